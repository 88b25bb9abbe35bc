#!/usr/bin/env python3
"""Graded exercises cut from the chapters' own code (make exercise, make grade, make handout).

`make exercise` writes a student copy of a chapter; `make grade` builds and grades it; `make
handout` packs a copy with what grades it, and no solution, for a class.

  exercises.py list                                   every exercise: chapter, name, kind, grading, task
  exercises.py make CHAPTER [--only NAME,...] [--force]         (make exercise CH=04 [EX=..] [FORCE=1])
  exercises.py grade CHAPTER --build DIR [--make CMD]           (make grade CH=04)
  exercises.py handout CHAPTER --out DIR                        (make handout CH=04)

The chapter is the solution: an exercise is made of one or more blocks of lines of
NN_name/attention.cu between comment markers, so the chapter compiles to the same code with or
without them.

    <indent>// EXERCISE NN.name BEGIN: <the task, one line>
    <indent>//   <field>: <value>                     (the exercise's facts: main part only)
    <the solution: the chapter's own lines>
    <indent>// EXERCISE NN.name STUB                 (speed exercises)
    <indent>// <one line of the stub, commented out>
    <indent>// EXERCISE END

NN is the chapter's number. The same name may open several blocks in the file (helpers the
solution needs elsewhere, say): at least one of them has the task (the first that has one is the
exercise's main part, where its region shows the hint); the others may be a bare
`// EXERCISE NN.name BEGIN`, and any of them may have a STUB.

An exercise's facts (its kind, hint and grading) are the comment lines right after the BEGIN
line of its main part, beside the code they describe: one field a line, `//`, three spaces,
`field: value`. A prose value (hint, stub, ptx means, ptx todo) goes on over lines of `//` and
five spaces, joined with one space; every other value is one line, taken verbatim to its end
(trailing blanks dropped), so that a regular expression or a line of code stays exact. Any line
of `//` and two spaces or more right after a BEGIN line is a facts line: one that is neither
form, an unknown field, a field given twice, a bad value, or facts that lack what their kind
needs is a MarkerError naming the file and line. For example (04_fused/attention.cu):

    // EXERCISE 04.k_layout BEGIN: stage K so that a thread's 4 keys at one dim are one conflict-free float4
    //   kind: speed
    //   gate: 1.10x
    //   shape: headline
    //   hint: The stub stages K as it lies in memory, [key][dim]: the 16 threads of a row then read keys
    //     HEAD_DIM floats apart, all in one bank, one float at a time. Stage it transposed, [dim][key]
    //     (load_transposed), so that a thread's 4 keys at dim d are one float4 read.
    //   stub: not timed: each K read is a 16-way bank conflict and 4 loads instead of one, about 20 times
    //     the S loop's shared-memory wavefronts

  kind: correctness | speed   (always) correctness: the stub is EXERCISE_TODO and the GPU matrix
      grades it. speed: the stub is correct but slow code; it must stay correct (the matrix) and
      get fast, graded by a gate or, where the gain is too close to the run-to-run noise for a
      gate to mean anything, by a `ptx:` check of the mechanism that makes it fast (its time at
      `shape` beside the chapter's is then shown for information)
  hint: prose                 (always) shown in the region of the student copy and in HANDOUT.md
  gate: 1.10x                 (speed) the copy takes at most this x the chapter's time at `shape`,
      both timed in the same run
  shape: B=1 H=16 N=2048 D=128, or a name of SHAPES: headline (B=4 H=16 N=4096 D=128),
      headline_d64 (B=4 H=32 N=4096 D=64); ` causal` after either   (speed) where it is timed
  timed: ms | attend_ms       (speed, optional) what is timed: the whole forward (the harness's
      ms, the default) or the attention kernel alone, where the exercise changes only that kernel
      and a pass before it (08's quantisation) would dilute the difference
  stub: prose                 (speed) how slow the stub is and how that is known: from a
      measurement in docs/results (the stub is code the chapter once was), or from its access
      pattern where it was not timed
  dims: 64                    (optional) the head dims the exercise's code runs at, when not both
      (the grade's matrix runs these), blank-separated
  pass: forward | backward    (optional; forward by default) the pass whose code the exercise is in:
      backward (09's kernels) grades it with --backward, the harness's run of the chapter's backward
      pass (dQ, dK, dV against the float64 reference, after the forward): the matrix, racecheck and,
      for a speed exercise, what its gate times (the backward alone)
  ptx: <regular expression>   (optional, repeatable) the PTX of the copy (made with the build's
      flags) must match it; the lines after it describe it: `ptx shown:` the instruction as a
      student would grep for it, `ptx found:` (optional) a regular expression whose matches are
      listed when the check finds none, `ptx means:` what the instruction is for, `ptx todo:`
      what to do when it is missing
  wrong old: <code>, wrong new: <code>   (optional) a wrong solution: the chapter with `old`
      replaced by `new` once in the exercise's code (the GPU tests check that the grade's matrix
      fails it); the student copy and a hand-out never hold it

A speed exercise needs shape, stub, and a gate or a ptx check. In a hand-out, where the chapter's
attention.cu is a stand-in (the student copy with a note on top), the note holds the facts of each
exercise, without `wrong`, after a `// EXERCISE NN.name FACTS` line. EXERCISES reads them all
(the facts of NN.name from chapter NN, when asked), in the form the grader uses: dict(kind, hint,
gate, shape=(B, H, N, D, causal), timed, stub, dims=(64,), pass, ptx_has=[dict(pattern, shown, found,
means, todo)], wrong=(old, new)); `pass` only where the facts give it (pass_of: forward otherwise).

The student copy (exercises/NN_name/attention.cu) has every block of each chosen exercise
replaced by a region; the main one keeps the task and adds the hint (and how the exercise is
graded) from its facts; each holds its stub:

  STUB lines (every speed exercise has them, in one of its blocks at least): those lines,
      uncommented: code that is correct but slow.
  STUB lines of a correctness exercise hold its EXERCISE_TODO("NN.name") and what else the stub
      needs to build without a warning (09.ds: `(void)delta_tile;`, read by the code cut alone).
  no STUB lines, inside a function, in a correctness exercise: EXERCISE_TODO("NN.name"); the
      macro (common/harness.h) compiles to a store of the name, and a run whose kernel reaches
      it fails with "TODO: exercise NN.name is not written yet". Blocks are chosen so that their
      absence cannot make a loop run forever or an access leave its buffer: a stub fails, it
      never crashes or hangs.
  no STUB lines otherwise (a part at file scope, or a part of a speed exercise): nothing: the
      student writes there what their solution needs, or nothing.

    <indent>// EXERCISE NN.name TODO: <task>         ("TODO (speed):" for a speed exercise)
    <indent>// Hint: ... Graded: ... Grade: make grade CH=NN ...
    <the stub>
    <indent>// EXERCISE END

Blocks not chosen (EX=) stay as in the chapter, markers included. Putting each chosen block back
in place of its region (restore; the k-th region of a name takes the k-th block of that name)
gives the chapter byte for byte; the tests check it.

`make grade` builds the student copy with the Makefile's own rule and flags into
BUILD/exercises/NN_name and grades it. What decides the grade:

  static    the build (no warning), no EXERCISE_TODO left, and each exercise's checks of the
            compiled code (its `ptx:` facts: the PTX of the copy, made with the build's flags,
            must contain an instruction that the exercise's solution alone produces)
  GPU       the matrix below (the head dims the exercises run at; with --backward for exercises of
            the backward pass), compute-sanitizer racecheck at one small shape (in each pass the
            exercises are in), and each speed exercise's `gate`: its time against the chapter's
            (BUILD/NN_name), the two run alternately in the same grade (a speed exercise graded
            by its compiled code instead has its time shown beside the chapter's, no gate)

The chapter's claims about its compiled code (common/claims.py) are checked too: one
that fails fails the grade; one that cannot be checked here (no cuobjdump, no sm_90 code in the
build) is named beside the verdict, since no exercise is decided by it. The verdict is the last
line:

  PASS      (exit 0) every check that decides the grade ran and passed
  FAIL      (exit 1) a check failed: the copy does not build, a stub is left, a claim or a check
            of the compiled code fails, a run of the matrix fails, racecheck finds a hazard, or a
            speed exercise misses its gate
  UNGRADED  (exit 77, the harness's skip code) nothing failed, but a check that decides the
            grade could not run here: it names which and why (no usable GPU, compute-sanitizer
            missing, no reference solution to time against in a hand-out)

make itself reports a recipe's exit 77 as "Error 77" and exits 2.

`make handout CH=NN` writes BUILD/handout/NN_name.tar.gz, one folder, handout-NN_name/: the
student copy of the chapter with every exercise cut (exercises/NN_name/, as make exercise writes
it), the same copy at NN_name/attention.cu with a note on top (the Makefile finds a chapter by
that file; make exercise FORCE=1 there copies it over the student's to start again; the note
holds the exercises' facts, which the grader reads there), common/
(the harness and this grader), the tests/ modules the grader imports, the Makefile,
requirements.txt, the docs/ pages the hints name, and HANDOUT.md (what is there, how it is
graded, each exercise's task and hint). Not in it: the chapter's own source (the solution), its
README (which quotes the solution), any other chapter, docs/results. Unpacked, `make grade CH=NN`
grades the copy as in the tutorial, except that a speed gate has no reference to time against:
such an exercise is UNGRADED there (its time is still shown); grade it in a full checkout.
"""
import argparse
import ast
import concurrent.futures
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import unittest
from collections.abc import Mapping
from pathlib import Path

from runner import chapters, find_chapter, run_case, shape_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDENT_DIR = os.path.join(ROOT, "exercises")
RECORD = ".exercise.json"  # beside a student copy: what make exercise wrote, to spot later edits

# --- The exercises: their facts are comment lines in the chapters (the module's docstring) ----------
# The named shapes a `shape:` fact may use (B, H, N, D; ` causal` after the name makes it causal).
SHAPES = {"headline": (4, 16, 4096, 128), "headline_d64": (4, 32, 4096, 64)}
HEADLINE, HEADLINE_D64 = SHAPES["headline"] + (False,), SHAPES["headline_d64"] + (False,)
# Where a copy's time is shown when no speed exercise names a shape (B, H, N, D, causal).
TIME_SHAPE = {1: (1, 16, 2048, 128, False)}
DEFAULT_TIME_SHAPE = HEADLINE
# The compact GPU matrix: D x causal x N (1, one ragged tile, whole tiles, many and ragged) x (B, H);
# a grade runs the D that its exercises run at (`dims`; both when any of them has none).
HEAD_DIMS = (64, 128)
MATRIX = [(b, h, n, d, causal) for d in HEAD_DIMS for causal in (False, True) for n in (1, 77, 256, 1000)
          for b, h in ((1, 1), (2, 3))]
RACECHECK_SHAPE = (1, 1, 130, 128, True)
RUN_TIMEOUT_S = 300
TIME_ROUNDS = 2  # the chapter and the copy timed alternately, best median of each
MATRIX_WORKERS = 4  # the matrix's runs at once: one (B, H, N, D) per worker, its cases in order (they share inputs)

BEGIN = re.compile(r"^(?P<indent>[ \t]*)// EXERCISE (?P<name>\d\d\.\w+) BEGIN(?:: (?P<task>\S.*?))?\s*$")
STUB = re.compile(r"^[ \t]*// EXERCISE (?P<name>\d\d\.\w+) STUB\s*$")
END = re.compile(r"^[ \t]*// EXERCISE END\s*$")
REGION = re.compile(r"^(?P<indent>[ \t]*)// EXERCISE (?P<name>\d\d\.\w+) TODO(?: \(speed\))?: ")
ANY_MARKER = re.compile(r"//\s*EXERCISE\b")
TODO_CALL = re.compile(r'^\s*EXERCISE_TODO\("(\d\d\.\w+)"\)', re.M)
# The facts lines after a BEGIN line (the module's docstring): any line of `//` and two spaces or
# more there is one, and must be a field (`//`, three spaces, `field: value`) or the continuation of a
# prose field (`//`, five spaces, more words).
FACT_LINE = re.compile(r"^[ \t]*//  ")
FACT = re.compile(r"^[ \t]*//   (?P<field>[a-z]+(?: [a-z]+)?): (?P<value>\S.*?)\s*$")
MORE = re.compile(r"^[ \t]*//     (?P<value>\S.*?)\s*$")
FIELDS = ("kind", "gate", "shape", "timed", "dims", "pass", "hint", "stub", "ptx", "ptx shown", "ptx found", "ptx means",
          "ptx todo", "wrong old", "wrong new")
PROSE = {"hint", "stub", "ptx means", "ptx todo"}  # the fields that may go on over lines
KINDS, TIMED = ("correctness", "speed"), ("ms", "attend_ms")
# The passes an exercise's code may be in (`pass:`), and what the harness's command line adds for each.
PASSES = ("forward", "backward")
PASS_ARGS = {"forward": [], "backward": ["--backward"]}
PASS_WORDS = {"forward": "the forward pass", "backward": "the backward pass (--backward: dQ, dK, dV)"}
GATE = re.compile(r"^(?P<g>\d+(?:\.\d+)?)x$")
SHAPE = re.compile(r"^(?:(?P<name>[a-z]\w*)|B=(?P<b>\d+) H=(?P<h>\d+) N=(?P<n>\d+) D=(?P<d>\d+))(?P<causal> causal)?$")
FACTS_MARK = re.compile(r"^// EXERCISE (?P<name>\d\d\.\w+) FACTS\s*$")  # in a hand-out's stand-in only
# The first lines of a hand-out's NN_name/attention.cu: the student copy stands in for the chapter.
STANDIN_NOTE = ("// HAND-OUT: not the chapter and not your copy. This hand-out holds no solution: this file is the\n"
                "// student copy as handed out, here so that the Makefile finds the chapter; edit {copy}.\n")
STANDIN_FACTS = ("// How each exercise is graded, as the chapter says it after its BEGIN line; make grade reads "
                 "these lines:\n")
STANDIN_END = "// HAND-OUT END: the student copy as handed out follows.\n"
STANDIN_FIRST = "// HAND-OUT: not the chapter"
HANDOUT_GUIDE = "HANDOUT.md"


class MarkerError(ValueError):
    """Malformed EXERCISE markers, with the file and line."""


# --- Chapters ------------------------------------------------------------------------------------
def chapter_source(chapter, root=ROOT):
    with open(os.path.join(root, chapter, "attention.cu")) as f:
        return f.read()


def is_standin(text):
    """Whether a chapter's attention.cu is a hand-out's stand-in (the student copy, no solution)."""
    return text.startswith(STANDIN_FIRST)


def standin_copy(text):
    """The student copy a stand-in holds: the stand-in without its note (and the facts in it)."""
    note, found, copy = text.partition(STANDIN_END)
    return copy if found else text.split("\n", STANDIN_NOTE.count("\n"))[-1]


# --- Markers -------------------------------------------------------------------------------------
def uncomment(line):
    """A commented-out stub line as code: '    // x = 1;' -> '    x = 1;' ('    //' -> '')."""
    body = line.rstrip("\r\n")
    ending = line[len(body):]
    head, _, rest = body.partition("//")
    code = rest[1:] if rest.startswith(" ") else rest
    if code.lstrip().startswith("#"):  # a preprocessor line starts the line, as clang-format puts it
        return code.lstrip() + ending
    return (head + code if code.strip() else "") + ending


def read_facts(lines, i, where, name):
    """([field, value, line number], the index of the line after them): the facts lines after
    line i (a BEGIN or FACTS line), each prose value joined with its continuation lines."""
    fields, j = [], i + 1
    while j < len(lines) and FACT_LINE.match(lines[j]):
        fact, more = FACT.match(lines[j]), MORE.match(lines[j])
        if fact:
            fields.append([fact["field"], fact["value"], j + 1])
        elif more and fields and fields[-1][0] in PROSE:
            fields[-1][1] += " " + more["value"]
        elif more:
            after = f"the one-line field '{fields[-1][0]}'" if fields else "no field"
            raise MarkerError(f"{where}:{j + 1}: {name}: a continuation line after {after}; only "
                              f"{words_list(sorted(PROSE))} go on over lines (`//` and five spaces)")
        else:
            raise MarkerError(f"{where}:{j + 1}: {name}: not a facts line: {lines[j].strip()!r} (`//`, three spaces, "
                              "`field: value`; or `//`, five spaces and more of a hint, stub, ptx means or ptx todo)")
        j += 1
    return fields, j


def fact_value(field, value, where, name):
    """A fact's value as the grader uses it (a float, a shape, a tuple of dims, a string)."""
    def bad(expected):
        return MarkerError(f"{where}: {name}: {field}: {value!r} is not {expected}")
    if field == "kind":
        if value not in KINDS:
            raise bad(" or ".join(KINDS))
        return value
    if field == "gate":
        found = GATE.match(value)
        if not found or float(found["g"]) <= 0:
            raise bad("a gate such as 1.10x")
        return float(found["g"])
    if field == "shape":
        found = SHAPE.match(value)
        if not found or (found["name"] and found["name"] not in SHAPES):
            raise bad(f"a shape: {' or '.join(SHAPES)}, or B=4 H=16 N=4096 D=128; either with ' causal' after it")
        dims = SHAPES[found["name"]] if found["name"] else tuple(int(found[k]) for k in "bhnd")
        return dims + (bool(found["causal"]),)
    if field == "timed":
        if value not in TIMED:
            raise bad(" or ".join(TIMED))
        return value
    if field == "pass":
        if value not in PASSES:
            raise bad(" or ".join(PASSES))
        return value
    if field == "dims":
        dims = tuple(int(d) for d in value.split()) if re.fullmatch(r"\d+( \d+)*", value) else ()
        if not dims or not set(dims) <= set(HEAD_DIMS) or len(set(dims)) < len(dims):
            raise bad(f"head dims among {' '.join(map(str, HEAD_DIMS))}, blank-separated")
        return dims
    if field in ("ptx", "ptx found"):
        try:
            re.compile(value)
        except re.error as exc:
            raise bad(f"a regular expression ({exc})") from None
    return value


def read_exercise_facts(fields, where, name, at):
    """The facts of exercise `name` (fields from read_facts; `at`: its BEGIN line's number) as
    the grader uses them: dict(kind, hint, gate, shape, timed, stub, dims, ptx_has, wrong)."""
    info, check, wrong = {}, None, {}
    for field, value, line in fields:
        here = f"{where}:{line}"
        if field not in FIELDS:
            raise MarkerError(f"{here}: {name}: unknown field '{field}' (fields: {', '.join(FIELDS)})")
        value = fact_value(field, value, here, name)
        if field == "ptx":
            check = {"pattern": value}
            info.setdefault("ptx_has", []).append(check)
            continue
        key, into = field, info
        if field.startswith("ptx "):
            if check is None:
                raise MarkerError(f"{here}: {name}: '{field}' before any `ptx:` line (it describes the one above it)")
            key, into = field[4:], check
        elif field.startswith("wrong "):
            key, into = field[6:], wrong
        if key in into:
            raise MarkerError(f"{here}: {name}: '{field}' given twice")
        into[key] = value
    here = f"{where}:{at}"
    missing = [f for f in ("kind", "hint") if f not in info]
    if missing:
        raise MarkerError(f"{here}: {name}: its facts lack {' and '.join(missing)}")
    if info["kind"] == "speed":
        missing = [f for f in ("shape", "stub") if f not in info]
        if missing:
            raise MarkerError(f"{here}: speed exercise {name}: its facts lack {' and '.join(missing)} (where it is "
                              "timed, how slow its stub is and how that is known)")
        if not (info.get("gate") or info.get("ptx_has")):
            raise MarkerError(f"{here}: speed exercise {name} needs a gate (`gate: 1.10x`) or a check of its compiled "
                              "code (`ptx: <pattern>`)")
    else:
        extra = [f for f in ("gate", "shape", "timed", "stub") if f in info]
        if extra:
            raise MarkerError(f"{here}: correctness exercise {name}: {', '.join(extra)} are facts of a speed exercise")
    for c in info.get("ptx_has", []):
        missing = [f"ptx {f}" for f in ("shown", "means", "todo") if f not in c]
        if missing:
            raise MarkerError(f"{here}: {name}: its check `ptx: {c['pattern']}` lacks {', '.join(missing)}")
    if wrong:
        if set(wrong) != {"old", "new"}:
            raise MarkerError(f"{here}: {name}: a wrong solution needs both `wrong old:` and `wrong new:`")
        info["wrong"] = (wrong["old"], wrong["new"])
    return info


def fact_lines(info, indent="", width=110):
    """The facts lines of an exercise's facts (read_exercise_facts read back), `indent` before
    each: what the chapter holds after the BEGIN line, and a hand-out's stand-in after FACTS."""
    def shape_words(shape):
        named = next((n for n, dims in SHAPES.items() if dims == tuple(shape[:4])), None)
        return (named or shape_text(tuple(shape[:4]) + (False,))) + (" causal" if shape[4] else "")
    fields = [("kind", info["kind"])]
    if "gate" in info:
        fields.append(("gate", f"{info['gate']:.2f}x"))
    if "shape" in info:
        fields.append(("shape", shape_words(info["shape"])))
    if "timed" in info:
        fields.append(("timed", info["timed"]))
    if "dims" in info:
        fields.append(("dims", " ".join(map(str, info["dims"]))))
    if "pass" in info:
        fields.append(("pass", info["pass"]))
    fields.append(("hint", info["hint"]))
    if "stub" in info:
        fields.append(("stub", info["stub"]))
    for c in info.get("ptx_has", []):
        fields += [("ptx", c["pattern"]), ("ptx shown", c["shown"])] + ([("ptx found", c["found"])] if "found" in c
                                                                          else [])
        fields += [("ptx means", c["means"]), ("ptx todo", c["todo"])]
    if "wrong" in info:
        fields += [("wrong old", info["wrong"][0]), ("wrong new", info["wrong"][1])]
    out = []
    for field, value in fields:
        head = f"{indent}//   {field}: "
        if field not in PROSE:
            out.append(f"{head}{value}")
            continue
        words = glued(value)
        wrapped = textwrap.wrap(words, width=width - len(head), break_long_words=False, break_on_hyphens=False)
        more = textwrap.wrap(" ".join(wrapped[1:]), width=width - len(indent) - 7, break_long_words=False,
                             break_on_hyphens=False)
        lines = [head + wrapped[0]] + [f"{indent}//     {line}" for line in more]
        if " ".join(wrapped[:1] + more) != words:
            raise ValueError(f"{field}: {value!r} does not survive wrapping (runs of spaces?)")
        out += [line.replace(GLUE, " ") for line in lines]
    return [line + "\n" for line in out]


GLUE = "\0"  # a space that fact_lines does not break a line at
OPERATORS = {"*", "/", "+", "-", "%", "=", "==", "!=", "<", ">", "<=", ">=", "+=", "-=", "*=", "->", "&&", "||"}


def glued(value):
    """The value with GLUE for the spaces of an expression: around an operator, inside a template's
    <...>, between the B= H= N= D= of a shape (the lines read better unbroken there)."""
    words = value.split(" ")
    out = words[:1]
    for word in words[1:]:
        last = out[-1].split(GLUE)[-1]
        joined = out[-1]
        glue = (word in OPERATORS or last in OPERATORS or joined.count("<") > joined.count(">")
                or (re.fullmatch(r"[BHND]=\d+", last) and re.fullmatch(r"[HND]=\d+,?", word)))
        if glue:
            out[-1] += GLUE + word
        else:
            out.append(word)
    return " ".join(out)


def parse(text, where="attention.cu"):
    """The EXERCISE blocks of a chapter source, in file order: [dict(name, task, indent, start, end,
    stub, facts, code_at)] with task None on a bare BEGIN, start/end the indices of the BEGIN and
    END lines, stub the uncommented STUB lines or None, facts the exercise's facts on its main
    part (None on the others), code_at the index of the first line after BEGIN and its facts."""
    lines, blocks, block, skip = text.splitlines(keepends=True), [], None, 0
    for i, line in enumerate(lines):
        if i < skip:
            continue
        begin, stub, end = BEGIN.match(line), STUB.match(line), END.match(line)
        if begin:
            if block:
                raise MarkerError(f"{where}:{i + 1}: EXERCISE {begin['name']} BEGIN inside {block['name']} "
                                  f"(line {block['start'] + 1}): blocks do not nest")
            block = dict(name=begin["name"], task=begin["task"], indent=begin["indent"], start=i, stub_at=None)
            fields, skip = read_facts(lines, i, where, begin["name"])
            if fields and not begin["task"]:
                raise MarkerError(f"{where}:{i + 2}: {begin['name']}: facts lines after a bare BEGIN: they follow "
                                  "the BEGIN line that has the task")
            block["facts"] = read_exercise_facts(fields, where, begin["name"], i + 1) if fields else None
            block["code_at"] = skip
        elif stub:
            if not block or stub["name"] != block["name"] or block["stub_at"] is not None:
                raise MarkerError(f"{where}:{i + 1}: EXERCISE {stub['name']} STUB outside its block, or twice")
            block["stub_at"] = i
        elif end:
            if not block:
                raise MarkerError(f"{where}:{i + 1}: EXERCISE END without a BEGIN")
            block["end"], block["stub"] = i, None
            if block["stub_at"] is not None:
                stub_lines = lines[block["stub_at"] + 1:i]
                bad = [n for n, s in enumerate(stub_lines, block["stub_at"] + 2) if not s.lstrip().startswith("//")]
                if bad:
                    raise MarkerError(f"{where}:{bad[0]}: a STUB line of {block['name']} is not commented out")
                block["stub"] = [uncomment(s) for s in stub_lines]
            blocks.append(block)
            block = None
        elif ANY_MARKER.search(line) and not REGION.match(line):
            raise MarkerError(f"{where}:{i + 1}: not an EXERCISE marker: {line.strip()!r} "
                              "(BEGIN: <task>, a bare BEGIN, STUB, END)")
    if block:
        raise MarkerError(f"{where}:{block['start'] + 1}: EXERCISE {block['name']} BEGIN has no END")
    for name, parts in exercise_parts(blocks).items():
        main = main_part(parts)
        if main is None:
            continue  # check_blocks says so
        for b in parts:
            if b["facts"] is not None and b is not main:
                raise MarkerError(f"{where}:{b['start'] + 2}: {name}: its facts follow the BEGIN line of its main "
                                  f"part, line {main['start'] + 1} (the first with a task)")
        if main["facts"] is None:
            raise MarkerError(f"{where}:{main['start'] + 1}: exercise {name} has no facts: the lines after its BEGIN "
                              "line, `//   kind: ...`, `//   hint: ...` (the format: common/exercises.py)")
    return blocks


def exercise_parts(blocks):
    """{name: its blocks in file order}, the names in the order they first appear."""
    parts = {}
    for b in blocks:
        parts.setdefault(b["name"], []).append(b)
    return parts


def main_part(parts):
    """The block of an exercise that carries its task: the first with task text (None if none)."""
    return next((b for b in parts if b["task"]), None)


def tasks(blocks):
    """{name: task} of each exercise of a chapter."""
    return {name: main_part(parts)["task"] for name, parts in exercise_parts(blocks).items() if main_part(parts)}


def facts_table(blocks):
    """{name: facts} of each exercise of a chapter's blocks, from its main part."""
    return {name: main_part(parts)["facts"] for name, parts in exercise_parts(blocks).items()
            if main_part(parts) and main_part(parts)["facts"]}


def standin_facts(text, where):
    """{name: facts} written in a hand-out's stand-in: after each `// EXERCISE NN.name FACTS` of its note."""
    lines, table = text.partition(STANDIN_END)[0].splitlines(keepends=True), {}
    for i, line in enumerate(lines):
        mark = FACTS_MARK.match(line)
        if mark:
            fields, _ = read_facts(lines, i, where, mark["name"])
            table[mark["name"]] = read_exercise_facts(fields, where, mark["name"], i + 1)
    return table


def standin_note(copy_path, table, names):
    """The note atop a hand-out's stand-in: what it is, the facts of each exercise (without `wrong`,
    which quotes the solution), and the line after which the student copy follows."""
    lines = [STANDIN_NOTE.format(copy=copy_path), STANDIN_FACTS]
    for name in names:
        public = {k: v for k, v in table[name].items() if k != "wrong"}
        lines += [f"// EXERCISE {name} FACTS\n"] + fact_lines(public)
    return "".join(lines) + STANDIN_END


_FACTS_CACHE = {}


def chapter_facts(chapter, root=ROOT):
    """{name: facts} of a chapter's exercises, read from its attention.cu (a hand-out's stand-in:
    from its note), read again when the file changes."""
    path = os.path.join(root, chapter, "attention.cu")
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    if key not in _FACTS_CACHE:
        text, where = chapter_source(chapter, root), f"{chapter}/attention.cu"
        _FACTS_CACHE[key] = standin_facts(text, where) if is_standin(text) else facts_table(parse(text, where))
    return _FACTS_CACHE[key]


class Facts(Mapping):
    """{name: facts} of every exercise of the chapters under `root`, read from their markers when
    asked: a name's NN says which chapter's source is read."""

    def __init__(self, root=ROOT):
        self.root = root

    def __getitem__(self, name):
        chapter = find_chapter(name, self.root) if re.match(r"\d\d\.\w+$", str(name)) else None
        if not chapter:
            raise KeyError(name)
        return chapter_facts(chapter, self.root)[name]

    def __iter__(self):
        for chapter in chapters(self.root):
            yield from chapter_facts(chapter, self.root)

    def __len__(self):
        return sum(1 for _ in self)


EXERCISES = Facts()  # what the grader, the hand-out and the tests read an exercise's facts from


def check_blocks(blocks, chapter, table=None):
    """Raise MarkerError unless the blocks are well-formed for `chapter` (table: the exercises'
    facts; by default those of the blocks themselves)."""
    table = facts_table(blocks) if table is None else table
    for name, parts in exercise_parts(blocks).items():
        where = f"{chapter}/attention.cu:{parts[0]['start'] + 1}"
        if name[:2] != chapter[:2]:
            raise MarkerError(f"{where}: exercise {name} is in chapter {chapter}: names start with {chapter[:2]}.")
        main = main_part(parts)
        if not main:
            raise MarkerError(f"{where}: exercise {name}: none of its {len(parts)} block(s) has a task "
                              f"(// EXERCISE {name} BEGIN: <the task>)")
        where = f"{chapter}/attention.cu:{main['start'] + 1}"
        info = table.get(name)
        if not info:
            raise MarkerError(f"{where}: exercise {name} has no facts (the lines after its BEGIN line)")
        if info["kind"] == "speed" and all(b["stub"] is None for b in parts):
            raise MarkerError(f"{where}: speed exercise {name} needs STUB lines (its slow, correct code) in one "
                              "of its blocks")
        if info["kind"] == "correctness" and not any(b["indent"] and (b["stub"] is None or todo_in_stub(b))
                                                     for b in parts):
            raise MarkerError(f"{where}: {name}: an EXERCISE_TODO stub needs a block inside a function, without "
                              f"STUB lines (or with STUB lines that hold EXERCISE_TODO(\"{name}\"))")
        if info["kind"] == "speed" and not (info.get("gate") or info.get("ptx_has")):
            raise MarkerError(f"{where}: speed exercise {name} needs a gate or a ptx check in its facts")


def todo_in_stub(block):
    """Whether a block's STUB lines hold its exercise's EXERCISE_TODO (a correctness stub that keeps a
    variable referenced beside it, as 09.ds's does)."""
    return block["stub"] is not None and block["name"] in TODO_CALL.findall("".join(block["stub"]))


def solution_lines(text, block):
    """The lines a block spans in the chapter, its markers (and facts) included."""
    return text.splitlines(keepends=True)[block["start"]:block["end"] + 1]


def wrong_solution(text, name, table=None):
    """The chapter with exercise `name`'s `wrong` substitution made in its blocks' code (the lines
    after BEGIN and its facts): a solution that compiles and is wrong (MarkerError unless `old`
    occurs exactly once there)."""
    blocks = parse(text)
    old, new = (facts_table(blocks) if table is None else table)[name]["wrong"]
    lines = text.splitlines(keepends=True)
    spans = [(b["code_at"], b["end"]) for b in blocks if b["name"] == name]
    hits = [(start, end) for start, end in spans if old in "".join(lines[start:end])]
    count = sum("".join(lines[start:end]).count(old) for start, end in spans)
    if count != 1:
        raise MarkerError(f"{name}: its wrong solution's {old!r} occurs {count} times in its blocks, expected once: "
                          "update its `wrong old:` fact")
    start, end = hits[0]
    lines[start:end] = ["".join(lines[start:end]).replace(old, new)]
    return "".join(lines)


# --- The student copy ----------------------------------------------------------------------------
def shape_text(shape):
    b, h, n, d, causal = shape
    return f"B={b} H={h} N={n} D={d}{' causal' if causal else ''}"


def pass_of(info):
    """The pass an exercise's code is in: its `pass` fact, forward by default."""
    return info.get("pass", "forward")


def case_args(case):
    """The command line of a grade's run: (B, H, N, D, causal), then its pass (forward if none given)."""
    return shape_args(tuple(case[:5])) + PASS_ARGS[case[5] if len(case) > 5 else "forward"]


def case_text(case):
    """A grade's run in words: its shape, and `backward` for a run of the backward pass."""
    return shape_text(tuple(case[:5])) + (" backward" if len(case) > 5 and case[5] == "backward" else "")


def part_body(block, kind, ending="\n"):
    """What a region holds in place of a block: its stub lines, EXERCISE_TODO or nothing."""
    if block["stub"] is not None:
        return list(block["stub"])
    if kind == "correctness" and block["indent"]:
        return [f'{block["indent"]}EXERCISE_TODO("{block["name"]}");{ending}']
    return []


def region_lines(block, chapter, ending="\n", table=EXERCISES, part=(1, 1), main_at=1, guide=None):
    """The student copy's lines in place of a block, part `part` = (k, n) of its exercise, whose
    main part (task and hint) is part `main_at`; `guide`: where the exercise is described."""
    info, name, indent = table[block["name"]], block["name"], block["indent"]
    speed = info["kind"] == "speed"
    k, n = part
    body = part_body(block, info["kind"], ending)
    wrap = textwrap.TextWrapper(width=100 - len(indent), initial_indent="", subsequent_indent="  ")
    guide = guide or f"{chapter}/README.md, Exercises"
    if block["stub"] is not None and speed:
        says = "The code below is correct but slow: make it fast."
    elif not body:
        says = "Your copy has no code here: write here what your solution needs, or nothing."
    else:
        says = ""
    if k != main_at:
        lines = [f"// EXERCISE {name} TODO{' (speed)' if speed else ''}: "
                 + (block["task"] or f"part {k} of {n} of this exercise") + "."]
        text = f"Part {k} of {n} of exercise {name}: its task and hint are in part {main_at}, "
        text += f"{'below' if main_at > k else 'above'}. {says}"
        lines += [f"// {line}" for line in wrap.wrap(text)]
    else:
        lines = [f"// EXERCISE {name} TODO{' (speed)' if speed else ''}: {block['task']}"]
        text = [f"Hint: {info['hint']}", f"Graded: {grading_text(info)}."]
        if n > 1:
            text.append(f"This is part {k} of the {n} regions of this exercise (search for EXERCISE {name}). {says}")
        elif says:
            text.append(says)
        for paragraph in text:
            lines += [f"// {line}" for line in wrap.wrap(paragraph)]
        lines.append(f"// Grade: make grade CH={chapter[:2]}; the exercise: {guide}.")
    return [indent + line + ending for line in lines] + body + [f"{indent}// EXERCISE END{ending}"]


def select(blocks, only):
    """The blocks of the exercises named in `only` ('online_update' or '04.online_update'; None:
    all), every block of each."""
    if not only:
        return blocks
    wanted, chosen = [w.strip() for w in only], []
    for w in wanted:
        hits = [b for b in blocks if w in (b["name"], b["name"].split(".", 1)[1])]
        if not hits:
            names = ", ".join(exercise_parts(blocks)) or "none"
            raise MarkerError(f"no exercise '{w}' in this chapter; its exercises: {names}")
        chosen += [b for b in hits if b not in chosen]
    return chosen


def student_copy(text, chapter, only=None, guide=None, table=None):
    """(the student copy of a chapter source, the names of its exercises in file order); table: the
    exercises' facts, by default those the source holds."""
    blocks = parse(text, f"{chapter}/attention.cu")
    table = facts_table(blocks) if table is None else table
    check_blocks(blocks, chapter, table)
    chosen = select(blocks, only)
    parts = exercise_parts(blocks)
    lines = text.splitlines(keepends=True)
    for block in sorted(chosen, key=lambda b: b["start"], reverse=True):
        mine = parts[block["name"]]
        ending = lines[block["start"]][len(lines[block["start"]].rstrip("\r\n")):] or "\n"
        lines[block["start"]:block["end"] + 1] = region_lines(
            block, chapter, ending, table, part=(mine.index(block) + 1, len(mine)),
            main_at=mine.index(main_part(mine)) + 1, guide=guide)
    return "".join(lines), list(dict.fromkeys(b["name"] for b in sorted(chosen, key=lambda b: b["start"])))


def regions(text):
    """The exercise regions of a student copy, in file order: [(name, first line index, END line index)]."""
    lines, out, open_region = text.splitlines(keepends=True), [], None
    for i, line in enumerate(lines):
        found = REGION.match(line)
        if found:
            open_region = (found["name"], i)
        elif END.match(line) and open_region:
            out.append((open_region[0], open_region[1], i))
            open_region = None
    return out


def restore(student_text, chapter_text):
    """The student copy with each region replaced by the chapter's block of that name: the k-th
    region of a name by its k-th block."""
    parts = exercise_parts(parse(chapter_text))
    lines = student_text.splitlines(keepends=True)
    found, seen = regions(student_text), {}
    numbered = []
    for name, first, last in found:
        numbered.append((parts[name][seen.get(name, 0)], first, last))
        seen[name] = seen.get(name, 0) + 1
    for block, first, last in reversed(numbered):
        lines[first:last + 1] = solution_lines(chapter_text, block)
    return "".join(lines)


# --- make exercise -------------------------------------------------------------------------------
def digest(text):
    return hashlib.sha256(text.encode()).hexdigest()


def read_record(folder):
    try:
        with open(os.path.join(folder, RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def link_common(student_dir):
    """exercises/common -> ../common, so that a copy's #include "../common/harness.h" resolves."""
    link = os.path.join(student_dir, "common")
    if not os.path.lexists(link):
        os.symlink(os.path.join("..", "common"), link)


def write_copy(chapter, only=None, force=False, student_dir=STUDENT_DIR, root=ROOT):
    """Write exercises/<chapter>/attention.cu; (path, names). Refuses to overwrite a copy that
    differs from what was written last (the student's work) unless force. In a hand-out (the
    chapter is a stand-in) the copy is the one handed out, every exercise cut."""
    source = chapter_source(chapter, root)
    if is_standin(source):
        if only:
            raise MarkerError(f"this hand-out holds {chapter} with every exercise cut and no solution, so EX= "
                              "cannot choose some of them: leave EX= out")
        text = standin_copy(source)
        names = list(dict.fromkeys(name for name, _, _ in regions(text)))
    else:
        text, names = student_copy(source, chapter, only)
    if not names:
        raise MarkerError(f"{chapter} has no exercises (chapters with some: {exercise_chapters(root)})")
    folder = os.path.join(student_dir, chapter)
    path = os.path.join(folder, "attention.cu")
    if os.path.exists(path) and not force:
        record = read_record(folder)
        with open(path) as f:
            current = f.read()
        if not record or record.get("sha256") != digest(current):
            raise FileExistsError(f"{os.path.relpath(path, root)} holds changes of yours (it is not the copy "
                                  "make exercise wrote): keep it, or overwrite it with FORCE=1")
    os.makedirs(folder, exist_ok=True)
    link_common(student_dir)
    with open(path, "w") as f:
        f.write(text)
    with open(os.path.join(folder, RECORD), "w") as f:
        json.dump({"chapter": chapter, "exercises": names, "sha256": digest(text)}, f, indent=1)
    return path, names


def timed_as(info):
    """What a speed exercise times: (shape, the harness column, the pass)."""
    return info["shape"], info.get("timed", "ms"), pass_of(info)


def timed_what(column, pass_name="forward"):
    if pass_name == "backward":
        return "backward pass's time"
    return "attention kernel's time" if column == "attend_ms" else "time"


def gate_text(info):
    """"at most 1.10x the chapter's time at B=4 ...": a speed exercise's gate in words."""
    return (f"at most {info['gate']:.2f}x the chapter's {timed_what(*timed_as(info)[1:])} at "
            f"{shape_text(info['shape'])}")


def dims_text(info):
    dims = info.get("dims", HEAD_DIMS)
    return "D " + " and ".join(map(str, dims)) if len(dims) > 1 else f"D = {dims[0]} only"


def grading_text(info):
    """How an exercise is graded, in words (the student copy's 'Graded:' line, make exercise, list)."""
    what = ("your copy's backward pass (--backward) must compute dQ, dK and dV correctly" if pass_of(info) == "backward"
            else "your copy must compute attention correctly")
    matrix = (f"{what} on the GPU matrix ({dims_text(info)}), with no race that compute-sanitizer "
              "racecheck finds")
    if info["kind"] == "correctness":
        return matrix + (f", and its PTX must contain {', '.join(c['shown'] for c in info['ptx_has'])}"
                         if info.get("ptx_has") else "")
    if info.get("gate"):
        return f"{matrix}, and take {gate_text(info)}, the two timed in the same run"
    checks = ", ".join(c["shown"] for c in info["ptx_has"])
    return (f"{matrix}, and the PTX of your build must contain {checks}, which only the overlapped code "
            f"produces; your {timed_what(*timed_as(info)[1:])} at {shape_text(info['shape'])} is shown "
            "beside the chapter's for information (no gate: the gain is close to the run-to-run noise)")


def describe(name, table=EXERCISES):
    info = table[name]
    return f"{info['kind']}: {grading_text(info)}"


def command_make(args):
    chapter = find_chapter(args.chapter)
    if not chapter:
        return fail(2, f"make exercise: no chapter '{args.chapter}' (e.g. CH=04; chapters: {' '.join(chapters())})")
    try:
        path, names = write_copy(chapter, args.only.split(",") if args.only else None, args.force)
    except (MarkerError, FileExistsError) as exc:
        return fail(2, f"make exercise: {exc}")
    source = chapter_source(chapter)
    found = {} if is_standin(source) else tasks(parse(source))
    try:
        table = {name: EXERCISES[name] for name in names}
    except MarkerError as exc:
        return fail(2, f"make exercise: {exc}")
    print(f"{os.path.relpath(path, ROOT)}: the student copy of {chapter}, {len(names)} exercise(s) to do:")
    for name in names:
        print(f"  {name} ({describe(name, table)})" + (f": {found[name]}" if name in found else ""))
    guide = HANDOUT_GUIDE if is_standin(source) else f'{chapter}/README.md, "Exercises"'
    print(f"Edit it, then: make grade CH={chapter[:2]}  (the exercises: {guide})")
    return 0


def exercise_chapters(root=ROOT):
    return " ".join(c[:2] for c in chapters(root)
                    if not is_standin(chapter_source(c, root)) and parse(chapter_source(c, root)))


def command_list(_args):
    for chapter in chapters():
        source = chapter_source(chapter)
        if is_standin(source):
            continue
        try:
            blocks = parse(source, f"{chapter}/attention.cu")
        except MarkerError as exc:
            return fail(2, f"exercises.py list: {exc}")
        table = facts_table(blocks)
        for name, task in tasks(blocks).items():
            info = table[name]
            print(f"{name:18} {describe(name, table)}\n{'':18} task: {task}")
            if info["kind"] == "speed":
                print(f"{'':18} the stub: {info['stub']}")
    return 0


def fail(code, message):
    print(message, file=sys.stderr)
    return code


# --- make grade: the static part -----------------------------------------------------------------
def make_env():
    """The sub-make runs on its own: drop the parent make's jobserver from MAKEFLAGS."""
    env = dict(os.environ)
    env["MAKEFLAGS"] = re.sub(r"\s*--jobserver-(auth|fds)=\S+", "", env.get("MAKEFLAGS", ""))
    return env


def build_copy(chapter, build, make):
    """make BUILD/exercises/<chapter> with the Makefile's rule: (ok, output)."""
    os.makedirs(os.path.join(ROOT, build, "exercises"), exist_ok=True)
    link_common(STUDENT_DIR)
    cmd = shlex.split(make) + ["--no-print-directory", f"BUILD={build}", f"{build}/exercises/{chapter}"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=make_env(), capture_output=True, text=True, errors="replace",
                              timeout=900)
    except subprocess.TimeoutExpired:
        return False, f"{shlex.join(cmd)} ran for more than 900 s and was stopped"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


class ClaimContext:
    """What common/claims.py's checks need of the test runner's context, pointed at the
    student copy: root is exercises/ (its NN_name/attention.cu), binaries are BUILD/exercises/."""

    def __init__(self, build, tools):
        self.root, self.build, self.python = Path(STUDENT_DIR), Path(ROOT) / build / "exercises", sys.executable
        self.cache = {"sass_tools": tools}
        self.tmp = tempfile.mkdtemp(prefix="fa-grade-")

    def tmpdir(self):
        return Path(tempfile.mkdtemp(dir=self.tmp))

    def run(self, cmd, env=None, timeout=300, cwd=None):
        full_env = dict(os.environ, **{k: str(v) for k, v in (env or {}).items()})
        try:
            return subprocess.run([str(c) for c in cmd], cwd=str(cwd or self.root), env=full_env,
                                  capture_output=True, text=True, errors="replace", timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{shlex.join(map(str, cmd))} ran for more than {timeout} s and was stopped") from None

    def once(self, key, fn):
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    def chapter_number(self, chapter):
        return int(chapter[:2])

    def binary(self, chapter, native=False):
        return self.build / chapter

    def require_binary(self, chapter, native=False):
        path = self.binary(chapter)
        if not path.is_file():
            raise unittest.SkipTest(f"{self.rel(path)} is not built")
        return path

    def rel(self, path):
        return os.path.relpath(str(path), ROOT)

    def close(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def sass_tools():
    """(cuobjdump, env) found where the tests look (PATH, next to nvcc, .cache/tools), or None
    with the reason: the grader fetches nothing."""
    import claims
    found = {}
    for name in ("cuobjdump", "nvdisasm"):
        found[name] = claims.find_tool(type("Repo", (), {"root": Path(ROOT)}), name)
        if not found[name]:
            return None, (f"{name} was not found on PATH, next to nvcc or in .cache/tools: install the CUDA "
                          "toolkit's cuobjdump and nvdisasm and put them on PATH (in a full checkout, make test "
                          "fetches them)")
    path = os.path.dirname(found["nvdisasm"]) + os.pathsep + os.environ.get("PATH", "")
    return (found["cuobjdump"], {"PATH": path}), None


def claim_checks(chapter, build):
    """[(name, 'pass'|'fail'|'skip', note)]: common/claims.py's claims on the copy."""
    import claims
    from chapters import read_chapter
    try:
        adds = read_chapter(os.path.join(STUDENT_DIR, chapter, "attention.cu"))["adds"]
    except ValueError:
        adds = chapter
    ctx = ClaimContext(build, sass_tools())
    tools = ctx.cache["sass_tools"][0]
    if tools:  # the SASS claims read sm_90 code: a copy built for another GPU alone has none
        listing = ctx.run([tools[0], "--list-elf", ctx.binary(chapter)], env=tools[1], timeout=120).stdout
        if claims.SASS_ARCH not in listing:
            ctx.cache["sass_tools"] = (None, f"your build has no {claims.SASS_ARCH} code (the Makefile's ARCH "
                                             f"picked another GPU), and these claims read {claims.SASS_ARCH} "
                                             "code: build with ARCH=multi to check them")
    out = []
    try:
        for name, fn in claims.claim_cases(chapter, int(chapter[:2]), adds):
            try:
                note = fn(ctx)
                out.append((name, "pass", note if isinstance(note, str) else ""))
            except unittest.SkipTest as exc:
                out.append((name, "skip", str(exc)))
            except AssertionError as exc:
                out.append((name, "fail", str(exc)))
    finally:
        ctx.close()
    return out


# The chapters' claims in words: what each PTX pattern and SASS opcode of common/claims.py
# is (the tests check that every claim of a chapter with exercises has its words here).
PTX_WORDS = {
    r"\.shared\b": "shared memory (.shared)",
    r"\bw?mma\.": "tensor-core matrix instructions (wmma.* or mma.*)",
    r"\bld\.shared": "loads from shared memory (ld.shared)",
    r"\bst\.shared": "stores to shared memory (st.shared)",
    r"\bex2\.approx": "the hardware's base-2 exponential (ex2.approx, which exp2f compiles to)",
    r"\bwmma\.mma\.sync": "WMMA tensor-core products (wmma.mma.sync, from nvcuda::wmma::mma_sync)",
    r"\bcp\.async": "asynchronous copies from global to shared memory (cp.async)",
    r"\bldmatrix": "ldmatrix loads of MMA fragments from shared memory",
    r"(?<![\w.])mma\.sync": "warp-level MMA instructions (mma.sync)",
    r"\bwgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3":
        "FP8 warpgroup products into fp32 (wgmma.mma_async...m64nNk32.f32.e4m3.e4m3)",
    r"\bcp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes":
        "TMA tile copies that complete on an mbarrier (cp.async.bulk.tensor.3d...)",
    r"\bmbarrier\.try_wait\.parity": "waits on an mbarrier's phase (mbarrier.try_wait.parity)",
    r"\bmbarrier\.arrive\.expect_tx": "mbarrier arrivals that expect a TMA copy's bytes (mbarrier.arrive.expect_tx)",
    r"\bcvt\.rn\.satfinite\.e4m3x2\.f32": "conversions of fp32 pairs to e4m3 (cvt.rn.satfinite.e4m3x2.f32, as pack_e4m3x4 does)",
    r"\bwgmma\.fence": "fences before the warpgroup products (wgmma.fence)",
    r"\bwgmma\.wait_group": "waits for warpgroup products (wgmma.wait_group)",
    r"\bwgmma\.mma_async\.sync\.aligned\.m64n256k32\.f16\.e4m3\.e4m3":
        "Q K^T into fp16 scores at D = 128 (wgmma.mma_async...m64n256k32.f16.e4m3.e4m3)",
    r"\bex2\.approx\.f16x2": "the exponential of fp16 pairs (ex2.approx.f16x2)",
    r"\bcvt\.rn\.satfinite\.e4m3x2\.f16x2": "conversions of fp16 pairs to e4m3 (cvt.rn.satfinite.e4m3x2.f16x2)",
    r"\bsetmaxnreg\.(inc|dec)\.sync\.aligned": "register hand-overs between warpgroups (setmaxnreg)",
    r"\bbar\.arrive\b": "named-barrier arrivals (bar.arrive: the consumers' turns)",
    r"\bwmma\.": "WMMA instructions (wmma.*)",
    r"\bcp\.async\.(ca|cg)\b": "per-thread asynchronous copies (cp.async.ca or .cg), which TMA replaces here",
    r"\bcuda(Malloc|Free)\w*\s*\(": "calls of cudaMalloc or cudaFree",
    r"\batom\.global\.add\.v4\.f32": "16-byte vector atomic adds to device memory (atom.global.add.v4.f32, "
                                       "from atomicAdd on a float4: one RED of four floats)",
}
SASS_WORDS = {
    "FFMA": "fp32 fused multiply-adds (FFMA)", "HMMA": "fp16 tensor-core products (HMMA)",
    "LDS": "shared-memory loads (LDS)", "STS": "shared-memory stores (STS)",
    "LDGSTS": "asynchronous global-to-shared copies (LDGSTS)", "LDSM": "ldmatrix loads (LDSM)",
    "HGMMA": "fp16 warpgroup products (HGMMA)", "QGMMA": "FP8 warpgroup products (QGMMA)",
    "UTMALDG": "TMA loads (UTMALDG)", "SYNCS": "mbarrier operations (SYNCS)",
    "WARPGROUP": "warpgroup arrivals and waits (WARPGROUP)", "USETMAXREG": "register hand-overs (USETMAXREG)",
    "REDG": "reductions into device memory (REDG: atomic adds whose result is unused)",
}
# What to do when a claim that a chapter's own code meets fails on a copy.
LOST = ("The chapter's code has it and yours lost it: that happens while an exercise is not written, when "
        "the compiler drops code whose result is never used, or when the work is done another way than "
        "the hint's: follow the hint of the exercise that does this work")
GAINED = ("The chapter's code does without it: find the code of yours that brings it in and write that "
          "work the way the hint says")
CLAIM_TODO = {
    r"\bex2\.approx": ("Only the softmax's exponentials produce it: write them with the chapter's exponential "
                       "(exp_score, exp2f, or exp2_approx: see the hint), on scores in log2 units"),
}


def claim_words(name, note):
    """A claim's failure as a sentence: what was expected, what was found, what to do."""
    what = re.sub(r"^claims\[[^:]*: (.*)\]$", r"\1", name)
    first = note.splitlines()[0] if note else ""

    def found(pattern, fallback=None):
        match = re.search(pattern, first)
        return match.group(1).strip() if match else (fallback or f"what its check says: {first}")
    kind = re.match(r"PTX (has|lacks) /(.*)/$", what)
    if kind:
        words = PTX_WORDS.get(kind[2], f"instructions matching /{kind[2]}/")
        if kind[1] == "has":
            return f"Expected {words} in the PTX of your build, as the chapter has; found none. {CLAIM_TODO.get(kind[2], LOST)}."
        times, example = found(r"(\d+ times), expected", "some"), found(r"e\.g\. (.*)$", "?")
        return f"Expected no {words} in the PTX of your build, as the chapter has none; found {times}, e.g. {example}. {GAINED}."
    kind = re.match(r"SASS (has|lacks) (\w+)$", what)
    if kind:
        words = SASS_WORDS.get(kind[2], kind[2])
        if kind[1] == "has":
            return f"Expected {words} in the sm_90 machine code (SASS) of your build; found none. {LOST}."
        holders = found(r"SASS, in (.*)$", "some function")
        return f"Expected no {words} in the sm_90 machine code (SASS) of your build; found them in {holders}. {GAINED}."
    kind = re.match(r"SASS of \*(\w+)\* has (.*)$", what)
    if kind:
        opcodes = ", ".join(SASS_WORDS.get(op.strip(), op.strip()) for op in kind[2].split(","))
        lacking = found(r"(\S+ lacks \[.*?\])", "that it lacks some")
        return f"Expected the sm_90 machine code of {kind[1]} to have {opcodes}; found {lacking}. {LOST}."
    kind = re.match(r"(\d+) kernel function$", what)
    if kind:
        kernels = found(r": (\d+ kernel functions \[.*?\])")
        return (f"Expected {kind[1]} kernel functions, as the chapter has; found {kernels}. "
                "Keep the chapter's kernels: the exercises change code inside them, not their number.")
    kind = re.match(r"a kernel named \*(\w+)\*$", what)
    if kind:
        return (f"Expected a kernel whose name contains '{kind[1]}', as the chapter's does; found "
                f"{found(r'kernels: (.*)$')}. Keep the chapter's kernel names.")
    kind = re.match(r"(\d+) launch in the source$", what)
    if kind:
        count = found(r"has (\d+) ")
        return (f"Expected {kind[1]} kernel launch (<<<...>>>) in the source, as the chapter has; found "
                f"{count}. Keep the chapter's launches: the exercises change code inside the kernels.")
    kind = re.match(r"source lacks /(.*)/$", what)
    if kind:
        words = PTX_WORDS.get(kind[1], f"code matching /{kind[1]}/")
        return (f"Expected no {words} in the source, since the harness owns device memory; found "
                f"{found(r': (.*)$')}. Use the workspace the harness allocates (args->workspace) instead.")
    if what.startswith("no register spills"):
        return ("Expected no register spills, as the chapter has none (ptxas's report in the build's .log); "
                f"found {found(r'spill stores in (.*)$')}. Keep fewer values live at once: arrays indexed by "
                "loop counters the compiler cannot unroll, or extra copies of the accumulators, spill.")
    return f"Expected the chapter's claim '{what}' to hold; {first or 'it failed'}."


def ptx_arch(chapter, words):
    """The virtual arch of a chapter's PTX: compute_90a for the sm_90a chapter, else the build's first."""
    import claims
    if int(chapter[:2]) in claims.PTX_ARCH_OF:
        return claims.PTX_ARCH_OF[int(chapter[:2])]
    found = re.search(r"arch=(compute_\w+)", " ".join(words))
    return found.group(1) if found else "compute_90"


def ptx_command(words, chapter, source, out):
    """nvcc -ptx of `source` with a compile line's words (BUILD/.flags: nvcc, then its flags)."""
    keep, skip = [], False
    for word in words[1:]:
        if skip:
            skip = False
        elif word in ("-gencode", "-Xptxas"):
            skip = True
        elif not word.startswith(("-gencode", "-Xptxas")):
            keep.append(word)
    return [words[0]] + keep + [f"-arch={ptx_arch(chapter, words)}", "-ptx", "-o", str(out), str(source)]


def copy_ptx(chapter, build):
    """(the PTX text of the student copy, made with the build's flags, comments out; None) or
    (None, why it could not be made)."""
    flags = os.path.join(ROOT, build, ".flags")
    try:
        with open(flags) as f:
            words = shlex.split(f.read())
    except OSError as exc:
        return None, f"{os.path.relpath(flags, ROOT)} could not be read ({exc.strerror}): build with make first"
    with tempfile.TemporaryDirectory(prefix="fa-ptx-") as tmp:
        out = os.path.join(tmp, f"{chapter}.ptx")
        cmd = ptx_command(words, chapter, os.path.join("exercises", chapter, "attention.cu"), out)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, errors="replace", timeout=900)
        except subprocess.TimeoutExpired:
            return None, "nvcc -ptx ran for more than 900 s and was stopped"
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            return None, f"nvcc -ptx failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}"
        with open(out) as f:
            return re.sub(r"//[^\n]*", "", f.read()), None


def ptx_check(check, ptx):
    """(ok, sentence) of one ptx_has check on a PTX text."""
    hits = len(re.findall(check["pattern"], ptx))
    if hits:
        return True, f"the PTX of your build has {check['shown']} ({hits} times): {check['means']}."
    counts = {}
    for match in re.findall(check.get("found", r"(?!)"), ptx):
        counts[re.sub(r"\s+", " ", match)] = counts.get(re.sub(r"\s+", " ", match), 0) + 1
    seen = (", ".join(f"{text} ({n} times)" for text, n in sorted(counts.items())) if counts else "nothing like it")
    return False, (f"Expected {check['shown']} in the PTX of your build, {check['means']}; found none "
                   f"(of its kind it has: {seen}). {check['todo']}.")


# --- make grade: the GPU part --------------------------------------------------------------------
def probe_gpu(binary, chapter):
    """(usable, reason): a binary of the chapter on a tiny shape; exit 77 is no usable GPU."""
    status, _, note = run_case(binary, chapter, shape_args((1, 1, 16, 64, False)) + ["--no-check", "--iters", "1",
                                                                                    "--warmup", "0"])
    return status != "skipped", note or status


def matrix_dims(names, table=EXERCISES):
    """The head dims a grade's matrix runs: those its exercises run at (both if any has no `dims`)."""
    dims = set()
    for name in names:
        dims |= set(table[name].get("dims", HEAD_DIMS))
    return tuple(d for d in HEAD_DIMS if d in dims) or HEAD_DIMS


def matrix_passes(names, table=EXERCISES):
    """The passes a grade's matrix runs: those the exercises' code is in (`pass`), in PASSES order."""
    found = {pass_of(table[name]) for name in names}
    return tuple(p for p in PASSES if p in found) or PASSES[:1]


def matrix_cases(names, table=EXERCISES):
    """The MATRIX cases a grade of these exercises runs: (B, H, N, D, causal, pass)."""
    dims = matrix_dims(names, table)
    return [shape + (p,) for p in matrix_passes(names, table) for shape in MATRIX if shape[3] in dims]


def matrix(student, chapter, cases=MATRIX, failures=None):
    """One line per case (a shape, or a shape and its pass: matrix_cases), in order; the number that
    failed (those cases appended to `failures`). The runs of one (B, H, N, D) share the inputs the
    first one makes in the cache: they run in order, MATRIX_WORKERS such groups at a time."""
    groups = {}
    for case in cases:
        groups.setdefault(tuple(case[:4]), []).append(case)

    def run_group(members):
        return {case: run_case(student, chapter, case_args(case) + ["--warmup", "0", "--iters", "1"])
                for case in members}

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, min(MATRIX_WORKERS, len(groups)))) as pool:
        runs = {shape: pool.submit(run_group, members) for shape, members in groups.items()}
        for case in cases:  # printed in order, each as soon as its group is done
            status, row, note = runs[tuple(case[:4])].result()[case]
            ok = status == "PASS"
            failed += not ok
            if not ok and failures is not None:
                failures.append(case)
            detail = f"rel_l2 {row['rel_l2']:.2e}" if row and row["rel_l2"] is not None else ""
            detail += f", lse_err {row['lse_err']:.2e}" if row and row["lse_err"] is not None else ""
            if row and row.get("dq_rel_l2") is not None:  # a backward run: each gradient's error
                detail += f" (dQ {row['dq_rel_l2']:.2e}, dK {row['dk_rel_l2']:.2e}, dV {row['dv_rel_l2']:.2e})"
            reason = "; ".join(x for x in (detail, note) if x)
            print(f"    {'PASS' if ok else 'FAIL'}  {case_text(case):35} {reason}", flush=True)
    return failed


def racecheck(student, chapter, pass_name="forward"):
    """('pass'|'fail'|'skip', sentence): compute-sanitizer racecheck at RACECHECK_SHAPE, of that pass."""
    from sanitizer import check_summary, find_sanitizer
    sanitizer = find_sanitizer()
    if not sanitizer:
        return "skip", ("compute-sanitizer was not found (on PATH, next to nvcc, in /usr/local/cuda): install it "
                        "with the CUDA toolkit, or put it on PATH, to check the copy for races")
    case = RACECHECK_SHAPE + (pass_name,)
    args = case_args(case) + ["--warmup", "0", "--iters", "1"]
    run_case(student, chapter, args)  # makes the shape's inputs and reference outside the sanitizer
    cmd = [sanitizer, "--tool", "racecheck", "--error-exitcode", "99", "--target-processes", "application-only",
           student] + args
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "fail", (f"racecheck at {case_text(case)} ran for more than {RUN_TIMEOUT_S} s and was "
                        "stopped: the copy may wait forever on a barrier some threads never reach")
    output = proc.stdout + proc.stderr
    if "RACECHECK SUMMARY" not in output and proc.returncode != 99:
        lines = [l for l in output.splitlines() if l.strip()]
        return "skip", (f"compute-sanitizer racecheck did not run here (exit {proc.returncode}; it said: "
                        f"{lines[-1].strip() if lines else 'nothing'})")
    try:
        check_summary("racecheck", output, f"racecheck {case_text(case)}")
    except AssertionError as exc:
        hazards = [l for l in output.splitlines() if l.startswith("=========")][:12]
        return "fail", "\n".join([
            f"compute-sanitizer racecheck found hazards at {case_text(case)}: threads read and write "
            "the same shared memory with no barrier between them. Find the accesses it names below and put a "
            "__syncthreads() (or the chapter's barrier) between them.", str(exc)] + hazards)
    return "pass", f"compute-sanitizer racecheck finds no hazard at {case_text(case)}"


def time_copy(student, solution, chapter, shape, column="ms", pass_name="forward"):
    """{ratio, line, failed}: the copy's time (the row's `column`, of that pass) beside the chapter's,
    the two run alternately TIME_ROUNDS times, the best median of each counting; ratio None when
    either could not be timed (failed: 'yours', 'chapter' or 'column'). solution None: the copy alone."""
    best, what, where = {}, timed_what(column, pass_name), case_text(shape + (pass_name,))
    runs = [("yours", student)] if solution is None else [("chapter", solution), ("yours", student)]
    for _ in range(TIME_ROUNDS):
        for who, binary in runs:
            status, row, note = run_case(binary, chapter, case_args(shape + (pass_name,)))
            said = f"{status}{': ' + note if note else ''}"
            if status != "PASS":
                if who == "yours":
                    return dict(ratio=None, failed="yours", line=(
                        f"{where}: your copy was not timed: its run there failed ({said}); fix that run first"))
                return dict(ratio=None, failed="chapter", line=(
                    f"{where}: not timed: the chapter's own run failed ({said}), so there is nothing to compare "
                    "with: rebuild the chapter with make"))
            if row.get(column) is None:
                return dict(ratio=None, failed="column", line=(
                    f"{where}: not timed: the harness's CSV row has no {column} (the {what}): rebuild the copy and "
                    "the chapter with this tree's harness (make)"))
            best[who] = min(best.get(who, row[column]), row[column])
    how = f"the best of {TIME_ROUNDS} runs{' taken alternately' if solution else ''}, each the median of 10"
    if solution is None:
        return dict(ratio=None, failed=None, line=f"{where}: your {what} {best['yours']:.3f} ms ({how})")
    ratio = best["yours"] / best["chapter"]
    return dict(ratio=ratio, failed=None, line=(
        f"{where}: your {what} {best['yours']:.3f} ms, the chapter's {best['chapter']:.3f} ms ({how}): {ratio:.2f}x"))


def timing(student, solution, chapter, shape, column="ms", pass_name="forward"):
    """(ratio or None, line): time_copy's ratio and line."""
    timed = time_copy(student, solution, chapter, shape, column, pass_name)
    return timed["ratio"], timed["line"]


# --- make grade ----------------------------------------------------------------------------------
class Checks:
    """A grade's checks: [(what, outcome, why, decides)]; outcome 'pass', 'fail' or 'not run';
    `what` names the check in words ("the GPU matrix"), `why` says why one did not run."""

    def __init__(self):
        self.items = []

    def add(self, what, outcome, why="", decides=True):
        assert outcome in ("pass", "fail", "not run"), outcome
        self.items.append((what, outcome, why, decides))

    def failed(self):
        return [what for what, outcome, _, _ in self.items if outcome == "fail"]

    def not_run(self, decides=True):
        return [(what, why) for what, outcome, why, d in self.items if outcome == "not run" and d == decides]


def cap(text):
    return text[:1].upper() + text[1:]


def words_list(items):
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def grouped(pairs):
    """'a and b: why; c: why2' for [(what, why)], checks with one reason together."""
    by_why = {}
    for what, why in pairs:
        by_why.setdefault(why, []).append(what)
    return "; ".join(f"{words_list(whats)} ({why})" for why, whats in by_why.items())


def verdict(chapter, checks):
    """(exit code, the verdict line): FAIL 1, UNGRADED 77, PASS 0."""
    failed, missing, unchecked = checks.failed(), checks.not_run(True), checks.not_run(False)
    if failed:
        return 1, (f"FAIL {chapter}: {len(failed)} check(s) failed: {words_list(failed)}. The lines above say what "
                   f"was expected and what to do; fix that, then run make grade CH={chapter[:2]} again.")
    if missing:
        return 77, (f"UNGRADED {chapter}: nothing failed, but what decides the grade did not run here: "
                    f"{grouped(missing)}. No PASS without it: run make grade CH={chapter[:2]} where that can run.")
    extra = f" Not checked here, and not needed for the grade: {grouped(unchecked)}." if unchecked else ""
    return 0, f"PASS {chapter}: every check that decides the grade ran and passed.{extra}"


def copy_exercises(chapter, text):
    """The exercises a student copy holds: from make exercise's record, else from its regions."""
    record = read_record(os.path.join(STUDENT_DIR, chapter)) or {}
    names = record.get("exercises") or list(dict.fromkeys(name for name, _, _ in regions(text)))
    return [n for n in names if n in EXERCISES]


def say(label, text):
    lines = str(text).splitlines() or [""]
    print(f"  {label:9} {lines[0]}")
    for line in lines[1:]:
        print(f"  {'':9} {line}")


def grade_static(chapter, build, make, text, names, checks):
    """The build, the stubs left, the exercises' PTX checks and the chapter's claims, into checks."""
    copy = os.path.relpath(os.path.join(STUDENT_DIR, chapter, "attention.cu"), ROOT)
    ok, output = build_copy(chapter, build, make)
    if not ok:
        say("build", f"FAIL: {copy} does not build with the Makefile's flags, where a warning counts as an "
                     "error. Fix the first error or warning in the compiler's output (its last 40 lines):\n" +
            "\n".join(output.splitlines()[-40:]))
        checks.add("the build", "fail")
        return
    say("build", f"{copy} builds with the Makefile's flags, without a warning, into {build}/exercises/{chapter}.")
    checks.add("the build", "pass")
    todo = list(dict.fromkeys(TODO_CALL.findall(text)))
    for name in todo:
        say("stubs", f"FAIL: exercise {name} is not written yet: its EXERCISE_TODO(\"{name}\") is still in the "
                     "source. Write the exercise in its region, in place of that line.")
    if todo:
        checks.add(f"the stubs ({words_list(todo)} not written yet)", "fail")
    else:
        say("stubs", "No EXERCISE_TODO is left in the source.")
        checks.add("the stubs", "pass")
    with_ptx = [n for n in names if EXERCISES[n].get("ptx_has")]
    if with_ptx:
        ptx, why = copy_ptx(chapter, build)
        for name in with_ptx:
            for check in EXERCISES[name]["ptx_has"]:
                what = f"the PTX check of {name} ({check['shown']})"
                if ptx is None:
                    say("ptx", f"{name}: not run: the PTX of your copy could not be made: {why}")
                    checks.add(what, "not run", f"the PTX could not be made: {why}")
                    continue
                passed, sentence = ptx_check(check, ptx)
                say("ptx", f"{name}: {'PASS' if passed else 'FAIL'}: {sentence}")
                checks.add(what, "pass" if passed else "fail")
    results = claim_checks(chapter, build)
    count = {kind: sum(r[1] == kind for r in results) for kind in ("pass", "fail", "skip")}
    say("claims", f"{count['pass']} of the chapter's {len(results)} claims about its compiled code hold for your "
                  "copy (common/claims.py).")
    for name, _, note in (r for r in results if r[1] == "fail"):
        say("", f"FAIL: {claim_words(name, note)}")
    skipped = {}
    for name, _, note in (r for r in results if r[1] == "skip"):
        skipped.setdefault(re.sub(r"^no SASS: ", "", note), []).append(name)
    for why, which in skipped.items():
        say("", f"{len(which)} not checked here: {why}.")
        checks.add(f"{len(which)} of the chapter's claims", "not run", why, decides=False)
    checks.add("the chapter's claims", "fail" if count["fail"] else "pass")


def gpu_checks(names):
    """What the GPU part decides, in words."""
    return ["the GPU matrix", "racecheck"] + [f"the speed gate of {n}" for n in names if EXERCISES[n].get("gate")]


def gpu_not_run(names, reason, checks):
    """No usable GPU: one line, and each check of the GPU part not run."""
    whats = gpu_checks(names)
    say("gpu", f"not run: the harness finds no usable CUDA GPU here ({reason}). {cap(words_list(whats))} need one.")
    for what in whats:
        checks.add(what, "not run", f"they need a CUDA GPU, and the harness finds none usable here: {reason}")


def grade_gpu(chapter, student, solution, names, checks, race=racecheck, no_solution=""):
    """The matrix, racecheck, times and gates into checks; solution None: no reference to time
    against (`no_solution` says why)."""
    cases, passes = matrix_cases(names), matrix_passes(names)
    dims = matrix_dims(names)
    only = [f"{n} runs at D = {EXERCISES[n]['dims'][0]} only" for n in names if EXERCISES[n].get("dims")]
    which = "; " + " and ".join(PASS_WORDS[p] for p in passes) if passes != ("forward",) else ""
    print(f"  matrix    {len(cases)} runs against the reference (D {' and '.join(map(str, dims))}"
          f"{' only: ' + ', '.join(only) if len(dims) < len(HEAD_DIMS) else ''}; causal or not; N 1, 77, 256 and "
          f"1000; B,H 1,1 and 2,3{which}):")
    failures = []
    bad = matrix(student, chapter, cases, failures)
    if bad:
        first = failures[0]
        say("", f"FAIL: {bad} of the {len(cases)} runs do not match the reference (the lines above say how far off, "
                "or why the run failed). Start with the smallest: "
                f"{os.path.relpath(student, ROOT)} {' '.join(case_args(first))}")
    else:
        say("", f"All {len(cases)} runs match the reference.")
    checks.add("the GPU matrix", "fail" if bad else "pass")
    for pass_name in passes:  # each pass the exercises are in: racecheck runs its kernels
        outcome, note = race(student, chapter, pass_name)
        say("racecheck", {"pass": "PASS: ", "fail": "FAIL: ", "skip": "not run: "}[outcome] + note)
        what = "racecheck" if len(passes) == 1 else f"racecheck of the {pass_name} pass"
        checks.add(what, {"pass": "pass", "fail": "fail", "skip": "not run"}[outcome], note)
    speed = [n for n in names if EXERCISES[n]["kind"] == "speed"]
    timed = [timed_as(EXERCISES[n]) for n in speed] or [(TIME_SHAPE.get(int(chapter[:2]), DEFAULT_TIME_SHAPE), "ms",
                                                         passes[-1])]
    results = {}
    for key in dict.fromkeys(timed):
        results[key] = time_copy(student, solution, chapter, *key)
        gated = [n for n in speed if EXERCISES[n].get("gate") and timed_as(EXERCISES[n]) == key]
        info = "" if gated else " (for information: no gate)"
        missing = f"; the speed comparison is unavailable: {no_solution}" if solution is None else ""
        say("time", results[key]["line"] + info + missing)
    for name in speed:
        info = EXERCISES[name]
        if not info.get("gate"):
            continue
        what, timed_result = f"the speed gate of {name}", results[timed_as(info)]
        ratio = timed_result["ratio"]
        limit = f"at most {info['gate']:.2f}x the chapter's {timed_what(*timed_as(info)[1:])}"
        if solution is None:
            say("speed", f"{name}: not run: its gate ({limit}) needs the chapter's time, and {no_solution}.")
            checks.add(what, "not run", f"{no_solution}: grade the copy in a full checkout of the tutorial")
        elif ratio is not None:
            ok = ratio <= info["gate"]
            say("speed", f"{'PASS' if ok else 'FAIL'} {name}: your copy takes {ratio:.2f}x the chapter's "
                         f"{timed_what(*timed_as(info)[1:])} at {shape_text(info['shape'])}; the gate is {limit}"
                         + ("." if ok else ": make it faster (the hint in its region says where the time goes)."))
            checks.add(what, "pass" if ok else "fail")
        elif timed_result["failed"] == "yours":
            say("speed", f"FAIL {name}: your copy could not be timed at {shape_text(info['shape'])}, since its run "
                         "there failed (above); the gate needs a correct run.")
            checks.add(what, "fail")
        else:
            say("speed", f"{name}: not run: {timed_result['line']}.")
            checks.add(what, "not run", timed_result["line"])


def reference_solution(chapter, build, names):
    """(the chapter's binary to time against, None) or (None, why there is none)."""
    source = chapter_source(chapter)
    if is_standin(source):
        return None, (f"this hand-out has no reference solution ({chapter}/attention.cu here is the student copy "
                      "as handed out)")
    try:
        marked = exercise_parts(parse(source, f"{chapter}/attention.cu"))
    except MarkerError as exc:
        return None, f"the chapter's markers do not parse ({exc})"
    missing = [n for n in names if n not in marked]
    if missing:
        return None, f"{chapter}/attention.cu has no solution for {words_list(missing)}"
    return os.path.join(ROOT, build, chapter), None


def command_grade(args):
    chapter = find_chapter(args.chapter)
    if not chapter:
        return fail(2, f"make grade: no chapter '{args.chapter}' (e.g. CH=04; chapters: {' '.join(chapters())})")
    path = os.path.join(STUDENT_DIR, chapter, "attention.cu")
    if not os.path.isfile(path):
        return fail(2, f"make grade: there is no student copy {os.path.relpath(path, ROOT)}: write one with "
                       f"make exercise CH={chapter[:2]} first")
    with open(path) as f:
        text = f.read()
    try:
        names = copy_exercises(chapter, text)  # reads the exercises' facts from the chapter
    except MarkerError as exc:
        return fail(2, f"make grade: {exc}")
    shown = ", ".join(f"{n} ({EXERCISES[n]['kind']})" for n in names) or "none recorded"
    print(f"grade {chapter}: {os.path.relpath(path, ROOT)}, exercises {shown}")
    checks = Checks()
    grade_static(chapter, args.build, args.make, text, names, checks)
    if "the build" not in checks.failed():
        solution, no_solution = reference_solution(chapter, args.build, names)
        probe = os.path.join(ROOT, args.build, chapter)
        usable, reason = probe_gpu(probe, chapter)
        if usable:
            grade_gpu(chapter, os.path.join(ROOT, args.build, "exercises", chapter), solution, names, checks,
                      no_solution=no_solution)
        else:
            gpu_not_run(names, reason, checks)
    code, line = verdict(chapter, checks)
    print(line)
    return code


# --- make handout --------------------------------------------------------------------------------
# The modules make grade runs (the grader, the harness's runner, the claims, racecheck): a hand-out
# holds the tests/ modules among what they import (none today: common/ imports nothing of tests/).
GRADER_MODULES = ("exercises", "runner", "claims", "sanitizer")
MIN_SOLUTION_LINE = 16  # shorter solution lines ("}", "#pragma unroll") say nothing of the solution


def imported_modules(path):
    """The top-level names of every module a Python file imports, at any depth in it."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def grader_tests(root=ROOT):
    """The file names of the tests/ modules that make grade imports, directly or not."""
    todo, seen, found = list(GRADER_MODULES), set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for folder in ("tests", "common"):
            path = os.path.join(root, folder, f"{name}.py")
            if os.path.isfile(path):
                if folder == "tests":
                    found.append(f"{name}.py")
                todo += sorted(imported_modules(path))
                break
    return sorted(found)


def docs_named(names, root=ROOT, table=None):
    """The docs/ pages the exercises' hints name, and the figures those pages show (table: the
    exercises' facts, by default read from the chapters under root)."""
    table = Facts(root) if table is None else table
    pages = sorted({page for n in names for page in re.findall(r"docs/[\w./-]+\.md", table[n]["hint"])})
    out = []
    for page in pages:
        if os.path.isfile(os.path.join(root, page)):
            out.append(page)
            with open(os.path.join(root, page)) as f:
                for figure in re.findall(r"\]\((figures/[^)\s]+)\)", f.read()):
                    if os.path.isfile(os.path.join(root, "docs", figure)):
                        out.append(f"docs/{figure}")
    return list(dict.fromkeys(out))


def solution_lines_of(source, names):
    """The solution's own lines of these exercises: each block's lines between BEGIN (and its
    facts) and its STUB or END, stripped, those of MIN_SOLUTION_LINE characters or more."""
    lines = source.splitlines()
    out = []
    for b in parse(source):
        if b["name"] in names:
            stop = b["stub_at"] if b["stub_at"] is not None else b["end"]
            out += [l.strip() for l in lines[b["code_at"]:stop] if len(l.strip()) >= MIN_SOLUTION_LINE]
    return list(dict.fromkeys(out))


def leaked_lines(source, copy, names, files):
    """[(path, line)]: solution lines (those the student copy does not hold, even inside a line of its
    own) found in the files' text."""
    secret = [l for l in solution_lines_of(source, names) if l not in copy]
    out = []
    for path, data in files.items():
        if isinstance(data, bytes):
            text = data.decode(errors="replace")
            out += [(path, l) for l in secret if l in text]
    return out


def handout_guide(chapter, names, files, copy, table=EXERCISES):
    """HANDOUT.md: what the hand-out holds, how it is graded, each exercise (table: their facts)."""
    from chapters import read_chapter, runs_on
    number = chapter[:2]
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".cu", delete=False) as f:
            f.write(copy)
        gpus = runs_on(read_chapter(f.name))
    except ValueError:
        gpus = "the GPUs the chapter names"
    finally:
        os.unlink(f.name)
    found = tasks(parse(chapter_source(chapter)))
    docs = [p for p in files if p.startswith("docs/") and p.endswith(".md")]
    gated = [n for n in names if table[n].get("gate")]
    lines = [
        f"# {chapter}: exercises, a hand-out", "",
        f"One chapter of the FlashAttention tutorial as exercises: your copy of `{chapter}/attention.cu` with "
        f"{len(names)} exercise(s) cut out, and what grades it. It holds no solution.", "",
        "## What is here", "",
        f"- `exercises/{chapter}/attention.cu`: your copy. Each exercise is a region that starts at "
        "`// EXERCISE NN.name TODO` and ends at `// EXERCISE END`; write your code there.",
        f"- `{chapter}/attention.cu`: the same copy as handed out, with a note on top. The Makefile finds a "
        f"chapter by that file: do not edit it. `make exercise CH={number} FORCE=1` copies it over yours, to "
        "start again.",
        "- `common/`: the harness (inputs, the NumPy reference, the check, the timing) and the grader, "
        "`common/exercises.py`; `tests/`: the checks of the compiled code and the racecheck that the grader runs.",
    ]
    if docs:
        lines.append(f"- {', '.join(f'`{p}`' for p in docs)}: what the hints refer to.")
    lines += [
        "- `Makefile` and `requirements.txt` (NumPy: when the system's Python has none, make sets up `.venv` "
        "with it).", "",
        "## Grading", "",
        f"`make grade CH={number}` builds your copy with the Makefile's flags (nvcc, from the CUDA toolkit) into "
        f"`build/exercises/{chapter}` and grades it: the build (no warning), no stub left, the checks of the "
        "compiled code, and, on an NVIDIA GPU (this chapter runs on " + gpus + "), runs against the NumPy "
        "reference, compute-sanitizer racecheck and your time. The last line is the verdict: PASS (exit 0), "
        "FAIL (exit 1), or UNGRADED: nothing failed, but a check that decides the grade could not run here, "
        "for example without a GPU (the grader exits 77, which make reports as \"Error 77\").",
    ]
    if gated:
        lines += ["",
                  f"This hand-out cannot grade {words_list(gated)}: a speed gate compares your time with the "
                  "chapter's solution, timed in the same run, and the solution is not here. Your time is shown, "
                  f"and the grade says UNGRADED. To grade it, copy `exercises/{chapter}/attention.cu` into "
                  f"`exercises/{chapter}/` of a full checkout of the tutorial and run `make grade CH={number}` there."]
    lines += ["", "## The exercises"]
    for name in names:
        info = table[name]
        lines += ["", f"### `{name}` ({info['kind']})", "", f"Task: {found.get(name, '')}.", "",
                  f"Hint: {info['hint']}", "", f"Graded: {grading_text(info)}."]
    return "\n".join(lines) + "\n"


def handout_files(chapter, root=ROOT):
    """({path in the hand-out: bytes, or a str: a symbolic link's target}, the exercise names)."""
    source = chapter_source(chapter, root)
    if is_standin(source):
        raise MarkerError(f"{chapter}/attention.cu is a hand-out's stand-in, not the chapter: make a hand-out "
                          "from a full checkout of the tutorial")
    table = facts_table(parse(source, f"{chapter}/attention.cu"))
    copy, names = student_copy(source, chapter, guide=HANDOUT_GUIDE, table=table)
    files = {}

    def add(rel):
        with open(os.path.join(root, rel), "rb") as f:
            files[rel] = f.read()
    for rel in ("Makefile", "requirements.txt"):
        add(rel)
    for name in sorted(os.listdir(os.path.join(root, "common"))):
        if os.path.isfile(os.path.join(root, "common", name)) and not name.endswith(".pyc"):
            add(f"common/{name}")
    for name in grader_tests(root):
        add(f"tests/{name}")
    for page in docs_named(names, root, table):
        add(page)
    student = f"exercises/{chapter}/attention.cu"
    files[f"{chapter}/attention.cu"] = (standin_note(student, table, names) + copy).encode()
    files[student] = copy.encode()
    files[f"exercises/{chapter}/{RECORD}"] = json.dumps(
        {"chapter": chapter, "exercises": names, "sha256": digest(copy)}, indent=1).encode()
    files["exercises/common"] = "../common"
    files[HANDOUT_GUIDE] = handout_guide(chapter, names, files, copy, table).encode()
    leaks = leaked_lines(source, copy, names, files)
    if leaks:
        raise MarkerError(f"the hand-out would hold solution lines, e.g. {leaks[0][0]}: {leaks[0][1]!r}: "
                          "leave that file out")
    return files, names


def write_handout(chapter, out_dir, root=ROOT):
    """OUT/NN_name.tar.gz, one folder handout-NN_name/; (its path, the exercise names)."""
    files, names = handout_files(chapter, root)
    top = f"handout-{chapter}"
    out_dir = os.path.join(root, out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{chapter}.tar.gz")
    partial = f"{path}.part{os.getpid()}"
    with tarfile.open(partial, "w:gz") as tar:
        for folder in sorted({os.path.dirname(f"{top}/{rel}") for rel in files} | {top}):
            entry = tarfile.TarInfo(folder)
            entry.type, entry.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(entry)
        for rel, data in sorted(files.items()):
            entry = tarfile.TarInfo(f"{top}/{rel}")
            if isinstance(data, str):
                entry.type, entry.linkname, entry.mode = tarfile.SYMTYPE, data, 0o777
                tar.addfile(entry)
            else:
                entry.size, entry.mode = len(data), 0o644
                tar.addfile(entry, io.BytesIO(data))
    os.replace(partial, path)
    return path, names


def command_handout(args):
    chapter = find_chapter(args.chapter)
    if not chapter:
        return fail(2, f"make handout: no chapter '{args.chapter}' (e.g. CH=04; chapters: {' '.join(chapters())})")
    try:
        path, names = write_handout(chapter, args.out)
    except MarkerError as exc:
        return fail(2, f"make handout: {exc}")
    shown = os.path.relpath(path, ROOT) if not os.path.isabs(args.out) else path
    print(f"{shown}: a hand-out of {chapter}'s {len(names)} exercise(s) ({', '.join(names)}), without their "
          f"solution. Unpack it (tar xzf {os.path.basename(path)}), then in handout-{chapter}/ run "
          f"make grade CH={chapter[:2]}; {HANDOUT_GUIDE} there says what it holds.")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every exercise")
    made = sub.add_parser("make", help="write the student copy of a chapter")
    made.add_argument("chapter")
    made.add_argument("--only", help="exercise names, comma-separated (default: all of the chapter's)")
    made.add_argument("--force", action="store_true", help="overwrite a copy you have edited")
    graded = sub.add_parser("grade", help="build and grade the student copy of a chapter")
    graded.add_argument("chapter")
    graded.add_argument("--build", default="build", help="make's BUILD folder")
    graded.add_argument("--make", default="make", help="the make command")
    handed = sub.add_parser("handout", help="a hand-out of a chapter's exercises, without their solution")
    handed.add_argument("chapter")
    handed.add_argument("--out", default=os.path.join("build", "handout"), help="the folder of the .tar.gz")
    args = parser.parse_args(argv)
    return {"list": command_list, "make": command_make, "grade": command_grade,
            "handout": command_handout}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
