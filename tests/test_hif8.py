import math

import numpy as np
import pytest
import torch
from conftest import DEVICES

from fa4_rowmax.reference.hif8 import HIF8_MAX, round_to_hif8


def hif8_grid() -> np.ndarray:
    """Every positive finite HiF8 value, from the format table (Luo et al. 2024), in float64."""
    values = {2.0**e for e in range(-22, -15)}  # denormal mode: powers of two only
    for e in range(-15, 16):
        width = 3 if abs(e) <= 3 else 2 if abs(e) <= 7 else 1
        values.update(2.0**e * (1 + m / 2**width) for m in range(2**width))
    values.discard(1.5 * 2.0**15)  # that code is infinity
    return np.array(sorted(values))


GRID = hif8_grid()


def nearest_ties_away(x: np.ndarray) -> np.ndarray:
    """Brute force: the nearest grid value (0 and the infinity code 1.5 * 2^15 included), ties
    to the larger magnitude."""
    candidates = np.concatenate([[0.0], GRID, [1.5 * 2.0**15]])
    magnitude = np.abs(x)
    upper = np.clip(np.searchsorted(candidates, magnitude, side="left"), 1, len(candidates) - 1)
    lo, hi = candidates[upper - 1], candidates[upper]
    result = np.where(magnitude - lo < hi - magnitude, lo, hi)
    result = np.where(magnitude > candidates[-1], np.inf, result)
    result = np.where(result == candidates[-1], np.inf, result)
    return np.copysign(result, x) + 0.0


def test_grid_size_and_range():
    assert len(GRID) == 126 and GRID[0] == 2.0**-22 and GRID[-1] == HIF8_MAX == 32768.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_grid_values_are_fixed_points(dtype):
    values = torch.tensor(np.concatenate([GRID, -GRID, [0.0]]), dtype=torch.float64).to(dtype)
    rounded = round_to_hif8(values)
    assert rounded.dtype == dtype
    assert torch.equal(rounded, values)


def test_midpoints_round_away_from_zero_and_neighbours_to_nearest():
    candidates = np.concatenate([[0.0], GRID])
    midpoints = (candidates[:-1] + candidates[1:]) / 2
    x = torch.tensor(np.concatenate([midpoints, -midpoints]), dtype=torch.float64)
    got = round_to_hif8(x).numpy()
    assert np.array_equal(np.abs(got), np.concatenate([candidates[1:], candidates[1:]]))
    # Just below a midpoint goes down (float64 input: no double rounding through float32).
    below = torch.tensor(midpoints[1:] * (1 - 1e-12), dtype=torch.float64)
    assert np.array_equal(round_to_hif8(below).numpy(), candidates[1:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_values_against_brute_force(dtype):
    generator = torch.Generator().manual_seed(0)
    magnitude = torch.exp2(torch.rand(400_000, generator=generator, dtype=torch.float64) * 44.0 - 27.0)
    sign = torch.where(torch.rand(400_000, generator=generator) < 0.5, -1.0, 1.0).double()
    x = (magnitude * sign).to(dtype)
    expected = nearest_ties_away(x.double().numpy())
    assert np.array_equal(round_to_hif8(x).double().numpy(), expected)


def test_limits_and_specials():
    x = torch.tensor(
        [
            2.0**-23,
            2.0**-23 * (1 - 2**-20),
            2.0**-24,
            1.4 * 2.0**-20,
            1.5 * 2.0**-20,
            32768.0,
            40959.0,
            40960.0,
            1e30,
            -40960.0,
            -0.0,
            math.inf,
            -math.inf,
            math.nan,
        ],
        dtype=torch.float32,
    )
    got = round_to_hif8(x).tolist()
    assert got[:13] == [
        2.0**-22,
        0.0,
        0.0,
        2.0**-20,
        2.0**-19,
        32768.0,
        32768.0,
        math.inf,
        math.inf,
        -math.inf,
        0.0,
        math.inf,
        -math.inf,
    ]
    assert math.copysign(1.0, got[10]) == 1.0  # one zero: +0
    assert math.isnan(got[13])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_subnormal_inputs_and_negative_ties(dtype):
    x = torch.tensor([1e-45, -1e-40, -(2.0**-23), -1.0625, -17.5, -18.0], dtype=dtype)
    assert round_to_hif8(x).tolist() == [0.0, 0.0, -(2.0**-22), -1.125, -16.0, -20.0]


def test_rejects_non_float_input():
    with pytest.raises(TypeError, match="dtypes"):
        round_to_hif8(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        round_to_hif8(np.zeros(3))


@pytest.mark.parametrize("device", DEVICES)
def test_same_values_on_every_device(device):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=generator) * torch.exp2(torch.randn(200_000, generator=generator) * 10)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert torch.equal(round_to_hif8(x.to(dtype).to(device)).cpu(), round_to_hif8(x.to(dtype)))
