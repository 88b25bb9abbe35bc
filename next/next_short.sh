#!/bin/bash
# One call: 10's backward at N = 8k and 16k beside cuDNN, FA2 and 09; 11.12 (build/11_decode) against 11.11
# (build/11_decode.step11) and variants of 11.11 from next/v12.cu: pdl (the merge by programmatic dependent launch),
# fused (no merge kernel: the last split block of a sequence and KV head merges, counters zeroed by a memset),
# divfused (11.12's page arithmetic and fused): checks, sanitizers, ms,GB/s at the README's shapes, SDPA.
# Run from main with 11.12 applied (git diff -M 2785958^ 2785958 | git apply) and next/ from this commit.
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "($(( $(date +%s) - T0 ))s)"; }
L=$OUT/short_call.log
echo "# $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) $(date -u +%F) head $(cat next/head.txt)" | tee $L
make -j16 build/11_decode build/11_decode.step11 > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
PY=$(python3 -c 'import sys; print(sys.executable)')
for v in "pdl:-DVAR_PDL=1" "fused:-DVAR_FUSED=1" "divfused:-DVAR_DIVMOD=1 -DVAR_FUSED=1"; do n=${v%%:*}; f=${v#*:}
  { nvcc -O3 -std=c++17 -lineinfo $f -DFA_ROOT="\"$PWD\"" -DFA_PYTHON="\"$PY\"" -gencode=arch=compute_90,code=sm_90 -c -o build/obj/v_$n.o next/v12.cu \
   && nvcc -gencode=arch=compute_90,code=sm_90 -o build/v_$n build/obj/v_$n.o build/common/harness.o build/common/npy.o; } &
done; wait
echo "build $(el) $(ls build/v_* | tr '\n' ' ')" | tee -a $L
echo "== 11.12 fp16 checks $(el)" | tee -a $L
CASES="3:8:8:1:16:1,17,300 3:16:4:4:1:4,257,1000 2:32:4:1:256:513,4096 2:8:1:4:16:600,33 1:32:8:1:16:32768 2:16:2:16:16:16,1025 64:32:8:1:16:4096 2:16:4:1:3:1000,77 1:8:8:4:7:5000 2:32:8:1:100:4097,1 3:8:2:2:255:300,9000,511"
for c in $CASES; do IFS=: read b hq hkv nq p lens <<< "$c"; for d in 64 128; do for x in build/11_decode build/v_divfused; do
  echo "$x --decode --batch $b --heads $hq --kv-heads $hkv --new $nq --page-size $p --cache-len $lens --headdim $d --warmup 1 --iters 3 --csv"
  echo "$x --decode --batch $b --heads $hq --kv-heads $hkv --new $nq --page-size $p --cache-len $lens --headdim $d --kv-cache e4m3 --warmup 1 --iters 3 --csv"
done; done; done > $OUT/checks.txt
xargs -P 10 -I{} sh -c 'timeout 60 {} 2>&1 | tail -1' < $OUT/checks.txt > $OUT/checks.csv
echo "checks: $(grep -c ',PASS,' $OUT/checks.csv) PASS of $(wc -l < $OUT/checks.txt) $(el)" | tee -a $L
echo "== ms,GB/s, D=128, Hq=32, page 16: 11.11 11.12 pdl fused divfused $(el)" | tee -a $L
for c in 1:8:32768 1:8:131072 16:8:8192 64:8:4096 8:32:32768; do IFS=: read b hkv len <<< "$c"; row="b$b hkv$hkv L$len"
  for x in build/11_decode.step11 build/11_decode build/v_pdl build/v_fused build/v_divfused; do
    row="$row $(timeout 30 $x --decode --batch $b --heads 32 --kv-heads $hkv --cache-len $len --page-size 16 --headdim 128 --no-check --warmup 5 --iters 20 --csv | tail -1 | cut -d, -f9,10)"; done
  echo "$row" | tee -a $L; done
row="b1 hkv8 L32768 new4"; for x in build/11_decode.step11 build/11_decode build/v_pdl build/v_fused build/v_divfused; do
  row="$row $(timeout 30 $x --decode --batch 1 --heads 32 --kv-heads 8 --new 4 --cache-len 32768 --page-size 16 --headdim 128 --no-check --warmup 5 --iters 20 --csv | tail -1 | cut -d, -f9,10)"; done; echo "$row" | tee -a $L
timeout 100 python3 next/sdpa_decode.py 2>&1 | tee -a $L
for x in build/11_decode; do for t in memcheck racecheck synccheck initcheck; do
  r=$(timeout 40 compute-sanitizer --tool $t --error-exitcode 99 $x --decode --batch 2 --heads 8 --kv-heads 2 --new 4 --page-size 7 --cache-len 37,3000 --headdim 128 --warmup 0 --iters 1 2>&1 | grep -E "SUMMARY" | tail -1); echo "$x fp16 page7 $t rc=${PIPESTATUS[0]} $r" | tee -a $L
done; done
echo "done $(el)" | tee -a $L
echo "== checks" >> $L; cat $OUT/checks.csv >> $L
