"""Exercise torch.op: chapter 07's forward and 09's backward as a PyTorch op of your own.

`make exercise CH=torch` copies this file to exercises/torch/attention_op.py; fill in the four TODOs
there, then `make grade CH=torch`. The calls into the chapters' libraries are given (torch_op's
run_forward and run_backward: ctypes, a workspace from PyTorch's allocator, the current stream);
what is yours is how PyTorch sees them: two custom ops, their fake implementations, and the
autograd formula that joins them. common/torch_op.py does the same for every chapter; try it
without reading it first.

What the grade checks (common/torch_grade.py): O and LSE bitwise those of 07's library, and dQ, dK,
dV bitwise those of 09's backward in its deterministic mode on them, also when autograd hands the
backward a non-contiguous dO; torch.library.opcheck on both ops; torch.compile(fullgraph=True) of
a loss through the op, bitwise as eager. The op fa_tutorial::attention (torch_op.attention) is
switched off while it grades: the ops must be these.
"""
from typing import Tuple

import torch

import torch_op

Tensor = torch.Tensor
FORWARD = torch_op.library("07")   # 07_async_pipeline's library (make lib)
BACKWARD = torch_op.library("09")  # 09_backward's


@torch.library.custom_op("mine::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """O (fp16 [B, H, N, D]) and LSE (fp32 [B, H, N]) from 07's fa_forward."""
    # TODO(1): torch_op.run_forward(FORWARD, ...) returns both; torch_op.check_inputs first.
    raise NotImplementedError("TODO: exercise torch.op (1, the forward op) is not written yet")


@attention_op.register_fake
def _(q, k, v, causal, scale):
    # TODO(2): tensors of the outputs' shapes and dtypes, on q's device, and no GPU work: this runs
    # when torch.compile traces the op on FakeTensors, which have no data.
    raise NotImplementedError("TODO: exercise torch.op (2, the fake forward) is not written yet")


@torch.library.custom_op("mine::attention_backward", mutates_args=())
def attention_backward_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, d_o: Tensor, causal: bool,
                          scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV from 09's fa_backward on the forward's O and LSE. Why an op of its own, and not
    a call to the library inside the autograd formula? (Run opcheck on a version without it.)"""
    # TODO(3): torch_op.check_inputs on q, k, v, o, d_o (09's backward reads them as contiguous
    # [B, H, N, D]: anything else must be refused, not read), then torch_op.run_backward(BACKWARD,
    # ..., deterministic=True): the deterministic mode, so that two runs (opcheck's, the grade's)
    # agree bitwise.
    raise NotImplementedError("TODO: exercise torch.op (3, the backward op) is not written yet")


@attention_backward_op.register_fake
def _(q, k, v, o, lse, d_o, causal, scale):
    return tuple(q.new_empty(q.shape) for _ in range(3))


def setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.mark_non_differentiable(lse)
    ctx.causal, ctx.scale = causal, scale


def backward(ctx, grad_o, grad_lse):
    # TODO(4): dQ, dK, dV from attention_backward_op, and None for each other input of
    # attention_op. What may autograd hand you as grad_o that 09's backward cannot read?
    raise NotImplementedError("TODO: exercise torch.op (4, the autograd formula) is not written yet")


attention_op.register_autograd(backward, setup_context=setup_context)


def attention(q, k, v, causal=False):
    """O = softmax(q kᵀ / sqrt(D) [causal mask]) v, differentiable."""
    return attention_op(q, k, v, bool(causal), 1.0 / q.shape[-1] ** 0.5)[0]
