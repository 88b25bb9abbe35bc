// The harness shared by every chapter: CLI, inputs, the check against the NumPy float64
// reference, CUDA-event timing and the report (docs/design.md states the contract).
// A reader may skip this file: the chapters' ideas live in their attention.cu.
#define HARNESS_SOURCE  // harness.h: the exercise stub's variable and reader belong to the chapter
#include "harness.h"
#include "gpu_files.h"
#include "kv_cache_e4m3.h"
#include "npy.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

enum { EXIT_PASS = 0, EXIT_FAILED = 1, EXIT_USAGE = 2, EXIT_SKIP = 77 };

// In an --input folder or the cache: Q, K, V, and dO too with --backward (input_count).
static const char *const INPUT_NAMES[4] = {"q.npy", "k.npy", "v.npy", "do.npy"};
// What --output DIR gets, all of it: O and LSE, and dQ, dK, dV too with --backward (output_count).
static const char *const OUTPUT_NAMES[5] = {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"};
static const char *const GRAD_NAMES[3] = {"dQ", "dK", "dV"};  // as the report names OUTPUT_NAMES[2 ..]
// Decoding's inputs (reference.py decode writes them; --decode --input DIR reads them from DIR): the
// queries, the paged cache and its block table and lengths.
static const char *const DECODE_INPUTS[5] = {"q.npy", "k_pool.npy", "v_pool.npy", "block_table.npy", "lengths.npy"};

#ifndef FA_ROOT
#define FA_ROOT "."
#endif
#ifndef FA_PYTHON
#define FA_PYTHON "python3"
#endif

// ---------------------------------------------------------------------------
// Tolerances, by the chapter's internal precision
// ---------------------------------------------------------------------------

// A chapter passes when rel L2 of O <= floor_factor * floor + rel_l2_tol and the LSE max abs
// error <= floor_factor * lse_floor + lse_tol. The floors are 0 except for FP8, where they are
// the error that quantising the inputs to e4m3 alone causes (common/reference.py computes
// them): no FP8 kernel can beat that, so its tolerance is relative to it. The slack is what an
// fp16 tensor-core chapter may lose on top (fp16 output rounding, fp32 accumulation order).
typedef struct {
    const char *math;   // how the chapter computes, for the report
    const char *dtype;  // the CSV's dtype column: the tensor cores' operand type
    double rel_l2_tol, lse_tol;
    double floor_factor;  // 0: no input-quantisation floor
    double randn_cap;     // on the generated N(0, 1) inputs at the default scale, rel L2 at most this (0: none)
} PrecisionRule;

static const PrecisionRule FP32_RULE = {"fp32 CUDA cores", "fp16", 1e-3, 1e-3, 0, 0};
static const PrecisionRule FP16_TC_RULE = {"fp16 tensor cores", "fp16", 3e-3, 1e-3, 0, 0};
// cuDNN's FP8 attention measures 5.9e-2 on N(0, 1) inputs at D=128, the e4m3 input floor
// 4.7e-2: hence 6e-2 as the cap there, and 1.5x the floor elsewhere.
static const PrecisionRule FP8_TC_RULE = {"fp8 (e4m3) tensor cores", "fp8", 3e-3, 1e-3, 1.5, 6e-2};
// The backward pass (--backward): each of dQ, dK and dV passes at a rel L2 error of at most this, whatever
// the precision of the chapter's forward (which is checked by its rule above). Set for fp16 tensor-core
// backward chapters: fp16 in and out, fp32 accumulation (PyTorch's FlashAttention-2 backward measures
// about 3e-4 on N(0, 1) inputs).
static const double BACKWARD_REL_L2_TOL = 1e-3;
// The floor's rows per scale of Q and of K and V at a head dim: the chapter's, else 128 each.
static int fp8_scale_rows(int headdim, int which) {
    return chapter.fp8 ? chapter.fp8->scale_rows(headdim, which) : 128;
}
static int fp8_qk_range(int headdim) { return chapter.fp8 ? chapter.fp8->qk_range(headdim) : 448; }

static const PrecisionRule *precision_rule(Precision precision) {
    switch (precision) {  // no default: the compiler names a Precision left without a rule
    case PRECISION_FP32: return &FP32_RULE;
    case PRECISION_FP16_TC: return &FP16_TC_RULE;
    case PRECISION_FP8_TC: return &FP8_TC_RULE;
    }
    fprintf(stderr, "%s: unknown precision %d\n", chapter.name, (int)precision);
    exit(1);
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

static void die(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", chapter.name);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(code);
}

// `text` as a message shows it: one line, control characters and the like escaped C-style
// (npy_printable). Anything a message echoes that came from outside (a flag or its value, a path,
// an environment variable) goes through it; up to 8 in one message.
static const char *shown(const char *text) {
    static char buffers[8][4 * 4096 + 8];
    static unsigned next;
    char *out = buffers[next++ % 8];
    return npy_printable(text, out, sizeof buffers[0]);
}

#define CUDA_CHECK(call)                                                                                           \
    do {                                                                                                           \
        cudaError_t err_ = (call);                                                                                 \
        if (err_ != cudaSuccess)                                                                                   \
            die(EXIT_FAILED, "CUDA error in %s (%s:%d): %s", #call, __FILE__, __LINE__, cudaGetErrorString(err_)); \
    } while (0)

// ---------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------

// Decoding's inputs in host memory (the lengths: Options.lengths).
typedef struct {
    __half *q, *k_pool, *v_pool;  // [B][Hq][Nq][D]; [pages][Hkv][P][D] each
    int *table;                   // [B][max_pages]
} DecodeHost;

typedef struct {
    AttnShape shape;
    int shape_given[4];  // --batch/--heads/--seqlen/--headdim given explicitly
    int scale_given;
    unsigned long long seed;
    int warmup, iters;
    int check, csv, dry_run;
    int backward;       // --backward: the chapter's backward pass is what is checked and timed
    int deterministic;  // --deterministic: that backward in its deterministic mode (BackwardArgs.deterministic)
    int flush_l2;       // --flush-l2: L2 emptied of the inputs before each timed run and part
    const char *input_dir, *output_dir;
    int decode;               // --decode: the decoding problem (DecodeShape) instead
    const char *decode_flag;  // the first decoding option given (--kv-heads, --new, --cache-len, --page-size,
                              // --kv-cache)
    int kv_heads, new_tokens, page_size;  // 0: not given
    int kv_e4m3;                          // --kv-cache e4m3: the cache as e4m3 codes and a scale per KV head
    const char *cache_len;                // --cache-len: one length, or B of them comma-separated
    DecodeShape dshape;                   // --decode: the shape, checked (check_decode)
    int *lengths;                         // and its sequences' cache lengths [B]
    DecodeHost host;                      // --decode --input: the folder's arrays, read and checked
} Options;

// How many of INPUT_NAMES and of OUTPUT_NAMES a run reads and writes.
static int input_count(const Options *o) { return o->backward ? 4 : 3; }
static int output_count(const Options *o) { return o->backward ? 5 : 2; }

static void print_help(void) {
    printf(
        "usage: %s [options]\n"
        "  %s\n\n"
        "Runs one attention forward on fp16 Q, K, V [B, H, N, D] (or with --backward, its\n"
        "backward pass), checks it against the NumPy float64 reference and times it with\n"
        "CUDA events.\n\n"
        "  --batch B       batch size (default 8)\n"
        "  --heads H       heads (default 16)\n"
        "  --seqlen N      sequence length, queries = keys (default 2048)\n"
        "  --headdim D     head dimension: 64 or 128 (default 128)\n"
        "  --causal        query i attends keys j <= i\n"
        "  --scale F       softmax scale (default 1/sqrt(D))\n"
        "  --seed S        seed of the generated inputs (default 0)\n"
        "  --warmup W      untimed runs before timing (default 2)\n"
        "  --iters K       timed runs; the median is reported (default 10)\n"
        "  --no-check      skip the reference check (inputs are still NumPy's)\n"
        "  --input DIR     read DIR/q.npy k.npy v.npy (fp16, [B,H,N,D]); shape from the files\n"
        "                  (with --decode: the decoding inputs, see below)\n"
        "  --output DIR    write DIR/o.npy (fp16) and DIR/lse.npy (fp32)\n"
        "  --backward      the backward pass instead (chapters that register one):\n"
        "                  the chapter's forward makes O and LSE (checked, not timed), then\n"
        "                  dQ, dK, dV from dO (N(0,1), seeded; --input: DIR/do.npy, fp16 as q)\n"
        "                  are checked (rel L2 of each <= 1e-3) and timed alone, TFLOP/s at\n"
        "                  2.5x the forward's FLOPs; --output also writes dq.npy dk.npy dv.npy\n"
        "  --deterministic with --backward: the backward in its deterministic mode, dQ, dK, dV\n"
        "                  bitwise the same on every run (its --csv row's impl: %s.deterministic)\n"
        "  --csv           print one CSV row instead of the report:\n"
        "                  impl,batch,heads,seqlen,headdim,causal,dtype,ms,tflops,rel_l2,status,\n"
        "                  max_abs,lse_err,kernels,workspace_bytes,prepare_ms,attend_ms,rel_l2_floor,\n"
        "                  device_bytes,dq_rel_l2,dk_rel_l2,dv_rel_l2 (prepare_ms, attend_ms,\n"
        "                  rel_l2_floor only for chapters that prepare their inputs / FP8;\n"
        "                  device_bytes: what the harness allocated; with --backward: ms, kernels\n"
        "                  and workspace_bytes are the backward's, rel_l2 and max_abs the largest\n"
        "                  of dQ's, dK's and dV's, dq/dk/dv_rel_l2 each one's, lse_err empty)\n"
        "  --dry-run       validate, print the plan (FLOPs, memory), touch no GPU\n"
        "  --flush-l2      before each timed run, and between a preparing chapter's two parts,\n"
        "                  write a buffer of twice the L2's size (untimed): no timed part finds\n"
        "                  what ran before it in L2\n"
        "  --decode        the decoding problem instead: Nq new queries per sequence against a\n"
        "                  paged KV cache (chapters that register a decode pass), shaped by\n"
        "                  --batch, --heads (query heads), --headdim and:\n"
        "  --kv-heads G    KV heads, dividing --heads (default: as many as --heads)\n"
        "  --new Q         new tokens per sequence, the cache's last Q (default 1, at most 16)\n"
        "  --cache-len L   tokens cached per sequence, new ones included, 1 to 4194304: one L\n"
        "                  for all, or B of them comma-separated (default 4096)\n"
        "  --page-size P   tokens per page of the cache, 1 to 256 (default 16); with --decode the\n"
        "                  report gives GB/s of K and V read, and --csv's row is impl,batch,\n"
        "                  q_heads,kv_heads,new,max_length,page_size,headdim,ms,gbps,rel_l2,\n"
        "                  status,max_abs,lse_err,kernels,workspace_bytes,device_bytes,\n"
        "                  cache_rel_l2 (--kv-cache e4m3's O against the fp16 cache's reference)\n"
        "  --kv-cache C    with --decode: the cache's K and V as fp16 (default) or e4m3, one byte\n"
        "                  an element and a scale per KV head (max |x| of the head / 448), quantised\n"
        "                  from the fp16 cache by the harness (chapters whose decode pass reads it,\n"
        "                  sm_89 on); checked against the float64 reference of the quantised cache,\n"
        "                  O's rel L2 against the fp16 cache's reference reported beside; GB/s\n"
        "                  count one byte an element; --csv's impl: %s.e4m3\n"
        "  --decode --input DIR\n"
        "                  decoding inputs of one's own, the shape and all from DIR (a shape\n"
        "                  option given too must agree): q.npy [B,Hq,Nq,D] and k_pool.npy,\n"
        "                  v_pool.npy [pages,Hkv,P,D] (fp16), block_table.npy [B,max_pages] and\n"
        "                  lengths.npy [B] (int32 or int64), as common/reference.py decode\n"
        "                  writes them; checked against its float64 reference of DIR (cached)\n"
        "  --help          this text\n\n"
        "exit codes: 0 ran (and passed), 1 failed the check or a CUDA error,\n"
        "            2 bad usage or input, 77 skipped (no GPU, or a GPU this chapter cannot use)\n"
        "environment: FA_PYTHON (Python with NumPy), FA_CACHE (input/reference cache folder)\n",
        chapter.name, chapter.adds, chapter.name, chapter.name);
}

// One rule for every number on the command line: decimal digits after an optional '-' (a value out
// of the flag's range, negative ones included, is then refused as such), and for --scale an optional
// fraction and exponent as well (0.125, .5, 2., 1e-3, 1.5E+2). Nothing else: no spaces, no '+' in
// front, no hex, no inf or nan.
static int is_decimal(const char *text, int fraction_and_exponent) {
    const char *c = text + (*text == '-');
    size_t digits = 0;
    for (; *c >= '0' && *c <= '9'; c++) digits++;
    if (fraction_and_exponent && *c == '.')
        for (c++; *c >= '0' && *c <= '9'; c++) digits++;
    if (!digits) return 0;
    if (fraction_and_exponent && (*c == 'e' || *c == 'E')) {
        c += c[1] == '+' || c[1] == '-' ? 2 : 1;
        if (!(*c >= '0' && *c <= '9')) return 0;
        while (*c >= '0' && *c <= '9') c++;
    }
    return *c == 0;
}

static long long parse_int(const char *flag, const char *text, long long lo, long long hi) {
    if (!is_decimal(text, 0))
        die(EXIT_USAGE, "%s expects a whole number in decimal digits, got '%s'", flag, shown(text));
    errno = 0;
    long long v = strtoll(text, NULL, 10);  // ERANGE: beyond any range a flag has
    if (errno || v < lo || v > hi)
        die(EXIT_USAGE, "%s must be between %lld and %lld (got %s)", flag, lo, hi, shown(text));
    return v;
}

static float parse_scale(const char *text) {
    if (!is_decimal(text, 1))
        die(EXIT_USAGE,
            "--scale expects a decimal number such as 0.125 or 1e-3 (no spaces, no '+' in front, no hex, "
            "inf or nan), got '%s'",
            shown(text));
    float v = strtof(text, NULL);
    // Positive and normal (common/shape.h): a subnormal scale (below ~1.2e-38) loses its precision in fp32.
    if (!scale_is_valid(v))
        die(EXIT_USAGE, "--scale expects a positive number between 1.2e-38 and 3.4e38, got '%s'", shown(text));
    return v;
}

// --kv-cache: fp16 (0) or e4m3 (1).
static int parse_kv_cache(const char *text) {
    if (strcmp(text, "fp16") && strcmp(text, "e4m3"))
        die(EXIT_USAGE, "--kv-cache expects fp16 or e4m3, got '%s'", shown(text));
    return !strcmp(text, "e4m3");
}

static Options parse_args(int argc, char **argv) {
    Options o;
    memset(&o, 0, sizeof o);
    o.shape.batch = 8;
    o.shape.heads = 16;
    o.shape.seqlen = 2048;
    o.shape.headdim = 128;
    o.warmup = 2;
    o.iters = 10;
    o.check = 1;
    static const char *const with_value[] = {"--batch",    "--heads",  "--seqlen",    "--headdim",   "--scale",
                                             "--seed",     "--warmup", "--iters",     "--input",     "--output",
                                             "--kv-heads", "--new",    "--cache-len", "--page-size", "--kv-cache"};
    static const char *const switches[] = {"--causal",        "--no-check", "--csv",      "--dry-run", "--backward",
                                           "--deterministic", "--decode",   "--flush-l2", "--help"};
    static const char *const decode_flags[] = {"--kv-heads", "--new", "--cache-len", "--page-size", "--kv-cache"};
    for (int i = 1; i < argc; i++) {
        char flag[64];
        const char *arg = strcmp(argv[i], "-h") == 0 ? "--help" : argv[i], *value = NULL, *eq = strchr(arg, '=');
        if (strncmp(arg, "--", 2) != 0) die(EXIT_USAGE, "unexpected argument '%s' (see --help)", shown(arg));
        size_t flag_len = eq ? (size_t)(eq - arg) : strlen(arg);
        if (flag_len >= sizeof flag) die(EXIT_USAGE, "unknown option '%s' (see --help)", shown(arg));
        memcpy(flag, arg, flag_len);
        flag[flag_len] = 0;
        int takes_value = 0, known = 0;
        for (size_t k = 0; k < sizeof with_value / sizeof *with_value; k++)
            takes_value |= strcmp(flag, with_value[k]) == 0;
        for (size_t k = 0; k < sizeof switches / sizeof *switches; k++) known |= strcmp(flag, switches[k]) == 0;
        if (!takes_value && !known) die(EXIT_USAGE, "unknown option '%s' (see --help)", shown(flag));
        if (takes_value) {
            if (eq) value = eq + 1;
            else if (i + 1 < argc) value = argv[++i];
            else die(EXIT_USAGE, "%s needs a value (see --help)", flag);
            if (!*value) die(EXIT_USAGE, "%s needs a value, got an empty one (see --help)", flag);
        } else if (eq) {
            die(EXIT_USAGE, "%s takes no value (see --help)", flag);
        }
        const long long MAX_INT = 2147483647;
        if (!strcmp(flag, "--batch")) o.shape.batch = (int)parse_int(flag, value, 1, MAX_INT), o.shape_given[0] = 1;
        else if (!strcmp(flag, "--heads"))
            o.shape.heads = (int)parse_int(flag, value, 1, MAX_INT), o.shape_given[1] = 1;
        else if (!strcmp(flag, "--seqlen"))
            o.shape.seqlen = (int)parse_int(flag, value, 1, MAX_INT), o.shape_given[2] = 1;
        else if (!strcmp(flag, "--headdim"))
            o.shape.headdim = (int)parse_int(flag, value, 1, MAX_INT), o.shape_given[3] = 1;
        else if (!strcmp(flag, "--seed")) o.seed = (unsigned long long)parse_int(flag, value, 0, 4294967295LL);
        else if (!strcmp(flag, "--warmup")) o.warmup = (int)parse_int(flag, value, 0, 100000);
        else if (!strcmp(flag, "--iters")) o.iters = (int)parse_int(flag, value, 1, 100000);
        else if (!strcmp(flag, "--input")) o.input_dir = value;
        else if (!strcmp(flag, "--output")) o.output_dir = value;
        else if (!strcmp(flag, "--scale")) o.shape.scale = parse_scale(value), o.scale_given = 1;
        else if (!strcmp(flag, "--causal")) o.shape.causal = 1;
        else if (!strcmp(flag, "--no-check")) o.check = 0;
        else if (!strcmp(flag, "--csv")) o.csv = 1;
        else if (!strcmp(flag, "--dry-run")) o.dry_run = 1;
        else if (!strcmp(flag, "--backward")) o.backward = 1;
        else if (!strcmp(flag, "--deterministic")) o.deterministic = 1;
        else if (!strcmp(flag, "--decode")) o.decode = 1;
        else if (!strcmp(flag, "--flush-l2")) o.flush_l2 = 1;
        else if (!strcmp(flag, "--kv-heads")) o.kv_heads = (int)parse_int(flag, value, 1, MAX_INT);
        else if (!strcmp(flag, "--new")) o.new_tokens = (int)parse_int(flag, value, 1, DECODE_MAX_NEW);
        else if (!strcmp(flag, "--page-size")) o.page_size = (int)parse_int(flag, value, 1, DECODE_MAX_PAGE);
        else if (!strcmp(flag, "--cache-len")) o.cache_len = value;
        else if (!strcmp(flag, "--kv-cache")) o.kv_e4m3 = parse_kv_cache(value);
        else if (!strcmp(flag, "--help")) print_help(), exit(EXIT_PASS);
        for (size_t k = 0; k < sizeof decode_flags / sizeof *decode_flags; k++)  // the first decoding option given
            if (!o.decode_flag && !strcmp(flag, decode_flags[k])) o.decode_flag = decode_flags[k];
    }
    return o;
}

// ---------------------------------------------------------------------------
// Shapes and sizes
// ---------------------------------------------------------------------------

static size_t elems_qkv(const AttnShape *s) { return (size_t)s->batch * s->heads * s->seqlen * s->headdim; }
static size_t elems_lse(const AttnShape *s) { return (size_t)s->batch * s->heads * s->seqlen; }

// Forward FLOPs, the FlashAttention papers' convention: 4·B·H·N²·D, halved when causal.
static double forward_flops(const AttnShape *s) {
    double f = 4.0 * s->batch * s->heads * (double)s->seqlen * s->seqlen * s->headdim;
    return s->causal ? f / 2 : f;
}

// Bytes any forward must move: read Q, K, V once, write O and LSE once.
static double min_bytes(const AttnShape *s) {
    return 4.0 * elems_qkv(s) * sizeof(__half) + (double)elems_lse(s) * sizeof(float);
}

// Backward FLOPs, the same papers' convention: 2.5x the forward's (five N x N x D products, not two).
static double backward_flops(const AttnShape *s) { return 2.5 * forward_flops(s); }

// Bytes any backward must move, and the tensors the harness holds for it: read Q, K, V, O, dO and
// LSE once, write dQ, dK, dV once.
static double backward_bytes(const AttnShape *s) {
    return 8.0 * elems_qkv(s) * sizeof(__half) + (double)elems_lse(s) * sizeof(float);
}

static const char *human_bytes(double bytes, char *buf, size_t len) {
    const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (bytes >= 1024 && u < 4) bytes /= 1024, u++;
    snprintf(buf, len, u ? "%.1f %s" : "%.0f %s", bytes, unit[u]);
    return buf;
}

// The shape rules (common/shape.h), which the chapters as libraries (common/library.cu) apply too.
static void validate_shape(const AttnShape *s) {
    char problem[256];
    if (shape_problem(s, problem, sizeof problem)) die(EXIT_USAGE, "%s", problem);
}

// ---------------------------------------------------------------------------
// Decoding (--decode): its shape from the command line, checked before any GPU work
// ---------------------------------------------------------------------------

// --cache-len: one length for every sequence, or one per sequence (B of them), comma-separated.
static int *parse_cache_lengths(const char *text, int batch) {
    int *lengths = (int *)calloc(batch, sizeof *lengths);
    if (!lengths) die(EXIT_FAILED, "out of host memory");
    const char *at = text ? text : "4096";
    int count = 0;
    for (;;) {
        const char *comma = strchr(at, ',');
        size_t n = comma ? (size_t)(comma - at) : strlen(at);
        if (n == 0) die(EXIT_USAGE, "--cache-len expects one length or B comma-separated ones, got '%s'", shown(text));
        if (count == batch) die(EXIT_USAGE, "--cache-len gives more than B = %d lengths: '%s'", batch, shown(text));
        char *item = strndup(at, n);
        if (!item) die(EXIT_FAILED, "out of host memory");
        lengths[count++] = (int)parse_int("--cache-len", item, 1, 1 << 22);
        free(item);
        if (!comma) break;
        at = comma + 1;
    }
    if (count == 1)
        for (int b = 1; b < batch; b++) lengths[b] = lengths[0];
    else if (count != batch)
        die(EXIT_USAGE, "--cache-len gives %d lengths for B = %d sequences: give one, or one per sequence", count,
            batch);
    return lengths;
}

// The decoding shape of the command line (--batch, --heads, --kv-heads, --new, --headdim, --page-size,
// --cache-len), checked by the decoding shape's rules (common/shape.h); each sequence its own pages.
static void decode_shape_from_flags(Options *o) {
    DecodeShape d = {o->shape.batch,
                     o->shape.heads,
                     o->kv_heads ? o->kv_heads : o->shape.heads,
                     o->new_tokens ? o->new_tokens : 1,
                     o->shape.headdim,
                     o->page_size ? o->page_size : 16,
                     1,
                     1,
                     o->scale_given ? o->shape.scale : 1.0f / sqrtf((float)o->shape.headdim)};
    char problem[256];  // the dimensions first (one page a sequence for now): B is bounded before its lengths
    if (decode_shape_problem(&d, problem, sizeof problem)) die(EXIT_USAGE, "%s", problem);
    int *lengths = parse_cache_lengths(o->cache_len, d.batch);
    d.pages = d.max_pages = 0;
    for (int b = 0; b < d.batch; b++) {  // each sequence its own pages; the capacity the longest one's
        const int used = (lengths[b] + d.page_size - 1) / d.page_size;
        d.pages += used;
        if (used > d.max_pages) d.max_pages = used;
    }
    if (decode_shape_problem(&d, problem, sizeof problem) ||
        decode_cache_problem(&d, lengths, NULL, problem, sizeof problem))
        die(EXIT_USAGE, "%s", problem);
    o->dshape = d;
    o->lengths = lengths;
}

static void decode_shape_from_input(Options *o);
static void read_decode_input(Options *o);

// The options that go with --decode and the decoding shape's rules (common/shape.h), its shape from the
// command line or from --input DIR's files; then a chapter without a decode pass refuses it. Said before
// anything about outputs or the GPU; an --input folder's queries and pools are read last, checked too.
static void check_decode(Options *o) {
    if (!o->decode) {
        if (o->decode_flag) die(EXIT_USAGE, "%s is an option of decoding: add --decode, or drop it", o->decode_flag);
        return;
    }
    const char *forward_only = o->shape_given[2] ? "--seqlen"
                               : o->shape.causal ? "--causal"
                               : o->backward     ? "--backward"
                               : o->output_dir   ? "--output"
                                                 : NULL;
    if (forward_only)
        die(EXIT_USAGE,
            "%s belongs to the forward problem, not to decoding (--decode): the cache is --cache-len, the new "
            "tokens --new (causal among themselves)",
            forward_only);
    if (o->input_dir) decode_shape_from_input(o);
    else decode_shape_from_flags(o);
    if (!chapter.decode)
        die(EXIT_USAGE,
            "this chapter has no decode pass (--decode): drop it, or run it on a chapter that registers one");
    if (o->kv_e4m3 && !chapter.decode->e4m3_cache)
        die(EXIT_USAGE,
            "this decode pass reads an fp16 cache only (--kv-cache e4m3): drop it, or run 11_decode (11.5 on)");
    if (o->input_dir) read_decode_input(o);
}

// ---------------------------------------------------------------------------
// Inputs: generated by common/reference.py (cached) or read from --input DIR
// ---------------------------------------------------------------------------

// snprintf that refuses to truncate a path.
static void format_path(char *out, size_t len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, len, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= len)
        die(EXIT_USAGE, "path too long (%zu bytes at most): %s...; give a shorter one", len - 1, shown(out));
}

static void join(char *out, size_t len, const char *dir, const char *file) {
    format_path(out, len, *dir && dir[strlen(dir) - 1] == '/' ? "%s%s" : "%s/%s", dir, file);
}

static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

// Read the headers of DIR/q.npy, k.npy, v.npy (and do.npy with --backward) and take the shape from them.
static void shape_from_input(Options *o) {
    NpyHeader h[4];
    char path[4096], err[1024];
    struct stat st;
    for (int i = 0; i < input_count(o); i++) {
        join(path, sizeof path, o->input_dir, INPUT_NAMES[i]);
        if (i == 3 && stat(path, &st) != 0 && errno == ENOENT)  // the one file a forward's folder lacks
            die(EXIT_USAGE,
                "--backward reads dO from the --input folder too, and %s does not exist: save it there, fp16 in "
                "q.npy's shape [B, H, N, D] (np.save(path, do.astype(np.float16))), or drop --backward",
                shown(path));
        // fp16 alone: any other dtype is refused naming '<f2' and the NumPy line that casts to it.
        if (npy_read_header_of(path, NPY_F16, &h[i], err, sizeof err)) die(EXIT_USAGE, "%s", err);
        if (h[i].ndim != 4) die(EXIT_USAGE, "%s: %d-D array, expected 4-D [B, H, N, D]", shown(path), h[i].ndim);
        for (int d = 0; d < 4; d++) {
            if (h[i].shape[d] < 1 || h[i].shape[d] > 2147483647)
                die(EXIT_USAGE, "%s: dimension %d is %lld, expected 1 .. 2^31-1", shown(path), d, h[i].shape[d]);
            if (h[i].shape[d] != h[0].shape[d])
                die(EXIT_USAGE,
                    "%s has shape (%lld, %lld, %lld, %lld) but q.npy has (%lld, %lld, %lld, %lld): "
                    "q, k, v%s must share one [B, H, N, D] shape",
                    shown(path), h[i].shape[0], h[i].shape[1], h[i].shape[2], h[i].shape[3], h[0].shape[0],
                    h[0].shape[1], h[0].shape[2], h[0].shape[3], o->backward ? " and do" : "");
        }
    }
    int dims[4] = {(int)h[0].shape[0], (int)h[0].shape[1], (int)h[0].shape[2], (int)h[0].shape[3]};
    int *fields[4] = {&o->shape.batch, &o->shape.heads, &o->shape.seqlen, &o->shape.headdim};
    const char *flags[4] = {"--batch", "--heads", "--seqlen", "--headdim"};
    for (int d = 0; d < 4; d++) {
        if (o->shape_given[d] && *fields[d] != dims[d])
            die(EXIT_USAGE, "%s %d contradicts the --input files (%d); drop it: the shape comes from the files",
                flags[d], *fields[d], dims[d]);
        *fields[d] = dims[d];
    }
}

// FNV-1a over a file's bytes: names the reference cache of --input data.
static uint64_t hash_file(const char *path, uint64_t h) {
    FILE *f = fopen(path, "rb");
    if (!f) die(EXIT_USAGE, "cannot open %s: %s", shown(path), strerror(errno));
    unsigned char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        for (size_t i = 0; i < n; i++) h = (h ^ buf[i]) * 1099511628211ULL;
    fclose(f);
    return h;
}

typedef struct {
    char data_dir[4096];  // where q/k/v.npy (and do.npy) live
    char ref_dir[4096];   // where the reference files live
    char ref_tag[128];    // names the reference files: causal and scale
    char floor_part[64];  // names the FP8 floor's file, as reference.py's fp8_floor_part does
} DataPaths;

// The folder of generated inputs and references: $FA_CACHE, else the checkout's .cache.
static const char *cache_root(char *buf, size_t len) {
    const char *cache = getenv("FA_CACHE");
    if (cache && *cache) return cache;
    format_path(buf, len, "%s/.cache", FA_ROOT);
    return buf;
}

static DataPaths data_paths(const Options *o) {
    DataPaths p;
    char default_cache[4096];
    const char *cache = cache_root(default_cache, sizeof default_cache);
    const AttnShape *s = &o->shape;
    if (o->input_dir) {
        char path[4096];
        uint64_t h = 1469598103934665603ULL;
        // dO too with --backward: its reference gradients are cached under a name of their own.
        for (int i = 0; i < input_count(o); i++)
            join(path, sizeof path, o->input_dir, INPUT_NAMES[i]), h = hash_file(path, h);
        format_path(p.data_dir, sizeof p.data_dir, "%s", o->input_dir);
        format_path(p.ref_dir, sizeof p.ref_dir, "%s/input_%016llx", cache, (unsigned long long)h);
    } else {
        format_path(p.data_dir, sizeof p.data_dir, "%s/b%d_h%d_n%d_d%d_seed%llu", cache, s->batch, s->heads, s->seqlen,
                    s->headdim, o->seed);
        format_path(p.ref_dir, sizeof p.ref_dir, "%s", p.data_dir);
    }
    snprintf(p.ref_tag, sizeof p.ref_tag, "c%d_s%.9g", s->causal, s->scale);
    const int qk_range = fp8_qk_range(s->headdim);  // named only where it is not e4m3's 448
    snprintf(p.floor_part, sizeof p.floor_part, qk_range == 448 ? "fp8floor%dx%d" : "fp8floor%dx%dr%d",
             fp8_scale_rows(s->headdim, 0), fp8_scale_rows(s->headdim, 1), qk_range);
    return p;
}

// The gradient reference files the check reads (reference.py backward writes them, the rows last).
static const char *const GRAD_PARTS[5] = {"dq", "dk", "dv", "dq_rows", "dkv_rows"};

static void run_reference(const char *const *args);

// Run common/reference.py to create whatever inputs and reference files are missing (with --backward,
// its backward command: dO and the gradients besides the forward's files).
static void prepare_data(const Options *o, const DataPaths *p) {
    char path[4096], file[256];
    int missing = 0;
    for (int i = 0; i < input_count(o); i++)
        join(path, sizeof path, p->data_dir, INPUT_NAMES[i]), missing |= !file_exists(path);
    const int floors = precision_rule(chapter.precision)->floor_factor > 0;
    if (o->check) {
        const char *parts[] = {"rows", "o", "lse", p->floor_part};
        for (int i = 0; i < 3 + floors; i++) {
            snprintf(file, sizeof file, "ref_%s_%s.npy", p->ref_tag, parts[i]);
            join(path, sizeof path, p->ref_dir, file);
            missing |= !file_exists(path);
        }
        for (int i = 0; o->backward && i < 5; i++) {
            snprintf(file, sizeof file, "ref_%s_%s.npy", p->ref_tag, GRAD_PARTS[i]);
            join(path, sizeof path, p->ref_dir, file);
            missing |= !file_exists(path);
        }
    }
    if (!missing) return;

    char b[32], h[32], n[32], d[32], seed[32], scale[64];
    snprintf(b, sizeof b, "%d", o->shape.batch);
    snprintf(h, sizeof h, "%d", o->shape.heads);
    snprintf(n, sizeof n, "%d", o->shape.seqlen);
    snprintf(d, sizeof d, "%d", o->shape.headdim);
    snprintf(seed, sizeof seed, "%llu", o->seed);
    snprintf(scale, sizeof scale, "%.9g", o->shape.scale);
    const char *argv[32];
    int argc = 0;
    argv[argc++] = o->backward ? "backward" : "prepare";
    argv[argc++] = "--out";
    argv[argc++] = p->ref_dir;
    if (o->input_dir) {
        argv[argc++] = "--input";
        argv[argc++] = o->input_dir;
    } else {
        const char *kv[] = {"--batch", b, "--heads", h, "--seqlen", n, "--headdim", d, "--seed", seed};
        for (int i = 0; i < 10; i++) argv[argc++] = kv[i];
    }
    argv[argc++] = "--scale";
    argv[argc++] = scale;
    if (o->shape.causal) argv[argc++] = "--causal";
    if (!o->check) argv[argc++] = "--no-ref";
    char q_rows[16], kv_rows[16], qk_range[16];
    snprintf(q_rows, sizeof q_rows, "%d", fp8_scale_rows(o->shape.headdim, 0));
    snprintf(kv_rows, sizeof kv_rows, "%d", fp8_scale_rows(o->shape.headdim, 1));
    snprintf(qk_range, sizeof qk_range, "%d", fp8_qk_range(o->shape.headdim));
    if (o->check && floors) {
        argv[argc++] = "--fp8-floor";
        argv[argc++] = q_rows;
        argv[argc++] = kv_rows;
        argv[argc++] = qk_range;
    }
    argv[argc] = NULL;

    run_reference(argv);
}

// Run common/reference.py (under FA_PYTHON) with `args`, its command and options, NULL-terminated, and
// wait for it to succeed.
static void run_reference(const char *const *args) {
    const char *argv[64];
    char script[4096];
    const char *python = getenv("FA_PYTHON");
    format_path(script, sizeof script, "%s/common/reference.py", FA_ROOT);
    int argc = 0;
    argv[argc++] = python && *python ? python : FA_PYTHON;
    argv[argc++] = script;
    while (*args && argc < 63) argv[argc++] = *args++;
    argv[argc] = NULL;
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], NULL, NULL, (char *const *)argv, environ);
    int status = 0;
    if (rc == 0 && waitpid(pid, &status, 0) < 0) rc = errno;
    if (rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        die(EXIT_USAGE,
            "could not prepare inputs with '%s %s' (%s); run 'make' to set up Python with NumPy, "
            "or set FA_PYTHON",
            shown(argv[0]), shown(argv[1]), rc ? strerror(rc) : "it failed, see above");
}

// Load dir/file, refusing another dtype or shape (a negative dimension matches any).
static void *load_array(const char *dir, const char *file, NpyDtype dtype, int ndim, const long long *shape,
                        NpyHeader *header) {
    char path[4096], err[1024];
    NpyHeader h;
    void *data;
    join(path, sizeof path, dir, file);
    if (npy_load(path, dtype, &h, &data, err, sizeof err)) die(EXIT_USAGE, "%s", err);
    int ok = h.ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = shape[i] < 0 || h.shape[i] == shape[i];
    if (!ok) die(EXIT_USAGE, "%s: unexpected shape (stale cache? delete it and rerun)", shown(path));
    if (header) *header = h;
    return data;
}

// ---------------------------------------------------------------------------
// Check against the reference
// ---------------------------------------------------------------------------

typedef struct {
    double rel_l2, max_abs, lse_err;
    double floor, lse_floor;     // the input-quantisation error (FP8), else 0
    double rel_l2_tol, lse_tol;  // what this run had to meet
    size_t unwritten;            // NaN/Inf elements left in O or LSE (poisoned with NaN)
    long long rows_checked;      // query rows per (b, h) the reference covers
    int passed;
} CheckResult;

// The rows of a reference file (ref_<tag>_<part>.npy, int64 [R]): those it covers in every (b, h).
static int64_t *load_rows(const DataPaths *p, const AttnShape *s, const char *part, long long *nrows) {
    char file[256];
    snprintf(file, sizeof file, "ref_%s_%s.npy", p->ref_tag, part);
    long long any = -1;
    NpyHeader h;
    int64_t *rows = (int64_t *)load_array(p->ref_dir, file, NPY_I64, 1, &any, &h);
    *nrows = h.shape[0];
    for (long long i = 0; i < *nrows; i++)
        if (rows[i] < 0 || rows[i] >= s->seqlen)
            die(EXIT_USAGE, "%s/%s: row %lld out of range (stale cache? delete it and rerun)", shown(p->ref_dir), file,
                (long long)rows[i]);
    return rows;
}

// ||got - want|| / ||want|| over the listed rows of every (b, h) together (absolute where want is all
// zero), and the max abs error: got is [B, H, N, D], want [B, H, nrows, D] (row i of it is rows[i]).
// A NaN in a checked row makes both NaN.
static double rel_l2_over_rows(const AttnShape *s, const __half *got, const double *want, const int64_t *rows,
                               long long nrows, double *max_abs) {
    double err2 = 0, ref2 = 0;
    const int D = s->headdim;
    *max_abs = 0;
    for (long long bh = 0; bh < (long long)s->batch * s->heads; bh++) {
        for (long long i = 0; i < nrows; i++) {
            const __half *x = got + ((size_t)bh * s->seqlen + rows[i]) * D;
            const double *ref = want + ((size_t)bh * nrows + i) * D;
            for (int d = 0; d < D; d++) {
                double diff = (double)__half2float(x[d]) - ref[d];
                if (!(fabs(diff) <= *max_abs) && !isnan(*max_abs)) *max_abs = fabs(diff);  // a NaN stays
                err2 += diff * diff;
                ref2 += ref[d] * ref[d];
            }
        }
    }
    return sqrt(err2 / (ref2 > 0 ? ref2 : 1));
}

static size_t count_not_finite(const __half *x, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += !isfinite(__half2float(x[i]));
    return bad;
}

static CheckResult check_outputs(const Options *o, const DataPaths *p, const __half *out, const float *lse) {
    const AttnShape *s = &o->shape;
    char file[256];
    CheckResult r;
    memset(&r, 0, sizeof r);
    r.unwritten = count_not_finite(out, elems_qkv(s));
    for (size_t i = 0; i < elems_lse(s); i++) r.unwritten += !isfinite(lse[i]);

    long long nrows;
    int64_t *rows = load_rows(p, s, "rows", &nrows);
    long long o_shape[4] = {s->batch, s->heads, nrows, s->headdim};
    snprintf(file, sizeof file, "ref_%s_o.npy", p->ref_tag);
    double *ref_o = (double *)load_array(p->ref_dir, file, NPY_F64, 4, o_shape, NULL);
    snprintf(file, sizeof file, "ref_%s_lse.npy", p->ref_tag);
    double *ref_lse = (double *)load_array(p->ref_dir, file, NPY_F64, 3, o_shape, NULL);

    r.rel_l2 = rel_l2_over_rows(s, out, ref_o, rows, nrows, &r.max_abs);
    for (long long bh = 0; bh < (long long)s->batch * s->heads; bh++) {
        for (long long i = 0; i < nrows; i++) {
            double lse_diff = fabs((double)lse[(size_t)bh * s->seqlen + rows[i]] - ref_lse[(size_t)bh * nrows + i]);
            if (!(lse_diff <= r.lse_err) && !isnan(r.lse_err)) r.lse_err = lse_diff;  // a NaN stays
        }
    }
    r.rows_checked = nrows;

    const PrecisionRule *rule = precision_rule(chapter.precision);
    if (rule->floor_factor > 0) {
        long long two = 2;
        snprintf(file, sizeof file, "ref_%s_%s.npy", p->ref_tag, p->floor_part);
        double *floors = (double *)load_array(p->ref_dir, file, NPY_F64, 1, &two, NULL);
        r.floor = floors[0];
        r.lse_floor = floors[1];
        free(floors);
    }
    r.rel_l2_tol = rule->floor_factor * r.floor + rule->rel_l2_tol;
    const int standard_inputs = !o->input_dir && !o->scale_given;  // N(0, 1), scale 1/sqrt(D)
    if (rule->randn_cap > 0 && standard_inputs && r.rel_l2_tol > rule->randn_cap) r.rel_l2_tol = rule->randn_cap;
    r.lse_tol = rule->floor_factor * r.lse_floor + rule->lse_tol;
    r.passed = r.unwritten == 0 && r.rel_l2 <= r.rel_l2_tol && r.lse_err <= r.lse_tol;
    free(rows);
    free(ref_o);
    free(ref_lse);
    return r;
}

// The backward's check: dQ, dK, dV (GRAD_NAMES order) against reference.py backward's float64 gradients,
// dQ at its query rows, dK and dV at its key rows, the same rows in every (b, h).
typedef struct {
    double rel_l2[3], max_abs[3];
    size_t unwritten[3];        // NaN/Inf elements of each, anywhere (all were poisoned with NaN)
    long long rows_checked[3];  // rows per (b, h) the reference covers
    double worst_rel_l2, worst_max_abs;
    int passed;  // every gradient written, finite and within BACKWARD_REL_L2_TOL
} GradCheck;

// NaN-propagating max, so that the CSV's largest error is NaN when one is.
static double worst(double a, double b) { return isnan(a) || isnan(b) ? NAN : a > b ? a : b; }

static GradCheck check_grads(const Options *o, const DataPaths *p, __half *const grad[3]) {
    const AttnShape *s = &o->shape;
    GradCheck r;
    memset(&r, 0, sizeof r);
    long long nrows[2];
    int64_t *rows[2] = {load_rows(p, s, "dq_rows", &nrows[0]), load_rows(p, s, "dkv_rows", &nrows[1])};
    r.passed = 1;
    for (int g = 0; g < 3; g++) {
        char file[256];
        const int which = g ? 1 : 0;  // dQ: query rows; dK, dV: key rows
        long long shape[4] = {s->batch, s->heads, nrows[which], s->headdim};
        snprintf(file, sizeof file, "ref_%s_%s.npy", p->ref_tag, GRAD_PARTS[g]);
        double *ref = (double *)load_array(p->ref_dir, file, NPY_F64, 4, shape, NULL);
        r.unwritten[g] = count_not_finite(grad[g], elems_qkv(s));
        r.rel_l2[g] = rel_l2_over_rows(s, grad[g], ref, rows[which], nrows[which], &r.max_abs[g]);
        r.rows_checked[g] = nrows[which];
        r.worst_rel_l2 = g ? worst(r.worst_rel_l2, r.rel_l2[g]) : r.rel_l2[g];
        r.worst_max_abs = g ? worst(r.worst_max_abs, r.max_abs[g]) : r.max_abs[g];
        r.passed &= r.unwritten[g] == 0 && r.rel_l2[g] <= BACKWARD_REL_L2_TOL;  // NaN fails
        free(ref);
    }
    free(rows[0]);
    free(rows[1]);
    return r;
}

// ---------------------------------------------------------------------------
// GPU
// ---------------------------------------------------------------------------

static void require_gpu(cudaDeviceProp *prop) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        const char *why = err == cudaErrorInsufficientDriver
                              ? "no CUDA driver found: this machine has no NVIDIA GPU, or its driver is older than "
                                "this CUDA runtime needs"
                          : err == cudaErrorNoDevice || count == 0 ? "the driver sees no device (CUDA_VISIBLE_DEVICES?)"
                                                                   : cudaGetErrorString(err);
        printf("%s: skipped: no CUDA GPU available (%s)\n", chapter.name, why);
        exit(EXIT_SKIP);
    }
    CUDA_CHECK(cudaGetDeviceProperties(prop, 0));
    int sm = prop->major * 10 + prop->minor;
    if (sm < chapter.min_sm || (chapter.max_sm && sm > chapter.max_sm)) {
        if (chapter.max_sm == chapter.min_sm)
            printf("%s: skipped: needs an sm_%d GPU (its sm_%da code runs on no other), this GPU (%s) is sm_%d\n",
                   chapter.name, chapter.min_sm, chapter.min_sm, prop->name, sm);
        else if (chapter.max_sm)
            printf("%s: skipped: needs sm_%d to sm_%d, this GPU (%s) is sm_%d\n", chapter.name, chapter.min_sm,
                   chapter.max_sm, prop->name, sm);
        else
            printf("%s: skipped: needs sm_%d or newer, this GPU (%s) is sm_%d\n", chapter.name, chapter.min_sm,
                   prop->name, sm);
        exit(EXIT_SKIP);
    }
}

// need: the bytes of every buffer the harness will allocate, scratch the workspaces among them.
static void require_memory(double need, size_t scratch, const char *hint) {
    size_t free_bytes = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    double margin = 256.0 * 1024 * 1024;
    if (need + margin > (double)free_bytes) {
        char a[32], b[32], c[32];
        die(EXIT_USAGE,
            "this shape needs %s of device memory (%s of it scratch), the GPU has %s free: "
            "lower B, H or N%s",
            human_bytes(need, a, sizeof a), human_bytes((double)scratch, b, sizeof b),
            human_bytes((double)free_bytes, c, sizeof c), hint);
    }
}

// What to enqueue: the whole forward (prepare, then forward), one of its two parts, or the backward.
typedef enum { PART_WHOLE, PART_PREPARE, PART_ATTEND, PART_BACKWARD } Part;

// grad: the backward's arguments, read for PART_BACKWARD alone (NULL for a forward).
static cudaError_t enqueue(const AttnArgs *args, const BackwardArgs *grad, cudaStream_t stream, Part part) {
    if (part == PART_BACKWARD) return chapter.backward->backward(grad, stream);
    cudaError_t err = cudaSuccess;
    if (part != PART_ATTEND && chapter.prepare) err = chapter.prepare(args, stream);
    if (err == cudaSuccess && part != PART_PREPARE) err = chapter.forward(args, stream);
    return err;
}

// The kernel launches a captured graph holds (its other nodes, memsets and copies, are not counted); the
// graph is destroyed.
static int kernels_in(cudaGraph_t graph) {
    size_t n = 0;
    CUDA_CHECK(cudaGraphGetNodes(graph, NULL, &n));
    cudaGraphNode_t *nodes = (cudaGraphNode_t *)calloc(n ? n : 1, sizeof *nodes);
    CUDA_CHECK(cudaGraphGetNodes(graph, nodes, &n));
    int kernels = 0;
    for (size_t i = 0; i < n; i++) {
        cudaGraphNodeType type;
        CUDA_CHECK(cudaGraphNodeGetType(nodes[i], &type));
        kernels += type == cudaGraphNodeTypeKernel;
    }
    free(nodes);
    CUDA_CHECK(cudaGraphDestroy(graph));
    return kernels;
}

// What a pass's launchers answered (and then the launches' own error): the binary ends on either.
static void check_launch(cudaError_t err, const char *pass) {
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err == cudaErrorNoKernelImageForDevice)
        die(EXIT_FAILED, "this binary has no kernel for this GPU: rebuild with ARCH=sm_XY (see make help)");
    if (err != cudaSuccess) die(EXIT_FAILED, "CUDA error in the %s: %s", pass, cudaGetErrorString(err));
}

static void run_pass(const AttnArgs *args, const BackwardArgs *grad, cudaStream_t stream, Part part) {
    check_launch(enqueue(args, grad, stream, part), part == PART_BACKWARD ? "backward" : "forward");
}

static int compare_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

// The median of n times (sorts them).
static float median_of(float *ms, int n) {
    qsort(ms, n, sizeof *ms, compare_float);
    return n % 2 ? ms[n / 2] : 0.5f * (ms[n / 2 - 1] + ms[n / 2]);
}

// --flush-l2's buffer (twice the L2), and its write on the stream: what the next kernel reads then
// comes from device memory, as it would after other work. Nothing without the flag.
static void *l2_flush;
static size_t l2_flush_bytes;

static void flush_l2(cudaStream_t stream) {
    static int value;
    if (l2_flush) CUDA_CHECK(cudaMemsetAsync(l2_flush, ++value & 0xff, l2_flush_bytes, stream));
}

// One run of what is timed (a pass, or decoding), on `stream`; it ends the binary on a CUDA error.
typedef void (*RunOnce)(const void *what, cudaStream_t stream);

// The median time of o->iters runs (after o->warmup untimed ones), CUDA events around each, the runs
// queued back to back and read after one synchronisation (no host gap inside a timed interval).
static float median_time(const Options *o, cudaStream_t stream, RunOnce run, const void *what) {
    for (int i = 0; i < o->warmup; i++) run(what, stream);
    cudaEvent_t *start = (cudaEvent_t *)calloc(o->iters, sizeof *start);
    cudaEvent_t *stop = (cudaEvent_t *)calloc(o->iters, sizeof *stop);
    float *ms = (float *)calloc(o->iters, sizeof *ms);
    if (!start || !stop || !ms) die(EXIT_FAILED, "out of host memory");
    for (int i = 0; i < o->iters; i++) {
        CUDA_CHECK(cudaEventCreate(&start[i]));
        CUDA_CHECK(cudaEventCreate(&stop[i]));
    }
    for (int i = 0; i < o->iters; i++) {
        flush_l2(stream);
        CUDA_CHECK(cudaEventRecord(start[i], stream));
        run(what, stream);
        CUDA_CHECK(cudaEventRecord(stop[i], stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int i = 0; i < o->iters; i++) {
        CUDA_CHECK(cudaEventElapsedTime(&ms[i], start[i], stop[i]));
        CUDA_CHECK(cudaEventDestroy(start[i]));
        CUDA_CHECK(cudaEventDestroy(stop[i]));
    }
    float median = median_of(ms, o->iters);
    free(start);
    free(stop);
    free(ms);
    return median;
}

typedef struct {
    const AttnArgs *args;
    const BackwardArgs *grad;
    Part part;
} PassRun;

static void run_pass_once(const void *what, cudaStream_t stream) {
    const PassRun *r = (const PassRun *)what;
    run_pass(r->args, r->grad, stream, r->part);
}

// The kernels one run launches: captured into a graph (nothing runs) and counted.
static int kernels_of(cudaStream_t stream, RunOnce run, const void *what) {
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    run(what, stream);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    return kernels_in(graph);
}

// Kernels one forward (or backward) launches.
static int kernels_per_pass(const AttnArgs *args, const BackwardArgs *grad, cudaStream_t stream, Part part) {
    const PassRun run = {args, grad, part};
    return kernels_of(stream, run_pass_once, &run);
}

// The median time of a part (median_time).
static float time_pass(const Options *o, const AttnArgs *args, const BackwardArgs *grad, cudaStream_t stream,
                       Part part) {
    const PassRun run = {args, grad, part};
    return median_time(o, stream, run_pass_once, &run);
}

// A chapter that prepares its inputs: each whole forward timed with an event between its two parts,
// so that the whole and each part are medians over the same runs (timed in runs of their own, 08's
// attention alone at N = 16384 once came out slower than the whole forward: it then follows another
// attention, not the quantisation). Out: the medians of the whole, the prepare step and the attention.
static void time_parts(const Options *o, const AttnArgs *args, cudaStream_t stream, float *whole_ms, float *prepare_ms,
                       float *attend_ms) {
    for (int i = 0; i < o->warmup; i++) run_pass(args, NULL, stream, PART_WHOLE);
    const int n = o->iters;
    cudaEvent_t *marks = (cudaEvent_t *)calloc(4 * n, sizeof *marks);  // run i: start, after prepare, attend, end
    float *ms = (float *)calloc(3 * n, sizeof *ms);                    // whole, prepare, attention
    if (!marks || !ms) die(EXIT_FAILED, "out of host memory");
    for (int i = 0; i < 4 * n; i++) CUDA_CHECK(cudaEventCreate(&marks[i]));
    for (int i = 0; i < n; i++) {
        cudaEvent_t *m = marks + 4 * i;
        flush_l2(stream);
        CUDA_CHECK(cudaEventRecord(m[0], stream));
        run_pass(args, NULL, stream, PART_PREPARE);
        CUDA_CHECK(cudaEventRecord(m[1], stream));
        flush_l2(stream);  // (--flush-l2: the attention's inputs leave L2, and this write is not timed)
        CUDA_CHECK(cudaEventRecord(m[2], stream));
        run_pass(args, NULL, stream, PART_ATTEND);
        CUDA_CHECK(cudaEventRecord(m[3], stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int i = 0; i < n; i++) {
        const cudaEvent_t *m = marks + 4 * i;
        CUDA_CHECK(cudaEventElapsedTime(&ms[n + i], m[0], m[1]));
        CUDA_CHECK(cudaEventElapsedTime(&ms[2 * n + i], m[2], m[3]));
        if (l2_flush) ms[i] = ms[n + i] + ms[2 * n + i];  // the two parts, without the flush between them
        else CUDA_CHECK(cudaEventElapsedTime(&ms[i], m[0], m[3]));
    }
    for (int i = 0; i < 4 * n; i++) CUDA_CHECK(cudaEventDestroy(marks[i]));
    *whole_ms = median_of(ms, n);
    *prepare_ms = median_of(ms + n, n);
    *attend_ms = median_of(ms + 2 * n, n);
    free(marks);
    free(ms);
}

// A file or folder with no write permission bit at all, one its owner marked read-only, is not
// written: not even by a user whose privileges would let it be (root), as a user expects.
static int marked_read_only(const struct stat *st) { return (st->st_mode & (S_IWUSR | S_IWGRP | S_IWOTH)) == 0; }

// Where the symbolic link at path points, for a message.
static const char *link_target(const char *path, char *out, size_t len) {
    ssize_t n = readlink(path, out, len - 1);
    out[n < 0 ? 0 : n] = 0;
    return out;
}

// What is wrong with writing OUTPUT_NAMES[i] into the existing folder dir, into problem (empty:
// nothing). It must be a regular file this user may write, not marked read-only, or not exist in a
// folder that takes a new file: that one is created and removed again, which tells for certain.
static void check_output_file(const char *dir, int i, struct stat *st, int *exists, char *problem, size_t len) {
    char path[4096], target[4096];
    struct stat lst;
    join(path, sizeof path, dir, OUTPUT_NAMES[i]);
    *exists = 0;
    int missing = lstat(path, &lst) != 0;
    if (missing) {
        int fd = errno == ENOENT ? open(path, O_WRONLY | O_CREAT | O_EXCL, 0644) : -1;
        if (fd >= 0) {
            close(fd);
            unlink(path);
            return;
        }
        // EEXIST: another run made it meanwhile; then it is checked as any existing file.
        if (errno != EEXIST || lstat(path, &lst) != 0) {
            snprintf(problem, len, "--output: %s cannot be created: %s; give a folder you can write to", shown(path),
                     strerror(errno));
            return;
        }
    }
    if (S_ISLNK(lst.st_mode) && stat(path, st) != 0) {
        snprintf(problem, len,
                 "--output: %s is a dangling symbolic link (to %s, %s): remove it, or point it at a file, "
                 "or give another folder",
                 shown(path), shown(link_target(path, target, sizeof target)), strerror(errno));
        return;
    }
    if (!S_ISLNK(lst.st_mode)) *st = lst;
    *exists = 1;
    if (S_ISDIR(st->st_mode))
        snprintf(problem, len, "--output: %s is a directory: remove it, or give another folder", shown(path));
    else if (!S_ISREG(st->st_mode))
        snprintf(problem, len,
                 "--output: %s is not a regular file (a FIFO, socket or device): remove it, or give another folder",
                 shown(path));
    else if (marked_read_only(st))
        snprintf(problem, len,
                 "--output: %s is read-only (no write permission): make it writable (chmod u+w), remove it, "
                 "or give another folder",
                 shown(path));
    else {
        int fd = open(path, O_WRONLY | O_NONBLOCK);  // no O_TRUNC: the check changes nothing in it
        if (fd < 0)
            snprintf(problem, len, "--output: %s cannot be written: %s; remove it, or give another folder", shown(path),
                     strerror(errno));
        else close(fd);
    }
}

// --output DIR is checked before any work, on what a run will really write: DIR itself (an existing
// folder, or one to make in an existing folder: it is made now), then each of the first `count` of
// OUTPUT_NAMES in it (output_count). A folder made here is removed again, refused or not, so that a run
// that stops before writing (a refusal, --dry-run, no GPU) leaves nothing behind; write_outputs makes it
// again.
static void check_output_dir(const char *dir, int count) {
    struct stat st;
    char target[4096];
    if (lstat(dir, &st) == 0 && S_ISLNK(st.st_mode) && stat(dir, &st) != 0)
        die(EXIT_USAGE, "--output %s is a dangling symbolic link (to %s): remove it, or give another folder",
            shown(dir), shown(link_target(dir, target, sizeof target)));
    int made = 0;
    if (stat(dir, &st) == 0) {
        if (!S_ISDIR(st.st_mode)) die(EXIT_USAGE, "--output %s exists and is not a folder: give a folder", shown(dir));
        if (marked_read_only(&st))
            die(EXIT_USAGE,
                "--output %s is a read-only folder (no write permission): make it writable (chmod u+w), "
                "or give another folder",
                shown(dir));
        if (access(dir, W_OK | X_OK) != 0)
            die(EXIT_USAGE, "--output %s: cannot write into it: %s", shown(dir), strerror(errno));
    } else {
        if (errno != ENOENT) die(EXIT_USAGE, "--output %s: %s", shown(dir), strerror(errno));
        char parent[4096];
        format_path(parent, sizeof parent, "%s", dir);
        char *slash = strrchr(parent, '/');
        while (slash && slash > parent && slash[1] == 0) *slash = 0, slash = strrchr(parent, '/');  // "a/b/" -> "a/b"
        if (!slash) strcpy(parent, ".");
        else if (slash == parent) parent[1] = 0;  // "/x": the root
        else *slash = 0;
        if (stat(parent, &st) != 0 || !S_ISDIR(st.st_mode))
            die(EXIT_USAGE, "--output %s cannot be created: %s is not an existing folder", shown(dir), shown(parent));
        if (marked_read_only(&st))
            die(EXIT_USAGE,
                "--output %s cannot be created: %s is a read-only folder (no write permission); give a folder "
                "you can write to",
                shown(dir), shown(parent));
        if (access(parent, W_OK | X_OK) != 0)
            die(EXIT_USAGE, "--output %s cannot be created in %s: %s", shown(dir), shown(parent), strerror(errno));
        if (mkdir(dir, 0755) != 0)  // what tells for certain: /proc, say, refuses here and only here
            die(EXIT_USAGE, "--output %s cannot be created in %s: %s; give a folder you can write to", shown(dir),
                shown(parent), strerror(errno));
        made = 1;
    }
    char problem[8192] = "";
    struct stat file[5];
    int exists[5] = {0, 0, 0, 0, 0};
    for (int i = 0; i < count && !*problem; i++)
        check_output_file(dir, i, &file[i], &exists[i], problem, sizeof problem);
    for (int i = 0; i < count && !*problem; i++) {
        for (int j = i + 1; j < count && !*problem; j++) {
            if (!exists[i] || !exists[j] || file[i].st_dev != file[j].st_dev || file[i].st_ino != file[j].st_ino)
                continue;
            char paths[2][4096];
            join(paths[0], sizeof paths[0], dir, OUTPUT_NAMES[i]);
            join(paths[1], sizeof paths[1], dir, OUTPUT_NAMES[j]);
            snprintf(problem, sizeof problem,
                     "--output: %s and %s are the same file (a link): one would overwrite the other; remove the link",
                     shown(paths[0]), shown(paths[1]));
        }
    }
    if (made) rmdir(dir);
    if (*problem) die(EXIT_USAGE, "%s", problem);
}

// Q, K, V (and dO with --backward: input_count) from dir into host memory, in the validated shape.
static void load_inputs(const char *dir, const AttnShape *s, int count, __half *host_in[4]) {
    long long shape[4] = {s->batch, s->heads, s->seqlen, s->headdim};
    for (int i = 0; i < count; i++) host_in[i] = (__half *)load_array(dir, INPUT_NAMES[i], NPY_F16, 4, shape, NULL);
}

// NaN or Inf in dir/file, fp16 of a 4-D shape, refused, saying how many and where the first is: `what`
// ("attention is", "the gradients are") undefined on them.
static void refuse_not_finite(const char *dir, const char *file, const __half *x, const long long shape[4],
                              const char *what) {
    const size_t n = (size_t)shape[0] * shape[1] * shape[2] * shape[3];
    size_t bad = 0, first = 0;
    for (size_t e = 0; e < n; e++) {
        unsigned short bits = *(const unsigned short *)&x[e];
        if ((bits & 0x7C00) == 0x7C00 && !bad++) first = e;  // exponent all ones: Inf or NaN
    }
    if (!bad) return;
    size_t at[4];
    for (int d = 3; d >= 0; d--) at[d] = first % (size_t)shape[d], first /= (size_t)shape[d];
    die(EXIT_USAGE,
        "%s/%s holds %zu NaN or Inf value%s, the first at [%zu, %zu, %zu, %zu]: %s undefined on them; replace "
        "them (np.nan_to_num) or find where they came from",
        shown(dir), file, bad, bad == 1 ? "" : "s", at[0], at[1], at[2], at[3], what);
}

// NaN or Inf in an input makes the whole output row undefined: refuse it, saying where.
static void check_finite(const char *dir, const AttnShape *s, int count, __half *const host_in[4]) {
    const long long shape[4] = {s->batch, s->heads, s->seqlen, s->headdim};
    for (int i = 0; i < count; i++)
        refuse_not_finite(dir, INPUT_NAMES[i], host_in[i], shape, i < 3 ? "attention is" : "the gradients are");
}

// ---------------------------------------------------------------------------
// Decoding's --input DIR: the user's own queries, paged cache, block table and lengths
// ---------------------------------------------------------------------------

// The header of DIR/DECODE_INPUTS[i]: fp16 (q and the pools) or int32 or int64 (the table and lengths), of
// its rank, each dimension 1 .. 2^31-1.
static void decode_input_header(const char *dir, int i, NpyHeader *h) {
    static const int RANK[5] = {4, 4, 4, 2, 1};
    static const char *const LAYOUT[5] = {"[B, Hq, Nq, D]", "[pages, Hkv, P, D]", "[pages, Hkv, P, D]",
                                          "[B, max_pages]", "[B]"};
    char path[4096], err[1024];
    join(path, sizeof path, dir, DECODE_INPUTS[i]);
    // The table and lengths: int32, else (another dtype) int64, whose refusal names '<i8' and the cast; an
    // int32 file's other fault (truncated, Fortran order) is said as it is.
    int refused = npy_read_header_of(path, i < 3 ? NPY_F16 : NPY_I32, h, err, sizeof err);
    if (refused && i >= 3 && strstr(err, "expected '<i4'"))
        refused = npy_read_header_of(path, NPY_I64, h, err, sizeof err);
    if (refused) die(EXIT_USAGE, "%s", err);
    if (h->ndim != RANK[i])
        die(EXIT_USAGE, "%s: %d-D array, expected %d-D %s", shown(path), h->ndim, RANK[i], LAYOUT[i]);
    for (int d = 0; d < h->ndim; d++)
        if (h->shape[d] < 1 || h->shape[d] > 2147483647)
            die(EXIT_USAGE, "%s: dimension %d is %lld, expected 1 .. 2^31-1", shown(path), d, h->shape[d]);
}

// The five headers fit together: the pools of one shape and of q's D, a table row and a length per sequence.
static void check_decode_headers(const char *dir, const NpyHeader h[5]) {
    const long long *q = h[0].shape, *k = h[1].shape, *v = h[2].shape;
    if (k[0] != v[0] || k[1] != v[1] || k[2] != v[2] || k[3] != v[3])
        die(EXIT_USAGE,
            "%s/v_pool.npy has shape (%lld, %lld, %lld, %lld) but k_pool.npy has (%lld, %lld, %lld, %lld): the "
            "pools must share one [pages, Hkv, P, D] shape",
            shown(dir), v[0], v[1], v[2], v[3], k[0], k[1], k[2], k[3]);
    if (k[3] != q[3])
        die(EXIT_USAGE, "%s/k_pool.npy has D = %lld but q.npy has D = %lld: the pools hold q's head dimension",
            shown(dir), k[3], q[3]);
    if (h[3].shape[0] != q[0])
        die(EXIT_USAGE, "%s/block_table.npy has %lld rows but q.npy has B = %lld sequences: one row per sequence",
            shown(dir), h[3].shape[0], q[0]);
    if (h[4].shape[0] != q[0])
        die(EXIT_USAGE, "%s/lengths.npy has %lld lengths but q.npy has B = %lld sequences: one per sequence",
            shown(dir), h[4].shape[0], q[0]);
}

// A shape flag given with --input must say what the files do, as the forward's --input rule has it.
static void refuse_contradiction(const char *flag, int given, int value, int from_files) {
    if (given && value != from_files)
        die(EXIT_USAGE, "%s %d contradicts the --input files (%d); drop it: the shape comes from the files", flag,
            value, from_files);
}

// --cache-len given with --input must say what lengths.npy does: one length for all, or the B of them.
static void refuse_cache_len(const char *text, const int *lengths, int batch) {
    int count = 1;
    for (const char *c = text; *c; c++) count += *c == ',';
    if (count != 1 && count != batch)
        die(EXIT_USAGE,
            "--cache-len %s contradicts the --input files (%d lengths in lengths.npy); drop it: the shape comes "
            "from the files",
            shown(text), batch);
    int *given = parse_cache_lengths(text, batch);
    for (int b = 0; b < batch; b++)
        if (given[b] != lengths[b])
            die(EXIT_USAGE,
                "--cache-len %s contradicts the --input files (sequence %d caches %d tokens); drop it: the shape "
                "comes from the files",
                shown(text), b, lengths[b]);
    free(given);
}

// DIR/DECODE_INPUTS[i], the table or the lengths (header h: int32 or int64), as ints. An int64 value past an
// int's range becomes the nearest int, which the rules refuse as they would the value (shown as that int).
static int *load_decode_ints(const char *dir, int i, const NpyHeader *h) {
    void *data = load_array(dir, DECODE_INPUTS[i], h->dtype, h->ndim, h->shape, NULL);
    if (h->dtype == NPY_I32) return (int *)data;
    int *ints = (int *)malloc(h->count * sizeof(int));
    if (!ints) die(EXIT_FAILED, "out of host memory");
    for (size_t e = 0; e < h->count; e++) {
        const int64_t v = ((const int64_t *)data)[e];
        ints[e] = v < INT_MIN ? INT_MIN : v > INT_MAX ? INT_MAX : (int)v;
    }
    free(data);
    return ints;
}

// --decode --input DIR: the shape from the headers of DIR's five files (B, Hq, Nq, D from q; pages, Hkv, P from
// the pools; max_pages from the table), its lengths and block table from theirs, checked by the rules the
// command line's shape meets (common/shape.h), the table's entries this time too; a shape flag that
// contradicts the files is refused.
static void decode_shape_from_input(Options *o) {
    const char *dir = o->input_dir;
    NpyHeader h[5];
    for (int i = 0; i < 5; i++) decode_input_header(dir, i, &h[i]);
    check_decode_headers(dir, h);
    const long long *q = h[0].shape, *pool = h[1].shape;
    DecodeShape d;
    d.batch = (int)q[0], d.q_heads = (int)q[1], d.new_tokens = (int)q[2], d.headdim = (int)q[3];  // [B, Hq, Nq, D]
    d.pages = pool[0], d.kv_heads = (int)pool[1], d.page_size = (int)pool[2];                     // [pages, Hkv, P, D]
    d.max_pages = (int)h[3].shape[1];                                                             // [B, max_pages]
    d.scale = o->scale_given ? o->shape.scale : 1.0f / sqrtf((float)d.headdim);
    refuse_contradiction("--batch", o->shape_given[0], o->shape.batch, d.batch);
    refuse_contradiction("--heads", o->shape_given[1], o->shape.heads, d.q_heads);
    refuse_contradiction("--kv-heads", o->kv_heads > 0, o->kv_heads, d.kv_heads);
    refuse_contradiction("--new", o->new_tokens > 0, o->new_tokens, d.new_tokens);
    refuse_contradiction("--headdim", o->shape_given[3], o->shape.headdim, d.headdim);
    refuse_contradiction("--page-size", o->page_size > 0, o->page_size, d.page_size);
    char problem[256];
    if (decode_shape_problem(&d, problem, sizeof problem)) die(EXIT_USAGE, "%s: %s", shown(dir), problem);
    int *lengths = load_decode_ints(dir, 4, &h[4]), *table = load_decode_ints(dir, 3, &h[3]);
    if (o->cache_len) refuse_cache_len(o->cache_len, lengths, d.batch);
    if (decode_cache_problem(&d, lengths, table, problem, sizeof problem))
        die(EXIT_USAGE, "%s: %s", shown(dir), problem);
    for (int b = 0; b < d.batch; b++)  // entries past a sequence's pages are -1 on the device, as generated ones are
        for (int i = (lengths[b] + d.page_size - 1) / d.page_size; i < d.max_pages; i++)
            table[(size_t)b * d.max_pages + i] = -1;
    o->dshape = d;
    o->lengths = lengths;
    o->host.table = table;
}

// --decode --input DIR: q.npy and the pools, in the shape decode_shape_from_input took, refused where they hold
// NaN or Inf anywhere in a pool, free pages too: a kernel (a student's) may read a page past a sequence's length.
static void read_decode_input(Options *o) {
    const DecodeShape *d = &o->dshape;
    const long long q_shape[4] = {d->batch, d->q_heads, d->new_tokens, d->headdim};
    const long long pool_shape[4] = {d->pages, d->kv_heads, d->page_size, d->headdim};
    __half **arrays[3] = {&o->host.q, &o->host.k_pool, &o->host.v_pool};
    for (int i = 0; i < 3; i++) {
        const long long *shape = i ? pool_shape : q_shape;
        *arrays[i] = (__half *)load_array(o->input_dir, DECODE_INPUTS[i], NPY_F16, 4, shape, NULL);
        refuse_not_finite(o->input_dir, DECODE_INPUTS[i], *arrays[i], shape, "attention is");
    }
}

// OUTPUT_NAMES, in the folder check_output_dir accepted: O and LSE, and dQ, dK, dV where grad is not NULL.
static void write_outputs(const char *dir, const AttnShape *s, const __half *out, const float *lse,
                          __half *const *grad) {
    char path[4096], err[1024];
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) die(EXIT_USAGE, "cannot create %s: %s", shown(dir), strerror(errno));
    long long shape[4] = {s->batch, s->heads, s->seqlen, s->headdim};
    join(path, sizeof path, dir, OUTPUT_NAMES[0]);
    if (npy_save(path, NPY_F16, 4, shape, out, err, sizeof err)) die(EXIT_FAILED, "%s", err);
    join(path, sizeof path, dir, OUTPUT_NAMES[1]);
    if (npy_save(path, NPY_F32, 3, shape, lse, err, sizeof err)) die(EXIT_FAILED, "%s", err);
    for (int g = 0; grad && g < 3; g++) {
        join(path, sizeof path, dir, OUTPUT_NAMES[2 + g]);
        if (npy_save(path, NPY_F16, 4, shape, grad[g], err, sizeof err)) die(EXIT_FAILED, "%s", err);
    }
}

// ---------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------

static void print_shape(const Options *o) {
    const AttnShape *s = &o->shape;
    printf("%s: %s\n", chapter.name, chapter.adds);
    printf("  shape     B=%d H=%d N=%d D=%d %s, scale %.6g, fp16 in/out, %s math\n", s->batch, s->heads, s->seqlen,
           s->headdim, s->causal ? "causal" : "non-causal", s->scale, precision_rule(chapter.precision)->math);
}

static void print_plan(const Options *o, size_t workspace) {
    const AttnShape *s = &o->shape;
    char a[32], b[32];
    print_shape(o);
    printf("  work      %.3g GFLOP, at least %s moved\n", forward_flops(s) / 1e9,
           human_bytes(min_bytes(s), a, sizeof a));
    printf("  memory    inputs+outputs %s, workspace %s\n", human_bytes(min_bytes(s), a, sizeof a),
           human_bytes((double)workspace, b, sizeof b));
}

// --backward's plan: what runs, its work, every buffer the harness allocates for it, and where the
// reference gradients are (refs: NULL with --no-check).
static void print_backward_plan(const Options *o, size_t workspace, size_t grad_workspace, const DataPaths *refs) {
    const AttnShape *s = &o->shape;
    char a[32], b[32], c[32], d[32];
    print_shape(o);
    printf("  backward  dQ, dK, dV from dO, Q, K, V and the chapter's forward's O and LSE (run first, untimed)\n");
    if (o->deterministic)
        printf("  mode      deterministic: dQ, dK, dV bitwise the same on every run (--deterministic)\n");
    printf("  work      %.3g GFLOP (2.5x the forward's %.3g), at least %s moved\n", backward_flops(s) / 1e9,
           forward_flops(s) / 1e9, human_bytes(backward_bytes(s), a, sizeof a));
    printf("  memory    tensors %s (Q, K, V, O, LSE, dO, dQ, dK, dV), %s in all with the workspaces\n",
           human_bytes(backward_bytes(s), a, sizeof a),
           human_bytes(backward_bytes(s) + (double)workspace + (double)grad_workspace, b, sizeof b));
    printf("  workspace forward %s, backward %s\n", human_bytes((double)workspace, c, sizeof c),
           human_bytes((double)grad_workspace, d, sizeof d));
    if (refs)
        printf("  reference %s (common/reference.py backward: dO and the float64 gradients)\n", shown(refs->ref_dir));
}

// The forward's check, on one line headed `label`.
static void print_check(const char *label, const CheckResult *check, const AttnShape *s, const char *status) {
    const PrecisionRule *rule = precision_rule(chapter.precision);
    printf("  %-10s", label);
    if (rule->floor_factor > 0)
        printf(
            "rel_l2 %.2e = %.2fx the e4m3 input floor %.2e (tol %.2e)  max_abs %.2e  "
            "lse_max_abs %.2e (floor %.2e, tol %.2e)  rows %lld of %d per head%s  %s\n",
            check->rel_l2, check->floor > 0 ? check->rel_l2 / check->floor : 0.0, check->floor, check->rel_l2_tol,
            check->max_abs, check->lse_err, check->lse_floor, check->lse_tol, check->rows_checked, s->seqlen,
            check->unwritten ? "  UNWRITTEN OUTPUTS" : "", status);
    else
        printf(
            "rel_l2 %.2e (tol %.0e)  max_abs %.2e  lse_max_abs %.2e (tol %.0e)  "
            "rows %lld of %d per head%s  %s\n",
            check->rel_l2, check->rel_l2_tol, check->max_abs, check->lse_err, check->lse_tol, check->rows_checked,
            s->seqlen, check->unwritten ? "  UNWRITTEN OUTPUTS" : "", status);
}

static void print_output_paths(const Options *o) {
    printf("  output    ");
    for (int i = 0; i < output_count(o); i++) {
        char path[4096];
        join(path, sizeof path, o->output_dir, OUTPUT_NAMES[i]);
        printf("%s%s", i ? ", " : "", shown(path));
    }
    printf("\n");
}

// The name of the EXERCISE_TODO a student copy's kernel reached in the run just synchronised: fail on it.
static void require_no_todo(void) {
    const char *todo = exercise_todo();
    if (todo) die(EXIT_FAILED, "TODO: exercise %s is not written yet (its EXERCISE_TODO stub ran)", todo);
}

// What failed a checked --backward run, in words, into why (empty when it passed).
static void backward_failures(const CheckResult *forward, const GradCheck *check, char *why, size_t len) {
    size_t n = 0;
    *why = 0;
    if (!forward->passed)
        n +=
            snprintf(why + n, len - n,
                     "%sthe forward's O or LSE failed its check (the gradients are computed from them)", n ? "; " : "");
    for (int g = 0; g < 3 && n < len; g++) {
        if (check->unwritten[g])
            n += snprintf(why + n, len - n, "%s%s has %zu NaN or Inf elements (unwritten, or not finite)",
                          n ? "; " : "", GRAD_NAMES[g], check->unwritten[g]);
        else if (!(check->rel_l2[g] <= BACKWARD_REL_L2_TOL))
            n += snprintf(why + n, len - n, "%s%s rel_l2 %.2e above %.0e", n ? "; " : "", GRAD_NAMES[g],
                          check->rel_l2[g], BACKWARD_REL_L2_TOL);
    }
}

// --backward, once the chapter's forward has made O and LSE (args): the backward's buffers, its checked
// run (dQ, dK, dV poisoned with NaN first), the check of the forward and of the gradients, --output, the
// timing of the backward alone and the report. d_o: dO on the device; workspace: the forward's.
static int run_backward(const Options *o, const DataPaths *paths, const AttnArgs *args, const __half *d_o,
                        size_t workspace, size_t grad_workspace, cudaStream_t stream, const cudaDeviceProp *prop) {
    const AttnShape *s = &o->shape;
    const size_t in_bytes = elems_qkv(s) * sizeof(__half), lse_bytes = elems_lse(s) * sizeof(float);
    BackwardArgs grad = {*s,  args->q, args->k, args->v, args->o, args->lse,
                         d_o, NULL,    NULL,    NULL,    NULL,    o->deterministic};
    __half **dev_grad[3] = {&grad.dq, &grad.dk, &grad.dv};
    for (int g = 0; g < 3; g++) {
        CUDA_CHECK(cudaMalloc(dev_grad[g], in_bytes));
        CUDA_CHECK(cudaMemsetAsync(*dev_grad[g], 0xFF, in_bytes, stream));  // NaN: what is left unwritten shows
    }
    if (grad_workspace) CUDA_CHECK(cudaMalloc(&grad.workspace, grad_workspace));
    run_pass(args, &grad, stream, PART_BACKWARD);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    require_no_todo();
    // Every buffer the harness allocated: Q, K, V, O, dO, dQ, dK, dV, LSE and both workspaces.
    const size_t device_bytes = 8 * in_bytes + lse_bytes + workspace + grad_workspace;

    __half *host_o = (__half *)malloc(in_bytes), *host_grad[3];
    float *host_lse = (float *)malloc(lse_bytes);
    if (!host_o || !host_lse) die(EXIT_FAILED, "out of host memory");
    CUDA_CHECK(cudaMemcpy(host_o, args->o, in_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(host_lse, args->lse, lse_bytes, cudaMemcpyDeviceToHost));
    for (int g = 0; g < 3; g++) {
        if (!(host_grad[g] = (__half *)malloc(in_bytes))) die(EXIT_FAILED, "out of host memory");
        CUDA_CHECK(cudaMemcpy(host_grad[g], *dev_grad[g], in_bytes, cudaMemcpyDeviceToHost));
    }
    CheckResult forward;
    GradCheck check;
    memset(&forward, 0, sizeof forward);
    memset(&check, 0, sizeof check);
    if (o->check) {
        forward = check_outputs(o, paths, host_o, host_lse);
        check = check_grads(o, paths, host_grad);
    }
    if (o->output_dir) write_outputs(o->output_dir, s, host_o, host_lse, host_grad);

    int kernels = kernels_per_pass(args, &grad, stream, PART_BACKWARD);
    float ms = time_pass(o, args, &grad, stream, PART_BACKWARD);
    double tflops = backward_flops(s) / (ms * 1e-3) / 1e12;
    const int passed = forward.passed && check.passed;
    const char *status = !o->check ? "unchecked" : passed ? "PASS" : "FAIL";
    char why[1024] = "";
    if (o->check) backward_failures(&forward, &check, why, sizeof why);

    if (o->csv) {
        // The impl names the mode, so that rows of the two modes are told apart (09_backward.deterministic).
        printf("%s%s,%d,%d,%d,%d,%d,fp16,%.4f,%.2f,", chapter.name, o->deterministic ? ".deterministic" : "", s->batch,
               s->heads, s->seqlen, s->headdim, s->causal, ms, tflops);
        if (o->check) printf("%.3e,%s,%.3e,,", check.worst_rel_l2, status, check.worst_max_abs);  // no lse_err
        else printf(",%s,,,", status);
        printf("%d,%zu,,,,%zu,", kernels, grad_workspace, device_bytes);  // no prepare_ms, attend_ms, rel_l2_floor
        if (o->check) printf("%.3e,%.3e,%.3e\n", check.rel_l2[0], check.rel_l2[1], check.rel_l2[2]);
        else printf(",,\n");
        if (*why) fprintf(stderr, "%s: FAIL: %s\n", chapter.name, why);
    } else {
        print_backward_plan(o, workspace, grad_workspace, o->check ? paths : NULL);
        printf("  gpu       %s (sm_%d%d), %d kernel%s per backward\n", prop->name, prop->major, prop->minor, kernels,
               kernels == 1 ? "" : "s");
        if (o->check) {
            print_check("forward", &forward, s, forward.passed ? "PASS" : "FAIL");
            for (int g = 0; g < 3; g++)
                printf("  check %s  rel_l2 %.2e (tol %.0e)  max_abs %.2e  rows %lld of %d per head%s\n", GRAD_NAMES[g],
                       check.rel_l2[g], BACKWARD_REL_L2_TOL, check.max_abs[g], check.rows_checked[g], s->seqlen,
                       check.unwritten[g] ? "  UNWRITTEN OUTPUTS" : "");
            if (passed)
                printf("  check     PASS: dQ, dK and dV each within rel L2 %.0e, the forward within its tolerance\n",
                       BACKWARD_REL_L2_TOL);
            else printf("  check     FAIL: %s\n", why);
        }
        printf(
            "  time      %.4f ms the backward alone (median of %d, %d warm-up%s)  %.2f TFLOP/s (2.5x the forward's "
            "FLOPs)  %.0f GB/s of the minimum traffic\n",
            ms, o->iters, o->warmup, o->flush_l2 ? ", L2 flushed before each" : "", tflops,
            backward_bytes(s) / (ms * 1e-3) / 1e9);
        printf("  device    %.1f MB allocated: Q, K, V, O, LSE, dO, dQ, dK, dV and the workspaces\n",
               device_bytes / 1e6);
        if (o->output_dir) print_output_paths(o);
    }
    for (int g = 0; g < 3; g++) {
        CUDA_CHECK(cudaFree(*dev_grad[g]));
        free(host_grad[g]);
    }
    if (grad.workspace) CUDA_CHECK(cudaFree(grad.workspace));
    free(host_o);
    free(host_lse);
    return (!o->check || passed) ? EXIT_PASS : EXIT_FAILED;
}

// ---------------------------------------------------------------------------
// Decoding (--decode): its inputs, the checked run, the timing, the report
// ---------------------------------------------------------------------------

static size_t decode_q_elems(const DecodeShape *d) {
    return (size_t)d->batch * d->q_heads * d->new_tokens * d->headdim;
}
static size_t decode_pool_elems(const DecodeShape *d) {
    return (size_t)d->pages * d->kv_heads * d->page_size * d->headdim;
}

// Bytes of one cached K or V element: 2 (fp16) or 1 (--kv-cache e4m3).
static size_t decode_elem_bytes(const Options *o) { return o->kv_e4m3 ? 1 : sizeof(__half); }

// The bytes a decoding step must read: K and V of every cached token, each KV head's once, at the
// cache's element size.
static double decode_kv_bytes(const Options *o) {
    const DecodeShape *d = &o->dshape;
    double tokens = 0;
    for (int b = 0; b < d->batch; b++) tokens += o->lengths[b];
    return 2.0 * tokens * d->kv_heads * d->headdim * decode_elem_bytes(o);
}

// What the harness allocates: Q, the pools (and an e4m3 cache's scales), the table and lengths, O and LSE.
static double decode_device_bytes(const Options *o) {
    const DecodeShape *d = &o->dshape;
    return 2.0 * decode_q_elems(d) * sizeof(__half) + 2.0 * decode_pool_elems(d) * decode_elem_bytes(o) +
           (o->kv_e4m3 ? 2.0 * d->kv_heads * sizeof(float) : 0.0) +
           ((double)d->batch * d->max_pages + d->batch) * sizeof(int) +
           (double)d->batch * d->q_heads * d->new_tokens * sizeof(float);
}

// A decoding reference file: O or LSE ("o", "lse") of the fp16 cache, or of the e4m3 one
// (reference.py decode_paths).
static void decode_ref_file(char *out, size_t len, const char *scale, int e4m3, const char *part) {
    snprintf(out, len, "ref_decode_s%s%s_%s.npy", scale, e4m3 ? "_e4m3" : "", part);
}

// The options that ask reference.py decode for the references a run checks against: none unchecked
// (--no-ref), the e4m3 cache's beside the fp16 one with --kv-cache e4m3. argv ends in three NULLs.
static void ask_for_references(const Options *o, const char **argv, size_t count) {
    const size_t end = count - 3;
    if (!o->check) argv[end] = "--no-ref";
    else if (o->kv_e4m3) argv[end] = "--kv-cache", argv[end + 1] = "e4m3";
}

static int decode_max_length(const Options *o) {
    int longest = 0;
    for (int b = 0; b < o->dshape.batch; b++) longest = o->lengths[b] > longest ? o->lengths[b] : longest;
    return longest;
}

// The cache folder of a decoding shape: its dimensions, a hash of its lengths, the seed.
static void decode_data_dir(const Options *o, char *dir, size_t len) {
    const DecodeShape *d = &o->dshape;
    char root[4096];
    uint64_t h = 1469598103934665603ULL;
    for (int b = 0; b < d->batch; b++)
        for (int i = 0; i < 4; i++) h = (h ^ (unsigned)((o->lengths[b] >> (8 * i)) & 0xff)) * 1099511628211ULL;
    format_path(dir, len, "%s/decode_b%d_hq%d_hkv%d_n%d_d%d_p%d_l%016llx_seed%llu", cache_root(root, sizeof root),
                d->batch, d->q_heads, d->kv_heads, d->new_tokens, d->headdim, d->page_size, (unsigned long long)h,
                o->seed);
}

// Whether dir lacks one of the decoding reference's files at this scale: the fp16 cache's, and with an e4m3
// cache its own too.
static int decode_ref_missing(const Options *o, const char *dir, const char *scale) {
    char path[4096], file[128];
    const char *parts[2] = {"o", "lse"};
    int missing = 0;
    for (int e4m3 = 0; e4m3 <= o->kv_e4m3; e4m3++)
        for (int i = 0; i < 2; i++) {
            decode_ref_file(file, sizeof file, scale, e4m3, parts[i]);
            join(path, sizeof path, dir, file), missing |= !file_exists(path);
        }
    return missing;
}

// Run reference.py decode where its inputs, or (checking) its reference, are missing.
static void prepare_decode_data(const Options *o, const char *dir, const char *scale) {
    const DecodeShape *d = &o->dshape;
    char path[4096];
    int missing = o->check && decode_ref_missing(o, dir, scale);
    for (int i = 0; i < 5; i++) join(path, sizeof path, dir, DECODE_INPUTS[i]), missing |= !file_exists(path);
    if (!missing) return;
    char num[6][32], seed[32];
    char *lengths = (char *)malloc((size_t)d->batch * 12 + 1);
    if (!lengths) die(EXIT_FAILED, "out of host memory");
    size_t at = 0;
    for (int b = 0; b < d->batch; b++) at += sprintf(lengths + at, b ? ",%d" : "%d", o->lengths[b]);
    const int values[6] = {d->batch, d->q_heads, d->kv_heads, d->new_tokens, d->headdim, d->page_size};
    for (int i = 0; i < 6; i++) snprintf(num[i], sizeof num[i], "%d", values[i]);
    snprintf(seed, sizeof seed, "%llu", o->seed);
    const char *argv[] = {"decode", "--out",  dir,    "--batch",   num[0], "--heads",     num[1], "--kv-heads",
                          num[2],   "--new",  num[3], "--headdim", num[4], "--page-size", num[5], "--lengths",
                          lengths,  "--seed", seed,   "--scale",   scale,  NULL,          NULL,   NULL};
    ask_for_references(o, argv, sizeof argv / sizeof *argv);
    run_reference(argv);
    free(lengths);
}

// The reference cache of a --decode --input folder: named by a hash of its five files, as the forward's.
static void decode_input_ref_dir(const Options *o, char *dir, size_t len) {
    char root[4096], path[4096];
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < 5; i++) join(path, sizeof path, o->input_dir, DECODE_INPUTS[i]), h = hash_file(path, h);
    format_path(dir, len, "%s/decode_input_%016llx", cache_root(root, sizeof root), (unsigned long long)h);
}

// Run reference.py decode --input where the reference of an --input folder is missing from its cache (dir).
static void prepare_decode_reference(const Options *o, const char *dir, const char *scale) {
    if (!decode_ref_missing(o, dir, scale)) return;
    const char *argv[] = {"decode", "--input", o->input_dir, "--out", dir, "--scale", scale, NULL, NULL, NULL};
    ask_for_references(o, argv, sizeof argv / sizeof *argv);
    run_reference(argv);
}

// Load reference.py decode's inputs for o->dshape into *in; the int64 table as the ints the chapter reads,
// the lengths checked against the command line's (a stale cache otherwise), which the chapter is given.
static void load_decode_inputs(const Options *o, const char *dir, DecodeHost *in) {
    const DecodeShape *d = &o->dshape;
    const long long q_shape[4] = {d->batch, d->q_heads, d->new_tokens, d->headdim};
    const long long pool_shape[4] = {d->pages, d->kv_heads, d->page_size, d->headdim};
    const long long table_shape[2] = {d->batch, d->max_pages}, lengths_shape[1] = {d->batch};
    in->q = (__half *)load_array(dir, DECODE_INPUTS[0], NPY_F16, 4, q_shape, NULL);
    in->k_pool = (__half *)load_array(dir, DECODE_INPUTS[1], NPY_F16, 4, pool_shape, NULL);
    in->v_pool = (__half *)load_array(dir, DECODE_INPUTS[2], NPY_F16, 4, pool_shape, NULL);
    int64_t *table64 = (int64_t *)load_array(dir, DECODE_INPUTS[3], NPY_I64, 2, table_shape, NULL);
    int64_t *lengths64 = (int64_t *)load_array(dir, DECODE_INPUTS[4], NPY_I64, 1, lengths_shape, NULL);
    in->table = (int *)malloc((size_t)d->batch * d->max_pages * sizeof(int));
    if (!in->table) die(EXIT_FAILED, "out of host memory");
    for (size_t i = 0; i < (size_t)d->batch * d->max_pages; i++)  // -1 past a sequence's pages; a page below 2^31
        in->table[i] = table64[i] >= -1 && table64[i] < d->pages ? (int)table64[i] : (int)d->pages;
    for (int b = 0; b < d->batch; b++)
        if (lengths64[b] != o->lengths[b])
            die(EXIT_USAGE, "%s/%s: sequence %d caches %lld tokens, the command line says %d (stale cache? delete it)",
                shown(dir), DECODE_INPUTS[4], b, (long long)lengths64[b], o->lengths[b]);
    char problem[256];
    if (decode_cache_problem(d, o->lengths, in->table, problem, sizeof problem))
        die(EXIT_USAGE, "%s/%s: %s", shown(dir), DECODE_INPUTS[3], problem);
    free(table64);
    free(lengths64);
}

// Rel L2 of O against a reference file's O (every row), and its max abs error.
static double decode_o_rel_l2(const DecodeShape *d, const char *dir, const char *o_file, const __half *out,
                              double *max_abs) {
    const long long o_shape[4] = {d->batch, d->q_heads, d->new_tokens, d->headdim};
    double *want = (double *)load_array(dir, o_file, NPY_F64, 4, o_shape, NULL);
    // O as a [B, Hq, Nq, D] problem whose every row is checked.
    const AttnShape as_rows = {d->batch, d->q_heads, d->new_tokens, d->headdim, 0, d->scale};
    int64_t rows[DECODE_MAX_NEW];
    for (int i = 0; i < d->new_tokens; i++) rows[i] = i;
    const double rel_l2 = rel_l2_over_rows(&as_rows, out, want, rows, d->new_tokens, max_abs);
    free(want);
    return rel_l2;
}

// O against the float64 reference of the cache the chapter read (fp16, or e4m3 with --kv-cache e4m3),
// rel L2 over every element, max abs, LSE's max abs error, and what was left unwritten; passed by the
// chapter's precision rule.
static CheckResult check_decode_outputs(const DecodeShape *d, const char *dir, const char *scale, int e4m3,
                                        const __half *out, const float *lse) {
    CheckResult r;
    memset(&r, 0, sizeof r);
    char o_file[128], lse_file[128];
    decode_ref_file(o_file, sizeof o_file, scale, e4m3, "o");
    decode_ref_file(lse_file, sizeof lse_file, scale, e4m3, "lse");
    const long long lse_shape[3] = {d->batch, d->q_heads, d->new_tokens};
    double *want_lse = (double *)load_array(dir, lse_file, NPY_F64, 3, lse_shape, NULL);
    r.rel_l2 = decode_o_rel_l2(d, dir, o_file, out, &r.max_abs);
    const size_t n_lse = (size_t)d->batch * d->q_heads * d->new_tokens;
    for (size_t i = 0; i < n_lse; i++) {
        const double e = fabs((double)lse[i] - want_lse[i]);
        if (!(e <= r.lse_err) && !isnan(r.lse_err)) r.lse_err = e;
    }
    r.unwritten = count_not_finite(out, decode_q_elems(d));
    for (size_t i = 0; i < n_lse; i++) r.unwritten += !isfinite(lse[i]);
    const PrecisionRule *rule = precision_rule(chapter.precision);
    r.rel_l2_tol = rule->rel_l2_tol;
    r.lse_tol = rule->lse_tol;
    r.rows_checked = d->new_tokens;
    r.passed = r.unwritten == 0 && r.rel_l2 <= r.rel_l2_tol && r.lse_err <= r.lse_tol;
    free(want_lse);
    return r;
}

static void print_decode_shape(const Options *o, int max_length) {
    const DecodeShape *d = &o->dshape;
    printf("%s: %s\n", chapter.name, chapter.adds);
    printf(
        "  decode    B=%d Hq=%d Hkv=%d (groups of %d) Nq=%d D=%d, cache up to %d tokens in pages of %d (%lld pages), "
        "scale %.6g\n",
        d->batch, d->q_heads, d->kv_heads, d->q_heads / d->kv_heads, d->new_tokens, d->headdim, max_length,
        d->page_size, d->pages, d->scale);
}

// This GPU's device-to-device copy bandwidth in TB/s as `make peaks` measured it, read from its log
// (path: where it is, or would be); 0 where make peaks has not run on this GPU.
static double measured_copy_tbps(const char *gpu, char *path, size_t len) {
    char name[256], line[512];
    gpu_file_name(gpu, name, sizeof name);
    format_path(path, len, "%s/docs/results/logs/common/peaks_%s.log", FA_ROOT, name);
    FILE *f = fopen(path, "r");
    double tbps = 0.0;
    while (f && fgets(line, sizeof line, f)) {  // "device-to-device copy (cudaMemcpyAsync)   4.24 TB/s ..."
        const char *after = strchr(line, ')');
        if (strncmp(line, "device-to-device copy", 21) == 0 && after && sscanf(after + 1, "%lf TB/s", &tbps) == 1)
            break;
    }
    if (f) fclose(f);
    return tbps;
}

// An e4m3 cache's conversions (cvt ... e4m3x2) exist from sm_89: below, the run is skipped with its reason.
static void require_e4m3_gpu(const cudaDeviceProp *prop) {
    const int sm = prop->major * 10 + prop->minor;
    if (sm >= 89) return;
    printf("%s: skipped: --kv-cache e4m3 needs sm_89 or newer (e4m3 conversions), this GPU (%s) is sm_%d\n",
           chapter.name, prop->name, sm);
    exit(EXIT_SKIP);
}

// One decoding step (median_time's and kernels_of's RunOnce).
static void run_decode_once(const void *what, cudaStream_t stream) {
    check_launch(chapter.decode->decode((const DecodeArgs *)what, stream), "decoding pass");
}

// The decoding step of the chapter: checked, timed, reported; its exit code.
static int run_decode(const Options *o) {
    const DecodeShape *d = &o->dshape;
    const int max_length = decode_max_length(o);
    const size_t workspace = chapter.decode->workspace_bytes ? chapter.decode->workspace_bytes(d, max_length) : 0;
    const double kv_bytes = decode_kv_bytes(o), device_bytes = decode_device_bytes(o);
    const char *cache = o->kv_e4m3 ? "e4m3" : "fp16";
    char a[32], b[32];
    if (o->dry_run) {
        print_decode_shape(o, max_length);
        printf("  work      %s of K and V to read (%s)\n", human_bytes(kv_bytes, a, sizeof a), cache);
        printf("  memory    inputs+outputs %s, workspace %s\n", human_bytes(device_bytes, a, sizeof a),
               human_bytes((double)workspace, b, sizeof b));
        return EXIT_PASS;
    }
    cudaDeviceProp prop;
    require_gpu(&prop);
    if (o->kv_e4m3) require_e4m3_gpu(&prop);
    require_memory(device_bytes + (double)workspace, workspace, "");
    char dir[4096], scale[64];
    snprintf(scale, sizeof scale, "%.9g", d->scale);
    DecodeHost in = o->host;  // --input: read and checked already (check_decode)
    if (o->input_dir) {
        decode_input_ref_dir(o, dir, sizeof dir);
        if (o->check) prepare_decode_reference(o, dir, scale);
    } else {
        decode_data_dir(o, dir, sizeof dir);
        prepare_decode_data(o, dir, scale);
        load_decode_inputs(o, dir, &in);
    }

    // --kv-cache e4m3: the pools quantised on the host, the fp16 ones then dropped.
    const size_t scale_bytes = d->kv_heads * sizeof(float);
    __nv_fp8_storage_t *host_pool8[2] = {NULL, NULL};
    float *host_scales[2] = {NULL, NULL};
    const __half *host_pool[2] = {in.k_pool, in.v_pool};
    for (int i = 0; i < 2 && o->kv_e4m3; i++) {
        host_pool8[i] = (__nv_fp8_storage_t *)malloc(decode_pool_elems(d));
        host_scales[i] = (float *)malloc(scale_bytes);
        if (!host_pool8[i] || !host_scales[i]) die(EXIT_FAILED, "out of host memory");
        quantize_pool_e4m3(host_pool[i], d->pages, d->kv_heads, (size_t)d->page_size * d->headdim, host_pool8[i],
                           host_scales[i]);
    }

    // Device buffers (the harness owns every allocation): the pools fp16, or e4m3 and their scales.
    const size_t q_bytes = decode_q_elems(d) * sizeof(__half), pool_bytes = decode_pool_elems(d) * decode_elem_bytes(o);
    const size_t table_bytes = (size_t)d->batch * d->max_pages * sizeof(int), lengths_bytes = d->batch * sizeof(int);
    const size_t lse_bytes = (size_t)d->batch * d->q_heads * d->new_tokens * sizeof(float);
    __half *q, *out;
    void *pools[2] = {NULL, NULL};
    float *scales[2] = {NULL, NULL};
    int *table, *lengths;
    float *lse;
    void *work = NULL;
    CUDA_CHECK(cudaMalloc(&q, q_bytes));
    for (int i = 0; i < 2; i++) {
        CUDA_CHECK(cudaMalloc(&pools[i], pool_bytes));
        CUDA_CHECK(cudaMemcpy(pools[i], o->kv_e4m3 ? (const void *)host_pool8[i] : (const void *)host_pool[i],
                              pool_bytes, cudaMemcpyHostToDevice));
        if (!o->kv_e4m3) continue;
        CUDA_CHECK(cudaMalloc(&scales[i], scale_bytes));
        CUDA_CHECK(cudaMemcpy(scales[i], host_scales[i], scale_bytes, cudaMemcpyHostToDevice));
        free(host_pool8[i]), free(host_scales[i]);
    }
    CUDA_CHECK(cudaMalloc(&table, table_bytes));
    CUDA_CHECK(cudaMalloc(&lengths, lengths_bytes));
    CUDA_CHECK(cudaMalloc(&out, q_bytes));
    CUDA_CHECK(cudaMalloc(&lse, lse_bytes));
    if (workspace) CUDA_CHECK(cudaMalloc(&work, workspace));
    CUDA_CHECK(cudaMemcpy(q, in.q, q_bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(table, in.table, table_bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(lengths, o->lengths, lengths_bytes, cudaMemcpyHostToDevice));
    free(in.q), free(in.k_pool), free(in.v_pool), free(in.table);
    DecodeArgs args = {*d,  q,   (const __half *)pools[0], (const __half *)pools[1], table, lengths, max_length, out,
                       lse, work};
    const DecodeE4m3 e4m3 = {(const __nv_fp8_e4m3 *)pools[0], (const __nv_fp8_e4m3 *)pools[1], scales[0], scales[1]};
    if (o->kv_e4m3) args.k_pool = args.v_pool = NULL, args.e4m3 = &e4m3;
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));

    // The checked run, on O and LSE filled with NaN (all bits set), then the timed ones.
    CUDA_CHECK(cudaMemsetAsync(out, 0xff, q_bytes, stream));
    CUDA_CHECK(cudaMemsetAsync(lse, 0xff, lse_bytes, stream));
    run_decode_once(&args, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    require_no_todo();
    CheckResult check;
    memset(&check, 0, sizeof check);
    check.passed = 1;
    double cache_rel_l2 = 0.0, cache_max_abs = 0.0;  // --kv-cache e4m3: O against the fp16 cache's reference
    if (o->check) {
        __half *host_o = (__half *)malloc(q_bytes);
        float *host_lse = (float *)malloc(lse_bytes);
        if (!host_o || !host_lse) die(EXIT_FAILED, "out of host memory");
        CUDA_CHECK(cudaMemcpy(host_o, out, q_bytes, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(host_lse, lse, lse_bytes, cudaMemcpyDeviceToHost));
        check = check_decode_outputs(d, dir, scale, o->kv_e4m3, host_o, host_lse);
        if (o->kv_e4m3) {
            char fp16_o[128];
            decode_ref_file(fp16_o, sizeof fp16_o, scale, 0, "o");
            cache_rel_l2 = decode_o_rel_l2(d, dir, fp16_o, host_o, &cache_max_abs);
        }
        free(host_o), free(host_lse);
    }
    const int kernels = kernels_of(stream, run_decode_once, &args);
    const float median = median_time(o, stream, run_decode_once, &args);
    const double gbps = kv_bytes / (median * 1e-3) / 1e9;
    const char *status = !o->check ? "unchecked" : check.passed ? "PASS" : "FAIL";
    if (o->csv) {  // the impl names an e4m3 cache (11_decode.e4m3); cache_rel_l2 is its column alone
        printf("%s%s,%d,%d,%d,%d,%d,%d,%d,%.4f,%.1f,%.4g,%s,%.4g,%.4g,%d,%zu,%.0f,", chapter.name,
               o->kv_e4m3 ? ".e4m3" : "", d->batch, d->q_heads, d->kv_heads, d->new_tokens, max_length, d->page_size,
               d->headdim, median, gbps, check.rel_l2, status, check.max_abs, check.lse_err, kernels, workspace,
               device_bytes + (double)workspace);
        if (o->kv_e4m3 && o->check) printf("%.4g", cache_rel_l2);
        printf("\n");
    } else {
        print_decode_shape(o, max_length);
        printf("  gpu       %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
        printf("  time      %.4f ms (median of %d), %.1f GB/s of K and V (%s, %s), %d kernel%s\n", median, o->iters,
               gbps, human_bytes(kv_bytes, a, sizeof a), cache, kernels, kernels == 1 ? "" : "s");
        char peaks[4096];
        const double copy_tbps = measured_copy_tbps(prop.name, peaks, sizeof peaks);
        if (copy_tbps > 0)
            printf("  bandwidth %.0f%% of this GPU's device-to-device copy, %.2f TB/s (make peaks: %s)\n",
                   gbps / 10.0 / copy_tbps, copy_tbps, peaks);
        else printf("  bandwidth against the copy: not measured on this GPU (make peaks writes %s)\n", peaks);
        if (o->check)
            printf("  check     O rel L2 %.3g (<= %.0e), max abs %.3g; LSE max abs %.3g (<= %.0e)%s: %s\n",
                   check.rel_l2, check.rel_l2_tol, check.max_abs, check.lse_err, check.lse_tol,
                   check.unwritten ? ", elements left unwritten" : "", status);
        if (o->check && o->kv_e4m3)
            printf(
                "  cache     e4m3, a scale per KV head: the check is against the e4m3 cache's reference; against "
                "the fp16 cache's, O rel L2 %.3g, max abs %.3g (what e4m3 storage costs, not checked)\n",
                cache_rel_l2, cache_max_abs);
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
    void *buffers[] = {q, pools[0], pools[1], scales[0], scales[1], table, lengths, out, lse, work};
    for (size_t i = 0; i < sizeof buffers / sizeof *buffers; i++) CUDA_CHECK(cudaFree(buffers[i]));
    return check.passed ? EXIT_PASS : EXIT_FAILED;
}

int main(int argc, char **argv) {
    Options o = parse_args(argc, argv);
    check_decode(&o);
    if (o.decode) return run_decode(&o);
    // Said before anything about the inputs or the output folder: fixing those would not make it run.
    if (o.backward && !chapter.backward)
        die(EXIT_USAGE,
            "this chapter has no backward pass (--backward): drop it, or run it on a chapter that registers one");
    if (o.backward && !chapter.backward->backward)
        die(EXIT_FAILED, "the chapter's Backward has no backward function: name its launcher there");
    if (o.deterministic && !o.backward)
        die(EXIT_USAGE, "%s",
            chapter.backward ? "--deterministic is a mode of the backward pass: add --backward, or drop it"
                             : "--deterministic is a mode of the backward pass (--backward), which this chapter "
                               "has not: drop it, or run it on a chapter that registers one");
    if (o.deterministic && !chapter.backward->deterministic)
        die(EXIT_USAGE, "this backward has no deterministic mode (--deterministic): drop it, or run the chapter's");
    if (o.output_dir) check_output_dir(o.output_dir, output_count(&o));
    if (o.input_dir) shape_from_input(&o);
    validate_shape(&o.shape);
    if (!o.scale_given) o.shape.scale = 1.0f / sqrtf((float)o.shape.headdim);
    const AttnShape *s = &o.shape;
    const int inputs = input_count(&o);
    // --input files are read once, here, and checked before any GPU work.
    __half *host_in[4] = {NULL, NULL, NULL, NULL};
    if (o.input_dir) {
        load_inputs(o.input_dir, s, inputs, host_in);
        check_finite(o.input_dir, s, inputs, host_in);
    }
    size_t workspace = chapter.workspace_bytes ? chapter.workspace_bytes(s) : 0;
    size_t grad_workspace =
        o.backward && chapter.backward->workspace_bytes ? chapter.backward->workspace_bytes(s, o.deterministic) : 0;
    if (o.dry_run) {
        if (o.backward) {
            DataPaths paths = data_paths(&o);
            print_backward_plan(&o, workspace, grad_workspace, o.check ? &paths : NULL);
        } else {
            print_plan(&o, workspace);
        }
        for (int i = 0; i < inputs; i++) free(host_in[i]);
        return EXIT_PASS;
    }

    cudaDeviceProp prop;
    require_gpu(&prop);
    if (o.flush_l2) {
        l2_flush_bytes = 2 * (size_t)prop.l2CacheSize;
        CUDA_CHECK(cudaMalloc(&l2_flush, l2_flush_bytes));
    }
    if (o.backward)
        require_memory(backward_bytes(s) + (double)workspace + (double)grad_workspace, workspace + grad_workspace, "");
    else
        require_memory(min_bytes(s) + (double)workspace, workspace,
                       workspace ? " (the fused chapters, 04 on, need no N^2 scratch)" : "");
    DataPaths paths = data_paths(&o);
    prepare_data(&o, &paths);

    // Host inputs (generated ones are read now), then device buffers (the harness owns every allocation).
    if (!o.input_dir) load_inputs(paths.data_dir, s, inputs, host_in);
    __half *dev_in[4] = {NULL, NULL, NULL, NULL};
    size_t in_bytes = elems_qkv(s) * sizeof(__half), lse_bytes = elems_lse(s) * sizeof(float);
    for (int i = 0; i < inputs; i++) {
        CUDA_CHECK(cudaMalloc(&dev_in[i], in_bytes));
        CUDA_CHECK(cudaMemcpy(dev_in[i], host_in[i], in_bytes, cudaMemcpyHostToDevice));
        free(host_in[i]);
    }
    AttnArgs args = {*s, dev_in[0], dev_in[1], dev_in[2], NULL, NULL, NULL};
    CUDA_CHECK(cudaMalloc(&args.o, in_bytes));
    CUDA_CHECK(cudaMalloc(&args.lse, lse_bytes));
    if (workspace) CUDA_CHECK(cudaMalloc(&args.workspace, workspace));
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));

    // One checked run: poison every output element with NaN first (0xFF bytes).
    CUDA_CHECK(cudaMemsetAsync(args.o, 0xFF, in_bytes, stream));
    CUDA_CHECK(cudaMemsetAsync(args.lse, 0xFF, lse_bytes, stream));
    run_pass(&args, NULL, stream, PART_WHOLE);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    require_no_todo();  // a student copy whose kernel reached an unwritten part
    int code = EXIT_PASS;
    if (o.backward) {
        code = run_backward(&o, &paths, &args, dev_in[3], workspace, grad_workspace, stream, &prop);
    } else {
        // The device memory the chapter needs: every buffer the harness allocated for it. (Counted, not
        // read from cudaMemGetInfo, which sees every process on the GPU.)
        size_t device_bytes = 4 * in_bytes + lse_bytes + workspace;
        __half *host_o = (__half *)malloc(in_bytes);
        float *host_lse = (float *)malloc(lse_bytes);
        if (!host_o || !host_lse) die(EXIT_FAILED, "out of host memory");
        CUDA_CHECK(cudaMemcpy(host_o, args.o, in_bytes, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(host_lse, args.lse, lse_bytes, cudaMemcpyDeviceToHost));
        CheckResult check;
        memset(&check, 0, sizeof check);
        if (o.check) check = check_outputs(&o, &paths, host_o, host_lse);
        if (o.output_dir) write_outputs(o.output_dir, s, host_o, host_lse, NULL);

        int kernels = kernels_per_pass(&args, NULL, stream, PART_WHOLE);
        // A chapter that prepares its inputs (08: quantisation) has each part timed too, in the same runs.
        float ms = 0, prepare_ms = 0, attend_ms = 0;
        if (chapter.prepare) time_parts(&o, &args, stream, &ms, &prepare_ms, &attend_ms);
        else ms = time_pass(&o, &args, NULL, stream, PART_WHOLE);
        double tflops = forward_flops(s) / (ms * 1e-3) / 1e12;
        const char *status = !o.check ? "unchecked" : check.passed ? "PASS" : "FAIL";
        const PrecisionRule *rule = precision_rule(chapter.precision);

        if (o.csv) {
            printf("%s,%d,%d,%d,%d,%d,%s,%.4f,%.2f,", chapter.name, s->batch, s->heads, s->seqlen, s->headdim,
                   s->causal, rule->dtype, ms, tflops);
            if (o.check) printf("%.3e,%s,%.3e,%.3e,", check.rel_l2, status, check.max_abs, check.lse_err);
            else printf(",%s,,,", status);
            printf("%d,%zu,", kernels, workspace);
            if (chapter.prepare) printf("%.4f,%.4f,", prepare_ms, attend_ms);
            else printf(",,");
            if (o.check && rule->floor_factor > 0) printf("%.3e", check.floor);
            printf(",%zu,,,\n", device_bytes);  // dq_rel_l2, dk_rel_l2, dv_rel_l2: the backward's
        } else {
            print_plan(&o, workspace);
            printf("  gpu       %s (sm_%d%d), %d kernel%s per forward\n", prop.name, prop.major, prop.minor, kernels,
                   kernels == 1 ? "" : "s");
            if (o.check) print_check("check", &check, s, status);
            printf("  time      %.4f ms (median of %d, %d warm-up%s)  %.2f TFLOP/s  %.0f GB/s of the minimum traffic\n",
                   ms, o.iters, o.warmup, o.flush_l2 ? ", L2 flushed before each" : "", tflops,
                   min_bytes(s) / (ms * 1e-3) / 1e9);
            if (chapter.prepare)
                printf("  parts     prepare %.4f ms (%.0f%% of the forward), attention alone %.4f ms = %.2f TFLOP/s\n",
                       prepare_ms, 100.0 * prepare_ms / ms, attend_ms, forward_flops(s) / (attend_ms * 1e-3) / 1e12);
            printf("  device    %.1f MB allocated: Q, K, V, O, LSE and the workspace\n", device_bytes / 1e6);
            if (o.output_dir) print_output_paths(&o);
        }
        free(host_o);
        free(host_lse);
        code = (!o.check || check.passed) ? EXIT_PASS : EXIT_FAILED;
    }
    for (int i = 0; i < inputs; i++) CUDA_CHECK(cudaFree(dev_in[i]));
    CUDA_CHECK(cudaFree(args.o));
    CUDA_CHECK(cudaFree(args.lse));
    if (args.workspace) CUDA_CHECK(cudaFree(args.workspace));
    if (l2_flush) CUDA_CHECK(cudaFree(l2_flush));
    CUDA_CHECK(cudaStreamDestroy(stream));
    return code;
}
