"""common/reference.py's backward pass: the gradients of attention, the ground truth for 09.

Checked against central finite differences of L = sum(O * dO), against the formulas written
out densely here (the whole score matrix at once, einsum, the mask as an -inf upper triangle),
sampled rows against full ones, the causal structure of dK and dV, then the command line:
inputs --grad, backward's files, its cache and its refusals.
"""
from pathlib import Path

import numpy as np
import pytest

import reference

SCRIPT = Path(reference.__file__)


def dense_forward(q, k, v, causal, scale):
    """P [B,H,N,N] and O [B,H,N,D] in float64, straight from the formula."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    if causal:
        s = np.where(np.triu(np.ones(s.shape[-2:], dtype=bool), k=1), -np.inf, s)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    return p, np.einsum("bhij,bhjd->bhid", p, v)


def dense_backward(q, k, v, do, causal, scale):
    """dQ, dK, dV [B,H,N,D] and Delta [B,H,N] from the whole P at once."""
    p, o = dense_forward(q, k, v, causal, scale)
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    delta = np.einsum("bhid,bhid->bhi", do, o)
    ds = p * (np.einsum("bhid,bhjd->bhij", do, v) - delta[..., None])
    return (scale * np.einsum("bhij,bhjd->bhid", ds, k), scale * np.einsum("bhij,bhid->bhjd", ds, q),
            np.einsum("bhij,bhid->bhjd", p, do), delta)


def loss(q, k, v, do, causal, scale):
    return float(np.sum(dense_forward(q, k, v, causal, scale)[1] * do))


def rel_err(got, want):
    """Relative to the reference's norm, or absolute where that is below 1 (N = 1: dQ = dK = 0)."""
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1.0))


def check_close(got, want, what, tol=1e-12):
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == np.float64, f"{what}: dtype {got.dtype}, expected float64"
    assert np.all(np.isfinite(got)), f"{what}: {np.count_nonzero(~np.isfinite(got))} non-finite values"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e}, expected <= {tol:.0e}"


def every_row(n):
    return np.arange(n, dtype=np.int64)


def inputs_and_grad(b, h, n, d, seed, qk_std=1.0):
    return (*reference.make_inputs(b, h, n, d, seed, qk_std), reference.make_grad_output(b, h, n, d, seed))


def test_full_gradients_match_finite_differences():
    """Every entry of dQ, dK, dV against (L(x + e) - L(x - e)) / 2e, L = sum(O * dO) in float64."""
    step = 1e-6
    for n, d, causal in [(5, 4, False), (7, 8, True), (9, 6, False), (8, 4, True), (6, 8, True)]:
        q, k, v, do = (x.astype(np.float64) for x in inputs_and_grad(1, 2, n, d, seed=n * d))
        scale = 0.4
        grads = reference.attention_backward(q, k, v, do, every_row(n), every_row(n), causal, scale)
        for name, x, grad in zip("qkv", (q, k, v), grads):
            numeric = np.empty_like(x)
            for index in np.ndindex(x.shape):
                saved = x[index]
                x[index] = saved + step
                up = loss(q, k, v, do, causal, scale)
                x[index] = saved - step
                down = loss(q, k, v, do, causal, scale)
                x[index] = saved
                numeric[index] = (up - down) / (2 * step)
            err = float(np.linalg.norm(grad - numeric) / np.linalg.norm(numeric))
            assert err < 1e-7, f"N={n} D={d} causal={causal}: d{name} against finite differences: {err:.3e}"


def test_blockwise_equals_dense():
    """Tiles of any size, N not a multiple of the tile, N = 1, several heads per step, causal."""
    cases = [(1, 1, 1, 8, None), (1, 2, 1, 4, 3), (2, 3, 17, 16, 5), (1, 2, 64, 32, 64), (1, 1, 100, 64, 7),
             (2, 1, 33, 8, 32), (1, 2, 129, 128, None), (1, 1, 40, 16, 1)]
    for b, h, n, d, tile in cases:
        q, k, v, do = inputs_and_grad(b, h, n, d, seed=n + d)
        for causal in (False, True):
            for scale in (d ** -0.5, 1.3):
                got = reference.attention_backward(q, k, v, do, every_row(n), every_row(n), causal, scale, tile)
                want = dense_backward(q, k, v, do, causal, scale)
                for name, g, w in zip(("dQ", "dK", "dV", "Delta"), got, want):
                    check_close(g, w, f"B={b} H={h} N={n} D={d} tile={tile} causal={causal} scale={scale:g}: {name}")
    # N = 1: softmax over one key is constant, so dQ = dK = 0 and dV = dO.
    q, k, v, do = inputs_and_grad(2, 2, 1, 8, seed=1)
    dq, dk, dv, _ = reference.attention_backward(q, k, v, do, every_row(1), every_row(1), True, 0.3)
    assert np.abs(dq).max() < 1e-14 and np.abs(dk).max() < 1e-14, "N = 1: dQ and dK should be 0"
    assert np.array_equal(dv, do.astype(np.float64)), "N = 1: dV should equal dO"


def test_large_logits_stay_finite():
    """Logits of ~100 and far past exp's range: finite, and the dense formula's (shifted) result."""
    for qk_std, n in ((4.5, 60), (40.0, 24)):
        q, k, v, do = inputs_and_grad(1, 2, n, 64, seed=7, qk_std=qk_std)
        for causal in (False, True):
            got = reference.attention_backward(q, k, v, do, every_row(n), every_row(n), causal, 0.125, tile=9)
            want = dense_backward(q, k, v, do, causal, 0.125)
            for name, g, w in zip(("dQ", "dK", "dV", "Delta"), got, want):
                check_close(g, w, f"qk_std {qk_std} causal={causal}: {name}", tol=1e-11)


def test_sampled_rows_equal_full_rows():
    """Given query and key rows (tile edges among them), small tiles: the rows of the full gradients."""
    b, h, n, d = 1, 2, 300, 32
    q, k, v, do = inputs_and_grad(b, h, n, d, seed=5)
    q_rows = np.array([0, 1, 15, 16, 63, 64, 100, 127, 128, 255, 256, 298, 299], dtype=np.int64)
    kv_rows = np.array([0, 2, 17, 63, 64, 128, 200, 255, 256, 299], dtype=np.int64)
    for causal in (False, True):
        full = reference.attention_backward(q, k, v, do, every_row(n), every_row(n), causal, 0.2)
        dense = dense_backward(q, k, v, do, causal, 0.2)
        for tile in (16, 37, 300):
            dq, dk, dv, delta = reference.attention_backward(q, k, v, do, q_rows, kv_rows, causal, 0.2, tile)
            what = f"N={n} tile={tile} causal={causal}"
            for name, got, rows, f, w in (("dQ", dq, q_rows, full[0], dense[0]), ("dK", dk, kv_rows, full[1], dense[1]),
                                          ("dV", dv, kv_rows, full[2], dense[2])):
                check_close(got, f[:, :, rows], f"{what}: sampled {name} against the full one", tol=1e-13)
                check_close(got, w[:, :, rows], f"{what}: sampled {name} against the dense formula")
            check_close(delta, full[3], f"{what}: Delta")


def test_causal_keys_get_gradient_only_from_queries_that_see_them():
    n, d, scale = 12, 16, 0.25
    q, k, v, do = (x.astype(np.float64) for x in inputs_and_grad(1, 2, n, d, seed=9))
    rows = every_row(n)
    dq, dk, dv, _ = reference.attention_backward(q, k, v, do, rows, rows, True, scale, tile=5)
    # The last key is seen by the last query alone: dV = P[N-1, N-1] dO[N-1], dK = scale dS[N-1, N-1] Q[N-1].
    p, o = dense_forward(q, k, v, True, scale)
    p_last = p[:, :, -1, -1, None]
    ds_last = p_last * (np.sum(do[:, :, -1] * v[:, :, -1], -1, keepdims=True) - np.sum(do[:, :, -1] * o[:, :, -1], -1,
                                                                                        keepdims=True))
    check_close(dv[:, :, -1], p_last * do[:, :, -1], "causal: dV of the last key")
    check_close(dk[:, :, -1], scale * ds_last * q[:, :, -1], "causal: dK of the last key")
    # Change every query and dO row but the last: the last key's gradients stay exactly the same.
    q2, do2 = q.copy(), do.copy()
    q2[:, :, :-1] += 0.5
    do2[:, :, :-1] *= -3
    _, dk2, dv2, _ = reference.attention_backward(q2, k, v, do2, rows, rows, True, scale, tile=5)
    assert np.array_equal(dk2[:, :, -1], dk[:, :, -1]) and np.array_equal(dv2[:, :, -1], dv[:, :, -1]), \
        "causal: the last key's dK, dV changed with queries that cannot see it"
    # dO on one query row i alone: dK and dV are exactly 0 for the keys after i, dQ for the other rows.
    for i in (0, 4, 5, n - 1):
        one = np.zeros_like(do)
        one[:, :, i] = do[:, :, i]
        dq1, dk1, dv1, _ = reference.attention_backward(q, k, v, one, rows, rows, True, scale, tile=5)
        assert not dk1[:, :, i + 1:].any() and not dv1[:, :, i + 1:].any(), \
            f"causal: dO on query {i} alone gave keys after {i} a nonzero dK or dV"
        assert np.abs(dv1[:, :, :i + 1]).sum(-1).min() > 0, f"causal: a key <= {i} got no dV from query {i}"
        assert not np.delete(dq1, i, axis=2).any(), f"causal: dO on query {i} alone gave other rows a dQ"


def test_sample_grad_rows():
    for b, h, n in [(1, 1, 1), (2, 3, 17), (1, 16, 2048), (1, 1, 8192)]:
        for which in ("q", "kv"):
            rows = reference.sample_grad_rows(b, h, n, which)
            assert rows.dtype == np.int64 and np.array_equal(rows, every_row(n)), \
                f"B={b} H={h} N={n}: expected every {which} row, got {len(rows)}"
    for b, h, n in [(1, 1, 8193), (1, 16, 4096), (1, 16, 16384), (2, 8, 10000), (64, 32, 4096)]:
        forward = reference.sample_rows(b, h, n)
        samples = {which: reference.sample_grad_rows(b, h, n, which) for which in ("q", "kv")}
        for which, rows in samples.items():
            what = f"B={b} H={h} N={n} {which} rows"
            assert rows.dtype == np.int64 and np.all(np.diff(rows) > 0), f"{what}: not sorted, unique int64"
            assert rows[0] == 0 and rows[-1] == n - 1, f"{what}: the first and last row must be sampled"
            assert len(forward) <= len(rows) < n, f"{what}: {len(rows)} rows (the forward samples {len(forward)})"
            edges = [e for t in reference.GRAD_TILE_EDGES for e in (t, (n - 1) // t * t)]
            missing = [r for e in edges for r in (e - 1, e) if r not in set(rows.tolist())]
            assert not missing, f"{what}: the rows either side of the first and last tile edges {missing} are missing"
            assert np.array_equal(rows, reference.sample_grad_rows(b, h, n, which)), f"{what}: not deterministic"
        assert not np.array_equal(samples["q"], samples["kv"]), f"B={b} H={h} N={n}: query and key samples equal"
    for n in (1, 1000, 16384, 1 << 20):
        tile = reference.grad_tile_rows(n)
        assert 1 <= tile <= n and (tile == 1 or tile * n * 8 * reference.GRAD_LIVE_SCORES <= reference.CHUNK_BYTES), \
            f"N={n}: {tile} rows per backward step"


# --- the command line ----------------------------------------------------------------------------
def run(repo, *args):
    return repo.run([repo.python, SCRIPT, *args], timeout=300)


SHAPE = (1, 2, 33, 16)
SHAPE_ARGS = ["--batch", "1", "--heads", "2", "--seqlen", "33", "--headdim", "16", "--seed", "3"]
GRAD_FILES = [f"ref_c1_s0.3_{part}.npy" for part in ("dq_rows", "dq", "dkv_rows", "dk", "dv", "delta")]
FORWARD_FILES = [f"ref_c1_s0.3_{part}.npy" for part in ("rows", "o", "lse")]


def check_grad_files(folder, tag, q, k, v, do, causal, scale, what):
    """The gradient set in folder against the dense formula; returns the rows of dQ and of dK, dV."""
    dq_rows, kv_rows = (np.load(folder / f"ref_{tag}_{part}.npy") for part in ("dq_rows", "dkv_rows"))
    for name, rows in (("dq_rows", dq_rows), ("dkv_rows", kv_rows)):
        assert rows.dtype == np.int64 and rows.ndim == 1, f"{what}: {name} {rows.dtype} {rows.shape}"
    want = dense_backward(q, k, v, do, causal, scale)
    for part, rows, w in (("dq", dq_rows, want[0]), ("dk", kv_rows, want[1]), ("dv", kv_rows, want[2])):
        check_close(np.load(folder / f"ref_{tag}_{part}.npy"), w[:, :, rows], f"{what}: ref_{tag}_{part}.npy")
    check_close(np.load(folder / f"ref_{tag}_delta.npy"), want[3], f"{what}: ref_{tag}_delta.npy")
    return dq_rows, kv_rows


def test_inputs_grad_writes_do(repo, tmp_path):
    out = tmp_path
    proc = run(repo, "inputs", "--out", out, *SHAPE_ARGS, "--grad")
    assert proc.returncode == 0, f"inputs --grad failed ({proc.returncode}): {proc.stderr}"
    assert sorted(p.name for p in out.iterdir()) == ["do.npy", "k.npy", "q.npy", "v.npy"], \
        f"inputs --grad wrote {sorted(p.name for p in out.iterdir())}"
    do = np.load(out / "do.npy")
    assert do.dtype == np.float16 and do.shape == SHAPE, f"do.npy {do.dtype} {do.shape}"
    assert np.array_equal(do, reference.make_grad_output(*SHAPE, 3)), "do.npy differs from make_grad_output(seed 3)"
    assert abs(float(reference.make_grad_output(1, 4, 256, 64, 0).astype(np.float64).std()) - 1) < 0.05, \
        "dO should be N(0, 1)"
    for name, want in zip("qkv", reference.make_inputs(*SHAPE, 3)):
        assert np.array_equal(np.load(out / f"{name}.npy"), want), f"inputs --grad changed {name}.npy"
    assert not np.array_equal(do, reference.make_grad_output(*SHAPE, 4)), "seeds 3 and 4 gave the same dO"


def test_backward_writes_documented_files(repo, tmp_path):
    out = tmp_path / "data"
    proc = run(repo, "backward", "--out", out, *SHAPE_ARGS, "--scale", "0.3", "--causal")
    assert proc.returncode == 0, f"backward failed ({proc.returncode}): {proc.stderr}"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["q.npy", "k.npy", "v.npy", "do.npy"] + FORWARD_FILES + GRAD_FILES), \
        f"backward wrote {names}"
    q, k, v, do = (np.load(out / f"{n}.npy") for n in ("q", "k", "v", "do"))
    for x, want in zip((q, k, v, do), inputs_and_grad(*SHAPE, 3)):
        assert np.array_equal(x, want), "backward's inputs differ from make_inputs, make_grad_output of the seed"
    dq_rows, kv_rows = check_grad_files(out, "c1_s0.3", q, k, v, do, True, 0.3, "backward")
    assert np.array_equal(dq_rows, every_row(33)) and np.array_equal(kv_rows, every_row(33)), "small shape: every row"
    # The cache: a second run keeps what is there; another scale and mask go beside it.
    marker = np.zeros((1, 2, 33, 16))
    np.save(out / "ref_c1_s0.3_dk.npy", marker)
    proc = run(repo, "backward", "--out", out, *SHAPE_ARGS, "--scale", "0.3", "--causal")
    assert proc.returncode == 0, f"backward (cached) failed: {proc.stderr}"
    assert np.array_equal(np.load(out / "ref_c1_s0.3_dk.npy"), marker), "backward rewrote a cached gradient"
    proc = run(repo, "backward", "--out", out, *SHAPE_ARGS, "--scale", "0.5")
    assert proc.returncode == 0, f"backward --scale 0.5 failed: {proc.stderr}"
    check_grad_files(out, "c0_s0.5", q, k, v, do, False, 0.5, "backward --scale 0.5")
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name], "temporary files left behind"
    only = tmp_path / "no-ref"
    proc = run(repo, "backward", "--out", only, *SHAPE_ARGS, "--scale", "0.3", "--no-ref")
    assert proc.returncode == 0 and sorted(p.name for p in only.iterdir()) == ["do.npy", "k.npy", "q.npy", "v.npy"], \
        f"backward --no-ref: rc {proc.returncode}, wrote {sorted(p.name for p in only.iterdir())}"


def test_backward_input_folder(repo, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    rng = np.random.default_rng(8)
    arrays = [rng.standard_normal((2, 1, 20, 8)).astype(np.float16) for _ in range(4)]
    for name, array in zip(("q", "k", "v", "do"), arrays):
        np.save(src / f"{name}.npy", array)
    proc = run(repo, "backward", "--input", src, "--out", out, "--scale", "0.25")
    assert proc.returncode == 0, f"backward --input failed ({proc.returncode}): {proc.stderr}"
    check_grad_files(out, "c0_s0.25", *arrays, False, 0.25, "backward --input")
    assert (out / "ref_c0_s0.25_o.npy").is_file(), "backward --input should write the forward's reference too"
    assert sorted(p.name for p in src.iterdir()) == ["do.npy", "k.npy", "q.npy", "v.npy"], "backward changed SRC"


def test_backward_sampled_rows(repo, tmp_path):
    """Past FULL_PAIRS: sampled rows, exact (some of them checked with row and column formulas
    written here, the rows at tile edges among them), Delta of every row. The forward's set is
    planted beforehand and must be kept (the cache): computing it here would take seconds and
    1.6 GB, and test_reference.py checks it. Not causal, to keep the formulas here short (the
    causal sampled rows are checked in process above)."""
    b, h, n, d, scale = 1, 1, 8200, 16, 0.25
    assert b * h * n * n > reference.FULL_PAIRS, "test shape too small to be sampled"
    out = tmp_path
    forward_rows = reference.sample_rows(b, h, n)
    planted = {"rows": forward_rows, "o": np.zeros((b, h, len(forward_rows), d)),
               "lse": np.zeros((b, h, len(forward_rows)))}
    for part, array in planted.items():
        np.save(out / f"ref_c0_s0.25_{part}.npy", array)
    proc = run(repo, "backward", "--out", out, "--batch", "1", "--heads", "1", "--seqlen", str(n), "--headdim", str(d),
               "--seed", "2", "--scale", "0.25")
    assert proc.returncode == 0, f"backward at N={n} failed ({proc.returncode}): {proc.stderr}"
    for part, array in planted.items():
        assert np.array_equal(np.load(out / f"ref_c0_s0.25_{part}.npy"), array), \
            f"backward rewrote the forward's {part}"
    q, k, v, do = (np.load(out / f"{x}.npy")[0, 0].astype(np.float64) for x in ("q", "k", "v", "do"))
    dq_rows, kv_rows = (np.load(out / f"ref_c0_s0.25_{x}.npy") for x in ("dq_rows", "dkv_rows"))
    assert dq_rows[0] == 0 and dq_rows[-1] == n - 1 and len(dq_rows) < n and np.all(np.diff(dq_rows) > 0), \
        f"dq_rows: {len(dq_rows)} rows from {dq_rows[0]} to {dq_rows[-1]}"
    assert {63, 64, 127, 128, 8191, 8192} <= set(kv_rows.tolist()), "dkv_rows lacks rows at tile edges"
    # LSE and Delta of every row, 1024 rows at a time: what a key row's gradients need.
    lse, delta = np.empty(n), np.empty(n)
    for i0 in range(0, n, 1024):
        s = q[i0:i0 + 1024] @ k.T * scale
        m = s.max(-1, keepdims=True)
        lse[i0:i0 + 1024] = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[:, 0]
        delta[i0:i0 + 1024] = np.sum(do[i0:i0 + 1024] * (np.exp(s - lse[i0:i0 + 1024, None]) @ v), -1)
    check_close(np.load(out / "ref_c0_s0.25_delta.npy")[0, 0], delta, "Delta")
    rng = np.random.default_rng(0)
    some = lambda rows: np.unique(np.concatenate([np.arange(8), np.arange(len(rows) - 8, len(rows)),
                                                  np.searchsorted(rows, [63, 64, 127, 128, 8191, 8192]),
                                                  rng.choice(len(rows), 24, replace=False)]))
    picked = some(dq_rows)
    want_dq = []
    for i in dq_rows[picked]:  # a query row: its own row of P and dS
        p = np.exp(q[i] @ k.T * scale - lse[i])
        want_dq.append(scale * (p * (v @ do[i] - delta[i])) @ k)
    check_close(np.load(out / "ref_c0_s0.25_dq.npy")[0, 0, picked], np.array(want_dq), "sampled dQ")
    picked = some(kv_rows)
    want_dk, want_dv = [], []
    for j in kv_rows[picked]:  # a key row: its column of P and dS over every query
        p = np.exp(q @ k[j] * scale - lse)
        want_dv.append(p @ do)
        want_dk.append(scale * (p * (do @ v[j] - delta)) @ q)
    check_close(np.load(out / "ref_c0_s0.25_dk.npy")[0, 0, picked], np.array(want_dk), "sampled dK")
    check_close(np.load(out / "ref_c0_s0.25_dv.npy")[0, 0, picked], np.array(want_dv), "sampled dV")


# A folder of inputs --grad's files with one of them wrong: (label, the change, what the message names).
BAD_FOLDERS = [
    ("float32 dO", lambda f: np.save(f / "do.npy", np.load(f / "do.npy").astype(np.float32)), "float16"),
    ("no dO", lambda f: (f / "do.npy").unlink(), "do.npy"),
    ("dO of another N", lambda f: np.save(f / "do.npy", np.zeros((1, 2, 32, 16), np.float16)), "(1, 2, 33, 16)"),
    ("3-D dO", lambda f: np.save(f / "do.npy", np.zeros((2, 33, 16), np.float16)), "4-D"),
    ("k of another D", lambda f: np.save(f / "k.npy", np.zeros((1, 2, 33, 8), np.float16)), "shapes differ"),
    ("float64 q", lambda f: np.save(f / "q.npy", np.load(f / "q.npy").astype(np.float64)), "float16"),
]


@pytest.mark.parametrize("label, change, keyword", BAD_FOLDERS, ids=[label for label, _, _ in BAD_FOLDERS])
def test_backward_refuses_bad_input_folder(repo, tmp_path, label, change, keyword):
    """backward --input with a wrong file: exit 2, one line that names it, no gradient written.
    The folder holds what inputs --grad writes (test_inputs_grad_writes_do), one file changed."""
    folder, out = tmp_path / "in", tmp_path / "out"
    folder.mkdir()
    out.mkdir()
    for name, array in zip(("q", "k", "v", "do"), inputs_and_grad(*SHAPE, 3)):
        np.save(folder / f"{name}.npy", array)
    change(folder)
    proc = run(repo, "backward", "--input", folder, "--out", out, "--scale", "0.3")
    err = proc.stderr.strip()
    assert proc.returncode == 2, f"backward with {label}: expected exit 2, got {proc.returncode}; stderr {err!r}"
    assert "Traceback" not in err and len(err.splitlines()) == 1, f"backward with {label}: not one line: {err!r}"
    assert keyword in err, f"backward with {label}: stderr lacks {keyword!r}: {err!r}"
    assert not [p.name for p in out.iterdir() if "_d" in p.name], f"backward with {label} wrote gradients"


BAD_COMMAND_LINES = [(SHAPE_ARGS, "--scale"), (["--scale", "0.3"], "--batch"),
                     ([*SHAPE_ARGS, "--scale", "0"], "--scale")]


@pytest.mark.parametrize("args, keyword", BAD_COMMAND_LINES, ids=["no --scale", "no shape", "--scale 0"])
def test_backward_refuses_bad_command_line(repo, tmp_path, args, keyword):
    args = ["backward", "--out", str(tmp_path), *args]
    proc = run(repo, *args)
    assert proc.returncode == 2 and keyword in proc.stderr, \
        f"reference.py {' '.join(args)}: rc {proc.returncode}, stderr {proc.stderr.strip()!r}"
