"""The .mcapy container: round trips, atomic writes, every malformed-input case, and a corruption fuzz."""

from __future__ import annotations

import dataclasses
import gc
import json
import uuid
import zlib
from pathlib import Path

import fsspec
import numpy as np
import pytest

from decapybara.dtypes import bf16_to_f32, f32_to_bf16
from decapybara.errors import DecapybaraError
from decapybara.mcapy import HEADER_SIZE, MAGIC, McapyError, McapyFile, McapyHeader, McapyWriter


def _sample_tensors() -> dict[str, tuple[np.ndarray, str | None]]:
    rng = np.random.default_rng(7)
    return {
        "f32": (rng.standard_normal((3, 5)).astype(np.float32), None),
        "f16": (rng.standard_normal((7,)).astype(np.float16), None),
        "f64_scalar": (np.array(np.pi), None),
        "bf16": (f32_to_bf16(rng.standard_normal((2, 3, 4)).astype(np.float32)), "bf16"),
        "i8": (rng.integers(-128, 128, (9,)).astype(np.int8), None),
        "u8": (rng.integers(0, 256, (4, 4)).astype(np.uint8), None),
        "i16": (rng.integers(-(2**15), 2**15, (3,)).astype(np.int16), None),
        "u16": (rng.integers(0, 2**16, (5,)).astype(np.uint16), None),
        "i32": (rng.integers(-(2**31), 2**31, (2, 2)).astype(np.int32), None),
        "u32": (rng.integers(0, 2**32, (6,)).astype(np.uint32), None),
        "i64": (rng.integers(-(2**62), 2**62, (1, 1, 3)).astype(np.int64), None),
        "empty": (np.zeros((0, 4), np.float32), None),
        "empty_bf16": (np.zeros((2, 0), np.uint16), "bf16"),
        "i32_scalar": (np.array(-5, np.int32), None),
    }


META = {"model_config": {"hidden_size": 64}, "tokenizer": "{\"x\": \"ünï 🦫\"}", "sections": {}}


def _write(path: Path, alignment: int = 256, tensors=None, metadata=None) -> dict[str, np.ndarray]:
    tensors = _sample_tensors() if tensors is None else tensors
    with McapyWriter(path, metadata=metadata if metadata is not None else META, alignment=alignment) as w:
        for name, (arr, dtype) in tensors.items():
            w.add_tensor(name, arr, dtype=dtype, quant={"scheme": "test"} if name == "u8" else None)
        w.set_metadata("late", [1, 2, 3])
    return {name: arr for name, (arr, _) in tensors.items()}


def _to_memory(path: Path) -> str:
    name = f"/{uuid.uuid4().hex}.mcapy"
    fsspec.filesystem("memory").pipe(name, path.read_bytes())
    return "memory://" + name


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype.itemsize == want.dtype.itemsize
    assert got.dtype.kind == want.dtype.kind
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("backend", ["local", "memory", "file"])
def test_round_trip_is_bit_exact_for_every_dtype(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "m.mcapy"
    want = _write(path)
    url = {"local": str(path), "memory": _to_memory(path), "file": "file://" + str(path)}[backend]
    with McapyFile.open(url) as f:
        assert f.metadata == {**META, "late": [1, 2, 3]}
        assert f.names() == list(want)
        assert "f32" in f and "nope" not in f
        for name, arr in want.items():
            got = f.tensor(name)
            _assert_same(got, arr)
            assert not got.flags.writeable
        assert f.tensors["bf16"].dtype == "bf16" and f.tensors["u16"].dtype == "u16"
        assert f.tensors["u8"].quant == {"scheme": "test"} and f.tensors["f32"].quant is None
        assert f.header.tensor_count == len(want) and f.header.file_size == path.stat().st_size
        f.verify()
        with pytest.raises(KeyError, match="nope"):
            f.tensor("nope")


@pytest.mark.parametrize("alignment", [8, 64, 256, 4096])
def test_every_tensor_offset_is_aligned(tmp_path: Path, alignment: int) -> None:
    path = tmp_path / "m.mcapy"
    _write(path, alignment=alignment)
    with McapyFile.open(path) as f:
        assert f.header.alignment == alignment and f.header.data_offset % alignment == 0
        for t in f.tensors.values():
            assert t.offset % alignment == 0
            assert (f.header.data_offset + t.offset) % alignment == 0


def test_header_matches_the_documented_byte_table(tmp_path: Path) -> None:
    path = tmp_path / "m.mcapy"
    _write(path)
    raw = path.read_bytes()
    u32 = lambda o: int.from_bytes(raw[o:o + 4], "little")
    u64 = lambda o: int.from_bytes(raw[o:o + 8], "little")
    assert raw[:8] == b"\x89MCAPY\r\n" == MAGIC
    assert (u32(8), u32(12), u32(16), u32(20)) == (1, 0, 144, 256)
    meta_off, meta_n, dir_off, dir_n = u64(32), u64(40), u64(48), u64(56)
    data_off, data_n, file_size = u64(64), u64(72), u64(80)
    assert file_size == len(raw) and data_off == 256
    assert u32(88) == zlib.crc32(raw[meta_off:meta_off + meta_n])
    assert u32(92) == zlib.crc32(raw[dir_off:dir_off + dir_n])
    assert u32(96) == zlib.crc32(raw[data_off:data_off + data_n])
    assert raw[100:140] == bytes(40) and u32(140) == zlib.crc32(raw[:140])
    assert u64(24) == len(json.loads(raw[dir_off:dir_off + dir_n]))


def test_writer_converts_float_arrays_to_bf16_and_refuses_duplicates(tmp_path: Path) -> None:
    x = np.array([1.0, -2.5, 3.14159, np.inf, 1e-30], np.float32)
    with McapyWriter(tmp_path / "m.mcapy") as w:
        w.add_tensor("x", x, dtype="bf16")
        w.add_tensor("h", x.astype(np.float64), dtype="f16")
        with pytest.raises(ValueError, match="duplicate"):
            w.add_tensor("x", x)
        with pytest.raises(ValueError, match="will not convert"):
            w.add_tensor("i", np.arange(3), dtype="f32")
    with McapyFile.open(tmp_path / "m.mcapy") as f:
        np.testing.assert_array_equal(f.tensor("x"), f32_to_bf16(x))
        np.testing.assert_array_equal(f.tensor("h"), x.astype(np.float16))
        assert f.names() == ["x", "h"]


def test_exception_inside_with_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.mcapy"
    with pytest.raises(RuntimeError), McapyWriter(path, metadata={"a": 1}) as w:
        w.add_tensor("a", np.ones(1000, np.float32))
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_failed_rewrite_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "m.mcapy"
    _write(path)
    before = path.read_bytes()
    w = McapyWriter(path)
    w.add_tensor("a", np.ones(10, np.float32))
    w.abort()
    w2 = McapyWriter(path, metadata={"bad": object()})  # not JSON: close() fails and aborts
    with pytest.raises(TypeError):
        w2.close()
    w3 = McapyWriter(path)
    del w3  # dropped without close: the temp file goes with it
    gc.collect()
    assert [p.name for p in tmp_path.iterdir()] == ["m.mcapy"] and path.read_bytes() == before


def test_bf16_conversion_matches_torch_and_keeps_nan() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-45, -1e-40,
                        1.00390625, 1.01171875, 1.0 + 2**-8 + 2**-20], np.float32)
    randbits = rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([special, rng.standard_normal(50_000).astype(np.float32), randbits])
    ours = f32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert nan.any() and (ours[~nan] == theirs[~nan]).all()
    back = bf16_to_f32(ours)
    assert np.isnan(back[nan]).all()
    assert (np.signbit(back[nan]) == np.signbit(x[nan])).all()
    np.testing.assert_array_equal(back[~nan], torch.from_numpy(theirs.view(np.int16)).view(torch.bfloat16)
                                  .float().numpy()[~nan])
    assert f32_to_bf16(np.float32(1.5)).shape == () and f32_to_bf16(np.zeros((0, 3))).shape == (0, 3)


# ---- malformed files ---------------------------------------------------------------------------------
def _parts(path: Path) -> tuple[McapyHeader, bytes, bytes, bytes]:
    raw = path.read_bytes()
    h = McapyHeader.unpack(raw[:HEADER_SIZE])
    return (h, raw[h.data_offset:h.data_offset + h.data_size],
            raw[h.metadata_offset:h.metadata_offset + h.metadata_size],
            raw[h.directory_offset:h.directory_offset + h.directory_size])


def _assemble(path: Path, meta: bytes | None = None, directory: list | bytes | None = None,
              fix_crc: bool = True, **fields: int) -> Path:
    """Rewrite `path` with other metadata/directory bytes and header fields (checksums recomputed)."""
    h, data, m, d = _parts(path)
    m = m if meta is None else meta
    d = d if directory is None else directory if isinstance(directory, bytes) else json.dumps(directory).encode()
    body = bytes(h.data_offset - HEADER_SIZE) + data + m + d
    meta_off = h.data_offset + len(data)
    h = dataclasses.replace(h, metadata_offset=meta_off, metadata_size=len(m), directory_offset=meta_off + len(m),
                            directory_size=len(d), file_size=HEADER_SIZE + len(body))
    if fix_crc:
        h = dataclasses.replace(h, metadata_crc32=zlib.crc32(m), directory_crc32=zlib.crc32(d))
    out = path.with_name("bad.mcapy")
    out.write_bytes(dataclasses.replace(h, **fields).pack() + body)
    return out


def _directory(path: Path) -> list[dict]:
    return json.loads(_parts(path)[3])


def _expect(problem: str, path: Path | str, match: str | None = None) -> McapyError:
    with pytest.raises(McapyError) as ei:
        McapyFile.open(path)
    assert ei.value.problem == problem, str(ei.value)
    assert isinstance(ei.value, DecapybaraError)
    if match:
        assert match in str(ei.value)
    return ei.value


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good.mcapy"
    _write(path)
    return path


def test_bad_magic_and_unknown_version(good: Path) -> None:
    raw = bytearray(good.read_bytes())
    raw[1] ^= 0xFF
    good.with_name("m1").write_bytes(raw)
    _expect("bad_magic", good.with_name("m1"), "magic")
    _expect("unknown_version", _assemble(good, version=2), "version 2")
    _expect("unknown_version", _assemble(good, flags=4), "flags")


def test_truncated(good: Path, tmp_path: Path) -> None:
    raw = good.read_bytes()
    for n in (0, 10, HEADER_SIZE - 1, HEADER_SIZE, len(raw) - 1):
        (tmp_path / "t").write_bytes(raw[:n])
        _expect("truncated", tmp_path / "t")
        _expect("truncated", _to_memory(tmp_path / "t"))


def test_out_of_range(good: Path) -> None:
    h = _parts(good)[0]
    _expect("out_of_range", _assemble(good, metadata_offset=2**63), "metadata section")
    _expect("out_of_range", _assemble(good, directory_size=2**64 - 1), "directory section")
    _expect("out_of_range", _assemble(good, data_size=h.data_size + 10**12), "data section")
    _expect("out_of_range", _assemble(good, metadata_offset=10), "metadata section")
    _expect("out_of_range", _assemble(good, header_size=200), "header_size")
    d = _directory(good)
    d[0]["offset"] = h.data_size - 256 + 256 * ((d[0]["nbytes"] + 255) // 256)
    _expect("out_of_range", _assemble(good, directory=d), "'f32'")
    d[0]["offset"] = -256
    _expect("out_of_range", _assemble(good, directory=d), "'f32'")
    good.with_name("long").write_bytes(good.read_bytes() + b"\0")
    _expect("out_of_range", good.with_name("long"), "beyond file_size")


def test_overlap(good: Path) -> None:
    d = _directory(good)
    d[1]["offset"] = d[0]["offset"]
    _expect("overlap", _assemble(good, directory=d), "overlaps")
    h = _parts(good)[0]
    _expect("overlap", _assemble(good, data_size=h.data_size + 1), "overlaps")  # data runs into metadata
    d = _directory(good)
    empty = next(e for e in d if e["name"] == "empty")
    empty["offset"] = d[0]["offset"]  # an empty tensor overlaps nothing
    McapyFile.open(_assemble(good, directory=d)).close()


def test_misaligned(good: Path) -> None:
    d = _directory(good)
    d[0]["offset"] += 8
    _expect("misaligned", _assemble(good, directory=d), "'f32'")
    _expect("misaligned", _assemble(good, alignment=100), "alignment 100")
    _expect("misaligned", _assemble(good, alignment=0), "alignment 0")


def test_bad_checksum(good: Path, tmp_path: Path) -> None:
    h = _parts(good)[0]
    for off, what in ((50, "header"), (120, "header"), (h.metadata_offset + 3, "metadata"),
                      (h.directory_offset + 5, "directory")):
        raw = bytearray(good.read_bytes())
        raw[off] ^= 0x10
        (tmp_path / "c").write_bytes(raw)
        _expect("bad_checksum", tmp_path / "c", what)
    raw = bytearray(good.read_bytes())
    raw[h.data_offset + 4] ^= 0x01  # inside tensor "f32"
    (tmp_path / "c").write_bytes(raw)
    for url in (tmp_path / "c", _to_memory(tmp_path / "c")):
        with McapyFile.open(url) as f:
            np.testing.assert_array_equal(f.tensor("i8"), _sample_tensors()["i8"][0])
            with pytest.raises(McapyError, match="'f32'") as ei:
                f.tensor("f32")
            assert ei.value.problem == "bad_checksum"
            f.tensor("f32", verify=False)  # the caller may opt out
            with pytest.raises(McapyError) as ei:
                f.verify()
            assert ei.value.problem == "bad_checksum"
    raw = bytearray(good.read_bytes())
    raw[HEADER_SIZE + 3] = 1  # padding between header and data: no tensor changes, verify() notices
    (tmp_path / "c").write_bytes(raw)
    with McapyFile.open(tmp_path / "c") as f, pytest.raises(McapyError, match="padding") as ei:
        f.verify()
    assert ei.value.problem == "bad_checksum"


def test_bad_json(good: Path) -> None:
    _expect("bad_json", _assemble(good, meta=b"{not json"), "metadata")
    _expect("bad_json", _assemble(good, meta=b"\xff\xfe"), "metadata")
    _expect("bad_json", _assemble(good, meta=b"[1, 2]"), "not an object")
    _expect("bad_json", _assemble(good, meta=b"[" * 100_000 + b"]" * 100_000), "metadata")
    _expect("bad_json", _assemble(good, directory=b'{"a": 1}'), "not a list")
    d = _directory(good)
    _expect("bad_json", _assemble(good, directory=d[:-1]), "header says")
    _expect("bad_json", _assemble(good, directory=d, tensor_count=len(d) + 1), "header says")
    _expect("bad_json", _assemble(good, directory=[*d[:-1], d[0]]), "listed twice")
    for key, value in (("offset", "0"), ("nbytes", None), ("crc32", True), ("shape", [2, "3"]),
                       ("shape", 5), ("crc32", 2**32), ("quant", [1])):
        d = _directory(good)
        d[0][key] = value
        _expect("bad_json", _assemble(good, directory=d), "'f32'")
    d = _directory(good)
    del d[0]["name"]
    _expect("bad_json", _assemble(good, directory=d), "entry 0")


def test_shape_mismatch(good: Path) -> None:
    for key, value, match in (("nbytes", 64, "nbytes 64"), ("dtype", "f8", "unknown dtype"),
                              ("dtype", 3, "unknown dtype"), ("shape", [-3, -5], "negative"),
                              ("shape", [1] * 33, "more than 32"), ("shape", [2**64, 0], "huge"),
                              ("shape", [2**40, 2**40], "nbytes")):
        d = _directory(good)
        d[0][key] = value
        _expect("shape_mismatch", _assemble(good, directory=d), match)


# ---- fuzz --------------------------------------------------------------------------------------------
def _mutate(raw: bytes, rng: np.random.Generator, data: tuple[int, int]) -> bytes:
    b = bytearray(raw)
    kind = rng.integers(0, 5)
    if kind in (0, 2):  # flips anywhere
        for _ in range(int(rng.integers(1, 5))):
            b[int(rng.integers(0, len(b)))] ^= int(rng.integers(1, 256))
    if kind in (1, 2):  # truncation
        del b[int(rng.integers(0, len(b))):]
    if kind == 3:  # a bit flip in the header, where the parsing decisions are made
        b[int(rng.integers(0, HEADER_SIZE))] ^= 1 << int(rng.integers(0, 8))
    if kind == 4:  # flips inside the data section (tensors and the padding between them)
        for _ in range(int(rng.integers(1, 3))):
            b[int(rng.integers(*data))] ^= int(rng.integers(1, 256))
    return bytes(b)


@pytest.mark.timeout(60)
def test_fuzzed_files_fail_typed_or_read_back_identical(tmp_path: Path) -> None:
    src = tmp_path / "small.mcapy"
    want = _write(src, alignment=8)
    raw = src.read_bytes()
    h = McapyHeader.unpack(raw)
    data = (h.data_offset, h.data_offset + h.data_size)
    rng = np.random.default_rng(12345)
    outcomes = {"open": 0, "tensor": 0, "verify": 0, "intact": 0}
    mem = fsspec.filesystem("memory")
    for i in range(500):
        bad = _mutate(raw, rng, data)
        if i % 2:
            url: str | Path = f"memory:///fuzz-{uuid.uuid4().hex}.mcapy"
            mem.pipe(str(url)[len("memory://"):], bad)
        else:
            url = tmp_path / "fuzz.mcapy"
            url.write_bytes(bad)
        try:
            f = McapyFile.open(url)
        except McapyError:
            outcomes["open"] += 1
            continue
        with f:
            assert f.metadata == {**META, "late": [1, 2, 3]}
            failed = False
            for name, arr in want.items():
                try:
                    got = f.tensor(name)
                except McapyError:
                    failed = True
                    continue
                _assert_same(got, arr)  # whatever is returned is the original, bit for bit
            try:
                f.verify()
            except McapyError:
                outcomes["verify" if not failed else "tensor"] += 1
                continue
            assert not failed, "verify() passed a file whose tensor failed its checksum"
            outcomes["intact"] += 1
        if i % 2:
            mem.rm(str(url)[len("memory://"):])
    print(outcomes)
    assert outcomes["open"] > 250 and outcomes["tensor"] > 50 and outcomes["verify"] > 0, outcomes


@pytest.mark.parametrize("tensors", [{}, {"empty": (np.zeros((0, 3), np.float32), None)}])
def test_a_file_with_an_empty_data_section_reads_back(tmp_path: Path, tensors) -> None:
    path = tmp_path / "e.mcapy"
    _write(path, tensors=tensors)
    with McapyFile.open(path) as f:
        assert f.header.data_size == 0 and f.header.metadata_offset == f.header.data_offset
        assert f.names() == list(tensors) and f.metadata["late"] == [1, 2, 3]
        for name in tensors:
            assert f.tensor(name).shape == (0, 3)
        f.verify()
