// .npy reader and writer; see npy.h. Format: NumPy's NEP 1
// ("\x93NUMPY", version, header length, a Python dict literal, the data).
#include "npy.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *const DESCR[NPY_DTYPE_COUNT] = {"<f2", "<f4", "<f8", "<i8"};
static const char *const NAME[NPY_DTYPE_COUNT] = {"float16", "float32", "float64", "int64"};
static const size_t SIZE[NPY_DTYPE_COUNT] = {2, 4, 8, 8};

const char *npy_dtype_name(NpyDtype dtype) { return NAME[dtype]; }
size_t npy_dtype_size(NpyDtype dtype) { return SIZE[dtype]; }

static int fail(char *err, size_t err_len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
    return -1;
}

// The header is a Python dict literal, e.g. {'descr': '<f2', 'fortran_order': False,
// 'shape': (2, 3), }: read token by token, so that a key is only ever a key.
static void skip_space(const char **p) {
    while (**p == ' ' || **p == '\t' || **p == '\n' || **p == '\r') (*p)++;
}

// A quoted string ('...' or "...") into out; 0 on success.
static int read_string(const char **p, char *out, size_t out_len) {
    const char quote = **p;
    if (quote != '\'' && quote != '"') return -1;
    const char *end = strchr(*p + 1, quote);
    if (!end || (size_t)(end - *p - 1) >= out_len) return -1;
    memcpy(out, *p + 1, (size_t)(end - *p - 1));
    out[end - *p - 1] = 0;
    *p = end + 1;
    return 0;
}

static int parse_descr(const char **p, NpyDtype *dtype, const char *path, char *err, size_t err_len) {
    char descr[16];
    if (read_string(p, descr, sizeof descr))
        return fail(err, err_len, "%s: cannot read the dtype ('descr') of the .npy header", path);
    for (int i = 0; i < NPY_DTYPE_COUNT; i++) {
        if (strcmp(descr, DESCR[i]) == 0) {
            *dtype = (NpyDtype)i;
            return 0;
        }
    }
    return fail(err, err_len,
                "%s: unsupported dtype '%s' (this reader takes little-endian float16, "
                "float32, float64, int64)",
                path, descr);
}

static int parse_order(const char **p, const char *path, char *err, size_t err_len) {
    if (strncmp(*p, "False", 5) == 0) {
        *p += 5;
        return 0;
    }
    if (strncmp(*p, "True", 4) == 0)
        return fail(err, err_len, "%s: Fortran-order arrays are not supported (save a C-order array)", path);
    return fail(err, err_len, "%s: cannot read 'fortran_order' of the .npy header", path);
}

// A tuple of non-negative integers; the element count must fit in memory's address range.
static int parse_shape(const char **p, NpyHeader *h, const char *path, char *err, size_t err_len) {
    if (**p != '(') return fail(err, err_len, "%s: cannot read the shape of the .npy header", path);
    (*p)++;
    h->ndim = 0;
    h->count = 1;
    for (;;) {
        skip_space(p);
        if (**p == ')') break;
        char *end;
        errno = 0;
        long long dim = strtoll(*p, &end, 10);
        if (end == *p || errno || dim < 0) return fail(err, err_len, "%s: malformed shape in the .npy header", path);
        if (h->ndim == NPY_MAX_DIMS) return fail(err, err_len, "%s: more than %d dimensions", path, NPY_MAX_DIMS);
        if (dim > 0 && h->count > SIZE_MAX / 8 / (size_t)dim)
            return fail(err, err_len, "%s: the shape in its header has more elements than any memory holds", path);
        h->shape[h->ndim++] = dim;
        h->count *= (size_t)dim;
        *p = end;
        skip_space(p);
        if (**p == ',') (*p)++;
        else if (**p != ')') return fail(err, err_len, "%s: malformed shape in the .npy header", path);
    }
    (*p)++;
    return 0;
}

// The whole dict: exactly the keys descr, fortran_order and shape, each once.
static int parse_dict(const char *dict, NpyHeader *h, const char *path, char *err, size_t err_len) {
    const char *p = dict;
    int seen[3] = {0, 0, 0};
    static const char *const KEYS[3] = {"descr", "fortran_order", "shape"};
    skip_space(&p);
    if (*p++ != '{') return fail(err, err_len, "%s: the .npy header is not a dict", path);
    for (;;) {
        skip_space(&p);
        if (*p == '}') break;
        char key[32];
        if (read_string(&p, key, sizeof key)) return fail(err, err_len, "%s: malformed .npy header", path);
        skip_space(&p);
        if (*p++ != ':') return fail(err, err_len, "%s: malformed .npy header", path);
        skip_space(&p);
        int k = 0;
        while (k < 3 && strcmp(key, KEYS[k]) != 0) k++;
        if (k == 3) return fail(err, err_len, "%s: unexpected key '%s' in the .npy header", path, key);
        if (seen[k]++) return fail(err, err_len, "%s: key '%s' twice in the .npy header", path, key);
        int rc = k == 0   ? parse_descr(&p, &h->dtype, path, err, err_len)
                 : k == 1 ? parse_order(&p, path, err, err_len)
                          : parse_shape(&p, h, path, err, err_len);
        if (rc) return rc;
        skip_space(&p);
        if (*p == ',') p++;
        else if (*p != '}') return fail(err, err_len, "%s: malformed .npy header", path);
    }
    if (!seen[0] || !seen[1] || !seen[2])
        return fail(err, err_len, "%s: .npy header lacks descr, fortran_order or shape", path);
    return 0;
}

int npy_read_header(const char *path, NpyHeader *h, char *err, size_t err_len) {
    // Say what the path is before opening it: opening a FIFO would wait for a writer forever.
    struct stat st;
    if (stat(path, &st) != 0) return fail(err, err_len, "cannot open %s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) return fail(err, err_len, "%s is a directory, not a .npy file", path);
    if (!S_ISREG(st.st_mode))
        return fail(err, err_len, "%s is not a regular file (a FIFO, socket or device), not a .npy file", path);
    if (st.st_size == 0) return fail(err, err_len, "%s is empty (0 bytes), not a .npy file", path);
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, err_len, "cannot open %s: %s", path, strerror(errno));
    unsigned char pre[10];
    int rc = -1;
    char *dict = NULL;
    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0) {
        fail(err, err_len, "%s is not a .npy file (bad magic)", path);
        goto done;
    }
    size_t header_len, prefix;
    if (pre[6] == 1) {
        header_len = pre[8] | (size_t)pre[9] << 8;
        prefix = 10;
    } else if (pre[6] == 2 || pre[6] == 3) {
        unsigned char more[2];
        if (fread(more, 1, 2, f) != 2) {
            fail(err, err_len, "%s: truncated .npy header", path);
            goto done;
        }
        header_len = pre[8] | (size_t)pre[9] << 8 | (size_t)more[0] << 16 | (size_t)more[1] << 24;
        prefix = 12;
    } else {
        fail(err, err_len, "%s: unsupported .npy version %d.%d", path, pre[6], pre[7]);
        goto done;
    }
    dict = (char *)calloc(header_len + 1, 1);
    if (!dict || fread(dict, 1, header_len, f) != header_len) {
        fail(err, err_len, "%s: truncated .npy header", path);
        goto done;
    }
    if (parse_dict(dict, h, path, err, err_len)) goto done;
    h->data_offset = prefix + header_len;
    if (fseek(f, 0, SEEK_END) != 0) {
        fail(err, err_len, "%s: cannot seek: %s", path, strerror(errno));
        goto done;
    }
    long file_size = ftell(f);
    size_t want = h->data_offset + h->count * SIZE[h->dtype];
    if (file_size < 0 || (size_t)file_size != want) {
        fail(err, err_len, "%s: file is %ld bytes, its header promises %zu (%s%s)", path, file_size, want,
             NAME[h->dtype], (size_t)file_size < want ? ", truncated" : ", trailing bytes");
        goto done;
    }
    rc = 0;
done:
    free(dict);
    fclose(f);
    return rc;
}

int npy_load(const char *path, NpyDtype want, NpyHeader *h, void **data, char *err, size_t err_len) {
    *data = NULL;
    if (npy_read_header(path, h, err, err_len)) return -1;
    if (h->dtype != want) return fail(err, err_len, "%s: dtype is %s, expected %s", path, NAME[h->dtype], NAME[want]);
    size_t bytes = h->count * SIZE[want];
    void *buf = malloc(bytes ? bytes : 1);
    FILE *f = fopen(path, "rb");
    if (!buf || !f) {
        free(buf);
        if (f) fclose(f);
        return fail(err, err_len, "cannot read %s: %s", path, buf ? strerror(errno) : "out of memory");
    }
    int ok = fseek(f, (long)h->data_offset, SEEK_SET) == 0 && fread(buf, 1, bytes, f) == bytes;
    fclose(f);
    if (!ok) {
        free(buf);
        return fail(err, err_len, "%s: short read", path);
    }
    *data = buf;
    return 0;
}

int npy_save(const char *path, NpyDtype dtype, int ndim, const long long *shape, const void *data, char *err,
             size_t err_len) {
    char dict[256];
    int len = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (", DESCR[dtype]);
    size_t count = 1;
    for (int i = 0; i < ndim; i++) {
        len += snprintf(dict + len, sizeof dict - len, "%lld,%s", shape[i], i + 1 < ndim ? " " : "");
        count *= (size_t)shape[i];
    }
    len += snprintf(dict + len, sizeof dict - len, "), }");
    // Pad with spaces and a newline so the data starts on a 64-byte boundary.
    size_t total = 10 + (size_t)len + 1;
    size_t padded = (total + 63) / 64 * 64;
    size_t header_len = padded - 10;
    unsigned char pre[10] = {
        0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(header_len & 0xff), (unsigned char)(header_len >> 8)};
    FILE *f = fopen(path, "wb");
    if (!f) return fail(err, err_len, "cannot create %s: %s", path, strerror(errno));
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)len, f) == (size_t)len;
    for (size_t i = (size_t)len; ok && i + 1 < header_len; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    size_t bytes = count * SIZE[dtype];
    ok = ok && (bytes == 0 || fwrite(data, 1, bytes, f) == bytes);
    ok = (fclose(f) == 0) && ok;
    if (!ok) return fail(err, err_len, "cannot write %s: %s", path, strerror(errno));
    return 0;
}
