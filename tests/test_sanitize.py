"""compute-sanitizer on every chapter (and 08's step builds) at small shapes, and on each backward
pass (--backward, both of 09's builds) (`make sanitize`,
--suite sanitize).

memcheck (with --leak-check full), racecheck, synccheck and initcheck, each on shapes that
are not tile multiples. A case passes when the sanitizer exits 0 and reports
`ERROR SUMMARY: 0 errors` (racecheck: 0 hazards, 0 errors, 0 warnings). Before the first
sanitized run of a shape, one plain run of the binary makes the shape's inputs and reference
in the cache (one worker per shape, under a lock), so that sanitized runs only read it.
Skipped, with the reason, without a GPU or without compute-sanitizer.
"""
import unittest

from sanitizer import check_summary, find_sanitizer
from test_gpu import BACKWARD_VARIANTS, STEP_BUILDS, backward_chapters

SUITE = "sanitize"
PARALLEL = 8

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


def shape_args(b, h, n, d, causal):
    return ["--batch", str(b), "--heads", str(h), "--seqlen", str(n), "--headdim", str(d),
            "--warmup", "0", "--iters", "1"] + (["--causal"] if causal else [])


def sanitize_case(chapter, tool, extra, b, h, n, d, causal, backward=False):
    def case(ctx):
        sanitizer = ctx.once("compute-sanitizer", find_sanitizer)
        if not sanitizer:
            raise unittest.SkipTest("compute-sanitizer not found (PATH, next to nvcc, /usr/local/cuda)")
        binary = ctx.require_binary(chapter, native=True)
        args = shape_args(b, h, n, d, causal) + (["--backward"] if backward else [])
        # One plain run per shape makes the cached inputs and reference for everyone.
        ctx.once(("sanitize-cache", b, h, n, d, causal, backward), lambda: ctx.run([binary, *args, "--csv"], timeout=TIMEOUT_S))
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99", "--target-processes", "application-only",
               *extra, binary, *args]
        proc = ctx.run(cmd, timeout=TIMEOUT_S)
        output = proc.stdout + proc.stderr
        shown = f"compute-sanitizer --tool {tool} {chapter}{' --backward' if backward else ''} B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
        if proc.returncode == 77:
            raise unittest.SkipTest(f"{chapter}: " + (proc.stdout.strip().splitlines() or ["exit 77"])[-1])
        reports = [line for line in output.splitlines() if line.startswith("=========")]
        assert proc.returncode == 0, (
            f"{shown}: exit {proc.returncode}, expected 0 (99: the sanitizer found errors; 1: the check failed)\n"
            + "\n".join(reports[:40] or output.strip().splitlines()[-20:]))
        check_summary(tool, output, shown)
    return case


def cases(ctx):
    out = []
    for tool, extra, b, h, n, d, causal in RUNS:
        for chapter in ctx.chapters + [build for _, build, _ in STEP_BUILDS]:  # and 08's steps, BUILD/08_fp8.stepK
            name = f"{tool}[{chapter} B={b} H={h} N={n} D={d}{' causal' if causal else ''}]"
            out.append((name, sanitize_case(chapter, tool, extra, b, h, n, d, causal)))
        for chapter in backward_chapters(ctx):
            for build in [chapter] + [f"{chapter}.{variant}" for variant in BACKWARD_VARIANTS]:
                name = f"{tool}[{build} --backward B={b} H={h} N={n} D={d}{' causal' if causal else ''}]"
                out.append((name, sanitize_case(build, tool, extra, b, h, n, d, causal, backward=True)))
    return out


def test_summary_parsing():
    """The verdict on sanitizer output, on samples of it."""
    clean = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
    check_summary("memcheck", clean, "clean")
    check_summary("racecheck", "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", "clean")
    for tool, text in [("memcheck", "========= ERROR SUMMARY: 3 errors\n"),
                       ("memcheck", "========= COMPUTE-SANITIZER\n"),
                       ("racecheck", "========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)\n"),
                       ("racecheck", "nothing\n")]:
        try:
            check_summary(tool, text, "sample")
        except AssertionError:
            continue
        raise AssertionError(f"{tool} output {text!r} was accepted; expected a failure")
