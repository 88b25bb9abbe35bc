"""Every chapter binary's command line (docs/design.md), without a GPU.

Bad usage and bad input must give exit 2 and a message on stderr that names the problem and
what to change, before any GPU work: the binaries run with CUDA_VISIBLE_DEVICES= (no GPU
visible), so a binary that looked for a GPU first would answer 77 and fail here, on any
machine. Every refusal in BAD is checked on every chapter. --scale takes one form of number;
--output leaves nothing behind when nothing is written; --help lists every option; --dry-run
prints the plan, and its workspace line shows the chapter's scratch memory (helpers.WORKSPACE):
B*H*N*N floats for 01-03, nothing that grows with N^2 from 04 on.

test_backward_cli.py imports the helpers here that make inputs and check a refusal.
"""
import os
import re

import numpy as np
import pytest

import runner
from chapters import read_steps
from helpers import CHAPTERS, DECODE_CHAPTERS, WORKSPACE

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
AT_LEAST_1 = r"(between 1 |>= ?1\b|at least 1\b|positive)"
OPTIONS = ["--batch", "--heads", "--seqlen", "--headdim", "--causal", "--seed", "--warmup", "--iters",
           "--no-check", "--input", "--output", "--backward", "--csv", "--dry-run", "--decode", "--kv-heads", "--new",
           "--cache-len", "--page-size", "--kv-cache", "--flush-l2", "--help"]


# --- inputs and output folders, made in a test's temporary folder -----------------------------------
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


def truncated(folder, name):
    """folder (as a str) with its <name>.npy missing its last 3 bytes."""
    path = os.path.join(folder, f"{name}.npy")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-3])
    return str(folder)


def truncated_v(folder):
    """q, k, v with v.npy's last 10 bytes cut off."""
    write_qkv(folder)
    data = (folder / "v.npy").read_bytes()
    (folder / "v.npy").write_bytes(data[:-10])
    return folder


def output_with(folder, name, kind):
    """An --output folder whose `name` (o.npy or lse.npy) is a directory, a dangling symbolic link (to
    a file in a missing folder, or to a missing file in this one), a read-only file, a FIFO, or a
    link to the folder's other output (kind "same": lse.npy -> o.npy)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if kind == "dir":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(folder / "gone" / name)
    elif kind == "dangling here":
        path.symlink_to(folder / "elsewhere.npy")
    elif kind == "read-only":
        path.write_bytes(b"keep me")
        path.chmod(0o444)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "same":
        (folder / "o.npy").write_bytes(b"old")
        path.symlink_to(folder / "o.npy")
    return folder


def read_only_folder(folder):
    folder.mkdir(parents=True)
    folder.chmod(0o555)
    return folder


def npy_with_header(folder, dict_text, tail=b"\n"):
    """q.npy whose header is dict_text padded with spaces and ended by `tail` (k, v are fine)."""
    write_qkv(folder)
    data = np.zeros((1, 2, 16, 64), np.float16).tobytes()
    body = dict_text.encode()
    length = -(-(10 + len(body) + len(tail)) // 64) * 64 - 10
    header = body.ljust(length - len(tail)) + tail
    (folder / "q.npy").write_bytes(b"\x93NUMPY\x01\x00" + length.to_bytes(2, "little") + header + data)
    return folder


# --- running a binary, and what a refusal must look like ----------------------------------------------
def run_binary(repo, binary, args, cache):
    """The binary with no GPU visible and FA_CACHE=cache."""
    return repo.run([binary, *args], env={**NO_GPU, "FA_CACHE": cache}, timeout=60)


def assert_refused(repo, binary, name, args, patterns, unwanted, tmp):
    """Exit 2 before any GPU work, one line on stderr matching every pattern (a regex, or a
    function of tmp giving one) and not `unwanted`, nothing on stdout, nothing prepared in
    FA_CACHE."""
    cache = tmp / "cache"
    args = [str(a) for a in args]
    proc = run_binary(repo, binary, args, cache)
    shown = f"{name} {' '.join(map(repr, args))}"
    message = proc.stderr.strip()
    assert proc.returncode == 2, (
        f"{shown}: expected exit 2 (bad usage/input, refused before any GPU work), got "
        f"{proc.returncode}; stdout {proc.stdout.strip()!r} stderr {message!r}")
    assert message, f"{shown}: exit 2 but no message on stderr"
    missing = [p for p in (p(tmp) if callable(p) else p for p in patterns)
               if not re.search(p, message, re.IGNORECASE)]
    assert not missing, f"{shown}: the message {message!r} does not match {missing}"
    assert len(message.splitlines()) == 1, f"{shown}: expected a one-line message, got {message!r}"
    assert not unwanted or not re.search(unwanted, message, re.IGNORECASE), (
        f"{shown}: the message {message!r} should not match {unwanted!r}")
    assert not proc.stdout.strip(), f"{shown}: refusal printed on stdout: {proc.stdout.strip()!r}"
    assert not cache.exists() or not any(cache.iterdir()), (
        f"{shown}: refused, but only after preparing data in FA_CACHE: {sorted(p.name for p in cache.iterdir())}")


def path_in_tmp(*parts):
    """A pattern of the path tmp/parts... (the test's temporary folder), exactly."""
    return lambda t: re.escape(str(t.joinpath(*parts)))


def tmp_then(regex):
    """A pattern: the test's temporary folder, then regex (what the message shows escaped)."""
    return lambda t: re.escape(str(t)) + regex


def refusal(label, make_args, *patterns, unwanted=None):
    """One refusal case: make_args(tmp) is the command line, given the test's temporary folder; the
    one-line message must match every pattern and must not match `unwanted`."""
    return pytest.param(make_args, patterns, unwanted, id=label)


Q_DICT = "{'descr': '<f2', 'fortran_order': False, 'shape': (1, 2, 16, 64), }"
# What --input takes, said exactly, and how to get there from any other dtype.
CAST_TO_FP16 = [r"'<f2'", r"float16", r"np\.save\(", r"np\.load\(", r"\.astype\(np\.float16\)"]
# The one rule of --scale: decimal, optional fraction and exponent; no space, '+', hex, inf or nan.
SCALE_FORM = [r"--scale", r"decimal"]

BAD = [
    refusal("headdim 96", lambda t: ["--headdim", "96"], r"\b96\b", r"\b64\b", r"\b128\b"),
    refusal("seqlen 0", lambda t: ["--seqlen", "0"], r"--seqlen", r"\b0\b", AT_LEAST_1),
    refusal("batch -1", lambda t: ["--batch", "-1"], r"--batch", r"-1\b", AT_LEAST_1),
    refusal("heads x", lambda t: ["--heads", "x"], r"--heads", r"'x'", r"(whole number|integer)"),
    refusal("iters 0", lambda t: ["--iters", "0"], r"--iters", r"\b0\b", AT_LEAST_1),
    refusal("scale -1", lambda t: ["--scale", "-1"], r"--scale", r"positive"),
    refusal("unknown flag", lambda t: ["--frobnicate"], r"--frobnicate", r"(unknown|unrecognized)", r"--help"),
    refusal("stray argument", lambda t: ["64"], r"'64'", r"(unexpected|unknown)", r"--help"),
    refusal("value missing", lambda t: ["--causal", "--seqlen"], r"--seqlen", r"value"),
    refusal("input folder missing", lambda t: ["--input", t / "nope"],
            path_in_tmp("nope"), r"(cannot open|no such|not found|missing|does not exist)"),
    refusal("input k.npy missing", lambda t: ["--input", write_qkv(t / "in", k=None)],
            r"k\.npy", r"(cannot open|no such|not found|missing)"),
    refusal("input float32", lambda t: ["--input", write_qkv(t / "in", dtype=np.float32)],
            r"q\.npy", r"float32", *CAST_TO_FP16),
    # A dtype the .npy reader has no name for is refused as --input's, not as the reader's: the
    # message names what --input takes, not types that --input would refuse next.
    refusal("input int16", lambda t: ["--input", write_qkv(t / "in", dtype=np.int16)],
            r"q\.npy", r"'<i2'", *CAST_TO_FP16, unwanted=r"float32|float64|int64|int32"),
    # One it has a name for (int32, which decoding's block table may be) is not fp16 either.
    refusal("input int32", lambda t: ["--input", write_qkv(t / "in", dtype=np.int32)],
            r"q\.npy", r"'<i4'", *CAST_TO_FP16),
    refusal("input big-endian fp16", lambda t: ["--input", write_qkv(t / "in", dtype=">f2")],
            r"q\.npy", r"'>f2'", r"little-endian", *CAST_TO_FP16),
    refusal("input float64, --dry-run", lambda t: ["--dry-run", "--input", write_qkv(t / "in", dtype=np.float64)],
            r"q\.npy", r"float64", *CAST_TO_FP16),
    # A header is a dict literal, then only spaces and a newline (NumPy refuses anything else there).
    refusal("input q.npy header has text after its dict",
            lambda t: ["--input", npy_with_header(t / "in", Q_DICT + " x")], r"q\.npy", r"after", r"header"),
    refusal("input q.npy header has a NUL after its dict",
            lambda t: ["--input", npy_with_header(t / "in", Q_DICT + "\0")], r"q\.npy", r"after", r"\\x00"),
    refusal("input 3-D", lambda t: ["--input", write_qkv(t / "in", shape=(2, 16, 64))],
            r"q\.npy", r"(3-D|3 dim|three)", r"(4-D|\[B, ?H, ?N, ?D\])"),
    refusal("input k of another shape",
            lambda t: ["--input", write_qkv(t / "in", k=np.zeros((1, 2, 17, 64), np.float16))],
            r"k\.npy", r"shape", r"q\.npy", r"17"),
    refusal("input v truncated", lambda t: ["--input", truncated_v(t / "in")], r"v\.npy", r"truncated"),
    refusal("input D=96", lambda t: ["--input", write_qkv(t / "in", shape=(1, 1, 8, 96))],
            r"\b96\b", r"\b64\b", r"\b128\b"),
    refusal("input contradicts --seqlen", lambda t: ["--seqlen", "32", "--input", write_qkv(t / "in")],
            r"--seqlen", r"\b32\b", r"\b16\b", r"(contradict|does not match|differs|disagree)"),
    # Files that are not .npy files at all: refused for what they are, without opening a FIFO
    # (which would wait for a writer forever), --dry-run included.
    refusal("input q.npy is a FIFO", lambda t: ["--input", special_q(t / "in", "fifo")],
            r"q\.npy", r"not a regular file"),
    refusal("input q.npy is a FIFO, --dry-run", lambda t: ["--dry-run", "--input", special_q(t / "in", "fifo")],
            r"q\.npy", r"not a regular file"),
    refusal("input q.npy is a directory", lambda t: ["--input", special_q(t / "in", "dir")],
            r"q\.npy", r"is a directory"),
    refusal("input q.npy is empty", lambda t: ["--input", special_q(t / "in", "empty")], r"q\.npy", r"empty"),
    # Values no attention is defined on.
    refusal("input NaN in k.npy", lambda t: ["--input", with_special_value(t / "in", "k", (0, 1, 5, 17), np.nan)],
            r"k\.npy", r"NaN", r"\[0, 1, 5, 17\]", r"nan_to_num"),
    refusal("input Inf in v.npy, --dry-run",
            lambda t: ["--dry-run", "--input", with_special_value(t / "in", "v", (0, 0, 3, 2), np.inf)],
            r"v\.npy", r"Inf", r"\[0, 0, 3, 2\]"),
    # --output is checked first, before inputs are made or a GPU is looked for.
    refusal("output is a file", lambda t: ["--output", write_qkv(t / "in") / "q.npy"], r"--output", r"not a folder"),
    refusal("output is a file, --dry-run", lambda t: ["--dry-run", "--output", write_qkv(t / "in") / "q.npy"],
            r"--output", r"not a folder"),
    refusal("output parent missing", lambda t: ["--output", t / "no" / "such" / "out"],
            r"--output", r"cannot be created", r"no.such"),
    # What --output will really write, o.npy and lse.npy, must be writable: each is checked, and the
    # message names the file and what is wrong with it.
    refusal("output o.npy is a directory", lambda t: ["--output", output_with(t / "out", "o.npy", "dir")],
            path_in_tmp("out", "o.npy"), r"is a directory"),
    refusal("output lse.npy is a directory, --dry-run",
            lambda t: ["--dry-run", "--output", output_with(t / "out", "lse.npy", "dir")],
            path_in_tmp("out", "lse.npy"), r"is a directory"),
    refusal("output o.npy is a dangling symlink", lambda t: ["--output", output_with(t / "out", "o.npy", "dangling")],
            path_in_tmp("out", "o.npy"), r"dangling symbolic link"),
    refusal("output o.npy is a dangling symlink into its folder",
            lambda t: ["--output", output_with(t / "out", "o.npy", "dangling here")],
            path_in_tmp("out", "o.npy"), r"dangling symbolic link"),
    refusal("output o.npy is read-only", lambda t: ["--output", output_with(t / "out", "o.npy", "read-only")],
            path_in_tmp("out", "o.npy"), r"read-only"),
    refusal("output lse.npy is read-only, --dry-run",
            lambda t: ["--dry-run", "--output", output_with(t / "out", "lse.npy", "read-only")],
            path_in_tmp("out", "lse.npy"), r"read-only"),
    refusal("output o.npy is a FIFO", lambda t: ["--output", output_with(t / "out", "o.npy", "fifo")],
            path_in_tmp("out", "o.npy"), r"not a regular file"),
    refusal("output lse.npy is o.npy", lambda t: ["--output", output_with(t / "out", "lse.npy", "same")],
            r"lse\.npy", r"o\.npy", r"same file"),
    refusal("output folder is read-only", lambda t: ["--output", read_only_folder(t / "out")],
            path_in_tmp("out"), r"read-only"),
    refusal("output folder cannot be made (under /proc)", lambda t: ["--output", "/proc/fa-harness-no-such-output"],
            r"/proc/fa-harness-no-such-output", r"cannot be created"),
    # A folder whose mode allows it, where the file system still refuses (only making it tells).
    refusal("output folder cannot be made (under /sys/kernel)",
            lambda t: ["--output", "/sys/kernel/fa-harness-no-such-output"],
            r"/sys/kernel/fa-harness-no-such-output", r"cannot be created"),
    # One rule for numbers, and values that are empty or meaningless.
    refusal("input empty", lambda t: ["--input="], r"--input", r"empty"),
    refusal("output empty", lambda t: ["--output="], r"--output", r"empty"),
    refusal("headdim leading space", lambda t: ["--headdim", " 64"], r"--headdim", r"whole number"),
    refusal("headdim trailing space", lambda t: ["--headdim", "64 "], r"--headdim", r"whole number"),
    refusal("headdim plus sign", lambda t: ["--headdim", "+64"], r"--headdim", r"whole number"),
    refusal("scale subnormal", lambda t: ["--scale", "1e-40"], r"--scale", r"1e-40", r"positive"),
    refusal("scale leading space", lambda t: ["--scale", " 0.125"], *SCALE_FORM, r"' 0\.125'"),
    refusal("scale trailing space", lambda t: ["--scale", "0.125 "], *SCALE_FORM, r"'0\.125 '"),
    refusal("scale plus sign", lambda t: ["--scale", "+0.125"], *SCALE_FORM, r"'\+0\.125'"),
    refusal("scale hex", lambda t: ["--scale", "0x1p-3"], *SCALE_FORM, r"'0x1p-3'"),
    refusal("scale inf", lambda t: ["--scale", "inf"], *SCALE_FORM, r"'inf'"),
    refusal("scale nan", lambda t: ["--scale=nan"], *SCALE_FORM, r"'nan'"),
    refusal("scale a dot alone", lambda t: ["--scale", "."], *SCALE_FORM, r"'\.'"),
    refusal("scale exponent without digits", lambda t: ["--scale", "1e"], *SCALE_FORM, r"'1e'"),
    refusal("scale -0.125", lambda t: ["--scale", "-0.125"], r"--scale", r"-0\.125", r"positive"),
    refusal("scale overflows fp32", lambda t: ["--scale", "1e39"], r"--scale", r"1e39", r"positive"),
    refusal("batch beyond any integer", lambda t: ["--batch", "99999999999999999999"],
            r"--batch", r"99999999999999999999", AT_LEAST_1),
    refusal("unknown flag with a value", lambda t: ["--frobnicate=1"], r"--frobnicate", r"unknown", r"--help",
            unwanted=r"takes no"),
    # What is echoed is escaped (C style), so that the message stays on one line whatever was typed.
    refusal("scale with a newline", lambda t: ["--scale", "0.1\n25"], *SCALE_FORM, r"'0\.1\\n25'"),
    refusal("heads with a tab", lambda t: ["--heads", "1\t6"], r"--heads", r"'1\\t6'"),
    refusal("heads with a backslash", lambda t: ["--heads", "1\\n"], r"--heads", r"'1\\\\n'"),
    refusal("unknown flag with an escape sequence", lambda t: ["--frob\x1b[2J"], r"'--frob\\x1b\[2J'", r"unknown"),
    refusal("stray argument with a newline", lambda t: ["a\nb"], r"'a\\nb'", r"unexpected"),
    refusal("input folder with a newline", lambda t: ["--input", t / "no\nsuch"],
            tmp_then(r"/no\\nsuch"), r"(cannot open|no such)"),
    refusal("input folder with a carriage return, float32",
            lambda t: ["--input", write_qkv(t / "in\rx", dtype=np.float32)], tmp_then(r"/in\\rx/q\.npy"), r"float32"),
    refusal("output folder with a newline", lambda t: ["--output", t / "a\nb" / "out"],
            tmp_then(r"/a\\nb/out"), r"cannot be created"),
    # Decoding (--decode, common/shape.h's DecodeShape): its options and rules, then the chapters that
    # solve the forward problem only refuse a decoding shape that is valid.
    refusal("decode option without --decode", lambda t: ["--kv-heads", "8"], r"--kv-heads", r"add --decode"),
    refusal("kv-cache without --decode", lambda t: ["--kv-cache", "e4m3"], r"--kv-cache", r"add --decode"),
    refusal("kv-cache of another type", lambda t: ["--decode", "--kv-cache", "bf16"], r"--kv-cache", r"fp16 or e4m3",
            r"'bf16'"),
    refusal("decode group that does not divide", lambda t: ["--decode", "--heads", "32", "--kv-heads", "5"],
            r"\b32\b", r"\b5\b", r"multiple"),
    refusal("decode cache shorter than its new tokens",
            lambda t: ["--decode", "--batch", "2", "--new", "4", "--cache-len", "9,3"], r"sequence 1", r"length 3\b",
            r"Nq = 4"),
    refusal("decode lengths not one per sequence", lambda t: ["--decode", "--batch", "3", "--cache-len", "5,6"],
            r"--cache-len", r"\b2 lengths", r"B = 3"),
    refusal("decode pool past 2^31 elements",
            lambda t: ["--decode", "--batch", "1025", "--heads", "1", "--headdim", "64", "--page-size", "1",
                       "--cache-len", "4194304"], r"cache pool", r"2\^31"),
    refusal("decode lengths with an empty item", lambda t: ["--decode", "--batch", "3", "--cache-len", "10,,3"],
            r"--cache-len", r"comma-separated", r"'10,,3'"),
    refusal("decode more lengths than sequences", lambda t: ["--decode", "--batch", "2", "--cache-len", "5,5,5"],
            r"--cache-len", r"more than B = 2"),
    refusal("decode a length of 36 digits",
            lambda t: ["--decode", "--batch", "1", "--cache-len", "99999999999999999999999999999999999"],
            r"--cache-len", r"between 1 and 4194304"),
    refusal("decode past 65535 (sequence, head) pairs", lambda t: ["--decode", "--batch", "70000", "--heads", "1"],
            r"B\*Hq = 70000", r"65535"),
    refusal("decode page of 512 tokens", lambda t: ["--decode", "--page-size", "512"], r"--page-size", r"\b256\b"),
    refusal("decode 17 new tokens", lambda t: ["--decode", "--new", "17"], r"--new", r"\b16\b"),
    refusal("decode with --seqlen", lambda t: ["--decode", "--seqlen", "64"], r"--seqlen", r"--cache-len"),
    refusal("decode with --causal", lambda t: ["--decode", "--causal"], r"--causal", r"--new"),
    refusal("decode headdim 96", lambda t: ["--decode", "--headdim", "96"], r"\b96\b", r"\b64\b", r"\b128\b"),
    refusal("output o.npy a directory, folder with a newline",
            lambda t: ["--output", output_with(t / "x\ny", "o.npy", "dir")], tmp_then(r"/x\\ny/o\.npy"),
            r"is a directory"),
]


@pytest.mark.parametrize("make_args, patterns, unwanted", BAD)
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_bad_input_is_refused_before_any_gpu_work(repo, tmp_path, chapter, make_args, patterns, unwanted):
    """Exit 2, one line on stderr that says what is wrong (every pattern, and not `unwanted`),
    nothing on stdout, nothing prepared in FA_CACHE."""
    assert_refused(repo, repo.require_binary(chapter), chapter, make_args(tmp_path), patterns, unwanted, tmp_path)


# --scale values that follow the rule: accepted, and the plan shows the value (as %.6g of the fp32).
GOOD_SCALES = ["0.125", "1e-3", "1E-3", ".5", "2.", "1.5e+2", "0125e-4", "3.4e38", "1.2e-38"]


@pytest.mark.parametrize("value", GOOD_SCALES)
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_good_scale_is_accepted_and_shown_in_the_plan(repo, tmp_path, chapter, value):
    proc = run_binary(repo, repo.require_binary(chapter), ["--dry-run", "--scale", value], tmp_path / "cache")
    assert proc.returncode == 0, f"{chapter} --dry-run --scale {value!r}: exit {proc.returncode}: {proc.stderr.strip()}"
    want = f"scale {float(np.float32(float(value))):.6g},"
    assert want in proc.stdout, f"{chapter} --scale {value!r}: the plan does not show {want!r}:\n{proc.stdout}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_output_check_leaves_nothing_behind(repo, tmp_path, chapter):
    """The --output check leaves nothing behind, whether it refuses or accepts: refused (lse.npy a
    directory), the file it tried for o.npy is gone; accepted but nothing written (--dry-run, or no
    GPU: exit 77), no folder made and an existing o.npy unchanged."""
    binary = repo.require_binary(chapter)
    cache = tmp_path / "cache"
    small = ["--batch", "1", "--heads", "1", "--seqlen", "16", "--headdim", "64", "--no-check"]
    out = output_with(tmp_path / "refused", "lse.npy", "dir")
    proc = run_binary(repo, binary, ["--output", out, *small], cache)
    assert proc.returncode == 2, f"{chapter} --output (lse.npy a directory): exit {proc.returncode}, expected 2"
    left = sorted(p.name for p in out.iterdir())
    assert left == ["lse.npy"], f"{chapter}: refused --output {out}, but left {left} in it (expected only lse.npy)"
    for extra, code in ((["--dry-run"], 0), ([], 77)):
        fresh = tmp_path / f"fresh{len(extra)}"
        proc = run_binary(repo, binary, [*extra, "--output", fresh, *small], cache)
        assert proc.returncode == code, (
            f"{chapter} {' '.join(extra)} --output {fresh}: exit {proc.returncode}, expected {code}: "
            f"{proc.stderr.strip()}")
        assert not fresh.exists(), f"{chapter} {' '.join(extra)} --output: wrote nothing, but made {fresh}"
        kept = tmp_path / f"kept{len(extra)}"
        kept.mkdir()
        (kept / "o.npy").write_bytes(b"old")
        proc = run_binary(repo, binary, [*extra, "--output", kept, *small], cache)
        assert proc.returncode == code, f"{chapter} --output {kept}: exit {proc.returncode}, expected {code}"
        left = sorted(p.name for p in kept.iterdir())
        assert left == ["o.npy"] and (kept / "o.npy").read_bytes() == b"old", (
            f"{chapter} {' '.join(extra)} --output: wrote nothing, but the folder now holds {left} "
            f"(o.npy {(kept / 'o.npy').read_bytes()[:16]!r})")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_help_lists_every_option_and_exit_code(repo, tmp_path, chapter):
    """-h is --help; it exits 0 and lists every option, and what exit codes 77 and 2 mean."""
    binary = repo.require_binary(chapter)
    short = run_binary(repo, binary, ["-h"], tmp_path / "cache")
    assert short.returncode == 0, (
        f"{chapter} -h: exit {short.returncode}, expected 0 (as --help): {short.stderr.strip()}")
    proc = run_binary(repo, binary, ["--help"], tmp_path / "cache")
    assert proc.returncode == 0, f"{chapter} --help: exit {proc.returncode}, expected 0: {proc.stderr.strip()}"
    assert short.stdout == proc.stdout, f"{chapter}: -h and --help print different texts"
    missing = [o for o in OPTIONS if not re.search(re.escape(o) + r"\b", proc.stdout)]
    assert not missing, f"{chapter} --help does not list {missing}"
    for code in ("77", "2"):
        assert re.search(rf"\b{code}\b", proc.stdout), f"{chapter} --help does not explain exit code {code}"


# --- --dry-run: the plan, and the scratch memory it shows ---------------------------------------------
def human_bytes(n):
    """The harness's size format: '512 B', '234.4 KiB', '256.0 GiB'."""
    units, u, value = ["B", "KiB", "MiB", "GiB", "TiB"], 0, float(n)
    while value >= 1024 and u < 4:
        value /= 1024
        u += 1
    return f"{value:.1f} {units[u]}" if u else f"{value:.0f} {units[u]}"


DRY_RUN_SHAPES = {  # (B, H, N, D): small and huge, for the chapters with an N^2 workspace and the fused ones
    "n2": [(1, 2, 8, 64), (1, 1, 16, 128), (2, 3, 100, 64), (3, 5, 1000, 64), (1, 16, 65536, 128)],
    "fused": [(1, 16, 65536, 128), (1, 16, 65536, 64), (2, 3, 100, 64)],
}
DRY_RUNS = [pytest.param(chapter, shape, id=f"{chapter} B={shape[0]} H={shape[1]} N={shape[2]} D={shape[3]}")
            for chapter in CHAPTERS for shape in DRY_RUN_SHAPES["fused" if int(chapter[:2]) >= 4 else "n2"]]


@pytest.mark.parametrize("causal", [False, True], ids=["non-causal", "causal"])
@pytest.mark.parametrize("chapter, shape", DRY_RUNS)
def test_dry_run_shows_the_shape_and_the_workspace(repo, tmp_path, chapter, shape, causal):
    """The plan echoes the shape and causality, and its workspace line is helpers.WORKSPACE's size."""
    binary = repo.require_binary(chapter)
    number = int(chapter[:2])
    if number not in WORKSPACE:
        pytest.skip(f"{chapter}: no workspace claim for chapter {number:02d} in helpers.WORKSPACE")
    b, h, n, d = shape
    args = ["--dry-run", "--batch", b, "--heads", h, "--seqlen", n, "--headdim", d] + (["--causal"] if causal else [])
    args = [str(a) for a in args]
    proc = run_binary(repo, binary, args, tmp_path / "cache")
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


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_dry_run_takes_the_shape_from_input(repo, tmp_path, chapter):
    folder = write_qkv(tmp_path / "in", shape=(2, 3, 33, 128))
    proc = run_binary(repo, repo.require_binary(chapter), ["--dry-run", "--input", folder, "--causal"],
                      tmp_path / "cache")
    assert proc.returncode == 0, f"{chapter} --dry-run --input: exit {proc.returncode}: {proc.stderr.strip()}"
    assert "B=2 H=3 N=33 D=128 causal" in proc.stdout, (
        f"{chapter} --dry-run --input: shape not taken from the files (2, 3, 33, 128):\n{proc.stdout}")


# --- decoding (--decode) ---------------------------------------------------------------------------
DECODE_ARGS = ["--decode", "--batch", "2", "--heads", "32", "--kv-heads", "8", "--new", "4", "--cache-len", "100,2000",
               "--page-size", "16", "--headdim", "64"]


@pytest.mark.parametrize("chapter", [c for c in CHAPTERS if c not in DECODE_CHAPTERS])
def test_a_chapter_without_a_decode_pass_refuses_a_valid_decoding_shape(repo, tmp_path, chapter):
    assert_refused(repo, repo.require_binary(chapter), chapter, DECODE_ARGS, [r"no decode pass", r"--decode"], None,
                   tmp_path)


@pytest.mark.parametrize("chapter", DECODE_CHAPTERS)
def test_decode_dry_run_shows_the_shape_and_the_bytes_to_read(repo, tmp_path, chapter):
    """The plan of a ragged, grouped, paged shape: its dimensions, its pages, and the bytes of K and V
    every step must read (2 x 2100 tokens x 8 KV heads x 64 dims x 2 bytes = 4.1 MiB)."""
    proc = repo.run([repo.require_binary(chapter), *DECODE_ARGS, "--dry-run"], env={**NO_GPU, "FA_CACHE": str(tmp_path)},
                    timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"B=2 Hq=32 Hkv=8 \(groups of 4\) Nq=4 D=64, cache up to 2000 tokens in pages of 16 "
                     r"\(132 pages\)", proc.stdout), proc.stdout
    assert re.search(r"4\.1 MiB of K and V to read", proc.stdout), proc.stdout
    assert not any(tmp_path.iterdir()), "a dry run prepared inputs"


# --kv-cache e4m3: the decoding steps before 11.5 read an fp16 cache only, and say so before any GPU work; a
# chapter without a decode pass says that first. A step whose Decode pass ends in 1 reads e4m3 too.
READS_E4M3 = re.compile(r"static const Decode \w+ = \{[^}]*,\s*1\s*\}")
FP16_CACHE_BUILDS = [f"{c}.step{s['step']}" for c in DECODE_CHAPTERS
                     for s in read_steps(os.path.join(runner.ROOT, c, "attention.cu"))[:-1]
                     if not READS_E4M3.search(open(s["source"]).read())]


@pytest.mark.parametrize("build", FP16_CACHE_BUILDS + ["07_async_pipeline"])
def test_a_build_without_an_e4m3_cache_refuses_it(repo, tmp_path, build):
    patterns = [r"no decode pass"] if build == "07_async_pipeline" else [r"fp16 cache only", r"--kv-cache e4m3"]
    assert_refused(repo, repo.require_binary(build), build, DECODE_ARGS + ["--kv-cache", "e4m3"], patterns, None,
                   tmp_path)


@pytest.mark.parametrize("chapter", DECODE_CHAPTERS)
def test_decode_dry_run_with_an_e4m3_cache_reads_half_the_bytes(repo, tmp_path, chapter):
    """--kv-cache e4m3's plan: one byte an element, 2 x 2100 tokens x 8 KV heads x 64 dims = 2.1 MiB (fp16's 4.1),
    and --kv-cache fp16 is the default's plan; with --input too."""
    env = {**NO_GPU, "FA_CACHE": str(tmp_path / "cache")}
    plans = {}
    for cache in ("e4m3", "fp16"):
        proc = repo.run([repo.require_binary(chapter), *DECODE_ARGS, "--kv-cache", cache, "--dry-run"], env=env,
                        timeout=60)
        assert proc.returncode == 0, proc.stderr
        plans[cache] = proc.stdout
    assert re.search(r"\b2\.1 MiB of K and V to read \(e4m3\)", plans["e4m3"]), plans["e4m3"]
    assert re.search(r"\b4\.1 MiB of K and V to read \(fp16\)", plans["fp16"]), plans["fp16"]
    proc = repo.run([repo.require_binary(chapter), *decode_input(tmp_path), "--kv-cache", "e4m3", "--dry-run"],
                    env=env, timeout=60)
    assert proc.returncode == 0 and re.search(r"of K and V to read \(e4m3\)", proc.stdout), (proc.stdout, proc.stderr)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir()), "a dry run prepared inputs"


# --- decoding's --input DIR: the user's own queries, paged cache, block table and lengths --------------
def write_decode(folder, tokens=(20, 40), heads=(4, 2), new=2, d=64, page=16, int_dtype=np.int32, **override):
    """A --decode --input folder: q [B, Hq, Nq, D] and pools [pages, Hkv, P, D] (fp16 N(0, 1)), each sequence
    its own pages (those its tokens use, in pool order), block_table [B, max_pages] (-1 past a sequence's
    pages) and lengths [B] (the tokens) of int_dtype; override={'name': array, or None: no such file}
    replaces a file's array. Default: B=2, Hq=4, Hkv=2, Nq=2, D=64, P=16, 20 and 40 tokens: 2 + 3 = 5
    pages, 3 a row, a capacity of 48 tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    used = [-(-n // page) for n in tokens]
    table = np.full((len(tokens), max(used)), -1, int_dtype)
    for b, n in enumerate(used):
        table[b, :n] = np.arange(sum(used[:b]), sum(used[:b]) + n)
    pool = (sum(used), heads[1], page, d)
    arrays = {"q": rng.standard_normal((len(tokens), heads[0], new, d)).astype(np.float16),
              "k_pool": rng.standard_normal(pool).astype(np.float16),
              "v_pool": rng.standard_normal(pool).astype(np.float16),
              "block_table": table, "lengths": np.array(tokens, int_dtype)}
    arrays.update(override)
    for name, array in arrays.items():
        if array is not None:
            np.save(folder / f"{name}.npy", array)
    return folder


def decode_with(folder, name, at, value, **shape):
    """write_decode's folder with one element of `name` set to value at index at."""
    write_decode(folder, **shape)
    array = np.load(folder / f"{name}.npy")
    array[at] = value
    np.save(folder / f"{name}.npy", array)
    return folder


def decode_input(tmp, *flags, **shape):
    """--decode --input <a write_decode folder in tmp>, then flags."""
    return ["--decode", "--input", write_decode(tmp / "in", **shape), *flags]


CONTRADICTS = [r"contradicts the --input files", r"drop it: the shape comes from the files"]
DECODE_INPUT_BAD = [
    # A shape option given with --input: refused where it says other than the files, as the forward's is.
    refusal("--batch", lambda t: decode_input(t, "--batch", "3"), r"--batch 3\b", r"\(2\)", *CONTRADICTS),
    refusal("--heads", lambda t: decode_input(t, "--heads", "8"), r"--heads 8\b", r"\(4\)", *CONTRADICTS),
    refusal("--kv-heads", lambda t: decode_input(t, "--kv-heads", "1"), r"--kv-heads 1\b", r"\(2\)", *CONTRADICTS),
    refusal("--new", lambda t: decode_input(t, "--new", "1"), r"--new 1\b", r"\(2\)", *CONTRADICTS),
    refusal("--headdim", lambda t: decode_input(t, "--headdim", "128"), r"--headdim 128\b", r"\(64\)", *CONTRADICTS),
    refusal("--page-size", lambda t: decode_input(t, "--page-size", "8"), r"--page-size 8\b", r"\(16\)",
            *CONTRADICTS),
    refusal("--cache-len other lengths", lambda t: decode_input(t, "--cache-len", "20,41"), r"--cache-len 20,41",
            r"sequence 1 caches 40 tokens", *CONTRADICTS),
    refusal("--cache-len one length for all", lambda t: decode_input(t, "--cache-len", "40"), r"--cache-len 40\b",
            r"sequence 0 caches 20 tokens", *CONTRADICTS),
    refusal("--cache-len three lengths", lambda t: decode_input(t, "--cache-len", "20,40,60"),
            r"--cache-len 20,40,60", r"2 lengths in lengths\.npy", *CONTRADICTS),
    refusal("--headdim, --dry-run", lambda t: decode_input(t, "--dry-run", "--headdim", "128"), r"--headdim 128\b",
            *CONTRADICTS),
    # The rules of a decoding shape (common/shape.h), the block table's entries among them this time.
    refusal("an entry past the pool",
            lambda t: ["--decode", "--input", decode_with(t / "in", "block_table", (1, 2), 5)],
            r"sequence 1: block table entry 2 names page 5, past the pool of 5 pages"),
    refusal("a used entry of -1, --dry-run",
            lambda t: ["--dry-run", "--decode", "--input", decode_with(t / "in", "block_table", (0, 1), -1)],
            r"sequence 0: block table entry 1 names page -1\b"),
    refusal("an int64 entry past an int",
            lambda t: ["--decode", "--input", decode_with(t / "in", "block_table", (0, 0), 1 << 40,
                                                          int_dtype=np.int64)],
            r"sequence 0: block table entry 0 names page 2147483647, past the pool of 5 pages"),
    refusal("a length over the capacity", lambda t: ["--decode", "--input", decode_with(t / "in", "lengths", 1, 49)],
            r"sequence 1: cache length 49, over the capacity of 48 tokens \(3 pages of 16\)"),
    refusal("a length below Nq", lambda t: ["--decode", "--input", decode_with(t / "in", "lengths", 0, 1)],
            r"sequence 0: cache length 1, shorter than its Nq = 2 new tokens"),
    refusal("Hq not a multiple of Hkv", lambda t: decode_input(t, heads=(3, 2)),
            r"3 query heads over 2 KV heads: Hq must be a multiple of Hkv"),
    refusal("17 new tokens", lambda t: decode_input(t, new=17), r"Nq = 17 new tokens: at most 16"),
    refusal("D = 96", lambda t: decode_input(t, d=96), r"head dimension 96", r"\b64\b", r"\b128\b"),
    # What the files are, and whether they fit together.
    refusal("q float32", lambda t: decode_input(t, q=np.zeros((2, 4, 2, 64), np.float32)),
            r"q\.npy", r"float32", *CAST_TO_FP16),
    refusal("k_pool float64, --dry-run", lambda t: decode_input(t, "--dry-run", k_pool=np.zeros((5, 2, 16, 64))),
            r"k_pool\.npy", r"float64", *CAST_TO_FP16),
    refusal("block_table float32", lambda t: decode_input(t, block_table=np.zeros((2, 3), np.float32)),
            r"block_table\.npy", r"float32", r"'<i8'", r"\.astype\(np\.int64\)"),
    refusal("lengths uint8", lambda t: decode_input(t, lengths=np.array([20, 40], np.uint8)),
            r"lengths\.npy", r"'\|u1'", r"'<i8'"),
    refusal("lengths int32, truncated", lambda t: ["--decode", "--input", truncated(write_decode(t / "in"), "lengths")],
            r"lengths\.npy", r"truncated", unwanted=r"'<i8'"),
    refusal("q 3-D", lambda t: decode_input(t, q=np.zeros((2, 4, 64), np.float16)),
            r"q\.npy: 3-D array, expected 4-D \[B, Hq, Nq, D\]"),
    refusal("block_table 1-D", lambda t: decode_input(t, block_table=np.zeros(6, np.int32)),
            r"block_table\.npy: 1-D array, expected 2-D \[B, max_pages\]"),
    refusal("pools of two shapes", lambda t: decode_input(t, v_pool=np.zeros((6, 2, 16, 64), np.float16)),
            r"v_pool\.npy has shape \(6, 2, 16, 64\) but k_pool\.npy has \(5, 2, 16, 64\)"),
    refusal("pools of another D", lambda t: decode_input(t, k_pool=np.zeros((5, 2, 16, 128), np.float16),
                                                         v_pool=np.zeros((5, 2, 16, 128), np.float16)),
            r"k_pool\.npy has D = 128 but q\.npy has D = 64"),
    refusal("a table row short", lambda t: decode_input(t, block_table=np.zeros((1, 3), np.int32)),
            r"block_table\.npy has 1 rows but q\.npy has B = 2 sequences"),
    refusal("a length too many", lambda t: decode_input(t, lengths=np.array([20, 40, 9], np.int32)),
            r"lengths\.npy has 3 lengths but q\.npy has B = 2 sequences"),
    refusal("lengths.npy missing", lambda t: ["--decode", "--input", write_decode(t / "in", lengths=None)],
            r"lengths\.npy", r"cannot open"),
    # Values no attention is defined on, anywhere in q or a pool.
    refusal("NaN in k_pool", lambda t: ["--decode", "--input", decode_with(t / "in", "k_pool", (3, 1, 5, 7), np.nan)],
            r"k_pool\.npy holds 1 NaN or Inf value, the first at \[3, 1, 5, 7\]", r"nan_to_num"),
    refusal("Inf in q, --dry-run",
            lambda t: ["--dry-run", "--decode", "--input", decode_with(t / "in", "q", (1, 3, 0, 2), np.inf)],
            r"q\.npy holds 1 NaN or Inf value, the first at \[1, 3, 0, 2\]"),
    refusal("Inf in v_pool past every length",
            lambda t: ["--decode", "--input", decode_with(t / "in", "v_pool", (4, 0, 15, 63), -np.inf)],
            r"v_pool\.npy holds 1 NaN or Inf value, the first at \[4, 0, 15, 63\]"),
    # --output still belongs to the forward problem.
    refusal("--output", lambda t: decode_input(t, "--output", t / "out"), r"--output belongs to the forward problem"),
]


@pytest.mark.parametrize("make_args, patterns, unwanted", DECODE_INPUT_BAD)
@pytest.mark.parametrize("chapter", DECODE_CHAPTERS)
def test_decode_input_is_refused_before_any_gpu_work(repo, tmp_path, chapter, make_args, patterns, unwanted):
    """--decode --input DIR of a folder that is not a decoding problem, or with a shape option that says
    otherwise: exit 2 and one line (no GPU is visible: a refusal after the GPU check would be exit 77),
    nothing prepared in FA_CACHE."""
    assert_refused(repo, repo.require_binary(chapter), chapter, make_args(tmp_path), patterns, unwanted, tmp_path)


@pytest.mark.parametrize("chapter", [c for c in CHAPTERS if c not in DECODE_CHAPTERS])
def test_a_chapter_without_a_decode_pass_refuses_a_valid_decoding_folder(repo, tmp_path, chapter):
    assert_refused(repo, repo.require_binary(chapter), chapter, decode_input(tmp_path), [r"no decode pass"], None,
                   tmp_path)


DECODE_INPUT_PLAN = r"B=2 Hq=4 Hkv=2 \(groups of 2\) Nq=2 D=64, cache up to 40 tokens in pages of 16 \(5 pages\)"


@pytest.mark.parametrize("int_dtype", [np.int32, np.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("chapter", DECODE_CHAPTERS)
def test_decode_dry_run_takes_the_shape_from_input(repo, tmp_path, chapter, int_dtype):
    """The plan of --decode --input DIR is the folder's shape (B, Hq, Nq, D from q, Hkv, P and the pages from the
    pools, the lengths from lengths.npy), the scale 1/sqrt(D) unless given; shape options that agree with the
    files are taken (as the forward's are); a table entry past a sequence's pages is not read, so not refused.
    Nothing is prepared."""
    binary = repo.require_binary(chapter)
    folder = write_decode(tmp_path / "in", int_dtype=int_dtype)
    table = np.load(folder / "block_table.npy")
    table[0, 2] = 99  # past sequence 0's two pages
    np.save(folder / "block_table.npy", table)
    agreeing = ["--batch", "2", "--heads", "4", "--kv-heads", "2", "--new", "2", "--headdim", "64", "--page-size", "16",
                "--cache-len", "20,40"]
    for extra, scale in (([], "0.125"), (agreeing, "0.125"), (["--scale", "0.5"], "0.5")):
        args = ["--decode", "--input", str(folder), "--dry-run", *extra]
        proc = run_binary(repo, binary, args, tmp_path / "cache")
        shown = f"{chapter} {' '.join(args)}"
        assert proc.returncode == 0, f"{shown}: exit {proc.returncode}: {proc.stderr.strip()}"
        assert re.search(DECODE_INPUT_PLAN + rf", scale {scale}\n", proc.stdout), f"{shown}:\n{proc.stdout}"
        # 2 x (20 + 40) tokens x 2 KV heads x 64 dims x 2 bytes
        assert re.search(r"\b30\.0 KiB of K and V to read", proc.stdout), f"{shown}:\n{proc.stdout}"
    assert not (tmp_path / "cache").exists(), "a dry run prepared a reference"


@pytest.mark.parametrize("chapter", DECODE_CHAPTERS)
def test_a_folder_reference_py_decode_wrote_is_a_valid_decode_input(repo, tmp_path, chapter):
    """reference.py decode's files are --decode --input's: the same names, dtypes and shapes."""
    import reference
    folder = tmp_path / "written"
    assert reference.main(["decode", "--out", str(folder), "--batch", "3", "--heads", "8", "--kv-heads", "2", "--new",
                           "4", "--headdim", "128", "--page-size", "256", "--lengths", "4,300,1000", "--scale", "0.1",
                           "--no-ref"]) == 0
    proc = run_binary(repo, repo.require_binary(chapter), ["--decode", "--input", folder, "--dry-run"],
                      tmp_path / "cache")
    assert proc.returncode == 0, f"{chapter} --decode --input {folder} --dry-run: {proc.stderr.strip()}"
    assert re.search(r"B=3 Hq=8 Hkv=2 \(groups of 4\) Nq=4 D=128, cache up to 1000 tokens in pages of 256 "
                     r"\(7 pages\), scale 0\.0883883", proc.stdout), proc.stdout
