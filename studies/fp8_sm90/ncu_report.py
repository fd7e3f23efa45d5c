#!/usr/bin/env python3
"""Where a consumer warp's time goes in the SM90 FP8 forward's main loop, from an Nsight Compute report.

    python -m studies.fp8_sm90.ncu_report DETAILS.csv SOURCE.csv [OUT.md]

DETAILS.csv is `ncu -i REP --page details --csv`, SOURCE.csv (or .csv.xz) `ncu -i REP --page source --csv
--print-source sass`
of a report from `studies.fp8_sm90.ncu_profile` (`--set full`, so the SASS carries warp-state samples). For each
FP8-forward kernel of the report: its duration, issue-slot use, the main loop split into the stretches of one
iteration (a consumer warpgroup's KV tile), each in samples and in cycles, and what the consumer warps were doing
in the softmax stretch and in the whole loop (Note [Warp states]).

Note [Samples to cycles]
~~~~~~~~~~~~~~~~~~~~~~~~
The sampler reads each warp's state at a fixed interval, so a stretch of SASS gets samples in proportion to the
warp-time spent there. The main loop is the run of instructions executed once per iteration (the most common
large execution count); the consumer warps' samples are the loop's plus those executed once per warp and work tile
(the first block and the epilogue). A work tile lasts elapsed cycles / (work tiles / SMs) (one CTA per SM at a time;
the work tiles are the grid on FA4's grid, and on the persistent grid the once-a-tile executions over the consumer
warps a CTA has), so one iteration takes tile cycles x loop share / iterations, and a stretch its share of that. The
iteration count is the loop's execution count over the once-a-tile one. A single issue of an instruction is one
sample of 'selected' per execution, which checks the scale: 'selected' samples / executions per warp ~ 1 cycle each.

Note [Warp states]
~~~~~~~~~~~~~~~~~~
Each sample also records the warp's state: 'selected' (it issued), 'not_selected' (it was ready but the scheduler
issued another warp of its SMSP), 'wait' (a fixed-latency dependency: the stall count ptxas wrote), 'dispatch' (ready,
held back at dispatch), 'math' (its pipe was busy), 'short_sb' (shuffles and other variable-latency results),
'barrier' (here the WARPGROUP.DEPBAR waits for a wgmma: FA4's GEMM waits, not a named barrier), and a few more
(Nsight Compute's "Warp State Statistics"). Shares are over the stretch's samples, so a softmax whose 'not_selected',
'dispatch' and 'math' shares grow is one whose warps compete with the other warps of their SMSP.
"""

import collections
import csv
import lzma
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
FP8_KERNEL = "FlashAttentionForwardSm90Fp8"
PRODUCER_WARPS = 4  # FA4's producer warpgroup, before the consumer warps
STATE_PREFIX = "stall_"  # the source page's warp-state sample columns (Note [Warp states])
NOT_ISSUED = "(Not Issued)"


def source_sections(path: str) -> list[dict]:
    """The source page's kernels, in report order: {"name", "header", "rows"}."""
    kernels, header = [], None
    with (lzma.open if path.endswith(".xz") else open)(path, "rt", newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                kernels.append({"name": row[1], "rows": []})
                header = None
            elif header is None:
                header = row
                kernels[-1]["header"] = header
            else:
                kernels[-1]["rows"].append(dict(zip(header, row)))
    return kernels


def details(path: str) -> dict[str, dict[str, str]]:
    """Report ID -> metric name -> "value unit", and "Kernel Name", "Grid Size"."""
    out = collections.defaultdict(dict)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            out[r["ID"]][r["Metric Name"]] = f"{r['Metric Value']} {r['Metric Unit']}".strip()
            out[r["ID"]]["Kernel Name"] = r["Kernel Name"]
            out[r["ID"]]["Grid Size"] = r["Grid Size"]
            out[r["ID"]]["Block Size"] = r["Block Size"]
    return out


def _extent(text: str) -> int:
    size = 1
    for extent in text.strip("()").split(","):
        size *= int(extent)
    return size


def grid_size(metrics: dict[str, str]) -> int:
    """CTAs in the launch: the product of the report's "(x, y, z)" grid."""
    return _extent(metrics["Grid Size"])


def work_tiles(rows: list[dict], metrics: dict[str, str]) -> int:
    """Work tiles the launch ran (Note [Samples to cycles]): the consumer warps' once-a-tile executions over the
    consumer warps a CTA has (its threads less FA4's producer warpgroup); the grid on FA4's one-CTA-per-tile grid, more
    than the grid on the persistent one."""
    consumer_warps = _extent(metrics["Block Size"]) // 32 - PRODUCER_WARPS
    return _once_per_warp_tile(rows) // consumer_warps


def number(text: str) -> float:
    return float(text.split()[0].replace(",", ""))


def _executed(r) -> int:
    return int(r[EXECUTED] or 0)


def _loop_executions(rows: list[dict]) -> int:
    """The main loop's execution count: the most common large one."""
    counts = collections.Counter(_executed(r) for r in rows)
    return max(e for e, n in counts.items() if n > 100)


def _once_per_warp_tile(rows: list[dict]) -> int:
    """The execution count of the consumer code run once per warp and work tile (the first block, the epilogue)."""
    loop_exec = _loop_executions(rows)
    per_warp = [_executed(r) for r in rows if _executed(r) and _executed(r) != loop_exec]
    return max(set(per_warp), key=per_warp.count)


def loop_stretches(rows: list[dict], sm_count: int, elapsed_cycles: float, tiles: int) -> dict:
    """The main loop's stretches (Note [Samples to cycles]): name -> (instructions, samples, cycles). `tiles`: the
    work tiles the launch ran (`work_tiles`; the grid on FA4's grid). ValueError for a loop without the two GEMM waits
    and a P.V GEMM after the first (intra-warpgroup overlap, whose loop issues the P.V GEMM before the S wait)."""

    def samples(r):
        return int(r[SAMPLES] or 0)

    executed = _executed
    loop_exec = _loop_executions(rows)
    loop = [i for i, r in enumerate(rows) if executed(r) == loop_exec]
    first, last = loop[0], loop[-1]
    waits = [i for i in range(first, last + 1) if "DEPBAR" in rows[i]["Source"]]
    syncs = [i for i in range(first, last + 1) if "BAR.SYNC" in rows[i]["Source"]]
    pv_issues = [i for i in range(waits[0] + 1, last + 1) if "QGMMA" in rows[i]["Source"]] if waits else []
    if len(waits) < 2 or not pv_issues:
        raise ValueError("main loop not split: no P.V GEMM between its GEMM waits (intra-warpgroup overlap?)")
    pv_issue = pv_issues[0]
    # the step before the P.V GEMM: the V wait, the scheduler barrier (two warpgroups) and the descriptors
    pre_pv = min(syncs[0], pv_issue) - 8 if syncs else pv_issue - 8
    marks = [
        ("loop head, S issue", first),
        ("S GEMM wait", waits[0]),
        ("softmax", waits[0] + 1),
        ("V wait, hand-over, P.V issue", pre_pv),
        ("P.V GEMM wait", waits[1]),
        ("promotion, loop tail", waits[1] + 1),
    ]
    warps = _once_per_warp_tile(rows)  # executed once per consumer warp and work tile
    iterations = loop_exec / warps
    consumer = sum(samples(r) for r in rows if executed(r) in (loop_exec, warps))
    consumer += sum(samples(rows[i]) for i in range(first, last + 1) if executed(rows[i]) == 0)
    loop_samples = sum(samples(rows[i]) for i in range(first, last + 1))
    tile_cycles = elapsed_cycles / (tiles / sm_count)
    iteration_cycles = tile_cycles * loop_samples / consumer / iterations
    # the scale's check: each loop instruction issues once an iteration, one cycle of 'selected' samples
    selected = sum(int(rows[i]["stall_selected"] or 0) for i in range(first, last + 1))
    loop_instructions = sum(1 for i in range(first, last + 1) if executed(rows[i]) == loop_exec)
    out = {
        "iteration cycles": iteration_cycles,
        "iterations": iterations,
        "issue cycles per instruction": iteration_cycles * selected / loop_samples / loop_instructions,
        "stretches": {},
        "bounds": {"loop": (first, last + 1)},  # row ranges of the source page
        "warp states": {"loop": warp_states(rows, first, last + 1)},
    }
    for (name, start), (_, end) in zip(marks, marks[1:] + [("end", last + 1)]):
        n = sum(samples(rows[i]) for i in range(start, end))
        instructions = sum(1 for i in range(start, end) if executed(rows[i]) == loop_exec)
        out["stretches"][name] = (instructions, n, iteration_cycles * n / loop_samples)
        out["bounds"][name] = (start, end)
        if name == "softmax":
            out["warp states"]["softmax"] = warp_states(rows, start, end)
    return out


def warp_state_counts(rows: list[dict], start: int, end: int) -> collections.Counter:
    """Note [Warp states]: state -> its samples over rows[start:end]."""
    counts = collections.Counter()
    for r in rows[start:end]:
        for column, value in r.items():
            if column.startswith(STATE_PREFIX) and not column.endswith(NOT_ISSUED):
                counts[column[len(STATE_PREFIX) :]] += int(value or 0)
    return counts


def warp_states(rows: list[dict], start: int, end: int) -> dict[str, float]:
    """Note [Warp states]: state -> its share of the warp-state samples of rows[start:end], largest first."""
    counts = warp_state_counts(rows, start, end)
    total = sum(counts.values())
    return {state: n / total for state, n in counts.most_common()} if total else {}


def state_line(states: dict[str, float], top: int = 7) -> str:
    """The largest shares, e.g. "selected 24 %, wait 18 %, ..."."""
    return ", ".join(f"{state} {share:.0%}".replace("%", " %") for state, share in list(states.items())[:top])


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        sys.exit(__doc__)
    metrics = details(argv[0])
    kernels = source_sections(argv[1])
    ids = sorted(metrics, key=int)
    if len(ids) != len(kernels):
        sys.exit(f"{argv[0]} has {len(ids)} kernels, {argv[1]} {len(kernels)}")
    lines = []
    for report_id, kernel in zip(ids, kernels):
        m = metrics[report_id]
        if FP8_KERNEL not in kernel["name"] and "FlashAttnFwdSm90" not in kernel["name"]:
            continue
        elapsed = number(m["Elapsed Cycles"])
        grid = grid_size(m)
        lines.append(
            f"## report ID {report_id}: {kernel['name'][:70]}\n\n"
            f"{m['Duration']}, {m['Elapsed Cycles']} at {m['SM Frequency']}, grid {grid}, "
            f"{m['Registers Per Thread']}, issue slots busy {m['Issue Slots Busy']}\n"
        )
        if FP8_KERNEL not in kernel["name"]:
            continue  # FA3's persistent loop has another shape
        try:
            split = loop_stretches(kernel["rows"], 132, elapsed, work_tiles(kernel["rows"], m))
        except ValueError as error:
            lines.append(f"\n{error}\n")
            continue
        lines.append(
            f"\nOne main-loop iteration (a consumer warpgroup's KV tile): {split['iteration cycles']:.0f} cycles, "
            f"{split['iterations']:.0f} iterations per warp; the scale's check (Note [Samples to cycles]): "
            f"{split['issue cycles per instruction']:.2f} cycles of 'selected' per loop instruction\n\n"
            "| stretch | instructions | samples | cycles |\n"
            "| --- | --- | --- | --- |"
        )
        for name, (instructions, n, cycles) in split["stretches"].items():
            lines.append(f"| {name} | {instructions} | {n} | {cycles:.0f} |")
        instructions, _, cycles = split["stretches"]["softmax"]
        lines.append(
            f"\nWarp states (Note [Warp states]); the softmax issues {instructions / cycles:.2f} instructions a cycle "
            f"per warp:\n- softmax: {state_line(split['warp states']['softmax'])}\n"
            f"- whole loop: {state_line(split['warp states']['loop'])}"
        )
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if len(argv) == 3:
        with open(argv[2], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
