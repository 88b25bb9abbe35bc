"""The decoding matrix (--decode), on a GPU: every chapter that registers a decode pass (and its steps), against
common/reference.py's float64 decode_reference on the paged cache reference.py writes (each sequence's
pages in a random order of the pool).

  matrix   D {64, 128} x (group size g = Hq / Hkv, page size P, new tokens Nq, cache lengths): g 1, 4
           and 8; P 1, 16 and 256; Nq 1 and 4; ragged lengths (one sequence as short as its new tokens,
           one a page and a token, one past a split of 256 keys): exit 0, PASS under the fp16 rule, the
           row's shape as given, two kernels (the split and the merge), the workspace the chapter says
"""
import csv

import pytest

from helpers import DECODE_CHAPTERS, STEP_BUILDS

pytestmark = pytest.mark.gpu

DECODE_FIELDS = ("impl,batch,q_heads,kv_heads,new,max_length,page_size,headdim,ms,gbps,rel_l2,status,max_abs,lse_err,"
                 "kernels,workspace_bytes,device_bytes").split(",")
# Each decoding chapter, and its steps before the last: (the impl its CSV row names, the build).
DECODE_BUILDS = [(c, c) for c in DECODE_CHAPTERS] + [(name, build) for name, build, _ in STEP_BUILDS
                                                    if build.split(".")[0] in DECODE_CHAPTERS]
# (B, Hq, Hkv, Nq, P, lengths)
CASES = [
    (3, 8, 8, 1, 16, "1,17,300"),        # g = 1; a sequence of one token, one of a page and a token
    (3, 16, 4, 4, 1, "4,257,1000"),      # g = 4, pages of one token, four new ones seeing each other
    (2, 32, 4, 1, 256, "513,4096"),      # g = 8, whole splits and a ragged one
    (2, 8, 1, 4, 16, "600,33"),          # g = 8 over one KV head
]


def run_decode(repo, impl, build, b, hq, hkv, new, page, lengths, d):
    args = ["--decode", "--batch", str(b), "--heads", str(hq), "--kv-heads", str(hkv), "--new", str(new),
            "--page-size", str(page), "--cache-len", lengths, "--headdim", str(d), "--warmup", "0", "--iters", "1",
            "--csv"]
    proc = repo.run([repo.require_binary(build), *args], timeout=300)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else f"{build}: exit 77")
    rows = [next(csv.reader([line])) for line in proc.stdout.splitlines() if line.startswith(impl + ",")]
    return proc, dict(zip(DECODE_FIELDS, rows[-1])) if rows else None


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b, hq, hkv, new, page, lengths", CASES,
                         ids=[f"B={c[0]} Hq={c[1]} Hkv={c[2]} Nq={c[3]} P={c[4]} L={c[5]}" for c in CASES])
@pytest.mark.parametrize("impl, build", DECODE_BUILDS, ids=[impl for impl, _ in DECODE_BUILDS])
def test_decode_matrix(repo, impl, build, b, hq, hkv, new, page, lengths, d):
    proc, row = run_decode(repo, impl, build, b, hq, hkv, new, page, lengths, d)
    shown = f"{build} --decode B={b} Hq={hq} Hkv={hkv} Nq={new} P={page} L={lengths} D={d}"
    assert proc.returncode == 0 and row and row["status"] == "PASS", (
        f"{shown}: expected PASS, got exit {proc.returncode}, row {row}, stderr {proc.stderr.strip()[-500:]!r}")
    echoed = tuple(int(row[k]) for k in ("batch", "q_heads", "kv_heads", "new", "max_length", "page_size", "headdim"))
    want = (b, hq, hkv, new, max(int(n) for n in lengths.split(",")), page, d)
    assert echoed == want, f"{shown}: the row reports {echoed}, expected {want}"
    assert row["kernels"] == "2", f"{shown}: {row['kernels']} kernels, expected 2 (the split and the merge)"
