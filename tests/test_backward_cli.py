"""--backward on the command line (common/harness.cu), without a GPU.

A chapter without a backward pass refuses --backward, exit 2, in one line that names the chapter
that has one. The command line is read first (an unknown flag, a malformed value are reported as
such), then whether the chapter has a backward, then the inputs, the output folder and the shape:
none of those would make the run possible, so they are not what the message is about. --deterministic,
the backward's deterministic mode, is refused the same way without --backward (on any binary: it is a
mode of the backward pass), before the inputs, the output folder and the shape.

What a binary with a backward checks before any GPU work runs on tests/fixtures/backward_stub.cu, a
Chapter with a forward and a backward linked with the build's harness objects (and on any chapter
that registers a backward): --dry-run's plan (the backward's FLOPs, buffers, workspaces, the
reference's folder), --input's do.npy (missing, another dtype or shape, NaN, not a file: refused as
q.npy is), --output's dq.npy, dk.npy, dv.npy (checked as o.npy is), the cache folder of --input data
(its name hashes do.npy too), exit 77 without a GPU, and that the forward of the same binary is
unchanged; --deterministic's plan says the mode and sizes the backward's workspace for it.
"""
import os
import re

import numpy as np
import pytest

import cuda_tools
from helpers import BACKWARD_CHAPTERS, CHAPTERS, STEP_BUILDS
from test_cli import (AT_LEAST_1, CAST_TO_FP16, assert_refused, human_bytes, output_with, path_in_tmp, refusal,
                      run_binary, write_qkv)

STUB = "backward_stub"
STUB_SHAPES = [(1, 2, 16, 64, False), (2, 3, 100, 128, True), (1, 16, 65536, 128, False)]  # (B, H, N, D, causal)
NO_BACKWARD = [r"no backward", r"--backward", r"drop it"]  # what a chapter without one says
MODE_ALONE = [r"--deterministic is a mode of the backward pass"]  # --deterministic without --backward
WITHOUT_BACKWARD = [chapter for chapter in CHAPTERS if chapter not in BACKWARD_CHAPTERS]
# The stub's tests run on one worker, which compiles it once.
BACKWARD_BINARIES = [pytest.param(STUB, marks=pytest.mark.xdist_group(STUB)), *BACKWARD_CHAPTERS]


def stub_workspaces(b, h, n, d):
    """The stub's forward and backward scratch (tests/fixtures/backward_stub.cu)."""
    return b * h * n * 4, b * h * n * d * 4


def stub_deterministic_workspace(b, h, n, d):
    """The stub's backward scratch in its deterministic mode: twice the other's."""
    return 2 * b * h * n * d * 4


def stub_binary(repo):
    """tests/fixtures/backward_stub.cu linked with the build's harness objects, once per worker."""
    def build():
        objects = [repo.build / "common" / name for name in ("harness.o", "npy.o")]
        missing = [repo.rel(o) for o in objects if not o.is_file()]
        if missing:
            return None, f"{', '.join(missing)} not built (the build failed or did not run)"
        nvcc = cuda_tools.nvcc()
        if not nvcc:
            return None, "nvcc not found (PATH, $NVCC, /usr/local/cuda/bin): cannot link the backward stub"
        out = repo.tmpdir() / STUB
        proc = repo.run([nvcc, "-std=c++17", "-Xcompiler", "-Wall,-Wextra", "-gencode=arch=compute_80,code=sm_80",
                         "-o", out, repo.root / "tests" / "fixtures" / f"{STUB}.cu", *objects], timeout=600)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"nvcc failed on tests/fixtures/{STUB}.cu:\n{log.strip()[-3000:]}"
        warnings = [line for line in log.splitlines() if "warning" in line.lower()]
        assert not warnings, f"tests/fixtures/{STUB}.cu: compiler warnings:\n" + "\n".join(warnings[:20])
        return out, None
    out, why = repo.once("backward_stub_binary", build)
    if out is None:
        pytest.skip(why)
    return out


def binary_of(repo, name):
    return stub_binary(repo) if name == STUB else repo.require_binary(name)


# --- inputs with a dO ---------------------------------------------------------------------------------
def with_do(folder, shape=(1, 2, 16, 64), do=None, **qkv):
    """q, k, v (write_qkv) and do.npy: N(0, 1) fp16 of `shape` unless `do` is given (None: absent
    when do="absent")."""
    write_qkv(folder, shape=shape, **qkv)
    if isinstance(do, str) and do == "absent":
        return folder
    if do is None:
        do = np.random.default_rng(2).standard_normal(shape).astype(np.float16)
    if isinstance(do, np.ndarray):
        np.save(folder / "do.npy", do)
    return folder


def do_special(folder, kind):
    """A folder with fine q, k, v and a do.npy that is a FIFO, a directory, empty or truncated."""
    with_do(folder, do="absent")
    path = folder / "do.npy"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        np.save(path, np.zeros((1, 2, 16, 64), np.float16))
        path.write_bytes(path.read_bytes()[:-10])
    return folder


def do_with(value, index=(0, 1, 5, 17)):
    """A dO with one element set to value (NaN or Inf) at index."""
    array = np.random.default_rng(3).standard_normal((1, 2, 16, 64)).astype(np.float16)
    array[index] = value
    return array


def linked(folder, name, to):
    """An --output folder where `name` is a symbolic link to its `to` (an existing file)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / to).write_bytes(b"old")
    (folder / name).symlink_to(folder / to)
    return folder


def fnv1a(paths):
    """The harness's cache key of --input files: FNV-1a over their bytes, one after another."""
    h = 1469598103934665603
    for path in paths:
        for byte in path.read_bytes():
            h = ((h ^ byte) * 1099511628211) & (2 ** 64 - 1)
    return f"{h:016x}"


# --- chapters without a backward: refused, and in which order --------------------------------------
WITHOUT = [
    refusal("--backward", lambda t: ["--backward"], *NO_BACKWARD),
    refusal("--backward --dry-run", lambda t: ["--dry-run", "--backward"], *NO_BACKWARD),
    refusal("--backward --csv, small", lambda t: ["--backward", "--csv", "--batch", "1", "--heads", "1", "--seqlen",
                                                  "16", "--headdim", "64"], *NO_BACKWARD),
    # What the chapter cannot do comes before what is wrong with the shape, the inputs or the output:
    # fixing those would still not give it a backward.
    refusal("--backward, head dim 96", lambda t: ["--backward", "--headdim", "96"], *NO_BACKWARD, unwanted=r"\b96\b"),
    refusal("--backward, --input without do.npy", lambda t: ["--backward", "--input", write_qkv(t / "in")],
            *NO_BACKWARD, unwanted=r"do\.npy"),
    refusal("--backward, --input folder missing", lambda t: ["--backward", "--input", t / "nope"], *NO_BACKWARD,
            unwanted=r"nope"),
    refusal("--backward, --output a file", lambda t: ["--backward", "--output", write_qkv(t / "in") / "q.npy"],
            *NO_BACKWARD, unwanted=r"not a folder"),
    refusal("--backward, --output dq.npy a directory",
            lambda t: ["--dry-run", "--backward", "--output", output_with(t / "out", "dq.npy", "dir")], *NO_BACKWARD,
            unwanted=r"directory"),
    # The command line itself is read first, whatever else it asks for.
    refusal("--backward, --seqlen 0", lambda t: ["--backward", "--seqlen", "0"], r"--seqlen", r"\b0\b", AT_LEAST_1,
            unwanted=r"no backward"),
    refusal("--backward, unknown flag", lambda t: ["--backward", "--backwards"], r"--backwards", r"unknown",
            r"--help", unwanted=r"no backward"),
    refusal("--backward with a value", lambda t: ["--backward=1"], r"--backward", r"takes no value",
            unwanted=r"no backward"),
    # --deterministic is a mode of a pass this chapter has not: said so, whichever flag names it.
    refusal("--deterministic", lambda t: ["--deterministic"], *MODE_ALONE, r"which this chapter has not",
            r"drop it"),
    refusal("--deterministic --dry-run, head dim 96", lambda t: ["--dry-run", "--deterministic", "--headdim", "96"],
            *MODE_ALONE, r"which this chapter has not", unwanted=r"\b96\b"),
    refusal("--backward --deterministic", lambda t: ["--backward", "--deterministic"], *NO_BACKWARD,
            unwanted=r"mode of the backward"),
]


@pytest.mark.parametrize("make_args, patterns, unwanted", WITHOUT)
@pytest.mark.parametrize("chapter", WITHOUT_BACKWARD)
def test_chapter_without_backward_refuses_it(repo, tmp_path, chapter, make_args, patterns, unwanted):
    assert_refused(repo, repo.require_binary(chapter), chapter, make_args(tmp_path), patterns, unwanted, tmp_path)


@pytest.mark.parametrize("chapter", WITHOUT_BACKWARD)
def test_no_backward_message_names_the_chapter(repo, tmp_path, chapter):
    """The refusal of --backward starts with the chapter's own name."""
    message = run_binary(repo, repo.require_binary(chapter), ["--backward"], tmp_path / "cache").stderr.strip()
    assert message.startswith(f"{chapter}: "), f"{chapter} --backward: {message!r} does not name the chapter"


# --- 09's steps before the chapter: a backward without the deterministic mode ------------------------
# Steps 09.1-09.7 register a Backward whose `deterministic` is 0: the mode is 09.8's (the chapter's).
STEPS_WITHOUT_MODE = [build for _, build, _ in STEP_BUILDS if build.startswith("09_backward.")]
NO_MODE = [r"no deterministic mode", r"--deterministic", r"drop it", r"the chapter's"]


@pytest.mark.parametrize("args", [["--backward", "--deterministic"],
                                  ["--backward", "--deterministic", "--headdim", "96", "--dry-run"]],
                         ids=["--backward --deterministic", "head dim 96, --dry-run"])
@pytest.mark.parametrize("build", STEPS_WITHOUT_MODE)
def test_step_without_the_mode_refuses_deterministic(repo, tmp_path, build, args):
    """--deterministic on a step whose backward has no such mode: refused, before the shape and any GPU work,
    the step named (09.3: ...); its plain --backward is not (the dry run's plan)."""
    binary = repo.require_binary(build)
    assert_refused(repo, binary, build, args, NO_MODE, r"\b96\b", tmp_path)
    plain = run_binary(repo, binary, ["--dry-run", "--backward"], tmp_path / "plain")
    assert plain.returncode == 0, f"{build} --dry-run --backward: exit {plain.returncode}: {plain.stderr.strip()}"


# --- a binary with a backward: what it checks before any GPU work -----------------------------------
REFUSED = [
    # --deterministic without --backward: a mode of a pass not asked for, said before the rest.
    refusal("--deterministic without --backward", lambda t: ["--deterministic"], *MODE_ALONE, r"add --backward",
            unwanted=r"which this chapter has not"),
    refusal("--deterministic without --backward, --dry-run", lambda t: ["--dry-run", "--deterministic"],
            *MODE_ALONE, r"add --backward"),
    refusal("--deterministic without --backward, head dim 96 and --output a file",
            lambda t: ["--deterministic", "--headdim", "96", "--output", write_qkv(t / "in") / "q.npy"],
            *MODE_ALONE, unwanted=r"\b96\b|not a folder"),
    refusal("--deterministic with a value", lambda t: ["--backward", "--deterministic=1"], r"--deterministic",
            r"takes no value"),
    refusal("--backward --deterministic, do.npy missing",
            lambda t: ["--backward", "--deterministic", "--input", with_do(t / "in", do="absent")],
            path_in_tmp("in", "do.npy"), r"does not exist"),
    refusal("do.npy missing", lambda t: ["--backward", "--input", with_do(t / "in", do="absent")],
            path_in_tmp("in", "do.npy"), r"does not exist", r"--backward", r"float16|fp16"),
    refusal("do.npy missing, --dry-run",
            lambda t: ["--dry-run", "--backward", "--input", with_do(t / "in", do="absent")],
            r"do\.npy", r"does not exist"),
    refusal("do.npy float32",
            lambda t: ["--backward", "--input", with_do(t / "in", do=np.ones((1, 2, 16, 64), np.float32))],
            r"do\.npy", r"float32", *CAST_TO_FP16),
    refusal("do.npy int64, --dry-run",
            lambda t: ["--dry-run", "--backward", "--input", with_do(t / "in", do=np.ones((1, 2, 16, 64), np.int64))],
            r"do\.npy", r"'<i8'", *CAST_TO_FP16),
    refusal("do.npy another shape",
            lambda t: ["--backward", "--input", with_do(t / "in", do=np.ones((1, 2, 17, 64), np.float16))],
            r"do\.npy", r"17", r"q\.npy", r"shape", r"\bdo\b"),
    refusal("do.npy 3-D", lambda t: ["--backward", "--input", with_do(t / "in", do=np.ones((2, 16, 64), np.float16))],
            r"do\.npy", r"3-D", r"4-D"),
    refusal("do.npy truncated", lambda t: ["--backward", "--input", do_special(t / "in", "truncated")],
            r"do\.npy", r"truncated|bytes"),
    refusal("do.npy empty", lambda t: ["--backward", "--input", do_special(t / "in", "empty")], r"do\.npy", r"empty"),
    refusal("do.npy a directory", lambda t: ["--backward", "--input", do_special(t / "in", "dir")],
            r"do\.npy", r"is a directory"),
    refusal("do.npy a FIFO, --dry-run", lambda t: ["--dry-run", "--backward", "--input", do_special(t / "in", "fifo")],
            r"do\.npy", r"not a regular file"),
    refusal("do.npy NaN", lambda t: ["--backward", "--input", with_do(t / "in", do=do_with(np.nan))],
            r"do\.npy", r"NaN", r"\[0, 1, 5, 17\]", r"nan_to_num"),
    refusal("do.npy Inf, --dry-run",
            lambda t: ["--dry-run", "--backward", "--input", with_do(t / "in", do=do_with(np.inf))],
            r"do\.npy", r"Inf", r"\[0, 1, 5, 17\]"),
    # Q, K, V are read first, as the forward reads them; dO last.
    refusal("q.npy missing and do.npy missing",
            lambda t: ["--backward", "--input", with_do(t / "in", do="absent", q=None)],
            r"q\.npy", r"cannot open|no such", unwanted=r"do\.npy"),
    refusal("q, k, v float32 and do.npy fine",
            lambda t: ["--backward", "--input",
                       with_do(t / "in", dtype=np.float32, do=np.ones((1, 2, 16, 64), np.float16))],
            r"q\.npy", r"float32", unwanted=r"do\.npy"),
    refusal("input contradicts --seqlen", lambda t: ["--backward", "--seqlen", "32", "--input", with_do(t / "in")],
            r"--seqlen", r"\b32\b", r"\b16\b", r"contradict"),
    refusal("head dim 96", lambda t: ["--backward", "--headdim", "96"], r"\b96\b", r"\b64\b", r"\b128\b",
            unwanted=r"no backward"),
    # --output: dq.npy, dk.npy, dv.npy are checked as o.npy and lse.npy are.
    refusal("output dq.npy a directory", lambda t: ["--backward", "--output", output_with(t / "out", "dq.npy", "dir")],
            path_in_tmp("out", "dq.npy"), r"is a directory"),
    refusal("output dk.npy read-only, --dry-run",
            lambda t: ["--dry-run", "--backward", "--output", output_with(t / "out", "dk.npy", "read-only")],
            path_in_tmp("out", "dk.npy"), r"read-only"),
    refusal("output dv.npy a dangling symlink",
            lambda t: ["--backward", "--output", output_with(t / "out", "dv.npy", "dangling")],
            path_in_tmp("out", "dv.npy"), r"dangling symbolic link"),
    refusal("output dv.npy a FIFO", lambda t: ["--backward", "--output", output_with(t / "out", "dv.npy", "fifo")],
            path_in_tmp("out", "dv.npy"), r"not a regular file"),
    refusal("output dq.npy is o.npy", lambda t: ["--backward", "--output", output_with(t / "out", "dq.npy", "same")],
            r"o\.npy", r"dq\.npy", r"same file"),
    refusal("output dv.npy is dk.npy", lambda t: ["--backward", "--output", linked(t / "out", "dv.npy", "dk.npy")],
            r"dk\.npy", r"dv\.npy", r"same file"),
    # The output folder is checked before the inputs are read, as the forward's is.
    refusal("output dq.npy a directory and do.npy missing",
            lambda t: ["--backward", "--input", with_do(t / "in", do="absent"), "--output",
                       output_with(t / "out", "dq.npy", "dir")], r"dq\.npy", r"is a directory",
            unwanted=r"do\.npy.*exist"),
]


@pytest.mark.parametrize("make_args, patterns, unwanted", REFUSED)
@pytest.mark.parametrize("name", BACKWARD_BINARIES)
def test_backward_bad_input_is_refused_before_any_gpu_work(repo, tmp_path, name, make_args, patterns, unwanted):
    assert_refused(repo, binary_of(repo, name), name, make_args(tmp_path), patterns, unwanted, tmp_path)


@pytest.mark.xdist_group(STUB)
@pytest.mark.parametrize("shape", STUB_SHAPES,
                         ids=[f"B={b} H={h} N={n} D={d}{' causal' if c else ''}" for b, h, n, d, c in STUB_SHAPES])
def test_backward_plan(repo, tmp_path, shape):
    """--dry-run --backward: the plan names the backward, its FLOPs (2.5x the forward's), the tensors
    it holds, both workspaces, the total and the reference's folder; --no-check drops that folder."""
    b, h, n, d, causal = shape
    binary = stub_binary(repo)
    cache = tmp_path / "cache"
    args = [str(a) for a in ["--dry-run", "--backward", "--batch", b, "--heads", h, "--seqlen", n, "--headdim", d]]
    args += ["--causal"] if causal else []
    proc = run_binary(repo, binary, args, cache)
    shown = f"{STUB} {' '.join(args)}"
    assert proc.returncode == 0, f"{shown}: exit {proc.returncode}, expected 0: {proc.stderr.strip()}"
    plan = proc.stdout
    assert f"B={b} H={h} N={n} D={d} {'causal' if causal else 'non-causal'}" in plan, f"{shown}: no shape:\n{plan}"
    assert re.search(r"^  backward\s+dQ, dK, dV", plan, re.M), f"{shown}: the plan does not name the backward:\n{plan}"
    forward = 4 * b * h * n * n * d / (2 if causal else 1)
    work = re.search(r"work\s+(\S+) GFLOP \(2\.5x the forward's (\S+)\)", plan)
    assert work and (work.group(1), work.group(2)) == (f"{2.5 * forward / 1e9:.3g}", f"{forward / 1e9:.3g}"), (
        f"{shown}: expected {2.5 * forward / 1e9:.3g} GFLOP, 2.5x the forward's {forward / 1e9:.3g}:\n{plan}")
    tensors = 8 * b * h * n * d * 2 + b * h * n * 4  # Q K V O dO dQ dK dV (fp16) and LSE (fp32)
    ws_forward, ws_backward = stub_workspaces(b, h, n, d)
    memory = re.search(r"memory\s+tensors (.+?) \(Q, K, V, O, LSE, dO, dQ, dK, dV\), (.+?) in all", plan)
    assert memory and memory.groups() == (human_bytes(tensors), human_bytes(tensors + ws_forward + ws_backward)), (
        f"{shown}: expected tensors {human_bytes(tensors)}, "
        f"{human_bytes(tensors + ws_forward + ws_backward)} in all:\n{plan}")
    workspace = re.search(r"workspace\s+forward (.+?), backward (.+?)$", plan, re.M)
    assert workspace and workspace.groups() == (human_bytes(ws_forward), human_bytes(ws_backward)), (
        f"{shown}: expected workspaces forward {human_bytes(ws_forward)}, backward {human_bytes(ws_backward)}:\n{plan}")
    folder = f"{cache}/b{b}_h{h}_n{n}_d{d}_seed0"
    assert re.search(rf"^  reference\s+{re.escape(folder)} ", plan, re.M), f"{shown}: no 'reference {folder}':\n{plan}"
    unchecked = run_binary(repo, binary, args + ["--no-check"], cache)
    assert unchecked.returncode == 0 and "reference" not in unchecked.stdout, (
        f"{shown} --no-check: exit {unchecked.returncode}, a plan without the reference expected:\n{unchecked.stdout}")
    assert not cache.exists(), f"{shown}: a dry run prepared data in FA_CACHE"


@pytest.mark.xdist_group(STUB)
@pytest.mark.parametrize("shape", STUB_SHAPES[:2],
                         ids=[f"B={b} H={h} N={n} D={d}{' causal' if c else ''}" for b, h, n, d, c in STUB_SHAPES[:2]])
def test_deterministic_plan(repo, tmp_path, shape):
    """--dry-run --backward --deterministic: the plan says the mode (the plain --backward's does not), and the
    backward's workspace, and the total, are the chapter's for that mode (the stub's: twice the other's)."""
    b, h, n, d, causal = shape
    binary = stub_binary(repo)
    args = [str(a) for a in ["--dry-run", "--backward", "--batch", b, "--heads", h, "--seqlen", n, "--headdim", d]]
    args += ["--causal"] if causal else []
    plain = run_binary(repo, binary, args, tmp_path / "cache")
    proc = run_binary(repo, binary, args + ["--deterministic"], tmp_path / "cache")
    shown = f"{STUB} {' '.join(args)} --deterministic"
    assert plain.returncode == 0 and proc.returncode == 0, f"{shown}: exit {proc.returncode}: {proc.stderr.strip()}"
    assert not re.search(r"^  mode\b", plain.stdout, re.M), f"{STUB} --backward: a mode in the plan:\n{plain.stdout}"
    assert re.search(r"^  mode\s+deterministic: dQ, dK, dV bitwise the same on every run", proc.stdout, re.M), (
        f"{shown}: the plan does not say the mode:\n{proc.stdout}")
    ws_forward = stub_workspaces(b, h, n, d)[0]
    ws_backward = stub_deterministic_workspace(b, h, n, d)
    workspace = re.search(r"workspace\s+forward (.+?), backward (.+?)$", proc.stdout, re.M)
    assert workspace and workspace.groups() == (human_bytes(ws_forward), human_bytes(ws_backward)), (
        f"{shown}: expected workspaces forward {human_bytes(ws_forward)}, backward {human_bytes(ws_backward)} (the "
        f"deterministic mode's):\n{proc.stdout}")
    total = 8 * b * h * n * d * 2 + b * h * n * 4 + ws_forward + ws_backward
    assert re.search(rf"\), {re.escape(human_bytes(total))} in all with the workspaces", proc.stdout), (
        f"{shown}: expected {human_bytes(total)} in all:\n{proc.stdout}")


@pytest.mark.parametrize("name", BACKWARD_BINARIES)
def test_backward_plan_of_input_names_its_reference_by_every_file(repo, tmp_path, name):
    """--dry-run --backward --input: the shape from the files, and the reference's folder named by a hash
    of q, k, v and do.npy (another dO, another folder: its gradients differ)."""
    binary = binary_of(repo, name)
    folder = with_do(tmp_path / "in", shape=(2, 3, 33, 128))
    cache = tmp_path / "cache"
    proc = run_binary(repo, binary, ["--dry-run", "--backward", "--input", folder, "--causal"], cache)
    assert proc.returncode == 0, f"{name} --dry-run --backward --input: exit {proc.returncode}: {proc.stderr.strip()}"
    assert "B=2 H=3 N=33 D=128 causal" in proc.stdout, (
        f"{name} --dry-run --backward --input: shape not taken from the files (2, 3, 33, 128):\n{proc.stdout}")
    key = fnv1a([folder / f for f in ("q.npy", "k.npy", "v.npy", "do.npy")])
    want = f"{cache}/input_{key}"
    assert re.search(rf"^  reference\s+{re.escape(want)} ", proc.stdout, re.M), (
        f"{name} --dry-run --backward --input: the reference folder should be {want} (q, k, v and do.npy "
        f"hashed):\n{proc.stdout}")
    np.save(folder / "do.npy", np.ones((2, 3, 33, 128), np.float16))
    again = run_binary(repo, binary, ["--dry-run", "--backward", "--input", folder, "--causal"], cache)
    other = f"{cache}/input_{fnv1a([folder / f for f in ('q.npy', 'k.npy', 'v.npy', 'do.npy')])}"
    assert other != want and re.search(rf"^  reference\s+{re.escape(other)} ", again.stdout, re.M), (
        f"{name}: another do.npy must name another reference folder ({other}):\n{again.stdout}")


@pytest.mark.parametrize("name", BACKWARD_BINARIES)
def test_forward_is_unchanged_without_backward(repo, tmp_path, name):
    """Without --backward a binary that has one is the forward it was: do.npy is not read (absent or
    broken), dq/dk/dv.npy are not checked (they are not written), the plan is the forward's."""
    binary = binary_of(repo, name)
    broken = with_do(tmp_path / "in", do=np.ones((1, 2, 16, 64), np.float32))
    out = output_with(tmp_path / "out", "dq.npy", "dir")
    proc = run_binary(repo, binary, ["--dry-run", "--input", broken, "--output", out], tmp_path / "cache")
    assert proc.returncode == 0, (f"{name} --dry-run without --backward: exit {proc.returncode} "
                                  f"(do.npy and dq.npy are the backward's): {proc.stderr.strip()}")
    assert "backward" not in "".join(proc.stdout.splitlines(True)[1:]), (
        f"{name}: the forward's plan mentions the backward:\n{proc.stdout}")
    assert re.search(r"^  memory\s+inputs\+outputs 16\.1 KiB, workspace ", proc.stdout, re.M), proc.stdout
    proc = run_binary(repo, binary, ["--dry-run", "--input", with_do(tmp_path / "in2", do="absent")],
                      tmp_path / "cache")
    assert proc.returncode == 0, f"{name} --dry-run --input without do.npy: exit {proc.returncode}: {proc.stderr}"


@pytest.mark.parametrize("name", BACKWARD_BINARIES)
def test_backward_without_gpu_exits_77_and_writes_nothing(repo, tmp_path, name):
    """A valid --backward run without a GPU: exit 77, one line on stdout, nothing on stderr, nothing
    prepared or written (generated inputs; --input with do.npy, --output, --csv)."""
    binary = binary_of(repo, name)
    small = ["--batch", "1", "--heads", "1", "--seqlen", "16", "--headdim", "64"]
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "dq.npy").write_bytes(b"old")
    runs = {"generated": ["--backward", *small, "--warmup", "0", "--iters", "1"],
            "input output csv": ["--backward", "--input", with_do(tmp_path / "in"), "--output", tmp_path / "out",
                                 "--csv"],
            "existing output folder": ["--backward", *small, "--output", kept, "--no-check"],
            "deterministic": ["--backward", "--deterministic", *small, "--csv"]}
    for label, args in runs.items():
        args = [str(a) for a in args]
        proc = run_binary(repo, binary, args, tmp_path / "cache")
        shown = f"{name} {' '.join(args)}"
        assert proc.returncode == 77, (f"{shown}: expected exit 77 (no GPU), got {proc.returncode}; "
                                       f"stdout {proc.stdout.strip()!r} stderr {proc.stderr.strip()!r}")
        lines = proc.stdout.splitlines()
        assert len(lines) == 1 and "skip" in lines[0] and "GPU" in lines[0], f"{shown}: {proc.stdout!r}"
        assert not proc.stderr.strip(), f"{shown}: expected nothing on stderr, got {proc.stderr.strip()!r}"
    assert not (tmp_path / "out").exists(), f"{name} --backward --output: skipped, yet made the folder"
    assert sorted(p.name for p in kept.iterdir()) == ["dq.npy"] and (kept / "dq.npy").read_bytes() == b"old", (
        f"{name} --backward --output {kept}: skipped, yet changed what is there")
    assert not (tmp_path / "cache").exists(), f"{name} --backward: skipped, yet prepared data in FA_CACHE"
    refused = output_with(tmp_path / "refused", "dv.npy", "dir")
    proc = run_binary(repo, binary, ["--backward", *small, "--output", refused], tmp_path / "cache")
    left = sorted(p.name for p in refused.iterdir())
    assert proc.returncode == 2 and left == ["dv.npy"], (
        f"{name} --backward --output (dv.npy a directory): exit {proc.returncode}, left {left} (only dv.npy expected)")


@pytest.mark.parametrize("name", BACKWARD_BINARIES)
def test_help_explains_backward(repo, tmp_path, name):
    """--help says what --backward reads (do.npy), writes (dq.npy ...), costs (2.5x) and is checked against, and
    what --deterministic gives and what its --csv row is named."""
    proc = run_binary(repo, binary_of(repo, name), ["--help"], tmp_path / "cache")
    assert proc.returncode == 0, f"{name} --help: exit {proc.returncode}"
    for word in (r"--backward\b", r"do\.npy", r"dq\.npy", r"2\.5x", r"1e-3", r"dq_rel_l2", r"--deterministic\b",
                 r"bitwise the same", rf"impl: {re.escape(name)}\.deterministic"):
        assert re.search(word, proc.stdout), f"{name} --help does not say {word!r}:\n{proc.stdout}"
