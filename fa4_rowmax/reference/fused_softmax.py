"""The pure pieces of Fused-Softmax attention (AMD, arXiv 2611.09225), shared by the semantic
reference (``reference.py``, mode ``fused_softmax``) and the Triton kernel (``aiter_fused``).

Everything here works on torch tensors, CPU or CUDA, with no kernel in sight; the kernel mirrors
these functions operation for operation, and its tests hold it to them.

Note [Frozen reference max]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Online softmax moves the running max ``m`` at every tile and rescales the output accumulator ``O``
and the row sum ``l`` by ``exp2(m_old - m_new)``. Fused-Softmax freezes ``m`` instead: the first KV
tile that has a key for the row sets it (its row max), and it stays put, so ``x - m`` can be folded
into the score GEMM and the per-tile rescale disappears. Weights then reach ``2 ** (x - m)`` with
``x - m`` up to ``recovery_threshold`` (log2 units): ``P`` up to 256 for the default 8, which the
BF16 intermediate and the MX block scale of ``P`` hold with ease.

Recovery: when a tile's max exceeds the frozen max by more than ``recovery_threshold``, the max
moves to that tile max and ``O`` and ``l`` are rescaled by ``exp2(m_old - m_new)`` once. The tile
max is *always* computed (one row reduction per tile on the fp32 scores, before ``P`` is built),
so a recovery can never be missed, whatever the order of the scores: a late max, a staircase of
increases, one huge score. (The paper's fastest FP4 variant takes a shortcut that can miss one in
an extreme-score range; we do not take it.) ``needs_recovery`` and ``frozen_max_step`` hold the rule.

Note [Schraudolph exp2 as BF16 bits]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``y = x - m`` in log2 units, BF16's bit pattern ``(y + 127) * 128`` read as an integer is a
piecewise-linear ``2 ** y``: the integer part of ``y + 127`` lands in the 8 exponent bits and the
fraction, linearly, in the 7 mantissa bits: ``2**floor(y) * (1 + frac(y))``, the chord of the convex
``2**frac``, so never below ``2**y`` and at most 6.15% above (at a fraction of ``1/ln 2 - 1``), before
the rounding to 7 mantissa bits (at most 2**-8 relative). This is the linear map a GEMM epilogue
applies, one fused multiply-add per score. We round it once, to nearest even:
``bits = round_half_even(y * 128 + 16256)``, computed as ``(y * 128 + C) - (C - 16256)`` with
``C = 1.5 * 2**23 + 16256``: ``y * 128`` is exact, the one addition rounds to an integer (fp32's ulp is 1 in
``[2**23, 2**24)``) and the subtraction is exact, so torch and Triton produce the same bits from the same
``y``. ``y < -127`` gives 0 (``y`` in ``[-127, -126)`` gives BF16 subnormals, the linear continuation); ``y``
must stay below 128 (``recovery_threshold`` guarantees it); NaN stays NaN.

Note [Two-stage P and the row sum]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The BF16 ``P`` is then quantized to the P element format in MX blocks of 32 consecutive keys (RCEIL
scale per row and block, ``fa4_rowmax.reference.mx``): MXFP8 -> e4m3, MXFP6 and MXFP4 -> e2m3 (the paper's
MXFP4 keeps six-bit P). The row sum ``l`` is the sum of the *same quantized* ``P`` (a GEMM against a
ones vector in the kernel), so numerator and denominator agree. Blocks are aligned to the key index
within the sequence (tiles start at multiples of the tile size, a multiple of 32).

Note [Folded Schraudolph]
~~~~~~~~~~~~~~~~~~~~~~~~~
``exp_fold=True`` folds the frozen-max subtraction and the Schraudolph linear map into the score GEMM
(the paper's GEMM that "yields P's exponent-and-mantissa bits"). With ``c = fl32(softmax_scale * log2 e)``:
- Q is prescaled by ``128 c`` (``folded_q_prescale``: ``128 * c``, exact in fp32) before its MX quantization:
  ``Qf = quantize(fl32(Q * 128 c))``. ``128 c`` is no power of two, so it cannot ride in the E8M0 scale; Qf's
  elements are not Q's, so the fold changes the scores by Q's rounding, not by an fp32 ulp.
- Each row carries an fp32 addend ``C`` (0 until the row's max is set) and the GEMM starts from it:
  ``z = fl32(C + S)`` with ``S = Qf K^T`` (the reference rounds the dot and then adds; a kernel adds inside
  its MFMA/MMA sum, in the hardware's order). Masked keys get ``z = -inf``.
- The row's tile max is ``max z``. The max *moves* on the row's first tile with a key (``C`` was 0, so ``z``
  is the raw score ``S``: 128 times the log2-unit score up to Qf's rounding) and on a recovery, a tile with
  ``max z > B``, ``B = fl32(16256 + 128 * recovery_threshold)`` (``folded_recovery_bound``; the rule
  ``x_max > m + threshold`` of Note [Frozen reference max] times 128, in ``z`` units). Where it moves, the
  shift ``D = fl32(16256 - max z)`` is added to the addend (``C = fl32(C + D)``) and to the tile
  (``z = fl32(z + D)``: the re-derivation, one more rounding; the tile's max lands on 16256, P = 1). The
  frozen max in log2 units is ``m = fl32(16256 - C) / 128`` (exact when C is in [8128, 32512], Sterbenz: max
  scores in [-127, 63.5] log2 units); ``O`` and ``l`` are rescaled by ``exp2(m_old - m_new)`` on a recovery
  and the LSE is ``m + log2(l)``, as before.
- P's BF16 bits are ``clamp(RNE(z), 0, 0x7F80)`` (NaN stays NaN, ``-inf`` gives 0): ``folded_schraudolph_bf16``.
  Then P is MX-quantized and summed as in Note [Two-stage P and the row sum].
Against the unfolded form on the same scores (``x = S / 128``, exact) the bits' argument
``16256 + 128 (x - m)`` is rounded at the addend's magnitude: after the step ``z <= B < 2**15`` (17280 at the
default threshold), where fp32's ulp is at most ``2**-9``, against ``2**-13``-ish for the separately
rounded ``x - m``; ``aiter_fused/tolerances.py`` Note [Folded Schraudolph tolerance] turns that into the
kernel-vs-reference bounds.

Note [Operand quantization]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The MX GEMMs need their block scales constant along the reduction: ``Q`` and ``K`` are quantized in
blocks of 32 along head_dim (QK^T reduces over head_dim), ``V`` in blocks of 32 along keys (P@V
reduces over keys; varlen: per sequence, so no block crosses two sequences). Element formats:
MXFP8 -> e4m3, MXFP6 -> e2m3, MXFP4 -> e2m1.
"""

import math
import numbers
from typing import Optional

import torch

from fa4_rowmax.reference.mx import MX_BLOCK, fake_quantize_mx

__all__ = [
    "MX_FORMATS",
    "OPERAND_ELEMENT_FORMAT",
    "P_ELEMENT_FORMAT",
    "RECOVERY_THRESHOLD_MAX",
    "check_mx_format",
    "check_recovery_threshold",
    "operand_element_format",
    "p_element_format",
    "schraudolph_bf16",
    "folded_schraudolph_bf16",
    "folded_q_prescale",
    "folded_recovery_bound",
    "folded_max_step",
    "quantize_p",
    "quantize_operands",
    "needs_recovery",
    "frozen_max_step",
    "hybrid_format",
    "fused_softmax_attention_reference",
    "fused_softmax_attention_reference_varlen",
]

OPERAND_ELEMENT_FORMAT = {"mxfp8": "e4m3", "mxfp6": "e2m3", "mxfp4": "e2m1"}
P_ELEMENT_FORMAT = {"mxfp8": "e4m3", "mxfp6": "e2m3", "mxfp4": "e2m3"}
MX_FORMATS = tuple(OPERAND_ELEMENT_FORMAT)
# P = 2**y with y <= recovery_threshold must stay below BF16's infinity (y < 128).
RECOVERY_THRESHOLD_MAX = 127.0

_SCHRAUDOLPH_BIAS = 127.0 * 128.0  # 16256: BF16 bits of 1.0
_ROUND_MAGIC = 1.5 * 2.0**23  # adding it rounds an fp32 in (-2**22, 2**22) to an integer, ties to even


def check_mx_format(mx_format) -> str:
    if not isinstance(mx_format, str):
        raise TypeError(f"mx_format must be a str, one of {MX_FORMATS}; got {type(mx_format).__name__}")
    if mx_format not in OPERAND_ELEMENT_FORMAT:
        raise ValueError(f"mx_format must be one of {MX_FORMATS}; got {mx_format!r}")
    return mx_format


def check_recovery_threshold(recovery_threshold) -> float:
    if isinstance(recovery_threshold, bool) or not isinstance(recovery_threshold, numbers.Real):
        raise TypeError(
            f"recovery_threshold must be a real number in [0, {RECOVERY_THRESHOLD_MAX}); "
            f"got {type(recovery_threshold).__name__}"
        )
    if not 0.0 <= recovery_threshold < RECOVERY_THRESHOLD_MAX:
        raise ValueError(
            f"recovery_threshold must be in [0, {RECOVERY_THRESHOLD_MAX}) (log2 units); got {recovery_threshold}"
        )
    return float(recovery_threshold)


def operand_element_format(mx_format: str) -> str:
    """Element format of Q, K and V: mxfp8 -> e4m3, mxfp6 -> e2m3, mxfp4 -> e2m1."""
    return OPERAND_ELEMENT_FORMAT[check_mx_format(mx_format)]


def p_element_format(mx_format: str) -> str:
    """Element format of P: mxfp8 -> e4m3, mxfp6 and mxfp4 -> e2m3 (see Note [Two-stage P and the row sum])."""
    return P_ELEMENT_FORMAT[check_mx_format(mx_format)]


def schraudolph_bf16(y: torch.Tensor) -> torch.Tensor:
    """``2 ** y`` by Schraudolph's bit trick, as a BF16 tensor. ``y`` float32, log2 units, ``x - m``.
    See Note [Schraudolph exp2 as BF16 bits]."""
    if not isinstance(y, torch.Tensor) or y.dtype != torch.float32:
        raise TypeError(f"y must be a float32 torch.Tensor; got {getattr(y, 'dtype', type(y).__name__)}")
    clamped = y.clamp(-128.0, 128.0)  # keeps the rounding trick in range; -inf -> -128 -> bits 0
    bits = (clamped * 128.0 + (_ROUND_MAGIC + _SCHRAUDOLPH_BIAS)) - _ROUND_MAGIC
    bits = bits.clamp(0.0, 0x7F80)  # y < -127 -> 0; y >= 128 -> +inf (outside the contract)
    p = bits.to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(y), torch.full_like(p, float("nan")), p)


def folded_schraudolph_bf16(z: torch.Tensor) -> torch.Tensor:
    """P's BF16 from the folded score GEMM's ``z`` (float32, the bits as a float, Note [Folded Schraudolph]):
    bits ``clamp(RNE(z), 0, 0x7F80)`` by the same magic-number rounding as ``schraudolph_bf16`` (exact for
    ``|z| < 2**22``; below that the result is negative and clamps to 0); ``-inf`` gives 0, NaN stays NaN."""
    if not isinstance(z, torch.Tensor) or z.dtype != torch.float32:
        raise TypeError(f"z must be a float32 torch.Tensor; got {getattr(z, 'dtype', type(z).__name__)}")
    bits = ((z + _ROUND_MAGIC) - _ROUND_MAGIC).clamp(0.0, 0x7F80)
    p = bits.to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(z), torch.full_like(p, float("nan")), p)


def folded_q_prescale(softmax_scale: float) -> float:
    """``128 * fl32(softmax_scale * log2 e)``, exact in fp32: the factor Q takes before its MX quantization
    with ``exp_fold`` (Note [Folded Schraudolph]). ``c`` is rounded to fp32 as the kernel's ``scale_log2``."""
    return 128.0 * torch.tensor(softmax_scale * math.log2(math.e), dtype=torch.float32).item()


def folded_recovery_bound(recovery_threshold: float) -> float:
    """``B = fl32(16256 + 128 * fl32(recovery_threshold))``: a tile recovers when its ``max z`` exceeds it
    (Note [Folded Schraudolph])."""
    threshold = torch.tensor(recovery_threshold, dtype=torch.float32)
    return (threshold * 128.0 + _SCHRAUDOLPH_BIAS).item()


def folded_max_step(frozen_max: torch.Tensor, addend: torch.Tensor, tile_max: torch.Tensor, recovery_bound: float):
    """``frozen_max_step`` in the folded form (Note [Folded Schraudolph]): ``tile_max`` is the tile's
    ``max z``. Returns ``(new_max, new_addend, shift, rescale, recovered)``: the shift ``D`` to add to the
    tile's ``z`` (0 where the max did not move), and ``rescale`` for ``O`` and ``l`` as ``frozen_max_step``'s."""
    first = ~torch.isfinite(frozen_max) & torch.isfinite(tile_max)
    recovered = torch.isfinite(frozen_max) & (tile_max > recovery_bound)
    moved = first | recovered
    shift = torch.where(moved, _SCHRAUDOLPH_BIAS - tile_max, torch.zeros_like(tile_max))
    new_addend = addend + shift
    new_max = torch.where(moved, (_SCHRAUDOLPH_BIAS - new_addend) / 128.0, frozen_max)
    rescale = torch.where(recovered, torch.exp2(frozen_max - new_max), torch.ones_like(frozen_max))
    rescale = torch.where(first, torch.zeros_like(rescale), rescale)
    return new_max, new_addend, shift, rescale, recovered


def quantize_p(p: torch.Tensor, mx_format: str) -> torch.Tensor:
    """MX round trip of P along its last dim (keys) in blocks of 32, in the P element format.
    Returns float32 values. The caller aligns the last dim's start with a multiple of 32."""
    return fake_quantize_mx(p.float(), p_element_format(mx_format), MX_BLOCK, dim=-1)


def _quantize_along_keys(v: torch.Tensor, fmt: str, key_dim: int, cu_seqlens: Optional[torch.Tensor]):
    if cu_seqlens is None:
        return fake_quantize_mx(v.float(), fmt, MX_BLOCK, dim=key_dim)
    bounds = cu_seqlens.tolist()
    pieces = [
        fake_quantize_mx(v[start:end].float(), fmt, MX_BLOCK, dim=key_dim)
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(pieces, dim=key_dim) if pieces else v.float()


def quantize_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mx_format: str,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    q_prescale: float = 1.0,
):
    """MX round trip of the three operands, as float32: Q and K in blocks of 32 along head_dim, V in
    blocks of 32 along keys (dim 1 of (batch, seqlen, heads, head_dim); varlen (total, heads, head_dim)
    with ``cu_seqlens_k``: dim 0, per sequence). See Note [Operand quantization]. ``q_prescale`` (an fp32
    value) multiplies Q in fp32 before its quantization (``folded_q_prescale``, Note [Folded Schraudolph])."""
    fmt = operand_element_format(mx_format)
    key_dim = 0 if cu_seqlens_k is not None else 1
    q = q.float() if q_prescale == 1.0 else q.float() * q_prescale
    return (
        fake_quantize_mx(q, fmt, MX_BLOCK, dim=-1),
        fake_quantize_mx(k.float(), fmt, MX_BLOCK, dim=-1),
        _quantize_along_keys(v, fmt, key_dim, cu_seqlens_k),
    )


def needs_recovery(tile_max: torch.Tensor, frozen_max: torch.Tensor, recovery_threshold: float) -> torch.Tensor:
    """True where a frozen max exists (finite) and the tile max exceeds it by more than the threshold.
    See Note [Frozen reference max]."""
    return torch.isfinite(frozen_max) & (tile_max > frozen_max + recovery_threshold)


def frozen_max_step(frozen_max: torch.Tensor, tile_max: torch.Tensor, recovery_threshold: float):
    """One tile of the frozen-max rule. Returns ``(new_max, rescale, recovered)``: the max to use for
    this tile, the factor ``exp2(old - new)`` for ``O`` and ``l`` (1 when nothing moved, 0 when the max is
    set for the first time: ``O`` and ``l`` are still 0 then), and where a recovery happened."""
    first = ~torch.isfinite(frozen_max) & torch.isfinite(tile_max)
    recovered = needs_recovery(tile_max, frozen_max, recovery_threshold)
    new_max = torch.where(first | recovered, tile_max, frozen_max)
    rescale = torch.where(recovered, torch.exp2(frozen_max - new_max), torch.ones_like(frozen_max))
    rescale = torch.where(first, torch.zeros_like(rescale), rescale)
    return new_max, rescale, recovered


def hybrid_format(step: int, num_steps: int, edge_steps: int = 3) -> str:
    """The paper's hybrid schedule: MXFP6 for the first and last ``edge_steps`` denoising steps,
    MXFP4 between. ``step`` counts from 0."""
    for name, value in (("step", step), ("num_steps", num_steps), ("edge_steps", edge_steps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if num_steps < 1 or edge_steps < 0:
        raise ValueError(f"num_steps must be >= 1 and edge_steps >= 0; got {num_steps}, {edge_steps}")
    if not 0 <= step < num_steps:
        raise ValueError(f"step must be in [0, {num_steps}); got {step}")
    return "mxfp6" if step < edge_steps or step >= num_steps - edge_steps else "mxfp4"


def _dense_reference(q, k, v, causal, scale_log2, mx_format, recovery_threshold, tile_n, exp_fold):
    """The tile loop. q (b, h, sq, d), k/v (b, h, sk, d): float32, already MX-quantized (with ``exp_fold``,
    q prescaled first: Note [Folded Schraudolph])."""
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    out = torch.zeros(batch, heads, seqlen_q, v.shape[-1], dtype=torch.float32, device=q.device)
    row_sum = torch.zeros(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    frozen = torch.full_like(row_sum, -math.inf)
    recoveries = torch.zeros(batch, heads, seqlen_q, dtype=torch.int64, device=q.device)
    rows = torch.arange(seqlen_q, device=q.device)[:, None]
    addend = torch.zeros_like(row_sum)  # exp_fold: the score GEMM's per-row start, 0 until the max is set
    recovery_bound = folded_recovery_bound(recovery_threshold)
    for start in range(0, seqlen_k, tile_n):
        keys = torch.arange(start, min(start + tile_n, seqlen_k), device=q.device)
        scores = q @ k[:, :, keys].transpose(-1, -2)
        x = scores + addend[..., None] if exp_fold else scores * scale_log2
        if causal:
            x = x.masked_fill(keys[None, :] > rows + (seqlen_k - seqlen_q), -math.inf)
        tile_max = x.amax(dim=-1)
        if exp_fold:  # x is z, the folded GEMM's output (Note [Folded Schraudolph])
            frozen, addend, shift, rescale, recovered = folded_max_step(frozen, addend, tile_max, recovery_bound)
        else:
            frozen, rescale, recovered = frozen_max_step(frozen, tile_max, recovery_threshold)
        recoveries += recovered
        out *= rescale[..., None]
        row_sum *= rescale
        if exp_fold:
            p = folded_schraudolph_bf16(x + shift[..., None]).float()
        else:
            p = schraudolph_bf16(x - frozen[..., None]).float()
            p = p.masked_fill(x == -math.inf, 0.0)  # also the rows whose max is not set yet (-inf - -inf)
        p = quantize_p(p, mx_format)
        row_sum += p.sum(dim=-1)
        out += p @ v[:, :, keys]
    return out, row_sum, frozen, recoveries


def fused_softmax_attention_reference(
    q,
    k,
    v,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    mx_format: str = "mxfp8",
    recovery_threshold: float = 8.0,
    tile_n: int = 128,
    return_counters: bool = False,
    exp_fold: bool = False,
):
    """Fused-Softmax attention, dense layout (batch, seqlen, heads, head_dim), GQA, causal aligned
    bottom-right. Pure torch, float32 throughout (the MX-quantized operands are exact in float32).
    ``exp_fold=True``: the frozen max and the Schraudolph map folded into the score GEMM, Q prescaled
    before its quantization (Note [Folded Schraudolph]).

    Returns ``(out, lse)`` (out float32 like q; lse float32 natural log, (batch, heads_q, seqlen_q)),
    or ``(out, lse, counters)`` with ``counters = {"tiles", "recoveries"}`` (per-row recoveries as an
    int64 tensor (batch, heads_q, seqlen_q)). A fully masked row gives out 0 and lse -inf.
    """
    check_mx_format(mx_format)
    recovery_threshold = check_recovery_threshold(recovery_threshold)
    if isinstance(tile_n, bool) or not isinstance(tile_n, int) or tile_n < MX_BLOCK or tile_n % MX_BLOCK:
        raise ValueError(f"tile_n must be a positive multiple of {MX_BLOCK}; got {tile_n!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D (batch, seqlen, heads, head_dim)")
    heads_q, heads_k = q.shape[2], k.shape[2]
    if heads_q % heads_k:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_k ({heads_k})")
    if not isinstance(exp_fold, bool):
        raise TypeError(f"exp_fold must be a bool; got {type(exp_fold).__name__}")
    softmax_scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    q_prescale = folded_q_prescale(softmax_scale) if exp_fold else 1.0
    qq, kq, vq = quantize_operands(q, k, v, mx_format, q_prescale=q_prescale)
    group = heads_q // heads_k
    qq = qq.transpose(1, 2)
    kq = kq.transpose(1, 2).repeat_interleave(group, dim=1)
    vq = vq.transpose(1, 2).repeat_interleave(group, dim=1)
    out, row_sum, frozen, recoveries = _dense_reference(
        qq, kq, vq, causal, softmax_scale * math.log2(math.e), mx_format, recovery_threshold, tile_n, exp_fold
    )
    masked = row_sum == 0
    out = torch.where(masked[..., None], torch.zeros_like(out), out / row_sum[..., None])
    lse = torch.where(masked, torch.full_like(row_sum, -math.inf), (frozen + torch.log2(row_sum)) * math.log(2.0))
    out = out.transpose(1, 2)
    if return_counters:
        tiles = -(-k.shape[1] // tile_n)
        return out, lse, {"tiles": tiles, "recoveries": recoveries}
    return out, lse


def fused_softmax_attention_reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
    """Varlen twin of ``fused_softmax_attention_reference``: q (total_q, heads_q, head_dim), k/v
    (total_k, heads_k, head_dim), int cu_seqlens (batch + 1). Each sequence is its own dense problem
    (V's MX blocks start at the sequence's first key). Returns out (total_q, heads_q, head_dim) and lse
    (heads_q, total_q), and with ``return_counters=True`` per-row recoveries (heads_q, total_q)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v must be 3-D (total_tokens, heads, head_dim) for varlen")
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(bounds_q) != len(bounds_k) or len(bounds_q) < 2:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 2 entries")
    outs, lses, recoveries = [], [], []
    for sq0, sq1, sk0, sk1 in zip(bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:]):
        result = fused_softmax_attention_reference(q[None, sq0:sq1], k[None, sk0:sk1], v[None, sk0:sk1], **options)
        outs.append(result[0][0])
        lses.append(result[1][0])
        if len(result) == 3:
            recoveries.append(result[2]["recoveries"][0])
    out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=-1)
    if recoveries:
        return out, lse, {"recoveries": torch.cat(recoveries, dim=-1)}
    return out, lse
