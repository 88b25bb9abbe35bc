"""Every chapter builds for sm_80, sm_89 and sm_90 (the runner's `make ARCH=multi` into
BUILD/multiarch) without a compiler warning: its binary is there and its nvcc/ptxas log
(BUILD/multiarch/NN_name.log) holds no 'warning' and a ptxas report for each of the archs.
Chapters on Hopper's arch-specific features (wgmma: 08) build for sm_90a alone, whatever ARCH."""
import re
import unittest

ARCHS = ["sm_80", "sm_89", "sm_90"]
ARCHS_OF = {8: ["sm_90a"]}  # by chapter number: the archs it builds for instead of ARCHS
ALONE = True  # test_harness_compiled_once relinks BUILD/multiarch/01_naive, which other modules run


def build_case(chapter):
    def case(ctx):
        binary = ctx.binary(chapter)
        log = binary.parent / f"{chapter}.log"
        failed = ctx.build_failed.get("build::multiarch")
        assert binary.is_file(), (
            f"{ctx.rel(binary)} is missing: the multiarch build "
            + ("failed (see build::multiarch)" if failed else "did not produce it (run without --no-build)"))
        assert log.is_file(), f"{ctx.rel(log)} is missing: the Makefile writes nvcc's output there"
        text = log.read_text(errors="replace")
        warnings = [line for line in text.splitlines() if "warning" in line.lower()]
        assert not warnings, f"{ctx.rel(log)}: {len(warnings)} compiler warning lines:\n" + "\n".join(warnings[:20])
        archs = ARCHS_OF.get(ctx.chapter_number(chapter), ARCHS)
        for arch in archs:
            assert re.search(rf"Compiling entry function '[^']+' for '{arch}'", text), (
                f"{ctx.rel(log)}: no ptxas report for {arch}: the multiarch build should target "
                f"{', '.join(archs)}")
        built = set(re.findall(r"Compiling entry function '[^']+' for '(sm_\w+)'", text))
        assert built <= set(archs), f"{ctx.rel(log)}: ptxas compiled for {sorted(built)}, expected only {archs}"
        assert binary.stat().st_mtime >= (ctx.root / chapter / "attention.cu").stat().st_mtime, (
            f"{ctx.rel(binary)} is older than {chapter}/attention.cu: stale build")
    return case


def cases(ctx):
    return [(f"multiarch_build[{chapter}]", build_case(chapter)) for chapter in ctx.chapters]


def test_chapters_found(ctx):
    assert ctx.chapters, "no chapter directories NN_name/attention.cu found"
    assert ctx.chapters[0].startswith("01_"), f"the first chapter is {ctx.chapters[0]}, expected 01_naive"


def test_harness_compiled_once(ctx):
    """harness.cu and npy.c are compiled once per build folder and linked into every chapter:
    rebuilding a chapter (make -W: as if its source had changed) leaves their objects alone."""
    import shlex
    objects = [ctx.multiarch / "common" / f"{name}.o" for name in ("harness", "npy")]
    missing = [ctx.rel(o) for o in objects if not o.is_file()]
    assert not missing, f"{missing} missing: the Makefile should compile the harness once into BUILD/common"
    chapter = ctx.chapters[0]
    binary = ctx.binary(chapter)
    before = [o.stat().st_mtime_ns for o in objects] + [binary.stat().st_mtime_ns]
    proc = ctx.run(shlex.split(ctx.make) + [f"BUILD={ctx.rel(ctx.multiarch)}", "ARCH=multi",
                                            "-W", f"{chapter}/attention.cu", ctx.rel(binary)], timeout=600)
    assert proc.returncode == 0, f"rebuilding {chapter} failed: {proc.stdout}{proc.stderr}"
    after = [o.stat().st_mtime_ns for o in objects] + [binary.stat().st_mtime_ns]
    assert after[:2] == before[:2], f"rebuilding {chapter} recompiled the harness:\n{proc.stdout}"
    assert after[2] != before[2], f"make -W {chapter}/attention.cu did not rebuild {ctx.rel(binary)}"


def ptxas_registers(log_text):
    """{(kernel base name, head dim, arch): registers} from a ptxas -v report."""
    out, current = {}, None
    for line in log_text.splitlines():
        entry = re.search(r"Compiling entry function '_Z\d+(\w+?)ILi(\d+)E\w*' for '(sm_\w+)'", line)
        if entry:
            current = entry.groups()
        used = re.search(r"Used (\d+) registers", line)
        if used and current:
            out[(current[0], int(current[1]), current[2])] = int(used.group(1))
            current = None
    return out


def test_register_table_is_ptxas(ctx):
    """The "Registers from `ptxas`" table of a chapter README (09's) holds what the multiarch
    build's ptxas reported, per kernel, head dim and arch (sm_80 and sm_90 columns); rows
    "with `-DDETERMINISTIC_DQ=1`" against the .deterministic build's report."""
    checked = 0
    for chapter in ctx.chapters:
        text = (ctx.root / chapter / "README.md").read_text()
        at = text.find("Registers from `ptxas`")
        if at < 0:
            continue
        logs = {}
        for variant in ("", ".deterministic"):
            log = ctx.multiarch / f"{chapter}{variant}.log"
            if not log.is_file():
                continue
            logs[variant] = ptxas_registers(log.read_text(errors="replace"))
        if not logs:
            raise unittest.SkipTest(f"{ctx.rel(ctx.multiarch)}/{chapter}.log not built")
        rows = re.findall(r"^\| (with `-DDETERMINISTIC_DQ=1`: )?[^`|]*`(\w+)`[^|]*\| ([-\d]+) / ([-\d]+) \| ([-\d]+) / ([-\d]+) \|$",
                          text[at:text.find("\n\n", text.find("|", at))], re.M)
        assert rows, f"{chapter}/README.md: no rows under its 'Registers from `ptxas`' table"
        wrong = []
        for det, kernel, *values in rows:
            report = logs.get(".deterministic" if det else "")
            if report is None:
                continue
            for (arch, d), said in zip([("sm_80", 64), ("sm_80", 128), ("sm_90", 64), ("sm_90", 128)], values):
                got = report.get((kernel, d, arch))
                if said != "-" and got != int(said) or said == "-" and got is not None:
                    wrong.append(f"{det}{kernel} D={d} {arch}: the table says {said}, ptxas {got}")
                checked += said != "-"
        assert not wrong, f"{chapter}/README.md's register table against ptxas: " + "; ".join(wrong)
    if not checked:
        raise unittest.SkipTest("no chapter README has a 'Registers from `ptxas`' table")
    return f"{checked} register counts, as ptxas reported them"
