#!/usr/bin/env python3
"""Regenerate the SM90 SASS the speed model is validated on (results/, README.md here).

    python -m studies.speed_model.sass OUT_DIR      # OUT_DIR/sass_sm90/*.sass.gz, OUT_DIR/sass_sm90_fp8/*.sass.gz

CPU only (FakeTensorMode compiles, compile_check's private FA4 copies); 18 kernels, a few minutes on 2 CPUs.
"""

import gzip
import sys
import tempfile
from pathlib import Path

from fa4_rowmax.testing import compile_check as cc
from fa4_rowmax.testing.sass import sass

D = dict(cc.DEFAULT_CONFIG)
FOLD, VOTE = {"anchor_rounding": "half_octave"}, {"rescale_vote": True}
BF16 = {
    "fa4_h15": dict(D, mode="rowmax_h15"),
    "fa4_h15_fold": dict(D, mode="rowmax_h15", levers=FOLD),
    "fa4_h15_vote": dict(D, mode="rowmax_h15", levers=VOTE),
    "fa4_h15_fold_vote": dict(D, mode="rowmax_h15", levers=dict(FOLD, **VOTE)),
    "fa4_h15_fold_vote_t8": dict(D, mode="rowmax_h15", rescale_threshold=8.0, levers=dict(FOLD, **VOTE)),
    "fa4_exact_vote": dict(D, mode="exact", levers=VOTE),
    "fa4_exact_vote_t8": dict(D, mode="exact", rescale_threshold=8.0, levers=VOTE),
    "fa4_h15_t0_b0": dict(D, mode="rowmax_h15", beta=0.0),
    "fa4_h15_t0_b0.125": dict(D, mode="rowmax_h15", beta=0.125),
    "fa4_h15_t0_b0.25": dict(D, mode="rowmax_h15", beta=0.25),
    "fa4_h15_t0_b0.375": dict(D, mode="rowmax_h15", beta=0.375),
    "fa4_h15_t0_b0.5": dict(D, mode="rowmax_h15", beta=0.5),
    "fa4_h15_t8_b1": dict(D, mode="rowmax_h15", rescale_threshold=8.0),
}
FP8 = {
    "fa4fp8_exact": dict(softmax_mode="exact"),
    "fa4fp8_h15": dict(softmax_mode="rowmax_h15"),
    "fa4fp8_exact_n192": dict(softmax_mode="exact", tile_n=192),
    "fa4fp8_exact_noexp2_n192": dict(softmax_mode="exact", exp2_deleted=True, tile_n=192),
    "fa4fp8_h15_n192": dict(softmax_mode="rowmax_h15", tile_n=192),
}


def main():
    out = Path(sys.argv[1])
    bf16_dir, fp8_dir = out / "sass_sm90", out / "sass_sm90_fp8"
    bf16_dir.mkdir(parents=True, exist_ok=True)
    fp8_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="speed_model_"))
    report = dict(cc.check_matrix("sm90", list(BF16.values()), work / "bf16"), workdir=str(work / "bf16"))
    for name, r in zip(list(BF16) + ["fa4_stock"], report["results"]):
        assert r["ok"], (name, r.get("error", "")[-2000:])
        (bf16_dir / f"{name}.sass.gz").write_bytes(gzip.compress("\n".join(sass(report, r)).encode()))
        print(name, r["instructions"], flush=True)
    site = cc.prepare_fa4_copies(work / "fp8")["patched"]
    for name, kwargs in FP8.items():
        lines = cc.disassemble(cc.compile_fp8_sm90(kwargs, work / "fp8" / name, site))
        (fp8_dir / f"{name}.sass.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
        print(name, len(lines), flush=True)


if __name__ == "__main__":
    main()
