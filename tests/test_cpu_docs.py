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
    """The measured variants kept as patches (docs/results/logs/*.patch) each apply to the source
    of the commit that added them, which the 08 README tells readers to check out. Needs the
    project's git history; without it (an export, a shallow clone) there is nothing to check."""
    import unittest
    patches = sorted((ctx.root / "docs" / "results" / "logs").glob("*.patch"))
    assert patches, "no patches in docs/results/logs"

    def git(*args, cwd=None):
        try:
            proc = ctx.run(["git", *args], cwd=cwd)
        except FileNotFoundError:
            return None
        return proc.stdout if proc.returncode == 0 else None

    if (git("rev-parse", "--is-shallow-repository") or "").strip() != "false":
        raise unittest.SkipTest("no full git history here: the patches' commits cannot be checked out")
    failed = []
    for patch in patches:
        relative = str(patch.relative_to(ctx.root))
        added = git("log", "--diff-filter=A", "--format=%h", "--", relative).split()
        commit = added[-1] if added else "HEAD"  # not committed yet: against the last commit
        tree = ctx.tmpdir()
        git("init", "-q", str(tree))
        for path in sorted(set(re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M))):
            text = git("show", f"{commit}:{path}")
            assert text is not None, f"{relative}: {path} is not in commit {commit}"
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text(text)
        if git("apply", "--check", str(patch), cwd=tree) is None:
            failed.append(f"{patch.name} at {commit}")
    assert not failed, f"patches that no longer apply to the commit that added them: {failed}"
    return f"{len(patches)} patches apply to their commits"


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
