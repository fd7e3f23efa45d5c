"""Element-wise exp2 approximations on float32 tensors: Rowmax-H15, Schraudolph, Rowmax-PoT.

Every function takes and returns float32 tensors of the same shape (any device). The
argument is an exponent in log2 units, normally `x - m` (the score minus the row max),
so values are <= 0 except under FA4's stale max (`rescale_threshold`).

Note [H15 definition]
~~~~~~~~~~~~~~~~~~~~~
H(x) = S(Q_half(x)): round x to the nearest half octave (ties to even), then evaluate
Schraudolph's piecewise-linear 2^y there. With n = round_half_even(2x),
H = 2^floor(n/2) * (1 + (n mod 2)/2): every weight is 2^k or 1.5 * 2^k, one mantissa bit,
exact in fp32, bf16, fp16, e5m2 and e4m3 (inside their ranges). Per element,
log2(H(x)) - x lies in [-1/4, log2(1.5) - 1/4 = 0.33496...], so two normalised weights of
one row are off by at most log2(1.5) = 0.585 octaves relative to each other.

Note [H15 fp32 bit trick and its clamp]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For x in [-127, 128], the fp32 sum x + 1.5 * 2^22 lies in [2^22, 2^23) where the ulp is 1/2,
so the add itself rounds x to the nearest half (ties to even) and leaves 2^22 + n in the
mantissa field. Shifting those bits left by 22 drops the exponent field and the 2^22 (both
fall off the top of 32 bits) and leaves n << 22; adding bits(1.0) = 254 << 22 gives
(n + 254) << 22, which is exactly the fp32 encoding of H whenever H is a normal number
(n >= -252, i.e. x >= -126.25). Below that the same bits underflow:
  - n = -253 (x in [-126.75, -126.25)) gives 2^-127, not H = 1.5 * 2^-127;
  - n = -254 (x <= -126.75 after the clamp at -127) gives +0.
The clamp at -127 is what keeps n + 254 >= 0, and it makes a masked score (x = -inf) come
out as exactly 0 with no separate select. The upper clamp at 128 makes x >= 127.75 give
+inf (n = 256 encodes inf) instead of a NaN pattern. `h15` (the closed form) is defined
with the same underflow so that the two are bit-identical everywhere; weights below
2^-126 of the max are far below any P dtype's resolution.

Note [H15 weights as e4m3 bytes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An FP8 kernel holds P in e4m3 and scales it by 2^max_offset, FA4's max_offset = 8 for FP8 inputs
(flash_fwd_sm100.py, Note [Low Precision Scaling]). Let n = round_half_even(2 (x - m)) be the half-octave
index of an element relative to the max in use (n <= 0, up to 1 under a stale max). The weight with the
offset is H = 2^k (1 + b/2) with 2k + b = n + 2 * 8, b in {0, 1}. A normal e4m3 number
2^k (1 + M/8) is the byte 8 (k + 7) + M; here M = 4b, so
    byte = 8k + 56 + 4b = 4 (2k + b) + 56 = 4 (n + 16) + 56 = 4n + 8 * (7 + 8),
linear in n, with no convert. e4m3 is normal for k >= -6 (2^-6), i.e. n >= -28: weights down to 2^-14
of the row max (2^8). At the top, n = 1 gives byte 124 (384); n >= 2 would give 128 and up, negative
codes, which FA4's range rule excludes (max_offset + rescale_threshold + H15's round-up log2(1.5) - 1/4
< log2(448)). Below n = -28 the formula gives codes 0..7, e4m3's subnormals m * 2^-9, which are not the
weights there (n = -29: code 4 = 2^-7, but H = 1.5 * 2^-7 = code 6), so the kernel clamps them to byte 0:
P = 0 below 2^-14 of the max. That flush is part of the method's definition (the semantic reference does
the same, attention.py Note [H15 with FP8 P]); each flushed weight is below 2^-6 while the row's largest
is at least 2^8, so a row of L keys loses at most L * 2^-14 of its top weight's mass.
"""

import torch

from fa4_rowmax.config import FP8_MAX_OFFSET

H15_CLAMP_LOW = -127.0
H15_CLAMP_HIGH = 128.0
# Smallest n = round_half_even(2x) for which H is a normal fp32 number (H = 2^-126).
_H15_MIN_NORMAL_N = -252
# Adding it to an fp32 in (-2**21, 2**21) rounds it to the nearest half, ties to even (ulp 0.5 in [2**22, 2**23)).
ROUND_TO_HALF_MAGIC = 1.5 * 2.0**22
_BITS_OF_ONE = 0x3F800000
# Note [H15 weights as e4m3 bytes]: e4m3's exponent bias, the linear range of n.
_E4M3_BIAS = 7
H15_E4M3_MIN_N = -2 * (FP8_MAX_OFFSET + 6)  # -28: 2^-6, e4m3's smallest normal, after the 2^8 offset
H15_E4M3_MAX_N = 1  # 1.5 * 2^8 = 384; n = 2 (512) is past e4m3's max 448


def _check_float32(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got dtype {x.dtype}")


def q_half(x: torch.Tensor) -> torch.Tensor:
    """Nearest half octave, ties to even: round_half_even(2x) / 2 (exact in fp32)."""
    _check_float32("x", x)
    return torch.round(x * 2.0) * 0.5


def schraudolph(y: torch.Tensor) -> torch.Tensor:
    """S(y) = 2^floor(y) * (1 + y - floor(y)), rounded once to float32.

    Evaluated in float64, where every step is exact for a float32 `y` that is not tiny,
    so the result is S(y) correctly rounded; S(-inf) = 0 and S(inf) = inf.
    """
    _check_float32("y", y)
    y64 = y.double()
    floor = torch.floor(y64)
    weight = torch.ldexp(1.0 + (y64 - floor), floor)
    # The limits 2^-inf = 0 and 2^inf = inf, where y - floor(y) is NaN.
    weight = torch.where(torch.isinf(y64), torch.exp2(y64), weight)
    return weight.float()


def h15(x: torch.Tensor) -> torch.Tensor:
    """Rowmax-H15 weight H(x) = S(Q_half(x)) in closed form (Note [H15 definition]).

    Below fp32's normal range it follows the bit trick's underflow (Note [H15 fp32 bit
    trick and its clamp]): 2^-127 for Q_half(x) = -126.5 and +0 below, so -inf gives 0.
    """
    _check_float32("x", x)
    y = q_half(x)
    n = y * 2.0
    weight = schraudolph(y)
    weight = torch.where(n == _H15_MIN_NORMAL_N - 1, torch.full_like(weight, 2.0**-127), weight)
    return torch.where(n < _H15_MIN_NORMAL_N - 1, torch.zeros_like(weight), weight)


def h15_bits(x: torch.Tensor) -> torch.Tensor:
    """H(x) built from fp32 bits, as a kernel does it (Note [H15 fp32 bit trick and its clamp]).

    bits(H) = (bits(clamp(x, -127, 128) + 1.5 * 2^22) << 22) + bits(1.0)  (mod 2^32).
    NaN stays NaN. Bit-identical to `h15`.
    """
    _check_float32("x", x)
    rounded = x.clamp(H15_CLAMP_LOW, H15_CLAMP_HIGH) + ROUND_TO_HALF_MAGIC
    # int32 arithmetic wraps mod 2^32 like the kernel's 32-bit integer ops.
    bits = (rounded.view(torch.int32) << 22) + _BITS_OF_ONE
    return torch.where(torch.isnan(x), x, bits.view(torch.float32))


def pot(x: torch.Tensor, k_max: int) -> torch.Tensor:
    """Rowmax-PoT weight 2^-min(k_max, round_half_even(-x)): one level per octave.

    `x` is the distance to the row max in log2 units; anything below -k_max - 1/2 (-inf
    included) is clamped to 2^-k_max, so a caller keeps masked elements at 0 itself.
    """
    _check_float32("x", x)
    if isinstance(k_max, bool) or not isinstance(k_max, int) or not 0 <= k_max <= 126:
        raise ValueError(f"k_max must be an int in [0, 126], got {k_max!r}")
    exponent = torch.clamp(torch.round(x), min=-float(k_max))
    return torch.ldexp(torch.ones_like(x), exponent)


def h15_e4m3_bytes(n: torch.Tensor) -> torch.Tensor:
    """The e4m3 byte (uint8) of the H15 weight with half-octave index `n` relative to the max in use,
    scaled by 2^FP8_MAX_OFFSET: `4n + 8 * (7 + 8)` for n in [-28, 1], 0 below (Note [H15 weights as e4m3 bytes]).

    `n` is an integer tensor (any device). An n above 1 raises ValueError: its weight exceeds e4m3's max
    448 (FA4's range rule keeps kernels from producing one).
    """
    if not isinstance(n, torch.Tensor):
        raise TypeError(f"n must be a torch.Tensor, got {type(n).__name__}")
    if n.dtype.is_floating_point or n.dtype.is_complex or n.dtype == torch.bool:
        raise TypeError(f"n must be an integer tensor (half-octave indices), got dtype {n.dtype}")
    if n.numel() and int(n.max()) > H15_E4M3_MAX_N:
        raise ValueError(
            f"n must be <= {H15_E4M3_MAX_N} (half-octave index relative to the max); got {int(n.max())}, whose "
            f"weight exceeds e4m3's max 448 after the 2^{FP8_MAX_OFFSET} offset"
        )
    n = n.to(torch.int32)
    linear = 4 * n + 8 * (_E4M3_BIAS + FP8_MAX_OFFSET)
    return torch.where(n >= H15_E4M3_MIN_N, linear, torch.zeros_like(linear)).to(torch.uint8)
