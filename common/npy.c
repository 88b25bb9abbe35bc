// .npy reader and writer; see npy.h. Format: NumPy's NEP 1
// ("\x93NUMPY", version, header length, a Python dict literal, the data).
#include "npy.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *const DESCR[NPY_DTYPE_COUNT] = {"<f2", "<f4", "<f8", "<i8", "<i4"};
static const char *const NAME[NPY_DTYPE_COUNT] = {"float16", "float32", "float64", "int64", "int32"};
static const size_t SIZE[NPY_DTYPE_COUNT] = {2, 4, 8, 8, 4};

const char *npy_dtype_name(NpyDtype dtype) { return NAME[dtype]; }
size_t npy_dtype_size(NpyDtype dtype) { return SIZE[dtype]; }

static int fail(char *err, size_t err_len, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
    return -1;
}

// Length of the valid UTF-8 sequence of 2 to 4 bytes at s (before end), 0 when there is none.
static size_t utf8_length(const unsigned char *s, const unsigned char *end) {
    size_t n;
    unsigned lo = 0x80, hi = 0xBF;  // the second byte's range: no overlong forms, surrogates or > U+10FFFF
    if (s[0] >= 0xC2 && s[0] <= 0xDF) n = 2;
    else if (s[0] >= 0xE0 && s[0] <= 0xEF) n = 3, lo = s[0] == 0xE0 ? 0xA0 : 0x80, hi = s[0] == 0xED ? 0x9F : 0xBF;
    else if (s[0] >= 0xF0 && s[0] <= 0xF4) n = 4, lo = s[0] == 0xF0 ? 0x90 : 0x80, hi = s[0] == 0xF4 ? 0x8F : 0xBF;
    else return 0;
    if ((size_t)(end - s) < n || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < n; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return n;
}

// The piece of text at s: its bytes, or their escape, into piece; returns its size and sets *used
// to the bytes of s it stands for (npy_printable's rules).
static size_t printable_piece(const unsigned char *s, const unsigned char *end, char piece[16], size_t *used) {
    size_t u = utf8_length(s, end);
    int breaks_lines = (u == 2 && s[0] == 0xC2 && s[1] < 0xA0) ||  // C1 controls, U+0080 .. U+009F
                       (u == 3 && s[0] == 0xE2 && s[1] == 0x80 && (s[2] == 0xA8 || s[2] == 0xA9));
    *used = u ? u : 1;
    if (u && !breaks_lines) {
        memcpy(piece, s, u);
        return u;
    }
    if (u) {
        for (size_t i = 0; i < u; i++) snprintf(piece + 4 * i, 5, "\\x%02x", s[i]);
        return 4 * u;
    }
    if (*s == '\n' || *s == '\t' || *s == '\r' || *s == '\\') {
        piece[0] = '\\';
        piece[1] = *s == '\n' ? 'n' : *s == '\t' ? 't' : *s == '\r' ? 'r' : '\\';
        return 2;
    }
    if (*s < 0x20 || *s >= 0x7F) return (size_t)snprintf(piece, 16, "\\x%02x", *s);
    piece[0] = (char)*s;
    return 1;
}

// The bytes [text, text + len) as printable text (npy_printable's rules).
static char *printable(const char *text, size_t len, char *out, size_t out_len) {
    if (out_len < 4) {  // no room for anything but an empty string
        if (out_len) out[0] = 0;
        return out;
    }
    const unsigned char *s = (const unsigned char *)text, *end = s + len;
    char piece[16];
    size_t used, total = 0;
    for (const unsigned char *c = s; c < end; c += used) total += printable_piece(c, end, piece, &used);
    // All of it when it fits; else pieces while "..." still fits after them, then "...".
    const size_t reserve = total + 1 <= out_len ? 1 : 4;
    size_t n = 0;
    for (; s < end; s += used) {
        size_t size = printable_piece(s, end, piece, &used);
        if (n + size + reserve > out_len) {
            memcpy(out + n, "...", 3);
            n += 3;
            break;
        }
        memcpy(out + n, piece, size);
        n += size;
    }
    out[n] = 0;
    return out;
}

char *npy_printable(const char *text, char *out, size_t out_len) { return printable(text, strlen(text), out, out_len); }

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

// The dtype, a string such as '<f2'. want >= 0: it must be that one (npy_read_header_of), and any
// other is refused naming the one taken and the NumPy line that casts to it.
static int parse_descr(const char **p, int want, NpyDtype *dtype, const char *path, char *err, size_t err_len) {
    char descr[16], shown[64];
    if (read_string(p, descr, sizeof descr))
        return fail(err, err_len, "%s: cannot read the dtype ('descr') of the .npy header", path);
    int found = -1;
    for (int i = 0; i < NPY_DTYPE_COUNT; i++)
        if (strcmp(descr, DESCR[i]) == 0) found = i;
    printable(descr, strlen(descr), shown, sizeof shown);
    if (want >= 0 && found != want)
        return fail(err, err_len,
                    "%s: dtype '%s'%s%s%s, expected '%s' (little-endian %s): cast it in NumPy, "
                    "np.save(p, np.load(p).astype(np.%s)) with p this file",
                    path, shown, found >= 0 ? " (" : "", found >= 0 ? NAME[found] : "", found >= 0 ? ")" : "",
                    DESCR[want], NAME[want], NAME[want]);
    if (found < 0)
        return fail(err, err_len,
                    "%s: unsupported dtype '%s': this reader takes '<f2' (float16), '<f4' (float32), "
                    "'<f8' (float64), '<i8' (int64) and '<i4' (int32), little-endian",
                    path, shown);
    *dtype = (NpyDtype)found;
    return 0;
}

static int parse_order(const char **p, const char *path, char *err, size_t err_len) {
    if (strncmp(*p, "False", 5) == 0) {
        *p += 5;
        return 0;
    }
    if (strncmp(*p, "True", 4) == 0)
        return fail(err, err_len,
                    "%s: Fortran-order arrays are not supported: save a C-order array, "
                    "np.save(p, np.ascontiguousarray(np.load(p)))",
                    path);
    return fail(err, err_len, "%s: cannot read 'fortran_order' of the .npy header", path);
}

// A tuple of non-negative integers as Python writes them (decimal digits, no sign, no leading zero;
// one dimension as (n,)); the element count must fit in memory's address range.
static int parse_shape(const char **p, NpyHeader *h, const char *path, char *err, size_t err_len) {
    if (**p != '(') return fail(err, err_len, "%s: cannot read the shape of the .npy header", path);
    (*p)++;
    h->ndim = 0;
    h->count = 1;
    int comma = 0;  // the last dimension was followed by a comma
    for (;;) {
        skip_space(p);
        if (**p == ')') break;
        const char *c = *p;
        long long dim = 0;
        for (; *c >= '0' && *c <= '9'; c++) {
            if (dim > (LLONG_MAX - (*c - '0')) / 10)
                return fail(err, err_len, "%s: the shape in its header has more elements than any memory holds", path);
            dim = dim * 10 + (*c - '0');
        }
        if (c == *p || (**p == '0' && c - *p > 1))
            return fail(err, err_len, "%s: malformed shape in the .npy header", path);
        if (h->ndim == NPY_MAX_DIMS) return fail(err, err_len, "%s: more than %d dimensions", path, NPY_MAX_DIMS);
        if (dim > 0 && h->count > SIZE_MAX / 8 / (size_t)dim)
            return fail(err, err_len, "%s: the shape in its header has more elements than any memory holds", path);
        h->shape[h->ndim++] = dim;
        h->count *= (size_t)dim;
        *p = c;
        skip_space(p);
        comma = **p == ',';
        if (comma) (*p)++;
        else if (**p != ')') return fail(err, err_len, "%s: malformed shape in the .npy header", path);
    }
    if (h->ndim == 1 && !comma)
        return fail(err, err_len, "%s: the shape in the .npy header is not a tuple (one dimension is written (%lld,))",
                    path, h->shape[0]);
    (*p)++;
    return 0;
}

// The whole dict: exactly the keys descr, fortran_order and shape, each once. *end: just past its '}'.
static int parse_dict(const char *dict, int want, NpyHeader *h, const char **end, const char *path, char *err,
                      size_t err_len) {
    const char *p = dict;
    int seen[3] = {0, 0, 0};
    static const char *const KEYS[3] = {"descr", "fortran_order", "shape"};
    skip_space(&p);
    if (*p++ != '{') return fail(err, err_len, "%s: the .npy header is not a dict", path);
    for (;;) {
        skip_space(&p);
        if (*p == '}') break;
        char key[32], shown[128];
        if (read_string(&p, key, sizeof key)) return fail(err, err_len, "%s: malformed .npy header", path);
        skip_space(&p);
        if (*p++ != ':') return fail(err, err_len, "%s: malformed .npy header", path);
        skip_space(&p);
        int k = 0;
        while (k < 3 && strcmp(key, KEYS[k]) != 0) k++;
        printable(key, strlen(key), shown, sizeof shown);
        if (k == 3) return fail(err, err_len, "%s: unexpected key '%s' in the .npy header", path, shown);
        if (seen[k]++) return fail(err, err_len, "%s: key '%s' twice in the .npy header", path, shown);
        int rc = k == 0   ? parse_descr(&p, want, &h->dtype, path, err, err_len)
                 : k == 1 ? parse_order(&p, path, err, err_len)
                          : parse_shape(&p, h, path, err, err_len);
        if (rc) return rc;
        skip_space(&p);
        if (*p == ',') p++;
        else if (*p != '}') return fail(err, err_len, "%s: malformed .npy header", path);
    }
    if (!seen[0] || !seen[1] || !seen[2])
        return fail(err, err_len, "%s: .npy header lacks descr, fortran_order or shape", path);
    *end = p + 1;
    return 0;
}

// After the dict, the header holds only spaces and a final newline (NEP 1's padding): anything
// else there, NumPy refuses too. rest: the len bytes after the dict's '}'.
static int check_padding(const char *rest, size_t len, const char *path, char *err, size_t err_len) {
    size_t i = 0;
    while (i < len && rest[i] == ' ') i++;
    if (i + 1 == len && rest[i] == '\n') return 0;
    if (i == len)
        return fail(err, err_len,
                    "%s: the .npy header does not end with a newline: a header is its dict literal, "
                    "then spaces and a final newline",
                    path);
    size_t end = len;  // what follows the dict, without the padding that ends it
    if (rest[end - 1] == '\n') end--;
    while (end > i + 1 && rest[end - 1] == ' ') end--;
    char shown[128];
    printable(rest + i, end - i < 32 ? end - i : 32, shown, sizeof shown);
    return fail(err, err_len,
                "%s: the .npy header has '%s%s' after its dict: a header is its dict literal, then only "
                "spaces and a final newline",
                path, shown, end - i > 32 ? "..." : "");
}

// npy_read_header, with want >= 0 the dtype the file must have (npy_read_header_of).
static int read_header(const char *path, int want, NpyHeader *h, char *err, size_t err_len) {
    char shown[1024];  // the path as messages show it
    printable(path, strlen(path), shown, sizeof shown);
    // Say what the path is before opening it: opening a FIFO would wait for a writer forever.
    struct stat st;
    if (stat(path, &st) != 0) return fail(err, err_len, "cannot open %s: %s", shown, strerror(errno));
    if (S_ISDIR(st.st_mode)) return fail(err, err_len, "%s is a directory, not a .npy file", shown);
    if (!S_ISREG(st.st_mode))
        return fail(err, err_len, "%s is not a regular file (a FIFO, socket or device), not a .npy file", shown);
    if (st.st_size == 0) return fail(err, err_len, "%s is empty (0 bytes), not a .npy file", shown);
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, err_len, "cannot open %s: %s", shown, strerror(errno));
    unsigned char pre[10];
    int rc = -1;
    char *dict = NULL;
    const char *dict_end = NULL;
    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0) {
        fail(err, err_len, "%s is not a .npy file (bad magic)", shown);
        goto done;
    }
    size_t header_len, prefix;
    if (pre[6] == 1) {
        header_len = pre[8] | (size_t)pre[9] << 8;
        prefix = 10;
    } else if (pre[6] == 2 || pre[6] == 3) {
        unsigned char more[2];
        if (fread(more, 1, 2, f) != 2) {
            fail(err, err_len, "%s: truncated .npy header", shown);
            goto done;
        }
        header_len = pre[8] | (size_t)pre[9] << 8 | (size_t)more[0] << 16 | (size_t)more[1] << 24;
        prefix = 12;
    } else {
        fail(err, err_len, "%s: unsupported .npy version %d.%d", shown, pre[6], pre[7]);
        goto done;
    }
    dict = (char *)calloc(header_len + 1, 1);
    if (!dict || fread(dict, 1, header_len, f) != header_len) {
        fail(err, err_len, "%s: truncated .npy header", shown);
        goto done;
    }
    if (parse_dict(dict, want, h, &dict_end, shown, err, err_len)) goto done;
    if (check_padding(dict_end, header_len - (size_t)(dict_end - dict), shown, err, err_len)) goto done;
    h->data_offset = prefix + header_len;
    if (fseek(f, 0, SEEK_END) != 0) {
        fail(err, err_len, "%s: cannot seek: %s", shown, strerror(errno));
        goto done;
    }
    long file_size = ftell(f);
    size_t want_size = h->data_offset + h->count * SIZE[h->dtype];
    if (file_size < 0 || (size_t)file_size != want_size) {
        fail(err, err_len, "%s: file is %ld bytes, its header promises %zu (%s%s)", shown, file_size, want_size,
             NAME[h->dtype], (size_t)file_size < want_size ? ", truncated" : ", trailing bytes");
        goto done;
    }
    rc = 0;
done:
    free(dict);
    fclose(f);
    return rc;
}

int npy_read_header(const char *path, NpyHeader *h, char *err, size_t err_len) {
    return read_header(path, -1, h, err, err_len);
}

int npy_read_header_of(const char *path, NpyDtype want, NpyHeader *h, char *err, size_t err_len) {
    return read_header(path, (int)want, h, err, err_len);
}

int npy_load(const char *path, NpyDtype want, NpyHeader *h, void **data, char *err, size_t err_len) {
    *data = NULL;
    if (npy_read_header_of(path, want, h, err, err_len)) return -1;
    char shown[1024];
    printable(path, strlen(path), shown, sizeof shown);
    size_t bytes = h->count * SIZE[want];
    void *buf = malloc(bytes ? bytes : 1);
    FILE *f = fopen(path, "rb");
    if (!buf || !f) {
        free(buf);
        if (f) fclose(f);
        return fail(err, err_len, "cannot read %s: %s", shown, buf ? strerror(errno) : "out of memory");
    }
    int ok = fseek(f, (long)h->data_offset, SEEK_SET) == 0 && fread(buf, 1, bytes, f) == bytes;
    fclose(f);
    if (!ok) {
        free(buf);
        return fail(err, err_len, "%s: short read", shown);
    }
    *data = buf;
    return 0;
}

int npy_save(const char *path, NpyDtype dtype, int ndim, const long long *shape, const void *data, char *err,
             size_t err_len) {
    char dict[256], shown[1024];
    printable(path, strlen(path), shown, sizeof shown);
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
    if (!f) return fail(err, err_len, "cannot create %s: %s", shown, strerror(errno));
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)len, f) == (size_t)len;
    for (size_t i = (size_t)len; ok && i + 1 < header_len; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    size_t bytes = count * SIZE[dtype];
    ok = ok && (bytes == 0 || fwrite(data, 1, bytes, f) == bytes);
    ok = (fclose(f) == 0) && ok;
    if (!ok) return fail(err, err_len, "cannot write %s: %s", shown, strerror(errno));
    return 0;
}
