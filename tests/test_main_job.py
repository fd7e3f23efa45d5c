"""python -m fa4_rowmax on the CPU: the reference passes, the exact control fails only the single-tile gate,
and a wrong backend turns the exit status non-zero. No time is asserted (its CPU seconds grew from ~11 to 63 when
CI shared the machine: speed lives in bench/); the subprocess timeout only stops a hang."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fa4_rowmax.__main__ as main_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_job_on_cpu(tmp_path):
    json_path = tmp_path / "gates.json"
    completed = subprocess.run(
        [sys.executable, "-m", "fa4_rowmax", "--device", "cpu", "--json", str(json_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]

    summary = json.loads(json_path.read_text())
    assert summary["device"] == "cpu"
    results = summary["results"]
    subjects = {r["subject"] for r in results}
    assert subjects == {
        "reference rowmax_h15 threshold 0",
        "reference rowmax_h15 threshold 8",
        "reference exact (control)",
    }
    assert all(r["as_expected"] for r in results)
    control_single = [r for r in results if r["subject"].startswith("reference exact") and r["gate"] == "single-tile"]
    assert control_single and all(not r["passed"] and not r["must_pass"] for r in control_single)
    control_multi = [r for r in results if r["subject"].startswith("reference exact") and r["gate"] == "multi-tile"]
    assert control_multi and all(r["passed"] for r in control_multi)
    h15 = [r for r in results if "rowmax_h15" in r["subject"]]
    assert h15 and all(r["passed"] and r["must_pass"] for r in h15)
    paper_gate = [r for r in results if "causal 512x512 b1 h1/1" in r["setup"] and r["gate"] == "multi-tile"]
    assert paper_gate and all(r["checks"][0]["n_elements"] == 131_328 for r in paper_gate)
    assert {r["setup"].split()[1] for r in results if r["gate"] == "multi-tile"} == {"causal", "non-causal"}

    assert "FAIL (expected)" in completed.stdout
    assert f"all {len(results)} gates gave what they must" in completed.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused():
    completed = subprocess.run(
        [sys.executable, "-m", "fa4_rowmax", "--device", "cuda"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 2
    assert "--device cuda" in completed.stderr


def test_wrong_backend_gives_exit_status_1(monkeypatch, tmp_path, capsys):
    # The exact reference labelled as Rowmax-H15: the single-tile gate fails where it must pass.
    exact_as_h15 = main_job.Subject("exact labelled as rowmax_h15", main_job._reference_backend("exact"), is_h15=True)
    monkeypatch.setattr(main_job, "_reference_subjects", lambda: [exact_as_h15])
    status = main_job.main(["--device", "cpu", "--seeds", "0", "--json", str(tmp_path / "g.json")])
    assert status == 1
    out = capsys.readouterr().out
    assert "UNEXPECTED: exact labelled as rowmax_h15 single-tile" in out


def test_control_that_passes_single_tile_gives_exit_status_1(monkeypatch, capsys):
    # An H15 backend presented as the exact control: it passes the single-tile gate it must fail, which
    # would mean the gate cannot tell exact from H15.
    h15_as_control = main_job.Subject(
        "h15 labelled as the exact control", main_job._reference_backend("rowmax_h15"), is_h15=False
    )
    monkeypatch.setattr(main_job, "_reference_subjects", lambda: [h15_as_control])
    assert main_job.main(["--device", "cpu", "--seeds", "0"]) == 1
    assert "PASSED (must fail)" in capsys.readouterr().out


@pytest.mark.parametrize("reference_only, status", [(False, 3), (True, 0)])
def test_a_gpu_run_without_kernels_fails_unless_reference_only(monkeypatch, reference_only, status, capsys):
    # What a GPU machine without the patched FA4 sees (the device and the kernel loader are the stand-ins here;
    # the real GPU path runs on the H200).
    monkeypatch.setattr(main_job, "_resolve_device", lambda parser, device: "cuda")
    monkeypatch.setattr(main_job, "_reference_subjects", lambda: [])
    monkeypatch.setattr(main_job, "_kernel_subjects", lambda: ([], "RuntimeError: FA4 is not patched"))
    argv = ["--device", "cuda"] + (["--reference-only"] if reference_only else [])
    assert main_job.main(argv) == status
    out = capsys.readouterr().out
    assert ("--reference-only" in out) != reference_only


def test_the_main_job_runs_gates_then_no_benchmark_on_a_cpu(capsys):
    from bench import main_job as job

    assert job.main(["--device", "cpu", "--seeds", "0"]) == 0
    assert "benchmark: not run (no GPU in use)" in capsys.readouterr().out
