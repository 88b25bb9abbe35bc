#!/usr/bin/env python3
"""Each idea of a chapter on its own: the chapter built with its ideas switched off, timed in one run.

A chapter that adds several ideas at once has a preprocessor switch per idea (`#ifndef NAME`,
default 1 = the chapter as written; `-DNAME=0` turns that idea off and stays correct). This
script builds the variants below, checks each one, times them in interleaved rounds at the
headline shape, and writes docs/results/logs/NN/ablation_NN.csv and the table in the chapter's
README (between ABLATION_BEGIN and ABLATION_END).

  ablation.py run CH [--build DIR] [--rounds R] [--out FILE]     (make ablation CH=NN)
      Build (BUILD/ablation/<variant>/NN_name), check at small shapes, time, write the CSV and
      the table. Exit 1 if a variant fails its check.
  ablation.py table [CH...]    regenerate the README tables from the CSVs that exist
  ablation.py list             the chapters and their switches
  ablation.py diff A B         (make diff) chapter A against B, each as its defaults compile it:
                               the branches and comments of the switches left out

The rows of a table: the chapter before (the baseline), the chapter with every idea off, then
the ideas switched on one at a time in the order listed (the last row is the chapter), then the
chapter with each idea off alone (what that idea is worth in the finished kernel), then its
run-time variants (the chapter's binary run with one more flag, such as 09's --deterministic)
against the chapter. A chapter built in steps has its steps as the first rows instead.
A chapter that registers a backward pass (09) is ablated on its backward: every run gets
--backward, TFLOP/s count 2.5x the forward's FLOPs, and the chapter before is the baseline only
if it has a backward too (08 has none, so 09's table has no such row).
"""
import argparse
import csv
import difflib
import functools
import os
import re
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "common"))
from report import fmt_ms, fmt_speedup, fmt_tflops, markdown_table, replace_between, say  # noqa: E402
from results import (HEADLINE_D, HEADLINE_N, backward_tflops, bench_shape, chapter_pass, forward_tflops, gpu_name,  # noqa: E402
                     write_if_changed)
from runner import build_of, chapters, find_chapter as chapter_named, make_env, run_case, shape_args  # noqa: E402
from chapters import read_steps  # noqa: E402
from source import without_switches  # noqa: E402

# The chapters with an ablation table and their switches, in the order the table switches them on.
# What each switch is comes from the chapter itself (switch_words), the chapter before it is the
# previous folder, and a chapter built in steps (08, 09) has its steps as the table's rows, then the
# finished kernel with each of these switches off alone.
ABLATION_SWITCHES = {
    "04_fused": ("LOOP_ORDER", "REGISTER_TILING", "LOG2_DOMAIN"),
    "07_async_pipeline": ("P_IN_REGISTERS", "ASYNC_RING", "QUERY_ROWS_128", "DOUBLE_BUFFER", "RESCALE_VOTE"),
    "08_fp8": (),  # a chapter of steps as files (stepK_*.cu): its table is the staircase of its steps
    "09_backward": (),  # the same, on its backward
}
# A chapter's run-time variants, rows after those without one idea: (variant, the flag its binary runs
# with, what that gives), each against the chapter, run by the chapter row's binary. 09's is the mode
# the bench also times (09_backward.deterministic).
ABLATION_VARIANTS = {"09_backward": (("deterministic", "--deterministic", "dQ, dK, dV bitwise the same on every run"),)}
TFLOPS_OF_PASS = {"forward": forward_tflops, "backward": backward_tflops}


def switch_words(text, name):
    """A switch's words, its comment in the source (`#define NAME 1  // what it is (0: the other)`),
    without the off setting."""
    found = re.search(rf"#define {name} 1\s*//\s*(.+)", text)
    if not found:
        raise ValueError(f"no `#define {name} 1  // what it is` in the chapter's source")
    return re.sub(r"\s*\(0: [^)]*\)$", "", found.group(1).strip())


@functools.cache
def ablations(root=ROOT):
    """{chapter: {"pass", "before" (None: no chapter before of the same pass), "steps",
    "ideas": [(switch, words)], "variants": ABLATION_VARIANTS'}} for ABLATION_SWITCHES."""
    folders, out = chapters(root), {}
    for chapter, names in ABLATION_SWITCHES.items():
        path = os.path.join(root, chapter, "attention.cu")
        text = open(path).read()
        previous, pass_ = folders[folders.index(chapter) - 1], chapter_pass(chapter, root)
        out[chapter] = {"pass": pass_, "before": previous if chapter_pass(previous, root) == pass_ else None,
                        "steps": bool(read_steps(path)), "ideas": [(name, switch_words(text, name)) for name in names],
                        "variants": ABLATION_VARIANTS.get(chapter, ())}
    return out


ABLATION_BEGIN = "<!-- ablation table: generated by common/ablation.py from docs/results/logs/{nn}/ablation_{nn}.csv -->"
ABLATION_END = "<!-- end ablation table -->"
LOG_DIR = os.path.join(ROOT, "docs", "results", "logs")  # one folder per chapter: logs/NN/
CHECK_SHAPES = ((2, 3, 1000, 64, True), (1, 2, 300, 128, False), (1, 1, 1, 128, True), (2, 1, 257, 128, True))
FIELDS = ("gpu", "variant", "kind", "flags", "impl", "batch", "heads", "seqlen", "headdim", "causal", "ms", "tflops",
          "attend_ms", "round_ms", "iters")
ROUNDS, WARMUP, ITERS = 3, 3, 20


def variants(chapter):
    """[(variant name, kind, flags)]: before, none, the ideas on one by one, each off alone (their -D
    flags), the run-time variants (the binary's flag); for a chapter built in steps: before, each step
    (step1 ... chapter), each idea off alone, the run-time variants; for a chapter with neither steps nor
    ideas: before, the chapter, the run-time variants. No before row where the chapter before has not
    the chapter's pass."""
    spec = ablations()[chapter]
    names = [name for name, _ in spec["ideas"]]
    out = [("before", "before", "")] if spec["before"] else []
    if spec.get("steps"):
        count = len(read_steps(os.path.join(ROOT, chapter, "attention.cu")))
        out += [(f"step{k}", "step", "") for k in range(1, count)] + [("chapter", "step", "")]
    elif not names:
        out.append(("chapter", "step", ""))
    else:
        out.append(("none", "step", " ".join(f"-D{n}=0" for n in names)))
        for k in range(1, len(names) + 1):
            off = names[k:]
            out.append(("chapter" if not off else f"plus_{names[k - 1].lower()}", "step",
                        " ".join(f"-D{n}=0" for n in off)))
    seen = {flags for _, _, flags in out}
    for name in names:
        flags = f"-D{name}=0"
        if flags not in seen:
            out.append((f"without_{name.lower()}", "without", flags))
    return out + [(variant, "variant", flag) for variant, flag, _ in spec["variants"]]


def variant_label(chapter, variant, kind):
    """The table's words for one variant."""
    spec = ablations()[chapter]
    if kind == "before":
        return f"{spec['before']} (the chapter before)"
    if spec.get("steps") and kind == "step":
        steps = read_steps(os.path.join(ROOT, chapter, "attention.cu"))
        step = steps[-1] if variant == "chapter" else steps[int(variant[len("step"):]) - 1]
        name = f"{chapter[:2]}.{step['step']}"
        return f"{name}: {step['adds']}" + (f" (**{chapter}**)" if variant == "chapter" else "")
    if kind == "variant":
        flag, words = next((f, w) for v, f, w in spec["variants"] if v == variant)
        return f"{chapter} with `{flag}` ({words})"
    if variant == "none":
        return "every idea off"
    if variant == "chapter":
        return f"+ {spec['ideas'][-1][1]}: **{chapter}**" if spec["ideas"] else f"**{chapter}**"
    if kind == "step":
        return "+ " + dict(spec["ideas"])[variant[len("plus_"):].upper()]
    return f"{chapter} with `{variant[len('without_'):].upper()}` off"


def variant_impl(chapter, variant):
    """The chapter a variant's binary is (the one before, for the before row; a step's own name)."""
    if variant == "before":
        return ablations()[chapter]["before"]
    if ablations()[chapter]["steps"] and variant.startswith("step"):
        return read_steps(os.path.join(ROOT, chapter, "attention.cu"))[int(variant[len("step"):]) - 1]["name"]
    return chapter


def plain_build(chapter, variant):
    """The Makefile's own build a variant is, where it is one (the chapter before; a step of a chapter
    of steps, or that chapter: BUILD/08_fp8.step3, BUILD/08_fp8), else None: a build of its own flags."""
    if variant == "before":
        return ablations()[chapter]["before"]
    if ablations()[chapter]["steps"] and (variant == "chapter" or variant.startswith("step")):
        return chapter if variant == "chapter" else f"{chapter}.{variant}"
    return None


def run_flags(chapter, variant):
    """The flags a run-time variant's binary runs with (09's deterministic: --deterministic); [] for any
    other row."""
    return [flag for name, flag, _ in ablations()[chapter]["variants"] if name == variant]


def case_args(chapter, variant, dims, warmup, iters):
    """The command line of a check or a timed run: the shape, its runs, the chapter's pass, the
    variant's run-time flags."""
    backward = ["--backward"] if ablations()[chapter]["pass"] == "backward" else []
    return shape_args(dims) + ["--warmup", str(warmup), "--iters", str(iters)] + backward + run_flags(chapter, variant)


def binary_path(build, chapter, variant):
    """The binary a row runs: its own build, the chapter row's for a run-time variant."""
    if run_flags(chapter, variant):
        variant = "chapter"
    plain = plain_build(chapter, variant)
    return os.path.join(build, plain) if plain else os.path.join(build, "ablation", variant, chapter)


def build_variant(build, make, chapter, variant, flags):
    """Build one variant with the Makefile (a build of its own, or its own BUILD folder); (ok, output tail)."""
    if plain_build(chapter, variant):
        target, extra = binary_path(build, chapter, variant), [f"BUILD={build}"]
    else:
        folder = os.path.join(build, "ablation", variant)
        target, extra = os.path.join(folder, chapter), [f"BUILD={folder}", f"EXTRA_NVFLAGS={flags}"]
    proc = subprocess.run(shlex.split(make) + ["--no-print-directory", "-s"] + extra + [target], cwd=ROOT,
                          env=make_env(), capture_output=True, text=True)
    return proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:]


def command_run(args):
    chapter = find_chapter(args.chapter)
    rows = variants(chapter)
    builds = [row for row in rows if not run_flags(chapter, row[0])]  # a run-time variant: the chapter's binary
    say(f"ablation of {chapter}: {len(rows)} variants, building {len(builds)} ...")
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        built = list(pool.map(lambda r: build_variant(args.build, args.make, chapter, r[0], r[2]), builds))
    for (variant, _, flags), (ok, tail) in zip(builds, built):
        if not ok:
            say(f"{variant} ({flags}): build failed:\n{tail}")
            return 1
    failed = 0
    for variant, _, flags in rows:
        impl = variant_impl(chapter, variant)
        for shape in CHECK_SHAPES:
            status, _, note = run_case(binary_path(args.build, chapter, variant), impl,
                                       case_args(chapter, variant, shape, 0, 1))
            if status == "skipped":
                say(f"ablation: {impl} did not run here: {note}")
                return 1
            if status != "PASS":
                failed += 1
                say(f"FAIL {variant} ({flags or 'defaults'}) {shape}: {status} {note or ''}")
    if failed:
        return 1
    say(f"every variant PASSes at {len(CHECK_SHAPES)} shapes; timing {args.rounds} rounds ...")
    samples = {}
    for rnd in range(args.rounds):
        for causal in (0, 1):
            shape = bench_shape(HEADLINE_D, HEADLINE_N, causal)
            dims = (shape["batch"], shape["heads"], shape["seqlen"], shape["headdim"], causal)
            for variant, _, _ in rows:
                check = [] if rnd == 0 else ["--no-check"]
                status, row, note = run_case(binary_path(args.build, chapter, variant), variant_impl(chapter, variant),
                                             case_args(chapter, variant, dims, WARMUP, ITERS) + check)
                if status not in ("PASS", "unchecked"):
                    say(f"FAIL {variant} {dims}: {status} {note or ''}")
                    return 1
                # attend_ms: the attention kernel alone where the chapter times it (08, without quantisation)
                samples.setdefault((variant, causal), []).append((row["ms"], row["attend_ms"]))
    out, tflops, gpu = [], TFLOPS_OF_PASS[ablations()[chapter]["pass"]], gpu_name() or "?"
    for causal in (0, 1):
        shape = bench_shape(HEADLINE_D, HEADLINE_N, causal)
        for variant, kind, flags in rows:
            got = samples[(variant, causal)]
            ms = statistics.median(s[0] for s in got)
            attend = [s[1] for s in got if s[1] is not None]
            out.append({"gpu": gpu, "variant": variant, "kind": kind, "flags": flags, "impl": variant_impl(chapter, variant),
                        **shape, "ms": f"{ms:.4f}", "tflops": f"{tflops(shape, ms):.1f}",
                        "attend_ms": f"{statistics.median(attend):.4f}" if attend else "",
                        "round_ms": " ".join(f"{s[0]:.4f}" for s in got), "iters": ITERS})
    path = args.out or csv_path(chapter)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(out)
    say(f"{path}: written")
    print(table_markdown(chapter, read_rows(path)))
    if not args.out:
        update_readme(chapter)
    return 0


# --- The table ------------------------------------------------------------------------------------

def csv_path(chapter):
    return os.path.join(LOG_DIR, chapter[:2], f"ablation_{chapter[:2]}.csv")


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def stale(chapter, rows):
    """What makes a CSV's rows another ablation than the chapter's now (its variants, their flags), in
    words; None where they are the same rows. A stale CSV makes no table: `make ablation` measures anew."""
    measured = [(r["variant"], r["kind"], r["flags"]) for r in rows if int(r["causal"]) == 0]
    if measured == variants(chapter):
        return None
    return (f"{os.path.relpath(csv_path(chapter), ROOT)} holds the rows {[v for v, _, _ in measured]}, the chapter's "
            f"ablation now {[v for v, _, _ in variants(chapter)]}: run `make ablation CH={chapter[:2]}` on a GPU")


def table_markdown(chapter, rows):
    """The README table from the CSV rows: ms and TFLOP/s per mask, and what each row changes
    (a step: x faster than the row above; a row without an idea, or a variant: x slower than the
    chapter)."""
    by = {(r["variant"], int(r["causal"])): r for r in rows}
    order = [r["variant"] for r in rows if int(r["causal"]) == 0]
    alone = any(r["attend_ms"] for r in rows)
    stepped = bool(ablations()[chapter]["steps"])
    steps = read_steps(os.path.join(ROOT, chapter, "attention.cu")) if stepped else []
    header = ["version", "file or flags" if stepped else "switches"]
    for mask in ("non-causal", "causal"):
        header += [f"{mask} ms", "TFLOP/s"] + (["attention ms"] if alone else []) + ["change"]
    body, prev = [], {}
    for variant in order:
        first = by[(variant, 0)]
        kind = first["kind"]
        if first["flags"]:
            how = f"`{first['flags']}`"
        elif stepped and (variant == "chapter" or variant.startswith("step")):
            step = steps[-1] if variant == "chapter" else steps[int(variant[len("step"):]) - 1]
            how = f"`{os.path.basename(step['source'])}`"
        else:
            how = "defaults" if kind != "before" else ""
        cells = [variant_label(chapter, variant, kind), how]
        for causal in (0, 1):
            row = by[(variant, causal)]
            ms = float(row["ms"])
            against_chapter = kind in ("without", "variant")
            ref = float(by[("chapter", causal)]["ms"]) if against_chapter else prev.get(causal)
            if against_chapter:
                change = f"{ms / ref:.2f}x slower" if ms >= ref else f"{ref / ms:.2f}x faster"
            elif ref is None:
                change = ""
            else:
                change = fmt_speedup(ref / ms)
            cells += [fmt_ms(ms), fmt_tflops(float(row["tflops"]))] + \
                ([fmt_ms(float(row["attend_ms"])) if row["attend_ms"] else ""] if alone else []) + [change]
            if not against_chapter:
                prev[causal] = ms
        body.append(cells)
    return table_caption(chapter, rows) + "\n\n" + markdown_table(header, body, "ll" + "r" * (len(header) - 2))


def table_caption(chapter, rows):
    """The shape, the pass (a backward's says so, and its FLOPs), how the times were taken, what
    `change` is, and where the CSV comes from."""
    spec, shape = ablations()[chapter], bench_shape(HEADLINE_D, HEADLINE_N, 0)
    rounds = len(rows[0]["round_ms"].split())
    backward = "the backward (dQ, dK, dV), FLOPs 2.5x the forward's; " if spec["pass"] == "backward" else ""
    variants = "".join(f", or with `{flag}`" for _, flag, _ in spec["variants"])
    gpu = rows[0].get("gpu") or "the GPU not recorded"
    return (f"*{gpu}, D={HEADLINE_D}, N={HEADLINE_N}, B={shape['batch']}, H={shape['heads']}; {backward}median of {rounds} "
            f"interleaved rounds, each the median of {rows[0].get('iters') or ITERS} runs; `change`: a step's speedup over the row "
            f"above, or how much slower the chapter is without one idea{variants}; `docs/results/logs/"
            f"{chapter[:2]}/ablation_{chapter[:2]}.csv`, written by `make ablation CH={chapter[:2]}`.*")


def update_readme(chapter):
    """Refill the chapter README's table from its CSV; False when the README has no markers or the
    CSV is stale."""
    path = os.path.join(ROOT, chapter, "README.md")
    with open(path) as f:
        text = f.read()
    begin = ABLATION_BEGIN.format(nn=chapter[:2])
    if begin not in text or ABLATION_END not in text:
        say(f"{path}: no ablation markers, left alone")
        return False
    why = stale(chapter, read_rows(csv_path(chapter)))
    if why:
        say(f"{path}: left alone: {why}")
        return False
    if write_if_changed(path, replace_between(text, begin, ABLATION_END, table_markdown(chapter,
                                                                                       read_rows(csv_path(chapter))))):
        say(f"{path}: ablation table updated")
    return True


def find_chapter(arg):
    chapter = chapter_named(arg)
    if chapter in ablations():
        return chapter
    raise SystemExit(f"ablation: no ablation for chapter '{arg}' (chapters: {', '.join(ablations())})")


def command_table(args):
    for chapter in [find_chapter(a) for a in args.chapters] or list(ablations()):
        if os.path.exists(csv_path(chapter)):
            update_readme(chapter)
    return 0


def diff_source(name):
    """(label, text) of a `make diff` operand: a chapter by number or folder (04, 4, 04_fused) as its
    defaults compile it, or a step of a chapter built in steps (08.3) as its step file holds it."""
    folder = chapter_named(name)
    if folder is None:
        raise SystemExit(f"make diff: no chapter '{name}' (name one by its number, e.g. 04, or a step, e.g. 08.3)")
    path = os.path.join(ROOT, folder, "attention.cu")
    if not name.partition(".")[2]:
        return f"{folder}/attention.cu", without_switches(open(path).read())
    try:
        build = build_of(name)
    except ValueError as exc:
        raise SystemExit(f"make diff: {exc}") from None
    source = path if build == folder else read_steps(path)[int(build.rpartition(".step")[2]) - 1]["source"]
    return os.path.relpath(source, ROOT), open(source).read()


def command_diff(args):
    """`make diff`: the two chapters' (or steps') sources as they compile, unified diff."""
    (name_a, text_a), (name_b, text_b) = diff_source(args.a), diff_source(args.b)
    try:
        sys.stdout.writelines(difflib.unified_diff(text_a.splitlines(keepends=True), text_b.splitlines(keepends=True),
                                                   name_a, name_b))
        sys.stdout.flush()
    except BrokenPipeError:  # a reader that stopped early (| head)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def command_list(_args):
    for chapter, spec in ablations().items():
        backward = ", on its backward" if spec["pass"] == "backward" else ""
        print(f"{chapter} (before: {spec['before'] or 'none of the same pass'}{backward})")
        for name, what in spec["ideas"]:
            print(f"  -D{name}=0   turns off {what}")
        for _, flag, what in spec["variants"]:
            print(f"  {flag}   runs it with {what}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("chapter")
    run.add_argument("--build", default="build")
    run.add_argument("--make", default="make")
    run.add_argument("--rounds", type=int, default=ROUNDS)
    run.add_argument("--out", help="write the CSV here instead of docs/results/logs/NN/ (the README is left alone)")
    table = sub.add_parser("table")
    table.add_argument("chapters", nargs="*")
    sub.add_parser("list")
    diff = sub.add_parser("diff")
    diff.add_argument("a")
    diff.add_argument("b")
    args = parser.parse_args(argv)
    return {"run": command_run, "table": command_table, "list": command_list, "diff": command_diff}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
