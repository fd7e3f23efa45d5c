"""fa4_rowmax.gates.tolerances (Note [Kernel vs reference: lattice flips]) on the CPU: two implementations that
differ only in rounding (the reference in fp32 and in fp64) stay within the per-row bounds, the bounds are
tight enough that wrong implementations (another mode, another threshold, a swapped V row) break them."""

import dataclasses
import math

import pytest
import torch
from helpers_emulation import one_thread  # noqa: F401 (a fixture)

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


def _emulated_reference_errors(monkeypatch, q, k, v, config):
    """The reference with every exact weight from the fp32 model of FA4's `ex2_emulation` against the stock one
    (causal): per-row max |out error|, |LSE error| on the finite rows, and that finite mask."""
    from fa4_rowmax.reference import attention as reference

    ref_out, ref_lse = attention_reference(q, k, v, config, causal=True)
    with monkeypatch.context() as patch:
        patch.setattr(reference, "_fa4_weights", lambda y, tile, cfg: _ex2_emulation_model(y.float()).to(y.dtype))
        out, lse = attention_reference(q, k, v, config, causal=True)
    finite = torch.isfinite(ref_lse)
    return (out.float() - ref_out.float()).abs().amax(-1, keepdim=True), (lse - ref_lse).abs()[finite], finite


def test_fp8_bounds_cover_the_exp2_emulation(monkeypatch):
    """Note [FP8 kernel vs reference bounds], beta: the FP8 reference with every exact weight emulated (beta 1, the
    kernel's FADD row sum adds the emulated fp32 weights) stays within the bounds with beta=1.0, and leaves them
    without the emulation term (small scores: the accumulator term of delta is then far below the emulation's)."""
    from fa4_rowmax.config import FP8_MAX_OFFSET
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds

    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(1, 200, 2, 64, generator=gen) * 0.02).to(torch.float8_e4m3fn)
    k, v = (torch.randn(1, 300, 2, 64, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    config = SoftmaxConfig(mode="exact", max_offset=FP8_MAX_OFFSET, tile_n=128)
    out_err, lse_err, finite = _emulated_reference_errors(monkeypatch, q, k, v, config)
    for beta, covered in ((1.0, True), (None, False)):
        out_bound, lse_bound = fp8_kernel_bounds(q, k, v, dataclasses.replace(config, beta=beta), True)
        assert (out_err <= out_bound).all()
        assert bool((lse_err <= lse_bound[finite]).all()) == covered, beta


def test_bf16_bounds_cover_the_exp2_emulation(monkeypatch):
    """Note [Kernel vs reference: the exp2 emulation]: the BF16 reference with every exact weight emulated (beta 1:
    FA4's `ex2_emulation` model in place of exp2) stays within `kernel_bounds` with beta=1.0, and leaves them without
    the emulation term (small scores: the score GEMM's share of delta is then far below the emulation's)."""
    from fa4_rowmax.gates.tolerances import kernel_bounds

    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(1, 200, 2, 64, generator=gen) * 0.02).bfloat16()
    k, v = (torch.randn(1, 300, 2, 64, generator=gen).bfloat16() for _ in range(2))
    config = SoftmaxConfig(mode="exact", tile_n=128)
    out_err, lse_err, finite = _emulated_reference_errors(monkeypatch, q, k, v, config)
    for beta, covered in ((1.0, True), (None, True), (0.0, False)):  # None: FA4's stock tuning, charged
        bounds = kernel_bounds(q, k, v, dataclasses.replace(config, beta=beta), causal=True)
        assert (out_err <= bounds.out).all()
        assert bool((lse_err <= bounds.lse[finite]).all()) == covered, beta


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


def _fp8_rule_inputs(seed):
    """e4m3 q, k (head dim 128) over several scales, with zeros and subnormals, and rows whose top score is
    made of same-sign products (k row i = q row i: the case that loses most to the truncation)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.01, 0.3, 1.0, 1.5, 4.0])[torch.arange(40) % 5][:, None]
    q = (torch.randn(40, 128, generator=gen) * scale).to(torch.float8_e4m3fn).double()
    k = (torch.randn(48, 128, generator=gen) * 1.5).to(torch.float8_e4m3fn).double()
    k[:40] = torch.where(torch.arange(40)[:, None] % 2 == 0, q, k[:40])
    q[3, ::3] = 0.0
    k[5, 1::4] = 2.0**-9  # e4m3's smallest subnormal
    return q, k


def test_fp8_score_error_bound_holds_for_the_rule_and_is_not_vacuous():
    """Note [Hopper FP8 accumulation]: the rule's scores stay within eps of the exact ones; on the same-sign rows
    the error uses a good part of eps, and it exceeds the 2^-13 sum |q k| of a 14-bit rounding by far, twice that
    included (a delta's factor 2)."""
    from fa4_rowmax.gates.tolerances import fp8_score_error_bound

    q, k = _fp8_rule_inputs(8)
    err = (_hopper_scores(q, k) - q @ k.T).abs()
    eps = fp8_score_error_bound(q, k)
    assert (err <= eps).all()
    assert float((err / eps).max()) > 0.3
    older = 2 * 2.0**-13 * (q.abs() @ k.abs().T)
    assert float((err / older).max()) > 3


def _hopper_scores(q64, k64):
    """q k^T by Hopper's e4m3 wgmma rule: the reference's emulated accumulator (Note [Emulated FP8 MMA accumulator])
    with MMA-Sim's 13 fraction bits."""
    from fa4_rowmax.reference.mma_accumulator import emulated_matmul

    return emulated_matmul(q64.float(), k64.float(), 13, -6, -6).double()


def _hopper_config(config):
    """`config` with the reference's Q K^T through the emulated accumulator (a model of the kernel's score GEMM)."""
    return dataclasses.replace(config, accumulator_mantissa_bits=13, accumulator_gemms="qk")


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_fp8_bounds_cover_the_qk_truncation(mode):
    """Note [Hopper FP8 accumulation], the H200's GQA-7 case in small: the FP8 reference with its scores
    by Hopper's rule (its emulated accumulator, 13 bits, Q K^T only) stays within `fp8_kernel_bounds` of the
    stock one, on rows whose top score is a sum of same-sign products (each query's own key, the other keys > 20
    octaves below: the LSE is that score's), and leaves a 14-bit-rounding bound on every row (its LSE term:
    ln2 (2 scale_log2 2^-13 max sum |q k| + 8 ulp) + 2^-20 + 4 ulp(LSE), no fragile element here), by up to 4.8
    times."""
    from fa4_rowmax.config import FP8_MAX_OFFSET
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds

    gen = torch.Generator().manual_seed(11)
    q = (torch.randn(1, 16, 1, 128, generator=gen) * 1.5).to(torch.float8_e4m3fn)
    k, v = q.clone(), torch.randn(1, 16, 1, 128, generator=gen).to(torch.float8_e4m3fn)
    config = SoftmaxConfig(mode=mode, max_offset=FP8_MAX_OFFSET, tile_n=128)
    ref_out, ref_lse = attention_reference(q, k, v, config)
    out, lse = attention_reference(q, k, v, _hopper_config(config))
    out_bound, lse_bound = fp8_kernel_bounds(q, k, v, config, False)
    lse_err = (lse - ref_lse).abs()
    assert (lse_err <= lse_bound).all()
    assert ((out.float() - ref_out.float()).abs().amax(-1, keepdim=True) <= out_bound).all()
    scale_log2 = 128**-0.5 * math.log2(math.e)
    qf, kf = q[0, :, 0].double(), k[0, :, 0].double()
    x = qf @ kf.T * scale_log2
    assert bool((x.diagonal()[:, None] - x >= 20).fill_diagonal_(True).all())  # one key per row
    older_delta = 2 * scale_log2 * 2.0**-13 * (qf.abs() @ kf.abs().T).amax(-1) + 8 * 2.0**-24 * 2 * x.abs().amax(-1)
    older = math.log(2.0) * older_delta + 2.0**-20 + 4 * 2.0**-24 * ref_lse[0, 0].abs()
    assert (lse_err[0, 0] > older).all() and bool((lse_err[0, 0] > 3 * older).any())


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_fp8_bounds_cover_hopper_scores_with_gqa_and_descales(mode):
    """The failing GPU test's kind in small (GQA 7, causal, descales, N(0, 1) e4m3): the reference with Hopper's
    scores (as above) stays within the bounds of the stock one, and the truncation is felt (LSE errors far above
    fp32's)."""
    from fa4_rowmax.config import FP8_MAX_OFFSET
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds

    gen = torch.Generator().manual_seed(12)
    q, k, v = (
        torch.randn(1, n, h, 128, generator=gen).to(torch.float8_e4m3fn) for n, h in ((300, 14), (300, 2), (300, 2))
    )
    dq, dk, dv = (torch.rand(1, 2, generator=gen) + 0.5 for _ in range(3))
    config = SoftmaxConfig(mode=mode, max_offset=FP8_MAX_OFFSET, tile_n=128)
    kw = dict(causal=True, q_descale=dq, k_descale=dk, v_descale=dv)
    ref_out, ref_lse = attention_reference(q, k, v, config, **kw)
    out, lse = attention_reference(q, k, v, _hopper_config(config), **kw)
    out_bound, lse_bound = fp8_kernel_bounds(q, k, v, config, True, [dq, dk, dv])
    lse_err = (lse - ref_lse).abs()
    assert (lse_err <= lse_bound).all()
    assert ((out.float() - ref_out.float()).abs().amax(-1, keepdim=True) <= out_bound).all()
    assert float(lse_err.max()) > 1e-4


def test_bf16_bounds_cover_p_rounding_flips_where_the_output_cancels(monkeypatch):
    """Note [Kernel vs reference: P's rounding]: two keys with v = +1 / -1 and scores 0 to 0.15 octave apart, so O is
    near 0 and the output's rounding term vanishes: the emulated weights (beta 1) round some P to the neighbouring
    BF16 value, one ulp (2^-8 relative), far beyond the smooth drift. Covered with the P-rounding term; the same
    bound with P held in fp32 (no BF16 steps) is exceeded on those rows."""
    from fa4_rowmax.gates.tolerances import kernel_bounds
    from fa4_rowmax.reference import attention as reference

    head_dim, rows = 64, 4096
    k = torch.zeros(1, 2, 1, head_dim)
    k[0, 1, 0, 0] = 1.0
    q = torch.zeros(1, rows, 1, head_dim)
    gen = torch.Generator().manual_seed(0)
    q[0, :, 0, 0] = -torch.rand(rows, generator=gen) * 0.15 * math.sqrt(head_dim) / math.log2(math.e)
    v = torch.zeros(1, 2, 1, head_dim)
    v[0, 0], v[0, 1] = 1.0, -1.0
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    config = SoftmaxConfig(mode="exact", tile_n=128, beta=1.0)
    ref_out, _ = attention_reference(q, k, v, config)
    monkeypatch.setattr(reference, "_fa4_weights", lambda y, tile, cfg: _ex2_emulation_model(y.float()).to(y.dtype))
    out, _ = attention_reference(q, k, v, config)
    out_err = (out.float() - ref_out.float()).abs().amax(-1, keepdim=True)
    bounds = kernel_bounds(q, k, v, config, causal=False)
    assert (out_err <= bounds.out).all()
    assert bounds.fragile_elements > 0
    without = kernel_bounds(q, k, v, dataclasses.replace(config, p_dtype=torch.float32), causal=False)
    assert float((out_err / without.out).max()) > 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_rounding_midpoint_distance_is_the_true_nearest_midpoint(dtype):
    """`rounding_midpoint_distance` against every midpoint of `dtype`'s grid (enumerated from its bit patterns),
    on random weights and exact powers of two (where the nearest midpoint is the lower binade's: half as far as
    p's own grid would put it), subnormals included."""
    from fa4_rowmax.gates.tolerances import rounding_midpoint_distance

    bits = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32).to(
        torch.int16 if dtype.itemsize == 2 else torch.uint8
    )
    grid = bits.view(dtype).double()
    grid = torch.unique(grid[torch.isfinite(grid) & (grid >= 0)])
    midpoints = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    tiny = torch.finfo(dtype).tiny
    p = torch.cat(
        [
            torch.exp2(torch.rand(4000, generator=gen, dtype=torch.float64) * 12 - 10),
            torch.exp2(torch.arange(-8.0, 3.0, dtype=torch.float64)),  # powers of two
            torch.rand(200, generator=gen, dtype=torch.float64) * tiny,  # subnormals
        ]
    )
    p = p[p < grid.max()]
    distance, ulp_share = rounding_midpoint_distance(p, dtype)
    true = (p.log2()[:, None] - midpoints.log2()[None, :]).abs().amin(-1)
    assert torch.allclose(distance, true, rtol=1e-9, atol=0.0)
    step = (grid[torch.searchsorted(grid, p, right=True)] - grid[torch.searchsorted(grid, p, right=True) - 1]) / p
    assert (ulp_share >= step * (1 - 1e-12)).all()  # one rounding step relative to p, never under-counted


# --- two-level P V accumulation (Note [Two-level P V accumulation bound]) --------------------------------------


def _long_rows(keys: int, rows: int = 4, v_mean: float = 1.0, seed: int = 21, head_dim: int = 128):
    """The H200 accuracy study's adversarial rows (studies/fp8_accumulator): diffuse attention (q, k ~ 0.35
    N(0, 1)) over V of mean 1, so O ~ 1 is large against each tile's share of it; e4m3."""
    gen = torch.Generator().manual_seed(seed)
    q = 0.35 * torch.randn(1, rows, 1, head_dim, generator=gen)
    k = 0.35 * torch.randn(1, keys, 1, head_dim, generator=gen)
    v = torch.randn(1, keys, 1, head_dim, generator=gen) + v_mean
    return [t.to(torch.float8_e4m3fn) for t in (q, k, v)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode, causal", [("exact", False), ("rowmax_h15", True)])
def test_two_level_bound_covers_two_level_accumulation_and_not_single_level(mode, causal):
    """The reference with Hopper's accumulation in both GEMMs (its emulated accumulator, 13 bits) and two-level P V
    stays within the two-level `fp8_kernel_bounds` of the stock reference on long diffuse rows over V of mean 1;
    the same with single-level P V (O the wgmma's accumulator input) leaves that bound on every row (the H200's
    FA3-FP8 loses 10 % of O at 8K keys; here 1.7-3.1 times the bound) and stays within the single-level one. (H15's
    two-level error is 0 here: the tile sums' truncation stays below the BF16 output's rounding.)"""
    from fa4_rowmax.config import FP8_MAX_OFFSET
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds

    q, k, v = _long_rows(keys=8192, rows=2, head_dim=64)
    config = SoftmaxConfig(mode=mode, max_offset=FP8_MAX_OFFSET, tile_n=128)
    ref_out, ref_lse = attention_reference(q, k, v, config, causal=causal)
    errors = {}
    for promotion in ("tile", "none"):
        emulated = dataclasses.replace(config, accumulator_mantissa_bits=13, accumulator_promotion=promotion)
        if mode == "rowmax_h15":  # P V alone: the score GEMM's truncation is tested above; this keeps it brief
            emulated = dataclasses.replace(emulated, accumulator_gemms="pv")
        out, lse = attention_reference(q, k, v, emulated, causal=causal)
        errors[promotion] = (out.float() - ref_out.float()).abs().amax(-1, keepdim=True), (lse - ref_lse).abs()
    bounds = {s: fp8_kernel_bounds(q, k, v, config, causal, pv_accumulation=s) for s in ("two_level", "single")}
    two_out, two_lse = bounds["two_level"]
    assert (errors["tile"][0] <= two_out).all() and (errors["tile"][1] <= two_lse).all()
    assert (errors["none"][0] > 1.2 * two_out).all()
    assert (errors["none"][0] <= bounds["single"][0]).all() and (errors["none"][1] <= bounds["single"][1]).all()
    assert float(two_out.max()) < float(bounds["single"][0].min()) / 4


def _promoted_sums(p: torch.Tensor, factors: torch.Tensor, tile_n: int, two_level: bool) -> torch.Tensor:
    """sum_j p_j (a ones column: the MMA row sum) through the emulated e4m3 wgmma, tile by tile with each tile's
    rescale factor (c_t <= 1) applied to what came before: single-level (the sum the accumulator input, scaled
    in fp32) or two-level (fresh per tile, promoted by the exactly rounded FFMA)."""
    from fa4_rowmax.reference.mma_accumulator import emulated_matmul, fma_fp32

    ones = torch.ones(1, tile_n)
    total = torch.zeros(p.shape[0], 1)
    for t, c in zip(range(0, p.shape[1], tile_n), factors):
        tile = p[:, t : t + tile_n]
        if two_level:
            total = fma_fp32(total, c, emulated_matmul(tile, ones[:, : tile.shape[1]], 13, -6, -6))
        else:
            total = emulated_matmul(tile, ones[:, : tile.shape[1]], 13, -6, -6, c=total * c)
    return total[:, 0]


@pytest.mark.usefixtures("one_thread")
def test_fp8_pv_sum_error_covers_the_mma_row_sum_of_both_schemes():
    """`fp8_pv_sum_error` on a ones column (the MMA row sum): e4m3 weights of a diffuse row (2^8 down to 2^6, FA4's
    max_offset 8), 8,192 keys, each tile's factor c_t <= 1: two-level within its per-tile bound, single-level
    within its own and past the two-level one (the sum swamps each tile's weights)."""
    from fa4_rowmax.gates.tolerances import fp8_pv_sum_error

    gen = torch.Generator().manual_seed(4)
    keys, tile_n = 8192, 128
    p = torch.exp2(8 - 2 * torch.rand(3, keys, generator=gen)).to(torch.float8_e4m3fn).float()
    factors = torch.exp2(-0.01 * torch.rand(keys // tile_n, generator=gen))
    factors[-1] = 1.0
    later = torch.cat([torch.flip(torch.cumprod(torch.flip(factors[1:], [0]), 0), [0]), torch.ones(1)])
    exact = (p.double().view(3, -1, tile_n).sum(-1) * later.double()).sum(-1)
    relative = {
        two: ((_promoted_sums(p, factors, tile_n, two).double() - exact).abs() / exact) for two in (True, False)
    }
    two_level = fp8_pv_sum_error(keys, "two_level", tile_n)
    assert (relative[True] <= two_level).all()
    assert (relative[False] <= fp8_pv_sum_error(keys, "single", tile_n)).all()
    assert (relative[False] > 4 * two_level).all()
    assert fp8_pv_sum_error(128 * keys, "two_level", tile_n) < 1.05 * two_level  # flat in the keys (1M here)


def test_fp8_kernel_bounds_default_is_single_level_and_refuses_other_schemes():
    from fa4_rowmax.config import FP8_MAX_OFFSET
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds, fp8_pv_sum_error

    q, k, v = _long_rows(keys=300, rows=3)
    config = SoftmaxConfig(mode="exact", max_offset=FP8_MAX_OFFSET, tile_n=128)
    default = fp8_kernel_bounds(q, k, v, config, True, None, True)
    single = fp8_kernel_bounds(q, k, v, config, True, None, True, pv_accumulation="single")
    two = fp8_kernel_bounds(q, k, v, config, True, None, True, pv_accumulation="two_level")
    assert all(torch.equal(a, b) for a, b in zip(default, single))
    assert not torch.equal(default[0], two[0])
    with pytest.raises(ValueError, match=r"pv_accumulation must be one of \('single', 'two_level'\), got 'tile'"):
        fp8_kernel_bounds(q, k, v, config, True, pv_accumulation="tile")
    with pytest.raises(ValueError, match="pv_accumulation must be one of"):
        fp8_pv_sum_error(300, "two-level", 128)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_two_level_bounds_cover_hopper_accumulation_with_gqa_causal_and_descales(mode):
    """The GPU tests' kind in small (GQA 7, causal, descales, N(0, 1) e4m3): the reference with both GEMMs by
    Hopper's rule and two-level P V stays within the two-level bounds of the stock reference, out and LSE."""
    from fa4_rowmax.config import FP8_MAX_OFFSET
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds

    gen = torch.Generator().manual_seed(12)
    q, k, v = (
        torch.randn(1, n, h, 128, generator=gen).to(torch.float8_e4m3fn) for n, h in ((300, 14), (300, 2), (300, 2))
    )
    dq, dk, dv = (torch.rand(1, 2, generator=gen) + 0.5 for _ in range(3))
    config = SoftmaxConfig(mode=mode, max_offset=FP8_MAX_OFFSET, tile_n=128)
    kw = dict(causal=True, q_descale=dq, k_descale=dk, v_descale=dv)
    ref_out, ref_lse = attention_reference(q, k, v, config, **kw)
    emulated = dataclasses.replace(config, accumulator_mantissa_bits=13, accumulator_promotion="tile")
    out, lse = attention_reference(q, k, v, emulated, **kw)
    out_bound, lse_bound = fp8_kernel_bounds(q, k, v, config, True, [dq, dk, dv], pv_accumulation="two_level")
    assert ((lse - ref_lse).abs() <= lse_bound).all()
    assert ((out.float() - ref_out.float()).abs().amax(-1, keepdim=True) <= out_bound).all()
