"""fa4_rowmax.reference.mx against torchao 0.18.0 (RCEIL) and ml_dtypes 0.6.0 (element rounding)."""

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from fa4_rowmax.reference.mx import (
    E8M0_NAN,
    ELEMENT_FORMATS,
    dequantize_mx,
    fake_quantize_mx,
    quantize_mx,
    rceil_scale_exponent,
    round_to_element,
)

FORMATS = ["e4m3", "e2m3", "e2m1"]
ML_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e2m3": ml_dtypes.float6_e2m3fn, "e2m1": ml_dtypes.float4_e2m1fn}


def _torchao_rceil(x, fmt):
    """torchao's to_mx(..., RCEIL) as (uint8 scale, float32 element values)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f6_e2m3_unpacked_to_f32, unpack_uint4
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    elem_dtype = {"e4m3": torch.float8_e4m3fn, "e2m3": "fp6_e2m3", "e2m1": torch.float4_e2m1fn_x2}[fmt]
    scale, data = to_mx(x.contiguous(), elem_dtype, 32, ScaleCalculationMode.RCEIL)
    if fmt == "e4m3":
        elements = data.float()
    elif fmt == "e2m3":
        elements = f6_e2m3_unpacked_to_f32(data)
    else:
        elements = f4_unpacked_to_f32(unpack_uint4(data)).reshape(x.shape)
    return scale.view(torch.uint8), elements


def _bits(t):
    return t.float().contiguous().view(torch.int32)  # float32 bits: equal values *and* equal sign of zero


def _random_blocks(gen, rows, dtype):
    """Blocks at magnitudes from tiny to huge, with exact zeros, whole zero blocks and single spikes."""
    x = torch.randn(rows, 256, generator=gen, dtype=torch.float64)
    magnitude = 10.0 ** torch.randint(-30, 31, (rows, 8, 1), generator=gen).double()
    x = (x.reshape(rows, 8, 32) * magnitude).reshape(rows, 256)
    x[:, 32:64] = 0.0  # whole zero block
    x[::3, 70] = 0.0
    x[::5, 100] *= 1e4  # one spike per block
    x[1::4, 5] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bit_equal_to_torchao_rceil(fmt, dtype):
    gen = torch.Generator().manual_seed(1234 + FORMATS.index(fmt))
    x = _random_blocks(gen, 48, dtype)
    scale, elements = quantize_mx(x, fmt)
    scale_ao, elements_ao = _torchao_rceil(x, fmt)
    assert torch.equal(scale, scale_ao)
    assert torch.equal(_bits(elements), _bits(elements_ao))


@pytest.mark.parametrize("fmt", FORMATS)
def test_elements_match_ml_dtypes(fmt):
    gen = torch.Generator().manual_seed(99)
    x = _random_blocks(gen, 32, torch.float32)
    scale, elements = quantize_mx(x, fmt)
    exponent = scale.double() - 127.0
    scaled = x.double().reshape(32, 8, 32) * torch.exp2(-exponent).unsqueeze(-1)  # exact in float64
    oracle = scaled.numpy().astype(ML_DTYPES[fmt]).astype(np.float64)
    assert np.array_equal(elements.double().reshape(32, 8, 32).numpy(), oracle)
    assert np.array_equal(np.signbit(elements.numpy()).reshape(32, 8, 32), np.signbit(oracle))


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_to_element_ties_and_subnormals(fmt):
    """Every grid value, every midpoint (a tie) and its two neighbours, against ml_dtypes."""
    spec = ELEMENT_FORMATS[fmt]
    grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ML_DTYPES[fmt]).astype(np.float64)))
    grid = grid[np.isfinite(grid)]
    mids = (grid[1:] + grid[:-1]) / 2
    candidates = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    candidates = np.concatenate([candidates, -candidates]).astype(np.float32)
    ours = round_to_element(torch.from_numpy(candidates), fmt).numpy()
    oracle = candidates.astype(ML_DTYPES[fmt]).astype(np.float32)
    assert np.array_equal(ours, oracle)
    assert np.array_equal(np.signbit(ours), np.signbit(oracle))
    assert ours.max() == spec.max_normal


@pytest.mark.parametrize("fmt", FORMATS)
def test_rceil_never_saturates_and_is_tight(fmt):
    """Including amax a few ulp above max_normal * 2**k, where an fp32 log2 rounds down."""
    spec = ELEMENT_FORMATS[fmt]
    base = torch.tensor([spec.max_normal * 2.0**k for k in range(-100, 100, 7)], dtype=torch.float32)
    one_ulp_above = torch.nextafter(base, torch.tensor(float("inf")))
    random = torch.rand(200) * 10.0 ** torch.randint(-20, 20, (200,))
    amax = torch.cat([base, one_ulp_above, base * (1 + 2.0**-22), base * (1 + 2.0**-21), random])
    exponent = rceil_scale_exponent(amax, fmt).double()
    assert torch.all(amax.double() * torch.exp2(-exponent) <= spec.max_normal * (1 + 2.0**-23))
    assert torch.all(amax.double() * torch.exp2(-(exponent - 1)) > spec.max_normal * (1 - 2.0**-23))
    above = amax[len(base) : 2 * len(base)]  # a few ulp above the exact power of two: the next exponent
    assert torch.equal(rceil_scale_exponent(above, fmt), rceil_scale_exponent(base, fmt) + 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_blocks_round_trip(fmt):
    """Blocks below max_normal * 2**-127 get scale byte 0 and are still represented (torchao flushes
    them to zero; see Note [RCEIL scale])."""
    spec = ELEMENT_FORMATS[fmt]
    x = torch.randn(4, 32, dtype=torch.float64) * spec.max_normal * 2.0**-130
    scale, elements = quantize_mx(x, fmt)
    assert torch.all(scale == 0)
    rel = (dequantize_mx(scale, elements, dtype=torch.float64) - x).norm() / x.norm()
    assert rel < {"e4m3": 0.05, "e2m3": 0.1, "e2m1": 0.3}[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_on_gaussian(fmt):
    x = torch.randn(256, 512, dtype=torch.float32)
    rel = ((fake_quantize_mx(x, fmt) - x).norm() / x.norm()).item()
    expected = {"e4m3": 0.027, "e2m3": 0.028, "e2m1": 0.116}[fmt]
    assert abs(rel - expected) < 0.004


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_and_inf_poison_only_their_block(fmt):
    x = torch.randn(3, 96)
    x[0, 40] = float("nan")
    x[1, 90] = float("inf")
    x[2, 5] = -float("inf")
    scale, elements = quantize_mx(x, fmt)
    assert scale[0, 1] == E8M0_NAN and scale[1, 2] == E8M0_NAN and scale[2, 0] == E8M0_NAN
    assert torch.isnan(elements[0, 32:64]).all() and torch.isnan(elements[2, :32]).all()
    out = dequantize_mx(scale, elements)
    poisoned = torch.zeros(3, 3, dtype=torch.bool)
    poisoned[0, 1] = poisoned[1, 2] = poisoned[2, 0] = True
    assert torch.equal(torch.isnan(out).reshape(3, 3, 32).all(-1), poisoned)
    assert torch.equal(torch.isnan(out).reshape(3, 3, 32).any(-1), poisoned)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 31, 33, 50, 100])
def test_padding_and_dim(fmt, n):
    x = torch.randn(5, n, 7)
    scale, elements = quantize_mx(x, fmt, dim=1)
    assert scale.shape == (5, -(-n // 32), 7) and elements.shape == x.shape
    padded = torch.nn.functional.pad(x.transpose(1, 2), (0, -(-n // 32) * 32 - n))
    ref_scale, ref_elements = quantize_mx(padded, fmt)
    assert torch.equal(scale, ref_scale.transpose(1, 2))
    assert torch.equal(elements, ref_elements[..., :n].transpose(1, 2))
    assert torch.equal(fake_quantize_mx(x, fmt, dim=1), dequantize_mx(scale, elements, dim=1))


def test_fake_quantize_keeps_dtype_and_bf16_is_exact():
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    out = fake_quantize_mx(x, "e4m3")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.float(), fake_quantize_mx(x.float(), "e4m3"))  # dequantized values fit bf16


def test_bad_arguments():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="fmt"):
        quantize_mx(x, "e5m2")
    with pytest.raises(TypeError, match="fmt"):
        quantize_mx(x, 3)
    with pytest.raises(TypeError, match="dtype"):
        quantize_mx(x.to(torch.int32), "e4m3")
    with pytest.raises(ValueError, match="block"):
        quantize_mx(x, "e4m3", block=0)
    with pytest.raises(ValueError, match="dim"):
        quantize_mx(x, "e4m3", dim=2)
    scale, elements = quantize_mx(x, "e4m3")
    with pytest.raises(ValueError, match="scale"):
        dequantize_mx(scale[:, :0], elements)
    with pytest.raises(TypeError, match="scale"):
        dequantize_mx(scale.float(), elements)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_matches_cpu(fmt):
    x = _random_blocks(torch.Generator().manual_seed(7), 64, torch.float32)
    scale, elements = quantize_mx(x, fmt)
    scale_cuda, elements_cuda = quantize_mx(x.cuda(), fmt)
    assert torch.equal(scale, scale_cuda.cpu())
    assert torch.equal(_bits(elements), _bits(elements_cuda.cpu()))
