"""Host entry of the SM90 (Hopper) FP8 forward: validate, V^T pre-pass, compile (cached), launch.

    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90
    out, lse = flash_attn_fp8_sm90(q8, k8, v8, causal=True, softmax_mode="rowmax_h15",
                                   q_descale=d, k_descale=d, v_descale=d)

q, k, v: torch.float8_e4m3fn (batch, seqlen, heads, head_dim), head_dim 64 or 128, heads_q a multiple of
heads_kv (GQA), last dimension contiguous. Returns BF16 out (batch, seqlen_q, heads_q, head_dim) and fp32
lse (batch, heads_q, seqlen_q), natural log, of the logits softmax_scale * q_descale * k_descale * q.k.
Causal masking is bottom-right aligned (FA4's), per sequence. Forward only.

Varlen (FA4's `flash_attn_varlen_func` layout): q (total_q, heads, head_dim), k, v (total_k, heads_kv, head_dim)
with int32 cu_seqlens_q / cu_seqlens_k (batch + 1), optionally int32 seqused_q / seqused_k (batch); out
(total_q, heads_q, head_dim), lse (heads_q, total_q). The pre-pass gives each sequence its own V^T range (Note
[Varlen V^T], stage/v_transpose.py).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fa4_rowmax.aux_data import NO_AUX_DATA
from fa4_rowmax.config import FP8_TILE_M3_TILE_NS, check_real
from fa4_rowmax.interface import FP8_SM90_VARLEN_ARGS, STAGE_KNOBS, SoftmaxStage, softmax_stage
from fa4_rowmax.source_digest import source_digest
from fa4_rowmax.stage.flash_fwd_sm90_fp8 import o_store_overrun
from fa4_rowmax.stage.softmax_sm90_fp8 import ROW_SUM_COLUMNS
from fa4_rowmax.stage.tile_scheduler_sm90 import semaphore_numel

HEAD_DIMS = (64, 128)
# Note [MMA row sum at long rows]
# With row_sum="mma" the row sum is a column of the PV GEMM, summed in Hopper's FP8 accumulator, which keeps
# about 13 fraction bits and truncates (Note [Row sum by the MMA]). With pv_accumulation="single" the running
# sum is the accumulator's C operand: over L keys the sum of positive weights loses up to ceil(L / 32) * 34 *
# 2^-13 of itself, a worst case that grows with L. On the H200 the shared benchmark's gate failed it at 8K keys
# non-causal (output error 0.15 exact / 0.25 H15 against fp32 attention, 0.32 at 16K), while the GPU tests, whose
# bounds carry that accumulation term, pass it up to 2,048 keys; so single-level refuses it beyond that length.
# With pv_accumulation="two_level" the truncation acts on one tile's sum and the tiles add in fp32 (Note
# [Two-level P.V accumulation]): no length limit.
MMA_ROW_SUM_MAX_KEYS = 2048  # multiples of 32: the e4m3 wgmma K
# FA4's varlen arguments this forward takes (with cu_seqlens_q and cu_seqlens_k; Note [Varlen host checks]).
VARLEN_ARGS = FP8_SM90_VARLEN_ARGS


@dataclass(frozen=True)
class KernelConfig:
    """One compiled kernel: every field joins the compile-cache key."""

    head_dim: int
    qhead_per_kvhead: int
    causal: bool
    stage: SoftmaxStage  # resolved for the SM90 FP8 forward (SoftmaxStage.for_kernel)
    varlen: bool = False  # q, k, v packed, with cu_seqlens_q / cu_seqlens_k
    seqused_q: bool = False
    seqused_k: bool = False
    persistent_ctas: int = 0  # with stage.persistent, the grid size, the SM count (Note [Persistent work tiles])

    @property
    def tile_n(self) -> int:
        return self.stage.tile_n

    @property
    def tile_m(self) -> int:
        return self.stage.tile_m

    @property
    def num_stages(self) -> int:
        return self.stage.kv_stages

    @property
    def pack_gqa(self) -> bool:
        return packs_gqa(self.qhead_per_kvhead, self.tile_m)


def packs_gqa(qhead_per_kvhead: int, tile_m: int) -> bool:
    """Note [GQA packing on FP8]: the Q heads of one KV head share its K/V tiles in one Q tile (tile_m rows) when the
    ratio divides tile_m (FA4 then loads the packed Q by TMA); other ratios (Qwen2.5's 7; its 6 at tile_m 128) run one
    Q head per work tile, K/V head = Q head // ratio, as FA4 does without packing. Values are the same."""
    return qhead_per_kvhead > 1 and tile_m % qhead_per_kvhead == 0


# Note [Tuned defaults]
# ~~~~~~~~~~~~~~~~~~~~~
# The knobs a call leaves unset take the configuration the shared benchmark measured fastest on the H200 among
# two-level ones (every candidate passed the benchmark's gate, and two-level accumulation holds the long-row
# accuracy contract: tests/test_fp8_sm90_long_rows.py), per softmax mode, head dim and mask: the geometric mean
# of the speed-up over FA3-FP8 across the lengths, MHA and GQA (`python -m bench --fp8`; head dim 64 and tile 128
# to 224 from 2K-32K, bench/results/h200_2026-12-02_s6/bench_fp8/; tile 256 and the scheduler hand-over from
# 8K-32K, bench/results/h200_2026-12-02_s8/; three consumer warpgroups at 8K-32K, bench/results/h200_2026-12-03_s12/;
# the round-robin barrier, bench/results/h200_2026-12-03_s13/; O's store and each tiling's entry at 2K-32K, two runs,
# bench/results/h200_2026-12-03_s14/).
# - Every entry takes the MMA row sum and stores O's head_dim columns alone (o_store="head_dim", Note [O's tile
#   without the row-sum columns]): 8-21 % faster than storing the row-sum columns too at 2K keys, -2 to +5 % at 32K
#   (a fixed cost per call: the fitted intercept falls by 0.03-0.14 ms, the per-key rate stays within 3 %).
# - Rowmax-H15 takes the clamp by saturation (same values as the FMNMX clamp). Two consumer warpgroups: at head dim
#   128 at tile 256 without intra-warpgroup overlap (without overlap S and the second accumulator are never live
#   together, so the largest wgmma N fits: Note [Two-level P.V accumulation]), at head dim 64 at tile 192 with
#   overlap. At head dim 128 non-causal three consumer warpgroups at tile 160 (tile_m 192, Note [Three consumer
#   warpgroups]) ran up to 2 % ahead of two on FA4's grid; two on the persistent grid with each warpgroup's own
#   boundary are ahead now (below), and three stay where GQA packs the tile (Note [Packed tiles without the own
#   boundary]).
# - The exact twin, bound by the MUFU: three warpgroups at tile 160 at head dim 128 non-causal; two at tile 256
#   without overlap at head dim 128 causal; at head dim 64 three at tile 160 under FA4's round-robin scheduler
#   barrier (3-16 % over no barrier there: the round-robin staggers the warpgroups' exponentials).
# - Causal calls whose GQA packs a 192-row tile to few positions take three warpgroups (Note [Causal tiles that
#   pack GQA]).
# - The persistent grid (`persistent=True`, Note [Persistent work tiles]) where two H200 runs at 2K-32K measured it
#   ahead by that mean (bench/results/h200_2026-12-04_s16/ and _s17/; the GPU suite and the long-row contract pass
#   with it in every entry, _s17/persistent_defaults_gpu_tests/): the exact twin's default tilings (+0-11 %: its
#   fixed cost per work tile goes), H15 at head dim 128 causal with two warpgroups (+1-13 %, the most at 2K) and
#   non-causal with three (+1 %: -1 to -4 % with 16 KV heads at 16K-32K, +2-4 % with 4), H15 at head dim 64 causal
#   (+0-12 %). Not H15 at head dim 128 causal with three warpgroups (the GQA tiling: +6 % at 2K, -1 to -5 % from 8K)
#   nor at head dim 64 non-causal (-1 to -4 % from 8K): more cycles at the GEMM waits, not a lower clock (_s18/),
#   the cause not isolated (not the tile order: FA4's own non-causal order lost the same, _s19/). An entry that
#   takes it yields to the caller's knobs where they leave no room for O's own tile, and varlen calls run FA4's
#   varlen scheduler.
# - Each warpgroup's own tile boundary (`warpgroup_epilogue="own"`, Note [Each warpgroup's own tile boundary]) in
#   H15's head dim 128 causal entry at tile_m 128, the goal cell of issue 22: one H200 run at 4K-16K with 16/16 heads
#   (bench/results/h200_2026-12-05_s21/next/) measured it +2.2 % at 4K, +1.6 % at 8K and +0.8 % at 16K over the
#   shared boundary (1.15x, 1.18x, 1.19x FA3-FP8), the prediction's low edge; through flash_attn_func at 8K a second
#   run gave 1.16x (bench/results/h200_2026-12-05_s21/defaults_own/, where the long-row contract passed with it). It
#   yields to packed GQA (16/4 heads at tile_m 128), varlen and the caller's overlap. Three H200 runs at 2K-32K
#   (bench/results/h200_2026-12-05_s22/, the earlier entries' knobs as rows in the same rounds) took it into two
#   more entries at 16/16 heads: H15 at head dim 128 non-causal at tile_m 128 on the persistent grid in place of
#   three warpgroups (+5-6 % at 2K-4K, +0.3-1.9 % at 8K, +3.7-4.8 % at 16K, -1.0 to +0.5 % at 32K), and the exact
#   twin's head dim 128 causal entry (+6.4-6.6 % at 2K, +2.4-3.0 % at 4K, +0.7-1.3 % at 8K, -1.6 to +0.2 % at 16K,
#   -0.2 to +2.9 % at 32K). Not at three warpgroups (it ran +0.1 % at 4K, +1.2 % at 8K and -2.0 % at 16K
#   non-causal). The masked half of the first KV tile (`masked_half="skip"`) is in no entry: it ran 0.1-1.4 % behind
#   computing it at 4K-16K.
# TUNED_DEFAULTS holds both tilings per key, TUNED_TILE_M the faster for one head per Q tile. A call whose own knobs
# exclude three warpgroups (tile_n past 160, intra_wg_overlap=True, arrive_after_pv=True) gets the two-warpgroup
# entry; a call that passes tile_m gets that tile_m's entry, one that passes scheduler_barrier=True the
# three-warpgroup one, and one that passes kv_stages the faster entry whose shared memory holds them.
# Both keep FA4's scheduler hand-over (`arrive_after_pv` pays only where the softmax fits beside one GEMM: Note
# [Scheduler window after the P.V GEMM]). A knob the caller passes wins, the table applies only to two-level
# accumulation (a single-level call keeps config.STAGE_KNOBS' defaults), and the clamp only with the exact anchor
# (clamp="sat" requires it).
_H15_M192 = dict(clamp="sat", row_sum="mma", tile_n=160, intra_wg_overlap=False, o_store="head_dim")
_H15_M128 = dict(clamp="sat", row_sum="mma", tile_n=256, intra_wg_overlap=False, o_store="head_dim")
_H15_D64_M128 = dict(clamp="sat", row_sum="mma", tile_n=192, o_store="head_dim")
_EXACT_M128 = dict(row_sum="mma", tile_n=256, intra_wg_overlap=False, o_store="head_dim")
_EXACT_M192 = dict(row_sum="mma", tile_n=160, intra_wg_overlap=False, o_store="head_dim", persistent=True)
_EXACT_M192_ROUND_ROBIN = dict(_EXACT_M192, scheduler_barrier=True)
TUNED_DEFAULTS = {  # (mode, head_dim, causal) -> {tile_m: the knobs at that tile_m}
    ("rowmax_h15", 128, False): {
        192: dict(_H15_M192, persistent=True),
        128: dict(_H15_M128, persistent=True, warpgroup_epilogue="own"),
    },
    ("rowmax_h15", 128, True): {192: _H15_M192, 128: dict(_H15_M128, persistent=True, warpgroup_epilogue="own")},
    ("rowmax_h15", 64, False): {192: _H15_M192, 128: _H15_D64_M128},
    ("rowmax_h15", 64, True): {192: dict(_H15_M192, persistent=True), 128: dict(_H15_D64_M128, persistent=True)},
    ("exact", 128, False): {192: _EXACT_M192, 128: _EXACT_M128},
    ("exact", 128, True): {192: _EXACT_M192, 128: dict(_EXACT_M128, persistent=True, warpgroup_epilogue="own")},
    ("exact", 64, False): {
        192: _EXACT_M192_ROUND_ROBIN,
        128: dict(row_sum="mma", tile_n=192, intra_wg_overlap=False, o_store="head_dim"),
    },
    ("exact", 64, True): {192: _EXACT_M192_ROUND_ROBIN, 128: {}},
}
TUNED_TILE_M = {
    ("rowmax_h15", 128, False): 128,
    ("rowmax_h15", 128, True): 128,
    ("rowmax_h15", 64, False): 128,
    ("rowmax_h15", 64, True): 128,
    ("exact", 128, False): 192,
    ("exact", 128, True): 128,
    ("exact", 64, False): 192,
    ("exact", 64, True): 192,
}


# Note [Causal tiles that pack GQA]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# TUNED_TILE_M is the faster tiling where a Q tile holds one head's consecutive positions. Under a causal mask a
# call whose Q heads per KV head pack a 192-row tile (Note [GQA packing on FP8]) to at most 64 positions (ratio 3,
# 4, 6, 8, ...) takes three consumer warpgroups at every head dim: on the H200, two runs at 2K-32K with 16/4 heads
# (bench/results/h200_2026-12-03_s14/tuned_tile_m/), tile_m 192 ran H15 1.07-1.16x FA3-FP8 against tile_m 128's
# 0.98-1.12x at head dim 128 and the exact twin 0.96-1.05x against 0.89-1.01x, while with 16/16 heads tile_m 128
# stays ahead (H15 1.04x against 0.99x at 4K). A reading, not measured apart: a packed tile's rows sit at
# 192/ratio positions, so fewer of its KV tiles cross the diagonal (masked, partly wasted: (positions + tile_n) /
# tile_n of them, 2.2 at 192 unpacked positions and tile 160, 1.3 at 48) and three warpgroups keep their per-key
# lead. Through flash_attn_func under the rule (bench/results/h200_2026-12-04_s15/, two runs) H15 ran 1.07-1.17x and
# the exact twin 0.96-1.04x at 16/4 heads, head dim 128, and every FP8 GPU test passed. Ratios 2 (96 positions) and
# those that do not divide 192 (Qwen2.5-0.5B's 7) keep TUNED_TILE_M; only ratio 4 is measured. Not H15 at head dim
# 128: since its tile_m 128 entry runs the persistent grid (Note [Persistent work tiles]) that entry is ahead at 16/4
# heads, in two runs (bench/results/h200_2026-12-04_s18/tuned_tile_m*/) 1.12-1.14x FA3-FP8 against tile_m 192's
# 1.06-1.11x at 2K-4K, 1.16-1.17x against 1.15-1.17x at 8K-16K, and within 2 % either way at 32K (1.17-1.18x against
# 1.17-1.19x); tile_m 192 on the persistent grid loses 1-5 % per key (the seventeenth session) and stays on FA4's.
PACKED_CAUSAL_MAX_POSITIONS = 64
PACKED_CAUSAL_KEYS = frozenset(
    key for key in TUNED_TILE_M if key[2] and key != ("rowmax_h15", 128, True)
)  # the (mode, head_dim, causal) keys the rule applies to


# Note [Packed tiles without the own boundary]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# H15 at head dim 128 non-causal takes tile_m 128 for what each warpgroup's own tile boundary buys it (Note [Tuned
# defaults]); a call whose GQA packs that tile (ratio 2, 4, 8, ...) cannot have the own boundary (Note [Each
# warpgroup's own tile boundary]), and on the shared one three warpgroups stay ahead: with 16/4 heads, three H200
# runs at 2K-32K (bench/results/h200_2026-12-05_s22/), tile_m 128 ran 0.2-2.6 % behind tile_m 192 in 14 of 15 cells
# (median -0.9 %). Such calls keep tile_m 192; ratios that do not divide 128 (Qwen2.5-1.5B's 6) run unpacked and
# take the own boundary at tile_m 128.
PACKED_TILE_M = {("rowmax_h15", 128, False): 192}  # key -> tile_m where the call packs TUNED_TILE_M's tile


def faster_tile_m(key, qhead_per_kvhead: int = 1) -> int:
    """The tiling Note [Tuned defaults] gives a call of this (mode, head_dim, causal) and GQA ratio when no knob
    decides it (Note [Causal tiles that pack GQA], Note [Packed tiles without the own boundary])."""
    ratio = qhead_per_kvhead
    if key in PACKED_CAUSAL_KEYS and ratio > 1 and 192 % ratio == 0 and 192 // ratio <= PACKED_CAUSAL_MAX_POSITIONS:
        return 192
    if key in PACKED_TILE_M and packs_gqa(ratio, TUNED_TILE_M[key]):
        return PACKED_TILE_M[key]
    return TUNED_TILE_M[key]


def _admits_three_warpgroups(stage: SoftmaxStage, explicit) -> bool:
    """Whether the knobs the caller passed leave tile_m=192 possible (interface._check_three_warpgroups); a masked
    half skipped without a tile_n takes two warpgroups, whose entries' tiles are whole k32 half-steps (the
    three-warpgroup entries' 160 is not)."""
    return (
        ("tile_n" not in explicit or stage.tile_n in FP8_TILE_M3_TILE_NS)
        and ("intra_wg_overlap" not in explicit or not stage.intra_wg_overlap)
        and ("arrive_after_pv" not in explicit or not stage.arrive_after_pv or stage.scheduler_barrier)
        and ("masked_half" not in explicit or stage.masked_half != "skip" or "tile_n" in explicit)
    )


def tuned_knobs(stage: SoftmaxStage, head_dim: int, causal: bool, explicit, qhead_per_kvhead: int = 1) -> dict:
    """Note [Tuned defaults] for the knobs not named in `explicit` (the knobs the caller passed), tile_m included."""
    key = (stage.mode, head_dim, causal)
    if key not in TUNED_DEFAULTS:  # refused later, by name (SoftmaxStage.for_kernel, the head-dim check)
        return {}
    own_boundary = "warpgroup_epilogue" in explicit and stage.warpgroup_epilogue == "own"
    if "tile_m" in explicit:
        tile_m = stage.tile_m
    elif "scheduler_barrier" in explicit and stage.scheduler_barrier:  # a three-warpgroup knob
        if not _admits_three_warpgroups(stage, explicit):
            passed = ", ".join(f"{k}={getattr(stage, k)!r}" for k in ("tile_n", "intra_wg_overlap") if k in explicit)
            raise ValueError(
                "scheduler_barrier=True runs three consumer warpgroups (tile_m=192), which take tile_n in "
                f"{FP8_TILE_M3_TILE_NS} and intra_wg_overlap=False (Note [Three consumer warpgroups]); got "
                f"{passed}. Accepted: scheduler_barrier=True with tile_n in {FP8_TILE_M3_TILE_NS} and "
                "intra_wg_overlap=False, or scheduler_barrier=False"
            )
        tile_m = 192
    elif not _admits_three_warpgroups(stage, explicit):
        tile_m = 128
    else:
        faster = faster_tile_m(key, qhead_per_kvhead)
        tile_m = faster
        other = 128 if faster == 192 else 192
        if "kv_stages" in explicit and not _fits(stage, head_dim, faster, explicit, key):
            tile_m = other if _fits(stage, head_dim, other, explicit, key) else faster
        elif own_boundary and packs_gqa(qhead_per_kvhead, faster) and not packs_gqa(qhead_per_kvhead, other):
            tile_m = other  # Note [Each warpgroup's own tile boundary]: unpacked heads only
    entry = {"tile_m": tile_m, **TUNED_DEFAULTS[key][tile_m]}
    # The masked half and the own boundary, passed, take the step without overlap; the own boundary the persistent
    # grid (interface.SoftmaxStage refuses them otherwise).
    if own_boundary or ("masked_half" in explicit and stage.masked_half == "skip"):
        entry["intra_wg_overlap"] = False
    if own_boundary:
        entry["persistent"] = True
    return {k: v for k, v in entry.items() if k not in explicit}


def _fits(stage: SoftmaxStage, head_dim: int, tile_m: int, explicit, key) -> bool:
    """Whether the caller's kv_stages fit beside the tile_m entry of Note [Tuned defaults] (the caller's own tile_n
    and row_sum kept)."""
    entry = {"tile_n": stage.tile_n, "row_sum": stage.row_sum, **TUNED_DEFAULTS[key][tile_m]}
    for knob in ("tile_n", "row_sum"):
        if knob in explicit:
            entry[knob] = getattr(stage, knob)
    need = shared_memory_bytes(
        head_dim, tile_m, entry["tile_n"], stage.kv_stages, entry["row_sum"], stage.o_store, stage.persistent
    )
    return need <= SMEM_PER_BLOCK


def tuned_stage(stage: SoftmaxStage, head_dim: int, causal: bool, explicit, qhead_per_kvhead: int = 1) -> SoftmaxStage:
    """`stage` with Note [Tuned defaults] in every knob not named in `explicit` (the knobs the caller passed), for a
    call with `qhead_per_kvhead` Q heads per KV head."""
    if stage.pv_accumulation != "two_level":
        return stage
    tuned = tuned_knobs(stage, head_dim, causal, explicit, qhead_per_kvhead)
    if stage.anchor_rounding != "exact":
        tuned.pop("clamp", None)
    if stage.exp2_deleted:  # the probe takes the defaults' structure, not their softmax
        tuned = {k: v for k, v in tuned.items() if k in ("tile_m", "tile_n", "intra_wg_overlap", "persistent")}
    tuned_stage = replace(stage, **tuned)
    if tuned.get("persistent") and not _admits_persistent(tuned_stage, head_dim):
        tuned_stage = replace(tuned_stage, persistent=False)
    # An entry's masked half or own boundary yields where the call's other knobs leave it unbuilt (they are refused
    # when passed), as the persistent grid does.
    if tuned.get("masked_half") == "skip" and not _admits_masked_half(tuned_stage):
        tuned_stage = replace(tuned_stage, masked_half="compute")
    if tuned.get("warpgroup_epilogue") == "own" and not _admits_own_boundary(tuned_stage, qhead_per_kvhead):
        tuned_stage = replace(tuned_stage, warpgroup_epilogue="shared")
    return tuned_stage


def _admits_masked_half(stage: SoftmaxStage) -> bool:
    """Whether Note [The masked half of the first KV tile] is built for these knobs (interface.SoftmaxStage refuses
    it otherwise)."""
    return stage.pv_accumulation == "two_level" and not stage.intra_wg_overlap and (stage.tile_n // 2) % 32 == 0


def _admits_own_boundary(stage: SoftmaxStage, qhead_per_kvhead: int) -> bool:
    """Whether Note [Each warpgroup's own tile boundary] is built for these knobs and this GQA ratio."""
    o_at_head_dim = stage.o_store == "head_dim" or stage.row_sum == "fadd"
    return (
        stage.persistent
        and not stage.intra_wg_overlap
        and o_at_head_dim
        and not packs_gqa(qhead_per_kvhead, stage.tile_m)
    )


def _admits_persistent(stage: SoftmaxStage, head_dim: int) -> bool:
    """Whether the caller's knobs leave a tuned persistent grid possible (Note [Persistent work tiles]): room for O's
    own tile beside their kv_stages."""
    knobs = dict(row_sum=stage.row_sum, o_store=stage.o_store, persistent=True)
    return shared_memory_bytes(head_dim, stage.tile_m, stage.tile_n, stage.kv_stages, **knobs) <= SMEM_PER_BLOCK


def call_stage(
    softmax_mode: str,
    head_dim: int,
    causal: bool,
    rescale_threshold=None,
    beta=None,
    qhead_per_kvhead: int = 1,
    **knobs,
):
    """The unresolved stage `flash_attn_fp8_sm90(..., softmax_mode, rescale_threshold, beta, **knobs)` compiles for
    this head dim, mask and GQA ratio: the caller's knobs, Note [Tuned defaults] for the rest (for the reference's
    configs and the tests)."""
    stage = softmax_stage(softmax_mode, rescale_threshold, beta, **knobs) or SoftmaxStage()
    return tuned_stage(stage, head_dim, causal, frozenset(knobs), qhead_per_kvhead)


_LAYOUTS = {4: "(batch, seqlen, heads, head_dim)", 3: "(total, heads, head_dim) with cu_seqlens (varlen)"}


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.float8_e5m2:
        raise ValueError(
            f"{name} must be torch.float8_e4m3fn: e5m2 inputs are not implemented on the SM90 FP8 path "
            "(docs/fp8_sm90.md, 'e5m2 inputs'), got torch.float8_e5m2"
        )
    if t.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} must be torch.float8_e4m3fn, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {_LAYOUTS[ndim]}, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def _check_descale(name: str, d, batch: int, heads_kv: int, device) -> torch.Tensor | None:
    if d is None:
        return None
    if not isinstance(d, torch.Tensor) or d.dtype != torch.float32 or tuple(d.shape) != (batch, heads_kv):
        got = f"{d.dtype} {tuple(d.shape)}" if isinstance(d, torch.Tensor) else type(d).__name__
        raise ValueError(
            f"{name} must be None or a torch.float32 tensor of shape (batch, heads_kv) = "
            f"({batch}, {heads_kv}), got {got}"
        )
    if d.device != device:
        raise ValueError(f"{name} must be on {device}, got {d.device}")
    return d.contiguous()


# Note [Varlen host checks]
# The varlen layout needs cu_seqlens_q and cu_seqlens_k together (seqused_q / seqused_k only with them; dense
# calls with seqused or one packed side have no GPU test here, so they are refused). Shapes, dtypes and devices
# are checked for free. The offsets' contents (start at 0, never decrease, end at q's / k's token count;
# 0 <= seqused <= the sequence's length) are checked with `validate=True`, by one host read of these few
# int32s: one sync per call, and no CUDA-graph capture (refused with a ValueError while capturing).
# `validate=False` skips exactly those content checks, the only host read of GPU data, so the call is
# sync-free and capturable (as aiter_fused's varlen entry); the caller then guarantees them, or the pre-pass
# and the kernel read out of bounds. Neither the kernel nor the pre-pass needs max_seqlen_q/k: FA4's varlen
# scheduler sizes its grid from total_q, the pre-pass from V^T's columns (Note [Varlen V^T]), so they are not
# arguments here (FA4's flash_attn_varlen_func takes them and does not pass them on).


def _check_index(name: str, t, length: int, device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (length,):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int32 tensor of shape ({length},), got {got}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, validate: bool) -> int:
    """The batch of a varlen call (Note [Varlen host checks]); q, k are 3-D already."""
    if not isinstance(validate, bool):
        raise ValueError(f"validate must be a bool, got {validate!r}")
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 1:
        got = tuple(cu_seqlens_q.shape) if isinstance(cu_seqlens_q, torch.Tensor) else type(cu_seqlens_q).__name__
        raise ValueError(f"cu_seqlens_q must be an int32 tensor of shape (batch + 1,), got {got}")
    batch = cu_seqlens_q.numel() - 1
    for name, t, length in (
        ("cu_seqlens_q", cu_seqlens_q, batch + 1),
        ("cu_seqlens_k", cu_seqlens_k, batch + 1),
        ("seqused_q", seqused_q, batch),
        ("seqused_k", seqused_k, batch),
    ):
        if t is not None:
            _check_index(name, t, length, q.device)
    from flash_attn.cute.testing import is_fake_mode

    if not validate or is_fake_mode():
        return batch
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            "validate=True reads cu_seqlens_q/k (and seqused_q/k) on the host, which a CUDA-graph capture cannot; "
            "accepted while capturing: validate=False (Note [Varlen host checks])"
        )
    present = [t for t in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) if t is not None]
    values = torch.cat(present).tolist()  # the one host read
    cu = {"cu_seqlens_q": values[: batch + 1], "cu_seqlens_k": values[batch + 1 : 2 * batch + 2]}
    for (name, offsets), total, side in zip(cu.items(), (q.shape[0], k.shape[0]), ("q", "k")):
        if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
            shown = offsets if len(offsets) <= 9 else [*offsets[:4], "...", *offsets[-4:]]
            raise ValueError(
                f"{name} must start at 0, never decrease and end at {side}.shape[0] = {total} "
                f"(total_{side}); got {shown}"
            )
    rest = values[2 * batch + 2 :]
    for name, used, offsets in (
        ("seqused_q", seqused_q, cu["cu_seqlens_q"]),
        ("seqused_k", seqused_k, cu["cu_seqlens_k"]),
    ):
        if used is None:
            continue
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        counts, rest = rest[:batch], rest[batch:]
        bad = [i for i, (n, length) in enumerate(zip(counts, lengths)) if not 0 <= n <= length]
        if bad:
            i = bad[0]
            raise ValueError(
                f"{name} must lie in [0, the sequence's length]; got {name}[{i}] = {counts[i]} for a sequence of "
                f"{lengths[i]} ({len(bad)} of {batch} sequences out of range)"
            )
    return batch


# Note [KV stages in shared memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The producer warp keeps `kv_stages` K tiles and as many V^T tiles in shared memory (FA4's num_stages; 2 by
# default, as FA4 and FA3 run head dim 128), so it can load ahead of the slowest consumer warpgroup: a stage is
# refilled only once every consumer warpgroup has released it, and three warpgroups (tile_m 192) drift further
# apart than two. The kernel's storage (stage/flash_fwd_sm90_fp8.py, `_get_shared_storage_cls`) is the barriers,
# the V^T stages (tile_n x head_dim_v bytes each, head_dim_v = head_dim + 8 with the MMA row sum), Q with O (BF16)
# in the same buffer, and the K stages, each buffer aligned to 1,024 bytes; one more 1,024 covers the empty P
# buffer's alignment. A configuration past the H200's 227 KiB a block is refused by name, not left to the launch.
SMEM_ALIGN = 1024
SMEM_PER_BLOCK = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on SM90 (227 KiB)


def shared_memory_bytes(
    head_dim: int,
    tile_m: int,
    tile_n: int,
    kv_stages: int,
    row_sum: str,
    o_store: str = "pv_columns",
    persistent: bool = False,
) -> int:
    """The FP8 forward's shared memory a block (Note [KV stages in shared memory]); O's tile is as wide as the P.V
    GEMM unless `o_store` is "head_dim" (Note [O's tile without the row-sum columns]), and over Q's buffer unless
    `persistent` (Note [Persistent work tiles])."""

    def aligned(n: int) -> int:
        return -(-n // SMEM_ALIGN) * SMEM_ALIGN

    head_dim_v = head_dim + (ROW_SUM_COLUMNS if row_sum == "mma" else 0)
    barriers = 8 * (2 + 4 * kv_stages)  # Q full/empty, then K and V full/empty per stage
    o_columns = head_dim if o_store == "head_dim" else head_dim_v
    q, o = tile_m * head_dim, tile_m * o_columns * 2
    q_and_o = aligned(q) + aligned(o + o_store_overrun(tile_m, o_columns) * 2) if persistent else aligned(max(q, o))
    return (
        aligned(barriers)
        + aligned(kv_stages * tile_n * head_dim_v)
        + q_and_o
        + aligned(kv_stages * tile_n * head_dim)
        + SMEM_ALIGN
    )


def check_shared_memory(stage: SoftmaxStage, head_dim: int) -> None:
    """ValueError naming kv_stages and the most that fit when this stage's buffers exceed SMEM_PER_BLOCK."""
    knobs = dict(row_sum=stage.row_sum, o_store=stage.o_store, persistent=stage.persistent)
    need = shared_memory_bytes(head_dim, stage.tile_m, stage.tile_n, stage.kv_stages, **knobs)
    if need <= SMEM_PER_BLOCK:
        return
    fitting = [
        n
        for n in STAGE_KNOBS["kv_stages"].accepted
        if shared_memory_bytes(head_dim, stage.tile_m, stage.tile_n, n, **knobs) <= SMEM_PER_BLOCK
    ]
    raise ValueError(
        f"kv_stages={stage.kv_stages} at tile_m={stage.tile_m}, tile_n={stage.tile_n}, head dim {head_dim}, "
        f"row_sum={stage.row_sum!r}{', persistent=True' if stage.persistent else ''} needs {need:,} bytes of shared "
        f"memory a block, more than the {SMEM_PER_BLOCK:,} "
        f"an SM90 block can have (Note [KV stages in shared memory]); accepted there: kv_stages in {tuple(fitting)}"
    )


# Note [Compiled kernels on disk]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A kernel compiles in 3-6 s on the H200's host, and a benchmark step compiles dozens (the nineteenth session's
# `persistent` step spent ~114 s of its 146 s compiling), each process anew. With COMPILE_CACHE_ENV naming a folder,
# compiled kernels are kept there as well, through FA4's own persistent cache (flash_attn.cute.cache_utils: CuTe's
# TVM-FFI export to an object file, loaded back with cute.runtime.load_module, an entry that fails to load compiled
# again), so later processes on that machine load them instead: scripts/h200_session.sh sets it for every step.
# The key is the package's source digest with the KernelConfig; the folder is FA4's fingerprint of its own sources
# (patched), Python, CUTLASS and TVM-FFI: a kernel from other code is never reused. Unset (CI, the default), kernels
# live in memory for the process, as before.
COMPILE_CACHE_ENV = "LOWPREC_FP8_COMPILE_CACHE"


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """SHA-256 of this package's Python sources (Note [Compiled kernels on disk])."""
    package = Path(__file__).resolve().parent
    return source_digest(str(package.parent), (package.name,), (".py",))


def _new_compile_cache():
    """In memory, or on disk under COMPILE_CACHE_ENV's folder (Note [Compiled kernels on disk])."""
    folder = os.environ.get(COMPILE_CACHE_ENV)
    if not folder:
        return {}
    from flash_attn.cute.cache_utils import JITPersistentCache, _compute_source_fingerprint

    return JITPersistentCache(Path(folder) / _compute_source_fingerprint() / "fa4_rowmax_fp8_sm90")


_compile_cache = _new_compile_cache()
FAKE_MODE_SMS = 132  # the H100/H200 SXM's SM count, for compiles without a GPU to ask


def _sm_count(device: torch.device, fake: bool) -> int:
    """A persistent grid's size (Note [Persistent work tiles]): the GPU's SM count, or the H200's without a GPU."""
    return FAKE_MODE_SMS if fake else torch.cuda.get_device_properties(device).multi_processor_count


def _aux_data(descale, semaphore):
    """FA4's aux tensors: the descales (Note [Descales]), then a persistent grid's counter and slots (Note [Dynamic
    persistent order], its last aux tensor); NO_AUX_DATA without either."""
    from flash_attn.cute.utils import AuxData

    tensors = [t for t in (descale, semaphore) if t is not None]
    return AuxData(tensors, None) if tensors else NO_AUX_DATA


def _compile(config: KernelConfig, q, k, vt, out, lse, descale, semaphore, index):
    import cutlass.cute as cute
    from flash_attn.cute.cute_dsl_utils import to_cute_tensor

    from fa4_rowmax.stage.flash_fwd_sm90_fp8 import FlashAttentionForwardSm90Fp8

    kernel = FlashAttentionForwardSm90Fp8(
        config.head_dim,
        config.qhead_per_kvhead,
        is_causal=config.causal,
        pack_gqa=config.pack_gqa,
        stage=config.stage,
        tile_m=config.tile_m,
        tile_n=config.tile_n,
        num_stages=config.num_stages,
        persistent_ctas=config.persistent_ctas,
    )
    q_t, k_t = to_cute_tensor(q), to_cute_tensor(k)
    vt_t = to_cute_tensor(vt, leading_dim=0 if config.varlen else 1)  # the key mode
    o_t = to_cute_tensor(out)
    lse_t = to_cute_tensor(lse, assumed_align=4)
    aux = _aux_data(
        to_cute_tensor(descale, assumed_align=4, leading_dim=2) if descale is not None else None,
        to_cute_tensor(semaphore, assumed_align=4, leading_dim=0) if semaphore is not None else None,
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(
        kernel,
        q_t,
        k_t,
        vt_t,
        o_t,
        lse_t,
        1.0,
        *(to_cute_tensor(t, assumed_align=4, leading_dim=0) if t is not None else None for t in index),
        None,  # page_table
        None,
        None,
        None,
        None,  # window left/right, learnable_sink, block sparsity
        aux,
        None,
        None,
        stream,
        options="--enable-tvm-ffi",
    )


def flash_attn_fp8_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    softmax_mode: str = "exact",
    rescale_threshold: float | None = None,
    beta: float | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    validate: bool = True,
    **knobs,
):
    """SM90 FP8 attention forward -> (out BF16, lse fp32).

    `beta` (exact: the share of exponentials built by FA4's polynomial off the MUFU, in [0, 1], None = 0;
    rowmax_h15: None or 1.0 only; Note [beta on the FP8 exact twin]). `knobs` (keyword-only) are the softmax-stage
    knobs of config.STAGE_KNOBS, validated by `interface.softmax_stage` and resolved by `SoftmaxStage.for_kernel`,
    as on FA4's path; measured in docs/fp8_sm90.md:
    - `anchor_rounding="half_octave"` (rowmax_h15: Note [Folded H15 on FP8]; changes values);
    - `row_sum="mma"` (Note [Row sum by the MMA]);
    - `rescale_vote=True` (with pv_accumulation="single": Note [Warp-vote rescale skip on FP8]);
    - `clamp="sat"` (rowmax_h15, exact anchor: Note [Clamp by saturation]; same values, one op less);
    - `tile_n` (keys per tile, a multiple of 32);
    - `tile_m` (query rows per tile: 128, two consumer warpgroups, or 192, three; Note [Three consumer warpgroups]
      in stage/flash_fwd_sm90_fp8.py);
    - `kv_stages` (K and V^T tiles in flight, 2-5 as shared memory allows: Note [KV stages in shared memory]);
    - `scheduler_barrier=True` (tile_m=192: FA4's round-robin scheduler barrier between the three consumer
      warpgroups; Note [Three consumer warpgroups]);
    - `persistent=True` (dense batches: one CTA per SM taking work tiles as it frees up, the next tile's loads
      under this one's last GEMM and epilogue; Note [Persistent work tiles] in stage/flash_fwd_sm90_fp8.py);
    - `pv_accumulation` ("two_level": each tile's P V in a fresh accumulator, added into fp32 O, accurate at any
      length; "single": O is the FP8 MMA's accumulator, whose truncation grows O's error with the key count;
      Note [Two-level P.V accumulation]);
    - `exp2_deleted=True`, a cost probe (exact without exp2: wrong values).

    Varlen (keyword-only, module docstring): `cu_seqlens_q`, `cu_seqlens_k` (int32, batch + 1), `seqused_q`,
    `seqused_k` (int32, batch: the rows / keys used of each sequence; rows past seqused_q are not written, as
    in FA4); `validate=False` skips the one host read that checks their contents (Note [Varlen host checks]).
    """
    if not isinstance(validate, bool):
        raise ValueError(f"validate must be a bool, got {validate!r}")
    stage = softmax_stage(softmax_mode, rescale_threshold, beta, **knobs) or SoftmaxStage()
    varlen_args = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k)
    descales = (q_descale, k_descale, v_descale)
    return _forward(q, k, v, softmax_scale, causal, stage, descales, varlen_args, validate, explicit=frozenset(knobs))


def resolve_stage(softmax_mode: str, rescale_threshold, beta, has_descale: bool = False, **knobs) -> SoftmaxStage:
    """The stage the SM90 FP8 forward compiles for these arguments, without tensors: interface.softmax_stage then
    SoftmaxStage.for_kernel, as `flash_attn_fp8_sm90` resolves it (for the reference's configs and the tests)."""
    stage = softmax_stage(softmax_mode, rescale_threshold, beta, **knobs) or SoftmaxStage()
    return replace(stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn), has_descale=has_descale)


def _check_call_arguments(softmax_scale, causal) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {causal!r} ({type(causal).__name__})")
    accepted = "None (1 / sqrt(head_dim)) or a finite number > 0"
    if softmax_scale is not None and check_real("softmax_scale", softmax_scale, 0.0, accepted=accepted) == 0.0:
        raise ValueError(f"softmax_scale must be {accepted}, got {softmax_scale!r}")


def _check_cuda(q, k, v) -> None:
    """Note [Varlen host checks]'s shapes pass on any device; the pre-pass and the kernel need the GPU."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        raise ValueError(
            f"q, k and v must be CUDA tensors (an SM90 GPU) for the SM90 FP8 forward, got {q.device}, {k.device}, "
            f"{v.device}"
        )


def _forward(
    q,
    k,
    v,
    softmax_scale,
    causal,
    stage: SoftmaxStage,
    descales_given,
    varlen_args: dict,
    validate: bool,
    features: dict | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    explicit: frozenset = frozenset(),
):
    """(out, lse) for a validated, unresolved stage: both entries (`flash_attn_fp8_sm90`, FA4's route, which adds
    FA4's other `features` and its caller's `out` / `lse`, checked here before any work and filled at the end).
    `explicit`: the knobs the caller passed; the others take Note [Tuned defaults]."""
    _check_call_arguments(softmax_scale, causal)
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = (varlen_args[name] for name in VARLEN_ARGS)
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must be given together on the SM90 FP8 path (q, k and v packed); "
            f"got cu_seqlens_q {'set' if varlen else 'None'}, cu_seqlens_k {'None' if varlen else 'set'}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3 if varlen else 4)
    if any(t.requires_grad for t in (q, k, v)):
        raise ValueError(
            "the SM90 FP8 forward is forward-only: q, k and v must not require grad (use torch.no_grad() or .detach())"
        )
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if varlen:
        (total_q, heads_q, head_dim), (total_k, heads_kv, head_dim_k) = q.shape, k.shape
        batch = _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, validate)
        if head_dim_k != head_dim:
            raise ValueError(f"k must be (total_k, heads_kv, head_dim={head_dim}), got {tuple(k.shape)}")
    else:
        for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if t is not None:
                raise ValueError(
                    f"{name} is accepted with cu_seqlens_q and cu_seqlens_k only on the SM90 FP8 path (varlen); "
                    f"got it with 4-D q, k, v (Note [Varlen host checks])"
                )
        batch, seqlen_q, heads_q, head_dim = q.shape
        batch_k, seqlen_k, heads_kv, head_dim_k = k.shape
        total_q, total_k = batch * seqlen_q, seqlen_k  # total_k: the most keys a row can see, as in varlen
        if batch_k != batch or head_dim_k != head_dim:
            raise ValueError(
                f"k must be (batch={batch}, seqlen_k, heads_kv, head_dim={head_dim}), got {tuple(k.shape)}"
            )
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} on the SM90 FP8 path, got {head_dim}")
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads of q ({heads_q}) must be a multiple of heads of k and v ({heads_kv}), both >= 1")
    if heads_q == 0:
        raise ValueError(f"heads of q must be >= 1 (a multiple of heads of k and v, {heads_kv}), got 0")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    descales = [
        _check_descale(n, d, batch, heads_kv, q.device)
        for n, d in zip(("q_descale", "k_descale", "v_descale"), descales_given)
    ]
    lse_shape = (heads_q, total_q) if varlen else (batch, heads_q, seqlen_q)
    for name, buffer, shape, dtype in (("out", out, q.shape, torch.bfloat16), ("lse", lse, lse_shape, torch.float32)):
        if buffer is not None:
            _check_caller_buffer(name, buffer, shape, dtype, q.device)
    features = dict(features or {}, **varlen_args, **dict(zip(("q_descale", "k_descale", "v_descale"), descales)))
    stage = tuned_stage(stage, head_dim, causal, explicit, heads_q // heads_kv)
    if varlen:  # Note [Persistent work tiles], [The masked half of the first KV tile]: dense batches only
        dense_only = dict(persistent=False, masked_half="compute", warpgroup_epilogue="shared")
        stage = replace(stage, **{k: v for k, v in dense_only.items() if k not in explicit})
    stage = stage.for_kernel(arch=90, q_dtype=q.dtype, features=features)
    check_shared_memory(stage, head_dim)
    if stage.warpgroup_epilogue == "own" and packs_gqa(heads_q // heads_kv, stage.tile_m):
        raise ValueError(
            "warpgroup_epilogue='own' stores each warpgroup's rows of O unpacked (Note [Each warpgroup's own tile "
            f"boundary]); got {heads_q} q heads over {heads_kv} kv heads, which tile_m={stage.tile_m} packs (Note "
            "[GQA packing on FP8]). Accepted: warpgroup_epilogue='own' with heads_q == heads_kv or a ratio that does "
            "not divide tile_m, or warpgroup_epilogue='shared'"
        )
    if stage.row_sum == "mma" and stage.pv_accumulation == "single" and total_k > MMA_ROW_SUM_MAX_KEYS:
        what = "total_k (varlen: the bound on every sequence's keys)" if varlen else "seqlen_k"
        raise ValueError(
            f"row_sum='mma' with pv_accumulation='single' is accepted for {what} <= {MMA_ROW_SUM_MAX_KEYS} only "
            f"(Note [MMA row sum at long rows]); got {what.split()[0]} {total_k}: use row_sum='fadd' or "
            "pv_accumulation='two_level'"
        )
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)

    row_sum_rows = ROW_SUM_COLUMNS if stage.row_sum == "mma" else 0
    # Note [Row sum by the MMA]: the kernel's O tile has head_dim + 8 columns; its TMA store clips the 8 row-sum
    # columns at out's last dimension, so out stays a contiguous tensor of q's shape.
    out = torch.empty(*q.shape[:-1], head_dim, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if total_q == 0 or total_k == 0:  # FA4's rule (_flash_attn_fwd): no rows, or no key for any row
        return out.zero_(), lse.fill_(-math.inf)
    _check_cuda(q, k, v)
    from flash_attn.cute.testing import is_fake_mode

    config = KernelConfig(
        head_dim=head_dim,
        qhead_per_kvhead=heads_q // heads_kv,
        causal=causal,
        stage=stage,
        varlen=varlen,
        seqused_q=seqused_q is not None,
        seqused_k=seqused_k is not None,
        persistent_ctas=_sm_count(q.device, is_fake_mode()) if stage.persistent else 0,
    )
    tile_n = stage.tile_n
    index = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    fake = is_fake_mode()
    # Note [Dynamic persistent order]: the counter and the slots; the dense pre-pass zeroes the counter (Note [The
    # counter zeroed by the pre-pass], v_transpose.py; persistent grids are dense only).
    semaphore = (
        torch.empty(semaphore_numel(config.persistent_ctas), dtype=torch.int32, device=q.device)
        if config.persistent_ctas
        else None
    )
    if fake:
        from fa4_rowmax.stage.v_transpose import padded_keys, varlen_vt_start

        rows = head_dim + row_sum_rows
        if varlen:
            columns = varlen_vt_start(total_k, batch, tile_n)
            vt = torch.empty(heads_kv, rows, columns, dtype=v.dtype, device=v.device).permute(2, 0, 1)
        else:
            keys_padded = padded_keys(seqlen_k)
            vt = torch.empty(batch, heads_kv, rows, keys_padded, dtype=v.dtype, device=v.device).permute(0, 3, 1, 2)
        descale = torch.empty(batch, heads_kv, 2, dtype=torch.float32, device=q.device) if stage.has_descale else None
    elif varlen:
        from fa4_rowmax.stage.v_transpose import v_transpose_varlen

        vt, descale = v_transpose_varlen(v, cu_seqlens_k, tile_n, *descales, row_sum_rows=row_sum_rows)
    else:
        from fa4_rowmax.stage.v_transpose import v_transpose

        vt, descale = v_transpose(v, *descales, row_sum_rows=row_sum_rows, counter=semaphore)
    key = (package_digest(), config)
    if key not in _compile_cache:
        _compile_cache[key] = _compile(config, q, k, vt, out, lse, descale, semaphore, index)
    if fake:
        return out, lse
    aux = _aux_data(descale, semaphore)
    q_u8, k_u8, vt_u8 = (t.view(torch.uint8) for t in (q, k, vt))
    _compile_cache[key](
        q_u8,
        k_u8,
        vt_u8,
        out,
        lse,
        float(softmax_scale),
        *index,
        None,
        None,
        None,
        None,
        None,
        aux,
        None,
        None,
    )
    return out, lse


def fp8_backend(softmax_mode: str = "rowmax_h15", **levers):
    """A gate backend (fa4_rowmax/gates): `(q, k, v, causal) -> (out, lse)` through `flash_attn_fp8_sm90` with
    e4m3 q, k, v, under `torch.no_grad()` (the forward refuses tensors that require grad). `levers` are
    `flash_attn_fp8_sm90`'s keywords (rescale_threshold, beta, softmax_scale, descales and config.STAGE_KNOBS);
    unknown names, modes and values raise here, not at the first call."""
    accepted = {"softmax_scale", "rescale_threshold", "beta", "q_descale", "k_descale", "v_descale", *STAGE_KNOBS}
    unknown = sorted(set(levers) - accepted)
    if unknown:
        raise TypeError(f"fp8_backend: unknown levers {unknown}; accepted: {sorted(accepted)}")
    knobs = {name: value for name, value in levers.items() if name in STAGE_KNOBS}
    stage = softmax_stage(softmax_mode, levers.get("rescale_threshold"), levers.get("beta"), **knobs) or SoftmaxStage()
    stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn)

    def backend(q, k, v, causal):
        with torch.no_grad():
            return flash_attn_fp8_sm90(q, k, v, causal=causal, softmax_mode=softmax_mode, **levers)

    return backend


def _check_caller_buffer(name: str, t, shape: tuple, dtype: torch.dtype, device) -> None:
    """A caller's `out` / `lse` on FA4's route: FA4's checks (`_validate_tensor`, `validate_output_layout`) as
    errors naming the buffer, so that the copy into it can neither broadcast nor convert."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be None or a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name} must be a {dtype} tensor of shape {tuple(shape)} on {device}, got {t.dtype} "
            f"{tuple(t.shape)} on {t.device}"
        )
    if 0 in t.stride() or (t.numel() > 1 and t.stride(-1) != 1):
        raise ValueError(
            f"{name} must have no broadcast dimension and a contiguous last dimension, got strides {t.stride()}"
        )


def fa4_sm90_fp8_forward(
    q,
    k,
    v,
    *,
    softmax_scale,
    causal,
    softmax_stage,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out=None,
    lse=None,
    features: dict | None = None,
):
    """Routing entry for FA4's `_flash_attn_fwd` on SM90 with FP8 inputs; returns its 5-tuple (out, lse, None,
    None, None). `softmax_stage` is the `fa4_rowmax.interface.SoftmaxStage` of the patched `flash_attn_func`'s
    arguments, or None (stock); `features` maps FA4 argument names to their values, each refused by
    `SoftmaxStage.for_kernel` unless stock (interface.FEATURE_STOCK_VALUES) or tested on this forward
    (interface.FP8_SM90_FEATURES_TESTED). A caller's `out` / `lse` is checked as FA4 checks it, then filled."""
    features = dict(features or {})
    varlen_args = {name: features.pop(name, None) for name in VARLEN_ARGS}
    descales = (q_descale, k_descale, v_descale)
    stage = softmax_stage or SoftmaxStage()
    result = _forward(q, k, v, softmax_scale, causal, stage, descales, varlen_args, True, features, out, lse)
    out, lse = (given.copy_(r) if given is not None else r for given, r in zip((out, lse), result))
    return out, lse, None, None, None
