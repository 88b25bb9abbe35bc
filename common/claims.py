"""What each chapter claims to do, checked in the code the compiler made (no GPU needed): the
claims themselves and how they are checked. tests/test_claims.py runs them for every chapter;
common/exercise_grade.py runs them on a student's copy (make grade). Each check takes a runner.Repo: the
checkout whose chapter it checks and the build folder of its binaries.

PTX comes from `nvcc -ptx -arch=compute_90` (compute_90a for 08) on the chapter's
attention.cu; SASS from `cuobjdump --dump-sass -arch sm_90` on its binary (built for sm_90 among others); spills from
the ptxas report in BUILD/NN_name.log; launches and allocations from the source
(comments and strings stripped). cuobjdump and nvdisasm come from common/cuda_tools.py; without
them the SASS claims are skipped with the reason and the rest still run.

CLAIMS below is the whole promise of each chapter, keyed by its number and applied when that
chapter exists. Patterns: PTX ones are regular expressions over the PTX text (comments
stripped); SASS ones are opcodes (the part before the first dot: HMMA matches HMMA.16816.F32 but
not HFMA2.MMA).
"""
import re
import unittest

import cuda_tools

MMA_PTX = r"\bw?mma\."                 # any warp-level matrix instruction (wmma.* or mma.*)
PLAIN_MMA_PTX = r"(?<![\w.])mma\.sync"  # mma.sync itself, not wmma.mma.sync
CLAIMS = {
    1: dict(ptx_lacks=[r"\.shared\b", MMA_PTX], sass_has=["FFMA"], sass_lacks=["HMMA", "LDS", "STS"]),
    2: dict(ptx_has=[r"\bld\.shared", r"\bst\.shared"], ptx_lacks=[MMA_PTX],
            sass_has=["FFMA", "LDS"], sass_lacks=["HMMA"]),
    3: dict(ptx_has=[r"\bld\.shared", r"\bst\.shared"], ptx_lacks=[MMA_PTX],
            sass_has=["FFMA", "LDS"], sass_lacks=["HMMA"], kernel_named="online"),
    4: dict(kernels=1, launches=1, ptx_has=[r"\bld\.shared", r"\bex2\.approx"], ptx_lacks=[MMA_PTX],
            sass_has=["FFMA"], sass_lacks=["HMMA"]),
    5: dict(kernels=1, launches=1, ptx_has=[r"\bld\.shared", r"\bex2\.approx"], ptx_lacks=[MMA_PTX],
            sass_has=["FFMA"], sass_lacks=["HMMA"]),
    6: dict(ptx_has=[r"\bwmma\.mma\.sync"], sass_has=["HMMA"], no_spills=True),
    7: dict(launches=1, ptx_has=[r"\bcp\.async", r"\bldmatrix", PLAIN_MMA_PTX],
            sass_has=["LDGSTS", "LDSM", "HMMA"], no_spills=True),
    8: dict(kernels=2,  # quantize, attention
            ptx_has=[r"\bwgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
                     r"\bcp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes",
                     r"\bmbarrier\.try_wait\.parity", r"\bmbarrier\.arrive\.expect_tx",
                     r"\bcvt\.rn\.satfinite\.e4m3x2\.f32", r"\bwgmma\.fence", r"\bwgmma\.wait_group",
                     r"\bwgmma\.mma_async\.sync\.aligned\.m64n256k32\.f16\.e4m3\.e4m3",  # S in fp16 (D = 128)
                     r"\bex2\.approx\.f16x2", r"\bcvt\.rn\.satfinite\.e4m3x2\.f16x2",
                     r"\bsetmaxnreg\.(inc|dec)\.sync\.aligned", r"\bbar\.arrive\b"],
            ptx_lacks=[PLAIN_MMA_PTX, r"\bwmma\.", r"\bcp\.async\.(ca|cg)\b"],
            sass_lacks=["HMMA", "HGMMA"], no_spills=True,
            sass_kernel_has={"attention_kernel": ["QGMMA", "UTMALDG", "SYNCS", "WARPGROUP", "USETMAXREG"]}),
    9: dict(kernels=5,  # forward, preprocess (D), backward (dK, dV, dQ atomics) and its D=128 split, dQ to fp16
            ptx_has=[PLAIN_MMA_PTX, r"\bcp\.async", r"\bldmatrix", r"\batom\.global\.add\.v4\.f32"],
            sass_has=["HMMA", "LDGSTS", "LDSM", "REDG"], no_spills=True,  # REDG: sm_90's RED (sm_80: RED)
            deterministic_spill_bytes=4,  # the deterministic first kernel: one register of its loop over key tiles
            sass_kernel_has={"flash_attention_backward_kernel": ["HMMA", "LDGSTS", "LDSM", "REDG"],
                             # P^T, dS^T and the dQ tile staged (STS), read back by rows (LDS), added (REDG)
                             "flash_attention_backward_split_kernel": ["HMMA", "LDGSTS", "LDSM", "STS", "LDS",
                                                                       "REDG"]}),
}
PTX_ARCH_OF = {8: "compute_90a"}  # by chapter number; the others: compute_90
EVERY_CHAPTER = dict(source_lacks=[r"\bcuda(Malloc|Free)\w*\s*\("])  # the harness owns device memory
SASS_ARCH = "sm_90"


# --- sources -----------------------------------------------------------------------------------
def strip_comments(source):
    """C source without comments; string and character literals emptied."""
    def replace(match):
        text = match.group(0)
        if text.startswith("/"):
            return " " if text.startswith("/*") else ""
        return text[0] * 2
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', replace, source, flags=re.S)


def source(repo, chapter):
    return strip_comments((repo.root / chapter / "attention.cu").read_text())


# --- PTX -----------------------------------------------------------------------------------------
def nvcc():
    found = cuda_tools.nvcc()
    if not found:
        raise unittest.SkipTest("nvcc not found (PATH, $NVCC, /usr/local/cuda/bin): no PTX claims")
    return found


def ptx(repo, chapter):
    def generate():
        out = repo.tmpdir() / f"{chapter}.ptx"
        arch = PTX_ARCH_OF.get(int(chapter[:2]), "compute_90")
        cmd = [nvcc(), "-ptx", f"-arch={arch}", "-std=c++17", "-o", out, f"{chapter}/attention.cu"]
        proc = repo.run(cmd, timeout=600)
        assert proc.returncode == 0, f"nvcc -ptx failed for {chapter}:\n{proc.stdout}{proc.stderr}"
        return re.sub(r"//[^\n]*", "", out.read_text())
    return repo.once(("ptx", chapter), generate)


def kernel_base_name(mangled):
    """The function-name part of an Itanium-mangled kernel name, template arguments dropped:
    _Z22flash_attention_kernelILi64EEv... -> flash_attention_kernel (extern "C": as is)."""
    match = re.match(r"_Z(L?)(N?)", mangled)
    if not match:
        return mangled
    rest, nested, parts = mangled[match.end():], bool(match.group(2)), []
    while True:
        number = re.match(r"\d+", rest)
        if not number:
            break
        length = int(number.group(0))
        parts.append(rest[number.end():number.end() + length])
        rest = rest[number.end() + length:]
        if not nested or rest[:1] in ("I", "E", ""):
            break
    return "::".join(parts) or mangled


def entries(ptx_text):
    return re.findall(r"^\s*(?:\.visible\s+|\.weak\s+)*\.entry\s+([\w$.]+)", ptx_text, re.M)


# --- SASS ----------------------------------------------------------------------------------------
def sass_tools(repo):
    """(cuobjdump, env) or a skip: what prints SASS here (common/cuda_tools.py finds or fetches it)."""
    tools, why = repo.once("sass_tools", cuda_tools.sass_tools)
    if not tools:
        raise unittest.SkipTest(f"no SASS: {why}")
    return tools


def sass_text(repo, cubin):
    """{function: [instruction text]}: cuobjdump's SASS without addresses and encodings."""
    cuobjdump, env = sass_tools(repo)
    proc = repo.run([cuobjdump, "--dump-sass", cubin], env=env, timeout=300)
    assert proc.returncode == 0, f"cuobjdump failed on {cubin}: {proc.stderr.strip()}"
    functions, current = {}, None
    for line in proc.stdout.splitlines():
        header = re.match(r"\s*Function\s*:\s*(\S+)", line)
        if header:
            current = functions.setdefault(header.group(1), [])
            continue
        instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if instruction and current is not None:
            current.append(re.sub(r"\s+", " ", instruction.group(1)))
    return functions


def sass(repo, chapter):
    """{function name: set of opcodes} of the chapter's code for SASS_ARCH: its object in the build
    (BUILD/obj/NN_name.o, which its binary links unchanged and which is quicker to read), else its
    binary (a student copy's)."""
    binary = repo.require_binary(chapter)
    obj = repo.build / "obj" / f"{chapter}.o"
    binary = obj if obj.is_file() else binary
    cuobjdump, env = sass_tools(repo)

    def dump():
        listing = repo.run([cuobjdump, "--list-elf", binary], env=env, timeout=120).stdout
        if SASS_ARCH not in listing:
            raise unittest.SkipTest(f"{repo.rel(binary)} has no {SASS_ARCH} code (the Makefile's ARCH picked "
                                    f"another GPU), and these claims read {SASS_ARCH} code: build with ARCH=multi")
        proc = repo.run([cuobjdump, "--dump-sass", "-arch", SASS_ARCH, binary], env=env, timeout=600)
        assert proc.returncode == 0, f"cuobjdump --dump-sass failed on {repo.rel(binary)}:\n{proc.stderr}"
        functions, current = {}, None
        for line in proc.stdout.splitlines():
            header = re.match(r"\s*Function\s*:\s*(\S+)", line)
            if header:
                current = functions.setdefault(header.group(1), set())
                continue
            op = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", line)
            if op and current is not None:
                current.add(op.group(1))
        assert functions, f"cuobjdump found no {SASS_ARCH} functions in {repo.rel(binary)}"
        return functions
    return repo.once(("sass", chapter), dump)


# --- ptxas spill report --------------------------------------------------------------------------
def spills(repo, chapter):
    """[(function, arch, spill store bytes)] from the build's log (ptxas -v)."""
    log = repo.binary(chapter).parent / f"{chapter}.log"
    if not log.is_file():
        raise unittest.SkipTest(f"{repo.rel(log)} missing: the build did not run (make)")
    out, arch = [], "?"
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        compiling = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if compiling:
            arch = compiling.group(2)
        props = re.search(r"Function properties for (\S+)", line)
        if props and i + 1 < len(lines):
            stores = re.search(r"(\d+) bytes spill stores", lines[i + 1])
            if stores:
                out.append((props.group(1), arch, int(stores.group(1))))
    return out


def deterministic(function):
    """Whether a mangled kernel name is the deterministic mode's instance: its `bool DETERMINISTIC`
    template argument, the last, true (09's `flash_attention_backward_kernel<64, true>`: ...ILi64ELb1EEv...)."""
    return re.search(r"Lb1EEv", function) is not None


def lines_with(pattern, text):
    """Every whole line of text that matches pattern."""
    return re.findall(r"[^\n]*" + pattern + r"[^\n]*", text)


# --- the cases -----------------------------------------------------------------------------------
def claim_cases(chapter, number, adds):
    claims = dict(CLAIMS.get(number, {}), **EVERY_CHAPTER, adds=adds)  # adds: the chapter's own words
    cases = []

    def add(name, fn):
        cases.append((f"claims[{chapter}: {name}]", fn))

    for pattern in claims.get("ptx_has", []):
        def has(repo, pattern=pattern):
            found = len(re.findall(pattern, ptx(repo, chapter)))
            assert found, f"{chapter} ({claims['adds']}): its PTX has no /{pattern}/, expected some"
            return f"{found} matches"
        add(f"PTX has /{pattern}/", has)
    for pattern in claims.get("ptx_lacks", []):
        def lacks(repo, pattern=pattern):
            hits = lines_with(pattern, ptx(repo, chapter))
            assert not hits, (f"{chapter} ({claims['adds']}): its PTX has /{pattern}/ {len(hits)} times, "
                              f"expected none; e.g. {hits[0].strip()!r}")
        add(f"PTX lacks /{pattern}/", lacks)
    for opcode in claims.get("sass_has", []):
        def sass_has(repo, opcode=opcode):
            functions = sass(repo, chapter)
            holders = sorted(f for f, ops in functions.items() if opcode in ops)
            assert holders, (f"{chapter} ({claims['adds']}): no {opcode} in its {SASS_ARCH} SASS; "
                             f"functions: {sorted(functions)}")
            return f"{opcode} in {holders}"
        add(f"SASS has {opcode}", sass_has)
    for opcode in claims.get("sass_lacks", []):
        def sass_lacks(repo, opcode=opcode):
            holders = sorted(f for f, ops in sass(repo, chapter).items() if opcode in ops)
            assert not holders, f"{chapter} ({claims['adds']}): {opcode} in its {SASS_ARCH} SASS, in {holders}"
        add(f"SASS lacks {opcode}", sass_lacks)
    for kernel, opcodes in claims.get("sass_kernel_has", {}).items():
        def kernel_has(repo, kernel=kernel, opcodes=tuple(opcodes)):
            functions = {f: ops for f, ops in sass(repo, chapter).items() if kernel in kernel_base_name(f)}
            assert functions, f"{chapter}: no {SASS_ARCH} function named *{kernel}*; functions: {sorted(sass(repo, chapter))}"
            for name, ops in sorted(functions.items()):
                missing = [op for op in opcodes if op not in ops]
                assert not missing, f"{chapter} ({claims['adds']}): {name} lacks {missing} in its {SASS_ARCH} SASS"
            return f"{', '.join(opcodes)} in each of {sorted(functions)}"
        add(f"SASS of *{kernel}* has {', '.join(opcodes)}", kernel_has)
    if "kernels" in claims:
        def kernels(repo):
            names = entries(ptx(repo, chapter))
            bases = sorted({kernel_base_name(n) for n in names})
            assert len(bases) == claims["kernels"], (
                f"{chapter}: {len(bases)} kernel functions {bases} (from .entry {names}), "
                f"expected {claims['kernels']}")
            return f"kernels {bases} from {names}"
        add(f"{claims['kernels']} kernel function", kernels)
    if "kernel_named" in claims:
        def named(repo):
            names = entries(ptx(repo, chapter))
            word = claims["kernel_named"]
            assert any(word in kernel_base_name(n) for n in names), (
                f"{chapter}: no kernel whose name contains '{word}'; kernels: "
                f"{[kernel_base_name(n) for n in names]}")
        add(f"a kernel named *{claims['kernel_named']}*", named)
    if "launches" in claims:
        def launches(repo):
            count = source(repo, chapter).count("<<<")
            assert count == claims["launches"], (
                f"{chapter}/attention.cu has {count} '<<<' kernel launches (outside comments), "
                f"expected {claims['launches']}")
        add(f"{claims['launches']} launch in the source", launches)
    for pattern in claims.get("source_lacks", []):
        def source_lacks(repo, pattern=pattern):
            hits = lines_with(pattern, source(repo, chapter))
            assert not hits, (f"{chapter}/attention.cu calls /{pattern}/ (the harness owns device memory): "
                              f"{hits[0].strip()!r}")
        add(f"source lacks /{pattern}/", source_lacks)
    if claims.get("no_spills"):
        allowed = claims.get("deterministic_spill_bytes", 0)

        def no_spills(repo):
            repo.require_binary(chapter)
            report = spills(repo, chapter)
            assert report, f"{chapter}.log: no ptxas 'Function properties' report to read"
            spilling = [f"{f} ({a}): {n} bytes" for f, a, n in report if n > (allowed if deterministic(f) else 0)]
            assert not spilling, f"{chapter}: ptxas spill stores in {spilling}"
            archs = {}
            for function, arch, _ in report:
                archs.setdefault(function, set()).add(arch)
            parsed = [f"{f} ({', '.join(sorted(a))})" for f, a in sorted(archs.items())]
            return f"0 bytes spill stores in {'; '.join(parsed)}"
        add("no register spills (ptxas)" + (f", but for the deterministic mode's {allowed} bytes" if allowed else ""),
            no_spills)
    return cases
