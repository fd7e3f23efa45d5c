"""fa4_rowmax.gates.tolerances (Note [Kernel vs reference: lattice flips]) on the CPU: two implementations that
differ only in rounding (the reference in fp32 and in fp64) stay within the per-row bounds, the bounds are
tight enough that wrong implementations (another mode, another threshold, a swapped V row) break them."""

import dataclasses
import math

import pytest
import torch

from fa4_rowmax.config import SoftmaxConfig
from fa4_rowmax.gates.tolerances import assert_within_bounds, kernel_bounds
from fa4_rowmax.reference.attention import attention_reference

SHAPES = [((1, 128, 128, 1, 1), True), ((2, 509, 300, 4, 2), False), ((1, 300, 509, 4, 2), True)]


def _inputs(seed, batch, sq, sk, hq, hk, d=64, q_std=3.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, sq, hq, d, generator=gen) * q_std).bfloat16()
    k = torch.randn(batch, sk, hk, d, generator=gen).bfloat16()
    v = torch.randn(batch, sk, hk, d, generator=gen).bfloat16()
    return q, k, v


@pytest.mark.parametrize("shape, causal", SHAPES)
@pytest.mark.parametrize(
    "mode, threshold, anchor_rounding",
    [
        ("rowmax_h15", 0.0, "exact"),
        ("rowmax_h15", 8.0, "exact"),
        ("rowmax_pot", 0.0, "exact"),
        ("exact", 0.0, "exact"),
        ("rowmax_h15", 8.0, "half_octave"),
    ],
)
def test_rounding_differences_stay_within_the_bounds(shape, causal, mode, threshold, anchor_rounding):
    q, k, v = _inputs(sum(shape), *shape)
    config = SoftmaxConfig(
        mode=mode, tile_n=128, rescale_threshold=threshold, p_dtype=torch.bfloat16, anchor_rounding=anchor_rounding
    )
    fp32 = attention_reference(q, k, v, config, causal=causal)
    fp64 = attention_reference(q, k, v, config, causal=causal, compute_dtype=torch.float64)
    bounds = kernel_bounds(q, k, v, config, causal=causal)
    assert_within_bounds(*fp32, *fp64, bounds)
    # Not vacuous: the typical row's bound is a few output ulps, not the cap.
    v_max = float(v.float().abs().max())
    assert float(bounds.out.median()) < 0.02 * v_max, float(bounds.out.median())
    assert bounds.decision_rows <= 0.01 * bounds.lse.numel()


@pytest.mark.parametrize("wrong", ["other_mode", "other_threshold", "swapped_v_row"])
def test_wrong_implementations_break_the_bounds(wrong):
    q, k, v = _inputs(7, 2, 509, 300, 4, 2)
    config = SoftmaxConfig(mode="rowmax_h15", tile_n=128, p_dtype=torch.bfloat16)
    bounds = kernel_bounds(q, k, v, config, causal=False)
    ref = attention_reference(q, k, v, config, causal=False)
    if wrong == "other_mode":
        got = attention_reference(q, k, v, SoftmaxConfig(mode="rowmax_pot", tile_n=128, p_dtype=torch.bfloat16))
    elif wrong == "other_threshold":
        got = attention_reference(
            q, k, v, SoftmaxConfig(mode="rowmax_h15", tile_n=128, rescale_threshold=8.0, p_dtype=torch.bfloat16)
        )
    else:
        v_wrong = v.clone()
        v_wrong[0, 17] = v_wrong[0, 18]
        got = attention_reference(q, k, v_wrong, config)
    with pytest.raises(AssertionError):
        assert_within_bounds(*got, *ref, bounds)


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_fp8_bounds_hold_between_two_roundings_of_the_fp8_reference(mode):
    from fa4_rowmax.config import FP8_MAX_OFFSET
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 2, 64, generator=gen).to(torch.float8_e4m3fn) for n in (200, 300, 300))
    config = SoftmaxConfig(mode=mode, max_offset=FP8_MAX_OFFSET, tile_n=128)
    out32, lse32 = attention_reference(q, k, v, config, causal=True)
    out64, lse64 = attention_reference(q, k, v, config, causal=True, compute_dtype=torch.float64)
    out_bound, lse_bound = fp8_kernel_bounds(q, k, v, config, True)
    assert ((out32.float() - out64.float()).abs().amax(-1, keepdim=True) <= out_bound).all()
    finite = torch.isfinite(lse64)
    assert ((lse32 - lse64).abs()[finite] <= lse_bound[finite]).all()


def _ex2_emulation_model(y: torch.Tensor) -> torch.Tensor:
    """fp32 model of FA4's `utils.ex2_emulation` (degree 3), bit for bit up to the FMAs' double rounding: NaN-quiet
    clamp at -127, floor, fraction in fp32, Horner in fp32, floor added into the exponent bits (mod 2^32)."""
    from flash_attn.cute.utils import POLY_EX2

    x = torch.where(torch.isnan(y), -127.0, y.clamp(min=-127.0)).float()
    floor = torch.floor(x)
    frac = x - floor
    coeffs = POLY_EX2[3]
    p = torch.full_like(frac, coeffs[3])
    for c in coeffs[2::-1]:
        p = (p.double() * frac.double() + torch.tensor(c, dtype=torch.float32).double()).float()
    bits = (floor.long() << 23) + p.view(torch.int32).long()
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).int().view(torch.float32)


def test_exp2_emulation_error_is_derived_from_fa4s_polynomial():
    """Note [exp2 emulation error]: the constant is the bound recomputed from FA4's degree-3 POLY_EX2 (rounded up
    by under 1 %), and an fp32 model of the emulation stays within it on y in [-126, 9] (the FP8 range: y <=
    max_offset + rescale_threshold < 8.81); -inf and NaN give +0 (hence the NaN row max with beta, Note [beta on
    the FP8 exact twin])."""
    import inspect
    import math

    import flash_attn.cute.utils as utils

    from fa4_rowmax.gates.tolerances import EX2_EMULATION_REL_ERROR

    assert inspect.signature(utils.ex2_emulation).parameters["poly_degree"].default == 3
    c = [float(torch.tensor(x, dtype=torch.float32)) for x in utils.POLY_EX2[3]]
    assert c == list(utils.POLY_EX2[3]), "the coefficients are fp32 values"
    f = torch.linspace(0.0, 1.0, 2**20 + 1, dtype=torch.float64)
    p = ((c[3] * f + c[2]) * f + c[1]) * f + c[0]
    dp = (3 * c[3] * f + 2 * c[2]) * f + c[1]
    poly = (p / torch.exp2(f) - 1).abs().max() + ((dp - math.log(2) * p) / torch.exp2(f)).abs().max() * 2.0**-20
    t2 = c[3] * f + c[2]
    t1 = t2 * f + c[1]
    fma = ((p + t1 * f + t2 * f * f) / torch.exp2(f)).max() * 2.0**-24
    fraction = 2.0**-24 * math.log(2.0)
    derived = float(poly + fma + fraction)
    assert derived <= EX2_EMULATION_REL_ERROR <= 1.01 * derived, derived
    y = torch.cat([torch.linspace(-126.0, 9.0, 2**21 + 1), torch.linspace(-1.0, 0.0, 2**18 + 1)])
    rel = (_ex2_emulation_model(y).double() / torch.exp2(y.double()) - 1).abs()
    assert float(rel.max()) <= EX2_EMULATION_REL_ERROR
    assert float(rel.max()) > 0.95 * EX2_EMULATION_REL_ERROR  # the model is the polynomial, not exp2
    special = _ex2_emulation_model(torch.tensor([-math.inf, math.nan, -200.0]))
    assert special.tolist() == [0.0, 0.0, 0.0] and not torch.signbit(special).any()


def test_fp8_bounds_cover_the_exp2_emulation(monkeypatch):
    """Note [FP8 kernel vs reference bounds], beta: the FP8 reference with every exact weight emulated (beta 1, the
    kernel's FADD row sum adds the emulated fp32 weights) stays within the bounds with beta=1.0, and leaves them
    without the emulation term (small scores: the accumulator term of delta is then far below the emulation's)."""
    from fa4_rowmax.config import FP8_MAX_OFFSET
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds
    from fa4_rowmax.reference import attention as reference

    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(1, 200, 2, 64, generator=gen) * 0.02).to(torch.float8_e4m3fn)
    k, v = (torch.randn(1, 300, 2, 64, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    config = SoftmaxConfig(mode="exact", max_offset=FP8_MAX_OFFSET, tile_n=128)
    ref_out, ref_lse = attention_reference(q, k, v, config, causal=True)
    stock_weights = reference._fa4_weights
    monkeypatch.setattr(reference, "_fa4_weights", lambda y, tile, cfg: _ex2_emulation_model(y.float()).to(y.dtype))
    out, lse = attention_reference(q, k, v, config, causal=True)
    monkeypatch.setattr(reference, "_fa4_weights", stock_weights)
    finite = torch.isfinite(ref_lse)
    lse_err = (lse - ref_lse).abs()[finite]
    out_err = (out.float() - ref_out.float()).abs().amax(-1, keepdim=True)
    for beta, covered in ((1.0, True), (None, False)):
        out_bound, lse_bound = fp8_kernel_bounds(q, k, v, dataclasses.replace(config, beta=beta), True)
        assert (out_err <= out_bound).all()
        assert bool((lse_err <= lse_bound[finite]).all()) == covered, beta


def test_fp8_bounds_cover_the_h15_byte4_rule(monkeypatch):
    """Note [FP8 kernel vs reference bounds], byte-4 rule: with one key 14.43 octaves above 127 others (one tile) (H15
    weight 1.5 * 2^-7 at max_offset 8), the kernel's 2^-7 per element moves the LSE by ~127 2^-15 where the
    reference flushes them; a model of that stays within the bounds, and beyond them without the band term."""
    from fa4_rowmax.config import FP8_MAX_OFFSET
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds
    from fa4_rowmax.reference import attention as reference

    head_dim, keys = 64, 128  # one KV tile: every other key is in the band
    q = torch.zeros(1, 1, 1, head_dim)
    q[..., 0] = 8.0
    k = torch.zeros(1, keys, 1, head_dim)
    k[0, 0, 0, 0] = 10.0  # score 80: 80 / sqrt(64) * log2(e) = 14.43 octaves above the other keys (score 0)
    v = torch.randn(1, keys, 1, head_dim, generator=torch.Generator().manual_seed(2))
    q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    config = SoftmaxConfig(mode="rowmax_h15", max_offset=FP8_MAX_OFFSET, tile_n=128)
    ref_out, ref_lse = attention_reference(q, k, v, config)
    stock_operand = reference._h15_fp8_operand

    def kernel_operand(p, p_dtype):
        return torch.where(p == 1.5 * 2**-7, 2.0**-7, stock_operand(p, p_dtype))

    monkeypatch.setattr(reference, "_h15_fp8_operand", kernel_operand)
    out, lse = attention_reference(q, k, v, config)
    out_bound, lse_bound = fp8_kernel_bounds(q, k, v, config, False)
    lse_err = float((lse - ref_lse).abs().max())
    assert lse_err > 100 * 2.0**-15  # the rule matters here (127 elements)
    assert lse_err <= float(lse_bound.min())
    assert ((out.float() - ref_out.float()).abs().amax(-1, keepdim=True) <= out_bound).all()
    x = torch.tensor([80.0] + [0.0] * (keys - 1), dtype=torch.float64) * head_dim**-0.5 * math.log2(math.e)
    pi = torch.softmax(x * math.log(2.0), -1)
    band_mass = float(pi[1:].sum())
    assert lse_err > float(lse_bound.min()) - band_mass  # without the band term the bound is too small
