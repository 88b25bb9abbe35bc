"""The Makefile's reading aids: `make diff`, `make sass` and `make profile` say what is wrong
instead of failing obscurely (chapter numbers as 4, 04 or 04_fused; cuobjdump found or fetched by
common/cuda_tools.py; no GPU or no Nsight Compute named in one line, the skip code 77), and
`make bench` and `make compare` pass BENCH_PASS and QUICK on; the groups `make test` sends to its
workers first are groups that tests carry. make runs on the build folder that make test made, with
its ARCH, so that nothing there is built again."""
import re
import shlex
import shutil

import pytest

import runner
from claims import sass_tools


def build_arch(repo):
    """The ARCH= the build folder was made with, read from its .flags: multi for several archs."""
    path = repo.build / ".flags"
    if not path.is_file():
        pytest.skip(f"{repo.rel(path)} is missing: run make all lib first (make test does)")
    archs = re.findall(r"-gencode=arch=compute_\w+,code=(sm_\w+)", path.read_text())
    return "multi" if len(archs) > 1 else archs[0]


def make(repo, *args, timeout=600):
    """make ARGS on the build folder, with the ARCH it was built for (nothing to rebuild)."""
    return repo.run(shlex.split(repo.make) + ["--no-print-directory", f"BUILD={repo.build}", f"ARCH={build_arch(repo)}",
                                              *args], env=runner.make_env(), timeout=timeout)


@pytest.mark.parametrize("a, b", [("4", "5"), ("04", "05"), ("04_fused", "05_causal")])
def test_diff_takes_chapter_numbers(repo, a, b):
    proc = make(repo, "diff", f"A={a}", f"B={b}")
    assert proc.returncode == 0, f"make diff A={a} B={b}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    assert "--- 04_fused/attention.cu" in proc.stdout and "+++ 05_causal/attention.cu" in proc.stdout, (
        f"make diff A={a} B={b}: expected a diff of 04_fused and 05_causal, got {proc.stdout[:200]!r}")


def test_diff_refuses_a_missing_chapter(repo):
    proc = make(repo, "diff", "A=4", "B=42")
    assert proc.returncode != 0, "make diff B=42: expected a failure, got exit 0"
    assert "no chapter '42'" in proc.stderr and "04_fused" in proc.stderr, (
        f"make diff B=42 should name the missing chapter and list the others: {proc.stderr.strip()!r}")
    assert "usage" not in proc.stderr.lower(), f"diff's own usage error leaked out: {proc.stderr.strip()!r}"


def test_sass_finds_cuobjdump(repo):
    """make sass finds cuobjdump and nvdisasm (PATH, beside nvcc, .cache/tools) or fetches them
    (common/cuda_tools.py path); skipped where neither works here either."""
    sass_tools(repo)
    proc = make(repo, "sass", "CH=7")
    assert proc.returncode == 0, f"make sass CH=7: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
    assert "HMMA" in proc.stdout, "make sass CH=7: no HMMA in the SASS of 07"


def test_profile_without_gpu_or_ncu_says_so(repo, gpu_state):
    """Without Nsight Compute, or without a GPU the chapter runs on, make profile prints one line,
    "make profile: skipped: <why>", and its recipe exits 77, the skip code (make reports it as
    "Error 77" and exits 2, as make does on any failed recipe)."""
    have_ncu = shutil.which("ncu") is not None
    usable, why = gpu_state
    if have_ncu and usable:
        pytest.skip("this machine has a GPU and Nsight Compute: make profile would run")
    proc = make(repo, "profile", "CH=07")
    lines = proc.stdout.strip().splitlines()
    want = "Nsight Compute (ncu) not found" if not have_ncu else why
    assert len(lines) == 1 and lines[0].startswith("make profile: skipped: ") and want in lines[0], (
        f"make profile should say in one line 'make profile: skipped: ...{want}...': {proc.stdout!r}")
    assert proc.returncode == 2 and re.search(r"\] Error 77$", proc.stderr, re.M), (
        f"make profile: exit {proc.returncode}, stderr {proc.stderr.strip()!r}; expected its recipe's exit 77 "
        f"(make: '... Error 77', exit 2)")


BENCH_ARGS = [((), "--pass both "), (("BENCH_PASS=backward", "QUICK=1"), "--pass backward --quick "),
              (("BENCH_PASS=forward", "QUICK=0"), "--pass forward "),
              (("BENCH_PASS=forward", "HEADDIM=64"), "--pass forward --headdim 64 "),
              (("BENCH_PASS=backward", "SEQLENS=512,8192", "HEADDIM=128"),
               "--pass backward --seqlens 512,8192 --headdim 128 ")]  # make bench's variables -> stages.py's options
BENCH_IDS = ["default", "backward-quick", "forward", "one-headdim", "some-seqlens"]


@pytest.mark.parametrize("args, want", BENCH_ARGS, ids=BENCH_IDS)
def test_bench_passes_and_quick(repo, args, want):
    """make bench runs both passes; BENCH_PASS=backward the backward's alone, QUICK=1 only N = 1k and 4k,
    HEADDIM=64 only D = 64, SEQLENS=512,8192 only those N (make -n: what it would run)."""
    proc = make(repo, "-n", "bench", *args)
    line = next((l for l in proc.stdout.splitlines() if "common/stages.py bench" in l), "")
    assert proc.returncode == 0 and want in line and "09_backward" in line, \
        f"make -n bench {' '.join(args)}: expected `{want.strip()}` in {line!r} ({proc.stderr.strip()[-200:]})"


def test_compare_takes_bench_pass(repo):
    proc = make(repo, "-n", "compare", "BENCH_PASS=backward")
    assert "common/stages.py compare" in proc.stdout and "--pass backward" in proc.stdout, proc.stdout[-300:]


# What the targets that need a GPU (or PyTorch) print where they cannot run, and its first words:
# (make's arguments, the start of the one line that says why).
SKIPPING_TARGETS = [(("run",), "make run: skipped: "), (("bench",), "make bench: skipped: "),
                    (("sanitize",), "make sanitize: skipped: "), (("ablation", "CH=7"), "make ablation CH=7: skipped: "),
                    (("peaks",), "peaks: skipped: "), (("compare",), "make compare: skipped: "),
                    (("train", "CH=07"), "make train: skipped: "), (("generate",), "make generate: skipped: ")]


@pytest.mark.parametrize("args, line", SKIPPING_TARGETS, ids=[" ".join(a) for a, _ in SKIPPING_TARGETS])
def test_a_target_that_cannot_run_here_says_why_once_and_exits_77(repo, args, line):
    """With every GPU hidden (CUDA_VISIBLE_DEVICES=, so that this holds on a GPU machine too), each
    target that needs one builds what it needs (nothing here: the build is current, but peaks), then
    says in one line why it skips, naming the chapter it was asked for, and its recipe exits 77 (make
    itself reports that as "Error 77" and exits 2, as it does for any recipe that fails)."""
    proc = repo.run(shlex.split(repo.make) + ["--no-print-directory", f"BUILD={repo.build}", f"ARCH={build_arch(repo)}",
                                              *args], env={**runner.make_env(), "CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    said = [l for l in proc.stdout.strip().splitlines() if not l.startswith("nvcc ")]
    shown = f"make {' '.join(args)} without a GPU"
    assert len(said) == 1 and said[0].startswith(line), f"{shown}: expected one line '{line}<why>', got {proc.stdout!r}"
    assert proc.returncode == 2 and re.search(r"\] Error 77$", proc.stderr, re.M), (
        f"{shown}: exit {proc.returncode}, stderr {proc.stderr.strip()!r}; expected its recipe's exit 77 "
        f"(make: '... Error 77', exit 2)")


def test_the_groups_make_test_sends_first_are_groups_of_tests(repo):
    """conftest.SENT_FIRST names xdist groups that tests carry (a literal name, or an f-string's pattern):
    a group renamed in a test module would otherwise drop out of it silently, and the suite's wall time
    on a GPU would grow past its limit again."""
    import conftest
    patterns = set()
    for path in (repo.root / "tests").glob("test_*.py"):
        for prefix, name in re.findall(r'xdist_group\((f?)"([^"]+)"\)', path.read_text()):
            patterns.add(re.sub(r"\\\{[^}]*\\\}", ".+", re.escape(name)) if prefix else re.escape(name))
    missing = [g for g in conftest.SENT_FIRST if not any(re.fullmatch(p, g) for p in patterns)]
    assert not missing, f"conftest.SENT_FIRST names groups no test carries: {missing}"
