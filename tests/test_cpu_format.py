"""The C and CUDA sources are formatted as .clang-format says (clang-format --dry-run --Werror).
Skipped with a note where clang-format is missing, or is another major version than the one
.clang-format names: versions differ in how they format some constructs."""
import re
import shutil
import unittest

SOURCES = ["[0-9][0-9]_*/attention.cu", "common/*.cu", "common/*.c", "common/*.h", "tests/*.c", "tests/fixtures/*.cu",
           "tools/*.cu"]


def test_sources_are_formatted(ctx):
    tool = shutil.which("clang-format")
    if not tool:
        raise unittest.SkipTest("clang-format not installed: formatting not checked")
    wanted = re.search(r"clang-format (\d+)", (ctx.root / ".clang-format").read_text())
    version = re.search(r"version (\d+)", ctx.run([tool, "--version"]).stdout)
    if not wanted or not version or wanted.group(1) != version.group(1):
        raise unittest.SkipTest(f"clang-format {version.group(1) if version else '?'} installed, the sources are "
                                f"formatted with {wanted.group(1) if wanted else '?'}: formatting not checked")
    files = sorted(str(p.relative_to(ctx.root)) for pattern in SOURCES for p in ctx.root.glob(pattern))
    assert files, "no sources found"
    proc = ctx.run([tool, "--dry-run", "--Werror", *files])
    unformatted = sorted(set(re.findall(r"^([^\s:]+):\d+:\d+: (?:error|warning)", proc.stderr, re.M)))
    assert proc.returncode == 0, (f"{len(unformatted)} files differ from .clang-format: {unformatted}; "
                                  f"run clang-format -i on them")
    return f"{len(files)} files formatted"
