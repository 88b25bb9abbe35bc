// How the project names a GPU's files (docs/results/logs/common/peaks_<name>.log): the GPU's name with
// each run of characters other than letters, digits, '.', '_' and '-' as one '_', none at the end
// ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3"). tools/peaks.cu writes that file; the harness
// reads the copy bandwidth from it.
#ifndef GPU_FILES_H
#define GPU_FILES_H

static inline void gpu_file_name(const char *gpu, char *name, int size) {
    int n = 0;
    for (const char *p = gpu; *p && n < size - 1; p++) {
        int keep = (*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '.' ||
                   *p == '_' || *p == '-';
        if (keep) name[n++] = *p;
        else if (n > 0 && name[n - 1] != '_') name[n++] = '_';  // a run of others: one '_'
    }
    while (n > 0 && name[n - 1] == '_') n--;
    name[n] = 0;
}

#endif
