"""A chapter's source as one of its builds compiles it: the switches it defaults to 1 or 0 (or that a
step turns on) and the text with the branches they leave out removed. What `make diff` shows
and what tests read a chapter's constants from. Plain Python, no NumPy."""
import re

SWITCH_IF = re.compile(r"#if\s+(!?)\s*(\w+)\s*(?://.*)?$")
STEP_IF = re.compile(r"#if\s+STEP\s*(==|>=)\s*(\d+)\s*(?://.*)?$")


def switches_of(text, step=None):
    """{switch: value} for the switches a source defaults to 1 or 0 (`#ifndef NAME` / `#define NAME 1`)
    and, in a chapter built in steps, those a step turns on (`#define NAME (STEP >= k)`), at `step`
    (None: the default, the last step)."""
    values = {name: int(v) for name, v in re.findall(r"#ifndef (\w+)\n#define \1 ([01])\b", text)}
    steps = re.findall(r"#ifndef (\w+)\n#define \1 \(STEP >= (\d+)\)", text)
    default = re.search(r"#ifndef STEP\n#define STEP (\d+)", text)
    if steps and default:
        at = int(default.group(1)) if step is None else step
        values.update({name: int(at >= int(k)) for name, k in steps})
        values["STEP"] = at
    return values


def without_switches(text, step=None):
    """The source as its defaults compile it (or, for a chapter built in steps, as step `step`
    does): the branches the switches' values leave out, the #if/#else/#endif lines around the ones
    they keep, and the `// Ablation` comments that introduce them, removed (the #ifndef defaults
    stay: expressions use them). A switch's #if is `#if NAME` or `#if !NAME`; a step's, also
    `#if STEP == k` (with an #elif chain) or `#if STEP >= k`. An `// Ablation` comment runs to the
    end of its block of comment lines. What `make diff` compares, so that it shows one chapter's
    (or step's) idea rather than the other's measuring aids. ValueError on #elif in a switch's #if."""
    values, out, stack = switches_of(text, step), [], []  # stack: (keeping this branch?, a switch #if?, taken?)
    lines = text.splitlines(keepends=True)
    i, dropped = 0, False
    while i < len(lines):
        line, stripped = lines[i], lines[i].strip()
        m, s = SWITCH_IF.match(stripped), STEP_IF.match(stripped)
        keeping = all(keep for keep, _, _ in stack)
        if m and m.group(2) in values:
            keep = bool(values[m.group(2)]) != bool(m.group(1))
            stack.append((keep, True, keep))
        elif s and "STEP" in values:
            at, k = values["STEP"], int(s.group(2))
            keep = at == k if s.group(1) == "==" else at >= k
            stack.append((keep, True, keep))
        elif stripped.startswith("#if"):  # another condition: kept as it is
            if keeping:
                out.append(line)
            stack.append((True, False, True))
        elif stripped.startswith("#elif") and stack and stack[-1][1]:
            e = re.match(r"#elif\s+STEP\s*==\s*(\d+)", stripped)
            if not e:
                raise ValueError(f"line {i + 1}: #elif in a switch's #if: write it as #else + #if")
            taken = stack[-1][2]
            keep = not taken and values["STEP"] == int(e.group(1))
            stack[-1] = (keep, True, taken or keep)
        elif stripped.startswith("#else") and stack and stack[-1][1]:
            stack[-1] = (not stack[-1][2], True, True)
        elif stripped.startswith("#endif") and stack:
            _, ours, _ = stack.pop()
            if not ours and all(keep for keep, _, _ in stack):
                out.append(line)
        elif stripped.startswith("// Ablation"):  # and the rest of its comment block
            while i + 1 < len(lines) and lines[i + 1].strip().startswith("//"):
                i += 1
        elif keeping:
            if not (stripped == "" and out and out[-1].strip() == "" and dropped):
                out.append(line)  # a blank line is kept unless a dropped branch left two in a row
            dropped = False
        if not keeping or (m and m.group(2) in values) or s:
            dropped = True
        i += 1
    return "".join(out)
