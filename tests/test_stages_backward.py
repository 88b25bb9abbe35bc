"""The backward's rows in the bench, on the CPU: its results file beside the forward's (its own columns:
each gradient's error), the runs it times (the chapters with a `Backward`, each again in its deterministic
mode: the chapter's binary with --deterministic, impl <chapter>.deterministic; the Makefile knows nothing
of it), its tables and inline values against tests/fixtures/FAKE_GPU.backward.*, its sweep on stand-in
binaries (the forward's then the backward's; skips and refusals), the references it makes ahead, and its
anchors (without PyTorch, and on PyTorch's CPU tensors where PyTorch is installed).

No GPU or matplotlib needed. The fixtures' helpers and the stand-in binaries are tests/test_stages.py's.
"""
import json
import os
import re
import shutil
import sys
import types

import pytest

import anchors
import report
import results
import stages
from chapters import has_backward
from helpers import CHAPTERS
from test_stages import (FIXTURE_CSV, FIXTURE_GPU, FIXTURES, ROOT, assert_golden, make_fake_build, printed_by, read,
                         value, without_torch, write)

BACKWARD_CSV = str(FIXTURES / "FAKE_GPU.backward.csv")


def backward_rows():
    """The made-up backward results of tests/fixtures/FAKE_GPU.backward.csv (with its notes)."""
    return results.read_results(BACKWARD_CSV)


# --- The results file of the backward ----------------------------------------------------------

def test_backward_csv_round_trip(tmp_path):
    shape = results.bench_shape(128, 4096, 0)
    rows = [results.make_row("09_backward", shape, "PASS", 6.58, 208.87, 3.1e-4, device_bytes=673185792,
                             grads=(3.1e-4, 2.9e-4, 2.8e-4)),
            results.make_row("torch_eager", dict(shape, causal=1), "SKIP", note="out of memory: x",
                             grads=(None, None, None))]
    path, forward = str(tmp_path / "NVIDIA_H200.backward.csv"), str(tmp_path / "NVIDIA_H200.csv")
    assert results.csv_pass(path) == "backward" and results.csv_pass(forward) == "forward"
    assert results.pass_csv(path, "forward") == forward
    assert results.pass_csv(forward, "backward") == path
    results.write_results(path, rows)
    lines = read(path).splitlines()
    assert lines[0] == ("impl,batch,heads,seqlen,headdim,causal,dtype,ms,tflops,rel_l2,status,device_bytes,"
                        "dq_rel_l2,dk_rel_l2,dv_rel_l2"), lines[0]
    assert tuple(lines[0].split(",")) == results.CSV_FIELDS + results.GRAD_FIELDS
    assert lines[1] == "09_backward,4,16,4096,128,0,fp16,6.58,208.87,0.00031,PASS,673185792,0.00031,0.00029,0.00028"
    assert lines[2] == "torch_eager,4,16,4096,128,1,fp16,,,,SKIP,,,,"
    assert (tmp_path / "NVIDIA_H200.backward.notes.csv").exists()
    assert not os.path.exists(forward), "the forward's file was written"
    back = results.read_results(path)
    assert back == rows, back
    assert results.env_path(path).endswith("NVIDIA_H200.backward.env")
    # A forward file never gets the gradients' columns, whatever its rows hold.
    results.write_results(forward, rows)
    assert read(forward).splitlines()[0].endswith(",status,device_bytes")
    assert "dq_rel_l2" not in results.read_results(forward)[0]


def test_backward_flops_and_tolerances():
    shape = results.bench_shape(128, 4096, 0)  # forward 5.4976e11 FLOPs: 549.76 TFLOP/s at 1 ms
    assert abs(results.backward_tflops(shape, 1.0) - 2.5 * 549.7558) < 1e-2
    assert abs(results.backward_tflops(dict(shape, causal=1), 6.58) - 104.44) < 1e-2
    harness = read(ROOT / "common" / "harness.cu")
    found = re.search(r"static const double BACKWARD_REL_L2_TOL = ([0-9.e-]+);", harness)
    assert found and float(found.group(1)) == results.BACKWARD_REL_L2_TOL, "the harness's backward bound moved"
    assert anchors.REL_L2_TOL == results.ANCHOR_REL_L2_TOL == 3e-3
    assert results.BACKWARD_ANCHORS == ("torch_flash", "torch_cudnn", "torch_efficient", "torch_eager")


def test_backward_runs_from_the_sources(tmp_path):
    """The chapters whose backward the bench times are those that define a `Backward`, each also in its
    deterministic mode: a row of its own (impl <chapter>.deterministic) run by the chapter's binary with
    --deterministic. The sources say it, not the Makefile, which builds no binary of its own for it."""
    backward = ("09_backward", "10_backward_hopper")
    assert results.variants() == {c: (f"{c}.deterministic",) for c in backward}, results.variants()
    timed = {c: results.backward_runs(c) for c in CHAPTERS if results.backward_runs(c)}
    assert timed == {c: (c, f"{c}.deterministic") for c in backward}, timed
    want = []
    for c in backward:  # each after its steps, where it has them (test below)
        want += stages.step_binaries("b", c) + [(c, os.path.join("b", c), "fp16"),
                                                (f"{c}.deterministic", os.path.join("b", c), "fp16")]
    assert stages.backward_binaries("b", CHAPTERS) == want
    assert stages.backward_binaries("b", ["07_async_pipeline", "08_fp8"]) == []
    commands = {impl: results.impl_command(impl) for impl in ("09_backward.deterministic", "09_backward", "08.3",
                                                                "07_async_pipeline.deterministic")}
    assert commands == {"09_backward.deterministic": ("09_backward", ["--deterministic"]),
                        "09_backward": ("09_backward", []), "08.3": ("08.3", []),
                        "07_async_pipeline.deterministic": ("07_async_pipeline.deterministic", [])}, commands
    recipes = "\n".join(line for line in read(ROOT / "Makefile").splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"determin|VARIANT", recipes, re.I), "the Makefile knows of a mode"
    for chapter, text in (("10_x", "static const Backward backward_pass = {workspace, backward};\n"),
                          ("11_y", "const Chapter chapter = {NULL};\n")):
        (tmp_path / chapter).mkdir()
        (tmp_path / chapter / "attention.cu").write_text(text)
    assert results.variants(str(tmp_path)) == {"10_x": ("10_x.deterministic",)}, results.variants(str(tmp_path))
    assert results.variants(str(tmp_path / "none")) == {}
    source = tmp_path / "attention.cu"
    for text, has in (("// no Backward here\nconst Chapter chapter = {NULL};\n", False),
                      ("static const Backward backward_pass = {workspace, backward};\n", True)):
        source.write_text(text)
        assert has_backward(str(source)) == has, text


def test_a_backward_chapters_steps_are_the_backwards(monkeypatch):
    """A chapter with a backward built in steps (09.1 ...: its step files) has them in the backward's sweep,
    before the chapter and its modes, and not in the forward's; 08's stay the forward's."""
    monkeypatch.setattr(stages, "steps", lambda: {"08_fp8": ("08.1", "08.2"), "09_backward": ("09.1", "09.2")})
    assert results.chapter_pass("09_backward") == "backward" and results.chapter_pass("08_fp8") == "forward"
    forward = [name for name, _, _ in stages.chapter_binaries("b", ["08_fp8", "09_backward"])]
    assert forward == ["08.1", "08.2", "08_fp8", "09_backward"], forward
    backward = stages.backward_binaries("b", ["08_fp8", "09_backward"])
    chapter = os.path.join("b", "09_backward")
    assert backward == [("09.1", os.path.join("b", "09_backward.step1"), "fp16"),
                        ("09.2", os.path.join("b", "09_backward.step2"), "fp16"), ("09_backward", chapter, "fp16"),
                        ("09_backward.deterministic", chapter, "fp16")], backward


# --- Tables ------------------------------------------------------------------------------------

def test_backward_page_matches_golden():
    env = results.read_env(str(FIXTURES / "FAKE_GPU.backward.env"))
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


@pytest.mark.parametrize("spec, message",
                         [("07 D128 N4k nc dq_rel_l2", "bad quantity"), ("bwd 09 D128 N4k", "too few")],
                         ids=["a gradient's error in a forward marker", "a backward marker without its quantity"])
def test_malformed_backward_marker_is_refused(spec, message):
    with pytest.raises(ValueError, match=message):  # accepted: DID NOT RAISE
        report.fill_values(value(spec), results.read_results(FIXTURE_CSV), "x", backward_rows())


def test_resolve_impl_of_modes():
    bwd = backward_rows()
    assert report.resolve_impl(bwd, "09") == "09_backward"
    assert report.resolve_impl(bwd, "09.deterministic") == "09_backward.deterministic"
    assert report.resolve_impl(bwd, "09.fast") == "09.fast"  # no such mode: as it is (n/a)
    assert report.resolve_impl(bwd, "FA2") == "torch_flash"
    forward = results.read_results(FIXTURE_CSV)
    assert report.resolve_impl(forward, "07") == "07_async_pipeline"
    shape = results.bench_shape(128, 4096, 0)
    steps = [results.make_row(n, shape, "PASS", 1.0, 1.0, 1e-4) for n in ("08.3", "08_fp8")]
    assert report.resolve_impl(steps, "08") == "08_fp8" and report.resolve_impl(steps, "08.3") == "08.3"
    assert report.resolve_impl(steps, "08.6") == "08_fp8"


def test_regenerate_backward_on_a_tree(tmp_path, capsys):
    """`table` from either pass's CSV writes both pages; the backward's block goes to the README of
    the chapter that has one; without a backward file its block and its values are left alone."""
    out = tmp_path / "docs" / "results"
    out.mkdir(parents=True)
    forward_csv, readme = str(out / "FAKE_GPU.csv"), tmp_path / "README.md"
    readme.write_text(f"{report.STAGE_BEGIN}\n{report.STAGE_END}\n07 {value('07 D128 N4k nc ms')}, "
                      f"09 {value('bwd 09 D128 N4k nc x FA2')}\n")
    chapter = tmp_path / "09_backward" / "README.md"
    stale = f"# 09\n{report.BACKWARD_BEGIN}\nnot measured yet\n{report.BACKWARD_END}\n"
    write(chapter, stale)
    results.write_results(forward_csv, results.read_results(FIXTURE_CSV))
    printed_by(capsys, report.regenerate_tables, forward_csv, str(readme))
    assert read(chapter) == stale, "the backward block changed without a backward file"
    assert read(readme).endswith(f"07 {value('07 D128 N4k nc ms', '2.12')}, 09 {value('bwd 09 D128 N4k nc x FA2')}\n")
    assert not (out / "FAKE_GPU.backward.md").exists()
    backward_csv = str(out / "FAKE_GPU.backward.csv")
    results.write_results(backward_csv, backward_rows())
    shutil.copyfile(FIXTURES / "FAKE_GPU.backward.env", results.env_path(backward_csv))
    for path in (backward_csv, forward_csv):  # from either pass's file
        chapter.write_text(stale)
        _, printed = printed_by(capsys, report.regenerate_tables, path, str(readme))
        assert "warning:" not in printed, printed
        assert read(chapter) == (f"# 09\n{report.BACKWARD_BEGIN}\n\n" + read(FIXTURES / "chapter_09_backward.md")
                                 + f"\n{report.BACKWARD_END}\n"), read(chapter)
        assert read(out / "FAKE_GPU.backward.md") == read(FIXTURES / "FAKE_GPU.backward.md")
        assert read(readme).endswith(f"09 {value('bwd 09 D128 N4k nc x FA2', '0.77x')}\n"), read(readme)
        assert "| 07_async_pipeline |" in read(readme), "the forward's stage table was not written"
    # Only the backward's file: the forward's tables and values are left as they are.
    os.remove(forward_csv)
    alone = f"{report.STAGE_BEGIN}\nstale\n{report.STAGE_END}\n07 {value('07 D128 N4k nc ms', 'old')}\n"
    readme.write_text(alone)
    printed_by(capsys, report.regenerate_tables, backward_csv, str(readme))
    assert read(readme) == alone
    assert stages.default_csv(str(out)) == backward_csv  # a backward file alone is the one to read
    results.write_results(forward_csv, results.read_results(FIXTURE_CSV))
    os.utime(forward_csv, (1, 1))
    assert stages.default_csv(str(out)) == forward_csv  # the forward's, however old, with the backward's beside it
    with pytest.raises(ValueError, match="no such results CSV"):  # a missing CSV accepted: DID NOT RAISE
        report.regenerate_tables(str(out / "NONE.csv"), str(readme))


# --- The sweep, on stand-in binaries -------------------------------------------------------------

@pytest.fixture
def bench(tmp_path, capsys, monkeypatch):
    """stages.py bench into tmp_path/results (README tmp_path/README.md, binaries tmp_path/build), PyTorch
    absent, the references' step recorded instead of run: bench(*argv) -> .code (its exit code), .out
    and .err (what it printed), .asked (the shapes it was asked to prepare, a list per call)."""
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.STAGE_BEGIN}\n{report.STAGE_END}\n")
    without_torch(monkeypatch)
    monkeypatch.setattr(stages, "gpu_name", lambda: "FAKE GPU")  # as on a GPU machine: the references are made first

    def run(*argv):
        asked = []
        monkeypatch.setattr(stages, "prepare_references", lambda shapes, *a, **k: asked.append(list(shapes)))
        args = stages.parse_args(["bench", "--build", str(tmp_path / "build"), "--quick", "--out",
                                  str(tmp_path / "results"), "--readme", str(readme)] + list(argv))
        capsys.readouterr()
        code = stages.command_bench(args)
        printed = capsys.readouterr()
        return types.SimpleNamespace(code=code, out=printed.out, err=printed.err, asked=asked)
    return run


def result_files(tmp_path):
    folder = tmp_path / "results"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def test_bench_backward_on_fake_binaries(tmp_path, bench):
    """--pass backward times each chapter with a backward (09_backward) with --backward, and again with
    --deterministic (its row 09_backward.deterministic: the stand-in is 1.25x slower so), into
    <gpu>.backward.csv alone; --pass both (make bench) does the forward's first."""
    timed = stages.backward_binaries(str(tmp_path / "build"), ["09_backward"])  # its steps too, where it has them
    make_fake_build(tmp_path / "build", ["05_good"] + sorted({os.path.basename(b) for _, b, _ in timed}))
    done = bench("--pass", "backward", "05_good", "09_backward")
    assert done.code == 0, done.out
    assert len(done.asked) == 1 and len(done.asked[0]) == 8, done.asked  # --quick: 2 N x 2 D x 2 masks
    files = result_files(tmp_path)
    assert files == ["FAKE_GPU.backward.csv", "FAKE_GPU.backward.env", "FAKE_GPU.backward.md",
                     "FAKE_GPU.backward.notes.csv"], files
    rows = results.read_results(str(tmp_path / "results" / "FAKE_GPU.backward.csv"))
    assert [r["impl"] for r in rows[:len(timed)]] == [name for name, _, _ in timed], rows
    assert timed[-2:] == [("09_backward", str(tmp_path / "build" / "09_backward"), "fp16"),
                          ("09_backward.deterministic", str(tmp_path / "build" / "09_backward"), "fp16")], timed
    assert len(rows) == 8 * len(timed)
    row = results.find_row(rows, "09_backward", 128, 4096, 0)
    # The stand-in's backward: 40 ms at N=4k (2.5x its forward), TFLOP/s with 2.5x the forward's FLOPs.
    assert row["status"] == "PASS" and row["ms"] == 40.0 and abs(row["tflops"] - 34.36) < 0.01, row
    row = results.find_row(rows, "09_backward.deterministic", 128, 4096, 0)
    assert row["status"] == "PASS" and row["ms"] == 50.0, f"run without --deterministic: {row}"
    assert (row["dq_rel_l2"], row["dk_rel_l2"], row["dv_rel_l2"]) == (3.1e-4, 2.9e-4, 2.8e-4), row
    assert row["rel_l2"] == 3.1e-4 and row["device_bytes"] == 8 * 4 * 16 * 4096 * 128 * 2 + 4 * 16 * 4096 * 4
    env = results.read_env(str(tmp_path / "results" / "FAKE_GPU.backward.env"))
    assert env["pass"] == "backward", env
    assert "The backward at D=128 N=4096" in done.out and "09_backward.deterministic" in done.out, done.out
    page = read(tmp_path / "results" / "FAKE_GPU.backward.md")
    # 8 tensors of 67.1 MB and LSE (1 MB), no workspace: 538 MB, 269 MB beyond Q, K, V, dO; no FA2 row here.
    assert "| 09_backward.deterministic | 538 MB | 269 MB | 50.0 | 34.4 | - | 50.0 | 17.2 | - |" in page, page

    # make bench: the forward's sweep, then the backward's; the backward's rows replaced, the file's others kept.
    done = bench("05_good", "09_backward")
    assert done.code == 0 and len(done.asked) == 1, done.out
    forward = results.read_results(str(tmp_path / "results" / "FAKE_GPU.csv"))
    assert sorted({r["impl"] for r in forward}) == ["05_good", "09_backward"], forward
    assert "dq_rel_l2" not in forward[0] and results.find_row(forward, "09_backward", 128, 4096, 0)["ms"] == 16.0
    again = results.read_results(str(tmp_path / "results" / "FAKE_GPU.backward.csv"))
    assert again == rows, "the backward's rows changed"
    assert done.out.index("bench: 2 builds") < done.out.index(f"bench --backward: {len(timed)} builds"), done.out


def test_bench_backward_of_chapters_without_one(tmp_path, bench):
    make_fake_build(tmp_path / "build", ["05_good", "09_backward"])
    # A chapter without a backward pass: --pass backward has nothing to time.
    done = bench("--pass", "backward", "05_good")
    assert done.code == 2 and result_files(tmp_path) == [], (done.code, done.out)
    assert "none of 05_good has a backward pass (the chapters that have one: 09_backward, 10_backward_hopper)" in \
        done.err, done.err
    # make bench of chapters without one: the forward's sweep alone.
    done = bench("05_good")
    assert done.code == 0 and done.asked == [] and "--backward" not in done.out, done.out
    assert [f for f in result_files(tmp_path) if not f.endswith(".png")] == \
        ["FAKE_GPU.csv", "FAKE_GPU.env", "FAKE_GPU.md", "FAKE_GPU.notes.csv"], result_files(tmp_path)


def test_bench_backward_when_every_build_skips(tmp_path, bench):
    """Every binary skips (no GPU, exit 77), the chapter's in both modes: nothing measured, nothing written
    (one binary for two rows); the deterministic row's note is the reason alone, its binary's line read
    under the chapter's name (09_backward: skipped: ...)."""
    (tmp_path / "build").mkdir()
    for _, binary, _ in stages.backward_binaries(str(tmp_path / "build"), ["09_backward"]):
        with open(binary, "w") as f:
            f.write(f"#!{sys.executable}\nimport sys\nprint('09_backward: skipped: no CUDA GPU available (x)')\n"
                    "sys.exit(77)\n")
        os.chmod(binary, 0o755)
    path = tmp_path / "build" / "09_backward"
    done = bench("--pass", "backward", "09_backward")
    assert done.code == 77 and result_files(tmp_path) == [], (done.code, done.out)
    assert "nothing measured" in done.out, done.out
    row = stages.bench_one(str(path), "09_backward.deterministic", "fp16", results.bench_shape(128, 1024, 0), None, {},
                           "backward")
    assert (row["status"], row["note"], row["dq_rel_l2"]) == ("SKIP", "no CUDA GPU available (x)", None), row


def test_prepare_references_makes_the_harness_files(tmp_path, capsys, monkeypatch):
    """The backward's references made ahead, several shapes at once, are the very files the harness
    looks for (reference.py backward in <cache>/b{B}_h{H}_n{N}_d{D}_seed0, tag c<causal>_s<scale>)."""
    shapes = [{"batch": 1, "heads": 2, "seqlen": 64, "headdim": d, "causal": c} for d in (64, 128) for c in (0, 1)]
    monkeypatch.setenv("FA_CACHE", str(tmp_path))
    _, printed = printed_by(capsys, stages.prepare_references, shapes, "backward", 2)
    assert "4 shapes, 2 at once" in printed and "FAILED" not in printed, printed
    for shape in shapes:
        folder, argv = anchors.reference_args(str(tmp_path), shape, "backward")
        assert folder == os.path.join(str(tmp_path), f"b1_h2_n64_d{shape['headdim']}_seed0"), folder
        scale = "0.125" if shape["headdim"] == 64 else "0.0883883461"  # the harness's %.9g of 1/sqrtf(D)
        assert argv[argv.index("--scale") + 1] == scale, argv
        for part in ("q", "k", "v", "do"):
            assert os.path.exists(os.path.join(folder, f"{part}.npy")), (folder, part)
        for part in ("rows", "o", "lse", "dq", "dk", "dv", "dq_rows", "dkv_rows"):
            name = f"ref_c{shape['causal']}_s{scale}_{part}.npy"
            assert os.path.exists(os.path.join(folder, name)), (folder, name)


# --- The anchors -------------------------------------------------------------------------------------

def test_anchors_import_and_skip_without_torch(repo):
    """anchors.py imports with NumPy alone, and without PyTorch its backward rows are skipped in one line."""
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); import anchors; "
            "rows = anchors.run_anchors([dict(batch=1, heads=1, seqlen=8, headdim=64, causal=0)], '/nonexistent', "
            "pass_='backward'); assert rows == [], rows; print('imported')")
    proc = repo.run([sys.executable, "-c", code, ROOT / "common"], timeout=120)
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
    _, reason = anchors.attempt(fake, "torch_eager", raising(RuntimeError("No available kernel")))
    assert reason == "No available kernel", reason
    assert len(emptied) == 2
    with pytest.raises(KeyError):  # a KeyError taken for a reason to skip: DID NOT RAISE
        anchors.attempt(fake, "torch_eager", raising(KeyError("bug")))
    assert anchors.attempt(fake, "cudnn_fp8", raising(KeyError("frontend")), lenient=True)[1] == "'frontend'"


def test_backward_anchors_on_cpu_torch(repo, tmp_path):
    """The anchors' backward on PyTorch's CPU tensors (tests/fixtures/anchors_on_cpu.py stands in for
    the CUDA calls): dO and the reference gradients found in the cache, each gradient's error as the
    harness measures it, device memory counted as documented, a SKIP for a backend with no CPU kernel,
    and no forward inside a backward's timed window."""
    pytest.importorskip("torch", reason="PyTorch is not installed here")
    proc = repo.run([sys.executable, FIXTURES / "anchors_on_cpu.py", tmp_path], timeout=600)
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
