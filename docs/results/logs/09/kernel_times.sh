#!/bin/bash
# Each kernel of one 09 backward, timed alone by Nsight Compute (gpu__time_duration, one run, no
# warm-up): where the time of a build goes, e.g. the deterministic build's main and dQ kernels.
#
#   bash docs/results/logs/09/kernel_times.sh BINARY [B H N D [causal]]   (default: 4 16 4096 128)
set -u
binary=$1 b=${2:-4} h=${3:-16} n=${4:-4096} d=${5:-128} mask=""
[ "${6:-}" = causal ] && mask=--causal
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
echo "$binary B=$b H=$h N=$n D=$d ${6:-noncausal}:"
timeout 120 "$ncu" --metrics gpu__time_duration.sum --print-units base --csv \
    --kernel-name regex:'backward|dq_kernel|convert' \
    "$binary" --backward --batch "$b" --heads "$h" --seqlen "$n" --headdim "$d" $mask --warmup 0 --iters 1 --no-check |
    grep '^"' | python3 -c '
import csv, sys
for row in csv.DictReader(sys.stdin):
    name = row["Kernel Name"].split("(")[0].replace("void ", "")
    print("  %-48s %14s %s" % (name, row["Metric Value"], row["Metric Unit"]))'
