"""The graded exercises on a GPU, the part that times (common/exercises.py): run alone, after the
other modules, its builds done ahead. test_gpu_exercise_checks.py runs the rest (the stubs' TODO
exits, the wrong solutions, a wrong grade) beside the other modules.

Student copies are compiled here with the native build's flags (BUILD/.flags) and linked with
its harness objects (BUILD/common/*.o), into a temporary folder.

  speed_stub  each speed exercise alone: where a gate grades it, its stub misses that gate (slower
              than `gate` x the chapter at the gate's shape), so that an untouched copy cannot pass
              it; where its compiled code grades it (ptx_has), its time beside the chapter's is
              reported (that the stub is correct, test_gpu_exercise_checks checks); its build and
              the timed shape's inputs and reference are made ahead
  grade       `make grade CH=04` in a copy of the repository, on this GPU, the solution put back:
              PASS, exit 0 (UNGRADED, exit 77, only where racecheck cannot run here, which skips
              the test with its reason); the copy, the student copy and the builds are made ahead
"""
import shlex
import unittest

import exercises as ex
from test_cpu_exercises import ARCH_FLAG_OF, make_in, marked_chapters, repo_copy, write_tree

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


def speed_case(chapter, name):
    def build(ctx):
        return build_copy(ctx, chapter, [name])

    def prepare(ctx):
        """The build, and the timed shape's inputs and reference made in the cache (once per shape),
        so that the timed runs find them."""
        build(ctx)
        shape, _, pass_name = ex.timed_as(ex.EXERCISES[name])
        case = tuple(shape) + (pass_name,)
        solution = str(ctx.require_binary(chapter, native=True))
        fp8_floor = chapter[:2] == "08"  # 08's reference has its e4m3 floor files besides the others
        ctx.once(("timed_shape_in_cache", fp8_floor, case),
                 lambda: ex.run_case(solution, chapter, ex.case_args(case) + ["--warmup", "0", "--iters", "1"]))

    def case(ctx):
        solution = str(ctx.require_binary(chapter, native=True))
        binary = build(ctx)  # that the stub is correct, test_gpu_exercise_checks checks beside the others
        info = ex.EXERCISES[name]
        ratio, line = ex.timing(binary, solution, chapter, *ex.timed_as(info))
        assert ratio is not None, f"{name}: {line}"
        if info.get("gate"):
            assert ratio > info["gate"], f"{name}: the untouched stub passes its own gate (<= {info['gate']:.2f}x): {line}"
            return line
        return f"{line} (no gate: graded by its PTX)"
    case.prepare = prepare
    return case


def cases(ctx):
    return [(f"speed_stub[{name}]", speed_case(chapter, name)) for chapter in marked_chapters(ctx)
            for name in ex.exercise_parts(ex.parse(ex.chapter_source(chapter, ctx.root), chapter))
            if ex.EXERCISES[name]["kind"] == "speed"]


def make_in_copy(ctx, copy, *args):
    """make ARGS in a repository copy, on this GPU."""
    return make_in(ctx, copy, *args, hide_gpu=False)


def graded_copy(ctx, chapter, solution_of):
    """A copy of the repository with `make exercise` done for `chapter` and the student copy's
    regions filled from solution_of(chapter's source); its path."""
    copy = repo_copy(ctx)
    made = make_in_copy(ctx, copy, "exercise", f"CH={chapter[:2]}")
    assert made.returncode == 0, f"make exercise CH={chapter[:2]}: {made.stderr.strip()}"
    student = copy / "exercises" / chapter / "attention.cu"
    student.write_text(ex.restore(student.read_text(), solution_of(ex.chapter_source(chapter, ctx.root))))
    return copy


def solution_copy(ctx):
    """The grade's copy with 04's solution put back, and what `make grade` builds, made once."""
    def make():
        copy = graded_copy(ctx, "04_fused", lambda source: source)
        (copy / "build" / "exercises").mkdir(parents=True, exist_ok=True)  # as make grade makes it first
        built = make_in_copy(ctx, copy, "build/04_fused", "build/exercises/04_fused")
        assert built.returncode == 0, f"make build/04_fused build/exercises/04_fused: {built.stderr.strip()[-2000:]}"
        return copy
    return ctx.once(("gpu_grade_solution_copy",), make)


def test_grade_on_this_gpu(ctx):
    chapter = "04_fused"
    ctx.require_binary(chapter, native=True)
    graded = make_in_copy(ctx, solution_copy(ctx), "grade", "CH=04")
    last = (graded.stdout.splitlines() or [""])[-1]
    if last.startswith("UNGRADED") and "racecheck" in last and "the GPU matrix" not in last:
        raise unittest.SkipTest(f"racecheck cannot run here, so no grade passes: {last}")
    assert graded.returncode == 0 and last.startswith(f"PASS {chapter}"), (
        f"make grade CH=04, the solution put back, on this GPU: expected PASS:\n{graded.stdout}{graded.stderr[-2000:]}")
    return last


test_grade_on_this_gpu.prepare = solution_copy
