"""Reading P back through one-hot V: round trips on a known P, unnormalised weights, underflow, bad input."""

import functools
import math

import pytest
import torch

from fa4_rowmax.gates.readback import (
    one_hot_value_block,
    read_probabilities,
    resolvable,
    unit_roundoff,
    unnormalised_log2_weights,
)


def _known_p_backend(p: torch.Tensor, lse: torch.Tensor):
    """A backend whose P (batch, heads_q, seqlen_q, seqlen_k) and LSE are given: out = P @ V."""

    def backend(q, k, v, causal):
        group = q.shape[2] // k.shape[2]
        v64 = v.double().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
        out = (p @ v64).permute(0, 2, 1, 3).to(q.dtype)
        return out, lse.to(torch.float32)

    return backend


def _random_p(batch, heads, seqlen_q, seqlen_k, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, seqlen_q, seqlen_k, generator=generator, dtype=torch.float64) * 4
    x[..., ::7] = -math.inf  # some keys with P = 0 exactly
    x[:, :, 3] = -math.inf  # a fully masked row
    lse = torch.logsumexp(x * math.log(2), dim=-1)
    p = torch.where(lse.unsqueeze(-1) > -math.inf, torch.exp(x * math.log(2) - lse.unsqueeze(-1)), 0.0)
    return x, p, lse


def _qk(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype):
    q = torch.zeros(batch, seqlen_q, heads_q, head_dim, dtype=dtype)
    k = torch.zeros(batch, seqlen_k, heads_k, head_dim, dtype=dtype)
    return q, k


@pytest.mark.parametrize("head_dim", [64, 128])
def test_round_trip_fp64_is_exact(head_dim):
    # seqlen_k 300 is not a multiple of the block: the last call reads a partial block. GQA 4/2.
    _, p, lse = _random_p(2, 4, 37, 300, seed=head_dim)
    q, k = _qk(2, 37, 300, 4, 2, head_dim, torch.float64)
    read = read_probabilities(_known_p_backend(p, lse), q, k, causal=False)
    assert read.calls == math.ceil(300 / head_dim)
    assert read.p.dtype == torch.float64
    assert torch.equal(read.p, p)
    assert torch.equal(read.lse, lse.to(torch.float32).double())
    assert read.lse_spread == 0.0
    assert read.out_dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_reads_p_as_the_output_dtype_rounds_it(dtype):
    _, p, lse = _random_p(1, 2, 20, 129, seed=3)
    q, k = _qk(1, 20, 129, 2, 2, 32, dtype)
    read = read_probabilities(_known_p_backend(p, lse), q, k, causal=True)
    assert torch.equal(read.p, p.to(dtype).double())
    assert read.out_dtype == dtype
    # A wrong readback (e.g. a transposed block) would be far off; this pins the rounding bound itself.
    nonzero = p > torch.finfo(dtype).tiny
    relative = ((read.p - p).abs() / p)[nonzero]
    assert float(relative.max()) <= unit_roundoff(dtype)


def test_unnormalised_weights_recover_the_scores():
    # P = 2^x / sum 2^x and lse = ln(sum 2^x): log2(P) + lse log2(e) gives x back (weights on the 2^0 scale).
    x, p, lse = _random_p(1, 2, 16, 50, seed=5)
    log2_w = unnormalised_log2_weights(p, lse)
    finite = x > -math.inf
    assert torch.allclose(log2_w[finite], x[finite], atol=1e-12, rtol=0)
    assert (log2_w[~finite] == -math.inf).all()


def test_fp16_underflow_reads_zero_and_is_not_resolvable():
    # Weights 30 octaves below the row: fp16 holds nothing there (subnormal floor 2^-24), bf16 does.
    x = torch.tensor([[[[0.0, -3.0, -16.0, -30.0]]]], dtype=torch.float64)
    lse = torch.logsumexp(x * math.log(2), dim=-1)
    p = torch.exp(x * math.log(2) - lse.unsqueeze(-1))
    for dtype, expected_zero in ((torch.float16, [False, False, False, True]), (torch.bfloat16, [False] * 4)):
        q, k = _qk(1, 1, 4, 1, 1, 4, dtype)
        read = read_probabilities(_known_p_backend(p, lse), q, k, causal=False)
        assert (read.p[0, 0, 0] == 0).tolist() == expected_zero
    assert resolvable(p, torch.float16).tolist() == [[[[True, True, False, False]]]]
    assert resolvable(p, torch.bfloat16).all()
    assert not resolvable(p, torch.float16, headroom_log2=12.0)[0, 0, 0, 1]  # 0.11 < 2^-14 * 2^12


def test_lse_disagreement_between_calls_is_recorded():
    _, p, lse = _random_p(1, 1, 8, 40, seed=6)
    calls = []

    def drifting(q, k, v, causal):
        out, lse_call = _known_p_backend(p, lse)(q, k, v, causal)
        calls.append(None)
        return out, lse_call + 0.25 * (len(calls) - 1)

    q, k = _qk(1, 8, 40, 1, 1, 16, torch.float32)
    read = read_probabilities(drifting, q, k, causal=False)
    assert read.calls == 3
    assert read.lse_spread == pytest.approx(0.5)


def test_reference_backend_reads_exact_softmax():
    from fa4_rowmax.config import SoftmaxConfig
    from fa4_rowmax.reference import attention as reference

    backend = functools.partial(reference.attention_reference, config=SoftmaxConfig(mode="exact"))
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(1, 70, 4, 64, generator=generator, dtype=torch.float64)
    k = torch.randn(1, 150, 2, 64, generator=generator, dtype=torch.float64)
    read = read_probabilities(backend, q, k, causal=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, dim=2)) * 64**-0.5
    keep = torch.arange(150).unsqueeze(0) <= torch.arange(70).unsqueeze(1) + 80
    expected = scores.masked_fill(~keep, -math.inf).softmax(dim=-1)
    assert torch.allclose(read.p, expected, atol=1e-6, rtol=1e-5)
    assert torch.allclose(read.lse, torch.logsumexp(scores.masked_fill(~keep, -math.inf), dim=-1), atol=1e-5)


def test_one_hot_value_block_is_an_identity_over_its_keys():
    k = torch.zeros(2, 300, 3, 8, dtype=torch.bfloat16)
    v = one_hot_value_block(k, 37, 8)  # keys 296..299: a partial block
    assert v.dtype == torch.bfloat16 and v.shape == (2, 300, 3, 8)
    assert v.sum() == 2 * 3 * 4
    assert torch.equal(v[:, 296:300, :, :4], torch.eye(4, dtype=v.dtype)[None, :, None, :].expand(2, 4, 3, 4))
    with pytest.raises(ValueError, match="block"):
        one_hot_value_block(k, 38, 8)


def test_bad_input_names_the_argument():
    _, p, lse = _random_p(1, 1, 8, 40, seed=8)
    good = _known_p_backend(p, lse)
    q, k = _qk(1, 8, 40, 1, 1, 16, torch.float32)
    with pytest.raises(TypeError, match="backend"):
        read_probabilities("not a backend", q, k, causal=False)
    with pytest.raises(TypeError, match="causal"):
        read_probabilities(good, q, k, causal=None)
    with pytest.raises(ValueError, match="q must be 4-D"):
        read_probabilities(good, q[0], k, causal=False)
    with pytest.raises(ValueError, match="heads_q"):
        read_probabilities(good, torch.zeros(1, 8, 3, 16), torch.zeros(1, 40, 2, 16), causal=False)
    with pytest.raises(ValueError, match="head_dim_v"):
        read_probabilities(good, q, k, causal=False, head_dim_v=0)
    with pytest.raises(TypeError, match="tuple"):
        read_probabilities(lambda q, k, v, causal: good(q, k, v, causal)[0], q, k, causal=False)
    with pytest.raises(ValueError, match="out of shape"):
        read_probabilities(lambda q, k, v, causal: (good(q, k, v, causal)[0][:, :4], lse), q, k, causal=False)
    with pytest.raises(ValueError, match="lse of shape"):
        read_probabilities(lambda q, k, v, causal: (good(q, k, v, causal)[0], lse[0]), q, k, causal=False)
    with pytest.raises(ValueError, match="lse shape"):
        unnormalised_log2_weights(p, lse[..., :3])
