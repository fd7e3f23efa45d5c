"""SM100 (Blackwell) FA4 kernels with the softmax stage compile to cubin on the CPU; SASS read with cuobjdump.

Each configuration compiles in its own subprocess against private FA4 copies (scripts/compile_check.py).
The CI matrix is small; FA4_FULL_COMPILE_MATRIX=1 adds the full one (marked slow) (dtypes x causal x head dim x GQA/varlen x modes).
"""

import pytest

pytest.importorskip("flash_attn.cute")
pytest.importorskip("triton")

from compile_helpers import (  # noqa: E402
    assert_every_configuration_compiled,
    assert_full_matrix_passes,
    assert_mufu_count_falls_as_beta_grows,
    ci_report as compile_ci_report,
    full_matrix_only_on_request,
    result as _result,
)

ARCH = "sm100"


@pytest.fixture(scope="module")
def ci_report(tmp_path_factory):
    return compile_ci_report(ARCH, tmp_path_factory)


def test_every_configuration_compiles(ci_report):
    assert_every_configuration_compiled(ci_report)


def test_exact_compiles_to_the_same_sass_as_stock_fa4(ci_report):
    assert ci_report["checks"]["exact_sass_equals_stock"]


def test_h15_moves_the_exponential_off_the_mufu(ci_report):
    stock = ci_report["stock"]["counts"]
    h15_counts = _result(ci_report, mode="rowmax_h15")["counts"]
    # Only the per-row rescale factors stay on the MUFU; every element's exp2 leaves it...
    assert h15_counts["MUFU.EX2"] * 10 < stock["MUFU.EX2"]
    # ...each element gains a clamp (FMNMX) and a shift-add (LEA); the round-add is packed (FADD2).
    assert h15_counts["LEA"] - stock["LEA"] >= 0.9 * stock["MUFU.EX2"]
    assert h15_counts["FMNMX"] > stock["FMNMX"] and h15_counts["FADD2"] > stock["FADD2"]


def test_fp8_h15_compiles(ci_report):
    assert _result(ci_report, mode="rowmax_h15", dtype="fp8", causal=False)["counts"]["UTCQMMA"] > 0


def test_mufu_count_falls_as_beta_grows(ci_report):
    assert_mufu_count_falls_as_beta_grows(ci_report)


@pytest.mark.slow
@full_matrix_only_on_request
def test_full_matrix(tmp_path):
    assert_full_matrix_passes(ARCH, tmp_path)
