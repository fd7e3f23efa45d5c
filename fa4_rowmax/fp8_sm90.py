"""Host entry of the SM90 (Hopper) FP8 forward: validate, V^T pre-pass, compile (cached), launch.

    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90
    out, lse = flash_attn_fp8_sm90(q8, k8, v8, causal=True, softmax_mode="rowmax_h15",
                                   q_descale=d, k_descale=d, v_descale=d)

q, k, v: torch.float8_e4m3fn (batch, seqlen, heads, head_dim), head_dim 64 or 128, heads_q a multiple of
heads_kv (GQA), last dimension contiguous. Returns BF16 out (batch, seqlen_q, heads_q, head_dim) and fp32
lse (batch, heads_q, seqlen_q), natural log, of the logits softmax_scale * q_descale * k_descale * q.k.
Causal masking is bottom-right aligned (FA4's), per sequence. Forward only.

Varlen (FA4's `flash_attn_varlen_func` layout): q (total_q, heads, head_dim), k, v (total_k, heads_kv, head_dim)
with int32 cu_seqlens_q / cu_seqlens_k (batch + 1), optionally int32 seqused_q / seqused_k (batch); out
(total_q, heads_q, head_dim), lse (heads_q, total_q). The pre-pass gives each sequence its own V^T range (Note
[Varlen V^T], stage/v_transpose.py).
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass

import torch

from fa4_rowmax.config import FP8_MAX_OFFSET, KERNEL_MODES, LOG2_ROUND_UP
from fa4_rowmax.stage.softmax_sm90_fp8 import (
    CLAMPS,
    E4M3_MAX,
    PV_ACCUMULATIONS,
    ROW_SUM_COLUMNS,
    Fp8Stage,
)

# The FP8 forward implements exact and rowmax_h15 of the FA4 stage's modes (rowmax_pot is refused here).
SOFTMAX_MODES = tuple(m for m in KERNEL_MODES if m != "rowmax_pot")
HEAD_DIMS = (64, 128)
TILE_NS = (128, 160, 192, 224)
# Note [MMA row sum at long rows]
# With row_sum="mma" the row sum is a column of the PV GEMM, summed in Hopper's FP8 accumulator, which keeps
# about 13 fraction bits and truncates (Note [Row sum by the MMA]). With pv_accumulation="single" the running
# sum is the accumulator's C operand: over L keys the sum of positive weights loses up to ceil(L / 32) * 34 *
# 2^-13 of itself, a worst case that grows with L. On the H200 the shared benchmark's gate failed it at 8K keys
# non-causal (output error 0.15 exact / 0.25 H15 against fp32 attention, 0.32 at 16K), while the GPU tests, whose
# bounds carry that accumulation term, pass it up to 2,048 keys; so single-level refuses it beyond that length.
# With pv_accumulation="two_level" the truncation acts on one tile's sum and the tiles add in fp32 (Note
# [Two-level P.V accumulation]): no length limit.
MMA_ROW_SUM_MAX_KEYS = 2048  # multiples of 32: the e4m3 wgmma K
# FA4's varlen arguments this forward takes (with cu_seqlens_q and cu_seqlens_k; Note [Varlen host checks]).
VARLEN_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")


@dataclass(frozen=True)
class KernelConfig:
    """One compiled kernel: every field joins the compile-cache key."""

    head_dim: int
    qhead_per_kvhead: int
    causal: bool
    stage: Fp8Stage
    tile_m: int = 128
    tile_n: int = 128
    num_stages: int = 2
    varlen: bool = False  # q, k, v packed, with cu_seqlens_q / cu_seqlens_k
    seqused_q: bool = False
    seqused_k: bool = False

    @property
    def pack_gqa(self) -> bool:
        # Note [GQA packing on FP8]: the Q heads of one KV head share its K/V tiles in one 128-row Q tile when
        # the ratio divides tile_m (FA4 then loads the packed Q by TMA); other ratios (Qwen2.5: 7, 6) run one
        # Q head per work tile, K/V head = Q head // ratio, as FA4 does without packing. Values are the same.
        return self.qhead_per_kvhead > 1 and self.tile_m % self.qhead_per_kvhead == 0


_LAYOUTS = {4: "(batch, seqlen, heads, head_dim)", 3: "(total, heads, head_dim) with cu_seqlens (varlen)"}


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.float8_e5m2:
        raise ValueError(
            f"{name} must be torch.float8_e4m3fn: e5m2 inputs are not implemented on the SM90 FP8 path "
            "(docs/fp8_sm90.md, 'e5m2 inputs'), got torch.float8_e5m2"
        )
    if t.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} must be torch.float8_e4m3fn, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {_LAYOUTS[ndim]}, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def _check_descale(name: str, d, batch: int, heads_kv: int, device) -> torch.Tensor | None:
    if d is None:
        return None
    if not isinstance(d, torch.Tensor) or d.dtype != torch.float32 or tuple(d.shape) != (batch, heads_kv):
        got = f"{d.dtype} {tuple(d.shape)}" if isinstance(d, torch.Tensor) else type(d).__name__
        raise ValueError(
            f"{name} must be None or a torch.float32 tensor of shape (batch, heads_kv) = "
            f"({batch}, {heads_kv}), got {got}"
        )
    if d.device != device:
        raise ValueError(f"{name} must be on {device}, got {d.device}")
    return d.contiguous()


# Note [Varlen host checks]
# The varlen layout needs cu_seqlens_q and cu_seqlens_k together (seqused_q / seqused_k only with them; dense
# calls with seqused or one packed side have no GPU test here, so they are refused). Shapes, dtypes and devices
# are checked for free. The offsets' contents (start at 0, never decrease, end at q's / k's token count;
# 0 <= seqused <= the sequence's length) are checked with `validate=True`, by one host read of these few
# int32s: one sync per call, and no CUDA-graph capture (refused with a ValueError while capturing).
# `validate=False` skips exactly those content checks, the only host read of GPU data, so the call is
# sync-free and capturable (as aiter_fused's varlen entry); the caller then guarantees them, or the pre-pass
# and the kernel read out of bounds. Neither the kernel nor the pre-pass needs max_seqlen_q/k: FA4's varlen
# scheduler sizes its grid from total_q, the pre-pass from V^T's columns (Note [Varlen V^T]), so they are not
# arguments here (FA4's flash_attn_varlen_func takes them and does not pass them on).


def _check_index(name: str, t, length: int, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (length,):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int32 tensor of shape ({length},), got {got}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, validate: bool) -> int:
    """The batch of a varlen call (Note [Varlen host checks]); q, k are 3-D already."""
    if not isinstance(validate, bool):
        raise ValueError(f"validate must be a bool, got {validate!r}")
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1:
        got = tuple(cu_seqlens_q.shape) if isinstance(cu_seqlens_q, torch.Tensor) else type(cu_seqlens_q).__name__
        raise ValueError(f"cu_seqlens_q must be an int32 tensor of shape (batch + 1,), got {got}")
    batch = cu_seqlens_q.numel() - 1
    for name, t, length in (
        ("cu_seqlens_q", cu_seqlens_q, batch + 1),
        ("cu_seqlens_k", cu_seqlens_k, batch + 1),
        ("seqused_q", seqused_q, batch),
        ("seqused_k", seqused_k, batch),
    ):
        if t is not None:
            _check_index(name, t, length, q.device)
    from flash_attn.cute.testing import is_fake_mode

    if not validate or is_fake_mode():
        return batch
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            "validate=True reads cu_seqlens_q/k (and seqused_q/k) on the host, which a CUDA-graph capture cannot; "
            "accepted while capturing: validate=False (Note [Varlen host checks])"
        )
    present = [t for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) if t is not None]
    values = torch.cat(present).tolist()  # the one host read
    cu = {"cu_seqlens_q": values[: batch + 1], "cu_seqlens_k": values[batch + 1 : 2 * batch + 2]}
    for (name, offsets), total, side in zip(cu.items(), (q.shape[0], k.shape[0]), ("q", "k")):
        if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
            shown = offsets if len(offsets) <= 9 else [*offsets[:4], "...", *offsets[-4:]]
            raise ValueError(
                f"{name} must start at 0, never decrease and end at {side}.shape[0] = {total} "
                f"(total_{side}); got {shown}"
            )
    rest = values[2 * batch + 2 :]
    for name, used, offsets in (
        ("seqused_q", seqused_q, cu["cu_seqlens_q"]),
        ("seqused_k", seqused_k, cu["cu_seqlens_k"]),
    ):
        if used is None:
            continue
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        counts, rest = rest[:batch], rest[batch:]
        bad = [i for i, (n, length) in enumerate(zip(counts, lengths)) if not 0 <= n <= length]
        if bad:
            i = bad[0]
            raise ValueError(
                f"{name} must lie in [0, the sequence's length]; got {name}[{i}] = {counts[i]} for a sequence of "
                f"{lengths[i]} ({len(bad)} of {batch} sequences out of range)"
            )
    return batch


def check_range_rule(softmax_mode: str, rescale_threshold: float) -> None:
    """Note [FP8 max_offset] (softmax_sm90_fp8.py): the largest weight must fit e4m3."""
    top = FP8_MAX_OFFSET + rescale_threshold + LOG2_ROUND_UP[softmax_mode]
    if top >= math.log2(E4M3_MAX):
        limit = math.log2(E4M3_MAX) - FP8_MAX_OFFSET - LOG2_ROUND_UP[softmax_mode]
        raise ValueError(
            f"rescale_threshold={rescale_threshold} with softmax_mode={softmax_mode!r} lets P reach "
            f"2**{top:.3f} > 448 (e4m3 max): max_offset {FP8_MAX_OFFSET} + rescale_threshold + round-up "
            f"{LOG2_ROUND_UP[softmax_mode]:.3f} must stay below log2(448) = {math.log2(E4M3_MAX):.3f}; "
            f"accepted: 0 <= rescale_threshold < {limit:.3f}"
        )


ANCHOR_ROUNDINGS = ("exact", "half_octave")
ROW_SUMS = ("fadd", "mma")


def resolve_stage(
    softmax_mode: str,
    rescale_threshold,
    beta,
    has_descale: bool,
    exp2_deleted: bool = False,
    anchor_rounding: str = "exact",
    row_sum: str = "fadd",
    rescale_vote: bool = False,
    clamp: str = "max",
    pv_accumulation: str = "two_level",
) -> Fp8Stage:
    if softmax_mode not in SOFTMAX_MODES:
        raise ValueError(f"softmax_mode must be one of {SOFTMAX_MODES} on the SM90 FP8 path, got {softmax_mode!r}")
    threshold = 0.0 if rescale_threshold is None else float(rescale_threshold)
    if not threshold >= 0.0:
        raise ValueError(f"rescale_threshold must be None or a float >= 0 (log2 units), got {rescale_threshold!r}")
    check_range_rule(softmax_mode, threshold)
    if exp2_deleted and softmax_mode != "exact":
        raise ValueError("exp2_deleted is a cost probe of softmax_mode='exact' only")
    # Note [beta on the FP8 exact twin] (softmax_sm90_fp8.py): the stage carries beta only for exact, in (0, 1].
    if beta is not None:
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be None or a number in [0, 1], got {beta!r}")
        if softmax_mode == "rowmax_h15" and beta != 1.0:
            raise ValueError(
                f"beta must be None or 1.0 with softmax_mode='rowmax_h15' on the SM90 FP8 path, got {beta!r}: every "
                "H15 weight is built by integer ops off the MUFU (Note [H15 e4m3 bytes by integer ops]), so there "
                "is no MUFU share to choose"
            )
        if exp2_deleted:
            raise ValueError(
                f"beta must be None with exp2_deleted=True, got {beta!r}: the probe computes no exp2 to move off "
                "the MUFU"
            )
        beta = float(beta) if softmax_mode == "exact" and beta > 0.0 else None
    if anchor_rounding not in ANCHOR_ROUNDINGS:
        raise ValueError(f"anchor_rounding must be one of {ANCHOR_ROUNDINGS}, got {anchor_rounding!r}")
    if anchor_rounding != "exact" and softmax_mode != "rowmax_h15":
        raise ValueError("anchor_rounding='half_octave' applies to softmax_mode='rowmax_h15' only")
    if row_sum not in ROW_SUMS:
        raise ValueError(f"row_sum must be one of {ROW_SUMS}, got {row_sum!r}")
    if not isinstance(rescale_vote, bool):
        raise ValueError(f"rescale_vote must be a bool, got {rescale_vote!r}")
    if clamp not in CLAMPS:
        raise ValueError(f"clamp must be one of {CLAMPS}, got {clamp!r}")
    if clamp == "sat" and (softmax_mode != "rowmax_h15" or anchor_rounding != "exact"):
        raise ValueError("clamp='sat' applies to softmax_mode='rowmax_h15' with anchor_rounding='exact' only")
    if pv_accumulation not in PV_ACCUMULATIONS:
        raise ValueError(f"pv_accumulation must be one of {PV_ACCUMULATIONS}, got {pv_accumulation!r}")
    if rescale_vote and pv_accumulation == "two_level":
        raise ValueError(
            "rescale_vote=True applies to pv_accumulation='single' only: two-level accumulation promotes every "
            "tile by an FFMA that carries the rescale, so there is no rescale to skip (Note [Two-level P.V "
            "accumulation])"
        )
    return Fp8Stage(
        mode=softmax_mode,
        rescale_threshold=threshold,
        beta=beta,
        exp2_deleted=exp2_deleted,
        has_descale=has_descale,
        anchor_rounding=anchor_rounding,
        row_sum=row_sum,
        rescale_vote=rescale_vote,
        clamp=clamp,
        pv_accumulation=pv_accumulation,
    )


_compile_cache: dict = {}


def _compile(config: KernelConfig, q, k, vt, out, lse, descale, index):
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor
    from flash_attn.cute.utils import AuxData

    from fa4_rowmax.stage.flash_fwd_sm90_fp8 import FlashAttentionForwardSm90Fp8

    kernel = FlashAttentionForwardSm90Fp8(
        config.head_dim,
        config.qhead_per_kvhead,
        is_causal=config.causal,
        pack_gqa=config.pack_gqa,
        stage=config.stage,
        tile_m=config.tile_m,
        tile_n=config.tile_n,
        num_stages=config.num_stages,
    )
    q_t, k_t = to_cute_tensor(q), to_cute_tensor(k)
    vt_t = to_cute_tensor(vt, leading_dim=0 if config.varlen else 1)  # the key mode
    o_t = to_cute_tensor(out)
    lse_t = to_cute_tensor(lse, assumed_align=4)
    aux = AuxData([to_cute_tensor(descale, assumed_align=4, leading_dim=2)], None) if descale is not None else AuxData()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        kernel,
        q_t,
        k_t,
        vt_t,
        o_t,
        lse_t,
        1.0,
        *(to_cute_tensor(t, assumed_align=4, leading_dim=0) if t is not None else None for t in index),
        None,  # page_table
        None,
        None,
        None,
        None,  # window left/right, learnable_sink, block sparsity
        aux,
        None,
        None,
        stream,
        options="--enable-tvm-ffi",
    )


def flash_attn_fp8_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    softmax_mode: str = "exact",
    rescale_threshold: float | None = None,
    beta: float | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    *,
    anchor_rounding: str = "exact",
    row_sum: str = "fadd",
    rescale_vote: bool = False,
    clamp: str = "max",
    pv_accumulation: str = "two_level",
    exp2_deleted: bool = False,
    tile_n: int = 128,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    validate: bool = True,
):
    """SM90 FP8 attention forward -> (out BF16, lse fp32).

    `beta` (exact: the share of exponentials built by FA4's polynomial off the MUFU, in [0, 1], None = 0;
    rowmax_h15: None or 1.0 only; Note [beta on the FP8 exact twin]). Levers (keyword-only), measured in
    docs/fp8_sm90.md:
    - `anchor_rounding="half_octave"` (rowmax_h15: Note [Folded H15 on FP8]; changes values);
    - `row_sum="mma"` (Note [Row sum by the MMA]);
    - `rescale_vote=True` (Note [Warp-vote rescale skip on FP8]);
    - `clamp="sat"` (rowmax_h15, exact anchor: Note [Clamp by saturation]; same values, one op less);
    - `tile_n` (keys per tile, a multiple of 32; 192 was the fastest measured on the H200);
    - `pv_accumulation` ("two_level": each tile's P V in a fresh accumulator, added into fp32 O, accurate at any
      length; "single": O is the FP8 MMA's accumulator, whose truncation grows O's error with the key count;
      Note [Two-level P.V accumulation]).
    `exp2_deleted=True` is a cost probe (exact without exp2: wrong values).

    Varlen (keyword-only, module docstring): `cu_seqlens_q`, `cu_seqlens_k` (int32, batch + 1), `seqused_q`,
    `seqused_k` (int32, batch: the rows / keys used of each sequence; rows past seqused_q are not written, as
    in FA4); `validate=False` skips the one host read that checks their contents (Note [Varlen host checks]).
    """
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must be given together on the SM90 FP8 path (q, k and v packed); "
            f"got cu_seqlens_q {'set' if varlen else 'None'}, cu_seqlens_k {'None' if varlen else 'set'}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3 if varlen else 4)
    if any(t.requires_grad for t in (q, k, v)):
        raise ValueError(
            "the SM90 FP8 forward is forward-only: q, k and v must not require grad (use torch.no_grad() or .detach())"
        )
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if varlen:
        (total_q, heads_q, head_dim), (total_k, heads_kv, head_dim_k) = q.shape, k.shape
        batch = _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, validate)
        if head_dim_k != head_dim:
            raise ValueError(f"k must be (total_k, heads_kv, head_dim={head_dim}), got {tuple(k.shape)}")
    else:
        for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if t is not None:
                raise ValueError(
                    f"{name} is accepted with cu_seqlens_q and cu_seqlens_k only on the SM90 FP8 path (varlen); "
                    f"got it with 4-D q, k, v (Note [Varlen host checks])"
                )
        batch, seqlen_q, heads_q, head_dim = q.shape
        batch_k, seqlen_k, heads_kv, head_dim_k = k.shape
        total_q, total_k = batch * seqlen_q, seqlen_k  # total_k: the most keys a row can see, as in varlen
        if batch_k != batch or head_dim_k != head_dim:
            raise ValueError(
                f"k must be (batch={batch}, seqlen_k, heads_kv, head_dim={head_dim}), got {tuple(k.shape)}"
            )
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} on the SM90 FP8 path, got {head_dim}")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads of q ({heads_q}) must be a multiple of heads of k and v ({heads_kv})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    descales = [
        _check_descale(n, d, batch, heads_kv, q.device)
        for n, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    ]
    has_descale = any(d is not None for d in descales)
    stage = resolve_stage(
        softmax_mode,
        rescale_threshold,
        beta,
        has_descale,
        exp2_deleted,
        anchor_rounding,
        row_sum,
        rescale_vote,
        clamp,
        pv_accumulation,
    )
    if tile_n not in TILE_NS:
        raise ValueError(f"tile_n must be one of {TILE_NS}, got {tile_n!r}")
    if stage.row_sum == "mma" and stage.pv_accumulation == "single" and total_k > MMA_ROW_SUM_MAX_KEYS:
        what = "total_k (varlen: the bound on every sequence's keys)" if varlen else "seqlen_k"
        raise ValueError(
            f"row_sum='mma' with pv_accumulation='single' is accepted for {what} <= {MMA_ROW_SUM_MAX_KEYS} only "
            f"(Note [MMA row sum at long rows]); got {what.split()[0]} {total_k}: use row_sum='fadd' or "
            "pv_accumulation='two_level'"
        )
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    config = KernelConfig(
        head_dim=head_dim,
        qhead_per_kvhead=heads_q // heads_kv,
        causal=bool(causal),
        stage=stage,
        tile_n=tile_n,
        varlen=varlen,
        seqused_q=seqused_q is not None,
        seqused_k=seqused_k is not None,
    )

    from flash_attn.cute.testing import is_fake_mode

    row_sum_rows = ROW_SUM_COLUMNS if stage.row_sum == "mma" else 0
    # Note [Row sum by the MMA]: the kernel's O tile has head_dim + 8 columns; its TMA store clips the 8 row-sum
    # columns at out's last dimension, so out stays a contiguous tensor of q's shape.
    out = torch.empty(*q.shape[:-1], head_dim, dtype=torch.bfloat16, device=q.device)
    lse_shape = (heads_q, total_q) if varlen else (batch, heads_q, seqlen_q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if total_q == 0 or total_k == 0:  # FA4's rule (_flash_attn_fwd): no rows, or no key for any row
        return out.zero_(), lse.fill_(-math.inf)
    index = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    fake = is_fake_mode()
    if fake:
        from fa4_rowmax.stage.v_transpose import padded_keys, varlen_vt_start

        rows = head_dim + row_sum_rows
        if varlen:
            columns = varlen_vt_start(total_k, batch, tile_n)
            vt = torch.empty(heads_kv, rows, columns, dtype=v.dtype, device=v.device).permute(2, 0, 1)
        else:
            keys_padded = padded_keys(seqlen_k)
            vt = torch.empty(batch, heads_kv, rows, keys_padded, dtype=v.dtype, device=v.device).permute(0, 3, 1, 2)
        descale = torch.empty(batch, heads_kv, 2, dtype=torch.float32, device=q.device) if has_descale else None
    elif varlen:
        from fa4_rowmax.stage.v_transpose import v_transpose_varlen

        vt, descale = v_transpose_varlen(v, cu_seqlens_k, tile_n, *descales, row_sum_rows=row_sum_rows)
    else:
        from fa4_rowmax.stage.v_transpose import v_transpose

        vt, descale = v_transpose(v, *descales, row_sum_rows=row_sum_rows)
    if config not in _compile_cache:
        _compile_cache[config] = _compile(config, q, k, vt, out, lse, descale, index)
    if fake:
        return out, lse
    from flash_attn.cute.utils import AuxData

    aux = AuxData([descale], None) if descale is not None else AuxData()
    q_u8, k_u8, vt_u8 = (t.view(torch.uint8) for t in (q, k, vt))
    _compile_cache[config](
        q_u8,
        k_u8,
        vt_u8,
        out,
        lse,
        float(softmax_scale),
        *index,
        None,
        None,
        None,
        None,
        None,
        aux,
        None,
        None,
    )
    return out, lse


def fp8_backend(softmax_mode: str = "rowmax_h15", **levers):
    """A gate backend (fa4_rowmax/gates): `(q, k, v, causal) -> (out, lse)` through `flash_attn_fp8_sm90` with
    e4m3 q, k, v, under `torch.no_grad()` (the forward refuses tensors that require grad). `levers` are
    `flash_attn_fp8_sm90`'s keywords (rescale_threshold, anchor_rounding, row_sum, rescale_vote, clamp, tile_n,
    ...); unknown names and modes raise here, not at the first call."""
    if softmax_mode not in SOFTMAX_MODES:
        raise ValueError(f"softmax_mode must be one of {SOFTMAX_MODES} on the SM90 FP8 path, got {softmax_mode!r}")
    fixed = {"q", "k", "v", "causal", "softmax_mode", *VARLEN_ARGS, "validate"}
    accepted = set(inspect.signature(flash_attn_fp8_sm90).parameters) - fixed
    unknown = sorted(set(levers) - accepted)
    if unknown:
        raise TypeError(f"fp8_backend: unknown levers {unknown}; accepted: {sorted(accepted)}")

    def backend(q, k, v, causal):
        with torch.no_grad():
            return flash_attn_fp8_sm90(q, k, v, causal=causal, softmax_mode=softmax_mode, **levers)

    return backend


def fa4_sm90_fp8_forward(
    q,
    k,
    v,
    *,
    softmax_scale,
    causal,
    softmax_stage,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out=None,
    lse=None,
    features: dict | None = None,
):
    """Routing entry for FA4's `_flash_attn_fwd` on SM90 with FP8 inputs; returns its 5-tuple (out, lse, None,
    None, None). `softmax_stage` is `fa4_rowmax.interface.SoftmaxStage` or None (exact); `features` maps FA4
    argument names to their values, each refused unless stock (interface.FEATURE_STOCK_VALUES) or one of
    VARLEN_ARGS (`flash_attn_varlen_func`'s, passed on to `flash_attn_fp8_sm90`, which checks them)."""
    from fa4_rowmax.interface import refuse_untested_features

    features = features or {}
    refuse_untested_features(
        features, where="by the SM90 FP8 forward (fa4_rowmax.fp8_sm90)", accepted="", tested=VARLEN_ARGS
    )
    knobs = {}
    mode = "exact"
    if softmax_stage is not None:
        mode = softmax_stage.mode
        knobs = dict(
            rescale_threshold=softmax_stage.rescale_threshold,
            beta=softmax_stage.beta,
            anchor_rounding=softmax_stage.anchor_rounding,
            rescale_vote=softmax_stage.rescale_vote,
        )
    result_out, result_lse = flash_attn_fp8_sm90(
        q,
        k,
        v,
        softmax_scale,
        causal,
        mode,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        **{name: features.get(name) for name in VARLEN_ARGS},
        **knobs,
    )
    if out is not None:
        out.copy_(result_out)
        result_out = out
    if lse is not None:
        lse.copy_(result_lse)
        result_lse = lse
    return result_out, result_lse, None, None, None
