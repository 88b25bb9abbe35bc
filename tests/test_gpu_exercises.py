"""The graded exercises on a GPU: what a stub does when it runs (common/exercises.py).

Student copies are compiled here with the native build's flags (BUILD/.flags) and linked with
its harness objects (BUILD/common/*.o), into a temporary folder.

  todo        the copy with its correctness exercises stubbed, at a shape that reaches every stub
              (ragged N, causal): exit 1 with "TODO: exercise NN.name is not written yet" on stderr,
              never a CUDA error, a crash or a hang
  speed_stub  each speed exercise alone: its stub is correct (PASS at a ragged causal shape) and
              misses its gate (slower than `gate` x the chapter at the gate's shape), so that an
              untouched copy cannot pass it
"""
import shlex

import exercises as ex
from test_cpu_exercises import ARCH_FLAG_OF, marked_chapters, write_tree

SUITE = "gpu"
PARALLEL = 1  # timings: one binary at a time
REACH_EVERY_STUB = (2, 3, 1000, 64, True)  # ragged, several tiles, causal: masks and updates all run


def build_copy(ctx, chapter, only):
    """The student copy of `chapter` (only these exercises, None: all), built natively; its path."""
    flags = shlex.split((ctx.build / ".flags").read_text())
    if chapter[:2] in ARCH_FLAG_OF:  # the Makefile builds it for its own arch, whatever ARCH says
        flags = [f for f in flags if not f.startswith("-gencode")] + [ARCH_FLAG_OF[chapter[:2]]]
    copy, _ = ex.student_copy(ex.chapter_source(chapter, ctx.root), chapter, only)
    folder = write_tree(ctx, {f"{chapter}/attention.cu": copy})
    binary = folder / f"{chapter}.student"  # beside its source folder, folder / chapter
    objects = [ctx.build / "common" / "harness.o", ctx.build / "common" / "npy.o"]
    proc = ctx.run(flags + ["-o", binary, folder / chapter / "attention.cu", *objects], timeout=600)
    assert proc.returncode == 0, f"{chapter} ({only or 'all'}): the student copy does not build:\n{proc.stderr[-2000:]}"
    return str(binary)


def todo_case(chapter):
    def case(ctx):
        ctx.require_binary(chapter, native=True)
        # The correctness exercises stubbed; the speed ones keep their solution, since a speed stub
        # may take a path around a correctness block (03.one_pass's two passes skip online_update).
        names = [b["name"] for b in ex.parse(ex.chapter_source(chapter, ctx.root), chapter)
                 if ex.EXERCISES[b["name"]]["kind"] == "correctness"]
        binary = build_copy(ctx, chapter, names)
        status, row, note = ex.run_case(binary, chapter, ex.shape_args(REACH_EVERY_STUB) + ["--warmup", "0", "--iters", "1"])
        shown = f"{chapter}, its correctness exercises stubbed, {ex.shape_text(REACH_EVERY_STUB)}"
        assert status == "error" and note.startswith("TODO: exercise") and "not written yet" in note, (
            f"{shown}: expected exit 1 with the TODO message, got {status}: {note!r}")
        return note
    return case


def speed_case(chapter, name):
    def case(ctx):
        solution = str(ctx.require_binary(chapter, native=True))
        binary = build_copy(ctx, chapter, [name])
        status, _, note = ex.run_case(binary, chapter, ex.shape_args(REACH_EVERY_STUB) + ["--warmup", "0", "--iters", "1"])
        assert status == "PASS", f"{name}: its stub should be correct; {ex.shape_text(REACH_EVERY_STUB)}: {status} {note}"
        info = ex.EXERCISES[name]
        ratio, line = ex.timing(binary, solution, chapter, *ex.timed_as(info))
        assert ratio is not None, f"{name}: {line}"
        assert ratio > info["gate"], f"{name}: the untouched stub passes its own gate (<= {info['gate']:.2f}x): {line}"
        return line
    return case


def cases(ctx):
    out = []
    for chapter in marked_chapters(ctx):
        out.append((f"todo[{chapter}]", todo_case(chapter)))
        for block in ex.parse(ex.chapter_source(chapter, ctx.root), chapter):
            if ex.EXERCISES[block["name"]]["kind"] == "speed":
                out.append((f"speed_stub[{block['name']}]", speed_case(chapter, block["name"])))
    return out
