"""--backward on the command line (common/harness.cu), without a GPU.

A chapter without a backward pass (01-08) refuses --backward, exit 2, in one line that names the
chapter that has one. The command line is read first (an unknown flag, a malformed value are
reported as such), then whether the chapter has a backward, then the inputs, the output folder and
the shape: none of those would make the run possible, so they are not what the message is about.

What a binary with a backward checks before any GPU work runs on tests/fixtures/backward_stub.cu, a
Chapter with a forward and a backward linked with the harness here (and on any chapter that registers
a backward): --dry-run's plan (the backward's FLOPs, buffers, workspaces, the reference's folder),
--input's do.npy (missing, another dtype or shape, NaN, not a file: refused as q.npy is),
--output's dq.npy, dk.npy, dv.npy (checked as o.npy is), the cache folder of --input data (its name
hashes do.npy too), exit 77 without a GPU, and that the forward of the same binary is unchanged.
"""
import os
import re
import unittest

import numpy as np

from claims import nvcc, strip_comments
from test_cpu_cli import AT_LEAST_1, CAST_TO_FP16, assert_refused, human_bytes, output_with, run_binary, write_qkv

PARALLEL = 2
STUB = "backward_stub"
STUB_SHAPES = [(1, 2, 16, 64, False), (2, 3, 100, 128, True), (1, 16, 65536, 128, False)]  # (B, H, N, D, causal)
NO_BACKWARD = [r"no backward", r"--backward", r"drop it"]  # what a chapter without one says
GRADS = ("dq.npy", "dk.npy", "dv.npy")


def stub_workspaces(b, h, n, d):
    """The stub's forward and backward scratch (tests/fixtures/backward_stub.cu)."""
    return b * h * n * 4, b * h * n * d * 4


def has_backward(ctx, chapter):
    """Whether a chapter registers a backward pass (a `Backward` in its code, comments left out)."""
    return re.search(r"\bBackward\b", strip_comments((ctx.root / chapter / "attention.cu").read_text())) is not None


def stub_binary(ctx):
    """tests/fixtures/backward_stub.cu linked with the CPU build's harness objects, once per run."""
    def build():
        objects = [ctx.multiarch / "common" / name for name in ("harness.o", "npy.o")]
        missing = [ctx.rel(o) for o in objects if not o.is_file()]
        if missing:
            return None, f"{', '.join(missing)} not built (the build failed or did not run)"
        out = ctx.tmpdir() / STUB
        proc = ctx.run([nvcc(), "-std=c++17", "-Xcompiler", "-Wall,-Wextra", "-gencode=arch=compute_80,code=sm_80",
                        "-o", out, ctx.root / "tests" / "fixtures" / f"{STUB}.cu", *objects], timeout=600)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"nvcc failed on tests/fixtures/{STUB}.cu:\n{log.strip()[-3000:]}"
        warnings = [line for line in log.splitlines() if "warning" in line.lower()]
        assert not warnings, f"tests/fixtures/{STUB}.cu: compiler warnings:\n" + "\n".join(warnings[:20])
        return out, None
    out, why = ctx.once("backward_stub_binary", build)
    if out is None:
        raise unittest.SkipTest(why)
    return out


def binary_of(ctx, name):
    return stub_binary(ctx) if name == STUB else ctx.require_binary(name)


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
    array = np.random.default_rng(3).standard_normal((1, 2, 16, 64)).astype(np.float16)
    array[index] = value
    return array


def fnv1a(paths):
    """The harness's cache key of --input files: FNV-1a over their bytes, one after another."""
    h = 1469598103934665603
    for path in paths:
        for byte in path.read_bytes():
            h = ((h ^ byte) * 1099511628211) & (2 ** 64 - 1)
    return f"{h:016x}"


# --- chapters without a backward: refused, and in which order --------------------------------------
# (label, args given the case's temporary folder, patterns, what the message must not say)
WITHOUT = [
    ("--backward", lambda t: ["--backward"], NO_BACKWARD, None),
    ("--backward --dry-run", lambda t: ["--dry-run", "--backward"], NO_BACKWARD, None),
    ("--backward --csv, small", lambda t: ["--backward", "--csv", "--batch", "1", "--heads", "1", "--seqlen", "16",
                                           "--headdim", "64"], NO_BACKWARD, None),
    # What the chapter cannot do comes before what is wrong with the shape, the inputs or the output:
    # fixing those would still not give it a backward.
    ("--backward, head dim 96", lambda t: ["--backward", "--headdim", "96"], NO_BACKWARD, r"\b96\b"),
    ("--backward, --input without do.npy", lambda t: ["--backward", "--input", write_qkv(t / "in")], NO_BACKWARD,
     r"do\.npy"),
    ("--backward, --input folder missing", lambda t: ["--backward", "--input", t / "nope"], NO_BACKWARD, r"nope"),
    ("--backward, --output a file", lambda t: ["--backward", "--output", write_qkv(t / "in") / "q.npy"], NO_BACKWARD,
     r"not a folder"),
    ("--backward, --output dq.npy a directory",
     lambda t: ["--dry-run", "--backward", "--output", output_with(t / "out", "dq.npy", "dir")], NO_BACKWARD,
     r"directory"),
    # The command line itself is read first, whatever else it asks for.
    ("--backward, --seqlen 0", lambda t: ["--backward", "--seqlen", "0"], [r"--seqlen", r"\b0\b", AT_LEAST_1],
     r"no backward"),
    ("--backward, unknown flag", lambda t: ["--backward", "--backwards"], [r"--backwards", r"unknown", r"--help"],
     r"no backward"),
    ("--backward with a value", lambda t: ["--backward=1"], [r"--backward", r"takes no value"], r"no backward"),
]


def without_case(chapter, label, make_args, patterns, unwanted):
    def case(ctx):
        binary = ctx.require_binary(chapter)
        tmp = ctx.tmpdir()
        assert_refused(ctx, binary, chapter, make_args(tmp), patterns, unwanted, tmp)
        if label == "--backward":  # the chapter's own name, and the message's words
            message = run_binary(ctx, binary, ["--backward"], tmp / "cache").stderr.strip()
            assert message.startswith(f"{chapter}: "), f"{chapter} --backward: {message!r} does not name the chapter"
    return case


# --- a binary with a backward: what it checks before any GPU work -----------------------------------
# (label, args given the folder, patterns, unwanted): refused, exit 2, one line.
REFUSED = [
    ("do.npy missing", lambda t: ["--backward", "--input", with_do(t / "in", do="absent")],
     [lambda t: re.escape(str(t / "in" / "do.npy")), r"does not exist", r"--backward", r"float16|fp16"], None),
    ("do.npy missing, --dry-run", lambda t: ["--dry-run", "--backward", "--input", with_do(t / "in", do="absent")],
     [r"do\.npy", r"does not exist"], None),
    ("do.npy float32", lambda t: ["--backward", "--input", with_do(t / "in", do=np.ones((1, 2, 16, 64), np.float32))],
     [r"do\.npy", r"float32", *CAST_TO_FP16], None),
    ("do.npy int64, --dry-run",
     lambda t: ["--dry-run", "--backward", "--input", with_do(t / "in", do=np.ones((1, 2, 16, 64), np.int64))],
     [r"do\.npy", r"'<i8'", *CAST_TO_FP16], None),
    ("do.npy another shape",
     lambda t: ["--backward", "--input", with_do(t / "in", do=np.ones((1, 2, 17, 64), np.float16))],
     [r"do\.npy", r"17", r"q\.npy", r"shape", r"\bdo\b"], None),
    ("do.npy 3-D", lambda t: ["--backward", "--input", with_do(t / "in", do=np.ones((2, 16, 64), np.float16))],
     [r"do\.npy", r"3-D", r"4-D"], None),
    ("do.npy truncated", lambda t: ["--backward", "--input", do_special(t / "in", "truncated")],
     [r"do\.npy", r"truncated|bytes"], None),
    ("do.npy empty", lambda t: ["--backward", "--input", do_special(t / "in", "empty")], [r"do\.npy", r"empty"], None),
    ("do.npy a directory", lambda t: ["--backward", "--input", do_special(t / "in", "dir")],
     [r"do\.npy", r"is a directory"], None),
    ("do.npy a FIFO, --dry-run", lambda t: ["--dry-run", "--backward", "--input", do_special(t / "in", "fifo")],
     [r"do\.npy", r"not a regular file"], None),
    ("do.npy NaN", lambda t: ["--backward", "--input", with_do(t / "in", do=do_with(np.nan))],
     [r"do\.npy", r"NaN", r"\[0, 1, 5, 17\]", r"nan_to_num"], None),
    ("do.npy Inf, --dry-run", lambda t: ["--dry-run", "--backward", "--input", with_do(t / "in", do=do_with(np.inf))],
     [r"do\.npy", r"Inf", r"\[0, 1, 5, 17\]"], None),
    # Q, K, V are read first, as the forward reads them; dO last.
    ("q.npy missing and do.npy missing", lambda t: ["--backward", "--input", with_do(t / "in", do="absent", q=None)],
     [r"q\.npy", r"cannot open|no such"], r"do\.npy"),
    ("q, k, v float32 and do.npy fine",
     lambda t: ["--backward", "--input", with_do(t / "in", dtype=np.float32, do=np.ones((1, 2, 16, 64), np.float16))],
     [r"q\.npy", r"float32"], r"do\.npy"),
    ("input contradicts --seqlen", lambda t: ["--backward", "--seqlen", "32", "--input", with_do(t / "in")],
     [r"--seqlen", r"\b32\b", r"\b16\b", r"contradict"], None),
    ("head dim 96", lambda t: ["--backward", "--headdim", "96"], [r"\b96\b", r"\b64\b", r"\b128\b"], r"no backward"),
    # --output: dq.npy, dk.npy, dv.npy are checked as o.npy and lse.npy are.
    ("output dq.npy a directory", lambda t: ["--backward", "--output", output_with(t / "out", "dq.npy", "dir")],
     [lambda t: re.escape(str(t / "out" / "dq.npy")), r"is a directory"], None),
    ("output dk.npy read-only, --dry-run",
     lambda t: ["--dry-run", "--backward", "--output", output_with(t / "out", "dk.npy", "read-only")],
     [lambda t: re.escape(str(t / "out" / "dk.npy")), r"read-only"], None),
    ("output dv.npy a dangling symlink", lambda t: ["--backward", "--output", output_with(t / "out", "dv.npy",
                                                                                          "dangling")],
     [lambda t: re.escape(str(t / "out" / "dv.npy")), r"dangling symbolic link"], None),
    ("output dv.npy a FIFO", lambda t: ["--backward", "--output", output_with(t / "out", "dv.npy", "fifo")],
     [lambda t: re.escape(str(t / "out" / "dv.npy")), r"not a regular file"], None),
    ("output dq.npy is o.npy", lambda t: ["--backward", "--output", output_with(t / "out", "dq.npy", "same")],
     [r"o\.npy", r"dq\.npy", r"same file"], None),
    ("output dv.npy is dk.npy", lambda t: ["--backward", "--output", linked(t / "out", "dv.npy", "dk.npy")],
     [r"dk\.npy", r"dv\.npy", r"same file"], None),
    # The output folder is checked before the inputs are read, as the forward's is.
    ("output dq.npy a directory and do.npy missing",
     lambda t: ["--backward", "--input", with_do(t / "in", do="absent"), "--output",
                output_with(t / "out", "dq.npy", "dir")], [r"dq\.npy", r"is a directory"], r"do\.npy.*exist"),
]


def linked(folder, name, to):
    """An --output folder where `name` is a symbolic link to its `to` (an existing file)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / to).write_bytes(b"old")
    (folder / name).symlink_to(folder / to)
    return folder


def refused_case(name, label, make_args, patterns, unwanted):
    def case(ctx):
        tmp = ctx.tmpdir()
        assert_refused(ctx, binary_of(ctx, name), name, make_args(tmp), patterns, unwanted, tmp)
    return case


def stub_plan_case(shape):
    """--dry-run --backward: the plan names the backward, its FLOPs (2.5x the forward's), the tensors
    it holds, both workspaces, the total and the reference's folder; --no-check drops that folder."""
    b, h, n, d, causal = shape

    def case(ctx):
        binary = stub_binary(ctx)
        cache = ctx.tmpdir() / "cache"
        args = [str(a) for a in ["--dry-run", "--backward", "--batch", b, "--heads", h, "--seqlen", n, "--headdim", d]]
        args += ["--causal"] if causal else []
        proc = run_binary(ctx, binary, args, cache)
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
        unchecked = run_binary(ctx, binary, args + ["--no-check"], cache)
        assert unchecked.returncode == 0 and "reference" not in unchecked.stdout, (
            f"{shown} --no-check: exit {unchecked.returncode}, a plan without the reference expected:\n{unchecked.stdout}")
        assert not cache.exists(), f"{shown}: a dry run prepared data in FA_CACHE"
    return case


def plan_input_case(name):
    """--dry-run --backward --input: the shape from the files, and the reference's folder named by a hash
    of q, k, v and do.npy (another dO, another folder: its gradients differ)."""
    def case(ctx):
        binary = binary_of(ctx, name)
        tmp = ctx.tmpdir()
        folder = with_do(tmp / "in", shape=(2, 3, 33, 128))
        cache = tmp / "cache"
        proc = run_binary(ctx, binary, ["--dry-run", "--backward", "--input", folder, "--causal"], cache)
        assert proc.returncode == 0, f"{name} --dry-run --backward --input: exit {proc.returncode}: {proc.stderr.strip()}"
        assert "B=2 H=3 N=33 D=128 causal" in proc.stdout, (
            f"{name} --dry-run --backward --input: shape not taken from the files (2, 3, 33, 128):\n{proc.stdout}")
        key = fnv1a([folder / f for f in ("q.npy", "k.npy", "v.npy", "do.npy")])
        want = f"{cache}/input_{key}"
        assert re.search(rf"^  reference\s+{re.escape(want)} ", proc.stdout, re.M), (
            f"{name} --dry-run --backward --input: the reference folder should be {want} (q, k, v and do.npy "
            f"hashed):\n{proc.stdout}")
        np.save(folder / "do.npy", np.ones((2, 3, 33, 128), np.float16))
        again = run_binary(ctx, binary, ["--dry-run", "--backward", "--input", folder, "--causal"], cache)
        other = f"{cache}/input_{fnv1a([folder / f for f in ('q.npy', 'k.npy', 'v.npy', 'do.npy')])}"
        assert other != want and re.search(rf"^  reference\s+{re.escape(other)} ", again.stdout, re.M), (
            f"{name}: another do.npy must name another reference folder ({other}):\n{again.stdout}")
    return case


def forward_unchanged_case(name):
    """Without --backward a binary that has one is the forward it was: do.npy is not read (absent or
    broken), dq/dk/dv.npy are not checked (they are not written), the plan is the forward's."""
    def case(ctx):
        binary = binary_of(ctx, name)
        tmp = ctx.tmpdir()
        broken = with_do(tmp / "in", do=np.ones((1, 2, 16, 64), np.float32))
        out = output_with(tmp / "out", "dq.npy", "dir")
        proc = run_binary(ctx, binary, ["--dry-run", "--input", broken, "--output", out], tmp / "cache")
        assert proc.returncode == 0, (f"{name} --dry-run without --backward: exit {proc.returncode} "
                                      f"(do.npy and dq.npy are the backward's): {proc.stderr.strip()}")
        assert "backward" not in "".join(proc.stdout.splitlines(True)[1:]), (
            f"{name}: the forward's plan mentions the backward:\n{proc.stdout}")
        assert re.search(r"^  memory\s+inputs\+outputs 16\.1 KiB, workspace ", proc.stdout, re.M), proc.stdout
        proc = run_binary(ctx, binary, ["--dry-run", "--input", with_do(tmp / "in2", do="absent")], tmp / "cache")
        assert proc.returncode == 0, f"{name} --dry-run --input without do.npy: exit {proc.returncode}: {proc.stderr}"
    return case


def no_gpu_case(name):
    """A valid --backward run without a GPU: exit 77, one line on stdout, nothing on stderr, nothing
    prepared or written (generated inputs; --input with do.npy, --output, --csv)."""
    def case(ctx):
        binary = binary_of(ctx, name)
        tmp = ctx.tmpdir()
        small = ["--batch", "1", "--heads", "1", "--seqlen", "16", "--headdim", "64"]
        kept = tmp / "kept"
        kept.mkdir()
        (kept / "dq.npy").write_bytes(b"old")
        runs = {"generated": ["--backward", *small, "--warmup", "0", "--iters", "1"],
                "input output csv": ["--backward", "--input", with_do(tmp / "in"), "--output", tmp / "out", "--csv"],
                "existing output folder": ["--backward", *small, "--output", kept, "--no-check"]}
        for label, args in runs.items():
            args = [str(a) for a in args]
            proc = run_binary(ctx, binary, args, tmp / "cache")
            shown = f"{name} {' '.join(args)}"
            assert proc.returncode == 77, (f"{shown}: expected exit 77 (no GPU), got {proc.returncode}; "
                                           f"stdout {proc.stdout.strip()!r} stderr {proc.stderr.strip()!r}")
            lines = proc.stdout.splitlines()
            assert len(lines) == 1 and "skip" in lines[0] and "GPU" in lines[0], f"{shown}: {proc.stdout!r}"
            assert not proc.stderr.strip(), f"{shown}: expected nothing on stderr, got {proc.stderr.strip()!r}"
        assert not (tmp / "out").exists(), f"{name} --backward --output: skipped, yet made the folder"
        assert sorted(p.name for p in kept.iterdir()) == ["dq.npy"] and (kept / "dq.npy").read_bytes() == b"old", (
            f"{name} --backward --output {kept}: skipped, yet changed what is there")
        assert not (tmp / "cache").exists(), f"{name} --backward: skipped, yet prepared data in FA_CACHE"
        refused = output_with(tmp / "refused", "dv.npy", "dir")
        proc = run_binary(ctx, binary, ["--backward", *small, "--output", refused], tmp / "cache")
        left = sorted(p.name for p in refused.iterdir())
        assert proc.returncode == 2 and left == ["dv.npy"], (
            f"{name} --backward --output (dv.npy a directory): exit {proc.returncode}, left {left} (only dv.npy expected)")
    return case


def help_case(name):
    def case(ctx):
        proc = run_binary(ctx, binary_of(ctx, name), ["--help"], ctx.tmpdir())
        assert proc.returncode == 0, f"{name} --help: exit {proc.returncode}"
        for word in (r"--backward\b", r"do\.npy", r"dq\.npy", r"2\.5x", r"1e-3", r"dq_rel_l2"):
            assert re.search(word, proc.stdout), f"{name} --help does not say {word!r}:\n{proc.stdout}"
    return case


def cases(ctx):
    out = []
    with_backward = [STUB]
    for chapter in ctx.chapters:
        if has_backward(ctx, chapter):
            with_backward.append(chapter)
            continue
        for label, make_args, patterns, unwanted in WITHOUT:
            out.append((f"no_backward[{chapter}: {label}]", without_case(chapter, label, make_args, patterns, unwanted)))
    for name in with_backward:
        for label, make_args, patterns, unwanted in REFUSED:
            out.append((f"backward_refused[{name}: {label}]", refused_case(name, label, make_args, patterns, unwanted)))
        out.append((f"backward_plan_input[{name}]", plan_input_case(name)))
        out.append((f"backward_forward_unchanged[{name}]", forward_unchanged_case(name)))
        out.append((f"backward_no_gpu[{name}]", no_gpu_case(name)))
        out.append((f"backward_help[{name}]", help_case(name)))
    for shape in STUB_SHAPES:
        b, h, n, d, causal = shape
        out.append((f"backward_plan[{STUB} B={b} H={h} N={n} D={d}{' causal' if causal else ''}]",
                    stub_plan_case(shape)))
    return out
