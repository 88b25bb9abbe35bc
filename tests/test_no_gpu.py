"""No GPU: a valid run is skipped, exit 77, with one line on stdout that says why (docs/design.md).

CUDA_VISIBLE_DEVICES= hides every GPU, so those cases hold on a GPU machine too; on a machine
without a usable GPU the plain environment is checked as well.
"""
import numpy as np
import pytest

from helpers import CHAPTERS

RUNS = {  # label -> arguments of a valid run (IN, OUT: an input folder and an output folder)
    "small": ["--batch", "1", "--heads", "1", "--seqlen", "16", "--headdim", "64", "--warmup", "0", "--iters", "1"],
    "causal csv": ["--batch", "2", "--heads", "3", "--seqlen", "100", "--headdim", "128", "--causal", "--csv"],
    "defaults": [],
    "input output": ["--input", "IN", "--output", "OUT", "--no-check"],
}


def assert_skipped(repo, tmp, chapter, label, hide_gpus):
    """The run RUNS[label] exits 77 with one line on stdout that says it skipped for want of a GPU,
    nothing on stderr, and no --output folder made."""
    binary = repo.require_binary(chapter)
    folder = tmp / "in"
    folder.mkdir()
    for name in "qkv":
        np.save(folder / f"{name}.npy", np.ones((1, 2, 20, 64), np.float16))
    args = [str(folder) if a == "IN" else str(tmp / "out") if a == "OUT" else a for a in RUNS[label]]
    env = {"FA_CACHE": tmp / "cache"}
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = repo.run([binary, *args], env=env, timeout=120)
    shown = f"{'CUDA_VISIBLE_DEVICES= ' if hide_gpus else ''}{chapter} {' '.join(args)}"
    assert proc.returncode == 77, (
        f"{shown}: expected exit 77 (skipped: no GPU), got {proc.returncode}; "
        f"stdout {proc.stdout.strip()!r} stderr {proc.stderr.strip()!r}")
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"{shown}: expected one line on stdout, got {proc.stdout!r}"
    assert not proc.stderr.strip(), f"{shown}: expected nothing on stderr, got {proc.stderr.strip()!r}"
    line = lines[0].lower()
    assert "gpu" in line and "skip" in line, f"{shown}: the line should say it skipped for want of a GPU: {lines[0]!r}"
    assert not (tmp / "out").exists(), f"{shown}: skipped, yet created the --output folder"


@pytest.mark.parametrize("label", RUNS)
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_gpus_hidden_a_valid_run_exits_77(repo, tmp_path, chapter, label):
    assert_skipped(repo, tmp_path, chapter, label, hide_gpus=True)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_gpu_here_a_valid_run_exits_77(repo, tmp_path, gpu_state, chapter):
    """The plain environment, where this machine has no usable GPU."""
    if gpu_state[0]:
        pytest.skip("a GPU is present: the plain-environment no-GPU cases apply only without one")
    assert_skipped(repo, tmp_path, chapter, "small", hide_gpus=False)
