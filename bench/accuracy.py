"""FP8 accuracy over key count: O's error against fp64 attention of the same e4m3 inputs, kernel by kernel.

`python -m bench --fp8-accuracy` runs the study alone, `python -m bench --fp8 --with-accuracy` runs it and then
the FP8 speed table in one process (one GPU session, one commit); `python -m bench.accuracy RESULTS.json`
rewrites the Markdown table and the plot from a results file.

Note [Long-row accuracy]
~~~~~~~~~~~~~~~~~~~~~~~~
Hopper's FP8 wgmma keeps about 13 fraction bits in its accumulator and truncates; a kernel that feeds the running
O back as the C operand on every KV tile loses more of each tile's P.V the larger O is, so its error grows with
the key count where the attention is diffuse and V has a nonzero mean (../shared/notes/fp8_sm90.md, "Long rows").
The study isolates that error: 256 queries, 4 heads, head dim 128, q and k ~ QK_STD N(0, 1) (scores of std
~0.35^2 sqrt(128) / sqrt(128) = 0.12: diffuse), V ~ N(mean, 1) for mean in V_MEANS, all rounded to e4m3 once;
the reference is attention in fp64 of exactly those e4m3 values (dequantized exactly), so input quantization is
not counted and what remains is the kernel's own arithmetic: P's rounding (e4m3 for the FP8 kernels), O's
rounding (BF16, e4m3 for cuDNN), and the accumulator. FA4 stock BF16 runs on the same values upcast (exact).
The error is the relative Frobenius norm ||O - O_ref||_F / ||O_ref||_F over all queries and heads. Causal is
bottom-right (query i sees keys j <= i + keys - 256), which cuDNN's sdpa_fp8 cannot do (top-left only): those
cells are "-" with the reason. The inputs of one key count share q, k and V's noise across the V means, so the
means differ by the mean alone.

Note [fp64 reference in key chunks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
At 128K keys one head's score matrix is 256 x 131072 fp64 values (256 MiB); `reference_fp64` never holds more
than `chunk_keys` keys of it: a first pass over the chunks finds each row's max, a second sums exp(s - max) and
accumulates exp(s - max) V, both in fp64, so the result does not depend on the chunking beyond fp64 rounding
(~1e-16 relative, 13 orders below the errors measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Callable, Sequence

import torch

from bench.check import relative_frobenius_error
from bench.kernels import KERNELS
from bench.report import REASON_CHARS, environment_lines, failure_reason, read_json, write_json
from bench.sweep import format_seqlen, select_kernels

ACCURACY_KEYS = tuple(1024 * 2**i for i in range(8))  # 1K .. 128K
V_MEANS = (0.0, 0.25, 1.0)
QUERIES = 256
HEADS = 4
HEAD_DIM = 128
QK_STD = 0.35
MASKS = (False, True)  # non-causal, causal (bottom-right)
REFERENCE_CHUNK_KEYS = 16384
# FA3-FP8, cuDNN-FP8, vLLM's two-level FA3, ours through flash_attn_func (its defaults) and with each P.V
# accumulation in both softmax modes, FA4 stock BF16.
ACCURACY_KERNELS = (
    "fa3_fp8",
    "cudnn_fp8",
    "vllm_fa3_fp8",
    "fa4_fp8_func_exact",
    "fa4_fp8_func_h15",
    "fa4_fp8_exact_single",
    "fa4_fp8_h15_single",
    "fa4_fp8_exact_two_level",
    "fa4_fp8_h15_two_level",
    "fa4_stock_bf16",
)
STATUSES = ("ok", "n/a", "unsupported", "unavailable", "error", "skipped")
CUDNN_BOTTOM_RIGHT = (
    "cuDNN's sdpa_fp8 has top-left causal masks only (bottom-right is not supported), and with 256 queries < "
    "keys the two differ"
)
ERROR_DEFINITION = (
    "error = ||O - O_ref||_F / ||O_ref||_F over all queries and heads, O_ref = fp64 attention of the same e4m3 "
    "values (dequantized exactly); Note [Long-row accuracy] in bench/accuracy.py"
)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One measurement: a kernel at one V mean, mask and key count; `reason` set: not measurable ("-")."""

    kernel: str
    v_mean: float
    causal: bool
    keys: int
    reason: str | None = None

    @property
    def mask(self) -> str:
        return "causal" if self.causal else "non-causal"


def not_applicable_reason(kernel: str, causal: bool, queries: int, keys: int) -> str | None:
    """Why `kernel` cannot compute this cell's attention, or None."""
    if kernel == "cudnn_fp8" and causal and queries != keys:
        return CUDNN_BOTTOM_RIGHT
    return None


def build_accuracy_plan(
    kernel_patterns: Sequence[str] | None = None,
    keys: Sequence[int] | None = None,
    v_means: Sequence[float] = V_MEANS,
    queries: int = QUERIES,
) -> list[Cell]:
    """Every (key count, V mean, mask, kernel) cell, by key count first (one input set per key count)."""
    kernels = ACCURACY_KERNELS if not kernel_patterns else tuple(select_kernels(kernel_patterns, list(KERNELS)))
    for name in kernels:
        spec = KERNELS[name]
        if "fp8" not in spec.tolerances or not spec.checked:
            raise ValueError(
                f"--accuracy-kernels: {name} is not an attention kernel on FP8 inputs (it takes "
                f"{'/'.join(spec.tolerances)}{'' if spec.checked else ', a cost probe'}); accepted: FP8 kernels "
                f"such as {', '.join(ACCURACY_KERNELS)}"
            )
    keys = list(ACCURACY_KEYS if keys is None else keys)
    if not keys or any(not isinstance(n, int) or n < 1 for n in keys):
        raise ValueError(f"--accuracy-keys must be positive ints, got {keys!r}")
    if any(n < queries for n in keys):
        raise ValueError(f"--accuracy-keys must be >= the {queries} queries (bottom-right causal), got {keys!r}")
    return [
        Cell(name, float(mean), causal, n, not_applicable_reason(name, causal, queries, n))
        for n in dict.fromkeys(keys)
        for mean in v_means
        for causal in MASKS
        for name in kernels
    ]


def make_accuracy_inputs(
    keys: int,
    v_means: Sequence[float],
    device: torch.device | str,
    seed: int,
    queries: int = QUERIES,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
) -> dict[float, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per V mean, e4m3 (q, k, v) in FlashAttention layout (batch 1): q, k ~ QK_STD N(0, 1), v ~ N(mean, 1);
    one draw of q, k and V's noise for all means (Note [Long-row accuracy])."""
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + keys)

    def draw(rows):
        return torch.randn(1, rows, heads, head_dim, device=device, dtype=torch.float32, generator=generator)

    q = (QK_STD * draw(queries)).to(torch.float8_e4m3fn)
    k = (QK_STD * draw(keys)).to(torch.float8_e4m3fn)
    noise = draw(keys)
    return {float(mean): (q, k, (noise + mean).to(torch.float8_e4m3fn)) for mean in v_means}


def reference_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float | None = None,
    chunk_keys: int = REFERENCE_CHUNK_KEYS,
) -> torch.Tensor:
    """Attention in fp64 of q (b, s_q, h_q, d), k/v (b, s_k, h_kv, d) of any dtype (upcast exactly), causal
    bottom-right, GQA (query head h reads kv head h // (h_q / h_kv)), over key chunks (Note [fp64 reference in
    key chunks]); a row that sees no key gives 0. Returns (b, s_q, h_q, d_v) float64."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D (batch, seqlen, heads, head_dim)")
    if chunk_keys < 1:
        raise ValueError(f"chunk_keys must be >= 1, got {chunk_keys}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    group = heads_q // heads_kv
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    # rows of one kv head: (query head within the group, query), query = row % seqlen_q
    qd = q.double().permute(0, 2, 1, 3).reshape(batch, heads_kv, group * seqlen_q, head_dim) * scale
    last_key = torch.arange(group * seqlen_q, device=q.device) % seqlen_q + (seqlen_k - seqlen_q)
    chunks = [(start, min(start + chunk_keys, seqlen_k)) for start in range(0, seqlen_k, chunk_keys)]

    def scores(start, stop):
        s = qd @ k[:, start:stop].double().permute(0, 2, 3, 1)
        if causal:
            allowed = torch.arange(start, stop, device=q.device)[None, :] <= last_key[:, None]
            s = s.masked_fill(~allowed, -math.inf)
        return s

    row_max = torch.full(qd.shape[:-1], -math.inf, dtype=torch.float64, device=q.device)
    for start, stop in chunks:
        row_max = torch.maximum(row_max, scores(start, stop).amax(dim=-1))
    anchor = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    row_sum = torch.zeros_like(row_max)
    acc = torch.zeros(*qd.shape[:-1], v.shape[-1], dtype=torch.float64, device=q.device)
    for start, stop in chunks:
        p = torch.exp(scores(start, stop) - anchor[..., None])
        row_sum += p.sum(dim=-1)
        acc += p @ v[:, start:stop].double().permute(0, 2, 1, 3)
    out = torch.where(row_sum[..., None] > 0, acc / row_sum.clamp_min(math.ulp(0.0))[..., None], 0.0)
    return out.reshape(batch, heads_q, seqlen_q, v.shape[-1]).permute(0, 2, 1, 3)


def new_accuracy_row(cell: Cell) -> dict:
    spec = KERNELS[cell.kernel]
    return {
        "kernel": cell.kernel,
        "family": spec.family,
        "mode": spec.mode,
        "knobs": dict(spec.knobs),
        "v_mean": cell.v_mean,
        "mask": cell.mask,
        "causal": cell.causal,
        "keys": cell.keys,
        "queries": QUERIES,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "status": "n/a" if cell.reason else "skipped",
        "reason": cell.reason or "",
        "rel_err": None,
        "max_abs_err": None,
        "first_call_s": None,
    }


def run_accuracy(
    cells: Sequence[Cell],
    *,
    seed: int = 0,
    deadline: float | None = None,
    log: Callable[[str], None] = print,
    on_rows: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Measure every cell on the current CUDA device; returns one row per cell (plan order). A kernel that is
    unsupported or unavailable here gets that status in each of its cells; past `deadline` (perf_counter
    seconds) the remaining cells are "skipped". `on_rows` sees the rows so far after each key count."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    capability = (props.major, props.minor)
    rows = {cell: new_accuracy_row(cell) for cell in cells}
    absent = {}
    for name in dict.fromkeys(cell.kernel for cell in cells):
        spec = KERNELS[name]
        reason = spec.unsupported_reason("fp8", capability)
        if reason is not None:
            absent[name] = ("unsupported", reason)
        elif (reason := spec.unavailable_reason()) is not None:
            absent[name] = ("unavailable", reason)
    for keys in dict.fromkeys(cell.keys for cell in cells):
        mine = [cell for cell in cells if cell.keys == keys]
        if deadline is not None and time.perf_counter() > deadline:
            for cell in mine:
                if not cell.reason:
                    rows[cell]["reason"] = "time budget (--max-minutes) spent"
            log(f"accuracy {format_seqlen(keys)} keys: skipped (budget)")
            continue
        inputs = make_accuracy_inputs(keys, sorted({c.v_mean for c in mine}), "cuda", seed)
        for v_mean, causal in dict.fromkeys((c.v_mean, c.causal) for c in mine):
            q, k, v = inputs[v_mean]
            ref = reference_fp64(q, k, v, causal)
            parts = []
            for cell in (c for c in mine if c.v_mean == v_mean and c.causal == causal):
                row = rows[cell]
                if cell.reason:
                    parts.append(f"{cell.kernel} -")
                    continue
                if cell.kernel in absent:
                    row["status"], reason = absent[cell.kernel]
                    row["reason"] = reason[:REASON_CHARS]
                    parts.append(f"{cell.kernel} {row['status']}")
                    continue
                spec = KERNELS[cell.kernel]
                try:
                    launch = spec.bind(q, k, v, causal)
                    start = time.perf_counter()
                    out = spec.output_for_check(launch())
                    torch.cuda.synchronize()
                    row["first_call_s"] = time.perf_counter() - start
                    bad = int((~torch.isfinite(out)).sum())
                    if bad:
                        raise FloatingPointError(f"{bad} non-finite output values")
                    row["rel_err"], row["max_abs_err"] = relative_frobenius_error(out, ref)
                    row["status"] = "ok"
                    parts.append(f"{cell.kernel} {100 * row['rel_err']:.3g} %")
                    del out
                except Exception as exc:  # the cell says what went wrong; the other kernels still run
                    row.update(status="error", reason=failure_reason(exc))
                    parts.append(f"{cell.kernel} error")
            mask = "causal" if causal else "non-causal"
            log(f"accuracy {format_seqlen(keys)} keys, V mean {v_mean:g}, {mask}: " + " | ".join(parts))
            del ref
        del inputs
        torch.cuda.empty_cache()
        if on_rows is not None:
            on_rows([rows[cell] for cell in cells])
    return [rows[cell] for cell in cells]


def _cell_text(row: dict) -> str:
    if row["status"] == "ok":
        return f"{100 * row['rel_err']:.3g} %"
    return "-" if row["status"] == "n/a" else row["status"]


def accuracy_table(rows: Sequence[dict]) -> str:
    """Markdown: one line per kernel x V mean x mask, one column per key count, cells the error in percent."""
    keys = sorted({r["keys"] for r in rows})
    cell = {(r["kernel"], r["v_mean"], r["mask"], r["keys"]): r for r in rows}
    lines = [
        "| kernel | V mean | mask | " + " | ".join(format_seqlen(n) for n in keys) + " |",
        "| --- | --- | --- |" + " --- |" * len(keys),
    ]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    masks = ("non-causal", "causal")
    lines_of = sorted(
        dict.fromkeys((r["kernel"], r["v_mean"], r["mask"]) for r in rows),
        key=lambda line: (kernels.index(line[0]), line[1], masks.index(line[2])),
    )
    for kernel, v_mean, mask in lines_of:
        cells = [_cell_text(cell[(kernel, v_mean, mask, n)]) if (kernel, v_mean, mask, n) in cell else "" for n in keys]
        lines.append(f"| {kernel} | {v_mean:g} | {mask} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def absent_lines(rows: Sequence[dict]) -> list[str]:
    """One line per (kernel, status, reason) of the cells without a value."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        if r["status"] != "ok":
            groups.setdefault((r["kernel"], _cell_text(r), r["reason"]), []).append(r)
    return [
        f"- {kernel}, {'/'.join(sorted({c['mask'] for c in cells}))}, {len(cells)} cells: {status}"
        + (f": {reason}" if reason else "")
        for (kernel, status, reason), cells in groups.items()
    ]


def accuracy_markdown(doc: dict) -> str:
    env, rows = doc["env"], doc["rows"]
    gpu = env.get("gpu")
    title = gpu["name"] if isinstance(gpu, dict) else "unknown GPU"
    settings = env.get("settings", {})
    parts = [
        f"# FP8 attention accuracy over key count: {title}",
        "",
        *environment_lines(env),
        f"- {ERROR_DEFINITION}",
        f"- {settings.get('queries', QUERIES)} queries, {settings.get('heads', HEADS)} heads, head dim "
        f"{settings.get('head_dim', HEAD_DIM)}, batch 1; q, k ~ {settings.get('qk_std', QK_STD)} N(0, 1), "
        "V ~ N(mean, 1), rounded to e4m3; causal is bottom-right",
        "",
        "## Relative error of O (percent)",
        "",
        accuracy_table(rows),
        "",
    ]
    missing = absent_lines(rows)
    if missing:
        parts += ["## Cells without a value", "", *missing, ""]
    return "\n".join(parts)


def write_accuracy_plot(rows: Sequence[dict], path: str) -> str:
    """log2(keys) vs error (log scale), one panel per V mean, one colour per kernel, solid non-causal and dashed
    causal. Returns the path, or a sentence saying why there is no plot."""
    ok = [r for r in rows if r["status"] == "ok" and r["rel_err"] is not None and r["rel_err"] > 0]
    if not ok:
        return "accuracy plot skipped: no measured cell"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"accuracy plot skipped: matplotlib not importable ({exc})"
    means = sorted({r["v_mean"] for r in rows})
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    colours = plt.get_cmap("tab10").colors
    keys = sorted({r["keys"] for r in rows})
    fig, axes = plt.subplots(1, len(means), figsize=(5.2 * len(means) + 2.8, 4.6), squeeze=False, sharey=True)
    for ax, mean in zip(axes[0], means):
        for kernel in kernels:
            for mask, style in (("non-causal", "-"), ("causal", "--")):
                series = sorted(
                    (r for r in ok if r["kernel"] == kernel and r["v_mean"] == mean and r["mask"] == mask),
                    key=lambda r: r["keys"],
                )
                if series:
                    ax.plot(
                        [math.log2(r["keys"]) for r in series],
                        [r["rel_err"] for r in series],
                        marker="o",
                        ms=3,
                        linestyle=style,
                        color=colours[kernels.index(kernel) % len(colours)],
                        label=f"{kernel} ({mask})",
                    )
        ax.set_yscale("log")
        ax.set_xticks([math.log2(n) for n in keys], [format_seqlen(n) for n in keys])
        ax.set_xlabel("keys (log2)")
        ax.set_title(f"V ~ N({mean:g}, 1)")
        ax.grid(alpha=0.3, which="both")
    axes[0, 0].set_ylabel("relative error of O vs fp64")
    handles, labels = {}, []
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    fig.legend([handles[label] for label in labels], labels, loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 1 - 2.8 / (5.2 * len(means) + 2.8), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_accuracy_report(doc: dict, out_dir: str, stem: str, plots: bool = True) -> dict:
    """The Markdown file and the plot: {'markdown': path, 'plot': path or the reason there is none}."""
    md_path = os.path.join(out_dir, f"{stem}.md")
    with open(md_path, "w") as f:
        f.write(accuracy_markdown(doc))
    plot = write_accuracy_plot(doc["rows"], os.path.join(out_dir, f"{stem}.png")) if plots else "plot not requested"
    return {"markdown": md_path, "plot": plot}


def accuracy_settings(cells: Sequence[Cell], seed: int) -> dict:
    return {
        "study": "fp8_accuracy",
        "kernels": list(dict.fromkeys(c.kernel for c in cells)),
        "keys": sorted({c.keys for c in cells}),
        "v_means": sorted({c.v_mean for c in cells}),
        "masks": ["non-causal", "causal (bottom-right)"],
        "queries": QUERIES,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "qk_std": QK_STD,
        "seed": seed,
        "reference": f"fp64, two passes over key chunks of {REFERENCE_CHUNK_KEYS}",
    }


def print_accuracy_plan(cells: Sequence[Cell]) -> None:
    measured = [c for c in cells if not c.reason]
    keys = sorted({c.keys for c in cells})
    kernels = list(dict.fromkeys(c.kernel for c in cells))
    print(
        f"accuracy: {len(kernels)} kernels x {len({c.v_mean for c in cells})} V means x 2 masks x {len(keys)} key "
        f"counts ({', '.join(format_seqlen(n) for n in keys)}), {QUERIES} queries, {HEADS} heads, head dim "
        f"{HEAD_DIM}: {len(cells)} cells, {len(measured)} measured (one call each), {len(cells) - len(measured)} '-'"
    )
    print("accuracy kernels: " + ", ".join(kernels))
    for reason in dict.fromkeys(c.reason for c in cells if c.reason):
        these = [c for c in cells if c.reason == reason]
        names = ", ".join(dict.fromkeys(c.kernel for c in these))
        print(f"accuracy '-' ({len(these)} cells: {names}, {'/'.join(sorted({c.mask for c in these}))}): {reason}")


def run_study(cells: Sequence[Cell], out_dir: str, stem: str, *, seed: int, deadline: float | None, plots: bool):
    """Run the study, writing the JSON after every key count and the Markdown and plot at the end."""
    from bench import env_info

    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{stem}.json")
    doc = {"schema": 1, "study": "fp8_accuracy", "env": env_info.collect(accuracy_settings(cells, seed)), "rows": []}
    started = time.perf_counter()

    def save(rows):
        doc["rows"] = rows
        doc["env"]["wall_s"] = time.perf_counter() - started
        write_json(json_path, doc)

    save(run_accuracy(cells, seed=seed, deadline=deadline, on_rows=save))
    written = write_accuracy_report(doc, out_dir, stem, plots=plots)
    print(f"wrote {json_path}\nwrote {written['markdown']}\n{written['plot']}")
    print(accuracy_table(doc["rows"]))
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a JSON file written by python -m bench --fp8-accuracy")
    parser.add_argument("--out", help="folder for the Markdown and the plot (default: next to the JSON)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    doc = read_json(args.results)
    if doc.get("study") != "fp8_accuracy":
        print(f"error: {args.results} is not an FP8 accuracy result (study {doc.get('study')!r})", file=sys.stderr)
        return 2
    out_dir = args.out or os.path.dirname(os.path.abspath(args.results))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(args.results))[0]
    written = write_accuracy_report(doc, out_dir, stem, plots=not args.no_plots)
    print(f"wrote {written['markdown']}\n{written['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
