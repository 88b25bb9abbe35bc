// The problem's shape and the rules a shape must meet, in plain C (no CUDA header): one definition
// for the harness's command line (common/harness.cu) and for the chapters as libraries
// (common/library.h, whose FaShape this is), so that both refuse the same shapes with the same words.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdio.h>

typedef struct {
    int batch;    // B
    int heads;    // H
    int seqlen;   // N (queries = keys: self-attention)
    int headdim;  // D
    int causal;   // 1: query i attends keys j <= i
    float scale;  // softmax scale, 1/sqrt(D) unless given
} AttnShape;

// What is wrong with a shape's dimensions and causal flag, into msg (one line, no chapter name):
// 1, or 0 when nothing is. The command line has already refused B, H, N < 1 in words of its own, so
// its messages are the last four.
static inline int shape_problem(const AttnShape *s, char *msg, size_t len) {
    if (s->batch < 1 || s->heads < 1 || s->seqlen < 1) {
        const char *name = s->batch < 1 ? "B (batch)" : s->heads < 1 ? "H (heads)" : "N (seqlen)";
        snprintf(msg, len, "%s = %d: must be at least 1", name,
                 s->batch < 1   ? s->batch
                 : s->heads < 1 ? s->heads
                                : s->seqlen);
        return 1;
    }
    if (s->causal != 0 && s->causal != 1) {
        snprintf(msg, len, "causal = %d: must be 0 or 1", s->causal);
        return 1;
    }
    if (s->headdim != 64 && s->headdim != 128) {
        snprintf(msg, len, "head dimension %d is not supported: the kernels are written for D = 64 or 128", s->headdim);
        return 1;
    }
    if (s->seqlen > (1 << 22)) {
        snprintf(msg, len, "N = %d: at most 4194304 (2^22) is supported (grid limits)", s->seqlen);
        return 1;
    }
    if ((double)s->batch * s->heads > 65535) {
        snprintf(msg, len, "B*H = %.0f: at most 65535 (batch, head) pairs are supported", (double)s->batch * s->heads);
        return 1;
    }
    if ((double)s->batch * s->heads * s->seqlen * s->headdim >= 2147483648.0) {
        snprintf(msg, len, "B*H*N*D = %.0f elements per tensor: at most 2^31 - 1 are supported",
                 (double)s->batch * s->heads * s->seqlen * s->headdim);
        return 1;
    }
    return 0;
}

// A softmax scale the kernels take: positive and normal (a subnormal one, below ~1.2e-38, loses its
// precision in fp32; no infinity, no NaN).
static inline int scale_is_valid(float scale) { return scale > 0 && isnormal(scale); }

// What is wrong with a shape's scale, into msg: 1, or 0 when nothing is. (The command line says it in
// words of its own, about the text of --scale, and sets 1/sqrt(D) when none is given.)
static inline int scale_problem(float scale, char *msg, size_t len) {
    if (scale_is_valid(scale)) return 0;
    snprintf(msg, len, "scale %g: expected a positive number between 1.2e-38 and 3.4e38 (1/sqrt(D) is the usual one)",
             (double)scale);
    return 1;
}
