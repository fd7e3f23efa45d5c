"""The pure Fused-Softmax pieces and the pure reference (fa4_rowmax.reference.fused_softmax)."""

import math

import numpy as np
import pytest
import torch

from fa4_rowmax.reference.fused_softmax import (
    MX_FORMATS,
    check_recovery_threshold,
    frozen_max_step,
    fused_softmax_attention_reference,
    fused_softmax_attention_reference_varlen,
    hybrid_format,
    needs_recovery,
    operand_element_format,
    p_element_format,
    quantize_operands,
    quantize_p,
    schraudolph_bf16,
)
from fa4_rowmax.reference.mx import fake_quantize_mx
from fa4_rowmax.testing.fused_softmax_inputs import ADVERSARIAL, adversarial_qkv

LOG2E = math.log2(math.e)


def test_schraudolph_bits_are_one_round_half_even():
    y = torch.cat(
        [
            torch.linspace(-130, 20, 200_001),
            torch.arange(-127 * 256, 20 * 256) / 256.0 + 1 / 256,  # exact ties of (y + 127) * 128
            torch.tensor([-127.0, -126.999, -127.001, 0.0, -0.0, 8.0]),
        ]
    ).float()
    bits = schraudolph_bf16(y).view(torch.int16).numpy().astype(np.int64)
    expected = np.rint((y.double().numpy() + 127.0) * 128.0)  # exact in float64; rint = half to even
    expected = np.clip(expected, 0, None).astype(np.int64)
    assert np.array_equal(bits, expected)


def test_schraudolph_special_values_and_error_bound():
    y = torch.tensor([-math.inf, -1000.0, -127.5, math.nan])
    p = schraudolph_bf16(y)
    assert p.dtype == torch.bfloat16
    assert p[:3].float().tolist() == [0.0, 0.0, 0.0] and math.isnan(p[3].item())
    y = torch.linspace(-100, 8, 100_003)
    ratio = schraudolph_bf16(y).double() / torch.exp2(y.double())
    assert ratio.min() > 1 - 2.0**-8 and ratio.max() < 1.0616 * (1 + 2.0**-8)  # chord of 2**frac, BF16 rounding
    assert ratio.max() > 1.06
    with pytest.raises(TypeError, match="float32"):
        schraudolph_bf16(y.double())


def test_formats():
    assert [operand_element_format(f) for f in MX_FORMATS] == ["e4m3", "e2m3", "e2m1"]
    assert [p_element_format(f) for f in MX_FORMATS] == ["e4m3", "e2m3", "e2m3"]
    with pytest.raises(ValueError, match="mx_format"):
        p_element_format("mxfp16")
    with pytest.raises(TypeError, match="mx_format"):
        operand_element_format(None)


def test_quantize_p_blocks_along_keys():
    p = torch.rand(3, 4, 100) * 300
    for fmt in MX_FORMATS:
        assert torch.equal(quantize_p(p.bfloat16(), fmt), fake_quantize_mx(p.bfloat16().float(), p_element_format(fmt)))
    six = quantize_p(p.bfloat16(), "mxfp4")
    assert torch.equal(six, quantize_p(p.bfloat16(), "mxfp6"))  # MXFP4 keeps six-bit P


def test_quantize_operands_block_directions():
    q, k, v = torch.randn(2, 70, 4, 64), torch.randn(2, 70, 2, 64), torch.randn(2, 70, 2, 64)
    qq, kq, vq = quantize_operands(q, k, v, "mxfp4")
    assert torch.equal(qq, fake_quantize_mx(q, "e2m1", dim=-1))
    assert torch.equal(kq, fake_quantize_mx(k, "e2m1", dim=-1))
    assert torch.equal(vq, fake_quantize_mx(v, "e2m1", dim=1))
    # varlen: V's blocks restart at every sequence
    cu = torch.tensor([0, 20, 70], dtype=torch.int32)
    _, _, vq_var = quantize_operands(q[0], k[0], v[0], "mxfp8", cu_seqlens_k=cu)
    assert torch.equal(vq_var[:20], fake_quantize_mx(v[0, :20], "e4m3", dim=0))
    assert torch.equal(vq_var[20:], fake_quantize_mx(v[0, 20:], "e4m3", dim=0))


def test_recovery_rule():
    frozen = torch.tensor([-math.inf, 0.0, 0.0, 0.0, 5.0, -math.inf])
    tile = torch.tensor([3.0, 8.0, 8.01, -50.0, 100.0, -math.inf])
    assert needs_recovery(tile, frozen, 8.0).tolist() == [False, False, True, False, True, False]
    new_max, rescale, recovered = frozen_max_step(frozen, tile, 8.0)
    assert torch.equal(new_max, torch.tensor([3.0, 0.0, 8.01, 0.0, 100.0, -math.inf]))
    assert rescale[0] == 0 and rescale[1] == 1 and rescale[3] == 1 and rescale[5] == 1
    assert torch.allclose(rescale[[2, 4]], torch.exp2(torch.tensor([-8.01, -95.0])))
    assert recovered.tolist() == [False, False, True, False, True, False]
    with pytest.raises(ValueError, match="recovery_threshold"):
        check_recovery_threshold(200.0)
    with pytest.raises(TypeError, match="recovery_threshold"):
        check_recovery_threshold("8")


def test_hybrid_schedule():
    schedule = [hybrid_format(step, 20) for step in range(20)]
    assert schedule == ["mxfp6"] * 3 + ["mxfp4"] * 14 + ["mxfp6"] * 3
    assert [hybrid_format(s, 4, edge_steps=0) for s in range(4)] == ["mxfp4"] * 4
    with pytest.raises(ValueError, match="step"):
        hybrid_format(20, 20)
    with pytest.raises(TypeError, match="edge_steps"):
        hybrid_format(1, 20, edge_steps=1.5)


# ----------------------------------------------------------------------------------------------
# The reference


def _exact_attention(q, k, v, causal=False, softmax_scale=None):
    """float64 softmax attention, dense layout, GQA, bottom-right causal; fully masked rows -> 0."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), torch.logsumexp(s, dim=-1)


def _tile_weights_oracle(q, k, v, mx_format, threshold, tile_n):
    """Independent formulation: the max in force for every tile from a scalar scan, then each tile's
    contribution weighted by 2**(m_tile - m_final) (no running rescale). One head, float64 sums."""
    qq, kq, vq = quantize_operands(q, k, v, mx_format)
    x = (qq[0, :, 0] @ kq[0, :, 0].T) * (q.shape[-1] ** -0.5 * LOG2E)
    maxes, m = [], torch.full((x.shape[0],), -math.inf)
    for start in range(0, x.shape[1], tile_n):
        tile_max = x[:, start : start + tile_n].amax(-1)
        m = torch.where(torch.isinf(m) | (tile_max > m + threshold), tile_max, m)
        maxes.append(m)
    num = torch.zeros(x.shape[0], v.shape[-1], dtype=torch.float64)
    den = torch.zeros(x.shape[0], dtype=torch.float64)
    for t, start in enumerate(range(0, x.shape[1], tile_n)):
        p = quantize_p(schraudolph_bf16(x[:, start : start + tile_n] - maxes[t][:, None]), mx_format).double()
        weight = torch.exp2((maxes[t] - maxes[-1]).double())[:, None]
        num += weight * (p @ vq[0, start : start + tile_n, 0].double())
        den += weight[:, 0] * p.sum(-1)
    recoveries = sum((maxes[t] != maxes[t - 1]).long() for t in range(1, len(maxes)))
    return num / den[:, None], recoveries


@pytest.mark.parametrize("mx_format", MX_FORMATS)
def test_reference_matches_tile_weights_oracle(mx_format):
    torch.manual_seed(3)
    sq, sk, d = 24, 300, 64
    trend = torch.linspace(0, 6, sk)[None, :, None, None]  # rising keys: several recoveries per row
    q, k, v = torch.randn(1, sq, 1, d) + 1.0, (torch.randn(1, sk, 1, d) + trend), torch.randn(1, sk, 1, d)
    out, lse, counters = fused_softmax_attention_reference(
        q, k, v, mx_format=mx_format, recovery_threshold=4.0, tile_n=32, return_counters=True
    )
    oracle, recoveries = _tile_weights_oracle(q, k, v, mx_format, 4.0, 32)
    assert torch.equal(counters["recoveries"][0, 0], recoveries)
    assert recoveries.sum() > sq  # the test exercises recoveries
    assert torch.allclose(out[0, :, 0].double(), oracle, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mx_format", MX_FORMATS)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_close_to_exact_attention(mx_format, causal):
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 77, 4, 64), torch.randn(2, 150, 2, 64), torch.randn(2, 150, 2, 64)
    out, lse = fused_softmax_attention_reference(q, k, v, causal=causal, mx_format=mx_format)
    ref_out, ref_lse = _exact_attention(q, k, v, causal=causal)
    rel = (out.double() - ref_out).norm() / ref_out.norm()
    assert rel < {"mxfp8": 0.06, "mxfp6": 0.08, "mxfp4": 0.25}[mx_format]
    # Schraudolph over-estimates the row sum by < 6.2% (0.06 in lse); MXFP4 scores move it further
    assert (lse.double() - ref_lse).abs().max() < {"mxfp8": 0.1, "mxfp6": 0.1, "mxfp4": 0.3}[mx_format]


def test_reference_fully_masked_rows_and_nan():
    q, k, v = torch.randn(1, 40, 2, 32), torch.randn(1, 10, 2, 32), torch.randn(1, 10, 2, 32)
    out, lse = fused_softmax_attention_reference(q, k, v, causal=True)
    assert torch.all(out[0, :30] == 0) and torch.all(lse[0, :, :30] == -math.inf)
    assert torch.isfinite(out[0, 30:]).all() and torch.isfinite(lse[0, :, 30:]).all()
    k[0, 3, 1, 0] = math.nan
    out, lse = fused_softmax_attention_reference(q, k, v)
    assert torch.isnan(out[0, :, 1]).all() and torch.isfinite(out[0, :, 0]).all()


def expected_recoveries(x_row: torch.Tensor, threshold: float, tile_n: int) -> int:
    m, count = -math.inf, 0
    for start in range(0, x_row.numel(), tile_n):
        tile_max = x_row[start : start + tile_n].max().item()
        if m == -math.inf:
            m = tile_max
        elif tile_max > m + threshold:
            m, count = tile_max, count + 1
    return count


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_reference_never_misses_a_recovery(name):
    sk, tile_n, threshold = 320, 32, 8.0
    q, k, v, scale = adversarial_qkv(name, sk)
    out, lse, counters = fused_softmax_attention_reference(
        q, k, v, softmax_scale=scale, tile_n=tile_n, recovery_threshold=threshold, return_counters=True
    )
    x = (q[0, :, 0] @ k[0, :, 0].T) * (scale * LOG2E)
    expected = [expected_recoveries(x[r], threshold, tile_n) for r in range(x.shape[0])]
    assert counters["recoveries"][0, 0].tolist() == expected
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = _exact_attention(q, k, v, softmax_scale=scale)
    assert (out.double() - ref_out).norm() / ref_out.norm() < 0.08
    assert (lse.double() - ref_lse).abs().max() < 0.07


def test_varlen_reference_is_per_sequence_dense():
    torch.manual_seed(5)
    cu_q, cu_k = torch.tensor([0, 5, 5, 40]), torch.tensor([0, 33, 40, 140])
    q, k, v = torch.randn(40, 4, 64), torch.randn(140, 2, 64), torch.randn(140, 2, 64)
    out, lse = fused_softmax_attention_reference_varlen(q, k, v, cu_q, cu_k, causal=True, mx_format="mxfp6")
    for b in range(3):
        sl_q, sl_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        dense_out, dense_lse = fused_softmax_attention_reference(
            q[None, sl_q], k[None, sl_k], v[None, sl_k], causal=True, mx_format="mxfp6"
        )
        assert torch.equal(out[sl_q], dense_out[0]) and torch.equal(lse[:, sl_q], dense_lse[0])
