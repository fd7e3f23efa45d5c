"""Note [Strict skips] and Note [GPU tests] (tests/conftest.py): under LOWPREC_STRICT_SKIPS=1 a skip fails unless
it is for a missing GPU (on a machine without one) or an opt-in suite; an SM90 test on a GPU of another
architecture skips with a reason the strict rule refuses, unless selected out; without the switch every skip
stays a skip. The machine's GPU is faked by a plugin loaded before the conftest, so every case runs on the CPU."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CASES = """
import pytest

def test_missing_package():
    pytest.skip("some package is not installed")

@pytest.mark.skipif(True, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_gpu_by_hand():
    pass

@pytest.mark.skipif(True, reason="opt-in: set SOMETHING=1")
def test_opt_in():
    pass

@pytest.mark.gpu
def test_any_gpu():
    pass

@pytest.mark.gpu(arch="sm90")
def test_sm90():
    pass

def test_passes():
    pass
"""

# Loaded with -p before the conftest is imported: what torch reports as the GPU (FAKE_GPU="10.0": a B200).
FAKE_GPU = """
import os
import torch

if os.environ.get("FAKE_GPU"):
    capability = tuple(int(x) for x in os.environ["FAKE_GPU"].split("."))
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: capability
"""


def _run(tmp_path: Path, strict: bool, gpu: str | None = None, *options: str) -> tuple[str, str]:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "fake_gpu.py").write_text(FAKE_GPU)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    env = dict(os.environ, LOWPREC_STRICT_SKIPS="1" if strict else "0", PYTHONPATH=str(tmp_path))
    env.pop("FAKE_GPU", None)
    if gpu is not None:
        env["FAKE_GPU"] = gpu
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", "-p", "fake_gpu", *options, "."],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.stdout.strip().splitlines()[-1], proc.stdout


def _outcomes(stdout: str) -> dict[str, str]:
    """test name -> PASSED / FAILED / SKIPPED from pytest -v's one line per test (ERROR counted as FAILED)."""
    outcomes = {}
    for line in stdout.splitlines():
        if line.startswith("test_cases.py::"):
            name, outcome = line.removeprefix("test_cases.py::").split()[:2]
            outcomes[name] = "FAILED" if outcome == "ERROR" else outcome  # a refused skipif fails at setup
    return outcomes


@pytest.mark.parametrize(
    "strict,gpu,expected",
    [
        # a CPU machine: the GPU tests skip for the missing GPU, which strict runs accept
        (True, None, dict(test_missing_package="FAILED", test_gpu_by_hand="SKIPPED", test_any_gpu="SKIPPED")),
        (False, None, dict(test_missing_package="SKIPPED", test_gpu_by_hand="SKIPPED", test_sm90="SKIPPED")),
        # an H200: both GPU tests run; a hand-written "needs a CUDA GPU" skip is refused there
        (True, "9.0", dict(test_any_gpu="PASSED", test_sm90="PASSED", test_gpu_by_hand="FAILED")),
        # a B200: the SM90 test skips for the wrong architecture, which strict runs refuse
        (True, "10.0", dict(test_any_gpu="PASSED", test_sm90="FAILED", test_opt_in="SKIPPED")),
        (False, "10.0", dict(test_any_gpu="PASSED", test_sm90="SKIPPED", test_gpu_by_hand="SKIPPED")),
    ],
)
def test_strict_switch(tmp_path, strict, gpu, expected):
    _, stdout = _run(tmp_path, strict, gpu)
    outcomes = _outcomes(stdout)
    assert {name: outcomes.get(name) for name in expected} == expected, stdout
    assert outcomes.get("test_passes") == "PASSED", stdout
    if gpu == "10.0" and not strict:
        assert "wrong GPU architecture: needs sm90, this GPU is sm100" in stdout


def test_sm90_tests_selected_out_on_another_gpu(tmp_path):
    """On a B200, `-m "not gpu(arch='sm90')"` leaves the SM90 test out: a strict run passes without it."""
    summary, stdout = _run(tmp_path, True, "10.0", "-m", "not gpu(arch='sm90')", "-k", "not missing and not by_hand")
    outcomes = _outcomes(stdout)
    assert "test_sm90" not in outcomes and outcomes["test_any_gpu"] == "PASSED", stdout
    assert "failed" not in summary, stdout
