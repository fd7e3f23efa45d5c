"""SM90 (Hopper) FP8 forward for FlashAttention-4: e4m3 Q/K/V, BF16 O, fp32 LSE.

A subclass of FA4's `FlashAttentionForwardSm90` that overrides only what FP8 changes:

- `_check_type`: e4m3 Q, K and V^T, BF16 O.
- `_get_tiled_mma`: e4m3 wgmma (K = 32, both operands K-major, P from registers).
- `_get_smem_layout_atom`: one BF16 head-dim atom for FA4's (unused here) cp.async copy shapes.
- `_get_shared_storage_cls`: V^T's K-major shared layout, and a Q buffer big enough for the BF16 O that reuses
  it (Note [FP8 kernel dtypes]).
- `first_half_block_overlap` / `mma_one_n_block_intrawg_overlap`: the softmax stage writes the e4m3 P
  operand (`Fp8SoftmaxSm90.write_p`) where FA4 converts to 16 bits, and the first block loads the tile's
  descales (Note [Descales] in softmax_sm90_fp8.py).
- `last_half_block_overlap`: with row_sum="mma", the row sums from O's extra column (Note [Row sum by the
  MMA] in softmax_sm90_fp8.py).
- `mma_one_n_block` (no intra-warpgroup overlap): the e4m3 P operand, two-level promotion, and with
  `arrive_after_pv` the hand-over to the other warpgroup right after the P.V GEMM (Note [Scheduler window after
  the P.V GEMM]).
- `load`: FA4's producer, reading a varlen V^T at its own offsets (Note [V^T at FA4's padded offsets]).
- tile_m 128 or 192: two or three consumer warpgroups (Note [Three consumer warpgroups]).
- `epilogue`: FA4's, on O's head_dim columns alone with o_store="head_dim" (Note [O's tile without the row-sum
  columns]); with warpgroup_epilogue="own" each warpgroup's rows stored by that warpgroup (Note [Each warpgroup's
  own tile boundary]).
- `mma`: FA4's; with warpgroup_epilogue="own" Q released by the last block's S GEMM (the same Note).

Everything else (producer warp and TMA, pipelines, masking, tile schedulers, ping-pong of the two consumer
warpgroups, epilogue) is FA4's. Supported: dense batches and varlen (cu_seqlens_q/k, seqused_q/k), head dim
64 and 128, causal (bottom-right) or not, GQA (pack_gqa), seqlens off the tile grid. The host entry is
`fa4_rowmax.fp8_sm90`.

Note [FP8 kernel dtypes]
~~~~~~~~~~~~~~~~~~~~~~~~
FA4's SM90 kernel has one `self.dtype` for Q, K, V and O. Here `self.dtype` is the *output* dtype (BF16):
FA4 uses it for the O epilogue (register convert, shared-memory store atom, TMA store) and for the view of
the Q buffer that O reuses, while the shared layouts and TMA atoms of Q, K and V take their element type
from the tensors (e4m3). The Q buffer is sized for the larger of Q (e4m3) and O (BF16, twice the bytes at
equal head dims).

Note [V^T in shared memory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
FP8 wgmma reads both operands K-major, so the PV GEMM needs V with keys contiguous. The host passes V^T
(written by `v_transpose.py`, keys permuted inside 16-key groups) as a (batch, keys, heads, dim) tensor whose
key stride is 1, and its shared tile (tile_n, head_dim_v) is laid out column-major (keys contiguous, 128-byte
swizzle along them). FA4's `__call__` builds the shared layouts, then asks `_get_shared_storage_cls` for the
storage, then builds the TMA atoms and launches with `self.sV_layout`; so the override sets V's layout there,
before the storage and the TMA atom are made from it. FA4's `transpose_view(sV)` then gives the K-major
(head_dim_v, tile_n) operand.

Note [Scheduler window after the P.V GEMM]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The two consumer warpgroups take turns issuing GEMMs through FA4's named barriers: a warpgroup's window runs
from its `warp_scheduler_barrier_sync` to its `warp_scheduler_barrier_arrive`, and the other warpgroup issues
nothing meanwhile. Without intra-warpgroup overlap FA4's step syncs before the P.V GEMM and arrives after issuing
the next tile's S, so one window holds the P.V GEMM, its wait, whatever follows it (two-level: the promotion, one
FFMA per O element) and the next S's issue; the tensor cores idle from the P.V GEMM's end to that issue, twice
per pair of tiles. With `arrive_after_pv` the warpgroup arrives as soon as its P.V GEMM has finished: the other
warpgroup's P.V GEMM starts at once, and this one's promotion and next S issue run beside it. The counts stay
FA4's (one sync before the loop and one per P.V GEMM; one arrive per hand-over plus FA4's after the loop): the
first block still arrives after its S, and block 0, the last block of every work tile (n_block_min is 0: no
local window, no KV split), leaves its hand-over to FA4's arrive after the loop. The other warpgroup's softmax
must then fit beside one GEMM instead of two, so this is a measured choice (`arrive_after_pv`, off by default: it
pays for the exp2-deleted probe and H15 at tile 224, and loses at tile 256 and for the MUFU-bound exact twin;
docs/fp8_sm90.md, "Levers").

Note [Three consumer warpgroups]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Without intra-warpgroup overlap a consumer warpgroup's tile is a chain: its S GEMM, its softmax, its P.V GEMM, the
promotion; only the other warpgroups' GEMMs run under its softmax. With two warpgroups at tile 256 the softmax
outlasts the other's two GEMMs (on the H200, Nsight Compute at 8K keys: ~1,600 cycles of rowmax_h15 softmax at
~0.33 instructions a cycle beside ~1,060 tensor cycles of the other warpgroup), so the tensor pipe idles ~40 % of
the time. tile_m=192 runs three consumer warpgroups (64 rows each; FA4's register split gives 160 registers a
thread), so two other warpgroups' GEMMs run under each softmax. At 160 registers only tile_n <= 160 fits beside O
and the fresh accumulator (with the MMA row sum's 8 columns a few registers spill around the P.V GEMM, bounded in
tests/test_compile_sm90_fp8.py), and intra-warpgroup overlap does not fit at all (the host refuses both); where
three warpgroups are the default is Note [Tuned defaults] (fp8_sm90.py). FA4 runs three warpgroups without overlap
with no scheduler barrier (`use_scheduler_barrier`): the warpgroups issue their GEMMs as they are ready, and that is
the default here. Their softmaxes then overlap on every SMSP, which the three consumer warps share; for H15 and the
exact twin at head dim 128 that shared issue is what binds, and ordering the GEMMs only adds a wait for each turn
(docs/fp8_sm90.md, Budget and Levers, from the H200's profile and timings). `scheduler_barrier=True` takes FA4's
round-robin instead (the one its overlapped three-warpgroup step uses): a warpgroup issues its P.V GEMM and its next
S GEMM between its sync and its arrive, and the arrive wakes the next warpgroup, so the three take the tensor pipe
in turn and their softmaxes are staggered; that pays where the MUFU binds (the exact twin at head dim 64). Its
hand-over is FA4's, after the next S GEMM's issue, so a warpgroup holds the tensor pipe through its P.V GEMM's wait
and its promotion; with `arrive_after_pv` (Note [Scheduler window after the P.V GEMM]) it hands over as soon as its
P.V GEMM is done, the same count of arrives, each earlier.
Values do not depend on tile_m: a row's arithmetic is its warpgroup's, whichever Q tile holds it (tests check tile_m
192 against 128 bit for bit).

Note [O's tile without the row-sum columns]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With row_sum="mma" the P.V GEMM carries head_dim + 8 columns (Note [Row sum by the MMA]) and FA4 stages O's tile in
shared memory and stores it by TMA at that width. 136 columns of BF16 have no 128-byte swizzle, so FA4's epilogue
issues (head_dim + 8) / 8 TMA stores of 16-byte rows (17 at head dim 128, against 2 at 128 columns: SASS, CPU
compile), once per work tile. The H200 puts about 0.1 ms a call more of fixed cost on the MMA row sum than on the
FADD one at head dim 128, whatever the KV heads (studies/fp8_sm90/results/fixed_cost.md, the thirteenth session's
last call), which this store may carry. o_store="head_dim" gives O's shared tile and TMA store head_dim columns
(FA4's seam `o_store_columns`, patch 0002) and the epilogue a head_dim-wide view of O: the wgmma accumulator holds
a row's columns in chunks of 8, one after another in each thread's registers, so O's first head_dim columns are
the first head_dim / 8 chunks, the whole of an N = head_dim accumulator (`_tiled_mma_pv(head_dim)`), and the row
sum's chunk, read before the epilogue (`row_sum_from_acc_O`), is left out. Values are unchanged.

Note [Persistent work tiles]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With `persistent` (dense batches) the grid is one CTA per SM and each CTA walks work tiles in FA4's own producer
and consumer loops (`tile_scheduler_sm90.DynamicPersistentTileScheduler`, Note [Dynamic persistent order], through
FA4's seam `select_tile_scheduler`, patch 0002). The consumers release Q before a tile's last P.V GEMM, so the
producer loads the next tile's Q while this tile's last GEMM and epilogue run. FA4 stages O's tile in Q's buffer,
which that load would then overwrite, or be overwritten by: O's BF16 bytes read as e4m3 Q include NaNs (0x7F,
0xFF), the rows of NaN the withdrawn persistent grid of commit 549de6f produced (docs/fp8_sm90.md, Levers). So O
gets a shared region of its own, a struct field (`o_smem_tensor`, FA4's seam, patch 0002), not an offset into Q's
buffer. Its reuse from tile to tile is FA4's: the epilogue's first barrier waits for every consumer thread,
including the warp that awaited the previous tile's O store (`cp_async_bulk_wait_group(0, read=True)`). At head
dim 128, tile 256, shared memory is 16 KB of Q, 32 KB of O, 64 KB of K and 68 KB of V^T (two stages).
O's region is longer than O's tile where FA4's epilogue writes past it: the epilogue stores O's tile through StMatrix,
16 columns for each pair of 8-column chunks, so a tile of 72 or 136 columns (row_sum="mma" with o_store="pv_columns":
an odd count of 8-column chunks) is cut into ceil(columns / 16) pairs and the upper half-warp's last chunk lands at
columns head_dim + 8 .. head_dim + 15, tile_m x 8 BF16 past the tile (`o_store_overrun`; traced without a GPU in
tests/test_compile_sm90_fp8.py). Over Q's buffer (FA4's grid) that lands in K's, which no one reads after the last
tile's main loop; O's own region ends the allocation, and without the padding the H200 faulted there (an illegal
address at head dim 64, tile 192: studies/fp8_sm90/persistent_fault.py, bench/results/h200_2026-12-04_s16/).

Note [O store wait on the persistent grid]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FA4's epilogue has its store warp (warp 4) wait for O's TMA store to read O's shared tile right after issuing it:
on FA4's grid the CTA exits next, and its shared memory must outlive the read. On the persistent grid every consumer
thread meets the store warp at the next tile's slot barrier (Note [Dynamic persistent order]), so all of them waited
for that read at every tile boundary with the tensor cores idle: in Nsight Compute the consumers' largest stall
outside the main loop (bench/results/h200_2026-12-04_s18/ncu_persistent/, three warpgroups at 32K: 2,346 samples at
the slot barrier, the per-tile grid's CTA exit 2,078). The read only has to finish before O's tile is written again,
so on the persistent grid `wait_o_store` (FA4's seam, patch 0004) does nothing after the store; the store warp
waits at the start of the next epilogue, before FA4's first epilogue barrier, which every consumer thread passes
before it writes O's tile; and after the last tile, before the CTA exits (`advance_to_next_work`, when the next
tile number is past the last). On the H200 (bench/results/h200_2026-12-04_s19/, two runs) this made the persistent
grid 2-4 % faster at head dim 128 causal from 2K to 16K and 0-3 % elsewhere (more at short rows), the outputs bit
for bit FA4's grid's (the GPU tests with one KV tile per work tile, the shortest window).

Note [The masked half of the first KV tile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A work tile's first KV tile (FA4 walks n blocks down from n_block_max - 1) is where its last visible key falls:
the causal diagonal, or the end of seqlen_k. When that key falls in the tile's first half, every key of the second
half is masked for every row of the tile: with tile_m 128 and tile_n 256 under a causal mask that is every other
m block, a quarter of a tile's GEMM work that FA4 computes and then masks away (3.1 % of all the GEMM work at 8K
causal against 1.6 % with tiles of 128 keys; 12 % against 6 % at 2K). With masked_half="skip" (two-level
accumulation without intra-warpgroup overlap, tile_n/2 a multiple of 32) `mma_one_n_block` runs the first KV
tile's S GEMM as two at N = tile_n/2, the second (keys tile_n/2 on) only where the tile does not qualify, and its
P.V GEMM over the first tile_n/2 keys where it does. The S halves are views of one S accumulator: a wgmma's
accumulator registers at a narrower N are the first ones of the wider (columns in groups of 8, the group the
slowest index), so the halves are its first and second halves. The skipped half is set to -inf once its GEMM is
done, and FA4's mask writes -inf there as over computed values (a select, not an add), so the softmax, its row max
and row sum see what they saw; the P bytes there are 0, so the P.V k-steps skipped would have added 0 x V: O is bit
for bit FA4's where V is finite. A NaN or Inf in V's keys of the skipped half (keys no row of the tile sees) no
longer reaches the tile's rows through 0 x Inf, as it does through FA4's full GEMM. Which tiles qualify is FA4's own
geometry: `BlockInfo` at tile_n/2 (causal offset, pack_gqa, seqlen_k) gives an odd n_block_max exactly when the last
visible key is in a first half. `mma` partitions both halves of K's shared buffer with the half-N tiled MMA, where
FA4 has them, for `mma_one_n_block`. ptxas keeps the wgmmas pipelined only if each branch waits for what it issued
and the S accumulator is written by the same wgmmas on both paths (a full-N GEMM in one branch and a half-N one in
the other, on one accumulator, serialized every wgmma of the kernel: C7511, "insufficient register resources").
Note [Each warpgroup's own tile boundary]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FA4's consumer warpgroups meet at every work tile's end: without intra-warpgroup overlap Q is released after the
tile's last P.V GEMM, the epilogue's first barrier waits for every consumer thread, one warp stores the whole O tile
by TMA, and on the persistent grid every consumer thread takes the next tile's number at one slot barrier (Note
[Dynamic persistent order]). FA4's ping-pong keeps the two warpgroups half a block apart (each one's softmax under
the other's GEMMs), so at each boundary the leading warpgroup waits for the other, and the next tile restarts the
ping-pong from both at once: their first S GEMMs back to back, then the tensor cores idle under the first softmax.
In Nsight Compute (H15 at two warpgroups, 8K non-causal, tile 256, FA4's grid; the eleventh and thirteenth
sessions' reports, studies/fp8_sm90/tile_boundary.py) a consumer warp spends ~1,000 cycles a work tile waiting at
barriers outside its wgmma waits (the epilogue's, Q's, the first scheduler hand-over) and its first block's wgmma
waits take ~850 cycles more than a main-loop block's: ~1,800 cycles, 1.6 % of a work tile of 31 blocks, twice that
share at 8K causal, where a work tile holds half as many.
With warpgroup_epilogue="own" (the persistent grid, no intra-warpgroup overlap, no packed GQA, O's tile at head_dim
columns) each warpgroup crosses the boundary alone:
- it releases Q right after its last S GEMM (n block 0 is the last FA4 walks: no local window, no KV split); the
  release still needs every warpgroup, and the producer then loads the next tile's Q under this tile's last
  softmax, P.V GEMM and epilogue instead of after them;
- it stores its own 64 rows of O: StMatrix into its rows of O's shared tile, then 16-byte shared loads and global
  stores by its 128 threads (rows past seqlen_q left out), between two barriers of its own (tile_scheduler_sm90
  EPILOGUE_BARRIERS): the first keeps every write after the warpgroup's reads of the previous tile's rows, the second
  every read after the writes; no TMA store is left to wait for;
- it takes the next tile's number at its own slot barrier (tile_scheduler_sm90, `per_warpgroup`).
FA4's scheduler barriers keep their order: a warpgroup syncs and arrives as often in each tile as before (once
before its first S GEMM and before each P.V GEMM; after each S GEMM and after its last P.V), so the ping-pong runs
on across the boundary with the warpgroups still half a block apart, and neither can arrive twice before the other
syncs. O and the LSE are the same values, written by other instructions.

Note [V^T at FA4's padded offsets]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A varlen V^T holds sequence b's keys from FA4's padded offset `padded_offset_k` with the kernel's tile_n, not
from cu_seqlens_k[b] (Note [Varlen V^T], v_transpose.py). FA4's producer (`load`) offsets both K and V with
`seqlen.offset_batch_K(mX, batch_idx, dim=3)` on the `SeqlenInfoQK` its `SeqlenInfoCls(batch_idx)` returns, and
FA4's `offset_batch_K(..., padded=True)` already moves a tensor to `padded_offset_k`. So `load` hands FA4's
producer a `SeqlenInfoCls` whose objects (`SeqlenInfoQKVt`, built with tile_n = self.tile_n) take the padded
offset for the one tensor that is V^T (compared by identity at trace time, the tensor `load` was given) and
FA4's offset for everything else; the rest of the producer, and the consumers (which never offset V), are
FA4's. The seam records that it moved V^T, and the trace fails if FA4's producer stops offsetting V through it
(tests/test_fp8_sm90_varlen.py also pins the FA4 lines it relies on).
"""

from dataclasses import dataclass, fields, replace
from functools import partial
from types import SimpleNamespace
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils_basic
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum
from flash_attn.cute import copy_utils, utils
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from quack import layout_utils, sm90_utils

from fa4_rowmax.stage.softmax_sm90_fp8 import ROW_SUM_COLUMNS, Fp8SoftmaxSm90
from fa4_rowmax.stage.tile_scheduler_sm90 import (
    EPILOGUE_BARRIERS,
    O_STORE_WARP,
    WARPGROUP_THREADS,
    dynamic_persistent_scheduler,
)

OPERAND_DTYPE = cutlass.Float8E4M3FN
OUTPUT_DTYPE = cutlass.BFloat16
O_STORE_PAIR_COLUMNS = 16  # FA4's epilogue StMatrix store: two 8-column chunks a pair (Note [Persistent work tiles])


def o_store_overrun(tile_m: int, columns: int) -> int:
    """BF16 elements FA4's epilogue writes past an O tile of `columns` columns (Note [Persistent work tiles])."""
    return tile_m * (-columns % O_STORE_PAIR_COLUMNS)


@dataclass(frozen=True)
class SeqlenInfoQKVt(SeqlenInfoQK):
    """FA4's `SeqlenInfoQK`, whose `offset_batch_K` moves the V^T tensor `vt` to FA4's padded offset (Note [V^T at
    FA4's padded offsets]); `moved` (a list) records each such move at trace time."""

    vt: Optional[cute.Tensor] = None
    moved: Optional[list] = None

    @staticmethod
    def create(batch_idx, *, seqlen_info_cls: Callable, vt: cute.Tensor, tile_n: int, moved: list):
        stock = seqlen_info_cls(batch_idx, tile_n=tile_n)
        return SeqlenInfoQKVt(**{f.name: getattr(stock, f.name) for f in fields(SeqlenInfoQK)}, vt=vt, moved=moved)

    def offset_batch_K(self, mK, batch_idx, dim, padded=False, ragged=False, multiple=1):
        if const_expr(mK is self.vt and self.has_cu_seqlens_k):
            assert not (padded or ragged) and multiple == 1, "V^T is offset once, at its padded start"
            self.moved.append(dim)
            padded = True
        return super().offset_batch_K(mK, batch_idx, dim, padded=padded, ragged=ragged, multiple=multiple)


@cute.jit
def gemm_k_blocks(
    tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, k_blocks: cutlass.Constexpr[int]
):
    """quack's `sm90_utils.gemm` (zero_init, no wait) over the first `k_blocks` k32 steps of tCrA/tCrB instead of all:
    Note [The masked half of the first KV tile]."""
    warpgroup.fence()
    mma_atom = cute.make_mma_atom(tiled_mma.op)
    mma_atom.set(warpgroup.Field.ACCUMULATE, False)
    for k in cutlass.range_constexpr(k_blocks):
        cute.gemm(mma_atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        mma_atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def pv_gemm_operands(mma_pv_fn: partial) -> tuple:
    """(tiled_mma_pv, acc_O, tOrP, tOrVt) of FA4's `mma_pv_fn`, `partial(sm90_utils.gemm_w_idx, tiled_mma_pv, acc_O,
    tOrP, tOrVt)` (its `mma`), possibly wrapped in another partial that sets zero_init; checked at trace time."""
    if mma_pv_fn.func is not sm90_utils.gemm_w_idx or len(mma_pv_fn.args) != 4:
        raise TypeError(
            "FA4's mma_pv_fn is no longer partial(sm90_utils.gemm_w_idx, tiled_mma_pv, acc_O, tOrP, tOrVt): the "
            "two-level accumulation seam (Note [Two-level P.V accumulation]) must be ported"
        )
    return mma_pv_fn.args


def qk_gemm_operands(mma_qk_fn: partial) -> tuple:
    """(tiled_mma_qk, tSrQ, tSrK) of FA4's `mma_qk_fn`, `partial(sm90_utils.gemm_zero_init, tiled_mma_qk, (tile_m,
    tile_n), tSrQ, tSrK)`; checked at trace time."""
    if mma_qk_fn.func is not sm90_utils.gemm_zero_init or len(mma_qk_fn.args) != 4:
        raise TypeError(
            "FA4's mma_qk_fn is no longer partial(sm90_utils.gemm_zero_init, tiled_mma_qk, shape, tSrQ, tSrK): the "
            "seam of Note [The masked half of the first KV tile] must be ported"
        )
    tiled_mma_qk, _, tSrQ, tSrK = mma_qk_fn.args
    return tiled_mma_qk, tSrQ, tSrK


def pv_gemm_fresh(mma_pv_fn: partial, B_idx: Int32, wg_wait: int) -> cute.Tensor:
    """FA4's PV GEMM into a fresh accumulator of O's layout (zero_init: scale-d 0 on the first k32 step), returned."""
    tiled_mma_pv, acc_O, tOrP, tOrVt = pv_gemm_operands(mma_pv_fn)
    acc_PV = cute.make_rmem_tensor_like(acc_O, Float32)
    sm90_utils.gemm_w_idx(tiled_mma_pv, acc_PV, tOrP, tOrVt, zero_init=True, B_idx=B_idx, wg_wait=wg_wait)
    return acc_PV


@dataclass
class FirstTileHalf:
    """What `mma_one_n_block` needs for Note [The masked half of the first KV tile]: FA4's `BlockInfo` at tile_n/2,
    the half-N tiled MMA and its Q and K fragments (the first tile_n/2 rows of each K stage)."""

    block_info: object
    tiled_mma_qk: cute.TiledMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tSrK_upper: cute.Tensor

    def qualifies(self, seqlen: SeqlenInfoQK, m_block: Int32):
        """Whether the work tile's last visible key is in its first KV tile's first half: an odd n_block_max at
        tile_n/2."""
        _, n_half_max = self.block_info.get_n_block_min_max(seqlen, m_block)
        return n_half_max % 2 == 1


class QReleasedByTheLastBlock:
    """FA4's Q pipeline as FA4's `mma` sees it under Note [Each warpgroup's own tile boundary]: its waits are the
    pipeline's, its release after the work tile's main loop does nothing (`mma_one_n_block` releases Q after the last
    block's S GEMM instead). `releases[0]` counts the releases FA4's `mma` traced (one a work tile), shared by the
    copies the DSL makes of this object as it carries it through FA4's tile loop."""

    def __init__(self, pipeline_q, releases: Optional[list] = None):
        self.pipeline = pipeline_q
        self.releases = [0] if releases is None else releases

    def consumer_wait_w_index_phase(self, *args, **kwargs):
        return self.pipeline.consumer_wait_w_index_phase(*args, **kwargs)

    def consumer_release_w_index(self, index):
        self.releases[0] += 1

    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values(self.pipeline)

    def __new_from_mlir_values__(self, values):
        return QReleasedByTheLastBlock(cutlass.new_from_mlir_values(self.pipeline, values), self.releases)


class FlashAttentionForwardSm90Fp8(FlashAttentionForwardSm90):
    """FA4's SM90 forward with e4m3 operands; `stage` is the resolved `fa4_rowmax.interface.SoftmaxStage` (its knobs,
    Note [Softmax-stage knobs] in config.py), kept as FA4's `softmax_stage` hook."""

    def __init__(
        self,
        head_dim: int,
        qhead_per_kvhead: int = 1,
        *,
        is_causal: bool,
        pack_gqa: bool,
        stage,
        tile_m: int = 128,
        tile_n: int = 128,
        num_stages: int = 2,
        persistent_ctas: int = 0,
    ):
        # Note [Row sum by the MMA]: V^T and O carry ROW_SUM_COLUMNS more columns (PV GEMM N = head_dim + 8).
        head_dim_v = head_dim + (ROW_SUM_COLUMNS if stage.row_sum == "mma" else 0)
        super().__init__(
            OUTPUT_DTYPE,
            head_dim,
            head_dim_v,
            qhead_per_kvhead,
            is_causal=is_causal,
            is_local=False,
            pack_gqa=pack_gqa,
            tile_m=tile_m,
            tile_n=tile_n,
            num_stages=num_stages,
            num_threads=128 * (tile_m // 64 + 1),
            Q_in_regs=False,
            intra_wg_overlap=stage.intra_wg_overlap,
            mma_pv_is_rs=True,
        )
        self.operand_dtype = OPERAND_DTYPE
        self.softmax_stage = stage
        self.two_level = stage.pv_accumulation == "two_level"
        # Note [Scheduler window after the P.V GEMM]: the last block of every work tile is block 0 (no local
        # window, no KV split: is_local=False above, and FA4's SM90 forward does not split here).
        self.arrive_after_pv = stage.arrive_after_pv
        self.round_robin = stage.scheduler_barrier
        assert not (self.round_robin and (tile_m != 192 or stage.intra_wg_overlap)), (
            "scheduler_barrier needs tile_m=192"
        )
        assert not (self.arrive_after_pv and stage.intra_wg_overlap), "arrive_after_pv needs intra_wg_overlap=False"
        # FA4 pads head_dim_v to a multiple of 16; wgmma N only needs a multiple of 8, and V^T and O hold
        # exactly head_dim_v columns, so no head-dim predication either.
        self.tile_hdimv = head_dim_v
        self.check_hdim_v_oob = False
        # Note [O's tile without the row-sum columns]: the columns FA4's seam (patch 0002) gives O's shared tile and
        # TMA store, and this epilogue; None: FA4's, the P.V GEMM's.
        self.o_columns = head_dim if stage.o_store == "head_dim" and head_dim_v != head_dim else None
        # Note [Persistent work tiles]: the grid's size (the GPU's SM count) with stage.persistent; 0, FA4's one CTA per
        # work tile.
        self.persistent_ctas = persistent_ctas
        assert (persistent_ctas > 0) == stage.persistent, "persistent_ctas is the SM count exactly when persistent"
        # Note [The masked half of the first KV tile]: set by `mma` when stage.masked_half == "skip".
        self.skip_masked_half = stage.masked_half == "skip"
        assert not self.skip_masked_half or (
            self.two_level and not stage.intra_wg_overlap and (tile_n // 2) % 32 == 0
        ), "masked_half='skip' needs two-level accumulation, intra_wg_overlap=False and tile_n/2 a multiple of 32"
        self.first_tile_half: Optional[FirstTileHalf] = None
        # Note [Each warpgroup's own tile boundary]; `mma` sets q_pipeline for `mma_one_n_block`.
        self.own_tile_boundary = stage.warpgroup_epilogue == "own"
        assert not self.own_tile_boundary or (
            persistent_ctas and not stage.intra_wg_overlap and not pack_gqa and self.o_store_columns() == head_dim
        ), "warpgroup_epilogue='own' needs the persistent grid, no overlap, no packed GQA and O at head_dim columns"
        self.q_pipeline = None

    def _check_type(self, mQ_type, mK_type, mV_type, mO_type, mLSE_type, *index_types):
        if const_expr(not (mQ_type == mK_type == mV_type == self.operand_dtype)):
            raise TypeError("q, k and v^T must be Float8E4M3FN")
        if const_expr(mO_type != self.dtype):
            raise TypeError("the output must be BFloat16")
        if const_expr(mLSE_type not in [None, Float32]):
            raise TypeError("LSE tensor must be Float32")
        if const_expr(any(t not in [None, Int32] for t in index_types)):
            raise TypeError("cu_seqlens_q/k and seqused_q/k must be Int32")

    def _get_smem_layout_atom(self):
        # FA4 uses these atoms only to shape its cp.async / universal gmem copies of Q, K, V and O, which this
        # kernel never runs (the host requires TMA for all four: qhead_per_kvhead divides tile_m); the real
        # shared layouts are built from the tensors in __call__. One atom of the (BF16) head dim serves all,
        # so the row-sum columns (Note [Row sum by the MMA]) do not reach FA4's copy-thread arithmetic.
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils_basic.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, self.tile_hdim), self.dtype
        )
        return atom, atom, atom, atom, None

    def _get_tiled_mma(self):
        return self._tiled_mma_qk(self.tile_n), self._tiled_mma_pv(self.tile_hdimv)

    def _tiled_mma_qk(self, keys: int):
        """The S GEMM's tiled MMA over `keys` of a KV tile (tile_n; half of it for Note [The masked half of the first
        KV tile])."""
        return sm90_utils_basic.make_trivial_tiled_mma(
            self.operand_dtype,
            self.operand_dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(self.tile_m // 64, 1, 1),
            tiler_mn=(64, keys),
        )

    def o_store_columns(self) -> int:
        return self.tile_hdimv if self.o_columns is None else self.o_columns

    def _tiled_mma_pv(self, columns: int):
        """The P.V GEMM's tiled MMA over `columns` of O (the epilogue's, at head_dim: Note [O's tile without the
        row-sum columns])."""
        return sm90_utils_basic.make_trivial_tiled_mma(
            self.operand_dtype,
            self.operand_dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(self.tile_m // 64, 1, 1),
            tiler_mn=(64, columns),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def _get_shared_storage_cls(self):
        # FA4 rescales O before the PV GEMM when head_dim_v > 128 (register pressure at head dim 192/256); the 8
        # row-sum columns of Note [Row sum by the MMA] do not need it. Single-level accumulation rescales after
        # the GEMM; two-level keeps O one tile behind with FA4's bookkeeping of that mode (the pending factor in
        # `scores_scale`, O zeroed by the first block: Note [Two-level P.V accumulation] in softmax_sm90_fp8.py).
        # Without intra-warpgroup overlap two-level promotes at once (`mma_one_n_block`). Set here, after FA4's
        # __call__ chose it and before mma() reads it.
        self.rescale_O_before_gemm = self.two_level and self.intra_wg_overlap
        # Note [Three consumer warpgroups]: FA4 chose no scheduler barrier for three warpgroups without overlap; its
        # round-robin (warp_scheduler_barrier_arrive's next_wg, mma_init's kick-off of warpgroup 1) on request.
        if const_expr(self.round_robin):
            self.use_scheduler_barrier = True
        # Note [Each warpgroup's own tile boundary]: O is stored by plain stores, so FA4 builds no TMA atom for it and
        # hands the kernel O's global tensor.
        if const_expr(self.own_tile_boundary):
            self.use_tma_O = False
        # Note [V^T in shared memory]: V's K-major layout, set before FA4 builds the storage and V's TMA atom.
        self.sV_layout = sm90_utils.make_smem_layout(
            self.operand_dtype, LayoutEnum.COL_MAJOR, (self.tile_n, self.tile_hdimv), self.num_stages
        )
        # Note [FP8 kernel dtypes]: O (BF16) reuses the Q buffer, or has its own (Note [Persistent work tiles]).
        cosize_sQO = cute.cosize(self.sQ_layout)
        if const_expr(not self.persistent_ctas):
            cosize_sQO = max(cosize_sQO, cute.cosize(self.sO_layout) * self.dtype.width // self.operand_dtype.width)
        sQ_struct = cute.struct.Align[cute.struct.MemRange[self.operand_dtype, cosize_sQO], self.buffer_align_bytes]
        # Zero bytes when O reuses Q's buffer; its own region holds what the epilogue writes past the tile.
        sO_elements = cute.cosize(self.sO_layout) + o_store_overrun(self.tile_m, self.o_store_columns())
        sO_struct = cute.struct.Align[
            cute.struct.MemRange[self.dtype, sO_elements if self.persistent_ctas else 0], self.buffer_align_bytes
        ]
        sK_struct, sV_struct = [
            cute.struct.Align[cute.struct.MemRange[self.operand_dtype, cute.cosize(layout)], self.buffer_align_bytes]
            for layout in (self.sK_layout, self.sV_layout)
        ]
        mbar_ptr_Q_struct = cute.struct.MemRange[cutlass.Int64, 1 * 2]
        mbar_ptr_K_struct = cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
        mbar_ptr_V_struct = cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
        sP_struct = cute.struct.Align[cute.struct.MemRange[self.operand_dtype, 0], 1024]

        @cute.struct
        class SharedStorageFp8:
            mbar_ptr_Q: mbar_ptr_Q_struct
            mbar_ptr_K: mbar_ptr_K_struct
            mbar_ptr_V: mbar_ptr_V_struct
            sV: sV_struct
            sQ: sQ_struct
            sK: sK_struct
            sP: sP_struct
            sO: sO_struct

        return SharedStorageFp8

    def o_smem_tensor(self, storage, sO_layout):
        """FA4's seam (patch 0002): O's shared tile over Q's buffer, or in its own with a persistent grid (Note
        [Persistent work tiles])."""
        if const_expr(not self.persistent_ctas):
            return super().o_smem_tensor(storage, sO_layout)
        return storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

    def select_tile_scheduler(self, TileScheduler, tile_sched_args, aux_data):
        """FA4's seam (patch 0002): with a persistent grid, the dynamic persistent scheduler on dense batches, its
        counter and slots in FA4's last aux tensor (Note [Dynamic persistent order], tile_scheduler_sm90.py)."""
        if const_expr(not self.persistent_ctas):
            return TileScheduler, tile_sched_args
        assert tile_sched_args.mCuSeqlensQ is None and tile_sched_args.mSeqUsedQ is None, "dense batches only"
        scheduler = dynamic_persistent_scheduler(self.persistent_ctas, self.num_mma_threads, self.own_tile_boundary)
        return scheduler, replace(tile_sched_args, tile_count_semaphore=aux_data.tensors[-1].iterator)

    def wait_o_store(self):
        """FA4's seam (patch 0004): on the persistent grid the store warp waits for O's TMA store before the next
        tile's epilogue writes O's tile, not right after the store (Note [O store wait on the persistent grid])."""
        if const_expr(not self.persistent_ctas):
            super().wait_o_store()

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        seqlen,
        gmem_tiled_copy_O: cute.TiledCopy,
        tma_atom_O: Optional[cute.CopyAtom],
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """FA4's epilogue; with `o_columns` set, on O's head_dim columns alone (Note [O's tile without the row-sum
        columns]); on the persistent grid after the previous tile's O store has read O's tile (Note [O store wait on
        the persistent grid])."""
        if const_expr(self.own_tile_boundary):
            acc_O_head, tiled_mma_o = self._o_columns_of(acc_O, tidx, self.o_store_columns())
            self.warpgroup_epilogue(
                acc_O_head, lse, mO, mLSE, sO, seqlen, tiled_mma_o, tidx, m_block, head_idx, batch_idx
            )
            return
        if const_expr(self.persistent_ctas):
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == O_STORE_WARP:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(self.o_columns is None):
            super().epilogue(
                acc_O, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O, tiled_mma, tidx, m_block, head_idx,
                batch_idx,
            )  # fmt: skip
        else:
            acc_O_head, tiled_mma_o = self._o_columns_of(acc_O, tidx, self.o_columns)
            pv_columns, self.tile_hdimv = self.tile_hdimv, self.o_columns
            super().epilogue(
                acc_O_head, lse, mO, mLSE, sO, seqlen, gmem_tiled_copy_O, tma_atom_O, tiled_mma_o, tidx, m_block,
                head_idx, batch_idx,
            )  # fmt: skip
            self.tile_hdimv = pv_columns

    def _o_columns_of(self, acc_O: cute.Tensor, tidx: Int32, columns: int):
        """O's first `columns` columns (Note [O's tile without the row-sum columns]): the P.V accumulator's first
        registers as an accumulator of that width, and the tiled MMA over it."""
        tiled_mma_o = self._tiled_mma_pv(columns)
        shape = tiled_mma_o.get_slice(tidx).partition_shape_C((self.tile_m, columns))
        return cute.make_tensor(acc_O.iterator, cute.make_layout(shape)), tiled_mma_o

    @cute.jit
    def warpgroup_epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        seqlen,
        tiled_mma: cute.TiledMma,
        tidx: Int32,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """Note [Each warpgroup's own tile boundary]: this warpgroup's 64 rows of O and of the LSE, stored by it."""
        rows, columns = self.tile_m // self.num_wg_mma, self.o_store_columns()
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        barrier_id = EPILOGUE_BARRIERS[0] + warpgroup_idx
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WARPGROUP_THREADS)
        smem_copy_atom_O = utils.get_smem_store_atom(self.arch.major * 10 + self.arch.minor, self.dtype)
        smem_thr_copy_O = cute.make_tiled_copy_C(smem_copy_atom_O, tiled_mma).get_slice(tidx)
        cute.copy(smem_copy_atom_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))
        first_row = m_block * self.tile_m + warpgroup_idx * rows
        if const_expr(mLSE is not None):
            # FA4's LSE store (epilogue in flash_fwd.py): the thread holding column 0 of a row writes its LSE, over
            # the thread's rows (FA4 loops over the column mode there, whose extra steps index past `lse`).
            mLSE_cur = seqlen.offset_batch_Q(mLSE, batch_idx, dim=2)[None, head_idx]
            gLSE = cute.local_tile(mLSE_cur, (self.tile_m,), (m_block,))
            gLSE_expanded = cute.make_tensor(
                gLSE.iterator, cute.append(gLSE.layout, cute.make_layout((columns,), stride=(0,)))
            )
            thr_mma = tiled_mma.get_slice(tidx)
            taccOgLSE = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(gLSE_expanded))
            cO_tile = cute.make_identity_tensor((self.tile_m, columns))
            taccOcO = layout_utils.reshape_acc_to_mn(thr_mma.partition_C(cO_tile))
            if taccOcO[0][1] == 0:
                for m in cutlass.range(cute.size(taccOgLSE, mode=[0]), unroll_full=True):
                    if m_block * self.tile_m + taccOcO[m, 0][0] < seqlen.seqlen_q:
                        taccOgLSE[m, 0] = lse[m]
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WARPGROUP_THREADS)
        gmem_copy_O = copy_utils.tiled_copy_2d(self.dtype, columns, WARPGROUP_THREADS)
        gmem_thr_copy_O = gmem_copy_O.get_slice(tidx % WARPGROUP_THREADS)
        mO_cur = seqlen.offset_batch_Q(mO, batch_idx, dim=3)[None, None, head_idx]
        gO = cute.local_tile(mO_cur, (rows, columns), (m_block * self.num_wg_mma + warpgroup_idx, 0))
        tOsO = gmem_thr_copy_O.partition_S(cute.local_tile(sO, (rows, columns), (warpgroup_idx, 0)))
        tOgO = gmem_thr_copy_O.partition_D(gO)
        tOcO = gmem_thr_copy_O.partition_S(cute.make_identity_tensor((rows, columns)))
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            if first_row + tOcO[0, m, 0][0] < seqlen.seqlen_q:
                cute.copy(gmem_copy_O, tOrO[None, m, None], tOgO[None, m, None])

    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tma_atom_Q: Optional[cute.CopyAtom],
        tma_atom_K: Optional[cute.CopyAtom],
        tma_atom_V: Optional[cute.CopyAtom],
        pipeline_k,
        pipeline_v,
        pipeline_q,
        gmem_tiled_copy_Q: cute.TiledCopy,
        mPageTable: Optional[cute.Tensor],
        blocksparse_tensors,
        block_info,
        SeqlenInfoCls: Callable,
        TileSchedulerCls: Callable,
    ):
        """FA4's producer; a varlen V^T (here mV) is read from FA4's padded offsets (Note [V^T at FA4's padded
        offsets]). `SeqlenInfoCls` is FA4's partial of `SeqlenInfoQK.create`."""
        moved = []
        seqlen_info_vt = partial(
            SeqlenInfoQKVt.create, seqlen_info_cls=SeqlenInfoCls, vt=mV, tile_n=self.tile_n, moved=moved
        )
        super().load(
            mQ,
            mK,
            mV,
            sQ,
            sK,
            sV,
            tma_atom_Q,
            tma_atom_K,
            tma_atom_V,
            pipeline_k,
            pipeline_v,
            pipeline_q,
            gmem_tiled_copy_Q,
            mPageTable,
            blocksparse_tensors,
            block_info,
            seqlen_info_vt,
            TileSchedulerCls,
        )
        if const_expr(SeqlenInfoCls.keywords["mCuSeqlensK"] is not None and not moved):
            raise TypeError(
                "FA4's producer no longer offsets V through SeqlenInfoQK.offset_batch_K: the varlen V^T seam "
                "(Note [V^T at FA4's padded offsets]) must be ported"
            )

    @cute.jit
    def load_tile_descale(self, softmax: Fp8SoftmaxSm90, mask_fn: Callable) -> None:
        """Note [Descales]: FA4's `mma` binds the work tile's batch, head and aux tensors into `mask_fn`
        (a functools.partial of `AttentionMask.apply_mask`); the descales travel as aux tensor 0,
        fp32 (batch, kv heads, 2) = (q_descale * k_descale, v_descale)."""
        batch_idx = mask_fn.keywords["batch_idx"]
        head_idx = mask_fn.keywords["head_idx"]
        mDescale = mask_fn.keywords["aux_data"].tensors[0]
        head_kv = head_idx if const_expr(self.pack_gqa) else head_idx // self.qhead_per_kvhead
        softmax.set_tile_descale(mDescale[batch_idx, head_kv, 0], mDescale[batch_idx, head_kv, 1])

    @cute.jit
    def first_half_block_overlap(
        self,
        n_block: Int32,
        mma_qk_fn: Callable,
        kv_consumer_state,
        pipeline_k,
        tOrP: cute.Tensor,
        smem_copy_params: SimpleNamespace,
        softmax: Fp8SoftmaxSm90,
        seqlen: SeqlenInfoQK,
        scores_scale: Optional[cute.Tensor] = None,
        acc_O: Optional[cute.Tensor] = None,
        mask_fn: Callable = None,
        score_mod_fn: Optional[Callable] = None,
        is_first_block: bool = False,
    ):
        """FA4's first half block (QK GEMM, mask, softmax), with the tile's descales and the e4m3 P operand."""
        if const_expr(softmax.has_descale):
            self.load_tile_descale(softmax, mask_fn)
        pipeline_k.consumer_wait(kv_consumer_state, pipeline_k.consumer_try_wait(kv_consumer_state))
        acc_S = mma_qk_fn(B_idx=kv_consumer_state.index, wg_wait=0)
        pipeline_k.consumer_release(kv_consumer_state)
        mask_fn(acc_S, n_block=n_block, mask_seqlen=True)
        row_scale = softmax.online_softmax(acc_S, is_first=is_first_block)
        softmax.write_p(acc_S, tOrP)
        if const_expr(self.two_level):
            acc_O.fill(0.0)
            scores_scale.store(row_scale.load())
        return kv_consumer_state

    @cute.jit
    def last_half_block_overlap(
        self,
        kv_consumer_state,
        pipeline_v,
        mma_pv_fn: Callable,
        zero_init: bool,
        scores_scale: Optional[cute.Tensor] = None,
        softmax: Optional[Fp8SoftmaxSm90] = None,
        acc_O: Optional[cute.Tensor] = None,
    ):
        """FA4's last PV GEMM (two-level: into a fresh accumulator, then promoted); then the row sums come out of O's
        extra column (Note [Row sum by the MMA])."""
        if const_expr(self.two_level):
            pipeline_v.consumer_wait(kv_consumer_state, pipeline_v.consumer_try_wait(kv_consumer_state))
            acc_PV = pv_gemm_fresh(mma_pv_fn, B_idx=kv_consumer_state.index, wg_wait=0)
            pipeline_v.consumer_release(kv_consumer_state)
            kv_consumer_state.advance()
            softmax.promote_O(acc_O, acc_PV, scores_scale)
        else:
            kv_consumer_state = super().last_half_block_overlap(
                kv_consumer_state, pipeline_v, mma_pv_fn, zero_init, scores_scale, softmax, acc_O
            )
        if const_expr(softmax.row_sum_by_mma):
            softmax.row_sum_from_acc_O(acc_O)
        return kv_consumer_state

    @cute.jit
    def mma_one_n_block_intrawg_overlap(
        self,
        smem_pipe_read,
        n_block: Int32,
        mma_qk_fn: Callable,
        mma_pv_fn: Callable,
        pipeline_k,
        pipeline_v,
        acc_O: cute.Tensor,
        tOrP: cute.Tensor,
        smem_copy_params: SimpleNamespace,
        softmax: Fp8SoftmaxSm90,
        seqlen: SeqlenInfoQK,
        scores_scale: Optional[cute.Tensor] = None,
        score_mod_fn: Optional[Callable] = None,
        mask_fn: Optional[Callable] = None,
        check_inf: cutlass.Constexpr = True,
    ):
        """FA4's overlapped step (S = QK^T of this block while the previous block's P V runs), with the e4m3 P
        operand written by the softmax stage. Single-level: O += P V in the GEMM, then O rescaled; two-level: P V
        into a fresh accumulator, promoted into O by one FFMA with the pending factor (Note [Two-level P.V
        accumulation] in softmax_sm90_fp8.py)."""
        smem_pipe_read_v = smem_pipe_read.clone()
        smem_pipe_read.advance()
        pipeline_k.consumer_wait(smem_pipe_read, pipeline_k.consumer_try_wait(smem_pipe_read))
        self.warp_scheduler_barrier_sync()
        acc_S = mma_qk_fn(B_idx=smem_pipe_read.index, wg_wait=-1)
        pipeline_v.consumer_wait(smem_pipe_read_v, pipeline_v.consumer_try_wait(smem_pipe_read_v))
        if const_expr(self.two_level):
            acc_PV = pv_gemm_fresh(mma_pv_fn, B_idx=smem_pipe_read_v.index, wg_wait=-1)
        else:
            mma_pv_fn(B_idx=smem_pipe_read_v.index, wg_wait=-1)
        self.warp_scheduler_barrier_arrive()
        warpgroup.wait_group(1)
        pipeline_k.consumer_release(smem_pipe_read)
        if const_expr(mask_fn is not None):
            mask_fn(acc_S=acc_S, n_block=n_block)
        row_scale = softmax.online_softmax(acc_S, check_inf=check_inf)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(smem_pipe_read_v)
        softmax.write_p(acc_S, tOrP)
        if const_expr(self.two_level):
            softmax.promote_O(acc_O, acc_PV, scores_scale)
            scores_scale.store(row_scale.load())
        else:
            softmax.rescale_O(acc_O, row_scale)
        return smem_pipe_read

    def mma(self, tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink, pipeline_k, pipeline_v,
            pipeline_q, *args):  # fmt: skip
        """FA4's `mma`; with masked_half="skip", first the half-N S GEMM's tiled MMA and fragments over the first
        tile_n/2 rows of each K stage, for `mma_one_n_block` (Note [The masked half of the first KV tile]); under Note
        [Each warpgroup's own tile boundary] Q is released by `mma_one_n_block` after the work tile's last S GEMM, not
        by FA4 after the main loop."""
        if const_expr(self.skip_masked_half):
            (_, _, tidx, _, _, block_info) = args[:6]
            tiled_mma_half = self._tiled_mma_qk(self.tile_n // 2)
            warp_group_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_warp_group)
            warp_group_thread_layout = cute.make_layout(self.num_wg_mma, stride=self.num_threads_per_warp_group)
            wg_mma_half = tiled_mma_half.get_slice(warp_group_thread_layout(warp_group_idx))
            halves = [
                cute.local_tile(sK, (self.tile_n // 2, self.tile_hdim, cute.size(sK.shape[2])), (i, 0, 0))
                for i in (0, 1)
            ]
            _, tSrQ, tSrK = sm90_utils.partition_fragment_ABC(
                wg_mma_half, (self.tile_m, self.tile_n // 2, self.tile_hdim), sQ, halves[0]
            )
            _, _, tSrK_upper = sm90_utils.partition_fragment_ABC(
                wg_mma_half, (self.tile_m, self.tile_n // 2, self.tile_hdim), sQ, halves[1]
            )
            self.first_tile_half = FirstTileHalf(
                replace(block_info, tile_n=self.tile_n // 2), tiled_mma_half, tSrQ, tSrK, tSrK_upper
            )
        if const_expr(not self.own_tile_boundary):
            return super().mma(tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink, pipeline_k,
                               pipeline_v, pipeline_q, *args)  # fmt: skip
        # Block 0 is a work tile's last only where FA4 walks every block down to it (no block sparsity).
        assert not self.use_block_sparsity, "warpgroup_epilogue='own' walks dense KV blocks"
        self.q_pipeline = pipeline_q
        seen_by_fa4 = QReleasedByTheLastBlock(pipeline_q)
        super().mma(tiled_mma_qk, tiled_mma_pv, mO, mLSE, sQ, sK, sVt, sP, sO, learnable_sink, pipeline_k, pipeline_v,
                    seen_by_fa4, *args)  # fmt: skip
        if seen_by_fa4.releases[0] != 1:
            raise TypeError(
                f"FA4's mma released Q {seen_by_fa4.releases[0]} times in its traced loop, not once a work tile: Note "
                "[Each warpgroup's own tile boundary] must be ported"
            )

    @cute.jit
    def arrive_after_pv_gemm(self, n_block: Int32):
        """Note [Scheduler window after the P.V GEMM]: hand the tensor cores over once this tile's P V is done,
        except after block 0, the last of the work tile, whose hand-over is FA4's arrive after its loop."""
        if const_expr(self.arrive_after_pv):
            if n_block > 0:
                self.warp_scheduler_barrier_arrive()

    @cute.jit
    def mma_one_n_block(
        self,
        smem_pipe_read,
        n_block: Int32,
        mma_qk_fn: Callable,
        mma_pv_fn: Callable,
        pipeline_k,
        pipeline_v,
        acc_O: cute.Tensor,
        tOrP: cute.Tensor,
        smem_copy_params: SimpleNamespace,
        softmax: Fp8SoftmaxSm90,
        seqlen: SeqlenInfoQK,
        scores_scale: Optional[cute.Tensor] = None,
        score_mod_fn: Optional[Callable] = None,
        mask_fn: Optional[Callable] = None,
        is_first_n_block: cutlass.Constexpr = False,
        check_inf: cutlass.Constexpr = True,
    ):
        """FA4's step without intra-warpgroup overlap (S, softmax, then this block's P V; the other warpgroup's GEMMs
        run meanwhile), with the e4m3 P operand and the first block's descales. Two-level: P V into a fresh
        accumulator promoted at once, O = O * row_scale + acc (no factor waits a tile: Note [Two-level P.V
        accumulation]), so S and the fresh accumulator are never live together."""
        if const_expr(is_first_n_block and softmax.has_descale):
            self.load_tile_descale(softmax, mask_fn)
        pipeline_k.consumer_wait(smem_pipe_read, pipeline_k.consumer_try_wait(smem_pipe_read))
        skip_half = const_expr(is_first_n_block and self.first_tile_half is not None)
        if const_expr(skip_half):
            # Note [The masked half of the first KV tile]. Each branch issues, hands over and waits for its own GEMM:
            # a wgmma issued in one branch and waited for after the branches merge is an ill-formed pipeline stage to
            # ptxas, which then serializes every wgmma of the kernel.
            first_half = self.first_tile_half.qualifies(seqlen, mask_fn.keywords["m_block"])
            tiled_mma_qk, tSrQ, tSrK = qk_gemm_operands(mma_qk_fn)
            acc_S = cute.make_rmem_tensor(tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
            half = self.first_tile_half
            half_layout = cute.make_layout(half.tiled_mma_qk.partition_shape_C((self.tile_m, self.tile_n // 2)))
            acc_S_lower = cute.make_tensor(acc_S.iterator, half_layout)
            acc_S_upper = cute.make_tensor(acc_S.iterator + cute.size(half_layout), half_layout)
            k_steps = cute.size(half.tSrQ.shape[2])
            gemm_k_blocks(
                half.tiled_mma_qk, acc_S_lower, half.tSrQ, half.tSrK[None, None, None, smem_pipe_read.index], k_steps
            )
            if first_half:
                self.warp_scheduler_barrier_arrive()
                warpgroup.wait_group(0)
                for i in cutlass.range_constexpr(cute.size(acc_S_upper)):
                    acc_S_upper[i] = -Float32.inf
            else:
                gemm_k_blocks(
                    half.tiled_mma_qk,
                    acc_S_upper,
                    half.tSrQ,
                    half.tSrK_upper[None, None, None, smem_pipe_read.index],
                    k_steps,
                )
                self.warp_scheduler_barrier_arrive()
                warpgroup.wait_group(0)
        else:
            acc_S = mma_qk_fn(B_idx=smem_pipe_read.index, wg_wait=-1)
            if const_expr(not self.arrive_after_pv or is_first_n_block):
                self.warp_scheduler_barrier_arrive()
            warpgroup.wait_group(0)
        pipeline_k.consumer_release(smem_pipe_read)
        if const_expr(self.own_tile_boundary):
            # The work tile's last block: FA4 walks n_block_max - 1 down to 0 (no local window, no KV split, no block
            # sparsity), or runs block -1 alone for rows that see no key. Note [Each warpgroup's own tile boundary].
            if n_block <= 0:
                self.q_pipeline.consumer_release_w_index(0)
        if const_expr(mask_fn is not None):
            mask_fn(acc_S=acc_S, n_block=n_block)
        row_scale = softmax.online_softmax(acc_S, is_first=is_first_n_block, check_inf=check_inf)
        softmax.write_p(acc_S, tOrP)
        if const_expr(not self.two_level):
            softmax.rescale_O(acc_O, row_scale)
        pipeline_v.consumer_wait(smem_pipe_read, pipeline_v.consumer_try_wait(smem_pipe_read))
        self.warp_scheduler_barrier_sync()
        if const_expr(skip_half):
            tiled_mma_pv, _, tOrP_pv, tOrVt = pv_gemm_operands(mma_pv_fn)
            acc_PV = cute.make_rmem_tensor_like(acc_O, Float32)
            k_blocks = cute.size(tOrP_pv.shape[2])
            if first_half:
                gemm_k_blocks(
                    tiled_mma_pv, acc_PV, tOrP_pv, tOrVt[None, None, None, smem_pipe_read.index], k_blocks // 2
                )
                warpgroup.wait_group(0)
            else:
                gemm_k_blocks(tiled_mma_pv, acc_PV, tOrP_pv, tOrVt[None, None, None, smem_pipe_read.index], k_blocks)
                warpgroup.wait_group(0)
            self.arrive_after_pv_gemm(n_block)
            acc_O.fill(0.0)
            softmax.promote_O(acc_O, acc_PV, row_scale)
        elif const_expr(self.two_level):
            acc_PV = pv_gemm_fresh(mma_pv_fn, B_idx=smem_pipe_read.index, wg_wait=0)
            self.arrive_after_pv_gemm(n_block)
            if const_expr(is_first_n_block):
                acc_O.fill(0.0)
            softmax.promote_O(acc_O, acc_PV, row_scale)
        else:
            mma_pv_fn(B_idx=smem_pipe_read.index, wg_wait=0)
            self.arrive_after_pv_gemm(n_block)
        pipeline_v.consumer_release(smem_pipe_read)
        smem_pipe_read.advance()
        if const_expr(softmax.row_sum_by_mma):
            softmax.row_sum_from_acc_O(acc_O)
        return smem_pipe_read
