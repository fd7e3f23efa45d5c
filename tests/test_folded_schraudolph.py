"""The folded Schraudolph form of the reference (fa4_rowmax/reference/fused_softmax.py, Note [Folded
Schraudolph]) against the unfolded form on the same scores, within aiter_fused/tolerances.py's Note [Folded
Schraudolph tolerance], and mutants of the fold that the comparison must catch. Pure torch."""

import math

import pytest
import torch

from aiter_fused.tolerances import INTERPRETER_FOLD_Z_ROUNDINGS, fold_lse_ok, lse_stats
from fa4_rowmax.reference import fused_softmax
from fa4_rowmax.reference.fused_softmax import (
    folded_q_prescale,
    folded_recovery_bound,
    folded_schraudolph_bf16,
    fused_softmax_attention_reference,
    operand_element_format,
    schraudolph_bf16,
)
from fa4_rowmax.reference.mx import fake_quantize_mx

THRESHOLD, TILE_N, KEYS = 2.0, 32, 83


def test_folded_bits_are_the_unfolded_bits_where_z_is_exact():
    """``z = 128 y + 16256`` exact in fp32 (y on a 2**-10 grid in [-140, 120]): the same BF16 bits, -inf to 0,
    NaN to NaN, y below -127 to 0."""
    y = torch.arange(-140 * 1024, 120 * 1024, 7, dtype=torch.float32) / 1024
    y = torch.cat([y, torch.tensor([-math.inf, math.nan])])
    z = y * 128 + 16256  # exact: |z| < 2**15 on a 2**-3 grid
    folded, unfolded = folded_schraudolph_bf16(z), schraudolph_bf16(y)
    assert torch.equal(folded.view(torch.int16), unfolded.view(torch.int16))
    assert folded[-2] == 0 and torch.isnan(folded[-1])


def test_recovery_bound_and_prescale_are_fp32():
    assert folded_recovery_bound(8.0) == 17280.0 and folded_recovery_bound(2.0) == 16512.0
    c = torch.tensor(64**-0.5 * math.log2(math.e), dtype=torch.float32).item()
    assert folded_q_prescale(64**-0.5) == 128 * c


def _qkv(causal_seed=5):
    gen = torch.Generator().manual_seed(causal_seed)
    return (
        torch.randn(1, 37, 4, 64, generator=gen).bfloat16(),
        torch.randn(1, KEYS, 2, 64, generator=gen).bfloat16(),
        torch.randn(1, KEYS, 2, 64, generator=gen).bfloat16(),
    )


def _unfolded_on_folded_scores(q, k, v, causal, mx_format):
    """The unfolded reference on the fold's scores: Q prescaled and quantized as the fold does it (idempotent
    under the reference's own quantization), scale_log2 = 2**-7, so ``x = S / 128`` exactly."""
    q_folded = fake_quantize_mx(q.float() * folded_q_prescale(64**-0.5), operand_element_format(mx_format), dim=-1)
    return fused_softmax_attention_reference(
        q_folded,
        k,
        v,
        causal=causal,
        mx_format=mx_format,
        tile_n=TILE_N,
        recovery_threshold=THRESHOLD,
        softmax_scale=2.0**-7 / math.log2(math.e),
        return_counters=True,
    )


def _folded(q, k, v, causal, mx_format):
    return fused_softmax_attention_reference(
        q,
        k,
        v,
        causal=causal,
        mx_format=mx_format,
        tile_n=TILE_N,
        recovery_threshold=THRESHOLD,
        exp_fold=True,
        return_counters=True,
    )


@pytest.mark.parametrize("mx_format,causal", [("mxfp8", False), ("mxfp8", True), ("mxfp4", True)])
def test_fold_equals_the_unfolded_form_on_the_same_scores(mx_format, causal):
    """Note [Folded Schraudolph tolerance], r = 2: the same recoveries, LSE within the derived bound but for
    the allowed flip rows, output near. The fold's Q quantization is the only other change, and it is large:
    against the plain reference (Q quantized unscaled) the LSE moves far beyond the bound."""
    q, k, v = _qkv()
    out, lse, counters = _folded(q, k, v, causal, mx_format)
    out_u, lse_u, counters_u = _unfolded_on_folded_scores(q, k, v, causal, mx_format)
    assert torch.equal(counters["recoveries"], counters_u["recoveries"]) and counters["recoveries"].sum() > 0
    moves = 1 + int(counters["recoveries"].max())
    assert fold_lse_ok(lse, lse_u, moves, KEYS, INTERPRETER_FOLD_Z_ROUNDINGS), lse_stats(lse, lse_u)
    assert ((out - out_u).norm() / out_u.norm()).item() < 2.0**-7
    plain = fused_softmax_attention_reference(
        q, k, v, causal=causal, mx_format=mx_format, tile_n=TILE_N, recovery_threshold=THRESHOLD
    )
    assert not fold_lse_ok(lse, plain[1], moves, KEYS, INTERPRETER_FOLD_Z_ROUNDINGS)


def _without_recovery_rederivation(frozen, addend, tile_max, bound):
    new_max, new_addend, shift, rescale, recovered = _FOLDED_MAX_STEP(frozen, addend, tile_max, bound)
    return new_max, new_addend, torch.where(recovered, torch.zeros_like(shift), shift), rescale, recovered


def _recovery_bound_in_log2_units(frozen, addend, tile_max, bound):
    return _FOLDED_MAX_STEP(frozen, addend, tile_max, THRESHOLD)


def _addend_not_moved(frozen, addend, tile_max, bound):
    new_max, _, shift, rescale, recovered = _FOLDED_MAX_STEP(frozen, addend, tile_max, bound)
    return new_max, torch.where(torch.isfinite(frozen), addend, addend + shift), shift, rescale, recovered


_FOLDED_MAX_STEP = fused_softmax.folded_max_step


@pytest.mark.parametrize("mutant", [_without_recovery_rederivation, _recovery_bound_in_log2_units, _addend_not_moved])
def test_the_comparison_catches_a_wrong_fold(monkeypatch, mutant):
    """A fold that skips the re-derivation on a recovery, tests the tile max against the threshold in log2 units
    instead of z units, or keeps the addend on a recovery must fail the comparison the right fold passes."""
    q, k, v = _qkv()
    out_u, lse_u, counters_u = _unfolded_on_folded_scores(q, k, v, False, "mxfp8")
    monkeypatch.setattr(fused_softmax, "folded_max_step", mutant)
    out, lse, counters = _folded(q, k, v, False, "mxfp8")
    moves = 1 + int(counters_u["recoveries"].max())
    assert not fold_lse_ok(lse, lse_u, moves, KEYS, INTERPRETER_FOLD_Z_ROUNDINGS)
