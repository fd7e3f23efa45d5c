"""Which part of a vLLM batch the `FA4_ROWMAX` backend (fa4_rowmax/vllm_backend.py) sends to the patched FA4, and
with which arguments: what the backend serves, the decode/prefill split, the per-layer check, the two calls'
metadata and the paged cache's K/V views. Torch and vLLM's torch utilities only (not its CUDA stack), so the
decisions run and are tested on a CPU machine with vLLM installed --no-deps.

Note [Which vLLM paths reach FA4]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In vLLM 0.33.0 `FlashAttentionImpl.forward` (vllm/v1/attention/backends/flash_attn.py) does not split a batch: the
plain decoder path makes one call of vLLM's bundled FlashAttention (`vllm.vllm_flash_attn`, FA2/FA3/FA4 by GPU)
with the whole batch packed by `query_start_loc` (cu_seqlens_q), `seq_lens` (seqused_k) and the paged cache's
`block_table`, the new tokens' K/V already written to the cache. Its `FlashAttentionMetadata` carries no
decode/prefill counts outside decode context parallelism. So this backend makes the split itself:
- its metadata builder sets `reorder_batch_threshold = 1`, so vLLM's model runner puts the requests with one query
  token (decodes) first, and records the split from the host-side `query_start_loc_cpu` (`split_batch`);
- `forward` runs the decodes through the stock `FlashAttentionImpl.forward` on a metadata cut to them
  (`decode_metadata`) and the rest, prefills (new sequences, chunked prefill, prefix-cache hits: any query of two
  or more tokens, speculative-decoding verification included), through the patched
  `flash_attn.cute.flash_attn_varlen_func` with `cu_seqlens_q` (rebased), `seqused_k`, `page_table` (the block
  table; FA4 refuses it beside `cu_seqlens_k`, and takes the page size from the cache's shape), `causal=True`
  (bottom-right per sequence) and the backend's softmax setting (`prefill_arguments`); FA4's page loads by TMA
  read a last page's rows past `seqused_k`, which must be finite: vLLM allocates its cache zeroed
  (`vllm/v1/worker/utils.py`) and writes only K/V into it;
- a batch of decodes only, a batch whose `causal` is not the plain `True` (per-request causal tensors) and a layer
  `layer_stock_reason` refuses (ALiBi, softcap, sliding window, sinks, FP8 KV cache, or a layout the softmax stage
  refuses on this GPU, logged once per layer at construction) run the stock implementation unchanged.
Decode stays on vLLM's kernels: one query row per sequence is memory-bound and gains nothing from a cheaper
exponential. What vLLM can refuse up front it refuses: the backend declares BF16/FP16, head sizes 64 and 128 (those
the stage's varlen and paged GPU tests run), SM90 and the SM100 family, decoder attention only, no sinks, no sliding
window, no FP8 KV cache, no multimodal prefix, no decode context parallelism, so `validate_configuration` rejects
`--attention-backend CUSTOM` for any other model. Full CUDA graphs are declared for single-token decode batches
only (the split is a host-side decision a replayed graph could not remake); every batch with a prefill runs
eagerly (piecewise graphs).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides

from fa4_rowmax.interface import softmax_stage

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_SIZES = (64, 128)
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")
SUPPORTED_CAPABILITY_MAJORS = (9, 10, 11)
# vLLM's query length at or below which a request is a decode (the builder's reorder_batch_threshold).
DECODE_QUERY_LEN = 1


@dataclass(frozen=True)
class BatchSplit:
    """A reordered batch: `num_decodes` requests of one query token first, then `num_prefills` requests."""

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


def split_batch(query_start_loc_cpu: torch.Tensor, num_reqs: int) -> BatchSplit:
    """The decode/prefill split of a batch vLLM reordered with threshold `DECODE_QUERY_LEN`, from its host-side
    `query_start_loc_cpu` (num_reqs + 1 offsets; entries past num_reqs are padding). Raises RuntimeError when a
    decode follows a prefill: the reorder this backend asks for did not happen."""
    offsets = query_start_loc_cpu[: num_reqs + 1]
    lengths = offsets[1:] - offsets[:-1]
    is_prefill = lengths > DECODE_QUERY_LEN
    num_decodes = int(is_prefill.int().argmax()) if bool(is_prefill.any()) else num_reqs
    if bool((lengths[num_decodes:] == DECODE_QUERY_LEN).any()):
        raise RuntimeError(
            f"FA4_ROWMAX needs decodes (query length {DECODE_QUERY_LEN}) before prefills in a batch (its metadata "
            f"builder's reorder_batch_threshold); got query lengths {lengths.tolist()}"
        )
    num_decode_tokens = int(offsets[num_decodes] - offsets[0])
    return BatchSplit(
        num_decodes=num_decodes,
        num_prefills=num_reqs - num_decodes,
        num_decode_tokens=num_decode_tokens,
        num_prefill_tokens=int(offsets[num_reqs] - offsets[0]) - num_decode_tokens,
    )


def prefill_features(device: torch.device | str = "cpu") -> dict:
    """The FA4 features the prefill call sets, as `SoftmaxStage.for_kernel` checks them (Note [Features allowed
    with a softmax stage], interface.py)."""
    offsets = torch.zeros(2, dtype=torch.int32, device=device)
    return {"cu_seqlens_q": offsets, "seqused_k": offsets[:1], "page_table": offsets[:1].view(1, 1)}


def layer_stock_reason(
    setting,
    *,
    arch: int,
    dtype: torch.dtype,
    alibi_slopes: Optional[torch.Tensor],
    logits_soft_cap: float,
    sliding_window: tuple[int, int],
    sinks: Optional[torch.Tensor],
    kv_cache_dtype: str,
) -> Optional[str]:
    """Why a layer's prefill stays on the stock implementation, or None when it goes to FA4. `setting` is a
    vllm_plugin.SoftmaxSetting; `sliding_window` is FlashAttentionImpl's (-1, -1) for none; `arch` e.g. 90."""
    features = {
        "ALiBi": alibi_slopes is not None,
        "softcap": bool(logits_soft_cap),
        "a sliding window": tuple(sliding_window) != (-1, -1),
        "attention sinks": sinks is not None,
        f"KV cache dtype {kv_cache_dtype!r}": kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES,
        f"dtype {dtype}": dtype not in SUPPORTED_DTYPES,
    }
    unserved = [name for name, present in features.items() if present]
    if unserved:
        return f"the layer has {', '.join(unserved)}, which FA4_ROWMAX does not serve"
    stage = softmax_stage(**setting.fa4_arguments())
    if stage is None:
        return None  # exact without knobs: stock FA4, every feature
    try:
        stage.for_kernel(arch=arch, q_dtype=dtype, features=prefill_features())
    except ValueError as error:
        return f"the softmax stage refuses vLLM's prefill layout on arch {arch} with {dtype}: {error}"
    return None


def decode_metadata(metadata, split: BatchSplit):
    """A shallow copy of FlashAttentionMetadata cut to the batch's leading decodes, for the stock forward. The
    FA3 ahead-of-time schedule describes the whole batch, so the cut drops it (FA3 then schedules the call
    itself); `max_seq_len` stays the batch's, an upper bound."""
    cut = copy.copy(metadata)
    cut.num_actual_tokens = split.num_decode_tokens
    cut.max_query_len = DECODE_QUERY_LEN
    cut.query_start_loc = metadata.query_start_loc[: split.num_decodes + 1]
    cut.seq_lens = metadata.seq_lens[: split.num_decodes]
    cut.block_table = metadata.block_table[: split.num_decodes]
    cut.slot_mapping = metadata.slot_mapping[: split.num_decode_tokens]
    cut.scheduler_metadata = None
    return cut


def prefill_arguments(metadata, split: BatchSplit) -> dict:
    """The packing arguments of `flash_attn.cute.flash_attn_varlen_func` for the batch's prefills: query offsets
    rebased to the first prefill token, per-sequence key counts and page rows (Note [Which vLLM paths reach FA4])."""
    first, end = split.num_decodes, split.num_decodes + split.num_prefills
    offsets = metadata.query_start_loc[first : end + 1]
    return dict(
        cu_seqlens_q=offsets - offsets[:1],
        max_seqlen_q=metadata.max_query_len,
        seqused_k=metadata.seq_lens[first:end],
        page_table=metadata.block_table[first:end],
    )


def paged_kv(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FLASH_ATTN cache (blocks, kv heads, block size, 2 * head size) as FA4's paged k and v (blocks, block
    size, kv heads, head size), views as the stock forward takes them, singleton strides made canonical (TMA
    needs 16-byte aligned strides, also on a dimension of size 1)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return canonicalize_singleton_dim_strides(key_cache), canonicalize_singleton_dim_strides(value_cache)
