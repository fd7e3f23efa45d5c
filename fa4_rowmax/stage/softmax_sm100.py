"""Rowmax softmax stage on SM100 (Blackwell): FA4's `SoftmaxSm100` with the modes and beta.

FA4's SM100 softmax already keeps a stale row max within `rescale_threshold` and computes
`x = s * scale_log2 - m * scale_log2 + max_offset` with packed FFMA2 (`scale_subtract_rowmax`); only the
exponential (`apply_exp2_convert`) changes here. Elements are handled in pairs so the round-add of H15 is
one packed FADD2 per pair (`h15_alu_pair`).

Note [NaN rows in the approximate modes on SM100]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
As on SM90 (Note [NaN rows in the approximate modes] in softmax_sm90.py), the H15/PoT clamp (`max` against
a constant) turns a NaN score into a finite weight (0 or 2^-K_max), where stock FA4's `exp2(NaN)` poisons
the row sum and O. On SM100 one thread owns a whole row, and its row max is FA4's tree of 3-input maxima;
the approximate modes take it with `max.NaN` (FMNMX3.NAN, the same instruction count as stock's FMNMX3), so
a NaN score makes the row's running max NaN for good, and a score of +inf (stock: `exp2(inf - inf)` = NaN)
makes it +inf. Unlike SM90, the final normalisation and the LSE are the correction warps' (kernel code):
they scale O by 1 / row_sum, or by 1 when the row sum is 0 or NaN, and write LSE = -inf for such a row. So
the row must reach them as stock's does, with a NaN in P and in the row sum. With a NaN row max every x of
the row is NaN (the bias `max_offset - m * scale_log2` is); with +inf, x is -inf for finite scores and NaN
only where the score is +inf. The weight builders clamp either to a finite weight; instead the first
weight of each tile takes `w + max.NaN(m, 0) * 0` (two instructions per row per tile, `nan_row_weight`):
w unchanged for a finite or fully masked (-inf) max, NaN for a NaN or +inf max. P then carries the NaN
through the PV GEMM into every column of O, the row sum is NaN, and the correction warps give O = NaN and
LSE = -inf, stock's values for a NaN row sum. The rescale factor of such a row, exp2(NaN) or exp2(-inf) = 0,
leaves O NaN either way. NaN in V propagates through the PV GEMM as in stock.
On SM103 (B300) with no score_mod/mask_mod, FA4 takes the row max of an unmasked tile from the TMEM load
itself (`tcgen05.ld.red`, one max per 32 columns). The kernel patch requests it with `.NaN` in the approximate
modes (LDTM.STAT...NAN, no extra instruction) and hands the maxima to `reduce_ldred_row_max`; they and the
running max are combined with `max.NaN` (`update_row_max_precomputed`), so such a tile poisons the row as the
software max does. `exact` keeps stock's NaN-quiet ld.red and combine.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import flash_attn.cute.utils as utils
from cutlass import Float32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op
from flash_attn.cute.softmax import SoftmaxSm100

from fa4_rowmax.stage.softmax_base import (
    RowmaxSoftmaxMixin,
    _asm_f32,
    h15_alu_pair,
    h15_mufu,
    nan_row_weight_asm,
    pot_alu,
    pot_mufu,
)


@dsl_user_op
def fmax_nan(a: Float32, b: Float32, c: Float32 | None = None, *, loc=None, ip=None) -> Float32:
    """`max.NaN` of two or three fp32 values (FMNMX.NAN / FMNMX3.NAN): NaN if any input is NaN."""
    return Float32(
        nvvm.fmax(
            Float32(a).ir_value(loc=loc, ip=ip),
            Float32(b).ir_value(loc=loc, ip=ip),
            c=Float32(c).ir_value(loc=loc, ip=ip) if c is not None else None,
            nan=True,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def nan_row_weight(weight: Float32, row_max: Float32, *, loc=None, ip=None) -> Float32:
    """`weight + max.NaN(row_max, 0) * 0`: NaN for a NaN or +inf row max, else `weight`
    (Note [NaN rows in the approximate modes on SM100])."""
    return _asm_f32(nan_row_weight_asm(), weight, row_max, loc=loc, ip=ip)


@dataclass
class RowmaxSoftmaxSm100(RowmaxSoftmaxMixin, SoftmaxSm100):
    mode: cutlass.Constexpr[str] = "exact"
    beta: cutlass.Constexpr[float | None] = None

    @staticmethod
    def from_stock(softmax: SoftmaxSm100, *, mode: str, beta: float | None, rescale_threshold: float):
        """Take over the row statistics and `max_offset` of the `SoftmaxSm100` the kernel created."""
        return RowmaxSoftmaxSm100(
            *RowmaxSoftmaxMixin.stock_fields(softmax),
            rescale_threshold=rescale_threshold,
            max_offset=softmax.max_offset,
            mode=mode,
            beta=beta,
        )

    @property
    def nan_rows(self) -> bool:
        """Note [NaN rows in the approximate modes on SM100]; `exact` keeps stock's max (exp2 propagates NaN)."""
        return self.mode != "exact"

    @cute.jit
    def _compute_row_max(self, acc_S_row: cute.TensorSSA, init_val: Float32 | None = None) -> Float32:
        """FA4's 3-input max tree (`utils.fmax_reduce`, SM100 branch), NaN-propagating in the approximate modes."""
        if const_expr(not self.nan_rows):
            return SoftmaxSm100._compute_row_max(self, acc_S_row, init_val)
        assert cute.size(acc_S_row.shape) % 8 == 0, "acc_S_row must have a multiple of 8 elements"
        values = cute.make_rmem_tensor(acc_S_row.shape, Float32)
        values.store(acc_S_row)
        first = (
            fmax_nan(init_val, values[0], values[1])
            if const_expr(init_val is not None)
            else fmax_nan(values[0], values[1])
        )
        partial = [first] + [fmax_nan(values[2 * j], values[2 * j + 1]) for j in range(1, 4)]
        for i in cutlass.range_constexpr(8, cute.size(acc_S_row.shape), 8):
            for j in cutlass.range_constexpr(4):
                partial[j] = fmax_nan(partial[j], values[i + 2 * j], values[i + 2 * j + 1])
        return fmax_nan(fmax_nan(partial[0], partial[1]), partial[2], partial[3])

    @cute.jit
    def reduce_ldred_row_max(self, tile_maxima: cute.Tensor) -> Float32:
        """The row max of one S tile from the per-32-column maxima of SM103's `tcgen05.ld.red` (the kernel
        requests `.NaN` there in the approximate modes); stock FA4's NaN-quiet loop in `exact`."""
        if const_expr(not self.nan_rows):
            row_max = Float32(-Float32.inf)
            for i in cutlass.range_constexpr(cute.size(tile_maxima.shape)):
                row_max = cute.arch.fmax(row_max, tile_maxima[i])
            return row_max
        n = cute.size(tile_maxima.shape)
        row_max = tile_maxima[0]
        for i in cutlass.range_constexpr(1, n - 1, 2):
            row_max = fmax_nan(row_max, tile_maxima[i], tile_maxima[i + 1])
        if const_expr(n % 2 == 0):
            row_max = fmax_nan(row_max, tile_maxima[n - 1])
        return row_max

    @cute.jit
    def update_row_max_precomputed(self, hw_row_max: Float32, is_first: int) -> tuple[Float32, Float32]:
        """FA4's combine of the `tcgen05.ld.red` row max with the running one, `max.NaN` in the approximate
        modes so that a NaN row stays NaN across tiles (as `_compute_row_max` with `init_val`)."""
        if const_expr(not self.nan_rows or is_first):
            return SoftmaxSm100.update_row_max_precomputed(self, hw_row_max, is_first)
        return self.update_row_max_from_local(fmax_nan(hw_row_max, self.row_max[0]), is_first)

    @cute.jit
    def weight_pair(
        self, x: Float32, y: Float32, pair: cutlass.Constexpr[int], n_pairs: cutlass.Constexpr[int]
    ) -> tuple[Float32, Float32]:
        off = self.off_mufu(pair, n_pairs)
        if const_expr(self.mode == "rowmax_h15"):
            if const_expr(off):
                return h15_alu_pair(x, y)
            return h15_mufu(x), h15_mufu(y)
        elif const_expr(self.mode == "rowmax_pot"):
            if const_expr(off):
                return pot_alu(x), pot_alu(y)
            return pot_mufu(x), pot_mufu(y)
        else:
            if const_expr(off):
                return utils.ex2_emulation_2(x, y)
            return cute.math.exp2(x, fastmath=True), cute.math.exp2(y, fastmath=True)

    @cute.jit
    def apply_exp2_convert(
        self,
        acc_S_row: cute.Tensor,
        acc_S_row_converted: cute.Tensor,
        ex2_emu_freq: cutlass.Constexpr[int] = 0,
        ex2_emu_res: cutlass.Constexpr[int] = 4,
        ex2_emu_start_frg: cutlass.Constexpr[int] = 0,
    ):
        """Weights in place (fp32, for the row sum) and converted to the P dtype, 32 columns at a time.

        In `exact` mode without `beta` this is FA4's own schedule (the kernel's tuned emulation knobs);
        otherwise `beta` picks the pairs built off the MUFU and the kernel's knobs are not used. In the
        approximate modes the first weight carries the row's NaN (Note [NaN rows in the approximate modes
        on SM100]); `self.row_max` is the max `update_row_max` just set.
        """
        if const_expr(self.mode == "exact" and self.beta is None):
            SoftmaxSm100.apply_exp2_convert(
                self, acc_S_row, acc_S_row_converted, ex2_emu_freq, ex2_emu_res, ex2_emu_start_frg
            )
        else:
            assert cute.size(acc_S_row.shape) % 2 == 0, "acc_S_row must have an even number of elements"
            frg_tile = 32
            frg_cnt = cute.size(acc_S_row) // frg_tile
            assert cute.size(acc_S_row) % frg_tile == 0
            n_pairs = cute.size(acc_S_row) // 2
            acc_S_row_frg = cute.logical_divide(acc_S_row, cute.make_layout(frg_tile))
            acc_S_row_converted_frg = cute.logical_divide(acc_S_row_converted, cute.make_layout(frg_tile))
            for j in cutlass.range_constexpr(frg_cnt):
                for k in cutlass.range_constexpr(0, frg_tile, 2):
                    acc_S_row_frg[k, j], acc_S_row_frg[k + 1, j] = self.weight_pair(
                        acc_S_row_frg[k, j], acc_S_row_frg[k + 1, j], (j * frg_tile + k) // 2, n_pairs
                    )
                if const_expr(self.nan_rows and j == 0):
                    acc_S_row_frg[0, 0] = nan_row_weight(acc_S_row_frg[0, 0], self.row_max[0])
                acc_S_row_converted_frg[None, j].store(
                    acc_S_row_frg[None, j].load().to(acc_S_row_converted.element_type)
                )
