"""Synthetic accuracy table for Fused-Softmax attention (the paper's 10-seed experiment, our inputs).

For every MX format, the relative output error ``||O - O_bf16||_F / ||O_bf16||_F`` (Frobenius over the
whole output tensor) against BF16 attention, averaged over seeds, of
  (a) plain operand quantization: Q, K, V MX-quantized, exact softmax (fp32 exp2 from the full row max),
      P MX-quantized in the same P format as (b) for P@V, row sum from the unquantized fp32 P;
  (b) the full Fused-Softmax (fa4_rowmax.reference.fused_softmax.fused_softmax_attention_reference): frozen max,
      Schraudolph BF16 P, MX P, row sum from the same quantized P;
and the difference (b) - (a). BF16 attention: q, k, v in BF16, exact fp32 softmax, P rounded to BF16
for P@V, fp32 row sum and accumulation.

Inputs: q, k, v ~ N(0, sigma^2) rounded to BF16, batch 1, 8 heads, head_dim 128, non-causal,
softmax_scale = head_dim ** -0.5. The main table uses sigma = 1; ``--sigmas`` adds a sweep over input
scales (fewer seeds), since the error of (a) and (b) grows with how peaked the softmax is.

Usage: python -m studies.fused_softmax_synthetic.table [--seeds 10] [--seqlen 1024] [--out-dir bench/results]
"""

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from fa4_rowmax.reference.fused_softmax import (
    MX_FORMATS,
    fused_softmax_attention_reference,
    quantize_operands,
    quantize_p,
)

PAPER = {"mxfp8": 5.69, "mxfp6": 6.46, "mxfp4": 20.53}


def bf16_attention(q, k, v, softmax_scale):
    """(b, s, h, d) BF16 inputs -> float32 output: exact softmax, BF16 P, fp32 sums."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * softmax_scale
    p = torch.exp(s - s.amax(-1, keepdim=True))
    out = (p.bfloat16().float() @ v) / p.sum(-1, keepdim=True)
    return out.transpose(1, 2)


def plain_quantized_attention(q, k, v, softmax_scale, mx_format):
    """MX operands and MX P with an exact softmax: the error that quantization alone brings."""
    qq, kq, vq = (t.transpose(1, 2) for t in quantize_operands(q, k, v, mx_format))
    x = (qq @ kq.transpose(-1, -2)) * (softmax_scale * math.log2(math.e))
    p = torch.exp2(x - x.amax(-1, keepdim=True))
    out = (quantize_p(p, mx_format) @ vq) / p.sum(-1, keepdim=True)
    return out.transpose(1, 2)


def relative_error(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run(seeds, sigma, seqlen, heads, head_dim):
    rows = {fmt: {"plain": [], "fused": [], "recoveries_per_row": []} for fmt in MX_FORMATS}
    scale = head_dim**-0.5
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, seqlen, heads, head_dim, generator=gen).mul(sigma).bfloat16() for _ in range(3))
        ref = bf16_attention(q, k, v, scale)
        for fmt in MX_FORMATS:
            rows[fmt]["plain"].append(relative_error(plain_quantized_attention(q, k, v, scale, fmt), ref))
            out, _, counters = fused_softmax_attention_reference(q, k, v, mx_format=fmt, return_counters=True)
            rows[fmt]["fused"].append(relative_error(out, ref))
            rows[fmt]["recoveries_per_row"].append(counters["recoveries"].float().mean().item())
    summary = {}
    for fmt, r in rows.items():
        plain, fused = torch.tensor(r["plain"]) * 100, torch.tensor(r["fused"]) * 100
        summary[fmt] = {
            "plain_pct_mean": plain.mean().item(),
            "plain_pct_std": plain.std().item() if seeds > 1 else 0.0,
            "fused_pct_mean": fused.mean().item(),
            "fused_pct_std": fused.std().item() if seeds > 1 else 0.0,
            "delta_pct_points": (fused - plain).mean().item(),
            "recoveries_per_row": sum(r["recoveries_per_row"]) / seeds,
            "paper_fused_pct": PAPER[fmt],
            "per_seed": {"plain": r["plain"], "fused": r["fused"]},
        }
    return summary


def markdown(result):
    cfg = result["config"]
    lines = [
        "# Fused-Softmax: synthetic accuracy vs BF16 attention",
        "",
        f"Relative output error ||O - O_bf16||_F / ||O_bf16||_F in %, mean ± std over {cfg['seeds']} seeds. "
        f"q, k, v ~ N(0, sigma^2) in BF16, batch 1, {cfg['heads']} heads, seqlen {cfg['seqlen']}, head_dim "
        f"{cfg['head_dim']}, non-causal, softmax_scale = head_dim^-0.5, tile 128, recovery threshold 8.",
        "(a) plain: MX Q/K/V and MX P (same P format as (b)), exact softmax, fp32 row sum.",
        "(b) Fused-Softmax: frozen max, Schraudolph BF16 P, MX P, row sum from the quantized P.",
        "P format: MXFP8 -> e4m3; MXFP6 and MXFP4 -> e2m3 (the paper's MXFP4 keeps six-bit P).",
        "",
        f"## sigma = {cfg['sigma']}",
        "",
        "| format | (a) plain % | (b) Fused-Softmax % | (b) - (a) points | paper (b) % | recoveries/row |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for fmt, s in result["main"].items():
        lines.append(
            f"| {fmt} | {s['plain_pct_mean']:.2f} ± {s['plain_pct_std']:.2f} | "
            f"{s['fused_pct_mean']:.2f} ± {s['fused_pct_std']:.2f} | {s['delta_pct_points']:+.2f} | "
            f"{s['paper_fused_pct']:.2f} | {s['recoveries_per_row']:.3f} |"
        )
    if result["sweep"]:
        lines += [
            "",
            f"## Input-scale sweep ({cfg['sweep_seeds']} seeds each)",
            "",
            "| sigma | format | (a) plain % | (b) Fused-Softmax % | (b) - (a) points |",
            "| --- | --- | --- | --- | --- |",
        ]
        for sigma, per_fmt in result["sweep"].items():
            for fmt, s in per_fmt.items():
                lines.append(
                    f"| {sigma} | {fmt} | {s['plain_pct_mean']:.2f} | {s['fused_pct_mean']:.2f} | "
                    f"{s['delta_pct_points']:+.2f} |"
                )
    main = result["main"]
    worst = max(s["delta_pct_points"] for s in main.values())
    gap = max(abs(s["fused_pct_mean"] - s["paper_fused_pct"]) for s in main.values())
    lines += [
        "",
        "## Reading",
        "",
        f"- At sigma = 1 the Fused-Softmax errors are within {gap:.2f} points of the paper's, so N(0, 1) "
        "inputs at head_dim 128 are most likely the paper's setting; the error grows with sigma (a "
        "peakier softmax makes the score error from the quantized Q and K count more).",
        f"- Fused-Softmax adds at most {worst:+.2f} points over plain quantization here (paper: <= 0.3). The "
        "likely source (not isolated by an ablation here) is the Schraudolph exp2, which over-estimates "
        "2**y by 0 to 6.15% depending on the fractional part of y, a weight error that normalisation "
        "cannot cancel; it shows most where the quantization error is small (MXFP8, small sigma).",
        "- No recovery fires on these inputs: with N(0, 1) data no later tile's max exceeds the first "
        "tile's by 8 (log2 units); the recovery path is exercised by the adversarial tests instead.",
        "",
        f"Runtime {result['runtime_s']:.0f} s on {result['machine']} (2 shared CPUs), torch {result['torch']}.",
        "",
    ]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sigmas", type=float, nargs="*", default=[0.5, 2.0])
    parser.add_argument("--sweep-seeds", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if args.seeds < 1 or args.sweep_seeds < 1:
        parser.error("--seeds and --sweep-seeds must be >= 1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.time()
    main_table = run(args.seeds, args.sigma, args.seqlen, args.heads, args.head_dim)
    sweep = {str(s): run(args.sweep_seeds, s, args.seqlen, args.heads, args.head_dim) for s in args.sigmas}
    result = {
        "config": {
            "seeds": args.seeds,
            "sigma": args.sigma,
            "seqlen": args.seqlen,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "batch": 1,
            "causal": False,
            "tile_n": 128,
            "recovery_threshold": 8.0,
            "sweep_seeds": args.sweep_seeds,
            "error": "Frobenius norm of O - O_bf16 over the whole output, divided by that of O_bf16",
        },
        "main": main_table,
        "sweep": sweep,
        "runtime_s": time.time() - start,
        "machine": platform.machine() + " CPU",
        "torch": torch.__version__,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "fused_softmax_synthetic.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, args.out_dir)


def write_markdown(result, out_dir: Path):
    text = markdown(result)
    (out_dir / "fused_softmax_synthetic.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
