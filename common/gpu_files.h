// How the project names a GPU's files (docs/results/logs/common/peaks_<name>.log): the GPU's name with
// each run of characters other than letters, digits, '.', '_' and '-' as one '_', and '_' stripped
// from both ends ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3"; common/results.py's gpu_slug).
// tools/peaks.cu writes that file; the harness reads the copy bandwidth from it.
#ifndef GPU_FILES_H
#define GPU_FILES_H

#include <stdio.h>

static inline void gpu_file_name(const char *gpu, char *name, int size) {
    int n = 0, in_run = 0;
    for (const char *p = gpu; *p && n < size - 1; p++) {
        int keep = (*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '.' ||
                   *p == '_' || *p == '-';
        if (keep) name[n++] = *p, in_run = 0;
        else if (!in_run) name[n++] = '_', in_run = 1;  // a run of others: one '_'
    }
    int start = 0;  // '_' stripped from both ends, as common/results.py's gpu_slug strips them
    while (start < n && name[start] == '_') start++;
    while (n > start && name[n - 1] == '_') n--;
    for (int i = start; i < n; i++) name[i - start] = name[i];
    n -= start;
    if (n == 0) snprintf(name, size, "unknown_gpu");
    else name[n] = 0;
}

#endif
