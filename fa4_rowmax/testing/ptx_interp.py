"""Execute the inline PTX of the softmax stages on numpy arrays, bit for bit (Note [PTX interpreter]).

    (w,) = run(asm.ptx, asm.constraints, x)     # float32 arrays in, float32 arrays out, one lane per element

The fragments come from the stages' own builders (`@ptx_fragment`, Note [PTX fragments are data] in
softmax_base.py); tests/test_ptx_fragments.py runs each against the closed-form reference. Pure numpy: no
cutlass, no GPU.

Note [PTX interpreter]
~~~~~~~~~~~~~~~~~~~~~~
Straight-line PTX as `llvm.inline_asm` takes it: `{ }` scopes with `.reg .TYPE a, b;` declarations (no `%r<n>`
ranges), then unguarded instructions over declared registers, immediates and the operands `$k`, bound by the
constraint string (outputs `=f` / `=r` first, then inputs `f`, numbered in that order). Every lane (array element)
runs the same instructions. Anything else raises PtxError, never skipped: an unknown opcode, modifier, type or
operand form, a register of a type the instruction does not accept, a read before a write, an output left
unwritten. Values are held as bits (uint32 / uint64 / bool). Semantics, per the PTX ISA:
- fp32 `add`/`sub`/`mul`/`fma` need an explicit `.rn`/`.rz`/`.rm`/`.rp` (without one ptxas may contract an add
  or mul into an fma, so the value is not fixed). They are computed exactly (an fp32 product is exact in fp64,
  TwoSum gives a sum as an exact pair of fp64) and rounded once; IEEE infinities and NaNs; a NaN result is the
  canonical NaN 0x7FFFFFFF; an exact zero sum is +0 except under `.rm` (-0) or when both addends are -0.
- `.ftz`: subnormal inputs, and results that are subnormal after rounding, become a zero of the same sign.
  `.sat`: the result is clamped to [+0, 1], NaN to +0.
- `max`/`min` (2 or 3 inputs): NaN inputs are ignored unless all are NaN; with `.NaN` any NaN input gives the
  canonical NaN; +0 counts as greater than -0.
- `.f32x2` (`add`/`sub`/`mul`/`fma` on `.b64` registers): element 0 in bits 0..31, element 1 in bits 32..63;
  `mov.b64 d, {lo, hi}` packs and `mov.b64 {lo, hi}, d` unpacks in the same order (`mov.b32` likewise with
  `.b16` halves).
- `cvt.rn.satfinite.e4m3x2.f32 d, a, b`: a to the high byte, b to the low one, each rounded to nearest even
  on e4m3's grid (subnormals 2^-9 apart), finite values past 448 and infinities saturated to +-448, NaN 0x7F.
- integers wrap mod 2^32; shift amounts above 31 give 0 (`shl`, `shr.b32/.u32`) or the sign (`shr.s32`).
- `ex2.approx`: the ISA bounds its error (a few ulps) but does not give its bits, so its value is a model
  (Ex2Model): 2^a rounded to nearest, moved by a chosen number of ulps; exact at integer a unless told not to
  be, an assumption `rowmax_pot`'s MUFU path rests on (tests/test_ptx_fragments.py). -inf gives +0, +inf gives
  +inf, NaN the canonical NaN.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

CANONICAL_NAN = 0x7FFFFFFF
_SIGN = np.uint32(0x80000000)
_FLT_MAX = np.float32(np.finfo(np.float32).max)
_ROUNDINGS = ("rn", "rz", "rm", "rp")
# Register types by size in bits; `pred` is a predicate.
_SIZES = {"f32": 32, "b32": 32, "s32": 32, "u32": 32, "b16": 16, "b64": 64, "pred": 1}
_E4M3_MAX = 448.0
_SETP = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: (a != b) & ~np.isnan(a) & ~np.isnan(b),
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "num": lambda a, b: ~np.isnan(a) & ~np.isnan(b),
    "nan": lambda a, b: np.isnan(a) | np.isnan(b),
}
for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    _SETP[_op + "u"] = (lambda ordered: lambda a, b: ordered(a, b) | np.isnan(a) | np.isnan(b))(_SETP[_op])


class PtxError(ValueError):
    """PTX outside the interpreted subset, or ill-typed (Note [PTX interpreter])."""


@dataclass(frozen=True)
class Ex2Model:
    """`ex2.approx.f32` as 2^a rounded to nearest fp32, then `ulps` units in the last place up (down if
    negative); at integer a exactly 2^a unless `exact_at_integers` is False (Note [PTX interpreter])."""

    ulps: int = 0
    exact_at_integers: bool = True

    def __call__(self, a_bits: np.ndarray) -> np.ndarray:
        a = _bits_f64(a_bits)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            rounded = np.exp2(a).astype(np.float32).view(np.uint32)
        moved = np.isfinite(a) & (rounded != 0) & (rounded != 0x7F800000)
        if self.exact_at_integers:
            moved &= a != np.round(a)
        shifted = np.clip(rounded.astype(np.int64) + self.ulps, 0, 0x7F800000).astype(np.uint32)
        out = np.where(moved, shifted, rounded)
        return np.where(np.isnan(a), np.uint32(CANONICAL_NAN), out).astype(np.uint32)


def _bits_f64(bits: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # signalling NaNs
        return bits.view(np.float32).astype(np.float64)


def _flush(bits: np.ndarray) -> np.ndarray:
    """Subnormals to a zero of the same sign (`.ftz`)."""
    return np.where((bits & 0x7F800000) == 0, bits & _SIGN, bits).astype(np.uint32)


def _two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """s = fl64(a + b) and the exact error e = a + b - s (0 where s is not finite)."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = a + b
        bb = s - a
        e = (a - (s - bb)) + (b - bb)
    return s, np.where(np.isfinite(s), e, 0.0)


def _round_f32(s: np.ndarray, e: np.ndarray, rounding: str) -> np.ndarray:
    """The fp32 bits of the exact value s + e (fp64 pair, |e| <= ulp(s) / 2) rounded once by `rounding`.

    r = rn32(s) and its neighbour on the side of s + e bracket the value (rounding s to fp64 cannot have
    crossed an fp32 number or midpoint, as both are fp64 numbers); past fp32's range 2^128 stands in for inf.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return _round_f32_unchecked(s, e, rounding)


def _round_f32_unchecked(s: np.ndarray, e: np.ndarray, rounding: str) -> np.ndarray:
    r = s.astype(np.float32)
    finite = np.isfinite(s)
    r = np.where(finite & np.isinf(r), np.copysign(_FLT_MAX, s).astype(np.float32), r)
    side = (s - r.astype(np.float64)) + e  # sign of (s + e) - r
    up = np.nextafter(r, np.float32(np.inf))
    down = np.nextafter(r, np.float32(-np.inf))
    lo = np.where(side < 0, down, r)
    hi = np.where(side > 0, up, r)
    lo64, hi64 = (
        np.where(np.isinf(v), np.copysign(2.0**128, v.astype(np.float64)), v.astype(np.float64)) for v in (lo, hi)
    )
    if rounding == "rn":
        tie = (s - (lo64 + hi64) / 2) + e
        hi_is_even = (hi.view(np.uint32) & 1) == 0
        pick = np.where(tie > 0, hi, np.where(tie < 0, lo, np.where(hi_is_even, hi, lo)))
    elif rounding == "rz":
        pick = np.where(lo64 >= 0, lo, hi)
    elif rounding == "rm":
        pick = lo
    else:
        pick = hi
    pick = np.where(side == 0, r, pick)
    out = np.where(finite, pick, s.astype(np.float32)).view(np.uint32)
    return np.where(np.isnan(s), np.uint32(CANONICAL_NAN), out).astype(np.uint32)


def _fp32_arith(op: str, rounding: str, args: list[np.ndarray]) -> np.ndarray:
    """add/sub/mul/fma of fp32 values (as fp64) rounded once; exact zero sums signed per IEEE 754."""
    a, b = args[0], args[1]
    if op == "mul":
        with np.errstate(invalid="ignore"):
            return _round_f32(a * b, np.zeros_like(a), rounding)
    if op == "fma":
        with np.errstate(invalid="ignore"):
            addends = (a * b, args[2])
    else:
        addends = (a, -b if op == "sub" else b)
    s, e = _two_sum(*addends)
    out = _round_f32(s, e, rounding)
    exact_zero = (s == 0) & (e == 0)
    zeros = (addends[0] == 0) & (addends[1] == 0)
    signs = np.signbit(addends[0]).astype(int) + np.signbit(addends[1])
    negative = (zeros & (signs == 2)) | ((rounding == "rm") & ~(zeros & (signs == 0)))
    return np.where(exact_zero, np.where(negative, _SIGN, np.uint32(0)), out).astype(np.uint32)


def _max_min(op: str, nan_propagates: bool, args: list[np.ndarray]) -> np.ndarray:
    """max/min of fp32 bits (Note [PTX interpreter]: NaN rules, +0 > -0)."""
    result = args[0]
    for other in args[1:]:
        a, b = _bits_f64(result), _bits_f64(other)
        better = (a > b) if op == "max" else (a < b)
        worse = (a < b) if op == "max" else (a > b)
        zeros = (a == 0) & (b == 0)
        zero_pick = (result & other) if op == "max" else (result | other)  # the sign bits decide
        picked = np.where(better, result, np.where(worse, other, np.where(zeros, zero_pick, result)))
        picked = np.where(np.isnan(a), other, np.where(np.isnan(b), result, picked))
        if nan_propagates:
            picked = np.where(np.isnan(a) | np.isnan(b), np.uint32(CANONICAL_NAN), picked)
        result = np.where(np.isnan(_bits_f64(picked)), np.uint32(CANONICAL_NAN), picked).astype(np.uint32)
    return result


def _e4m3_satfinite(bits: np.ndarray) -> np.ndarray:
    """fp32 bits to e4m3 bytes (Note [PTX interpreter]: cvt.rn.satfinite)."""
    value = _bits_f64(bits)
    magnitude = np.where(np.isfinite(value), np.abs(value), _E4M3_MAX)
    exponent = np.maximum(np.frexp(magnitude)[1] - 1, -6)  # floor(log2), e4m3's subnormals below 2^-6
    rounded = np.minimum(np.rint(magnitude / np.ldexp(1.0, exponent - 3)) * np.ldexp(1.0, exponent - 3), _E4M3_MAX)
    top = np.frexp(rounded)[1] - 1
    normal = rounded >= 2.0**-6
    code = np.where(normal, (top + 7) * 8 + (rounded / np.ldexp(1.0, top) - 1) * 8, rounded / 2.0**-9)
    byte = code.astype(np.uint32) | ((bits >> 31) << 7)
    return np.where(np.isnan(value), np.uint32(0x7F), byte).astype(np.uint32)


def _lop3(a, b, c, lut: int) -> np.ndarray:
    """Bit i of the result is bit (a_i b_i c_i as a 3-bit index) of `lut` (lop3's immLut: a = 0xF0, b = 0xCC,
    c = 0xAA)."""
    out = np.zeros_like(a)
    for index in range(8):
        if lut >> index & 1:
            out |= (a if index & 4 else ~a) & (b if index & 2 else ~b) & (c if index & 1 else ~c)
    return out


def _prmt(a, b, selector) -> np.ndarray:
    """prmt.b32 (default mode): byte i of d is byte (selector nibble i & 7) of {b, a}, or its sign if nibble & 8."""
    pool = (b.astype(np.uint64) << 32) | a.astype(np.uint64)
    out = np.zeros_like(a, dtype=np.uint64)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = (pool >> ((nibble & 7).astype(np.uint64) * 8)) & 0xFF
        byte = np.where(nibble & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint64)
        out |= byte << np.uint64(8 * i)
    return out.astype(np.uint32)


def _shift(op: str, kind: str, a: np.ndarray, n: np.ndarray) -> np.ndarray:
    n64 = np.minimum(n.astype(np.uint64), 32)
    if op == "shl":
        return ((a.astype(np.uint64) << n64) & 0xFFFFFFFF).astype(np.uint32)
    if kind == "s32":
        return (a.view(np.int32).astype(np.int64) >> np.minimum(n64, 31).astype(np.int64)).astype(np.uint32)
    return (a.astype(np.uint64) >> n64).astype(np.uint32)


def _funnel(direction: str, mode: str, a, b, c) -> np.ndarray:
    """shf.{l,r}: the high (l) or low (r) word of {b, a} shifted by c (clamped to 32, or c mod 32)."""
    n = np.minimum(c, 32) if mode == "clamp" else (c & 31)
    pool = (b.astype(np.uint64) << 32) | a.astype(np.uint64)
    n = n.astype(np.uint64)
    if direction == "l":
        return (((pool << n) >> np.uint64(32)) & 0xFFFFFFFF).astype(np.uint32)
    return ((pool >> n) & 0xFFFFFFFF).astype(np.uint32)


_TOKEN_INT = re.compile(r"-?(0[xX][0-9a-fA-F]+|[0-9]+)")
_TOKEN_F32 = re.compile(r"0[fF][0-9a-fA-F]{8}")
_TOKEN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN_DOLLAR = re.compile(r"\$([0-9]+)")


class _Machine:
    def __init__(self, constraints: str, inputs: list[np.ndarray], ex2: Ex2Model):
        entries = constraints.split(",")
        self.output_types = {i: {"=f": "f32", "=r": "b32"}[c] for i, c in enumerate(entries) if c in ("=f", "=r")}
        self.outputs = list(self.output_types)
        self.input_slots = [i for i, c in enumerate(entries) if c == "f"]
        if len(self.outputs) + len(self.input_slots) != len(entries) or self.outputs != list(range(len(self.outputs))):
            raise PtxError(
                f"constraints {constraints!r}: only '=f'/'=r' outputs followed by 'f' inputs are interpreted"
            )
        if len(inputs) != len(self.input_slots):
            raise PtxError(f"constraints {constraints!r} take {len(self.input_slots)} inputs, got {len(inputs)}")
        if any(np.asarray(x).dtype != np.float32 for x in inputs):
            raise TypeError("inputs must be float32 (a wider type would be rounded on the way in)")
        arrays = np.broadcast_arrays(*[np.asarray(x) for x in inputs]) if inputs else []
        self.shape = arrays[0].shape if inputs else ()
        self.operands = {slot: np.ascontiguousarray(x).view(np.uint32) for slot, x in zip(self.input_slots, arrays)}
        self.written: dict[int, np.ndarray] = {}
        self.scopes: list[dict[str, list]] = []  # name -> [type, value or None]
        self.ex2 = ex2

    # --- operands ------------------------------------------------------------------------------------------
    def _register(self, name: str) -> list:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        raise PtxError(f"register {name!r} is not declared")

    @staticmethod
    def _accepts(itype: str, rtype: str) -> bool:
        """PTX operand type rules: same size; a .b register or instruction matches any kind, else f with f and
        integers (s/u) with integers."""
        if itype == "pred" or rtype == "pred":
            return itype == rtype
        if _SIZES[itype] != _SIZES[rtype]:
            return False
        if itype[0] == "b" or rtype[0] == "b":
            return True
        return (itype[0] == "f") == (rtype[0] == "f")

    def read(self, token: str, itype: str) -> np.ndarray:
        token = token.strip()
        dollar = _TOKEN_DOLLAR.fullmatch(token)
        if dollar:
            slot = int(dollar.group(1))
            if not self._accepts(itype, self.output_types.get(slot, "f32")):
                raise PtxError(f"{token} is a .{self.output_types.get(slot, 'f32')} operand, not .{itype}")
            if slot in self.operands:
                return self.operands[slot]
            if slot in self.written:
                return self.written[slot]
            raise PtxError(f"{token} is read before it is written")
        if _TOKEN_F32.fullmatch(token):
            if itype != "f32":
                raise PtxError(f"fp32 literal {token} for a .{itype} operand")
            return np.full(self.shape, int(token[2:], 16), dtype=np.uint32)
        if _TOKEN_INT.fullmatch(token):
            if itype not in ("b32", "s32", "u32"):
                raise PtxError(f"integer literal {token} for a .{itype} operand")
            value = int(token, 0)
            if not -(2**31) <= value < 2**32:
                raise PtxError(f"integer literal {token} does not fit 32 bits")
            return np.full(self.shape, value & 0xFFFFFFFF, dtype=np.uint32)
        if _TOKEN_NAME.fullmatch(token):
            rtype, value = self._register(token)
            if not self._accepts(itype, rtype):
                raise PtxError(f"register {token} (.{rtype}) used as .{itype}")
            if value is None:
                raise PtxError(f"register {token} is read before it is written")
            return value
        raise PtxError(f"operand {token!r} is not a register, $k or a literal the interpreter knows")

    def write(self, token: str, itype: str, value: np.ndarray) -> None:
        token = token.strip()
        dollar = _TOKEN_DOLLAR.fullmatch(token)
        if dollar:
            slot = int(dollar.group(1))
            if slot not in self.outputs or not self._accepts(itype, self.output_types[slot]):
                raise PtxError(f"{token} is not an output of type .{itype}")
            self.written[slot] = value.astype(np.uint32)
            return
        if not _TOKEN_NAME.fullmatch(token):
            raise PtxError(f"cannot write to {token!r}")
        entry = self._register(token)
        if not self._accepts(itype, entry[0]):
            raise PtxError(f"register {token} (.{entry[0]}) written as .{itype}")
        entry[1] = value

    # --- statements ----------------------------------------------------------------------------------------
    def declare(self, statement: str) -> None:
        match = re.fullmatch(r"\.reg\s+\.(\w+)\s+(.+)", statement)
        if not match or match.group(1) not in _SIZES:
            raise PtxError(f"unsupported declaration {statement!r}")
        if not self.scopes:
            raise PtxError(f"declaration outside a {{ }} scope: {statement!r}")
        for name in (n.strip() for n in match.group(2).split(",")):
            if not _TOKEN_NAME.fullmatch(name) or name in self.scopes[-1]:
                raise PtxError(f"bad or repeated register name {name!r} in {statement!r}")
            self.scopes[-1][name] = [match.group(1), None]

    def execute(self, statement: str) -> None:
        if statement.startswith("@"):
            raise PtxError(f"guarded instructions are not interpreted: {statement!r}")
        opcode, _, rest = statement.partition(" ")
        parts = opcode.split(".")
        operands = _split_operands(rest)
        handler = _HANDLERS.get(parts[0])
        if handler is None:
            raise PtxError(f"unknown instruction {opcode!r}")
        handler(self, parts[1:], operands, statement)


def _split_operands(text: str) -> list[str]:
    """Comma-separated operands, `{a, b}` kept as one."""
    operands, depth, current = [], 0, ""
    for char in text:
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        if char == "," and depth == 0:
            operands.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        operands.append(current.strip())
    return operands


def _modifiers(mods: list[str], statement: str, *, roundings=(), flags=(), types=()) -> tuple[str | None, set, str]:
    """Split an opcode's modifiers into (rounding, flags, type); anything not allowed raises."""
    rounding, found, kind = None, set(), None
    for mod in mods:
        if mod in roundings and rounding is None:
            rounding = mod
        elif mod in flags and mod not in found:
            found.add(mod)
        elif mod in types and kind is None:
            kind = mod
        else:
            raise PtxError(f"unknown or repeated modifier .{mod} in {statement!r}")
    if kind is None:
        raise PtxError(f"no type among {types} in {statement!r}")
    return rounding, found, kind


def _count(operands: list[str], n: int | tuple, statement: str) -> None:
    if len(operands) not in ((n,) if isinstance(n, int) else n):
        raise PtxError(f"wrong operand count in {statement!r}")


def _float_arith(m: _Machine, mods, operands, statement, op):
    n_in = 3 if op == "fma" else 2
    rounding, flags, kind = _modifiers(
        mods, statement, roundings=_ROUNDINGS, flags=("ftz", "sat"), types=("f32", "f32x2")
    )
    _count(operands, n_in + 1, statement)
    if rounding is None:
        raise PtxError(f"{op}.{kind} needs an explicit rounding modifier (Note [PTX interpreter]): {statement!r}")
    if kind == "f32x2":
        if "sat" in flags:
            raise PtxError(f".sat is not allowed with .f32x2: {statement!r}")
        packed = [m.read(t, "b64") for t in operands[1:]]
        halves = [
            _float_lanes(op, rounding, flags, [(p >> np.uint64(32 * i)).astype(np.uint32) for p in packed])
            for i in (0, 1)
        ]
        m.write(operands[0], "b64", halves[0].astype(np.uint64) | (halves[1].astype(np.uint64) << np.uint64(32)))
        return
    m.write(operands[0], "f32", _float_lanes(op, rounding, flags, [m.read(t, "f32") for t in operands[1:]]))


def _float_lanes(op, rounding, flags, args: list[np.ndarray]) -> np.ndarray:
    if "ftz" in flags:
        args = [_flush(a) for a in args]
    out = _fp32_arith(op, rounding, [_bits_f64(a) for a in args])
    if "ftz" in flags:
        out = _flush(out)
    if "sat" in flags:
        value = _bits_f64(out)
        out = np.where(np.isnan(value) | (value <= 0), np.uint32(0), np.where(value >= 1, np.uint32(0x3F800000), out))
    return out.astype(np.uint32)


def _max_min_handler(m: _Machine, mods, operands, statement, op):
    _, flags, _ = _modifiers(mods, statement, flags=("ftz", "NaN"), types=("f32",))
    _count(operands, (3, 4), statement)
    args = [m.read(t, "f32") for t in operands[1:]]
    if "ftz" in flags:
        args = [_flush(a) for a in args]
    m.write(operands[0], "f32", _max_min(op, "NaN" in flags, args))


def _neg(m: _Machine, mods, operands, statement):
    _, flags, _ = _modifiers(mods, statement, flags=("ftz",), types=("f32",))
    _count(operands, 2, statement)
    a = m.read(operands[1], "f32")
    m.write(operands[0], "f32", (_flush(a) if "ftz" in flags else a) ^ _SIGN)


def _ex2(m: _Machine, mods, operands, statement):
    if not mods or mods[0] != "approx":
        raise PtxError(f"only ex2.approx is interpreted: {statement!r}")
    _, flags, _ = _modifiers(mods[1:], statement, flags=("ftz",), types=("f32",))
    _count(operands, 2, statement)
    a = m.read(operands[1], "f32")
    out = m.ex2(_flush(a) if "ftz" in flags else a)
    m.write(operands[0], "f32", _flush(out) if "ftz" in flags else out)


def _setp(m: _Machine, mods, operands, statement):
    if not mods or mods[0] not in _SETP:
        raise PtxError(f"unknown comparison in {statement!r}")
    _, flags, _ = _modifiers(mods[1:], statement, flags=("ftz",), types=("f32",))
    _count(operands, 3, statement)
    a, b = (m.read(t, "f32") for t in operands[1:])
    if "ftz" in flags:
        a, b = _flush(a), _flush(b)
    m.write(operands[0], "pred", _SETP[mods[0]](_bits_f64(a), _bits_f64(b)))


def _selp(m: _Machine, mods, operands, statement):
    _, _, kind = _modifiers(mods, statement, types=("b32", "s32", "u32", "f32"))
    _count(operands, 4, statement)
    a, b = m.read(operands[1], kind), m.read(operands[2], kind)
    m.write(operands[0], kind, np.where(m.read(operands[3], "pred"), a, b).astype(np.uint32))


_HALF = {"b64": ("b32", np.uint64), "b32": ("b16", np.uint32)}


def _mov(m: _Machine, mods, operands, statement):
    _, _, kind = _modifiers(mods, statement, types=("b16", "b32", "s32", "u32", "f32", "b64"))
    _count(operands, 2, statement)
    dst, src = operands
    if src.startswith("{") or dst.startswith("{"):
        if kind not in _HALF:
            raise PtxError(f"vector operands only with mov.b32 (.b16 halves) or mov.b64 (.b32): {statement!r}")
        half, wide = _HALF[kind]
        shift, mask = wide(_SIZES[half]), wide((1 << _SIZES[half]) - 1)
        if src.startswith("{"):
            lo, hi = _vector(src, statement)
            m.write(dst, kind, m.read(lo, half).astype(wide) | (m.read(hi, half).astype(wide) << shift))
        else:
            lo, hi = _vector(dst, statement)
            value = m.read(src, kind)
            m.write(lo, half, (value & mask).astype(np.uint32))
            m.write(hi, half, (value >> shift).astype(np.uint32))
    else:
        m.write(dst, kind, m.read(src, kind))


def _cvt(m: _Machine, mods, operands, statement):
    if mods != ["rn", "satfinite", "e4m3x2", "f32"]:
        raise PtxError(f"only cvt.rn.satfinite.e4m3x2.f32 is interpreted: {statement!r}")
    _count(operands, 3, statement)
    high, low = (_e4m3_satfinite(m.read(t, "f32")) for t in operands[1:])
    m.write(operands[0], "b16", (high << 8) | low)


def _vector(token: str, statement: str) -> list[str]:
    if not token.endswith("}"):
        raise PtxError(f"bad vector operand {token!r} in {statement!r}")
    elements = [t.strip() for t in token[1:-1].split(",")]
    if len(elements) != 2:
        raise PtxError(f"only 2-element vectors are interpreted: {statement!r}")
    return elements


def _int_arith(m: _Machine, mods, operands, statement, op):
    if op in ("mul", "mad"):
        if not mods or mods[0] != "lo":
            raise PtxError(f"only {op}.lo is interpreted: {statement!r}")
        mods = mods[1:]
    _, _, kind = _modifiers(mods, statement, types=("s32", "u32"))
    n_in = 3 if op == "mad" else 2
    _count(operands, n_in + 1, statement)
    a, b, *c = (m.read(t, kind).astype(np.uint64) for t in operands[1:])
    value = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b, "mad": lambda: a * b + c[0]}[op]()
    m.write(operands[0], kind, (value & 0xFFFFFFFF).astype(np.uint32))


def _logic(m: _Machine, mods, operands, statement, op):
    _, _, kind = _modifiers(mods, statement, types=("b32",))
    if op == "not":
        _count(operands, 2, statement)
        m.write(operands[0], kind, ~m.read(operands[1], kind))
        return
    if op == "lop3":
        _count(operands, 5, statement)
        lut = operands[4]
        if not _TOKEN_INT.fullmatch(lut) or not 0 <= int(lut, 0) <= 255:
            raise PtxError(f"lop3 needs an 8-bit immediate table: {statement!r}")
        a, b, c = (m.read(t, kind) for t in operands[1:4])
        m.write(operands[0], kind, _lop3(a, b, c, int(lut, 0)))
        return
    _count(operands, 3, statement)
    a, b = (m.read(t, kind) for t in operands[1:])
    m.write(operands[0], kind, {"and": a & b, "or": a | b, "xor": a ^ b}[op])


def _shift_handler(m: _Machine, mods, operands, statement, op):
    _, _, kind = _modifiers(mods, statement, types=("b32",) if op == "shl" else ("b32", "u32", "s32"))
    _count(operands, 3, statement)
    m.write(operands[0], kind, _shift(op, kind, m.read(operands[1], kind), m.read(operands[2], "u32")))


def _shf(m: _Machine, mods, operands, statement):
    if len(mods) != 3 or mods[0] not in ("l", "r") or mods[1] not in ("wrap", "clamp") or mods[2] != "b32":
        raise PtxError(f"shf needs .l/.r, .wrap/.clamp and .b32: {statement!r}")
    _count(operands, 4, statement)
    a, b, c = m.read(operands[1], "b32"), m.read(operands[2], "b32"), m.read(operands[3], "u32")
    m.write(operands[0], "b32", _funnel(mods[0], mods[1], a, b, c))


def _prmt_handler(m: _Machine, mods, operands, statement):
    _modifiers(mods, statement, types=("b32",))
    _count(operands, 4, statement)
    a, b, c = (m.read(t, "b32") for t in operands[1:])
    m.write(operands[0], "b32", _prmt(a, b, c))


_HANDLERS = {
    **{op: (lambda op: lambda m, mods, ops, st: _float_or_int(m, mods, ops, st, op))(op) for op in ("add", "sub")},
    "mul": lambda m, mods, ops, st: (_int_arith if mods[:1] == ["lo"] else _float_arith)(m, mods, ops, st, "mul"),
    "fma": lambda m, mods, ops, st: _float_arith(m, mods, ops, st, "fma"),
    "mad": lambda m, mods, ops, st: _int_arith(m, mods, ops, st, "mad"),
    "max": lambda m, mods, ops, st: _max_min_handler(m, mods, ops, st, "max"),
    "min": lambda m, mods, ops, st: _max_min_handler(m, mods, ops, st, "min"),
    **{
        op: (lambda op: lambda m, mods, ops, st: _logic(m, mods, ops, st, op))(op)
        for op in ("and", "or", "xor", "not", "lop3")
    },
    "shl": lambda m, mods, ops, st: _shift_handler(m, mods, ops, st, "shl"),
    "shr": lambda m, mods, ops, st: _shift_handler(m, mods, ops, st, "shr"),
    "neg": _neg,
    "ex2": _ex2,
    "setp": _setp,
    "selp": _selp,
    "mov": _mov,
    "shf": _shf,
    "prmt": _prmt_handler,
    "cvt": _cvt,
}


def _float_or_int(m: _Machine, mods, operands, statement, op):
    """add/sub: fp32 (`.f32`, `.f32x2`) or integer (`.s32`, `.u32`) by the type modifier."""
    if mods and mods[-1] in ("s32", "u32"):
        _int_arith(m, mods, operands, statement, op)
    else:
        _float_arith(m, mods, operands, statement, op)


def run(ptx: str, constraints: str, *inputs, ex2: Ex2Model = Ex2Model()) -> tuple[np.ndarray, ...]:
    """Run one inline-asm fragment on float32 inputs (broadcast together); its outputs in order, float32 for
    `=f` and uint32 for `=r`."""
    machine = _Machine(constraints, list(inputs), ex2)
    for chunk in ptx.split(";"):
        statement = chunk.strip()
        while statement[:1] in ("{", "}"):
            if statement[0] == "{":
                machine.scopes.append({})
            elif not machine.scopes:
                raise PtxError("'}' without a matching '{'")
            else:
                machine.scopes.pop()
            statement = statement[1:].strip()
        statement = " ".join(statement.split())
        if not statement:
            continue
        if statement.startswith(".reg"):
            machine.declare(statement)
        elif statement.startswith("."):
            raise PtxError(f"unsupported directive {statement!r}")
        else:
            machine.execute(statement)
    if machine.scopes:
        raise PtxError("unclosed '{' scope")
    missing = [k for k in machine.outputs if k not in machine.written]
    if missing:
        raise PtxError(f"outputs {['$%d' % k for k in missing]} are never written")
    return tuple(
        machine.written[k].view(np.float32 if machine.output_types[k] == "f32" else np.uint32) for k in machine.outputs
    )
