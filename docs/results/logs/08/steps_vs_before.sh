#!/bin/bash
# 08 before the steps (its source at the commit before them, in scratch_ref/) against the restructured
# chapter and its step builds, same call: kernel alone and whole forward, interleaved. scratch_ref/
# held `git show 754493b:08_fp8/attention.cu` and a copy of common/harness.h; old08 is its default
# build, old08.s4 its -DSCORES_F16=0 build (08.4's configuration), old08.fp16 its -DFP16_OPERANDS=1
# build (08.3's). Run on the H200, 2026-12-01: steps_vs_before_h200.csv / .txt.
set -u
B=build
F="-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a"
nvcc $F -o $B/old08 scratch_ref/08_fp8/attention.cu $B/common/harness.o $B/common/npy.o 2>/dev/null &
nvcc $F -DFP16_OPERANDS=1 -o $B/old08.fp16 scratch_ref/08_fp8/attention.cu $B/common/harness.o $B/common/npy.o 2>/dev/null &
nvcc $F -DSCORES_F16=0 -o $B/old08.s4 scratch_ref/08_fp8/attention.cu $B/common/harness.o $B/common/npy.o 2>/dev/null &
wait
echo "bin,causal,round,ms,attend_ms,rel_l2,status" > $OUT/compare.csv
for r in 1 2 3; do
  for c in 0 1; do
    for bin in old08 08_fp8 old08.s4 08_fp8.step4 old08.fp16 08_fp8.step3 08_fp8.step2 08_fp8.step1; do
      cf=""; [ $c = 1 ] && cf=--causal
      line=$($B/$bin --batch 4 --heads 16 --seqlen 4096 --headdim 128 $cf --warmup 5 --iters 30 --csv 2>/dev/null | grep -v '^#' | tail -1)
      IFS=, read -ra f <<< "$line"
      echo "$bin,$c,$r,${f[7]},${f[16]},${f[9]},${f[10]}" >> $OUT/compare.csv
    done
  done
done
python3 - <<'PY'
import csv, statistics, os
rows=list(csv.DictReader(open(os.environ['OUT']+'/compare.csv')))
agg={}
for r in rows: agg.setdefault((r['bin'],r['causal']),[]).append(r)
print(f"{'bin':14} {'c':>1} {'ms':>8} {'attend':>8} {'rel_l2':>10} status")
for (b,c),rs in agg.items():
    ms=statistics.median(float(r['ms']) for r in rs)
    at=[float(r['attend_ms']) for r in rs if r['attend_ms']]
    print(f"{b:14} {c:>1} {ms:8.4f} {statistics.median(at) if at else float('nan'):8.4f} {rs[0]['rel_l2']:>10} {rs[0]['status']}")
PY
