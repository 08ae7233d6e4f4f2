set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 FLASHOVERLAP_PEER_TIMEOUT_S=20
summ() {
  python3 - $1 <<'PY'
import csv,sys
for r in csv.DictReader(open(sys.argv[1])):
    ks=["symm_us"]+[k for k in r if k.startswith("fo_") and "sharded" not in k and r[k] not in ("nan","")]
    print(r["tokens"], " ".join(f"{k[:-3].replace('fo_','')}={float(r[k]):.1f}" for k in ks), "best/symm=%.3f" % (float(r.get("best_us", "nan") or "nan")/float(r["symm_us"])))
PY
}
while read -r tag rest; do
  [ -z "$tag" ] && continue
  env $rest timeout 240 python evaluation/bench_all_reduce_rmsnorm.py --world-size 2 --tokens $TOK --iters ${ITERS:-20} --out $OUT/b_$tag > $OUT/bench_$tag.log 2>&1
  echo "== $tag ($rest) rc $?"; summ $OUT/b_$tag.csv; grep -i "error\|fail" $OUT/b_$tag.txt | grep -v "FAIL \|verdict\|bars:" | head -3
done <<< "$RUNS"
