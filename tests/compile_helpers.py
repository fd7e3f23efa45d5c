"""What the SM90 and SM100 compile tests share (test_compile_sm90.py, test_compile_sm100.py): the compiled
CI matrix, one configuration's result, and the checks every architecture must pass.

Assertions here are rewritten by pytest (`register_assert_rewrite` in conftest.py).
"""

import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
from fa4_rowmax.stage import compile_check

DEFAULT_CONFIG = compile_check.DEFAULT_CONFIG  # what a configuration not otherwise given compiles with

# The full matrix (dtypes x causal x head dim x GQA/varlen x modes) only on request: it takes about 30 min.
full_matrix_only_on_request = pytest.mark.skipif(
    os.environ.get("FA4_FULL_COMPILE_MATRIX") != "1", reason="opt-in: set FA4_FULL_COMPILE_MATRIX=1 (about 30 min)"
)


def compile_configs(arch: str, configs: list[dict], tmp_path_factory, name: str) -> dict:
    """`configs` (plus stock FA4, last) compiled for `arch`, each in its own subprocess; the cubins stay in
    `report["workdir"]` for `sass`."""
    workdir = tmp_path_factory.mktemp(name)
    return dict(compile_check.check_matrix(arch, configs, workdir), workdir=str(workdir))


def compile_configs_sm103(configs: list[dict], tmp_path_factory, name: str = "sm103") -> dict:
    """`compile_configs` for sm_103a (B300)."""
    return compile_configs("sm103", configs, tmp_path_factory, name)


def ci_report(arch: str, tmp_path_factory, extra_configs: tuple[dict, ...] = ()) -> dict:
    """The CI matrix of `compile_check`, plus `extra_configs` compiled in the same pool."""
    return compile_configs(arch, compile_check.ci_matrix(arch) + list(extra_configs), tmp_path_factory, arch)


def _disassemble(cubin: Path) -> list[str]:
    """The instruction stream as `compile_check.sass_stats` hashes it (addresses and encodings dropped)."""
    sass = subprocess.run([compile_check.cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in sass.splitlines()
            if compile_check._SASS_LINE.search(line)]


def sass(report: dict, compiled: dict) -> list[str]:
    """The SASS instructions of one compiled result of `report` (its cubin found by the hash it reported)."""
    by_hash = report.setdefault("sass_by_sha256", {})
    cubins = iter(sorted(Path(report["workdir"]).glob(f"dump_*/{compiled['cubin']}")))
    while compiled["sass_sha256"] not in by_hash:
        cubin = next(cubins, None)
        assert cubin is not None, f"no {compiled['cubin']} under {report['workdir']} has the reported SASS hash"
        instructions = _disassemble(cubin)
        by_hash[hashlib.sha256("\n".join(instructions).encode()).hexdigest()] = instructions
    return by_hash[compiled["sass_sha256"]]


def split_instruction(instruction: str) -> tuple[str, list[str]]:
    """(mnemonic, operands) of one SASS instruction, its guard predicate (`@P0`) dropped."""
    if instruction.startswith("@"):
        instruction = instruction.split(None, 1)[1]
    mnemonic, _, operands = instruction.partition(" ")
    return mnemonic, [op.strip() for op in operands.split(",") if op.strip()]


def mnemonic_counts(instructions: list[str]) -> Counter:
    """How often each full mnemonic (with its modifiers: `FMNMX3.NAN`, `FMNMX.FTZ`) occurs."""
    return Counter(split_instruction(ins)[0] for ins in instructions)


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
