"""common/reference.py, the ground truth: checked against attention written out directly.

The direct formula here is deliberately naive and different from the reference's code: the
whole score matrix at once (einsum), the mask as an -inf upper triangle, exp without a shift,
the LSE as log(sum(exp(s))). Then the script's command line (file names, determinism, the
cache, --input, refusals), its e4m3 (FP8) emulation (every code, rounding, saturation, and
against the toolkit's own conversion where nvcc is here), and the FP8 floor: its granularity is
08's as built by default, and it is attention on the e4m3 inputs.
"""
import math
import re
from pathlib import Path

import numpy as np
import pytest

import cuda_tools
import reference
import source

SCRIPT = Path(reference.__file__)


def direct_attention(q, k, v, causal, scale, shift=False):
    """O [B,H,N,D], LSE [B,H,N] in float64, straight from the formula."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    n = s.shape[-1]
    if causal:
        upper = np.triu(np.ones((n, n), dtype=bool), k=1)  # key j > query i
        s = np.where(upper, -np.inf, s)
    if shift:  # for logits whose exp would lose range: exp(s - m) and m + log(sum)
        m = np.max(s, axis=-1, keepdims=True)
        e = np.exp(s - m)
        return (np.einsum("bhij,bhjd->bhid", e, v) / e.sum(-1, keepdims=True),
                (m + np.log(e.sum(-1, keepdims=True)))[..., 0])
    e = np.exp(s)
    return np.einsum("bhij,bhjd->bhid", e / np.sum(e, axis=-1, keepdims=True), v), np.log(np.sum(e, axis=-1))


def rel_err(got, want):
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def check_close(got, want, what, tol=1e-12):
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert np.all(np.isfinite(got)), f"{what}: {np.count_nonzero(~np.isfinite(got))} non-finite values"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} against the direct formula, expected <= {tol:.0e}"


SHAPES = [(1, 1, 1, 64), (1, 1, 2, 128), (2, 3, 17, 64), (1, 2, 50, 128), (2, 1, 33, 64), (1, 1, 129, 128)]


@pytest.mark.parametrize("b, h, n, d", SHAPES, ids=[f"B{b}H{h}N{n}D{d}" for b, h, n, d in SHAPES])
def test_matches_direct_formula_all_rows(b, h, n, d):
    """Every row, causal or not, at the default scale and at others."""
    q, k, v = reference.make_inputs(b, h, n, d, seed=n + d)
    for causal in (False, True):
        for scale in (1 / math.sqrt(d), 0.3, 1.7, 0.0883883476):
            rows = np.arange(n, dtype=np.int64)
            o, lse = reference.attention_reference(q, k, v, rows, causal, scale)
            want_o, want_lse = direct_attention(q, k, v, causal, scale)
            what = f"B={b} H={h} N={n} D={d} causal={causal} scale={scale:g}"
            assert o.dtype == np.float64 and lse.dtype == np.float64, f"{what}: dtypes {o.dtype}, {lse.dtype}"
            check_close(o, want_o, f"{what}: O")
            check_close(lse, want_lse, f"{what}: LSE")


def test_matches_direct_formula_on_sampled_rows():
    """Given a subset of rows, O and LSE are those rows of the full result (causal: their own mask)."""
    b, h, n, d = 2, 2, 70, 64
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float16) for _ in range(3))
    rows = np.array([0, 1, 5, 31, 32, 68, 69], dtype=np.int64)
    for causal in (False, True):
        o, lse = reference.attention_reference(q, k, v, rows, causal, 0.125)
        want_o, want_lse = direct_attention(q, k, v, causal, 0.125)
        check_close(o, want_o[:, :, rows], f"rows {rows.tolist()} causal={causal}: O")
        check_close(lse, want_lse[:, :, rows], f"rows {rows.tolist()} causal={causal}: LSE")


def test_causal_first_row_is_v0():
    """Causal row 0 sees key 0 only: O = V[0] exactly and LSE = its one scaled score."""
    q, k, v = reference.make_inputs(1, 2, 9, 64, seed=3)
    o, lse = reference.attention_reference(q, k, v, np.arange(9, dtype=np.int64), True, 0.125)
    assert np.array_equal(o[:, :, 0], v[:, :, 0].astype(np.float64)), "causal O[0] should equal V[0]"
    s00 = np.sum(q[:, :, 0].astype(np.float64) * k[:, :, 0].astype(np.float64), axis=-1) * 0.125
    assert np.allclose(lse[:, :, 0], s00, rtol=0, atol=1e-12), f"causal LSE[0] {lse[:, :, 0]}, expected {s00}"


def test_large_logits_stay_finite():
    """Q, K scaled by qk_std = 4.5 (logits up to ~100): finite, and equal to the shifted formula."""
    for d in (64, 128):
        q, k, v = reference.make_inputs(1, 2, 300, d, seed=7, qk_std=4.5)
        scale = 1 / math.sqrt(d)
        s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64)) * scale
        assert np.abs(s).max() >= 50, f"D={d}: max |logit| {np.abs(s).max():.1f}: expected large logits (>= 50)"
        for causal in (False, True):
            rows = np.arange(300, dtype=np.int64)
            o, lse = reference.attention_reference(q, k, v, rows, causal, scale)
            want_o, want_lse = direct_attention(q, k, v, causal, scale, shift=True)
            check_close(o, want_o, f"qk_std 4.5 D={d} causal={causal}: O")
            check_close(lse, want_lse, f"qk_std 4.5 D={d} causal={causal}: LSE")
    # Logits far past exp's float64 range (~709): the reference must still be finite.
    q, k, v = reference.make_inputs(1, 1, 40, 64, seed=1, qk_std=40.0)
    o, lse = reference.attention_reference(q, k, v, np.arange(40, dtype=np.int64), False, 0.125)
    want_o, want_lse = direct_attention(q, k, v, False, 0.125, shift=True)
    check_close(o, want_o, "qk_std 40: O")
    check_close(lse, want_lse, "qk_std 40: LSE")


def test_make_inputs_deterministic_fp16():
    a = reference.make_inputs(2, 3, 17, 64, seed=5)
    b = reference.make_inputs(2, 3, 17, 64, seed=5)
    c = reference.make_inputs(2, 3, 17, 64, seed=6)
    for x, y, z, name in zip(a, b, c, "qkv"):
        assert x.dtype == np.float16 and x.shape == (2, 3, 17, 64), f"{name}: {x.dtype} {x.shape}"
        assert np.array_equal(x, y), f"{name}: the same seed gave different inputs"
        assert not np.array_equal(x, z), f"{name}: seeds 5 and 6 gave the same inputs"
    q, k, v = reference.make_inputs(1, 4, 256, 64, seed=0, qk_std=4.5)
    for x, want, name in ((q, 4.5, "q"), (k, 4.5, "k"), (v, 1.0, "v")):
        std = float(x.astype(np.float64).std())
        assert abs(std - want) < 0.05 * want, f"qk_std 4.5: {name} has std {std:.3f}, expected ~{want}"


def test_sample_rows_small_shapes_every_row():
    for b, h, n in [(1, 1, 1), (2, 3, 17), (1, 16, 2048), (1, 1, 8192)]:
        assert b * h * n * n <= reference.FULL_PAIRS, "test shape too large"
        rows = reference.sample_rows(b, h, n)
        assert rows.dtype == np.int64, f"rows dtype {rows.dtype}, expected int64"
        assert np.array_equal(rows, np.arange(n)), f"B={b} H={h} N={n}: expected every row, got {len(rows)}"


def test_sample_rows_large_shapes_sampled():
    for b, h, n in [(1, 1, 8193), (1, 16, 4096), (4, 16, 4096), (1, 16, 16384), (64, 32, 4096)]:
        rows = reference.sample_rows(b, h, n)
        what = f"B={b} H={h} N={n}"
        assert b * h * n * n > reference.FULL_PAIRS, "test shape too small"
        assert rows.dtype == np.int64, f"{what}: rows dtype {rows.dtype}"
        assert rows[0] == 0 and rows[-1] == n - 1, f"{what}: the sample must hold rows 0 and N-1, got {rows[[0, -1]]}"
        assert np.all(np.diff(rows) > 0), f"{what}: rows not sorted and unique"
        assert reference.MIN_SAMPLED_ROWS <= len(rows) < n, f"{what}: {len(rows)} rows sampled of {n}"
        assert b * h * len(rows) * n <= 2 * reference.FULL_PAIRS + b * h * n * reference.MIN_SAMPLED_ROWS, (
            f"{what}: {len(rows)} rows: the reference would cost more than the budget FULL_PAIRS")
        assert np.array_equal(rows, reference.sample_rows(b, h, n)), f"{what}: the sample is not deterministic"


# --- the command line ----------------------------------------------------------------------------
def prepare(repo, out, *args):
    return repo.run([repo.python, SCRIPT, "prepare", "--out", out, *args], timeout=300)


SHAPE_ARGS = ["--batch", "1", "--heads", "2", "--seqlen", "33", "--headdim", "64", "--seed", "3"]
REF_FILES = ["ref_c1_s0.125_rows.npy", "ref_c1_s0.125_o.npy", "ref_c1_s0.125_lse.npy"]


def test_prepare_writes_documented_files(repo, tmp_path):
    out = tmp_path / "data"
    proc = prepare(repo, out, *SHAPE_ARGS, "--scale", "0.125", "--causal")
    assert proc.returncode == 0, f"prepare failed ({proc.returncode}): {proc.stderr}"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["q.npy", "k.npy", "v.npy"] + REF_FILES), f"prepare wrote {names}"
    q, k, v = (np.load(out / f"{n}.npy") for n in "qkv")
    for x, want in zip((q, k, v), reference.make_inputs(1, 2, 33, 64, 3)):
        assert x.dtype == np.float16 and x.shape == (1, 2, 33, 64), f"input {x.dtype} {x.shape}"
        assert np.array_equal(x, want), "prepare's inputs differ from make_inputs with the same seed"
    rows = np.load(out / REF_FILES[0])
    o = np.load(out / REF_FILES[1])
    lse = np.load(out / REF_FILES[2])
    assert rows.dtype == np.int64 and np.array_equal(rows, np.arange(33)), f"rows {rows.dtype} {rows}"
    assert o.dtype == np.float64 and o.shape == (1, 2, 33, 64), f"o {o.dtype} {o.shape}"
    assert lse.dtype == np.float64 and lse.shape == (1, 2, 33), f"lse {lse.dtype} {lse.shape}"
    want_o, want_lse = direct_attention(q, k, v, True, 0.125)
    check_close(o, want_o, "prepare: O")
    check_close(lse, want_lse, "prepare: LSE")
    paths = reference.ref_paths(str(out), True, "0.125")
    named = sorted(Path(paths[part]).name for part in ("rows", "o", "lse"))
    assert named == sorted(REF_FILES), f"ref_paths gives {paths}"


def test_prepare_deterministic_and_reuses_cache(repo, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        proc = prepare(repo, out, *SHAPE_ARGS, "--scale", "0.125", "--causal")
        assert proc.returncode == 0, f"prepare failed ({proc.returncode}): {proc.stderr}"
    for name in ["q.npy", "k.npy", "v.npy"] + REF_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between two runs of one seed"
    # A second prepare into the same folder keeps what is there (the cache): plant a marker.
    marker = np.zeros((1, 2, 33, 64))
    np.save(a / REF_FILES[1], marker)
    proc = prepare(repo, a, *SHAPE_ARGS, "--scale", "0.125", "--causal")
    assert proc.returncode == 0, f"prepare (cached) failed: {proc.stderr}"
    assert np.array_equal(np.load(a / REF_FILES[1]), marker), "prepare rewrote a cached reference file"
    leftovers = [p.name for p in a.iterdir() if ".tmp" in p.name]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    # Another causal flag and scale in the same folder: new reference files beside the old ones.
    proc = prepare(repo, a, *SHAPE_ARGS, "--scale", "0.3")
    assert proc.returncode == 0, f"prepare --scale 0.3 failed: {proc.stderr}"
    for part in ("rows", "o", "lse"):
        assert (a / f"ref_c0_s0.3_{part}.npy").is_file(), f"ref_c0_s0.3_{part}.npy not written"


def test_prepare_no_ref_writes_inputs_only(repo, tmp_path):
    out = tmp_path
    proc = prepare(repo, out, *SHAPE_ARGS, "--scale", "0.125", "--no-ref")
    assert proc.returncode == 0, f"prepare --no-ref failed: {proc.stderr}"
    names = sorted(p.name for p in out.iterdir())
    assert names == ["k.npy", "q.npy", "v.npy"], f"prepare --no-ref wrote {names}"


def test_prepare_input_folder(repo, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    rng = np.random.default_rng(42)
    arrays = [rng.standard_normal((2, 1, 20, 128)).astype(np.float16) for _ in range(3)]
    for name, array in zip("qkv", arrays):
        np.save(src / f"{name}.npy", array)
    proc = prepare(repo, out, "--input", src, "--scale", "0.2", "--causal")
    assert proc.returncode == 0, f"prepare --input failed ({proc.returncode}): {proc.stderr}"
    o = np.load(out / "ref_c1_s0.2_o.npy")
    lse = np.load(out / "ref_c1_s0.2_lse.npy")
    rows = np.load(out / "ref_c1_s0.2_rows.npy")
    assert np.array_equal(rows, np.arange(20)), f"rows {rows}"
    want_o, want_lse = direct_attention(*arrays, True, 0.2)
    check_close(o, want_o, "prepare --input: O")
    check_close(lse, want_lse, "prepare --input: LSE")
    assert sorted(p.name for p in src.iterdir()) == ["k.npy", "q.npy", "v.npy"], "prepare --input changed SRC"


def test_inputs_command_qk_std(repo, tmp_path):
    out = tmp_path
    proc = repo.run([repo.python, SCRIPT, "inputs", "--out", out, "--batch", "1", "--heads", "2", "--seqlen", "300",
                    "--headdim", "64", "--seed", "7", "--qk-std", "4.5"])
    assert proc.returncode == 0, f"inputs failed ({proc.returncode}): {proc.stderr}"
    q, k, v = (np.load(out / f"{n}.npy") for n in "qkv")
    for x, want in zip((q, k, v), reference.make_inputs(1, 2, 300, 64, 7, qk_std=4.5)):
        assert np.array_equal(x, want), "inputs --qk-std 4.5 differ from make_inputs(qk_std=4.5)"


def test_inputs_command_outliers(repo, tmp_path):
    out = tmp_path
    proc = repo.run([repo.python, SCRIPT, "inputs", "--out", out, "--batch", "1", "--heads", "2", "--seqlen", "500",
                    "--headdim", "128", "--seed", "11", "--outliers", "0.001"])
    assert proc.returncode == 0, f"inputs --outliers failed ({proc.returncode}): {proc.stderr}"
    q, k, v = (np.load(out / f"{n}.npy").astype(np.float64) for n in "qkv")
    for name, x in (("q", q), ("k", k)):
        big = np.abs(x) >= 10
        assert 0.0003 < big.mean() < 0.003, f"{name}: {big.mean():.4%} of entries >= 10, expected about 0.1%"
        assert np.abs(x).max() <= 100.1, f"{name}: an entry of {np.abs(x).max()}, expected <= 100"
    assert np.abs(v).max() < 10, "V should have no outliers"


# --- e4m3 (FP8) emulation -------------------------------------------------------------------
# (code, value): zero, subnormals, the smallest normal, around 1, the largest, NaN, negatives.
E4M3_KNOWN = [(0x00, 0.0), (0x01, 2.0 ** -9), (0x07, 7 * 2.0 ** -9), (0x08, 2.0 ** -6), (0x30, 0.5),
              (0x38, 1.0), (0x39, 1.125), (0x3F, 1.875), (0x40, 2.0), (0x77, 240.0), (0x78, 256.0),
              (0x7E, 448.0), (0x7F, np.nan), (0x80, -0.0), (0xB8, -1.0), (0xFE, -448.0), (0xFF, np.nan)]
# (input, e4m3 value): ties to even, subnormal rounding, saturation (satfinite).
E4M3_ROUNDING = [(1 + 1 / 16, 1.0), (1 + 3 / 16, 1.25), (1.0624, 1.0), (1.0626, 1.125),
                 (2.0 ** -10, 0.0), (3 * 2.0 ** -10, 2.0 ** -8), (5 * 2.0 ** -10, 2.0 ** -8),
                 (2.0 ** -6 - 2.0 ** -11, 2.0 ** -6), (416.0, 416.0), (432.0, 448.0), (464.0, 448.0),
                 (1e6, 448.0), (np.inf, 448.0), (-np.inf, -448.0), (-3.3, -3.25), (0.1, 0.1015625)]


def test_e4m3_decodes_every_code():
    codes = np.arange(256, dtype=np.uint8)
    values = reference.e4m3_decode(codes)
    for code, want in E4M3_KNOWN:
        got = values[code]
        same = (np.isnan(want) and np.isnan(got)) or (got == want and np.signbit(got) == np.signbit(want))
        assert same, f"code 0x{code:02x} decodes to {got!r}, expected {want!r}"
    assert np.isnan(values).sum() == 2, f"{np.isnan(values).sum()} NaN codes, expected 2 (0x7f, 0xff)"
    positive = values[:0x7F]
    assert np.all(np.diff(positive) > 0), "codes 0x00..0x7e should decode to increasing values"
    assert np.array_equal(values[0x80:0xFF], -positive), "codes 0x80.. should be the negatives of 0x00.."
    steps = {1.0: values[0x39] - values[0x38], 448.0: values[0x7E] - values[0x7D]}
    assert steps == {1.0: 0.125, 448.0: 32.0}, f"spacing near 1 and 448: {steps}, expected 0.125 and 32"


def test_e4m3_round_trips_every_code():
    codes = np.arange(256, dtype=np.uint8)
    values = reference.e4m3_decode(codes)
    finite = ~np.isnan(values)
    back = reference.e4m3_encode(values[finite])
    bad = codes[finite][back != codes[finite]]
    assert bad.size == 0, f"codes {[hex(c) for c in bad[:8]]} do not round-trip through encode(decode)"
    assert np.array_equal(reference.e4m3_round(values[finite]), values[finite]), "e4m3 values must round to themselves"
    assert reference.e4m3_encode([np.nan])[0] == 0x7F, "NaN should encode as 0x7f"


def test_e4m3_rounding_and_saturation():
    for x, want in E4M3_ROUNDING:
        got = float(reference.e4m3_round(x))
        assert got == want, f"e4m3_round({x!r}) = {got!r}, expected {want!r}"
        assert float(reference.e4m3_round(-x)) == -want, f"e4m3_round({-x!r}) is not -e4m3_round({x!r})"


def host_fixture(repo, tmp_path, name):
    """tests/fixtures/<name>.cu built by nvcc as a host program (cuda_fp8.h's conversions), its path; a skip
    without nvcc."""
    nvcc = cuda_tools.nvcc()
    if not nvcc:
        pytest.skip("nvcc not found: no cuda_fp8.h to compare with")
    proc = repo.run([nvcc, "-o", tmp_path / name, repo.root / "tests" / "fixtures" / f"{name}.cu"], timeout=300)
    assert proc.returncode == 0, f"nvcc failed on tests/fixtures/{name}.cu:\n{proc.stderr}"
    return tmp_path / name


def test_e4m3_matches_cuda_fp8_conversion(repo, tmp_path):
    """The emulation against the toolkit's own conversion (cuda_fp8.h's __nv_cvt_float_to_fp8,
    satfinite, e4m3), compiled here as a host program: 200k random float32 values over the whole
    range, every tie point between neighbouring codes, and the edges."""
    exe = host_fixture(repo, tmp_path, "e4m3_codes")
    rng = np.random.default_rng(5)
    values = reference.e4m3_decode(np.arange(0x7F, dtype=np.uint8))
    ties = (values[:-1] + values[1:]) / 2
    x = np.concatenate([rng.standard_normal(100000) * np.exp2(rng.uniform(-12, 10, 100000)),
                        rng.uniform(-500, 500, 100000), ties, -ties, np.nextafter(ties, 0), np.nextafter(ties, 1),
                        [0.0, -0.0, 448.0, 449.0, 463.9, 464.0, 465.0, 1e30, np.inf, -np.inf]]).astype(np.float32)
    text = "\n".join(f"{b:08x}" for b in x.view(np.uint32)) + "\n"
    run = repo.run([exe], input=text, timeout=300)
    assert run.returncode == 0, f"e4m3_codes failed: {run.stderr}"
    cuda = np.array([int(line, 16) for line in run.stdout.split()], dtype=np.uint8)
    assert cuda.size == x.size, f"e4m3_codes printed {cuda.size} codes for {x.size} values"
    ours = reference.e4m3_encode(x.astype(np.float64))
    wrong = np.nonzero(ours != cuda)[0]
    assert wrong.size == 0, (f"{wrong.size} of {x.size} values encode differently, e.g. {x[wrong[0]]!r}: "
                             f"numpy 0x{ours[wrong[0]]:02x}, cuda_fp8.h 0x{cuda[wrong[0]]:02x}")


def test_quantize_e4m3_scales_per_head():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 40, 64)).astype(np.float16)
    x[1, 2] *= 50  # one head with a much larger range
    x[0, 1] = 0    # and one of zeros (scale 1, exact)
    got = reference.quantize_e4m3(x)
    assert got.shape == x.shape and got.dtype == np.float64, f"quantize_e4m3 gave {got.dtype} {got.shape}"
    for b in range(2):
        for h in range(3):
            head, back = x[b, h].astype(np.float64), got[b, h]
            amax = np.abs(head).max()
            if amax == 0:
                assert not back.any(), "a head of zeros should stay zeros"
                continue
            top = np.unravel_index(np.abs(head).argmax(), head.shape)
            assert abs(back[top] - head[top]) <= 1e-6 * amax, f"({b},{h}): amax should map to +-448 and back exactly"
            rel = np.linalg.norm(back - head) / np.linalg.norm(head)
            assert 0.005 < rel < 0.05, f"({b},{h}): relative error {rel:.3e} of e4m3 (3 mantissa bits) out of range"
    exact = np.array([1.0, -2.0, 0.5, 0.0], np.float16).reshape(1, 1, 2, 2)
    assert np.array_equal(reference.quantize_e4m3(exact), exact.astype(np.float64)), \
        "values exact in e4m3 after scaling (448 / 2 = 224: 224, 448, 112) should come back unchanged"
    blocked = reference.quantize_e4m3(x, block_rows=16)
    assert blocked.shape == x.shape and np.linalg.norm(blocked - x) <= np.linalg.norm(got - x) * 1.05, \
        "per-block scales should be no worse than per-head ones"
    # Blocks are independent: a block 1e5 times smaller than the rest of its head falls into
    # e4m3's subnormals with the head's scale, and keeps 3 mantissa bits with its own.
    two_ranges = rng.standard_normal((1, 1, 32, 64))
    two_ranges[:, :, :16] *= 1e-5
    two_ranges = two_ranges.astype(np.float16)
    small = two_ranges[:, :, :16].astype(np.float64)
    per_block = reference.quantize_e4m3(two_ranges, block_rows=16)[:, :, :16]
    per_head = reference.quantize_e4m3(two_ranges)[:, :, :16]
    assert np.array_equal(per_block, reference.quantize_e4m3(two_ranges[:, :, :16])), \
        "rows [0, 16) with block_rows=16 should be quantised as a tensor of their own"
    rel_block, rel_head = (np.linalg.norm(got - small) / np.linalg.norm(small) for got in (per_block, per_head))
    assert rel_block < 0.05 < rel_head, \
        f"the small block's error: {rel_block:.3e} with its own scale (want < 5e-2), {rel_head:.3e} with its head's"


def test_fp8_floor_matches_the_chapter(repo):
    """The floor's granularity: 08 tells the harness its tiles by head dim, the harness names the
    floor's file as reference.py does, and reference.py's defaults are 08's as built by default."""
    harness = (repo.root / "common" / "harness.cu").read_text()
    assert re.search(r'qk_range == 448 \? "fp8floor%dx%d" : "fp8floor%dx%dr%d",\s*fp8_scale_rows\(s->headdim, 0\),'
                     r'\s*fp8_scale_rows\(s->headdim, 1\), qk_range\)', harness), \
        ("harness.cu should name the floor's file fp8floor<Q rows>x<KV rows>[r<range>] from the chapter's tiles "
         "at the head dim")
    assert reference.fp8_floor_part(128, 192) == "fp8floor128x192"
    assert reference.fp8_floor_part(128, 256, 16) == "fp8floor128x256r16"
    kernel = source.without_switches((repo.root / "08_fp8" / "attention.cu").read_text())  # as built by default
    q_rows = re.search(r"#define Q_SCALE_ROWS (\d+)", kernel)
    key_tile = re.search(r"static constexpr int BLOCK_KV = HEAD_DIM == 128 \? (\d+) : (\d+);", kernel)
    half = re.search(r"static constexpr bool SCORES_ARE_FP16 = HEAD_DIM == 128;", kernel)
    qk_range = re.search(r"#define QK_RANGE_F16 (\d+)", kernel)
    assert q_rows and key_tile and half and qk_range, \
        ("08_fp8/attention.cu as built by default: no Q_SCALE_ROWS, Config's BLOCK_KV by head dim, SCORES_ARE_FP16 "
         "or QK_RANGE_F16")
    assert reference.FP8_QK_RANGE == {64: 448, 128: int(qk_range.group(1))}, \
        f"reference.py's FP8_QK_RANGE {reference.FP8_QK_RANGE} is not 08's (QK_RANGE_F16 at D = 128, fp16 scores)"
    assert re.search(r"Fp8Scaling fp8_scaling = \{fp8_scale_rows, fp8_qk_range\};", kernel) \
        and "&fp8_scaling," in kernel, \
        "08's Chapter should give the harness its scale tiles and Q/K range (an Fp8Scaling)"
    tiles = (int(q_rows.group(1)), {64: int(key_tile.group(2)), 128: int(key_tile.group(1))})
    assert tiles == (reference.FP8_Q_ROWS, reference.FP8_KV_ROWS), \
        (f"08 scales per {tiles} rows of (Q, K and V by head dim), reference.py's defaults "
         f"{(reference.FP8_Q_ROWS, reference.FP8_KV_ROWS)}")
    assert re.search(r"fp8_scale_rows\(int headdim, int which\) \{ "
                     r"return which == 0 \? Q_SCALE_ROWS : key_tile\(headdim\); \}", kernel), \
        "08's Chapter should give the harness its scale tiles: Q_SCALE_ROWS, then the key tile"


def test_fp8_floor(repo, tmp_path):
    """The floor of N(0, 1) inputs is e4m3's (~4.7e-2), inputs exact in e4m3 have none, and
    prepare --fp8-floor writes it with Q's rows per scale and K's and V's each where they belong."""
    q, k, v = reference.make_inputs(1, 2, 200, 128, seed=4)
    rows = np.arange(200, dtype=np.int64)
    for causal in (False, True):
        o, lse = reference.attention_reference(q, k, v, rows, causal, 128 ** -0.5)
        rel, lse_err = reference.fp8_floor(q, k, v, rows, causal, 128 ** -0.5, o, lse)
        assert 0.03 < rel < 0.07, f"e4m3 floor of N(0, 1) inputs, causal={causal}: {rel:.3e}, expected ~4.7e-2"
        assert 0 < lse_err < 0.5, f"LSE floor {lse_err:.3e} out of range"
        want_o, _ = direct_attention(*(reference.quantize_e4m3(x) for x in (q, k, v)), causal, 128 ** -0.5)
        assert abs(rel - rel_err(want_o, o)) < 1e-9, "fp8_floor disagrees with the direct formula"
    exact = [np.full((1, 1, 8, 64), value, np.float16) for value in (1.0, 0.5, 2.0)]
    o, lse = reference.attention_reference(*exact, np.arange(8), False, 0.125)
    rel, lse_err = reference.fp8_floor(*exact, np.arange(8), False, 0.125, o, lse)
    assert rel == 0 and lse_err == 0, f"inputs exact in e4m3 have a floor of 0, got {rel}, {lse_err}"
    out = tmp_path / "data"
    proc = prepare(repo, out, *SHAPE_ARGS, "--scale", "0.125", "--causal", "--fp8-floor", "16", "24")
    assert proc.returncode == 0, f"prepare --fp8-floor failed: {proc.stderr}"
    floors = np.load(out / "ref_c1_s0.125_fp8floor16x24.npy")
    q, k, v = (np.load(out / f"{n}.npy") for n in "qkv")
    o, lse = np.load(out / REF_FILES[1]), np.load(out / REF_FILES[2])
    want = reference.fp8_floor(q, k, v, np.arange(33), True, 0.125, o, lse, 16, 24)
    assert floors.dtype == np.float64 and np.allclose(floors, want, rtol=1e-12), \
        f"fp8floor.npy {floors}, expected {want}"
    # Q's rows per scale and K's and V's are not interchangeable: the floor is attention on Q per
    # 16 rows and K, V per 24, written out here with the direct formula.
    direct_o, direct_lse = direct_attention(reference.quantize_e4m3(q, 16), reference.quantize_e4m3(k, 24),
                                            reference.quantize_e4m3(v, 24), True, 0.125)
    assert abs(want[0] - rel_err(direct_o, o)) < 1e-9 and abs(want[1] - np.abs(direct_lse - lse).max()) < 1e-9, \
        f"fp8_floor with (16, 24) rows {want} disagrees with the direct formula"
    swapped = reference.fp8_floor(q, k, v, np.arange(33), True, 0.125, o, lse, 24, 16)
    assert not np.allclose(swapped, want), "the floor should depend on which tensor gets which rows per scale"


BAD_ARGS = [
    (["prepare", "--batch", "1"], "--out"),
    (["prepare", "--out", "OUT", "--scale", "0.1"], "--batch"),
    (["prepare", "--out", "OUT", *SHAPE_ARGS[:4], "--seqlen", "0", "--headdim", "64", "--scale", "0.1"], ">= 1"),
    (["prepare", "--out", "OUT", *SHAPE_ARGS, "--scale", "-1"], "--scale"),
    (["prepare", "--out", "OUT", *SHAPE_ARGS, "--scale", "nan"], "--scale"),
    (["prepare", "--out", "OUT", *SHAPE_ARGS], "--scale"),
    (["inputs", "--out", "OUT", "--batch", "x", "--heads", "1", "--seqlen", "4", "--headdim", "64"], "--batch"),
    (["transmogrify"], "invalid choice"),
    ([], "command"),
    (["prepare", "--out", "OUT", "--input", "MISSING", "--scale", "0.1"], "MISSING"),
    (["decode", "--out", "OUT", "--batch", "1", "--scale", "0.1"], "give --batch"),
    (["decode", "--out", "OUT", "--input", "MISSING", "--heads", "4", "--scale", "0.1"], "--heads with --input"),
    (["decode", "--out", "OUT", "--input", "MISSING", "--scale", "0.1", "--no-ref"], "--no-ref with --input"),
    (["decode", "--out", "OUT", "--input", "MISSING", "--scale", "0.1"], "MISSING"),
    (["decode", "--out", "OUT", "--input", "MISSING", "--scale", "0.1", "--kv-cache", "bf16"], "invalid choice"),
    (["decode", "--out", "OUT", "--batch", "1", "--heads", "1", "--kv-heads", "1", "--new", "1", "--headdim", "64",
      "--page-size", "16", "--lengths", "4", "--scale", "0.1", "--no-ref", "--kv-cache", "e4m3"],
     "--kv-cache e4m3 with --no-ref"),
]


@pytest.mark.parametrize("args, keyword", BAD_ARGS, ids=[" ".join(args) or "no arguments" for args, _ in BAD_ARGS])
def test_bad_arguments_exit_2(repo, tmp_path, args, keyword):
    """A refused command line: exit 2, a message that names what is wrong, no traceback."""
    args = [str(tmp_path / a) if a in ("OUT", "MISSING") else a for a in args]
    keyword = str(tmp_path / keyword) if keyword == "MISSING" else keyword
    proc = repo.run([repo.python, SCRIPT, *args], timeout=60)
    assert proc.returncode == 2, (
        f"reference.py {' '.join(args)}: expected exit 2, got {proc.returncode}; stderr {proc.stderr.strip()!r}")
    assert keyword in proc.stderr, f"reference.py {' '.join(args)}: stderr lacks {keyword!r}: {proc.stderr.strip()!r}"
    assert "Traceback" not in proc.stderr, f"reference.py {' '.join(args)}: a traceback instead of a message"


# --- decoding against a KV cache --------------------------------------------------------------
@pytest.mark.parametrize("group,new", [(1, 1), (4, 1), (8, 3), (2, 4)])
def test_decode_is_the_last_rows_of_causal_attention(group, new):
    """Nq new queries against a cache of lengths[b] positions are the last Nq rows of causal attention
    over those positions, with each KV head serving `group` query heads: the prefill computation the
    decode step must agree with."""
    rng = np.random.default_rng([group, new])
    batch, kv_heads, capacity, d = 3, 2, 40, 64
    lengths = np.array([new, 17, capacity])
    q = rng.standard_normal((batch, kv_heads * group, new, d)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((batch, kv_heads, capacity, d)).astype(np.float16) for _ in range(2))
    o, lse = reference.decode_reference(q, k_cache, v_cache, lengths, 1 / math.sqrt(d))
    for b, length in enumerate(lengths):
        # the full sequence: the cache's keys, its last Nq positions' queries being the new ones
        full_q = np.zeros((1, kv_heads * group, length, d), dtype=np.float16)
        full_q[0, :, length - new:] = q[b]
        full_k, full_v = (np.repeat(c[b:b + 1, :, :length], group, axis=1) for c in (k_cache, v_cache))
        rows = np.arange(length - new, length)
        want_o, want_lse = reference.attention_reference(full_q, full_k, full_v, rows, True, 1 / math.sqrt(d))
        np.testing.assert_allclose(o[b], want_o[0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[b], want_lse[0], rtol=0, atol=1e-12)


def test_decode_one_query_sees_the_whole_cache_and_nothing_past_it():
    """Nq = 1: the mean of the cache's first lengths[b] values when every logit is equal; what lies past
    lengths[b] in the cache never counts."""
    batch, kv_heads, capacity, d = 2, 1, 8, 64
    lengths = np.array([3, 8])
    q = np.zeros((batch, 2, 1, d), dtype=np.float16)
    k_cache = np.ones((batch, kv_heads, capacity, d), dtype=np.float16)
    v_cache = np.arange(capacity, dtype=np.float16)[None, None, :, None] * np.ones((batch, kv_heads, capacity, d),
                                                                                 dtype=np.float16)
    v_cache[0, :, 3:] = 1000  # past sequence 0's length: must not count
    o, lse = reference.decode_reference(q, k_cache, v_cache, lengths, 0.125)
    assert np.allclose(o[0], 1.0) and np.allclose(o[1], 3.5), (o[0, 0, 0, 0], o[1, 0, 0, 0])
    assert np.allclose(lse[0], math.log(3)) and np.allclose(lse[1], math.log(8)), lse


@pytest.mark.parametrize("change,message", [
    (dict(q_heads=3), "multiple of Hkv"),
    (dict(lengths=[2, 5]), "each from Nq"),
    (dict(lengths=[4, 99]), "capacity"),
    (dict(lengths=[4]), "one per sequence"),
    (dict(v_capacity=7), "two caches")])
def test_decode_refuses_shapes_that_do_not_fit(change, message):
    q_heads, new = change.get("q_heads", 4), 3
    q = np.zeros((2, q_heads, new, 64), dtype=np.float16)
    k = np.zeros((2, 2, 8, 64), dtype=np.float16)
    v = np.zeros((2, 2, change.get("v_capacity", 8), 64), dtype=np.float16)
    with pytest.raises(ValueError, match=message):
        reference.decode_reference(q, k, v, np.array(change.get("lengths", [4, 8])), 0.125)


def test_decode_inputs_page_the_cache_through_the_block_table(tmp_path):
    """reference.py decode: every sequence's pages are its own (no page twice, none past the pool), not in
    pool order, -1 past its last; the reference it writes is decode_reference on the caches those
    pages make, page by page, in the table's order."""
    lengths = [40, 100, 1]
    args = ["decode", "--out", str(tmp_path), "--batch", "3", "--heads", "8", "--kv-heads", "2", "--new", "1",
            "--headdim", "64", "--page-size", "16", "--lengths", ",".join(map(str, lengths)), "--scale", "0.125"]
    assert reference.main(args) == 0
    q, k_pool, v_pool, table, got_lengths = (np.load(tmp_path / f"{n}.npy") for n in reference.DECODE_INPUTS)
    used = [3, 7, 1]
    assert list(got_lengths) == lengths and table.shape == (3, 7) and k_pool.shape == (sum(used), 2, 16, 64)
    pages = np.concatenate([table[b, :n] for b, n in enumerate(used)])
    assert sorted(pages) == list(range(sum(used))), f"the pages in use are not the pool, each once: {table}"
    assert all((table[b, n:] == -1).all() for b, n in enumerate(used)), table
    assert list(table[1, :7]) != sorted(table[1, :7]), "sequence 1's pages lie in pool order"
    k = reference.gather_cache(k_pool, table, got_lengths)
    assert np.array_equal(k[1, :, 16 * 2:16 * 3], k_pool[table[1, 2]]), "page 2 of sequence 1 is not where it goes"
    o = np.load(tmp_path / "ref_decode_s0.125_o.npy")
    want, _ = reference.decode_reference(q, k, reference.gather_cache(v_pool, table, got_lengths), got_lengths, 0.125)
    assert np.array_equal(o, want)


DECODE_SHAPE = ["--batch", "3", "--heads", "8", "--kv-heads", "2", "--new", "2", "--headdim", "64", "--page-size", "16",
                "--lengths", "40,100,2"]


def write_decode_folder(folder, scale="0.125"):
    """reference.py decode's inputs and reference in folder (B=3, Hq=8, Hkv=2, Nq=2, D=64, P=16); its arrays."""
    assert reference.main(["decode", "--out", str(folder), *DECODE_SHAPE, "--scale", scale]) == 0
    return {name: np.load(folder / f"{name}.npy") for name in reference.DECODE_INPUTS}


@pytest.mark.parametrize("int_dtype", [np.int64, np.int32], ids=["int64 as written", "int32"])
def test_decode_reference_of_a_folder_is_the_one_written_with_its_inputs(tmp_path, int_dtype):
    """reference.py decode --input: the reference of a folder reference.py decode wrote (its table and lengths
    as written, or as int32) is the O and LSE it wrote with them, bit for bit, under the same names; nothing
    is written beside the inputs."""
    arrays = write_decode_folder(tmp_path / "gen")
    folder = tmp_path / "user"
    folder.mkdir()
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", array.astype(int_dtype) if array.dtype.kind == "i" else array)
    out = tmp_path / "ref"
    assert reference.main(["decode", "--input", str(folder), "--out", str(out), "--scale", "0.125"]) == 0
    for part in ("o", "lse"):
        name = f"ref_decode_s0.125_{part}.npy"
        want, got = np.load(tmp_path / "gen" / name), np.load(out / name)
        assert got.dtype == np.float64 and got.shape == want.shape, f"{name}: {got.dtype} {got.shape}"
        assert np.array_equal(got, want), f"{name}: differs by {np.abs(got - want).max():.3e} from the one written"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{n}.npy" for n in reference.DECODE_INPUTS)
    assert sorted(p.name for p in out.iterdir()) == ["ref_decode_s0.125_lse.npy", "ref_decode_s0.125_o.npy"]
    # Another folder's reference into the same --out replaces it: a reference is never reused for other inputs.
    smaller = tmp_path / "smaller"
    smaller.mkdir()
    for name, array in arrays.items():
        np.save(smaller / f"{name}.npy", array[:2] if name in ("q", "block_table", "lengths") else array)
    assert reference.main(["decode", "--input", str(smaller), "--out", str(out), "--scale", "0.125"]) == 0
    assert np.load(out / "ref_decode_s0.125_o.npy").shape[0] == 2, "the first folder's reference was kept"


def _with(array, at, value):
    """array, a copy, with array[at] = value."""
    array = array.copy()
    array[at] = value
    return array


# A folder reference.py decode wrote (B=3, Hq=8, Hkv=2, Nq=2, D=64, P=16, lengths 40, 100, 2: 11 pages, 7 a row)
# with one file changed: (what, the file, its new array from the folder's arrays, what the message must match).
DECODE_MISFITS = [
    ("v_pool of another page count", "v_pool", lambda a: a["v_pool"][:-1],
     r"two pools \[pages, Hkv, P, D\] of one shape"),
    ("pools of another head dimension", "k_pool", lambda a: np.zeros((11, 2, 16, 128), np.float16), r"q's D"),
    ("q float32", "q", lambda a: a["q"].astype(np.float32), r"q\.npy: want a 4-D float16 array, got 4-D float32"),
    ("block_table float64", "block_table", lambda a: a["block_table"].astype(np.float64),
     r"block_table\.npy: want a 2-D int32 or int64 array, got 2-D float64"),
    ("lengths uint8", "lengths", lambda a: a["lengths"].astype(np.uint8),
     r"lengths\.npy: want a 1-D int32 or int64 array, got 1-D uint8"),
    ("a table row short", "block_table", lambda a: a["block_table"][:2], r"\[B, max_pages\] and \[B\], q's B"),
    ("a length over the capacity", "lengths", lambda a: _with(a["lengths"], 1, 113),
     r"lengths\.npy.*capacity 112 \(7 pages of 16\)"),
    ("a length under Nq", "lengths", lambda a: _with(a["lengths"], 2, 1), r"lengths\.npy.*from Nq = 2"),
    ("an entry past the pool", "block_table", lambda a: _with(a["block_table"], (1, 3), 11),
     r"block_table\.npy: sequence 1: entry 3 names page 11, past the pool of 11 pages"),
    ("a used entry of -1", "block_table", lambda a: _with(a["block_table"], (0, 0), -1),
     r"sequence 0: entry 0 names page -1\b"),
    ("pages of 0 tokens", "k_pool", lambda a: np.zeros((11, 2, 0, 64), np.float16), r"every dimension at least 1"),
]


@pytest.mark.parametrize("what, name, change, message", DECODE_MISFITS, ids=[case[0] for case in DECODE_MISFITS])
def test_decode_input_refuses_a_folder_that_does_not_fit(tmp_path, capsys, what, name, change, message):
    """reference.py decode --input of a folder whose files do not fit together (shapes, dtypes, lengths, the
    block table): exit 2, one line naming the file or the folder and what is wrong, nothing written."""
    folder = tmp_path / "in"
    arrays = write_decode_folder(folder)
    np.save(folder / f"{name}.npy", change(arrays))
    out = tmp_path / "ref"
    capsys.readouterr()
    assert reference.main(["decode", "--input", str(folder), "--out", str(out), "--scale", "0.125"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err) and len(err.splitlines()) == 1, (
        f"{what}: expected one line matching {message!r}: {err!r}")
    assert not out.exists(), f"refused, but wrote {sorted(p.name for p in out.iterdir())}"


# --- an e4m3 KV cache (--kv-cache e4m3) --------------------------------------------------------
def test_e4m3_cache_quantisation_is_the_harness_s(repo, tmp_path):
    """reference.py quantize_cache_e4m3 against the harness's own quantisation (common/kv_cache_e4m3.h, compiled
    here as a host program, tests/fixtures/kv_cache_e4m3.cu): the same float32 scales and the same e4m3 codes,
    bit for bit, on a pool with a head of N(0, 1), one spanning 2^-20 to 2^14 (e4m3's subnormals after scaling,
    ties among them), one of zeros (scale 1), and one whose maximum is alone in the last row of the last page
    with a value that a float64 division would round differently (so that the amax must take every page and
    row, and the division be float32's)."""
    exe = host_fixture(repo, tmp_path, "kv_cache_e4m3")
    rng = np.random.default_rng(7)
    pool = rng.standard_normal((5, 4, 16, 64))
    pool[:, 1] *= np.exp2(rng.integers(-20, 12, pool[:, 1].shape))
    pool[:, 1, 0, :8] = [2.0 ** 14, 3 * 2.0 ** -20, 5 * 2.0 ** -20, 2.0 ** -24, -(2.0 ** -24), 0.0, -0.0, -1.0]
    pool[:, 2] = 0
    pool[:, 3] = np.clip(8 * pool[:, 3], -20, 20)
    pool[-1, 3, -1, -1], pool[0, 3, 0, 0], pool[-1, 0, -1, -1] = 21.0625, 0.00096416, 9.0
    pool = pool.astype(np.float16)
    pool.tofile(tmp_path / "pool.bin")
    run = repo.run([exe, tmp_path / "pool.bin", tmp_path / "codes.bin", tmp_path / "scales.bin", "5", "4",
                    str(16 * 64)], timeout=60)
    assert run.returncode == 0, f"kv_cache_e4m3 failed: {run.stderr}"
    codes = np.fromfile(tmp_path / "codes.bin", np.uint8).reshape(pool.shape)
    scales = np.fromfile(tmp_path / "scales.bin", np.float32)
    values, want_scales = reference.quantize_cache_e4m3(pool)
    assert want_scales.dtype == np.float32 and np.array_equal(want_scales.view(np.uint32), scales.view(np.uint32)), (
        f"scales per KV head: numpy {want_scales.tolist()}, the harness's {scales.tolist()}")
    assert want_scales[2] == 1, "a KV head of zeros has the scale 1"
    ours = reference.e4m3_encode(values)
    wrong = np.argwhere(ours != codes)
    assert wrong.size == 0, (f"{len(wrong)} of {pool.size} codes differ, e.g. at {tuple(wrong[0])} "
                             f"({pool[tuple(wrong[0])]!r}): numpy 0x{ours[tuple(wrong[0])]:02x}, "
                             f"the harness's 0x{codes[tuple(wrong[0])]:02x}")
    assert (np.abs(values) <= reference.E4M3_MAX).all() and np.abs(values).max(axis=(0, 2, 3))[[0, 1, 3]].tolist() == [
        reference.E4M3_MAX] * 3, "each KV head's largest |x| becomes 448"


def test_decode_e4m3_reference_is_the_quantised_cache_s(tmp_path):
    """reference.py decode --kv-cache e4m3: beside the fp16 cache's reference (the same files as without it),
    ref_decode_s<F>_e4m3_o.npy and _lse.npy, decode_reference of the pools quantised per KV head and
    dequantised (e4m3 x scale); it differs from the fp16 one by e4m3's rounding (rel L2 of O about 3e-2); with
    --input, the same files from a folder of one's own."""
    folder = tmp_path / "gen"
    assert reference.main(["decode", "--out", str(folder), *DECODE_SHAPE, "--scale", "0.125", "--kv-cache",
                           "e4m3"]) == 0
    q, k_pool, v_pool, table, lengths = (np.load(folder / f"{n}.npy") for n in reference.DECODE_INPUTS)
    refs = sorted(p.name for p in folder.glob("ref_*"))
    assert refs == sorted(f"ref_decode_s0.125{tag}_{part}.npy" for tag in ("", "_e4m3") for part in ("lse", "o")), refs
    caches = []
    for pool in (k_pool, v_pool):
        values, scales = reference.quantize_cache_e4m3(pool)
        caches.append(reference.gather_cache(values * scales.astype(np.float64)[None, :, None, None], table, lengths))
    want_o, want_lse = reference.decode_reference(q, *caches, lengths, 0.125)
    got_o = np.load(folder / "ref_decode_s0.125_e4m3_o.npy")
    got_lse = np.load(folder / "ref_decode_s0.125_e4m3_lse.npy")
    assert np.array_equal(got_o, want_o) and np.array_equal(got_lse, want_lse), "the e4m3 cache's reference"
    fp16_o = np.load(folder / "ref_decode_s0.125_o.npy")
    rel = np.linalg.norm(got_o - fp16_o) / np.linalg.norm(fp16_o)
    assert 1e-3 < rel < 8e-2, f"O of the e4m3 cache against the fp16 cache's: rel L2 {rel:.3e}"
    out = tmp_path / "ref"
    assert reference.main(["decode", "--input", str(folder), "--out", str(out), "--scale", "0.125", "--kv-cache",
                           "e4m3"]) == 0
    for name in refs:
        assert np.array_equal(np.load(out / name), np.load(folder / name)), f"--input: {name} differs"
