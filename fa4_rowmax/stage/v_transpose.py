"""Triton pre-pass of the SM90 FP8 forward: V^T with keys permuted in 16-key groups, and the descales.

FP8 wgmma reads V K-major (keys contiguous), FA4 stores V (batch, keys, kv heads, dim). This pass writes
V^T as (batch, kv heads, dim, keys_padded), keys padded with zeros to a multiple of 16 (TMA strides are
multiples of 16 bytes, and the permutation works on whole groups), and position p of each 16-key group holds
key KEY_ORDER_IN_16[p] of the group (Note [FP8 A operand from the S accumulator], softmax_sm90_fp8.py).
It moves bytes only: e4m3 in, e4m3 out, bit for bit.

With descales it also writes the (batch, kv heads, 2) fp32 tensor (q_descale * k_descale, v_descale) the
kernel reads per work tile (Note [Descales]), so a call launches this kernel and the attention kernel only.
"""

import torch
import triton
import triton.language as tl

from fa4_rowmax.stage.softmax_sm90_fp8 import KEY_ORDER_IN_16

KEY_GROUP = 16
BLOCK_KEYS = 64


@triton.jit
def _v_transpose_kernel(
    v_ptr,
    vt_ptr,
    qd_ptr,
    kd_ptr,
    vd_ptr,
    descale_ptr,
    seqlen_k,
    heads_kv,
    keys_padded,
    stride_vb,
    stride_vs,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    ROWS_OUT: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    HAS_DESCALE: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_V: tl.constexpr,
):
    pid_key = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // heads_kv
    head = pid_bh % heads_kv
    pos = pid_key * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
    # Key held at position p of a 16-key group: [0, 1, 8, 9, 2, 3, 10, 11, ...][p % 16] (KEY_ORDER_IN_16).
    in_group = pos % 16
    src = (pos - in_group) + (in_group // 4) * 2 + (in_group % 2) + ((in_group // 2) % 2) * 8
    dims = tl.arange(0, HEAD_DIM)
    v_rows = v_ptr + batch * stride_vb + head * stride_vh + src[:, None] * stride_vs + dims[None, :]
    tile = tl.load(v_rows, mask=(src < seqlen_k)[:, None], other=0)
    vt_base = vt_ptr + pid_bh.to(tl.int64) * ROWS_OUT * keys_padded
    vt_cols = vt_base + dims[:, None] * keys_padded + pos[None, :]
    tl.store(vt_cols, tl.trans(tile), mask=(pos < keys_padded)[None, :])
    if ROWS_OUT > HEAD_DIM:
        # Note [Row sum by the MMA]: row HEAD_DIM is e4m3 1.0 (0x38) for real keys, the others 0.
        extra = tl.arange(0, ROWS_OUT - HEAD_DIM)
        ones = tl.where((extra[:, None] == 0) & (src[None, :] < seqlen_k), 0x38, 0).to(tl.uint8)
        extra_cols = vt_base + (HEAD_DIM + extra[:, None]) * keys_padded + pos[None, :]
        tl.store(extra_cols, ones, mask=(pos < keys_padded)[None, :])
    if HAS_DESCALE:
        if pid_key == 0:
            qk = 1.0
            if HAS_Q:
                qk = qk * tl.load(qd_ptr + pid_bh)
            if HAS_K:
                qk = qk * tl.load(kd_ptr + pid_bh)
            vd = 1.0
            if HAS_V:
                vd = tl.load(vd_ptr + pid_bh)
            tl.store(descale_ptr + pid_bh * 2, qk)
            tl.store(descale_ptr + pid_bh * 2 + 1, vd)


def padded_keys(seqlen_k: int) -> int:
    return -(-seqlen_k // KEY_GROUP) * KEY_GROUP


def v_transpose(v: torch.Tensor, q_descale=None, k_descale=None, v_descale=None, row_sum_rows: int = 0):
    """V (b, s_k, h_k, d) e4m3 -> (V^T as a (b, s_pad, h_k, d + row_sum_rows) view with key stride 1, descale or None).

    `row_sum_rows` (0 or 8) appends Note [Row sum by the MMA]'s rows: ones for the real keys, then zeros.
    The descales are fp32 (b, h_k) contiguous tensors (validated by the host entry); the returned descale is
    fp32 (b, h_k, 2), or None when all three are None.
    """
    batch, seqlen_k, heads_kv, head_dim = v.shape
    keys_padded = padded_keys(seqlen_k)
    rows_out = head_dim + row_sum_rows
    vt = torch.empty(batch, heads_kv, rows_out, keys_padded, dtype=v.dtype, device=v.device)
    has_descale = any(d is not None for d in (q_descale, k_descale, v_descale))
    descale = torch.empty(batch, heads_kv, 2, dtype=torch.float32, device=v.device) if has_descale else None
    v_bytes, vt_bytes = v.view(torch.uint8), vt.view(torch.uint8)
    placeholder = descale if has_descale else vt_bytes
    grid = (triton.cdiv(keys_padded, BLOCK_KEYS), batch * heads_kv)
    _v_transpose_kernel[grid](
        v_bytes,
        vt_bytes,
        q_descale if q_descale is not None else placeholder,
        k_descale if k_descale is not None else placeholder,
        v_descale if v_descale is not None else placeholder,
        placeholder,
        seqlen_k,
        heads_kv,
        keys_padded,
        v_bytes.stride(0),
        v_bytes.stride(1),
        v_bytes.stride(2),
        HEAD_DIM=head_dim,
        ROWS_OUT=rows_out,
        BLOCK_KEYS=BLOCK_KEYS,
        HAS_DESCALE=has_descale,
        HAS_Q=q_descale is not None,
        HAS_K=k_descale is not None,
        HAS_V=v_descale is not None,
    )
    return vt.permute(0, 3, 1, 2), descale


def v_transpose_reference(v: torch.Tensor, row_sum_rows: int = 0) -> torch.Tensor:
    """The same V^T in torch (tests): (b, h_k, d + row_sum_rows, s_pad) contiguous."""
    batch, seqlen_k, heads_kv, head_dim = v.shape
    keys_padded = padded_keys(seqlen_k)
    padded = torch.zeros(batch, keys_padded, heads_kv, head_dim + row_sum_rows, dtype=torch.uint8, device=v.device)
    padded[:, :seqlen_k, :, :head_dim] = v.view(torch.uint8)
    if row_sum_rows:
        padded[:, :seqlen_k, :, head_dim] = 0x38
    order = torch.tensor(KEY_ORDER_IN_16, device=v.device)
    src = (torch.arange(keys_padded, device=v.device) // KEY_GROUP) * KEY_GROUP + order.repeat(keys_padded // KEY_GROUP)
    return padded[:, src].permute(0, 2, 3, 1).contiguous().view(v.dtype)
