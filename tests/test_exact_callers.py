"""Callers in this repo that mean a given softmax mode pass it, so a process-wide mode (Note [Process-wide softmax
mode], fa4_rowmax/process_mode.py) cannot change them: the quality study's FA4 modes (fa4_rowmax.hf), the exact
baseline `exact_bf16p` above all."""

import pytest

from fa4_rowmax import hf, process_mode
from fa4_rowmax.interface import softmax_stage
from fa4_rowmax.process_mode import VARIABLES


@pytest.fixture
def h15_from_the_environment(monkeypatch):
    """FA4_ROWMAX_SOFTMAX_MODE=rowmax_h15 and nothing else; the print-once record starts empty, so this setting
    is new to the module whatever ran before (it keeps no other state between calls)."""
    for variable in VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(process_mode, "_announced", set())
    assert process_mode.current() is None  # no scope left open by another test
    monkeypatch.setenv(VARIABLES["softmax_mode"], "rowmax_h15")
    return monkeypatch


def _stage_of_call(kernel_kwargs: dict):
    """The stage the patched `flash_attn_func(..., **kernel_kwargs)` resolves: its softmax_mode defaults to None
    (patch 0001), unlike `softmax_stage`'s "exact"."""
    return softmax_stage(**{"softmax_mode": None, **kernel_kwargs})


def test_the_exact_baseline_passes_exact_under_a_process_mode(h15_from_the_environment):
    modes = hf._mode_table()  # built under the variable, as a study started with it set would build it
    exact = modes["exact_bf16p"]
    assert exact.kernel == "fa4" and exact.kernel_kwargs == {"softmax_mode": "exact"}
    # What the patched FA4 resolves from these arguments: no stage, i.e. stock FA4. The same call without the
    # argument takes the variable's H15 stage: the variable is live, so an exact baseline without it would be H15.
    assert _stage_of_call(exact.kernel_kwargs) is None
    taken = _stage_of_call({})
    assert taken is not None and taken.mode == "rowmax_h15"


def test_every_fa4_mode_runs_the_same_stage_with_and_without_a_process_mode(h15_from_the_environment):
    fa4_modes = {name: spec for name, spec in hf._mode_table().items() if spec.kernel == "fa4"}
    assert "exact_bf16p" in fa4_modes and len(fa4_modes) > 1
    under_variable = {name: _stage_of_call(spec.kernel_kwargs) for name, spec in fa4_modes.items()}
    h15_from_the_environment.delenv(VARIABLES["softmax_mode"])
    assert process_mode.current() is None
    unset = {name: _stage_of_call(spec.kernel_kwargs) for name, spec in fa4_modes.items()}
    assert under_variable == unset
    assert all("softmax_mode" in spec.kernel_kwargs for spec in fa4_modes.values())
