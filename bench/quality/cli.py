"""The command line of the quality study, `python -m bench.quality` (the package docstring lists the options):
its arguments and their checks, and the one call from them to a written report.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import bench.quality
from aiter_fused import hf as fused_hf
from bench import env_info
from bench.quality import assets, baseline, models
from bench.quality.assets import AssetMismatch, MissingAsset
from bench.quality.baps import BAPS_READING_SETS, BAPS_STUDY_LENGTHS, baps_restart_study
from bench.quality.report import baps_restart_markdown, markdown_report, write_results
from bench.quality.stats import BOOTSTRAP_REPS, BOOTSTRAP_SEED, paired_difference
from bench.quality.study import (
    BASELINE,
    BLOCK_ORDER_SEED,
    FULL_MODES,
    MODES,
    QUICK_MODES,
    check_resumable,
    pair_runs,
    plan_runs,
    run_study,
)
from bench.quality.text import DEFAULT_TEXT, TEXTS, cut_blocks
from bench.quality.workload import export_cache, load_from_cache, load_from_gguf

PROG = "python -m bench.quality"
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
CHECKPOINT_SECONDS = 20.0  # the least time between two partial reports (Note [Resuming a cut run] in study.py)


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line and exit status 2: this parser's usage alone runs to a dozen lines (--help)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        """Refuse `--option=--`: argparse (3.11) drops that '--' and stores [] without calling the option's type,
        so `--blocks=--` would pass every count check."""
        args = sys.argv[1:] if args is None else list(args)
        for arg in args:
            if arg == "--":
                break
            option, equals, value = arg.partition("=")
            if option.startswith("-") and equals and value == "--":
                self.error(f"argument {option}: expected a value, got '--'")
        return super().parse_known_args(args, namespace)


def _usage_error(message: str):
    """What the parser does with a bad argument, for what only shows once the command runs (a missing asset)."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(2)


def _integer_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = _OneLineParser(prog=PROG, description=bench.quality.__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"CI slice: 3 blocks of 512 tokens, modes {', '.join(QUICK_MODES)}"
    )
    parser.add_argument(
        "--blocks", type=_integer_at_least(1), help="number of blocks, >= 1 (default: 3 with --quick, else 64)"
    )
    parser.add_argument(
        "--block-size",
        type=_integer_at_least(2),
        help="tokens per block, >= 2 (default: 512 with --quick, else 2048)",
    )
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), help="default: every mode")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--compare-kernels",
        action="store_true",
        help="run each mode's GPU kernel and the simulator on the same blocks (needs --device cuda)",
    )
    parser.add_argument(
        "--kernels-only",
        action="store_true",
        help="run each mode through its GPU kernel only, no simulator twin (needs --device cuda)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for quality_<tag>.json/.md")
    parser.add_argument("--tag", help="results name (default: quick, full or kernels)")
    parser.add_argument(
        "--model",
        choices=sorted(models.MODELS),
        default=models.DEFAULT_MODEL,
        help=f"model to score (default {models.DEFAULT_MODEL}; the Qwen GGUFs: bash scripts/fetch_quality_models.sh)",
    )
    parser.add_argument("--text", choices=TEXTS, default=DEFAULT_TEXT, help=f"text to score (default {DEFAULT_TEXT})")
    parser.add_argument(
        "--assets-dir",
        type=Path,
        default=assets.DEFAULT_CACHE,
        help="folder holding <model>/model.gguf of the Qwen models (default .cache/quality_models)",
    )
    parser.add_argument("--text-dir", type=Path, help="folder of the fetched text (default: the text's cache folder)")
    parser.add_argument("--note", help="a label written at the top of the results (e.g. 'CPU smoke, not the table')")
    parser.add_argument(
        "--allow-text-change",
        action="store_true",
        help="measure a text whose SHA-256 differs from the pinned one (recorded in the results)",
    )
    parser.add_argument("--from-cache", type=Path, help="load model and tokens written by --export (no gguf needed)")
    parser.add_argument("--export", type=Path, help="write model + tokens for --from-cache into this folder and exit")
    parser.add_argument("--export-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=[],
        metavar="RUN:AGAINST",
        help="report RUN minus AGAINST per block with paired intervals (both must be in --modes)",
    )
    parser.add_argument(
        "--baps-restart-study",
        action="store_true",
        help="count BAPS restarts under each reading of the rule (exact attention, no scoring)",
    )
    parser.add_argument(
        "--baps-lengths",
        nargs="+",
        type=_integer_at_least(1),
        default=list(BAPS_STUDY_LENGTHS),
        metavar="N",
        help=f"--baps-restart-study: prefix lengths to count, each <= --block-size (default {BAPS_STUDY_LENGTHS})",
    )
    parser.add_argument(
        "--baps-readings",
        choices=BAPS_READING_SETS,
        default="all",
        help="--baps-restart-study: every reading of the rule, or the simulator's (block, first tile, ceil) alone",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run whose quality_<tag>.json is in --out (same model, text, blocks and runs): "
        "score only the blocks it has not",
    )
    parser.add_argument(
        "--time-budget-s",
        type=_positive_seconds,
        help="scoring time limit: start no block that would end past it (all runs keep the same blocks)",
    )
    args = parser.parse_args(argv)
    if args.compare_kernels and args.device != "cuda":
        parser.error("--compare-kernels needs --device cuda")
    if args.kernels_only and (args.device != "cuda" or args.compare_kernels):
        parser.error("--kernels-only needs --device cuda and excludes --compare-kernels")
    if args.export and args.from_cache:
        parser.error("--export and --from-cache exclude each other")
    for pair in args.pairs:
        parts = pair.split(":")
        if len(parts) != 2 or not all(p in MODES for p in parts):
            parser.error(f"--pairs takes RUN:AGAINST with both modes in {sorted(MODES)}, got {pair!r}")
    if args.blocks is None:
        args.blocks = 3 if args.quick else 64
    if args.block_size is None:
        args.block_size = 512 if args.quick else 2048
    if args.modes is None:
        if args.compare_kernels or args.kernels_only:
            args.modes = [m for m, s in MODES.items() if s.kernel]
        else:
            args.modes = list(QUICK_MODES if args.quick else FULL_MODES)
    for pair in args.pairs:
        missing = [p for p in pair.split(":") if p not in args.modes]
        if missing:
            parser.error(f"--pairs {pair}: {missing} not in --modes {args.modes}")
    try:  # a mode without a GPU kernel, refused before a minute of loading
        plan_runs(args.modes, args.compare_kernels, args.kernels_only)
    except ValueError as refused:
        parser.error(str(refused))
    if args.baps_restart_study:
        too_long = [n for n in args.baps_lengths if not 1 <= n <= args.block_size]
        if too_long:
            parser.error(f"--baps-lengths {too_long}: each must be in [1, --block-size {args.block_size}]")
    if not args.tag:
        args.tag = (
            "baps_restarts"
            if args.baps_restart_study
            else "kernels"
            if args.compare_kernels
            else "kernels_only"
            if args.kernels_only
            else "quick"
            if args.quick
            else "full"
        )
        # Non-default model or text: their names lead, so no run overwrites the SmolLM2 / python-doc results.
        prefix = "_".join(
            x for x, default in ((args.model, models.DEFAULT_MODEL), (args.text, DEFAULT_TEXT)) if x != default
        )
        args.tag = f"{prefix}_{args.tag}".replace(".", "") if prefix else args.tag
    if args.resume:
        if args.baps_restart_study:
            parser.error("--resume continues a scored run; --baps-restart-study has none to continue")
        if not (args.out / f"quality_{args.tag}.json").is_file():
            parser.error(f"--resume: no previous report {args.out / f'quality_{args.tag}.json'} (--out, --tag)")
    return args


def _git_commit() -> str | None:
    """HEAD of the checkout, with "+dirty" when tracked files differ (None outside a git checkout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():  # not in parse_args: GPU plans parse on any machine
        _usage_error(
            "argument --device: cuda needs a CUDA device and torch.cuda.is_available() is False; "
            "accepted on this machine: --device cpu"
        )
    started = time.perf_counter()
    git_commit = _git_commit()  # at the start: the code that runs, not what a later commit made of it
    code_digest = env_info.code_digest()  # Note [Code digest]: what ran, whatever the git metadata says
    if args.device == "cuda":
        # The fp32 baseline and the simulator must not silently drop to TF32 matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        if args.from_cache:
            workload = load_from_cache(args.from_cache)
        else:
            workload = load_from_gguf(args.text_dir, args.allow_text_change, args.model, args.text, args.assets_dir)
    except (MissingAsset, AssetMismatch) as refused:  # each names the file and the command that fetches it
        _usage_error(str(refused))
    if args.export:
        export_cache(workload, args.export, getattr(torch, args.export_dtype))
        print(f"exported to {args.export}")
        return None
    max_positions = getattr(workload.model.config, "max_position_embeddings", None)
    if max_positions is not None and args.block_size > max_positions:
        _usage_error(
            f"argument --block-size: must be at most the model's max_position_embeddings ({max_positions}), "
            f"got {args.block_size}"
        )
    workload.model.to(args.device)
    try:
        blocks, indices = cut_blocks(workload.token_ids, args.block_size, args.blocks)
    except ValueError as too_many:
        _usage_error(f"--blocks {args.blocks} --block-size {args.block_size}: {too_many}")
    order = np.random.default_rng(BLOCK_ORDER_SEED).permutation(len(blocks))
    blocks, indices = blocks[torch.from_numpy(order)], [indices[i] for i in order]
    if args.baps_restart_study:
        study = baps_restart_study(
            workload,
            blocks,
            log=print,
            lengths=tuple(args.baps_lengths),
            reading_set=args.baps_readings,
            time_budget_s=args.time_budget_s,
        )
        study["meta"] = dict(
            workload.provenance,
            block_size=args.block_size,
            block_indices=indices[: study["num_blocks"]],
            torch=torch.__version__,
            device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            git_commit=git_commit,
            code_digest=code_digest,
            command="python -m bench.quality " + shlex.join(argv if argv is not None else sys.argv[1:]),
            wall_seconds=time.perf_counter() - started,
        )
        write_results(args.out, args.tag, study, baps_restart_markdown(study))
        return study
    runs = plan_runs(args.modes, args.compare_kernels, args.kernels_only)
    previous = None
    if args.resume:
        previous_path = args.out / f"quality_{args.tag}.json"
        previous = json.loads(previous_path.read_text())
        expected = dict(
            workload.provenance,
            block_size=args.block_size,
            num_blocks_requested=len(blocks),
            block_order_seed=BLOCK_ORDER_SEED,
        )
        check_resumable(previous, expected, [r.name for r in runs], indices)
        print(f"--resume: {previous['meta']['num_blocks']} blocks from {previous_path}")
    print(f"{len(runs)} runs x {len(blocks)} blocks of {args.block_size} tokens on {args.device}")
    import transformers

    device_name = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"cpu ({platform.processor() or 'x86_64'}, {torch.get_num_threads()} threads)"
    )
    first_block = previous["meta"]["num_blocks"] if previous else 0
    command = "python -m bench.quality " + shlex.join(argv if argv is not None else sys.argv[1:])

    def finished(report: dict, final: bool) -> dict:
        """The report with its meta (and, when `final`, printed): written after every block and at the end."""
        report = dict(report)
        blocks_done = report.pop("blocks_done")
        baseline_seconds = report.pop("baseline_seconds")
        report["paired"] = {pair: paired_difference(report["runs"], *pair_runs(pair, runs)) for pair in args.pairs}
        sessions = list(previous["meta"].get("sessions", [])) if previous else []
        sessions.append(
            dict(
                blocks=[first_block, blocks_done],
                device=device_name,
                git_commit=git_commit,
                code_digest=code_digest,
                wall_seconds=time.perf_counter() - started,
            )
        )
        meta = dict(
            workload.provenance,
            tag=args.tag,
            block_size=args.block_size,
            num_blocks=blocks_done,
            num_blocks_requested=len(blocks),
            block_indices=indices[:blocks_done],
            bootstrap_reps=BOOTSTRAP_REPS,
            bootstrap_seed=BOOTSTRAP_SEED,
            block_order_seed=BLOCK_ORDER_SEED,
            baseline=f"{BASELINE} float32"
            + (
                f", in query chunks of {baseline.QUERY_CHUNK} (Note [Baseline in query chunks])"
                if args.block_size > baseline.WHOLE_BLOCK_MAX_TOKENS
                else ""
            ),
            hybrid_schedule=(
                f"per layer: MXFP6 in the first and last {fused_hf.HYBRID_EDGE_LAYERS} layers, MXFP4 between "
                "(Note [Hybrid MX schedule for an LLM] in aiter_fused/hf.py)"
            ),
            device=device_name,
            torch=torch.__version__,
            transformers=transformers.__version__,
            gguf=_package_version("gguf"),
            numpy=np.__version__,
            python=platform.python_version(),
            threads=torch.get_num_threads(),
            baseline_seconds_per_block=baseline_seconds / blocks_done if blocks_done else None,
            note=args.note,
            git_commit=git_commit,
            code_digest=code_digest,
            command=command,
            wall_seconds=sum(session["wall_seconds"] for session in sessions),
            sessions=sessions,
        )
        report = {"meta": meta, **report}
        write_results(args.out, args.tag, report, markdown_report(report), echo=final)
        return report

    # Note [Resuming a cut run] (study.py): a report on disk after every block (at most every CHECKPOINT_SECONDS),
    # so a process killed from outside (a device call's timeout) keeps the blocks it finished for --resume.
    last_write = [time.perf_counter()]

    def checkpoint(partial: dict) -> None:
        if time.perf_counter() - last_write[0] >= CHECKPOINT_SECONDS:
            finished(partial, final=False)
            last_write[0] = time.perf_counter()

    return finished(run_study(workload, blocks, runs, args.time_budget_s, previous=previous, on_block=checkpoint), True)
