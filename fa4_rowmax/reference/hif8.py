"""HiF8 (Ascend HiFloat8) emulated by rounding: values snapped to the HiF8 grid, kept in a wide dtype.

Note [HiF8 grid and rounding]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
HiF8 (Luo et al. 2024, arXiv 2409.16626) is an 8-bit tapered-precision float: a sign bit,
a prefix-coded "dot" field that says how many exponent bits follow (sign-magnitude
exponent with an implicit leading magnitude bit), then the mantissa. For a value
2^e * 1.f the stored mantissa width is
    |e| in [0, 3]  -> 3 bits          |e| in [4, 7]  -> 2 bits
    |e| in [8, 15] -> 1 bit           e in [-22, -16] -> 0 bits (denormal mode: 2^e only)
so the finite magnitudes are 2^-22 .. 2^15 = 32768 (38 binades). 1.5 * 2^15 is the code
of infinity, so the largest finite value is 2^15. There is one zero (+0) and one NaN.

Conversion rounds to nearest with ties away from zero ("TA", the rounding the HiF8 paper
and Huawei's CANN conversion routines use), on the magnitude:
  - quantum q = 2^(e - width(e)) with e = floor(log2 |x|) taken before rounding, so a
    value that rounds up into the next binade lands on its power of two (exact);
  - |x| < 2^-23 (half the smallest denormal) gives +0; [2^-23, 2^-22) gives 2^-22;
  - a result above 2^15 (i.e. |x| >= 1.25 * 2^15) is +-inf, as is +-inf; NaN stays NaN.
The result keeps the input's dtype (float16, bfloat16, float32 or float64; every HiF8
value is exact in each of them).

Implementation: on the IEEE bits of float32 (float16/bfloat16 widen exactly) or float64.
With `drop = mantissa_bits - width(e)` low bits to remove, adding 2^(drop - 1) to the
magnitude bits and clearing the low `drop` bits is round-half-away on the magnitude; a
carry out of the mantissa bumps the exponent field, which is the correct next binade. For
e = -23 (width -1, the quantum above the value's own binade) the add carries into the
exponent and only the mantissa bits are cleared, giving 2^-22. Integer arithmetic only, so
no double rounding.
"""

import functools

import torch

HIF8_MAX = 2.0**15
HIF8_MIN_EXPONENT = -22
HIF8_MAX_EXPONENT = 15
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# dtype -> (same-width integer dtype, mantissa bits, exponent bias)
_IEEE_LAYOUT = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}
# Exponents covered by the width table: -23 (rounds to 2^-22 or below) .. 16 (overflows).
_TABLE_LOW, _TABLE_HIGH = HIF8_MIN_EXPONENT - 1, HIF8_MAX_EXPONENT + 1
# dtype -> the IEEE bits of HIF8_MAX and of +inf, as ints.
_MAX_AND_INF_BITS = {
    dtype: tuple(torch.tensor(value, dtype=dtype).view(int_dtype).item() for value in (HIF8_MAX, float("inf")))
    for dtype, (int_dtype, _, _) in _IEEE_LAYOUT.items()
}


@functools.cache
def _mantissa_width_table(int_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Stored mantissa bits of HiF8 for 2^e * 1.f, e = -23 .. 16 (Note [HiF8 grid and rounding]).

    e = -23 gets width -1: its quantum is 2^-22, the smallest denormal. Built once per dtype and
    device (a constant, read only).
    """
    exponent = torch.arange(_TABLE_LOW, _TABLE_HIGH + 1)
    magnitude = exponent.abs()
    width = torch.where(magnitude <= 3, 3, torch.where(magnitude <= 7, 2, 1))
    width = torch.where(exponent < -15, 0, width)
    width = torch.where(exponent == _TABLE_LOW, -1, width)
    return width.to(device=device, dtype=int_dtype)


def round_to_hif8(x: torch.Tensor) -> torch.Tensor:
    """Round every element of `x` to the nearest HiF8 value (ties away from zero)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"x must have one of the dtypes {_SUPPORTED_DTYPES}, got {x.dtype}")
    work = x if x.dtype in _IEEE_LAYOUT else x.float()
    int_dtype, mantissa_bits, bias = _IEEE_LAYOUT[work.dtype]
    bits = work.view(int_dtype)
    sign_bit = torch.iinfo(int_dtype).min
    magnitude = bits & ~sign_bit
    exponent = (magnitude >> mantissa_bits) - bias
    table = _mantissa_width_table(int_dtype, x.device)
    drop = mantissa_bits - table[exponent.clamp(_TABLE_LOW, _TABLE_HIGH) - _TABLE_LOW]
    one = torch.ones((), dtype=int_dtype, device=x.device)
    cleared = (one << drop.clamp(max=mantissa_bits)) - 1
    rounded = (magnitude + (one << (drop - 1))) & ~cleared
    rounded = torch.where(exponent < _TABLE_LOW, 0, rounded)
    max_bits, inf_bits = _MAX_AND_INF_BITS[work.dtype]
    rounded = torch.where(rounded > max_bits, inf_bits, rounded)
    # The sign goes back on everything but zero (HiF8 has one zero, +0).
    rounded = torch.where(rounded == 0, rounded, rounded | (bits & sign_bit))
    result = torch.where(torch.isnan(work), work, rounded.view(work.dtype))
    return result.to(x.dtype)
