"""studies.fp8_sm90.ncu_report on the committed Nsight Compute report of the eleventh H200 session (8K keys)."""

from pathlib import Path

import pytest

from studies.fp8_sm90 import ncu_report

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200_2026-12-03_s11" / "ncu_8k"


@pytest.fixture(scope="module")
def splits():
    metrics = ncu_report.details(str(RESULTS / "nc8k_details.csv"))
    kernels = ncu_report.source_sections(str(RESULTS / "nc8k_source.csv.xz"))
    ids = sorted(metrics, key=int)
    assert len(ids) == len(kernels) == 7  # FA3, then (V^T pre-pass, FP8 forward) for H15, the probe, exact
    out = {}
    for report_id, kernel in zip(ids, kernels):
        if ncu_report.FP8_KERNEL in kernel["name"]:
            m = metrics[report_id]
            elapsed = ncu_report.number(m["Elapsed Cycles"])
            out[report_id] = ncu_report.loop_stretches(kernel["rows"], 132, elapsed, ncu_report.grid_size(m))
    return out


def test_the_sample_scale_checks_out(splits):
    """Note [Samples to cycles]: every loop instruction issues once an iteration, so 'selected' samples converted by
    the scale give one cycle each; the scale over-counts by at most the tail wave (4,096 CTAs over 132 SMs: 31.03
    waves counted as sequential, < 4 %) plus the sampler's granularity, so 0.9 to 1.15 cycles."""
    assert len(splits) == 3
    for split in splits.values():
        assert 0.9 <= split["issue cycles per instruction"] <= 1.15, split["issue cycles per instruction"]


def test_stretches_add_up_and_order_as_their_work(splits):
    """The stretches partition the iteration; the softmax stretch orders as the instruction counts (probe < H15) and
    the exact twin's, bound by the MUFU, is the longest; the GEMM waits are at least the GEMMs' own tensor time
    (S: 4 x 64x256x32 e4m3 wgmma at 8,192 FLOP a cycle = 512 cycles; P.V with the row-sum columns: 544)."""
    h15, probe, exact = (splits[i] for i in ("2", "4", "6"))
    for split in (h15, probe, exact):
        cycles = sum(c for _, _, c in split["stretches"].values())
        assert cycles == pytest.approx(split["iteration cycles"], rel=1e-9)
        assert split["stretches"]["S GEMM wait"][2] >= 512 and split["stretches"]["P.V GEMM wait"][2] >= 544
    softmax = [s["stretches"]["softmax"] for s in (probe, h15, exact)]
    assert softmax[0][0] < softmax[1][0] and softmax[0][2] < softmax[1][2] < softmax[2][2]


THREE_WARPGROUPS = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200_2026-12-03_s13" / "ncu_m192"


@pytest.fixture(scope="module")
def three_warpgroup_splits():
    """The thirteenth session's report at 8K keys: H15 at tile_m 128 (tile 256), at the default tile_m 192 (tile
    160), the exp2-deleted probe at tile_m 192 (tile 128); each a V^T pre-pass and a forward."""
    metrics = ncu_report.details(str(THREE_WARPGROUPS / "m192_details.csv"))
    kernels = ncu_report.source_sections(str(THREE_WARPGROUPS / "m192_source.csv.xz"))
    ids = sorted(metrics, key=int)
    assert len(ids) == len(kernels) == 6
    out = {}
    for report_id, kernel in zip(ids, kernels):
        if ncu_report.FP8_KERNEL in kernel["name"]:
            m = metrics[report_id]
            elapsed = ncu_report.number(m["Elapsed Cycles"])
            split = ncu_report.loop_stretches(kernel["rows"], 132, elapsed, ncu_report.grid_size(m))
            out[report_id] = (kernel["rows"], split)
    return out


def test_warp_state_shares_add_up_and_the_barrier_state_is_the_gemm_waits(three_warpgroup_splits):
    """Note [Warp states]: the states partition the softmax stretch's samples (every sample there is in one state
    column; only QGMMA rows, outside it, carry samples no column names); at tile_m 192, which runs no scheduler
    barrier, the kernel's 'barrier' samples sit on the WARPGROUP.DEPBAR waits for its GEMMs; at tile_m 128 FA4's
    scheduler barrier (BAR.SYNC, its samples landing on the instruction after it) takes a share of them."""
    assert len(three_warpgroup_splits) == 3
    on_gemm_waits = {}
    for report_id, (rows, split) in three_warpgroup_splits.items():
        start, end = split["bounds"]["softmax"]
        samples = sum(int(r[ncu_report.SAMPLES] or 0) for r in rows[start:end])
        assert sum(ncu_report.warp_state_counts(rows, start, end).values()) == samples > 0
        barrier = [int(r["stall_barrier"] or 0) for r in rows]
        waits = sum(n for r, n in zip(rows, barrier) if "WARPGROUP.DEPBAR" in r["Source"])
        on_gemm_waits[report_id] = waits / sum(barrier)
    assert on_gemm_waits["3"] >= 0.95 and on_gemm_waits["5"] >= 0.95, on_gemm_waits
    assert on_gemm_waits["1"] < 0.95, on_gemm_waits


def test_three_warpgroups_slow_each_warps_softmax(three_warpgroup_splits):
    """What the thirteenth session's profile shows (docs/fp8_sm90.md, Budget): at three consumer warpgroups each
    warp's H15 softmax issues at ~2/3 the rate it does at two (0.22 against 0.34 instructions a cycle), and the
    states in which a ready warp waits for its SMSP (not selected, dispatch, math pipe) take a larger share."""
    (_, two), (_, three), _ = (three_warpgroup_splits[i] for i in ("1", "3", "5"))

    def rate(split):
        instructions, _, cycles = split["stretches"]["softmax"]
        return instructions / cycles

    def contention(split):
        states = split["warp states"]["softmax"]
        return sum(states.get(s, 0.0) for s in ("not_selected", "dispatch", "math"))

    assert rate(three) < 0.8 * rate(two)
    assert contention(three) > 1.5 * contention(two)


PERSISTENT = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200_2026-12-04_s18" / "ncu_persistent"


def test_the_scale_holds_on_the_persistent_grid():
    """Note [Samples to cycles] on the eighteenth session's report (H15, head dim 128, causal GQA, three warpgroups,
    32K keys; FA4's grid, then the persistent one): both ran the same 2,732 work tiles, on grids of 2,732 and 132 CTAs,
    and with the work tiles counted from the once-a-tile executions the scale checks out on both."""
    metrics = ncu_report.details(str(PERSISTENT / "causal_gqa_details.csv"))
    kernels = ncu_report.source_sections(str(PERSISTENT / "causal_gqa_source.csv.xz"))
    ids = sorted(metrics, key=int)
    splits, grids = [], []
    for report_id, kernel in zip(ids, kernels):
        if ncu_report.FP8_KERNEL in kernel["name"]:
            m = metrics[report_id]
            tiles = ncu_report.work_tiles(kernel["rows"], m)
            assert tiles == 2732
            grids.append(ncu_report.grid_size(m))
            elapsed = ncu_report.number(m["Elapsed Cycles"])
            splits.append(ncu_report.loop_stretches(kernel["rows"], 132, elapsed, tiles))
    assert grids == [2732, 132]
    for split in splits:
        assert 0.9 <= split["issue cycles per instruction"] <= 1.15, split["issue cycles per instruction"]
