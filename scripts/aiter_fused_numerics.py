"""GPU numerics check of the Fused-Softmax Triton kernel (aiter_fused) in one command.

For every MX format, causal and not, head_dim 64 and 128, MHA and GQA, odd sequence lengths, dense
and varlen, and every dot mode (``aiter_fused.attention.DOT_MODES``: "fp8" = FP8 tensor-core dots
with the block scales outside, the Hopper default; "bf16" = BF16 dots on exactly dequantized
operands; "scaled" = ``tl.dot_scaled``, emulated by Triton below Blackwell):
  - kernel vs the pure reference (fa4_rowmax.reference.fused_softmax, run on the same GPU in fp32): relative
    output error, LSE difference (max, 99th percentile and median over rows), recovery counts equal;
    pass/fail against rounding tolerances: the same output tolerance for every mode, and for the LSE
    the fp32-summation tolerance in "bf16"/"scaled" but Note [FP8 LSE tolerance] in "fp8";
  - kernel vs BF16 attention (the kernel's own exact build, and a torch fp32 softmax reference):
    relative output error ||O - O_bf16||_F / ||O_bf16||_F per format and dot mode;
  - the FP8 path vs the BF16 path on the same inputs (what Hopper's FP8 accumulation changes);
  - an indicative timing of the fused kernel per dot mode vs its exact build at one long shape, and of
    the MX quantization pre-pass (aiter_fused.quantize) alone.
Writes ``numerics.json`` and ``numerics.log`` to the directory given on the command line; exits 1 if
any check fails. ``--quick`` (one dense shape, which shares its kernel builds with the varlen case,
MXFP8 and MXFP4, fewer timings) is sized to finish in about a minute on an H200.

Usage: python scripts/aiter_fused_numerics.py OUT_DIR [--quick]

Tolerances: aiter_fused/tolerances.py (Note [FP8 LSE tolerance] there).
"""

import argparse
import json
import math
import sys
import zlib
from pathlib import Path
from statistics import mean

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiter_fused.attention import (  # noqa: E402
    DOT_MODES,
    _default_dot_mode,
    fused_softmax_attention,
    fused_softmax_attention_varlen,
)
from aiter_fused.launch import arch_of, launch_for  # noqa: E402
from aiter_fused.quantize import quantize_head_dim, quantize_keys  # noqa: E402
from aiter_fused.tolerances import OUT_REL_TOL, lse_ok, lse_stats  # noqa: E402
from fa4_rowmax.reference.fused_softmax import (  # noqa: E402
    MX_FORMATS,
    fused_softmax_attention_reference,
    fused_softmax_attention_reference_varlen,
)


def log(lines, text):
    """Print, keep and append to the log file at once (a run cut off by a timeout keeps its lines)."""
    print(text, flush=True)
    lines.append(text)
    with open(lines.path, "a") as handle:
        handle.write(text + "\n")


class LogLines(list):
    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        path.write_text("")


def _kernel_tile() -> int:
    """The tile the kernel uses when none is passed (the launch table's, Note [Launch table] in
    aiter_fused/launch.py: 64 on gfx950, 128 on the H200); the reference must use the same one."""
    return launch_for(torch.device("cuda"))[1].tile_n


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def lse_text(stats):
    return f"lse {stats['lse_max_diff']:.1e} (p99 {stats['lse_p99_diff']:.1e}, median {stats['lse_median_diff']:.1e})"


def torch_attention(q, k, v, causal):
    """fp32 softmax attention (dense layout, GQA, bottom-right causal)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.float().repeat_interleave(group, 2), v.float().repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = torch.arange(sk, device=q.device)[None, :] > torch.arange(sq, device=q.device)[:, None] + sk - sq
        s = s.masked_fill(mask, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1).nan_to_num(0.0), v)


def check_dense(shape, causal, fmt, lines):
    """One dense problem, every dot mode on the same inputs. Returns one result per mode."""
    batch, sq, sk, hq, hk, d = shape
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((shape, causal, fmt)).encode()))
    q = torch.randn(batch, sq, hq, d, device="cuda", generator=gen).bfloat16()
    k = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).bfloat16()
    ref_out, ref_lse, counters = fused_softmax_attention_reference(
        q, k, v, causal=causal, mx_format=fmt, return_counters=True, tile_n=_kernel_tile()
    )
    exact_out, _ = fused_softmax_attention(q, k, v, causal=causal, exact=True)
    fp32_out = torch_attention(q, k, v, causal)
    outs, results = {}, []
    for mode in DOT_MODES:
        out, lse, rec = fused_softmax_attention(
            q, k, v, causal=causal, mx_format=fmt, dot_mode=mode, return_recoveries=True
        )
        outs[mode] = out
        case = (*shape, causal, fmt, mode)
        result = {
            "case": dict(
                zip(
                    [
                        "batch",
                        "seqlen_q",
                        "seqlen_k",
                        "heads_q",
                        "heads_k",
                        "head_dim",
                        "causal",
                        "mx_format",
                        "dot_mode",
                    ],
                    case,
                )
            ),
            "rel_vs_reference": rel(out.float(), ref_out),
            **lse_stats(lse, ref_lse),
            "recoveries_equal": bool(torch.equal(rec.long(), counters["recoveries"])),
            "recoveries": int(counters["recoveries"].sum()),
            "rel_vs_bf16_exact_build": rel(out.float(), exact_out.float()),
            "rel_vs_fp32_attention": rel(out.float(), fp32_out),
            "rel_exact_build_vs_fp32_attention": rel(exact_out.float(), fp32_out),
            "finite": bool(torch.isfinite(out.float()).all()),
        }
        if mode == "fp8":
            result["rel_vs_bf16_dot_mode"] = rel(out.float(), outs["bf16"].float())
        result["pass"] = (
            result["rel_vs_reference"] < OUT_REL_TOL
            and lse_ok(mode, fmt, result)
            and result["recoveries_equal"]
            and result["finite"]
            and result["rel_exact_build_vs_fp32_attention"] < OUT_REL_TOL
        )
        extra = f", fp8 vs bf16 mode {result['rel_vs_bf16_dot_mode']:.2e}" if mode == "fp8" else ""
        log(
            lines,
            f"{'PASS' if result['pass'] else 'FAIL'} dense {case}: vs ref {result['rel_vs_reference']:.2e}, "
            f"{lse_text(result)}, rec {result['recoveries_equal']}, vs BF16 "
            f"{100 * result['rel_vs_bf16_exact_build']:.2f}%{extra}",
        )
        results.append(result)
    return results


def check_varlen(fmt, causal, dot_mode, lines):
    gen = torch.Generator(device="cuda").manual_seed(7)
    lens_q, lens_k = [1, 77, 300, 0, 129], [5, 200, 300, 17, 64]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", generator=gen).bfloat16()
    k = torch.randn(sum(lens_k), 2, 128, device="cuda", generator=gen).bfloat16()
    v = torch.randn(sum(lens_k), 2, 128, device="cuda", generator=gen).bfloat16()
    out, lse = fused_softmax_attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, mx_format=fmt, dot_mode=dot_mode, validate=False
    )
    ref_out, ref_lse = fused_softmax_attention_reference_varlen(
        q, k, v, cu_q, cu_k, causal=causal, mx_format=fmt, tile_n=_kernel_tile()
    )
    result = {
        "case": {
            "varlen": True,
            "lens_q": lens_q,
            "lens_k": lens_k,
            "causal": causal,
            "mx_format": fmt,
            "dot_mode": dot_mode,
        },
        "rel_vs_reference": rel(out.float(), ref_out),
        **lse_stats(lse, ref_lse),
        "masked_rows_ok": bool(torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))),
    }
    result["pass"] = (
        result["rel_vs_reference"] < OUT_REL_TOL and lse_ok(dot_mode, fmt, result) and result["masked_rows_ok"]
    )
    log(
        lines,
        f"{'PASS' if result['pass'] else 'FAIL'} varlen {fmt} causal={causal} dot_mode={dot_mode}: "
        f"vs ref {result['rel_vs_reference']:.2e}, {lse_text(result)}",
    )
    return result


def time_ms(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--quick", action="store_true", help="fewer cases (about a minute on an H200)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a GPU (torch.cuda.is_available() is False)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    lines = LogLines(args.out_dir / "numerics.log")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    results["triton"] = triton.__version__
    results["default_dot_mode"] = _default_dot_mode(arch_of(torch.device("cuda")))
    log(
        lines,
        f"device {results['device']}, torch {results['torch']}, triton {results['triton']}, "
        f"default dot_mode {results['default_dot_mode']}",
    )

    shapes = [(1, 1000, 1000, 8, 8, 128), (2, 333, 517, 8, 2, 64), (1, 129, 1031, 4, 1, 128), (1, 600, 250, 4, 4, 64)]
    formats = MX_FORMATS
    if args.quick:  # GQA group 4 and head_dim 128 like the varlen case: both share their kernel builds
        shapes, formats = [(1, 129, 1031, 4, 1, 128)], ("mxfp8", "mxfp4")
    dense = []
    for shape in shapes:
        for causal in (False, True):
            for fmt in formats:
                dense.extend(check_dense(shape, causal, fmt, lines))
    varlen = [
        check_varlen(fmt, causal, mode, lines) for fmt in formats for causal in (False, True) for mode in DOT_MODES
    ]
    results["dense"], results["varlen"] = dense, varlen

    def noncausal(mode, fmt):
        return [
            r
            for r in dense
            if r["case"]["mx_format"] == fmt and r["case"]["dot_mode"] == mode and not r["case"]["causal"]
        ]

    summary = {}
    for mode in DOT_MODES:
        summary[mode] = {
            fmt: {
                "rel_error_vs_bf16_pct_mean": 100 * mean(r["rel_vs_bf16_exact_build"] for r in noncausal(mode, fmt)),
                "rel_vs_reference_max": max(r["rel_vs_reference"] for r in noncausal(mode, fmt)),
            }
            for fmt in formats
        }
        log(
            lines,
            f"dot_mode {mode}: relative error vs BF16 attention (non-causal, mean) / kernel vs reference "
            "(max): "
            + ", ".join(
                f"{fmt} {v['rel_error_vs_bf16_pct_mean']:.2f}% / {v['rel_vs_reference_max']:.1e}"
                for fmt, v in summary[mode].items()
            ),
        )
    fp8_vs_bf16 = max(r["rel_vs_bf16_dot_mode"] for r in dense if r["case"]["dot_mode"] == "fp8")
    summary["fp8_vs_bf16_dot_mode_rel_max"] = fp8_vs_bf16
    results["summary_noncausal"] = summary
    log(lines, f"fp8 vs bf16 dot mode, same inputs: largest relative difference {fp8_vs_bf16:.2e}")

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 8192, 16, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
    cu = torch.tensor([0, 8192], dtype=torch.int32, device="cuda")
    iters = 5 if args.quick else 20
    timing = {
        "shape": "batch 1, seqlen 8192, 16 heads, head_dim 128, non-causal",
        "exact_ms": time_ms(lambda: fused_softmax_attention(q, k, v, exact=True), iters),
        "mxfp8_prepass_ms": time_ms(
            lambda: (
                quantize_head_dim(q[0], "e4m3"),
                quantize_head_dim(k[0], "e4m3"),
                quantize_keys(v[0], "e4m3", cu, keys_contiguous=True),
            ),
            iters,
        ),
    }
    timed = [("mxfp8", "fp8"), ("mxfp8", "bf16")] if args.quick else [(f, m) for f in MX_FORMATS for m in DOT_MODES]
    for fmt, mode in timed:
        timing[f"{fmt}_{mode}_ms"] = time_ms(
            lambda: fused_softmax_attention(q, k, v, mx_format=fmt, dot_mode=mode), iters
        )
    results["timing_indicative"] = timing
    log(
        lines,
        "indicative timing, ms per call (each mode includes the MX pre-pass, timed alone as prepass): "
        + ", ".join(f"{key} {val:.2f}" for key, val in timing.items() if key != "shape"),
    )

    failed = [r for r in dense + varlen if not r["pass"]]
    results["all_pass"] = not failed
    log(lines, f"{len(dense) + len(varlen) - len(failed)} passed, {len(failed)} failed")
    (args.out_dir / "numerics.json").write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
