"""The reference's emulated FP8 MMA accumulator (Note [Emulated FP8 MMA accumulator], reference/mma_accumulator.py)."""

import math

import pytest
import torch

from fa4_rowmax.config import SoftmaxConfig
from fa4_rowmax.reference.attention import attention_reference
from fa4_rowmax.reference.mma_accumulator import emulated_matmul, truncate_to_bits

E4M3 = torch.float8_e4m3fn


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(E4M3).float()


def _fused_dot_add_scalar(a: list, b: list, c: float, bits: int, min_exponent: int = -6) -> float:
    """MMA-Sim's `nv_fused_dot_add` (mmasim/simulator/functions.py) transcribed with Python floats: products
    aligned (exponent fields, subnormals at the minimum) with c to the largest exponent, truncated to `bits`
    fraction bits there, summed exactly, the sum truncated to `bits` fraction bits of its own leading bit."""

    def split(x: float, lowest: int) -> tuple[float, int]:
        if x == 0.0:
            return 0.0, -(10**6)
        m, e = math.frexp(x)
        m, e = 2 * m, e - 1
        if e < lowest:
            m, e = m * 2.0 ** (e - lowest), lowest
        return m, e

    terms = [split(c, -126)]
    for x, y in zip(a, b):
        (sx, ex), (sy, ey) = split(x, min_exponent), split(y, min_exponent)
        terms.append((sx * sy, ex + ey if sx * sy != 0.0 else -(10**6)))
    top = max(e for _, e in terms)
    if top == -(10**6):
        return 0.0
    total = sum(math.trunc(s * 2.0 ** (bits + e - top)) for s, e in terms) * 2.0 ** (top - bits)
    if total == 0.0:
        return 0.0
    m, e = math.frexp(total)
    return math.trunc(m * 2.0 ** (bits + 1)) * 2.0 ** (e - bits - 1)


def _matmul_scalar(a: torch.Tensor, b_t: torch.Tensor, bits: int, c: torch.Tensor | None = None, k_block: int = 32):
    out = torch.zeros(a.shape[0], b_t.shape[0], dtype=torch.float64)
    for i in range(a.shape[0]):
        for j in range(b_t.shape[0]):
            acc = 0.0 if c is None else float(c[i, j])
            for k0 in range(0, a.shape[1], k_block):
                acc = _fused_dot_add_scalar(
                    a[i, k0 : k0 + k_block].tolist(), b_t[j, k0 : k0 + k_block].tolist(), acc, bits
                )
            out[i, j] = acc
    return out


def test_truncation_drops_a_small_product_by_a_known_amount():
    # One wgmma: 16 * 16 = 256 (exponent 8) and 0.75 * 2^-5 = 0.0234375. At 13 fraction bits the grid at
    # exponent 8 is 2^-5 = 0.03125, so the small product truncates to 0: the sum is 256, not fp32's 256.0234375.
    a = torch.zeros(1, 32)
    b = torch.zeros(1, 32)
    a[0, :2] = torch.tensor([16.0, 0.75])
    b[0, :2] = torch.tensor([16.0, 2.0**-5])
    exact = float(a.double() @ b.double().T)
    assert exact == 256.0234375
    assert float(emulated_matmul(a, b, 13, -6, -6)) == 256.0
    assert float(emulated_matmul(-a, b, 13, -6, -6)) == -256.0  # toward zero, whatever the sign
    # With 16 fraction bits the grid is 2^-8 and the product keeps 6 of its 2^-8 units: 0.0234375 = 6 * 2^-8.
    assert float(emulated_matmul(a, b, 16, -6, -6)) == 256.0234375
    # fp32's matmul keeps it.
    assert float(a @ b.T) == 256.0234375


def test_the_sum_is_truncated_to_its_own_leading_bit():
    # 256 + 256 + 2^-5: aligned at exponent 8 the 2^-5 survives (one unit), but the sum 512 + 2^-5 has its
    # leading bit at 2^9, where 13 fraction bits step by 2^-4: the output is 512.
    a = torch.zeros(1, 32)
    b = torch.zeros(1, 32)
    a[0, :3] = torch.tensor([16.0, 16.0, 0.25])
    b[0, :3] = torch.tensor([16.0, 16.0, 0.125])
    assert float(a.double() @ b.double().T) == 512.03125
    assert float(emulated_matmul(a, b, 13, -6, -6)) == 512.0
    assert float(emulated_matmul(a, b, 14, -6, -6)) == 512.03125


def test_the_accumulator_input_is_aligned_too():
    # Second wgmma: c = 256 from the first k-block, then a product of 0.0234375 is below the 2^-5 grid.
    a = torch.zeros(1, 64)
    b = torch.zeros(1, 64)
    a[0, 0], b[0, 0] = 16.0, 16.0
    a[0, 32], b[0, 32] = 0.75, 2.0**-5
    assert float(emulated_matmul(a, b, 13, -6, -6)) == 256.0
    c = torch.full((1, 1), 256.0)
    assert float(emulated_matmul(a[:, 32:], b[:, 32:], 13, -6, -6, c=c)) == 256.0


@pytest.mark.parametrize("bits", [13, 16, 23])
def test_matches_mma_sims_rule_elementwise(bits):
    torch.manual_seed(bits)
    # Wide magnitudes (e4m3 subnormals included) and an offset channel, as layer 0's k has.
    a = _e4m3(torch.randn(6, 96) * torch.logspace(-3, 1, 96))
    b = _e4m3(torch.randn(5, 96) * 3)
    b[:, 7] = 300.0
    b = _e4m3(b)
    got = emulated_matmul(a, b, bits, -6, -6).double()
    assert torch.equal(got, _matmul_scalar(a, b, bits))
    c = (torch.randn(6, 5) * 100).float()
    got_c = emulated_matmul(a, b, bits, -6, -6, c=c).double()
    assert torch.equal(got_c, _matmul_scalar(a, b, bits, c=c))


def test_truncate_to_bits():
    x = torch.tensor([1.0 + 2.0**-13 + 2.0**-14, -(1.0 + 2.0**-13 + 2.0**-14), 0.0, 3.0], dtype=torch.float64)
    assert truncate_to_bits(x, 13).tolist() == [1.0 + 2.0**-13, -(1.0 + 2.0**-13), 0.0, 3.0]


def _fp8_problem(seed=0, rows=200, heads_q=4, heads_k=2, dim=64, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, rows, heads_q, dim, generator=g)
    k = torch.randn(1, rows, heads_k, dim, generator=g)
    k[..., 5] += offset
    v = torch.randn(1, rows, heads_k, dim, generator=g)
    return [t.clamp(-448, 448).to(E4M3) for t in (q, k, v)]


def _fp8_config(**fields):
    return SoftmaxConfig(mode="exact", max_offset=8, p_dtype=E4M3, **fields)


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_default_is_the_fp32_reference(mode):
    q, k, v = _fp8_problem()
    fields = dict(mode=mode, max_offset=8, p_dtype=E4M3, tile_n=64)
    base = attention_reference(q, k, v, SoftmaxConfig(**fields), causal=True)
    explicit = attention_reference(q, k, v, SoftmaxConfig(**fields, accumulator_mantissa_bits=None), causal=True)
    assert SoftmaxConfig(**fields) == SoftmaxConfig(**fields, accumulator_mantissa_bits=None)
    for x, y in zip(base, explicit):
        assert torch.equal(x, y)


def test_score_error_grows_with_a_row_constant_offset():
    # Layer 0's situation (docs/quality_notes.md section 5): a channel that is nearly the same for every key
    # puts a large offset on every score of a row, so the alignment grid 2^(E - 13) is coarse for all of them.
    errors = {}
    for offset in (0.0, 300.0):
        q, k, _ = _fp8_problem(offset=offset)
        q2, k2 = q.float()[0].transpose(0, 1)[:2], k.float()[0].transpose(0, 1)
        exact = q2.double() @ k2.double().transpose(-1, -2)
        errors[offset] = (emulated_matmul(q2, k2, 13, -6, -6).double() - exact).abs().mean().item()
    assert errors[0.0] > 0
    assert errors[300.0] > 16 * errors[0.0]


def test_emulation_takes_effect_and_shrinks_with_more_bits():
    q, k, v = _fp8_problem(offset=200.0)
    exact = attention_reference(q, k, v, _fp8_config(), causal=True)[0].float()
    errors = {}
    for bits in (13, 23):
        out = attention_reference(q, k, v, _fp8_config(accumulator_mantissa_bits=bits), causal=True)[0].float()
        errors[bits] = (out - exact).abs().mean().item()
    assert errors[13] > 0
    assert errors[23] < errors[13] / 4


def test_gemm_choice():
    q, k, v = _fp8_problem(offset=200.0)
    outs = {
        g: attention_reference(q, k, v, _fp8_config(accumulator_mantissa_bits=13, accumulator_gemms=g), causal=True)[0]
        for g in ("qk", "pv", "qk_pv")
    }
    assert not torch.equal(outs["qk"], outs["pv"])
    assert not torch.equal(outs["qk"], outs["qk_pv"])


def test_rejections():
    with pytest.raises(ValueError, match="accumulator_mantissa_bits"):
        SoftmaxConfig(accumulator_mantissa_bits=24)
    with pytest.raises(ValueError, match="accumulator_mantissa_bits"):
        SoftmaxConfig(mode="baps", accumulator_mantissa_bits=13)
    with pytest.raises(ValueError, match="accumulator_gemms"):
        SoftmaxConfig(accumulator_gemms="sv")
    q = torch.randn(1, 64, 2, 64)
    with pytest.raises(ValueError, match="FP8 inputs only"):
        attention_reference(q, q, q, SoftmaxConfig(accumulator_mantissa_bits=13))
    q8, k8, v8 = _fp8_problem(rows=64)
    with pytest.raises(ValueError, match="FP8 p_dtype"):
        attention_reference(q8, k8, v8, SoftmaxConfig(p_dtype=torch.float32, accumulator_mantissa_bits=13))
    attention_reference(
        q8, k8, v8, SoftmaxConfig(p_dtype=torch.float32, accumulator_mantissa_bits=13, accumulator_gemms="qk")
    )
