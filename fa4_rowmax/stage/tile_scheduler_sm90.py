"""A persistent tile scheduler for FA4's SM90 forward (dense batches): FA4's LPT order, walked by a fixed grid.

FA4's SM90 forward launches one CTA per work tile (`SingleTileScheduler` / `SingleTileLPTScheduler`, non-persistent),
so every tile pays its own start (Q and the first K/V tile loaded with nothing to hide them) and its epilogue (O
converted, stored through shared memory, the store awaited) on an idle tensor core. Its producer and consumer
loops already walk any number of work tiles (`while work_tile.is_valid_tile`), and the consumers release Q before
a tile's last P.V GEMM so the producer can load the next tile's Q; what keeps the forward non-persistent is that O
reuses Q's shared buffer. With O in a region of its own (`FlashAttentionForwardSm90Fp8`, Note [Persistent work
tiles] in flash_fwd_sm90_fp8.py) a CTA can take tile after tile: the next tile's K, V and Q load during this
tile's last P.V GEMM and epilogue.

Note [Persistent LPT order]
The grid is `num_ctas` CTAs (the GPU's SM count: one CTA per SM fits at FA4's SM90 shared-memory sizes), or the
tile count when smaller. Tiles are numbered as `SingleTileLPTScheduler` numbers them (heads grouped into L2-sized
sections, m blocks reversed for causal so the longest rows go first), and CTA c takes, in wave w, tile
w * G + c for even w and w * G + (G - 1 - c) for odd w (G the grid size): a snake. Within a wave the tiles run from
longer to shorter (causal), so a plain stride would give CTA 0 the longest tile of every wave; the snake pairs a
wave's longest with the next wave's shortest and keeps the CTAs' totals close. Every tile is taken exactly once:
wave w covers [w * G, (w + 1) * G) in some order, and a CTA stops at its first tile past the end, which can only
be in the last wave.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from flash_attn.cute.tile_scheduler import SingleTileLPTScheduler, WorkTileInfo


class PersistentLPTScheduler(SingleTileLPTScheduler):
    """FA4's `SingleTileLPTScheduler` order walked by a persistent grid of `num_ctas` CTAs in a snake (Note
    [Persistent LPT order]); `self._tile_idx` counts this CTA's steps, `c + k * G` at its k-th tile."""

    num_ctas: int = 0  # set by `persistent_lpt_scheduler`

    @classmethod
    def create(cls, params, ctx=None, *, loc=None, ip=None):
        assert const_expr(params.cluster_shape_m == 1 and not params.is_split_kv), "one CTA per tile, no KV split"
        return cls(params, cute.arch.block_idx()[0], Int32(0), loc=loc, ip=ip)

    @classmethod
    def get_grid_shape(cls, params, *, loc=None, ip=None):
        return (cutlass.min(params.total_blocks, Int32(cls.num_ctas)), Int32(1), Int32(1))

    @cute.jit
    def get_current_work(self, *, loc=None, ip=None) -> WorkTileInfo:
        grid = cute.arch.grid_dim()[0]
        wave = self._tile_idx // grid
        cta = self._tile_idx - wave * grid
        if wave % 2 == 1:
            cta = grid - 1 - cta
        return SingleTileLPTScheduler(self.params, wave * grid + cta, self._split_idx).get_current_work()

    def advance_to_next_work(self, *, loc=None, ip=None):
        self._tile_idx += cute.arch.grid_dim()[0]
        return self.get_current_work()


def persistent_lpt_scheduler(num_ctas: int) -> type:
    """A `PersistentLPTScheduler` whose grid is at most `num_ctas` CTAs (the GPU's SM count)."""
    if not (isinstance(num_ctas, int) and num_ctas >= 1):
        raise ValueError(f"num_ctas must be an int >= 1 (the GPU's SM count), got {num_ctas!r}")
    return type(f"PersistentLPTScheduler{num_ctas}", (PersistentLPTScheduler,), {"num_ctas": num_ctas})
