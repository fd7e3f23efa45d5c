"""The gates pass a Rowmax-H15 backend and fail each deliberately wrong one, naming the wrong element.

The backends (helpers_gates.py) are closed-form fp64 attention (whole-row anchor, no tiles), written independently
of the library's reference so that a bug shared by the two cannot hide; the library's reference backend is gated
too once `fa4_rowmax.reference.attention` is importable.
"""

import functools
import math

import pytest
import torch
from helpers_gates import (
    OneOctaveOffBackend,
    closed_form_attention,
    exact_backend,
    h15_backend,
    h15_fp64,
    rows_swapped_backend,
    shifted_lattice_backend,
)

from fa4_rowmax.gates.gates import (
    H15_ENVELOPE,
    GateReport,
    format_report,
    multi_tile_gate,
    run_gates,
    single_tile_gate,
)


def _reference_h15_backend(rescale_threshold=0.0):
    from fa4_rowmax.config import SoftmaxConfig
    from fa4_rowmax.reference import attention as reference

    config = SoftmaxConfig(mode="rowmax_h15", rescale_threshold=rescale_threshold)
    return functools.partial(reference.attention_reference, config=config)


# --- the gates pass correct backends ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_single_tile_passes_h15(seed, dtype):
    report = single_tile_gate(h15_backend, h15_backend, dtype=dtype, seed=seed)
    assert report.passed, str(report)
    assert report.n_elements == 8256  # the paper's count: causal 128x128
    assert report.worst == 0.0 or abs(report.worst) <= report.bound[1]


def test_multi_tile_passes_h15_and_exact_paper_shape():
    for backend in (h15_backend, exact_backend):
        report = multi_tile_gate(backend, causal=True, seqlen_q=512, seqlen_k=512, seed=3)
        assert report.passed, "\n" + format_report([report])
        assert report.n_elements == 131_328  # the paper's count: causal 512x512, one head


def test_h15_fills_the_envelope():
    # The LSE view of a correct H15 must reach close to both envelope edges on 131k elements; otherwise
    # the gate is measuring something else.
    report = multi_tile_gate(h15_backend, causal=True, seqlen_q=512, seqlen_k=512, seed=4, dtype=torch.float32)
    lse_view = next(c for c in report.checks if c.name == "log2(w_hat/w) via LSE")
    assert lse_view.passed
    assert lse_view.worst == pytest.approx(H15_ENVELOPE[1], abs=0.01) or lse_view.worst == pytest.approx(
        H15_ENVELOPE[0], abs=0.01
    )


@pytest.mark.parametrize(
    "causal, seqlen_q, seqlen_k, batch, heads_q, heads_k",
    [(False, 300, 509, 1, 4, 2), (True, 509, 300, 2, 2, 1), (True, 300, 509, 1, 3, 1)],
)
def test_multi_tile_odd_shapes_gqa_fully_masked(causal, seqlen_q, seqlen_k, batch, heads_q, heads_k):
    report = multi_tile_gate(
        h15_backend,
        causal=causal,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=heads_q,
        heads_k=heads_k,
        batch=batch,
        seed=5,
        dtype=torch.float16,
    )
    assert report.passed, "\n" + format_report([report])
    names = [c.name for c in report.checks]
    assert ("fully masked rows: lse = -inf" in names) == (causal and seqlen_q > seqlen_k)


def test_fp16_underflow_is_counted_not_failed():
    # Wide scores: many weights fall below fp16's normal range (2^-14) and read as 0 or subnormal.
    report = multi_tile_gate(h15_backend, causal=False, seqlen_q=128, seqlen_k=256, dtype=torch.float16, q_std=8.0)
    assert report.passed, "\n" + format_report([report])
    note = report.checks[0].note
    assert int(note.rsplit(":", 1)[1]) > 100, note


# --- the gates fail wrong backends, and say where -------------------------------------------------


def test_lattice_tie_within_score_rounding_is_accepted():
    # Score errors of 1.5e-4 octave (inside the derived fp32 bound, ~2.5e-4 per score here) flip a few
    # elements sitting on a lattice boundary by one step: a correct kernel, so the gate passes and counts
    # the flips.
    noisy = functools.partial(closed_form_attention, weights=h15_fp64, score_noise=1.5e-4)
    flips = 0
    for seed in range(4):
        report = single_tile_gate(noisy, h15_backend, seed=seed)
        assert report.passed, str(report)
        assert report.n_elements == 8256
        flips += int(report.checks[0].note.split("lattice ties flipped: ")[1].split(";")[0])
    assert flips > 0


def test_lattice_flip_outside_rounding_fails():
    # Score errors of 0.02 octave are far beyond fp32 rounding: the flips they cause are wrong.
    noisy = functools.partial(closed_form_attention, weights=h15_fp64, score_noise=0.02)
    report = single_tile_gate(noisy, h15_backend, seed=0)
    assert not report.passed
    assert abs(report.worst) > 0.3


def test_exact_presented_as_h15_fails_single_tile_only():
    single = single_tile_gate(exact_backend, h15_backend, seed=0)
    assert not single.passed
    assert 0.05 < abs(single.worst) <= math.log2(1.5) + 1e-6  # exact vs H15: within one H15 ratio bound
    multi = multi_tile_gate(exact_backend, causal=True, seqlen_q=512, seqlen_k=512)
    assert multi.passed


def test_shifted_lattice_fails_both():
    single = single_tile_gate(shifted_lattice_backend, h15_backend, seed=1)
    assert not single.passed
    assert (
        abs(single.worst) == pytest.approx(math.log2(1.5), abs=0.05)
        or abs(single.worst) == pytest.approx(math.log2(4 / 3), abs=0.05)
        or abs(single.worst) > 0.3
    )
    multi = multi_tile_gate(shifted_lattice_backend, causal=True, seqlen_q=512, seqlen_k=512)
    assert not multi.passed
    assert multi.deciding.name == "log2(w_hat/w) via LSE"
    assert multi.worst > H15_ENVELOPE[1]


def test_swapped_rows_fail_and_are_located():
    single = single_tile_gate(rows_swapped_backend, h15_backend)
    assert not single.passed
    assert single.where[2] in (10, 20)
    multi = multi_tile_gate(rows_swapped_backend, causal=False, seqlen_q=300, seqlen_k=509, heads_q=2, heads_k=1)
    assert not multi.passed
    assert multi.where[2] in (10, 20)


def test_one_element_one_octave_off_is_named():
    backend = OneOctaveOffBackend(batch=0, head=0, row=77)
    single = single_tile_gate(backend, h15_backend, seed=2)
    assert not single.passed
    assert single.where == (0, 0, 77, backend.col)
    assert single.worst == pytest.approx(1.0, abs=0.1)

    backend = OneOctaveOffBackend(batch=1, head=3, row=300)
    multi = multi_tile_gate(backend, causal=True, seqlen_q=509, seqlen_k=509, batch=2, heads_q=4, heads_k=2)
    assert not multi.passed
    assert multi.where == (1, 3, 300, backend.col)
    assert str(multi).startswith("FAIL multi-tile")
    assert "(1, 3, 300, " in str(multi)


def test_masked_element_written_is_caught():
    def leaks_past_the_mask(q, k, v, causal):
        out, lse = h15_backend(q, k, v, False)  # ignores causal: P nonzero above the diagonal
        return out, lse

    report = single_tile_gate(leaks_past_the_mask, h15_backend)
    assert not report.passed
    failing = [c for c in report.checks if not c.passed]
    assert any(c.name == "masked P = 0" for c in failing)


def test_nan_output_fails():
    def nan_in_one_element(q, k, v, causal):
        out, lse = h15_backend(q, k, v, causal)
        out[0, 5, 0, 2] = math.nan
        return out, lse

    report = single_tile_gate(nan_in_one_element, h15_backend)
    assert not report.passed
    assert report.where[:3] == (0, 0, 5)


# --- the library's reference and the suite ---------------------------------------------------------


@pytest.mark.parametrize("rescale_threshold", [0.0, 8.0])
def test_reference_h15_passes(rescale_threshold):
    reference = _reference_h15_backend(rescale_threshold)
    single = single_tile_gate(reference, h15_backend, seed=7)
    assert single.passed, str(single)
    multi = multi_tile_gate(reference, causal=True, seqlen_q=509, seqlen_k=509, heads_q=2, heads_k=1, seed=7)
    assert multi.passed, "\n" + format_report([multi])
    # Threshold 0 always moves the anchor onto the row max (e* = 0: both views of log2(w_hat/w) agree);
    # threshold 8 keeps stale anchors in some rows, which the row-max view must leave out.
    rowmax_view = next(c for c in multi.checks if c.name == "log2(w_hat/w) via row max")
    stale_rows = int(rowmax_view.note.rsplit(":", 1)[1])
    assert (stale_rows > 0) == (rescale_threshold > 0), rowmax_view.note


def test_run_gates_and_format_report():
    reports = run_gates(exact_backend, h15_backend, seeds=(0,))
    assert all(isinstance(r, GateReport) for r in reports)
    single = [r for r in reports if r.name == "single-tile"]
    multi = [r for r in reports if r.name == "multi-tile"]
    assert single and not any(r.passed for r in single)
    assert multi and all(r.passed for r in multi)
    assert {"causal", "non-causal"} <= {r.setup.split()[1] for r in multi}
    text = format_report(reports, title="exact control", expect_pass=[r.name != "single-tile" for r in reports])
    assert "FAIL (expected)" in text and "UNEXPECTED" not in text


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="dtype"):
        single_tile_gate(h15_backend, h15_backend, dtype="bf16")
    with pytest.raises(ValueError, match="heads_q"):
        multi_tile_gate(h15_backend, causal=True, seqlen_q=64, seqlen_k=64, heads_q=3, heads_k=2)
    with pytest.raises(TypeError, match="causal"):
        multi_tile_gate(h15_backend, causal=1, seqlen_q=64, seqlen_k=64)
    with pytest.raises(ValueError, match="seqlen_k"):
        multi_tile_gate(h15_backend, causal=True, seqlen_q=64, seqlen_k=0)
    with pytest.raises(TypeError, match="backend"):
        single_tile_gate(None, h15_backend)


# --- the FA4 kernel (GPU) ------------------------------------------------------------------------


def _fa4_backend(*args, **kwargs):
    from fa4_rowmax import interface

    return interface.fa4_backend(*args, **kwargs)  # raises when FA4 is not patched: a failure, not a skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rescale_threshold", [0.0, None])
def test_fa4_rowmax_h15_kernel_passes(dtype, rescale_threshold):
    kernel = _fa4_backend("rowmax_h15", rescale_threshold=rescale_threshold)
    reference = _reference_h15_backend()
    single = single_tile_gate(kernel, reference, dtype=dtype, device="cuda")
    assert single.passed, str(single)
    for causal, seqlen_q, seqlen_k, heads_q, heads_k in ((True, 512, 512, 1, 1), (False, 300, 509, 4, 2)):
        multi = multi_tile_gate(
            kernel,
            causal=causal,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            heads_q=heads_q,
            heads_k=heads_k,
            dtype=dtype,
            device="cuda",
        )
        assert multi.passed, "\n" + format_report([multi])


@pytest.mark.gpu
def test_fa4_stock_kernel_is_the_exact_control():
    kernel = _fa4_backend("exact")
    single = single_tile_gate(kernel, _reference_h15_backend(), device="cuda")
    assert not single.passed
    multi = multi_tile_gate(kernel, causal=True, seqlen_q=512, seqlen_k=512, device="cuda")
    assert multi.passed, "\n" + format_report([multi])
