"""Which rows a NaN in one packed sequence's V reaches, stock FA4 exact beside rowmax_h15 (Note [A NaN in a packed V],
tests/test_fa4_varlen_paged.py). Run on the device (patched FA4): python -m studies.serving.nan_leak_probe

Three sequences of 130, 70 and 200 tokens, 4 heads, head dim 128, BF16; V[the last key of sequence 1, head 0, dim 3]
is NaN. Prints, per mode, how many packed rows hold a NaN, the first and last of them, and the heads.
"""

import math

import torch

LENGTHS = (130, 70, 200)


def _packed(seed, heads=4, head_dim=128):
    """The same packed tensors as tests/test_fa4_varlen_paged.py builds for its NaN test."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(sum(LENGTHS), heads, head_dim, device="cuda", generator=gen).to(torch.bfloat16)


def main() -> None:
    from flash_attn.cute import flash_attn_varlen_func

    q = _packed(9)
    k, v = (_packed(10 + i) for i in (0, 1))
    v[LENGTHS[0] + LENGTHS[1] - 1, 0, 3] = math.nan
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    for mode in ("exact", "rowmax_h15"):
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, softmax_mode=mode)
        out = out[0] if isinstance(out, tuple) else out
        rows = torch.isnan(out).any(-1).any(-1).nonzero().flatten().tolist()
        heads = torch.isnan(out).any(0).any(-1).tolist()
        print(f"{mode}: {len(rows)} rows with NaN, {rows[:1]} .. {rows[-1:]}, heads {heads}")


if __name__ == "__main__":
    main()
