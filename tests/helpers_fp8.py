"""What the SM90 FP8 forward's GPU tests share (test_fp8_sm90_gpu.py, test_fp8_sm90_varlen.py): NaN-poisoned
output memory, stale small blocks and random descales."""

import math

import torch


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fill freed caching-allocator blocks with NaN so an unwritten output element shows up as NaN."""
    torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").fill_(math.nan)
    torch.cuda.synchronize()


def stale_small_blocks(numel: int, value: int, count: int = 64) -> None:
    """Leave `count` freed int32 blocks of `numel` elements holding `value` in the caching allocator's small pool, so
    the next int32 tensor of that size starts from `value` (the caching allocator hands out the smallest free block
    that fits, and these are all of that size), not from whatever an earlier call left there."""
    blocks = [torch.full((numel,), value, dtype=torch.int32, device="cuda") for _ in range(count)]
    torch.cuda.synchronize()
    del blocks


def random_descales(seed, batch, hk):
    """q, k and v descales, each (batch, hk) in [0.5, 1.5), from a CUDA generator seeded `seed + 1000`."""
    gen = torch.Generator(device="cuda").manual_seed(seed + 1000)
    return [torch.rand(batch, hk, device="cuda", generator=gen) + 0.5 for _ in range(3)]
