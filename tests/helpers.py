"""What several test modules share: the chapters' promises (their scratch memory, which has a
backward pass), stand-in binaries, compiling a source as the Makefile does, and running make in a
copy of the checkout. Tests import it as `helpers` (conftest.py puts tests/ on sys.path)."""
import math
import os
import re
import shlex
import shutil
import sys
import unittest

import numpy as np

import runner
from chapters import read_steps
from claims import strip_comments
from reference import FP8_KV_ROWS, FP8_Q_ROWS, FP8_QK_RANGE, quantize_e4m3

CHAPTERS = runner.chapters()  # NN_name of every chapter, in order: what tests parametrize over

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
    9: lambda b, h, n, d: 0,  # the forward is 07's; the backward's workspace is Backward.workspace_bytes
    10: lambda b, h, n, d: 0,  # the same
    11: lambda b, h, n, d: 0,  # the same (07's forward: the prompt)
}


def has_backward(repo, chapter):
    """Whether a chapter registers a backward pass (a `Backward` in its code, comments left out)."""
    return re.search(r"\bBackward\b", strip_comments((repo.root / chapter / "attention.cu").read_text())) is not None


def shape_args(b, h, n, d, causal):
    return ["--batch", str(b), "--heads", str(h), "--seqlen", str(n), "--headdim", str(d)] + \
        (["--causal"] if causal else [])


# --- compiling as the Makefile does ------------------------------------------------------------------
SASS_ARCH_FLAG = "-gencode=arch=compute_90,code=sm_90"
ARCH_FLAG_OF = {"08": "-gencode=arch=compute_90a,code=sm_90a"}  # wgmma: sm_90a only, as the Makefile builds it


def nvcc_flags(repo):
    """The Makefile's compile line for ARCH=sm_90 (its BUILD/.flags), as a list, without -gencode."""
    def read():
        build = repo.tmpdir() / "flags"
        proc = repo.run(shlex.split(repo.make) + ["--no-print-directory", f"BUILD={build}", "ARCH=sm_90",
                                                  f"{build}/.flags"], timeout=120)
        assert proc.returncode == 0, f"make {build}/.flags failed: {proc.stderr.strip()}"
        words = shlex.split((build / ".flags").read_text())
        return [w for w in words if not w.startswith("-gencode")]
    return repo.once("nvcc_flags", read)


def compile_quietly(repo, source, out, extra=()):
    """nvcc with the Makefile's flags for sm_90 (08: sm_90a); asserts success and no warning."""
    arch = ARCH_FLAG_OF.get(source.parent.name[:2], SASS_ARCH_FLAG)
    proc = repo.run(nvcc_flags(repo) + [arch, *extra, "-o", out, source], timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{repo.rel(source)} does not compile:\n{log.strip()[-3000:]}"
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not warnings, f"{repo.rel(source)}: compiler warnings:\n" + "\n".join(warnings[:20])


# --- a stand-in for a chapter binary ------------------------------------------------------------------
# Prints the harness's --csv row for the shape it is given (ms, attend_ms and the status as asked; ms
# deterministic_ms with --deterministic), or fails as an EXERCISE_TODO stub does; `log` records each
# command line.
FAKE = """#!{python} -IS
import sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
if {log!r}:
    with open({log!r}, "a") as f:
        f.write(" ".join(args) + "\\n")
if {todo}:
    sys.stderr.write("04_fused: TODO: exercise 04.online_softmax is not written yet (its EXERCISE_TODO stub ran)\\n")
    sys.exit(1)
print("04_fused,%s,%s,%s,%s,%d,fp16,%s,1.0,2.1e-04,{status},5.7e-05,1.2e-06,1,0,,{attend_ms},," % (
    value("--batch"), value("--heads"), value("--seqlen"), value("--headdim"), "--causal" in args,
    {deterministic_ms} if "--deterministic" in args else {ms}))
if "{status}" == "FAIL":
    sys.stderr.write("04_fused: rel_l2 2.1e-04 is above the tolerance\\n")
    sys.exit(1)
"""


def fake_binary(folder, ms, todo=False, attend_ms="", status="PASS", log="", deterministic_ms=None):
    """A stand-in for build/04_fused in folder (see FAKE); its path."""
    path = folder / "04_fused"
    path.write_text(FAKE.format(python=sys.executable, ms=ms, todo=todo, attend_ms=attend_ms, status=status, log=log,
                                deterministic_ms=ms if deterministic_ms is None else deterministic_ms))
    path.chmod(0o755)
    return str(path)


def write_tree(folder, files):
    """files {relative path: NN_name/attention.cu text} under folder, with a common/ link beside each
    chapter folder (its #include "../common/harness.h") and, in it, a link to each of the chapter's own
    headers (08_fp8/hopper.h); folder."""
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
        link = (folder / rel).parent.parent / "common"
        if not os.path.lexists(link):
            os.symlink(os.path.join(runner.ROOT, "common"), link)
        chapter = os.path.join(runner.ROOT, (folder / rel).parent.name)
        for header in (h for h in (os.listdir(chapter) if os.path.isdir(chapter) else []) if h.endswith(".h")):
            if not os.path.lexists(folder / rel / ".." / header):
                os.symlink(os.path.join(chapter, header), (folder / rel).parent / header)
    return folder


# --- make in a copy of the checkout ---------------------------------------------------------------------
def repo_copy(repo, folder):
    """The checkout's files (tracked and new, as they are on disk; no exercises/) copied into folder/repo."""
    listed = repo.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], timeout=60)
    if listed.returncode != 0:
        raise unittest.SkipTest(f"git ls-files failed: {listed.stderr.strip()}")
    copy = folder / "repo"
    for rel in filter(None, listed.stdout.split("\0")):
        source = repo.root / rel
        if source.is_file() and not rel.startswith("exercises/"):
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / rel)
    return copy


def make_in(repo, copy, *args, hide_gpu=True, timeout=900):
    """make ARGS in a checkout copy (BUILD=build), the GPUs hidden unless hide_gpu is False; the
    fetched tools (.cache/tools) on PATH."""
    env = {"PATH": f"{repo.root / '.cache' / 'tools'}{os.pathsep}{os.environ.get('PATH', '')}"}
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return repo.run(shlex.split(repo.make) + ["--no-print-directory", f"PYTHON_SYS={sys.executable}",
                                              "BUILD=build", *args], env=env, cwd=copy, timeout=timeout)


# --- the GPU tests' rules and float64 formulas (test_gpu, test_sanitize, test_torch_op_gpu) --------------
# By chapter number: relative L2 error of O (fp32 math, fp16 tensor cores); FP8 (08) below.
REL_L2_TOL = {1: 1e-3, 2: 1e-3, 3: 1e-3, 4: 1e-3, 5: 1e-3, 6: 3e-3, 7: 3e-3, 9: 3e-3, 10: 3e-3, 11: 3e-3}
LSE_TOL = 1e-3
FP8 = {8}                 # tolerance: FP8_FLOOR_FACTOR x the e4m3 floor + the fp16 chapters' bound
FP8_FLOOR_FACTOR = 1.5
BACKWARD_TOL = 1e-3       # each gradient's rel L2 (common/harness.cu's BACKWARD_REL_L2_TOL)
# The step files of the chapters built in steps (08_fp8/stepK_*.cu: BUILD/08_fp8.stepK; the last step
# is the chapter's attention.cu, in CHAPTERS): (step, build, dtype), e.g. ("08.4", "08_fp8.step4", "fp8").
STEP_BUILDS = [(s["name"], f"{c}.step{s['step']}", "fp8" if s["precision"] == "PRECISION_FP8_TC" else "fp16")
               for c in CHAPTERS for s in read_steps(os.path.join(runner.ROOT, c, "attention.cu"))[:-1]]
BACKWARD_CHAPTERS = [c for c in CHAPTERS if re.search(r"\bBackward\b", strip_comments(
    open(os.path.join(runner.ROOT, c, "attention.cu")).read()))]
DECODE_CHAPTERS = [c for c in CHAPTERS if re.search(r"\bDecode\b", strip_comments(
    open(os.path.join(runner.ROOT, c, "attention.cu")).read()))]
# (B, H, N, D, causal) where --output's gradients are checked against float64 and PyTorch's error
BACKWARD_OUTPUT_SHAPES = [(2, 3, 200, 64, True), (1, 2, 129, 128, False), (1, 4, 1024, 128, True)]


def scores64(q, k, causal, scale):
    """float64 S = Q K^T * scale, -inf above the diagonal when causal."""
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) * scale
    if causal:
        n = s.shape[-1]
        s = np.where(np.triu(np.ones((n, n), bool), 1), -np.inf, s)
    return s


def attention64(q, k, v, causal, scale):
    """float64 O and LSE straight from the formula (shifted exp), independent of common/."""
    s = scores64(q, k, causal, scale)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", e, v.astype(np.float64)) / total, (m + np.log(total))[..., 0]


def attention64_grads(q, k, v, do, causal, scale):
    """float64 dQ, dK, dV of L = sum(O * dO), straight from the formula, independent of common/."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    s = scores64(q, k, causal, scale)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", p, v)
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    return (np.einsum("bhij,bhjd->bhid", ds, k) * scale, np.einsum("bhij,bhid->bhjd", ds, q) * scale,
            np.einsum("bhij,bhid->bhjd", p, do))


def fp8_floor_attention(q, k, v, causal, d):
    """float64 O and LSE of exact attention on Q, K, V quantised as the FP8 chapter quantises them
    (scales per tile, Q and K to its range): the FP8 check's floor."""
    kv_rows, qk_range = FP8_KV_ROWS[d], FP8_QK_RANGE[d]
    quantized = (quantize_e4m3(x, rows, to) for x, rows, to in
                 ((q, FP8_Q_ROWS, qk_range), (k, kv_rows, qk_range), (v, kv_rows, 448.0)))
    return attention64(*quantized, causal, 1 / math.sqrt(d))


def torch_flash():
    """(torch, a function running PyTorch's SDPA on its flash backend), or None without PyTorch or
    a CUDA device for it."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def attend(q, k, v, causal):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return torch, attend


def torch_fp16_error(q, k, v, causal, want_o):
    """Max abs error of PyTorch's fp16 flash attention against float64 on the same inputs; None
    without PyTorch or a CUDA device for it."""
    if not (found := torch_flash()):
        return None
    torch, attend = found
    o = attend(*(torch.from_numpy(x).cuda() for x in (q, k, v)), causal)
    return float(np.abs(o.float().cpu().numpy().astype(np.float64) - want_o).max())


def torch_grad_errors(q, k, v, do, causal, want):
    """Max abs error of each of PyTorch's fp16 flash-attention gradients against float64; None without it."""
    if not (found := torch_flash()):
        return None
    torch, attend = found
    q, k, v = (torch.from_numpy(x).cuda().requires_grad_() for x in (q, k, v))
    o = attend(q, k, v, causal)
    o.backward(torch.from_numpy(do).cuda())
    return [float(np.abs(x.grad.float().cpu().numpy().astype(np.float64) - w).max()) for x, w in zip((q, k, v), want)]
