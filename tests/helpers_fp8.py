"""What the SM90 FP8 forward's GPU tests share (test_fp8_sm90_gpu.py, test_fp8_sm90_varlen.py): NaN-poisoned
output memory and random descales."""

import math

import torch


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fill freed caching-allocator blocks with NaN so an unwritten output element shows up as NaN."""
    torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").fill_(math.nan)
    torch.cuda.synchronize()


def random_descales(seed, batch, hk):
    """q, k and v descales, each (batch, hk) in [0.5, 1.5), from a CUDA generator seeded `seed + 1000`."""
    gen = torch.Generator(device="cuda").manual_seed(seed + 1000)
    return [torch.rand(batch, hk, device="cuda", generator=gen) + 0.5 for _ in range(3)]
