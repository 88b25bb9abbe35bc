"""common/npy.c, the .npy reader and writer the harness uses, against NumPy itself.

tests/npy_tool.c drives it: files NumPy writes (every supported dtype, 0-d to 4-d, header
versions 1, 2 and 3) must read with NumPy's dtype, shape and bits; files it writes must load
in NumPy with the exact values; anything it cannot take must be refused with a message that
names the problem.
"""
import io
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("npy_tool")  # one worker, one compile of the tool

DTYPES = {"f2": np.float16, "f4": np.float32, "f8": np.float64, "i8": np.int64, "i4": np.int32}
NAMES = {"f2": "float16", "f4": "float32", "f8": "float64", "i8": "int64", "i4": "int32"}
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
SHAPES = [(), (1,), (7,), (2, 3, 4, 5), (3, 0)]
VERSIONS = [(1, 0), (2, 0), (3, 0)]


@pytest.fixture(scope="session")
def tool_path(repo):
    """tests/npy_tool.c compiled with common/npy.c (-Wall -Wextra -Werror), once."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler (cc or gcc) to build tests/npy_tool.c")
    out = repo.tmpdir() / "npy_tool"
    proc = repo.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-Icommon", "tests/npy_tool.c", "common/npy.c",
                     "-o", out], timeout=120)
    assert proc.returncode == 0, f"compiling the npy tool failed:\n{proc.stdout}{proc.stderr}"
    return out


@pytest.fixture
def tool(repo, tool_path):
    """npy_tool ARGS..., its CompletedProcess (text)."""
    return lambda *args: repo.run([tool_path, *args], timeout=60)


def pattern(dtype, count):
    """What npy_tool write puts in element i (see tests/npy_tool.c)."""
    i = np.arange(count, dtype=np.uint64)
    if dtype == "f2":
        bits = ((i * np.uint64(2654435761)) % np.uint64(0x7C00)).astype(np.uint16)
        bits[1::2] |= np.uint16(0x8000)
        return bits.view(np.float16)
    if dtype == "f4":
        return i.astype(np.float32) * np.float32(0.25) - np.float32(3.5)
    if dtype == "f8":
        return i.astype(np.float64) * 0.125 - 1.5
    if dtype == "i4":
        return (i.astype(np.int64) * 1000003 - 50000000).astype(np.int32)
    return i.astype(np.int64) * 1000003 - 5000000000


def sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if dtype in ("i8", "i4"):
        return rng.integers(np.iinfo(DTYPES[dtype]).min, np.iinfo(DTYPES[dtype]).max, size=shape, dtype=DTYPES[dtype])
    a = rng.standard_normal(shape) * 100
    a = np.asarray(a).astype(DTYPES[dtype])
    if a.size >= 4:  # specials the reader must carry bit for bit
        flat = a.reshape(-1)
        flat[:4] = [np.inf, -np.inf, -0.0, np.finfo(DTYPES[dtype]).tiny / 2]
    return a


def write_numpy(path, array, version=(1, 0)):
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=version)
    return path


def check_reads(tool, path, array):
    """npy_tool reads `path` as NumPy's `array`: dtype, shape, count and every element's bits."""
    proc = tool("info", path)
    assert proc.returncode == 0, f"info {path.name}: expected exit 0, got {proc.returncode}: {proc.stderr.strip()}"
    line = proc.stdout.strip()
    dtype = line.split()[1]
    shape_text = line.split(" shape ")[1].split(" count ")[0].strip()
    shape = tuple(int(d) for d in shape_text.split(",")) if shape_text else ()
    assert dtype == array.dtype.name, f"{path.name}: dtype {dtype}, expected {array.dtype.name}"
    assert shape == array.shape, f"{path.name}: shape {shape}, expected {array.shape}"
    count = int(line.split(" count ")[1].split()[0])
    assert count == array.size, f"{path.name}: count {count}, expected {array.size}"
    proc = tool("dump", path)
    assert proc.returncode == 0, f"dump {path.name}: exit {proc.returncode}: {proc.stderr.strip()}"
    got = [int(x, 16) for x in proc.stdout.split()]
    want = array.reshape(-1).view(UINT[array.itemsize]).tolist()
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert len(got) == len(want) and not bad, (
        f"{path.name}: {len(got)} elements read, {len(want)} expected; first mismatch at "
        f"{bad[:1]}: read {[hex(got[i]) for i in bad[:1]]}, expected {[hex(want[i]) for i in bad[:1]]}")


# --- the tool builds -------------------------------------------------------------------------
def test_tool_compiles_without_warnings(tool_path):
    assert tool_path.is_file()


# --- NumPy writes, C reads -------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS, ids=[f"v{major}" for major, _ in VERSIONS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reads_numpy_files_of_every_shape(tool, tmp_path, dtype, version):
    """Every dtype, 0-d to 4-d (an empty one too), header versions 1, 2 and 3."""
    for index, shape in enumerate(SHAPES):
        array = sample(dtype, shape, seed=index)
        name = f"{dtype}_{'x'.join(map(str, shape)) or 'scalar'}_v{version[0]}.npy"
        check_reads(tool, write_numpy(tmp_path / name, array, version), array)


def test_reads_numpy_save_output(tool, tmp_path):
    """np.save itself (what common/reference.py uses), a 4-D fp16 tensor as the harness reads."""
    path = tmp_path / "q.npy"
    array = sample("f2", (2, 3, 17, 64))
    np.save(path, array)
    check_reads(tool, path, array)


def test_reads_header_with_long_dict(tool, tmp_path):
    """A header padded far past 64 bytes (many dims of 1) still parses."""
    path = tmp_path / "long.npy"
    array = sample("f4", (1, 1, 1, 1, 1, 1, 1, 5))
    check_reads(tool, write_numpy(path, array), array)


# --- C writes, NumPy reads -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_reads_c_written_files(tool, tmp_path, dtype):
    """Every shape: NumPy reads the dtype, shape and pattern's bits; the header is NumPy's, the data
    64-byte aligned, and nothing follows it."""
    for shape in SHAPES:
        path = tmp_path / f"{dtype}_{len(shape)}d_{'x'.join(map(str, shape))}.npy"
        proc = tool("write", path, dtype, *shape)
        assert proc.returncode == 0, f"write {path.name}: exit {proc.returncode}: {proc.stderr.strip()}"
        array = np.load(path)
        assert array.dtype == DTYPES[dtype], f"{path.name}: NumPy reads dtype {array.dtype}, expected {NAMES[dtype]}"
        assert array.shape == shape, f"{path.name}: NumPy reads shape {array.shape}, expected {shape}"
        want = pattern(dtype, int(np.prod(shape))).reshape(shape)
        got_bits = array.reshape(-1).view(UINT[array.itemsize])
        want_bits = want.reshape(-1).view(UINT[want.itemsize])
        assert np.array_equal(got_bits, want_bits), (
            f"{path.name}: values differ from the pattern, first at "
            f"{int(np.argmax(got_bits != want_bits))}")
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            header = read_header(f)
            data_offset = f.tell()
        assert header == (shape, False, np.dtype(DTYPES[dtype])), f"{path.name}: header {header}"
        assert data_offset % 64 == 0, f"{path.name}: data starts at byte {data_offset}, not 64-aligned"
        assert path.stat().st_size == data_offset + array.nbytes, f"{path.name}: size {path.stat().st_size}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_keeps_bytes(tool, tmp_path, dtype):
    """NumPy file -> C load -> C save: the same array, and the data bytes unchanged."""
    for shape in [(), (9,), (2, 3, 5, 64)]:
        for version in [(1, 0), (2, 0)]:
            array = sample(dtype, shape, seed=5)
            src = write_numpy(tmp_path / f"in_{dtype}_{len(shape)}_{version[0]}.npy", array, version)
            dst = tmp_path / f"out_{dtype}_{len(shape)}_{version[0]}.npy"
            proc = tool("roundtrip", src, dst)
            assert proc.returncode == 0, f"roundtrip {src.name}: exit {proc.returncode}: {proc.stderr.strip()}"
            back = np.load(dst)
            assert back.dtype == array.dtype and back.shape == array.shape, (
                f"{src.name}: came back as {back.dtype} {back.shape}, expected {array.dtype} {array.shape}")
            assert back.tobytes() == array.tobytes(), f"{src.name}: data bytes changed in the roundtrip"


# --- refusals --------------------------------------------------------------------------------
def npy_bytes(array, version=(1, 0)):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version)
    return buf.getvalue()


def check_refused(tool, path, *keywords):
    """info and dump must both exit 2 with one message naming the file and every keyword."""
    for mode in ("info", "dump"):
        proc = tool(mode, path)
        message = proc.stderr.strip()
        assert proc.returncode == 2, (
            f"{mode} {Path(path).name}: expected exit 2 (refused), got {proc.returncode}; "
            f"stdout {proc.stdout.strip()[:200]!r} stderr {message!r}")
        assert str(path) in message, f"{mode} {Path(path).name}: the message does not name the file: {message!r}"
        missing = [k for k in keywords if k.lower() not in message.lower()]
        assert not missing, f"{mode} {Path(path).name}: message {message!r} lacks {missing}"
        assert len(message.splitlines()) == 1, f"{mode}: expected a one-line message, got {message!r}"


def write_bytes(folder, name, data):
    """folder/name holding data; its path."""
    path = folder / name
    path.write_bytes(data)
    return path


def test_refuses_wrong_magic(tool, tmp_path):
    data = bytearray(npy_bytes(np.zeros(4, np.float32)))
    data[1:6] = b"NUMPZ"
    check_refused(tool, write_bytes(tmp_path, "magic.npy", bytes(data)), "magic")


def test_refuses_a_text_file(tool, tmp_path):
    check_refused(tool, write_bytes(tmp_path, "text.npy", b"1.0 2.0 3.0\n"), "not a .npy")


def test_refuses_fortran_order(tool, tmp_path):
    array = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    check_refused(tool, write_bytes(tmp_path, "fortran.npy", npy_bytes(array)), "Fortran", "C-order")


def test_refuses_big_endian(tool, tmp_path):
    array = np.arange(6, dtype=">f4")
    check_refused(tool, write_bytes(tmp_path, "big.npy", npy_bytes(array)), ">f4", "little-endian")


def test_refuses_int16(tool, tmp_path):
    check_refused(tool, write_bytes(tmp_path, "i2.npy", npy_bytes(np.arange(6, dtype=np.int16))),
                  "<i2", "unsupported dtype", "float16", "int32")


def test_refuses_complex(tool, tmp_path):
    check_refused(tool, write_bytes(tmp_path, "c8.npy", npy_bytes(np.zeros(3, np.complex64))),
                  "<c8", "unsupported dtype")


def test_refuses_truncated_data(tool, tmp_path):
    data = npy_bytes(np.arange(10, dtype=np.float32))
    check_refused(tool, write_bytes(tmp_path, "short.npy", data[:-1]), "truncated", "float32")


def test_refuses_trailing_bytes(tool, tmp_path):
    data = npy_bytes(np.arange(10, dtype=np.float16))
    check_refused(tool, write_bytes(tmp_path, "long.npy", data + b"\0\0"), "trailing bytes")


def test_refuses_truncated_header(tool, tmp_path):
    data = npy_bytes(np.arange(10, dtype=np.float64))
    check_refused(tool, write_bytes(tmp_path, "head.npy", data[:30]), "truncated", "header")
    check_refused(tool, write_bytes(tmp_path, "head2.npy", npy_bytes(np.zeros(2), (2, 0))[:11]), "truncated", "header")


def test_refuses_unknown_version(tool, tmp_path):
    data = bytearray(npy_bytes(np.zeros(4, np.float32)))
    data[6] = 9
    check_refused(tool, write_bytes(tmp_path, "v9.npy", bytes(data)), "version 9")


def test_refuses_missing_file(tool, tmp_path):
    path = tmp_path / "nope.npy"
    check_refused(tool, path, "cannot open", "no such file")


def test_refuses_empty_file(tool, tmp_path):
    check_refused(tool, write_bytes(tmp_path, "empty.npy", b""), "not a .npy")


def test_write_refuses_missing_folder(tool, tmp_path):
    path = tmp_path / "no" / "such" / "out.npy"
    proc = tool("write", path, "f4", "3")
    assert proc.returncode == 2, f"writing into a missing folder: expected exit 2, got {proc.returncode}"
    assert str(path) in proc.stderr and "cannot create" in proc.stderr, (
        f"expected 'cannot create {path}...', got {proc.stderr.strip()!r}")
    assert not os.path.exists(path)


def test_refuses_a_directory(tool, tmp_path):
    path = tmp_path / "q.npy"
    path.mkdir()
    check_refused(tool, path, "is a directory")


def test_refuses_a_fifo_without_waiting(tool, tmp_path):
    """A FIFO (or any non-regular file) is refused before it is opened: opening one waits for a
    writer forever (run_tool's time-out would fail this test)."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no os.mkfifo on this platform")
    path = tmp_path / "q.npy"
    os.mkfifo(path)
    check_refused(tool, path, "not a regular file")


def header_bytes(dict_text, data=b""):
    """A version 1.0 .npy file whose header is dict_text, padded to 64 bytes, then data."""
    body = dict_text.encode()
    length = -(-(10 + len(body) + 1) // 64) * 64 - 10
    return b"\x93NUMPY\x01\x00" + length.to_bytes(2, "little") + body.ljust(length - 1) + b"\n" + data


def test_header_keys_are_parsed_not_searched(tool, tmp_path):
    """'descr' inside another key's string value must not be taken for the key itself."""
    data = np.arange(3, dtype=np.float32).tobytes()
    good = "{'fortran_order': False, 'shape': (3,), 'descr': '<f4', }"
    check_reads(tool, write_bytes(tmp_path, "reordered.npy", header_bytes(good, data)), np.arange(3, dtype=np.float32))
    sneaky = "{'shape': (3,), 'fortran_order': False, 'x': \"'descr': '<f4'\", }"
    check_refused(tool, write_bytes(tmp_path, "sneaky.npy", header_bytes(sneaky, data)), "unexpected key 'x'")
    twice = "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (3,), }"
    check_refused(tool, write_bytes(tmp_path, "twice.npy", header_bytes(twice, data)), "twice")
    missing = "{'descr': '<f4', 'fortran_order': False, }"
    check_refused(tool, write_bytes(tmp_path, "missing.npy", header_bytes(missing, data)), "lacks")


def test_refuses_a_shape_that_overflows(tool, tmp_path):
    """A header whose element count overflows size_t is refused by the reader itself."""
    huge = "{'descr': '<f2', 'fortran_order': False, 'shape': (4294967296, 4294967296, 16), }"
    check_refused(tool, write_bytes(tmp_path, "huge.npy", header_bytes(huge, b"\0" * 16)), "more elements")


def raw_header_bytes(header, data=b""):
    """A version 1.0 .npy file whose header is exactly `header` (bytes), then data."""
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


F4_DICT = "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }"


def test_refuses_text_after_the_header_dict(tool, tmp_path):
    """The header is the dict literal, then only spaces and one final newline (NEP 1's padding);
    NumPy refuses text there. The message says what follows the dict."""
    data = np.arange(3, dtype=np.float32).tobytes()
    three = np.arange(3, dtype=np.float32)

    def with_header(name, dict_text):
        return write_bytes(tmp_path, name, header_bytes(dict_text, data))

    def with_raw_header(name, header):
        return write_bytes(tmp_path, name, raw_header_bytes(header, data))

    check_reads(tool, with_header("padded.npy", F4_DICT), three)
    check_reads(tool, with_header("lead.npy", " " + F4_DICT), three)
    check_refused(tool, with_header("word.npy", F4_DICT + " x"), "after", "'x'", "newline")
    check_refused(tool, with_header("dict2.npy", F4_DICT + "{}"), "after", "'{}'")
    check_refused(tool, with_header("nul.npy", F4_DICT + "\0"), "after", "'\\x00'")
    check_refused(tool, with_header("comment.npy", F4_DICT + " # note"), "after", "# note")
    body = F4_DICT.encode()
    check_refused(tool, with_raw_header("nl_inside.npy", body + b"\n".ljust(118 - len(body)) + b"\n"), "after", "'\\n'")
    check_refused(tool, with_raw_header("tab.npy", body.ljust(116) + b"\t\n"), "after", "'\\t'")
    check_refused(tool, with_raw_header("no_nl.npy", body.ljust(118)), "newline")


def test_shape_is_a_tuple_of_plain_integers(tool, tmp_path):
    """The shape as NumPy reads it: a tuple (one element needs its comma), of decimal integers
    without leading zeros; this reader takes digits only (no sign)."""
    data = np.arange(3, dtype=np.float32).tobytes()
    for shape in ["(3,)", "( 3 , )", "(1, 3)", "(1, 3,)"]:
        text = F4_DICT.replace("(3,)", shape)
        check_reads(tool, write_bytes(tmp_path, "ok.npy", header_bytes(text, data)),
                    np.arange(3, dtype=np.float32).reshape(eval(shape)))
    for shape, why in [("(3)", "not a tuple"), ("(03,)", "malformed shape"), ("(+3,)", "malformed shape"),
                       ("(3.0,)", "malformed shape"), ("(,)", "malformed shape")]:
        text = F4_DICT.replace("(3,)", shape)
        check_refused(tool, write_bytes(tmp_path, "bad.npy", header_bytes(text, data)), why)


def run_bytes(tool_path, *args):
    """npy_tool with its stderr as bytes (what a terminal would receive)."""
    return subprocess.run([os.fsencode(str(a)) for a in [tool_path, *args]], capture_output=True, timeout=60)


def test_messages_escape_what_they_echo(tool, tool_path, tmp_path):
    """Paths and header text are echoed C-style escaped (\\n, \\t, \\\\, \\xNN), valid UTF-8 as it is:
    a message is one line of text whatever the file's name or header holds."""
    if os.fsencode("é") != "é".encode():
        pytest.skip("the file system encoding is not UTF-8")
    bad_magic = b"\x93NUMPZ\x01\x00\x06\x00{}   \n"
    for name, shown in [("bad\nname.npy", rb"bad\nname.npy"), ("tab\there.npy", rb"tab\there.npy"),
                        ("back\\n.npy", rb"back\\n.npy"), ("esc\x1b[2J.npy", rb"esc\x1b[2J.npy"),
                        ("caf\u00e9.npy", "café.npy".encode()), ("ls\u2028.npy", rb"ls\xe2\x80\xa8.npy"),
                        ("c1\u009b.npy", rb"c1\xc2\x9b.npy"), (os.fsdecode(b"raw\xff.npy"), rb"raw\xff.npy")]:
        path = tmp_path / name
        path.write_bytes(bad_magic)
        for mode in ("info", "dump"):
            proc = run_bytes(tool_path, mode, path)
            message = proc.stderr.rstrip(b"\n")
            assert proc.returncode == 2, f"{mode} {name!r}: exit {proc.returncode}, expected 2"
            assert b"\n" not in message and b"\r" not in message, f"{mode} {name!r}: not one line: {message!r}"
            assert shown in message and b"bad magic" in message, f"{mode} {name!r}: expected {shown!r} in {message!r}"
            assert len(message.decode("utf-8").splitlines()) == 1, f"{mode} {name!r}: not one line: {message!r}"
    data = np.arange(3, dtype=np.float32).tobytes()
    for text, shown in [(F4_DICT.replace("<f4", "<f\n4"), "'<f\\n4'"),
                        (F4_DICT.replace("'descr'", "'de\tscr'"), "'de\\tscr'"),
                        (F4_DICT + "\x1b[2J", "\\x1b[2J")]:
        check_refused(tool, write_bytes(tmp_path, "h.npy", header_bytes(text, data)), shown)


# (the dtype asked for, a file of another dtype, its descr, the asked dtype's name and NumPy spelling)
LOAD_MISMATCHES = [("f2", np.arange(4, dtype=np.int32), "<i4", "float16", "np.float16"),
                   ("i4", np.arange(4, dtype=np.int64), "<i8", "int32", "np.int32"),
                   ("i4", np.arange(4, dtype=np.int16), "<i2", "int32", "np.int32"),
                   ("f2", np.arange(4, dtype=np.float32), "<f4", "float16", "np.float16"),
                   ("f2", np.arange(4, dtype=">f2"), ">f2", "float16", "np.float16"),
                   ("f4", np.arange(4, dtype=np.float16), "<f2", "float32", "np.float32"),
                   ("i8", np.arange(4, dtype=np.uint8), "|u1", "int64", "np.int64")]


@pytest.mark.parametrize("want, array, descr, name, np_name", LOAD_MISMATCHES,
                         ids=[f"{case[2]} as {case[0]}" for case in LOAD_MISMATCHES])
def test_load_names_the_dtype_it_takes_and_how_to_cast(tool, tmp_path, want, array, descr, name, np_name):
    """npy_load of a file of another dtype, one this reader knows or not, names the dtype it takes
    ('<f2' float16, ...) and the NumPy line that casts to it."""
    path = write_numpy(tmp_path / f"{descr[1:]}_as_{want}.npy", array)
    proc = tool("load", path, want)
    message = proc.stderr.strip()
    assert proc.returncode == 2, f"load {path.name} {want}: exit {proc.returncode}, expected 2: {message!r}"
    wanted = [str(path), f"'{descr}'", f"'<{want}'", name, "np.save(", "np.load(", f".astype({np_name})"]
    missing = [k for k in wanted if k not in message]
    assert not missing and len(message.splitlines()) == 1, f"load {path.name} {want}: {message!r} lacks {missing}"


def test_load_of_its_own_dtype_gives_the_count(tool, tmp_path):
    path = write_numpy(tmp_path / "ok.npy", np.arange(4, dtype=np.float16))
    proc = tool("load", path, "f2")
    assert proc.returncode == 0 and proc.stdout.split() == ["count", "4"], (
        f"load ok.npy f2: exit {proc.returncode}, stdout {proc.stdout!r} stderr {proc.stderr!r}")
