"""The one table of benchmarked kernels.

Every entry knows how to call its kernel on FlashAttention-layout tensors (q (B, S, Hq, D), k/v
(B, S, Hkv, D)) and returns the output in that layout, which shapes and dtypes it cannot run (with the
reason), whether its package is importable here (imported lazily, on first use, so a missing or
half-written backend becomes an "unavailable: <reason>" row instead of a crash), and the tolerance of its
correctness gate.

Note [Gate tolerances]
~~~~~~~~~~~~~~~~~~~~~~
The gate (bench/check.py) compares a kernel's output with an fp32 reference computed from the same
(rounded) inputs, q, k, v ~ N(0, 1), by the relative Frobenius error ||out - ref|| / ||ref||. For such
inputs the output is a weighted mean of V rows, and a per-weight relative error e gives an output error of
about rms(e), so the tolerances follow each method's per-weight error, with ~2x headroom:
  - exact softmax, 16-bit inputs: 1e-2 (FA4 stock measured 2.0-2.3e-3 on the H200: bf16 rounding of P and O);
    FP8 inputs: Note [FP8 gate tolerances].
  - Rowmax-H15: 0.2 against exact attention (log2 error of every weight within [-0.25, +0.335] octave; 8-10%
    measured on Gaussian inputs); FP8: Note [FP8 gate tolerances]. Against exact attention this is only a
    sanity check, which a wrong approximate kernel could pass: the binding gate of every FA4 kernel with a
    softmax stage (16-bit inputs) is bench/semantic_check.py, the stage's own reference within the per-row
    bounds derived in fa4_rowmax/gates/tolerances.py.
  - Fused-Softmax and its exact twin, by operand format: mxfp8 and mxfp6 0.12 (5.7% / 6.5% reported vs BF16
    attention), mxfp4 0.4 (20.5% reported).
Garbage stays far above all of them: zeros give 1.0, unrelated values ~1.4, and a kernel that ignores the
scores (uniform weights) ~0.8 for these inputs.

Note [FP8 gate tolerances]
~~~~~~~~~~~~~~~~~~~~~~~~~~
e4m3 keeps 3 fraction bits: unit roundoff u = 2^-4. Rounding a value of binade [2^e, 2^(e+1)) to the step
2u 2^e leaves an error uniform over the step, variance (2u 2^e)^2 / 12. Relative to the signal power E[x^2]
that is between u^2/7 (values uniform in their binade) and u^2/6.5 (log-uniform); N(0, 1) values, whose
density falls across the top binades, sit lower in them: u^2/5.5, and so do the softmax weights
exp(s - m) (both measured by tests/test_bench.py from torch's e4m3 rounding). So each e4m3 rounding adds the
noise power rho = u^2 / 5.5. For q, k, v ~ N(0, 1) and softmax scale d^-1/2 the output is a weighted mean of
V rows and every weight is off by its own independent relative error, so the relative Frobenius output error
is the rms of the per-weight (or per-V-element) relative errors, and independent sources add in power:
  - Q and K rounded: score error variance rho E[k^2] + rho E[q^2] = 2 rho; each weight exp(s) moves by it;
  - V rounded: rho;  P rounded before P@V (the row sum from the fp32 P): rho;  O rounded to e4m3: rho;
  - Rowmax-H15 itself: log2(H / 2^x) = -t + 0.085 b (t uniform in +-1/4, b a fair bit), std 0.150 octaves,
    a relative weight error of ln 2 * 0.150 = 0.104;
  - Hopper's FP8 wgmma accumulator (13 kept fraction bits, truncated: aiter_fused/kernel.py, Note [FP8
    accumulation]; O accumulates a whole row in it): a model, not a measurement: each 32-key k-step
    truncates up to 2^-13 of the running |O|, which grows like sqrt(keys), so the mean relative error is
    ~2^-14 (2/3) seqlen / 32: 0.3% at 2K, 4.2% at 32K (ACCUMULATOR_REL_ERROR, at the longest seqlen run).
Sanity check against the H200: FA3-FP8 vs fp32 attention of the unrounded N(0, 1) inputs rounds Q, K, V
and P: sqrt(4 rho) = 5.3%, and 5.3% was measured (../shared/notes/fp8_sm90.md), so at that shape the
accumulator adds nothing visible. The gate's reference is computed from the very FP8 inputs the kernel
read (bench/check.py), so only P and O count there, plus the accumulator model and the method's own error:
tolerance = 2 x that (the ~2x headroom of Note [Gate tolerances]), capped at FP8_EXACT_CAP / FP8_H15_CAP:
exact FP8 with a BF16 O 0.10, cuDNN's FP8 O 0.11, H15 FP8 (its P exact in e4m3) 0.22. `fp8_output_error`
computes them; the H200 rows' `check.rel_err` over 2K-32K put the accumulator model to the test.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import os
from typing import Callable, Mapping

import torch

Launch = Callable[[], torch.Tensor]

BASELINE = "fa4_stock"
H15_THRESHOLDS = (0.0, 2.0, 4.0, 8.0)
H15_BETAS = (0.0, 0.125, 0.25, 0.375, 0.5, 1.0)
MX_FORMATS = ("mxfp8", "mxfp6", "mxfp4")
FA4_PATCH_KWARGS = ("softmax_mode", "rescale_threshold", "beta")

# Note [FP8 gate tolerances]
E4M3_UNIT_ROUNDOFF = 2.0**-4
E4M3_NOISE_POWER = E4M3_UNIT_ROUNDOFF**2 / 5.5  # rho: one e4m3 rounding, relative to N(0, 1)-like signal power
H15_WEIGHT_REL_ERROR = math.log(2.0) * math.sqrt(0.5**2 / 12 + (math.log2(1.5) - 0.5) ** 2 / 4)  # 0.104
FP8_LONGEST_SEQLEN = 32768
ACCUMULATOR_REL_ERROR = 2.0**-14 * (2 / 3) * FP8_LONGEST_SEQLEN / 32
FA3_FP8_MEASURED_REL_ERROR = 0.053  # H200, 2026-12-01, vs fp32 attention of unrounded N(0, 1) inputs
FP8_EXACT_CAP, FP8_H15_CAP = 0.12, 0.3


def fp8_output_error(*, roundings: int, accumulator: bool = True, h15: bool = False) -> float:
    """Predicted relative Frobenius output error (Note [FP8 gate tolerances]) from `roundings` e4m3 roundings
    (Q and K count 2, V, P and O one each), Hopper's FP8 accumulator model, and H15's own weight error."""
    power = roundings * E4M3_NOISE_POWER + (ACCUMULATOR_REL_ERROR**2 if accumulator else 0.0)
    power += H15_WEIGHT_REL_ERROR**2 if h15 else 0.0
    return math.sqrt(power)


def fp8_tolerance(*, roundings: int, h15: bool = False) -> float:
    """The gate tolerance: 2x the predicted error against a reference from the same FP8 inputs, capped."""
    return min(2 * fp8_output_error(roundings=roundings, h15=h15), FP8_H15_CAP if h15 else FP8_EXACT_CAP)


_EXACT_TOL = {"bf16": 1e-2, "fp16": 1e-2, "fp8": fp8_tolerance(roundings=1)}  # P rounded to e4m3, BF16 O
_H15_TOL = {"bf16": 0.2, "fp16": 0.2, "fp8": fp8_tolerance(roundings=0, h15=True)}  # H15 weights exact in e4m3
_CUDNN_FP8_TOL = {"fp8": fp8_tolerance(roundings=2)}  # P and the FP8 O
# BF16 kernels on FP8 inputs upcast to BF16 (exact): their BF16 error, as for BF16 inputs.
_BF16_PEER_TOL = {"bf16": 1e-2, "fp16": 1e-2, "fp8": 1e-2}
_MX_TOL = {"mxfp8": 0.12, "mxfp6": 0.12, "mxfp4": 0.4}
# aiter_fused dot modes timed against the arch default (aiter_fused.attention.DOT_MODES; "fp8" is the sm_90 default)
AITER_DOT_MODE_VARIANTS = ("bf16", "scaled")

# SM90 softmax-stage levers, one entry per variant, called through fa4_rowmax.interface.rowmax_attn_func
# (flash_attn_func does not take anchor_rounding / rescale_vote).
HOPPER_LEVERS = {
    "fa4_h15_fold": {"softmax_mode": "rowmax_h15", "anchor_rounding": "half_octave"},
    "fa4_h15_vote": {"softmax_mode": "rowmax_h15", "rescale_vote": True},
    "fa4_h15_fold_vote": {"softmax_mode": "rowmax_h15", "anchor_rounding": "half_octave", "rescale_vote": True},
    "fa4_h15_fold_vote_t8": {
        "softmax_mode": "rowmax_h15",
        "anchor_rounding": "half_octave",
        "rescale_vote": True,
        "rescale_threshold": 8.0,
    },
    "fa4_exact_vote": {"softmax_mode": "exact", "rescale_vote": True},
    "fa4_exact_vote_t8": {"softmax_mode": "exact", "rescale_vote": True, "rescale_threshold": 8.0},
}

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}

# The FP8 SM90 kernel (fa4_rowmax.fp8_sm90): exact twin, its exp2-deleted cost probe, Rowmax-H15 and its map
# over its knobs: rescale_threshold (FA4's range rule with max_offset 8 leaves < 0.472 for H15 in e4m3,
# config.py), the folded half-octave anchor, and the KV tile (the kernel takes 128-224; FA3 uses 224 for FP8
# hd128). Its H15 takes beta None or 1.0 only (every weight is built off the MUFU), so the map has no beta axis;
# the exact twin's beta rows are levers (FP8_EXACT_BETAS).
FP8_H15_THRESHOLDS = (0.0, 0.4)
FP8_ANCHOR_ROUNDINGS = ("exact", "half_octave")
FP8_TILE_NS = (128, 224)
FP8_EXACT_BETAS = (0.125, 0.25)
# How the FP8 SM90 kernel accumulates P.V (issue 22): "single" feeds the running O back as the wgmma's C operand on
# every KV tile (Hopper's FP8 accumulator keeps ~13 fraction bits and truncates, so long rows lose O); "two_level"
# gives each tile's P.V a fresh accumulator promoted into FP32 O. One row per softmax mode and accumulation.
FP8_PV_ACCUMULATIONS = ("single", "two_level")
# flash_attn_func with e4m3 inputs and no lever: the defaults a user gets.
FP8_FUNC_VARIANTS = {"fa4_fp8_func_exact": {}, "fa4_fp8_func_h15": {"softmax_mode": "rowmax_h15"}}
# The kernel's per-element levers one at a time, and all together (issue 11, "What decides it"): the row sum
# by the PV MMA (ones columns in V^T) and the warp-vote O-rescale skip; timed at the focus shape with the map.
# The vote skips the O rescale of single-level accumulation only (two-level promotes every tile; the kernel refuses
# the pair), so its rows ask for pv_accumulation="single".
FP8_LEVERS = {
    "fa4_fp8_h15_mma": {"softmax_mode": "rowmax_h15", "row_sum": "mma"},
    "fa4_fp8_h15_vote": {"softmax_mode": "rowmax_h15", "rescale_vote": True, "pv_accumulation": "single"},
    "fa4_fp8_h15_fold_vote_mma": {
        "softmax_mode": "rowmax_h15",
        "anchor_rounding": "half_octave",
        "rescale_vote": True,
        "row_sum": "mma",
        "pv_accumulation": "single",
    },
    "fa4_fp8_exact_vote_mma": {
        "softmax_mode": "exact",
        "rescale_vote": True,
        "row_sum": "mma",
        "pv_accumulation": "single",
    },
    # KV tile 192 (fastest in the kernel's own interleaved timing, docs/fp8_sm90.md), fp32 and MMA row sums.
    "fa4_fp8_exact_n192": {"softmax_mode": "exact", "tile_n": 192},
    "fa4_fp8_h15_n192": {"softmax_mode": "rowmax_h15", "tile_n": 192},
    "fa4_fp8_exact_n192_mma": {"softmax_mode": "exact", "tile_n": 192, "row_sum": "mma"},
    "fa4_fp8_h15_n192_mma": {"softmax_mode": "rowmax_h15", "tile_n": 192, "row_sum": "mma"},
    "fa4_fp8_h15_fold_n192_mma": {
        "softmax_mode": "rowmax_h15",
        "anchor_rounding": "half_octave",
        "tile_n": 192,
        "row_sum": "mma",
    },
    # The FADD-sum levers for rows past fp8_sm90.MMA_ROW_SUM_MAX_KEYS (the MMA row sum is refused there): the
    # fold, and the exact-anchor H15 clamped by saturation (Note [Clamp by saturation]; same values as
    # fa4_fp8_h15_n192, one op less per element).
    "fa4_fp8_h15_fold_n192": {"softmax_mode": "rowmax_h15", "anchor_rounding": "half_octave", "tile_n": 192},
    "fa4_fp8_h15_sat_n192": {"softmax_mode": "rowmax_h15", "clamp": "sat", "tile_n": 192},
    # The exact twin's exp2-emulation share (fp8_sm90, Note [beta on the FP8 exact twin]) at KV tile 192, with the
    # FADD row sum (the MMA row sum is refused past MMA_ROW_SUM_MAX_KEYS).
    **{
        f"fa4_fp8_exact_n192_b{beta:g}": {"softmax_mode": "exact", "tile_n": 192, "beta": beta}
        for beta in FP8_EXACT_BETAS
    },
}
# Three consumer warpgroups (tile_m 192, Note [Three consumer warpgroups]), opt-in rows (`--kernels '*_m192_*'`).
FP8_TILE_M3 = {
    # Without overlap, tile_n <= 160; the MMA row sum (its 8 columns spill a few registers at 160 a thread) and the
    # FADD row sum (no spill).
    **{
        f"fa4_fp8_{name}_m192_n{n}": {
            "softmax_mode": mode,
            **knobs,
            "tile_m": 192,
            "tile_n": n,
            "intra_wg_overlap": False,
        }
        for name, mode, knobs in (
            ("h15_sat_mma", "rowmax_h15", {"clamp": "sat", "row_sum": "mma"}),
            ("h15_sat", "rowmax_h15", {"clamp": "sat"}),
            ("exact_mma", "exact", {"row_sum": "mma"}),
        )
        for n in (128, 160)  # fa4_rowmax.config.FP8_TILE_M3_TILE_NS (bench/ looks the package up lazily)
    },
}
# Three consumer warpgroups under FA4's round-robin scheduler barrier (`scheduler_barrier`, Note [Three consumer
# warpgroups]), with FA4's hand-over and right after the P.V GEMM; opt-in rows (`--kernels '*_sb' '*_sb_arrive'`).
FP8_ROUND_ROBIN = {
    f"{name}{suffix}": {**FP8_TILE_M3[name], "scheduler_barrier": True, **extra}
    for name in ("fa4_fp8_h15_sat_mma_m192_n128", "fa4_fp8_h15_sat_mma_m192_n160", "fa4_fp8_exact_mma_m192_n160")
    for suffix, extra in (("_sb", {}), ("_sb_arrive", {"arrive_after_pv": True}))
}
# The tuned defaults with O's tile at the P.V GEMM's columns, the row-sum columns included (`o_store="pv_columns"`,
# Note [O's tile without the row-sum columns]), beside `fa4_fp8_exact_two_level` / `fa4_fp8_h15_two_level` (the same
# direct call at the defaults, which store head_dim columns); opt-in rows (`--kernels '*_o_pv_columns'`).
FP8_O_STORE = {
    f"fa4_fp8_{name}_o_pv_columns": {"softmax_mode": mode, "o_store": "pv_columns"}
    for name, mode in (("exact", "exact"), ("h15", "rowmax_h15"))
}
# The tuned defaults at each tiling (Note [Tuned defaults]: tile_m passed takes that tile_m's entry, every other
# knob tuned), to re-decide TUNED_TILE_M per head dim and mask; opt-in rows (`--kernels '*_tuned_m*'`).
FP8_TUNED_TILE_M = {
    f"fa4_fp8_{name}_tuned_m{tile_m}": {"softmax_mode": mode, "tile_m": tile_m}
    for name, mode in (("exact", "exact"), ("h15", "rowmax_h15"))
    for tile_m in (128, 192)  # fa4_rowmax.config.FP8_TILE_MS
}
# The first KV tile's masked half skipped (Note [The masked half of the first KV tile]) at the tile_m 128 entries
# without intra-warpgroup overlap: at head dim 128 the same structure as `*_tuned_m128`, the rows to compare it
# with; opt-in rows (`--kernels '*_tuned_m128_masked_half'`).
FP8_MASKED_HALF = {
    f"{name}_masked_half": {**knobs, "intra_wg_overlap": False, "masked_half": "skip"}
    for name, knobs in FP8_TUNED_TILE_M.items()
    if knobs["tile_m"] == 128
}
# Each warpgroup's own tile boundary (`warpgroup_epilogue="own"`, Note [Each warpgroup's own tile boundary]) beside
# FA4's shared one, both on the persistent grid without overlap at each tiling's tuned entry; opt-in rows (`--kernels
# '*_boundary'`). Unpacked heads only: the benchmark's GQA 16/4 packs at both tile_m, so its "own" rows report the
# refusal.
FP8_WARPGROUP_EPILOGUE = {
    f"fa4_fp8_{name}_m{tile_m}_{boundary}_boundary": {
        "softmax_mode": mode,
        "tile_m": tile_m,
        "persistent": True,
        "intra_wg_overlap": False,
        "warpgroup_epilogue": boundary,
    }
    for name, mode in (("exact", "exact"), ("h15", "rowmax_h15"))
    for tile_m in (128, 192)  # fa4_rowmax.config.FP8_TILE_MS
    for boundary in ("shared", "own")
}
# Both at once at tile_m 128 (H15 and the exact twin): the masked half skipped under each boundary; opt-in rows
# (`--kernels '*_boundary_masked_half'`), beside `*_m128_*_boundary`.
FP8_BOUNDARY_MASKED_HALF = {
    f"{name}_masked_half": {**knobs, "masked_half": "skip"}
    for name, knobs in FP8_WARPGROUP_EPILOGUE.items()
    if knobs["tile_m"] == 128
}
# The exp2-deleted probe at three warpgroups (tile 128), the base of its structure rows.
FP8_PROBE_M192 = {
    "softmax_mode": "exact",
    "exp2_deleted": True,
    "row_sum": "mma",
    "tile_m": 192,
    "tile_n": 128,
    "intra_wg_overlap": False,
}
# The exact twin's exp2-emulation share (Note [beta on the FP8 exact twin]) at its tuned configurations: three
# warpgroups at tile 160 (head dim 128 non-causal) and 128 (head dim 64), two at tile 256 (head dim 128 causal);
# opt-in rows (`--kernels 'fa4_fp8_exact_mma_*_b*'`).
FP8_EXACT_DEFAULT_BETAS = {
    f"{name}_b{beta:g}": {**knobs, "beta": beta}
    for name, knobs in (
        ("fa4_fp8_exact_mma_m192_n160", FP8_TILE_M3["fa4_fp8_exact_mma_m192_n160"]),
        ("fa4_fp8_exact_mma_m192_n128", FP8_TILE_M3["fa4_fp8_exact_mma_m192_n128"]),
        (
            "fa4_fp8_exact_mma_n256_nooverlap",
            {"softmax_mode": "exact", "row_sum": "mma", "tile_n": 256, "intra_wg_overlap": False},
        ),
    )
    for beta in FP8_EXACT_BETAS
}
# More K/V stages in flight (Note [KV stages in shared memory], fa4_rowmax/fp8_sm90.py), opt-in rows
# (`--kernels '*_s[345]'`): three warpgroups at the stages their shared memory allows, and tile 192 at tile_m 128,
# the largest key tile that takes a third stage.
FP8_KV_STAGE_ROWS = {
    **{
        f"{name}_s{stages}": {**FP8_TILE_M3[name], "kv_stages": stages}
        for name, stages in (
            ("fa4_fp8_h15_sat_mma_m192_n128", 4),
            ("fa4_fp8_h15_sat_mma_m192_n128", 5),
            ("fa4_fp8_h15_sat_mma_m192_n160", 4),
            ("fa4_fp8_exact_mma_m192_n160", 4),
        )
    },
    **{
        f"fa4_fp8_{name}_n192_nooverlap_s3": {
            "softmax_mode": mode,
            **knobs,
            "tile_n": 192,
            "intra_wg_overlap": False,
            "kv_stages": 3,
        }
        for name, mode, knobs in (
            ("h15_sat_mma", "rowmax_h15", {"clamp": "sat", "row_sum": "mma"}),
            ("exact_mma", "exact", {"row_sum": "mma"}),
        )
    },
}
# Candidates for the FP8 forward's tuned defaults (issue 22 item 3: the fastest configuration that passes every
# accuracy check), all two-level: the clamp by saturation and the MMA row sum (the levers that free registers), at
# KV tile 128 with FA4's intra-warpgroup overlap (the largest tile whose registers fit beside the second accumulator
# at head dim 128) and at 192 / 224 / 256 without it (Note [Two-level P.V accumulation]). The hand-over right after
# the P.V GEMM (`arrive_after_pv`, Note [Scheduler window after the P.V GEMM]) is a lever row (FP8_LEVERS, the
# "_arrive" names): the eighth H200 session measured it losing at tile 256 and on the exact twin.
NO_OVERLAP_TILE_NS = (192, 224, 256)
FP8_CANDIDATES = {
    "fa4_fp8_h15_sat_mma": {"softmax_mode": "rowmax_h15", "clamp": "sat", "row_sum": "mma"},
    **{
        f"fa4_fp8_h15_sat_mma_n{n}_nooverlap": {
            "softmax_mode": "rowmax_h15",
            "clamp": "sat",
            "row_sum": "mma",
            "tile_n": n,
            "intra_wg_overlap": False,
        }
        for n in NO_OVERLAP_TILE_NS
    },
    "fa4_fp8_h15_sat_mma_n192": {"softmax_mode": "rowmax_h15", "clamp": "sat", "row_sum": "mma", "tile_n": 192},
    "fa4_fp8_exact_mma": {"softmax_mode": "exact", "row_sum": "mma"},
    **{
        f"fa4_fp8_exact_mma_n{n}_nooverlap": {
            "softmax_mode": "exact",
            "row_sum": "mma",
            "tile_n": n,
            "intra_wg_overlap": False,
        }
        for n in NO_OVERLAP_TILE_NS
    },
    "fa4_fp8_exact_mma_n192": {"softmax_mode": "exact", "row_sum": "mma", "tile_n": 192},
}
# Peers every row of an FP8 group is also compared with (same interleaved rounds): speedup_vs_<name>.
RATIO_PEERS = ("fa3_fp8", "fa4_stock_bf16")
GEMM_CEILING_N = 8192
GEMM_CEILING_FLOPS = 2.0 * GEMM_CEILING_N**3
# cuDNN's FP8 scales (the bench's choice, Note [cuDNN FP8 scales])
CUDNN_SCALE_S = 2.0**8
CUDNN_SCALE_O = 2.0**6


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    family: str  # "fa4" | "aiter_fused" | "sdpa"
    mode: str  # the softmax: "exact" | "rowmax_h15" | "fused_softmax"
    knobs: tuple[tuple[str, object], ...]  # what the call passes beyond (q, k, v, causal), for the results
    tolerances: Mapping[str, float]  # per input dtype, Note [Gate tolerances]
    _load: Callable[[], Callable] = dataclasses.field(repr=False)  # the entry point, or raises KernelUnavailable
    _bind: Callable[[Callable, torch.Tensor, torch.Tensor, torch.Tensor, bool], Launch] = dataclasses.field(repr=False)
    _unsupported: Callable[[str, tuple[int, int]], str | None] = dataclasses.field(repr=False)  # (dtype, capability)
    # False for cost probes whose values are wrong by design (the GEMM ceiling, exp2 deleted): no output check.
    checked: bool = True
    # A ceiling's fixed FLOP count per call (its TFLOPS use it, it gets no speed-ups); None: the shape's attention.
    flops: float | None = None
    # The launch returns the output times this (cuDNN's FP8 O carries scale_o); the check divides it out.
    output_scale: float = 1.0

    def unavailable_reason(self) -> str | None:
        """None when the entry point imports (and has the needed arguments), else why not."""
        try:
            self._load()
        except KernelUnavailable as exc:
            return str(exc)
        return None

    def unsupported_reason(self, dtype: str, capability: tuple[int, int]) -> str | None:
        if dtype not in self.tolerances:
            return f"{self.name} takes {'/'.join(self.tolerances)} inputs, not {dtype}"
        return self._unsupported(dtype, capability)

    def bind(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Launch:
        """A zero-argument callable running the kernel on these tensors, returning out (B, S, Hq, D).
        Layout changes (views) happen here, outside the timed call."""
        return self._bind(self._load(), q, k, v, causal)

    def output_for_check(self, out: torch.Tensor) -> torch.Tensor:
        """The launch's output as attention values (fp32), for the gate."""
        return out.float() / self.output_scale

    def tolerance(self, dtype: str) -> float:
        if dtype not in self.tolerances:
            raise ValueError(f"dtype must be one of {sorted(self.tolerances)} for {self.name}, got {dtype!r}")
        return self.tolerances[dtype]


class KernelUnavailable(RuntimeError):
    pass


def missing_kwargs(fn: Callable, names: tuple[str, ...]) -> list[str]:
    """The keyword arguments among `names` that `fn`'s signature does not declare by name."""
    params = inspect.signature(fn).parameters
    return [name for name in names if name not in params]


def _import_failure(what: str, exc: BaseException) -> KernelUnavailable:
    return KernelUnavailable(f"cannot import {what}: {type(exc).__name__}: {exc}")


@functools.cache
def _lookup(module: str, name: str) -> tuple[Callable | None, str | None]:
    """`module.name`, imported once; (None, why) when the import fails."""
    try:
        return getattr(importlib.import_module(module), name), None
    except Exception as exc:  # any import-time failure (no CUDA DSL, wrong torch, no Triton) makes it unavailable
        return None, str(_import_failure(f"{module}.{name}", exc))


def _load(module: str, name: str) -> Callable:
    fn, reason = _lookup(module, name)
    if fn is None:
        raise KernelUnavailable(reason)
    return fn


def _load_fa4() -> Callable:
    return _load("flash_attn.cute", "flash_attn_func")


def _load_fa4_patched() -> Callable:
    fn = _load_fa4()
    missing = missing_kwargs(fn, FA4_PATCH_KWARGS)
    if missing:
        raise KernelUnavailable(
            f"flash_attn_func has no {', '.join(missing)} argument "
            "(the Rowmax-H15 patch set is not applied to the installed flash-attn-4)"
        )
    return fn


def _load_aiter() -> Callable:
    return _load("aiter_fused.attention", "fused_softmax_attention")


def _load_sdpa() -> Callable:
    return torch.nn.functional.scaled_dot_product_attention


def _first(result) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


def _fa4_binder(knobs: dict) -> Callable:
    """A row without a softmax_mode is stock FA4's exact attention: on a patched FA4 the call names it, since the
    patch's default (None) would take a process-wide mode (Note [Process-wide softmax mode], fa4_rowmax/process_mode.py)
    and FA4_ROWMAX_SOFTMAX_MODE in the benchmark's environment would turn the baseline into the approximation."""

    def bind(fn, q, k, v, causal):
        call_knobs = knobs
        if "softmax_mode" not in knobs and not missing_kwargs(fn, ("softmax_mode",)):
            call_knobs = {"softmax_mode": "exact", **knobs}
        return lambda: _first(fn(q, k, v, causal=causal, **call_knobs))

    return bind


def _load_rowmax_levers() -> Callable:
    _load_fa4_patched()
    return _load("fa4_rowmax.interface", "rowmax_attn_func")


def _rowmax_levers_unsupported(dtype: str, capability: tuple[int, int]) -> str | None:
    if capability[0] != 9:
        return (
            f"anchor_rounding / rescale_vote are SM90 (Hopper) levers (fa4_rowmax.interface.SoftmaxStage); "
            f"this GPU is sm_{capability[0]}{capability[1]}"
        )
    return _fa4_unsupported(dtype, capability)


def _aiter_binder(mx_format: str, exact: bool, dot_mode: str | None = None) -> Callable:
    def bind(fn, q, k, v, causal):
        return lambda: _first(fn(q, k, v, causal=causal, mx_format=mx_format, exact=exact, dot_mode=dot_mode))

    return bind


def _sdpa_binder(backend_name: str) -> Callable:
    def bind(fn, q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views, no copy
        gqa = q.shape[2] != k.shape[2]

        def launch():
            with sdpa_kernel(backend):
                return fn(qt, kt, vt, is_causal=causal, enable_gqa=gqa).transpose(1, 2)

        return launch

    return bind


def _fa4_unsupported(dtype: str, capability: tuple[int, int]) -> str | None:
    if dtype == "fp8" and capability[0] != 10:
        return (
            f"FA4 FP8 is SM100-only (flash_attn/cute/interface.py asserts compute capability 10.x); "
            f"this GPU is sm_{capability[0]}{capability[1]}"
        )
    return None


def _always_supported(dtype: str, capability: tuple[int, int]) -> str | None:
    return None


def _upcast_fp8(bind: Callable) -> Callable:
    """A BF16 kernel's binder that also takes FP8 inputs, upcast to BF16 (exact) outside the timed call."""

    def upcast_bind(fn, q, k, v, causal):
        if q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        return bind(fn, q, k, v, causal)

    return upcast_bind


def _hopper_only(what: str) -> Callable:
    def unsupported(dtype: str, capability: tuple[int, int]) -> str | None:
        if capability[0] != 9:
            return f"{what} is a Hopper (SM90) kernel; this GPU is sm_{capability[0]}{capability[1]}"
        return None

    return unsupported


# --- FP8 peers and the FP8 SM90 kernel ------------------------------------------------------------------------


def _load_gemm() -> Callable:
    if not hasattr(torch, "_scaled_mm"):
        raise KernelUnavailable(f"torch {torch.__version__} has no torch._scaled_mm")
    return torch._scaled_mm


def _gemm_binder(fn, q, k, v, causal):
    """The FP8 GEMM ceiling: an e4m3 GEMM_CEILING_N^3 product (A row-major, B column-major, as _scaled_mm
    needs), BF16 out; the attention inputs only give the device. Its TFLOPS is GEMM_CEILING_FLOPS / time."""
    generator = torch.Generator(device=q.device).manual_seed(0)
    n = GEMM_CEILING_N
    a = torch.randn(n, n, device=q.device, dtype=torch.bfloat16, generator=generator).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=q.device, dtype=torch.bfloat16, generator=generator).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=q.device, dtype=torch.float32)
    return lambda: fn(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _load_fa3() -> Callable:
    return _load("fa3_fwd_interface", "flash_attn_func")


def _fa3_bf16_binder(fn, q, k, v, causal):
    return lambda: _first(fn(q, k, v, causal=causal))


def _fa3_fp8_binder(fn, q, k, v, causal):
    """fa3-fwd 0.0.3's FP8 forward; descales float32 (batch, heads_kv), ones (the inputs are N(0, 1) in e4m3)."""
    ones = torch.ones(q.shape[0], k.shape[2], device=q.device, dtype=torch.float32)
    return lambda: _first(fn(q, k, v, causal=causal, q_descale=ones, k_descale=ones, v_descale=ones))


_fa3_unsupported = _hopper_only("FlashAttention-3 (fa3-fwd)")


def _load_cudnn() -> Callable:
    cudnn, reason = _lookup_module("cudnn")
    if cudnn is None:
        raise KernelUnavailable(reason)
    if not hasattr(cudnn.pygraph, "sdpa_fp8"):
        raise KernelUnavailable(f"cudnn frontend {getattr(cudnn, '__version__', '?')} has no pygraph.sdpa_fp8")
    return cudnn


@functools.cache
def _lookup_module(module: str):
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # any import-time failure makes the kernel unavailable
        return None, str(_import_failure(module, exc))


# Note [cuDNN FP8 scales]
# cuDNN's FP8 SDPA (nvidia-cudnn-frontend 1.32.0, `sdpa_fp8`) quantizes P with scale_s (and takes descale_s
# after P@V) and the output with scale_o; on Hopper O is e4m3 (BF16 O is Blackwell-only). The bench uses FA4's
# rule for P, scale_s = 2^8 (P <= 1 becomes <= 256 < 448, the tail stays normal down to 2^-14), and scale_o =
# 2^6: |O| <= max|v| < 7 for N(0, 1) V, 7 * 64 = 448, while long rows' outputs (rms sqrt(e / L), 0.009 at 32K)
# stay normal (>= 2^-6 / 64). The gate divides scale_o out (KernelSpec.output_scale); descales q/k/v are 1.
# Causal is top-left in cuDNN's sdpa_fp8 (bottom-right is not supported): the bench's shapes are square,
# where the two coincide; a non-square causal call raises instead of measuring another mask.
def _cudnn_fp8_binder(cudnn, q, k, v, causal):
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    if causal and seqlen_q != seqlen_k:
        raise ValueError(
            f"cudnn_fp8: causal masks are top-left only in cuDNN's sdpa_fp8; seqlen_q {seqlen_q} != "
            f"seqlen_k {seqlen_k} would measure a different mask than FlashAttention's bottom-right one"
        )
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    handle = _cudnn_handle(cudnn, q.device.index)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)

    def bhsd(t):  # FlashAttention's (b, s, h, d) memory described as cuDNN's (b, h, s, d)
        b, s, h, d = t.shape
        return graph.tensor(dim=(b, h, s, d), stride=(s * h * d, d, h * d, 1), data_type=e4m3)

    tq, tk, tv = bhsd(q), bhsd(k), bhsd(v)
    scalar = dict(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=fp32)
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    scale_tensors = {name: graph.tensor(name=name, **scalar) for name in names}
    out_t, _, amax_s_t, amax_o_t = graph.sdpa_fp8(
        q=tq, k=tk, v=tv, **scale_tensors, generate_stats=False, attn_scale=head_dim**-0.5, use_causal_mask=causal
    )
    out = torch.empty(batch, seqlen_q, heads_q, head_dim, device=q.device, dtype=torch.float8_e4m3fn)
    out_t.set_output(True).set_dim((batch, heads_q, seqlen_q, head_dim)).set_stride(
        (seqlen_q * heads_q * head_dim, head_dim, heads_q * head_dim, 1)
    ).set_data_type(e4m3)
    for amax in (amax_s_t, amax_o_t):
        amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    values = {
        "descale_q": 1.0,
        "descale_k": 1.0,
        "descale_v": 1.0,
        "descale_s": 1.0 / CUDNN_SCALE_S,
        "scale_s": CUDNN_SCALE_S,
        "scale_o": CUDNN_SCALE_O,
    }
    pack = {
        scale_tensors[name]: torch.full((1, 1, 1, 1), value, device=q.device, dtype=torch.float32)
        for name, value in values.items()
    }
    amaxes = [torch.empty(1, 1, 1, 1, device=q.device, dtype=torch.float32) for _ in range(2)]
    pack.update({tq: q, tk: k, tv: v, out_t: out, amax_s_t: amaxes[0], amax_o_t: amaxes[1]})
    workspace = torch.empty(graph.get_workspace_size(), device=q.device, dtype=torch.uint8)

    def launch():
        graph.execute(pack, workspace, handle=handle)
        return out

    return launch


@functools.cache
def _cudnn_handle(cudnn, device_index):
    return cudnn.create_handle()


# Note [vLLM's FA3 peer]
# vLLM 0.26.0's fork of FlashAttention-3 promotes each KV block's P.V from a fresh wgmma accumulator into FP32
# registers (two-level accumulation, vllm-project/flash-attention PR 104), so its FP8 error stays flat in the key
# count where upstream FA3's grows (../shared/notes/fp8_sm90.md, "Long rows"). Its kernels ship prebuilt in the
# wheel as `vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so` (linked to torch 2.11 / CUDA 13, the H200 image's); the
# bench loads that file with `torch.ops.load_library` from the path in $LOWPREC_VLLM_FA3_SO (no vllm import, no
# vllm install) and calls `torch.ops._vllm_fa3_C.fwd` positionally, as vLLM's `flash_attn_interface.py` does,
# with varlen-packed q/k/v (total, heads, dim) and float32 descales (batch, heads_kv). VLLM_FA3_FWD_SCHEMA is the
# op's registration string in that .so; the loader refuses a library whose op has other arguments, so a positional
# call cannot silently shift. num_splits is 1 (upstream FA3's `flash_attn_func` default), not vLLM's 0
# (heuristic): a split-KV call combines partial outputs in fp32 and would hide the accumulator under test.
VLLM_FA3_SO_ENV = "LOWPREC_VLLM_FA3_SO"
VLLM_FA3_WHEEL_PATH = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"  # inside vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64
VLLM_FA3_FWD_SCHEMA = (
    "fwd(Tensor! q, Tensor k, Tensor v, Tensor? k_new, Tensor? v_new, Tensor? q_v, Tensor!? out, "
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? cu_seqlens_k_new, Tensor? seqused_q, Tensor? seqused_k, "
    "int? max_seqlen_q, int? max_seqlen_k, Tensor? page_table, Tensor? kv_batch_idx, Tensor? leftpad_k, "
    "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? seqlens_rotary, Tensor? q_descale, Tensor? k_descale, "
    "Tensor? v_descale, float softmax_scale, bool is_causal, int window_size_left, int window_size_right, "
    "float softcap, bool is_rotary_interleaved, Tensor? scheduler_metadata, int num_splits, bool? pack_gqa, "
    "int sm_margin, Tensor? s_aux, int cp_world_size, int cp_rank, Tensor? cp_tot_seqused_k) -> Tensor[]"
)
VLLM_FA3_NUM_SPLITS = 1


def schema_signature(schema) -> list[tuple[str, str]]:
    """(name, type) of every argument and the return types of a `torch._C.FunctionSchema` (or its text)."""
    if isinstance(schema, str):
        schema = torch._C.parse_schema(schema)
    return [(a.name, str(a.type)) for a in schema.arguments] + [("->", str(r.type)) for r in schema.returns]


def vllm_fa3_fwd_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    descale: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> dict[str, object]:
    """The arguments of `torch.ops._vllm_fa3_C.fwd` by schema name, in schema order (Note [vLLM's FA3 peer]):
    varlen-packed q, k, v, one descale tensor for q, k and v, no paging, rotary, window, softcap or sinks."""
    return {
        "q": q,
        "k": k,
        "v": v,
        "k_new": None,
        "v_new": None,
        "q_v": None,
        "out": None,
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
        "cu_seqlens_k_new": None,
        "seqused_q": None,
        "seqused_k": None,
        "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k,
        "page_table": None,
        "kv_batch_idx": None,
        "leftpad_k": None,
        "rotary_cos": None,
        "rotary_sin": None,
        "seqlens_rotary": None,
        "q_descale": descale,
        "k_descale": descale,
        "v_descale": descale,
        "softmax_scale": float(softmax_scale),
        "is_causal": bool(causal),
        "window_size_left": -1,
        "window_size_right": -1,
        "softcap": 0.0,
        "is_rotary_interleaved": True,
        "scheduler_metadata": None,
        "num_splits": VLLM_FA3_NUM_SPLITS,
        "pack_gqa": None,
        "sm_margin": 0,
        "s_aux": None,
        "cp_world_size": 1,
        "cp_rank": 0,
        "cp_tot_seqused_k": None,
    }


def _load_vllm_fa3() -> Callable:
    path = os.environ.get(VLLM_FA3_SO_ENV)
    if not path:
        raise KernelUnavailable(
            f"{VLLM_FA3_SO_ENV} is not set: give it the path of _vllm_fa3_C.abi3.so from the vllm==0.26.0 wheel "
            f"({VLLM_FA3_WHEEL_PATH}); Note [vLLM's FA3 peer]"
        )
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise KernelUnavailable(
            f"{VLLM_FA3_SO_ENV}={path}: no such file (expected {VLLM_FA3_WHEEL_PATH} of vllm 0.26.0)"
        )
    fwd, reason = _vllm_fa3_op(path)
    if fwd is None:
        raise KernelUnavailable(reason)
    return fwd


@functools.cache
def _vllm_fa3_op(path: str) -> tuple[Callable | None, str | None]:
    """torch.ops._vllm_fa3_C.fwd after loading `path` once; (None, why) when it does not load or its schema is not
    VLLM_FA3_FWD_SCHEMA."""
    try:
        torch.ops.load_library(path)
        fwd = torch.ops._vllm_fa3_C.fwd
        schema = fwd.default._schema
    except Exception as exc:  # not a library, wrong torch/CUDA ABI, no such op: the peer is unavailable
        return None, f"torch.ops.load_library({path}) gave no _vllm_fa3_C.fwd: {type(exc).__name__}: {exc}"
    if schema_signature(schema) != schema_signature(VLLM_FA3_FWD_SCHEMA):
        return None, f"{path}: _vllm_fa3_C.fwd is {schema}, not the schema the bench calls (VLLM_FA3_FWD_SCHEMA)"
    return fwd, None


def _vllm_fa3_fp8_binder(fwd, q, k, v, causal):
    """vLLM's FA3 on FlashAttention-layout e4m3 tensors: packed (total, heads, dim) views, descales ones."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    packed = [t.view(batch * t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v)]  # views: the tensors are dense
    starts = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    ones = torch.ones(batch, heads_kv, device=q.device, dtype=torch.float32)
    args = vllm_fa3_fwd_args(
        *packed, starts * seqlen_q, starts * seqlen_k, seqlen_q, seqlen_k, ones, head_dim**-0.5, causal
    )
    values = tuple(args.values())
    return lambda: fwd(*values)[0].view(batch, seqlen_q, heads_q, v.shape[-1])


FP8_SM90_ENTRY = ("fa4_rowmax.fp8_sm90", "flash_attn_fp8_sm90")


def fp8_sm90_accepted_knobs(fn: Callable) -> set[str]:
    """The keywords the FP8 SM90 entry `fn` takes: those its signature names, and, when it takes `**knobs`, the
    stage knobs fa4_rowmax.config.STAGE_KNOBS lists for the "sm90_fp8" kernel (which it validates them against)."""
    params = inspect.signature(fn).parameters
    accepted = {name for name, p in params.items() if p.kind is not p.VAR_KEYWORD}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        stage_knobs, _ = _lookup("fa4_rowmax.config", "STAGE_KNOBS")
        accepted |= {name for name, knob in (stage_knobs or {}).items() if "sm90_fp8" in knob.kernels}
    return accepted


def fp8_stock_structure(softmax_mode: str) -> dict:
    """The FP8 forward's structural knobs at their config.STAGE_KNOBS defaults (tile 128, overlapped step, FADD
    row sum, no scheduler barrier, O stored at the P.V GEMM's columns; the FMNMX clamp for rowmax_h15)."""
    stock = {
        "tile_n": 128,
        "intra_wg_overlap": True,
        "row_sum": "fadd",
        "scheduler_barrier": False,
        "o_store": "pv_columns",
    }
    return {**stock, "clamp": "max"} if softmax_mode == "rowmax_h15" else stock


def _fp8_sm90_loader(knobs: dict) -> Callable:
    """The FP8 SM90 entry, unavailable when it lacks one of `knobs`' arguments."""

    def load() -> Callable:
        fn = _load(*FP8_SM90_ENTRY)
        accepted = fp8_sm90_accepted_knobs(fn)
        missing = [name for name in knobs if name not in accepted]
        if missing:
            raise KernelUnavailable(f"flash_attn_fp8_sm90 has no {', '.join(missing)} argument")
        return fn

    return load


def _fp8_sm90_binder(knobs: dict) -> Callable:
    def bind(fn, q, k, v, causal):
        return lambda: _first(fn(q, k, v, causal=causal, **knobs))

    return bind


def fp8_accumulation_name(softmax_mode: str, pv_accumulation: str) -> str:
    return f"fa4_fp8_{'h15' if softmax_mode == 'rowmax_h15' else 'exact'}_{pv_accumulation}"


def fp8_h15_map_name(threshold: float, anchor_rounding: str, tile_n: int) -> str:
    return f"fa4_fp8_h15{'_fold' if anchor_rounding == 'half_octave' else ''}_t{threshold:g}_n{tile_n}"


def _build_table() -> dict[str, KernelSpec]:
    specs = [
        KernelSpec(BASELINE, "fa4", "exact", (), _EXACT_TOL, _load_fa4, _fa4_binder({}), _fa4_unsupported),
        KernelSpec(
            "fa4_h15",
            "fa4",
            "rowmax_h15",
            (("softmax_mode", "rowmax_h15"),),
            _H15_TOL,
            _load_fa4_patched,
            _fa4_binder({"softmax_mode": "rowmax_h15"}),
            _fa4_unsupported,
        ),
    ]
    for threshold in H15_THRESHOLDS:
        for beta in H15_BETAS:
            knobs = {"softmax_mode": "rowmax_h15", "rescale_threshold": threshold, "beta": beta}
            specs.append(
                KernelSpec(
                    h15_map_name(threshold, beta),
                    "fa4",
                    "rowmax_h15",
                    tuple(knobs.items()),
                    _H15_TOL,
                    _load_fa4_patched,
                    _fa4_binder(knobs),
                    _fa4_unsupported,
                )
            )
    for name, knobs in HOPPER_LEVERS.items():  # docs/fa4_notes.md, "Hopper variants"
        tol = _H15_TOL if knobs["softmax_mode"] == "rowmax_h15" else _EXACT_TOL
        specs.append(
            KernelSpec(
                name,
                "fa4",
                knobs["softmax_mode"],
                tuple(knobs.items()),
                tol,
                _load_rowmax_levers,
                _fa4_binder(knobs),
                _rowmax_levers_unsupported,
            )
        )
    aiter_tol = {fmt: {"bf16": tol} for fmt, tol in _MX_TOL.items()}  # BF16 in/out (docs/design.md)
    for fmt in MX_FORMATS:
        for exact in (False, True):
            specs.append(
                KernelSpec(
                    f"aiter_{fmt}" + ("_exact" if exact else ""),
                    "aiter_fused",
                    "exact" if exact else "fused_softmax",
                    (("mx_format", fmt), ("exact", exact)),
                    aiter_tol[fmt],
                    _load_aiter,
                    _aiter_binder(fmt, exact),
                    _always_supported,
                )
            )
    for dot_mode in AITER_DOT_MODE_VARIANTS:  # the arch default (aiter_mxfp8) against the other dot modes
        specs.append(
            KernelSpec(
                f"aiter_mxfp8_{dot_mode}",
                "aiter_fused",
                "fused_softmax",
                (("mx_format", "mxfp8"), ("exact", False), ("dot_mode", dot_mode)),
                aiter_tol["mxfp8"],
                _load_aiter,
                _aiter_binder("mxfp8", False, dot_mode),
                _always_supported,
            )
        )
    specs += _fp8_specs()
    sdpa_tol = {d: t for d, t in _EXACT_TOL.items() if d != "fp8"}  # SDPA takes no FP8 inputs
    specs += [
        KernelSpec(
            "sdpa_cudnn",
            "sdpa",
            "exact",
            (("backend", "CUDNN_ATTENTION"),),
            sdpa_tol,
            _load_sdpa,
            _sdpa_binder("CUDNN_ATTENTION"),
            _always_supported,
        ),
        KernelSpec(
            "sdpa_flash",
            "sdpa",
            "exact",
            (("backend", "FLASH_ATTENTION"),),
            sdpa_tol,
            _load_sdpa,
            _sdpa_binder("FLASH_ATTENTION"),
            _always_supported,
        ),
    ]
    return {spec.name: spec for spec in specs}


def _fp8_specs() -> list[KernelSpec]:
    """The FP8 ceiling and peers (../shared/notes/fp8_sm90.md) and the FP8 SM90 kernel's rows."""
    fp8_exact_tol = {"fp8": _EXACT_TOL["fp8"]}
    specs = [
        KernelSpec(
            "gemm_fp8",
            "ceiling",
            "gemm",
            (("n", GEMM_CEILING_N), ("dtype", "e4m3")),
            {"fp8": math.inf},
            _load_gemm,
            _gemm_binder,
            _always_supported,
            checked=False,
            flops=GEMM_CEILING_FLOPS,
        ),
        KernelSpec(
            "fa3_bf16", "fa3", "exact", (), _BF16_PEER_TOL, _load_fa3, _upcast_fp8(_fa3_bf16_binder), _fa3_unsupported
        ),
        KernelSpec(
            "fa3_fp8",
            "fa3",
            "exact",
            (("descales", "ones"),),
            fp8_exact_tol,
            _load_fa3,
            _fa3_fp8_binder,
            _fa3_unsupported,
        ),
        KernelSpec(
            "cudnn_fp8",
            "cudnn",
            "exact",
            (("scale_s", CUDNN_SCALE_S), ("scale_o", CUDNN_SCALE_O), ("causal", "top-left (square shapes only)")),
            _CUDNN_FP8_TOL,
            _load_cudnn,
            _cudnn_fp8_binder,
            _always_supported,
            output_scale=CUDNN_SCALE_O,
        ),
        KernelSpec(
            "vllm_fa3_fp8",
            "vllm_fa3",
            "exact",
            (("descales", "ones"), ("num_splits", VLLM_FA3_NUM_SPLITS), ("accumulation", "two-level (vLLM's fork)")),
            fp8_exact_tol,
            _load_vllm_fa3,
            _vllm_fa3_fp8_binder,
            _hopper_only("vLLM's FA3 (_vllm_fa3_C)"),
        ),
        KernelSpec(
            "fa4_stock_bf16",
            "fa4",
            "exact",
            (("inputs", "FP8 upcast to BF16"),),
            _BF16_PEER_TOL,
            _load_fa4,
            _upcast_fp8(_fa4_binder({})),
            _always_supported,
        ),
    ]
    fp8_sm90 = _hopper_only("fa4_rowmax.fp8_sm90")
    # The call a user writes: FA4's flash_attn_func on e4m3 tensors routes to the SM90 FP8 forward with its
    # defaults (the patch set); exact passes no argument at all.
    for name, knobs in FP8_FUNC_VARIANTS.items():
        tol = _H15_TOL if knobs.get("softmax_mode") == "rowmax_h15" else _EXACT_TOL
        specs.append(
            KernelSpec(
                name,
                "fa4_fp8",
                knobs.get("softmax_mode", "exact"),
                (("entry", "flash_attn.cute.flash_attn_func"), *knobs.items()),
                {"fp8": tol["fp8"]},
                _load_fa4_patched,
                _fa4_binder(knobs),
                _hopper_only("flash_attn_func's SM90 FP8 forward (fa4_rowmax.fp8_sm90)"),
            )
        )
    variants = [
        ("fa4_fp8_exact", {"softmax_mode": "exact"}),
        (f"fa4_fp8_exact_n{FP8_TILE_NS[-1]}", {"softmax_mode": "exact", "tile_n": FP8_TILE_NS[-1]}),
        ("fa4_fp8_h15", {"softmax_mode": "rowmax_h15"}),
    ]
    variants += [
        (
            fp8_h15_map_name(t, a, n),
            {"softmax_mode": "rowmax_h15", "rescale_threshold": t, "anchor_rounding": a, "tile_n": n},
        )
        for t in FP8_H15_THRESHOLDS
        for a in FP8_ANCHOR_ROUNDINGS
        for n in FP8_TILE_NS
    ]
    variants += list(FP8_LEVERS.items())
    variants += list(FP8_CANDIDATES.items())
    variants += list(FP8_TILE_M3.items())
    variants += list(FP8_KV_STAGE_ROWS.items())
    variants += list(FP8_ROUND_ROBIN.items())
    variants += list(FP8_EXACT_DEFAULT_BETAS.items())
    variants += [
        (f"{name}_arrive", {**knobs, "arrive_after_pv": True})
        for name, knobs in FP8_CANDIDATES.items()
        if knobs.get("intra_wg_overlap") is False and knobs.get("tile_m", 128) == 128  # three warpgroups: no hand-over
    ]
    # The rows above name their structure; the kernel's tuned defaults (fp8_sm90, Note [Tuned defaults]) fill
    # only what the call leaves out, so each row passes the rest at its stock value. The accumulation rows below
    # are what a user gets: the defaults.
    variants = [(name, {**fp8_stock_structure(knobs["softmax_mode"]), **knobs}) for name, knobs in variants]
    variants += [
        (fp8_accumulation_name(mode, accumulation), {"softmax_mode": mode, "pv_accumulation": accumulation})
        for mode in ("exact", "rowmax_h15")
        for accumulation in FP8_PV_ACCUMULATIONS
    ]
    # The direct call's defaults on each grid (Note [Persistent work tiles]), whichever the defaults take: lever rows
    # beside the two-level rows above (flash_attn_func takes no knob).
    variants += [
        (f"{fp8_accumulation_name(mode, 'two_level')}_{suffix}", {"softmax_mode": mode, "persistent": persistent})
        for mode in ("exact", "rowmax_h15")
        for suffix, persistent in (("persistent", True), ("per_tile", False))
    ]
    variants += list(FP8_O_STORE.items())
    variants += list(FP8_TUNED_TILE_M.items())
    variants += list(FP8_MASKED_HALF.items())
    variants += list(FP8_WARPGROUP_EPILOGUE.items())
    variants += list(FP8_BOUNDARY_MASKED_HALF.items())
    for name, knobs in variants:
        tol = _H15_TOL if knobs["softmax_mode"] == "rowmax_h15" else _EXACT_TOL
        specs.append(
            KernelSpec(
                name,
                "fa4_fp8",
                knobs["softmax_mode"],
                tuple(knobs.items()),
                {"fp8": tol["fp8"]},
                _fp8_sm90_loader(knobs),
                _fp8_sm90_binder(knobs),
                fp8_sm90,
            )
        )
    for name, probe in (
        ("fa4_fp8_exact_noexp", {"softmax_mode": "exact", "exp2_deleted": True}),
        ("fa4_fp8_exact_noexp_n192", {"softmax_mode": "exact", "exp2_deleted": True, "tile_n": 192}),
        # At the defaults' structure: the probe takes tile_m, tile_n, the overlap and the grid from Note [Tuned
        # defaults] (fp8_sm90.tuned_stage), the row sum and O's store are passed; at head dim 128 both modes' defaults.
        (
            "fa4_fp8_exact_noexp_defaults",
            {"softmax_mode": "exact", "exp2_deleted": True, "row_sum": "mma", "o_store": "head_dim"},
        ),
        (
            "fa4_fp8_exact_noexp_defaults_per_tile",
            {
                "softmax_mode": "exact",
                "exp2_deleted": True,
                "row_sum": "mma",
                "o_store": "head_dim",
                "persistent": False,
            },
        ),
        (
            "fa4_fp8_exact_noexp_two_level",
            {"softmax_mode": "exact", "exp2_deleted": True, "pv_accumulation": "two_level"},
        ),
        (
            "fa4_fp8_exact_noexp_mma_n224_nooverlap",
            {"softmax_mode": "exact", "exp2_deleted": True, "row_sum": "mma", "tile_n": 224, "intra_wg_overlap": False},
        ),
        (
            "fa4_fp8_exact_noexp_mma_n256_nooverlap",
            {"softmax_mode": "exact", "exp2_deleted": True, "row_sum": "mma", "tile_n": 256, "intra_wg_overlap": False},
        ),
        *(
            (f"fa4_fp8_exact_noexp_mma_m192_n128{suffix}", {**FP8_PROBE_M192, **extra})
            for suffix, extra in (
                ("", {}),
                ("_sb", {"scheduler_barrier": True}),
                ("_sb_arrive", {"scheduler_barrier": True, "arrive_after_pv": True}),
                ("_s4", {"kv_stages": 4}),
            )
        ),
        (
            "fa4_fp8_exact_noexp_mma_n224_nooverlap_arrive",
            {
                "softmax_mode": "exact",
                "exp2_deleted": True,
                "row_sum": "mma",
                "tile_n": 224,
                "intra_wg_overlap": False,
                "arrive_after_pv": True,
            },
        ),
    ):
        # wrong values by design: the no-MUFU ceiling of the skeleton
        specs.append(
            KernelSpec(
                name,
                "fa4_fp8",
                "exact",
                tuple(probe.items()),
                fp8_exact_tol,
                _fp8_sm90_loader(probe),
                _fp8_sm90_binder(probe),
                fp8_sm90,
                checked=False,
            )
        )
    return specs


def h15_map_name(threshold: float, beta: float) -> str:
    return f"fa4_h15_t{threshold:g}_b{beta:g}"


KERNELS: dict[str, KernelSpec] = _build_table()
MAP_KERNELS = tuple(h15_map_name(t, b) for t in H15_THRESHOLDS for b in H15_BETAS)
# Opt-in rows (`--kernels 'aiter_mxfp8_*'`): one format is enough, the dot mode's cost is format-independent.
DOT_MODE_KERNELS = tuple(f"aiter_mxfp8_{mode}" for mode in AITER_DOT_MODE_VARIANTS)
FP8_MAP_KERNELS = tuple(
    fp8_h15_map_name(t, a, n) for t in FP8_H15_THRESHOLDS for a in FP8_ANCHOR_ROUNDINGS for n in FP8_TILE_NS
)
FP8_LEVER_KERNELS = tuple(FP8_LEVERS)
# The --fp8 preset's rows (issue 22; FP8 groups only; the map and levers at the focus shape on request): the FP8
# GEMM ceiling, the FP8 peers (FA3, cuDNN, vLLM's two-level FA3), our kernel through flash_attn_func (its defaults)
# and through its direct call with each P.V accumulation, the exp2-deleted cost probe under two-level accumulation,
# FA4 stock and FA3 on the inputs upcast to BF16.
FP8_KERNELS = (
    "gemm_fp8",
    "fa3_fp8",
    "cudnn_fp8",
    "vllm_fa3_fp8",
    *FP8_FUNC_VARIANTS,
    *(fp8_accumulation_name(m, a) for m in ("exact", "rowmax_h15") for a in FP8_PV_ACCUMULATIONS),
    "fa4_fp8_exact_noexp_two_level",
    *FP8_CANDIDATES,
    "fa4_fp8_exact_noexp_mma_n224_nooverlap",
    "fa4_fp8_exact_noexp_mma_n256_nooverlap",
    "fa4_stock_bf16",
    "fa3_bf16",
)
# FP8-only rows (every entry taking FP8 inputs only, and FA4 stock on upcast FP8) stay out of the 16-bit groups;
# fa3_bf16 is a BF16 peer everywhere.
_FP8_ONLY = tuple(name for name, spec in KERNELS.items() if set(spec.tolerances) == {"fp8"}) + ("fa4_stock_bf16",)
DEFAULT_KERNELS = tuple(name for name in KERNELS if name not in MAP_KERNELS + DOT_MODE_KERNELS + _FP8_ONLY)
QUICK_KERNELS = (BASELINE, "fa4_h15", "aiter_mxfp8", "sdpa_cudnn")
