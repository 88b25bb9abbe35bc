"""make grade: build a student copy and grade it.

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

"""
import concurrent.futures
import os
import re
import shlex
import subprocess
import tempfile
import unittest

import claims
from chapters import read_chapter
from cuda_tools import check_summary, find_sanitizer
from exercise_copy import STUDENT_DIR, fail, link_common, read_record, regions
from exercise_markers import (EXERCISES, HEAD_DIMS, HEADLINE, PASSES, PASS_ARGS, PASS_WORDS, TODO_CALL, MarkerError,
                              cap, chapter_named, chapter_source, exercise_parts, is_standin, parse, pass_of,
                              shape_text, timed_as, timed_what, words_list)
from runner import Repo, gpu_probe, make_env, run_case, shape_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The compact GPU matrix: D x causal x N (1, one ragged tile, whole tiles, many and ragged) x (B, H);
# a grade runs the D that its exercises run at (`dims`; both when any of them has none).
MATRIX = [(b, h, n, d, causal) for d in HEAD_DIMS for causal in (False, True) for n in (1, 77, 256, 1000)
          for b, h in ((1, 1), (2, 3))]
RACECHECK_SHAPE = (1, 1, 130, 128, True)
# Where a copy's time is shown when no speed exercise names a shape (B, H, N, D, causal).
TIME_SHAPE = {1: (1, 16, 2048, 128, False)}
DEFAULT_TIME_SHAPE = HEADLINE
RUN_TIMEOUT_S = 300
TIME_ROUNDS = 2  # the chapter and the copy timed alternately, best median of each
# A ratio within a factor RETIME_WITHIN of its gate, on either side, is timed again, a round at a
# time, up to MAX_TIME_ROUNDS: another program on the GPU (a class sharing a machine, make test's
# other workers) slows whichever run it overlaps, not both alike, and a close call on either side
# deserves the same number of rounds.
RETIME_WITHIN, MAX_TIME_ROUNDS = 1.2, 4
MATRIX_WORKERS = 4  # the matrix's runs at once: one (B, H, N, D) per worker, its cases in order (they share inputs)



def case_args(case):
    """The command line of a grade's run: (B, H, N, D, causal), then its pass (forward if none given)."""
    return shape_args(tuple(case[:5])) + PASS_ARGS[case[5] if len(case) > 5 else "forward"]


def case_text(case):
    """A grade's run in words: its shape, and `backward` for a run of the backward pass."""
    return shape_text(tuple(case[:5])) + (" backward" if len(case) > 5 and case[5] == "backward" else "")


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


def claim_checks(chapter, build):
    """[(name, 'pass'|'fail'|'skip', note)]: common/claims.py's claims on the copy: the checkout seen
    from exercises/ (its NN_name/attention.cu), its binary in BUILD/exercises/."""
    try:
        adds = read_chapter(os.path.join(STUDENT_DIR, chapter, "attention.cu"))["adds"]
    except ValueError:
        adds = chapter
    repo = Repo(STUDENT_DIR, os.path.join(ROOT, build, "exercises"))
    out = []
    try:
        for name, fn in claims.claim_cases(chapter, int(chapter[:2]), adds):
            try:
                note = fn(repo)
                out.append((name, "pass", note if isinstance(note, str) else ""))
            except unittest.SkipTest as exc:
                out.append((name, "skip", str(exc)))
            except AssertionError as exc:
                out.append((name, "fail", str(exc)))
    finally:
        repo.close()
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


def close_call(best, gate, rounds):
    """Whether a copy timed `rounds` rounds (best {who: ms}) is close enough to its gate, on either
    side (gate / RETIME_WITHIN < ratio <= gate * RETIME_WITHIN), and few enough rounds ran, to be
    timed once more."""
    if gate is None or "chapter" not in best or rounds >= MAX_TIME_ROUNDS:
        return False
    return gate / RETIME_WITHIN < best["yours"] / best["chapter"] <= gate * RETIME_WITHIN


def time_copy(student, solution, chapter, shape, column="ms", pass_name="forward", checked=True, gate=None):
    """{ratio, line, failed}: the copy's time (the row's `column`, of that pass) beside the chapter's,
    the two run alternately TIME_ROUNDS times (more, up to MAX_TIME_ROUNDS, while the ratio is close
    to `gate` on either side: close_call), the best median of each counting; ratio None when either could
    not be timed (failed: 'yours', 'chapter' or 'column'). solution None: the copy alone. checked
    False: the runs skip the reference check (--no-check), so no float64 reference of a large shape
    is made (the tests' timings of the chapter's own stubs, checked elsewhere)."""
    best, what, where = {}, timed_what(column, pass_name), case_text(shape + (pass_name,))
    runs = [("yours", student)] if solution is None else [("chapter", solution), ("yours", student)]
    args, ran = case_args(shape + (pass_name,)) + ([] if checked else ["--no-check"]), "PASS" if checked else "unchecked"
    rounds = 0
    while rounds < TIME_ROUNDS or close_call(best, gate, rounds):
        rounds += 1
        for who, binary in runs:
            status, row, note = run_case(binary, chapter, args)
            said = f"{status}{': ' + note if note else ''}"
            if status != ran:
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
    how = f"the best of {rounds} runs{' taken alternately' if solution else ''}, each the median of 10"
    if solution is None:
        return dict(ratio=None, failed=None, line=f"{where}: your {what} {best['yours']:.3f} ms ({how})")
    ratio = best["yours"] / best["chapter"]
    return dict(ratio=ratio, failed=None, line=(
        f"{where}: your {what} {best['yours']:.3f} ms, the chapter's {best['chapter']:.3f} ms ({how}): {ratio:.2f}x"))


def timing(student, solution, chapter, shape, column="ms", pass_name="forward", checked=True, gate=None):
    """(ratio or None, line): time_copy's ratio and line."""
    timed = time_copy(student, solution, chapter, shape, column, pass_name, checked, gate)
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


def gate_checks(names):
    """The speed gates of these exercises (those that have one), in words."""
    return [f"the speed gate of {n}" for n in names if EXERCISES[n].get("gate")]


def gpu_checks(names):
    """What the GPU part decides, in words."""
    return ["the GPU matrix", "racecheck"] + gate_checks(names)


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
    if bad:  # a copy with wrong results is not timed: its time says nothing yet
        say("time", "not timed: your copy's results are wrong (the matrix above); its time counts once they are right.")
        for what in gate_checks(speed):
            checks.add(what, "not run", "the GPU matrix failed first")
        return
    timed = [timed_as(EXERCISES[n]) for n in speed] or [(TIME_SHAPE.get(int(chapter[:2]), DEFAULT_TIME_SHAPE), "ms",
                                                         passes[-1])]
    results = {}
    for key in dict.fromkeys(timed):
        gated = [n for n in speed if EXERCISES[n].get("gate") and timed_as(EXERCISES[n]) == key]
        results[key] = time_copy(student, solution, chapter, *key, gate=min((EXERCISES[n]["gate"] for n in gated),
                                                                            default=None))
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
    chapter, why = chapter_named(args.chapter, "make grade")
    if not chapter:
        return fail(2, why)
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
        usable, reason = gpu_probe(probe)
        if usable:
            grade_gpu(chapter, os.path.join(ROOT, args.build, "exercises", chapter), solution, names, checks,
                      no_solution=no_solution)
        else:
            gpu_not_run(names, reason, checks)
    code, line = verdict(chapter, checks)
    print(line)
    return code



