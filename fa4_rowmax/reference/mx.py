"""OCP Microscaling (MX) block quantization in pure PyTorch (CPU and CUDA).

An MX tensor holds, for every block of 32 consecutive elements along one dimension, one shared
power-of-two scale (E8M0: an 8-bit biased exponent, bias 127, 0xFF = NaN) and 32 small floats
(the elements). ``value = element * 2 ** (scale - 127)``.

Element formats (OCP MX v1.0): ``e4m3`` (MXFP8), ``e2m3`` (MXFP6), ``e2m1`` (MXFP4). None of them has
an infinity; ``e2m3`` and ``e2m1`` have no NaN either.

Note [RCEIL scale]
~~~~~~~~~~~~~~~~~~
The block scale is the smallest power of two that lets the block's largest magnitude fit the
element format without saturating::

    descale = fp32(amax / max_normal)        # one rounded fp32 division
    scale_exponent = ceil(log2(descale))     # computed exactly, from the bits of descale

so every ``|x| * 2**-scale_exponent <= max_normal``. This is "RCEIL": the rule of AITER's MX
quantizers (``exponent = ceil(log2(amax / fp8_max))``), of NVIDIA's ``cvt.rp.satfinite.ue8m0x2.f32``
and of torchao 0.18.0's ``ScaleCalculationMode.RCEIL``. The OCP spec's own example rule (torchao's
FLOOR) takes ``floor(log2(amax)) - emax_elem`` and clamps the elements that overflow.

Differences from torchao 0.18.0's eager RCEIL (``torchao.prototype.mx_formats.mx_tensor._to_mx_rceil``),
which we are otherwise bit-equal to (tests/test_mx.py):
- torchao takes ``ceil(torch.log2(descale))`` in fp32. For ``descale = 2**k * (1 + a few ulp)`` with
  ``|k| >= 4`` the fp32 log2 rounds to exactly ``k`` and torchao picks ``2**k``; its elements then
  exceed ``max_normal`` by a few fp32 ulp and are clamped. We take the exponent from the bits, so we
  pick ``2**(k+1)`` (what the hardware conversion does). GPU ``log2`` is approximate, so AITER's
  Triton quantizers can differ from both in the same corner.
- A block with ``descale <= 2**-127`` (``amax <= max_normal * 2**-127``, only reachable from fp32
  or fp64 data) gets scale byte 0 in both, but torchao divides the elements by 1.0 instead of
  ``2**-127`` (TransformerEngine's convention) and so flushes them to zero; we divide by ``2**-127``.
- Some AITER quantizers floor ``amax`` at 1e-4 (so tiny blocks share one scale); we do not.

Note [Element rounding]
~~~~~~~~~~~~~~~~~~~~~~~
Elements are rounded to nearest, ties to even, in the element format's own grid (normals and
subnormals), after a saturating clamp to ``±max_normal``. The sign of zero is kept (``-0.0``
stays ``-0.0``, as a hardware cast does). ml_dtypes' casts are the independent oracle.

Note [Special values]
~~~~~~~~~~~~~~~~~~~~~
A block that holds a NaN or an infinity gets scale byte 0xFF (E8M0 NaN), and all of its elements
are NaN; it dequantizes to NaN. MX cannot hold an infinity, and saturating it to a finite number
(what torchao does for inf: scale 2**127) would hide the overflow. Zeros and values too small
for the element grid at the block's scale round to (signed) zero. A block of zeros gets scale
byte 0 (2**-127).

Note [Padding]
~~~~~~~~~~~~~~
When the quantized dimension is not a multiple of the block size, the last block is padded with
zeros (they change no block maximum) and the padding is cut off again: ``elements`` has ``x``'s
shape and ``scale`` has ``ceil(n / block)`` entries along ``dim``.
"""

from dataclasses import dataclass

import torch

__all__ = [
    "ElementFormat",
    "ELEMENT_FORMATS",
    "E8M0_BIAS",
    "E8M0_NAN",
    "MX_BLOCK",
    "element_format",
    "exact_pow2",
    "round_to_element",
    "rceil_scale_exponent",
    "quantize_mx",
    "dequantize_mx",
    "fake_quantize_mx",
]

E8M0_BIAS = 127
E8M0_NAN = 255
MX_BLOCK = 32


@dataclass(frozen=True)
class ElementFormat:
    """One MX element format: a sign, ``exponent_bits``, ``mantissa_bits``, no infinity."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    max_normal: float
    min_normal_exponent: int  # unbiased exponent of the smallest normal (1 - bias)


ELEMENT_FORMATS = {
    "e4m3": ElementFormat("e4m3", 4, 3, 448.0, -6),
    "e2m3": ElementFormat("e2m3", 2, 3, 7.5, 0),
    "e2m1": ElementFormat("e2m1", 2, 1, 6.0, 0),
}

_WORK_DTYPES = (torch.float32, torch.float64)
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def element_format(fmt: str) -> ElementFormat:
    """The ``ElementFormat`` named ``fmt`` (``"e4m3"``, ``"e2m3"`` or ``"e2m1"``)."""
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a str, one of {sorted(ELEMENT_FORMATS)}; got {type(fmt).__name__}")
    if fmt not in ELEMENT_FORMATS:
        raise ValueError(f"fmt must be one of {sorted(ELEMENT_FORMATS)}; got {fmt!r}")
    return ELEMENT_FORMATS[fmt]


def exact_pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**exponent, built from the bits (no libm call), exact over the normal and subnormal range."""
    if dtype == torch.float32:
        mantissa_bits, bias, int_dtype = 23, 127, torch.int32
    else:
        mantissa_bits, bias, int_dtype = 52, 1023, torch.int64
    e = exponent.to(int_dtype)
    normal = ((e + bias).clamp(min=1) << mantissa_bits).view(dtype)
    subnormal = (torch.ones_like(e) << (e + bias - 1 + mantissa_bits).clamp(min=0, max=mantissa_bits - 1)).view(dtype)
    return torch.where(e >= 1 - bias, normal, subnormal)


def round_to_element(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round ``v`` (float32/float64) to the nearest value of element format ``fmt``, ties to even,
    saturating at ``±max_normal``. NaN stays NaN. See Note [Element rounding]."""
    spec = element_format(fmt)
    if v.dtype not in _WORK_DTYPES:
        raise TypeError(f"v must be float32 or float64; got {v.dtype}")
    v = v.clamp(-spec.max_normal, spec.max_normal)
    _, frexp_exponent = torch.frexp(v)  # |v| = m * 2**e, m in [0.5, 1): floor(log2|v|) = e - 1
    exponent = (frexp_exponent - 1).clamp(min=spec.min_normal_exponent)
    quantum = exact_pow2(exponent - spec.mantissa_bits, v.dtype)
    return torch.round(v / quantum) * quantum  # torch.round: half to even; both scalings are exact


def rceil_scale_exponent(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """Unbiased E8M0 exponent (int32, in [-127, 127]) for blocks whose largest magnitude is ``amax``.
    Non-finite ``amax`` is not handled here (see ``quantize_mx``). See Note [RCEIL scale]."""
    spec = element_format(fmt)
    descale = amax / spec.max_normal
    mantissa, frexp_exponent = torch.frexp(descale)
    ceil_log2 = torch.where(mantissa == 0.5, frexp_exponent - 1, frexp_exponent)
    ceil_log2 = torch.where(descale == 0, torch.full_like(ceil_log2, -E8M0_BIAS), ceil_log2)
    return ceil_log2.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def _check_block_dim(x: torch.Tensor, block: int, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must have one of the dtypes {_INPUT_DTYPES}; got {x.dtype}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int (MX uses {MX_BLOCK}); got {block!r}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim() - 1}]; got {dim!r}")
    return dim % x.dim()


def quantize_mx(x: torch.Tensor, fmt: str, block: int = MX_BLOCK, dim: int = -1):
    """Quantize ``x`` to MX format ``fmt`` in blocks of ``block`` consecutive elements along ``dim``.

    Returns ``(scale, elements)``: ``scale`` is uint8 (biased E8M0) with ``ceil(n / block)`` entries
    along ``dim``; ``elements`` has ``x``'s shape, float32 (float64 for float64 ``x``), every value on
    the element grid of ``fmt``. Notes: [RCEIL scale], [Element rounding], [Special values], [Padding].
    """
    spec = element_format(fmt)
    dim = _check_block_dim(x, block, dim)
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    moved = x.to(work_dtype).movedim(dim, -1)
    n = moved.shape[-1]
    num_blocks = -(-n // block)
    padded = torch.nn.functional.pad(moved, (0, num_blocks * block - n))
    blocks = padded.reshape(*moved.shape[:-1], num_blocks, block)

    amax = blocks.abs().amax(dim=-1, keepdim=True)  # NaN if the block holds a NaN
    finite = torch.isfinite(amax)
    exponent = rceil_scale_exponent(torch.where(finite, amax, torch.zeros_like(amax)), fmt)
    elements = round_to_element(blocks * exact_pow2(-exponent, work_dtype), spec.name)
    elements = torch.where(finite, elements, torch.full_like(elements, float("nan")))
    scale = torch.where(finite, exponent + E8M0_BIAS, torch.full_like(exponent, E8M0_NAN)).to(torch.uint8)

    elements = elements.reshape(padded.shape)[..., :n].movedim(-1, dim)
    scale = scale.squeeze(-1).movedim(-1, dim)
    return scale, elements


def dequantize_mx(
    scale: torch.Tensor,
    elements: torch.Tensor,
    block: int = MX_BLOCK,
    dim: int = -1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``elements * 2 ** (scale - 127)`` broadcast over the blocks of ``block`` along ``dim``, in
    ``dtype``. Scale byte 0xFF gives NaN."""
    dim = _check_block_dim(elements, block, dim)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
        raise TypeError(f"scale must be a uint8 torch.Tensor (biased E8M0); got {getattr(scale, 'dtype', type(scale))}")
    n = elements.shape[dim]
    expected = list(elements.shape)
    expected[dim] = -(-n // block)
    if list(scale.shape) != expected:
        raise ValueError(
            f"scale must have shape {tuple(expected)} for elements {tuple(elements.shape)}; got {tuple(scale.shape)}"
        )
    work_dtype = torch.float64 if elements.dtype == torch.float64 else torch.float32
    factor = exact_pow2(scale.to(torch.int32) - E8M0_BIAS, work_dtype)
    factor = torch.where(scale == E8M0_NAN, torch.full_like(factor, float("nan")), factor)
    factor = factor.repeat_interleave(block, dim=dim).narrow(dim, 0, n)
    return (elements.to(work_dtype) * factor).to(dtype)


def fake_quantize_mx(x: torch.Tensor, fmt: str, block: int = MX_BLOCK, dim: int = -1) -> torch.Tensor:
    """Round trip through MX format ``fmt``: ``dequantize_mx(*quantize_mx(x, ...))`` in ``x``'s dtype."""
    scale, elements = quantize_mx(x, fmt, block, dim)
    return dequantize_mx(scale, elements, block, dim, dtype=x.dtype)
