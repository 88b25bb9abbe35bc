"""What each chapter claims to do, checked in the code the compiler made (no GPU needed): every
claim of common/claims.py on every chapter, and the claims of 08's steps and variants below.
"""
import re
import unittest

from chapters import read_chapter
from claims import claim_cases, kernel_base_name, nvcc, sass_tools, strip_comments

PARALLEL = 2


def cases(ctx):
    out = []
    for chapter in ctx.chapters:
        adds = read_chapter(str(ctx.root / chapter / "attention.cu"))["adds"]
        out.extend(claim_cases(chapter, ctx.chapter_number(chapter), adds))
    return out


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


def test_mma_sync_e4m3_is_emulated_on_sm90(ctx):
    """Why 08 uses wgmma: mma.sync with e4m3 operands (tests/fixtures/mma_e4m3.cu) is one native
    QMMA on sm_89, but on sm_90 conversions to fp16 (F2FP) plus fp16 HMMAs. Hopper's FP8 rate
    is reached only through wgmma (QGMMA)."""
    cuobjdump, env = sass_tools(ctx)
    ops = {}
    for arch in ("sm_89", "sm_90"):
        cubin = ctx.tmpdir() / f"mma_e4m3_{arch}.cubin"
        proc = ctx.run([nvcc(), "-cubin", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-o", cubin,
                        ctx.root / "tests" / "fixtures" / "mma_e4m3.cu"], timeout=300)
        assert proc.returncode == 0, f"nvcc -cubin for {arch} failed:\n{proc.stderr}"
        dump = ctx.run([cuobjdump, "--dump-sass", cubin], env=env, timeout=300)
        assert dump.returncode == 0, f"cuobjdump failed on {cubin}:\n{dump.stderr}"
        ops[arch] = re.findall(r"\b(QMMA|HMMA|QGMMA|F2FP)(\.[A-Z0-9_.]*)?", dump.stdout)
    names = {arch: sorted({op for op, _ in found}) for arch, found in ops.items()}
    assert "QMMA" in names["sm_89"] and "HMMA" not in names["sm_89"], f"sm_89: expected a native QMMA, got {names['sm_89']}"
    assert "HMMA" in names["sm_90"] and "QMMA" not in names["sm_90"], f"sm_90: expected HMMA, no QMMA, got {names['sm_90']}"
    unpacks = [op + rest for op, rest in ops["sm_90"] if op == "F2FP" and "E4M3" in rest]
    assert unpacks, f"sm_90: expected F2FP conversions from e4m3, got {ops['sm_90']}"
    return (f"sm_89: {names['sm_89']}; sm_90: {len(unpacks)} x {unpacks[0]} + "
            f"{sum(op == 'HMMA' for op, _ in ops['sm_90'])} x HMMA")


def build_08_variant(ctx, flags=(), step=None):
    """08 as a build made it, or compiled for sm_90a with extra -D flags: (ptxas report lines,
    {head dim: SASS text of its attention_kernel}). A step (1-4) is its build, BUILD/08_fp8.stepK,
    and no flags the chapter, BUILD/08_fp8: their binaries and build logs are read, not compiled
    a second time."""
    cuobjdump, env = sass_tools(ctx)
    if flags:
        cubin = ctx.tmpdir() / "08_variant.cubin"
        proc = ctx.run([nvcc(), "-cubin", "-std=c++17", "-O3", "-Xptxas", "-v", *flags,
                        "-gencode=arch=compute_90a,code=sm_90a", "-o", cubin, ctx.root / "08_fp8" / "attention.cu"],
                       timeout=600)
        assert proc.returncode == 0, f"nvcc {' '.join(flags)} failed:\n{proc.stderr}"
        report = proc.stderr
    else:
        cubin = ctx.require_binary(f"08_fp8.step{step}" if step else "08_fp8")
        log = cubin.parent / f"{cubin.name}.log"
        if not log.is_file():
            raise unittest.SkipTest(f"{ctx.rel(log)} missing: the multiarch build did not run")
        report = log.read_text(errors="replace")
    dump = ctx.run([cuobjdump, "--dump-sass", cubin], env=env, timeout=300)
    assert dump.returncode == 0, f"cuobjdump failed on {cubin}:\n{dump.stderr}"
    kernels = {}
    for text in re.split(r"Function : ", dump.stdout)[1:]:
        name = text.split()[0]
        if kernel_base_name(name) == "attention_kernel":
            kernels[int(re.search(r"ILi(\d+)E", name).group(1))] = text
    shown = " ".join(flags) or f"step {step or 5}"
    assert sorted(kernels) == [64, 128], f"{shown}: attention_kernel for D = {sorted(kernels)}, expected 64 and 128"
    return report.splitlines(), kernels


def spill_report(lines, dim):
    """ptxas's spill line for attention_kernel<dim> in a -Xptxas -v report."""
    entry = [i for i, l in enumerate(lines) if "Function properties for" in l and f"attention_kernelILi{dim}E" in l]
    assert entry and entry[0] + 1 < len(lines), f"no ptxas report for attention_kernel<{dim}>"
    return lines[entry[0] + 1]


# What each of 08's steps adds, as its attention kernels' SASS shows it: (present, absent) per step.
# 08.1: wgmma on fp16 (HGMMA) fed by TMA (UTMALDG) through mbarriers (SYNCS), one wait per product;
# 08.2: setmaxnreg (USETMAXREG) between the producer and the consumers; 08.3: the ping-pong's named
# barriers (BAR.ARV) and a wait that leaves one wgmma group in flight (P V under the softmax);
# 08.4: e4m3 operands (QGMMA, and P converted to e4m3); 08.5: S in fp16 (D = 128, below).
STEP_SASS = {
    1: (["HGMMA.64x128x16.F32", "UTMALDG.3D", "SYNCS.PHASECHK.TRANS64.TRYWAIT"],
        ["QGMMA", "USETMAXREG", "BAR.ARV", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "F2FP.SATFINITE.E4M3"]),
    2: (["HGMMA.64x128x16.F32", "UTMALDG.3D", "USETMAXREG.DEALLOC", "USETMAXREG.TRY_ALLOC"],
        ["QGMMA", "BAR.ARV", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "F2FP.SATFINITE.E4M3"]),
    3: (["HGMMA.64x128x16.F32", "UTMALDG.3D", "USETMAXREG.TRY_ALLOC", "BAR.ARV", "WARPGROUP.DEPBAR.LE gsb0, 0x1"],
        ["QGMMA", "F2FP.SATFINITE.E4M3"]),
    4: (["QGMMA", "UTMALDG.3D", "USETMAXREG.TRY_ALLOC", "BAR.ARV", "WARPGROUP.DEPBAR.LE gsb0, 0x1",
         "F2FP.SATFINITE.E4M3"], ["HGMMA", "MUFU.EX2.F16"]),
}


def test_fp8_chapter_steps(ctx):
    """Each of 08's step builds (BUILD/08_fp8.step1 ... step4) uses the instructions its step adds and
    none of a later step's, in both attention kernels, and none of them spills."""
    results = []
    for step, (present, absent) in STEP_SASS.items():
        lines, kernels = build_08_variant(ctx, step=step)
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", "\n".join(lines))
        assert spills and all(s == ("0", "0") for s in spills), f"08.{step}: spills in its build: {spills}"
        for dim, text in kernels.items():
            missing = [op for op in present if op not in text]
            found = [op for op in absent if op in text]
            assert not missing and not found, f"08.{step} attention_kernel<{dim}>: lacks {missing}, has {found}"
        results.append(f"08.{step}: {', '.join(op.split('.')[0] for op in present)}")
    return "; ".join(results)


def test_fp8_scores_in_fp16(ctx):
    """08 (its last step, 08.5) at D = 128 keeps S in fp16: Q K^T is a QGMMA with fp16 accumulators
    over 256 keys and the exponentials are MUFU.EX2.F16, about one in five a polynomial on the FMA
    units instead (SPLIT_EXP2); D = 64 keeps fp32 scores. Step 08.4 is the fp32-score kernel on
    192-key tiles. Neither build spills."""
    want = {1: {128: (["QGMMA.64x256x32.F16.E4M3.E4M3", "MUFU.EX2.F16"], ["QGMMA.64x256x32.F32", "QGMMA.64x192x32"]),
                64: (["QGMMA.64x128x32.F32.E4M3.E4M3"], ["QGMMA.64x128x32.F16", "MUFU.EX2.F16"])},
            0: {128: (["QGMMA.64x192x32.F32.E4M3.E4M3"], ["QGMMA.64x256x32", "MUFU.EX2.F16", ".F16.E4M3"])}}
    results = []
    for half, dims in want.items():
        lines, kernels = build_08_variant(ctx, step=None if half else 4)  # 1: the chapter, 0: step 08.4
        for dim, (present, absent) in dims.items():
            report = spill_report(lines, dim)
            assert "0 bytes spill stores, 0 bytes spill loads" in report, f"fp16 scores {half}, D={dim}: {report}"
            text = kernels[dim]
            missing = [op for op in present if op not in text]
            found = [op for op in absent if op in text]
            assert not missing and not found, f"fp16 scores {half}, D={dim}: lacks {missing}, has {found}"
            results.append(f"{'08.5' if half else '08.4'} D={dim}: {', '.join(present)}")
            # The split exponentials (fp16 scores only): each polynomial ends in one HMUL2 (by 2^j),
            # which nothing else in the kernel uses, in place of two MUFU.EX2.F16.
            polys, mufu_pairs = text.count("HMUL2"), text.count("MUFU.EX2.F16") / 2
            if half and dim == 128:
                share = polys / (polys + mufu_pairs)
                assert 0.1 < share < 0.3, f"D=128: {polys} exp2 polynomials beside {mufu_pairs:.0f} MUFU pairs"
                results.append(f"{share:.0%} of the half2 exponentials on the FMA units")
            else:
                assert polys == 0, f"fp16 scores {half}, D={dim}: {polys} HMUL2 with fp32 scores"
    return "; ".join(results)
