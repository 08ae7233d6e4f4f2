#!/usr/bin/env bash
# Every measurement the open issues need from two GPUs of one node, as named
# parts, so that a short session on a 2-GPU machine can run them in a few
# batches (each part has its own time limit; run the parts that fit):
#
#   bash evaluation/run_two_gpu.sh OUTDIR PART [PART ...]
#
# Parts (seconds measured on 2x H200 on 2026-11-23 in brackets; the budget of each is its timeout):
#   tests  the whole GPU test suite                              [300 on 2026-11-23; 430 on ONE GPU on 2026-11-25]
#   testsa / testsb  the same in two halves: the GEMM ops' files / every other file (each under the 10-minute limit)
#   tests2 only the tests that need 2 GPUs (pytest --multi-gpu-only; one GPU runs the rest)
#   ar     bench_gemm_ar.py --iters 40 (issues 3, 5, 8)           [37]
#   rs     bench_gemm_rs.py, both backends (issues 4, 8)          [31]
#   a2a    bench_gemm_a2a.py, both backends, 19 cases (the 16 and issue 4's bar cases) [36 for 16]
#   arn    bench_gemm_ar_rmsnorm.py (issue 4)                     [28]
#   norm   bench_all_reduce_rmsnorm.py (issue 6)                  [29]
#   normcfg  the same, each kernel config: the stages pipelined, one-shot (issue 6) [19 at 1K and 8K tokens]
#   arns4  bench_gemm_ar_rmsnorm.py with FLASHOVERLAP_NORM_CONFIG=512x4s4 (issue 4: the peer backend's kernel pipelined) [28]
#   coll   bench_collectives.py (issue 8)                         [32]
#   e1     e1_correctness.py (issues 4, 8)                        [14]
#   e2     e2_predictive_search.py, NCCL (issue 5)                [67]
#   e2ce   e2_predictive_search.py --backend copy_engine          [67]
#   e2push e2_predictive_search.py --backend push (its estimated constants' first check; then refit them with e2_replay) [~70]
#   tune   flashoverlap tune, 2-GPU collective curves (issue 5) [72]
#   first  first_call_latency.py --world-size 2 (issue 5)         [13]
#   a2a16  bench_gemm_a2a.py with FLASHOVERLAP_NCCL_MAX_CTAS=16 (NCCL rounds P2P channels up to a power of two: 24 -> 32 CTAs, more than the 24 SMs the GEMM leaves; suspected of forced A2A groups costing ~45 us each) [36]
#   argather  bench_gemm_ar.py with FLASHOVERLAP_CE_ALLREDUCE=gather (the copy engines' AllReduce as ReduceScatter + AllGather on 2 ranks) [40]
#   collgather  bench_collectives.py with the same                [32]
#   weave  bench_weave.py: 2 decoder layers woven over two token halves vs NCCL / fused, 1K-16K tokens [~60 on 2x H100 at 3 token counts]
# Each part writes OUTDIR/<part>.log (its output) and its result files
# under OUTDIR, and prints one line: part, exit code, seconds (and a warning
# where a GPU's clock slowdown is active when the part ends). A GPU whose clocks
# are cut (a bf16 matmul check first, nvidia-smi's slowdown reasons after each
# part) skips the timing parts that follow; the tests and E1 still run. NVLink
# multicast stays off in everything started here.
# The 2x H200 and 2x H100 curves ship in the package (NCCL 2.28.9): `tune` is
# needed only under another NCCL version or GPU. With ~30 minutes of 2-GPU time
# (a machine start takes a few): ar rs a2a arn norm coll first in one call, then
# e2 e2ce e2push e1 weave, then tests2 (the 2-GPU tests: ~220 s on 2x H100;
# testsa / testsb, the whole suite, only where a one-GPU machine cannot run the
# rest); a2a16 argather collgather normcfg arns4 where time is left. The push
# backend (in auto for every GEMM op on 2 Hopper ranks; its constants fitted on
# 2x H100 and 2x H200) is timed by ar, rs, a2a, arn, e1 and e2push.
# After `e2` (and `tune`), the predictor can be refitted on any machine:
#   python evaluation/e2_replay.py OUTDIR/e2_predictive_search_h200x2.csv
# (the profile `tune` wrote in $FLASHOVERLAP_CACHE_DIR/profiles-v1/ to replay with it).
set -uo pipefail

if [ $# -lt 2 ]; then
  sed -n '2,/^set /{/^set /!p}' "$0"
  exit 2
fi
out="$1"
shift
mkdir -p "$out"
here="$(cd "$(dirname "$0")" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Lazy module loading (CUDA's default) is what users run.
unset CUDA_MODULE_LOADING

# The GPU test files of the GEMM ops (testsa), or every other one (--others: testsb).
gemm_tests() {
  local pattern='/test_gemm(_all_reduce|_reduce_scatter|_all_to_all)?\.py$'
  if [ "${1:-}" = --others ]; then
    ls "$here"/../tests/gpu/test_*.py | grep -v -E "$pattern" | tr '\n' ' '
  else
    ls "$here"/../tests/gpu/test_*.py | grep -E "$pattern" | tr '\n' ' '
  fi
}

part_command() {
  case "$1" in
    tests) echo "timeout 560 python -m pytest $here/../tests/gpu -q -p no:cacheprovider --timeout 240" ;;
    # The suite in two halves, each under the device's 10-minute limit (one GPU alone took 430 s on 2026-11-25).
    testsa) echo "timeout 560 python -m pytest $(gemm_tests) -q -p no:cacheprovider --timeout 240" ;;
    testsb) echo "timeout 560 python -m pytest $(gemm_tests --others) -q -p no:cacheprovider --timeout 240" ;;
    tests2) echo "timeout 560 python -m pytest $here/../tests/gpu --multi-gpu-only -q -rfE -p no:cacheprovider --timeout 240" ;;
    ar) echo "timeout 420 python $here/bench_gemm_ar.py --iters 40 --out $out/bench_gemm_ar_h200x2_bfloat16.csv" ;;
    rs) echo "timeout 420 python $here/bench_gemm_rs.py --out $out/bench_gemm_rs_h200x2_bfloat16" ;;
    a2a) echo "timeout 360 python $here/bench_gemm_a2a.py --out $out/bench_gemm_a2a_h200x2_bfloat16" ;;
    arn) echo "timeout 360 python $here/bench_gemm_ar_rmsnorm.py --out $out/bench_gemm_ar_rmsnorm_h200x2_bfloat16" ;;
    norm) echo "timeout 420 python $here/bench_all_reduce_rmsnorm.py --world-size 2 --out $out/bench_all_reduce_rmsnorm_h200x2" ;;
    normcfg) echo "timeout 420 python $here/bench_all_reduce_rmsnorm.py --world-size 2 --configs 512x4s4 512x4o 512x4s4o 512x4s8o --out $out/bench_all_reduce_rmsnorm_configs_h200x2" ;;
    arns4) echo "env FLASHOVERLAP_NORM_CONFIG=512x4s4 timeout 360 python $here/bench_gemm_ar_rmsnorm.py --out $out/bench_gemm_ar_rmsnorm_s4_h200x2_bfloat16" ;;
    coll) echo "timeout 420 python $here/bench_collectives.py --world-size 2 --out $out/bench_collectives_h200x2" ;;
    e1) echo "timeout 300 python $here/e1_correctness.py --world-size 2 --out $out/e1_correctness_h200x2.txt" ;;
    e2) echo "timeout 570 python $here/e2_predictive_search.py --world-size 2 --out $out/e2_predictive_search_h200x2" ;;
    e2ce) echo "timeout 570 python $here/e2_predictive_search.py --world-size 2 --backend copy_engine --out $out/e2_predictive_search_ce_h200x2" ;;
    e2push) echo "timeout 570 python $here/e2_predictive_search.py --world-size 2 --backend push --out $out/e2_predictive_search_push_h200x2" ;;
    # Into the cache dir, where every later part's planner finds it (the GEMM times of the 16
    # shapes ship in the bundled one-GPU profile), then a copy under OUTDIR.
    tune) echo "timeout 570 flashoverlap tune --world-size 2 --ops all_reduce,reduce_scatter,all_to_all && cp \"\$(python -c 'from flashoverlap import profiles; print(profiles.cache_dir())')\"/*-w2-*.json $out/" ;;
    first) echo "timeout 240 python $here/first_call_latency.py --world-size 2" ;;
    a2a16) echo "FLASHOVERLAP_NCCL_MAX_CTAS=16 timeout 360 python $here/bench_gemm_a2a.py --out $out/bench_gemm_a2a_ctas16_h200x2_bfloat16" ;;
    argather) echo "FLASHOVERLAP_CE_ALLREDUCE=gather timeout 420 python $here/bench_gemm_ar.py --iters 40 --out $out/bench_gemm_ar_gather_h200x2_bfloat16.csv" ;;
    collgather) echo "FLASHOVERLAP_CE_ALLREDUCE=gather timeout 420 python $here/bench_collectives.py --world-size 2 --out $out/bench_collectives_gather_h200x2" ;;
    weave) echo "timeout 420 python $here/bench_weave.py --world-size 2 --out $out/bench_weave_h200x2" ;;
    *) return 1 ;;
  esac
}

# Parts whose results are times (everything but the tests and E1's errors): on a GPU whose
# clocks are cut they would only spend the lease, so they are skipped once a check finds one
# (FLASHOVERLAP_RUN_SLOW=1 runs them anyway). Checked before the first and after each part.
timing_part() { case "$1" in tests|testsa|testsb|tests2|e1) return 1 ;; *) return 0 ;; esac; }
slow=""
if [ "${FLASHOVERLAP_RUN_SLOW:-0}" != 1 ]; then
  slow="$(python -c 'from flashoverlap import bench; print(bench.check_gpus() or "")' 2>/dev/null | tee "$out/gpu_check.log" | grep WARNING)"
  [ -z "$slow" ] || echo "$slow: timing parts skipped (FLASHOVERLAP_RUN_SLOW=1 runs them)"
fi

status=0
for part in "$@"; do
  if ! cmd="$(part_command "$part")"; then
    echo "unknown part: $part (see: bash $0)" >&2
    status=2
    continue
  fi
  if [ -n "$slow" ] && timing_part "$part"; then
    echo "$part skipped: GPU clocks cut"
    status=3
    continue
  fi
  start=$(date +%s)
  echo "\$ $cmd" > "$out/$part.log"
  bash -c "$cmd" >> "$out/$part.log" 2>&1
  rc=$?
  # A throttled GPU (thermal or hardware slowdown) makes every time of the part meaningless.
  warn="$(python -c 'from flashoverlap import bench; print(bench.slowdown_warning(bench.gpu_state()) or "")' 2>/dev/null)"
  [ -z "$warn" ] || echo "# $warn" >> "$out/$part.log"
  [ -z "$warn" ] || [ "${FLASHOVERLAP_RUN_SLOW:-0}" = 1 ] || slow="$warn"
  echo "$part rc=$rc $(( $(date +%s) - start ))s${warn:+ $warn}"
  [ $rc -eq 0 ] || status=1
done
exit $status
