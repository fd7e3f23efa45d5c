"""python -m bench: time every attention kernel of the table against FA4 stock, in interleaved rounds.

Per group (one shape): allocate rotating inputs, compute the fp32 reference once, call each kernel once
(this compiles it) and gate its output, then time the kernels that passed in interleaved rounds
(bench/timing.py) and turn the times into rows. The JSON is rewritten after every group, so a run that is
cut short keeps what it measured; the Markdown and plots are written at the end (or later by
`python -m bench.report`). `--fp8-accuracy` runs the FP8 accuracy-over-key-count study instead (bench/accuracy.py),
`--fp8 --with-accuracy` runs it first and then the FP8 speed table, in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

from bench import accuracy, env_info
from bench.check import check_batches, check_output, make_inputs, reference_attention
from bench.kernels import BASELINE, FP8_MAP_KERNELS, KERNELS, MAP_KERNELS, RATIO_PEERS
from bench.report import (
    REASON_CHARS,
    failure_reason,
    gpu_slug,
    map_pivot,
    new_row,
    read_json,
    seqlen_pivot,
    write_json,
    write_report,
)
from bench.semantic_check import semantic_check
from bench.sweep import MAP_MASK_CHOICES, TOKENS, Group, attention_flops, build_plan, parse_seqlen, tflops
from bench.timing import SPACER_CYCLES, median, per_round_speedups, rotation_count, spread, time_interleaved

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="8K and 2K, causal and non-causal, bf16 hd128: FA4 stock, fa4_h15, aiter_mxfp8, cuDNN",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 inputs, head dim 128/64, 2K-32K, both masks, MHA and GQA 16/4, every row gated before timing: "
        "the FP8 GEMM ceiling, FA3 FP8/BF16, cuDNN FP8, vLLM's FA3, FA4 stock BF16 (on the upcast inputs), the "
        "FP8 SM90 kernel through flash_attn_func and with single / two-level P.V accumulation (exact, H15, exp2 "
        "deleted); the H15 map and levers at 8K with --map-masks",
    )
    parser.add_argument(
        "--fp8-accuracy",
        action="store_true",
        help="the FP8 accuracy study alone (bench/accuracy.py): O's error vs fp64 attention of the same e4m3 "
        "inputs over 1K-128K keys, V mean 0/0.25/1, both masks, FA3/cuDNN/vLLM FP8, ours, FA4 BF16",
    )
    parser.add_argument(
        "--with-accuracy",
        action="store_true",
        help="with --fp8: run the accuracy study first, then the speed table, in this one process",
    )
    parser.add_argument(
        "--accuracy-keys", nargs="+", type=_seqlen_arg, metavar="S", help="the study's key counts (default 1K-128K)"
    )
    parser.add_argument(
        "--accuracy-kernels",
        nargs="+",
        metavar="PATTERN",
        help="the study's kernels, names or shell patterns (default: bench.accuracy.ACCURACY_KERNELS)",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        metavar="PATTERN",
        help="kernel names or shell patterns (e.g. 'fa4_h15*'); replaces the preset's choice; "
        f"{BASELINE} is always added",
    )
    parser.add_argument("--seqlens", nargs="+", type=_seqlen_arg, metavar="S", help="e.g. 1K 8K 32768")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results folder (default: bench/results)")
    parser.add_argument("--name", help="file stem (default: <gpu>_quick or <gpu>_full, e.g. h200_full)")
    parser.add_argument("--rounds", type=_positive_int, help="interleaved rounds per group (default 5 quick, 7 full)")
    parser.add_argument("--calls-per-round", type=_positive_int, default=3, help="timed calls per kernel per round")
    parser.add_argument("--warmup", type=_nonnegative_int, default=2, help="untimed calls per kernel after its check")
    parser.add_argument(
        "--map-masks",
        choices=MAP_MASK_CHOICES,
        help="masks that get the fa4_h15 threshold x beta map at 8K (full run; default causal), or the FP8 H15 "
        "map and levers (--fp8; default none)",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        help="stop compiling new kernels after this much wall time; the rest become 'skipped'",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run whose JSON is already at --out/--name: keep its finished groups "
        "(errors included) and run the rest; settings, GPU and package versions must match, "
        "--max-minutes may differ",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    args = parser.parse_args(argv)
    if sum((args.quick, args.fp8, args.fp8_accuracy)) > 1:
        parser.error(
            "--quick, --fp8 and --fp8-accuracy are presets; choose one (--fp8 --with-accuracy runs both FP8 parts)"
        )
    if args.with_accuracy and not args.fp8:
        parser.error("--with-accuracy goes with --fp8 (the accuracy study alone is --fp8-accuracy)")
    wants_accuracy = args.fp8_accuracy or args.with_accuracy
    if not wants_accuracy and (args.accuracy_keys or args.accuracy_kernels):
        parser.error("--accuracy-keys / --accuracy-kernels need --fp8-accuracy or --fp8 --with-accuracy")
    if args.fp8_accuracy and (args.kernels or args.seqlens or args.map_masks or args.resume):
        parser.error(
            "--kernels, --seqlens, --map-masks and --resume are the speed table's; with --fp8-accuracy use "
            "--accuracy-kernels / --accuracy-keys"
        )
    if args.map_masks is None:
        args.map_masks = "none" if args.fp8 else "causal"
    if args.rounds is None:
        args.rounds = 5 if args.quick else 7
    if args.max_minutes is not None and not args.max_minutes > 0:
        parser.error(f"--max-minutes must be > 0, got {args.max_minutes}")
    return args


def _seqlen_arg(text: str) -> int:
    try:
        return parse_seqlen(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def preset_of(args: argparse.Namespace) -> str:
    return "quick" if args.quick else "fp8" if args.fp8 else "fp8_accuracy" if args.fp8_accuracy else "full"


def settings_of(args: argparse.Namespace) -> dict:
    return {
        "preset": preset_of(args),
        "kernels": args.kernels,
        "seqlens": args.seqlens,
        "rounds": args.rounds,
        "calls_per_round": args.calls_per_round,
        "warmup": args.warmup,
        "map_masks": args.map_masks,
        "max_minutes": args.max_minutes,
        "seed": args.seed,
        "tokens_per_call": TOKENS,
        "spacer_cycles": SPACER_CYCLES,
        "rotation": "fewest input sets (>= 2) whose total size exceeds 2x L2",
    }


# Settings a resumed run may change: they bound the run's length, not what a row measures.
RESUMABLE_SETTINGS = ("max_minutes",)


def group_key(shape_or_row) -> tuple:
    """What identifies a group in the plan and in a results file (rows carry the shape's fields)."""
    get = shape_or_row.get if isinstance(shape_or_row, dict) else lambda k: getattr(shape_or_row, k)
    return tuple(get(k) for k in ("dtype", "causal", "seqlen", "head_dim", "heads_q", "heads_kv", "batch"))


class ResumeError(ValueError):
    """--resume refused: the results file does not belong to this run."""


def finished_rows(
    doc: dict, plan: list[Group], settings: dict, gpu_name: str, packages: dict[str, str | None]
) -> dict[tuple, list[dict]]:
    """The rows of `doc` (a previous run's JSON) for every group of `plan` it finished, by group key.

    A group counts as finished when the file holds a row for each of its kernels and none of them was
    skipped for the time budget (a group that ended in errors is finished: rerun without --resume to retry
    it). Raises ResumeError, naming the setting or package, when the file was made with other settings,
    package versions or on another GPU. The git commit of each session is recorded (env["resumed"]) and
    shown in the report, not compared: a device copy of the tree may carry stale git metadata."""
    old_settings = doc["env"].get("settings", {})
    for key in sorted(set(old_settings) | set(settings)):
        if key not in RESUMABLE_SETTINGS and old_settings.get(key) != settings.get(key):
            raise ResumeError(
                f"--resume: setting {key!r} was {old_settings.get(key)!r} in the results file, "
                f"now {settings.get(key)!r}; rerun without --resume (or with the same settings)"
            )
    old_gpu = doc["env"].get("gpu", {})
    old_name = old_gpu.get("name") if isinstance(old_gpu, dict) else None
    if old_name != gpu_name:
        raise ResumeError(f"--resume: the results file was measured on {old_name!r}, this GPU is {gpu_name!r}")
    old_packages = doc["env"].get("packages", {})
    for name in sorted(set(old_packages) | set(packages)):
        if old_packages.get(name) != packages.get(name):
            raise ResumeError(
                f"--resume: package {name} was {old_packages.get(name)!r} in the results file, "
                f"now {packages.get(name)!r}"
            )
    by_group: dict[tuple, dict[str, dict]] = {}
    for row in doc["rows"]:
        by_group.setdefault(group_key(row), {})[row["kernel"]] = row
    done = {}
    for group in plan:
        rows = by_group.get(group_key(group.shape), {})
        if all(name in rows and not rows[name]["reason"].startswith("time budget") for name in group.kernels):
            done[group_key(group.shape)] = [rows[name] for name in group.kernels]
    return done


def describe_kernels(names: tuple[str, ...]) -> str:
    plain = [n for n in names if n not in MAP_KERNELS + FP8_MAP_KERNELS]  # the FP8 levers are listed by name
    mapped = sum(n in MAP_KERNELS for n in names)
    fp8_mapped = sum(n in FP8_MAP_KERNELS for n in names)
    return (
        ", ".join(plain)
        + (f", fa4_h15_t*_b* ({mapped} map points)" if mapped else "")
        + (f", fa4_fp8_h15*_t*_n* ({fp8_mapped} map points)" if fp8_mapped else "")
    )


def print_plan(plan: list[Group], settings: dict) -> None:
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    for i, group in enumerate(plan):
        print(
            f"[{i + 1:2d}] {group.shape.label:34s} {len(group.kernels):2d} kernels: {describe_kernels(group.kernels)}"
        )
    print(
        f"{len(plan)} groups, {sum(len(g.kernels) for g in plan)} kernel rows, "
        f"~{compiled_configurations(plan)} FA4/Triton compilations (FP8 aside)"
    )
    if any(g.shape.dtype == "fp8" for g in plan):
        estimate = estimate_fp8_run(plan, settings)
        print(
            f"on an H200 (sm_90): {estimate['rows']} rows to time, {estimate['timed_calls']} timed calls "
            f"(+{estimate['untimed_calls']} gate and warm-up calls), {estimate['compilations']} kernel "
            f"compilations; rough wall time {estimate['seconds']:.0f} s ({ESTIMATE_BASIS})"
        )


def compiled_configurations(plan: list[Group]) -> int:
    """Distinct (kernel, dtype, head dim, GQA ratio, mask) among compiled kernels: FA4's compile key (and a
    Triton kernel's specialization) holds those but not the seqlen. SDPA ships precompiled. A rough guide
    to a run's length: one compilation takes ~2-4 s on the H200."""
    keys = set()
    for group in plan:
        s = group.shape
        for name in group.kernels:
            spec = KERNELS[name]
            if spec.family != "sdpa" and s.dtype != "fp8" and s.dtype in spec.tolerances:
                keys.add((name, s.dtype, s.head_dim, s.heads_q // s.heads_kv, s.causal))
    return len(keys)


# Note [Run-length estimate]
# A dry run's guide to whether a run fits one device command, from the H200 runs of 2026-12-01
# (bench/results/h200_2026-12-01_s2/bench_fp8*): a CuTe-DSL configuration's first call 1.2-3.0 s (FP8 SM90 kernel
# and FA4), FA3-FP8 ~850 TFLOPS, FA4/FA3 BF16 ~600, the FP8 GEMM ceiling ~1250, and per group ~1 s for inputs and
# the fp32 reference. Rows unsupported on sm_90 are not counted.
ESTIMATE_COMPILE_S = 2.5
ESTIMATE_TFLOPS = {"fp8": 850.0, "bf16": 600.0}
ESTIMATE_GEMM_TFLOPS = 1250.0
ESTIMATE_GROUP_S = 1.0
ESTIMATE_BASIS = "Note [Run-length estimate]"
HOPPER = (9, 0)


def _timed_on_hopper(name: str, dtype: str) -> bool:
    spec = KERNELS[name]
    return spec.unsupported_reason(dtype, HOPPER) is None


def estimate_fp8_run(plan: list[Group], settings: dict) -> dict:
    """Rows, calls, compilations and a rough wall time of `plan` on an H200 (Note [Run-length estimate])."""
    calls_per_kernel = settings["rounds"] * settings["calls_per_round"]
    rows = timed = untimed = 0
    seconds = 0.0
    compiled = set()
    for group in plan:
        s = group.shape
        seconds += ESTIMATE_GROUP_S
        for name in group.kernels:
            if not _timed_on_hopper(name, s.dtype):
                continue
            spec = KERNELS[name]
            rows += 1
            timed += calls_per_kernel
            untimed += 1 + settings["warmup"]
            if spec.flops is not None:
                call_s = spec.flops / (ESTIMATE_GEMM_TFLOPS * 1e12)
            else:
                upcast = spec.family not in ("fa3", "cudnn", "vllm_fa3", "fa4_fp8") or name == "fa3_bf16"
                call_s = attention_flops(s) / (ESTIMATE_TFLOPS["bf16" if upcast else "fp8"] * 1e12)
            seconds += (calls_per_kernel + 1 + settings["warmup"]) * call_s
            if spec.family in ("fa4", "fa4_fp8", "aiter_fused"):
                compiled.add((name, s.dtype, s.head_dim, s.heads_q // s.heads_kv, s.causal))
    seconds += ESTIMATE_COMPILE_S * len(compiled)
    return {
        "rows": rows,
        "timed_calls": timed,
        "untimed_calls": untimed,
        "compilations": len(compiled),
        "seconds": seconds,
    }


def estimate_accuracy_seconds(cells) -> float:
    """The study's rough wall time: its calls are small (256 queries), so compilations of kernels the speed
    table does not share (its head dim 128 MHA ones are the same) and cuDNN's graph per cell dominate."""
    measured = [c for c in cells if not c.reason]
    compiled = {(c.kernel, c.causal) for c in measured if KERNELS[c.kernel].family in ("fa4", "fa4_fp8")}
    graphs = sum(KERNELS[c.kernel].family == "cudnn" for c in measured)
    return ESTIMATE_COMPILE_S * len(compiled) + 0.5 * graphs + 0.1 * len(measured)


class Progress:
    """A tqdm bar on a terminal; elsewhere (a log file, the device's captured output, or no tqdm installed)
    one plain line per step with the elapsed time, which reads well in a log."""

    def __init__(self, total: int):
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                print("progress: tqdm not installed, printing one line per step", flush=True)
            else:
                self._bar = tqdm(total=total, unit="step", dynamic_ncols=True)
        self._total, self._done, self._start = total, 0, time.perf_counter()

    def step(self, text: str, n: int = 1) -> None:
        self._done += n
        if self._bar is not None:
            self._bar.set_description_str(text[:60])
            self._bar.update(n)
        else:
            print(f"[{self._done}/{self._total} {time.perf_counter() - self._start:.0f}s] {text}", flush=True)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _fmt_err(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2g}"


def run_group(
    group: Group,
    index: int,
    args: argparse.Namespace,
    capability: tuple[int, int],
    l2_bytes: int,
    deadline: float | None,
    progress: Progress,
) -> list[dict]:
    shape = group.shape
    rows = {name: new_row(shape, KERNELS[name]) for name in group.kernels}
    active = []
    for name in group.kernels:
        spec = KERNELS[name]
        reason = spec.unsupported_reason(shape.dtype, capability)
        status = "unsupported"
        if reason is None:
            reason, status = spec.unavailable_reason(), "unavailable"
        if reason is None:
            active.append(name)
        else:
            rows[name].update(status=status, reason=reason[:REASON_CHARS])
            progress.step(f"{shape.label}: {name} {status}")
    if not active:
        progress.step(f"{shape.label}: nothing to time", args.rounds)
        return list(rows.values())

    set_bytes = (
        ELEMENT_BYTES[shape.dtype] * shape.batch * shape.seqlen * shape.head_dim * (shape.heads_q + 2 * shape.heads_kv)
    )
    inputs = make_inputs(shape, rotation_count(set_bytes, l2_bytes), "cuda", seed=args.seed + index)
    batches = check_batches(shape.batch)
    try:
        ref = reference_attention(*inputs[0], shape.causal, batches)
    except Exception as exc:  # e.g. out of memory: no gate, so no kernel of this group may be timed
        for name in active:
            rows[name].update(status="error", reason=f"fp32 reference failed: {failure_reason(exc)}")
        progress.step(f"{shape.label}: reference failed", len(active) + args.rounds)
        return list(rows.values())

    launchers = {}
    for name in active:
        spec = KERNELS[name]
        if deadline is not None and time.perf_counter() > deadline:
            rows[name].update(status="skipped", reason=f"time budget (--max-minutes {args.max_minutes}) spent")
            progress.step(f"{shape.label}: {name} skipped (budget)")
            continue
        try:
            launches = [spec.bind(q, k, v, shape.causal) for q, k, v in inputs]
            start = time.perf_counter()
            out = launches[0]()
            torch.cuda.synchronize()
            rows[name]["first_call_s"] = time.perf_counter() - start
            # to fp32 before indexing: cuDNN's FP8 output is e4m3, which not every indexing kernel takes
            result = (
                check_output(spec.output_for_check(out)[batches], ref, spec.tolerance(shape.dtype))
                if spec.checked
                else None
            )
            if result is not None and spec.family == "fa4" and spec.knobs and shape.dtype in ("bf16", "fp16"):
                # A softmax stage: the binding gate is its own reference within the derived bounds.
                semantic = semantic_check(dict(spec.knobs), *inputs[0], shape.causal, out)
                rows[name]["semantic_check"] = semantic.as_dict()
                if not semantic.passed:
                    result = dataclasses.replace(result, passed=False, reason=f"semantic check: {semantic.reason}")
            del out
        except Exception as exc:  # the row says what went wrong; the other kernels still run
            rows[name].update(status="error", reason=failure_reason(exc))
            progress.step(f"{shape.label}: {name} error")
            continue
        if result is None:  # a cost probe (KernelSpec.checked False: the GEMM ceiling, exp2 deleted)
            launchers[name] = launches
            rows[name]["reason"] = "not checked: a cost probe (wrong values or no attention output by design)"
            progress.step(f"{shape.label}: {name} ran, not checked (cost probe)")
            continue
        rows[name]["check"] = result.as_dict()
        if result.passed:
            launchers[name] = launches
        else:
            rows[name].update(status="check_failed", reason=result.reason)
        verdict = "checked" if result.passed else "CHECK FAILED"
        progress.step(
            f"{shape.label}: {name} {verdict} (first call {rows[name]['first_call_s']:.1f} s, "
            f"rel err {_fmt_err(result.rel_err)} vs tol {result.tolerance:g})"
        )
    del ref

    times, errors = time_interleaved(
        launchers,
        rounds=args.rounds,
        calls_per_round=args.calls_per_round,
        warmup=args.warmup,
        seed=args.seed + index,
        on_round=lambda r: progress.step(f"{shape.label}: round {r + 1}/{args.rounds}"),
    )
    baseline = times.get(BASELINE) if BASELINE not in errors else None
    for name, per_round in times.items():
        row = rows[name]
        if name in errors:
            row.update(status="error", reason=f"while timing: {errors[name]}"[:REASON_CHARS])
            continue
        calls = [t for round_times in per_round for t in round_times]
        summary = spread(calls)
        spec = KERNELS[name]
        row.update(
            status="ok",
            median_ms=summary["median"],
            ms_q1=summary["q1"],
            ms_q3=summary["q3"],
            tflops=tflops(shape, summary["median"])
            if spec.flops is None
            else spec.flops / (summary["median"] * 1e-3) / 1e12,
            timed_calls=len(calls),
        )
        if spec.flops is not None:  # a ceiling does other work than the group's attention: no speed-ups
            continue
        for peer in RATIO_PEERS:
            if peer in times and peer not in errors and peer != name:
                row[f"speedup_vs_{peer}"] = median(per_round_speedups(times[peer], per_round))
        if baseline:
            ratios = per_round_speedups(baseline, per_round)
            row.update(speedup_vs_fa4_stock=median(ratios), speedup_spread=spread(ratios), round_speedups=ratios)
        else:
            row["reason"] = f"no speed-up: {BASELINE} has no time in this group ({rows[BASELINE]['status']})"
    del inputs, launchers
    torch.cuda.empty_cache()
    return list(rows.values())


def group_summary(rows: list[dict]) -> str:
    parts = []
    for r in rows:
        if r["kernel"] in MAP_KERNELS:
            continue
        if r["status"] == "ok":
            speed = f" {r['speedup_vs_fa4_stock']:.3f}x" if r["speedup_vs_fa4_stock"] is not None else ""
            parts.append(f"{r['kernel']} {r['median_ms']:.3f} ms {r['tflops']:.0f} TF{speed}")
        else:
            parts.append(f"{r['kernel']} {r['status']}")
    return " | ".join(parts)


def default_stem(args: argparse.Namespace, gpu_name: str) -> str:
    """--name, or <gpu>_<preset> (h200_quick, h200_full, h200_fp8, h200_fp8_accuracy)."""
    return args.name or f"{gpu_slug(gpu_name)}_{preset_of(args)}"


def run(plan: list[Group], args: argparse.Namespace, settings: dict, deadline: float | None = None) -> dict:
    """Time `plan`; `deadline` (perf_counter seconds) overrides --max-minutes counted from now."""
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    capability = (props.major, props.minor)
    l2_bytes = props.L2_cache_size
    env = env_info.collect(settings)
    stem = default_stem(args, props.name)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"{stem}.json")
    doc = {"schema": 1, "env": env, "rows": []}
    done: dict[tuple, list[dict]] = {}
    if args.resume and os.path.exists(json_path):
        previous = read_json(json_path)
        done = finished_rows(previous, plan, settings, props.name, env["packages"])
        doc["env"] = previous["env"]
        doc["env"].setdefault("resumed", []).append(
            {
                "date_utc": env["date_utc"],
                "host": env["host"],
                "git_commit": env["git_commit"],
                "code_digest": env["code_digest"],
                "nvidia_smi": env["nvidia_smi"],
                "max_minutes": args.max_minutes,
                "groups_kept": len(done),
            }
        )
    elif args.resume:
        print(f"--resume: no results file at {json_path}; starting a new run", flush=True)
    earlier_wall_s = doc["env"].get("wall_s", 0.0) if args.resume else 0.0
    started = time.perf_counter()
    if deadline is None and args.max_minutes:
        deadline = started + 60 * args.max_minutes
    progress = Progress(sum(len(g.kernels) + args.rounds for g in plan))
    progress.write(
        f"{props.name} sm_{capability[0]}{capability[1]}, L2 {l2_bytes / 2**20:.0f} MiB; "
        f"{len(plan)} groups -> {json_path}"
    )
    for index, group in enumerate(plan):
        if group_key(group.shape) in done:
            rows = done[group_key(group.shape)]
            progress.step(f"{group.shape.label}: kept from the results file", len(group.kernels) + args.rounds)
        elif deadline is not None and time.perf_counter() > deadline:
            rows = [new_row(group.shape, KERNELS[name]) for name in group.kernels]
            for row in rows:
                row["reason"] = f"time budget (--max-minutes {args.max_minutes}) spent"
            progress.step(f"{group.shape.label}: skipped (budget)", len(group.kernels) + args.rounds)
        else:
            rows = run_group(group, index, args, capability, l2_bytes, deadline, progress)
        progress.write(f"{group.shape.label}: {group_summary(rows)}")
        doc["rows"].extend(rows)
        doc["env"]["wall_s"] = earlier_wall_s + time.perf_counter() - started
        write_json(json_path, doc)
    progress.close()
    doc["env"]["nvidia_smi_after"] = env_info.nvidia_smi(device)
    doc["env"]["wall_s"] = earlier_wall_s + time.perf_counter() - started
    write_json(json_path, doc)
    written = write_report(doc, args.out, stem, plots=not args.no_plots)
    print(f"wrote {json_path}\nwrote {written['markdown']}")
    print(written["plots"] if isinstance(written["plots"], str) else "\n".join(f"wrote {p}" for p in written["plots"]))
    for mask in ("causal", "non-causal"):
        for table in (seqlen_pivot(doc["rows"], mask), map_pivot(doc["rows"], mask)):
            if table:
                print(f"\n{mask}:\n{table}")
    print(f"\nwall time {doc['env']['wall_s']:.0f} s")
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    deadline = started + 60 * args.max_minutes if args.max_minutes else None
    cells = None
    try:
        if args.fp8_accuracy or args.with_accuracy:
            cells = accuracy.build_accuracy_plan(args.accuracy_kernels, args.accuracy_keys)
        plan = (
            []
            if args.fp8_accuracy
            else build_plan(
                quick=args.quick,
                kernel_patterns=args.kernels,
                seqlens=args.seqlens,
                map_masks=args.map_masks,
                fp8=args.fp8,
            )
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = settings_of(args)
    if args.dry_run:
        if cells is not None:
            accuracy.print_accuracy_plan(cells)
            print(f"accuracy: rough wall time {estimate_accuracy_seconds(cells):.0f} s ({ESTIMATE_BASIS})")
            print(f"accuracy: vLLM's FA3 peer: {KERNELS['vllm_fa3_fp8'].unavailable_reason() or 'available'}")
        if plan:
            print_plan(plan, settings)
        if cells is not None and plan:
            total = estimate_accuracy_seconds(cells) + estimate_fp8_run(plan, settings)["seconds"]
            print(f"accuracy study + speed table: rough wall time {total:.0f} s in one process")
        return 0
    if not torch.cuda.is_available():
        print(
            "error: python -m bench times CUDA kernels and found no CUDA device (use --dry-run to see the plan)",
            file=sys.stderr,
        )
        return 2
    if cells is not None:
        stem = (
            f"{args.name}_accuracy"
            if args.name
            else default_stem(args, torch.cuda.get_device_name()) + ("_accuracy" if args.with_accuracy else "")
        )
        accuracy.run_study(cells, args.out, stem, seed=args.seed, deadline=deadline, plots=not args.no_plots)
    if plan:
        try:
            run(plan, args, settings, deadline=deadline)
        except ResumeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
