"""What each chapter says about itself, read from its source: the `Chapter` initializer at the
end of NN_name/attention.cu (its name, what it adds, its precision, the GPUs it runs on), and
the harness's wording of each precision (common/harness.cu). The README's chapter table and the
tests use these words, so each is written once, in the code."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INITIALIZER = re.compile(r'const\s+Chapter\s+chapter\s*=\s*\{\s*"([^"]+)",\s*"((?:[^"\\]|\\.)*)",\s*'
                         r'(PRECISION_\w+),\s*(\d+),\s*(\d+),')
# A chapter built in steps (08) names each build in a `#if STEP == k` block of defines, and its
# initializer uses them: the chapter is the step named like its folder.
STEP_DEFINES = re.compile(r'#(?:el)?if STEP == (\d+)\n#define STEP_NAME "([^"]+)"\n#define STEP_ADDS "((?:[^"\\]|\\.)*)"\n'
                          r'#define STEP_PRECISION (PRECISION_\w+)\n')
STEP_INITIALIZER = re.compile(r'const\s+Chapter\s+chapter\s*=\s*\{\s*STEP_NAME,\s*STEP_ADDS,\s*STEP_PRECISION,\s*(\d+),\s*(\d+),')
# A chapter with a backward pass registers a `Backward` beside its forward (common/harness.h).
BACKWARD_DEFINITION = re.compile(r"^[ \t]*(?:static[ \t]+)?const[ \t]+(?:struct[ \t]+)?Backward[ \t]+\w+[ \t]*=", re.M)
CHAPTERS_BEGIN, CHAPTERS_END = "<!-- chapters:begin -->", "<!-- chapters:end -->"


def precision_words(root=ROOT):
    """{'PRECISION_FP32': 'fp32 CUDA cores', ...} from harness.cu's rules and its switch."""
    text = open(os.path.join(root, "common", "harness.cu")).read()
    rules = dict(re.findall(r'static const PrecisionRule (\w+) = \{"([^"]+)"', text))
    cases = re.findall(r"case (PRECISION_\w+): return &(\w+);", text)
    return {precision: rules[rule] for precision, rule in cases}


def read_steps(path, words=None):
    """The steps of a chapter built in steps, in order, as dicts (name, adds, precision, math,
    step); [] for any other chapter."""
    words = words or precision_words()
    return [{"step": int(step), "name": name, "adds": adds.replace('\\"', '"'), "precision": precision,
             "math": words.get(precision, precision)}
            for step, name, adds, precision in STEP_DEFINES.findall(open(path).read())]


def has_backward(path):
    """Whether the chapter of this attention.cu defines a `Backward` (its --backward pass)."""
    return BACKWARD_DEFINITION.search(open(path).read()) is not None


def read_chapter(path, words=None):
    """The chapter defined in one attention.cu, as a dict."""
    text = open(path).read()
    words = words or precision_words()
    found, stepped = INITIALIZER.search(text), STEP_INITIALIZER.search(text)
    if found:
        name, adds, precision, min_sm, max_sm = found.groups()
        adds = adds.replace('\\"', '"')
    elif stepped:
        folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
        last = [s for s in read_steps(path, words) if s["name"] == folder]
        if not last:
            raise ValueError(f"{path}: no `#if STEP == k` block names the chapter {folder}")
        name, adds, precision = last[0]["name"], last[0]["adds"], last[0]["precision"]
        min_sm, max_sm = stepped.groups()
    else:
        raise ValueError(f"{path}: no 'const Chapter chapter = {{ name, adds, precision, min_sm, max_sm, ...' found")
    return {"name": name, "adds": adds, "precision": precision,
            "math": words.get(precision, precision), "min_sm": int(min_sm), "max_sm": int(max_sm)}


def read_chapters(root=ROOT):
    words = precision_words()  # the harness's words, whatever tree the chapters are in
    return [read_chapter(path, words) for path in sorted(glob.glob(os.path.join(root, "[0-9][0-9]_*", "attention.cu")))]


def runs_on(chapter):
    """sm_80+, sm_90 only, or sm_80 to sm_90."""
    low, high = chapter["min_sm"], chapter["max_sm"]
    if high == 0:
        return f"sm_{low}+"
    return f"sm_{low} only" if high == low else f"sm_{low} to sm_{high}"


def chapters_markdown(chapters):
    """The README's chapter table: each chapter's own words."""
    lines = ["| chapter | adds | math | runs on |", "|---|---|---|---|"]
    for c in chapters:
        adds = c["adds"].replace("|", "\\|")
        lines.append(f"| [{c['name']}]({c['name']}/README.md) | {adds} | {c['math']} | {runs_on(c)} |")
    return "\n".join(lines) + "\n"
