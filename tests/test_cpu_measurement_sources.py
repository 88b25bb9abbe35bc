"""The CUDA programs beside the logs (docs/results/logs/NN/*.cu: measurements a chapter's notes
quote or plan) still compile, for sm_90, without a warning, and hold what they measure: 09's
red_layout.cu makes both the 16-byte and the 4-byte reductions it times (in the PTX, an atom whose
result is unused, which ptxas makes a RED). No GPU needed."""
import re

from claims import nvcc


def sources(ctx):
    return sorted((ctx.root / "docs" / "results" / "logs").glob("*/*.cu"))


def ptx_of(ctx, source):
    out = ctx.tmpdir() / (source.stem + ".ptx")
    proc = ctx.run([nvcc(), "-ptx", "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", "-o", out, source],
                   timeout=300)
    assert proc.returncode == 0, f"nvcc -ptx failed for {ctx.rel(source)}:\n{proc.stdout}{proc.stderr}"
    return out.read_text()


def test_measurement_sources_compile_without_warnings(ctx):
    found = sources(ctx)
    assert found, "no docs/results/logs/*/*.cu: the tests expect 09's red_layout.cu at least"
    for source in found:
        ptx_of(ctx, source)
    return f"{len(found)} program(s): " + ", ".join(ctx.rel(s) for s in found)


def test_red_layout_makes_vector_and_scalar_reductions(ctx):
    text = ptx_of(ctx, ctx.root / "docs" / "results" / "logs" / "09" / "red_layout.cu")
    kernels = re.split(r"\.entry\s+", text)[1:]
    counts = [(len(re.findall(r"\b(?:atom|red)\.global\.add\.v4\.f32", k)),
               len(re.findall(r"\b(?:atom|red)\.global\.add\.(?:f32|u64)", k)),
               len(re.findall(r"\bcp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32", k)))
              for k in kernels]
    assert len(counts) == 7, f"red_layout.cu: {len(counts)} kernels in the PTX, expected the seven layouts"
    # per lane and query tile 8 vector REDs or 32 scalar ones (4-byte float or 8-byte integer) (nvcc may unroll the tile loop); the
    # bulk layouts, their bulk reductions and no RED
    kinds = sorted("vector" if v and not f and not b and v % 8 == 0 else
                   "scalar" if f and not v and not b and f % 32 == 0 else
                   "bulk" if b and not v and not f else str((v, f, b)) for v, f, b in counts)
    assert kinds == ["bulk", "bulk", "scalar", "scalar", "vector", "vector", "vector"], (
        f"(16-byte, 4-byte, bulk) reductions per kernel: {counts}")
    return f"(16-byte, 4-byte, bulk) reductions per kernel: {counts}"
