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
