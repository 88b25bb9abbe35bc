"""CPU tests of the backward's rows in the bench: its results file beside the forward's, its sweep
(on fake binaries), its anchors (without PyTorch, and on PyTorch's CPU tensors where PyTorch is
installed), its tables and its inline values.

No GPU, PyTorch or matplotlib needed. Each test_* function takes no arguments; tests/run.py runs them
(`tests/run.py --suite cpu -k stages_backward`).
"""
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURES = os.path.join(HERE, "fixtures")
sys.path.insert(0, os.path.join(ROOT, "common"))
sys.path.insert(0, HERE)

import anchors  # noqa: E402
import report  # noqa: E402
import results  # noqa: E402
import stages  # noqa: E402
from test_stages import (FIXTURE_CSV, FIXTURE_GPU, assert_golden, make_fake_build, quiet, read, value,  # noqa: E402
                         without_torch)

BACKWARD_CSV = os.path.join(FIXTURES, "FAKE_GPU.backward.csv")
ISOLATED = True  # it swaps sys.stdout, and stands in for stages.prepare_references: a process of its own


def backward_rows():
    """The made-up backward results of tests/fixtures/FAKE_GPU.backward.csv (with its notes)."""
    return results.read_results(BACKWARD_CSV)


# --- The results file of the backward ----------------------------------------------------------

def test_backward_csv_round_trip():
    shape = results.bench_shape(128, 4096, 0)
    rows = [results.make_row("09_backward", shape, "PASS", 6.58, 208.87, 3.1e-4, device_bytes=673185792,
                             grads=(3.1e-4, 2.9e-4, 2.8e-4)),
            results.make_row("torch_eager", dict(shape, causal=1), "SKIP", note="out of memory: x",
                             grads=(None, None, None))]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "NVIDIA_H200.backward.csv")
        assert results.csv_pass(path) == "backward" and results.csv_pass(os.path.join(tmp, "NVIDIA_H200.csv")) == \
            "forward"
        assert results.pass_csv(path, "forward") == os.path.join(tmp, "NVIDIA_H200.csv")
        assert results.pass_csv(os.path.join(tmp, "NVIDIA_H200.csv"), "backward") == path
        results.write_results(path, rows)
        lines = read(path).splitlines()
        assert lines[0] == ("impl,batch,heads,seqlen,headdim,causal,dtype,ms,tflops,rel_l2,status,device_bytes,"
                            "dq_rel_l2,dk_rel_l2,dv_rel_l2"), lines[0]
        assert tuple(lines[0].split(",")) == results.CSV_FIELDS + results.GRAD_FIELDS
        assert lines[1] == "09_backward,4,16,4096,128,0,fp16,6.58,208.87,0.00031,PASS,673185792,0.00031,0.00029,0.00028"
        assert lines[2] == "torch_eager,4,16,4096,128,1,fp16,,,,SKIP,,,,"
        assert os.path.exists(os.path.join(tmp, "NVIDIA_H200.backward.notes.csv"))
        assert not os.path.exists(os.path.join(tmp, "NVIDIA_H200.csv")), "the forward's file was written"
        back = results.read_results(path)
        assert back == rows, back
        assert results.env_path(path).endswith("NVIDIA_H200.backward.env")
        # A forward file never gets the gradients' columns, whatever its rows hold.
        forward = os.path.join(tmp, "NVIDIA_H200.csv")
        results.write_results(forward, rows)
        assert read(forward).splitlines()[0].endswith(",status,device_bytes")
        assert "dq_rel_l2" not in results.read_results(forward)[0]


def test_backward_flops_and_tolerances():
    shape = results.bench_shape(128, 4096, 0)  # forward 5.4976e11 FLOPs: 549.76 TFLOP/s at 1 ms
    assert abs(results.backward_tflops(shape, 1.0) - 2.5 * 549.7558) < 1e-2
    assert abs(results.backward_tflops(dict(shape, causal=1), 6.58) - 104.44) < 1e-2
    harness = read(os.path.join(ROOT, "common", "harness.cu"))
    found = re.search(r"static const double BACKWARD_REL_L2_TOL = ([0-9.e-]+);", harness)
    assert found and float(found.group(1)) == results.BACKWARD_REL_L2_TOL, "the harness's backward bound moved"
    assert anchors.REL_L2_TOL == results.ANCHOR_REL_L2_TOL == 3e-3
    assert results.BACKWARD_ANCHORS == ("torch_flash", "torch_cudnn", "torch_efficient", "torch_eager")


def test_backward_builds_from_the_sources_and_the_makefile():
    """The chapters whose backward the bench times are those that define a `Backward`; their variant
    builds are the Makefile's VARIANT_BUILDS, which `make all` builds."""
    assert results.VARIANTS == {"09_backward": ("09_backward.deterministic",)}, results.VARIANTS
    chapters = sorted(os.path.basename(os.path.dirname(p)) for p in
                      __import__("glob").glob(os.path.join(ROOT, "[0-9][0-9]_*", "attention.cu")))
    timed = {c: results.backward_builds(c) for c in chapters if results.backward_builds(c)}
    assert timed == {"09_backward": ("09_backward", "09_backward.deterministic")}, timed
    assert [name for name, _, _ in stages.backward_binaries("b", chapters)] == \
        ["09_backward", "09_backward.deterministic"]
    assert stages.backward_binaries("b", ["07_async_pipeline", "08_fp8"]) == []
    with tempfile.TemporaryDirectory() as tmp:
        makefile = os.path.join(tmp, "Makefile")
        with open(makefile, "w") as f:
            f.write("VARIANT_BUILDS := 09_backward.deterministic 10_x.fast 10_x.small\nall: $(VARIANT_BUILDS)\n")
        assert results._variants(makefile) == {"09_backward": ("09_backward.deterministic",),
                                              "10_x": ("10_x.fast", "10_x.small")}
        assert results._variants(os.path.join(tmp, "none")) == {}
        source = os.path.join(tmp, "attention.cu")
        for text, has in (("// no Backward here\nconst Chapter chapter = {NULL};\n", False),
                          ("static const Backward backward_pass = {workspace, backward};\n", True)):
            with open(source, "w") as f:
                f.write(text)
            assert __import__("chapters").has_backward(source) == has, text


# --- Tables ------------------------------------------------------------------------------------

def test_backward_page_matches_golden():
    env = results.read_env(os.path.join(FIXTURES, "FAKE_GPU.backward.env"))
    got = report.backward_results_markdown(backward_rows(), env, "FAKE_GPU.backward.csv")
    assert_golden(got, "FAKE_GPU.backward.md", "backward page")


def test_backward_chapter_block_matches_golden():
    got = report.backward_chapter_markdown(backward_rows(), "09_backward", "../docs/results/FAKE_GPU.backward.csv",
                                           FIXTURE_GPU)
    assert_golden(got, "chapter_09_backward.md", "backward block")


def test_backward_cells_hand_computed():
    rows = backward_rows()
    # D=128 N=4096 non-causal: 09 6.58 ms, FA2 5.06 ms: 5.06 / 6.58 = 0.769; 2.5 x 549.76 / 6.58 = 208.9.
    # Memory: 8 tensors of 64 MiB, LSE and D (1 MiB each), the fp32 dQ accumulator (128 MiB): 673 MB,
    # of which 405 MB beyond Q, K, V, dO (4 x 67.1 MB); FA2's 846 MB holds 578 MB beyond them.
    body = {line[0]: line for line in report.backward_headline_body(rows)}
    assert body["09_backward"] == ["09_backward", "673 MB", "405 MB", "6.58", "208.9", "0.77x",
                                   "3.41", "201.5", "0.85x"], body["09_backward"]
    assert body["torch_flash"][1:3] == ["846 MB", "578 MB"] and body["torch_flash"][5] == "1.00x"
    assert body["torch_eager"][1:3] == ["18.87 GB", "18.60 GB"] and body["torch_eager"][6:] == ["skip", "-", "-"]
    assert list(body) == ["09_backward", "09_backward.deterministic", "torch_flash", "torch_cudnn",
                          "torch_efficient", "torch_eager"]
    table = report.backward_sweep_table(rows, 128, 0)
    assert "| 09_backward | 286.3 (0.75x) | 208.9 (0.77x) |" in table, table  # 0.90 / 1.2 = 0.75
    assert "| torch_flash | 381.8 | 271.6 |" in table, table
    assert "| torch_efficient | - | FAIL |" in report.backward_sweep_table(rows, 64, 0)
    errors = report.grad_error_table(rows)
    assert "| 09_backward | causal | 3.1e-04 | 2.9e-04 | 2.8e-04 | 2.1e-03 FAIL | 2.9e-04 | 2.8e-04 |" in errors, errors
    assert "| torch_eager | causal | skip | skip | skip | 1.1e-03 | 9.8e-04 | 8.1e-04 |" in errors, errors
    # An anchor's bound is 3e-3: eager's 1.1e-3 passes, efficient's 4.2e-3 is marked.
    assert "| torch_efficient | non-causal | 3.7e-04 | 3.8e-04 | 3.6e-04 | 4.2e-03 FAIL | 3.8e-04 | 3.6e-04 |" \
        in errors, errors


def test_backward_inline_values():
    rows, bwd = [], backward_rows()
    want = {
        "bwd 09 D128 N4k nc tflops": "208.9",
        "bwd 09 D128 N4k nc x FA2": "0.77x",                    # 5.06 / 6.58
        "bwd 09.deterministic D128 N4k nc x FA2": "0.81x",      # 5.06 / 6.21
        "bwd 09_backward.deterministic D128 N4k causal ms": "3.35",
        "bwd 09,09.deterministic D128 N4k * x FA2": "0.77-0.87x",
        "bwd torch_eager D128 N4k nc mem": "18.87 GB",
        "bwd 09 D128 N4k nc dq_rel_l2": "3.1e-04",
        "bwd FA2 D128 N4k nc % cuDNN": "55%",                   # 271.62 / 492.61
    }
    text = "".join(f"{spec}: {value(spec)}\n" for spec in want)
    filled, warnings = report.fill_values(text, rows, "page.md", bwd)
    assert filled == "".join(f"{spec}: {value(spec, got)}\n" for spec, got in want.items()), filled
    assert warnings == []
    # A forward marker reads the forward's rows, a bwd one the backward's; a pass without its file (None)
    # leaves its markers as they are.
    forward = results.read_results(FIXTURE_CSV)
    text = f"{value('07 D128 N4k nc ms')} {value('bwd 09 D128 N4k nc ms')}"
    assert report.fill_values(text, forward, "x", None) == (f"{value('07 D128 N4k nc ms', '2.12')} "
                                                           f"{value('bwd 09 D128 N4k nc ms')}", [])
    assert report.fill_values(text, None, "x", bwd) == (f"{value('07 D128 N4k nc ms')} "
                                                       f"{value('bwd 09 D128 N4k nc ms', '6.58')}", [])
    filled, warnings = report.fill_values(value("bwd 09 D64 N4k causal ms"), forward, "x", bwd)  # FAILed
    assert filled == value("bwd 09 D64 N4k causal ms", "n/a") and len(warnings) == 1, (filled, warnings)
    for bad, message in ((value("07 D128 N4k nc dq_rel_l2"), "bad quantity"), (value("bwd 09 D128 N4k"), "too few")):
        try:
            report.fill_values(bad, forward, "x", bwd)
        except ValueError as exc:
            assert message in str(exc), str(exc)
        else:
            raise AssertionError(f"accepted {bad}")


def test_resolve_impl_with_variants():
    bwd = backward_rows()
    assert report.resolve_impl(bwd, "09") == "09_backward"
    assert report.resolve_impl(bwd, "09.deterministic") == "09_backward.deterministic"
    assert report.resolve_impl(bwd, "09.fast") == "09.fast"  # no such build: as it is (n/a)
    assert report.resolve_impl(bwd, "FA2") == "torch_flash"
    forward = results.read_results(FIXTURE_CSV)
    assert report.resolve_impl(forward, "07") == "07_async_pipeline"
    shape = results.bench_shape(128, 4096, 0)
    steps = [results.make_row(n, shape, "PASS", 1.0, 1.0, 1e-4) for n in ("08.3", "08_fp8")]
    assert report.resolve_impl(steps, "08") == "08_fp8" and report.resolve_impl(steps, "08.3") == "08.3"
    assert report.resolve_impl(steps, "08.5") == "08_fp8"


def test_regenerate_backward_on_a_tree():
    """`table` from either pass's CSV writes both pages; the backward's block goes to the README of
    the chapter that has one; without a backward file its block and its values are left alone."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "docs", "results")
        os.makedirs(out)
        forward_csv = os.path.join(out, "FAKE_GPU.csv")
        readme = os.path.join(tmp, "README.md")
        with open(readme, "w") as f:
            f.write(f"{report.STAGE_BEGIN}\n{report.STAGE_END}\n07 {value('07 D128 N4k nc ms')}, "
                    f"09 {value('bwd 09 D128 N4k nc x FA2')}\n")
        os.mkdir(os.path.join(tmp, "09_backward"))
        chapter = os.path.join(tmp, "09_backward", "README.md")
        stale = f"# 09\n{report.BACKWARD_BEGIN}\nnot measured yet\n{report.BACKWARD_END}\n"
        with open(chapter, "w") as f:
            f.write(stale)
        results.write_results(forward_csv, results.read_results(FIXTURE_CSV))
        _, printed = quiet(report.regenerate_tables, forward_csv, readme)
        assert read(chapter) == stale, "the backward block changed without a backward file"
        assert read(readme).endswith(f"07 {value('07 D128 N4k nc ms', '2.12')}, 09 {value('bwd 09 D128 N4k nc x FA2')}\n")
        assert not os.path.exists(os.path.join(out, "FAKE_GPU.backward.md"))
        backward_csv = os.path.join(out, "FAKE_GPU.backward.csv")
        results.write_results(backward_csv, backward_rows())
        shutil.copyfile(os.path.join(FIXTURES, "FAKE_GPU.backward.env"), results.env_path(backward_csv))
        for path in (backward_csv, forward_csv):  # from either pass's file
            with open(chapter, "w") as f:
                f.write(stale)
            _, printed = quiet(report.regenerate_tables, path, readme)
            assert "warning:" not in printed, printed
            assert read(chapter) == (f"# 09\n{report.BACKWARD_BEGIN}\n\n"
                                     + read(os.path.join(FIXTURES, "chapter_09_backward.md")) + "\n"
                                     f"{report.BACKWARD_END}\n"), read(chapter)
            assert read(os.path.join(out, "FAKE_GPU.backward.md")) == read(os.path.join(FIXTURES, "FAKE_GPU.backward.md"))
            assert read(readme).endswith(f"09 {value('bwd 09 D128 N4k nc x FA2', '0.77x')}\n"), read(readme)
            assert "| 07_async_pipeline |" in read(readme), "the forward's stage table was not written"
        # Only the backward's file: the forward's tables and values are left as they are.
        os.remove(forward_csv)
        with open(readme, "w") as f:
            f.write(f"{report.STAGE_BEGIN}\nstale\n{report.STAGE_END}\n07 {value('07 D128 N4k nc ms', 'old')}\n")
        quiet(report.regenerate_tables, backward_csv, readme)
        assert read(readme) == f"{report.STAGE_BEGIN}\nstale\n{report.STAGE_END}\n07 {value('07 D128 N4k nc ms', 'old')}\n"
        assert stages.default_csv(out) == backward_csv  # a backward file alone is the one to read
        results.write_results(forward_csv, results.read_results(FIXTURE_CSV))
        os.utime(forward_csv, (1, 1))
        assert stages.default_csv(out) == forward_csv  # the forward's, however old, with the backward's beside it
        try:
            report.regenerate_tables(os.path.join(out, "NONE.csv"), readme)
        except ValueError as exc:
            assert "no such results CSV" in str(exc)
        else:
            raise AssertionError("a missing CSV was accepted")


# --- The sweep, on fake binaries -----------------------------------------------------------------

def backward_fake_build(tmp, names):
    """Fake binaries (tests/test_stages.py's), these names, under tmp/build."""
    make_fake_build(os.path.join(tmp, "build"), names)
    return os.path.join(tmp, "build")


def bench(tmp, *argv):
    """stages.py bench into tmp/results (README tmp/README.md), PyTorch absent, the references'
    step recorded instead of run; (exit code, printed, the shapes it was asked to prepare)."""
    readme = os.path.join(tmp, "README.md")
    if not os.path.exists(readme):
        with open(readme, "w") as f:
            f.write(f"{report.STAGE_BEGIN}\n{report.STAGE_END}\n")
    asked = []
    saved = stages.prepare_references, stages.gpu_name
    stages.prepare_references = lambda shapes, *a, **k: asked.append(list(shapes))
    stages.gpu_name = lambda: "FAKE GPU"  # as on a GPU machine: the references are made first
    try:
        args = stages.parse_args(["bench", "--build", os.path.join(tmp, "build"), "--quick", "--out",
                                  os.path.join(tmp, "results"), "--readme", readme] + list(argv))
        code, printed = without_torch(stages.command_bench, args)
    finally:
        stages.prepare_references, stages.gpu_name = saved
    return code, printed, asked


def result_files(tmp):
    return sorted(os.listdir(os.path.join(tmp, "results"))) if os.path.isdir(os.path.join(tmp, "results")) else []


def test_bench_backward_on_fake_binaries():
    """--pass backward times each build of a chapter with a backward (09_backward and its variant) with
    --backward, into <gpu>.backward.csv alone; --pass both (make bench) does the forward's first."""
    with tempfile.TemporaryDirectory() as tmp:
        backward_fake_build(tmp, ["05_good", "09_backward", "09_backward.deterministic"])
        code, printed, asked = bench(tmp, "--pass", "backward", "05_good", "09_backward")
        assert code == 0, printed
        assert len(asked) == 1 and len(asked[0]) == 8, asked  # --quick: 2 N x 2 D x 2 masks
        files = result_files(tmp)
        assert files == ["FAKE_GPU.backward.csv", "FAKE_GPU.backward.env", "FAKE_GPU.backward.md",
                         "FAKE_GPU.backward.notes.csv"], files
        rows = results.read_results(os.path.join(tmp, "results", "FAKE_GPU.backward.csv"))
        assert sorted({r["impl"] for r in rows}) == ["09_backward", "09_backward.deterministic"], rows
        assert len(rows) == 16
        row = results.find_row(rows, "09_backward.deterministic", 128, 4096, 0)
        # The fake binary's backward: 2.5 ms at N=4k (2.5x its forward), TFLOP/s with 2.5x the forward's FLOPs.
        assert row["status"] == "PASS" and row["ms"] == 40.0 and abs(row["tflops"] - 34.36) < 0.01, row
        assert (row["dq_rel_l2"], row["dk_rel_l2"], row["dv_rel_l2"]) == (3.1e-4, 2.9e-4, 2.8e-4), row
        assert row["rel_l2"] == 3.1e-4 and row["device_bytes"] == 8 * 4 * 16 * 4096 * 128 * 2 + 4 * 16 * 4096 * 4
        env = results.read_env(os.path.join(tmp, "results", "FAKE_GPU.backward.env"))
        assert env["pass"] == "backward", env
        assert "The backward at D=128 N=4096" in printed and "09_backward.deterministic" in printed, printed
        page = read(os.path.join(tmp, "results", "FAKE_GPU.backward.md"))
        # 8 tensors of 67.1 MB and LSE (1 MB), no workspace: 538 MB, 269 MB beyond Q, K, V, dO; no FA2 row here.
        assert "| 09_backward.deterministic | 538 MB | 269 MB | 40.0 | 34.4 | - | 40.0 | 17.2 | - |" in page, page

        # make bench: the forward's sweep, then the backward's; the backward's rows replaced, the file's others kept.
        code, printed, asked = bench(tmp, "05_good", "09_backward")
        assert code == 0 and len(asked) == 1, printed
        forward = results.read_results(os.path.join(tmp, "results", "FAKE_GPU.csv"))
        assert sorted({r["impl"] for r in forward}) == ["05_good", "09_backward"], forward
        assert "dq_rel_l2" not in forward[0] and results.find_row(forward, "09_backward", 128, 4096, 0)["ms"] == 16.0
        again = results.read_results(os.path.join(tmp, "results", "FAKE_GPU.backward.csv"))
        assert again == rows, "the backward's rows changed"
        assert printed.index("bench: 2 builds") < printed.index("bench --backward: 2 builds"), printed


def test_bench_backward_skips_and_refusals():
    with tempfile.TemporaryDirectory() as tmp:
        backward_fake_build(tmp, ["05_good", "09_backward", "09_backward.deterministic.old"])
        # A chapter without a backward pass: --pass backward has nothing to time.
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code, printed, _ = bench(tmp, "--pass", "backward", "05_good")
        assert code == 2 and result_files(tmp) == [], (code, printed)
        assert "none of 05_good has a backward pass (the chapters that have one: 09_backward)" in err.getvalue()
        # make bench of chapters without one: the forward's sweep alone.
        code, printed, asked = bench(tmp, "05_good")
        assert code == 0 and asked == [] and "--backward" not in printed, printed
        assert [f for f in result_files(tmp) if not f.endswith(".png")] == \
            ["FAKE_GPU.csv", "FAKE_GPU.env", "FAKE_GPU.md", "FAKE_GPU.notes.csv"], result_files(tmp)
    with tempfile.TemporaryDirectory() as tmp:
        # Both builds skip (no GPU, exit 77): nothing measured, nothing written.
        code, printed, _ = bench_skipping(tmp)
        assert code == 77 and result_files(tmp) == [], (code, printed)
        assert "nothing measured" in printed, printed
        # A variant build speaks with its chapter's name (09_backward: skipped: ...): its note is the reason alone.
        assert results.build_chapter("09_backward.deterministic") == "09_backward"
        assert results.build_chapter("08.3") == "08.3" and results.build_chapter("09_backward") == "09_backward"
        row = stages.bench_one(os.path.join(tmp, "build", "09_backward.deterministic"), "09_backward.deterministic",
                               "fp16", results.bench_shape(128, 1024, 0), None, {}, "backward")
        assert (row["status"], row["note"], row["dq_rel_l2"]) == ("SKIP", "no CUDA GPU available (x)", None), row


def bench_skipping(tmp):
    """A backward bench whose every binary exits 77 (fake binaries made to skip)."""
    os.makedirs(os.path.join(tmp, "build"))
    for name in ("09_backward", "09_backward.deterministic"):
        path = os.path.join(tmp, "build", name)
        with open(path, "w") as f:
            f.write(f"#!{sys.executable}\nimport sys\nprint('09_backward: skipped: no CUDA GPU available (x)')\n"
                    "sys.exit(77)\n")
        os.chmod(path, 0o755)
    return bench(tmp, "--pass", "backward", "09_backward")


def test_prepare_references_makes_the_harness_files():
    """The backward's references made ahead, several shapes at once, are the very files the harness
    looks for (reference.py backward in <cache>/b{B}_h{H}_n{N}_d{D}_seed0, tag c<causal>_s<scale>)."""
    shapes = [{"batch": 1, "heads": 2, "seqlen": 64, "headdim": d, "causal": c} for d in (64, 128) for c in (0, 1)]
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.environ.get("FA_CACHE")
        os.environ["FA_CACHE"] = tmp
        try:
            _, printed = quiet(stages.prepare_references, shapes, "backward", 2)
        finally:
            if saved is None:
                del os.environ["FA_CACHE"]
            else:
                os.environ["FA_CACHE"] = saved
        assert "4 shapes, 2 at once" in printed and "FAILED" not in printed, printed
        for shape in shapes:
            folder, argv = anchors.reference_args(tmp, shape, "backward")
            assert folder == os.path.join(tmp, f"b1_h2_n64_d{shape['headdim']}_seed0"), folder
            scale = "0.125" if shape["headdim"] == 64 else "0.0883883461"  # the harness's %.9g of 1/sqrtf(D)
            assert argv[argv.index("--scale") + 1] == scale, argv
            for part in ("q", "k", "v", "do"):
                assert os.path.exists(os.path.join(folder, f"{part}.npy")), (folder, part)
            for part in ("rows", "o", "lse", "dq", "dk", "dv", "dq_rows", "dkv_rows"):
                name = f"ref_c{shape['causal']}_s{scale}_{part}.npy"
                assert os.path.exists(os.path.join(folder, name)), (folder, name)


# --- The anchors -------------------------------------------------------------------------------------

def test_anchors_import_and_skip_without_torch():
    """anchors.py imports with NumPy alone, and without PyTorch its backward rows are skipped in one line."""
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); import anchors; "
            "rows = anchors.run_anchors([dict(batch=1, heads=1, seqlen=8, headdim=64, causal=0)], '/nonexistent', "
            "pass_='backward'); assert rows == [], rows; print('imported')")
    proc = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "common")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "imported" in proc.stdout and "PyTorch not found" in proc.stdout, \
        f"exit {proc.returncode}: {proc.stdout} {proc.stderr}"


def test_attempt_reasons():
    """What an anchor that cannot run says: out of memory, a missing kernel (RuntimeError); any other
    exception is a bug and propagates, except for the cuDNN frontend's (lenient)."""
    class OutOfMemory(RuntimeError):
        pass
    emptied = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(OutOfMemoryError=OutOfMemory,
                                                            empty_cache=lambda: emptied.append(1)))

    def raising(exc):
        def run():
            raise exc
        return run
    assert anchors.attempt(fake, "torch_eager", lambda: 42) == (42, None)
    done, reason = anchors.attempt(fake, "torch_eager", raising(OutOfMemory("CUDA out of memory. Tried 8 GiB\nmore")))
    assert done is None and reason == "out of memory: CUDA out of memory. Tried 8 GiB", reason
    assert anchors.attempt(fake, "torch_eager", raising(RuntimeError("No available kernel")))[1] == "No available kernel"
    assert len(emptied) == 2
    try:
        anchors.attempt(fake, "torch_eager", raising(KeyError("bug")))
    except KeyError:
        pass
    else:
        raise AssertionError("a KeyError was taken for a reason to skip")
    assert anchors.attempt(fake, "cudnn_fp8", raising(KeyError("frontend")), lenient=True)[1] == "'frontend'"


def test_backward_anchors_on_cpu_torch():
    """The anchors' backward on PyTorch's CPU tensors (tests/fixtures/anchors_on_cpu.py stands in for
    the CUDA calls): dO and the reference gradients found in the cache, each gradient's error as the
    harness measures it, device memory counted as documented, a SKIP for a backend with no CPU kernel,
    and no forward inside a backward's timed window."""
    import importlib.util
    if importlib.util.find_spec("torch") is None:
        raise unittest.SkipTest("PyTorch is not installed here")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, os.path.join(FIXTURES, "anchors_on_cpu.py"), tmp],
                              capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    backward = [r for r in rows if "dq_rel_l2" in r]
    assert [r["impl"] for r in backward] == list(results.BACKWARD_ANCHORS) * 2, [r["impl"] for r in backward]
    for row in backward:
        assert row["status"] in ("PASS", "SKIP"), row
        if row["status"] == "PASS":
            grads = [row[k] for k in results.GRAD_FIELDS]
            assert all(0 < g < 3e-3 for g in grads) and row["rel_l2"] == max(grads), row
            inputs = 4 * row["batch"] * row["heads"] * row["seqlen"] * row["headdim"] * 2
            assert row["device_bytes"] == 12345 + inputs, row  # the fake peak, plus Q, K, V and dO
        else:
            assert row["note"] and all(row[k] is None for k in results.GRAD_FIELDS), row
    assert all(r["status"] == "PASS" for r in backward if r["impl"] == "torch_eager"), backward
    forward = [r for r in rows if "dq_rel_l2" not in r]
    assert [r["impl"] for r in forward] == list(results.ANCHORS), forward
    # The timed windows: a backward's hold no forward, a forward's one each (so the count is seen).
    windows = {line.split()[1]: json.loads(line.split(None, 2)[2]) for line in proc.stdout.splitlines()
               if line.startswith("WINDOWS ")}
    timed = sum(r["status"] == "PASS" for r in backward)
    assert len(windows["backward"]) == 2 * timed and not any(windows["backward"]), windows
    assert windows["forward"] and set(windows["forward"]) == {1}, windows
    return ", ".join(f"{r['impl']} {r['status']}" for r in backward[:4])

