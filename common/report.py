"""The report of a benchmark run: the number formats, the Markdown tables (the README's stage
table, docs/results/<gpu>.md, each chapter README's measured block; the backward's
docs/results/<gpu>.backward.md and its block in the READMEs of the chapters that have one), the
measured values quoted in prose (inline markers, below), the text tables `make run` and `make
bench` print, and the plot. It reads result rows (common/results.py) and writes text."""
import glob
import os
import re

from chapters import CHAPTERS_BEGIN, CHAPTERS_END, chapters_markdown, read_chapters
from results import (ANCHOR_REL_L2_TOL, BACKWARD_REL_L2_TOL, BENCH_DS, BENCH_ITERS, BENCH_NS, CUDNN, EAGER, FA2,
                     GRAD_FIELDS, HEADLINE_D, HEADLINE_N, HIDDEN, TIMED, TOTAL_TOKENS,
                     anchor_impls, bench_shape, chapter_impls, env_path, find_row, is_anchor, pass_csv, read_env,
                     read_results, step_aliases, steps, timed, variants, write_if_changed)

STAGE_BEGIN, STAGE_END = "<!-- stage-table:begin -->", "<!-- stage-table:end -->"
MEASURED_BEGIN, MEASURED_END = "<!-- measured:begin -->", "<!-- measured:end -->"
BACKWARD_BEGIN, BACKWARD_END = "<!-- measured-backward:begin -->", "<!-- measured-backward:end -->"


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


def fmt_bytes(count):
    """Device memory: 268 MB, 4.56 GB; '-' when not measured."""
    if count is None:
        return "-"
    if count >= 1e9:
        return f"{count / 1e9:.2f} GB"
    return f"{count / 1e6:.0f} MB"


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


def status_cell(row):
    """The cell of a row that has no timing: 'skip', 'FAIL' or '-' (missing)."""
    if row is None:
        return "-"
    return "skip" if row["status"] == "SKIP" else "FAIL" if row["status"] == "FAIL" else "-"


def shorten(text, width):
    """text cut to width characters, with '...' when cut."""
    return text if len(text) <= width else text[:max(width - 3, 0)] + "..."


# --- Tables --------------------------------------------------------------------------------

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
    """Seven cells of one stage-table half: ms, TFLOP/s, x vs first, x vs prev, x vs eager PyTorch,
    % FA2, % cuDNN."""
    row = find_row(rows, impl, headdim, seqlen, causal)
    ms, tflops = timed(row, "ms"), timed(row, "tflops")
    if ms is None:
        return [status_cell(row)] + ["-"] * 6
    def other(name, field):
        return timed(find_row(rows, name, headdim, seqlen, causal), field) if name else None
    vs_prev = "" if is_anchor(impl) else fmt_speedup(speedup(other(prev, "ms"), ms))
    return [fmt_ms(ms), fmt_tflops(tflops), fmt_speedup(speedup(other(first, "ms"), ms)), vs_prev,
            fmt_speedup(speedup(other(EAGER, "ms"), ms)), fmt_percent(percent_of(tflops, other(FA2, "tflops"))),
            fmt_percent(percent_of(tflops, other(CUDNN, "tflops")))]


def stage_body(rows, headdim=HEADLINE_D, seqlen=HEADLINE_N):
    """The stage table's rows: each chapter, then each anchor, non-causal then causal cells."""
    chapters = chapter_impls(rows)
    first = chapters[0] if chapters else None
    body = []
    for i, impl in enumerate(chapters + anchor_impls(rows)):
        prev = chapters[i - 1] if 0 < i < len(chapters) else None
        memory = find_row(rows, impl, headdim, seqlen, 0)
        body.append([impl, fmt_bytes(memory and memory.get("device_bytes"))]
                    + stage_cells(rows, impl, first, prev, 0, headdim, seqlen)
                    + stage_cells(rows, impl, first, prev, 1, headdim, seqlen))
    return body


def stage_header(first="01"):
    """The stage table's header."""
    half = ["TFLOP/s", f"x vs {first}", "x vs prev", "x vs eager", "% FA2", "% cuDNN"]
    return ["chapter", "device memory", "non-causal ms"] + half + ["causal ms"] + half


def stage_table_markdown(rows, source, gpu):
    """The README stage table at the headline shape, with its one-line caption."""
    shape = bench_shape(HEADLINE_D, HEADLINE_N, 0)
    chapters = chapter_impls(rows)
    first = chapters[0].split("_")[0] if chapters else "01"
    anchors = ("FA2 = torch_flash, cuDNN = torch_cudnn (PyTorch SDPA backends)" if anchor_impls(rows)
               else "PyTorch anchors not measured (`make compare`)")
    if "cudnn_fp8" in anchor_impls(rows):
        anchors += ("; cudnn_fp8 = cuDNN's FP8 attention alone, on inputs already in e4m3 (08's row includes "
                    "its quantisation)")
    stepped = [(chapter, names) for chapter, names in steps().items() if chapter in chapters and
               any(name in chapters for name in names)]
    built_in_steps = "".join(f"; {names[0]} ... {names[-1]} are {chapter}'s steps (`build/{chapter}.stepK`), "
                             f"{chapter} the last" for chapter, names in stepped)
    caption = (f"*{gpu}, D={HEADLINE_D}, N={HEADLINE_N} (B={shape['batch']}, H={shape['heads']}), "
               f"fp16, median ms; {anchors}{built_in_steps}; from `{source}` (its `.env` says which run each row "
               f"comes from), regenerated by `make bench`.*")
    caption += ("\n\n*Device memory at the non-causal shape, inputs and outputs included: what the harness "
                "allocates for a chapter (Q, K, V, O, LSE and the chapter's workspace), and a PyTorch anchor's "
                "peak allocation during one forward (torch.cuda.max_memory_allocated) plus its inputs.*")
    return caption + "\n\n" + markdown_table(stage_header(first), stage_body(rows), "l" + "r" * 15)


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


def by_n_tables(rows, impls, chapter, vs=None):
    """A measured block's tables, one per D: a line per (mask, impl), the chapter's name in bold, its
    TFLOP/s by N, then its ms at the headline N (and with vs, how many times faster than vs there)."""
    ns = bench_ns(rows)
    with_ms = HEADLINE_N in ns
    out = []
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
                    if vs:
                        cells.append(fmt_speedup(speedup(timed(find_row(rows, vs, d, HEADLINE_N, c), "ms"), ms)))
                body.append(cells)
        header = ([f"D={d}", "mask"] + [f"N={n_label(n)}" for n in ns] + (["ms at 4k"] if with_ms else [])
                  + ([f"x {ANCHOR_NAMES.get(vs, vs)} at 4k"] if with_ms and vs else []))
        out += ["", markdown_table(header, body, "ll" + "r" * (len(header) - 2)).rstrip("\n")]
    return out


def chapter_table_markdown(rows, chapter, previous, source, gpu):
    """A chapter README's measured block: the previous chapter, the chapter's steps (08.1 ...) and
    the chapter, and FA2/cuDNN, by N."""
    shown = [s for s in steps().get(chapter, ()) if any(row["impl"] == s for row in rows)]
    impls = ([previous] if previous else []) + shown + [chapter] + [a for a in (FA2, CUDNN) if a in anchor_impls(rows)]
    with_ms = HEADLINE_N in bench_ns(rows)
    out = [f"TFLOP/s on {gpu} (fp16 in and out, B = {TOTAL_TOKENS}/N, H = {HIDDEN}/D"
           + (f"; last column: ms at N={n_label(HEADLINE_N)}" if with_ms else "")
           + f"), from `{source}`, regenerated by `make bench`."]
    return "\n".join(out + by_n_tables(rows, impls, chapter)) + "\n"


# --- The backward's tables (rows of <gpu>.backward.csv) -----------------------------------------
ANCHOR_NAMES = {FA2: "FA2", CUDNN: "cuDNN"}


def inputs_bytes(shape):
    """Q, K, V and dO of a shape, fp16: what the backward is given."""
    return 4 * shape["batch"] * shape["heads"] * shape["seqlen"] * shape["headdim"] * 2


def backward_impls(rows):
    """The backward rows' impls: the chapters (each followed by its modes' rows), then the anchors."""
    return chapter_impls(rows) + anchor_impls(rows)


def backward_headline_body(rows, headdim=HEADLINE_D, seqlen=HEADLINE_N):
    """The backward at the headline shape: per impl its device memory (and how much of it is beyond
    Q, K, V and dO), then ms, TFLOP/s and x FA2 non-causal, and causal."""
    body = []
    for impl in backward_impls(rows):
        memory = find_row(rows, impl, headdim, seqlen, 0)
        held = memory and memory.get("device_bytes")
        cells = [impl, fmt_bytes(held), fmt_bytes(held - inputs_bytes(memory) if held else None)]
        for c in (0, 1):
            row = find_row(rows, impl, headdim, seqlen, c)
            ms = timed(row, "ms")
            if ms is None:
                cells += [status_cell(row), "-", "-"]
                continue
            fa2 = timed(find_row(rows, FA2, headdim, seqlen, c), "ms")
            cells += [fmt_ms(ms), fmt_tflops(timed(row, "tflops")), fmt_speedup(speedup(fa2, ms))]
        body.append(cells)
    return body


BACKWARD_HEADLINE_HEADER = ["impl", "device memory", "beyond Q, K, V, dO", "non-causal ms", "TFLOP/s", "x FA2",
                            "causal ms", "TFLOP/s", "x FA2"]


def backward_cell(row, fa2):
    """A backward sweep cell: TFLOP/s, and how many times faster than FA2 (by ms) in parentheses; or
    skip/FAIL/-."""
    value = timed(row, "tflops")
    if value is None:
        return status_cell(row)
    ratio = speedup(timed(fa2, "ms"), timed(row, "ms")) if row["impl"] != FA2 else None
    return fmt_tflops(value) + (f" ({fmt_speedup(ratio)})" if ratio is not None else "")


def backward_sweep_table(rows, headdim, causal):
    """One backward sweep table: rows = impl, columns = N, cells = TFLOP/s (x FA2)."""
    ns = bench_ns(rows)
    body = [[impl] + [backward_cell(find_row(rows, impl, headdim, n, causal), find_row(rows, FA2, headdim, n, causal))
                      for n in ns] for impl in backward_impls(rows)]
    return markdown_table(["impl"] + [f"N={n_label(n)}" for n in ns], body, "l" + "r" * len(ns))


def grad_cells(row):
    """dQ, dK, dV relative L2 errors of a backward row, FAIL marked on each over its bound (a chapter's
    BACKWARD_REL_L2_TOL, an anchor's ANCHOR_REL_L2_TOL), or skip/-."""
    if row is None or all(row.get(k) is None for k in GRAD_FIELDS):
        return [status_cell(row) if row is None or row["status"] == "SKIP" else row["status"]] * len(GRAD_FIELDS)
    bound = ANCHOR_REL_L2_TOL if is_anchor(row["impl"]) else BACKWARD_REL_L2_TOL
    def over(value):  # (a NaN is over)
        return row["status"] == "FAIL" and value is not None and not value <= bound
    return [fmt_rel(row.get(k)) + (" FAIL" if over(row.get(k)) else "") for k in GRAD_FIELDS]


def grad_error_table(rows, seqlen=HEADLINE_N):
    """dQ, dK, dV rel L2 of every impl at one N: a line per (impl, mask), three columns per D."""
    ds = [d for d in BENCH_DS if any(r["headdim"] == d and r["seqlen"] == seqlen for r in rows)]
    body = [[impl, "causal" if c else "non-causal"] + [cell for d in ds for cell in grad_cells(
        find_row(rows, impl, d, seqlen, c))] for impl in backward_impls(rows) for c in (0, 1)]
    header = ["impl", "mask"] + [f"D={d} {g}" for d in ds for g in ("dQ", "dK", "dV")]
    return markdown_table(header, body, "ll" + "r" * (len(header) - 2))


def backward_results_markdown(rows, env, csv_name):
    """The whole <gpu>.backward.md page: header from the env, the headline shape (with device memory),
    the sweep tables, the gradients' errors, notes."""
    gpu = env.get("gpu") or os.path.splitext(os.path.splitext(csv_name)[0])[0].replace("_", " ")
    shape = bench_shape(HEADLINE_D, HEADLINE_N, 0)
    out = [f"# The backward pass on {gpu}", ""]
    out.append(f"Driver {env.get('driver', '?')}, CUDA {env.get('cuda_driver', '?')} (driver), "
               f"nvcc {env.get('nvcc', '?')}; measured {env.get('date', '?')}, "
               f"commit {env.get('commit', '?')}.  ")
    out.append(f"Generated from `{csv_name}` by `common/stages.py table`; do not edit by hand. The forward's "
               f"results are in `{os.path.basename(pass_csv(csv_name, 'forward'))}` beside it.  ")
    out.append(f"Benchmark shapes (docs/design.md): B = {TOTAL_TOKENS}/N, H = {HIDDEN}/D, fp16 in and out. The "
               f"backward alone: a chapter's `--backward` (after its own forward), PyTorch's "
               f"`torch.autograd.grad(o, (q, k, v), dO)` after one forward; median of {BENCH_ITERS} runs.  ")
    out.append("TFLOP/s count 2.5x the forward's FLOPs (10·B·H·N²·D, halved when causal); in parentheses, how "
               "many times faster than torch_flash (FlashAttention-2), by ms; `skip`: not run (see the notes); "
               "`FAIL`: a wrong gradient; `-`: not measured.")
    if any(row["seqlen"] == HEADLINE_N and row["headdim"] == HEADLINE_D for row in rows):
        out += ["", f"## At D={HEADLINE_D}, N={HEADLINE_N} (B={shape['batch']}, H={shape['heads']})", "",
                "Device memory at the non-causal shape, through one forward and backward: for a chapter what the "
                "harness allocates (Q, K, V, O, dO, dQ, dK, dV, LSE and both workspaces); for a PyTorch anchor "
                "its peak allocation (torch.cuda.max_memory_allocated) plus Q, K, V and dO; and of it, what is "
                "beyond those four inputs.", "",
                markdown_table(BACKWARD_HEADLINE_HEADER, backward_headline_body(rows), "l" + "r" * 8).rstrip("\n")]
    for d in BENCH_DS:
        for c in (0, 1):
            if any(row["headdim"] == d and row["causal"] == c for row in rows):
                out += ["", f"## D={d}, {'causal' if c else 'non-causal'}: TFLOP/s (x FA2)", "",
                        backward_sweep_table(rows, d, c).rstrip("\n")]
    if any(row["seqlen"] == HEADLINE_N for row in rows):
        out += ["", f"## Relative L2 error of dQ, dK, dV at N={HEADLINE_N}", "",
                "Against the float64 reference (common/reference.py backward: exact gradients at sampled query "
                "rows of dQ and key rows of dK and dV, tile edges among them, the same rows in every head), over "
                "those rows of every head together, on the same dO for every impl. A chapter passes at "
                f"{BACKWARD_REL_L2_TOL:.0e} each, an anchor at {ANCHOR_REL_L2_TOL:.0e}.".replace("e-0", "e-"), "",
                grad_error_table(rows).rstrip("\n")]
    notes = note_lines(rows)
    if notes:
        out += ["", "## Skipped and failed", ""] + notes
    return "\n".join(out) + "\n"


def backward_chapter_markdown(rows, chapter, source, gpu):
    """A chapter README's backward block: the chapter, its modes' rows, FA2 and cuDNN, by N, with ms
    and x FA2 at the headline N."""
    impls = ([chapter] + [v for v in variants().get(chapter, ()) if any(row["impl"] == v for row in rows)]
             + [a for a in (FA2, CUDNN) if a in anchor_impls(rows)])
    with_ms = HEADLINE_N in bench_ns(rows)
    page = os.path.splitext(source)[0] + ".md"
    out = [f"Backward TFLOP/s on {gpu} (the backward alone, 2.5x the forward's FLOPs; fp16 in and out, "
           f"B = {TOTAL_TOKENS}/N, H = {HIDDEN}/D"
           + (f"; last columns: ms at N={n_label(HEADLINE_N)} and how many times faster than FA2 there"
              if with_ms else "")
           + f"), from `{source}`, regenerated by `make bench`; every impl, device memory and each gradient's "
           f"error: [{os.path.basename(page)}]({page})."]
    return "\n".join(out + by_n_tables(rows, impls, chapter, vs=FA2 if FA2 in anchor_impls(rows) else None)) + "\n"


def print_headline_table(rows, what, title, note, header, body, align):
    """A table at the headline shape, as text: `title`, the shape and `note` over header and
    body(rows) (`what`: the rows' name in the line said instead when there are none there)."""
    if not any(r["seqlen"] == HEADLINE_N and r["headdim"] == HEADLINE_D for r in rows):
        say(f"(no {what} at the headline shape D={HEADLINE_D}, N={HEADLINE_N})")
        return
    shape = bench_shape(HEADLINE_D, HEADLINE_N, 0)
    say("")
    say(f"{title} D={HEADLINE_D} N={HEADLINE_N} B={shape['batch']} H={shape['heads']} {note}:")
    say(text_table(header, body(rows), align))


def print_backward_summary(rows):
    """The backward at the headline shape, as text, last thing its bench prints."""
    print_headline_table(rows, "backward rows", "The backward at",
                         "(non-causal | causal; TFLOP/s with 2.5x the forward's FLOPs)", BACKWARD_HEADLINE_HEADER,
                         backward_headline_body, "l" + "r" * 8)


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


def print_summary(rows):
    """The headline-shape stage table, as text, last thing bench prints."""
    print_headline_table(rows, "rows", "Headline shape", "(non-causal | causal)", stage_header(), stage_body,
                         "l" + "r" * 15)


# --- Files with generated blocks -------------------------------------------------------------

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


# --- Measured values in prose ----------------------------------------------------------------
# A measured number quoted in prose sits between two HTML comments, invisible once rendered,
# and `table` rewrites it from the results CSV like the tables:
#     <!--r 07 D128 N4k nc x FA2-->1.02x<!--/r-->
# The fields: IMPL (a row's impl, a chapter's number such as 07, or FA2 / cuDNN for torch_flash /
# torch_cudnn), D (D128), N (N4096 or N4k), the mask (nc or causal), and the quantity: ms, tflops,
# rel_l2, mem (device memory), x OTHER (how many times faster than OTHER, by ms) or % OTHER (TFLOP/s as a percentage
# of OTHER's, or of a constant such as 64TFLOP/s). IMPL may name a step of a chapter built in
# steps (08.1 ... 08.5, the last being the chapter), or a chapter's run in a mode (09.deterministic for
# 09_backward.deterministic). IMPL, D, N and the mask may list values (04,05;
# N2k,8k) or take all (D*, N*, *): the text is then the range over them, 1.01-1.17x. A last field
# :SPEC formats with format(value, SPEC) (tflops :.0f gives 658) instead of the tables' format.
# A first field `bwd` quotes the backward's rows (<gpu>.backward.csv) instead of the forward's, OTHER
# among them too, and allows dq_rel_l2, dk_rel_l2, dv_rel_l2 (each gradient's error):
#     <!--r bwd 09 D128 N4k nc x FA2-->0.77x<!--/r-->
VALUE = re.compile(r"(<!--[ \t]*r[ \t]+([^<>\n]*?)[ \t]*-->)((?:(?!<!--)[^\n])*?)(<!--[ \t]*/r[ \t]*-->)")
VALUE_TAG = re.compile(r"<!--\s*/?r(?:\s[^>]*)?-->")
VALUE_SYNTAX = ("<!--r [bwd] IMPL D128 N4k nc|causal ms|tflops|rel_l2|dq_rel_l2|dk_rel_l2|dv_rel_l2|mem|x OTHER|"
                "% OTHER [:SPEC]-->")
VALUE_FORMATS = {"ms": fmt_ms, "tflops": fmt_tflops, "rel_l2": fmt_rel, "mem": fmt_bytes, "x": fmt_speedup,
                 "%": fmt_percent, **{field: fmt_rel for field in GRAD_FIELDS}}
BACKWARD_WORD = "bwd"
COLUMNS = {"mem": "device_bytes"}  # a quantity read from a column of another name
ALIASES = {"FA2": FA2, "cuDNN": CUDNN}
CONSTANT = re.compile(r"(\d+(?:\.\d+)?)TFLOP/s")
MASKS = {"nc": (0,), "causal": (1,), "*": (0, 1)}
NOT_AVAILABLE = "n/a"


def value_list(word, prefix, everything):
    """'D128' -> (128,), 'N2k,4096' -> (2048, 4096), 'N*' -> everything; None when malformed."""
    if not word.startswith(prefix):
        return None
    if word[len(prefix):] == "*":
        return tuple(everything)
    try:
        return tuple(int(v[:-1]) * 1024 if v.endswith("k") else int(v) for v in word[len(prefix):].split(","))
    except ValueError:
        return None


def parse_value_marker(spec):
    """The fields of a marker ('07 D128 N4k nc tflops') as a dict; ValueError saying what is wrong."""
    words = spec.split()
    backward = bool(words) and words[0] == BACKWARD_WORD
    words = words[1:] if backward else words
    fmt = words.pop()[1:] if len(words) > 5 and words[-1].startswith(":") else None
    if len(words) < 5:
        raise ValueError(f"too few fields, expected {VALUE_SYNTAX}")
    impl, d, n, mask, quantity, *other = words
    marker = {"impls": impl.split(","), "ds": value_list(d, "D", BENCH_DS), "ns": value_list(n, "N", BENCH_NS),
              "masks": MASKS.get(mask), "quantity": quantity, "other": other[0] if other else None, "fmt": fmt,
              "pass": "backward" if backward else "forward"}
    for field, word in (("ds", d), ("ns", n), ("masks", mask)):
        if marker[field] is None:
            raise ValueError(f"bad field {word!r}, expected {VALUE_SYNTAX}")
    if (quantity not in VALUE_FORMATS or len(other) != (quantity in ("x", "%"))
            or (quantity == "x" and CONSTANT.fullmatch(other[0])) or (quantity in GRAD_FIELDS and not backward)):
        raise ValueError(f"bad quantity {' '.join([quantity] + other)!r}, expected {VALUE_SYNTAX}")
    try:
        format(1.0, fmt or "")
    except ValueError:
        raise ValueError(f"bad format :{fmt}") from None
    return marker


def resolve_impl(rows, name):
    """A marker's impl: FA2 and cuDNN by their rows' names, a bare number NN as the one chapter
    named NN_..., NN.mode as that chapter's rows in the mode (09.deterministic:
    09_backward.deterministic), a step as its build's impl (08.3; 08.5, the last, is the chapter
    08_fp8), any other name as it is."""
    number, dot, variant = name.partition(".")
    found = set()
    if number.isdigit() and not variant.isdigit():
        found = {r["impl"] for r in rows if r["impl"].startswith(number + "_") and r["impl"].partition(".")[2] == variant}
    return found.pop() if len(found) == 1 else ALIASES.get(name, step_aliases().get(name, name))


def marker_value(rows, marker, impl, headdim, seqlen, causal):
    """The marker's quantity for impl at one shape; None when a row it needs is missing or not timed."""
    def field(name, column):
        constant = CONSTANT.fullmatch(name)
        if constant:
            return float(constant.group(1))
        return timed(find_row(rows, resolve_impl(rows, name), headdim, seqlen, causal), column)
    if marker["quantity"] == "x":
        return speedup(field(marker["other"], "ms"), field(impl, "ms"))
    if marker["quantity"] == "%":
        return percent_of(field(impl, "tflops"), field(marker["other"], "tflops"))
    return field(impl, COLUMNS.get(marker["quantity"], marker["quantity"]))


def marker_text(rows, marker):
    """(the text a marker shows, None): one value, or 'low-high' over several impls or shapes;
    (None, the first impl and shape without a value) when a value is missing."""
    points = [(i, d, n, c) for i in marker["impls"] for d in marker["ds"] for n in marker["ns"]
              for c in marker["masks"]]
    values = [marker_value(rows, marker, *point) for point in points]
    if None in values:
        i, d, n, c = points[values.index(None)]
        return None, f"{i} D={d} N={n} {'causal' if c else 'non-causal'}"
    def show(value):
        return VALUE_FORMATS[marker["quantity"]](value) if marker["fmt"] is None else format(value, marker["fmt"])
    low, high = show(min(values)), show(max(values))
    unit = marker["quantity"] if marker["fmt"] is None and marker["quantity"] in ("x", "%") else ""
    return (low if low == high else low[:len(low) - len(unit)] + "-" + high), None


def fill_values(text, rows, where, backward_rows=None):
    """(text with every inline value refilled from rows, a `bwd` marker's from backward_rows,
    warnings): a value without its rows becomes n/a, with a warning naming where and the marker;
    a marker whose pass has no rows at all (None: no results file of that pass) is left as it is.
    ValueError for a malformed marker, or one without its pair on the same line."""
    warnings = []
    def fill(match):
        try:
            marker = parse_value_marker(match.group(2))
        except ValueError as exc:
            raise ValueError(f"{where}: {match.group(1)}: {exc}") from None
        found = backward_rows if marker["pass"] == "backward" else rows
        if found is None:
            return match.group(0)
        value, missing = marker_text(found, marker)
        if missing:
            warnings.append(f"{where}: {match.group(1)}: no timed row at {missing}, written as {NOT_AVAILABLE}")
        return match.group(1) + (value or NOT_AVAILABLE) + match.group(4)
    stray = VALUE_TAG.search(VALUE.sub("", text))
    if stray:
        raise ValueError(f"{where}: {stray.group(0)} without its pair on the same line "
                         f"(expected {VALUE_SYNTAX}value<!--/r-->)")
    return VALUE.sub(fill, text), warnings


def prose_files(readme_path):
    """The files whose inline values `table` refills: the README, each chapter's, docs/*.md."""
    root = os.path.dirname(os.path.abspath(readme_path))
    return ([readme_path] + sorted(glob.glob(os.path.join(root, "[0-9][0-9]_*", "README.md")))
            + sorted(glob.glob(os.path.join(root, "docs", "*.md"))))


def update_values(paths, rows, backward_rows=None):
    """Refill the inline values of every file (`bwd` ones from backward_rows; None: those of that
    pass left as they are), warning of each n/a; every file is read and checked before any is
    written, so a malformed marker anywhere changes nothing."""
    filled = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                filled.append((path, fill_values(f.read(), rows, path, backward_rows)))
    for path, (text, warnings) in filled:
        for warning in warnings:
            say(f"warning: {warning}")
        if write_if_changed(path, text):
            say(f"{path}: values updated")


def regenerate_tables(csv_path, readme_path):
    """The `table` step, from a results CSV of either pass and the other pass's beside it: <gpu>.md,
    the README stage table and the chapter README tables from <gpu>.csv; <gpu>.backward.md and the
    backward blocks of the chapter READMEs from <gpu>.backward.csv; then the inline values of the
    READMEs and docs/*.md. A pass without its file leaves its tables and values as they are."""
    paths = {pass_: pass_csv(csv_path, pass_) for pass_ in ("forward", "backward")}
    found = {pass_: read_results(path) if os.path.exists(path) else None for pass_, path in paths.items()}
    if all(rows is None for rows in found.values()):
        raise ValueError(f"{csv_path}: no such results CSV")
    readme_dir = os.path.dirname(os.path.abspath(readme_path))
    chapter_dirs = sorted(os.path.basename(os.path.dirname(p))
                          for p in glob.glob(os.path.join(readme_dir, "[0-9][0-9]_*", "README.md")))
    rows, backward_rows = found["forward"], found["backward"]
    if rows is not None:
        csv_path = paths["forward"]
        env = read_env(env_path(csv_path))
        gpu = env.get("gpu") or os.path.splitext(os.path.basename(csv_path))[0].replace("_", " ")
        md_path = os.path.splitext(csv_path)[0] + ".md"
        if write_if_changed(md_path, results_markdown(rows, env, os.path.basename(csv_path))):
            say(f"{md_path}: written")
        update_file(readme_path, CHAPTERS_BEGIN, CHAPTERS_END, chapters_markdown(read_chapters(readme_dir)))
        update_file(readme_path, STAGE_BEGIN, STAGE_END,
                    stage_table_markdown(rows, os.path.relpath(csv_path, readme_dir), gpu))
        for i, chapter in enumerate(chapter_dirs):
            path = os.path.join(readme_dir, chapter, "README.md")
            body = chapter_table_markdown(rows, chapter, chapter_dirs[i - 1] if i else None,
                                          os.path.relpath(csv_path, os.path.dirname(path)), gpu)
            update_file(path, MEASURED_BEGIN, MEASURED_END, body)
        say(f"tables regenerated from {csv_path} ({len(rows)} rows)")
    if backward_rows is not None:
        csv_path = paths["backward"]
        env = read_env(env_path(csv_path))
        gpu = env.get("gpu") or os.path.basename(csv_path)[:-len(".backward.csv")].replace("_", " ")
        md_path = os.path.splitext(csv_path)[0] + ".md"
        if write_if_changed(md_path, backward_results_markdown(backward_rows, env, os.path.basename(csv_path))):
            say(f"{md_path}: written")
        measured = {impl.partition(".")[0] for impl in chapter_impls(backward_rows)}
        for chapter in chapter_dirs:
            path = os.path.join(readme_dir, chapter, "README.md")
            with open(path) as f:
                marked = BACKWARD_BEGIN in f.read()
            if marked or chapter in measured:  # (a chapter without a backward says nothing)
                body = backward_chapter_markdown(backward_rows, chapter,
                                                 os.path.relpath(csv_path, os.path.dirname(path)), gpu)
                update_file(path, BACKWARD_BEGIN, BACKWARD_END, body)
        say(f"backward tables regenerated from {csv_path} ({len(backward_rows)} rows)")
    update_values(prose_files(readme_path), rows, backward_rows)


# --- The plot ------------------------------------------------------------------------------

def plot_results(rows, path, gpu):
    """TFLOP/s vs N (log-log), 4 panels (D x causal): chapters solid, steps dash-dotted, anchors dashed;
    needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib not found: plot skipped")
        return
    # One line per (impl, dtype). Chapters solid, each its own colour and marker; a chapter's steps
    # (08.1 ...) in shades of its colour, dash-dotted; anchors dashed with hollow markers. A line
    # that would hide under the one before it (02/03, 04/05: the same speed) is drawn short-dashed
    # on top of it, with a larger hollow marker, so that both show.
    series = sorted({(r["impl"], r["dtype"]) for r in rows if not is_anchor(r["impl"])})
    series += [(impl, dtype) for impl in anchor_impls(rows) for dtype in sorted({r["dtype"] for r in rows
                                                                                 if r["impl"] == impl})]
    several = {impl for impl, _ in series if sum(1 for i, _ in series if i == impl) > 1}
    stepped = {impl[:2] for impl, _ in series if "." in impl}
    step_of = {chapter: step for step, chapter in step_aliases().items() if chapter[:2] in stepped}

    def label(impl, dtype):
        name = f"{impl} ({step_of[impl]})" if impl in step_of else impl
        return f"{name}, {dtype}" if impl in several or "." in impl or impl in step_of else name

    def points(key, d, c):
        return sorted((r["seqlen"], r["tflops"]) for r in rows if (r["impl"], r["dtype"], r["headdim"], r["causal"])
                      == (*key, d, c) and timed(r, "tflops") is not None)

    chapter_colors = ["#8c510a", "#1f78b4", "#ff7f00", "#33a02c", "#e31a1c", "#17becf", "#b8860b", "#6a3d9a"]
    anchor_styles = {"torch_flash": ("#000000", "s"), "torch_cudnn": ("#525252", "D"),
                     "torch_efficient": ("#8c8c8c", "^"), "torch_eager": ("#8c8c8c", "v"),
                     "cudnn_fp8": ("#c51b7d", "*")}
    markers = ["o", "s", "^", "D", "v", "P", "X", "h"]
    chapters = [key for key in series if not is_anchor(key[0]) and "." not in key[0]]
    style = {}
    for i, key in enumerate(chapters):
        style[key] = {"color": chapter_colors[i % len(chapter_colors)], "linestyle": "-", "linewidth": 1.8,
                      "marker": markers[i % len(markers)], "markersize": 4.5}
    for key in series:
        if "." in key[0]:  # a step: the chapter's hue, lighter for earlier steps
            chapter = next((k for k in chapters if k[0][:2] == key[0][:2]), None)
            steps = sorted(k for k in series if "." in k[0] and k[0][:2] == key[0][:2])
            base = matplotlib.colors.to_rgb(style[chapter]["color"]) if chapter else (0.4, 0.4, 0.4)
            mix = 0.15 + 0.55 * (len(steps) - steps.index(key)) / (len(steps) + 1)
            style[key] = {"color": tuple(b + (1 - b) * mix for b in base), "linestyle": "-.", "linewidth": 1.5,
                          "marker": ["v", "^", "<", ">", "d"][steps.index(key) % 5], "markersize": 5}
        elif is_anchor(key[0]):
            color, marker = anchor_styles.get(key[0], ("#404040", "x"))
            style[key] = {"color": color, "linestyle": "--", "linewidth": 1.8 if key[0] == "cudnn_fp8" else 1.3,
                          "marker": marker, "markersize": 7 if marker == "*" else 5, "markerfacecolor": "white"}
    for i, key in enumerate(chapters[1:], 1):  # hidden under the chapter before it, in some panel?
        for d, c in [(d, c) for d in BENCH_DS for c in (0, 1)]:
            before = dict(points(chapters[i - 1], d, c))
            ratios = [y / before[n] for n, y in points(key, d, c) if before.get(n)]
            if len(ratios) >= 2 and all(0.93 < r < 1.075 for r in ratios):
                style[key].update(linestyle=(0, (3, 1.6)), markerfacecolor="white", markersize=6.5, zorder=3)
    ns = bench_ns(rows)
    fig, axes = plt.subplots(2, 2, figsize=(13.5, 9.5), sharex=True)
    for ax, (d, c) in zip(axes.flat, [(d, c) for d in BENCH_DS for c in (0, 1)]):
        for key in series:
            line = points(key, d, c)
            if line:
                ax.plot(*zip(*line), label=label(*key), **style[key])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns)
        ax.set_xticklabels([n_label(n) for n in ns])
        ax.set_title(f"D={d}, {'causal' if c else 'non-causal'}")
        ax.set_xlabel("N (B = 16k/N, H = 2048/D)")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = max((ax.get_legend_handles_labels() for ax in axes.flat), key=lambda hl: len(hl[1]))
    fig.legend(handles, labels, loc="center right", fontsize=8.5, handlelength=3.2, labelspacing=0.7)
    fig.suptitle(f"FlashAttention stage by stage on {gpu}, fp16 in and out (08.4 and 08.5 compute in FP8)")
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"{path}: written")
