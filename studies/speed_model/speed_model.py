"""A static per-tile pipe model of FA4's SM90 forward, computed from a compiled kernel's SASS (issue 13, item 4).

    python -m studies.speed_model.speed_model --validate studies/speed_model/results --json /tmp/model.json
    python -m studies.speed_model.speed_model --rates h200-bf16 --stock STOCK.sass[.gz] VARIANT.sass[.gz] ...

Pure Python: it reads SASS text (`cuobjdump -sass` output, or one instruction per line as
`tests/compile_helpers.py::sass` returns it) and imports no cutlass. A MODEL, never a measurement: every number
it prints is a prediction from instruction counts and the constants below.

Note [Per-tile pipe model]
--------------------------
What is counted. The steady-state main loop of the kernel: the last backward branch of the SASS whose body holds
MMA instructions (HGMMA/QGMMA) and no EXIT (FA4's unmasked KV-tile loop; the masked loop of a causal kernel and
the out-of-line TRYWAIT retry stubs are excluded). Instructions behind a forward branch inside the body (the warp
vote's `@!P0 BRA` over the O-rescale FMULs) count with weight `1 - skip` (`skip` = the fraction of tiles on which
the branch is taken: a run-time, data-dependent input, not in the SASS). One pass of the body is one KV tile of
one warp of one softmax warpgroup: 64 rows x tile_n keys per warpgroup, 16 rows per warp, one warp per SMSP.

Per SMSP and per tile of each of the two softmax warpgroups (ping-pong: a "tile pair"), with the Hopper per-SMSP
widths (NVIDIA, CUDA C++ Programming Guide, arithmetic-instruction throughput table for compute capability 9.0:
128 FP32 add/mul/fma, 64 integer add/compare/logic/shift, 16 exp2/rcp/lg2 results per clock per SM, i.e. 32, 16
and 4 lanes per SMSP; one warp instruction issued per clock per SMSP):

    issue = 2 * N_issue                     every instruction of the body, MUFU and MMA included, 1 slot each
    fma   = 2 * N_fma   * 32 / 32           FFMA FADD FMUL IMAD ... (FMA pipe, 32 lanes)
    alu   = 2 * N_alu   * 32 / 16           FMNMX FSEL LEA LOP3 IADD3 SHF PRMT F2FP ... (ALU pipe, 16 lanes)
    mufu  = 2 * N_mufu  * 32 / 4            MUFU.* (16 lanes per SM)
    tensor = 2 * F_tile / R                  F_tile: the MMA FLOPs of one warpgroup's pass (from the HGMMA/QGMMA
                                            shapes m x n x k: 2 m n k each), R: the measured dense GEMM rate in
                                            FLOP per clock per SM (GEMM TFLOPS / (SMs * max clock))

The overlap rule (FA4's SM90 ping-pong, as FA3: while one warpgroup runs its softmax the other's two GEMMs run on
the tensor cores; a warpgroup's softmax may start only when its own QK^T GEMM, half of its GEMM time, is done,
and must end before its next GEMM issue):

    P = max(tensor, issue, fma, alu, mufu, tensor / 4 + W)      cycles per tile pair
    W = max(N_issue, N_fma, 2 N_alu, 8 N_mufu)                   one warp's own softmax pass, alone on its SMSP

and the predicted speed ratio of a variant to stock is P_stock / P_variant (same kernel skeleton, same tile, same
tensor work). The kernel's fixed costs (prologue, masked tiles, epilogue, load imbalance) are outside the model;
they dilute any difference, so the model's ratios are the steady-state ones.

What it leaves out, knowingly: dependency latencies and stalls (a single warp with one partner per SMSP does not
reach one instruction per clock), register-bank conflicts, the producer warp's instructions, shared-memory
traffic of the MMA operands, and the clock and power behaviour of the part. The H200 validation
(studies/speed_model/README.md) says whether leaving them out is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import re
import sys
from pathlib import Path

# --- SASS reading ----------------------------------------------------------------------------------------------------

_ADDRESSED = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:`\()?0x([0-9a-f]+)")
_MMA_SHAPE = re.compile(r"^(HGMMA|QGMMA)\.(\d+)x(\d+)x(\d+)\b")
INSTRUCTION_BYTES = 16  # sm_90 and sm_100: fixed 128-bit instructions, so index * 16 is the address


def read_sass(text: str) -> list[str]:
    """Instructions, in address order, from `cuobjdump -sass` text or from one instruction per line."""
    addressed = [(int(a, 16), ins) for a, ins in _ADDRESSED.findall(text)]
    if addressed:
        start = addressed[0][0]
        if [a for a, _ in addressed] != list(
            range(start, start + INSTRUCTION_BYTES * len(addressed), INSTRUCTION_BYTES)
        ):
            raise ValueError("SASS addresses are not contiguous 16-byte steps: more than one function in the text?")
        return [ins.strip() for _, ins in addressed]
    return [line.strip().rstrip(";") for line in text.splitlines() if line.strip()]


def read_sass_file(path: str | Path) -> list[str]:
    raw = Path(path).read_bytes()
    return read_sass((gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode())


def mnemonic(instruction: str) -> str:
    """The full mnemonic (`MUFU.EX2`, `HGMMA.64x128x16.F32.BF16`), guard predicate dropped."""
    parts = instruction.split()
    if not parts:
        return ""
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def _branch_target(instruction: str) -> int | None:
    match = _BRANCH.search(instruction)
    return int(match.group(1), 16) // INSTRUCTION_BYTES if match else None


def main_loop(instructions: list[str]) -> tuple[int, int]:
    """(first, last) index of the steady-state loop (Note [Per-tile pipe model])."""
    loops = []
    for i, ins in enumerate(instructions):
        target = _branch_target(ins)
        if target is None or target >= i:
            continue
        body = instructions[target : i + 1]
        if sum(bool(_MMA_SHAPE.match(mnemonic(b))) for b in body) >= 2 and not any(mnemonic(b) == "EXIT" for b in body):
            loops.append((target, i))
    if not loops:
        raise ValueError("no backward-branch loop with MMA instructions and no EXIT in this SASS")
    return loops[-1]


# --- pipes -----------------------------------------------------------------------------------------------------------

FMA_OPS = ("FFMA", "FADD", "FMUL", "FFMA2", "FADD2", "FMUL2", "IMAD", "IMUL", "HFMA2", "HADD2", "HMUL2", "FSWZADD")
ALU_OPS = (
    "FMNMX",
    "FMNMX3",
    "FSEL",
    "FSETP",
    "FSET",
    "LEA",
    "LOP3",
    "IADD3",
    "VIADD",
    "VIMNMX",
    "IMNMX",
    "SHF",
    "SEL",
    "ISETP",
    "PRMT",
    "MOV",
    "F2FP",
    "R2P",
    "P2R",
    "PLOP3",
    "IABS",
    "FRND",
    "F2I",
    "I2F",
    "HMNMX2",
)
PIPE_CYCLES = {"fma": 1, "alu": 2, "mufu": 8}  # warp instruction occupancy per SMSP (32 / lanes per SMSP)


def pipe_of(mn: str) -> str:
    """'mma', 'mufu', 'fma', 'alu', 'uniform' (uniform datapath) or 'other' (issue slot only)."""
    base = mn.split(".")[0]
    if _MMA_SHAPE.match(mn):
        return "mma"
    if base == "MUFU":
        return "mufu"
    if base in FMA_OPS:
        return "fma"
    if base in ALU_OPS:
        return "alu"
    if base.startswith("U") or base in ("R2UR", "S2UR"):
        return "uniform"
    return "other"


@dataclasses.dataclass
class TileCounts:
    """Per warp and per pass of the main loop (one KV tile): instructions by pipe, MMA FLOPs of the warpgroup."""

    issue: float
    fma: float
    alu: float
    mufu: float
    mma_flops: float  # per warpgroup and tile
    body: int  # static instructions in the loop body
    conditional: int  # static instructions behind in-loop forward branches

    def warp_cycles(self) -> float:
        return max(
            self.issue, self.fma * PIPE_CYCLES["fma"], self.alu * PIPE_CYCLES["alu"], self.mufu * PIPE_CYCLES["mufu"]
        )


def tile_counts(instructions: list[str], skip: float = 0.0) -> TileCounts:
    """Count the main loop (Note [Per-tile pipe model]); `skip`: fraction of tiles that take the in-loop forward
    branches (the warp vote), whose skipped instructions then count `1 - skip`."""
    first, last = main_loop(instructions)
    weight = [1.0] * (last + 1)
    conditional = 0
    for i in range(first, last + 1):
        target = _branch_target(instructions[i])
        if target is not None and i < target <= last and instructions[i].startswith("@"):
            for j in range(i + 1, target):
                weight[j] = 1.0 - skip
            conditional += target - i - 1
    sums = {"issue": 0.0, "fma": 0.0, "alu": 0.0, "mufu": 0.0}
    flops = 0.0
    for i in range(first, last + 1):
        mn = mnemonic(instructions[i])
        if mn in ("NOP", ""):
            continue
        w = weight[i]
        sums["issue"] += w
        pipe = pipe_of(mn)
        if pipe in ("fma", "alu", "mufu"):
            sums[pipe] += w
        shape = _MMA_SHAPE.match(mn)
        if shape:
            m, n, k = (int(g) for g in shape.group(2, 3, 4))
            flops += 2 * m * n * k * w
    return TileCounts(mma_flops=flops, body=last - first + 1, conditional=conditional, **sums)


# --- rates -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rates:
    """Tensor rate in FLOP per clock per SM: a measured (or datasheet) dense GEMM rate / (SMs * clock)."""

    name: str
    gemm_tflops: float
    sms: int
    clock_mhz: float
    source: str

    @property
    def flop_per_clock_per_sm(self) -> float:
        return self.gemm_tflops * 1e12 / (self.sms * self.clock_mhz * 1e6)


RATES = {
    # Measured on the H200 of this project: torch bf16 GEMM 8192^3, ~790 TF (shared/notes/rowmax_h15.md, 2026-11-29;
    # 700 TF on the slow day of 2026-12-01, shared/notes/fp8_sm90.md). 132 SMs, 1980 MHz max clock (bench headers).
    "h200-bf16": Rates(
        "h200-bf16", 790.0, 132, 1980.0, "measured torch bf16 GEMM 8192^3 ~790 TF (shared/notes/rowmax_h15.md)"
    ),
    # FP8 e4m3 torch._scaled_mm 8192^3: 1456 TF in the same run as the FP8 shared benchmark
    # (bench/results/h200_2026-12-01/bench_fp8/h200_fp8_focus.json, gemm_fp8 at 8K causal).
    "h200-fp8": Rates(
        "h200-fp8",
        1456.0,
        132,
        1980.0,
        "measured gemm_fp8 1456 TF (bench/results/h200_2026-12-01/bench_fp8/h200_fp8_focus.json)",
    ),
}


# --- the model -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prediction:
    cycles: float  # per tile pair per SMSP
    bound: str  # which term of P is the max
    terms: dict

    def as_dict(self) -> dict:
        return {
            "cycles_per_tile_pair": round(self.cycles, 1),
            "bound": self.bound,
            "terms": {k: round(v, 1) for k, v in self.terms.items()},
        }


def predict(counts: TileCounts, rates: Rates) -> Prediction:
    """P = max(tensor, issue, fma, alu, mufu, tensor / 4 + W) (Note [Per-tile pipe model])."""
    tensor = 2 * counts.mma_flops / rates.flop_per_clock_per_sm
    terms = {
        "tensor": tensor,
        "issue": 2 * counts.issue,
        "fma": 2 * counts.fma * PIPE_CYCLES["fma"],
        "alu": 2 * counts.alu * PIPE_CYCLES["alu"],
        "mufu": 2 * counts.mufu * PIPE_CYCLES["mufu"],
        "pingpong": tensor / 4 + counts.warp_cycles(),
    }
    bound = max(terms, key=terms.get)
    return Prediction(terms[bound], bound, terms)


def ratio_to_stock(stock: Prediction, variant: Prediction) -> float:
    """Predicted speed of the variant relative to stock (> 1: faster)."""
    return stock.cycles / variant.cycles


# --- the H200 validation ---------------------------------------------------------------------------------------------

# Skip fractions of the warp-vote branch (tiles on which no row of the warp moved its anchor): N(0, 1) inputs,
# 64 KV tiles of 128 keys (8K), 16 rows per warp; Note [Vote skip fractions] in README.md here. Only the vote
# variants have an in-loop forward branch; for the others `skip` changes nothing.
VOTE_SKIP = {
    "fa4_exact_vote": 0.5,
    "fa4_h15_vote": 0.5,
    "fa4_h15_fold_vote": 0.7,
    "fa4_h15_fold_vote_t8": 0.95,
    "fa4_exact_vote_t8": 0.95,
}


def validate(directory: Path) -> dict:
    """Predict every variant of `directory/measured.json` from the SASS beside it and compare."""
    spec = json.loads((directory / "measured.json").read_text())
    out = {"rates": {}, "points": []}
    for group in spec["groups"]:
        rates = RATES[group["rates"]]
        out["rates"][rates.name] = dataclasses.asdict(rates) | {"flop_per_clock_per_sm": rates.flop_per_clock_per_sm}
        sass_dir = directory / group["sass_dir"]
        stock_name = group["stock"]
        stock = predict(tile_counts(read_sass_file(sass_dir / f"{stock_name}.sass.gz")), rates)
        for point in group["points"]:
            name = point["variant"]
            counts = tile_counts(read_sass_file(sass_dir / f"{name}.sass.gz"), skip=VOTE_SKIP.get(name, 0.0))
            pred = predict(counts, rates)
            ratio = ratio_to_stock(stock, pred)
            out["points"].append(
                {
                    **point,
                    "rates": rates.name,
                    "stock": stock_name,
                    "predicted": round(ratio, 4),
                    "error_points": round(100 * (ratio - point["measured"]), 1),
                    "null_error_points": round(100 * (1.0 - point["measured"]), 1),
                    "model": pred.as_dict(),
                    "stock_model": stock.as_dict(),
                    "loop": dataclasses.asdict(counts),
                }
            )
    within = [p for p in out["points"] if abs(p["error_points"]) <= 3.0]
    null_within = [p for p in out["points"] if abs(p["null_error_points"]) <= 3.0]
    moved = [p for p in out["points"] if abs(p["null_error_points"]) > 3.0]
    out["summary"] = {
        "points": len(out["points"]),
        "within_3_points": len(within),
        "variants_within_3_points": sorted({p["variant"] for p in within}),
        "null_model_within_3_points": len(null_within),
        "points_that_moved_more_than_3": len(moved),
        "moved_points_within_3": sum(abs(p["error_points"]) <= 3.0 for p in moved),
        "max_abs_error_points": max(abs(p["error_points"]) for p in out["points"]),
    }
    # Pass only if the model does what the ratio-1 null model cannot: get the points that moved.
    out["summary"]["passes"] = len({p["variant"] for p in within}) >= 6 and out["summary"][
        "moved_points_within_3"
    ] >= max(1, len(moved) // 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--validate", type=Path, help="directory with measured.json and the SASS it names")
    parser.add_argument("--rates", default="h200-bf16", choices=sorted(RATES))
    parser.add_argument("--stock", type=Path, help="stock kernel SASS (for ratios)")
    parser.add_argument("--skip", type=float, default=0.0, help="vote branch skip fraction for the variants")
    parser.add_argument("sass", nargs="*", type=Path, help="variant SASS files (.sass, .sass.gz, cuobjdump text)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    if args.validate:
        result = validate(args.validate)
        for p in result["points"]:
            print(
                f"{p['variant']:<26} {p['mask']:<10} {p['run']:<12} measured {p['measured']:.3f} "
                f"model {p['predicted']:.3f} error {p['error_points']:+5.1f} (null {p['null_error_points']:+5.1f}) "
                f"bound {p['model']['bound']}"
            )
        print(json.dumps(result["summary"]))
    else:
        rates = RATES[args.rates]
        stock = predict(tile_counts(read_sass_file(args.stock)), rates) if args.stock else None
        result = {"rates": dataclasses.asdict(rates), "variants": {}}
        for path in args.sass:
            counts = tile_counts(read_sass_file(path), skip=args.skip)
            pred = predict(counts, rates)
            entry = {"loop": dataclasses.asdict(counts), "model": pred.as_dict()}
            if stock:
                entry["ratio_to_stock"] = round(ratio_to_stock(stock, pred), 4)
            result["variants"][path.name] = entry
            print(path.name, json.dumps(entry))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
