import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import DEVICES

from fa4_rowmax.reference.exp_approx import h15, h15_bits, pot, q_half, schraudolph

ENVELOPE_LOW, ENVELOPE_HIGH = -0.25, math.log2(1.5) - 0.25  # 0.33496...
# x >= this keeps H a normal fp32 number, where the envelope holds.
NORMAL_RANGE_LOW = -126.25


def h15_oracle(x: np.ndarray) -> np.ndarray:
    """H in float64 numpy, independent of torch: n = round_half_even(2x) (exact in float64),
    H = 2^floor(n/2) * (1 + (n mod 2)/2), with the fp32 bit trick's underflow documented in
    exp_approx: 2^-127 for n = -253, 0 below."""
    x = x.astype(np.float64)
    n = np.round(2.0 * x)  # numpy rounds half to even
    with np.errstate(over="ignore", invalid="ignore"):
        h = np.ldexp(1.0 + np.mod(n, 2.0) / 2.0, np.floor(n / 2.0).clip(-1000, 1000).astype(np.int64))
    h = np.where(n == -253, 2.0**-127, h)
    h = np.where(n < -253, 0.0, h)
    h = np.where(x == np.inf, np.inf, h)
    h = np.where(np.isnan(x), np.nan, h)
    with np.errstate(over="ignore"):
        return h.astype(np.float32)


def h15_fraction(x: float) -> float:
    """One value by exact rational arithmetic (Python's round() on a Fraction is half-even)."""
    n = round(2 * Fraction(x))
    if n < -253:
        return 0.0
    if n == -253:
        return 2.0**-127
    value = Fraction(2) ** (n // 2) * (1 + Fraction(n % 2, 2))
    return float(np.float32(float(value))) if n < 256 else math.inf


def boundary_sweep(steps: int = 48) -> torch.Tensor:
    """fp32 neighbours of every rounding boundary k/2 + 1/4 in [-130, 10], plus the clamps."""
    boundaries = [k / 2 + 0.25 for k in range(-261, 20)] + [-127.0, -126.75, -126.25, -126.0]
    centre = torch.tensor(boundaries, dtype=torch.float32)
    points = [centre]
    up, down = centre.clone(), centre.clone()
    for _ in range(steps):
        up = torch.nextafter(up, torch.full_like(up, math.inf))
        down = torch.nextafter(down, torch.full_like(down, -math.inf))
        points += [up, down]
    return torch.cat(points)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def test_h15_bits_matches_closed_form_bit_for_bit_around_every_boundary():
    x = boundary_sweep()
    assert torch.equal(bits(h15_bits(x)), bits(h15(x)))
    expected = torch.from_numpy(h15_oracle(x.numpy()))
    assert torch.equal(bits(h15(x)), bits(expected))


def test_h15_closed_form_matches_exact_rationals_on_the_boundaries():
    x = boundary_sweep(steps=2)
    got = h15(x).tolist()
    for value, h in zip(x.tolist(), got):
        assert h == h15_fraction(value), value


def test_h15_dense_sweep_and_specials():
    generator = torch.Generator().manual_seed(0)
    dense = torch.linspace(-130.0, 10.0, 1_000_003)
    random = torch.rand(200_000, generator=generator) * 280.0 - 140.0
    specials = torch.tensor(
        [-math.inf, math.inf, math.nan, 0.0, -0.0, -127.0, -127.25, -1e30, 1e30, 127.5, 127.75, 128.0, 300.0]
    )
    x = torch.cat([dense, random, specials])
    got_bits, got_closed = h15_bits(x), h15(x)
    same = bits(got_bits) == bits(got_closed)
    both_nan = torch.isnan(got_bits) & torch.isnan(got_closed)
    assert bool((same | both_nan).all())
    expected = torch.from_numpy(h15_oracle(x.numpy()))
    assert bool(((bits(got_closed) == bits(expected)) | both_nan).all())
    # Masked scores (-inf) and everything below -126.75 give exactly +0; the top saturates to inf.
    assert h15_bits(torch.tensor([-math.inf, -126.76, -1e30])).tolist() == [0.0, 0.0, 0.0]
    assert h15_bits(torch.tensor([127.75, math.inf])).tolist() == [math.inf, math.inf]
    assert math.isnan(h15_bits(torch.tensor([math.nan])).item())


def test_every_h15_value_has_one_mantissa_bit_and_is_exact_in_16_bit_types():
    x = torch.linspace(-14.0, 15.0, 100_001)
    h = h15(x)
    mantissa = bits(h) & 0x7FFFFF
    assert bool(((mantissa == 0) | (mantissa == 1 << 22)).all())
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e5m2):
        assert torch.equal(h.to(dtype).float(), h)


def test_q_half_rounds_to_nearest_half_with_ties_to_even():
    x = torch.tensor([0.25, 0.75, -0.25, -0.75, 1.25, 1.2500001, 0.2499999, -3.1])
    expected = [0.0, 1.0, 0.0, -1.0, 1.0, 1.5, 0.0, -3.0]
    assert q_half(x).tolist() == expected


def test_schraudolph_matches_exact_rationals():
    generator = torch.Generator().manual_seed(1)
    y = torch.cat([torch.randn(2000, generator=generator) * 20, torch.arange(-140.0, 120.0, 0.125)])
    got = schraudolph(y).tolist()
    for value, s in zip(y.tolist(), got):
        floor = math.floor(value)
        exact = Fraction(2) ** floor * (1 + Fraction(value) - floor)
        assert s == float(np.float32(float(exact))), value
    assert schraudolph(torch.tensor([-math.inf, math.inf])).tolist() == [0.0, math.inf]


@pytest.mark.parametrize("seed", range(3))
def test_envelope_per_element(seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(500_000, generator=generator) * (10.0 - NORMAL_RANGE_LOW) + NORMAL_RANGE_LOW
    error = torch.log2(h15(x).double()) - x.double()
    assert float(error.min()) >= ENVELOPE_LOW and float(error.max()) <= ENVELOPE_HIGH


def test_envelope_is_reached_at_the_boundaries():
    x = boundary_sweep(steps=1)
    x = x[x >= NORMAL_RANGE_LOW]
    error = torch.log2(h15(x).double()) - x.double()
    assert float(error.min()) >= ENVELOPE_LOW and float(error.max()) <= ENVELOPE_HIGH
    assert float(error.min()) == pytest.approx(ENVELOPE_LOW, abs=1e-5)
    assert float(error.max()) == pytest.approx(ENVELOPE_HIGH, abs=1e-5)


@pytest.mark.parametrize("k_max", [0, 5, 20, 126])
def test_pot_is_one_level_per_octave_and_clamps_at_k_max(k_max):
    generator = torch.Generator().manual_seed(k_max)
    x = torch.cat(
        [
            torch.rand(10_000, generator=generator) * -150.0,
            torch.arange(-30.0, 2.0, 0.5),
            torch.tensor([-math.inf, 0.0, 3.4]),
        ]
    )
    got = pot(x, k_max).double().numpy()
    exponent = np.maximum(-k_max, np.round(x.double().numpy()))  # round half to even
    assert np.array_equal(got, np.ldexp(1.0, exponent.astype(np.int64)))
    assert pot(torch.tensor([-math.inf]), k_max).item() == 2.0**-k_max


@pytest.mark.parametrize("function", [h15, h15_bits, q_half, schraudolph, lambda x: pot(x, 20)])
def test_float32_only(function):
    with pytest.raises(TypeError, match="float32"):
        function(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        function([0.0])


@pytest.mark.parametrize("k_max", [-1, 127, 2.0, True])
def test_pot_rejects_bad_k_max(k_max):
    with pytest.raises(ValueError, match=r"k_max must be an int in \[0, 126\]"):
        pot(torch.zeros(2), k_max)


@pytest.mark.parametrize("device", DEVICES)
def test_same_bits_on_every_device(device):
    x = torch.cat([boundary_sweep(steps=4), torch.linspace(-140.0, 140.0, 100_001)])
    for function in (h15_bits, h15, q_half, schraudolph, lambda v: pot(v, 20)):
        assert torch.equal(bits(function(x.to(device)).cpu()), bits(function(x)))
