"""The H200 (sm_90a) build of aiter_fused at the launch table's sm90 entry, on the CPU.

`python -m aiter_fused.compile_sm90 --json FILE` compiles the kernel with the argument values a benchmark call
passes (Note [Compile as the runtime does] in aiter_fused/compile_sm90.py) and reads the SASS. A subprocess:
other test modules run Triton in interpreter mode. What is asserted is the structure the exact twin's speed
rests on (docs/aiter_h200.md); the numbers themselves are in the JSON.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from aiter_fused.launch import LAUNCHES

REPO = Path(__file__).resolve().parents[1]
# FA4 stock's SM90 main loop: 474 instructions per warp and 128 x 128 tile, 7.4 per score (docs/fa4_notes.md).
# At BLOCK_M 128, 8 warps, tile 128, 3 stages with tile-offset K/V addresses (kv_tile_offsets, the configuration
# this cap was derived for) the exact twin's loop is 8.27 (non-causal) / 8.56 (causal): stock's per-element ops
# (FFMA, MUFU.EX2, FMNMX, FADD, the FMUL of O, half an F2FP) plus loads, addresses and barriers. Undoing one fix
# of kernel.py's Notes gives 9.30 / 9.53 (the scale not folded), 9.34 / 9.38 (64-bit addresses per element),
# 11.94 / 13.94 (one masked loop): each crosses this bound (docs/aiter_h200.md).
EXACT_TWIN_MAX_PER_ELEMENT = 9.0
# The launch table's sm90 entry has per-element addresses (measured faster on the H200: Note [Launch table]):
# 9.34 / 9.38. Its cap keeps the masks, the fold and the split honest (without the fold 10.4, without the split
# 13+) and lets the address form's 64-bit arithmetic through.
TABLE_ENTRY_MAX_PER_ELEMENT = 9.5
H200_MAX_SHARED_BYTES = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90


def _compile(tmp_path, *arguments) -> list[dict]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    out = tmp_path / "sm90.json"
    result = subprocess.run(
        [sys.executable, "-m", "aiter_fused.compile_sm90", *arguments, "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())["records"]


def _check_exact_twin(records, max_per_element):
    assert [record["name"].split("/")[4] for record in records] == ["dense", "causal"]
    for record in records:
        assert record["mma"] == {"wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16": 32}, record["name"]
        assert record["cp_async"] > 0 and record["stack_bytes"] == 0, record
        assert record["shared_bytes"] <= H200_MAX_SHARED_BYTES, record["shared_bytes"]
        assert record["scores_per_thread"] == 64
        assert record["per_element"] <= max_per_element, (record["name"], record["loop"])
        assert record["loop"]["MUFU.EX2"] <= 66 and record["loop"].get("FSEL", 0) <= 2, record["loop"]


def test_exact_twin_runs_pipelined_wgmma_without_spills_near_fa4s_budget(tmp_path):
    """Both masks, at the sm90 entry with tile-offset addresses: m64n128k16 BF16 wgmma (two warpgroups of 64
    rows), cp.async loads (the pipeliner's), no stack, Q plus three K/V stages within the 227 KB a block may use,
    and the main loop within EXACT_TWIN_MAX_PER_ELEMENT instructions per score element."""
    _check_exact_twin(_compile(tmp_path, "--modes", "exact", "--kv-tile-offsets", "1"), EXACT_TWIN_MAX_PER_ELEMENT)


def test_exact_twin_at_the_table_entry(tmp_path):
    """The same structure at the launch table's sm90 entry as it is (per-element addresses), within
    TABLE_ENTRY_MAX_PER_ELEMENT; and the address form is what the table says (more integer work per tile)."""
    assert not LAUNCHES["sm90"].kv_tile_offsets
    records = _compile(tmp_path, "--modes", "exact")
    _check_exact_twin(records, TABLE_ENTRY_MAX_PER_ELEMENT)
    assert all(record["launch"]["kv_tile_offsets"] is False for record in records)
    assert all(record["per_element"] > EXACT_TWIN_MAX_PER_ELEMENT for record in records), records


def test_every_dot_mode_compiles_at_the_sm90_launch(tmp_path):
    """The sm90 entry is every mode's launch: each compiles, on its tensor-core instruction (e4m3 wgmma for
    "fp8", BF16 for "bf16" and for "scaled", which Triton emulates below SM100)."""
    records = _compile(tmp_path, "--modes", "bf16", "fp8", "scaled", "--masks", "dense")
    mma = {record["name"].split("/")[1]: sorted(record["mma"]) for record in records}
    assert all(name.endswith(".f32.e4m3.e4m3") for name in mma["fp8"]), mma
    assert all(name.endswith(".f32.bf16.bf16") for name in mma["bf16"] + mma["scaled"]), mma
