"""What the SM90 and SM100 compile tests share (test_compile_sm90.py, test_compile_sm100.py): the compiled
CI matrix, one configuration's result, and the checks every architecture must pass.

Assertions here are rewritten by pytest (`register_assert_rewrite` in conftest.py).
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import compile_check  # noqa: E402

DEFAULT_CONFIG = compile_check.DEFAULT_CONFIG  # what a configuration not otherwise given compiles with

# The full matrix (dtypes x causal x head dim x GQA/varlen x modes) only on request: it takes about 30 min.
full_matrix_only_on_request = pytest.mark.skipif(
    os.environ.get("FA4_FULL_COMPILE_MATRIX") != "1", reason="set FA4_FULL_COMPILE_MATRIX=1 (about 30 min)"
)


def compile_configs(arch: str, configs: list[dict], tmp_path_factory, name: str) -> dict:
    """`configs` (plus stock FA4, last) compiled for `arch`, each in its own subprocess."""
    return compile_check.check_matrix(arch, configs, tmp_path_factory.mktemp(name))


def ci_report(arch: str, tmp_path_factory) -> dict:
    return compile_configs(arch, compile_check.ci_matrix(arch), tmp_path_factory, arch)


def result(report: dict, **config) -> dict:
    """The result of `DEFAULT_CONFIG` updated by `config` (stock FA4 excluded)."""
    want = dict(DEFAULT_CONFIG, **config)
    return next(r for r in report["results"][:-1] if r["config"] == want)


def assert_every_configuration_compiled(report: dict) -> None:
    failed = [(r["config"], r.get("error", "")[-600:]) for r in report["results"] if not r["ok"]]
    assert not failed, failed


def assert_mufu_count_falls_as_beta_grows(report: dict) -> None:
    assert report["checks"]["mufu_falls_with_beta_rowmax_h15"]
    ex2 = dict(report["checks"]["mufu_by_beta_rowmax_h15"])
    assert ex2[0.0] >= report["stock"]["counts"]["MUFU.EX2"]  # beta 0: every weight through the MUFU
    assert result(report, mode="exact", beta=1.0)["counts"]["MUFU.EX2"] < ex2[0.5] < ex2[0.0]


def assert_full_matrix_passes(arch: str, tmp_path: Path) -> None:
    report = compile_check.check_matrix(arch, compile_check.full_matrix(arch), tmp_path)
    assert all(v for k, v in report["checks"].items() if not k.startswith("mufu_by_beta")), report["checks"]
