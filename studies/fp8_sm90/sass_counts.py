#!/usr/bin/env python3
"""SASS counts of the SM90 FP8 forward variants (CPU compile, sm_90a), per kernel and per score element.

    python -m studies.fp8_sm90.sass_counts [OUT.json]

Each variant compiles in its own subprocess (`compile_check.compile_fp8_sm90`: causal, head dim 128,
256 keys, so FA4's three softmax sites are unrolled); per-element counts divide by 3 * tile_n / 2 element
sites per thread. Prints a Markdown table. Every variant names its structural knobs (tile 128, overlap on, FADD
row sum, FMNMX clamp unless it says otherwise), so Note [Tuned defaults] (fa4_rowmax/fp8_sm90.py) does not move
what a name compiles.
"""

import argparse
import json
import tempfile
from pathlib import Path

from fa4_rowmax.testing import compile_check
from fa4_rowmax.testing.sass import count, mnemonic_counts

VARIANTS = {
    "fa4fp8_exact": dict(softmax_mode="exact"),
    "fa4fp8_exact_noexp2": dict(softmax_mode="exact", exp2_deleted=True),
    "fa4fp8_h15": dict(softmax_mode="rowmax_h15"),
    "fa4fp8_h15_fold": dict(softmax_mode="rowmax_h15", anchor_rounding="half_octave"),
    "fa4fp8_exact_n192": dict(softmax_mode="exact", tile_n=192),
    "fa4fp8_exact_noexp2_n192": dict(softmax_mode="exact", exp2_deleted=True, tile_n=192),
    "fa4fp8_exact_noexp2_n192_mma": dict(softmax_mode="exact", exp2_deleted=True, tile_n=192, row_sum="mma"),
    "fa4fp8_exact_n192_mma": dict(softmax_mode="exact", tile_n=192, row_sum="mma"),
    # The vote skips single-level accumulation's O rescale; two-level (the default) has none to skip and refuses it.
    "fa4fp8_exact_n192_mma_vote": dict(
        softmax_mode="exact", tile_n=192, row_sum="mma", rescale_vote=True, pv_accumulation="single"
    ),
    "fa4fp8_h15_n192": dict(softmax_mode="rowmax_h15", tile_n=192),
    "fa4fp8_h15_n192_mma": dict(softmax_mode="rowmax_h15", tile_n=192, row_sum="mma"),
    "fa4fp8_h15_fold_n192": dict(softmax_mode="rowmax_h15", anchor_rounding="half_octave", tile_n=192),
    "fa4fp8_h15_fold_n192_vote": dict(
        softmax_mode="rowmax_h15",
        anchor_rounding="half_octave",
        tile_n=192,
        rescale_vote=True,
        pv_accumulation="single",
    ),
    "fa4fp8_h15_fold_n192_mma": dict(
        softmax_mode="rowmax_h15", anchor_rounding="half_octave", tile_n=192, row_sum="mma"
    ),
    "fa4fp8_h15_sat_n192": dict(softmax_mode="rowmax_h15", clamp="sat", tile_n=192),
    "fa4fp8_h15_sat_n192_mma": dict(softmax_mode="rowmax_h15", clamp="sat", tile_n=192, row_sum="mma"),
    "fa4fp8_exact_n192_beta0p125": dict(softmax_mode="exact", tile_n=192, beta=0.125),
    "fa4fp8_exact_n192_beta0p25": dict(softmax_mode="exact", tile_n=192, beta=0.25),
    "fa4fp8_exact_n192_mma_beta0p125": dict(softmax_mode="exact", tile_n=192, row_sum="mma", beta=0.125),
    "fa4fp8_exact_n192_mma_beta0p25": dict(softmax_mode="exact", tile_n=192, row_sum="mma", beta=0.25),
    "fa4fp8_exact_n192_mma_beta0p5": dict(softmax_mode="exact", tile_n=192, row_sum="mma", beta=0.5),
    # The tuned defaults at head dim 128 (tile 256 without overlap) beside tile 224 and the exp2-deleted probe.
    "fa4fp8_h15_sat_mma_n224_nooverlap": dict(
        softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", tile_n=224, intra_wg_overlap=False
    ),
    "fa4fp8_h15_sat_mma_n256_nooverlap": dict(
        softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", tile_n=256, intra_wg_overlap=False
    ),
    "fa4fp8_exact_mma_n256_nooverlap": dict(softmax_mode="exact", row_sum="mma", tile_n=256, intra_wg_overlap=False),
    "fa4fp8_exact_noexp2_mma_n256_nooverlap": dict(
        softmax_mode="exact", exp2_deleted=True, row_sum="mma", tile_n=256, intra_wg_overlap=False
    ),
}
STRUCTURAL = dict(tile_n=128, intra_wg_overlap=True, row_sum="fadd", clamp="max")
VARIANTS = {
    name: {**{k: v for k, v in STRUCTURAL.items() if k != "clamp" or kw["softmax_mode"] == "rowmax_h15"}, **kw}
    for name, kw in VARIANTS.items()
}
OPS = ("MUFU.EX2", "FFMA", "FADD", "FMUL", "FMNMX", "F2FP", "PRMT", "SHF", "IMAD", "LOP3", "FSEL", "IADD3")


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m studies.fp8_sm90.sass_counts", description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="write the counts as JSON here too")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="fp8_sass_"))
    site = compile_check.prepare_fa4_copies(workdir)["patched"]
    rows = {}
    for name, kwargs in VARIANTS.items():
        ops = mnemonic_counts(compile_check.disassemble(compile_check.compile_fp8_sm90(kwargs, workdir / name, site)))
        sites = 3 * kwargs.get("tile_n", 128) // 2
        counts = {op: count(ops, op) for op in OPS}
        counts["F2FP.E4M3"] = sum(n for op, n in ops.items() if op.startswith("F2FP") and "E4M3" in op)
        counts["QGMMA"] = count(ops, "QGMMA")
        rows[name] = dict(kwargs=kwargs, instructions=sum(ops.values()), sites=sites, counts=counts)
        print(name, rows[name]["instructions"], counts, flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))
    cols = ("MUFU.EX2", "FFMA", "FADD", "FMUL", "FMNMX", "F2FP.E4M3", "PRMT", "SHF", "IMAD", "FSEL")
    print("| variant | instr. | " + " | ".join(cols) + " | per element: ALU+FMA issues (MUFU) |")
    print("| --- " * (len(cols) + 3) + "|")
    for name, r in rows.items():
        c, s = r["counts"], r["sites"]
        per = {k: c[k] / s for k in cols}
        alu = sum(v for k, v in per.items() if k != "MUFU.EX2")
        print(
            f"| `{name}` | {r['instructions']} | "
            + " | ".join(f"{c[k]}" for k in cols)
            + f" | {alu:.2f} ({per['MUFU.EX2']:.2f}) |"
        )


if __name__ == "__main__":
    main()
