"""Which aiter_fused kernels run correctly on this GPU: every dot mode (and the exact twin) x KV tile x head dim,
non-causal and causal, each in its own process (a fault is sticky), the output against the reference of the same
mode on the CPU.

    python -m studies.aiter_h200_fault.launch_sweep OUT_DIR [--jobs 12]

Why (docs/aiter_matrix_core.md, "The H200 fault"): on the H200 (2026-12-01) the MXFP8 kernel at tile 64 and head
dim 32 hit an illegal memory access in "bf16" and "scaled", folded or not, and returned wrong values where it
did not fault; tile 32 ran. This maps where the public API's launches are safe. Writes OUT_DIR/sweep.json and
prints one line per case: ok / WRONG (relative L2 error of out past 0.05, far above any mode's kernel-vs-reference
difference, which is rounding order) / FAULT (the exception's first line).
"""

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CASE = r"""
import json, sys, torch
from aiter_fused.attention import fused_softmax_attention
from fa4_rowmax.reference.fused_softmax import fused_softmax_attention_reference
mode, tile_n, head_dim, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter (TRITON_INTERPRET=1), a dry run
gen = torch.Generator().manual_seed(7)
q, k, v = (torch.randn(1, n, h, head_dim, generator=gen).bfloat16() for n, h in ((300, 4), (320, 2), (320, 2)))
exact = mode == "exact"
kwargs = dict(causal=causal, tile_n=tile_n, mx_format="mxfp8", exact=exact)
record = dict(mode=mode, tile_n=tile_n, head_dim=head_dim, causal=causal)
if exact:  # the exact twin against fp32 softmax attention (causal aligned bottom-right, GQA by repetition)
    kr, vr = (t.float().repeat_interleave(2, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kr) * head_dim**-0.5
    if causal:
        rows, cols = torch.arange(300)[:, None], torch.arange(320)[None, :]
        scores = scores.masked_fill(cols > rows + 20, float("-inf"))
    ref_out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vr)
    ref_lse = scores.logsumexp(-1)
else:
    ref_out, ref_lse = fused_softmax_attention_reference(q, k, v, causal=causal, tile_n=tile_n, mx_format="mxfp8")
try:
    dot_mode = None if exact else mode
    out, lse = fused_softmax_attention(q.to(device), k.to(device), v.to(device), dot_mode=dot_mode, **kwargs)
    torch.cuda.synchronize() if device == "cuda" else None
    out, lse = out.float().cpu(), lse.cpu()
    record["rel_err"] = ((out - ref_out.float()).norm() / ref_out.float().norm()).item()
    record["lse_err"] = (lse - ref_lse).abs().max().item()
    record["status"] = "ok" if record["rel_err"] < 0.05 and torch.isfinite(out).all() else "WRONG"
except Exception as error:
    record["status"] = "FAULT"
    record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
print("RESULT " + json.dumps(record))
"""


def run_case(case):
    mode, tile_n, head_dim, causal = case
    proc = subprocess.run(
        [sys.executable, "-c", CASE, mode, str(tile_n), str(head_dim), "1" if causal else "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "CUDA_LAUNCH_BLOCKING": "1"},
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return dict(mode=mode, tile_n=tile_n, head_dim=head_dim, causal=causal, status="CRASH", error=tail[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--limit", type=int, default=None, help="the first N cases only (a dry run)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [
        (mode, tile_n, head_dim, causal)
        for causal in (False, True)
        for mode in ("exact", "bf16", "fp8", "scaled")
        for tile_n in (32, 64, 128)
        for head_dim in (32, 64, 128, 256)
    ]
    cases = cases[: args.limit]
    with ThreadPoolExecutor(args.jobs) as pool:
        records = list(pool.map(run_case, cases))
    for r in records:
        detail = f"rel_err {r['rel_err']:.2e} lse_err {r['lse_err']:.2e}" if "rel_err" in r else r.get("error", "")
        causal = "causal" if r["causal"] else "dense"
        print(f"{r['mode']:>6} tile {r['tile_n']:>3} hd {r['head_dim']:>3} {causal:>6}: {r['status']:5} {detail}")
    (args.out / "sweep.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
