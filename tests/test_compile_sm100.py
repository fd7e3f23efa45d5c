"""SM100 (Blackwell) FA4 kernels with the softmax stage compile to cubin on the CPU; SASS read with cuobjdump.

Each configuration compiles in its own subprocess against private FA4 copies (fa4_rowmax/testing/compile_check.py).
Two matrices run: the small one (modes, beta, serving layouts) with its SASS checks, and the full one (marked slow;
both full matrices take ~12 min on 2 CPUs): dtypes x causal x head dim x GQA/varlen x modes.
"""

import re

import pytest
from compile_helpers import (  # noqa: E402
    DEFAULT_CONFIG,
    assert_every_configuration_compiled,
    assert_full_matrix_passes,
    assert_mufu_count_falls_as_beta_grows,
    assert_serving_layouts_compile_with_h15,
    compile_configs_sm103,
    h15_alu_pair_chains,
    h15_mufu_chains,
    pot_alu_chains,
)
from compile_helpers import (
    ci_report as compile_ci_report,
)
from compile_helpers import (
    result as _result,
)

from fa4_rowmax.testing.sass import mnemonic_counts, sass, split_instruction

ARCH = "sm100"


@pytest.fixture(scope="module")
def ci_report(tmp_path_factory):
    # rowmax_pot joins the CI matrix here for the NaN-row checks (one more compile in the same pool).
    return compile_ci_report(ARCH, tmp_path_factory, extra_configs=(dict(DEFAULT_CONFIG, mode="rowmax_pot"),))


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
    # ...each element gains a clamp (FMNMX) and a shift-add (LEA); the round-add is packed (FADD2).
    assert h15_counts["LEA"] - stock["LEA"] >= 0.9 * stock["MUFU.EX2"]
    assert h15_counts["FMNMX"] > stock["FMNMX"] and h15_counts["FADD2"] > stock["FADD2"]


def test_fp8_h15_compiles(ci_report):
    assert _result(ci_report, mode="rowmax_h15", dtype="fp8", causal=False)["counts"]["UTCQMMA"] > 0


def test_mufu_count_falls_as_beta_grows(ci_report):
    assert_mufu_count_falls_as_beta_grows(ci_report)


# --- Note [NaN rows in the approximate modes on SM100] -------------------------------------------------------

APPROXIMATE = {
    "h15": dict(mode="rowmax_h15"),
    "pot": dict(mode="rowmax_pot"),
    "h15_fp8": dict(mode="rowmax_h15", dtype="fp8", causal=False),
}
SAME_SHAPE_AS_STOCK = ("h15", "pot")  # bf16 causal, as the stock reference


def _reads(operand: str, register: str) -> bool:
    """`R72`, `R72.F32x2.HI_LO` (the pair R72:R73) and `-R72` all read R72."""
    return re.fullmatch(rf"[-|!]*{register}(\.[\w.]+)?\|?", operand) is not None


def _nan_row_weight_sites(instructions: list[str]) -> int:
    """`FMNMX.NAN t, RZ, m` feeding `FFMA d, RZ, t, w` (d = w + max.NaN(m, 0) * 0, `nan_row_weight`; d is w's
    register or, as on sm_103a, another one) whose d then reaches both P (an F2FP conversion) and the row sum
    (an FADD/FADD2) before it is overwritten: the NaN must land in both, or O stays finite."""
    nan_max_of_zero = set()  # registers last written by a max.NaN against 0
    pending: dict[str, set[str]] = {}  # FFMA destination -> the consumers seen so far
    sites = 0
    for instruction in instructions:
        mnemonic, operands = split_instruction(instruction)
        for register, seen in list(pending.items()):
            if any(_reads(operand, register) for operand in operands[1:]):
                seen.update(
                    kind for kind, prefix in (("p", "F2FP"), ("row_sum", "FADD")) if mnemonic.startswith(prefix)
                )
            if seen == {"p", "row_sum"} or (operands and operands[0] == register):
                sites += seen == {"p", "row_sum"}
                del pending[register]
        if mnemonic == "FFMA" and operands[1] == "RZ" and operands[2] in nan_max_of_zero:
            pending[operands[0]] = set()
        if operands and operands[0].startswith("R"):
            nan_max_of_zero.discard(operands[0])
            if mnemonic == "FMNMX.NAN" and "RZ" in operands[1:3]:
                nan_max_of_zero.add(operands[0])
    return sites


def test_a_nan_row_weight_site_must_reach_p_and_the_row_sum():
    """The site finder on hand-written SASS (the shapes seen in sm_100a): P and the row sum both read d."""
    head = ["FMNMX.NAN R3, RZ, R9", "FFMA R72, RZ, R3, R72"]
    p = "F2FP.BF16.F32.PACK_AB R4, R73, R72"
    row_sum = "FADD2 R72, R72.F32x2.HI_LO, R102.F32x2.HI_LO"
    assert _nan_row_weight_sites(head + [p, row_sum]) == 1
    assert _nan_row_weight_sites(head + [p, "MOV R72, RZ", row_sum]) == 0  # overwritten before the row sum
    assert _nan_row_weight_sites(head + [row_sum]) == 0  # P never sees it
    assert _nan_row_weight_sites(head[:1] + ["FMNMX R3, RZ, R9", head[1], p, row_sum]) == 0  # NaN-quiet max


@pytest.mark.parametrize("name", list(APPROXIMATE))
def test_approximate_modes_take_a_nan_propagating_row_max(ci_report, name):
    """Every 2- and 3-input max is `.NAN` (the clamps are FMNMX.FTZ against a constant), and the 3-input tree is
    stock's, one FMNMX3.NAN for each stock FMNMX3."""
    counts = mnemonic_counts(sass(ci_report, _result(ci_report, **APPROXIMATE[name])))
    assert counts["FMNMX3"] == 0 and counts["FMNMX"] == 0, counts
    assert counts["FMNMX3.NAN"] > 0
    if name in SAME_SHAPE_AS_STOCK:
        assert counts["FMNMX3.NAN"] == mnemonic_counts(sass(ci_report, ci_report["stock"]))["FMNMX3"]


@pytest.mark.parametrize("name", list(APPROXIMATE))
def test_a_nan_row_max_reaches_the_first_weight_of_each_tile(ci_report, name):
    """One max.NaN and one FFMA per row-max site, the only FFMAs added to stock's."""
    instructions = sass(ci_report, _result(ci_report, **APPROXIMATE[name]))
    counts = mnemonic_counts(instructions)
    sites = _nan_row_weight_sites(instructions)
    assert sites >= 1
    nan_max_of_zero = sum(
        mnemonic == "FMNMX.NAN" and "RZ" in operands[1:3] for mnemonic, operands in map(split_instruction, instructions)
    )
    assert nan_max_of_zero == sites
    if name in SAME_SHAPE_AS_STOCK:
        assert counts["FFMA"] - mnemonic_counts(sass(ci_report, ci_report["stock"]))["FFMA"] == sites


def test_exact_keeps_stocks_nan_quiet_row_max(ci_report):
    """`exact` through our stage (beta=1.0) keeps FA4's max; exp2(NaN) poisons its rows as in stock."""
    for compiled in (_result(ci_report, mode="exact", beta=1.0), ci_report["stock"]):
        counts = mnemonic_counts(sass(ci_report, compiled))
        assert counts["FMNMX3"] > 0 and not [m for m in counts if m.endswith(".NAN")], counts


# --- the per-element instruction pattern (Note [SASS weight chains] in compile_helpers.py) ---------------------

PAIR_SASS = [
    "FFMA2 R72, R10.F32x2.HI_LO, UR4.F32, R0.F32",
    "FMNMX.FTZ R72, R72, -127, !PT",
    "FMNMX.FTZ R73, R73, -127, !PT",
    "FADD2.FTZ R72, R72.F32x2.HI_LO, 6291456",
    "LEA R72, R72, 0x3f800000, 0x16",
    "LEA R73, R73, 0x3f800000, 0x16",
    "F2FP.BF16.F32.PACK_AB R4, R73, R72",
    "FADD2 R100, R72.F32x2.HI_LO, R100.F32x2.HI_LO",
]


def test_the_chain_finder_on_hand_written_sass():
    """h15_alu_pair as sm_100a shows it: 2 chains; each broken link leaves the LEAs without a chain."""
    assert h15_alu_pair_chains(PAIR_SASS) == (2, 2)
    for k, broken in (
        (1, "FMNMX.FTZ R72, R72, -126, !PT"),
        (2, "FMNMX.FTZ R73, R72, -127, !PT"),
        (3, "FADD2.FTZ R72, R72.F32x2.HI_LO, 12582912"),
        (3, "FADD2.FTZ R72, R74.F32x2.HI_LO, 6291456"),
        (0, "MOV R72, R10"),
    ):
        assert h15_alu_pair_chains(PAIR_SASS[:k] + [broken] + PAIR_SASS[k + 1 :])[0] == 0, broken
    assert h15_alu_pair_chains(PAIR_SASS[:6] + PAIR_SASS[7:]) == (0, 2)  # P never sees the weights
    nan_row = PAIR_SASS[:6] + ["FMNMX.NAN R3, RZ, R9", "FFMA R72, RZ, R3, R72"] + PAIR_SASS[6:]
    assert h15_alu_pair_chains(nan_row) == (2, 2)  # through nan_row_weight's FFMA


def _elements(report) -> int:
    """Weights per kernel of the default shape: the MUFU.EX2 that beta 0 adds to the all-ALU H15 kernel."""
    return (
        _result(report, mode="rowmax_h15", beta=0.0)["counts"]["MUFU.EX2"]
        - _result(report, mode="rowmax_h15")["counts"]["MUFU.EX2"]
    )


def test_every_weight_is_built_by_its_fragment(ci_report):
    """Each approximate configuration's weights, chain by chain: every H15/PoT shift-add or snap heads a complete
    chain from its element's x to P and the row sum, and the chains are as many as the elements (beta 0.5: half
    of them each way), the packed round-add feeding two lanes of two different elements."""
    n = _elements(ci_report)
    assert n >= 256 and n % 4 == 0
    expected = [
        (dict(mode="rowmax_h15"), dict(pair=(n, n), mufu=(0, 0), pot=(0, 0))),
        (dict(mode="rowmax_h15", beta=0.5), dict(pair=(n // 2, n // 2), mufu=(n // 2, n // 2), pot=(0, 0))),
        (dict(mode="rowmax_h15", beta=0.0), dict(pair=(0, 0), mufu=(n, n), pot=(0, 0))),
        (dict(mode="rowmax_pot"), dict(pair=(0, 0), mufu=(0, 0), pot=(n, n))),
    ]
    for config, chains in expected:
        instructions = sass(ci_report, _result(ci_report, **config))
        found = dict(
            pair=h15_alu_pair_chains(instructions), mufu=h15_mufu_chains(instructions), pot=pot_alu_chains(instructions)
        )
        assert found == chains, (config, found)
        assert mnemonic_counts(instructions)["FADD2.FTZ"] * 2 == chains["pair"][0], config


def test_fp8_weights_are_built_by_the_pair_fragment(ci_report):
    """FP8 (non-causal): every weight from h15_alu_pair, into an e4m3 F2FP (SATFINITE.E4M3) and the row sum."""
    instructions = sass(ci_report, _result(ci_report, mode="rowmax_h15", dtype="fp8", causal=False))
    complete, leas = h15_alu_pair_chains(instructions)
    assert complete == leas == 2 * mnemonic_counts(instructions)["FADD2.FTZ"] > 0
    assert any(m.startswith("F2FP.SATFINITE.E4M3") for m in mnemonic_counts(instructions))


# --- SM103 (B300): the row max of unmasked tiles comes from tcgen05.ld.red (LDTM.STAT) -----------------------

LDRED_MAX = "LDTM.STAT.x32.MAX.F32"


@pytest.fixture(scope="module")
def sm103_report(tmp_path_factory):
    # Four compiles (exact, exact through our stage, rowmax_h15, stock); rowmax_pot shares the h15 row-max
    # code (`nan_rows`).
    return compile_configs_sm103(
        [dict(DEFAULT_CONFIG), dict(DEFAULT_CONFIG, mode="exact", beta=1.0), dict(DEFAULT_CONFIG, mode="rowmax_h15")],
        tmp_path_factory,
    )


def test_sm103_exact_compiles_to_the_same_sass_as_stock_fa4(sm103_report):
    """The SASS hash of `exact` equals stock's on sm_103a, where stock's row max comes from a NaN-quiet ld.red."""
    assert_every_configuration_compiled(sm103_report)
    assert sm103_report["checks"]["exact_sass_equals_stock"]
    stock = mnemonic_counts(sass(sm103_report, sm103_report["stock"]))
    assert stock[LDRED_MAX] > 0 and not [m for m in stock if m.endswith(".NAN")], stock


def test_sm103_exact_through_the_stage_keeps_stocks_nan_quiet_ld_red(sm103_report):
    """`exact` with a knob (beta=1.0) runs our stage: its ld.red and row maxima stay stock's NaN-quiet ones."""
    stock = mnemonic_counts(sass(sm103_report, sm103_report["stock"]))
    exact = mnemonic_counts(sass(sm103_report, _result(sm103_report, mode="exact", beta=1.0)))
    assert exact[LDRED_MAX] == stock[LDRED_MAX] > 0 and not [m for m in exact if m.endswith(".NAN")], exact


def test_sm103_approximate_modes_take_a_nan_propagating_ld_red_row_max(sm103_report):
    """rowmax_h15 on sm_103a: every ld.red of stock is `.NAN`, every max that combines its maxima (and the
    software row max of masked tiles) is FMNMX3.NAN/FMNMX.NAN, one FMNMX3.NAN per stock FMNMX3, and the NaN
    reaches the first weight of each tile (Note [NaN rows in the approximate modes on SM100])."""
    assert_every_configuration_compiled(sm103_report)
    stock = mnemonic_counts(sass(sm103_report, sm103_report["stock"]))
    instructions = sass(sm103_report, _result(sm103_report, mode="rowmax_h15"))
    h15 = mnemonic_counts(instructions)
    assert h15[LDRED_MAX] == 0 and h15[LDRED_MAX + ".NAN"] == stock[LDRED_MAX] > 0, h15
    assert h15["FMNMX3"] == 0 and h15["FMNMX"] == 0, h15
    assert h15["FMNMX3.NAN"] == stock["FMNMX3"]
    sites = _nan_row_weight_sites(instructions)
    nan_max_of_zero = sum(
        mnemonic == "FMNMX.NAN" and "RZ" in operands[1:3] for mnemonic, operands in map(split_instruction, instructions)
    )
    assert sites >= 1 and nan_max_of_zero == sites and h15["FFMA"] - stock["FFMA"] == sites


@pytest.mark.slow
def test_full_matrix(tmp_path):
    assert_full_matrix_passes(ARCH, tmp_path)
