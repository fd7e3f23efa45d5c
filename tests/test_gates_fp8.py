"""The gates with FP8 (e4m3) inputs (Note [FP8 inputs in the gates], gates.py): the FP8 reference and a
closed-form model of the SM90 FP8 H15 kernel pass; exact presented as H15, a lattice shifted by one step and
one element off by an octave fail, named. On an SM90 GPU the suite runs through the FP8 kernel itself.

The model is fp64 attention with the kernel's P written out by hand (whole-row anchor, which the single tile
and a threshold-0 schedule share at the row max): P = H(x - m + 8) on the e4m3 lattice, 2^-7 (byte 4) for
H = 1.5 * 2^-7 and 0 below (docs/fp8_sm90.md), the row sum of that same P, BF16 out. It is independent of
the library's reference, which flushes byte 4 to 0: the single-tile gate must accept that one difference.
"""

import dataclasses
import functools
import json
import math

import pytest
import torch
from helpers_emulation import one_thread  # noqa: F401 (a fixture)
from helpers_gates import OneOctaveOffBackend, fp64_scores

import fa4_rowmax.__main__ as main_job
from fa4_rowmax.config import FP8_MAX_OFFSET, FP8_TILE_NS, SoftmaxConfig
from fa4_rowmax.gates.gates import H15_ENVELOPE, format_report, multi_tile_gate, run_gates, single_tile_gate
from fa4_rowmax.gates.readback import read_probabilities
from fa4_rowmax.reference.attention import attention_reference

E4M3 = torch.float8_e4m3fn
E4M3_TINY_LOG2 = -6  # e4m3's smallest normal


def _reference(mode: str):
    config = SoftmaxConfig(mode=mode, p_dtype=E4M3, max_offset=FP8_MAX_OFFSET, tile_n=128)
    return functools.partial(attention_reference, config=config)


def _kernel_model(q, k, v, causal, *, lattice_shift=0, byte4=True, edit_p=None, row_sum=None):
    x, v64 = fp64_scores(q, k, v, causal)
    m = x.amax(dim=-1, keepdim=True)
    n = torch.round(2 * (x - m + FP8_MAX_OFFSET)) + lattice_shift  # half-octave index, ties to even
    n = n.nan_to_num(nan=-1e9, neginf=-1e9)  # masked and empty rows: far below the flush
    h = torch.exp2(torch.floor(n / 2)) * (1 + torch.remainder(n, 2) / 2)
    byte4_value = 2.0 ** (E4M3_TINY_LOG2 - 1) if byte4 else 0.0
    p = torch.where(n >= 2 * E4M3_TINY_LOG2, h, torch.where(n == 2 * E4M3_TINY_LOG2 - 1, byte4_value, 0.0))
    if edit_p is not None:
        p = edit_p(p)
    total = p.sum(dim=-1, keepdim=True) if row_sum is None else row_sum(p)
    normalised = torch.where(total > 0, p / total, 0.0)
    lse = torch.where(total > 0, total.log() + (m - FP8_MAX_OFFSET) * math.log(2), -math.inf).squeeze(-1)
    out = (normalised @ v64).permute(0, 2, 1, 3).to(torch.bfloat16)
    return out, lse.to(torch.float32)


class OneOctaveOffModel(OneOctaveOffBackend):
    """The FP8 kernel model with one weight doubled (helpers_gates.OneOctaveOffBackend's edit on this model)."""

    def __call__(self, q, k, v, causal):
        return _kernel_model(q, k, v, causal, edit_p=self._double_one)


def _note_count(note: str, label: str) -> int:
    return int(note.split(label + ": ")[1].split(";")[0].split(" ")[0].rstrip(","))


# --- correct backends pass -------------------------------------------------------------------------


def test_fp8_reference_passes_every_gate():
    reference = main_job._fp8_reference_backend()  # the one `python -m fa4_rowmax` gates the FP8 kernel against
    assert reference.keywords["config"] == _reference("rowmax_h15").keywords["config"]
    reports = run_gates(reference, reference, dtype=E4M3, seeds=(0,))
    assert all(r.passed for r in reports), "\n" + format_report(reports)
    assert {r.setup.split()[0] for r in reports} == {"float8_e4m3fn"}
    paper = next(r for r in reports if r.name == "multi-tile" and "causal 512x512 b1 h1/1" in r.setup)
    assert paper.n_elements == 131_328
    # q_std 3 spreads scores over ~4 octaves each way: many weights lie below e4m3 P's normal range, counted.
    assert _note_count(paper.checks[0].note, "below P's normal range") > 1000, paper.checks[0].note


def test_kernel_model_differs_from_the_reference_only_on_byte4():
    # The premise of the single-tile acceptance: where the model and the reference disagree on P, the
    # reference has 0 and the model 2^-7 of 2^8 (2^-15 of the top weight): byte 4, nowhere else.
    q, k = (
        torch.randn(1, 128, 1, 128, generator=torch.Generator().manual_seed(s), dtype=torch.float64) * std
        for s, std in ((0, 3.0), (1, 1.0))
    )
    q, k = q.to(E4M3), k.to(E4M3)
    model = read_probabilities(_kernel_model, q, k, causal=True)
    reference = read_probabilities(_reference("rowmax_h15"), q, k, causal=True)
    model_weights = model.p / model.p.amax(dim=-1, keepdim=True)
    differs = ~torch.isclose(model.p, reference.p, rtol=2.0**-6, atol=0.0)  # beyond BF16 and row-sum rounding
    assert differs.sum() > 0
    assert (reference.p[differs] == 0).all()
    assert torch.allclose(model_weights[differs], torch.full_like(model_weights[differs], 2.0**-15), rtol=2.0**-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_model_with_byte4_passes_single_tile(seed):
    report = single_tile_gate(_kernel_model, _reference("rowmax_h15"), dtype=E4M3, seed=seed)
    assert report.passed, str(report)
    assert report.n_elements == 8256
    note = report.checks[0].note
    # Evidence for Note [FP8 inputs in the gates]: byte-4 elements exist, and the tolerance (mostly Hopper's FP8
    # score accumulation at q_std 3: 0.17-0.18 octave on seeds 0-2) stays below half H15's smallest lattice step,
    # log2(4/3), so a neighbouring lattice point never passes as a rounding.
    assert _note_count(note, "on the byte-4 point") > 0, note
    assert _note_count(note, "below P's normal range (flushed)") > 100, note
    assert report.bound[1] < math.log2(4 / 3) / 2, note


def test_byte4_is_below_the_floor_but_a_normal_weight_there_fails():
    # Raising the flushed byte-4 elements to 2^-6 (the smallest normal, byte 8) is a wrong kernel: caught.
    def byte8_for_byte4(q, k, v, causal):
        return _kernel_model(q, k, v, causal, edit_p=lambda p: torch.where(p == 2.0**-7, 2.0**-6, p))

    report = single_tile_gate(byte8_for_byte4, _reference("rowmax_h15"), dtype=E4M3, seed=0)
    assert not report.passed
    assert report.worst >= 0.5 - 0.05


def test_kernel_model_passes_multi_tile_and_so_does_fp8_exact():
    for backend in (_kernel_model, _reference("exact")):
        report = multi_tile_gate(backend, causal=True, seqlen_q=512, seqlen_k=512, dtype=E4M3, seed=3)
        assert report.passed, "\n" + format_report([report])


# --- wrong backends fail, and say where ------------------------------------------------------------


def test_fp8_exact_presented_as_h15_fails_single_tile_only():
    reports = run_gates(_reference("exact"), _reference("rowmax_h15"), dtype=E4M3, seeds=(0,))
    single = [r for r in reports if r.name == "single-tile"]
    multi = [r for r in reports if r.name == "multi-tile"]
    assert single and not any(r.passed for r in single)
    assert 0.1 < abs(single[0].worst) <= math.log2(1.5) + 0.1
    assert multi and all(r.passed for r in multi), "\n" + format_report(multi)


def test_fp8_shifted_lattice_fails_both():
    shifted = functools.partial(_kernel_model, lattice_shift=1)
    single = single_tile_gate(shifted, _reference("rowmax_h15"), dtype=E4M3, seed=1)
    assert not single.passed
    assert abs(single.worst) > 0.3
    multi = multi_tile_gate(shifted, causal=True, seqlen_q=512, seqlen_k=512, dtype=E4M3)
    assert not multi.passed
    assert multi.deciding.name == "log2(w_hat/w) via LSE"
    assert multi.worst > H15_ENVELOPE[1]


def test_fp8_one_element_one_octave_off_is_named():
    backend = OneOctaveOffModel(batch=0, head=0, row=77)
    single = single_tile_gate(backend, _reference("rowmax_h15"), dtype=E4M3, seed=2)
    assert not single.passed
    assert single.where == (0, 0, 77, backend.col)
    assert single.worst == pytest.approx(1.0, abs=0.1)

    backend = OneOctaveOffModel(batch=1, head=3, row=300)
    multi = multi_tile_gate(backend, causal=True, seqlen_q=509, seqlen_k=509, batch=2, heads_q=4, heads_k=2, dtype=E4M3)
    assert not multi.passed
    assert multi.where == (1, 3, 300, backend.col)


# --- python -m fa4_rowmax on an SM90 GPU (stand-ins on the CPU) -----------------------------------


@pytest.mark.parametrize("control_as_h15, status", [(False, 0), (True, 1)])
def test_main_gates_fp8_subjects_in_e4m3_only(monkeypatch, tmp_path, control_as_h15, status):
    # The FP8 subjects are the references standing in for `fp8_backend`; the real kernels run on the H200.
    subjects = [
        main_job.Subject("SM90 FP8 rowmax_h15", _reference("rowmax_h15"), True),
        main_job.Subject("SM90 FP8 exact (control)", _reference("exact"), control_as_h15),
    ]
    monkeypatch.setattr(main_job, "_reference_subjects", lambda: [])
    monkeypatch.setattr(main_job, "_kernel_subjects", lambda: ([], None))
    monkeypatch.setattr(main_job, "_is_sm90", lambda: True)
    monkeypatch.setattr(main_job, "_fp8_kernel_subjects", lambda: (subjects, None))
    # The job takes its GPU branch; the gates themselves run on the CPU.
    monkeypatch.setattr(main_job, "_resolve_device", lambda parser, device: "cuda")
    monkeypatch.setattr(main_job, "run_gates", functools.partial(_run_gates_on_cpu, main_job.run_gates))
    json_path = tmp_path / "gates.json"
    assert main_job.main(["--device", "cuda", "--seeds", "0", "--json", str(json_path)]) == status
    summary = json.loads(json_path.read_text())
    assert summary["fp8_kernel"] == "available"
    results = summary["results"]
    assert {r["subject"] for r in results} == {s.label for s in subjects}
    assert {r["dtype"] for r in results} == {"float8_e4m3fn"}
    control_single = [r for r in results if "exact" in r["subject"] and r["gate"] == "single-tile"]
    assert control_single and not any(r["passed"] for r in control_single)


def _run_gates_on_cpu(run_gates, backend, reference, *, dtype, device, seeds):
    return run_gates(backend, reference, dtype=dtype, device="cpu", seeds=seeds)


# --- the SM90 FP8 kernel (GPU) ---------------------------------------------------------------------


@pytest.mark.gpu(arch="sm90")
def test_fp8_kernel_h15_passes_and_exact_is_the_control():
    from fa4_rowmax.fp8_sm90 import fp8_backend

    reference = _reference("rowmax_h15")
    h15 = run_gates(fp8_backend("rowmax_h15"), reference, dtype=E4M3, device="cuda", seeds=(0, 1))
    assert all(r.passed for r in h15), "\n" + format_report(h15)
    exact = run_gates(fp8_backend("exact"), reference, dtype=E4M3, device="cuda", seeds=(0, 1))
    expect = [r.name != "single-tile" for r in exact]
    assert [r.passed for r in exact] == expect, "\n" + format_report(exact, expect_pass=expect)


# --- Hopper's FP8 accumulation (Note [FP8 inputs in the gates], Note [Hopper FP8 accumulation]) --------------


def _hopper_reference(mode: str):
    """The FP8 reference with its score GEMM by Hopper's e4m3 wgmma rule (the reference's emulated accumulator,
    13 fraction bits, Q K^T only): a model of the SM90 FP8 kernel's scores."""
    config = SoftmaxConfig(
        mode=mode,
        p_dtype=E4M3,
        max_offset=FP8_MAX_OFFSET,
        tile_n=128,
        accumulator_mantissa_bits=13,
        accumulator_gemms="qk",
    )
    return functools.partial(attention_reference, config=config)


def test_the_score_bound_covers_hopper_accumulation_on_the_gate_inputs_and_the_older_model_does_not():
    # The gate's own single-tile inputs (seed 0, q_std 3): the rule's scores stay within the bound the gates
    # now use, and leave the older 2^-13 sum |q k| model on some scores.
    from fa4_rowmax.gates.gates import _log2_scores, _random_qk
    from fa4_rowmax.reference.mma_accumulator import emulated_matmul

    q, k = _random_qk(1, 128, 128, 1, 1, 128, E4M3, "cpu", 0, 3.0)
    x, x_error = _log2_scores(q, k)
    scale_log2 = 128**-0.5 * math.log2(math.e)
    q64, k64 = q.double()[0, :, 0], k.double()[0, :, 0]
    hopper = emulated_matmul(q64.float(), k64.float(), 13, -6, -6).double() * scale_log2
    err = (hopper - x[0, 0]).abs()
    assert (err <= x_error[0, 0]).all()
    older = 2.0**-13 * (q64.abs() @ k64.abs().T) * scale_log2
    assert (err > older).any(), float((err / older).max())


@pytest.mark.parametrize("mode", ["rowmax_h15", "exact"])
def test_reference_with_hopper_accumulation_passes_the_gates(mode):
    # A backend whose scores carry Hopper's FP8 accumulation error is a correct kernel: the gates pass it
    # against the plain FP8 reference (single tile: H15 only, its subject).
    if mode == "rowmax_h15":
        report = single_tile_gate(_hopper_reference(mode), _reference(mode), dtype=E4M3, seed=0)
        assert report.passed, str(report)
    report = multi_tile_gate(_hopper_reference(mode), causal=True, seqlen_q=512, seqlen_k=512, dtype=E4M3, seed=3)
    assert report.passed, "\n" + format_report([report])


# --- the FP8 kernel's P V accumulation and MMA row sum (Note [FP8 inputs in the gates]) ---------------------------


def _mma_row_sum(p: torch.Tensor, pv_accumulation: str, tile_n: int = 128) -> torch.Tensor:
    """The row sum as a ones column of Hopper's e4m3 P V wgmma (the reference's emulated accumulator), KV tiles
    last to first as the kernel walks them: single-level (the sum the accumulator input) or two-level (a fresh
    accumulator per tile, promoted by the exactly rounded FFMA; the model's whole-row anchor rescales nothing)."""
    from fa4_rowmax.reference.mma_accumulator import emulated_matmul, fma_fp32

    p32 = p.float()
    total = p32.new_zeros(*p.shape[:-1], 1)
    for start in reversed(range(0, p.shape[-1], tile_n)):
        tile = p32[..., start : start + tile_n]
        ones = torch.ones(*p.shape[:-2], 1, tile.shape[-1])
        if pv_accumulation == "two_level":
            total = fma_fp32(total, torch.ones(()), emulated_matmul(tile, ones, 13, -6, -6))
        else:
            total = emulated_matmul(tile, ones, 13, -6, -6, c=total)
    return total.double()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("pv_accumulation", ["single", "two_level"])
def test_a_kernel_with_the_mma_row_sum_passes_with_its_accumulation(pv_accumulation):
    from fa4_rowmax.gates.gates import Fp8Accumulation
    from fa4_rowmax.gates.tolerances import fp8_pv_sum_error

    accumulation = Fp8Accumulation(row_sum="mma", pv_accumulation=pv_accumulation)
    backend = functools.partial(_kernel_model, row_sum=lambda p: _mma_row_sum(p, pv_accumulation))
    # The emulated row sum is truly short, within the bound the gates charge.
    q, k = (torch.randn(1, 512, 1, 128, generator=torch.Generator().manual_seed(s)) for s in (5, 6))
    x = q.to(E4M3).double()[0, :, 0] @ k.to(E4M3).double()[0, :, 0].T * 128**-0.5 * math.log2(math.e)
    p = torch.exp2(torch.round(2 * (x - x.amax(-1, keepdim=True) + FP8_MAX_OFFSET)) / 2).to(E4M3).double()[None]
    loss = 1 - _mma_row_sum(p, pv_accumulation)[..., 0] / p.sum(-1)
    assert float(loss.min()) >= 0 and float(loss.max()) <= fp8_pv_sum_error(512, pv_accumulation, 128)
    assert float(loss.max()) > 2.0**-16
    single = single_tile_gate(backend, _reference("rowmax_h15"), dtype=E4M3, seed=0, accumulation=accumulation)
    assert single.passed, str(single)
    multi = multi_tile_gate(backend, causal=True, seqlen_q=512, seqlen_k=512, dtype=E4M3, accumulation=accumulation)
    assert multi.passed, "\n" + format_report([multi])
    fadd = multi_tile_gate(_kernel_model, causal=True, seqlen_q=512, seqlen_k=512, dtype=E4M3)
    widening = accumulation.widening_log2(512, 2.0**-4, exact_row_sum=True)
    # The lower end is -log2(1.5) - tol: the MMA row sum's widening, beside the default's (single-level, FADD).
    assert fadd.bound[0] - multi.bound[0] == pytest.approx(widening - Fp8Accumulation().widening_log2(512, 0, True))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("promotion", ["none", "tile"])
def test_one_hot_readback_through_hopper_p_v_passes_the_default(promotion):
    # The reference with Hopper's accumulation in both GEMMs, single- or two-level P V, read back through one-hot V:
    # single-level truncates each rescaled weight at every later tile (Note [FP8 inputs in the gates]), which the
    # default accumulation (single-level) charges; the readback really moves.
    config = _hopper_reference("exact").keywords["config"]
    emulated = functools.partial(
        attention_reference,
        config=dataclasses.replace(config, accumulator_gemms="qk_pv", accumulator_promotion=promotion),
    )
    report = multi_tile_gate(emulated, causal=True, seqlen_q=512, seqlen_k=512, dtype=E4M3, seed=3)
    assert report.passed, "\n" + format_report([report])
    if promotion == "none":
        from fa4_rowmax.gates.gates import _random_qk

        q, k = _random_qk(1, 512, 512, 1, 1, 128, E4M3, "cpu", 3, 3.0)
        moved = read_probabilities(emulated, q, k, causal=True).p
        scores_only = read_probabilities(_hopper_reference("exact"), q, k, causal=True).p
        ratio = (moved / scores_only)[scores_only > 2.0**-100]
        assert float(ratio.min()) < 1 and float(ratio.max()) <= 1 + 2.0**-8  # toward zero, beyond BF16's out


def test_single_level_widening_covers_two_level_for_each_row_sum():
    from fa4_rowmax.gates.gates import Fp8Accumulation

    for row_sum in ("fadd", "mma"):
        for tile_n in FP8_TILE_NS:
            for keys in (1, 127, 128, 129, 512, 2048, 131072):
                single = Fp8Accumulation(row_sum, "single", tile_n).widening_log2(keys, 2.0**-4, True)
                two = Fp8Accumulation(row_sum, "two_level", tile_n).widening_log2(keys, 2.0**-4, True)
                assert single >= two, (row_sum, tile_n, keys)
    assert Fp8Accumulation("fadd", "single", 128).widening_log2(512, 2.0**-4, True) > 0


def test_accumulation_refusals():
    from fa4_rowmax.gates.gates import Fp8Accumulation

    with pytest.raises(ValueError, match=r"row_sum must be one of \('fadd', 'mma'\), got 'gemm'"):
        Fp8Accumulation(row_sum="gemm")
    with pytest.raises(ValueError, match=r"pv_accumulation must be one of \('single', 'two_level'\)"):
        Fp8Accumulation(pv_accumulation="tile")
    with pytest.raises(ValueError, match="tile_n must be a positive int"):
        Fp8Accumulation(tile_n=0)
    with pytest.raises(TypeError, match="accumulation must be None or an Fp8Accumulation"):
        multi_tile_gate(_kernel_model, causal=True, seqlen_q=8, seqlen_k=8, dtype=E4M3, accumulation="mma")
    with pytest.raises(ValueError, match="applies to FP8 inputs"):
        multi_tile_gate(
            _kernel_model,
            causal=True,
            seqlen_q=8,
            seqlen_k=8,
            dtype=torch.bfloat16,
            accumulation=Fp8Accumulation(row_sum="mma"),
        )
