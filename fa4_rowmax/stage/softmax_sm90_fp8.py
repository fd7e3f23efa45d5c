"""Softmax stage of the SM90 FP8 forward (`flash_fwd_sm90_fp8.py`): weights, row statistics and the e4m3 P operand.

FA4's SM90 `Softmax` leaves fp32 weights in the S accumulator and the kernel converts them to the 16-bit A
operand. With FP8 operands the stage also owns that conversion (`write_p`), because the e4m3 A-operand
register layout is not the accumulator's (Note [FP8 A operand from the S accumulator]) and because
`rowmax_h15` builds P's bytes without a convert (Note [H15 e4m3 bytes by integer ops]).

Modes:
- `exact`: `P = exp2(y)` on the MUFU, `y = s * scale_log2 + (max_offset - m * scale_log2)`, P to e4m3 by
  `cvt.rn.satfinite.e4m3x2.f32`; the row sum adds the fp32 weights (FA4's SM100 FP8 semantics). With `beta`
  a share of the exponentials is FA4's polynomial on the FMA pipe (Note [beta on the FP8 exact twin]).
  `exp2_deleted=True` is a cost probe only: P = y, the MUFU is gone and the values are wrong.
- `rowmax_h15`: P's bytes from the half-octave index by FFMA, clamp, round-add and a byte permute; the row sum
  adds the very values those bytes encode (scaled by 2^-120, Note [H15 e4m3 bytes by integer ops]).

Note [FP8 max_offset]
~~~~~~~~~~~~~~~~~~~~~
As FA4's SM100 FP8 path (Note [Low Precision Scaling] in flash_fwd_sm100.py): weights carry a factor
2^max_offset, max_offset = 8, so the largest weight is 256 and small weights keep e4m3's precision; the row
sum carries the same factor and the LSE subtracts it. A stale max (rescale_threshold) lets y reach
max_offset + rescale_threshold, and H15 rounds up by up to log2(1.5) - 0.25 octaves: the host refuses
settings where that passes log2(448) (`config.check_p_range`, from `interface.SoftmaxStage.for_kernel`).

Note [beta on the FP8 exact twin]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The exact twin spends one MUFU.EX2 per element, the FP8 tensor rate at head dim 128 (docs/fp8_sm90.md,
"Budget"). With `beta` the elements the mixin's `off_mufu` picks (Note [beta selects instructions],
softmax_base.py: floor(n beta) of each row's n = tile_n / 4 elements per thread, spread evenly) take FA4's
`utils.ex2_emulation(y)` instead: clamp at -127, floor by `add.rm` of 1.5 * 2^23, the fraction f in [0, 1)
(exact), the degree-3 `POLY_EX2` by three FFMA, and floor(y) added into the exponent bits by integer ops. Its
domain holds here: y <= max_offset + rescale_threshold < 8.81 (the range rule, Note [FP8 max_offset]) is far
below its assumed 127; y = -inf (masked keys) clamps to -127 and comes out +0 bit for bit (fraction 0, the
exponent field wraps to 0); -127 < y < -126 gives a subnormal within 2^-126 of 2^y (e4m3 0 on both paths).
Its relative error (8.8e-5, Note [exp2 emulation error], gates/tolerances.py) is not MUFU
ex2.approx's 2^-22, so the e4m3 rounding of an element within that of a rounding midpoint can flip, and the
FADD row sum adds the emulated fp32 weights.
NaN: the emulation's clamp is a NaN-quiet max, so a NaN y would become +0 where ex2.approx gives NaN. So with a
beta the exact twin takes the NaN-propagating row max and finalize's NaN-row rule of rowmax_h15 (`nan_rows`,
Note [NaN rows in the approximate modes], softmax_sm90.py; FMNMX.NAN costs what FMNMX costs): a NaN or +inf
score makes the row's max NaN or +inf, so every y of the row is NaN, O is NaN and the LSE -inf, what beta 0
gives through exp2(NaN) in P and the row sum. The host (`interface.SoftmaxStage.for_kernel`) maps beta 0 to None (the
unchanged kernel: same stage, compile key and SASS), accepts only None or 1.0 for rowmax_h15 (its weights
use no MUFU at all), and refuses beta with `exp2_deleted` (the probe computes no exp2 to move).

Note [Descales]
~~~~~~~~~~~~~~~
q_descale * k_descale multiplies the logits, so it joins scale_log2 (as FA4's SM100 FP8 path folds it into
the softmax scale); v_descale multiplies O, so it joins the final 1 / row_sum. Both are per (batch, kv head)
and so per work tile: the kernel loads them once per tile (`set_tile_descale`) into one-element register
tensors that `online_softmax` and `finalize` read.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import flash_attn.cute.utils as utils
from cutlass import Float32, Int32, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute.softmax import Softmax
from quack import layout_utils

from fa4_rowmax.config import FP8_MAX_OFFSET
from fa4_rowmax.stage.softmax_base import (
    H15_ROUND,
    InlineAsm,
    RowmaxSoftmaxMixin,
    Sm90OnlineSoftmaxMixin,
    _asm,
    _f32_hex,
    h15_anchor_addend,
    ptx_fragment,
)

# Note [H15 e4m3 bytes by integer ops]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With n = round_half_even(2y) the H15 weight is 2^floor(n/2) * (1 + (n mod 2)/2), and its e4m3 byte, for a
# normal weight (n >= -12: exponent field floor(n/2) + 7 >= 1, mantissa bit 2 = n mod 2), is 8 (floor(n/2) + 7)
# + 4 (n mod 2) = 4n + 56 = 4L with L = n + 14. The kernel computes t = y + 7 by one FFMA (the 7 joins the
# per-row addend), clamps t at 0 (L >= 0; -inf and NaN scores give 0), and r = t + 1.5 * 2^22 (fp32 ulp 0.5
# there) leaves L = round_half_even(2t) = n + 14 in the low byte of bits(r) (adding 7 commutes with the rounding:
# 14 is even). L <= 63 for every y the range rule allows (y <= 8.47), so packing four low bytes with PRMT and
# shifting the word left by 2 gives four e4m3 bytes 4L without a carry between bytes.
# The same bits give the row sum exactly: bits(r) << 22 = L << 22 (the set bits of bits(1.5 * 2^22) sit at 22
# and above and wrap out), and the fp32 number with bits b << 20 is the e4m3 number with byte b times 2^-120,
# normal or subnormal alike. So fp32(bits(r) << 22) = value(byte 4L) * 2^-120 for every L: the row sum adds
# exactly the P that enters the MMA, scaled by 2^-120, and finalize puts 2^120 back into 1 / row_sum and the
# LSE. The one place the bytes leave H15 is below e4m3's normals: L = 1 (H = 1.5 * 2^-7, 2^-15 of the largest
# weight) encodes 2^-7 (byte 4), and L = 0 (H <= 2^-7) encodes 0; both the MMA and the row sum see that value.
# The row sum must add fp32 denormals for L = 1 (2^-127 after the scaling), so its adds are `add.rn.f32`
# without `.ftz`.
H15_FP8_T_SHIFT = 7.0
H15_FP8_SUM_LOG2_SCALE = -120

# Note [Clamp by saturation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# clamp="sat" (exact anchor) drops the per-element FMNMX: `fma.rn.sat` clamps its result to [0, 1] (NaN to +0)
# for free, so u = sat(s * (scale_log2 / 16) + addend / 16) = clamp(t, 0, 16) / 16. Dividing both operands by
# 16 is exact and commutes with the rounding, so u = fl(t) / 16 bit for bit below the top, and the top (t = 16,
# y = 9) is out of reach (the range rule keeps y < 8.47). Then r = 32 u + 1.5 * 2^23 (fp32 ulp 1 there) rounds
# 2t = 32 u half to even: the same L in the low byte of bits(r) as t + 1.5 * 2^22 gives, and bits(r) << 22 is
# still L << 22 (bits(1.5 * 2^23) has no set bit below 22). Two FFMA per element instead of FFMA, FMNMX, FADD,
# with the same values.
H15_ROUND_SAT = 1.5 * 2**23
H15_SAT_SCALE = 1.0 / 16

# Note [Folded H15 on FP8]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The SM90 BF16 fold (Note [Folded H15 with a half-octave anchor], softmax_base.py) carries over: the per-row
# addend b = fl(1.5 * 2^22 - m * scale_log2) + 15 (the + 15 = max_offset + 7 is exact in [2^22, 2^23)) makes
# r = fl(s * scale_log2 + b) the lattice point of y + 7 with the anchor a = 1.5 * 2^22 - fl(1.5 * 2^22 -
# m * scale_log2) (the half octave nearest m * scale_log2), in one FFMA; the clamp moves onto r (at
# 1.5 * 2^22, L = 0). The reference is SoftmaxConfig(anchor_rounding="half_octave"): rescale exp2(a_old -
# a_new), LSE from a. Per element one FADD less than the exact-anchor H15.


_H15_ROUND_HEX = _f32_hex(H15_ROUND)
_H15_ROUND_SAT_HEX = _f32_hex(H15_ROUND_SAT)


@ptx_fragment
def h15_fp8_lattice_asm() -> InlineAsm:
    """r = max($1 * $2 + $3, 0) + 1.5 * 2^22 (Note [H15 e4m3 bytes by integer ops])."""
    return InlineAsm(
        "{\n\t.reg .f32 t;\n\t"
        "fma.rn.f32 t, $1, $2, $3;\n\t"
        "max.f32 t, t, 0f00000000;\n\t"
        f"add.rn.f32 $0, t, {_H15_ROUND_HEX};\n\t}}\n",
        "=f,f,f,f",
    )


@dsl_user_op
def h15_fp8_lattice(s: Float32, scale_log2: Float32, addend: Float32, *, loc=None, ip=None) -> Float32:
    """r = max(s * scale_log2 + addend, 0) + 1.5 * 2^22: bits(r)'s low byte is L (Note [H15 e4m3 bytes by integer
    ops])."""
    args = [Float32(a) for a in (s, scale_log2, addend)]
    return Float32(_asm(h15_fp8_lattice_asm(), T.f32(), *args, loc=loc, ip=ip))


@ptx_fragment
def h15_fp8_sat_lattice_asm() -> InlineAsm:
    """r = 32 sat($1 * $2 + $3) + 1.5 * 2^23 with $2 = scale_log2 / 16, $3 = addend / 16 (Note [Clamp by
    saturation])."""
    return InlineAsm(
        "{\n\t.reg .f32 u;\n\t"
        "fma.rn.sat.f32 u, $1, $2, $3;\n\t"
        f"fma.rn.f32 $0, u, 0f42000000, {_H15_ROUND_SAT_HEX};\n\t}}\n",
        "=f,f,f,f",
    )


@dsl_user_op
def h15_fp8_sat_lattice(s: Float32, scale_log2_16: Float32, addend_16: Float32, *, loc=None, ip=None) -> Float32:
    """`h15_fp8_lattice`'s L by two FFMA; the caller passes scale_log2 / 16 and addend / 16 (Note [Clamp by
    saturation])."""
    args = [Float32(a) for a in (s, scale_log2_16, addend_16)]
    return Float32(_asm(h15_fp8_sat_lattice_asm(), T.f32(), *args, loc=loc, ip=ip))


@ptx_fragment
def h15_fp8_folded_lattice_asm() -> InlineAsm:
    """r = max($1 * $2 + $3, 1.5 * 2^22), one rounding onto the lattice (Note [Folded H15 on FP8])."""
    return InlineAsm(
        f"{{\n\t.reg .f32 t;\n\tfma.rn.f32 t, $1, $2, $3;\n\tmax.f32 $0, t, {_H15_ROUND_HEX};\n\t}}\n", "=f,f,f,f"
    )


@dsl_user_op
def h15_fp8_folded_lattice(s: Float32, scale_log2: Float32, addend: Float32, *, loc=None, ip=None) -> Float32:
    """r = max(s * scale_log2 + addend, 1.5 * 2^22), one rounding onto the lattice (Note [Folded H15 on FP8])."""
    args = [Float32(a) for a in (s, scale_log2, addend)]
    return Float32(_asm(h15_fp8_folded_lattice_asm(), T.f32(), *args, loc=loc, ip=ip))


@ptx_fragment
def h15_fp8_sum_add_asm() -> InlineAsm:
    """$1 + fp32(bits($2) << 22), denormals kept (Note [H15 e4m3 bytes by integer ops])."""
    return InlineAsm("{\n\t.reg .b32 b;\n\tshl.b32 b, $2, 22;\n\tadd.rn.f32 $0, $1, b;\n\t}\n", "=f,f,f")


@dsl_user_op
def h15_fp8_sum_add(acc: Float32, r: Float32, *, loc=None, ip=None) -> Float32:
    """acc + fp32(bits(r) << 22), denormals kept (Note [H15 e4m3 bytes by integer ops])."""
    return Float32(_asm(h15_fp8_sum_add_asm(), T.f32(), Float32(acc), Float32(r), loc=loc, ip=ip))


@ptx_fragment
def add_keep_denormals_asm() -> InlineAsm:
    """$1 + $2 without .ftz."""
    return InlineAsm("add.rn.f32 $0, $1, $2;", "=f,f,f")


@dsl_user_op
def add_keep_denormals(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(add_keep_denormals_asm(), T.f32(), Float32(a), Float32(b), loc=loc, ip=ip))


@ptx_fragment
def pack_e4m3_cvt_asm() -> InlineAsm:
    """Four fp32 ($1..$4) to four e4m3 bytes ($1 in the low byte), saturating, round to nearest even."""
    return InlineAsm(
        "{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n\t"
        "mov.b32 $0, {lo, hi};\n\t}\n",
        "=r,f,f,f,f",
    )


@dsl_user_op
def pack_e4m3_cvt(x0: Float32, x1: Float32, x2: Float32, x3: Float32, *, loc=None, ip=None) -> Int32:
    """Four fp32 weights to four e4m3 bytes (x0 in the low byte), saturating, round to nearest even."""
    args = [Float32(a) for a in (x0, x1, x2, x3)]
    return Int32(_asm(pack_e4m3_cvt_asm(), T.i32(), *args, loc=loc, ip=ip))


@ptx_fragment
def pack_h15_bytes_asm() -> InlineAsm:
    """e4m3 bytes 4L from four lattice points ($1 in the low byte) (Note [H15 e4m3 bytes by integer ops])."""
    return InlineAsm(
        "{\n\t.reg .b32 t0, t1, w;\n\t"
        "prmt.b32 t0, $1, $2, 0x0040;\n\t"
        "prmt.b32 t1, $3, $4, 0x0040;\n\t"
        "prmt.b32 w, t0, t1, 0x5410;\n\t"
        "shl.b32 $0, w, 2;\n\t}\n",
        "=r,f,f,f,f",
    )


@dsl_user_op
def pack_h15_bytes(r0: Float32, r1: Float32, r2: Float32, r3: Float32, *, loc=None, ip=None) -> Int32:
    """e4m3 bytes 4L from four lattice points (r0 in the low byte): 3 PRMT + 1 SHL (Note [H15 e4m3 bytes by integer
    ops])."""
    args = [Float32(a) for a in (r0, r1, r2, r3)]
    return Int32(_asm(pack_h15_bytes_asm(), T.i32(), *args, loc=loc, ip=ip))


# Note [Row sum by the MMA]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# With row_sum="mma" the V^T pre-pass appends ROW_SUM_COLUMNS rows to V^T, the first all ones (e4m3 1.0) and
# the rest zeros, so the PV GEMM (N = head_dim + 8) leaves in O's column head_dim the sum of exactly the
# e4m3 P that entered it, rescaled with O on every tile (no separate row-sum update). The softmax then adds
# nothing per element (one FADD less, and in rowmax_h15 also the shift that builds the fp32 weight), at
# 8 / head_dim more PV tensor work. That column sits in the accumulator of the quad's lane 0 at local column
# 2 * (head_dim // 8) (columns 8j + 2t + c live at local index c + 2j), the other lanes hold zero columns
# there, so finalize's quad sum of that local column is the row sum. The sum carries max_offset's 2^8 (no
# 2^-120: it adds P's values, not fp32 bits) and the FP8 MMA's accumulation.
ROW_SUM_COLUMNS = 8

# Note [Two-level P.V accumulation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Hopper's e4m3 wgmma accumulates in about 13 fraction bits and truncates (Note [Hopper FP8 accumulation],
# gates/tolerances.py). FA4's loop passes the running O as the PV GEMM's C operand, so every tile's P.V is added
# into O at that precision: once O is large (long rows, V of nonzero mean, diffuse attention) each tile loses its
# low bits against O, and O's error grows with the key count (2 % at 2K keys, 76 % at 128K on the H200 with
# V ~ N(1, 1): docs/fp8_sm90.md). With pv_accumulation="two_level" each tile's P.V goes into a fresh accumulator
# (scale-d 0 on its first k32 step, so the truncation acts on one tile's sum of tile_n products) and is promoted
# into the fp32 O on the CUDA cores by one FFMA per element, O = O * c + acc (`promote_O`). The kernel keeps O one
# tile behind: O holds the tiles before the one in flight relative to *their* max, and c is the factor from that
# max to the tile's (FA4's rescale_O_before_gemm bookkeeping: the factor waits in `scores_scale` for the next
# promotion), so the FFMA replaces the rescale FMUL and the rescale is never skipped (rescale_vote does not
# apply). With row_sum="mma" the row-sum column is promoted the same way, so the row sum is an fp32 sum of
# per-tile sums. The price is registers: a second accumulator of O's size lives from the PV GEMM's issue to its
# promotion, beside S of the next tile.


@ptx_fragment
def promote_o_asm() -> InlineAsm:
    """$1 * $2 + $3 rounded once (Note [Two-level P.V accumulation])."""
    return InlineAsm("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f")


@dsl_user_op
def promote_o(o: Float32, scale: Float32, acc: Float32, *, loc=None, ip=None) -> Float32:
    """o * scale + acc by one FFMA (Note [Two-level P.V accumulation])."""
    args = [Float32(a) for a in (o, scale, acc)]
    return Float32(_asm(promote_o_asm(), T.f32(), *args, loc=loc, ip=ip))


# Note [Warp-vote rescale skip on FP8]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# As on SM90 BF16 (Note [Warp-vote rescale skip], softmax_sm90.py): with rescale_vote=True a warp skips its
# O multiplies when no row of the warp changed its factor (vote.any on factor != 1.0); the values are those
# without the vote (x * 1.0 is exact).


# Note [FP8 A operand from the S accumulator]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The SM90 wgmma accumulator gives thread (row group g, quad lane t) of each 8-column chunk j the columns
# 8j + 2t + {0, 1} of rows g and g + 8 (fragment index c + 2 * row_half + 4 * j). The e4m3 A operand of one
# k32 block gives the same thread bytes 4t + {0..3} and 16 + 4t + {0..3} of rows g and g + 8 (register
# index byte + 4 * row_half + 8 * k_half). So one register of A can hold chunk 2h's two columns followed by
# chunk 2h + 1's two columns of one row, with no data crossing threads, if key position p = 4t + i of each
# 16-key group is key [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15][p] of that group. The V^T
# pre-pass (`v_transpose.py`) stores V's keys in that order (SageAttention2's layout), so P @ V pairs each
# weight with its own key. Word (row_half, k_half, k_block) of the operand packs accumulator entries
# (j, row_half, 0), (j, row_half, 1), (j + 1, row_half, 0), (j + 1, row_half, 1) with j = 4 k_block + 2 k_half.
KEY_ORDER_IN_16 = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)


@dataclass
class Fp8SoftmaxSm90(Sm90OnlineSoftmaxMixin, Softmax):
    mode: cutlass.Constexpr[str] = "exact"
    rescale_threshold: cutlass.Constexpr[float] = 0.0
    beta: cutlass.Constexpr[float | None] = None
    exp2_deleted: cutlass.Constexpr[bool] = False
    has_descale: cutlass.Constexpr[bool] = False
    anchor_rounding: cutlass.Constexpr[str] = "exact"
    row_sum_by_mma: cutlass.Constexpr[bool] = False
    rescale_vote: cutlass.Constexpr[bool] = False
    clamp: cutlass.Constexpr[str] = "max"
    tile_scale_log2: cute.Tensor = None
    tile_v_descale: cute.Tensor = None

    @staticmethod
    def from_stock(softmax: Softmax, stage):
        """Take over the row statistics of the `Softmax` the kernel created, with the knobs of the resolved `stage`
        (interface.SoftmaxStage). FA4's `Softmax.row_sum` is the row-sum tensor, so the `row_sum` knob is held as
        `row_sum_by_mma`."""
        return Fp8SoftmaxSm90(
            *RowmaxSoftmaxMixin.stock_fields(softmax),
            **Fp8SoftmaxSm90.stage_knobs(stage),
            row_sum_by_mma=stage.row_sum == "mma",
            tile_scale_log2=cute.make_rmem_tensor(1, Float32),
            tile_v_descale=cute.make_rmem_tensor(1, Float32),
        )

    @property
    def nan_rows(self) -> bool:
        """NaN-propagating row max and NaN rows: rowmax_h15, and exact with a beta
        (Note [beta on the FP8 exact twin])."""
        return self.mode == "rowmax_h15" or self.beta is not None

    @cute.jit
    def set_tile_descale(self, qk_descale: Float32, v_descale: Float32) -> None:
        """Note [Descales]: the logit and output factors of this work tile's (batch, kv head)."""
        self.tile_scale_log2[0] = self.scale_log2 * qk_descale
        self.tile_v_descale[0] = v_descale

    def current_scale_log2(self) -> Float32:
        return self.tile_scale_log2[0] if const_expr(self.has_descale) else self.scale_log2

    @cute.jit
    def row_weights(
        self,
        acc_S_mn: cute.Tensor,
        r,
        row_max_safe: Float32,
        row_scale: cute.Tensor,
        scale_log2: Float32,
        is_first: cutlass.Constexpr[bool],
    ) -> None:
        """Row r's weights (exact) or lattice points (rowmax_h15) in acc_S_mn (Sm90OnlineSoftmaxMixin), and its row
        sum unless the MMA sums it."""
        n_cols = cute.size(acc_S_mn, mode=[1])
        row_sum = self.row_sum
        if const_expr(self.mode == "rowmax_h15"):
            if const_expr(self.folded):
                addend = h15_anchor_addend(row_max_safe, scale_log2) + Float32(FP8_MAX_OFFSET + H15_FP8_T_SHIFT)
            else:
                addend = Float32(FP8_MAX_OFFSET + H15_FP8_T_SHIFT) - row_max_safe * scale_log2
            if const_expr(self.clamp == "sat"):
                # Note [Clamp by saturation]: both operands / 16 (exact).
                addend = addend * H15_SAT_SCALE
                scale_log2_16 = scale_log2 * H15_SAT_SCALE
            partial = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
            for c in cutlass.range_constexpr(n_cols):
                if const_expr(self.folded):
                    lattice = h15_fp8_folded_lattice(acc_S_mn[r, c], scale_log2, addend)
                elif const_expr(self.clamp == "sat"):
                    lattice = h15_fp8_sat_lattice(acc_S_mn[r, c], scale_log2_16, addend)
                else:
                    lattice = h15_fp8_lattice(acc_S_mn[r, c], scale_log2, addend)
                acc_S_mn[r, c] = lattice
                if const_expr(not self.row_sum_by_mma):
                    partial[c % 4] = h15_fp8_sum_add(partial[c % 4], lattice)
            if const_expr(not self.row_sum_by_mma):
                tile_sum = add_keep_denormals(
                    add_keep_denormals(partial[0], partial[1]), add_keep_denormals(partial[2], partial[3])
                )
                if const_expr(is_first):
                    row_sum[r] = tile_sum
                else:
                    row_sum[r] = add_keep_denormals(row_sum[r] * row_scale[r], tile_sum)
        else:
            bias = Float32(FP8_MAX_OFFSET) - row_max_safe * scale_log2
            for c in cutlass.range_constexpr(n_cols):
                y = acc_S_mn[r, c] * scale_log2 + bias
                if const_expr(self.exp2_deleted):
                    acc_S_mn[r, c] = y
                elif const_expr(self.off_mufu(c, n_cols)):
                    acc_S_mn[r, c] = utils.ex2_emulation(y)  # Note [beta on the FP8 exact twin]
                else:
                    acc_S_mn[r, c] = cute.math.exp2(y, fastmath=True)
            if const_expr(not self.row_sum_by_mma):
                row_sum[r] = utils.fadd_reduce(
                    acc_S_mn[r, None].load(),
                    init_val=row_sum[r] * row_scale[r] if const_expr(not is_first) else None,
                    arch=self.arch,
                )

    @cute.jit
    def write_p(self, acc_S: cute.Tensor, tOrP: cute.Tensor) -> None:
        """Pack the weights in acc_S into the e4m3 A operand tOrP (Note [FP8 A operand from the S accumulator])."""
        # acc_S per thread: ((2 columns, 2 row halves, n/8 chunks), 1, 1); tOrP words: ((1, 2 row halves,
        # 2 k halves), 1, n/32 k blocks).
        assert cute.size(acc_S, mode=[1]) == 1 and cute.size(acc_S, mode=[2]) == 1
        p_words = cute.recast_tensor(tOrP, Int32)
        n_kblocks = cute.size(p_words, mode=[2])
        assert cute.size(p_words) == 4 * n_kblocks
        assert cute.size(acc_S) == 16 * n_kblocks
        for kb in cutlass.range_constexpr(n_kblocks):
            for k_half in cutlass.range_constexpr(2):
                for row_half in cutlass.range_constexpr(2):
                    j = 4 * kb + 2 * k_half
                    i0 = 2 * row_half + 4 * j
                    i1 = 2 * row_half + 4 * (j + 1)
                    vals = (acc_S[i0], acc_S[i0 + 1], acc_S[i1], acc_S[i1 + 1])
                    if const_expr(self.mode == "rowmax_h15"):
                        word = pack_h15_bytes(*vals)
                    else:
                        word = pack_e4m3_cvt(*vals)
                    p_words[row_half + 2 * k_half + 4 * kb] = word

    @cute.jit
    def promote_O(self, acc_O: cute.Tensor, acc_PV: cute.Tensor, row_scale: cute.Tensor) -> None:
        """acc_O = acc_O * row_scale + acc_PV per element, one FFMA each (Note [Two-level P.V accumulation])."""
        acc_O_mn = layout_utils.reshape_acc_to_mn(acc_O)
        acc_PV_mn = layout_utils.reshape_acc_to_mn(acc_PV)
        assert cute.size(row_scale) == cute.size(acc_O_mn, mode=[0])
        for r in cutlass.range(cute.size(row_scale), unroll_full=True):
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = promote_o(acc_O_mn[r, c], row_scale[r], acc_PV_mn[r, c])

    @cute.jit
    def row_sum_from_acc_O(self, acc_O: cute.Tensor) -> None:
        """Note [Row sum by the MMA]: this lane's share of each row sum, after the last PV GEMM (finalize adds
        the quad). The ROW_SUM_COLUMNS = 8 extra columns are the last local pair, 2 * (head_dim // 8) and its
        neighbour."""
        acc_O_mn = layout_utils.reshape_acc_to_mn(acc_O)
        sum_col = cute.size(acc_O_mn, mode=[1]) - 2
        for r in cutlass.range(cute.size(self.row_sum), unroll_full=True):
            self.row_sum[r] = acc_O_mn[r, sum_col]

    @cute.jit
    def finalize(self, final_scale: Float32 = 1.0, sink_val: Float32 | cute.Tensor | None = None) -> cute.Tensor:
        """1 / row_sum (with v_descale, and 2^120 for rowmax_h15) and the LSE; row_sum becomes the LSE
        (`Sm90OnlineSoftmaxMixin.finalize_rows`).

        Rows whose sum is 0 or NaN get LSE -inf and factor 1 (stock); with `nan_rows` (rowmax_h15, exact with a
        beta) a NaN or +inf row max (NaN or +inf score) makes the factor NaN, so O is NaN there as in exact
        (Note [NaN rows in the approximate modes], softmax_sm90.py; Note [beta on the FP8 exact twin]).
        """
        assert sink_val is None, "learnable sinks are not supported on the SM90 FP8 path"
        return self.finalize_rows(final_scale, sink_val)

    @property
    def sum_log2_scale(self) -> int:
        """The row sum's scaling (log2): 2^-120 when it adds H15's fp32 bits (Note [H15 e4m3 bytes by integer ops])."""
        return H15_FP8_SUM_LOG2_SCALE if self.mode == "rowmax_h15" and not self.row_sum_by_mma else 0

    def finalize_out_scale(self, final_scale: Float32) -> Float32:
        """final_scale, the row sum's scaling put back and v_descale (Note [Descales])."""
        out_scale = final_scale * Float32(2.0**self.sum_log2_scale)
        if const_expr(self.has_descale):
            out_scale = out_scale * self.tile_v_descale[0]
        return out_scale

    def lse_log2_offset(self) -> int:
        """max_offset's 2^8 (Note [FP8 max_offset]) and the row sum's scaling come off the LSE."""
        return FP8_MAX_OFFSET + self.sum_log2_scale
