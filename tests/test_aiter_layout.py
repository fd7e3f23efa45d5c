"""The Fused-Softmax entries' input layouts and empty inputs (issue 25, defects 1 and 8), on Triton's CPU
interpreter (tiny shapes) or a GPU.

A layout is not a value: q, k and v with any strides (a transposed copy, a slice, a view of a larger buffer)
must give the bit-identical result of their contiguous copies, through the dense and varlen entries and
``torch.ops.aiter_fused.fwd``, in the exact twin and an MX mode. Empty inputs return what FA4's interface
returns: out zero, LSE -inf, in the shapes of a non-empty call.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when aiter_fused.kernel is first imported

pytest.importorskip("triton")

import aiter_fused.ops  # noqa: E402,F401  (registers torch.ops.aiter_fused)
from aiter_fused.attention import fused_softmax_attention, fused_softmax_attention_varlen  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

BF16 = torch.bfloat16
# The exact twin and one MX mode; "bf16" dots run in the interpreter and on every GPU.
MODES = [dict(exact=True), dict(mx_format="mxfp8", dot_mode="bf16")]


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16).to(DEVICE)


def _last_dim_strided(x: torch.Tensor, layout: str = "transposed") -> torch.Tensor:
    """The same values with the last dimension's stride != 1: "transposed" (the issue's construction, a dense
    permutation of the strides, which ``torch.empty_like`` copies) or "gapped" (every other element of a wider
    buffer, which it does not)."""
    if layout == "transposed":
        strided = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    else:
        strided = x.new_empty(*x.shape[:-1], 2 * x.shape[-1])[..., ::2].copy_(x)
    assert strided.stride(-1) != 1 and torch.equal(strided, x)
    return strided


def _assert_same(result, expected):
    for got, want in zip(result, expected):
        assert got.shape == want.shape and torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("mode", MODES, ids=["exact", "mxfp8"])
@pytest.mark.parametrize("layout", ["transposed", "gapped"])
@pytest.mark.parametrize("strided", ["q", "k", "v"])
def test_dense_last_dim_stride_changes_nothing(mode, layout, strided):
    q, k, v = _randn(1, 8, 4, 32, seed=1), _randn(1, 12, 2, 32, seed=2), _randn(1, 12, 2, 32, seed=3)
    expected = fused_softmax_attention(q, k, v, tile_n=32, **mode)
    inputs = dict(q=q, k=k, v=v)
    inputs[strided] = _last_dim_strided(inputs[strided], layout)
    result = fused_softmax_attention(**inputs, tile_n=32, **mode)
    _assert_same(result, expected)
    assert result[0].is_contiguous()  # out is allocated contiguous, not like a strided q


@pytest.mark.parametrize("mode", MODES, ids=["exact", "mxfp8"])
def test_varlen_last_dim_stride_changes_nothing(mode):
    q, k, v = _randn(9, 2, 32, seed=4), _randn(14, 2, 32, seed=5), _randn(14, 2, 32, seed=6)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 6, 14], dtype=torch.int32, device=DEVICE)
    expected = fused_softmax_attention_varlen(q, k, v, cu_q, cu_k, 5, 8, causal=True, tile_n=32, **mode)
    strided = [_last_dim_strided(x) for x in (q, k, v)]
    result = fused_softmax_attention_varlen(*strided, cu_q, cu_k, 5, 8, causal=True, tile_n=32, **mode)
    _assert_same(result, expected)


def test_custom_op_last_dim_stride_changes_nothing():
    q, k, v = _randn(1, 8, 2, 32, seed=7), _randn(1, 12, 2, 32, seed=8), _randn(1, 12, 2, 32, seed=9)
    expected = torch.ops.aiter_fused.fwd(q, k, v, False, None, "mxfp8", False)
    result = torch.ops.aiter_fused.fwd(_last_dim_strided(q), _last_dim_strided(k), v, False, None, "mxfp8", False)
    _assert_same(result, expected)


@pytest.mark.parametrize("mode", MODES, ids=["exact", "mxfp8"])
@pytest.mark.parametrize(
    "q_shape,kv_shape",
    [
        ((0, 8, 2, 32), (0, 12, 1, 32)),  # batch 0
        ((2, 0, 2, 32), (2, 12, 1, 32)),  # no queries
        ((2, 8, 0, 32), (2, 12, 1, 32)),  # no query heads
        ((2, 8, 2, 32), (2, 0, 1, 32)),  # no keys: every row empty
    ],
    ids=["batch0", "seqlen_q0", "heads_q0", "seqlen_k0"],
)
def test_dense_empty_inputs_return_fa4s_empty_result(mode, q_shape, kv_shape):
    q, k, v = _randn(*q_shape, seed=10), _randn(*kv_shape, seed=11), _randn(*kv_shape, seed=12)
    out, lse = fused_softmax_attention(q, k, v, causal=True, tile_n=32, **mode)
    batch, seqlen_q, heads_q, head_dim = q_shape
    assert out.shape == q_shape and out.dtype == BF16 and bool((out == 0).all())
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32
    assert bool((lse == -math.inf).all())


@pytest.mark.parametrize("mode", MODES, ids=["exact", "mxfp8"])
@pytest.mark.parametrize("total_q,total_k", [(0, 0), (0, 7), (5, 0)])
def test_varlen_empty_totals_return_fa4s_empty_result(mode, total_q, total_k):
    q, k, v = _randn(total_q, 2, 32, seed=13), _randn(total_k, 1, 32, seed=14), _randn(total_k, 1, 32, seed=15)
    cu_q = torch.tensor([0, total_q], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, total_k], dtype=torch.int32, device=DEVICE)
    out, lse = fused_softmax_attention_varlen(q, k, v, cu_q, cu_k, total_q, total_k, tile_n=32, **mode)
    assert out.shape == (total_q, 2, 32) and bool((out == 0).all())
    assert lse.shape == (2, total_q) and bool((lse == -math.inf).all())


def test_empty_inputs_are_still_checked():
    """An empty call is not a way around the argument checks."""
    q = _randn(0, 8, 2, 32, seed=16)
    with pytest.raises(ValueError, match="tile_n"):
        fused_softmax_attention(q, q, q, tile_n=48)
    with pytest.raises(ValueError, match="mx_format"):
        fused_softmax_attention(q, q, q, mx_format="mxfp16")
