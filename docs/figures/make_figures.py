#!/usr/bin/env python3
"""Make the tutorial's figures: docs/figures/*.svg.

Every number drawn comes from the repository itself:
  - the chapters' constants, parsed from `#define NAME value` and `static constexpr int NAME = ...`
    lines of NN_name/attention.cu in the branches of its #if switches that the default build compiles
    (tile sizes, thread counts, padding, pipeline stages), plus a few expressions read from the sources
    (07's ldmatrix addresses and P repacking, 05's block order, 08's key_slot, the order of 08's producer
    and consumer steps, checked before its timeline is drawn), and 08's steps (STEP_NAME, STEP_PRECISION);
  - the headline shape, from common/results.py (HEADLINE_D, HEADLINE_N);
  - the measured times, from docs/results/NVIDIA_H200.csv (csv module) and the SM clock from
    docs/results/NVIDIA_H200.env; for the ping-pong figure, the tensor and XU pipe utilisation of 08's
    attention kernel from ncu_08_split_exp2.txt and ncu_08_split_exp2_pipes.txt (Nsight Compute), in
    docs/results/logs/08/ or else docs/results/logs/.
Only documented hardware facts of the H200 are constants here (HARDWARE, below).

    python3 docs/figures/make_figures.py          # rewrites docs/figures/*.svg
    python3 docs/figures/make_figures.py --png DIR   # also writes a PNG copy of each, to look at

matplotlib (and NumPy) are optional for the project: without them this prints one line and exits 0.
The output is deterministic: the same inputs give byte-identical SVGs.
"""
import argparse
import ast
import csv
import functools
import glob
import heapq
import io
import math
import os
import re
import sys

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch, Patch, PathPatch, Polygon, Rectangle
    from matplotlib.path import Path
except ImportError:
    plt = None

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(ROOT, "docs", "results", "NVIDIA_H200")

# NVIDIA H200 (Hopper GH100, SXM), from NVIDIA's H200 product brief and the Hopper tuning guide.
HARDWARE = {
    "gpu": "NVIDIA H200",
    "sms": 132,                    # streaming multiprocessors
    "registers_per_sm": 64 * 1024,  # 32-bit registers
    "smem_per_sm_kib": 228,        # shared memory per SM at most (carved out of 256 KiB L1/shared)
    "l1_smem_per_sm_kib": 256,     # combined L1 data cache and shared memory per SM
    "l2_mb": 50,
    "hbm_gb": 141,                 # HBM3e
    "hbm_tb_s": 4.8,
    "banks": 32,                   # shared memory: 32 banks...
    "bank_bytes": 4,               # ...of 4 bytes, one access per bank per clock
    "fp8_flop_per_clock_sm": 8192,  # dense e4m3 wgmma: 1979 TFLOP/s = 132 SMs x 1.83 GHz x 8192 (datasheet)
    "ex2_per_clock_sm": 16,        # MUFU.EX2 results per clock per SM (CUDA Programming Guide, cc 9.0)
}

COLORS = {"q": "#9ecae1", "k": "#fdae6b", "s": "#bcbddc", "hi": "#e6550d", "hbm": "#fee6ce", "smem": "#deebf7",
          "reg": "#e5f5e0", "l2": "#efedf5"}
QUAD = ["#6baed6", "#fd8d3c", "#74c476", "#9e9ac8"]  # a0a1, a2a3, a4a5, a6a7 / ldmatrix matrices 0..3


# --- Reading the sources ------------------------------------------------------------------------

DIRECTIVE = re.compile(r"^\s*#\s*(\w+)\b\s*(.*?)\s*(?://.*)?$")
OBJECT_MACRO = re.compile(r"^([A-Za-z_]\w*)(?:[ \t]+(.*))?$")  # NAME value (not NAME(args) value)


def preprocess(text, defines=None):
    """The lines of a source that a build compiles, as the C preprocessor picks them: the branches of
    #if/#ifdef/#ifndef/#elif/#else that hold (the others blanked, so line numbers stay), with the object-like
    #defines made on the way (defines: -D switches, given first). Returns (text, defines, the #error lines met)."""
    defines = dict(defines or {})
    out, errors, stack, active = [], [], [], True

    def holds(kind, expr):
        if kind == "ifdef":
            return expr.split()[0] in defines
        if kind == "ifndef":
            return expr.split()[0] not in defines
        expr = re.sub(r"\bdefined\s*\(\s*(\w+)\s*\)|\bdefined\s+(\w+)",
                      lambda m: "1" if (m.group(1) or m.group(2)) in defines else "0", expr)
        return bool(macro_value(defines, expr))

    for line in text.split("\n"):
        match = DIRECTIVE.match(line)
        kind, rest = (match.group(1), match.group(2)) if match else (None, "")
        if kind in ("if", "ifdef", "ifndef"):
            stack.append([active, False])
            active = active and holds(kind, rest)
            stack[-1][1] = active
        elif kind == "elif":
            parent, taken = stack[-1]
            active = parent and not taken and holds("if", rest)
            stack[-1][1] = taken or active
        elif kind == "else":
            parent, taken = stack[-1]
            active, stack[-1][1] = parent and not taken, True
        elif kind == "endif":
            active = stack.pop()[0]
        elif active and kind == "define":
            macro = OBJECT_MACRO.match(rest)
            if macro:
                defines[macro.group(1)] = (macro.group(2) or "").strip()
        elif active and kind == "undef":
            defines.pop(rest.split()[0], None)
        elif active and kind == "error":
            errors.append(rest)
        out.append(line if active and kind not in ("if", "ifdef", "ifndef", "elif", "else", "endif") else "")
    return "\n".join(out), defines, errors


def macro_value(defines, expr, depth=0):
    """The integer value of a preprocessor expression: macros expanded from defines, unknown names 0."""
    if depth > 20:
        raise ValueError(f"macros nested too deep in {expr!r}")
    tree = ast.parse(c_to_python(expr) or "0", mode="eval")
    bad = [type(node).__name__ for node in ast.walk(tree) if not isinstance(node, SAFE_NODES)]
    if bad:
        raise ValueError(f"cannot evaluate the preprocessor expression {expr!r}: {bad}")
    names = {node.id: macro_value(defines, defines[node.id], depth + 1) if node.id in defines else 0
             for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return eval(compile(tree, "<#if>", "eval"), {"__builtins__": {}}, names)


def raw_source(chapter):
    """The text of NN_name/attention.cu, as it is."""
    with open(os.path.join(ROOT, chapter, "attention.cu")) as f:
        return f.read()


def source_text(chapter, **defines):
    """The text of NN_name/attention.cu that its build compiles (the default build, or the one with these
    -D switches): the branches of its #if switches not taken are blanked."""
    return preprocess(raw_source(chapter), defines)[0]


def chapter_steps(chapter):
    """A chapter built in steps (08: its step files 08_fp8/stepK_*.cu, then attention.cu): [(step, name,
    precision macro)] as common/chapters.py reads them; [] for other chapters."""
    sys.path.insert(0, os.path.join(ROOT, "common"))
    import chapters  # common/chapters.py: the steps as the build and the bench see them
    return [(s["step"], s["name"], s["precision"])
            for s in chapters.read_steps(os.path.join(ROOT, chapter, "attention.cu"))]


def split_top_level(text):
    """Split `A = x, B = f(y, z)` at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def chapter_constants(chapter):
    """NAME -> expression text of the #defines and `static constexpr int`s (and bools) of the chapter's default
    build (its #if switches as the preprocessor takes them; first wins)."""
    return text_constants(source_text(chapter))


def text_constants(text):
    """NAME -> expression text of the #defines and `static constexpr int`s (and bools) of a source's text."""
    consts = {}
    for name, value in re.findall(r"^\s*#define\s+([A-Z_][A-Z0-9_]*)[ \t]+([^\n]*?)\s*(?://[^\n]*)?$", text, re.M):
        consts.setdefault(name, value)
    for decl in re.findall(r"static\s+constexpr\s+(?:int|bool)\s+([^;]+);", text):
        for part in split_top_level(decl):
            name, _, value = part.partition("=")
            consts.setdefault(name.strip(), value.strip())
    return consts


def c_to_python(expr):
    """A C integer expression as Python: sizeof of the two types used, no casts, ternaries, integer
    division, and the logical operators as Python's and/or/not, which keep C's truth but not its
    0/1 values or the precedence of `!`: enough for the conditions of ternaries they serve here."""
    expr = re.sub(r"\(int\)\s*sizeof\(__half\)|sizeof\(__half\)", "2", expr)
    expr = re.sub(r"\(int\)\s*sizeof\(float\)|sizeof\(float\)", "4", expr)
    expr = re.sub(r"\((?:int|unsigned)\)", "", expr)
    expr = re.sub(r"(\d+\.\d*)f\b", r"\1", expr)
    expr = re.sub(r"\btrue\b", "1", re.sub(r"\bfalse\b", "0", expr))
    expr = expr.replace("&&", " and ").replace("||", " or ")
    expr = re.sub(r"!(?!=)", " not ", expr)
    inner = re.compile(r"\(([^()?:]*)\?([^()?:]*):([^()?:]*)\)")  # a bracketed ternary, innermost first
    while inner.search(expr):
        expr = inner.sub(lambda m: f"(({m.group(2)}) if ({m.group(1)}) else ({m.group(3)}))", expr)
    ternary = re.match(r"^(.*?)\?(.*?):(.*)$", expr, re.S)
    if ternary:
        cond, yes, no = ternary.groups()
        expr = f"({yes}) if ({cond}) else ({no})"
    return " ".join(expr.replace("/", "//").split())


SAFE_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.IfExp, ast.Constant, ast.Name, ast.Load,
              ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.USub, ast.Eq, ast.NotEq, ast.Lt, ast.Gt,
              ast.LtE, ast.GtE, ast.BoolOp, ast.And, ast.Or, ast.Not)


def const_expr(consts, expr, **env):
    """Evaluate a C integer expression, resolving the names in it from env, then from consts."""
    tree = ast.parse(c_to_python(expr), mode="eval")
    bad = [type(node).__name__ for node in ast.walk(tree) if not isinstance(node, SAFE_NODES)]
    if bad:
        raise ValueError(f"cannot evaluate {expr!r}: {bad}")
    names = dict(env)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in names:
            names[node.id] = const(consts, node.id, **env)
    return eval(compile(tree, "<constant>", "eval"), {"__builtins__": {}}, names)


def const(consts, name, **env):
    """The integer value of constant `name` (env: template parameters such as HEAD_DIM)."""
    if name not in consts:
        raise KeyError(f"constant {name} not found in the chapter source: the figure script needs updating")
    return const_expr(consts, consts[name], **env)


def find(pattern, text, what, flags=0):
    """re.search that says what it could not find in which source."""
    match = re.search(pattern, text, flags)
    if not match:
        raise LookupError(f"{what} not found: the figure script needs updating")
    return match


def launch_bound_blocks(chapter):
    """Blocks per SM the kernel asks for: the second argument of __launch_bounds__."""
    match = find(r"__launch_bounds__\(\s*THREADS\s*,\s*(\w+)\s*\)", source_text(chapter),
                 f"{chapter}'s __launch_bounds__(THREADS, blocks)")
    return const_expr(chapter_constants(chapter), match.group(1))


PRECISIONS = {"FP32": "fp32 CUDA cores", "FP16_TC": "fp16 tensor cores", "FP8_TC": "fp8 tensor cores"}


def precision_of(chapter):
    """fp32 / fp16 tensor cores / fp8 tensor cores, from the Chapter struct's precision field: PRECISION_x,
    or a macro the build defines to one (08's STEP_PRECISION)."""
    text = source_text(chapter)
    struct = find(r"\bChapter\s+chapter\s*=\s*\{(.*?)\};", text, f"{chapter}'s Chapter struct", re.S).group(1)
    field = find(r"\b(\w*PRECISION\w*)\s*,", struct, f"{chapter}'s precision").group(1)
    defines = preprocess(raw_source(chapter))[1]
    kind = defines.get(field, field).strip()
    kind = find(r"^PRECISION_(\w+)$", kind, f"{chapter}'s precision ({field})").group(1)
    return PRECISIONS.get(kind, kind)


def heaviest_first(chapter):
    """Check that the causal grid hands out the last query tile first (query_tile = gridDim.y - 1 - blockIdx.y)."""
    find(r"query_tile\s*=\s*causal\s*\?\s*gridDim\.y\s*-\s*1\s*-\s*blockIdx\.y", source_text(chapter),
         f"{chapter}'s heaviest-first causal order")
    return True


def ldmatrix_q_address(lane):
    """(row, 8-half chunk) whose address lane `lane` gives in 07's load_q_step (first m16 tile, k-step 0)."""
    match = find(r"ldmatrix_x4\(frag\[mt\],\s*q_tile\s*\+\s*tile_offset<HEAD_DIM>\((.+?),\s*(.+?)\)\);",
                 source_text("07_async_pipeline"), "07's ldmatrix of Q in load_q_step", re.S)
    consts, env = chapter_constants("07_async_pipeline"), {"warp_row0": 0, "mt": 0, "ks": 0, "lane": lane}
    return const_expr(consts, match.group(1), **env), const_expr(consts, match.group(2), **env)


def p_repack_lines():
    """07's lines that pack two n8 score accumulators into one A fragment of P, and their map:
    A register i <- (which of the two n8 tiles, accumulator elements)."""
    text, consts = source_text("07_async_pipeline"), chapter_constants("07_async_pipeline")
    lines = re.findall(r"(p_frag\[mt\]\[kk\]\[\w+\]\s*=\s*pack_half2\(.*?\);)", text, re.S)
    mapping = {}
    for line in lines:
        reg = const_expr(consts, re.search(r"p_frag\[mt\]\[kk\]\[(\w+)\]", line).group(1))
        tiles = re.findall(r"score\[mt\]\[2\s*\*\s*kk(\s*\+\s*1)?\]\[([^\]]+)\]", line)
        mapping[reg] = (1 if tiles[0][0] else 0, [const_expr(consts, e) for _, e in tiles])
    if sorted(mapping) != [0, 1, 2, 3]:
        raise LookupError("07's p_frag = pack_half2(...) lines not found: the figure script needs updating")
    return [" ".join(line.split()) for line in lines], mapping


# --- Reading the results ------------------------------------------------------------------------

def read_results():
    """The rows of docs/results/NVIDIA_H200.csv, numbers parsed (empty cells: None)."""
    with open(RESULTS + ".csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ("batch", "heads", "seqlen", "headdim", "causal"):
            row[key] = int(row[key])
        for key in ("ms", "tflops"):
            row[key] = float(row[key]) if row[key] else None
    return rows


def read_env():
    """key -> value of docs/results/NVIDIA_H200.env."""
    with open(RESULTS + ".env") as f:
        return dict(line.rstrip("\n").split(": ", 1) for line in f if ": " in line)


def sm_clock_ghz(env):
    """The SM clock the results were measured at (its maximum), in GHz."""
    return int(re.search(r"(\d+) MHz max", env["sm_clock"]).group(1)) / 1000


def headline_shape():
    """(D, N) of the headline shape: common/results.py, else the root README's stage-table caption."""
    with open(os.path.join(ROOT, "common", "results.py")) as f:
        match = re.search(r"HEADLINE_D,\s*HEADLINE_N\s*=\s*(\d+),\s*(\d+)", f.read())
    if not match:
        with open(os.path.join(ROOT, "README.md")) as f:
            match = find(r"D=(\d+), N=(\d+) \(B=\d+, H=\d+\)", f.read(), "the headline shape")
    return int(match.group(1)), int(match.group(2))


@functools.lru_cache(maxsize=None)
def step_table():
    """impl -> (step label, dtype of its operands) for the builds of every chapter built in steps: 08's
    steps as common/chapters.py reads them, e.g. '08.1' -> ('08.1', 'fp16'), '08_fp8' -> ('08.6', 'fp8')."""
    table = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "[0-9][0-9]_*", "attention.cu"))):
        chapter = os.path.basename(os.path.dirname(path))
        for step, name, precision in chapter_steps(chapter):
            table[name] = (f"{chapter[:2]}.{step}", "fp8" if precision.endswith("FP8_TC") else "fp16")
    return table


def is_chapter(impl):
    """A chapter's row (01_naive, ...) rather than an anchor's (torch_flash, ...)."""
    return re.match(r"^\d\d_", impl) is not None


def is_step(impl):
    """A row of one step of a chapter (08.1, ...): NN.k."""
    return re.match(r"^\d\d\.\d+$", impl) is not None


def own_dtype(impl, dtypes):
    """The dtype of impl's own row, given the dtypes its rows have: a chapter's from its source (fp8 for
    an fp8 tensor-core chapter, else fp16: other dtypes are other builds of it), a step's from its
    chapter's source (step_table), anything else's its only one."""
    if is_chapter(impl):
        return "fp8" if precision_of(impl) == "fp8 tensor cores" else "fp16"
    if impl in step_table():
        return step_table()[impl][1]
    if len(dtypes) > 1:
        raise LookupError(f"{impl} has rows of dtypes {sorted(dtypes)} at one shape: the figure script does not "
                          f"know which is its own")
    return next(iter(dtypes))


def headline_rows(rows, causal=0):
    """impl -> its timed row at the headline shape, of its own dtype (own_dtype): a row of another build
    of the same impl (08_fp8 on fp16 operands) is never taken."""
    headdim, seqlen = headline_shape()
    found = {}
    for r in rows:
        if (r["headdim"], r["seqlen"], r["causal"]) == (headdim, seqlen, causal) and \
                r["status"] in ("PASS", "unchecked") and r["tflops"]:
            found.setdefault(r["impl"], {}).setdefault(r["dtype"], r)
    out = {}
    for impl, by_dtype in found.items():
        dtype = own_dtype(impl, set(by_dtype))
        if dtype in by_dtype:
            out[impl] = by_dtype[dtype]
    return out


# --- Drawing helpers ----------------------------------------------------------------------------

def setup_matplotlib():
    """Deterministic, readable SVG output."""
    matplotlib.rcParams.update({
        "svg.hashsalt": "flashattention-tutorial-figures",
        "svg.fonttype": "none",  # text as <text>: small files; the font stack below falls back to any sans
        "font.family": "sans-serif",
        "font.sans-serif": ["DejaVu Sans", "Arial", "Helvetica"],
        "font.monospace": ["DejaVu Sans Mono", "Consolas", "Menlo"],
        "font.size": 10,
        "axes.titlesize": 11,
        "path.simplify": True,
        "figure.dpi": 100,
    })


def blank_axes(ax, xlim, ylim):
    """An axes with no frame, equal aspect, y growing downwards (as matrix rows do)."""
    ax.set_xlim(*xlim)
    ax.set_ylim(ylim[1], ylim[0])
    ax.set_aspect("equal")
    ax.axis("off")


def rect(ax, x, y, w, h, color, edge="#404040", lw=0.6, **kw):
    """One rectangle, top-left corner (x, y) on a y-down axes."""
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, linewidth=lw, **kw))


def merge_boxes(boxes):
    """Fewer rectangles covering the same cells: runs along rows, then equal runs stacked down."""
    rows = {}
    for x, y, w, h in sorted(boxes, key=lambda b: (round(b[1], 6), round(b[0], 6))):
        runs = rows.setdefault((round(y, 6), round(h, 6)), [])
        if runs and abs(runs[-1][0] + runs[-1][2] - x) < 1e-9:
            runs[-1][2] += w
        else:
            runs.append([x, y, w, h])
    merged = {}
    for (y, h), runs in sorted(rows.items()):
        for x, _, w, _ in runs:
            key = (round(x, 6), round(w, 6))
            stack = merged.setdefault(key, [])
            if stack and abs(stack[-1][1] + stack[-1][3] - y) < 1e-9:
                stack[-1][3] += h
            else:
                stack.append([x, y, w, h])
    return [tuple(b) for key in sorted(merged) for b in merged[key]]


def rect_group(ax, boxes, color, edge="none", lw=0.6):
    """Rectangles (x, y, w, h) of one colour, merged, as a single path: one SVG element, not one per cell."""
    vertices, codes = [], []
    for x, y, w, h in merge_boxes(boxes):
        vertices += [(x, y), (x + w, y), (x + w, y + h), (x, y + h), (x, y)]
        codes += [Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY]
    if vertices:
        ax.add_patch(PathPatch(Path(vertices, codes), facecolor=color, edgecolor=edge, linewidth=lw))


def line_group(ax, segments, color="#808080", lw=0.3, zorder=2):
    """Line segments ((x0, y0), (x1, y1)) as a single path."""
    vertices = [p for segment in segments for p in segment]
    codes = [Path.MOVETO, Path.LINETO] * len(segments)
    if vertices:
        ax.add_patch(PathPatch(Path(vertices, codes), facecolor="none", edgecolor=color, linewidth=lw,
                               zorder=zorder))


def box(ax, x, y, w, h, text, color, size=9, **kw):
    """A rounded box with centred text."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12", facecolor=color,
                                edgecolor="#404040", linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", size=size, **kw)


def arrow(ax, start, end, color="#404040", text=None, size=9, lw=1.2, offset=(0, 0)):
    """An arrow from start to end, with optional text at its middle (moved by offset)."""
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=lw, shrinkA=0,
                                                          shrinkB=0))
    if text:
        x = (start[0] + end[0]) / 2 + offset[0]
        y = (start[1] + end[1]) / 2 + offset[1]
        ax.text(x, y, text, ha="center", va="center", size=size, color=color,
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none"))


def grid_lines(ax, x, y, w, h, nx, ny, color="#808080", lw=0.3):
    """Lines dividing the rectangle into nx x ny cells, as one path."""
    segments = [((x + w * i / nx, y), (x + w * i / nx, y + h)) for i in range(1, nx)]
    segments += [((x, y + h * j / ny), (x + w, y + h * j / ny)) for j in range(1, ny)]
    line_group(ax, segments, color, lw)


FONT_STYLE = re.compile(r"font-family: ([^;\"]+)")


def compact_svg(svg):
    """Smaller, same picture: one CSS font-family rule for the sans-serif texts instead of one per text,
    no no-op rotations, no group around each single text."""
    sans = sorted({f for f in FONT_STYLE.findall(svg) if f.endswith("sans-serif")})
    if len(sans) == 1:
        svg = svg.replace(f"font-family: {sans[0]}; ", "").replace(f"; font-family: {sans[0]}\"", "\"")
        svg = svg.replace("<style type=\"text/css\">", f"<style type=\"text/css\">text{{font-family: {sans[0]}}}\n", 1)
    svg = re.sub(r' transform="rotate\(-0 [-\d.]+ [-\d.]+\)"', "", svg)
    return re.sub(r'<g id="text_\d+">\s*(<text [^>]*>[^<]*</text>)\s*</g>', r"\1", svg)


def save(fig, name, png_dir):
    """Write docs/figures/<name>.svg (deterministic, compacted) and, when asked, a PNG copy."""
    path = os.path.join(HERE, name + ".svg")
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight", pad_inches=0.1)
    with open(path, "w") as f:
        f.write(compact_svg(buffer.getvalue()))
    if png_dir:
        fig.savefig(os.path.join(png_dir, name + ".png"), format="png", dpi=100, bbox_inches="tight",
                    pad_inches=0.1, metadata={"Software": None})
    plt.close(fig)
    return path


# --- 1. Memory hierarchy ------------------------------------------------------------------------

def memory_levels(clock_ghz):
    """Per level: name, capacity lines, bandwidth lines, what the tutorial keeps there."""
    hw = HARDWARE
    reg_kib = hw["registers_per_sm"] * 4 // 1024
    smem_bytes_per_clock = hw["banks"] * hw["bank_bytes"]
    smem_tb_s = hw["sms"] * smem_bytes_per_clock * clock_ghz * 1e9 / 1e12
    return [
        ("Registers", f"{hw['registers_per_sm'] // 1024}K × 32-bit = {reg_kib} KiB per SM\n"
                      f"× {hw['sms']} SMs = {hw['sms'] * reg_kib / 1024:.0f} MiB",
         "operands of every instruction,\nevery clock; private to a thread",
         "04-06: O accumulator, running max and sum\n07: also S and P, as mma.sync fragments"),
        ("Shared memory / L1", f"up to {hw['smem_per_sm_kib']} KiB per SM (of {hw['l1_smem_per_sm_kib']} KiB L1)\n"
                               f"× {hw['sms']} SMs = {hw['sms'] * hw['smem_per_sm_kib'] / 1024:.1f} MiB",
         f"{hw['banks']} banks × {hw['bank_bytes']} B = {smem_bytes_per_clock} B/clk per SM\n"
         f"= {smem_tb_s:.1f} TB/s at {clock_ghz:.2f} GHz, {hw['sms']} SMs",
         "02-07: Q, K, V tiles (07: a ring of K/V tiles)\n06: the S tile, P written over it"),
        ("L2 cache", f"{hw['l2_mb']} MB, shared by all SMs",
         "between those of shared memory\nand HBM (NVIDIA publishes none)",
         "K and V of one head, re-read by every\nquery tile of it: mostly L2 hits (04-08)"),
        ("HBM3e (device memory)", f"{hw['hbm_gb']} GB",
         f"{hw['hbm_tb_s']} TB/s peak",
         "Q, K, V in; O and LSE out\n01-03: also S and P, B·H·N² floats each"),
    ]


PYRAMID_X, BANDWIDTH_X, USE_X = 2.7, 5.6, 9.3


def draw_level(ax, index, level, color):
    """One level of the pyramid (a trapezoid) and its three text columns."""
    name, size, bandwidth, use = level
    top, height = index * 1.25, 1.05
    half_top, half_bottom = 1.45 + index * 0.3, 1.45 + (index + 1) * 0.3 - 0.05
    cx = PYRAMID_X
    ax.add_patch(Polygon([(cx - half_top, top), (cx + half_top, top), (cx + half_bottom, top + height),
                          (cx - half_bottom, top + height)], closed=True, facecolor=color, edgecolor="#404040"))
    ax.text(cx, top + height * 0.28, name, ha="center", va="center", size=10.5, weight="bold")
    ax.text(cx, top + height * 0.68, size, ha="center", va="center", size=8.5)
    ax.text(BANDWIDTH_X, top + height / 2, bandwidth, ha="left", va="center", size=9)
    ax.text(USE_X, top + height / 2, use, ha="left", va="center", size=9)


def memory_hierarchy(ctx):
    """Figure 1: the H200's registers, shared memory, L2 and HBM (HARDWARE; the SM clock from the .env)."""
    levels = memory_levels(ctx["clock_ghz"])
    fig, ax = plt.subplots(figsize=(11.5, 5.4))
    blank_axes(ax, (-0.3, 13.5), (-0.7, len(levels) * 1.25))
    ax.set_aspect("auto")
    for i, (level, color) in enumerate(zip(levels, [COLORS["reg"], COLORS["smem"], COLORS["l2"], COLORS["hbm"]])):
        draw_level(ax, i, level, color)
    for x, head in ((PYRAMID_X, "capacity"), (BANDWIDTH_X, "bandwidth"), (USE_X, "what this tutorial keeps there")):
        ax.text(x, -0.3, head, ha="center" if x == PYRAMID_X else "left", va="center", size=10, style="italic")
    ax.annotate("", xy=(0.05, 4.9), xytext=(0.05, 0.05), arrowprops=dict(arrowstyle="-|>", color="#808080", lw=1.2))
    ax.text(-0.12, 2.5, "larger, slower", rotation=90, va="center", ha="center", size=8.5, color="#606060")
    ax.set_title(f"The {HARDWARE['gpu']}'s memory hierarchy: every level a FlashAttention kernel uses", size=12)
    return fig


# --- 2. Chapter 02's tiles ----------------------------------------------------------------------

def tiling_constants():
    """02's tile sizes, and the threads per row of its block (tx = threadIdx.x % side)."""
    c = chapter_constants("02_tiling")
    tile, tile_k, threads, patch, pad = (const(c, n) for n in ("TILE", "TILE_K", "THREADS", "PATCH", "PAD"))
    side = find(r"tx\s*=\s*threadIdx\.x\s*%\s*(\d+)", source_text("02_tiling"), "02's thread layout").group(1)
    return {"tile": tile, "tile_k": tile_k, "threads": threads, "patch": patch, "pad": pad, "side": int(side)}


def draw_global_view(ax, t, headdim, tiles, block, slice_index, unit):
    """Q (N x D), K^T (D x N) and S (N x N) with the block's tile, its Q rows and K columns."""
    n, d, tile, tile_k = tiles * t["tile"], headdim, t["tile"], t["tile_k"]
    by, bx = block
    s_x, s_y = d * unit + 1.2, d * unit + 1.2          # S's top-left corner
    rect(ax, 0, s_y, d * unit, n * unit, "white")    # Q
    rect(ax, 0, s_y + by * tile * unit, d * unit, tile * unit, COLORS["q"])
    rect(ax, slice_index * tile_k * unit, s_y + by * tile * unit, tile_k * unit, tile * unit, "#3182bd")
    grid_lines(ax, 0, s_y, d * unit, n * unit, d // tile_k, tiles)
    rect(ax, s_x, 0, n * unit, d * unit, "white")    # K^T
    rect(ax, s_x + bx * tile * unit, 0, tile * unit, d * unit, COLORS["k"])
    rect(ax, s_x + bx * tile * unit, slice_index * tile_k * unit, tile * unit, tile_k * unit, "#e6550d")
    grid_lines(ax, s_x, 0, n * unit, d * unit, tiles, d // tile_k)
    rect(ax, s_x, s_y, n * unit, n * unit, "white")  # S
    grid_lines(ax, s_x, s_y, n * unit, n * unit, tiles, tiles)
    rect(ax, s_x + bx * tile * unit, s_y + by * tile * unit, tile * unit, tile * unit, COLORS["s"], lw=1.5)
    ax.text(d * unit / 2, s_y + n * unit + 0.9, f"Q  [N x D]\n(D = {d})", ha="center", va="top", size=9)
    ax.text(s_x - 0.3, d * unit / 2, "K^T  [D x N]", ha="right", va="center", size=9)
    ax.text(s_x + n * unit / 2, s_y + n * unit + 0.9, f"S = Q K^T  [N x N], a grid of {tile} x {tile} tiles\n"
            f"(drawn for N = {tiles} x {tile}; one block per tile)", ha="center", va="top", size=9)
    ax.text(d * unit / 2, s_y + by * tile * unit - 0.25, f"{tile_k}-dim\nslice", ha="center", va="bottom", size=7.5)
    return s_x + bx * tile * unit, s_y + by * tile * unit, tile * unit


def draw_block_zoom(ax, t, origin, size, thread):
    """The block's 64 x 64 tile: a grid of 16 x 16 threads, each a 4 x 4 patch; one thread's patch."""
    x0, y0 = origin
    side, patch, tile = t["side"], t["patch"], t["tile"]
    cell, strip = size / tile, 1.1
    ty, tx = thread
    rect(ax, x0, y0, size, size, COLORS["s"], lw=1.5)
    grid_lines(ax, x0, y0, size, size, side, side, color="#6a6a9a", lw=0.35)
    rect(ax, x0 + tx * patch * cell, y0 + ty * patch * cell, patch * cell, patch * cell, COLORS["hi"], lw=1.0)
    # q_tile[d][.] as a column on the left, k_tile[d][.] as a row on top: one float4 each.
    rect(ax, x0 - 2.4, y0, strip, size, COLORS["q"])
    rect(ax, x0 - 2.4, y0 + ty * patch * cell, strip, patch * cell, "#3182bd")
    rect(ax, x0, y0 - 2.4, size, strip, COLORS["k"])
    rect(ax, x0 + tx * patch * cell, y0 - 2.4, patch * cell, strip, "#e6550d")
    ax.text(x0 - 3.0, y0 + size / 2, f"q_tile[d][{patch}ty .. {patch}ty+{patch - 1}]: one float4", rotation=90,
            ha="center", va="center", size=8.5, bbox=dict(facecolor="white", edgecolor="none", pad=1))
    ax.text(x0 + size / 2, y0 - 2.9, f"k_tile[d][{patch}tx .. {patch}tx+{patch - 1}]: one float4",
            ha="center", va="bottom", size=8.5)
    ax.text(x0 + size / 2, y0 + size + 0.8,
            f"one block: {t['threads']} threads as {side} x {side}, each owning\na {patch} x {patch} patch of the "
            f"{tile} x {tile} tile; thread (ty, tx) = ({ty}, {tx}):\nrows {patch * ty}..{patch * ty + patch - 1}, "
            f"columns {patch * tx}..{patch * tx + patch - 1}. Per d: {patch} x {patch} = {patch * patch} FMAs\n"
            f"from two float4 reads of shared memory (an outer product)", ha="center", va="top", size=9)


def tiling_02(ctx):
    """Figure 2: 02's scores_kernel tiles and one thread's patch (02's TILE, TILE_K, THREADS, PATCH, PAD)."""
    t = tiling_constants()
    headdim, _ = headline_shape()
    unit = 1 / 16
    fig, ax = plt.subplots(figsize=(11, 7.0))
    tile_x, tile_y, tile_size = draw_global_view(ax, t, headdim, tiles=8, block=(2, 5), slice_index=1, unit=unit)
    zoom_x, zoom_y, zoom = 51, 12, 27
    blank_axes(ax, (-0.5, zoom_x + zoom + 0.5), (-0.5, 50.5))
    draw_block_zoom(ax, t, (zoom_x, zoom_y), zoom, thread=(5, 9))
    for (ax_, ay), (bx_, by_) in (((tile_x + tile_size, tile_y), (zoom_x, zoom_y)),
                                  ((tile_x + tile_size, tile_y + tile_size), (zoom_x, zoom_y + zoom))):
        ax.plot([ax_, bx_], [ay, by_], color="#9e9ac8", lw=0.8, ls="--")
    ax.text(-0.3, 47.3,
            f"Shared memory per block: q_tile and k_tile, each [{t['tile_k']}][{t['tile']} + {t['pad']}] floats, "
            f"stored [dim][row] (transposed, padded by PAD = {t['pad']}). The block loops over D in "
            f"{t['tile_k']}-dim slices:\nstage one slice of Q and of K, __syncthreads, {t['tile_k']} outer-product "
            f"steps, repeat. Each staged value feeds {t['patch']} FMAs of a thread and {t['tile']} of the block.",
            ha="left", va="top", size=9)
    ax.set_title(f"02_tiling, scores_kernel: S = Q K^T, one block per {t['tile']} x {t['tile']} tile of S "
                 f"(pv_kernel tiles O = P V the same way)", size=11.5)
    return fig


# --- 3. The online softmax, worked ----------------------------------------------------------------

EXAMPLE_SCORES = [2.0, 4.0, 1.0, 3.0, 5.0, 0.0, 6.0, 2.0]  # a row of 8 scores, processed as 2 tiles of 4


def online_softmax_steps(scores, tile):
    """The running (max, sum) after each tile, the rescale factors, and the one-pass result."""
    x = np.array(scores, dtype=np.float64)
    steps, m, l = [], -np.inf, 0.0
    for start in range(0, len(x), tile):
        part = x[start:start + tile]
        m_new = max(m, part.max())
        rescale = math.exp(m - m_new) if m > -np.inf else 0.0
        terms = np.exp(part - m_new)
        l = l * rescale + terms.sum()
        steps.append({"start": start, "tile_max": part.max(), "m_old": m, "m": m_new, "rescale": rescale,
                      "terms": terms, "l": l})
        m = m_new
    one_pass_m = x.max()
    one_pass_terms = np.exp(x - one_pass_m)
    return steps, {"m": one_pass_m, "terms": one_pass_terms, "l": one_pass_terms.sum()}


def table_cell(ax, col, row, text, color="white", bold=False, size=9.5):
    """One cell of a table drawn in data units."""
    rect(ax, col, row, 1, 1, color, edge="#a0a0a0", lw=0.5)
    ax.text(col + 0.5, row + 0.5, text, ha="center", va="center", size=size, weight="bold" if bold else "normal")


def online_softmax_rows(scores, tile, first, second, one):
    """The table: (row name, cell texts, cell colour per column, note at the row's end)."""
    blank = [""] * tile
    in_first = lambda j: COLORS["q"] if j < tile else "white"  # noqa: E731
    return [
        ("score x", [f"{v:g}" for v in scores], lambda j: [COLORS["q"], COLORS["k"]][j // tile], ""),
        (f"tile 1: exp(x - {first['m']:g})", [f"{v:.3f}" for v in first["terms"]] + blank, in_first,
         f"m1 = {first['m']:g},  l1 = {first['l']:.4f}"),
        (f"tile 1 x r = exp(x - {second['m']:g})", [f"{v * second['rescale']:.3f}" for v in first["terms"]] + blank,
         in_first, f"r = exp(m1 - m2) = {second['rescale']:.4f}\nl1 · r = {first['l'] * second['rescale']:.4f}"),
        (f"tile 2: exp(x - {second['m']:g})", blank + [f"{v:.3f}" for v in second["terms"]],
         lambda j: COLORS["k"] if j >= tile else "white",
         f"m2 = {second['m']:g},  l2 = l1 · r + {second['terms'].sum():.4f}\n     = {second['l']:.4f}"),
        (f"one pass: exp(x - {one['m']:g})", [f"{v:.3f}" for v in one["terms"]], lambda j: COLORS["s"],
         f"m = {one['m']:g},  l = {one['l']:.4f}"),
        ("p = exp(x - m) / l", [f"{v / one['l']:.3f}" for v in one["terms"]], lambda j: COLORS["s"],
         f"sum of p = {sum(one['terms'] / one['l']):.4f}"),
    ]


def online_softmax(ctx):
    """Figure 3: the online softmax worked on EXAMPLE_SCORES, against the one-pass softmax."""
    scores, tile = EXAMPLE_SCORES, 4
    steps, one = online_softmax_steps(scores, tile)
    first, second = steps
    fig, ax = plt.subplots(figsize=(11, 6.0))
    blank_axes(ax, (-4.6, 12.4), (-1.0, 8.4))
    ax.set_aspect("auto")
    for r, (name, cells, color, note) in enumerate(online_softmax_rows(scores, tile, first, second, one)):
        ax.text(-0.15, r + 0.5, name, ha="right", va="center", size=9.5)
        for j, text in enumerate(cells):
            table_cell(ax, j, r, text, color(j) if text else "white", bold=(r == 0))
        ax.text(8.2, r + 0.5, note, ha="left", va="center", size=9.5)
    tile_1 = ", ".join(f"{v:g}" for v in scores[:tile])
    notes = (f"tile 1:  m1 = max({tile_1}) = {first['m']:g};   l1 = sum of exp(x - m1) = {first['l']:.4f}\n"
             f"tile 2:  its max {second['tile_max']:g} > m1, so m2 = {second['m']:g};   rescale r = exp(m1 - m2) = "
             f"exp({first['m']:g} - {second['m']:g}) = {second['rescale']:.4f};   l2 = l1 · r + sum of exp(x - m2) = "
             f"{second['l']:.4f}\none pass (the max first, then the sum):  m = {one['m']:g},  l = {one['l']:.4f}:  "
             f"the same m and l; the rescaled tile-1 terms are the one-pass terms.\n"
             f"The kernels rescale the output accumulator O by the same r, so O / l after the last tile is exact.")
    ax.text(-4.5, 6.3, notes, ha="left", va="top", size=9.5, linespacing=1.5)
    ax.text(2.0, -0.35, f"tile 1 (keys 0-{tile - 1})", ha="center", size=9.5, color="#3182bd", weight="bold")
    ax.text(6.0, -0.35, f"tile 2 (keys {tile}-{2 * tile - 1})", ha="center", size=9.5, color="#e6550d", weight="bold")
    ax.set_title(f"The online softmax on one row of {len(scores)} scores, in 2 tiles of {tile}: a running max and "
                 f"a rescaled running sum", size=11.5)
    return fig


# --- 4. Loop order: FlashAttention-1 vs -2 --------------------------------------------------------

def loop_panel(ax, x0, tiles, fa2, title, outer, inner):
    """A query-tile x key-tile grid at x0, numbered in the order the work happens, with its two loops."""
    for i in range(tiles):
        for j in range(tiles):
            color = QUAD[i % 4] if fa2 else plt.cm.Greys(0.12 + 0.5 * j / tiles)
            rect(ax, x0 + j, i, 1, 1, color, edge="white", lw=1.5, alpha=0.8 if fa2 else 1)
            label = f"block {i}\nstep {j + 1}" if fa2 else f"step {j * tiles + i + 1}"
            ax.text(x0 + j + 0.5, i + 0.5, label, ha="center", va="center", size=8.5)
    for k in range(tiles):
        ax.text(x0 - 0.1, k + 0.5, f"Q{k}", ha="right", va="center", size=9.5)
        ax.text(x0 + k + 0.5, -0.1, f"K{k}, V{k}", ha="center", va="bottom", size=9)
    ax.annotate("", xy=(x0 + tiles, -0.65), xytext=(x0, -0.65), arrowprops=dict(arrowstyle="-|>", color="#505050"))
    ax.text(x0 + tiles / 2, -0.78, outer, ha="center", va="bottom", size=9, color="#303030")
    ax.annotate("", xy=(x0 - 0.75, tiles), xytext=(x0 - 0.75, 0), arrowprops=dict(arrowstyle="-|>", color="#505050"))
    ax.text(x0 - 0.9, tiles / 2, inner, rotation=90, ha="center", va="center", size=9, color="#303030")
    ax.text(x0 + tiles / 2, -1.55, title, ha="center", va="bottom", size=10.5, weight="bold")


def loop_order(ctx):
    """Figure 4: FlashAttention-1's and -2's loop orders (04's BLOCK_Q, BLOCK_KV; its headline row)."""
    c = chapter_constants("04_fused")
    block_q, block_kv = const(c, "BLOCK_Q"), const(c, "BLOCK_KV")
    _, seqlen = headline_shape()
    row = headline_rows(ctx["rows"])["04_fused"]
    heads, tiles, shown = row["batch"] * row["heads"], seqlen // block_q, 4
    fig, ax = plt.subplots(figsize=(11, 5.6))
    gap = 4.4
    blank_axes(ax, (-1.9, 2 * shown + gap + 0.9), (-2.3, shown + 1.7))
    loop_panel(ax, 0, shown, False, "FlashAttention-1", "outer loop: K/V tiles", "inner loop: query tiles")
    loop_panel(ax, shown + gap, shown, True, "FlashAttention-2 (chapters 04-08)", "the block's loop: K/V tiles",
               "one block per query tile, in parallel")
    ax.text(shown / 2, shown + 0.2,
            f"one block per head (B·H = {heads} in parallel)\nwalks all the pairs; every step reads and\n"
            f"writes O_i, m_i, l_i in device memory:\n"
            f"2 N / BLOCK_KV = {2 * seqlen // block_kv} passes over O at N = {seqlen}",
            ha="center", va="top", size=9)
    ax.text(1.5 * shown + gap, shown + 0.2,
            f"N / BLOCK_Q × B·H = {tiles} × {heads} = {tiles * heads} blocks\n"
            f"at N = {seqlen}; O, m, l stay in registers;\n"
            f"O is written once, divided by l once;\nno block talks to another", ha="center", va="top", size=9)
    ax.set_title(f"Which loop is outside: {shown} × {shown} (query tile, K/V tile) pairs; tiles of {block_q} queries "
                 f"and {block_kv} keys (04_fused's BLOCK_Q, BLOCK_KV)", size=11.5)
    return fig


# --- 5. Causal tiles and the heaviest-first order ------------------------------------------------

def greedy_makespan(works, slots):
    """Finish time when blocks start, in the given order, on whichever of `slots` frees first;
    and the schedule, (slot, start, work) per block."""
    free = [(0.0, slot) for slot in range(slots)]
    schedule = []
    for work in works:
        start, slot = heapq.heappop(free)
        heapq.heappush(free, (start + work, slot))
        schedule.append((slot, start, work))
    return max(t for t, _ in free), schedule


def causal_triangle(ax, tiles):
    """Query tile i x key tile j: computed, diagonal (masked per element), skipped; work per row."""
    for i in range(tiles):
        for j in range(tiles):
            if j < i:
                rect(ax, j, i, 1, 1, COLORS["q"], edge="white", lw=1.2)
            elif j == i:
                rect(ax, j, i, 1, 1, "white", edge="white", lw=1.2)
                ax.add_patch(Polygon([(j, i), (j, i + 1), (j + 1, i + 1)], facecolor="#3182bd", edgecolor="none"))
            else:
                rect(ax, j, i, 1, 1, "#f3f3f3", edge="white", lw=1.2)
        rect(ax, tiles + 0.4, i + 0.15, (i + 1) * 0.35, 0.7, COLORS["hi"], edge="none")
        ax.text(tiles + 0.5 + (i + 1) * 0.35, i + 0.5, f"{i + 1}", va="center", size=9)
        ax.text(-0.15, i + 0.5, f"{i}", ha="right", va="center", size=9)
        ax.text(i + 0.5, -0.15, f"{i}", ha="center", va="bottom", size=9)
    ax.text(tiles / 2, -0.9, "key tile j", ha="center", size=10)
    ax.text(-0.9, tiles / 2, "query tile i", rotation=90, va="center", ha="center", size=10)
    ax.text(tiles + 0.4, -0.15, "tiles of work", va="bottom", size=9)
    ax.text(0, tiles + 0.35, "computed, no mask", color="#3182bd", size=9, va="top")
    ax.text(0, tiles + 0.95, "diagonal: masked per element", color="#08519c", size=9, va="top")
    ax.text(0, tiles + 1.55, "above: skipped (never loaded)", color="#909090", size=9, va="top")


def gantt(ax, y0, schedule, slots, label, makespan, most):
    """Blocks on `slots` block slots over time; each bar is labelled with its query tile."""
    for slot, start, work in schedule:
        rect(ax, start, y0 + slot * 0.8, work, 0.7, plt.cm.Oranges(0.2 + 0.6 * work / most), edge="white", lw=1)
        ax.text(start + work / 2, y0 + slot * 0.8 + 0.35, f"{work - 1}", ha="center", va="center", size=8.5)
    ax.text(-0.3, y0 + slots * 0.4 - 0.05, label, ha="right", va="center", size=9)
    ax.plot([makespan, makespan], [y0 - 0.1, y0 + slots * 0.8], color="#a50f15", lw=1.2)
    ax.text(makespan + 0.2, y0 + slots * 0.4, f"done at {makespan:g}", va="center", size=9, color="#a50f15")


def causal_tiles(ctx):
    """Figure 5: the causal tile triangle and 05's heaviest-first order (05's constants and grid)."""
    c = chapter_constants("05_causal")
    block_q, block_kv = const(c, "BLOCK_Q"), const(c, "BLOCK_KV")
    tiles, slots = 8, 3
    fig = plt.figure(figsize=(11, 4.7))
    left = fig.add_axes([0.0, 0.0, 0.42, 0.9])
    right = fig.add_axes([0.47, 0.0, 0.53, 0.9])
    blank_axes(left, (-1.3, tiles + 3.8), (-1.2, tiles + 1.7))
    causal_triangle(left, tiles)
    works = [i + 1 for i in range(tiles)]
    heaviest_first("05_causal")  # stops the script if 05 no longer orders its blocks so
    order = works[::-1]
    blank_axes(right, (-5.0, 18.5), (-1.2, 8.6))
    right.set_aspect("auto")
    for y0, seq, label in ((0.0, works, "query tiles in\nindex order"),
                           (3.6, order, "05's order:\nheaviest first")):
        span, schedule = greedy_makespan(seq, slots)
        gantt(right, y0, schedule, slots, label, span, tiles)
    right.text(6.4, -0.45, f"one head's {tiles} query tiles on {slots} block slots (schematic); "
               f"bar = query tile, length = its work", ha="center", va="bottom", size=9)
    right.text(6.4, 6.4, headline_causal_note(ctx, block_q), ha="center", va="top", size=9)
    fig.suptitle(f"05_causal: causal attention on N = {tiles} tiles of {block_q} queries x {block_kv} keys: "
                 f"{tiles * (tiles + 1) // 2} of {tiles * tiles} tile products, heaviest query tiles launched first",
                 size=11.5, y=1.0)
    return fig


def headline_causal_note(ctx, block_q):
    """The same greedy model at the headline shape: index order vs heaviest first."""
    _, seqlen = headline_shape()
    row = headline_rows(ctx["rows"], causal=1)["05_causal"]
    heads, tiles = row["batch"] * row["heads"], seqlen // block_q
    slots = HARDWARE["sms"] * launch_bound_blocks("05_causal")
    light = [t + 1 for t in range(tiles) for _ in range(heads)]
    light_span, _ = greedy_makespan(light, slots)
    heavy_span, _ = greedy_makespan(light[::-1], slots)
    ideal = sum(light) / slots
    return (f"the same model at the headline N = {seqlen}: {tiles} query tiles x {heads} heads on "
            f"{HARDWARE['sms']} SMs x {launch_bound_blocks('05_causal')} blocks = {slots} slots\n"
            f"index order done at {light_span:g} tile-times, heaviest first at {heavy_span:g} "
            f"(perfect balance: {ideal:.1f})\ngrid (B*H, tiles): blockIdx.x = head runs fastest, "
            f"query_tile = gridDim.y - 1 - blockIdx.y")


# --- 6. Chapter 06's round trip through shared memory --------------------------------------------

def wmma_sizes(headdim):
    """06's tile shapes and shared-memory bytes at HEAD_DIM = headdim, from its constants and Smem<>."""
    c = chapter_constants("06_tensorcore_wmma")
    env = {"HEAD_DIM": headdim}
    names = ("BLOCK_Q", "BLOCK_KV", "STRIDE", "S_STRIDE", "P_STRIDE", "Q_BYTES", "S_BYTES", "KV_BYTES", "TOTAL",
             "FRAG", "WARPS", "BLOCKS_PER_SM")
    return {n: const(c, n, **env) for n in names}


LANES = {"hbm": (0.0, 1.5, "device memory", COLORS["hbm"]), "smem": (1.7, 2.4, "shared memory", COLORS["smem"]),
         "reg": (4.3, 2.0, "registers", COLORS["reg"])}
PITCH, BOX_W = 1.75, 1.45


def wmma_items(z, headdim):
    """name -> (column, lane, y offset in the lane, height, text): 06's data, step by step, where it lives."""
    bq, bkv, frag = z["BLOCK_Q"], z["BLOCK_KV"], z["FRAG"]
    return {
        "qkv": (0, "hbm", 0.2, 1.1, "Q, K, V\nfp16"),
        "tiles": (1, "smem", 0.2, 2.0, f"q_tile\nk_tile\nv_tile\n[{bq}][{z['STRIDE']}]\nfp16"),
        "qk_frag": (2, "reg", 0.2, 1.6, f"q_frag\nk_frag\nWMMA\n{frag}×{frag}×{frag}"),
        "s_frag": (3, "reg", 0.2, 1.6, f"s_frag[{bkv // frag}]\n{frag}×{bkv}\nfp32"),
        "s_tile": (4, "smem", 0.2, 2.0, f"s_tile\n[{bq}][{z['S_STRIDE']}]\nfp32"),
        "score": (5, "reg", 0.2, 1.6, f"score[{bkv // 2}]\nper lane:\nmax, exp2,\nsum"),
        "p_tile": (6, "smem", 0.2, 1.15, f"P over S\n[{frag}][{z['P_STRIDE']}]\nfp16"),
        "factor": (6, "smem", 1.5, 0.75, f"row_factor\n[{bq}] fp32"),
        "rescale": (7, "reg", 0.2, 1.6, f"o_acc[{headdim // frag}]\n*= row\nfactor"),
        "v_tile": (8, "smem", 0.2, 2.0, "v_tile\n(from 1)"),
        "pv_frag": (8, "reg", 0.2, 1.6, "p_frag\nv_frag\nWMMA"),
        "o_acc": (9, "reg", 0.2, 1.6, f"o_acc[{headdim // frag}]\n{frag}×{headdim}\nfp32"),
        "out": (9, "hbm", 0.2, 1.1, "O fp16\nLSE fp32"),
    }


# (from, to, step, where it leaves and where it arrives, as fractions (x, y) of each box)
WMMA_ARROWS = [("qkv", "tiles", "1", (0.8, 1), (0.2, 0)), ("tiles", "qk_frag", "2", (0.8, 1), (0.2, 0)),
               ("qk_frag", "s_frag", "3", (1, 0.5), (0, 0.5)), ("s_frag", "s_tile", "4", (0.8, 0), (0.2, 1)),
               ("s_tile", "score", "5", (0.8, 1), (0.2, 0)), ("score", "p_tile", "6", (0.85, 0), (0, 0.5)),
               ("score", "factor", "6", (1, 0.25), (0, 0.5)), ("factor", "rescale", "7", (1, 0.5), (0.25, 0)),
               ("p_tile", "pv_frag", "8", (1, 0.5), (0.2, 0)), ("v_tile", "pv_frag", "8", (0.5, 1), (0.5, 0)),
               ("pv_frag", "o_acc", "9", (1, 0.5), (0, 0.5)), ("o_acc", "out", "10", (0.5, 0), (0.5, 1))]

WMMA_STEPS = ["1  load_tile: 16-byte copies into padded rows (Q once; K and V every key tile)",
              "2  wmma::load_matrix_sync: the Q and K fragments",
              "3  wmma::mma_sync: S = Q K^T, fp16 in, fp32 accumulate",
              "4  store_matrix_sync: the fragment layout is opaque, so S goes to shared memory",
              "5  each pair of lanes reads its row as float4: mask, tile max, exp2, row sum",
              "6  P written over the warp's S rows as fp16; each row's rescale factor to row_factor",
              "7  o_acc.x[e] *= row_factor[frag_row[e]] (each element's row found once, at the start)",
              "8  load_matrix_sync: the P and V fragments",
              "9  mma_sync: O += P V",
              "10 after the last key tile: O / l, through the warp's S rows, as 16-byte fp16 stores"]


def wmma_item_box(item):
    """(x, y, w, h) of an item: its column along x, its lane along y."""
    column, lane, dy, height, _ = item
    return column * PITCH, LANES[lane][0] + dy, BOX_W, height


def anchor(box_xywh, fraction):
    """The point at fractions (fx, fy) of a box (x, y, w, h)."""
    x, y, w, h = box_xywh
    return x + fraction[0] * w, y + fraction[1] * h


def wmma_lanes(ax, z, headdim, right):
    """The three horizontal lanes: device memory, shared memory, registers."""
    for key, (y, height, name, color) in LANES.items():
        rect(ax, -2.8, y, right + 2.8, height, color, edge="none", alpha=0.4)
        ax.text(-2.7, y + 0.15, name, ha="left", va="top", size=10, weight="bold")
    ax.text(-2.7, 2.3, f"one block:\n{z['TOTAL']:,} B\nat D = {headdim}", ha="left", va="top", size=8.5)
    ax.text(-2.7, 4.9, f"one warp:\n{z['FRAG']} query rows", ha="left", va="top", size=8.5)


def wmma_roundtrip_06(ctx):
    """Figure 6: 06's per-tile data flow through shared memory and registers (06's Smem<> sizes)."""
    headdim, _ = headline_shape()
    z = wmma_sizes(headdim)
    items = wmma_items(z, headdim)
    boxes = {name: wmma_item_box(item) for name, item in items.items()}
    right = 10 * PITCH
    fig, ax = plt.subplots(figsize=(12, 7.4))
    blank_axes(ax, (-2.9, right + 0.1), (-0.1, 10.5))
    ax.set_aspect("auto")
    wmma_lanes(ax, z, headdim, right)
    for name, (x, y, w, h) in boxes.items():
        box(ax, x, y, w, h, items[name][4], LANES[items[name][1]][3], size=8.5)
    for src, dst, label, leaves, arrives in WMMA_ARROWS:
        start, end = anchor(boxes[src], leaves), anchor(boxes[dst], arrives)
        same_lane = abs(start[1] - end[1]) < 1e-9
        arrow(ax, start, end, text=label, size=8.5, lw=1.0, offset=(0, -0.3) if same_lane else (0, 0))
    rescale, total = boxes["rescale"], boxes["o_acc"]
    ax.annotate("", xy=(total[0] + 0.3, total[1] + total[3]), xytext=(rescale[0] + 0.8, rescale[1] + rescale[3]),
                arrowprops=dict(arrowstyle="-|>", color="#404040", lw=1.0, connectionstyle="arc3,rad=0.35"))
    ax.text(-2.8, 7.0, "\n".join(WMMA_STEPS), ha="left", va="top", size=9, linespacing=1.55)
    ax.text(right, 7.0, f"{z['WARPS']} warps per block; warp w owns\nquery rows {z['FRAG']}w .. {z['FRAG']}w + "
            f"{z['FRAG'] - 1}.\n{z['BLOCKS_PER_SM']} blocks per SM: {z['BLOCKS_PER_SM']} × {z['TOTAL']:,} B\n"
            f"of the {HARDWARE['smem_per_sm_kib']} KiB of shared memory.\nSteps 1-9 repeat for every key tile.",
            ha="right", va="top", size=9)
    ax.set_title(f"06_tensorcore_wmma, one key tile: S and P make a round trip through shared memory "
                 f"(D = {headdim})", size=11.5)
    return fig


# --- 7. mma.sync m16n8k16 fragments -------------------------------------------------------------

def a_fragment(lane):
    """(row, first column) of each of the four b32 registers (two halves each) of the A operand of one lane."""
    group, tid = lane // 4, lane % 4
    return [(group, 2 * tid), (group + 8, 2 * tid), (group, 2 * tid + 8), (group + 8, 2 * tid + 8)]


def b_fragment(lane):
    """(first k row, column) of the two b32 registers (b0b1, b2b3) of the B operand of one lane."""
    group, tid = lane // 4, lane % 4
    return [(2 * tid, group), (2 * tid + 8, group)]


def c_fragment(lane):
    """(row, first column) of the two float pairs (c0c1, c2c3) of the accumulator of one lane."""
    group, tid = lane // 4, lane % 4
    return [(group, 2 * tid), (group + 8, 2 * tid)]


def draw_pairs(ax, x0, y0, cells, cell_w, cell_h, horizontal=True, colors=QUAD, highlight=None):
    """One labelled box per register pair: cells = [(row, col, lane, reg)] in element units."""
    w, h = (2 * cell_w, cell_h) if horizontal else (cell_w, 2 * cell_h)
    by_color = {}
    for row, col, lane, reg in cells:
        x, y = x0 + col * cell_w, y0 + row * cell_h
        by_color.setdefault(colors[reg], []).append((x, y, w, h))
        ax.text(x + w / 2, y + h / 2, f"{lane}", ha="center", va="center", size=7.5)
        if lane == highlight:
            rect(ax, x, y, w, h, "none", edge="#000000", lw=1.6, zorder=3)
    for color in sorted(by_color):
        rect_group(ax, by_color[color], color)
    xs = sorted({round(b[0], 6) for boxes in by_color.values() for b in boxes})
    ys = sorted({round(b[1], 6) for boxes in by_color.values() for b in boxes})
    right, bottom = xs[-1] + w, ys[-1] + h
    line_group(ax, [((x, ys[0]), (x, bottom)) for x in xs[1:]] + [((xs[0], y), (right, y)) for y in ys[1:]],
               color="white", lw=0.8)


def matrix_frame(ax, x0, y0, rows, cols, cell_w, cell_h, title, row_label, col_label):
    """A matrix's outline, title, a few row and column numbers, and axis names."""
    rect(ax, x0, y0, cols * cell_w, rows * cell_h, "none", edge="#202020", lw=1.0)
    ax.text(x0 + cols * cell_w / 2, y0 - 0.55, title, ha="center", va="bottom", size=9.5, weight="bold")
    for r in (0, rows // 2, rows - 1):
        ax.text(x0 - 0.12, y0 + (r + 0.5) * cell_h, f"{r}", ha="right", va="center", size=7)
    for c in (0, cols // 2, cols - 1):
        ax.text(x0 + (c + 0.5) * cell_w, y0 - 0.08, f"{c}", ha="center", va="bottom", size=7)
    ax.text(x0 - 0.55, y0 + rows * cell_h / 2, row_label, rotation=90, ha="center", va="center", size=8.5)
    ax.text(x0 + cols * cell_w / 2, y0 + rows * cell_h + 0.12, col_label, ha="center", va="top", size=8.5)


def a_cells():
    """(row, column, lane, register) of every pair of the A operand."""
    return [(row, col, lane, reg) for lane in range(32) for reg, (row, col) in enumerate(a_fragment(lane))]


def c_cells():
    """(row, column, lane, register pair) of every pair of the accumulator."""
    return [(row, col, lane, reg) for lane in range(32)
            for reg, (row, col) in enumerate(c_fragment(lane))]


def draw_operands(ax, highlight):
    """A (16x16), B (16x8) and C (16x8) with the lane that holds every element pair."""
    cw, ch = 0.62, 0.36
    draw_pairs(ax, 0, 0, a_cells(), cw, ch, highlight=highlight)
    matrix_frame(ax, 0, 0, 16, 16, cw, ch, "A: 16 × 16 fp16, row-major (a0..a7)", "row (query)", "column (k)")
    b_cells = [(row, col, lane, reg) for lane in range(32) for reg, (row, col) in enumerate(b_fragment(lane))]
    draw_pairs(ax, 11.8, 0, b_cells, cw, ch, horizontal=False, colors=[QUAD[0], QUAD[1]], highlight=highlight)
    matrix_frame(ax, 11.8, 0, 16, 8, cw, ch, "B: 16 × 8 fp16, column-major (b0..b3)", "row (k)", "column (n)")
    draw_pairs(ax, 18.6, 0, c_cells(), cw, ch, colors=[QUAD[0], QUAD[1]], highlight=highlight)
    matrix_frame(ax, 18.6, 0, 16, 8, cw, ch, "C: 16 × 8 fp32 (c0..c3)", "row", "column (n)")


def register_legend(ax, x, y, entries):
    """Colour swatches in a row, each with its text."""
    for color, text, width in entries:
        rect(ax, x, y, 0.4, 0.32, color, edge="none")
        ax.text(x + 0.55, y + 0.16, text, va="center", size=8.5)
        x += width


def draw_ldmatrix(ax, x0, y0):
    """32 lanes in 4 address groups; each group's 8 row addresses = one 8x8 matrix of A."""
    cw = 0.7
    for lane in range(32):
        row, chunk = ldmatrix_q_address(lane)
        matrix = lane // 8
        rect(ax, x0 + lane * cw, y0, cw, 0.5, QUAD[matrix], edge="white", lw=0.5)
        ax.text(x0 + (lane + 0.5) * cw, y0 + 0.25, f"{lane}", ha="center", va="center", size=7.5)
        if lane % 8 == 0:
            ax.text(x0 + (lane + 4) * cw, y0 + 0.65, f"lanes {lane}-{lane + 7}: matrix {matrix}\nrows {row}-{row + 7}, "
                    f"columns {8 * chunk}-{8 * chunk + 7}\n-> register {matrix}", ha="center", va="top", size=8.5)
    ax.text(x0, y0 - 0.2, "ldmatrix.x4 in 07's load_q_step: lane l gives the address of one 16-byte row; "
            "lanes 8i..8i+7 make matrix i, which lands in register i (the colours of A above)",
            va="bottom", size=9, weight="bold")


def draw_repack(ax, x0, y0, highlight):
    """Two n8 score accumulators (fp32) -> one k16 A fragment of P (fp16): the same lanes."""
    lines, mapping = p_repack_lines()
    cw, ch = 0.42, 0.3
    for tile in (0, 1):
        draw_pairs(ax, x0 + tile * 4.3, y0, c_cells(), cw, ch, colors=[QUAD[2 * tile], QUAD[2 * tile + 1]],
                   highlight=highlight)
        matrix_frame(ax, x0 + tile * 4.3, y0, 16, 8, cw, ch, f"score[mt][{'2kk+1' if tile else '2kk'}]",
                     "", "keys")
    colors = [None] * 4
    for reg, (tile, elements) in mapping.items():
        colors[reg] = QUAD[2 * tile + elements[0] // 2]
    draw_pairs(ax, x0 + 10.4, y0, a_cells(), cw, ch, colors=colors, highlight=highlight)
    matrix_frame(ax, x0 + 10.4, y0, 16, 16, cw, ch, "p_frag[mt][kk]: the A operand of O += P V", "",
                 "keys (one k16 step)")
    arrow(ax, (x0 + 8.0, y0 + 2.4), (x0 + 10.0, y0 + 2.4), text="pack_half2", size=8.5, offset=(0, -0.45))
    ax.text(x0 + 17.9, y0 + 0.3, "Every value stays in the lane that\ncomputed it: no shuffle, no shared\n"
            "memory. The lane numbers in the\nthree pictures are the same; fp32\npairs become fp16 pairs.",
            ha="left", va="top", size=9)
    ax.text(x0, y0 + 5.6, "\n".join(lines), ha="left", va="top", size=8.5, family="monospace")


def mma_fragments(ctx):
    """Figure 7: m16n8k16 fragment layouts, ldmatrix address groups, 07's C-to-A repacking of P."""
    highlight = 5
    fig, ax = plt.subplots(figsize=(11.5, 9.6))
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.95)
    blank_axes(ax, (-1.2, 23.8), (-1.3, 19.6))
    draw_operands(ax, highlight)
    register_legend(ax, 0, 6.75, [(QUAD[0], "a0,a1   b0,b1   c0,c1", 4.6), (QUAD[1], "a2,a3   b2,b3   c2,c3", 4.6),
                                  (QUAD[2], "a4,a5", 2.2), (QUAD[3], "a6,a7", 2.2)])
    ax.text(0, 7.35, f"Each box: two elements held by one lane (its number). groupID = lane / 4, threadID_in_group = "
            f"lane % 4; outlined: lane {highlight} (groupID {highlight // 4}, thread {highlight % 4}).",
            va="top", size=9)
    draw_ldmatrix(ax, 0, 9.3)
    ax.text(0, 11.75, "S = Q K^T leaves mma.sync as fp32 C fragments, two n8 tiles per 16 keys; 07 packs them into "
            "the fp16 A fragment of P V in registers:", va="bottom", size=9, weight="bold")
    draw_repack(ax, 0, 13.1, highlight)
    ax.set_title("mma.sync.m16n8k16 (fp16 in, fp32 accumulate): which lane holds which elements "
                 "(PTX ISA fragment layouts)", size=11.5)
    return fig


# --- 8. 07's cp.async ring ----------------------------------------------------------------------

COPY_LATENCY = 1.5  # schematic: a tile's copy takes 1.5x its compute time (for the drawing only)


def ring_schedule(stages, tiles, latency=COPY_LATENCY):
    """Start/end of every tile's copy and compute under 07's loop: the prologue issues tiles 0..STAGES-2;
    iteration j waits for tile j, issues tile j+STAGES-1 into the slot tile j-1 used, computes tile j."""
    arrive = {t: latency for t in range(min(stages - 1, tiles))}
    issued = {t: 0.0 for t in arrive}
    compute, end = {}, 0.0
    for j in range(tiles):
        start = max(end, arrive[j])
        nxt = j + stages - 1
        if nxt < tiles:
            issued[nxt], arrive[nxt] = start, start + latency
        compute[j] = (start, start + 1.0)
        end = start + 1.0
    return issued, arrive, compute


def ring_panel(ax, stages, tiles, title):
    """One ring as lanes over time: the warps' compute, then one lane per slot (copy in flight, tile in use)."""
    issued, arrive, compute = ring_schedule(stages, tiles)
    for t in range(tiles):
        slot = t % stages
        y = 1 + slot
        rect(ax, issued[t], y + 0.1, arrive[t] - issued[t], 0.8, COLORS["k"], edge="white", lw=1, hatch="///")
        what = f"cp.async\nQ + tile {t}" if t == 0 else f"cp.async\ntile {t}"
        ax.text((issued[t] + arrive[t]) / 2, y + 0.5, what, ha="center", va="center", size=7.5,
                bbox=dict(facecolor=COLORS["k"], edgecolor="none", pad=0.5))
        start, stop = compute[t]
        rect(ax, start, y + 0.1, stop - start, 0.8, COLORS["q"], edge="white", lw=1)
        ax.text((start + stop) / 2, y + 0.5, f"use {t}", ha="center", va="center", size=7.5)
        rect(ax, start, 0.1, stop - start, 0.8, "#3182bd", edge="white", lw=1)
        ax.text((start + stop) / 2, 0.5, f"tile {t}", ha="center", va="center", size=8, color="white")
    for t in range(1, tiles):
        gap = compute[t][0] - compute[t - 1][1]
        if gap > 1e-9:
            rect(ax, compute[t - 1][1], 0.1, gap, 0.8, "#fcbba1", edge="white", lw=1)
            ax.text(compute[t - 1][1] + gap / 2, 0.5, "wait", ha="center", va="center", size=7.5)
    first_wait = compute[0][0]
    rect(ax, 0, 0.1, first_wait, 0.8, "#fcbba1", edge="white", lw=1)
    ax.text(first_wait / 2, 0.5, "wait", ha="center", va="center", size=8)
    ax.text(-0.15, 0.5, "warps compute", ha="right", va="center", size=9)
    for s in range(stages):
        ax.text(-0.15, 1.5 + s, f"ring slot {s}", ha="right", va="center", size=9)
    ax.set_title(title, size=10, loc="left")
    return compute[tiles - 1][1]


def ring_smem(c, headdim, stages):
    """Shared memory of one 07 block at HEAD_DIM = headdim with `stages` (K, V) pairs."""
    env = {"HEAD_DIM": headdim}
    q_halves, kv_halves = const(c, "Q_HALVES", **env), const(c, "KV_HALVES", **env)
    return (q_halves + 2 * stages * kv_halves) * 2


def cp_async_ring(ctx):
    """Figure 8: 07's cp.async ring over time for each head dim (07's STAGES_D*, Config<> sizes)."""
    c = chapter_constants("07_async_pipeline")
    tiles = 6
    panels = [(d, const(c, "STAGES", HEAD_DIM=d)) for d in (128, 64)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 6.8), gridspec_kw={"height_ratios": [s + 1 for _, s in
                                                                                                  panels]})
    horizon = max(ring_schedule(s, tiles)[2][tiles - 1][1] for _, s in panels) + 0.3
    for ax, (d, stages) in zip(axes, panels):
        smem, blocks = ring_smem(c, d, stages), launch_bound_blocks("07_async_pipeline")
        more = ring_smem(c, d, stages + 1)
        fit = HARDWARE["smem_per_sm_kib"] * 1024 // more
        title = (f"D = {d}: STAGES = {stages} (STAGES_D{d}); one block: {smem // 1024} KiB of shared memory, "
                 f"{blocks} blocks = {blocks * smem // 1024} of the SM's {HARDWARE['smem_per_sm_kib']} KiB; "
                 f"{stages + 1} stages would take {more // 1024} KiB: {fit} block{'s' if fit > 1 else ''} per SM")
        done = ring_panel(ax, stages, tiles, title)
        ax.set_xlim(-2.6, horizon)
        ax.set_ylim(stages + 1.05, -0.05)
        ax.set_yticks([])
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        ax.set_xlabel(f"time, in tile computes (schematic: a copy takes {COPY_LATENCY}x a compute); "
                      f"{tiles} tiles done at {done:g}", size=9)
        ax.set_xticks(range(0, int(horizon) + 1))
    fig.suptitle("07_async_pipeline: the cp.async ring. Iteration j waits for tile j (__pipeline_wait_prior"
                 "(STAGES - 2)),\nissues the copy of tile j + STAGES - 1 into the slot tile j - 1 freed, then computes "
                 "tile j", size=11)
    fig.tight_layout()
    return fig


# --- 9. Shared-memory bank maps -------------------------------------------------------------------

def chunk_banks(stride_halves, rows=8):
    """Banks of the first 16-byte chunk of each of `rows` consecutive rows of `stride_halves` halves."""
    hw = HARDWARE
    words = 16 // hw["bank_bytes"]
    return [[(r * stride_halves * 2 // hw["bank_bytes"] + w) % hw["banks"] for w in range(words)]
            for r in range(rows)]


def conflict_degree(stride_halves, rows=8):
    """Wavefronts a 16-byte access of those rows' first chunks needs: the most distinct words in one bank."""
    per_bank = {}
    for r, banks in enumerate(chunk_banks(stride_halves, rows)):
        for w, bank in enumerate(banks):
            per_bank.setdefault(bank, set()).add((r, w))
    return max(len(v) for v in per_bank.values())


def bank_panel(ax, stride_halves, title):
    """8 rows x 32 banks: the banks chunk 0 of each row covers, and how many rows meet in each bank."""
    banks = HARDWARE["banks"]
    hits = np.zeros((8, banks), dtype=int)
    for r, row_banks in enumerate(chunk_banks(stride_halves)):
        for b in row_banks:
            hits[r, b] = 1
    load = hits.sum(axis=0)
    for r in range(8):
        for b in range(banks):
            if hits[r, b]:
                rect(ax, b, r, 1, 1, plt.cm.tab10(r % 10), edge="white", lw=0.8)
        ax.text(-0.3, r + 0.5, f"row {r}", ha="right", va="center", size=8.5)
    rect(ax, 0, 0, banks, 8, "none", edge="#404040", lw=0.8)
    grid_lines(ax, 0, 0, banks, 8, banks, 8, color="#d0d0d0", lw=0.4)
    for b in range(banks):
        color = "#a50f15" if load[b] > 1 else "#404040"
        ax.text(b + 0.5, 8.55, f"{load[b]}" if load[b] else "", ha="center", va="center", size=8, color=color)
        if b % 4 == 0:
            ax.text(b + 0.5, -0.3, f"{b}", ha="center", va="bottom", size=7.5)
    ax.text(banks + 0.3, 8.55, "rows per bank", va="center", size=8)
    ax.text(banks + 0.3, -0.3, "bank", va="bottom", size=8)
    ax.set_title(title, size=10, loc="left")


def bank_maps(ctx):
    """Figure 9: shared-memory banks of 8 rows' first chunks for 3 paddings (06's and 07's PAD)."""
    c6, c7 = chapter_constants("06_tensorcore_wmma"), chapter_constants("07_async_pipeline")
    pad6, pad7 = const(c6, "PAD"), const(c7, "PAD")
    row_halves = 64
    pads = [0, pad7 // 2, pad7]
    fig, axes = plt.subplots(len(pads), 1, figsize=(11, 9.6))
    for ax, pad in zip(axes, pads):
        stride = row_halves + pad
        degree = conflict_degree(stride)
        who = f" (PAD in 06 and 07: {pad6}, {pad7})" if pad == pad7 else " (for comparison)" if pad else ""
        verdict = "conflict-free" if degree == 1 else f"{degree}-way conflict: {degree} wavefronts instead of 1"
        bank_panel(ax, stride, f"rows of {row_halves} + {pad} halves = {stride * 2} bytes{who}: "
                               f"first 16-byte chunks of 8 rows -> {verdict}")
        blank_axes(ax, (-2.6, HARDWARE["banks"] + 4.5), (-0.9, 9.0))
    d128 = [conflict_degree(128 + p) for p in pads]
    fig.suptitle(f"Shared memory has {HARDWARE['banks']} banks of {HARDWARE['bank_bytes']} bytes. ldmatrix (and a "
                 f"16-byte load by 8 lanes) reads one 16-byte chunk from each of 8 rows in one go.\n"
                 f"Which banks chunk 0 of rows 0-7 lands in; same degrees for 128-half rows (D = 128): "
                 f"{', '.join(f'PAD {p}: {d}' for p, d in zip(pads, d128))}", size=10.5)
    fig.tight_layout()
    return fig


# --- 10. The staircase ----------------------------------------------------------------------------

ANCHOR_LABELS = {"torch_flash": "FlashAttention-2 (PyTorch SDPA flash)", "torch_cudnn": "cuDNN (PyTorch SDPA)",
                 "torch_efficient": "memory-efficient (PyTorch SDPA)", "torch_eager": "PyTorch eager",
                 "cudnn_fp8": "cuDNN FP8 (kernel alone, e4m3 in/out)"}
PRECISION_COLORS = {"fp32 CUDA cores": "#9ecae1", "fp16 tensor cores": "#fd8d3c", "fp8 tensor cores": "#756bb1"}
ANCHOR_COLORS = {"fp8": "#54278f"}  # an anchor's line and label by its dtype; others grey


def chapter_tick(chapter):
    """01_naive -> '01\\nnaive'; long names broken at their underscores."""
    number, name = chapter.split("_", 1)
    return number + "\n" + (name.replace("_", "\n") if len(name) > 10 else name)


def spread(positions, gap, top):
    """Positions (ascending) moved as little as possible (least squares) so that neighbours are at least
    `gap` apart, then shifted down as a whole if the highest passes `top`: labels that do not overlap."""
    shifted = [p - i * gap for i, p in enumerate(positions)]  # gaps >= `gap` <=> these non-decreasing
    blocks = []  # pool adjacent violators: [mean, count]
    for value in shifted:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            blocks[-1] = [(blocks[-1][0] * blocks[-1][1] + mean * count) / (blocks[-1][1] + count),
                          blocks[-1][1] + count]
    fitted = [mean for mean, count in blocks for _ in range(count)]
    placed = [v + i * gap for i, v in enumerate(fitted)]
    excess = max(0.0, placed[-1] - top) if placed else 0.0
    return [p - excess for p in placed]


def anchor_label_positions(ax, ys, lines_per_label, size):
    """Data y of each anchor's label: the anchors' own y, spread in display space so that no two
    labels (of `lines_per_label` lines of `size` points) overlap."""
    order = sorted(range(len(ys)), key=lambda i: ys[i])
    to_px, from_px = ax.transData.transform, ax.transData.inverted().transform
    px = [to_px((0, ys[i]))[1] for i in order]
    gap = lines_per_label * size * 1.3 * ax.figure.dpi / 72
    top = ax.transAxes.transform((0, 1))[1] - gap / 2
    placed = spread(px, gap, top)
    out = [0.0] * len(ys)
    for i, p in zip(order, placed):
        out[i] = from_px((0, p))[1]
    return out


def measured_together(env, chapters):
    """The chapters timed in the same run as the anchors: those outside the .env's rows_AA_to_BB note."""
    for key in env:
        match = re.match(r"rows_(\d\d)_to_(\d\d)$", key)
        if match:
            lo, hi = int(match.group(1)), int(match.group(2))
            same = sorted({ch[:2] for ch in chapters if not lo <= int(ch[:2]) <= hi})
            return f"{same[0]}-{same[-1]}" if len(same) > 1 else (same[0] if same else "")
    return f"{chapters[0][:2]}-{chapters[-1][:2]}"


def staircase_bars(rows):
    """The bars, in order: (impl, tick label, precision). Each chapter NN_name in turn, except that where the
    CSV has rows of its steps (NN.1, NN.2, ...: the builds of its step files, step_table) those come first
    and the chapter's own row closes them as its last step (08_fp8 is 08.6). Steps with no row are left out."""
    bars, table = [], step_table()
    for chapter in sorted(impl for impl in rows if is_chapter(impl)):
        steps = sorted((impl for impl in rows if is_step(impl) and impl[:2] == chapter[:2]),
                       key=lambda impl: int(impl.split(".")[1]))
        for step in steps:
            dtype = rows[step]["dtype"]
            bars.append((step, f"{step}\n{dtype}", {"fp8": "fp8 tensor cores"}.get(dtype, "fp16 tensor cores")))
        if steps:
            last = table[chapter][0] if chapter in table else f"{chapter[:2]}.{int(steps[-1].split('.')[1]) + 1}"
            bars.append((chapter, f"{last}\n{rows[chapter]['dtype']}\n({chapter})", precision_of(chapter)))
        else:
            bars.append((chapter, chapter_tick(chapter), precision_of(chapter)))
    return bars


def staircase(ctx):
    """Figure 10: TFLOP/s per chapter (and per step of 08, where the CSV has them) at the headline shape, with
    the anchors as lines (the CSV)."""
    rows = headline_rows(ctx["rows"])
    bars = staircase_bars(rows)
    impls = [impl for impl, _, _ in bars]
    anchors = sorted((impl for impl in rows if not is_chapter(impl) and not is_step(impl)),
                     key=lambda i: -rows[i]["tflops"])
    headdim, seqlen = headline_shape()
    sample = rows[impls[0]]
    fig, ax = plt.subplots(figsize=(11 + 0.45 * max(0, len(bars) - 8), 6.2))
    kinds = [kind for _, _, kind in bars]
    values = [rows[impl]["tflops"] for impl in impls]
    ax.bar(range(len(bars)), values, color=[PRECISION_COLORS.get(k, "#bdbdbd") for k in kinds],
           edgecolor="#404040", linewidth=0.6, width=0.7, zorder=2)
    for i, impl in enumerate(impls):
        ax.text(i, values[i] * 1.07, f"{values[i]:.1f}\n{rows[impl]['ms']:.3g} ms", ha="center", va="bottom",
                size=8.5, zorder=3, bbox=dict(facecolor="white", edgecolor="none", pad=0.6, alpha=0.85))
    ax.set_yscale("log")
    ax.set_xlim(-0.6, len(bars) + 1.9)
    ax.set_ylim(min(values) / 1.6, max(values + [rows[a]["tflops"] for a in anchors]) * 2.4)
    # Lines end right of the last bar; each label sits right of its line's end, nudged apart from its
    # neighbours (in their order) with a short leader where it had to move.
    line_end, text_x, size = len(bars) - 0.45, len(bars) - 0.2, 8.5
    ys = [rows[impl]["tflops"] for impl in anchors]
    label_ys = anchor_label_positions(ax, ys, 2, size)
    styles = ["-", "--", "-.", ":"]
    for k, impl in enumerate(anchors):
        y, color = ys[k], ANCHOR_COLORS.get(rows[impl]["dtype"], "#505050")
        ax.plot([-0.6, line_end], [y, y], color=color, lw=1.0, ls=styles[k % len(styles)], zorder=1)
        ax.plot([line_end, text_x - 0.05], [y, label_ys[k]], color=color, lw=0.6, zorder=1)
        label = f"{ANCHOR_LABELS.get(impl, impl)}\n{y:.1f} TFLOP/s, {rows[impl]['ms']:.3g} ms"
        ax.text(text_x, label_ys[k], label, ha="left", va="center", size=size, color=color, linespacing=1.15)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([tick for _, tick, _ in bars], size=9)
    stepped = [i for i, impl in enumerate(impls) if is_step(impl)]
    if stepped:  # a bracket under the steps of one chapter and its finished row
        first, last = stepped[0], impls.index(next(ch for ch in impls if is_chapter(ch) and
                                                   ch[:2] == impls[stepped[0]][:2]))
        chapter = impls[last]
        ax.annotate("", xy=(last + 0.35, -0.155), xytext=(first - 0.35, -0.155), xycoords=("data", "axes fraction"),
                    arrowprops=dict(arrowstyle="-", color="#606060", lw=0.8), annotation_clip=False)
        ax.text((first + last) / 2, -0.17, f"{chapter}'s steps (dtype: of the operands)",
                ha="center", va="top", size=8.5, color="#404040", transform=ax.get_xaxis_transform())
    ax.set_ylabel("TFLOP/s (log scale; 4·B·H·N²·D FLOPs)")
    ax.legend(handles=[Patch(facecolor=PRECISION_COLORS[k], edgecolor="#404040", linewidth=0.6, label=k)
                       for k in PRECISION_COLORS if k in kinds], loc="lower right", fontsize=9, frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    together = f"anchors timed in the same bench run as {measured_together(ctx['env'], impls)}"
    fp8 = [step_table().get(impl, (impl,))[0] if stepped else impl for impl in impls if rows[impl]["dtype"] == "fp8"]
    fp8_bars = (f"{fp8[0]}'s bar includes" if len(fp8) == 1 else
                f"the bars of {', '.join(fp8)} include") + " the quantisation"
    if any(rows[impl]["dtype"] == "fp8" for impl in anchors):
        lines = ("lines: PyTorch SDPA's backends on the same fp16 inputs, and cuDNN's FP8 attention alone on inputs "
                 f"already in e4m3\n({fp8_bars}); {together}")
    else:
        lines = f"lines: PyTorch SDPA's backends on the same fp16 inputs; {together}"
    what = "per chapter and per step of 08" if stepped else "per chapter"
    ax.set_title(f"{ctx['env'].get('gpu', HARDWARE['gpu'])}, B={sample['batch']} H={sample['heads']} N={seqlen} "
                 f"D={headdim}, non-causal, fp16 in and out: TFLOP/s and median time {what} (bars)\n"
                 f"{lines} (docs/results/NVIDIA_H200.csv)", size=10.5)
    return fig


# --- 11. 08's warp-specialised ping-pong ------------------------------------------------------------

LOGS = os.path.join(ROOT, "docs", "results", "logs")
# 08's attention kernel under Nsight Compute at the headline shape: the report, and its pipe metrics.
NCU_08, NCU_08_PIPES = "ncu_08_split_exp2.txt", "ncu_08_split_exp2_pipes.txt"
# The schematic's durations, in units of one warpgroup's two products of one key tile (QK^T + P V = 1):
# the softmax block (mask, max, exp2, sums) plus the O rescale and the packing of P, also 1 in all,
# since at the H200's peak rates the two take the same time at D = 128 (pingpong_rates); the copy
# latency and the issue time are for the drawing only.
PP = {"qk": 0.5, "pv": 0.5, "softmax": 0.7, "pack": 0.3, "issue": 0.12, "copy": 1.0, "q_copy": 1.0,
      "tma_issue": 0.1, "epilogue": 0.5}


def pingpong_source():
    """08's constants at D = 128, after checking that its kernel still has the order the figure draws."""
    text, c = source_text("08_fp8"), chapter_constants("08_fp8")
    if const(c, "SOFTMAX_UNDER_PV", HEAD_DIM=128):
        raise LookupError("08's SOFTMAX_UNDER_PV is true at D = 128: the ping-pong figure draws the other order")
    # The checks name what the code does, not what its variables are called (\w+, [^;]*).
    checks = [
        (r"void produce\(.*?mbarrier_wait\(&\w+\.kv_empty\[tile % STAGES\].*?load_kv_tile<HEAD_DIM>\([^;]*tile\)",
         "produce: wait for an empty stage, then load the tile"),
        (r"void scores_and_softmax\(.*?mbarrier_wait\(&\w+\.kv_full.*?wait_turn\(\w+\.group\);.*?issue_qk<HEAD_DIM>.*?"
         r"if \(PV_IN_FLIGHT\) issue_pv<HEAD_DIM>.*?pass_turn\(\w+\.group, \w+::CONSUMERS\);.*?wgmma_wait<1>\(\).*?"
         r"softmax_tile",
         "scores_and_softmax: wait full, wait turn, issue QK^T and P V, pass turn, wait for S, softmax"),
        (r"void finish_pv\(.*?wgmma_wait<0>\(\);.*?release_stage<HEAD_DIM>", "finish_pv: wait for P V, release"),
        (r"if \(group == \w+::CONSUMERS - 1\) pass_turn\(group, \w+::CONSUMERS\);", "consume: warpgroup 0 goes first"),
        (r"void previous_p_ready\(.*?wgmma_wait<0>\(\);.*?release_stage<HEAD_DIM>.*?rescale_output<HEAD_DIM>.*?pack_p\(",
         "previous_p_ready: wait for P V, release, rescale, pack"),
        (r"scores_and_softmax<HEAD_DIM, true, MASK>\([^;]*tile\);\s*"
         r"if \(!UNDER_PV\) previous_p_ready<HEAD_DIM>\([^;]*tile \+ 1\);",
         "overlapped_tile: softmax of j, then P V of j-1 waited for, rescale, pack"),
        (r"finish_pv<HEAD_DIM>\([^;]*w\.kv_tiles - 1[^;]*\);", "consume: the last P V after the loop"),
    ]
    for pattern, what in checks:
        find(pattern, text, f"08's {what}", re.S)
    d = 128
    out = {n.lower(): const(c, n, HEAD_DIM=d) for n in ("STAGES", "SMEM_BYTES")}
    out.update({n.lower(): const(c, n, HEAD_DIM=d) for n in ("BLOCK_Q", "BLOCK_KV", "CONSUMERS", "WARPGROUP_ROWS",
                                                               "PRODUCER_REGISTERS", "CONSUMER_REGISTERS")})
    out["head_dim"] = d
    return out


def log_path(name, chapter="08"):
    """A measurement log: docs/results/logs/<chapter>/<name>, else docs/results/logs/<name>."""
    for path in (os.path.join(LOGS, chapter, name), os.path.join(LOGS, name)):
        if os.path.exists(path):
            return path
    raise LookupError(f"docs/results/logs/{chapter}/{name} (or docs/results/logs/{name}) not found: a figure "
                      f"quotes it")


def ncu_attention_08():
    """Tensor pipe active % and XU pipe (MUFU.EX2) issue %, of 08's attention kernel at D = 128 under Nsight
    Compute: the metrics from the report's own section where it has them, else from the pipe-metrics table
    beside it (a column per build, the chapter's first); the SM clock it ran at, from the report."""
    report = log_path(NCU_08)
    with open(report) as f:
        text = f.read()
    section = text[find(r"void attention_kernel<128>", text, f"08's attention kernel in {NCU_08}").start():]
    out = {"report": os.path.relpath(report, ROOT),
           "ghz": float(find(r"SM Frequency\s+Ghz\s+([\d.]+)", section, f"the SM frequency in {NCU_08}").group(1))}
    names = {"tensor": ("SM: Pipe Tensor Cycles Active",
                        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
             "xu": ("SM: Inst Executed Pipe Xu", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active")}
    if all(re.search(re.escape(long) + r"\s+%", section) for long, _ in names.values()):
        for key, (long, _) in names.items():
            out[key] = float(re.search(re.escape(long) + r"\s+%\s+([\d.]+)", section).group(1))
        return out
    pipes = log_path(NCU_08_PIPES)
    with open(pipes) as f:
        table = f.read()
    header = find(r"^metric\s+(\S+)", table, f"the header of {NCU_08_PIPES}", re.M)
    if header.group(1) != "08_fp8":
        raise LookupError(f"{NCU_08_PIPES}'s first column is {header.group(1)!r}, not 08_fp8: the figure script "
                          f"needs updating")
    for key, (_, metric) in names.items():
        out[key] = float(find(r"^" + re.escape(metric) + r"\s+([\d.]+)", table, f"{metric} in {NCU_08_PIPES}",
                              re.M).group(1))
    out["pipes"] = os.path.relpath(pipes, ROOT)
    return out


def exp2_split_08():
    """N when 08 computes one 8-key chunk of exponentials in N on the FMA units (SPLIT_EXP2 with its period,
    EXP2_FMA_PERIOD), else 0; 0 too where the source no longer has those switches (the note leaves it out)."""
    c = chapter_constants("08_fp8")
    try:
        return const(c, "EXP2_FMA_PERIOD") if const(c, "SPLIT_EXP2") else 0
    except (KeyError, ValueError, SyntaxError):
        return 0


def pingpong_rates(p):
    """Clocks per warpgroup and key tile at D = 128: its two products at the dense e4m3 rate, and its
    exponentials on the special-function units."""
    flop = 2 * 2 * p["warpgroup_rows"] * p["block_kv"] * p["head_dim"]
    exps = p["warpgroup_rows"] * p["block_kv"]
    return flop, flop / HARDWARE["fp8_flop_per_clock_sm"], exps, exps / HARDWARE["ex2_per_clock_sm"]


def pingpong_schedule(stages, tiles, d=PP):
    """Every interval of one block's timeline under 08's code: lane -> [(start, end, kind, text)].
    Producer: wait for stage t % STAGES to be empty (t >= STAGES), issue the TMA copy of tile t.
    Consumer g, tile j: wait for tile j to land and for its turn, issue QK^T j (and P V j-1), pass the turn,
    wait for S and, as the compiled code does at D = 128 (ptxas places the wait for P V j-1 ahead of the
    softmax), for P V j-1, releasing its stage; softmax j, rescale O, pack P; after the loop the last P V.
    The tensor cores run the issued groups in issue order."""
    lanes = {"producer": [], "tensor": [], "wg0": [], "wg1": []}
    lanes.update({f"stage{s}": [] for s in range(stages)})
    full, released, tensor_free = {}, {}, 0.0
    lanes["producer"].append((0.0, d["tma_issue"], "issue", "Q"))
    q_full = d["q_copy"]
    producer_t = d["tma_issue"]

    def load(t, start):
        lanes["producer"].append((start, start + d["tma_issue"], "issue", f"{t}"))
        full[t] = start + d["tma_issue"] + d["copy"]
        lanes[f"stage{t % stages}"].append((start, full[t], "copy", f"TMA K, V tile {t}"))
        return start + d["tma_issue"]

    def mma(g, start, kind, length, text):
        nonlocal tensor_free
        begin = max(start, tensor_free)
        tensor_free = begin + length
        lanes["tensor"].append((begin, tensor_free, f"{kind}{g}", text))
        return tensor_free

    for t in range(min(stages, tiles)):
        producer_t = load(t, producer_t)
    now = {0: q_full, 1: q_full}
    turn = {0: 0.0}  # when warpgroup g may issue its next products: the other's last pass_turn
    next_load = stages
    done_pv = {}
    for j in range(tiles):
        for g in (0, 1):
            # The producer refills each stage once both consumers have released it (by now, or before tile j
            # is needed: the release of tile j - STAGES is always known by then).
            while next_load < tiles and (next_load - stages) in released and \
                    (released[next_load - stages] <= now[g] or next_load <= j):
                start = max(producer_t, released[next_load - stages])
                if start > producer_t:
                    lanes["producer"].append((producer_t, start, "wait", f"wait empty[{next_load % stages}]"))
                producer_t = load(next_load, start)
                next_load += 1
            lane = lanes[f"wg{g}"]
            ready = max(now[g], full[j])
            if ready > now[g]:
                lane.append((now[g], ready, "wait", "wait K, V"))
            go = max(ready, turn[g])
            if go > ready:
                lane.append((ready, go, "wait", "wait turn"))
            issued = go + d["issue"]
            lane.append((go, issued, "issue", ""))
            turn[1 - g] = issued  # pass_turn
            s_ready = mma(g, issued, "qk", d["qk"], f"QK^T {j}")
            if j > 0:
                done_pv[(g, j - 1)] = mma(g, issued, "pv", d["pv"], f"PV {j - 1}")
            if s_ready > issued:
                lane.append((issued, s_ready, "wait", "wait S"))
            t = s_ready
            if j > 0:
                if done_pv[(g, j - 1)] > t:
                    lane.append((t, done_pv[(g, j - 1)], "wait", "wait PV"))
                    t = done_pv[(g, j - 1)]
                released[j - 1] = max(released.get(j - 1, 0.0), t) if g == 1 else t
            lane.append((t, t + d["softmax"], "softmax", f"softmax {j}"))
            t += d["softmax"]
            lane.append((t, t + d["pack"], "pack", ""))
            now[g] = t + d["pack"]
    for g in (0, 1):  # the last tile's P V, then O and LSE out
        lane = lanes[f"wg{g}"]
        issued = now[g] + d["issue"]
        lane.append((now[g], issued, "issue", ""))
        end = mma(g, issued, "pv", d["pv"], f"PV {tiles - 1}")
        lane.append((issued, end, "wait", "wait PV"))
        lane.append((end, end + d["epilogue"], "epilogue", "O, LSE"))
        released[tiles - 1] = max(released.get(tiles - 1, 0.0), end)
    for t in range(tiles):
        lanes[f"stage{t % stages}"].append((full[t], released[t], "use", f"tile {t}"))
    return lanes


PP_COLORS = {"issue": "#252525", "wait": "#f4f4f4", "copy": COLORS["k"], "use": "#fdd0a2", "softmax0": "#9ecae1",
             "softmax1": "#fdae6b", "pack": "#a1d99b", "qk0": "#2171b5", "pv0": "#6baed6", "qk1": "#d94801",
             "pv1": "#fd8d3c", "epilogue": "#d9d9d9"}


def points_per_unit(ax):
    """Points per data unit along x: how much text fits in a box."""
    lo, hi = ax.get_xlim()
    return ax.get_window_extent().width * 72 / ax.figure.dpi / (hi - lo)


def pingpong_lane(ax, y, height, intervals, group=None, size=7):
    """One lane of the timeline: a box per interval, its text inside where it fits."""
    scale = points_per_unit(ax)
    for start, end, kind, text in intervals:
        key = f"{kind}{group}" if kind == "softmax" else kind
        color = PP_COLORS[key]
        rect(ax, start, y, end - start, height, color, edge="#bdbdbd" if kind == "wait" else "white", lw=0.8,
             hatch="///" if kind == "copy" else None)
        if text and (end - start) * scale >= 0.55 * size * len(text) + 3:
            dark = kind in ("qk0", "qk1", "issue")
            ax.text((start + end) / 2, y + height / 2, text, ha="center", va="center", size=size,
                    color="white" if dark else "#202020",
                    bbox=dict(facecolor=color, edgecolor="none", pad=0.3) if kind == "copy" else None)


def pingpong_08(ctx):
    """Figure 11: one block of 08's attention kernel over time (schematic): the producer's TMA ring, the two
    consumer warpgroups taking turns, and the tensor cores (08's constants; the order checked in its source)."""
    p = pingpong_source()
    ncu = ncu_attention_08()
    flop, mma_clocks, exps, exp_clocks = pingpong_rates(p)
    stages, tiles = p["stages"], p["stages"] + 2
    lanes = pingpong_schedule(stages, tiles)
    end = max(e for intervals in lanes.values() for _, e, _, _ in intervals)
    rows = [("producer", "producer warpgroup\n(one thread issues TMA)", None, 0.0, 0.7)]
    rows += [(f"stage{s}", f"ring stage {s}", None, 0.95 + 0.6 * s, 0.5) for s in range(stages)]
    y = 0.95 + 0.6 * stages + 0.35
    rows += [("wg0", f"consumer warpgroup 0\n(query rows 0-{p['warpgroup_rows'] - 1})", 0, y, 0.8),
             ("wg1", f"consumer warpgroup 1\n(rows {p['warpgroup_rows']}-{2 * p['warpgroup_rows'] - 1})", 1,
              y + 1.05, 0.8),
             ("tensor", "tensor cores\n(wgmma groups,\nin issue order)", None, y + 2.1, 0.8)]
    bottom = y + 2.9
    fig, ax = plt.subplots(figsize=(12.5, 6.4))
    fig.subplots_adjust(left=0.16, right=0.995)
    ax.set_xlim(0, end + 0.1)
    ax.set_ylim(bottom + 0.1, -0.1)
    for key, name, group, top, height in rows:
        pingpong_lane(ax, top, height, lanes[key], group, size=6.5 if key == "tensor" else 7)
        ax.text(-0.15, top + height / 2, name, ha="right", va="center", size=9 if height > 0.6 else 8.5)
    # The turn passing: each issue lets the other warpgroup issue next.
    issues = sorted((start, end_, g) for g in (0, 1) for start, end_, kind, _ in lanes[f"wg{g}"] if kind == "issue")
    lane_y = {0: (y, 0.8), 1: (y + 1.05, 0.8)}
    for (s0, e0, g0), (s1, _, g1) in zip(issues, issues[1:]):
        if g0 != g1 and s1 >= e0:
            y0 = lane_y[g0][0] + (lane_y[g0][1] if g0 == 0 else 0)
            y1 = lane_y[g1][0] + (0 if g1 == 1 else lane_y[g1][1])
            ax.annotate("", xy=(s1, y1), xytext=(e0, y0),
                        arrowprops=dict(arrowstyle="-|>", color="#636363", lw=0.7, shrinkA=0, shrinkB=0))
    ax.set_yticks([])
    ax.set_xticks([])
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.annotate("", xy=(end + 0.1, bottom), xytext=(0, bottom),
                arrowprops=dict(arrowstyle="-|>", color="#404040", lw=0.8))
    ax.text(end + 0.1, bottom + 0.12, "time (schematic)", ha="right", va="top", size=8.5)
    legend = [Patch(facecolor=PP_COLORS["qk0"], label="QK^T of tile j, warpgroup 0"),
              Patch(facecolor=PP_COLORS["pv0"], label="P V of tile j-1, warpgroup 0"),
              Patch(facecolor=PP_COLORS["softmax0"], label="mask, softmax of tile j, wg 0"),
              Patch(facecolor=PP_COLORS["qk1"], label="QK^T of tile j, warpgroup 1"),
              Patch(facecolor=PP_COLORS["pv1"], label="P V of tile j-1, warpgroup 1"),
              Patch(facecolor=PP_COLORS["softmax1"], label="mask, softmax of tile j, wg 1"),
              Patch(facecolor=PP_COLORS["pack"], label="rescale O, pack P to e4m3"),
              Patch(facecolor=PP_COLORS["issue"], label="issue (wgmma or TMA)"),
              Line2D([], [], color="#636363", lw=0.7, marker=">", markersize=4, label="pass_turn"),
              Patch(facecolor=PP_COLORS["copy"], hatch="///", edgecolor="white", label="TMA copy in flight"),
              Patch(facecolor=PP_COLORS["use"], label="tile held until both release it"),
              Patch(facecolor=PP_COLORS["wait"], edgecolor="#bdbdbd", label="waiting")]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(-0.16, -0.01), ncol=4, fontsize=8.5,
              frameon=False, columnspacing=1.2, handlelength=1.6)
    split = exp2_split_08()
    on_mufu = (f"\n(SPLIT_EXP2: one 8-key chunk in {split} has them on the FMA units, leaving "
               f"{exp_clocks * (split - 1) / split:.0f} on MUFU)" if split else "")
    where = ncu["report"] + (f" and {os.path.basename(ncu['pipes'])}" if "pipes" in ncu else "")
    note = (f"At D = {p['head_dim']}, per warpgroup and key tile: QK^T + P V = {flop / 1e6:.2f} MFLOP, "
            f"{mma_clocks:.0f} clocks at {HARDWARE['fp8_flop_per_clock_sm']:,} e4m3 FLOP per clock per SM; its "
            f"{exps:,} exponentials, {exp_clocks:.0f} clocks at {HARDWARE['ex2_per_clock_sm']} ex2 per clock per SM"
            f"{on_mufu}: of the same order at peak rates, so drawn equal (the copy time is for the drawing only)."
            f"\nMeasured (Nsight Compute, headline shape, SM at {ncu['ghz']:.2f} GHz, {where}): tensor pipe active "
            f"{ncu['tensor']:.1f}% of the time,\nXU pipe (MUFU.EX2) issuing at {ncu['xu']:.1f}% of its peak: the "
            f"real kernel has gaps this drawing does not. One block per SM: {p['smem_bytes']:,} bytes of shared "
            f"memory (Q and {stages} stages of K, Vt);\nregisters per thread: {p['producer_registers']} (producer), "
            f"{p['consumer_registers']} (consumers).")
    ax.text(-0.16, -0.22, note, ha="left", va="top", size=8.5, linespacing=1.45, transform=ax.transAxes)
    ax.set_title(f"08_fp8's attention kernel, one block over time (schematic, {tiles} key tiles): a producer "
                 f"warpgroup fills a ring of STAGES = {stages} (K, Vt) stages;\n{p['consumers']} consumer warpgroups "
                 f"of {p['warpgroup_rows']} query rows take turns on the tensor cores (ping-pong), each issuing "
                 f"P V of tile j-1 right behind QK^T of tile j\n(BLOCK_Q = {p['block_q']}, BLOCK_KV = "
                 f"{p['block_kv']}, D = {p['head_dim']}: one warpgroup's softmax overlaps the other's products)",
                 size=10.5)
    return fig


# --- 12. 08's wgmma fragments and V's key_slot order ------------------------------------------------

KEY_OWNERS = ["#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3"]  # threadID_in_group 0..3, in the key_slot picture


def key_slot_source():
    """08's key_slot(key) as read from its source: (the body's statements, a Python function evaluating them).
    The body is `const int` declarations, then a return, as C integer expressions."""
    text, consts = source_text("08_fp8"), chapter_constants("08_fp8")
    body = find(r"constexpr\s+int\s+key_slot\(\s*int\s+key\s*\)\s*\{([^{}]*)\}", text,
                "08's key_slot(int key)").group(1)
    statements = [" ".join(st.split()) for st in body.split(";") if st.strip()]
    if not statements or not statements[-1].startswith("return "):
        raise LookupError("08's key_slot does not end in a return: the figure script needs updating")
    decls = []
    for st in statements[:-1]:
        match = re.match(r"^(?:const\s+)?int\s+(.*)$", st)
        if not match:
            raise LookupError(f"08's key_slot has a statement the figure script cannot read: {st!r}")
        decls += [tuple(part.strip() for part in p.split("=", 1)) for p in split_top_level(match.group(1))]
    result = statements[-1][len("return "):]

    def key_slot(key):
        env = {"key": key}
        for name, value in decls:
            env[name] = const_expr(consts, value, **env)
        return const_expr(consts, result, **env)
    return [st + ";" for st in statements], key_slot


def key_slot_python(key, group=16):
    """Where key goes in Vt, written out: within each 16 keys, key 8h + 2t + e goes to 4t + 2h + e."""
    k = key % group
    return key - k + 4 * (k // 2 % 4) + 2 * (k // 8) + k % 2


def checked_key_slot(keys=256):
    """08's key_slot, checked against key_slot_python and against what the figure says it does: a permutation
    of each 16 keys that puts the accumulator's keys {2t, 2t+1, 2t+8, 2t+9} at positions 4t..4t+3."""
    lines, key_slot = key_slot_source()
    slots = [key_slot(key) for key in range(keys)]
    if slots != [key_slot_python(key) for key in range(keys)]:
        raise LookupError("08's key_slot no longer matches the figure's key_slot_python: the figure needs updating")
    for t in range(4):
        if sorted(slots[k] for k in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)) != list(range(4 * t, 4 * t + 4)):
            raise LookupError(f"08's key_slot does not put thread {t}'s keys at positions {4 * t}..{4 * t + 3}")
    return lines, slots


def wgmma_d_fragment(thread):
    """(row, first column) of the first two pairs a warpgroup thread holds of a wgmma accumulator (PTX ISA):
    warp w = thread / 32 owns rows 16w..16w+15; lane l holds rows 16w + l/4 and +8, columns 8c + 2(l%4) and +1
    of every 8-column chunk c."""
    warp, lane = thread // 32, thread % 32
    return [(16 * warp + lane // 4, 2 * (lane % 4)), (16 * warp + lane // 4 + 8, 2 * (lane % 4))]


def wgmma_a8_fragment(lane):
    """(row, first column) of the four 32-bit registers of a k32 e4m3 A operand in registers, one warp's 16 rows
    (PTX ISA): register i holds 4 consecutive columns of row l/4 + 8 (i % 2), from 16 (i / 2) + 4 (l % 4)."""
    group, tid = lane // 4, lane % 4
    return [(group + 8 * (i % 2), 16 * (i // 2) + 4 * tid) for i in range(4)]


def draw_cells(ax, x0, y0, cells, width, cw, ch, colors, highlight):
    """Boxes `width` columns wide: cells = [(row, col, lane, color index)], each labelled with its lane."""
    by_color = {}
    for row, col, lane, which in cells:
        x, y = x0 + col * cw, y0 + row * ch
        by_color.setdefault(colors[which], []).append((x, y, width * cw, ch))
        ax.text(x + width * cw / 2, y + ch / 2, f"{lane}", ha="center", va="center", size=6.5)
        if lane == highlight:
            rect(ax, x, y, width * cw, ch, "none", edge="#000000", lw=1.5, zorder=3)
    for color in sorted(by_color):
        rect_group(ax, by_color[color], color)
    boxes = [b for group in by_color.values() for b in group]
    xs = sorted({round(b[0], 6) for b in boxes})
    ys = sorted({round(b[1], 6) for b in boxes})
    right, bottom = xs[-1] + width * cw, ys[-1] + ch
    line_group(ax, [((x, ys[0]), (x, bottom)) for x in xs[1:]] + [((xs[0], y), (right, y)) for y in ys[1:]],
               color="white", lw=0.7)


def accumulator_cells(keys):
    """Warp 0's pairs of the S accumulator over `keys` columns, coloured by the A register of P V they become:
    chunks c, c+1 of each 16 keys (c even), row g + 8r -> register 2 (c % 4 / 2) + r."""
    cells = []
    for lane in range(32):
        for r, (row, col) in enumerate(wgmma_d_fragment(lane)):
            for chunk in range(keys // 8):
                cells.append((row, 8 * chunk + col, lane, 2 * (chunk % 4 // 2) + r))
    return cells


def operand_cells():
    """Warp 0's 32-bit registers of the e4m3 A operand of one k32 step, coloured by register index."""
    return [(row, col, lane, i) for lane in range(32) for i, (row, col) in enumerate(wgmma_a8_fragment(lane))]


def warpgroup_strip(ax, x0, y0, height, zoom_to):
    """The warpgroup's 64 rows as 4 warp bands, warp 0's led to the zoomed picture at zoom_to = (x, y, h)."""
    band = height / 4
    for w in range(4):
        rect(ax, x0, y0 + w * band, 0.55, band, plt.cm.Greys(0.25 + 0.15 * w), edge="white", lw=1.0)
        ax.text(x0 - 0.1, y0 + (w + 0.5) * band,
                f"warp {w}\nrows {16 * w}-{16 * w + 15}\nthreads\n{32 * w}-{32 * w + 31}", ha="right", va="center",
                size=7.5)
    rect(ax, x0, y0, 0.55, band, "none", edge="#000000", lw=1.2, zorder=3)
    zx, zy, zh = zoom_to
    for (ay, by) in ((y0, zy), (y0 + band, zy + zh)):
        ax.plot([x0 + 0.55, zx], [ay, by], color="#9e9e9e", lw=0.8, ls="--")
    ax.text(x0 + 0.27, y0 - 0.15, "M = 64", ha="center", va="bottom", size=8)


def key_slot_panel(ax, x0, y0, slots, cw):
    """One 16-key group: keys in the accumulator's order (thread t's four keys interleaved) above, their
    positions in Vt and in the A operand (thread t's four keys side by side) below, and a line for each."""
    gap = 1.9
    owner = [(k % 8) // 2 for k in range(16)]  # the threadID_in_group holding key k's column in the accumulator
    for k in range(16):
        slot = slots[k]
        rect(ax, x0 + k * cw, y0, cw, 0.5, KEY_OWNERS[owner[k]], edge="white", lw=1)
        ax.text(x0 + (k + 0.5) * cw, y0 + 0.25, f"{k}", ha="center", va="center", size=8)
        rect(ax, x0 + slot * cw, y0 + gap, cw, 0.5, KEY_OWNERS[owner[k]], edge="white", lw=1)
        ax.text(x0 + (slot + 0.5) * cw, y0 + gap + 0.25, f"{k}", ha="center", va="center", size=8)
        ax.plot([x0 + (k + 0.5) * cw, x0 + (slot + 0.5) * cw], [y0 + 0.5, y0 + gap], color="#737373", lw=0.7)
    for t in range(4):
        ax.text(x0 + (4 * t + 2) * cw, y0 + gap + 0.6, f"t = {t}: positions\n{4 * t}-{4 * t + 3}, one register",
                ha="center", va="top", size=7.5, color="#303030")
    for k in (0, 8):
        ax.text(x0 + (k + 4) * cw, y0 - 0.08, f"chunk {k // 8}: keys {k}-{k + 7}", ha="center", va="bottom", size=8)
    ax.text(x0 - 0.15, y0 + 0.25, "S accumulator:\nthe key of a column", ha="right", va="center", size=8.5)
    ax.text(x0 - 0.15, y0 + gap + 0.25, "Vt and P's A operand:\nthe key at a position", ha="right", va="center",
            size=8.5)
    ax.text(x0 + 8 * cw, y0 + gap / 2 + 0.25, "key_slot", ha="center", va="center", size=8.5, style="italic",
            bbox=dict(facecolor="white", edgecolor="none", pad=1))
    legend_x = x0 + 16 * cw + 0.6
    for t in range(4):
        rect(ax, legend_x, y0 + 0.6 * t, 0.35, 0.35, KEY_OWNERS[t], edge="none")
        ax.text(legend_x + 0.5, y0 + 0.6 * t + 0.175, f"thread t = {t} holds keys {2 * t}, {2 * t + 1}, {2 * t + 8}, "
                f"{2 * t + 9} of every 16", va="center", size=8.5)


def wgmma_fragments_08(ctx):
    """Figure 12: 08's wgmma accumulator fragments, the e4m3 A operand of P V, and key_slot (from 08's source)."""
    lines, slots = checked_key_slot()
    highlight, keys = 5, 32
    cw, ch = 0.3, 0.36
    fig, ax = plt.subplots(figsize=(13.5, 9.4))
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.93)
    blank_axes(ax, (-3.4, 22.3), (-1.3, 16.3))
    width = keys * cw
    warpgroup_strip(ax, -1.0, 0, 16 * ch, (0, 0, 16 * ch))
    draw_cells(ax, 0, 0, accumulator_cells(keys), 2, cw, ch, QUAD, highlight)
    matrix_frame(ax, 0, 0, 16, keys, cw, ch, "S = Q K^T: wgmma's accumulator, warp 0, keys 0-31", "",
                 "key (column of S)")
    a_x = width + 2.6
    draw_cells(ax, a_x, 0, operand_cells(), 4, cw, ch, QUAD, highlight)
    matrix_frame(ax, a_x, 0, 16, keys, cw, ch, "P in e4m3: the A operand of O += P V, one k32 step", "", "")
    owner = [(k % 8) // 2 for k in range(16)]
    inverse = {slot: key for key, slot in enumerate(slots)}
    for p in range(keys):
        key = inverse[p]
        rect(ax, a_x + p * cw, 16 * ch + 0.12, cw, 0.34, KEY_OWNERS[owner[key % 16]], edge="white", lw=0.6)
        ax.text(a_x + (p + 0.5) * cw, 16 * ch + 0.29, f"{key}", ha="center", va="center", size=6)
    ax.text(a_x - 0.12, 16 * ch + 0.29, "key", ha="right", va="center", size=7.5)
    ax.text(a_x + width / 2, 16 * ch + 0.55, "position k of the step; below it, the key it holds (Vt's row k)",
            ha="center", va="top", size=8.5)
    arrow(ax, (width + 0.35, 8 * ch), (a_x - 0.35, 8 * ch), text="pack_p:\nsame lane,\nno shuffle", size=8,
          offset=(0, -1.0))
    y = 16 * ch + 0.9
    for i, text in enumerate(["register 0 of a k32 step: row g, positions 4t..4t+3",
                              "register 1: row g + 8, positions 4t..4t+3",
                              "register 2: row g, positions 16 + 4t..16 + 4t + 3",
                              "register 3: row g + 8, positions 16 + 4t..16 + 4t + 3"]):
        register_legend(ax, 0, y + 0.45 * i, [(QUAD[i], text, 0)])
    ax.text(a_x, y + 0.45,
            f"Left, each box is two accumulator columns of one lane (its number): two\nfp32 registers, or one with S "
            f"in fp16 (08 at D = 128), coloured by the register\nof P V they are packed into; right, each box is one "
            f"32-bit register of a\nlane: four e4m3. g = lane / 4, t = lane % 4; outlined: lane {highlight} (g = "
            f"{highlight // 4}, t = {highlight % 4}).\nWarps 1-3 repeat warp 0 on their rows 16w..16w + 15.",
            va="top", size=8.5)
    top = y + 4.0
    ax.text(-3.3, top - 0.45, "Lane t's accumulator columns of each 16 keys are 2t, 2t+1, 2t+8, 2t+9; the A operand "
            "wants its register to hold positions 4t..4t+3.\nThe quantisation stores V transposed with key k at "
            "position key_slot(k) of its group of 16, so position p of P's register and row p of Vt\nare the same "
            "key: the sum over the keys is unchanged, and P never moves between lanes.", va="bottom", size=9.5,
            weight="bold", linespacing=1.4)
    key_slot_panel(ax, 0.4, top + 0.45, slots, 0.62)
    code = "\n".join(["__host__ __device__ constexpr int key_slot(int key) {"] + ["    " + line for line in lines]
                      + ["}"])
    ax.text(-3.3, top + 3.75, code, ha="left", va="top", size=8, family="monospace")
    ax.text(10.2, top + 3.75, f"08_fp8/attention.cu's key_slot, read from the source and\nevaluated for keys "
            f"0-{len(slots) - 1}: the same as key - k + 4·pair +\n2·half_of_16 + odd written out in the figure "
            f"script.", ha="left", va="top", size=8.5)
    ax.set_title("08_fp8: wgmma m64nNk32 in registers. The accumulator of S (one warpgroup: 4 warps of 16 rows), the "
                 "e4m3 A operand of P V,\nand the order of V's keys (key_slot) that makes the two agree (PTX ISA "
                 "fragment layouts)", size=11)
    return fig


# --- 13. The 128-byte swizzle --------------------------------------------------------------------------

SWIZZLE_CHUNK = 16  # bytes: TMA's and wgmma's swizzles permute 16-byte chunks of a row (CUDA driver API, PTX ISA)


def swizzle_constants():
    """08's SLICE_BYTES (the swizzled row) and KSTEP_BYTES (the reduced dimension per wgmma), read from its source."""
    c = chapter_constants("08_fp8")
    out = {}
    for name in ("SLICE_BYTES", "KSTEP_BYTES"):
        if name not in c:
            raise LookupError(f"08_fp8/attention.cu: #define {name} not found (the swizzle figure draws it): "
                              f"the figure script needs updating")
        out[name.lower()] = const(c, name)
    if out["slice_bytes"] != 128:
        raise LookupError(f"08's SLICE_BYTES is {out['slice_bytes']}, not 128: the 128-byte swizzle figure needs "
                          f"updating")
    if out["kstep_bytes"] % SWIZZLE_CHUNK or out["slice_bytes"] % out["kstep_bytes"]:
        raise LookupError(f"08's KSTEP_BYTES ({out['kstep_bytes']}) is not whole 16-byte chunks of a slice")
    return out


def swizzled_chunk(row, chunk, rows_per_atom=8):
    """Where TMA's CU_TENSOR_MAP_SWIZZLE_128B puts chunk `chunk` of row `row`: chunk XOR (row mod 8), which is
    bits 4-6 of the byte address XOR bits 7-9 in a 1024-byte-aligned tile."""
    return chunk ^ (row % rows_per_atom)


def kstep_wavefronts(position, rows, chunks):
    """Shared-memory wavefronts to read `chunks` (logical chunk indices) of each of `rows` 128-byte rows when
    chunk c of row r lies at position(r, c): the most distinct 4-byte words any one bank must deliver."""
    words = {}
    for r in rows:
        for c in chunks:
            start = r * 128 + position(r, c) * SWIZZLE_CHUNK
            for word in range(start // HARDWARE["bank_bytes"], (start + SWIZZLE_CHUNK) // HARDWARE["bank_bytes"]):
                words.setdefault(word % HARDWARE["banks"], set()).add(word)
    return max(len(v) for v in words.values())


def swizzle_tile(ax, x0, y0, cw, chh, position, kstep_chunks, title, outline_step):
    """8 rows of 8 chunks: chunk c of row r drawn at position(r, c), coloured by its k-step, numbered; the
    chunks of k-step `outline_step` outlined."""
    chunks = 8
    for r in range(8):
        for c in range(chunks):
            x = x0 + position(r, c) * cw
            step = c // kstep_chunks
            rect(ax, x, y0 + r * chh, cw, chh, QUAD[step % len(QUAD)], edge="white", lw=1.0)
            ax.text(x + cw / 2, y0 + (r + 0.5) * chh, f"{c}", ha="center", va="center", size=8.5)
            if step == outline_step:
                rect(ax, x, y0 + r * chh, cw, chh, "none", edge="#000000", lw=1.6, zorder=3)
        ax.text(x0 - 0.12, y0 + (r + 0.5) * chh, f"row {r}", ha="right", va="center", size=8)
    ax.text(x0 + chunks * cw / 2, y0 - 0.75, title, ha="center", va="bottom", size=9.5, weight="bold")


def swizzle_128b_08(ctx):
    """Figure 13: TMA's 128-byte swizzle and a wgmma k-step read of it (08's SLICE_BYTES, KSTEP_BYTES)."""
    z = swizzle_constants()
    row_bytes, kstep = z["slice_bytes"], z["kstep_bytes"]
    chunks, kstep_chunks = row_bytes // SWIZZLE_CHUNK, kstep // SWIZZLE_CHUNK
    steps, rows = row_bytes // kstep, list(range(chunks))
    banks_per_chunk = SWIZZLE_CHUNK // HARDWARE["bank_bytes"]
    plain = lambda r, c: c  # noqa: E731
    swizzled = swizzled_chunk
    cw, chh = 0.95, 0.55
    fig, ax = plt.subplots(figsize=(12.5, 6.9))
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.92)
    blank_axes(ax, (-1.4, 19.8), (-1.9, 11.3))
    left_x, right_x = 0.0, 10.6
    swizzle_tile(ax, left_x, 0, cw, chh, plain, kstep_chunks,
                 f"the tile as in global memory (8 rows of {row_bytes} bytes),\nand as shared memory would hold it "
                 f"unswizzled", outline_step=0)
    swizzle_tile(ax, right_x, 0, cw, chh, swizzled, kstep_chunks,
                 "shared memory as TMA writes it (CU_TENSOR_MAP_SWIZZLE_128B):\nchunk c of row r at position "
                 "c XOR (r mod 8)", outline_step=0)
    arrow(ax, (left_x + chunks * cw + 0.25, 4 * chh), (right_x - 0.85, 4 * chh), text="TMA", size=9,
          offset=(0, -0.3))
    for x0, position in ((left_x, plain), (right_x, swizzled)):
        for p in range(chunks):
            ax.text(x0 + (p + 0.5) * cw, -0.08, f"{banks_per_chunk * p}-{banks_per_chunk * p + banks_per_chunk - 1}",
                    ha="center", va="bottom", size=7.5, color="#404040")
        ax.text(x0 - 0.12, -0.08, "banks", ha="right", va="bottom", size=7.5, color="#404040")
        for r in range(chunks):
            ax.text(x0 + chunks * cw + 0.08, (r + 0.5) * chh, f"+{row_bytes * r}", va="center", size=7,
                    color="#606060")
        # chunks of k-step 0 per bank group, and the wavefronts of each k-step's read
        y = 8 * chh + 0.35
        counts = [sum(1 for r in rows for c in range(kstep_chunks) if position(r, c) == p) for p in range(chunks)]
        for p, n in enumerate(counts):
            ax.text(x0 + (p + 0.5) * cw, y + 0.2, f"{n}", ha="center", va="center", size=9,
                    color="#a50f15" if n > max(1, min(counts)) else "#202020", weight="bold")
        ax.text(x0 - 0.12, y + 0.2, "k-step 0\nper bank group", ha="right", va="center", size=7.5)
        fronts = [kstep_wavefronts(position, rows, range(s * kstep_chunks, (s + 1) * kstep_chunks))
                  for s in range(steps)]
        need = len(rows) * kstep // (HARDWARE["banks"] * HARDWARE["bank_bytes"])
        verdict = ("the minimum: conflict-free" if max(fronts) == need else
                   f"{max(fronts) // need}x the {need} a conflict-free read needs")
        ax.text(x0 + chunks * cw / 2, y + 0.62, f"reading one k-step ({kstep} bytes) of all 8 rows: "
                f"{max(fronts)} wavefronts\n({verdict}; k-steps 0-{steps - 1} alike)",
                ha="center", va="top", size=8.5)
    for s in range(steps):
        rect(ax, left_x + 3.2 * s, 6.95, 0.4, 0.3, QUAD[s], edge="none")
        ax.text(left_x + 0.5 + 3.2 * s, 7.1, f"k-step {s}: bytes {s * kstep}-{(s + 1) * kstep - 1}", va="center",
                size=8)
    ax.text(left_x, 7.5, f"Each cell: one 16-byte chunk (16 e4m3 of the reduced dimension), numbered by its place in "
            f"the row, under the 4 of the {HARDWARE['banks']} banks of {HARDWARE['bank_bytes']} bytes it\nlands in; "
            f"outlined: k-step 0, the {kstep} bytes of every row one wgmma reads. Wavefronts: the most 4-byte words "
            f"any one bank must deliver, one per wavefront.", va="top", size=8.5, linespacing=1.4)
    descriptor = (
        f"wgmma reads the tile through a shared-memory descriptor: K-major, {row_bytes}-byte "
        f"rows (one SLICE_BYTES slice), 128-byte swizzle mode,\n"
        f"stride byte offset 8 x {row_bytes} = {8 * row_bytes} bytes: from one 8-row atom of the pattern to the next "
        f"(a tile of R rows is R / 8 atoms), leading byte offset unused (1);\n"
        f"start address: the tile + k-step ks x KSTEP_BYTES ({kstep}) within the slice. Every tile "
        f"starts 1024-byte aligned, so row r's bits 7-9 are r mod 8\n"
        f"and the XOR wgmma applies to the addresses it forms is the one TMA applied: adding {kstep} x ks to the "
        f"start selects chunks {kstep_chunks}ks..{kstep_chunks}ks+{kstep_chunks - 1} of every row.\n"
        f"Rows longer than {row_bytes} bytes (Vt's rows: BLOCK_KV keys of one dimension) are stored as "
        f"{row_bytes}-byte slices, each a column of atoms; Q's and K's rows (D = 128 e4m3) are one slice.")
    ax.text(-1.3, 8.6, descriptor, va="top", size=8.5, linespacing=1.5)
    ax.set_title(f"08_fp8: the 128-byte swizzle, on 8 rows of {row_bytes} bytes (SLICE_BYTES), {chunks} chunks of "
                 f"{SWIZZLE_CHUNK} bytes each. Unswizzled, one k-step of every row\nfalls in {kstep_chunks} of the "
                 f"{chunks} bank groups; swizzled, in all {chunks}, and wgmma reads its {kstep}-byte k-steps "
                 f"(KSTEP_BYTES) conflict-free", size=11)
    return fig


# --- 14. 08's mbarrier ring ---------------------------------------------------------------------------

MB_COPY, MB_ISSUE = 1.5, 0.12  # schematic: a copy takes 1.5 tile computes, issuing a product 0.12 (for the drawing only)
PARITY_COLORS = ["#c6dbef", "#c7e9c0"]  # a wait on parity 0, on parity 1


def ring_stages_08():
    """D -> 08's (K, V) ring stages: STAGES_D128 and STAGES_D64, read from its source."""
    c = chapter_constants("08_fp8")
    out = {}
    for d in (128, 64):
        name = f"STAGES_D{d}"
        if name not in c:
            raise LookupError(f"08_fp8/attention.cu: `#define {name} ...` not found (the ring's stage count at "
                              f"D = {d}, which the mbarrier figure draws): the figure script needs updating")
        try:
            out[d] = const(c, name)
        except (KeyError, ValueError, SyntaxError) as error:
            raise LookupError(f"08_fp8/attention.cu: {name} = {c[name]!r} is not an integer the figure script can "
                              f"evaluate ({error})") from error
        if out[d] < 2:
            raise LookupError(f"08_fp8/attention.cu: {name} = {out[d]}: the mbarrier figure draws a ring of 2 or more")
    return out


def optional_const(c, name, **env):
    """A constant of the source, or None where it is not there (what only a label quotes)."""
    try:
        return const(c, name, **env)
    except (KeyError, ValueError, SyntaxError):
        return None


def mbarrier_schedule(stages, tiles):
    """08's ring over time (schematic): thread 0 issues tiles 0..STAGES-1 at the setup; the consumers compute
    tile t once it has landed and the previous one is done, then every warp arrives on empty[t % STAGES];
    the producer waits on that barrier before it issues tile t + STAGES into the stage."""
    issue, land, start, end, wait = {}, {}, {}, {}, {}
    for t in range(min(stages, tiles)):
        issue[t] = t * MB_ISSUE
        land[t] = issue[t] + MB_ISSUE + MB_COPY
    producer = min(stages, tiles) * MB_ISSUE
    for t in range(tiles):
        start[t] = max(end.get(t - 1, 0.0), land[t])
        end[t] = start[t] + 1.0
        nxt = t + stages
        if nxt < tiles:
            wait[nxt] = (producer, max(producer, end[t]))
            issue[nxt] = wait[nxt][1]
            land[nxt] = issue[nxt] + MB_ISSUE + MB_COPY
            producer = issue[nxt] + MB_ISSUE
    return issue, land, start, end, wait


def fitted_text(ax, x0, x1, y, texts, size=7, bbox=None):
    """The first of `texts` whose longest line fits between x0 and x1, centred there (none if none fits)."""
    scale = points_per_unit(ax)
    for text in texts:
        if (x1 - x0) * scale >= 0.56 * size * max(len(line) for line in text.split("\n")) + 4:
            ax.text((x0 + x1) / 2, y, text, ha="center", va="center", size=size, linespacing=1.1,
                    bbox=dict(facecolor=bbox, edgecolor="none", pad=0.3) if bbox else None)
            return


def mbarrier_panel(ax, d, stages, tiles, byte_count, warps):
    """One ring: the producer's thread, one lane per stage (copy in flight, tile in use), the consumers; every
    wait labelled with its barrier and parity, every fill with its phase."""
    issue, land, start, end, wait = mbarrier_schedule(stages, tiles)
    lane_y = {"producer": 0.0, "consumers": 1.2 + 0.75 * stages}
    for s in range(stages):
        lane_y[s] = 1.1 + 0.75 * s
    for t in range(tiles):
        stage, n = t % stages, t // stages
        y = lane_y[stage]
        rect(ax, issue[t], y, MB_ISSUE, 0.6, PP_COLORS["issue"], edge="white", lw=0.6)
        rect(ax, issue[t] + MB_ISSUE, y, land[t] - issue[t] - MB_ISSUE, 0.6, COLORS["k"], edge="white", lw=1,
             hatch="///")
        fitted_text(ax, issue[t] + MB_ISSUE, land[t], y + 0.3,
                    [f"TMA: tile {t}\nfull[{stage}] phase {n}", f"tile {t}"], bbox=COLORS["k"])
        rect(ax, land[t], y, end[t] - land[t], 0.6, "#fdd0a2", edge="white", lw=1)
        fitted_text(ax, land[t], end[t], y + 0.3, [f"tile {t} in the stage; its release\ncompletes empty[{stage}] "
                                                   f"phase {n}", f"tile {t}; release:\nempty[{stage}] phase {n}",
                                                   f"tile {t}"], bbox="#fdd0a2")
        # the consumers: wait on full[stage] with parity n % 2, compute, arrive on empty[stage]
        cy = lane_y["consumers"]
        rect(ax, start[t], cy, 1.0, 0.9, PARITY_COLORS[n % 2], edge="white", lw=1.2)
        ax.text(start[t] + 0.5, cy + 0.45, f"tile {t}\nwait full[{stage}]\nparity {n % 2}", ha="center",
                va="center", size=7.5, linespacing=1.15)
        if t in wait:
            w0, w1 = wait[t]
            if w1 > w0:
                parity = (t // stages - 1) % 2
                rect(ax, w0, 0, w1 - w0, 0.8, PARITY_COLORS[parity], edge="#bdbdbd", lw=0.8)
                ax.text((w0 + w1) / 2, 0.4, f"wait empty[{stage}]\nparity {parity}", ha="center", va="center",
                        size=7.5, linespacing=1.15)
            ax.annotate("", xy=(issue[t] + MB_ISSUE / 2, lane_y[stage] + 0.6), xytext=(end[t - stages], cy),
                        arrowprops=dict(arrowstyle="-|>", color="#636363", lw=0.7, shrinkA=0, shrinkB=0),
                        zorder=1.5)
    for t in range(min(stages, tiles)):
        rect(ax, issue[t], 0, MB_ISSUE, 0.8, PP_COLORS["issue"], edge="white", lw=0.6)
    for t in wait:
        rect(ax, issue[t], 0, MB_ISSUE, 0.8, PP_COLORS["issue"], edge="white", lw=0.6)
    first = min(stages, tiles)
    ax.text(first * MB_ISSUE + 0.05, -0.08, f"setup: thread 0 loads Q and tiles 0-{first - 1}, waiting on nothing",
            va="bottom", size=7.5)
    ax.text(-0.15, 0.4, "producer\n(one thread)", ha="right", va="center", size=8.5)
    for s in range(stages):
        ax.text(-0.15, lane_y[s] + 0.3, f"stage {s}", ha="right", va="center", size=8.5)
    ax.text(-0.15, lane_y["consumers"] + 0.45, f"consumers\n({warps} warps)" if warps else "consumers",
            ha="right", va="center", size=8.5)
    bytes_text = f"{byte_count:,} bytes" if byte_count else "K_BYTES + V_BYTES"
    ax.set_title(f"D = {d}: STAGES = {stages} (STAGES_D{d}), tiles 0-{tiles - 1}; each fill announces "
                 f"{bytes_text} (K and Vt)", size=9.5, loc="left")
    return max(end.values())


def mbarrier_ring_08(ctx):
    """Figure 14: 08's ring of (K, V) stages and its full and empty mbarriers, phase by phase (STAGES_D*)."""
    rings = ring_stages_08()
    c = chapter_constants("08_fp8")
    panels = [(d, rings[d], 2 * rings[d] + 2) for d in (128, 64)]
    horizon = max(mbarrier_schedule(s, t)[3][t - 1] for _, s, t in panels) + 0.2
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.0 + 1.9 * sum(s for _, s, _ in panels) / 2),
                             gridspec_kw={"height_ratios": [s + 2.6 for _, s, _ in panels]})
    for ax, (d, stages, tiles) in zip(axes, panels):
        k_bytes, v_bytes = optional_const(c, "K_BYTES", HEAD_DIM=d), optional_const(c, "V_BYTES", HEAD_DIM=d)
        warps = optional_const(c, "CONSUMER_WARPS", HEAD_DIM=d)
        ax.set_xlim(-1.6, horizon)
        ax.set_ylim(1.2 + 0.75 * stages + 1.0, -0.35)
        mbarrier_panel(ax, d, stages, tiles, k_bytes + v_bytes if k_bytes and v_bytes else None, warps)
        ax.set_yticks([])
        ax.set_xticks([])
        for side in ("top", "right", "left", "bottom"):
            ax.spines[side].set_visible(False)
    legend = [Patch(facecolor=PARITY_COLORS[0], label="a wait on parity 0"),
              Patch(facecolor=PARITY_COLORS[1], label="a wait on parity 1"),
              Patch(facecolor=COLORS["k"], hatch="///", edgecolor="white", label="TMA copy in flight"),
              Patch(facecolor="#fdd0a2", label="tile in the stage, in use"),
              Patch(facecolor=PP_COLORS["issue"], label="arrive.expect_tx and the TMA issue"),
              Line2D([], [], color="#636363", lw=0.7, marker=">", markersize=4,
                     label="the release of tile t lets the producer load tile t + STAGES")]
    axes[-1].legend(handles=legend, loc="upper left", bbox_to_anchor=(0.0, -0.02), ncol=3, fontsize=8.5,
                    frameon=False, handlelength=1.6)
    note = ("full[s]: count 1. The producer's mbarrier.arrive.expect_tx is its one arrival and announces the "
            "tile's bytes; the TMA copies count them off (complete_tx); the phase completes when both have.\n"
            "The consumers wait with try_wait.parity(tile / STAGES % 2). empty[s]: count = the consumer warps; "
            "lane 0 of each arrives once its warp is done with the tile;\nthe producer waits with parity "
            "(tile / STAGES - 1) % 2, for the phase of the tile STAGES before, then refills the stage. Use n of a "
            "stage is phase n of both its barriers,\nand a wait on parity p returns once the latest phase of that "
            "parity has completed: the parity flips with every round of the ring, so one bit tells the rounds "
            "apart.\nTimes are schematic (a copy takes 1.5 tile computes); only the order and the parities are "
            "08's. Before 08.2 (no producer warpgroup) thread 0 refills the stage as it releases it, on the same "
            "parities.")
    fig.text(0.01, 0.0, note, ha="left", va="top", size=8.5, linespacing=1.45)
    fig.suptitle("08_fp8: the ring of (K, Vt) stages and its mbarriers. Stage s = tile % STAGES has a full "
                 "barrier (the copy landed) and an empty one (every consumer warp is done);\nthe waits name the "
                 "parity of the phase they wait for, tile / STAGES % 2", size=11)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    return fig


# --- 15. 09's plain backward: one block's data flow ---------------------------------------------------

def box_side(spec, where, frac=0.5):
    """A point on the edge of box spec (x, y, w, h, text): its right, left, top or bottom side, frac along it."""
    x, y, w, h, _ = spec
    return {"r": (x + w, y + h * frac), "l": (x, y + h * frac), "t": (x + w * frac, y), "b": (x + w * frac, y + h)}[where]


def backward_constants():
    """09.1's block (09_backward/step1_plain.cu, with forward.h's MMA_M): keys per block and per warp,
    queries per tile, ring slots."""
    folder = os.path.join(ROOT, "09_backward")
    files = sorted(glob.glob(os.path.join(folder, "step1_*.cu")))
    if len(files) != 1:
        raise ValueError(f"09_backward: expected one step1_*.cu, found {files}")
    text = "".join(open(path).read() for path in (os.path.join(folder, "forward.h"), files[0]))
    c = text_constants(preprocess(text)[0])
    warps, warp_keys = const(c, "BWD_WARPS"), const(c, "BWD_WARP_ROWS")
    return {"warps": warps, "warp_keys": warp_keys, "block_kv": warps * warp_keys,
            "block_q": const(c, "BWD_BLOCK_Q"), "stages": const(c, "BWD_STAGES")}


def backward_09(ctx):
    """09.1, one block of the backward (key tile j of one head) over its loop of query tiles: what stays
    in shared memory and registers for the whole loop, what arrives per tile, what is recomputed, and
    where dQ is reduced. Sizes from step1_plain.cu."""
    b = backward_constants()
    kv, bq, wk = b["block_kv"], b["block_q"], b["warp_keys"]
    fig, ax = plt.subplots(figsize=(13.2, 6.9))
    blank_axes(ax, (-0.2, 15.6), (-1.0, 8.2))
    ax.set_aspect("auto")
    cols = ((0.0, 3.7, "device memory (one head)", COLORS["hbm"]),
            (5.0, 4.3, f"shared memory of the block ({kv} keys)", COLORS["smem"]),
            (10.6, 5.0, f"registers of warp w ({wk} keys of the {kv})", COLORS["reg"]))
    for x, w, title, color in cols:
        rect(ax, x - 0.1, -0.55, w + 0.2, 8.55, color, edge="none", alpha=0.45)
        ax.text(x + w / 2, -0.3, title, ha="center", va="center", size=10.5, style="italic")
    g = {  # device memory
        "qdo": (0.0, 0.4, 3.7, 0.75, "Q, dO  [N × D] fp16"),
        "lsed": (0.0, 1.45, 3.7, 0.75, "LSE (the forward's), D  [N] fp32"),
        "kv": (0.0, 2.9, 3.7, 0.75, "K, V  [N × D] fp16"),
        "dkdv": (0.0, 4.2, 3.7, 0.75, "dK, dV  [N × D] fp16"),
        "acc": (0.0, 5.6, 3.7, 0.95, "dQ accumulator  [N × D] fp32\n(workspace, zeroed by kernel 1)"),
        "dq": (0.0, 7.15, 3.7, 0.65, "dQ  [N × D] fp16"),
    }
    s = {  # shared memory
        "ring": (5.0, 0.4, 4.3, 1.8, f"ring of {b['stages']} slots, one per query tile i:\n"
                                      f"Q_i, dO_i  [{bq} × D]\nLSE_i, D_i  [{bq}]"),
        "kvj": (5.0, 2.9, 4.3, 0.75, f"K_j, V_j  [{kv} × D]: the whole loop"),
        "ds": (5.0, 5.6, 4.3, 0.95, f"dSᵀ of tile i  [{kv} keys × {bq} queries]\n(every warp's rows)"),
    }
    r = {  # registers
        "sp": (10.6, 0.4, 5.0, 0.8, f"Sᵀ = K_j Q_iᵀ  → Pᵀ = exp(Sᵀ·scale − LSE_i)\nrecomputed, {wk} × {bq}"),
        "dp": (10.6, 1.4, 5.0, 0.8, f"dPᵀ = V_j dO_iᵀ  → dSᵀ = Pᵀ ∘ (dPᵀ − D_i)\n{wk} × {bq}"),
        "dkv": (10.6, 2.9, 5.0, 0.75, f"dV += Pᵀ dO_i,  dK += dSᵀ Q_i\n{wk} × D each, fp32: the whole loop"),
        "dqp": (10.6, 5.6, 5.0, 0.95, f"dQ_i's partial = dS K_j\n{wk} queries × D, this warp's share"),
    }
    colors = {"qdo": COLORS["q"], "lsed": COLORS["q"], "kv": COLORS["k"], "acc": COLORS["s"], "dkdv": COLORS["k"],
              "dq": COLORS["q"], "ring": COLORS["q"], "kvj": COLORS["k"], "ds": COLORS["s"], "sp": COLORS["s"],
              "dp": COLORS["s"], "dkv": COLORS["k"], "dqp": COLORS["q"]}
    boxes = {**g, **s, **r}
    for name, (x, y, w, h, text) in boxes.items():
        box(ax, x, y, w, h, text, colors[name], size=9)

    def side(name, where, frac=0.5):
        return box_side(boxes[name], where, frac)

    def path(points, color, text=None, at=None):
        """A polyline ending in an arrow head, with optional text at `at`."""
        ax.plot([p[0] for p in points[:-1]], [p[1] for p in points[:-1]], color=color, lw=1.2)
        arrow(ax, points[-2], points[-1], color=color)
        if text:
            ax.text(*at, text, ha="center", va="top", size=8.5, color=color)

    arrow(ax, side("qdo", "r"), side("ring", "l", 0.3), text="cp.async,\nevery tile", size=8)
    arrow(ax, side("lsed", "r"), side("ring", "l", 0.8), size=8)
    arrow(ax, side("kv", "r"), side("kvj", "l"), text="cp.async, once", size=8)
    arrow(ax, side("ring", "r", 0.25), side("sp", "l"), text="ldmatrix", size=8)
    arrow(ax, side("kvj", "r", 0.3), side("dp", "l", 0.7), size=8)
    arrow(ax, side("dp", "b", 0.08), side("ds", "t", 0.85), text="4-byte stores", size=8, offset=(0.2, 0.3))
    arrow(ax, side("ds", "r"), side("dqp", "l"), text="ldmatrix.trans, after\nthe next barrier", size=8,
          offset=(0.0, -0.55))
    bend = side("dqp", "b")[1] + 0.3
    path([side("dqp", "b"), (side("dqp", "b")[0], bend), (3.35, bend), (3.35, side("acc", "b")[1])], COLORS["hi"],
         "atomicAdd (RED): every key block adds into every query row it sees", (8.6, bend + 0.08))
    path([side("dkv", "b", 0.3), (side("dkv", "b", 0.3)[0], 4.575), side("dkdv", "r")], "#606060",
         "once, after the loop (dK × scale)", (7.2, 4.66))
    arrow(ax, side("acc", "b", 0.15), side("dq", "t", 0.15), text="kernel 3: × scale, fp16", size=8,
          offset=(1.05, 0.0))
    ax.text(1.85, 2.42, "kernel 1: D = rowsum(dO ∘ O)", ha="center", va="center", size=8, style="italic")
    ax.set_title(f"09.1, kernel 2: one block = key tile j ({kv} keys, {b['warps']} warps of {wk}), looping over "
                 f"query tiles i of {bq}", size=11.5)
    return fig


def hopper_backward_constants():
    """10's block at D = 128 (10_backward_hopper/attention.cu): keys per consumer and per block, queries per
    tile, ring stages, the roles' registers, dQ's passes and its stage, shared memory."""
    text = raw_source("10_backward_hopper")
    find(r"void write_dq\(", text, "10's dQ writer warp (write_dq), which the figure draws")
    c = text_constants(text)
    return {"consumers": const(c, "CONSUMERS"), "wg_keys": const(c, "WG_ROWS"),
            "block_kv": const(c, "TILE_KV", HEAD_DIM=128), "block_q": const(c, "TILE_Q", HEAD_DIM=128),
            "stages": const(c, "BWD_STAGES"), "producer_regs": const(c, "PRODUCER_REGISTERS"),
            "consumer_regs": const(c, "CONSUMER_REGISTERS"), "passes": const(c, "DQ_PASSES", HEAD_DIM=128),
            "chunk_kib": const(c, "DQ_CHUNK_BYTES") // 1024, "smem_kib": const(c, "SMEM_BYTES", HEAD_DIM=128) / 1024}


def backward_hopper_10(ctx):
    """10, one block of the backward at D = 128 (key tile j of one head) over its loop of query tiles: the
    producer's copies through the ring and its barriers, what each consumer warpgroup computes and keeps,
    and dQ's way out through a shared-memory stage and the bulk reduce-add. Sizes from attention.cu."""
    b = hopper_backward_constants()
    kv, bq, wk, n = b["block_kv"], b["block_q"], b["wg_keys"], b["consumers"]
    fig, ax = plt.subplots(figsize=(13.2, 7.4))
    blank_axes(ax, (-0.2, 15.6), (-1.0, 8.8))
    ax.set_aspect("auto")
    cols = ((0.0, 3.7, "device memory (one head)", COLORS["hbm"]),
            (5.0, 4.3, f"shared memory of the block ({b['smem_kib']:.0f} KiB)", COLORS["smem"]),
            (10.6, 5.0, "warpgroups: registers", COLORS["reg"]))
    for x, w, title, color in cols:
        rect(ax, x - 0.1, -0.55, w + 0.2, 9.15, color, edge="none", alpha=0.45)
        ax.text(x + w / 2, -0.3, title, ha="center", va="center", size=10.5, style="italic")
    boxes = {
        "qdo": (0.0, 0.4, 3.7, 0.75, "Q, dO  [N × D] fp16"),
        "cols": (0.0, 1.45, 3.7, 0.9, f"LSE and D, per query tile\n[tile][LSE, D][{bq}] fp32 (kernel 1)"),
        "kv": (0.0, 2.9, 3.7, 0.75, "K, V  [N × D] fp16"),
        "dkdv": (0.0, 3.85, 3.7, 0.75, "dK, dV  [N × D] fp16"),
        "acc": (0.0, 5.95, 3.7, 0.95, "dQ accumulator  [N × D] fp32\n(zeroed by cudaMemsetAsync)"),
        "dq": (0.0, 7.55, 3.7, 0.65, "dQ  [N × D] fp16"),
        "ring": (5.0, 0.4, 4.3, 1.95, f"ring of {b['stages']} stages, one per query tile i:\nQ_i, dO_i  [{bq} × D], "
                                      f"LSE_i, D_i\nfull barrier: the copies landed\nempty: every consumer thread "
                                      "arrived"),
        "kvj": (5.0, 2.9, 4.3, 0.75, f"K_j, V_j  [{kv} × D]: the whole loop"),
        "ds": (5.0, 4.55, 4.3, 0.95, f"dSᵀ of tile i  [{kv} keys × {bq} queries]\nboth consumers' rows (two buffers)"),
        "stage": (5.0, 5.95, 4.3, 0.95, f"dQ stage, one per consumer\n{bq} queries × 64 dims fp32 ({b['chunk_kib']} KiB)"),
        "prod": (10.6, 0.4, 5.0, 0.95, f"producer warpgroup ({b['producer_regs']} registers):\n"
                                      "thread 0 copies; warp 1, the dQ writer, adds"),
        "cons": (10.6, 1.6, 5.0, 2.05, f"consumer c of {n} ({b['consumer_regs']} registers),\nkeys {wk}c to {wk}c + {wk - 1}:\n"
                                      f"Sᵀ = K Q_iᵀ, dPᵀ = V dO_iᵀ (wgmma)\nPᵀ = exp(Sᵀ·scale − LSE_i), "
                                      f"dSᵀ = Pᵀ ∘ (dPᵀ − D_i)\ndV += Pᵀ dO_i, dK += dSᵀ Q_i (wgmma)"),
        "dkv": (10.6, 3.85, 5.0, 0.75, f"dK, dV of its {wk} keys × D, fp32: the whole loop"),
        "dqp": (10.6, 5.95, 5.0, 0.95, f"dQ_i's pass c = dS K_j over the {kv} keys\n64 dims a pass, {b['passes']} "
                                      "passes: one per consumer"),
    }
    colors = {"qdo": COLORS["q"], "cols": COLORS["q"], "kv": COLORS["k"], "dkdv": COLORS["k"], "acc": COLORS["s"],
              "dq": COLORS["q"], "ring": COLORS["q"], "kvj": COLORS["k"], "ds": COLORS["s"], "stage": COLORS["s"],
              "prod": COLORS["hi"], "cons": COLORS["s"], "dkv": COLORS["k"], "dqp": COLORS["q"]}
    for name, (x, y, w, h, text) in boxes.items():
        box(ax, x, y, w, h, text, colors[name], size=9)

    def side(name, where, frac=0.5):
        return box_side(boxes[name], where, frac)

    arrow(ax, side("qdo", "r"), side("ring", "l", 0.2), text="TMA, every tile", size=8)
    arrow(ax, side("cols", "r"), side("ring", "l", 0.75), text="bulk copy,\nwith Q and dO", size=8)
    arrow(ax, side("kv", "r"), side("kvj", "l"), text="TMA, once", size=8)
    arrow(ax, side("prod", "l", 0.3), side("ring", "r", 0.15), text="issues", size=8, offset=(0.0, -0.05))
    arrow(ax, side("ring", "r", 0.8), side("cons", "l", 0.3), text="wgmma reads", size=8)
    arrow(ax, side("kvj", "r"), side("cons", "l", 0.85), size=8)
    arrow(ax, side("cons", "b", 0.2), side("dkv", "t", 0.2), size=8)
    arrow(ax, side("cons", "l", 0.97), side("ds", "r", 0.3), text="stores", size=8, offset=(0.0, 0.25))
    arrow(ax, side("ds", "r", 0.85), side("dqp", "l", 0.3), text="after both\nconsumers' barrier", size=8,
          offset=(0.0, -0.3))
    arrow(ax, side("dqp", "l", 0.8), side("stage", "r", 0.8), text="stores", size=8, offset=(0.0, -0.2))
    arrow(ax, side("stage", "l"), side("acc", "r"), color=COLORS["hi"], text="cp.reduce.async.bulk\n.add.f32, by the\nwriter warp",
          size=8, offset=(0.0, -0.75))
    arrow(ax, side("dkv", "l", 0.5), side("dkdv", "r", 0.5), color="#606060", text="once, after\nthe loop", size=8,
          offset=(-2.8, 0.0))
    arrow(ax, side("acc", "b", 0.15), side("dq", "t", 0.15), text="kernel 3: × scale, fp16", size=8,
          offset=(1.05, 0.0))
    ax.set_title(f"10, kernel 2 at D = 128: one block = key tile j ({kv} keys: {n} consumers of {wk}) and a producer, "
                 f"looping over query tiles i of {bq}", size=11.5)
    return fig


# --- Main -------------------------------------------------------------------------------------------

FIGURES = [("memory_hierarchy", memory_hierarchy), ("tiling_02", tiling_02), ("online_softmax", online_softmax),
           ("loop_order", loop_order), ("causal_tiles", causal_tiles), ("wmma_roundtrip_06", wmma_roundtrip_06),
           ("mma_fragments", mma_fragments), ("cp_async_ring", cp_async_ring), ("bank_maps", bank_maps),
           ("staircase", staircase), ("pingpong_08", pingpong_08), ("wgmma_fragments_08", wgmma_fragments_08),
           ("swizzle_128b_08", swizzle_128b_08), ("mbarrier_ring_08", mbarrier_ring_08),
           ("backward_09", backward_09), ("backward_hopper_10", backward_hopper_10)]


def main():
    """Make the figures named on the command line, or all of them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--png", metavar="DIR", help="also write a PNG copy of every figure into DIR")
    parser.add_argument("names", nargs="*", help="only these figures (default: all)")
    args = parser.parse_args()
    if plt is None:
        print("matplotlib not installed: figures not regenerated")
        return 0
    setup_matplotlib()
    if args.png:
        os.makedirs(args.png, exist_ok=True)
    env = read_env()
    ctx = {"rows": read_results(), "env": env, "clock_ghz": sm_clock_ghz(env)}
    for name, make in FIGURES:
        if args.names and name not in args.names:
            continue
        path = save(make(ctx), name, args.png)
        print(f"{os.path.relpath(path, ROOT)}: {os.path.getsize(path) / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
