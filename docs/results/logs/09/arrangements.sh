#!/bin/bash
# 09's backward, the main kernel's arrangements side by side in one GPU call: each built with its
# switches (its own BUILD folder under build/), its ptxas report (registers, spills), its gradients
# checked at ragged shapes in both dQ modes, the deterministic build run twice (bitwise the same
# dQ?), the chapter's build through compute-sanitizer racecheck and synccheck, then every build
# timed beside FlashAttention-2's backward (backward_vs_fa2.py), with the 09.dq_red exercise's
# stub (scalar atomics) as one more row.
# It builds the switches of the one-file chapter: run it at commit 70bddea or before (the logs it
# made name their commits); the step files replaced the switches (09_backward/NOTES.md).
#
#   bash docs/results/logs/09/arrangements.sh [K] [SET]   (K: the first K shapes of backward_vs_fa2.py,
#                                         default 2: B4 H16 N4096, D 128 and 64; SET: warps or split)
# Variants of SET warps: new (the source's defaults), old (four warps, 64 keys per block, no
# stagger: the chapter's first arrangement), w4_stagger, w8_nostagger (one change each). SET split:
# new and nosplit (-DBWD_SPLIT=0: at D=128 each warp keeps its 16 keys throughout). SET ring: new,
# stages3 (-DBWD_STAGES=3: a third Q/dO tile in flight) and nostagger (-DBWD_STAGGER=0). SET
# keytiles: new and kt1 (-DBWD_KEY_TILES_D64=1: at D=64 one m16 tile of keys per warp, 128 keys
# per block; D=128 unchanged, so time it with K=4 for both N's D=64 rows). SET dqtiles: new, dq1
# (-DDQ_WARP_TILES=1: the dQ kernel with 16 queries per warp and 64-key tiles) and before (both
# one-tile arrangements: the chapter before two tiles per warp). SET dqadd: new and reg
# (-DBWD_DQ_STAGE=0: the split kernel's dQ by 16-byte REDs from registers, 16 rows x 32 bytes each,
# not staged and added a whole row per RED); D=64 unchanged. SET dqcopies: new and dqkernel
# (-DBWD_DQ_KERNEL=1: the deterministic build's dQ by its own kernel over query tiles, not by the
# main kernel into one workspace copy per block of a head). PYTHON: a Python with PyTorch
# (default python3). Exit 1 if a build or a check failed.
set -u
cd "$(dirname "$0")/../../../.." || exit 2
SHAPES=${1:-2}
PYTHON=${PYTHON:-python3}
case ${2:-warps} in
    warps) VARIANTS=(new old w4_stagger w8_nostagger) ;;
    split) VARIANTS=(new nosplit) ;;
    ring) VARIANTS=(new stages3 nostagger) ;;
    keytiles) VARIANTS=(new kt1) ;;
    dqtiles) VARIANTS=(new dq1 before) ;;
    dqadd) VARIANTS=(new reg) ;;
    dqcopies) VARIANTS=(new dqkernel) ;;
    *) echo "arrangements.sh: SET is warps, split, ring, keytiles, dqtiles, dqadd or dqcopies, not '$2'"; exit 2 ;;
esac
declare -A FLAGS=([new]="" [old]="-DBWD_WIDE_BLOCK=0 -DBWD_STAGGER=0" [w4_stagger]="-DBWD_WIDE_BLOCK=0"
                  [w8_nostagger]="-DBWD_STAGGER=0" [nosplit]="-DBWD_SPLIT=0"
                  [stages3]="-DBWD_STAGES=3" [nostagger]="-DBWD_STAGGER=0" [kt1]="-DBWD_KEY_TILES_D64=1"
                  [dq1]="-DDQ_WARP_TILES=1" [before]="-DBWD_KEY_TILES_D64=1 -DDQ_WARP_TILES=1"
                  [reg]="-DBWD_DQ_STAGE=0" [dqkernel]="-DBWD_DQ_KERNEL=1")
folder() { if [ "$1" = new ]; then echo build; else echo "build/arr_$1"; fi; }
failed=0
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader

# Builds, in parallel (each its own folder), and the exercise's stub in build/exercises/ (after
# the chapter's build, whose folder's harness objects it shares).
pids=() logs=()
for v in "${VARIANTS[@]}"; do
    b=$(folder "$v")
    mkdir -p "$b"
    make -s -j4 BUILD="$b" EXTRA_NVFLAGS="${FLAGS[$v]}" "$b/09_backward" "$b/09_backward.deterministic" \
        > "$b/arrangements_make.log" 2>&1 &
    pids+=($!) logs+=("$b/arrangements_make.log")
done
for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { failed=1; echo "BUILD FAILED, ${logs[$i]}:"; tail -n 20 "${logs[$i]}"; }
done
mkdir -p build/exercises
{ "${PYTHON}" common/exercises.py make 09_backward --only dq_red --force && make -s build/exercises/09_backward; } \
    > build/exercises/arrangements_make.log 2>&1 ||
    { failed=1; echo "BUILD FAILED, the 09.dq_red stub:"; tail -n 20 build/exercises/arrangements_make.log; }

# Registers and spills of the backward kernels, per build (ptxas' report in BUILD/X.log).
for v in "${VARIANTS[@]}"; do
    for bin in 09_backward 09_backward.deterministic; do
        awk -v tag="$v $bin" '
            /Compiling entry function/ {
                name = $0; sub(/.*_Z[0-9]+/, "", name); sub(/EEv.* for /, " ", name); sub(/ILi/, " D", name) }
            /spill stores/ { spill = $5 " + " $9 }
            /Used [0-9]+ registers/ && name ~ /^flash_attention_(backward|dq)_kernel/ {
                print tag ": " name ": " $5 " registers, spill " spill " bytes" }
        ' "$(folder "$v")/$bin.log"
    done
done

# What the main kernels issue, per build: tensor-core, ldmatrix, shared-memory stores, reductions.
for v in "${VARIANTS[@]}"; do
    cuobjdump -sass "$(folder "$v")/09_backward" | awk -v tag="$v" '
        /Function :/ { name = $3 }
        name ~ /flash_attention_backward/ { for (op in want) if ($0 ~ want[op]) n[name, op]++ }
        BEGIN { want["HMMA"] = " HMMA"; want["LDSM"] = " LDSM"; want["STS"] = " STS"; want["RED"] = " RED" }
        END { for (key in n) { split(key, part, SUBSEP); print tag ": " part[1] ": " n[key] " " part[2] } }
    ' | sort
done

# Correctness: --backward at ragged shapes, both D, causal and not, every build (8 at a time).
# B8 H16 N1000: 128 heads, more blocks than the GPU holds, so that a deterministic block takes
# several key tiles in turn.
check() {  # folder binary N D causal|noncausal [B H]
    local out status mask=""
    [ "$5" = causal ] && mask=--causal
    out=$("$1/$2" --backward --batch "${6:-1}" --heads "${7:-2}" --seqlen "$3" --headdim "$4" $mask --warmup 0 --iters 1 \
        --csv 2>&1)
    status=$(echo "$out" | tail -n 1 | awk -F, 'NF >= 22 { print $11 " dq " $20 " dk " $21 " dv " $22 }')
    echo "$1/$2 N=$3 D=$4 $5 B=${6:-1} H=${7:-2}: ${status:-ERROR $(echo "$out" | tail -n 1)}"
}
export -f check
for v in "${VARIANTS[@]}"; do
    for bin in 09_backward 09_backward.deterministic; do
        for d in 64 128; do
            for c in noncausal causal; do
                for n in 1 17 127 1000; do echo "$(folder "$v") $bin $n $d $c 1 2"; done
                echo "$(folder "$v") $bin 1000 $d $c 8 16"
            done
        done
    done
done | xargs -P 8 -n 7 bash -c 'check "$@"' _ | sort > build/arrangements_checks.txt
grep -c ": PASS" build/arrangements_checks.txt | sed 's/^/checks passed: /'
if grep -v ": PASS" build/arrangements_checks.txt; then failed=1; fi

# DETERMINISTIC_DQ: the same dQ, bit for bit, in two runs (and the atomic build, for contrast).
for bin in 09_backward.deterministic 09_backward; do
    for run in 1 2; do
        rm -rf "build/arr_repeat_$run"
        build/$bin --backward --batch 2 --heads 4 --seqlen 1000 --headdim 128 --causal --warmup 0 --iters 1 \
            --no-check --output "build/arr_repeat_$run" > /dev/null 2>&1
    done
    if cmp -s build/arr_repeat_1/dq.npy build/arr_repeat_2/dq.npy; then echo "$bin: dQ bitwise the same in two runs"
    else echo "$bin: dQ differs between two runs"; [ "$bin" = 09_backward.deterministic ] && failed=1; fi
done

# compute-sanitizer racecheck and synccheck of the chapter's builds, atomic and deterministic
# (SANITIZED: another folder's): ragged, wrapping round (N=300: three key blocks of 128, five
# query tiles) and causal.
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for bin in 09_backward 09_backward.deterministic; do
    for run in "racecheck 300 128 noncausal" "racecheck 200 64 causal" "racecheck 300 64 noncausal" \
        "synccheck 300 64 noncausal" "synccheck 200 128 causal" "memcheck 130 128 causal" \
        "racecheck 300 128 causal 12 11" "memcheck 600 64 noncausal 12 11" "synccheck 300 128 noncausal 12 11"; do
        set -- $run
        mask="" && [ "$4" = causal ] && mask=--causal
        out=$(timeout 150 "$sanitizer" --tool "$1" --error-exitcode 99 --target-processes application-only \
            "${SANITIZED:-build}/$bin" --backward --batch "${5:-1}" --heads "${6:-1}" --seqlen "$2" --headdim "$3" \
            $mask --warmup 0 --iters 1 2>&1)
        code=$?
        echo "${SANITIZED:-build}/$bin $1 N=$2 D=$3 $4 B=${5:-1} H=${6:-1}: exit $code, $(echo "$out" | grep -E "SUMMARY" | tail -n 1)"
        [ "$code" = 0 ] || failed=1
    done
done

# Timing, beside FlashAttention-2's backward, in one run.
builds=()
for v in "${VARIANTS[@]}"; do
    builds+=(--build "$v=$(folder "$v")/09_backward")
    case $v in new | old | nosplit | stages3 | kt1 | dq1 | before | dqkernel) builds+=(--build "${v}_det=$(folder "$v")/09_backward.deterministic") ;; esac
done
builds+=(--build "dq_red_stub=build/exercises/09_backward")
"${PYTHON}" docs/results/logs/09/backward_vs_fa2.py "$SHAPES" "${builds[@]}"
exit $failed
