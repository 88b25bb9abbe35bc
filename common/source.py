"""A chapter's source as its default build compiles it: the switches it defaults to 1 or 0 (04's and
07's ablation switches, 09's) and the text with the branches they leave out removed. What `make diff`
shows and what tests read a chapter's constants from. Plain Python, no NumPy."""
import re

SWITCH_IF = re.compile(r"#if\s+(!?)\s*(\w+)\s*(?://.*)?$")


def switches_of(text):
    """{switch: value} for the switches a source defaults to 1 or 0 (`#ifndef NAME` / `#define NAME 1`)."""
    return {name: int(v) for name, v in re.findall(r"#ifndef (\w+)\n#define \1 ([01])\b", text)}


def without_switches(text):
    """The source as its defaults compile it: the branches the switches' values leave out, the
    #if/#else/#endif lines around the ones they keep, and the `// Ablation` comments that introduce
    them, removed (the #ifndef defaults stay: expressions use them). A switch's #if is `#if NAME` or
    `#if !NAME`. An `// Ablation` comment runs to the end of its block of comment lines. What `make
    diff` compares, so that it shows one chapter's idea rather than the other's measuring aids.
    ValueError on #elif in a switch's #if."""
    values, out, stack = switches_of(text), [], []  # stack: (keeping this branch?, a switch #if?, taken?)
    lines = text.splitlines(keepends=True)
    i, dropped = 0, False
    while i < len(lines):
        line, stripped = lines[i], lines[i].strip()
        m = SWITCH_IF.match(stripped)
        keeping = all(keep for keep, _, _ in stack)
        if m and m.group(2) in values:
            keep = bool(values[m.group(2)]) != bool(m.group(1))
            stack.append((keep, True, keep))
        elif stripped.startswith("#if"):  # another condition: kept as it is
            if keeping:
                out.append(line)
            stack.append((True, False, True))
        elif stripped.startswith("#elif") and stack and stack[-1][1]:
            raise ValueError(f"line {i + 1}: #elif in a switch's #if: write it as #else + #if")
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
        if not keeping or (m and m.group(2) in values):
            dropped = True
        i += 1
    return "".join(out)
