#!/usr/bin/env python3
"""The FA4 gate run on a GPU: patch the installed FA4, then judge the real kernels.

    python scripts/fa4_gate_run.py --out DIR [--quick]

Steps (each recorded in DIR/fa4_gates.json and DIR/fa4_gates.log; a failing step does not stop the others):
1. A stock copy of the installed FA4 is saved, then the patches are applied to the installed FA4
   (fa4_rowmax/patching.py; idempotent).
2. `exact` == stock, bit for bit: fixed inputs run through the patched FA4 (softmax_mode="exact", passed so that
   a process-wide mode cannot reach it) in this process and through the stock copy in a subprocess; out and lse
   must be identical.
3. `rowmax_h15` (and `rowmax_pot`, `rescale_threshold`) against the semantic reference
   (fa4_rowmax.reference.attention.attention_reference with the kernel's tile size and threshold): single- and
   multi-tile, causal and not, seqlens off the tile grid, GQA, varlen, causal with seqlen_q > seqlen_k
   (fully masked rows), extreme score ranges. Out within rounding of the reference, LSE too, no NaN/Inf.
4. The correctness gates (fa4_rowmax.gates.gates.run_gates) through the kernels: Rowmax-H15 (single-tile gate
   against the reference, multi-tile gates), exact as the control (multi-tile gates must pass too).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fa4_rowmax import patching as fa4_patch  # noqa: E402

LOG: list[str] = []


def log(message: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    LOG.append(line)


def make_inputs(
    seed: int,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    heads_q: int,
    heads_k: int,
    head_dim: int,
    dtype,
    q_std: float = 1.0,
):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(batch, seqlen_q, heads_q, head_dim, device="cuda", generator=gen) * q_std).to(dtype)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", generator=gen).to(dtype)
    return q, k, v


# (name, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, causal, q_std)
CASES = [
    ("single-tile causal 128", 1, 128, 128, 1, 1, 128, True, 3.0),
    ("single-tile non-causal 100x77", 1, 100, 77, 2, 2, 128, False, 3.0),
    ("multi-tile causal 512", 1, 512, 512, 2, 2, 128, True, 3.0),
    ("multi-tile non-causal 509x300 GQA", 2, 509, 300, 8, 2, 128, False, 3.0),
    ("causal 300x509 (sq<sk) GQA", 1, 300, 509, 4, 2, 128, True, 3.0),
    ("causal 509x300 (fully masked rows)", 1, 509, 300, 2, 1, 128, True, 3.0),
    ("head dim 64 causal 333", 2, 333, 333, 4, 4, 64, True, 3.0),
    ("extreme scores q*30 causal 384", 1, 384, 384, 2, 2, 128, True, 30.0),
]
QUICK_CASES = CASES[:4] + CASES[5:6]
VARLEN_SEQLENS = [(1, 1), (129, 300), (255, 17), (0, 64), (400, 400)]


def exact_vs_stock(stock_site: Path, workdir: Path, cases) -> dict:
    """Patched FA4 in `exact` mode against the stock copy (a subprocess), bit for bit."""
    import torch
    from flash_attn.cute import flash_attn_func

    results = {}
    inputs_path = workdir / "exact_inputs.pt"
    saved = {}
    for name, batch, sq, sk, hq, hk, d, causal, q_std in cases:
        for dtype in (torch.bfloat16, torch.float16):
            key = f"{name} {str(dtype)[6:]}"
            q, k, v = make_inputs(1, batch, sq, sk, hq, hk, d, dtype, q_std)
            # Explicit: the patched default (None) would take FA4_ROWMAX_SOFTMAX_MODE or an open softmax_mode_scope
            # (Note [Process-wide softmax mode]). The stock copy below takes no softmax_mode and reads none of the
            # FA4_ROWMAX_* variables, so its subprocess may inherit the environment as it is.
            out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, softmax_mode="exact")
            saved[key] = dict(q=q.cpu(), k=k.cpu(), v=v.cpu(), causal=causal, out=out.cpu(), lse=lse.cpu())
    torch.save(saved, inputs_path)
    code = (
        "import sys, torch\n"
        "import flash_attn.cute.interface as fi, inspect\n"
        "assert 'softmax_mode' not in inspect.signature(fi.flash_attn_func).parameters, 'stock copy is patched'\n"
        f"saved = torch.load({str(inputs_path)!r})\n"
        "res = {}\n"
        "for key, s in saved.items():\n"
        "    out, lse = fi.flash_attn_func(s['q'].cuda(), s['k'].cuda(), s['v'].cuda(), causal=s['causal'],\n"
        "                                  return_lse=True)\n"
        "    res[key] = (torch.equal(out.cpu(), s['out']),\n"
        "                torch.equal(lse.cpu().nan_to_num(), s['lse'].nan_to_num()),\n"
        "                float((out.cpu().float() - s['out'].float()).abs().max()))\n"
        f"torch.save(res, {str(workdir / 'exact_result.pt')!r})\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stock_site), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        raise RuntimeError(f"stock subprocess failed:\n{proc.stderr[-3000:]}")
    for key, (out_eq, lse_eq, diff) in torch.load(workdir / "exact_result.pt").items():
        results[key] = dict(out_bitwise_equal=out_eq, lse_bitwise_equal=lse_eq, max_abs_diff=diff)
        log(f"exact==stock {key}: out {out_eq} lse {lse_eq}")
    return results


def compare_to_reference(mode: str, rescale_threshold, cases, arch: int) -> dict:
    """Kernel vs attention_reference with the kernel's semantics (tile 128, its threshold)."""
    import torch
    from flash_attn.cute import flash_attn_func

    from fa4_rowmax.config import SoftmaxConfig
    from fa4_rowmax.reference.attention import attention_reference

    threshold = rescale_threshold if rescale_threshold is not None else (0.0 if arch // 10 == 9 else 8.0)
    results = {}
    for name, batch, sq, sk, hq, hk, d, causal, q_std in cases:
        dtype = torch.bfloat16
        q, k, v = make_inputs(2, batch, sq, sk, hq, hk, d, dtype, q_std)
        with torch.no_grad():
            out, lse = flash_attn_func(
                q, k, v, causal=causal, return_lse=True, softmax_mode=mode, rescale_threshold=rescale_threshold
            )
        # SM90 tiles: 128 keys for head dim 128, 128 for 64 too (interface._tile_size_fwd_sm90).
        config = SoftmaxConfig(mode=mode, tile_n=128, rescale_threshold=threshold)
        out_ref, lse_ref = attention_reference(q, k, v, config, causal=causal)
        results[name] = summarize(out, lse, out_ref, lse_ref, dtype)
        log(f"{mode} thr={rescale_threshold} {name}: {results[name]}")
    return results


def summarize(out, lse, out_ref, lse_ref, dtype) -> dict:
    """Max |out - ref| in units of the output dtype's ulp at each row's scale, LSE difference, NaN/Inf."""
    import torch

    out_f, ref_f = out.float(), out_ref.float()
    finite_rows = torch.isfinite(lse_ref)  # (b, h, s)
    row_scale = ref_f.abs().amax(dim=-1).clamp_min(1e-30)  # (b, s, h)
    eps = torch.finfo(dtype).eps
    err = (out_f - ref_f).abs().amax(dim=-1) / (row_scale * eps)  # in ulps of the row's largest entry
    err = err.transpose(1, 2)[finite_rows] if out.dim() == 4 else err.transpose(0, 1)[finite_rows]
    lse_diff = (lse - lse_ref)[finite_rows].abs()
    masked_rows = ~finite_rows
    masked_out = (
        out.float().transpose(1, 2)[masked_rows] if out.dim() == 4 else out.float().transpose(0, 1)[masked_rows]
    )
    return dict(
        rows=int(finite_rows.sum()),
        out_err_ulp_max=float(err.max()) if err.numel() else 0.0,
        out_err_ulp_p999=float(err.quantile(0.999)) if err.numel() else 0.0,
        rows_over_4ulp=int((err > 4).sum()),
        lse_abs_diff_max=float(lse_diff.max()) if lse_diff.numel() else 0.0,
        out_nan_or_inf=int((~torch.isfinite(out.float())).sum()),
        lse_nan=int(torch.isnan(lse).sum()),
        fully_masked_rows=int(masked_rows.sum()),
        fully_masked_rows_ok=bool((masked_out == 0).all() and torch.isneginf(lse[masked_rows]).all()),
    )


def varlen_vs_reference(mode: str) -> dict:
    import torch
    from flash_attn.cute import flash_attn_varlen_func

    from fa4_rowmax.config import SoftmaxConfig
    from fa4_rowmax.reference.attention import attention_reference

    seqlens_q = [s for s, _ in VARLEN_SEQLENS]
    seqlens_k = [s for _, s in VARLEN_SEQLENS]
    cu_q = torch.tensor([0] + list(__import__("itertools").accumulate(seqlens_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(__import__("itertools").accumulate(seqlens_k)), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = (torch.randn(int(cu_q[-1]), 4, 128, device="cuda", generator=gen) * 3).bfloat16()
    k = torch.randn(int(cu_k[-1]), 2, 128, device="cuda", generator=gen).bfloat16()
    v = torch.randn(int(cu_k[-1]), 2, 128, device="cuda", generator=gen).bfloat16()
    results = {}
    for causal in (False, True):
        with torch.no_grad():
            out, lse = flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max(seqlens_q),
                max_seqlen_k=max(seqlens_k),
                causal=causal,
                return_lse=True,
                softmax_mode=mode,
            )
        config = SoftmaxConfig(mode=mode, tile_n=128, rescale_threshold=0.0)
        out_ref, lse_ref = attention_reference(q, k, v, config, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        results[f"varlen causal={causal}"] = summarize(out, lse, out_ref, lse_ref, torch.bfloat16)
        log(f"varlen {mode} causal={causal}: {results[f'varlen causal={causal}']}")
    return results


def gates(mode: str, quick: bool) -> dict:
    import torch

    from fa4_rowmax.config import SoftmaxConfig
    from fa4_rowmax.gates.gates import format_report, run_gates
    from fa4_rowmax.interface import fa4_backend
    from fa4_rowmax.reference.attention import attention_reference

    backend = fa4_backend(mode)
    reference = None
    if mode == "rowmax_h15":
        reference = functools.partial(attention_reference, config=SoftmaxConfig(mode="rowmax_h15", tile_n=128))
    seeds = (0,) if quick else (0, 1, 2)
    reports = run_gates(backend, reference, dtype=torch.bfloat16, device="cuda", seeds=seeds)
    log(f"gates {mode}:\n" + format_report(reports, title=f"FA4 {mode} on the GPU"))
    return {
        "passed": all(r.passed for r in reports),
        "reports": [
            dict(
                name=r.name,
                setup=r.setup,
                passed=r.passed,
                worst=r.worst,
                bound=list(r.bound),
                where=r.where,
                n_elements=r.n_elements,
                checks=[
                    dict(name=c.name, passed=c.passed, worst=c.worst, bound=list(c.bound), note=c.note)
                    for c in r.checks
                ],
            )
            for r in reports
        ],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and seeds")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    steps: dict = {}
    workdir = Path(tempfile.mkdtemp(prefix="fa4_gate_"))

    def step(name, fn, *a, **k):
        start = time.time()
        try:
            steps[name] = {"ok": True, "result": fn(*a, **k)}
        except Exception as err:  # recorded, and the run goes on to the next step
            steps[name] = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            log(f"step {name} FAILED: {err}\n{traceback.format_exc()}")
        steps[name]["seconds"] = round(time.time() - start, 1)

    site = fa4_patch.default_site()
    stock_site = fa4_patch.copy_package(site, workdir / "fa4_stock", state="stock")
    changed = fa4_patch.apply(site)
    log(f"FA4 {fa4_patch.installed_version(site)} in {site}: patched ({len(changed)} files changed now)")

    import torch

    report["gpu"] = torch.cuda.get_device_name()
    report["capability"] = torch.cuda.get_device_capability()
    report["torch"] = torch.__version__
    arch = report["capability"][0] * 10 + report["capability"][1]
    report["settings"] = dict(
        dtype="bf16 (exact==stock also fp16)",
        tile_n=128,
        quick=args.quick,
        default_rescale_threshold=0.0 if arch // 10 == 9 else 8.0,
    )
    cases = QUICK_CASES if args.quick else CASES
    step("exact_equals_stock", exact_vs_stock, stock_site, workdir, cases)
    step("rowmax_h15_vs_reference", compare_to_reference, "rowmax_h15", None, cases, arch)
    step("rowmax_h15_threshold8_vs_reference", compare_to_reference, "rowmax_h15", 8.0, cases[:4], arch)
    step("rowmax_h15_beta0.5_vs_reference", lambda: compare_h15_beta(cases[:3], arch))
    step("rowmax_pot_vs_reference", compare_to_reference, "rowmax_pot", None, cases[:4], arch)
    step("varlen_rowmax_h15", varlen_vs_reference, "rowmax_h15")
    step("gates_rowmax_h15", gates, "rowmax_h15", args.quick)
    step("gates_exact_control", gates, "exact", True)
    report["steps"] = steps
    report["verdict"] = verdict(steps)
    (args.out / "fa4_gates.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "fa4_gates.log").write_text("\n".join(LOG) + "\n")
    log(f"verdict: {json.dumps(report['verdict'])}")
    return 0 if all(report["verdict"].values()) else 1


def compare_h15_beta(cases, arch):
    """beta selects instructions, not values: beta=0.5 must give the same out/lse as beta=1 (default)."""
    import torch
    from flash_attn.cute import flash_attn_func

    results = {}
    for name, batch, sq, sk, hq, hk, d, causal, q_std in cases:
        q, k, v = make_inputs(4, batch, sq, sk, hq, hk, d, torch.bfloat16, q_std)
        with torch.no_grad():
            a = flash_attn_func(q, k, v, causal=causal, return_lse=True, softmax_mode="rowmax_h15")
            b = flash_attn_func(q, k, v, causal=causal, return_lse=True, softmax_mode="rowmax_h15", beta=0.5)
        results[name] = dict(
            out_bitwise_equal=torch.equal(a[0], b[0]), lse_max_abs_diff=float((a[1] - b[1]).nan_to_num().abs().max())
        )
        log(f"h15 beta=0.5 vs 1 {name}: {results[name]}")
    return results


def verdict(steps) -> dict:
    v = {name: s["ok"] for name, s in steps.items()}
    if steps["exact_equals_stock"]["ok"]:
        v["exact_equals_stock"] = all(
            r["out_bitwise_equal"] and r["lse_bitwise_equal"] for r in steps["exact_equals_stock"]["result"].values()
        )
    for name in (
        "rowmax_h15_vs_reference",
        "rowmax_h15_threshold8_vs_reference",
        "rowmax_pot_vs_reference",
        "varlen_rowmax_h15",
    ):
        if steps[name]["ok"]:
            rs = steps[name]["result"].values()
            v[name] = all(
                r["out_nan_or_inf"] == 0
                and r["lse_nan"] == 0
                and r["fully_masked_rows_ok"]
                and r["rows_over_4ulp"] <= max(1, r["rows"] // 1000)
                and r["lse_abs_diff_max"] < 1e-2
                for r in rs
            )
    for name in ("gates_rowmax_h15", "gates_exact_control"):
        if steps[name]["ok"]:
            v[name] = steps[name]["result"]["passed"]
    return v


if __name__ == "__main__":
    sys.exit(main())
