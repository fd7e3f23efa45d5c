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
value is exact in each of them). Rounding is done in float32 (float64 for float64 input)
where every step is exact, so no double rounding occurs.
"""

import torch

HIF8_MAX = 2.0**15
HIF8_MIN_EXPONENT = -22
HIF8_MAX_EXPONENT = 15
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _mantissa_width(exponent: torch.Tensor) -> torch.Tensor:
    """Stored mantissa bits for 2^exponent * 1.f (Note [HiF8 grid and rounding]).

    Exponent -23 gets width -1: its quantum is 2^-22, the smallest denormal.
    """
    magnitude = exponent.abs()
    width = torch.where(magnitude <= 3, 3, torch.where(magnitude <= 7, 2, 1))
    width = torch.where(exponent < -15, 0, width)
    return torch.where(exponent < HIF8_MIN_EXPONENT, -1, width)


def round_to_hif8(x: torch.Tensor) -> torch.Tensor:
    """Round every element of `x` to the nearest HiF8 value (ties away from zero)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"x must have one of the dtypes {_SUPPORTED_DTYPES}, got {x.dtype}")
    work = x if x.dtype == torch.float64 else x.float()
    # |x| = fraction * 2^binade_exponent with fraction in [0.5, 1): e = binade_exponent - 1.
    fraction, binade_exponent = torch.frexp(work.abs())
    exponent = binade_exponent - 1
    width = _mantissa_width(exponent)
    # |x| / q lies in [2^width, 2^(width+1)); + 1/2 then floor is round-half-away.
    scaled = torch.ldexp(fraction, width + 1)
    magnitude = torch.ldexp(torch.floor(scaled + 0.5), exponent - width)
    magnitude = torch.where(magnitude > HIF8_MAX, torch.full_like(magnitude, float("inf")), magnitude)
    # Below 2^-23 the answer is 0; done apart because floor(scaled + 0.5) could round up to 1
    # when scaled sits within an ulp of 1/2.
    magnitude = torch.where(exponent < HIF8_MIN_EXPONENT - 1, torch.zeros_like(magnitude), magnitude)
    # +0.0 turns a negative zero into +0 (HiF8 has one zero).
    rounded = torch.copysign(magnitude, work) + 0.0
    rounded = torch.where(torch.isinf(work), work, rounded)
    rounded = torch.where(torch.isnan(work), work, rounded)
    return rounded.to(x.dtype)
