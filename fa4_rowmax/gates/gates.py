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
GQA, fully masked rows and several seeds; ``format_report`` prints the result as a table.

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
"""

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fa4_rowmax.gates.readback import Backend, ProbabilityReadback, read_probabilities, resolvable, unit_roundoff

H15_ENVELOPE = (-0.25, math.log2(1.5) - 0.25)  # log2(H(y)) - y, octaves
H15_RATIO_BOUND = math.log2(1.5)  # |log2(P_kernel / P_exact)|: two envelope extremes apart
SINGLE_TILE = 128  # the paper's tile: causal 128x128, 8,256 valid elements
FP32_UNIT_ROUNDOFF = 2.0**-24

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


def _valid_mask(seqlen_q: int, seqlen_k: int, causal: bool, device) -> torch.Tensor:
    """(seqlen_q, seqlen_k) keys each query sees; causal is aligned bottom-right (docs/design.md)."""
    if not causal:
        return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return cols <= rows + (seqlen_k - seqlen_q)


def _log2_scores(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact scores ``x = q.k * head_dim^-0.5 * log2(e)`` in fp64, (batch, heads_q, seqlen_q, seqlen_k),
    and the fp32 error bound on them (Note [Gate tolerances]) without the anchor term."""
    head_dim = q.shape[3]
    group = q.shape[2] // k.shape[2]
    q64 = q.to(torch.float64).permute(0, 2, 1, 3)
    k64 = k.to(torch.float64).permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    scale_log2 = head_dim**-0.5 * math.log2(math.e)
    x = q64 @ k64.transpose(-1, -2) * scale_log2
    dot_error = head_dim * FP32_UNIT_ROUNDOFF * (q64.abs() @ k64.abs().transpose(-1, -2)) * scale_log2
    return x, dot_error + 2 * FP32_UNIT_ROUNDOFF * x.abs()


def _p_unit_roundoff(dtype: torch.dtype) -> float:
    """P is held in q's dtype before P@V, never finer than fp32 (Note [Gate tolerances])."""
    return max(unit_roundoff(dtype), FP32_UNIT_ROUNDOFF)


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


def _judged_log2_ratio(p: torch.Tensor, p_expected: torch.Tensor, floor: float) -> torch.Tensor:
    """``log2(p / p_expected)``; where ``p_expected`` is below ``floor`` (not resolvable in the output
    dtype) both sides are clamped at ``floor``, so underflow reads 0 and only a P that came out large
    where a tiny one was expected is seen (Note [Underflow of P in the output dtype], readback.py)."""
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
) -> GateReport:
    """One causal 128x128 tile: ``backend``'s P equals ``reference``'s P to rounding.

    ``reference`` is the Rowmax-H15 reference backend, e.g.
    ``functools.partial(attention_reference, config=SoftmaxConfig(mode="rowmax_h15"))``. ``q_std`` is the
    standard deviation of q's entries (k's is 1): the scores spread about ``1.44 * q_std`` octaves.
    """
    _check_common(dtype, device, seed, head_dim, q_std)
    q, k = _random_qk(1, SINGLE_TILE, SINGLE_TILE, 1, 1, head_dim, dtype, device, seed, q_std)
    kernel = read_probabilities(backend, q, k, causal=True)
    expected = read_probabilities(reference, q, k, causal=True)
    valid = _valid_mask(SINGLE_TILE, SINGLE_TILE, True, q.device)
    x, x_error = _log2_scores(q, k)
    x = x.masked_fill(~valid, -math.inf)
    row_max = x.amax(dim=-1, keepdim=True)
    max_index = x.argmax(dim=-1, keepdim=True)
    # Single tile: the anchor is the row max, so the lattice argument is y = x - row_max.
    y_error = x_error + x_error.gather(-1, max_index) + 2 * FP32_UNIT_ROUNDOFF * row_max.abs()

    u = sum(unit_roundoff(d) for d in (kernel.out_dtype, expected.out_dtype)) + 2 * _p_unit_roundoff(dtype)
    y_error_max = float(y_error[valid.expand_as(x)].max())
    # Both sides' P rounding, row sums, scores and (for rows compared on w_hat) LSEs.
    tol = (
        (u + 2 * SINGLE_TILE * FP32_UNIT_ROUNDOFF) / math.log(2)
        + 2 * y_error_max
        + _lse_error_log2(kernel.lse)
        + _lse_error_log2(expected.lse)
    )
    floor = torch.finfo(kernel.out_dtype).tiny * 2**tol  # below it a ratio says nothing (underflow)
    judged = valid.expand_as(kernel.p)
    p_ratio = _judged_log2_ratio(kernel.p, expected.p, floor)
    w_ratio = kernel.log2_weights - expected.log2_weights

    # Note [Lattice ties in the single-tile gate]
    two_y = 2 * (x - row_max)
    boundary_distance = (two_y - (two_y.floor() + 0.5)).abs() / 2
    steps = torch.tensor([math.log2(1.5), math.log2(4 / 3)], dtype=torch.float64, device=x.device)
    step_error, step = (w_ratio.abs().unsqueeze(-1) - steps).abs().min(dim=-1)
    flipped = judged & (boundary_distance <= y_error) & (step_error <= tol) & (w_ratio.abs() > tol)
    resolved = resolvable(expected.p, kernel.out_dtype, headroom_log2=tol)
    flipped &= resolved
    rows_with_flip = flipped.any(dim=-1, keepdim=True)
    residual = torch.where(rows_with_flip & resolved, w_ratio, p_ratio)
    residual = torch.where(flipped, w_ratio - w_ratio.sign() * steps[step], residual)  # what is left of a flip
    n_underflow = int((judged & ~resolved).sum())
    note = (
        f"rounding tol {tol:.3g} oct (out {_dtype_name(kernel.out_dtype)}); lattice ties flipped: "
        f"{int(flipped.sum())}; unresolvable (underflow): {n_underflow}"
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
    """
    _check_common(dtype, device, seed, head_dim, q_std)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    sizes = (
        ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("batch", batch), ("heads_q", heads_q), ("heads_k", heads_k)
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
    headroom = H15_RATIO_BOUND + tol  # a correct P may sit this far below P_exact
    floor = torch.finfo(kernel.out_dtype).tiny * 2**headroom
    resolved = judged & resolvable(p_exact, kernel.out_dtype, headroom_log2=headroom)
    n_underflow = int((judged & ~resolved).sum())

    ratio = _judged_log2_ratio(kernel.p, p_exact, floor)
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
            "log2(P/P_exact)", ratio, judged, (-H15_RATIO_BOUND - tol, H15_RATIO_BOUND + tol),
            f"tol {tol:.3g} oct (out {_dtype_name(kernel.out_dtype)}); unresolvable (underflow): {n_underflow}",
        ),
        _evaluate(
            "log2(w_hat/w) via LSE", lse_view, resolved, (lo - tol, hi + tol),
            f"LSE spread between calls {kernel.lse_spread:.3g}",
        ),
        _evaluate(
            "log2(w_hat/w) via row max", rowmax_view, resolved & anchored_rows, (lo - 2 * tol, hi + 2 * tol),
            (f"row-max shift in [{float(shifts.min()):+.3f}, {float(shifts.max()):+.3f}]; " if shifts.numel() else "")
            + f"rows with stale anchor (e* != 0, not judged): {n_stale}",
        ),
    ]
    checks += _mask_checks(kernel, valid)
    mask = "causal" if causal else "non-causal"
    setup = (
        f"{_dtype_name(dtype)} {mask} {seqlen_q}x{seqlen_k} b{batch} h{heads_q}/{heads_k} d{head_dim} seed {seed}"
    )
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
) -> list[GateReport]:
    """The gate suite: the single-tile gate on every seed (skipped when ``reference`` is None), the paper's
    multi-tile gate on every seed, and the other shapes of ``MULTI_TILE_CASES`` on one seed each."""
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    reports = []
    if reference is not None:
        reports += [single_tile_gate(backend, reference, dtype=dtype, seed=s, device=device) for s in seeds]
    for index, (causal, seqlen_q, seqlen_k, batch, heads_q, heads_k) in enumerate(MULTI_TILE_CASES):
        case_seeds = seeds if index == 0 else (seeds[index % len(seeds)],)
        for seed in case_seeds:
            reports.append(
                multi_tile_gate(
                    backend, causal=causal, seqlen_q=seqlen_q, seqlen_k=seqlen_k, dtype=dtype, batch=batch,
                    heads_q=heads_q, heads_k=heads_k, seed=seed, device=device,
                )
            )
    return reports


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _format_number(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.4g}"


def format_report(
    reports: Sequence[GateReport], *, title: str = "", expect_pass: Sequence[bool] | None = None
) -> str:
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
            rows.append((
                report.name if position == 0 else "",
                report.setup if position == 0 else "",
                check.name,
                verdict if position == 0 else ("ok" if check.passed else "fail"),
                f"{check.n_elements:,}",
                _format_number(check.worst),
                f"[{_format_number(check.bound[0])}, {_format_number(check.bound[1])}]",
                "" if check.where is None else ",".join(map(str, check.where)),
                check.note,
            ))
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
