"""SM90 (Hopper) FA4 kernels with the softmax stage compile to cubin on the CPU; SASS read with cuobjdump.

Each configuration compiles in its own subprocess against private FA4 copies (fa4_rowmax/testing/compile_check.py).
Two matrices run: the small one (modes, beta, serving layouts) with its SASS checks, and the full one (marked slow;
both full matrices take ~12 min on 2 CPUs): dtypes x causal x head dim x GQA/varlen x modes.
"""

import numpy as np
import pytest
import torch
from compile_helpers import (  # noqa: E402
    DEFAULT_CONFIG,
    assert_every_configuration_compiled,
    assert_full_matrix_passes,
    assert_mufu_count_falls_as_beta_grows,
    assert_serving_layouts_compile_with_h15,
    compile_configs,
)
from compile_helpers import (
    ci_report as compile_ci_report,
)
from compile_helpers import (
    result as _result,
)

from fa4_rowmax.reference.exp_approx import h15  # noqa: E402
from fa4_rowmax.stage.softmax_base import (  # noqa: E402
    H15_CLAMP,
    H15_FOLD_CLAMP,
    H15_ROUND,
    H15_SNAP_ADD,
    H15_SNAP_MASK,
    off_mufu,
)

ARCH = "sm90"


@pytest.fixture(scope="module")
def ci_report(tmp_path_factory):
    return compile_ci_report(ARCH, tmp_path_factory)


def test_every_configuration_compiles(ci_report):
    assert_every_configuration_compiled(ci_report)


def test_serving_layouts_compile_with_the_h15_stage(ci_report):
    assert_serving_layouts_compile_with_h15(ci_report, ARCH)


def test_exact_compiles_to_the_same_sass_as_stock_fa4(ci_report):
    assert ci_report["checks"]["exact_sass_equals_stock"]


def test_h15_moves_the_exponential_off_the_mufu(ci_report):
    stock = ci_report["stock"]["counts"]
    h15_counts = _result(ci_report, mode="rowmax_h15")["counts"]
    # Only the per-row rescale factors stay on the MUFU; every element's exp2 leaves it...
    assert h15_counts["MUFU.EX2"] * 10 < stock["MUFU.EX2"]
    # ...and each element gains a clamp (FMNMX), a round-add (FADD) and a shift-add (LEA).
    n_elements = stock["MUFU.EX2"] - h15_counts["MUFU.EX2"]
    assert h15_counts["LEA"] - stock["LEA"] >= 0.9 * n_elements
    assert h15_counts["FMNMX"] - stock["FMNMX"] >= 0.9 * n_elements


def test_mufu_count_falls_as_beta_grows(ci_report):
    assert_mufu_count_falls_as_beta_grows(ci_report)


# The SM90 levers (docs/fa4_notes.md, "Hopper variants"), compiled through rowmax_attn_func.
FOLD = dict(anchor_rounding="half_octave")
LEVER_CONFIGS = [
    dict(DEFAULT_CONFIG, mode="rowmax_h15", levers=FOLD),
    dict(DEFAULT_CONFIG, mode="rowmax_h15", rescale_threshold=8.0, levers=dict(FOLD, rescale_vote=True)),
    dict(DEFAULT_CONFIG, mode="exact", levers=dict(rescale_vote=True)),
]


@pytest.fixture(scope="module")
def lever_report(tmp_path_factory):
    configs = [dict(DEFAULT_CONFIG, mode="rowmax_h15")] + LEVER_CONFIGS
    return compile_configs(ARCH, configs, tmp_path_factory, ARCH + "_levers")


def test_levers_compile(lever_report):
    assert_every_configuration_compiled(lever_report)


def test_folded_h15_drops_the_round_add(lever_report):
    """Note [Folded H15 with a half-octave anchor]: per element FFMA + clamp + LEA; the FADD left is the row sum."""
    stock = lever_report["stock"]["counts"]
    plain = _result(lever_report, mode="rowmax_h15")["counts"]
    folded = _result(lever_report, mode="rowmax_h15", levers=FOLD)["counts"]
    n_elements = stock["MUFU.EX2"] - folded["MUFU.EX2"]
    assert plain["FADD"] - folded["FADD"] >= 0.9 * n_elements
    assert abs(folded["FADD"] - stock["FADD"]) <= 0.1 * n_elements
    assert folded["LEA"] - stock["LEA"] >= 0.9 * n_elements
    assert folded["FFMA"] - stock["FFMA"] <= 0.1 * n_elements


def test_rescale_vote_keeps_the_multiplies_behind_a_branch(lever_report):
    """Note [Warp-vote rescale skip]: the FMULs of rescale_O stay (skipped at run time, not removed)."""
    stock = lever_report["stock"]["counts"]
    voted = _result(lever_report, mode="exact", levers=dict(rescale_vote=True))
    assert voted["counts"]["FMUL"] == stock["FMUL"] and voted["counts"]["MUFU.EX2"] == stock["MUFU.EX2"]
    assert voted["instructions"] > lever_report["stock"]["instructions"]  # the compares, votes and branches


def test_folded_bit_trick_matches_h15_of_the_rounded_anchor():
    """fl32(s * scale_log2 + (C - a)), clamped at C - 127, then (bits << 22) + bits(1.0), is H(s * scale_log2 - a)
    with a the half octave nearest to m * scale_log2."""
    rng = np.random.default_rng(0)
    scale_log2 = np.float32(0.12751743)
    s = np.concatenate([rng.normal(0, 40, 200_000), [-np.inf, -5000.0]]).astype(np.float32)
    for m in np.float32([0.0, 3.3, -17.61, 101.37, 2500.9]):
        addend = np.float32(np.float64(H15_ROUND) - np.float64(m) * np.float64(scale_log2))  # one FFMA
        r = np.float32(s.astype(np.float64) * np.float64(scale_log2) + np.float64(addend))  # one FFMA
        built = (_bits(np.maximum(r, np.float32(H15_FOLD_CLAMP))).astype(np.uint64) << 22) + 0x3F800000
        anchor = np.float64(H15_ROUND) - np.float64(addend)
        assert anchor * 2 == np.round(anchor * 2) and abs(anchor - np.float64(m) * scale_log2) <= 0.25
        # H(x) with the one rounding the FFMA makes: n = round_half_even(2x) of the fp64 value (rounding x to
        # fp32 first would round twice and move ties).
        n = np.round(2.0 * (s.astype(np.float64) * np.float64(scale_log2) - anchor))
        expected = np.where(n >= -254, (np.maximum(n, -254) + 254).astype(np.uint64) << 22, 0).astype(np.uint32)
        assert np.array_equal(built.astype(np.uint32), expected), m


@pytest.mark.slow
def test_full_matrix(tmp_path):
    assert_full_matrix_passes(ARCH, tmp_path)


# --- the instruction sequences' arithmetic, emulated in numpy float32 (no GPU) -----------------------


def _bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def test_mufu_snap_maps_approximate_exp2_onto_the_h15_lattice():
    """Note [H15 through the MUFU]: ex2.approx of Q_half(x), a few ulps off either way, snaps to H(x)."""
    x = np.linspace(-126.0, 20.0, 400_001, dtype=np.float32)
    q = (np.maximum(x, np.float32(H15_CLAMP)) + np.float32(H15_ROUND)) - np.float32(H15_ROUND)  # fp32 rn
    expected = _bits(h15(torch.from_numpy(x)).numpy())
    for ulps in (-3, -1, 0, 1, 3):
        approx = (_bits(np.exp2(q.astype(np.float64)).astype(np.float32)).astype(np.int64) + ulps).astype(np.uint32)
        snapped = ((approx.astype(np.uint64) + H15_SNAP_ADD) & H15_SNAP_MASK).astype(np.uint32)
        assert np.array_equal(snapped, expected), ulps


def test_alu_bit_trick_matches_h15():
    """Note [H15 in fp32 bits]: clamp, fp32 round-add, (bits << 22) + bits(1.0)."""
    x = np.concatenate([np.linspace(-130.0, 30.0, 400_001, dtype=np.float32), np.float32([-np.inf, -127, -126.75])])
    r = np.maximum(x, np.float32(H15_CLAMP)) + np.float32(H15_ROUND)
    built = ((_bits(r).astype(np.uint64) << 22) + 0x3F800000).astype(np.uint32)
    assert np.array_equal(built, _bits(h15(torch.from_numpy(x)).numpy()))


@pytest.mark.parametrize("beta", [0.0, 0.125, 0.25, 0.5, 0.7, 1.0])
def test_beta_picks_an_even_share(beta):
    picks = [off_mufu(i, 64, beta) for i in range(64)]
    assert sum(picks) == int(64 * beta)


# --- the lever knobs on the host side (fa4_rowmax.interface) ----------------------------------------------------


def test_lever_knobs_are_validated_and_keyed():
    from fa4_rowmax.interface import SoftmaxStage, softmax_stage

    with pytest.raises(ValueError, match="anchor_rounding must be one of"):
        softmax_stage("rowmax_h15", anchor_rounding="third_octave")
    with pytest.raises(ValueError, match="rowmax_h15' only"):
        softmax_stage("exact", anchor_rounding="half_octave")
    with pytest.raises(TypeError, match="rescale_vote must be a bool"):
        softmax_stage("rowmax_h15", rescale_vote="yes")
    voted = softmax_stage("exact", rescale_vote=True)
    assert voted is not None and voted.rescale_vote  # exact + vote is a (stock-valued) stage, not stock FA4
    folded = softmax_stage("rowmax_h15", anchor_rounding="half_octave")
    assert folded != softmax_stage("rowmax_h15") and hash(folded) != hash(softmax_stage("rowmax_h15"))
    assert folded.for_kernel(arch=90, q_dtype=torch.bfloat16).anchor_rounding == "half_octave"
    with pytest.raises(ValueError, match="SM90"):
        SoftmaxStage("rowmax_h15", rescale_vote=True).for_kernel(arch=100, q_dtype=torch.bfloat16)
