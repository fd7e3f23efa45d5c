"""python -m bench.main_job: the project's main job. The correctness gates (`python -m fa4_rowmax`: the
reference everywhere, the FA4 kernels too on a GPU), then on a GPU the short benchmark (`python -m bench
--quick`) and, on an SM90 GPU, its FP8 rows at 8K (`python -m bench --fp8` with the FP8 forward a user gets
from `flash_attn_func`, exact and H15, beside FA3's FP8 and FA4's BF16), all called as functions in this
process.

    python -m bench.main_job [--device cpu|cuda|auto] [--json PATH] [--reference-only] [--skip-bench]
                             [--bench-out DIR] [--verbose]

By default it prints one line per gated subject and each benchmark's speed-up tables; the benchmark's
progress goes to a log beside its results (`--verbose`: the gates' tables and the benchmark's progress here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

import fa4_rowmax.__main__ as gates_job
from bench import __main__ as bench_job
from bench.report import fp8_pivot, gpu_slug, read_json, seqlen_pivot
from bench.sweep import FOCUS_SEQLEN, HEADS_Q, format_seqlen

EXIT_STATUS = """exit status:
  0  the gates gave what they must and each benchmark ran (or none was due)
  1  a gate gave other than it must (the gates' status)
  2  a usage error (a bad argument, an output path that cannot be written; checked before any work)
  3  on a GPU, the kernels could not be loaded, or a benchmark failed"""

# What the FP8 rows of the short benchmark time: the two peers every FP8 row is quoted against
# (bench.kernels.RATIO_PEERS: FA3's FP8 forward, FA4 stock BF16 on the upcast inputs; FA4 stock itself has no
# SM90 FP8) and what a user gets from `flash_attn_func` with e4m3 inputs on SM90, exact and H15
# (bench.kernels.FP8_FUNC_VARIANTS).
FP8_QUICK_KERNELS = ("fa3_fp8", "fa4_stock_bf16", "fa4_fp8_func_exact", "fa4_fp8_func_h15")
FP8_QUICK_HEAD_DIM = 128  # the tables printed here; the results file has every head dim and GQA shape


def quick_bench_argv(out: str, stem: str) -> list[str]:
    return ["--quick", "--out", out, "--name", stem]


def fp8_quick_bench_argv(out: str, stem: str) -> list[str]:
    return [
        "--fp8",
        "--seqlens",
        format_seqlen(FOCUS_SEQLEN),
        "--kernels",
        *FP8_QUICK_KERNELS,
        "--rounds",
        "5",
        "--out",
        out,
        "--name",
        stem,
    ]


def unwritable_dir_reason(path: str) -> str | None:
    """Why a results folder cannot be made or written at `path`, or None when it can."""
    folder = Path(path)
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"directory {existing} is not writable"
    return None


def _is_sm90() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def run_bench(label: str, argv: list[str], out: str, stem: str, verbose: bool) -> int:
    """One `python -m bench` run; its progress goes to `<out>/<stem>.log` unless `verbose`. Prints its exit
    status and where its results are."""
    print(f"\nbenchmark {label}: python -m bench {' '.join(argv)}", flush=True)
    where = []
    if verbose:
        status = bench_job.main(argv)
    else:
        os.makedirs(out, exist_ok=True)
        log = os.path.join(out, f"{stem}.log")
        with open(log, "w") as f, contextlib.redirect_stdout(f):
            status = bench_job.main(argv)
        where.append(f"progress in {log}")
    if status == 0:
        where.insert(0, f"results in {os.path.join(out, stem)}.md")
    print(f"benchmark {label}: exit status {status}" + "".join(f"; {w}" for w in where))
    return status


def print_tables(json_path: str, fp8: bool) -> None:
    """The speed-up tables of a finished benchmark run, as `python -m bench` prints them."""
    rows = read_json(json_path)["rows"]
    for mask in ("causal", "non-causal"):
        if fp8:
            table = fp8_pivot(rows, mask, FP8_QUICK_HEAD_DIM, HEADS_Q)
            title = f"{mask}, fp8 head dim {FP8_QUICK_HEAD_DIM}, {HEADS_Q} heads"
        else:
            table, title = seqlen_pivot(rows, mask), mask
        if table:
            print(f"{title}:\n{table}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.main_job",
        description=__doc__.splitlines()[0],
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--skip-bench", action="store_true", help="do not run the short benchmark on a GPU")
    parser.add_argument(
        "--bench-out", default=bench_job.DEFAULT_OUT, metavar="DIR", help="the benchmark's results folder"
    )
    parser.add_argument("--verbose", action="store_true", help="the gates' tables and the benchmark's progress")
    args, gate_argv = parser.parse_known_args(argv)
    if (why := unwritable_dir_reason(args.bench_out)) is not None:
        parser.error(f"--bench-out {args.bench_out}: {why}")
    status = gates_job.main(["--device", args.device, *(["--verbose"] if args.verbose else []), *gate_argv])
    if status != 0:
        return status
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.skip_bench or not on_gpu:
        print("\nbenchmark: not run (" + ("--skip-bench" if args.skip_bench else "no GPU in use") + ")")
        return 0
    slug = gpu_slug(torch.cuda.get_device_name())
    runs = [("bf16", quick_bench_argv, f"{slug}_quick", False)]
    if _is_sm90():
        runs.append(("fp8", fp8_quick_bench_argv, f"{slug}_quick_fp8", True))
    else:
        print("\nbenchmark fp8: not run (the FP8 forward is SM90's)")
    failed = False
    for label, make_argv, stem, fp8 in runs:
        bench_status = run_bench(label, make_argv(args.bench_out, stem), args.bench_out, stem, args.verbose)
        failed |= bench_status != 0
        if bench_status == 0 and not args.verbose:
            print_tables(os.path.join(args.bench_out, f"{stem}.json"), fp8)
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
