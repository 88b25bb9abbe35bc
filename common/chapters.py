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
# A chapter of ordered steps (08, 09) holds one file per step, NN_name/stepK_<idea>.cu, each a program
# with a Chapter of its own; its attention.cu is the last step.
STEP_FILE = re.compile(r"^step(\d+)_\w+\.cu$")
# A chapter with a backward pass registers a `Backward` beside its forward (common/harness.h).
BACKWARD_DEFINITION = re.compile(r"^[ \t]*(?:static[ \t]+)?const[ \t]+(?:struct[ \t]+)?Backward[ \t]+\w+[ \t]*=", re.M)
CHAPTERS_BEGIN, CHAPTERS_END = "<!-- chapters:begin -->", "<!-- chapters:end -->"


def precision_words(root=ROOT):
    """{'PRECISION_FP32': 'fp32 CUDA cores', ...} from harness.cu's rules and its switch."""
    text = open(os.path.join(root, "common", "harness.cu")).read()
    rules = dict(re.findall(r'static const PrecisionRule (\w+) = \{"([^"]+)"', text))
    cases = re.findall(r"case (PRECISION_\w+): return &(\w+);", text)
    return {precision: rules[rule] for precision, rule in cases}


def step_files(folder):
    """[(k, path)] of a chapter folder's step files, in order of k ([] for a chapter of one file)."""
    found = [(int(m.group(1)), os.path.join(folder, name)) for name in os.listdir(folder)
             for m in [STEP_FILE.match(name)] if m]
    return sorted(found)


def read_steps(path, words=None):
    """The steps of a chapter built in steps, in order, as dicts (step, name, adds, precision, math,
    source): each step file's Chapter, then the chapter's own attention.cu (`path`) as the last step;
    [] for any other chapter."""
    files = step_files(os.path.dirname(os.path.abspath(path)))
    if not files:
        return []
    words = words or precision_words()
    steps = [dict(read_chapter(source, words), step=k, source=source) for k, source in files]
    return steps + [dict(read_chapter(path, words), step=len(files) + 1, source=path)]


def has_backward(path):
    """Whether the chapter of this attention.cu defines a `Backward` (its --backward pass)."""
    return BACKWARD_DEFINITION.search(open(path).read()) is not None


def read_chapter(path, words=None):
    """The chapter (or step) defined in one source file, as a dict."""
    text = open(path).read()
    words = words or precision_words()
    found = INITIALIZER.search(text)
    if not found:
        raise ValueError(f"{path}: no 'const Chapter chapter = {{ name, adds, precision, min_sm, max_sm, ...' found")
    name, adds, precision, min_sm, max_sm = found.groups()
    return {"name": name, "adds": adds.replace('\\"', '"'), "precision": precision,
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
