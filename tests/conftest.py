"""Shared test helpers: GPU tests (the `gpu` mark, Note [GPU tests]) skip cleanly when CUDA is absent, and the
strict-skip switch CI turns on.

Note [GPU tests]
One mark gates every GPU test: `@pytest.mark.gpu`, and `@pytest.mark.gpu(arch="sm90")` for a test of one GPU
architecture (`arch` is `sm` + the compute capability, e.g. "sm90" for the H100/H200, "sm100" for the B200). This
conftest applies it. Without CUDA such a test skips with "needs a CUDA GPU (...)". On a GPU of another
architecture (an SM90 test on a B200) it skips with "wrong GPU architecture: ...": a reason the strict rule does
not accept, so a strict run there fails loudly instead of counting the Hopper tests as passed. A run on such a GPU
that means to leave them out selects them out by name: `-m "not gpu(arch='sm90')"`.

Note [Strict skips]
With LOWPREC_STRICT_SKIPS=1 (set by .ci/run), a skipped test fails unless its reason starts with one of
`ALLOWED_SKIP_PREFIXES`: "needs a CUDA GPU" (the GPU tests on a CPU machine) or "opt-in:" (what the README
lists as opt-in: the quality quick slice on a machine set up without `--quality`; CI sets up with it, so in CI only
the GPU tests skip). A missing package or an unpatched FA4 is then a red CI, not a quiet skip counted as a pass.
"needs a CUDA GPU" counts only where there is none: on a machine with CUDA such a skip (a test gated by hand on an
architecture) fails the strict run too.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

HAS_CUDA = torch.cuda.is_available()

# Note [Triton's interpreter on a CPU machine]: Triton reads TRITON_INTERPRET when a kernel is decorated, that is
# when its module is first imported. A test module that imports triton (or aiter_fused.kernel) before the
# interpreter modules set the variable left every interpreter test after it with compiled kernels and CPU
# tensors. Set here, before any test module is collected, the order of the modules no longer matters. The
# compile tests unset it in their subprocesses (the interpreter replaces compilation).
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Note [Persistent defaults under test]: LOWPREC_FP8_PERSISTENT_DEFAULTS=1 runs the suite as if every entry of Note
# [Tuned defaults] (fa4_rowmax/fp8_sm90.py) took the persistent grid (Note [Persistent work tiles]), the check a
# default needs before it becomes one (`bash scripts/h200_session.sh persistentdefaults OUT`, then the step
# `persistentdefaultsgpu`). Unset, nothing changes.
if os.environ.get("LOWPREC_FP8_PERSISTENT_DEFAULTS") == "1":
    from fa4_rowmax import fp8_sm90

    for entries in fp8_sm90.TUNED_DEFAULTS.values():
        for tile_m, knobs in entries.items():
            entries[tile_m] = {**knobs, "persistent": True}
STRICT_SKIPS = os.environ.get("LOWPREC_STRICT_SKIPS") == "1"
ALLOWED_SKIP_PREFIXES = ("needs a CUDA GPU", "opt-in:")

# Parametrise a test over devices with `@pytest.mark.parametrize("device", DEVICES)`:
# the CUDA case carries the `gpu` mark and skips without a GPU.
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


NO_GPU_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False)"
WRONG_GPU_PREFIX = "wrong GPU architecture:"


def gpu_arch() -> str | None:
    """This machine's GPU as the `gpu` mark's `arch` names it ("sm90"), None without CUDA."""
    return "sm{}{}".format(*torch.cuda.get_device_capability()) if HAS_CUDA else None


def gpu_skip_reason(marks, arch: str | None) -> str | None:
    """Why a test with these `gpu` marks does not run on a machine whose GPU is `arch` (None: no CUDA), or None
    when it runs (Note [GPU tests])."""
    marks = list(marks)
    if not marks:
        return None
    if arch is None:
        return NO_GPU_REASON
    wanted = sorted({mark.kwargs["arch"] for mark in marks if "arch" in mark.kwargs})
    if wanted and arch not in wanted:
        return (
            f"{WRONG_GPU_PREFIX} needs {' or '.join(wanted)}, this GPU is {arch}; select such tests out with "
            f"-m \"not gpu(arch='{wanted[0]}')\" (Note [GPU tests] in tests/conftest.py)"
        )
    return None


def pytest_collection_modifyitems(config, items):
    arch = gpu_arch()
    for item in items:
        reason = gpu_skip_reason(item.iter_markers("gpu"), arch)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def strict_skip_allowed(reason: str, has_cuda: bool) -> bool:
    """Whether Note [Strict skips] lets a skip for `reason` stand on a machine with (or without) CUDA."""
    if reason.startswith("needs a CUDA GPU"):
        return not has_cuda
    return reason.startswith(ALLOWED_SKIP_PREFIXES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT_SKIPS and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not strict_skip_allowed(reason, HAS_CUDA):
            report.outcome = "failed"
            report.longrepr = (
                f"strict skips (LOWPREC_STRICT_SKIPS=1, Note [Strict skips] in tests/conftest.py): "
                f"skipped for a reason that is neither a missing GPU (on a machine without CUDA) nor an opt-in suite: "
                f"{reason}"
            )


def pytest_collectreport(report):
    if STRICT_SKIPS and report.skipped:
        reason = _skip_reason(report)
        if not strict_skip_allowed(reason, HAS_CUDA):
            report.outcome = "failed"
            report.longrepr = f"strict skips: module skipped at collection for a reason that is not allowed: {reason}"


# Note [Hypothesis profiles]: the property suites (tests/test_properties*.py) run under a fixed seed and a small
# budget by default, so CI is reproducible and bounded; LOWPREC_HYPOTHESIS_PROFILE=deep turns on a random seed and
# more examples (a nightly-style search; a failure prints the example and the blob to replay it). Each test's own
# budget is scaled by `property_helpers.examples`. No example database: nothing is written to the tree.
PROFILE_ENV = "LOWPREC_HYPOTHESIS_PROFILE"
_quiet_health = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", derandomize=True, database=None, deadline=None, suppress_health_check=_quiet_health)
settings.register_profile(
    "deep", derandomize=False, database=None, deadline=None, print_blob=True, suppress_health_check=_quiet_health
)
_profile = os.environ.get(PROFILE_ENV, "ci")
if _profile not in ("ci", "deep"):
    raise pytest.UsageError(f"{PROFILE_ENV} must be one of ('ci', 'deep'); got {_profile!r}")
settings.load_profile(_profile)

# Helper modules whose asserts should report like a test's.
pytest.register_assert_rewrite("compile_helpers", "property_helpers")
