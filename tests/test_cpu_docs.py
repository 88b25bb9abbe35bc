"""The documentation stays true to the code it quotes: every code line a chapter README quotes
(```c blocks) is in that chapter's attention.cu (whitespace aside; a line with '...' is an
elision), READMEs point at code by name rather than by line number, and nothing cites design
sections or issue numbers that a reader does not have."""
import re

CITATION = re.compile(r"DESIGN\s?§|DESIGN\.md|\b[Ii]ssue \d+\b")  # (written so as not to match itself)
LINE_REF = re.compile(r"\b[Ll]ines? \d+\b")


def squeeze(text):
    return re.sub(r"\s+", "", text)


def cases(ctx):
    out = []
    for chapter in ctx.chapters:
        def quoted(ctx, chapter=chapter):
            readme = (ctx.root / chapter / "README.md").read_text()
            source = squeeze((ctx.root / chapter / "attention.cu").read_text())
            missing, checked = [], 0
            for block in re.findall(r"```c\n(.*?)```", readme, re.S):
                for line in block.splitlines():
                    code = line.split("//")[0].strip()
                    if not code or "..." in line:
                        continue
                    checked += 1
                    if squeeze(code) not in source:
                        missing.append(line.strip())
            assert not missing, f"{chapter}/README.md quotes code that is not in its attention.cu: {missing[:5]}"
            return f"{checked} quoted lines found"
        out.append((f"quoted_code[{chapter}]", quoted))

        def by_name(ctx, chapter=chapter):
            hits = LINE_REF.findall((ctx.root / chapter / "README.md").read_text())
            assert not hits, f"{chapter}/README.md points at code by line number ({hits[:3]}): name the symbol"
        out.append((f"no_line_numbers[{chapter}]", by_name))
    return out


def test_no_citations_readers_cannot_follow(ctx):
    files = [p for pattern in ("*.md", "[0-9][0-9]_*/*.md", "docs/*.md", "[0-9][0-9]_*/*.cu", "common/*",
                               "tests/*.py", "Makefile")
             for p in ctx.root.glob(pattern) if p.is_file() and p.name != "test_cpu_docs.py"]
    hits = [f"{p.relative_to(ctx.root)}: {m.group(0)}" for p in files
            for m in CITATION.finditer(p.read_text(errors="replace"))]
    assert not hits, f"citations of the design document or of issues, which readers do not have: {hits[:8]}"


def test_patches_apply_to_their_commit(ctx):
    """The measured variants kept as patches (docs/results/logs/<NN>/*.patch) each apply to the
    source of the commit that added them, which the 08 README tells readers to check out. Each
    patch names that commit in its header (a line `Applies to: <commit>` before the diff, which
    `git apply` ignores), so a moved or rewritten patch keeps it. Checking needs this repository's own git history; without it (an
    export, an archive unpacked inside some other work tree, a shallow clone) the test is skipped."""
    import shutil
    import unittest
    from pathlib import Path
    logs = ctx.root / "docs" / "results" / "logs"
    patches = sorted(logs.rglob("*.patch"))
    assert patches, "no patches under docs/results/logs"

    commits, unnamed = {}, []
    for patch in patches:
        header = re.split(r"^(?:diff --git |--- )", patch.read_text(), maxsplit=1, flags=re.M)[0]
        named = re.findall(r"^Applies to: ([0-9a-f]{40})\s*$", header, re.M)
        if len(named) == 1:
            commits[patch] = named[0]
        else:
            unnamed.append(str(patch.relative_to(ctx.root)))
    assert not unnamed, ("patches whose header (before the diff) does not name the commit they apply "
                         f"to in one line `Applies to: <40-hex commit>`: {unnamed}")

    # Never let a caller's GIT_DIR & co. point these commands at another repository.
    plain = {"GIT_DIR": None, "GIT_WORK_TREE": None, "GIT_INDEX_FILE": None, "GIT_CEILING_DIRECTORIES": None}

    def git(*args, cwd=None):
        proc = ctx.run(["git", *args], cwd=cwd, env=plain)
        return proc.stdout if proc.returncode == 0 else None

    if shutil.which("git") is None:
        raise unittest.SkipTest("git is not installed: the patches' commits cannot be checked out")
    top = (git("rev-parse", "--show-toplevel") or "").strip()
    if not top or Path(top).resolve() != ctx.root.resolve():
        where = f"the enclosing work tree is {top}" if top else "not a git work tree"
        raise unittest.SkipTest(f"no git history of this repository here ({where}): "
                                "the patches' commits cannot be checked out")
    absent = sorted({c for c in commits.values() if git("cat-file", "-e", f"{c}^{{commit}}") is None})

    failed, checked = [], 0
    for patch, commit in commits.items():
        if commit in absent:
            continue
        relative = str(patch.relative_to(ctx.root))
        tree = ctx.tmpdir()
        git("init", "-q", str(tree))
        for path in sorted(set(re.findall(r"^--- a/(\S+)", patch.read_text(), re.M))):
            text = git("show", f"{commit}:{path}")
            assert text is not None, f"{relative}: {path} is not in commit {commit}"
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text(text)
        checked += 1
        if git("apply", "--check", str(patch), cwd=tree) is None:
            failed.append(f"{relative} at {commit[:12]}")
    assert not failed, f"patches that no longer apply to the commit they name: {failed}"
    if absent:
        raise unittest.SkipTest(f"this history lacks {len(absent)} of the commits the patches name (a shallow "
                                f"clone, or a header naming a commit that is not here): "
                                f"{', '.join(c[:12] for c in absent)}; "
                                + (f"the {checked} patches whose commit is here apply" if checked else
                                   "no patch could be checked"))
    return f"{len(patches)} patches apply to the commits they name"


def test_figure_code_checks(ctx):
    """docs/figures/make_figures.py reads the constants and the order of operations it draws from
    the chapters' sources and refuses to draw when they changed: those checks need no matplotlib,
    so they run here, where a figure that no longer matches its chapter shows up at once."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_figures", ctx.root / "docs" / "figures" / "make_figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    p = figures.pingpong_source()
    assert p["block_kv"] > 0 and p["stages"] > 0 and p["smem_bytes"] <= 227 * 1024, f"08's constants as drawn: {p}"
    figures.heaviest_first("05_causal")
    assert figures.const_expr({}, "(1 && !0 ? 192 : 128)") == 192, "the C expression reader lost && or !"
    return f"08 as drawn: BLOCK_KV {p['block_kv']}, {p['stages']} stages, {p['smem_bytes']} bytes of shared memory"


# Words a chapter README writes in backticks that look like code names but are not names of the
# chapter's code, so test_named_symbols_exist does not look for them there. Keep this short: a name
# that the code lost belongs in the README's fix, not here.
NOT_CODE = {
    # SASS opcodes the READMEs count or rule out (common/claims.py's SASS claims add their own).
    "sass": {"F2FP", "FADD", "FMNMX", "FMUL", "HADD2", "HFMA2", "HMUL2", "MUFU", "PRMT", "SHFL", "VHMNMX"},
    # The exercise markers are comments by design (common/exercises.py reads them).
    "markers": {"EXERCISE"},
    # CUDA and C library names cited for what they compile to, or for what a chapter no longer uses.
    "library": {"exp2f", "INT_MAX", "__shfl_sync"},
    # Nsight Compute's stall reasons (its metric names, `unit__metric`, are told by their "__").
    "nsight": {"math_pipe_throttle", "mio_throttle"},
}


def test_named_symbols_exist(ctx):
    """Every code name a chapter README writes in backticks (not in its ```c blocks, which
    quoted_code checks) exists: a function named with its `(`, an ALL_CAPS macro or constant, a
    `-DNAME=` switch, a snake_case name. It is looked for in the chapter's attention.cu and in the
    one it was copied from (a README contrasts the two), comments stripped; in common/ (the
    harness's C, and the names and string keys of its Python); among the tests' functions and
    case names, the Makefile's variables and the rows of the results; and in the added lines of
    the chapter's measured variants kept as patches (docs/results/logs/NN/*.patch), whose switches
    a README describes."""
    import io
    import tokenize
    from claims import CLAIMS, strip_comments

    def words(text):
        return set(re.findall(r"\w+", text))

    def python_names(text):
        names = set()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME:
                names.add(tok.string)
            elif tok.type == tokenize.STRING and re.fullmatch(r"[rbu]?(['\"])\w+\1", tok.string, re.I):
                names.add(tok.string.strip("rbuRBU")[1:-1])
        return names

    known = set().union(*NOT_CODE.values())
    for claims in CLAIMS.values():
        known |= set(claims.get("sass_has", [])) | set(claims.get("sass_lacks", []))
        known |= {op for ops in claims.get("sass_kernel_has", {}).values() for op in ops}
    for path in sorted((ctx.root / "common").iterdir()):
        if path.suffix in (".h", ".c", ".cu"):
            known |= words(strip_comments(path.read_text()))
        elif path.suffix == ".py":
            known |= python_names(path.read_text())
    for path in sorted((ctx.root / "tests").glob("*.py")):
        text = path.read_text()
        known |= set(re.findall(r"^def\s+(\w+)", text, re.M)) | set(re.findall(r"""["'](\w+)\[""", text))
    for used, assigned in re.findall(r"\$\((\w+)\)|^(\w+)\s*[?:]?=", (ctx.root / "Makefile").read_text(), re.M):
        known.add(used or assigned)
    for path in sorted((ctx.root / "docs" / "results").glob("*.csv")):
        known |= {line.split(",")[0] for line in path.read_text().splitlines()[1:]}

    span = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
    name_like = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*|_*[a-z][a-z0-9]*(?:_+[a-z0-9]+)+")
    logs = ctx.root / "docs" / "results" / "logs"
    missing, checked = [], 0
    for i, chapter in enumerate(ctx.chapters):
        number = chapter[:2]
        found = set(known) | words(strip_comments((ctx.root / chapter / "attention.cu").read_text()))
        if i:
            found |= words(strip_comments((ctx.root / ctx.chapters[i - 1] / "attention.cu").read_text()))
        for patch in sorted(logs.rglob("*.patch")):
            if patch.parent.name == number or re.search(rf"(?:^|_){number}[_.]", patch.name):
                found |= words("\n".join(line[1:] for line in patch.read_text().splitlines()
                                         if line.startswith("+") and not line.startswith("+++")))
        readme = re.sub(r"```.*?```", "", (ctx.root / chapter / "README.md").read_text(), flags=re.S)
        for text in span.findall(readme):
            text = text.strip()
            names = re.findall(r"(?<![\w-])-D([A-Za-z_]\w*)", text)
            call = re.match(r"([A-Za-z_]\w*)\s*\(", text)
            if call:
                names.append(call.group(1))
            elif len(text) > 1 and name_like.fullmatch(text) and not re.search(r"[a-z0-9]__[a-z]", text):
                names.append(text)  # (a name with "__" inside, `unit__metric`, is Nsight Compute's)
            for name in names:
                checked += 1
                if name not in found:
                    missing.append(f"{chapter}/README.md: `{text}`")
    missing = sorted(set(missing))
    assert not missing, (f"{len(missing)} code names in chapter READMEs that neither the chapter's code, the one "
                         f"before it, common/, the tests nor its patches define:\n" + "\n".join(missing))
    return f"{checked} names in {len(ctx.chapters)} chapter READMEs found"
