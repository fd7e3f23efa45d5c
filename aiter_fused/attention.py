"""Host entry points of the Fused-Softmax Triton kernel: checks, MX operand quantization, launch.

``fused_softmax_attention`` (dense, FlashAttention layout) and ``fused_softmax_attention_varlen``
(packed sequences). BF16 in, BF16 out, LSE float32 (natural log). The numerics are
``fa4_rowmax.reference.fused_softmax``'s (``fused_softmax_attention_reference``); ``exact=True`` runs the
same kernel with online softmax, exact exp2 and unquantized BF16 operands (``mx_format`` is then
checked but not used).

Q and K are MX-quantized along head_dim and V along keys (per sequence) before the launch, by the
Triton kernels of ``quantize.py`` (bit-exact to ``fa4_rowmax.reference.mx``), into e4m3-container elements
(``torch.float8_e4m3fn``) and E8M0 bytes (uint8); P is quantized inside the kernel. ``dot_mode``
picks how the kernel multiplies them (Note [MX dots, per architecture] in
``kernel.py``): ``"scaled"`` (native MX dots: gfx950, NVIDIA capability >= 10), ``"fp8"`` (Hopper's
FP8 tensor cores, block scales outside 32-wide dots; the default on capability 9.x) or ``"bf16"``
(exactly dequantized BF16 dots: the default elsewhere, and the fallback). For ``"fp8"`` V's elements
are stored transposed (keys contiguous).

Host synchronisation: nothing here reads a GPU tensor back, except the varlen entry's checks of the
contents of ``cu_seqlens_q``/``cu_seqlens_k`` with ``validate=True`` (one sync per call, and it breaks
CUDA-graph capture); callers that already know their offsets are well formed pass ``validate=False``.

On a CPU tensor the kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
``triton`` is imported): that is how the tests run it without a GPU.
"""

import dataclasses
import math
import numbers
import os
from typing import Optional

import torch

from aiter_fused.launch import Launch, launch_for
from fa4_rowmax.config import check_real
from fa4_rowmax.reference.fused_softmax import (
    check_mx_format,
    check_recovery_threshold,
    folded_q_prescale,
    operand_element_format,
    p_element_format,
)
from fa4_rowmax.reference.mx import ELEMENT_FORMATS

__all__ = [
    "fused_softmax_attention",
    "fused_softmax_attention_varlen",
    "DOT_MODES",
    "HEAD_DIMS",
    "ROW_SUMS",
    "EXP_FOLD_DOT_MODES",
    "TILE_SIZES",
]

HEAD_DIMS = (32, 64, 128, 256)
TILE_SIZES = (32, 64, 128)
DOT_MODES = ("bf16", "fp8", "scaled")
_SOFTMAX_SCALES = "None (head_dim**-0.5) or a finite number > 0"
ROW_SUMS = ("reduce", "gemm")  # Note [Row sum by GEMM] in kernel.py
ROW_SUM_GEMM_DOT_MODES = ("bf16", "scaled")
EXP_FOLD_DOT_MODES = ("bf16", "scaled")  # Note [Folded Schraudolph] in kernel.py


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_tensors(q, k, v, rank: int, layout: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16 (BF16 in, BF16 out); got {t.dtype}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}; got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {t.device}")
    if q.device.type == "cpu" and not _interpreting():
        raise ValueError("q, k, v must be on a GPU, or on the CPU with TRITON_INTERPRET=1 (Triton's interpreter)")
    head_dim = q.shape[-1]
    if head_dim not in HEAD_DIMS or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(
            f"head_dim of q, k and v must be equal and one of {HEAD_DIMS}; got "
            f"{q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}"
        )
    heads_q, heads_k = q.shape[-2], k.shape[-2]
    if v.shape[-2] != heads_k or heads_k == 0 or heads_q % heads_k:
        raise ValueError(
            f"heads of q ({heads_q}) must be a multiple of the heads of k and v ({heads_k}, {v.shape[-2]}, equal)"
        )


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False); got {value!r} ({type(value).__name__})")


def _check_extent(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0; got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0; got {value}")
    return int(value)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied when its last dimension is not contiguous (Note [Operand layouts])."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _default_dot_mode(arch: str) -> str:
    """Native MX dots ("scaled") on gfx950 (MI350/MI355) and NVIDIA compute capability >= 10; FP8 dots
    on capability 9.x (Hopper); BF16 dots on exactly dequantized operands elsewhere, the interpreter
    included (see Note [MX dots, per architecture]). ``arch`` is ``launch.arch_of``'s name."""
    if arch == "gfx950" or (arch.startswith("sm") and int(arch[2:-1]) >= 10):
        return "scaled"
    return "fp8" if arch.startswith("sm9") else "bf16"


def _operand_format(mx_format: str, exact: bool, dot_mode: str) -> str:
    """The Q/K/V format the kernel's "scaled" dots take (Note [MX dots, per architecture]): packed e2m1
    for MXFP4, the e4m3 container otherwise (and in every other mode)."""
    if not exact and dot_mode == "scaled" and operand_element_format(mx_format) == "e2m1":
        return "e2m1"
    return "e4m3"


def _check_dot_mode(dot_mode) -> None:
    if dot_mode is not None and dot_mode not in DOT_MODES:
        raise ValueError(f"dot_mode must be None (by architecture) or one of {DOT_MODES}; got {dot_mode!r}")


def _check_row_sum(row_sum, exact: bool, dot_mode: str) -> None:
    """``row_sum="gemm"`` (Note [Row sum by GEMM] in ``kernel.py``) is the MX modes' whose P@V is one GEMM per
    tile: "bf16" and "scaled"; not the exact twin (its row sum is of fp32 P, its P@V of BF16 P) nor "fp8"."""
    if row_sum not in ROW_SUMS:
        raise ValueError(f"row_sum must be one of {ROW_SUMS}; got {row_sum!r}")
    if row_sum == "gemm" and (exact or dot_mode not in ROW_SUM_GEMM_DOT_MODES):
        raise ValueError(
            f'row_sum="gemm" takes the MX dot modes {ROW_SUM_GEMM_DOT_MODES}; got '
            f"{'exact=True' if exact else f'dot_mode={dot_mode!r}'}"
        )


# Note [exp_fold on GPUs]: exp_fold=True runs wherever the unfolded kernel does. The one GPU fault seen with it
# ("bf16", tile 64, head dim 32) is the unfolded kernel's: at that launch "bf16" and "scaled" fault or go wrong
# with the fold off as well (studies/aiter_h200_fault/), so on sm90 head dim 32 at tiles 64 and 128 is refused for
# both modes (Note [sm90 refusals] in launch.py). Where the kernel runs, the fold matches its reference on the H200:
# dense, causal, GQA, MXFP8/6/4, "bf16" and "scaled", both row sums, varlen with empty and fully masked rows, NaN
# inputs, and extreme scores at head dim 64 (docs/ledger/aiter.md).


def _check_exp_fold(exp_fold, exact: bool, dot_mode: str) -> None:
    """``exp_fold=True`` (Note [Folded Schraudolph] in ``kernel.py``) needs a score dot with an fp32 accumulator
    to start from the addend, and Schraudolph P: "bf16" and "scaled"; not "fp8" (per-chunk FP8 dots combined
    outside the MMA) nor the exact twin (exact exp2). Its GPU record: Note [exp_fold on GPUs]."""
    if not isinstance(exp_fold, bool):
        raise TypeError(f"exp_fold must be a bool; got {type(exp_fold).__name__}")
    if exp_fold and (exact or dot_mode not in EXP_FOLD_DOT_MODES):
        raise ValueError(
            f"exp_fold=True takes the MX dot modes {EXP_FOLD_DOT_MODES}; got "
            f"{'exact=True' if exact else f'dot_mode={dot_mode!r}'}"
        )


# Note [Operand layouts]: the kernel takes the token and head strides of q, k and out and steps their head_dim
# by one element; only v's head_dim stride is passed (the "fp8" dots' V is stored keys-contiguous). So q and k are
# copied when their last dimension is not contiguous (free otherwise; the MX quantizers read any strides, the exact
# twin reads q and k directly) and out is allocated contiguous, whatever q's layout (``torch.empty_like`` would copy
# a transposed q's strides). AITER's override reaches this entry through ``torch.ops.aiter_fused``.
#
# Note [Empty inputs]: as FA4's interface does, no query (batch 0, seqlen_q 0, heads_q 0, total_q 0) or no key
# (seqlen_k 0, total_k 0) returns out 0 and LSE -inf in the shapes of a non-empty call, without a launch, after
# every argument check (an empty call is not a way around them).


def _launch(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    causal,
    softmax_scale,
    mx_format,
    exact,
    recovery_threshold,
    tile_n,
    dot_mode,
    return_recoveries,
    launch,
    row_sum,
    exp_fold,
):
    """Varlen launch. Returns out (total_q, heads_q, head_dim), lse (heads_q, total_q), recoveries."""
    import triton
    import triton.language as tl

    from aiter_fused.kernel import _fused_softmax_attn_fwd
    from aiter_fused.quantize import check_fits_e4m3, quantize_head_dim, quantize_keys

    check_mx_format(mx_format)
    recovery_threshold = check_recovery_threshold(recovery_threshold)
    _check_flag("causal", causal)
    _check_flag("exact", exact)
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    elif check_real("softmax_scale", softmax_scale, 0.0, accepted=_SOFTMAX_SCALES) == 0.0:
        raise ValueError(f"softmax_scale must be {_SOFTMAX_SCALES}; got {softmax_scale!r}")
    softmax_scale = float(softmax_scale)
    _check_dot_mode(dot_mode)
    if launch is not None and not isinstance(launch, Launch):
        raise TypeError(f"launch must be None (the launch table's) or an aiter_fused.launch.Launch; got {launch!r}")
    arch, table_launch = launch_for(q.device)  # Note [Launch table]
    if launch is None:
        launch = table_launch
    else:  # a caller's launch: the architecture's dot modes and inherited refusals still hold (Note [sm90 refusals])
        inherited = tuple(r for r in table_launch.refusals if r.inherited and r not in launch.refusals)
        dot_modes = tuple(m for m in launch.dot_modes if m in table_launch.dot_modes)
        launch = dataclasses.replace(launch, refusals=launch.refusals + inherited, dot_modes=dot_modes)
    dot_mode = _default_dot_mode(arch) if dot_mode is None else dot_mode
    if dot_mode not in launch.dot_modes:
        raise ValueError(f"dot_mode={dot_mode!r} does not compile for {arch}; accepted there: {launch.dot_modes}")
    _check_row_sum(row_sum, exact, dot_mode)
    _check_exp_fold(exp_fold, exact, dot_mode)
    tile_n = launch.tile_n if tile_n is None else tile_n
    if isinstance(tile_n, bool) or not isinstance(tile_n, numbers.Integral) or tile_n not in TILE_SIZES:
        raise ValueError(f"tile_n must be None (by architecture) or one of {TILE_SIZES} (an int); got {tile_n!r}")
    tile_n = int(tile_n)
    kernel = "exact" if exact else dot_mode
    refusal = launch.refusal(head_dim, tile_n, kernel)
    if refusal is not None:  # Note [sm90 refusals] in launch.py
        accepted = [t for t in TILE_SIZES if launch.refusal(head_dim, t, kernel) is None]
        raise ValueError(
            f"{'the exact twin' if exact else f'dot_mode={dot_mode!r}'} at head_dim={head_dim} with tile_n={tile_n} "
            f"is refused on {arch}: {refusal.why}; accepted tile_n there: {accepted}"
        )

    batch = cu_seqlens_q.numel() - 1
    heads_q, heads_k = q.shape[1], k.shape[1]
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)  # Note [Operand layouts]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(heads_q, q.shape[0], dtype=torch.float32, device=q.device)
    recoveries = torch.zeros(heads_q, q.shape[0], dtype=torch.int32, device=q.device)
    if out.numel() == 0 or k.shape[0] == 0:  # Note [Empty inputs]
        return out.zero_(), lse.fill_(-math.inf), recoveries
    operand_format = _operand_format(mx_format, exact, dot_mode)
    if exact:
        q_in, k_in, v_in = q, k, v
        q_scale = k_scale = v_scale = torch.zeros(1, 1, 1, dtype=torch.uint8, device=q.device)
        cu_blocks = torch.zeros_like(cu_seqlens_k)
    else:
        fmt = operand_element_format(mx_format)
        check_fits_e4m3(fmt)
        check_fits_e4m3(p_element_format(mx_format))
        packed = operand_format == "e2m1"
        q_prescale = folded_q_prescale(softmax_scale) if exp_fold else None  # Note [Folded Schraudolph]
        q_scale, q_in = quantize_head_dim(q, fmt, pack_e2m1=packed, prescale=q_prescale)
        k_scale, k_in = quantize_head_dim(k, fmt, pack_e2m1=packed)
        v_in, v_scale, cu_blocks = quantize_keys(
            v, fmt, cu_seqlens_k, keys_contiguous=dot_mode == "fp8", pack_e2m1=packed
        )
    p_spec = ELEMENT_FORMATS[p_element_format(mx_format)]
    p_max_bits = torch.tensor(p_spec.max_normal, dtype=torch.float32).view(torch.int32).item()

    block_m = launch.block_m
    longest_stride = max(k_in.stride(0), v_in.stride(0))
    if exact and launch.kv_tile_offsets and longest_stride * tile_n >= 2**31 > longest_stride:  # Note [KV addresses]
        raise ValueError(
            f"with exact=True, the k and v token strides times tile_n must stay below 2**31 (int32 tile "
            f"offsets); got {longest_stride} * {tile_n}"
        )
    grid = (triton.cdiv(max_seqlen_q, block_m), batch, heads_q)
    _fused_softmax_attn_fwd[grid](
        q_in,
        k_in,
        v_in,
        q_scale,
        k_scale,
        v_scale,
        out,
        lse,
        recoveries,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_blocks,
        q_in.stride(0),
        q_in.stride(1),
        k_in.stride(0),
        k_in.stride(1),
        v_in.stride(0),
        v_in.stride(1),
        v_in.stride(2),
        q_scale.stride(0),
        q_scale.stride(1),
        k_scale.stride(0),
        k_scale.stride(1),
        v_scale.stride(0),
        v_scale.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        softmax_scale * math.log2(math.e),
        recovery_threshold,
        GROUP=heads_q // heads_k,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=tile_n,
        CAUSAL=causal,
        EXACT=exact,
        DOT_MODE=dot_mode,
        OPERAND_FORMAT=operand_format,
        RETURN_RECOVERIES=return_recoveries,
        KV_TILE_OFFSETS=launch.kv_tile_offsets,
        ROW_SUM_GEMM=row_sum == "gemm",
        EXP_FOLD=exp_fold,
        P_CONVERT="software",  # the only one that runs ("hardware": compile_check's audit, never launched)
        DOT_DTYPE=tl.float32 if q.device.type == "cpu" else tl.bfloat16,
        P_MANTISSA=p_spec.mantissa_bits,
        P_MIN_EXPONENT=p_spec.min_normal_exponent,
        P_MAX_NORMAL=p_spec.max_normal,
        P_MAX_MANTISSA_BITS=p_max_bits & 0x7FFFFF,
        P_MAX_EXPONENT=((p_max_bits >> 23) & 0xFF) - 127,
        **launch.options(arch),
    )
    return out, lse, recoveries


def fused_softmax_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    mx_format: str = "mxfp8",
    exact: bool = False,
    recovery_threshold: float = 8.0,
    return_lse: bool = True,
    tile_n: Optional[int] = None,
    dot_mode: Optional[str] = None,
    return_recoveries: bool = False,
    launch: Optional[Launch] = None,
    row_sum: str = "reduce",
    exp_fold: bool = False,
):
    """Fused-Softmax attention forward. q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k,
    heads_k, head_dim), BF16, head_dim in ``HEAD_DIMS``, heads_q a multiple of heads_k (GQA); causal
    masks aligned bottom-right. Returns ``(out, lse)`` (lse float32 (batch, heads_q, seqlen_q), natural
    log), or ``out`` alone with ``return_lse=False``; with ``return_recoveries=True`` a third tensor
    (int32, like lse) counts the recoveries per row. ``tile_n`` is the KV tile (the frozen max comes
    from the first one; None: the launch table's, 64 on gfx950/gfx942 and 128 elsewhere, Note [Launch
    table] in ``launch.py``); ``dot_mode`` picks the dot strategy, one of ``DOT_MODES`` (None: by
    architecture; see the module docstring); ``launch`` replaces the launch table's entry for this call
    (tuning: ``studies/aiter_h200_tune/tune.py``; its ``block_m``, ``num_warps`` and ``num_stages`` change no
    value, its ``tile_n`` is the default tile); ``row_sum``: one of ``ROW_SUMS``, "reduce" (a row reduction of
    P) or "gemm" (a matrix multiply of the P that enters P@V, dot modes "bf16" and "scaled": Note [Row sum by
    GEMM] in ``kernel.py``); ``exp_fold=True``: the frozen max and the Schraudolph map folded into the score GEMM,
    Q quantized after a prescale by ``128 * softmax_scale * log2 e`` (dot modes "bf16" and "scaled": Note
    [Folded Schraudolph] in ``kernel.py``; the reference's ``exp_fold``)."""
    _check_tensors(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    _check_flag("return_lse", return_lse)
    _check_flag("return_recoveries", return_recoveries)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    if k.shape[0] != batch or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"k and v must have shape (batch={batch}, seqlen_k, heads_k, head_dim) alike; got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q
    cu_k = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_k
    out, lse, recoveries = _launch(
        q.reshape(batch * seqlen_q, heads_q, head_dim),
        k.reshape(batch * seqlen_k, k.shape[2], head_dim),
        v.reshape(batch * seqlen_k, v.shape[2], head_dim),
        cu_q,
        cu_k,
        seqlen_q,
        causal,
        softmax_scale,
        mx_format,
        exact,
        recovery_threshold,
        tile_n,
        dot_mode,
        return_recoveries,
        launch,
        row_sum,
        exp_fold,
    )
    out = out.reshape(batch, seqlen_q, heads_q, head_dim)
    lse = lse.reshape(heads_q, batch, seqlen_q).transpose(0, 1).contiguous()
    result = (out, lse) if return_lse else (out,)
    if return_recoveries:
        result += (recoveries.reshape(heads_q, batch, seqlen_q).transpose(0, 1).contiguous(),)
    return result if len(result) > 1 else result[0]


def fused_softmax_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    mx_format: str = "mxfp8",
    exact: bool = False,
    recovery_threshold: float = 8.0,
    return_lse: bool = True,
    tile_n: Optional[int] = None,
    dot_mode: Optional[str] = None,
    return_recoveries: bool = False,
    validate: bool = True,
    launch: Optional[Launch] = None,
    row_sum: str = "reduce",
    exp_fold: bool = False,
):
    """Varlen twin: q (total_q, heads_q, head_dim), k/v (total_k, heads_k, head_dim), int32 cu_seqlens
    (batch + 1) on q's device. Returns out like q and lse float32 (heads_q, total_q) (and recoveries
    like lse with ``return_recoveries=True``). ``max_seqlen_k`` is accepted for FlashAttention's
    signature; the kernel reads the key lengths from ``cu_seqlens_k``. ``launch``, ``row_sum`` and
    ``exp_fold`` as in ``fused_softmax_attention``.

    ``validate=True`` checks the offsets' contents (start at 0, never decrease, end at the token
    counts, no query sequence longer than ``max_seqlen_q``): a host read of GPU data, so one sync per
    call and no CUDA-graph capture. ``validate=False`` skips exactly those checks (shapes, dtypes and
    devices are still checked, for free); the caller then guarantees them, or the kernel reads out of
    bounds (bad offsets) or leaves rows unwritten (``max_seqlen_q`` too small)."""
    _check_tensors(q, k, v, 3, "(total_tokens, heads, head_dim)")
    for flag, value in (("return_lse", return_lse), ("return_recoveries", return_recoveries), ("validate", validate)):
        _check_flag(flag, value)
    max_seqlen_q = _check_extent("max_seqlen_q", max_seqlen_q)
    _check_extent("max_seqlen_k", max_seqlen_k)
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise TypeError(f"{name} must be a 1-D int32 tensor of batch + 1 >= 2 offsets")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {cu.device}")
        if validate and (int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any())):
            raise ValueError(f"{name} must start at 0, never decrease and end at {total}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)")
    if validate:
        longest_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        if longest_q > max_seqlen_q:
            raise ValueError(f"max_seqlen_q ({max_seqlen_q}) is below the longest query sequence ({longest_q})")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must have the same number of tokens; got {k.shape[0]} and {v.shape[0]}")
    out, lse, recoveries = _launch(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        causal,
        softmax_scale,
        mx_format,
        exact,
        recovery_threshold,
        tile_n,
        dot_mode,
        return_recoveries,
        launch,
        row_sum,
        exp_fold,
    )
    result = (out, lse) if return_lse else (out,)
    if return_recoveries:
        result += (recoveries,)
    return result if len(result) > 1 else result[0]
