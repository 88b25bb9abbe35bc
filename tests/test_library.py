"""The chapters as libraries (`make lib`: BUILD/lib/<build>.so, common/library.h; docs/design.md), without a GPU.

Each library is the build folder's, made by `make all lib` before the tests (skipped, saying so, where it is
missing); it links the object of the build's executable (whose compile test_build checks) and exports exactly
the fa_* functions common/library.h declares. tests/fixtures/library_probe.c, a C program that dlopen()s the
library, then calls it on made-up device pointers: each call must be refused before any kernel could read them,
with the code library.h gives and a one-line fa_last_error() naming the problem: the command line's shape rules
(common/shape.h, in the very words the binary prints), the scale, the backward's mode (`deterministic` 0 or 1),
NULL and misaligned pointers, a workspace too small (in either mode), a backward on a chapter without one (before
anything else, as the command line says it); a valid call, where no GPU is visible, answers FA_ERR_NO_GPU. Never
a crash, an exit or a line printed. The sizes fa_workspace_bytes and fa_backward_workspace_bytes (in each mode)
give are the chapter's (helpers.WORKSPACE, 09's backward's here).
"""
import re
import shlex
import shutil

import pytest

import runner
import torch_op
from chapters import read_chapter
from helpers import CHAPTERS, DECODE_CHAPTERS, STEP_BUILDS, WORKSPACE, has_backward

# Every build of `make all`, each with its library (test_build holds the list to the Makefile's).
BUILDS = [*CHAPTERS, *(build for _, build, _ in STEP_BUILDS)]
BASE = (1, 2, 16, 64)  # the probe's shape for every call (B, H, N, D), scale 0.125
PROBE_SHAPES = [(1, 2, 16, 64), (2, 3, 100, 128), (3, 5, 1000, 64), (1, 16, 65536, 128)]
NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def header(repo):
    return (repo.root / "common" / "library.h").read_text()


def codes(repo):
    """library.h's numbers by name: {'OK': 0, 'ERR_INVALID_ARGUMENT': 1, ..., 'PRECISION_FP32': 0, ...,
    'ABI_VERSION': 2}."""
    text = header(repo)
    found = {name: int(value) for name, value in re.findall(r"\bFA_(\w+) = (\d+)", text)}
    found["ABI_VERSION"] = int(re.search(r"#define FA_ABI_VERSION (\d+)", text).group(1))
    return found


def exported_names(repo):
    """The functions library.h declares: what a library exports, and nothing more."""
    return set(re.findall(r"^FA_API [^;(]*?\b(fa_\w+)\(", header(repo), re.M))


def backward_workspace(b, h, n, d, deterministic=False, build="09_backward"):
    """A backward's scratch, then the fp32 dQ accumulator; the same in the deterministic mode where no GPU
    is visible (09's copies of dQ are the GPU's to decide: one without it). 09's (and 10's first two
    steps'): D, a float per query row, to 256 bytes, then the accumulator of n rows. 10's: each 64-query
    tile's LSE and D side by side (512 bytes a tile), then the accumulator of whole 64-query tiles, then
    the deterministic mode's turns, an int per 64-query tile and 64-dim pass, to 256 bytes (both modes)."""
    tiles = -(-n // 64)
    if build == "10_backward_hopper":
        return b * h * tiles * 512 + b * h * tiles * 64 * d * 4 + -(-b * h * tiles * (d // 64) * 4 // 256) * 256
    return -(-b * h * n * 4 // 256) * 256 + b * h * n * d * 4


def decode_workspace(b, q_heads, new_tokens, d, max_length):
    """11's decoding scratch: a partial softmax state (O, max, sum) per query row per split of 256 keys of
    the longest sequence."""
    return b * q_heads * new_tokens * -(-max_length // 256) * (d + 2) * 4


def library(repo, name):
    """BUILD/lib/<name>.so, as `make lib` built it; a skip where it is not there."""
    path = repo.build / "lib" / f"{name}.so"
    if not path.is_file():
        pytest.skip(f"{repo.rel(path)} is not built: run make lib (make test runs make all lib first)")
    return path


def host_compiler():
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no C compiler (cc, gcc, clang) for tests/fixtures/library_probe.c")


def probe(repo):
    """tests/fixtures/library_probe.c, compiled once per worker: C11, every warning an error, no CUDA header on
    the path."""
    def build():
        out = repo.tmpdir() / "library_probe"
        proc = repo.run([host_compiler(), "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", repo.root / "common", "-o",
                         out, repo.root / "tests" / "fixtures" / "library_probe.c", "-ldl", "-pthread"], timeout=120)
        assert proc.returncode == 0, f"tests/fixtures/library_probe.c does not compile:\n{proc.stderr.strip()[-3000:]}"
        return out
    return repo.once("library_probe", build)


def test_header_is_plain_c_and_cxx(repo):
    """common/library.h compiles alone, without CUDA's headers, as C99, C11 and C++17, every warning an error."""
    source = ('#include "library.h"\n'
              "int main(void) {\n"
              "    FaShape s = {1, 2, 16, 64, 0, 0.125f};\n"
              "    char problem[256];\n"
              "    return shape_problem(&s, problem, sizeof problem) + scale_problem(s.scale, problem, 256) + FA_OK;\n"
              "}\n")
    compilers = [(host_compiler(), "c", ["-std=c99"]), (host_compiler(), "c", ["-std=c11"])]
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx:
        compilers.append((cxx, "c++", ["-std=c++17"]))
    for compiler, language, flags in compilers:
        proc = repo.run([compiler, "-x", language, *flags, "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I",
                         repo.root / "common", "-"], input=source, timeout=60)
        assert proc.returncode == 0, f"library.h as {language} {flags}: {proc.stderr.strip()[-2000:]}"


def test_make_lib_builds_every_build(repo, tmp_path):
    """`make lib` has a library for every build of `all` (the chapters, 08's steps),
    each linked -shared from the build's position-independent object (the executable's) and library.o, without
    the harness; `make all` builds none of them (it stays as quick as it was), and `make help` names the target
    (make -n in an empty folder: what it would run)."""
    folder = tmp_path / "build"
    make = shlex.split(repo.make) + ["-n", "--no-print-directory", f"BUILD={folder}", "ARCH=sm_80"]
    lib = repo.run(make + ["lib"], env=runner.make_env(), timeout=120)
    assert lib.returncode == 0, f"make -n lib failed: {lib.stderr.strip()}"
    lines = lib.stdout.splitlines()
    missing = [name for name in BUILDS if f"{folder}/lib/{name}.so" not in lib.stdout]
    assert not missing, f"make lib does not build {missing}"
    for name in BUILDS:
        link = next((line for line in lines if f"-o {folder}/lib/{name}.so" in line), "")
        assert re.search(r"\s-shared\s", link) and "harness.o" not in link, f"make lib: {name}.so's link line: {link!r}"
    for name in [*BUILDS, "library"]:
        compile_line = next((line for line in lines
                             if " -c " in line and re.search(rf"-o \S+/{re.escape(name)}\.o ", line)), "")
        assert "-fPIC" in compile_line, f"make lib: {name}.o is not compiled -fPIC: {compile_line!r}"
    everything = repo.run(make + ["all"], env=runner.make_env(), timeout=120)
    assert everything.returncode == 0, f"make -n all failed: {everything.stderr.strip()}"
    assert ".so" not in everything.stdout, "make all builds libraries: they are `make lib`'s"
    helped = repo.run(shlex.split(repo.make) + ["--no-print-directory", "help"], timeout=60)
    assert re.search(r"^make lib\b.*\.so", helped.stdout, re.M), f"make help does not name `make lib`:\n{helped.stdout}"


@pytest.mark.parametrize("build", BUILDS)
def test_library_exports_library_h(repo, build):
    path = library(repo, build)
    tool = shutil.which("nm")
    if not tool:
        pytest.skip("nm (binutils) not installed: exports not checked")
    proc = repo.run([tool, "-D", "--defined-only", path], timeout=60)
    assert proc.returncode == 0, f"nm -D {path.name}: {proc.stderr.strip()}"
    names = {line.split()[-1].split("@")[0] for line in proc.stdout.splitlines() if line.strip()}
    wanted = exported_names(repo)
    assert len(wanted) >= 10, f"common/library.h: only {sorted(wanted)} found declared FA_API"
    assert names == wanted, (f"{path.name} exports {sorted(names - wanted)[:20]} beyond library.h's functions"
                             if names - wanted else f"{path.name} lacks {sorted(wanted - names)}")


# 09's steps before the chapter: their Backward has no deterministic mode (09.8's), and says so.
STEPS_WITHOUT_MODE = [build for _, build, _ in STEP_BUILDS if build.startswith("09_backward.")]


@pytest.mark.parametrize("build", STEPS_WITHOUT_MODE)
def test_step_library_refuses_the_deterministic_mode(repo, build):
    """fa_backward_workspace_bytes with deterministic 1 on a step's library: FA_ERR_INVALID_ARGUMENT, the
    step named and the chapter's pointed to; with 0, its workspace (no GPU needed for either)."""
    lib = torch_op.Library(str(library(repo, build)))
    shape = torch_op.make_shape(*BASE, False, 0.125)
    assert lib.backward_workspace_bytes(shape, deterministic=False) == backward_workspace(*BASE, build=build)
    with pytest.raises(torch_op.LibraryError) as refused:
        lib.backward_workspace_bytes(shape, deterministic=True)
    message = str(refused.value)
    assert refused.value.code == codes(repo)["ERR_INVALID_ARGUMENT"], message
    assert re.search(rf"^{re.escape(lib.name)}: fa_backward_workspace_bytes: .*no deterministic mode.*the chapter's",
                     message), message


def read_probe(proc, shown):
    """The probe's lines: ({what: value}, {label: (code, message)}); every line one of the two kinds."""
    assert proc.returncode == 0, (f"{shown}: exit {proc.returncode} (a crash, or the library exited); "
                                  f"stderr {proc.stderr.strip()[-1500:]!r}, last lines {proc.stdout[-800:]!r}")
    assert not proc.stderr.strip(), f"{shown}: something printed on stderr: {proc.stderr.strip()[:1500]!r}"
    info, cases = {}, {}
    for line in proc.stdout.splitlines():
        fields = line.split("\t")
        if fields[0] == "info" and len(fields) == 3:
            info[fields[1]] = fields[2]
        elif fields[0] == "case" and len(fields) == 4:
            assert fields[1] not in cases, f"{shown}: case {fields[1]!r} twice"
            cases[fields[1]] = (int(fields[2]), fields[3])
        else:
            raise AssertionError(f"{shown}: a line that is neither the probe's info nor a case (printed by the "
                                 f"library, or a message of more than one line?): {line!r}")
    assert info.get("done") == "1", f"{shown}: the probe did not get to its end"
    return info, cases


# Shapes the command line's rules refuse (the probe's labels): patterns of the message.
SHAPES_REFUSED = {
    "headdim 96": [r"head dimension 96", r"64 or 128"],
    "seqlen 0": [r"\bN\b.*seqlen", r"= 0\b", r"at least 1"],
    "batch 0": [r"\bB\b.*batch", r"= 0\b", r"at least 1"],
    "heads -1": [r"\bH\b.*heads", r"= -1\b", r"at least 1"],
    "batch*heads 65536": [r"B\*H = 65536", r"at most 65535"],
    "seqlen 2^22+1": [r"N = 4194305", r"at most 4194304"],
    "elements 2^31": [r"B\*H\*N\*D = 2147483648", r"2\^31 - 1"],
    "causal 2": [r"causal = 2", r"0 or 1"],
    "scale 0": [r"scale 0\b", r"positive"],
    "scale -1": [r"scale -1\b", r"positive"],
    "scale nan": [r"scale nan", r"positive"],
    "scale inf": [r"scale inf", r"positive"],
    "scale subnormal": [r"scale 9\.99\d*e-41", r"1\.2e-38"],
}
# The same shapes on the command line (a binary's flags): the library says what the binary says.
CLI_OF = {
    "headdim 96": ["--headdim", "96"],
    "batch*heads 65536": ["--batch", "256", "--heads", "256"],
    "seqlen 2^22+1": ["--seqlen", "4194305"],
    "elements 2^31": ["--batch", "1", "--heads", "256", "--seqlen", "65536", "--headdim", "128"],
}
TENSORS = ["q", "k", "v", "o", "lse", "d_o", "dq", "dk", "dv"]  # the first five: the forward's
NO_BACKWARD = [r"no backward pass", r"fa_has_backward"]
NO_GPU = [r"no usable CUDA GPU", r"\(cuda\w+: [^)]+\)"]
NO_DECODE = [r"no decoding pass", r"fa_has_decode"]
# The probe's decoding shapes refused (B=2, Hq=8, Hkv=2, Nq=1, D=64, pages of 16, 32 a sequence): patterns.
DECODE_REFUSED = {
    "groups 8 over 3": [r"8 query heads over 3 KV heads", r"multiple"],
    "page size 0": [r"page size 0", r"1 to 256"],
    "new 17": [r"Nq = 17", r"at most 16"],
    "headdim 96": [r"head dimension 96", r"64 or 128"],
    "scale 0": [r"scale 0\b", r"positive"],
}


def expected_cases(repo, chapter):
    """{label: (code name, [patterns])}: what each of the probe's calls must answer on this chapter."""
    backward = has_backward(repo, chapter)
    need = WORKSPACE[int(chapter[:2])](*BASE)
    grad_need = backward_workspace(*BASE, build=chapter) if backward else 0
    deterministic_need = backward_workspace(*BASE, deterministic=True, build=chapter) if backward else 0
    bad = "ERR_INVALID_ARGUMENT"
    no_bwd = ("ERR_NO_BACKWARD", NO_BACKWARD)
    want = {}
    for label, patterns in SHAPES_REFUSED.items():
        want[f"forward: {label}"] = (bad, patterns)
        want[f"workspace_bytes: {label}"] = (bad, patterns)
        want[f"backward: {label}"] = (bad, patterns) if backward else no_bwd
    want["forward: shape NULL"] = (bad, [r"shape is NULL"])
    want["workspace_bytes: bytes NULL"] = (bad, [r"bytes is NULL"])
    want["backward_workspace_bytes: bytes NULL"] = (bad, [r"bytes is NULL"]) if backward else no_bwd
    want["backward_workspace_bytes: deterministic 2"] = (bad, [r"deterministic = 2", r"0 or 1"]) if backward else no_bwd
    want["backward: deterministic -1"] = (bad, [r"deterministic = -1", r"0 or 1"]) if backward else no_bwd
    for i, name in enumerate(TENSORS):
        for how, words in (("NULL", [rf"\b{name} is NULL", r"device pointer"]),
                           ("misaligned", [rf"\b{name} \(0x[0-9a-f]+\)", r"not 16-byte aligned"])):
            if i < 5:
                want[f"forward: {name} {how}"] = (bad, words)
            want[f"backward: {name} {how}"] = (bad, words) if backward else no_bwd
    fine = ("ERR_NO_GPU", NO_GPU)  # a workspace the shape does not need is not read
    want["forward: workspace too small"] = (bad, [r"workspace too small", rf"\b{need - 1} bytes given",
                                                  rf"needs {need}\b", r"fa_workspace_bytes"]) if need else fine
    want["forward: workspace NULL"] = (bad, [r"workspace is NULL", rf"needs {need} bytes"]) if need else fine
    want["forward: workspace misaligned"] = (bad, [r"workspace \(0x", r"not 16-byte aligned"]) if need else fine
    want["backward: workspace too small"] = (
        (bad, [r"workspace too small", rf"needs {grad_need}\b", r"fa_backward_workspace_bytes"]) if grad_need
        else fine) if backward else no_bwd
    want["backward: workspace NULL"] = ((bad, [r"workspace is NULL", rf"needs {grad_need} bytes"]) if grad_need
                                        else fine) if backward else no_bwd
    want["backward: deterministic, workspace too small"] = (
        (bad, [r"workspace too small", rf"needs {deterministic_need}\b", r"fa_backward_workspace_bytes"])
        if deterministic_need else fine) if backward else no_bwd
    want["forward: valid"] = fine
    want["forward: valid causal D=128"] = fine
    want["backward: valid"] = fine if backward else no_bwd
    want["backward: valid deterministic"] = fine if backward else no_bwd
    want["forward: headdim 96, then another thread"] = (bad, SHAPES_REFUSED["headdim 96"])
    decoding = chapter in DECODE_CHAPTERS
    no_dec = ("ERR_NO_DECODE", NO_DECODE)
    for label, patterns in DECODE_REFUSED.items():
        want[f"decode: {label}"] = want[f"decode_workspace_bytes: {label}"] = (bad, patterns) if decoding else no_dec
    decode_need = decode_workspace(2, 8, 1, 64, 300)
    for label, patterns in {"shape NULL": [r"shape is NULL"], "max_length 513": [r"max_length = 513", r"512 tokens"],
                            "max_length 0": [r"max_length = 0", r"Nq = 1"], "q NULL": [r"\bq is NULL"],
                            "lse misaligned": [r"\blse \(0x", r"not 16-byte aligned"],
                            "block_table misaligned": [r"block_table \(0x", r"not 4-byte aligned"],
                            "lengths NULL": [r"lengths is NULL"],
                            "workspace too small": [r"workspace too small", rf"needs {decode_need}\b",
                                                    r"fa_decode_workspace_bytes"]}.items():
        want[f"decode: {label}"] = (bad, patterns) if decoding else no_dec
    want["decode_workspace_bytes: bytes NULL"] = (bad, [r"bytes is NULL"]) if decoding else no_dec
    want["decode: valid, the int arrays 4-byte aligned"] = fine if decoding else no_dec
    for label, patterns in {"shape NULL": [r"shape is NULL"], "groups 8 over 3": DECODE_REFUSED["groups 8 over 3"],
                            "k_new NULL": [r"\bk_new is NULL"], "v_pool misaligned": [r"\bv_pool \(0x", r"16-byte"],
                            "lengths misaligned": [r"\blengths \(0x", r"not 4-byte aligned"]}.items():
        want[f"append: {label}"] = (bad, [r"fa_decode_append", *patterns]) if decoding else no_dec
    want["append: valid"] = fine if decoding else no_dec
    return want


FUNCTION_OF = {"forward": "fa_forward", "backward": "fa_backward", "workspace_bytes": "fa_workspace_bytes",
               "backward_workspace_bytes": "fa_backward_workspace_bytes", "decode": "fa_decode",
               "decode_workspace_bytes": "fa_decode_workspace_bytes", "append": "fa_decode_append"}


@pytest.mark.parametrize("hide_gpus", [True, False], ids=["GPUs hidden", "plain environment"])
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_library_refuses_bad_calls_before_gpu_work(repo, gpu_state, chapter, hide_gpus):
    """library_probe on the chapter's library: what it says of itself and its workspaces, and each of its calls
    answered as expected_cases says (GPUs hidden; and in the plain environment where there is no GPU); the shape
    refusals in the very words of the chapter's binary."""
    if not hide_gpus and gpu_state[0]:
        pytest.skip("a GPU is present: the plain-environment case applies only without one")
    path, program = library(repo, chapter), probe(repo)
    shown = f"{'CUDA_VISIBLE_DEVICES= ' if hide_gpus else ''}library_probe {chapter}.so"
    proc = repo.run([program, path], env=NO_GPU_ENV if hide_gpus else None, timeout=120)
    info, cases = read_probe(proc, shown)
    code = codes(repo)
    facts = read_chapter(repo.root / chapter / "attention.cu")
    backward = has_backward(repo, chapter)

    assert info["abi_version"] == info["header_abi_version"] == str(code["ABI_VERSION"]), (
        f"{shown}: fa_abi_version {info['abi_version']}, library.h says {code['ABI_VERSION']}")
    decoding = chapter in DECODE_CHAPTERS
    for what, value in (("chapter_name", facts["name"]), ("precision", code[facts["precision"]]),
                        ("has_backward", int(backward)), ("has_decode", int(decoding)), ("min_sm", facts["min_sm"]),
                        ("max_sm", facts["max_sm"]), ("first_error", "")):
        assert info[what] == str(value), f"{shown}: fa_{what} {info[what]!r}, the chapter says {value!r}"
    for b, h, n, d in PROBE_SHAPES:
        forward = WORKSPACE[int(chapter[:2])](b, h, n, d)
        assert info[f"workspace {b} {h} {n} {d}"] == f"0 {forward}", (
            f"{shown}: fa_workspace_bytes of B={b} H={h} N={n} D={d}: {info[f'workspace {b} {h} {n} {d}']} "
            f"(code, bytes), expected 0 {forward}")
        for mode, deterministic in (("backward_workspace", False), ("deterministic_backward_workspace", True)):
            grad = (f"0 {backward_workspace(b, h, n, d, deterministic, chapter)}" if backward
                    else f"{code['ERR_NO_BACKWARD']} 0")
            assert info[f"{mode} {b} {h} {n} {d}"] == grad, (
                f"{shown}: fa_backward_workspace_bytes of B={b} H={h} N={n} D={d}, deterministic "
                f"{int(deterministic)}: {info[f'{mode} {b} {h} {n} {d}']} (code, bytes), expected {grad}")

    for max_length in (1, 300, 512):
        need = f"0 {decode_workspace(2, 8, 1, 64, max_length)}" if decoding else f"{code['ERR_NO_DECODE']} 0"
        assert info[f"decode_workspace {max_length}"] == need, (
            f"{shown}: fa_decode_workspace_bytes at max_length {max_length}: {info[f'decode_workspace {max_length}']} "
            f"(code, bytes), expected {need}")

    want = expected_cases(repo, chapter)
    assert set(cases) == set(want), (f"{shown}: the probe's cases differ from the test's: "
                                     f"{sorted(set(cases) ^ set(want))}")
    wrong = []
    for label, (name, patterns) in want.items():
        got, message = cases[label]
        prefix = f"{facts['name']}: {FUNCTION_OF[label.split(':')[0]]}: "
        missing = [p for p in patterns if not re.search(p, message)]
        if got != code[name] or missing or not message.startswith(prefix):
            wrong.append(f"{label}: code {got} (expected FA_{name} = {code[name]}), message {message!r}"
                         + (f" does not match {missing}" if missing else "")
                         + ("" if message.startswith(prefix) else f" does not start {prefix!r}"))
    assert not wrong, f"{shown}: {len(wrong)} calls answered wrongly:\n" + "\n".join(wrong)
    assert info["other_thread_error"] == "", (
        f"{shown}: fa_last_error in another thread is {info['other_thread_error']!r}: it should be per thread")

    if not hide_gpus:
        return
    # The shape rules are the command line's: the binary says the same words.
    binary = repo.require_binary(chapter)
    for label, args in CLI_OF.items():
        cli = repo.run([binary, *args, "--dry-run"], env=NO_GPU_ENV, timeout=60)
        said = cases[f"forward: {label}"][1].split(": ", 2)[2]
        assert cli.returncode == 2 and cli.stderr.strip() == f"{facts['name']}: {said}", (
            f"{chapter} {' '.join(args)}: the command line says {cli.stderr.strip()!r} (exit {cli.returncode}), "
            f"the library {said!r}: one set of rules (common/shape.h) should give one message")
