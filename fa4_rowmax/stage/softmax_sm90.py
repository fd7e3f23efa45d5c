"""Rowmax softmax stage on SM90 (Hopper): FA4's `Softmax` with the modes, conditional rescale and beta.

Stock FA4 on SM90 always moves the running max and rescales O; here, as on SM100, the stale max is kept
while the new tile max exceeds it by at most `rescale_threshold` (log2 units; 0 keeps stock behaviour) and
weights up to `2**rescale_threshold` appear. Hopper has no packed f32x2 arithmetic, so every element is
handled on its own, and the FP32/ALU issue slots, not the MUFU, bound the softmax (docs/fa4_notes.md,
"Hopper variants"). The Hopper levers, each a knob of `SoftmaxStage`:

- `anchor_rounding="half_octave"` (rowmax_h15): scale, anchor subtraction and round-add in one FFMA
  (Note [Folded H15 with a half-octave anchor] in softmax_base.py).
- `rescale_vote=True`: skip the O rescale when no row of the warp moved its anchor
  (Note [Warp-vote rescale skip]).

Note [NaN rows in the approximate modes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The H15/PoT clamp (`max` against a constant) turns a NaN score into weight 0, where stock FA4's
`exp2(NaN)` poisons the row sum and O. To give the same NaN rows at no per-element cost, the approximate
modes take the row max with `max.NaN` (FMNMX.NAN: same count as the stock FMNMX), quad reduction included,
so a NaN score makes the row's running max NaN for good; a score of +inf (stock: `exp2(inf - inf)` = NaN)
makes it +inf. Either row then rescales O by exp2(NaN or -inf) on its next tile and `finalize` scales it
by NaN (one compare per row), so O is NaN in that row; its LSE is -inf, which is what stock FA4 returns for
a NaN row sum. NaN in V propagates through the PV GEMM as in stock.

Note [Warp-vote rescale skip]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`rescale_O` multiplies every O accumulator of the thread (64 FMUL per thread per tile at head dim 128, one
issue per score element). With `rescale_threshold > 0`, or a half-octave anchor that did not move, most
tiles leave every row's factor at exactly 1.0. The rows of a warp vote (`vote.any` on factor != 1, NaN
counts as a change): when none changed, the warp branches over the multiplies. The branch is warp-uniform,
so no lane diverges; the cost is the compares, one vote and one branch per tile.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import flash_attn.cute.utils as utils
from cutlass import Float32, const_expr
from flash_attn.cute.softmax import Softmax

from fa4_rowmax.stage.softmax_base import (
    RowmaxSoftmaxMixin,
    Sm90OnlineSoftmaxMixin,
    h15_alu,
    h15_anchor_addend,
    h15_folded_alu,
    h15_folded_mufu,
    h15_mufu,
    pot_alu,
    pot_mufu,
)


@dataclass
class RowmaxSoftmaxSm90(Sm90OnlineSoftmaxMixin, Softmax):
    rescale_threshold: cutlass.Constexpr[float] = 0.0
    mode: cutlass.Constexpr[str] = "exact"
    beta: cutlass.Constexpr[float | None] = None
    anchor_rounding: cutlass.Constexpr[str] = "exact"
    rescale_vote: cutlass.Constexpr[bool] = False

    @staticmethod
    def from_stock(softmax: Softmax, stage):
        """Take over the row statistics of the `Softmax` the kernel created, with the knobs of the resolved
        `stage` (interface.SoftmaxStage)."""
        return RowmaxSoftmaxSm90(*RowmaxSoftmaxMixin.stock_fields(softmax), **RowmaxSoftmaxSm90.stage_knobs(stage))

    @property
    def nan_rows(self) -> bool:
        """Note [NaN rows in the approximate modes]; `exact` keeps stock's max (exp2 propagates NaN)."""
        return self.mode != "exact"

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
    def folded_weight(
        self, s: Float32, addend: Float32, index: cutlass.Constexpr[int], count: cutlass.Constexpr[int]
    ) -> Float32:
        """H15 weight of raw score `s` on the half-octave lattice whose row addend is `addend`."""
        if const_expr(self.off_mufu(index, count)):
            return h15_folded_alu(s, self.scale_log2, addend)
        return h15_folded_mufu(s, self.scale_log2, addend)

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
        """Row r's weights (Sm90OnlineSoftmaxMixin) and its fp32 row sum."""
        n_cols = cute.size(acc_S_mn, mode=[1])
        row_sum = self.row_sum
        if const_expr(self.folded):
            addend = h15_anchor_addend(row_max_safe, scale_log2)
            for c in cutlass.range_constexpr(n_cols):
                acc_S_mn[r, c] = self.folded_weight(acc_S_mn[r, c], addend, c, n_cols)
        else:
            bias = -row_max_safe * scale_log2
            for c in cutlass.range_constexpr(n_cols):
                acc_S_mn[r, c] = self.weight(acc_S_mn[r, c] * scale_log2 + bias, c, n_cols)
        row_sum[r] = utils.fadd_reduce(
            acc_S_mn[r, None].load(),
            init_val=row_sum[r] * row_scale[r] if const_expr(not is_first) else None,
            arch=self.arch,
        )

    @cute.jit
    def finalize(self, final_scale: Float32 = 1.0, sink_val: Float32 | cute.Tensor | None = None) -> cute.Tensor:
        """Stock `Softmax.finalize` for `exact` without a half-octave anchor; otherwise the same formulas with the
        anchor the weights used and the NaN rows (`Sm90OnlineSoftmaxMixin.finalize_rows`)."""
        if const_expr(not self.folded and not self.nan_rows):
            return Softmax.finalize(self, final_scale, sink_val)
        return self.finalize_rows(final_scale, sink_val)
