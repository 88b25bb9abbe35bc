"""What common/stages.py (make run, make bench, make compare, stages.py table) and common/report.py
promise, on the CPU: no GPU, PyTorch or matplotlib needed.

  results files   a results CSV (and its notes, its .env) reads back as written; another CSV is refused
  tables          the Markdown tables from tests/fixtures/FAKE_GPU.csv are the golden files beside it,
                  their cells as computed by hand; `table` on a made-up tree rewrites the marked blocks
  inline values   the measured numbers quoted in prose (`<!--r ... -->` markers) are filled from the
                  rows, n/a with a warning where there is none, a malformed marker refused (and then
                  no file is written)
  the repository  the committed READMEs and docs/*.md already say what docs/results/*.csv says (tables
                  and inline values), and the README's chapter table is the chapters' own words
  math and rules  speedups, percentages, number formats, the benchmark's shapes, the skip rule (a
                  shape projected past the budget is skipped), a binary's exit code and --csv row
  commands        run and bench on stand-in chapter binaries (Python scripts: a slow one, one too big,
                  one for an older GPU, one that FAILs), and stages.py run as a program

tests/test_stages_backward.py imports the fixtures' helpers and the stand-in binaries from here.
"""
import difflib
import glob
import os
import re
import shutil
import stat
import sys
from pathlib import Path

import pytest

import report
import results
import runner
import stages
from chapters import CHAPTERS_BEGIN, CHAPTERS_END, chapters_markdown, read_chapters
from helpers import CHAPTERS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIXTURES = HERE / "fixtures"
FIXTURE_CSV = str(FIXTURES / "FAKE_GPU.csv")
FIXTURE_GPU = "FAKE GPU H200"


def assert_golden(got, fixture, what):
    """got is exactly tests/fixtures/<fixture> (what: the words of the failure)."""
    want = read(FIXTURES / fixture)
    assert got == want, f"{what} differs from tests/fixtures/{fixture}:\n" + got


def read(path):
    """The text of a file."""
    return Path(path).read_text()


def write(path, text):
    """Write text to path, its folder made first."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def fixture_rows():
    """The made-up results of tests/fixtures/FAKE_GPU.csv (with its notes)."""
    return results.read_results(FIXTURE_CSV)


def printed_by(capsys, function, *args):
    """Call function; (its result, what it printed)."""
    capsys.readouterr()
    result = function(*args)
    return result, capsys.readouterr().out


def value(spec, text="?"):
    """An inline value marker holding text."""
    return f"<!--r {spec}-->{text}<!--/r-->"


# --- Results files ---------------------------------------------------------------------

def test_csv_round_trip(tmp_path):
    shape = results.bench_shape(128, 4096, 1)
    rows = [results.make_row("04_fused", shape, "PASS", 18.3301, 29.99, 3.012e-4, device_bytes=269484032),
            results.make_row("01_naive", results.bench_shape(64, 16384, 0), "SKIP",
                             note="this shape needs 33.0 GiB of device memory, lower B, H or N"),
            results.make_row("torch_flash", shape, "FAIL", 0.9194, 298.98, 0.0123, note="odd, but kept")]
    path = tmp_path / "NVIDIA_H200.csv"
    results.write_results(str(path), rows)
    lines = read(path).splitlines()
    assert lines[0] == "impl,batch,heads,seqlen,headdim,causal,dtype,ms,tflops,rel_l2,status,device_bytes"
    assert lines[1].endswith(",PASS,269484032")
    assert lines[2] == "01_naive,1,32,16384,64,0,fp16,,,,SKIP,"
    back = results.read_results(str(path))
    older = "\n".join(",".join(line.split(",")[:-1]) for line in lines)  # no device_bytes
    path.write_text(older + "\n")
    assert [r["device_bytes"] for r in results.read_results(str(path))] == [None] * 3
    assert back == rows, back
    assert back[0]["ms"] == 18.3301 and back[0]["batch"] == 4 and back[0]["causal"] == 1
    assert "note" not in back[0] and back[1]["note"].startswith("this shape needs")


def test_read_results_refuses_other_csv(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("impl,ms\n01_naive,1.0\n")
    with pytest.raises(ValueError, match="missing columns"):  # a CSV without the result columns
        results.read_results(str(path))


def test_env_round_trip(tmp_path):
    env = {"gpu": "NVIDIA H200", "command": "python3 common/stages.py bench --build build 01_naive"}
    path = tmp_path / "x.env"
    results.write_env(str(path), env)
    assert read(path) == ("gpu: NVIDIA H200\n"
                          "command: python3 common/stages.py bench --build build 01_naive\n")
    assert results.read_env(str(path)) == env
    assert results.read_env(str(tmp_path / "missing.env")) == {}


# --- Markdown -------------------------------------------------------------------------

def test_stage_table_matches_golden():
    got = report.stage_table_markdown(fixture_rows(), "docs/results/FAKE_GPU.csv", FIXTURE_GPU)
    assert_golden(got, "stage_table.md", "stage table")


def test_results_page_matches_golden():
    env = results.read_env(str(FIXTURES / "FAKE_GPU.env"))
    got = report.results_markdown(fixture_rows(), env, "FAKE_GPU.csv")
    assert_golden(got, "FAKE_GPU.md", "results page")


def test_chapter_table_matches_golden():
    got = report.chapter_table_markdown(fixture_rows(), "04_fused", "03_online_softmax",
                                        "../docs/results/FAKE_GPU.csv", FIXTURE_GPU)
    assert_golden(got, "chapter_04_fused.md", "chapter table")


def test_stage_cells_hand_computed():
    rows = fixture_rows()
    # 02 at 27.49 ms, 20.0 TFLOP/s; 01 at 68.72 ms; eager 10.0 ms; FA2 331.98, cuDNN 582.99 TFLOP/s.
    cells = report.stage_cells(rows, "02_tiling", "01_naive", "01_naive", 0)
    assert cells == ["27.5", "20.0", "2.50x", "2.50x", "0.36x", "6%", "3%"], cells
    # 07 causal: 70.1 / 1.2 = 58.4x vs 01, 14.47 / 1.2 = 12.1x vs eager; its previous chapter
    # (06) FAILed there: no ratio.
    cells = report.stage_cells(rows, "07_async_pipeline", "01_naive", "06_tensorcore_wmma", 1)
    assert cells == ["1.20", "229.1", "58.4x", "-", "12.1x", "77%", "45%"], cells
    assert report.stage_cells(rows, "06_tensorcore_wmma", "01_naive", "05_causal", 1) == ["FAIL"] + ["-"] * 6
    assert report.stage_cells(rows, "torch_efficient", "01_naive", None, 1) == ["skip"] + ["-"] * 6
    assert report.stage_cells(rows, "04_fused", "01_naive", "03_online_softmax", 0, 64) == ["-"] * 7
    # An anchor has no previous chapter: its "x vs prev" cell is empty.
    assert report.stage_cells(rows, "torch_cudnn", "01_naive", None, 0)[2:4] == ["72.9x", ""]


def test_marker_replacement():
    begin, end = report.STAGE_BEGIN, report.STAGE_END
    text = f"# Title\n\nbefore\n{begin}\nold table\nmore old\n{end}\nafter\n"
    new = report.replace_between(text, begin, end, "| a |\n|--|\n")
    assert new == f"# Title\n\nbefore\n{begin}\n\n| a |\n|--|\n\n{end}\nafter\n", new
    assert report.replace_between(new, begin, end, "| a |\n|--|\n") == new  # idempotent
    for broken in ("no markers at all\n", f"only {begin}\nx\n", f"{end}\nonly the end\n",
                   f"{end}\nwrong order\n{begin}\n"):
        assert report.replace_between(broken, begin, end, "table") == broken, broken


def test_regenerate_tables_on_a_tree(tmp_path, capsys):
    csv_path = tmp_path / "results" / "FAKE_GPU.csv"
    results.write_results(str(csv_path), fixture_rows())
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.STAGE_BEGIN}\nstale\n{report.STAGE_END}\n"
                      f"end, 07 at {value('07 D128 N4k nc ms')} ms\n")
    write(tmp_path / "03_online_softmax" / "README.md", "# 03, no markers\n")
    write(tmp_path / "04_fused" / "README.md", f"# 04\n{report.MEASURED_BEGIN}\n{report.MEASURED_END}\n"
                                               f"{value('04 D128 N4k nc x 03')} 03\n")
    write(tmp_path / "docs" / "notes.md",
          f"cuDNN {value('cuDNN D128 N4k nc tflops :.0f')}, 06 causal {value('06 D128 N4k causal ms')}\n")
    _, printed = printed_by(capsys, report.regenerate_tables, str(csv_path), str(readme))
    top = read(readme)
    assert top.startswith("intro\n") and "stale" not in top
    assert top.endswith(f"{report.STAGE_END}\nend, 07 at {value('07 D128 N4k nc ms', '2.12')} ms\n"), top
    chapter = read(tmp_path / "04_fused" / "README.md")
    assert chapter.endswith(f"{value('04 D128 N4k nc x 03', '1.25x')} 03\n"), chapter  # 22.9 / 18.33
    assert read(tmp_path / "docs" / "notes.md") == (
        f"cuDNN {value('cuDNN D128 N4k nc tflops :.0f', '583')}, "
        f"06 causal {value('06 D128 N4k causal ms', 'n/a')}\n")
    assert "warning: " in printed and "notes.md: <!--r 06 D128 N4k causal ms-->: no timed row" in printed, printed
    assert "| 07_async_pipeline | - | 2.12 | 259.9 | 32.5x |" in top
    assert "`results/FAKE_GPU.csv`" in top
    assert read(tmp_path / "03_online_softmax" / "README.md") == "# 03, no markers\n"
    assert "| **04_fused** | non-causal | 29.2 | 30.0 | 18.3 |" in chapter
    assert "| 03_online_softmax | causal |" in chapter and "`../results/FAKE_GPU.csv`" in chapter
    assert (tmp_path / "results" / "FAKE_GPU.md").exists()


# --- Measured values in prose -----------------------------------------------------------

def test_inline_values_hand_computed():
    rows = fixture_rows()
    # The fixture at D=128 N=4096 non-causal: 07 2.115 ms, 259.93 TFLOP/s, rel_l2 7.1e-4; 01 68.72 ms;
    # FA2 1.656 ms; cuDNN 582.99 TFLOP/s; 04 29.99 and 05 30.37 TFLOP/s. Causal: 07 1.2 ms, eager 14.47.
    want = {
        "07 D128 N4k nc ms": "2.12",
        "07_async_pipeline D128 N4096 nc tflops": "259.9",
        "07 D128 N4k nc rel_l2": "7.1e-04",
        "07 D128 N4k nc x 01": "32.5x",                  # 68.72 / 2.115 = 32.49
        "07 D128 N4k nc x FA2": "0.78x",                 # 1.656 / 2.115 = 0.783
        "07 D128 N4k nc x torch_flash :.3f": "0.783",
        "07 D128 N4k causal x torch_eager": "12.1x",     # 14.47 / 1.2 = 12.06
        "07 D128 N4k nc % cuDNN": "45%",                 # 259.93 / 582.99 = 44.6%
        "cuDNN D128 N4k nc tflops :.0f": "583",
        "04 D128 N4k nc % 64TFLOP/s": "47%",             # 29.99 / 64 = 46.9%
        "04,05 D128 N4k nc tflops": "30.0-30.4",         # two impls: the range
        "07 D128 N1k,4k nc tflops": "237.0-259.9",       # two shapes: the range
        "07 D128 N1k,4k * x FA2": "0.73-0.78x",          # 0.2828 / 0.39 = 0.725 ... 1.656 / 2.115 = 0.783
        "07 D128 N1k,4k * x FA2 :.2f": "0.73-0.78",
        "04,05 D128 N4k nc % 64TFLOP/s": "47%",          # 46.9% and 47.5%: one text, shown once
    }
    text = "".join(f"{spec}: {value(spec)}\n" for spec in want)
    filled, warnings = report.fill_values(text, rows, "page.md")
    assert filled == "".join(f"{spec}: {value(spec, got)}\n" for spec, got in want.items()), filled
    assert warnings == []
    assert report.fill_values(filled, rows, "page.md") == (filled, [])  # idempotent
    # Text around the markers is kept, and so is the spacing inside the tags.
    assert report.fill_values("a <!-- r 02 D128 N4k nc ms -->old<!-- /r --> b\n", rows, "x") == \
        ("a <!-- r 02 D128 N4k nc ms -->27.5<!-- /r --> b\n", [])


def test_inline_values_without_rows():
    rows = fixture_rows()
    missing = ["06 D128 N4k causal ms",                  # FAIL
               "torch_efficient D128 N4k causal tflops",  # SKIP
               "07 D128 N4k causal x 06",                # the other row FAILed
               "09 D128 N4k nc ms",                      # no such chapter
               "04 D64 N4k nc ms",                       # not measured at D=64
               "07 D128 N* nc tflops"]                   # only N=1k and 4k measured
    text = " ".join(value(spec, "1.0") for spec in missing)
    filled, warnings = report.fill_values(text, rows, "docs/page.md")
    assert filled == " ".join(value(spec, "n/a") for spec in missing), filled
    assert len(warnings) == len(missing), warnings
    assert warnings[0] == ("docs/page.md: <!--r 06 D128 N4k causal ms-->: no timed row at "
                           "06 D=128 N=4096 causal, written as n/a"), warnings[0]
    assert "07 D=128 N=512 non-causal" in warnings[-1], warnings[-1]


MALFORMED = {
    value("07 D128 N4k nc"): "too few fields",
    value("07 128 N4k nc ms"): "bad field '128'",
    value("07 D128 N4q nc ms"): "bad field 'N4q'",
    value("07 D128 N4k noncausal ms"): "bad field 'noncausal'",
    value("07 D128 N4k nc gflops"): "bad quantity 'gflops'",
    value("07 D128 N4k nc x"): "bad quantity 'x'",
    value("07 D128 N4k nc ms 06"): "bad quantity 'ms 06'",
    value("07 D128 N4k nc x 64TFLOP/s"): "bad quantity 'x 64TFLOP/s'",
    value("07 D128 N4k nc ms :q"): "bad format :q",
    "a <!--r 07 D128 N4k nc ms-->1.5\n<!--/r--> b": "<!--r 07 D128 N4k nc ms--> without its pair",
    "<!--r 07 D128 N4k nc ms\n-->1.5<!--/r-->": "without its pair",
    "1.5<!--/r--> alone": "<!--/r--> without its pair",
    value("07 D128 N4k nc ms", value("07 D128 N4k nc tflops")): "without its pair",  # nested
}


@pytest.mark.parametrize("text, message", MALFORMED.items(), ids=[repr(t) for t in MALFORMED])
def test_malformed_inline_value_is_refused(text, message):
    with pytest.raises(ValueError) as refused:  # a malformed marker accepted: DID NOT RAISE
        report.fill_values(text, fixture_rows(), "docs/page.md")
    assert str(refused.value).startswith("docs/page.md: ") and message in str(refused.value), str(refused.value)
    if "pair" not in message:
        assert report.VALUE_SYNTAX in str(refused.value) or "format" in message, str(refused.value)


def test_update_values_all_or_nothing(tmp_path, capsys):
    """A malformed marker in one file leaves every file as it was; a good run rewrites them all."""
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text(f"07: {value('07 D128 N4k nc ms', 'old')} ms\n")
    bad.write_text(f"broken: {value('07 D128 N4k', 'old')}\n")
    with pytest.raises(ValueError) as refused:  # a malformed marker accepted: DID NOT RAISE
        report.update_values([str(good), str(bad)], fixture_rows())
    assert "bad.md" in str(refused.value) and "too few fields" in str(refused.value), str(refused.value)
    assert "old" in read(good), read(good)
    _, printed = printed_by(capsys, report.update_values, [str(good), str(tmp_path / "missing.md")], fixture_rows())
    assert read(good) == f"07: {value('07 D128 N4k nc ms', '2.12')} ms\n" and "values updated" in printed


def repository_tree(tmp, csv_path):
    """A copy of what `table` reads and writes: READMEs, chapter sources, docs/*.md, the results."""
    names = ["README.md"] + [os.path.relpath(p, ROOT) for pattern in
                             ("[0-9][0-9]_*/README.md", "[0-9][0-9]_*/attention.cu", "docs/*.md")
                             for p in glob.glob(str(ROOT / pattern))]
    for path in (csv_path, results.pass_csv(csv_path, "backward")):  # and the backward's results beside it
        base = os.path.splitext(path)[0]
        names += [os.path.relpath(p, ROOT) for p in (path, base + ".notes.csv", base + ".env", base + ".md")
                  if os.path.exists(p)]
    for name in names:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, tmp / name)
    return names


def test_repository_prose_and_tables_are_current(tmp_path, capsys):
    """`stages.py table` on the committed results changes nothing: every table, and every measured
    number quoted in prose (the inline markers), already says what the CSV says."""
    csv_path = stages.default_csv()
    if not csv_path:
        pytest.skip("no docs/results/*.csv")
    counts = {}
    for path in report.prose_files(str(ROOT / "README.md")):
        counts[os.path.relpath(path, ROOT)] = len(report.VALUE.findall(read(path)))
    chapters = [name for name in counts if name[:2].isdigit()]
    assert chapters and all(counts[name] for name in chapters), f"chapter READMEs without inline values: {counts}"
    names = repository_tree(tmp_path, csv_path)
    _, printed = printed_by(capsys, report.regenerate_tables, str(tmp_path / os.path.relpath(csv_path, ROOT)),
                            str(tmp_path / "README.md"))
    assert "warning:" not in printed, printed
    stale = []
    for name in names:
        old, new = read(ROOT / name), read(tmp_path / name)
        if old != new:
            lines = [line for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
                     if line[:1] in "+-" and line[:3] not in ("+++", "---")]
            stale.append(f"{name}:\n" + "\n".join(lines[:6]))
    assert not stale, ("the committed docs differ from what `common/stages.py table` writes from "
                       f"{os.path.relpath(csv_path, ROOT)} (run it):\n" + "\n".join(stale))


def test_readme_chapter_table_is_the_chapters_own_words():
    """The README's chapter table is generated from each chapter's `Chapter` initializer
    (`stages.py table`), so that what a chapter adds is written once, in its code."""
    chapters = read_chapters(str(ROOT))
    assert [c["name"] for c in chapters] == CHAPTERS, f"parsed {[c['name'] for c in chapters]}"
    for c in chapters:
        assert c["adds"] and c["math"] != c["precision"], f"{c['name']}: incomplete {c}"
    block = read(ROOT / "README.md").split(CHAPTERS_BEGIN)[1].split(CHAPTERS_END)[0].strip()
    assert block == chapters_markdown(chapters).strip(), (
        "README.md's chapter table differs from the chapters' own words: run common/stages.py table")


# --- Math, formats, the skip rule --------------------------------------------------------

def test_speedup_and_percent():
    assert report.speedup(100.0, 8.0) == 12.5
    assert report.fmt_speedup(report.speedup(68.72, 2.115)) == "32.5x"
    assert report.fmt_speedup(report.speedup(25.8, 24.9)) == "1.04x"   # below 10x: two decimals
    assert report.speedup(None, 1.0) is None and report.speedup(1.0, None) is None
    assert abs(report.percent_of(150.0, 332.0) - 45.1807) < 1e-3
    assert report.fmt_percent(report.percent_of(150.0, 332.0)) == "45%"
    assert report.percent_of(150.0, None) is None and report.fmt_percent(None) == "-"
    shape = results.bench_shape(128, 4096, 0)  # 4*4*16*4096^2*128 = 5.4976e11 FLOPs
    assert abs(results.forward_tflops(shape, 1.0) - 549.7558) < 1e-3
    assert abs(results.forward_tflops(dict(shape, causal=1), 1.0) - 274.8779) < 1e-3


def test_number_formats():
    assert [report.fmt_ms(x) for x in (0.0123, 0.943, 3.665, 18.33, 68.72, 123.4, 4567.8)] == \
        ["0.012", "0.943", "3.67", "18.3", "68.7", "123", "4568"]
    assert report.fmt_tflops(259.93) == "259.9" and report.fmt_tflops(8) == "8.0"
    assert report.fmt_rel(2.9e-4) == "2.9e-04" and report.fmt_ms(None) == "-"
    assert [report.n_label(n) for n in (512, 1024, 16384, 1000)] == ["512", "1k", "16k", "1000"]


def test_skip_projection():
    # 100 ms on some work -> 400 ms on 4x the work, times 14 runs = 5.6 s.
    assert abs(stages.projected_seconds(10, 100.0, 40) - 5.6) < 1e-9
    assert stages.RUNS_PER_SHAPE == 14
    assert stages.BUDGET_S == 15
    def at(n):
        return results.bench_shape(128, n, 0)
    assert results.work(at(8192)) == 2 * results.work(at(4096))      # B·N fixed: work grows as N
    assert stages.too_slow(None, at(512)) is None
    assert stages.too_slow((results.work(at(4096)), 354.0), at(8192)) is None  # 9.9 s: runs
    assert stages.too_slow((results.work(at(8192)), 708.0), at(16384)) == "projected 20 s"  # 19.8 s
    assert stages.too_slow((results.work(at(1024)), 260.0), at(4096)) is None  # 14.56 s: runs
    assert stages.too_slow((results.work(at(1024)), 270.0), at(4096)) == "projected 16 s"  # 15.12 s


def test_bench_shapes():
    shapes = results.bench_shapes()
    assert len(shapes) == 24
    assert all(s["batch"] * s["seqlen"] == 16384 and s["heads"] * s["headdim"] == 2048 for s in shapes)
    assert shapes[0] == {"batch": 32, "heads": 16, "seqlen": 512, "headdim": 128, "causal": 0}
    for d in (64, 128):
        for c in (0, 1):
            ns = [s["seqlen"] for s in shapes if (s["headdim"], s["causal"]) == (d, c)]
            assert ns == [512, 1024, 2048, 4096, 8192, 16384], ns
    assert sorted({s["seqlen"] for s in results.bench_shapes(quick=True)}) == [1024, 4096]
    half = results.bench_shapes(headdim=64)  # a sweep split by D: each half's shapes, in the sweep's order
    assert half == [s for s in shapes if s["headdim"] == 64] and len(half) == 12
    some = results.bench_shapes(headdim=128, seqlens=[8192, 512])  # a sweep split by N too: ascending still
    assert [(s["seqlen"], s["causal"]) for s in some] == [(512, 0), (8192, 0), (512, 1), (8192, 1)], some
    assert stages.parse_args(["bench", "--seqlens", "512,2048", "07"]).seqlens == [512, 2048]
    for bad in ("1000", "512,x", ""):
        with pytest.raises(SystemExit):  # argparse's usage error, exit 2
            stages.parse_args(["bench", "--seqlens", bad, "07"])
    with pytest.raises(SystemExit):
        stages.parse_args(["bench", "--quick", "--seqlens", "512", "07"])


def test_default_csv_is_the_one_the_readme_names(tmp_path):
    """With two GPUs' results side by side, `table` reads the one the README's stage table names
    (the published GPU's), not whichever file is newest; without a name, the newest."""
    for name, mtime in (("OLD_GPU.csv", 1), ("NEW_GPU.csv", 2)):
        shutil.copyfile(FIXTURE_CSV, tmp_path / name)
        os.utime(tmp_path / name, (mtime, mtime))
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.STAGE_BEGIN}\n*from `docs/results/OLD_GPU.csv`*\n{report.STAGE_END}\n")
    assert stages.default_csv(str(tmp_path), str(readme)) == str(tmp_path / "OLD_GPU.csv")
    readme.write_text("no stage table\n")
    assert stages.default_csv(str(tmp_path), str(readme)) == str(tmp_path / "NEW_GPU.csv")


def test_every_gpus_results_markdown_is_its_csv():
    """Each GPU's <gpu>.md and <gpu>.backward.md in docs/results is what its CSV writes (also the GPUs
    whose files the READMEs do not quote)."""
    paths = [p for p in glob.glob(str(ROOT / "docs" / "results" / "*.csv")) if not p.endswith(".notes.csv")]
    if not paths:
        pytest.skip("no docs/results/*.csv")
    for path in paths:
        rows, env, name = results.read_results(path), results.read_env(results.env_path(path)), os.path.basename(path)
        write = report.backward_results_markdown if results.csv_pass(path) == "backward" else report.results_markdown
        md = os.path.splitext(path)[0] + ".md"
        assert read(md) == write(rows, env, name), f"{md} is not what {name} writes (run common/stages.py table)"


def test_gpu_slug():
    assert results.gpu_slug("NVIDIA H200") == "NVIDIA_H200"
    assert results.gpu_slug("NVIDIA GeForce RTX 4090\nNVIDIA GeForce RTX 4090\n") == "NVIDIA_GeForce_RTX_4090"
    assert results.gpu_slug("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100-SXM4-80GB"
    assert results.gpu_slug("") == "unknown_gpu" and results.gpu_slug(None) == "unknown_gpu"
    assert results.gpu_slug("a/b c") == "a_b_c"


def test_classify_exit_codes():
    row = "04_fused,4,16,4096,128,0,fp16,18.3300,29.99,3.000e-04,PASS,1.2e-03,2.0e-05,1,0\n"
    status, parsed, note = runner.classify("04_fused", 0, row, "")
    assert status == "PASS" and parsed["ms"] == 18.33 and parsed["rel_l2"] == 3e-4 and note is None
    status, parsed, _ = runner.classify("04_fused", 1, row.replace("PASS", "FAIL"), "")
    assert status == "FAIL" and parsed["tflops"] == 29.99
    assert runner.classify("04_fused", 77, "04_fused: skipped: no CUDA GPU available (x)\n", "") == \
        ("skipped", None, "no CUDA GPU available (x)")
    assert runner.classify("01_naive", 2, "", "01_naive: this shape needs 66 GiB\n") == \
        ("usage", None, "this shape needs 66 GiB")
    assert runner.classify("04_fused", 1, "", "04_fused: CUDA error in the forward: x\n") == \
        ("error", None, "CUDA error in the forward: x")
    assert runner.classify("04_fused", -11, "", "") == ("error", None, "exit -11: no output")


def test_harness_columns():
    """The --csv columns harness.cu's help lists are results.HARNESS_FIELDS, and a binary's row
    parses into them (the result fields, then the harness's further numbers)."""
    literals = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', read(ROOT / "common" / "harness.cu")))
    listed = literals.split("print one CSV row instead of the report:")[1].split("(")[0]
    assert tuple(re.findall(r"[a-z_0-9]+", listed.replace("\\n", " "))) == results.HARNESS_FIELDS, listed
    row = runner.parse_csv_line("08_fp8,4,16,4096,128,1,fp8,0.4697,585.21,4.003e-02,PASS,1.562e-01,8.456e-02,2,"
                                "100687872,0.0757,0.3980,3.687e-02,370171904")
    assert (row["ms"], row["lse_err"], row["attend_ms"], row["device_bytes"]) == (0.4697, 0.08456, 0.398, 370171904)
    row = runner.parse_csv_line("04_fused,1,1,1,64,0,fp16,0.0100,0.00,,unchecked,,,1,0,,,,1028")
    assert row["status"] == "unchecked" and row["lse_err"] is None and row["device_bytes"] == 1028, row


def test_step_rows(tmp_path):
    """08's steps: their rows carry their own impl (08.1 ... 08.5, read from its step files), sort
    between 07 and the chapter, and 08.6 names the chapter in markers; the binaries are
    BUILD/08_fp8.stepK. (A backward chapter's steps are the backward's: test_stages_backward.)"""
    assert results.steps()["08_fp8"] == ("08.1", "08.2", "08.3", "08.4", "08.5"), results.steps()
    assert results.chapter_dtypes() == {"08.4": "fp8", "08.5": "fp8", "08_fp8": "fp8"}, results.chapter_dtypes()
    assert results.step_binary("build", "08_fp8", "08.3") == os.path.join("build", "08_fp8.step3")
    assert [name for name, _, _ in stages.chapter_binaries("b", ["07_async_pipeline", "08_fp8"])] == \
        ["07_async_pipeline", "08.1", "08.2", "08.3", "08.4", "08.5", "08_fp8"]
    shape = results.bench_shape(128, 4096, 0)
    rows = [results.make_row("07_async_pipeline", shape, "PASS", 2.0, 250.0, 1e-4),
            results.make_row("08_fp8", shape, "SKIP", note="needs sm_90", dtype="fp8"),
            results.make_row("08.3", shape, "PASS", 1.0, 500.0, 2e-4, note="fast")]
    assert results.find_row(rows, "08_fp8", 128, 4096, 0)["status"] == "SKIP"
    assert results.find_row(rows, "08.6", 128, 4096, 0)["status"] == "SKIP"
    assert results.find_row(rows, "08.3", 128, 4096, 0)["ms"] == 1.0
    assert results.chapter_impls(rows) == ["07_async_pipeline", "08.3", "08_fp8"]
    assert report.resolve_impl(rows, "08.3") == "08.3" and report.resolve_impl(rows, "08") == "08_fp8"
    assert report.resolve_impl(rows, "08.6") == "08_fp8"
    path = str(tmp_path / "X.csv")
    results.write_results(path, rows)
    back = results.read_results(path)
    assert [r.get("note") for r in back] == [None, "needs sm_90", "fast"], back
    body = report.stage_body(back)
    assert [line[0] for line in body] == ["07_async_pipeline", "08.3", "08_fp8"] and body[2][2] == "skip", body
    sweep = report.results_sweep_table(back, 128, 0)
    assert "| 08.3 |" in sweep and "| 08_fp8 | skip" in sweep, sweep


# --- The commands, on stand-in chapter binaries ------------------------------------------

FAKE_BINARY = '''#!{python}
"""A stand-in for a chapter binary: behaviour chosen by its name."""
import os, sys
name = os.path.basename(sys.argv[0])
args = sys.argv[1:]
if "--dry-run" in args:
    print(f"{{name}}: the fake idea of {{name}}")
    sys.exit(0)
def flag(f, default):
    return int(args[args.index(f) + 1]) if f in args else default
b, h, n, d = flag("--batch", 8), flag("--heads", 16), flag("--seqlen", 2048), flag("--headdim", 128)
c = int("--causal" in args)
if name.endswith("old"):
    print(f"{{name}}: skipped: needs sm_80 or newer")
    sys.exit(77)
if name.endswith("big") and n >= 4096:
    print(f"{{name}}: this shape needs 99.0 GiB of device memory", file=sys.stderr)
    sys.exit(2)
ms = 300.0 * (n / 1024) ** 2 if name.endswith("slow") else 1.0 * (n / 1024) ** 2
status = "FAIL" if name.endswith("bad") else "PASS"
tflops = 4.0 * b * h * n * n * d / (2 if c else 1) / (ms * 1e-3) / 1e12
mem = 4 * b * h * n * d * 2 + b * h * n * 4
deterministic = "--deterministic" in args
if deterministic and "--backward" not in args:
    print(f"{{name}}: --deterministic is a mode of the backward pass: add --backward, or drop it", file=sys.stderr)
    sys.exit(2)
if "--backward" in args:  # as 09 does: 2.5x the work, Q K V O dO dQ dK dV and LSE held, each gradient's error
    if not name.startswith("09_"):
        print(f"{{name}}: this chapter has no backward pass (--backward): drop it", file=sys.stderr)
        sys.exit(2)
    ms *= 2.5 * (1.25 if deterministic else 1)  # its deterministic mode: slower, its row named for it
    mem = 8 * b * h * n * d * 2 + b * h * n * 4
    impl = name + (".deterministic" if deterministic else "")
    print(f"{{impl}},{{b}},{{h}},{{n}},{{d}},{{c}},fp16,{{ms:.4f}},{{tflops:.2f}},3.100e-04,{{status}},1e-3,,2,0,,,,"
          f"{{mem}},3.100e-04,2.900e-04,2.800e-04")
    sys.exit(1 if status == "FAIL" else 0)
print(f"{{name}},{{b}},{{h}},{{n}},{{d}},{{c}},fp16,{{ms:.4f}},{{tflops:.2f}},3.000e-04,{{status}},1e-3,1e-5,1,0,,,,"
      f"{{mem}}")
sys.exit(1 if status == "FAIL" else 0)
'''


def make_fake_build(folder, names):
    """Write executable stand-in chapter binaries (FAKE_BINARY) named names into folder; its path as a str."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = folder / name
        path.write_text(FAKE_BINARY.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(folder)


def without_torch(monkeypatch):
    """Commands run as if PyTorch were absent, whatever this machine has."""
    monkeypatch.setattr(stages, "torch_gpu_ready", lambda line: (print(line), False)[1])


def results_csvs(out):
    """The results CSVs (not the notes) in folder out."""
    return [p for p in os.listdir(out) if p.endswith(".csv") and not p.endswith(".notes.csv")]


def test_bench_on_fake_binaries(tmp_path, capsys, monkeypatch):
    without_torch(monkeypatch)
    names = ["01_slow", "02_big", "03_old", "04_bad", "05_good"]
    build = make_fake_build(tmp_path / "build", names)
    out = tmp_path / "results"
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.STAGE_BEGIN}\n{report.STAGE_END}\n")
    args = stages.parse_args(["bench", "--build", build, "--quick", "--out", str(out), "--readme", str(readme)] + names)
    code, printed = printed_by(capsys, stages.command_bench, args)
    assert code == 1, printed  # 04_bad FAILed
    assert "PyTorch not found: anchor rows skipped" in printed
    csv_files = results_csvs(out)
    assert len(csv_files) == 1, os.listdir(out)
    rows = results.read_results(str(out / csv_files[0]))
    assert len(rows) == 8 * len(names)

    def at(impl, n, d=128, c=0):
        return results.find_row(rows, impl, d, n, c)
    assert at("01_slow", 1024)["status"] == "PASS"
    assert at("01_slow", 4096)["status"] == "SKIP"
    assert at("01_slow", 4096)["note"] == "projected 17 s"  # 300 ms x 4 x 14
    assert at("01_slow", 4096)["ms"] is None
    assert at("02_big", 4096, 64, 1)["note"] == "this shape needs 99.0 GiB of device memory"
    assert at("03_old", 1024)["status"] == "SKIP" and "needs sm_80" in at("03_old", 1024)["note"]
    assert at("04_bad", 4096)["status"] == "FAIL" and at("04_bad", 4096)["ms"] == 16.0
    assert at("05_good", 4096)["status"] == "PASS" and at("05_good", 4096)["tflops"] > 0
    assert (out / (csv_files[0][:-4] + ".md")).exists()
    assert at("05_good", 4096)["device_bytes"] == 4 * 4 * 16 * 4096 * 128 * 2 + 4 * 16 * 4096 * 4
    assert "| 05_good | 269 MB | 16.0 |" in read(readme)


def test_bench_of_some_chapters_keeps_the_others(tmp_path, capsys, monkeypatch):
    """A bench of a few chapters (or --quick) replaces their rows and keeps every other row of the file."""
    without_torch(monkeypatch)
    build = make_fake_build(tmp_path / "build", ["05_good", "06_good"])
    out = tmp_path / "results"
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.STAGE_BEGIN}\n{report.STAGE_END}\n")

    def bench(*names):
        args = stages.parse_args(["bench", "--build", build, "--quick", "--out", str(out), "--readme", str(readme)]
                                 + list(names))
        return printed_by(capsys, stages.command_bench, args)
    bench("05_good", "06_good")
    csv_path = str(out / results_csvs(out)[0])
    first = {results.row_key(r): r for r in results.read_results(csv_path)}
    code, printed = bench("06_good")
    assert code == 0, printed
    second = {results.row_key(r): r for r in results.read_results(csv_path)}
    assert second.keys() == first.keys(), "a bench of 06 alone dropped or added rows"
    assert all(second[k] == first[k] for k in first if k[0] == "05_good"), "05's rows changed"
    env = results.read_env(results.env_path(csv_path))
    assert env["kept_rows"].startswith("8 rows"), env.get("kept_rows")


def test_bench_stops_when_every_chapter_skips(tmp_path, capsys, monkeypatch):
    without_torch(monkeypatch)
    build = make_fake_build(tmp_path / "build", ["01_old", "02_old"])
    out = tmp_path / "results"
    args = stages.parse_args(["bench", "--build", build, "--quick", "--out", str(out),
                              "--readme", str(tmp_path / "README.md"), "01_old", "02_old"])
    code, printed = printed_by(capsys, stages.command_bench, args)
    assert code == 77 and not out.exists(), f"exit {code} (expected 77, skipped): {printed}"
    assert "nothing measured" in printed and "PyTorch not found" in printed, printed


def test_run_on_fake_binaries(tmp_path, capsys, monkeypatch):
    """make run on stand-in binaries: exit 0 with a skip, 1 with a FAIL or a missing binary."""
    monkeypatch.setenv("COLUMNS", "200")  # wide enough that "adds" is not cut
    build = make_fake_build(tmp_path / "build", ["01_good", "02_good", "03_old", "04_bad"])
    code, printed = printed_by(capsys, stages.command_run,
                               stages.parse_args(["run", "--build", build, "01_good", "02_good", "03_old"]))
    assert code == 0, printed
    assert "running 01_good" in printed and "not a failure" in printed
    line = next(line for line in printed.splitlines() if line.startswith("02_good "))
    assert "the fake idea of 02_good" in line and "4.00" in line and "PASS" in line, line
    code, printed = printed_by(capsys, stages.command_run,
                               stages.parse_args(["run", "--build", build, "01_good", "04_bad", "09_missing"]))
    assert code == 1 and "failed: 04_bad, 09_missing" in printed, printed


def test_table_command_without_csv(tmp_path, capsys):
    args = stages.parse_args(["table", "--csv", str(tmp_path / "none.csv")])
    assert stages.command_table(args) == 2
    assert "no results CSV" in capsys.readouterr().err


def test_scripts_run_as_programs(repo, tmp_path):
    """make run/bench/compare call common/stages.py as a program: it must act, not just import."""
    proc = repo.run([sys.executable, ROOT / "common" / "stages.py", "table", "--csv", tmp_path / "none.csv"],
                    timeout=60)
    assert proc.returncode == 2 and "no results CSV" in proc.stderr, \
        f"stages.py table as a program: exit {proc.returncode}, stderr {proc.stderr!r}"
    for script in ("stages.py", "anchors.py", "reference.py"):
        source = read(ROOT / "common" / script)
        assert 'if __name__ == "__main__":' in source, f"common/{script} has no main guard: running it does nothing"
