"""The study's baseline attention: transformers' `sdpa` in float32, in query chunks past 16K tokens.

Note [Baseline in query chunks]
With GQA (every Qwen2.5) transformers calls SDPA with `enable_gqa=True`, which in float32 only the math backend
takes: it materializes the (heads, queries, keys) scores and their softmax, 60 GB each for a 32K-token block of
Qwen2.5-0.5B (14 heads), more than an H200 holds beside the model's 20 GB of log-probabilities. Past
WHOLE_BLOCK_MAX_TOKENS this attention therefore runs SDPA on QUERY_CHUNK rows at a time, each chunk against the
keys up to its last row with the causal mask bottom-right aligned: the same exact float32 attention, row by row,
with the math backend's scores a chunk's size (about 8 GB per chunk at 32K). Blocks up to WHOLE_BLOCK_MAX_TOKENS
(2K, 16K) take transformers' call unchanged, so their baseline is the one every earlier table used.
"""

from __future__ import annotations

import torch

NAME = "sdpa_query_chunks"
WHOLE_BLOCK_MAX_TOKENS = 16384
QUERY_CHUNK = 8192


def sdpa_query_chunks(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' `sdpa_attention_forward` (query (B, Hq, L, D)), in query chunks past WHOLE_BLOCK_MAX_TOKENS
    (Note [Baseline in query chunks]); the chunked path takes causal attention without padding only."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if seqlen_q <= WHOLE_BLOCK_MAX_TOKENS:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None or not causal or seqlen_k != seqlen_q:
        raise ValueError(
            f"{NAME}: past {WHOLE_BLOCK_MAX_TOKENS} tokens only causal self-attention without a mask is chunked "
            f"(the study's blocks); got attention_mask {'set' if attention_mask is not None else 'None'}, "
            f"causal {causal}, {seqlen_q} queries and {seqlen_k} keys"
        )
    chunks = []
    for start in range(0, seqlen_q, QUERY_CHUNK):
        stop = min(seqlen_q, start + QUERY_CHUNK)
        allowed = torch.ones(stop - start, stop, dtype=torch.bool, device=query.device).tril(diagonal=start)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:stop],
            key[:, :, :stop],
            value[:, :, :stop],
            allowed[None, None],
            dropout=dropout,
            scaling=scaling,
            is_causal=False,
            **kwargs,
        )
        chunks.append(out)  # (B, rows, Hq, D)
    return torch.cat(chunks, dim=1), None


def register() -> str:
    """Register the baseline with transformers (its mask builder: sdpa's); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_query_chunks)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
