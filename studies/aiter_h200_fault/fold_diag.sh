#!/usr/bin/env bash
# Which aiter_fused launch faulted on the H200 (2026-12-01, bench/results/h200_2026-12-01_s3/aiter/): the first
# GPU run of test_exp_fold_extreme_scores[late_max] (dot_mode "bf16", tile_n 64, head dim 32, the sm90 launch)
# hit an illegal memory access. A CPU comparison of the sm_90 builds with and without exp_fold found the same
# memory instructions (docs/aiter_matrix_core.md, "The H200 fault"), and the unfolded "bf16" kernel at tile 64 /
# head dim 32 had never run on a GPU either. Each case runs in its own process (the error is sticky) with
# blocking launches, and prints ok with the recoveries or FAIL with the aiter_fused frames:
#   "bf16 0 64" fails too -> not the fold: the bf16 build at this shape (or Triton); then run that case under
#   `compute-sanitizer --tool memcheck` if the machine has it. Only exp_fold=1 fails -> intermittent: repeat it.
#   bash studies/aiter_h200_fault/fold_diag.sh > OUT/aiter_fold_diag.log 2>&1
# CASES="bf16 1 64" picks cases; SANITIZER=PATH runs each under `PATH --tool memcheck` (its report goes to stdout).
CASES=${CASES:-"bf16 0 64|bf16 1 64|bf16 0 32|bf16 1 32|scaled 0 64|scaled 1 64"}
IFS='|' read -ra CASE_LIST <<< "$CASES"
for case in "${CASE_LIST[@]}"; do
  set -- $case
  CUDA_LAUNCH_BLOCKING=1 ${SANITIZER:+$SANITIZER --tool memcheck} ${PYTHON:-python3} -c "
import torch, traceback
from aiter_fused.attention import fused_softmax_attention
from fa4_rowmax.testing.fused_softmax_inputs import adversarial_qkv
device = 'cuda' if torch.cuda.is_available() else 'cpu'
q, k, v, scale = adversarial_qkv('late_max', 320)
q, k, v = (t.bfloat16().to(device) for t in (q, k, v))
try:
    out = fused_softmax_attention(q, k, v, softmax_scale=scale, tile_n=$3, mx_format='mxfp8', dot_mode='$1',
                                  exp_fold=bool($2), return_recoveries=True)
    if device == 'cuda':
        torch.cuda.synchronize()
    print('dot_mode=$1 exp_fold=$2 tile_n=$3: ok, recoveries', out[2].flatten().tolist())
except Exception as error:
    frames = [f'{f.filename.split(chr(47))[-1]}:{f.lineno}' for f in traceback.extract_tb(error.__traceback__)
              if 'aiter_fused' in f.filename]
    print('dot_mode=$1 exp_fold=$2 tile_n=$3: FAIL', type(error).__name__, str(error).splitlines()[0], '| at', frames)
" 2>&1 | if [ -n "${SANITIZER:-}" ]; then grep -v "^$\|Host Frame" | head -40; else grep "dot_mode="; fi
done
