#!/usr/bin/env python3
"""Where the CUDA toolkit's programs are: nvcc, cuobjdump and nvdisasm (which print SASS), and
compute-sanitizer with its verdict on a run. The tests (SASS claims, make sanitize), make grade and
make sass all look here.

cuobjdump and nvdisasm come from PATH or from beside nvcc; where the toolkit lacks them (some
installs ship the compiler alone), `fetch` downloads NVIDIA's own wheels of them from PyPI into
.cache/tools, which `make clean` keeps.

    cuda_tools.py path      the folders of cuobjdump and nvdisasm, PATH-style (fetching them if
                            needed: make sass puts them first on PATH); exit 2 with the reason when
                            neither finding nor fetching works
"""
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS_DIR = os.path.join(ROOT, ".cache", "tools")
TOOL_PACKAGES = {"cuobjdump": "nvidia-cuda-cuobjdump>=13,<14", "nvdisasm": "nvidia-cuda-nvdisasm>=13,<14"}


def nvcc():
    """nvcc from $NVCC, PATH or /usr/local/cuda/bin; None if there is none."""
    found = os.environ.get("NVCC") or shutil.which("nvcc")
    if not found and os.path.exists("/usr/local/cuda/bin/nvcc"):
        found = "/usr/local/cuda/bin/nvcc"
    return found


def find_tool(name):
    """A toolkit program on PATH, beside nvcc, or in .cache/tools; None if none is there."""
    compiler = nvcc() or "/usr/local/cuda/bin/nvcc"
    for path in (shutil.which(name), os.path.join(os.path.dirname(os.path.realpath(compiler)), name),
                 os.path.join(TOOLS_DIR, name)):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def fetch_tool(name):
    """(path, None) after downloading the tool's wheel from PyPI with pip and unpacking its binary
    into .cache/tools, or (None, why not)."""
    os.makedirs(TOOLS_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fa-tools-") as download:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--disable-pip-version-check", "-q", "-d", download, TOOL_PACKAGES[name]],
                              capture_output=True, text=True, errors="replace", timeout=600)
        if proc.returncode != 0:
            return None, (f"{name} not found and 'pip download {TOOL_PACKAGES[name]}' failed: "
                          f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        for wheel in sorted(os.listdir(download)):
            with zipfile.ZipFile(os.path.join(download, wheel)) as archive:
                members = [m for m in archive.namelist() if m.endswith(f"/bin/{name}")]
                if members:
                    target = os.path.join(TOOLS_DIR, name)
                    partial = f"{target}.part{os.getpid()}"
                    with open(partial, "wb") as f:
                        f.write(archive.read(members[0]))
                    os.chmod(partial, os.stat(partial).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
                    os.replace(partial, target)
                    return target, None
    return None, f"{name}: the wheel of {TOOL_PACKAGES[name]} holds no bin/{name}"


def sass_tools(fetch=True):
    """((cuobjdump, env), None): cuobjdump and the environment that lets it find nvdisasm, which it
    needs to print SASS; or (None, why not). fetch: download what is missing (fetch_tool)."""
    found = {}
    for name in ("cuobjdump", "nvdisasm"):
        found[name] = find_tool(name)
        if not found[name] and fetch:
            found[name], why = fetch_tool(name)
            if not found[name]:
                return None, why
        if not found[name]:
            return None, (f"{name} was not found on PATH, next to nvcc or in .cache/tools: install the CUDA "
                          "toolkit's cuobjdump and nvdisasm and put them on PATH (make sass fetches them)")
    path = os.path.dirname(found["nvdisasm"]) + os.pathsep + os.environ.get("PATH", "")
    return (found["cuobjdump"], {"PATH": path}), None


# --- compute-sanitizer ---------------------------------------------------------------------------
def find_sanitizer():
    """compute-sanitizer on PATH, beside nvcc or in the toolkit's usual place; None if there is none."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    bin_dir = os.path.dirname(os.path.realpath(nvcc() or "/usr/local/cuda/bin/nvcc"))
    for path in (os.path.join(bin_dir, "compute-sanitizer"),
                 os.path.join(bin_dir, "..", "compute-sanitizer", "compute-sanitizer"),
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.normpath(path)
    return None


def check_summary(tool, output, shown):
    """AssertionError unless compute-sanitizer's output reports no error (racecheck: no hazard)."""
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


def main(argv):
    if argv != ["path"]:
        print("usage: cuda_tools.py path", file=sys.stderr)
        return 2
    tools, why = sass_tools()
    if not tools:
        print(f"cuobjdump: {why}", file=sys.stderr)
        return 2
    cuobjdump, env = tools
    folders = [os.path.dirname(cuobjdump), env["PATH"].split(os.pathsep)[0]]
    print(os.pathsep.join(dict.fromkeys(folders)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
