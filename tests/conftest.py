"""What every test gets. `make test` builds first (make all lib: the native build, or sm_80, sm_89
and sm_90 where there is no GPU), then runs pytest here on every core (pytest-xdist).

Fixtures:
  repo    common/runner.py's Repo: the checkout, its build folder ($FA_BUILD, default build/), commands
          run in it (repo.run), temporary folders, values computed once per worker (repo.once)
  torch   PyTorch with a CUDA device, or the test is skipped saying which is missing
  gpu_state  (usable, why): whether the build finds a GPU it can run on

Markers (pytest.ini):
  gpu       the test runs chapter binaries on a GPU: skipped, with the reason the harness gives
            (one summary line per file), where the build finds no GPU it can use
  sanitize  a compute-sanitizer run: only `make sanitize` (pytest -m sanitize) runs these

Tests that share inputs made once (one shape's references in the cache) carry
`pytest.mark.xdist_group(name)`: pytest.ini's --dist loadgroup runs each group on one worker.
The groups in SENT_FIRST are the suite's longest chains of work: they go to the workers before
the rest (xdist's own order is the most tests first), so that the suite is not left waiting on
them at its end.
"""
import collections
import functools
import os
import sys
from pathlib import Path

import pytest

try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:  # pytest alone: one process, no scheduler
    LoadGroupScheduling = object

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "common"), str(ROOT / "tests")]

import runner  # noqa: E402  (common/runner.py)
from helpers import CHAPTERS  # noqa: E402


BUILD = os.environ.get("FA_BUILD") or "build"  # the binaries' folder: make's BUILD (make test sets FA_BUILD)
# The xdist groups that take longest, longest first: the timed exercises (one after the other on one
# worker), make grade in copies of the checkout (test_exercises_gpu.py), the deterministic backward on
# many heads (test_gpu.py: their float64 references take half a minute each).
SENT_FIRST = ("exercise_timing", "make_grade_solution", "make_grade_wrong", "many_heads_d128", "many_heads_d64")


class LongestFirst(LoadGroupScheduling):
    """--dist loadgroup with the groups of SENT_FIRST handed out before any other."""

    def _assign_work_unit(self, node):
        for group in reversed(SENT_FIRST):
            if group in self.workqueue:
                self.workqueue.move_to_end(group, last=False)
        super()._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return LongestFirst(config, log)
    return None


@pytest.fixture(scope="session")
def repo():
    checkout = runner.Repo(ROOT, BUILD)
    yield checkout
    checkout.close()


@functools.cache
def probe_gpu(build):
    """(usable, why), from the first chapter's binary (the least demanding one) in the build folder."""
    return runner.gpu_probe(str(Path(ROOT, build, CHAPTERS[0])))


@pytest.fixture(scope="session")
def gpu_state():
    """(usable, why): whether the build finds a GPU it can run on, and the harness's words."""
    return probe_gpu(BUILD)


def pytest_terminal_summary(terminalreporter):
    """Each reason a test was skipped for, once, with how many it skipped (pytest's own -rs says it
    once per test function)."""
    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        if isinstance(report.longrepr, tuple):
            reasons[report.longrepr[2].removeprefix("Skipped: ")] += 1
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"SKIPPED ({count}): {reason}")


def pytest_collection_modifyitems(config, items):
    """Without a usable GPU, the tests marked gpu are skipped, each file's in one summary line."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    usable, why = probe_gpu(BUILD) if marked else (True, "")
    if not usable:
        skip = pytest.mark.skip(reason=f"no usable GPU: {why}")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def torch():
    # inductor compiles in a pool of worker processes that can keep a pytest worker from exiting: compile in-process
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    try:
        import torch
    except ImportError:
        pytest.skip("PyTorch is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
    return torch

