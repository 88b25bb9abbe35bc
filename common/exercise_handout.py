"""make handout: a class's hand-out of one chapter's exercises, without their solution.

`make handout CH=NN` writes BUILD/handout/NN_name.tar.gz, one folder, handout-NN_name/: the
student copy of the chapter with every exercise cut (exercises/NN_name/, as make exercise writes
it), the same copy at NN_name/attention.cu with a note on top (the Makefile finds a chapter by
that file; make exercise FORCE=1 there copies it over the student's to start again; the note
holds the exercises' facts, which the grader reads there), common/
(the harness and this grader), the Makefile,
requirements.txt, the docs/ pages the hints name, and HANDOUT.md (what is there, how it is
graded, each exercise's task and hint). Not in it: the chapter's own source (the solution), its
README (which quotes the solution), any other chapter, docs/results. Unpacked, `make grade CH=NN`
grades the copy as in the tutorial, except that a speed gate has no reference to time against:
such an exercise is UNGRADED there (its time is still shown); grade it in a full checkout.
"""
import io
import json
import os
import re
import tarfile
import tempfile

from chapters import read_chapter, runs_on
from exercise_copy import HANDOUT_GUIDE, RECORD, chapter_headers, digest, fail, student_copy
from exercise_markers import (EXERCISES, Facts, MarkerError, chapter_named, chapter_source, facts_table,
                              grading_text, is_standin, parse, standin_note, tasks, words_list)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_SOLUTION_LINE = 16  # shorter solution lines ("}", "#pragma unroll") say nothing of the solution


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
        "`common/exercises.py` (with the checks of the compiled code, `common/claims.py`).",
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
    for page in docs_named(names, root, table):
        add(page)
    for header in chapter_headers(chapter, root):  # the chapter's own headers, which the copy includes
        add(f"{chapter}/{header}")
        files[f"exercises/{chapter}/{header}"] = f"../../{chapter}/{header}"
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
    chapter, why = chapter_named(args.chapter, "make handout")
    if not chapter:
        return fail(2, why)
    try:
        path, names = write_handout(chapter, args.out)
    except MarkerError as exc:
        return fail(2, f"make handout: {exc}")
    shown = os.path.relpath(path, ROOT) if not os.path.isabs(args.out) else path
    print(f"{shown}: a hand-out of {chapter}'s {len(names)} exercise(s) ({', '.join(names)}), without their "
          f"solution. Unpack it (tar xzf {os.path.basename(path)}), then in handout-{chapter}/ run "
          f"make grade CH={chapter[:2]}; {HANDOUT_GUIDE} there says what it holds.")
    return 0


