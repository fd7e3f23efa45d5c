"""Fused-Softmax attention forward as one Triton kernel, written once for NVIDIA and AMD.

The numerics are those of ``fa4_rowmax.fused_softmax`` (read its Notes first); this file mirrors
them tile by tile. Only plain ``tl`` is used: no architecture keyword (``waves_per_eu`` and the like)
appears, so the same source compiles for CUDA, ROCm and Triton's CPU interpreter.

Note [MX dots, per architecture]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Operands arrive pre-quantized (``attention.py``): elements in an e4m3 container, one E8M0 byte per
block of 32 along the reduction dim. e2m3 and e2m1 values are all exactly representable in e4m3, so
one container serves every format without changing a value. Two dot strategies, chosen on the host
(``DOT_SCALED``):
- ``DOT_SCALED=True``: ``tl.dot_scaled`` with the block scales: native MX MFMA on gfx950 (and
  Blackwell), Triton's own emulation elsewhere (it upcasts to bf16). All formats go in as e4m3:
  exact, but gfx950's faster fp6/fp4 MFMA rates are left unused (Triton 3.x's ``dot_scaled`` takes no
  e2m3, and e2m1 would need packing along K).
- ``DOT_SCALED=False``: the elements are dequantized in registers (``element * 2**scale``, exact in
  BF16: at most 4 significant bits and fp32's exponent range) and fed to an ordinary BF16 ``tl.dot``
  (fp32 accumulation): exact MX semantics on any GPU with BF16 tensor cores, the default on Hopper.
  Hopper's FP8 tensor cores would need the scales outside the dot, which is only possible with a
  reduction block of 32 (the scale changes every 32 keys / head-dim lanes); see the report.
``DOT_DTYPE`` is the operand type of the ordinary dots: BF16 on GPUs; fp32 under Triton's CPU
interpreter, whose ``tl.dot`` multiplies BF16 operands as their raw uint16 storage (Triton 3.x,
``interpreter.create_dot``). The operands hold BF16 values either way, so the products are the same.

Note [Kernel rounding vs the reference]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The element rounding (round to nearest even via the ``1.5 * 2**23`` addition) and the RCEIL scale
(from the bits of the block maximum, no division) give the same values as ``fa4_rowmax.mx`` for the
same input; the Schraudolph bits use the same single rounding. The scores differ from the
reference's by the fp32 summation order of the dots, so a score near a rounding boundary can move
one element of P by one step: kernel and reference agree "to rounding", not bit for bit.
One difference in sign only: a negative value that rounds to zero is +0 here, -0 in ``mx.py``.
"""

import triton
import triton.language as tl

_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: x + it - it rounds x to an integer, ties to even
_SCHRAUDOLPH_MAGIC = 12599168.0  # 1.5 * 2**23 + 127 * 128


@triton.jit
def _pow2(exponent):
    """2**exponent (int32, in [-126, 127]) as fp32, from the bits."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


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
    """Round fp32 v to the element grid, ties to even, saturating. See Note [Kernel rounding vs the reference]."""
    v = tl.minimum(tl.maximum(v, -MAX_NORMAL), MAX_NORMAL)
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXPONENT)
    t = v * _pow2(MANTISSA - exponent)
    t = (t + _ROUND_MAGIC) - _ROUND_MAGIC
    return t * _pow2(exponent - MANTISSA)


@triton.jit
def _quantize_p(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MANTISSA: tl.constexpr,
                MIN_EXPONENT: tl.constexpr, MAX_NORMAL: tl.constexpr, MAX_MANTISSA_BITS: tl.constexpr,
                MAX_EXPONENT: tl.constexpr):
    """MX-quantize P (fp32, >= 0) in blocks of 32 keys. Returns (elements, scale exponents [M, N/32])."""
    blocks = tl.reshape(p, (BLOCK_M, BLOCK_N // 32, 32))
    exponent = _rceil_exponent(tl.max(blocks, axis=2), MAX_MANTISSA_BITS, MAX_EXPONENT)
    # -exponent is in [-126, 127]: P <= 2**recovery_threshold keeps exponent far below 127.
    elements = _round_to_element(blocks * _pow2(-exponent)[:, :, None], MANTISSA, MIN_EXPONENT, MAX_NORMAL)
    return tl.reshape(elements, (BLOCK_M, BLOCK_N)), exponent


@triton.jit
def _dequantize_p(elements, exponent, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    blocks = tl.reshape(elements, (BLOCK_M, BLOCK_N // 32, 32))
    factor = _pow2(tl.maximum(exponent, -126)) * tl.where(exponent < -126, 0.5, 1.0)
    return tl.reshape(blocks * factor[:, :, None], (BLOCK_M, BLOCK_N))


@triton.jit
def _dequantize(elements, scale_byte):
    """e4m3-container elements times 2**(scale - 127); scale byte 255 (NaN) gives NaN."""
    exponent = scale_byte.to(tl.int32) - 127
    factor = _pow2(tl.maximum(exponent, -126)) * tl.where(exponent < -126, 0.5, 1.0)
    factor = tl.where(scale_byte == 255, float("nan"), factor)
    return elements.to(tl.float32) * factor


@triton.jit
def _fused_softmax_attn_fwd(
    Q, K, V, Q_scale, K_scale, V_scale, Out, Lse, Recoveries,
    cu_seqlens_q, cu_seqlens_k, cu_blocks_k,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_qst, stride_qsh, stride_kst, stride_ksh, stride_vsb, stride_vsh,
    stride_ot, stride_oh, stride_lh,
    scale_log2, recovery_threshold,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EXACT: tl.constexpr, DOT_SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr,
    RETURN_RECOVERIES: tl.constexpr,
    P_MANTISSA: tl.constexpr, P_MIN_EXPONENT: tl.constexpr, P_MAX_NORMAL: tl.constexpr,
    P_MAX_MANTISSA_BITS: tl.constexpr, P_MAX_EXPONENT: tl.constexpr,
):
    """One program: BLOCK_M query rows of one sequence and one query head. Varlen layout throughout
    (dense inputs arrive flattened). EXACT: the same loop with online softmax and exact exp2 on the
    unquantized BF16 operands (the like-for-like baseline)."""
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
    row_ok = offs_m < seqlen_q

    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head_q * stride_qh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if EXACT:
        q = q.to(DOT_DTYPE)
    else:
        if DOT_SCALED:
            q_scale = tl.load(Q_scale + q_rows[:, None] * stride_qst + head_q * stride_qsh + offs_ds[None, :],
                              mask=row_ok[:, None], other=127)
        else:
            q_scale = tl.load(Q_scale + q_rows[:, None] * stride_qst + head_q * stride_qsh + (offs_d // 32)[None, :],
                              mask=row_ok[:, None], other=127)
            q = _dequantize(q, q_scale).to(tl.bfloat16).to(DOT_DTYPE)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    recoveries = tl.zeros((BLOCK_M,), tl.int32)

    # Causal, bottom-right aligned: row i sees keys j <= i + seqlen_k - seqlen_q.
    kv_end = seqlen_k
    if CAUSAL:
        kv_end = tl.minimum(seqlen_k, (block_m + 1) * BLOCK_M + seqlen_k - seqlen_q)
    v_block0 = tl.load(cu_blocks_k + seq)
    for n_start in range(0, kv_end, BLOCK_N):
        keys = n_start + offs_n
        key_ok = keys < seqlen_k
        k_rows = (k_start + keys).to(tl.int64)
        k = tl.load(K + k_rows[None, :] * stride_kt + head_k * stride_kh + offs_d[:, None],
                    mask=key_ok[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N]
        v = tl.load(V + k_rows[:, None] * stride_vt + head_k * stride_vh + offs_d[None, :],
                    mask=key_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        if EXACT:
            s = tl.dot(q, k.to(DOT_DTYPE))
        elif DOT_SCALED:
            k_scale = tl.load(K_scale + k_rows[:, None] * stride_kst + head_k * stride_ksh + offs_ds[None, :],
                              mask=key_ok[:, None], other=127)
            s = tl.dot_scaled(q, q_scale, "e4m3", k, k_scale, "e4m3")
        else:
            k_scale = tl.load(K_scale + k_rows[None, :] * stride_kst + head_k * stride_ksh + (offs_d // 32)[:, None],
                              mask=key_ok[None, :], other=127)
            s = tl.dot(q, _dequantize(k, k_scale).to(tl.bfloat16).to(DOT_DTYPE))
        x = s * scale_log2
        visible = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_m[:, None] + seqlen_k - seqlen_q)
        x = tl.where(visible, x, float("-inf"))
        tile_max = tl.max(x, axis=1)

        if EXACT:
            m_new = tl.maximum(m, tile_max)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(x - m_safe[:, None])
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16).to(DOT_DTYPE), v.to(DOT_DTYPE))
            m = m_new
        else:
            # Note [Frozen reference max]: the tile max is always computed, the max moves only on a
            # recovery (or when it is set for the first time), and the rescale runs only then.
            first = (m == float("-inf")) & (tile_max > float("-inf"))
            recovered = (m > float("-inf")) & (tile_max > m + recovery_threshold)
            m_new = tl.where(first | recovered, tile_max, m)
            if tl.max(recovered.to(tl.int32), axis=0) > 0:
                alpha = tl.where(recovered, tl.exp2(m - m_new), 1.0)
                acc = acc * alpha[:, None]
                row_sum = row_sum * alpha
            recoveries += recovered.to(tl.int32)
            m = m_new

            # Note [Schraudolph exp2 as BF16 bits]
            y = x - m[:, None]
            y_clamped = tl.minimum(tl.maximum(y, -128.0), 128.0)
            bits = (y_clamped * 128.0 + _SCHRAUDOLPH_MAGIC) - _ROUND_MAGIC
            bits = tl.minimum(tl.maximum(bits, 0.0), 32640.0)
            p = bits.to(tl.int32).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
            p = tl.where(y == y, p, float("nan"))
            p = tl.where(x == float("-inf"), 0.0, p)

            # Note [Two-stage P and the row sum]
            p_elements, p_exponent = _quantize_p(p, BLOCK_M, BLOCK_N, P_MANTISSA, P_MIN_EXPONENT, P_MAX_NORMAL,
                                                 P_MAX_MANTISSA_BITS, P_MAX_EXPONENT)
            p_values = _dequantize_p(p_elements, p_exponent, BLOCK_M, BLOCK_N)
            row_sum += tl.sum(p_values, axis=1)
            if DOT_SCALED:
                block_keys = n_start + 32 * tl.arange(0, BLOCK_N // 32)
                v_blocks = v_block0 + block_keys // 32
                v_scale = tl.load(V_scale + v_blocks[None, :].to(tl.int64) * stride_vsb + head_k * stride_vsh
                                  + offs_d[:, None], mask=(block_keys < seqlen_k)[None, :], other=127)
                p_scale = (p_exponent + 127).to(tl.uint8)
                acc = tl.dot_scaled(p_elements.to(tl.float8e4nv), p_scale, "e4m3", v, v_scale, "e4m3", acc)
            else:
                v_blocks = v_block0 + keys // 32
                v_scale = tl.load(V_scale + v_blocks[:, None].to(tl.int64) * stride_vsb + head_k * stride_vsh
                                  + offs_d[None, :], mask=key_ok[:, None], other=127)
                v_values = _dequantize(v, v_scale).to(tl.bfloat16).to(DOT_DTYPE)
                acc = tl.dot(p_values.to(tl.bfloat16).to(DOT_DTYPE), v_values, acc)

    empty = row_sum == 0.0
    out = acc / tl.where(empty, 1.0, row_sum)[:, None]
    out = tl.where(empty[:, None], 0.0, out)
    lse = tl.where(empty, float("-inf"), (m + tl.log2(tl.where(empty, 1.0, row_sum))) * 0.6931471805599453)
    tl.store(Out + q_rows[:, None] * stride_ot + head_q * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(Lse + head_q * stride_lh + q_rows, lse, mask=row_ok)
    if RETURN_RECOVERIES:
        tl.store(Recoveries + head_q * stride_lh + q_rows, recoveries, mask=row_ok)
