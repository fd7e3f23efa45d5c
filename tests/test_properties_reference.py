"""Properties of the semantic reference (`fa4_rowmax.reference`) over generated inputs (issue 25's suite):

- no layout changes the answer: q, k and v in any of property_helpers.LAYOUTS give bit-identical out, LSE and
  counters, in every mode, dense and varlen;
- finite inputs get an answer or a refusal naming the inputs: out finite, LSE finite on exactly the rows with a
  key (-inf on the others), exact-mode out inside its rows' convex hull of v up to its derived rounding; never the
  masked row for a row that sees a key, whatever the magnitudes;
- bad arguments raise TypeError/ValueError naming the argument;
- empty inputs return FA4's empty result.
Budgets: Note [Hypothesis profiles] in tests/conftest.py.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_helpers import (
    BAD_POSITIVE_REALS,
    LAYOUTS,
    NOT_A_BOOL,
    assert_refused_naming,
    assert_same_results,
    attention_shapes,
    cu_seqlens,
    dense_inputs,
    examples,
    float_or_inf,
    is_real,
    real_like_values,
    relayout,
    seeded,
    seeds,
    varlen_lengths,
)

from fa4_rowmax.config import SoftmaxConfig
from fa4_rowmax.reference.attention import attention_reference

MODES = ("exact", "rowmax_h15", "rowmax_pot", "baps", "fused_softmax")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
layouts = st.sampled_from(LAYOUTS)


def _config(mode: str, tile_n: int) -> SoftmaxConfig:
    # BAPS blocks are tile_m rows; a small tile_m gives several blocks on small inputs.
    return (
        SoftmaxConfig(mode=mode, tile_n=tile_n, tile_m=16)
        if mode == "baps"
        else SoftmaxConfig(mode=mode, tile_n=tile_n)
    )


@examples(25)
@given(
    shape=attention_shapes(),
    seed=seeds,
    mode=st.sampled_from(MODES),
    dtype=st.sampled_from(INPUT_DTYPES),
    causal=st.booleans(),
    tile_n=st.sampled_from((32, 64)),
    layout_q=layouts,
    layout_k=layouts,
    layout_v=layouts,
)
def test_no_layout_changes_the_dense_answer(shape, seed, mode, dtype, causal, tile_n, layout_q, layout_k, layout_v):
    q, k, v = dense_inputs(shape, seed, dtype)
    config = _config(mode, tile_n)
    want = attention_reference(q, k, v, config, causal=causal, return_counters=True)
    got = attention_reference(
        relayout(q, layout_q),
        relayout(k, layout_k),
        relayout(v, layout_v),
        config,
        causal=causal,
        return_counters=True,
    )
    assert_same_results(got, want)


@examples(15)
@given(
    lengths=varlen_lengths(),
    heads=st.sampled_from(((1, 1), (2, 1), (2, 2))),
    seed=seeds,
    mode=st.sampled_from(MODES),
    causal=st.booleans(),
    layout_q=layouts,
    layout_k=layouts,
    layout_v=layouts,
)
def test_no_layout_changes_the_varlen_answer(lengths, heads, seed, mode, causal, layout_q, layout_k, layout_v):
    (seqlen_q, seqlen_k), (heads_q, heads_k) = lengths, heads
    q = seeded((sum(seqlen_q), heads_q, 64), seed)
    k, v = seeded((sum(seqlen_k), heads_k, 64), seed + 1), seeded((sum(seqlen_k), heads_k, 64), seed + 2)
    offsets = dict(cu_seqlens_q=cu_seqlens(seqlen_q), cu_seqlens_k=cu_seqlens(seqlen_k))
    config = _config(mode, 32)
    want = attention_reference(q, k, v, config, causal=causal, **offsets)
    got = attention_reference(
        relayout(q, layout_q), relayout(k, layout_k), relayout(v, layout_v), config, causal=causal, **offsets
    )
    assert_same_results(got, want)


def _rows_with_a_key(seqlen_q: int, seqlen_k: int, causal: bool) -> torch.Tensor:
    row = torch.arange(seqlen_q)
    has_key = torch.full((seqlen_q,), seqlen_k > 0)
    return has_key & (row + seqlen_k - seqlen_q >= 0) if causal else has_key


@examples(40)
@given(
    shape=attention_shapes(max_seqlen=12),
    seed=seeds,
    mode=st.sampled_from(MODES),
    dtype=st.sampled_from((torch.float32, torch.float64)),
    compute_dtype=st.sampled_from((torch.float32, torch.float64)),
    log10_scale=st.integers(-30, 160),
    v_log10_scale=st.integers(-10, 40),
    causal=st.booleans(),
)
def test_finite_inputs_give_an_answer_or_a_refusal_naming_them(
    shape, seed, mode, dtype, compute_dtype, log10_scale, v_log10_scale, causal
):
    """Magnitudes from tiny to past float32 (and, squared in the scores, past float64): the reference answers, or
    refuses naming q, k or v; an answer is never a masked-looking row for a row that sees a key."""
    q, k, _ = dense_inputs(shape, seed, torch.float64, scale=10.0**log10_scale)
    v = seeded(k.shape, seed + 2, torch.float64, scale=10.0**v_log10_scale)
    if dtype == torch.float32 and not all(bool(torch.isfinite(x.float()).all()) for x in (q, k, v)):
        return  # the float32 inputs themselves would not be finite: the NaN/Inf refusal, tested elsewhere
    q, k, v = (x.to(dtype) for x in (q, k, v))
    try:
        out, lse = attention_reference(q, k, v, _config(mode, 32), causal=causal, compute_dtype=compute_dtype)
    except ValueError as error:
        message = str(error)
        assert message.startswith(("q ", "k ", "v ", "q and k ", "v:", "v and", "q holds", "k holds", "v holds")), (
            message
        )
        assert "range" in message, message
        return
    has_key = _rows_with_a_key(shape["seqlen_q"], shape["seqlen_k"], causal)
    assert bool(torch.isfinite(out).all())
    assert torch.equal(torch.isfinite(lse), has_key[None, None, :].expand_as(lse))
    assert bool((lse[..., ~has_key] == -math.inf).all()) and bool((out[:, ~has_key] == 0).all())
    if mode == "exact":
        _assert_inside_the_hull_of_v(out, v, has_key, causal, shape, compute_dtype)


def _assert_inside_the_hull_of_v(out, v, has_key, causal, shape, compute_dtype):
    """Exact softmax weights are positive and normalised, so each output component lies between the smallest and
    largest v component over the row's keys, up to rounding: P is rounded to p_dtype (float32 for these inputs,
    2^-24 relative) after the row sum adds it unrounded, and P @ V and the row sum are each summed over at most
    seqlen_k terms in the compute dtype (gamma_n <= n u / (1 - n u), u its unit roundoff): the slack is
    (2^-24 + 2 * 1.01 * seqlen_k * u) * max |v| of the row's keys, and out is then rounded to the input dtype
    (one more unit roundoff of |out| <= max |v|)."""
    u = 2.0**-24 if compute_dtype == torch.float32 else 2.0**-53
    u_out = 2.0**-24 if out.dtype == torch.float32 else 2.0**-53
    seqlen_q, seqlen_k, group = shape["seqlen_q"], shape["seqlen_k"], shape["group"]
    v = v.double().repeat_interleave(group, dim=2)  # (batch, keys, heads_q, dim)
    out = out.double()
    for row in torch.nonzero(has_key).flatten().tolist():
        last = row + seqlen_k - seqlen_q if causal else seqlen_k - 1
        keys = v[:, : last + 1]
        low, high, largest = keys.amin(1), keys.amax(1), keys.abs().amax(1)
        slack = (2.0**-24 + 2 * 1.01 * seqlen_k * u + u_out) * largest
        assert bool((out[:, row] >= low - slack).all()) and bool((out[:, row] <= high + slack).all()), row


def _base_inputs():
    q = seeded((1, 8, 2, 64), 0)
    k, v = seeded((1, 8, 1, 64), 1), seeded((1, 8, 1, 64), 2)
    return dict(q=q, k=k, v=v)


def _bad_calls():
    """(arguments changed, names the error must mention) over every argument of attention_reference."""
    base = _base_inputs()
    q, k = base["q"], base["k"]
    cases = []
    for label, value in NOT_A_BOOL:
        cases.append((f"causal {label}", dict(causal=value), ("causal",)))
        cases.append((f"return_counters {label}", dict(return_counters=value), ("return_counters",)))
    for label, value in BAD_POSITIVE_REALS:
        cases.append((f"softmax_scale {label}", dict(softmax_scale=value), ("softmax_scale",)))
    for dtype in (torch.float16, torch.bfloat16, torch.int32, "float32", None):
        cases.append((f"compute_dtype {dtype}", dict(compute_dtype=dtype), ("compute_dtype",)))
    for name in ("q", "k", "v"):
        x = base[name]
        cases += [
            (f"{name} int", {name: x.to(torch.int32)}, (name,)),
            (f"{name} bool", {name: x > 0}, (name,)),
            (f"{name} list", {name: x.tolist()}, (name,)),
            (f"{name} 3-D", {name: x[0]}, (name,)),
            (f"{name} NaN", {name: x.clone().index_fill_(1, torch.tensor([3]), math.nan)}, (name,)),
            (f"{name} Inf", {name: x.clone().index_fill_(1, torch.tensor([0]), -math.inf)}, (name,)),
            (f"{name} other dtype", {name: x.double()}, ("q, k and v",)),
            (f"{name} meta", {name: torch.empty_like(x, device="meta")}, ("q, k and v",)),
        ]
    cases += [
        ("head_dim 32", dict(q=q[..., :32], k=k[..., :32], v=base["v"][..., :32]), ("head_dim",)),
        ("k head_dim", dict(k=seeded((1, 8, 1, 128), 3), v=seeded((1, 8, 1, 128), 4)), ("k's head_dim", "head_dim")),
        ("v shape", dict(v=base["v"][:, :5]), ("k and v",)),
        ("batch", dict(q=seeded((2, 8, 2, 64), 5)), ("batch",)),
        ("heads", dict(q=seeded((1, 8, 3, 64), 6), k=seeded((1, 8, 2, 64), 7), v=seeded((1, 8, 2, 64), 8)), ("heads",)),
        ("zero kv heads", dict(k=k[:, :, :0], v=base["v"][:, :, :0]), ("heads",)),
        ("config", dict(config="exact"), ("config",)),
        ("descale on bf16", dict(q_descale=torch.ones(1, 1)), ("q_descale",)),
        ("cu_seqlens alone", dict(cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32)), ("cu_seqlens_k",)),
    ]
    return cases


BAD_CALLS = _bad_calls()


@pytest.mark.parametrize("case", BAD_CALLS, ids=lambda case: case[0])
def test_bad_arguments_are_refused_by_name(case):
    _, changes, names = case
    arguments = {**_base_inputs(), **changes}
    assert_refused_naming(lambda: attention_reference(**arguments), names)


@examples(60)
@given(scale=real_like_values, empty=st.booleans())
def test_softmax_scale_is_accepted_exactly_when_it_is_none_or_a_finite_positive_real(scale, empty):
    inputs = _base_inputs()
    if empty:  # the checks run before the empty result
        inputs = {name: x[:0] for name, x in inputs.items()}
    call = lambda: attention_reference(**inputs, softmax_scale=scale)  # noqa: E731
    if scale is None or (is_real(scale) and 0 < float_or_inf(scale) < math.inf):
        try:
            call()
        except ValueError as error:  # a huge scale may overflow the scores: refused naming the inputs
            assert str(error).startswith("q and k give scores"), error
    else:
        assert_refused_naming(call, ("softmax_scale",))


@st.composite
def bad_offsets(draw):
    """cu_seqlens lists that break one of the rules (start 0, never decrease, end at the token count, int32,
    1-D with at least two entries)."""
    total = 8
    flaw = draw(st.sampled_from(("start", "decrease", "end", "dtype", "short", "rank")))
    inner = sorted(draw(st.lists(st.integers(0, total), min_size=0, max_size=3)))
    offsets = [0, *inner, total]
    if flaw == "start":
        offsets[0] = draw(st.integers(1, total))
    elif flaw == "decrease":
        offsets.insert(1, draw(st.integers(1, total)))
        offsets.insert(2, offsets[1] - 1)
    elif flaw == "end":
        offsets[-1] = draw(st.integers(0, total - 1) | st.integers(total + 1, 3 * total))
    tensor = torch.tensor(offsets, dtype=torch.int64 if flaw == "dtype" else torch.int32)
    if flaw == "short":
        tensor = tensor[:1]
    elif flaw == "rank":
        tensor = tensor[None]
    return tensor


@examples(30)
@given(bad=bad_offsets(), which=st.sampled_from(("cu_seqlens_q", "cu_seqlens_k")))
def test_bad_varlen_offsets_are_refused_by_name(bad, which):
    q, k, v = seeded((8, 2, 64), 0), seeded((8, 1, 64), 1), seeded((8, 1, 64), 2)
    good = torch.tensor([0, 3, 8], dtype=torch.int32)
    offsets = dict(cu_seqlens_q=good, cu_seqlens_k=good)
    offsets[which] = bad
    assert_refused_naming(lambda: attention_reference(q, k, v, **offsets), (which, "cu_seqlens_q and cu_seqlens_k"))


@examples(20)
@given(
    shape=attention_shapes(max_seqlen=6),
    empty=st.sets(st.sampled_from(("batch", "seqlen_q", "seqlen_k", "group")), min_size=1),
    mode=st.sampled_from(MODES),
    dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float8_e4m3fn)),
    causal=st.booleans(),
)
def test_empty_inputs_return_fa4s_empty_result(shape, empty, mode, dtype, causal):
    """FA4 (flash_attn/cute/interface.py): out zero and LSE -inf when there is no query or no key."""
    if dtype == torch.float8_e4m3fn and mode not in ("exact", "rowmax_h15", "rowmax_pot"):
        mode = "exact"
    shape = {**shape, **{name: 0 for name in empty}}
    q, k, v = (x.to(dtype) for x in dense_inputs(shape, 0))
    out, lse = attention_reference(q, k, v, _config(mode, 32), causal=causal)
    batch, seqlen_q, heads_q = shape["batch"], shape["seqlen_q"], shape["heads_k"] * shape["group"]
    assert out.shape == q.shape and lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32
    assert out.dtype == (torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype)
    assert bool((out == 0).all()) and bool((lse == -math.inf).all())


def _full_softmax_fp64(q, k, v, causal, scale):
    """Attention from the whole score matrix in float64: logsumexp and softmax, no tiles (the independent oracle)."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.double().repeat_interleave(group, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * scale
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if causal:
        row, key = torch.arange(seqlen_q)[:, None], torch.arange(seqlen_k)[None, :]
        s = s.masked_fill(key > row + seqlen_k - seqlen_q, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


@examples(25)
@given(
    shape=attention_shapes(max_seqlen=80, head_dims=(64, 128)),
    seed=seeds,
    q_scale=st.sampled_from((0.1, 1.0, 4.0, 30.0)),
    causal=st.booleans(),
    tile_n=st.sampled_from((16, 32, 128)),
)
def test_exact_float64_is_full_softmax_within_its_rounding_bound(shape, seed, q_scale, causal, tile_n):
    """Exact mode in float64 (P in float64) against the whole-matrix softmax, within a bound derived from the
    roundings both make (unit roundoff u = 2^-53, gamma_n = n u / (1 - n u)):
    - each score q.k: gamma_d * A_ij in each computation, A_ij = sum_t |q_it k_jt|; so the weights' exponents
      differ by at most eta_ij = scale * 2 gamma_d A_ij, plus the roundings of y = s scale_log2 + (max_offset - m
      scale_log2) and of exp2 (4 u (|s scale| + |m scale| + max_offset + 1), in natural-log units);
    - weights perturbed by relative factors within exp(+-eta) move out by at most 2 (e^eta - 1) max|v| and the LSE
      by eta;
    - P @ V and the row sum each add gamma_L (L keys), every tile's rescale and the final division one u each."""
    q, k, v = dense_inputs(shape, seed, torch.float64, scale=q_scale)
    head_dim, seqlen_k = shape["head_dim"], shape["seqlen_k"]
    scale = head_dim**-0.5
    config = SoftmaxConfig(mode="exact", tile_n=tile_n, p_dtype=torch.float64)
    out, lse = attention_reference(q, k, v, config, causal=causal, compute_dtype=torch.float64)
    want_out, want_lse = _full_softmax_fp64(q, k, v, causal, scale)

    u = 2.0**-53
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    group = shape["group"]
    k_rep = k.repeat_interleave(group, dim=2)
    magnitude = torch.einsum("bqhd,bkhd->bhqk", q.abs(), k_rep.abs())  # A_ij
    s = torch.einsum("bqhd,bkhd->bhqk", q, k_rep).abs() * scale
    row_max = s.amax(-1, keepdim=True)
    eta = (scale * 2 * gamma(head_dim) * magnitude + 4 * u * (s + row_max + config.max_offset + 1)).amax(-1)
    n_tiles = -(-seqlen_k // tile_n)
    accumulate = 2 * gamma(seqlen_k) + (n_tiles + 2) * u
    largest_v = v.abs().amax(dim=(1, 3)).repeat_interleave(group, dim=1)[:, None, :, None]  # per (batch, head)
    out_bound = (2 * torch.expm1(eta).transpose(1, 2)[..., None] + accumulate) * largest_v
    lse_bound = eta + accumulate + 4 * u * want_lse.abs().nan_to_num(posinf=0, neginf=0)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert bool(((out.double() - want_out).abs() <= out_bound).all())
    # The LSE is returned in float32: half an ulp of |lse| more.
    lse_bound = lse_bound + 2.0**-24 * want_lse.abs().nan_to_num(posinf=0, neginf=0)
    assert bool(((lse.double() - want_lse).abs()[finite] <= lse_bound[finite]).all())
