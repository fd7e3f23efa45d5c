"""The semantic reference with FP8 inputs, descales and an FP8 P (fa4_rowmax/reference/attention.py, Notes
[FP8 inputs and descales] and [H15 with FP8 P]) and the H15 e4m3 byte oracle (exp_approx.h15_e4m3_bytes)."""

import dataclasses
import math

import pytest
import torch
from helpers_emulation import one_thread  # noqa: F401 (a fixture)

from fa4_rowmax.config import FP8_MAX_OFFSET, SoftmaxConfig
from fa4_rowmax.reference.attention import attention_reference
from fa4_rowmax.reference.exp_approx import H15_E4M3_MAX_N, H15_E4M3_MIN_N, h15_e4m3_bytes

E4M3 = torch.float8_e4m3fn
LN2 = math.log(2.0)
# Unit roundoff of e4m3 (3 fraction bits): a round-to-nearest error is at most 2^-4 of the value's binade.
E4M3_UNIT_ROUNDOFF = 2.0**-4
E4M3_TINY = 2.0**-6  # smallest normal
E4M3_SUBNORMAL_STEP = 2.0**-9


def h15_weight_with_offset(n: torch.Tensor) -> torch.Tensor:
    """The exact H15 weight of half-octave index n (relative to the max), times 2^FP8_MAX_OFFSET, in fp64."""
    shifted = n.double() + 2 * FP8_MAX_OFFSET
    return torch.exp2(torch.floor(shifted / 2)) * (1 + torch.remainder(shifted, 2) / 2)


def fp8_qkv(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim=64, seed=0, dtype=E4M3):
    generator = torch.Generator().manual_seed(seed)
    shapes = [
        (batch, seqlen_q, heads_q, head_dim),
        (batch, seqlen_k, heads_k, head_dim),
        (batch, seqlen_k, heads_k, head_dim),
    ]
    return [torch.randn(*shape, generator=generator).to(dtype) for shape in shapes]


# ---- the byte oracle ----------------------------------------------------------------------------------------


def test_h15_e4m3_bytes_equal_torch_e4m3_of_every_normal_weight():
    n = torch.arange(H15_E4M3_MIN_N, H15_E4M3_MAX_N + 1)
    weights = h15_weight_with_offset(n)
    expected = weights.float().to(E4M3).view(torch.uint8)
    got = h15_e4m3_bytes(n)
    assert got.dtype == torch.uint8
    assert torch.equal(got, expected)
    assert torch.equal(got.view(E4M3).double(), weights)  # every one of them exact in e4m3
    assert torch.equal(got.int(), 4 * n + 8 * (7 + 8))
    assert (got[0].item(), got[-1].item()) == (8, 124)  # 2^-6 (e4m3's smallest normal) and 1.5 * 2^8


def test_h15_e4m3_bytes_clamp_to_zero_below_the_normal_range():
    n = torch.arange(-60, H15_E4M3_MIN_N)
    assert torch.equal(h15_e4m3_bytes(n), torch.zeros_like(n, dtype=torch.uint8))
    # The clamp is needed: the linear formula there is not the weight's subnormal code (n = -29: 1.5 * 2^-7 is
    # code 6, the formula gives 4 = 2^-7).
    below = torch.tensor([H15_E4M3_MIN_N - 1])
    assert h15_weight_with_offset(below).float().to(E4M3).view(torch.uint8).item() == 6
    assert (4 * below + 120).item() == 4


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (torch.tensor([0.0]), TypeError, "integer tensor"),
        ([0], TypeError, "torch.Tensor"),
        (torch.tensor([0, H15_E4M3_MAX_N + 1]), ValueError, "n must be <= 1"),
    ],
)
def test_h15_e4m3_bytes_rejects_bad_input(bad, error, message):
    with pytest.raises(error, match=message):
        h15_e4m3_bytes(bad)


def one_hot_row(x_row):
    """fp64 q, k, v with log2-unit scores x_row (one query, softmax_scale ln 2) and V one-hot over the keys,
    so out[0, 0, 0, j] is the normalised P of key j."""
    keys = len(x_row)
    q = torch.zeros(1, 1, 1, 64, dtype=torch.float64)
    q[0, 0, 0, 0] = 1.0
    k = torch.zeros(1, keys, 1, 64, dtype=torch.float64)
    k[0, :, 0, 0] = torch.as_tensor(x_row, dtype=torch.float64)
    v = torch.zeros(1, keys, 1, 64, dtype=torch.float64)
    v[0, :, 0, :keys] = torch.eye(keys, dtype=torch.float64)
    return q, k, v


def test_reference_h15_with_e4m3_p_is_the_byte_oracle_and_sums_the_same_p():
    n = -torch.arange(0, 40)  # half octaves 0 .. -39 below the max: across the flush at -28
    q, k, v = one_hot_row(n.double() / 2)
    config = SoftmaxConfig(mode="rowmax_h15", max_offset=FP8_MAX_OFFSET, p_dtype=E4M3, tile_n=64)
    out, lse = attention_reference(q, k, v, config, softmax_scale=LN2, compute_dtype=torch.float64)
    p = out[0, 0, 0, :40]
    # The max (n = 0) has weight 2^8 exactly: P relative to it, times 2^8, is the weight itself (to the fp64
    # rounding of the normalisation and this ratio), and its e4m3 byte is the oracle's; the flushed ones are 0.
    weights = p / p[0] * 2.0**FP8_MAX_OFFSET
    oracle = h15_e4m3_bytes(n)
    torch.testing.assert_close(weights, oracle.view(E4M3).double(), rtol=1e-14, atol=0.0)
    assert torch.equal(weights.float().to(E4M3).view(torch.uint8), oracle)
    assert torch.equal(weights == 0, n < H15_E4M3_MIN_N)
    # The row sum is the sum of the P that entered P@V: the normalised P add up to 1 and the LSE is its log.
    assert p.sum().item() == pytest.approx(1.0, abs=1e-15)
    kept = h15_weight_with_offset(n[n >= H15_E4M3_MIN_N])
    assert lse.item() == pytest.approx(math.log(kept.sum().item() / 2**FP8_MAX_OFFSET), abs=1e-6)
    # The flushed tail is real mass in fp32 P: without the flush the normalised P would not add up to 1.
    fp32_out, _ = attention_reference(
        q,
        k,
        v,
        SoftmaxConfig(mode="rowmax_h15", max_offset=FP8_MAX_OFFSET, p_dtype=torch.float64, tile_n=64),
        softmax_scale=LN2,
        compute_dtype=torch.float64,
    )
    assert (fp32_out[0, 0, 0, 28:40] > 0).all() and (p[29:] == 0).all()


def test_h15_e4m3_range_rule_is_validated():
    SoftmaxConfig(mode="rowmax_h15", max_offset=8, p_dtype=E4M3, rescale_threshold=0.45)
    with pytest.raises(ValueError, match=r"rescale_threshold < 0\.47"):
        SoftmaxConfig(mode="rowmax_h15", max_offset=8, p_dtype=E4M3, rescale_threshold=0.5)
    # exact keeps the saturating convert as a defined behaviour (tests/test_reference.py)
    SoftmaxConfig(mode="exact", max_offset=8, p_dtype=E4M3, rescale_threshold=8.0)


# ---- FP8 inputs, descales -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15", "rowmax_pot"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("p_dtype", [torch.float32, E4M3, None])
def test_fp8_inputs_give_the_result_of_their_fp32_dequantization(mode, causal, p_dtype):
    q8, k8, v8 = fp8_qkv(2, 70, 150, 4, 2, seed=1)
    config = SoftmaxConfig(mode=mode, tile_n=64, max_offset=FP8_MAX_OFFSET, p_dtype=p_dtype)
    out8, lse8 = attention_reference(q8, k8, v8, config, causal=causal)
    # p_dtype None means P in the input dtype: e4m3 for FP8 inputs, fp32 for fp32 inputs.
    config32 = SoftmaxConfig(mode=mode, tile_n=64, max_offset=FP8_MAX_OFFSET, p_dtype=p_dtype or E4M3)
    out32, lse32 = attention_reference(q8.float(), k8.float(), v8.float(), config32, causal=causal)
    assert out8.dtype == torch.bfloat16 and lse8.dtype == torch.float32
    assert torch.equal(out8, out32.to(torch.bfloat16))
    assert torch.equal(lse8, lse32)


def test_fp8_varlen_inputs_give_the_result_of_their_fp32_dequantization():
    generator = torch.Generator().manual_seed(2)
    q8, k8, v8 = (
        torch.randn(total, heads, 64, generator=generator).to(E4M3) for total, heads in ((50, 4), (90, 2), (90, 2))
    )
    cu_q, cu_k = torch.tensor([0, 20, 50], dtype=torch.int32), torch.tensor([0, 60, 90], dtype=torch.int32)
    descale = torch.tensor([[0.5, 2.0], [0.25, 1.0]])
    config = SoftmaxConfig(mode="rowmax_h15", tile_n=32, max_offset=FP8_MAX_OFFSET)
    kwargs = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out8, lse8 = attention_reference(q8, k8, v8, config, q_descale=descale, v_descale=descale, **kwargs)
    # per-token descales of the dequantized inputs: sequence b, kv head h (q heads 2h, 2h+1)
    seq_q = torch.repeat_interleave(torch.arange(2), torch.tensor([20, 30]))
    seq_k = torch.repeat_interleave(torch.arange(2), torch.tensor([60, 30]))
    q32 = q8.float() * descale[seq_q].repeat_interleave(2, dim=1)[..., None]
    v32 = v8.float() * descale[seq_k][..., None]
    out32, lse32 = attention_reference(q32, k8.float(), v32, dataclasses.replace(config, p_dtype=E4M3), **kwargs)
    assert torch.equal(out8, out32.to(torch.bfloat16)) and torch.equal(lse8, lse32)


def power_of_two_descales(batch, heads_k, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-3, 4, (batch, heads_k), generator=generator).float())


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_power_of_two_descales_fold_exactly(mode):
    """Powers of two scale exactly, so folding them into scale_log2 and the output equals dequantizing first."""
    q8, k8, v8 = fp8_qkv(2, 40, 100, 6, 3, seed=3)
    qd, kd, vd = (power_of_two_descales(2, 3, seed) for seed in (4, 5, 6))
    config = SoftmaxConfig(mode=mode, tile_n=32, max_offset=FP8_MAX_OFFSET)
    out8, lse8 = attention_reference(q8, k8, v8, config, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

    def dequantize(x8, d):  # (batch, seqlen, heads, dim) times its (batch, kv head) descale
        heads = x8.shape[2]
        return x8.float() * d.repeat_interleave(heads // d.shape[1], dim=1)[:, None, :, None]

    config32 = SoftmaxConfig(mode=mode, tile_n=32, max_offset=FP8_MAX_OFFSET, p_dtype=E4M3)
    out32, lse32 = attention_reference(
        dequantize(q8, qd), dequantize(k8, kd), dequantize(v8, vd), config32, causal=True
    )
    assert torch.equal(out8, out32.to(torch.bfloat16)) and torch.equal(lse8, lse32)
    # and the descales do act: without them the result differs
    plain, _ = attention_reference(q8, k8, v8, config, causal=True)
    assert not torch.equal(plain, out8)


def test_general_descales_fold_to_rounding():
    q8, k8, v8 = fp8_qkv(1, 64, 64, 2, 2, seed=7)
    generator = torch.Generator().manual_seed(8)
    qd, kd, vd = (torch.rand(1, 2, generator=generator) + 0.5 for _ in range(3))
    config = SoftmaxConfig(mode="exact", tile_n=32, max_offset=FP8_MAX_OFFSET, p_dtype=torch.float32)
    out8, lse8 = attention_reference(
        q8, k8, v8, config, q_descale=qd, k_descale=kd, v_descale=vd, compute_dtype=torch.float64
    )
    q = q8.double() * qd[:, None, :, None].double()
    k = k8.double() * kd[:, None, :, None].double()
    v = v8.double() * vd[:, None, :, None].double()
    expected = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / 8.0, dim=-1)
    expected_out = torch.einsum("bhqk,bkhd->bqhd", expected, v)
    # BF16 output: within half a bf16 ulp (2^-9 relative) of the fp64 attention.
    torch.testing.assert_close(out8.double(), expected_out, rtol=2.0**-8, atol=1e-6)
    expected_lse = torch.logsumexp(torch.einsum("bqhd,bkhd->bhqk", q, k) / 8.0, dim=-1)
    torch.testing.assert_close(lse8.double(), expected_lse, rtol=1e-6, atol=1e-6)


# ---- what an e4m3 P costs -----------------------------------------------------------------------------------

# Note [e4m3 P error bound]
# With FA4's FP8 rule (max_offset 8, threshold 0) the row's top weight is exactly 2^8, so the fp32 row sum is
# W >= 2^8. P@V takes each P_j rounded to e4m3: |P8_j - P_j| <= 2^-4 P_j when P_j is normal (>= 2^-6), and
# <= 2^-10 (half the subnormal step 2^-9) below. The output is o = sum_j P_j v_j / W (the row sum from the fp32
# P), so per component
#   |o8 - o| <= max|v| * (2^-4 sum_j P_j + 2^-10 * #{P_j < 2^-6}) / W <= max|v| * (2^-4 + L * 2^-18)
# for a row of L keys. The typical error is far smaller: one rounding's noise power is about u^2 / 5.5
# (bench/kernels.py, Note [FP8 gate tolerances]), so the Frobenius relative error is ~u / sqrt(5.5) = 2.7%;
# it cannot exceed the rms bound u / sqrt(3) (every P at the bottom of its binade, where 2^-4 relative is the
# largest), and P that was not rounded at all would give ~0.


@pytest.mark.parametrize("causal", [False, True])
def test_exact_e4m3_p_error_is_within_the_derived_bound(causal):
    q8, k8, v8 = fp8_qkv(2, 128, 256, 4, 2, seed=9)
    kwargs = dict(causal=causal, compute_dtype=torch.float64)
    # the FP8 values as fp64 inputs: the output is compared before any BF16 rounding
    q, k, v = (x.double() for x in (q8, k8, v8))
    out8 = attention_reference(q, k, v, SoftmaxConfig(tile_n=64, max_offset=FP8_MAX_OFFSET, p_dtype=E4M3), **kwargs)[0]
    out = attention_reference(
        q, k, v, SoftmaxConfig(tile_n=64, max_offset=FP8_MAX_OFFSET, p_dtype=torch.float64), **kwargs
    )[0]
    bound = v.abs().max().item() * (E4M3_UNIT_ROUNDOFF + 256 * 2.0**-18)
    assert (out8 - out).abs().max().item() <= bound
    rel = ((out8 - out).norm() / out.norm()).item()
    assert E4M3_UNIT_ROUNDOFF / math.sqrt(5.5) / 3 < rel < E4M3_UNIT_ROUNDOFF / math.sqrt(3)


def test_h15_e4m3_p_differs_from_fp32_p_only_by_the_flush():
    """Rowmax-H15's kept weights are exact in e4m3; the flushed tail moves the output by at most
    2 max|v| F / (W - F), F the flushed mass (each < 2^-6) and W >= 2^8 (Note [H15 with FP8 P])."""
    q8, k8, v8 = fp8_qkv(1, 64, 64, 2, 2, seed=10)
    q, k, v = (x.double() * 3 for x in (q8, k8, v8))  # wide scores: a real tail below 2^-14 of the max
    kwargs = dict(causal=True, compute_dtype=torch.float64)
    out8 = attention_reference(q, k, v, SoftmaxConfig(mode="rowmax_h15", max_offset=8, p_dtype=E4M3), **kwargs)[0]
    out = attention_reference(q, k, v, SoftmaxConfig(mode="rowmax_h15", max_offset=8, p_dtype=torch.float64), **kwargs)[
        0
    ]
    keys = 64
    flushed_mass = keys * E4M3_TINY
    bound = 2 * v.abs().max().item() * flushed_mass / (2.0**8 - flushed_mass)
    diff = (out8 - out).abs().max().item()
    assert 0 < diff <= bound
    # narrow scores: nothing below 2^-14 of the max, so e4m3 P gives the fp32 P's result exactly
    q, k = q / 6, k / 6
    narrow8 = attention_reference(q, k, v, SoftmaxConfig(mode="rowmax_h15", max_offset=8, p_dtype=E4M3), **kwargs)[0]
    narrow = attention_reference(
        q, k, v, SoftmaxConfig(mode="rowmax_h15", max_offset=8, p_dtype=torch.float64), **kwargs
    )[0]
    assert torch.equal(narrow8, narrow)


# ---- bad input ----------------------------------------------------------------------------------------------


def _fp8_arguments(**changes):
    q8, k8, v8 = fp8_qkv(2, 8, 8, 4, 2)
    arguments = dict(q=q8, k=k8, v=v8, config=SoftmaxConfig(max_offset=8))
    arguments.update(changes)
    return arguments


BAD_FP8_INPUTS = [
    (
        lambda: _fp8_arguments(k=torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16)),
        TypeError,
        "q, k and v must share one dtype",
    ),
    (
        lambda: _fp8_arguments(config=SoftmaxConfig(mode="baps")),
        ValueError,
        "FP8 q/k/v (torch.float8_e4m3fn) apply to modes ('exact', 'rowmax_pot', 'rowmax_h15'), not mode='baps'",
    ),
    (
        lambda: _fp8_arguments(q_descale=torch.ones(2, 4)),
        ValueError,
        "q_descale must have shape (batch, heads_k) = (2, 2)",
    ),
    (
        lambda: _fp8_arguments(v_descale=torch.ones(2, 2, dtype=torch.float64)),
        TypeError,
        "v_descale must have dtype torch.float32",
    ),
    (lambda: _fp8_arguments(k_descale=[[1.0, 1.0], [1.0, 1.0]]), TypeError, "k_descale must be None or a float32"),
    (lambda: _fp8_arguments(k_descale=torch.zeros(2, 2)), ValueError, "k_descale must hold finite positive"),
    (lambda: _fp8_arguments(q_descale=torch.ones(2, 2, device="meta")), ValueError, "q_descale must be on q's device"),
    (
        lambda: dict(
            _fp8_arguments(),
            q=torch.zeros(2, 8, 4, 64),
            k=torch.zeros(2, 8, 2, 64),
            v=torch.zeros(2, 8, 2, 64),
            q_descale=torch.ones(2, 2),
        ),
        ValueError,
        "q_descale apply to FP8 inputs only",
    ),
    (lambda: _fp8_arguments(q=torch.full((2, 8, 4, 64), math.nan).to(E4M3)), ValueError, "q holds NaN or Inf"),
]


@pytest.mark.parametrize("make_arguments, error, message", BAD_FP8_INPUTS)
def test_bad_fp8_input_names_the_argument(make_arguments, error, message):
    with pytest.raises(error) as info:
        attention_reference(**make_arguments())
    assert message in str(info.value)


# ---- two-level P V accumulation in the emulated accumulator (Note [Two-level P V accumulation]) ---------------


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_two_level_accumulation_is_per_head_and_per_row_under_gqa_causal_and_descales(mode):
    # The promotion acts on the rows each tile holds (causal tiles start at a later row): each q head of a GQA,
    # causal, descaled problem gives bit for bit what it gives alone with its kv head.
    q, k, v = fp8_qkv(1, 150, 333, 4, 2, seed=9)
    dq, dk, dv = (torch.rand(1, 2, generator=torch.Generator().manual_seed(s)) + 0.5 for s in (1, 2, 3))
    config = SoftmaxConfig(
        mode=mode, max_offset=FP8_MAX_OFFSET, tile_n=128, accumulator_mantissa_bits=13, accumulator_promotion="tile"
    )
    out, lse = attention_reference(q, k, v, config, causal=True, q_descale=dq, k_descale=dk, v_descale=dv)
    single_level = attention_reference(
        q,
        k,
        v,
        dataclasses.replace(config, accumulator_promotion="none"),
        causal=True,
        q_descale=dq,
        k_descale=dk,
        v_descale=dv,
    )[0]
    assert not torch.equal(out, single_level)
    for head in range(4):
        kv = head // 2
        alone = attention_reference(
            q[:, :, head : head + 1],
            k[:, :, kv : kv + 1],
            v[:, :, kv : kv + 1],
            config,
            causal=True,
            q_descale=dq[:, kv : kv + 1],
            k_descale=dk[:, kv : kv + 1],
            v_descale=dv[:, kv : kv + 1],
        )
        assert torch.equal(out[:, :, head : head + 1], alone[0]) and torch.equal(lse[:, head : head + 1], alone[1])


# ---- Note [Row sum by the MMA in the reference] ----------------------------------------------------------------


@pytest.mark.parametrize("accumulator", [{}, dict(accumulator_mantissa_bits=13, accumulator_promotion="tile")])
@pytest.mark.parametrize("causal", [False, True])
def test_mma_row_sum_divides_by_the_weights_that_entered_p_v(causal, accumulator):
    # With V all ones, O is (sum of the rounded P) / (row sum): exactly 1 when the row sum adds the rounded P as the
    # P V GEMM does (the ones column goes through the same rounding and, emulated, the same truncation); the FADD
    # order divides by the float weights and misses 1 by P's rounding. Few keys per row, so that rounding shows.
    q, k, _ = fp8_qkv(2, 37, 21, 4, 2, seed=3)
    ones = torch.ones(2, 21, 2, 64).to(E4M3)
    config = SoftmaxConfig(mode="exact", max_offset=FP8_MAX_OFFSET, p_dtype=E4M3, tile_n=8, **accumulator)
    outputs = {}
    for row_sum in ("fadd", "mma"):
        c = dataclasses.replace(config, row_sum=row_sum)
        outputs[row_sum] = attention_reference(q, k, ones, c, causal=causal, compute_dtype=torch.float64)[0]
    has_key = torch.arange(37)[None, :, None] >= 37 - 21 if causal else torch.ones(1, 37, 1, dtype=torch.bool)
    mma = outputs["mma"].float()[..., 0]
    assert torch.equal(mma[has_key.expand_as(mma)], torch.ones_like(mma[has_key.expand_as(mma)]))
    assert not torch.equal(outputs["fadd"], outputs["mma"])


def test_mma_row_sum_adds_the_same_p_for_h15_with_fp8_p():
    # Note [H15 with FP8 P]: H15's e4m3 P is exact, so both orders add the same weights (in fp64, exactly).
    q, k, v = fp8_qkv(1, 150, 333, 4, 2, seed=5)
    config = SoftmaxConfig(mode="rowmax_h15", max_offset=FP8_MAX_OFFSET, p_dtype=E4M3, tile_n=64)
    fadd = attention_reference(q, k, v, config, causal=True, compute_dtype=torch.float64)
    mma = attention_reference(
        q, k, v, dataclasses.replace(config, row_sum="mma"), causal=True, compute_dtype=torch.float64
    )
    assert torch.equal(fadd[0], mma[0]) and torch.equal(fadd[1], mma[1])
