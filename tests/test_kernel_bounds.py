"""fa4_rowmax.gates.tolerances (Note [Kernel vs reference: lattice flips]) on the CPU: two implementations that
differ only in rounding (the reference in fp32 and in fp64) stay within the per-row bounds, the bounds are
tight enough that wrong implementations (another mode, another threshold, a swapped V row) break them."""

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
