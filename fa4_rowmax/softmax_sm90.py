"""Rowmax softmax stage on SM90 (Hopper): FA4's `Softmax` with the modes, conditional rescale and beta.

Stock FA4 on SM90 always moves the running max and rescales O; here, as on SM100, the stale max is kept
while the new tile max exceeds it by at most `rescale_threshold` (log2 units; 0 keeps stock behaviour) and
weights up to `2**rescale_threshold` appear. Hopper has no packed f32x2 arithmetic, so every element is
handled on its own.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from quack import layout_utils
import flash_attn.cute.utils as utils
from flash_attn.cute.softmax import Softmax

from fa4_rowmax.softmax_base import RowmaxSoftmaxMixin, h15_alu, h15_mufu, pot_alu, pot_mufu


@dataclass
class RowmaxSoftmaxSm90(RowmaxSoftmaxMixin, Softmax):
    rescale_threshold: cutlass.Constexpr[float] = 0.0
    mode: cutlass.Constexpr[str] = "exact"
    beta: cutlass.Constexpr[float | None] = None

    @staticmethod
    def from_stock(softmax: Softmax, *, mode: str, beta: float | None, rescale_threshold: float):
        """Take over the row statistics of the `Softmax` the kernel created."""
        return RowmaxSoftmaxSm90(
            softmax.scale_log2,
            softmax.num_rows,
            softmax.row_max,
            softmax.row_sum,
            softmax.arch,
            softmax.softmax_scale,
            rescale_threshold=rescale_threshold,
            mode=mode,
            beta=beta,
        )

    @cute.jit
    def weight(self, x: Float32, index: cutlass.Constexpr[int], count: cutlass.Constexpr[int]) -> Float32:
        """The softmax weight of one element with `x` = scaled score minus the (stale) row max."""
        off = self.off_mufu(index, count)
        if const_expr(self.mode == "rowmax_h15"):
            return h15_alu(x) if const_expr(off) else h15_mufu(x)
        elif const_expr(self.mode == "rowmax_pot"):
            return pot_alu(x) if const_expr(off) else pot_mufu(x)
        else:
            return utils.ex2_emulation(x) if const_expr(off) else cute.math.exp2(x, fastmath=True)

    @cute.jit
    def online_softmax(
        self,
        acc_S: cute.Tensor,
        is_first: cutlass.Constexpr[bool] = False,
        check_inf: cutlass.Constexpr[bool] = True,
    ) -> cute.Tensor:
        """Replace acc_S by its weights, update row max and sum, return the factor to rescale O by.

        `check_inf` is accepted for the stock signature; a fully masked row (max -inf) is always
        anchored at 0 here, so its weights are 0 and never NaN.
        """
        acc_S_mn = layout_utils.reshape_acc_to_mn(acc_S)
        row_scale = cute.make_fragment_like(self.row_max, Float32)
        row_max = self.row_max
        row_sum = self.row_sum
        scale_log2 = self.scale_log2
        n_cols = cute.size(acc_S_mn, mode=[1])
        for r in cutlass.range(cute.size(row_max), unroll_full=True):
            row_max_cur = utils.fmax_reduce(
                acc_S_mn[r, None].load(),
                init_val=row_max[r] if const_expr(not is_first) else None,
                arch=self.arch,
            )
            row_max_cur = cute.arch.warp_reduction_max(row_max_cur, threads_in_group=4)
            row_max_safe = row_max_cur if row_max_cur != -Float32.inf else 0.0
            if const_expr(is_first):
                row_scale[r] = 1.0
            else:
                row_max_old = row_max[r]
                acc_scale_ = (row_max_old - row_max_safe) * scale_log2
                row_scale[r] = cute.math.exp2(acc_scale_, fastmath=True)
                if const_expr(self.rescale_threshold > 0.0):
                    # Stale max within the threshold: keep it and skip the rescale.
                    if acc_scale_ >= -self.rescale_threshold:
                        row_max_cur = row_max_old
                        row_max_safe = row_max_old
                        row_scale[r] = 1.0
            row_max[r] = row_max_cur
            bias = -row_max_safe * scale_log2
            for c in cutlass.range_constexpr(n_cols):
                acc_S_mn[r, c] = self.weight(acc_S_mn[r, c] * scale_log2 + bias, c, n_cols)
            row_sum[r] = utils.fadd_reduce(
                acc_S_mn[r, None].load(),
                init_val=row_sum[r] * row_scale[r] if const_expr(not is_first) else None,
                arch=self.arch,
            )
        return row_scale
