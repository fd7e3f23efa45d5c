"""MX quantization of the attention operands (Q, K, V) as Triton kernels, bit-exact to ``fa4_rowmax.reference.mx``.

The kernel in ``kernel.py`` takes its operands pre-quantized: e4m3-container elements and one E8M0 byte
per block of 32 along the reduction dim (Q and K along head_dim, V along keys, per sequence). Done with
``fa4_rowmax.reference.mx.quantize_mx`` in torch, that pre-pass is some 200 elementwise ops over fp32 copies of
the operands per call (about 58 GB of memory traffic at batch 4, seqlen 8K, 16 heads, head_dim 128:
Note [Cost of the pre-pass]); here it is one read of each BF16 operand and one write of its elements
and scales (about 0.6 GB at that shape).

``quantize_head_dim(x, fmt)``: x (tokens, heads, head_dim) -> (scale uint8 (tokens, heads, head_dim // 32),
elements float8_e4m3fn like x), the values ``quantize_mx(x, fmt, dim=-1)`` gives.
``quantize_keys(v, fmt, cu_seqlens_k, keys_contiguous=False)``: v (total_k, heads_k, head_dim) in blocks of
32 keys that restart at every sequence -> (elements, scale uint8 (blocks, heads_k, head_dim), cu_blocks
int32 (batch + 1)), each sequence's blocks the values ``quantize_mx(v[start:end], fmt, dim=0)`` gives.
``keys_contiguous=True`` writes the elements transposed (the FP8 dot's K-major V, Note [MX dots, per
architecture] in ``kernel.py``). ``pack_e2m1=True`` on either gives packed e2m1 codes instead (the
"scaled" dots at MXFP4, Note [Packed e2m1]). Neither reads GPU data back to the host (CUDA-graph capturable).

Note [Bit-exact to mx.py]
~~~~~~~~~~~~~~~~~~~~~~~~~
The scale is RCEIL from the bits of the block maximum and the elements are rounded to nearest even
by the ``1.5 * 2**23`` addition (``kernel.py``'s ``_rceil_exponent`` and ``_round_to_element``, see its
Note [Kernel rounding vs the reference]); for BF16 inputs both equal ``mx.py``'s division and frexp
route (tests/test_aiter_quantize.py checks random, tiny, huge, zero, subnormal, NaN and Inf blocks).
Two details ``_round_to_element`` leaves aside because P is never negative and never poisoned here:
the sign of a zero (a negative value that rounds to zero is -0, as in ``mx.py``: the input's sign bit
is put back) and non-finite inputs (a block holding a NaN or an infinity gets scale byte 255 and NaN
elements, mx.py's Note [Special values]). The element store converts exact e4m3 values: no rounding
happens in the conversion.

Note [Packed e2m1]
~~~~~~~~~~~~~~~~~
For the "scaled" dot mode at MXFP4 (gfx950's fp4 MFMA, ``kernel.py`` Note [MX dots, per architecture]),
``tl.dot_scaled`` takes e2m1 operands packed two to a byte along the reduction dim, the even element in
the low nibble (Triton's convention, ``triton.tools.mxfp``). Each code is sign << 3 | exponent << 1 |
mantissa, so the codes hold exactly the values ``mx.py`` rounds to (the tests unpack and compare). Q and
K pack along head_dim. V packs along keys, and its blocks of 32 keys restart at every sequence, so a pair
could straddle two sequences if rows followed the tokens: the packed V is laid out by block instead (16
rows a block, the last block's padding keys 0), and the kernel addresses it by ``cu_blocks``. e2m1 has no
NaN: in a poisoned block the scale byte 255 alone carries it (each code keeps only its sign).

Note [Cost of the pre-pass]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Counted on the CPU with a torch dispatch mode around the host part of ``fused_softmax_attention``
(kernel launch stubbed), batch 1, seqlen 8192, 16 heads, head_dim 128, ``dot_mode="fp8"``, with the
torch pre-pass this module replaces: 264 aten calls (207 not views), 8.13 GB read and 6.32 GB written,
no float64. Bytes scale with the tokens, so the H200 bench shape (batch 4) moves about 58 GB per call:
some 15-25 ms of HBM time at 2.5-4 TB/s, the same order as the ~27 ms by which the H200 run's causal
and non-causal timings put the per-call overhead of ``aiter_mxfp8`` (see ``kernel.py``, Note [Where
the time goes on Hopper]). Estimates, not GPU measurements.

Note [Prescaled Q]
~~~~~~~~~~~~~~~~~~
The attention kernel's ``exp_fold`` (``kernel.py`` Note [Folded Schraudolph]) takes Q quantized after a
prescale by ``128 c``, which is no power of two and so cannot ride in the E8M0 scale. ``quantize_head_dim``'s
``prescale`` multiplies the exact fp32 value of each BF16 element by it (one fp32 rounding, the reference's
``q.float() * prescale``) and quantizes that. A compile-time switch (``PRESCALED``): without it the kernel
is the one before, and no multiply by 1 can flush an fp32 subnormal where a GPU flushes them.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from aiter_fused.kernel import _rceil_exponent, _round_to_element
from fa4_rowmax.reference.mx import ELEMENT_FORMATS, MX_BLOCK, element_format

__all__ = ["check_fits_e4m3", "quantize_head_dim", "quantize_keys"]


@triton.jit
def _bf16_bits_to_fp32(bits):
    """BF16 values loaded as their int16 bits -> fp32, exactly (subnormals included). Triton's CPU
    interpreter (3.x) flushes BF16 subnormals in ``.to(tl.float32)``; on a GPU this is the same shift."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_codes(elements):
    """e2m1 grid values (fp32, sign kept) -> their 4-bit codes as int32: sign << 3 | exponent << 1 |
    mantissa (0.5 is the subnormal code 1). NaN gives a code of its sign: the block's scale byte 255
    carries the NaN (e2m1 has none)."""
    bits = elements.to(tl.int32, bitcast=True)
    magnitude = tl.abs(elements)
    normal = (((((bits >> 23) & 0xFF) - 127) + 1) << 1) | ((bits >> 22) & 1)  # 1 .. 6: exponent 0 .. 2
    code = tl.where(magnitude >= 1.0, normal, tl.where(magnitude == 0.5, 1, 0))
    return ((bits >> 28) & 8) | code


@triton.jit
def _quantize_block(
    x,
    AXIS: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MAX_MANTISSA_BITS: tl.constexpr,
    MAX_EXPONENT: tl.constexpr,
    E2M1_CODES: tl.constexpr,
):
    """MX-quantize fp32 ``x`` in blocks along ``AXIS`` (the block is that whole axis). Returns (the
    elements as e4m3 bytes (uint8), NaN in poisoned blocks, or with ``E2M1_CODES`` as e2m1 codes (int32,
    Note [Packed e2m1]); biased scale bytes as int32, 255 for poisoned blocks). Note [Bit-exact to mx.py]."""
    finite = tl.abs(x) < float("inf")  # False for NaN and +-Inf
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=AXIS)
    poisoned = tl.max((~finite).to(tl.int32), axis=AXIS) > 0
    exponent = _rceil_exponent(amax, MAX_MANTISSA_BITS, MAX_EXPONENT)
    # -exponent is in [-126, 127] for BF16 inputs (amax < 2**128), the range of the bit-built 2**n.
    factor = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    elements = _round_to_element(x * tl.expand_dims(factor, AXIS), MANTISSA, MIN_EXPONENT, MAX_NORMAL)
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000: the input's sign bit
    elements = (elements.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    if E2M1_CODES:
        element_bytes = _e2m1_codes(elements)
    else:
        # e4m3 bytes, NaN written as its byte (0x7F): the conversion is exact for grid values, but how it
        # treats a NaN differs between backends (Triton's interpreter saturates it).
        element_bytes = elements.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        element_bytes = tl.where(tl.expand_dims(poisoned, AXIS), 0x7F, element_bytes)
    return element_bytes, tl.where(poisoned, 255, exponent + 127)


@triton.jit
def _quantize_head_dim_kernel(
    X,
    Elements,
    Scale,
    tokens,
    stride_xt,
    stride_xh,
    stride_xd,
    stride_et,
    stride_eh,
    stride_st,
    stride_sh,
    prescale,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MAX_MANTISSA_BITS: tl.constexpr,
    MAX_EXPONENT: tl.constexpr,
    PACK_E2M1: tl.constexpr,
    PRESCALED: tl.constexpr,
):
    """One program: BLOCK_T tokens of one head, every MX block of their head_dim. With PRESCALED the fp32
    values are multiplied by ``prescale`` (fp32) before the quantization (Note [Prescaled Q])."""
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (offs_t < tokens)[:, None]
    rows = offs_t.to(tl.int64)[:, None]
    x = _bf16_bits_to_fp32(
        tl.load(X + rows * stride_xt + head * stride_xh + offs_d[None, :] * stride_xd, mask=ok, other=0)
    )
    if PRESCALED:
        x = x * prescale
    blocks = tl.reshape(x, (BLOCK_T, HEAD_DIM // 32, 32))
    elements, scale = _quantize_block(
        blocks, 2, MANTISSA, MIN_EXPONENT, MAX_NORMAL, MAX_MANTISSA_BITS, MAX_EXPONENT, PACK_E2M1
    )
    if PACK_E2M1:  # Note [Packed e2m1]: head_dim pairs in one byte
        low, high = tl.split(tl.reshape(elements, (BLOCK_T, HEAD_DIM // 2, 2)))
        tl.store(
            Elements + rows * stride_et + head * stride_eh + tl.arange(0, HEAD_DIM // 2)[None, :],
            (low | (high << 4)).to(tl.uint8),
            mask=ok,
        )
    else:
        elements = tl.reshape(elements, (BLOCK_T, HEAD_DIM))
        tl.store(Elements + rows * stride_et + head * stride_eh + offs_d[None, :], elements.to(tl.uint8), mask=ok)
    offs_s = tl.arange(0, HEAD_DIM // 32)
    tl.store(Scale + rows * stride_st + head * stride_sh + offs_s[None, :], scale.to(tl.uint8), mask=ok)


@triton.jit
def _quantize_keys_kernel(
    V,
    Elements,
    Scale,
    cu_seqlens,
    cu_blocks,
    seq_of_block,
    batch,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_et,
    stride_eh,
    stride_ed,
    stride_sb,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MAX_MANTISSA_BITS: tl.constexpr,
    MAX_EXPONENT: tl.constexpr,
    PACK_E2M1: tl.constexpr,
):
    """One program: one MX block (32 keys of one sequence) of one head, every head_dim lane. Blocks past
    the last sequence's (the grid is a bound, see ``quantize_keys``) return at once."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(seq_of_block + block)
    if seq >= batch:
        return
    key_end = tl.load(cu_seqlens + seq + 1)
    keys = tl.load(cu_seqlens + seq) + (block - tl.load(cu_blocks + seq)) * 32 + tl.arange(0, 32)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (keys < key_end)[:, None]
    rows = keys.to(tl.int64)[:, None]
    x = _bf16_bits_to_fp32(
        tl.load(V + rows * stride_vt + head * stride_vh + offs_d[None, :] * stride_vd, mask=ok, other=0)
    )
    elements, scale = _quantize_block(
        x, 0, MANTISSA, MIN_EXPONENT, MAX_NORMAL, MAX_MANTISSA_BITS, MAX_EXPONENT, PACK_E2M1
    )
    if PACK_E2M1:  # Note [Packed e2m1]: key pairs of the block in one byte, the whole block (padding: 0)
        pairs = tl.permute(tl.reshape(elements, (16, 2, HEAD_DIM)), (0, 2, 1))
        low, high = tl.split(pairs)
        packed_rows = (block * 16 + tl.arange(0, 16)).to(tl.int64)[:, None]
        tl.store(
            Elements + packed_rows * stride_et + head * stride_eh + offs_d[None, :] * stride_ed,
            (low | (high << 4)).to(tl.uint8),
        )
    else:
        tl.store(
            Elements + rows * stride_et + head * stride_eh + offs_d[None, :] * stride_ed, elements.to(tl.uint8), mask=ok
        )
    tl.store(Scale + block.to(tl.int64) * stride_sb + head * stride_sh + offs_d, scale.to(tl.uint8))


def check_fits_e4m3(fmt: str) -> None:
    """Every element of ``fmt`` must be an e4m3 value: the container the kernels store (and the FP8
    dots' operand type). True for e4m3, e2m3 and e2m1; checked so that a new format cannot slip through."""
    spec, e4m3 = element_format(fmt), ELEMENT_FORMATS["e4m3"]
    if (
        spec.mantissa_bits > e4m3.mantissa_bits
        or spec.max_normal > e4m3.max_normal
        or spec.min_normal_exponent - spec.mantissa_bits < e4m3.min_normal_exponent - e4m3.mantissa_bits
    ):
        raise ValueError(f"element format {fmt} does not fit the kernels' e4m3 container")


def _format_constants(fmt: str) -> dict:
    check_fits_e4m3(fmt)
    spec = element_format(fmt)
    max_bits = torch.tensor(spec.max_normal, dtype=torch.float32).view(torch.int32).item()
    return dict(
        MANTISSA=spec.mantissa_bits,
        MIN_EXPONENT=spec.min_normal_exponent,
        MAX_NORMAL=spec.max_normal,
        MAX_MANTISSA_BITS=max_bits & 0x7FFFFF,
        MAX_EXPONENT=((max_bits >> 23) & 0xFF) - 127,
    )


def _check_operand(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16; got {x.dtype}")
    if x.dim() != 3 or x.shape[-1] % MX_BLOCK or x.shape[-1] & (x.shape[-1] - 1):
        raise ValueError(
            f"{name} must be 3-D (tokens, heads, head_dim) with head_dim a power of two and a "
            f"multiple of {MX_BLOCK}; got shape {tuple(x.shape)}"
        )


def _check_pack(fmt: str, pack_e2m1) -> None:
    if not isinstance(pack_e2m1, bool):
        raise TypeError(f"pack_e2m1 must be a bool; got {type(pack_e2m1).__name__}")
    if pack_e2m1 and fmt != "e2m1":
        raise ValueError(f"pack_e2m1=True needs fmt='e2m1'; got fmt={fmt!r}")


def quantize_head_dim(x: torch.Tensor, fmt: str, pack_e2m1: bool = False, prescale: Optional[float] = None):
    """MX-quantize ``x`` (tokens, heads, head_dim), BF16, in blocks of 32 along head_dim. Returns
    ``(scale, elements)`` like ``quantize_mx(x, fmt, dim=-1)``: scale uint8 (tokens, heads, head_dim // 32),
    elements ``torch.float8_e4m3fn`` (every element format fits e4m3); with ``pack_e2m1=True`` (fmt
    e2m1) elements uint8 (tokens, heads, head_dim // 2), two codes a byte (Note [Packed e2m1]).
    ``prescale`` (a float exactly representable in fp32): quantize ``fl32(x * prescale)`` instead, the values
    ``quantize_mx(x.float() * prescale, fmt, dim=-1)`` gives (Note [Prescaled Q])."""
    _check_operand("x", x)
    _check_pack(fmt, pack_e2m1)
    if prescale is not None and (
        isinstance(prescale, bool)
        or not isinstance(prescale, (int, float))
        or not math.isfinite(prescale)
        or torch.tensor(prescale, dtype=torch.float32).item() != prescale
    ):
        raise ValueError(f"prescale must be None or a finite float exactly representable in fp32; got {prescale!r}")
    constants = _format_constants(fmt)
    tokens, heads, head_dim = x.shape
    if pack_e2m1:
        elements = torch.empty(tokens, heads, head_dim // 2, dtype=torch.uint8, device=x.device)
    else:
        elements = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(tokens, heads, head_dim // MX_BLOCK, dtype=torch.uint8, device=x.device)
    block_t = 16
    if tokens and heads:
        _quantize_head_dim_kernel[(triton.cdiv(tokens, block_t), heads)](
            x.view(torch.int16),
            elements.view(torch.uint8),
            scale,
            tokens,
            *x.stride(),
            elements.stride(0),
            elements.stride(1),
            scale.stride(0),
            scale.stride(1),
            1.0 if prescale is None else float(prescale),
            HEAD_DIM=head_dim,
            BLOCK_T=block_t,
            **constants,
            PACK_E2M1=pack_e2m1,
            PRESCALED=prescale is not None,
            num_warps=4,
        )
    return scale, elements


def quantize_keys(
    v: torch.Tensor, fmt: str, cu_seqlens_k: torch.Tensor, keys_contiguous: bool = False, pack_e2m1: bool = False
):
    """MX-quantize ``v`` (total_k, heads_k, head_dim), BF16, in blocks of 32 keys that restart at every
    sequence of ``cu_seqlens_k`` (int32, batch + 1, on v's device, assumed well formed).

    Returns ``(elements, scale, cu_blocks)``: elements ``torch.float8_e4m3fn`` shaped like v (with
    ``keys_contiguous=True`` a view of (heads_k, head_dim, keys) storage, keys padded to 16 so that the
    head_dim stride keeps 16-byte alignment); scale uint8 (blocks, heads_k, head_dim), sequence ``s``'s
    blocks at ``cu_blocks[s]:cu_blocks[s + 1]``. ``blocks`` is a bound known without reading
    ``cu_seqlens_k`` back (each sequence ends at most one partial block); the scale rows past
    ``cu_blocks[-1]`` are left unwritten and never read. ``pack_e2m1=True`` (fmt e2m1, not with
    ``keys_contiguous``): elements uint8 (blocks * 16, heads_k, head_dim), block ``b``'s key pairs in rows
    ``16 b .. 16 b + 15``, padding keys of a sequence's last block 0 (Note [Packed e2m1])."""
    _check_operand("v", v)
    _check_pack(fmt, pack_e2m1)
    if pack_e2m1 and keys_contiguous:
        raise ValueError("pack_e2m1=True and keys_contiguous=True cannot be combined (the FP8 dots take no e2m1)")
    if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dtype != torch.int32 or cu_seqlens_k.dim() != 1:
        raise TypeError("cu_seqlens_k must be a 1-D int32 tensor of batch + 1 offsets")
    constants = _format_constants(fmt)
    total, heads_k, head_dim = v.shape
    batch = cu_seqlens_k.numel() - 1
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    cu_blocks = torch.zeros(batch + 1, dtype=torch.int64, device=v.device)
    cu_blocks[1:] = torch.cumsum((lengths + MX_BLOCK - 1) // MX_BLOCK, 0)
    num_blocks = total // MX_BLOCK + batch
    seq_of_block = torch.searchsorted(cu_blocks[1:], torch.arange(num_blocks, device=v.device), right=True)
    cu_blocks, seq_of_block = cu_blocks.to(torch.int32), seq_of_block.to(torch.int32)
    if pack_e2m1:
        elements = torch.empty(num_blocks * 16, heads_k, head_dim, dtype=torch.uint8, device=v.device)
    elif keys_contiguous:
        storage = torch.empty(heads_k, head_dim, -(-total // 16) * 16, dtype=torch.float8_e4m3fn, device=v.device)
        elements = storage[:, :, :total].permute(2, 0, 1)
    else:
        elements = torch.empty(v.shape, dtype=torch.float8_e4m3fn, device=v.device)
    scale = torch.empty(num_blocks, heads_k, head_dim, dtype=torch.uint8, device=v.device)
    if num_blocks and heads_k:
        _quantize_keys_kernel[(num_blocks, heads_k)](
            v.view(torch.int16),
            elements.view(torch.uint8),
            scale,
            cu_seqlens_k,
            cu_blocks,
            seq_of_block,
            batch,
            *v.stride(),
            *elements.stride(),
            scale.stride(0),
            scale.stride(1),
            HEAD_DIM=head_dim,
            **constants,
            PACK_E2M1=pack_e2m1,
            num_warps=4,
        )
    return elements, scale, cu_blocks
