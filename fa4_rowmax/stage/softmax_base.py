"""Rowmax softmax stage for FlashAttention-4: the arithmetic both architectures share.

FA4 computes `P = exp2(x)` with `x = s * scale_log2 - m * scale_log2 (+ max_offset)` and `m` the running
row max. This module holds the per-element replacements for `exp2` and the mixin that picks, element by
element, which instruction sequence builds the weight:

- `exact`: `exp2(x)` on the MUFU, or FA4's cubic polynomial emulation on the FMA/ALU pipes.
- `rowmax_h15`: `H(x) = S(Q_half(x))` (docs/design.md, shared/notes/rowmax_h15.md), built from fp32 bits
  on the ALU pipes, or through the MUFU followed by a snap to the lattice. Both give the same value.
- `rowmax_pot`: `2 ** -min(K_max, round_half_even(-x))`, bits built on the ALU, or `exp2` of the rounded
  integer on the MUFU.

`beta` is the share of elements built off the MUFU. In the lattice modes it selects instructions, never values;
in `exact` it moves them by the polynomial's error (Note [beta selects instructions]). The arch subclasses live
in `softmax_sm90.py` and `softmax_sm100.py`.
"""

import dataclasses
import math
import operator
from fractions import Fraction
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import flash_attn.cute.utils as utils
from cutlass import Float32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute.softmax import Softmax
from quack import layout_utils

# Note [H15 in fp32 bits]
# In [2^22, 2^23) the fp32 ulp is 0.5, so `r = x + 1.5 * 2^22` (round to nearest even) rounds x to the
# nearest half and leaves n = round_half_even(2x) in the low mantissa bits: bits(r) = bits(1.5 * 2^22) + n.
# Shifting left by 22 drops bits(1.5 * 2^22) (its set bits all sit at 22 and above, so they wrap out) and
# puts n into the exponent field at the half-octave position: bits(H) = (n << 22) + bits(1.0)
# = (n + 254) << 22 (mod 2^32), i.e. exponent floor(n / 2) and mantissa 0 or 0.5 for n even or odd, which is
# S(n / 2) = 2^floor(n/2) * (1 + (n mod 2) / 2). Clamping x at -127 first keeps n >= -254, so the
# smallest weight is +0 (n = -254) and masked scores (-inf) become 0. The same trick one octave coarser
# (`1.5 * 2^23`, ulp 1, shift 23) gives Rowmax-PoT's powers of two.
H15_ROUND = 1.5 * 2**22
H15_CLAMP = -127.0
POT_ROUND = 1.5 * 2**23
POT_K_MAX = 20
FP32_ONE_BITS = 0x3F800000

# Note [H15 through the MUFU]
# `ex2.approx.ftz` of q = Q_half(x) returns 2^k or sqrt(2) * 2^k within a couple of ulps. Adding 2^21
# (a quarter of the mantissa range) to the bits and clearing the low 22 bits snaps both to the lattice:
# 1.4142.. * 2^k -> 1.5 * 2^k, and 2^k (or its value one ulp below, 0x..7FFFFF of the octave under it,
# which carries into the exponent) -> 2^k. So the MUFU path returns the same bits as the ALU path, except
# that `ftz` flushes the one denormal level q = -126.5 (ALU bits 0x00400000, weight 2^-127) to 0; that
# weight is 2^-127 of the row max and cannot change an output.
H15_SNAP_ADD = 1 << 21
H15_SNAP_MASK = 0xFFC00000

# Note [Folded H15 with a half-octave anchor]
# The straightforward H15 spends an FFMA (x = s * scale_log2 - m * scale_log2), a clamp and a round-add per
# element. Folding the round-add constant into the FFMA's addend, r = s * scale_log2 + (1.5 * 2^22 - a),
# needs the addend to be exact: in [2^22, 2^23) the fp32 ulp is 0.5, so the per-row addend
# b = fl(1.5 * 2^22 - m * scale_log2) (one FFMA per row) rounds the anchor to a = 1.5 * 2^22 - b, the
# nearest half octave of m * scale_log2 (ties to even; exact while |m * scale_log2| < 2^21, beyond it a is
# what the fp32 addend holds, and the reference computes the same expression). The per-element FFMA then
# rounds once to the half-octave lattice: r = 1.5 * 2^22 + round_half_even(2 (s * scale_log2 - a)) / 2, the
# clamp moves onto r (at 1.5 * 2^22 - 127, exact) and the shift-add is unchanged: 3 issues instead of 4.
# The lattice now sits on the absolute half-octave grid, within 1/4 octave of the row max (the max element
# still rounds to weight 1; the others may round across a lattice point); the normaliser, the rescale factors
# exp2(a_old - a_new) and the LSE use the same a, so this changes values only through that phase
# (SoftmaxConfig.anchor_rounding="half_octave" in the reference).
H15_FOLD_CLAMP = H15_ROUND + H15_CLAMP

# Note [beta selects instructions]
# beta in [0, 1] is the share of a thread's elements (SM100: element pairs) whose weight is built off the
# MUFU. Element i of n goes off the MUFU when floor((i + 1) * beta) > floor(i * beta), which spreads
# floor(n * beta) elements evenly along the row so the MUFU and the FMA/ALU pipes drain in parallel.
# In `rowmax_h15` and `rowmax_pot` both paths give the same weight; in `exact` the off-MUFU path is FA4's
# polynomial, which differs from exp2 by up to 8.8e-5 relative (Note [exp2 emulation error] in
# gates/tolerances.py), under BF16 P's half ulp; the kernel bounds charge it (Note [Kernel vs reference: the exp2
# emulation]).


def _f32_hex(value: float) -> str:
    """PTX fp32 immediate (0fXXXXXXXX) for a Python float."""
    import struct

    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def off_mufu(index: int, count: int, beta: float) -> bool:
    """Whether element `index` of `count` is built off the MUFU for share `beta` (trace time)."""
    share = Fraction(beta).limit_denominator(1 << 16)
    return math.floor((index + 1) * share) > math.floor(index * share)


# Note [PTX fragments are data]
# Every inline PTX string of the stages comes from a pure builder marked `@ptx_fragment` that returns an
# `InlineAsm` (the text and its constraint string); the `dsl_user_op` wrappers only bind operands to it. So
# the strings the kernels emit can be run without cutlass tracing: tests/test_ptx_fragments.py finds every
# marked builder in fa4_rowmax/stage/, executes it through fa4_rowmax/testing/ptx_interp.py against the
# closed-form reference, and fails on a builder it has no check for, or on an `inline_asm` call whose text
# does not come from a builder.
class InlineAsm(NamedTuple):
    """One inline-PTX fragment as `llvm.inline_asm` takes it: outputs `=f` then inputs `f`, numbered $0, $1, ..."""

    ptx: str
    constraints: str


def ptx_fragment(builder):
    """Mark a pure builder of one inline-PTX fragment; the tests find it by this mark (Note [PTX fragments are
    data])."""
    return builder


def _asm(asm: InlineAsm, result_type, *args, loc=None, ip=None):
    """The inline-PTX op of one fragment: `args` are DSL values (Float32, Int32), `result_type` an MLIR type."""
    return llvm.inline_asm(
        result_type,
        [a.ir_value(loc=loc, ip=ip) for a in args],
        asm.ptx,
        asm.constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _asm_f32(asm: InlineAsm, *args: Float32, loc=None, ip=None) -> Float32:
    return Float32(_asm(asm, T.f32(), *(Float32(a) for a in args), loc=loc, ip=ip))


_H15_ROUND_HEX = _f32_hex(H15_ROUND)
_H15_CLAMP_HEX = _f32_hex(H15_CLAMP)
_POT_ROUND_HEX = _f32_hex(POT_ROUND)
_POT_CLAMP_HEX = _f32_hex(-float(POT_K_MAX))
_NEG_INF_HEX = "0fFF800000"
_H15_FOLD_CLAMP_HEX = _f32_hex(H15_FOLD_CLAMP)

# The single-element H15 ops are one front end, which leaves the lattice point r = 1.5 * 2^22 + Q_half(x)
# in register t, followed by one back end that turns r into the weight's bits.
_REGS_T_B = "{\n\t.reg .f32 t;\n\t.reg .b32 b;\n\t"
# Front ends: clamp then round-add on x = $1 (Note [H15 in fp32 bits]), or the folded FFMA
# $1 * $2 + $3 = s * scale_log2 + addend, then the clamp moved onto r
# (Note [Folded H15 with a half-octave anchor]).
_H15_CLAMP_ROUND = f"max.ftz.f32 t, $1, {_H15_CLAMP_HEX};\n\tadd.rn.ftz.f32 t, t, {_H15_ROUND_HEX};\n\t"
_H15_FOLD_CLAMP = f"fma.rn.ftz.f32 t, $1, $2, $3;\n\tmax.ftz.f32 t, t, {_H15_FOLD_CLAMP_HEX};\n\t"
# Back ends: shift-add on the ALU (Note [H15 in fp32 bits]), or ex2.approx of Q_half(x) = r - 1.5 * 2^22
# snapped to the lattice (Note [H15 through the MUFU]).
_H15_SHIFT_ADD = (
    "mov.b32 b, t;\n\t"
    "shl.b32 b, b, 22;\n\t"
    # add.s32 lowers to LEA (ALU pipe) together with the shift; see flash_attn.cute.utils.
    f"add.s32 b, b, {FP32_ONE_BITS};\n\t"
    "mov.b32 $0, b;\n\t}\n"
)
_H15_MUFU_SNAP = (
    f"sub.rn.ftz.f32 t, t, {_H15_ROUND_HEX};\n\t"
    "ex2.approx.ftz.f32 t, t;\n\t"
    "mov.b32 b, t;\n\t"
    f"add.s32 b, b, {H15_SNAP_ADD};\n\t"
    f"and.b32 b, b, 0x{H15_SNAP_MASK:08X};\n\t"
    "mov.b32 $0, b;\n\t}\n"
)


@ptx_fragment
def h15_alu_asm() -> InlineAsm:
    """H(x) from fp32 bits: clamp, round-add, shift-add (Note [H15 in fp32 bits])."""
    return InlineAsm(_REGS_T_B + _H15_CLAMP_ROUND + _H15_SHIFT_ADD, "=f,f")


@dsl_user_op
def h15_alu(x: Float32, *, loc=None, ip=None) -> Float32:
    """H(x) from fp32 bits: clamp, round-add, shift-add (Note [H15 in fp32 bits])."""
    return _asm_f32(h15_alu_asm(), x, loc=loc, ip=ip)


@ptx_fragment
def h15_alu_pair_asm() -> InlineAsm:
    """H of two elements ($2, $3 -> $0, $1) with one packed round-add (FADD2, SM100 and later)."""
    return InlineAsm(
        "{\n\t.reg .f32 c0, c1, r;\n\t.reg .b64 xy, rr, sum;\n\t.reg .b32 b0, b1;\n\t"
        f"max.ftz.f32 c0, $2, {_H15_CLAMP_HEX};\n\t"
        f"max.ftz.f32 c1, $3, {_H15_CLAMP_HEX};\n\t"
        "mov.b64 xy, {c0, c1};\n\t"
        f"mov.f32 r, {_H15_ROUND_HEX};\n\t"
        "mov.b64 rr, {r, r};\n\t"
        "add.rn.ftz.f32x2 sum, xy, rr;\n\t"
        "mov.b64 {b0, b1}, sum;\n\t"
        "shl.b32 b0, b0, 22;\n\t"
        "shl.b32 b1, b1, 22;\n\t"
        f"add.s32 b0, b0, {FP32_ONE_BITS};\n\t"
        f"add.s32 b1, b1, {FP32_ONE_BITS};\n\t"
        "mov.b32 $0, b0;\n\t"
        "mov.b32 $1, b1;\n\t}\n",
        "=f,=f,f,f",
    )


@dsl_user_op
def h15_alu_pair(x: Float32, y: Float32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """H of two elements with one packed round-add (FADD2, SM100 and later)."""
    asm = h15_alu_pair_asm()
    out = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]),
        [Float32(x).ir_value(loc=loc, ip=ip), Float32(y).ir_value(loc=loc, ip=ip)],
        asm.ptx,
        asm.constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return (
        Float32(llvm.extractvalue(T.f32(), out, [0], loc=loc, ip=ip)),
        Float32(llvm.extractvalue(T.f32(), out, [1], loc=loc, ip=ip)),
    )


@ptx_fragment
def h15_mufu_asm() -> InlineAsm:
    """H(x) through ex2.approx of Q_half(x), snapped to the lattice (Note [H15 through the MUFU])."""
    return InlineAsm(_REGS_T_B + _H15_CLAMP_ROUND + _H15_MUFU_SNAP, "=f,f")


@dsl_user_op
def h15_mufu(x: Float32, *, loc=None, ip=None) -> Float32:
    """H(x) through ex2.approx of Q_half(x), snapped to the lattice (Note [H15 through the MUFU])."""
    return _asm_f32(h15_mufu_asm(), x, loc=loc, ip=ip)


@ptx_fragment
def h15_anchor_addend_asm() -> InlineAsm:
    """fl(1.5 * 2^22 - row_max * scale_log2) of ($1, $2), one FFMA (Note [Folded H15 with a half-octave anchor])."""
    return InlineAsm(
        f"{{\n\t.reg .f32 m;\n\tneg.f32 m, $1;\n\tfma.rn.f32 $0, m, $2, {_H15_ROUND_HEX};\n\t}}\n", "=f,f,f"
    )


@dsl_user_op
def h15_anchor_addend(row_max: Float32, scale_log2: Float32, *, loc=None, ip=None) -> Float32:
    """fl(1.5 * 2^22 - row_max * scale_log2), one FFMA (Note [Folded H15 with a half-octave anchor])."""
    return _asm_f32(h15_anchor_addend_asm(), row_max, scale_log2, loc=loc, ip=ip)


@ptx_fragment
def h15_folded_alu_asm() -> InlineAsm:
    """H(s * scale_log2 - a) of (s, scale_log2, addend) = ($1, $2, $3) (Note [Folded H15 with a half-octave anchor])."""
    return InlineAsm(_REGS_T_B + _H15_FOLD_CLAMP + _H15_SHIFT_ADD, "=f,f,f,f")


@dsl_user_op
def h15_folded_alu(s: Float32, scale_log2: Float32, addend: Float32, *, loc=None, ip=None) -> Float32:
    """H(s * scale_log2 - a): FFMA onto the lattice, clamp, shift-add (Note [Folded H15 with a half-octave anchor])."""
    return _asm_f32(h15_folded_alu_asm(), s, scale_log2, addend, loc=loc, ip=ip)


@ptx_fragment
def h15_folded_mufu_asm() -> InlineAsm:
    """`h15_folded_alu_asm` through ex2.approx of the lattice point, snapped (Note [H15 through the MUFU])."""
    return InlineAsm(_REGS_T_B + _H15_FOLD_CLAMP + _H15_MUFU_SNAP, "=f,f,f,f")


@dsl_user_op
def h15_folded_mufu(s: Float32, scale_log2: Float32, addend: Float32, *, loc=None, ip=None) -> Float32:
    """`h15_folded_alu` through ex2.approx of the lattice point, snapped (Note [H15 through the MUFU])."""
    return _asm_f32(h15_folded_mufu_asm(), s, scale_log2, addend, loc=loc, ip=ip)


@ptx_fragment
def pot_alu_asm() -> InlineAsm:
    """2^max(-K_max, round_half_even(x)) from fp32 bits; masked scores (-inf) stay 0."""
    return InlineAsm(
        "{\n\t.reg .f32 t;\n\t.reg .b32 b;\n\t.reg .pred masked;\n\t"
        f"max.ftz.f32 t, $1, {_POT_CLAMP_HEX};\n\t"
        f"add.rn.ftz.f32 t, t, {_POT_ROUND_HEX};\n\t"
        "mov.b32 b, t;\n\t"
        "shl.b32 b, b, 23;\n\t"
        f"add.s32 b, b, {FP32_ONE_BITS};\n\t"
        f"setp.eq.f32 masked, $1, {_NEG_INF_HEX};\n\t"
        "selp.b32 b, 0, b, masked;\n\t"
        "mov.b32 $0, b;\n\t}\n",
        "=f,f",
    )


@dsl_user_op
def pot_alu(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^max(-K_max, round_half_even(x)) from fp32 bits; masked scores (-inf) stay 0."""
    return _asm_f32(pot_alu_asm(), x, loc=loc, ip=ip)


@ptx_fragment
def pot_mufu_asm() -> InlineAsm:
    """`pot_alu_asm` through ex2.approx of the rounded integer (exact for integers)."""
    return InlineAsm(
        "{\n\t.reg .f32 t;\n\t.reg .pred masked;\n\t"
        f"max.ftz.f32 t, $1, {_POT_CLAMP_HEX};\n\t"
        f"add.rn.ftz.f32 t, t, {_POT_ROUND_HEX};\n\t"
        f"sub.rn.ftz.f32 t, t, {_POT_ROUND_HEX};\n\t"
        "ex2.approx.ftz.f32 t, t;\n\t"
        f"setp.eq.f32 masked, $1, {_NEG_INF_HEX};\n\t"
        "selp.f32 $0, 0f00000000, t, masked;\n\t}\n",
        "=f,f",
    )


@dsl_user_op
def pot_mufu(x: Float32, *, loc=None, ip=None) -> Float32:
    """`pot_alu` through ex2.approx of the rounded integer (exact for integers)."""
    return _asm_f32(pot_mufu_asm(), x, loc=loc, ip=ip)


@ptx_fragment
def nan_row_weight_asm() -> InlineAsm:
    """`$1 + max.NaN($2, 0) * 0` for (weight, row_max): the SM100 stage's `nan_row_weight`
    (Note [NaN rows in the approximate modes on SM100] in softmax_sm100.py)."""
    return InlineAsm(
        "{\n\t.reg .f32 t;\n\tmax.NaN.f32 t, $2, 0f00000000;\n\tfma.rn.f32 $0, t, 0f00000000, $1;\n\t}\n", "=f,f,f"
    )


class RowmaxSoftmaxMixin:
    """What the arch subclasses share: the mode, beta, and the per-element weight builders.

    Subclasses are dataclasses that also derive from FA4's `Softmax` / `SoftmaxSm100` and declare the
    Constexpr fields `mode` (str), `beta` (float or None) and `rescale_threshold` (float).
    """

    STOCK_FIELDS = ("scale_log2", "num_rows", "row_max", "row_sum", "arch", "softmax_scale")

    @staticmethod
    def stock_fields(softmax) -> tuple:
        """The positional fields of FA4's `Softmax` / `SoftmaxSm100` (scale, row statistics, arch), in order;
        `from_stock` passes them on so the subclass takes over the stage the kernel created."""
        return tuple(getattr(softmax, name) for name in RowmaxSoftmaxMixin.STOCK_FIELDS)

    @classmethod
    def stage_knobs(cls, stage) -> dict:
        """The subclass's Constexpr knob fields, each taken from the resolved stage's field of the same name
        (interface.SoftmaxStage, Note [Softmax-stage knobs] in config.py); FA4's own fields stay the stock
        object's (`row_sum` there is the row-sum tensor, not the knob)."""
        names = [f.name for f in dataclasses.fields(cls) if f.name not in RowmaxSoftmaxMixin.STOCK_FIELDS]
        return {name: getattr(stage, name) for name in names if hasattr(stage, name)}

    def off_mufu(self, index: int, count: int) -> bool:
        beta = self.beta if self.beta is not None else (0.0 if self.mode == "exact" else 1.0)
        return off_mufu(index, count, beta)


def _fmax_nan(a: Float32, b: Float32) -> Float32:
    return cute.arch.fmax(a, b, nan=True)


@cute.jit
def quad_row_max(acc_S_row: cute.TensorSSA, init_val, nan_rows: cutlass.Constexpr[bool], arch) -> Float32:
    """A row's max over the thread's elements and its quad (the 4 threads sharing the row), from `init_val`
    (None: none). `nan_rows`: NaN-propagating (Note [NaN rows in the approximate modes], softmax_sm90.py)."""
    if const_expr(nan_rows):
        values = cute.make_rmem_tensor(acc_S_row.shape, Float32)
        values.store(acc_S_row)
        partial = [values[0], values[1], values[2], values[3]]
        for i in cutlass.range_constexpr(4, cute.size(acc_S_row.shape), 4):
            for j in cutlass.range_constexpr(4):
                partial[j] = _fmax_nan(partial[j], values[i + j])
        local = _fmax_nan(_fmax_nan(partial[0], partial[1]), _fmax_nan(partial[2], partial[3]))
        if const_expr(init_val is not None):
            local = _fmax_nan(local, init_val)
        return cute.arch.warp_reduction(local, _fmax_nan, threads_in_group=4)
    local = utils.fmax_reduce(acc_S_row, init_val=init_val, arch=arch)
    return cute.arch.warp_reduction_max(local, threads_in_group=4)


class Sm90OnlineSoftmaxMixin(RowmaxSoftmaxMixin):
    """The SM90 online softmax both SM90 stages run (`RowmaxSoftmaxSm90`, `Fp8SoftmaxSm90`): per row the
    quad-reduced max, the rescale factor (a rounded anchor's with a half-octave anchor, none while a stale max
    stays within `rescale_threshold`), then the stage's own weights and row sum: `row_weights(acc_S_mn, r,
    row_max_safe, row_scale, scale_log2, is_first)` writes row r's weights into acc_S_mn and its sum into
    `row_sum[r]` (rescaled by `row_scale[r]` unless `is_first`).

    Subclasses also declare the Constexpr fields `anchor_rounding` (str) and `rescale_vote` (bool) and define
    `nan_rows`.
    """

    @cute.jit
    def rescale_O(self, acc_O: cute.Tensor, row_scale: cute.Tensor) -> None:
        """Stock rescale, skipped by a warp vote when every factor of the warp is 1.0 (Note [Warp-vote rescale skip],
        softmax_sm90.py; the values are those without the vote: x * 1.0 is exact)."""
        if const_expr(not self.rescale_vote):
            Softmax.rescale_O(self, acc_O, row_scale)
        else:
            changed = row_scale[0] != 1.0
            for r in cutlass.range_constexpr(1, cute.size(row_scale)):
                changed = changed or row_scale[r] != 1.0
            if cute.arch.vote_any_sync(changed):
                Softmax.rescale_O(self, acc_O, row_scale)

    @property
    def folded(self) -> bool:
        return self.mode == "rowmax_h15" and self.anchor_rounding == "half_octave"

    def current_scale_log2(self) -> Float32:
        """The logit scale (log2 units) of this work tile; the FP8 stage folds the descales in."""
        return self.scale_log2

    @cute.jit
    def row_max_of(self, acc_S_row: cute.TensorSSA, init_val) -> Float32:
        """Quad-reduced row max; NaN-propagating with `nan_rows` (a clamp would hide NaN scores)."""
        return quad_row_max(acc_S_row, init_val, self.nan_rows, self.arch)

    @cute.jit
    def online_softmax(
        self,
        acc_S: cute.Tensor,
        is_first: cutlass.Constexpr[bool] = False,
        check_inf: cutlass.Constexpr[bool] = True,
    ) -> cute.Tensor:
        """Replace acc_S by the stage's weights, update row max and sum, return the factor to rescale O by.

        `check_inf` is accepted for the stock signature; a fully masked row (max -inf) is always anchored at 0
        here, so its weights are 0 and never NaN.
        """
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
        row_scale = cute.make_fragment_like(self.row_max, Float32)
        row_max = self.row_max
        scale_log2 = self.current_scale_log2()
        for r in cutlass.range(cute.size(row_max), unroll_full=True):
            row_max_cur = self.row_max_of(acc_S_mn[r, None].load(), row_max[r] if const_expr(not is_first) else None)
            row_max_safe = row_max_cur if row_max_cur != -Float32.inf else 0.0
            if const_expr(is_first):
                row_scale[r] = 1.0
            else:
                row_max_old = row_max[r]
                acc_scale_ = (row_max_old - row_max_safe) * scale_log2
                if const_expr(self.folded):
                    # a_old - a_new of the rounded anchors (exact: both addends are multiples of 0.5).
                    row_scale[r] = cute.math.exp2(
                        h15_anchor_addend(row_max_safe, scale_log2) - h15_anchor_addend(row_max_old, scale_log2),
                        fastmath=True,
                    )
                else:
                    row_scale[r] = cute.math.exp2(acc_scale_, fastmath=True)
                if const_expr(self.rescale_threshold > 0.0):
                    # Stale max within the threshold: keep it and skip the rescale.
                    if acc_scale_ >= -self.rescale_threshold:
                        row_max_cur = row_max_old
                        row_max_safe = row_max_old
                        row_scale[r] = 1.0
            row_max[r] = row_max_cur
            self.row_weights(acc_S_mn, r, row_max_safe, row_scale, scale_log2, is_first)
        return row_scale

    def finalize_out_scale(self, final_scale: Float32) -> Float32:
        """What every row's 1 / row_sum is multiplied by: `final_scale`; the FP8 stage adds its own factors."""
        return final_scale

    def lse_log2_offset(self):
        """What the LSE (log2 units) subtracts: None here; the FP8 stage's weights carry scalings."""
        return None

    def lse_log2(self, anchor: Float32, row_sum: Float32, offset) -> Float32:
        lse = anchor + cute.math.log2(row_sum, fastmath=True)
        return lse if const_expr(offset is None) else lse - Float32(offset)

    @cute.jit
    def finalize_rows(self, final_scale: Float32, sink_val) -> cute.Tensor:
        """FA4's `Softmax.finalize` with the anchor a the weights used (Note [Folded H15 with a half-octave
        anchor]), the stage's scalings (`finalize_out_scale`, `lse_log2_offset`) and, with `nan_rows`, a NaN factor
        for rows whose max is NaN or +inf (Note [NaN rows in the approximate modes], softmax_sm90.py); rows whose
        sum is 0 or NaN get LSE -inf and factor 1 (stock). row_sum becomes the LSE."""
        if const_expr(sink_val is not None and isinstance(sink_val, cute.Tensor)):
            assert cute.size(sink_val) == cute.size(self.row_sum)
        row_sum = self.row_sum
        row_max = self.row_max
        scale_log2 = self.current_scale_log2()
        row_sum.store(utils.warp_reduce(row_sum.load(), operator.add, width=4))
        row_scale = cute.make_fragment_like(row_max, Float32)
        out_scale = self.finalize_out_scale(final_scale)
        lse_offset = self.lse_log2_offset()
        for r in cutlass.range(cute.size(row_sum), unroll_full=True):
            anchor = row_max[r] * scale_log2
            if const_expr(self.folded):
                anchor = Float32(H15_ROUND) - h15_anchor_addend(row_max[r], scale_log2)
            if const_expr(sink_val is not None):
                sink_cur = sink_val if const_expr(not isinstance(sink_val, cute.Tensor)) else sink_val[r]
                if row_max[r] == -Float32.inf:
                    anchor = sink_cur * utils.LOG2_E
                row_sum[r] += cute.math.exp2(sink_cur * utils.LOG2_E - anchor, fastmath=True)
            empty_or_nan = row_sum[r] == 0.0 or row_sum[r] != row_sum[r]
            row_scale[r] = cute.arch.rcp_approx(row_sum[r] if not empty_or_nan else 1.0) * out_scale
            poisoned = False
            if const_expr(self.nan_rows):
                poisoned = row_max[r] != row_max[r] or row_max[r] == Float32.inf
                if poisoned:
                    row_scale[r] = Float32(math.nan)
            row_sum_cur = row_sum[r]
            row_sum[r] = (
                self.lse_log2(anchor, row_sum_cur, lse_offset) * math.log(2.0)
                if not (empty_or_nan or poisoned)
                else -Float32.inf
            )
        return row_scale
