"""Semantic reference for attention with an approximate softmax: what a kernel must compute.

`attention_reference` runs the tiled online softmax the kernels run, KV tile by KV tile,
with each mode's rules for the running max, the weights P and the row sum (docs/design.md,
"Mode semantics"). It is pure torch, one code path for CPU and CUDA tensors, vectorised
over batch, heads and query rows; the only Python loop is over KV tiles.

Note [Tile order]
~~~~~~~~~~~~~~~~~
KV tiles start at multiples of `tile_n` from each sequence's first key. FA4 (SM90 and SM100)
walks them from the last to the first (`n_block = n_block_max - 1 - i`), so the modes that
model FA4 (`exact`, `rowmax_h15`, `rowmax_pot`) do the same: under causal masking the first
tile a row sees is its diagonal tile, which matters for the stale max and the H15 lattice.
BAPS takes its critical tiles B0 from the start of the sequence and Fused-Softmax freezes the
max of the first tile; both walk the tiles first to last. A tile in which a row has no key
leaves that row's state untouched, whatever the order.

Note [FA4 running max and rescale_threshold]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Reproduces `SoftmaxSm100.update_row_max` of flash-attn-4 4.0.0b36. The max `m` is kept in
score units (before `scale_log2`). Per tile: `m_new = max(m_old, rowmax(s))`,
`m_safe = m_new` (0 when -inf), `acc_scale_ = (m_old - m_safe) * scale_log2`; when
`rescale_threshold > 0` and `acc_scale_ >= -rescale_threshold` the old max stays and
nothing is rescaled, otherwise O and the row sum are scaled by `exp2(acc_scale_)` (0 on the
first tile with a key, where `m_old = -inf`). The weights use
`y = s * scale_log2 + (max_offset - m * scale_log2)`, the kernel's expression, so with a
stale max y reaches `max_offset + rescale_threshold`. The kernel evaluates it as one FFMA
(one rounding) on scores from its own GEMM; here it is a multiply and an add. y can differ
by an ulp, which now and then moves an element across an H15/PoT rounding boundary: a
kernel-vs-reference comparison must allow such rare half-octave (PoT: octave) flips. The LSE is
`(m * scale_log2 + log2(row_sum) - max_offset) * ln 2` with the max actually used.

Note [Weights per mode]
~~~~~~~~~~~~~~~~~~~~~~~
- `exact`: `P = exp2(y)`.
- `rowmax_h15`: `P = h15_bits(y)` (`exp_approx`): H on the lattice anchored at the max;
  the -127 clamp makes masked scores give exactly 0.
- `rowmax_pot`: `P = 2**max_offset * pot(y - max_offset, pot_k_max)`: `K_max` counts octaves
  below the max; masked elements are set to 0 (the clamp alone would give 2**-K_max).
With `anchor_rounding="half_octave"` (rowmax_h15) the anchor is not `m * scale_log2` but
`a = C - fl32(C - m * scale_log2)` with `C = 1.5 * 2**22`, the half octave nearest to it (ties to even;
what the SM90 folded FFMA's fp32 addend holds): weights use `y = s * scale_log2 - a`, the rescale
factor is `exp2(a_old - a_new)` and the LSE uses `a`.
With `anchor="row"` a first pass finds each row's max over all its keys and every tile uses
it (no rescale ever): the control that separates the lattice anchor from the tile schedule.
P is rounded to `p_dtype` (FP8 saturating, as `cvt.rn.satfinite` does) only for P@V; the
row sum adds the float P before that rounding (FA4's order), except for `rowmax_h15` with an FP8
`p_dtype` (Note [H15 with FP8 P]) and with `row_sum="mma"` (Note [Row sum by the MMA in the reference]).

Note [H15 with FP8 P]
~~~~~~~~~~~~~~~~~~~~~
An FP8 Rowmax-H15 kernel builds P's bytes from the half-octave index with integer ops
(`exp_approx`, Note [H15 weights as e4m3 bytes]); no float P exists. The reference defines exactly
that: P = H(y) where H(y) is at least the P dtype's smallest normal (e4m3: 2^-6, which with FA4's
max_offset 8 is 2^-14 of the max; e5m2: 2^-14), and P = 0 below it, where the byte formula stops being
the weight (the subnormal codes are not clamped to on purpose). Every kept H is exact in the FP8
dtype (one mantissa bit), so rounding to `p_dtype` changes nothing below its max, and the row sum adds
this same P, the one that enters P@V. What the flush costs: each flushed weight is below 2^-6 and the
row's top weight is at least 2^max_offset, so with max_offset 8 the row sum and every output
component move by at most L * 2^-14 of the top weight (times max |v|) for a row of L keys.

Note [Row sum by the MMA in the reference]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The SM90 FP8 forward's `row_sum="mma"` sums P in the P V GEMM, against ones rows of V^T (Note [Row sum by the MMA],
stage/softmax_sm90_fp8.py): it adds P after its rounding to e4m3, in the GEMM's accumulator, where FA4's FADD row
sum adds the float weights before the rounding. `SoftmaxConfig(row_sum="mma")` computes that sum the same way: V gains
a column of ones, so the row sum is that column of P V, with P's rounding and, when the accumulator is emulated (Note
[Emulated FP8 MMA accumulator]), its truncation and promotion. O is then divided by the sum of the weights that
entered it. For rowmax_h15 with an FP8 P both orders add the same P (Note [H15 with FP8 P]); for the exact softmax
they differ by P's rounding, which on Qwen2.5-0.5B scales O by +8.6e-4 against the FADD order
(bench/results/h200_2026-12-04_s16/).

Note [FP8 inputs and descales]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FP8 q, k, v (e4m3fn, e5m2) are dequantized exactly (every FP8 value is an fp32 value) and the scores are
the raw products of those values, summed in fp32 (the products an FP8 kernel's QK^T GEMM multiplies; Hopper's
accumulator truncates their sums: Note [Hopper FP8 accumulation], gates/tolerances.py). The optional descales,
float32 of shape (batch, heads_k) as FA4 takes them, fold in as FA4's SM100 FP8 path does
(`_load_effective_descales`, flash_fwd_sm100.py): `q_descale * k_descale` multiplies `scale_log2` per
(batch, kv head) (fp32: scale_log2_eff = fl(fl(softmax_scale * log2 e) * fl(q_descale * k_descale))),
so the running max, the weights and the LSE are those of the dequantized scores; `v_descale` multiplies
the normalised output. FP8 inputs give a BF16 output (FA4's FP8 output dtype); `p_dtype=None` means P
in the input's FP8 dtype, and `max_offset` is the caller's (FA4 uses 8 for FP8 inputs:
`config.FP8_MAX_OFFSET`). FP8 inputs apply to the modes that model FA4 (`exact`, `rowmax_pot`,
`rowmax_h15`).

Note [BAPS]
~~~~~~~~~~~
Log2 units `x = s * scale_log2`. The approximate max is `m = ceil(max x)` over the first
`baps_critical_tiles` tiles (B0). Each tile is a block of `tile_m` query rows by `tile_n`
keys (row blocks start at each sequence's first query). A block restarts when any of its
rows has `rowmax(x) - m > baps_lambda`; a restarted block is recomputed in high precision:
each of its rows moves its max to `max(m, ceil(rowmax(x)))`, O and the row sum are scaled by
the exact power of two `2**(m_old - m_new)`, and `P = exp2(x - m)` in fp32. Otherwise
`T = hif8(x - m)` and `P = hif8(exp2(T))` (`hif8.round_to_hif8`). The row sum adds the P
that enters P@V (before `p_dtype` rounding, which is exact for HiF8 values in 16-bit types).
Counters: `baps_blocks` = blocks with at least one unmasked element outside B0;
`restarts` = restarted blocks; `arr` = restarts / baps_blocks; `prr` = the largest
restarts / blocks of any one (batch, head, row block), i.e. one output O_i (0.0 when no
block follows B0).

Note [Fused-Softmax]
~~~~~~~~~~~~~~~~~~~~
Built from `fused_softmax.py`: operands through `quantize_operands`, the frozen max and
its recovery from `frozen_max_step`, `P = quantize_p(schraudolph_bf16(x - m))` in MX blocks
of 32 keys, the row sum from that same quantized P. `recoveries` counts (row, tile) pairs.
"""

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from fa4_rowmax.config import SoftmaxConfig, check_real
from fa4_rowmax.reference import fused_softmax, mma_accumulator
from fa4_rowmax.reference.exp_approx import ROUND_TO_HALF_MAGIC, h15_bits, pot
from fa4_rowmax.reference.hif8 import round_to_hif8

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64) + _FP8_DTYPES
COMPUTE_DTYPES = (torch.float32, torch.float64)
# Note [FP8 inputs and descales]
FP8_INPUT_MODES = ("exact", "rowmax_pot", "rowmax_h15")
FP8_OUTPUT_DTYPE = torch.bfloat16
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
_LN2 = math.log(2.0)
_LOG2_E = math.log2(math.e)


@dataclass
class _Problem:
    """Inputs laid out for the tile loop, padded to a dense batch."""

    q: torch.Tensor  # (batch, heads_k, group, rows, head_dim), compute dtype
    k: torch.Tensor  # (batch, heads_k, keys, head_dim)
    v: torch.Tensor  # (batch, heads_k, keys, head_dim)
    seqlen_q: list  # per batch entry
    seqlen_k: list
    seqlen_q_t: torch.Tensor  # (batch,) int64 on the device
    seqlen_k_t: torch.Tensor
    causal: bool
    # A float, or (batch, heads_k, 1, 1) in the compute dtype when descales fold in (Note [FP8 inputs and descales]).
    scale_log2: "float | torch.Tensor"
    # Note [Emulated FP8 MMA accumulator]: fraction bits of Q K^T's and P V's accumulators (None: fp32 GEMMs),
    # how P V's reaches O (SoftmaxConfig.accumulator_promotion), and the smallest normal exponents of the FP8
    # operands (q/k/v's dtype, P's dtype).
    qk_bits: Optional[int] = None
    pv_bits: Optional[int] = None
    pv_promotion: str = "none"
    input_min_exponent: int = 0
    p_min_exponent: int = 0

    @property
    def shape(self):
        return self.q.shape[:4]


@dataclass
class _Tile:
    index: int
    key_start: int
    key_end: int
    row_start: int
    # (batch, 1, 1, rows, keys) bool, or None when every (row, key) of the tile is valid.
    valid: Optional[torch.Tensor]


# ---------------------------------------------------------------------------------------
# Input checks
# ---------------------------------------------------------------------------------------


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must have one of the dtypes {INPUT_DTYPES}, got {x.dtype}")


def _check_cu_seqlens(name: str, cu: torch.Tensor, total: int, device: torch.device) -> list:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    bounds = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"{name} must start at 0, never decrease and end at the token count {total}, got {bounds}")
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _check_descales(descales: dict, q: torch.Tensor, batch: int, heads_k: int) -> None:
    given = [name for name, d in descales.items() if d is not None]
    if not given:
        return
    if q.dtype not in _FP8_DTYPES:
        raise ValueError(
            f"{', '.join(given)} apply to FP8 inputs only (q/k/v dtype one of {_FP8_DTYPES}), got q of dtype "
            f"{q.dtype}; accepted for other inputs: None"
        )
    for name in given:
        d = descales[name]
        if not isinstance(d, torch.Tensor):
            raise TypeError(
                f"{name} must be None or a float32 torch.Tensor of shape (batch, heads_k), got {type(d).__name__}"
            )
        if d.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype torch.float32 (as FA4 takes it), got {d.dtype}")
        if tuple(d.shape) != (batch, heads_k):
            raise ValueError(f"{name} must have shape (batch, heads_k) = {(batch, heads_k)}, got {tuple(d.shape)}")
        if d.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {d.device}")
        if not bool((torch.isfinite(d) & (d > 0)).all()):
            raise ValueError(
                f"{name} must hold finite positive scale factors, got min {d.min().item()}, max {d.max().item()}"
            )


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, compute_dtype, config, descales):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (varlen) or both be None")
    rank = 3 if varlen else 4
    layout = "(total, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim} (q.shape[-1])")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k's head_dim must equal q's ({head_dim}), got {k.shape[-1]}")
    heads_q, heads_k = q.shape[-2], k.shape[-2]
    if heads_k == 0 or heads_q % heads_k:
        raise ValueError(f"q's heads ({heads_q}) must be a positive multiple of k's heads ({heads_k}) (GQA)")
    if q.dtype in _FP8_DTYPES and config.mode not in FP8_INPUT_MODES:
        raise ValueError(
            f"FP8 q/k/v ({q.dtype}) apply to modes {FP8_INPUT_MODES}, not mode={config.mode!r}; "
            "accepted inputs there: float16, bfloat16, float32, float64"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        # FP8 has no isfinite kernel everywhere; the upcast is exact (e4m3fn's NaN stays NaN).
        values = x.float() if x.dtype in _FP8_DTYPES else x
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"{name} holds NaN or Inf; the reference accepts finite inputs only")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    accepted = "None or a positive finite float"
    if softmax_scale is not None and check_real("softmax_scale", softmax_scale, 0.0, accepted=accepted) == 0.0:
        raise ValueError(f"softmax_scale must be {accepted}, got {softmax_scale!r}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        # Note [Overflow in the reference]: only float64 inputs can exceed a compute dtype.
        if x.dtype == torch.float64 and compute_dtype != torch.float64 and x.numel():
            largest = x.abs().amax()
            if not bool(torch.isfinite(largest.to(compute_dtype))):
                raise ValueError(
                    f"{name} holds values beyond compute_dtype={compute_dtype}'s range (max |{name}| = "
                    f"{largest.item():.3g}); pass compute_dtype=torch.float64"
                )
    if varlen:
        seqlen_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
        seqlen_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
        if len(seqlen_q) != len(seqlen_k):
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                f"got {len(seqlen_q) + 1} and {len(seqlen_k) + 1}"
            )
    else:
        seqlen_q, seqlen_k = [q.shape[1]] * q.shape[0], [k.shape[1]] * k.shape[0]
    _check_descales(descales, q, len(seqlen_q), heads_k)
    return seqlen_q, seqlen_k


# ---------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------


def _to_padded(x: torch.Tensor, cu_seqlens: torch.Tensor, seqlens: list) -> torch.Tensor:
    """(total, heads, dim) -> (batch, max_seqlen, heads, dim) with zeros after each sequence."""
    batch, longest = len(seqlens), max(seqlens)
    padded = x.new_zeros(batch, longest, *x.shape[1:])
    sequence, position = _token_positions(cu_seqlens, x.shape[0])
    padded[sequence, position] = x
    return padded


def _token_positions(cu_seqlens: torch.Tensor, total: int):
    """For every packed token, its sequence and its position within it."""
    token = torch.arange(total, device=cu_seqlens.device)
    starts = cu_seqlens.long()
    sequence = torch.searchsorted(starts[1:], token, right=True)
    return sequence, token - starts[sequence]


def _scale_log2(softmax_scale, head_dim, q_descale, k_descale, compute_dtype):
    """scale_log2, with the QK descales folded in per (batch, kv head) as FA4 does (Note [FP8 inputs and descales])."""
    scale = head_dim**-0.5 if softmax_scale is None else float(softmax_scale)
    scale_log2 = scale * _LOG2_E
    if q_descale is None and k_descale is None:
        return scale_log2
    reference = q_descale if q_descale is not None else k_descale
    qk_descale = torch.ones_like(reference)
    for descale in (q_descale, k_descale):
        if descale is not None:
            qk_descale = qk_descale * descale
    # FA4: fp32 softmax_scale_log2 times the fp32 qk_descale; the fp64 control keeps full precision.
    base = torch.tensor(scale_log2, dtype=compute_dtype, device=reference.device)
    return (base * qk_descale.to(compute_dtype))[:, :, None, None]


def _score_scale(scale_log2):
    """scale_log2 shaped for scores (batch, heads_k, group, rows, keys)."""
    return scale_log2[..., None] if isinstance(scale_log2, torch.Tensor) else scale_log2


def _pack(
    q, k, v, seqlen_q, seqlen_k, causal, softmax_scale, compute_dtype, row_multiple, q_descale=None, k_descale=None
) -> _Problem:
    """Dense (batch, seqlen, heads, dim) inputs -> the tile loop's layout, rows padded to `row_multiple`."""
    batch, rows, heads_q, head_dim = q.shape
    heads_k = k.shape[2]
    group = heads_q // heads_k
    padded_rows = -(-rows // row_multiple) * row_multiple
    q5 = q.to(compute_dtype).reshape(batch, rows, heads_k, group, head_dim).permute(0, 2, 3, 1, 4)
    if padded_rows != rows:
        q5 = torch.nn.functional.pad(q5, (0, 0, 0, padded_rows - rows))
    device = q.device
    return _Problem(
        q=q5.contiguous(),
        k=k.to(compute_dtype).transpose(1, 2).contiguous(),
        v=v.to(compute_dtype).transpose(1, 2).contiguous(),
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        seqlen_q_t=torch.tensor(seqlen_q, dtype=torch.int64, device=device),
        seqlen_k_t=torch.tensor(seqlen_k, dtype=torch.int64, device=device),
        causal=causal,
        scale_log2=_scale_log2(softmax_scale, head_dim, q_descale, k_descale, compute_dtype),
    )


# ---------------------------------------------------------------------------------------
# Tiles
# ---------------------------------------------------------------------------------------


def _tiles(problem: _Problem, tile_n: int, descending: bool, row_multiple: int = 1):
    """The KV tiles in processing order, each with the first row that can see it and its mask."""
    rows = problem.shape[3]
    longest_k = max(problem.seqlen_k, default=0)
    n_tiles = -(-longest_k // tile_n)
    order = range(n_tiles - 1, -1, -1) if descending else range(n_tiles)
    # Causal: row i of entry b sees keys j <= i + seqlen_k[b] - seqlen_q[b] (bottom-right).
    diagonal_offsets = [sk - sq for sq, sk in zip(problem.seqlen_q, problem.seqlen_k)]
    # The parts of the mask that do not depend on the tile, (batch, rows, 1) and (1, 1, keys), built once.
    device = problem.q.device
    row = torch.arange(rows, device=device)[None, :, None]
    key = torch.arange(longest_k, device=device)[None, None, :]
    row_in_sequence = row < problem.seqlen_q_t[:, None, None]
    last_visible_key = row + (problem.seqlen_k_t - problem.seqlen_q_t)[:, None, None]
    for index in order:
        key_start, key_end = index * tile_n, min((index + 1) * tile_n, longest_k)
        row_start = max(0, min(key_start - off for off in diagonal_offsets)) if problem.causal else 0
        row_start = row_start // row_multiple * row_multiple
        if row_start >= rows:
            continue
        # Every (row, key) is valid when the tile's last row and key are inside every sequence and,
        # causal, its last key is visible from its first row: decided from the lengths, no mask needed.
        all_valid = rows <= min(problem.seqlen_q) and key_end <= min(problem.seqlen_k)
        if problem.causal:
            all_valid = all_valid and key_end - 1 <= row_start + min(diagonal_offsets)
        valid = None
        if not all_valid:
            tile_key = key[:, :, key_start:key_end]
            valid = row_in_sequence[:, row_start:] & (tile_key < problem.seqlen_k_t[:, None, None])
            if problem.causal:
                valid = valid & (tile_key <= last_visible_key[:, row_start:])
            valid = valid[:, None, None]
        yield _Tile(index, key_start, key_end, row_start, valid)


def _scores(problem: _Problem, tile: _Tile) -> torch.Tensor:
    """Raw scores q k^T of one tile, (batch, heads_k, group, rows, keys), masked ones -inf."""
    batch, heads_k, group, rows = problem.shape
    q = problem.q[:, :, :, tile.row_start :]
    q = q.reshape(batch, heads_k, group * (rows - tile.row_start), q.shape[-1])
    k = problem.k[:, :, tile.key_start : tile.key_end]
    if problem.qk_bits is None:
        s = torch.matmul(q, k.transpose(-1, -2))
    else:
        e = problem.input_min_exponent
        s = mma_accumulator.emulated_matmul(q, k, problem.qk_bits, e, e).to(q.dtype)
    s = s.view(batch, heads_k, group, rows - tile.row_start, -1)
    if tile.valid is not None:
        s.masked_fill_(~tile.valid, -math.inf)
    return s


def _accumulate_pv(problem: _Problem, tile: _Tile, p: torch.Tensor, acc: torch.Tensor, acc_scale: torch.Tensor):
    """acc[rows] = acc[rows] * acc_scale + p @ v_tile, in place."""
    batch, heads_k, group, rows_in_tile, keys = p.shape
    v = problem.v[:, :, tile.key_start : tile.key_end]
    target = acc[:, :, :, tile.row_start :]
    if problem.pv_bits is not None:
        shape = (batch, heads_k, group * rows_in_tile)
        two_level = problem.pv_promotion == "tile"
        # Note [Emulated FP8 MMA accumulator]: single-level, O is the wgmma's accumulator input, scaled first;
        # two-level, the tile starts from 0 and is promoted by one FFMA (Note [Two-level P V accumulation]).
        c = None if two_level else target.mul_(acc_scale[..., None]).reshape(*shape, -1)
        out = mma_accumulator.emulated_matmul(
            p.reshape(*shape, keys),
            v.transpose(-1, -2),
            problem.pv_bits,
            problem.p_min_exponent,
            problem.input_min_exponent,
            c=c,
        ).view(target.shape)
        if two_level and target.dtype == torch.float32:
            out = mma_accumulator.fma_fp32(target, acc_scale[..., None], out)
        elif two_level:  # the fp64 control keeps its own precision for the promotion
            out = torch.addcmul(out.to(target.dtype), target, acc_scale[..., None])
        target.copy_(out)
        return
    pv = torch.matmul(p.reshape(batch, heads_k, group * rows_in_tile, keys), v)
    target.mul_(acc_scale[..., None]).add_(pv.view(batch, heads_k, group, rows_in_tile, -1))


def p_dtype_for(config: SoftmaxConfig, q_dtype: torch.dtype) -> torch.dtype:
    """The dtype P is rounded to for P@V: `config.p_dtype`, else q's dtype (float32 for float32/float64 inputs)."""
    if config.p_dtype is not None:
        return config.p_dtype
    return torch.float32 if q_dtype in (torch.float32, torch.float64) else q_dtype


def _round_p(p: torch.Tensor, p_dtype: torch.dtype) -> torch.Tensor:
    """P as the P@V GEMM sees it: rounded to p_dtype (FP8 saturating), back in p's dtype."""
    if p_dtype == p.dtype:
        return p
    if p_dtype in _FP8_DTYPES:
        p = p.clamp(max=torch.finfo(p_dtype).max)
    return p.to(p_dtype).to(p.dtype)


def _h15_fp8_operand(p: torch.Tensor, p_dtype: torch.dtype) -> torch.Tensor:
    """H15 weights as an FP8 kernel builds them: 0 below the dtype's smallest normal (Note [H15 with FP8 P])."""
    p = p.masked_fill(p < torch.finfo(p_dtype).tiny, 0.0)
    return _round_p(p, p_dtype)


def _rows_with_keys(tile: _Tile, heads_q: int, scores: torch.Tensor):
    """Number of (row, head) pairs that have at least one key in the tile."""
    if tile.valid is None:
        return scores[..., 0].numel()
    return tile.valid.any(-1).sum() * heads_q


# ---------------------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------------------


def _fa4_weights(y: torch.Tensor, tile: _Tile, config: SoftmaxConfig) -> torch.Tensor:
    """P from y = x - m + max_offset, in place where the mode allows (Note [Weights per mode])."""
    if config.mode == "exact":
        return y.exp2_()
    if config.mode == "rowmax_h15":
        return h15_bits(y.float()).to(y.dtype)
    offset = config.max_offset
    p = pot((y - offset).float(), config.pot_k_max).to(y.dtype)
    if offset:
        p.mul_(2.0**offset)
    if tile.valid is not None:
        p.masked_fill_(~tile.valid, 0.0)
    return p


def _half_octave_anchor(m: torch.Tensor, scale_log2: float) -> torch.Tensor:
    """a = C - fl32(C - m * scale_log2), C = 1.5 * 2**22 (Note [Weights per mode]); -inf stays -inf."""
    addend = (ROUND_TO_HALF_MAGIC - m.double() * scale_log2).float().double()
    return (ROUND_TO_HALF_MAGIC - addend).to(m.dtype)


def _anchor(m: torch.Tensor, scale_log2: float, config: SoftmaxConfig) -> torch.Tensor:
    """The lattice anchor in log2 units for the max in use `m` (score units)."""
    if config.anchor_rounding == "half_octave":
        return _half_octave_anchor(m, scale_log2)
    return m * scale_log2


def _whole_row_max(problem: _Problem, config: SoftmaxConfig) -> torch.Tensor:
    row_max = problem.q.new_full(problem.shape, -math.inf)
    for tile in _tiles(problem, config.tile_n, descending=True):
        s = _scores(problem, tile)
        target = row_max[:, :, :, tile.row_start :]
        torch.maximum(target, s.amax(-1), out=target)
    return row_max


def _run_fa4(problem: _Problem, config: SoftmaxConfig, p_dtype: torch.dtype, counting: bool):
    """exact / rowmax_h15 / rowmax_pot (Notes [FA4 running max and rescale_threshold], [Weights per mode])."""
    mma_row_sum = config.row_sum == "mma"
    if mma_row_sum:  # Note [Row sum by the MMA in the reference]
        problem = replace(problem, v=torch.cat([problem.v, torch.ones_like(problem.v[..., :1])], dim=-1))
    heads_q = problem.shape[1] * problem.shape[2]
    row_anchor = config.anchor == "row"
    row_max = _whole_row_max(problem, config) if row_anchor else problem.q.new_full(problem.shape, -math.inf)
    row_sum = problem.q.new_zeros(problem.shape)
    acc = problem.q.new_zeros(*problem.shape, problem.v.shape[-1])
    scale_log2 = problem.scale_log2
    threshold = config.rescale_threshold
    h15_fp8 = config.mode == "rowmax_h15" and p_dtype in _FP8_DTYPES
    counters = _new_counters(problem.q.device)
    for tile in _tiles(problem, config.tile_n, descending=True):
        s = _scores(problem, tile)
        m_old = row_max[:, :, :, tile.row_start :]
        if row_anchor:
            m_new = m_old
            m_safe = torch.where(m_old == -math.inf, 0.0, m_old)
            acc_scale = torch.ones_like(m_old)
        else:
            m_new = torch.maximum(m_old, s.amax(-1))
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
            acc_scale_log2 = (m_old - m_safe) * scale_log2
            anchor_step = acc_scale_log2
            if config.anchor_rounding == "half_octave":
                anchor_step = _half_octave_anchor(m_old, scale_log2) - _half_octave_anchor(m_safe, scale_log2)
            if counting:
                moved = m_new > m_old
                rescaled = moved & (m_old > -math.inf)
            if threshold > 0.0:
                # FA4 compares the scaled difference with -rescale_threshold (>=: keep the max).
                keep = acc_scale_log2 >= -threshold
                if counting:
                    rescaled = rescaled & ~keep
                    counters["rescales_skipped"] += (moved & keep).sum()
                m_new = torch.where(keep, m_old, m_new)
                m_safe = torch.where(keep, m_old, m_safe)
                acc_scale = torch.where(keep, 1.0, torch.exp2(anchor_step))
            else:
                acc_scale = torch.exp2(anchor_step)
            if counting:
                counters["rescales"] += rescaled.sum()
            m_old.copy_(m_new)
        bias = config.max_offset - _anchor(m_safe, scale_log2, config)
        p = _fa4_weights(s.mul_(_score_scale(scale_log2)).add_(bias[..., None]), tile, config)
        if counting:
            counters["tiles"] += _rows_with_keys(tile, heads_q, s)
            counters["p_max"] = torch.maximum(counters["p_max"], p.max())
        if h15_fp8:
            p = p_operand = _h15_fp8_operand(p, p_dtype)
        else:
            p_operand = _round_p(p, p_dtype)
        if not mma_row_sum:
            sums = row_sum[:, :, :, tile.row_start :]
            sums.mul_(acc_scale).add_(p.sum(-1))
        _accumulate_pv(problem, tile, p_operand, acc, acc_scale)
    lse_base_log2 = _anchor(row_max, scale_log2, config) - config.max_offset
    if mma_row_sum:
        acc, row_sum = acc[..., :-1], acc[..., -1].clone()
    return acc, row_sum, lse_base_log2, counters


def _run_baps(problem: _Problem, config: SoftmaxConfig, p_dtype: torch.dtype, counting: bool):
    """Block-aware precision rescaling (Note [BAPS])."""
    batch, heads_k, group, rows = problem.shape
    heads_q = heads_k * group
    tile_m = config.tile_m
    blocks = rows // tile_m
    lam = float(config.baps_lambda)
    scale_log2 = problem.scale_log2
    # The approximate max: integer, from the critical tiles B0.
    row_max = problem.q.new_full(problem.shape, -math.inf)
    for tile in _tiles(problem, config.tile_n, descending=False, row_multiple=tile_m):
        if tile.index >= config.baps_critical_tiles:
            break
        target = row_max[:, :, :, tile.row_start :]
        torch.maximum(target, _scores(problem, tile).amax(-1) * scale_log2, out=target)
    row_max = torch.ceil(row_max)
    row_sum = problem.q.new_zeros(problem.shape)
    acc = problem.q.new_zeros(*problem.shape, problem.v.shape[-1])
    counters = _new_counters(problem.q.device)
    block_restarts = torch.zeros(batch, heads_k, group, blocks, dtype=torch.int64, device=problem.q.device)
    block_tiles = torch.zeros_like(block_restarts)
    for tile in _tiles(problem, config.tile_n, descending=False, row_multiple=tile_m):
        x = _scores(problem, tile).mul_(scale_log2)
        m_old = row_max[:, :, :, tile.row_start :]
        tile_max = x.amax(-1)
        # rowmax(x - m) > lambda; a row without a max yet restarts as soon as it sees a key.
        over = torch.where(m_old == -math.inf, tile_max > -math.inf, (tile_max - m_old) > lam)
        first_block = tile.row_start // tile_m
        block_shape = (batch, heads_k, group, blocks - first_block, tile_m)
        restart_block = over.view(block_shape).any(-1)
        restart_row = restart_block[..., None].expand(block_shape).reshape(over.shape)
        m_new = torch.where(restart_row, torch.maximum(m_old, torch.ceil(tile_max)), m_old)
        acc_scale = torch.where(m_new > m_old, torch.exp2(m_old - m_new), 1.0)
        m_old.copy_(m_new)
        t = x - torch.where(m_new == -math.inf, 0.0, m_new)[..., None]
        # The fp32 P of restarted rows, the HiF8 P of the others; both always built (no host sync per tile).
        p = torch.where(restart_row[..., None], torch.exp2(t), round_to_hif8(torch.exp2(round_to_hif8(t))))
        sums = row_sum[:, :, :, tile.row_start :]
        sums.mul_(acc_scale).add_(p.sum(-1))
        if counting:
            counters["tiles"] += _rows_with_keys(tile, heads_q, x)
            counters["p_max"] = torch.maximum(counters["p_max"], p.max())
            if tile.index >= config.baps_critical_tiles:
                if tile.valid is None:
                    block_valid = torch.ones_like(restart_block)
                else:
                    rows_valid = tile.valid.any(-1).expand(over.shape)
                    block_valid = rows_valid.reshape(block_shape).any(-1)
                block_tiles[:, :, :, first_block:] += block_valid
                block_restarts[:, :, :, first_block:] += restart_block & block_valid
        _accumulate_pv(problem, tile, _round_p(p, p_dtype), acc, acc_scale)
    if counting:
        counters["restarts"] = block_restarts.sum()
        counters["baps_blocks"] = block_tiles.sum()
        followed = block_tiles > 0
        counters["arr"] = counters["restarts"].double() / counters["baps_blocks"].clamp(min=1).double()
        share = block_restarts[followed].double() / block_tiles[followed].double()
        counters["prr"] = share.max() if share.numel() else torch.zeros((), dtype=torch.float64)
    return acc, row_sum, row_max, counters


def _run_fused_softmax(problem: _Problem, config: SoftmaxConfig, p_dtype: torch.dtype, counting: bool):
    """Frozen max, Schraudolph BF16 P, MX-quantized P and row sum (Note [Fused-Softmax]).

    The operands arrive already MX-quantized; `p_dtype` does not apply (P's format is the MX one).
    """
    heads_q = problem.shape[1] * problem.shape[2]
    scale_log2 = problem.scale_log2
    frozen = problem.q.new_full(problem.shape, -math.inf)
    row_sum = problem.q.new_zeros(problem.shape)
    acc = problem.q.new_zeros(*problem.shape, problem.v.shape[-1])
    counters = _new_counters(problem.q.device)
    for tile in _tiles(problem, config.tile_n, descending=False):
        x = _scores(problem, tile).mul_(scale_log2)
        m_old = frozen[:, :, :, tile.row_start :]
        m_new, acc_scale, recovered = fused_softmax.frozen_max_step(m_old, x.amax(-1), config.recovery_threshold)
        m_old.copy_(m_new)
        p = fused_softmax.schraudolph_bf16((x - m_new[..., None]).float())
        # -inf - -inf is NaN for rows with no max yet: every masked score gives 0.
        p = p.float().masked_fill_(x == -math.inf, 0.0)
        p = fused_softmax.quantize_p(p, config.mx_format).to(x.dtype)
        sums = row_sum[:, :, :, tile.row_start :]
        sums.mul_(acc_scale).add_(p.sum(-1))
        if counting:
            counters["tiles"] += _rows_with_keys(tile, heads_q, x)
            counters["recoveries"] += recovered.sum()
            counters["p_max"] = torch.maximum(counters["p_max"], p.max())
        _accumulate_pv(problem, tile, p, acc, acc_scale)
    return acc, row_sum, frozen, counters


def _new_counters(device: torch.device) -> dict:
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return {
        "tiles": zero.clone(),
        "rescales": zero.clone(),
        "rescales_skipped": zero.clone(),
        "restarts": zero.clone(),
        "recoveries": zero.clone(),
        "p_max": torch.zeros((), dtype=torch.float64, device=device),
    }


_RUNNERS = {
    "exact": _run_fa4,
    "rowmax_h15": _run_fa4,
    "rowmax_pot": _run_fa4,
    "baps": _run_baps,
    "fused_softmax": _run_fused_softmax,
}


def _set_accumulator(problem: _Problem, config: SoftmaxConfig, input_dtype: torch.dtype, p_dtype: torch.dtype):
    """The emulated FP8 accumulator's settings (Note [Emulated FP8 MMA accumulator]); None leaves fp32 GEMMs."""
    bits = config.accumulator_mantissa_bits
    if bits is None:
        return
    if input_dtype not in _FP8_DTYPES:
        raise ValueError(
            f"SoftmaxConfig.accumulator_mantissa_bits={bits} applies to FP8 inputs only (q/k/v dtype one of "
            f"{_FP8_DTYPES}), got {input_dtype}; accepted for other inputs: None"
        )
    pv = config.accumulator_gemms in ("qk_pv", "pv")
    if pv and p_dtype not in _FP8_DTYPES:
        raise ValueError(
            f"SoftmaxConfig.accumulator_gemms={config.accumulator_gemms!r} emulates an FP8 P V GEMM, which needs an "
            f"FP8 p_dtype, got {p_dtype}; accepted with this P: accumulator_gemms='qk'"
        )
    problem.qk_bits = bits if config.accumulator_gemms in ("qk_pv", "qk") else None
    problem.pv_bits = bits if pv else None
    problem.pv_promotion = config.accumulator_promotion
    problem.input_min_exponent = mma_accumulator.min_normal_exponent(input_dtype)
    if pv:
        problem.p_min_exponent = mma_accumulator.min_normal_exponent(p_dtype)


# ---------------------------------------------------------------------------------------
# Empty inputs and overflow
# ---------------------------------------------------------------------------------------

# Note [Empty inputs]
# ~~~~~~~~~~~~~~~~~~~
# No query (batch 0, seqlen_q 0, heads_q 0, varlen total_q 0) returns an empty out in q's shape and an empty
# float32 LSE, (batch, heads_q, seqlen_q) or (heads_q, total_q), with zero counters; no key (seqlen_k 0, total_k 0)
# takes the ordinary path, where every row is empty: out 0, LSE -inf. That is FA4's interface
# (`flash_attn/cute/interface.py`: `if seqlen_k == 0 or total_q == 0`, out zero-filled, LSE -inf). Every
# argument is checked first; zero kv heads stay refused (a query head needs a kv head to share).
#
# Note [Overflow in the reference]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The reference accepts finite inputs only, and finite inputs have a finite answer: a weighted mean of v's rows
# and a finite LSE for every row with a key. Where the arithmetic of `compute_dtype` cannot hold that answer, an
# infinite score makes the row's max inf and its weights NaN (and a -inf score, all weights 0), which read as a
# row with no key: out 0, LSE -inf, the masked row, for inputs that mask nothing. So the reference refuses, naming
# the inputs: float64 inputs beyond the compute dtype's range (`q`, `k`, `v`), a row with a key whose sum is not
# positive and finite (the scores of `q` and `k`), an output that is not finite (`v`: P @ V or the output dtype)
# and an LSE beyond float32's range (the LSE's dtype). It does not widen the arithmetic on its own: the float32
# reference is the kernels' arithmetic, and a silently wider one would answer a question the kernels cannot;
# `compute_dtype=torch.float64` is the caller's way to have such inputs computed where float64 holds them.


def _rows_with_a_key(problem: _Problem) -> torch.Tensor:
    """(batch, 1, 1, rows) bool: the rows that see at least one key (causal: bottom-right aligned)."""
    row = torch.arange(problem.shape[3], device=problem.q.device)[None, :]
    seqlen_q, seqlen_k = problem.seqlen_q_t[:, None], problem.seqlen_k_t[:, None]
    has_key = (row < seqlen_q) & (seqlen_k > 0)
    if problem.causal:
        has_key = has_key & (row + seqlen_k - seqlen_q >= 0)
    return has_key[:, None, None]


def _check_finite_rows(bad: torch.Tensor, what: str, dtype: torch.dtype, wider: bool) -> None:
    """Raises when any row is `bad`, naming `what` overflowed (Note [Overflow in the reference])."""
    if not bool(bad.any()):
        return
    hint = "; pass compute_dtype=torch.float64" if wider and dtype == torch.float32 else ""
    raise ValueError(
        f"{what} beyond {dtype}'s range on {int(bad.sum())} rows with a key: finite inputs whose answer the "
        f"arithmetic cannot hold (Note [Overflow in the reference]){hint}"
    )


def _empty_result(q, v, out_dtype: torch.dtype, varlen: bool, config: SoftmaxConfig, return_counters: bool):
    """Note [Empty inputs]: no query."""
    heads_q = q.shape[-2]
    lse_shape = (heads_q, q.shape[0]) if varlen else (q.shape[0], heads_q, q.shape[1])
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=out_dtype, device=q.device)
    lse = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=q.device)
    if not return_counters:
        return out, lse
    counters = {name: value.item() for name, value in _new_counters(q.device).items()}
    if config.mode == "baps":
        counters.update(baps_blocks=0, arr=0.0, prr=0.0)
    return out, lse, counters


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Optional[SoftmaxConfig] = None,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    return_counters: bool = False,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    """Attention with the softmax of `config.mode`, as the kernels compute it tile by tile.

    Layouts are FlashAttention's (docs/design.md, Conventions): dense q (batch, seqlen_q,
    heads_q, head_dim), k/v (batch, seqlen_k, heads_k, head_dim); varlen q (total_q, heads_q,
    head_dim), k/v (total_k, heads_k, head_dim) with int32 `cu_seqlens_q`/`cu_seqlens_k`.
    Causal masks are aligned bottom-right. Scores, the running state and P are held in
    `compute_dtype` (float32 like the kernels, or float64 for an exact control); P is
    rounded to `config.p_dtype` (default: q's dtype, float32 for float32/float64 inputs)
    before P@V.

    FP8 q/k/v (float8_e4m3fn, float8_e5m2; modes exact, rowmax_pot, rowmax_h15) are dequantized
    exactly, with optional float32 descales of shape (batch, heads_k) folded in as FA4 does
    (Note [FP8 inputs and descales]); their output is BF16.

    Returns `(out, lse)`: out in q's shape and dtype (BF16 for FP8 inputs), lse float32 natural log, (batch,
    heads_q, seqlen_q) (varlen: (heads_q, total_q)); a row with no key gives out 0 and lse
    -inf. With `return_counters=True` also a dict of Python numbers: `tiles` ((row, head, KV
    tile) triples with a key), `rescales`, `rescales_skipped` (FA4 max moved / kept stale),
    `restarts` (BAPS blocks), `recoveries` (fused softmax), `p_max` (largest P fed to P@V,
    before p_dtype rounding), and for BAPS `baps_blocks`, `arr`, `prr` (Note [BAPS]).
    """
    if config is None:
        config = SoftmaxConfig()
    if not isinstance(config, SoftmaxConfig):
        raise TypeError(f"config must be a SoftmaxConfig or None, got {type(config).__name__}")
    if not isinstance(return_counters, bool):
        raise TypeError(f"return_counters must be a bool, got {type(return_counters).__name__}")
    descales = dict(zip(DESCALE_NAMES, (q_descale, k_descale, v_descale)))
    seqlen_q, seqlen_k = _check_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, compute_dtype, config, descales
    )
    fp8_inputs = q.dtype in _FP8_DTYPES
    varlen = cu_seqlens_q is not None
    out_dtype = FP8_OUTPUT_DTYPE if fp8_inputs else q.dtype
    if q.numel() == 0:  # Note [Empty inputs]
        return _empty_result(q, v, out_dtype, varlen, config, return_counters)
    p_dtype = p_dtype_for(config, q.dtype)
    dense_q, dense_k, dense_v = q, k, v
    if fp8_inputs:  # exact upcast before any padding or layout change (FP8 lacks some of those kernels)
        dense_q, dense_k, dense_v = q.float(), k.float(), v.float()
    if config.mode == "fused_softmax":
        dense_q, dense_k, dense_v = fused_softmax.quantize_operands(q, k, v, config.mx_format, cu_seqlens_k)
    if varlen:
        dense_q = _to_padded(dense_q, cu_seqlens_q, seqlen_q)
        dense_k = _to_padded(dense_k, cu_seqlens_k, seqlen_k)
        dense_v = _to_padded(dense_v, cu_seqlens_k, seqlen_k)
    row_multiple = config.tile_m if config.mode == "baps" else 1
    problem = _pack(
        dense_q,
        dense_k,
        dense_v,
        seqlen_q,
        seqlen_k,
        causal,
        softmax_scale,
        compute_dtype,
        row_multiple,
        q_descale,
        k_descale,
    )
    _set_accumulator(problem, config, q.dtype, p_dtype)
    acc, row_sum, lse_base_log2, counters = _RUNNERS[config.mode](problem, config, p_dtype, return_counters)

    # A row with no key gives out 0 and lse -inf, as FA4 does; a row with a key has a finite max and a positive
    # finite sum unless its scores overflowed (Note [Overflow in the reference]).
    has_key = _rows_with_a_key(problem)
    scores_overflow = ~(torch.isfinite(lse_base_log2) & torch.isfinite(row_sum) & (row_sum > 0)) & has_key
    _check_finite_rows(
        scores_overflow, "q and k give scores (q k^T * softmax_scale) in compute_dtype", compute_dtype, True
    )
    empty = ~has_key
    safe_sum = torch.where(empty, 1.0, row_sum)
    out5 = torch.where(empty[..., None], 0.0, acc / safe_sum[..., None])
    _check_finite_rows(~torch.isfinite(out5).all(-1), "v: P @ V in compute_dtype", compute_dtype, True)
    if v_descale is not None:
        out5 = out5 * v_descale.to(out5.dtype)[:, :, None, None, None]
    lse = torch.where(empty, -math.inf, (lse_base_log2 + torch.log2(safe_sum)) * _LN2).float()
    _check_finite_rows(~torch.isfinite(lse) & has_key, "q and k give a log-sum-exp (the LSE)", torch.float32, False)

    batch, heads_k, group, rows = problem.shape
    longest_q = max(seqlen_q, default=0)
    head_dim_v = problem.v.shape[-1]
    out = out5[:, :, :, :longest_q].permute(0, 3, 1, 2, 4).reshape(batch, longest_q, heads_k * group, head_dim_v)
    lse = lse[:, :, :, :longest_q].reshape(batch, heads_k * group, longest_q)
    if varlen:
        sequence, position = _token_positions(cu_seqlens_q, q.shape[0])
        out = out[sequence, position]
        lse = lse[sequence, :, position].transpose(0, 1)
    out = out.to(out_dtype).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise ValueError(
            f"v{' and v_descale' if v_descale is not None else ''} give an output beyond {out_dtype}'s range "
            f"(the output dtype; Note [Overflow in the reference])"
        )
    lse = lse.contiguous()
    if not return_counters:
        return out, lse
    return out, lse, {name: value.item() for name, value in counters.items()}
