"""Triton pre-pass of the SM90 FP8 forward: V^T with keys permuted in 16-key groups, and the descales.

FP8 wgmma reads V K-major (keys contiguous), FA4 stores V (batch, keys, kv heads, dim). This pass writes
V^T as (batch, kv heads, dim, keys_padded), keys padded with zeros to a multiple of 16 (TMA strides are
multiples of 16 bytes, and the permutation works on whole groups), and position p of each 16-key group holds
key KEY_ORDER_IN_16[p] of the group (Note [FP8 A operand from the S accumulator], softmax_sm90_fp8.py).
It moves bytes only: e4m3 in, e4m3 out, bit for bit. Varlen V (total_k, kv heads, dim) gets one V^T range
per sequence, at FA4's padded varlen offsets (Note [Varlen V^T]).

With descales it also writes the (batch, kv heads, 2) fp32 tensor (q_descale * k_descale, v_descale) the
kernel reads per work tile (Note [Descales]), and for a persistent grid it zeroes the tile counter (Note [The
counter zeroed by the pre-pass]), so a call launches this kernel and the attention kernel only.

Note [The counter zeroed by the pre-pass]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The persistent grid's CTAs take work tiles from a global counter that must read 0 when the attention kernel starts
(Note [Dynamic persistent order], tile_scheduler_sm90.py); the slots beside it are written before they are read.
A separate `torch.zeros` is a kernel launch of its own on every call, its run and the gap before the next launch
(~2-3 us, a quarter to a third of a per-cent at 8K causal). The dense pre-pass runs on the same stream right
before the attention kernel, so its first program stores the 0 instead, and stream order makes the store visible
to the attention kernel's first atomic add.

Note [Varlen V^T]
~~~~~~~~~~~~~~~~~
With packed keys a sequence starts at any cu_seqlens_k[b], and the permutation works on 16-key groups counted
from the sequence's first key (the kernel's KV tiles start there), so V^T cannot share K's offsets: the last
group of one sequence and the first of the next would claim the same columns. Each sequence b gets its own
V^T range, starting at column `start(b) = (cu_seqlens_k[b] + b * tile_n) // tile_n * tile_n`, which is FA4's
`SeqlenInfoQK.padded_offset_k` (seqlen_info.py) with the kernel's tile_n: the kernel reads V^T there through
one narrow seam (`FlashAttentionForwardSm90Fp8.load`, Note [V^T at FA4's padded offsets]) while Q, K, O and
the LSE keep FA4's own varlen offsets. start(b + 1) - start(b) is a multiple of tile_n above the sequence's
length, so a sequence's range holds all of its KV tiles: the pass writes the range whole (keys, then zeros),
V^T has start(batch) <= total_k + batch * tile_n columns, and no tile reads another sequence's V or unwritten
memory (so, unlike K, V^T of a sequence's last tile is 0 past its end: masked P = 0 times 0 stays 0, and a
NaN in one sequence's V cannot reach another's rows through it). Only a tile with no key at all (a sequence
with no keys, or causal rows before a sequence's first visible key, FA4's `n_block = -1`) reads the tail of
the previous range, as FA4's BF16 varlen kernel reads the previous sequence's V there. Cost: the pass reads
V once and writes V^T once, as the dense pass does, plus at most 2 tiles of zeros per sequence. The other
option, a zero-padded copy of K with padded cu_seqlens_k and the true lengths as seqused_k (no kernel seam),
moves K in and out once more: 2 * total_k * heads_kv * head_dim bytes, as much as the V^T pass itself.
The pass finds a block's sequence by binary search over start(b) (strictly increasing), so it needs no host
read of the lengths; tile_n is a multiple of 32 (fa4_rowmax.config.FP8_TILE_NS), so a 32-key block never straddles two
ranges.
"""

import torch
import triton
import triton.language as tl

from fa4_rowmax.stage.softmax_sm90_fp8 import KEY_ORDER_IN_16

KEY_GROUP = 16
BLOCK_KEYS = 64
VARLEN_BLOCK_KEYS = 32  # divides every tile_n (Note [Varlen V^T])
NUM_WARPS = 4  # Triton's default; studies/fp8_two_level/probe_speed.py --vt-only sweeps both


@triton.jit
def _key_in_group(pos):
    """The key at position `pos`: [0, 1, 8, 9, 2, 3, 10, 11, ...][pos % 16] of pos's 16-key group (KEY_ORDER_IN_16)."""
    in_group = pos % 16
    return (pos - in_group) + (in_group // 4) * 2 + (in_group % 2) + ((in_group // 2) % 2) * 8


@triton.jit
def _write_descale(
    qd_ptr, kd_ptr, vd_ptr, descale_ptr, idx, HAS_Q: tl.constexpr, HAS_K: tl.constexpr, HAS_V: tl.constexpr
):
    """(q_descale * k_descale, v_descale) of (batch, kv head) `idx` (Note [Descales])."""
    qk = 1.0
    if HAS_Q:
        qk = qk * tl.load(qd_ptr + idx)
    if HAS_K:
        qk = qk * tl.load(kd_ptr + idx)
    vd = 1.0
    if HAS_V:
        vd = tl.load(vd_ptr + idx)
    tl.store(descale_ptr + idx * 2, qk)
    tl.store(descale_ptr + idx * 2 + 1, vd)


@triton.jit
def _write_vt_block(v_rows, is_key, vt_cols, in_range, row_stride, HEAD_DIM: tl.constexpr, ROWS_OUT: tl.constexpr):
    """Write the V^T columns `vt_cols` (pointers into V^T row 0) where `in_range`: V's rows `v_rows` (pointers to
    dim 0) where `is_key`, 0 elsewhere; with ROWS_OUT > HEAD_DIM also Note [Row sum by the MMA]'s rows (e4m3 1.0
    = 0x38 for keys, then 0)."""
    dims = tl.arange(0, HEAD_DIM)
    tile = tl.load(v_rows[:, None] + dims[None, :], mask=is_key[:, None], other=0)
    tl.store(vt_cols[None, :] + dims[:, None] * row_stride, tl.trans(tile), mask=in_range[None, :])
    if ROWS_OUT > HEAD_DIM:
        extra = tl.arange(0, ROWS_OUT - HEAD_DIM)
        ones = tl.where((extra[:, None] == 0) & is_key[None, :], 0x38, 0).to(tl.uint8)
        tl.store(vt_cols[None, :] + (HEAD_DIM + extra[:, None]) * row_stride, ones, mask=in_range[None, :])


@triton.jit
def _v_transpose_kernel(
    v_ptr,
    vt_ptr,
    qd_ptr,
    kd_ptr,
    vd_ptr,
    descale_ptr,
    counter_ptr,
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
    HAS_COUNTER: tl.constexpr,
):
    pid_key = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // heads_kv
    head = pid_bh % heads_kv
    pos = pid_key * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
    src = _key_in_group(pos)
    v_rows = v_ptr + batch * stride_vb + head * stride_vh + src * stride_vs
    vt_cols = vt_ptr + pid_bh.to(tl.int64) * ROWS_OUT * keys_padded + pos
    _write_vt_block(v_rows, src < seqlen_k, vt_cols, pos < keys_padded, keys_padded, HEAD_DIM, ROWS_OUT)
    if HAS_DESCALE:
        if pid_key == 0:
            _write_descale(qd_ptr, kd_ptr, vd_ptr, descale_ptr, pid_bh, HAS_Q, HAS_K, HAS_V)
    if HAS_COUNTER:
        if pid_key + pid_bh == 0:  # Note [The counter zeroed by the pre-pass]
            tl.store(counter_ptr, 0)


@triton.jit
def _vt_start(cu_seqlens_ptr, b, TILE: tl.constexpr):
    """Column where sequence b's V^T range starts (FA4's padded_offset_k, Note [Varlen V^T])."""
    return (tl.load(cu_seqlens_ptr + b) + b * TILE) // TILE * TILE


@triton.jit
def _v_transpose_varlen_kernel(
    v_ptr,
    vt_ptr,
    cu_seqlens_ptr,
    qd_ptr,
    kd_ptr,
    vd_ptr,
    descale_ptr,
    batch,
    heads_kv,
    columns,
    stride_vs,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    ROWS_OUT: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    HAS_DESCALE: tl.constexpr,
    HAS_Q: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_V: tl.constexpr,
):
    col0 = tl.program_id(0) * BLOCK_KEYS
    head = tl.program_id(1)
    # The sequence whose range holds col0: start(lo) <= col0 < start(hi), start(batch) = columns.
    lo = tl.program_id(0) * 0
    hi = lo + batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = _vt_start(cu_seqlens_ptr, mid, TILE) <= col0
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    first_key = tl.load(cu_seqlens_ptr + lo)
    seqlen = tl.load(cu_seqlens_ptr + lo + 1) - first_key
    pos = col0 - _vt_start(cu_seqlens_ptr, lo, TILE) + tl.arange(0, BLOCK_KEYS)
    src = _key_in_group(pos)
    v_rows = v_ptr + (first_key + src).to(tl.int64) * stride_vs + head * stride_vh
    vt_cols = vt_ptr + head.to(tl.int64) * ROWS_OUT * columns + col0 + tl.arange(0, BLOCK_KEYS)
    every = tl.full((BLOCK_KEYS,), 1, tl.int1)  # the grid covers the `columns` exactly
    _write_vt_block(v_rows, src < seqlen, vt_cols, every, columns, HEAD_DIM, ROWS_OUT)
    if HAS_DESCALE:
        if col0 == _vt_start(cu_seqlens_ptr, lo, TILE):
            _write_descale(qd_ptr, kd_ptr, vd_ptr, descale_ptr, lo * heads_kv + head, HAS_Q, HAS_K, HAS_V)


def padded_keys(seqlen_k: int) -> int:
    return -(-seqlen_k // KEY_GROUP) * KEY_GROUP


def varlen_vt_start(first_key, b, tile_n: int):
    """Column where sequence b's V^T range starts (Note [Varlen V^T]); ints or tensors. With the total key count
    and b = batch: the number of V^T columns."""
    return (first_key + b * tile_n) // tile_n * tile_n


def _descale_args(q_descale, k_descale, v_descale, batch: int, heads_kv: int, device, placeholder):
    has_descale = any(d is not None for d in (q_descale, k_descale, v_descale))
    descale = torch.empty(batch, heads_kv, 2, dtype=torch.float32, device=device) if has_descale else None
    stand_in = descale if has_descale else placeholder
    pointers = [d if d is not None else stand_in for d in (q_descale, k_descale, v_descale)] + [stand_in]
    flags = dict(
        HAS_DESCALE=has_descale, HAS_Q=q_descale is not None, HAS_K=k_descale is not None, HAS_V=v_descale is not None
    )
    return descale, pointers, flags


def v_transpose(v: torch.Tensor, q_descale=None, k_descale=None, v_descale=None, row_sum_rows: int = 0, counter=None):
    """V (b, s_k, h_k, d) e4m3 -> (V^T as a (b, s_pad, h_k, d + row_sum_rows) view with key stride 1, descale or None).

    `row_sum_rows` (0 or 8) appends Note [Row sum by the MMA]'s rows: ones for the real keys, then zeros.
    The descales are fp32 (b, h_k) contiguous tensors (validated by the host entry); the returned descale is
    fp32 (b, h_k, 2), or None when all three are None. `counter`, an int32 tensor on v's device, gets 0 in its
    first element (Note [The counter zeroed by the pre-pass]).
    """
    if counter is not None and (counter.dtype != torch.int32 or counter.device != v.device or counter.numel() < 1):
        raise ValueError(
            f"counter must be an int32 tensor of at least one element on v's device {v.device}, got "
            f"{counter.dtype} of {counter.numel()} elements on {counter.device}"
        )
    batch, seqlen_k, heads_kv, head_dim = v.shape
    keys_padded = padded_keys(seqlen_k)
    rows_out = head_dim + row_sum_rows
    vt = torch.empty(batch, heads_kv, rows_out, keys_padded, dtype=v.dtype, device=v.device)
    v_bytes, vt_bytes = v.view(torch.uint8), vt.view(torch.uint8)
    descale, pointers, flags = _descale_args(q_descale, k_descale, v_descale, batch, heads_kv, v.device, vt_bytes)
    grid = (triton.cdiv(keys_padded, BLOCK_KEYS), batch * heads_kv)
    _v_transpose_kernel[grid](
        v_bytes,
        vt_bytes,
        *pointers,
        counter if counter is not None else vt_bytes,
        seqlen_k,
        heads_kv,
        keys_padded,
        v_bytes.stride(0),
        v_bytes.stride(1),
        v_bytes.stride(2),
        HEAD_DIM=head_dim,
        ROWS_OUT=rows_out,
        BLOCK_KEYS=BLOCK_KEYS,
        **flags,
        HAS_COUNTER=counter is not None,
        num_warps=NUM_WARPS,
    )
    return vt.permute(0, 3, 1, 2), descale


def v_transpose_varlen(
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    tile_n: int,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    row_sum_rows: int = 0,
):
    """Varlen V (total_k, h_k, d) e4m3 with int32 cu_seqlens_k (batch + 1) -> (V^T as a (columns, h_k, d +
    row_sum_rows) view with key stride 1, sequence b's range at `varlen_vt_start(cu_seqlens_k[b], b, tile_n)`
    (Note [Varlen V^T]); descale (b, h_k, 2) or None), as `v_transpose`. cu_seqlens_k must start at 0, never
    decrease and end at total_k (the host entry checks it)."""
    total_k, heads_kv, head_dim = v.shape
    batch = cu_seqlens_k.numel() - 1
    columns = varlen_vt_start(total_k, batch, tile_n)
    rows_out = head_dim + row_sum_rows
    vt = torch.empty(heads_kv, rows_out, columns, dtype=v.dtype, device=v.device)
    v_bytes, vt_bytes = v.view(torch.uint8), vt.view(torch.uint8)
    descale, pointers, flags = _descale_args(q_descale, k_descale, v_descale, batch, heads_kv, v.device, vt_bytes)
    grid = (columns // VARLEN_BLOCK_KEYS, heads_kv)
    _v_transpose_varlen_kernel[grid](
        v_bytes,
        vt_bytes,
        cu_seqlens_k,
        *pointers,
        batch,
        heads_kv,
        columns,
        v_bytes.stride(0),
        v_bytes.stride(1),
        HEAD_DIM=head_dim,
        ROWS_OUT=rows_out,
        TILE=tile_n,
        BLOCK_KEYS=VARLEN_BLOCK_KEYS,
        **flags,
    )
    return vt.permute(2, 0, 1), descale


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


def v_transpose_varlen_reference(v: torch.Tensor, cu_seqlens_k: torch.Tensor, tile_n: int, row_sum_rows: int = 0):
    """The varlen V^T in torch (tests): (h_k, d + row_sum_rows, columns) contiguous, each sequence's dense V^T
    (`v_transpose_reference`) at its start, zeros elsewhere."""
    total_k, heads_kv, head_dim = v.shape
    cu = cu_seqlens_k.tolist()
    vt = torch.zeros(
        heads_kv,
        head_dim + row_sum_rows,
        varlen_vt_start(total_k, len(cu) - 1, tile_n),
        dtype=torch.uint8,
        device=v.device,
    )
    for b, (first, end) in enumerate(zip(cu[:-1], cu[1:])):
        start = varlen_vt_start(first, b, tile_n)
        dense = v_transpose_reference(v[None, first:end], row_sum_rows)[0].view(torch.uint8)
        vt[:, :, start : start + dense.shape[-1]] = dense
    return vt.view(v.dtype)
