"""A reduced-precision FP8 MMA accumulator for the reference: Hopper's e4m3 wgmma sum, emulated on any device.

Note [Emulated FP8 MMA accumulator]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`SoftmaxConfig.accumulator_mantissa_bits = b` (None: the reference's fp32 GEMMs, bit-identical to before) makes
the reference's FP8 GEMMs (Q K^T and/or P V, `SoftmaxConfig.accumulator_gemms`) sum their products the way
MMA-Sim's bit-accurate model of Hopper's FP8 wgmma does (github.com/microsoft/MMA-Sim, `mmasim/simulator/nv.py`
`WGMMASim` and `functions.py` `nv_fused_dot_add`: 13 fraction bits and an `f32_e8m13` output for e4m3/e5m2
inputs, so b = 13 is that model; DeepSeek-V3's report, arXiv 2412.19437 section 3.3.2: "the accumulation
precision of FP8 GEMM on NVIDIA H800 GPUs is limited to retaining around 14 bits"). One wgmma has K = 32
(`FP8_MMA_K`); a GEMM over K' runs ceil(K' / 32) of them in order along K, each taking the previous one's
result as its accumulator input c (the first c is 0). One of them computes, per output element:
- the 32 products a_i b_i exactly (e4m3 x e4m3 fits fp32), each with the alignment exponent e_i = e(a_i) +
  e(b_i), where e(x) is x's exponent field value (floor(log2 |x|), subnormals at the dtype's minimum normal
  exponent: e4m3 -6, e5m2 -14) and a zero product has none; c has its own fp32 exponent e_c;
- E = max(e_i, e_c); each of the 33 terms truncated toward zero to a multiple of 2^(E - b) (b fraction bits
  at E); the truncated terms added exactly;
- the sum truncated toward zero to b fraction bits of its own leading bit (b < 23; for b = 23 that is fp32's
  grid, the truncation then being RZ instead of the GEMM's RN).
Every loss is toward zero, against its term's sign: a sum of mostly same-sign products (a score riding on a
large row-constant offset) loses several units of 2^(E - b) in one direction per wgmma.
The P V GEMM's accumulation, `SoftmaxConfig.accumulator_promotion` (Note [Two-level P V accumulation] below):
- "none" (single-level; FA3-FP8's and the SM90 FP8 forward's `pv_accumulation="single"`): the accumulator is O
  itself, carried over the KV tiles: before each tile the reference scales O by the rescale factor in fp32 (the
  kernel's register multiply), and that O is the c of the tile's first wgmma.
- "tile" (two-level; `pv_accumulation="two_level"`): each tile's P V starts from c = 0 and is promoted into O
  by one fp32 FFMA, O = fma(O, c_t, acc_t), with c_t the tile's rescale factor.
The keys of a tile enter in blocks of 32 in key order (the kernel's V^T permutes keys only inside 16-key groups,
Note [FP8 A operand from the S accumulator], so each block of 32 holds the same keys, and the sum of truncated
terms does not depend on their order). The row sum is untouched: the study's kernels add it in fp32 FADDs
(`row_sum="fadd"`; `row_sum="mma"`, the sum by the PV GEMM, is not modelled here).
What this is not: a bit-exact replica of the kernel. The kernel's scores then go through an FFMA where the
reference multiplies and adds, and the model's own fidelity is MMA-Sim's (its authors' validation against
hardware; not checked here on the H200). Values below 2^-100 (a product or c) are outside the emulation: the
scale factors are built as fp32 powers of two.

Note [Two-level P V accumulation]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Single-level feeds the running O back as the wgmma's c on every k-block, so O's own exponent sets the alignment
grid 2^(E - 13) of every later product: once O is large (long rows, V of nonzero mean, diffuse attention) a
tile's products fall below the grid and are truncated away, and the error grows with the row. Two-level
(vllm-project/flash-attention PR 104; SageAttention2's `RO_temp`; CUTLASS's `GmmaFP8Accumulation`) gives each
KV tile a fresh accumulator (the wgmma's scale-d = 0 on its first k-step), so the truncation acts on that
tile's partial sums only, and adds the tile's result into the fp32 O on the CUDA cores. The SM90 FP8 forward
keeps O relative to the previous tile's max and applies the tile's factor at the promotion: O = fma(O, c_t,
acc_t), one FFMA per element, rounded once. `fma_fp32` computes it correctly rounded: the product of two fp32
values is exact in fp64, the fp64 sum s rounds once, and TwoSum gives that rounding's error r exactly. Rounding
s to fp32 is the FFMA's result except where s lies exactly on a midpoint of the fp32 grid (25 significant bits)
and r != 0 (the double rounding case: the exact sum is off the midpoint, on r's side); there s moves one fp64
ulp toward r first, which puts it strictly on the right side of the midpoint and crosses no other (an fp64
neighbour of a 25-bit value is never itself an fp32 midpoint). So the emulated FFMA equals the hardware's
bit for bit, subnormals included (tests/test_mma_accumulator.py checks it against exact rationals, double
rounding cases included). A plain fp64 evaluation rounded to fp32 would be off by one fp32 ulp in those cases
only: where the exact sum needs more than 53 bits (operands of far apart magnitudes) and rounds onto a midpoint.
"""

from __future__ import annotations

import math

import torch

from fa4_rowmax.config import ACCUMULATOR_MAX_BITS as MAX_BITS

FP8_MMA_K = 32  # K of one e4m3 / e5m2 wgmma
_NO_EXPONENT = -(2**20)  # the alignment exponent of a zero product: below any real one
_LOWEST_EXPONENT = -100  # E is clamped here so 2^(b - E) stays an fp32 normal (b <= 23)
_CHUNK_ELEMENTS = 2**22  # products per working chunk (rows are split to stay near it)


def exponent_fields(x: torch.Tensor, min_exponent: int) -> torch.Tensor:
    """int32 exponent field value of each FP8 value held in `x` (fp32/fp64): floor(log2 |x|), at least
    `min_exponent` (subnormals), `_NO_EXPONENT` for 0."""
    _, e = torch.frexp(x)
    e = (e.to(torch.int32) - 1).clamp_(min=min_exponent)
    return torch.where(x != 0, e, _NO_EXPONENT)


def _fp32_exponent(x: torch.Tensor) -> torch.Tensor:
    """int32 floor(log2 |x|) of fp32 values, `_NO_EXPONENT` for 0 (subnormals: their own leading bit)."""
    _, e = torch.frexp(x)
    return torch.where(x != 0, e.to(torch.int32) - 1, _NO_EXPONENT)


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 2^exponent for int32 exponents in [-126, 127], built from the bits (exact)."""
    return ((exponent + 127) << 23).view(torch.float32)


def truncate_to_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x (fp64 holding values of at most 53 bits) truncated toward zero to `bits` fraction bits of its own
    leading bit, as fp64 (0 stays 0)."""
    m, e = torch.frexp(x)  # x = m 2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.trunc(torch.ldexp(m, torch.full_like(e, bits + 1))), e - (bits + 1))


def _wgmma_step(a, b, c, ea, eb, bits: int) -> torch.Tensor:
    """One k-block: a (..., R, k), b (..., C, k), c (..., R, C) fp32; ea, eb their exponent fields.
    Returns the new accumulator (..., R, C) fp32 (Note [Emulated FP8 MMA accumulator])."""
    products = a[..., :, None, :] * b[..., None, :, :]  # exact for FP8 values
    e_products = (ea[..., :, None, :] + eb[..., None, :, :]).amax(-1)
    top = torch.maximum(e_products, _fp32_exponent(c)).clamp_(min=_LOWEST_EXPONENT)
    scale = _power_of_two(bits - top)  # 1 / 2^(E - b)
    # Integers of at most bits + 2 bits each; their sum over 33 terms has at most bits + 8: exact in fp32 up to
    # b = 16, in fp64 beyond.
    wide = torch.float32 if bits <= 16 else torch.float64
    terms = torch.trunc(products.mul_(scale[..., None])).to(wide)
    units = terms.sum(-1) + torch.trunc(c * scale).to(wide)
    total = units.double() * _power_of_two(top - bits).double()
    return truncate_to_bits(total, bits).float()


def _row_chunks(rows: int, per_row: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, per_row))
    return [slice(r, min(rows, r + step)) for r in range(0, rows, step)]


def emulated_matmul(
    a: torch.Tensor,
    b_t: torch.Tensor,
    bits: int,
    a_min_exponent: int,
    b_min_exponent: int,
    c: torch.Tensor | None = None,
    k_block: int = FP8_MMA_K,
) -> torch.Tensor:
    """a (..., R, K) @ b_t (..., C, K)^T (+ c (..., R, C)) through the emulated accumulator, fp32 (..., R, C).

    a and b_t are fp32 tensors holding FP8 values (exponent fields from `a_min_exponent` / `b_min_exponent`:
    the minimum normal exponent of their FP8 dtypes); the K axis runs in wgmmas of `k_block` in order.
    """
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in [1, {MAX_BITS}], got {bits}")
    a, b_t = a.float(), b_t.float()
    lead = torch.broadcast_shapes(a.shape[:-2], b_t.shape[:-2])
    a = a.expand(*lead, *a.shape[-2:])
    b_t = b_t.expand(*lead, *b_t.shape[-2:])
    rows, depth, cols = a.shape[-2], a.shape[-1], b_t.shape[-2]
    acc = a.new_zeros(*lead, rows, cols) if c is None else c.float().expand(*lead, rows, cols).clone()
    ea = exponent_fields(a, a_min_exponent)
    eb = exponent_fields(b_t, b_min_exponent)
    lead_size = 1
    for n in lead:
        lead_size *= n
    for k0 in range(0, depth, k_block):
        ks = slice(k0, min(depth, k0 + k_block))
        b_k, eb_k = b_t[..., ks], eb[..., ks]
        for rs in _row_chunks(rows, lead_size * cols * (ks.stop - ks.start)):
            acc[..., rs, :] = _wgmma_step(a[..., rs, ks], b_k, acc[..., rs, :], ea[..., rs, ks], eb_k, bits)
    return acc


def fma_fp32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once to nearest even, as an FFMA does (Note [Two-level P V accumulation]); a, b, c
    fp32 (broadcast), the result fp32."""
    product = a.double() * b.double()  # exact: 24 + 24 significant bits
    addend = c.double()
    total = product + addend
    # TwoSum: the fp64 sum's rounding error, exactly.
    addend_part = total - product
    error = (product - (total - addend_part)) + (addend - addend_part)
    on_midpoint = (truncate_to_bits(total, 24) == total) & (total.float().double() != total) & (error != 0)
    toward = torch.where(error > 0, math.inf, -math.inf).to(total.dtype)
    return torch.where(on_midpoint, torch.nextafter(total, toward), total).float()


def min_normal_exponent(dtype: torch.dtype) -> int:
    """The smallest normal exponent of an FP8 dtype (e4m3fn -6, e5m2 -14)."""
    tiny = torch.finfo(dtype).tiny
    exponent = 0
    while 2.0**exponent > tiny:
        exponent -= 1
    return exponent
