"""The graded exercises on a GPU (common/exercise_grade.py, `make grade`): every test here runs
chapter binaries, so each is marked gpu (skipped, with the harness's reason, without a usable GPU).

  grade_fails   `make grade CH=04` in a copy of the checkout, on this GPU, with 04.online_softmax's
                wrong solution: FAIL naming the matrix, exit 1, the copy not timed
  stub_correct  each speed exercise's stub, untouched, is correct: PASS at a shape that reaches
                every stub, in its pass (speed_stub times it against the chapter)
  todo          the copy with its correctness exercises stubbed, at a shape that reaches every stub
                (ragged N, causal), in each pass they are in (`pass: backward`: with --backward):
                exit 1 with "TODO: exercise NN.name is not written yet" on stderr, never a CUDA
                error, a crash or a hang
  wrong         each exercise's `wrong` solution (the chapter with one line of it changed) fails the
                matrix the grade runs for that exercise (08.pack_p: D = 64 alone; 09's: --backward),
                so that the grade cannot pass it
  speed_stub    (timed) each speed exercise alone: where a gate grades it, its stub misses that gate
                (slower than `gate` x the chapter at the gate's shape), so that an untouched copy
                cannot pass it; where its compiled code grades it (ptx_has), its time beside the
                chapter's is only shown
  grade         `make grade CH=04` in a copy of the checkout, on this GPU, the solution put
                back: PASS, exit 0 (UNGRADED, exit 77, only where racecheck cannot run here, which
                skips the test with its reason)

Student copies are compiled with the build's flags (BUILD/.flags; 08: sm_90a) and linked with its
harness objects (BUILD/common/*.o), into a temporary folder.

The timed tests share the xdist group "exercise_timing": they run one after the other, on one
worker, each build made before its timing starts, the runs unchecked (--no-check: no float64 reference
of a large shape to make; each stub's correctness is stub_correct's). Tests of other
modules may use the GPU meanwhile; the gates they check are ratios of the copy and the chapter
timed alternately in the same run (TIME_ROUNDS rounds, the best median of each), and a ratio close
to its gate on either side is timed again (up to MAX_TIME_ROUNDS), since a load slows whichever run
it overlaps: the stubs must miss their gates after those rounds too.
"""
import shlex

import pytest

import exercise_copy as copies
import exercise_grade as grader
import exercise_markers as markers
import runner
from helpers import ARCH_FLAG_OF, CHAPTERS, make_in, repo_copy, write_tree

pytestmark = pytest.mark.gpu

REACH_EVERY_STUB = (2, 3, 1000, 64, True)  # ragged, several tiles, causal: masks and updates all run
ONE_RUN = ["--warmup", "0", "--iters", "1"]
MARKED = [c for c in CHAPTERS if markers.parse(markers.chapter_source(c), c)]
NAMES = {c: list(markers.exercise_parts(markers.parse(markers.chapter_source(c), c))) for c in MARKED}
SPEED = [(c, n) for c in MARKED for n in NAMES[c] if markers.EXERCISES[n]["kind"] == "speed"]
WRONG = [(c, n) for c in MARKED for n in NAMES[c] if markers.EXERCISES[n].get("wrong")]
timed = pytest.mark.xdist_group("exercise_timing")


def compile_text(repo, chapter, text, label):
    """A chapter source (a student copy, or the chapter changed) built with the build's flags and
    linked with its harness objects; the binary's path."""
    flags = shlex.split((repo.build / ".flags").read_text())
    if chapter[:2] in ARCH_FLAG_OF:  # the Makefile builds it for its own arch, whatever ARCH says
        flags = [f for f in flags if not f.startswith("-gencode")] + [ARCH_FLAG_OF[chapter[:2]]]
    folder = write_tree(repo.tmpdir(), {f"{chapter}/attention.cu": text})
    binary = folder / f"{chapter}.student"  # beside its source folder, folder / chapter
    objects = [repo.build / "common" / "harness.o", repo.build / "common" / "npy.o"]
    proc = repo.run(flags + ["-o", binary, folder / chapter / "attention.cu", *objects], timeout=600)
    assert proc.returncode == 0, f"{chapter} ({label}) does not build:\n{proc.stderr[-2000:]}"
    return str(binary)


def build_text(repo, chapter, text, label):
    """compile_text, once per worker for each (chapter, label)."""
    return repo.once(("exercise_build", chapter, label), lambda: compile_text(repo, chapter, text, label))


def build_copy(repo, chapter, only):
    """The student copy of `chapter` (only these exercises, None: all), built; its path."""
    copy, _ = copies.student_copy(markers.chapter_source(chapter, repo.root), chapter, only)
    return build_text(repo, chapter, copy, f"the student copy of {only or 'all'}")


def chapter_binary(repo, chapter):
    """BUILD/<chapter>, or a skip where it is not built or cannot run on this GPU (08 needs sm_90a):
    a stub or a wrong solution that cannot run would fail every run for the wrong reason."""
    binary = repo.require_binary(chapter)
    usable, why = runner.gpu_probe(str(binary))
    if not usable:
        pytest.skip(f"{chapter} does not run here: {why}")
    return str(binary)


def correctness_names(chapter):
    """The chapter's correctness exercises. Only they are stubbed: a speed stub may take a path around
    a correctness block (03.one_pass's two passes skip online_update)."""
    return [n for n in NAMES[chapter] if markers.EXERCISES[n]["kind"] == "correctness"]


# --- the checks: run beside the other modules' tests ---------------------------------------------------
@pytest.mark.parametrize("chapter", MARKED)
def test_correctness_stubs_exit_with_their_todo(repo, chapter):
    chapter_binary(repo, chapter)
    names = correctness_names(chapter)
    binary = build_copy(repo, chapter, names)
    for pass_name in grader.matrix_passes(names):  # 09's stubs are in the backward: reached with --backward
        shape = REACH_EVERY_STUB + (pass_name,)
        status, _, note = grader.run_case(binary, chapter, grader.case_args(shape) + ONE_RUN)
        shown = f"{chapter}, its correctness exercises stubbed, {grader.case_text(shape)}"
        assert status == "error" and note.startswith("TODO: exercise") and "not written yet" in note, (
            f"{shown}: expected exit 1 with the TODO message, got {status}: {note!r}")


@pytest.mark.parametrize("chapter, name", SPEED, ids=[n for _, n in SPEED])
def test_speed_stub_is_correct(repo, chapter, name):
    chapter_binary(repo, chapter)
    binary = build_copy(repo, chapter, [name])
    shape = REACH_EVERY_STUB + (markers.pass_of(markers.EXERCISES[name]),)
    status, _, note = grader.run_case(binary, chapter, grader.case_args(shape) + ONE_RUN)
    assert status == "PASS", f"{name}: its stub should be correct; {grader.case_text(shape)}: {status} {note}"


@pytest.mark.parametrize("chapter, name", WRONG, ids=[n for _, n in WRONG])
def test_wrong_solution_fails_the_grades_matrix(repo, chapter, name):
    chapter_binary(repo, chapter)
    wrong = markers.wrong_solution(markers.chapter_source(chapter, repo.root), name)
    binary = build_text(repo, chapter, wrong, f"{name}'s wrong solution")
    # The grade fails on one failed run: the matrix's cases one at a time, up to the first that fails.
    cases, failures = grader.matrix_cases([name]), []
    for case in cases:
        if grader.matrix(binary, chapter, [case], failures):
            break
    assert failures, f"{name}: its wrong solution passes all {len(cases)} runs of the grade's matrix"


def make_in_copy(repo, copy, *args):
    """make ARGS in a copy of the checkout, on this GPU."""
    return make_in(repo, copy, *args, hide_gpu=False)


def graded_copy(repo, folder, chapter, solution_of):
    """A copy of the checkout in folder with `make exercise` done for `chapter` and the student copy's
    regions filled from solution_of(chapter's source); its path."""
    copy = repo_copy(repo, folder)
    made = make_in_copy(repo, copy, "exercise", f"CH={chapter[:2]}")
    assert made.returncode == 0, f"make exercise CH={chapter[:2]}: {made.stderr.strip()}"
    student = copy / "exercises" / chapter / "attention.cu"
    student.write_text(copies.restore(student.read_text(), solution_of(markers.chapter_source(chapter, repo.root))))
    return copy


@pytest.mark.xdist_group("make_grade_wrong")  # sent first (conftest.SENT_FIRST): a minute of builds
def test_grade_fails_on_a_wrong_solution(repo, tmp_path):
    """make grade end to end on a wrong solution (04.online_softmax's): FAIL naming the matrix, and
    the copy not timed."""
    chapter = "04_fused"
    chapter_binary(repo, chapter)
    copy = graded_copy(repo, tmp_path, chapter, lambda source: markers.wrong_solution(source, "04.online_softmax"))
    graded = make_in_copy(repo, copy, "grade", "CH=04")
    last = (graded.stdout.splitlines() or [""])[-1]
    assert "Error 1" in graded.stderr and last.startswith(f"FAIL {chapter}") and "the GPU matrix" in last and \
        "not timed" in graded.stdout, (
        f"make grade CH=04, a wrong solution, on this GPU: expected FAIL naming the matrix, untimed:\n{graded.stdout}"
        f"{graded.stderr[-2000:]}")


# --- the timed stubs: one at a time, on one worker ----------------------------------------------------------
@timed
@pytest.mark.parametrize("chapter, name", SPEED, ids=[n for _, n in SPEED])
def test_speed_stub_misses_its_gate(repo, chapter, name):
    solution = chapter_binary(repo, chapter)
    binary = build_copy(repo, chapter, [name])  # that the stub is correct: test_speed_stub_is_correct
    info = markers.EXERCISES[name]
    shape, column, pass_name = markers.timed_as(info)
    # Timed without the check (the stub's correctness is test_speed_stub_is_correct's): no float64
    # reference of the large timed shape to make first.
    ratio, line = grader.timing(binary, solution, chapter, shape, column, pass_name, checked=False,
                                gate=info.get("gate"))
    assert ratio is not None, f"{name}: {line}"
    if info.get("gate"):
        assert ratio > info["gate"], f"{name}: the untouched stub passes its own gate (<= {info['gate']:.2f}x): {line}"
    else:
        print(f"{line} (no gate: graded by its PTX)")


# --- make grade of the solution, beside the timed stubs (its gate, too, is a ratio of two times taken in turn) --
@pytest.mark.xdist_group("make_grade_solution")  # sent first (conftest.SENT_FIRST)
def test_grade_passes_the_solution_on_this_gpu(repo, tmp_path):
    chapter = "04_fused"
    chapter_binary(repo, chapter)
    copy = graded_copy(repo, tmp_path, chapter, lambda source: source)
    (copy / "build" / "exercises").mkdir(parents=True, exist_ok=True)  # as make grade makes it first
    built = make_in_copy(repo, copy, f"build/{chapter}", f"build/exercises/{chapter}")  # built before timing
    assert built.returncode == 0, f"make build/{chapter} build/exercises/{chapter}: {built.stderr.strip()[-2000:]}"
    graded = make_in_copy(repo, copy, "grade", "CH=04")
    last = (graded.stdout.splitlines() or [""])[-1]
    if last.startswith("UNGRADED") and "racecheck" in last and "the GPU matrix" not in last:
        pytest.skip(f"racecheck cannot run here, so no grade passes: {last}")
    assert graded.returncode == 0 and last.startswith(f"PASS {chapter}"), (
        f"make grade CH=04, the solution put back, on this GPU: expected PASS:\n{graded.stdout}{graded.stderr[-2000:]}")
