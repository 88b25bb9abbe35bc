"""compute-sanitizer: where it is, and its verdict on a run. tests/test_sanitize.py (make sanitize)
and common/exercises.py (make grade's racecheck) use both."""
import os
import re
import shutil


def find_sanitizer():
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    compiler = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    bin_dir = os.path.dirname(os.path.realpath(compiler))
    for path in (os.path.join(bin_dir, "compute-sanitizer"),
                 os.path.join(bin_dir, "..", "compute-sanitizer", "compute-sanitizer"),
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.normpath(path)
    return None


def check_summary(tool, output, shown):
    errors = [int(x) for x in re.findall(r"ERROR SUMMARY: (\d+) errors?", output)]
    assert all(e == 0 for e in errors), f"{shown}: ERROR SUMMARY reports {errors} errors"
    if tool == "racecheck":
        race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", output)
        assert race or errors, f"{shown}: no RACECHECK SUMMARY (nor ERROR SUMMARY) in the output"
        for hazards, errs, warns in race:
            assert hazards == errs == warns == "0", (
                f"{shown}: racecheck reports {hazards} hazards ({errs} errors, {warns} warnings), expected 0")
    else:
        assert errors, f"{shown}: no 'ERROR SUMMARY: 0 errors' in the output"
