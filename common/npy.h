// Minimal reader and writer for NumPy's .npy format (versions 1-3, C order,
// little-endian float16/float32/float64/int64/int32): enough to exchange inputs and
// outputs with NumPy without any other dependency.
#pragma once

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { NPY_F16 = 0, NPY_F32, NPY_F64, NPY_I64, NPY_I32, NPY_DTYPE_COUNT } NpyDtype;

#define NPY_MAX_DIMS 8

typedef struct {
    NpyDtype dtype;
    int ndim;
    long long shape[NPY_MAX_DIMS];
    size_t count;        // number of elements
    size_t data_offset;  // bytes from the start of the file to the data
} NpyHeader;

const char *npy_dtype_name(NpyDtype dtype);  // "float16", ...
size_t npy_dtype_size(NpyDtype dtype);       // bytes per element

// Parse and validate the header of `path` (magic, version, dtype, order,
// shape, and that the file holds exactly the data the header promises).
// On failure: returns -1 and writes one sentence, one line, into err.
int npy_read_header(const char *path, NpyHeader *header, char *err, size_t err_len);

// npy_read_header, and the dtype must be `want`: any other, one this reader knows or not, is
// refused with a message naming the one it takes (e.g. '<f2', float16) and how to cast with NumPy.
int npy_read_header_of(const char *path, NpyDtype want, NpyHeader *header, char *err, size_t err_len);

// Load a whole array of dtype `want` into a malloc'd buffer (*data), refusing another dtype as
// npy_read_header_of does.
int npy_load(const char *path, NpyDtype want, NpyHeader *header, void **data, char *err, size_t err_len);

// Write a C-order little-endian array as a version 1.0 .npy file.
int npy_save(const char *path, NpyDtype dtype, int ndim, const long long *shape, const void *data, char *err,
             size_t err_len);

// `text` as one line of printable text, for a message that echoes it (a path, a value typed on a
// command line, a string read from a file): control characters C-style escaped (\n, \t, \r,
// \xNN), a backslash as \\, bytes that are not UTF-8 as \xNN; valid UTF-8 is kept as it is,
// except C1 controls and U+2028/U+2029, which break lines too (escaped byte by byte, \xNN).
// Writes at most out_len bytes, NUL included, ending in "..." when out_len is too short; returns out.
char *npy_printable(const char *text, char *out, size_t out_len);

#ifdef __cplusplus
}
#endif
