"""The result row shared by common/stages.py (chapters) and common/anchors.py (PyTorch):
its CSV columns, its constructor, and the FLOP convention of the TFLOP/s column."""

CSV_FIELDS = ("impl", "batch", "heads", "seqlen", "headdim", "causal", "dtype",
              "ms", "tflops", "rel_l2", "status")
INT_FIELDS = ("batch", "heads", "seqlen", "headdim", "causal")
ANCHORS = ("torch_flash", "torch_cudnn", "torch_efficient", "torch_eager")


def work(shape):
    """B·H·N²·D: what a forward's time grows with (the bench keeps B·N fixed, so ~N)."""
    return shape["batch"] * shape["heads"] * shape["seqlen"] ** 2 * shape["headdim"]


def forward_tflops(shape, ms):
    """TFLOP/s of one forward: 4·B·H·N²·D FLOPs, halved when causal."""
    flops = 4.0 * work(shape)
    return (flops / 2 if shape["causal"] else flops) / (ms * 1e-3) / 1e12


def shape_label(shape):
    """B=4 H=16 N=4096 D=128 causal."""
    mask = "causal" if shape["causal"] else "non-causal"
    return f"B={shape['batch']} H={shape['heads']} N={shape['seqlen']} D={shape['headdim']} {mask}"


def make_row(impl, shape, status, ms=None, tflops=None, rel_l2=None, note=None, dtype="fp16"):
    """One result row (a dict of CSV_FIELDS, plus an optional note)."""
    row = {"impl": impl, **{k: int(shape[k]) for k in INT_FIELDS}, "dtype": dtype,
           "ms": ms, "tflops": tflops, "rel_l2": rel_l2, "status": status}
    if note:
        row["note"] = note
    return row
