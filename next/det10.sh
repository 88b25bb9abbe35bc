#!/bin/bash
# One call (after next_Y.sh, on the same machine: its build/ kept): what 10.11's deterministic mode pays for.
# Variants of 10.11 (next/v10.cu): noturn (deterministic grid and completion waits, no counters: no order),
# nowait (the counters and fences, no waiting), nofence (the waits, no proxy fences), two (a writer warp for
# each consumer, both modes). B4 H16 (D64: H32) N4096, ms.
set -o pipefail
L=$OUT/det10.log
echo "# 10.11's deterministic mode, variants, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) $(date -u +%F) head $(cat next/head.txt)" | tee $L
PY=$(python3 -c 'import sys; print(sys.executable)')
make -j16 build/10_backward_hopper build/common/harness.o build/common/npy.o > $OUT/build10.log 2>&1 || { tail -20 $OUT/build10.log; exit 1; }
for v in "noturn:-DVAR_NOTURN=1" "nowait:-DVAR_NOWAIT=1" "nofence:-DVAR_NOFENCE=1" "two:-DVAR_TWO_WRITERS=1"; do n=${v%%:*}; f=${v#*:}
  { nvcc -O3 -std=c++17 -lineinfo $f -DFA_ROOT="\"$PWD\"" -DFA_PYTHON="\"$PY\"" -gencode=arch=compute_90a,code=sm_90a -c -o build/obj/v10_$n.o next/v10.cu \
   && nvcc -gencode=arch=compute_90a,code=sm_90a -o build/v10_$n build/obj/v10_$n.o build/common/harness.o build/common/npy.o; } &
done; wait
echo "D causal: default det noturn nowait nofence two two-det (ms)" | tee -a $L
for d in 128 64; do h=$(( d == 128 ? 16 : 32 )); for c in "" "--causal"; do row="D$d H$h ${c:-non-causal}:"
  for x in "build/10_backward_hopper" "build/10_backward_hopper --deterministic" "build/v10_noturn --deterministic" "build/v10_nowait --deterministic" "build/v10_nofence --deterministic" "build/v10_two" "build/v10_two --deterministic"; do
    row="$row $(timeout 30 $x --backward --batch 4 --heads $h --seqlen 4096 --headdim $d $c --no-check --warmup 5 --iters 20 --csv | tail -1 | cut -d, -f8)"; done
  echo "$row" | tee -a $L; done; done
echo "checks (two writers, both modes; nofence det):" | tee -a $L
for a in "build/v10_two --headdim 128" "build/v10_two --headdim 64" "build/v10_two --headdim 128 --deterministic" "build/v10_two --headdim 64 --deterministic --causal" "build/v10_two --headdim 128 --causal" "build/v10_nofence --deterministic --headdim 128 --causal"; do
  timeout 60 $a --backward --batch 2 --heads 3 --seqlen 1000 --csv 2>&1 | tail -1 | tee -a $L; done
