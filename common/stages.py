#!/usr/bin/env python3
"""The stage table: run every chapter, sweep the benchmark shapes, write the results.

  stages.py run     --build DIR CH...                       (make run)
      Each chapter on its default shape; prints the stage table. Exit 1 on FAIL or error.
  stages.py bench   --build DIR CH... [--pass forward|backward|both] [--quick | --seqlens N,N...] [--headdim D]
                    [--out DIR] [--readme FILE]
      (make bench) The benchmark sweep (docs/design.md), then the PyTorch anchors when PyTorch has a
      GPU; writes DIR/<gpu>.csv, .notes.csv, .env, .md (and .png with matplotlib), then `table`.
      Then (--pass both, the default) the backward's sweep: each chapter among CH that has a backward
      pass (its steps first where it is built in steps: a backward chapter's steps are the backward's,
      not the forward's), timed with --backward on the same shapes, and again in each of its modes (impl
      09_backward.deterministic: --backward --deterministic), then PyTorch's backward anchors; their
      rows go to DIR/<gpu>.backward.csv (.notes.csv, .env, .md beside it), the forward's files
      untouched. --pass backward: that sweep alone; --pass forward: the forward's alone. Exit 1 if a
      chapter row FAILed.
  stages.py compare --build DIR [--pass forward|backward|both] [--quick | --seqlens N,N...] [--headdim D]
                    [--out DIR] [--readme FILE]
      (make compare) Only the PyTorch anchors, merged into DIR/<gpu>.csv (torch_* rows replaced), and
      the backward's into DIR/<gpu>.backward.csv, then `table`.
  stages.py memory  --build DIR CH... [--csv FILE] [--readme FILE]
      The device memory of each chapter (the harness's device_bytes) and each PyTorch anchor (its
      peak) at the headline shapes, merged into the results CSV; `bench` records it for every row.
  stages.py table   [--csv FILE] [--readme FILE]
      Regenerate the Markdown from a results CSV (default: the one the README's stage table
      names, else the newest docs/results/*.csv):
      <gpu>.md beside it, the stage table in the README (default: the repository's), the
      measured table in every NN_name/README.md beside that README, and every measured number
      quoted in the prose of those READMEs and of docs/*.md (inline markers, common/report.py);
      from <gpu>.backward.csv beside it, where there is one, <gpu>.backward.md and the backward's
      measured block of the chapter READMEs that have one.

The CSV header is exactly CSV_FIELDS (a backward file's: then GRAD_FIELDS); why a row was skipped or
failed goes to <gpu>.notes.csv.

Only NumPy and the standard library are needed; PyTorch and matplotlib are optional.
"""
import argparse
import concurrent.futures
import datetime
import glob
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "common"))
from report import (STAGE_BEGIN, STAGE_END, fmt_ms, fmt_rel, fmt_tflops, print_backward_summary,  # noqa: E402
                    print_summary, plot_results, regenerate_tables, run_stage_table, say)
from results import (BENCH_DS, BENCH_ITERS, BENCH_NS, BENCH_WARMUP, GRAD_FIELDS, HEADLINE_D,  # noqa: E402
                     HEADLINE_N, PASSES, QUICK_NS, backward_runs, chapter_dtypes, chapter_pass, bench_shape,
                     bench_shapes, collect_env, csv_pass, env_path, gpu_name, gpu_slug, impl_command, is_anchor,
                     make_row, pass_csv, read_env, read_results, row_key, shape_label, step_binary, steps, work,
                     write_env, write_results)
from runner import chapters as chapters_of, classify, run_binary  # noqa: E402

# --- Running the chapters: the sweep and its skip policy -------------------------------------
RUNS_PER_SHAPE = BENCH_WARMUP + BENCH_ITERS + 1   # warm-up, timed, and the checked run
BUDGET_S = 15           # a (chapter, shape) projected to take longer is skipped (01 at 16k: ~20 s)


def projected_seconds(last_work, last_ms, new_work, runs=RUNS_PER_SHAPE):
    """Seconds a binary should take on new_work, from its ms on last_work."""
    return last_ms * new_work / last_work * runs / 1000.0


def too_slow(last, shape, budget_s=BUDGET_S):
    """The skip note when the projection from last = (work, ms) exceeds the budget, else None."""
    if last is None:
        return None
    seconds = projected_seconds(last[0], last[1], work(shape))
    return f"projected {math.ceil(seconds)} s" if seconds > budget_s else None


def chapter_adds(binary, name):
    """The one-line 'what it adds' from `BIN --dry-run` ('' when unavailable)."""
    code, stdout, _ = run_binary(binary, ["--dry-run"], timeout=60)
    first = stdout.splitlines()[0] if code == 0 and stdout.strip() else ""
    return first[len(name) + 2:] if first.startswith(name + ": ") else first


def command_run(args):
    """`make run`: every chapter on its default shape, then the stage table."""
    results, adds = [], {}
    for name, binary, _ in chapter_binaries(args.build, args.chapters):
        say(f"running {name} ...")
        adds[name] = chapter_adds(binary, name)
        code, stdout, stderr = run_binary(binary, ["--csv"])
        status, row, note = classify(name, code, stdout, stderr)
        if status == "usage":
            status = "error"
        results.append((name, status, row, note))
        if note and status != "skipped":  # the skipped ones' reasons are said once, below
            say(f"  {name}: {status}: {note}")
    shape = next((r for _, _, r, _ in results if r), None)
    say("")
    if shape:
        say(f"Stage table, default shape {shape_label(shape)}, fp16 "
            "(speedups compare ms; rel_l2 vs the float64 reference):")
    say(run_stage_table(results, adds, shutil.get_terminal_size((120, 24)).columns))
    skipped = [name for name, status, _, _ in results if status == "skipped"]
    bad = [name for name, status, _, _ in results if status in ("FAIL", "error")]
    if skipped:
        why = sorted({note for name, status, _, note in results if status == "skipped" and note})
        say(f"skipped (exit 77, not a failure): {', '.join(skipped)}" + (f": {'; '.join(why)}" if why else ""))
    if bad:
        say(f"failed: {', '.join(bad)}")
    return 1 if bad else 77 if len(skipped) == len(results) else 0


def shape_flags(shape, warmup, iters, pass_="forward"):
    """A binary's command line for a shape dict, with --csv (and --backward for that pass)."""
    flags = ["--batch", shape["batch"], "--heads", shape["heads"], "--seqlen", shape["seqlen"],
             "--headdim", shape["headdim"], "--warmup", warmup, "--iters", iters, "--csv"]
    return ([str(f) for f in flags] + (["--causal"] if shape["causal"] else [])
            + (["--backward"] if pass_ == "backward" else []))


def bench_one(binary, name, dtype, shape, last, unsupported, pass_="forward"):
    """One chapter's binary at one bench shape, under the skip policy, with the run-time flags of the
    impl `name` (09_backward.deterministic: --deterministic); returns a result row (dtype: the one its
    rows carry, also on the rows of runs that printed none; a backward row also has each gradient's
    error, GRAD_FIELDS)."""
    unknown = (None,) * len(GRAD_FIELDS) if pass_ == "backward" else None  # a backward row's, not measured
    if binary in unsupported:
        return make_row(name, shape, "SKIP", note=unsupported[binary], dtype=dtype, grads=unknown)
    slow = too_slow(last, shape)
    if slow:
        return make_row(name, shape, "SKIP", note=slow, dtype=dtype, grads=unknown)
    build, flags = impl_command(name)
    code, stdout, stderr = run_binary(binary, shape_flags(shape, BENCH_WARMUP, BENCH_ITERS, pass_) + flags)
    status, row, note = classify(build, code, stdout, stderr)
    if status == "skipped":
        unsupported[binary] = note
        return make_row(name, shape, "SKIP", note=note, dtype=dtype, grads=unknown)
    if status == "usage":
        return make_row(name, shape, "SKIP", note=note, dtype=dtype, grads=unknown)
    if status == "error":
        return make_row(name, shape, "FAIL", note=note, dtype=dtype, grads=unknown)
    grads = tuple(row.get(k) for k in GRAD_FIELDS) if pass_ == "backward" else None
    return make_row(name, shape, status, row["ms"], row["tflops"], row["rel_l2"], note=note, dtype=row["dtype"],
                    device_bytes=row["device_bytes"], grads=grads)


def row_progress(row, said=None):
    """One progress line for a finished row; a note already in `said` (a set) is not repeated."""
    name = row["impl"]
    if row["ms"] is None:
        note = row.get("note", "")
        if said is not None:
            note, _ = ("(as above)" if note in said else note), said.add(note)
        return f"  {name:<20} {row['status']:<5} {note}"
    return (f"  {name:<20} {row['status']:<5} {fmt_ms(row['ms']):>7} ms "
            f"{fmt_tflops(row['tflops']):>7} TFLOP/s  rel_l2 {fmt_rel(row['rel_l2'])}"
            + (f"  ({row['note']})" if row.get("note") else ""))


def step_binaries(build, chapter):
    """[(impl, binary, dtype)] of a chapter's steps but the last (08.1 ... 08.4: BUILD/08_fp8.step1 ...)."""
    return [(step, step_binary(build, chapter, step), chapter_dtypes().get(step, "fp16"))
            for step in steps().get(chapter, ())]


def chapter_binaries(build, chapters):
    """[(impl, binary, dtype)] of the forward's sweep: each chapter, its steps first where it is built in
    steps of the forward (08.1 ... 08.4, then 08_fp8, the last step; a backward chapter's steps are the
    backward's)."""
    out = []
    for name in chapters:
        out += step_binaries(build, name) if chapter_pass(name) == "forward" else []
        out.append((name, os.path.join(build, name), chapter_dtypes().get(name, "fp16")))
    return out


def backward_binaries(build, chapters):
    """[(impl, binary, dtype)] of the backward's sweep: each chapter that has a backward pass, its steps
    first where it is built in steps (09.1 ...: BUILD/09_backward.step1 ...), then the chapter and its
    modes, both on the chapter's own binary (09_backward, 09_backward.deterministic: BUILD/09_backward)."""
    out = []
    for chapter in (c for c in chapters if backward_runs(c)):
        out += step_binaries(build, chapter)
        out += [(name, os.path.join(build, impl_command(name)[0]), "fp16") for name in backward_runs(chapter)]
    return out


def pass_binaries(build, chapters, pass_):
    """The binaries a pass times: chapter_binaries for the forward, backward_binaries for the backward."""
    return backward_binaries(build, chapters) if pass_ == "backward" else chapter_binaries(build, chapters)


def bench_chapters(build, chapters, shapes, pass_="forward"):
    """Every chapter (and step build, and mode) of the pass on every shape; None when every binary was
    skipped (no GPU)."""
    rows, last, unsupported, said = [], {}, {}, set()
    binaries = pass_binaries(build, chapters, pass_)
    for i, shape in enumerate(shapes):
        say(f"[{i + 1}/{len(shapes)}] {shape_label(shape)}{' (backward)' if pass_ == 'backward' else ''}")
        for name, binary, dtype in binaries:
            key = (name, shape["headdim"], shape["causal"])
            row = bench_one(binary, name, dtype, shape, last.get(key), unsupported, pass_)
            if row["ms"] is not None:
                last[key] = (work(shape), row["ms"])
            rows.append(row)
            say(row_progress(row, said))
        if i == 0 and len(unsupported) == len({binary for _, binary, _ in binaries}):
            return None
    return rows


def torch_gpu_ready(skip_line):
    """True when PyTorch imports and sees a GPU; otherwise print skip_line (one line)."""
    try:
        import torch
    except ImportError:
        say(skip_line)
        return False
    if not torch.cuda.is_available():
        say(skip_line.replace("PyTorch not found (pip install torch)", "PyTorch sees no CUDA GPU").replace("PyTorch not found", "PyTorch sees no CUDA GPU"))
        return False
    return True


def cache_dir():
    """Where the binaries cache inputs and references: $FA_CACHE or <repo>/.cache."""
    return os.environ.get("FA_CACHE") or os.path.join(ROOT, ".cache")


def measure_anchors(shapes, pass_="forward"):
    """The anchor rows of a pass for shapes (PyTorch must be importable)."""
    import anchors
    return anchors.run_anchors(shapes, cache_dir(), warmup=BENCH_WARMUP, iters=BENCH_ITERS, pass_=pass_)


def prepare_references(shapes, command="backward", jobs=None):
    """Make every shape's inputs and float64 reference in the binaries' cache ahead of the sweep, `jobs`
    shapes at once, the largest first, each process with its share of the CPU's threads. The backward's
    reference costs O(N²·D) per head at every shape (the key rows' dK and dV need every query's P), tens
    of seconds at 16k, which the first binary of each shape would otherwise compute alone, one shape
    after the other. What is already there is kept; a shape that fails is left to its binaries, which
    say why."""
    import anchors
    cpus = os.cpu_count() or 1
    jobs = max(1, min(len(shapes), jobs or cpus // 2))
    threads = str(max(1, cpus // jobs))
    env = dict(os.environ, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    script = os.path.join(ROOT, "common", "reference.py")
    order = sorted(shapes, key=lambda s: -work(s) * (1 if s["causal"] else 2))
    say(f"references ({command}): {len(order)} shapes, {jobs} at once, {threads} threads each")
    started = time.monotonic()

    def make(shape):
        _, argv = anchors.reference_args(cache_dir(), shape, command)
        begin = time.monotonic()
        done = subprocess.run([sys.executable, script] + argv, capture_output=True, text=True, env=env)
        return shape, done, time.monotonic() - begin

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for shape, done, seconds in pool.map(make, order):
            why = (done.stderr.strip().splitlines() or ["failed"])[-1] if done.returncode else ""
            say(f"  {shape_label(shape)}: {f'FAILED: {why}' if why else f'{seconds:.0f} s'}")
    say(f"references ready in {time.monotonic() - started:.0f} s")


def results_csv(out_dir, pass_="forward"):
    """This GPU's results CSV of a pass in out_dir (docs/results/NVIDIA_H200.csv, .backward.csv)."""
    return pass_csv(os.path.join(out_dir, gpu_slug(gpu_name()) + ".csv"), pass_)


def save_results(out_dir, rows, env, readme, pass_="forward"):
    """Write the pass's <gpu>.csv/.notes.csv/.env (and the forward's .png), then regenerate every table."""
    csv_path = results_csv(out_dir, pass_)
    write_results(csv_path, rows)
    write_env(env_path(csv_path), env)
    say(f"{csv_path}: {len(rows)} rows written")
    if pass_ == "forward":
        plot_results(rows, os.path.splitext(csv_path)[0] + ".png", env["gpu"])
    regenerate_tables(csv_path, readme)
    return csv_path


def passes_of(args):
    """The passes a command runs: --pass forward, backward, or both (forward first)."""
    return PASSES if args.pass_ == "both" else (args.pass_,)


def command_bench(args):
    """`make bench`: each pass's sweep, its anchors, its results files, and every table."""
    shapes = bench_shapes(args.quick, args.headdim, args.seqlens)
    chapters = [c.rstrip("/") for c in args.chapters]
    if args.pass_ == "backward" and not backward_binaries(args.build, chapters):
        print(f"stages.py bench --pass backward: none of {', '.join(chapters)} has a backward pass "
              f"(the chapters that have one: {', '.join(c for c in chapters_of(ROOT) if backward_runs(c))})",
              file=sys.stderr)
        return 2
    codes = []
    for pass_ in passes_of(args):
        if pass_ == "backward" and not backward_binaries(args.build, chapters):
            continue  # (--pass both) no chapter here has a backward pass
        codes.append(bench_pass(args, chapters, shapes, pass_))
        if codes[-1] == 77:
            break  # no GPU: the other pass would skip the same way
    return 1 if 1 in codes else 77 if codes == [77] else 0


def bench_pass(args, chapters, shapes, pass_):
    """One pass of `make bench`: its sweep, its anchors, its results file (other rows kept) and the tables;
    0, 1 when a chapter row FAILed, 77 when every chapter skipped (nothing written)."""
    backward = pass_ == "backward"
    binaries = pass_binaries(args.build, chapters, pass_)
    say(f"bench{' --backward' if backward else ''}: {len(binaries)} builds x {len(shapes)} shapes"
        f"{' (--quick)' if args.quick else ''}; a shape projected over {BUDGET_S} s is skipped")
    if backward and gpu_name():  # (no GPU: the binaries will skip, and need no reference)
        prepare_references(shapes)
    rows = bench_chapters(args.build, chapters, shapes, pass_)
    if rows is None:
        say("every chapter skipped (exit 77, their reasons above): nothing measured, docs/results left alone")
        torch_gpu_ready("PyTorch not found: the anchors would be skipped too (pip install torch for make compare)")
        return 77
    if torch_gpu_ready("PyTorch not found: anchor rows skipped (pip install torch to measure them)"):
        rows += measure_anchors(shapes, pass_)
    env = collect_env(shlex.join([sys.executable] + sys.argv))
    env["pass"] = pass_
    kept = rows_not_measured(args.out, rows, pass_)
    if kept:  # and what the file said of where its rows come from
        before = read_env(env_path(results_csv(args.out, pass_)))
        env.update({k: v for k, v in before.items() if k.startswith("rows_")})
        env["kept_rows"] = (f"{len(kept)} rows of chapters or shapes this run did not measure, kept from the file "
                            "before it (the rows_* lines say where they come from)")
    save_results(args.out, kept + rows, env, args.readme, pass_)
    (print_backward_summary if backward else print_summary)(rows)
    failed = [r for r in rows if r["status"] == "FAIL" and not is_anchor(r["impl"])]
    for r in failed:
        say(f"FAIL {r['impl']}{' --backward' if backward else ''} {shape_label(r)}: "
            f"{r.get('note') or 'rel_l2 ' + fmt_rel(r['rel_l2'])}")
    return 1 if failed else 0


def rows_not_measured(out_dir, rows, pass_="forward"):
    """The rows of out_dir's results CSV of the pass for this GPU that `rows` do not replace (other
    chapters, other shapes: a bench of a few chapters, --quick, --headdim or --seqlens keeps the rest of the
    file)."""
    csv_path = results_csv(out_dir, pass_)
    if not os.path.exists(csv_path):
        return []
    measured = {row_key(r) for r in rows}
    return [r for r in read_results(csv_path) if row_key(r) not in measured]


def command_compare(args):
    """`make compare`: the anchors only, merged into <gpu>.csv (and the backward's into <gpu>.backward.csv)."""
    if not torch_gpu_ready("make compare: skipped: PyTorch not found (pip install torch)"):
        return 77
    shapes = bench_shapes(args.quick, args.headdim, args.seqlens)
    for pass_ in passes_of(args):
        if pass_ == "backward":
            prepare_references(shapes)
        rows = measure_anchors(shapes, pass_)
        csv_path = results_csv(args.out, pass_)
        kept = [r for r in read_results(csv_path) if not is_anchor(r["impl"])] if os.path.exists(csv_path) else []
        env = read_env(env_path(csv_path)) or dict(collect_env("(none: make compare only)"), **{"pass": pass_})
        env["compare_command"] = shlex.join([sys.executable] + sys.argv)
        env["compare_date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        save_results(args.out, kept + rows, env, args.readme, pass_)
        (print_backward_summary if pass_ == "backward" else print_summary)(kept + rows)
    return 0


def command_memory(args):
    """`memory`: the device memory of every chapter and anchor at the headline shapes, merged
    into the results CSV's device_bytes column (the times are left as they are)."""
    shapes = [bench_shape(HEADLINE_D, HEADLINE_N, causal) for causal in (0, 1)]
    measured = {}
    for shape in shapes:
        for name, binary, _ in chapter_binaries(args.build, [c.rstrip("/") for c in args.chapters]):
            status, row, note = classify(name, *run_binary(binary, shape_flags(shape, 0, 1) + ["--no-check"]))
            if row is None or row["device_bytes"] is None:
                say(f"  {name:<20} {status} {note or ''}")
                continue
            measured[row_key(make_row(name, shape, status, dtype=row["dtype"]))] = row["device_bytes"]
            say(f"  {os.path.basename(binary):<20} {shape_label(shape)}: {row['device_bytes'] / 1e6:.0f} MB")
    if torch_gpu_ready("PyTorch not found: anchors' device memory skipped"):
        import anchors
        for row in anchors.run_anchors(shapes, cache_dir(), warmup=1, iters=1):
            if row.get("device_bytes") is not None:
                measured[row_key(row)] = row["device_bytes"]
    csv_path = args.csv or default_csv()
    rows = read_results(csv_path)
    for row in rows:
        if row_key(row) in measured:
            row["device_bytes"] = measured[row_key(row)]
    write_results(csv_path, rows)
    say(f"{csv_path}: device_bytes of {sum(row_key(r) in measured for r in rows)} rows")
    regenerate_tables(csv_path, args.readme)
    return 0


def default_csv(folder=os.path.join(ROOT, "docs", "results"), readme=os.path.join(ROOT, "README.md")):
    """The results CSV the READMEs quote: the one the README's stage table names, where it is in folder
    (the published GPU's, whichever other GPU's files lie beside it); else the newest forward results
    CSV in folder (`table` reads the backward's beside it), or a backward CSV where no forward one is
    beside it; None if there is none."""
    found = [p for p in glob.glob(os.path.join(folder, "*.csv")) if not p.endswith(".notes.csv")]
    named = os.path.join(folder, published_csv(readme) or "")
    if named in found:
        return named
    forward = [p for p in found if csv_pass(p) == "forward"]
    alone = [p for p in found if csv_pass(p) == "backward" and pass_csv(p, "forward") not in found]
    found = forward or alone
    return max(found, key=os.path.getmtime) if found else None


def published_csv(readme):
    """The file name of the results CSV that the README's stage table says it comes from, or None."""
    try:
        with open(readme) as f:
            text = f.read()
    except OSError:
        return None
    table = text.partition(STAGE_BEGIN)[2].partition(STAGE_END)[0]
    match = re.search(r"docs/results/([\w.-]+\.csv)", table)
    return match.group(1) if match else None


def command_table(args):
    """`table`: regenerate the Markdown from a results CSV."""
    path = args.csv or default_csv()
    if not path or not os.path.exists(path):
        print(f"stages.py table: no results CSV ({path or 'docs/results/*.csv'}): run make bench "
              "or pass --csv FILE", file=sys.stderr)
        return 2
    try:
        regenerate_tables(path, args.readme)
    except (ValueError, KeyError) as exc:
        print(f"stages.py table: {exc}", file=sys.stderr)
        return 2
    return 0


def seqlen_list(text):
    """--seqlens: a comma-separated list of the bench's N."""
    try:
        ns = [int(n) for n in text.split(",")]
    except ValueError:
        ns = None
    if not ns or any(n not in BENCH_NS for n in ns):
        raise argparse.ArgumentTypeError(f"{text!r}: expected N from {', '.join(map(str, BENCH_NS))}, "
                                         "comma-separated")
    return ns


def parse_args(argv):
    """The command line of the four subcommands."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="every chapter on its default shape (make run)")
    bench = sub.add_parser("bench", help="the benchmark sweep (make bench)")
    compare = sub.add_parser("compare", help="PyTorch anchors only (make compare)")
    table = sub.add_parser("table", help="regenerate the Markdown from a results CSV")
    memory = sub.add_parser("memory", help="device memory at the headline shapes -> the results CSV")
    for p in (run, bench, compare, memory):
        p.add_argument("--build", default="build", help="folder of the chapter binaries")
    for p in (run, bench, memory):
        p.add_argument("chapters", nargs="+", metavar="CH", help="chapter names, in order")
    for p in (bench, compare):
        p.add_argument("--pass", dest="pass_", choices=PASSES + ("both",), default="both",
                       help="the forward's sweep, the backward's (chapters with a backward pass, in each of "
                            "their modes, PyTorch's backward), or both (default)")
        only = p.add_mutually_exclusive_group()
        only.add_argument("--quick", action="store_true", help=f"only N in {QUICK_NS}")
        only.add_argument("--seqlens", type=seqlen_list, metavar="N,N...",
                          help=f"only these N, of {', '.join(map(str, BENCH_NS))} (a sweep split by N)")
        p.add_argument("--headdim", type=int, choices=BENCH_DS, help="only this D (a sweep split in two runs, "
                                                                      "each with its anchors)")
        p.add_argument("--out", default=os.path.join("docs", "results"), help="results folder")
    for p in (table, memory):
        p.add_argument("--csv", help="results CSV (default: the one the README's stage table names, else the newest "
                                     "docs/results/*.csv; table: the "
                                     "<gpu>.backward.csv beside it too)")
    for p in (bench, compare, table, memory):
        p.add_argument("--readme", default=os.path.join(ROOT, "README.md"),
                       help="README with the stage-table markers; chapter READMEs beside it")
    return parser.parse_args(argv)


def main(argv=None):
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    commands = {"run": command_run, "bench": command_bench, "compare": command_compare,
                "table": command_table, "memory": command_memory}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
