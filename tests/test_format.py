"""The code stays as `ruff format` (pyproject's [tool.ruff], line length 120) writes it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_tree_is_ruff_formatted():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(ROOT)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
