#!/usr/bin/env bash
# One H200 session's checks, one step per device call (docs/measurements.md lists what each produced):
#   bash scripts/h200_session.sh bench OUT   # the shared benchmark's FP8 groups at 8K/16K, head dim 128 first
#   bash scripts/h200_session.sh tests OUT   # the FP8 and FA4/hf GPU tests, the gates job, aiter's scaled-dot tests
#   bash scripts/h200_session.sh aiter OUT   # aiter_fused kernel tests and numerics --quick on the GPU
# Run after the device bundle is staged (../shared/device/README.md); patches FA4 in /tmp/site first.
set -uo pipefail
STEP=$1; OUT=$2
mkdir -p "$OUT"
python3 -m fa4_rowmax.patching apply >/dev/null
case "$STEP" in
  bench)
    python3 -m bench --fp8 --seqlens 8K 16K --map-masks none --max-minutes 4 --out "$OUT" --name h200_fp8_focus \
      --kernels gemm_fp8 fa3_fp8 cudnn_fp8 fa4_stock_bf16 fa3_bf16 fa4_fp8_exact fa4_fp8_exact_n192 \
      fa4_fp8_exact_n192_mma fa4_fp8_h15 fa4_fp8_h15_n192 fa4_fp8_h15_n192_mma fa4_fp8_h15_fold_n192_mma \
      fa4_fp8_exact_noexp_n192 > "$OUT/bench.log" 2>&1
    tail -40 "$OUT/bench.log" ;;
  tests)
    timeout 150 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py tests/test_gates_fp8.py \
      > "$OUT/pytest_gpu_fp8.log" 2>&1; tail -4 "$OUT/pytest_gpu_fp8.log"
    timeout 150 python3 -m pytest -q -rs -m gpu tests/test_fa4_gpu.py tests/test_hf_attention.py tests/test_gates.py \
      > "$OUT/pytest_gpu_fa4.log" 2>&1; tail -4 "$OUT/pytest_gpu_fa4.log"
    timeout 90 python3 -m fa4_rowmax --device cuda --json "$OUT/gates_cuda.json" > "$OUT/gates_cuda.log" 2>&1
    echo "gates job exit status $?"; tail -3 "$OUT/gates_cuda.log"
    timeout 60 python3 -m pytest -q -rs tests/test_aiter_fused_kernel.py -k scaled > "$OUT/pytest_aiter_scaled.log" 2>&1
    tail -3 "$OUT/pytest_aiter_scaled.log" ;;
  aiter)
    python3 -m pytest -q -rs tests/test_aiter_fused_kernel.py tests/test_aiter_quantize.py > "$OUT/pytest_aiter.log" 2>&1
    tail -8 "$OUT/pytest_aiter.log"
    timeout 200 python3 scripts/aiter_fused_numerics.py "$OUT/aiter_numerics" --quick > "$OUT/aiter_numerics.log" 2>&1
    tail -8 "$OUT/aiter_numerics.log" ;;
  *) echo "h200_session.sh: step must be bench, tests or aiter; got '$STEP'" >&2; exit 2 ;;
esac
