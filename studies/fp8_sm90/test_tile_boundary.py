"""studies.fp8_sm90.tile_boundary on the committed Nsight Compute reports (docs/fp8_sm90.md, Levers: each
warpgroup's own tile boundary)."""

from pathlib import Path

import pytest

from studies.fp8_sm90 import ncu_report, tile_boundary

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _boundaries(folder: str, stem: str) -> dict[str, dict]:
    metrics = ncu_report.details(str(RESULTS / folder / f"{stem}_details.csv"))
    kernels = ncu_report.source_sections(str(RESULTS / folder / f"{stem}_source.csv.xz"))
    return {
        report_id: tile_boundary.boundary(kernel["rows"], metrics[report_id])
        for report_id, kernel in zip(sorted(metrics, key=int), kernels)
        if ncu_report.FP8_KERNEL in kernel["name"]
    }


@pytest.mark.parametrize("folder, stem, report_id", [("h200_2026-12-03_s13/ncu_m192", "m192", "1"),
                                                     ("h200_2026-12-03_s11/ncu_8k", "nc8k", "2")])  # fmt: skip
def test_two_warpgroups_wait_at_every_tile_boundary(folder, stem, report_id):
    """H15 at two warpgroups, tile 256, 8K non-causal, FA4's grid (31 blocks a tile), in two sessions' reports: what
    docs/fp8_sm90.md quotes. The stretches are parts of the once-a-tile code, itself a small part of a work tile;
    the first block's wgmma waits exceed a main-loop block's (the ping-pong's restart) and the barrier waits hold
    hundreds of cycles a tile."""
    b = _boundaries(folder, stem)[report_id]
    assert b["iterations"] == pytest.approx(31, abs=0.1)
    assert b["barrier waits"] + b["first block GEMM waits"] < b["once a tile"] < 0.1 * b["tile cycles"]
    assert 500 < b["barrier waits"] < 2000
    assert 500 < b["first block GEMM waits"] - b["loop GEMM waits"] < 1500


def test_the_persistent_grid_waited_at_its_slot_barrier():
    """The eighteenth session's report (three warpgroups, 32K causal GQA; FA4's grid, then the persistent one, before
    Note [O store wait on the persistent grid]): the persistent grid's consumers waited ~1,800 cycles a tile at the
    slot barrier for the store warp's O-store wait, which FA4's grid paid at its CTA exit instead (not a barrier)."""
    per_tile, persistent = (_boundaries("h200_2026-12-04_s18/ncu_persistent", "causal_gqa")[i] for i in ("1", "4"))
    assert persistent["barrier waits"] - per_tile["barrier waits"] > 1500
