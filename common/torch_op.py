"""A chapter as a PyTorch op: BUILD/lib/<build>.so (`make lib`, common/library.h) loaded with ctypes
and registered as torch.ops.fa_tutorial.attention, with a fake implementation (torch.compile,
torch.export) and an autograd formula whose backward is 09's.

    import torch_op                                    # common/ on sys.path
    o = torch_op.attention(q, k, v, causal=True, chapter="07", backward="09")
    o = torch_op.attention(q, k, v, causal=True, deterministic=True)  # repeatable gradients

q, k, v: torch.float16 CUDA tensors [B, H, N, D], contiguous, D = 64 or 128, one shape for all
three (self-attention). backward="auto" (the default) is the fastest backward this GPU runs:
the latest chapter with a backward pass whose library is built and runs here, leaving out one
not yet faster than the chapter before it (NOT_YET_FASTER; auto_backward). The op runs on
torch.cuda.current_stream(), takes its workspace from PyTorch's allocator and returns O (fp16, [B, H, N, D]); return_lse=True also returns the LSE
(fp32, [B, H, N], natural log), which is not differentiable. A chapter is named as the Makefile
names it: 7, 07 or 07_async_pipeline; a step of 08 as 08.3 or 08_fp8.step3 (08.5 is 08_fp8).
deterministic=True runs the backward in its deterministic mode (fa_backward's `deterministic`): dQ,
dK, dV bitwise the same on every call with the same inputs. It is a mode of the backward chapter's
library, not a build: '09.deterministic' names nothing, and says so.

What the op refuses, and why:
  - TypeError: a dtype other than torch.float16 (the kernels read fp16; a cast is the caller's).
  - ValueError: a tensor off CUDA, on two devices, not 4-dimensional, shapes that differ, D not
    64 or 128, a non-contiguous tensor, data not 16-byte aligned. A non-contiguous q, k or v is
    refused rather than copied: the kernels index [B, H, N, D] with D fastest, and a copy moves
    every byte once more; the op leaves that copy, and its cost, where the caller can see it
    (`.contiguous()`). The gradient dO is the exception: autograd, not the caller, makes it, so
    the backward makes it contiguous itself.
  - FileNotFoundError: the chapter's library is not built (make lib).
  - LibraryError (a RuntimeError): a call the library answered with a code other than FA_OK,
    with fa_last_error()'s line (the shape rules of common/shape.h, no GPU, a GPU the chapter
    does not run on, a CUDA error).

The backward. fa_backward takes "the O and LSE that this library's fa_forward made", because it
recomputes P = exp(S * scale - LSE) from them and D = rowsum(dO * O). The forward may be another
chapter's; what decides is how close its O and LSE are to the exact ones, which the chapter's
precision (fa_precision) says:
  - fp32 (01-05) and fp16 tensor-core (06, 07, 09, 08.1-08.3) chapters meet the tolerances 09's
    own forward meets (rel L2 of O <= 3e-3 or better, LSE within 1e-3: docs/design.md,
    "Tolerances"); 07's forward is 09's, copied. Their O and LSE are the same math within the
    rounding 09's forward has itself, and the backward uses them as they are.
  - FP8 chapters (08.4, 08_fp8) are not: their O is up to 6e-2 off on N(0, 1) inputs, and that
    error would enter D and, through the LSE, P, giving gradients of neither the FP8 function nor
    exact attention. For them the backward first recomputes O and LSE with the backward chapter's
    own forward (one extra forward pass), then runs its backward: the gradient is that of exact
    attention at the fp16 inputs, the straight-through rule of FP8 training, computed in fp16.

Importing this module needs no PyTorch (nor a GPU): available() says whether the op is usable,
and attention() raises ImportError in one line where PyTorch is missing. Library (the ctypes
binding) needs neither PyTorch nor a GPU to load a library and ask it about itself.
"""
import ctypes
import functools
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from chapters import has_backward, read_steps, runs_on  # noqa: E402
from runner import chapters, find_chapter  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

ROOT = os.path.dirname(HERE)
NAMESPACE = "fa_tutorial"
HEAD_DIMS = (64, 128)
ABI_VERSION = 4  # common/library.h's FA_ABI_VERSION
ALIGNMENT = 16   # bytes, FA_ALIGNMENT
# common/library.h's return codes and precisions (tests/test_torch_op.py checks them against it).
(FA_OK, FA_ERR_INVALID_ARGUMENT, FA_ERR_NO_BACKWARD, FA_ERR_NO_GPU, FA_ERR_UNSUPPORTED_GPU, FA_ERR_CUDA,
 FA_ERR_NO_DECODE) = range(7)
CODE_NAMES = {FA_OK: "FA_OK", FA_ERR_INVALID_ARGUMENT: "FA_ERR_INVALID_ARGUMENT", FA_ERR_NO_BACKWARD: "FA_ERR_NO_BACKWARD",
              FA_ERR_NO_GPU: "FA_ERR_NO_GPU", FA_ERR_UNSUPPORTED_GPU: "FA_ERR_UNSUPPORTED_GPU", FA_ERR_CUDA: "FA_ERR_CUDA",
              FA_ERR_NO_DECODE: "FA_ERR_NO_DECODE"}
FA_PRECISION_FP32, FA_PRECISION_FP16_TC, FA_PRECISION_FP8_TC = range(3)
NO_TORCH = "PyTorch is not installed (pip install torch): the chapters' PyTorch op needs it"


def available():
    """Whether the op can be used here: PyTorch imports (a GPU is the call's business)."""
    return torch is not None


def require_torch():
    if torch is None:
        raise ImportError(NO_TORCH)


# --- Which library ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def build_name(chapter):
    """The build a chapter argument names, as `make lib` names its library: '7', '07' and
    '07_async_pipeline' -> '07_async_pipeline'; '08.3' and '08_fp8.step3' -> '08_fp8.step3' (the last
    step, '08.6', is the chapter, '08_fp8'). Any other name after the dot is refused: '09.deterministic'
    with a pointer to deterministic=True, the backward's run-time mode."""
    text = str(chapter).strip()
    head, _, tail = text.partition(".")
    folder = find_chapter(head) if head else None
    if folder is None:
        raise ValueError(f"chapter {chapter!r}: no such chapter (name one as 7, 07 or 07_async_pipeline; "
                         f"chapters: {', '.join(chapters())})")
    if not tail:
        return folder
    step = tail[len("step"):] if tail.startswith("step") else tail
    if not step.isdigit():
        mode = "; determinism is a run-time mode of the backward: pass deterministic=True" \
            if tail == "deterministic" else ""
        raise ValueError(f"chapter {chapter!r}: {folder} has no build {tail!r} (a step is named as "
                         f"{folder[:2]}.K){mode}")
    numbers = [s["step"] for s in read_steps(os.path.join(ROOT, folder, "attention.cu"))]
    if not numbers:
        raise ValueError(f"chapter {chapter!r}: {folder} is not built in steps")
    if int(step) not in numbers:
        raise ValueError(f"chapter {chapter!r}: {folder}'s steps are {folder[:2]}.{numbers[0]} ... "
                         f"{folder[:2]}.{numbers[-1]}")
    return folder if int(step) == numbers[-1] else f"{folder}.step{int(step)}"


def build_dir(build=None):
    """The build folder: `build`, else $FA_BUILD, else build/ (make's default BUILD); a relative
    path is taken from the repository's root, where make runs."""
    folder = build or os.environ.get("FA_BUILD") or "build"
    return folder if os.path.isabs(folder) else os.path.join(ROOT, folder)


def library_path(chapter, build=None):
    return os.path.join(build_dir(build), "lib", build_name(chapter) + ".so")


# --- The C ABI through ctypes (no PyTorch) -----------------------------------------------------------
class FaShape(ctypes.Structure):
    """common/shape.h's AttnShape (library.h's FaShape): six 4-byte fields, in this order."""
    _fields_ = [("batch", ctypes.c_int), ("heads", ctypes.c_int), ("seqlen", ctypes.c_int),
                ("headdim", ctypes.c_int), ("causal", ctypes.c_int), ("scale", ctypes.c_float)]


class FaDecodeShape(ctypes.Structure):
    """common/shape.h's DecodeShape (library.h's FaDecodeShape): its fields in this order, 40 bytes."""
    _fields_ = [("batch", ctypes.c_int), ("q_heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("new_tokens", ctypes.c_int), ("headdim", ctypes.c_int), ("page_size", ctypes.c_int),
                ("pages", ctypes.c_longlong), ("max_pages", ctypes.c_int), ("scale", ctypes.c_float)]


class LibraryError(RuntimeError):
    """A library call answered a code other than FA_OK; the message is its fa_last_error() line."""

    def __init__(self, code, message):
        super().__init__(f"{message} ({CODE_NAMES.get(code, f'code {code}')})")
        self.code = code


POINTER = ctypes.c_void_p
SIGNATURES = {  # name: (restype, argtypes), as common/library.h declares them
    "fa_abi_version": (ctypes.c_int, []), "fa_chapter_name": (ctypes.c_char_p, []),
    "fa_precision": (ctypes.c_int, []), "fa_has_backward": (ctypes.c_int, []),
    "fa_min_sm": (ctypes.c_int, []), "fa_max_sm": (ctypes.c_int, []), "fa_last_error": (ctypes.c_char_p, []),
    "fa_workspace_bytes": (ctypes.c_int, [ctypes.POINTER(FaShape), ctypes.POINTER(ctypes.c_size_t)]),
    "fa_backward_workspace_bytes": (ctypes.c_int, [ctypes.POINTER(FaShape), ctypes.c_int,
                                                   ctypes.POINTER(ctypes.c_size_t)]),
    "fa_forward": (ctypes.c_int, [ctypes.POINTER(FaShape)] + [POINTER] * 6 + [ctypes.c_size_t, POINTER]),
    "fa_backward": (ctypes.c_int, [ctypes.POINTER(FaShape), ctypes.c_int] + [POINTER] * 10
                    + [ctypes.c_size_t, POINTER]),
    "fa_has_decode": (ctypes.c_int, []),
    "fa_decode_workspace_bytes": (ctypes.c_int, [ctypes.POINTER(FaDecodeShape), ctypes.c_int,
                                                 ctypes.POINTER(ctypes.c_size_t)]),
    "fa_decode": (ctypes.c_int, [ctypes.POINTER(FaDecodeShape), ctypes.c_int] + [POINTER] * 8
                  + [ctypes.c_size_t, POINTER]),
    "fa_decode_append": (ctypes.c_int, [ctypes.POINTER(FaDecodeShape)] + [POINTER] * 7),
}


def make_shape(batch, heads, seqlen, headdim, causal, scale):
    return FaShape(int(batch), int(heads), int(seqlen), int(headdim), int(bool(causal)), float(scale))


class Library:
    """One chapter's library: what it says about itself, and its calls on device pointers (ints)."""

    def __init__(self, path):
        if not os.path.isfile(path):
            default = os.path.dirname(os.path.abspath(path)) == os.path.join(ROOT, "build", "lib")
            shown = os.path.relpath(path, ROOT) if default else path
            how = "`make lib` (this one alone: `make {}`)".format(shown) if default else \
                "`make lib BUILD={}`".format(os.path.dirname(os.path.dirname(path)))
            raise FileNotFoundError(f"{shown} not found: build the chapters' libraries with {how}")
        self.path = path
        self.dll = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)  # every library exports the same names
        for name, (restype, argtypes) in SIGNATURES.items():
            function = getattr(self.dll, name)
            function.restype, function.argtypes = restype, argtypes
        if self.dll.fa_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI version {self.dll.fa_abi_version()}, this module speaks {ABI_VERSION}: "
                               f"rebuild it with `make lib`")
        self.name = self.dll.fa_chapter_name().decode()
        self.precision = self.dll.fa_precision()
        self.has_backward = bool(self.dll.fa_has_backward())
        self.has_decode = bool(self.dll.fa_has_decode())
        self.min_sm, self.max_sm = self.dll.fa_min_sm(), self.dll.fa_max_sm()

    def runs_on(self, sm):
        """Whether the chapter runs on compute capability sm (e.g. 90 for sm_90)."""
        return sm >= self.min_sm and (self.max_sm == 0 or sm <= self.max_sm)

    def check(self, code):
        if code != FA_OK:
            raise LibraryError(code, self.dll.fa_last_error().decode(errors="replace"))

    def workspace_bytes(self, shape):
        size = ctypes.c_size_t(0)
        self.check(self.dll.fa_workspace_bytes(ctypes.byref(shape), ctypes.byref(size)))
        return size.value

    def backward_workspace_bytes(self, shape, deterministic=False):
        size = ctypes.c_size_t(0)
        self.check(self.dll.fa_backward_workspace_bytes(ctypes.byref(shape), int(bool(deterministic)),
                                                        ctypes.byref(size)))
        return size.value

    def forward(self, shape, q, k, v, o, lse, workspace, workspace_bytes, stream):
        self.check(self.dll.fa_forward(ctypes.byref(shape), q, k, v, o, lse, workspace, workspace_bytes, stream))

    def backward(self, shape, deterministic, q, k, v, o, lse, d_o, dq, dk, dv, workspace, workspace_bytes, stream):
        self.check(self.dll.fa_backward(ctypes.byref(shape), int(bool(deterministic)), q, k, v, o, lse, d_o, dq, dk,
                                        dv, workspace, workspace_bytes, stream))

    def decode_workspace_bytes(self, shape, max_length):
        size = ctypes.c_size_t(0)
        self.check(self.dll.fa_decode_workspace_bytes(ctypes.byref(shape), int(max_length), ctypes.byref(size)))
        return size.value

    def decode_append(self, shape, k_new, v_new, block_table, lengths, k_pool, v_pool, stream):
        self.check(self.dll.fa_decode_append(ctypes.byref(shape), k_new, v_new, block_table, lengths, k_pool, v_pool,
                                             stream))

    def decode(self, shape, max_length, q, k_pool, v_pool, block_table, lengths, o, lse, workspace, workspace_bytes,
               stream):
        self.check(self.dll.fa_decode(ctypes.byref(shape), int(max_length), q, k_pool, v_pool, block_table, lengths, o,
                                      lse, workspace, workspace_bytes, stream))


@functools.lru_cache(maxsize=None)
def load_path(path):
    return Library(path)


def library(chapter, build=None):
    """The chapter's Library, loaded once per path."""
    return load_path(library_path(chapter, build))


def gpu_refusal(names):
    """The one-line reason the current CUDA GPU runs one of these chapters' libraries not, or None."""
    major, minor = torch.cuda.get_device_capability()
    for lib in [library(name) for name in names]:
        if not lib.runs_on(major * 10 + minor):
            return f"{lib.name} runs on {runs_on({'min_sm': lib.min_sm, 'max_sm': lib.max_sm})}, this GPU is sm_{major}{minor}"
    return None


# --- The checks of the tensors (PyTorch) -----------------------------------------------------------
def check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}: expected a torch.Tensor")
    if t.dtype != torch.float16:
        raise TypeError(f"{name} is {t.dtype}: the chapters take torch.float16 (cast with .half(); "
                        f"the op does not cast behind the caller's back)")
    if t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}: the chapters run on a CUDA device (move it with .cuda())")
    if t.dim() != 4:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: expected [B, H, N, D] (4 dimensions)")


def check_contiguous(name, t):
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}): the kernels "
                         f"read [B, H, N, D] with D fastest; pass {name}.contiguous() (the op does not copy "
                         f"behind the caller's back)")


def check_inputs(**tensors):
    """q, k, v (and, for the backward, o, d_o): fp16 CUDA [B, H, N, D], one shape and device,
    D 64 or 128, contiguous. No data is read: the fake implementation runs it too."""
    for name, t in tensors.items():
        check_tensor(name, t)
    (first, q), *others = tensors.items()
    for name, t in others:
        if t.shape != q.shape:
            shapes = ", ".join(f"{n} {tuple(x.shape)}" for n, x in tensors.items())
            raise ValueError(f"{shapes}: expected one shape [B, H, N, D] (self-attention: N queries and N keys, "
                             f"one head dimension)")
        if t.device != q.device:
            raise ValueError(f"{first} is on {q.device} and {name} on {t.device}: expected one device")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dimension D = {q.shape[-1]}: the kernels are written for D = 64 or 128")
    for name, t in tensors.items():
        check_contiguous(name, t)


def check_lse(lse, q):
    if lse.dtype != torch.float32 or tuple(lse.shape) != tuple(q.shape[:3]) or not lse.is_contiguous():
        raise ValueError(f"lse is {lse.dtype} {tuple(lse.shape)}: expected a contiguous torch.float32 [B, H, N]")


def check_aligned(**tensors):
    for name, t in tensors.items():
        if t.data_ptr() % ALIGNMENT:
            raise ValueError(f"{name}'s data (0x{t.data_ptr():x}) is not {ALIGNMENT}-byte aligned: the kernels load "
                             f"{ALIGNMENT} bytes at once (a tensor of its own, or .clone(), is)")


# --- Running a library on tensors ------------------------------------------------------------------
def shape_of(q, causal, scale):
    return make_shape(*q.shape, causal, scale)


def scratch(size, device):
    """(pointer, bytes) of a workspace from PyTorch's allocator (NULL when none is needed), and the
    tensor that holds it."""
    if not size:
        return None, 0, None
    held = torch.empty(size, dtype=torch.uint8, device=device)
    return held.data_ptr(), size, held


def stream_of(device):
    return torch.cuda.current_stream(device).cuda_stream


def run_forward(lib, q, k, v, causal, scale):
    """O and LSE of one fa_forward on the current stream."""
    shape = shape_of(q, causal, scale)
    o, lse = q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)
    with torch.cuda.device(q.device):
        pointer, size, held = scratch(lib.workspace_bytes(shape), q.device)
        lib.forward(shape, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), pointer, size,
                    stream_of(q.device))
    del held  # the stream-ordered allocator reuses it only after the enqueued kernels, on this stream
    return o, lse


def run_backward(lib, q, k, v, o, lse, d_o, causal, scale, deterministic):
    """dQ, dK, dV of one fa_backward on the current stream, in the deterministic mode or not."""
    shape = shape_of(q, causal, scale)
    dq, dk, dv = (q.new_empty(q.shape) for _ in range(3))
    with torch.cuda.device(q.device):
        pointer, size, held = scratch(lib.backward_workspace_bytes(shape, deterministic), q.device)
        lib.backward(shape, deterministic, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                     d_o.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), pointer, size, stream_of(q.device))
    del held
    return dq, dk, dv


AUTO = "auto"


# Backward chapters that "auto" passes over, with why: a chapter still being built that its own
# measurements put behind the chapter before it. It stays callable by name.
NOT_YET_FASTER = {}  # none today: 10.10 took 0.53-0.73x 09's time in the H100 bench (its backward CSV)


def auto_backward(sm, build=None):
    """backward="auto": the latest chapter (the fastest, each being measured against the one
    before) that has a backward pass, is built (make lib) and runs on sm_<sm>, leaving out those
    NOT_YET_FASTER names; RuntimeError naming what was looked at where none does. Once per GPU kind
    and build folder."""
    return find_auto_backward(sm, build_dir(build))


@functools.lru_cache(maxsize=None)
def find_auto_backward(sm, build):
    looked = []
    for chapter in reversed(chapters()):
        if not has_backward(os.path.join(ROOT, chapter, "attention.cu")):
            continue
        if chapter in NOT_YET_FASTER:
            looked.append(f"{chapter} (passed over: {NOT_YET_FASTER[chapter]})")
        elif not os.path.isfile(library_path(chapter, build)):
            looked.append(f"{chapter} (not built: make lib)")
        elif not library(chapter, build).runs_on(sm):
            looked.append(f"{chapter} (does not run on sm_{sm})")
        else:
            return chapter
    raise RuntimeError(f"backward='auto': no chapter's backward runs here: {', '.join(looked) or 'none has one'}")


def backward_library(backward):
    if not backward:
        raise RuntimeError("fa_tutorial::attention: no backward chapter was given (backward=None): "
                           "pass backward='09' to differentiate through the op")
    lib = library(backward)
    if not lib.has_backward:
        raise RuntimeError(f"backward={backward!r}: {lib.name} has no backward pass (fa_has_backward is 0): "
                           f"name a chapter that has one, such as 09")
    return lib


def saved_forward_is_exact_enough(chapter):
    """Whether the forward chapter's O and LSE can enter the backward as they are (see the module's
    docstring): yes for fp32 and fp16 tensor-core chapters, no for FP8 ones."""
    return library(chapter).precision != FA_PRECISION_FP8_TC


def forward_impl(q, k, v, causal, scale, chapter, backward, deterministic):
    check_inputs(q=q, k=k, v=v)
    check_aligned(q=q, k=k, v=v)
    return run_forward(library(chapter), q, k, v, causal, scale)


def forward_fake(q, k, v, causal, scale, chapter, backward, deterministic):
    check_inputs(q=q, k=k, v=v)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def backward_impl(q, k, v, o, lse, d_o, causal, scale, chapter, backward, deterministic):
    check_inputs(q=q, k=k, v=v, o=o, d_o=d_o)
    check_lse(lse, q)
    check_aligned(q=q, k=k, v=v, o=o, lse=lse, d_o=d_o)
    lib = backward_library(backward)
    if not saved_forward_is_exact_enough(chapter):
        o, lse = run_forward(lib, q, k, v, causal, scale)
    return run_backward(lib, q, k, v, o, lse, d_o, causal, scale, deterministic)


def backward_fake(q, k, v, o, lse, d_o, causal, scale, chapter, backward, deterministic):
    check_inputs(q=q, k=k, v=v, o=o, d_o=d_o)
    return tuple(q.new_empty(q.shape) for _ in range(3))


def setup_context(ctx, inputs, output):
    q, k, v, causal, scale, chapter, backward, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.mark_non_differentiable(lse)
    ctx.causal, ctx.scale, ctx.chapter, ctx.backward, ctx.deterministic = causal, scale, chapter, backward, deterministic


def backward_formula(ctx, grad_o, grad_lse):
    """dQ, dK, dV from the backward op; the LSE's gradient is None (it is marked non-differentiable), as
    are those of the op's other arguments."""
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fa_tutorial.attention_backward(q, k, v, o, lse, grad_o.contiguous(), ctx.causal, ctx.scale,
                                                          ctx.chapter, ctx.backward, ctx.deterministic)
    return dq, dk, dv, None, None, None, None, None


# --- Decoding (11_decode's fa_decode): not differentiable, it is inference -----------------------------
def check_decode_inputs(q, k_pool, v_pool, block_table, lengths):
    """q [B, Hq, Nq, D] and the pools [pages, Hkv, P, D]: fp16 CUDA, contiguous, one device and D (64 or
    128); block_table [B, max_pages] and lengths [B]: contiguous int32 on that device. No data is read."""
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        check_tensor(name, t)
        check_contiguous(name, t)
        if t.device != q.device:
            raise ValueError(f"q is on {q.device} and {name} on {t.device}: expected one device")
    if k_pool.shape != v_pool.shape or k_pool.shape[-1] != q.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}: expected "
                         f"q [B, Hq, Nq, D] and two pools [pages, Hkv, P, D] of one shape and q's D")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dimension D = {q.shape[-1]}: the kernels are written for D = 64 or 128")
    for name, t, dims in (("block_table", block_table, 2), ("lengths", lengths, 1)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} is {what}: expected a torch.int32 tensor (the op does not cast behind the "
                            f"caller's back)")
        if t.dim() != dims or not t.is_contiguous():
            raise ValueError(f"{name} has shape {tuple(t.shape)}, strides {t.stride()}: expected a contiguous tensor of "
                             f"{dims} dimension(s)")
        if t.device != q.device:
            raise ValueError(f"q is on {q.device} and {name} on {t.device}: expected one device")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} rows, q {q.shape[0]} sequences: one per sequence")


def decode_shape_of(q, k_pool, block_table, scale):
    batch, q_heads, new_tokens, headdim = q.shape
    pages, kv_heads, page_size, _ = k_pool.shape
    return FaDecodeShape(batch, q_heads, kv_heads, new_tokens, headdim, page_size, pages, block_table.shape[1],
                         float(scale))


def decode_impl(q, k_pool, v_pool, block_table, lengths, max_length, scale, chapter):
    check_decode_inputs(q, k_pool, v_pool, block_table, lengths)
    check_aligned(q=q, k_pool=k_pool, v_pool=v_pool)
    lib = library(chapter)
    if not lib.has_decode:
        raise RuntimeError(f"chapter={chapter!r}: {lib.name} has no decoding pass (fa_has_decode is 0): name a "
                           f"chapter that has one, such as 11")
    shape = decode_shape_of(q, k_pool, block_table, scale)
    o, lse = q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)
    with torch.cuda.device(q.device):
        pointer, size, held = scratch(lib.decode_workspace_bytes(shape, max_length), q.device)
        lib.decode(shape, max_length, q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), block_table.data_ptr(),
                   lengths.data_ptr(), o.data_ptr(), lse.data_ptr(), pointer, size, stream_of(q.device))
    del held
    return o, lse


class DecodePlan:
    """Decoding planned once and run once a layer of each step, the split FlashInfer's decode wrappers make.
    The op (`decode`) pays on every call for the dispatcher, every check, the workspace and a second
    library call for its size: about 100 us of Python where the library call takes 14
    (docs/pytorch.md). A plan does once, from the first layer's q and pools, the checks of the block
    table and the lengths (their types, shapes and device; their values are the caller's, as for the
    op), the shape, the library, the workspace and the stream; `run` then checks only that q and the
    pools it is given are typed, shaped and placed as those, allocates O and LSE and calls the
    library, on the stream that was current when the plan was made (which the workspace belongs to).
    The block table and lengths tensors are the plan's, read by each run's kernels: a generation loop
    fills the lengths in place each step and keeps the plan, made with a max_length that bounds every
    step's lengths (the cache's capacity); plan again only for other tensors or a longer cache. Not
    differentiable, not an op (torch.compile sees `decode`)."""

    def __init__(self, q, k_pool, v_pool, block_table, lengths, max_length, scale=None, chapter="11"):
        require_torch()
        check_tensor("q", q)
        check_decode_inputs(q, k_pool, v_pool, block_table, lengths)
        self.lib = library(chapter)
        if not self.lib.has_decode:
            raise RuntimeError(f"chapter={chapter!r}: {self.lib.name} has no decoding pass (fa_has_decode is 0)")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        self.shape, self.max_length = decode_shape_of(q, k_pool, block_table, scale), int(max_length)
        self.q_shape, self.pool_shape, self.device = q.shape, k_pool.shape, q.device
        self.new_shape = torch.Size((q.shape[0], k_pool.shape[1], q.shape[2], q.shape[3]))  # [B, Hkv, Nq, D]
        self.table, self.lengths = block_table, lengths  # held, so that their memory outlives the plan
        with torch.cuda.device(self.device):
            self.workspace_bytes = self.lib.decode_workspace_bytes(self.shape, self.max_length)
            self.workspace = torch.empty(max(self.workspace_bytes, 1), dtype=torch.uint8, device=self.device)
            self.stream = stream_of(self.device)

    def run(self, q, k_pool, v_pool, k_new=None, v_new=None):
        """(O, LSE) of q against one layer's pools; with k_new and v_new [B, Hkv, Nq, D], the step's new
        keys and values are first written into the pools as each sequence's last Nq tokens
        (fa_decode_append), in the same stream."""
        checked = [("q", q, self.q_shape), ("k_pool", k_pool, self.pool_shape), ("v_pool", v_pool, self.pool_shape)]
        if (k_new is None) != (v_new is None):
            raise ValueError("k_new and v_new: both or neither")
        if k_new is not None:
            checked += [(name, t, self.new_shape) for name, t in (("k_new", k_new), ("v_new", v_new))]
        for name, t, shape in checked:
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float16:
                raise TypeError(f"{name} is {getattr(t, 'dtype', type(t).__name__)}: the plan takes torch.float16")
            if t.shape != shape or t.device != self.device or not t.is_contiguous():
                raise ValueError(f"{name}: {tuple(t.shape)} on {t.device}, contiguous {t.is_contiguous()}: the plan "
                                 f"was made for contiguous {tuple(shape)} on {self.device}")
        check_aligned(q=q, k_pool=k_pool, v_pool=v_pool)
        o, lse = q.new_empty(self.q_shape), q.new_empty(self.q_shape[:3], dtype=torch.float32)
        with torch.cuda.device(self.device):
            if k_new is not None:
                check_aligned(k_new=k_new, v_new=v_new)
                self.lib.decode_append(self.shape, k_new.data_ptr(), v_new.data_ptr(), self.table.data_ptr(),
                                       self.lengths.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), self.stream)
            self.lib.decode(self.shape, self.max_length, q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                            self.table.data_ptr(), self.lengths.data_ptr(), o.data_ptr(), lse.data_ptr(),
                            self.workspace.data_ptr(), self.workspace_bytes, self.stream)
        return o, lse


def decode_fake(q, k_pool, v_pool, block_table, lengths, max_length, scale, chapter):
    check_decode_inputs(q, k_pool, v_pool, block_table, lengths)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def register():
    """torch.ops.fa_tutorial.attention, .attention_backward and .decode, once per process."""
    try:
        if hasattr(getattr(torch.ops, NAMESPACE), "decode"):  # registered last
            return
    except (AttributeError, RuntimeError):
        pass
    from typing import Tuple
    Tensor = torch.Tensor

    def attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, chapter: str, backward: str,
                     deterministic: bool) -> Tuple[Tensor, Tensor]:
        return forward_impl(q, k, v, causal, scale, chapter, backward, deterministic)

    def attention_backward_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, d_o: Tensor, causal: bool,
                              scale: float, chapter: str, backward: str,
                              deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
        return backward_impl(q, k, v, o, lse, d_o, causal, scale, chapter, backward, deterministic)

    forward_op = torch.library.custom_op(f"{NAMESPACE}::attention", mutates_args=())(attention_op)
    forward_op.register_fake(forward_fake)
    forward_op.register_autograd(backward_formula, setup_context=setup_context)
    backward_op = torch.library.custom_op(f"{NAMESPACE}::attention_backward", mutates_args=())(attention_backward_op)
    backward_op.register_fake(backward_fake)

    def decode_op(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, lengths: Tensor, max_length: int,
                  scale: float, chapter: str) -> Tuple[Tensor, Tensor]:
        return decode_impl(q, k_pool, v_pool, block_table, lengths, max_length, scale, chapter)

    torch.library.custom_op(f"{NAMESPACE}::decode", mutates_args=())(decode_op).register_fake(decode_fake)


def attention(q, k, v, causal=False, chapter="07", backward=AUTO, scale=None, return_lse=False, *,
              deterministic=False):
    """O = softmax(q kᵀ * scale [causal mask]) v by a chapter's forward (scale: 1/sqrt(D) unless
    given); differentiable through `backward`'s fa_backward ("auto": auto_backward's choice for q's
    GPU; None: not differentiable), in its
    deterministic mode with deterministic=True (dQ, dK, dV bitwise the same on every call with the
    same inputs). With return_lse, (O, LSE)."""
    require_torch()
    check_tensor("q", q)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if backward == AUTO:
        major, minor = torch.cuda.get_device_capability(q.device)
        backward = auto_backward(major * 10 + minor)
    o, lse = torch.ops.fa_tutorial.attention(q, k, v, bool(causal), float(scale), str(chapter), str(backward or ""),
                                             bool(deterministic))
    return (o, lse) if return_lse else o


def decode(q, k_pool, v_pool, block_table, lengths, max_length=None, scale=None, chapter="11"):
    """(O, LSE) of each sequence's Nq new queries against its paged KV cache, by a chapter's fa_decode:
    q [B, Hq, Nq, D] and k_pool, v_pool [pages, Hkv, P, D] fp16, block_table [B, max_pages] and lengths
    [B] int32, all on one GPU, the new tokens already written as each sequence's last Nq (docs/design.md,
    decoding). max_length: the longest of lengths (None: read from the device, which waits for it; a
    generation loop knows it); it sizes the grid and the workspace and is not checked against the
    device's lengths: a smaller one misses keys and reads past the workspace. scale: 1/sqrt(D) unless
    given. Not differentiable."""
    require_torch()
    check_tensor("q", q)
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"lengths is a {type(lengths).__name__}: expected a torch.int32 tensor on q's device")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if max_length is None:
        max_length = int(lengths.max())
    return torch.ops.fa_tutorial.decode(q, k_pool, v_pool, block_table, lengths, int(max_length), float(scale),
                                        str(chapter))


if torch is not None:
    register()
