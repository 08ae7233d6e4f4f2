#!/usr/bin/env bash
# The GPU tests under NVIDIA compute-sanitizer, as named parts (each with its
# own time limit), on one GPU:
#
#   bash tests/sanitize.sh OUTDIR PART [PART ...]
#
# Parts (seconds on one H200 on 2026-11-25 in brackets; the budget of each is its timeout):
#   mgemm    memcheck: tests/gpu/test_gemm.py (every kernel, tile order, SM count, staged stores + un-reorder) [43]
#   mnorm    memcheck: the peer AllReduce + RMSNorm kernel (2-4 ranks emulated on one GPU) and add-RMSNorm [125]
#   mweave   memcheck: token weaving                                 [49]
#   mops     memcheck: every GEMM op on a 1-rank group, both backends and the peer norm [>460: 9 of 16 tests ran in 260]
#   mshared  memcheck: the copy-engine, push and peer paths, 2 ranks sharing the GPU [>400: 15 of these 18 tests ran in 392]
#   race     racecheck (shared-memory hazards): GEMM kernels, add-RMSNorm, the peer norm kernel [111]
#   sync     synccheck (barrier misuse): the same kernels                [16]
# SANITIZE_COLLECT=1 lists each part's tests instead of running them.
# Each part writes OUTDIR/<part>.out (pytest's output) and OUTDIR/<part>.log
# (the sanitizer's report, child processes included) and prints one line:
# part, tool, exit code, seconds, pytest's last line, the sanitizer's summary.
# Kernels are compiled with -lineinfo (FLASHOVERLAP_NVRTC_OPTIONS) so that a
# report names the source line. A sanitizer error fails the part (exit 99).
# racecheck sees the threads' own shared-memory loads and stores, not the
# TMA and wgmma traffic (the async proxy), whose ordering the mbarriers keep.
set -uo pipefail

if [ $# -lt 2 ]; then
  sed -n '2,/^set /{/^set /!p}' "$0"
  exit 2
fi
out="$1"
shift
mkdir -p "$out"
here="$(cd "$(dirname "$0")" && pwd)"
gpu="$here/gpu"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export FLASHOVERLAP_NVRTC_OPTIONS="${FLASHOVERLAP_NVRTC_OPTIONS:--lineinfo}"
unset CUDA_MODULE_LOADING

for part in "$@"; do
  case "$part" in
    mgemm|mnorm|mweave|mops|mshared|race|sync) ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
# SANITIZE_COLLECT=1: only list each part's tests (pytest --collect-only), no GPU or sanitizer needed.
collect="${SANITIZE_COLLECT:-0}"
cs="$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)"
if [ "$collect" = 1 ]; then
  :
elif [ -z "$cs" ]; then
  echo "compute-sanitizer not found (it comes with the CUDA toolkit)" >&2
  exit 2
else
  "$cs" --version | tail -1
fi

# part tool limit pytest-arguments...
sanitize() {
  local part="$1" tool="$2" limit="$3"
  shift 3
  if [ "$collect" = 1 ]; then
    echo "$part: $(python3 -m pytest -q -p no:cacheprovider --collect-only "$@" 2>&1 | tail -1)"
    return
  fi
  local start=$SECONDS
  # API errors are not reported: NCCL probes kernel images of other architectures on purpose.
  timeout "$limit" "$cs" --tool "$tool" --target-processes all --error-exitcode 99 \
    --report-api-errors no --print-limit 40 --log-file "$out/$part.log" \
    python3 -m pytest -q -p no:cacheprovider "$@" >"$out/$part.out" 2>&1
  local rc=$?
  local summary
  summary="$(grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$part.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
  echo "$part $tool rc=$rc $((SECONDS - start))s: $(tail -1 "$out/$part.out") | ${summary:-no summary (timed out?)}"
}

gemm_orders='1000-136 and (None-3 or 1-16) or 77-1032 and None-1'
for part in "$@"; do
  case "$part" in
    mgemm) sanitize mgemm memcheck 300 "$gpu/test_gemm.py" ;;
    mnorm) sanitize mnorm memcheck 400 "$gpu/test_allreduce_rmsnorm_kernel.py" "$gpu/test_add_rmsnorm.py" ;;
    mweave) sanitize mweave memcheck 300 "$gpu/test_token_weave.py" ;;
    mops) sanitize mops memcheck 900 "$gpu/test_gemm_all_reduce.py" "$gpu/test_gemm_reduce_scatter.py" \
      "$gpu/test_gemm_all_to_all.py" "$gpu/test_gemm_all_reduce_rmsnorm.py" "$gpu/test_nn_layers.py" \
      -k "single or one_rank" ;;
    mshared) sanitize mshared memcheck 900 "$gpu/test_copy_engine_shared.py" "$gpu/test_peer_norm.py" \
      -k "[2] or [banded-2] or [swizzled-2] or push" ;;
    race) sanitize race racecheck 600 "$gpu/test_gemm.py::test_every_kernel_order_and_sm_count" \
      "$gpu/test_add_rmsnorm.py" "$gpu/test_allreduce_rmsnorm_kernel.py" \
      -k "$gemm_orders or add or pull or oneshot" ;;
    sync) sanitize sync synccheck 300 "$gpu/test_gemm.py::test_every_kernel_order_and_sm_count" \
      "$gpu/test_add_rmsnorm.py" "$gpu/test_allreduce_rmsnorm_kernel.py" \
      -k "1000-136 and None-3 or add or pull" ;;
  esac
done
