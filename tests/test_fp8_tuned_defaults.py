"""Note [Tuned defaults] (fa4_rowmax/fp8_sm90.py): the SM90 FP8 forward's unset knobs take the benchmark's fastest
two-level configuration per mode, head dim and mask; a knob the caller passes wins; single-level calls and the
folded anchor are not tuned. On the CPU: the resolution, and that every table entry is a stage the FP8 forward
resolves (knob values accepted, rules between knobs kept)."""

import pytest
import torch

from fa4_rowmax.config import STAGE_KNOBS
from fa4_rowmax.fp8_sm90 import TUNED_DEFAULTS, call_stage


@pytest.mark.parametrize("key", sorted(TUNED_DEFAULTS, key=str))
def test_every_entry_resolves_on_the_fp8_forward(key):
    mode, head_dim, causal = key
    stage = call_stage(mode, head_dim, causal)
    for knob, value in TUNED_DEFAULTS[key].items():
        assert getattr(stage, knob) == value
    resolved = stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn)
    assert resolved.kernel == "sm90_fp8" and resolved.pv_accumulation == "two_level"


def test_the_table_covers_every_mode_head_dim_and_mask():
    assert set(TUNED_DEFAULTS) == {(m, d, c) for m in ("exact", "rowmax_h15") for d in (64, 128) for c in (False, True)}


def test_a_knob_the_caller_passes_wins():
    stage = call_stage("rowmax_h15", 128, False, tile_n=128, row_sum="fadd")
    assert (stage.tile_n, stage.row_sum) == (128, "fadd")
    assert (stage.clamp, stage.intra_wg_overlap) == ("sat", False)  # the rest still tuned


def test_single_level_keeps_the_stock_knobs():
    stage = call_stage("rowmax_h15", 128, True, pv_accumulation="single")
    for knob in ("tile_n", "row_sum", "clamp", "intra_wg_overlap"):
        assert getattr(stage, knob) == STAGE_KNOBS[knob].default, knob


def test_the_folded_anchor_keeps_the_fmnmx_clamp():
    """clamp='sat' needs the exact anchor (Note [Clamp by saturation]); the fold gets the other tuned knobs."""
    stage = call_stage("rowmax_h15", 64, False, anchor_rounding="half_octave")
    assert stage.clamp == "max" and stage.row_sum == "mma" and stage.tile_n == 192
    stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn)


def test_flash_attn_func_gets_the_tuned_stage(monkeypatch):
    """The route of FA4's flash_attn_func (no FP8 knob can be passed there) compiles the tuned stage: checked at the
    config the compile cache is keyed by, with fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4_rowmax import fp8_sm90
    from fa4_rowmax.interface import softmax_stage

    seen = []
    monkeypatch.setattr(fp8_sm90, "_compile", lambda config, *args: seen.append(config) or (lambda *a: None))
    monkeypatch.setattr(fp8_sm90, "_compile_cache", {})
    with FakeTensorMode():
        q = torch.empty(1, 256, 2, 128, dtype=torch.float8_e4m3fn, device="cuda")
        fp8_sm90.fa4_sm90_fp8_forward(
            q, q, q, softmax_scale=None, causal=True, softmax_stage=softmax_stage("rowmax_h15", None, None)
        )
    (config,) = seen
    for knob, value in TUNED_DEFAULTS[("rowmax_h15", 128, True)].items():
        assert getattr(config.stage, knob) == value, knob
