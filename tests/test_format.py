"""The code stays as `ruff format` (pyproject's [tool.ruff], line length 120) writes it, and `ruff check` (the
rules pyproject selects: pycodestyle E and W, pyflakes F, import order I) finds nothing."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_the_tree_passes_ruff(command):
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *command, str(ROOT)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
