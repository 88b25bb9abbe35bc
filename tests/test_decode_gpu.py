"""The decoding matrix (--decode), on a GPU: every chapter that registers a decode pass (and its steps), against
common/reference.py's float64 decode_reference on the paged cache reference.py writes (each sequence's
pages in a random order of the pool).

  matrix   D {64, 128} x (group size g = Hq / Hkv, page size P, new tokens Nq, cache lengths): g 1, 4
           and 8; P 1, 16 and 256; Nq 1 and 4; ragged lengths (one sequence as short as its new tokens,
           one a page and a token, one past a split of 256 keys), and 48 sequences of ragged lengths whose
           splits grow past 256 keys (11.4's rule): exit 0, PASS under the fp16 rule, the
           row's shape as given, two kernels (the split and the merge), the workspace the chapter says
  e4m3     the same matrix with --kv-cache e4m3 on the builds that read an e4m3 cache (a GPU of sm_89 on;
           below, the harness skips): PASS against the quantised cache's reference, and O against the fp16
           cache's reference off by e4m3's rounding alone (cache_rel_l2 under 8e-2: e4m3 rounds each
           element by up to 2^-4; float64 references of these cases give 3-4e-2)
"""
import csv

import pytest

from helpers import DECODE_CHAPTERS, STEP_BUILDS

pytestmark = pytest.mark.gpu

DECODE_FIELDS = ("impl,batch,q_heads,kv_heads,new,max_length,page_size,headdim,ms,gbps,rel_l2,status,max_abs,lse_err,"
                 "kernels,workspace_bytes,device_bytes,cache_rel_l2").split(",")
# Each decoding chapter, and its steps before the last: (the impl its CSV row names, the build).
DECODE_BUILDS = [(c, c) for c in DECODE_CHAPTERS] + [(name, build) for name, build, _ in STEP_BUILDS
                                                    if build.split(".")[0] in DECODE_CHAPTERS]
# (B, Hq, Hkv, Nq, P, lengths)
CASES = [
    (3, 8, 8, 1, 16, "1,17,300"),        # g = 1; a sequence of one token, one of a page and a token
    (3, 16, 4, 4, 1, "4,257,1000"),      # g = 4, pages of one token, four new ones seeing each other
    (2, 32, 4, 1, 256, "513,4096"),      # g = 8, whole splits and a ragged one
    (2, 8, 1, 4, 16, "600,33"),          # g = 8 over one KV head
    # B x Hkv = 384 blocks a split: 11.4's splits grow past 256 keys (1,024 on an H100); ragged lengths
    (48, 32, 8, 1, 16, ",".join(str(4096 - 85 * i) for i in range(48))),
]


CASE_IDS = [f"B={c[0]} Hq={c[1]} Hkv={c[2]} Nq={c[3]} P={c[4]} L={c[5] if len(c[5]) < 24 else c[5][:9] + '...'}"
            for c in CASES]


def run_decode(repo, impl, build, b, hq, hkv, new, page, lengths, d, *extra):
    args = ["--decode", "--batch", str(b), "--heads", str(hq), "--kv-heads", str(hkv), "--new", str(new),
            "--page-size", str(page), "--cache-len", lengths, "--headdim", str(d), "--warmup", "0", "--iters", "1",
            "--csv", *extra]
    proc = repo.run([repo.require_binary(build), *args], timeout=300)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else f"{build}: exit 77")
    rows = [next(csv.reader([line])) for line in proc.stdout.splitlines() if line.startswith(impl + ",")]
    assert all(len(row) == len(DECODE_FIELDS) for row in rows), f"{build}: rows of another width: {rows}"
    return proc, dict(zip(DECODE_FIELDS, rows[-1])) if rows else None


def assert_passed(proc, row, shown):
    """Exit 0, a PASS row, and two kernels (the split and the merge)."""
    assert proc.returncode == 0 and row and row["status"] == "PASS", (
        f"{shown}: expected PASS, got exit {proc.returncode}, row {row}, stderr {proc.stderr.strip()[-500:]!r}")
    assert row["kernels"] == "2", f"{shown}: {row['kernels']} kernels, expected 2 (the split and the merge)"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b, hq, hkv, new, page, lengths", CASES,
                         ids=CASE_IDS)
@pytest.mark.parametrize("impl, build", DECODE_BUILDS, ids=[impl for impl, _ in DECODE_BUILDS])
def test_decode_matrix(repo, impl, build, b, hq, hkv, new, page, lengths, d):
    proc, row = run_decode(repo, impl, build, b, hq, hkv, new, page, lengths, d)
    shown = f"{build} --decode B={b} Hq={hq} Hkv={hkv} Nq={new} P={page} L={lengths} D={d}"
    assert_passed(proc, row, shown)
    echoed = tuple(int(row[k]) for k in ("batch", "q_heads", "kv_heads", "new", "max_length", "page_size", "headdim"))
    want = (b, hq, hkv, new, max(int(n) for n in lengths.split(",")), page, d)
    assert echoed == want, f"{shown}: the row reports {echoed}, expected {want}"


# The builds that read an e4m3 cache (--kv-cache e4m3): the chapter, from 11.5; its CSV rows name it impl.e4m3.
E4M3_BUILDS = [(c + ".e4m3", c) for c in DECODE_CHAPTERS]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b, hq, hkv, new, page, lengths", CASES,
                         ids=CASE_IDS)
@pytest.mark.parametrize("impl, build", E4M3_BUILDS, ids=[impl for impl, _ in E4M3_BUILDS])
def test_decode_matrix_e4m3_cache(repo, impl, build, b, hq, hkv, new, page, lengths, d):
    proc, row = run_decode(repo, impl, build, b, hq, hkv, new, page, lengths, d, "--kv-cache", "e4m3")
    shown = f"{build} --decode --kv-cache e4m3 B={b} Hq={hq} Hkv={hkv} Nq={new} P={page} L={lengths} D={d}"
    assert_passed(proc, row, shown)
    assert 0 < float(row["cache_rel_l2"]) < 8e-2, (
        f"{shown}: O against the fp16 cache's reference, rel L2 {row['cache_rel_l2']}: e4m3's rounding gives about 3-4e-2")


def test_decode_input_folder_is_checked_against_its_own_reference(repo, tmp_path):
    """--decode --input DIR, a folder of one's own: reference.py decode's files with the table and lengths as
    int32, a page no sequence uses added to the pools and the table's pages moved to where it was. PASS
    against reference.py decode --input's float64 reference of the folder, which the harness writes under
    FA_CACHE/decode_input_<hash of the five files> (the scale 1/sqrt(D) = 0.125 names it)."""
    import numpy as np
    import reference
    folder = tmp_path / "in"
    assert reference.main(["decode", "--out", str(folder), "--batch", "3", "--heads", "16", "--kv-heads", "4", "--new",
                           "4", "--headdim", "64", "--page-size", "16", "--lengths", "4,257,1000", "--scale", "0.125",
                           "--no-ref"]) == 0
    arrays = {name: np.load(folder / f"{name}.npy") for name in reference.DECODE_INPUTS}
    rng = np.random.default_rng(5)
    for name in ("k_pool", "v_pool"):  # page 0 moves to the end; a new page 0 no sequence reads
        pool = arrays[name]
        arrays[name] = np.concatenate([rng.standard_normal(pool[:1].shape).astype(np.float16), pool[1:], pool[:1]])
    table = arrays["block_table"]
    table = np.where(table == 0, len(arrays["k_pool"]) - 1, table)
    arrays["block_table"], arrays["lengths"] = table.astype(np.int32), arrays["lengths"].astype(np.int32)
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", array)
    cache = tmp_path / "cache"
    binary = repo.require_binary(DECODE_CHAPTERS[0])
    proc = repo.run([binary, "--decode", "--input", str(folder), "--warmup", "0", "--iters", "1", "--csv"],
                    env={"FA_CACHE": str(cache)}, timeout=300)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "exit 77")
    rows = [dict(zip(DECODE_FIELDS, next(csv.reader([line])))) for line in proc.stdout.splitlines()
            if line.startswith(DECODE_CHAPTERS[0] + ",")]
    assert proc.returncode == 0 and rows and rows[-1]["status"] == "PASS", (
        f"--decode --input: exit {proc.returncode}, rows {rows}, stderr {proc.stderr.strip()[-500:]!r}")
    echoed = tuple(int(rows[-1][k]) for k in ("batch", "q_heads", "kv_heads", "new", "max_length", "page_size"))
    assert echoed == (3, 16, 4, 4, 1000, 16), f"the row reports {echoed}"
    refs = sorted(p.relative_to(cache).as_posix() for p in cache.glob("decode_input_*/*"))
    assert len(refs) == 2 and all(r.endswith(("ref_decode_s0.125_lse.npy", "ref_decode_s0.125_o.npy")) for r in refs), (
        f"the folder's reference in FA_CACHE: {refs}")


def test_decode_says_its_share_of_the_copy(repo):
    """The decoding report's bandwidth line: the GB/s of K and V against this GPU's device-to-device copy as
    `make peaks` measured it (docs/results/logs/common/peaks_<gpu>.log, the GPU the report's gpu line names,
    as results.gpu_slug names its files), or, where that log is absent, that it is not measured, naming the
    file make peaks writes."""
    import re

    import results
    proc = repo.run([repo.require_binary(DECODE_CHAPTERS[0]), "--decode", "--batch", "1", "--heads", "8", "--kv-heads",
                     "2", "--cache-len", "4096", "--headdim", "128", "--no-check", "--warmup", "1", "--iters", "3"],
                    timeout=300)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "exit 77")
    gbps = float(re.search(r"([\d.]+) GB/s of K and V", proc.stdout).group(1))
    gpu = re.search(r"^  gpu       (.*) \(sm_\d+\)$", proc.stdout, re.M)
    assert gpu, f"no gpu line in the decoding report:\n{proc.stdout}"
    log = repo.root / "docs/results/logs/common" / f"peaks_{results.gpu_slug(gpu.group(1))}.log"
    copy_line = re.search(r"^device-to-device copy \([^)]*\)\s+([\d.]+) TB/s", log.read_text(), re.M) if log.is_file() else None
    if not copy_line:
        assert f"  bandwidth against the copy: not measured on this GPU (make peaks writes {log})" in proc.stdout, (
            proc.stdout)
        return
    copy = float(copy_line.group(1))
    said = re.search(r"^  bandwidth (\d+)% of this GPU's device-to-device copy, ([\d.]+) TB/s \(make peaks: (.*)\)$",
                     proc.stdout, re.M)
    assert said and said.group(3) == str(log) and float(said.group(2)) == copy, proc.stdout
    assert abs(int(said.group(1)) - gbps / 10 / copy) <= 0.6, proc.stdout  # the GB/s printed to 0.1, the % to 1
