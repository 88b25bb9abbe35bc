#!/usr/bin/env python3
"""The stage table: run every chapter, sweep the benchmark shapes, write the results.

  stages.py run     --build DIR CH...                       (make run)
      Each chapter on its default shape; prints the stage table. Exit 1 on FAIL or error.
  stages.py bench   --build DIR CH... [--quick] [--out DIR] [--readme FILE]   (make bench)
      The benchmark sweep (docs/design.md), then the PyTorch anchors when PyTorch has a GPU; writes
      DIR/<gpu>.csv, .notes.csv, .env, .md (and .png with matplotlib), then `table`.
      Exit 1 if a chapter row FAILed.
  stages.py compare --build DIR [--quick] [--out DIR] [--readme FILE]        (make compare)
      Only the PyTorch anchors, merged into DIR/<gpu>.csv (torch_* rows replaced), then `table`.
  stages.py table   [--csv FILE] [--readme FILE]
      Regenerate the Markdown from a results CSV (default: the newest docs/results/*.csv):
      <gpu>.md beside it, the stage table in the README (default: the repository's) and the
      measured table in every NN_name/README.md beside that README.

The CSV header is exactly CSV_FIELDS; why a row was skipped or failed goes to <gpu>.notes.csv.

Only NumPy and the standard library are needed; PyTorch and matplotlib are optional.
"""
import argparse
import csv
import datetime
import glob
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "common"))
from chapters import CHAPTERS_BEGIN, CHAPTERS_END, chapters_markdown, read_chapters  # noqa: E402
from results import (ANCHORS, CSV_FIELDS, INT_FIELDS, forward_tflops, make_row,  # noqa: E402
                     shape_label, work)

# --- The benchmark (docs/design.md) -----------------------------------------------------------
BENCH_DS = (128, 64)
BENCH_NS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_NS = (1024, 4096)
TOTAL_TOKENS = 16384    # B = TOTAL_TOKENS / N
HIDDEN = 2048           # H = HIDDEN / D
HEADLINE_D, HEADLINE_N = 128, 4096
BENCH_WARMUP, BENCH_ITERS = 3, 10
RUNS_PER_SHAPE = BENCH_WARMUP + BENCH_ITERS + 1   # warm-up, timed, and the checked run
BUDGET_S = 15           # a (chapter, shape) projected to take longer is skipped (01 at 16k: ~20 s)
BINARY_TIMEOUT_S = 600  # a binary still running after this is counted as an error
FA2, CUDNN = "torch_flash", "torch_cudnn"

FLOAT_FIELDS = ("ms", "tflops", "rel_l2")
KEY_FIELDS = ("impl", "batch", "heads", "seqlen", "headdim", "causal")
NOTE_FIELDS = KEY_FIELDS + ("note",)
TIMED = ("PASS", "unchecked")   # statuses whose timing is shown

STAGE_BEGIN, STAGE_END = "<!-- stage-table:begin -->", "<!-- stage-table:end -->"
MEASURED_BEGIN, MEASURED_END = "<!-- measured:begin -->", "<!-- measured:end -->"


def say(text=""):
    """Print one progress line at once."""
    print(text, flush=True)


# --- Numbers ------------------------------------------------------------------------------

def fmt_ms(ms):
    """Milliseconds to 3 significant digits (0.123, 1.23, 12.3, 123); '-' when missing."""
    if ms is None:
        return "-"
    for limit, decimals in ((100, 0), (10, 1), (1, 2)):
        if ms >= limit:
            return f"{ms:.{decimals}f}"
    return f"{ms:.3f}"


def fmt_tflops(tflops):
    """TFLOP/s with one decimal; '-' when missing."""
    return "-" if tflops is None else f"{tflops:.1f}"


def fmt_speedup(ratio):
    """A speedup like 12.3x, or 1.04x below 10x (small steps matter); '-' when missing."""
    if ratio is None:
        return "-"
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2f}x"


def fmt_percent(percent):
    """A percentage like 45%; '-' when missing."""
    return "-" if percent is None else f"{percent:.0f}%"


def fmt_rel(value):
    """A relative error like 3.1e-04; '-' when missing."""
    return "-" if value is None else f"{value:.1e}"


def speedup(base_ms, ms):
    """How many times faster ms is than base_ms; None when either is missing."""
    if base_ms is None or ms is None or ms <= 0:
        return None
    return base_ms / ms


def percent_of(tflops, anchor_tflops):
    """tflops as a percentage of anchor_tflops; None when either is missing."""
    if tflops is None or anchor_tflops is None or anchor_tflops <= 0:
        return None
    return 100.0 * tflops / anchor_tflops


def n_label(n):
    """A sequence length as the papers write it: 512, 1k, 16k."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# --- Shapes and the skip rule ---------------------------------------------------------------

def bench_shape(headdim, seqlen, causal):
    """The benchmark shape for D and N: 16k tokens, hidden 2048."""
    return {"batch": TOTAL_TOKENS // seqlen, "heads": HIDDEN // headdim, "seqlen": seqlen,
            "headdim": headdim, "causal": causal}


def bench_shapes(quick=False):
    """Every bench shape, N ascending within each (D, causal), as the skip rule needs."""
    ns = QUICK_NS if quick else BENCH_NS
    return [bench_shape(d, n, c) for d in BENCH_DS for c in (0, 1) for n in ns]


def projected_seconds(last_work, last_ms, new_work, runs=RUNS_PER_SHAPE):
    """Seconds a binary should take on new_work, from its ms on last_work."""
    return last_ms * new_work / last_work * runs / 1000.0


def too_slow(last, shape, budget_s=BUDGET_S):
    """The skip note when the projection from last = (work, ms) exceeds the budget, else None."""
    if last is None:
        return None
    seconds = projected_seconds(last[0], last[1], work(shape))
    return f"projected {math.ceil(seconds)} s" if seconds > budget_s else None


def gpu_slug(name):
    """A file name for a GPU: the first line, spaces to '_'; 'unknown_gpu' if empty."""
    lines = (name or "").strip().splitlines()
    first = lines[0].strip() if lines else ""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", first).strip("_")
    return slug or "unknown_gpu"


# --- Result rows and files ----------------------------------------------------------------

def row_key(row):
    """What identifies a row: impl and shape."""
    return tuple(row[k] for k in KEY_FIELDS)


def format_value(value):
    """A CSV cell: '' for None, the shortest exact text for a float."""
    if value is None:
        return ""
    return repr(float(value)) if isinstance(value, float) else str(value)


def parse_value(field, text):
    """A CSV cell back to its type."""
    text = (text or "").strip()
    if field in INT_FIELDS:
        return int(text)
    if field in FLOAT_FIELDS:
        return float(text) if text else None
    return text


def notes_path(csv_path):
    """Where the skip/fail notes of a results CSV live: <gpu>.notes.csv."""
    return os.path.splitext(csv_path)[0] + ".notes.csv"


def write_results(path, rows):
    """Write rows to path (exact CSV_FIELDS header) and their notes to the .notes.csv beside it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(CSV_FIELDS)
        for row in rows:
            writer.writerow([format_value(row.get(k)) for k in CSV_FIELDS])
    with open(notes_path(path), "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(NOTE_FIELDS)
        for row in rows:
            if row.get("note"):
                writer.writerow([format_value(row.get(k)) for k in NOTE_FIELDS])


def read_results(path):
    """Rows of a results CSV, with the notes of its .notes.csv (if any) attached."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in CSV_FIELDS if k not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a results CSV (missing columns {', '.join(missing)})")
        rows = [{k: parse_value(k, line[k]) for k in CSV_FIELDS} for line in reader]
    notes = {}
    if os.path.exists(notes_path(path)):
        with open(notes_path(path), newline="") as f:
            for line in csv.DictReader(f):
                key = tuple(parse_value(k, line[k]) for k in KEY_FIELDS)
                notes[key] = line["note"]
    for row in rows:
        if row_key(row) in notes:
            row["note"] = notes[row_key(row)]
    return rows


def env_path(csv_path):
    """The <gpu>.env beside a results CSV."""
    return os.path.splitext(csv_path)[0] + ".env"


def read_env(path):
    """key: value lines to a dict ({} when the file is missing)."""
    env = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    env[key.strip()] = value.strip()
    return env


def write_env(path, env):
    """A dict to key: value lines."""
    with open(path, "w") as f:
        f.writelines(f"{key}: {value}\n" for key, value in env.items())


def write_if_changed(path, text):
    """Write text to path unless it already holds it; True when written."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return False
    with open(path, "w") as f:
        f.write(text)
    return True


# --- Looking rows up --------------------------------------------------------------------

def find_row(rows, impl, headdim, seqlen, causal):
    """The row of impl at (D, N, causal), or None."""
    for row in rows:
        if (row["impl"], row["headdim"], row["seqlen"], row["causal"]) == (impl, headdim, seqlen, causal):
            return row
    return None


def timed(row, field):
    """row[field] when the row is a trustworthy timing (PASS or unchecked), else None."""
    return row[field] if row is not None and row["status"] in TIMED else None


def is_anchor(impl):
    """True for the PyTorch rows."""
    return impl.startswith("torch_")


def chapter_impls(rows):
    """The chapters present in rows, in order."""
    return sorted({row["impl"] for row in rows if not is_anchor(row["impl"])})


def anchor_impls(rows):
    """The anchors present in rows, in ANCHORS order."""
    present = {row["impl"] for row in rows}
    return [a for a in ANCHORS if a in present]


def status_cell(row):
    """The cell of a row that has no timing: 'skip', 'FAIL' or '-' (missing)."""
    if row is None:
        return "-"
    return "skip" if row["status"] == "SKIP" else "FAIL" if row["status"] == "FAIL" else "-"


# --- Markdown ------------------------------------------------------------------------------

def markdown_table(header, body, align):
    """A Markdown table; align holds 'l' or 'r' per column."""
    rule = {"l": ":--", "r": "--:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines) + "\n"


def text_table(header, body, align):
    """An aligned plain-text table for the terminal."""
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    def line(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(cells, widths, align)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in body])


def stage_cells(rows, impl, first, prev, causal, headdim=HEADLINE_D, seqlen=HEADLINE_N):
    """Six cells of one stage-table half: ms, TFLOP/s, x vs first, x vs prev, % FA2, % cuDNN."""
    row = find_row(rows, impl, headdim, seqlen, causal)
    ms, tflops = timed(row, "ms"), timed(row, "tflops")
    if ms is None:
        return [status_cell(row)] + ["-"] * 5
    def other(name, field):
        return timed(find_row(rows, name, headdim, seqlen, causal), field) if name else None
    vs_prev = "" if is_anchor(impl) else fmt_speedup(speedup(other(prev, "ms"), ms))
    return [fmt_ms(ms), fmt_tflops(tflops), fmt_speedup(speedup(other(first, "ms"), ms)), vs_prev,
            fmt_percent(percent_of(tflops, other(FA2, "tflops"))),
            fmt_percent(percent_of(tflops, other(CUDNN, "tflops")))]


def stage_body(rows, headdim=HEADLINE_D, seqlen=HEADLINE_N):
    """The stage table's rows: each chapter, then each anchor, non-causal then causal cells."""
    chapters = chapter_impls(rows)
    first = chapters[0] if chapters else None
    body = []
    for i, impl in enumerate(chapters + anchor_impls(rows)):
        prev = chapters[i - 1] if 0 < i < len(chapters) else None
        body.append([impl] + stage_cells(rows, impl, first, prev, 0, headdim, seqlen)
                    + stage_cells(rows, impl, first, prev, 1, headdim, seqlen))
    return body


def stage_header(first="01"):
    """The stage table's header."""
    half = ["TFLOP/s", f"x vs {first}", "x vs prev", "% FA2", "% cuDNN"]
    return ["chapter", "non-causal ms"] + half + ["causal ms"] + half


def stage_table_markdown(rows, source, gpu):
    """The README stage table at the headline shape, with its one-line caption."""
    shape = bench_shape(HEADLINE_D, HEADLINE_N, 0)
    chapters = chapter_impls(rows)
    first = chapters[0].split("_")[0] if chapters else "01"
    anchors = ("FA2 = torch_flash, cuDNN = torch_cudnn (PyTorch SDPA backends)" if anchor_impls(rows)
               else "PyTorch anchors not measured (`make compare`)")
    caption = (f"*{gpu}, D={HEADLINE_D}, N={HEADLINE_N} (B={shape['batch']}, H={shape['heads']}), "
               f"fp16, median ms; {anchors}; from `{source}`, regenerated by `make bench`.*")
    return caption + "\n\n" + markdown_table(stage_header(first), stage_body(rows), "l" + "r" * 12)


def bench_ns(rows):
    """The sequence lengths present in rows, ascending."""
    return sorted({row["seqlen"] for row in rows})


def tflops_cell(row):
    """TFLOP/s of a row, or skip/FAIL/-."""
    value = timed(row, "tflops")
    return fmt_tflops(value) if value is not None else status_cell(row)


def results_sweep_table(rows, headdim, causal):
    """One sweep table of the results page: rows = impl, columns = N, cells = TFLOP/s."""
    ns = bench_ns(rows)
    body = [[impl] + [tflops_cell(find_row(rows, impl, headdim, n, causal)) for n in ns]
            for impl in chapter_impls(rows) + anchor_impls(rows)]
    return markdown_table(["impl"] + [f"N={n_label(n)}" for n in ns], body, "l" + "r" * len(ns))


def rel_cell(row):
    """rel_l2 of a row (with FAIL when it failed), or skip/-."""
    if row is None or row["rel_l2"] is None:
        return status_cell(row) if row is None or row["status"] == "SKIP" else row["status"]
    return fmt_rel(row["rel_l2"]) + (" FAIL" if row["status"] == "FAIL" else "")


def error_table(rows, seqlen=HEADLINE_N):
    """rel_l2 of every impl at one N, for both D and both masks."""
    cols = [(d, c) for d in BENCH_DS for c in (0, 1)
            if any((r["headdim"], r["causal"]) == (d, c) for r in rows)]
    body = [[impl] + [rel_cell(find_row(rows, impl, d, seqlen, c)) for d, c in cols]
            for impl in chapter_impls(rows) + anchor_impls(rows)]
    header = ["impl"] + [f"D={d} {'causal' if c else 'non-causal'}" for d, c in cols]
    return markdown_table(header, body, "l" + "r" * len(cols))


def note_lines(rows):
    """One Markdown list line per SKIP or FAIL row, with its reason."""
    lines = []
    for row in rows:
        if row["status"] not in ("SKIP", "FAIL"):
            continue
        mask = "causal" if row["causal"] else "non-causal"
        reason = row.get("note") or (f"rel_l2 {fmt_rel(row['rel_l2'])} over the tolerance"
                                     if row["status"] == "FAIL" and row["rel_l2"] is not None
                                     else "no reason recorded")
        lines.append(f"- {row['status']} `{row['impl']}` D={row['headdim']} N={row['seqlen']} "
                     f"{mask}: {reason}")
    return lines


def results_markdown(rows, env, csv_name):
    """The whole <gpu>.md page: header from the env, sweep tables, errors, notes."""
    gpu = env.get("gpu") or os.path.splitext(csv_name)[0].replace("_", " ")
    out = [f"# Results on {gpu}", ""]
    out.append(f"Driver {env.get('driver', '?')}, CUDA {env.get('cuda_driver', '?')} (driver), "
               f"nvcc {env.get('nvcc', '?')}; measured {env.get('date', '?')}, "
               f"commit {env.get('commit', '?')}.  ")
    out.append(f"Generated from `{csv_name}` by `common/stages.py table`; do not edit by hand. "
               f"Benchmark shapes (docs/design.md): B = {TOTAL_TOKENS}/N, H = {HIDDEN}/D, fp16 in and out, "
               f"median of {BENCH_ITERS} runs.  ")
    out.append("Cells: TFLOP/s (forward FLOPs 4·B·H·N²·D, halved when causal); `skip`: not run "
               "(see the notes); `FAIL`: wrong result; `-`: not measured.")
    for d in BENCH_DS:
        for c in (0, 1):
            if any(row["headdim"] == d and row["causal"] == c for row in rows):
                out += ["", f"## D={d}, {'causal' if c else 'non-causal'}: TFLOP/s", "",
                        results_sweep_table(rows, d, c).rstrip("\n")]
    if any(row["seqlen"] == HEADLINE_N for row in rows):
        out += ["", f"## Relative L2 error of O at N={HEADLINE_N}", "",
                error_table(rows).rstrip("\n")]
    notes = note_lines(rows)
    if notes:
        out += ["", "## Skipped and failed", ""] + notes
    return "\n".join(out) + "\n"


def chapter_table_markdown(rows, chapter, previous, source, gpu):
    """A chapter README's measured block: it, the previous chapter and FA2/cuDNN, by N."""
    impls = [i for i in (previous, chapter) if i] + [a for a in (FA2, CUDNN) if a in anchor_impls(rows)]
    ns = bench_ns(rows)
    with_ms = HEADLINE_N in ns
    out = [f"TFLOP/s on {gpu} (fp16 in and out, B = {TOTAL_TOKENS}/N, H = {HIDDEN}/D"
           + (f"; last column: ms at N={n_label(HEADLINE_N)}" if with_ms else "")
           + f"), from `{source}`, regenerated by `make bench`."]
    for d in BENCH_DS:
        if not any(row["headdim"] == d for row in rows):
            continue
        body = []
        for c in (0, 1):
            for impl in impls:
                name = f"**{impl}**" if impl == chapter else impl
                cells = [name, "causal" if c else "non-causal"]
                cells += [tflops_cell(find_row(rows, impl, d, n, c)) for n in ns]
                if with_ms:
                    row = find_row(rows, impl, d, HEADLINE_N, c)
                    ms = timed(row, "ms")
                    cells.append(fmt_ms(ms) if ms is not None else status_cell(row))
                body.append(cells)
        header = [f"D={d}", "mask"] + [f"N={n_label(n)}" for n in ns] + (["ms at 4k"] if with_ms else [])
        out += ["", markdown_table(header, body, "ll" + "r" * (len(header) - 2)).rstrip("\n")]
    return "\n".join(out) + "\n"


def replace_between(text, begin, end, body):
    """text with the lines between the begin and end marker lines replaced by body;
    text unchanged when either marker is missing."""
    start = text.find(begin)
    if start < 0:
        return text
    after_begin = text.find("\n", start)
    if after_begin < 0:
        return text
    stop = text.find(end, after_begin)
    if stop < 0:
        return text
    end_line = text.rfind("\n", 0, stop) + 1
    return text[:after_begin + 1] + "\n" + body.strip("\n") + "\n\n" + text[end_line:]


# --- Regenerating the Markdown from a CSV ----------------------------------------------

def update_file(path, begin, end, body):
    """Replace the marked block of one file; say what happened."""
    if not os.path.exists(path):
        say(f"{path}: not found, left alone")
        return
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        say(f"{path}: no {begin} ... {end} markers, left alone")
    elif write_if_changed(path, replace_between(text, begin, end, body)):
        say(f"{path}: table updated")


def regenerate_tables(csv_path, readme_path):
    """The `table` step: <gpu>.md, README stage table and chapter README tables from a CSV."""
    rows = read_results(csv_path)
    env = read_env(env_path(csv_path))
    gpu = env.get("gpu") or os.path.splitext(os.path.basename(csv_path))[0].replace("_", " ")
    md_path = os.path.splitext(csv_path)[0] + ".md"
    if write_if_changed(md_path, results_markdown(rows, env, os.path.basename(csv_path))):
        say(f"{md_path}: written")
    readme_dir = os.path.dirname(os.path.abspath(readme_path))
    update_file(readme_path, CHAPTERS_BEGIN, CHAPTERS_END, chapters_markdown(read_chapters(readme_dir)))
    update_file(readme_path, STAGE_BEGIN, STAGE_END,
                stage_table_markdown(rows, os.path.relpath(csv_path, readme_dir), gpu))
    chapter_dirs = sorted(os.path.basename(os.path.dirname(p))
                          for p in glob.glob(os.path.join(readme_dir, "[0-9][0-9]_*", "README.md")))
    for i, chapter in enumerate(chapter_dirs):
        path = os.path.join(readme_dir, chapter, "README.md")
        body = chapter_table_markdown(rows, chapter, chapter_dirs[i - 1] if i else None,
                                      os.path.relpath(csv_path, os.path.dirname(path)), gpu)
        update_file(path, MEASURED_BEGIN, MEASURED_END, body)
    say(f"tables regenerated from {csv_path} ({len(rows)} rows)")


# --- Running the chapter binaries ---------------------------------------------------------

def run_binary(binary, args, timeout=BINARY_TIMEOUT_S):
    """Run a binary; (exit code or None on timeout or a missing file, stdout, stderr)."""
    if not os.path.exists(binary):
        return None, "", f"{binary} not found: build it with make"
    try:
        done = subprocess.run([binary] + args, capture_output=True, text=True, errors="replace",
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout} s"
    return done.returncode, done.stdout, done.stderr


def last_line(text, name=None):
    """The last non-empty line of text, without a leading '<name>: '."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    line = lines[-1] if lines else ""
    return line[len(name) + 2:] if name and line.startswith(name + ": ") else line


def parse_csv_line(line):
    """A binary's --csv row to a result row (None if it is not one)."""
    cells = next(csv.reader([line]), [])
    if len(cells) < len(CSV_FIELDS):
        return None
    try:
        row = {k: parse_value(k, v) for k, v in zip(CSV_FIELDS, cells)}
    except ValueError:
        return None
    return row if row["status"] in ("PASS", "FAIL", "unchecked") else None


def classify(name, code, stdout, stderr):
    """(status, row, note) of one binary run; status is the row's or skipped/usage/error."""
    row = next((r for r in map(parse_csv_line, stdout.splitlines()) if r), None)
    if code == 77:
        line = last_line(stdout, name)
        return "skipped", None, line[len("skipped: "):] if line.startswith("skipped: ") else line
    if code == 2:
        return "usage", None, last_line(stderr, name)
    if code in (0, 1) and row is not None:
        return row["status"], row, last_line(stderr, name) if row["status"] == "FAIL" else None
    reason = last_line(stderr, name) or "no output"
    return "error", None, reason if code in (0, 1, None) else f"exit {code}: {reason}"


def chapter_adds(binary, name):
    """The one-line 'what it adds' from `BIN --dry-run` ('' when unavailable)."""
    code, stdout, _ = run_binary(binary, ["--dry-run"], timeout=60)
    first = stdout.splitlines()[0] if code == 0 and stdout.strip() else ""
    return first[len(name) + 2:] if first.startswith(name + ": ") else first


def shorten(text, width):
    """text cut to width characters, with '...' when cut."""
    return text if len(text) <= width else text[:max(width - 3, 0)] + "..."


def run_stage_table(results, adds, width):
    """The `make run` table as text: results are (name, status, row, note) in order."""
    base = next((r["ms"] for _, _, r, _ in results if r and r["status"] in TIMED), None)
    body, prev_ms = [], None
    for name, status, row, _ in results:
        ms = row["ms"] if row else None
        rel = fmt_rel(row["rel_l2"]) if row else "-"
        body.append([name, "", fmt_ms(ms), fmt_tflops(row["tflops"] if row else None),
                     fmt_speedup(speedup(base, ms)), fmt_speedup(speedup(prev_ms, ms)), rel, status])
        prev_ms = ms
    header = ["chapter", "adds", "ms", "TFLOP/s", "vs first", "vs prev", "rel_l2", "status"]
    others = sum(max(len(r[i]) for r in [header] + body) + 2 for i in range(len(header)) if i != 1)
    room = max(16, width - others)
    for cells, (name, *_rest) in zip(body, results):
        cells[1] = shorten(adds.get(name, ""), room)
    return text_table(header, body, "llrrrrrl")


def command_run(args):
    """`make run`: every chapter on its default shape, then the stage table."""
    results, adds = [], {}
    for name in args.chapters:
        binary = os.path.join(args.build, name)
        say(f"running {name} ...")
        adds[name] = chapter_adds(binary, name)
        code, stdout, stderr = run_binary(binary, ["--csv"])
        status, row, note = classify(name, code, stdout, stderr)
        if status == "usage":
            status = "error"
        results.append((name, status, row, note))
        if note:
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
        say(f"skipped (exit 77, this GPU lacks what they need; not a failure): {', '.join(skipped)}")
    if bad:
        say(f"failed: {', '.join(bad)}")
    return 1 if bad else 0


def bench_one(build, name, shape, last, unsupported):
    """One chapter at one bench shape, under the skip policy; returns a result row."""
    if name in unsupported:
        return make_row(name, shape, "SKIP", note=unsupported[name])
    slow = too_slow(last, shape)
    if slow:
        return make_row(name, shape, "SKIP", note=slow)
    flags = ["--batch", shape["batch"], "--heads", shape["heads"], "--seqlen", shape["seqlen"],
             "--headdim", shape["headdim"], "--warmup", BENCH_WARMUP, "--iters", BENCH_ITERS, "--csv"]
    flags = [str(f) for f in flags] + (["--causal"] if shape["causal"] else [])
    code, stdout, stderr = run_binary(os.path.join(build, name), flags)
    status, row, note = classify(name, code, stdout, stderr)
    if status == "skipped":
        unsupported[name] = note
        return make_row(name, shape, "SKIP", note=note)
    if status == "usage":
        return make_row(name, shape, "SKIP", note=note)
    if status == "error":
        return make_row(name, shape, "FAIL", note=note)
    return make_row(name, shape, status, row["ms"], row["tflops"], row["rel_l2"], note=note, dtype=row["dtype"])


def row_progress(row):
    """One progress line for a finished row."""
    if row["ms"] is None:
        return f"  {row['impl']:<20} {row['status']:<5} {row.get('note', '')}"
    return (f"  {row['impl']:<20} {row['status']:<5} {fmt_ms(row['ms']):>7} ms "
            f"{fmt_tflops(row['tflops']):>7} TFLOP/s  rel_l2 {fmt_rel(row['rel_l2'])}"
            + (f"  ({row['note']})" if row.get("note") else ""))


def bench_chapters(build, chapters, shapes):
    """Every chapter on every shape; None when every chapter was skipped (no GPU)."""
    rows, last, unsupported = [], {}, {}
    for i, shape in enumerate(shapes):
        say(f"[{i + 1}/{len(shapes)}] {shape_label(shape)}")
        for name in chapters:
            key = (name, shape["headdim"], shape["causal"])
            row = bench_one(build, name, shape, last.get(key), unsupported)
            if row["ms"] is not None:
                last[key] = (work(shape), row["ms"])
            rows.append(row)
            say(row_progress(row))
        if i == 0 and len(unsupported) == len(chapters):
            return None
    return rows


# --- The machine, for the .env -----------------------------------------------------------

def command_output(argv, cwd=None):
    """stdout of a command, '' when it fails or is missing."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def gpu_name():
    """The first GPU's name from nvidia-smi ('' when it fails)."""
    out = command_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return out.strip().splitlines()[0].strip() if out.strip() else ""


def git_commit():
    """Short HEAD, with -dirty when tracked files changed."""
    commit = command_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT).strip() or "unknown"
    dirty = command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT).strip()
    return commit + ("-dirty" if dirty else "")


def collect_env(command):
    """What the .env records: GPU, driver, CUDA, clocks, date, commit, command."""
    env = {"gpu": gpu_name() or "unknown (nvidia-smi failed)"}
    query = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit"
    out = command_output(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"])
    fields = [f.strip() for f in out.splitlines()[0].split(",")] if out.strip() else []
    if len(fields) == 6:
        env["driver"] = fields[0]
        env["sm_clock"] = f"{fields[1]} now, {fields[2]} max"
        env["mem_clock"] = f"{fields[3]} now, {fields[4]} max"
        env["power_limit"] = fields[5]
    found = re.search(r"CUDA Version:\s*([\d.]+)", command_output(["nvidia-smi"]))
    env["cuda_driver"] = found.group(1) if found else "unknown"
    nvcc = command_output([os.environ.get("NVCC", "nvcc"), "--version"])
    found = re.search(r"release ([\d.]+), V([\d.]+)", nvcc)
    env["nvcc"] = found.group(2) if found else "unknown"
    env["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    env["commit"] = git_commit()
    env["command"] = command
    return env


# --- Anchors, plot, summary ---------------------------------------------------------------

def torch_gpu_ready(skip_line):
    """True when PyTorch imports and sees a GPU; otherwise print skip_line (one line)."""
    try:
        import torch
    except ImportError:
        say(skip_line)
        return False
    if not torch.cuda.is_available():
        say(skip_line.replace("PyTorch not found", "PyTorch sees no CUDA GPU"))
        return False
    return True


def cache_dir():
    """Where the binaries cache inputs and references: $FA_CACHE or <repo>/.cache."""
    return os.environ.get("FA_CACHE") or os.path.join(ROOT, ".cache")


def measure_anchors(shapes):
    """The anchor rows for shapes (PyTorch must be importable)."""
    import anchors
    return anchors.run_anchors(shapes, cache_dir(), warmup=BENCH_WARMUP, iters=BENCH_ITERS)


def plot_results(rows, path, gpu):
    """TFLOP/s vs N (log-log), 4 panels (D x causal), anchors dashed; needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib not found: plot skipped")
        return
    chapters, anchors = chapter_impls(rows), anchor_impls(rows)
    style = {impl: {"color": plt.cm.viridis(i / max(len(chapters) - 1, 1)), "linestyle": "-"}
             for i, impl in enumerate(chapters)}
    style.update({impl: {"color": str(0.15 + 0.2 * i), "linestyle": "--"} for i, impl in enumerate(anchors)})
    ns = bench_ns(rows)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharex=True)
    for ax, (d, c) in zip(axes.flat, [(d, c) for d in BENCH_DS for c in (0, 1)]):
        for impl in chapters + anchors:
            points = sorted((r["seqlen"], r["tflops"]) for r in rows
                            if (r["impl"], r["headdim"], r["causal"]) == (impl, d, c)
                            and timed(r, "tflops") is not None)
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=impl, **style[impl])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns)
        ax.set_xticklabels([n_label(n) for n in ns])
        ax.set_title(f"D={d}, {'causal' if c else 'non-causal'}")
        ax.set_xlabel("N (B = 16k/N, H = 2048/D)")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = max((ax.get_legend_handles_labels() for ax in axes.flat), key=lambda hl: len(hl[1]))
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.suptitle(f"FlashAttention stage by stage on {gpu}, fp16 in and out (08 computes in FP8)")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"{path}: written")


def print_summary(rows):
    """The headline-shape stage table, as text, last thing bench prints."""
    if not any(r["seqlen"] == HEADLINE_N and r["headdim"] == HEADLINE_D for r in rows):
        say(f"(no rows at the headline shape D={HEADLINE_D}, N={HEADLINE_N})")
        return
    shape = bench_shape(HEADLINE_D, HEADLINE_N, 0)
    say("")
    say(f"Headline shape D={HEADLINE_D} N={HEADLINE_N} B={shape['batch']} H={shape['heads']} "
        "(non-causal | causal):")
    say(text_table(stage_header(), stage_body(rows), "l" + "r" * 12))


def save_results(out_dir, rows, env, readme):
    """Write <gpu>.csv/.notes.csv/.env (and .png), then regenerate every table."""
    csv_path = os.path.join(out_dir, gpu_slug(gpu_name()) + ".csv")
    write_results(csv_path, rows)
    write_env(env_path(csv_path), env)
    say(f"{csv_path}: {len(rows)} rows written")
    plot_results(rows, os.path.splitext(csv_path)[0] + ".png", env["gpu"])
    regenerate_tables(csv_path, readme)
    return csv_path


def command_bench(args):
    """`make bench`: the sweep, the anchors, every results file and table."""
    shapes = bench_shapes(args.quick)
    chapters = [c.rstrip("/") for c in args.chapters]
    say(f"bench: {len(chapters)} chapters x {len(shapes)} shapes"
        f"{' (--quick)' if args.quick else ''}; a shape projected over {BUDGET_S} s is skipped")
    rows = bench_chapters(args.build, chapters, shapes)
    if rows is None:
        say("every chapter skipped (exit 77): nothing measured, docs/results left alone")
        return 0
    if torch_gpu_ready("PyTorch not found: anchor rows skipped"):
        rows += measure_anchors(shapes)
    env = collect_env(shlex.join([sys.executable] + sys.argv))
    save_results(args.out, rows, env, args.readme)
    print_summary(rows)
    failed = [r for r in rows if r["status"] == "FAIL" and not is_anchor(r["impl"])]
    for r in failed:
        say(f"FAIL {r['impl']} {shape_label(r)}: {r.get('note') or 'rel_l2 ' + fmt_rel(r['rel_l2'])}")
    return 1 if failed else 0


def command_compare(args):
    """`make compare`: the anchors only, merged into <gpu>.csv."""
    if not torch_gpu_ready("PyTorch not found: make compare skipped"):
        return 0
    rows = measure_anchors(bench_shapes(args.quick))
    csv_path = os.path.join(args.out, gpu_slug(gpu_name()) + ".csv")
    kept = [r for r in read_results(csv_path) if not is_anchor(r["impl"])] if os.path.exists(csv_path) else []
    env = read_env(env_path(csv_path)) or collect_env("(none: make compare only)")
    env["compare_command"] = shlex.join([sys.executable] + sys.argv)
    env["compare_date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    save_results(args.out, kept + rows, env, args.readme)
    print_summary(kept + rows)
    return 0


def default_csv():
    """The newest results CSV under docs/results, or None."""
    found = [p for p in glob.glob(os.path.join(ROOT, "docs", "results", "*.csv"))
             if not p.endswith(".notes.csv")]
    return max(found, key=os.path.getmtime) if found else None


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


def parse_args(argv):
    """The command line of the four subcommands."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="every chapter on its default shape (make run)")
    bench = sub.add_parser("bench", help="the benchmark sweep (make bench)")
    compare = sub.add_parser("compare", help="PyTorch anchors only (make compare)")
    table = sub.add_parser("table", help="regenerate the Markdown from a results CSV")
    for p in (run, bench, compare):
        p.add_argument("--build", default="build", help="folder of the chapter binaries")
    for p in (run, bench):
        p.add_argument("chapters", nargs="+", metavar="CH", help="chapter names, in order")
    for p in (bench, compare):
        p.add_argument("--quick", action="store_true", help=f"only N in {QUICK_NS}")
        p.add_argument("--out", default=os.path.join("docs", "results"), help="results folder")
    table.add_argument("--csv", help="results CSV (default: the newest docs/results/*.csv)")
    for p in (bench, compare, table):
        p.add_argument("--readme", default=os.path.join(ROOT, "README.md"),
                       help="README with the stage-table markers; chapter READMEs beside it")
    return parser.parse_args(argv)


def main(argv=None):
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    commands = {"run": command_run, "bench": command_bench, "compare": command_compare,
                "table": command_table}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
