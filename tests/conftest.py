"""Shared test helpers: GPU tests (`@pytest.mark.gpu`) skip cleanly when CUDA is absent, and the strict-skip
switch CI turns on.

Note [Strict skips]
With LOWPREC_STRICT_SKIPS=1 (set by .ci/run), a skipped test fails unless its reason starts with one of
`ALLOWED_SKIP_PREFIXES`: "needs a CUDA GPU" (the GPU tests on a CPU machine) or "opt-in:" (the suites the
README lists as opt-in, such as the full compile matrix). A missing package, an unpatched FA4 or a missing
asset is then a red CI, not a quiet skip counted as a pass.
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
STRICT_SKIPS = os.environ.get("LOWPREC_STRICT_SKIPS") == "1"
ALLOWED_SKIP_PREFIXES = ("needs a CUDA GPU", "opt-in:")

# Parametrise a test over devices with `@pytest.mark.parametrize("device", DEVICES)`:
# the CUDA case carries the `gpu` mark and skips without a GPU.
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT_SKIPS and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not reason.startswith(ALLOWED_SKIP_PREFIXES):
            report.outcome = "failed"
            report.longrepr = (
                f"strict skips (LOWPREC_STRICT_SKIPS=1, Note [Strict skips] in tests/conftest.py): "
                f"skipped for a reason that is neither a missing GPU nor an opt-in suite: {reason}"
            )


def pytest_collectreport(report):
    if STRICT_SKIPS and report.skipped:
        reason = _skip_reason(report)
        if not reason.startswith(ALLOWED_SKIP_PREFIXES):
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
