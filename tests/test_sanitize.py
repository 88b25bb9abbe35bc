"""compute-sanitizer (`make sanitize`: pytest -m sanitize) on every chapter and 08's step builds at
small shapes, on each backward pass (--backward, and in its deterministic mode: --backward
--deterministic), 09's step builds included, and on each decoding pass (--decode).

memcheck (with --leak-check full), racecheck, synccheck and initcheck, each on shapes that are not
tile multiples. A run passes when the sanitizer exits 0 and reports `ERROR SUMMARY: 0 errors`
(racecheck: 0 hazards, 0 errors, 0 warnings). Before the first sanitized run of a shape, one plain
run of the binary makes the shape's inputs and reference in the cache (the runs of a shape are one
xdist group), so that sanitized runs only read it. Skipped, with the reason, without a GPU or
without compute-sanitizer.
"""
import pytest

from cuda_tools import check_summary, find_sanitizer
from helpers import BACKWARD_CHAPTERS, CHAPTERS, DECODE_CHAPTERS, STEP_BUILDS, shape_args

# (tool, extra sanitizer flags, B, H, N, D, causal)
RUNS = [
    ("memcheck", ["--leak-check", "full"], 1, 2, 77, 64, True),
    ("memcheck", ["--leak-check", "full"], 1, 2, 130, 128, False),
    ("racecheck", [], 1, 1, 130, 128, True),
    ("racecheck", [], 1, 1, 200, 64, False),
    ("synccheck", [], 1, 2, 77, 64, False),
    ("synccheck", [], 1, 1, 130, 128, True),
    ("initcheck", [], 1, 2, 77, 128, True),
]
TIMEOUT_S = 600
# What runs: each chapter and 08's steps (BUILD/08_fp8.stepK) forward; each chapter with a backward pass with
# --backward, and again in its deterministic mode; 09's steps (BUILD/09_backward.stepK), whose forward is
# the chapter's, with --backward.
BACKWARD_STEPS = [build for _, build, _ in STEP_BUILDS if build.split(".")[0] in BACKWARD_CHAPTERS]
TARGETS = [(c, ()) for c in CHAPTERS + [build for _, build, _ in STEP_BUILDS if build not in BACKWARD_STEPS]] + \
          [(c, flags) for c in BACKWARD_CHAPTERS for flags in (("--backward",), ("--backward", "--deterministic"))] + \
          [(build, ("--backward",)) for build in BACKWARD_STEPS]


def params():
    for tool, extra, b, h, n, d, causal in RUNS:
        for build, flags in TARGETS:
            yield pytest.param(tool, extra, build, flags, (b, h, n, d, causal),
                               marks=pytest.mark.xdist_group(f"sanitize_{b}_{h}_{n}_{d}_{causal}_{bool(flags)}"),
                               id=f"{tool} {' '.join((build,) + flags)} B={b} H={h} N={n} D={d}"
                                  f"{' causal' if causal else ''}")


def sanitize(repo, tool, extra, build, args, cache_key):
    """The sanitizer's run of build with args, after one plain run per cache_key (which makes the cached inputs
    and reference for everyone): exit 0 and a clean summary."""
    sanitizer = repo.once("compute-sanitizer", find_sanitizer)
    if not sanitizer:
        pytest.skip("compute-sanitizer not found (PATH, next to nvcc, /usr/local/cuda)")
    binary = repo.require_binary(build)
    repo.once(cache_key, lambda: repo.run([binary, *args, "--csv"], timeout=TIMEOUT_S))
    proc = repo.run([sanitizer, "--tool", tool, "--error-exitcode", "99", "--target-processes", "application-only",
                     *extra, binary, *args], timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    shown = f"compute-sanitizer --tool {tool} {build} {' '.join(args)}"
    if proc.returncode == 77:
        pytest.skip(f"{build}: " + (proc.stdout.strip().splitlines() or ["exit 77"])[-1])
    reports = [line for line in output.splitlines() if line.startswith("=========")]
    assert proc.returncode == 0, (
        f"{shown}: exit {proc.returncode}, expected 0 (99: the sanitizer found errors; 1: the check failed)\n"
        + "\n".join(reports[:40] or output.strip().splitlines()[-20:]))
    check_summary(tool, output, shown)


@pytest.mark.sanitize
@pytest.mark.gpu
@pytest.mark.parametrize("tool,extra,build,flags,shape", list(params()))
def test_sanitizer_finds_nothing(repo, tool, extra, build, flags, shape):
    args = shape_args(*shape) + ["--warmup", "0", "--iters", "1", *flags]
    sanitize(repo, tool, extra, build, args, ("sanitize-cache", shape, bool(flags)))


# Decoding (--decode), on the chapters that register it: a ragged, grouped, paged shape with four new tokens.
DECODE_ARGS = ["--decode", "--batch", "2", "--heads", "8", "--kv-heads", "2", "--new", "4", "--page-size", "16",
               "--cache-len", "37,300", "--warmup", "0", "--iters", "1"]


@pytest.mark.sanitize
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("tool,extra", [("memcheck", ["--leak-check", "full"]), ("racecheck", []),
                                        ("synccheck", []), ("initcheck", [])])
@pytest.mark.parametrize("cache", ["fp16", "e4m3"])
@pytest.mark.parametrize("chapter", DECODE_CHAPTERS)
def test_sanitizer_finds_nothing_in_decoding(repo, chapter, tool, extra, d, cache):
    """The decoding shape under each tool, with the cache in fp16 and in e4m3 (--kv-cache: a GPU below sm_89
    skips it)."""
    sanitize(repo, tool, extra, chapter, DECODE_ARGS + ["--headdim", str(d), "--kv-cache", cache],
             ("sanitize-decode", d, cache))


@pytest.mark.parametrize("tool,text", [
    ("memcheck", "========= ERROR SUMMARY: 3 errors\n"),
    ("memcheck", "========= COMPUTE-SANITIZER\n"),
    ("racecheck", "========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)\n"),
    ("racecheck", "nothing\n")])
def test_a_sanitizer_report_of_errors_fails(tool, text):
    with pytest.raises(AssertionError):
        check_summary(tool, text, "sample")


def test_a_clean_sanitizer_report_passes():
    check_summary("memcheck", "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n", "clean")
    check_summary("racecheck", "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", "clean")
