"""Note [Strict skips] (tests/conftest.py): under LOWPREC_STRICT_SKIPS=1 a skip fails unless it is for a
missing GPU or an opt-in suite; without the switch every skip stays a skip."""

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
def test_gpu():
    pass

@pytest.mark.skipif(True, reason="opt-in: set SOMETHING=1")
def test_opt_in():
    pass

def test_passes():
    pass
"""


def _run(tmp_path: Path, strict: bool) -> str:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    env = dict(os.environ, LOWPREC_STRICT_SKIPS="1" if strict else "0")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("strict,summary", [(True, "1 failed, 1 passed, 2 skipped"), (False, "1 passed, 3 skipped")])
def test_strict_switch(tmp_path, strict, summary):
    assert _run(tmp_path, strict).startswith(summary)
