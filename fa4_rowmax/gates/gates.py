"""Correctness gates for a Rowmax-H15 attention backend (the paper's Figure S1), element by element.

A backend is any callable ``backend(q, k, v, causal) -> (out, lse)`` (docs/design.md); its P is read back
through one-hot V (readback.py). Two gates:

- ``single_tile_gate``: one causal 128x128 tile (8,256 valid elements in 128 rows). The backend's P must
  equal the Rowmax-H15 reference's P to rounding.
- ``multi_tile_gate``: a multi-tile problem (causal 512x512: 131,328 valid elements per head) against exact
  fp64 softmax: the normalised ratio ``log2(P_kernel / P_exact)`` within +-log2(1.5) = +-0.585 octave, and
  the recovered unnormalised error ``log2(w_hat / w)`` inside the H15 envelope [-0.25, +0.335], read both
  through the LSE and through the per-row normalisation shift at the row max (Note [Unnormalised weights
  from P and the LSE] in readback.py).

``run_gates`` runs both over causal and non-causal problems, seqlens that are not multiples of the tile,
GQA, fully masked rows and several seeds; ``format_report`` prints the result as a table. ``dtype`` may be
FP8 (e4m3 q, k, v; BF16 out; Note [FP8 inputs in the gates]).

Note [Gate tolerances]
    Every bound is widened by the rounding a correct backend may carry, derived from the dtypes (never
    tuned to make a run pass); all in octaves (log2 units), using ``log2(1 + u) <= u / ln 2``:
    - P's own rounding: to the P dtype before P@V (``u_p``, q's dtype as FA4 does) and the final quotient
      to the output dtype (``u_out``): ``(u_p + u_out) / ln 2`` per backend. ``u`` is half the dtype's
      machine epsilon: bf16 2^-8 (0.0056 octave), fp16 2^-11, fp32 2^-24, e4m3 2^-4. Rowmax-H15 values are
      exact in all of them (one mantissa bit); exact softmax's are not.
    - The fp32 row sum over ``n`` keys: relative error ``<= n * 2^-24``.
    - The fp32 LSE: ``<= 2^-23 * (|lse| + 1)`` nats (the ``ln`` and the ``m * ln 2`` add).
    - The fp32 scores: ``|x_fp32 - x| <= scale_log2 * D * 2^-24 * sum_d |q_d k_d| + 2^-23 * (|x| + |m|)``
      (recursive summation bound over the head dim ``D``, then the FFMA with the anchor ``m``).
    The single-tile gate compares two backends, so their rounding adds: bf16 gives about +-0.023 octave,
    fp32 about 1e-3 (score term). A lattice step of H15 is at least log2(4/3) = 0.415 octave, so no
    rounding can hide a wrong lattice point.

Note [Lattice ties in the single-tile gate]
    ``H`` rounds ``2 * (x - m)`` to an integer. Where the exact ``x - m`` lies within the fp32 score error
    (Note [Gate tolerances]) of a rounding boundary, a correct kernel and the reference may round it to
    neighbouring lattice points: that element then differs by one lattice step (a factor 1.5 or 4/3) and,
    through the row sum, the whole row's P shifts a little. Such a flip is accepted only inside that
    window and only at exactly one lattice step; its row is then compared on the unnormalised weights
    ``w_hat = P * 2^(lse log2 e)``, which the LSE keeps free of the row-sum change. Flips are counted in the
    report. Everywhere else the normalised P is compared directly.

Note [FP8 inputs in the gates]
    With FP8 (e4m3) q and k the inputs are drawn as for the other dtypes and rounded to e4m3; the exact fp64
    scores are computed from those same e4m3 values, so input quantization is never counted as softmax
    error. V is one-hot (exact in e4m3), the output is BF16 (its rounding enters as ``u_out``). What
    changes, all derived from FA4's FP8 rules (max_offset 8, P in e4m3):
    - Scores: the FP8 score GEMM sums e4m3 products in Hopper's FP8 accumulator: per 32-deep wgmma step
      the products and the running sum are aligned to the largest exponent and truncated to 13 fraction
      bits. A score is off by up to ``scale_log2 * fp8_score_error_bound(q, k)`` (Note [Hopper FP8
      accumulation], tolerances.py; the kernel bounds use the same function) instead of the fp32 bound.
      A 14-bit-rounding model, ``2^-13 * sum_d |q_d k_d|`` per score, is exceeded by that rule wherever a
      block's small products fall below the largest one's grid (tests/test_gates_fp8.py shows it on the gate's
      inputs).
    - P's normal range: P is the weight relative to the anchor times ``2^max_offset``, held in e4m3, whose
      normals end at ``2^-6``: weights below ``2^-14`` of the anchor weight are flushed to 0 (H15, Note [H15
      with FP8 P] in reference/attention.py) or subnormal (exact's convert). Like elements below the output
      dtype's normal range (Note [Underflow of P in the output dtype], readback.py) they are not resolvable
      through P: they are excluded from the ratio checks and counted ("below P's normal range"), and
      judged only in that their P must not come out above the floor. The anchor never exceeds the row
      max, so an element at least ``2^-14`` (plus headroom) of the row's top weight below it is normal at
      every anchor. The 16-bit and 32-bit P dtypes reach at least as low as the output dtype: no floor.
    - Flushed weights leave the H15 row sum (it adds the very P that enters P@V), so the normalised P of
      the others rises by up to ``1 / (1 - delta)``, ``delta`` the exact mass of the row's unresolvable
      elements: the multi-tile ratio's upper bound gains ``-log2(1 - delta)`` (largest over rows; the LSE
      and row-max views see the weights themselves and need nothing). Exact's row sum adds the fp32
      weights (FA4's FP8 rule): delta is then an over-estimate, never an under-estimate.
    - Single tile: a correct FP8 H15 backend builds P's bytes from the lattice index (no float P, no
      rounding: every H15 weight above the flush is exact in e4m3), so the P-rounding term is 0 there; at
      e4m3's ``u = 2^-4`` it would be 0.18 octave over both sides, 44 % of the smallest lattice step, and
      would let wrong lattice points through. The 16-bit dtypes keep their (small) conservative term.
      Reference and kernel flush at the same anchor (the row max), except one lattice point: H15 weight
      ``1.5 * 2^-7`` (``2^-15 * 1.5`` of the top weight, half-octave index ``2 log2(tiny) - 1`` = -13 after
      the offset) is written ``2^-7`` (e4m3 byte 4) by the SM90 kernel and flushed by the reference
      (docs/fp8_sm90.md). That P itself is below the floor, which sits half an octave below the smallest
      normal weight (``2^-14.5`` of the row's top P, midway between byte 8 = ``2^-14`` and byte 4 =
      ``2^-15``): byte 4 reads as 0, while any element raised to the smallest normal weight or above still
      fails by at least 0.5 octave. Its weight joins the kernel's row sum, moving every other P of the row
      by at most ``log2(1 + n_4 * 2^-15 * P_top)`` octaves (``n_4`` the elements on that lattice point or
      within score rounding of it, ``P_top`` the row's normalised top weight; the tolerance takes
      ``2^-14`` per element, which also covers the flush-line ties below): the largest over rows joins the
      tolerance (below 1e-3 octave at the gate's score spread, seeds 0-2). So the gate covers the kernel's
      rule without changing the reference, and widens nothing else.
      The flush line is a lattice boundary too (Note [Lattice ties in the single-tile gate]): an element
      within score rounding of it (``2 (x - m) = 2 log2(tiny) - 0.5 - 2 max_offset`` = -28.5) may come out
      as the smallest normal weight on one side and byte 4 or 0 on the other. For those elements alone the
      floor is just above the smallest normal weight (``2^(-14 + tol)`` of the top P), so either reads as
      the floor; each may also move its row sum, by at most ``2^-14 * P_top``, which the row-sum term above
      takes for every element on or near the byte-4 point.
    - Hopper's FP8 P V accumulation (the kernel's ``pv_accumulation``, Note [Two-level P V accumulation bound] in
      tolerances.py): through one-hot V each output element holds one key's weight, so its sum has one nonzero
      product and a tile's wgmma adds it exactly. What is left: single-level feeds that weight, rescaled in
      fp32, back as the accumulator input of every later tile, which truncates it to 13 fraction bits (toward
      zero, at most 2^-13 relative per later tile: ``(T - 1) 2^-13`` over ``T`` KV tiles of ``tile_n`` keys);
      two-level promotes it by an FFMA, one fp32 rounding per later tile (``(T - 1) 2^-24``). The ratio checks
      gain ``-log2(1 - that)``.
    - The row sum by the MMA (the kernel's ``row_sum="mma"``): a ones column of the same GEMM, summed in that
      accumulator, low by up to ``r = fp8_pv_sum_error(seqlen_k, pv_accumulation, tile_n)`` of itself (toward
      zero; tolerances.py), so P reads high by up to ``-log2(1 - r)``; in exact mode the column adds the e4m3
      P where the FADD row sum adds the fp32 weights, up to ``u_p`` more, which the multi-tile gate (where exact
      is a control that must pass) adds, and the single-tile gate (H15 only, whose P is exact e4m3) does not.
      The LSE views see the weights times the same row sum: it cancels there. For one row sum, single-level's
      terms are at least two-level's.
"""

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fa4_rowmax.config import FP8_MAX_OFFSET, PV_ACCUMULATIONS
from fa4_rowmax.gates.readback import Backend, ProbabilityReadback, read_probabilities, resolvable, unit_roundoff
from fa4_rowmax.gates.tolerances import fp8_pv_sum_error, fp8_score_error_bound

H15_ENVELOPE = (-0.25, math.log2(1.5) - 0.25)  # log2(H(y)) - y, octaves
H15_RATIO_BOUND = math.log2(1.5)  # |log2(P_kernel / P_exact)|: two envelope extremes apart
SINGLE_TILE = 128  # the paper's tile: causal 128x128, 8,256 valid elements
FP32_UNIT_ROUNDOFF = 2.0**-24
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ROW_SUMS = ("fadd", "mma")  # the SM90 FP8 forward's row sum: fp32 FADDs, or a ones column of the P V GEMM
FP8_ACCUMULATOR_FRACTION_BITS = 13

Where = tuple[int, int, int, int]  # (batch, head_q, row, col)


@dataclass(frozen=True)
class Check:
    """One element-wise test: every judged value must lie in ``bound`` (closed interval)."""

    name: str
    passed: bool
    n_elements: int
    worst: float  # the value nearest to (or furthest beyond) the bound; NaN when nothing was judged
    bound: tuple[float, float]
    where: Where | None  # of ``worst``; col is -1 for a per-row value
    note: str = ""


@dataclass(frozen=True)
class GateReport:
    """A gate's verdict: all of its checks. ``worst``/``bound``/``where`` are the deciding check's."""

    name: str
    setup: str
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def deciding(self) -> Check:
        """The first failing check, or the gate's headline check when all pass."""
        return next((c for c in self.checks if not c.passed), self.checks[0])

    @property
    def n_elements(self) -> int:
        return self.checks[0].n_elements

    @property
    def worst(self) -> float:
        return self.deciding.worst

    @property
    def bound(self) -> tuple[float, float]:
        return self.deciding.bound

    @property
    def where(self) -> Where | None:
        return self.deciding.where

    def __str__(self) -> str:
        c = self.deciding
        return (
            f"{'PASS' if self.passed else 'FAIL'} {self.name} [{self.setup}] {c.name}: worst {c.worst:+.4g} "
            f"in [{c.bound[0]:+.4g}, {c.bound[1]:+.4g}] at {c.where}, {self.n_elements:,} elements"
        )


def _evaluate(
    name: str, values: torch.Tensor, judged: torch.Tensor, bound: tuple[float, float], note: str = ""
) -> Check:
    """Judge ``values`` (batch, heads, rows[, cols]) where ``judged``; NaN counts as out of bound."""
    lo, hi = bound
    n = int(judged.sum())
    if n == 0:
        return Check(name, True, 0, math.nan, bound, None, note)
    # Distance beyond the bound (negative inside). inf - inf is NaN: inside the bound that is a value
    # sitting on an infinite bound (0), outside it (a NaN value included) it is infinitely out.
    excess = torch.maximum(values - hi, lo - values)
    inside = (values >= lo) & (values <= hi)
    excess = torch.where(excess.isnan(), torch.where(inside, 0.0, math.inf), excess)
    excess = torch.where(judged, excess, -math.inf)
    flat = int(excess.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), values.shape))
    where = index if len(index) == 4 else (*index, -1)
    passed = bool(excess[index] <= 0)
    return Check(name, passed, n, float(values[index]), bound, where, note)


def _random_qk(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, device, seed, q_std):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=generator, dtype=torch.float64) * q_std
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, generator=generator, dtype=torch.float64)
    return q.to(dtype=dtype, device=device), k.to(dtype=dtype, device=device)


@dataclass(frozen=True)
class Fp8Accumulation:
    """The FP8 kernel's knobs that set how its P V GEMM adds up (Note [FP8 inputs in the gates]): ``row_sum``
    ("fadd" | "mma"), ``pv_accumulation`` ("single" | "two_level") and its KV tile ``tile_n``. For one row sum
    and ``tile_n``, single-level's widening is at least two-level's, so the default (single-level, FADD) covers a
    two-level kernel with the FADD row sum; an MMA row sum widens further."""

    row_sum: str = "fadd"
    pv_accumulation: str = "single"
    tile_n: int = 128

    def __post_init__(self) -> None:
        if self.row_sum not in ROW_SUMS:
            raise ValueError(f"Fp8Accumulation.row_sum must be one of {ROW_SUMS}, got {self.row_sum!r}")
        if self.pv_accumulation not in PV_ACCUMULATIONS:
            raise ValueError(
                f"Fp8Accumulation.pv_accumulation must be one of {PV_ACCUMULATIONS}, got {self.pv_accumulation!r}"
            )
        if isinstance(self.tile_n, bool) or not isinstance(self.tile_n, int) or self.tile_n < 1:
            raise ValueError(f"Fp8Accumulation.tile_n must be a positive int, got {self.tile_n!r}")

    def widening_log2(self, seqlen_k: int, u_p: float, exact_row_sum: bool) -> float:
        """Octaves the P ratio checks gain (Note [FP8 inputs in the gates]); ``u_p`` is P's unit roundoff, charged
        when ``exact_row_sum`` (an MMA row sum of e4m3 P where the reference adds fp32 weights)."""
        later_tiles = -(-seqlen_k // self.tile_n) - 1
        per_tile = 2.0**-FP8_ACCUMULATOR_FRACTION_BITS if self.pv_accumulation == "single" else FP32_UNIT_ROUNDOFF
        loss = later_tiles * per_tile
        widening = -math.log2(1 - loss) if loss < 1 else math.inf
        if self.row_sum == "mma":
            r = fp8_pv_sum_error(seqlen_k, self.pv_accumulation, self.tile_n)
            widening += (-math.log2(1 - r) if r < 1 else math.inf) + (u_p / math.log(2) if exact_row_sum else 0.0)
        return widening


def _check_accumulation(accumulation, dtype) -> Fp8Accumulation:
    if accumulation is None:
        return Fp8Accumulation()
    if not isinstance(accumulation, Fp8Accumulation):
        raise TypeError(f"accumulation must be None or an Fp8Accumulation, got {type(accumulation).__name__}")
    if accumulation != Fp8Accumulation() and dtype not in FP8_DTYPES:
        raise ValueError(
            f"accumulation={accumulation} applies to FP8 inputs (dtype one of {FP8_DTYPES}), got dtype {dtype}; "
            "accepted there: None"
        )
    return accumulation


def _valid_mask(seqlen_q: int, seqlen_k: int, causal: bool, device) -> torch.Tensor:
    """(seqlen_q, seqlen_k) keys each query sees; causal is aligned bottom-right (docs/design.md)."""
    if not causal:
        return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return cols <= rows + (seqlen_k - seqlen_q)


def _log2_scores(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact scores ``x = q.k * head_dim^-0.5 * log2(e)`` in fp64, (batch, heads_q, seqlen_q, seqlen_k),
    and the error bound on the kernel's scores (fp32 GEMM, or Hopper's FP8 accumulation for FP8 inputs; Note
    [Gate tolerances]) without the anchor term."""
    head_dim = q.shape[3]
    group = q.shape[2] // k.shape[2]
    q64 = q.to(torch.float64).permute(0, 2, 1, 3)
    k64 = k.to(torch.float64).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scale_log2 = head_dim**-0.5 * math.log2(math.e)
    x = q64 @ k64.transpose(-1, -2) * scale_log2
    if q.dtype in FP8_DTYPES:  # Note [FP8 inputs in the gates]: Hopper's FP8 accumulation, per score
        dot_error = fp8_score_error_bound(q64, k64, q.dtype) * scale_log2
    else:
        dot_error = head_dim * FP32_UNIT_ROUNDOFF * (q64.abs() @ k64.abs().transpose(-1, -2)) * scale_log2
    return x, dot_error + 2 * FP32_UNIT_ROUNDOFF * x.abs()


def _p_unit_roundoff(dtype: torch.dtype) -> float:
    """P is held in q's dtype before P@V, never finer than fp32 (Note [Gate tolerances])."""
    return max(unit_roundoff(dtype), FP32_UNIT_ROUNDOFF)


def _p_floor_log2(dtype: torch.dtype) -> float:
    """log2 of the smallest normal weight relative to the anchor weight that P in q's dtype holds: FP8 P
    carries ``2^max_offset``, so ``log2(tiny) - max_offset`` (-14 for e4m3); -inf for the other dtypes,
    whose P reaches below the output dtype's normal range (Note [FP8 inputs in the gates])."""
    return math.log2(torch.finfo(dtype).tiny) - FP8_MAX_OFFSET if dtype in FP8_DTYPES else -math.inf


def _lse_error_log2(lse: torch.Tensor) -> float:
    finite = lse[lse.isfinite()]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    return 2 * FP32_UNIT_ROUNDOFF * (largest + 1) * math.log2(math.e)


def _mask_checks(read: ProbabilityReadback, valid: torch.Tensor) -> list[Check]:
    """Masked elements must read P = 0 and fully masked rows lse = -inf (FA4's convention)."""
    masked = (~valid).expand_as(read.p)
    checks = []
    if masked.any():
        checks.append(_evaluate("masked P = 0", read.p, masked, (0.0, 0.0)))
    fully_masked_rows = (~valid.any(dim=-1)).expand_as(read.lse)
    if fully_masked_rows.any():
        checks.append(_evaluate("fully masked rows: lse = -inf", read.lse, fully_masked_rows, (-math.inf, -math.inf)))
    return checks


def _judged_log2_ratio(p: torch.Tensor, p_expected: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """``log2(p / p_expected)``; where ``p_expected`` is below ``floor`` (per row: not resolvable in the
    output dtype or in P's, Note [FP8 inputs in the gates]) both sides are clamped at ``floor``, so
    underflow reads 0 and only a P that came out large where a tiny one was expected is seen (Note
    [Underflow of P in the output dtype], readback.py)."""
    small = p_expected < floor
    return torch.where(small, p.clamp_min(floor).log2() - p_expected.clamp_min(floor).log2(), (p / p_expected).log2())


def _check_common(dtype, device, seed, head_dim, q_std):
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (bfloat16, float16, float32, ...), got {dtype!r}")
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if not (isinstance(q_std, (int, float)) and math.isfinite(q_std) and q_std > 0):
        raise ValueError(f"q_std must be a finite positive number, got {q_std!r}")
    torch.device(device)  # raises on a malformed device string


def single_tile_gate(
    backend: Backend,
    reference: Backend,
    *,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 128,
    seed: int = 0,
    device: str | torch.device = "cpu",
    q_std: float = 3.0,
    accumulation: Fp8Accumulation | None = None,
) -> GateReport:
    """One causal 128x128 tile: ``backend``'s P equals ``reference``'s P to rounding.

    ``reference`` is the Rowmax-H15 reference backend, e.g.
    ``functools.partial(attention_reference, config=SoftmaxConfig(mode="rowmax_h15"))``; for FP8 inputs
    (``dtype=torch.float8_e4m3fn``) the FP8 one, ``SoftmaxConfig(mode="rowmax_h15", p_dtype=torch.float8_e4m3fn,
    max_offset=8, tile_n=128)`` (Note [FP8 inputs in the gates]). ``q_std`` is the
    standard deviation of q's entries (k's is 1): the scores spread about ``1.44 * q_std`` octaves.
    ``accumulation``: an FP8 backend's row sum and P V accumulation (None: single-level with the FADD row sum).
    """
    _check_common(dtype, device, seed, head_dim, q_std)
    accumulation = _check_accumulation(accumulation, dtype)
    q, k = _random_qk(1, SINGLE_TILE, SINGLE_TILE, 1, 1, head_dim, dtype, device, seed, q_std)
    kernel = read_probabilities(backend, q, k, causal=True)
    expected = read_probabilities(reference, q, k, causal=True)
    valid = _valid_mask(SINGLE_TILE, SINGLE_TILE, True, q.device)
    x, x_error = _log2_scores(q, k)
    x = x.masked_fill(~valid, -math.inf)
    row_max = x.amax(dim=-1, keepdim=True)
    # Single tile: the anchor is the row max, so the lattice argument is y = x - row_max. The kernel's max is
    # the computed score of whichever key comes out largest: at most max_j (x_j + err_j), at least row_max minus
    # the argmax key's error, so it is off by at most max_j (x_j + err_j) - row_max (>= the argmax key's err).
    anchor_error = ((x + x_error).amax(dim=-1, keepdim=True) - row_max).where(row_max.isfinite(), 0.0)
    y_error = x_error + anchor_error + 2 * FP32_UNIT_ROUNDOFF * row_max.abs()

    fp8 = dtype in FP8_DTYPES
    p_floor_log2 = _p_floor_log2(dtype)
    # Note [FP8 inputs in the gates]: FP8 H15 P is exact bytes, no rounding term.
    u = sum(unit_roundoff(d) for d in (kernel.out_dtype, expected.out_dtype))
    u += 0.0 if fp8 else 2 * _p_unit_roundoff(dtype)
    judged = valid.expand_as(kernel.p)
    y_error_max = float(y_error[judged].max())
    # Note [FP8 inputs in the gates]: the lattice point just below P's normal range (byte 4) may join the
    # kernel's row sum and not the reference's.
    two_y = 2 * (x - row_max)
    below_floor_point = 2 * p_floor_log2 - 1
    on_byte4 = judged & ((two_y - below_floor_point).abs() <= 0.5 + 2 * y_error)
    flush_tie = judged & ((two_y - (below_floor_point + 0.5)).abs() <= 2 * y_error)
    p_top = expected.p.amax(dim=-1, keepdim=True)
    byte4_shift = on_byte4.sum(dim=-1, keepdim=True) * 2.0**p_floor_log2 * p_top
    byte4_shift_max = float(byte4_shift.max()) if fp8 else 0.0
    # Both sides' P rounding, row sums, scores, (for rows compared on w_hat) LSEs, the byte-4 row sums, and the
    # FP8 kernel's accumulation (H15: its P is exact e4m3, so no P rounding in an MMA row sum).
    tol = (
        (u + 2 * SINGLE_TILE * FP32_UNIT_ROUNDOFF) / math.log(2)
        + 2 * y_error_max
        + _lse_error_log2(kernel.lse)
        + _lse_error_log2(expected.lse)
        + math.log2(1 + byte4_shift_max)
        + (accumulation.widening_log2(SINGLE_TILE, 0.0, exact_row_sum=False) if fp8 else 0.0)
    )
    out_floor = torch.finfo(kernel.out_dtype).tiny * 2**tol  # below it a ratio says nothing (underflow)
    # Midway between bytes 8 and 4 (FP8; 0 otherwise); just above byte 8 within score rounding of the flush.
    p_floor = p_top * torch.where(flush_tie, 2.0 ** (p_floor_log2 + tol), 2.0 ** (p_floor_log2 - 0.5))
    p_ratio = _judged_log2_ratio(kernel.p, expected.p, torch.clamp_min(p_floor, out_floor))
    w_ratio = kernel.log2_weights - expected.log2_weights

    # Note [Lattice ties in the single-tile gate]
    boundary_distance = (two_y - (two_y.floor() + 0.5)).abs() / 2
    steps = torch.tensor([math.log2(1.5), math.log2(4 / 3)], dtype=torch.float64, device=x.device)
    step_error, step = (w_ratio.abs().unsqueeze(-1) - steps).abs().min(dim=-1)
    flipped = judged & (boundary_distance <= y_error) & (step_error <= tol) & (w_ratio.abs() > tol)
    out_resolved = resolvable(expected.p, kernel.out_dtype, headroom_log2=tol)
    p_normal = expected.p >= p_floor
    resolved = out_resolved & p_normal
    flipped &= resolved
    rows_with_flip = flipped.any(dim=-1, keepdim=True)
    residual = torch.where(rows_with_flip & resolved, w_ratio, p_ratio)
    residual = torch.where(flipped, w_ratio - w_ratio.sign() * steps[step], residual)  # what is left of a flip
    n_underflow = int((judged & p_normal & ~out_resolved).sum())
    note = (
        f"rounding tol {tol:.3g} oct (out {_dtype_name(kernel.out_dtype)}); lattice ties flipped: "
        f"{int(flipped.sum())}; unresolvable (underflow): {n_underflow}"
    )
    if fp8:
        note += (
            f"; below P's normal range (flushed): {int((judged & ~p_normal).sum())}"
            f"; on the byte-4 point: {int(on_byte4.sum())}, at the flush within score rounding: {int(flush_tie.sum())}"
        )
    checks = [_evaluate("P vs H15 reference", residual, judged, (-tol, tol), note)]
    checks += _mask_checks(kernel, valid)
    setup = f"{_dtype_name(dtype)} causal {SINGLE_TILE}x{SINGLE_TILE} d{head_dim} seed {seed}"
    return GateReport("single-tile", setup, tuple(checks))


def multi_tile_gate(
    backend: Backend,
    *,
    causal: bool,
    seqlen_q: int,
    seqlen_k: int,
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 1,
    heads_q: int = 1,
    heads_k: int = 1,
    head_dim: int = 128,
    seed: int = 0,
    device: str | torch.device = "cpu",
    q_std: float = 3.0,
    accumulation: Fp8Accumulation | None = None,
) -> GateReport:
    """A multi-tile problem against exact fp64 softmax; any Rowmax-H15 anchor schedule must pass, and so
    must exact softmax (it is the control).

    Checks (Note [Unnormalised weights from P and the LSE], readback.py):
    - normalised ratio ``log2(P / P_exact)`` within +-0.585;
    - unnormalised error via the LSE, ``log2(P) + lse log2(e) - x``, inside [-0.25, +0.335];
    - unnormalised error via the row max, ``log2(P / P_exact) - delta_i`` with ``delta_i`` that ratio at
      the row max, inside [-0.25, +0.335], over the rows whose anchor sits on the row max (the kernel's
      own error there, ``e*``, is 0); rows with a stale anchor are counted, not judged.
    The paper's gate is ``causal=True, seqlen_q=seqlen_k=512`` (131,328 valid elements per head).
    ``accumulation``: an FP8 backend's row sum and P V accumulation (None: single-level with the FADD row sum).
    """
    _check_common(dtype, device, seed, head_dim, q_std)
    accumulation = _check_accumulation(accumulation, dtype)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    sizes = (
        ("seqlen_q", seqlen_q),
        ("seqlen_k", seqlen_k),
        ("batch", batch),
        ("heads_q", heads_q),
        ("heads_k", heads_k),
    )
    for name, value in sizes:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if heads_q % heads_k != 0:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_k ({heads_k}) (GQA)")

    q, k = _random_qk(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, device, seed, q_std)
    kernel = read_probabilities(backend, q, k, causal=causal)
    valid = _valid_mask(seqlen_q, seqlen_k, causal, q.device)
    x, x_error = _log2_scores(q, k)
    x = x.masked_fill(~valid, -math.inf)
    row_max = x.amax(dim=-1, keepdim=True)
    p_exact = (x - row_max).exp2()
    p_exact = p_exact / p_exact.sum(dim=-1, keepdim=True)  # NaN in fully masked rows: never judged

    judged = valid.expand_as(kernel.p)
    y_error_max = float((x_error + 2 * FP32_UNIT_ROUNDOFF * row_max.abs())[judged].max()) if judged.any() else 0.0
    u = unit_roundoff(kernel.out_dtype) + _p_unit_roundoff(dtype)
    tol = (u + 2 * seqlen_k * FP32_UNIT_ROUNDOFF) / math.log(2) + 2 * y_error_max + _lse_error_log2(kernel.lse)
    if dtype in FP8_DTYPES:  # Note [FP8 inputs in the gates]: the kernel's accumulation; exact is a control here
        tol += accumulation.widening_log2(seqlen_k, _p_unit_roundoff(dtype), exact_row_sum=True)
    headroom = H15_RATIO_BOUND + tol  # a correct P may sit this far below P_exact
    out_floor = torch.finfo(kernel.out_dtype).tiny * 2**headroom
    # Note [FP8 inputs in the gates]: P's own normal range, relative to the row's top weight.
    p_floor = (p_exact.amax(dim=-1, keepdim=True) * 2.0 ** (_p_floor_log2(dtype) + headroom)).nan_to_num(0.0)
    p_normal = judged & (p_exact >= p_floor)
    resolved = p_normal & resolvable(p_exact, kernel.out_dtype, headroom_log2=headroom)
    n_underflow = int((p_normal & ~resolved).sum())
    n_flushed = int((judged & ~p_normal).sum())
    flushed_mass = torch.where(judged & ~p_normal, p_exact, 0.0).sum(dim=-1)
    flush_widening = -math.log2(1 - float(flushed_mass.max()))

    ratio = _judged_log2_ratio(kernel.p, p_exact, torch.clamp_min(p_floor, out_floor))
    lse_view = kernel.log2_weights - x
    argmax = x.argmax(dim=-1, keepdim=True)
    shift_at_max = ratio.gather(-1, argmax)  # the paper's per-row normalisation shift (green ticks)
    anchor_error = lse_view.gather(-1, argmax)  # e*: the kernel's own lattice error at the row max
    rowmax_view = ratio - shift_at_max
    anchored_rows = anchor_error.abs() <= tol
    rows = valid.any(dim=-1, keepdim=True).expand_as(anchor_error)
    shifts = shift_at_max[rows]
    n_stale = int((rows & ~anchored_rows).sum())
    lo, hi = H15_ENVELOPE
    checks = [
        _evaluate(
            "log2(P/P_exact)",
            ratio,
            judged,
            (-H15_RATIO_BOUND - tol, H15_RATIO_BOUND + tol + flush_widening),
            f"tol {tol:.3g} oct (out {_dtype_name(kernel.out_dtype)}); unresolvable (underflow): {n_underflow}"
            + (
                f"; below P's normal range: {n_flushed} (flushed mass widens by {flush_widening:.2g} oct)"
                if dtype in FP8_DTYPES
                else ""
            ),
        ),
        _evaluate(
            "log2(w_hat/w) via LSE",
            lse_view,
            resolved,
            (lo - tol, hi + tol),
            f"LSE spread between calls {kernel.lse_spread:.3g}",
        ),
        _evaluate(
            "log2(w_hat/w) via row max",
            rowmax_view,
            resolved & anchored_rows,
            (lo - 2 * tol, hi + 2 * tol),
            (f"row-max shift in [{float(shifts.min()):+.3f}, {float(shifts.max()):+.3f}]; " if shifts.numel() else "")
            + f"rows with stale anchor (e* != 0, not judged): {n_stale}",
        ),
    ]
    checks += _mask_checks(kernel, valid)
    mask = "causal" if causal else "non-causal"
    setup = f"{_dtype_name(dtype)} {mask} {seqlen_q}x{seqlen_k} b{batch} h{heads_q}/{heads_k} d{head_dim} seed {seed}"
    return GateReport("multi-tile", setup, tuple(checks))


# (causal, seqlen_q, seqlen_k, batch, heads_q, heads_k): the paper's 512x512 gate (one head: 131,328
# elements), then what it does not cover, kept small for the CPU: seqlens off the tile, GQA, batch > 1,
# non-causal, causal with seqlen_q != seqlen_k (bottom-right; fully masked rows when seqlen_q > seqlen_k).
MULTI_TILE_CASES = (
    (True, 512, 512, 1, 1, 1),
    (True, 509, 509, 1, 2, 1),
    (False, 300, 509, 2, 2, 1),
    (True, 300, 509, 1, 2, 2),
    (True, 509, 300, 1, 2, 1),
)


def run_gates(
    backend: Backend,
    reference: Backend | None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seeds: Sequence[int] = (0, 1, 2),
    accumulation: Fp8Accumulation | None = None,
) -> list[GateReport]:
    """The gate suite: the single-tile gate on every seed (skipped when ``reference`` is None), the paper's
    multi-tile gate on every seed, and the other shapes of ``MULTI_TILE_CASES`` on one seed each.
    ``accumulation``: an FP8 backend's row sum and P V accumulation (Note [FP8 inputs in the gates])."""
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    accumulation = _check_accumulation(accumulation, dtype)
    reports = []
    if reference is not None:
        reports += [
            single_tile_gate(backend, reference, dtype=dtype, seed=s, device=device, accumulation=accumulation)
            for s in seeds
        ]
    for index, (causal, seqlen_q, seqlen_k, batch, heads_q, heads_k) in enumerate(MULTI_TILE_CASES):
        case_seeds = seeds if index == 0 else (seeds[index % len(seeds)],)
        for seed in case_seeds:
            reports.append(
                multi_tile_gate(
                    backend,
                    causal=causal,
                    seqlen_q=seqlen_q,
                    seqlen_k=seqlen_k,
                    dtype=dtype,
                    batch=batch,
                    heads_q=heads_q,
                    heads_k=heads_k,
                    seed=seed,
                    device=device,
                    accumulation=accumulation,
                )
            )
    return reports


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _format_number(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.4g}"


def format_report(reports: Sequence[GateReport], *, title: str = "", expect_pass: Sequence[bool] | None = None) -> str:
    """A table with one line per check. ``expect_pass`` (one per report) adds what each gate was meant to
    give; a control that must fail shows ``FAIL (expected)``."""
    if expect_pass is not None and len(expect_pass) != len(reports):
        raise ValueError(f"expect_pass must have one entry per report ({len(reports)}), got {len(expect_pass)}")
    header = ("gate", "setup", "check", "result", "elements", "worst", "bound", "where", "note")
    rows = []
    for index, report in enumerate(reports):
        expected = True if expect_pass is None else expect_pass[index]
        verdict = "PASS" if report.passed else "FAIL"
        if expect_pass is not None and report.passed != expected:
            verdict += " (UNEXPECTED)"
        elif not expected:
            verdict += " (expected)"
        for position, check in enumerate(report.checks):
            rows.append(
                (
                    report.name if position == 0 else "",
                    report.setup if position == 0 else "",
                    check.name,
                    verdict if position == 0 else ("ok" if check.passed else "fail"),
                    f"{check.n_elements:,}",
                    _format_number(check.worst),
                    f"[{_format_number(check.bound[0])}, {_format_number(check.bound[1])}]",
                    "" if check.where is None else ",".join(map(str, check.where)),
                    check.note,
                )
            )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        lines = [title] if title else []
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in (header, *rows)]
        return "\n".join(lines)
    import io

    table = Table(title=title or None, show_lines=False)
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console = Console(file=io.StringIO(), width=220, force_terminal=False, color_system=None)
    console.print(table)
    return console.file.getvalue()
