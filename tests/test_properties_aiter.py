"""Properties of the Fused-Softmax entries (`aiter_fused.attention`, `torch.ops.aiter_fused`) on Triton's CPU
interpreter, tiny shapes (each call runs every program in Python), or on a GPU:

- no layout changes the answer: q, k, v in any of property_helpers.LAYOUTS give bit-identical out and LSE, dense
  and varlen, the exact twin and the MX modes, through the entries and the custom op;
- an answer is the reference's (`fused_softmax_attention_reference`) within aiter_fused/tolerances.py's bounds;
- bad arguments raise TypeError/ValueError naming the argument, before any launch;
- empty inputs return out 0 and LSE -inf in the shapes of a non-empty call.
Budgets: Note [Hypothesis profiles] in tests/conftest.py.
"""

import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when aiter_fused.kernel is first imported

pytest.importorskip("triton")

from property_helpers import (  # noqa: E402
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

import aiter_fused.ops  # noqa: E402,F401  (registers torch.ops.aiter_fused)
from aiter_fused.attention import fused_softmax_attention, fused_softmax_attention_varlen  # noqa: E402
from aiter_fused.tolerances import OUT_REL_TOL, lse_ok, lse_stats  # noqa: E402
from fa4_rowmax.reference.fused_softmax import (  # noqa: E402
    fused_softmax_attention_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

BF16 = torch.bfloat16
# (exact, mx_format, dot_mode) the interpreter runs ("scaled" has no interpreter: tests/test_aiter_fused_kernel.py).
KERNEL_MODES = [
    dict(exact=True),
    dict(mx_format="mxfp8", dot_mode="bf16"),
    dict(mx_format="mxfp4", dot_mode="bf16"),
    dict(mx_format="mxfp6", dot_mode="fp8"),
    dict(mx_format="mxfp8", dot_mode="fp8"),
]
kernel_modes = st.sampled_from(KERNEL_MODES)
layouts = st.sampled_from(LAYOUTS)
tiny = attention_shapes(head_dims=(32, 64), max_seqlen=20, max_batch=2)


def _bf16(shape, seed):
    return seeded(shape, seed, BF16, device=DEVICE)


@examples(6)
@given(shape=tiny, seed=seeds, mode=kernel_modes, causal=st.booleans(), lq=layouts, lk=layouts, lv=layouts)
def test_no_layout_changes_the_dense_answer(shape, seed, mode, causal, lq, lk, lv):
    q, k, v = dense_inputs(shape, seed, BF16, device=DEVICE)
    want = fused_softmax_attention(q, k, v, causal=causal, tile_n=32, **mode)
    got = fused_softmax_attention(relayout(q, lq), relayout(k, lk), relayout(v, lv), causal=causal, tile_n=32, **mode)
    assert_same_results(got, want)
    assert got[0].is_contiguous() and got[1].is_contiguous()


@examples(5)
@given(lengths=varlen_lengths(max_seqlen=12), seed=seeds, mode=kernel_modes, lq=layouts, lk=layouts, lv=layouts)
def test_no_layout_changes_the_varlen_answer(lengths, seed, mode, lq, lk, lv):
    seqlen_q, seqlen_k = lengths
    q, k, v = (
        _bf16((sum(seqlen_q), 2, 32), seed),
        _bf16((sum(seqlen_k), 1, 32), seed + 1),
        _bf16((sum(seqlen_k), 1, 32), seed + 2),
    )
    cu_q, cu_k = cu_seqlens(seqlen_q, DEVICE), cu_seqlens(seqlen_k, DEVICE)
    extents = (max(seqlen_q), max(seqlen_k))
    want = fused_softmax_attention_varlen(q, k, v, cu_q, cu_k, *extents, causal=True, tile_n=32, **mode)
    strided = (relayout(q, lq), relayout(k, lk), relayout(v, lv))
    got = fused_softmax_attention_varlen(*strided, cu_q, cu_k, *extents, causal=True, tile_n=32, **mode)
    assert_same_results(got, want)


@examples(3)
@given(shape=tiny, seed=seeds, causal=st.booleans(), exact=st.booleans(), lq=layouts, lk=layouts, lv=layouts)
def test_the_custom_op_is_the_entry_in_any_layout(shape, seed, causal, exact, lq, lk, lv):
    q, k, v = dense_inputs(shape, seed, BF16, device=DEVICE)
    want = fused_softmax_attention(q, k, v, causal=causal, exact=exact)
    got = torch.ops.aiter_fused.fwd(relayout(q, lq), relayout(k, lk), relayout(v, lv), causal, None, "mxfp8", exact)
    assert_same_results(got, want)


@examples(6)
@given(shape=tiny, seed=seeds, mode=kernel_modes.filter(lambda m: not m.get("exact")), causal=st.booleans())
def test_an_answer_is_the_references_within_its_bounds(shape, seed, mode, causal):
    """aiter_fused/tolerances.py: out within OUT_REL_TOL (relative Frobenius), the LSE by `lse_ok`, the same rows
    empty (LSE -inf) as the reference's."""
    q, k, v = dense_inputs(shape, seed, BF16, device=DEVICE)
    out, lse = fused_softmax_attention(q, k, v, causal=causal, tile_n=32, **mode)
    ref_out, ref_lse = fused_softmax_attention_reference(
        q.cpu(), k.cpu(), v.cpu(), causal=causal, mx_format=mode["mx_format"], tile_n=32
    )
    out, ref_out = out.float().cpu(), ref_out.float()
    if ref_out.norm() > 0:
        assert ((out - ref_out).norm() / ref_out.norm()).item() < OUT_REL_TOL
    assert torch.equal(torch.isfinite(lse.cpu()), torch.isfinite(ref_lse))
    stats = lse_stats(lse.cpu(), ref_lse)
    assert lse_ok(mode["dot_mode"], mode["mx_format"], stats, fp32_sums=DEVICE == "cpu"), stats


def _bad_dense_calls():
    """(label, changed arguments, names the error must mention): every argument of fused_softmax_attention."""
    q, k = torch.zeros(1, 8, 2, 32, dtype=BF16, device=DEVICE), torch.zeros(1, 8, 1, 32, dtype=BF16, device=DEVICE)
    cases = []
    for flag in ("causal", "exact", "return_lse", "return_recoveries", "exp_fold"):
        cases += [(f"{flag} {label}", {flag: value}, (flag,)) for label, value in NOT_A_BOOL]
    cases += [(f"softmax_scale {label}", dict(softmax_scale=v), ("softmax_scale",)) for label, v in BAD_POSITIVE_REALS]
    for label, value in [("nan", math.nan), ("negative", -1.0), ("huge", 1e9), ("str", "8"), ("bool", True)]:
        cases.append((f"recovery_threshold {label}", dict(recovery_threshold=value), ("recovery_threshold",)))
    for value in (48, 32.0, True, "64", 0, -32):
        cases.append((f"tile_n {value!r}", dict(tile_n=value), ("tile_n",)))
    for name, values in (("mx_format", ("mxfp16", None, 8)), ("dot_mode", ("fp16", ["bf16"])), ("row_sum", ("sum",))):
        cases += [(f"{name} {value!r}", {name: value}, (name,)) for value in values]
    cases += [
        ("launch", dict(launch="sm90"), ("launch",)),
        ("q float32", dict(q=q.float()), ("q",)),
        ("k 3-D", dict(k=k[0]), ("k",)),
        ("v list", dict(v=[1.0]), ("v",)),
        ("head_dim 48", dict(q=q[..., :16].repeat(1, 1, 1, 3)), ("head_dim",)),
        ("heads", dict(q=torch.zeros(1, 8, 3, 32, dtype=BF16, device=DEVICE), k=k.expand(1, 8, 2, 32)), ("heads",)),
        ("zero kv heads", dict(k=k[:, :, :0], v=k[:, :, :0]), ("heads",)),
        ("k batch", dict(k=k.expand(2, 8, 1, 32), v=k.expand(2, 8, 1, 32)), ("k and v",)),
        ("v keys", dict(v=k[:, :5]), ("k and v",)),
    ]
    return [(label, {"q": q, "k": k, "v": k, **changes}, names) for label, changes, names in cases]


@pytest.mark.parametrize("case", _bad_dense_calls(), ids=lambda case: case[0])
def test_bad_dense_arguments_are_refused_by_name(case):
    _, arguments, names = case
    assert_refused_naming(lambda: fused_softmax_attention(**arguments), names)


@examples(60)
@given(scale=real_like_values, knob=st.sampled_from(("softmax_scale", "recovery_threshold")))
def test_a_real_argument_is_accepted_exactly_when_it_is_in_range(scale, knob):
    """softmax_scale: None or a finite real > 0; recovery_threshold: a real in [0, 127); never a bool, a string,
    a complex. An empty q runs every check and no launch, so the property costs nothing per example."""
    q = torch.zeros(0, 8, 2, 32, dtype=BF16, device=DEVICE)
    if knob == "softmax_scale":
        valid = scale is None or (is_real(scale) and 0 < float_or_inf(scale) < math.inf)
    else:
        valid = is_real(scale) and 0 <= float_or_inf(scale) < 127
    call = lambda: fused_softmax_attention(q, q, q, **{knob: scale})  # noqa: E731
    if valid:
        call()
    else:
        assert_refused_naming(call, (knob,))


def _bad_varlen_calls():
    q, k = torch.zeros(8, 2, 32, dtype=BF16, device=DEVICE), torch.zeros(8, 1, 32, dtype=BF16, device=DEVICE)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    base = dict(q=q, k=k, v=k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    cases = [(f"validate {label}", dict(validate=value), ("validate",)) for label, value in NOT_A_BOOL]
    for name in ("max_seqlen_q", "max_seqlen_k"):
        for value in (5.5, "5", True, -1, None):
            cases.append((f"{name} {value!r}", {name: value}, (name,)))
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        cases += [
            (f"{name} int64", {name: cu.long()}, (name,)),
            (f"{name} short", {name: cu[:1]}, (name,)),
            (f"{name} end", {name: torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)}, (name,)),
            (f"{name} decreasing", {name: torch.tensor([0, 5, 3, 8], dtype=torch.int32, device=DEVICE)}, (name,)),
        ]
    cases.append(("max_seqlen_q short", dict(max_seqlen_q=4), ("max_seqlen_q",)))
    return [(label, {**base, **changes}, names) for label, changes, names in cases]


@pytest.mark.parametrize("case", _bad_varlen_calls(), ids=lambda case: case[0])
def test_bad_varlen_arguments_are_refused_by_name(case):
    _, arguments, names = case
    assert_refused_naming(lambda: fused_softmax_attention_varlen(**arguments), names)


@examples(10)
@given(
    shape=tiny,
    empty=st.sets(st.sampled_from(("batch", "seqlen_q", "seqlen_k", "group")), min_size=1),
    mode=kernel_modes,
    causal=st.booleans(),
)
def test_empty_inputs_return_fa4s_empty_result(shape, empty, mode, causal):
    shape = {**shape, **{name: 0 for name in empty}}
    q, k, v = dense_inputs(shape, 0, BF16, device=DEVICE)
    out, lse = fused_softmax_attention(q, k, v, causal=causal, tile_n=32, **mode)
    batch, seqlen_q, heads_q, _ = q.shape
    assert out.shape == q.shape and lse.shape == (batch, heads_q, seqlen_q)
    assert bool((out == 0).all()) and bool((lse == -math.inf).all())
