"""08's softmax on fp16 scores (D = 128), modelled in NumPy and checked against float64.

The model follows `softmax_tile` and `recentre_scores` on `unsigned` scores step by step, with
their roundings: the scores and p in float16, the scale rounded to fp16 for the one HFMA2 that
computes the exponent, the offset 8 - max rounded down to fp16 and used as the row's reference,
and, past HALF_MAX_LIMIT, the recentring of the scores in their own units. MUFU.EX2.F16 is
modelled as exp2 rounded to fp16; the chunks whose exponentials run on the FMA units
(`exp2_fma_h2`, one 8-key chunk in EXP2_FMA_PERIOD) follow its half-precision steps, with the
constants and the period read from the kernel's source. Random rows of 1-16 tiles of 256 keys, scores up to fp16's
32768 and scales from 0.001 to 10, some keys masked: logits from ~0 to ~3e5 in log2 units.

This checks the algorithm, not the kernel's code (the GPU suite runs the kernel on logits
~1900 and on a constructed one-hot case near 10^5); a change to either is a change to both.
"""
import re
from pathlib import Path

import numpy as np

F16 = np.float16
P_SCALE_LOG2, HALF_MAX_LIMIT, HALF_SCALE_LIMIT = 8.0, 2000.0, 32768.0
KEYS = 256
SOURCE = Path(__file__).resolve().parent.parent / "08_fp8" / "attention.cu"


def kernel_exp2_fma():
    """exp2_fma_h2's half constants (rounder, floor, then the cubic's c3, c2, c1, c0) and the period
    EXP2_FMA_PERIOD, as the kernel's source has them."""
    text = SOURCE.read_text()
    body = text[text.index("__device__ __half2 exp2_fma_h2"):]
    body = body[:body.index("\n}\n")]
    words = re.findall(r"as_half2\(0x([0-9a-f]{8})u\)", body)
    assert len(words) == 6 and all(w[:4] == w[4:] for w in words), f"exp2_fma_h2's constants: {words}"
    every = int(re.search(r"#define EXP2_FMA_PERIOD (\d+)", text).group(1))
    return [np.array(int(w[4:], 16), np.uint16).view(F16) for w in words], every


EXP2_CONSTANTS, EXP2_FMA_PERIOD = kernel_exp2_fma()


def hfma(a, b, c):
    """One HFMA2 lane: a * b + c rounded once to fp16."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F16)


def exp2_fma_h2(x):
    """exp2_fma_h2, step by step in fp16: 2^x = 2^f (a cubic) times 2^j made in the exponent bits."""
    rounder, floor, c3, c2, c1, c0 = EXP2_CONSTANTS
    x = np.maximum(np.asarray(x, F16), floor)
    shifted = (x + rounder).astype(F16)
    f = (x - (shifted - rounder).astype(F16)).astype(F16)
    p = hfma(hfma(hfma(c3, f, c2), f, c1), f, c0)
    two_to_j = ((shifted.view(np.uint16).astype(np.int64) - 0x65F1) << 10).astype(np.uint16).view(F16)
    return (p.astype(np.float64) * two_to_j.astype(np.float64)).astype(F16)


def on_fma(keys):
    """Whether each key's exponential runs on the FMA units: 8-key chunk c with (c + 1) % period == 0."""
    if EXP2_FMA_PERIOD <= 0:
        return np.zeros(keys, bool)
    return (np.arange(keys) // 8 + 1) % EXP2_FMA_PERIOD == 0


def half_down(x):
    """x rounded to fp16 towards -inf (__float2half_rd)."""
    h = F16(x)
    return h if float(h) <= x else np.nextafter(h, F16(-np.inf))


def recentre_scores(scores, row_max, scale_h):
    """The scores minus a max in their own units; the offset and the reference that go with it."""
    top = float(scores.max())
    tile_leads = top * scale_h >= row_max  # or the row starts here (row_max -inf)
    earlier = min(max(row_max / scale_h, -65504.0), 65504.0)
    max_scores = F16(0.0 if top == -np.inf else top) if tile_leads else half_down(earlier)
    gap = 0.0 if tile_leads else row_max - float(max_scores) * scale_h
    reference = float(max_scores) * scale_h if tile_leads else row_max
    return (scores - max_scores).astype(F16), F16(P_SCALE_LOG2 - gap), reference


def softmax_tile(scores, row_max, row_sum, scale_log2, recentring=True):
    """One tile of one row: its p (2^8 p, fp16), the new row max and sum, the rescale of O."""
    scale = min(scale_log2, HALF_SCALE_LIMIT)
    scale_h = float(F16(scale))
    new_max = max(row_max, float(scores.max()) * scale)
    max_here = 0.0 if new_max == -np.inf else new_max  # an empty row stays empty
    offset = half_down(P_SCALE_LOG2 - max_here)
    reference = P_SCALE_LOG2 - float(offset)
    if recentring and abs(max_here) > HALF_MAX_LIMIT:
        scores, offset, reference = recentre_scores(scores, row_max, scale_h)
    rescale = np.exp2(row_max - reference)
    exponent = (scores.astype(np.float64) * scale_h + float(offset)).astype(F16)  # one HFMA2
    p = np.exp2(exponent.astype(np.float64)).astype(F16)  # MUFU.EX2.F16
    fma = on_fma(len(p))
    p[fma] = exp2_fma_h2(exponent[fma])  # the FMA units' share
    row_max = -np.inf if new_max == -np.inf else reference
    return p, row_max, row_sum * rescale + float(p.astype(np.float64).sum()), rescale


def model_row(scores, scales, v, recentring=True):
    """O and LSE (log2) of one row through the tiles, as the kernel's loop does."""
    row_max, row_sum, o = -np.inf, 0.0, 0.0
    for t in range(scores.shape[0]):
        p, row_max, row_sum, rescale = softmax_tile(scores[t], row_max, row_sum, scales[t], recentring)
        o = o * rescale + p.astype(np.float64) @ v[t * KEYS:(t + 1) * KEYS]
    return o / row_sum, row_max + np.log2(row_sum) - P_SCALE_LOG2


def random_rows(count, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        tiles = int(rng.choice([1, 4, 16]))
        size, scale = float(rng.choice([1, 10, 100, 1000, 20000])), float(rng.choice([0.001, 0.01, 0.1, 1, 5]))
        scores = np.clip(rng.standard_normal((tiles, KEYS)) * size, -32768, 32768).astype(F16)
        if rng.random() < 0.3:
            scores[:, rng.integers(0, KEYS, 20)] = -np.inf  # masked keys
        scales = [scale * rng.uniform(0.5, 2) for _ in range(tiles)]
        yield scores, scales, rng.standard_normal(tiles * KEYS)


def exact_row(scores, scales, v):
    """float64 O and LSE (log2) of the logits the kernel computes: fp16 scores times the fp16 scale."""
    logits = np.concatenate([scores[t].astype(np.float64) * float(F16(min(scales[t], HALF_SCALE_LIMIT)))
                             for t in range(scores.shape[0])])
    m = logits.max()
    p = np.exp2(logits - m)
    return p @ v / p.sum(), m + np.log2(p.sum()), m


def errors(count, recentring):
    """The largest O and LSE errors over random rows, for rows within and past HALF_MAX_LIMIT."""
    worst = {False: [0, 0.0, 0.0], True: [0, 0.0, 0.0]}
    for scores, scales, v in random_rows(count):
        want, want_lse, top = exact_row(scores, scales, v)
        with np.errstate(all="ignore"):
            out, lse = model_row(scores, scales, v, recentring)
        entry = worst[abs(top) > HALF_MAX_LIMIT]
        entry[0] += 1
        entry[1] = max(entry[1], abs(out - want) if np.isfinite(out) else np.inf)
        entry[2] = max(entry[2], abs(lse - want_lse) if np.isfinite(lse) else np.inf)
    return worst


def test_fp16_softmax_matches_float64():
    worst = errors(300, recentring=True)
    small, wide = worst[False], worst[True]
    assert small[0] > 100 and wide[0] > 30, f"too few rows of each kind: {small[0]} and {wide[0]}"
    # Within one HFMA2's reach, the exponent rounds at 2^-11 relative: O to ~1e-3 (v ~ N(0, 1)).
    assert small[1] < 3e-3 and small[2] < 1e-2, f"logits within the limit: O error {small[1]:.3g}, LSE {small[2]:.3g}"
    # Past it, the recentred scores are exact near the max (the tile's own max or the reference).
    assert wide[1] < 1e-5 and wide[2] < 1e-5, f"logits past the limit: O error {wide[1]:.3g}, LSE {wide[2]:.3g}"


def test_without_recentring_wide_rows_fail():
    """The rows past the limit are the ones that need the recentring: without it they lose."""
    wide = errors(300, recentring=False)[True]
    assert wide[1] > 0.1 or not np.isfinite(wide[1]), f"wide rows pass without recentring (O error {wide[1]:.3g})"


def test_exp2_fma_h2_accuracy():
    """The half2 polynomial: within 7e-4 of 2^x over fp16's normal range up to p's 2^8 scale (fp16
    itself rounds at 4.9e-4), exact at the integers (the row's max gives 2^8), exactly 0 from
    -15.5 down (masked keys)."""
    x = np.linspace(-14, 8.49, 200001).astype(F16)
    rel = np.abs(exp2_fma_h2(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 7e-4, f"exp2_fma_h2: relative error {rel.max():.3g}"
    ints = np.arange(-14, 9).astype(F16)
    assert np.array_equal(exp2_fma_h2(ints).astype(np.float64), np.exp2(ints.astype(np.float64))), \
        "not exact at integers"
    low = np.array([-15.5, -16, -100, -60000, -np.inf], F16)
    assert not exp2_fma_h2(low).any(), f"exp2_fma_h2 of {low}: {exp2_fma_h2(low)}"
    share = on_fma(KEYS).mean()
    assert 0 < share < 0.5, f"one 8-key chunk in {EXP2_FMA_PERIOD} on the FMA units: {share:.3f} of the keys"
