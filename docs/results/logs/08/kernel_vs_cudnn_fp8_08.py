# How docs/results/logs/08/kernel_vs_cudnn_fp8_08*.csv were measured, on the GPU machine from the repository root
# after `make` and with the cuDNN frontend on PYTHONPATH: python3 docs/results/logs/08/kernel_vs_cudnn_fp8_08.py OUT.csv
# [--flush-l2] (both sides' inputs out of L2 before each timed run: the harness's --flush-l2, anchors.l2_flusher)
# (kernel_vs_cudnn_fp8_08.csv: H200, its kernel alone timed in runs of its own; _flushed_h100.csv: H100, 2026-12-06,
# timed inside each whole forward, the harness since e4e7cce, with --flush-l2).
# The attention kernel alone (08, inputs already in e4m3) beside cuDNN's FP8 attention, per bench shape,
# interleaved: 3 rounds, in each one 08 run (median of 20) then cuDNN (median of 20) per shape.
import csv, os, statistics, subprocess, sys
sys.path.insert(0, "common")  # run from the repository root
import anchors, torch
out = sys.argv[1]
flush = sys.argv[2:] == ["--flush-l2"]  # both sides with L2 written over before each timed run (and 08's parts)
shapes = [dict(batch=16384 // n, heads=2048 // d, seqlen=n, headdim=d, causal=c)
          for d, ns in ((128, (512, 1024, 2048, 4096, 8192, 16384)), (64, (4096, 16384))) for c in (0, 1) for n in ns]
rows = []
loaded = {}
for rnd in (1, 2, 3):
    for s in shapes:
        args = ["build/08_fp8", "--batch", str(s["batch"]), "--heads", str(s["heads"]), "--seqlen", str(s["seqlen"]),
                "--headdim", str(s["headdim"]), "--warmup", "5", "--iters", "20", "--no-check", "--csv"] + (["--causal"] if s["causal"] else []) + (["--flush-l2"] if flush else [])
        r = subprocess.run(args, capture_output=True, text=True, timeout=60).stdout.strip().splitlines()[-1].split(",")
        rows.append([rnd, "08_fp8", s["headdim"], s["causal"], s["seqlen"], r[7], r[16]])
        key = tuple(s.values())
        if key not in loaded:
            loaded.clear(); torch.cuda.empty_cache()
            loaded[key] = anchors.load_shape(torch, ".cache", s)
        a = anchors.measure(torch, "cudnn_fp8", s, *loaded[key], 5, 20, anchors.l2_flusher(torch) if flush else None)
        rows.append([rnd, "cudnn_fp8", s["headdim"], s["causal"], s["seqlen"], a["ms"], a["ms"]])
        print(rows[-2], rows[-1], flush=True)
with open(out, "w", newline="") as f:
    w = csv.writer(f); w.writerow(["round", "impl", "headdim", "causal", "seqlen", "ms", "attend_ms"]); w.writerows(rows)
med = lambda impl, s, col: statistics.median(float(r[col]) for r in rows if r[1] == impl and r[2:5] == [s["headdim"], s["causal"], s["seqlen"]])
print("D causal N | 08 whole ms | 08 kernel ms | cuDNN FP8 ms | kernel x cuDNN FP8")
for s in shapes:
    k, c = med("08_fp8", s, 6), med("cudnn_fp8", s, 6)
    print(f"{s['headdim']} {s['causal']} {s['seqlen']} | {med('08_fp8', s, 5):.4f} | {k:.4f} | {c:.4f} | {c / k:.3f}x")
