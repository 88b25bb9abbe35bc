"""What one harness process costs the GPU, alone and with others beside it: a tiny run (B=1 H=1
N=17 D=64, no check) timed from its start to its exit, 5 times alone, then 2n of them n at a time.
If the time of a run grows with n as n x its time alone, the GPU runs the processes' set-up
(context, module load, tear-down) one at a time, and a test suite of many processes is bound
by their number, not by its parallelism.

  python3 docs/results/logs/common/process_cost.py [BINARY]   (default build/07_async_pipeline)
"""
import concurrent.futures
import statistics
import subprocess
import sys
import time

BINARY = sys.argv[1] if len(sys.argv) > 1 else "build/07_async_pipeline"
CMD = [BINARY, "--batch", "1", "--heads", "1", "--seqlen", "17", "--headdim", "64", "--warmup", "0", "--iters", "1",
       "--no-check"]


def one(_):
    start = time.time()
    done = subprocess.run(CMD, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(CMD)}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
    return time.time() - start


alone = [one(0) for _ in range(5)]
print(f"alone: median {statistics.median(alone):.3f} s per run")
for n in (2, 4, 8, 16):
    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        each = list(pool.map(one, range(2 * n)))
    wall = time.time() - start
    print(f"{n:2} at a time: {2 * n} runs in {wall:.2f} s, {wall / (2 * n):.3f} s of wall per run, "
          f"median {statistics.median(each):.3f} s each")
