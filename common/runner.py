"""The bottom layer of the Python tools: find a chapter, run one of its binaries, and read what
it printed. common/stages.py (make run, make bench), the exercises' grader (make grade), ablation.py
(make ablation, make diff) and the tests stand on it; nothing here imports them, and nothing in
common/ imports tests/.

  chapters(), find_chapter(arg)      the chapter folders; 4, 04, 04_fused or a step (08.3) -> its folder
  run_binary(binary, args)           (exit code, stdout, stderr), None on a timeout or a missing file
  classify(name, code, out, err)     (status, row, note): PASS, FAIL, unchecked, skipped, usage, error
  run_case(binary, name, args)       run_binary with --csv, classified
  parse_csv_line(line)               a binary's --csv row as a result row (results.HARNESS_FIELDS)
  shape_args((B, H, N, D, causal))   the command line of a shape
  gpu_probe(binary)                  (usable, why): whether a chapter binary finds a GPU it can run on
  make_env()                         the environment of a make run from inside make
  Repo(root, build)                  a checkout and its build folder: run commands, temporary
                                     folders, values computed once (the tests' and the grader's)
"""
import csv
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest
from pathlib import Path

from results import CSV_FIELDS, HARNESS_FIELDS, HARNESS_NUMBERS, OPTIONAL_FIELDS, parse_value

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY_TIMEOUT_S = 600  # a binary still running after this is counted as an error


# --- Chapters ------------------------------------------------------------------------------------
def chapters(root=ROOT):
    """NN_name of every chapter, in order."""
    return sorted(d for d in os.listdir(root) if re.match(r"\d\d_", d)
                  and os.path.isfile(os.path.join(root, d, "attention.cu")))


def build_of(arg, root=ROOT):
    """The build a name means: 4, 04 or 04_fused its chapter's (04_fused); a step, 08.3, its step file's
    build (08_fp8.step3), and the last step its chapter's (08.6: 08_fp8). ValueError, saying what
    there is, for a name that means none."""
    chapter = find_chapter(arg, root)
    if not chapter:
        raise ValueError(f"no chapter '{arg}' (chapters: {' '.join(chapters(root))})")
    step = str(arg).partition(".")[2]
    if not step:
        return chapter
    files = [name for name in os.listdir(os.path.join(root, chapter)) if re.match(r"step\d+_\w+\.cu$", name)]
    last = len(files) + 1
    if not files or not step.isdigit() or not 1 <= int(step) <= last:
        steps = f"its steps are {chapter[:2]}.1 ... {chapter[:2]}.{last}" if files else "it has no steps"
        raise ValueError(f"no step '{arg}' of {chapter}: {steps}")
    return chapter if int(step) == last else f"{chapter}.step{int(step)}"


def find_chapter(arg, root=ROOT):
    """The chapter folder named by 4, 04 or 04_fused, or by one of its steps (08.3: 08_fp8); None if
    there is none. What a step names within its chapter is the caller's (source.without_switches)."""
    number = str(arg).partition(".")[0]
    for chapter in chapters(root):
        if number in (chapter, chapter[:2]) or (number.isdigit() and int(number) == int(chapter[:2])):
            return chapter
    return None


# --- Running a binary ------------------------------------------------------------------------------
def run_binary(binary, args, timeout=BINARY_TIMEOUT_S):
    """Run a binary; (exit code or None on timeout or a missing file, stdout, stderr)."""
    if not os.path.exists(binary):
        return None, "", f"{binary} not found: build it with make"
    try:
        done = subprocess.run([binary] + [str(a) for a in args], capture_output=True, text=True, errors="replace",
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout} s"
    return done.returncode, done.stdout, done.stderr


def last_line(text, name=None):
    """The last non-empty line of text, without a leading '<name>: '."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line[len(name) + 2:] if name and line.startswith(name + ": ") else line


def parse_csv_line(line):
    """A binary's --csv row to a result row (None if it is not one), with the harness's further
    columns (HARNESS_FIELDS: lse_err, attend_ms, device_bytes, ...) where the row has them."""
    cells = next(csv.reader([line]), [])
    if len(cells) < len(CSV_FIELDS) - len(OPTIONAL_FIELDS):
        return None
    try:
        row = {k: parse_value(k, v) for k, v in zip(HARNESS_FIELDS, cells) if k in CSV_FIELDS}
        row.update({k: float(v) if v else None for k, v in zip(HARNESS_FIELDS, cells) if k in HARNESS_NUMBERS})
        row.setdefault("device_bytes", None)
    except ValueError:
        return None
    return row if row["status"] in ("PASS", "FAIL", "unchecked") else None


def classify(name, code, stdout, stderr):
    """(status, row, note) of one binary run; status is the row's or skipped/usage/error."""
    row = next((r for r in map(parse_csv_line, stdout.splitlines()) if r), None)
    if code == 77:
        line = last_line(stdout, name)
        return "skipped", None, line[len("skipped: "):] if line.startswith("skipped: ") else line
    if code == 2:
        return "usage", None, last_line(stderr, name)
    if code in (0, 1) and row is not None:
        return row["status"], row, last_line(stderr, name) if row["status"] == "FAIL" else None
    reason = last_line(stderr, name) or "no output"
    return "error", None, reason if code in (0, 1, None) else f"exit {code}: {reason}"


def run_case(binary, name, args, timeout=BINARY_TIMEOUT_S):
    """(status, row, note) of one --csv run (classify: PASS, FAIL, unchecked, skipped, usage,
    error); the row also has the harness's further columns (lse_err, attend_ms, ...; None when absent)."""
    code, out, err = run_binary(binary, list(args) + ["--csv"], timeout=timeout)
    return classify(name, code, out, err)


def shape_args(shape):
    """--batch B --heads H --seqlen N --headdim D [--causal] for a (B, H, N, D, causal) tuple."""
    b, h, n, d, causal = shape
    return ["--batch", str(b), "--heads", str(h), "--seqlen", str(n), "--headdim", str(d)] + \
        (["--causal"] if causal else [])


def gpu_probe(binary):
    """(usable, why): run a chapter binary at a tiny shape; its exit 77 (skipped) means no GPU it can
    use, and its line says why. (False, why) too when the binary is missing."""
    code, out, err = run_binary(binary, shape_args((1, 1, 16, 64, False)) + ["--no-check", "--iters", "1",
                                                                           "--warmup", "0"], timeout=300)
    if code is None:
        return False, err
    if code == 77:
        return False, last_line(out, os.path.basename(binary)).removeprefix("skipped: ")
    return True, f"{os.path.basename(binary)} ran (exit {code})"


def make_env():
    """os.environ for a make run started from inside make (make test, make grade): the parent's
    jobserver dropped from MAKEFLAGS (its pipe is not passed on), the rest kept (variables given
    to the outer make still apply)."""
    env = dict(os.environ)
    env["MAKEFLAGS"] = re.sub(r"\s*--jobserver-(auth|fds)=\S+", "", env.get("MAKEFLAGS", ""))
    return env


class Repo:
    """A checkout and its build folder, as the tests and make grade use them: paths, commands run in
    the checkout, temporary folders (removed by close()), and values computed once."""

    def __init__(self, root=ROOT, build="build", make="make"):
        self.root = Path(root).resolve()
        self.build = Path(build) if Path(build).is_absolute() else self.root / build
        self.python, self.make = sys.executable, make
        self._tmp = Path(tempfile.mkdtemp(prefix="fa-"))
        self._once, self._lock = {}, threading.Lock()

    def run(self, cmd, env=None, timeout=300, cwd=None, input=None):
        """Run cmd (a list) in the checkout; env adds to os.environ (a None value removes the
        variable). The CompletedProcess, text captured; a time-out or a missing program is an
        AssertionError that says so."""
        cmd = [str(c) for c in cmd]
        full_env = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = str(value)
        try:
            return subprocess.run(cmd, cwd=str(cwd or self.root), env=full_env, input=input,
                                  stdin=None if input is not None else subprocess.DEVNULL,
                                  capture_output=True, text=True, errors="replace", timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"timed out after {timeout} s: {shlex.join(cmd)}") from None
        except FileNotFoundError:
            raise AssertionError(f"cannot run {cmd[0]}: no such program") from None

    def tmpdir(self):
        """A fresh, empty folder, removed by close()."""
        return Path(tempfile.mkdtemp(dir=self._tmp))

    def once(self, key, fn):
        """fn(), computed once per key (a failure is computed again next time)."""
        with self._lock:
            if key in self._once:
                return self._once[key]
        value = fn()
        with self._lock:
            return self._once.setdefault(key, value)

    def binary(self, name):
        """BUILD/<name>: a chapter's executable, or another build's (08_fp8.step1)."""
        return self.build / name

    def require_binary(self, name):
        """The executable, or a skip when it was not built."""
        path = self.binary(name)
        if not path.is_file():
            raise unittest.SkipTest(f"{self.rel(path)} is not built: run make first")
        return path

    def rel(self, path):
        """path relative to the checkout where it is inside it."""
        try:
            return str(Path(path).resolve().relative_to(self.root))
        except ValueError:
            return str(path)

    def close(self):
        shutil.rmtree(self._tmp, ignore_errors=True)


def main(argv):
    """runner.py gpu WHAT BINARY: exit 0 where BINARY finds a GPU it can run on; else print
    "WHAT: skipped: <why>" (one line) and exit 77. The Makefile's targets that need a GPU ask this first.
    runner.py build NAME: the build a chapter's or a step's name means (build_of), or exit 2 saying why."""
    if len(argv) == 2 and argv[0] == "build":
        try:
            print(build_of(argv[1]))
            return 0
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    if len(argv) != 3 or argv[0] != "gpu":
        print("usage: runner.py gpu WHAT BINARY | runner.py build NAME", file=sys.stderr)
        return 2
    what, binary = argv[1], argv[2]
    usable, why = gpu_probe(binary)
    if usable:
        return 0
    print(f"{what}: skipped: {why}")
    return 77


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
