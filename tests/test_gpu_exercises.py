"""The graded exercises on a GPU: what a stub does when it runs, and what the grade says of it
(common/exercises.py).

Student copies are compiled here with the native build's flags (BUILD/.flags) and linked with
its harness objects (BUILD/common/*.o), into a temporary folder.

  todo        the copy with its correctness exercises stubbed, at a shape that reaches every stub
              (ragged N, causal), in each pass they are in (`pass: backward`: with --backward): exit 1
              with "TODO: exercise NN.name is not written yet" on stderr, never a CUDA error, a crash or
              a hang
  speed_stub  each speed exercise alone: its stub is correct (PASS at a ragged causal shape, in its
              pass) and,
              where a gate grades it, misses that gate (slower than `gate` x the chapter at the
              gate's shape), so that an untouched copy cannot pass it; where its compiled code
              grades it (ptx_has), its time beside the chapter's is reported
  wrong       each exercise's `wrong` solution (the chapter with one line of it changed) fails the
              matrix the grade runs for that exercise (08.pack_p: D = 64 alone; 09's: --backward), so
              that the grade cannot pass it
  grade       `make grade CH=04` in a copy of the repository, on this GPU: the solution put back
              passes (PASS, exit 0; UNGRADED, exit 77, only where racecheck cannot run here, which
              skips the test with its reason), the wrong solution fails (exit 1)
"""
import contextlib
import io
import shlex
import sys
import unittest

import exercises as ex
from test_cpu_exercises import ARCH_FLAG_OF, marked_chapters, repo_copy, write_tree

SUITE = "gpu"
PARALLEL = 1  # timings: one binary at a time
ALONE = True  # and nothing else on the GPU or the CPU meanwhile; the builds are done ahead (prepare)
REACH_EVERY_STUB = (2, 3, 1000, 64, True)  # ragged, several tiles, causal: masks and updates all run


def build_text(ctx, chapter, text, label):
    """A chapter source (a student copy, or the chapter changed), built natively once; its path."""
    return ctx.once(("gpu_exercise_build", chapter, label), lambda: compile_text(ctx, chapter, text, label))


def compile_text(ctx, chapter, text, label):
    flags = shlex.split((ctx.build / ".flags").read_text())
    if chapter[:2] in ARCH_FLAG_OF:  # the Makefile builds it for its own arch, whatever ARCH says
        flags = [f for f in flags if not f.startswith("-gencode")] + [ARCH_FLAG_OF[chapter[:2]]]
    folder = write_tree(ctx, {f"{chapter}/attention.cu": text})
    binary = folder / f"{chapter}.student"  # beside its source folder, folder / chapter
    objects = [ctx.build / "common" / "harness.o", ctx.build / "common" / "npy.o"]
    proc = ctx.run(flags + ["-o", binary, folder / chapter / "attention.cu", *objects], timeout=600)
    assert proc.returncode == 0, f"{chapter} ({label}) does not build:\n{proc.stderr[-2000:]}"
    return str(binary)


def build_copy(ctx, chapter, only):
    """The student copy of `chapter` (only these exercises, None: all), built natively; its path."""
    copy, _ = ex.student_copy(ex.chapter_source(chapter, ctx.root), chapter, only)
    return build_text(ctx, chapter, copy, f"the student copy of {only or 'all'}")


def todo_case(chapter):
    def build(ctx):
        # The correctness exercises stubbed; the speed ones keep their solution, since a speed stub
        # may take a path around a correctness block (03.one_pass's two passes skip online_update).
        names = [n for n in ex.exercise_parts(ex.parse(ex.chapter_source(chapter, ctx.root), chapter))
                 if ex.EXERCISES[n]["kind"] == "correctness"]
        return build_copy(ctx, chapter, names)

    def case(ctx):
        ctx.require_binary(chapter, native=True)
        binary = build(ctx)
        names = [n for n in ex.exercise_parts(ex.parse(ex.chapter_source(chapter, ctx.root), chapter))
                 if ex.EXERCISES[n]["kind"] == "correctness"]
        notes = []
        for pass_name in ex.matrix_passes(names):  # 09's stubs are in the backward: reached with --backward
            case = REACH_EVERY_STUB + (pass_name,)
            status, row, note = ex.run_case(binary, chapter, ex.case_args(case) + ["--warmup", "0", "--iters", "1"])
            shown = f"{chapter}, its correctness exercises stubbed, {ex.case_text(case)}"
            assert status == "error" and note.startswith("TODO: exercise") and "not written yet" in note, (
                f"{shown}: expected exit 1 with the TODO message, got {status}: {note!r}")
            notes.append(note)
        return "; ".join(notes)
    case.prepare = build
    return case


def speed_case(chapter, name):
    def build(ctx):
        return build_copy(ctx, chapter, [name])

    def case(ctx):
        solution = str(ctx.require_binary(chapter, native=True))
        binary = build(ctx)
        info = ex.EXERCISES[name]
        case = REACH_EVERY_STUB + (ex.pass_of(info),)
        status, _, note = ex.run_case(binary, chapter, ex.case_args(case) + ["--warmup", "0", "--iters", "1"])
        assert status == "PASS", f"{name}: its stub should be correct; {ex.case_text(case)}: {status} {note}"
        ratio, line = ex.timing(binary, solution, chapter, *ex.timed_as(info))
        assert ratio is not None, f"{name}: {line}"
        if info.get("gate"):
            assert ratio > info["gate"], f"{name}: the untouched stub passes its own gate (<= {info['gate']:.2f}x): {line}"
            return line
        return f"{line} (no gate: graded by its PTX)"
    case.prepare = build
    return case


def wrong_case(chapter, name):
    def build(ctx):
        wrong = ex.wrong_solution(ex.chapter_source(chapter, ctx.root), name)
        return build_text(ctx, chapter, wrong, f"{name}'s wrong solution")

    def case(ctx):
        ctx.require_binary(chapter, native=True)
        binary = build(ctx)
        cases, failures = ex.matrix_cases([name]), []
        with contextlib.redirect_stdout(io.StringIO()):
            failed = ex.matrix(binary, chapter, cases, failures)
        assert failed, f"{name}: its wrong solution passes all {len(cases)} runs of the grade's matrix"
        return f"{failed} of {len(cases)} runs fail, e.g. {ex.case_text(failures[0])}"
    case.prepare = build
    return case


def cases(ctx):
    out = []
    for chapter in marked_chapters(ctx):
        out.append((f"todo[{chapter}]", todo_case(chapter)))
        for name in ex.exercise_parts(ex.parse(ex.chapter_source(chapter, ctx.root), chapter)):
            if ex.EXERCISES[name]["kind"] == "speed":
                out.append((f"speed_stub[{name}]", speed_case(chapter, name)))
            if ex.EXERCISES[name].get("wrong"):
                out.append((f"wrong[{name}]", wrong_case(chapter, name)))
    return out


def test_grade_on_this_gpu(ctx):
    chapter = "04_fused"
    ctx.require_binary(chapter, native=True)
    copy = repo_copy(ctx)

    def make(*args):
        return ctx.run(shlex.split(ctx.make) + ["--no-print-directory", f"PYTHON_SYS={sys.executable}", "BUILD=build",
                                                *args], cwd=copy, timeout=900)
    made = make("exercise", "CH=04")
    assert made.returncode == 0, f"make exercise CH=04: {made.stderr.strip()}"
    student = copy / "exercises" / chapter / "attention.cu"
    handed = student.read_text()
    source = ex.chapter_source(chapter, ctx.root)
    student.write_text(ex.restore(handed, source))
    graded = make("grade", "CH=04")
    last = (graded.stdout.splitlines() or [""])[-1]
    if last.startswith("UNGRADED") and "racecheck" in last and "the GPU matrix" not in last:
        raise unittest.SkipTest(f"racecheck cannot run here, so no grade passes: {last}")
    assert graded.returncode == 0 and last.startswith(f"PASS {chapter}"), (
        f"make grade CH=04, the solution put back, on this GPU: expected PASS:\n{graded.stdout}{graded.stderr[-2000:]}")
    student.write_text(ex.restore(handed, ex.wrong_solution(source, "04.online_softmax")))
    graded = make("grade", "CH=04")
    wrong_last = (graded.stdout.splitlines() or [""])[-1]
    assert "Error 1" in graded.stderr and wrong_last.startswith(f"FAIL {chapter}") and "the GPU matrix" in wrong_last, (
        f"make grade CH=04, a wrong solution, on this GPU: expected FAIL naming the matrix:\n{graded.stdout}")
    return f"{last} / {wrong_last[:80]}"
