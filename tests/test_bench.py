"""The benchmark's pure parts on CPU (statistics, plan, FLOPs, gate, writers, CLI) and, on a GPU, a --quick run."""

import inspect
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench import env_info
from bench.__main__ import group_key
from bench.check import check_batches, check_output, make_inputs, reference_attention
from bench.kernels import (
    BASELINE,
    DEFAULT_KERNELS,
    DOT_MODE_KERNELS,
    KERNELS,
    MAP_KERNELS,
    QUICK_KERNELS,
    h15_map_name,
    missing_kwargs,
)
from bench.report import (
    fp8_defaults_table,
    gpu_slug,
    map_pivot,
    markdown_report,
    new_row,
    read_json,
    seqlen_pivot,
    speedup_cell,
    write_json,
    write_plots,
)
from bench.sweep import (
    FOCUS_SEQLEN,
    GQA_HEADS_KV,
    HEADS_Q,
    TOKENS,
    Shape,
    attention_flops,
    build_plan,
    make_shape,
    parse_seqlen,
    tflops,
)
from bench.timing import median, per_round_speedups, rotation_count, round_orders, spread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gpu = pytest.mark.gpu


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


# ---- statistics -------------------------------------------------------------------------------------------


def test_median_odd_even_and_empty():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError):
        median([])


def test_spread_matches_numpy_percentiles():
    rng = np.random.default_rng(1)
    for n in (2, 5, 8, 21):
        values = list(rng.lognormal(size=n))
        s = spread(values)
        q = np.percentile(values, [0, 25, 50, 75, 100])
        assert [s["min"], s["q1"], s["median"], s["q3"], s["max"]] == pytest.approx(list(q), rel=1e-12)
    assert spread([1.5]) == {"min": 1.5, "q1": 1.5, "median": 1.5, "q3": 1.5, "max": 1.5}
    with pytest.raises(ValueError):
        spread([])


def test_per_round_speedups_use_each_rounds_medians():
    baseline = [[2.0, 2.2, 9.0], [4.0, 4.0, 4.1]]  # the 9.0 outlier must not move round 0's median
    kernel = [[1.0, 1.1, 0.9], [8.0, 1.0, 2.0]]
    assert per_round_speedups(baseline, kernel) == pytest.approx([2.2 / 1.0, 4.0 / 2.0])
    with pytest.raises(ValueError):
        per_round_speedups(baseline, kernel[:1])


def test_rotation_count_exceeds_twice_l2_with_fewest_sets():
    h200_l2 = 50 * 2**20
    assert rotation_count(384 * 2**20, h200_l2) == 2  # a 32K-token hd128 set: two sets already
    rng = random.Random(0)
    for _ in range(200):
        set_bytes, l2 = rng.randint(1, 10**9), rng.randint(0, 10**9)
        n = rotation_count(set_bytes, l2)
        assert n * set_bytes > 2 * l2 and n >= 2
        assert n == 2 or (n - 1) * set_bytes <= 2 * l2
    with pytest.raises(ValueError):
        rotation_count(0, h200_l2)


def test_round_orders_are_seeded_permutations():
    names = ["a", "b", "c", "d", "e"]
    orders = round_orders(names, 30, seed=3)
    assert len(orders) == 30 and all(sorted(o) == names for o in orders)
    assert orders == round_orders(names, 30, seed=3)
    assert orders != round_orders(names, 30, seed=4)
    assert len({tuple(o) for o in orders}) > 10  # really shuffled, not one fixed order
    with pytest.raises(ValueError):
        round_orders(names, 0, seed=0)


# ---- plan ---------------------------------------------------------------------------------------------------


def test_full_plan_holds_tokens_constant_and_places_the_map_at_8k_causal():
    plan = build_plan(quick=False)
    assert all(BASELINE in g.kernels for g in plan)
    shapes = [g.shape for g in plan]
    assert len(set(shapes)) == len(shapes)
    for s in shapes:
        assert s.batch * s.seqlen == TOKENS and s.heads_q == HEADS_Q
    assert sorted({s.seqlen for s in shapes}) == [1024, 2048, 4096, 8192, 16384, 32768]
    gqa = [s for s in shapes if s.is_gqa]
    assert gqa and all(s.heads_kv == GQA_HEADS_KV and s.seqlen == FOCUS_SEQLEN for s in gqa)
    assert {s.dtype for s in shapes} == {"bf16", "fp16", "fp8"}
    assert {s.head_dim for s in shapes} == {64, 128}
    with_map = [g for g in plan if set(MAP_KERNELS) <= set(g.kernels)]
    assert [(g.shape.seqlen, g.shape.causal, g.shape.dtype) for g in with_map] == [(FOCUS_SEQLEN, True, "bf16")]
    assert plan[0] is with_map[0]  # most informative group first
    both = build_plan(quick=False, map_masks="both")
    assert sum(set(MAP_KERNELS) <= set(g.kernels) for g in both) == 2
    assert not any(set(MAP_KERNELS) & set(g.kernels) for g in build_plan(quick=False, map_masks="none"))


def test_quick_plan_and_filters():
    quick = build_plan(quick=True)
    assert [(g.shape.seqlen, g.shape.causal) for g in quick] == [
        (8192, True),
        (8192, False),
        (2048, True),
        (2048, False),
    ]
    assert all(g.kernels == QUICK_KERNELS and g.shape.dtype == "bf16" and g.shape.head_dim == 128 for g in quick)
    picked = build_plan(quick=False, kernel_patterns=["sdpa_*"], seqlens=[4096, 1000])
    assert all(g.kernels == (BASELINE, "sdpa_cudnn", "sdpa_flash") for g in picked)
    assert {g.shape.seqlen for g in picked} == {4096, 1000}  # no 8K: no variants, no FP8, no map
    assert [g.shape.batch for g in picked if g.shape.seqlen == 1000] == [32, 32]
    with pytest.raises(ValueError, match="matches no kernel"):
        build_plan(quick=True, kernel_patterns=["nope*"])
    with pytest.raises(ValueError, match="map_masks"):
        build_plan(quick=False, map_masks="diagonal")
    with pytest.raises(ValueError, match="seqlens"):
        build_plan(quick=True, seqlens=[])
    assert build_plan(quick=True, seqlens=[2048, 2048]) == build_plan(quick=True, seqlens=[2048])


def test_shape_validation_and_seqlen_parsing():
    assert parse_seqlen("8K") == 8192 and parse_seqlen("8k") == 8192 and parse_seqlen("1000") == 1000
    for bad in ("0", "-1", "8M", "", "1.5K"):
        with pytest.raises(ValueError, match="seqlen"):
            parse_seqlen(bad)
    with pytest.raises(ValueError, match="heads_q"):
        make_shape(1024, True, heads_q=16, heads_kv=5)
    with pytest.raises(ValueError, match="dtype"):
        make_shape(1024, True, dtype="fp32")
    with pytest.raises(TypeError, match="causal"):
        Shape(1024, 1, "bf16", 128, 16, 16, 32)
    assert make_shape(40000, False).batch == 1


def test_flops_formula_counts_two_gemms_and_halves_causal():
    shape = make_shape(1024, causal=False, head_dim=64, heads_q=8, heads_kv=2, tokens=4096)
    b, h, s, d = 4, 8, 1024, 64
    # QK^T: b*h*s*s*d multiply-adds; PV: the same; 2 FLOPs each. GQA does not change the count.
    assert attention_flops(shape) == 2 * (2 * b * h * s * s * d)
    causal = make_shape(1024, causal=True, head_dim=64, heads_q=8, heads_kv=2, tokens=4096)
    assert attention_flops(causal) == attention_flops(shape) / 2
    assert tflops(shape, 1000.0) == pytest.approx(attention_flops(shape) / 1e12)
    assert tflops(shape, 2.0) == pytest.approx(attention_flops(shape) / 2e-3 / 1e12)
    with pytest.raises(ValueError):
        tflops(shape, 0.0)


# ---- reference and gate ----------------------------------------------------------------------------------------


def naive_attention_fp64(q, k, v, causal, batch_indices):
    q, k, v = q.double(), k.double(), v.double()
    _, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(len(batch_indices), sq, hq, v.shape[-1], dtype=torch.float64)
    for i, b in enumerate(batch_indices):
        for h in range(hq):
            kh = h // (hq // hk)
            for row in range(sq):
                scores = (k[b, :, kh] @ q[b, row, h]) / math.sqrt(d)
                if causal:
                    visible = torch.arange(sk) <= row + sk - sq
                    if not visible.any():
                        continue  # fully masked row: 0
                    scores = scores.masked_fill(~visible, -math.inf)
                w = torch.softmax(scores, dim=0)
                out[i, row, h] = w @ v[b, :, kh]
    return out


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", [(37, 53, True), (53, 37, True), (29, 29, False)])
def test_reference_matches_fp64_on_odd_gqa_shapes(seqlen_q, seqlen_k, causal):
    gen = torch.Generator().manual_seed(seqlen_q * 100 + seqlen_k)
    q = torch.randn(3, seqlen_q, 6, 24, generator=gen).bfloat16()
    k = torch.randn(3, seqlen_k, 2, 24, generator=gen).bfloat16()
    v = torch.randn(3, seqlen_k, 2, 24, generator=gen).bfloat16()
    ref = reference_attention(q, k, v, causal, [0, 2])
    want = naive_attention_fp64(q, k, v, causal, [0, 2])
    assert ref.dtype == torch.float32 and ref.shape == (2, seqlen_q, 6, 24)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    if seqlen_q > seqlen_k and causal:
        assert (ref[:, : seqlen_q - seqlen_k] == 0).all()


def test_check_output_accepts_close_and_rejects_wrong_outputs():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 64, 4, 32, generator=gen)
    close = ref + 1e-3 * torch.randn(ref.shape, generator=gen)
    result = check_output(close.bfloat16(), ref, 1e-2)
    assert result.passed and 0 < result.rel_err < 1e-2 and result.reason == ""
    assert not check_output(torch.zeros_like(ref), ref, 0.5).passed  # rel err 1.0
    heads_swapped = ref[:, :, [1, 0, 3, 2]]
    swapped = check_output(heads_swapped, ref, 0.5)
    assert not swapped.passed and swapped.rel_err > 1.0 and "tolerance" in swapped.reason
    nan = ref.clone()
    nan[1, 5, 2, 7] = math.nan
    assert check_output(nan, ref, 10.0).reason == "1 non-finite output values"
    inf = ref.clone()
    inf[0, 0, 0, 0] = math.inf
    assert not check_output(inf, ref, 10.0).passed
    assert "shape" in check_output(ref[:1], ref, 1.0).reason
    with pytest.raises(ValueError, match="tolerance"):
        check_output(ref, ref, 0.0)


def test_gate_through_a_real_kernel_and_a_wrong_mask():
    """sdpa_flash runs on the CPU too: its layout handling must pass the gate, and the wrong mask must fail it."""
    shape = make_shape(96, causal=True, heads_q=4, heads_kv=2, head_dim=32, tokens=192)
    ((q, k, v),) = make_inputs(shape, 1, "cpu", seed=5)
    batches = check_batches(shape.batch)
    ref = reference_attention(q, k, v, shape.causal, batches)
    spec = KERNELS["sdpa_flash"]
    good = check_output(spec.bind(q, k, v, True)()[batches], ref, spec.tolerance("bf16"))
    assert good.passed, good
    wrong_mask = check_output(spec.bind(q, k, v, False)()[batches], ref, spec.tolerance("bf16"))
    assert not wrong_mask.passed and wrong_mask.rel_err > 10 * spec.tolerance("bf16")


def test_make_inputs_shapes_dtypes_and_independent_sets():
    shape = make_shape(64, causal=False, dtype="fp8", heads_q=4, heads_kv=1, head_dim=16, tokens=128)
    sets = make_inputs(shape, 3, "cpu", seed=1)
    assert len(sets) == 3
    q, k, v = sets[0]
    assert q.shape == (2, 64, 4, 16) and k.shape == v.shape == (2, 64, 1, 16)
    assert q.dtype == torch.float8_e4m3fn
    assert not torch.equal(sets[0][0].float(), sets[1][0].float())
    assert torch.equal(make_inputs(shape, 1, "cpu", seed=1)[0][0].float(), q.float())
    assert check_batches(1) == [0] and check_batches(4) == [0, 3]


# ---- kernel table ----------------------------------------------------------------------------------------------


def test_kernel_table_contents():
    assert list(KERNELS)[0] == BASELINE
    assert len(MAP_KERNELS) == 24 and len(set(MAP_KERNELS)) == 24
    assert h15_map_name(4.0, 0.125) == "fa4_h15_t4_b0.125" and h15_map_name(4.0, 0.125) in KERNELS
    assert dict(KERNELS["fa4_h15_t8_b0.375"].knobs) == {
        "softmax_mode": "rowmax_h15",
        "rescale_threshold": 8.0,
        "beta": 0.375,
    }
    assert {"aiter_mxfp8", "aiter_mxfp6_exact", "aiter_mxfp4", "sdpa_cudnn", "sdpa_flash"} <= set(DEFAULT_KERNELS)
    assert not set(MAP_KERNELS) & set(DEFAULT_KERNELS)
    assert set(QUICK_KERNELS) <= set(DEFAULT_KERNELS)
    assert DOT_MODE_KERNELS == ("aiter_mxfp8_bf16", "aiter_mxfp8_scaled")  # opt-in: not in the full preset
    assert not set(DOT_MODE_KERNELS) & set(DEFAULT_KERNELS)
    assert dict(KERNELS["aiter_mxfp8_scaled"].knobs)["dot_mode"] == "scaled"
    for spec in KERNELS.values():
        assert spec.tolerances and all(spec.tolerance(dtype) > 0 for dtype in spec.tolerances)
        reason = spec.unavailable_reason()  # never raises; None or a sentence
        assert reason is None or (isinstance(reason, str) and reason)


def test_kernel_support_rules():
    hopper, blackwell = (9, 0), (10, 0)
    assert "SM100" in KERNELS[BASELINE].unsupported_reason("fp8", hopper)
    assert KERNELS[BASELINE].unsupported_reason("fp8", blackwell) is None
    assert KERNELS[BASELINE].unsupported_reason("fp16", hopper) is None
    assert "bf16" in KERNELS["aiter_mxfp8"].unsupported_reason("fp16", hopper)
    assert KERNELS["sdpa_cudnn"].unsupported_reason("fp8", blackwell) is not None
    assert KERNELS["aiter_mxfp4"].tolerance("bf16") > KERNELS["aiter_mxfp8"].tolerance("bf16")
    assert KERNELS["fa4_h15"].tolerance("bf16") > KERNELS[BASELINE].tolerance("bf16")
    with pytest.raises(ValueError, match="dtype"):
        KERNELS["aiter_mxfp8"].tolerance("fp16")


def test_patch_detection_by_signature():
    def stock(q, k, v, causal=False):
        pass

    def patched(q, k, v, causal=False, softmax_mode="exact", rescale_threshold=None, beta=None):
        pass

    assert missing_kwargs(stock, ("softmax_mode", "beta")) == ["softmax_mode", "beta"]
    assert missing_kwargs(patched, ("softmax_mode", "rescale_threshold", "beta")) == []
    from flash_attn.cute import flash_attn_func

    missing = missing_kwargs(flash_attn_func, ("softmax_mode", "rescale_threshold", "beta"))
    reason = KERNELS["fa4_h15"].unavailable_reason()
    if missing:
        assert reason is not None and all(name in reason for name in missing)
    else:
        assert reason is None
    assert KERNELS[BASELINE].unavailable_reason() is None


# ---- report ----------------------------------------------------------------------------------------------------


def fake_doc():
    rows = []
    for seqlen in (2048, 8192):
        for causal in (True, False):
            shape = make_shape(seqlen, causal)
            for name, speed in ((BASELINE, 1.0), ("fa4_h15", 1.05), ("sdpa_cudnn", 0.9)):
                row = new_row(shape, KERNELS[name])
                row.update(
                    status="ok",
                    median_ms=2.0 / speed,
                    tflops=500.0 * speed,
                    speedup_vs_fa4_stock=speed,
                    speedup_spread={
                        "min": speed - 0.03,
                        "q1": speed - 0.01,
                        "median": speed,
                        "q3": speed + 0.02,
                        "max": speed + 0.04,
                    },
                    check={"passed": True, "rel_err": 2e-3, "max_abs_err": 1e-2, "tolerance": 1e-2, "reason": ""},
                )
                rows.append(row)
            aiter = new_row(shape, KERNELS["aiter_mxfp8"])
            aiter.update(status="unavailable", reason="cannot import aiter_fused.attention | ModuleNotFoundError")
            rows.append(aiter)
    for i, name in enumerate(MAP_KERNELS):
        row = new_row(make_shape(FOCUS_SEQLEN, True), KERNELS[name])
        row.update(
            status="ok",
            median_ms=1.0,
            tflops=600.0,
            speedup_vs_fa4_stock=1.0 + i / 100,
            speedup_spread={"min": 0.9, "q1": 0.95, "median": 1.0, "q3": 1.05, "max": 1.1},
        )
        rows.append(row)
    failed = new_row(make_shape(FOCUS_SEQLEN, True), KERNELS["aiter_mxfp4"])
    failed.update(
        status="check_failed",
        reason="relative error 0.7 > tolerance 0.4",
        check={"passed": False, "rel_err": 0.7, "max_abs_err": 3.0, "tolerance": 0.4, "reason": "x"},
    )
    rows.append(failed)
    env = env_info.collect({"preset": "test"})
    env["gpu"] = {
        "name": "NVIDIA H200",
        "capability": "9.0",
        "sm_count": 132,
        "memory_bytes": 1,
        "l2_cache_bytes": 50 * 2**20,
        "device_index": 0,
    }
    return {"schema": 1, "env": env, "rows": rows}


def test_markdown_report_tables():
    doc = fake_doc()
    md = markdown_report(doc)
    assert md.startswith("# Attention forward benchmark: NVIDIA H200")
    assert "halved for causal" in md and "L2 50 MiB" in md
    causal = seqlen_pivot(doc["rows"], "causal")
    lines = causal.splitlines()
    assert lines[0] == "| kernel | 2K | 8K |"
    assert "| fa4_stock | 500 TFLOPS | 500 TFLOPS |" in lines
    assert "| fa4_h15 | 1.050 [1.04, 1.07] | 1.050 [1.04, 1.07] |" in lines
    assert any(line.startswith("| aiter_mxfp4 |") and "check failed (0.7 > 0.4)" in line for line in lines)
    assert not any("fa4_h15_t" in line for line in lines)  # the map has its own table
    heat = map_pivot(doc["rows"], "causal").splitlines()
    assert heat[0].startswith("| threshold \\ beta | 0 | 0.125 |") and len(heat) == 2 + 4
    assert heat[4].startswith("| 4 | 1.120 [0.95, 1.05] |")  # i = 12: threshold 4, beta 0
    assert map_pivot(doc["rows"], "non-causal") is None
    assert "aiter_fused.attention \\| ModuleNotFoundError" in md  # pipes escaped in the all-rows table
    assert speedup_cell(doc["rows"][3]) == "unavailable"


def test_fp8_defaults_table_spans_the_runs_and_bolds_the_goal():
    """The README's FP8 speed table: per shape the range over the runs of each kernel's ratio to FA3-FP8, bold only
    where the lowest run meets issue 22's goal (H15 1.15x, the exact twin 1.0x); a failed or missing row is '-'."""

    def run(h15_causal, exact_causal):
        rows = []
        for causal in (False, True):
            shape = Shape(batch=4, seqlen=8192, heads_q=HEADS_Q, heads_kv=16, head_dim=128, causal=causal, dtype="fp8")
            for name, ratio in (
                ("fa3_fp8", None),
                ("fa4_fp8_func_h15", h15_causal if causal else 1.2),
                ("fa4_fp8_func_exact", exact_causal if causal else 1.05),
                ("fa4_fp8_exact_noexp_defaults", 1.3),
            ):
                row = new_row(shape, KERNELS[name])
                row.update(status="ok", tflops=900.0, median_ms=1.0, speedup_vs_fa3_fp8=ratio)
                rows.append(row)
            vllm = new_row(shape, KERNELS["vllm_fa3_fp8"])
            vllm.update(status="unavailable", reason="no library")
            rows.append(vllm)
        return {"rows": rows}

    lines = fp8_defaults_table([run(1.16, 1.0), run(1.14, 1.02)]).splitlines()
    assert lines[0].startswith("| head dim | KV heads | keys | FA3-FP8 non-causal | rowmax_h15 non-causal |")
    expected = (
        "| 128 | 16 | 8K | 900 TF | **1.20x** | 1.14-1.16x | **1.05x** | **1.00-1.02x** | 1.30x / 1.30x | - / - |"
    )
    assert lines[2] == expected
    cells = fp8_defaults_table([run(1.15, 0.99)]).splitlines()[2].split(" | ")
    assert (cells[5], cells[7]) == ("**1.15x**", "0.99x")  # rowmax_h15 causal, exact causal


def test_json_round_trip_and_nan(tmp_path):
    doc = fake_doc()
    doc["rows"][0]["median_ms"] = math.nan
    doc["rows"][1]["round_speedups"] = [1.0, math.inf]
    path = tmp_path / "r.json"
    write_json(str(path), doc)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    back = read_json(str(path))
    assert back["rows"][0]["median_ms"] is None and back["rows"][1]["round_speedups"] == [1.0, None]
    assert back["rows"][2] == json.loads(json.dumps(doc["rows"][2]))
    (tmp_path / "bad.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="env"):
        read_json(str(tmp_path / "bad.json"))


def test_report_cli_regenerates_markdown_and_plots(tmp_path, capsys):
    from bench.report import main

    path = tmp_path / "h200_full.json"
    write_json(str(path), fake_doc())
    assert main([str(path)]) == 0
    assert "h200_full_h15_map_8K_causal.png" in capsys.readouterr().out
    assert (tmp_path / "h200_full.md").read_text() == markdown_report(read_json(str(path)))
    for png in ("h200_full_speedup_vs_seqlen.png", "h200_full_h15_map_8K_causal.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_say_why_when_nothing_to_plot(tmp_path):
    doc = fake_doc()
    doc["rows"] = [r for r in doc["rows"] if r["status"] != "ok"]
    assert write_plots(doc, str(tmp_path), "x") == []


def test_gpu_slug_and_env_info():
    assert gpu_slug("NVIDIA H200") == "h200" and gpu_slug("NVIDIA B200") == "b200"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "4090" and gpu_slug(None) == "gpu"
    env = env_info.collect({"rounds": 3})
    json.dumps(env)
    assert env["packages"]["torch"] == torch.__version__.split("+")[0] or env["packages"]["torch"] == torch.__version__
    assert env["settings"] == {"rounds": 3}
    assert isinstance(env["nvidia_smi"], (dict, str))


# ---- CLI -------------------------------------------------------------------------------------------------------


def test_cli_dry_run_prints_the_plan():
    proc = run_cli("--quick", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("settings: preset=quick") and "rounds=5" in lines[0]
    assert sum(line.startswith("[") for line in lines) == 4
    assert "8K causal bf16 d128 h16 b4" in proc.stdout and "2K non-causal bf16 d128 h16 b16" in proc.stdout
    assert lines[-1] == "4 groups, 16 kernel rows, ~6 FA4/Triton compilations (FP8 aside)"


def cli_main(capsys, *argv):
    from bench.__main__ import main

    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_rejects_bad_arguments(capsys):
    rc, _, err = cli_main(capsys, "--kernels", "fa5*", "--dry-run")
    assert rc == 2 and "--kernels: 'fa5*' matches no kernel" in err
    rc, _, err = cli_main(capsys, "--seqlens", "8M", "--dry-run")
    assert rc == 2 and "seqlen must be a positive integer" in err
    rc, _, err = cli_main(capsys, "--rounds", "0", "--dry-run")
    assert rc == 2 and "--rounds" in err
    rc, _, err = cli_main(capsys, "--max-minutes", "-1", "--dry-run")
    assert rc == 2 and "--max-minutes" in err
    rc, out, _ = cli_main(capsys, "--dry-run", "--rounds", "3", "--map-masks", "both")
    assert rc == 0 and "rounds=3" in out and out.count("(24 map points)") == 2 and "h16/4" in out
    if not torch.cuda.is_available():
        rc, _, err = cli_main(capsys, "--quick")
        assert rc == 2 and "no CUDA device" in err


def test_resume_keeps_finished_groups_and_refuses_other_settings():
    from bench.__main__ import ResumeError, finished_rows, parse_args, settings_of

    plan = build_plan(quick=True)
    settings = settings_of(parse_args(["--quick", "--max-minutes", "5"]))
    rows = []
    for group in plan[:2]:  # two groups measured, the second cut by the time budget on its last kernel
        rows += [dict(new_row(group.shape, KERNELS[name]), status="ok") for name in group.kernels]
    rows[-1].update(status="skipped", reason="time budget (--max-minutes 5) spent")
    packages = {"torch": "2.11.0", "flash-attn-4": "4.0.0b36"}
    doc = {
        "env": {"settings": settings, "gpu": {"name": "NVIDIA H200"}, "packages": packages},
        "rows": json.loads(json.dumps(rows)),
    }

    longer = settings_of(parse_args(["--quick", "--max-minutes", "9"]))  # the budget may change
    done = finished_rows(doc, plan, longer, "NVIDIA H200", packages)
    assert list(done) == [group_key(plan[0].shape)]
    assert [r["kernel"] for r in done[group_key(plan[0].shape)]] == list(plan[0].kernels)

    del doc["rows"][0]  # a group with a kernel row missing (run killed mid-group) is not finished
    assert finished_rows(doc, plan, longer, "NVIDIA H200", packages) == {}

    with pytest.raises(ResumeError, match="'rounds' was 5 in the results file, now 3"):
        finished_rows(doc, plan, settings_of(parse_args(["--quick", "--rounds", "3"])), "NVIDIA H200", packages)
    with pytest.raises(ResumeError, match="'preset' was 'quick' in the results file, now 'full'"):
        finished_rows(doc, plan, settings_of(parse_args([])), "NVIDIA H200", packages)
    with pytest.raises(ResumeError, match="measured on 'NVIDIA H200', this GPU is 'NVIDIA H100'"):
        finished_rows(doc, plan, settings, "NVIDIA H100", packages)
    with pytest.raises(ResumeError, match="package torch was '2.11.0' in the results file, now '2.12.0'"):
        finished_rows(doc, plan, settings, "NVIDIA H200", dict(packages, torch="2.12.0"))

    doc["env"]["resumed"] = [
        {
            "date_utc": "2026-11-30T01:00:00+00:00",
            "host": "h",
            "git_commit": "abc",
            "nvidia_smi": {"clocks.sm": "345 MHz"},
            "groups_kept": 1,
        }
    ]
    assert "- resumed 2026-11-30T01:00:00+00:00 on h (commit abc, SM 345 MHz at start): kept 1" in markdown_report(
        {"env": doc["env"], "rows": []}
    )


# ---- GPU -------------------------------------------------------------------------------------------------------


@gpu
def test_interleaved_timing_ranks_a_4x_larger_matmul_slower():
    from bench.timing import time_interleaved

    a = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    b = [torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    launchers = {"small": [lambda x=x: x @ x for x in a], "large": [lambda x=x, y=y: x @ y for x, y in zip(b, a)]}
    times, errors = time_interleaved(launchers, rounds=4, calls_per_round=5, warmup=2, seed=0)
    assert errors == {} and all(len(t) == 4 and all(len(r) == 5 for r in t) for t in times.values())
    ratios = per_round_speedups(times["large"], times["small"])
    assert all(2.0 < r < 6.0 for r in ratios), ratios


@gpu
def test_quick_run_writes_results(tmp_path):
    proc = run_cli(
        "--quick",
        "--out",
        str(tmp_path),
        "--name",
        "t",
        "--rounds",
        "2",
        "--calls-per-round",
        "2",
        "--no-plots",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = read_json(str(tmp_path / "t.json"))
    assert len(doc["rows"]) == 16 and (tmp_path / "t.md").exists()
    stock = [r for r in doc["rows"] if r["kernel"] == BASELINE]
    assert all(r["status"] == "ok" and r["speedup_vs_fa4_stock"] == 1.0 and r["check"]["passed"] for r in stock)
    cudnn = [r for r in doc["rows"] if r["kernel"] == "sdpa_cudnn"]
    assert all(r["status"] == "ok" and 100 < r["tflops"] < 2000 for r in cudnn), cudnn


# ---- FP8 (issue 11): preset, peers, tolerance derivation -----------------------------------------------------


def test_fp8_plan_covers_head_dims_seqlens_masks_and_gqa_with_the_goal_shapes_first():
    from bench.kernels import FP8_KERNELS, FP8_LEVER_KERNELS, FP8_LEVERS, FP8_MAP_KERNELS
    from bench.sweep import FP8_SEQLENS

    plan = build_plan(quick=False, fp8=True)
    shapes = [g.shape for g in plan]
    assert len(set(shapes)) == len(shapes) == 2 * 5 * 2 * 2
    assert {s.dtype for s in shapes} == {"fp8"} and {s.head_dim for s in shapes} == {64, 128}
    assert sorted({s.seqlen for s in shapes}) == list(FP8_SEQLENS) == [2048, 4096, 8192, 16384, 32768]
    assert {s.heads_kv for s in shapes} == {HEADS_Q, GQA_HEADS_KV} and {s.causal for s in shapes} == {True, False}
    assert all(s.batch * s.seqlen == TOKENS for s in shapes)
    assert all(g.kernels[: len(FP8_KERNELS) + 1] == (BASELINE,) + FP8_KERNELS for g in plan)
    assert [(s.seqlen, s.causal) for s in shapes[:4]] == [(8192, True), (8192, False), (16384, True), (16384, False)]
    assert all(s.head_dim == 128 and not s.is_gqa for s in shapes[:4])
    with_map = [g.shape for g in plan if set(FP8_MAP_KERNELS) <= set(g.kernels)]
    assert [(s.seqlen, s.causal, s.head_dim, s.is_gqa) for s in with_map] == [(8192, True, 128, False)]
    with_levers = [g.shape for g in plan if set(FP8_LEVER_KERNELS) & set(g.kernels)]
    assert with_levers == with_map and FP8_LEVER_KERNELS == tuple(FP8_LEVERS)
    assert len(build_plan(quick=False, fp8=True, seqlens=[8192])) == 8
    with pytest.raises(ValueError, match="two presets"):
        build_plan(quick=True, fp8=True)
    # the FP8-only rows stay out of the 16-bit groups of the full plan, and join its FP8 groups
    full = build_plan(quick=False)
    assert not any("fa3_fp8" in g.kernels for g in full if g.shape.dtype != "fp8")
    assert all("fa3_fp8" in g.kernels and "fa4_fp8_func_h15" in g.kernels for g in full if g.shape.dtype == "fp8")
    # the FP8 SM90 rows outside the preset (levers, probes, the direct call's defaults) stay out of 16-bit groups
    assert not any(name.startswith("fa4_fp8") for g in full if g.shape.dtype != "fp8" for name in g.kernels)
    assert "fa3_bf16" in DEFAULT_KERNELS


def test_cli_fp8_dry_run_and_preset_conflict(capsys):
    rc, out, _ = cli_main(capsys, "--fp8", "--dry-run")
    assert rc == 0 and out.startswith("settings: preset=fp8") and "40 groups" in out
    assert "8K causal fp8 d128 h16 b4" in out and "32K non-causal fp8 d64 h16/4 b1" in out
    assert "map_masks=none" in out and "map points" not in out  # --fp8 leaves the H15 map out by default
    rc, out, _ = cli_main(capsys, "--fp8", "--map-masks", "causal", "--dry-run")
    assert rc == 0 and out.count("fa4_fp8_h15*_t*_n* (8 map points)") == 1
    rc, _, err = cli_main(capsys, "--fp8", "--quick", "--dry-run")
    assert rc == 2 and "presets; choose one" in err


def test_fp8_kernel_rows_and_support_rules():
    from bench.kernels import CUDNN_SCALE_O, FP8_LEVERS, FP8_MAP_KERNELS, GEMM_CEILING_FLOPS, RATIO_PEERS

    hopper, blackwell = (9, 0), (10, 0)
    for name in ("fa3_fp8", "cudnn_fp8", "fa4_fp8_exact", "fa4_fp8_h15", "gemm_fp8") + FP8_MAP_KERNELS:
        assert set(KERNELS[name].tolerances) == {"fp8"}, name
        assert "fp8" in KERNELS[name].unsupported_reason("bf16", hopper)
    for name in ("fa3_fp8", "fa3_bf16", "fa4_fp8_exact", "fa4_fp8_h15", "fa4_fp8_exact_noexp"):
        assert KERNELS[name].unsupported_reason("fp8", hopper) is None
        assert "Hopper" in KERNELS[name].unsupported_reason("fp8", blackwell)
    assert KERNELS["fa4_stock_bf16"].unsupported_reason("fp8", hopper) is None
    assert KERNELS["fa4_stock_bf16"].tolerance("fp8") == KERNELS[BASELINE].tolerance("bf16")  # exact upcast
    gemm, probe = KERNELS["gemm_fp8"], KERNELS["fa4_fp8_exact_noexp"]
    assert not gemm.checked and gemm.flops == GEMM_CEILING_FLOPS == 2 * 8192**3
    assert not probe.checked and probe.flops is None and dict(probe.knobs)["exp2_deleted"] is True
    assert all(KERNELS[name].checked for name in ("fa3_fp8", "cudnn_fp8", "fa4_fp8_h15"))
    assert len(FP8_MAP_KERNELS) == 8
    assert dict(KERNELS["fa4_fp8_h15_fold_t0.4_n224"].knobs) == {
        "softmax_mode": "rowmax_h15",
        "rescale_threshold": 0.4,
        "anchor_rounding": "half_octave",
        "tile_n": 224,
        # the structure a map row names passes in full, so the kernel's tuned defaults change nothing in it
        "intra_wg_overlap": True,
        "row_sum": "fadd",
        "clamp": "max",
        "scheduler_barrier": False,
        "o_store": "pv_columns",
    }
    assert "fa4_fp8_h15_t0_n128" in FP8_MAP_KERNELS and dict(KERNELS["fa4_fp8_exact_n224"].knobs)["tile_n"] == 224
    assert dict(KERNELS["fa4_fp8_exact_n192_b0.25"].knobs) == {
        "softmax_mode": "exact",
        "tile_n": 192,
        "beta": 0.25,
        "intra_wg_overlap": True,
        "row_sum": "fadd",
        "scheduler_barrier": False,
        "o_store": "pv_columns",
    }
    assert "fa4_fp8_exact_n192_b0.125" in FP8_LEVERS and KERNELS["fa4_fp8_exact_n192_b0.125"].checked
    assert dict(KERNELS["fa4_fp8_h15_fold_vote_mma"].knobs) == {
        "softmax_mode": "rowmax_h15",
        "anchor_rounding": "half_octave",
        "rescale_vote": True,
        "row_sum": "mma",
        "pv_accumulation": "single",
        "tile_n": 128,
        "intra_wg_overlap": True,
        "clamp": "max",
        "scheduler_barrier": False,
        "o_store": "pv_columns",
    }
    # the vote skips single-level accumulation's O rescale: every vote row asks for it
    assert all(
        dict(spec.knobs).get("pv_accumulation") == "single"
        for spec in KERNELS.values()
        if spec.family == "fa4_fp8" and dict(spec.knobs).get("rescale_vote")
    )
    # the call a user writes (flash_attn_func, no lever) and the direct call with each P.V accumulation
    assert dict(KERNELS["fa4_fp8_func_exact"].knobs) == {"entry": "flash_attn.cute.flash_attn_func"}
    assert dict(KERNELS["fa4_fp8_func_h15"].knobs)["softmax_mode"] == "rowmax_h15"
    assert KERNELS["fa4_fp8_func_h15"].tolerance("fp8") == KERNELS["fa4_fp8_h15"].tolerance("fp8")
    assert dict(KERNELS["fa4_fp8_exact_noexp_two_level"].knobs)["pv_accumulation"] == "two_level"
    assert not KERNELS["fa4_fp8_exact_noexp_two_level"].checked
    for name in ("fa4_fp8_func_exact", "fa4_fp8_h15_two_level", "vllm_fa3_fp8"):
        assert KERNELS[name].unsupported_reason("fp8", hopper) is None
        assert "Hopper" in KERNELS[name].unsupported_reason("fp8", blackwell)
    cudnn = KERNELS["cudnn_fp8"]
    assert torch.equal(cudnn.output_for_check(torch.full((2,), 64.0).to(torch.float8_e4m3fn)), torch.ones(2))
    assert CUDNN_SCALE_O == 64 and "top-left" in dict(cudnn.knobs)["causal"]
    assert RATIO_PEERS == ("fa3_fp8", "fa4_stock_bf16")
    assert all(f"speedup_vs_{p}" in new_row(make_shape(8192, True, dtype="fp8"), cudnn) for p in RATIO_PEERS)


def test_fp8_binders_upcast_pass_descales_and_refuse_top_left_mismatch():
    from bench.kernels import _cudnn_fp8_binder, _fa3_fp8_binder, _upcast_fp8

    q8 = torch.zeros(2, 16, 4, 64).to(torch.float8_e4m3fn)
    k8 = torch.zeros(2, 32, 2, 64).to(torch.float8_e4m3fn)
    seen = {}

    def fake(q, k, v, causal=False, **kwargs):
        seen.update(dtypes={t.dtype for t in (q, k, v)}, causal=causal, **kwargs)
        return q

    _upcast_fp8(lambda fn, q, k, v, causal: lambda: fn(q, k, v, causal=causal))(fake, q8, k8, k8, True)()
    assert seen["dtypes"] == {torch.bfloat16} and seen["causal"] is True
    seen.clear()
    _fa3_fp8_binder(fake, q8, k8, k8, False)()
    assert seen["dtypes"] == {torch.float8_e4m3fn}
    for name in ("q_descale", "k_descale", "v_descale"):
        assert seen[name].dtype == torch.float32 and tuple(seen[name].shape) == (2, 2) and bool((seen[name] == 1).all())
    with pytest.raises(ValueError, match="top-left"):
        _cudnn_fp8_binder(None, q8, k8, k8, True)  # seqlen_q 16 != seqlen_k 32, causal: refused before cuDNN


def test_e4m3_noise_power_of_gaussian_values_and_softmax_weights():
    """Note [FP8 gate tolerances]: one e4m3 rounding's noise power, measured from torch's rounding."""
    from bench.kernels import E4M3_NOISE_POWER, E4M3_UNIT_ROUNDOFF

    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for values in (x, torch.exp(x - x.max()) * 256):  # N(0, 1); softmax weights with FA4's 2^8 offset
        rounded = values.float().to(torch.float8_e4m3fn).double()
        power = ((rounded - values) ** 2).mean() / (values**2).mean()
        assert power.item() == pytest.approx(E4M3_NOISE_POWER, rel=0.1)
    u = E4M3_UNIT_ROUNDOFF
    assert u**2 / 7 < E4M3_NOISE_POWER < u**2 / 3  # between values uniform in their binade and all at its bottom


def test_fp8_error_model_matches_the_reference_and_fa3s_measurement():
    """The predicted output errors of Note [FP8 gate tolerances] against the CPU reference, and FA3-FP8's 5.3%."""
    from bench.kernels import FA3_FP8_MEASURED_REL_ERROR, H15_WEIGHT_REL_ERROR, fp8_output_error
    from fa4_rowmax.config import SoftmaxConfig
    from fa4_rowmax.reference.attention import attention_reference

    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1024, 4, 128, generator=generator, dtype=torch.float64) for _ in range(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    exact = attention_reference(q, k, v, SoftmaxConfig(tile_n=128, p_dtype=torch.float64), compute_dtype=torch.float64)[
        0
    ]
    fp8 = dict(tile_n=128, max_offset=8, p_dtype=torch.float8_e4m3fn)
    same_inputs = [t.double() for t in (q8, k8, v8)]
    upcast_exact = attention_reference(
        *same_inputs, SoftmaxConfig(tile_n=128, p_dtype=torch.float64), compute_dtype=torch.float64
    )[0]

    def rel(out, ref):
        return ((out.double() - ref).norm() / ref.norm()).item()

    fp8_out = attention_reference(*same_inputs, SoftmaxConfig(**fp8), compute_dtype=torch.float64)[0]
    # against the same FP8 inputs only P's rounding counts (the bench gate's case); measured ~12% below the
    # model: each row's top weight is 2^8, exact in e4m3, and holds ~8% of the row's sum of squared weights here.
    assert rel(fp8_out, upcast_exact) == pytest.approx(fp8_output_error(roundings=1, accumulator=False), rel=0.2)
    # ... against the unrounded inputs Q, K (2), V and P do
    predicted = fp8_output_error(roundings=4, accumulator=False)
    assert rel(fp8_out, exact) == pytest.approx(predicted, rel=0.15)
    assert predicted == pytest.approx(FA3_FP8_MEASURED_REL_ERROR, rel=0.05)  # the H200's FA3-FP8: 5.3%
    h15 = attention_reference(
        q, k, v, SoftmaxConfig(mode="rowmax_h15", tile_n=128, p_dtype=torch.float64), compute_dtype=torch.float64
    )[0]
    assert rel(h15, exact) == pytest.approx(H15_WEIGHT_REL_ERROR, rel=0.25)


def test_fp8_tolerances_follow_the_derivation_and_stay_below_garbage():
    from bench.kernels import ACCUMULATOR_REL_ERROR, E4M3_NOISE_POWER, FP8_EXACT_CAP, fp8_tolerance

    exact, cudnn, h15 = (KERNELS[n].tolerance("fp8") for n in ("fa4_fp8_exact", "cudnn_fp8", "fa4_fp8_h15"))
    assert exact == pytest.approx(min(2 * math.sqrt(E4M3_NOISE_POWER + ACCUMULATOR_REL_ERROR**2), FP8_EXACT_CAP))
    assert KERNELS["fa3_fp8"].tolerance("fp8") == exact == KERNELS[BASELINE].tolerance("fp8")
    assert exact < cudnn < h15 < 0.5  # a kernel ignoring the scores gives ~0.8 (Note [Gate tolerances])
    assert 0.05 < exact <= 0.12 and fp8_tolerance(roundings=100) == FP8_EXACT_CAP
    assert ACCUMULATOR_REL_ERROR == pytest.approx(0.0417, abs=1e-4)


@pytest.mark.gpu(arch="sm90")  # the FP8 peers and the FP8 SM90 kernel are Hopper kernels
def test_fp8_run_times_the_peers_with_ratios(tmp_path):
    proc = run_cli(
        "--fp8",
        "--seqlens",
        "2K",
        "--kernels",
        "gemm_fp8",
        "fa3_fp8",
        "fa3_bf16",
        "cudnn_fp8",
        "fa4_stock_bf16",
        "fa4_fp8_exact",
        "fa4_fp8_h15",
        "--out",
        str(tmp_path),
        "--name",
        "t",
        "--rounds",
        "2",
        "--calls-per-round",
        "2",
        "--no-plots",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_json(str(tmp_path / "t.json"))["rows"]
    by = {(r["kernel"], r["head_dim"], r["heads_kv"], r["causal"]): r for r in rows}
    for (name, *_), row in by.items():
        if name in ("gemm_fp8", "fa3_fp8", "fa3_bf16", "fa4_stock_bf16"):
            assert row["status"] == "ok", row
    gemm = [r for r in rows if r["kernel"] == "gemm_fp8"]
    assert all(800 < r["tflops"] < 2500 and r["check"] is None and r["speedup_vs_fa3_fp8"] is None for r in gemm)
    fa3 = [r for r in rows if r["kernel"] == "fa3_fp8"]
    assert all(r["check"]["passed"] and r["check"]["rel_err"] < 0.06 for r in fa3), fa3
    fa4_bf16 = [r for r in rows if r["kernel"] == "fa4_stock_bf16"]
    assert all(r["speedup_vs_fa3_fp8"] is not None and r["speedup_vs_fa3_fp8"] < 1.0 for r in fa4_bf16), fa4_bf16


def test_fa4_rows_without_a_mode_pin_exact_on_the_patched_call(monkeypatch):
    """A row with no softmax_mode (fa4_stock, FA4 on upcast FP8, fa4_fp8_func_exact) is the exact baseline: with the
    process-wide mode set it still calls the patched FA4 with softmax_mode='exact' (the patch's None would take the
    process mode); a stock FA4, which has no such argument, gets none. The patched signature is FA4's own."""
    from flash_attn.cute import flash_attn_func

    from bench.kernels import _fa4_binder
    from fa4_rowmax.interface import is_fa4_patched

    assert is_fa4_patched(), "the suite runs against the patched FA4 (scripts/setup.sh)"
    monkeypatch.setenv("FA4_ROWMAX_SOFTMAX_MODE", "rowmax_h15")
    seen = []

    def patched(q, k, v, causal=False, softmax_mode=None, **kwargs):
        seen.append(softmax_mode)
        return q

    def stock(q, k, v, causal=False, **kwargs):
        seen.append(kwargs.get("softmax_mode", "absent"))
        return q

    assert "softmax_mode" in inspect.signature(flash_attn_func).parameters  # the stand-in's signature is FA4's
    x = torch.zeros(1)
    for fn in (patched, stock):
        _fa4_binder({})(fn, x, x, x, True)()
    _fa4_binder({"softmax_mode": "rowmax_h15"})(patched, x, x, x, True)()
    assert seen == ["exact", "absent", "rowmax_h15"]


def test_code_digest_names_the_code_and_nothing_else(tmp_path):
    """Note [Code digest]: equal trees give equal digests; changing a code file, adding one or renaming one changes
    it; caches, results and files outside CODE_DIRS do not."""
    for rel, text in {
        "fa4_rowmax/a.py": "x = 1\n",
        "patches/0001.diff": "--- a\n",
        "bench/results/r.json": "{}",
        "README.md": "doc",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    before = env_info.code_digest(str(tmp_path))
    assert before == env_info.code_digest(str(tmp_path)) and len(before) == 64
    (tmp_path / "bench/results/r.json").write_text('{"new": 1}')
    (tmp_path / "README.md").write_text("other doc")
    (tmp_path / "fa4_rowmax/__pycache__").mkdir()
    (tmp_path / "fa4_rowmax/__pycache__/a.cpython-311.py").write_text("cache")
    assert env_info.code_digest(str(tmp_path)) == before
    (tmp_path / "fa4_rowmax/a.py").write_text("x = 2\n")
    changed = env_info.code_digest(str(tmp_path))
    assert changed != before
    (tmp_path / "fa4_rowmax/a.py").rename(tmp_path / "fa4_rowmax/b.py")
    assert env_info.code_digest(str(tmp_path)) not in (before, changed)
    (tmp_path / "fa4_rowmax/b.py").rename(tmp_path / "fa4_rowmax/a.py")
    assert env_info.code_digest(str(tmp_path)) == changed
    (tmp_path / "aiter_fused").mkdir()
    (tmp_path / "aiter_fused/k.py").write_text("")
    assert env_info.code_digest(str(tmp_path)) != changed


def test_code_digest_of_this_checkout_is_what_the_cli_prints():
    out = subprocess.run(
        [sys.executable, "-m", "bench.env_info"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()
    assert out == env_info.code_digest()
