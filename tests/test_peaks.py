"""`make peaks` (tools/peaks.cu) measures what it says, checked in the code the compiler made (no
GPU needed): built by the Makefile's rule for ARCH=sm_90 (sm_90a code, no compiler warnings),
each of its kernels holds the instruction whose rate it reports: FFMA in the fp32 kernel, HMMA in
the mma.sync one, HGMMA (fp16) and QGMMA (e4m3) in the two wgmma ones, which ptxas did not
serialise. Without a GPU the program says so in one line and exits 77. SASS from cuobjdump, found
or fetched as common/claims.py does (skipped with the reason when neither works). The tests share
one build (an xdist group)."""
import re
import shlex

import pytest

import runner
from claims import kernel_base_name, sass_text

pytestmark = pytest.mark.xdist_group("peaks")

# kernel (function name, template arguments dropped; <FP8> told apart by its mangled name) -> opcodes
PEAK_KERNELS = {
    "ffma_kernel": ["FFMA"],
    "mma_sync_kernel": ["HMMA"],
    "wgmma_kernel<0>": ["HGMMA", "WARPGROUP"],
    "wgmma_kernel<1>": ["QGMMA", "WARPGROUP"],
}
# ptxas's notes that it serialised the wgmmas or fenced them itself: the rate would then not be the
# tensor cores' (C7514 and C7519 in its -v report).
SERIALISED = re.compile(r"\((C7514|C7519)\)[^\n]*")


def build(repo):
    """BUILD/peaks made by `make BUILD=<tmp> ARCH=sm_90 BUILD/peaks` (a folder of its own: the
    build folder is not written), once: the binary, its compiler log and make's output."""
    def make():
        folder = repo.tmpdir()
        target = folder / "peaks"
        proc = repo.run(shlex.split(repo.make) + ["--no-print-directory", f"BUILD={folder}", "ARCH=sm_90", target],
                        env=runner.make_env(), timeout=900)
        assert proc.returncode == 0, f"make {target} failed:\n{proc.stdout}{proc.stderr}"
        log = (folder / "peaks.log").read_text(errors="replace")
        return target, log, proc.stdout
    return repo.once("peaks_build", make)


def test_peaks_builds_for_sm90a_without_warnings(repo):
    binary, log, output = build(repo)
    assert "sm_90a" in output, f"make built tools/peaks.cu for another target than sm_90a:\n{output}"
    archs = set(re.findall(r"Compiling entry function '[^']+' for '(sm_\w+)'", log))
    assert archs == {"sm_90a"}, f"ptxas compiled peaks for {sorted(archs)}, expected sm_90a alone"
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not warnings, f"compiler warnings: {warnings[:5]}"
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert spills and all(s == "0" for s in spills), f"ptxas spill stores in peaks: {spills}"
    serialised = [m.group(0) for m in SERIALISED.finditer(log)]
    assert not serialised, f"ptxas serialised or fenced the wgmmas itself: {serialised[:2]}"


def test_peaks_kernels_hold_their_instructions(repo):
    binary, _, _ = build(repo)
    functions = {}
    for mangled, instructions in sass_text(repo, binary).items():  # opcode counts and wgmma shapes per kernel
        fp8 = re.search(r"ILi(\d)E", mangled)
        current = functions.setdefault(kernel_base_name(mangled) + (f"<{fp8.group(1)}>" if fp8 else ""), {})
        for text in instructions:
            op = re.match(r"(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\S*)", text)
            if op:
                current[op.group(1)] = current.get(op.group(1), 0) + 1
                if op.group(1) in ("HGMMA", "QGMMA"):
                    current.setdefault("shapes", set()).add(op.group(1) + op.group(2))
    for kernel, opcodes in PEAK_KERNELS.items():
        assert kernel in functions, f"no {kernel} in the SASS of {binary}; functions: {sorted(functions)}"
        missing = [op for op in opcodes if not functions[kernel].get(op)]
        assert not missing, f"{kernel} lacks {missing} in its SASS"
    tensor = [op for op in ("HMMA", "HGMMA", "QGMMA") if functions["ffma_kernel"].get(op)]
    assert not tensor, f"ffma_kernel runs tensor-core instructions: {tensor}"
    shapes = functions["wgmma_kernel<0>"]["shapes"] | functions["wgmma_kernel<1>"]["shapes"]
    assert shapes == {"HGMMA.64x256x16.F32", "QGMMA.64x256x32.F32.E4M3.E4M3"}, (
        f"wgmma shapes in the SASS: {sorted(shapes)}")


def test_peaks_without_gpu_exits_77(repo, gpu_state, tmp_path):
    usable, _ = gpu_state
    if usable:
        pytest.skip("a GPU is present: `make peaks` measures it instead")
    binary, _, _ = build(repo)
    proc = repo.run([binary, tmp_path], timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 77 and len(lines) == 1, (
        f"peaks without a GPU: exit {proc.returncode}, output {proc.stdout!r}{proc.stderr!r}; expected 77 and one line")
    assert not list(tmp_path.iterdir()), f"peaks wrote {sorted(p.name for p in tmp_path.iterdir())} without a GPU"


def test_gpu_file_name_is_gpu_slug(repo, tmp_path):
    """common/gpu_files.h's gpu_file_name (the name of peaks_<gpu>.log, as peaks writes it and the harness
    reads it) gives what common/results.py's gpu_slug gives, for real names and for the edge cases (a literal
    '_' beside others, leading ones, nothing left): a C program on the host compiler, skipped without one."""
    import shutil
    import subprocess

    import results
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        pytest.skip("no host C compiler (cc, gcc) to build the check with")
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "A_ B", "_x_", "-a.b-", "", "  "]
    source = tmp_path / "names.c"
    source.write_text(f'#include "{repo.root / "common" / "gpu_files.h"}"\n'
                      "int main(int argc, char **argv) {\n    char name[256];\n"
                      "    for (int i = 1; i < argc; i++) gpu_file_name(argv[i], name, sizeof name), puts(name);\n"
                      "    return 0;\n}\n")
    built = subprocess.run([compiler, "-o", str(tmp_path / "names"), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    got = subprocess.run([str(tmp_path / "names"), *names], capture_output=True, text=True, check=True).stdout
    assert got.splitlines() == [results.gpu_slug(n) for n in names], got
