#!/usr/bin/env bash
# Install the real AITER Python package (amd-aiter, the only AITER on PyPI) for the CPU tests of the AITER
# override, then check that it imports on this machine through the ROCm stand-ins the tests use
# (tests/aiter_stub/, documented in its README.md). Idempotent. Called by scripts/setup.sh (.ci/run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VPY=${VENV_PY:-python3}
AITER_VERSION=0.1.7.post2.dev18
# amd-aiter declares pybind11, pandas, einops and psutil; its import also needs packaging and a real triton,
# which it does not declare. --no-deps is not used: amd-aiter depends on no torch build.
"$VPY" -m pip install -q --disable-pip-version-check -c constraints.txt "amd-aiter==$AITER_VERSION" \
    pybind11 pandas einops psutil packaging triton
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if "$VPY" tests/aiter_stub/stand_ins.py >"$log" 2>&1; then
    grep "imports through the stand-ins" "$log"
else
    cat "$log"
    echo "install_aiter_ci.sh: amd-aiter $AITER_VERSION does not import through tests/aiter_stub" >&2
    exit 1
fi
