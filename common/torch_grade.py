#!/usr/bin/env python3
"""Exercise torch.op (`make exercise CH=torch`, `make grade CH=torch`): chapter 07's forward and 09's
backward as a PyTorch op of the student's own (the starting file: common/torch_exercise.py).

  torch_grade.py make [--force]                 exercises/torch/attention_op.py, a copy of the starting file
  torch_grade.py grade [FILE] [--build DIR]     grade FILE (default: that copy) on this GPU

The grade imports FILE with the op fa_tutorial::attention switched off (torch_op's forward_impl,
backward_impl and attention raise), so that the ops graded are the file's, then checks, at two
shapes (ragged N, both D, causal and not): O and LSE bitwise those of 07's library; dQ, dK, dV
through autograd bitwise those of 09's backward in its deterministic mode on that O and LSE, also
when autograd hands the backward a non-contiguous dO; torch.library.opcheck on both ops (schema,
fake tensors, autograd registration, AOT dispatch); torch.compile(fullgraph=True, backend
"aot_eager") of a loss through the op, bitwise as eager. One line per check, then PASS (exit 0) or
FAIL (exit 1); UNGRADED (exit 77) where no check can run: no PyTorch, no CUDA GPU, or one the
chapters do not run on.
"""
import argparse
import filecmp
import importlib.util
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_op  # noqa: E402

ROOT = os.path.dirname(HERE)
EXERCISE = "torch.op"
START = os.path.join(HERE, "torch_exercise.py")
COPY = os.path.join(ROOT, "exercises", "torch", "attention_op.py")
FORWARD, BACKWARD = "07", "09"
SHAPES = [(1, 2, 129, 64, True), (2, 3, 200, 128, False)]  # (B, H, N, D, causal)


def make_copy(force):
    """The student's copy of the starting file; 2 where one with edits is there and force is off."""
    if os.path.exists(COPY) and not force and not filecmp.cmp(COPY, START, shallow=False):
        print(f"make exercise CH=torch: {os.path.relpath(COPY, ROOT)} has your edits: left as it is "
              f"(FORCE=1 starts again from {os.path.relpath(START, ROOT)})", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(COPY), exist_ok=True)
    shutil.copyfile(START, COPY)
    print(f"wrote {os.path.relpath(COPY, ROOT)}: fill in its TODOs, then `make grade CH=torch`")
    return 0


def why_ungraded(torch):
    """The one-line reason nothing can be graded here, or None."""
    if torch is None:
        return "PyTorch not found (pip install torch)"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA GPU"
    return torch_op.gpu_refusal((FORWARD, BACKWARD))


def switch_off_the_reference_op():
    """torch_op's own op raises from here on (torch.ops.fa_tutorial.attention and torch_op.attention)."""
    def refuse(*args, **kwargs):
        raise RuntimeError(f"fa_tutorial::attention is switched off while {EXERCISE} is graded: the ops must be "
                           f"the exercise's, calling torch_op.run_forward and run_backward")
    torch_op.forward_impl = torch_op.backward_impl = torch_op.attention = refuse


def load(path):
    spec = importlib.util.spec_from_file_location("torch_op_exercise", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch.compile looks a function's module up by name when it inlines it
    spec.loader.exec_module(module)
    return module


def scale_of(d):
    return 1.0 / d ** 0.5  # as the exercise's attention() computes it


def inputs(torch, b, h, n, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, device="cuda", dtype=torch.float16) for _ in range(4)]


def reference(torch, q, k, v, do, causal, scale):
    """O, LSE of 07's library, and dQ, dK, dV of 09's deterministic backward on them."""
    o, lse = torch_op.run_forward(torch_op.library(FORWARD), q, k, v, causal, scale)
    grads = torch_op.run_backward(torch_op.library(BACKWARD), q, k, v, o, lse, do, causal, scale, True)
    return o, lse, grads


def differ(names, got, want):
    """The names of the tensors of got that are not bitwise those of want."""
    return [n for n, x, y in zip(names, got, want) if x.shape != y.shape or x.dtype != y.dtype or not x.equal(y)]


def check_forward(torch, module, shape):
    b, h, n, d, causal = shape
    q, k, v, do = inputs(torch, b, h, n, d, seed=1)
    o, lse = module.attention_op(q, k, v, causal, scale_of(d))
    want_o, want_lse, _ = reference(torch, q, k, v, do, causal, scale_of(d))
    wrong = differ(("O", "LSE"), (o, lse), (want_o, want_lse))
    return f"{', '.join(wrong)} not bitwise 07's" if wrong else None


def gradients(torch, module, q, k, v, do, causal, transposed):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = module.attention(*leaves, causal=causal)
    if transposed:  # dO's values laid out [B, N, H, D]: autograd hands the backward that layout
        do = do.transpose(1, 2).contiguous().transpose(1, 2)
    (o.float() * do.float()).sum().backward()
    return [x.grad for x in leaves]


def check_gradients(torch, module, shape, transposed=False):
    b, h, n, d, causal = shape
    q, k, v, do = inputs(torch, b, h, n, d, seed=2)
    got = gradients(torch, module, q, k, v, do, causal, transposed)
    if any(g is None for g in got):
        return "a gradient of q, k or v is None: is the autograd formula registered?"
    wrong = differ(("dQ", "dK", "dV"), got, reference(torch, q, k, v, do, causal, scale_of(d))[2])
    return f"{', '.join(wrong)} not bitwise 09's (deterministic) on 07's O and LSE" if wrong else None


def check_opcheck(torch, module, shape):
    b, h, n, d, causal = shape
    q, k, v, do = inputs(torch, b, h, n, d, seed=3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(module.attention_op, (*leaves, causal, scale_of(d)))
    o, lse = module.attention_op(q, k, v, causal, scale_of(d))
    torch.library.opcheck(module.attention_backward_op, (q, k, v, o, lse, do, causal, scale_of(d)))
    return None


def check_compile(torch, module, shape):
    b, h, n, d, causal = shape
    q, k, v, do = inputs(torch, b, h, n, d, seed=4)

    def loss(q, k, v):
        o = module.attention(q, k, v, causal=causal)
        return o, (o.float() * do.float()).sum()
    results = []
    for fn in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, total = fn(*leaves)
        total.backward()
        results.append([o.detach()] + [x.grad for x in leaves])
    wrong = differ(("O", "dQ", "dK", "dV"), results[1], results[0])
    return f"compiled {', '.join(wrong)} differ from eager" if wrong else None


def checks(shapes):
    """(name, function) of every check."""
    out = []
    for shape in shapes:
        b, h, n, d, causal = shape
        shown = f"B={b} H={h} N={n} D={d}{' causal' if causal else ''}"
        out += [(f"forward {shown}", lambda t, m, s=shape: check_forward(t, m, s)),
                (f"gradients {shown}", lambda t, m, s=shape: check_gradients(t, m, s)),
                (f"gradients, dO not contiguous, {shown}", lambda t, m, s=shape: check_gradients(t, m, s, True)),
                (f"opcheck {shown}", lambda t, m, s=shape: check_opcheck(t, m, s))]
    return out + [(f"torch.compile, {'causal' if shapes[0][4] else 'not causal'}",
                   lambda t, m, s=shapes[0]: check_compile(t, m, s))]


def last_line(exc):
    """What went wrong, in one line: the exception's first line (and its last, where they differ)."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    said = text[0] + (f" ... {text[-1]}" if len(text) > 1 else "") if text else ""
    return f"{type(exc).__name__}: {said}"


def grade(path, build):
    torch = torch_op.torch
    os.environ["FA_BUILD"] = torch_op.build_dir(build)
    try:
        reason = why_ungraded(torch)
    except (OSError, RuntimeError) as exc:  # a library not built
        print(f"torch_grade.py: {exc}", file=sys.stderr)
        return 1
    if reason:
        print(f"UNGRADED {EXERCISE}: {reason}")
        return 77
    if not os.path.exists(path):
        print(f"torch_grade.py: {path} not found (make exercise CH=torch writes it)", file=sys.stderr)
        return 2
    switch_off_the_reference_op()
    try:
        module = load(path)
    except Exception as exc:  # the student's file: anything may go wrong on import
        print(f"FAIL {EXERCISE}: {os.path.relpath(path)} does not import: {last_line(exc)}")
        return 1
    failed, graded = [], checks(SHAPES)
    for name, check in graded:
        try:
            problem = check(torch, module)
        except Exception as exc:  # a TODO, a wrong call: the check fails and says why
            problem = last_line(exc)
        print(f"  {'FAIL' if problem else 'ok  '} {name}" + (f": {problem}" if problem else ""))
        if problem:
            failed.append(name)
    if failed:
        print(f"FAIL {EXERCISE}: {len(failed)} of {len(graded)} checks failed ({failed[0]}"
              f"{', ...' if len(failed) > 1 else ''})")
        return 1
    print(f"PASS {EXERCISE}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("make")
    made.add_argument("--force", action="store_true")
    graded = sub.add_parser("grade")
    graded.add_argument("file", nargs="?", default=COPY)
    graded.add_argument("--build", default="build")
    args = parser.parse_args(argv)
    if args.command == "make":
        return make_copy(args.force)
    return grade(os.path.abspath(args.file), args.build)


if __name__ == "__main__":
    sys.exit(main())
