"""The scored study: the modes, the plan of runs, every run scored on every block, a cut run resumed.

`run_study` scores the baseline (exact softmax, transformers' `sdpa` in float32: baseline.py) and every `Run` on the
same blocks, so every per-block difference is paired (Note [What is reported] in stats.py). The caller hands it
the blocks in one seeded order (BLOCK_ORDER_SEED; cli.py), which is what lets a later session resume a cut
run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from aiter_fused import hf as fused_hf
from bench.quality import baseline
from bench.quality.stats import bootstrap_interval, counter_rates, mean_kl, score_block, summarize
from bench.quality.workload import Workload
from fa4_rowmax import hf

# Every mode the study can run: the rowmax/exact/BAPS modes and the Fused-Softmax formats.
MODES = {**hf.MODES, **fused_hf.MODES}
BASELINE = "sdpa"  # transformers' own exact attention, float32

QUICK_MODES = ("exact_ref", "rowmax_pot", "rowmax_h15_t0", "rowmax_h15_t8")
FULL_MODES = (
    "exact_ref",
    "exact_bf16p",
    "rowmax_pot",
    "rowmax_h15_t0",
    "rowmax_h15_t8",
    "rowmax_h15_row",
    "baps_l0",
    "baps_l1",
    "baps_l2",
    "fused_mxfp8",
    "fused_mxfp6",
    "fused_mxfp4",
    "fused_hybrid",
    "exact_fp8_inputs",
    "exact_fp8",
    "rowmax_h15_fp8",
    "exact_fp8_ksmooth",
    "rowmax_h15_fp8_ksmooth",
)
# Issue 22 item 7: the two K-smoothed FP8 modes through the kernel, two-level and single-level P.V accumulation
# (Note [P.V accumulation in the study] in fa4_rowmax/hf.py), each beside its simulator.
FP8_ACCUMULATION_MODES = (
    "exact_fp8_ksmooth",
    "exact_fp8_ksmooth_single_acc",
    "rowmax_h15_fp8_ksmooth",
    "rowmax_h15_fp8_ksmooth_single_acc",
)
# Tokens of the first block each kernel run scores once before the budget's clock starts (run_study): its compiles.
WARMUP_TOKENS = 256
# Blocks are scored in a seeded random order, so the blocks done before a --time-budget-s stop are a
# random sample of the evenly spaced set, not the beginning of the text.
BLOCK_ORDER_SEED = 0


@dataclass(frozen=True)
class Run:
    """One row of the table: a mode on a backend (see `fa4_rowmax.hf`)."""

    name: str
    mode: str
    backend: str  # "reference" or "kernel"
    reference_input_dtype: torch.dtype | None = None  # bf16: the simulator sees what a BF16 kernel sees


def plan_runs(modes: list[str], compare_kernels: bool, kernels_only: bool = False) -> list[Run]:
    """Reference runs; with `compare_kernels` a kernel run and its bf16-fed simulator twin per mode; with
    `kernels_only` the kernel run alone (the long kernel table: the simulator twin costs most of the time)."""
    if not (compare_kernels or kernels_only):
        return [Run(mode, mode, "reference") for mode in modes]
    runs = []
    for mode in modes:
        if MODES[mode].kernel is None:
            raise ValueError(
                f"--{'compare-kernels' if compare_kernels else 'kernels-only'}: mode {mode!r} has no GPU kernel; "
                f"modes with kernels: {[m for m, s in MODES.items() if s.kernel]}"
            )
        runs.append(Run(f"kernel_{mode}", mode, "kernel"))
        if compare_kernels:
            runs.append(Run(f"sim_bf16in_{mode}", mode, "reference", torch.bfloat16))
    return runs


def pair_runs(pair: str, runs: list[Run]) -> tuple[str, str]:
    """The run names of a `--pairs RUN:AGAINST` of modes: the kernel runs when the study has them
    (`--kernels-only`, `--compare-kernels`), else the simulator's."""
    names = {r.name for r in runs}
    return tuple(f"kernel_{mode}" if f"kernel_{mode}" in names else mode for mode in pair.split(":"))


# Note [Resuming a cut run]
# One device session cannot score every mode on every block of a large model (issue 12: 30 minutes of H200
# a session), so `--resume` continues the run whose `quality_<tag>.json` is already in `--out`. Blocks are
# scored in one seeded order, so a cut run holds the first K blocks of that order: the resumed call scores
# blocks K+1.. with the same runs and appends them, and the pairing (every run on the same blocks as the
# baseline) holds across sessions. It refuses a previous report whose model, text, block size, requested
# blocks, block order or runs differ (a silent mix would pair different things). Counters are sums and
# maxima, so they merge exactly; the intervals are recomputed over all blocks. Each call adds an entry to
# `meta.sessions` (its blocks, device, git commit, wall time), so a table made in several sessions says so.
# The report is also written after every block (at most every CHECKPOINT_SECONDS of cli.py, each file replaced
# whole), so a run killed from outside (a device call's timeout) keeps what it finished, and --resume goes on.
RESUME_KEYS = (
    "model",
    "model_sha256",
    "text_sha256",
    "num_tokens",
    "block_size",
    "num_blocks_requested",
    "block_order_seed",
)


def check_resumable(previous: dict, expected: dict, run_names: list[str], block_indices: list[int]) -> None:
    """Raise ValueError naming every setting in which `previous` (a report) differs from this call."""
    meta = previous.get("meta", {})
    differ = [
        f"{key}: previous {meta.get(key)!r}, now {expected.get(key)!r}"
        for key in RESUME_KEYS
        if meta.get(key) != expected.get(key)
    ]
    if sorted(previous.get("runs", {})) != sorted(run_names):
        differ.append(f"runs: previous {sorted(previous.get('runs', {}))}, now {sorted(run_names)}")
    done = meta.get("num_blocks", 0)
    if meta.get("block_indices") != block_indices[:done]:
        differ.append("block_indices: the previous blocks are not the first blocks of this call's order")
    if differ:
        raise ValueError("--resume: the previous report is a different run; " + "; ".join(differ))


def _resumed_state(runs: list[Run], previous: dict | None) -> tuple[dict, dict, int, float]:
    """Per-run records, kernel-vs-simulator agreements, blocks done and baseline seconds: empty, or read
    back from a previous report of the same runs (Note [Resuming a cut run])."""
    names = {r.name for r in runs}
    per_run = {r.name: {"delta": [], "agree": [], "kl": [], "totals": {}, "maxima": {}, "seconds": 0.0} for r in runs}
    kernel_vs_sim_agree = {r.mode: [] for r in runs if r.backend == "kernel" and f"sim_bf16in_{r.mode}" in names}
    if previous is None:
        return per_run, kernel_vs_sim_agree, 0, 0.0
    for name, record in per_run.items():
        summary = previous["runs"][name]
        record.update(
            delta=list(summary["per_block_delta_nll"]),
            agree=list(summary["per_block_top1_agreement"]),
            kl=list(summary["per_block_kl_nats"]),
            totals=dict(summary["counters"]),
            maxima=dict(summary["counter_maxima"]),
            seconds=summary["seconds"],
        )
    for mode, agree in kernel_vs_sim_agree.items():
        agree.extend(previous["kernel_vs_simulator"][mode]["per_block_kernel_vs_sim_top1_agreement"])
    meta = previous["meta"]
    return per_run, kernel_vs_sim_agree, meta["num_blocks"], meta["baseline_seconds_per_block"] * meta["num_blocks"]


def run_study(
    workload: Workload,
    blocks: torch.Tensor,
    runs: list[Run],
    time_budget_s: float | None = None,
    log=print,
    previous: dict | None = None,
    on_block=None,
) -> dict:
    """Score the baseline and every run on every block; per-block deltas, agreement and counters per run.

    With `time_budget_s`, no new block is started once the time spent plus one more block would exceed it;
    every run still covers the same blocks (the pairing holds) and the report says how many were done. The
    kernel runs first run once on WARMUP_TOKENS of the first block, before the clock starts: their compiles
    (tens of seconds for the FP8 kernels) would make the first block predict the others badly.
    `previous` (a report of the same runs and blocks, checked by `check_resumable`) supplies the blocks it
    holds; this call scores the rest, and the budget counts this call's time only. `on_block(partial)` is
    called after every block with what this function would return at that point (Note [Resuming a cut run]).
    """
    model = workload.model
    for backend in sorted({r.backend for r in runs}):
        hf.register(sorted({r.mode for r in runs if r.backend == backend}), backend=backend, table=MODES)
    baseline_attention = baseline.register()
    state = hf.attach(model)
    per_run, kernel_vs_sim_agree, first_block, baseline_seconds = _resumed_state(runs, previous)
    if first_block < len(blocks):
        for run in runs:
            if run.backend == "kernel":
                score_block(model, blocks[first_block][:WARMUP_TOKENS], hf.attention_name(run.mode, run.backend))
    started = time.perf_counter()
    blocks_done = first_block
    for b in range(first_block, len(blocks)):
        block = blocks[b]
        elapsed = time.perf_counter() - started
        done_here = b - first_block
        if time_budget_s is not None and done_here > 0 and elapsed * (done_here + 1) / done_here > time_budget_s:
            log(f"time budget {time_budget_s:.0f} s: stopping after {b} of {len(blocks)} blocks")
            break
        t0 = time.perf_counter()
        base = score_block(model, block, baseline_attention)
        base_seconds = time.perf_counter() - t0
        baseline_seconds += base_seconds
        top1_of = {}
        for run in runs:
            record = per_run[run.name]
            state.reference_input_dtype = run.reference_input_dtype
            state.tally.reset()
            t0 = time.perf_counter()
            scores = score_block(model, block, hf.attention_name(run.mode, run.backend))
            record["seconds"] += time.perf_counter() - t0
            result = dict(
                delta=float(scores.nll.mean() - base.nll.mean()),
                agree=float((scores.top1 == base.top1).double().mean()),
                kl=mean_kl(base, scores),
                top1=scores.top1,
                totals=dict(state.tally.totals),
                maxima=dict(state.tally.maxima),
            )
            del scores  # a 32K-token block's log-probabilities are 20 GB
            for key in ("delta", "agree", "kl"):
                record[key].append(result[key])
            for name, value in result["totals"].items():
                record["totals"][name] = record["totals"].get(name, 0) + value
            for name, value in result["maxima"].items():
                record["maxima"][name] = max(record["maxima"].get(name, float("-inf")), value)
            top1_of[run.name] = result["top1"]
        for mode, agree in kernel_vs_sim_agree.items():
            agree.append(float((top1_of[f"kernel_{mode}"] == top1_of[f"sim_bf16in_{mode}"]).double().mean()))
        blocks_done = b + 1
        log(
            f"block {b + 1}/{len(blocks)}: baseline NLL {base.nll.mean():.4f} ({base_seconds:.1f} s); "
            + ", ".join(f"{r.name} {per_run[r.name]['delta'][-1]:+.5f}" for r in runs)
        )
        if on_block is not None:
            on_block(_summarize_runs(runs, per_run, kernel_vs_sim_agree, blocks_done, baseline_seconds))
    return _summarize_runs(runs, per_run, kernel_vs_sim_agree, blocks_done, baseline_seconds)


def _summarize_runs(runs: list[Run], per_run: dict, kernel_vs_sim_agree: dict, blocks_done: int, baseline_seconds):
    """run_study's result from its per-run records: summaries, kernel-vs-simulator comparisons, blocks done."""
    results = {}
    for run in runs:
        record = per_run[run.name]
        summary = summarize(np.array(record["delta"]), np.array(record["agree"]), np.array(record["kl"]))
        spec = MODES[run.mode]
        summary.update(
            mode=run.mode,
            backend=run.backend,
            reference_input_dtype=str(run.reference_input_dtype) if run.reference_input_dtype else None,
            description=spec.description,
            counters=record["totals"],
            counter_maxima=record["maxima"],
            counter_rates=counter_rates(spec.config_fields["mode"], record["totals"], record["maxima"]),
            seconds=record["seconds"],
            seconds_per_block=record["seconds"] / blocks_done if blocks_done else None,
        )
        results[run.name] = summary
    comparisons = {}
    for mode, agree in kernel_vs_sim_agree.items():
        kernel, sim = results[f"kernel_{mode}"], results[f"sim_bf16in_{mode}"]
        diff = np.array(kernel["per_block_delta_nll"]) - np.array(sim["per_block_delta_nll"])
        low, high = sim["delta_nll_ci95"]
        comparisons[mode] = {
            "kernel_delta_nll": kernel["delta_nll"],
            "kernel_delta_nll_ci95": kernel["delta_nll_ci95"],
            "sim_delta_nll": sim["delta_nll"],
            "sim_delta_nll_ci95": sim["delta_nll_ci95"],
            "kernel_minus_sim": float(diff.mean()),
            "kernel_minus_sim_ci95": list(bootstrap_interval(diff)),
            "kernel_in_sim_ci95": bool(low <= kernel["delta_nll"] <= high),
            "kernel_vs_sim_top1_agreement_pct": 100.0 * float(np.mean(agree)),
            "per_block_kernel_vs_sim_top1_agreement": [float(x) for x in agree],
            "kernel_recoveries": kernel["counters"].get("recoveries"),
            "sim_recoveries": sim["counters"].get("recoveries") if "recoveries" in kernel["counters"] else None,
        }
    return {
        "runs": results,
        "kernel_vs_simulator": comparisons,
        "blocks_done": blocks_done,
        "baseline_seconds": baseline_seconds,
    }
