"""The ablation switches (common/ablation.py, `make ablation CH=NN`) and `make diff` (common/source.py),
without a GPU.

  switches   every switch an ablation table names is a `#ifndef NAME` / `#define NAME 1` default in its
             chapter (08, built in steps: `#define NAME (STEP >= k)`), so the chapter as written is the
             variant with every idea on; a run-time variant's flag (09's --deterministic) is the harness's
  rows       09, a backward chapter: its steps (or the chapter alone), no row for 08 (no backward), no -D
             flag, its run-time variant last (--deterministic, on the chapter's own binary); the forward
             chapters keep their before row
  run        `ablation.py run` on stand-in binaries (helpers.fake_binary): every check and timed run of 09
             has --backward, of 04 none, and --deterministic exactly those of 09's deterministic row; 09's
             CSV counts the backward's FLOPs (2.5x the forward's), its table says so, a variant is costed
             against the chapter
  compiles   every variant of 04's and 07's tables (each idea off alone, the ideas switched on one by one)
             compiles for sm_90 with the chapter's flags, without a warning (08's steps are builds of
             `make all`, and 09's run-time variant is its chapter's binary)
  readme     each chapter README has the table's markers, and where the measured CSV exists
             (docs/results/logs/NN/ablation_NN.csv), the table between them is the one `ablation.py table`
             writes from it (never stale); skipped, naming the CSV, where it is not measured yet (and then
             no table is there) or was measured for other rows than the chapter's ablation has now
             (`ablation.py table` then leaves the README alone, saying so)
  table      the table's arithmetic on a made-up CSV: a step's speedup over the row above, a missing
             idea's cost against the chapter
  diff       each chapter (and each of 08's steps) as `make diff` shows it (the switches' off branches and
             their comments left out) has no switch branch left and preprocesses to the very code of the
             chapter as built (so it compiles as the chapter does); the filter on made-up sources
"""
import argparse
import contextlib
import csv
import difflib
import io
import os
import re

import pytest

import ablation
import chapters
import results
import runner
import source
from helpers import ARCH_FLAG_OF, CHAPTERS, SASS_ARCH_FLAG, compile_quietly, fake_binary, nvcc_flags

ABLATED = list(ablation.ABLATION_SWITCHES)  # the chapters with an ablation table


@pytest.mark.parametrize("chapter", ABLATED)
def test_switches_default_on(repo, chapter):
    spec = ablation.ablations()[chapter]
    text = (repo.root / chapter / "attention.cu").read_text()
    for name, _ in spec["ideas"]:
        pattern = rf"#ifndef {name}\n#define {name} (1\b|\(STEP >= \d\))"
        assert re.search(pattern, text), f"{chapter}/attention.cu: no `#ifndef {name}` / `#define {name} 1` default"
    harness = (repo.root / "common" / "harness.cu").read_text()
    for _, flag, _ in spec["variants"]:
        assert re.search(rf'switches\[\] = \{{[^}}]*"{flag}"', harness), (
            f"{chapter}'s run-time variant runs with {flag}, which is not one of common/harness.cu's switches")


def test_backward_chapter_rows(repo):
    """09's rows: its steps where it is built in steps (the last, the chapter), else the chapter alone, then
    its deterministic mode, run by the chapter row's binary with --deterministic; no -D flag anywhere."""
    spec = ablation.ablations()["09_backward"]
    assert spec["pass"] == "backward" and spec["before"] is None, f"09: pass {spec['pass']}, before {spec['before']}"
    assert spec["ideas"] == [], f"09's ideas are its steps, not switches: {spec['ideas']}"
    got = ablation.variants("09_backward")
    count = len(chapters.read_steps(str(repo.root / "09_backward" / "attention.cu")))
    steps = [(f"step{k}", "step", "") for k in range(1, count)] + [("chapter", "step", "")]
    assert got == steps + [("deterministic", "variant", "--deterministic")], f"09's rows: {got}"
    label = ablation.variant_label("09_backward", "deterministic", "variant")
    assert label == "09_backward with `--deterministic` (dQ, dK, dV bitwise the same on every run)", label
    assert ablation.binary_path("B", "09_backward", "deterministic") == ablation.binary_path("B", "09_backward", "chapter")
    assert ablation.run_flags("09_backward", "deterministic") == ["--deterministic"]
    assert ablation.run_flags("09_backward", "chapter") == [] and ablation.run_flags("04_fused", "chapter") == []
    for chapter, spec in ablation.ablations().items():
        if chapter != "09_backward":
            previous = CHAPTERS[CHAPTERS.index(chapter) - 1]
            assert (spec["pass"], spec["before"]) == ("forward", previous), \
                f"{chapter}: {spec['pass']} {spec['before']}"
            assert ablation.variants(chapter)[0] == ("before", "before", ""), f"{chapter}: no before row first"


# --- ablation.py run, on stand-in binaries ------------------------------------------------------------

STAND_IN_MS = {"none": 2.0, "deterministic": 1.25}  # ms of a row's stand-in; every other row's: 1 ms


def run_on_stand_ins(folder, chapter):
    """`ablation.py run CH --rounds 1` with `true` for make and a stand-in at each row's binary path
    (helpers.fake_binary, STAND_IN_MS or 1 ms; a run-time variant's is the chapter row's, which gives its
    ms when run with the variant's flag), in folder; ({variant: [its command lines]}, the CSV's rows,
    what it printed)."""
    build, logs = folder / "build", folder / "logs"
    logs.mkdir()
    rows = ablation.variants(chapter)
    for variant, _, _ in rows:
        path = ablation.binary_path(str(build), chapter, variant)
        if os.path.lexists(path):
            continue  # a run-time variant's binary: the chapter row's, made already
        os.makedirs(os.path.dirname(path), exist_ok=True)
        stand_in = folder / "stand-ins" / variant
        stand_in.mkdir(parents=True)
        os.symlink(fake_binary(stand_in, STAND_IN_MS.get(variant, 1.0), log=str(logs / variant),
                               deterministic_ms=STAND_IN_MS["deterministic"]), path)
    out = folder / "ablation.csv"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        code = ablation.command_run(argparse.Namespace(chapter=chapter[:2], build=str(build), make="true", rounds=1,
                                                       out=str(out)))
    assert code == 0, f"ablation.py run {chapter[:2]} on stand-ins: exit {code}\n{printed.getvalue()[-2000:]}"
    lines = {}
    for variant, _, _ in rows:  # the lines of a row's binary that carry its run-time flags, and no other's
        binary = "chapter" if ablation.run_flags(chapter, variant) else variant
        flags = {f for v, _, _ in rows for f in ablation.run_flags(chapter, v)}
        lines[variant] = [line for line in (logs / binary).read_text().splitlines()
                          if flags & set(line.split()) == set(ablation.run_flags(chapter, variant))]
    return lines, ablation.read_rows(out), printed.getvalue()


def stand_in_run(repo, chapter):
    """run_on_stand_ins, once per chapter (tests that share it are in the xdist group "stand-ins")."""
    return repo.once(("ablation on stand-ins", chapter), lambda: run_on_stand_ins(repo.tmpdir(), chapter))


@pytest.mark.xdist_group("stand-ins")
@pytest.mark.parametrize("chapter, backward", [("09_backward", True), ("04_fused", False)])
def test_run_passes_backward_only_for_a_backward_chapter(repo, chapter, backward):
    """Each row runs its checks and one round of each mask, --backward on a backward chapter alone, and
    --deterministic on 09's deterministic row alone (its binary the chapter row's)."""
    lines, _, _ = stand_in_run(repo, chapter)
    runs = len(ablation.CHECK_SHAPES) + 2  # the checks, then one round of each mask
    assert ("deterministic" in lines) == backward, f"{chapter}'s rows: {list(lines)}"
    for variant, got in lines.items():
        assert len(got) == runs, f"{chapter} {variant}: {len(got)} runs, expected {runs}: {got}"
        wrong = [line for line in got if ("--backward" in line.split()) != backward]
        assert not wrong, f"{chapter} {variant}: {'without' if backward else 'with'} --backward: {wrong[:2]}"


@pytest.mark.xdist_group("stand-ins")
def test_backward_table_counts_backward_flops(repo):
    _, rows, printed = stand_in_run(repo, "09_backward")
    want = [v for v, _, _ in ablation.variants("09_backward")]
    assert [r["variant"] for r in rows] == want * 2, f"09's CSV rows: {[r['variant'] for r in rows]}"
    assert ablation.stale("09_backward", rows) is None, ablation.stale("09_backward", rows)
    assert set(rows[0]) == set(ablation.FIELDS), f"09's CSV columns: {list(rows[0])} (expected FIELDS, no pass column)"
    shape = results.bench_shape(results.HEADLINE_D, results.HEADLINE_N, 0)
    flops = 2.5 * 4 * results.work(shape)  # 2.5x the forward's 4·B·H·N²·D: 1374.4 TFLOP/s in 1 ms
    table = ablation.table_markdown("09_backward", rows)
    assert table.strip() in printed, "the table printed is not the one the CSV makes"
    lines = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    chapter = next(v for k, v in lines.items() if "**09_backward**" in k)
    assert f"| {flops / 1e-3 / 1e12:.1f} |" in chapter and f"| {flops / 2 / 1e-3 / 1e12:.1f} |" in chapter, (
        f"1 ms at the headline shape is {flops / 1e-3 / 1e12:.1f} TFLOP/s of the backward (causal: half): {chapter}")
    variant = lines[ablation.variant_label("09_backward", "deterministic", "variant")]
    assert variant.count("1.25x slower") == 2, f"1.25 ms against the chapter's 1 ms is 1.25x slower: {variant}"
    assert "| `--deterministic` |" in variant, f"the deterministic row's switches are its flag: {variant}"
    assert "the backward (dQ, dK, dV), FLOPs 2.5x the forward's" in table, table.splitlines()[0]
    assert "backward" not in ablation.table_caption("04_fused", rows), "04's caption names the backward"


# --- The variants compile ------------------------------------------------------------------------------

# 04's and 07's switches stay in their code; 08's steps are `make all`'s builds (BUILD/08_fp8.stepK), and
# 09's run-time variant is its chapter's binary.
COMPILED = [(chapter, variant, flags) for chapter in ("04_fused", "07_async_pipeline")
            for variant, kind, flags in ablation.variants(chapter) if kind != "before" and flags]


@pytest.mark.parametrize("chapter, variant, flags", COMPILED, ids=[f"{c}:{v}" for c, v, _ in COMPILED])
def test_variant_compiles_without_warnings(repo, tmp_path, chapter, variant, flags):
    compile_quietly(repo, repo.root / chapter / "attention.cu", tmp_path / f"{variant}.o", ["-c", *flags.split()])


# --- The README tables ---------------------------------------------------------------------------------

@pytest.mark.parametrize("chapter", ABLATED)
def test_readme_table_is_its_csvs(repo, chapter):
    text = (repo.root / chapter / "README.md").read_text()
    begin = ablation.ABLATION_BEGIN.format(nn=chapter[:2])
    assert begin in text and ablation.ABLATION_END in text, f"{chapter}/README.md: no ablation table markers"
    path = ablation.csv_path(chapter)
    inside = text.split(begin, 1)[1].split(ablation.ABLATION_END, 1)[0]
    if not os.path.exists(path):
        assert not re.search(r"^\|", inside, re.M), f"{chapter}/README.md: a table with no CSV to make it"
        pytest.skip(f"{repo.rel(path)} not measured yet (`make ablation CH={chapter[:2]}` on a GPU writes it); "
                    "the markers are there, no table")
    rows = ablation.read_rows(path)
    if ablation.stale(chapter, rows):
        pytest.skip(ablation.stale(chapter, rows))
    table = ablation.table_markdown(chapter, rows)
    assert inside.strip() == table.strip(), (
        f"{chapter}/README.md: the ablation table differs from {repo.rel(path)}: "
        f"run `python3 common/ablation.py table {chapter[:2]}`")


def test_table_arithmetic(tmp_path):
    path = tmp_path / "ablation.csv"
    made_up = [("before", "before", "", 4.0),
               ("none", "step", "-DLOOP_ORDER=0 -DREGISTER_TILING=0 -DLOG2_DOMAIN=0", 8.0),
               ("plus_loop_order", "step", "-DREGISTER_TILING=0 -DLOG2_DOMAIN=0", 4.0),
               ("plus_register_tiling", "step", "-DLOG2_DOMAIN=0", 2.0), ("chapter", "step", "", 1.0),
               ("without_loop_order", "without", "-DLOOP_ORDER=0", 3.0)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ablation.FIELDS)
        writer.writeheader()
        for causal in (0, 1):
            for variant, kind, flags, ms in made_up:
                writer.writerow({"variant": variant, "kind": kind, "flags": flags, "impl": "04_fused", "batch": 4,
                                 "heads": 16, "seqlen": 4096, "headdim": 128, "causal": causal, "ms": ms * (1 + causal),
                                 "tflops": 1.0, "attend_ms": "", "round_ms": f"{ms} {ms} {ms}"})
    table = ablation.table_markdown("04_fused", ablation.read_rows(path))
    lines = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "0.50x" in lines["every idea off"], f"8 ms after 4 ms is 0.50x: {lines['every idea off']}"
    assert "2.00x" in lines["+ " + dict(ablation.ablations()["04_fused"]["ideas"])["LOOP_ORDER"]], table
    without = next(v for k, v in lines.items() if k.startswith("04_fused with "))
    assert without.count("3.00x slower") == 2, f"3 ms against the chapter's 1 ms is 3.00x slower: {without}"
    assert "median of 3 interleaved rounds" in table, table


def test_stale_csv_is_named():
    """A CSV measured for other rows than the chapter's ablation has now (a row gone, other flags) is stale,
    saying which rows and what to run; one of exactly its rows is not."""
    def csv_rows(rows):
        return [{"variant": v, "kind": k, "flags": f, "causal": c} for c in (0, 1) for v, k, f in rows]
    now = ablation.variants("09_backward")
    assert ablation.stale("09_backward", csv_rows(now)) is None
    older = now + [("dq_kernel", "variant", "-DBWD_DQ_KERNEL=1")]
    why = ablation.stale("09_backward", csv_rows(older)) or ""
    assert "dq_kernel" in why and "make ablation CH=09" in why, f"a CSV with a row the ablation lost: {why!r}"
    built = now[:-1] + [("deterministic", "variant", "-DDETERMINISTIC_DQ=1")]
    assert ablation.stale("09_backward", csv_rows(built)), "a CSV whose row ran with other flags is not stale"


# --- make diff: the chapters as their defaults compile them ------------------------------------------

def preprocessed(repo, top, chapter, arch, defines):
    """The code nvcc compiles from top/chapter/attention.cu for arch (its device pass: -E), with the
    Makefile's flags, run in top (so that __FILE__ reads the same): line markers and blank lines left
    out, spaces squeezed."""
    path = f"{chapter}/attention.cu"
    proc = repo.run(nvcc_flags(repo) + [arch, *defines, "-E", path], timeout=120, cwd=top)
    assert proc.returncode == 0, f"nvcc -E {top}/{path} {' '.join(defines)} fails:\n{proc.stderr.strip()[-2000:]}"
    lines = (" ".join(line.split()) for line in proc.stdout.splitlines() if not re.match(r"#\s*(\d|line\b)", line))
    return [line for line in lines if line]


SWITCHED = [chapter for chapter in ABLATED if ablation.ablations()[chapter]["ideas"]]  # 08's steps are files


@pytest.mark.parametrize("chapter", SWITCHED)
def test_diff_shows_the_code_as_compiled(repo, tmp_path, chapter):
    """A chapter with switches as `make diff` shows it: no switch branch left, no `// Ablation`
    comment, and the very code the chapter compiles to, at sm_90, and at sm_80 too where its code
    tests __CUDA_ARCH__."""
    original = (repo.root / chapter / "attention.cu").read_text()
    text = source.without_switches(original)
    values = source.switches_of(original)
    left = [line for line in text.splitlines()
            if source.SWITCH_IF.match(line.strip()) and source.SWITCH_IF.match(line.strip()).group(2) in values]
    assert not left and "// Ablation" not in text, f"{chapter}: switch branches left: {left[:3]}"
    stripped = tmp_path / chapter / "attention.cu"
    stripped.parent.mkdir()
    stripped.write_text(text)
    (tmp_path / "common").symlink_to(repo.root / "common")  # its #include "../common/..."
    shown, defines = chapter, []
    arches = [ARCH_FLAG_OF.get(chapter[:2], SASS_ARCH_FLAG)]
    if chapter[:2] not in ARCH_FLAG_OF and re.search(r"^\s*#\s*(el)?if\b.*__CUDA_ARCH__", original, re.M):
        arches.append("-gencode=arch=compute_80,code=sm_80")  # its code below sm_90 (09's scalar dQ adds)
    for arch in arches:
        want = preprocessed(repo, repo.root, chapter, arch, defines)
        got = preprocessed(repo, tmp_path, chapter, arch, defines)
        assert got == want, (f"{shown} without its switches is not the code it compiles to ({arch}):\n"
                             + "\n".join(list(difflib.unified_diff(want, got, "as built", "as make diff shows it",
                                                                   lineterm="", n=1))[:30]))


@pytest.mark.parametrize("a, b", [("08.2", "08.3"), ("08.5", "08.6"), ("8.1", "08")])
def test_diff_of_two_steps_is_the_diff_of_their_files(a, b):
    """make diff A=08.2 B=08.3: a step is a file (08_fp8/stepK_*.cu; the last, 08.6, the chapter's
    attention.cu), shown as it is."""
    for name in (a, b):
        label, text = ablation.diff_source(name)
        build, chapter = runner.build_of(name), os.path.join(ablation.ROOT, "08_fp8", "attention.cu")
        steps = chapters.read_steps(chapter)
        path = steps[int(build.rpartition(".step")[2]) - 1]["source"] if ".step" in build else chapter
        assert label == os.path.relpath(path, ablation.ROOT) and text == open(path).read(), f"make diff {name}: {label}"


def test_switch_filter():
    text = ("#ifndef A\n#define A 1\n#endif\n#if X\nx\n#endif\n    // Ablation (-DA=0): off\n"
            "    // continued\n#if A  // a note\nkept\n#else\ngone\n#endif\n#if !A\ngone too\n#endif\n"
            "// Ablation (-DA=0): a comment on kept code\nkept too\n// a comment of its own\nend\n")
    want = "#ifndef A\n#define A 1\n#endif\n#if X\nx\n#endif\nkept\nkept too\n// a comment of its own\nend\n"
    got = source.without_switches(text)
    assert got == want, f"filtered:\n{got}\nexpected:\n{want}"
    with pytest.raises(ValueError):  # #elif in a switch's #if accepted: DID NOT RAISE
        source.without_switches("#ifndef A\n#define A 1\n#endif\n#if A\na\n#elif B\nb\n#endif\n")



def changed_lines(a, b):
    """The lines `make diff A=a B=b` shows as changed (each starting with - or +, the two headers not)."""
    (_, old), (_, new) = ablation.diff_source(a), ablation.diff_source(b)
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=3))
    return sum(1 for line in lines[2:] if line[:1] in "+-")


def test_08s_readme_states_its_diff_sizes(repo):
    """08's README gives the size of `make diff A=07 B=08.1` and the range of the later steps' diffs."""
    first = changed_lines("07", "08.1")
    later = [changed_lines(f"08.{k}", f"08.{k + 1}") for k in range(1, 6)]
    text = " ".join((repo.root / "08_fp8" / "README.md").read_text().split())
    assert f"the diff is large ({first} changed lines," in text, f"08's README: make diff A=07 B=08.1 is {first} lines"
    assert f"The steps after it change {min(later)} to {max(later)} lines each." in text, (
        f"08's README: the later steps' diffs are {later}")


@pytest.mark.parametrize("chapter, steps", [("09_backward", 8), ("10_backward_hopper", 11), ("11_decode", 12)])
def test_step_table_states_lines_and_diffs(repo, chapter, steps):
    """A chapter's README step table (09's, 10's, 11's): each file's line count and its `make diff` from the
    step before."""
    number = chapter[:2]
    text = (repo.root / chapter / "README.md").read_text()
    rows = re.findall(rf"^\| ({number}\.(\d+)) \| [^|]* \| `([\w.]+)` \| (\d+) \| ([^|]*)\|$", text, re.M)
    assert [int(k) for _, k, _, _, _ in rows] == list(range(1, steps + 1)), f"{chapter}'s step table: rows {rows}"
    for step, k, name, lines, diff in rows:
        have = len((repo.root / chapter / name).read_text().splitlines())
        assert int(lines) == have, f"{step}: the table says {lines} lines, {name} has {have}"
        if k != "1":
            size = changed_lines(f"{number}.{int(k) - 1}", step)
            assert re.search(rf": {size}( lines)? $", diff), f"{step}: the table says {diff.strip()!r}, the diff is {size} lines"
