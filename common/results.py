"""What a result is and where results live: the benchmark's shapes, the result row shared by
common/stages.py (chapters) and common/anchors.py (PyTorch), the FLOP convention of its TFLOP/s,
the results CSV with its notes, and the .env that records the machine a run was made on; the
two passes (the forward, and the backward of the chapters that have one), each in a file of its own."""
import csv
import datetime
import functools
import glob
import os
import re
import subprocess

from chapters import has_backward, read_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CSV_FIELDS = ("impl", "batch", "heads", "seqlen", "headdim", "causal", "dtype",
              "ms", "tflops", "rel_l2", "status", "device_bytes")
OPTIONAL_FIELDS = ("device_bytes",)  # may be absent from an older CSV, or empty in a row
# A binary's --csv row (common/harness.cu): the result row's first fields, then these.
# The last three are the backward's (--backward: each gradient's rel L2; empty in a forward's row).
HARNESS_FIELDS = CSV_FIELDS[:-1] + ("max_abs", "lse_err", "kernels", "workspace_bytes", "prepare_ms", "attend_ms",
                                    "rel_l2_floor", "device_bytes", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2")
HARNESS_NUMBERS = ("max_abs", "lse_err", "prepare_ms", "attend_ms", "rel_l2_floor",  # floats, None when empty
                   "dq_rel_l2", "dk_rel_l2", "dv_rel_l2")
INT_FIELDS = ("batch", "heads", "seqlen", "headdim", "causal")
GRAD_FIELDS = ("dq_rel_l2", "dk_rel_l2", "dv_rel_l2")  # a backward row's: each gradient's rel L2 (below)
FLOAT_FIELDS = ("ms", "tflops", "rel_l2") + GRAD_FIELDS
KEY_FIELDS = ("impl", "dtype", "batch", "heads", "seqlen", "headdim", "causal")
NOTE_FIELDS = KEY_FIELDS + ("note",)
TIMED = ("PASS", "unchecked")   # statuses whose timing is shown
ANCHORS = ("torch_flash", "torch_cudnn", "torch_efficient", "torch_eager", "cudnn_fp8")
BACKWARD_ANCHORS = ANCHORS[:4]  # cuDNN's FP8 attention is measured forward only
FA2, CUDNN, EAGER = "torch_flash", "torch_cudnn", "torch_eager"

# --- The two passes ------------------------------------------------------------------------------
# The backward (`--backward`, for a chapter that registers one) is swept over the same shapes as the
# forward, and its rows live in a file of their own beside the forward's: <gpu>.backward.csv (its
# .notes.csv, .env and .md beside it by the same rule), so that no forward table ever sees them. Its
# columns are CSV_FIELDS with the backward's numbers (ms and TFLOP/s of the backward alone, FLOPs 2.5x
# the forward's; rel_l2 the largest of the three gradients' errors; device_bytes all that is held
# through one forward and backward), then GRAD_FIELDS: each gradient's relative L2 error.
PASSES = ("forward", "backward")
BACKWARD_TAG = ".backward"  # <gpu>.backward.csv: the file's name says which pass its rows are
BACKWARD_CSV_FIELDS = CSV_FIELDS + GRAD_FIELDS
BACKWARD_REL_L2_TOL = 1e-3  # a chapter's bound on each gradient (common/harness.cu's BACKWARD_REL_L2_TOL)
ANCHOR_REL_L2_TOL = 3e-3    # an anchor's, forward or backward: the fp16 tensor-core bound (docs/design.md)


# A chapter built in steps (08: 08.1 ... 08.5, read from its source by chapters.read_steps): the
# Makefile's BUILD/<chapter>.step<k> for every step but the last, which is the chapter itself. Each
# step's rows carry its own name as impl ("08.1"), which sorts before the chapter's ("08_fp8"), so
# tables list 07, 08.1, ..., 08.4, 08_fp8; in markers and tables 08.5 also names the chapter.
@functools.cache
def _steps():
    steps, dtypes, aliases = {}, {}, {}
    for path in sorted(glob.glob(os.path.join(ROOT, "[0-9][0-9]_*", "attention.cu"))):
        chapter = os.path.basename(os.path.dirname(path))
        found = read_steps(path)
        for step in found:
            if step["precision"] == "PRECISION_FP8_TC":
                dtypes[step["name"]] = "fp8"
        if found:
            steps[chapter] = tuple(s["name"] for s in found if s["name"] != chapter)
            aliases[f"{chapter[:2]}.{len(found)}"] = chapter
    return steps, dtypes, aliases


def steps():
    """{chapter: (its step builds' names but the last)}, e.g. {"08_fp8": ("08.1", ..., "08.4")}."""
    return _steps()[0]


def chapter_dtypes():
    """{build: its dtype} where it is not fp16 ("08.4": "fp8", "08_fp8": "fp8")."""
    return _steps()[1]


def step_aliases():
    """{"08.5": "08_fp8"}: the last step's number names its chapter."""
    return _steps()[2]


# The backward's run-time modes (common/harness.h, BackwardArgs.deterministic): every chapter with a
# backward pass runs it in each, `BUILD/<chapter> --backward --<mode>`, as a row of the backward's sweep
# of its own, impl <chapter>.<mode> (09_backward.deterministic), the name its binary's --csv row gives
# itself in that mode.
BACKWARD_MODES = ("deterministic",)


@functools.cache
def variants(root=ROOT):
    """{chapter: its modes' impls} for every chapter with a backward pass:
    {"09_backward": ("09_backward.deterministic",)}."""
    found = {}
    for path in sorted(glob.glob(os.path.join(root, "[0-9][0-9]_*", "attention.cu"))):
        chapter = os.path.basename(os.path.dirname(path))
        if has_backward(path):
            found[chapter] = tuple(f"{chapter}.{mode}" for mode in BACKWARD_MODES)
    return found


def impl_command(impl):
    """(the build whose binary runs impl, its run-time flags): ("09_backward", ["--deterministic"]) for
    09_backward.deterministic, (impl, []) for any other (a chapter, a step such as 08.3). The build's
    name is also the one its binary's messages start with."""
    build, _, mode = impl.rpartition(".")
    return (build, [f"--{mode}"]) if build in variants() and mode in BACKWARD_MODES else (impl, [])


def chapter_pass(chapter, root=ROOT):
    """The pass a chapter adds, its steps' with it: "backward" where it registers a backward pass (09,
    whose steps are steps of its backward), else "forward" (08)."""
    return "backward" if chapter in variants(root) else "forward"


def backward_runs(chapter, root=ROOT):
    """The impls of a chapter whose backward the bench times: the chapter, then its modes, where it
    registers a backward pass (a `Backward` in its source); () for the others."""
    modes = variants(root).get(chapter)
    return (chapter,) + modes if modes else ()

# --- The benchmark's shapes (docs/design.md) ----------------------------------------------
BENCH_DS = (128, 64)
BENCH_NS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_NS = (1024, 4096)
TOTAL_TOKENS = 16384    # B = TOTAL_TOKENS / N
HIDDEN = 2048           # H = HIDDEN / D
HEADLINE_D, HEADLINE_N = 128, 4096
BENCH_WARMUP, BENCH_ITERS = 3, 10


def bench_shape(headdim, seqlen, causal):
    """The benchmark shape for D and N: 16k tokens, hidden 2048."""
    return {"batch": TOTAL_TOKENS // seqlen, "heads": HIDDEN // headdim, "seqlen": seqlen,
            "headdim": headdim, "causal": causal}


def bench_shapes(quick=False, headdim=None, seqlens=None):
    """Every bench shape (of one D where headdim is given, of the N in seqlens where given), N ascending
    within each (D, causal), as the skip rule needs."""
    ns = [n for n in BENCH_NS if n in (seqlens or (QUICK_NS if quick else BENCH_NS))]
    return [bench_shape(d, n, c) for d in BENCH_DS if headdim in (None, d) for c in (0, 1) for n in ns]


# --- Result rows ---------------------------------------------------------------------------

def work(shape):
    """B·H·N²·D: what a forward's time grows with (the bench keeps B·N fixed, so ~N)."""
    return shape["batch"] * shape["heads"] * shape["seqlen"] ** 2 * shape["headdim"]


def forward_tflops(shape, ms):
    """TFLOP/s of one forward: 4·B·H·N²·D FLOPs, halved when causal."""
    flops = 4.0 * work(shape)
    return (flops / 2 if shape["causal"] else flops) / (ms * 1e-3) / 1e12


def backward_tflops(shape, ms):
    """TFLOP/s of one backward: 2.5x the forward's FLOPs (the FlashAttention papers' convention)."""
    return 2.5 * forward_tflops(shape, ms)


def shape_label(shape):
    """B=4 H=16 N=4096 D=128 causal."""
    mask = "causal" if shape["causal"] else "non-causal"
    return f"B={shape['batch']} H={shape['heads']} N={shape['seqlen']} D={shape['headdim']} {mask}"


def make_row(impl, shape, status, ms=None, tflops=None, rel_l2=None, note=None, dtype="fp16", device_bytes=None,
             grads=None):
    """One result row (a dict of CSV_FIELDS, plus an optional note); grads: a backward row's
    (dq, dk, dv) relative L2 errors (GRAD_FIELDS; (None, None, None) where not measured)."""
    row = {"impl": impl, **{k: int(shape[k]) for k in INT_FIELDS}, "dtype": dtype,
           "ms": ms, "tflops": tflops, "rel_l2": rel_l2, "status": status, "device_bytes": device_bytes}
    if grads is not None:
        row.update(zip(GRAD_FIELDS, grads))
    if note:
        row["note"] = note
    return row


def row_key(row):
    """What identifies a row: impl and shape."""
    return tuple(row[k] for k in KEY_FIELDS)


def step_binary(build, chapter, step):
    """BUILD/08_fp8.step1 for step '08.1' of chapter 08_fp8."""
    return os.path.join(build, f"{chapter}.step{step.rpartition('.')[2]}")


def find_row(rows, name, headdim, seqlen, causal):
    """The row of impl `name` at (D, N, causal), or None."""
    name = step_aliases().get(name, name)
    for row in rows:
        if row["impl"] == name and (row["headdim"], row["seqlen"], row["causal"]) == (headdim, seqlen, causal):
            return row
    return None


def timed(row, field):
    """row[field] when the row is a trustworthy timing (PASS or unchecked), else None."""
    return row.get(field) if row is not None and row["status"] in TIMED else None


def is_anchor(impl):
    """True for the rows of other libraries (PyTorch's SDPA and eager, cuDNN's FP8)."""
    return impl in ANCHORS or impl.startswith("torch_")


def chapter_impls(rows):
    """The chapters present in rows, in order."""
    return sorted({row["impl"] for row in rows if not is_anchor(row["impl"])})


def anchor_impls(rows):
    """The anchors present in rows, in ANCHORS order."""
    present = {row["impl"] for row in rows}
    return [a for a in ANCHORS if a in present]


# --- Files: the results CSV and its notes, the .env ----------------------------------------

def gpu_slug(name):
    """A file name for a GPU: the first line, spaces to '_'; 'unknown_gpu' if empty."""
    lines = (name or "").strip().splitlines()
    first = lines[0].strip() if lines else ""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", first).strip("_")
    return slug or "unknown_gpu"


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
    if field in OPTIONAL_FIELDS:
        return int(text) if text else None
    return text


def csv_pass(path):
    """Which pass a results CSV holds, from its name: "backward" for <gpu>.backward.csv, else "forward"."""
    return "backward" if os.path.splitext(path)[0].endswith(BACKWARD_TAG) else "forward"


def pass_csv(csv_path, pass_):
    """The results CSV of a pass beside csv_path (of either pass): <gpu>.csv or <gpu>.backward.csv."""
    base = os.path.splitext(csv_path)[0]
    base = base[:-len(BACKWARD_TAG)] if base.endswith(BACKWARD_TAG) else base
    return base + (BACKWARD_TAG if pass_ == "backward" else "") + ".csv"


def csv_fields(path):
    """The columns of a results CSV: CSV_FIELDS, and GRAD_FIELDS after them in a backward file."""
    return BACKWARD_CSV_FIELDS if csv_pass(path) == "backward" else CSV_FIELDS


def notes_path(csv_path):
    """Where the skip/fail notes of a results CSV live: <gpu>.notes.csv."""
    return os.path.splitext(csv_path)[0] + ".notes.csv"


def write_results(path, rows):
    """Write rows to path (exact header: csv_fields, by the file's pass) and their notes to the
    .notes.csv beside it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fields = csv_fields(path)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(fields)
        for row in rows:
            writer.writerow([format_value(row.get(k)) for k in fields])
    with open(notes_path(path), "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(NOTE_FIELDS)
        for row in rows:
            if row.get("note"):
                writer.writerow([format_value(row.get(k)) for k in NOTE_FIELDS])


def read_results(path):
    """Rows of a results CSV, with the notes of its .notes.csv (if any) attached; a backward file's
    rows also have GRAD_FIELDS (None where a column or a cell is empty)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in CSV_FIELDS if k not in (reader.fieldnames or []) and k not in OPTIONAL_FIELDS]
        if missing:
            raise ValueError(f"{path}: not a results CSV (missing columns {', '.join(missing)})")
        rows = [{k: parse_value(k, line.get(k)) for k in csv_fields(path)} for line in reader]
    notes, fields = {}, KEY_FIELDS
    if os.path.exists(notes_path(path)):
        with open(notes_path(path), newline="") as f:
            reader = csv.DictReader(f)
            fields = [k for k in KEY_FIELDS if k in (reader.fieldnames or [])]  # older notes: no dtype
            for line in reader:
                notes[tuple(parse_value(k, line[k]) for k in fields)] = line["note"]
    for row in rows:
        key = tuple(row[k] for k in fields)
        if key in notes:
            row["note"] = notes[key]
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
