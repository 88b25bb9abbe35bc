"""The ablation switches (common/ablation.py, `make ablation CH=NN`), without a GPU.

  switches   every switch the table names is a `#ifndef NAME` / `#define NAME 1` default in its
             chapter (08, built in steps: `#define NAME (STEP >= k)`), so the chapter as written
             is the variant with every idea on; a variant's switch (09's DETERMINISTIC_DQ)
             defaults to 0
  rows       09, a backward chapter: its rows and their -D flags, no row for 08 (no backward),
             the deterministic variant last; the forward chapters keep their before row
  run        `ablation.py run` on stand-in binaries (test_cpu_exercises' fake_binary): every
             check and timed run of 09 has --backward, of 04 none; 09's CSV counts the
             backward's FLOPs (2.5x the forward's), its table says so, the variant is costed
             against the chapter
  compiles   every variant of the table (each idea off alone, the ideas switched on one by one)
             compiles for sm_90 (08: sm_90a) with the chapter's flags, without a warning
  readme     each chapter README has the table's markers, and where the measured CSV exists, the
             table between them is the one `ablation.py table` writes from it (never stale);
             skipped, naming the CSV, where it is not measured yet (and then no table is there)
  table      the table's arithmetic on a made-up CSV: a step's speedup over the row above, a
             missing idea's cost against the chapter
  diff       each chapter (and each of 08's steps) as `make diff` shows it (the switches' off
             branches and their comments left out) has no switch branch left and still compiles;
             the filter on made-up sources
"""
import argparse
import csv
import os
import re
import unittest

import ablation
import chapters
import results
import source
from test_cpu_exercises import ARCH_FLAG_OF, SASS_ARCH_FLAG, fake_binary, nvcc_flags

PARALLEL = 8


def test_switches_default_on(ctx):
    for chapter, spec in ablation.ABLATIONS.items():
        text = (ctx.root / chapter / "attention.cu").read_text()
        for name, _ in spec["ideas"]:
            pattern = rf"#ifndef {name}\n#define {name} (1\b|\(STEP >= \d\))"
            assert re.search(pattern, text), f"{chapter}/attention.cu: no `#ifndef {name}` / `#define {name} 1` default"
        for _, switch, _ in spec["variants"]:
            pattern = rf"#ifndef {switch}\n#define {switch} 0\b"
            assert re.search(pattern, text), f"{chapter}/attention.cu: no `#ifndef {switch}` / `#define {switch} 0`"
    return f"{sum(len(s['ideas']) + len(s['variants']) for s in ablation.ABLATIONS.values())} switches"


BACKWARD_ROWS = [  # 09's table: the ideas on one by one, each off alone (BWD_DQ_STAGE's is the row before the chapter)
    ("none", "step", "-DBWD_WIDE_BLOCK=0 -DBWD_STAGGER=0 -DBWD_SPLIT=0 -DBWD_DQ_STAGE=0"),
    ("plus_bwd_wide_block", "step", "-DBWD_STAGGER=0 -DBWD_SPLIT=0 -DBWD_DQ_STAGE=0"),
    ("plus_bwd_stagger", "step", "-DBWD_SPLIT=0 -DBWD_DQ_STAGE=0"), ("plus_bwd_split", "step", "-DBWD_DQ_STAGE=0"),
    ("chapter", "step", ""), ("without_bwd_wide_block", "without", "-DBWD_WIDE_BLOCK=0"),
    ("without_bwd_stagger", "without", "-DBWD_STAGGER=0"), ("without_bwd_split", "without", "-DBWD_SPLIT=0"),
    ("deterministic", "variant", "-DDETERMINISTIC_DQ=1"), ("dq_kernel", "variant", "-DBWD_DQ_KERNEL=1")]


def test_backward_chapter_rows(ctx):
    spec = ablation.ABLATIONS["09_backward"]
    assert spec["pass"] == "backward" and spec["before"] is None, f"09: pass {spec['pass']}, before {spec['before']}"
    got = ablation.variants("09_backward")
    assert got == BACKWARD_ROWS, f"09's rows:\n{got}\nexpected:\n{BACKWARD_ROWS}"
    label = ablation.variant_label("09_backward", "deterministic", "variant")
    assert label == "09_backward with `DETERMINISTIC_DQ` (dQ repeatable: a workspace copy per block)", label
    label = ablation.variant_label("09_backward", "dq_kernel", "variant")
    assert label == "09_backward with `BWD_DQ_KERNEL` (dQ repeatable: by a kernel of its own)", label
    for chapter, spec in ablation.ABLATIONS.items():
        if chapter != "09_backward":
            previous = ctx.chapters[ctx.chapters.index(chapter) - 1]
            assert (spec["pass"], spec["before"]) == ("forward", previous), f"{chapter}: {spec['pass']} {spec['before']}"
            assert ablation.variants(chapter)[0] == ("before", "before", ""), f"{chapter}: no before row first"
    return f"{len(got)} rows, no before row"


STAND_IN_MS = {"none": 2.0, "plus_bwd_wide_block": 1.5, "plus_bwd_stagger": 1.2, "plus_bwd_split": 1.1, "chapter": 1.0,
               "without_bwd_wide_block": 1.4, "without_bwd_stagger": 1.1, "without_bwd_split": 1.15,
               "deterministic": 1.25, "dq_kernel": 1.2}


def run_on_stand_ins(ctx, chapter):
    """`ablation.py run CH --rounds 1` with `true` for make and a stand-in at each variant's binary
    path (test_cpu_exercises.fake_binary, STAND_IN_MS or 1 ms); ({variant: [command lines]},
    the CSV's rows, what it printed)."""
    build, logs = ctx.tmpdir(), ctx.tmpdir()
    for variant, _, _ in ablation.variants(chapter):
        path = ablation.binary_path(str(build), chapter, variant)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(fake_binary(ctx, STAND_IN_MS.get(variant, 1.0), log=str(logs / variant)), path)
    out = ctx.tmpdir() / "ablation.csv"
    with ctx.captured_stdout() as printed:
        code = ablation.command_run(argparse.Namespace(chapter=chapter[:2], build=str(build), make="true", rounds=1,
                                                       out=str(out)))
    assert code == 0, f"ablation.py run {chapter[:2]} on stand-ins: exit {code}\n{printed.getvalue()[-2000:]}"
    lines = {v: (logs / v).read_text().splitlines() for v, _, _ in ablation.variants(chapter)}
    return lines, ablation.read_rows(out), printed.getvalue()


def test_run_passes_backward_only_for_a_backward_chapter(ctx):
    for chapter, wanted in (("09_backward", True), ("04_fused", False)):
        lines, _, _ = run_on_stand_ins(ctx, chapter)
        runs = len(ablation.CHECK_SHAPES) + 2  # the checks, then one round of each mask
        for variant, got in lines.items():
            assert len(got) == runs, f"{chapter} {variant}: {len(got)} runs, expected {runs}: {got}"
            wrong = [line for line in got if ("--backward" in line.split()) != wanted]
            assert not wrong, f"{chapter} {variant}: {'without' if wanted else 'with'} --backward: {wrong[:2]}"
    return "09: --backward on every run; 04: on none"


def test_backward_table_counts_backward_flops(ctx):
    _, rows, printed = run_on_stand_ins(ctx, "09_backward")
    assert {r["variant"] for r in rows} == set(STAND_IN_MS) and len(rows) == 2 * len(STAND_IN_MS), (
        f"09's CSV rows: {[r['variant'] for r in rows]}")
    assert set(rows[0]) == set(ablation.FIELDS), f"09's CSV columns: {list(rows[0])} (expected FIELDS, no pass column)"
    shape = results.bench_shape(results.HEADLINE_D, results.HEADLINE_N, 0)
    flops = 2.5 * 4 * results.work(shape)  # 2.5x the forward's 4·B·H·N²·D: 1374.4 TFLOP/s in 1 ms
    table = ablation.table_markdown("09_backward", rows)
    assert table.strip() in printed, "the table printed is not the one the CSV makes"
    lines = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    chapter = next(v for k, v in lines.items() if k.endswith("**09_backward**"))
    assert f"| {flops / 1e-3 / 1e12:.1f} |" in chapter and f"| {flops / 2 / 1e-3 / 1e12:.1f} |" in chapter, (
        f"1 ms at the headline shape is {flops / 1e-3 / 1e12:.1f} TFLOP/s of the backward (causal: half): {chapter}")
    variant = lines[ablation.variant_label("09_backward", "deterministic", "variant")]
    assert variant.count("1.25x slower") == 2, f"1.25 ms against the chapter's 1 ms is 1.25x slower: {variant}"
    assert "the backward (dQ, dK, dV), FLOPs 2.5x the forward's" in table, table.splitlines()[0]
    assert "backward" not in ablation.table_caption("04_fused", rows), "04's caption names the backward"
    return chapter


def compile_case(chapter, variant, flags):
    def case(ctx):
        out = ctx.tmpdir() / f"{variant}.o"
        arch = ARCH_FLAG_OF.get(chapter[:2], SASS_ARCH_FLAG)
        cmd = nvcc_flags(ctx) + [arch, "-c"] + flags.split() + ["-o", out, ctx.root / chapter / "attention.cu"]
        proc = ctx.run(cmd, timeout=600)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{chapter} {flags}: does not compile:\n{log.strip()[-3000:]}"
        warnings = [line for line in log.splitlines() if "warning" in line.lower()]
        assert not warnings, f"{chapter} {flags}: compiler warnings:\n" + "\n".join(warnings[:20])
        spills = sorted(set(re.findall(r"(\d+) bytes spill stores", log)) - {"0"})
        return f"spill stores: {', '.join(spills)} bytes" if spills else "no spills"
    return case


def readme_case(chapter):
    def case(ctx):
        text = (ctx.root / chapter / "README.md").read_text()
        begin = ablation.ABLATION_BEGIN.format(nn=chapter[:2])
        assert begin in text and ablation.ABLATION_END in text, f"{chapter}/README.md: no ablation table markers"
        path = ablation.csv_path(chapter)
        inside = text.split(begin, 1)[1].split(ablation.ABLATION_END, 1)[0]
        if not os.path.exists(path):
            assert not re.search(r"^\|", inside, re.M), f"{chapter}/README.md: a table with no CSV to make it"
            raise unittest.SkipTest(f"{os.path.relpath(path, ctx.root)} not measured yet (`make ablation "
                                    f"CH={chapter[:2]}` on a GPU writes it); the markers are there, no table")
        table = ablation.table_markdown(chapter, ablation.read_rows(path))
        assert inside.strip() == table.strip(), (
            f"{chapter}/README.md: the ablation table differs from {os.path.relpath(path, ctx.root)}: "
            f"run `python3 common/ablation.py table {chapter[:2]}`")
        return "table matches its CSV"
    return case


def test_table_arithmetic(ctx):
    path = ctx.tmpdir() / "ablation.csv"
    made_up = [("before", "before", "", 4.0), ("none", "step", "-DLOOP_ORDER=0 -DREGISTER_TILING=0 -DLOG2_DOMAIN=0", 8.0),
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
    assert "2.00x" in lines["+ " + dict(ablation.ABLATIONS["04_fused"]["ideas"])["LOOP_ORDER"]], table
    without = next(v for k, v in lines.items() if k.startswith("04_fused with "))
    assert without.count("3.00x slower") == 2, f"3 ms against the chapter's 1 ms is 3.00x slower: {without}"
    assert "median of 3 interleaved rounds" in table, table
    return "steps, costs, caption"


def stripped_case(chapter, step=None):
    """The chapter (or one of its steps) as `make diff` shows it compiles, with no switch left."""
    def case(ctx):
        original = (ctx.root / chapter / "attention.cu").read_text()
        text = source.without_switches(original, step)
        values = source.switches_of(original, step)
        left = [line for line in text.splitlines() if (source.SWITCH_IF.match(line.strip())
                and source.SWITCH_IF.match(line.strip()).group(2) in values) or source.STEP_IF.match(line.strip())]
        assert not left and "// Ablation" not in text, f"{chapter}: switch branches left: {left[:3]}"
        folder = ctx.tmpdir() / chapter
        folder.mkdir()
        (folder / "attention.cu").write_text(text)
        os.symlink(ctx.root / "common", folder.parent / "common")
        arch = ARCH_FLAG_OF.get(chapter[:2], SASS_ARCH_FLAG)
        flags = [f"-DSTEP={step}"] if step else []
        proc = ctx.run(nvcc_flags(ctx) + [arch, *flags, "-c", "-o", folder / "x.o", folder / "attention.cu"], timeout=600)
        shown = f"{chapter} (step {step})" if step else chapter
        assert proc.returncode == 0, f"{shown} without its switches does not compile:\n{proc.stderr[-2000:]}"
        return f"{len(text.splitlines())} of {len(original.splitlines())} lines"
    return case


def test_step_filter():
    """A chapter built in steps: each switch `#define NAME (STEP >= k)` is on from step k, and an
    `#if STEP == k` / `#elif STEP == k` chain keeps the branch of the step shown."""
    text = ("#ifndef STEP\n#define STEP 3\n#endif\n#ifndef B\n#define B (STEP >= 2)\n#endif\n"
            "#if B\nb\n#else\nnot b\n#endif\n#if STEP == 1\none\n#elif STEP == 2\ntwo\n#elif STEP == 3\nthree\n"
            "#else\n#error\n#endif\n#if !B\nbefore b\n#endif\n")
    head = "#ifndef STEP\n#define STEP 3\n#endif\n#ifndef B\n#define B (STEP >= 2)\n#endif\n"
    want = {1: head + "not b\none\nbefore b\n", 2: head + "b\ntwo\n", None: head + "b\nthree\n"}
    for step, expected in want.items():
        got = source.without_switches(text, step)
        assert got == expected, f"step {step}:\n{got}\nexpected:\n{expected}"
    return "steps 1, 2 and the default"


def test_switch_filter():
    text = ("#ifndef A\n#define A 1\n#endif\n#if X\nx\n#endif\n    // Ablation (-DA=0): off\n"
              "    // continued\n#if A  // a note\nkept\n#else\ngone\n#endif\n#if !A\ngone too\n#endif\n"
              "// Ablation (-DA=0): a comment on kept code\nkept too\n// a comment of its own\nend\n")
    want = "#ifndef A\n#define A 1\n#endif\n#if X\nx\n#endif\nkept\nkept too\n// a comment of its own\nend\n"
    got = source.without_switches(text)
    assert got == want, f"filtered:\n{got}\nexpected:\n{want}"
    try:
        source.without_switches("#ifndef A\n#define A 1\n#endif\n#if A\na\n#elif B\nb\n#endif\n")
    except ValueError:
        return "kept, dropped, #elif refused"
    raise AssertionError("#elif in a switch's #if was accepted")


def cases(ctx):
    out = [(f"diff[{chapter}]", stripped_case(chapter)) for chapter in ablation.ABLATIONS]
    for step in range(1, len(chapters.read_steps(ctx.root / "08_fp8" / "attention.cu"))):
        out.append((f"diff[08_fp8 step {step}]", stripped_case("08_fp8", step)))
    for chapter in ablation.ABLATIONS:
        for variant, kind, flags in ablation.variants(chapter):
            if kind != "before" and flags:
                out.append((f"compiles[{chapter}: {variant}]", compile_case(chapter, variant, flags)))
        out.append((f"readme[{chapter}]", readme_case(chapter)))
    return out
