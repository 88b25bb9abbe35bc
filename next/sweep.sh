#!/bin/bash
# One call: part of make bench on this GPU: next/sweep.sh PASS HEADDIM SEQLENS [PASS HEADDIM SEQLENS ...],
# the results files and the logs under $OUT. cuDNN's frontend (for the FP8 anchor) from .whl.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-index --target .cache/cudnn_fe .whl/nvidia_cudnn_frontend-*.whl 2>&1 | tail -2
T0=$(date +%s)
make -j16 all > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "build $(( $(date +%s) - T0 )) s"
while [ $# -ge 3 ]; do
  log=$OUT/bench_$1_d$2_${3//,/_}.log
  echo "# make bench BENCH_PASS=$1 HEADDIM=$2 SEQLENS=$3 on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u '+%F %H:%M') UTC, commit $(cat next/head.txt)" > $log
  PYTHONPATH=$PWD/.cache/cudnn_fe timeout ${BUDGET:-560} make bench BENCH_PASS=$1 HEADDIM=$2 SEQLENS=$3 2>&1 | tee -a $log | tail -25
  echo "# rc=${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s" | tee -a $log
  shift 3
done
mkdir -p $OUT/results && cp docs/results/NVIDIA_H* $OUT/results/ 2>/dev/null; ls $OUT/results
