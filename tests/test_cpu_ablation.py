"""The ablation switches (common/ablation.py, `make ablation CH=NN`), without a GPU.

  switches   every switch the table names is a `#ifndef NAME` / `#define NAME 1` default in its
             chapter, so the chapter as written is the variant with every idea on
  compiles   every variant of the table (each idea off alone, the ideas switched on one by one)
             compiles for sm_90 (08: sm_90a) with the chapter's flags, without a warning
  readme     each chapter README has the table's markers, and where the measured CSV exists, the
             table between them is the one `ablation.py table` writes from it (never stale)
  table      the table's arithmetic on a made-up CSV: a step's speedup over the row above, a
             missing idea's cost against the chapter
  diff       each chapter as `make diff` shows it (the switches' off branches and their comments
             left out) has no switch branch left and still compiles; the filter on a made-up source
"""
import csv
import os
import re

import ablation
from test_cpu_exercises import ARCH_FLAG_OF, SASS_ARCH_FLAG, nvcc_flags

PARALLEL = 8


def test_switches_default_on(ctx):
    for chapter, spec in ablation.ABLATIONS.items():
        text = (ctx.root / chapter / "attention.cu").read_text()
        for name, _ in spec["ideas"]:
            pattern = rf"#ifndef {name}\n#define {name} 1\b"
            assert re.search(pattern, text), f"{chapter}/attention.cu: no `#ifndef {name}` / `#define {name} 1` default"
    return f"{sum(len(s['ideas']) for s in ablation.ABLATIONS.values())} switches"


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
        if not os.path.exists(path):
            return "not measured yet"
        table = ablation.table_markdown(chapter, ablation.read_rows(path))
        inside = text.split(begin, 1)[1].split(ablation.ABLATION_END, 1)[0]
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
    without = next(v for k, v in lines.items() if k.startswith("04_fused without"))
    assert without.count("3.00x slower") == 2, f"3 ms against the chapter's 1 ms is 3.00x slower: {without}"
    assert "median of 3 interleaved rounds" in table, table
    return "steps, costs, caption"


def stripped_case(chapter):
    def case(ctx):
        text = ablation.without_switches((ctx.root / chapter / "attention.cu").read_text())
        left = [line for line in text.splitlines() if ablation.SWITCH_IF.match(line.strip())
                and ablation.SWITCH_IF.match(line.strip()).group(2) in ablation.switches_of(text)]
        assert not left and "// Ablation" not in text, f"{chapter}: switch branches left: {left[:3]}"
        folder = ctx.tmpdir() / chapter
        folder.mkdir()
        (folder / "attention.cu").write_text(text)
        os.symlink(ctx.root / "common", folder.parent / "common")
        arch = ARCH_FLAG_OF.get(chapter[:2], SASS_ARCH_FLAG)
        proc = ctx.run(nvcc_flags(ctx) + [arch, "-c", "-o", folder / "x.o", folder / "attention.cu"], timeout=600)
        assert proc.returncode == 0, f"{chapter} without its switches does not compile:\n{proc.stderr[-2000:]}"
        return f"{len(text.splitlines())} of {len((ctx.root / chapter / 'attention.cu').read_text().splitlines())} lines"
    return case


def test_switch_filter():
    source = ("#ifndef A\n#define A 1\n#endif\n#if X\nx\n#endif\n    // Ablation (-DA=0): off\n"
              "    // continued\n#if A  // a note\nkept\n#else\ngone\n#endif\n#if !A\ngone too\n#endif\n"
              "// Ablation (-DA=0): a comment on kept code\nkept too\n// a comment of its own\nend\n")
    want = "#ifndef A\n#define A 1\n#endif\n#if X\nx\n#endif\nkept\nkept too\n// a comment of its own\nend\n"
    got = ablation.without_switches(source)
    assert got == want, f"filtered:\n{got}\nexpected:\n{want}"
    try:
        ablation.without_switches("#ifndef A\n#define A 1\n#endif\n#if A\na\n#elif B\nb\n#endif\n")
    except ValueError:
        return "kept, dropped, #elif refused"
    raise AssertionError("#elif in a switch's #if was accepted")


def cases(ctx):
    out = [(f"diff[{chapter}]", stripped_case(chapter)) for chapter in ablation.ABLATIONS]
    for chapter in ablation.ABLATIONS:
        for variant, kind, flags in ablation.variants(chapter):
            if kind != "before" and flags:
                out.append((f"compiles[{chapter}: {variant}]", compile_case(chapter, variant, flags)))
        out.append((f"readme[{chapter}]", readme_case(chapter)))
    return out
