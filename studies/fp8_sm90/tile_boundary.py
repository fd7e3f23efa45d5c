#!/usr/bin/env python3
"""What a work tile's boundary costs a consumer warp in the SM90 FP8 forward, from an Nsight Compute report.

    python -m studies.fp8_sm90.tile_boundary DETAILS.csv SOURCE.csv    # the files studies.fp8_sm90.ncu_report reads

What do the consumer warpgroups pay for meeting at every work tile's end (docs/fp8_sm90.md, Levers: each warpgroup's
own tile boundary)? Of the consumer code executed once per warp and work tile (the first block, the epilogue, the
step to the next tile; Note [Samples to cycles] in ncu_report.py), this reports in cycles a work tile:
- "barrier waits": the samples in the 'barrier' state outside the wgmma waits: FA4's epilogue barrier, Q's wait, the
  first scheduler hand-over and, on the persistent grid, the slot barrier (where a warpgroup waits for the others);
- "first block GEMM waits": the first block's wgmma waits (WARPGROUP.DEPBAR), beside "loop GEMM waits", the main
  loop's per iteration: the excess is the ping-pong's restart from both warpgroups at once;
- "once a tile": all of it, the first block's softmax and the epilogue's own work included.
"""

import sys

from studies.fp8_sm90 import ncu_report


def boundary(rows: list[dict], metrics: dict[str, str], sm_count: int = 132) -> dict[str, float]:
    """The stretches above, in cycles a work tile, for one FP8 forward kernel of a report."""

    def samples(r, column=ncu_report.SAMPLES):
        return int(r[column] or 0)

    executed = ncu_report._executed
    loop_exec = ncu_report._loop_executions(rows)
    once = ncu_report._once_per_warp_tile(rows)
    tiles = ncu_report.work_tiles(rows, metrics)
    consumer = sum(samples(r) for r in rows if executed(r) in (loop_exec, once))
    tile_cycles = ncu_report.number(metrics["Elapsed Cycles"]) / (tiles / sm_count)
    scale = tile_cycles / consumer  # cycles a work tile per sample (Note [Samples to cycles])
    iterations = loop_exec / once
    once_rows = [r for r in rows if executed(r) == once]
    gemm_wait = [r for r in once_rows if "WARPGROUP.DEPBAR" in r["Source"]]
    loop_waits = [r for r in rows if executed(r) == loop_exec and "WARPGROUP.DEPBAR" in r["Source"]]
    return {
        "tile cycles": tile_cycles,
        "iterations": iterations,
        "once a tile": scale * sum(samples(r) for r in once_rows),
        "barrier waits": scale * sum(samples(r, "stall_barrier") for r in once_rows if r not in gemm_wait),
        "first block GEMM waits": scale * sum(samples(r) for r in gemm_wait),
        "loop GEMM waits": scale * sum(samples(r) for r in loop_waits) / iterations,
    }


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit(__doc__)
    metrics = ncu_report.details(argv[0])
    kernels = ncu_report.source_sections(argv[1])
    print(
        "| report | tile cycles | iterations | once a tile | barrier waits | first block GEMM waits | loop GEMM waits |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for report_id, kernel in zip(sorted(metrics, key=int), kernels):
        if ncu_report.FP8_KERNEL in kernel["name"]:
            b = boundary(kernel["rows"], metrics[report_id])
            print(f"| {report_id} | " + " | ".join(f"{v:,.0f}" if v >= 100 else f"{v:.1f}" for v in b.values()) + " |")


if __name__ == "__main__":
    main()
