"""Results: the row format, the JSON file, the Markdown report and the plots.

`python -m bench.report RESULTS.json [--out DIR]` regenerates the Markdown and the plots from a JSON file
(for instance on a machine with matplotlib, from a device run that had none);
`python -m bench.report --fp8-defaults RUN.json [RUN.json ...]` prints the README's FP8 speed table from runs of
`bash scripts/h200_session.sh peers OUT` (`fp8_defaults_table`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from bench.kernels import (
    BASELINE,
    H15_BETAS,
    H15_THRESHOLDS,
    KERNELS,
    MAP_KERNELS,
    RATIO_PEERS,
    KernelSpec,
    h15_map_name,
)
from bench.sweep import FOCUS_SEQLEN, HEADS_Q, TOKENS, Shape, format_seqlen

STATUSES = ("ok", "check_failed", "unsupported", "unavailable", "error", "skipped")
REASON_CHARS = 400  # a row's reason is cut here, so one long exception message cannot swamp the tables
FLOPS_FORMULA = (
    "FLOPs = 4 * batch * heads_q * seqlen_q * seqlen_k * head_dim (QK^T and PV, 2 per multiply-add), "
    "halved for causal; TFLOPS = FLOPs / median time"
)
SPEEDUP_DEFINITION = (
    "speed-up = FA4 stock time / kernel time, the median over interleaved rounds of the "
    "per-round ratio of median call times (>1: faster than FA4 stock); brackets: "
    "interquartile range of the per-round ratios"
)
GATE_DEFINITION = (
    "gate: output finite and ||out - ref||_F / ||ref||_F <= tolerance, ref = fp32 attention "
    "(PyTorch math SDPA) of the same inputs, first and last batch entry, all heads; "
    "inputs N(0, 1)"
)


def new_row(shape: Shape, spec: KernelSpec) -> dict:
    """A result row with every field present; the run fills in status, times and the check."""
    return {
        "kernel": spec.name,
        "family": spec.family,
        "mode": spec.mode,
        "knobs": dict(spec.knobs),
        "dtype": shape.dtype,
        "mask": shape.mask,
        "causal": shape.causal,
        "seqlen": shape.seqlen,
        "head_dim": shape.head_dim,
        "heads_q": shape.heads_q,
        "heads_kv": shape.heads_kv,
        "batch": shape.batch,
        "status": "skipped",
        "reason": "",
        "median_ms": None,
        "ms_q1": None,
        "ms_q3": None,
        "tflops": None,
        "speedup_vs_fa4_stock": None,
        "speedup_spread": None,
        "round_speedups": None,
        "check": None,
        "first_call_s": None,
        "timed_calls": 0,
        **{f"speedup_vs_{peer}": None for peer in RATIO_PEERS},
    }


def failure_reason(exc: BaseException) -> str:
    """A row's reason for an exception: its type and message, cut at REASON_CHARS."""
    return f"{type(exc).__name__}: {exc}"[:REASON_CHARS]


def _finite_or_none(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def write_json(path: str, doc: dict) -> None:
    """Strict JSON (NaN and inf become null), written to a temporary name and renamed into place."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_finite_or_none(doc), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "rows" not in doc or "env" not in doc:
        raise ValueError(f"{path} is not a benchmark result (needs 'env' and 'rows')")
    return doc


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H200' -> 'h200': the first word of the GPU name that holds a digit."""
    for word in re.split(r"[^a-z0-9]+", (name or "").lower()):
        if any(ch.isdigit() for ch in word):
            return word
    return "gpu"


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _fmt(value, digits=3) -> str:
    return "" if value is None else f"{value:.{digits}g}"


def speedup_cell(row: dict) -> str:
    """'1.05 [1.03, 1.06]' for a timed row, else the status (and the check's error for a failed gate)."""
    if row["status"] == "ok":
        if row["speedup_vs_fa4_stock"] is None:
            return f"{row['tflops']:.0f} TF (no baseline)" if row["tflops"] is not None else "no time"
        s = row["speedup_spread"] or {}
        return f"{row['speedup_vs_fa4_stock']:.3f} [{_fmt(s.get('q1'))}, {_fmt(s.get('q3'))}]"
    if row["status"] == "check_failed" and row["check"] and row["check"].get("rel_err") is not None:
        return f"check failed ({row['check']['rel_err']:.2g} > {row['check']['tolerance']:g})"
    return row["status"].replace("_", " ")


def _is_main(row: dict) -> bool:
    return row["dtype"] == "bf16" and row["head_dim"] == 128 and row["heads_q"] == row["heads_kv"] == HEADS_Q


def seqlen_pivot(rows: list[dict], mask: str) -> str | None:
    """Kernels x seqlens table of speed-ups (bf16, head dim 128, MHA); FA4 stock shows its TFLOPS."""
    main = [r for r in rows if _is_main(r) and r["mask"] == mask and r["kernel"] not in MAP_KERNELS]
    if not main:
        return None
    seqlens = sorted({r["seqlen"] for r in main})
    kernels = list(dict.fromkeys(r["kernel"] for r in main))
    cell = {(r["kernel"], r["seqlen"]): r for r in main}
    lines = ["| kernel | " + " | ".join(format_seqlen(s) for s in seqlens) + " |", "| --- |" + " --- |" * len(seqlens)]
    for kernel in kernels:
        cells = []
        for s in seqlens:
            row = cell.get((kernel, s))
            if row is None:
                cells.append("")
            elif kernel == BASELINE and row["status"] == "ok":
                cells.append(f"{row['tflops']:.0f} TFLOPS")
            else:
                cells.append(_md_escape(speedup_cell(row)))
        lines.append(f"| {kernel} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def map_pivot(rows: list[dict], mask: str) -> str | None:
    """rescale_threshold x beta table of fa4_h15 speed-ups at the focus seqlen."""
    cell = {
        r["kernel"]: r
        for r in rows
        if _is_main(r) and r["mask"] == mask and r["seqlen"] == FOCUS_SEQLEN and r["kernel"] in MAP_KERNELS
    }
    if not cell:
        return None
    lines = [
        "| threshold \\ beta | " + " | ".join(f"{b:g}" for b in H15_BETAS) + " |",
        "| --- |" + " --- |" * len(H15_BETAS),
    ]
    for t in H15_THRESHOLDS:
        cells = [
            _md_escape(speedup_cell(cell[h15_map_name(t, b)])) if h15_map_name(t, b) in cell else "" for b in H15_BETAS
        ]
        lines.append(f"| {t:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fp8_cell(row: dict) -> str:
    """'905 TF, 1.02x FA3-FP8, 1.41x FA4 BF16' for a timed FP8 row, else its status."""
    if row["status"] != "ok":
        return speedup_cell(row)
    ratios = [
        f"{row[f'speedup_vs_{peer}']:.2f}x {peer}" for peer in RATIO_PEERS if row.get(f"speedup_vs_{peer}") is not None
    ]
    return ", ".join([f"{row['tflops']:.0f} TF"] + ratios)


def fp8_pivot(rows: list[dict], mask: str, head_dim: int, heads_kv: int) -> str | None:
    """Kernels x seqlens of the FP8 rows of one (mask, head dim, heads_kv): TFLOPS and the ratios to the
    RATIO_PEERS (FA3-FP8, FA4 stock BF16) from the same interleaved rounds."""
    chosen = [
        r
        for r in rows
        if r["dtype"] == "fp8"
        and r["mask"] == mask
        and r["head_dim"] == head_dim
        and r["heads_kv"] == heads_kv
        and r["heads_q"] == HEADS_Q
    ]
    if not chosen:
        return None
    seqlens = sorted({r["seqlen"] for r in chosen})
    kernels = list(dict.fromkeys(r["kernel"] for r in chosen))
    cell = {(r["kernel"], r["seqlen"]): r for r in chosen}
    lines = ["| kernel | " + " | ".join(format_seqlen(s) for s in seqlens) + " |", "| --- |" + " --- |" * len(seqlens)]
    for kernel in kernels:
        cells = [_md_escape(fp8_cell(cell[(kernel, s)])) if (kernel, s) in cell else "" for s in seqlens]
        lines.append(f"| {kernel} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows_table(rows: list[dict]) -> str:
    lines = [
        "| kernel | mask | dtype | seqlen | d | heads q/kv | batch | median ms | TFLOPS | speed-up vs FA4 stock "
        "[IQR] | gate rel. err (tol) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        check = r["check"] or {}
        gate = f"{check['rel_err']:.2g} ({check['tolerance']:g})" if check.get("rel_err") is not None else ""
        speed = speedup_cell(r) if r["status"] == "ok" else ""
        note = r["status"].replace("_", " ") + (f": {r['reason']}" if r["reason"] else "")
        lines.append(
            f"| {r['kernel']} | {r['mask']} | {r['dtype']} | {format_seqlen(r['seqlen'])} | {r['head_dim']} "
            f"| {r['heads_q']}/{r['heads_kv']} | {r['batch']} | {_fmt(r['median_ms'], 4)} | "
            f"{_fmt(r['tflops'], 4)} | {speed} | {gate} | {_md_escape(note if r['status'] != 'ok' else '')} |"
        )
    return "\n".join(lines)


def environment_lines(env: dict) -> list[str]:
    gpu = env.get("gpu")
    smi = env.get("nvidia_smi")
    packages = env.get("packages", {})
    lines = []
    if isinstance(gpu, dict):
        l2 = gpu.get("l2_cache_bytes")
        lines.append(
            f"- GPU: {gpu['name']} (sm_{gpu['capability'].replace('.', '')}, {gpu['sm_count']} SMs, "
            f"L2 {l2 / 2**20:.0f} MiB)"
            if l2
            else f"- GPU: {gpu['name']}"
        )
    else:
        lines.append(f"- GPU: {gpu}")
    if isinstance(smi, dict):
        after = env.get("nvidia_smi_after")
        after_text = (
            f"; after the run: SM {after.get('clocks.sm')}, {after.get('temperature.gpu')} C, {after.get('power.draw')}"
            if isinstance(after, dict)
            else ""
        )
        lines.append(
            f"- clocks at start: SM {smi.get('clocks.sm')} (max {smi.get('clocks.max.sm')}), memory "
            f"{smi.get('clocks.mem')}, {smi.get('temperature.gpu')} C, power limit {smi.get('power.limit')}"
            f"{after_text}; driver {smi.get('driver_version')}"
        )
    else:
        lines.append(f"- nvidia-smi: {smi}")
    lines.append(
        f"- CUDA {env.get('cuda_runtime')}, cuDNN {env.get('cudnn')}, "
        + ", ".join(f"{k} {v}" for k, v in packages.items() if v)
        + f"; commit {env.get('git_commit') or 'unknown'}"
        + (f" (code sha256 {env['code_digest'][:16]})" if env.get("code_digest") else "")
        + f"; {env.get('date_utc')}"
    )
    for session in env.get("resumed", []):
        smi = session.get("nvidia_smi")
        clocks = f", SM {smi.get('clocks.sm')} at start" if isinstance(smi, dict) else ""
        lines.append(
            f"- resumed {session.get('date_utc')} on {session.get('host')} (commit "
            f"{session.get('git_commit') or 'unknown'}"
            + (f", code sha256 {session['code_digest'][:16]}" if session.get("code_digest") else "")
            + f"{clocks}): kept {session.get('groups_kept')} "
            f"finished groups, measured the rest"
        )
    settings = env.get("settings", {})
    if settings:
        lines.append("- settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    return lines


def tolerance_line(kernel_names) -> str:
    """The gate tolerances of the kernels in `kernel_names` (the map's points as one entry), kernels with
    equal tolerances listed together."""
    present = set(kernel_names)
    by_tolerance: dict[tuple, list[str]] = {}
    for spec in KERNELS.values():
        if spec.name in present and spec.name not in MAP_KERNELS and spec.checked:
            by_tolerance.setdefault(tuple(spec.tolerances.items()), []).append(spec.name)
    mapped = [KERNELS[name] for name in MAP_KERNELS if name in present]
    if mapped:
        by_tolerance.setdefault(tuple(mapped[0].tolerances.items()), []).append("fa4_h15_t*_b*")
    parts = [
        ", ".join(names) + ": " + ", ".join(f"{dtype} {tol:g}" for dtype, tol in tolerances)
        for tolerances, names in by_tolerance.items()
    ]
    return "gate tolerances (bench/kernels.py, Note [Gate tolerances]): " + "; ".join(parts)


def markdown_report(doc: dict) -> str:
    env, rows = doc["env"], doc["rows"]
    gpu = env.get("gpu")
    title = gpu["name"] if isinstance(gpu, dict) else "unknown GPU"
    parts = [
        f"# Attention forward benchmark: {title}",
        "",
        *environment_lines(env),
        f"- {FLOPS_FORMULA}",
        f"- {SPEEDUP_DEFINITION}",
        f"- {GATE_DEFINITION}",
        f"- {tolerance_line(r['kernel'] for r in rows)}",
        f"- batch * seqlen = {TOKENS} tokens, {HEADS_Q} query heads unless stated",
        "",
    ]
    for mask in ("causal", "non-causal"):
        table = seqlen_pivot(rows, mask)
        if table:
            parts += [f"## Speed-up vs FA4 stock by seqlen: {mask}, bf16, head dim 128, MHA", "", table, ""]
    for mask in ("causal", "non-causal"):
        table = map_pivot(rows, mask)
        if table:
            parts += [
                f"## fa4_h15: rescale_threshold x beta at {format_seqlen(FOCUS_SEQLEN)}, {mask}, bf16, "
                "head dim 128 (speed-up vs FA4 stock)",
                "",
                table,
                "",
            ]
    fp8_shapes = sorted({(r["head_dim"], r["heads_kv"]) for r in rows if r["dtype"] == "fp8"}, reverse=True)
    for head_dim, heads_kv in fp8_shapes:
        for mask in ("causal", "non-causal"):
            table = fp8_pivot(rows, mask, head_dim, heads_kv)
            if table:
                parts += [
                    f"## FP8: {mask}, head dim {head_dim}, heads {HEADS_Q}/{heads_kv} (TFLOPS; ratios from "
                    "the same rounds; gemm_fp8 is the e4m3 GEMM ceiling, fa4_fp8_exact_noexp a cost probe)",
                    "",
                    table,
                    "",
                ]
    parts += ["## All rows", "", rows_table(rows), ""]
    return "\n".join(parts)


def write_plots(doc: dict, out_dir: str, stem: str) -> list[str] | str:
    """PNG files (Agg backend) written, or a sentence saying why there are none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"plots skipped: matplotlib not importable ({exc}); regenerate with python -m bench.report"
    rows = doc["rows"]
    written = []
    masks = [
        m for m in ("causal", "non-causal") if any(_is_main(r) and r["mask"] == m and r["status"] == "ok" for r in rows)
    ]
    if masks:
        # Top row: the band around FA4 stock, linear (the FA4 variants and peers differ by a few percent);
        # bottom row: every kernel on a log scale (aiter_fused on Hopper sits at a few percent of FA4).
        # Colours from tab20 so that no two kernels share one; line style by family.
        fig, axes = plt.subplots(2, len(masks), figsize=(6.5 * len(masks) + 2.5, 8.5), squeeze=False)
        kernels = list(dict.fromkeys(r["kernel"] for r in rows if r["kernel"] not in MAP_KERNELS))
        colours = plt.get_cmap("tab20").colors
        styles = {"fa4": "-", "aiter_fused": "--", "sdpa": ":"}
        for column, mask in enumerate(masks):
            ok = [
                r
                for r in rows
                if _is_main(r)
                and r["mask"] == mask
                and r["status"] == "ok"
                and r["kernel"] not in MAP_KERNELS
                and r["speedup_vs_fa4_stock"] is not None
            ]
            for kernel in dict.fromkeys(r["kernel"] for r in ok):
                series = sorted((r for r in ok if r["kernel"] == kernel), key=lambda r: r["seqlen"])
                x = [r["seqlen"] for r in series]
                y = [r["speedup_vs_fa4_stock"] for r in series]
                err = [
                    [yi - r["speedup_spread"]["q1"] for yi, r in zip(y, series)],
                    [r["speedup_spread"]["q3"] - yi for yi, r in zip(y, series)],
                ]
                for ax in axes[:, column]:
                    ax.errorbar(
                        x,
                        y,
                        yerr=err,
                        marker="o",
                        ms=4,
                        capsize=3,
                        label=kernel,
                        color=colours[kernels.index(kernel) % len(colours)],
                        linestyle=styles.get(series[0]["family"], "-"),
                    )
            ticks = sorted({r["seqlen"] for r in ok})
            for row, ax in enumerate(axes[:, column]):
                ax.set_xscale("log", base=2)
                ax.set_xticks(ticks, [format_seqlen(t) for t in ticks])
                ax.minorticks_off()
                ax.axhline(1.0, color="grey", lw=0.8)
                ax.grid(alpha=0.3)
                ax.set_ylabel("speed-up vs FA4 stock" + (" (log)" if row else ""))
            top, bottom = axes[0, column], axes[1, column]
            top.set_ylim(0.8, 1.1)
            top.set_title(f"{mask}, bf16, head dim 128, {HEADS_Q} heads: near FA4 stock")
            bottom.set_yscale("log")
            bottom.set_title(f"{mask}: every kernel")
            bottom.set_xlabel("seqlen (batch * seqlen = %d)" % TOKENS)
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=8)
        fig.tight_layout(rect=(0, 0, 1 - 2.3 / (6.5 * len(masks) + 2.5), 1))
        path = os.path.join(out_dir, f"{stem}_speedup_vs_seqlen.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    for mask in ("causal", "non-causal"):
        cell = {
            r["kernel"]: r
            for r in rows
            if _is_main(r)
            and r["mask"] == mask
            and r["seqlen"] == FOCUS_SEQLEN
            and r["kernel"] in MAP_KERNELS
            and r["status"] == "ok"
            and r["speedup_vs_fa4_stock"] is not None
        }
        if not cell:
            continue
        grid = [
            [
                cell[h15_map_name(t, b)]["speedup_vs_fa4_stock"] if h15_map_name(t, b) in cell else math.nan
                for b in H15_BETAS
            ]
            for t in H15_THRESHOLDS
        ]
        from matplotlib.colors import TwoSlopeNorm

        values = [v for line in grid for v in line if math.isfinite(v)]
        norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(values), 0.99), vmax=max(max(values), 1.01))
        fig, ax = plt.subplots(figsize=(7, 4))
        image = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")  # red: slower than stock, green: faster
        ax.set_xticks(range(len(H15_BETAS)), [f"{b:g}" for b in H15_BETAS])
        ax.set_yticks(range(len(H15_THRESHOLDS)), [f"{t:g}" for t in H15_THRESHOLDS])
        ax.set_xlabel("beta (exp2-emulation share)")
        ax.set_ylabel("rescale_threshold (log2)")
        ax.set_title(f"fa4_h15 speed-up vs FA4 stock, {format_seqlen(FOCUS_SEQLEN)} {mask} bf16 d128")
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                if math.isfinite(value):
                    ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=8)
        fig.colorbar(image, ax=ax)
        path = os.path.join(out_dir, f"{stem}_h15_map_{format_seqlen(FOCUS_SEQLEN)}_{mask}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


# The README's FP8 speed table (`fp8_defaults_table`): its columns, (kernel, causal) of the peers run's rows, and the
# ratio to FA3-FP8 at or above which a cell of issue 22's goal is met (bold): H15 1.15x, the exact twin 1.0x.
FP8_DEFAULTS_COLUMNS = (
    ("rowmax_h15 non-causal", "fa4_fp8_func_h15", False),
    ("rowmax_h15 causal", "fa4_fp8_func_h15", True),
    ("exact non-causal", "fa4_fp8_func_exact", False),
    ("exact causal", "fa4_fp8_func_exact", True),
)
FP8_GOAL = {"fa4_fp8_func_h15": 1.15, "fa4_fp8_func_exact": 1.0}


def _span(values: list[float], digits: int = 2) -> str:
    """'1.12-1.13' over the runs' values ('1.12' where they agree at `digits`)."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def fp8_defaults_table(docs: list[dict]) -> str:
    """The README's FP8 speed table from one or more peers runs (`bash scripts/h200_session.sh peers OUT`): per head
    dim, KV heads and keys, FA3-FP8's TFLOPS, the ratio to FA3-FP8 of flash_attn_func's defaults (the range over the
    runs; bold where even the lowest meets FP8_GOAL), the exp2-deleted probe's and vLLM's FA3's, non-causal / causal."""
    cells: dict[tuple, list[dict]] = {}
    for doc in docs:
        for row in doc["rows"]:
            if row["status"] == "ok" and row["dtype"] == "fp8" and row["heads_q"] == HEADS_Q:
                key = (row["kernel"], row["head_dim"], row["heads_kv"], row["causal"], row["seqlen"])
                cells.setdefault(key, []).append(row)

    def ratio(kernel, shape, causal, bold_at=None):
        rows = cells.get((kernel, *shape[:2], causal, shape[2]), [])
        values = [r["speedup_vs_fa3_fp8"] for r in rows if r.get("speedup_vs_fa3_fp8") is not None]
        if not values:
            return "-"
        text = f"{_span(values)}x"
        return f"**{text}**" if bold_at is not None and min(values) >= bold_at else text

    shapes = sorted({(k[1], k[2], k[4]) for k in cells if k[0] == "fa3_fp8"}, key=lambda s: (-s[0], -s[1], s[2]))
    header = ["head dim", "KV heads", "keys", "FA3-FP8 non-causal"] + [c[0] for c in FP8_DEFAULTS_COLUMNS]
    header += ["probe non-causal / causal", "vLLM's FA3 non-causal / causal"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for shape in shapes:
        fa3 = cells.get(("fa3_fp8", shape[0], shape[1], False, shape[2]), [])
        row = [str(shape[0]), str(shape[1]), format_seqlen(shape[2]), f"{_span([r['tflops'] for r in fa3], 0)} TF"]
        row += [ratio(kernel, shape, causal, FP8_GOAL[kernel]) for _, kernel, causal in FP8_DEFAULTS_COLUMNS]
        for kernel in ("fa4_fp8_exact_noexp_defaults", "vllm_fa3_fp8"):
            row.append(f"{ratio(kernel, shape, False)} / {ratio(kernel, shape, True)}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_report(doc: dict, out_dir: str, stem: str, plots: bool = True) -> dict:
    """The Markdown file (and the plots): returns {'markdown': path, 'plots': list or reason}."""
    md_path = os.path.join(out_dir, f"{stem}.md")
    with open(md_path, "w") as f:
        f.write(markdown_report(doc))
    return {"markdown": md_path, "plots": write_plots(doc, out_dir, stem) if plots else "plots not requested"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="a JSON file written by python -m bench (several: --fp8-defaults)")
    parser.add_argument("--out", help="folder for the Markdown and plots (default: next to the JSON)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--fp8-defaults", action="store_true", help="print the README's FP8 speed table of the runs")
    args = parser.parse_args(argv)
    if args.fp8_defaults:
        print(fp8_defaults_table([read_json(path) for path in args.results]))
        return 0
    if len(args.results) != 1:
        parser.error("one results file, or several with --fp8-defaults")
    (results,) = args.results
    doc = read_json(results)
    out_dir = args.out or os.path.dirname(os.path.abspath(results))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(results))[0]
    written = write_report(doc, out_dir, stem, plots=not args.no_plots)
    print(f"wrote {written['markdown']}")
    print(written["plots"] if isinstance(written["plots"], str) else "\n".join(f"wrote {p}" for p in written["plots"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
