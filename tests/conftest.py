"""What every test gets. `make test` builds first (make all lib: the native build, or sm_80, sm_89
and sm_90 where there is no GPU), then runs pytest here on every core (pytest-xdist).

Fixtures:
  repo    common/runner.py's Repo: the checkout, its build folder (--build, default build/), commands
          run in it (repo.run), temporary folders, values computed once per worker (repo.once)
  torch   PyTorch with a CUDA device, or the test is skipped saying which is missing

Markers (pytest.ini):
  gpu       the test runs chapter binaries on a GPU: skipped, with the reason the harness gives
            (one line in the summary for them all), where the build finds no GPU it can use
  sanitize  a compute-sanitizer run: only `make sanitize` (pytest -m sanitize) runs these

Tests that share inputs made once (one shape's references in the cache) carry
`pytest.mark.xdist_group(name)`: pytest.ini's --dist loadgroup runs each group on one worker.
"""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "common"), str(ROOT / "tests")]

import runner  # noqa: E402  (common/runner.py)

CHAPTERS = runner.chapters()  # NN_name of every chapter, in order: what the tests parametrize over


def pytest_addoption(parser):
    parser.addoption("--build", default="build", help="the build folder of the binaries (make's BUILD)")


@pytest.fixture(scope="session")
def repo(request):
    checkout = runner.Repo(ROOT, request.config.getoption("--build"))
    yield checkout
    checkout.close()


@pytest.fixture(scope="session")
def gpu_state(repo):
    """(usable, why), from the first chapter's binary (the least demanding one)."""
    return runner.gpu_probe(repo.binary(CHAPTERS[0]))


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_gpu(request):
    if request.node.get_closest_marker("gpu"):
        usable, why = request.getfixturevalue("gpu_state")
        if not usable:
            pytest.skip(f"no usable GPU: {why}")


@pytest.fixture(scope="session")
def torch():
    try:
        import torch
    except ImportError:
        pytest.skip("PyTorch is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
    return torch

