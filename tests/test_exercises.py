"""The graded exercises (common/exercise_markers.py, exercise_copy.py, exercise_grade.py,
exercise_handout.py; `make exercise`, `make grade`, `make handout`), without a GPU.

  markers        every chapter's EXERCISE markers are well-formed (BEGIN/STUB/END paired, each
                 exercise in one chapter, NN.-prefixed, with a task and its facts), 01-08 have a
                 correctness and a speed exercise each, and malformed markers are refused; an
                 exercise of several blocks is cut and put back whole
  facts          the facts lines after a BEGIN line parse into what the grader uses (prose joined,
                 patterns and code exact, named and explicit shapes), read back what fact_lines
                 writes, and a malformed line, an unknown field or incomplete facts are refused
                 with the file and line; a hand-out's stand-in holds them, without `wrong'
  restore        each student copy (all exercises, and each one alone) with the chapter's blocks
                 put back is the chapter, byte for byte
  comments       the markers are comments: each chapter's code (claims.strip_comments) is the same
                 with its marker, facts and STUB lines taken out, so it compiles to the same code
  compiles       each chapter's student copy with every exercise cut (which holds every stub)
                 compiles for sm_90 with the chapter's flags (the Makefile's BUILD/.flags line,
                 ARCH=sm_90; 08: sm_90a), without a warning (nvcc -c)
  ptx_check      each exercise's `ptx_has` check holds on the chapter's PTX and fails on the
                 copy with that exercise's stub (nvcc -ptx with the Makefile's flags)
  dims           an exercise that runs at some head dims only (`dims`, 08.pack_p: D = 64): its
                 `wrong` solution changes the PTX of the kernels at those dims and of no other, so
                 that the grade's matrix, which runs those dims, runs the exercise's code
  readme         each chapter README states each exercise, its make commands and its gate (or,
                 for an exercise graded by its compiled code, the instruction it checks)
  words          what the grade prints is made of sentences: every claim of a chapter with
                 exercises has its words, docs cited by a hint exist, `wrong` solutions apply
  make           in a copy of the checkout (the real exercises/ is never touched), with
                 CUDA_VISIBLE_DEVICES= (no GPU): `make exercise` writes the copy and refuses to
                 overwrite an edited one; `make grade` on the untouched copy builds it, names the
                 TODO, says the failed claim in words, prints one line saying the GPU part did
                 not run and fails
  grader         the GPU part's bookkeeping (matrix lines, the TODO message, timing ratios) and
                 the verdicts (PASS, FAIL, UNGRADED with exit 77) on stand-in binaries that print
                 the harness's CSV; an exercise of the backward pass (`pass: backward`, 09's) has
                 every run of its grade made with --backward
  handout        `make handout CH=04` packs the copy, the harness, the grader, the Makefile and
                 no solution line, no other chapter, no chapter README, no docs/results; unpacked,
                 `make exercise FORCE=1` there gives back the copy handed out, and with a wrong
                 solution put back (it compiles, its static checks pass) `make grade CH=04` there
                 builds the copy and says UNGRADED, never PASS, exit 77 (make: "Error 77")

The make tests compile only the student copy, for sm_90 alone (ARCH=sm_90): make writes the copy's
(or the unpacked hand-out's) own BUILD/.flags, then seed_build puts this checkout's harness objects
and 04's object and binary there, newer than .flags; without a GPU, a grade only asks the chapter's
binary whether there is one.
"""
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

import claims
import exercise_copy as copies
import exercise_grade as grader
import exercise_markers as markers
from helpers import CHAPTERS, compile_quietly, fake_binary, make_in, nvcc_flags, repo_copy, write_tree

EXERCISE_CHAPTERS = range(1, 9)  # 01-08 each have a correctness and a speed exercise
MARKED = [c for c in CHAPTERS if markers.parse(markers.chapter_source(c), c)]
NAMES = {c: list(markers.exercise_parts(markers.parse(markers.chapter_source(c), c))) for c in MARKED}
# (chapter, label, only): every exercise at once, then each alone.
VARIANTS = [(c, "all", None) for c in MARKED] + [(c, name, [name]) for c in MARKED for name in NAMES[c]]
WITH_PTX_CHECK = [(c, n) for c in MARKED for n in NAMES[c] if markers.EXERCISES[n].get("ptx_has")]
WITH_DIMS = [(c, n) for c in MARKED for n in NAMES[c]
             if markers.EXERCISES[n].get("dims") and markers.EXERCISES[n].get("wrong")]


# --- markers -------------------------------------------------------------------------------------
def test_markers_well_formed(repo):
    found = {}
    for chapter in CHAPTERS:
        blocks = markers.parse(markers.chapter_source(chapter, repo.root), f"{chapter}/attention.cu")
        markers.check_blocks(blocks, chapter)
        for name in markers.exercise_parts(blocks):
            assert name not in found, f"{name} is marked in {found.get(name)} and {chapter}"
            found[name] = chapter
    orphans = sorted(set(markers.EXERCISES) - set(found))
    assert not orphans, f"EXERCISES reads facts of exercises no chapter marks: {orphans}"
    for name, chapter in found.items():
        assert markers.EXERCISES[name] == markers.chapter_facts(chapter, repo.root)[name], (
            f"{name}: EXERCISES is not its facts")
    for number in EXERCISE_CHAPTERS:
        kinds = {markers.EXERCISES[n]["kind"] for n, c in found.items() if int(c[:2]) == number}
        assert kinds == {"correctness", "speed"}, (
            f"chapter {number:02d} has exercises of kinds {sorted(kinds)}, expected a correctness and a speed one")
    for name, info in markers.EXERCISES.items():
        if info["kind"] == "speed":
            assert len(info["shape"]) == 5 and info["stub"], (
                f"{name}: a speed exercise needs a shape (B, H, N, D, causal) and what makes the stub slow")
            assert (info.get("gate") or 0) > 1 or info.get("ptx_has"), (
                f"{name}: a speed exercise is graded by a gate above 1 or by a ptx_has check of its compiled code")
        for check in info.get("ptx_has", []):
            missing = {"pattern", "shown", "means", "todo"} - set(check)
            assert not missing, f"{name}: its ptx_has check lacks {sorted(missing)}"
        assert set(info.get("dims", markers.HEAD_DIMS)) <= set(markers.HEAD_DIMS), f"{name}: dims {info['dims']}"


# The facts of the synthetic exercises below (04.s, a speed one; any other name but 04.zz, a
# correctness one), inserted after each BEGIN line that has a task by with_facts.
SYNTHETIC_FACTS = {"speed": ["kind: speed", "gate: 1.10x", "shape: B=1 H=1 N=1 D=64", "hint: h", "stub: s"],
                   "correctness": ["kind: correctness", "hint: h"]}


def with_facts(text):
    """The synthetic text with the facts of each exercise after the BEGIN line that has its task."""
    out = []
    for line in text.splitlines(keepends=True):
        out.append(line)
        begin = markers.BEGIN.match(line)
        if begin and begin["task"] and begin["name"] != "04.zz":
            ending = line[len(line.rstrip("\r\n")):]
            kind = "speed" if begin["name"].endswith(".s") else "correctness"
            out += [f"{begin['indent']}//   {fact}{ending}" for fact in SYNTHETIC_FACTS[kind]]
    return "".join(out)


BAD_MARKERS = {
    "BEGIN without END": "{\n    // EXERCISE 04.a BEGIN: x\n    y();\n}\n",
    "END without BEGIN": "{\n    y();\n    // EXERCISE END\n}\n",
    "nested": "{\n    // EXERCISE 04.a BEGIN: x\n    // EXERCISE 04.b BEGIN: x\n    // EXERCISE END\n}\n",
    "STUB of another block": "{\n    // EXERCISE 04.a BEGIN: x\n    // EXERCISE 04.b STUB\n    // EXERCISE END\n}\n",
    "stub line not commented": "{\n    // EXERCISE 04.a BEGIN: x\n    y();\n    // EXERCISE 04.a STUB\n"
                               "    z();\n    // EXERCISE END\n}\n",
    "misspelt marker": "{\n    // EXERCISE 04.a BEGINS: x\n    y();\n    // EXERCISE END\n}\n",
    "BEGIN: with no task": "{\n    // EXERCISE 04.a BEGIN:\n    y();\n    // EXERCISE END\n}\n",
}
BAD_BLOCKS = {
    "no block of a name with a task": "{\n    // EXERCISE 04.a BEGIN\n    y();\n    // EXERCISE END\n"
                                      "    // EXERCISE 04.a BEGIN\n    z();\n    // EXERCISE END\n}\n",
    "a speed exercise without a stub in any part": (
        "// EXERCISE 04.s BEGIN: x\nint x;\n// EXERCISE END\n{\n    // EXERCISE 04.s BEGIN\n    y();\n"
        "    // EXERCISE END\n}\n"),
    "a correctness exercise with no part inside a function": (
        "// EXERCISE 04.a BEGIN: x\nint x;\n// EXERCISE END\n// EXERCISE 04.a BEGIN\nint y;\n// EXERCISE END\n"),
    "another chapter's name": "{\n    // EXERCISE 05.a BEGIN: x\n    y();\n    // EXERCISE END\n}\n",
    "no facts": "{\n    // EXERCISE 04.zz BEGIN: x\n    y();\n    // EXERCISE END\n}\n",
    "a speed exercise without a stub": "{\n    // EXERCISE 04.s BEGIN: x\n    y();\n    // EXERCISE END\n}\n",
    "EXERCISE_TODO at file scope": "// EXERCISE 04.a BEGIN: x\nint y;\n// EXERCISE END\n",
    "a correctness stub without its EXERCISE_TODO": (
        "{\n    // EXERCISE 04.a BEGIN: x\n    y();\n    // EXERCISE 04.a STUB\n    // (void)z;\n"
        "    // EXERCISE END\n}\n"),
}


@pytest.mark.parametrize("label", list(BAD_MARKERS) + list(BAD_BLOCKS))
def test_malformed_markers_are_refused(label):
    text = with_facts(BAD_MARKERS.get(label) or BAD_BLOCKS[label])
    with pytest.raises(markers.MarkerError):
        markers.check_blocks(markers.parse(text, label), "04_fused")
        pytest.fail(f"markers with {label} were accepted:\n{text}")


def test_well_formed_markers_are_read():
    good = with_facts("{\n    // EXERCISE 04.s BEGIN: x\n    y();\n    // EXERCISE 04.s STUB\n    // z();\n"
                      "    // EXERCISE END\n}\n")
    blocks = markers.parse(good)
    markers.check_blocks(blocks, "04_fused")
    assert blocks[0]["stub"] == ["    z();\n"], f"the stub of {good!r} parsed as {blocks[0]['stub']}"
    assert blocks[0]["code_at"] == 2 + len(SYNTHETIC_FACTS["speed"]), f"code_at {blocks[0]['code_at']}"
    # A correctness stub may keep a variable referenced beside its EXERCISE_TODO (09.ds's delta_tile).
    kept = with_facts("{\n    // EXERCISE 04.a BEGIN: x\n    y(z);\n    // EXERCISE 04.a STUB\n"
                      "    // EXERCISE_TODO(\"04.a\");\n    // (void)z;\n    // EXERCISE END\n}\n")
    markers.check_blocks(markers.parse(kept), "04_fused")
    copy, _ = copies.student_copy(kept, "04_fused")
    assert markers.TODO_CALL.findall(copy) == ["04.a"] and "    (void)z;\n" in copy, copy


# --- facts: the lines after a BEGIN line ------------------------------------------------------------
GOOD_FACTS = r"""void f() {
    // EXERCISE 04.s BEGIN: make it fast
    //   kind: speed
    //   gate: 1.05x
    //   shape: headline_d64 causal
    //   timed: attend_ms
    //   dims: 64
    //   hint: The first line of the hint,
    //     and its second: a colon in it
    //   stub: slow: measured
    //   ptx: \bwgmma\.wait_group\.sync\.aligned\s+1\s*;   
    //   ptx shown: wgmma.wait_group.sync.aligned 1
    //   ptx found: \bwgmma\.wait_group\.sync\.aligned\s+\d+
    //   ptx means: a wait for all but the latest group
    //   ptx todo: Issue the P V
    //     behind Q K^T
    //   ptx: \bcp\.async
    //   ptx shown: cp.async
    //   ptx means: copies
    //   ptx todo: copy
    // A comment of the solution (one space after //): not a fact.
    fast();
    // EXERCISE 04.s STUB
    // slow();
    // EXERCISE END
    // EXERCISE 04.a BEGIN: do a
    //   kind: correctness
    //   pass: backward
    //   hint: h
    //   wrong old: a(x,  y);
    //   wrong new: a(y, x);
    a(x,  y);
    // EXERCISE END
    // EXERCISE 04.b BEGIN: do b
    //   kind: speed
    //   shape: B=1 H=16 N=2048 D=128
    //   ptx: \bx
    //   ptx shown: x
    //   ptx means: m
    //   ptx todo: t
    //   hint: h
    //   stub: s
    b();
    // EXERCISE 04.b STUB
    // slow_b();
    // EXERCISE END
}
"""
GOOD_TABLE = {
    "04.s": dict(kind="speed", gate=1.05, shape=(4, 32, 4096, 64, True), timed="attend_ms", dims=(64,),
                 hint="The first line of the hint, and its second: a colon in it", stub="slow: measured",
                 ptx_has=[dict(pattern=r"\bwgmma\.wait_group\.sync\.aligned\s+1\s*;",
                               shown="wgmma.wait_group.sync.aligned 1",
                               found=r"\bwgmma\.wait_group\.sync\.aligned\s+\d+",
                               means="a wait for all but the latest group", todo="Issue the P V behind Q K^T"),
                          dict(pattern=r"\bcp\.async", shown="cp.async", means="copies", todo="copy")]),
    "04.a": dict(kind="correctness", hint="h", wrong=("a(x,  y);", "a(y, x);"), **{"pass": "backward"}),
    "04.b": dict(kind="speed", shape=(1, 16, 2048, 128, False), hint="h", stub="s",
                 ptx_has=[dict(pattern=r"\bx", shown="x", means="m", todo="t")]),
}


@pytest.mark.parametrize("ending", ["\n", "\r\n"], ids=["LF", "CRLF"])
def test_facts_parse(ending):
    text = GOOD_FACTS.replace("\n", ending)
    blocks = markers.parse(text, "good.cu")
    markers.check_blocks(blocks, "04_fused")
    table = markers.facts_table(blocks)
    assert table == GOOD_TABLE, f"the facts parsed as {table}"
    lines = text.splitlines(keepends=True)
    assert lines[blocks[0]["code_at"]].lstrip().startswith("// A comment"), "the facts end at the first plain comment"
    assert [b["facts"] is not None for b in blocks] == [True, True, True], blocks
    # The wrong solution's `old` is in its facts line too: only the code counts, and changes.
    wrong = markers.wrong_solution(text, "04.a")
    assert "    a(y, x);" + ending in wrong and "//   wrong old: a(x,  y);" in wrong, wrong
    copy, names = copies.student_copy(text, "04_fused")
    assert names == ["04.s", "04.a", "04.b"] and "//   kind:" not in copy and "a(x,  y)" not in copy, copy
    assert "must contain x, which" in copy, f"the Graded: line of 04.b should name its PTX check:\n{copy}"
    assert copies.restore(copy, text) == text, "the copy with its blocks put back differs from the source"


@pytest.mark.parametrize("name", sorted(GOOD_TABLE) + sorted(markers.EXERCISES))
def test_fact_lines_read_back(name):
    """What fact_lines writes reads back as the same facts, at any indent, wrapped or not."""
    info = GOOD_TABLE.get(name) or markers.EXERCISES[name]
    for indent, width in (("", 110), ("        ", 60)):
        facts = "".join(markers.fact_lines(info, indent, width))
        text = f"{indent}// EXERCISE {name} BEGIN: t\n{facts}{indent}x();\n{indent}// EXERCISE END\n"
        got = markers.parse(text, "written.cu")[0]["facts"]
        assert got == info, f"{name}: fact_lines wrote\n{facts}which reads back as {got}, not {info}"
        long = [line for line in facts.splitlines() if markers.MORE.match(line) and len(line) > width]
        assert width < 110 or not long, f"{name}: continuation lines wider than {width}: {long}"


GOOD_SPEED = ("{\n"
              "    // EXERCISE 04.s BEGIN: x\n"  # line 2
              "    //   kind: speed\n"           # 3
              "    //   gate: 1.10x\n"           # 4
              "    //   shape: headline\n"       # 5
              "    //   hint: h\n"               # 6
              "    //   stub: s\n"               # 7
              "    y();\n"
              "    // EXERCISE 04.s STUB\n"
              "    // z();\n"
              "    // EXERCISE END\n"
              "}\n")
# (what is wrong, (old, new) in GOOD_SPEED, the line the error names, words of the error)
BAD_FACTS = [
    ("no colon", ("//   gate: 1.10x", "//   gate 1.10x"), 4, "not a facts line"),
    ("four spaces", ("//   gate: 1.10x", "//    gate: 1.10x"), 4, "not a facts line"),
    ("a blank value", ("//   gate: 1.10x", "//   gate:"), 4, "not a facts line"),
    ("an unknown field", ("//   gate: 1.10x", "//   gait: 1.10x"), 4, "unknown field 'gait'"),
    ("an unknown ptx field", ("//   stub: s\n", "//   stub: s\n    //   ptx: x\n    //   ptx shows: x\n"), 9,
     "unknown field 'ptx shows'"),
    ("neither gate nor ptx", ("    //   gate: 1.10x\n", ""), 2, "needs a gate"),
    ("a gate that is not a number", ("//   gate: 1.10x", "//   gate: fast"), 4, "a gate such as 1.10x"),
    ("a gate without its x", ("//   gate: 1.10x", "//   gate: 1.10"), 4, "a gate such as 1.10x"),
    ("an unknown shape name", ("//   shape: headline", "//   shape: huge"), 5, "is not a shape"),
    ("a shape without D", ("//   shape: headline", "//   shape: B=1 H=1 N=1"), 5, "is not a shape"),
    ("an unknown kind", ("//   kind: speed", "//   kind: quick"), 3, "correctness or speed"),
    ("a field twice", ("//   stub: s\n", "//   stub: s\n    //   hint: again\n"), 8, "'hint' given twice"),
    ("a continuation of a one-line field", ("//   gate: 1.10x\n", "//   gate: 1.10x\n    //     more\n"), 5,
     "continuation line after the one-line field 'gate'"),
    ("a continuation first", ("//   kind: speed\n", "//     more\n    //   kind: speed\n"), 3,
     "continuation line after no field"),
    ("a regular expression that does not compile", ("//   stub: s\n", "//   stub: s\n    //   ptx: (unclosed\n"), 8,
     "not a regular expression"),
    ("a ptx sub-field before ptx", ("//   stub: s\n", "//   stub: s\n    //   ptx shown: x\n"), 8,
     "before any `ptx:` line"),
    ("a ptx check without means and todo", ("//   stub: s\n", "//   stub: s\n    //   ptx: x\n    //   ptx shown: x\n"),
     2, "lacks ptx means, ptx todo"),
    ("wrong old without wrong new", ("//   stub: s\n", "//   stub: s\n    //   wrong old: y();\n"), 2,
     "both `wrong old:` and `wrong new:`"),
    ("a speed exercise without stub", ("    //   stub: s\n", ""), 2, "lack stub"),
    ("a speed exercise without shape", ("    //   shape: headline\n", ""), 2, "lack shape"),
    ("no hint", ("    //   hint: h\n", ""), 2, "lack hint"),
    ("no kind", ("    //   kind: speed\n", ""), 2, "lack kind"),
    ("no facts at all", ("    //   kind: speed\n    //   gate: 1.10x\n    //   shape: headline\n    //   hint: h\n"
                         "    //   stub: s\n", ""), 2, "has no facts"),
    ("a correctness exercise with a gate", ("//   kind: speed", "//   kind: correctness"), 2,
     "are facts of a speed exercise"),
    ("an unknown pass", ("//   stub: s\n", "//   stub: s\n    //   pass: sideways\n"), 8, "forward or backward"),
    ("a pass given twice", ("//   stub: s\n", "//   stub: s\n    //   pass: backward\n    //   pass: forward\n"), 9,
     "'pass' given twice"),
    ("dims the matrix does not run", ("//   stub: s\n", "//   stub: s\n    //   dims: 32\n"), 8, "head dims among"),
    ("facts after a bare BEGIN", ("    // EXERCISE END\n", "    // EXERCISE END\n    // EXERCISE 04.s BEGIN\n"
                                  "    //   kind: speed\n    w();\n    // EXERCISE END\n"), 13, "after a bare BEGIN"),
    ("facts on a part other than the main one", (
        "    // EXERCISE END\n", "    // EXERCISE END\n    // EXERCISE 04.s BEGIN: again\n    //   kind: speed\n"
        "    //   gate: 1.10x\n    //   shape: headline\n    //   hint: h\n    //   stub: s\n    w();\n"
        "    // EXERCISE END\n"), 13, "its facts follow the BEGIN line of its main part, line 2"),
]


def test_the_base_case_of_the_malformed_facts_is_good():
    markers.check_blocks(markers.parse(GOOD_SPEED, "bad.cu"), "04_fused")


@pytest.mark.parametrize("label, change, line, words", BAD_FACTS, ids=[b[0] for b in BAD_FACTS])
def test_malformed_facts_are_refused(label, change, line, words):
    old, new = change
    assert GOOD_SPEED.count(old) == 1, f"{label}: {old!r} is not once in the base case"
    text = GOOD_SPEED.replace(old, new)
    with pytest.raises(markers.MarkerError) as refused:
        markers.check_blocks(markers.parse(text, "bad.cu"), "04_fused")
        pytest.fail(f"facts with {label} were accepted:\n{text}")
    assert str(refused.value).startswith(f"bad.cu:{line}: ") and words in str(refused.value), (
        f"{label}: the error should name bad.cu:{line} and say {words!r}: {refused.value}")


def test_standin_holds_the_facts():
    table = {n: {k: v for k, v in info.items() if k != "wrong"} for n, info in GOOD_TABLE.items()}
    copy = "// the student copy\n//   kind: not a fact here\nint x;\n"
    standin = markers.standin_note("exercises/04_fused/attention.cu", GOOD_TABLE, list(GOOD_TABLE)) + copy
    assert markers.is_standin(standin) and markers.standin_copy(standin) == copy, standin
    assert markers.standin_facts(standin, "04_fused/attention.cu") == table, (
        markers.standin_facts(standin, "04_fused"))
    assert "wrong" not in standin and "a(x,  y)" not in standin, f"the stand-in quotes a wrong solution:\n{standin}"
    broken = standin.replace("//   kind: correctness", "//   kind correctness")
    with pytest.raises(markers.MarkerError) as refused:
        markers.standin_facts(broken, "04_fused/attention.cu")
        pytest.fail("a malformed facts line of a stand-in was accepted")
    assert str(refused.value).startswith("04_fused/attention.cu:"), refused.value


@pytest.mark.parametrize("commented, code", [
    ("    // x = 1;\n", "    x = 1;\n"), ("    //\n", "\n"), ("    //     y();\n", "        y();\n"),
    ("        // #pragma unroll 4\n", "#pragma unroll 4\n"), ("// // note\n", "// note\n")])
def test_uncomment(commented, code):
    got = markers.uncomment(commented)
    assert got == code, f"uncomment({commented!r}) = {got!r}, expected {code!r}"


SEVERAL_TEXT = ("// EXERCISE 04.s BEGIN\n"  # part 1 of 04.s: file scope, no task, no stub: nothing
                "int helper() { return 1; }\n"
                "// EXERCISE END\n"
                "void f() {\n"
                "    // EXERCISE 04.s BEGIN: make it fast\n"  # part 2: the task, the stub
                "    fast_path();\n"
                "    // EXERCISE 04.s STUB\n"
                "    // slow_path();\n"
                "    // EXERCISE END\n"
                "    // EXERCISE 04.a BEGIN: do a\n"
                "    a_itself();\n"
                "    // EXERCISE END\n"
                "    // EXERCISE 04.a BEGIN\n"  # part 2 of 04.a: in a function: EXERCISE_TODO
                "    a_again();\n"
                "    // EXERCISE END\n"
                "    // EXERCISE 04.s BEGIN\n"  # part 3 of 04.s: a stub of its own
                "    more_fast();\n"
                "    // EXERCISE 04.s STUB\n"
                "    // more_slow();\n"
                "    // EXERCISE END\n"
                "}\n")


@pytest.mark.parametrize("ending", ["\n", "\r\n"], ids=["LF", "CRLF"])
def test_an_exercise_of_several_blocks(ending):
    text = with_facts(SEVERAL_TEXT).replace("\n", ending)
    blocks = markers.parse(text)
    markers.check_blocks(blocks, "04_fused")
    assert [b["task"] for b in blocks] == [None, "make it fast", "do a", None, None], blocks
    copy, names = copies.student_copy(text, "04_fused")
    assert names == ["04.s", "04.a"], f"the copy's exercises: {names}"
    assert [r[0] for r in copies.regions(copy)] == ["04.s", "04.s", "04.a", "04.a", "04.s"], copies.regions(copy)
    gone = [w for w in ("helper", "fast_path", "a_itself", "a_again", "more_fast") if w in copy]
    assert not gone, f"solution lines left in the copy: {gone}\n{copy}"
    for stub in ("    slow_path();", "    more_slow();"):
        assert stub + ending in copy, f"the stub {stub!r} is not in the copy:\n{copy}"
    assert markers.TODO_CALL.findall(copy) == ["04.a", "04.a"], f"EXERCISE_TODO: {markers.TODO_CALL.findall(copy)}"
    assert "part 1 of 3" in copy and "part 2, below" in copy, f"part 1 should point at the task:\n{copy}"
    assert "// Hint: h" in copy and "//   kind:" not in copy, f"the copy shows the hint, not the facts:\n{copy}"
    assert copies.restore(copy, text) == text, f"several blocks put back differ from the source:\n{copy}"
    for only in (["04.a"], ["s"]):
        copy, names = copies.student_copy(text, "04_fused", only)
        assert copies.restore(copy, text) == text, f"{only}: put back, it differs from the source:\n{copy}"
        kept = "04.s" if only == ["04.a"] else "04.a"
        assert copy.count(f"// EXERCISE {kept} BEGIN") == text.count(f"// EXERCISE {kept} BEGIN"), (
            f"{only}: the blocks of {kept}, not chosen, should keep their markers:\n{copy}")


# --- each chapter: restore, the markers are comments, the copy compiles, its README ------------------
@pytest.mark.parametrize("chapter, label, only", VARIANTS, ids=[f"{c}-{label}" for c, label, _ in VARIANTS])
def test_restore_gives_the_chapter_byte_for_byte(repo, chapter, label, only):
    source = markers.chapter_source(chapter, repo.root)
    copy, names = copies.student_copy(source, chapter, only)
    assert copy != source and names, f"{chapter} {label}: the student copy is the chapter itself"
    todo = set(markers.TODO_CALL.findall(copy))
    parts = markers.exercise_parts(markers.parse(source))
    wanted = {n for n in names if markers.EXERCISES[n]["kind"] == "correctness"
              and any(b["indent"] and (b["stub"] is None or markers.todo_in_stub(b)) for b in parts[n])}
    assert todo == wanted, f"{chapter} {label}: EXERCISE_TODO stubs for {sorted(todo)}, expected {sorted(wanted)}"
    # The facts lines of the exercises cut are gone with their blocks (a `wrong` fact quotes the
    # solution); the region shows the hint and the grading in words instead.
    lines = source.splitlines(keepends=True)
    facts = {n: {line for b in blocks for line in lines[b["start"] + 1:b["code_at"]]} for n, blocks in parts.items()}
    kept = set().union(*(facts[n] for n in parts if n not in names))
    copy_lines = set(copy.splitlines(keepends=True))
    left = sorted(line.strip() for n in names for line in facts[n] - kept if line in copy_lines)
    assert not left, f"{chapter} {label}: facts lines left in the student copy: {left[:3]}"
    for name in names:
        hint = "// Hint: " + " ".join(markers.EXERCISES[name]["hint"].split()[:4])
        assert hint in copy, f"{chapter} {label}: the region of {name} does not start its hint with {hint!r}"
    back = copies.restore(copy, source)
    assert back == source, f"{chapter} {label}: the copy with its solutions put back differs from the chapter"


def without_marker_lines(text):
    """The chapter without the lines its markers are made of: BEGIN lines and their facts, STUB
    lines and the stub below them, END lines; (that text, how many lines went)."""
    lines, drop = text.splitlines(keepends=True), set()
    for block in markers.parse(text):
        drop |= set(range(block["start"], block["code_at"])) | {block["end"]}
        if block["stub_at"] is not None:
            drop |= set(range(block["stub_at"], block["end"]))
    return "".join(line for i, line in enumerate(lines) if i not in drop), len(drop)


def code_lines(text):
    """The lines of code of a C source: comments out (claims.strip_comments), blank lines dropped."""
    return [line.rstrip() for line in claims.strip_comments(text).splitlines() if line.strip()]


@pytest.mark.parametrize("chapter", MARKED)
def test_markers_are_comments(repo, chapter):
    """The chapter's code is the same with every marker, facts and STUB line taken out: they are
    comments, and the chapter compiles to the same code with or without them."""
    source = markers.chapter_source(chapter, repo.root)
    plain, dropped = without_marker_lines(source)
    assert dropped, f"{chapter}: no marker lines to take out"
    marked, unmarked = code_lines(source), code_lines(plain)
    changed = [(a, b) for a, b in zip(marked, unmarked) if a != b][:1] or [(marked[len(unmarked):][:1],
                                                                           unmarked[len(marked):][:1])]
    assert marked == unmarked, (f"{chapter}: its code changes with the markers taken out ({len(marked)} lines of "
                                f"code, {len(unmarked)} without them); first difference: {changed[0]}")


@pytest.mark.parametrize("chapter", MARKED)
def test_student_copy_compiles(repo, tmp_path, chapter):
    """The copy with every exercise cut: every stub (EXERCISE_TODO, the slow code) compiles."""
    copy, _ = copies.student_copy(markers.chapter_source(chapter, repo.root), chapter)
    folder = write_tree(tmp_path, {f"{chapter}/attention.cu": copy})
    compile_quietly(repo, folder / chapter / "attention.cu", folder / "copy.o", ["-c"])


@pytest.mark.parametrize("chapter", MARKED)
def test_readme_states_the_exercises(repo, chapter):
    readme = (repo.root / chapter / "README.md").read_text()
    section = readme.split("## Exercises", 1)[1] if "## Exercises" in readme else ""
    assert section, f"{chapter}/README.md has no '## Exercises' section"
    for needed in (f"make exercise CH={chapter[:2]}", f"make grade CH={chapter[:2]}"):
        assert needed in section, f"{chapter}/README.md, Exercises: '{needed}' is not stated"
    for name in NAMES[chapter]:
        info = markers.EXERCISES[name]
        assert f"`{name}`" in section, f"{chapter}/README.md, Exercises: no entry for `{name}`"
        entry = section.split(f"`{name}`", 1)[1][:2500]
        if info.get("gate"):
            gate = f"{info['gate']:.2f}x"
            assert gate in entry, f"{chapter}/README.md, `{name}`: its gate ({gate}) is not stated"
        for check in info.get("ptx_has", []):
            mnemonic = check["shown"].split(".")[0] + "." + check["shown"].split(".")[1].split()[0]
            assert mnemonic in entry, (f"{chapter}/README.md, `{name}`: the instruction its grade looks for in "
                                       f"the PTX ({check['shown']}) is not named (expected '{mnemonic}')")


# --- the PTX of a chapter and of its copies ----------------------------------------------------------
def ptx_of(repo, chapter, text, label):
    """The PTX of a chapter source (nvcc -ptx with the Makefile's flags), comments out."""
    folder = write_tree(repo.tmpdir(), {f"{chapter}/attention.cu": text})
    out = folder / "out.ptx"
    proc = repo.run(grader.ptx_command(nvcc_flags(repo), chapter, folder / chapter / "attention.cu", out), timeout=600)
    assert proc.returncode == 0, f"{label}: nvcc -ptx failed:\n{(proc.stdout + proc.stderr)[-2000:]}"
    return out.read_text()


def chapter_ptx(repo, chapter):
    """The chapter's own PTX, made once per worker (its tests share an xdist group)."""
    return repo.once(("chapter_ptx", chapter),
                     lambda: ptx_of(repo, chapter, markers.chapter_source(chapter, repo.root), chapter))


@pytest.mark.parametrize("chapter, name", [pytest.param(c, n, id=n, marks=pytest.mark.xdist_group(f"ptx_{c}"))
                                           for c, n in WITH_PTX_CHECK])
def test_ptx_check_holds_on_the_chapter_and_fails_on_the_stub(repo, chapter, name):
    stub, _ = copies.student_copy(markers.chapter_source(chapter, repo.root), chapter, [name])
    ptx = {"chapter": re.sub(r"//[^\n]*", "", chapter_ptx(repo, chapter)),
           "stub": re.sub(r"//[^\n]*", "", ptx_of(repo, chapter, stub, f"the stub of {name}"))}
    for check in markers.EXERCISES[name]["ptx_has"]:
        ok, chapter_says = grader.ptx_check(check, ptx["chapter"])
        assert ok, f"{chapter}: the chapter's own PTX fails the check of {name}: {chapter_says}"
        ok, stub_says = grader.ptx_check(check, ptx["stub"])
        assert not ok, f"{name}: the untouched stub passes its own PTX check: {stub_says}"


def ptx_by_head_dim(text):
    """{head dim (None: no template dim): the kernels' instructions}, debug lines and the file's
    internal-linkage hash left out (they change with the path and text, not with the code)."""
    out, dim = {}, "?"
    for line in re.sub(r"//[^\n]*", "", text).splitlines():
        entry = re.match(r"\s*(?:\.visible\s+|\.weak\s+)*\.entry\s+(\S+?)\(?$", line.strip())
        if entry:
            found = re.search(r"ILi(64|128)E", entry.group(1))
            dim = int(found.group(1)) if found else None
        if line.strip().startswith((".loc", ".file", ".b8", ".b32", ".section")) or not line.strip():
            continue
        out.setdefault(dim, []).append(re.sub(r"_INTERNAL_[0-9a-f]+_", "_INTERNAL_", line.strip()))
    return out


@pytest.mark.parametrize("chapter, name", [pytest.param(c, n, id=n, marks=pytest.mark.xdist_group(f"ptx_{c}"))
                                           for c, n in WITH_DIMS])
def test_wrong_solution_changes_only_the_kernels_at_its_dims(repo, chapter, name):
    wrong = markers.wrong_solution(markers.chapter_source(chapter, repo.root), name)
    ptx = {"chapter": ptx_by_head_dim(chapter_ptx(repo, chapter)),
           "wrong": ptx_by_head_dim(ptx_of(repo, chapter, wrong, f"the wrong solution of {name}"))}
    dims = set(markers.EXERCISES[name]["dims"])
    changed = {d for d in set(ptx["chapter"]) | set(ptx["wrong"]) if ptx["chapter"].get(d) != ptx["wrong"].get(d)}
    assert changed & dims, f"{name}: its wrong solution changes no kernel at D {sorted(dims)}, where it runs"
    assert changed <= dims, (f"{name} runs at D {sorted(dims)} alone, but its wrong solution changes the code at "
                             f"{sorted(changed - dims, key=str)} too: the grade's matrix must run those")


# --- words: what the grade prints -----------------------------------------------------------------
def test_every_claim_has_words():
    checked = 0
    for chapter in MARKED:
        for name, _ in claims.claim_cases(chapter, int(chapter[:2]), "what it adds"):
            sentence = grader.claim_words(name, "")
            assert sentence.startswith("Expected") and "matching /" not in sentence and "claim '" not in sentence, (
                f"{name}: no words for this claim in common/exercise_grade.py (PTX_WORDS, SASS_WORDS, claim_words): "
                f"{sentence!r}")
            checked += 1
    assert checked, "no claims of the chapters with exercises"
    failure = grader.claim_words("claims[04_fused: PTX has /\\bex2\\.approx/]",
                                 "04_fused (adds): its PTX has no /\\bex2\\.approx/, expected some")
    assert "/" not in failure.split(".")[0] and "base-2 exponential" in failure, f"in words: {failure!r}"
    failure = grader.claim_words("claims[01_naive: PTX lacks /\\.shared\\b/]",
                                 "01_naive (adds): its PTX has /\\.shared\\b/ 3 times, expected none; "
                                 "e.g. 'ld.shared.f32 x;'")
    assert "found 3 times, e.g. 'ld.shared.f32 x;'" in failure, f"what was found, in words: {failure!r}"


def test_hints_cite_what_exists(repo):
    for name, info in markers.EXERCISES.items():
        for text in (info["hint"], info.get("stub", "")):
            for path in re.findall(r"docs/[\w./-]+\.(?:md|csv|txt)", text):
                assert (repo.root / path).is_file(), f"{name} cites {path}, which does not exist"


def test_wrong_solutions_apply(repo):
    found = 0
    for chapter in MARKED:
        source = markers.chapter_source(chapter, repo.root)
        for name in NAMES[chapter]:
            if markers.EXERCISES[name].get("wrong"):
                wrong = markers.wrong_solution(source, name)
                assert wrong != source and markers.parse(wrong), f"{name}: its wrong solution changes nothing"
                found += 1
    assert found, "no exercise has a wrong solution to check the grade with"


def test_matrix_runs_the_exercises_head_dims():
    only = grader.matrix_cases(["08.pack_p"])
    assert {s[3] for s in only} == {64}, (
        f"08.pack_p runs at D = 64 alone; its matrix has D {sorted({s[3] for s in only})}")
    assert {s[2] for s in only} == {1, 77, 256, 1000} and {s[4] for s in only} == {False, True}, only
    both = grader.matrix_cases(["08.pack_p", "08.intra_overlap"])
    assert {s[3] for s in both} == {64, 128}, f"a copy of both 08 exercises runs D {sorted({s[3] for s in both})}"
    for name, info in markers.EXERCISES.items():
        dims = {s[3] for s in grader.matrix_cases([name])}
        assert set(info.get("dims", markers.HEAD_DIMS)) <= dims, (
            f"{name}: runs at {info.get('dims')}, its matrix at {dims}")


def test_backward_exercises_are_graded_with_backward():
    """`pass: backward` (09's exercises): the grade's matrix, racecheck and a gate's timing run
    --backward; forward exercises never do; a chapter's exercises in both passes run both."""
    backward = [n for n, info in markers.EXERCISES.items() if markers.pass_of(info) == "backward"]
    assert {"09.ds", "09.dq_red"} <= set(backward), f"09's exercises should be of the backward pass: {backward}"
    for name, info in markers.EXERCISES.items():
        cases = grader.matrix_cases([name])
        runs = [grader.case_args(c) for c in cases]
        if markers.pass_of(info) == "backward":
            assert all(args.count("--backward") == 1 for args in runs) and len(cases) == len(grader.matrix_cases(
                ["04.online_softmax"])), f"{name}: its matrix should be the whole matrix, each run with --backward"
            assert all(grader.case_text(c).endswith(" backward") for c in cases), (
                f"{name}: {grader.case_text(cases[0])}")
        else:
            assert not any("--backward" in args for args in runs), (
                f"{name}: a forward exercise's matrix runs --backward")
        if info["kind"] == "speed":
            shape, column, pass_name = markers.timed_as(info)
            assert pass_name == markers.pass_of(info), f"{name}: timed in the {pass_name} pass"
            if pass_name == "backward":
                assert "backward" in markers.gate_text(info) and "--backward" in markers.grading_text(info), (
                    markers.grading_text(info))
    matrix = grader.MATRIX
    assert grader.case_args(matrix[0]) == grader.shape_args(matrix[0]), "a bare shape is a run of the forward"
    table = {"04.f": dict(kind="correctness", hint="h"),
             "04.b": dict(kind="correctness", hint="h", **{"pass": "backward"})}
    passes = {names: grader.matrix_passes(names, table) for names in (("04.f",), ("04.b",), ("04.b", "04.f"))}
    assert passes == {("04.f",): ("forward",), ("04.b",): ("backward",), ("04.b", "04.f"): ("forward", "backward")}, (
        passes)
    both = grader.matrix_cases(["04.b", "04.f"], table)
    assert len(both) == 2 * len(matrix), both
    assert sum("--backward" in grader.case_args(c) for c in both) == len(matrix), "half the runs should be backward"


# --- make exercise / make grade, no GPU, in a copy of the checkout ------------------------------------
MAKE_ARCH = "ARCH=sm_90"  # the copies are built for sm_90 alone, as on an H100: one architecture, not three


def make_copy(repo, folder, *args):
    """make ARGS in a copy of the checkout or an unpacked hand-out, without a GPU, for sm_90."""
    return make_in(repo, folder, MAKE_ARCH, *args, timeout=600)


def seed_build(repo, folder, chapter):
    """folder/build as `make all` leaves it for `chapter`, without compiling: this checkout's harness
    objects and the chapter's object, ptxas log and binary, newer than folder/build/.flags (which
    make wrote there first: it names folder), so that make takes them as built. Without a GPU a
    grade only asks that binary whether there is one; the student copy is what it compiles."""
    flags = folder / "build" / ".flags"
    assert flags.is_file(), f"make {flags} first"
    stamp = flags.stat().st_mtime + 1
    for rel in ("common/harness.o", "common/npy.o", f"obj/{chapter}.o", f"{chapter}.log", chapter):
        built = repo.build / rel
        if not built.is_file():
            pytest.skip(f"{repo.rel(built)} is not built: run make first")
        (folder / "build" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, folder / "build" / rel)
        os.utime(folder / "build" / rel, (stamp, stamp))


def test_make_exercise_and_grade_without_gpu(repo, tmp_path):
    """make exercise, make grade on the untouched copy (FAIL), the refusal to overwrite an edited
    copy. (make grade on a wrong solution: test_handout_holds_no_solution_and_grades.)"""
    copy = repo_copy(repo, tmp_path)
    chapter = "04_fused"
    made = make_copy(repo, copy, "build/.flags", "exercise", "CH=04")
    assert made.returncode == 0, f"make exercise CH=04: exit {made.returncode}: {made.stderr.strip()}"
    student = copy / "exercises" / chapter / "attention.cu"
    assert student.is_file() and f"exercises/{chapter}/attention.cu" in made.stdout, (
        f"make exercise CH=04 should write and name exercises/{chapter}/attention.cu: {made.stdout!r}")

    seed_build(repo, copy, chapter)
    graded = make_copy(repo, copy, "grade", "CH=04")
    out = graded.stdout
    assert graded.returncode != 0, f"make grade on the untouched copy: exit 0, expected a failure:\n{out}"
    assert "exercise 04.online_softmax is not written yet" in out, f"make grade: no TODO line:\n{out}"
    assert out.splitlines()[-1].startswith(f"FAIL {chapter}:"), (
        f"make grade: the verdict should be FAIL:\n{out}{graded.stderr[-2000:]}")
    skip_lines = [line for line in out.splitlines() if line.split()[:3] == ["gpu", "not", "run:"]]
    assert len(skip_lines) == 1, f"make grade without a GPU: expected one line saying the GPU part did not run:\n{out}"
    assert "builds with the Makefile's flags" in out, f"make grade: the copy should build:\n{out}"
    # The claim the stub breaks, in words: what was expected, what was found, what to do.
    assert "Expected the hardware's base-2 exponential" in out and "/\\b" not in out, (
        f"make grade: a failed claim should be a sentence, not a pattern:\n{out}")

    student.write_text(student.read_text() + "// mine\n")
    refused = make_copy(repo, copy, "exercise", "CH=04")
    assert refused.returncode != 0 and "FORCE=1" in refused.stderr, (
        f"make exercise over an edited copy: exit {refused.returncode}, expected a refusal naming FORCE=1: "
        f"{refused.stderr.strip()!r}")
    forced = make_copy(repo, copy, "exercise", "CH=04", "EX=online_softmax", "FORCE=1")
    assert forced.returncode == 0, f"make exercise FORCE=1: exit {forced.returncode}: {forced.stderr.strip()}"


# --- the grader's GPU bookkeeping on stand-in binaries ------------------------------------------------
def stand_in(tmp_path, ms, **kwargs):
    """A stand-in for build/04_fused (helpers.fake_binary) in a folder of its own; its path."""
    return fake_binary(Path(tempfile.mkdtemp(dir=tmp_path)), ms, **kwargs)


def test_grader_bookkeeping_on_stand_in_binaries(tmp_path, capsys):
    failed = grader.matrix(stand_in(tmp_path, 1.0, todo=True), "04_fused")
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    assert failed == len(grader.MATRIX) == len(lines), f"matrix: {failed} failed of {len(lines)} lines:\n{out}"
    assert all("FAIL" in line and "TODO: exercise 04.online_softmax is not written yet" in line for line in lines), (
        f"each failed case should carry the harness's TODO message:\n{out}")
    assert grader.matrix(stand_in(tmp_path, 1.0), "04_fused") == 0, "matrix: passing runs counted as failures"
    shape = markers.EXERCISES["04.k_layout"]["shape"]
    ratio, line = grader.timing(stand_in(tmp_path, 3.0), stand_in(tmp_path, 2.0), "04_fused", shape)
    assert ratio is not None and abs(ratio - 1.5) < 1e-9 and "1.50x" in line, f"timing: ratio {ratio}, line {line!r}"
    ratio, line = grader.timing(stand_in(tmp_path, 1.0, todo=True), stand_in(tmp_path, 2.0), "04_fused", shape)
    assert ratio is None and "TODO: exercise" in line, f"timing of a copy that fails: {ratio}, {line!r}"
    # Timed on the attention kernel alone: its column counts, not the whole forward's.
    ratio, line = grader.timing(stand_in(tmp_path, 3.0, attend_ms=1.0), stand_in(tmp_path, 2.0, attend_ms=2.0),
                                "04_fused", shape, "attend_ms")
    assert ratio is not None and abs(ratio - 0.5) < 1e-9 and "attention kernel" in line, (
        f"timing on attend_ms: ratio {ratio}, line {line!r}")
    ratio, line = grader.timing(stand_in(tmp_path, 3.0), stand_in(tmp_path, 2.0), "04_fused", shape, "attend_ms")
    assert ratio is None and "no attend_ms" in line, f"timing on a column the harness left empty: {ratio}, {line!r}"


@pytest.mark.parametrize("label, yours, chapter, rounds, ratio", [
    ("a copy slowed once by another program", [1.15, 1.15, 1.0, 1.0], [1.0] * 4, grader.MAX_TIME_ROUNDS, 1.0),
    ("a copy 1.15x slower every round", [1.15] * 9, [1.0] * 9, grader.MAX_TIME_ROUNDS, 1.15),
    ("each side's best, not the last round", [1.15, 1.15, 1.05, 1.3], [1.0, 1.0, 1.2, 1.3], grader.MAX_TIME_ROUNDS,
     1.05),
    ("a copy far past the gate", [2.0] * 9, [1.0] * 9, grader.TIME_ROUNDS, 2.0),
    ("a copy far inside the gate", [0.5] * 9, [1.0] * 9, grader.TIME_ROUNDS, 0.5),
    ("just past the band above", [1.10 * 1.2 * 1.01] * 9, [1.0] * 9, grader.TIME_ROUNDS, 1.10 * 1.2 * 1.01),
    ("at the band's top", [1.10 * 1.2] * 9, [1.0] * 9, grader.MAX_TIME_ROUNDS, 1.10 * 1.2),
    ("at the band's bottom", [1.10 / 1.2] * 9, [1.0] * 9, grader.TIME_ROUNDS, 1.10 / 1.2),
])
def test_close_calls_are_timed_again(monkeypatch, label, yours, chapter, rounds, ratio):
    """A ratio within RETIME_WITHIN of its gate (1.10x here), on either side, is timed another round, up
    to MAX_TIME_ROUNDS; one outside that band is not; the best of each side counts."""
    assert grader.RETIME_WITHIN == 1.2, "the cases' band edges assume RETIME_WITHIN = 1.2"
    times = {"yours": iter(yours), "chapter": iter(chapter)}
    ran = []

    def run_case(binary, chapter_name, args):
        ran.append(binary)
        return "PASS", {"ms": next(times[binary])}, ""

    monkeypatch.setattr(grader, "run_case", run_case)
    timed = grader.time_copy("yours", "chapter", "04_fused", markers.EXERCISES["04.k_layout"]["shape"], gate=1.10)
    assert ran.count("yours") == ran.count("chapter") == rounds, f"{label}: {ran}"
    assert abs(timed["ratio"] - ratio) < 1e-9 and f"the best of {rounds} runs" in timed["line"], f"{label}: {timed}"


def test_grade_times_a_close_call_again(tmp_path, capsys):
    """make grade passes the exercise's gate to the timing: stand-ins 1.15x apart against 04.k_layout's
    1.10x gate are timed MAX_TIME_ROUNDS rounds (the line says so) and fail its gate."""
    gate = markers.EXERCISES["04.k_layout"]["gate"]
    assert gate * grader.RETIME_WITHIN > 1.15 > gate, f"the case assumes 1.15x is a close miss of {gate}"
    code, line, out = grade_on(capsys, ["04.k_layout", "04.online_softmax"], stand_in(tmp_path, 1.15),
                               stand_in(tmp_path, 1.0))
    assert f"the best of {grader.MAX_TIME_ROUNDS} runs taken alternately" in out and code == 1, f"{line}\n{out}"
    assert "the speed gate of 04.k_layout" in line, line


def grade_on(capsys, names, student, solution, race=("pass", "no hazard"), static=(("the build", "pass"),),
             gpu=True, no_solution="this hand-out has no reference solution"):
    """(exit code, verdict line, what was printed) of a grade whose GPU part runs stand-ins."""
    checks = grader.Checks()
    for what, outcome, *why in static:
        checks.add(what, outcome, *why, decides=not why)
    capsys.readouterr()
    if gpu:
        grader.grade_gpu("04_fused", student, solution, names, checks, race=lambda s, c, p: race,
                         no_solution=no_solution)
    else:
        grader.gpu_not_run(names, "no CUDA driver found", checks)
    code, line = grader.verdict("04_fused", checks)
    return code, line, capsys.readouterr().out


# (what, arguments, exit code, words of the verdict, words of the output); in the arguments, a number
# or a dict is a stand-in binary: its ms, or fake_binary's arguments.
VERDICTS = [
    ("no GPU, static checks pass", dict(gpu=False), 77,
     ["UNGRADED 04_fused", "the GPU matrix", "racecheck", "the speed gate of 04.k_layout", "no CUDA driver found"],
     ["gpu       not run:"]),
    ("no GPU, a claim fails", dict(gpu=False, static=(("the build", "pass"), ("the chapter's claims", "fail"))), 1,
     ["FAIL 04_fused", "the chapter's claims"], []),
    ("everything passes", {}, 0, ["PASS 04_fused"], ["All 32 runs match", "PASS 04.k_layout"]),
    ("wrong results", dict(student=dict(ms=1.0, status="FAIL")), 1, ["FAIL 04_fused", "the GPU matrix"],
     ["32 of the 32 runs do not match", "--batch 1 --heads 1 --seqlen 1 --headdim 64", "time      not timed"]),
    ("a stub left", dict(student=dict(ms=1.0, todo=True)), 1, ["FAIL 04_fused", "the GPU matrix"],
     ["TODO: exercise 04.online_softmax is not written yet", "not timed: your copy's results are wrong"]),
    ("too slow", dict(student=dict(ms=3.0)), 1, ["FAIL 04_fused", "the speed gate of 04.k_layout"],
     ["3.00x the chapter's time", "at most 1.10x"]),
    ("no racecheck", dict(race=("skip", "compute-sanitizer was not found")), 77,
     ["UNGRADED 04_fused", "racecheck (compute-sanitizer was not found)"], ["racecheck not run:"]),
    ("a race", dict(race=("fail", "racecheck found hazards")), 1, ["FAIL 04_fused", "racecheck"], []),
    ("no solution to time against", dict(solution=None), 77,
     ["UNGRADED 04_fused", "the speed gate of 04.k_layout", "this hand-out has no reference solution"],
     ["your time 1.000 ms", "the speed comparison is unavailable"]),
    ("SASS claims not checked", dict(static=(("the build", "pass"), ("5 of the chapter's claims", "not run",
                                                                     "cuobjdump was not found"))), 0,
     ["PASS 04_fused", "Not checked here", "cuobjdump was not found"], []),
    ("graded by its PTX, timed for information", dict(names=["08.intra_overlap"], student=dict(ms=1.0, attend_ms=0.6),
                                                      solution=dict(ms=1.0, attend_ms=0.5)), 0, ["PASS 04_fused"],
     ["1.20x (for information: no gate)", "attention kernel"]),
]


@pytest.mark.parametrize("label, args, code, verdict_words, output_words", VERDICTS, ids=[v[0] for v in VERDICTS])
def test_grade_verdicts_on_stand_in_binaries(tmp_path, capsys, label, args, code, verdict_words, output_words):
    args = dict(dict(names=["04.k_layout", "04.online_softmax"], student=dict(ms=1.0), solution=dict(ms=1.0)), **args)
    student, solution = (stand_in(tmp_path, **args.pop(who)) if isinstance(args[who], dict) else args.pop(who)
                         for who in ("student", "solution"))
    got, line, out = grade_on(capsys, args.pop("names"), student, solution, **args)
    assert got == code, f"{label}: exit {got}, expected {code}: {line}\n{out}"
    missing = [w for w in verdict_words if w not in line] + [w for w in output_words if w not in out]
    assert not missing, f"{label}: {missing} not said:\n{out}{line}"
    assert (code == 0) == line.startswith("PASS"), f"{label}: {line}"


def test_grade_of_backward_exercises_runs_backward(tmp_path, capsys):
    """A grade of 09's exercises (`pass: backward`) on stand-in binaries that log their command
    lines: every run of the copy and of the chapter (matrix, timing) has --backward, racecheck is
    asked for the backward pass, and the gate is the backward's time."""
    logs = {who: str(tmp_path / f"{who}.log") for who in ("yours", "chapter")}
    student, solution = stand_in(tmp_path, 2.0, log=logs["yours"]), stand_in(tmp_path, 1.0, log=logs["chapter"])
    raced = []
    checks = grader.Checks()
    grader.grade_gpu("09_backward", student, solution, ["09.ds", "09.dq_red"], checks,
                     race=lambda s, c, p: raced.append(p) or ("pass", "no hazard"))
    code, line = grader.verdict("09_backward", checks)
    said = capsys.readouterr().out
    runs = {who: Path(path).read_text().splitlines() for who, path in logs.items()}
    matrix = len(grader.matrix_cases(["09.ds", "09.dq_red"]))
    assert len(runs["yours"]) == matrix + grader.TIME_ROUNDS and len(runs["chapter"]) == grader.TIME_ROUNDS, runs
    plain = [r for who in runs for r in runs[who] if "--backward" not in r.split()]
    assert not plain, f"runs of a backward exercise's grade without --backward: {plain[:3]}"
    assert raced == ["backward"], f"racecheck should run the backward pass alone: {raced}"
    assert code == 1 and "the speed gate of 09.dq_red" in line, (
        f"2.00x against a {markers.EXERCISES['09.dq_red']['gate']:.2f}x gate should fail: {line}\n{said}")
    assert "backward pass's time" in said and "the backward pass (--backward" in said, said


# --- make handout ----------------------------------------------------------------------------------
def test_handout_holds_no_solution_and_grades(repo, tmp_path):
    copy = repo_copy(repo, tmp_path)
    chapter = "04_fused"
    made = make_copy(repo, copy, "handout", "CH=04")
    assert made.returncode == 0, f"make handout CH=04: exit {made.returncode}: {made.stderr.strip()}"
    tarball = copy / "build" / "handout" / f"{chapter}.tar.gz"
    assert tarball.is_file() and f"{chapter}.tar.gz" in made.stdout, f"make handout: {made.stdout!r}, no {tarball}"
    unpacked = tmp_path / "unpacked"
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
        tar.extractall(unpacked, filter="tar") if hasattr(tarfile, "data_filter") else tar.extractall(unpacked)
    top = f"handout-{chapter}"
    assert all(m.name == top or m.name.startswith(top + "/") for m in members), "the hand-out should be one folder"
    folder = unpacked / top
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    for needed in ("Makefile", "requirements.txt", "HANDOUT.md", "common/exercises.py", "common/exercise_markers.py",
                   "common/exercise_copy.py", "common/exercise_grade.py", "common/runner.py", "common/harness.cu",
                   "common/reference.py", "common/claims.py", "common/cuda_tools.py",
                   f"exercises/{chapter}/attention.cu", f"exercises/{chapter}/.exercise.json",
                   f"{chapter}/attention.cu"):
        assert needed in names, f"the hand-out lacks {needed}, which make grade needs: {names}"
    others = [n for n in names if re.match(r"\d\d_", n) and not n.startswith(f"{chapter}/")]
    assert not others, f"the hand-out holds other chapters: {others}"
    assert names.count(f"{chapter}/attention.cu") == 1 and not [n for n in names if n.endswith("README.md")], (
        f"the hand-out should hold no README (a chapter's quotes its solution): {names}")
    assert not [n for n in names if n.startswith("docs/results")], "the hand-out holds docs/results"

    # No solution line anywhere: each line of the exercise blocks (BEGIN to STUB or END) of every
    # chapter, this one's and the later ones', that the student copy does not hold itself.
    source = markers.chapter_source(chapter, repo.root)
    handed = (folder / "exercises" / chapter / "attention.cu").read_text()
    secret = set()
    for other in MARKED:
        text = markers.chapter_source(other, repo.root)
        lines = text.splitlines()
        for block in markers.parse(text):
            stop = block["stub_at"] if block["stub_at"] is not None else block["end"]
            secret |= {line.strip() for line in lines[block["code_at"]:stop] if len(line.strip()) > 12}
    secret = {line for line in secret if line not in handed}  # generic lines the copy holds too, if inside a line
    assert secret, "no solution lines to look for"
    leaks = [(n, line) for n in names if (folder / n).is_file()
             for line in sorted(secret) if line in (folder / n).read_text(errors="replace")]
    assert not leaks, f"solution lines in the hand-out: {leaks[:5]}"
    standin = (folder / chapter / "attention.cu").read_text()
    assert markers.is_standin(standin) and not re.search(r"// EXERCISE \d\d\.\w+ BEGIN", standin), (
        f"{chapter}/attention.cu in the hand-out should be the student copy with a note on top")
    facts = markers.facts_table(markers.parse(source))
    public = {name: {k: v for k, v in info.items() if k != "wrong"} for name, info in facts.items()}
    assert markers.standin_facts(standin, chapter) == public and "wrong old" not in standin, (
        f"the stand-in's note should hold the facts of {chapter}'s exercises, without their wrong solutions")
    assert markers.standin_copy(standin) == handed, "the stand-in without its note should be the copy handed out"
    record = json.loads((folder / "exercises" / chapter / ".exercise.json").read_text())
    assert record["exercises"] == ["04.k_layout", "04.online_softmax"], record

    # make exercise FORCE=1 there gives back the copy handed out, over the student's work.
    student = folder / "exercises" / chapter / "attention.cu"
    solved = copies.restore(handed, markers.wrong_solution(source, "04.online_softmax"))
    student.write_text(solved)
    again = make_copy(repo, folder, "build/.flags", "exercise", "CH=04", "FORCE=1")
    assert again.returncode == 0 and student.read_text() == handed, (
        f"make exercise FORCE=1 in the hand-out should give back the copy handed out: {again.stderr.strip()}")
    # Graded there with a wrong solution put back (it compiles, its static checks pass): the copy
    # builds, and without a GPU nothing that decides its grade ran: UNGRADED (exit 77), never PASS.
    student.write_text(solved)
    seed_build(repo, folder, chapter)
    graded = make_copy(repo, folder, "grade", "CH=04")
    out, last = graded.stdout, (graded.stdout.splitlines() or [""])[-1]
    assert "builds with the Makefile's flags" in out and last.startswith(f"UNGRADED {chapter}:"), (
        f"make grade in the hand-out, a wrong solution put back: expected a build and UNGRADED:\n{out}"
        f"{graded.stderr[-3000:]}")
    assert "the GPU matrix" in last and "CUDA GPU" in last, f"UNGRADED should name what did not run and why: {last}"
    assert "Error 77" in graded.stderr, f"make grade: the grader should exit 77 (make: 'Error 77'): {graded.stderr!r}"


def test_student_copies_of_this_checkout_are_ignored(repo):
    """The student copies never show up as changes: git ignores exercises/ (asked of git in the
    checkout's own work tree; elsewhere, a copy without its history, of .gitignore itself)."""
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=repo.root, capture_output=True, text=True)
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == repo.root:
        proc = subprocess.run(["git", "check-ignore", "-q", "exercises/04_fused/attention.cu"], cwd=repo.root)
        assert proc.returncode == 0, "exercises/ (the student copies) should be in .gitignore"
        return
    patterns = (repo.root / ".gitignore").read_text().split()
    assert "exercises/" in patterns or "/exercises/" in patterns, (
        "exercises/ (the student copies) should be in .gitignore")


def test_docs_state_the_retiming_rule(repo):
    """docs/README.md's account of make grade's timing states the rounds and band the grader uses."""
    text = " ".join((repo.root / "docs" / "README.md").read_text().split())
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    said = (f"{words[grader.TIME_ROUNDS]} rounds, and up to {words[grader.MAX_TIME_ROUNDS]} where the ratio is "
            f"within {grader.RETIME_WITHIN:g}x of the gate on either side")
    assert said in text, f"docs/README.md should say: {said}"
