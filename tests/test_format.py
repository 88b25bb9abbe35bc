"""The C and CUDA sources are formatted as .clang-format says (clang-format --dry-run --Werror).
Skipped with a note where clang-format is missing, or is another major version than the one
.clang-format names: versions differ in how they format some constructs."""
import re
import shutil

import pytest

SOURCES = ["[0-9][0-9]_*/*.cu", "[0-9][0-9]_*/*.h", "common/*.cu", "common/*.c", "common/*.h", "tests/*.c", "tests/fixtures/*.cu",
           "tests/fixtures/*.c", "tools/*.cu"]


def test_sources_are_formatted(repo):
    tool = shutil.which("clang-format")
    if not tool:
        pytest.skip("clang-format not installed: formatting not checked")
    wanted = re.search(r"clang-format (\d+)", (repo.root / ".clang-format").read_text())
    version = re.search(r"version (\d+)", repo.run([tool, "--version"]).stdout)
    if not wanted or not version or wanted.group(1) != version.group(1):
        pytest.skip(f"clang-format {version.group(1) if version else '?'} installed, the sources are "
                    f"formatted with {wanted.group(1) if wanted else '?'}: formatting not checked")
    files = sorted(str(p.relative_to(repo.root)) for pattern in SOURCES for p in repo.root.glob(pattern))
    assert files, "no sources found"
    proc = repo.run([tool, "--dry-run", "--Werror", *files])
    unformatted = sorted(set(re.findall(r"^([^\s:]+):\d+:\d+: (?:error|warning)", proc.stderr, re.M)))
    assert proc.returncode == 0, (f"{len(unformatted)} files differ from .clang-format: {unformatted}; "
                                  f"run clang-format -i on them")
