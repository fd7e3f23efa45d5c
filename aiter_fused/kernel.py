"""Fused-Softmax attention forward as one Triton kernel, written once for NVIDIA and AMD.

The numerics are those of ``fa4_rowmax.reference.fused_softmax`` (read its Notes first); this file mirrors
them tile by tile. Only plain ``tl`` is used: no architecture keyword (``waves_per_eu`` and the like)
appears, so the same source compiles for CUDA, ROCm and Triton's CPU interpreter.

Note [MX dots, per architecture]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Operands arrive pre-quantized (``attention.py``): elements in an e4m3 container, one E8M0 byte per
block of 32 along the reduction dim. e2m3 and e2m1 values are all exactly representable in e4m3, so
one container serves every format without changing a value. Three dot strategies (``DOT_MODE``),
chosen on the host:
- ``"scaled"``: ``tl.dot_scaled`` with the block scales: native MX MFMA/MMA on gfx950 and Blackwell,
  Triton's own emulation elsewhere (it upcasts to bf16). MXFP4's Q, K and V go in as packed e2m1
  (``OPERAND_FORMAT``, quantize.py's Note [Packed e2m1]): gfx950's fp4 x fp4 MFMA for QK^T and fp8 x
  fp4 for P@V (compile audit). MXFP8 and MXFP6 go in as e4m3: Triton 3.6's ``dot_scaled`` takes no
  e2m3/e3m2, so MXFP6 runs at the fp8 rate, and P (e4m3, or six-bit values in the e4m3 container) is
  always an fp8 operand.
- ``"fp8"``: Hopper's FP8 tensor cores, block scales applied outside the dots. A block scale is
  constant over 32 elements of the reduction dim and one FP8 MMA step reduces over K = 32, so each
  dot covers exactly one scale block and its fp32 result takes the two scales as one exact power of
  two afterwards: ``S = sum_c (s_q[:, c] outer s_k[:, c]) * dot(Q_c, K_c^T)`` over head-dim chunks
  ``c`` and ``O += sum_b (s_p[:, b] outer s_v[b, :]) * dot(P_b, V_b)`` over 32-key chunks ``b``. The
  KV tile is processed in sub-tiles of 32 keys, so every chunk of S and P is its own register tensor
  (no reshape or split of a wider tile); the tile max, the recovery and the frozen max are still
  per ``BLOCK_N`` tile, after all sub-tiles' scores exist. Products of e4m3 elements are exact in
  fp32 (at most 8 significant bits); see Note [FP8 accumulation] for the sums. V arrives transposed
  (keys contiguous) so that both FP8 B operands are K-major, the layout Hopper's wgmma needs.
- ``"bf16"``: the elements are dequantized in registers (``element * 2**scale``, exact in BF16: at
  most 4 significant bits and fp32's exponent range) and fed to an ordinary BF16 ``tl.dot`` (fp32
  accumulation): exact MX semantics on any GPU with BF16 tensor cores.
``DOT_DTYPE`` is the operand type of the ordinary BF16 dots: BF16 on GPUs; fp32 under Triton's CPU
interpreter, whose ``tl.dot`` multiplies BF16 operands as their raw uint16 storage (Triton 3.x,
``interpreter.create_dot``). The operands hold BF16 values either way, so the products are the same.
The interpreter's FP8 dot converts e4m3 to fp16 (exact) and multiplies in fp32: no workaround needed.

Note [FP8 accumulation]
~~~~~~~~~~~~~~~~~~~~~~~
Each 32-element FP8 dot starts from a zero accumulator and is added to the fp32 scores/output by an
ordinary fp32 multiply-add (the scale factor is a power of two, so the product is exact): the only
sums done inside the tensor core are the 32 products of one scale block. Hopper's FP8 MMA keeps
fewer than fp32's 24 bits while it adds those products (an e8m13 accumulator, truncating, per
DeepSeek-V3's report and SageAttention2's measurements), where the BF16 path is off by fp32
rounding only. Under the interpreter the sums are fp32, so the "fp8" path matches the reference
to ~1e-6 in the LSE there, at the numerics script's varlen shape too (kernel logic, V layout, scale
indexing and short-sequence masking are exact). On the H200 (2026-11-29) its LSE differed by up to
6.4e-3 (varlen), 1.1e-2 (varlen causal) and 2.8e-3 / 4.6e-3 (dense, head_dim 64), against ~1e-6 for
the fp32-summing modes, with outputs within 2.7e-3 of the "bf16" mode.

That is the accumulator, not a bug. A CPU emulation of the kernel with the e8m13 truncating sum in
place of each 32-product dot (the script's shapes, CPU seeds) reproduces it. In the varlen causal
case scores move by ~4e-5 log2 units (median; max ~6e-4), 1.5% of the Schraudolph BF16 P elements
move by one BF16 step (2**-7 in log2 units), and 0.09% of all P elements, those of the moved ones
that sit on an e4m3 rounding boundary (BF16 keeps 4 more bits), move by a whole e4m3 step, 1/16 to
1/8 of the element. One such step moves the row's LSE by about ln(1 + step / row_sum): ~1e-3 in
rows of 500-1000 keys, but 1e-2 in rows of 5-64 keys, which the varlen case has (a 5-key sequence,
and 129 queries on 64 keys causal: rows of 1-64 keys). Worst
emulated row: 9 keys, row sum 2.57, one element 0.3574 -> 0.3594 in BF16, a tie in e4m3, so
0.34375 -> 0.375: LSE +1.2e-2. The emulated maxima (varlen 4.6e-3 to 6.7e-3, causal 3.8e-3 to 2.1e-2;
dense head_dim 64 3e-3 to 8.9e-3) bracket the H200's, and it gives MXFP6/MXFP4 the same exact or
near-exact agreement the H200 showed (their e2m3/e2m1 products lie on a grid the narrow accumulator
holds). The frozen max moves by ~1e-4 log2 units in nearly every row, which shifts all of a row's
Schraudolph arguments alike, but the LSE takes the same shift back (m + log2(row_sum)); recovery
decisions agree unless a tile max lies within ~1e-4 of the threshold. The median LSE difference
stays ~6e-5 and the 99th percentile below ~2e-3: ``scripts/aiter_fused_numerics.py`` checks the
"fp8" LSE against those (its Note [FP8 LSE tolerance]), the other modes against the fp32 bound.

Note [Where the time goes on Hopper]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On Hopper the CUDA-core work around the dots decides, not the tensor cores: at the launch table's sm90 entry
(H200, 32K tokens, 16 heads, head dim 128, BF16, 8K and 16K, ``docs/aiter_h200.md``, Measured) the exact twin runs
0.68-0.71x FA4 stock, and the MX modes 0.08x ("fp8") and 0.15x ("bf16", "scaled"). The MX quantization of Q/K/V
(``quantize.py``) is a few percent of a call.

Per score element, read off the sm_90a SASS of that launch (``python -m aiter_fused.compile_sm90``, which compiles
with the values a call passes; BLOCK_M 128 over 8 warps, two warpgroups of 64 rows, tile 128): the exact twin's
main loop issues 8.3 (non-causal) / 8.6 (causal) instructions with no spills, against FA4 stock's 7.4, after Note
[Unmasked and masked KV loops], Note [Exact twin: scale folded into exp2] and Note [KV addresses]; the MX modes
64-66 ("bf16", 104-144 bytes of spills), 53 ("scaled", 8-64) and 120 ("fp8", 200-232). The twin's speed sits where
a second warp per scheduler doubles the softmax's issue rate without the softmax running under the GEMMs (the
``cp.async`` buffers' CTA-wide barriers keep the two warpgroups in step). Where the "fp8" mode's instructions go,
estimated from the source for head dim 128 and tile 128 in CUDA-core lane instructions per score: QK^T block
scales, a factor product and an FMA per 32-wide head-dim chunk, 8; K and V scale-byte decodes, 2-4; scale and
mask 3; tile max 1; Schraudolph bits ~12 (clamps, FMA, convert, NaN and -inf selects); the MX quantization of P
~15 (block max, ``_round_to_element``'s NaN-keeping clamps, two bit-built powers of two, the magic add/sub); row
sum 1; e4m3 convert 0.5; P@V block scales 8. On top, 20 small wgmma per 128-key tile (16 m64n32k32 for QK^T, 4
for P@V), each waited for before its scale applies, so tensor-core and CUDA-core work do not overlap.
Unmeasured levers: BF16 operands dequantized once per call (exact; plain BF16 dots with fp32 sums, so no block
scales, decodes or Note [FP8 accumulation]); for MXFP8 P, the hardware e4m3 conversion (round to nearest even,
subnormals; P never saturates) doing ``_round_to_element``'s work in one instruction (Triton's interpreter converts
differently, so only a GPU test can hold it to ``mx.py``); warp specialization with TMA (``docs/aiter_h200.md``,
Not done). The twin's per-element-address form ran faster on the H200 than the tile-offset one, so the table's
sm90 entry leaves ``kv_tile_offsets`` off (Note [Launch table] in ``launch.py``).

Note [Kernel rounding vs the reference]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The element rounding (round to nearest even via the ``1.5 * 2**23`` addition) and the RCEIL scale
(from the bits of the block maximum, no division) give the same values as ``fa4_rowmax.reference.mx`` for the
same input; the Schraudolph bits use the same single rounding. The scores differ from the
reference's by the fp32 summation order of the dots, so a score near a rounding boundary can move
one element of P by one step: kernel and reference agree "to rounding", not bit for bit.
One difference in sign only: a negative value that rounds to zero is +0 here, -0 in ``mx.py``.

Note [Unmasked and masked KV loops]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A program's KV tiles split at ``unmasked_end``: every tile below it holds only keys that every row of the
block sees (inside the sequence and, causal, at or left of the block's first row's diagonal), so its scores
need no mask; the tiles from there to ``kv_end`` (the causal diagonal band, the sequence's partial last tile)
are masked as before. One loop body runs over the two ranges, unmasked first, with ``masked`` a compile-time
0 / 1 (FlashAttention's and Triton's fused-attention tutorial's split of the causal band). ``unmasked_end``
is a multiple of ``BLOCK_N``, so the tiles and their order are the single loop's: the first tile (which sets
the frozen max) and every tile's recovery decision are unchanged, and so are the values of "scaled", the MX
mode that splits (its main loop keeps the same FFMA, FMUL and FADD counts on sm_90 and gfx950; only selects
and compares left). Query
rows past the sequence (``row_ok`` false) get unmasked scores instead of -inf in the unmasked loop: they are
never stored, and no row's values depend on another row's. The exact twin also loads K and V unmasked there.
The "fp8" and "bf16" modes keep the single masked loop: two copies of their large loop bodies outgrow the
registers. "fp8" at the sm90 launch spills 2 KB instead of 0.2 KB (148 instructions per score instead of 120,
``compile_sm90``); "bf16", gfx942's default, spills 44-49 VGPRs instead of 0-2 there (compile audit, head dim
128) and 292-319 instead of 167-168 on gfx950. The exact twin and "scaled" gain without new spills (sm_90: 8.3
vs 11.9 and 53 vs 58-60 per score; gfx950 main-loop VALU 544 vs 831 and 1,397 vs 1,555).

Note [Exact twin: scale folded into exp2]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The exact twin keeps the raw scores ``s`` and scales inside the exponent: per row ``m = max(m, max(s) * scale)``,
per element ``p = exp2(s * scale - m)``: one FFMA on a GPU (Triton's default fp fusion) instead of a multiply
and a subtract (``x = s * scale``, then ``x - m``). ``max(s) * scale == max(s * scale)``:
multiplying by a positive constant and rounding keep the order, and -inf stays -inf. The fused argument is
rounded once instead of twice, so it moves by at most half an ulp of ``s * scale`` and P by a relative
``ln 2 * 2**-24 * |s * scale|``, below 2**-17 for arguments under 64, against BF16 P's 2**-9 rounding (the
interpreter still rounds twice). Only the exact twin folds: the MX modes' Schraudolph argument stays ``x - m``
with ``x = s * scale`` rounded first, as ``fa4_rowmax.reference.fused_softmax`` computes it.

Note [KV addresses]
~~~~~~~~~~~~~~~~~~~
With ``KV_TILE_OFFSETS`` (a launch's ``kv_tile_offsets``; off in every table entry, sm90's by measurement: Note
[Launch table]) the exact twin addresses a K or V tile as one
64-bit base per tile (``k_start + n_start`` rows in) plus loop-invariant int32 offsets inside the tile, where
otherwise each element's row index is widened to 64 bits and multiplied by the stride: on sm_90 2 instructions
(a 64-bit add) per 16-byte ``cp.async`` instead of ~6, 32 instead of 96 per tile and thread at BLOCK_N 128 over
8 warps (1.1 per score). The offsets stay below ``BLOCK_N * stride``, which ``attention._launch`` checks fits
int32. gfx950 and gfx942 keep the per-element form: the compile audit compiles with unspecialized strides,
where the loads are not vectorized and the hoisted offsets (one per element) cost 76-122 VGPR spills at head
dim 128 (compiled with a call's values, ``compile_sm90``'s way, neither form spills there).

Note [Row sum by GEMM]
~~~~~~~~~~~~~~~~~~~~~~
``row_sum="gemm"`` (``ROW_SUM_GEMM``; "bf16" and "scaled" only, off by default) takes the row sum the paper's
way, "through another matrix multiplication": ``l_acc = dot(P, ones, l_acc)`` with the very operand P@V
takes in the same tile ("bf16": the BF16 values of the quantized P; "scaled": its e4m3 elements with their
E8M0 block scales, the ones block e4m3 with E8M0 scale bytes 127, i.e. 1), accumulated across tiles in the
dot's own fp32 accumulator and rescaled with ``O`` on a recovery; ``row_sum`` is the sum of ``l_acc``'s
columns at the end (exact: only column 0 of ``ones`` is 1, the other columns hold 0). ``ones`` is
``[BLOCK_N, 32]``, one column block of the 32x32 MFMA the launch's P@V uses, so the P operand is the P@V
dot's in the same layout. gfx950 compile audit (Triton 3.6, "scaled" MXFP8, hd128, tile 64): one more
``v_mfma_scale_f32_32x32x64_f8f6f4`` per tile and no LDS traffic added. The alternatives compiled worse:
16 columns (the smallest N ``tl.dot`` takes) make Triton pick a 16x16 MFMA, whose P layout differs (+42 LDS
instructions per tile to convert it), and ``rhs_scale=None`` makes it lower the scaled dot by upcasting
to a BF16 MFMA. Ones columns appended to V would share P@V's MFMAs, but the head dims are powers of two
with no spare column (128 + 1 is no ``tl.arange`` length), so the sum is its own dot. Not for "fp8" (a
block's scales are applied outside its 32-key dots, so the sum could not stay in one accumulator) nor the
exact twin (its row sum is of fp32 P, its P@V of BF16 P: a GEMM row sum would change its values).

Values: the same terms as the reference's ``p.sum(dim=-1)`` and as the reduction, in another fp32 order.
All terms are >= 0, so a sum of n of them in any order is within ``gamma_n = n u / (1 - n u)`` (u = 2**-24)
relative of the exact sum (Higham, Accuracy and Stability, 4.2), the running row sum over the tiles
included (n = the row's keys plus its recoveries: each rescale is one more rounding). The two orders
differ by at most ``2 gamma_n`` relative, the LSE (natural log) by at most ``2 gamma_n`` plus its own
rounding, and the output by ``2 gamma_n`` relative before its BF16 rounding, which can then move an element
by one BF16 step. No P element changes (the scores, the Schraudolph bits and the quantization are the same
instructions), so the frozen max and every recovery decision are unchanged, and ``LSE_TOL`` against the
reference holds as before. ``tests/test_aiter_fused_kernel.py`` holds gemm to reduce by the bound under the
interpreter (fp32 dots). On a GPU the bound assumes the MFMA/MMA sums its products in fp32; the order and
precision inside the instruction are the hardware's and not checked here (no MI355X run yet).

Note [Folded Schraudolph]
~~~~~~~~~~~~~~~~~~~~~~~~~
``exp_fold=True`` (``EXP_FOLD``; "bf16" and "scaled" only, off by default) computes P the way
``fa4_rowmax.reference.fused_softmax`` Note [Folded Schraudolph] defines it: Q arrives quantized after a
prescale by ``128 c`` (``quantize_head_dim``'s ``prescale``), the score dot's accumulator starts at the
per-row addend (``tl.dot(q, k, addend)`` / ``tl.dot_scaled(..., addend)``: on gfx950 the MFMA's C operand), so
the dot yields ``z``, the Schraudolph bits as a float, and P is ``_folded_schraudolph_p``: the magic-number
rounding, one clamp, the convert and the NaN select. No ``x = s * c``, no ``x - m``, no ``* 128 + 16256``, no
clamp of ``y`` and no ``-inf`` select (``z = -inf`` rounds and clamps to 0). The addend is 0 until a row's max
is set, so the first tile's ``z`` is the raw prescaled score. ``_folded_max_step`` takes the tile max of
``z`` (always: Note [Frozen reference max]), recovers where it exceeds ``16256 + 128 * recovery_threshold``
(computed in fp32 as the reference's ``folded_recovery_bound``), and where the max moves (first tile or
recovery) adds the shift ``16256 - max z`` to the addend and to the tile's ``z`` (the re-derivation): a branch
taken on a block's first tile and on recoveries only. ``m = (16256 - addend) / 128`` feeds the rescale and the
LSE as before. The interpreter's dot is ``fl(matmul) + acc`` (the reference's order up to the matmul's own);
an MFMA adds the addend inside its sum, in the hardware's order and precision: ``z`` then carries fp32 roundings
at ``|z| < 2**15`` (ulp ``2**-9``), ``aiter_fused/tolerances.py`` Note [Folded Schraudolph tolerance]. Not for
"fp8" (its scores are per-chunk FP8 dots combined outside the MMA by scale FMAs, Note [MX dots, per
architecture]: no accumulator to start from the addend) nor the exact twin (no Schraudolph P). Works with
``row_sum="gemm"``: the fold changes how P is made, not how it is summed.

Note [Hardware P convert]
~~~~~~~~~~~~~~~~~~~~~~~~~
``P_CONVERT="hardware"`` is a compile-audit variant: ``aiter_fused.compile_check``'s ``Config(p_convert=...)``
selects it (gfx950, "scaled", MXFP8 P; anything else is a ValueError there, and the kernel's static assert
refuses other modes and formats), ``attention.py`` always passes "software", and it has never run on a GPU.
``_quantize_p_hardware`` keeps the RCEIL scale (block max, exponent from its bits) and replaces the multiply by
``2**-exponent`` and ``_round_to_element`` with gfx950's ``v_cvt_scalef32_pk_fp8_f32``, which divides its
fp32 inputs by the power of two of its scale operand before rounding to e4m3 (LLVM's
``llvm.amdgcn.cvt.scalef32.pk.fp8.f32(old, a, b, scale, high_word)``; Composable Kernel's gfx950 MX path,
``mxf8_utils.hpp``). The scale operand is ``_e8m0_factor(exponent)``: the fp32 that MLIR's
``arith.scaling_truncf`` lowering passes (``arith.extf`` of the E8M0 byte), ``2**-127`` (an fp32 subnormal)
for a zero block. Triton 3.6's ``tl.inline_asm_elementwise`` returns a pack of 8-bit results as ``<N x i8>``,
which the AMDGPU backend will not put in a VGPR ("error: couldn't allocate output register for constraint
'v'", pack 2 and 4), so each asm takes two values and returns two 16-bit halves, each value converted alone
into the low byte of its half (two instructions, ``op_sel`` picking the half; early clobber, as the first
writes the output before the second reads); the truncation to bytes becomes ``v_perm_b32``. Each value takes
its own block's scale, so nothing depends on how the layout pairs elements. The row sum converts the e4m3
elements back to fp32 and goes on as the software path does.

Numerics unverified. Equal to the software path (and ``fa4_rowmax.reference.mx``) only if the instruction
rounds to nearest even, keeps e4m3 subnormals (elements below ``2**-6`` of the block's scale) instead of
flushing them, gives zeros for an all-zero block (exponent -127: masked keys, the causal band) and keeps NaN.
It does not saturate (Composable Kernel's comment: NaN above e4m3's largest value), where
``_round_to_element`` clamps; P never gets there, the RCEIL scale keeps each block's max at or below 448. The
interpreter cannot run the asm: only an MI355X test can hold it to ``mx.py``.
"""

import triton
import triton.language as tl

# Module constants must be tl.constexpr to be visible inside @triton.jit code on a GPU; the interpreter
# also reads plain globals, so test_aiter_fused_kernel.py::test_kernel_compiles_for_sm90 guards this.
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + it - it rounds x to an integer, ties to even
_SCHRAUDOLPH_MAGIC = tl.constexpr(12599168.0)  # 1.5 * 2**23 + 127 * 128
_SCHRAUDOLPH_BIAS = tl.constexpr(16256.0)  # 127 * 128: BF16 bits of 1.0 (Note [Folded Schraudolph])
_ROW_SUM_N = tl.constexpr(32)  # the ones block's columns: one 32-wide MFMA column block (Note [Row sum by GEMM])


@triton.jit
def _pow2(exponent):
    """2**exponent (int32, in [-126, 127]) as fp32, from the bits."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_factor(exponent):
    """2**exponent for an unbiased E8M0 exponent in [-127, 127] (2**-127 is an fp32 subnormal)."""
    return _pow2(tl.maximum(exponent, -126)) * tl.where(exponent < -126, 0.5, 1.0)


@triton.jit
def _scale_byte_factor(scale_byte):
    """The factor of a biased E8M0 byte: 2**(byte - 127); byte 255 (NaN) gives NaN."""
    factor = _e8m0_factor(scale_byte.to(tl.int32) - 127)
    return tl.where(scale_byte == 255, float("nan"), factor)


@triton.jit
def _rceil_exponent(amax, MAX_MANTISSA_BITS: tl.constexpr, MAX_EXPONENT: tl.constexpr):
    """Unbiased E8M0 exponent ceil(log2(amax / max_normal)), clamped to [-127, 127], for amax >= 0.
    max_normal = (1 + MAX_MANTISSA_BITS * 2**-23) * 2**MAX_EXPONENT. amax's mantissa above
    max_normal's means the ratio is in (1, 2) times a power of two: one exponent up. Equal to the
    reference's rounded fp32 division for these three max_normal values (the ratio can never round
    down onto a power of two: it is at least 1 + 0.53 ulp above one)."""
    bits = amax.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = exponent - MAX_EXPONENT + ((bits & 0x7FFFFF) > MAX_MANTISSA_BITS).to(tl.int32)
    exponent = tl.where(((bits >> 23) & 0xFF) == 0, -127, exponent)  # zero or fp32-subnormal amax
    return tl.minimum(tl.maximum(exponent, -127), 127)


@triton.jit
def _round_to_element(v, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX_NORMAL: tl.constexpr):
    """Round fp32 v to the element grid, ties to even, saturating; NaN stays NaN (a plain GPU min/max
    would return the bound and hide a NaN score). See Note [Kernel rounding vs the reference]."""
    v = tl.minimum(
        tl.maximum(v, -MAX_NORMAL, propagate_nan=tl.PropagateNan.ALL), MAX_NORMAL, propagate_nan=tl.PropagateNan.ALL
    )
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)
    t = v * _pow2(MANTISSA - exponent)
    t = (t + _ROUND_MAGIC) - _ROUND_MAGIC
    return t * _pow2(exponent - MANTISSA)


@triton.jit
def _quantize_p(
    p,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MAX_MANTISSA_BITS: tl.constexpr,
    MAX_EXPONENT: tl.constexpr,
):
    """MX-quantize P (fp32, >= 0) in blocks of 32 keys. Returns (elements, scale exponents [M, N/32])."""
    blocks = tl.reshape(p, (BLOCK_M, BLOCK_N // 32, 32))
    exponent = _rceil_exponent(tl.max(blocks, axis=2), MAX_MANTISSA_BITS, MAX_EXPONENT)
    # -exponent is in [-126, 127]: P <= 2**recovery_threshold keeps exponent far below 127.
    elements = _round_to_element(blocks * _pow2(-exponent)[:, :, None], MANTISSA, MIN_EXPONENT, MAX_NORMAL)
    return tl.reshape(elements, (BLOCK_M, BLOCK_N)), exponent


@triton.jit
def _quantize_p_block(
    p,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    MAX_NORMAL: tl.constexpr,
    MAX_MANTISSA_BITS: tl.constexpr,
    MAX_EXPONENT: tl.constexpr,
):
    """``_quantize_p`` for one MX block of P ([M, 32]). Returns (elements, scale exponents [M])."""
    exponent = _rceil_exponent(tl.max(p, axis=1), MAX_MANTISSA_BITS, MAX_EXPONENT)
    elements = _round_to_element(p * _pow2(-exponent)[:, None], MANTISSA, MIN_EXPONENT, MAX_NORMAL)
    return elements, exponent


# Note [Hardware P convert]: two fp32 values through gfx950's scaled down-convert (x divided by the scale's power
# of two, rounded to e4m3), each into the low byte of its own 16-bit half of the output dword.
_SCALED_CVT_FP8 = tl.constexpr(
    "v_cvt_scalef32_pk_fp8_f32 $0, $1, $1, $3\n\tv_cvt_scalef32_pk_fp8_f32 $0, $2, $2, $4 op_sel:[0,0,0,1]"
)


@triton.jit
def _quantize_p_hardware(
    p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_MANTISSA_BITS: tl.constexpr, MAX_EXPONENT: tl.constexpr
):
    """Note [Hardware P convert]: ``_quantize_p`` for MXFP8 P with gfx950's ``v_cvt_scalef32_pk_fp8_f32`` in
    place of the multiply by 2**-exponent and ``_round_to_element``. Compile audit only: never run on a GPU.
    Returns (e4m3 elements [M, N], scale exponents [M, N/32])."""
    blocks = tl.reshape(p, (BLOCK_M, BLOCK_N // 32, 32))
    exponent = _rceil_exponent(tl.max(blocks, axis=2), MAX_MANTISSA_BITS, MAX_EXPONENT)
    scale = _e8m0_factor(exponent)  # 2**exponent, the fp32 that MLIR's arith.extf makes of the E8M0 byte
    elements = tl.inline_asm_elementwise(
        _SCALED_CVT_FP8,
        "=&v,v,v,v,v",
        [blocks, tl.broadcast_to(scale[:, :, None], (BLOCK_M, BLOCK_N // 32, 32))],
        dtype=tl.int16,
        is_pure=True,
        pack=2,
    )
    return tl.reshape(elements.to(tl.uint8).to(tl.float8e4nv, bitcast=True), (BLOCK_M, BLOCK_N)), exponent


@triton.jit
def _dequantize_p(elements, exponent, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    blocks = tl.reshape(elements, (BLOCK_M, BLOCK_N // 32, 32))
    return tl.reshape(blocks * _e8m0_factor(exponent)[:, :, None], (BLOCK_M, BLOCK_N))


@triton.jit
def _dequantize(elements, scale_byte):
    """e4m3-container elements times 2**(scale - 127); scale byte 255 (NaN) gives NaN."""
    return elements.to(tl.float32) * _scale_byte_factor(scale_byte)


@triton.jit
def _frozen_max_step(m, tile_max, acc, row_sum, recoveries, recovery_threshold, ROW_SUM_GEMM: tl.constexpr = False):
    """Note [Frozen reference max]: the tile max is always computed, the max moves only on a recovery
    (or when it is set for the first time), and the rescale runs only then. ``row_sum`` is the row sum
    ([M]), or with ROW_SUM_GEMM its GEMM accumulator ([M, ROW_SUM_N], Note [Row sum by GEMM])."""
    first = (m == float("-inf")) & (tile_max > float("-inf"))
    recovered = (m > float("-inf")) & (tile_max > m + recovery_threshold)
    m_new = tl.where(first | recovered, tile_max, m)
    if tl.max(recovered.to(tl.int32), axis=0) > 0:
        acc, row_sum = _rescale_rows(acc, row_sum, tl.where(recovered, tl.exp2(m - m_new), 1.0), ROW_SUM_GEMM)
    return m_new, acc, row_sum, recoveries + recovered.to(tl.int32)


@triton.jit
def _rescale_rows(acc, row_sum, alpha, ROW_SUM_GEMM: tl.constexpr):
    """O and the row sum (or its GEMM accumulator, Note [Row sum by GEMM]) times the per-row factor ``alpha``."""
    acc = acc * alpha[:, None]
    if ROW_SUM_GEMM:
        row_sum = row_sum * alpha[:, None]
    else:
        row_sum = row_sum * alpha
    return acc, row_sum


@triton.jit
def _schraudolph_p(x, m):
    """Note [Schraudolph exp2 as BF16 bits]: P = 2**(x - m) as BF16 bits, returned in fp32; masked
    scores (x = -inf) give 0."""
    y = x - m[:, None]
    y_clamped = tl.minimum(tl.maximum(y, -128.0), 128.0)
    bits = (y_clamped * 128.0 + _SCHRAUDOLPH_MAGIC) - _ROUND_MAGIC
    bits = tl.minimum(tl.maximum(bits, 0.0), 32640.0)
    p = bits.to(tl.int32).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    p = tl.where(y == y, p, float("nan"))
    return tl.where(x == float("-inf"), 0.0, p)


@triton.jit
def _folded_max_step(m, addend, z, acc, row_sum, recoveries, recovery_bound, ROW_SUM_GEMM: tl.constexpr = False):
    """Note [Folded Schraudolph]: ``_frozen_max_step`` on the folded GEMM's ``z``. Where the max moves (a row's
    first tile, or ``max z`` above ``recovery_bound``) the shift ``16256 - max z`` goes into the addend and the
    tile's ``z``. Returns (m, addend, z, acc, row_sum, recoveries)."""
    tile_max = tl.max(z, axis=1)
    first = (m == float("-inf")) & (tile_max > float("-inf"))
    recovered = (m > float("-inf")) & (tile_max > recovery_bound)
    moved = first | recovered
    if tl.max(moved.to(tl.int32), axis=0) > 0:
        shift = tl.where(moved, _SCHRAUDOLPH_BIAS - tile_max, 0.0)
        z = z + shift[:, None]
        addend = addend + shift
        m_new = tl.where(moved, (_SCHRAUDOLPH_BIAS - addend) * 0.0078125, m)
        acc, row_sum = _rescale_rows(acc, row_sum, tl.where(recovered, tl.exp2(m - m_new), 1.0), ROW_SUM_GEMM)
        m = m_new
    return m, addend, z, acc, row_sum, recoveries + recovered.to(tl.int32)


@triton.jit
def _folded_schraudolph_p(z):
    """Note [Folded Schraudolph]: P from the folded GEMM's ``z`` (the BF16 bits as a float), returned in fp32:
    bits ``clamp(RNE(z), 0, 0x7F80)``; ``z = -inf`` gives 0 through the clamp, NaN stays NaN."""
    bits = tl.minimum(tl.maximum((z + _ROUND_MAGIC) - _ROUND_MAGIC, 0.0), 32640.0)
    p = bits.to(tl.int32).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    return tl.where(z == z, p, float("nan"))


@triton.jit
def _masked_scores(s, offs_m, keys, row_ok, seqlen_q, seqlen_k, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Raw scores, -inf where the key is past the sequence or causally masked; unchanged in the tiles of
    the unmasked loop (Note [Unmasked and masked KV loops])."""
    if not MASKED:
        return s
    visible = row_ok[:, None] & (keys < seqlen_k)[None, :]
    if CAUSAL:  # bottom-right aligned: row i sees keys j <= i + seqlen_k - seqlen_q
        visible = visible & (keys[None, :] <= offs_m[:, None] + seqlen_k - seqlen_q)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _fused_softmax_attn_fwd(
    Q,
    K,
    V,
    Q_scale,
    K_scale,
    V_scale,
    Out,
    Lse,
    Recoveries,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_blocks_k,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_qst,
    stride_qsh,
    stride_kst,
    stride_ksh,
    stride_vsb,
    stride_vsh,
    stride_ot,
    stride_oh,
    stride_lh,
    scale_log2,
    recovery_threshold,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    EXACT: tl.constexpr,
    DOT_MODE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    OPERAND_FORMAT: tl.constexpr,
    RETURN_RECOVERIES: tl.constexpr,
    KV_TILE_OFFSETS: tl.constexpr,
    ROW_SUM_GEMM: tl.constexpr,
    EXP_FOLD: tl.constexpr,
    P_MANTISSA: tl.constexpr,
    P_MIN_EXPONENT: tl.constexpr,
    P_MAX_NORMAL: tl.constexpr,
    P_MAX_MANTISSA_BITS: tl.constexpr,
    P_MAX_EXPONENT: tl.constexpr,
    P_CONVERT: tl.constexpr,
):
    """One program: BLOCK_M query rows of one sequence and one query head. Varlen layout throughout
    (dense inputs arrive flattened); V is addressed through three strides (token, head, head_dim) so
    that the FP8 path can take it transposed. EXACT: the same loop with online softmax and exact exp2
    on the unquantized BF16 operands (the like-for-like baseline); DOT_MODE: Note [MX dots, per
    architecture]; OPERAND_FORMAT: the "scaled" mode's Q/K/V format, "e4m3" (container) or "e2m1"
    (packed, quantize.py's Note [Packed e2m1]); KV_TILE_OFFSETS: the exact twin's K/V addressing (Note [KV
    addresses]), from the launch table; ROW_SUM_GEMM: the MX modes' row sum by a GEMM ("bf16" and "scaled";
    Note [Row sum by GEMM]); EXP_FOLD: the frozen max and the Schraudolph map folded into the score GEMM
    ("bf16" and "scaled"; Q arrives prescaled, Note [Folded Schraudolph]); P_CONVERT: how MX P is made,
    "software" (every launch) or "hardware" (Note [Hardware P convert]: the compile audit's gfx950 variant,
    "scaled" MXFP8 only, never run on a GPU)."""
    tl.static_assert(
        P_CONVERT == "software"
        or (P_CONVERT == "hardware" and DOT_MODE == "scaled" and not EXACT and P_MAX_NORMAL == 448.0),
        'P_CONVERT must be "software", or "hardware" with dot_mode "scaled" and e4m3 (MXFP8) P (compile audit only)',
    )
    block_m = tl.program_id(0)
    seq = tl.program_id(1)
    head_q = tl.program_id(2)
    head_k = head_q // GROUP
    q_start = tl.load(cu_seqlens_q + seq)
    seqlen_q = tl.load(cu_seqlens_q + seq + 1) - q_start
    if block_m * BLOCK_M >= seqlen_q:
        return
    k_start = tl.load(cu_seqlens_k + seq)
    seqlen_k = tl.load(cu_seqlens_k + seq + 1) - k_start

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_ds = tl.arange(0, HEAD_DIM // 32)
    offs_b = tl.arange(0, 32)  # one MX block
    row_ok = offs_m < seqlen_q

    q_rows = (q_start + offs_m).to(tl.int64)
    q_row_ptrs = Q + q_rows[:, None] * stride_qt + head_q * stride_qh
    q_scale_ptrs = Q_scale + q_rows * stride_qst + head_q * stride_qsh
    if EXACT:
        q = tl.load(q_row_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    elif DOT_MODE == "fp8":
        # Q stays in registers as HEAD_DIM / 32 chunks of fp8 elements, each with its row factors.
        q_chunks = ()
        q_factors = ()
        for c in tl.static_range(HEAD_DIM // 32):
            q_chunks = q_chunks + (tl.load(q_row_ptrs + (32 * c + offs_b)[None, :], mask=row_ok[:, None], other=0.0),)
            q_factors = q_factors + (_scale_byte_factor(tl.load(q_scale_ptrs + c, mask=row_ok, other=127)),)
    elif DOT_MODE == "scaled":
        if OPERAND_FORMAT == "e2m1":
            q = tl.load(q_row_ptrs + tl.arange(0, HEAD_DIM // 2)[None, :], mask=row_ok[:, None], other=0)
        else:
            q = tl.load(q_row_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        q_scale = tl.load(q_scale_ptrs[:, None] + offs_ds[None, :], mask=row_ok[:, None], other=127)
    else:
        q = tl.load(q_row_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        q_scale = tl.load(q_scale_ptrs[:, None] + (offs_d // 32)[None, :], mask=row_ok[:, None], other=127)
        q = _dequantize(q, q_scale).to(tl.bfloat16).to(DOT_DTYPE)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    recoveries = tl.zeros((BLOCK_M,), tl.int32)
    if ROW_SUM_GEMM:  # Note [Row sum by GEMM]: the ones block and the row sum's accumulator
        ones = tl.where((tl.arange(0, BLOCK_N)[:, None] >= 0) & (tl.arange(0, _ROW_SUM_N)[None, :] == 0), 1.0, 0.0)
        ones_scale = tl.full((_ROW_SUM_N, BLOCK_N // 32), 127, tl.uint8)  # "scaled": E8M0 127 is 1
        l_acc = tl.zeros((BLOCK_M, _ROW_SUM_N), tl.float32)
    if EXP_FOLD:  # Note [Folded Schraudolph]: the score GEMM's start, 0 until the row's max is set
        addend = tl.zeros((BLOCK_M,), tl.float32)
        recovery_bound = recovery_threshold * 128.0 + _SCHRAUDOLPH_BIAS

    kv_end = seqlen_k  # keys past it are invisible to every row of the block
    visible_end = seqlen_k  # keys before it are visible to every row of the block
    if CAUSAL:
        kv_end = tl.minimum(seqlen_k, (block_m + 1) * BLOCK_M + seqlen_k - seqlen_q)
        visible_end = tl.minimum(seqlen_k, block_m * BLOCK_M + seqlen_k - seqlen_q + 1)
    unmasked_end = 0  # "bf16", "fp8": every tile in the masked loop (Note [Unmasked and masked KV loops])
    if EXACT or DOT_MODE == "scaled":
        unmasked_end = tl.maximum(visible_end, 0) // BLOCK_N * BLOCK_N
    v_block0 = tl.load(cu_blocks_k + seq)
    k_head = K + head_k * stride_kh
    v_head = V + head_k * stride_vh
    v_scale_head = V_scale + head_k * stride_vsh
    # Note [Unmasked and masked KV loops]
    for masked in tl.static_range(2):  # 0: the unmasked loop, 1: the masked one
        lo = unmasked_end if masked else 0
        hi = kv_end if masked else unmasked_end
        for n_start in range(lo, hi, BLOCK_N):
            if EXACT:
                keys = n_start + offs_n
                if KV_TILE_OFFSETS:  # Note [KV addresses]
                    k_tile = k_head + (k_start + n_start).to(tl.int64) * stride_kt
                    v_tile = v_head + (k_start + n_start).to(tl.int64) * stride_vt
                    k_ptrs = k_tile + (offs_n[None, :] * stride_kt + offs_d[:, None])
                    v_ptrs = v_tile + (offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd)
                else:
                    k_rows = (k_start + keys).to(tl.int64)
                    k_ptrs = k_head + k_rows[None, :] * stride_kt + offs_d[:, None]
                    v_ptrs = v_head + k_rows[:, None] * stride_vt + offs_d[None, :] * stride_vd
                if masked:
                    k = tl.load(k_ptrs, mask=(keys < seqlen_k)[None, :], other=0.0)
                    v = tl.load(v_ptrs, mask=(keys < seqlen_k)[:, None], other=0.0)
                else:
                    k = tl.load(k_ptrs)
                    v = tl.load(v_ptrs)
                s = _masked_scores(tl.dot(q, k.to(DOT_DTYPE)), offs_m, keys, row_ok, seqlen_q, seqlen_k, masked, CAUSAL)
                # Note [Exact twin: scale folded into exp2]
                m_new = tl.maximum(m, tl.max(s, axis=1) * scale_log2)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_safe)
                p = tl.exp2(s * scale_log2 - m_safe[:, None])
                row_sum = row_sum * alpha + tl.sum(p, axis=1)
                acc = tl.dot(p.to(tl.bfloat16).to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None])
                m = m_new
            elif DOT_MODE == "fp8":
                # Scores of the tile, one 32-key sub-tile at a time, each the sum of HEAD_DIM / 32 scaled
                # FP8 dots (Note [MX dots, per architecture]).
                x_blocks = ()
                tile_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                for b in tl.static_range(BLOCK_N // 32):
                    keys = n_start + 32 * b + offs_b
                    key_ok = keys < seqlen_k
                    k_rows = (k_start + keys).to(tl.int64)
                    s = tl.zeros((BLOCK_M, 32), tl.float32)
                    for c in tl.static_range(HEAD_DIM // 32):
                        k_chunk = tl.load(
                            k_head + k_rows[None, :] * stride_kt + (32 * c + offs_b)[:, None],
                            mask=key_ok[None, :],
                            other=0.0,
                        )  # [32 head-dim lanes, 32 keys]
                        k_factor = _scale_byte_factor(
                            tl.load(K_scale + k_rows * stride_kst + head_k * stride_ksh + c, mask=key_ok, other=127)
                        )
                        s += (q_factors[c][:, None] * k_factor[None, :]) * tl.dot(q_chunks[c], k_chunk)
                    x = _masked_scores(s, offs_m, keys, row_ok, seqlen_q, seqlen_k, masked, CAUSAL) * scale_log2
                    tile_max = tl.maximum(tile_max, tl.max(x, axis=1))
                    x_blocks = x_blocks + (x,)
                m, acc, row_sum, recoveries = _frozen_max_step(
                    m, tile_max, acc, row_sum, recoveries, recovery_threshold
                )
                # Note [Two-stage P and the row sum], one MX block of P per sub-tile. The row sum adds the
                # block's elements and then scales (exact: at most 32 * 448 in steps of 2**-9).
                for b in tl.static_range(BLOCK_N // 32):
                    p_elements, p_exponent = _quantize_p_block(
                        _schraudolph_p(x_blocks[b], m),
                        P_MANTISSA,
                        P_MIN_EXPONENT,
                        P_MAX_NORMAL,
                        P_MAX_MANTISSA_BITS,
                        P_MAX_EXPONENT,
                    )
                    p_factor = _e8m0_factor(p_exponent)
                    row_sum += tl.sum(p_elements, axis=1) * p_factor
                    keys = n_start + 32 * b + offs_b
                    v_chunk = tl.load(
                        v_head + (k_start + keys).to(tl.int64)[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                        mask=(keys < seqlen_k)[:, None],
                        other=0.0,
                    )
                    v_block = v_block0 + (n_start + 32 * b) // 32
                    block_ok = tl.full((HEAD_DIM,), n_start + 32 * b, tl.int32) < seqlen_k
                    v_factor = _scale_byte_factor(
                        tl.load(v_scale_head + v_block.to(tl.int64) * stride_vsb + offs_d, mask=block_ok, other=127)
                    )
                    acc += (p_factor[:, None] * v_factor[None, :]) * tl.dot(p_elements.to(tl.float8e4nv), v_chunk)
            else:
                keys = n_start + offs_n
                key_ok = keys < seqlen_k
                k_rows = (k_start + keys).to(tl.int64)
                if OPERAND_FORMAT == "e2m1":  # head_dim pairs and key pairs in one byte (Note [Packed e2m1])
                    pairs = tl.arange(0, BLOCK_N // 2)
                    k = tl.load(
                        k_head + k_rows[None, :] * stride_kt + tl.arange(0, HEAD_DIM // 2)[:, None],
                        mask=key_ok[None, :],
                        other=0,
                    )  # [HEAD_DIM / 2, BLOCK_N]
                    v_rows = (v_block0 * 16 + n_start // 2 + pairs).to(tl.int64)  # by block: 16 rows a block
                    v = tl.load(
                        v_head + v_rows[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                        mask=(n_start + 2 * pairs < seqlen_k)[:, None],
                        other=0,
                    )  # [BLOCK_N / 2, HEAD_DIM]
                else:
                    k = tl.load(
                        k_head + k_rows[None, :] * stride_kt + offs_d[:, None], mask=key_ok[None, :], other=0.0
                    )  # [HEAD_DIM, BLOCK_N]
                    v = tl.load(
                        v_head + k_rows[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                        mask=key_ok[:, None],
                        other=0.0,
                    )  # [BLOCK_N, HEAD_DIM]
                if DOT_MODE == "scaled":
                    k_scale = tl.load(
                        K_scale + k_rows[:, None] * stride_kst + head_k * stride_ksh + offs_ds[None, :],
                        mask=key_ok[:, None],
                        other=127,
                    )
                    if EXP_FOLD:  # Note [Folded Schraudolph]: z = addend + Q' K^T
                        s = tl.dot_scaled(
                            q,
                            q_scale,
                            OPERAND_FORMAT,
                            k,
                            k_scale,
                            OPERAND_FORMAT,
                            tl.broadcast_to(addend[:, None], (BLOCK_M, BLOCK_N)),
                        )
                    else:
                        s = tl.dot_scaled(q, q_scale, OPERAND_FORMAT, k, k_scale, OPERAND_FORMAT)
                else:
                    k_scale = tl.load(
                        K_scale + k_rows[None, :] * stride_kst + head_k * stride_ksh + (offs_d // 32)[:, None],
                        mask=key_ok[None, :],
                        other=127,
                    )
                    k_values = _dequantize(k, k_scale).to(tl.bfloat16).to(DOT_DTYPE)
                    if EXP_FOLD:
                        s = tl.dot(q, k_values, tl.broadcast_to(addend[:, None], (BLOCK_M, BLOCK_N)))
                    else:
                        s = tl.dot(q, k_values)
                if EXP_FOLD:
                    z = _masked_scores(s, offs_m, keys, row_ok, seqlen_q, seqlen_k, masked, CAUSAL)
                    if ROW_SUM_GEMM:
                        m, addend, z, acc, l_acc, recoveries = _folded_max_step(
                            m, addend, z, acc, l_acc, recoveries, recovery_bound, True
                        )
                    else:
                        m, addend, z, acc, row_sum, recoveries = _folded_max_step(
                            m, addend, z, acc, row_sum, recoveries, recovery_bound
                        )
                    p_bf16 = _folded_schraudolph_p(z)
                else:
                    x = _masked_scores(s, offs_m, keys, row_ok, seqlen_q, seqlen_k, masked, CAUSAL) * scale_log2
                    if ROW_SUM_GEMM:
                        m, acc, l_acc, recoveries = _frozen_max_step(
                            m, tl.max(x, axis=1), acc, l_acc, recoveries, recovery_threshold, True
                        )
                    else:
                        m, acc, row_sum, recoveries = _frozen_max_step(
                            m, tl.max(x, axis=1), acc, row_sum, recoveries, recovery_threshold
                        )
                    p_bf16 = _schraudolph_p(x, m)
                # Note [Two-stage P and the row sum]
                if P_CONVERT == "hardware":  # Note [Hardware P convert]: compile audit only
                    p_fp8, p_exponent = _quantize_p_hardware(
                        p_bf16, BLOCK_M, BLOCK_N, P_MAX_MANTISSA_BITS, P_MAX_EXPONENT
                    )
                    p_elements = p_fp8.to(tl.float32)
                else:
                    p_elements, p_exponent = _quantize_p(
                        p_bf16,
                        BLOCK_M,
                        BLOCK_N,
                        P_MANTISSA,
                        P_MIN_EXPONENT,
                        P_MAX_NORMAL,
                        P_MAX_MANTISSA_BITS,
                        P_MAX_EXPONENT,
                    )
                p_values = _dequantize_p(p_elements, p_exponent, BLOCK_M, BLOCK_N)
                if not ROW_SUM_GEMM:
                    row_sum += tl.sum(p_values, axis=1)
                if DOT_MODE == "scaled":
                    block_keys = n_start + 32 * tl.arange(0, BLOCK_N // 32)
                    v_blocks = v_block0 + block_keys // 32
                    v_scale = tl.load(
                        v_scale_head + v_blocks[None, :].to(tl.int64) * stride_vsb + offs_d[:, None],
                        mask=(block_keys < seqlen_k)[None, :],
                        other=127,
                    )
                    p_scale = (p_exponent + 127).to(tl.uint8)
                    if P_CONVERT == "software":
                        p_fp8 = p_elements.to(tl.float8e4nv)
                    acc = tl.dot_scaled(p_fp8, p_scale, "e4m3", v, v_scale, OPERAND_FORMAT, acc)
                    if ROW_SUM_GEMM:
                        l_acc = tl.dot_scaled(p_fp8, p_scale, "e4m3", ones.to(tl.float8e4nv), ones_scale, "e4m3", l_acc)
                else:
                    v_blocks = v_block0 + keys // 32
                    v_scale = tl.load(
                        v_scale_head + v_blocks[:, None].to(tl.int64) * stride_vsb + offs_d[None, :],
                        mask=key_ok[:, None],
                        other=127,
                    )
                    v_values = _dequantize(v, v_scale).to(tl.bfloat16).to(DOT_DTYPE)
                    p_dot = p_values.to(tl.bfloat16).to(DOT_DTYPE)
                    acc = tl.dot(p_dot, v_values, acc)
                    if ROW_SUM_GEMM:
                        l_acc = tl.dot(p_dot, ones.to(DOT_DTYPE), l_acc)

    if ROW_SUM_GEMM:
        row_sum = tl.sum(l_acc, axis=1)  # exact: one column holds the sum, the others are 0
    empty = row_sum == 0.0
    out = acc / tl.where(empty, 1.0, row_sum)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, row_sum))) * 0.6931471805599453)
    tl.store(
        Out + q_rows[:, None] * stride_ot + head_q * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(Lse + head_q * stride_lh + q_rows, lse, mask=row_ok)
    if RETURN_RECOVERIES:
        tl.store(Recoveries + head_q * stride_lh + q_rows, recoveries, mask=row_ok)
