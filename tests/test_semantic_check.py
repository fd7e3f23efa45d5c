"""bench.semantic_check on the CPU: the reference computed another way (fp64) passes the gate of its own stage,
a wrong softmax fails it, and the last-rows slice gives exactly the full problem's rows."""

import pytest
import torch

from bench.semantic_check import semantic_check, stage_config
from fa4_rowmax.reference.attention import attention_reference


def _inputs(seed, sq=600, sk=700):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, sq, 4, 64, generator=gen) * 3).bfloat16()
    k, v = (torch.randn(2, sk, 2, 64, generator=gen).bfloat16() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    "knobs",
    [
        {"softmax_mode": "rowmax_h15"},
        {"softmax_mode": "rowmax_pot"},
        {"softmax_mode": "rowmax_h15", "rescale_threshold": 8.0, "beta": 0.5},
        {"softmax_mode": "rowmax_h15", "anchor_rounding": "half_octave"},
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_the_stage_reference_passes_and_a_wrong_softmax_fails(knobs, causal):
    q, k, v = _inputs(1)
    config = stage_config(knobs, q, arch=90)
    right, _ = attention_reference(q, k, v, config, causal=causal, compute_dtype=torch.float64)
    assert semantic_check(knobs, q, k, v, causal, right, arch=90).passed
    exact, _ = attention_reference(q, k, v, stage_config({"softmax_mode": "exact"}, q, arch=90), causal=causal)
    result = semantic_check(knobs, q, k, v, causal, exact, arch=90)
    assert not result.passed and result.worst_excess > 0


def test_the_last_rows_slice_is_the_full_problems_rows():
    q, k, v = _inputs(2)
    config = stage_config({"softmax_mode": "rowmax_h15"}, q, arch=90)
    full, _ = attention_reference(q, k, v, config, causal=True)
    tail, _ = attention_reference(q[:, -100:], k, v, config, causal=True)
    assert torch.equal(full[:, -100:], tail)
