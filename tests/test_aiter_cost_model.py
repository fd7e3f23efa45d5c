"""aiter_fused.cost_model (a model, not a measurement): its arithmetic on fixed counts, and the H200 validation
table (docs/aiter_cost_model.md) reproduced from the committed inputs, with its verdict (it does not validate)."""

import json
from pathlib import Path

import pytest

from aiter_fused import cost_model

DATA = Path(__file__).resolve().parents[1] / "bench" / "results" / "aiter_cost_model"
# The exact twin at the table's sm90 entry, non-causal (bench/results/aiter_cost_model/sm90_counts.json).
TWIN = dict(
    launch=dict(block_m=128, num_warps=8, tile_n=128),
    loop={"HGMMA.64x128x16.F32.BF16": 16},
    loop_instructions=598,
    registers=246,
    shared_bytes=229376,
)


def test_tile_flops_count_each_warpgroup_once():
    # 16 m64n128k16 per warp = QK^T and P@V of one warpgroup's 64 rows; two warpgroups: 4 * 128^3.
    assert cost_model.tile_flops(TWIN["loop"], 8) == {"BF16": 4 * 128**3}
    assert cost_model.tile_flops({"QGMMA.64x32x32.F32.E4M3.E4M3": 16, "FFMA": 7}, 4) == {"E4M3": 2 * 64 * 32 * 32 * 16}


def test_programs_per_sm():
    assert cost_model.programs_per_sm(246, 8, 229376) == 1  # 224 KB of shared memory
    assert cost_model.programs_per_sm(255, 4, 114688) == 2  # 112 KB each, 256 x 128 registers each
    assert cost_model.programs_per_sm(255, 4, 61696) == 2  # registers bind before shared memory (3)
    assert cost_model.programs_per_sm(32, 4, 0) == 16  # warps bind


def test_tile_cycles_and_prediction_by_hand():
    tensor, issue = 4 * 128**3 / 3023, 598 * 2
    parts = cost_model.tile_cycles(TWIN)
    assert parts["tensor"] == pytest.approx(tensor) and parts["issue"] == issue and parts["programs"] == 1
    assert parts["cycles"] == pytest.approx(tensor + issue)  # one program: serial
    assert cost_model.tile_cycles(TWIN, rule="overlap")["cycles"] == pytest.approx(tensor)
    two = dict(TWIN, launch=dict(block_m=64, num_warps=4, tile_n=128), shared_bytes=100_000, registers=128)
    assert cost_model.tile_cycles(two)["cycles"] == pytest.approx(max(tensor / 2, 598, (tensor / 2 + 598) / 2))
    assert cost_model.kv_tiles(8192, False, 128, 128, 4, 16) == 64 * 64 * 64
    assert cost_model.kv_tiles(8192, True, 128, 128, 4, 16) == 64 * 65 // 2 * 64
    assert cost_model.kv_tiles(8192, True, 128, 64, 1, 1) == sum(2 * i for i in range(1, 65))
    point = dict(seqlen=8192, causal=False, batch=4, heads=16)
    assert cost_model.predict(TWIN, point) == pytest.approx(64**3 / 132 * (tensor + issue) / 1.98e9 * 1e3)
    with pytest.raises(ValueError):
        cost_model.tile_cycles(TWIN, rule="sum")


def test_h200_validation_table_and_verdict():
    counts = json.loads((DATA / "sm90_counts.json").read_text())["records"]
    measured = json.loads((DATA / "measured_h200.json").read_text())
    committed = json.loads((DATA / "validation_h200.json").read_text())["results"]
    for result in committed:
        machine = {m.name: m for m in (cost_model.H200, cost_model.H200_DATASHEET)}[result["machine"]]
        again = cost_model.validate(counts, measured, machine, result["rule"])
        assert again == result
    primary = committed[0]
    assert (primary["machine"], primary["rule"]) == (cost_model.H200.name, "serial")
    summary = primary["summary"]
    assert summary["points"] == 52 and not summary["validated"]
    assert summary["checks"]["beat_constant"] and not summary["checks"]["median_abs_error"]
    # Every prediction is optimistic: the softmax never issues at one instruction per clock.
    assert all(row["error"] < 0 for row in primary["rows"])
