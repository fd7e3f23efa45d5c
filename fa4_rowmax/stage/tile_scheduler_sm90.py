"""A dynamic persistent tile scheduler for FA4's SM90 forward (dense batches).

FA4's SM90 forward launches one CTA per work tile (`SingleTileScheduler`, or `SingleTileLPTScheduler` under a causal
mask), so every tile pays its own start (Q and the first K/V tile loaded with nothing to hide them) and its
epilogue on an idle tensor core, and at FP8 speeds one CTA fits an SM. FA4's producer and consumer loops already
walk any number of work tiles (`while work_tile.is_valid_tile`, with the pipelines' states, the Q phase and the
scheduler barriers carried from tile to tile), and the consumers release Q before a tile's last P V GEMM, so the
producer can load the next tile's Q and K under this tile's last GEMM and epilogue; what keeps the forward
non-persistent is O's shared tile over Q's buffer (`FlashAttentionForwardSm90Fp8`, Note [Persistent work tiles]).

Note [Dynamic persistent order]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The grid is min(work tiles, SMs) CTAs. Work tiles are numbered as `SingleTileLPTScheduler` numbers them (heads
grouped into sections that fit the L2, m blocks reversed under a causal mask so that the longest rows go first).
CTA c starts with tile c; after that each CTA's producer warp takes the next number from a global counter
(`atomicAdd`, plus the grid size), so a CTA that finishes early takes more tiles, as the hardware's dispatch of a
non-persistent grid does (a static walk lost 15 % under a causal mask: docs/fp8_sm90.md, Levers). The producer
hands the number to the consumer warpgroups through a slot in global memory and a named barrier: it writes slot
s = step % 2 of its CTA, arrives at barrier SLOT_BARRIERS[s] (the producer warp and every consumer thread), and the
consumers wait there and read the slot. Two slots suffice: the producer writes step j + 2's slot only after loading
step j + 2's Q, which waits for the consumers to release step j + 1's Q, which they do after reading step j's slot;
the same order keeps each barrier's phases apart. The counter and the slots are one int32 tensor (`semaphore_numel`),
the counter zeroed before every call by the V^T pre-pass (Note [The counter zeroed by the pre-pass], v_transpose.py),
that travels as FA4's last aux tensor.
With warpgroup_epilogue="own" (Note [Each warpgroup's own tile boundary], flash_fwd_sm90_fp8.py) each consumer
warpgroup has its own pair of slot barriers (the producer warp and the warpgroup's 128 threads), so a warpgroup
takes its next tile without waiting for the others to finish theirs; the argument for two slots holds for each
warpgroup alike, since Q's release still needs every warpgroup.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from flash_attn.cute import utils
from flash_attn.cute.named_barrier import NamedBarrierFwd
from flash_attn.cute.tile_scheduler import SingleTileLPTScheduler, TileSchedulerArguments, WorkTileInfo
from quack.cute_dsl_utils import ParamsBase

# Named barriers from 7: FA4's forward uses 1 to len(NamedBarrierFwd) (barrier 0 is __syncthreads). Slots s = 0, 1:
# barriers 7 and 8 shared by every consumer thread, or 7 + 2 w + s for consumer warpgroup w alone (warpgroup_epilogue
# "own"); then each warpgroup's epilogue barrier, from 13 (after three warpgroups' slots) to 15 (the hardware's 16).
SLOT_BARRIERS = (len(NamedBarrierFwd) + 1, len(NamedBarrierFwd) + 2)
MAX_CONSUMER_WARPGROUPS = 3
EPILOGUE_BARRIERS = tuple(SLOT_BARRIERS[0] + 2 * MAX_CONSUMER_WARPGROUPS + w for w in range(MAX_CONSUMER_WARPGROUPS))
WARPGROUP_THREADS = 128
COUNTER = 0  # the semaphore's first element; CTA c's slots are 1 + 2c and 2 + 2c
PRODUCER_THREADS = 32  # FA4's one TMA producer warp
O_STORE_WARP = 4  # the consumer warp FA4's epilogue issues O's TMA store from (flash_fwd.py)


def semaphore_numel(num_ctas: int) -> int:
    """Elements of the int32 tensor the scheduler needs for a grid of at most `num_ctas` CTAs."""
    return 1 + 2 * num_ctas


class DynamicPersistentTileScheduler:
    """FA4's `SingleTileLPTScheduler` numbering walked by a persistent grid in the order CTAs free up (Note [Dynamic
    persistent order]). Subclassed per SM count and consumer thread count (`dynamic_persistent_scheduler`)."""

    num_ctas: int = 0
    consumer_threads: int = 0
    per_warpgroup: bool = False  # each consumer warpgroup's own slot barriers (warpgroup_epilogue="own")

    @dataclass
    class Params(ParamsBase):
        order: SingleTileLPTScheduler.Params
        semaphore: cute.Pointer

        @staticmethod
        def create(args: TileSchedulerArguments, *, loc=None, ip=None):
            assert args.cluster_shape_mn == (1, 1) and not args.is_split_kv, "one CTA per work tile, no KV split"
            return DynamicPersistentTileScheduler.Params(
                SingleTileLPTScheduler.Params.create(args, loc=loc, ip=ip), args.tile_count_semaphore
            )

    def __init__(self, params: Params, tile_idx: Int32, step: Int32, *, loc=None, ip=None):
        self.params = params
        self._tile_idx = tile_idx
        self._step = step
        self._loc = loc

    @staticmethod
    def to_underlying_arguments(args: TileSchedulerArguments, *, loc=None, ip=None):
        return DynamicPersistentTileScheduler.Params.create(args, loc=loc, ip=ip)

    @classmethod
    def get_grid_shape(cls, params: Params, *, loc=None, ip=None):
        return (cutlass.min(params.order.total_blocks, Int32(cls.num_ctas)), Int32(1), Int32(1))

    @classmethod
    def create(cls, params: Params, ctx=None, *, loc=None, ip=None):
        return cls(params, cute.arch.block_idx()[0], Int32(0), loc=loc, ip=ip)

    @cute.jit
    def get_current_work(self, *, loc=None, ip=None) -> WorkTileInfo:
        return SingleTileLPTScheduler(self.params.order, self._tile_idx, Int32(0)).get_current_work()

    @cute.jit
    def initial_work_tile_info(self, *, loc=None, ip=None) -> WorkTileInfo:
        return self.get_current_work()

    def prefetch_next_work(self, *, loc=None, ip=None):
        """The producer's next tile is taken in `advance_to_next_work`, where the consumers take theirs."""

    @cute.jit
    def advance_to_next_work(self, *, loc=None, ip=None):
        """Note [Dynamic persistent order]: the producer warp takes the next tile and publishes it; the consumer
        threads wait for it. Called once per work tile by both (FA4's producer and consumer loops)."""
        slot = self._step % 2
        slots = cute.make_tensor(
            self.params.semaphore + (1 + 2 * cute.arch.block_idx()[0]), cute.make_layout(2)
        )  # this CTA's two slots
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # The slot's barrier: one for every consumer thread, or one a consumer warpgroup (per_warpgroup).
        groups = self.consumer_threads // WARPGROUP_THREADS if const_expr(self.per_warpgroup) else 1
        threads = PRODUCER_THREADS + self.consumer_threads // groups
        tile_idx = Int32(0)
        if warp_idx < 4:  # FA4's producer warpgroup; only its TMA warp walks the tiles
            taken = Int32(0)
            if cute.arch.lane_idx() == 0:
                taken = cute.arch.grid_dim()[0] + utils.atomic_add_i32(1, self.params.semaphore + COUNTER)
                slots[slot] = taken
            tile_idx = cute.arch.shuffle_sync(taken, 0)
            for group in cutlass.range_constexpr(groups):
                cute.arch.barrier_arrive(barrier_id=SLOT_BARRIERS[0] + 2 * group + slot, number_of_threads=threads)
        else:
            group = warp_idx // 4 - 1 if const_expr(self.per_warpgroup) else 0
            cute.arch.barrier(barrier_id=SLOT_BARRIERS[0] + 2 * group + slot, number_of_threads=threads)
            tile_idx = slots[slot]
            # The CTA's last tile: its O store must read O's tile before the CTA exits (Note [O store wait on the
            # persistent grid], flash_fwd_sm90_fp8.py). A warpgroup's own epilogue stores O with plain stores.
            if const_expr(not self.per_warpgroup):
                if tile_idx >= self.params.order.total_blocks and warp_idx == O_STORE_WARP:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        self._tile_idx = tile_idx
        self._step = self._step + 1

    def producer_tail(self, *, loc=None, ip=None):
        pass

    def __extract_mlir_values__(self):
        values, self._values_pos = [], []
        for obj in (self.params, self._tile_idx, self._step):
            obj_values = cutlass.extract_mlir_values(obj)
            values += obj_values
            self._values_pos.append(len(obj_values))
        return values

    def __new_from_mlir_values__(self, values):
        objs = []
        for obj, n_items in zip((self.params, self._tile_idx, self._step), self._values_pos):
            objs.append(cutlass.new_from_mlir_values(obj, values[:n_items]))
            values = values[n_items:]
        return self.__class__(*objs, loc=self._loc)


def dynamic_persistent_scheduler(num_ctas: int, consumer_threads: int, per_warpgroup: bool = False) -> type:
    """A `DynamicPersistentTileScheduler` for a grid of at most `num_ctas` CTAs (the GPU's SM count) whose consumer
    warpgroups have `consumer_threads` threads; with `per_warpgroup`, each warpgroup with its own slot barriers."""
    if not (isinstance(num_ctas, int) and num_ctas >= 1):
        raise ValueError(f"num_ctas must be an int >= 1 (the GPU's SM count), got {num_ctas!r}")
    if consumer_threads not in (256, 384):
        raise ValueError(f"consumer_threads must be 256 or 384 (two or three warpgroups), got {consumer_threads!r}")
    return type(
        f"DynamicPersistentTileScheduler{num_ctas}x{consumer_threads}{'PerWarpgroup' if per_warpgroup else ''}",
        (DynamicPersistentTileScheduler,),
        {"num_ctas": num_ctas, "consumer_threads": consumer_threads, "per_warpgroup": per_warpgroup},
    )
