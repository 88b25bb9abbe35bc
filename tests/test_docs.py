"""The documentation stays true to the code it quotes and names.

  quoted code    every code line a chapter README quotes (```c blocks) is in that chapter's attention.cu
                 (whitespace aside; a line with '...' is an elision)
  by name        READMEs point at code by name, never by line number
  citations      nothing cites design sections or issue numbers that a reader does not have
  names          every code name a chapter README writes in backticks exists (in its code, the chapter
                 before, common/, the tests, the Makefile or the results)
  figures        docs/figures/make_figures.py's checks of the code it draws (no matplotlib needed)
  test logs      the README's counts of a GPU `make test` (passed, skipped) and its commit are its log's
"""
import importlib.util
import io
import re
import tokenize

import pytest

from claims import CLAIMS, strip_comments
from helpers import CHAPTERS

CITATION = re.compile(r"DESIGN\s?§|DESIGN\.md|\b[Ii]ssue \d+\b")  # (written so as not to match itself)
LINE_REF = re.compile(r"\b[Ll]ines? \d+\b")


def squeeze(text):
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_quoted_code_is_in_the_chapter(repo, chapter):
    readme = (repo.root / chapter / "README.md").read_text()
    source = squeeze((repo.root / chapter / "attention.cu").read_text())
    missing = []
    for block in re.findall(r"```c\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            code = line.split("//")[0].strip()
            if code and "..." not in line and squeeze(code) not in source:
                missing.append(line.strip())
    assert not missing, f"{chapter}/README.md quotes code that is not in its attention.cu: {missing[:5]}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_readme_points_at_code_by_name(repo, chapter):
    hits = LINE_REF.findall((repo.root / chapter / "README.md").read_text())
    assert not hits, f"{chapter}/README.md points at code by line number ({hits[:3]}): name the symbol"


def test_no_citations_readers_cannot_follow(repo):
    files = [p for pattern in ("*.md", "[0-9][0-9]_*/*.md", "docs/*.md", "[0-9][0-9]_*/*.cu", "common/*",
                               "tests/*.py", "Makefile")
             for p in repo.root.glob(pattern) if p.is_file() and p.name != "test_docs.py"]
    hits = [f"{p.relative_to(repo.root)}: {m.group(0)}" for p in files
            for m in CITATION.finditer(p.read_text(errors="replace"))]
    assert not hits, f"citations of the design document or of issues, which readers do not have: {hits[:8]}"


def test_figure_code_checks(repo):
    """docs/figures/make_figures.py reads the constants and the order of operations it draws from
    the chapters' sources and refuses to draw when they changed: those checks need no matplotlib,
    so they run here, where a figure that no longer matches its chapter shows up at once."""
    spec = importlib.util.spec_from_file_location("make_figures", repo.root / "docs" / "figures" / "make_figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    p = figures.pingpong_source()
    assert p["block_kv"] > 0 and p["stages"] > 0 and p["smem_bytes"] <= 227 * 1024, f"08's constants as drawn: {p}"
    figures.heaviest_first("05_causal")
    h = figures.hopper_backward_constants()
    assert h["block_kv"] == h["consumers"] * h["wg_keys"] and h["smem_kib"] <= 227, f"10's constants as drawn: {h}"
    assert figures.const_expr({}, "(1 && !0 ? 192 : 128)") == 192, "the C expression reader lost && or !"


# Words a chapter README writes in backticks that look like code names but are not names of the
# chapter's code, so test_named_symbols_exist does not look for them there. Keep this short: a name
# that the code lost belongs in the README's fix, not here.
NOT_CODE = {
    # SASS opcodes the READMEs count or rule out (common/claims.py's SASS claims add their own).
    "sass": {"F2FP", "FADD", "FMNMX", "FMUL", "HADD2", "HFMA2", "HMUL2", "MUFU", "PRMT", "SHFL", "VHMNMX"},
    # The exercise markers are comments by design (common/exercise_markers.py reads them).
    "markers": {"EXERCISE"},
    # CUDA and C library names cited for what they compile to, or for what a chapter no longer uses.
    "library": {"exp2f", "INT_MAX", "__shfl_sync"},
    # Nsight Compute's stall reasons (its metric names, `unit__metric`, are told by their "__").
    "nsight": {"math_pipe_throttle", "mio_throttle"},
}


def words(text):
    return set(re.findall(r"\w+", text))


def python_names(text):
    """The names in Python source, and the string literals that are one word (dictionary keys)."""
    names = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME:
            names.add(tok.string)
        elif tok.type == tokenize.STRING and re.fullmatch(r"[rbu]?(['\"])\w+\1", tok.string, re.I):
            names.add(tok.string.strip("rbuRBU")[1:-1])
    return names


def known_names(root):
    """The names any chapter README may use: NOT_CODE, the claims' SASS opcodes, common/'s C and
    Python, the tests' functions and case names, the Makefile's variables, the results' rows."""
    known = set().union(*NOT_CODE.values())
    for claims in CLAIMS.values():
        known |= set(claims.get("sass_has", [])) | set(claims.get("sass_lacks", []))
        known |= {op for ops in claims.get("sass_kernel_has", {}).values() for op in ops}
    for path in sorted((root / "common").iterdir()):
        if path.suffix in (".h", ".c", ".cu"):
            known |= words(strip_comments(path.read_text()))
        elif path.suffix == ".py":
            known |= python_names(path.read_text())
    for path in sorted((root / "tests").glob("*.py")):
        text = path.read_text()
        known |= set(re.findall(r"^def\s+(\w+)", text, re.M)) | set(re.findall(r"""["'](\w+)\[""", text))
    for used, assigned in re.findall(r"\$\((\w+)\)|^(\w+)\s*[?:]?=", (root / "Makefile").read_text(), re.M):
        known.add(used or assigned)
    for path in sorted((root / "docs" / "results").glob("*.csv")):
        known |= {line.split(",")[0] for line in path.read_text().splitlines()[1:]}
    return known


def chapter_words(folder):
    """The names in a chapter's sources: attention.cu, its step files and its headers (comments stripped)."""
    paths = [folder / "attention.cu", *sorted(folder.glob("step[0-9]_*.cu")), *sorted(folder.glob("*.h"))]
    return set().union(*(words(strip_comments(path.read_text())) for path in paths))


def test_named_symbols_exist(repo):
    """Every code name a chapter README writes in backticks (not in its ```c blocks, which
    test_quoted_code_is_in_the_chapter checks) exists: a function named with its `(`, an ALL_CAPS
    macro or constant, a `-DNAME=` switch, a snake_case name. It is looked for in the chapter's
    sources (attention.cu, its step files and headers) and in the one it was copied from (a README
    contrasts the two), comments stripped;
    in common/ (the harness's C, and the names and string keys of its Python); among the tests'
    functions and case names, the Makefile's variables and the rows of the results."""
    known = known_names(repo.root)
    span = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
    name_like = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*|_*[a-z][a-z0-9]*(?:_+[a-z0-9]+)+")
    missing = []
    for i, chapter in enumerate(CHAPTERS):
        found = set(known) | chapter_words(repo.root / chapter)
        if i:
            found |= chapter_words(repo.root / CHAPTERS[i - 1])
        readme = re.sub(r"```.*?```", "", (repo.root / chapter / "README.md").read_text(), flags=re.S)
        for text in span.findall(readme):
            text = text.strip()
            names = re.findall(r"(?<![\w-])-D([A-Za-z_]\w*)", text)
            call = re.match(r"([A-Za-z_]\w*)\s*\(", text)
            if call:
                names.append(call.group(1))
            elif len(text) > 1 and name_like.fullmatch(text) and not re.search(r"[a-z0-9]__[a-z]", text):
                names.append(text)  # (a name with "__" inside, `unit__metric`, is Nsight Compute's)
            missing += [f"{chapter}/README.md: `{text}`" for name in names if name not in found]
    missing = sorted(set(missing))
    assert not missing, (f"{len(missing)} code names in chapter READMEs that neither the chapter's code, the one "
                         f"before it, common/ nor the tests define:\n" + "\n".join(missing))


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_readme_make_test_counts_are_its_logs(repo, gpu):
    log = (repo.root / "docs/results/logs/common" / f"make_test_{gpu}.log").read_text()
    passed, skipped = re.findall(r"(\d+) passed, (\d+) skipped", log)[-1]
    commit = re.search(r"commit ([0-9a-f]{7})", log.splitlines()[0]).group(1)
    readme = " ".join((repo.root / "README.md").read_text().split())
    said = re.search(rf"at {commit}: (\d+) passed, (\d+) skipped", readme)
    assert said, f"README.md does not name make_test_{gpu}.log's commit {commit} with its counts"
    assert said.groups() == (passed, skipped), (
        f"README.md: {said.group(0)!r}, make_test_{gpu}.log: {passed} passed, {skipped} skipped")
