"""The graded exercises on a GPU, the part that does not time (common/exercises.py): beside the
other modules. test_gpu_exercises.py times the speed stubs and grades a solution, alone.

  grade_fails   `make grade CH=09` in a copy of the repository, on this GPU, with 09.ds's wrong
                solution: FAIL naming the matrix, exit 1
  stub_correct  each speed exercise's stub, untouched, is correct: PASS at a shape that reaches
                every stub, in its pass (test_gpu_exercises.py times it against the chapter)
  todo          the copy with its correctness exercises stubbed, at a shape that reaches every stub
                (ragged N, causal), in each pass they are in (`pass: backward`: with --backward):
                exit 1 with "TODO: exercise NN.name is not written yet" on stderr, never a CUDA
                error, a crash or a hang
  wrong         each exercise's `wrong` solution (the chapter with one line of it changed) fails the
                matrix the grade runs for that exercise (08.pack_p: D = 64 alone; 09's: --backward),
                so that the grade cannot pass it
"""

import exercises as ex
from test_cpu_exercises import marked_chapters
from test_gpu_exercises import REACH_EVERY_STUB, build_copy, build_text, graded_copy, make_in_copy

SUITE = "gpu"
PARALLEL = 4  # small runs, and builds: beside test_gpu on the GPU


def correctness_names(ctx, chapter):
    """The chapter's correctness exercises. Only they are stubbed: a speed stub may take a path around
    a correctness block (03.one_pass's two passes skip online_update)."""
    return [n for n in ex.exercise_parts(ex.parse(ex.chapter_source(chapter, ctx.root), chapter))
            if ex.EXERCISES[n]["kind"] == "correctness"]


def todo_case(chapter):
    def case(ctx):
        ctx.require_binary(chapter, native=True)
        names = correctness_names(ctx, chapter)
        binary = build_copy(ctx, chapter, names)
        notes = []
        for pass_name in ex.matrix_passes(names):  # 09's stubs are in the backward: reached with --backward
            shape = REACH_EVERY_STUB + (pass_name,)
            status, _, note = ex.run_case(binary, chapter, ex.case_args(shape) + ["--warmup", "0", "--iters", "1"])
            shown = f"{chapter}, its correctness exercises stubbed, {ex.case_text(shape)}"
            assert status == "error" and note.startswith("TODO: exercise") and "not written yet" in note, (
                f"{shown}: expected exit 1 with the TODO message, got {status}: {note!r}")
            notes.append(note)
        return "; ".join(notes)
    return case


def stub_correct_case(chapter, name):
    def case(ctx):
        ctx.require_binary(chapter, native=True)
        binary = build_copy(ctx, chapter, [name])  # the build test_gpu_exercises times
        shape = REACH_EVERY_STUB + (ex.pass_of(ex.EXERCISES[name]),)
        status, _, note = ex.run_case(binary, chapter, ex.case_args(shape) + ["--warmup", "0", "--iters", "1"])
        assert status == "PASS", f"{name}: its stub should be correct; {ex.case_text(shape)}: {status} {note}"
        return ex.case_text(shape)
    return case


def wrong_case(chapter, name):
    def build(ctx):
        wrong = ex.wrong_solution(ex.chapter_source(chapter, ctx.root), name)
        return build_text(ctx, chapter, wrong, f"{name}'s wrong solution")

    def case(ctx):
        ctx.require_binary(chapter, native=True)
        binary = build(ctx)
        # The grade fails on one failed run: the matrix's cases one at a time, up to the first that fails.
        cases, failures = ex.matrix_cases([name]), []
        with ctx.captured_stdout():
            for ran, case in enumerate(cases, 1):
                if ex.matrix(binary, chapter, [case], failures):
                    break
        assert failures, f"{name}: its wrong solution passes all {len(cases)} runs of the grade's matrix"
        return f"run {ran} of the grade's {len(cases)} fails: {ex.case_text(failures[0])}"
    return case


def cases(ctx):
    out = [("grade_fails[09.ds]", grade_fails)]
    for chapter in marked_chapters(ctx):
        names = ex.exercise_parts(ex.parse(ex.chapter_source(chapter, ctx.root), chapter))
        out.append((f"todo[{chapter}]", todo_case(chapter)))
        out += [(f"stub_correct[{name}]", stub_correct_case(chapter, name)) for name in names
                if ex.EXERCISES[name]["kind"] == "speed"]
        out += [(f"wrong[{name}]", wrong_case(chapter, name)) for name in names if ex.EXERCISES[name].get("wrong")]
    return out


def grade_fails(ctx):
    """make grade end to end on a wrong solution: 09's (its grade times a backward of 5 ms; 04's
    times a forward of its own FFMA kernel, which made this the longest case of make test). A case,
    the first of the module's, so that the others run beside it: its two builds, its matrix (four
    shapes at a time), racecheck and timing took 186 s beside the other modules on the H200."""
    chapter = "09_backward"
    ctx.require_binary(chapter, native=True)
    copy = graded_copy(ctx, chapter, lambda source: ex.wrong_solution(source, "09.ds"))
    graded = make_in_copy(ctx, copy, "grade", "CH=09")
    last = (graded.stdout.splitlines() or [""])[-1]
    assert "Error 1" in graded.stderr and last.startswith(f"FAIL {chapter}") and "the GPU matrix" in last, (
        f"make grade CH=09, a wrong solution, on this GPU: expected FAIL naming the matrix:\n{graded.stdout}")
    return last[:80]
