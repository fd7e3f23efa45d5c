"""The Fused-Softmax Triton kernel against the pure reference, on Triton's CPU interpreter
(small shapes: the interpreter runs every program in Python). On a CUDA machine the same tests run
on the GPU."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when aiter_fused.kernel is first imported

pytest.importorskip("triton")

from aiter_fused.attention import fused_softmax_attention, fused_softmax_attention_varlen  # noqa: E402
from fa4_rowmax.fused_softmax import (  # noqa: E402
    fused_softmax_attention_reference,
    fused_softmax_attention_reference_varlen,
)
from tests.test_fused_softmax import ADVERSARIAL, adversarial_qkv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen).bfloat16().to(DEVICE)


def _assert_close_to_reference(out, lse, ref_out, ref_lse):
    """Agreement to rounding: the output is BF16 (2**-9 relative), the scores differ by fp32
    summation order, which can move a rare P element by one step of its grid."""
    out, ref_out = out.float().cpu(), ref_out.float().cpu()
    rel = ((out - ref_out).norm() / ref_out.norm()).item()
    assert rel < 6e-3, rel
    assert (out - ref_out).abs().max() < 0.05 * ref_out.abs().max()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert (lse.cpu()[finite] - ref_lse[finite]).abs().max() < 1e-3


@pytest.mark.parametrize("mx_format,causal,dot_scaled", [
    ("mxfp8", False, False), ("mxfp6", True, True), ("mxfp4", True, False), ("mxfp4", False, True),
])
def test_kernel_matches_reference(mx_format, causal, dot_scaled):
    gen = torch.Generator().manual_seed(11)
    q, k, v = _randn(1, 37, 4, 64, gen=gen), _randn(1, 83, 2, 64, gen=gen), _randn(1, 83, 2, 64, gen=gen)
    out, lse, recoveries = fused_softmax_attention(q, k, v, causal=causal, mx_format=mx_format, tile_n=32,
                                                   dot_scaled=dot_scaled, recovery_threshold=2.0,
                                                   return_recoveries=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (1, 4, 37)
    ref_out, ref_lse, counters = fused_softmax_attention_reference(
        q.cpu(), k.cpu(), v.cpu(), causal=causal, mx_format=mx_format, tile_n=32, recovery_threshold=2.0,
        return_counters=True)
    _assert_close_to_reference(out, lse, ref_out, ref_lse)
    assert torch.equal(recoveries.cpu().long(), counters["recoveries"])
    assert counters["recoveries"].sum() > 0  # threshold 2 makes recoveries happen on plain N(0, 1) data


def test_kernel_head_dim_128_and_default_tile():
    gen = torch.Generator().manual_seed(12)
    q, k, v = _randn(2, 20, 2, 128, gen=gen), _randn(2, 150, 1, 128, gen=gen), _randn(2, 150, 1, 128, gen=gen)
    out, lse = fused_softmax_attention(q, k, v, mx_format="mxfp8")
    ref_out, ref_lse = fused_softmax_attention_reference(q.cpu(), k.cpu(), v.cpu(), mx_format="mxfp8")
    _assert_close_to_reference(out, lse, ref_out, ref_lse)


def test_kernel_varlen_with_empty_and_fully_masked_rows():
    gen = torch.Generator().manual_seed(13)
    cu_q = torch.tensor([0, 3, 3, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 75, 85], dtype=torch.int32)  # last sequence: 37 queries, 10 keys (causal)
    q, k, v = _randn(40, 2, 32, gen=gen), _randn(85, 1, 32, gen=gen), _randn(85, 1, 32, gen=gen)
    out, lse = fused_softmax_attention_varlen(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), 37, 70, causal=True,
                                              mx_format="mxfp6", tile_n=32)
    ref_out, ref_lse = fused_softmax_attention_reference_varlen(q.cpu(), k.cpu(), v.cpu(), cu_q, cu_k, causal=True,
                                                                mx_format="mxfp6", tile_n=32)
    assert lse.shape == (2, 40)
    assert torch.all(out[3:30].float() == 0) and torch.all(lse[:, 3:30] == -math.inf)
    _assert_close_to_reference(out, lse, ref_out, ref_lse)


def test_exact_build_is_bf16_attention():
    gen = torch.Generator().manual_seed(14)
    q, k, v = _randn(1, 33, 2, 64, gen=gen), _randn(1, 70, 2, 64, gen=gen), _randn(1, 70, 2, 64, gen=gen)
    out, lse = fused_softmax_attention(q, k, v, causal=True, exact=True, tile_n=32)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double().cpu(), k.double().cpu()) / 8.0
    s = s.masked_fill(torch.arange(70)[None, :] > torch.arange(33)[:, None] + 37, -math.inf)
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double().cpu())
    assert ((out.double().cpu() - ref).norm() / ref.norm()) < 6e-3  # BF16 P and BF16 output
    assert (lse.double().cpu() - s.logsumexp(-1)).abs().max() < 1e-4


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_kernel_never_misses_a_recovery(name):
    q, k, v, scale = adversarial_qkv(name, 320)
    q, k, v = (t.bfloat16().to(DEVICE) for t in (q, k, v))
    out, lse, recoveries = fused_softmax_attention(q, k, v, softmax_scale=scale, tile_n=32, mx_format="mxfp8",
                                                   return_recoveries=True)
    ref_out, ref_lse, counters = fused_softmax_attention_reference(q.cpu(), k.cpu(), v.cpu(), softmax_scale=scale,
                                                                   tile_n=32, return_counters=True)
    assert torch.equal(recoveries.cpu().long(), counters["recoveries"])
    assert torch.isfinite(out.float()).all()
    _assert_close_to_reference(out, lse, ref_out, ref_lse)


def test_bad_arguments():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="bfloat16"):
        fused_softmax_attention(q.float(), q, q)
    with pytest.raises(ValueError, match="mx_format"):
        fused_softmax_attention(q, q, q, mx_format="mxfp16")
    with pytest.raises(ValueError, match="head_dim"):
        fused_softmax_attention(q[..., :48], q[..., :48], q[..., :48])
    with pytest.raises(ValueError, match="heads"):
        fused_softmax_attention(q, q[:, :, :1].expand(1, 8, 3, 64), q[:, :, :1].expand(1, 8, 3, 64))
    with pytest.raises(ValueError, match="recovery_threshold"):
        fused_softmax_attention(q, q, q, recovery_threshold=-1.0)
    with pytest.raises(ValueError, match="tile_n"):
        fused_softmax_attention(q, q, q, tile_n=48)
    cu = torch.tensor([0, 8], dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        fused_softmax_attention_varlen(q[0], q[0], q[0], cu, cu, 8, 8)
