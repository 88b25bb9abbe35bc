#!/bin/bash
# 09 split-kernel experiment switches (BWD_DQ_FIRST, BWD_PAIR_BARRIER): built, checked at ragged N,
# racecheck/synccheck, the deterministic dQ repeated, timed beside FlashAttention-2. Needs make first.
#   OUT=folder bash docs/results/logs/09/split_variants.sh
set -u
OUT=${OUT:-/tmp}
mkdir -p build/arr_dqfirst build/arr_pair
make -s -j8 BUILD=build/arr_dqfirst EXTRA_NVFLAGS=-DBWD_DQ_FIRST=1 build/arr_dqfirst/09_backward > $OUT/build.log 2>&1 &
make -s -j8 BUILD=build/arr_pair EXTRA_NVFLAGS=-DBWD_PAIR_BARRIER=1 build/arr_pair/09_backward build/arr_pair/09_backward.deterministic >> $OUT/build.log 2>&1 &
wait; grep -i "error\|fail" $OUT/build.log | head
for b in arr_dqfirst/09_backward arr_pair/09_backward arr_pair/09_backward.deterministic; do
for n in 1 127 1000 2048; do for m in "" --causal; do
  build/$b --backward --batch 2 --heads 3 --seqlen $n --headdim 128 $m --warmup 0 --iters 1 --csv 2>&1 | tail -1 | awk -F, -v n=$n -v m="$m" -v b=$b '{print b " N=" n " " m ": " $11 " dq " $20 " dk " $21 " dv " $22}'
done; done; done > $OUT/checks.txt 2>&1
echo "checks PASS: $(grep -c PASS $OUT/checks.txt) of 24"; grep -v PASS $OUT/checks.txt | head -5
for t in racecheck synccheck; do timeout 60 compute-sanitizer --tool $t --error-exitcode 9 build/arr_pair/09_backward --backward --batch 1 --heads 2 --seqlen 300 --headdim 128 --warmup 0 --iters 1 > $OUT/pair_$t.txt 2>&1; echo "pair $t rc=$?"; done
for i in 1 2; do build/arr_pair/09_backward.deterministic --backward --batch 2 --heads 4 --seqlen 1000 --headdim 128 --warmup 0 --iters 1 --output /tmp/det$i > /dev/null 2>&1; done
cmp /tmp/det1/dq.npy /tmp/det2/dq.npy && echo "pair det dq bitwise same"
timeout 150 python3 docs/results/logs/09/backward_vs_fa2.py 5 --build ours=build/09_backward --build pair=build/arr_pair/09_backward --build dqfirst=build/arr_dqfirst/09_backward --build det=build/09_backward.deterministic --build pair_det=build/arr_pair/09_backward.deterministic > $OUT/times.csv 2>&1
cat $OUT/times.csv
