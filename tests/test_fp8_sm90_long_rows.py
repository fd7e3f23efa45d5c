"""The SM90 FP8 forward's accuracy contract at long rows (Note [Two-level P.V accumulation], softmax_sm90_fp8.py).

Hopper's FP8 wgmma truncates its accumulator to about 13 fraction bits. With the running O as the PV GEMM's C
operand (pv_accumulation="single") O's error grows with the key count once O is large: V of nonzero mean and
diffuse attention make it so. The contract of the default, two-level accumulation: the relative Frobenius error of
O against fp64 attention on the *same* e4m3 inputs at 128K keys stays within CONTRACT_RATIO of its value at 2K,
for V mean 0, 0.25 and 1, causal (bottom-right, 256 queries against all keys) and not, exact and rowmax_h15, the
row sum by FADD and by the MMA (whose 2,048-key limit is single-level's only). The single-level control shows the
same check fails without the promotion, so the contract test can fail.

Few queries and heads keep the run short: 256 queries x 4 heads x head dim 128 (the issue's setting), q and k
~ 0.35 N(0, 1) so that attention is diffuse, V ~ N(mean, 1); the fp64 reference runs on the GPU, one head at a
time.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

E4M3 = torch.float8_e4m3fn
QUERIES, HEADS = 256, 4
QK_STD = 0.35
KEYS = (2048, 8192, 32768, 131072)
# The contract (issue 22, "An accuracy contract"): O's error at 128K keys within 1.25x of its 2K value.
CONTRACT_RATIO = 1.25


@functools.lru_cache(maxsize=2 * len(KEYS))
def _problem(keys: int, v_mean: float, head_dim: int):
    gen = torch.Generator(device="cuda").manual_seed(keys * 7 + int(v_mean * 100) + head_dim)
    q = (torch.randn(1, QUERIES, HEADS, head_dim, device="cuda", generator=gen) * QK_STD).to(E4M3)
    k = (torch.randn(1, keys, HEADS, head_dim, device="cuda", generator=gen) * QK_STD).to(E4M3)
    v = (torch.randn(1, keys, HEADS, head_dim, device="cuda", generator=gen) + v_mean).to(E4M3)
    return q, k, v


@functools.lru_cache(maxsize=2 * len(KEYS))
def _fp64_attention(keys: int, v_mean: float, causal: bool, head_dim: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in fp64 on the e4m3 values; causal bottom-right (query i sees keys <= i + keys -
    QUERIES)."""
    q, k, v = (t.double() for t in _problem(keys, v_mean, head_dim))
    out = torch.empty(QUERIES, HEADS, head_dim, dtype=torch.float64, device="cuda")
    mask = None
    if causal:
        rows = torch.arange(QUERIES, device="cuda")[:, None] + keys - QUERIES
        mask = torch.arange(keys, device="cuda")[None, :] > rows
    for h in range(HEADS):
        scores = (q[0, :, h] @ k[0, :, h].T) / math.sqrt(head_dim)
        if mask is not None:
            scores.masked_fill_(mask, -math.inf)
        out[:, h] = torch.softmax(scores, dim=-1) @ v[0, :, h]
        del scores
    return out


def _relative_error(keys: int, v_mean: float, causal: bool, head_dim: int = 128, **levers) -> float:
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _problem(keys, v_mean, head_dim)
    out, _ = flash_attn_fp8_sm90(q, k, v, causal=causal, **levers)
    ref = _fp64_attention(keys, v_mean, causal, head_dim)
    out = out[0].double()
    assert torch.isfinite(out).all()
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref))


# The call with no lever at head dims 128 and 64 and the other tiling's entry where a call reaches it (Note [Tuned
# defaults]), and FA4's overlapped step at tile 128 with either row sum.
CONFIGS = {
    "defaults_d128": dict(head_dim=128),
    "defaults_d64": dict(head_dim=64),
    # the three-warpgroup entry causal GQA takes at head dim 128 (Note [Causal tiles that pack GQA])
    "tuned_m192_d128": dict(head_dim=128, tile_m=192),
    "overlap_n128_fadd": dict(tile_n=128, intra_wg_overlap=True, row_sum="fadd"),
    "overlap_n128_mma": dict(tile_n=128, intra_wg_overlap=True, row_sum="mma"),
}


# Note [H15's lattice at V mean 0]: with V of mean 0 and diffuse rows, Rowmax-H15's own weight error (its
# half-octave lattice, not the accumulator) grows from 9.5 % at 2K keys to 12.3 % at 128K at head dim 128 on the
# H200 (1.29-1.30x: tests' seeds, 2026-12-02), single-level and two-level alike (the shared benchmark: 9.6 % ->
# 12.8 % for both); the exact twin grows 1.18x there, as FA3-FP8 and vLLM's two-level FA3 do. So the contract's
# 1.25x does not hold for H15 at V mean 0 and head dim 128: those cases are strict expected failures, so that a
# change that makes them pass (or a seed that does) is seen. Head dim 64 stays within it (1.15x).
H15_LATTICE_AT_MEAN_0 = pytest.mark.xfail(
    strict=True, reason="Note [H15's lattice at V mean 0]: H15's own error grows 1.29-1.30x from 2K to 128K keys"
)


def _contract_cases():
    for config in sorted(CONFIGS):
        for mode in ("exact", "rowmax_h15"):
            for causal in (False, True):
                for v_mean in (0.0, 0.25, 1.0):
                    lattice = mode == "rowmax_h15" and v_mean == 0.0 and CONFIGS[config].get("head_dim", 128) == 128
                    marks = [H15_LATTICE_AT_MEAN_0] if lattice else []
                    yield pytest.param(v_mean, causal, mode, config, marks=marks)


@pytest.mark.parametrize("v_mean, causal, mode, config", list(_contract_cases()))
@pytest.mark.gpu(arch="sm90")
def test_two_level_error_is_flat_in_the_key_count(v_mean, causal, mode, config):
    levers = dict(softmax_mode=mode, **CONFIGS[config])
    errors = {keys: _relative_error(keys, v_mean, causal, **levers) for keys in KEYS}
    print(f"two-level {levers} causal={causal} v_mean={v_mean}:", errors)
    assert errors[KEYS[-1]] <= CONTRACT_RATIO * errors[KEYS[0]], errors


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
@pytest.mark.gpu(arch="sm90")
def test_single_level_breaks_the_contract(mode):
    """The control: with O as the FP8 accumulator the same check fails by 32K keys (V mean 1, diffuse rows)."""
    levers = dict(softmax_mode=mode, pv_accumulation="single", tile_n=128)
    errors = {keys: _relative_error(keys, 1.0, False, **levers) for keys in KEYS[:3]}
    print(f"single-level {mode}:", errors)
    assert errors[KEYS[2]] > CONTRACT_RATIO * errors[KEYS[0]], errors
