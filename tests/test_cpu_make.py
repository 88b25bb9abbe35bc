"""The Makefile's reading aids: `make diff`, `make sass` and `make profile` say what is wrong
instead of failing obscurely (chapter numbers as 4, 04 or 04_fused; tools found where the
tests put them; no GPU or no Nsight Compute named as such)."""
import shutil
import subprocess
import unittest

from claims import sass_tools


def make(ctx, *args, timeout=600):
    """make with the multiarch build the runner made (nothing to rebuild)."""
    import shlex
    return ctx.run(shlex.split(ctx.make) + ["--no-print-directory", f"BUILD={ctx.rel(ctx.multiarch)}", "ARCH=multi",
                                            *args], timeout=timeout)


def test_diff_takes_chapter_numbers(ctx):
    for a, b in (("4", "5"), ("04", "05"), ("04_fused", "05_causal")):
        proc = make(ctx, "diff", f"A={a}", f"B={b}")
        assert proc.returncode == 0, f"make diff A={a} B={b}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
        assert "--- 04_fused/attention.cu" in proc.stdout and "+++ 05_causal/attention.cu" in proc.stdout, (
            f"make diff A={a} B={b}: expected a diff of 04_fused and 05_causal, got {proc.stdout[:200]!r}")


def test_diff_refuses_a_missing_chapter(ctx):
    proc = make(ctx, "diff", "A=4", "B=42")
    assert proc.returncode != 0, "make diff B=42: expected a failure, got exit 0"
    assert "no chapter '42'" in proc.stderr and "04_fused" in proc.stderr, (
        f"make diff B=42 should name the missing chapter and list the others: {proc.stderr.strip()!r}")
    assert "usage" not in proc.stderr.lower(), f"diff's own usage error leaked out: {proc.stderr.strip()!r}"


def test_sass_finds_the_fetched_cuobjdump(ctx):
    sass_tools(ctx)  # cuobjdump: on PATH, next to nvcc, or fetched into .cache/tools
    proc = make(ctx, "sass", "CH=7")
    assert proc.returncode == 0, f"make sass CH=7: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    assert "HMMA" in proc.stdout, "make sass CH=7: no HMMA in the SASS of 07"


def test_profile_without_gpu_or_ncu_says_so(ctx):
    have_ncu = shutil.which("ncu") is not None
    have_gpu = shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0
    if have_ncu and have_gpu:
        raise unittest.SkipTest("this machine has a GPU and Nsight Compute: make profile would run")
    proc = make(ctx, "profile", "CH=07")
    assert proc.returncode != 0, "make profile without a GPU or ncu: expected a failure"
    want = "ncu" if not have_ncu else "no NVIDIA GPU"
    assert want in proc.stderr, f"make profile should say '{want}': {proc.stderr.strip()!r}"


def test_bench_passes_and_quick(ctx):
    """make bench runs both passes; BENCH_PASS=backward the backward's alone, QUICK=1 only N = 1k and 4k
    (make -n: what it would run, the build already made)."""
    for args, want in (((), "--pass both "), (("BENCH_PASS=backward", "QUICK=1"), "--pass backward --quick "),
                       (("BENCH_PASS=forward", "QUICK=0"), "--pass forward ")):
        proc = make(ctx, "-n", "bench", *args)
        line = next((l for l in proc.stdout.splitlines() if "common/stages.py bench" in l), "")
        assert proc.returncode == 0 and want in line and "09_backward" in line, \
            f"make -n bench {' '.join(args)}: expected `{want.strip()}` in {line!r} ({proc.stderr.strip()[-200:]})"
    proc = make(ctx, "-n", "compare", "BENCH_PASS=backward")
    assert "common/stages.py compare" in proc.stdout and "--pass backward" in proc.stdout, proc.stdout[-300:]
