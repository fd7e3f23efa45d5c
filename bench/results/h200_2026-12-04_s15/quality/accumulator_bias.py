"""CPU check of one reading of the H15 2K excess: does Hopper's truncating FP8 accumulator (emulated, Note [Emulated
FP8 MMA accumulator]) bias O at the 0.5B's kernel entry (head dim 64, tile 192, two-level), and more for H15?

    PYTHONPATH=. python bench/results/h200_2026-12-04_s15/quality/accumulator_bias.py

Synthetic e4m3 inputs (128 queries, 2,048 keys, one head, q, k ~ 0.6 N(0, 1), V ~ N(mean, 1)), non-causal. Per row the
signed bias <O_emulated - O_fp32, O_fp32> / |O_fp32|^2, averaged over rows, with the row sum in fp32 (FADD) and by
the MMA (the emulated P.V of a ones V, as studies/fp8_accumulator models it), and the relative Frobenius error.
"""

import torch

from fa4_rowmax.config import FP8_MAX_OFFSET, SoftmaxConfig
from fa4_rowmax.reference.attention import attention_reference

E4M3 = torch.float8_e4m3fn
HEAD_DIM, KEYS, QUERIES, TILE_N = 64, 2048, 128, 192


def output(mode, q, k, v, bits):
    accumulator = dict(accumulator_mantissa_bits=13, accumulator_gemms="qk_pv", accumulator_promotion="tile")
    config = SoftmaxConfig(
        mode=mode, max_offset=FP8_MAX_OFFSET, p_dtype=E4M3, tile_n=TILE_N, **(accumulator if bits else {})
    )
    return attention_reference(q, k, v, config)[0][0, :, 0].double()


def bias(out, ref):
    return float((((out - ref) * ref).sum(-1) / (ref * ref).sum(-1)).mean())


for seed in (0, 1):
    for v_mean in (0.0, 0.5):
        g = torch.Generator().manual_seed(seed)
        q = (0.6 * torch.randn(1, QUERIES, 1, HEAD_DIM, generator=g)).to(E4M3)
        k = (0.6 * torch.randn(1, KEYS, 1, HEAD_DIM, generator=g)).to(E4M3)
        v = (torch.randn(1, KEYS, 1, HEAD_DIM, generator=g) + v_mean).to(E4M3)
        for mode in ("exact", "rowmax_h15"):
            ref = output(mode, q, k, v, None)
            fadd = output(mode, q, k, v, 13)
            mma = fadd / output(mode, q, k, torch.ones_like(v), 13)[:, :1]
            print(
                f"seed {seed}, V mean {v_mean}, {mode}: bias {bias(fadd, ref):+.2e} (FADD row sum), "
                f"{bias(mma, ref):+.2e} (MMA row sum); relative error {float((fadd - ref).norm() / ref.norm()):.2e}"
            )
