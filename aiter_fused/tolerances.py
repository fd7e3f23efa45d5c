"""How close the Fused-Softmax kernel must come to its semantic reference
(`fa4_rowmax.reference.fused_softmax`), shared by the tests and `scripts/aiter_fused_numerics.py`.

Both compute the same quantized scores, Schraudolph bits and MX-rounded P; what remains is summation
order. With fp32 sums (dot modes "bf16" and "scaled", gfx950's MX dot, and Triton's CPU interpreter in
every mode) each row's LSE agrees to ``LSE_TOL``. Hopper's FP8 MMA does not sum in fp32, hence
Note [FP8 LSE tolerance].

Note [FP8 LSE tolerance]
~~~~~~~~~~~~~~~~~~~~~~~~
Hopper's FP8 MMA sums the 32 products of a dot in a narrower accumulator than fp32 (kernel.py, Note
[FP8 accumulation]), so "fp8" scores differ from the reference's by ~4e-5 (median) to ~6e-4 (max)
log2 units. Through the Schraudolph bits and the e4m3 rounding of P that becomes a rare whole e4m3
step of one P element, which moves its row's LSE by about ln(1 + step / row_sum): ~1e-3 in rows of
500-1000 keys, ~1e-2 in the varlen case's rows of 5-64 keys (the H200's 6.4e-3 and 1.1e-2). It is
per row and rare, not systematic. A CPU emulation of the kernel with that accumulator (e8m13; 13 or 14
fraction bits, truncated or rounded, groups of 16 or 32 products; the numerics script's mxfp8 shapes, three
CPU seeds each, eleven for varlen causal) gave over all rows: median <= 7.6e-5, 99th percentile <=
1.7e-3, maximum <= 2.1e-2 (varlen causal; dense head_dim 64 <= 8.9e-3, head_dim 128 <= 1.6e-3), and
none for MXFP6/MXFP4 but for rare 1e-4 (as on the H200). The "fp8" check asks for about 2x (median,
99th percentile) and 1.4x (maximum) of those: ``FP8_LSE_MEDIAN_TOL`` and ``FP8_LSE_P99_TOL`` catch anything
that moves most rows (a wrong scale, block or mask), ``FP8_LSE_MAX_TOL`` bounds the tail (one e4m3 step, 1/8,
of an element holding a quarter of its row's weight). The other modes sum in fp32, and MXFP6/MXFP4 products
are held exactly: every row within ``LSE_TOL``.

Note [Folded Schraudolph tolerance]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``exp_fold`` (kernel.py and fused_softmax.py, Note [Folded Schraudolph]) P's bits are ``RNE(z)`` of an
fp32 ``z`` held at the addend's magnitude: after the max step ``z <= 16256 + 128 * threshold < 2**15`` (17280 at
the default 8) and the addend lies in [8128, 32512] for max scores in [-127, 63.5] log2 units, so every
rounding there is at most half of ``FOLD_Z_ULP = 2**-9`` (fp32's ulp on [2**14, 2**15)). Let two evaluations
(kernel and reference) of the same fold differ by at most ``r`` such half-ulps in ``z`` (``z_roundings``:
2 under the interpreter, whose dot is ``fl(matmul) + acc`` like the reference's, so only the addend's add and
the re-derivation's round inputs that differ, by the dots' fp32 order; on a GPU the MFMA/MMA adds the addend
inside its sum: ``gpu_fold_z_roundings``, an assumption of one fp32 rounding per instruction along K, not
measured). Then:
- the frozen max ``m = (16256 - C) / 128``: each move (the first tile, each recovery) adds to ``C``'s
  difference at most ``z``'s (``r``) and two roundings of its own (the shift's and the addend's), so
  ``|dm| <= moves * (r + 2) * 2**-10 / 128`` log2 units; the LSE takes ``ln 2`` of that, plus
  ``FOLD_FP32_LSE_TOL``, the interpreter's fp32 allowance without the fold (the 1e-5 the kernel tests held
  before): ``fold_lse_tol``. A row's P elements all see the same ``dm`` inside ``z`` but are rounded to
  integers, so the LSE keeps it;
- a P flip: ``RNE(z)`` moves by one where a half-integer lies between the two ``z``, at most ``r * 2**-10``
  of the elements (fractional parts uniform): the doc's 2**-9 to 2**-10 for ``r`` = 1 to 2. It moves BF16 P
  by one step (2**-7 relative); the quantized P only where that crosses an e4m3/e2m3 rounding boundary,
  1 in 16 (BF16 keeps 4 more mantissa bits), then by one element step (up to 1/8 of the element). The rows
  holding such a flip may exceed ``fold_lse_tol``; their expected count is ``rows * keys * r * 2**-10 / 16``
  and ``fold_flip_rows_allowed`` allows the Poisson count's 1 - 1e-3 quantile of it. Every row stays within
  the cap ``FP8_LSE_MAX_TOL``: one element step (1/8) of an element holding a quarter of its row's weight.
  Scores beyond that range (the adversarial tests' 3000) put the addend in a coarser binade: ``fold_z_ulp``;
- the output: BF16 rounding (2**-9 relative) plus the flips, a fraction ``r * 2**-14`` of elements moved by
  at most 1/8: in norm ``2**-3 * sqrt(r * 2**-14)`` relative: ``fold_out_rel_tol`` (never below
  ``OUT_REL_TOL``, which every mode gets).
The fold's own change against the unfolded form is not a tolerance: Q is quantized after the prescale,
different elements (Note [Folded Schraudolph]); compared on the same scores (the unfolded reference fed the
prescaled, quantized Q with ``scale_log2 = 2**-7``), the same rules hold with ``r = 2`` (the addend's and the
re-derivation's roundings against the unfolded form's ``fl(x - m)``, which rounds far below ``FOLD_Z_ULP``).
"""

from __future__ import annotations

import math

import torch

OUT_REL_TOL = 6e-3  # BF16 output rounding plus rare one-step P flips from the fp32 dot order
LSE_TOL = 1e-3  # with fp32 sums (H200 "bf16"/"scaled": <= 1e-6; the bound leaves room for one rare P flip)
FP8_LSE_MEDIAN_TOL = 2e-4  # Note [FP8 LSE tolerance]
FP8_LSE_P99_TOL = 3e-3
FP8_LSE_MAX_TOL = 3e-2
FOLD_Z_ULP = 2.0**-9  # Note [Folded Schraudolph tolerance]: fp32's ulp on [2**14, 2**15)
FOLD_FP32_LSE_TOL = 1e-5  # the interpreter's fp32 LSE allowance without the fold
INTERPRETER_FOLD_Z_ROUNDINGS = 2
_FLIP_ROWS_QUANTILE = 1e-3


def gpu_fold_z_roundings(head_dim: int, dot_mode: str) -> int:
    """Note [Folded Schraudolph tolerance]: fp32 roundings at the addend's magnitude a GPU's folded score dot
    may do differently from the reference, assuming one per MFMA/MMA along K (K = 64 for gfx950's scaled
    f8f6f4 MFMA, 16 for the BF16 ones and Hopper's BF16 wgmma), plus the re-derivation's add. Not measured."""
    return head_dim // (64 if dot_mode == "scaled" else 16) + 1


def fold_z_ulp(max_abs_score_log2: float) -> float:
    """fp32's ulp at the fold's largest magnitude: the addend ``16256 - 128 m`` and ``z`` for max scores up to
    ``max_abs_score_log2`` (log2 units); ``FOLD_Z_ULP`` in the range Note [Folded Schraudolph tolerance] assumes."""
    return max(FOLD_Z_ULP, 2.0 ** (math.floor(math.log2(16256 + 128 * max_abs_score_log2)) - 23))


def fold_lse_tol(moves: int, z_roundings: int, z_ulp: float = FOLD_Z_ULP) -> float:
    """Per-row LSE bound (natural log) between two evaluations of the fold without a P flip, for rows whose
    frozen max moved at most ``moves`` times (1 + recoveries). Note [Folded Schraudolph tolerance]."""
    return math.log(2.0) * moves * (z_roundings + 2) * (z_ulp / 2) / 128 + FOLD_FP32_LSE_TOL


def fold_flip_rows_allowed(rows: int, keys: int, z_roundings: int, z_ulp: float = FOLD_Z_ULP) -> int:
    """How many of ``rows`` rows (of at most ``keys`` keys) may hold a quantized-P flip: the 1 - 1e-3 quantile of a
    Poisson count with the expected ``rows * keys * z_roundings * (z_ulp / 2) / 16``."""
    expected = rows * keys * z_roundings * (z_ulp / 2) / 16
    allowed, term = 0, math.exp(-expected)
    cumulative = term
    while 1.0 - cumulative > _FLIP_ROWS_QUANTILE:
        allowed += 1
        term *= expected / allowed
        cumulative += term
    return allowed


def fold_out_rel_tol(z_roundings: int) -> float:
    """Norm-relative output bound with the fold: BF16 output rounding plus the flips' share; at least OUT_REL_TOL."""
    return max(OUT_REL_TOL, 2.0**-9 + 2.0**-3 * math.sqrt(z_roundings * (FOLD_Z_ULP / 2) / 16))


def fold_lse_ok(
    lse: torch.Tensor, ref_lse: torch.Tensor, moves: int, keys: int, z_roundings: int, z_ulp: float = FOLD_Z_ULP
) -> bool:
    """Note [Folded Schraudolph tolerance] over the rows the reference gives a finite LSE: all within the cap
    FP8_LSE_MAX_TOL, all but ``fold_flip_rows_allowed`` within ``fold_lse_tol``."""
    finite = torch.isfinite(ref_lse)
    diff = (lse[finite] - ref_lse[finite]).abs().double()
    if not diff.numel():
        return True
    above = int((diff > fold_lse_tol(moves, z_roundings, z_ulp)).sum())
    allowed = fold_flip_rows_allowed(diff.numel(), keys, z_roundings, z_ulp)
    return diff.max().item() < FP8_LSE_MAX_TOL and above <= allowed


def lse_stats(lse: torch.Tensor, ref_lse: torch.Tensor) -> dict[str, float]:
    """|lse - ref_lse| over the rows the reference gives a finite LSE: max, 99th percentile, median."""
    finite = torch.isfinite(ref_lse)
    diff = (lse[finite] - ref_lse[finite]).abs().double()
    if not diff.numel():
        return {"lse_max_diff": 0.0, "lse_p99_diff": 0.0, "lse_median_diff": 0.0}
    return {
        "lse_max_diff": diff.max().item(),
        "lse_p99_diff": diff.quantile(0.99).item(),
        "lse_median_diff": diff.median().item(),
    }


def lse_ok(dot_mode: str, mx_format: str, stats: dict[str, float], fp32_sums: bool = False) -> bool:
    """Every row within LSE_TOL where the dots sum in fp32 (every mode but "fp8" on a GPU, or any mode when
    `fp32_sums`, e.g. under Triton's interpreter) and for MXFP6/MXFP4, whose e2m3/e2m1 products lie on a grid
    Hopper's FP8 accumulator holds; Note [FP8 LSE tolerance] for MXFP8 through Hopper's FP8 MMA."""
    if dot_mode != "fp8" or mx_format != "mxfp8" or fp32_sums:
        return stats["lse_max_diff"] < LSE_TOL
    return (
        stats["lse_max_diff"] < FP8_LSE_MAX_TOL
        and stats["lse_p99_diff"] < FP8_LSE_P99_TOL
        and stats["lse_median_diff"] < FP8_LSE_MEDIAN_TOL
    )
