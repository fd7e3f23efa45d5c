"""The softmax modes as transformers attention functions: plumbing (layout, GQA, causality, padding, KV cache)
checked against transformers' own exact attention on a small random Llama; counters; bad input."""

import math

import pytest
import torch
from helpers_hf import logits, tiny_llama

from aiter_fused import hf as fused_hf
from fa4_rowmax import hf


@pytest.fixture(scope="module", autouse=True)
def registered():
    return {**hf.register(), **fused_hf.register()}


@pytest.mark.parametrize("seqlen", [1, 77, 300])  # one token, less than a tile, several tiles with a ragged end
def test_exact_ref_matches_sdpa(seqlen):
    model = tiny_llama(seed=seqlen)
    ids = torch.randint(0, 97, (2, seqlen))
    expected = logits(model, "sdpa", ids)
    got = logits(model, "exact_ref", ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_causality_is_applied_without_a_mask():
    # A non-causal slip shows as the first positions depending on later tokens.
    model = tiny_llama(seed=1)
    ids = torch.randint(0, 97, (1, 200))
    changed = ids.clone()
    changed[0, 150:] = (changed[0, 150:] + 1) % 97
    a, b = logits(model, "rowmax_h15_t8", ids), logits(model, "rowmax_h15_t8", changed)
    torch.testing.assert_close(a[:, :150], b[:, :150], rtol=0, atol=0)
    assert not torch.equal(a[:, 150:], b[:, 150:])


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_matches_sdpa_on_real_tokens(side):
    model = tiny_llama(seed=2)
    ids = torch.randint(0, 97, (2, 160))
    mask = torch.ones(2, 160, dtype=torch.long)
    if side == "left":
        mask[1, :37] = 0
    else:
        mask[1, 123:] = 0
    expected = logits(model, "sdpa", ids, mask)
    got = logits(model, "exact_ref", ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)


def test_kv_cache_decoding_matches_sdpa():
    # Decoding steps have seqlen_q = 1 < seqlen_k: the causal mask must be bottom-right aligned.
    model = tiny_llama(seed=3)
    ids = torch.randint(0, 97, (1, 130))
    outputs = {}
    for attention in ("sdpa", "exact_ref"):
        model.set_attn_implementation(attention)
        with torch.inference_mode():
            outputs[attention] = model.generate(
                ids,
                max_new_tokens=5,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
    torch.testing.assert_close(
        torch.stack(outputs["exact_ref"].logits), torch.stack(outputs["sdpa"].logits), rtol=1e-4, atol=1e-4
    )


def test_approximate_modes_reach_the_model():
    # Each mode changes the model's logits (the attention function is really called) and keeps them finite;
    # how far each mode may move an attention output is checked per call below and in the reference tests.
    model = tiny_llama(seed=4)
    ids = torch.randint(0, 97, (1, 256))
    exact = logits(model, "sdpa", ids)
    for mode in ("rowmax_pot", "rowmax_h15_t0", "baps_l1", "fused_mxfp8", "fused_hybrid"):
        got = logits(model, mode, ids)
        assert not torch.equal(got, exact) and torch.isfinite(got).all(), mode


# Note [Envelope of a lattice mode]: the weight of each element over its exact weight lies in [2^-down, 2^up]
# (H15: up = log2(1.5) - 1/4, down = 1/4; PoT: 1/2 and 1/2, plus the K_max clamp), so each normalised weight
# is within a factor 2^e, e = up + down, of the exact softmax's pi_j; sum_j |p_j/L - pi_j| <= 2^e - 1, and
# since the weight differences sum to 0, |O_mode - O_exact| <= (2^e - 1) (max v - min v) / 2 per column. PoT's
# clamp adds at most n 2^-K_max of mass moved.
ENVELOPE = {"rowmax_h15_t0": math.log2(1.5), "rowmax_h15_t8": math.log2(1.5), "rowmax_pot": 1.0}


@pytest.mark.parametrize("mode", sorted(ENVELOPE))
def test_lattice_modes_move_an_attention_output_within_their_envelope(mode):
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 6, 300, 64) * 3, torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    module = tiny_llama(seed=5, num_layers=1).model.layers[0].self_attn
    got, _ = hf.make_attention_function(mode)(module, q, k, v, None, scaling=0.125)
    exact, _ = hf.make_attention_function("exact_ref")(module, q, k, v, None, scaling=0.125)
    v_range = (v.amax(dim=2) - v.amin(dim=2)).repeat_interleave(3, dim=1)[:, None]  # (1, 1, Hq, D)
    bound = (2 ** ENVELOPE[mode] - 1) * v_range / 2 + 300 * 2.0**-20 * v.abs().max() + 1e-5
    assert ((got - exact).abs() <= bound).all(), float(((got - exact).abs() - bound).max())
    assert not torch.equal(got, exact)


def test_fold_modes_run_the_half_octave_anchor():
    # The fold modes are Rowmax-H15 with the SM90 half-octave anchor: the same model output as the reference
    # called with that config, and different from the exact-anchor mode (the lattice moves by up to 1/4 octave).
    from fa4_rowmax.config import SoftmaxConfig
    from fa4_rowmax.reference.attention import attention_reference

    for threshold in (0, 8):
        config = hf.MODES[f"rowmax_h15_fold_t{threshold}"].config(0, 2)
        assert config == SoftmaxConfig(
            mode="rowmax_h15", rescale_threshold=float(threshold), anchor="tile", anchor_rounding="half_octave"
        )
    torch.manual_seed(11)
    q, k, v = torch.randn(1, 300, 6, 64) * 3, torch.randn(1, 300, 2, 64), torch.randn(1, 300, 2, 64)
    function = hf.make_attention_function("rowmax_h15_fold_t8")
    module = tiny_llama(seed=11, num_layers=1).model.layers[0].self_attn
    got, _ = function(module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, scaling=0.125)
    expected, _ = attention_reference(
        q, k, v, hf.MODES["rowmax_h15_fold_t8"].config(0, 1), causal=True, softmax_scale=0.125
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    model = tiny_llama(seed=12)
    ids = torch.randint(0, 97, (1, 300))
    exact, folded, unfolded = (logits(model, m, ids) for m in ("sdpa", "rowmax_h15_fold_t0", "rowmax_h15_t0"))
    assert not torch.equal(folded, unfolded) and torch.isfinite(folded).all()


def test_counters_are_tallied_per_model_and_layer():
    model = tiny_llama(seed=5, num_layers=3)
    state = hf.attach(model)
    ids = torch.randint(0, 97, (1, 300))
    logits(model, "rowmax_h15_t8", ids)
    snapshot = state.tally.snapshot()
    assert snapshot["calls"] == 3
    assert sorted(snapshot["per_layer"]) == [0, 1, 2]
    assert snapshot["totals"]["tiles"] > 0
    assert sum(layer["tiles"] for layer in snapshot["per_layer"].values()) == snapshot["totals"]["tiles"]
    state.tally.reset()
    assert state.tally.snapshot()["calls"] == 0
    other = tiny_llama(seed=6, num_layers=1)
    logits(other, "rowmax_h15_t8", ids)  # a model without attach() tallies nothing and does not touch ours
    assert state.tally.snapshot()["calls"] == 0


def test_reference_input_dtype_rounds_inputs():
    model = tiny_llama(seed=7)
    ids = torch.randint(0, 97, (1, 64))
    state = hf.attach(model)
    fp32 = logits(model, "exact_ref", ids)
    state.reference_input_dtype = torch.bfloat16
    bf16 = logits(model, "exact_ref", ids)
    assert not torch.equal(fp32, bf16)
    torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.05)


def test_hybrid_schedule():
    formats = [fused_hf.hybrid_mx_format(i, 30) for i in range(30)]
    assert formats[:3] == formats[-3:] == ["mxfp6"] * 3
    assert formats[3:27] == ["mxfp4"] * 24
    with pytest.raises(ValueError, match="step must be in"):
        fused_hf.hybrid_mx_format(30, 30)


def test_every_mode_builds_a_valid_config():
    for name, spec in {**hf.MODES, **fused_hf.MODES}.items():
        for layer in (0, 15, 29):
            config = spec.config(layer, 30)
            assert config.mode in ("exact", "rowmax_pot", "rowmax_h15", "baps", "fused_softmax"), name


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="mode must be one of"):
        hf.make_attention_function("rowmax_h16")
    with pytest.raises(ValueError, match="backend must be one of"):
        hf.make_attention_function("rowmax_pot", backend="gpu")
    with pytest.raises(ValueError, match="has no GPU kernel"):
        hf.make_attention_function("baps_l1", backend="kernel")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            hf.make_attention_function("rowmax_h15_t8", backend="kernel")
    with pytest.raises(ValueError, match="reference_input_dtype"):
        hf.attach(tiny_llama(seed=8, num_layers=1), reference_input_dtype=torch.int8)
    with pytest.raises(ValueError, match="no attention modules"):
        hf.attach(torch.nn.Linear(2, 2))
    # A mask that is neither causal nor padding (here: a sliding window) must not be silently replaced.
    function = hf.make_attention_function("exact_ref")
    module = tiny_llama(seed=9, num_layers=1).model.layers[0].self_attn
    q = torch.randn(1, 6, 8, 64)
    kv = torch.randn(1, 2, 8, 64)
    window = torch.tril(torch.ones(8, 8, dtype=torch.bool)) & torch.triu(torch.ones(8, 8, dtype=torch.bool), -2)
    with pytest.raises(ValueError, match="attention_mask must be causal"):
        function(module, q, kv, kv, window[None, None])
    with pytest.raises(ValueError, match="dropout"):
        function(module, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="softcap must be None"):
        function(module, q, kv, kv, None, softcap=30.0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mode",
    [
        "exact_bf16p",
        "rowmax_h15_t8",
        "fused_mxfp8",
        pytest.param("rowmax_h15_fold_t8", marks=pytest.mark.gpu(arch="sm90")),  # the fold is an SM90 lever
    ],
)
def test_kernel_matches_reference_in_a_model(mode):
    (fused_hf if mode in fused_hf.MODES else hf).register([mode], backend="kernel")
    model = tiny_llama(seed=10).cuda()
    state = hf.attach(model, reference_input_dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (2, 300), device="cuda")
    simulated = logits(model, mode, ids)
    kernel = logits(model, hf.attention_name(mode, "kernel"), ids)
    assert state.tally.snapshot()["calls"] > 0
    torch.testing.assert_close(kernel, simulated, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("arch", [90, 100])
def test_fa4_kernel_modes_run_what_their_reference_computes(arch):
    """Each FA4 mode's kernel arguments, resolved as the kernel resolves them, derive the mode's reference config
    (p_dtype aside: the reference's P rounding is a reference-only field)."""
    from fa4_rowmax.interface import SoftmaxStage, softmax_stage

    fa4_modes = {n: s for n, s in hf.MODES.items() if s.kernel == "fa4"}
    assert {"exact_bf16p", "rowmax_pot", "rowmax_h15_t0", "rowmax_h15_t8"} <= set(fa4_modes)
    for name, spec in fa4_modes.items():
        if "anchor_rounding" in spec.kernel_kwargs and arch != 90:
            continue  # the fold is an SM90 lever
        kwargs = dict(spec.kernel_kwargs)
        stage = (
            softmax_stage(
                kwargs.pop("softmax_mode", "exact"),
                kwargs.pop("rescale_threshold", None),
                anchor_rounding=kwargs.pop("anchor_rounding", "exact"),
            )
            or SoftmaxStage()
        )
        assert not kwargs, (name, kwargs)
        derived = stage.for_kernel(arch=arch, q_dtype=torch.bfloat16).reference_config(tile_n=128)
        config = spec.config(0, 1)
        for field in ("mode", "rescale_threshold", "anchor_rounding", "max_offset"):
            if field == "rescale_threshold" and "rescale_threshold" not in spec.kernel_kwargs:
                continue  # stock exact: the architecture's own threshold
            assert getattr(derived, field) == getattr(config, field), (name, field)
