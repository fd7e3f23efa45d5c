"""A static cost model of the Fused-Softmax kernel from its compiled main loop (issue 14, item 4): a MODEL.

    python -m studies.aiter_cost_model.cost_model --validate studies/aiter_cost_model/results [--json OUT]

Pure Python, no GPU. Inputs: the main-loop counts ``compile_sm90.compile_one`` records (per warp and KV tile:
instructions, the HGMMA/QGMMA shapes, registers, shared memory; ``studies/aiter_cost_model/counts.py`` compiles
every kernel the H200 tune run timed into ``sm90_counts.json``) and the measured times of that run
(``measured_h200.json``). Everything this module outputs is a **model prediction, not a measurement**;
``studies/aiter_cost_model/README.md`` has the validation and its verdict.

Note [Per-tile cost rule]
~~~~~~~~~~~~~~~~~~~~~~~~~
Per SM and per KV tile of one program (BLOCK_M x BLOCK_N scores):

    T = F / R                     tensor cycles: F = the loop's MMA FLOPs (2 m n k per instruction per warpgroup),
                                  R = the SM's rate for the instruction's operand type (FLOP per clock)
    I = N * num_warps / 4         issue cycles on one scheduler (SMSP): the loop's N instructions per warp,
                                  num_warps / 4 warps of the program per SMSP, 1 warp instruction per clock
    cycles = max(T, I, (T + I) / p)   p = programs resident per SM (registers, shared memory, warps)

A program serializes its GEMMs and its softmax (T + I): the twin's QK^T wait also waits for the previous P@V
(``warp_group_dot_wait {pendings = 0}``) and two ``BAR.SYNC`` per tile keep a program's two warpgroups in step
(``docs/aiter_h200.md``, Diagnosis), so nothing in one program overlaps a GEMM with the softmax. Programs on the
same SM are independent: with p of them the SM can overlap one's softmax with another's GEMMs, down to the
shared resources' bound max(T, I). For one program this is the doc's case B with the peak issue rate (B took
0.73 per clock: two warps at the 0.36 calibrated on the previous launch) instead of a calibrated one,
generalized to p programs; chosen before the model's errors were computed, it has no fitted constant. The
kernel's time is (KV tiles of all programs) / (SMs) x cycles / clock: perfect balance over the SMs, no wave
quantization, no prologue or epilogue, and the causal diagonal's masked tiles cost an unmasked tile (the counts
are the unmasked loop's). ``max`` (full overlap) is reported beside it as the model's lower bound.

Note [Latency rule]
~~~~~~~~~~~~~~~~~~~
The second method (v2, ``rule="latency"``; ``--method latency``), written down before any of its validation
numbers were computed, after v1 had failed because the issue rate was far below the peak and depended on the warps
per scheduler. It adds the latency a warp waits out, statically, from ptxas's own schedule (Note [SASS control
bits] in ``compile_sm90.py``): per KV tile one warp spends at least

    L = S + sum over the loop's scoreboard waits of the producer's latency

cycles, S = the loop's stall counts summed (``loop_stall_cycles``: fixed-latency dependencies and issue, as ptxas
scheduled them; a warp issues its next instruction ``stall`` cycles after this one). The waits, counted by the
instruction that set the barrier (``loop_waits``: MUFU, shuffles, global/local memory, ...), get **0 cycles each**
(``WAIT_CYCLES``), decided before validating: the brief's suggested source, Luo et al. 2024, "Benchmarking and
Dissecting the Nvidia Hopper GPU Architecture" (arXiv 2402.13499), is in the page index, but only its opening could
be read there, not its latency tables, and no other published Hopper microbenchmark turned up; a latency not read
from a source is not put in. L is therefore a lower bound on a warp's time per tile. The explicit waits
(``DEPBAR``, ``WARPGROUP.DEPBAR``, ``BAR.SYNC``: ``loop_wait_instructions``) are in S only through their own stall
counts; the GEMM they wait for is T.

A scheduler holding W = num_warps / 4 warps of a program runs a tile in X = max(I, L) cycles: at least I = W N to
issue (v1's issue term, 1 per clock), and at least L because each of its warps needs L. Composed as in v1 (Note
[Per-tile cost rule]: serial within a program, p programs per SM overlapping up to the shared resources):

    cycles = max(T, I, (T + X) / p)

and ``rule="latency_overlap"``, max(T, X), is its lower bound. v1's constants (Note [Cost model constants]) and
criterion (``CRITERION``) are unchanged; v2 is a method beside v1, whose output stays as it was.

Note [Cost model constants]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
H200 (``H200``): 132 SMs, 4 SMSPs per SM, 1 warp instruction per clock per SMSP (the Hopper SM's one dispatch
per scheduler, as ``studies/speed_model/`` uses it), clock 1980 MHz (the run's ``clocks.max.sm``). Tensor rates:
the measured GEMM rates that ``studies/speed_model/`` uses (BF16 790 TF, torch bf16 GEMM 8192^3 -> 3,023 FLOP per
clock per SM at 1980 MHz; e4m3 1,456 TF -> 5,571), so ``T`` carries the GEMM's sustained efficiency and clock.
The datasheet rates (``H200_DATASHEET``: 4,096 BF16 / 8,192 FP8 dense FLOP per clock per SM, i.e. 989.4 /
1,978.9 TF at 1830 MHz over 132 SMs; NVIDIA's H100 whitepaper as quoted on forums.developer.nvidia.com/t/244727
and glennklockwood.com/garden/processors/h100; H200 has the H100 SXM5's SMs) are the sensitivity. Occupancy: 65,536
registers per SM (allocated per thread in units of 8), 228 KB shared memory per SM with 1 KB reserved per block,
64 warps per SM (CUDA programming guide's cc 9.0 limits, as remembered, not re-checked here).
gfx950 (MI355X): no constant is taken, because the method did not validate (``studies/aiter_cost_model/README.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

__all__ = [
    "CRITERION",
    "RULES",
    "WAIT_CYCLES",
    "H200",
    "H200_DATASHEET",
    "Machine",
    "kv_tiles",
    "predict",
    "programs_per_sm",
    "tile_cycles",
    "tile_flops",
    "validate",
]


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    sms: int
    clock_hz: float
    tensor_flop_per_clock: dict  # operand type ("BF16", "E4M3") -> FLOP per clock per SM
    schedulers: int = 4
    issue_per_clock: float = 1.0  # warp instructions per clock per scheduler
    registers: int = 65536
    shared_bytes: int = 228 * 1024
    shared_reserved: int = 1024
    max_warps: int = 64


# Note [Cost model constants]
H200 = Machine("H200, measured GEMM rates", 132, 1.98e9, {"BF16": 3023.0, "E4M3": 5571.0})
H200_DATASHEET = Machine("H200, datasheet rates", 132, 1.98e9, {"BF16": 4096.0, "E4M3": 8192.0})

# Note [Latency rule]: cycles a scoreboard wait adds to a warp's tile, by the class of the instruction that set the
# barrier (compile_sm90._PRODUCERS). No published Hopper latency was read: 0 for each, so L is a lower bound.
WAIT_CYCLES = {
    "before the loop": 0,
    "global or local memory": 0,
    "shared memory": 0,
    "MUFU": 0,
    "shuffle": 0,
    "warpgroup MMA": 0,
    "barrier": 0,
    "other": 0,
}
RULES = ("serial", "overlap", "latency", "latency_overlap")

_MMA = re.compile(r"^[HQ]GMMA\.(\d+)x(\d+)x(\d+)\.F32\.([A-Z0-9]+)")


def tile_flops(loop: dict, num_warps: int) -> dict:
    """MMA FLOPs of one loop pass (one KV tile of one program) by operand type, from the per-warp SASS counts:
    every warp of a warpgroup issues the warpgroup's HGMMA/QGMMA, so each counts once per warpgroup."""
    flops: dict = {}
    for mnemonic, count in loop.items():
        found = _MMA.match(mnemonic)
        if found:
            m, n, k = (int(found.group(i)) for i in (1, 2, 3))
            kind = found.group(4)
            flops[kind] = flops.get(kind, 0) + 2 * m * n * k * count * (num_warps // 4)
    return flops


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int, machine: Machine = H200) -> int:
    """Programs resident per SM by registers (per thread rounded up to 8), shared memory and warps."""
    by_registers = machine.registers // (8 * math.ceil(registers / 8) * 32 * num_warps)
    by_shared = machine.shared_bytes // (shared_bytes + machine.shared_reserved)
    return max(1, min(by_registers, by_shared, machine.max_warps // num_warps))


def tile_cycles(record: dict, machine: Machine = H200, rule: str = "serial") -> dict:
    """Note [Per-tile cost rule]: cycles per SM and KV tile of one program, with its parts."""
    warps = record["launch"]["num_warps"]
    flops = tile_flops(record["loop"], warps)
    tensor = sum(value / machine.tensor_flop_per_clock[kind] for kind, value in flops.items())
    issue = record["loop_instructions"] * (warps / machine.schedulers) / machine.issue_per_clock
    programs = programs_per_sm(record["registers"], warps, record["shared_bytes"], machine)
    parts = dict(tensor=tensor, issue=issue, programs=programs, flops=sum(flops.values()))
    if rule == "serial":
        return dict(parts, cycles=max(tensor, issue, (tensor + issue) / programs))
    if rule == "overlap":
        return dict(parts, cycles=max(tensor, issue))
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}; got {rule!r}")
    # Note [Latency rule]
    latency = record["loop_stall_cycles"] + sum(
        count * WAIT_CYCLES[producer] for producer, count in record["loop_waits"].items()
    )
    scheduler = max(issue, latency)
    cycles = max(tensor, issue, (tensor + scheduler) / programs) if rule == "latency" else max(tensor, scheduler)
    return dict(parts, cycles=cycles, latency=latency)


def kv_tiles(seqlen: int, causal: bool, block_m: int, block_n: int, batch: int, heads: int) -> int:
    """KV tiles all programs run for a square seqlen x seqlen attention (causal: up to the block's last row)."""
    per_head = 0
    for start in range(0, seqlen, block_m):
        keys = min(seqlen, start + block_m) if causal else seqlen
        per_head += math.ceil(keys / block_n)
    return per_head * batch * heads


def predict(record: dict, point: dict, machine: Machine = H200, rule: str = "serial") -> float:
    """Predicted milliseconds of one kernel (its counts ``record``) at one measured point's shape. A model."""
    launch = record["launch"]
    tiles = kv_tiles(
        point["seqlen"], point["causal"], launch["block_m"], launch["tile_n"], point["batch"], point["heads"]
    )
    return tiles / machine.sms * tile_cycles(record, machine, rule)["cycles"] / machine.clock_hz * 1e3


def _attention_flops(point: dict) -> float:
    """The benchmark's FLOP count (bench.sweep.tflops: 4 s^2 d per head, halved causal)."""
    flops = 4 * point["batch"] * point["heads"] * point["seqlen"] ** 2 * point["head_dim"]
    return flops / 2 if point["causal"] else flops


def _ranks(values: list) -> list:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for rank, index in enumerate(order):
        ranks[index] = float(rank)
    return ranks


def _spearman(a: list, b: list) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


# The acceptance criterion for using the method on gfx950, fixed before any prediction was computed (after the
# measured JSON had been read; studies/aiter_cost_model/README.md says what was known then). Errors are relative time
# errors, (predicted - measured) / measured, over every timed Fused-Softmax kernel and shape.
CRITERION = dict(
    median_abs_error=0.10,  # median |error| at most 10 %
    max_abs_error=0.25,  # no point off by more than 25 %
    beat_constant=True,  # median |error| below the constant-TFLOPS predictor's (fitted to the same points)
    candidate_rank_spearman=0.7,  # per shape, rank correlation of the exact twin's 7 launches >= 0.7
    mx_to_twin_ratio_error=0.25,  # each MX row's time over the twin's (the gfx950 deliverable's kind) within 25 %
)


_LOWER_BOUND = dict(serial="overlap", overlap="overlap", latency="latency_overlap", latency_overlap="latency_overlap")


def validate(
    counts: dict, measured: dict, machine: Machine = H200, rule: str = "serial", twin: str = "exact_m128_n128_w8_s3"
) -> dict:
    """Predict every measured Fused-Softmax point from its counts; errors, baselines and the criterion."""
    points = [p for p in measured["points"] if p["kernel"] != "fa4_stock"]
    rows = []
    for point in points:
        record = counts[f"{point['kernel']}/{'causal' if point['causal'] else 'non-causal'}"]
        predicted = predict(record, point, machine, rule)
        parts = tile_cycles(record, machine, rule)
        launch = record["launch"]
        tiles = kv_tiles(
            point["seqlen"], point["causal"], launch["block_m"], launch["tile_n"], point["batch"], point["heads"]
        )
        measured_cycles = point["median_ms"] * 1e-3 * machine.clock_hz * machine.sms / tiles
        # What the measurement implies under the serial rule (one program per SM): the issue rate the softmax
        # would have had, instructions per clock per scheduler. Derived from a measurement through the model.
        implied = parts["issue"] / (measured_cycles - parts["tensor"]) if parts["programs"] == 1 else None
        rows.append(
            dict(
                kernel=point["kernel"],
                seqlen=point["seqlen"],
                causal=point["causal"],
                measured_ms=point["median_ms"],
                predicted_ms=round(predicted, 4),
                lower_bound_ms=round(predict(record, point, machine, _LOWER_BOUND[rule]), 4),
                error=round(predicted / point["median_ms"] - 1, 4),
                tensor_cycles=round(parts["tensor"], 1),
                issue_cycles=round(parts["issue"], 1),
                programs_per_sm=parts["programs"],
                measured_cycles_per_tile=round(measured_cycles, 1),
                implied_issue_rate=None if implied is None else round(implied, 3),
            )
        )
        if "latency" in parts:  # v2's rows also carry the latency term (v1's stay as they were)
            rows[-1]["latency_cycles"] = round(parts["latency"], 1)
    tflops = statistics.median(_attention_flops(p) / p["median_ms"] for p in points)
    constant = [abs(_attention_flops(p) / tflops / p["median_ms"] - 1) for p in points]
    errors = [abs(row["error"]) for row in rows]
    shapes = sorted({(row["seqlen"], row["causal"]) for row in rows})
    spearman = {}
    mx_ratio_errors = []
    for seqlen, causal in shapes:
        here = [row for row in rows if (row["seqlen"], row["causal"]) == (seqlen, causal)]
        exact = [row for row in here if row["kernel"].startswith("exact_")]
        label = f"{seqlen // 1024}K {'causal' if causal else 'non-causal'}"
        spearman[label] = round(_spearman([r["predicted_ms"] for r in exact], [r["measured_ms"] for r in exact]), 3)
        base = next(row for row in here if row["kernel"] == f"exact_{twin.removeprefix('exact_')}")
        for row in here:
            if row["kernel"].startswith("mx"):
                predicted_ratio = row["predicted_ms"] / base["predicted_ms"]
                measured_ratio = row["measured_ms"] / base["measured_ms"]
                mx_ratio_errors.append(abs(predicted_ratio / measured_ratio - 1))
    summary = dict(
        points=len(rows),
        median_abs_error=round(statistics.median(errors), 4),
        max_abs_error=round(max(errors), 4),
        constant_tflops=round(tflops / 1e9, 1),
        constant_median_abs_error=round(statistics.median(constant), 4),
        constant_max_abs_error=round(max(constant), 4),
        candidate_rank_spearman=spearman,
        mx_to_twin_ratio_max_error=round(max(mx_ratio_errors), 4),
    )
    checks = dict(
        median_abs_error=summary["median_abs_error"] <= CRITERION["median_abs_error"],
        max_abs_error=summary["max_abs_error"] <= CRITERION["max_abs_error"],
        beat_constant=summary["median_abs_error"] < summary["constant_median_abs_error"],
        candidate_rank_spearman=min(spearman.values()) >= CRITERION["candidate_rank_spearman"],
        mx_to_twin_ratio_error=summary["mx_to_twin_ratio_max_error"] <= CRITERION["mx_to_twin_ratio_error"],
    )
    summary.update(checks=checks, validated=all(checks.values()))
    return dict(machine=machine.name, rule=rule, criterion=CRITERION, summary=summary, rows=rows)


def _load(directory: Path) -> tuple[dict, dict]:
    counts = json.loads((directory / "sm90_counts.json").read_text())["records"]
    measured = json.loads((directory / "measured_h200.json").read_text())
    return counts, measured


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validate", required=True, help="directory with sm90_counts.json and measured_h200.json")
    parser.add_argument(
        "--method",
        choices=("count", "latency"),
        default="count",
        help="count: v1 (Note [Per-tile cost rule]); latency: v2 (Note [Latency rule])",
    )
    parser.add_argument("--json", help="where to write the validation (both machines, both of the method's rules)")
    args = parser.parse_args(argv)
    counts, measured = _load(Path(args.validate))
    rules = ("serial", "overlap") if args.method == "count" else ("latency", "latency_overlap")
    results = [validate(counts, measured, machine, rule) for machine in (H200, H200_DATASHEET) for rule in rules]
    for result in results:
        s = result["summary"]
        print(
            f"{result['machine']}, rule {result['rule']}: median |error| {s['median_abs_error']:.3f}, max "
            f"{s['max_abs_error']:.3f} (constant {s['constant_tflops']} TF: {s['constant_median_abs_error']:.3f} / "
            f"{s['constant_max_abs_error']:.3f}); rank {s['candidate_rank_spearman']}; MX/twin ratio max error "
            f"{s['mx_to_twin_ratio_max_error']:.3f}; validated {s['validated']} {s['checks']}"
        )
    primary = results[0]
    for row in primary["rows"]:
        print(
            f"  {row['kernel']:<32} {row['seqlen'] // 1024:>2}K {'c ' if row['causal'] else 'nc'} measured "
            f"{row['measured_ms']:8.3f} ms  model {row['predicted_ms']:8.3f} ({row['error']:+.3f})  bound "
            f"{row['lower_bound_ms']:8.3f}  T {row['tensor_cycles']:7.0f} I {row['issue_cycles']:7.0f} "
            f"p {row['programs_per_sm']} measured {row['measured_cycles_per_tile']:7.0f} implied IPC "
            f"{row['implied_issue_rate']}" + (f" L {row['latency_cycles']:7.0f}" if "latency_cycles" in row else "")
        )
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model="MODEL, not measured", results=results), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
