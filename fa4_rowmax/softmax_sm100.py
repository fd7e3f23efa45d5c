"""Rowmax softmax stage on SM100 (Blackwell): FA4's `SoftmaxSm100` with the modes and beta.

FA4's SM100 softmax already keeps a stale row max within `rescale_threshold` and computes
`x = s * scale_log2 - m * scale_log2 + max_offset` with packed FFMA2 (`scale_subtract_rowmax`); only the
exponential (`apply_exp2_convert`) changes here. Elements are handled in pairs so the round-add of H15 is
one packed FADD2 per pair (`h15_alu_pair`).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

import flash_attn.cute.utils as utils
from flash_attn.cute.softmax import SoftmaxSm100

from fa4_rowmax.softmax_base import (
    RowmaxSoftmaxMixin,
    h15_alu_pair,
    h15_mufu,
    pot_alu,
    pot_mufu,
)


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
        otherwise `beta` picks the pairs built off the MUFU and the kernel's knobs are not used.
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
            acc_S_row_converted_frg = cute.logical_divide(
                acc_S_row_converted, cute.make_layout(frg_tile)
            )
            for j in cutlass.range_constexpr(frg_cnt):
                for k in cutlass.range_constexpr(0, frg_tile, 2):
                    acc_S_row_frg[k, j], acc_S_row_frg[k + 1, j] = self.weight_pair(
                        acc_S_row_frg[k, j], acc_S_row_frg[k + 1, j], (j * frg_tile + k) // 2, n_pairs
                    )
                acc_S_row_converted_frg[None, j].store(
                    acc_S_row_frg[None, j].load().to(acc_S_row_converted.element_type)
                )
