# EXPERIMENT (branch exp-oneshot-store-area): one-shot by peer stores into store halves of their own,
# launched for one-shot calls of at most 256 tokens (fo_arn_oneshot_st), against main.
# Build: on main `maturin build --release -o .wheel/m1`, on this branch `maturin build --release -o .wheel/s1`.
# Run on nvidia-h200-x2: bash .exp/store_area.sh   (carry .wheel/m1, .wheel/s1, .exp)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 FLASHOVERLAP_PEER_TIMEOUT_S=20
for w in m1 s1; do rm -rf /tmp/$w; python3 -m pip install -q --no-deps --no-compile --target /tmp/$w .wheel/$w/*.whl 2>/dev/null; done
export TOK="128 256 384" ITERS=20
RUNS="M PYTHONPATH=/tmp/m1
S PYTHONPATH=/tmp/s1
S2 PYTHONPATH=/tmp/s1
M2 PYTHONPATH=/tmp/m1" bash .exp/wb.sh
grep -H "tokens: max" $OUT/b_*.txt | grep -v " ok"; rm -f $OUT/b_*.csv $OUT/b_*.json $OUT/b_*.txt $OUT/bench_*.log
PYTHONPATH=/tmp/s1 timeout 330 python -m pytest tests/gpu/test_peer_norm.py tests/gpu/test_allreduce_rmsnorm_kernel.py tests/gpu/test_gemm_all_reduce_rmsnorm.py -q --timeout 200 > $OUT/gpu_tests_s1.txt 2>&1; echo "tests rc $?"; tail -3 $OUT/gpu_tests_s1.txt
