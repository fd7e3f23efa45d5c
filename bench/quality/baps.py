"""The BAPS restart study: how often BAPS restarts under each reading of the paper's restart rule.

`python -m bench.quality --baps-restart-study` scores nothing: one exact (sdpa) forward pass per block
records each layer's per-tile row maxima, from which restarts are counted per block or per row, with
B0 = the first tile or the first and the last tile a block sees, the approximate max by ceil or by rounding
(docs/quality_notes.md). `fa4_rowmax.reference` implements one of these readings (BAPS_REFERENCE_READING);
the test suite checks that the counts here reproduce its counters.
"""

from __future__ import annotations

import itertools
import math
import time

import torch

from bench.quality.workload import Workload

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
