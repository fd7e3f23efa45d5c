"""The FP8 modes of the quality study (fa4_rowmax/hf.py, Note [FP8 modes in the study]): e4m3 inputs and P through
the reference, the SM90 FP8 kernel as their kernel."""

from dataclasses import replace

import pytest
import torch
from helpers_hf import logits, tiny_llama

from fa4_rowmax import hf
from fa4_rowmax.config import FP8_MAX_OFFSET, SoftmaxConfig
from fa4_rowmax.reference.attention import attention_reference

E4M3 = torch.float8_e4m3fn
FP8_MODES = (
    "exact_fp8",
    "rowmax_h15_fp8",
    "exact_fp8_ksmooth",
    "rowmax_h15_fp8_ksmooth",
    "exact_fp8_ksmooth_single_acc",
    "rowmax_h15_fp8_ksmooth_single_acc",
)


@pytest.fixture(scope="module", autouse=True)
def registered():
    return hf.register(["exact_ref", "exact_fp8_inputs", *FP8_MODES])


def test_ksmooth_modes_are_their_twins_plus_the_smoothing():
    for name in ("exact_fp8", "rowmax_h15_fp8"):
        plain, smoothed = hf.MODES[name], hf.MODES[name + "_ksmooth"]
        assert smoothed.config(0, 1) == plain.config(0, 1) and smoothed.kernel_kwargs == plain.kernel_kwargs
        assert smoothed.fp8_k_smoothing and not plain.fp8_k_smoothing and smoothed.kernel == plain.kernel


def test_single_level_twins_differ_from_their_modes_in_the_kernels_accumulation_only():
    # Note [P.V accumulation in the study]: same reference config and inputs, the kernel's pv_accumulation apart;
    # every FP8 mode names it, so a change of the kernel's default changes no mode of the study.
    from fa4_rowmax.fp8_sm90 import call_stage

    for name in ("exact_fp8_ksmooth", "rowmax_h15_fp8_ksmooth"):
        two_level, single = hf.MODES[name], hf.MODES[name + "_single_acc"]
        assert single.config_fields == two_level.config_fields and single.fp8_k_smoothing and single.fp8_inputs
        assert {**single.kernel_kwargs, "pv_accumulation": "two_level"} == two_level.kernel_kwargs
        for head_dim in (64, 128):
            for causal in (False, True):
                # the stage flash_attn_fp8_sm90(**kernel_kwargs) compiles for this call (the factory passes them)
                assert call_stage(head_dim=head_dim, causal=causal, **two_level.kernel_kwargs).pv_accumulation == (
                    "two_level"
                )
                assert call_stage(head_dim=head_dim, causal=causal, **single.kernel_kwargs).pv_accumulation == "single"
    for name in FP8_MODES:
        assert hf.MODES[name].kernel_kwargs["pv_accumulation"] == (
            "single" if name.endswith("_single_acc") else "two_level"
        )


def test_fp8_simulator_runs_at_the_kernels_tile():
    # Note [P.V accumulation in the study]: the tuned two-level kernel's tile (Note [Tuned defaults]) for the call's
    # head dim, mask and GQA ratio, the single-level one's the stage default of 128; causal GQA that packs a 192-row
    # tile takes the three-warpgroup entry (Note [Causal tiles that pack GQA]): Qwen2.5-1.5B's 6 Q heads per KV
    # head, not Qwen2.5-0.5B's 7. The simulator's config follows; modes without the FP8 kernel keep their own tile.
    from fa4_rowmax.config import STAGE_KNOBS
    from fa4_rowmax.fp8_sm90 import TUNED_DEFAULTS, TUNED_TILE_M

    def tuned_tile_n(key, tile_m=None):
        return TUNED_DEFAULTS[key][tile_m or TUNED_TILE_M[key]].get("tile_n", default)

    default = STAGE_KNOBS["tile_n"].default
    h15, h15_single = hf.MODES["rowmax_h15_fp8_ksmooth"], hf.MODES["rowmax_h15_fp8_ksmooth_single_acc"]
    h15_d64 = tuned_tile_n(("rowmax_h15", 64, True))
    assert hf.simulator_config(h15, 0, 2, 64, True).tile_n == h15_d64 != default
    assert hf.simulator_config(h15_single, 0, 2, 64, True).tile_n == default != h15_d64
    exact = hf.MODES["exact_fp8_ksmooth"]
    exact_d128 = tuned_tile_n(("exact", 128, True))
    assert hf.simulator_config(exact, 0, 2, 128, True).tile_n == exact_d128 != default
    assert hf.simulator_config(exact, 0, 2, 128, True, 7).tile_n == exact_d128
    packed = tuned_tile_n(("exact", 128, True), 192)
    assert hf.simulator_config(exact, 0, 2, 128, True, 6).tile_n == packed != exact_d128
    assert hf.simulator_config(exact, 0, 2, 128, False, 6).tile_n == tuned_tile_n(("exact", 128, False))
    bf16p = hf.MODES["exact_bf16p"]
    assert hf.simulator_config(bf16p, 0, 2, 64, True) == bf16p.config(0, 2)


def test_simulator_sums_the_row_as_its_kernel():
    """Note [P.V accumulation in the study]: the simulator's row sum follows the kernel's row_sum knob, the MMA
    order for every tuned two-level entry, the stage default (FADD) for single-level."""
    from fa4_rowmax.fp8_sm90 import TUNED_DEFAULTS, TUNED_TILE_M

    for name, head_dim in (("exact_fp8_ksmooth", 128), ("rowmax_h15_fp8_ksmooth", 64)):
        spec = hf.MODES[name]
        key = (spec.kernel_kwargs["softmax_mode"], head_dim, True)
        tuned = TUNED_DEFAULTS[key][TUNED_TILE_M[key]].get("row_sum", "fadd")
        assert hf.simulator_config(spec, 0, 2, head_dim, True).row_sum == tuned == "mma"
    single = hf.MODES["exact_fp8_ksmooth_single_acc"]
    assert hf.simulator_config(single, 0, 2, 128, True).row_sum == "fadd"


def test_k_smoothing_is_exact_and_removes_a_constant_k_offset():
    # Note [K smoothing for FP8]: in fp64, attention on k - mean(k) equals attention on k (causal, GQA). With
    # a token-constant offset on a few channels (Qwen2.5-1.5B's layer 0: docs/quality_notes.md section 5), e4m3
    # rounds the offset per key; smoothing first must leave the error of the same inputs without the offset.
    # That error is a norm over ~40K independent e4m3 roundings (relative spread well under 1 %); the smoothed k
    # differs from the offset-free one by its sample mean (~0.08 per channel), which reshuffles roundings, not
    # their size: 25 % is a cap, not a fit. The plain mode must be well above it (a no-op smoothing fails).
    torch.manual_seed(9)
    seqlen, config = 160, SoftmaxConfig(p_dtype=torch.float64)
    q, k, v = torch.randn(1, seqlen, 4, 64), torch.randn(1, seqlen, 2, 64), torch.randn(1, seqlen, 2, 64)
    q[..., :2] += 3.0
    offset_free_k = k.clone()
    k[..., :2] += 300.0  # the near-constant channels, inside e4m3's range (step 32 above 256)
    fp64 = dict(causal=True, softmax_scale=0.125, compute_dtype=torch.float64)
    exact, _ = attention_reference(q.double(), k.double(), v.double(), config, **fp64)
    again, _ = attention_reference(q.double(), hf.smooth_k(k.double()), v.double(), config, **fp64)
    torch.testing.assert_close(again, exact, rtol=1e-10, atol=1e-12)
    assert torch.allclose(hf.smooth_k(k).mean(dim=1), torch.zeros(1, 2, 64), atol=1e-3)
    module = tiny_llama(seed=9, num_layers=1).model.layers[0].self_attn
    error = {}
    for name, keys, mode in (
        ("plain", k, "exact_fp8"),
        ("smoothed", k, "exact_fp8_ksmooth"),
        ("offset_free", offset_free_k, "exact_fp8"),
    ):
        target, _ = attention_reference(q.double(), keys.double(), v.double(), config, **fp64)
        as_hf = [t.transpose(1, 2) for t in (q, keys, v)]  # transformers' (batch, heads, seqlen, head_dim)
        got, _ = hf.make_attention_function(mode)(module, *as_hf, None, scaling=0.125)
        error[name] = ((got.double() - target).norm() / target.norm()).item()
    assert error["smoothed"] < 1.25 * error["offset_free"] < error["plain"] / 4, error


def test_fp8_modes_are_the_kernels_semantics():
    from fa4_rowmax.fp8_sm90 import resolve_stage
    from fa4_rowmax.stage.softmax_sm90_fp8 import FP8_MAX_OFFSET as KERNEL_MAX_OFFSET

    assert hf.MODES["exact_fp8"].config(0, 1) == SoftmaxConfig(mode="exact", anchor="tile", max_offset=8, p_dtype=E4M3)
    assert hf.MODES["rowmax_h15_fp8"].config(0, 1) == SoftmaxConfig(
        mode="rowmax_h15", anchor="tile", max_offset=8, p_dtype=E4M3, rescale_threshold=0.0
    )
    assert KERNEL_MAX_OFFSET == FP8_MAX_OFFSET
    for name in FP8_MODES:
        spec = hf.MODES[name]
        assert spec.kernel == "fp8_sm90" and spec.fp8_inputs and spec.kernel_factory is not None
        kwargs = dict(spec.kernel_kwargs)
        accumulation = kwargs.pop("pv_accumulation")
        stage = resolve_stage(
            kwargs.pop("softmax_mode"), kwargs.pop("rescale_threshold", None), None, False, pv_accumulation=accumulation
        )
        assert not kwargs and stage.pv_accumulation == accumulation
        config = spec.config(0, 1)
        assert (stage.mode, stage.rescale_threshold, stage.anchor_rounding) == (
            config.mode,
            config.rescale_threshold,
            config.anchor_rounding,
        )


def test_to_e4m3_saturates_and_counts():
    x = torch.tensor([1.0, -500.0, 448.0, 449.0, 0.1, -0.01, 0.0])
    x8, counts = hf.to_e4m3(x)
    assert x8.dtype == E4M3 and counts == {"fp8_saturated": 2, "fp8_below_normal": 1}
    assert x8.float().tolist() == [1.0, -448.0, 448.0, 448.0, 0.1015625, -0.009765625, 0.0]


@pytest.mark.parametrize("mode", FP8_MODES)
def test_fp8_mode_runs_the_reference_on_e4m3_inputs(mode):
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 6, 200, 64) * 2, torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64)
    module = tiny_llama(seed=3, num_layers=1).model.layers[0].self_attn
    state = hf.attach(module)
    got, _ = hf.make_attention_function(mode)(module, q, k, v, None, scaling=0.125)
    q8, k8, v8 = (t.transpose(1, 2) for t in (q, k, v))
    if hf.MODES[mode].fp8_k_smoothing:
        k8 = hf.smooth_k(k8)
    q8, k8, v8 = (t.to(E4M3) for t in (q8, k8, v8))
    config = hf.simulator_config(hf.MODES[mode], 0, 1, 64, True, 3)  # 6 Q heads on 2 KV heads
    expected, _ = attention_reference(q8, k8, v8, config, causal=True, softmax_scale=0.125)
    assert torch.equal(got, expected.float())  # both (batch, seqlen, heads, head_dim)
    if config.tile_n != 128:  # 200 keys: a tile of 128 splits the rows' keys elsewhere, and H15's lattice moves
        at_128, _ = attention_reference(q8, k8, v8, replace(config, tile_n=128), causal=True, softmax_scale=0.125)
        assert not torch.equal(got, at_128.float())
    exact, _ = hf.make_attention_function("exact_ref")(module, q, k, v, None, scaling=0.125)
    assert not torch.equal(got, exact)
    assert state.tally.totals["fp8_saturated"] == 0
    cast = (q, hf.smooth_k(k.transpose(1, 2)) if hf.MODES[mode].fp8_k_smoothing else k, v)
    assert state.tally.totals["fp8_below_normal"] == sum(int((t.abs() < 2.0**-6).sum()) for t in cast) > 0
    got, _ = hf.make_attention_function(mode)(module, q * 300, k, v, None, scaling=0.125)
    assert state.tally.totals["fp8_saturated"] == int(((q * 300).abs() > 448).sum()) > 0


def test_fp8_inputs_control_rounds_only_the_operands():
    torch.manual_seed(6)
    q, k, v = torch.randn(1, 6, 150, 64), torch.randn(1, 2, 150, 64), torch.randn(1, 2, 150, 64)
    module = tiny_llama(seed=6, num_layers=1).model.layers[0].self_attn
    got, _ = hf.make_attention_function("exact_fp8_inputs")(module, q, k, v, None, scaling=0.125)
    q8, k8, v8 = (t.transpose(1, 2).to(E4M3) for t in (q, k, v))
    expected, _ = attention_reference(
        q8, k8, v8, SoftmaxConfig(p_dtype=torch.float32), causal=True, softmax_scale=0.125
    )
    assert torch.equal(got, expected.float())
    with_e4m3_p, _ = attention_reference(q8, k8, v8, SoftmaxConfig(max_offset=8), causal=True, softmax_scale=0.125)
    assert not torch.equal(got, with_e4m3_p.float())


def test_fp8_modes_reach_the_model():
    model = tiny_llama(seed=4)
    ids = torch.randint(0, 97, (1, 200))
    exact = logits(model, "exact_ref", ids)
    for mode in FP8_MODES + ("exact_fp8_inputs",):
        got = logits(model, mode, ids)
        assert not torch.equal(got, exact) and torch.isfinite(got).all(), mode


@pytest.mark.gpu(arch="sm90")  # the FP8 kernel is an SM90 kernel
@pytest.mark.parametrize("mode", FP8_MODES)
def test_fp8_kernel_matches_its_simulator_in_a_model(mode):
    # Same e4m3 bytes on both sides (the simulator gets the BF16-rounded inputs the kernel casts); what remains is
    # summation order and Hopper's FP8 accumulator, rare lattice or rounding flips, BF16 output rounding: the
    # bound of the BF16 kernels' model test (test_hf_attention.py).
    hf.register([mode], backend="kernel")
    model = tiny_llama(seed=10).cuda()
    state = hf.attach(model, reference_input_dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (2, 300), device="cuda")
    simulated = logits(model, mode, ids)
    kernel = logits(model, hf.attention_name(mode, "kernel"), ids)
    assert state.tally.snapshot()["calls"] > 0
    torch.testing.assert_close(kernel, simulated, rtol=0.02, atol=0.02)
