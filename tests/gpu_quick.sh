#!/usr/bin/env bash
# A quick look on a GPU in one go: build, smoke-test every chapter on awkward shapes,
# compute-sanitizer on the fused kernels, the headline shapes timed next to PyTorch SDPA,
# and optional variants of one chapter (VARIANTS="name:flags;name:flags", VARIANT_CH=07_...).
# Logs go to $OUT (default /tmp/gpu_quick); the summary is printed last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_quick}
mkdir -p "$OUT"
JOBS=$(nproc)

make -j"$JOBS" all >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
chapters=$(ls -d [0-9][0-9]_*/ | tr -d /)
causal_flag() { [ "$1" = 1 ] && echo --causal; }

# 1. Smoke: every chapter on shapes that are not tile multiples, causal and not.
: >"$OUT/smoke.csv"
for shape in "1 1 1 64" "2 3 17 128" "1 2 127 64" "2 1 1000 128" "1 1 130 64" "1 2 300 128"; do
    set -- $shape
    for c in 0 1; do
        for ch in $chapters; do
            build/$ch --batch $1 --heads $2 --seqlen $3 --headdim $4 $(causal_flag $c) \
                --warmup 0 --iters 1 --csv >>"$OUT/smoke.csv" 2>&1 || echo "exit $? $ch $shape c=$c" >>"$OUT/smoke.csv"
        done
    done
done

# 2. compute-sanitizer on the single-kernel chapters.
: >"$OUT/sanitize.log"
if command -v compute-sanitizer >/dev/null; then
    for ch in $chapters; do
        case $ch in 0[4-9]_*) ;; *) continue ;; esac
        for tool in memcheck racecheck; do
            for shape in "--headdim 64 --seqlen 77 --causal" "--headdim 128 --seqlen 130"; do
                echo "== $ch $tool $shape" >>"$OUT/sanitize.log"
                compute-sanitizer --tool $tool --error-exitcode 99 build/$ch --batch 1 --heads 2 $shape \
                    --warmup 0 --iters 1 >>"$OUT/sanitize.log" 2>&1
                echo "rc=$?" >>"$OUT/sanitize.log"
            done
        done
    done
fi

# 3. Headline shapes: B*N = 16k, H*D = 2048, N = 4096.
: >"$OUT/time.csv"
for d in 128 64; do
    for c in 0 1; do
        for ch in $chapters; do
            build/$ch --batch 4 --heads $((2048 / d)) --seqlen 4096 --headdim $d $(causal_flag $c) \
                --warmup 2 --iters 10 --csv >>"$OUT/time.csv" 2>>"$OUT/time.err"
        done
    done
done

# 4. Variants of one chapter, same shapes.
: >"$OUT/variants.csv"
IFS=';' read -ra variant_list <<<"${VARIANTS:-}"
for v in "${variant_list[@]}"; do
    name=${v%%:*} flags=${v#*:}
    make BUILD=build/v_$name EXTRA_NVFLAGS="$flags" build/v_$name/$VARIANT_CH >>"$OUT/build.log" 2>&1 || { echo "variant $name failed" >>"$OUT/variants.csv"; continue; }
    grep -E "registers|spill" build/v_$name/$VARIANT_CH.log | tail -4 | tr -s ' ' | sed "s/^/$name /" >>"$OUT/variants.log"
    for d in 128 64; do
        for c in 0 1; do
            printf '%s,' "$name" >>"$OUT/variants.csv"
            build/v_$name/$VARIANT_CH --batch 4 --heads $((2048 / d)) --seqlen 4096 --headdim $d $(causal_flag $c) \
                --warmup 2 --iters 10 --csv >>"$OUT/variants.csv" 2>&1
        done
    done
done

# 5. PyTorch SDPA on the same inputs (optional).
python3 - >"$OUT/torch.txt" 2>&1 <<'EOF'
import glob, os, sys
import numpy as np
try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:
    sys.exit("PyTorch not found")
for d in (128, 64):
    folder = f".cache/b4_h{2048 // d}_n4096_d{d}_seed0"
    q, k, v = (torch.from_numpy(np.load(f"{folder}/{n}.npy")).cuda() for n in "qkv")
    for causal in (False, True):
        for name, backend in (("torch_flash", SDPBackend.FLASH_ATTENTION), ("torch_cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel(backend):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                for _ in range(3): f()
                times = []
                for _ in range(10):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record(); f(); b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b))
            ms = float(np.median(times))
            flops = 4 * q.shape[0] * q.shape[1] * 4096 ** 2 * d / (2 if causal else 1)
            print(f"{name},4,{q.shape[1]},4096,{d},{int(causal)},fp16,{ms:.4f},{flops / ms / 1e9:.2f}")
EOF

echo "== build"; grep -hE "registers|spill" build/0[4-7]*.log | tr -s ' ' | paste - - | cut -c1-140
echo "== smoke: $(grep -c ',PASS,' "$OUT/smoke.csv") PASS, $(grep -c ',FAIL,' "$OUT/smoke.csv") FAIL"
grep -vE ',PASS,' "$OUT/smoke.csv" | head -30
echo "== sanitize"; grep -E "^==|rc=|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize.log" | paste - - - | grep -v "rc=0" | head -20
echo "== variants"; cat "$OUT/variants.log" 2>/dev/null; cut -d, -f1-9,11,12 "$OUT/variants.csv"
echo "== time (impl,B,H,N,D,causal,dtype,ms,TFLOP/s,rel_l2,status)"; cut -d, -f1-11 "$OUT/time.csv"; cat "$OUT/time.err" 2>/dev/null | head
cat "$OUT/torch.txt"

# 6. Nsight Compute, when PROFILE names chapters: per-kernel times of the split chapters and
#    the main sections of the fused ones, at the headline shape.
if [ -n "${PROFILE:-}" ] && command -v ncu >/dev/null; then
    for ch in $PROFILE; do
        args="--batch 4 --heads 16 --seqlen 4096 --headdim 128 --warmup 0 --iters 1 --no-check"
        case $ch in
        0[1-3]_*) ncu --clock-control none --metrics gpu__time_duration.sum build/$ch $args >"$OUT/ncu_$ch.txt" 2>&1
                  echo "== ncu $ch"; grep -E "^  [a-z_]+kernel|gpu__time_duration" "$OUT/ncu_$ch.txt" | paste - - | head -3 ;;
        *) ncu --clock-control none --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
               --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats build/$ch $args >"$OUT/ncu_$ch.txt" 2>&1
           echo "== ncu $ch"; grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Executed Ipc A|Bank Conflicts|Stall" "$OUT/ncu_$ch.txt" | head -20 ;;
        esac
    done
fi
