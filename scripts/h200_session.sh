#!/usr/bin/env bash
# One H200 session's checks, one step per device call (docs/measurements.md lists what each produced):
#   bash scripts/h200_session.sh bench OUT        # the shared benchmark's FP8 groups at 8K/16K, head dim 128 first
#   bash scripts/h200_session.sh benchlong OUT    # the same kernels at 2K/4K/32K (cut at 4 minutes; --resume continues)
#   bash scripts/h200_session.sh fp8tests OUT     # every FP8 GPU test (SM90 FP8 forward, varlen, gates, hf)
#   bash scripts/h200_session.sh tests OUT        # the FA4 BF16 and hf GPU tests, the gates job
#   bash scripts/h200_session.sh tilemtests OUT   # the GPU tests of tile_m=192 (three consumer warpgroups)
#   bash scripts/h200_session.sh tilem OUT        # the FP8 benchmark's tile_m=192 rows beside the defaults, 8K-32K
#   bash scripts/h200_session.sh defaults OUT     # the FP8 GPU tests through the tuned defaults: the long-row contract,
#                                                 # varlen, the FP8 gates and hf (~3 minutes)
#   bash scripts/h200_session.sh defaultsgpu OUT  # the SM90 FP8 file through them, a call of its own (~7 minutes)
#   bash scripts/h200_session.sh persistentdefaults[gpu] OUT  # the same with the persistent grid in every tuned entry
#   bash scripts/h200_session.sh persistent OUT   # the defaults on FA4's grid and on the persistent one, and the
#                                                 # exp2-deleted probe on each, beside FA3-FP8, 2K-32K (~3 minutes)
#   bash scripts/h200_session.sh counterzero OUT  # the tile counter zeroed by the V^T pre-pass: its GPU tests (the
#                                                 # persistent grid's bit identity from stale counter memory), then
#                                                 # the time a call saves (studies.fp8_sm90.counter_zeroing; ~5 min)
#   bash scripts/h200_session.sh maskedhalf OUT   # the first KV tile's masked half skipped: its GPU tests, then the
#                                                 # tile_m 128 entries with it beside without it and FA3-FP8, 2K-32K
#   bash scripts/h200_session.sh wgepilogue OUT   # each warpgroup's own tile boundary: its GPU tests, then the rows
#                                                 # beside the shared boundary, 2K-16K, with FA3-FP8 (~9 minutes)
#   bash scripts/h200_session.sh nexttests OUT    # the three above together: the GPU tests of all
#                                                 # three, then the counter study (~6 minutes)
#   bash scripts/h200_session.sh nextbench OUT    # H15's rows of all three and their combination
#                                                 # beside FA3-FP8 and the defaults, 8K first, then 4K and 16K (~9 min)
#   bash scripts/h200_session.sh ownlongrows OUT  # the long-row contract under the defaults, then them and H15 at
#                                                 # tile_m 128 on the own boundary beside FA3-FP8, 8K and 32K (~4 min)
#   bash scripts/h200_session.sh ncuboundary OUT  # Nsight Compute at the goal cell (H15, head dim
#                                                 # 128, causal MHA, 8K) under the shared and the own tile boundary,
#                                                 # with studies.fp8_sm90.tile_boundary's table (~3 minutes)
#   bash scripts/h200_session.sh ncupersistent OUT  # Nsight Compute at base clocks: H15 per tile and persistent, head dim
#                                                 # 128 causal GQA and head dim 64 non-causal, 32K (~4 minutes)
#   bash scripts/h200_session.sh ncu192 OUT       # Nsight Compute at 8K non-causal: H15 at two warpgroups (tile 256)
#                                                 # and at the default three (tile 160), the tile_m 192 probe (~4 min)
#   bash scripts/h200_session.sh roundrobin OUT   # three warpgroups under FA4's round-robin scheduler barrier, with its
#                                                 # hand-over and right after the P.V GEMM: GPU tests, then the rows
#                                                 # beside the defaults, 8K-32K (~7 minutes)
#   bash scripts/h200_session.sh exactbeta OUT    # the exact twin's exp2-emulation share at its tuned configurations,
#                                                 # 8K-32K (~4 minutes)
#   bash scripts/h200_session.sh accuracy OUT     # the FP8 accuracy study (bench --fp8-accuracy) under today's defaults,
#                                                 # every peer: the README's accuracy table (~1 minute)
#   bash scripts/h200_session.sh peers OUT        # flash_attn_func's defaults beside FA3-FP8, vLLM's FA3 and cuDNN's FP8,
#                                                 # 2K-32K, head dim 128 and 64: the README's speed table, with the
#                                                 # exp2-deleted probe at the exact twin's defaults (~2 minutes, 40 s
#                                                 # with the kernels compiled); PEERS_EXTRA='row ...' adds rows, e.g.
#                                                 # an entry's earlier knobs, to the same rounds
#   bash scripts/h200_session.sh ostore OUT       # O's tile with and without the row-sum columns (o_store): its GPU
#                                                 # bit-identity tests, then the defaults (head_dim columns) beside
#                                                 # o_store="pv_columns" and the exact twin's earlier head-dim-64 entry
#                                                 # (tile 128, no barrier), with FA3-FP8, 2K-32K (~6 minutes)
#   bash scripts/h200_session.sh tunedtilem OUT   # the defaults at tile_m 128 and 192 (each tiling's tuned entry) beside
#                                                 # flash_attn_func's and FA3-FP8, 2K-32K (~2 minutes)
#   bash scripts/h200_session.sh kvstages OUT     # the GPU tests of tile_m and kv_stages, then the kv_stages rows
#                                                 # beside the defaults and tile_m=192 at two stages, 8K-32K
#   bash scripts/h200_session.sh aiter OUT        # aiter_fused kernel tests, numerics --quick
#   bash scripts/h200_session.sh qualityfp8 OUT   # SmolLM2-135M: the FP8 modes through the kernel and the simulator
#   bash scripts/h200_session.sh qwen05 OUT       # Qwen2.5-0.5B on Austen, 97 blocks, every kernel mode (issue 12)
#   bash scripts/h200_session.sh qwen15k OUT      # Qwen2.5-1.5B, 97 blocks, every kernel mode, kernels only
#   bash scripts/h200_session.sh qwen15c OUT      # Qwen2.5-1.5B, every kernel mode and its simulator twin (>= 32 blocks)
#   bash scripts/h200_session.sh qwen15s OUT      # Qwen2.5-1.5B, the simulator-only modes (>= 32 blocks)
#   bash scripts/h200_session.sh qwen15long OUT   # Qwen2.5-1.5B at 8K blocks: exact vs H15 t0/t8 through FA4;
#                                                 # BAPS restart rates at 2K-16K prefixes of 16K blocks
#   bash scripts/h200_session.sh qwen15xl OUT     # Qwen2.5-1.5B at 16K blocks: exact vs H15 t0/t8 through FA4
#   bash scripts/h200_session.sh qwen15ks OUT     # Qwen2.5-1.5B, FP8 with and without K smoothing, kernel + simulator
#   bash scripts/h200_session.sh qwen05c OUT      # Qwen2.5-0.5B, every kernel mode and its simulator twin
#   bash scripts/h200_session.sh qwen05s OUT      # Qwen2.5-0.5B, the simulator-only modes
#   bash scripts/h200_session.sh qwen05fp8long OUT  # Qwen2.5-0.5B at 2K/16K/32K blocks: the K-smoothed FP8 modes
#                                                 # through the two-level and single-level kernels, each beside its
#                                                 # simulator (issue 22 item 7); ~8 minutes
#   bash scripts/h200_session.sh qwen15fp8long OUT  # the same for Qwen2.5-1.5B, 2K and 16K (LENGTHS=32768: 32K
#                                                 # alone, a call of its own)
# Run after the device bundle is staged (../shared/device/README.md; build it with scripts/device_bundle.sh, which
# takes prepare.sh's arguments); patches FA4 in /tmp/site first. The
# accuracy and peers steps need the fa3-fwd and nvidia-cudnn-frontend wheels and vLLM 0.26.0's FA3 library in the
# data, xz-compressed (`prepare.sh --data DIR fa3-fwd==0.0.3 nvidia-cudnn-frontend==1.32.0`, DIR holding
# _vllm_fa3_C.abi3.so.xz from the vllm-0.26.0 wheel's vllm/vllm_flash_attn/). The
# quality steps read the bundle's data at /tmp/devdata (austen/, qwen2.5-0.5b/model.gguf, qwen2.5-1.5b/model.gguf:
# `prepare.sh --data .cache/quality_device/both gguf==0.19.0`, docs/measurements.md). A device call returns a
# limited number of files: write the steps under one folder and tar it (`cd $OUT && tar czf results.tgz r`).
# Each quality step's --time-budget-s counts scoring only: its timeout leaves ~90 s for the 1.5B's load and
# the kernel compiles; a cut run continues with the same command plus --resume (docs/measurements.md).
set -uo pipefail
STEP=$1; OUT=$2
mkdir -p "$OUT"
# Note [Compiled kernels on disk] (fa4_rowmax/fp8_sm90.py): the FP8 forward's kernels, kept for the next steps on this
# machine (an ignored folder of the tree, which the device keeps between calls while it stays warm).
export LOWPREC_FP8_COMPILE_CACHE=${LOWPREC_FP8_COMPILE_CACHE:-$PWD/.dev/kernels}
python3 -m fa4_rowmax.patching apply >/dev/null
# The FP8 rows both benchmark steps time: peers and ceiling, the exact twin (MUFU, beta shares), H15 with the
# FADD row sum (exact anchor, fold, clamp by saturation), the MMA row sum (refused past 2,048 keys), the probe.
FP8_BENCH_KERNELS="gemm_fp8 fa3_fp8 cudnn_fp8 fa4_stock_bf16 fa3_bf16 fa4_fp8_exact_n192 fa4_fp8_exact_n192_mma \
  fa4_fp8_exact_n192_b0.125 fa4_fp8_exact_n192_b0.25 fa4_fp8_h15_n192 fa4_fp8_h15_fold_n192 fa4_fp8_h15_sat_n192 \
  fa4_fp8_h15_fold_n192_mma fa4_fp8_exact_noexp_n192"
# Qwen2.5-1.5B steps (issue 12): the common options, every mode with a kernel, and RESUME=--resume to continue
# a cut run whose quality_<tag>.json was copied into OUT first.
Q15="--device cuda --text austen --assets-dir /tmp/devdata --model qwen2.5-1.5b --block-size 2048"
Q05="--device cuda --text austen --assets-dir /tmp/devdata --model qwen2.5-0.5b --block-size 2048"
KERNEL_MODES="exact_bf16p rowmax_pot rowmax_h15_t0 rowmax_h15_t8 fused_mxfp8 fused_mxfp6 fused_mxfp4 fused_hybrid \
  exact_fp8 rowmax_h15_fp8"
RESUME=${RESUME:-}  # BUDGET=seconds overrides a qwen step's scoring budget
# Issue 22 item 7: the K-smoothed FP8 modes, two-level and single-level P.V accumulation (fa4_rowmax/hf.py, Note [P.V
# accumulation in the study]), kernel and simulator, one run per block length under OUT/NAME, joined into one table
# (OUT/NAME/lengths.md) by bench.quality.report. fp8_long_step MODEL NAME EXPORT_TIMEOUT SLACK "SIZE BLOCKS BUDGET"...:
# the model is exported once in float32 to /tmp; one process then runs every length in LENGTHS (the FP8 kernels
# compile once, each length loads the export in seconds), each with --time-budget-s BUDGET (B<SIZE>=seconds
# overrides it), all under one timeout of the budgets + SLACK (loads, compiles, the last blocks' overrun). To add
# blocks in a later call: PREVIOUS=<folder holding the cut runs' quality_NAME_<SIZE>.json> RESUME=--resume.
# FP8_ACC_MODES=... narrows the modes (the two-level ones alone rerun the defaults' rows: single-level keeps
# config.STAGE_KNOBS, which the tuned defaults never change).
FP8_ACC_MODES=${FP8_ACC_MODES:-exact_fp8_ksmooth exact_fp8_ksmooth_single_acc rowmax_h15_fp8_ksmooth rowmax_h15_fp8_ksmooth_single_acc}
fp8_long_step() {
  local model=$1 name=$2 export_limit=$3 limit=$4 row size blocks budget calls=()
  shift 4
  local cache=/tmp/quality_cache_$model dir=$OUT/$name
  mkdir -p "$dir"
  if [ -n "${PREVIOUS:-}" ]; then cp "$PREVIOUS"/quality_${name}_*.json "$dir"/; fi
  if [ ! -f "$cache/provenance.json" ]; then
    timeout "$export_limit" python3 -m bench.quality --text austen --assets-dir /tmp/devdata --model "$model" \
      --export "$cache" --export-dtype float32 > "$dir/export.log" 2>&1
    echo "export of $model to $cache: exit status $?"
  fi
  for row in "$@"; do
    read -r size blocks budget <<< "$row"
    case " $LENGTHS " in *" $size "*) ;; *) continue ;; esac
    budget=$(eval echo "\${B$size:-$budget}")
    limit=$((limit + budget))
    calls+=("--device cuda --from-cache $cache --block-size $size --blocks $blocks --compare-kernels \
      --time-budget-s $budget $RESUME --tag ${name}_$size --modes $FP8_ACC_MODES --out $dir")
  done
  timeout "$limit" python3 -c 'import sys; from bench.quality.cli import main; [main(a.split()) for a in sys.argv[1:]]' \
    "${calls[@]}" > "$dir/$name.log" 2>&1
  echo "$LENGTHS-token blocks, one process under ${limit} s: exit status $?"
  python3 -m bench.quality.report "$dir"/quality_${name}_*.json > "$dir/lengths.md" 2>&1
  cat "$dir/lengths.md"
}
# vLLM's FA3 peer (bench/kernels.py, LOWPREC_VLLM_FA3_SO), unpacked from the staged data.
vllm_fa3_library() {
  local packed=/tmp/devdata/_vllm_fa3_C.abi3.so.xz
  if [ ! -f "$packed" ]; then
    echo "warning: $packed is not staged: the vLLM FA3 peer will be reported unavailable" >&2
    return
  fi
  if [ ! -f /tmp/vllm_fa3.so ]; then
    xz -dc "$packed" > /tmp/vllm_fa3.so.part && mv /tmp/vllm_fa3.so.part /tmp/vllm_fa3.so
  fi
  export LOWPREC_VLLM_FA3_SO=/tmp/vllm_fa3.so
}
case "$STEP" in
  accuracy)
    vllm_fa3_library
    timeout 500 python3 -m bench --fp8-accuracy --out "$OUT" --name h200_fp8_accuracy > "$OUT/accuracy.log" 2>&1
    echo "accuracy study: exit status $?"; tail -3 "$OUT/accuracy.log" ;;
  ostore)
    timeout 150 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py tests/test_fp8_sm90_varlen.py \
      -k "o_without_the_row_sum_columns or bit_for_bit" > "$OUT/pytest_o_store.log" 2>&1; tail -2 "$OUT/pytest_o_store.log"
    python3 -m bench --fp8 --seqlens 2K 4K 8K 16K 32K --rounds 5 --max-minutes 4 --out "$OUT" --name h200_fp8_o_store \
      --kernels fa3_fp8 fa4_fp8_func_exact fa4_fp8_func_h15 '*_o_pv_columns' fa4_fp8_exact_mma_m192_n128 \
      > "$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log" ;;
  tunedtilem)
    python3 -m bench --fp8 --seqlens 2K 4K 8K 16K 32K --rounds 5 --max-minutes 4 --out "$OUT" --name h200_fp8_tuned_tile_m \
      --kernels fa3_fp8 fa4_fp8_func_exact fa4_fp8_func_h15 '*_tuned_m*' > "$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log" ;;
  peers)
    # PEERS_EXTRA='row ...' adds rows to the same rounds (e.g. the earlier defaults' knobs beside the new ones)
    vllm_fa3_library
    timeout ${LIMIT:-440} python3 -m bench --fp8 --seqlens 2K 4K 8K 16K 32K --rounds 5 --max-minutes ${MINUTES:-5.5} \
      --out "$OUT" --name h200_fp8_defaults_peers --kernels fa3_fp8 vllm_fa3_fp8 cudnn_fp8 fa4_fp8_func_exact \
      fa4_fp8_func_h15 fa4_fp8_exact_noexp_defaults ${PEERS_EXTRA:-} \
      > "$OUT/bench.log" 2>&1
    echo "peers: exit status $?"; tail -3 "$OUT/bench.log" ;;
  bench)
    python3 -m bench --fp8 --seqlens 8K 16K --map-masks none --max-minutes 4 --out "$OUT" --name h200_fp8_focus \
      --kernels $FP8_BENCH_KERNELS > "$OUT/bench.log" 2>&1
    tail -40 "$OUT/bench.log" ;;
  tilem)
    # issue 22: three consumer warpgroups (tile_m 192, Note [Three consumer warpgroups]) beside the defaults
    python3 -m bench --fp8 --seqlens 8K 16K 32K --rounds 5 --max-minutes 6 --out "$OUT" --name h200_fp8_tile_m \
      --kernels fa3_fp8 fa4_fp8_func_exact fa4_fp8_func_h15 'fa4_fp8_*_m192_n*' fa4_fp8_exact_noexp_mma_n256_nooverlap \
      > "$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log" ;;
  roundrobin)
    # issue 22: do three consumer warpgroups fall into step without a scheduler barrier (Note [Three consumer warpgroups])?
    timeout 300 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py -k "three_warpgroups_and_kv_stages" \
      > "$OUT/pytest_round_robin.log" 2>&1; tail -2 "$OUT/pytest_round_robin.log"
    python3 -m bench --fp8 --seqlens 8K 16K 32K --rounds 5 --max-minutes 5 --out "$OUT" --name h200_fp8_round_robin \
      --kernels fa3_fp8 fa4_fp8_func_exact fa4_fp8_func_h15 fa4_fp8_h15_sat_mma_n256_nooverlap \
      fa4_fp8_h15_sat_mma_m192_n128 fa4_fp8_h15_sat_mma_m192_n160 fa4_fp8_exact_mma_m192_n160 \
      'fa4_fp8_*mma_m192_n???_sb' 'fa4_fp8_*mma_m192_n???_sb_arrive' fa4_fp8_exact_noexp_mma_m192_n128 \
      > "$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log" ;;
  exactbeta)
    # issue 22 goal: the exact twin >= 1.0x FA3-FP8; beta moves a share of its exponentials off the MUFU
    python3 -m bench --fp8 --seqlens 8K 16K 32K --rounds 5 --max-minutes 4 --out "$OUT" --name h200_fp8_exact_beta \
      --kernels fa3_fp8 fa4_fp8_func_exact fa4_fp8_exact_mma_m192_n160 fa4_fp8_exact_mma_m192_n128 \
      fa4_fp8_exact_mma_n256_nooverlap 'fa4_fp8_exact_mma_*_b*' > "$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log" ;;
  ncu192)
    # issue 22: why three consumer warpgroups gained 2 % where the chain model predicted 10-30 %
    # (bench/results/h200_2026-12-03_s12/README.md); the report itself is too large to come back, its pages do
    ncu --profile-from-start off --clock-control none --set full -o "$OUT/m192" python3 -m studies.fp8_sm90.ncu_profile \
      --seqlen 8192 --kernels fa4_fp8_h15_sat_mma_n256_nooverlap fa4_fp8_func_h15 fa4_fp8_exact_noexp_mma_m192_n128 \
      > "$OUT/m192.log" 2>&1; tail -2 "$OUT/m192.log"
    ncu -i "$OUT/m192.ncu-rep" --page details --csv > "$OUT/m192_details.csv"
    ncu -i "$OUT/m192.ncu-rep" --page raw --csv > "$OUT/m192_raw.csv"
    ncu -i "$OUT/m192.ncu-rep" --page source --print-source sass --csv | xz -6 > "$OUT/m192_source.csv.xz"
    rm -f "$OUT/m192.ncu-rep"
    python3 -m studies.fp8_sm90.ncu_report "$OUT/m192_details.csv" "$OUT/m192_source.csv.xz" > "$OUT/loop_split.md" 2>&1
    tail -40 "$OUT/loop_split.md" ;;
  ncuboundary)
    # issue 22: what a work tile's boundary costs at the goal cell, each boundary (Note [Each
    # warpgroup's own tile boundary]): the consumers' barrier waits and first-block GEMM waits a tile, base clocks
    n=boundary_8k
    timeout 300 ncu --profile-from-start off --clock-control base --set full -o "$OUT/$n" python3 -m \
      studies.fp8_sm90.ncu_profile --seqlen 8192 --causal --kernels fa4_fp8_h15_m128_shared_boundary \
      fa4_fp8_h15_m128_own_boundary > "$OUT/$n.log" 2>&1; echo "ncu $n: exit status $?"
    ncu -i "$OUT/$n.ncu-rep" --page details --csv > "$OUT/${n}_details.csv"
    ncu -i "$OUT/$n.ncu-rep" --page source --print-source sass --csv | xz -6 > "$OUT/${n}_source.csv.xz"
    rm -f "$OUT/$n.ncu-rep"
    python3 -m studies.fp8_sm90.tile_boundary "$OUT/${n}_details.csv" "$OUT/${n}_source.csv.xz" \
      > "$OUT/${n}_boundary.md" 2>&1; cat "$OUT/${n}_boundary.md"
    python3 -m studies.fp8_sm90.ncu_report "$OUT/${n}_details.csv" "$OUT/${n}_source.csv.xz" > "$OUT/${n}_loop.md" 2>&1
    tail -30 "$OUT/${n}_loop.md" ;;
  ncupersistent)
    # issue 22: where the persistent grid's extra cycles go (Nsight Compute at base clocks: the seventeenth session's
    # loss is in cycles, not in the power-capped clock): H15's per-tile and persistent rows, head dim 128 causal GQA
    # (three warpgroups) and head dim 64 non-causal, 32K keys
    for c in "causal_gqa:--causal --heads-kv 4" "d64_nc:--head-dim 64"; do
      n=${c%%:*}; a=${c#*:}
      timeout 200 ncu --profile-from-start off --clock-control base --set full -o "$OUT/$n" python3 -m \
        studies.fp8_sm90.ncu_profile --seqlen 32768 $a --kernels fa4_fp8_h15_two_level_per_tile \
        fa4_fp8_h15_two_level_persistent > "$OUT/$n.log" 2>&1; echo "ncu $n: exit status $?"
      ncu -i "$OUT/$n.ncu-rep" --page details --csv > "$OUT/${n}_details.csv"
      ncu -i "$OUT/$n.ncu-rep" --page raw --csv | xz -6 > "$OUT/${n}_raw.csv.xz"
      ncu -i "$OUT/$n.ncu-rep" --page source --print-source sass --csv | xz -6 > "$OUT/${n}_source.csv.xz"
      rm -f "$OUT/$n.ncu-rep"
      python3 -m studies.fp8_sm90.ncu_report "$OUT/${n}_details.csv" "$OUT/${n}_source.csv.xz" > "$OUT/${n}_loop.md" 2>&1
      tail -30 "$OUT/${n}_loop.md"
    done ;;
  defaults)
    # issue 22 item 3: the FP8 GPU tests through Note [Tuned defaults] but test_fp8_sm90_gpu.py (step defaultsgpu, a
    # call of its own: ~390 s with the persistent grid's cases)
    timeout 120 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_long_rows.py > "$OUT/pytest_long_rows.log" 2>&1
    tail -2 "$OUT/pytest_long_rows.log"
    timeout 150 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_varlen.py tests/test_gates_fp8.py tests/test_hf_fp8.py \
      > "$OUT/pytest_gpu_fp8_varlen_gates_hf.log" 2>&1; tail -2 "$OUT/pytest_gpu_fp8_varlen_gates_hf.log" ;;
  defaultsgpu)
    timeout 560 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py -k "not three_warpgroups_and_kv_stages" \
      > "$OUT/pytest_gpu_fp8.log" 2>&1; tail -2 "$OUT/pytest_gpu_fp8.log" ;;
  persistent)
    # issue 22: the dynamic persistent grid (Note [Persistent work tiles]) beside FA4's grid at the direct call's defaults
    timeout 500 python3 -m bench --fp8 --seqlens 2K 4K 8K 16K 32K --rounds 5 --max-minutes 7 --out "$OUT" \
      --name h200_fp8_persistent --kernels fa3_fp8 fa4_fp8_func_exact fa4_fp8_func_h15 fa4_fp8_exact_two_level_per_tile \
      fa4_fp8_exact_two_level_persistent fa4_fp8_h15_two_level_per_tile fa4_fp8_h15_two_level_persistent \
      fa4_fp8_exact_noexp_defaults fa4_fp8_exact_noexp_defaults_per_tile > "$OUT/bench.log" 2>&1
    echo "persistent: exit status $?"; tail -3 "$OUT/bench.log" ;;
  counterzero)
    # issue 22: Note [The counter zeroed by the pre-pass] (v_transpose.py)
    timeout 330 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py -k "persistent_grid_is_bit_identical or \
      v_transpose_prepass" > "$OUT/pytest_counter.log" 2>&1; tail -2 "$OUT/pytest_counter.log"
    timeout 120 python3 -m studies.fp8_sm90.counter_zeroing --json "$OUT/counter_zeroing.json" \
      > "$OUT/counter_zeroing.log" 2>&1; echo "counter_zeroing: exit status $?"; cat "$OUT/counter_zeroing.log" ;;
  maskedhalf)
    # issue 22: the first KV tile's GEMMs over its first half where its second is masked for every row (Note [The masked
    # half of the first KV tile]): its GPU tests (bit identity, the NaN it no longer spreads), then the rows, 2K-32K
    timeout 200 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py -k "masked_half or skipped_half" \
      > "$OUT/pytest_masked_half.log" 2>&1; tail -2 "$OUT/pytest_masked_half.log"
    timeout 380 python3 -m bench --fp8 --seqlens 2K 4K 8K 16K 32K --rounds 5 --max-minutes 5 --out "$OUT" \
      --name h200_fp8_masked_half --kernels fa3_fp8 fa4_fp8_func_exact fa4_fp8_func_h15 '*_tuned_m128' \
      '*_tuned_m128_masked_half' fa4_fp8_exact_noexp_defaults > "$OUT/bench.log" 2>&1
    echo "maskedhalf: exit status $?"; tail -3 "$OUT/bench.log" ;;
  wgepilogue)
    # issue 22: Note [Each warpgroup's own tile boundary] (warpgroup_epilogue="own")
    timeout 200 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py -k "own_tile_boundary" \
      > "$OUT/pytest_wg_epilogue.log" 2>&1; tail -2 "$OUT/pytest_wg_epilogue.log"
    timeout 380 python3 -m bench --fp8 --seqlens 2K 4K 8K 16K --rounds 5 --max-minutes 6 --out "$OUT" \
      --name h200_fp8_wg_epilogue --kernels fa3_fp8 fa4_fp8_func_h15 fa4_fp8_func_exact '*_boundary' \
      > "$OUT/bench.log" 2>&1
    echo "wgepilogue: exit status $?"; tail -3 "$OUT/bench.log" ;;
  nexttests)
    # issue 22: the masked half, each warpgroup's own tile boundary, the counter zeroed by the pre-pass.
    # The own boundary has not run on a GPU before: its small cases first (one CTA with one tile; 3,072 tiles of one
    # KV block each), under a short limit (a barrier that never completes hangs the kernel), the rest only if they pass.
    timeout 120 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py -k "own_tile_boundary and (300 or 512)" \
      > "$OUT/pytest_own_smoke.log" 2>&1
    smoke=$?; tail -2 "$OUT/pytest_own_smoke.log"
    select="masked_half or skipped_half or persistent_grid_is_bit_identical or v_transpose_prepass or own_tile_boundary"
    if [ $smoke -ne 0 ]; then
      echo "own boundary smoke: exit $smoke"; select="($select) and not own_tile_boundary and not own_boundary"
    fi
    timeout 400 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py -k "$select" > "$OUT/pytest_next.log" 2>&1
    tail -2 "$OUT/pytest_next.log"
    timeout 120 python3 -m studies.fp8_sm90.counter_zeroing --json "$OUT/counter_zeroing.json" \
      > "$OUT/counter_zeroing.log" 2>&1; echo "counter_zeroing: exit status $?"; cat "$OUT/counter_zeroing.log" ;;
  nextbench)
    # issue 22: H15 at tile_m 128 with and without each of the two (and both), tile_m 192's
    # boundaries, beside FA3-FP8 and flash_attn_func's defaults (the counter zeroed by the pre-pass in every row)
    for seqlens in 8K "4K 16K"; do
      timeout 270 python3 -m bench --fp8 --seqlens $seqlens --rounds 5 --max-minutes 4 --out "$OUT" \
        --name "h200_fp8_next_${seqlens// /_}" --kernels fa3_fp8 fa4_fp8_func_h15 'fa4_fp8_h15_m*_boundary' \
        'fa4_fp8_h15_m128_*_boundary_masked_half' > "$OUT/bench_${seqlens// /_}.log" 2>&1
      echo "nextbench $seqlens: exit status $?"; tail -3 "$OUT/bench_${seqlens// /_}.log"
    done ;;
  ownlongrows)
    # issue 22: the long-row contract through the defaults with the own boundary, then flash_attn_func's defaults
    # beside FA3-FP8 and H15 at tile_m 128 on the own boundary (non-causal: a second run of that reading) at 8K and 32K
    timeout 110 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_long_rows.py > "$OUT/pytest_long_rows.log" 2>&1
    tail -2 "$OUT/pytest_long_rows.log"
    timeout 130 python3 -m bench --fp8 --seqlens 8K 32K --rounds 5 --max-minutes 1.6 --out "$OUT" \
      --name h200_fp8_defaults_own --kernels fa3_fp8 fa4_fp8_func_exact fa4_fp8_func_h15 fa4_fp8_h15_m128_own_boundary \
      > "$OUT/bench.log" 2>&1
    echo "ownlongrows bench: exit status $?"; tail -3 "$OUT/bench.log" ;;
  persistentdefaults)
    # issue 22: the defaults steps with the persistent grid in every tuned entry (Note [Persistent defaults under test])
    LOWPREC_FP8_PERSISTENT_DEFAULTS=1 bash "$0" defaults "$OUT" ;;
  persistentdefaultsgpu)
    LOWPREC_FP8_PERSISTENT_DEFAULTS=1 bash "$0" defaultsgpu "$OUT" ;;
  kvstages)
    # issue 22: more K/V stages in flight (Note [KV stages in shared memory]) for three warpgroups and tile 192
    timeout 200 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py -k "three_warpgroups_and_kv_stages" \
      > "$OUT/pytest_kv_stages.log" 2>&1; tail -3 "$OUT/pytest_kv_stages.log"
    python3 -m bench --fp8 --seqlens 8K 16K 32K --rounds 5 --max-minutes 5 --out "$OUT" --name h200_fp8_kv_stages \
      --kernels fa3_fp8 fa4_fp8_func_exact fa4_fp8_func_h15 fa4_fp8_h15_sat_mma_m192_n160 fa4_fp8_exact_mma_m192_n160 \
      fa4_fp8_h15_sat_mma_n192_nooverlap \
      'fa4_fp8_*_s[345]' fa4_fp8_exact_noexp_mma_n256_nooverlap fa4_fp8_exact_noexp_mma_m192_n128 \
      > "$OUT/bench.log" 2>&1
    tail -3 "$OUT/bench.log" ;;
  tilemtests)
    timeout 400 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py tests/test_fp8_sm90_varlen.py \
      -k "three_warpgroups or tile_m" > "$OUT/pytest_tile_m.log" 2>&1; tail -6 "$OUT/pytest_tile_m.log" ;;
  tests)
    timeout 240 python3 -m pytest -q -rs -m gpu tests/test_fa4_gpu.py tests/test_hf_attention.py tests/test_gates.py \
      > "$OUT/pytest_gpu_fa4.log" 2>&1; tail -4 "$OUT/pytest_gpu_fa4.log"
    timeout 90 python3 -m fa4_rowmax --device cuda --json "$OUT/gates_cuda.json" > "$OUT/gates_cuda.log" 2>&1
    echo "gates job exit status $?"; tail -3 "$OUT/gates_cuda.log" ;;
  aiter)
    python3 -m pytest -q -rs tests/test_aiter_fused_kernel.py tests/test_aiter_quantize.py > "$OUT/pytest_aiter.log" 2>&1
    tail -8 "$OUT/pytest_aiter.log"
    timeout 200 python3 scripts/aiter_fused_numerics.py "$OUT/aiter_numerics" --quick > "$OUT/aiter_numerics.log" 2>&1
    tail -8 "$OUT/aiter_numerics.log" ;;
  benchlong)
    python3 -m bench --fp8 --seqlens 2K 4K 32K --map-masks none --max-minutes 4 --out "$OUT" --name h200_fp8_long \
      --kernels $FP8_BENCH_KERNELS > "$OUT/bench_long.log" 2>&1
    tail -30 "$OUT/bench_long.log" ;;
  fp8tests)
    timeout 180 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_varlen.py tests/test_gates_fp8.py tests/test_hf_fp8.py \
      > "$OUT/pytest_gpu_fp8_varlen_gates_hf.log" 2>&1; tail -6 "$OUT/pytest_gpu_fp8_varlen_gates_hf.log"
    timeout 360 python3 -m pytest -q -rs -m gpu tests/test_fp8_sm90_gpu.py > "$OUT/pytest_gpu_fp8.log" 2>&1
    tail -6 "$OUT/pytest_gpu_fp8.log" ;;
  qualityfp8)
    timeout 280 python3 -m bench.quality --device cuda --compare-kernels --text-dir /tmp/devdata/python-doc \
      --blocks 16 --block-size 2048 --modes exact_bf16p exact_fp8 rowmax_h15_fp8 --time-budget-s 220 \
      --tag kernels_fp8 --out "$OUT" > "$OUT/quality_fp8.log" 2>&1; tail -12 "$OUT/quality_fp8.log" ;;
  qwen05)
    timeout 560 python3 -m bench.quality --device cuda --text austen --assets-dir /tmp/devdata --model qwen2.5-0.5b \
      --block-size 2048 --blocks 97 --kernels-only --time-budget-s 480 --tag qwen25-05b_austen_kernels_only \
      --modes exact_bf16p rowmax_pot rowmax_h15_t0 rowmax_h15_t8 fused_mxfp8 fused_mxfp6 fused_mxfp4 fused_hybrid \
      exact_fp8 rowmax_h15_fp8 --out "$OUT" > "$OUT/qwen05.log" 2>&1; tail -25 "$OUT/qwen05.log" ;;
  qwen15k)
    timeout 560 python3 -m bench.quality $Q15 --blocks 97 --kernels-only --time-budget-s ${BUDGET:-430} $RESUME \
      --tag qwen25-15b_austen_kernels_only --modes $KERNEL_MODES --out "$OUT" > "$OUT/qwen15k.log" 2>&1
    tail -16 "$OUT/qwen15k.log" ;;
  qwen15c) compare_step "$Q15" qwen25-15b_austen_kernels qwen15c.log ;;
  qwen15s) simulator_step "$Q15" qwen25-15b_austen_full_sim qwen15s.log ;;
  qwen15long)
    timeout 230 python3 -m bench.quality $Q15 --block-size 8192 --blocks 24 --kernels-only --time-budget-s 110 \
      --tag qwen25-15b_austen_8k_kernels_only --modes exact_bf16p rowmax_h15_t0 rowmax_h15_t8 \
      --pairs rowmax_h15_t8:rowmax_h15_t0 --out "$OUT" > "$OUT/qwen15_8k.log" 2>&1
    tail -8 "$OUT/qwen15_8k.log"
    timeout 200 python3 -m bench.quality $Q15 --block-size 16384 --blocks 12 --baps-restart-study \
      --baps-lengths 2048 4096 8192 16384 --baps-readings reference --time-budget-s 80 \
      --tag qwen25-15b_austen_baps_restarts_16k --out "$OUT" > "$OUT/qwen15_baps.log" 2>&1
    tail -16 "$OUT/qwen15_baps.log" ;;
  qwen15xl)
    timeout 560 python3 -m bench.quality $Q15 --block-size 16384 --blocks 12 --kernels-only --time-budget-s ${BUDGET:-90} \
      $RESUME --tag qwen25-15b_austen_16k_kernels_only --modes exact_bf16p rowmax_h15_t0 rowmax_h15_t8 \
      --pairs rowmax_h15_t8:rowmax_h15_t0 --out "$OUT" > "$OUT/qwen15_16k.log" 2>&1
    tail -8 "$OUT/qwen15_16k.log" ;;
  qwen15ks)
    timeout 560 python3 -m bench.quality $Q15 --blocks 97 --compare-kernels --time-budget-s ${BUDGET:-420} $RESUME \
      --tag qwen25-15b_austen_fp8_ksmooth --modes exact_fp8 exact_fp8_ksmooth rowmax_h15_fp8_ksmooth \
      --pairs exact_fp8_ksmooth:exact_fp8 --out "$OUT" > "$OUT/qwen15ks.log" 2>&1
    tail -16 "$OUT/qwen15ks.log" ;;
  qwen05c) compare_step "$Q05" qwen25-05b_austen_kernels qwen05c.log ;;
  qwen05s) simulator_step "$Q05" qwen25-05b_austen_full_sim qwen05s.log ;;
  qwen05fp8long)
    LENGTHS=${LENGTHS:-2048 16384 32768}
    fp8_long_step qwen2.5-0.5b qwen25-05b_austen_fp8_acc 120 100 "2048 24 70" "16384 6 110" "32768 4 190" ;;
  qwen15fp8long)
    LENGTHS=${LENGTHS:-2048 16384}
    fp8_long_step qwen2.5-1.5b qwen25-15b_austen_fp8_acc 170 130 "2048 24 60" "16384 6 220" "32768 3 280" ;;
  *) echo "h200_session.sh: step must be accuracy, peers, ostore, bench, benchlong, fp8tests, tilemtests, tilem, kvstages, defaults, ncu192, roundrobin, exactbeta, tests, aiter, qualityfp8, qwen05, qwen15k, qwen15c," \
       "qwen15s, qwen15long, qwen15xl, qwen15ks, qwen05c, qwen05s, qwen05fp8long, qwen15fp8long, maskedhalf or persistentdefaults;" \
       "got '$STEP'" >&2
     exit 2 ;;
esac
