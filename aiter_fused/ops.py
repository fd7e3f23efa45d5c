"""`torch.ops.aiter_fused.fwd` / `fwd_varlen`: the Fused-Softmax attention forward as torch custom ops.

Why custom ops: a model compiled with `torch.compile` (vLLM compiles its models) sees one opaque node
instead of tracing into the kernel's host code, and the fake implementations below give the output
shapes without running anything, so graphs can be traced on any machine (fake or meta tensors).

The real implementations look the kernel entry up in `aiter_fused.attention` at call time: importing
this module needs neither a GPU nor Triton.
"""

from typing import Optional

import torch

__all__ = ["fwd", "fwd_varlen"]


def _kernel_options(softmax_scale, mx_format, exact, recovery_threshold) -> dict:
    # recovery_threshold=None leaves the kernel's own default in force (one source of truth).
    options = dict(softmax_scale=softmax_scale, mx_format=mx_format, exact=exact, return_lse=True)
    if recovery_threshold is not None:
        options["recovery_threshold"] = recovery_threshold
    return options


def _contiguous_outputs(out: torch.Tensor, lse: torch.Tensor):
    # The fake implementations promise contiguous outputs (compiled graphs are planned on their strides);
    # free when the kernel already writes them contiguously.
    return out.contiguous(), lse.contiguous()


def _check_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.dim() != rank:
        raise ValueError(f"{name} must be a {rank}-D tensor {layout}, got shape {tuple(tensor.shape)}")


@torch.library.custom_op("aiter_fused::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    mx_format: str,
    exact: bool,
    recovery_threshold: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense forward: q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k, heads_k, head_dim)
    -> (out like q, lse float32 (batch, heads_q, seqlen_q))."""
    from aiter_fused import attention

    options = _kernel_options(softmax_scale, mx_format, exact, recovery_threshold)
    out, lse = attention.fused_softmax_attention(q, k, v, causal=causal, **options)
    return _contiguous_outputs(out, lse)


@fwd.register_fake
def _fwd_fake(q, k, v, causal, softmax_scale, mx_format, exact, recovery_threshold=None):
    layout = "(batch, seqlen, heads, head_dim)"
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, tensor, 4, layout)
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, v.shape[-1]))
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("aiter_fused::fwd_varlen", mutates_args=())
def fwd_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: Optional[float],
    mx_format: str,
    exact: bool,
    recovery_threshold: Optional[float] = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen forward: q (total_q, heads_q, head_dim), k/v (total_k, heads_k, head_dim), int32
    cu_seqlens -> (out like q, lse float32 (heads_q, total_q)). `validate=False` skips the checks that read
    cu_seqlens back to the host (one GPU sync each; they also break CUDA-graph capture)."""
    from aiter_fused import attention

    options = _kernel_options(softmax_scale, mx_format, exact, recovery_threshold)
    out, lse = attention.fused_softmax_attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
        validate=validate,
        **options,
    )
    return _contiguous_outputs(out, lse)


@fwd_varlen.register_fake
def _fwd_varlen_fake(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    mx_format,
    exact,
    recovery_threshold=None,
    validate=True,
):
    layout = "(total_tokens, heads, head_dim)"
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, tensor, 3, layout)
    for name, tensor in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_rank(name, tensor, 1, "(batch + 1,)")
    total_q, heads_q, _ = q.shape
    out = q.new_empty((total_q, heads_q, v.shape[-1]))
    lse = q.new_empty((heads_q, total_q), dtype=torch.float32)
    return out, lse
