"""The paged attention function for transformers' continuous batching (fa4_rowmax/hf_paged.py) on the CPU: the real
`generate_batch` on a tiny random Qwen2 through the reference backend against transformers' own `paged|sdpa`, each
call's output per sequence against the fp64 reference, the mode split between prefill and decode steps, bad
input, and the engine benchmark's CPU smoke mode."""

import json
import math

import pytest
import torch
import transformers
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from bench import engine_e2e
from fa4_rowmax import hf_paged
from fa4_rowmax.config import SoftmaxConfig
from fa4_rowmax.gates.tolerances import kernel_bounds
from fa4_rowmax.reference.attention import attention_reference

VOCAB = 101
# One token, a few, and lengths off every tile (128) and block (32) grid, some past one tile; with MAX_BATCH_TOKENS
# below the total the prompts are prefilled in chunks (a cached prefix plus new tokens) beside decoding ones.
PROMPT_LENGTHS = (1, 5, 77, 150, 203)
MAX_BATCH_TOKENS = 96
NEW_TOKENS = 6


def tiny_qwen2(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """A random Qwen2 with GQA (4 query heads over 2 KV heads), head dim 64 (an FA4 head dim), two layers."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
    )
    return transformers.Qwen2ForCausalLM(config).eval().to(dtype)


def prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def generate(model, attention: str, inputs) -> dict:
    model.set_attn_implementation(attention)
    config = ContinuousBatchingConfig(
        block_size=32,
        num_blocks=64,
        max_batch_tokens=MAX_BATCH_TOKENS,
        use_cuda_graph=False,
        max_blocks_per_request=0,
        return_logprobs=True,
    )
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return model.generate_batch(inputs, generation_config=generation, continuous_batching_config=config)


def record_calls(attention: hf_paged.PagedAttention) -> list[dict]:
    """Wrap `attention.attend` (the real call still runs) to keep every call's arguments and output."""
    calls, attend = [], attention.attend

    def recording(q, k, v, cu_q, cu_k, max_q, max_k, scale, knobs):
        out = attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, knobs)
        calls.append(dict(q=q, k=k, v=v, cu_q=cu_q.clone(), cu_k=cu_k.clone(), scale=scale, knobs=knobs, out=out))
        return out

    attention.attend = recording
    return calls


def fp32_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 23) if x else 2.0**-149


def test_generate_batch_exact_matches_paged_sdpa():
    # In fp64 both paths compute the same exact attention to ~1e-15; transformers hands the log-probabilities back
    # in fp32, so two fp64 values that close round to the same or adjacent fp32 numbers: one fp32 ulp apart at
    # most. A wrong key, mask or cache slot moves them by orders of magnitude more (a 1 % change to k: ~2e-4).
    model, inputs = tiny_qwen2(0, torch.float64), prompts(0)
    attention = hf_paged.register("exact", backend="reference")
    calls = record_calls(attention)
    expected = generate(model, "paged|sdpa", inputs)
    got = generate(model, attention.name, inputs)
    assert sorted(got) == sorted(expected) and len(got) == len(inputs)
    for request, reference in expected.items():
        assert got[request].prompt_ids == reference.prompt_ids
        assert got[request].generated_tokens == reference.generated_tokens
        assert len(got[request].generated_tokens) == NEW_TOKENS
        for a, b in zip(got[request].logprobs, reference.logprobs, strict=True):
            assert abs(a - b) <= fp32_ulp(b), (a, b)
    # The run covered what it is meant to: chunked prefill (a cached prefix plus several new tokens) and
    # decode steps, both counted.
    lengths = [(int(q), int(k)) for c in calls for q, k in zip(c["cu_q"].diff(), c["cu_k"].diff())]
    assert any(1 < q < k for q, k in lengths) and any(q == 1 for q, _ in lengths)
    assert attention.steps.prefill > 0 and attention.steps.decode > 0


def _per_sequence(call: dict):
    for b in range(call["cu_q"].numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (call["cu_q"][b], call["cu_q"][b + 1], call["cu_k"][b], call["cu_k"][b + 1]))
        yield (
            (call[name][None, start:end] for name, start, end in (("q", q0, q1), ("k", k0, k1), ("v", k0, k1))),
            (call["out"][None, q0:q1]),
        )


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_each_call_matches_the_fp64_reference_per_sequence(mode):
    # Every attention call of a real run (fp32 model): each sequence's output rows against the fp64 reference of that
    # sequence alone (dense, bottom-right causal, GQA), within the per-row bounds of an fp32 computation of the mode
    # (gates/tolerances.py: score rounding, P's rounding, lattice flips). Checks the packing, causality per sequence
    # and GQA; the K/V are those the cache gave back.
    model = tiny_qwen2(1, torch.float32)
    attention = hf_paged.register(mode, rescale_threshold=0.0, backend="reference")
    calls = record_calls(attention)
    generate(model, attention.name, prompts(1))
    prefill_calls = [c for c in calls if int(c["cu_q"].diff().max()) > 1]
    assert prefill_calls and all(c["knobs"]["softmax_mode"] == mode for c in prefill_calls)
    for call in calls:
        config = SoftmaxConfig(mode=call["knobs"]["softmax_mode"])
        for (q, k, v), out in _per_sequence(call):
            ref = attention_reference(
                q.double(),
                k.double(),
                v.double(),
                config,
                causal=True,
                softmax_scale=call["scale"],
                compute_dtype=torch.float64,
            )[0]
            bound = kernel_bounds(q, k, v, config, causal=True, softmax_scale=call["scale"]).out
            excess = (out - ref).abs().amax(-1, keepdim=True) - bound.double()
            assert (excess <= 0).all(), float(excess.max())


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_fp8_prefill_casts_smoothed_operands_and_matches_the_fp64_reference(mode):
    # Note [FP8 prefill steps]: prefill calls get e4m3 q, K (smoothed over the step's packed keys) and V; decode calls
    # the model's own dtype. Each prefill sequence against the fp64 reference of the same e4m3 inputs with P in e4m3
    # and FA4's FP8 offset, within that config's per-row bounds; and the smoothing leaves the softmax unchanged: the
    # run's log-probabilities stay within FP8's error of the BF16-prefill run's, not a shifted distribution.
    from fa4_rowmax.config import FP8_MAX_OFFSET

    model, inputs = tiny_qwen2(4, torch.float32), prompts(4)
    attention = hf_paged.register(mode, rescale_threshold=0.0, backend="reference", fp8_prefill=True)
    assert attention.name == f"paged|fa4_{mode}_t0_fp8_reference"
    calls = record_calls(attention)
    got = generate(model, attention.name, inputs)
    prefill = [c for c in calls if int(c["cu_q"].diff().max()) > 1]
    decode = [c for c in calls if int(c["cu_q"].diff().max()) == 1]
    assert prefill and decode
    assert all(c[x].dtype == torch.float8_e4m3fn for c in prefill for x in "qkv")
    assert all(c[x].dtype == torch.float32 for c in decode for x in "qkv")
    config = SoftmaxConfig(mode=mode, max_offset=FP8_MAX_OFFSET, p_dtype=torch.float8_e4m3fn)
    for call in prefill:
        # smoothed K: its mean over the packed keys is within e4m3's rounding of 0, per head
        k = call["k"][: int(call["cu_k"][-1])].float()
        assert (k.mean(0).abs() <= 2.0**-4 * k.abs().amax(0) + 1e-6).all()
        assert call["out"].dtype == torch.bfloat16
        for (q, k, v), out in _per_sequence(call):
            ref = attention_reference(
                q, k, v, config, causal=True, softmax_scale=call["scale"], compute_dtype=torch.float64
            )[0]
            bound = kernel_bounds(q, k, v, config, causal=True, softmax_scale=call["scale"]).out
            # BF16 output: half a BF16 ulp of each value on top of the fp32-computation bound
            rounding = out.double().abs().amax(-1, keepdim=True) * 2.0**-8
            excess = (out.double() - ref).abs().amax(-1, keepdim=True) - bound.double() - rounding
            assert (excess <= 0).all(), float(excess.max())
    for p in got:
        assert all(math.isfinite(x) for x in got[p].logprobs)


def test_one_k_mean_over_a_packed_step_leaves_every_sequences_softmax_unchanged():
    # Note [FP8 prefill steps]: K minus the mean of all packed keys of a head (across sequences) shifts each row's
    # scores by one constant, so exact fp64 attention per sequence is unchanged (to fp64 rounding of scores ~ 40);
    # checked on K with a large mean, three packed sequences, GQA, before the e4m3 cast (which `fp8_operands` applies
    # after the same smoothing: its K has mean ~0).
    from fa4_rowmax.hf import smooth_k

    gen = torch.Generator().manual_seed(5)
    lengths = (7, 33, 20)
    cu = torch.tensor([0, 7, 40, 60], dtype=torch.int32)
    q = torch.randn(60, 4, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(60, 2, 64, generator=gen, dtype=torch.float64) + 5.0 * torch.randn(2, 64, generator=gen).double()
    v = torch.randn(60, 2, 64, generator=gen, dtype=torch.float64)
    config = SoftmaxConfig(mode="exact", p_dtype=torch.float64)
    args = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, compute_dtype=torch.float64)
    plain = attention_reference(q, k, v, config, **args)[0]
    smoothed = attention_reference(q, smooth_k(k[None])[0], v, config, **args)[0]
    assert sum(lengths) == 60 and (plain - smoothed).abs().max() < 1e-12
    _, k8, _ = hf_paged.fp8_operands(q.float(), k.float(), v.float())
    assert k8.dtype == torch.float8_e4m3fn and k8.float().mean(0).abs().max() < 0.05


def test_prefill_runs_the_mode_and_decode_runs_stock():
    # Note [Prefill and decode steps]: steps with several queries in some sequence get the mode's knobs, steps of
    # one query per sequence stock FA4 by name; the mode reaches the model (its log-probabilities move).
    model, inputs = tiny_qwen2(2, torch.float32), prompts(2)
    h15 = hf_paged.register("rowmax_h15", rescale_threshold=0.0, backend="reference")
    calls = record_calls(h15)
    got = generate(model, h15.name, inputs)
    exact = generate(model, hf_paged.register("exact", backend="reference").name, inputs)
    for call in calls:
        several = int(call["cu_q"].diff().max()) > 1
        assert call["knobs"] == (
            {"softmax_mode": "rowmax_h15", "rescale_threshold": 0.0} if several else {"softmax_mode": "exact"}
        )
    assert any(got[p].logprobs != exact[p].logprobs for p in exact)
    for p in got:
        assert all(math.isfinite(x) for x in got[p].logprobs)


def test_names_and_bad_input():
    assert hf_paged.attention_name("rowmax_h15", 8.0) == "paged|fa4_rowmax_h15_t8"
    assert hf_paged.attention_name("exact", None, "reference") == "paged|fa4_exact_reference"
    assert hf_paged.attention_name("rowmax_h15", None, "kernel", True) == "paged|fa4_rowmax_h15_fp8"
    with pytest.raises(ValueError, match="fp8_prefill must be True or False"):
        hf_paged.make_paged_attention("exact", backend="reference", fp8_prefill="yes")
    with pytest.raises(ValueError, match="mode must be one of"):
        hf_paged.make_paged_attention("baps", backend="reference")
    with pytest.raises(ValueError, match="backend must be one of"):
        hf_paged.make_paged_attention("exact", backend="sdpa")
    with pytest.raises(ValueError, match="rescale_threshold"):
        hf_paged.make_paged_attention("rowmax_h15", rescale_threshold=-1.0, backend="reference")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            hf_paged.make_paged_attention("rowmax_h15")
    attention = hf_paged.register("exact", backend="reference")
    assert AttentionInterface()[attention.name] is attention
    module = tiny_qwen2(3, torch.float32).model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 64)
    kv = torch.zeros(1, 2, 3, 64)
    with pytest.raises(ValueError, match="without a PagedAttentionCache"):
        attention(module, q, kv, kv, None)
    with pytest.raises(ValueError, match="block_table must be None"):
        attention(module, q, kv, kv, None, cache=object(), block_table=torch.zeros(1, 1, 1, dtype=torch.int32))


def test_engine_benchmark_cpu_smoke(tmp_path):
    # The benchmark's --tiny mode end to end on the CPU (random model, reference backend): its JSON names every row
    # (the FP8 rows run through the reference on the CPU), exact agrees with itself token for token, and every number
    # it reports is finite.
    assert engine_e2e.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "engine_e2e.json").read_text())
    modes = result["modes"]
    assert set(modes) == {"exact", "rowmax_h15", "exact_fp8", "rowmax_h15_fp8"} and result["settings"]["fp8"] == "run"
    assert modes["rowmax_h15_fp8"]["attention"] == "paged|fa4_rowmax_h15_fp8_reference"
    assert modes["exact"]["token_agreement"] == 1.0
    assert all(p is None for p in modes["exact"]["first_divergence"])
    for mode in modes.values():
        assert mode["tokens_per_second"] > 0 and math.isfinite(mode["perplexity_under_exact"])
        assert mode["generated_tokens"] == result["settings"]["max_new_tokens"] * len(
            result["settings"]["prompt_lengths"]
        )
    assert (tmp_path / "engine_e2e.md").read_text().count("|") > 10


def test_engine_benchmark_refuses_missing_assets_and_cuda(tmp_path, capsys):
    assert engine_e2e.main(["--assets-dir", str(tmp_path / "none"), "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "none") in err and err.count("\n") == 1
    if not torch.cuda.is_available():
        assert engine_e2e.main(["--tiny", "--device", "cuda", "--out", str(tmp_path)]) == 2
        assert "CUDA" in capsys.readouterr().err


def test_engine_benchmark_prompts_are_text_windows_off_the_grid():
    lengths = engine_e2e.prompt_lengths(24, 100, 3000)
    assert lengths[0] == 100 and lengths[-1] == 3000 and lengths == sorted(lengths)
    assert all(n % engine_e2e.LENGTH_GRID for n in lengths)
    token_ids = torch.arange(10_000)
    windows = engine_e2e.text_prompts(token_ids, lengths, seed=0)
    assert sorted(len(w) for w in windows) == lengths and [len(w) for w in windows] != lengths
    assert all(w == list(range(w[0], w[0] + len(w))) for w in windows)
    assert min(w[0] for w in windows) == 0 and max(w[-1] for w in windows) == 9_999
    with pytest.raises(ValueError, match="fewer than the longest prompt"):
        engine_e2e.text_prompts(torch.arange(50), lengths, seed=0)
