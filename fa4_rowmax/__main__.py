"""python -m fa4_rowmax: the correctness gates (gates/gates.py) on the reference and, on a GPU, the FA4 kernels.

Subjects and what each must give:
- the semantic reference, Rowmax-H15 at rescale_threshold 0 and 8: every gate PASSES;
- exact softmax (control): the multi-tile gate PASSES (it bounds any softmax within H15's error) and the
  single-tile H15 gate FAILS (exact is not H15); a control that passed it would mean the gate sees nothing;
- on a GPU, the same three through the patched FA4 kernel (`fa4_rowmax.interface.fa4_backend`); a GPU run
  whose kernels cannot load fails (exit 3) unless `--reference-only` says the reference alone is wanted;
- on an SM90 GPU also the SM90 FP8 forward (`fa4_rowmax.fp8_sm90.fp8_backend`) with e4m3 inputs only: H15 must
  pass every gate, exact (control) the multi-tile gate only; their single-tile reference is the FP8 H15
  reference (P in e4m3, max_offset 8, tile_n 128; Note [FP8 inputs in the gates] in gates/gates.py).
The main job, `python -m bench.main_job`, runs these gates and then the short benchmark.
The single-tile gate always compares against the reference Rowmax-H15 (threshold 0; one tile never meets
the threshold).

The output is one line per subject and dtype and a summary (`--verbose`: every gate's table; a subject with
a gate that gave other than it must always shows its table).
"""

import argparse
import functools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fa4_rowmax.config import FP8_MAX_OFFSET, SoftmaxConfig
from fa4_rowmax.gates.gates import GateReport, format_report, run_gates
from fa4_rowmax.gates.readback import Backend
from fa4_rowmax.reference.attention import attention_reference

CPU_SEEDS = (0, 1)
GPU_SEEDS = (0, 1, 2)

EXIT_STATUS = """exit status:
  0  every gate gave what it must
  1  a gate gave other than it must, or a kernel raised while gated
  2  a usage error (a bad argument, an output path that cannot be written; checked before any gate runs),
     or the --json file could not be written at the end
  3  the gates were right but, on a GPU, the kernels could not be loaded (see --reference-only)"""


@dataclass(frozen=True)
class Subject:
    """A backend under the gates and what it must give."""

    label: str
    backend: Backend
    is_h15: bool  # False for the exact control: the single-tile H15 gate must fail

    def must_pass(self, report: GateReport) -> bool:
        return self.is_h15 or report.name != "single-tile"


def _reference_backend(mode: str, rescale_threshold: float = 0.0) -> Backend:
    return functools.partial(attention_reference, config=SoftmaxConfig(mode=mode, rescale_threshold=rescale_threshold))


def _fp8_reference_backend() -> Backend:
    config = SoftmaxConfig(mode="rowmax_h15", p_dtype=torch.float8_e4m3fn, max_offset=FP8_MAX_OFFSET, tile_n=128)
    return functools.partial(attention_reference, config=config)


def _reference_subjects() -> list[Subject]:
    return [
        Subject("reference rowmax_h15 threshold 0", _reference_backend("rowmax_h15", 0.0), True),
        Subject("reference rowmax_h15 threshold 8", _reference_backend("rowmax_h15", 8.0), True),
        Subject("reference exact (control)", _reference_backend("exact"), False),
    ]


def _kernel_subjects() -> tuple[list[Subject], str | None]:
    """The FA4 kernel backends, or ``([], why)`` when they cannot be built here."""
    try:
        from fa4_rowmax.interface import fa4_backend

        subjects = [
            Subject("FA4 rowmax_h15 threshold 0", fa4_backend("rowmax_h15", rescale_threshold=0.0), True),
            Subject("FA4 rowmax_h15 (FA4's default threshold)", fa4_backend("rowmax_h15"), True),
            Subject("FA4 stock exact (control)", fa4_backend("exact"), False),
        ]
    except (ImportError, RuntimeError, AttributeError) as error:
        return [], f"{type(error).__name__}: {error}"
    return subjects, None


def _fp8_kernel_subjects() -> tuple[list[Subject], str | None]:
    """The SM90 FP8 forward's backends, or ``([], why)`` when the module cannot be imported."""
    try:
        from fa4_rowmax.fp8_sm90 import fp8_backend

        subjects = [
            Subject("SM90 FP8 rowmax_h15", fp8_backend("rowmax_h15"), True),
            Subject("SM90 FP8 exact (control)", fp8_backend("exact"), False),
        ]
    except (ImportError, RuntimeError, AttributeError) as error:
        return [], f"{type(error).__name__}: {error}"
    return subjects, None


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _finite_or_text(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 'nan', 'inf', '-inf': JSON has no literal for them
    if isinstance(value, (list, tuple)):
        return [_finite_or_text(v) for v in value]
    return value


def _report_json(subject: Subject, report: GateReport, dtype: torch.dtype) -> dict:
    return {
        "subject": subject.label,
        "gate": report.name,
        "setup": report.setup,
        "dtype": str(dtype).removeprefix("torch."),
        "passed": report.passed,
        "must_pass": subject.must_pass(report),
        "as_expected": report.passed == subject.must_pass(report),
        "checks": [{key: _finite_or_text(value) for key, value in asdict(check).items()} for check in report.checks],
    }


def _gate_subject(subject, reference, dtypes, device, seeds, results, verbose: bool) -> bool:
    """Run the suite on one subject, print a line per dtype (or its table), append its JSON rows; False if
    it raised."""
    for dtype in dtypes:
        start = time.perf_counter()
        try:
            reports = run_gates(subject.backend, reference, dtype=dtype, device=device, seeds=seeds)
        except Exception as error:  # a kernel that raises under the gates has failed them
            print(f"{subject.label} [{dtype}]: FAILED TO RUN: {type(error).__name__}: {error}")
            results.append({"subject": subject.label, "dtype": str(dtype), "error": f"{type(error).__name__}: {error}"})
            return False
        elapsed = time.perf_counter() - start
        title = f"{subject.label}, {str(dtype).removeprefix('torch.')} on {device} ({elapsed:.1f} s)"
        expect_pass = [subject.must_pass(r) for r in reports]
        as_expected = sum(r.passed == e for r, e in zip(reports, expect_pass))
        if verbose or as_expected < len(reports):
            print()
            print(format_report(reports, title=title, expect_pass=expect_pass))
        else:
            failing = len(reports) - sum(expect_pass)
            print(
                f"ok  {title}: {len(reports)} gates gave what they must"
                + (f" ({failing} by failing, as a control must)" if failing else "")
            )
        results.extend(_report_json(subject, r, dtype) for r in reports)
    return True


def _resolve_device(parser: argparse.ArgumentParser, device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here; use --device cpu or auto")
    return device


def unwritable_reason(path: str) -> str | None:
    """Why a file cannot be written (created or replaced) at `path`, or None when it can."""
    target = Path(path)
    if target.is_dir():
        return f"{path} is a directory"
    folder = target.parent
    if not folder.exists():
        return f"directory {folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"directory {folder} is not writable"
    return None


def write_json_atomically(path: str, doc: dict) -> None:
    """Write `doc` to `path` whole or not at all: a temporary file beside it, renamed over it."""
    temporary = f"{path}.tmp"
    try:
        with open(temporary, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fa4_rowmax",
        description=__doc__.splitlines()[0],
        epilog=EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="auto",
        help="where to run: cpu gates the semantic reference; cuda also the FA4 kernel (default auto)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every gate and check as JSON here")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        metavar="SEED",
        help=f"gate seeds (default {' '.join(map(str, CPU_SEEDS))} on cpu, {' '.join(map(str, GPU_SEEDS))} on cuda)",
    )
    parser.add_argument(
        "--reference-only",
        action="store_true",
        help="on cuda, gate the reference alone (the GPU simulation) and do not load the FA4 kernels",
    )
    parser.add_argument("--verbose", action="store_true", help="print every gate's table, not one line per subject")
    args = parser.parse_args(argv)
    if args.json is not None and (why := unwritable_reason(args.json)) is not None:
        parser.error(f"--json {args.json}: {why}")
    device = _resolve_device(parser, args.device)
    seeds = tuple(args.seeds) if args.seeds else (CPU_SEEDS if device == "cpu" else GPU_SEEDS)

    start = time.perf_counter()
    reference = _reference_backend("rowmax_h15")
    results: list[dict] = []
    summary = {"device": device, "torch": torch.__version__, "seeds": list(seeds), "results": results}
    print(f"fa4_rowmax gates on {device} (torch {torch.__version__}), seeds {list(seeds)}")
    ran_cleanly = all(
        _gate_subject(subject, reference, (torch.bfloat16,), device, seeds, results, args.verbose)
        for subject in _reference_subjects()
    )

    kernel_missing = False
    if device == "cuda" and args.reference_only:
        summary["kernel"] = "not tried (--reference-only)"
    elif device == "cuda":
        kernels, why = _kernel_subjects()
        summary["kernel"] = "available" if why is None else f"not available: {why}"
        if why is not None:
            kernel_missing = True
            print(f"\nkernel not available: {why} (pass --reference-only to gate the reference alone)")
        for subject in kernels:
            ran_cleanly &= _gate_subject(
                subject, reference, (torch.bfloat16, torch.float16), device, seeds, results, args.verbose
            )
        if _is_sm90():
            fp8_kernels, fp8_why = _fp8_kernel_subjects()
            summary["fp8_kernel"] = "available" if fp8_why is None else f"not available: {fp8_why}"
            if fp8_why is not None:
                kernel_missing = True
                print(f"\nSM90 FP8 kernel not available: {fp8_why}")
            fp8_reference = _fp8_reference_backend()
            for subject in fp8_kernels:
                ran_cleanly &= _gate_subject(
                    subject, fp8_reference, (torch.float8_e4m3fn,), device, seeds, results, args.verbose
                )
        else:
            summary["fp8_kernel"] = "not tried (not SM90)"
    else:
        summary["kernel"] = "not tried (cpu)"

    unexpected = [r for r in results if not r.get("as_expected", False)]
    print()
    if unexpected or not ran_cleanly:
        for r in unexpected:
            if "error" in r:
                print(f"UNEXPECTED: {r['subject']} [{r['dtype']}] raised {r['error']}")
            else:
                verdict = "FAILED" if r["must_pass"] else "PASSED (must fail)"
                print(f"UNEXPECTED: {r['subject']} {r['gate']} [{r['setup']}] {verdict}")
    else:
        print(f"all {len(results)} gates gave what they must ({time.perf_counter() - start:.1f} s)")

    written = True
    if args.json:
        try:
            write_json_atomically(args.json, summary)
        except OSError as error:
            print(f"{parser.prog}: error: --json {args.json}: {error}", file=sys.stderr)
            written = False

    if unexpected or not ran_cleanly:
        return 1
    if not written:
        return 2
    if kernel_missing:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
