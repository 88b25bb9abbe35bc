"""The exercises' markers and facts: what `make exercise`, `make grade` and `make handout` read
from a chapter (common/exercise_copy.py, exercise_grade.py, exercise_handout.py stand on this).

The chapter is the solution: an exercise is made of one or more blocks of lines of
NN_name/attention.cu between comment markers, so the chapter compiles to the same code with or
without them.

    <indent>// EXERCISE NN.name BEGIN: <the task, one line>
    <indent>//   <field>: <value>                     (the exercise's facts: main part only)
    <the solution: the chapter's own lines>
    <indent>// EXERCISE NN.name STUB                 (speed exercises)
    <indent>// <one line of the stub, commented out>
    <indent>// EXERCISE END

NN is the chapter's number. The same name may open several blocks in the file (helpers the
solution needs elsewhere, say): at least one of them has the task (the first that has one is the
exercise's main part, where its region shows the hint); the others may be a bare
`// EXERCISE NN.name BEGIN`, and any of them may have a STUB.

An exercise's facts (its kind, hint and grading) are the comment lines right after the BEGIN
line of its main part, beside the code they describe: one field a line, `//`, three spaces,
`field: value`. A prose value (hint, stub, ptx means, ptx todo) goes on over lines of `//` and
five spaces, joined with one space; every other value is one line, taken verbatim to its end
(trailing blanks dropped), so that a regular expression or a line of code stays exact. Any line
of `//` and two spaces or more right after a BEGIN line is a facts line: one that is neither
form, an unknown field, a field given twice, a bad value, or facts that lack what their kind
needs is a MarkerError naming the file and line. For example (04_fused/attention.cu):

    // EXERCISE 04.k_layout BEGIN: stage K so that a thread's 4 keys at one dim are one conflict-free float4
    //   kind: speed
    //   gate: 1.10x
    //   shape: headline
    //   hint: The stub stages K as it lies in memory, [key][dim]: the 16 threads of a row then read keys
    //     HEAD_DIM floats apart, all in one bank, one float at a time. Stage it transposed, [dim][key]
    //     (load_transposed), so that a thread's 4 keys at dim d are one float4 read.
    //   stub: not timed: each K read is a 16-way bank conflict and 4 loads instead of one, about 20 times
    //     the S loop's shared-memory wavefronts

  kind: correctness | speed   (always) correctness: the stub is EXERCISE_TODO and the GPU matrix
      grades it. speed: the stub is correct but slow code; it must stay correct (the matrix) and
      get fast, graded by a gate or, where the gain is too close to the run-to-run noise for a
      gate to mean anything, by a `ptx:` check of the mechanism that makes it fast (its time at
      `shape` beside the chapter's is then shown for information)
  hint: prose                 (always) shown in the region of the student copy and in HANDOUT.md
  gate: 1.10x                 (speed) the copy takes at most this x the chapter's time at `shape`,
      both timed in the same run
  shape: B=1 H=16 N=2048 D=128, or a name of SHAPES: headline (B=4 H=16 N=4096 D=128),
      headline_d64 (B=4 H=32 N=4096 D=64); ` causal` after either   (speed) where it is timed
  timed: ms | attend_ms       (speed, optional) what is timed: the whole forward (the harness's
      ms, the default) or the attention kernel alone, where the exercise changes only that kernel
      and a pass before it (08's quantisation) would dilute the difference
  stub: prose                 (speed) how slow the stub is and how that is known: from a
      measurement in docs/results (the stub is code the chapter once was), or from its access
      pattern where it was not timed
  dims: 64                    (optional) the head dims the exercise's code runs at, when not both
      (the grade's matrix runs these), blank-separated
  pass: forward | backward    (optional; forward by default) the pass whose code the exercise is in:
      backward (09's kernels) grades it with --backward, the harness's run of the chapter's backward
      pass (dQ, dK, dV against the float64 reference, after the forward): the matrix, racecheck and,
      for a speed exercise, what its gate times (the backward alone)
  ptx: <regular expression>   (optional, repeatable) the PTX of the copy (made with the build's
      flags) must match it; the lines after it describe it: `ptx shown:` the instruction as a
      student would grep for it, `ptx found:` (optional) a regular expression whose matches are
      listed when the check finds none, `ptx means:` what the instruction is for, `ptx todo:`
      what to do when it is missing
  wrong old: <code>, wrong new: <code>   (optional) a wrong solution: the chapter with `old`
      replaced by `new` once in the exercise's code (the GPU tests check that the grade's matrix
      fails it); the student copy and a hand-out never hold it

A speed exercise needs shape, stub, and a gate or a ptx check. In a hand-out, where the chapter's
attention.cu is a stand-in (the student copy with a note on top), the note holds the facts of each
exercise, without `wrong`, after a `// EXERCISE NN.name FACTS` line. EXERCISES reads them all
(the facts of NN.name from chapter NN, when asked), in the form the grader uses: dict(kind, hint,
gate, shape=(B, H, N, D, causal), timed, stub, dims=(64,), pass, ptx_has=[dict(pattern, shown, found,
means, todo)], wrong=(old, new)); `pass` only where the facts give it (pass_of: forward otherwise).

"""
import os
import re
import textwrap
from collections.abc import Mapping

from runner import chapters, find_chapter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# --- The exercises: their facts are comment lines in the chapters (the module's docstring) ----------
# The named shapes a `shape:` fact may use (B, H, N, D; ` causal` after the name makes it causal).
SHAPES = {"headline": (4, 16, 4096, 128), "headline_d64": (4, 32, 4096, 64)}
HEADLINE, HEADLINE_D64 = SHAPES["headline"] + (False,), SHAPES["headline_d64"] + (False,)
HEAD_DIMS = (64, 128)
BEGIN = re.compile(r"^(?P<indent>[ \t]*)// EXERCISE (?P<name>\d\d\.\w+) BEGIN(?:: (?P<task>\S.*?))?\s*$")
STUB = re.compile(r"^[ \t]*// EXERCISE (?P<name>\d\d\.\w+) STUB\s*$")
END = re.compile(r"^[ \t]*// EXERCISE END\s*$")
REGION = re.compile(r"^(?P<indent>[ \t]*)// EXERCISE (?P<name>\d\d\.\w+) TODO(?: \(speed\))?: ")
ANY_MARKER = re.compile(r"//\s*EXERCISE\b")
TODO_CALL = re.compile(r'^\s*EXERCISE_TODO\("(\d\d\.\w+)"\)', re.M)
# The facts lines after a BEGIN line (the module's docstring): any line of `//` and two spaces or
# more there is one, and must be a field (`//`, three spaces, `field: value`) or the continuation of a
# prose field (`//`, five spaces, more words).
FACT_LINE = re.compile(r"^[ \t]*//  ")
FACT = re.compile(r"^[ \t]*//   (?P<field>[a-z]+(?: [a-z]+)?): (?P<value>\S.*?)\s*$")
MORE = re.compile(r"^[ \t]*//     (?P<value>\S.*?)\s*$")
FIELDS = ("kind", "gate", "shape", "timed", "dims", "pass", "hint", "stub", "ptx", "ptx shown", "ptx found", "ptx means",
          "ptx todo", "wrong old", "wrong new")
PROSE = {"hint", "stub", "ptx means", "ptx todo"}  # the fields that may go on over lines
KINDS, TIMED = ("correctness", "speed"), ("ms", "attend_ms")
# The passes an exercise's code may be in (`pass:`), and what the harness's command line adds for each.
PASSES = ("forward", "backward")
PASS_ARGS = {"forward": [], "backward": ["--backward"]}
PASS_WORDS = {"forward": "the forward pass", "backward": "the backward pass (--backward: dQ, dK, dV)"}
GATE = re.compile(r"^(?P<g>\d+(?:\.\d+)?)x$")
SHAPE = re.compile(r"^(?:(?P<name>[a-z]\w*)|B=(?P<b>\d+) H=(?P<h>\d+) N=(?P<n>\d+) D=(?P<d>\d+))(?P<causal> causal)?$")
FACTS_MARK = re.compile(r"^// EXERCISE (?P<name>\d\d\.\w+) FACTS\s*$")  # in a hand-out's stand-in only
# The first lines of a hand-out's NN_name/attention.cu: the student copy stands in for the chapter.
STANDIN_NOTE = ("// HAND-OUT: not the chapter and not your copy. This hand-out holds no solution: this file is the\n"
                "// student copy as handed out, here so that the Makefile finds the chapter; edit {copy}.\n")
STANDIN_FACTS = ("// How each exercise is graded, as the chapter says it after its BEGIN line; make grade reads "
                 "these lines:\n")
STANDIN_END = "// HAND-OUT END: the student copy as handed out follows.\n"
STANDIN_FIRST = "// HAND-OUT: not the chapter"


class MarkerError(ValueError):
    """Malformed EXERCISE markers, with the file and line."""


# --- Chapters ------------------------------------------------------------------------------------
def chapter_source(chapter, root=ROOT):
    with open(os.path.join(root, chapter, "attention.cu")) as f:
        return f.read()


def is_standin(text):
    """Whether a chapter's attention.cu is a hand-out's stand-in (the student copy, no solution)."""
    return text.startswith(STANDIN_FIRST)


def standin_copy(text):
    """The student copy a stand-in holds: the stand-in without its note (and the facts in it)."""
    note, found, copy = text.partition(STANDIN_END)
    return copy if found else text.split("\n", STANDIN_NOTE.count("\n"))[-1]


# --- Markers -------------------------------------------------------------------------------------
def uncomment(line):
    """A commented-out stub line as code: '    // x = 1;' -> '    x = 1;' ('    //' -> '')."""
    body = line.rstrip("\r\n")
    ending = line[len(body):]
    head, _, rest = body.partition("//")
    code = rest[1:] if rest.startswith(" ") else rest
    if code.lstrip().startswith("#"):  # a preprocessor line starts the line, as clang-format puts it
        return code.lstrip() + ending
    return (head + code if code.strip() else "") + ending


def read_facts(lines, i, where, name):
    """([field, value, line number], the index of the line after them): the facts lines after
    line i (a BEGIN or FACTS line), each prose value joined with its continuation lines."""
    fields, j = [], i + 1
    while j < len(lines) and FACT_LINE.match(lines[j]):
        fact, more = FACT.match(lines[j]), MORE.match(lines[j])
        if fact:
            fields.append([fact["field"], fact["value"], j + 1])
        elif more and fields and fields[-1][0] in PROSE:
            fields[-1][1] += " " + more["value"]
        elif more:
            after = f"the one-line field '{fields[-1][0]}'" if fields else "no field"
            raise MarkerError(f"{where}:{j + 1}: {name}: a continuation line after {after}; only "
                              f"{words_list(sorted(PROSE))} go on over lines (`//` and five spaces)")
        else:
            raise MarkerError(f"{where}:{j + 1}: {name}: not a facts line: {lines[j].strip()!r} (`//`, three spaces, "
                              "`field: value`; or `//`, five spaces and more of a hint, stub, ptx means or ptx todo)")
        j += 1
    return fields, j


def fact_value(field, value, where, name):
    """A fact's value as the grader uses it (a float, a shape, a tuple of dims, a string)."""
    def bad(expected):
        return MarkerError(f"{where}: {name}: {field}: {value!r} is not {expected}")
    if field == "kind":
        if value not in KINDS:
            raise bad(" or ".join(KINDS))
        return value
    if field == "gate":
        found = GATE.match(value)
        if not found or float(found["g"]) <= 0:
            raise bad("a gate such as 1.10x")
        return float(found["g"])
    if field == "shape":
        found = SHAPE.match(value)
        if not found or (found["name"] and found["name"] not in SHAPES):
            raise bad(f"a shape: {' or '.join(SHAPES)}, or B=4 H=16 N=4096 D=128; either with ' causal' after it")
        dims = SHAPES[found["name"]] if found["name"] else tuple(int(found[k]) for k in "bhnd")
        return dims + (bool(found["causal"]),)
    if field == "timed":
        if value not in TIMED:
            raise bad(" or ".join(TIMED))
        return value
    if field == "pass":
        if value not in PASSES:
            raise bad(" or ".join(PASSES))
        return value
    if field == "dims":
        dims = tuple(int(d) for d in value.split()) if re.fullmatch(r"\d+( \d+)*", value) else ()
        if not dims or not set(dims) <= set(HEAD_DIMS) or len(set(dims)) < len(dims):
            raise bad(f"head dims among {' '.join(map(str, HEAD_DIMS))}, blank-separated")
        return dims
    if field in ("ptx", "ptx found"):
        try:
            re.compile(value)
        except re.error as exc:
            raise bad(f"a regular expression ({exc})") from None
    return value


def read_exercise_facts(fields, where, name, at):
    """The facts of exercise `name` (fields from read_facts; `at`: its BEGIN line's number) as
    the grader uses them: dict(kind, hint, gate, shape, timed, stub, dims, ptx_has, wrong)."""
    info, check, wrong = {}, None, {}
    for field, value, line in fields:
        here = f"{where}:{line}"
        if field not in FIELDS:
            raise MarkerError(f"{here}: {name}: unknown field '{field}' (fields: {', '.join(FIELDS)})")
        value = fact_value(field, value, here, name)
        if field == "ptx":
            check = {"pattern": value}
            info.setdefault("ptx_has", []).append(check)
            continue
        key, into = field, info
        if field.startswith("ptx "):
            if check is None:
                raise MarkerError(f"{here}: {name}: '{field}' before any `ptx:` line (it describes the one above it)")
            key, into = field[4:], check
        elif field.startswith("wrong "):
            key, into = field[6:], wrong
        if key in into:
            raise MarkerError(f"{here}: {name}: '{field}' given twice")
        into[key] = value
    here = f"{where}:{at}"
    missing = [f for f in ("kind", "hint") if f not in info]
    if missing:
        raise MarkerError(f"{here}: {name}: its facts lack {' and '.join(missing)}")
    if info["kind"] == "speed":
        missing = [f for f in ("shape", "stub") if f not in info]
        if missing:
            raise MarkerError(f"{here}: speed exercise {name}: its facts lack {' and '.join(missing)} (where it is "
                              "timed, how slow its stub is and how that is known)")
        if not (info.get("gate") or info.get("ptx_has")):
            raise MarkerError(f"{here}: speed exercise {name} needs a gate (`gate: 1.10x`) or a check of its compiled "
                              "code (`ptx: <pattern>`)")
    else:
        extra = [f for f in ("gate", "shape", "timed", "stub") if f in info]
        if extra:
            raise MarkerError(f"{here}: correctness exercise {name}: {', '.join(extra)} are facts of a speed exercise")
    for c in info.get("ptx_has", []):
        missing = [f"ptx {f}" for f in ("shown", "means", "todo") if f not in c]
        if missing:
            raise MarkerError(f"{here}: {name}: its check `ptx: {c['pattern']}` lacks {', '.join(missing)}")
    if wrong:
        if set(wrong) != {"old", "new"}:
            raise MarkerError(f"{here}: {name}: a wrong solution needs both `wrong old:` and `wrong new:`")
        info["wrong"] = (wrong["old"], wrong["new"])
    return info


def fact_lines(info, indent="", width=110):
    """The facts lines of an exercise's facts (read_exercise_facts read back), `indent` before
    each: what the chapter holds after the BEGIN line, and a hand-out's stand-in after FACTS."""
    def shape_words(shape):
        named = next((n for n, dims in SHAPES.items() if dims == tuple(shape[:4])), None)
        return (named or shape_text(tuple(shape[:4]) + (False,))) + (" causal" if shape[4] else "")
    fields = [("kind", info["kind"])]
    if "gate" in info:
        fields.append(("gate", f"{info['gate']:.2f}x"))
    if "shape" in info:
        fields.append(("shape", shape_words(info["shape"])))
    if "timed" in info:
        fields.append(("timed", info["timed"]))
    if "dims" in info:
        fields.append(("dims", " ".join(map(str, info["dims"]))))
    if "pass" in info:
        fields.append(("pass", info["pass"]))
    fields.append(("hint", info["hint"]))
    if "stub" in info:
        fields.append(("stub", info["stub"]))
    for c in info.get("ptx_has", []):
        fields += [("ptx", c["pattern"]), ("ptx shown", c["shown"])] + ([("ptx found", c["found"])] if "found" in c
                                                                          else [])
        fields += [("ptx means", c["means"]), ("ptx todo", c["todo"])]
    if "wrong" in info:
        fields += [("wrong old", info["wrong"][0]), ("wrong new", info["wrong"][1])]
    out = []
    for field, value in fields:
        head = f"{indent}//   {field}: "
        if field not in PROSE:
            out.append(f"{head}{value}")
            continue
        words = glued(value)
        wrapped = textwrap.wrap(words, width=width - len(head), break_long_words=False, break_on_hyphens=False)
        more = textwrap.wrap(" ".join(wrapped[1:]), width=width - len(indent) - 7, break_long_words=False,
                             break_on_hyphens=False)
        lines = [head + wrapped[0]] + [f"{indent}//     {line}" for line in more]
        if " ".join(wrapped[:1] + more) != words:
            raise ValueError(f"{field}: {value!r} does not survive wrapping (runs of spaces?)")
        out += [line.replace(GLUE, " ") for line in lines]
    return [line + "\n" for line in out]


GLUE = "\0"  # a space that fact_lines does not break a line at
OPERATORS = {"*", "/", "+", "-", "%", "=", "==", "!=", "<", ">", "<=", ">=", "+=", "-=", "*=", "->", "&&", "||"}


def glued(value):
    """The value with GLUE for the spaces of an expression: around an operator, inside a template's
    <...>, between the B= H= N= D= of a shape (the lines read better unbroken there)."""
    words = value.split(" ")
    out = words[:1]
    for word in words[1:]:
        last = out[-1].split(GLUE)[-1]
        joined = out[-1]
        glue = (word in OPERATORS or last in OPERATORS or joined.count("<") > joined.count(">")
                or (re.fullmatch(r"[BHND]=\d+", last) and re.fullmatch(r"[HND]=\d+,?", word)))
        if glue:
            out[-1] += GLUE + word
        else:
            out.append(word)
    return " ".join(out)


def parse(text, where="attention.cu"):
    """The EXERCISE blocks of a chapter source, in file order: [dict(name, task, indent, start, end,
    stub, facts, code_at)] with task None on a bare BEGIN, start/end the indices of the BEGIN and
    END lines, stub the uncommented STUB lines or None, facts the exercise's facts on its main
    part (None on the others), code_at the index of the first line after BEGIN and its facts."""
    lines, blocks, block, skip = text.splitlines(keepends=True), [], None, 0
    for i, line in enumerate(lines):
        if i < skip:
            continue
        begin, stub, end = BEGIN.match(line), STUB.match(line), END.match(line)
        if begin:
            if block:
                raise MarkerError(f"{where}:{i + 1}: EXERCISE {begin['name']} BEGIN inside {block['name']} "
                                  f"(line {block['start'] + 1}): blocks do not nest")
            block = dict(name=begin["name"], task=begin["task"], indent=begin["indent"], start=i, stub_at=None)
            fields, skip = read_facts(lines, i, where, begin["name"])
            if fields and not begin["task"]:
                raise MarkerError(f"{where}:{i + 2}: {begin['name']}: facts lines after a bare BEGIN: they follow "
                                  "the BEGIN line that has the task")
            block["facts"] = read_exercise_facts(fields, where, begin["name"], i + 1) if fields else None
            block["code_at"] = skip
        elif stub:
            if not block or stub["name"] != block["name"] or block["stub_at"] is not None:
                raise MarkerError(f"{where}:{i + 1}: EXERCISE {stub['name']} STUB outside its block, or twice")
            block["stub_at"] = i
        elif end:
            if not block:
                raise MarkerError(f"{where}:{i + 1}: EXERCISE END without a BEGIN")
            block["end"], block["stub"] = i, None
            if block["stub_at"] is not None:
                stub_lines = lines[block["stub_at"] + 1:i]
                bad = [n for n, s in enumerate(stub_lines, block["stub_at"] + 2) if not s.lstrip().startswith("//")]
                if bad:
                    raise MarkerError(f"{where}:{bad[0]}: a STUB line of {block['name']} is not commented out")
                block["stub"] = [uncomment(s) for s in stub_lines]
            blocks.append(block)
            block = None
        elif ANY_MARKER.search(line) and not REGION.match(line):
            raise MarkerError(f"{where}:{i + 1}: not an EXERCISE marker: {line.strip()!r} "
                              "(BEGIN: <task>, a bare BEGIN, STUB, END)")
    if block:
        raise MarkerError(f"{where}:{block['start'] + 1}: EXERCISE {block['name']} BEGIN has no END")
    for name, parts in exercise_parts(blocks).items():
        main = main_part(parts)
        if main is None:
            continue  # check_blocks says so
        for b in parts:
            if b["facts"] is not None and b is not main:
                raise MarkerError(f"{where}:{b['start'] + 2}: {name}: its facts follow the BEGIN line of its main "
                                  f"part, line {main['start'] + 1} (the first with a task)")
        if main["facts"] is None:
            raise MarkerError(f"{where}:{main['start'] + 1}: exercise {name} has no facts: the lines after its BEGIN "
                              "line, `//   kind: ...`, `//   hint: ...` (the format: common/exercise_markers.py)")
    return blocks


def exercise_parts(blocks):
    """{name: its blocks in file order}, the names in the order they first appear."""
    parts = {}
    for b in blocks:
        parts.setdefault(b["name"], []).append(b)
    return parts


def main_part(parts):
    """The block of an exercise that carries its task: the first with task text (None if none)."""
    return next((b for b in parts if b["task"]), None)


def tasks(blocks):
    """{name: task} of each exercise of a chapter."""
    return {name: main_part(parts)["task"] for name, parts in exercise_parts(blocks).items() if main_part(parts)}


def facts_table(blocks):
    """{name: facts} of each exercise of a chapter's blocks, from its main part."""
    return {name: main_part(parts)["facts"] for name, parts in exercise_parts(blocks).items()
            if main_part(parts) and main_part(parts)["facts"]}


def standin_facts(text, where):
    """{name: facts} written in a hand-out's stand-in: after each `// EXERCISE NN.name FACTS` of its note."""
    lines, table = text.partition(STANDIN_END)[0].splitlines(keepends=True), {}
    for i, line in enumerate(lines):
        mark = FACTS_MARK.match(line)
        if mark:
            fields, _ = read_facts(lines, i, where, mark["name"])
            table[mark["name"]] = read_exercise_facts(fields, where, mark["name"], i + 1)
    return table


def standin_note(copy_path, table, names):
    """The note atop a hand-out's stand-in: what it is, the facts of each exercise (without `wrong`,
    which quotes the solution), and the line after which the student copy follows."""
    lines = [STANDIN_NOTE.format(copy=copy_path), STANDIN_FACTS]
    for name in names:
        public = {k: v for k, v in table[name].items() if k != "wrong"}
        lines += [f"// EXERCISE {name} FACTS\n"] + fact_lines(public)
    return "".join(lines) + STANDIN_END


_FACTS_CACHE = {}


def chapter_facts(chapter, root=ROOT):
    """{name: facts} of a chapter's exercises, read from its attention.cu (a hand-out's stand-in:
    from its note), read again when the file changes."""
    path = os.path.join(root, chapter, "attention.cu")
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    if key not in _FACTS_CACHE:
        text, where = chapter_source(chapter, root), f"{chapter}/attention.cu"
        _FACTS_CACHE[key] = standin_facts(text, where) if is_standin(text) else facts_table(parse(text, where))
    return _FACTS_CACHE[key]


class Facts(Mapping):
    """{name: facts} of every exercise of the chapters under `root`, read from their markers when
    asked: a name's NN says which chapter's source is read."""

    def __init__(self, root=ROOT):
        self.root = root

    def __getitem__(self, name):
        chapter = find_chapter(name, self.root) if re.match(r"\d\d\.\w+$", str(name)) else None
        if not chapter:
            raise KeyError(name)
        return chapter_facts(chapter, self.root)[name]

    def __iter__(self):
        for chapter in chapters(self.root):
            yield from chapter_facts(chapter, self.root)

    def __len__(self):
        return sum(1 for _ in self)


EXERCISES = Facts()  # what the grader, the hand-out and the tests read an exercise's facts from


def check_blocks(blocks, chapter, table=None):
    """Raise MarkerError unless the blocks are well-formed for `chapter` (table: the exercises'
    facts; by default those of the blocks themselves)."""
    table = facts_table(blocks) if table is None else table
    for name, parts in exercise_parts(blocks).items():
        where = f"{chapter}/attention.cu:{parts[0]['start'] + 1}"
        if name[:2] != chapter[:2]:
            raise MarkerError(f"{where}: exercise {name} is in chapter {chapter}: names start with {chapter[:2]}.")
        main = main_part(parts)
        if not main:
            raise MarkerError(f"{where}: exercise {name}: none of its {len(parts)} block(s) has a task "
                              f"(// EXERCISE {name} BEGIN: <the task>)")
        where = f"{chapter}/attention.cu:{main['start'] + 1}"
        info = table.get(name)
        if not info:
            raise MarkerError(f"{where}: exercise {name} has no facts (the lines after its BEGIN line)")
        if info["kind"] == "speed" and all(b["stub"] is None for b in parts):
            raise MarkerError(f"{where}: speed exercise {name} needs STUB lines (its slow, correct code) in one "
                              "of its blocks")
        if info["kind"] == "correctness" and not any(b["indent"] and (b["stub"] is None or todo_in_stub(b))
                                                     for b in parts):
            raise MarkerError(f"{where}: {name}: an EXERCISE_TODO stub needs a block inside a function, without "
                              f"STUB lines (or with STUB lines that hold EXERCISE_TODO(\"{name}\"))")
        if info["kind"] == "speed" and not (info.get("gate") or info.get("ptx_has")):
            raise MarkerError(f"{where}: speed exercise {name} needs a gate or a ptx check in its facts")


def todo_in_stub(block):
    """Whether a block's STUB lines hold its exercise's EXERCISE_TODO (a correctness stub that keeps a
    variable referenced beside it, as 09.ds's does)."""
    return block["stub"] is not None and block["name"] in TODO_CALL.findall("".join(block["stub"]))


def solution_lines(text, block):
    """The lines a block spans in the chapter, its markers (and facts) included."""
    return text.splitlines(keepends=True)[block["start"]:block["end"] + 1]


def wrong_solution(text, name, table=None):
    """The chapter with exercise `name`'s `wrong` substitution made in its blocks' code (the lines
    after BEGIN and its facts): a solution that compiles and is wrong (MarkerError unless `old`
    occurs exactly once there)."""
    blocks = parse(text)
    old, new = (facts_table(blocks) if table is None else table)[name]["wrong"]
    lines = text.splitlines(keepends=True)
    spans = [(b["code_at"], b["end"]) for b in blocks if b["name"] == name]
    hits = [(start, end) for start, end in spans if old in "".join(lines[start:end])]
    count = sum("".join(lines[start:end]).count(old) for start, end in spans)
    if count != 1:
        raise MarkerError(f"{name}: its wrong solution's {old!r} occurs {count} times in its blocks, expected once: "
                          "update its `wrong old:` fact")
    start, end = hits[0]
    lines[start:end] = ["".join(lines[start:end]).replace(old, new)]
    return "".join(lines)



# --- The facts in words --------------------------------------------------------------------------
def shape_text(shape):
    b, h, n, d, causal = shape
    return f"B={b} H={h} N={n} D={d}{' causal' if causal else ''}"


def pass_of(info):
    """The pass an exercise's code is in: its `pass` fact, forward by default."""
    return info.get("pass", "forward")


def timed_as(info):
    """What a speed exercise times: (shape, the harness column, the pass)."""
    return info["shape"], info.get("timed", "ms"), pass_of(info)


def timed_what(column, pass_name="forward"):
    if pass_name == "backward":
        return "backward pass's time"
    return "attention kernel's time" if column == "attend_ms" else "time"


def gate_text(info):
    """"at most 1.10x the chapter's time at B=4 ...": a speed exercise's gate in words."""
    return (f"at most {info['gate']:.2f}x the chapter's {timed_what(*timed_as(info)[1:])} at "
            f"{shape_text(info['shape'])}")


def dims_text(info):
    dims = info.get("dims", HEAD_DIMS)
    return "D " + " and ".join(map(str, dims)) if len(dims) > 1 else f"D = {dims[0]} only"


def grading_text(info):
    """How an exercise is graded, in words (the student copy's 'Graded:' line, make exercise, list)."""
    what = ("your copy's backward pass (--backward) must compute dQ, dK and dV correctly" if pass_of(info) == "backward"
            else "your copy must compute attention correctly")
    matrix = (f"{what} on the GPU matrix ({dims_text(info)}), with no race that compute-sanitizer "
              "racecheck finds")
    if info["kind"] == "correctness":
        return matrix + (f", and its PTX must contain {', '.join(c['shown'] for c in info['ptx_has'])}"
                         if info.get("ptx_has") else "")
    if info.get("gate"):
        return f"{matrix}, and take {gate_text(info)}, the two timed in the same run"
    checks = ", ".join(c["shown"] for c in info["ptx_has"])
    return (f"{matrix}, and the PTX of your build must contain {checks}, which only the overlapped code "
            f"produces; your {timed_what(*timed_as(info)[1:])} at {shape_text(info['shape'])} is shown "
            "beside the chapter's for information (no gate: the gain is close to the run-to-run noise)")


def describe(name, table=EXERCISES):
    info = table[name]
    return f"{info['kind']}: {grading_text(info)}"


def chapter_named(arg, command):
    """(the chapter folder that `arg` names: 4, 04 or 04_fused, None), or (None, the line that says
    there is none, for `command`)."""
    chapter = find_chapter(arg)
    if chapter:
        return chapter, None
    return None, f"{command}: no chapter '{arg}' (e.g. CH=04; chapters: {' '.join(chapters())})"


def exercise_chapters(root=ROOT):
    return " ".join(c[:2] for c in chapters(root)
                    if not is_standin(chapter_source(c, root)) and parse(chapter_source(c, root)))


def cap(text):
    return text[:1].upper() + text[1:]


def words_list(items):
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


