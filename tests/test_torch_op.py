"""The PyTorch op's module (common/torch_op.py) and `make train` (common/train.py) without PyTorch or a GPU.

Both import where PyTorch is missing and say so in one line: available() is False, attention() raises
ImportError; train.py and `make train` print one line and exit 77, the skip code; train.py without its
libraries (--no-build) says so in one line, exit 1. The chapter names resolve to the builds `make lib` makes;
determinism is no build ('09.deterministic' is refused, pointing at deterministic=True).
The ctypes binding is common/library.h's: its codes, its FaShape (common/shape.h's AttnShape, field by field),
its functions and their arities; loaded on a chapter's library (the build folder's, BUILD/lib), it reads what
the chapter says about itself and its workspaces (the backward's in each mode), and its calls are refused as
the C probe's are
(test_library), with the code and line turned into a LibraryError. PyTorch is hidden from each child process
(sys.modules['torch'] = None), so all of this holds where it is installed too.
"""
import ctypes
import math
import importlib.util
import json
import re
import shlex
import statistics

import pytest

import runner
import torch_op
from chapters import read_chapter
from helpers import WORKSPACE, has_backward
from test_library import backward_workspace, codes, exported_names, header, library

HIDE_TORCH = "import sys\nsys.modules['torch'] = None  # `import torch` raises ImportError from here on\n"
NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}
BINDING_CHAPTERS = ("07_async_pipeline", "08_fp8", "09_backward")


def run_hidden(repo, body, env=None, args=()):
    """body run by repo.python with PyTorch hidden and common/ on sys.path: the CompletedProcess."""
    script = HIDE_TORCH + f"sys.path.insert(0, {str(repo.root / 'common')!r})\n" + body
    return repo.run([repo.python, "-c", script, *args], env=env, timeout=120)


def test_imports_without_torch(repo):
    proc = run_hidden(repo, "import torch_op\n"
                           "print('available', torch_op.available())\n"
                           "try:\n"
                           "    torch_op.attention(None, None, None)\n"
                           "except ImportError as exc:\n"
                           "    print('ImportError', exc)\n")
    assert proc.returncode == 0, (
        f"importing torch_op without PyTorch: exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    lines = proc.stdout.splitlines()
    assert lines[:1] == ["available False"], f"torch_op.available() without PyTorch: {proc.stdout!r}"
    assert len(lines) == 2 and lines[1].startswith("ImportError ") and "PyTorch" in lines[1] \
        and "pip install torch" in lines[1], (
        f"attention() without PyTorch should raise ImportError in one line naming PyTorch: {proc.stdout!r}")


NOTHING_TRAINED = "make train: skipped: PyTorch not found (pip install torch): nothing trained\n"


def run_train_hidden(repo, *args):
    """common/train.py ARGS run as a script, PyTorch hidden: the CompletedProcess."""
    body = "import runpy\nsys.argv = ['train.py'] + sys.argv[1:]\nrunpy.run_path({!r}, run_name='__main__')\n".format(
        str(repo.root / "common" / "train.py"))
    return run_hidden(repo, body, args=args)


def test_train_without_torch(repo):
    """train.py says in one line that nothing was trained, and exits 77, the skip code (`make train`'s recipe)."""
    proc = run_train_hidden(repo, "--quick")
    assert proc.returncode == 77 and proc.stdout == NOTHING_TRAINED, (
        f"train.py --quick without PyTorch: exit {proc.returncode}, stdout {proc.stdout!r} (stderr "
        f"{proc.stderr.strip()[-1500:]!r}); expected exit 77 and {NOTHING_TRAINED!r}")


def test_train_refuses_a_wrong_chapter(repo):
    """A chapter that does not exist is a usage error (exit 2), PyTorch or not."""
    wrong = run_train_hidden(repo, "--chapter", "42")
    assert wrong.returncode == 2 and "chapter '42': no such chapter" in wrong.stderr, (
        f"train.py --chapter 42: exit {wrong.returncode}, stderr {wrong.stderr.strip()!r}")


def test_train_without_libraries(repo, tmp_path):
    """train.py --no-build on a build folder without the libraries: one line naming the make command,
    exit 1, not a traceback (its GPU check stood in for, so that it gets that far here)."""
    body = ("import train\ntrain.why_not_here = lambda: None  # as on a GPU\n"
            "sys.exit(train.main(sys.argv[1:]))\n")
    proc = run_hidden(repo, body, args=["--no-build", "--build", str(tmp_path), "--chapter", "07"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "not found" in lines[0] \
        and f"make lib BUILD={tmp_path}" in lines[0], (
        f"train.py --no-build without its libraries: exit {proc.returncode}, stderr {proc.stderr.strip()[-1500:]!r}")


def make_train(repo, *args):
    """make train ARGS with this Python (PyTorch as it is here) on the build folder."""
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("PyTorch is installed here: `make train` would train (test_torch_op_gpu runs it)")
    return repo.run(shlex.split(repo.make) + ["--no-print-directory", f"BUILD={repo.build}",
                                              f"PYTHON_SYS={repo.python}", "train", *args],
                    env=runner.make_env(), timeout=300)


def test_make_train_without_torch(repo):
    """The Makefile: "Without PyTorch or a GPU: one line, exit 77": the line, and the recipe's exit 77, the skip
    code (make reports it as "Error 77" and exits 2, as make does on any failed recipe)."""
    proc = make_train(repo, "CH=07", "TRAIN_ARGS=--quick")
    assert proc.stdout == NOTHING_TRAINED and proc.returncode == 2 and re.search(r"\] Error 77$", proc.stderr, re.M), (
        f"make train without PyTorch: exit {proc.returncode}, stdout {proc.stdout!r}, stderr "
        f"{proc.stderr.strip()[-800:]!r}; expected {NOTHING_TRAINED!r} and the recipe's exit 77 (make: '... Error 77')")


def test_make_train_refuses_a_wrong_chapter(repo):
    wrong = make_train(repo, "CH=42")
    assert wrong.returncode != 0 and "no chapter '42'" in wrong.stderr, (
        f"make train CH=42: exit {wrong.returncode}, stderr {wrong.stderr.strip()!r}")


def test_train_chapter_runs_and_modes(repo):
    """--chapter's runs: a chapter, a step, and CH@deterministic (09's backward in its deterministic mode);
    any other mode is refused; the file names they give."""
    body = ("import train\n"
            "runs = train.chapter_runs('07,08.3,07@deterministic')\n"
            "print(runs)\n"
            "print([train.short_name(r) for r in runs])\n"
            "try:\n"
            "    train.chapter_runs('07@fast')\n"
            "except ValueError as exc:\n"
            "    print('refused', exc)\n")
    proc = run_hidden(repo, body)
    assert proc.returncode == 0, proc.stderr.strip()[-1500:]
    lines = proc.stdout.splitlines()
    assert lines[0] == ("{'07_async_pipeline': ('07_async_pipeline', False), '08_fp8.step3': ('08_fp8.step3', False), "
                        "'07_async_pipeline@deterministic': ('07_async_pipeline', True)}"), lines[0]
    assert lines[1] == "['07', '08.3', '07det']", lines[1]
    assert lines[2].startswith("refused --chapter '07@fast': the one mode is deterministic"), lines[2]


def training_rows():
    """Rows as train.py writes them: SDPA and one chapter, seeds 0 and 1, evaluations at steps 0, 10, 20,
    with final validation losses 1.0 / 1.2 (SDPA) and 1.1 / 1.25 (the chapter)."""
    final = {("sdpa", 0): 1.0, ("sdpa", 1): 1.2, ("07_async_pipeline", 0): 1.1, ("07_async_pipeline", 1): 1.25}
    rows = []
    for seed in (0, 1):
        for run in ("sdpa", "07_async_pipeline"):
            common = {"run": run, "seed": seed, "backward": "" if run == "sdpa" else "09_backward", "gpu": "NVIDIA H100"}
            rows += [dict(common, step=0, train_loss=None, val_loss=5.0, tokens_per_s=None),
                     dict(common, step=10, train_loss=3.0, val_loss=2.0, tokens_per_s=9e5),
                     dict(common, step=20, train_loss=1.5, val_loss=final[(run, seed)],
                          tokens_per_s=1e6 if run == "sdpa" else 5e5)]
    return rows


def test_training_summary_arithmetic(tmp_path):
    """summarize() on known rows, through the CSV: means, sample std, ranges, differences from SDPA's run of the
    same seed, and tokens/s over every interval but the first."""
    import train
    path = tmp_path / "train.csv"
    train.write_csv(str(path), training_rows())
    got = {r["run"]: r for r in train.summarize(train.read_csv(str(path)))}
    sdpa, chapter = got["sdpa"], got["07_async_pipeline"]
    assert (sdpa["seeds"], sdpa["steps"], sdpa["diff"]) == (2, 20, None)
    assert sdpa["mean"] == pytest.approx(1.1) and sdpa["std"] == pytest.approx(0.2 / 2 ** 0.5)
    assert (sdpa["min"], sdpa["max"]) == (1.0, 1.2)
    assert chapter["mean"] == pytest.approx(1.175) and chapter["diff"] == pytest.approx((0.075, 0.05, 0.1))
    assert sdpa["tokens_per_s"] == pytest.approx(1e6) and chapter["tokens_per_s"] == pytest.approx(5e5)
    table = train.summary_table(train.read_csv(str(path)))
    assert "| 07 forward, 09 backward | 2 | 1.1750 | 0.1061 | 1.1000 | 1.2500 | +0.0750 | +0.0500 | +0.1000 | 0.50M |" \
        in table.splitlines(), table
    one_seed = train.summary_table([r for r in train.read_csv(str(path)) if r["seed"] == 0])
    assert "| 07 forward, 09 backward | 1 | 1.1000 | - | 1.1000 | 1.1000 | +0.1000 | +0.1000 | +0.1000 | 0.50M |" \
        in one_seed.splitlines(), one_seed
    assert train.run_label("08_fp8.step3@deterministic", "10_backward_hopper") == \
        "08.3 forward, 10 backward (deterministic)"


def test_train_from_csvs_joins_seeds_without_torch(repo, tmp_path):
    """train.py --from: the CSVs of two calls (seed 0, seed 1) joined into --out with the summary of both
    seeds, PyTorch hidden; the same (run, seed) in two files, runs of different schedules, and runs of different
    GPUs (whose tokens per second would be averaged) are refused (exit 2)."""
    import train
    rows = training_rows()
    for seed in (0, 1):
        train.write_csv(str(tmp_path / f"seed{seed}.csv"), [r for r in rows if r["seed"] == seed])
    out = tmp_path / "joined.csv"
    body = "import train\nsys.exit(train.main(sys.argv[1:]))\n"
    proc = run_hidden(repo, body, args=["--from", str(tmp_path / "seed0.csv"), str(tmp_path / "seed1.csv"),
                                        "--out", str(out)])
    assert proc.returncode == 0, f"train.py --from: exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"
    assert train.read_csv(str(out)) == train.read_csv(str(tmp_path / "seed0.csv")) + train.read_csv(str(tmp_path / "seed1.csv"))
    assert train.summary_table(train.read_csv(str(out))) in proc.stdout, proc.stdout
    twice = run_hidden(repo, body, args=["--from", str(tmp_path / "seed0.csv"), str(tmp_path / "seed0.csv"),
                                         "--out", str(tmp_path / "twice.csv")])
    assert twice.returncode == 2 and "seed 0 is in more than one file" in twice.stderr, (twice.returncode, twice.stderr)
    train.write_csv(str(tmp_path / "short.csv"), [r for r in rows if r["seed"] == 1 and r["step"] < 20])
    unlike = run_hidden(repo, body, args=["--from", str(tmp_path / "seed0.csv"), str(tmp_path / "short.csv"),
                                          "--out", str(tmp_path / "unlike.csv")])
    assert unlike.returncode == 2 and "evaluated at different steps" in unlike.stderr, (unlike.returncode, unlike.stderr)
    train.write_csv(str(tmp_path / "other_gpu.csv"), [dict(r, gpu="NVIDIA H200") for r in rows if r["seed"] == 1])
    mixed = run_hidden(repo, body, args=["--from", str(tmp_path / "seed0.csv"), str(tmp_path / "other_gpu.csv"),
                                         "--out", str(tmp_path / "mixed.csv")])
    assert mixed.returncode == 2 and "ran on different GPUs (NVIDIA H100, NVIDIA H200)" in mixed.stderr, (
        mixed.returncode, mixed.stderr)


def test_training_table_is_its_csv(repo):
    """docs/pytorch.md's training table is summary_table() of the CSV its marker names."""
    import train
    text = (repo.root / "docs" / "pytorch.md").read_text()
    pattern = re.escape(train.TABLE_BEGIN).replace(re.escape("{csv}"), r"(\S+)")
    found = re.search(pattern + r"\n(.*?)" + re.escape(train.TABLE_END), text, re.S)
    assert found, f"docs/pytorch.md: no training table between {train.TABLE_BEGIN!r} and {train.TABLE_END!r}"
    path = repo.root / found.group(1)
    if not path.is_file():
        pytest.skip(f"{found.group(1)} not measured yet (`make train` with --table docs/pytorch.md writes it)")
    want = train.summary_table(train.read_csv(str(path)))
    assert found.group(2).strip() == want, f"docs/pytorch.md's training table is not {found.group(1)}'s:\n{want}"


def test_training_prose_is_its_csv(repo):
    """The numbers docs/pytorch.md says under its training table, recomputed from the table's CSV."""
    import train
    text = " ".join((repo.root / "docs" / "pytorch.md").read_text().split())
    path = repo.root / "docs/results/train/train_07_08_07det_seeds0-1-2.csv"
    assert path.is_file(), f"{path.name}, which docs/pytorch.md and the README quote, is missing"
    runs = train.curves(train.read_csv(str(path)))
    sdpa, chapters = runs[train.SDPA_RUN], [r for r in runs if r != train.SDPA_RUN]
    summary = {r["run"]: r for r in train.summarize(train.read_csv(str(path)))}
    means = [summary[r]["mean"] for r in runs]
    differences = {run: [rows[-1]["val_loss"] - sdpa[seed][-1]["val_loss"] for seed, rows in runs[run].items()]
                   for run in chapters}
    mean_differences = [sum(d) / len(d) for d in differences.values()]
    single = [d for ds in differences.values() for d in ds]

    def gap(run, seed, index):
        return abs(runs[run][seed][index]["val_loss"] - sdpa[seed][index]["val_loss"])

    steps = [row["step"] for row in next(iter(sdpa.values()))]
    early = max(gap(run, seed, i) for run in chapters for seed in runs[run] for i, step in enumerate(steps)
                if 0 < step < 500)
    late = max(gap(run, seed, i) for run in chapters for seed in runs[run] for i, step in enumerate(steps)
               if step >= 1500)
    sdpa_range = {step: max(rows[i]["val_loss"] for rows in sdpa.values()) -
                  min(rows[i]["val_loss"] for rows in sdpa.values()) for i, step in enumerate(steps)}
    atomic_std = sorted(summary[r]["std"] for r in chapters if not r.endswith(train.DETERMINISTIC))
    rate = {run: {seed: train.steady_rate(rows) / 1e6 for seed, rows in seeds.items()} for run, seeds in runs.items()}
    deterministic = rate[next(r for r in chapters if r.endswith(train.DETERMINISTIC))]
    def up(x):  # a bound the prose states: rounded up, never down
        return math.ceil(x * 1e4 - 1e-9) / 1e4

    said = [f"within {up(max(means) - min(means)):.4f} nats of each other ({min(means):.4f} to {max(means):.4f})",
            f"({min(mean_differences):+.4f} to {max(mean_differences):+.4f})",
            f"differences ({min(single):+.4f} to {max(single):+.4f})",
            f"a gap of {max(abs(d) for d in single) / min(means) * 100:.1f}% either way",
            f"{sdpa_range[150]:.3f} nats at step 150 and {sdpa_range[steps[-1]]:.4f} at step {steps[-1]}",
            f"(up to {early:.3f} before step 500)", f"at most {late:.4f} from step 1500",
            f"(standard deviation {atomic_std[0]:.4f}-{atomic_std[-1]:.4f} for 07 and 08",
            f"{summary[train.SDPA_RUN]['std']:.4f} for SDPA's",
            f"{summary[next(r for r in chapters if r.endswith(train.DETERMINISTIC))]['std']:.4f} for 07 with the "
            "deterministic backward",
            f"{deterministic[0]:.2f}M tokens/s for seeds 0 and 1, {deterministic[2]:.2f}M for seed 2",
            f"SDPA {min(rate[train.SDPA_RUN].values()):.2f}-{max(rate[train.SDPA_RUN].values()):.2f}M in all three"]
    assert f"{deterministic[1]:.2f}" == f"{deterministic[0]:.2f}", deterministic
    assert min(single) < 0 < max(single), f"'either way' needs single-seed differences of both signs: {single}"
    # 07's paired differences: their standard error, and a 95% interval's half-width (Student's t, 2 degrees
    # of freedom: 4.303) against the mean loss.
    first = differences[next(r for r in chapters if not r.endswith(train.DETERMINISTIC))]
    assert len(first) == 3, "the interval below uses t for three seeds"
    error = statistics.stdev(first) / math.sqrt(len(first))
    said += [f"standard error of {error:.4f} nats", f"reaches {4.303 * error / min(means) * 100:.1f}% either way"]
    missing = [words for words in said if words not in text]
    assert not missing, f"docs/pytorch.md's training prose does not say what its CSV gives: {missing}"
    atomic = [d for run, d in zip(chapters, mean_differences) if not run.endswith(train.DETERMINISTIC)]
    largest = max(abs(d) for d in atomic)
    readme = " ".join((repo.root / "README.md").read_text().split())
    seeds = {seed for rows in runs.values() for seed in rows}
    words = {3: "three", 4: "four", 5: "five"}
    summary_words = [f"within {up(largest):.4f} nats ({largest / summary[train.SDPA_RUN]['mean'] * 100:.2f}%) of SDPA's",
                     f"by up to {max(abs(d) for d in single) / min(means) * 100:.1f}% either way",
                     f"Over {words.get(len(seeds), len(seeds))} initialisation seeds",
                     f"({steps[-1]} steps each)"]
    missing = [words for words in summary_words if words not in readme]
    assert not missing, f"README.md's training sentence does not say what {path.name} gives: {missing}"


def test_auto_backward_is_the_latest_that_runs(repo):
    """backward="auto": the latest chapter with a backward pass that is built and runs on the GPU, past
    those not yet faster than the one before (NOT_YET_FASTER, each a real backward chapter); none on a GPU
    older than every backward chapter's oldest, with what was looked at."""
    assert set(torch_op.NOT_YET_FASTER) <= {c for c in runner.chapters() if has_backward(repo, c)}, (
        f"NOT_YET_FASTER names what is no backward chapter: {sorted(torch_op.NOT_YET_FASTER)}")
    docs = " ".join((repo.root / "docs/pytorch.md").read_text().split())
    passed_over = ", ".join(c[:2] for c in sorted(torch_op.NOT_YET_FASTER)) or "none"
    assert f"(`torch_op.NOT_YET_FASTER`: today {passed_over}," in docs, (
        f"docs/pytorch.md should name what auto passes over today: {passed_over}")
    backward_chapters = [c for c in runner.chapters() if has_backward(repo, c) and c not in torch_op.NOT_YET_FASTER]
    body = ("import torch_op\n"
            f"print(torch_op.auto_backward(90, {str(repo.build)!r}))\n"
            "try:\n"
            f"    torch_op.auto_backward(70, {str(repo.build)!r})\n"
            "except RuntimeError as exc:\n"
            "    print('refused', exc)\n")
    proc = run_hidden(repo, body)
    assert proc.returncode == 0, proc.stderr.strip()[-1500:]
    lines = proc.stdout.splitlines()
    assert lines[0] == backward_chapters[-1], f"auto_backward(90): {lines[0]!r}, expected {backward_chapters[-1]}"
    assert lines[1].startswith("refused backward='auto': no chapter's backward runs here:") and all(
        f"{c} (does not run on sm_70)" in lines[1] for c in backward_chapters) and all(
        f"{c} (passed over: " in lines[1] for c in torch_op.NOT_YET_FASTER), lines[1]


BUILD_NAMES = {
    "7": "07_async_pipeline", "07": "07_async_pipeline", "07_async_pipeline": "07_async_pipeline",
    "8": "08_fp8", "08.6": "08_fp8", "08.5": "08_fp8.step5", "08.1": "08_fp8.step1", "8.3": "08_fp8.step3",
    "08_fp8.step4": "08_fp8.step4",
    "09": "09_backward",
}
NAMES_REFUSED = {"42": r"chapter '42': no such chapter.*07_async_pipeline", "": r"no such chapter",
                 "seven": r"no such chapter", "08.7": r"08_fp8's steps are 08\.1 \.\.\. 08\.6",
                 "07.2": r"07_async_pipeline is not built in steps",
                 "09.deterministic": r"09_backward has no build 'deterministic'.*pass deterministic=True",
                 "09_backward.deterministic": r"09_backward has no build 'deterministic'.*pass deterministic=True",
                 "07.fast": r"07_async_pipeline has no build 'fast' \(a step is named as 07\.K\)$"}


def test_build_names(repo, tmp_path):
    """Chapter names as the Makefile takes them, to the builds `make lib` makes (its targets)."""
    dry = repo.run(shlex.split(repo.make) + ["-n", "--no-print-directory", f"BUILD={tmp_path}", "ARCH=sm_80", "lib"],
                   env=runner.make_env(), timeout=120)
    built = set(re.findall(rf"{re.escape(str(tmp_path))}/lib/(\S+)\.so\b", dry.stdout))
    wrong = [f"{name!r} -> {torch_op.build_name(name)!r}, expected {want!r}" for name, want in BUILD_NAMES.items()
             if torch_op.build_name(name) != want]
    assert not wrong, "build names: " + "; ".join(wrong)
    assert set(BUILD_NAMES.values()) <= built, (
        f"names of builds `make lib` does not make: {set(BUILD_NAMES.values()) - built}")
    for name, pattern in NAMES_REFUSED.items():
        try:
            got = torch_op.build_name(name)
        except ValueError as exc:
            assert re.search(pattern, str(exc)), f"build_name({name!r}): {exc}, expected to match {pattern!r}"
        else:
            raise AssertionError(f"build_name({name!r}) gave {got!r}: expected a ValueError")


def test_constants_are_library_h(repo):
    code = codes(repo)
    ours = {"OK": torch_op.FA_OK, "ERR_INVALID_ARGUMENT": torch_op.FA_ERR_INVALID_ARGUMENT,
            "ERR_NO_BACKWARD": torch_op.FA_ERR_NO_BACKWARD, "ERR_NO_GPU": torch_op.FA_ERR_NO_GPU,
            "ERR_UNSUPPORTED_GPU": torch_op.FA_ERR_UNSUPPORTED_GPU, "ERR_CUDA": torch_op.FA_ERR_CUDA,
            "ERR_NO_DECODE": torch_op.FA_ERR_NO_DECODE,
            "PRECISION_FP32": torch_op.FA_PRECISION_FP32, "PRECISION_FP16_TC": torch_op.FA_PRECISION_FP16_TC,
            "PRECISION_FP8_TC": torch_op.FA_PRECISION_FP8_TC, "ABI_VERSION": torch_op.ABI_VERSION}
    assert ours == code, f"torch_op's constants {ours} differ from common/library.h's {code}"
    alignment = int(re.search(r"#define FA_ALIGNMENT (\d+)", header(repo)).group(1))
    assert torch_op.ALIGNMENT == alignment, f"torch_op.ALIGNMENT {torch_op.ALIGNMENT}, library.h {alignment}"


C_TYPES = {"int": ctypes.c_int, "float": ctypes.c_float, "long long": ctypes.c_longlong}


@pytest.mark.parametrize("c_name, ours, size", [("AttnShape", "FaShape", 24), ("DecodeShape", "FaDecodeShape", 40)])
def test_shapes_are_shape_h(repo, c_name, ours, size):
    """FaShape and FaDecodeShape: common/shape.h's AttnShape and DecodeShape, their fields in its order, of
    its C types, and the C size."""
    body = re.search(rf"typedef struct \{{([^{{}}]*)\}} {c_name};", (repo.root / "common" / "shape.h").read_text())
    assert body, f"common/shape.h: no `typedef struct {{ ... }} {c_name};`"
    fields = [(name, C_TYPES[kind]) for kind, name in
              re.findall(r"^\s*(int|float|long long)\s+(\w+);", body.group(1), re.M)]
    struct = getattr(torch_op, ours)
    assert fields and list(struct._fields_) == fields, f"torch_op.{ours} {struct._fields_} is not {c_name} {fields}"
    assert ctypes.sizeof(struct) == size, f"sizeof({ours}) {ctypes.sizeof(struct)}, the C one is {size}"


def c_parameter_type(param):
    """The ctypes type of one C parameter of library.h ('const FaShape *shape', 'size_t workspace_bytes')."""
    if "FaShape *" in param:
        return ctypes.POINTER(torch_op.FaShape)
    if "FaDecodeShape *" in param:
        return ctypes.POINTER(torch_op.FaDecodeShape)
    if param.split()[0] == "size_t":
        return ctypes.POINTER(ctypes.c_size_t) if "*" in param else ctypes.c_size_t
    if param.split()[0] == "int":
        assert "*" not in param, f"library.h: a parameter the binding has no rule for: {param!r}"
        return ctypes.c_int  # the backward's mode, decoding's max_length
    if param.startswith("const int *"):
        return ctypes.c_void_p  # decoding's block table and lengths: int32 in device memory
    assert "*" in param, f"library.h: a parameter the binding has no rule for: {param!r}"
    return ctypes.c_void_p  # a device pointer, the stream


def test_signatures_are_library_h(repo):
    """One ctypes signature per function library.h declares: its return type and each parameter's type, in order."""
    declared = {}
    for ret, name, params in re.findall(r"^FA_API ([^;(]*?)\b(fa_\w+)\(([^)]*)\);", header(repo), re.M | re.S):
        kinds = [] if params.strip() == "void" else [c_parameter_type(p.strip()) for p in params.split(",")]
        declared[name] = (ctypes.c_char_p if "char *" in ret else ctypes.c_int, kinds)
    assert set(declared) == exported_names(repo), f"library.h's declarations read as {sorted(declared)}"
    ours = {name: (restype, list(argtypes)) for name, (restype, argtypes) in torch_op.SIGNATURES.items()}
    assert ours == declared, f"torch_op.SIGNATURES {ours} differ from library.h's {declared}"


BINDING_PROBE = """
import json
import torch_op
out = {}
for chapter, path in json.loads(sys.argv[1]).items():
    lib = torch_op.Library(path)
    facts = {"name": lib.name, "precision": lib.precision, "has_backward": lib.has_backward,
             "min_sm": lib.min_sm, "max_sm": lib.max_sm, "workspace": {}, "backward_workspace": {},
             "deterministic_backward_workspace": {}, "refused": {}}
    for b, h, n, d in json.loads(sys.argv[2]):
        shape = torch_op.make_shape(b, h, n, d, 0, 0.125)
        facts["workspace"][f"{b} {h} {n} {d}"] = lib.workspace_bytes(shape)
        if lib.has_backward:
            facts["backward_workspace"][f"{b} {h} {n} {d}"] = lib.backward_workspace_bytes(shape)
            facts["deterministic_backward_workspace"][f"{b} {h} {n} {d}"] = lib.backward_workspace_bytes(shape, True)
    good, pointers = torch_op.make_shape(1, 2, 16, 64, 1, 0.125), [0x7F0000000000 + 0x1000000 * i for i in range(1, 10)]
    calls = {
        "headdim 96": lambda: lib.workspace_bytes(torch_op.make_shape(1, 2, 16, 96, 0, 0.125)),
        "scale 0": lambda: lib.forward(torch_op.make_shape(1, 2, 16, 64, 0, 0.0), *pointers[:5], None, 0, None),
        "q misaligned": lambda: lib.forward(good, pointers[0] + 2, *pointers[1:5], None, 0, None),
        "valid forward": lambda: lib.forward(good, *pointers[:5], pointers[5], 1 << 30, None),
        "valid backward": lambda: lib.backward(good, False, *pointers[:9], pointers[0], 1 << 30, None),
        "valid deterministic backward": lambda: lib.backward(good, True, *pointers[:9], pointers[0], 1 << 30, None),
        "deterministic, workspace too small": lambda: lib.backward(good, True, *pointers[:9], pointers[0], 1, None),
    }
    for label, call in calls.items():
        try:
            call()
            facts["refused"][label] = None
        except torch_op.LibraryError as exc:
            facts["refused"][label] = [exc.code, str(exc)]
    out[chapter] = facts
print(json.dumps(out))
"""
SHAPES = [(1, 2, 16, 64), (2, 3, 100, 128), (3, 5, 1000, 64)]


def test_binding_without_gpu(repo):
    """torch_op.Library on built libraries, every GPU hidden and PyTorch too: what each chapter says of
    itself, its workspaces (the chapter's rule), and its refusals as LibraryErrors with library.h's codes."""
    paths = {chapter: str(library(repo, chapter)) for chapter in BINDING_CHAPTERS}
    proc = run_hidden(repo, BINDING_PROBE, env=NO_GPU_ENV, args=[json.dumps(paths), json.dumps(SHAPES)])
    assert proc.returncode == 0, f"the binding's probe: exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"
    found = json.loads(proc.stdout)
    code = codes(repo)
    wrong = []
    for chapter in BINDING_CHAPTERS:
        facts, chapter_says = found[chapter], read_chapter(repo.root / chapter / "attention.cu")
        backward = has_backward(repo, chapter)
        said = {"name": facts["name"], "precision": facts["precision"], "has_backward": facts["has_backward"],
                "min_sm": facts["min_sm"], "max_sm": facts["max_sm"]}
        want = {"name": chapter_says["name"], "precision": code[chapter_says["precision"]], "has_backward": backward,
                "min_sm": chapter_says["min_sm"], "max_sm": chapter_says["max_sm"]}
        if said != want:
            wrong.append(f"{chapter}: says {said}, its source {want}")
        for b, h, n, d in SHAPES:
            key = f"{b} {h} {n} {d}"
            if facts["workspace"][key] != WORKSPACE[int(chapter[:2])](b, h, n, d):
                wrong.append(f"{chapter}: workspace of {key} is {facts['workspace'][key]}")
            if backward and facts["backward_workspace"][key] != backward_workspace(b, h, n, d, build=chapter):
                wrong.append(f"{chapter}: backward workspace of {key} is {facts['backward_workspace'][key]}")
            deterministic = facts["deterministic_backward_workspace"].get(key)
            if backward and deterministic != backward_workspace(b, h, n, d, deterministic=True, build=chapter):
                wrong.append(f"{chapter}: deterministic backward workspace of {key} is {deterministic}")
        no_backward = ("ERR_NO_BACKWARD", r"fa_backward: this chapter has no backward pass")
        no_gpu = ("ERR_NO_GPU", r"fa_backward: no usable CUDA GPU") if backward else no_backward
        expect = {"headdim 96": ("ERR_INVALID_ARGUMENT", r"fa_workspace_bytes: head dimension 96"),
                  "scale 0": ("ERR_INVALID_ARGUMENT", r"fa_forward: scale 0\b"),
                  "q misaligned": ("ERR_INVALID_ARGUMENT", r"fa_forward: q \(0x[0-9a-f]+\) is not 16-byte aligned"),
                  "valid forward": ("ERR_NO_GPU", r"fa_forward: no usable CUDA GPU"),
                  "valid backward": no_gpu, "valid deterministic backward": no_gpu,
                  "deterministic, workspace too small": ("ERR_INVALID_ARGUMENT",
                                                         r"fa_backward: workspace too small: 1 bytes given")
                  if backward else no_backward}
        for label, (name, pattern) in expect.items():
            got = facts["refused"][label]
            if not got or got[0] != code[name] or not re.search(pattern, got[1]) or f"(FA_{name})" not in got[1] \
                    or not got[1].startswith(chapter_says["name"] + ": "):
                wrong.append(f"{chapter} {label}: {got}, expected FA_{name} matching {pattern!r}")
    assert not wrong, f"{len(wrong)} wrong answers of the binding:\n" + "\n".join(wrong)
