"""The build folder that `make all lib` made (make test makes it before pytest runs).

Every build of `make all` (the chapters, 08's steps) is there, compiled
without a compiler warning for the archs the build targets (its .flags: the GPU's own, or sm_80,
sm_89 and sm_90 where there is none; 08 and its steps for sm_90a alone, whatever ARCH): the ptxas
log of its object, BUILD/<build>.log, holds a report for each of these archs and for no other.
The harness is compiled once per build folder and linked into every executable, and right after
the build make has nothing left to do. A chapter README's table of register counts is what ptxas
reported. Nothing here writes to the build folder (other tests read it meanwhile)."""
import re
import shlex
from pathlib import Path

import pytest

import runner
from helpers import CHAPTERS, STEP_BUILDS

# What `make all` makes (the Makefile's BUILDS; test_every_build_of_make_all_is_listed holds it to that): one
# build a chapter or step, whatever modes its binary runs in (09's --deterministic is a flag, not a build).
BUILDS = [*CHAPTERS, *(build for _, build, _ in STEP_BUILDS)]
ARCHS_OF = {"08_fp8": ["sm_90a"], "10_backward_hopper": ["sm_90a"]}  # by source chapter: the archs it builds for instead of the build's (wgmma)
HARNESS = ["harness", "npy"]  # common/harness.cu and common/npy.c: BUILD/common/<name>.o
ENTRY = re.compile(r"Compiling entry function '[^']+' for '(sm_\w+)'")


def make(repo, *args, timeout=300):
    """make ARGS in the checkout (the jobserver of a make test that started pytest dropped)."""
    return repo.run(shlex.split(repo.make) + ["--no-print-directory", *args], env=runner.make_env(), timeout=timeout)


def build_flags(repo):
    """BUILD/.flags (the compile line the build was made with), or a skip when there is none."""
    path = repo.build / ".flags"
    if not path.is_file():
        pytest.skip(f"{repo.rel(path)} is missing: run make all lib first (make test does)")
    return path.read_text()


def target_archs(flags):
    """The real archs a compile line builds code for (its -gencode ...,code=sm_XX)."""
    return re.findall(r"-gencode=arch=compute_\w+,code=(sm_\w+)", flags)


def make_arch(flags):
    """The ARCH= that gives these flags: multi for several archs, else the one."""
    archs = target_archs(flags)
    return "multi" if len(archs) > 1 else archs[0]


def test_chapters_found():
    assert CHAPTERS, "no chapter directories NN_name/attention.cu found"
    assert CHAPTERS[0].startswith("01_"), f"the first chapter is {CHAPTERS[0]}, expected 01_naive"


@pytest.mark.parametrize("build", BUILDS)
def test_build_is_there_without_warnings(repo, build):
    """BUILD/<build> is there, not older than its source, and its ptxas log holds no warning and a report
    for each arch the build targets (sm_90a alone for 08's builds), none for another."""
    binary, log = repo.binary(build), repo.build / f"{build}.log"
    assert binary.is_file(), f"{repo.rel(binary)} is missing: `make all` builds it (make test runs make all lib first)"
    assert log.is_file(), f"{repo.rel(log)} is missing: the Makefile writes the compile's nvcc/ptxas output there"
    text = log.read_text(errors="replace")
    warnings = [line for line in text.splitlines() if "warning" in line.lower()]
    assert not warnings, f"{repo.rel(log)}: {len(warnings)} compiler warning lines:\n" + "\n".join(warnings[:20])
    chapter = build.split(".")[0]
    archs = ARCHS_OF.get(chapter) or target_archs(build_flags(repo))
    for arch in archs:
        assert re.search(rf"Compiling entry function '[^']+' for '{arch}'", text), (
            f"{repo.rel(log)}: no ptxas report for {arch}: the build should target {', '.join(archs)}")
    built = set(ENTRY.findall(text))
    assert built <= set(archs), f"{repo.rel(log)}: ptxas compiled for {sorted(built)}, expected only {archs}"
    source = build_source(repo, build)
    assert binary.stat().st_mtime >= source.stat().st_mtime, (
        f"{repo.rel(binary)} is older than {repo.rel(source)}: stale build")


def build_source(repo, build):
    """The file a build compiles: a step's stepK_<idea>.cu (08_fp8.step3), else its attention.cu."""
    chapter, _, step = build.partition(".step")
    if not step:
        return repo.root / chapter / "attention.cu"
    found = sorted((repo.root / chapter).glob(f"step{step}_*.cu"))
    assert len(found) == 1, f"{build}: expected one {chapter}/step{step}_*.cu, found {[repo.rel(p) for p in found]}"
    return found[0]


def dry_run(repo, folder):
    """What `make -n all lib` would run to make every build into an empty folder: its lines."""
    proc = make(repo, "-n", f"BUILD={folder}", "all", "lib")
    assert proc.returncode == 0, f"make -n BUILD={folder} all lib: exit {proc.returncode}: {proc.stderr.strip()[-500:]}"
    return proc.stdout.splitlines()


def test_every_build_of_make_all_is_listed(repo, tmp_path):
    """The executables `make all` links are BUILDS, the list the tests here check."""
    folder = tmp_path / "build"
    linked = [m.group(1) for line in dry_run(repo, folder)
              for m in [re.search(rf" -o {re.escape(str(folder))}/([\w.]+) {re.escape(str(folder))}/obj/", line)] if m]
    assert sorted(linked) == sorted(BUILDS), f"make all links {sorted(linked)}; the tests check {sorted(BUILDS)}"


def test_harness_compiled_once(repo, tmp_path):
    """harness.cu and npy.c are compiled once per build folder (BUILD/common/*.o) and linked into
    every executable: in the build folder, and in what make would run for an empty one."""
    missing = [repo.rel(repo.build / "common" / f"{name}.o") for name in HARNESS
               if not (repo.build / "common" / f"{name}.o").is_file()]
    assert not missing, f"{missing} missing: the Makefile should compile the harness once into BUILD/common"
    folder = tmp_path / "build"
    lines = dry_run(repo, folder)
    links = [line for line in lines if re.search(rf" -o {re.escape(str(folder))}/[\w.]+ {re.escape(str(folder))}/obj/",
                                                 line)]
    assert links, "make -n all: no executable linked from BUILD/obj"
    for name in HARNESS:
        objects = [line for line in lines if " -c " in line and f"/{name}.o " in line]
        assert len(objects) == 1 and f"-o {folder}/common/{name}.o " in objects[0], (
            f"make all compiles {name}.o {len(objects)} times, expected once, into BUILD/common:\n"
            + "\n".join(objects))
        unlinked = [line.split(" -o ")[1].split()[0] for line in links if f"{folder}/common/{name}.o" not in line]
        assert not unlinked, f"{unlinked} not linked with BUILD/common/{name}.o"


def test_make_has_nothing_left_to_do(repo, tmp_path):
    """Right after the build, `make all lib` would do nothing: the flags make would use are the
    build's (BUILD/.flags), and `make -n all lib` lists no command. The dry run takes .flags as
    current (-o): its rule always runs (to compare the flags), so make -n would list every compile."""
    flags = build_flags(repo)
    fresh = tmp_path / "flags"
    proc = make(repo, f"BUILD={fresh}", f"ARCH={make_arch(flags)}", f"{fresh}/.flags")
    assert proc.returncode == 0, f"make {fresh}/.flags failed: {proc.stderr.strip()}"
    now = (fresh / ".flags").read_text()
    assert now == flags, (f"make would compile with other flags than the build's ({repo.rel(repo.build)}/.flags): "
                          f"make all lib would compile everything again:\n  build: {flags.strip()}\n"
                          f"  now:   {now.strip()}")
    dry = make(repo, "-n", f"BUILD={repo.build}", f"ARCH={make_arch(flags)}", "-o", repo.build / ".flags", "all", "lib")
    todo = [line for line in dry.stdout.splitlines() if not re.match(r"make(\[\d+\])?: Nothing to be done for", line)]
    assert dry.returncode == 0 and not todo, (
        f"make -n all lib right after the build: exit {dry.returncode}, would run:\n" + "\n".join(todo[:20])
        + dry.stderr.strip()[-500:])


def ptxas_registers(log_text):
    """{(kernel base name, head dim, arch, deterministic): registers} from a ptxas -v report; deterministic:
    the kernel's instance with its last template argument, `bool DETERMINISTIC`, true (09's: ...ELb1EEv...)."""
    out, current = {}, None
    for line in log_text.splitlines():
        entry = re.search(r"Compiling entry function '_Z\d+(\w+?)ILi(\d+)E(\w*)' for '(sm_\w+)'", line)
        if entry:
            kernel, d, rest, arch = entry.groups()
            current = (kernel, int(d), arch, rest.startswith("Lb1E"))
        used = re.search(r"Used (\d+) registers", line)
        if used and current:
            out[current] = int(used.group(1))
            current = None
    return out


TABLE = "Registers from `ptxas`"
TABLE_CHAPTERS = [c for c in CHAPTERS if TABLE in (Path(runner.ROOT) / c / "README.md").read_text()]
TABLE_COLUMNS = [("sm_80", 64), ("sm_80", 128), ("sm_90", 64), ("sm_90", 128)]  # the table's value columns
TABLE_ROW = re.compile(r"^\| (deterministic: )?[^`|]*`(\w+)`[^|]*\| ([-\d]+) / ([-\d]+) \| ([-\d]+) / ([-\d]+) \|$",
                       re.M)


@pytest.mark.parametrize("chapter", TABLE_CHAPTERS)
def test_register_table_is_ptxas(repo, chapter):
    """The "Registers from `ptxas`" table of a chapter README (09's) holds what the build's ptxas
    reported, per kernel, head dim and arch (its sm_80 and sm_90 columns, those the build targets); a row
    that starts "deterministic:" is the kernel's deterministic instance."""
    text = (repo.root / chapter / "README.md").read_text()
    at = text.find(TABLE)
    log = repo.build / f"{chapter}.log"
    if not log.is_file():
        pytest.skip(f"{repo.rel(log)} not built")
    # 09's forward, flash_attention_kernel, is compiled once for 09, 10 and 11 (the Makefile's forward.o)
    forward = repo.build / "common/forward.o.log"
    report = ptxas_registers(log.read_text(errors="replace") + (forward.read_text(errors="replace")
                                                                if forward.is_file() else ""))
    archs = set(target_archs(build_flags(repo)))
    columns = [(i, column) for i, column in enumerate(TABLE_COLUMNS) if column[0] in archs]
    if not columns:
        pytest.skip(f"the build targets {sorted(archs)}, the table gives sm_80 and sm_90")
    rows = TABLE_ROW.findall(text[at:text.find("\n\n", text.find("|", at))])
    assert rows, f"{chapter}/README.md: no rows under its 'Registers from `ptxas`' table"
    wrong, checked = [], 0
    for mode, kernel, *values in rows:
        for i, (arch, d) in columns:
            said, got = values[i], report.get((kernel, d, arch, bool(mode)))
            if said != "-" and got != int(said) or said == "-" and got is not None:
                wrong.append(f"{mode}{kernel} D={d} {arch}: the table says {said}, ptxas {got}")
            checked += said != "-"
    assert not wrong, f"{chapter}/README.md's register table against ptxas: " + "; ".join(wrong)
    assert checked, f"{chapter}/README.md's register table: no count checked"
