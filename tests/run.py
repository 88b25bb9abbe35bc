#!/usr/bin/env python3
"""The test runner: CPU tests always, the GPU matrix when a GPU is present, sanitize on demand.

    tests/run.py [--build DIR] [--make CMD] [--suite default|cpu|gpu|sanitize|all]
                 [-k SUBSTRING] [--gpu auto|yes|no] [--no-build] [--list] [-v] [--keep-tmp]

`make test` runs it with --build $(BUILD); `make sanitize` adds --suite sanitize.

A test module is tests/test_*.py. It may set SUITE = "cpu" (the default), "gpu" or "sanitize".
Its tests are its module-level functions named test_*, taking no argument or one `ctx`.
A test passes if it returns, fails on an exception (an AssertionError whose message says
what was expected and what came), and is skipped on unittest.SkipTest(reason).
A module may also define cases(ctx) -> [(name, fn) or (name, fn, group)]: sub-tests taking
ctx, each counted on its own. With PARALLEL = n the cases run on n threads; cases that
share a `group` run in one thread, in order (e.g. every chapter of one shape, so the
first run makes the shared input/reference cache and the others reuse it).

Modules run side by side, each on its own thread, with at most PROCESSES (os.cpu_count())
subprocesses of ctx.run at once; a GPU suite's are not counted (they wait on the GPU, PARALLEL
bounds them, and the CPU modules' compiles should not hold them up). A module with ALONE = True
runs after the others, by itself: one that times binaries, or that changes what the others
use. A test or case of such a module may carry fn.prepare(ctx), untimed work (a build) done
ahead, beside the other modules, whose result the case finds cached through ctx.once; a
failure there is left for the case to report. A module with ISOLATED = True, one that changes
what is the whole process's (os.environ, another module's attribute), runs beside the others
in a Python process of its own (tests/run.py --module NAME --report FILE), its line and counts
merged here. sys.stdout is the whole process's too, and tests run on many threads: a test
that captures what it prints does it with ctx.captured_stdout(), which takes that thread's
writes only (contextlib.redirect_stdout would take every thread's, and restore the wrong
stream when two overlap).

Before the CPU tests the multiarch binaries are built (make BUILD=<build>/multiarch
ARCH=multi all); when a GPU is present, the native ones too (make BUILD=<build> all), at the
same time where nvidia-smi lists one.
A build failure is a failed test. Each module's line (`.` a pass, `s` a skip, failures in full)
is printed whole when the module ends; after ten seconds without output, a `~` line names the
modules still running. The last line of the output is always
`N passed, N failed` or `N passed, N failed, N skipped`; the exit code is 1 on any failure.
"""
import argparse
import concurrent.futures
import contextlib
import copy
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITES = {"default": ["cpu", "gpu"], "cpu": ["cpu"], "gpu": ["gpu"], "sanitize": ["sanitize"],
          "all": ["cpu", "gpu", "sanitize"]}
NEEDS_GPU = {"gpu", "sanitize"}
BUILD_TIMEOUT_S = 3600
ISOLATED_TIMEOUT_S = 1800  # an ISOLATED module's whole process
DETAIL_LINES = 40  # lines of a failure message shown under it
HEARTBEAT_S = 10  # a `~` line after this long without output
PROCESSES = os.cpu_count() or 1  # subprocesses (ctx.run) at once, over all the CPU modules


def discover_chapters(root):
    """Chapter directories NN_name holding an attention.cu, in order (as the Makefile does)."""
    return sorted(p.parent.name for p in root.glob("[0-9][0-9]_*/attention.cu"))


class ThreadStdout:
    """sys.stdout during a run: each thread writes to the stream it captures into
    (Context.captured_stdout), or else to the real stdout."""

    def __init__(self, real):
        self.real, self.local = real, threading.local()

    def target(self):
        return getattr(self.local, "stream", None) or self.real

    def write(self, text):
        return self.target().write(text)

    def flush(self):
        self.target().flush()

    def __getattr__(self, name):  # fileno, isatty, encoding ...: the real stream's
        return getattr(self.real, name)


class Context:
    """What every test gets: paths, tools, the chapters, whether a GPU is usable, helpers."""

    def __init__(self, root, build, make, tmp_root):
        self.root = root
        self.build = build                    # native build (make BUILD=<build>)
        self.multiarch = build / "multiarch"  # sm_80 + sm_89 + sm_90 + PTX (ARCH=multi)
        self.python = sys.executable
        self.make = make
        self.chapters = discover_chapters(root)
        self.gpu = False
        self.gpu_reason = "not probed"
        self.build_failed = {}                # build name -> output tail
        self._tmp_root = tmp_root
        self._lock = threading.Lock()
        self._once = {}
        self.procs = threading.BoundedSemaphore(PROCESSES)  # held only while its subprocess runs
        self.child_args = None                # an ISOLATED module's run.py arguments; None: run it here

    # --- helpers ---------------------------------------------------------------------
    def tmpdir(self):
        """A fresh, empty temporary directory (removed when the run ends)."""
        return Path(tempfile.mkdtemp(dir=self._tmp_root))

    def run(self, cmd, env=None, timeout=300, cwd=None, input=None):
        """Run cmd (a list) in the repo root; env adds to (None: removes from) os.environ.
        Returns the CompletedProcess (text, stdout/stderr captured); a time-out is a failure."""
        cmd = [str(c) for c in cmd]
        full_env = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = str(value)
        try:
            with self.procs:
                return subprocess.run(cmd, cwd=str(cwd or self.root), env=full_env, input=input,
                                      stdin=None if input is not None else subprocess.DEVNULL,
                                      capture_output=True, text=True, errors="replace",
                                      timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"timed out after {timeout} s: {shlex.join(cmd)}") from None
        except FileNotFoundError:
            raise AssertionError(f"cannot run {cmd[0]}: no such program") from None

    @contextlib.contextmanager
    def captured_stdout(self):
        """A StringIO that receives what this thread prints meanwhile; other threads print as before."""
        if not isinstance(sys.stdout, ThreadStdout):  # a module imported by something other than run.py
            sys.stdout = ThreadStdout(sys.stdout)
        stream, before = io.StringIO(), getattr(sys.stdout.local, "stream", None)
        sys.stdout.local.stream = stream
        try:
            yield stream
        finally:
            sys.stdout.local.stream = before

    def chapter_number(self, chapter):
        return int(chapter[:2])

    def binary(self, chapter, native=False):
        return (self.build if native else self.multiarch) / chapter

    def require_binary(self, chapter, native=False):
        """The chapter's executable, or a skip when the build did not produce it (the build
        itself is reported as a failure)."""
        path = self.binary(chapter, native)
        if not path.is_file():
            raise unittest.SkipTest(f"{self.rel(path)} not built (the build failed or did not run)")
        return path

    def rel(self, path):
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return str(path)

    def once(self, key, fn):
        """fn() computed once per key for the whole run, thread-safe (a failure is retried)."""
        with self._lock:
            entry = self._once.setdefault(key, [threading.Lock(), False, None])
        with entry[0]:
            if not entry[1]:
                entry[2] = fn()
                entry[1] = True
            return entry[2]


# --- results and output ---------------------------------------------------------------------
class Job:
    """A module (or a build) running: its counts and its line, kept until it ends."""

    def __init__(self, name, total):
        self.name, self.total, self.start = name, total, time.time()
        self.passed = self.failed = self.skipped = 0
        self.text, self.midline = f"{name} ", True  # midline: progress marks end the text


class Results:
    def __init__(self, verbose, out=None):
        self.passed = self.failed = self.skipped = 0
        self.failures = []        # test ids
        self.skip_reasons = {}    # reason -> count
        self.verbose = verbose
        self.running = []         # jobs begun and not ended, in the order begun
        self.out = out or sys.stdout  # the real stdout, taken before main() installs ThreadStdout
        self.lock = threading.Lock()
        self.last_output = time.time()
        if out is None:  # a report for the parent run (--report) has no `~` lines
            threading.Thread(target=self.heartbeat, daemon=True).start()

    def write(self, text):
        """Print text (whole lines); the caller holds self.lock."""
        self.out.write(text)
        self.out.flush()
        self.last_output = time.time()

    def line(self, text):
        with self.lock:
            self.write(text + "\n")

    def heartbeat(self):
        """A `~` line naming what still runs, for every HEARTBEAT_S without output."""
        while True:
            time.sleep(1)
            with self.lock:
                if time.time() - self.last_output >= HEARTBEAT_S:
                    self.write("~" + self.still_running() + "\n")

    def still_running(self, width=100):
        """` running: a 3/10, b, ... (+N more)`: the jobs begun and not ended, cut to about width."""
        names = [j.name + (f" {j.passed + j.failed + j.skipped}/{j.total}" if j.total else "") for j in self.running]
        shown = []
        for name in names:
            if shown and len(", ".join(shown + [name])) > width:
                break
            shown.append(name)
        more = len(names) - len(shown)
        return f" running: {', '.join(shown)}" + (f" (+{more} more)" if more else "") if names else ""

    def begin(self, name, total=0):
        job = Job(name, total)
        with self.lock:
            self.running.append(job)
        return job

    def end(self, job, text=None):
        """Print the job's line whole, ended by text (default: its counts and time)."""
        if text is None:
            text = f" {job.passed} passed, {job.failed} failed" + (f", {job.skipped} skipped" if job.skipped else "")
            text += f" ({time.time() - job.start:.1f} s)"
        with self.lock:
            self.running.remove(job)
            self.write(job.text + (text if job.midline else f"  {text.strip()}") + "\n")

    def merge(self, job, report):
        """End job with an ISOLATED module's report (its process's counts and printed lines)."""
        with self.lock:
            for key in ("passed", "failed", "skipped"):
                setattr(self, key, getattr(self, key) + report[key])
            self.failures += report["failures"]
            for reason, count in report["skip_reasons"].items():
                self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + count
            self.running.remove(job)
            self.write(report["text"])

    def report(self):
        """What a --report run hands its parent."""
        return {"passed": self.passed, "failed": self.failed, "skipped": self.skipped, "failures": self.failures,
                "skip_reasons": self.skip_reasons, "text": self.out.getvalue()}

    def record(self, test_id, outcome, message="", job=None, seconds=None):
        """Count a result; its mark or lines go on the job's line (without a job: lines printed now);
        -v lines end with the test's time."""
        with self.lock:
            for counts in [self] + ([job] if job else []):
                if outcome == "pass":
                    counts.passed += 1
                elif outcome == "skip":
                    counts.skipped += 1
                else:
                    counts.failed += 1
            if outcome == "skip":
                self.skip_reasons[message] = self.skip_reasons.get(message, 0) + 1
            elif outcome != "pass":
                self.failures.append(test_id)
            if self.verbose or outcome == "fail":
                note = f": {first_line(message)}" if message else ""
                took = f" ({seconds:.1f} s)" if seconds is not None and self.verbose else ""
                lines = [f"  {outcome.upper():4} {test_id}{took}{note}"]
                if outcome == "fail":
                    lines += [f"       {line}" for line in detail_lines(message)]
                text = "\n".join(lines) + "\n"
                if job:
                    job.text += ("\n" if job.midline else "") + text
                    job.midline = False
                else:
                    self.write(text)
            elif job:
                job.text += "." if outcome == "pass" else "s"
                job.midline = True


def first_line(text):
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def detail_lines(text):
    lines = str(text).strip().splitlines()[1:]
    if len(lines) > DETAIL_LINES:
        lines = lines[:DETAIL_LINES // 2] + [f"... ({len(lines) - DETAIL_LINES} lines left out)"] + \
            lines[-DETAIL_LINES // 2:]
    return lines


def call_test(fn, ctx):
    """Run one test: ('pass'|'fail'|'skip', message)."""
    try:
        params = inspect.signature(fn).parameters
        note = fn(ctx) if len(params) >= 1 else fn()
        return "pass", note if isinstance(note, str) else ""
    except unittest.SkipTest as exc:
        return "skip", str(exc) or "skipped"
    except AssertionError as exc:
        message = str(exc)
        if not message:  # a bare assert: show where it was
            tb = traceback.extract_tb(exc.__traceback__)[-1]
            message = f"assertion failed at {Path(tb.filename).name}:{tb.lineno}: {tb.line}"
        return "fail", message
    except Exception as exc:  # a bug in the test or the code under test
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-3))
        return "fail", f"{type(exc).__name__}: {exc}\n{tb}"


# --- modules -------------------------------------------------------------------------------------
def load_modules(results, selected_suites, only=None):
    """Import tests/test_*.py (only: that one). Returns [(suite, name, module)]; an import error is
    a failure."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "common")]
    modules = []
    for path in sorted((ROOT / "tests").glob(f"{only or 'test_*'}.py")):
        name = path.stem
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        except unittest.SkipTest as exc:
            results.record(f"{name} (import)", "skip", str(exc))
            continue
        except Exception:
            results.record(f"{name} (import)", "fail", "import failed\n" + traceback.format_exc(limit=-3))
            continue
        suite = getattr(module, "SUITE", "cpu")
        if suite in selected_suites:
            modules.append((suite, name, module))
    order = {s: i for i, s in enumerate(["cpu", "gpu", "sanitize"])}
    modules.sort(key=lambda m: (order.get(m[0], 9), m[1]))
    return modules


def collect(name, module, ctx, results, pattern):
    """The module's tests [(id, fn)] and cases [(id, fn, group)], filtered by -k."""
    tests = [(f"{name}::{attr}", fn) for attr, fn in vars(module).items()
             if attr.startswith("test_") and inspect.isfunction(fn) and fn.__module__ == name]
    tests.sort(key=lambda t: t[1].__code__.co_firstlineno)
    cases = []
    if hasattr(module, "cases"):
        try:
            for item in module.cases(ctx):
                case_name, fn = item[0], item[1]
                group = item[2] if len(item) > 2 else ("case", case_name)
                cases.append((f"{name}::{case_name}", fn, group))
        except Exception:
            results.record(f"{name}::cases", "fail", "cases(ctx) failed\n" + traceback.format_exc(limit=-3))
    if pattern:
        keep = lambda test_id: pattern.lower() in test_id.lower()
        tests = [t for t in tests if keep(t[0])]
        cases = [c for c in cases if keep(c[0])]
    return tests, cases


def run_module(name, module, ctx, results, tests, cases):
    job = results.begin(name, len(tests) + len(cases))

    def run_one(test_id, fn):
        start = time.time()
        outcome, message = call_test(fn, ctx)
        results.record(test_id, outcome, message, job, seconds=time.time() - start)

    for test_id, fn in tests:
        run_one(test_id, fn)
    groups = {}
    for test_id, fn, group in cases:
        groups.setdefault(group, []).append((test_id, fn))

    def run_group(members):
        for test_id, fn in members:
            run_one(test_id, fn)

    workers = max(1, int(getattr(module, "PARALLEL", 1)))
    if workers == 1 or len(groups) <= 1:
        for members in groups.values():
            run_group(members)
    else:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for future in [pool.submit(run_group, m) for m in groups.values()]:
                future.result()
    results.end(job)


def prepare_module(name, module, ctx, results, tests, cases):
    """An ALONE module's fn.prepare(ctx) work, done ahead on threads of its own."""
    works = [fn.prepare for fn in [t[1] for t in tests] + [c[1] for c in cases] if hasattr(fn, "prepare")]
    if not works:
        return
    job = results.begin(f"{name} (prepare)")

    def attempt(work):
        try:
            work(ctx)
            return True
        except Exception:  # the case does it again, and reports what went wrong
            return False

    with concurrent.futures.ThreadPoolExecutor(len(works)) as pool:
        done = sum(pool.map(attempt, works))
    results.end(job, f" {done} of {len(works)} done ahead ({time.time() - job.start:.1f} s)")


def run_isolated(suite, name, ctx, results, total):
    """An ISOLATED module, run by tests/run.py in a process of its own; its report merged."""
    job = results.begin(name, total)
    report = ctx.tmpdir() / "report.json"
    cmd = [ctx.python, str(ROOT / "tests" / "run.py"), "--module", name, "--report", str(report), "--suite", suite,
           "--gpu", "yes" if ctx.gpu else "no", "--no-build", *ctx.child_args]
    try:
        proc = subprocess.run(cmd, cwd=str(ROOT), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=ISOLATED_TIMEOUT_S)
        said = f"exit {proc.returncode}, no report\n" + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
    except subprocess.TimeoutExpired:
        said = f"timed out after {ISOLATED_TIMEOUT_S} s"
    try:
        results.merge(job, json.loads(report.read_text()))
    except (OSError, ValueError, KeyError):
        results.record(f"{name} (its own process)", "fail", f"{shlex.join(cmd)}: {said}", job)
        results.end(job)


def run_modules(runs, ctx, results):
    """runs [(suite, name, module, tests, cases)] side by side, with the ALONE ones'
    preparations (builds: counted in PROCESSES); then each ALONE one by itself."""
    gpu_ctx = copy.copy(ctx)  # the same context (its caches too), its subprocesses not counted
    gpu_ctx.procs = contextlib.nullcontext()
    isolated = [r for r in runs if getattr(r[2], "ISOLATED", False) and ctx.child_args is not None]
    alone = [r for r in runs if getattr(r[2], "ALONE", False) and r not in isolated]
    together = [r for r in runs if r not in alone and r not in isolated]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(runs))) as pool:
        futures = [pool.submit(run_module, name, module, gpu_ctx if suite in NEEDS_GPU else ctx, results, tests, cases)
                   for suite, name, module, tests, cases in together]
        futures += [pool.submit(run_isolated, suite, name, ctx, results, len(tests) + len(cases))
                    for suite, name, module, tests, cases in isolated]
        futures += [pool.submit(prepare_module, name, module, ctx, results, tests, cases)
                    for suite, name, module, tests, cases in alone]
        for future in futures:
            future.result()
    for suite, name, module, tests, cases in alone:
        run_module(name, module, gpu_ctx if suite in NEEDS_GPU else ctx, results, tests, cases)


# --- builds and the GPU probe ------------------------------------------------------------------
def make_command(ctx, build_dir, extra):
    jobs = min(8, max(2, os.cpu_count() or 2))
    return shlex.split(ctx.make) + ["-k", f"-j{jobs}", f"BUILD={ctx.rel(build_dir)}"] + extra + ["all"]


def make_env():
    """The sub-make runs on its own -j: drop the parent make's jobserver (its pipe is not
    passed on), keep the rest of MAKEFLAGS (variables given to `make test` still apply)."""
    flags = re.sub(r"\s*--jobserver-(auth|fds)=\S+", "", os.environ.get("MAKEFLAGS", ""))
    return {"MAKEFLAGS": flags}


def build(ctx, results, test_id, build_dir, extra):
    job = results.begin(test_id)
    cmd = make_command(ctx, build_dir, extra)
    try:
        proc = ctx.run(cmd, env=make_env(), timeout=BUILD_TIMEOUT_S)
        ok, output = proc.returncode == 0, proc.stdout + proc.stderr
    except AssertionError as exc:
        ok, output = False, str(exc)
    if ok:
        results.record(test_id, "pass", job=job)
    else:
        tail = "\n".join(output.strip().splitlines()[-30:])
        ctx.build_failed[test_id] = tail
        results.record(test_id, "fail", f"'{shlex.join(cmd)}' failed; the end of its output:\n{tail}", job)
    results.end(job, f" {'ok' if ok else 'FAILED'} ({time.time() - job.start:.1f} s)")


def gpu_listed():
    """nvidia-smi's first line naming a GPU ("" where it lists none, or is not installed). Where it
    names one the native build starts beside the multiarch one, before the probe (which needs a
    built binary) says whether that GPU is usable."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return first_line(proc.stdout) if proc.returncode == 0 and "GPU" in proc.stdout else ""


def probe_gpu(ctx):
    """(usable, reason): run a chapter binary at a tiny shape (exit 77 = no usable GPU);
    without a binary, ask nvidia-smi."""
    binaries = [ctx.binary(c, native) for native in (False, True) for c in ctx.chapters]
    for binary in [b for b in binaries if b.is_file()][:1]:  # the oldest chapter, the least demanding
        try:
            proc = ctx.run([binary, "--batch", "1", "--heads", "1", "--seqlen", "16", "--headdim", "64",
                            "--no-check", "--iters", "1", "--warmup", "0"],
                           env={"FA_CACHE": ctx.tmpdir()}, timeout=300)
        except AssertionError as exc:
            return True, f"{ctx.rel(binary)} did not answer ({exc}): assuming a GPU"
        if proc.returncode == 77:
            return False, first_line(proc.stdout) or f"{ctx.rel(binary)} exited 77 (skipped)"
        return True, f"{ctx.rel(binary)} ran (exit {proc.returncode})"
    if not shutil.which("nvidia-smi"):
        return False, "no chapter binary to probe with and no nvidia-smi"
    listed = gpu_listed()
    return (True, listed) if listed else (False, "nvidia-smi -L lists no GPU")


# --- main ----------------------------------------------------------------------------------------
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default="build", help="native build folder (make's BUILD)")
    parser.add_argument("--make", default="make", help="the make command (make's $(MAKE))")
    parser.add_argument("--suite", choices=sorted(SUITES), default="default",
                        help="default: cpu, then gpu when a GPU is present; sanitize: compute-sanitizer")
    parser.add_argument("-k", dest="pattern", help="run only tests whose id contains this text")
    parser.add_argument("--gpu", choices=["auto", "yes", "no"], default="auto",
                        help="whether a GPU is usable (auto: probe)")
    parser.add_argument("--no-build", action="store_true", help="use the binaries already built")
    parser.add_argument("--list", action="store_true", help="list the test ids and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per test, with its time")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder")
    parser.add_argument("--module", help=argparse.SUPPRESS)  # with --report: an ISOLATED module's own run
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    start = time.time()
    build_dir = Path(args.build)
    build_dir = build_dir if build_dir.is_absolute() else (Path.cwd() / build_dir).resolve()
    tmp_root = Path(tempfile.mkdtemp(prefix="fa-tests-"))
    ctx = Context(ROOT, build_dir, args.make, tmp_root)
    if not args.report:
        ctx.child_args = ["--build", str(build_dir), "--make", args.make] + (["-k", args.pattern] if args.pattern else []) + \
            (["-v"] if args.verbose else [])
    results = Results(args.verbose, io.StringIO() if args.report else None)
    sys.stdout = ThreadStdout(sys.stdout)  # after Results took the real one
    suites = SUITES[args.suite]
    try:
        modules = load_modules(results, suites, args.module)
        if args.list:
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `--list | head` ends quietly
            for suite, name, module in modules:
                tests, cases = collect(name, module, ctx, results, args.pattern)
                for test_id in [t[0] for t in tests] + [c[0] for c in cases]:
                    print(f"{suite:8} {test_id}")
            return 0

        results.line(f"chapters: {' '.join(ctx.chapters) or '(none)'}")
        builds = {}  # name -> (folder, make arguments)
        if not args.no_build and "cpu" in suites:
            builds["build::multiarch"] = (ctx.multiarch, ["ARCH=multi"])
        if not args.no_build and NEEDS_GPU & set(suites) and args.gpu != "no" and gpu_listed():
            builds["build::native"] = (ctx.build, [])  # beside the multiarch one; the probe decides
        with concurrent.futures.ThreadPoolExecutor(max(1, len(builds))) as pool:
            for future in [pool.submit(build, ctx, results, name, *b) for name, b in builds.items()]:
                future.result()
        if args.gpu == "auto":
            ctx.gpu, ctx.gpu_reason = probe_gpu(ctx)
        else:
            ctx.gpu = args.gpu == "yes"
            ctx.gpu_reason = f"--gpu {args.gpu}"
        results.line(f"gpu: {'yes' if ctx.gpu else 'no'} ({ctx.gpu_reason})")
        if ctx.gpu and not args.no_build and NEEDS_GPU & set(suites) and "build::native" not in builds:
            build(ctx, results, "build::native", ctx.build, [])

        skipped_suites, runs = {}, []
        for suite, name, module in modules:
            tests, cases = collect(name, module, ctx, results, args.pattern)
            if not tests and not cases:
                continue
            if suite in NEEDS_GPU and not ctx.gpu:
                count = len(tests) + len(cases)
                skipped_suites[suite] = skipped_suites.get(suite, 0) + count
                results.skipped += count
                continue
            runs.append((suite, name, module, tests, cases))
        if args.report:  # the header above is the parent's: only the module's lines go back
            results.out.seek(0), results.out.truncate()
        run_modules(runs, ctx, results)
        if args.report:
            Path(args.report).write_text(json.dumps(results.report()))
            return 1 if results.failed else 0

        for suite, count in skipped_suites.items():
            results.line(f"SKIP {suite} suite ({count} tests): no usable GPU: {ctx.gpu_reason}")
        for reason, count in sorted(results.skip_reasons.items()):
            results.line(f"SKIP ({count}): {reason}")
        rank = {name: i for i, (_, name, _) in enumerate(modules)}  # failures in module order, as if run in turn
        for test_id in sorted(results.failures, key=lambda t: rank.get(re.split(r"::| ", t)[0], -1)):
            results.line(f"FAILED {test_id}")
        results.line(f"ran in {time.time() - start:.0f} s")
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp_root, ignore_errors=True)
        else:
            results.line(f"temporary files kept in {tmp_root}")
    line = f"{results.passed} passed, {results.failed} failed"
    if results.skipped:
        line += f", {results.skipped} skipped"
    results.line(line)
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())
