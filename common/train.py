#!/usr/bin/env python3
"""`make train CH=07`: a small GPT trained from one seed, once with PyTorch's SDPA and once with a
chapter's attention (common/torch_op.py: the forward from CH, the backward from 09), on the bytes of
the Python standard library's own source; the loss curves, side by side. CH=07,08: one SDPA run,
then one run per chapter, from the same seed.

  train.py [--chapter 07[,08...]] [--backward 09] [--steps N] [--batch B] [--eval-every K] [--eval-batches E]
           [--seed S] [--lr LR] [--quick] [--out CSV] [--build DIR] [--make CMD] [--no-build]

The model: 6 layers, 6 heads of D = 64 (width 384), context 512, bytes as tokens (256), learned
positions, pre-norm blocks, an MLP of 4x the width with GELU, tied embeddings (10.9M parameters).
The weights and everything but the attention are fp32 (matrix products on TF32); the attention is
fp16 in both runs: q, k, v cast to fp16 and made contiguous, the attention (SDPA, or the chapter),
O cast back. So the two runs differ in the attention kernels and in nothing else. fp16 gradients
are kept from underflowing by loss scaling (torch.amp.GradScaler). AdamW (0.9, 0.95, weight decay
0.1 on the matrices), the learning rate warmed up over the first 4% of steps, then a cosine to 10%.

The data: every .py file under sysconfig.get_paths()["stdlib"] (site-packages and __pycache__
left out), sorted by path; every VALIDATION_EVERY-th file of that order is validation, the rest
training; each split is its files' bytes joined by a NUL byte. Training batches are windows at
random offsets drawn from a generator seeded with --seed (the same windows for both runs); the
validation loss is the mean over --eval-batches batches of windows evenly spaced over the
validation bytes. The files are those of the Python that runs this: another Python version is
another corpus (the summary names it).

Out: a progress bar (plain text, on stderr), a CSV of (step, run, train_loss, val_loss,
tokens_per_s) at every evaluation (train_loss: the mean since the previous one; tokens_per_s: the
training tokens of that interval over its time, evaluation excluded), a figure of both runs' curves
beside it (skipped with a note without matplotlib), each run's tokens per second (every interval
but the first, which holds the warm-up) and the difference of the final validation losses. The
default output is docs/results/train/train_<build>.csv (.png); with --quick, BUILD/train/.

Without PyTorch or a CUDA GPU it says so in one line and exits 77 (the skip code), as `make compare` does.
"""
import argparse
import csv
import math
import os
import shlex
import subprocess
import sys
import sysconfig
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_op  # noqa: E402  (imports without PyTorch)
from chapters import runs_on  # noqa: E402
from runner import make_env  # noqa: E402

torch = torch_op.torch
ROOT = os.path.dirname(HERE)

LAYERS, HEADS, HEAD_DIM, CONTEXT, VOCAB = 6, 6, 64, 512, 256
WIDTH = HEADS * HEAD_DIM
VALIDATION_EVERY = 10  # every 10th file of the sorted list is validation
SEPARATOR = b"\0"      # between files: a byte no source file holds
WARMUP_FRACTION, FINAL_LR_FRACTION = 0.04, 0.1
CLIP_NORM = 1.0
PROGRESS_EVERY = 25    # steps between progress-bar updates on a terminal (each reads the loss: a sync)
FIELDS = ("step", "run", "train_loss", "val_loss", "tokens_per_s")
SDPA_RUN = "sdpa"
# An H200 ran a step of batch 32 in 17 ms with SDPA, 22 ms with 07 + 09 (--quick's tokens/s): 3000
# steps are about a minute a run.
DEFAULTS = {"steps": 3000, "batch": 32, "eval_every": 150, "eval_batches": 16}
QUICK = {"steps": 200, "batch": 32, "eval_every": 50, "eval_batches": 4}


# --- The corpus ----------------------------------------------------------------------------------
def stdlib_files(root=None):
    """The .py files of the standard library, as sorted paths relative to it."""
    root = root or sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        found += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    return root, sorted(found)


def split_files(files):
    """(training files, validation files): every VALIDATION_EVERY-th file is validation."""
    return ([f for i, f in enumerate(files) if i % VALIDATION_EVERY],
            [f for i, f in enumerate(files) if i % VALIDATION_EVERY == 0])


def read_bytes(root, files):
    parts = []
    for name in files:
        with open(os.path.join(root, name), "rb") as f:
            parts.append(f.read())
    return SEPARATOR.join(parts)


def load_corpus(device):
    """{'train': uint8 tensor, 'val': uint8 tensor, 'about': one line} on the device."""
    root, files = stdlib_files()
    train_files, val_files = split_files(files)
    splits = {name: read_bytes(root, chosen) for name, chosen in (("train", train_files), ("val", val_files))}
    about = (f"Python {sys.version.split()[0]} standard library ({root}): {len(train_files)} training files "
             f"({len(splits['train']) / 1e6:.1f} MB), {len(val_files)} validation files "
             f"({len(splits['val']) / 1e6:.1f} MB)")
    corpus = {name: torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) for name, data in splits.items()}
    corpus["about"] = about
    return corpus


def windows(data, starts):
    """Inputs and targets of the windows of CONTEXT + 1 bytes that begin at starts (a device tensor)."""
    chunk = data[starts[:, None] + torch.arange(CONTEXT + 1, device=data.device)].long()
    return chunk[:, :-1], chunk[:, 1:]


def training_batch(data, batch, generator):
    starts = torch.randint(0, len(data) - CONTEXT - 1, (batch,), generator=generator)
    return windows(data, starts.to(data.device))


def validation_batches(data, batch, count):
    """count batches of windows evenly spaced over the validation bytes: the same every evaluation."""
    starts = torch.linspace(0, len(data) - CONTEXT - 2, batch * count, device=data.device).long()
    return [windows(data, part) for part in starts.split(batch)]


# --- The model -------------------------------------------------------------------------------------
def sdpa_attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def chapter_attention(chapter, backward):
    def attend(q, k, v):
        return torch_op.attention(q, k, v, causal=True, chapter=chapter, backward=backward)
    return attend


def build_model(attend):
    """The GPT, its classes defined here so that this module imports without PyTorch."""
    nn = torch.nn

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            b, n, _ = x.shape
            qkv = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)  # 3, B, H, N, D
            q, k, v = (t.to(torch.float16, memory_format=torch.contiguous_format) for t in qkv)
            o = attend(q, k, v)  # fp16 [B, H, N, D]
            return self.proj(o.float().transpose(1, 2).reshape(b, n, WIDTH))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.attn, self.norm2 = nn.LayerNorm(WIDTH), SelfAttention(), nn.LayerNorm(WIDTH)
            self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = nn.LayerNorm(WIDTH)
            self.apply(self.init_weights)
            for block in self.blocks:  # residual branches scaled down with depth (GPT-2)
                for proj in (block.attn.proj, block.mlp[2]):
                    nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * LAYERS))

        @staticmethod
        def init_weights(module):
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

        def loss(self, inputs, targets):
            x = self.tokens(inputs) + self.positions(torch.arange(inputs.shape[1], device=inputs.device))
            for block in self.blocks:
                x = block(x)
            logits = self.norm(x) @ self.tokens.weight.t()  # tied embeddings
            return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))

    return GPT()


def optimizer(model, lr):
    """AdamW, weight decay on the matrices only."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def grad_scaler(device):
    amp = getattr(torch, "amp", None)
    if amp is not None and hasattr(amp, "GradScaler"):
        return amp.GradScaler(device)
    return torch.cuda.amp.GradScaler()  # PyTorch before 2.3


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def learning_rate(step, steps, peak):
    """Linear warm-up over WARMUP_FRACTION of the steps, then a cosine down to FINAL_LR_FRACTION."""
    warmup = max(1, int(WARMUP_FRACTION * steps))
    if step <= warmup:
        return peak * step / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return peak * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * done)))


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


# --- One run ---------------------------------------------------------------------------------------
class Progress:
    """A plain-text progress bar on stderr: on a terminal redrawn in place between evaluations and
    kept as a line at each; elsewhere (a log file) a line per evaluation."""

    def __init__(self, run, steps, stream=None):
        self.run, self.steps = run, steps
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()

    def line(self, step, loss, rate, val_loss):
        filled = int(30 * step / self.steps)
        return (f"{self.run:<26} [{'#' * filled}{'.' * (30 - filled)}] {step:>6}/{self.steps}  "
                f"loss {loss:6.3f}" + (f"  validation {val_loss:6.3f}" if val_loss is not None else " " * 19)
                + f"  {rate / 1e6:5.2f}M tokens/s")

    def show(self, step, loss, rate, val_loss=None):
        """val_loss: at an evaluation, which ends the line."""
        end = "\n" if val_loss is not None else ""
        if self.live or end:
            self.stream.write(("\r" if self.live else "") + self.line(step, loss, rate, val_loss) + end)
            self.stream.flush()


def evaluate(model, batches):
    model.eval()
    with torch.no_grad():
        total = sum(float(model.loss(x, y)) for x, y in batches)
    model.train()
    return total / len(batches)


def train_run(run, attend, corpus, steps, batch, eval_every, eval_batches, seed=0, lr=1e-3, progress=True):
    """Train one model on the corpus's device; (rows of FIELDS, tokens per second over every interval
    but the first)."""
    device = corpus["train"].device.type
    torch.manual_seed(seed)
    model = build_model(attend).to(device)
    opt, scaler = optimizer(model, lr), grad_scaler(device)
    generator = torch.Generator().manual_seed(seed)
    val = validation_batches(corpus["val"], batch, eval_batches)
    bar = Progress(run, steps) if progress else None
    rows = [{"step": 0, "run": run, "train_loss": None, "val_loss": evaluate(model, val), "tokens_per_s": None}]
    loss_sum, count, timed = torch.zeros((), device=device), 0, []
    synchronize(device)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        loss = model.loss(*training_batch(corpus["train"], batch, generator))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        scaler.step(opt)
        scaler.update()
        loss_sum += loss.detach()
        count += 1
        evaluated = step % eval_every == 0 or step == steps
        if evaluated:
            synchronize(device)
            seconds = time.perf_counter() - start
            timed.append((count * batch * CONTEXT, seconds))
            rows.append({"step": step, "run": run, "train_loss": float(loss_sum) / count,
                         "val_loss": evaluate(model, val), "tokens_per_s": count * batch * CONTEXT / seconds})
            loss_sum.zero_()
            count = 0
        if bar and evaluated:
            bar.show(step, rows[-1]["train_loss"], rows[-1]["tokens_per_s"], rows[-1]["val_loss"])
        elif bar and bar.live and step % PROGRESS_EVERY == 0:
            bar.show(step, float(loss_sum) / count, count * batch * CONTEXT / (time.perf_counter() - start))
        if evaluated:
            synchronize(device)
            start = time.perf_counter()
    steady = timed[1:] or timed
    return rows, sum(t for t, _ in steady) / sum(s for _, s in steady)


# --- Out: the CSV, the figure, the summary ---------------------------------------------------------------
def write_csv(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(FIELDS)
        for row in rows:
            writer.writerow(["" if row[k] is None else (f"{row[k]:.5g}" if isinstance(row[k], float) else row[k])
                             for k in FIELDS])


def plot(path, rows, title):
    """Every run's validation (solid) and training (dashed) losses against the step, and below them the
    difference of the validation losses (each later run minus the first), to path; None, or the
    one-line reason it was not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no figure (pip install matplotlib)"
    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig, (ax, below) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for i, run in enumerate(runs):
        mine = [r for r in rows if r["run"] == run]
        width = 4 if i == 0 else 1.5  # the first run drawn wide, so that the second shows on top of it
        line, = ax.plot([r["step"] for r in mine], [r["val_loss"] for r in mine], linewidth=width, alpha=0.7,
                        label=f"{run}: validation")
        trained = [r for r in mine if r["train_loss"] is not None]
        ax.plot([r["step"] for r in trained], [r["train_loss"] for r in trained], "--", linewidth=width,
                color=line.get_color(), alpha=0.5, label=f"{run}: training")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    first = {r["step"]: r["val_loss"] for r in rows if r["run"] == runs[0]}
    for run, line in zip(runs[1:], ax.get_lines()[2::2]):  # each run after the first, in its colour
        other = {r["step"]: r["val_loss"] for r in rows if r["run"] == run}
        steps = sorted(set(first) & set(other))
        below.plot(steps, [other[s] - first[s] for s in steps], marker=".", color=line.get_color(), label=run)
    below.axhline(0, color="grey", linewidth=0.8)
    below.set_xlabel("step")
    below.set_ylabel(f"validation loss,\nminus {runs[0]}'s", fontsize=8)
    below.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def summary_lines(results, chapter_runs):
    """Each run's final validation loss and tokens per second, and the difference of the final
    validation losses (each chapter minus SDPA)."""
    lines = [f"{run:<26} final validation loss {rows[-1]['val_loss']:.4f}, {rate / 1e6:.2f}M tokens/s"
             for run, (rows, rate) in results.items()]
    sdpa = results[SDPA_RUN][0][-1]["val_loss"]
    for run in chapter_runs:
        difference = results[run][0][-1]["val_loss"] - sdpa
        lines.append(f"difference of the final validation losses ({run} - {SDPA_RUN}): {difference:+.4f} "
                     f"({difference / sdpa:+.2%})")
    return lines


# --- Main -------------------------------------------------------------------------------------------
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chapter", default="07",
                        help="the forward's chapter: 07, 08, 08.3, ..., or several, 07,08 (default 07)")
    parser.add_argument("--backward", default="09", help="the backward's chapter (default 09)")
    parser.add_argument("--steps", type=int, help=f"training steps per run (default {DEFAULTS['steps']})")
    parser.add_argument("--batch", type=int, help=f"sequences of {CONTEXT} bytes per step (default {DEFAULTS['batch']})")
    parser.add_argument("--eval-every", type=int, help=f"steps between evaluations (default {DEFAULTS['eval_every']})")
    parser.add_argument("--eval-batches", type=int, help=f"validation batches (default {DEFAULTS['eval_batches']})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['steps']} steps, evaluated every {QUICK['eval_every']}; output under BUILD/train/")
    parser.add_argument("--out", help="the CSV (the figure beside it, .png); default docs/results/train/train_<build>.csv")
    parser.add_argument("--build", default="build", help="the build folder of the libraries (make's BUILD)")
    parser.add_argument("--make", default="make", help="the make command that builds the two libraries")
    parser.add_argument("--no-build", action="store_true", help="use the libraries already built")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("steps", "batch", "eval_every", "eval_batches"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} {getattr(args, key)}: must be at least 1")
    return args


def why_not_here():
    """The one-line reason no training runs here (no PyTorch, no CUDA GPU), or None."""
    if not torch_op.available():
        return "PyTorch not found (pip install torch): nothing trained"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU: nothing trained"
    return None


def build_libraries(args, names):
    """make the libraries the two runs load (a no-op when they are current); the exit code."""
    build = torch_op.build_dir(args.build)
    targets = [os.path.join(build, "lib", f"{name}.so") for name in names]
    cmd = shlex.split(args.make) + ["--no-print-directory", f"BUILD={build}"] + targets
    return subprocess.run(cmd, cwd=ROOT, env=make_env()).returncode


def output_path(args, forwards):
    if args.out:
        return args.out
    folder = os.path.join(torch_op.build_dir(args.build), "train") if args.quick else \
        os.path.join(ROOT, "docs", "results", "train")
    return os.path.join(folder, f"train_{'_'.join(forwards)}{'_quick' if args.quick else ''}.csv")


def load_refusal(names):
    """The one-line reason one of the libraries does not load (not built, another ABI), or None."""
    for name in names:
        try:
            torch_op.library(name)
        except (OSError, RuntimeError) as exc:
            return str(exc)
    return None


def gpu_refusal(names):
    """The one-line reason this GPU runs one of the libraries not, or None."""
    major, minor = torch.cuda.get_device_capability()
    for lib in [torch_op.library(name) for name in names]:
        if not lib.runs_on(major * 10 + minor):
            needs = runs_on({"min_sm": lib.min_sm, "max_sm": lib.max_sm})
            return f"{lib.name} runs on {needs}, this GPU is sm_{major}{minor}: nothing trained"
    return None


def main(argv=None):
    args = parse_args(argv)
    try:
        forwards = list(dict.fromkeys(torch_op.build_name(c) for c in args.chapter.split(",")))  # each once
        backward = torch_op.build_name(args.backward)
    except ValueError as exc:
        print(f"train.py: {exc}", file=sys.stderr)
        return 2
    reason = why_not_here()
    if reason:
        print(f"make train: skipped: {reason}")
        return 77
    names = list(dict.fromkeys(forwards + [backward]))
    if not args.no_build and build_libraries(args, names) != 0:
        print(f"train.py: building the libraries of {', '.join(names)} failed (output above)", file=sys.stderr)
        return 1
    os.environ["FA_BUILD"] = torch_op.build_dir(args.build)
    reason = load_refusal(names)
    if reason:
        print(f"train.py: {reason}", file=sys.stderr)
        return 1
    if not torch_op.library(backward).has_backward:
        print(f"train.py: --backward {args.backward}: {backward} has no backward pass", file=sys.stderr)
        return 2
    reason = gpu_refusal(names)
    if reason:
        print(f"make train: skipped: {reason}")
        return 77
    torch.set_float32_matmul_precision("high")  # TF32 for the fp32 matrix products, in both runs
    corpus = load_corpus("cuda")
    print(corpus["about"])
    print(f"model: {LAYERS} layers, {HEADS} heads of D = {HEAD_DIM}, context {CONTEXT}, "
          f"{parameter_count(build_model(sdpa_attention)) / 1e6:.1f}M parameters; {args.steps} steps of "
          f"{args.batch} x {CONTEXT} bytes, seed {args.seed}; GPU {torch.cuda.get_device_name()}")
    attends = {SDPA_RUN: sdpa_attention, **{forward: chapter_attention(forward, backward) for forward in forwards}}
    results = {run: train_run(run, attend, corpus, args.steps, args.batch, args.eval_every, args.eval_batches,
                              args.seed, args.lr) for run, attend in attends.items()}
    rows = [row for run_rows, _ in results.values() for row in run_rows]
    path = output_path(args, forwards)
    write_csv(path, rows)
    title = (f"{LAYERS}-layer GPT on the Python standard library's source, {args.steps} steps x {args.batch} x "
             f"{CONTEXT} bytes, seed {args.seed}: SDPA against {', '.join(forwards)} (backward {backward}), "
             f"{torch.cuda.get_device_name()}")
    figure = os.path.splitext(path)[0] + ".png"
    note = plot(figure, rows, title)
    for line in summary_lines(results, forwards):
        print(line)
    print(f"wrote {os.path.relpath(path)}" + (f" ({note})" if note else f" and its figure, {os.path.basename(figure)}"))
    finite = all(math.isfinite(r["val_loss"]) for r in rows)
    if not finite:
        print("train.py: a validation loss is not finite", file=sys.stderr)
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
