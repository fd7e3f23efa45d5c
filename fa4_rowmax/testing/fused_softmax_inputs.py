"""Adversarial inputs for a frozen running max (Fused-Softmax, fa4_rowmax.reference.fused_softmax): score orders
built to trip a max that is not checked at every tile, as q, k, v exact in every MX element format. Used by the
reference's tests, the aiter_fused kernel tests and the H200 fault study."""

import math

import numpy as np
import torch

from fa4_rowmax.reference.mx import fake_quantize_mx

LOG2E = math.log2(math.e)


def adversarial_scores(name: str, sk: int) -> torch.Tensor:
    """Per-key scores (log2 units, before scaling) for one query row: orders built to trip a
    frozen max that is not checked at every tile."""
    rng = np.random.default_rng(sum(map(ord, name)))
    base = rng.normal(0, 1, sk)
    if name == "late_max":
        base[-5] = 60.0
    elif name == "late_huge":
        base[-1] = 400.0  # a missed recovery would overflow BF16 (y >= 128)
    elif name == "staircase":
        base = base + 6.0 * (np.arange(sk) // 32)  # +6 per 32-key tile: below, then above, the threshold
    elif name == "staircase_down":
        base = base - 6.0 * (np.arange(sk) // 32)
    elif name == "one_huge":
        base[sk // 2] = 3000.0
    elif name == "all_equal":
        base[:] = 2.5
    else:
        raise ValueError(name)
    return torch.from_numpy(base).float()


ADVERSARIAL = ["late_max", "late_huge", "staircase", "staircase_down", "one_huge", "all_equal"]


def adversarial_qkv(name, sk, d=32, rows=4):
    """q, k, v whose (scaled, log2) scores are exactly row_gain * adversarial_scores(name): q holds
    one power of two per row, k one score per key, both exact in every MX element format once the
    scores are rounded to two significant bits."""
    scores = adversarial_scores(name, sk)
    scores = fake_quantize_mx(scores[:, None].expand(sk, 32).contiguous(), "e2m1")[:, 0]
    q = torch.zeros(1, rows, 1, d)
    q[0, :, 0, 0] = 2.0 ** -torch.arange(rows).float()
    k = torch.zeros(1, sk, 1, d)
    k[0, :, 0, 0] = scores
    v = torch.randn(1, sk, 1, d)
    return q, k, v, 1.0 / LOG2E
