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
def test_row_anchor_only_for_fa4_modes(mode):
    with pytest.raises(ValueError, match="anchor"):
        SoftmaxConfig(mode=mode, anchor="row")
    assert SoftmaxConfig(mode="rowmax_h15", anchor="row").anchor == "row"
