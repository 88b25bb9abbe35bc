"""What each chapter claims to do, checked in the code the compiler made (no GPU needed): every
claim of common/claims.py on every chapter (its PTX from `nvcc -ptx`, its SASS from the build
folder's binary, its spills from the build's ptxas log, its launches from the source), and the
claims of 08's steps: the instructions each step adds, in its build's SASS.

A chapter's claims share its PTX and SASS, made once per worker (repo.once): each chapter's claims
are one xdist group, so that each is made once in all."""
import os
import re

import pytest

import runner
from chapters import read_chapter
from claims import claim_cases, kernel_base_name, nvcc, sass_tools, strip_comments
from helpers import CHAPTERS


def chapter_claims():
    """pytest.params of every claim of every chapter (fn(repo)), grouped by chapter."""
    out = []
    for chapter in CHAPTERS:
        adds = read_chapter(os.path.join(runner.ROOT, chapter, "attention.cu"))["adds"]
        for name, fn in claim_cases(chapter, int(chapter[:2]), adds):
            out.append(pytest.param(fn, id=name.removeprefix("claims[").removesuffix("]"),
                                    marks=pytest.mark.xdist_group(f"claims-{chapter}")))
    return out


@pytest.mark.parametrize("claim", chapter_claims())
def test_chapter_claim(repo, claim):
    claim(repo)


def test_kernel_base_name():
    """The .entry grouping used by the kernel-count claim."""
    examples = {
        "_Z22flash_attention_kernelILi64EEvPK6__halfS2_S2_PS0_Pfifi": "flash_attention_kernel",
        "_Z22flash_attention_kernelILi128EEvPK6__halfS2_S2_PS0_Pfifi": "flash_attention_kernel",
        "_Z13scores_kernelPK6__halfS1_Pfiifi": "scores_kernel",
        "_ZL6kernelv": "kernel",
        "_ZN12_GLOBAL__N_16kernelILi64EEEvPf": "_GLOBAL__N_1::kernel",
        "_ZN2fa6attendEPf": "fa::attend",
        "plain_c_kernel": "plain_c_kernel",
    }
    for mangled, want in examples.items():
        got = kernel_base_name(mangled)
        assert got == want, f"kernel_base_name({mangled!r}) = {got!r}, expected {want!r}"


def test_strip_comments():
    text = 'a<<<1>>>(); // b<<<\n/* c<<< \n cudaMalloc( */ s = "<<<"; char c = \'"\'; d<<<2>>>();'
    stripped = strip_comments(text)
    assert stripped.count("<<<") == 2 and "cudaMalloc" not in stripped, f"strip_comments gave {stripped!r}"


def test_mma_sync_e4m3_is_emulated_on_sm90(repo):
    """Why 08 uses wgmma: mma.sync with e4m3 operands (tests/fixtures/mma_e4m3.cu) is one native
    QMMA on sm_89, but on sm_90 conversions to fp16 (F2FP) plus fp16 HMMAs. Hopper's FP8 rate
    is reached only through wgmma (QGMMA)."""
    cuobjdump, env = sass_tools(repo)
    cubin = repo.tmpdir() / "mma_e4m3.fatbin"  # one compile, both archs; cuobjdump -arch picks each
    proc = repo.run([nvcc(), "-fatbin", "-gencode=arch=compute_89,code=sm_89", "-gencode=arch=compute_90,code=sm_90",
                     "-o", cubin, repo.root / "tests" / "fixtures" / "mma_e4m3.cu"], timeout=300)
    assert proc.returncode == 0, f"nvcc -fatbin for sm_89 and sm_90 failed:\n{proc.stderr}"
    ops = {}
    for arch in ("sm_89", "sm_90"):
        dump = repo.run([cuobjdump, "--dump-sass", "-arch", arch, cubin], env=env, timeout=300)
        assert dump.returncode == 0 and "Function" in dump.stdout, (
            f"cuobjdump -arch {arch} failed on {cubin}:\n{dump.stderr}")
        ops[arch] = re.findall(r"\b(QMMA|HMMA|QGMMA|F2FP)(\.[A-Z0-9_.]*)?", dump.stdout)
    names = {arch: sorted({op for op, _ in found}) for arch, found in ops.items()}
    assert "QMMA" in names["sm_89"] and "HMMA" not in names["sm_89"], (
        f"sm_89: expected a native QMMA, got {names['sm_89']}")
    assert "HMMA" in names["sm_90"] and "QMMA" not in names["sm_90"], (
        f"sm_90: expected HMMA, no QMMA, got {names['sm_90']}")
    unpacks = [op + rest for op, rest in ops["sm_90"] if op == "F2FP" and "E4M3" in rest]
    assert unpacks, f"sm_90: expected F2FP conversions from e4m3, got {ops['sm_90']}"


def sass_kernels(repo, code, arch, base):
    """{mangled name: SASS text} of the kernels whose base name is `base` in `code` (an object or a binary)."""
    cuobjdump, env = sass_tools(repo)
    dump = repo.run([cuobjdump, "--dump-sass", "-arch", arch, code], env=env, timeout=300)
    assert dump.returncode == 0, f"cuobjdump failed on {repo.rel(code)}:\n{dump.stderr}"
    return {text.split()[0]: text for text in re.split(r"Function : ", dump.stdout)[1:]
            if kernel_base_name(text.split()[0]) == base}


def sass_instructions(text):
    """A kernel's instructions in its SASS text, without addresses and encodings."""
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in text.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def build_08(repo, step=None):
    """08 as its build made it: (ptxas report lines, {head dim: SASS text of its attention_kernel}).
    A step (1-5) is the build 08_fp8.stepK, None the chapter, 08_fp8 (its last step, 08.6): the SASS
    of its object, BUILD/obj/<build>.o, linked as it is into BUILD/<build> (the binary's other code,
    the harness's, left out: a third of the time), and its build log, read once per worker."""
    name = f"08_fp8.step{step}" if step else "08_fp8"
    binary = repo.require_binary(name)

    def read():
        log, code = repo.build / f"{name}.log", repo.build / "obj" / f"{name}.o"
        if not log.is_file():
            pytest.skip(f"{repo.rel(log)} missing: the build did not run (make)")
        kernels = {int(re.search(r"ILi(\d+)E", function).group(1)): text for function, text in
                   sass_kernels(repo, code if code.is_file() else binary, "sm_90a", "attention_kernel").items()}
        assert sorted(kernels) == [64, 128], (
            f"step {step or LAST_STEP}: attention_kernel for D = {sorted(kernels)}, expected 64 and 128")
        return log.read_text(errors="replace").splitlines(), kernels
    return repo.once(("08 build", step), read)


def spill_report(lines, dim):
    """ptxas's spill line for attention_kernel<dim> in a -Xptxas -v report."""
    entry = [i for i, l in enumerate(lines) if "Function properties for" in l and f"attention_kernelILi{dim}E" in l]
    assert entry and entry[0] + 1 < len(lines), f"no ptxas report for attention_kernel<{dim}>"
    return lines[entry[0] + 1]


# What each of 08's steps adds, as its attention kernels' SASS shows it: (present, absent) per step.
# 08.1: wgmma on fp16 (HGMMA) fed by TMA (UTMALDG) through mbarriers (SYNCS), one wait per product;
# 08.2: setmaxnreg (USETMAXREG) between the producer and the consumers; 08.3: the ping-pong's named
# barriers (BAR.ARV) and a wait that leaves one wgmma group in flight (P V under the softmax);
# 08.4: e4m3 operands (QGMMA, and P converted to e4m3); 08.5: 192-key tiles at D = 128 and 08.6: S in
# fp16 there (test_fp8_scores_in_fp16).
LAST_STEP = 6  # 08_fp8/attention.cu
FP8_STEP = (["QGMMA", "UTMALDG.3D", "USETMAXREG.TRY_ALLOC", "BAR.ARV", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
             "F2FP.SATFINITE.E4M3"], ["HGMMA", "MUFU.EX2.F16"])
STEP_SASS = {
    1: (["HGMMA.64x128x16.F32", "UTMALDG.3D", "SYNCS.PHASECHK.TRANS64.TRYWAIT"],
        ["QGMMA", "USETMAXREG", "BAR.ARV", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "F2FP.SATFINITE.E4M3"]),
    2: (["HGMMA.64x128x16.F32", "UTMALDG.3D", "USETMAXREG.DEALLOC", "USETMAXREG.TRY_ALLOC"],
        ["QGMMA", "BAR.ARV", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "F2FP.SATFINITE.E4M3"]),
    3: (["HGMMA.64x128x16.F32", "UTMALDG.3D", "USETMAXREG.TRY_ALLOC", "BAR.ARV", "WARPGROUP.DEPBAR.LE gsb0, 0x1"],
        ["QGMMA", "F2FP.SATFINITE.E4M3"]),
    4: FP8_STEP,
    5: FP8_STEP,
}


@pytest.mark.xdist_group("claims-08-steps")
@pytest.mark.parametrize("step", sorted(STEP_SASS), ids=lambda step: f"08.{step}")
def test_fp8_chapter_step(repo, step):
    """Each of 08's step builds (BUILD/08_fp8.step1 ... step5) uses the instructions its step adds and
    none of a later step's, in both attention kernels, and none of them spills."""
    present, absent = STEP_SASS[step]
    lines, kernels = build_08(repo, step)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", "\n".join(lines))
    assert spills and all(s == ("0", "0") for s in spills), f"08.{step}: spills in its build: {spills}"
    for dim, text in kernels.items():
        missing = [op for op in present if op not in text]
        found = [op for op in absent if op in text]
        assert not missing and not found, f"08.{step} attention_kernel<{dim}>: lacks {missing}, has {found}"


# (present, absent) in attention_kernel<D>'s SASS: 08.6, the chapter (S in fp16 at D = 128), 08.5 (fp32 S,
# 192 keys) and 08.4 (fp32 S, 128 keys, as 08.3's tiles).
SCORES_SASS = {
    (6, 128): (["QGMMA.64x256x32.F16.E4M3.E4M3", "MUFU.EX2.F16"], ["QGMMA.64x256x32.F32", "QGMMA.64x192x32"]),
    (6, 64): (["QGMMA.64x128x32.F32.E4M3.E4M3"], ["QGMMA.64x128x32.F16", "MUFU.EX2.F16"]),
    (5, 128): (["QGMMA.64x192x32.F32.E4M3.E4M3"], ["QGMMA.64x256x32", "MUFU.EX2.F16", ".F16.E4M3"]),
    (4, 128): (["QGMMA.64x128x32.F32.E4M3.E4M3"], ["QGMMA.64x192x32", "QGMMA.64x256x32", "MUFU.EX2.F16", ".F16.E4M3"]),
}


@pytest.mark.xdist_group("claims-08-steps")
@pytest.mark.parametrize("step, dim", sorted(SCORES_SASS), ids=[f"08.{s} D={d}" for s, d in sorted(SCORES_SASS)])
def test_fp8_scores_in_fp16(repo, step, dim):
    """08 (its last step, 08.6) at D = 128 keeps S in fp16: Q K^T is a QGMMA with fp16 accumulators
    over 256 keys and the exponentials are MUFU.EX2.F16, about one in five a polynomial on the FMA
    units instead (exp2_fma_h2); D = 64 keeps fp32 scores. Step 08.5 is the fp32-score kernel on
    192-key tiles, 08.4 on 128-key ones. No build spills."""
    present, absent = SCORES_SASS[step, dim]
    lines, kernels = build_08(repo, None if step == LAST_STEP else step)
    shown = f"08.{step} D={dim}"
    report = spill_report(lines, dim)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, f"{shown}: {report}"
    text = kernels[dim]
    missing = [op for op in present if op not in text]
    found = [op for op in absent if op in text]
    assert not missing and not found, f"{shown}: lacks {missing}, has {found}"
    # The split exponentials (fp16 scores only): each polynomial ends in one HMUL2 (by 2^j),
    # which nothing else in the kernel uses, in place of two MUFU.EX2.F16.
    polys, mufu_pairs = text.count("HMUL2"), text.count("MUFU.EX2.F16") / 2
    if step == LAST_STEP and dim == 128:
        share = polys / (polys + mufu_pairs)
        assert 0.1 < share < 0.3, f"{shown}: {polys} exp2 polynomials beside {mufu_pairs:.0f} MUFU pairs"
    else:
        assert polys == 0, f"{shown}: {polys} HMUL2 with fp32 scores"


def backward_kernels_10(repo, name):
    """{(D, deterministic): its instructions} of the backward_kernels of a 10 build (BUILD/obj/<name>.o, else
    the binary), read once per worker."""
    binary = repo.require_binary(name)

    def read():
        code = repo.build / "obj" / f"{name}.o"
        kernels = {}
        for function, text in sass_kernels(repo, code if code.is_file() else binary, "sm_90a",
                                           "backward_kernel").items():
            dim, deterministic = re.search(r"ILi(\d+)ELb([01])E", function).groups()
            kernels[(int(dim), deterministic == "1")] = sass_instructions(text)
        assert len(kernels) == 4, f"{name}: backward_kernel for {sorted(kernels)}, expected D 64 and 128 in both modes"
        return kernels
    return repo.once(("10 sass", name), read)


def before_first_wgmma(instructions):
    """The instructions between a tile's fence (the first WARPGROUP.ARRIVE) and its first HGMMA."""
    fence = next(i for i, op in enumerate(instructions) if op.startswith("WARPGROUP.ARRIVE"))
    return next(i for i, op in enumerate(instructions) if op.startswith("HGMMA")) - fence - 1


@pytest.mark.xdist_group("claims-10")
def test_10_6_issues_a_tiles_first_wgmma_without_the_mask(repo):
    """10.6 (10_backward_hopper.step6) keeps the mask out of the way of a tile's first wgmma, and 10.7
    (10_backward_hopper.step7), 10.8 (.step8), 10.9 (.step9) and 10.10 (10_backward_hopper) as well: at most 32 instructions between the fence and the first HGMMA in each
    backward kernel, where 10.5's non-deterministic kernels had the mask's predicates there (over 300)."""
    for name, check in (("10_backward_hopper.step6", lambda gap, det: gap <= 32),
                        ("10_backward_hopper.step7", lambda gap, det: gap <= 32),
                        ("10_backward_hopper.step8", lambda gap, det: gap <= 32),
                        ("10_backward_hopper.step9", lambda gap, det: gap <= 32),
                        ("10_backward_hopper", lambda gap, det: gap <= 32),
                        ("10_backward_hopper.step5", lambda gap, det: det or gap > 300)):
        for (dim, det), instructions in sorted(backward_kernels_10(repo, name).items()):
            gap = before_first_wgmma(instructions)
            assert check(gap, det), f"{name} D={dim} {'deterministic' if det else 'default'}: {gap} instructions " \
                                    f"between the fence and the first HGMMA"


def opcode(instruction):
    """An instruction's opcode, past its predicate if it has one."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


def memory_ops(instructions, generic):
    """The loads and stores among instructions, shared ones (LDS, STS) or generic ones (LD, ST), by opcode;
    not the strong GPU-scope ones (.STRONG.GPU: the deterministic turn counters that 10.11 reads with
    acquire, in global memory)."""
    found = {}
    for op in map(opcode, instructions):
        if ".STRONG.GPU" in op:
            continue
        if re.fullmatch(r"(LD|ST)(\.\w+)*" if generic else r"(LDS|STS)(\.\w+)*", op):
            found[op] = found.get(op, 0) + 1
    return found


@pytest.mark.xdist_group("claims-10")
def test_10_7_reaches_shared_memory_as_shared(repo):
    """10.7 (10_backward_hopper.step7), its shared memory aligned on the pointer and not on an integer, reads
    LSE and D as LDS.64 and writes dS^T and the dQ stage as STS and STS.128, with no PTX of its own for them,
    and so do 10.8-10.11: no generic load or store is left in their backward kernels, where 10.6's made generic
    ones (LD.E, ST.E)."""
    for name in ("10_backward_hopper.step7", "10_backward_hopper.step8", "10_backward_hopper.step9",
                 "10_backward_hopper.step10", "10_backward_hopper"):
        for (dim, det), instructions in sorted(backward_kernels_10(repo, name).items()):
            shown = f"{name} D={dim} {'deterministic' if det else 'default'}"
            shared = memory_ops(instructions, generic=False)
            assert not memory_ops(instructions, generic=True), f"{shown}: {memory_ops(instructions, generic=True)}"
            assert (shared.get("LDS.64"), shared.get("STS"), shared.get("STS.128")) == (16, 16, 8), f"{shown}: {shared}"
    for (dim, det), instructions in sorted(backward_kernels_10(repo, "10_backward_hopper.step6").items()):
        assert memory_ops(instructions, generic=True), f"10.6 D={dim}: no generic loads or stores; the claim is stale"


def hgmma_gaps(instructions):
    """The instructions between consecutive HGMMAs, sorted."""
    at = [i for i, op in enumerate(instructions) if op.startswith("HGMMA")]
    return sorted(b - a - 1 for a, b in zip(at, at[1:]))


@pytest.mark.xdist_group("claims-10")
def test_10_8_builds_descriptors_by_addition(repo):
    """10.8 (10_backward_hopper.step8) builds each operand's wgmma descriptor once a tile and adds the
    k-step's offset, and 10.9 and 10.10 too: the median gap between consecutive HGMMAs is at
    most 4 instructions in every backward kernel, where 10.7's, building each descriptor afresh, is at
    least 7; and their descriptors stay in the uniform datapath (at most 4 R2UR in the consumers' code)."""
    for name in ("10_backward_hopper.step8", "10_backward_hopper.step9", "10_backward_hopper"):
        for (dim, det), instructions in sorted(backward_kernels_10(repo, name).items()):
            gaps, shown = hgmma_gaps(instructions), f"{name} D={dim} {'deterministic' if det else 'default'}"
            assert gaps[len(gaps) // 2] <= 4, f"{shown}: median gap {gaps[len(gaps) // 2]} between HGMMAs"
            # the consumers' code, before the producer warpgroup gives its registers back (10.10's writer
            # warp, after it, moves its reductions' addresses to uniform registers: R2UR that are no descriptor)
            consumers = instructions[:next(k for k, op in enumerate(instructions) if "USETMAXREG.DEALLOC" in op)]
            r2ur = sum(1 for op in consumers if "R2UR" in op.split()[:2])
            assert r2ur <= 4, f"{shown}: {r2ur} R2UR (descriptors built in vector registers?)"
    for (dim, det), instructions in sorted(backward_kernels_10(repo, "10_backward_hopper.step7").items()):
        gaps = hgmma_gaps(instructions)
        assert gaps[len(gaps) // 2] >= 7, f"10.7 D={dim}: median gap {gaps[len(gaps) // 2]}; the claim is stale"


@pytest.mark.xdist_group("claims-10")
def test_10_10_hands_dq_to_a_writer_warp(repo):
    """10.10 (10_backward_hopper.step10) and 10.11 add dQ from a writer warp of the producer warpgroup: every
    bulk reduction (UBLKRED) comes after that warpgroup gives its registers back (USETMAXREG.DEALLOC), and that
    code uses fewer registers than the 24 it keeps; the consumers' code hands a partial over with bar.arrive
    (BAR.ARV), which 10.9's (10_backward_hopper.step9), whose consumers issue the reductions themselves, does
    not have."""
    for (name, dim, det), instructions in sorted(
            ((name, *key), found) for name in ("10_backward_hopper.step10", "10_backward_hopper")
            for key, found in backward_kernels_10(repo, name).items()):
        shown = f"{name} D={dim} {'deterministic' if det else 'default'}"
        ops = [opcode(i) for i in instructions]
        dealloc = next(k for k, op in enumerate(ops) if op.startswith("USETMAXREG.DEALLOC"))
        consumers, producer = ops[:dealloc], instructions[dealloc:]
        assert not any(op.startswith("UBLKRED") for op in consumers), f"{shown}: a bulk reduction before the DEALLOC"
        assert any(opcode(i).startswith("UBLKRED") for i in producer), f"{shown}: no bulk reduction after the DEALLOC"
        registers = max(int(r) for i in producer for r in re.findall(r"\bR(\d+)\b", i))
        assert registers < 24, f"{shown}: the producer warpgroup's code uses R{registers}, past the 24 it keeps"
        assert any(op.startswith("BAR.ARV") for op in consumers), f"{shown}: no BAR.ARV in the consumers' code"
    for (dim, det), instructions in sorted(backward_kernels_10(repo, "10_backward_hopper.step9").items()):
        assert not any(opcode(i).startswith("BAR.ARV") for i in instructions), f"10.9 D={dim}: BAR.ARV; the claim is stale"


def split_kernels_11(repo, name):
    """{(D, cache element): its opcodes} of the split_kernels of an 11 build's sm_90 SASS, read once per worker."""
    binary = repo.require_binary(name)

    def read():
        kernels = {}
        for function, text in sass_kernels(repo, binary, "sm_90", "split_kernel").items():
            dim, elem = re.search(r"ILi(\d+)E(6__half|13__nv_fp8_e4m3)E", function).groups()
            kernels[(int(dim), "e4m3" if "fp8" in elem else "fp16")] = [opcode(i) for i in sass_instructions(text)]
        assert len(kernels) == 4, f"{name}: split_kernel for {sorted(kernels)}, expected D 64 and 128, both caches"
        return kernels
    return repo.once(("11 sass", name), read)


@pytest.mark.xdist_group("claims-11")
def test_11_11_copies_k_and_v_by_cp_async(repo):
    """11.11 (11_decode.step11) and 11.12 (11_decode) bring K and V into shared memory by cp.async, never
    through registers: each split
    kernel has its copies (LDGSTS, 2 x KEYS_IN_FLIGHT = 8 a step, in the prologue's two steps and the loop's
    one) and no wide global load but the QUERY_CHUNK = 4 rows of Q (LDG.E.128), and no local memory (the
    transpose sum as a template per level, not a loop); 11.10 (11_decode.step10) loads K and V into registers
    (LDG.E.128 or, e4m3, LDG.E.64) and copies nothing."""
    for (name, dim, cache), ops in sorted(((name, *key), found) for name in ("11_decode.step11", "11_decode")
                                          for key, found in split_kernels_11(repo, name).items()):
        shown = f"{name} D={dim} {cache}"
        copies = sum(op.startswith("LDGSTS") for op in ops)
        wide = [op for op in ops if re.fullmatch(r"LDG\.E\.(64|128)(\.\w+)*", op)]
        assert copies == 24, f"{shown}: {copies} LDGSTS, expected 3 steps x 8"
        assert wide == ["LDG.E.128"] * 4, f"{shown}: wide global loads {wide}, expected Q's 4 rows alone"
        assert not [op for op in ops if op.startswith(("LDL", "STL"))], f"{shown}: local memory"
    for (dim, cache), ops in sorted(split_kernels_11(repo, "11_decode.step10").items()):
        wide = [op for op in ops if re.fullmatch(r"LDG\.E\.(64|128)(\.\w+)*", op)]
        assert not any(op.startswith("LDGSTS") for op in ops) and len(wide) == 12, \
            f"11.10 D={dim} {cache}: {len(wide)} wide loads; the claim is stale"
