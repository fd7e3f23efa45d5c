"""An FA4 softmax mode as a paged attention function for transformers' continuous batching (`model.generate_batch`,
`transformers serve`): prefill steps run the patched FA4's `flash_attn_varlen_func` with the chosen
`softmax_mode`, decode steps run stock FA4 (`softmax_mode="exact"`).

```python
from fa4_rowmax import hf_paged
attention = hf_paged.register(mode="rowmax_h15", rescale_threshold=0.0)   # attention.name: "paged|fa4_rowmax_h15_t0"
model.set_attn_implementation(attention.name)
outputs = model.generate_batch(prompts, generation_config, continuous_batching_config=ContinuousBatchingConfig(
    use_cuda_graph=False, max_blocks_per_request=0))                      # Notes [No CUDA graphs], [Paged KV ...]
```

Why our own function: transformers 5.17 maps `paged|flash_attention_4` to `flash_attn.cute`, but its paged path
(`integrations/flash_paged.py`) passes `cu_seq_lens_q` positionally into FA4 4.0.0b36's `qv` slot and decodes
through a `flash_attn_with_kvcache` that FA4 does not have; a name registered through
`transformers.AttentionInterface` as `paged|<name>` is called with the same arguments instead (the
`PagedAttentionCache`, `cu_seq_lens_q/k`, `max_seqlen_q/k`, `read_index`/`write_index`).

`fp8_prefill=True` runs prefill steps on e4m3 inputs (Note [FP8 prefill steps]); name suffix `_fp8`.

`backend="reference"` swaps the FA4 call for the semantic reference `attention_reference` (varlen, same mode,
fp32 arithmetic; fp64 for fp64 models), so the whole path runs on the CPU; `backend="kernel"` is FA4 and needs
CUDA and BF16/FP16.

Note [Paged KV as packed varlen]
transformers 5.17 calls a registered `paged|<name>` the way it calls `paged|sdpa`: every step through
`cache.update(read_index=..., write_index=...)`, which writes the new K/V into the cache and gives back each
sequence's whole K/V (cached prefix + new tokens) packed, with `cu_seq_lens_k` over it. That is FA4's varlen
layout as it stands, so a step is one `flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)`
(bottom-right causal per sequence, so a cached prefix longer than the new tokens, as chunked prefill and prefix
sharing give, is right). The cache `(pages, kv_heads, head_dim)` viewed as `(blocks, block_size, kv_heads,
head_dim)` is FA4's paged layout, but transformers fills a block table only on its decode fast path, which it
offers to FlashAttention 2/3 names alone (`max_blocks_per_request` becomes 0 for any other name); a
`block_table` would come with one query per sequence, where FA4 would need a dense `(batch, 1, heads, dim)`
q and `page_table` + `seqused_k` (FA4 refuses `page_table` with `cu_seqlens_k`). So a `block_table` is refused
by name (set `ContinuousBatchingConfig(max_blocks_per_request=0)`), and the read-back gather is paid in every
step: one read of the batch's KV per layer, which FA4's paged read would avoid.

Note [Prefill and decode steps]
A step is a prefill step when any sequence in it has more than one query (`max_seqlen_q > 1`); it runs in the
registered mode for every sequence of the step, including a decoding sequence that transformers scheduled into
the same step (continuous batching mixes them; splitting a step in two calls would cost a host sync per layer).
A step with one query per sequence is a decode step and runs stock FA4 (`softmax_mode="exact"`, no knobs: the
same bits as unpatched FA4; passed explicitly, so a process-wide mode (FA4_ROWMAX_SOFTMAX_MODE) cannot reach it):
one query row per sequence is memory-bound, and a cheaper exponential gains nothing there. `steps` counts both
kinds (at layer 0) so a run can report how its tokens were produced.

Note [FP8 prefill steps]
With `fp8_prefill=True` a prefill step casts q, K and V to e4m3 (scale 1, saturating: `hf.to_e4m3`, the quality
study's cast) after K smoothing (Note [K smoothing for FP8] in hf.py), and calls the same
`flash_attn_varlen_func`, which on an H200 routes e4m3 inputs to the SM90 FP8 forward (varlen, two-level P.V,
the tuned defaults: no extra argument) and returns BF16. In a packed step K's mean is taken over every packed key
of a KV head, across sequences: the scores of a row then all move by the same q . mean, which leaves its softmax
unchanged whatever sequence the row is in, so one mean serves the whole step. Decode steps stay stock BF16 FA4 on
the BF16 cache (Note [Prefill and decode steps]); the cache itself stays BF16.

Note [No CUDA graphs]
The reference syncs with the host (its per-sequence lengths), and FA4 under a captured graph is untested here, so
the function refuses a capturing stream by name. Pass `ContinuousBatchingConfig(use_cuda_graph=False)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from fa4_rowmax.config import FP8_MAX_OFFSET, KERNEL_MODES, SoftmaxConfig, check_real

BACKENDS = ("kernel", "reference")
NAME_PREFIX = "paged|fa4_"
# Decode steps, and every step of mode "exact" without a threshold: stock FA4, named explicitly (Note [Prefill and
# decode steps]).
STOCK_KNOBS = {"softmax_mode": "exact"}


def attention_name(
    mode: str, rescale_threshold: float | None = None, backend: str = "kernel", fp8_prefill: bool = False
) -> str:
    """`paged|fa4_<mode>[_t<threshold>][_fp8][_reference]`: the `paged|` prefix makes transformers' continuous
    batching use it as is; no `flash` in the name, or transformers would take it for its own flash path."""
    threshold = "" if rescale_threshold is None else f"_t{rescale_threshold:g}"
    fp8 = "_fp8" if fp8_prefill else ""
    return f"{NAME_PREFIX}{mode}{threshold}{fp8}{'' if backend == 'kernel' else '_' + backend}"


def fp8_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Packed q, k, v (tokens, heads, dim) in e4m3, K smoothed over the step's packed keys first (Note [FP8 prefill
    steps])."""
    from fa4_rowmax.hf import smooth_k, to_e4m3

    return tuple(to_e4m3(x)[0] for x in (q, smooth_k(k[None])[0], v))


@dataclass
class StepCounts:
    """Steps seen at layer 0, by kind (Note [Prefill and decode steps])."""

    prefill: int = 0
    decode: int = 0


def fa4_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, knobs: dict) -> torch.Tensor:
    """The patched FA4 varlen forward, causal; `knobs` are its softmax arguments (`STOCK_KNOBS`: stock FA4)."""
    from flash_attn.cute import flash_attn_varlen_func

    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        raise ValueError(f"backend='kernel' needs CUDA BF16/FP16/e4m3 tensors, got query {q.dtype} on {q.device}")
    result = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        **knobs,
    )
    return result[0] if isinstance(result, tuple) else result


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, knobs: dict):
    """`attention_reference` in FA4's varlen layout with the same knobs: fp32 arithmetic (fp64, P in fp64, for fp64
    inputs). Query and key rows past the last sequence (transformers' padding) give 0."""
    from fa4_rowmax.reference.attention import attention_reference

    exact64, fp8 = q.dtype == torch.float64, q.dtype == torch.float8_e4m3fn
    # e4m3 inputs: P in e4m3 with FA4's FP8 offset, as the FP8 kernel (the quality study's FP8 config, hf._fp8_mode).
    p_fields = {"max_offset": FP8_MAX_OFFSET, "p_dtype": torch.float8_e4m3fn} if fp8 else {}
    if exact64:
        p_fields = {"p_dtype": torch.float64}
    config = SoftmaxConfig(
        mode=knobs["softmax_mode"], rescale_threshold=knobs.get("rescale_threshold", 0.0), **p_fields
    )
    total_q, total_k = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
    out = torch.zeros(q.shape, dtype=torch.bfloat16 if fp8 else q.dtype, device=q.device)
    out[:total_q] = attention_reference(
        q[:total_q],
        k[:total_k],
        v[:total_k],
        config,
        causal=True,
        softmax_scale=scale,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        compute_dtype=torch.float64 if exact64 else torch.float32,
    )[0]
    return out


ATTEND = {"kernel": fa4_varlen, "reference": reference_varlen}


@dataclass
class PagedAttention:
    """The function transformers calls as `paged|...` (module docstring); `attend` is the varlen call (FA4 or the
    reference: `ATTEND`), swappable."""

    name: str
    mode: str
    knobs: dict  # FA4 softmax arguments of prefill steps
    attend: Callable
    fp8_prefill: bool = False  # Note [FP8 prefill steps]
    steps: StepCounts = field(default_factory=StepCounts)

    def __call__(
        self,
        module,
        query,
        key,
        value,
        attention_mask,
        dropout: float = 0.0,
        scaling: float | None = None,
        cache=None,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        block_table=None,
        **kwargs,
    ):
        if cache is None:
            raise ValueError(
                f"{self.name} was called without a PagedAttentionCache (cache=None): it is a paged attention "
                "function for continuous batching (model.generate_batch); use another implementation for a "
                "standard forward"
            )
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{self.name} cannot be captured in a CUDA graph (Note [No CUDA graphs] in fa4_rowmax/hf_paged.py): "
                "pass ContinuousBatchingConfig(use_cuda_graph=False)"
            )
        if dropout:
            raise ValueError(f"dropout must be 0 ({self.name} is inference-only), got {dropout}")
        for unsupported in ("sliding_window", "s_aux"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(
                    f"{unsupported} must be None for {self.name} (not supported), got {kwargs[unsupported]!r}"
                )
        if block_table is not None:
            raise ValueError(
                f"block_table must be None for {self.name} (transformers' decode fast path; Note [Paged KV as packed "
                "varlen] in fa4_rowmax/hf_paged.py): pass ContinuousBatchingConfig(max_blocks_per_request=0)"
            )
        if isinstance(cu_seq_lens_k, dict):
            cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k["full_attention"], max_seqlen_k["full_attention"]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
        # transformers: query (1, heads, tokens, dim), key/value (1, kv_heads, tokens, dim); FA4: (tokens, heads, dim).
        q = query[0].transpose(0, 1).contiguous()
        k, v = cache.update(
            key_states=key,
            value_states=value,
            layer_idx=module.layer_idx,
            read_index=kwargs["read_index"],
            write_index=kwargs["write_index"],
        )
        prefill = max_seqlen_q > 1
        if module.layer_idx == 0:
            if prefill:
                self.steps.prefill += 1
            else:
                self.steps.decode += 1
        knobs = self.knobs if prefill else STOCK_KNOBS
        k, v = k.contiguous(), v.contiguous()
        if prefill and self.fp8_prefill:
            q, k, v = fp8_operands(q, k, v)
        out = self.attend(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, scale, knobs)
        return out.to(query.dtype), None


def make_paged_attention(
    mode: str = "rowmax_h15",
    rescale_threshold: float | None = None,
    backend: str = "kernel",
    fp8_prefill: bool = False,
) -> PagedAttention:
    """The paged attention function for FA4 softmax `mode` (one of `KERNEL_MODES`) in prefill steps, on e4m3 inputs
    with `fp8_prefill` (Note [FP8 prefill steps]); `exact` with no threshold and no FP8 is stock FA4 throughout."""
    if not isinstance(fp8_prefill, bool):
        raise ValueError(f"fp8_prefill must be True or False, got {fp8_prefill!r}")
    if mode not in KERNEL_MODES:
        raise ValueError(f"mode must be one of {KERNEL_MODES}, got {mode!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    knobs = {"softmax_mode": mode}
    if rescale_threshold is not None:
        knobs["rescale_threshold"] = check_real("rescale_threshold", rescale_threshold, 0.0)
    if backend == "kernel" and not torch.cuda.is_available():
        raise RuntimeError(f"backend='kernel' needs CUDA (mode {mode!r}); use backend='reference' on the CPU")
    name = attention_name(mode, rescale_threshold, backend, fp8_prefill)
    return PagedAttention(name=name, mode=mode, knobs=knobs, attend=ATTEND[backend], fp8_prefill=fp8_prefill)


def register(
    mode: str = "rowmax_h15",
    rescale_threshold: float | None = None,
    backend: str = "kernel",
    fp8_prefill: bool = False,
) -> PagedAttention:
    """Register `make_paged_attention(...)` with `transformers.AttentionInterface` under its `name`; returns it
    (`model.set_attn_implementation(attention.name)`, then `model.generate_batch(...)`)."""
    from transformers import AttentionInterface

    attention = make_paged_attention(mode, rescale_threshold, backend, fp8_prefill)
    AttentionInterface.register(attention.name, attention)
    return attention
