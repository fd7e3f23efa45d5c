#!/usr/bin/env bash
# The H200 device bundle (../shared/device/prepare.sh, its README) in parts of 32 MiB instead of 48: a 48 MiB part
# plus this work tree (27 MB on 2026-12-04, growing with each session's results) overflows one carry (64 MiB in all).
#   bash scripts/device_bundle.sh hypothesis==6.170.17 sortedcontainers==2.4.0 fa3-fwd==0.0.3           # tests, bench
#   bash scripts/device_bundle.sh --data DIR hypothesis==6.170.17 sortedcontainers==2.4.0 fa3-fwd==0.0.3 \
#     nvidia-cudnn-frontend==1.32.0                     # the peers (DIR holds vLLM 0.26.0's _vllm_fa3_C.abi3.so.xz)
# Same arguments and result as prepare.sh (.dev/s1 .. .dev/sN); it runs a copy of prepare.sh with the part size
# changed and fails if prepare.sh no longer splits at 48 MiB.
set -euo pipefail
SHARED="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../shared/device" && pwd)"
COPY="$(mktemp)"; trap 'rm -f "$COPY"' EXIT
grep -q '^split -b 48M ' "$SHARED/prepare.sh" || { echo "prepare.sh no longer splits at 48M: update $0" >&2; exit 2; }
sed -e 's/^split -b 48M /split -b 32M /' -e "s|^HERE=.*|HERE=\"$SHARED\"|" "$SHARED/prepare.sh" > "$COPY"
bash "$COPY" "$@"
