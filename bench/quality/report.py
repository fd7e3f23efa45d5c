"""The Markdown of both studies and the files they are written to (`quality_<tag>.json` and `.md`), and the
kernel-vs-simulator table over block lengths from several reports (`python -m bench.quality.report JSON...`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.quality import baseline
from bench.quality.study import BASELINE, MODES


def _fmt_ci(value: float, ci: list[float], digits: int, scale: float = 1.0) -> str:
    return f"{value * scale:+.{digits}f} [{ci[0] * scale:+.{digits}f}, {ci[1] * scale:+.{digits}f}]"


def _fmt_counters(summary: dict) -> str:
    rates = summary["counter_rates"]
    parts = [f"{name} {value:.4g}" for name, value in rates.items()]
    return "; ".join(parts) if parts else "-"


def markdown_report(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"# Softmax modes in a real model: {meta['tag']}",
        "",
        *([f"**{meta['note']}**", ""] if meta.get("note") else []),
        f"- model: {meta['model']} (sha256 {meta['model_sha256'][:16]}...)",
        *(
            [f"- weights: {meta['weights_note']}; output layer {meta['output_layer']}"]
            if meta.get("weights_note")
            else []
        ),
        f"- text: {meta['text_source']}; {len(meta['text_files'])} files joined, sha256 {meta['text_sha256']}, "
        f"{meta['num_tokens']} tokens",
        f"- blocks: {meta['num_blocks']} of {meta['block_size']} tokens, evenly spaced, scored in a random order "
        f"(seed {meta['block_order_seed']}; block indices {meta['block_indices']})"
        + (
            f"; stopped by the time budget ({meta['num_blocks_requested']} requested)"
            if meta["num_blocks"] < meta["num_blocks_requested"]
            else ""
        ),
        f"- baseline: exact softmax, transformers `{BASELINE}` attention in float32"
        + (
            f", in query chunks of {baseline.QUERY_CHUNK} (Note [Baseline in query chunks])"
            if meta["block_size"] > baseline.WHOLE_BLOCK_MAX_TOKENS
            else ""
        )
        + ", same blocks (paired)",
        f"- 95% intervals: paired block bootstrap, {meta['bootstrap_reps']} replicates, seed {meta['bootstrap_seed']}",
        f"- device: {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}"
        + (f", gguf {meta['gguf']}" if meta.get("gguf") else "")
        + f"; {meta['wall_seconds']:.0f} s"
        + (
            f" (baseline {meta['baseline_seconds_per_block']:.1f} s per block)"
            if meta.get("baseline_seconds_per_block")
            else ""
        ),
        f"- command: `{meta.get('command')}`"
        + (f" at git {meta['git_commit']}" if meta.get("git_commit") else "")
        + (f" (code sha256 {meta['code_digest'][:16]})" if meta.get("code_digest") else ""),
        *(
            [
                "- sessions (`--resume`): "
                + "; ".join(
                    f"blocks {a + 1}-{b} on {x['device']} at git {x['git_commit']} ({x['wall_seconds']:.0f} s)"
                    for x in meta["sessions"]
                    for a, b in [x["blocks"]]
                )
            ]
            if len(meta.get("sessions", [])) > 1
            else []
        ),
        *(
            [f"- hybrid: {meta['hybrid_schedule']}"]
            if any(s.get("mode") == "fused_hybrid" for s in report["runs"].values())
            else []
        ),
        "",
        "| run | backend | delta-NLL (nats) [95% CI] | PPL change % [95% CI] | top-1 agreement % [95% CI] | "
        "KL(exact ‖ run) nats/token [95% CI] | counters | s / block |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in report["runs"].items():
        backend = s["backend"] + (f" ({s['reference_input_dtype']} inputs)" if s["reference_input_dtype"] else "")
        lines.append(
            f"| {name} | {backend} | {_fmt_ci(s['delta_nll'], s['delta_nll_ci95'], 5)} | "
            f"{_fmt_ci(s['ppl_change_pct'] / 100, [c / 100 for c in s['ppl_change_pct_ci95']], 3, 100)} | "
            f"{s['top1_agreement_pct']:.2f} [{s['top1_agreement_pct_ci95'][0]:.2f}, "
            f"{s['top1_agreement_pct_ci95'][1]:.2f}] | {s['kl_nats']:.5f} [{s['kl_nats_ci95'][0]:.5f}, "
            f"{s['kl_nats_ci95'][1]:.5f}] | {_fmt_counters(s)} | "
            + (f"{s['seconds_per_block']:.1f} |" if s.get("seconds_per_block") is not None else "- |")
        )
    lines += ["", "Modes:"] + [f"- `{name}`: {s['description']}" for name, s in report["runs"].items()]
    if report["kernel_vs_simulator"]:
        lines += [
            "",
            "## Kernel vs simulator (same blocks, simulator fed the kernel's bf16 inputs)",
            "",
            "| mode | kernel delta-NLL [95% CI] | simulator delta-NLL [95% CI] | kernel - simulator [95% CI] | "
            "kernel inside simulator CI | top-1 agreement kernel vs simulator % | recoveries kernel / simulator |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for mode, c in report["kernel_vs_simulator"].items():
            lines.append(
                f"| {mode} | {_fmt_ci(c['kernel_delta_nll'], c['kernel_delta_nll_ci95'], 5)} | "
                f"{_fmt_ci(c['sim_delta_nll'], c['sim_delta_nll_ci95'], 5)} | "
                f"{_fmt_ci(c['kernel_minus_sim'], c['kernel_minus_sim_ci95'], 5)} | "
                f"{'yes' if c['kernel_in_sim_ci95'] else 'NO'} | {c['kernel_vs_sim_top1_agreement_pct']:.2f} | "
                + (
                    f"{c['kernel_recoveries']} / {c['sim_recoveries']} |"
                    if c["kernel_recoveries"] is not None
                    else "- |"
                )
            )
    if report.get("paired"):
        lines += [
            "",
            "## Paired differences (run minus against, same blocks)",
            "",
            "| run - against | delta-NLL (nats) [95% CI] | KL (nats/token) [95% CI] "
            "| top-1 agreement (points) [95% CI] |",
            "| --- | --- | --- | --- |",
        ]
        for pair, d in report["paired"].items():
            lines.append(
                f"| {pair.replace(':', ' - ')} | {_fmt_ci(d['delta_nll'], d['delta_nll_ci95'], 5)} | "
                f"{_fmt_ci(d['kl_nats'], d['kl_nats_ci95'], 5)} | "
                f"{_fmt_ci(d['top1_agreement_pct'], d['top1_agreement_pct_ci95'], 2)} |"
            )
    return "\n".join(lines) + "\n"


def baps_restart_markdown(study: dict) -> str:
    meta = study["meta"]
    lines = [
        "# BAPS restart rates under each reading of the rule",
        "",
        f"- text: {meta['text_source']} (sha256 {meta['text_sha256'][:16]}...); "
        f"{study.get('num_blocks', len(meta['block_indices']))} of {study.get('num_blocks_requested', '?')} blocks "
        f"{meta['block_indices']} of {meta['block_size']} tokens; model: {meta['model']}",
        f"- device: {meta.get('device', '?')}; torch {meta['torch']}; command: `{meta.get('command', '?')}`",
        f"- tiles {study['tile_m']} x {study['tile_n']}; ARR = restarts / followed tiles (unit: block-tile for "
        "`block`, (row, tile) pair for `row`); PRR = largest share of one output O_i; PRR long = over outputs "
        "with >= 8 followed tiles; by distance = ARR of the block's last tile (0), the one before (1), the rest (2+)",
        "",
        "| seqlen | granularity | B0 | rounding | lambda | ARR % | PRR % | PRR long % | ARR by distance 0 / 1 / 2+ % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in study["rows"]:
        by_distance = " / ".join("-" if x is None else f"{100 * x:.1f}" for x in row["arr_by_distance"])
        lines.append(
            f"| {row['seqlen']} | {row['granularity']} | {row['critical']} | {row['rounding']} | "
            f"{row['lambda']} | {100 * row['arr']:.2f} | {100 * row['prr']:.2f} | "
            f"{100 * row['prr_long']:.2f} | {by_distance} |"
        )
    return "\n".join(lines) + "\n"


def write_results(out: Path, tag: str, data: dict, markdown: str, echo: bool = True) -> None:
    """`quality_<tag>.json` and `.md` under `out` (each replaced whole: a kill never leaves half a file); with
    `echo` the Markdown is also printed."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in ((f"quality_{tag}.json", json.dumps(data, indent=1) + "\n"), (f"quality_{tag}.md", markdown)):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    if echo:
        print(markdown)


def lengths_markdown(reports: list[dict]) -> str:
    """One table of every kernel-vs-simulator comparison in `reports` (one report per block length, all of one
    model and text), by mode and block length: the kernel's and the simulator's delta-NLL against the float32
    baseline with the perplexity change, and kernel minus simulator with its paired interval."""
    if not reports:
        raise ValueError("reports must hold at least one report")
    identity = [(r["meta"]["model"], r["meta"]["text_sha256"]) for r in reports]
    if len(set(identity)) != 1:
        raise ValueError(f"reports must share one model and text, got {sorted(set(identity))}")
    rows = sorted(
        (list(MODES).index(mode), r["meta"]["block_size"], mode, r)
        for r in reports
        for mode in r["kernel_vs_simulator"]
    )
    meta = reports[0]["meta"]
    lines = [
        f"Kernel vs simulator by block length: {meta['model']}; text sha256 {meta['text_sha256'][:16]}...; "
        f"delta-NLL against exact softmax (`{BASELINE}`, float32) on the same blocks, 95% paired block-bootstrap "
        "intervals.",
        "",
        "| mode | P.V accumulation | block tokens | blocks | kernel delta-NLL [95% CI] | kernel PPL change % | "
        "simulator delta-NLL [95% CI] | kernel - simulator [95% CI] | interval holds 0 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for _, block_size, mode, report in rows:
        c = report["kernel_vs_simulator"][mode]
        low_high = c["kernel_minus_sim_ci95"]
        kernel = report["runs"][f"kernel_{mode}"]
        lines.append(
            f"| {mode} | {MODES[mode].kernel_kwargs.get('pv_accumulation', '-')} | {block_size} | "
            f"{report['meta']['num_blocks']} | {_fmt_ci(c['kernel_delta_nll'], c['kernel_delta_nll_ci95'], 5)} | "
            f"{kernel['ppl_change_pct']:+.2f} | {_fmt_ci(c['sim_delta_nll'], c['sim_delta_nll_ci95'], 5)} | "
            f"{_fmt_ci(c['kernel_minus_sim'], low_high, 5)} | {'yes' if low_high[0] <= 0 <= low_high[1] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m bench.quality.report", description="the kernel-vs-simulator table over block lengths"
    )
    parser.add_argument("reports", nargs="+", type=Path, help="quality_<tag>.json files, one per block length")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.reports if not p.is_file()]
    if missing:
        parser.error(f"reports: no such file {missing}")
    table = lengths_markdown([json.loads(p.read_text()) for p in args.reports])
    print(table, end="")
    return table


if __name__ == "__main__":
    main()
