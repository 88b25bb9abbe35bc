#!/usr/bin/env python3
"""The student copy of a chapter (make exercise): each chosen exercise's blocks cut out and replaced
by a region holding its task, hint and stub (the markers: common/exercise_markers.py).

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

"""
import hashlib
import json
import os
import sys
import textwrap

from exercise_markers import (EXERCISES, REGION, END, MarkerError, chapter_named, check_blocks, chapter_source,
                              describe, exercise_chapters, exercise_parts, facts_table, grading_text, is_standin,
                              main_part, parse, solution_lines, standin_copy, tasks)
from runner import chapters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDENT_DIR = os.path.join(ROOT, "exercises")
RECORD = ".exercise.json"  # beside a student copy: what make exercise wrote, to spot later edits
HANDOUT_GUIDE = "HANDOUT.md"  # a hand-out's guide, where its regions point for each exercise


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


def chapter_headers(chapter, root=ROOT):
    """The headers a chapter's folder holds beside its sources (08_fp8/hopper.h), which its
    attention.cu includes as "hopper.h"."""
    folder = os.path.join(root, chapter)
    return sorted(name for name in os.listdir(folder) if name.endswith(".h"))


def link_chapter_headers(chapter, copy_folder, root=ROOT):
    """A link beside the student copy to each of the chapter's headers (exercises/08_fp8/hopper.h ->
    ../../08_fp8/hopper.h), so that its #include "hopper.h" resolves."""
    for name in chapter_headers(chapter, root):
        link = os.path.join(copy_folder, name)
        if not os.path.lexists(link):
            os.symlink(os.path.relpath(os.path.join(root, chapter, name), copy_folder), link)


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
    link_chapter_headers(chapter, folder, root)
    with open(path, "w") as f:
        f.write(text)
    with open(os.path.join(folder, RECORD), "w") as f:
        json.dump({"chapter": chapter, "exercises": names, "sha256": digest(text)}, f, indent=1)
    return path, names


def command_make(args):
    chapter, why = chapter_named(args.chapter, "make exercise")
    if not chapter:
        return fail(2, why)
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


