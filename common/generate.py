#!/usr/bin/env python3
"""`make generate`: a model that `make train` trained writes text. The prompt goes through a forward
chapter (07: its causal forward over the prompt's tokens), and every next token through 11's decoding
(one `torch_op.DecodePlan` for the whole generation, whose run at each layer appends the token's K
and V to its page and decodes) against a paged KV cache: per layer, pools of pages of P tokens and a block table
that gives the sequence its pages in a shuffled order of the pool. Beside it, the same model on
PyTorch's SDPA with a contiguous cache, on the backend PyTorch picks and on each of flash, cuDNN and
memory-efficient forced. Greedy decoding: each chooses the most likely next byte.

  generate.py [--model PT] [--prompt TEXT] [--tokens N] [--chapter 07] [--decode 11] [--page-size P]
              [--build DIR] [--make CMD] [--no-build]

It prints the text the chapters wrote and the text SDPA wrote on the backend PyTorch picks, whether
each SDPA run chose the same tokens as the chapters (where one did not, the two logits each run
chose between at the first difference, against the rounding of fp16 at their size), and each one's
decoding rate in tokens per second (the prompt excluded), timed on a second pass of the whole
generation. The first pass's rate is printed beside it (a cache length's first call pays for module
loads and, on some backends, a plan for that shape); it depends on the order of the runs, since a
later one may reuse what an earlier one loaded or planned: only the timed rate compares. Without PyTorch or a CUDA
GPU it says so in one line and exits 77, as `make train` does.
"""
import argparse
import contextlib
import glob
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_op  # noqa: E402  (imports without PyTorch)
import train  # noqa: E402  (the model: build_model, its shape)

torch = torch_op.torch
ROOT = os.path.dirname(HERE)
PROMPT = "def main(argv=None):\n    "
FP16_STEP = 2.0 ** -10  # fp16's relative rounding step (10 bits of mantissa)


# --- The KV caches -----------------------------------------------------------------------------------
class PagedCache:
    """Per layer, K and V pools [pages, H, P, D] fp16, and one block table [1, pages] int32 naming the
    sequence's pages in a shuffled order of the pool: token t is row t % P of page table[t // P]. The
    prompt's K and V are written by a scatter (write); each new token's, layer by layer, by the run
    that attends with it (step: one DecodePlan for the whole generation, made at the first step's
    first layer for the cache's capacity, CONTEXT tokens; it reads each step's length from the
    lengths tensor that begin fills; its run appends the token's K and V to its page, then decodes)."""

    def __init__(self, layers, page_size, device, seed=0):
        pages = -(-train.CONTEXT // page_size)
        shape = (pages, train.HEADS, page_size, train.HEAD_DIM)
        self.k = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(layers)]
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
        self.table = order.to(torch.int32).view(1, pages).to(device)
        self.lengths = torch.zeros(1, dtype=torch.int32, device=device)
        self.page_size = page_size
        self.plan = None  # made at the first step, for every step after it
        self.where = None  # the pages and rows of the positions begin named, found by the first write

    def begin(self, start, count):
        """The next writes are of positions start .. start + count - 1; the cache then holds start + count
        tokens."""
        self.start, self.length = start, start + count
        self.lengths.fill_(self.length)
        self.where = None

    def write(self, layer, k, v):
        """k, v [1, H, count, D] into their pages (the prompt's: a scatter)."""
        if self.where is None:  # once for all the layers
            positions = torch.arange(self.start, self.length, device=self.table.device)
            self.where = (self.table[0, positions // self.page_size].long(), positions % self.page_size)
        pages, rows = self.where
        self.k[layer][pages, :, rows] = k[0].transpose(0, 1)  # [count, H, D]
        self.v[layer][pages, :, rows] = v[0].transpose(0, 1)

    def step(self, layer, q, k, v, chapter):
        """The new token's k, v [1, H, 1, D] appended to its page, then q's attention over the cache."""
        if self.plan is None:  # planned for the longest cache, so that no later step plans again
            self.plan = torch_op.DecodePlan(q, self.k[layer], self.v[layer], self.table, self.lengths, train.CONTEXT,
                                            chapter=chapter)
        o, _ = self.plan.run(q, self.k[layer], self.v[layer], k_new=k, v_new=v)
        return o


class ContiguousCache:
    """Per layer, K and V [1, H, CONTEXT, D] fp16: SDPA's side."""

    def __init__(self, layers, device):
        shape = (1, train.HEADS, train.CONTEXT, train.HEAD_DIM)
        self.k = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(layers)]

    def begin(self, start, count):
        self.start, self.length = start, start + count

    def write(self, layer, k, v):
        self.k[layer][:, :, self.start:self.length] = k
        self.v[layer][:, :, self.start:self.length] = v

    def step(self, layer, q, k, v, chapter=None):
        """The new token's k, v [1, H, 1, D] written, then q's attention over the cache by SDPA."""
        self.write(layer, k, v)
        k, v = self.k[layer][:, :, :self.length], self.v[layer][:, :, :self.length]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)  # one query: it sees every key


def sdpa_prompt(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def on_backend(backend):
    """A context in which SDPA runs on backend (an SDPBackend), or, None, on the one PyTorch picks."""
    return contextlib.nullcontext() if backend is None else torch.nn.attention.sdpa_kernel(backend)


def sdpa_backends():
    """[(name, backend)]: the one PyTorch picks, then each backend that decodes on its own: a backend
    may be slow at one shape and not another (cuDNN plans a graph for each new cache length)."""
    named = torch.nn.attention.SDPBackend
    return [("SDPA", None), ("SDPA flash", named.FLASH_ATTENTION), ("SDPA cuDNN", named.CUDNN_ATTENTION),
            ("SDPA efficient", named.EFFICIENT_ATTENTION)]


# --- The model, a step at a time --------------------------------------------------------------------------
def logits_of(model, tokens, start, attend):
    """The logits [n, VOCAB] of tokens (a [1, n] tensor) at positions start.., each layer's attention
    given by attend(layer, q, k, v) (which also caches k and v)."""
    x = model.tokens(tokens) + model.positions(torch.arange(start, start + tokens.shape[1], device=tokens.device))
    for layer, block in enumerate(model.blocks):
        q, k, v = block.attn.heads(block.norm1(x))
        x = x + block.attn.merge(attend(layer, q, k, v))
        x = x + block.mlp(block.norm2(x))
    return (model.norm(x) @ model.tokens.weight.t())[0]


def generate(model, prompt, count, cache, prompt_attend, chapter=None):
    """Greedy decoding: (every token, the logits [VOCAB] each new one was chosen from, the seconds the
    new tokens took after the prompt's). The prompt's K and V go into the cache, its attention through
    prompt_attend(q, k, v) (causal); each new token's through cache.step (which writes its K and V too)."""
    device = model.tokens.weight.device
    tokens = list(prompt)

    def prompt_layer(layer, q, k, v):
        cache.write(layer, k, v)
        return prompt_attend(q, k, v)

    def step_layer(layer, q, k, v):
        return cache.step(layer, q, k, v, chapter)

    with torch.no_grad():
        cache.begin(0, len(tokens))
        logits = logits_of(model, torch.tensor([tokens], device=device), 0, prompt_layer)[-1]
        torch.cuda.synchronize(device)
        start, chosen = time.perf_counter(), []
        while len(chosen) < count and len(tokens) < train.CONTEXT:
            chosen.append(logits.float())
            tokens.append(int(logits.argmax()))
            cache.begin(len(tokens) - 1, 1)  # the new token's K and V, then its attention over them all
            logits = logits_of(model, torch.tensor([[tokens[-1]]], device=device), len(tokens) - 1, step_layer)[-1]
        torch.cuda.synchronize(device)
    return tokens, chosen, time.perf_counter() - start


def first_difference(ours, theirs, our_logits, their_logits, prompt_length):
    """None where the two chose the same tokens; else the words for the first new token they differ in:
    the logits of both choices in both runs, and their gap against fp16's rounding at their size."""
    for i, (a, b) in enumerate(zip(ours[prompt_length:], theirs[prompt_length:])):
        if a != b:
            mine, sdpa = our_logits[i], their_logits[i]
            size = float(max(abs(mine[a]), abs(mine[b]), abs(sdpa[a]), abs(sdpa[b])))
            gap = abs(float(mine[a] - mine[b]))
            return (f"token {i + 1}: the chapter chose byte {a} ({float(mine[a]):.4f}) over {b} ({float(mine[b]):.4f}), "
                    f"SDPA {b} ({float(sdpa[b]):.4f}) over {a} ({float(sdpa[a]):.4f}); the chapter's gap {gap:.2e}, "
                    f"{gap / (size * FP16_STEP):.1f} fp16 rounding steps at their size ({size * FP16_STEP:.1e}; a "
                    f"yardstick, not a bound: the logits are fp32, the attention's output fp16)")
    return None


def shown(tokens):
    return bytes(tokens).decode("utf-8", errors="replace")


# --- The command line ---------------------------------------------------------------------------------------
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model make train saved (default: the newest in BUILD/train/models)")
    parser.add_argument("--prompt", default=PROMPT, help="the text to continue (bytes are the tokens)")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens (default 200; the context is 512)")
    parser.add_argument("--chapter", default="07", help="the forward chapter of the prompt (default 07)")
    parser.add_argument("--decode", default="11", help="the decoding chapter of every next token (default 11)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page of the cache (default 16)")
    parser.add_argument("--build", default="build", help="the build folder of the libraries (make's BUILD)")
    parser.add_argument("--make", default="make", help="the make command that builds the libraries")
    parser.add_argument("--no-build", action="store_true", help="use the libraries already built")
    args = parser.parse_args(argv)
    if not 1 <= args.tokens or not 1 <= args.page_size <= 256 or not args.prompt.encode():
        parser.error("--tokens at least 1, --page-size 1 to 256, --prompt at least one byte")
    return args


def newest_model(build):
    found = sorted(glob.glob(os.path.join(torch_op.build_dir(build), "train", "models", "*.pt")), key=os.path.getmtime)
    return found[-1] if found else None


def load_model(path, device):
    saved = torch.load(path, map_location=device, weights_only=True)
    model = train.build_model(None).to(device)
    model.load_state_dict(saved["state"])
    return model.eval(), saved


def main(argv=None):
    args = parse_args(argv)
    reason = train.why_not_here()
    if reason:
        print(f"make generate: skipped: {reason.replace('nothing trained', 'nothing generated')}")
        return 77
    path = args.model or newest_model(args.build)
    if not path or not os.path.isfile(path):
        print(f"generate.py: no model{' ' + path if path else ''}: run make train first (it saves each run's "
              f"model in {os.path.relpath(os.path.join(torch_op.build_dir(args.build), 'train', 'models'), ROOT)})",
              file=sys.stderr)
        return 2
    try:
        names = [torch_op.build_name(args.chapter), torch_op.build_name(args.decode)]
    except ValueError as exc:
        print(f"generate.py: {exc}", file=sys.stderr)
        return 2
    if not args.no_build and train.build_libraries(args, names) != 0:
        print(f"generate.py: building the libraries of {', '.join(names)} failed (output above)", file=sys.stderr)
        return 1
    os.environ["FA_BUILD"] = torch_op.build_dir(args.build)
    reason = train.load_refusal(names)
    if reason:
        print(f"generate.py: {reason}", file=sys.stderr)
        return 1
    if not torch_op.library(names[1]).has_decode:
        print(f"generate.py: --decode {args.decode}: {names[1]} has no decoding pass (11_decode has)", file=sys.stderr)
        return 2
    reason = torch_op.gpu_refusal(names)
    if reason:
        print(f"make generate: skipped: {reason}: nothing generated")
        return 77
    torch.set_float32_matmul_precision("high")  # as the model was trained
    model, saved = load_model(path, "cuda")
    prompt = list(args.prompt.encode())[:train.CONTEXT - 1]
    print(f"model {os.path.relpath(path, ROOT)}: trained with {saved['run']}, seed {saved['seed']}, "
          f"{saved['steps']} steps; GPU {torch.cuda.get_device_name()}")

    def chapter_prompt(q, k, v):
        return torch_op.attention(q, k, v, causal=True, chapter=args.chapter, backward=None)

    layers = len(model.blocks)

    def twice(cache, attend, chapter=None):
        """The whole generation untimed (every cache length's first call: module loads, a backend's plans),
        then again, timed: (the timed run, the first run's tokens/s)."""
        first = generate(model, prompt, args.tokens, cache(), attend, chapter)
        timed = generate(model, prompt, args.tokens, cache(), attend, chapter)
        return timed, (len(first[0]) - len(prompt)) / first[2]

    ours, ours_first = twice(lambda: PagedCache(layers, args.page_size, "cuda"), chapter_prompt, args.decode)
    new = len(ours[0]) - len(prompt)
    print(f"--- {names[0]} (the prompt), then {names[1]} (every next token; pages of {args.page_size}):")
    print(shown(ours[0]))
    rates = [f"{names[1]} {new / ours[2]:.0f} (first pass {ours_first:.0f})"]
    for name, backend in sdpa_backends():
        try:
            with on_backend(backend):
                theirs, theirs_first = twice(lambda: ContiguousCache(layers, "cuda"), sdpa_prompt)
        except RuntimeError as exc:  # a forced backend that has no kernel for this shape here; anything else is raised
            if backend is None or "No available kernel" not in str(exc):
                raise
            rates.append(f"{name}: no kernel for this shape here")
            continue
        rates.append(f"{name} {new / theirs[2]:.0f} (first pass {theirs_first:.0f})")
        if backend is None:
            print(f"--- {name} (contiguous cache):")
            print(shown(theirs[0]))
            print("---")
        difference = first_difference(ours[0], theirs[0], ours[1], theirs[1], len(prompt))
        print(f"{name}: the same {new} tokens" if difference is None else f"{name}: they differ first at {difference}")
    print(f"decoding, tokens/s: {', '.join(rates)} (one sequence, {new} tokens after a prompt of {len(prompt)}; the "
          "whole model's step, Python and launches included; each timed after a whole untimed pass)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
