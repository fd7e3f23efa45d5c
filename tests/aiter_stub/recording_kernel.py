"""CPU stand-ins that record which attention implementation a call reached (tests only; see README.md).

- `RecordingKernel` replaces OUR kernel entries `aiter_fused.attention.fused_softmax_attention` /
  `fused_softmax_attention_varlen` (same signatures) with the project's semantic reference on the CPU
  (`fa4_rowmax.reference.fused_softmax`; exact attention in fp64 for `exact=True`), recording every call.
- `intercept_aiter_ops` overrides the CPU kernels of AITER's compiled attention ops
  (`torch.ops.aiter.mha_fwd`, ...) through `torch.library`, recording every call, so a test can see
  that a call fell through to AITER's original forward. They compute exact attention in fp64.
"""

import math
from typing import Optional

import torch

from fa4_rowmax.reference.fused_softmax import fused_softmax_attention_reference, fused_softmax_attention_reference_varlen

AITER_FORWARD_OPS = ("mha_fwd", "fmha_v3_fwd", "mha_varlen_fwd", "fmha_v3_varlen_fwd")


def attention_fp64(q, k, v, *, causal: bool, softmax_scale: Optional[float]):
    """Exact attention of one batch in fp64. q (seqlen_q, heads_q, d), k/v (seqlen_k, heads_k, d) ->
    out (seqlen_q, heads_q, d_v) and lse (heads_q, seqlen_q); causal is bottom-right aligned; a fully
    masked row gives out 0 and lse -inf."""
    seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k, _ = k.shape
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = heads_q // heads_k
    qd = q.double().transpose(0, 1)
    kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = scale * qd @ kd.transpose(-1, -2)
    if causal:
        rows = torch.arange(seqlen_q).unsqueeze(1)
        cols = torch.arange(seqlen_k).unsqueeze(0)
        scores = scores.masked_fill(cols > rows + seqlen_k - seqlen_q, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # fully masked rows: exp(-inf + inf)
    out = (probs @ vd).transpose(0, 1)
    return out, lse


def _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale):
    outs, lses = [], []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        out, lse = attention_fp64(q[q0:q1], k[k0:k1], v[k0:k1], causal=causal, softmax_scale=softmax_scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=-1)


def dense_fp64(q, k, v, *, causal, softmax_scale):
    """Batched dense layout: q (batch, seqlen_q, heads, d) -> out like q (fp64), lse (batch, heads, seqlen_q)."""
    results = [attention_fp64(*qkv, causal=causal, softmax_scale=softmax_scale) for qkv in zip(q, k, v)]
    return torch.stack([out for out, _ in results]), torch.stack([lse for _, lse in results])


class RecordingKernel:
    """Our kernel entries, recorded: `calls` holds one dict per call (entry name and its options)."""

    def __init__(self):
        self.calls = []

    @classmethod
    def patch_entries(cls, monkeypatch) -> "RecordingKernel":
        """A new recorder standing in for `aiter_fused.attention`'s two entries until `monkeypatch` undoes it."""
        from aiter_fused import attention

        recording = cls()
        monkeypatch.setattr(attention, "fused_softmax_attention", recording.fused_softmax_attention)
        monkeypatch.setattr(attention, "fused_softmax_attention_varlen", recording.fused_softmax_attention_varlen)
        return recording

    def fused_softmax_attention(
        self, q, k, v, *, causal=False, softmax_scale=None, mx_format="mxfp8", exact=False,
        recovery_threshold=8.0, return_lse=True,
    ):
        self.calls.append(dict(entry="dense", q=q, causal=causal, softmax_scale=softmax_scale,
                               mx_format=mx_format, exact=exact, return_lse=return_lse))
        if exact:
            out, lse = dense_fp64(q, k, v, causal=causal, softmax_scale=softmax_scale)
        else:
            out, lse = fused_softmax_attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                         mx_format=mx_format, recovery_threshold=recovery_threshold)
        return out.to(q.dtype), lse.float()

    def fused_softmax_attention_varlen(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
        softmax_scale=None, mx_format="mxfp8", exact=False, recovery_threshold=8.0, return_lse=True,
        validate=True,
    ):
        self.calls.append(dict(entry="varlen", validate=validate, q=q, causal=causal, softmax_scale=softmax_scale,
                               mx_format=mx_format, exact=exact, return_lse=return_lse,
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k))
        if exact:
            out, lse = _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        else:
            out, lse = fused_softmax_attention_reference_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale,
                mx_format=mx_format, recovery_threshold=recovery_threshold)
        return out.to(q.dtype), lse.float()


def intercept_aiter_ops(calls: list) -> torch.library.Library:
    """Override the CPU kernels of AITER's forward ops; each call appends the op name to `calls`.
    Keep the returned Library alive as long as AITER may be called: once it is gone, a call goes back to
    AITER's own CPU kernel, a JIT build that needs ROCm (and ends the process with SystemExit)."""
    library = torch.library.Library("aiter", "IMPL")
    for name in AITER_FORWARD_OPS:
        library.impl(name, _make_op_interceptor(name, calls), "CPU")
    return library


def _make_op_interceptor(name, calls):
    argument_names = [argument.name for argument in getattr(torch.ops.aiter, name).default._schema.arguments]

    def interceptor(*args, **kwargs):
        call = dict(zip(argument_names, args), **kwargs)
        calls.append(name)
        q, k, v = call["q"], call["k"], call["v"]
        if "cu_seqlens_q" in call and q.dim() == 3:
            out, lse = _per_sequence(q, k, v, call["cu_seqlens_q"], call["cu_seqlens_k"], call["is_causal"],
                                     call["softmax_scale"])
        else:
            out, lse = dense_fp64(q, k, v, causal=call["is_causal"], softmax_scale=call["softmax_scale"])
        out = out.to(q.dtype)
        if call.get("out") is not None:
            call["out"].copy_(out)
            out = call["out"]
        lse = lse.float() if call["return_softmax_lse"] else torch.empty((0,), dtype=torch.float32)
        return out, lse, torch.empty((0,)), torch.zeros((2,), dtype=torch.int64)

    return interceptor
