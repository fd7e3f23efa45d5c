"""GPU numerics check of the Fused-Softmax Triton kernel (aiter_fused) in one command.

For every MX format, causal and not, head_dim 64 and 128, MHA and GQA, odd sequence lengths, dense
and varlen, and both dot strategies (``dot_scaled`` and BF16 dots on dequantized operands):
  - kernel vs the pure reference (fa4_rowmax.fused_softmax, run on the same GPU in fp32): relative
    output error, max LSE difference, recovery counts equal; pass/fail against rounding tolerances;
  - kernel vs BF16 attention (the kernel's own exact build, and a torch fp32 softmax reference):
    relative output error ||O - O_bf16||_F / ||O_bf16||_F per format;
  - an indicative timing of the fused kernel vs its exact build at one long shape.
Writes ``numerics.json`` and ``numerics.log`` to the directory given on the command line; exits 1 if
any check fails.

Usage: python scripts/aiter_fused_numerics.py OUT_DIR [--quick]
"""

import argparse
import json
import math
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiter_fused.attention import fused_softmax_attention, fused_softmax_attention_varlen  # noqa: E402
from fa4_rowmax.fused_softmax import (  # noqa: E402
    MX_FORMATS,
    fused_softmax_attention_reference,
    fused_softmax_attention_reference_varlen,
)

OUT_REL_TOL = 6e-3  # BF16 output rounding plus rare one-step P flips from the fp32 dot order
LSE_TOL = 2e-3


def log(lines, text):
    print(text, flush=True)
    lines.append(text)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


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


def check_dense(case, lines):
    batch, sq, sk, hq, hk, d, causal, fmt, dot_scaled = case
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr(case).encode()))
    q = torch.randn(batch, sq, hq, d, device="cuda", generator=gen).bfloat16()
    k = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).bfloat16()
    out, lse, rec = fused_softmax_attention(q, k, v, causal=causal, mx_format=fmt, dot_scaled=dot_scaled,
                                            return_recoveries=True)
    ref_out, ref_lse, counters = fused_softmax_attention_reference(q, k, v, causal=causal, mx_format=fmt,
                                                                   return_counters=True)
    exact_out, _ = fused_softmax_attention(q, k, v, causal=causal, exact=True)
    finite = torch.isfinite(ref_lse)
    result = {
        "case": dict(zip(["batch", "seqlen_q", "seqlen_k", "heads_q", "heads_k", "head_dim", "causal", "mx_format",
                          "dot_scaled"], case)),
        "rel_vs_reference": rel(out.float(), ref_out),
        "lse_max_diff": (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0,
        "recoveries_equal": bool(torch.equal(rec.long(), counters["recoveries"])),
        "rel_vs_bf16_exact_build": rel(out.float(), exact_out.float()),
        "rel_vs_fp32_attention": rel(out.float(), torch_attention(q, k, v, causal)),
        "rel_exact_build_vs_fp32_attention": rel(exact_out.float(), torch_attention(q, k, v, causal)),
        "finite": bool(torch.isfinite(out.float()).all()),
    }
    result["pass"] = (result["rel_vs_reference"] < OUT_REL_TOL and result["lse_max_diff"] < LSE_TOL
                      and result["recoveries_equal"] and result["finite"]
                      and result["rel_exact_build_vs_fp32_attention"] < OUT_REL_TOL)
    log(lines, f"{'PASS' if result['pass'] else 'FAIL'} dense {case}: vs ref {result['rel_vs_reference']:.2e}, "
               f"lse {result['lse_max_diff']:.1e}, rec {result['recoveries_equal']}, vs BF16 "
               f"{100 * result['rel_vs_bf16_exact_build']:.2f}%")
    return result


def check_varlen(fmt, causal, dot_scaled, lines):
    gen = torch.Generator(device="cuda").manual_seed(7)
    lens_q, lens_k = [1, 77, 300, 0, 129], [5, 200, 300, 17, 64]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", generator=gen).bfloat16()
    k = torch.randn(sum(lens_k), 2, 128, device="cuda", generator=gen).bfloat16()
    v = torch.randn(sum(lens_k), 2, 128, device="cuda", generator=gen).bfloat16()
    out, lse = fused_softmax_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                              mx_format=fmt, dot_scaled=dot_scaled)
    ref_out, ref_lse = fused_softmax_attention_reference_varlen(q, k, v, cu_q, cu_k, causal=causal, mx_format=fmt)
    finite = torch.isfinite(ref_lse)
    result = {"case": {"varlen": True, "lens_q": lens_q, "lens_k": lens_k, "causal": causal, "mx_format": fmt,
                       "dot_scaled": dot_scaled},
              "rel_vs_reference": rel(out.float(), ref_out),
              "lse_max_diff": (lse[finite] - ref_lse[finite]).abs().max().item(),
              "masked_rows_ok": bool(torch.equal(torch.isfinite(lse), finite))}
    result["pass"] = (result["rel_vs_reference"] < OUT_REL_TOL and result["lse_max_diff"] < LSE_TOL
                      and result["masked_rows_ok"])
    log(lines, f"{'PASS' if result['pass'] else 'FAIL'} varlen {fmt} causal={causal} dot_scaled={dot_scaled}: "
               f"vs ref {result['rel_vs_reference']:.2e}, lse {result['lse_max_diff']:.1e}")
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
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a GPU (torch.cuda.is_available() is False)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    lines, results = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    results["triton"] = triton.__version__
    log(lines, f"device {results['device']}, torch {results['torch']}, triton {results['triton']}")

    shapes = [(1, 1000, 1000, 8, 8, 128), (2, 333, 517, 8, 2, 64), (1, 129, 1031, 4, 1, 128), (1, 600, 250, 4, 4, 64)]
    if args.quick:
        shapes = shapes[1:3]
    dense = []
    for shape in shapes:
        for causal in (False, True):
            for fmt in MX_FORMATS:
                for dot_scaled in (False, True):
                    dense.append(check_dense((*shape, causal, fmt, dot_scaled), lines))
    varlen = [check_varlen(fmt, causal, ds, lines) for fmt in MX_FORMATS for causal in (False, True)
              for ds in (False, True)]
    results["dense"], results["varlen"] = dense, varlen

    per_format = {}
    for fmt in MX_FORMATS:
        errors = [r["rel_vs_bf16_exact_build"] for r in dense if r["case"]["mx_format"] == fmt
                  and not r["case"]["causal"]]
        per_format[fmt] = 100 * sum(errors) / len(errors)
    results["rel_error_vs_bf16_pct_noncausal_mean"] = per_format
    log(lines, "relative error vs BF16 attention (non-causal cases, mean): "
        + ", ".join(f"{f} {e:.2f}%" for f, e in per_format.items()))

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 8192, 16, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
    timing = {"shape": "batch 1, seqlen 8192, 16 heads, head_dim 128, non-causal",
              "exact_ms": time_ms(lambda: fused_softmax_attention(q, k, v, exact=True))}
    for fmt in MX_FORMATS:
        for ds in (False, True):
            timing[f"{fmt}_dot_scaled={ds}_ms"] = time_ms(
                lambda: fused_softmax_attention(q, k, v, mx_format=fmt, dot_scaled=ds))
    results["timing_indicative"] = timing
    log(lines, "indicative timing (includes the torch MX quantization of Q/K/V): "
        + ", ".join(f"{key} {val:.2f}" for key, val in timing.items() if key != "shape"))

    failed = [r for r in dense + varlen if not r["pass"]]
    results["all_pass"] = not failed
    log(lines, f"{len(dense) + len(varlen) - len(failed)} passed, {len(failed)} failed")
    (args.out_dir / "numerics.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out_dir / "numerics.log").write_text("\n".join(lines) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
