"""The reference's emulated FP8 MMA accumulator (Note [Emulated FP8 MMA accumulator], reference/mma_accumulator.py)."""

import math
from fractions import Fraction

import pytest
import torch
from helpers_emulation import one_thread  # noqa: F401 (a fixture)

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


# --- two-level P V accumulation (Note [Two-level P V accumulation]) --------------------------------------------


def _fma_exact(a: float, b: float, c: float) -> float:
    """fp32 a * b + c rounded once to nearest even, from exact rationals (numpy's float32 rounds a rational's
    nearest fp64 only, so the tie is resolved here by hand)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    low = float(torch.tensor(float(exact), dtype=torch.float64).float())  # a neighbour of the answer
    candidates = [low]
    for direction in (math.inf, -math.inf):
        candidates.append(float(torch.nextafter(torch.tensor(low), torch.tensor(direction))))
    best = min(candidates, key=lambda r: (abs(Fraction(r) - exact), _odd_fp32(r)))
    return best


def _odd_fp32(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float32).view(torch.int32)) & 1


# a * b + c whose fp64 sum lands exactly on an fp32 midpoint while the exact sum does not (double rounding):
# 2^-24 (1 + 2^-15) (1 - 2^-15) = 2^-24 - 2^-54, plus 1 + 2^-23, rounds in fp64 to 1 + 2^-23 + 2^-24 (the midpoint
# between an odd and an even fp32), which ties to the even 1 + 2^-22; the FFMA gives 1 + 2^-23.
DOUBLE_ROUNDING_CASES = (
    (2.0**-24 * (1 + 2.0**-15), 1 - 2.0**-15, 1 + 2.0**-23),
    (-(2.0**-24) * (1 + 2.0**-15), 1 - 2.0**-15, -(1 + 2.0**-23)),
    # 2^-24 (1 + 2896 2^-23) (1 - 2895 2^-23) = 2^-24 + 4688 2^-70: the exact 1 + 2^-24 + 4688 2^-70 lies above the
    # midpoint between the even 1 and the odd 1 + 2^-23, and fp64 rounds it onto the midpoint, which ties down.
    (2.0**-24 * (1 + 2896 * 2.0**-23), 1 - 2895 * 2.0**-23, 1.0),
    (2.0**-75 * (1 + 2.0**-23), 2.0**-75, 2.0**-149),  # a subnormal result, above its midpoint
)


def test_fma_fp32_rounds_once_where_fp64_rounds_twice():
    from fa4_rowmax.reference.mma_accumulator import fma_fp32

    a, b, c = (torch.tensor([case[i] for case in DOUBLE_ROUNDING_CASES], dtype=torch.float32) for i in range(3))
    assert [float(x) for x in a] == [case[0] for case in DOUBLE_ROUNDING_CASES]  # the operands are fp32 values
    got = fma_fp32(a, b, c).tolist()
    assert got == [_fma_exact(*case) for case in DOUBLE_ROUNDING_CASES]
    assert got[0] == 1 + 2.0**-23
    twice = (a.double() * b.double() + c.double()).float().tolist()
    assert got[2] == 1 + 2.0**-23 and got[3] == 2.0**-148
    # What a double rounding gives: one ulp off.
    assert twice[:3] == [1 + 2.0**-22, -(1 + 2.0**-22), 1.0]


def test_fma_fp32_matches_exact_rounding_on_random_operands():
    from fa4_rowmax.reference.mma_accumulator import fma_fp32

    g = torch.Generator().manual_seed(5)
    n = 3000
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    b = torch.rand(n, generator=g)  # a rescale factor's range
    c = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    got = fma_fp32(a, b, c).tolist()
    assert got == [_fma_exact(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert not torch.equal(fma_fp32(a, b, c), a * b + c)  # fp32 mul then add rounds twice: some differ


def _fa4_exact_model(q, k, v, tile_n: int, two_level: bool):
    """An independent transcription of the FP8 reference's exact mode (Note [FA4 running max and
    rescale_threshold]: descending tiles, threshold 0, max_offset 8, e4m3 P, fp32 row sum of the fp32 weights),
    with both GEMMs through the emulated accumulator and P V single-level (O the accumulator input, scaled first)
    or two-level (a fresh accumulator per tile, O = fma(O, c, acc) exactly rounded): out (rows, D) fp32 before
    the BF16 output rounding. One batch, one head, non-causal."""
    from fa4_rowmax.reference.mma_accumulator import fma_fp32

    q, k, v = (t[0, :, 0].float() for t in (q, k, v))
    scale_log2 = q.shape[-1] ** -0.5 * math.log2(math.e)
    rows, keys = q.shape[0], k.shape[0]
    m = torch.full((rows,), -math.inf)
    total = torch.zeros(rows)
    out = torch.zeros(rows, v.shape[-1])
    for t in range(-(-keys // tile_n) - 1, -1, -1):
        cols = slice(t * tile_n, min(keys, (t + 1) * tile_n))
        s = emulated_matmul(q, k[cols], 13, -6, -6)
        m_new = torch.maximum(m, s.amax(-1))
        c = torch.exp2((m - m_new) * scale_log2)
        p = torch.exp2(s * scale_log2 + (8 - m_new * scale_log2)[:, None])
        total = total * c + p.sum(-1)
        p8 = _e4m3(p)
        if two_level:
            out = fma_fp32(out, c[:, None], emulated_matmul(p8, v[cols].T.contiguous(), 13, -6, -6))
        else:
            out = emulated_matmul(p8, v[cols].T.contiguous(), 13, -6, -6, c=out * c[:, None])
        m = m_new
    return out / total[:, None]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("promotion", ["none", "tile"])
def test_reference_promotion_matches_an_independent_tile_loop(promotion):
    q, k, v = _long_row_problem(keys=640, rows=6, v_mean=1.0)
    config = _fp8_config(accumulator_mantissa_bits=13, accumulator_promotion=promotion, tile_n=128)
    out = attention_reference(q, k, v, config)[0][0, :, 0]
    model = _fa4_exact_model(q, k, v, 128, two_level=promotion == "tile")
    assert torch.equal(out, model.to(torch.bfloat16))


def _long_row_problem(keys: int, rows: int, v_mean: float, seed: int = 0):
    """The H200 accuracy study's inputs (studies/fp8_accumulator): q, k ~ 0.35 N(0, 1), V ~ N(v_mean, 1), e4m3."""
    g = torch.Generator().manual_seed(seed)
    q = 0.35 * torch.randn(1, rows, 1, 128, generator=g)
    k = 0.35 * torch.randn(1, keys, 1, 128, generator=g)
    v = torch.randn(1, keys, 1, 128, generator=g) + v_mean
    return [t.to(E4M3) for t in (q, k, v)]


def _error_vs_fp64(q, k, v, config) -> float:
    q64, k64, v64 = (t.double()[0, :, 0] for t in (q, k, v))
    exact = torch.softmax(q64 @ k64.T * 128**-0.5, dim=-1) @ v64
    out = attention_reference(q, k, v, config)[0][0, :, 0].double()
    return float((out - exact).norm() / exact.norm())


@pytest.mark.usefixtures("one_thread")
def test_two_level_stays_flat_where_single_level_grows():
    # The H200's finding (issue 22): with V of mean 1 and diffuse attention, single-level accumulation loses a
    # share of O that grows with the keys (2.3 % at 2K, 10.5 % at 8K); two-level stays at the e4m3 P and BF16
    # output roundings (0.2 %).
    errors = {}
    for keys in (512, 4096):
        q, k, v = _long_row_problem(keys=keys, rows=4, v_mean=1.0)
        for promotion in ("none", "tile"):
            config = _fp8_config(accumulator_mantissa_bits=13, accumulator_promotion=promotion, tile_n=128)
            errors[keys, promotion] = _error_vs_fp64(q, k, v, config)
    assert errors[4096, "none"] > 4 * errors[512, "none"]  # the truncation grows about linearly with the keys
    assert errors[4096, "none"] > 0.03
    assert errors[4096, "tile"] < 1.5 * errors[512, "tile"]
    assert errors[4096, "tile"] < 0.004


@pytest.mark.usefixtures("one_thread")
def test_default_promotion_is_single_level():
    q, k, v = _fp8_problem(offset=200.0)
    base = attention_reference(q, k, v, _fp8_config(accumulator_mantissa_bits=13), causal=True)
    explicit = attention_reference(
        q, k, v, _fp8_config(accumulator_mantissa_bits=13, accumulator_promotion="none"), causal=True
    )
    tile = attention_reference(
        q, k, v, _fp8_config(accumulator_mantissa_bits=13, accumulator_promotion="tile"), causal=True
    )
    assert SoftmaxConfig().accumulator_promotion == "none"
    for x, y in zip(base, explicit):
        assert torch.equal(x, y)
    assert not torch.equal(base[0], tile[0])


def test_promotion_rejections():
    with pytest.raises(ValueError, match=r"accumulator_promotion must be one of \('none', 'tile'\)"):
        SoftmaxConfig(accumulator_mantissa_bits=13, accumulator_promotion="k128")
    with pytest.raises(ValueError, match="accumulator_promotion='tile' applies to the emulated P V"):
        SoftmaxConfig(accumulator_promotion="tile")
    with pytest.raises(ValueError, match="accumulator_promotion='tile' applies to the emulated P V"):
        SoftmaxConfig(accumulator_mantissa_bits=13, accumulator_gemms="qk", accumulator_promotion="tile")
    SoftmaxConfig(accumulator_mantissa_bits=13, accumulator_gemms="pv", accumulator_promotion="tile")
