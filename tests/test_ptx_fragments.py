"""Every inline-PTX fragment the SM90 and SM100/SM103 stages emit, executed on the CPU and compared bit for bit
with the closed-form reference; mutants of the builders must fail the same checks.

The fragments come from the builders the kernels call (every `@ptx_fragment` function in fa4_rowmax/stage/,
Note [PTX fragments are data]) and run through `fa4_rowmax.testing.ptx_interp` (Note [PTX interpreter]).
`check_fragment(name)` looks the builder up at call time, so a monkeypatched builder is what it checks.
"""

import ast
import importlib
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from fa4_rowmax.reference import attention
from fa4_rowmax.reference.exp_approx import h15, h15_e4m3_bytes, pot
from fa4_rowmax.stage import softmax_base as sb
from fa4_rowmax.stage import softmax_sm90_fp8 as sm90_fp8
from fa4_rowmax.testing.ptx_interp import CANONICAL_NAN, Ex2Model, PtxError, run

STAGE_DIR = Path(sb.__file__).parent


def _decorated_with(node: ast.FunctionDef, name: str) -> bool:
    return any(isinstance(d, ast.Name) and d.id == name for d in node.decorator_list)


def _marked_builders() -> dict[str, str]:
    """Builder name -> module (under fa4_rowmax.stage) of every `@ptx_fragment` function, read from the source."""
    builders = {}
    for path in sorted(STAGE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and _decorated_with(node, "ptx_fragment"):
                assert node.name not in builders, f"two builders named {node.name}"
                builders[node.name] = path.stem
    return builders


BUILDERS = _marked_builders()
C = np.float32(sb.H15_ROUND)
# Scale factors softmax_scale * log2(e) of head dims 64 and 128, and 1 (every x an fp32 input exactly).
SCALES = np.float32([1.0, 0.18033688, 0.12751743])
# ex2.approx as rounded-to-nearest moved by these many ulps at the half-octave points, exact at integers
# (Note [PTX interpreter]); the H15 snap holds far beyond any plausible ex2.approx error (Note [H15 through the
# MUFU]), here up to 2^20 ulps either way. Inexact at integers: test_mufu_paths_with_ex2_inexact_at_integers.
EX2_MODELS = [Ex2Model(ulps) for ulps in (-(2**20), -3, -1, 0, 1, 3, 2**20)]


def _bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def _f32_range(lo: float, hi: float) -> np.ndarray:
    """Every fp32 value in [lo, hi] (lo < hi <= 0 or 0 <= lo < hi)."""
    a, b = sorted(int(v) for v in _bits([lo, hi]))
    return np.arange(a, b + 1, dtype=np.uint32).view(np.float32)


SPECIALS = np.float32(
    [
        np.nan,
        -np.nan,
        -np.inf,
        0.0,
        -0.0,
        1e-45,
        -1e-45,
        1.1754942e-38,
        -1.1754942e-38,
        1.1754944e-38,
        -1e30,
        -3.4028235e38,
    ]
)
SPECIALS = np.concatenate([SPECIALS, np.uint32([0x7FC00001, 0xFFBADBAD, 0x7F800001]).view(np.float32)])


def boundary_sweep(lo: float, hi: float, step: float) -> np.ndarray:
    """Every multiple of `step` in [lo, hi], its fp32 neighbours up to 2 ulps either side, and a dense grid."""
    points = np.arange(lo, hi + step / 2, step, dtype=np.float64).astype(np.float32)
    near = [points]
    for direction in (np.inf, -np.inf):
        p = points
        for _ in range(2):
            p = np.nextafter(p, np.float32(direction))
            near.append(p)
    grid = np.linspace(lo, hi, 200_001, dtype=np.float32)
    sweep = np.concatenate(near + [grid])
    return sweep[(sweep >= lo) & (sweep <= hi)]


# [-130, 10] at every rounding boundary (H15: odd multiples of 1/4; PoT: of 1/2), every fp32 value of the clamp
# region [-128, -125], the special values, and the top of the ALU paths' domain (Note [H15 in fp32 bits]: n = 256
# still encodes inf): H15 up to x = 128.25, PoT up to 128.5. Beyond, and +inf: test_alu_fragments_outside_their_domain.
CLAMP_REGION = _f32_range(-128.0, -125.0)
H15_X = np.concatenate(
    [boundary_sweep(-130.0, 10.0, 0.25), CLAMP_REGION, SPECIALS, boundary_sweep(120.0, 128.25, 0.25)]
)
POT_X = np.concatenate([boundary_sweep(-130.0, 10.0, 0.5), CLAMP_REGION, SPECIALS, boundary_sweep(120.0, 128.5, 0.5)])


def _assert_same_bits(got, expected, inputs, label: str) -> None:
    got, expected = _bits(got), _bits(expected)
    wrong = np.flatnonzero(got != expected)
    if wrong.size:
        shown = [
            tuple(f"{float(x[i])!r}" for x in inputs) + (f"0x{got[i]:08X}", f"0x{expected[i]:08X}") for i in wrong[:5]
        ]
        raise AssertionError(f"{label}: {wrong.size} of {got.size} lanes differ; (inputs..., got, expected): {shown}")


def _h15_ref(x: np.ndarray, ftz_level: bool = False) -> np.ndarray:
    """The closed form `h15`, NaN taken as the clamp (Note [NaN rows in the approximate modes]); with `ftz_level`
    the one denormal level, Q_half(x) = -126.5, flushed as ex2.approx.ftz does (Note [H15 through the MUFU])."""
    x = np.where(np.isnan(x), np.float32(sb.H15_CLAMP), x).astype(np.float32)
    w = h15(torch.from_numpy(x)).numpy()
    if ftz_level:
        w = np.where(np.round(x.astype(np.float64) * 2) == -253, np.float32(0), w)
    return w


def _pot_ref(x: np.ndarray) -> np.ndarray:
    """`pot` with K_max = 20; NaN taken as the clamp, masked scores (-inf) 0 (the fragment's select)."""
    clean = np.where(np.isnan(x), np.float32(-sb.POT_K_MAX), x).astype(np.float32)
    w = pot(torch.from_numpy(clean), sb.POT_K_MAX).numpy()
    return np.where(np.isneginf(x), np.float32(0), w)


def _round_to_f32(q: Fraction) -> np.float32:
    """A rational rounded once to fp32, nearest even (an oracle independent of the interpreter)."""
    if q == 0:
        return np.float32(0.0)
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e += (Fraction(2) ** (e + 1) <= a) - (Fraction(2) ** e > a)
    quantum = Fraction(2) ** (max(e, -126) - 23)
    scaled = a / quantum
    mantissa = math.floor(scaled)
    rest = scaled - mantissa
    mantissa += rest > Fraction(1, 2) or (rest == Fraction(1, 2) and mantissa % 2 == 1)
    value = mantissa * quantum
    out = np.float32(np.inf) if value >= 2**128 else np.float32(float(value))
    return -out if q < 0 else out


def _addend_ref(m: np.ndarray, scale: np.float32) -> np.ndarray:
    """fl32(1.5 * 2^22 - m * scale_log2), rounded once (Note [Folded H15 with a half-octave anchor])."""
    out = []
    for value in m.astype(np.float64):
        if math.isnan(value):
            out.append(np.uint32(CANONICAL_NAN).view(np.float32))
        elif math.isinf(value):
            out.append(np.float32(np.float64(C) - value * np.float64(scale)))
        else:
            out.append(_round_to_f32(Fraction(float(C)) - Fraction(value) * Fraction(float(scale))))
    return np.array(out, dtype=np.float32)


def _folded_ref(s: np.ndarray, scale: np.float32, addend: np.float32, ftz_level: bool = False) -> np.ndarray:
    """H(s * scale_log2 - a), a = 1.5 * 2^22 - addend, with the one rounding of the FFMA: n = round_half_even(2x) of
    the exact x (2 s scale_log2 is exact in fp64, 2a an integer)."""
    finite = np.isfinite(s)
    two_p = 2.0 * np.where(finite, s, 0).astype(np.float64) * np.float64(scale)
    floor = np.floor(two_p)
    rest = two_p - floor
    base = floor - 2.0 * (np.float64(C) - np.float64(addend))
    n = base + (rest > 0.5) + ((rest == 0.5) & (np.mod(base, 2) == 1))
    n = np.where(finite, n, -254.0)  # -inf and NaN scores: the clamp, weight 0
    return _h15_ref((np.maximum(n, -300.0) / 2).astype(np.float32), ftz_level)


# --- the checks, one per builder ---------------------------------------------------------------------------------


def _fragment(name: str):
    module = importlib.import_module(f"fa4_rowmax.stage.{BUILDERS[name]}")
    return getattr(module, name)()  # at call time: a monkeypatched builder is the one checked


def _check_single(name: str, x: np.ndarray, expected: np.ndarray, ex2: Ex2Model) -> None:
    (w,) = run(*_fragment(name), x, ex2=ex2)
    _assert_same_bits(w, expected, [x], f"{name} ({ex2})")


def check_h15_alu(ex2: Ex2Model) -> None:
    _check_single("h15_alu_asm", H15_X, _h15_ref(H15_X), ex2)


def check_h15_mufu(ex2: Ex2Model) -> None:
    _check_single("h15_mufu_asm", H15_X, _h15_ref(H15_X, ftz_level=True), ex2)


def check_h15_alu_pair(ex2: Ex2Model) -> None:
    """Both lanes, with different inputs in each (a swap of the outputs or of the inputs shows)."""
    x, y = H15_X, np.roll(H15_X[::-1], 7)
    w0, w1 = run(*_fragment("h15_alu_pair_asm"), x, y, ex2=ex2)
    _assert_same_bits(w0, _h15_ref(x), [x, y], "h15_alu_pair_asm $0")
    _assert_same_bits(w1, _h15_ref(y), [x, y], "h15_alu_pair_asm $1")


def check_pot_alu(ex2: Ex2Model) -> None:
    _check_single("pot_alu_asm", POT_X, _pot_ref(POT_X), ex2)


def check_pot_mufu(ex2: Ex2Model) -> None:
    x = np.concatenate([POT_X, np.float32([np.inf, 1e30])])  # the MUFU path overflows to inf as the reference
    _check_single("pot_mufu_asm", x, _pot_ref(x), ex2)


ROW_MAXES = np.concatenate(
    [
        np.float32([0.0, -0.0, 3.3, -17.61, 101.37, 2500.9, -4.1e5, 1e-45, -1e-45, 7.5e6]),
        np.random.default_rng(0).normal(0, 300, 600).astype(np.float32),
    ]
)


def check_h15_anchor_addend(ex2: Ex2Model) -> None:
    """Against the exact single rounding and against the reference's anchor (`attention._half_octave_anchor`)."""
    m = np.concatenate([ROW_MAXES, np.float32([np.inf, -np.inf, np.nan])])
    for scale in SCALES:
        (addend,) = run(*_fragment("h15_anchor_addend_asm"), m, scale, ex2=ex2)
        _assert_same_bits(addend, _addend_ref(m, scale), [m], f"h15_anchor_addend_asm (scale {scale})")
        finite = np.isfinite(m)
        anchor = attention._half_octave_anchor(torch.from_numpy(m[finite]), float(scale)).numpy()
        _assert_same_bits(C - addend[finite], anchor, [m[finite]], "anchor vs attention._half_octave_anchor")


def _folded_cases():
    """(s, scale_log2, addend) sweeps: for each row max and scale, the scores whose x = s * scale_log2 - a sits on
    or next to every rounding boundary in [-130, 10], a dense spread, and -inf / NaN / denormal scores."""
    rng = np.random.default_rng(1)
    for scale in SCALES:
        for m in np.float32([0.0, 3.3, -17.61, 101.37, 2500.9]):
            addend = _addend_ref(np.float32([m]), scale)[0]
            anchor = np.float64(C) - np.float64(addend)
            targets = (np.arange(-130.0, 10.001, 0.25) + anchor) / np.float64(scale)
            near = [targets.astype(np.float32)]
            for direction in (np.inf, -np.inf):
                near.append(np.nextafter(near[0], np.float32(direction)))
            spread = ((rng.uniform(-130, 10, 20_000) + anchor) / np.float64(scale)).astype(np.float32)
            s = np.concatenate(near + [spread, SPECIALS])
            yield s, scale, addend


def _check_folded(name: str, ex2: Ex2Model, ftz_level: bool) -> None:
    for s, scale, addend in _folded_cases():
        (w,) = run(*_fragment(name), s, scale, addend, ex2=ex2)
        _assert_same_bits(w, _folded_ref(s, scale, addend, ftz_level), [s], f"{name} (scale {scale}, addend {addend})")
    # A NaN or +inf row max (addend NaN / -inf): the FFMA is NaN or -inf, the clamp gives weight 0 (the row is
    # poisoned in `finalize`, Note [NaN rows in the approximate modes]).
    s = H15_X[np.isfinite(H15_X)]
    for addend in np.float32([np.nan, -np.inf]):
        (w,) = run(*_fragment(name), s, SCALES[1], addend, ex2=ex2)
        _assert_same_bits(w, np.zeros_like(s), [s], f"{name} (addend {addend})")


def check_h15_folded_alu(ex2: Ex2Model) -> None:
    _check_folded("h15_folded_alu_asm", ex2, ftz_level=False)


def check_h15_folded_mufu(ex2: Ex2Model) -> None:
    _check_folded("h15_folded_mufu_asm", ex2, ftz_level=True)


H15_LATTICE = np.concatenate(
    [np.float32([0.0, 2.0**-127]), np.ldexp(np.float32([1.0, 1.5])[:, None], np.arange(-126, 128)[None]).ravel()]
)


def check_nan_row_weight(ex2: Ex2Model) -> None:
    """w + max.NaN(m, 0) * 0 is w's bits for a finite or -inf row max, the canonical NaN for NaN or +inf
    (Note [NaN rows in the approximate modes on SM100]); every H15 weight against every row max kind."""
    m = np.concatenate([ROW_MAXES, SPECIALS, np.float32([np.inf, 3.4028235e38])])
    w, mm = (a.ravel() for a in np.meshgrid(H15_LATTICE.astype(np.float32), m))
    (out,) = run(*_fragment("nan_row_weight_asm"), w, mm, ex2=ex2)
    poisoned = np.isnan(mm) | np.isposinf(mm)
    expected = np.where(poisoned, np.uint32(CANONICAL_NAN), _bits(w)).view(np.float32)
    _assert_same_bits(out, expected, [w, mm], "nan_row_weight_asm")


# --- the SM90 FP8 stage (softmax_sm90_fp8.py, Note [H15 e4m3 bytes by integer ops]) -----------------------------


def _exact_fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fl32(a * b + c) rounded once, by the rational oracle; IEEE special values through fp64."""
    a, b, c = np.broadcast_arrays(a, b, c)
    out = np.empty(a.shape, dtype=np.float32)
    for i, (x, y, z) in enumerate(zip(a.tolist(), b.tolist(), c.tolist())):
        if all(math.isfinite(v) for v in (x, y, z)):
            out[i] = _round_to_f32(Fraction(x) * Fraction(y) + Fraction(z))
        else:
            with np.errstate(invalid="ignore"):
                out[i] = np.float32(np.float64(x) * y + z)
    return np.where(np.isnan(out), np.uint32(CANONICAL_NAN).view(np.float32), out)


def _fp8_lattice_cases():
    """(s, scale_log2, addend) with t = s * scale_log2 + addend on and next to every quarter in [-8, 40] (L = 0 to
    31 and past both ends), a spread, and the special scores; addend = max_offset + 7 - m * scale_log2."""
    rng = np.random.default_rng(2)
    for scale in SCALES:
        for m in np.float32([0.0, 3.3, -17.61, 101.37]):
            addend = np.float32(np.float64(sm90_fp8.FP8_MAX_OFFSET + sm90_fp8.H15_FP8_T_SHIFT) - np.float64(m) * scale)
            targets = ((np.arange(-8.0, 40.001, 0.25) - np.float64(addend)) / np.float64(scale)).astype(np.float32)
            near = [targets, np.nextafter(targets, np.float32(np.inf)), np.nextafter(targets, np.float32(-np.inf))]
            spread = ((rng.uniform(-8, 40, 1500) - np.float64(addend)) / np.float64(scale)).astype(np.float32)
            yield np.concatenate(near + [spread, SPECIALS]), scale, addend


def check_h15_fp8_lattice(ex2: Ex2Model) -> None:
    """r = fl32(1.5 * 2^22 + max(fl32(s * scale_log2 + addend), 0)) (NaN scores: the clamp, r = 1.5 * 2^22)."""
    for s, scale, addend in _fp8_lattice_cases():
        (r,) = run(*_fragment("h15_fp8_lattice_asm"), s, scale, addend, ex2=ex2)
        t = _exact_fma(s, scale, np.float32(addend))
        t = np.where(np.isnan(t) | (t <= 0), np.float32(0), t)
        _assert_same_bits(
            r, _exact_fma(t, np.float32(1), C), [s], f"h15_fp8_lattice_asm (scale {scale}, addend {addend})"
        )


def check_h15_fp8_sat_lattice(ex2: Ex2Model) -> None:
    """Same L and the same bits << 22 as h15_fp8_lattice_asm wherever t <= 16 (y <= 9, beyond the range rule), from
    operands / 16 (Note [Clamp by saturation], softmax_sm90_fp8.py); L saturates at 32 above."""
    sat_c = np.float32(sm90_fp8.H15_ROUND_SAT)
    sixteenth = np.float32(sm90_fp8.H15_SAT_SCALE)
    for s, scale, addend in _fp8_lattice_cases():
        (r,) = run(*_fragment("h15_fp8_sat_lattice_asm"), s, scale * sixteenth, np.float32(addend) * sixteenth, ex2=ex2)
        t = _exact_fma(s, scale, np.float32(addend))
        t = np.where(np.isnan(t) | (t <= 0), np.float32(0), t)
        expected_l = _bits(_exact_fma(t, np.float32(1), C)).astype(np.int64) - int(_bits(C))
        expected_l = np.where(t > 16, 32, expected_l)
        got_l = _bits(r).astype(np.int64) - int(_bits(sat_c))
        assert (got_l == expected_l).all(), f"h15_fp8_sat_lattice_asm L (scale {scale}, addend {addend})"
        assert ((_bits(r) << np.uint32(22)) == (np.uint32(expected_l) << np.uint32(22))).all()


def check_h15_fp8_folded_lattice(ex2: Ex2Model) -> None:
    """r = max(fl32(s * scale_log2 + addend), 1.5 * 2^22), addend = fl32(1.5 * 2^22 - m * scale_log2) + 15
    (Note [Folded H15 on FP8])."""
    for s, scale, addend in _fp8_lattice_cases():
        addend = np.float32(addend - np.float32(15) + C)  # the folded addend of the same row: in [2^22, 2^23)
        (r,) = run(*_fragment("h15_fp8_folded_lattice_asm"), s, scale, addend, ex2=ex2)
        t = _exact_fma(s, scale, addend)
        _assert_same_bits(
            r, np.where(np.isnan(t) | (t < C), C, t), [s], f"h15_fp8_folded_lattice_asm (addend {addend})"
        )


# L = n + 14 (Note [H15 e4m3 bytes by integer ops]) up to 31, byte 124 = 384: the FP8 range rule keeps y below
# log2(448); from L = 32 on, 4L would be a negative e4m3 code (the packing itself carries nothing up to 63).
FP8_L = np.arange(32)
FP8_LATTICE = (np.float64(C) + FP8_L / 2).astype(np.float32)


def _e4m3_value(byte: np.ndarray) -> np.ndarray:
    return torch.from_numpy(byte.astype(np.uint8)).view(torch.float8_e4m3fn).float().numpy()


def check_h15_fp8_sum_add(ex2: Ex2Model) -> None:
    """acc + fp32(bits(r) << 22) = fl32(acc + value(e4m3 byte 4L) * 2^-120) for every lattice point and a sweep of
    partial sums (zero, denormal, small and large): the row sum adds the P the MMA sees, scaled by 2^-120."""
    acc = np.concatenate(
        [
            np.float32([0.0, 2.0**-127, 2.0**-126, 1e-38, 3.7e-37, 1e-30, 2.0**-100]),
            np.ldexp(np.float32(1.37), np.arange(-126, 40, 3)).astype(np.float32),
        ]
    )
    r, a = (v.ravel() for v in np.meshgrid(FP8_LATTICE, acc))
    (out,) = run(*_fragment("h15_fp8_sum_add_asm"), a, r, ex2=ex2)
    weight = (_e4m3_value(4 * (_bits(r) - _bits(C))) * np.float64(2.0**-120)).astype(np.float64)
    expected = [_round_to_f32(Fraction(float(x)) + Fraction(float(w))) for x, w in zip(a, weight)]
    _assert_same_bits(out, np.array(expected, dtype=np.float32), [a, r], "h15_fp8_sum_add_asm")


def check_add_keep_denormals(ex2: Ex2Model) -> None:
    """add.rn.f32 with denormals, against numpy's IEEE float32 add (NaN: the canonical one)."""
    rng = np.random.default_rng(3)
    a = np.concatenate([_random_f32(rng, 20_000), SPECIALS, np.float32([2.0**-127, 2.0**-149, -(2.0**-140)])])
    b = np.roll(a, 5)
    (out,) = run(*_fragment("add_keep_denormals_asm"), a, b, ex2=ex2)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = a + b
    _assert_same_bits(
        out,
        np.where(np.isnan(expected), np.uint32(CANONICAL_NAN).view(np.float32), expected),
        [a, b],
        "add_keep_denormals_asm",
    )


def check_promote_o(ex2: Ex2Model) -> None:
    """O * c + acc rounded once (Note [Two-level P.V accumulation]): O and acc of any sign and size, factors c in
    (0, 1] as the rescale gives them (1 exactly, tiny ones, denormal products), and special values."""
    rng = np.random.default_rng(5)
    o = np.concatenate([_random_f32(rng, 6_000), SPECIALS])
    c = np.concatenate([np.exp2(-rng.uniform(0, 140, o.size - 4)).astype(np.float32), np.float32([1, 1, 0, 2**-149])])
    acc = np.roll(o, 7) * np.float32(0.5)
    (out,) = run(*_fragment("promote_o_asm"), o, c, acc, ex2=ex2)
    _assert_same_bits(out, _exact_fma(o, c, acc), [o, c, acc], "promote_o_asm")


def _e4m3_bytes_ref(x: np.ndarray) -> np.ndarray:
    """torch's float8_e4m3fn (nearest even) of x saturated to +-448; NaN 0x7F."""
    clamped = torch.from_numpy(np.clip(np.nan_to_num(x, nan=0.0), -448.0, 448.0).astype(np.float32))
    byte = clamped.to(torch.float8_e4m3fn).view(torch.uint8).numpy().astype(np.uint32)
    return np.where(np.isnan(x), 0x7F, byte)


def check_pack_e4m3_cvt(ex2: Ex2Model) -> None:
    """Four lanes, each a different permutation of every e4m3 value, the midpoints between them and their fp32
    neighbours, the saturation region and special values; lane i in byte i."""
    codes = np.arange(0, 0x7F)
    values = _e4m3_value(codes).astype(np.float64)
    mids = (values[:-1] + values[1:]) / 2
    grid = np.concatenate([values, mids, [448.0, 460.0, 464.0, 470.0, 1e6]]).astype(np.float32)
    grid = np.concatenate([grid, np.nextafter(grid, np.float32(np.inf)), np.nextafter(grid, np.float32(-np.inf))])
    x = np.concatenate([grid, -grid, SPECIALS, np.float32([np.inf, -np.inf])])
    lanes = [x, np.roll(x, 1), np.roll(x, 2)[::-1].copy(), np.roll(x, 3)]
    (word,) = run(*_fragment("pack_e4m3_cvt_asm"), *lanes, ex2=ex2)
    expected = sum(_e4m3_bytes_ref(lane).astype(np.uint64) << (8 * i) for i, lane in enumerate(lanes))
    _assert_same_bits(word.view(np.float32), expected.astype(np.uint32).view(np.float32), lanes, "pack_e4m3_cvt_asm")


def check_pack_h15_bytes(ex2: Ex2Model) -> None:
    """Bytes 4L of four lattice points (lane i in byte i), every L in every lane. Against the reference's byte
    oracle `h15_e4m3_bytes(n)`, n = L - 30 relative to the max (max_offset 8 and the shift 7, doubled), for L >= 2;
    L = 0 gives 0 as the reference, L = 1 gives byte 4 (2^-7) where the reference flushes to 0 (Note [H15 with
    FP8 P] in reference/attention.py; the stage's Note keeps it: MMA and row sum see the same value)."""
    rng = np.random.default_rng(4)
    lanes = [np.concatenate([FP8_L, rng.integers(0, 32, 4000)]) for _ in range(4)]
    for i, lane in enumerate(lanes):
        lanes[i] = np.roll(lane, 17 * i)
    points = [(np.float64(C) + lane / 2).astype(np.float32) for lane in lanes]
    (word,) = run(*_fragment("pack_h15_bytes_asm"), *points, ex2=ex2)
    reference = [h15_e4m3_bytes(torch.from_numpy(lane - 30)).numpy().astype(np.uint64) for lane in lanes]
    reference = [np.where(lane == 1, 4, ref) for lane, ref in zip(lanes, reference)]  # the one documented difference
    expected = sum(ref << np.uint64(8 * i) for i, ref in enumerate(reference)).astype(np.uint32)
    _assert_same_bits(word.view(np.float32), expected.view(np.float32), points, "pack_h15_bytes_asm")
    assert (expected == sum((4 * lane).astype(np.uint64) << np.uint64(8 * i) for i, lane in enumerate(lanes))).all()


FRAGMENT_CHECKS = {
    "h15_alu_asm": check_h15_alu,
    "h15_alu_pair_asm": check_h15_alu_pair,
    "h15_mufu_asm": check_h15_mufu,
    "h15_anchor_addend_asm": check_h15_anchor_addend,
    "h15_folded_alu_asm": check_h15_folded_alu,
    "h15_folded_mufu_asm": check_h15_folded_mufu,
    "pot_alu_asm": check_pot_alu,
    "pot_mufu_asm": check_pot_mufu,
    "nan_row_weight_asm": check_nan_row_weight,
    "h15_fp8_lattice_asm": check_h15_fp8_lattice,
    "h15_fp8_sat_lattice_asm": check_h15_fp8_sat_lattice,
    "h15_fp8_folded_lattice_asm": check_h15_fp8_folded_lattice,
    "h15_fp8_sum_add_asm": check_h15_fp8_sum_add,
    "add_keep_denormals_asm": check_add_keep_denormals,
    "pack_e4m3_cvt_asm": check_pack_e4m3_cvt,
    "pack_h15_bytes_asm": check_pack_h15_bytes,
    "promote_o_asm": check_promote_o,
}
USES_EX2 = {"h15_mufu_asm", "h15_folded_mufu_asm", "pot_mufu_asm"}


def check_fragment(name: str, ex2: Ex2Model = Ex2Model()) -> None:
    """Run the builder `name` (looked up now) through its check; AssertionError on any wrong bit."""
    FRAGMENT_CHECKS[name](ex2)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fragment_matches_the_reference_bit_for_bit(name):
    for ex2 in EX2_MODELS if name in USES_EX2 and name != "pot_mufu_asm" else [Ex2Model()]:
        check_fragment(name, ex2)


def test_mufu_paths_with_ex2_inexact_at_integers():
    """Both MUFU paths take ex2.approx as exact at integers (Note [PTX interpreter]). Were it not: `pot_mufu` has
    no snap, so its weights would be off by the error (the check catches it); the H15 snap absorbs it except at
    q = -126, where a result below 2^-126 is flushed by .ftz, weight 0 instead of 2^-126 of the row max."""
    check_fragment("pot_mufu_asm", Ex2Model(ulps=3))
    with pytest.raises(AssertionError):
        check_fragment("pot_mufu_asm", Ex2Model(ulps=1, exact_at_integers=False))
    check_fragment("h15_mufu_asm", Ex2Model(ulps=2**20, exact_at_integers=False))
    (w,) = run(*sb.h15_mufu_asm(), H15_X, ex2=Ex2Model(ulps=-1, exact_at_integers=False))
    wrong = _bits(w) != _bits(_h15_ref(H15_X, ftz_level=True))
    assert wrong.any() and (np.round(H15_X[wrong].astype(np.float64) * 2) == -252).all()


def test_alu_fragments_outside_their_domain():
    """Pinned: the kernels never feed +inf (a +inf score makes the row max +inf, so x is -inf or NaN: Note [NaN rows
    in the approximate modes on SM100]) nor x above the ALU bit tricks' range; there they return 1.0 (the exponent
    bits of inf shift out) and garbage, where ex2 on the MUFU gives +inf."""
    x = np.float32([np.inf, 129.0])
    assert _bits(run(*sb.h15_alu_asm(), x)[0]).tolist() == [0x3F800000, 0x80000000]
    assert _bits(run(*sb.pot_alu_asm(), x)[0]).tolist() == [0x3F800000, 0x80000000]
    assert np.isposinf(run(*sb.h15_mufu_asm(), x)[0]).all() and np.isposinf(run(*sb.pot_mufu_asm(), x)[0]).all()


# --- coverage: every inline-PTX fragment of the stages has a check -------------------------------------------------


def test_every_builder_has_a_check():
    assert len(BUILDERS) >= 15 and sorted(FRAGMENT_CHECKS) == sorted(BUILDERS)


def test_every_inline_asm_of_the_stages_comes_from_a_builder():
    """In fa4_rowmax/stage/*.py, every `llvm.inline_asm` call takes `asm.ptx, asm.constraints` of an InlineAsm, and
    InlineAsm is built only in `@ptx_fragment` functions (Note [PTX fragments are data])."""
    for path in sorted(STAGE_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        inside = {}
        for func in ast.walk(tree):
            if isinstance(func, ast.FunctionDef):
                for node in ast.walk(func):
                    inside.setdefault(id(node), func)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            where = f"{path.name}:{node.lineno}"
            if callee == "inline_asm":
                text, constraints = node.args[2], node.args[3]
                assert isinstance(text, ast.Attribute) and text.attr == "ptx", where
                assert isinstance(constraints, ast.Attribute) and constraints.attr == "constraints", where
            if callee == "InlineAsm":
                func = inside.get(id(node))
                assert func is not None and _decorated_with(func, "ptx_fragment"), where


# --- mutants: each altered builder must fail its check -------------------------------------------------------------

_CLAMP = sb._H15_CLAMP_HEX
MUTANTS = {
    "pair: second shift 22 -> 21": ("h15_alu_pair_asm", "shl.b32 b1, b1, 22", "shl.b32 b1, b1, 21"),
    "pair: outputs swapped": (
        "h15_alu_pair_asm",
        "mov.b32 $0, b0;\n\tmov.b32 $1, b1;",
        "mov.b32 $0, b1;\n\tmov.b32 $1, b0;",
    ),
    "pair: inputs swapped": (
        "h15_alu_pair_asm",
        f"c0, $2, {_CLAMP};\n\tmax.ftz.f32 c1, $3,",
        f"c0, $3, {_CLAMP};\n\tmax.ftz.f32 c1, $2,",
    ),
    "pair: no clamp on lane 1": ("h15_alu_pair_asm", f"max.ftz.f32 c1, $3, {_CLAMP}", "mov.f32 c1, $3"),
    "pair: round-add .rn -> .rm": ("h15_alu_pair_asm", "add.rn.ftz.f32x2", "add.rm.ftz.f32x2"),
    "pair: bits(1.0) off by one": (
        "h15_alu_pair_asm",
        f"add.s32 b0, b0, {sb.FP32_ONE_BITS}",
        f"add.s32 b0, b0, {sb.FP32_ONE_BITS + 1}",
    ),
    "alu: round-add .rn -> .rz": ("h15_alu_asm", "add.rn.ftz.f32 t, t,", "add.rz.ftz.f32 t, t,"),
    "alu: no clamp": ("h15_alu_asm", f"max.ftz.f32 t, $1, {_CLAMP}", "mov.f32 t, $1"),
    "alu: clamp at -126": ("h15_alu_asm", _CLAMP, sb._f32_hex(-126.0)),
    "alu: shift 22 -> 23": ("h15_alu_asm", "shl.b32 b, b, 22", "shl.b32 b, b, 23"),
    "mufu: snap mask drops the half bit": ("h15_mufu_asm", f"0x{sb.H15_SNAP_MASK:08X}", "0xFF800000"),
    "mufu: no snap add": ("h15_mufu_asm", f"add.s32 b, b, {sb.H15_SNAP_ADD};", ""),
    "mufu: round-add .rn -> .rp": ("h15_mufu_asm", "add.rn.ftz.f32 t, t,", "add.rp.ftz.f32 t, t,"),
    "addend: fma .rn -> .rz": ("h15_anchor_addend_asm", "fma.rn.f32", "fma.rz.f32"),
    "addend: no negation": ("h15_anchor_addend_asm", "neg.f32 m, $1", "mov.f32 m, $1"),
    "folded alu: no clamp": ("h15_folded_alu_asm", f"max.ftz.f32 t, t, {sb._H15_FOLD_CLAMP_HEX}", "mov.f32 t, t"),
    "folded alu: fma operands swapped": (
        "h15_folded_alu_asm",
        "fma.rn.ftz.f32 t, $1, $2, $3",
        "fma.rn.ftz.f32 t, $1, $3, $2",
    ),
    "folded mufu: fma .rn -> .rm": ("h15_folded_mufu_asm", "fma.rn.ftz.f32", "fma.rm.ftz.f32"),
    "pot alu: shift 23 -> 22": ("pot_alu_asm", "shl.b32 b, b, 23", "shl.b32 b, b, 22"),
    "pot alu: masked scores not zeroed": ("pot_alu_asm", "selp.b32 b, 0, b, masked", "mov.b32 b, b"),
    "pot alu: round-add .rn -> .rp": ("pot_alu_asm", "add.rn.ftz.f32", "add.rp.ftz.f32"),
    "pot mufu: clamp at -21": ("pot_mufu_asm", sb._POT_CLAMP_HEX, sb._f32_hex(-21.0)),
    "pot mufu: select swapped": ("pot_mufu_asm", "0f00000000, t, masked", "t, 0f00000000, masked"),
    "nan row: NaN-quiet max": ("nan_row_weight_asm", "max.NaN.f32", "max.f32"),
    "nan row: operands swapped": ("nan_row_weight_asm", "t, $2, 0f00000000", "t, $1, 0f00000000"),
    "fp8 lattice: no clamp at 0": ("h15_fp8_lattice_asm", "max.f32 t, t, 0f00000000", "mov.f32 t, t"),
    "fp8 lattice: round-add .rn -> .rz": ("h15_fp8_lattice_asm", "add.rn.f32", "add.rz.f32"),
    "fp8 sat lattice: no saturation": ("h15_fp8_sat_lattice_asm", "fma.rn.sat.f32", "fma.rn.f32"),
    "fp8 sat lattice: 32u -> 16u": ("h15_fp8_sat_lattice_asm", "u, 0f42000000,", "u, 0f41800000,"),
    "fp8 folded lattice: no clamp": (
        "h15_fp8_folded_lattice_asm",
        f"max.f32 $0, t, {sb._H15_ROUND_HEX}",
        "mov.f32 $0, t",
    ),
    "fp8 sum: shift 22 -> 21": ("h15_fp8_sum_add_asm", "shl.b32 b, $2, 22", "shl.b32 b, $2, 21"),
    "fp8 sum: .rn -> .rp": ("h15_fp8_sum_add_asm", "add.rn.f32", "add.rp.f32"),
    "add without ftz: .rn -> .rz": ("add_keep_denormals_asm", "add.rn.f32", "add.rz.f32"),
    "promote: .rn -> .rz": ("promote_o_asm", "fma.rn.f32", "fma.rz.f32"),
    "promote: scale and acc swapped": ("promote_o_asm", "$1, $2, $3", "$1, $3, $2"),
    "e4m3 cvt: bytes of a pair swapped": ("pack_e4m3_cvt_asm", "lo, $2, $1", "lo, $1, $2"),
    "e4m3 cvt: halves swapped": ("pack_e4m3_cvt_asm", "{lo, hi}", "{hi, lo}"),
    "h15 bytes: shift 2 -> 3": ("pack_h15_bytes_asm", "shl.b32 $0, w, 2", "shl.b32 $0, w, 3"),
    "h15 bytes: word halves swapped": ("pack_h15_bytes_asm", "0x5410", "0x1054"),
    "h15 bytes: one selector wrong": ("pack_h15_bytes_asm", "t1, $3, $4, 0x0040", "t1, $3, $4, 0x0004"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_mutated_builder_fails_its_check(monkeypatch, mutant):
    name, old, new = MUTANTS[mutant]
    module = importlib.import_module(f"fa4_rowmax.stage.{BUILDERS[name]}")
    asm = getattr(module, name)()
    assert asm.ptx.count(old) == 1, f"the mutation site {old!r} is not (uniquely) in {name}"
    monkeypatch.setattr(module, name, lambda: asm._replace(ptx=asm.ptx.replace(old, new)))
    with pytest.raises(AssertionError):
        check_fragment(name)


# Equivalent mutants (no check can catch them; listed so nobody adds them as tests): dropping `.ftz` from the clamp
# (a denormal x rounds to the same lattice point), `.rz`/`.rm`/`.rp` on the MUFU path's `sub` (r - 1.5 * 2^22 is
# exact), and a snap add of 2^20 instead of 2^21 (still inside the snap's tolerance).


# --- the interpreter itself ------------------------------------------------------------------------------------


def _asm(body: str, regs: str = ".reg .f32 t;") -> str:
    return "{\n\t" + regs + "\n\t" + body + "\n\t}\n"


def _rational(x: np.float32) -> Fraction:
    return Fraction(float(x))


def _round_directed(q: Fraction, rounding: str) -> np.float32:
    """`_round_to_f32` under .rz/.rm/.rp, from the nearest one and its neighbours (exact comparisons)."""
    near = _round_to_f32(q)
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    finite = [c for c in candidates if np.isfinite(c)]
    below = max((c for c in finite if _rational(c) <= q), key=_rational, default=np.float32(-np.inf))
    above = min((c for c in finite if _rational(c) >= q), key=_rational, default=np.float32(np.inf))
    if rounding == "rm":
        return below
    if rounding == "rp":
        return above
    return below if q >= 0 else above


def _random_f32(rng, n: int) -> np.ndarray:
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    close = (rng.standard_normal(n) * 4).astype(np.float32)
    return np.where(np.isfinite(x) & (rng.random(n) < 0.5), x, close)


@pytest.mark.parametrize("rounding", ["rn", "rz", "rm", "rp"])
def test_fp32_arithmetic_is_correctly_rounded(rounding):
    """add/sub/mul/fma against an exact rational oracle, every rounding mode, random operands incl. denormals."""
    rng = np.random.default_rng({"rn": 0, "rz": 1, "rm": 2, "rp": 3}[rounding])
    a, b, c = (_random_f32(rng, 1500) for _ in range(3))
    with np.errstate(over="ignore"):
        product = (a.astype(np.float64) * b * -1).astype(np.float32)
    c = np.where((rng.random(1500) < 0.5) & np.isfinite(product), product, c)  # cancellations
    regs = ".reg .f32 t;"
    for op, operands, exact in (
        ("add", (a, b), lambda i: _rational(a[i]) + _rational(b[i])),
        ("sub", (a, b), lambda i: _rational(a[i]) - _rational(b[i])),
        ("mul", (a, b), lambda i: _rational(a[i]) * _rational(b[i])),
        ("fma", (a, b, c), lambda i: _rational(a[i]) * _rational(b[i]) + _rational(c[i])),
    ):
        args = ", ".join(f"${k + 1}" for k in range(len(operands)))
        ptx = _asm(f"{op}.{rounding}.f32 t, {args};\n\tmov.b32 $0, t;", regs)
        (got,) = run(ptx, "=f" + ",f" * len(operands), *operands)
        for i in range(a.size):
            q = exact(i)
            want = _round_to_f32(q) if rounding == "rn" else _round_directed(q, rounding)
            if q == 0:
                continue  # zero signs: test_exact_zero_signs
            assert _bits(got[i]) == _bits(want), (op, rounding, a[i], b[i], c[i], got[i], want)


def test_exact_zero_signs_and_specials():
    one, zero = np.float32(1.0), np.float32(0.0)

    def add(rnd):
        return _asm(f"add.{rnd}.f32 t, $1, $2;\n\tmov.b32 $0, t;")

    assert _bits(run(add("rn"), "=f,f,f", one, -one)[0]) == 0
    assert _bits(run(add("rm"), "=f,f,f", one, -one)[0]) == 0x80000000
    assert _bits(run(add("rm"), "=f,f,f", zero, zero)[0]) == 0
    assert _bits(run(add("rn"), "=f,f,f", -zero, -zero)[0]) == 0x80000000
    assert _bits(run(add("rn"), "=f,f,f", np.float32(np.inf), np.float32(-np.inf))[0]) == CANONICAL_NAN
    big = np.float32(3.4028235e38)
    assert np.isposinf(run(add("rn"), "=f,f,f", big, big)[0]) and run(add("rz"), "=f,f,f", big, big)[0] == big


def test_ftz_and_sat():
    tiny = np.float32(1e-40)
    assert _bits(run(_asm("add.rn.ftz.f32 t, $1, $2;\n\tmov.b32 $0, t;"), "=f,f,f", tiny, -tiny * 0)[0]) == 0
    assert run(_asm("add.rn.f32 t, $1, $2;\n\tmov.b32 $0, t;"), "=f,f,f", tiny, np.float32(0))[0] == tiny
    assert (
        _bits(
            run(_asm("mul.rn.ftz.f32 t, $1, $2;\n\tmov.b32 $0, t;"), "=f,f,f", np.float32(-1e-20), np.float32(1e-20))[0]
        )
        == 0x80000000
    )
    sat = _asm("add.rn.sat.f32 t, $1, $2;\n\tmov.b32 $0, t;")
    got = run(sat, "=f,f,f", np.float32([0.25, 2.0, -3.0, np.nan]), np.float32(0.5))[0]
    assert _bits(got).tolist() == _bits([0.75, 1.0, 0.0, 0.0]).tolist()


def test_max_min_nan_rules_and_signed_zeros():
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    a = np.float32([nan, 1.0, nan, 0.0, -0.0, -inf])
    b = np.float32([2.0, nan, nan, -0.0, -0.0, 3.0])

    def mx(mods):
        return run(_asm(f"max{mods}.f32 t, $1, $2;\n\tmov.b32 $0, t;"), "=f,f,f", a, b)[0]

    mn = run(_asm("min.f32 t, $1, $2;\n\tmov.b32 $0, t;"), "=f,f,f", a, b)[0]
    assert (
        _bits(mx("")).tolist()
        == _bits([2.0, 1.0, 0.0, 0.0, -0.0, 3.0]).tolist()[:2] + [CANONICAL_NAN] + _bits([0.0, -0.0, 3.0]).tolist()
    )
    assert _bits(mx(".NaN")).tolist()[:3] == [CANONICAL_NAN] * 3
    assert _bits(mn).tolist() == _bits([2.0, 1.0]).tolist() + [CANONICAL_NAN] + _bits([-0.0, -0.0, -inf]).tolist()
    three = run(
        _asm("max.NaN.f32 t, $1, $2, $3;\n\tmov.b32 $0, t;"),
        "=f,f,f,f",
        np.float32([1, 1]),
        np.float32([5, nan]),
        np.float32([2, 2]),
    )[0]
    assert three[0] == 5 and _bits(three[1]) == CANONICAL_NAN


def test_packed_f32x2_lanes_and_vector_moves():
    regs = ".reg .f32 a, b;\n\t.reg .b64 p, q;"
    body = (
        "mov.b64 p, {$2, $3};\n\tmov.b64 q, {$3, $3};\n\tmul.rn.f32x2 p, p, q;\n\tmov.b64 {a, b}, p;\n\t"
        "mov.b32 $0, a;\n\tmov.b32 $1, b;"
    )
    lo, hi = run(_asm(body, regs), "=f,=f,f,f", np.float32([3.0]), np.float32([0.5]))
    assert lo[0] == 1.5 and hi[0] == 0.25


def test_integer_ops():
    regs = ".reg .b32 r, s;\n\t.reg .u32 u;\n\t.reg .s32 i;"

    def one(body, *x):
        return int(
            _bits(
                run(_asm(body + "\n\tmov.b32 $0, r;", regs), "=f" + ",f" * len(x), *np.uint32(x).view(np.float32))[0][0]
            )
        )

    a, b, c = 0x12345678, 0x9ABCDEF0, 0x0F0F0F0F
    args = [a, b, c]
    load = "mov.b32 r, $1;\n\tmov.b32 s, $2;\n\tmov.b32 u, $3;\n\t"
    assert one(load + "lop3.b32 r, r, s, u, 0x96;", *args) == a ^ b ^ c
    assert one(load + "lop3.b32 r, r, s, u, 0xE8;", *args) == (a & b) | (a & c) | (b & c)  # majority
    assert one(load + "prmt.b32 r, r, s, 0x0123;", *args) == 0x78563412
    assert one(load + "prmt.b32 r, r, s, 0x7654;", *args) == b
    assert one(load + "prmt.b32 r, r, s, 0x8880;", *args) == 0x00000078  # byte 0 sign 0 replicated
    assert one(load + "prmt.b32 r, s, r, 0x000C;", *args) == 0xF0F0F000  # byte 4 (r's 0x78) as its sign, then s's 0xF0
    assert one(load + "shf.l.wrap.b32 r, r, s, 8;", *args) == ((b << 8) | (a >> 24)) & 0xFFFFFFFF
    assert one(load + "shf.r.clamp.b32 r, r, s, 40;", *args) == b
    assert one(load + "shr.u32 u, s, 4;\n\tmov.b32 r, u;", *args) == b >> 4
    assert one(load + "mov.b32 i, s;\n\tshr.s32 i, i, 40;\n\tmov.b32 r, i;", *args) == 0xFFFFFFFF
    assert one(load + "shl.b32 r, r, 32;", *args) == 0
    assert one(load + "mov.b32 i, r;\n\tmad.lo.s32 i, i, i, -1;\n\tmov.b32 r, i;", *args) == (a * a - 1) & 0xFFFFFFFF
    assert one(load + "mov.b32 u, r;\n\tsub.u32 u, u, 4294967295;\n\tmov.b32 r, u;", *args) == (a + 1) & 0xFFFFFFFF
    assert (
        one(load + "and.b32 r, r, s;\n\tor.b32 r, r, 1;\n\txor.b32 r, r, s;\n\tnot.b32 r, r;", *args)
        == ~(((a & b) | 1) ^ b) & 0xFFFFFFFF
    )


def test_setp_orders_nan():
    x = np.float32([1.0, np.nan, 2.0])
    for cmp, want in (("lt", [1, 0, 0]), ("ltu", [1, 1, 0]), ("ne", [1, 0, 1]), ("neu", [1, 1, 1]), ("nan", [0, 1, 0])):
        ptx = _asm(f"setp.{cmp}.f32 p, $1, $2;\n\tselp.f32 $0, 0f3F800000, 0f00000000, p;", ".reg .pred p;")
        assert run(ptx, "=f,f,f", x, np.float32([2.0, 2.0, 1.0]))[0].tolist() == want, cmp


@pytest.mark.parametrize(
    "ptx, message",
    [
        (_asm("foo.f32 t, $1;\n\tmov.b32 $0, t;"), "unknown instruction"),
        (_asm("add.rna.f32 t, $1, $1;\n\tmov.b32 $0, t;"), "modifier"),
        (_asm("add.f32 t, $1, $1;\n\tmov.b32 $0, t;"), "rounding modifier"),
        (_asm("add.rn.ftz.ftz.f32 t, $1, $1;\n\tmov.b32 $0, t;"), "modifier"),
        (_asm("mov.b32 $0, t;"), "read before"),
        (_asm("add.s32 t, t, 1;\n\tmov.b32 $0, t;"), "used as .s32"),
        (_asm("@p mov.b32 $0, $1;"), "guarded"),
        (_asm("mov.f32 t, 1.0;\n\tmov.b32 $0, t;"), "operand"),
        (_asm("mov.f32 t, $1;"), "never written"),
        (_asm("mov.b32 $0, u;"), "not declared"),
        ("{\n\t.reg .f32 t;\n\tmov.b32 $0, $1;\n", "unclosed"),
        (_asm("ex2.f32 t, $1;\n\tmov.b32 $0, t;"), "ex2.approx"),
        (_asm(".reg .f32 t;\n\tmov.b32 $0, $1;"), "repeated"),
        (_asm("mov.b32 $1, $1;"), "not an output"),
    ],
)
def test_the_interpreter_rejects_what_it_does_not_know(ptx, message):
    with pytest.raises(PtxError, match=message):
        run(ptx, "=f,f", np.float32([1.0]))


def test_the_interpreter_checks_constraints_and_input_types():
    with pytest.raises(PtxError, match="inputs"):
        run(sb.h15_alu_asm().ptx, "=f,f,f", np.float32([1.0]))
    with pytest.raises(PtxError, match="constraints"):
        run(sb.h15_alu_asm().ptx, "=f,r", np.float32([1.0]))
    with pytest.raises(TypeError, match="float32"):
        run(*sb.h15_alu_asm(), np.float64([1.0]))


def test_ex2_model():
    x = np.float32([0.5, 3.0, -np.inf, np.inf, np.nan, -126.5])
    exact = run(_asm("ex2.approx.ftz.f32 t, $1;\n\tmov.b32 $0, t;"), "=f,f", x)[0]
    assert exact[0] == np.float32(math.sqrt(2)) and exact[1] == 8 and exact[2] == 0 and np.isposinf(exact[3])
    assert _bits(exact[4]) == CANONICAL_NAN and _bits(exact[5]) == 0  # ftz flushes 2^-126.5
    moved = run(_asm("ex2.approx.f32 t, $1;\n\tmov.b32 $0, t;"), "=f,f", x, ex2=Ex2Model(ulps=-2))[0]
    assert _bits(moved[0]) == _bits(exact[0]) - 2 and moved[1] == 8 and moved[5] > 0  # no ftz: the denormal stays
