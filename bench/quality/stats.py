"""Scoring one block with one attention, and the statistics the study reports over blocks.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

BOOTSTRAP_REPS = 5000
BOOTSTRAP_SEED = 0
KL_CHUNK_POSITIONS = 4096  # positions per step of mean_kl: one chunk for the 2K-token blocks


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

    Positions go KL_CHUNK_POSITIONS at a time: the three (positions, vocab) temporaries of a 32K-token block of
    Qwen2.5 (vocab 151,936) would be 60 GB at once; each position's KL is the same sum either way.
    """
    kl = torch.cat(
        [
            (p.exp() * (p - q)).sum(dim=-1)
            for p, q in zip(
                exact.log_probs.split(KL_CHUNK_POSITIONS), approx.log_probs.split(KL_CHUNK_POSITIONS), strict=True
            )
        ]
    )
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
