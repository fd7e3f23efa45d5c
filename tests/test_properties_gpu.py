"""The layout property through the GPU kernels (issue 25): q, k and v in any of property_helpers.LAYOUTS give the
bit-identical answer of their contiguous copies, or (where a kernel documents a layout rule) a refusal naming the
tensor. The FA4 BF16 Rowmax-H15 stage through the patched `flash_attn_func`, the SM90 FP8 forward
(`fa4_rowmax.fp8_sm90.flash_attn_fp8_sm90`), and the Fused-Softmax Triton kernel. Few small examples, one head
dim per kernel so that each compiles once per causal flag. The `gpu` mark (Note [GPU tests] in tests/conftest.py)
skips them without CUDA and on other architectures.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_helpers import LAYOUTS, assert_same_results, examples, relayout, seeded, seeds

pytestmark = pytest.mark.gpu

layouts = st.sampled_from(LAYOUTS)
lengths = st.integers(1, 300)


def _inputs(seed, batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype):
    q = seeded((batch, seqlen_q, heads_q, head_dim), seed, torch.float32, 2.0, "cuda")
    k = seeded((batch, seqlen_k, heads_k, head_dim), seed + 1, torch.float32, 1.0, "cuda")
    v = seeded((batch, seqlen_k, heads_k, head_dim), seed + 2, torch.float32, 1.0, "cuda")
    return tuple(x.to(dtype) for x in (q, k, v))


@pytest.mark.gpu(arch="sm90")
@pytest.mark.gpu(arch="sm100")
@pytest.mark.gpu(arch="sm103")
@pytest.mark.gpu(arch="sm110")
@examples(4)
@given(seed=seeds, seqlen_q=lengths, seqlen_k=lengths, causal=st.booleans(), lq=layouts, lk=layouts, lv=layouts)
def test_fa4_rowmax_h15_stage_answers_alike_in_any_layout(seed, seqlen_q, seqlen_k, causal, lq, lk, lv):
    from fa4_rowmax.interface import is_fa4_patched

    assert is_fa4_patched(), "FA4 is not patched: python -m fa4_rowmax.patching apply"
    from flash_attn.cute import flash_attn_func

    q, k, v = _inputs(seed, 1, seqlen_q, seqlen_k, 4, 2, 128, torch.bfloat16)
    options = dict(causal=causal, softmax_mode="rowmax_h15", return_lse=True)
    want = flash_attn_func(q, k, v, **options)
    got = flash_attn_func(relayout(q, lq), relayout(k, lk), relayout(v, lv), **options)
    assert_same_results(tuple(got), tuple(want))


@pytest.mark.gpu(arch="sm90")
@examples(4)
@given(
    seed=seeds,
    seqlen_q=lengths,
    seqlen_k=lengths,
    causal=st.booleans(),
    mode=st.sampled_from(("exact", "rowmax_h15")),
    lq=layouts,
    lk=layouts,
    lv=layouts,
)
def test_fp8_sm90_forward_answers_alike_in_any_layout_or_names_the_tensor(
    seed, seqlen_q, seqlen_k, causal, mode, lq, lk, lv
):
    """The FP8 forward documents one layout rule: a contiguous last dimension (fp8_sm90._check_tensor); any other
    layout must give the same bytes."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _inputs(seed, 1, seqlen_q, seqlen_k, 4, 2, 128, torch.float8_e4m3fn)
    want = flash_attn_fp8_sm90(q, k, v, causal=causal, softmax_mode=mode)
    inputs = dict(q=relayout(q, lq), k=relayout(k, lk), v=relayout(v, lv))
    strided = [name for name, x in inputs.items() if x.stride(-1) != 1]
    try:
        got = flash_attn_fp8_sm90(**inputs, causal=causal, softmax_mode=mode)
    except ValueError as error:
        assert strided and any(
            str(error).startswith(f"{name} must have a contiguous last dimension") for name in strided
        )
        return
    assert not strided, f"{strided} with a strided last dimension was accepted"
    assert_same_results(tuple(got), tuple(want))


@examples(6)
@given(
    seed=seeds,
    seqlen_q=st.integers(1, 200),
    seqlen_k=st.integers(1, 200),
    causal=st.booleans(),
    exact=st.booleans(),
    lq=layouts,
    lk=layouts,
    lv=layouts,
)
def test_aiter_fused_kernel_answers_alike_in_any_layout(seed, seqlen_q, seqlen_k, causal, exact, lq, lk, lv):
    from aiter_fused.attention import fused_softmax_attention

    q, k, v = _inputs(seed, 2, seqlen_q, seqlen_k, 4, 2, 64, torch.bfloat16)
    want = fused_softmax_attention(q, k, v, causal=causal, exact=exact)
    got = fused_softmax_attention(relayout(q, lq), relayout(k, lk), relayout(v, lv), causal=causal, exact=exact)
    assert_same_results(got, want)
