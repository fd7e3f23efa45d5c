"""The process-wide softmax mode: what a patched FA4 call that passes no `softmax_mode` runs.

For engines that call the installed `flash_attn.cute.flash_attn_func` / `flash_attn_varlen_func` with no way to
pass `softmax_mode` (transformers' `flash_attention_4`; SGLang's `fa4` backend runs its own copy of FA4 unless told
to import the installed one: docs/sglang_fa4_rowmax.md):

    FA4_ROWMAX_SOFTMAX_MODE=rowmax_h15 FA4_ROWMAX_RESCALE_THRESHOLD=8 python serve.py

    from fa4_rowmax.process_mode import softmax_mode_scope
    with softmax_mode_scope("rowmax_h15", rescale_threshold=8.0):
        model.generate(...)

`interface.softmax_stage` reads the setting (`resolve`) for every call whose `softmax_mode` is None.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

from fa4_rowmax.config import KERNEL_MODES, check_real

# Note [Process-wide softmax mode]
# The patched FA4's `softmax_mode` defaults to None: the process setting, else "exact". The process setting is the
# innermost open `softmax_mode_scope`, else FA4_ROWMAX_SOFTMAX_MODE with FA4_ROWMAX_RESCALE_THRESHOLD and
# FA4_ROWMAX_BETA, else none.
# - A call that passes softmax_mode takes nothing from the process (softmax_mode="exact" with no knob is stock FA4).
#   A call that leaves it out takes the process mode and knobs; a rescale_threshold or beta it passes wins.
# - Nothing set: the patched FA4 returns no stage before importing fa4_rowmax, so the call is stock FA4 (same
#   compile key, same kernel). For that check patch 0001 holds the variables' names (`_PROCESS_MODE_VARIABLES`).
# - The variables are read at every call that leaves softmax_mode out, so a change to os.environ counts from the
#   next call. A bad value (an empty one included) raises at that call, naming the variable and the accepted
#   values; a knob variable without FA4_ROWMAX_SOFTMAX_MODE is refused (exact with a knob: set it to "exact").
# - The first call under each setting prints one line to stderr: the mode, its knobs and their source.
# - A stage from the process is refused where an explicit one is (untested features, gradients, SM80/SM120, the
#   range rule), and the error names the variable or the scope as the source of the mode.
# - FP8: e4m3 calls on SM90 go to fa4_rowmax.fp8_sm90 and take the process mode like any other call: rowmax_h15
#   runs the FP8 H15 forward; rowmax_pot, which it lacks, and thresholds past FP8's range rule are refused naming
#   the variable. Pass softmax_mode to those calls to run them otherwise.
# - Scopes are process-wide, like the variables: an engine calls attention from threads its caller does not own.
#   The active scope is the most recently entered one still open; leaving a scope (on an exception too) drops it
#   and restores whatever was active beneath. Worker processes see the variables; a scope reaches a child only
#   when forked inside it, so multi-process engines take the variables.
# - The stage is chosen at compile time: a CUDA graph captured under one setting replays that kernel.
VARIABLES = {
    "softmax_mode": "FA4_ROWMAX_SOFTMAX_MODE",
    "rescale_threshold": "FA4_ROWMAX_RESCALE_THRESHOLD",
    "beta": "FA4_ROWMAX_BETA",
}
SCOPE = "fa4_rowmax.process_mode.softmax_mode_scope"
THRESHOLD_ACCEPTED = "a finite number >= 0 (log2 units)"
BETA_ACCEPTED = "a number in [0, 1]"


@dataclass(frozen=True)
class ProcessMode:
    """One process-wide setting: the mode, its knobs (None: the call's, else the architecture's default) and
    whether it comes from the environment variables or a scope."""

    softmax_mode: str
    rescale_threshold: Optional[float] = None
    beta: Optional[float] = None
    from_environment: bool = True

    def source(self, argument: str) -> str:
        """Where `argument` ("softmax_mode", "rescale_threshold", "beta") of this setting comes from."""
        return VARIABLES[argument] if self.from_environment else SCOPE

    def describe(self) -> str:
        sources = sorted({self.source(a) for a in VARIABLES if a == "softmax_mode" or getattr(self, a) is not None})
        return (
            f"softmax_mode={self.softmax_mode!r} (rescale_threshold={self.rescale_threshold}, beta={self.beta}) "
            f"from {', '.join(sources)}"
        )


def _checked_mode(name: str, value, *, or_unset: bool = False) -> str:
    accepted = f"one of {KERNEL_MODES}" + (", or unset" if or_unset else "")
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, {accepted}; got {value!r} ({type(value).__name__})")
    if value not in KERNEL_MODES:
        raise ValueError(f"{name} must be {accepted}; got {value!r}")
    return value


def _number(variable: str, text: str, high: float, accepted: str) -> float:
    """The variable's text as a finite float in [0, high], else ValueError naming it and showing the text."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0.0 <= value <= high):
        raise ValueError(f"{variable} must be {accepted}, or unset; got {text!r}")
    return value


def from_environment(environ: Mapping[str, str] = os.environ) -> Optional[ProcessMode]:
    """The setting of the variables in `environ`, None when none is set; a bad value raises naming its variable."""
    raw = {argument: environ.get(variable) for argument, variable in VARIABLES.items()}
    mode_variable = VARIABLES["softmax_mode"]
    if raw["softmax_mode"] is None:
        knobs = [VARIABLES[a] for a in ("rescale_threshold", "beta") if raw[a] is not None]
        if knobs:
            raise ValueError(
                f"{' and '.join(knobs)} set without {mode_variable}: set {mode_variable} to one of {KERNEL_MODES} "
                f"(exact with a knob: {mode_variable}=exact), or unset {' and '.join(knobs)}"
            )
        return None
    mode = _checked_mode(mode_variable, raw["softmax_mode"], or_unset=True)
    threshold, beta = raw["rescale_threshold"], raw["beta"]
    if threshold is not None:
        threshold = _number(VARIABLES["rescale_threshold"], threshold, math.inf, THRESHOLD_ACCEPTED)
    if beta is not None:
        beta = _number(VARIABLES["beta"], beta, 1.0, BETA_ACCEPTED)
    return ProcessMode(mode, threshold, beta, from_environment=True)


_lock = threading.Lock()
_scopes: list[tuple[object, ProcessMode]] = []  # (entry token, setting), in the order entered
_announced: set[ProcessMode] = set()


@contextmanager
def softmax_mode_scope(
    softmax_mode: str, rescale_threshold: Optional[float] = None, beta: Optional[float] = None
) -> Iterator[ProcessMode]:
    """Run FA4 calls that pass no `softmax_mode` with this one, in every thread, until the block ends (Note
    [Process-wide softmax mode]); over the environment variables, under an inner scope. Arguments are checked
    here, as the patched `flash_attn_func` checks them; `softmax_mode_scope("exact")` runs stock FA4 within."""
    mode = _checked_mode("softmax_mode", softmax_mode)
    if rescale_threshold is not None:
        rescale_threshold = check_real("rescale_threshold", rescale_threshold, 0.0, accepted=THRESHOLD_ACCEPTED)
    if beta is not None:
        beta = check_real("beta", beta, 0.0, 1.0, accepted=f"None or {BETA_ACCEPTED}")
    setting = ProcessMode(mode, rescale_threshold, beta, from_environment=False)
    token = object()
    with _lock:
        _scopes.append((token, setting))
    try:
        yield setting
    finally:
        with _lock:
            _scopes.remove(next(entry for entry in _scopes if entry[0] is token))


def current() -> Optional[ProcessMode]:
    """The active setting: the innermost open scope, else the environment variables, else None."""
    with _lock:
        if _scopes:
            return _scopes[-1][1]
    return from_environment()


def resolve(
    rescale_threshold: Optional[float], beta: Optional[float]
) -> tuple[str, Optional[float], Optional[float], tuple[tuple[str, str], ...]]:
    """(softmax_mode, rescale_threshold, beta, sources) for a call that passes no softmax_mode and these knobs: the
    process setting with the call's knobs over its own, or "exact" and the call's knobs when nothing is set.
    `sources` maps each argument taken from the process to its source. The first call under a setting prints it."""
    setting = current()
    if setting is None:
        return "exact", rescale_threshold, beta, ()
    _announce(setting)
    sources = [("softmax_mode", setting.source("softmax_mode"))]
    if rescale_threshold is None and setting.rescale_threshold is not None:
        rescale_threshold = setting.rescale_threshold
        sources.append(("rescale_threshold", setting.source("rescale_threshold")))
    if beta is None and setting.beta is not None:
        beta = setting.beta
        sources.append(("beta", setting.source("beta")))
    return setting.softmax_mode, rescale_threshold, beta, tuple(sources)


def remedy(source: str) -> str:
    """What an error about a process-wide value from `source` tells the user to do instead."""
    if source == SCOPE:
        return "pass it to this call: an explicit argument wins over the open softmax_mode_scope"
    return f"pass it to this call (an explicit argument wins over {source}), or unset {source}"


def _announce(setting: ProcessMode) -> None:
    with _lock:
        if setting in _announced:
            return
        _announced.add(setting)
    print(f"fa4_rowmax: FA4 calls that pass no softmax_mode run {setting.describe()}", file=sys.stderr, flush=True)
