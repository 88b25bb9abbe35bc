"""The report of a benchmark run: the number formats, the Markdown tables (the README's stage
table, docs/results/<gpu>.md, each chapter README's measured block), the text tables `make run`
and `make bench` print, and the plot. It reads result rows (common/results.py) and writes text."""
import glob
import os

from chapters import CHAPTERS_BEGIN, CHAPTERS_END, chapters_markdown, read_chapters
from results import (BENCH_DS, BENCH_ITERS, CUDNN, EAGER, FA2, HEADLINE_D, HEADLINE_N, HIDDEN, TIMED, TOTAL_TOKENS,
                     anchor_impls, bench_shape, chapter_impls, env_path, find_row, is_anchor, read_env, read_results,
                     timed, write_if_changed)

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
        body.append([impl] + stage_cells(rows, impl, first, prev, 0, headdim, seqlen)
                    + stage_cells(rows, impl, first, prev, 1, headdim, seqlen))
    return body


def stage_header(first="01"):
    """The stage table's header."""
    half = ["TFLOP/s", f"x vs {first}", "x vs prev", "x vs eager", "% FA2", "% cuDNN"]
    return ["chapter", "non-causal ms"] + half + ["causal ms"] + half


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
    caption = (f"*{gpu}, D={HEADLINE_D}, N={HEADLINE_N} (B={shape['batch']}, H={shape['heads']}), "
               f"fp16, median ms; {anchors}; from `{source}`, regenerated by `make bench`.*")
    return caption + "\n\n" + markdown_table(stage_header(first), stage_body(rows), "l" + "r" * 14)


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
    if not any(r["seqlen"] == HEADLINE_N and r["headdim"] == HEADLINE_D for r in rows):
        say(f"(no rows at the headline shape D={HEADLINE_D}, N={HEADLINE_N})")
        return
    shape = bench_shape(HEADLINE_D, HEADLINE_N, 0)
    say("")
    say(f"Headline shape D={HEADLINE_D} N={HEADLINE_N} B={shape['batch']} H={shape['heads']} "
        "(non-causal | causal):")
    say(text_table(stage_header(), stage_body(rows), "l" + "r" * 14))


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


# --- The plot ------------------------------------------------------------------------------

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
