"""Tables in a lesson that quote a log (not the bench's CSV, whose tables and inline values are
regenerated): each row is what its log holds, formatted as the table shows it. A table that lists
a measurement by hand is checked here, so that prose and log cannot drift apart."""
import csv
import math
import re
import statistics

import pytest

import results


README_09 = "09_backward/README.md"
LOGS_09 = "docs/results/logs/09"


def markdown_rows(text, header):
    """The body rows (lists of cells) of the Markdown table whose header line starts with header."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header)]
    assert len(starts) == 1, f"{len(starts)} tables with the header {header!r}, expected 1"
    rows = []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def csv_rows(path, fieldnames=None, comment="#"):
    with open(path) as f:
        return list(csv.DictReader((line for line in f if not line.startswith(comment)), fieldnames=fieldnames))


def h100_bench_ms(repo, backward=False):
    """The H100 bench's median ms by (impl, D, N, causal), from its forward's or its backward's results CSV."""
    name = f"docs/results/NVIDIA_H100_80GB_HBM3{'.backward' if backward else ''}.csv"
    return {(r["impl"], r["headdim"], r["seqlen"], bool(r["causal"])): r["ms"]
            for r in results.read_results(repo.root / name) if r["ms"] is not None}


def test_step1_beside_fa2_is_its_log(repo):
    """09's README: 09.1, the chapter and its deterministic mode beside FlashAttention-2 on an H100."""
    log = {(r["shape"], r["causal"]): r for r in csv_rows(repo.root / LOGS_09 / "step1_vs_fa2_h100.csv")}
    table = markdown_rows((repo.root / README_09).read_text(), "| D | mask | FlashAttention-2 | 09.1 |")
    assert len(table) == len(log), f"{len(table)} rows in the table, {len(log)} in the log"
    for d, mask, fa2, *builds in table:
        row = log[(f"B4H16N4096D{d}", "1" if mask == "causal" else "0")]
        want = [f"{float(row['torch_ms']):.2f}"] + [
            f"{float(row[f'{b}_ms']):.2f} ({float(row[f'{b}_speedup']):.2f}x)" for b in ("step1", "chapter", "det")]
        assert [fa2, *builds] == want, f"D={d} {mask}: the table has {[fa2, *builds]}, the log {want}"


def test_final_beside_fa2_is_its_log(repo):
    """09's README, "Measured": the chapter in both modes beside FlashAttention-2 on the H200."""
    log = {(r["shape"], r["causal"]): r for r in csv_rows(repo.root / LOGS_09 / "final_vs_fa2_h200.csv")}
    table = markdown_rows((repo.root / README_09).read_text(), "| B, H, N, D | mask | FlashAttention-2 | 09 |")
    assert len(table) == len(log), f"{len(table)} rows in the table, {len(log)} in the log"
    for shape, mask, *cells in table:
        b, h, n, d = (x.strip() for x in shape.split(","))
        row = log[(f"B{b}H{h}N{n}D{d}", "1" if mask == "causal" else "0")]
        want = [f"{float(row[k]):.2f}" for k in ("torch_ms", "ours_ms", "det_ms")] + [
            f"{float(row[k]):.2f}x" for k in ("ours_speedup", "det_speedup")]
        assert cells == want, f"{shape} {mask}: the table has {cells}, the log {want}"


def step_build(step):
    """A step of 09 as the build that runs it: 09.3 -> 09_backward.step3; 09.8 (the chapter) -> 09_backward."""
    k = int(step.split(".")[1])
    return "09_backward" if k == 8 else f"09_backward.step{k}"


def steps_h100(repo):
    """{(build, D, causal): (ms, TFLOP/s)} of the one-run step timings on the H100."""
    timed = {}
    with open(repo.root / LOGS_09 / "steps_h100.txt") as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) == 5 and fields[0].startswith("09_backward"):
                timed[(fields[0], int(fields[1]), int(fields[2]))] = (float(fields[3]), float(fields[4]))
    return timed




def test_steps_one_run_is_its_log(repo):
    """09's NOTES, "The steps, one run": each step's ms and TFLOP/s at both D, causal and not."""
    timed = steps_h100(repo)
    table = markdown_rows((repo.root / "09_backward/NOTES.md").read_text(), "| step | D=128 | TFLOP/s | causal |")
    assert len(table) == 8, f"{len(table)} steps in the table, expected 8"
    for label, *cells in table:
        build = step_build(label.split()[0])
        want = []
        for d in (128, 64):
            ms, tflops = timed[(build, d, 0)]
            want += [f"{ms:.2f}", f"{tflops:.1f}", f"{timed[(build, d, 1)][0]:.2f}"]
        assert cells == want, f"{label.split()[0]}: the table has {cells}, steps_h100.txt {want}"


def kernel_vs_cudnn_fp8(repo):
    """{(D, causal, N): {column: median}} of the log's rounds: 08's whole forward (`whole`), its kernel
    alone (`kernel`) and cuDNN's FP8 attention (`cudnn`)."""
    rows = csv_rows(repo.root / "docs/results/logs/08/kernel_vs_cudnn_fp8_08_flushed_h100.csv")
    out = {}
    for r in rows:
        shape = out.setdefault((int(r["headdim"]), int(r["causal"]), int(r["seqlen"])), {})
        if r["impl"] == "08_fp8":
            shape.setdefault("whole", []).append(float(r["ms"]))
            shape.setdefault("kernel", []).append(float(r["attend_ms"]))
        else:
            shape.setdefault("cudnn", []).append(float(r["attend_ms"]))
    return {shape: {k: statistics.median(v) for k, v in times.items()} for shape, times in out.items()}


def test_fp8_kernel_beside_cudnn_is_its_log(repo):
    """08's kernel alone against cuDNN's FP8 attention on an H100, L2 flushed before every run, as 08's README and the top README quote it."""
    timed = kernel_vs_cudnn_fp8(repo)

    def x(d, causal, n):
        return f"{timed[(d, causal, n)]['cudnn'] / timed[(d, causal, n)]['kernel']:.2f}x"
    kernel, cudnn = timed[(128, 0, 4096)]["kernel"], timed[(128, 0, 4096)]["cudnn"]
    tflops = 4 * 4 * 16 * 4096 ** 2 * 128 / (kernel * 1e-3) / 1e12  # B4 H16 N4096 D128, non-causal
    quotes = {
        "08_fp8/README.md": [
            f"128): {x(128, 0, 4096)} at N = 4096 ({kernel:.3f} against {cudnn:.3f} ms), {x(128, 0, 8192)} at 8192, "
            f"{x(128, 0, 16384)} at 16384, causal {x(128, 1, 4096)} at 4096",
            f"{x(128, 0, 512)} at N = 512 without the mask, and causal {x(128, 1, 512)} at 512 and {x(128, 1, 1024)} at 1024"],
        "README.md": [
            f"on an H100 at {tflops:.0f} TFLOP/s, {x(128, 0, 4096)} cuDNN's FP8 attention ({x(128, 1, 4096)} causal; "
            f"{x(128, 0, 8192)} at N=8k, {x(128, 0, 16384)} at 16k",
            f"{x(64, 0, 4096)} cuDNN's FP8 attention at N=4096 on the H100 ({x(64, 1, 4096)} causal) and "
            f"{x(64, 0, 16384)} at N=16384"],
    }
    for path, fragments in quotes.items():
        text = " ".join((repo.root / path).read_text().split())
        missing = [f for f in fragments if f not in text]
        assert not missing, f"{path} does not quote kernel_vs_cudnn_fp8_08_flushed_h100.csv as it is: expected {missing}"


def test_09s_step_sections_quote_the_steps_log(repo):
    """The step sections of 09's README: each step's time beside the one before, as steps_h100.txt has
    them (ms to 2 decimals, ratios from the unrounded times), and the interleaved stagger numbers as
    ablation_09.csv has them."""
    timed = steps_h100(repo)

    def ms(step, d, causal=0):
        return f"{timed[(step_build(f'09.{step}'), d, causal)][0]:.2f}"

    def x(a, b, d, causal=0):
        return f"{timed[(step_build(f'09.{a}'), d, causal)][0] / timed[(step_build(f'09.{b}'), d, causal)][0]:.2f}x"
    ablation = {(r["variant"], r["causal"]): float(r["ms"]) for r in csv_rows(repo.root / LOGS_09 / "ablation_09.csv")}
    fragments = [
        f"from {ms(1, 128)} to {ms(2, 128)} ms, {x(1, 2, 128)} ({ms(1, 128, 1)} to {ms(2, 128, 1)} causal; "
        f"{ms(1, 64)} to {ms(2, 64)} at D = 64)",
        f"{ms(2, 128)} to {ms(3, 128)} ms on the H100, {x(2, 3, 128)} ({ms(2, 128, 1)} to {ms(3, 128, 1)} causal; at "
        f"D = 64 {ms(2, 64)} to {ms(3, 64)}, {x(2, 3, 64)})",
        f"{ms(3, 64)} to {ms(4, 64)} ms, {x(3, 4, 64)} ({ms(3, 64, 1)} to {ms(4, 64, 1)} causal)",
        f"{ablation[('step4', '0')]:.2f} to {ablation[('step5', '0')]:.2f} ms without the mask and "
        f"{ablation[('step4', '1')]:.2f} to {ablation[('step5', '1')]:.2f} causal",
        f"{ms(5, 128)} to {ms(6, 128)} ms, {x(5, 6, 128)}, causal {ms(5, 128, 1)} to {ms(6, 128, 1)}",
        f"{ms(6, 128)} to {ms(7, 128)} ms, {x(6, 7, 128)}, causal {ms(6, 128, 1)} to {ms(7, 128, 1)}",
        f"{ms(8, 128)} ms against step 7's {ms(7, 128)} on the H100",
    ]
    text = " ".join((repo.root / README_09).read_text().split())
    missing = [f for f in fragments if f not in text]
    assert not missing, f"09's README does not quote steps_h100.txt / ablation_09.csv as they are: expected {missing}"


def first_run_10(repo, log):
    """A first run of 10's: {(build, deterministic, D, causal): ms} from its log's timing lines."""
    times = {}
    for line in (repo.root / "docs/results/logs/10" / log).read_text().splitlines():
        words = line.split()
        if not (words and (words[0] in ("09_backward", "10_backward_hopper") or
                           re.fullmatch(r"10_backward_hopper\.step\d", words[0]))
                and re.fullmatch(r"[\d.]+,[\d.]+", words[-1])):
            continue
        d = next(int(w[2:]) for w in words if w.startswith("D="))
        times[(words[0], "--deterministic" in words, d, "--causal" in words)] = float(words[-1].split(",")[0])
    return times


# 10's README tables, each its first run's log: (log, the table's header, the builds of its columns, the
# modes timed: the default, then the deterministic where the table has it; the ratio is the last build's
# time over 09's, in the default mode).
BOTH_MODES, DEFAULT_MODE = (False, True), (False,)
TABLES_10 = [("first_run_h100.log", "| D | mask | 09 | 10.1 | 10.1 / 09 |", ("09_backward", "10_backward_hopper"),
              BOTH_MODES),
             ("first_run_10_2_h100.log", "| D | mask | 09 | 10.1 | 10.2 |",
              ("09_backward", "10_backward_hopper.step1", "10_backward_hopper"), BOTH_MODES),
             ("first_run_10_3_h100.log", "| D | mask | 09 | 10.2 | 10.3 |",
              ("09_backward", "10_backward_hopper.step2", "10_backward_hopper"), BOTH_MODES),
             ("first_run_10_5_h100.log", "| D | mask | 09 | 10.3 | 10.4 | 10.5 |",
              ("09_backward", "10_backward_hopper.step3", "10_backward_hopper.step4", "10_backward_hopper"),
              DEFAULT_MODE),
             ("first_run_10_8_h100.log", "| D | mask | 09 | 10.5 | 10.6 | 10.7 | 10.8 |",
              ("09_backward", "10_backward_hopper.step5", "10_backward_hopper.step6", "10_backward_hopper.step7",
               "10_backward_hopper"), DEFAULT_MODE)]


@pytest.mark.parametrize("log, header, builds, modes", TABLES_10, ids=[t[0] for t in TABLES_10])
def test_10s_tables_are_their_logs(repo, log, header, builds, modes):
    """A table of 10's README: each build in each mode its run timed, and the last's time over 09's, one call,
    as its log has them."""
    times = {key: ms for key, ms in first_run_10(repo, log).items() if key[0] in builds and key[1] in modes}
    table = markdown_rows((repo.root / "10_backward_hopper/README.md").read_text(), header)
    assert table and len(table) * len(modes) * len(builds) == len(times), (
        f"{len(table)} rows in the table, {len(times)} timings in the log")
    for d, mask, *cells in table:
        ms = {(b, det): times[(b, det, int(d), mask == "causal")] for b in builds for det in modes}
        want = [f"{ms[(b, False)]:.2f}" for b in builds] + [
            f"{ms[(builds[-1], False)] / ms[('09_backward', False)]:.2f}x"]
        if True in modes:
            want += [f"{ms[(b, True)]:.2f}" for b in builds]
        assert cells == want, f"D={d} {mask}: the table has {cells}, the log {want}"


def test_08_4s_d64_finding_is_the_h100_bench(repo):
    """08's README on 08.4 against 08.3 at D = 64, N = 4096 (B = 4, H = 32), and on 08.5 against 08.4 at N = 1024:
    the H100 bench's ms, as it quotes them."""
    ms = h100_bench_ms(repo)
    text = " ".join((repo.root / "08_fp8/README.md").read_text().split())
    phrase = (f"{ms[('08.4', 64, 4096, False)]:.3f} ms against {ms[('08.3', 64, 4096, False)]:.3f} without the mask, "
              f"and level with it under the mask ({ms[('08.4', 64, 4096, True)]:.3f} against "
              f"{ms[('08.3', 64, 4096, True)]:.3f})")
    assert phrase in text, f"08_fp8/README.md: expected {phrase!r} (the H100 bench)"
    short = (f"{ms[('08.5', 128, 1024, False)]:.3f} ms against 08.4's {ms[('08.4', 128, 1024, False)]:.3f} without the mask "
             f"and {ms[('08.5', 128, 1024, True)]:.3f} against {ms[('08.4', 128, 1024, True)]:.3f} with it, and "
             f"{ms[('08.5', 64, 1024, True)]:.3f} against {ms[('08.4', 64, 1024, True)]:.3f} at D = 64 with the mask")
    assert short in text, f"08_fp8/README.md: expected {short!r} (the H100 bench)"
    last = f"{ms[('08_fp8', 128, 1024, True)]:.3f} ms against 08.5's {ms[('08.5', 128, 1024, True)]:.3f}"
    assert last in text, f"08_fp8/README.md: expected {last!r} (the H100 bench)"


def test_09s_h100_claims_are_the_bench(repo):
    """The top README's and 09's words on 09 against FlashAttention-2 on an H100: ranges of the H100 bench's rows
    (N = 1k and 4k, D 64 and 128, both masks; and N = 4096 alone), each as the prose has it."""
    ms = h100_bench_ms(repo, backward=True)
    shapes = [(d, n, c) for d in (128, 64) for n in (1024, 4096) for c in (False, True)]

    def span(top, bottom, ns=(1024, 4096)):  # top's time over bottom's, low-high
        values = [ms[(top, *s)] / ms[(bottom, *s)] for s in shapes if s[1] in ns]
        return f"{min(values):.2f}-{max(values):.2f}x"
    fa2, ours, first, det = "torch_flash", "09_backward", "09.1", "09_backward.deterministic"
    readme = " ".join((repo.root / "README.md").read_text().split())
    for phrase in (f"the plain first step is at {span(fa2, first)} FlashAttention-2's speed and the chapter at "
                   f"{span(fa2, ours)}", f"{span(det, ours)} on the H100 ({span(fa2, det)} FlashAttention-2's speed"):
        assert phrase in readme, f"README.md: expected {phrase!r} (the H100 bench)"
    chapter = " ".join((repo.root / "09_backward/README.md").read_text().split())
    for phrase in (f"{span(fa2, ours)} on an H100, where the plain first step runs at {span(fa2, first)}",
                   f"the chapter is at {span(fa2, ours, (4096,))} FlashAttention-2's speed at N = 4096 on an H100 "
                   f"(D = 64 there at H = 32) and 09.1 at {span(fa2, first, (4096,))}"):
        assert phrase in chapter, f"09_backward/README.md: expected {phrase!r} (the H100 bench)"


def test_10_9s_table_is_its_log(repo):
    """10.9's table: 09, 10.8 and 10.9 (the log's grid8) at each shape and mask, and 10.9's time over 09's,
    one call, as run_10_9_h100.log has them."""
    text = (repo.root / "docs/results/logs/10/run_10_9_h100.log").read_text()
    # "B4 H16 N4096 D128 none|--causal", then 09, 10.5, grid5, 10.8, grid8, stagger8
    ours = {(int(b), int(h), int(n), int(d), mask == "--causal"): [float(t) for t in times.split()]
            for b, h, n, d, mask, times in re.findall(r"^B(\d+) H(\d+) N(\d+) D(\d+) (none|--causal) ([\d. ]+)$", text, re.M)}
    table = markdown_rows((repo.root / "10_backward_hopper/README.md").read_text(),
                          "| B | H | N | D | mask | 09 | 10.8 | 10.9 | 10.9 / 09 |")
    assert table and len(table) == len(ours), f"{len(table)} rows, {len(ours)} in the log"
    for b, h, n, d, mask, *cells in table:
        key = (int(b), int(h), int(n), int(d), mask == "causal")
        t09, _, _, t108, t109, _ = ours[key]
        want = [f"{t09:.2f}", f"{t108:.2f}", f"{t109:.2f}", f"{t109 / t09:.2f}x"]
        assert cells == want, f"{key}: the table has {cells}, the log {want}"


def two_builds_ms(repo, log):
    """A first run's timing lines of two builds in 10's logs ("D128 none default <before ms> <after ms>"):
    {(D, causal, deterministic): (before, after)}."""
    text = (repo.root / "docs/results/logs/10" / log).read_text()
    return {(int(d), mask == "--causal", mode == "--deterministic"): (float(a), float(b)) for d, mask, mode, a, b in
            re.findall(r"^D(\d+) (none|--causal) (default|--deterministic) ([\d.]+) ([\d.]+)$", text, re.M)}


def test_10_10s_table_is_its_log(repo):
    """10.10's table: 10.9 and 10.10 in each mode and 10.9's time over 10.10's, one call, as
    first_run_10_10_h100.log has them ("D128 none default <10.9 ms> <10.10 ms>")."""
    ms = two_builds_ms(repo, "first_run_10_10_h100.log")
    table = markdown_rows((repo.root / "10_backward_hopper/README.md").read_text(), "| D | mask | 10.9 | 10.10 |")
    assert table and len(table) * 2 == len(ms), f"{len(table)} rows, {len(ms)} timings in the log"
    for d, mask, *cells in table:
        (a, b), (det_a, det_b) = (ms[(int(d), mask == "causal", det)] for det in (False, True))
        want = [f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}x", f"{det_a:.2f}", f"{det_b:.2f}"]
        assert cells == want, f"D={d} {mask}: the table has {cells}, the log {want}"


def test_10_11s_table_is_its_log(repo):
    """10.11's table: 10.10 and 10.11 in each mode, 10.10's deterministic time over 10.11's and 10.11's
    deterministic time over its default's, one call, as first_run_10_11_h100.log has them."""
    ms = two_builds_ms(repo, "first_run_10_11_h100.log")
    table = markdown_rows((repo.root / "10_backward_hopper/README.md").read_text(), "| D | mask | 10.10 | 10.11 |")
    assert table and len(table) * 2 == len(ms), f"{len(table)} rows, {len(ms)} timings in the log"
    for d, mask, *cells in table:
        (a, b), (det_a, det_b) = (ms[(int(d), mask == "causal", det)] for det in (False, True))
        want = [f"{a:.2f}", f"{b:.2f}", f"{det_a:.2f}", f"{det_b:.2f}", f"{det_a / det_b:.2f}x", f"{det_b / b:.2f}x"]
        assert cells == want, f"D={d} {mask}: the table has {cells}, the log {want}"


def test_10s_steps_table_is_the_h100_bench(repo):
    """10's table of every step, 09, and SDPA's FA2 and cuDNN backward (torch.autograd.grad) at each bench shape:
    each cell the ms of NVIDIA_H100_80GB_HBM3.backward.csv's row, every row of a D from one run."""
    ms = h100_bench_ms(repo, backward=True)
    impls = ["torch_flash", "torch_cudnn", "09_backward"] + [f"10.{i}" for i in range(1, 10)] + ["10_backward_hopper"]
    table = markdown_rows((repo.root / "10_backward_hopper/README.md").read_text(), "| D | N | mask | FA2 | cuDNN | 09 |")
    assert len(table) == 8, f"{len(table)} rows: expected D 64 and 128, N 1024 and 4096, both masks"
    for d, n, mask, *cells in table:
        want = [f"{ms[(impl, int(d), int(n), mask == 'causal')]:.3f}" for impl in impls]
        assert cells == want, f"D={d} N={n} {mask}: the table has {cells}, the CSV {want}"


# 11's README tables, each its first run's log: (log, the table's header, the step beside the chapter).
TABLES_11 = [("first_run_h100.log", "| B | KV heads | cache | 11.1 |", "build/11_decode.step1"),
             ("first_run_11_3_h100.log", "| B | KV heads | cache | 11.2 | 11.3 |", "build/11_decode.step2")]


@pytest.mark.parametrize("log, header, step", TABLES_11, ids=[t[0] for t in TABLES_11])
def test_11s_tables_are_their_logs(repo, log, header, step):
    """A table of 11's README: the step before, the chapter (ms and GB/s), SDPA's flash and cuDNN backends at
    each shape, and the chapter's time over cuDNN's, one call, as its log has them."""
    builds = (step, "build/11_decode", "sdpa_flash", "sdpa_cudnn")
    timed = {}
    for line in (repo.root / "docs/results/logs/11" / log).read_text().splitlines():
        words = line.split()
        if len(words) == 5 and words[0] in builds:
            ms, gbps = map(float, words[4].split(","))
            timed[(words[0], int(words[1][1:]), int(words[2][3:]), int(words[3][1:]))] = (ms, gbps)
    table = markdown_rows((repo.root / "11_decode/README.md").read_text(), header)
    assert table and len(table) * 4 == len(timed), f"{len(table)} rows in the table, {len(timed)} timings in the log"
    for b, kv, cache, *cells in table:
        got = {who: timed[(who, int(b), int(kv), int(cache))] for who in builds}
        want = [f"{got[step][0]:.3f}", f"{got['build/11_decode'][0]:.3f}", f"{got['build/11_decode'][1]:.0f}",
                f"{got['sdpa_flash'][0]:.3f}", f"{got['sdpa_cudnn'][0]:.3f}",
                f"{got['build/11_decode'][0] / got['sdpa_cudnn'][0]:.2f}x"]
        assert cells == want, f"B={b} Hkv={kv} L={cache}: the table has {cells}, the log {want}"


def decode_checks(repo, log, impl):
    """A first run's check rows of one implementation (11_decode, 11_decode.e4m3), split at the commas."""
    return [line.split(",") for line in (repo.root / "docs/results/logs/11" / log).read_text().splitlines()
            if line.split(",")[0] == impl]


@pytest.mark.parametrize("log, impl, count", [("first_run_11_3_h100.log", "11_decode", 12),
                                              ("first_run_11_4_h100.log", "11_decode", 18),
                                              ("first_run_11_4_h100.log", "11_decode.e4m3", 12)])
def test_11s_checks_passed_in_their_logs(repo, log, impl, count):
    """A first run's checks, each PASS, as many as the README's status counts."""
    checks = decode_checks(repo, log, impl)
    assert len(checks) == count and all(row[11] == "PASS" for row in checks), f"{impl}'s checks in {log}: {checks}"


def test_11_4s_table_is_its_log(repo):
    """11.4's table: 11.3, 11.4 (ms, GB/s), their ratio, and 11.4 built with MIN_WAVES 1 and 4, as its log has them."""
    timed = {}
    for line in (repo.root / "docs/results/logs/11/first_run_11_4_h100.log").read_text().splitlines():
        words = line.split()
        if len(words) == 5 and words[0].startswith("build/"):
            timed[(words[0], int(words[1][1:]), int(words[2][3:]), int(words[3][1:]))] = tuple(
                map(float, words[4].split(",")))
    table = markdown_rows((repo.root / "11_decode/README.md").read_text(), "| B | KV heads | cache | 11.3 | 11.4 |")
    assert len(table) == 5, table
    for b, kv, cache, *cells in table:
        step3, step4, waves1, waves4 = (timed[(who, int(b), int(kv), int(cache))] for who in (
            "build/11_decode.step3", "build/11_decode.step4", "build/waves1", "build/waves4"))
        want = [f"{step3[0]:.3f}", f"{step4[0]:.3f}", f"{step4[1]:.0f}", f"{step4[0] / step3[0]:.2f}x",
                f"{waves1[0]:.3f}", f"{waves4[0]:.3f}"]
        assert cells == want, f"B={b} Hkv={kv} L={cache}: the table has {cells}, the log {want}"


def test_11_5s_table_is_its_log(repo):
    """11.5's table: the fp16 and e4m3 caches' check rows at the same shape, as its log has them."""
    log = "first_run_11_4_h100.log"
    rows = {(r[1], r[2], r[3], r[5], r[7]): r for r in decode_checks(repo, log, "11_decode")}
    table = markdown_rows((repo.root / "11_decode/README.md").read_text(), "| B | cache | D | fp16 ms | e4m3 ms |")
    assert len(table) == 4, table
    for b, cache, d, *cells in table:
        e4m3 = next(r for r in decode_checks(repo, log, "11_decode.e4m3") if (r[1], r[5], r[7]) == (b, cache, d))
        fp16 = rows[(b, e4m3[2], e4m3[3], cache, d)]
        want = [fp16[8], e4m3[8], f"{float(e4m3[8]) / float(fp16[8]):.2f}x", f"{float(fp16[9]):.0f}",
                f"{float(e4m3[9]):.0f}", f"{float(e4m3[-1]):.4f}"]
        assert cells == want, f"B={b} L={cache} D={d}: the table has {cells}, the log {want}"


def decode_call(repo, log, builds):
    """A decode call's log in docs/results/logs/11: {(B, KV heads, cache): [ms, GB/s of each build]} and
    {(backend, B, KV heads, cache): SDPA's ms}."""
    text = (repo.root / "docs/results/logs/11" / log).read_text()
    ours = {(int(b), int(h), int(n)): [float(x) for x in rest.replace(",", " ").split()] for b, h, n, rest in
            re.findall(r"^b(\d+) hkv(\d+) L(\d+) ((?:[\d.]+,[\d.]+ ?){%d})$" % builds, text, re.M)}
    sdpa = {(who, int(b), int(h), int(n)): float(t) for who, b, h, n, t in
            re.findall(r"^sdpa_(flash|cudnn) b(\d+) hkv(\d+) L(\d+) ([\d.]+),", text, re.M)}
    return ours, sdpa


def h100_copy_gbps(repo):
    """The H100's device-to-device copy in GB/s, as its `make peaks` log has it."""
    peaks = (repo.root / "docs/results/logs/common/peaks_NVIDIA_H100_80GB_HBM3.log").read_text()
    return float(re.search(r"device-to-device copy \S+\s+([\d.]+) TB/s", peaks).group(1)) * 1000


@pytest.mark.parametrize("log, header, builds, copy_share", [
    ("run_11_6_h100.log", "| B | KV heads | cache | 11.5 | 11.6 |", 2, False),
    ("first_run_11_10_h100.log", "| B | KV heads | cache | 11.6 | 11.7 | 11.8 | 11.9 | 11.10 |", 5, False),
    ("first_run_11_11_h100.log", "| B | KV heads | cache | 11.10 | 11.10 without pages ahead | 11.11 |", 3, True)])
def test_11s_one_call_tables_are_their_logs(repo, log, header, builds, copy_share):
    """The tables of 11.5-11.6, of 11.7-11.10 and of 11.11: each build's ms, the last one's GB/s (11.11's: and
    its share of the H100's copy, as its peaks log has it), SDPA's flash and cuDNN backends at each shape, and
    the last build's time over cuDNN's, one call, as the log has them (its rows: the builds in the table's
    order, each as ms,GB/s)."""
    copy_gbps = h100_copy_gbps(repo)
    ours, sdpa = decode_call(repo, log, builds)
    table = markdown_rows((repo.root / "11_decode/README.md").read_text(), header)
    assert table and len(table) == len(ours) == len(sdpa) // 2, f"{len(table)} rows, {len(ours)} in the log"
    for b, kv, cache, *cells in table:
        key = (int(b), int(kv), int(cache))
        ms, last_gbps = ours[key][0::2], ours[key][-1]
        cudnn = sdpa[("cudnn", *key)]
        share = [f"{last_gbps / copy_gbps * 100:.0f}%"] if copy_share else []
        want = [f"{t:.3f}" for t in ms] + [f"{last_gbps:.0f}"] + share + [f"{sdpa[('flash', *key)]:.3f}",
                                                                        f"{cudnn:.3f}", f"{ms[-1] / cudnn:.2f}x"]
        assert cells == want, f"B={b} Hkv={kv} L={cache}: the table has {cells}, the log {want}"


def test_decode_overhead_table_is_its_log(repo):
    """docs/pytorch.md's per-call costs: each cell is the log's line, in the table's column order."""
    lines = (repo.root / "docs/results/logs/11/decode_overhead_h100.txt").read_text().splitlines()
    measured = dict(line.strip().rsplit(None, 1) for line in lines if line.startswith("  "))
    names = ["sdpa flash", "sdpa cudnn", "sdpa efficient", "op", "impl", "checks only", "raw", "plan run",
             "plan append+run", "write paged", "write slice"]
    table = markdown_rows((repo.root / "docs/pytorch.md").read_text(), "| SDPA flash | cuDNN | efficient |")
    assert table == [[measured[name] for name in names]], f"the table {table}, the log {measured}"


def test_generate_rates_are_their_log(repo):
    """docs/pytorch.md's make generate rates: each run's tokens/s as generate_rates_h100.log has it. The
    prose names every run's rate of 11, the fastest SDPA backend's, the range of the backends, or their
    ratio; each such number (3-digit rates, ranges, and "N.NNx the fastest") must be the log's."""
    runs = [dict(re.findall(r"(11_decode|SDPA(?: \w+)?) (\d+) \(first pass", line))
            for line in (repo.root / "docs/results/logs/11/generate_rates_h100.log").read_text().splitlines()
            if line.startswith("decoding, tokens/s:")]
    assert len(runs) >= 6 and all(len(run) == 5 for run in runs), f"the log's runs: {runs}"
    text = " ".join((repo.root / "docs/pytorch.md").read_text().split())
    prose = text[text.index("In a call of two runs one after the other"):text.index("## Exercises")]
    rates = {int(r) for run in runs for r in run.values()}
    quoted = {int(n) for n in re.findall(r"(?<![\d.])(\d{3})(?![\d.]| us| MB| tokens,| new| cached)", prose)}
    assert quoted and quoted <= rates | {200, 225, 512}, f"rates in docs/pytorch.md not in the log: {quoted - rates}"
    fastest = [int(run["11_decode"]) / max(int(r) for k, r in run.items() if k != "11_decode") for run in runs]
    for ratio in re.findall(r"(\d\.\d\d)x the fastest", prose):
        assert any(f"{f:.2f}" == ratio for f in fastest), f"{ratio}x the fastest: the log's runs give {fastest}"
    for low, high in re.findall(r"(\d{3})-(\d{3})", prose):
        assert any(sorted(int(r) for k, r in run.items() if k != "11_decode")[::3] == [int(low), int(high)]
                   for run in runs), f"SDPA's {low}-{high}: no run of the log has that range"


def test_10s_errors_table_is_its_log(repo):
    """10's errors beside PyTorch's: each row is errors_vs_pytorch_h100.log's row of 10 (its default mode and its
    deterministic mode, which the table says are the same), PyTorch's and their ratios."""
    rows = {}
    for line in (repo.root / "docs/results/logs/10/errors_vs_pytorch_h100.log").read_text().splitlines():
        m = re.fullmatch(r"(\d+) (\d+) (\d+) (\d+) (none|causal) 10_backward_hopper (default|deterministic) "
                         r"\| ([^|]+) \| ([^|]+) \| ([^|]+)", line)
        if m:
            rows[(*m.groups()[:5], m[6])] = [", ".join(cell.split()) for cell in m.groups()[6:]]
    table = markdown_rows((repo.root / "10_backward_hopper/README.md").read_text(), "| B | H | N | D | mask | 10 (")
    assert table and len(table) * 2 == len(rows), f"{len(table)} rows, {len(rows)} in the log"
    for b, h, n, d, mask, *cells in table:
        key = (b, h, n, d, "none" if mask == "non-causal" else "causal")
        assert cells == rows[(*key, "default")] == rows[(*key, "deterministic")], f"{key}: {cells}, the log {rows}"
        assert all(float(r) <= 2.0 for r in cells[2].split(", ")), f"{key}: a ratio over FlashAttention's 2"


def ncu_metric(text, name):
    """A metric's value in an Nsight Compute report (its last column, thousands' commas dropped)."""
    return float(re.search(rf"^\s+{re.escape(name)}\s+\S+\s+([\d,.]+)\s*$", text, re.M).group(1).replace(",", ""))


def test_11_11s_prose_is_its_logs(repo):
    """The numbers of 11.11's section and of the chapter's status that its table does not hold, each computed
    from first_run_11_11_h100.log, the two Nsight Compute reports and the H100's peaks log."""
    logs = repo.root / "docs/results/logs"
    runs, sdpa = decode_call(repo, "first_run_11_11_h100.log", 3)
    cudnn = {key[1:]: ms for key, ms in sdpa.items() if key[0] == "cudnn"}
    text = (logs / "11/first_run_11_11_h100.log").read_text()
    e4m3 = [float(x) for x in re.search(r"^e4m3 b64 L4096: ([\d.]+),[\d.]+ ([\d.]+),", text, re.M).groups()]
    copy = h100_copy_gbps(repo) / 1000
    ncu11, ncu10 = ((logs / f"11/ncu_11_{n}_split_h100.txt").read_text() for n in (11, 10))
    readme = (repo.root / "11_decode/README.md").read_text()
    start = readme.index("\n## 11.11 ")
    section = " ".join(readme[start:readme.index("\n## ", start + 1)].split())
    status = " ".join(readme[:readme.index("\n## ")].split())

    def span(values, fmt):
        return f"{fmt.format(min(values))}-{fmt.format(max(values))}"
    speedup = [r[0] / r[4] for r in runs.values()]
    over_cudnn = [runs[k][4] / cudnn[k] for k in runs]
    gbps = [r[5] for r in runs.values()]
    b1 = runs[(1, 8, 32768)]
    elsewhere = max(abs(r[2] / r[0] - 1) for k, r in runs.items() if k != (1, 8, 32768))
    fp16_b64 = runs[(64, 8, 4096)]
    wanted_section = [
        f"{span(speedup, '{:.2f}')}x faster than 11.10", f"{span(over_cudnn, '{:.2f}')}x cuDNN's time",
        f"{e4m3[0]:.3f} ms with it ({e4m3[0] / fp16_b64[0]:.2f}x", f"takes {e4m3[1]:.3f} ({e4m3[1] / fp16_b64[4]:.2f}x)",
        f"({(b1[2] / b1[0] - 1) * 100:.1f}% slower at b = 1 and 32k, within {math.ceil(elsewhere * 1000) / 10:.1f}% elsewhere)",
        f"{ncu_metric(ncu11, 'Duration'):.1f} us where 11.10's took {ncu_metric(ncu10, 'Duration'):.1f}",
        f"DRAM at {ncu_metric(ncu11, 'DRAM Throughput'):.0f}% of its peak ({ncu_metric(ncu10, 'DRAM Throughput'):.0f}%)",
        f"the SMs {ncu_metric(ncu11, 'Compute (SM) Throughput'):.0f}% busy",
        f"active for {ncu_metric(ncu11, 'SM Active Cycles') / ncu_metric(ncu11, 'Elapsed Cycles') * 100:.0f}%",
        f"of the {ncu_metric(ncu11, 'Warp Cycles Per Issued Instruction'):.2f} cycles",
        f"reads at {gbps[0] / copy / 10:.0f}% of this H100's {copy:.2f} TB/s copy"]
    for want in wanted_section:
        assert want in section, f"11.11's section should say {want!r} (its logs)"
    stalled = re.search(r"spends ([\d.]+) cycles being stalled", ncu11).group(1)
    assert f"waits on memory for {stalled} " in section, f"the stall cycles are not the report's {stalled}"
    wanted_status = [f"at {min(gbps) / 1000:.1f}-{max(gbps) / 1000:.1f} TB/s",
                     f"{min(gbps) / copy / 10:.0f}-{max(gbps) / copy / 10:.0f}% of its device-to-device copy",
                     f"takes {span(over_cudnn, '{:.2f}')}x the time of SDPA's cuDNN backend",
                     f"take {span([(1 - 1 / x) * 100 for x in speedup], '{:.0f}')}% off ({(1 - e4m3[1] / e4m3[0]) * 100:.0f}% "
                     "with an e4m3 cache)"]
    for want in wanted_status:
        assert want in status, f"11's status should say {want!r} (first_run_11_11_h100.log)"
    course = " ".join((repo.root / "docs/README.md").read_text().split())
    share = f"{min(gbps) / copy / 10:.0f}-{max(gbps) / copy / 10:.0f}% of the copy's bandwidth"
    assert f"{share} and takes {span(over_cudnn, '{:.2f}')}x cuDNN's time" in course, f"docs/README.md: {share}"
    top = " ".join((repo.root / "README.md").read_text().split())
    assert f"up to {max(gbps) / copy / 10:.0f}% of the H100's copy bandwidth" in top, "README.md: 11's best share"
