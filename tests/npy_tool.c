// A small driver of common/npy.c for tests/test_npy.py.
//
//   npy_tool info FILE                  print "dtype <name> shape <d0,d1,...> count <n> offset <bytes>"
//   npy_tool dump FILE                  print every element's bits as hex, one a line
//   npy_tool write FILE DTYPE DIM...    write a deterministic pattern (DTYPE: f2 f4 f8 i8 i4)
//   npy_tool roundtrip IN OUT           load IN (its own dtype) and save it as OUT
//   npy_tool load FILE DTYPE            load FILE as DTYPE (f2 f4 f8 i8 i4), print "count <n>"
//
// Exit codes: 0 done, 2 the reader or writer refused (its message on stderr), 3 bad usage.
// The pattern of element i, exactly representable so that NumPy can recompute it bit for bit:
//   f2: bits (i * 2654435761) mod 0x7c00, sign bit set for odd i   (finite, subnormals included)
//   f4: i * 0.25 - 3.5      f8: i * 0.125 - 1.5      i8: i * 1000003 - 5000000000
//   i4: i * 1000003 - 50000000 (the counts the tests write stay within int32)
#include "npy.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(void) {
    fprintf(stderr,
            "usage: npy_tool info FILE | dump FILE | write FILE DTYPE DIM... | roundtrip IN OUT | load FILE DTYPE\n");
    return 3;
}

static int refused(const char *err) {
    fprintf(stderr, "%s\n", err);
    return 2;
}

static int parse_dtype(const char *text, NpyDtype *dtype) {
    static const char *const names[NPY_DTYPE_COUNT] = {"f2", "f4", "f8", "i8", "i4"};
    for (int i = 0; i < NPY_DTYPE_COUNT; i++) {
        if (strcmp(text, names[i]) == 0) {
            *dtype = (NpyDtype)i;
            return 0;
        }
    }
    return -1;
}

static int info(const char *path) {
    NpyHeader h;
    char err[1024];
    if (npy_read_header(path, &h, err, sizeof err)) return refused(err);
    printf("dtype %s shape ", npy_dtype_name(h.dtype));
    for (int i = 0; i < h.ndim; i++) printf("%s%lld", i ? "," : "", h.shape[i]);
    printf(" count %zu offset %zu\n", h.count, h.data_offset);
    return 0;
}

static int dump(const char *path) {
    NpyHeader h;
    char err[1024];
    if (npy_read_header(path, &h, err, sizeof err)) return refused(err);
    void *data;
    if (npy_load(path, h.dtype, &h, &data, err, sizeof err)) return refused(err);
    size_t size = npy_dtype_size(h.dtype);
    for (size_t i = 0; i < h.count; i++) {
        uint64_t bits = 0;
        memcpy(&bits, (const unsigned char *)data + i * size, size);  // little-endian host
        printf("%llx\n", (unsigned long long)bits);
    }
    free(data);
    return 0;
}

static int write_pattern(const char *path, const char *dtype_text, int ndim, char **dims) {
    NpyDtype dtype;
    if (parse_dtype(dtype_text, &dtype) || ndim > NPY_MAX_DIMS) return usage();
    long long shape[NPY_MAX_DIMS];
    size_t count = 1;
    for (int i = 0; i < ndim; i++) {
        char *end;
        shape[i] = strtoll(dims[i], &end, 10);
        if (end == dims[i] || *end || shape[i] < 0) return usage();
        count *= (size_t)shape[i];
    }
    size_t size = npy_dtype_size(dtype);
    unsigned char *data = (unsigned char *)malloc(count * size + 1);
    if (!data) return refused("out of memory");
    for (size_t i = 0; i < count; i++) {
        unsigned char *at = data + i * size;
        if (dtype == NPY_F16) {
            uint16_t bits = (uint16_t)((i * 2654435761ULL) % 0x7c00);
            if (i % 2) bits |= 0x8000;
            memcpy(at, &bits, 2);
        } else if (dtype == NPY_F32) {
            float v = (float)i * 0.25f - 3.5f;
            memcpy(at, &v, 4);
        } else if (dtype == NPY_F64) {
            double v = (double)i * 0.125 - 1.5;
            memcpy(at, &v, 8);
        } else if (dtype == NPY_I64) {
            int64_t v = (int64_t)i * 1000003 - 5000000000LL;
            memcpy(at, &v, 8);
        } else {
            int32_t v = (int32_t)((int64_t)i * 1000003 - 50000000);
            memcpy(at, &v, 4);
        }
    }
    char err[1024];
    int rc = npy_save(path, dtype, ndim, shape, data, err, sizeof err);
    free(data);
    return rc ? refused(err) : 0;
}

static int roundtrip(const char *in, const char *out) {
    NpyHeader h;
    char err[1024];
    void *data;
    if (npy_read_header(in, &h, err, sizeof err)) return refused(err);
    if (npy_load(in, h.dtype, &h, &data, err, sizeof err)) return refused(err);
    int rc = npy_save(out, h.dtype, h.ndim, h.shape, data, err, sizeof err);
    free(data);
    return rc ? refused(err) : 0;
}

static int load_as(const char *path, const char *dtype_text) {
    NpyDtype dtype;
    if (parse_dtype(dtype_text, &dtype)) return usage();
    NpyHeader h;
    char err[1024];
    void *data;
    if (npy_load(path, dtype, &h, &data, err, sizeof err)) return refused(err);
    printf("count %zu\n", h.count);
    free(data);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "info") == 0) return info(argv[2]);
    if (argc == 3 && strcmp(argv[1], "dump") == 0) return dump(argv[2]);
    if (argc >= 4 && strcmp(argv[1], "write") == 0) return write_pattern(argv[2], argv[3], argc - 4, argv + 4);
    if (argc == 4 && strcmp(argv[1], "roundtrip") == 0) return roundtrip(argv[2], argv[3]);
    if (argc == 4 && strcmp(argv[1], "load") == 0) return load_as(argv[2], argv[3]);
    return usage();
}
