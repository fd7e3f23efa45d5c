"""python -m bench.main_job: the project's main job. The correctness gates (`python -m fa4_rowmax`: the
reference everywhere, the FA4 kernels too on a GPU), then on a GPU the short benchmark (`python -m bench
--quick`), both called as functions in this process.

    python -m bench.main_job [--device cpu|cuda|auto] [--json PATH] [--reference-only] [--skip-bench]

Exit status: the gates' status when it is not 0 (1 wrong gate, 2 usage, 3 kernels missing on a GPU); else 3
when the benchmark failed; else 0.
"""

from __future__ import annotations

import argparse
import sys

import torch

import fa4_rowmax.__main__ as gates_job
from bench import __main__ as bench_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.main_job", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--skip-bench", action="store_true", help="do not run the short benchmark on a GPU")
    args, gate_argv = parser.parse_known_args(argv)
    status = gates_job.main(["--device", args.device, *gate_argv])
    if status != 0:
        return status
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.skip_bench or not on_gpu:
        print("\nbenchmark: not run (" + ("--skip-bench" if args.skip_bench else "no GPU in use") + ")")
        return 0
    print("\nbenchmark: python -m bench --quick", flush=True)
    bench_status = bench_job.main(["--quick"])
    print(f"benchmark: exit status {bench_status}")
    return 0 if bench_status == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
