"""The test runner's own promises: tests on parallel threads each capture only what they print,
and a module that swaps the process's sys.stdout runs in a process of its own."""
import re
import threading

LINES = 200  # per thread, printed in lock-step so that the writes interleave


def test_captured_stdout_is_per_thread(ctx):
    start = threading.Barrier(3)
    captured = {}

    def printer(name):
        with ctx.captured_stdout() as out:
            start.wait()
            for i in range(LINES):
                print(f"{name} {i}")
        captured[name] = out.getvalue().splitlines()

    threads = [threading.Thread(target=printer, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    with ctx.captured_stdout() as main:
        start.wait()
        for i in range(LINES):
            print(f"main {i}")
    for thread in threads:
        thread.join()
    captured["main"] = main.getvalue().splitlines()
    for name, lines in captured.items():
        assert lines == [f"{name} {i}" for i in range(LINES)], (
            f"thread {name} captured {len(lines)} lines, e.g. {lines[:3]}; expected its own {LINES}")
    return f"3 threads, {LINES} lines each, each captured only its own"


def test_stdout_swaps_only_in_isolated_modules(ctx):
    swaps = re.compile(r"redirect_std(out|err)\(|\bsys\.std(out|err)\s*=(?!=)")
    offenders = []
    for path in sorted((ctx.root / "tests").glob("test_*.py")):
        text = path.read_text()
        if swaps.search(text) and not re.search(r"^ISOLATED = True", text, re.M):
            offenders.append(f"{path.name}: {swaps.search(text).group(0)}")
    assert not offenders, ("these modules swap sys.stdout but run on threads beside the others (capture with "
                           "ctx.captured_stdout(), or set ISOLATED = True): " + "; ".join(offenders))
    return "every swap of sys.stdout is in an ISOLATED module"
