import dataclasses

import pytest
import torch

from fa4_rowmax.config import MX_FORMATS, SOFTMAX_MODES, SoftmaxConfig


def test_defaults_follow_the_design_table():
    config = SoftmaxConfig()
    assert (config.mode, config.tile_n, config.rescale_threshold, config.max_offset) == ("exact", 128, 0.0, 0.0)
    assert (config.p_dtype, config.anchor, config.pot_k_max, config.beta) == (None, "tile", 20, None)
    assert (config.baps_lambda, config.baps_critical_tiles) == (1, 1)
    assert (config.mx_format, config.recovery_threshold) == ("mxfp8", 8.0)
    assert SOFTMAX_MODES == ("exact", "rowmax_pot", "rowmax_h15", "baps", "fused_softmax")
    assert MX_FORMATS == ("mxfp8", "mxfp6", "mxfp4")


@pytest.mark.parametrize("mode", SOFTMAX_MODES)
def test_every_mode_and_format_is_accepted(mode):
    for fmt in MX_FORMATS:
        assert SoftmaxConfig(mode=mode, mx_format=fmt).mode == mode


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SoftmaxConfig().mode = "baps"


@pytest.mark.parametrize(
    "field, value, error, accepted",
    [
        ("mode", "rowmax", ValueError, "rowmax_h15"),
        ("mode", None, ValueError, "fused_softmax"),
        ("tile_n", 0, ValueError, ">= 1"),
        ("tile_n", 64.0, ValueError, ">= 1"),
        ("tile_m", -1, ValueError, ">= 1"),
        ("rescale_threshold", -0.5, ValueError, ">= 0"),
        ("rescale_threshold", float("nan"), ValueError, ">= 0"),
        ("rescale_threshold", "8", TypeError, "real number"),
        ("max_offset", 0.5, ValueError, "whole number"),
        ("max_offset", float("inf"), ValueError, ">= 0"),
        ("p_dtype", torch.int8, ValueError, "torch.bfloat16"),
        ("p_dtype", "bf16", ValueError, "torch.float8_e4m3fn"),
        ("anchor", "absolute", ValueError, "'tile', 'row'"),
        ("pot_k_max", 127, ValueError, "[0, 126]"),
        ("pot_k_max", 2.5, ValueError, "[0, 126]"),
        ("beta", 1.5, ValueError, "[0.0, 1.0]"),
        ("beta", -0.1, ValueError, "[0.0, 1.0]"),
        ("baps_lambda", 1.5, ValueError, "[0, 15]"),
        ("baps_lambda", -1, ValueError, "[0, 15]"),
        ("baps_lambda", True, TypeError, "[0, 15]"),
        ("baps_critical_tiles", -1, ValueError, ">= 0"),
        ("mx_format", "mxfp5", ValueError, "mxfp6"),
        ("recovery_threshold", -1.0, ValueError, "[0.0, 126.0]"),
        ("recovery_threshold", 127.0, ValueError, "[0.0, 126.0]"),
        ("row_sum", "sum", ValueError, "'fadd', 'mma'"),
    ],
)
def test_bad_field_names_field_and_accepted_values(field, value, error, accepted):
    with pytest.raises(error) as info:
        SoftmaxConfig(**{field: value})
    assert f"SoftmaxConfig.{field}" in str(info.value)
    assert accepted in str(info.value)


def test_fused_softmax_constraints():
    with pytest.raises(ValueError, match=r"SoftmaxConfig.tile_n must be a multiple of 32"):
        SoftmaxConfig(mode="fused_softmax", tile_n=48)
    with pytest.raises(ValueError, match=r"SoftmaxConfig.p_dtype must be None for mode 'fused_softmax'"):
        SoftmaxConfig(mode="fused_softmax", p_dtype=torch.bfloat16)
    assert SoftmaxConfig(mode="exact", tile_n=48, p_dtype=torch.bfloat16).tile_n == 48


@pytest.mark.parametrize("mode", ["baps", "fused_softmax"])
def test_mma_row_sum_only_for_fa4_modes(mode):
    with pytest.raises(ValueError, match=r"SoftmaxConfig.row_sum='mma' applies to modes .*accepted there: 'fadd'"):
        SoftmaxConfig(mode=mode, row_sum="mma")
    assert SoftmaxConfig(mode="exact", row_sum="mma").row_sum == "mma"


@pytest.mark.parametrize("mode", ["baps", "fused_softmax"])
def test_row_anchor_only_for_fa4_modes(mode):
    with pytest.raises(ValueError, match="anchor"):
        SoftmaxConfig(mode=mode, anchor="row")
    assert SoftmaxConfig(mode="rowmax_h15", anchor="row").anchor == "row"


# --- the softmax-stage knobs: one table, one resolution (Note [Softmax-stage knobs]) ------------------------------


def test_every_knob_is_a_stage_field_with_its_default():
    from fa4_rowmax.config import KERNELS, STAGE_KNOBS
    from fa4_rowmax.interface import SoftmaxStage

    fields = {f.name: f.default for f in dataclasses.fields(SoftmaxStage)}
    for name, knob in STAGE_KNOBS.items():
        assert fields[name] == knob.default and knob.default in knob.accepted, name
        assert knob.kernels and set(knob.kernels) <= set(KERNELS), name


def test_a_knob_on_a_kernel_without_it_is_refused_by_name():
    from fa4_rowmax.interface import softmax_stage

    stage = softmax_stage("exact", row_sum="mma")
    with pytest.raises(ValueError, match=r"row_sum='mma' is implemented by the SM90 FP8 forward .* only.*"):
        stage.for_kernel(arch=90, q_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"anchor_rounding='half_octave' is implemented by the SM90 \(Hopper\)"):
        softmax_stage("rowmax_h15", anchor_rounding="half_octave").for_kernel(arch=100, q_dtype=torch.bfloat16)
    assert stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn).row_sum == "mma"


def test_the_fp8_path_resolves_through_fa4_defaults_and_checks_them_at_trace_time():
    """Issue 23 item 1: the SM90 FP8 forward's stage comes from SoftmaxStage.for_kernel (FA4's threshold and
    max_offset rules), and its trace-time hook checks the stock softmax object as the BF16 path does."""
    from types import SimpleNamespace

    from fa4_rowmax.interface import softmax_stage

    stage = softmax_stage("rowmax_h15").for_kernel(arch=90, q_dtype=torch.float8_e4m3fn)
    assert (stage.kernel, stage.rescale_threshold, stage.max_offset, stage.threshold_from_fa4) == (
        "sm90_fp8",
        0.0,
        8,
        True,
    )
    with pytest.raises(AssertionError, match="rescale_threshold 1.0"):
        stage._check_stock_defaults(SimpleNamespace(rescale_threshold=1.0))
    with pytest.raises(AssertionError, match="max_offset 8"):
        stage._check_stock_defaults(SimpleNamespace(max_offset=8))
    stage._check_stock_defaults(SimpleNamespace())  # FA4's SM90 Softmax: no max_offset, threshold 0


# --- issue 25 defect 10: the interface's edges ---------------------------------------------------------------------


def test_a_threshold_beyond_float_range_is_refused_by_name():
    from fa4_rowmax.interface import softmax_stage

    with pytest.raises(ValueError, match=r"rescale_threshold must be None .* >= 0 \(log2 units\), got 1000"):
        softmax_stage("rowmax_h15", 10**400)
    with pytest.raises(ValueError, match=r"beta must be None or a number in \[0, 1\], got 1000"):
        softmax_stage("exact", None, 10**400)
    with pytest.raises(ValueError, match=r"SoftmaxConfig.rescale_threshold must be a finite number >= 0.0"):
        SoftmaxConfig(rescale_threshold=10**400)


def test_an_unsupported_q_dtype_is_refused_with_the_true_list():
    from fa4_rowmax.interface import softmax_stage

    with pytest.raises(ValueError) as info:
        softmax_stage("rowmax_h15").for_kernel(arch=90, q_dtype=torch.float32)
    message = str(info.value)
    assert message.startswith("q_dtype must be one of [") and message.endswith("; got torch.float32")
    accepted = message.split("[", 1)[1].split("]", 1)[0]
    assert "torch.float32" not in accepted and "torch.bfloat16" in accepted and "torch.float8_e4m3fn" in accepted
