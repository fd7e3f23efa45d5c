"""The gfx950 (MI350/MI355X) and gfx942 (MI300X) compile audit of aiter_fused, on the CPU.

`python -m aiter_fused.compile_check --arch ARCH --matrix ci --json FILE` compiles every configuration the
dispatcher launches on that architecture for head dims 64/128 with the launch table's tile (Note [Launch
table] in aiter_fused/launch.py), through the PyPI Triton wheel's AMD backend (no ROCm). A subprocess:
other test modules run Triton in interpreter mode. Asserted here is what holds for the shipped kernel; the
rest is recorded in the JSON (docs/aiter_gfx950_audit.md).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCALED_MFMA = "v_mfma_scale_f32_32x32x64_f8f6f4"


def _env(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    return env


def _run(arguments, tmp_path, timeout=1200):
    result = subprocess.run(
        [sys.executable, *arguments], capture_output=True, text=True, env=_env(tmp_path), cwd=REPO, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def audits(tmp_path_factory):
    """arch -> the audit's JSON, compiled once per module run."""
    cache = {}

    def get(arch):
        if arch not in cache:
            tmp_path = tmp_path_factory.mktemp(arch)
            _run(
                [
                    "-m",
                    "aiter_fused.compile_check",
                    "--arch",
                    arch,
                    "--matrix",
                    "ci",
                    "--json",
                    str(tmp_path / "audit.json"),
                ],
                tmp_path,
            )
            cache[arch] = json.loads((tmp_path / "audit.json").read_text())
        return cache[arch]

    return get


@pytest.fixture(params=["gfx950", "gfx942"])
def audit(request, audits):
    return audits(request.param)


def _attention(audit, dot_mode="any"):
    return [
        r for r in audit["configs"] if r["kernel"] == "attention" and (dot_mode == "any" or r["dot_mode"] == dot_mode)
    ]


def test_every_configuration_compiles_and_the_triton_pin_is_recorded(audit):
    from aiter_fused.compile_check import configs

    assert [r["name"] for r in audit["configs"]] == [c.name for c in configs(audit["arch"], "ci")]
    assert [r["name"] for r in audit["configs"] if "error" in r] == []
    pinned = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("triton==")]
    assert pinned == [f"triton=={audit['triton']}"]
    for record in audit["configs"]:
        assert record["vgpr_count"] > 0 and record["agpr_count"] is not None and record["lds_bytes"] >= 0
    for record in _attention(audit):
        assert record["mfma"] and record["main_loop"]["mfma"] > 0 and record["main_loop"]["valu"] > 0


def test_no_dot_is_computed_twice(audit):
    """BLOCK_M 128 over 4 waves: each wave has its own 32 rows of every dot's result."""
    for record in _attention(audit):
        assert record["block_m"] == 128 and record["dots"], record["name"]
        assert {dot["replication"] for dot in record["dots"]} == {1}, (record["name"], record["dots"])


def test_exact_twin_and_quantizers_do_not_spill(audit):
    checked = _attention(audit, None) + [r for r in audit["configs"] if r["kernel"] != "attention"]
    assert len(checked) == {"gfx950": 20, "gfx942": 16}[audit["arch"]]  # gfx950: MXFP4's packed quantizers too
    assert {r["name"]: r["vgpr_spill_count"] for r in checked if r["vgpr_spill_count"] != 0} == {}


def test_gfx950_default_dot_mode_does_not_spill(audits):
    """dot_mode="scaled" (gfx950's default) for every format, head dim and mask: no VGPR spills."""
    scaled = _attention(audits("gfx950"), "scaled")
    assert len(scaled) == 12
    assert {r["name"]: r["vgpr_spill_count"] for r in scaled if r["vgpr_spill_count"] != 0} == {}


def test_gfx950_scaled_path_runs_on_the_scaled_mfma(audits):
    """Every "scaled" configuration multiplies with gfx950's block-scaled MFMA and nothing else: per wave
    and KV tile, QK^T (32 rows x tile_n keys) and P@V (32 rows x head_dim), K = 64 per instruction. MXFP4
    runs fp4 operands: QK^T fp4 x fp4, P@V V fp4 x P fp8 (P holds six-bit values in the e4m3 container;
    Triton computes the transposed products, so A is K or V). MXFP8 and MXFP6 run fp8 x fp8 (Triton 3.6's
    dot_scaled takes no fp6: MXFP6's fp6 rate stays unused, recorded in the JSON, not asserted)."""
    scaled = _attention(audits("gfx950"), "scaled")
    assert len(scaled) == 12
    expected_formats = {
        "mxfp8": {("fp8_e4m3", "fp8_e4m3")},
        "mxfp6": {("fp8_e4m3", "fp8_e4m3")},
        "mxfp4": {("fp4_e2m1", "fp4_e2m1"), ("fp4_e2m1", "fp8_e4m3")},
    }
    for record in scaled:
        assert {m["instruction"] for m in record["mfma"]} == {SCALED_MFMA}, record["name"]
        formats = {(m["a_format"], m["b_format"]) for m in record["mfma"]}
        assert formats == expected_formats[record["mx_format"]], record["name"]
        head_dim, tile_n = record["head_dim"], record["tile_n"]
        per_tile = (tile_n // 32) * (head_dim // 64) + (head_dim // 32) * (tile_n // 64)
        assert record["main_loop"]["mfma"] == per_tile, record["name"]


def test_mfma_operand_formats_are_read_from_the_instruction():
    """The audit reads the A/B formats of f8f6f4 MFMAs from cbsz/blgp (absent: e4m3), so an fp6 or fp4
    operand would show."""
    from aiter_fused.compile_check import read_amdgcn

    asm = textwrap.dedent(f"""\
        .LBB0_1:
        \t{SCALED_MFMA} a[0:15], v[1:8], v[9:16], a[0:15], v1, v2 op_sel_hi:[0,0,0]
        \t{SCALED_MFMA} a[0:15], v[1:6], v[9:12], a[0:15], v1, v2 op_sel_hi:[0,0,0] cbsz:2 blgp:4
        \tv_add_f32 v1, v2, v3
        \ts_cbranch_scc1 .LBB0_1
          - .agpr_count:     16
            .vgpr_count:     40
            .vgpr_spill_count: 0
        """)
    record = read_amdgcn(asm)
    assert [(m["a_format"], m["b_format"], m["count"]) for m in record["mfma"]] == [
        ("fp6_e2m3", "fp4_e2m1", 1),
        ("fp8_e4m3", "fp8_e4m3", 1),
    ]
    assert record["main_loop"] == {"valu": 1, "mfma": 2, "lds": 0, "salu": 1}
    assert (record["vgpr_count"], record["agpr_count"], record["waves_per_simd"]) == (40, 16, 12)


def test_the_replication_check_sees_the_previous_launch(tmp_path):
    """The launch before the table (BLOCK_M 64, 4 waves) split S as warpsPerCTA [4, 1] over 32-row MFMAs:
    two pairs of waves computed the same QK^T and softmax (P@V got [2, 2], no repeat). The check must see
    it. The TTGIR holds each dot four times (two KV loops, Note [Unmasked and masked KV loops] in
    aiter_fused/kernel.py, each a pipelined body and its peeled copy), QK^T first."""
    code = textwrap.dedent("""\
        import json
        from aiter_fused.compile_check import Config, compile_one
        from aiter_fused.launch import Launch
        record = compile_one(Config("attention", "mxfp8", 128, "scaled", False, 128), "gfx950",
                             Launch(block_m=64, num_warps=4, tile_n=128))
        print(json.dumps([record["vgpr_spill_count"], [d["replication"] for d in record["dots"]]]))
        """)
    spills, replication = json.loads(_run(["-c", code], tmp_path).stdout.strip().splitlines()[-1])
    assert replication == [2, 1] * 4 and spills > 0


_ROW_SUM_GEMM_COMPILE = textwrap.dedent("""
    import json
    from aiter_fused.compile_check import Config, compile_one
    print(json.dumps([compile_one(Config("attention", fmt, 128, "scaled", True, 64, row_sum="gemm"), "gfx950")
                      for fmt in ("mxfp8", "mxfp4")]))
""")


def test_gfx950_row_sum_by_gemm_is_one_scaled_mfma_per_64_keys(audits, tmp_path):
    """Note [Row sum by GEMM] in kernel.py: with row_sum="gemm" (off by default, so not in the audit's
    matrix) the "scaled" main loop gains one block-scaled MFMA per wave and 64 keys (32 rows x the ones
    block's 32 columns, K = 64), P e4m3 x ones e4m3, with no LDS instruction and no spill added: the row sum
    reads P in the P@V dot's layout. MXFP8 and MXFP4, head dim 128, causal, the launch table's tile."""
    result = _run(["-c", _ROW_SUM_GEMM_COMPILE], tmp_path)
    reduced = {
        r["mx_format"]: r for r in _attention(audits("gfx950"), "scaled") if r["head_dim"] == 128 and r["causal"]
    }
    for record in json.loads(result.stdout.strip().splitlines()[-1]):
        base = reduced[record["mx_format"]]
        assert record["vgpr_spill_count"] == 0, record["name"]
        assert {m["instruction"] for m in record["mfma"]} == {SCALED_MFMA}, record["name"]
        added = {(m["a_format"], m["b_format"]): m["count"] for m in record["mfma"]}
        for m in base["mfma"]:
            added[(m["a_format"], m["b_format"])] -= m["count"]
        # The loop body's copies (two KV loops, and what the pipeliner peels) each gain the same MFMAs.
        copies = sum(m["count"] for m in base["mfma"]) // base["main_loop"]["mfma"]
        expected = {("fp8_e4m3", "fp8_e4m3"): copies * (record["tile_n"] // 64)}
        assert {key: count for key, count in added.items() if count} == expected, record["name"]
        assert record["main_loop"]["mfma"] == base["main_loop"]["mfma"] + record["tile_n"] // 64, record["name"]
        assert record["main_loop"]["lds"] == base["main_loop"]["lds"], record["name"]


_EXP_FOLD_COMPILE = textwrap.dedent("""
    import json
    from aiter_fused.compile_check import Config, compile_one
    print(json.dumps([compile_one(Config("attention", fmt, 128, "scaled", True, 64, exp_fold=True), "gfx950")
                      for fmt in ("mxfp8", "mxfp4")]))
""")
_AGPR_MOVES = ("v_accvgpr_read", "v_accvgpr_write")


def test_gfx950_exp_fold_keeps_the_mfmas_and_does_not_spill(audits, tmp_path):
    """Note [Folded Schraudolph] in kernel.py: with exp_fold (off by default, so not in the audit's matrix) the
    "scaled" main loop keeps its MFMAs (the addend rides as the QK^T MFMA's accumulator) and LDS instructions,
    does not spill, and issues fewer VALU per tile than the unfolded loop. MXFP8 and MXFP4, head dim 128,
    causal, the launch table's tile. The counts (docs/aiter_matrix_core.md, section 2) are printed."""
    result = _run(["-c", _EXP_FOLD_COMPILE], tmp_path)
    unfolded = {
        r["mx_format"]: r for r in _attention(audits("gfx950"), "scaled") if r["head_dim"] == 128 and r["causal"]
    }
    for record in json.loads(result.stdout.strip().splitlines()[-1]):
        base = unfolded[record["mx_format"]]
        print(record["name"], "main loop", base["main_loop"], "->", record["main_loop"])
        assert record["vgpr_spill_count"] == 0, record["name"]
        assert record["mfma"] == base["mfma"], record["name"]
        assert record["main_loop"]["mfma"] == base["main_loop"]["mfma"], record["name"]
        assert record["main_loop"]["lds"] == base["main_loop"]["lds"], record["name"]
        assert record["main_loop"]["valu"] < base["main_loop"]["valu"], record["name"]


_P_CONVERT_COMPILE = textwrap.dedent("""
    import json
    from aiter_fused.compile_check import Config, compile_one
    configs = [Config("attention", "mxfp8", 128, "scaled", causal, 64, p_convert=p_convert)
               for causal in (False, True) for p_convert in ("software", "hardware")]
    print(json.dumps([compile_one(config, "gfx950") for config in configs]))
""")


def test_gfx950_hardware_p_convert_uses_the_scaled_convert_and_saves_valu(tmp_path):
    """Note [Hardware P convert] in kernel.py: the compile-audit variant (never run on a GPU) makes MXFP8 P with
    v_cvt_scalef32_pk_fp8_f32 and the block's scale in a register, where the software path gets that
    instruction only as the scale-1 container cast after its own rounding. Head dim 128, dense and causal, the
    launch table's tile: no spill, the same MFMAs and LDS instructions, fewer main-loop VALU. The counts
    (docs/aiter_matrix_core.md, section 3) are printed."""
    result = _run(["-c", _P_CONVERT_COMPILE], tmp_path)
    records = json.loads(result.stdout.strip().splitlines()[-1])
    for software, hardware in zip(records[::2], records[1::2]):
        print(software["name"], software["main_loop"], software["scaled_fp8_converts"])
        print(hardware["name"], hardware["main_loop"], hardware["scaled_fp8_converts"])
        assert "error" not in hardware, hardware.get("error")
        assert hardware["vgpr_spill_count"] == 0 and software["vgpr_spill_count"] == 0, hardware["name"]
        for where in ("kernel", "main_loop"):
            soft, hard = software["scaled_fp8_converts"][where], hardware["scaled_fp8_converts"][where]
            assert soft["count"] > 0 and soft["constant_scale"] == soft["count"], (where, soft)
            assert hard["count"] > 0 and hard["constant_scale"] == 0, (where, hard)
        assert hardware["mfma"] == software["mfma"], hardware["name"]
        assert hardware["main_loop"]["mfma"] == software["main_loop"]["mfma"], hardware["name"]
        assert hardware["main_loop"]["lds"] == software["main_loop"]["lds"], hardware["name"]
        assert hardware["main_loop"]["valu"] < software["main_loop"]["valu"], hardware["name"]


def test_hardware_p_convert_is_compile_audit_only():
    """p_convert="hardware" has never run on an MI355X: compile_check refuses it outside its one gfx950
    configuration family (ValueError saying so), and the public entry points have no way to pass it."""
    import inspect

    from aiter_fused import attention
    from aiter_fused.compile_check import Config, _source
    from aiter_fused.launch import LAUNCHES

    message = "compile-audit variant only.*has never run on an MI355X"
    for refused in (
        dict(kernel="attention", mx_format="mxfp4", head_dim=128, dot_mode="scaled"),
        dict(kernel="attention", mx_format="mxfp6", head_dim=128, dot_mode="scaled"),
        dict(kernel="attention", mx_format="mxfp8", head_dim=128, dot_mode="bf16"),
        dict(kernel="attention", mx_format="mxfp8", head_dim=128, dot_mode=None),
        dict(kernel="quantize_keys", mx_format="mxfp8", head_dim=128),
    ):
        with pytest.raises(ValueError, match=message):
            Config(**refused, p_convert="hardware")
    with pytest.raises(ValueError, match="p_convert must be one of"):
        Config("attention", "mxfp8", 128, "scaled", p_convert="asm")
    config = Config("attention", "mxfp8", 128, "scaled", False, 64, p_convert="hardware")
    for arch in ("gfx942", "sm90"):
        with pytest.raises(ValueError, match=message):
            _source(config, arch, LAUNCHES[arch])
    for entry in (attention.fused_softmax_attention, attention.fused_softmax_attention_varlen, attention._launch):
        assert "p_convert" not in inspect.signature(entry).parameters
    assert 'P_CONVERT="software"' in inspect.getsource(attention._launch)
