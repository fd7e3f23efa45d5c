import math

import numpy as np
import pytest
import torch
from conftest import DEVICES

from fa4_rowmax.config import SoftmaxConfig
from fa4_rowmax.reference.attention import SUPPORTED_HEAD_DIMS, attention_reference
from fa4_rowmax.reference.fused_softmax import (
    fused_softmax_attention_reference,
    fused_softmax_attention_reference_varlen,
)

F64 = dict(compute_dtype=torch.float64)
EXACT_F64 = SoftmaxConfig(p_dtype=torch.float64, tile_n=32)
# softmax_scale = ln 2 makes scale_log2 exactly 1 in fp32: scores are log2-unit exponents.
LOG2_UNITS = math.log(2.0)


def naive_attention(q, k, v, causal, softmax_scale=None):
    """Full-matrix fp64 softmax attention, dense layout, GQA, causal bottom-right."""
    q, k, v = q.double(), k.double(), v.double()
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    k = k.repeat_interleave(heads_q // heads_k, dim=2)
    v = v.repeat_interleave(heads_q // heads_k, dim=2)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        row = torch.arange(seqlen_q)[:, None]
        key = torch.arange(seqlen_k)[None, :]
        s = s.masked_fill(key > row + seqlen_k - seqlen_q, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def assert_matches_naive(out, lse, expected_out, expected_lse, atol=1e-12):
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse))
    assert out.shape == expected_out.shape
    assert (out.double() - expected_out).abs().amax(dim=None).item() <= atol if out.numel() else True
    finite = torch.isfinite(expected_lse)
    # lse is float32 by contract.
    assert torch.allclose(lse[finite].double(), expected_lse[finite], rtol=3e-7, atol=3e-7)


def random_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim=64, dtype=torch.float64, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=generator, dtype=torch.float64) * scale
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, generator=generator, dtype=torch.float64) * scale
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, generator=generator, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def log2_units_problem(x_rows, heads=1):
    """q, k, v whose log2-unit scores are exactly `x_rows` (rows x keys), head_dim 64, with
    V one-hot over the keys so that `out[0, i, h, j]` is the normalised P of key j."""
    x_rows = torch.as_tensor(x_rows, dtype=torch.float32)
    rows, keys = x_rows.shape
    assert keys <= 64
    q = torch.zeros(1, rows, heads, 64)
    q[:, :, :, :rows] = torch.eye(rows)[None, :, None, :]
    k = torch.zeros(1, keys, 1, 64)
    k[0, :, 0, :rows] = x_rows.T
    v = torch.zeros(1, keys, 1, 64)
    v[0, :, 0, :keys] = torch.eye(keys)
    return q, k, v


# ---------------------------------------------------------------------------------------
# Every approximation off: fp64 softmax attention
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (17, 300), (300, 17), (129, 129), (64, 200)])
@pytest.mark.parametrize("heads_q, heads_k", [(6, 2), (3, 3)])
def test_exact_fp64_equals_softmax_attention(causal, seqlen_q, seqlen_k, heads_q, heads_k):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_k, seed=seqlen_q * 7 + seqlen_k, scale=1.5)
    out, lse = attention_reference(q, k, v, EXACT_F64, causal=causal, **F64)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (2, heads_q, seqlen_q)
    assert_matches_naive(out, lse, *naive_attention(q, k, v, causal))


@pytest.mark.parametrize(
    "config",
    [
        SoftmaxConfig(p_dtype=torch.float64, tile_n=16, rescale_threshold=8.0),
        SoftmaxConfig(p_dtype=torch.float64, tile_n=48, anchor="row"),
        SoftmaxConfig(p_dtype=torch.float64, tile_n=128, max_offset=8),
    ],
    ids=["stale-max", "row-anchor", "max-offset"],
)
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_exact_fp64_knobs_that_must_not_change_the_result(config, head_dim):
    q, k, v = random_qkv(1, 70, 150, 4, 2, head_dim=head_dim, seed=head_dim, scale=2.0)
    for causal in (False, True):
        out, lse = attention_reference(q, k, v, config, causal=causal, **F64)
        assert_matches_naive(out, lse, *naive_attention(q, k, v, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_exact_fp64_varlen_with_empty_sequences_and_masked_rows(causal):
    seqlens_q, seqlens_k = [5, 0, 70, 33, 9], [40, 3, 0, 100, 1]
    cu_q = torch.tensor([0] + list(np.cumsum(seqlens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(seqlens_k)), dtype=torch.int32)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(sum(seqlens_q), 4, 64, generator=generator, dtype=torch.float64)
    k = torch.randn(sum(seqlens_k), 2, 64, generator=generator, dtype=torch.float64)
    v = torch.randn(sum(seqlens_k), 2, 64, generator=generator, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, EXACT_F64, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **F64)
    assert out.shape == q.shape and lse.shape == (4, sum(seqlens_q))
    for b in range(len(seqlens_q)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        expected_out, expected_lse = naive_attention(q[None, rows], k[None, keys], v[None, keys], causal)
        assert_matches_naive(out[rows][None], lse[:, rows][None], expected_out, expected_lse)
    # Sequence 2 (rows 5..74) has no keys; causally, only the last row of sequence 4 sees its key.
    empty = [*range(5, 75)] + ([*range(108, 116)] if causal else [])
    assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[:, empty]).all())
    assert bool(torch.isfinite(lse[:, [r for r in range(sum(seqlens_q)) if r not in empty]]).all())
    assert not bool(torch.isnan(out).any())


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = random_qkv(1, 50, 20, 2, 2, dtype=torch.bfloat16, seed=4)
    for mode in ("exact", "rowmax_h15", "rowmax_pot", "baps", "fused_softmax"):
        out, lse = attention_reference(q, k, v, SoftmaxConfig(mode=mode, tile_n=32, tile_m=8), causal=True)
        assert bool((out[:, :30] == 0).all()) and bool(torch.isneginf(lse[:, :, :30]).all()), mode
        assert bool(torch.isfinite(lse[:, :, 30:]).all()) and not bool(torch.isnan(out).any()), mode


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 3e-6), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_exact_fp32_compute_is_close_to_fp64(dtype, tolerance):
    q, k, v = random_qkv(2, 100, 260, 4, 1, dtype=dtype, seed=5)
    out, lse = attention_reference(q, k, v, causal=True)
    expected_out, expected_lse = naive_attention(q, k, v, True)
    assert out.dtype == dtype
    assert (out.double() - expected_out).abs().max().item() < tolerance
    assert (lse.double() - expected_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["exact", "rowmax_h15", "rowmax_pot", "baps", "fused_softmax"])
def test_same_result_on_every_device(device, mode):
    q, k, v = random_qkv(2, 90, 200, 4, 2, dtype=torch.bfloat16, seed=6)
    config = SoftmaxConfig(mode=mode, tile_n=64, tile_m=32)
    out_cpu, lse_cpu = attention_reference(q, k, v, config, causal=True)
    out, lse = attention_reference(q.to(device), k.to(device), v.to(device), config, causal=True)
    assert out.device.type == device and lse.device.type == device
    # GEMMs sum in another order on another device: an element may cross a rounding boundary of
    # the approximate modes (or flip a BAPS block), so a rare larger difference is allowed.
    far = (out.cpu().float() - out_cpu.float()).abs() > 2e-2
    assert far.float().mean().item() <= (0.0 if mode == "exact" else 1e-3)
    torch.testing.assert_close(lse.cpu(), lse_cpu, atol=1e-3 if mode == "exact" else 5e-2, rtol=0)


# ---------------------------------------------------------------------------------------
# FA4 running max: rescale_threshold
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "jump, threshold, skipped", [(3.0, 8.0, True), (8.0, 8.0, True), (9.0, 8.0, False), (0.5, 0.0, False)]
)
def test_stale_max_weights_reach_at_most_two_to_the_threshold(jump, threshold, skipped):
    # Two tiles of 16 keys. FA4 walks them last to first: keys 16..31 (max 0) set the max,
    # then keys 0..15 bring a score `jump` octaves higher.
    x = torch.full((1, 32), -3.0)
    x[0, 20] = 0.0
    x[0, 5] = jump
    q, k, v = log2_units_problem(x, heads=2)
    config = SoftmaxConfig(tile_n=16, rescale_threshold=threshold, p_dtype=torch.float32)
    out, lse, counters = attention_reference(q, k, v, config, softmax_scale=LOG2_UNITS, return_counters=True)
    assert counters["rescales_skipped"] == (2 if skipped else 0)
    assert counters["rescales"] == (0 if skipped else 2)
    assert counters["tiles"] == 4
    assert counters["p_max"] == (2.0**jump if skipped else 1.0)
    # Normalised weights and the lse do not depend on the stale max.
    expected = torch.softmax(x.double() * math.log(2.0), dim=-1)
    torch.testing.assert_close(out[0, 0, 0, :32].double(), expected[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse[0, 0, 0].double(), torch.logsumexp(x.double() * math.log(2.0), -1)[0])


def test_fp8_p_saturates_above_the_dtype_max():
    # max_offset 8 plus a stale max 1.5 octaves up: P reaches 2^9.5 > 448, e4m3's max.
    x = torch.full((1, 32), -2.0)
    x[0, 20] = 0.0
    x[0, 5] = 1.5
    q, k, v = log2_units_problem(x)
    config = SoftmaxConfig(tile_n=16, rescale_threshold=8.0, max_offset=8, p_dtype=torch.float8_e4m3fn)
    out, lse, counters = attention_reference(q, k, v, config, softmax_scale=LOG2_UNITS, return_counters=True)
    assert counters["p_max"] == pytest.approx(2.0**9.5, rel=1e-6)
    weights = out[0, 0, 0, :32].double()
    row_sum = torch.exp2(x.double() + 8).sum()
    assert weights[5].item() == pytest.approx(448.0 / row_sum.item(), rel=1e-3)
    assert weights[20].item() == pytest.approx(256.0 / row_sum.item(), rel=1e-3)


# ---------------------------------------------------------------------------------------
# Rowmax-H15 and Rowmax-PoT through the tile loop
# ---------------------------------------------------------------------------------------


def readback_log2_ratio(x, config, softmax_scale=LOG2_UNITS):
    """log2(P_mode / P_exact) per key, P read back through one-hot V."""
    q, k, v = log2_units_problem(x)
    out, _ = attention_reference(q, k, v, config, softmax_scale=softmax_scale)
    p = out[0, :, 0, : x.shape[1]].double()
    exact = torch.softmax(torch.as_tensor(x, dtype=torch.float64) * math.log(2.0), dim=-1)
    return torch.log2(p / exact)


def adversarial_rows():
    """Rows whose distances to the max sit just either side of H15 rounding boundaries
    (k/2 + 1/4 octaves): just below -(j + 3/4) H rounds down to 2^-(j+1) (error -1/4),
    just above it rounds up to 1.5 * 2^-(j+1) (error +0.335). The max comes last, in the
    tile FA4 processes first, so it anchors the lattice from the start."""
    below = [-(j + 0.75) - 1e-3 for j in range(15)]
    above = [-(j + 0.75) + 1e-3 for j in range(15)]
    half_octaves = [-(j / 2 + 0.25) + (-1) ** j * 1e-3 for j in range(30)]
    rows = [below + above + [0.0], half_octaves + [0.0]]
    # Scattered so that the running max moves from tile to tile.
    rows.append([(-1) ** j * (j % 7) / 4 + j / 20 for j in range(40)])
    width = max(len(r) for r in rows)
    return torch.tensor([[-40.0] * (width - len(r)) + r for r in rows]) + 5.0


@pytest.mark.parametrize("threshold, anchor", [(0.0, "tile"), (8.0, "tile"), (0.0, "row")])
def test_h15_ratio_bound_on_random_and_adversarial_rows(threshold, anchor):
    generator = torch.Generator().manual_seed(7)
    random_rows = torch.randn(8, 61, generator=generator) * 3
    config = SoftmaxConfig(mode="rowmax_h15", tile_n=16, rescale_threshold=threshold, anchor=anchor)
    spreads = []
    for x in (random_rows, adversarial_rows()):
        ratio = readback_log2_ratio(x, config)
        spread = ratio.max(-1).values - ratio.min(-1).values
        assert float(spread.max()) <= math.log2(1.5) + 1e-5
        spreads.append(float(spread.max()))
    # The adversarial rows come close to the bound, so the check has teeth.
    assert spreads[1] > 0.55


def test_h15_weights_are_exact_in_bf16():
    q, k, v = random_qkv(1, 80, 300, 4, 2, dtype=torch.float32, seed=8, scale=1.5)
    out_fp32, lse_fp32 = attention_reference(q, k, v, SoftmaxConfig(mode="rowmax_h15", p_dtype=torch.float32))
    out_bf16, lse_bf16 = attention_reference(q, k, v, SoftmaxConfig(mode="rowmax_h15", p_dtype=torch.bfloat16))
    assert torch.equal(out_fp32, out_bf16) and torch.equal(lse_fp32, lse_bf16)
    out_exact, _ = attention_reference(q, k, v, SoftmaxConfig(p_dtype=torch.float32))
    assert not torch.equal(out_fp32, out_exact)


@pytest.mark.parametrize("tile_n, anchor", [(16, "tile"), (8, "row")])
@pytest.mark.parametrize("k_max", [3, 20])
def test_pot_weights_are_powers_of_two_clamped_at_k_max(k_max, tile_n, anchor):
    x = torch.tensor([[0.0, -0.4, -0.6, -3.4, -2.5, -30.0, -90.0] + [-200.0] * 9])
    q, k, v = log2_units_problem(x)
    # One tile, or the whole-row anchor: the clamp counts octaves below the row max. (With a
    # tile anchor the clamp is relative to each tile's running max, and FA4's exact rescale
    # underflows the all-(-200) tile once the max moves by 200 octaves.)
    config = SoftmaxConfig(mode="rowmax_pot", pot_k_max=k_max, tile_n=tile_n, anchor=anchor, p_dtype=torch.float32)
    out, _ = attention_reference(q, k, v, config, softmax_scale=LOG2_UNITS)
    p = out[0, 0, 0, :16].double()
    levels = torch.tensor([0, 0, -1, -3, -2, -30, -90] + [-200] * 9, dtype=torch.float64).clamp(min=-k_max)
    expected = torch.exp2(levels)
    torch.testing.assert_close(p, expected / expected.sum(), rtol=1e-6, atol=0)


def test_pot_masked_keys_stay_zero():
    q, k, v = random_qkv(1, 40, 40, 2, 2, dtype=torch.float32, seed=9)
    out, _ = attention_reference(q, k, v, SoftmaxConfig(mode="rowmax_pot", tile_n=16), causal=True)
    expected_first_row = v[0, 0].float()  # row 0 sees key 0 only
    torch.testing.assert_close(out[0, 0], expected_first_row)


# ---------------------------------------------------------------------------------------
# BAPS
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("lam", [0, 1, 2])
@pytest.mark.parametrize(
    "b0_max, excess", [(2.25, -0.25), (2.25, 0.0), (2.25, 0.25), (3.0, 3.0), (3.0, -5.0), (3.0, 0.0)]
)
def test_baps_restarts_exactly_when_a_tile_exceeds_the_integer_max_by_more_than_lambda(lam, b0_max, excess):
    # Tile 0 (B0) has max b0_max, so the approximate max is ceil(b0_max) = 3; tile 1's max
    # sits `lam + excess` above it.
    x = torch.full((1, 16), -1.0)
    x[0, 2] = b0_max
    x[0, 11] = 3.0 + lam + excess
    q, k, v = log2_units_problem(x)
    config = SoftmaxConfig(mode="baps", baps_lambda=lam, tile_n=8, tile_m=1)
    _, _, counters = attention_reference(q, k, v, config, softmax_scale=LOG2_UNITS, return_counters=True)
    restarted = excess > 0
    assert counters["restarts"] == int(restarted)
    assert counters["baps_blocks"] == 1
    assert counters["arr"] == counters["prr"] == float(restarted)


def test_baps_equals_exact_when_every_exponent_is_an_integer():
    # Integer log2 scores with x - m in [-15, 0]: HiF8 holds every such T (integers stop being
    # exact at 16, where the mantissa is down to 2 bits) and 2^T, so BAPS (restarts included)
    # must reproduce exact attention.
    generator = torch.Generator().manual_seed(10)
    x = torch.randint(-6, 1, (12, 64), generator=generator).float()  # T >= -6 - 9
    x[3, 40] = 4.0  # later tiles that force restarts
    x[7, 20] = 9.0
    x[8, 63] = 2.0
    q, k, v = log2_units_problem(x)
    v = torch.randn(v.shape, generator=generator)
    config = SoftmaxConfig(mode="baps", tile_n=16, tile_m=4)
    out, lse, counters = attention_reference(q, k, v, config, softmax_scale=LOG2_UNITS, return_counters=True)
    assert counters["restarts"] >= 3
    expected_out, expected_lse = naive_attention(q, k, v, False, softmax_scale=LOG2_UNITS)
    torch.testing.assert_close(out.double(), expected_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(lse.double(), expected_lse, atol=2e-6, rtol=0)
    # Off the integer grid HiF8 rounding shows.
    out_off, _ = attention_reference(q, k * 1.1, v, config, softmax_scale=LOG2_UNITS)
    expected_off, _ = naive_attention(q, k * 1.1, v, False, softmax_scale=LOG2_UNITS)
    assert (out_off.double() - expected_off).abs().max().item() > 1e-3


def baps_restart_oracle(x, seqlen_q, seqlen_k, causal, tile_m, tile_n, lam, critical):
    """Restart counts straight from the definition, one (head, row block) at a time, in Python.
    x: (heads, seqlen_q, seqlen_k) float64 log2-unit scores."""
    restarts, blocks, shares = 0, 0, []
    for head in range(x.shape[0]):
        for row0 in range(0, seqlen_q, tile_m):
            rows = range(row0, min(row0 + tile_m, seqlen_q))
            visible = {i: [j for j in range(seqlen_k) if not causal or j <= i + seqlen_k - seqlen_q] for i in rows}
            m = {}
            for i in rows:
                keys = [j for j in visible[i] if j < critical * tile_n]
                m[i] = math.ceil(max(x[head, i, j] for j in keys)) if keys else -math.inf
            block_restarts, block_tiles = 0, 0
            for t in range(critical, -(-seqlen_k // tile_n)):
                tile_keys = {i: [j for j in visible[i] if t * tile_n <= j < (t + 1) * tile_n] for i in rows}
                if not any(tile_keys.values()):
                    continue
                block_tiles += 1
                tile_max = {i: max(x[head, i, j] for j in tile_keys[i]) for i in rows if tile_keys[i]}
                if any(tile_max[i] - m[i] > lam for i in tile_max):
                    block_restarts += 1
                    for i in tile_max:
                        m[i] = max(m[i], math.ceil(tile_max[i]))
            restarts += block_restarts
            blocks += block_tiles
            if block_tiles:
                shares.append(block_restarts / block_tiles)
    return restarts, blocks, max(shares, default=0.0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lam", [0, 1, 2])
def test_baps_counters_match_the_definition(causal, lam):
    q, k, v = random_qkv(1, 37, 90, 2, 1, dtype=torch.float32, seed=11 + lam, scale=2.0)
    config = SoftmaxConfig(mode="baps", baps_lambda=lam, tile_n=16, tile_m=8)
    _, _, counters = attention_reference(q, k, v, config, causal=causal, return_counters=True)
    scale_log2 = 64**-0.5 * math.log2(math.e)
    x = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2))[0] * scale_log2
    restarts, blocks, prr = baps_restart_oracle(x.numpy(), 37, 90, causal, 8, 16, lam, critical=1)
    assert restarts > 0
    assert (counters["restarts"], counters["baps_blocks"]) == (restarts, blocks)
    assert counters["arr"] == pytest.approx(restarts / blocks)
    assert counters["prr"] == pytest.approx(prr)


def test_baps_restart_rate_falls_as_lambda_grows():
    q, k, v = random_qkv(2, 256, 256, 4, 2, dtype=torch.bfloat16, seed=12, scale=1.7)
    rates = []
    for lam in (0, 1, 2):
        config = SoftmaxConfig(mode="baps", baps_lambda=lam, tile_n=32, tile_m=32)
        _, _, counters = attention_reference(q, k, v, config, causal=True, return_counters=True)
        rates.append((counters["restarts"], counters["arr"], counters["prr"]))
    assert rates[0][0] > rates[1][0] > rates[2][0] > 0
    assert rates[0][1] > rates[1][1] > rates[2][1]
    assert rates[0][2] >= rates[1][2] >= rates[2][2]


# ---------------------------------------------------------------------------------------
# Fused-Softmax: the same pieces as fused_softmax.py's own loop
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mx_format", ["mxfp8", "mxfp6", "mxfp4"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_softmax_matches_the_module_reference(mx_format, causal):
    q, k, v = random_qkv(2, 45, 130, 4, 2, dtype=torch.bfloat16, seed=13, scale=1.5)
    config = SoftmaxConfig(mode="fused_softmax", mx_format=mx_format, recovery_threshold=2.0, tile_n=32)
    out, lse, counters = attention_reference(q, k, v, config, causal=causal, return_counters=True)
    expected_out, expected_lse, expected_counters = fused_softmax_attention_reference(
        q, k, v, causal=causal, mx_format=mx_format, recovery_threshold=2.0, tile_n=32, return_counters=True
    )
    torch.testing.assert_close(out.float(), expected_out.float(), atol=1e-2, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=0)
    assert counters["recoveries"] == int(expected_counters["recoveries"].sum()) > 0


def test_fused_softmax_varlen_matches_the_module_reference():
    seqlens_q, seqlens_k = [7, 40, 1], [70, 33, 64]
    cu_q = torch.tensor([0] + list(np.cumsum(seqlens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(seqlens_k)), dtype=torch.int32)
    generator = torch.Generator().manual_seed(14)
    q = torch.randn(sum(seqlens_q), 4, 64, generator=generator)
    k = torch.randn(sum(seqlens_k), 2, 64, generator=generator) * 2
    v = torch.randn(sum(seqlens_k), 2, 64, generator=generator)
    config = SoftmaxConfig(mode="fused_softmax", recovery_threshold=1.0, tile_n=32)
    out, lse = attention_reference(q, k, v, config, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    expected_out, expected_lse = fused_softmax_attention_reference_varlen(
        q, k, v, cu_q, cu_k, causal=True, recovery_threshold=1.0, tile_n=32
    )
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------


def _inputs():
    q, k, v = random_qkv(1, 8, 8, 2, 1, dtype=torch.float32)
    return dict(q=q, k=k, v=v)


def _varlen_inputs():
    generator = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(10, 2, 64, generator=generator),
        k=torch.randn(12, 1, 64, generator=generator),
        v=torch.randn(12, 1, 64, generator=generator),
        cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32),
    )


def _with(base, **changes):
    arguments = base()
    arguments.update(changes)
    return arguments


def _nan_at(tensor):
    tensor = tensor.clone()
    tensor.view(-1)[3] = math.nan
    return tensor


BAD_INPUTS = [
    (lambda: _with(_inputs, config="rowmax_h15"), TypeError, "config must be a SoftmaxConfig"),
    (lambda: _with(_inputs, q=[[0.0]]), TypeError, "q must be a torch.Tensor"),
    (lambda: _with(_inputs, q=_inputs()["q"].int()), TypeError, "q must have one of the dtypes"),
    (lambda: _with(_inputs, k=_inputs()["k"].double()), TypeError, "q, k and v must share one dtype"),
    (lambda: _with(_inputs, v=torch.zeros(1, 8, 1, 64, device="meta")), ValueError, "one device"),
    (lambda: _with(_inputs, q=_inputs()["q"][0]), ValueError, "q must be 4-D"),
    (lambda: _with(_inputs, v=_inputs()["v"][:, :5]), ValueError, "k and v must have the same shape"),
    (lambda: _with(_inputs, q=torch.zeros(2, 8, 2, 64)), ValueError, "same batch size"),
    (
        lambda: _with(_inputs, q=torch.zeros(1, 8, 2, 80), k=torch.zeros(1, 8, 1, 80), v=torch.zeros(1, 8, 1, 80)),
        ValueError,
        "head_dim must be one of (64, 96, 128, 192, 256)",
    ),
    (lambda: _with(_inputs, k=torch.zeros(1, 8, 1, 128), v=torch.zeros(1, 8, 1, 128)), ValueError, "k's head_dim"),
    (
        lambda: _with(_inputs, q=torch.zeros(1, 8, 3, 64), k=torch.zeros(1, 8, 2, 64), v=torch.zeros(1, 8, 2, 64)),
        ValueError,
        "multiple of k's heads",
    ),
    (lambda: _with(_inputs, k=_nan_at(_inputs()["k"])), ValueError, "k holds NaN or Inf"),
    (lambda: _with(_inputs, v=_inputs()["v"] * math.inf), ValueError, "v holds NaN or Inf"),
    (lambda: _with(_inputs, causal=1), TypeError, "causal must be a bool"),
    (lambda: _with(_inputs, softmax_scale=-1.0), ValueError, "softmax_scale"),
    (lambda: _with(_inputs, softmax_scale="0.1"), TypeError, "softmax_scale"),
    (lambda: _with(_inputs, compute_dtype=torch.float16), ValueError, "compute_dtype must be one of"),
    (lambda: _with(_inputs, return_counters="yes"), TypeError, "return_counters"),
    (lambda: _with(_varlen_inputs, cu_seqlens_k=None), ValueError, "given together"),
    (
        lambda: _with(_varlen_inputs, cu_seqlens_q=torch.tensor([0, 4, 10])),
        TypeError,
        "cu_seqlens_q must have dtype torch.int32",
    ),
    (
        lambda: _with(_varlen_inputs, cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_q must start at 0",
    ),
    (
        lambda: _with(_varlen_inputs, cu_seqlens_k=torch.tensor([0, 7, 5, 12], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_k must start at 0, never decrease",
    ),
    (
        lambda: _with(_varlen_inputs, cu_seqlens_k=torch.tensor([0, 5, 11], dtype=torch.int32)),
        ValueError,
        "end at the token count 12",
    ),
    (
        lambda: _with(_varlen_inputs, cu_seqlens_k=torch.tensor([0, 5, 6, 12], dtype=torch.int32)),
        ValueError,
        "same length",
    ),
    (
        lambda: _with(_varlen_inputs, cu_seqlens_q=torch.tensor([[0, 4, 10]], dtype=torch.int32)),
        ValueError,
        "cu_seqlens_q must be 1-D",
    ),
    (lambda: _with(_varlen_inputs, q=torch.zeros(1, 10, 2, 64)), ValueError, "q must be 3-D"),
]


@pytest.mark.parametrize("make_arguments, error, message", BAD_INPUTS)
def test_bad_input_names_the_argument(make_arguments, error, message):
    arguments = make_arguments()
    with pytest.raises(error) as info:
        attention_reference(**arguments)
    assert message in str(info.value)


# --- anchor_rounding="half_octave" (the SM90 folded FFMA's anchor) ---------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(anchor_rounding="quarter"), "anchor_rounding"),
        (dict(mode="exact", anchor_rounding="half_octave"), "rowmax_h15"),
    ],
)
def test_anchor_rounding_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SoftmaxConfig(**kwargs)


def _half_octave_weights_one_tile(q, k, v, scale):
    """fp64 H15 on one tile with the anchor a = round_half_even(2 * rowmax(x)) / 2, x = s * scale_log2."""
    from fa4_rowmax.reference.exp_approx import h15

    scale_log2 = scale * math.log2(math.e)
    x = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale_log2
    anchor = torch.round(2.0 * x.amax(-1, keepdim=True)) / 2.0  # torch.round: half to even
    p = h15((x - anchor).float()).double()
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.double()) / p.sum(-1).transpose(1, 2)[..., None]
    lse = (anchor[..., 0] + torch.log2(p.sum(-1))) * math.log(2.0)
    return out, lse, p


def test_half_octave_anchor_matches_a_direct_one_tile_computation():
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 48, 3, 64, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    config = SoftmaxConfig(mode="rowmax_h15", tile_n=64, p_dtype=torch.float64, anchor_rounding="half_octave")
    out, lse = attention_reference(q, k, v, config, compute_dtype=torch.float64)
    want_out, want_lse, p = _half_octave_weights_one_tile(q, k, v, 64**-0.5)
    torch.testing.assert_close(out, want_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)  # the LSE is returned in fp32
    # The max element sits within 1/4 octave of the anchor, so it still rounds to weight 1; the others move.
    assert (p.amax(-1) == 1.0).all()
    exact_out, _ = attention_reference(
        q, k, v, SoftmaxConfig(mode="rowmax_h15", tile_n=64, p_dtype=torch.float64), compute_dtype=torch.float64
    )
    assert not torch.equal(out, exact_out)


@pytest.mark.parametrize("causal, threshold", [(True, 0.0), (False, 0.0), (True, 4.0)])
def test_half_octave_anchor_over_many_tiles_stays_in_the_h15_envelope(causal, threshold):
    """Across tiles the rescale uses exp2(a_old - a_new): the result stays within H15's ratio bound of
    exact attention, and the LSE within the per-element envelope."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(1, 200, 2, 64, generator=gen, dtype=torch.float64) * 3
    k, v = (torch.randn(1, 200, 2, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    config = SoftmaxConfig(
        mode="rowmax_h15", tile_n=32, p_dtype=torch.float64, anchor_rounding="half_octave", rescale_threshold=threshold
    )
    out, lse = attention_reference(q, k, v, config, causal=causal, compute_dtype=torch.float64)
    _, exact_lse = attention_reference(
        q, k, v, SoftmaxConfig(p_dtype=torch.float64, tile_n=32), causal=causal, compute_dtype=torch.float64
    )
    assert torch.isfinite(out).all()
    # log2(sum H) - log2(sum exp2) lies in H's per-element envelope [-0.25, 0.335] octaves.
    shift = (lse - exact_lse) / math.log(2.0)
    assert (shift >= -0.25 - 1e-9).all() and (shift <= math.log2(1.5) - 0.25 + 1e-9).all()


# Issue 25, defect 3: finite inputs whose scores (or P @ V, or the LSE) overflow are refused by name, never
# answered with the masked row (out 0, LSE -inf); where the caller's compute_dtype=torch.float64 holds them, they
# are computed.
_MODES = ["exact", "rowmax_h15", "rowmax_pot", "baps", "fused_softmax"]


def _constant_inputs(value, keys=6, dtype=torch.float32, v_value=1.0, k_sign=1.0):
    q = torch.full((1, 3, 2, 64), value, dtype=dtype)
    k = torch.full((1, keys, 1, 64), k_sign * value, dtype=dtype)
    return q, k, torch.full((1, keys, 1, 64), v_value, dtype=dtype)


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("k_sign", [1.0, -1.0], ids=["scores_inf", "scores_minus_inf"])
def test_scores_beyond_the_compute_dtype_are_refused(mode, k_sign):
    q, k, v = _constant_inputs(1e20, k_sign=k_sign)  # scores +-6.4e41: past float32
    with pytest.raises(ValueError, match=r"q and k give scores .* in compute_dtype beyond torch.float32's range"):
        attention_reference(q, k, v, SoftmaxConfig(mode=mode))


@pytest.mark.parametrize("mode", _MODES)
def test_float64_inputs_beyond_float32_are_refused_by_name(mode):
    q, k, v = _constant_inputs(1e200, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"q holds values beyond compute_dtype=torch.float32's range"):
        attention_reference(q, k, v, SoftmaxConfig(mode=mode))
    with pytest.raises(ValueError, match=r"q and k give scores .* in compute_dtype beyond torch.float64's range"):
        attention_reference(q, k, v, SoftmaxConfig(mode=mode), compute_dtype=torch.float64)


@pytest.mark.parametrize("mode", _MODES)
def test_float64_computes_scores_float32_cannot_hold(mode):
    """q = k = 1e19 (head dim 64): every score is 6.4e39 (past float32), softmax_scale 1e-3 puts the LSE at
    6.4e36 (inside it). Every key has the same score, so out is v = 1 and the LSE s * scale + ln(keys)."""
    q, k, v = _constant_inputs(1e19)
    config = SoftmaxConfig(mode=mode)
    with pytest.raises(ValueError, match="q and k give scores"):
        attention_reference(q, k, v, config, softmax_scale=1e-3)
    out, lse = attention_reference(q, k, v, config, softmax_scale=1e-3, compute_dtype=torch.float64)
    assert torch.equal(out, torch.ones_like(out))
    expected_out, expected_lse = naive_attention(q, k, v, causal=False, softmax_scale=1e-3)
    if mode != "fused_softmax":  # its MX-quantized q and k move the scores (not the output)
        assert torch.equal(lse, expected_lse.float())


def test_lse_beyond_float32_is_refused():
    """float64 holds the scores, but the LSE (6.4e39 * 8**-1 = 8e38) is returned in float32."""
    q, k, v = _constant_inputs(1e19)
    with pytest.raises(ValueError, match=r"log-sum-exp \(the LSE\) beyond torch.float32's range"):
        attention_reference(q, k, v, compute_dtype=torch.float64)


def test_output_beyond_the_compute_dtype_is_refused_and_float64_computes_it():
    """v = 3e38 on 6 keys of weight 2**8 each: P @ V (4.6e41) overflows float32, its mean (3e38) does not."""
    q, k, v = _constant_inputs(0.5, v_value=3e38)
    with pytest.raises(ValueError, match=r"v: P @ V in compute_dtype beyond torch.float32's range"):
        attention_reference(q, k, v)
    out, _ = attention_reference(q, k, v, compute_dtype=torch.float64)
    assert torch.equal(out, v[:, :3].expand(1, 3, 2, 64))


# Issue 25, defect 8: empty inputs return FA4's empty result (flash_attn/cute/interface.py: out zero-filled, lse
# filled with -inf when seqlen_k == 0 or total_q == 0), in the shapes of a non-empty call.
@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize(
    "q_shape,kv_shape",
    [((0, 4, 2, 64), (0, 5, 1, 64)), ((2, 0, 2, 64), (2, 5, 1, 64)), ((2, 4, 0, 64), (2, 5, 1, 64))],
    ids=["batch0", "seqlen_q0", "heads_q0"],
)
def test_empty_dense_inputs_return_empty_results(mode, q_shape, kv_shape):
    q, k, v = torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)
    out, lse, counters = attention_reference(q, k, v, SoftmaxConfig(mode=mode), causal=True, return_counters=True)
    batch, seqlen_q, heads_q, _ = q_shape
    assert out.shape == q_shape and out.dtype == q.dtype and lse.shape == (batch, heads_q, seqlen_q)
    assert lse.dtype == torch.float32
    _, _, nonempty = attention_reference(
        torch.randn(1, 4, 2, 64),
        torch.randn(1, 5, 1, 64),
        torch.randn(1, 5, 1, 64),
        SoftmaxConfig(mode=mode),
        return_counters=True,
    )
    assert counters.keys() == nonempty.keys()
    assert all(value == 0 for value in counters.values())


@pytest.mark.parametrize("total_q,total_k", [(0, 0), (0, 5), (4, 0)])
def test_empty_varlen_totals_return_empty_results(total_q, total_k):
    q, k, v = torch.randn(total_q, 2, 64), torch.randn(total_k, 1, 64), torch.randn(total_k, 1, 64)
    cu_q = torch.tensor([0, total_q], dtype=torch.int32)
    cu_k = torch.tensor([0, total_k], dtype=torch.int32)
    out, lse = attention_reference(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert out.shape == (total_q, 2, 64) and lse.shape == (2, total_q)
    assert bool((out == 0).all()) and bool((lse == -math.inf).all())


def test_empty_fp8_inputs_give_bf16_and_are_still_checked():
    q = torch.zeros(0, 4, 2, 64).to(torch.float8_e4m3fn)
    k = torch.zeros(0, 5, 1, 64).to(torch.float8_e4m3fn)
    out, lse = attention_reference(q, k, k)
    assert out.dtype == torch.bfloat16 and out.shape == (0, 4, 2, 64) and lse.shape == (0, 2, 4)
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        attention_reference(q, k, k, compute_dtype=torch.float16)
