"""The graded exercises (common/exercises.py, `make exercise`, `make grade`), without a GPU.

  markers        every chapter's EXERCISE markers are well-formed (BEGIN/STUB/END paired, names
                 unique and NN.-prefixed, each in the EXERCISES table and back), 01-07 have a
                 correctness and a speed exercise each, and malformed markers are refused
  restore        each student copy (all exercises, and each one alone) with the chapter's blocks
                 put back is the chapter, byte for byte
  compiles       each of those copies compiles for sm_90 with the chapter's flags (the Makefile's
                 BUILD/.flags line, ARCH=sm_90), without a warning (nvcc -c, in parallel)
  sass           the markers are comments: each chapter with its markers taken out compiles to
                 the same sm_90 SASS, instruction for instruction (cuobjdump, addresses dropped)
  readme         each chapter README states each exercise, its make commands and its gate
  make           in a copy of the repository (the real exercises/ is never touched), with
                 CUDA_VISIBLE_DEVICES= (no GPU): `make exercise` writes the copy and refuses to
                 overwrite an edited one; `make grade` on the untouched copy builds it, names the
                 TODO, prints one line saying the GPU part is skipped and exits non-zero; on the
                 copy with the solution put back it passes the static part and exits 0
  grader         the GPU part's bookkeeping (matrix lines, the TODO message, timing ratios and
                 gates) on stand-in binaries that print the harness's CSV
"""
import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import unittest

import exercises as ex
from test_cpu_claims import sass_tools

PARALLEL = 8
SASS_ARCH_FLAG = "-gencode=arch=compute_90,code=sm_90"
ARCH_FLAG_OF = {"08": "-gencode=arch=compute_90a,code=sm_90a"}  # wgmma: sm_90a only, as the Makefile builds it
EXERCISE_CHAPTERS = range(1, 9)  # 01-08 each have a correctness and a speed exercise


def marked_chapters(ctx):
    return [c for c in ctx.chapters if ex.parse(ex.chapter_source(c, ctx.root), c)]


def variants(ctx, chapter):
    """[(label, only)]: every exercise at once, then each alone."""
    blocks = ex.parse(ex.chapter_source(chapter, ctx.root), chapter)
    return [("all", None)] + [(b["name"], [b["name"]]) for b in blocks]


def nvcc_flags(ctx):
    """The Makefile's compile line for ARCH=sm_90 (BUILD/.flags), as a list, without -gencode."""
    def read():
        build = ctx.tmpdir() / "flags"
        proc = ctx.run(shlex.split(ctx.make) + ["--no-print-directory", f"BUILD={build}", "ARCH=sm_90",
                                                f"{build}/.flags"], timeout=120)
        assert proc.returncode == 0, f"make {build}/.flags failed: {proc.stderr.strip()}"
        words = shlex.split((build / ".flags").read_text())
        return [w for w in words if not w.startswith("-gencode")]
    return ctx.once("exercise_nvcc_flags", read)


def write_tree(ctx, files):
    """files {relative path: NN_name/attention.cu text} in a fresh folder, with a common/ link
    beside each chapter folder (its #include "../common/harness.h"); the folder."""
    folder = ctx.tmpdir()
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
        link = (folder / rel).parent.parent / "common"
        if not os.path.lexists(link):
            os.symlink(ctx.root / "common", link)
    return folder


def compile_quietly(ctx, source, out, extra):
    """nvcc with the chapter's flags for sm_90; asserts success and no warning."""
    cmd = nvcc_flags(ctx) + [ARCH_FLAG_OF.get(source.parent.name[:2], SASS_ARCH_FLAG)] + extra + ["-o", out, source]
    proc = ctx.run(cmd, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{ctx.rel(source)} does not compile:\n{log.strip()[-3000:]}"
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not warnings, f"{ctx.rel(source)}: compiler warnings:\n" + "\n".join(warnings[:20])


# --- markers -------------------------------------------------------------------------------------
def test_markers_well_formed(ctx):
    found = {}
    for chapter in ctx.chapters:
        blocks = ex.parse(ex.chapter_source(chapter, ctx.root), f"{chapter}/attention.cu")
        ex.check_blocks(blocks, chapter)
        for b in blocks:
            assert b["name"] not in found, f"{b['name']} is marked in {found.get(b['name'])} and {chapter}"
            found[b["name"]] = chapter
    orphans = sorted(set(ex.EXERCISES) - set(found))
    assert not orphans, f"EXERCISES has entries no chapter marks: {orphans}"
    for number in EXERCISE_CHAPTERS:
        kinds = {ex.EXERCISES[n]["kind"] for n, c in found.items() if int(c[:2]) == number}
        assert kinds == {"correctness", "speed"}, (
            f"chapter {number:02d} has exercises of kinds {sorted(kinds)}, expected a correctness and a speed one")
    for name, info in ex.EXERCISES.items():
        if info["kind"] == "speed":
            assert info["gate"] > 1 and len(info["shape"]) == 5 and info["stub"], (
                f"{name}: a speed exercise needs a gate above 1, a shape (B, H, N, D, causal) and what makes the stub slow")
    return f"{len(found)} exercises in {len(set(found.values()))} chapters"


BAD_MARKERS = {
    "BEGIN without END": "{\n    // EXERCISE 04.a BEGIN: x\n    y();\n}\n",
    "END without BEGIN": "{\n    y();\n    // EXERCISE END\n}\n",
    "nested": "{\n    // EXERCISE 04.a BEGIN: x\n    // EXERCISE 04.b BEGIN: x\n    // EXERCISE END\n}\n",
    "STUB of another block": "{\n    // EXERCISE 04.a BEGIN: x\n    // EXERCISE 04.b STUB\n    // EXERCISE END\n}\n",
    "stub line not commented": "{\n    // EXERCISE 04.a BEGIN: x\n    y();\n    // EXERCISE 04.a STUB\n"
                               "    z();\n    // EXERCISE END\n}\n",
    "misspelt marker": "{\n    // EXERCISE 04.a BEGINS: x\n    y();\n    // EXERCISE END\n}\n",
}
BAD_BLOCKS = {
    "a name marked twice": "{\n    // EXERCISE 04.a BEGIN: x\n    // EXERCISE END\n"
                           "    // EXERCISE 04.a BEGIN: x\n    // EXERCISE END\n}\n",
    "another chapter's name": "{\n    // EXERCISE 05.a BEGIN: x\n    y();\n    // EXERCISE END\n}\n",
    "not in the table": "{\n    // EXERCISE 04.zz BEGIN: x\n    y();\n    // EXERCISE END\n}\n",
    "a speed exercise without a stub": "{\n    // EXERCISE 04.s BEGIN: x\n    y();\n    // EXERCISE END\n}\n",
    "EXERCISE_TODO at file scope": "// EXERCISE 04.a BEGIN: x\nint y;\n// EXERCISE END\n",
}


def test_malformed_markers_are_refused():
    table = {"04.a": dict(kind="correctness", hint="h"), "04.b": dict(kind="correctness", hint="h"),
             "05.a": dict(kind="correctness", hint="h"), "04.s": dict(kind="speed", hint="h", gate=1.1,
                                                                        shape=(1, 1, 1, 64, False), stub="s")}
    for label, text in list(BAD_MARKERS.items()) + list(BAD_BLOCKS.items()):
        try:
            ex.check_blocks(ex.parse(text, label), "04_fused", table)
        except ex.MarkerError:
            continue
        raise AssertionError(f"markers with {label} were accepted:\n{text}")
    good = "{\n    // EXERCISE 04.s BEGIN: x\n    y();\n    // EXERCISE 04.s STUB\n    // z();\n    // EXERCISE END\n}\n"
    blocks = ex.parse(good)
    ex.check_blocks(blocks, "04_fused", table)
    assert blocks[0]["stub"] == ["    z();\n"], f"the stub of {good!r} parsed as {blocks[0]['stub']}"


def test_uncomment():
    for commented, code in [("    // x = 1;\n", "    x = 1;\n"), ("    //\n", "\n"), ("    //     y();\n", "        y();\n"),
                            ("        // #pragma unroll 4\n", "#pragma unroll 4\n"), ("// // note\n", "// note\n")]:
        assert ex.uncomment(commented) == code, f"uncomment({commented!r}) = {ex.uncomment(commented)!r}, expected {code!r}"


# --- restore, compiles, sass, readme (cases) -----------------------------------------------------
def restore_case(chapter, label, only):
    def case(ctx):
        source = ex.chapter_source(chapter, ctx.root)
        copy, names = ex.student_copy(source, chapter, only)
        assert copy != source and names, f"{chapter} {label}: the student copy is the chapter itself"
        todo = set(ex.TODO_CALL.findall(copy))
        blocks = {b["name"]: b for b in ex.parse(source)}
        wanted = {n for n in names if blocks[n]["stub"] is None}
        assert todo == wanted, f"{chapter} {label}: EXERCISE_TODO stubs for {sorted(todo)}, expected {sorted(wanted)}"
        back = ex.restore(copy, source)
        assert back == source, f"{chapter} {label}: the copy with its solutions put back differs from the chapter"
        return f"{len(names)} region(s) restored byte for byte"
    return case


def compile_case(chapter, label, only):
    def case(ctx):
        copy, _ = ex.student_copy(ex.chapter_source(chapter, ctx.root), chapter, only)
        folder = write_tree(ctx, {f"{chapter}/attention.cu": copy})
        compile_quietly(ctx, folder / chapter / "attention.cu", folder / "copy.o", ["-c"])
    return case


def strip_markers(text):
    """The chapter without its EXERCISE lines: markers and commented-out stubs."""
    keep, in_stub = [], False
    for line in text.splitlines(keepends=True):
        if ex.STUB.match(line):
            in_stub = True
        elif ex.END.match(line):
            in_stub = False
        elif not (in_stub or ex.BEGIN.match(line)):
            keep.append(line)
    return "".join(keep)


def sass_text(ctx, cubin):
    """{function: [instruction text]}: cuobjdump's SASS without addresses and encodings."""
    cuobjdump, env = sass_tools(ctx)
    proc = ctx.run([cuobjdump, "--dump-sass", cubin], env=env, timeout=300)
    assert proc.returncode == 0, f"cuobjdump failed on {cubin}: {proc.stderr.strip()}"
    functions, current = {}, None
    for line in proc.stdout.splitlines():
        header = re.match(r"\s*Function\s*:\s*(\S+)", line)
        if header:
            current = functions.setdefault(header.group(1), [])
            continue
        instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if instruction and current is not None:
            current.append(re.sub(r"\s+", " ", instruction.group(1)))
    return functions


def sass_case(chapter):
    def case(ctx):
        sass_tools(ctx)  # skips without cuobjdump before compiling anything
        source = ex.chapter_source(chapter, ctx.root)
        folder = write_tree(ctx, {f"marked/{chapter}/attention.cu": source,
                                  f"plain/{chapter}/attention.cu": strip_markers(source)})
        for side in ("marked", "plain"):
            compile_quietly(ctx, folder / side / chapter / "attention.cu", folder / f"{side}.cubin", ["-cubin"])
        marked, plain = sass_text(ctx, folder / "marked.cubin"), sass_text(ctx, folder / "plain.cubin")
        assert marked and sorted(marked) == sorted(plain), f"{chapter}: functions {sorted(marked)} vs {sorted(plain)}"
        for name in marked:
            assert marked[name] == plain[name], f"{chapter}: the SASS of {name} changes with the markers taken out"
        return f"{sum(map(len, marked.values()))} instructions in {len(marked)} functions identical"
    return case


def readme_case(chapter):
    def case(ctx):
        readme = (ctx.root / chapter / "README.md").read_text()
        section = readme.split("## Exercises", 1)[1] if "## Exercises" in readme else ""
        assert section, f"{chapter}/README.md has no '## Exercises' section"
        for block in ex.parse(ex.chapter_source(chapter, ctx.root), chapter):
            name, info = block["name"], ex.EXERCISES[block["name"]]
            assert f"`{name}`" in section, f"{chapter}/README.md, Exercises: no entry for `{name}`"
            entry = section.split(f"`{name}`", 1)[1][:2500]
            for needed in (f"make exercise CH={chapter[:2]}", f"make grade CH={chapter[:2]}"):
                assert needed in section, f"{chapter}/README.md, Exercises: '{needed}' is not stated"
            if info["kind"] == "speed":
                gate = f"{info['gate']:.2f}x"
                assert gate in entry, f"{chapter}/README.md, `{name}`: its gate ({gate}) is not stated"
    return case


def cases(ctx):
    out = []
    for chapter in marked_chapters(ctx):
        for label, only in variants(ctx, chapter):
            out.append((f"restore[{chapter}: {label}]", restore_case(chapter, label, only)))
            out.append((f"compiles[{chapter}: {label}]", compile_case(chapter, label, only)))
        out.append((f"sass_unchanged_by_markers[{chapter}]", sass_case(chapter)))
        out.append((f"readme_states_exercises[{chapter}]", readme_case(chapter)))
    return out


# --- make exercise / make grade, no GPU, in a copy of the repository ------------------------------
def repo_copy(ctx):
    """The repository's files (tracked and new, as they are on disk) in a temporary folder."""
    listed = ctx.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], timeout=60)
    if listed.returncode != 0:
        raise unittest.SkipTest(f"git ls-files failed: {listed.stderr.strip()}")
    copy = ctx.tmpdir() / "repo"
    for rel in filter(None, listed.stdout.split("\0")):
        source = ctx.root / rel
        if source.is_file() and not rel.startswith("exercises/"):
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / rel)
    return copy


def make_in(ctx, copy, *args):
    tools = ctx.root / ".cache" / "tools"
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    return ctx.run(shlex.split(ctx.make) + ["--no-print-directory", f"PYTHON_SYS={sys.executable}",
                                            "BUILD=build", *args], env=env, cwd=copy, timeout=900)


def test_make_exercise_and_grade_without_gpu(ctx):
    copy = repo_copy(ctx)
    chapter = "04_fused"
    made = make_in(ctx, copy, "exercise", "CH=04")
    assert made.returncode == 0, f"make exercise CH=04: exit {made.returncode}: {made.stderr.strip()}"
    student = copy / "exercises" / chapter / "attention.cu"
    assert student.is_file() and f"exercises/{chapter}/attention.cu" in made.stdout, (
        f"make exercise CH=04 should write and name exercises/{chapter}/attention.cu: {made.stdout!r}")

    graded = make_in(ctx, copy, "grade", "CH=04")
    out = graded.stdout
    assert graded.returncode != 0, f"make grade on the untouched copy: exit 0, expected a failure:\n{out}"
    assert "TODO: exercise 04.online_softmax is not written yet" in out, f"make grade: no TODO line:\n{out}"
    skip_lines = [line for line in out.splitlines() if line.split()[:2] == ["gpu", "skipped:"]]
    assert len(skip_lines) == 1, f"make grade without a GPU: expected one line saying the GPU part is skipped:\n{out}"
    assert "build" in out and ": ok" in out, f"make grade: the copy should build:\n{out}"

    student.write_text(student.read_text() + "// mine\n")
    refused = make_in(ctx, copy, "exercise", "CH=04")
    assert refused.returncode != 0 and "FORCE=1" in refused.stderr, (
        f"make exercise over an edited copy: exit {refused.returncode}, expected a refusal naming FORCE=1: "
        f"{refused.stderr.strip()!r}")
    forced = make_in(ctx, copy, "exercise", "CH=04", "EX=online_softmax", "FORCE=1")
    assert forced.returncode == 0, f"make exercise FORCE=1: exit {forced.returncode}: {forced.stderr.strip()}"

    student.write_text(ex.restore(student.read_text(), ex.chapter_source(chapter, ctx.root)))
    solved = make_in(ctx, copy, "grade", "CH=04")
    assert solved.returncode == 0, f"make grade on the copy with its solution put back: exit {solved.returncode}:\n" \
                                   f"{solved.stdout}{solved.stderr[-2000:]}"
    assert "PASS" in solved.stdout.splitlines()[-1], f"make grade: the verdict should be PASS:\n{solved.stdout}"
    return skip_lines[0].strip()


# --- the grader's GPU bookkeeping on stand-in binaries ------------------------------------------------
FAKE = """#!{python}
import sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
if {todo}:
    sys.stderr.write("04_fused: TODO: exercise 04.online_softmax is not written yet (its EXERCISE_TODO stub ran)\\n")
    sys.exit(1)
print("04_fused,%s,%s,%s,%s,%d,fp16,{ms},1.0,2.1e-04,PASS,5.7e-05,1.2e-06,1,0,,{attend_ms},," % (
    value("--batch"), value("--heads"), value("--seqlen"), value("--headdim"), "--causal" in args))
"""


def fake_binary(ctx, ms, todo=False, attend_ms=""):
    path = ctx.tmpdir() / "04_fused"
    path.write_text(FAKE.format(python=sys.executable, ms=ms, todo=todo, attend_ms=attend_ms))
    path.chmod(0o755)
    return str(path)


def test_grader_bookkeeping_on_stand_in_binaries(ctx):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        failed = ex.matrix(fake_binary(ctx, 1.0, todo=True), "04_fused")
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert failed == len(ex.MATRIX) == len(lines), f"matrix: {failed} failed of {len(lines)} lines:\n{out.getvalue()}"
    assert all("FAIL" in line and "TODO: exercise 04.online_softmax is not written yet" in line for line in lines), (
        f"each failed case should carry the harness's TODO message:\n{out.getvalue()}")
    with contextlib.redirect_stdout(io.StringIO()):
        assert ex.matrix(fake_binary(ctx, 1.0), "04_fused") == 0, "matrix: passing runs counted as failures"
    shape = ex.EXERCISES["04.k_layout"]["shape"]
    ratio, line = ex.timing(fake_binary(ctx, 3.0), fake_binary(ctx, 2.0), "04_fused", shape)
    assert ratio is not None and abs(ratio - 1.5) < 1e-9 and "1.50x" in line, f"timing: ratio {ratio}, line {line!r}"
    ratio, line = ex.timing(fake_binary(ctx, 1.0, todo=True), fake_binary(ctx, 2.0), "04_fused", shape)
    assert ratio is None and "TODO: exercise" in line, f"timing of a copy that fails: {ratio}, {line!r}"
    # Timed on the attention kernel alone: its column counts, not the whole forward's.
    ratio, line = ex.timing(fake_binary(ctx, 3.0, attend_ms=1.0), fake_binary(ctx, 2.0, attend_ms=2.0), "04_fused",
                            shape, "attend_ms")
    assert ratio is not None and abs(ratio - 0.5) < 1e-9 and "attention kernel" in line, (
        f"timing on attend_ms: ratio {ratio}, line {line!r}")
    ratio, line = ex.timing(fake_binary(ctx, 3.0), fake_binary(ctx, 2.0), "04_fused", shape, "attend_ms")
    assert ratio is None and "no attend_ms" in line, f"timing on a column the harness left empty: {ratio}, {line!r}"
    return line


def test_student_copies_of_this_checkout_are_ignored(ctx):
    proc = subprocess.run(["git", "check-ignore", "-q", "exercises/04_fused/attention.cu"], cwd=ctx.root)
    assert proc.returncode == 0, "exercises/ (the student copies) should be in .gitignore"
