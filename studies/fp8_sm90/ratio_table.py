"""Ratio to FA3-FP8 of the FP8 rows of shared-benchmark JSONs, one Markdown row per shape (docs/fp8_sm90.md).

    python -m studies.fp8_sm90.ratio_table bench/results/h200_2026-12-01_s2/bench_fp8*/h200_fp8_*.json

Every ratio is the benchmark's `speedup_vs_fa3_fp8` (median over interleaved rounds of FA3-FP8's time over the
row's, same run); "error" rows are refusals (the MMA row sum past 2,048 keys), "(gate fail)" a failed output gate.
"""

import json
import sys

rows = []
for f in sys.argv[1:]:
    rows += json.load(open(f))["rows"]
ks = [
    "fa3_fp8",
    "cudnn_fp8",
    "fa4_stock_bf16",
    "fa4_fp8_exact_n192",
    "fa4_fp8_exact_n192_b0.125",
    "fa4_fp8_exact_n192_b0.25",
    "fa4_fp8_exact_n192_mma",
    "fa4_fp8_h15_n192",
    "fa4_fp8_h15_sat_n192",
    "fa4_fp8_h15_fold_n192",
    "fa4_fp8_h15_fold_n192_mma",
    "fa4_fp8_exact_noexp_n192",
]
groups = {}
for r in rows:
    key = (r["head_dim"], r["heads_kv"], r["seqlen"], r["causal"])
    groups.setdefault(key, {})[r["kernel"]] = r
print("| d | kv | seqlen | mask | FA3-FP8 TF | " + " | ".join(k.replace("fa4_fp8_", "") for k in ks[1:]) + " |")
for key in sorted(groups, key=lambda k: (-k[0], -k[1], k[2], not k[3])):
    g = groups[key]
    fa3 = g["fa3_fp8"]["tflops"]
    cells = []
    for k in ks[1:]:
        r = g.get(k)
        if r is None:
            cells.append("-")
            continue
        if r["status"] != "ok":
            cells.append(r["status"])
            continue
        v = r.get("speedup_vs_fa3_fp8")
        cells.append(f"{v:.2f}" + ("" if (r["check"] or {}).get("passed", True) else " (gate fail)"))
    print(
        f"| {key[0]} | {key[1]} | {key[2] // 1024}K | {'causal' if key[3] else 'non-causal'} | {fa3:.0f} | "
        + " | ".join(cells)
        + " |"
    )
