#!/usr/bin/env python3
"""Graded exercises cut from the chapters' own code (make exercise, make grade).

`make exercise` writes a student copy of a chapter; `make grade` builds and grades it.

  exercises.py list                                   every exercise: chapter, name, kind, gate, task
  exercises.py make CHAPTER [--only NAME,...] [--force]         (make exercise CH=04 [EX=..] [FORCE=1])
  exercises.py grade CHAPTER --build DIR [--make CMD]           (make grade CH=04)

The chapter is the solution: an exercise is a block of lines of NN_name/attention.cu between
comment markers, so the chapter compiles to the same code with or without them.

    <indent>// EXERCISE NN.name BEGIN: <the task, one line>
    <the solution: the chapter's own lines>
    <indent>// EXERCISE NN.name STUB                 (speed exercises)
    <indent>// <one line of the stub, commented out>
    <indent>// EXERCISE END

NN is the chapter's number; names are unique. The student copy (exercises/NN_name/attention.cu)
has each chosen block replaced by a region that keeps the task, adds the hint (and, for speed,
the gate) from EXERCISES below, and holds the stub:

  no STUB lines (correctness exercises): EXERCISE_TODO("NN.name"); the macro (common/harness.h)
      compiles to a store of the name, and a run whose kernel reaches it fails with "TODO:
      exercise NN.name is not written yet". Blocks are chosen so that their absence cannot make a
      loop run forever or an access leave its buffer: a stub fails, it never crashes or hangs.
  STUB lines (every speed exercise has them): those lines, uncommented, are the stub: code that
      is correct but slow. The student makes it faster than the gate in EXERCISES, measured
      against the chapter in the same run.

    <indent>// EXERCISE NN.name TODO: <task>         ("TODO (speed):" for a speed exercise)
    <indent>// Hint: ... (Gate: ...) Grade: make grade CH=NN ...
    <the stub>
    <indent>// EXERCISE END

Blocks not chosen (EX=) stay as in the chapter, markers included. Putting each chosen block back
in place of its region (restore) gives the chapter byte for byte; the tests check it.

`make grade` builds the student copy with the Makefile's own rule and flags into
BUILD/exercises/NN_name and grades it: the stubs left (EXERCISE_TODO in the source), the
chapter's compiled-code claims (tests/test_cpu_claims.py), and, when a GPU is there, the GPU
matrix below, compute-sanitizer racecheck at one small shape (when installed), and its time
beside the chapter's (BUILD/NN_name) with each speed exercise's gate. Without a GPU the GPU
part is skipped with one line, and the verdict is that of what could be checked: a copy with
EXERCISE_TODO left fails (exit 1), a copy whose static checks pass exits 0.
"""
import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDENT_DIR = os.path.join(ROOT, "exercises")
RECORD = ".exercise.json"  # beside a student copy: what make exercise wrote, to spot later edits

# --- The exercises: kind, hint and (speed) gate; the task is the BEGIN line in the chapter ---------
# A speed exercise passes when the copy takes at most `gate` x the chapter's time at `shape`
# (B, H, N, D, causal), both timed in the same run: the whole forward (the harness's ms), or with
# `timed="attend_ms"` the attention kernel alone, where the exercise changes only that kernel and
# a pass before it (08's quantisation) would dilute the difference. `stub` says how slow the stub
# is and how that is known: from a measurement in docs/results (the stub is code the chapter once
# was), or from its access pattern where it was not timed.
HEADLINE, HEADLINE_D64 = (4, 16, 4096, 128, False), (4, 32, 4096, 64, False)
EXERCISES = {
    "01.softmax": dict(kind="correctness", hint=(
        "The warp's row is blockIdx.x * SOFTMAX_WARPS + threadIdx.x / WARP_SIZE (return if >= rows). "
        "Three passes over it, the lanes striding by WARP_SIZE: the max (combine lanes with warp_max), "
        "the sum of expf(s - max) (warp_sum), then P = expf(s - max) * (1 / sum) in place; lane 0 "
        "writes lse[row] = max + logf(sum).")),
    "01.pv_columns": dict(kind="speed", gate=1.10, shape=(1, 16, 2048, 128, False), hint=(
        "In the stub a warp's lanes take 32 queries of one column: each load of P touches 32 rows "
        "(32 sectors) while every lane reads the same V element. Give thread d = threadIdx.x of "
        "block (query blockIdx.x, head blockIdx.y) column d: V loads coalesce and p_row[key] is one "
        "address for the whole warp."), stub=(
        "not timed: it reads P as scores_kernel reads K (a row per lane), and scores_kernel takes "
        "5.7x pv_kernel's time for the same FLOPs")),
    "02.patch_fma": dict(kind="correctness", hint=(
        "Unpack a and b into 4 floats each and add av[i] * bv[j] into acc[i][j] for all 16 (i, j): "
        "each of the 8 values read from shared memory feeds 4 multiply-adds.")),
    "02.pad": dict(kind="speed", gate=1.05, shape=HEADLINE, hint=(
        "In the staging stores the 32 lanes of a warp write one column of a [TILE_K][TILE + PAD] "
        "tile: 32 rows, TILE + PAD floats apart. Work out each lane's bank (4-byte banks, 32 of "
        "them) for a few values of PAD; it must stay a multiple of 4 (the float4 reads)."), stub=(
        "not timed: with PAD 0 every staging store of S's operands and of P is a 32-way bank "
        "conflict, 8 times the wavefronts of PAD 4's 4-way")),
    "03.online_update": dict(kind="correctness", hint=(
        "Load the lane's CHUNK scores s_row[j0 + c * WARP_SIZE] (-inf past seqlen) and take their "
        "max; new_max = max(*row_max, chunk max). If it is still -inf, return: exp(-inf - (-inf)) is "
        "NaN. Else the sum becomes *row_sum * expf(*row_max - new_max) plus expf(x - new_max) for "
        "each score.")),
    "03.one_pass": dict(kind="speed", gate=1.03, shape=HEADLINE_D64, hint=(
        "The stub is 02's softmax: it reads the row once for the max and again for the sum. Call "
        "online_update along the row (CHUNK * WARP_SIZE scores per step) to keep both in one read, "
        "then merge the 32 lanes' (max, sum) pairs with __shfl_xor_sync and merge_max_sum."), stub=(
        "measured as 02 (the same softmax): 30.8 ms against 03's 28.95 ms at D=64, 1.06x "
        "(docs/results/NVIDIA_H200.csv)")),
    "04.online_softmax": dict(kind="correctness", hint=(
        "For each row i of the thread: scores times scale_log2 (log2 units), their max, the row's max "
        "over its 16 threads (row_group_max); base = the new max, or 0 while it is -inf; rescale = "
        "exp2f(row_max[i] - base) multiplies row_sum[i] and o_acc[i][*]; then score = exp2f(score - "
        "base), added to row_sum[i]. The recurrence: docs/concepts.md.")),
    "04.k_layout": dict(kind="speed", gate=1.10, shape=HEADLINE, hint=(
        "The stub stages K as it lies in memory, [key][dim]: the 16 threads of a row then read keys "
        "HEAD_DIM floats apart, all in one bank, one float at a time. Stage it transposed, [dim][key] "
        "(load_transposed), so that a thread's 4 keys at dim d are one float4 read."), stub=(
        "not timed: each K read is a 16-way bank conflict and 4 loads instead of one, about 20 times "
        "the S loop's shared-memory wavefronts")),
    "05.diagonal_mask": dict(kind="correctness", hint=(
        "Which tiles can hold a hidden key? A ragged last tile (key0 + BLOCK_KV > seqlen) and, causal, "
        "the diagonal one (key0 + BLOCK_KV - 1 > query0): test that, the same for the whole block. "
        "Inside: key = key0 + tx * KEYS_PER_THREAD + j, query = query0 + row_of(ty, i).")),
    "05.key_end": dict(kind="speed", gate=1.10, shape=(4, 16, 4096, 128, True), hint=(
        "The rows of query tile query0 see keys up to query0 + BLOCK_Q - 1. The stub loops over every "
        "key tile and masks the ones above the diagonal; stop after the diagonal tile (and never "
        "past seqlen)."), stub=(
        "measured as 04 causal (every tile computed, the upper ones masked): 16.4 ms against 8.12, "
        "2.0x (docs/results/NVIDIA_H200.csv)")),
    "06.softmax_rows": dict(kind="correctness", hint=(
        "Lanes 2r and 2r + 1 (pair_lane) share row r: each reads its 32 scores (float4 columns "
        "4 * (2i + pair_lane)), through masked_score on the tiles that need the mask (ragged: key0 + "
        "BLOCK_KV > seqlen; causal diagonal: key0 + BLOCK_KV - 1 > query0); the row max over the pair "
        "(__shfl_xor_sync 1) times scale_log2; rescale = exp2_approx(row_max - base); P = "
        "exp2_approx(score * scale_log2 - base) as fp16 over the row, after a __syncwarp(); lane 0 of "
        "the pair stores factor_warp[row] = rescale.")),
    "06.load_tile": dict(kind="speed", gate=1.03, shape=(4, 16, 4096, 128, True), hint=(
        "The stub's trip count depends on threadIdx.x, and each 16-byte chunk is bounds-checked and "
        "stored before the next is loaded. Give every thread the same chunks at constant offsets (rows "
        "t / CHUNKS + k * THREADS / CHUNKS), load four before storing four, and check bounds only on "
        "a tile that crosses seqlen."), stub=(
        "measured (the chapter's earlier loads): 1.546 ms against 1.434 causal, 1.078x, and 1.067x "
        "non-causal (docs/results/logs/variants_06_07_run4.csv)")),
    "07.mask_scores": dict(kind="correctness", hint=(
        "Lane element score[mt][nt][2r + e] holds query row0 + 16 mt + 8 r and key key0 + 8 nt + e "
        "(mma_16x8x16's comment): -inf where the key is >= seqlen or, causal, after the query.")),
    "07.ring": dict(kind="correctness", hint=(
        "Tile `tile` has landed once at most STAGES - 2 younger commit groups are pending "
        "(__pipeline_wait_prior); one __syncthreads() then covers every thread's copies and the slot "
        "of tile - 1, which you refill with tile + STAGES - 1 (if it exists) before __pipeline_commit(): "
        "commit even when nothing was requested, one group per tile.")),
    "07.copies": dict(kind="speed", gate=1.05, shape=HEADLINE_D64, hint=(
        "In the stub each thread loops over chunks threadIdx.x, + THREADS, ... with a trip count the "
        "compiler cannot fix, and checks the bounds of every chunk. Give thread t chunk t % CHUNKS of "
        "rows t / CHUNKS + i * ROWS_PER_PASS: a fixed count, fully unrolled, addresses at constant "
        "offsets; check bounds only on a tile that crosses seqlen (zero-fill with the src_size "
        "argument)."), stub=(
        "measured (the chapter's earlier copies): 1.834 ms against 1.612 at D=64, 1.138x "
        "(docs/results/logs/variants_06_07_run4.csv)")),
    "08.pack_p": dict(kind="correctness", hint=(
        "The Q K^T accumulator gives this thread, per 8-key chunk c, keys 8c + 2t and 8c + 2t + 1 of "
        "rows g and g + 8 (score[4c + 2r + e], t = lane % 4). Register i of k32 step kk takes the two "
        "pairs of chunks c = 4 kk + 2 (i / 2) and c + 1 of row g + 8 (i % 2), packed by pack_e4m3x4: "
        "key_slot stored Vt so that these are the A operand's positions 4t..4t+3.")),
    "08.intra_overlap": dict(kind="speed", gate=1.03, shape=HEADLINE, timed="attend_ms", hint=(
        "The stub waits for each tile's P V before the next tile's Q K^T. Peel tile 0 (its softmax, "
        "rescale, pack); then per tile j issue Q K^T of j and P V of j-1 in one turn "
        "(scores_and_softmax<HEAD_DIM, true>), and only after j's softmax wait for that P V "
        "(finish_pv(..., false)), rescale O and pack P; issue and finish the last P V after the loop."), stub=(
        "measured: the chapter with -DINTRA_OVERLAP=0, its attention kernel 0.587 ms against 0.565 "
        "at B=4 H=16 N=4096 D=128, 1.04x (docs/results/logs/ablation_08.csv)")),
}
# Where a copy's time is shown when no speed exercise names a shape (B, H, N, D, causal).
TIME_SHAPE = {1: (1, 16, 2048, 128, False)}
DEFAULT_TIME_SHAPE = HEADLINE
# The compact GPU matrix: D x causal x N (1, one ragged tile, whole tiles, many and ragged) x (B, H).
MATRIX = [(b, h, n, d, causal) for d in (64, 128) for causal in (False, True) for n in (1, 77, 256, 1000)
          for b, h in ((1, 1), (2, 3))]
RACECHECK_SHAPE = (1, 1, 130, 128, True)
RUN_TIMEOUT_S = 300
TIME_ROUNDS = 2  # the chapter and the copy timed alternately, best median of each

BEGIN = re.compile(r"^(?P<indent>[ \t]*)// EXERCISE (?P<name>\d\d\.\w+) BEGIN: (?P<task>\S.*?)\s*$")
STUB = re.compile(r"^[ \t]*// EXERCISE (?P<name>\d\d\.\w+) STUB\s*$")
END = re.compile(r"^[ \t]*// EXERCISE END\s*$")
REGION = re.compile(r"^(?P<indent>[ \t]*)// EXERCISE (?P<name>\d\d\.\w+) TODO(?: \(speed\))?: ")
ANY_MARKER = re.compile(r"//\s*EXERCISE\b")
TODO_CALL = re.compile(r'^\s*EXERCISE_TODO\("(\d\d\.\w+)"\)', re.M)


class MarkerError(ValueError):
    """Malformed EXERCISE markers, with the file and line."""


# --- Chapters ------------------------------------------------------------------------------------
def chapters(root=ROOT):
    """NN_name of every chapter, in order."""
    return sorted(d for d in os.listdir(root) if re.match(r"\d\d_", d)
                  and os.path.isfile(os.path.join(root, d, "attention.cu")))


def find_chapter(arg, root=ROOT):
    """The chapter folder named by 4, 04 or 04_fused (None if there is none)."""
    for chapter in chapters(root):
        if arg in (chapter, chapter[:2]) or (arg.isdigit() and int(arg) == int(chapter[:2])):
            return chapter
    return None


def chapter_source(chapter, root=ROOT):
    with open(os.path.join(root, chapter, "attention.cu")) as f:
        return f.read()


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


def parse(text, where="attention.cu"):
    """The EXERCISE blocks of a chapter source: [dict(name, task, indent, start, end, stub)] with
    start/end the indices of the BEGIN and END lines, stub the uncommented STUB lines or None."""
    lines, blocks, block = text.splitlines(keepends=True), [], None
    for i, line in enumerate(lines):
        begin, stub, end = BEGIN.match(line), STUB.match(line), END.match(line)
        if begin:
            if block:
                raise MarkerError(f"{where}:{i + 1}: EXERCISE {begin['name']} BEGIN inside {block['name']} "
                                  f"(line {block['start'] + 1}): blocks do not nest")
            block = dict(name=begin["name"], task=begin["task"], indent=begin["indent"], start=i, stub_at=None)
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
            raise MarkerError(f"{where}:{i + 1}: not an EXERCISE marker: {line.strip()!r} (BEGIN: <task>, STUB, END)")
    if block:
        raise MarkerError(f"{where}:{block['start'] + 1}: EXERCISE {block['name']} BEGIN has no END")
    return blocks


def check_blocks(blocks, chapter, table=EXERCISES):
    """Raise MarkerError unless the blocks are well-formed for `chapter` and match the table."""
    seen = set()
    for b in blocks:
        where = f"{chapter}/attention.cu:{b['start'] + 1}"
        if b["name"] in seen:
            raise MarkerError(f"{where}: exercise {b['name']} is marked twice")
        seen.add(b["name"])
        if b["name"][:2] != chapter[:2]:
            raise MarkerError(f"{where}: exercise {b['name']} is in chapter {chapter}: names start with {chapter[:2]}.")
        info = table.get(b["name"])
        if not info:
            raise MarkerError(f"{where}: exercise {b['name']} has no entry in common/exercises.py EXERCISES")
        if info["kind"] == "speed" and b["stub"] is None:
            raise MarkerError(f"{where}: speed exercise {b['name']} needs STUB lines (its slow, correct code)")
        if b["stub"] is None and not b["indent"]:
            raise MarkerError(f"{where}: {b['name']}: an EXERCISE_TODO stub needs a block inside a function")


def solution_lines(text, block):
    """The lines a block spans in the chapter, its markers included."""
    return text.splitlines(keepends=True)[block["start"]:block["end"] + 1]


# --- The student copy ----------------------------------------------------------------------------
def shape_text(shape):
    b, h, n, d, causal = shape
    return f"B={b} H={h} N={n} D={d}{' causal' if causal else ''}"


def region_lines(block, chapter, ending="\n", table=EXERCISES):
    """The student copy's lines in place of a block."""
    info, name, indent = table[block["name"]], block["name"], block["indent"]
    speed = info["kind"] == "speed"
    wrap = textwrap.TextWrapper(width=100 - len(indent), initial_indent="", subsequent_indent="  ")
    lines = [f"// EXERCISE {name} TODO{' (speed)' if speed else ''}: {block['task']}"]
    lines += [f"// {line}" for line in wrap.wrap("Hint: " + info["hint"])]
    if speed:
        lines.append(f"// Gate: {gate_text(info)}.")
        lines.append("// The code below is correct but slow: make it fast.")
    lines.append(f"// Grade: make grade CH={chapter[:2]}; the exercise: {chapter}/README.md, Exercises.")
    out = [indent + line + ending for line in lines]
    out += block["stub"] if block["stub"] is not None else [f'{indent}EXERCISE_TODO("{name}");{ending}']
    return out + [f"{indent}// EXERCISE END{ending}"]


def select(blocks, only):
    """The blocks named in `only` ('online_update' or '04.online_update'; None: all)."""
    if not only:
        return blocks
    wanted, chosen = [w.strip() for w in only], []
    for w in wanted:
        hits = [b for b in blocks if w in (b["name"], b["name"].split(".", 1)[1])]
        if not hits:
            names = ", ".join(b["name"] for b in blocks) or "none"
            raise MarkerError(f"no exercise '{w}' in this chapter; its exercises: {names}")
        chosen += [b for b in hits if b not in chosen]
    return chosen


def student_copy(text, chapter, only=None):
    """(the student copy of a chapter source, the names of its exercises)."""
    blocks = parse(text, f"{chapter}/attention.cu")
    check_blocks(blocks, chapter)
    chosen = select(blocks, only)
    lines = text.splitlines(keepends=True)
    for block in sorted(chosen, key=lambda b: b["start"], reverse=True):
        ending = lines[block["start"]][len(lines[block["start"]].rstrip("\r\n")):] or "\n"
        lines[block["start"]:block["end"] + 1] = region_lines(block, chapter, ending)
    return "".join(lines), [b["name"] for b in sorted(chosen, key=lambda b: b["start"])]


def regions(text):
    """The exercise regions of a student copy: [(name, first line index, END line index)]."""
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
    """The student copy with each region replaced by the chapter's block of that name."""
    blocks = {b["name"]: b for b in parse(chapter_text)}
    lines = student_text.splitlines(keepends=True)
    for name, first, last in reversed(regions(student_text)):
        lines[first:last + 1] = solution_lines(chapter_text, blocks[name])
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
    differs from what was written last (the student's work) unless force."""
    text, names = student_copy(chapter_source(chapter, root), chapter, only)
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
    """What a speed exercise times: (shape, the harness column)."""
    return info["shape"], info.get("timed", "ms")


def gate_text(info):
    """"at most 1.10x the chapter's time at B=4 ...": a speed exercise's gate in words."""
    return f"at most {info['gate']:.2f}x the chapter's {timed_what(timed_as(info)[1])} at {shape_text(info['shape'])}"


def describe(name, table=EXERCISES):
    info = table[name]
    if info["kind"] == "speed":
        return f"speed, gate: {gate_text(info)}"
    return "correctness"


def command_make(args):
    chapter = find_chapter(args.chapter)
    if not chapter:
        return fail(2, f"make exercise: no chapter '{args.chapter}' (e.g. CH=04; chapters: {' '.join(chapters())})")
    try:
        path, names = write_copy(chapter, args.only.split(",") if args.only else None, args.force)
    except (MarkerError, FileExistsError) as exc:
        return fail(2, f"make exercise: {exc}")
    tasks = {b["name"]: b["task"] for b in parse(chapter_source(chapter))}
    print(f"{os.path.relpath(path, ROOT)}: the student copy of {chapter}, {len(names)} exercise(s) to do:")
    for name in names:
        print(f"  {name} ({describe(name)}): {tasks[name]}")
    print(f"Edit it, then: make grade CH={chapter[:2]}  (the exercises: {chapter}/README.md, \"Exercises\")")
    return 0


def exercise_chapters(root=ROOT):
    return " ".join(c[:2] for c in chapters(root) if parse(chapter_source(c, root)))


def command_list(_args):
    for chapter in chapters():
        for block in parse(chapter_source(chapter), chapter):
            info = EXERCISES[block["name"]]
            print(f"{block['name']:18} {describe(block['name'])}\n{'':18} task: {block['task']}")
            if info["kind"] == "speed":
                print(f"{'':18} the stub: {info['stub']}")
    return 0


def fail(code, message):
    print(message, file=sys.stderr)
    return code


# --- make grade: the static part -----------------------------------------------------------------
def import_tests():
    """tests/ and common/ on sys.path (the claims and sanitizer helpers live there)."""
    for folder in (os.path.join(ROOT, "tests"), os.path.join(ROOT, "common")):
        if folder not in sys.path:
            sys.path.insert(0, folder)


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
        return False, f"{shlex.join(cmd)}: timed out"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


class ClaimContext:
    """What tests/test_cpu_claims.py's cases need of the test runner's context, pointed at the
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
            raise AssertionError(f"timed out after {timeout} s: {shlex.join(map(str, cmd))}") from None

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
            raise unittest.SkipTest(f"{path} not built")
        return path

    def rel(self, path):
        return os.path.relpath(str(path), ROOT)

    def close(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def sass_tools():
    """(cuobjdump, env) found where the tests look (PATH, next to nvcc, .cache/tools), or None
    with the reason: the grader fetches nothing."""
    import test_cpu_claims as claims
    found = {}
    for name in ("cuobjdump", "nvdisasm"):
        found[name] = claims.find_tool(type("Repo", (), {"root": Path(ROOT)}), name)
        if not found[name]:
            return None, f"{name} not found (PATH, next to nvcc, .cache/tools; make test fetches it)"
    path = os.path.dirname(found["nvdisasm"]) + os.pathsep + os.environ.get("PATH", "")
    return (found["cuobjdump"], {"PATH": path}), None


def claim_checks(chapter, build):
    """[(name, 'pass'|'fail'|'skip', note)]: tests/test_cpu_claims.py's claims on the copy."""
    import_tests()
    import test_cpu_claims as claims
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
            ctx.cache["sass_tools"] = (None, f"no {claims.SASS_ARCH} code in the build (ARCH=...): SASS claims need it")
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


# --- make grade: the GPU part --------------------------------------------------------------------
def shape_args(shape):
    b, h, n, d, causal = shape
    return ["--batch", str(b), "--heads", str(h), "--seqlen", str(n), "--headdim", str(d)] + \
        (["--causal"] if causal else [])


def run_case(binary, chapter, args, timeout=RUN_TIMEOUT_S):
    """(status, row, note) of one --csv run (stages.classify: PASS, FAIL, skipped, usage, error);
    the row also has the harness's further columns (lse_err, attend_ms, ...; None when absent)."""
    import_tests()
    from stages import classify, run_binary
    code, out, err = run_binary(binary, args + ["--csv"], timeout=timeout)
    return classify(chapter, code, out, err)


def probe_gpu(solution, chapter):
    """(usable, reason): the chapter's binary on a tiny shape; exit 77 is no usable GPU."""
    status, _, note = run_case(solution, chapter, shape_args((1, 1, 16, 64, False)) + ["--no-check", "--iters", "1",
                                                                                      "--warmup", "0"])
    return status != "skipped", note or status


def matrix(student, chapter):
    """One line per MATRIX case; the number that failed."""
    failed = 0
    for shape in MATRIX:
        status, row, note = run_case(student, chapter, shape_args(shape) + ["--warmup", "0", "--iters", "1"])
        ok = status == "PASS"
        failed += not ok
        detail = f"rel_l2 {row['rel_l2']:.2e}" if row and row["rel_l2"] is not None else ""
        detail += f", lse_err {row['lse_err']:.2e}" if row and row["lse_err"] is not None else ""
        reason = "; ".join(x for x in (detail, note) if x)
        print(f"    {'PASS' if ok else 'FAIL'}  {shape_text(shape):26} {reason}")
    return failed


def racecheck(student, chapter):
    """('pass'|'fail'|'skip', note): compute-sanitizer racecheck at RACECHECK_SHAPE."""
    import_tests()
    from test_sanitize import check_summary, find_sanitizer
    sanitizer = find_sanitizer()
    if not sanitizer:
        return "skip", "compute-sanitizer not found (PATH, next to nvcc, /usr/local/cuda)"
    args = shape_args(RACECHECK_SHAPE) + ["--warmup", "0", "--iters", "1"]
    run_case(student, chapter, args)  # makes the shape's inputs and reference outside the sanitizer
    cmd = [sanitizer, "--tool", "racecheck", "--error-exitcode", "99", "--target-processes", "application-only",
           student] + args
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "fail", f"timed out after {RUN_TIMEOUT_S} s"
    output = proc.stdout + proc.stderr
    if "RACECHECK SUMMARY" not in output and proc.returncode != 99:
        lines = [l for l in output.splitlines() if l.strip()]
        return "skip", f"racecheck did not run here (exit {proc.returncode}): {lines[-1] if lines else 'no output'}"
    try:
        check_summary("racecheck", output, f"racecheck {shape_text(RACECHECK_SHAPE)}")
    except AssertionError as exc:
        hazards = [l for l in output.splitlines() if l.startswith("=========")][:12]
        return "fail", "\n".join([str(exc)] + hazards)
    return "pass", f"{shape_text(RACECHECK_SHAPE)}: 0 hazards"


def timed_what(column):
    return "attention kernel" if column == "attend_ms" else "time"


def timing(student, solution, chapter, shape, column="ms"):
    """(ratio or None, line): the copy's time (the row's `column`) beside the chapter's, the two
    run alternately TIME_ROUNDS times; the best median of each counts."""
    best = {}
    for _ in range(TIME_ROUNDS):
        for who, binary in (("chapter", solution), ("yours", student)):
            status, row, note = run_case(binary, chapter, shape_args(shape))
            if status != "PASS":
                shown = "your copy" if who == "yours" else "the chapter"
                return None, f"{shape_text(shape)}: not timed: {shown}: {status}{': ' + note if note else ''}"
            if row.get(column) is None:
                return None, f"{shape_text(shape)}: not timed: the harness printed no {column}"
            best[who] = min(best.get(who, row[column]), row[column])
    ratio = best["yours"] / best["chapter"]
    what = "" if column == "ms" else f" ({timed_what(column)})"
    return ratio, (f"{shape_text(shape)}{what}: yours {best['yours']:.3f} ms, the chapter's {best['chapter']:.3f} ms "
                   f"(best of {TIME_ROUNDS} alternate runs, each the median of 10): {ratio:.2f}x")


# --- make grade ----------------------------------------------------------------------------------
def copy_exercises(chapter, text):
    """The exercises a student copy holds: from make exercise's record, else from its regions."""
    record = read_record(os.path.join(STUDENT_DIR, chapter)) or {}
    names = record.get("exercises") or [name for name, _, _ in regions(text)]
    return [n for n in names if n in EXERCISES]


def say(label, text):
    lines = str(text).splitlines() or [""]
    print(f"  {label:9} {lines[0]}")
    for line in lines[1:]:
        print(f"  {'':9} {line}")


def grade_static(chapter, build, make, text):
    """Build, stubs, claims: the failed check names."""
    failed = []
    ok, output = build_copy(chapter, build, make)
    if not ok:
        say("build", "FAIL: the copy does not build with the Makefile's flags (warnings count):\n" +
            "\n".join(output.splitlines()[-40:]))
        return ["build"]
    say("build", f"{os.path.relpath(os.path.join(STUDENT_DIR, chapter, 'attention.cu'), ROOT)} -> "
        f"{build}/exercises/{chapter}: ok (the Makefile's nvcc line, no warnings)")
    todo = sorted(set(TODO_CALL.findall(text)))
    for name in todo:
        say("stubs", f"TODO: exercise {name} is not written yet (its EXERCISE_TODO is still in the source)")
    if todo:
        failed.append("stubs")
    else:
        say("stubs", "none left")
    results = claim_checks(chapter, build)
    count = {kind: sum(r[1] == kind for r in results) for kind in ("pass", "fail", "skip")}
    why_skipped = "; ".join(sorted({note for _, outcome, note in results if outcome == "skip"}))
    say("claims", f"{count['pass']} of {len(results)} pass (tests/test_cpu_claims.py's claims on {chapter})"
        + (f", {count['skip']} skipped: {why_skipped}" if count["skip"] else ""))
    bad = [r for r in results if r[1] == "fail"]
    for name, _, note in bad:
        say("", f"FAIL {name}: {note.splitlines()[0]}")
    if bad:
        failed.append("claims")
    return failed


def grade_gpu(chapter, build, names):
    """Matrix, racecheck, time and gates: the failed check names."""
    student = os.path.join(ROOT, build, "exercises", chapter)
    solution = os.path.join(ROOT, build, chapter)
    failed = []
    print(f"  matrix    {len(MATRIX)} runs (D 64/128, causal or not, N 1/77/256/1000, B,H 1,1 and 2,3):")
    bad = matrix(student, chapter)
    say("", f"{len(MATRIX) - bad} of {len(MATRIX)} pass")
    if bad:
        failed.append("matrix")
    outcome, note = racecheck(student, chapter)
    say("racecheck", f"{outcome.upper()}: {note}")
    if outcome == "fail":
        failed.append("racecheck")
    speed = [n for n in names if EXERCISES[n]["kind"] == "speed"]
    timed = [timed_as(EXERCISES[n]) for n in speed] or [(TIME_SHAPE.get(int(chapter[:2]), DEFAULT_TIME_SHAPE), "ms")]
    ratios = {}
    for shape, column in dict.fromkeys(timed):
        ratios[shape, column], line = timing(student, solution, chapter, shape, column)
        say("time", line)
    for name in speed:
        gate, ratio = EXERCISES[name]["gate"], ratios[timed_as(EXERCISES[name])]
        ok = ratio is not None and ratio <= gate
        shown = f"{ratio:.2f}x" if ratio is not None else "no time"
        say("speed", f"{'PASS' if ok else 'FAIL'} {name}: {shown} the chapter's "
                     f"{timed_what(timed_as(EXERCISES[name])[1])}, gate <= {gate:.2f}x")
        if not ok:
            failed.append(f"speed {name}")
    return failed


def command_grade(args):
    chapter = find_chapter(args.chapter)
    if not chapter:
        return fail(2, f"make grade: no chapter '{args.chapter}' (e.g. CH=04; chapters: {' '.join(chapters())})")
    path = os.path.join(STUDENT_DIR, chapter, "attention.cu")
    if not os.path.isfile(path):
        return fail(2, f"make grade: no student copy {os.path.relpath(path, ROOT)}: make exercise CH={chapter[:2]} first")
    with open(path) as f:
        text = f.read()
    names = copy_exercises(chapter, text)
    shown = ", ".join(f"{n} ({EXERCISES[n]['kind']})" for n in names) or "none recorded"
    print(f"grade {chapter}: {os.path.relpath(path, ROOT)}, exercises {shown}")
    failed = grade_static(chapter, args.build, args.make, text)
    gpu_note = None
    if "build" not in failed:
        usable, reason = probe_gpu(os.path.join(ROOT, args.build, chapter), chapter)
        if usable:
            failed += grade_gpu(chapter, args.build, names)
        else:
            gpu_note = f"skipped: {reason}: the matrix, racecheck, timing and speed gates need a GPU"
            say("gpu", gpu_note)
    verdict = "FAIL" if failed else "PASS"
    detail = f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else "every check that ran passed"
    print(f"{verdict} {chapter}: {detail}{'; the GPU part was skipped' if gpu_note else ''}")
    return 1 if failed else 0


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
    args = parser.parse_args(argv)
    return {"list": command_list, "make": command_make, "grade": command_grade}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
