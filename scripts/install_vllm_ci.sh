#!/usr/bin/env bash
# Install the real vLLM package for the CPU tests of aiter_fused's vLLM backend registration
# (tests/test_aiter_vllm_backend.py), then check that its attention backend registry imports. Idempotent. Called by
# scripts/setup.sh (.ci/run).
# --no-deps: vLLM pins its own torch (0.33.0: torch==2.14.0, this project 2.13.0) and a serving stack the
# registry does not need; vllm.v1.attention.backends.registry imports with none of them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VPY=${VENV_PY:-python3}
VLLM_VERSION=0.33.0
# pip's exit status is kept (pipefail); grep only drops the local-index notes and never fails the pipe.
"$VPY" -m pip install -q --disable-pip-version-check --no-deps -c constraints.txt "vllm==$VLLM_VERSION" 2>&1 \
    | { grep -v "is ignored: it is neither" || true; }
"$VPY" -c "import vllm, vllm.v1.attention.backends.registry as r; print('vllm', vllm.__version__, 'registry:', r.register_backend.__name__)"
