"""Every chapter binary's command line (docs/design.md), without a GPU.

Bad usage and bad input must give exit 2 and a message on stderr that names the problem and
what to change, before any GPU work: the cases run with CUDA_VISIBLE_DEVICES= (no GPU
visible), so a binary that looked for a GPU first would answer 77 and fail here, on any
machine. --help lists every option; --dry-run prints the plan, and its workspace line shows
the chapter's scratch memory: B*H*N*N floats for 01-03, nothing at all from 04 on.
"""
import os
import re
import unittest

import numpy as np

from reference import FP8_KV_ROWS, FP8_Q_ROWS

PARALLEL = 2

# Device scratch each chapter promises (docs/design.md and each chapter README): by chapter number, in bytes.
WORKSPACE = {
    1: lambda b, h, n, d: b * h * n * n * 4,  # S (then P) in device memory: B*H*N*N fp32
    2: lambda b, h, n, d: b * h * n * n * 4,
    3: lambda b, h, n, d: b * h * n * n * 4,
    4: lambda b, h, n, d: 0,                  # fused: nothing that grows with N^2, nothing at all
    5: lambda b, h, n, d: 0,
    6: lambda b, h, n, d: 0,
    7: lambda b, h, n, d: 0,
    # 08: the e4m3 copies the attention kernel reads: descales, Q's [B*H][N / 128 scale tiles] and
    # K's and V's [2][B*H][N / key tile] (reference.py's FP8 tiles, which a CPU test ties to 08's;
    # padded to 256 bytes), Q and K [B*H][N][D], V transposed [B*H][D][N rounded up to 16]: O(N*D),
    # nothing grows with N^2.
    8: lambda b, h, n, d: (-(-b * h * (-(-n // FP8_Q_ROWS) + 2 * -(-n // FP8_KV_ROWS[d])) * 4 // 256) * 256
                           + 2 * b * h * n * d + b * h * d * (-(-n // 16) * 16)),
}
DRY_RUN_SHAPES = {  # (B, H, N, D)
    "n2": [(1, 2, 8, 64), (1, 1, 16, 128), (2, 3, 100, 64), (3, 5, 1000, 64), (1, 16, 65536, 128)],
    "fused": [(1, 16, 65536, 128), (1, 16, 65536, 64), (2, 3, 100, 64)],
}
OPTIONS = ["--batch", "--heads", "--seqlen", "--headdim", "--causal", "--seed", "--warmup", "--iters",
           "--no-check", "--input", "--output", "--csv", "--dry-run", "--help"]
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
AT_LEAST_1 = r"(between 1 |>= ?1\b|at least 1\b|positive)"


def write_qkv(folder, shape=(1, 2, 16, 64), dtype=np.float16, **override):
    """q.npy, k.npy, v.npy in folder; override={'k': array or None (absent)}."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for name in "qkv":
        array = override.get(name, rng.standard_normal(shape).astype(dtype))
        if array is not None:
            np.save(folder / f"{name}.npy", array)
    return folder


def special_q(folder, kind):
    """A folder whose q.npy is a FIFO, a directory or an empty file (k, v are fine)."""
    write_qkv(folder, q=None)
    path = folder / "q.npy"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        path.write_bytes(b"")
    return folder


def with_special_value(folder, name, index, value):
    """q, k, v with one element of `name` set to value (NaN or Inf) at index."""
    write_qkv(folder)
    array = np.load(folder / f"{name}.npy")
    array[index] = value
    np.save(folder / f"{name}.npy", array)
    return folder


def truncated_v(folder):
    write_qkv(folder)
    data = (folder / "v.npy").read_bytes()
    (folder / "v.npy").write_bytes(data[:-10])
    return folder


# (label, args given the case's temporary folder, regexes the stderr must all match)
BAD = [
    ("headdim 96", lambda t: ["--headdim", "96"], [r"\b96\b", r"\b64\b", r"\b128\b"]),
    ("seqlen 0", lambda t: ["--seqlen", "0"], [r"--seqlen", r"\b0\b", AT_LEAST_1]),
    ("batch -1", lambda t: ["--batch", "-1"], [r"--batch", r"-1\b", AT_LEAST_1]),
    ("heads x", lambda t: ["--heads", "x"], [r"--heads", r"'x'", r"(whole number|integer)"]),
    ("iters 0", lambda t: ["--iters", "0"], [r"--iters", r"\b0\b", AT_LEAST_1]),
    ("scale -1", lambda t: ["--scale", "-1"], [r"--scale", r"positive"]),
    ("unknown flag", lambda t: ["--frobnicate"], [r"--frobnicate", r"(unknown|unrecognized)", r"--help"]),
    ("stray argument", lambda t: ["64"], [r"'64'", r"(unexpected|unknown)", r"--help"]),
    ("value missing", lambda t: ["--causal", "--seqlen"], [r"--seqlen", r"value"]),
    ("input folder missing", lambda t: ["--input", t / "nope"],
     [lambda t: re.escape(str(t / "nope")), r"(cannot open|no such|not found|missing|does not exist)"]),
    ("input k.npy missing", lambda t: ["--input", write_qkv(t / "in", k=None)],
     [r"k\.npy", r"(cannot open|no such|not found|missing)"]),
    ("input float32", lambda t: ["--input", write_qkv(t / "in", dtype=np.float32)],
     [r"q\.npy", r"float32", r"float16"]),
    ("input 3-D", lambda t: ["--input", write_qkv(t / "in", shape=(2, 16, 64))],
     [r"q\.npy", r"(3-D|3 dim|three)", r"(4-D|\[B, ?H, ?N, ?D\])"]),
    ("input k of another shape",
     lambda t: ["--input", write_qkv(t / "in", k=np.zeros((1, 2, 17, 64), np.float16))],
     [r"k\.npy", r"shape", r"q\.npy", r"17"]),
    ("input v truncated", lambda t: ["--input", truncated_v(t / "in")], [r"v\.npy", r"truncated"]),
    ("input D=96", lambda t: ["--input", write_qkv(t / "in", shape=(1, 1, 8, 96))],
     [r"\b96\b", r"\b64\b", r"\b128\b"]),
    ("input contradicts --seqlen", lambda t: ["--seqlen", "32", "--input", write_qkv(t / "in")],
     [r"--seqlen", r"\b32\b", r"\b16\b", r"(contradict|does not match|differs|disagree)"]),
    # Files that are not .npy files at all: refused for what they are, without opening a FIFO
    # (which would wait for a writer forever), --dry-run included.
    ("input q.npy is a FIFO", lambda t: ["--input", special_q(t / "in", "fifo")], [r"q\.npy", r"not a regular file"]),
    ("input q.npy is a FIFO, --dry-run", lambda t: ["--dry-run", "--input", special_q(t / "in", "fifo")],
     [r"q\.npy", r"not a regular file"]),
    ("input q.npy is a directory", lambda t: ["--input", special_q(t / "in", "dir")], [r"q\.npy", r"is a directory"]),
    ("input q.npy is empty", lambda t: ["--input", special_q(t / "in", "empty")], [r"q\.npy", r"empty"]),
    # Values no attention is defined on.
    ("input NaN in k.npy", lambda t: ["--input", with_special_value(t / "in", "k", (0, 1, 5, 17), np.nan)],
     [r"k\.npy", r"NaN", r"\[0, 1, 5, 17\]", r"nan_to_num"]),
    ("input Inf in v.npy, --dry-run",
     lambda t: ["--dry-run", "--input", with_special_value(t / "in", "v", (0, 0, 3, 2), np.inf)],
     [r"v\.npy", r"Inf", r"\[0, 0, 3, 2\]"]),
    # --output is checked first, before inputs are made or a GPU is looked for.
    ("output is a file", lambda t: ["--output", write_qkv(t / "in") / "q.npy"], [r"--output", r"not a folder"]),
    ("output is a file, --dry-run", lambda t: ["--dry-run", "--output", write_qkv(t / "in") / "q.npy"],
     [r"--output", r"not a folder"]),
    ("output parent missing", lambda t: ["--output", t / "no" / "such" / "out"],
     [r"--output", r"cannot be created", r"no.such"]),
    # One rule for numbers, and values that are empty or meaningless.
    ("input empty", lambda t: ["--input="], [r"--input", r"empty"]),
    ("output empty", lambda t: ["--output="], [r"--output", r"empty"]),
    ("headdim leading space", lambda t: ["--headdim", " 64"], [r"--headdim", r"whole number"]),
    ("headdim trailing space", lambda t: ["--headdim", "64 "], [r"--headdim", r"whole number"]),
    ("headdim plus sign", lambda t: ["--headdim", "+64"], [r"--headdim", r"whole number"]),
    ("scale subnormal", lambda t: ["--scale", "1e-40"], [r"--scale", r"1e-40", r"positive"]),
]


def human_bytes(n):
    """The harness's size format: '512 B', '234.4 KiB', '256.0 GiB'."""
    units, u, value = ["B", "KiB", "MiB", "GiB", "TiB"], 0, float(n)
    while value >= 1024 and u < 4:
        value /= 1024
        u += 1
    return f"{value:.1f} {units[u]}" if u else f"{value:.0f} {units[u]}"


def run_binary(ctx, binary, args, cache):
    return ctx.run([binary, *args], env={**NO_GPU, "FA_CACHE": cache}, timeout=60)


def bad_input_case(chapter, label, make_args, patterns):
    def case(ctx):
        binary = ctx.require_binary(chapter)
        tmp = ctx.tmpdir()
        cache = tmp / "cache"
        args = [str(a) for a in make_args(tmp)]
        proc = run_binary(ctx, binary, args, cache)
        shown = f"{chapter} {' '.join(args)}"
        assert proc.returncode == 2, (
            f"{shown}: expected exit 2 (bad usage/input, refused before any GPU work), got "
            f"{proc.returncode}; stdout {proc.stdout.strip()!r} stderr {proc.stderr.strip()!r}")
        message = proc.stderr.strip()
        assert message, f"{shown}: exit 2 but no message on stderr"
        missing = []
        for pattern in patterns:
            pattern = pattern(tmp) if callable(pattern) else pattern
            if not re.search(pattern, message, re.IGNORECASE):
                missing.append(pattern)
        assert not missing, f"{shown}: the message {message!r} does not match {missing}"
        assert not proc.stdout.strip(), f"{shown}: refusal printed on stdout: {proc.stdout.strip()!r}"
        assert not cache.exists() or not any(cache.iterdir()), (
            f"{shown}: refused, but only after preparing data in FA_CACHE: {sorted(p.name for p in cache.iterdir())}")
    return case


def help_case(chapter):
    def case(ctx):
        binary = ctx.require_binary(chapter)
        proc = run_binary(ctx, binary, ["--help"], ctx.tmpdir())
        assert proc.returncode == 0, f"{chapter} --help: exit {proc.returncode}, expected 0: {proc.stderr.strip()}"
        missing = [o for o in OPTIONS if not re.search(re.escape(o) + r"\b", proc.stdout)]
        assert not missing, f"{chapter} --help does not list {missing}"
        for code in ("77", "2"):
            assert re.search(rf"\b{code}\b", proc.stdout), f"{chapter} --help does not explain exit code {code}"
    return case


def dry_run_case(chapter, number, shape, causal):
    b, h, n, d = shape

    def case(ctx):
        binary = ctx.require_binary(chapter)
        if number not in WORKSPACE:
            raise unittest.SkipTest(f"{chapter}: no workspace claim for chapter {number:02d} in test_cpu_cli.WORKSPACE")
        args = ["--dry-run", "--batch", b, "--heads", h, "--seqlen", n, "--headdim", d] + (["--causal"] if causal else [])
        args = [str(a) for a in args]
        proc = run_binary(ctx, binary, args, ctx.tmpdir())
        shown = f"{chapter} {' '.join(args)}"
        assert proc.returncode == 0, f"{shown}: exit {proc.returncode}, expected 0: {proc.stderr.strip()}"
        assert f"B={b} H={h} N={n} D={d}" in proc.stdout, f"{shown}: the plan does not echo the shape:\n{proc.stdout}"
        assert ("non-causal" not in proc.stdout) == causal, f"{shown}: causal={causal} not shown in the plan"
        found = re.search(r"workspace\s+([0-9.]+ [KMGT]?i?B)\b", proc.stdout)
        assert found, f"{shown}: no 'workspace <size>' in the plan:\n{proc.stdout}"
        want_bytes = WORKSPACE[number](b, h, n, d)
        want = human_bytes(want_bytes)
        assert found.group(1) == want, (
            f"{shown}: workspace {found.group(1)}, expected {want} ({want_bytes} bytes"
            f"{' = B*H*N*N*4' if number <= 3 else ': nothing grows with N^2 from 04 on'})")
    return case


def dry_run_input_case(chapter):
    def case(ctx):
        binary = ctx.require_binary(chapter)
        folder = write_qkv(ctx.tmpdir() / "in", shape=(2, 3, 33, 128))
        proc = run_binary(ctx, binary, ["--dry-run", "--input", folder, "--causal"], ctx.tmpdir())
        assert proc.returncode == 0, f"{chapter} --dry-run --input: exit {proc.returncode}: {proc.stderr.strip()}"
        assert "B=2 H=3 N=33 D=128 causal" in proc.stdout, (
            f"{chapter} --dry-run --input: shape not taken from the files (2, 3, 33, 128):\n{proc.stdout}")
    return case


def cases(ctx):
    out = []
    for chapter in ctx.chapters:
        number = ctx.chapter_number(chapter)
        for label, make_args, patterns in BAD:
            out.append((f"bad_input[{chapter}: {label}]", bad_input_case(chapter, label, make_args, patterns)))
        out.append((f"help[{chapter}]", help_case(chapter)))
        kind = "fused" if number >= 4 else "n2"
        for shape in DRY_RUN_SHAPES[kind]:
            for causal in (False, True):
                name = f"dry_run_workspace[{chapter} B={shape[0]} H={shape[1]} N={shape[2]} D={shape[3]}" \
                       f"{' causal' if causal else ''}]"
                out.append((name, dry_run_case(chapter, number, shape, causal)))
        out.append((f"dry_run_input[{chapter}]", dry_run_input_case(chapter)))
    return out
