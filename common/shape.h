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

// --- Decoding: a few new queries per sequence against a paged KV cache ------------------------
// The second problem (docs/design.md; common/reference.py decode_reference): sequence b has Nq new
// queries, the last Nq of its lengths[b] cached tokens, each attending the cache up to itself. The
// cache is a pool of pages of P tokens, [pages][Hkv][P][D] for K and for V, and a block table,
// [B][max_pages], names the page that holds each sequence's tokens P·i .. P·i + P - 1.
#define DECODE_MAX_NEW 16    // Nq: the new tokens of one step (speculative decoding verifies a few)
#define DECODE_MAX_PAGE 256  // P: tokens per page
typedef struct {
    int batch;        // B: sequences
    int q_heads;      // Hq
    int kv_heads;     // Hkv: Hq is a multiple of it (grouped-query attention: g = Hq / Hkv)
    int new_tokens;   // Nq
    int headdim;      // D
    int page_size;    // P
    long long pages;  // pages in the pool (summed over the sequences: wider than an int before it is checked)
    int max_pages;    // block-table entries per sequence: the capacity is max_pages * P tokens
    float scale;      // softmax scale, 1/sqrt(D) unless given
} DecodeShape;

// What is wrong with a decoding shape's dimensions, into msg (one line): 1, or 0 when nothing is.
static inline int decode_shape_problem(const DecodeShape *s, char *msg, size_t len) {
    if (s->batch < 1 || s->q_heads < 1 || s->kv_heads < 1 || s->new_tokens < 1 || s->pages < 1 || s->max_pages < 1) {
        snprintf(msg, len,
                 "B = %d, Hq = %d, Hkv = %d, Nq = %d, pages = %lld, pages per sequence = %d: each must be at "
                 "least 1",
                 s->batch, s->q_heads, s->kv_heads, s->new_tokens, s->pages, s->max_pages);
        return 1;
    }
    if ((double)s->batch * s->q_heads > 65535) {
        snprintf(msg, len, "B*Hq = %.0f: at most 65535 (sequence, query head) pairs are supported",
                 (double)s->batch * s->q_heads);
        return 1;
    }
    if (s->q_heads % s->kv_heads) {
        snprintf(msg, len,
                 "%d query heads over %d KV heads: Hq must be a multiple of Hkv (each KV head serves "
                 "Hq / Hkv query heads)",
                 s->q_heads, s->kv_heads);
        return 1;
    }
    if (s->headdim != 64 && s->headdim != 128) {
        snprintf(msg, len, "head dimension %d is not supported: the kernels are written for D = 64 or 128", s->headdim);
        return 1;
    }
    if (s->new_tokens > DECODE_MAX_NEW) {
        snprintf(msg, len, "Nq = %d new tokens: at most %d are supported", s->new_tokens, DECODE_MAX_NEW);
        return 1;
    }
    if (s->page_size < 1 || s->page_size > DECODE_MAX_PAGE) {
        snprintf(msg, len, "page size %d: expected 1 to %d tokens", s->page_size, DECODE_MAX_PAGE);
        return 1;
    }
    if ((double)(s->max_pages - 1) * s->page_size >= (1 << 22)) {
        snprintf(msg, len,
                 "%d pages of %d tokens a sequence: a sequence of more than 4194304 (2^22) tokens is not "
                 "supported",
                 s->max_pages, s->page_size);
        return 1;
    }
    if ((double)s->pages * s->kv_heads * s->page_size * s->headdim >= 2147483648.0) {
        snprintf(msg, len,
                 "the cache pool (%lld pages of %d x %d x %d) exceeds 2^31 - 1 elements: fewer or shorter "
                 "sequences",
                 s->pages, s->kv_heads, s->page_size, s->headdim);
        return 1;
    }
    return 0;
}

// What is wrong with the cache's lengths ([B]) and block table ([B][max_pages]), into msg: 1, or 0.
// Each length is from Nq to the capacity; the entries a sequence uses (its first ceil(length / P))
// each name a page of the pool; the entries past them are not read. block_table NULL: the lengths only.
static inline int decode_cache_problem(const DecodeShape *s, const int *lengths, const int *block_table, char *msg,
                                       size_t len) {
    const long long capacity = (long long)s->max_pages * s->page_size;
    for (int b = 0; b < s->batch; b++) {
        if (lengths[b] < s->new_tokens) {
            snprintf(msg, len,
                     "sequence %d: cache length %d, shorter than its Nq = %d new tokens (the cache's last Nq)", b,
                     lengths[b], s->new_tokens);
            return 1;
        }
        if (lengths[b] > capacity) {
            snprintf(msg, len, "sequence %d: cache length %d, over the capacity of %lld tokens (%d pages of %d)", b,
                     lengths[b], capacity, s->max_pages, s->page_size);
            return 1;
        }
        const int used = (lengths[b] + s->page_size - 1) / s->page_size;
        for (int i = 0; block_table && i < used; i++) {
            const int page = block_table[(size_t)b * s->max_pages + i];
            if (page < 0 || page >= s->pages) {
                snprintf(msg, len, "sequence %d: block table entry %d names page %d, past the pool of %lld pages", b, i,
                         page, s->pages);
                return 1;
            }
        }
    }
    return 0;
}
