"""A memory-mapped, validated view of a GGUF model file.

Tensor bytes are never copied: `raw` and `torch_raw` are views into the file's read-only
memory map, so a 60 GB model costs page cache, not RAM.

The header is parsed here rather than by gguf-py's GGUFReader, which builds one numpy view
per array element: it took 14 s to open a file with a 150k-entry vocabulary (this parser:
0.07 s), and it trusts every length in the file, so a corrupt array length makes it loop
past the end of the map instead of failing. Every count, length and tensor extent is checked
against the file size here before it is used, so a header can make this parser allocate no more
than a small multiple of the header's own size (tests/reliability/test_gguf_fuzz.py runs it under
an address-space cap). torch is imported only by `torch_raw`, so reading headers (the planner, the
checks in check.py) needs no torch.
"""
from __future__ import annotations

import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType as VT
from gguf import GGMLQuantizationType as QT

from engine.errors import UserError

if TYPE_CHECKING:
    import torch

MAX_TENSORS = 1_000_000
MAX_KV = 1_000_000
MAX_ARRAY_LEN = 1 << 26  # real vocabularies hold ~10^5-10^6 entries
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME, with the terminating NUL: llama.cpp refuses longer tensor names
# Decoding these to Python lists costs time and memory that only the tokenizer needs.
LAZY_KEYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                       "tokenizer.ggml.token_type", "tokenizer.ggml.scores"})

_SCALARS = {vt: struct.Struct("<" + code) for vt, code in [
    (VT.UINT8, "B"), (VT.INT8, "b"), (VT.BOOL, "?"), (VT.UINT16, "H"), (VT.INT16, "h"),
    (VT.UINT32, "I"), (VT.INT32, "i"), (VT.FLOAT32, "f"), (VT.UINT64, "Q"), (VT.INT64, "q"),
    (VT.FLOAT64, "d")]}
_REQUIRED = object()


class GGUFError(UserError, ValueError):
    """A file that is not a sound GGUF model: a user error (another file fixes it), shown as one line."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: QT
    shape: tuple[int, ...]  # numpy order: ggml's ne reversed, last axis = row
    n_bytes: int
    offset: int  # absolute, in the file


class _TensorTable(dict):
    """name -> TensorInfo; looking up a missing tensor raises GGUFError naming it, so a builder
    that indexes a tensor an incomplete file lacks fails with that message, not a bare KeyError."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def __missing__(self, name: str) -> TensorInfo:
        raise GGUFError(f"{self.path}: no tensor named {name!r}; the model file is incomplete")


@dataclass(frozen=True)
class _Array:
    """An undecoded metadata array: item type, length, file offset of the first item."""
    itype: VT
    count: int
    start: int


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, data: np.ndarray, path: Path) -> None:
        self.buf, self.size, self.path, self.pos = memoryview(data), len(data), path, 0

    def fail(self, problem: str) -> GGUFError:
        return GGUFError(f"{self.path}: {problem}")

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n > self.size - start:
            raise self.fail(f"truncated: {what} at byte {start} needs {n} bytes, the file has {self.size}")
        self.pos += n
        return start

    def scalar(self, vtype: VT, what: str) -> Any:
        fmt = _SCALARS[vtype]
        return fmt.unpack_from(self.buf, self.take(fmt.size, what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(VT.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(VT.UINT64, what)

    def text(self, start: int, n: int, what: str) -> str:
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        return self.text(self.take(n, what), n, what)

    def value_type(self, what: str) -> VT:
        raw = self.u32(f"type of {what}")
        try:
            return VT(raw)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {raw}") from None

    def value(self, vtype: VT, what: str) -> Any:
        """A scalar or string, decoded; an array, skipped and returned as an _Array."""
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == VT.STRING:
            return self.string(what)
        itype = self.value_type(f"items of {what}")
        count = self.u64(f"length of {what}")
        if count > MAX_ARRAY_LEN:
            raise self.fail(f"metadata array {what} claims {count} items (limit {MAX_ARRAY_LEN})")
        array = _Array(itype, count, self.pos)
        if itype in _SCALARS:
            self.take(count * _SCALARS[itype].size, what)
        elif itype == VT.STRING:
            self.skip_strings(count, what)
        else:
            raise self.fail(f"metadata array {what} holds arrays, which GGUF readers do not support")
        return array

    def skip_strings(self, count: int, what: str) -> None:
        # A vocabulary is ~10^5 strings: one tight loop, no per-item message formatting.
        pos, end, length = self.pos, self.size, _SCALARS[VT.UINT64].unpack_from
        problem = f"truncated: the strings of {what} run past the end of the file"
        for _ in range(count):
            if pos + 8 > end:
                raise self.fail(problem)
            pos += 8 + length(self.buf, pos)[0]
        if pos > end:
            raise self.fail(problem)
        self.pos = pos

    def decode(self, array: _Array, what: str, raw: bool = False) -> list[Any]:
        """The items of an array that value() has already bounds-checked; `raw`: strings as bytes."""
        if array.itype in _SCALARS:
            dtype = np.dtype(_SCALARS[array.itype].format)
            return np.frombuffer(self.buf, dtype, array.count, array.start).tolist()
        out, pos, length = [], array.start, _SCALARS[VT.UINT64].unpack_from
        for _ in range(array.count):
            n = length(self.buf, pos)[0]
            out.append(bytes(self.buf[pos + 8:pos + 8 + n]) if raw else self.text(pos + 8, n, what))
            pos += 8 + n
        return out


def _tensor_info(cur: _Cursor, index: int) -> tuple[str, QT, tuple[int, ...], int, int]:
    name = cur.string(f"name of tensor #{index}")
    if len(name.encode()) >= MAX_NAME:
        raise cur.fail(f"tensor #{index} has a name of {len(name.encode())} bytes (ggml's limit is {MAX_NAME - 1})")
    n_dims = cur.u32(f"dimension count of {name!r}")
    if n_dims > MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
    ne = [cur.u64(f"shape of {name!r}") for _ in range(n_dims)]
    raw_type = cur.u32(f"type of {name!r}")
    offset = cur.u64(f"offset of {name!r}")
    try:
        qtype = QT(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name!r} has unknown type {raw_type}") from None
    if ne and ne[0] % block_size:
        raise cur.fail(f"tensor {name!r}: row length {ne[0]} is not a multiple of the "
                       f"{qtype.name} block size {block_size}")
    n_elements = int(np.prod(ne, dtype=object))
    return name, qtype, tuple(reversed(ne)), n_elements // block_size * type_size, offset


def _read_header(cur: _Cursor) -> tuple[dict[str, Any], dict[str, _Array], dict[str, TensorInfo]]:
    magic = bytes(cur.buf[:4])
    if magic != b"GGUF":
        raise cur.fail(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.u32("version")
    if version and version & 0xFFFF == 0:  # a small version number read in the wrong byte order
        raise cur.fail("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise cur.fail(f"unsupported GGUF version {version} (supported: 2 and 3)")
    n_tensors, n_kv = cur.u64("tensor count"), cur.u64("metadata count")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise cur.fail(f"header claims {n_tensors} tensors and {n_kv} metadata entries "
                       f"(limits {MAX_TENSORS} and {MAX_KV}); the file is corrupt")
    metadata: dict[str, Any] = {}
    lazy: dict[str, _Array] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata or key in lazy:
            raise cur.fail(f"metadata key {key!r} appears twice")
        value = cur.value(cur.value_type(repr(key)), repr(key))
        if isinstance(value, _Array) and key in LAZY_KEYS:
            lazy[key] = value
        else:
            metadata[key] = cur.decode(value, repr(key)) if isinstance(value, _Array) else value
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two")
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = _TensorTable(cur.path)
    for name, qtype, shape, n_bytes, offset in infos:
        if name in tensors:
            raise cur.fail(f"tensor {name!r} appears twice")
        if offset % alignment:
            raise cur.fail(f"tensor {name!r}: data offset {offset} is not a multiple of {alignment}")
        end = data_start + offset + n_bytes
        if end > cur.size:
            raise cur.fail(f"tensor {name!r}: data ends at byte {end}, past the end of the file "
                           f"({cur.size} bytes); the file is truncated or corrupt")
        tensors[name] = TensorInfo(name, qtype, shape, n_bytes, data_start + offset)
    # No two tensors share bytes: a count or an offset that is off still lands inside the file, and
    # then shows as a tensor that reads another's data (no writer aliases tensors).
    extents = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in tensors.values() if t.n_bytes)
    for (_, end, first), (start, _, second) in zip(extents, extents[1:]):
        if start < end:
            raise cur.fail(f"tensors {first!r} and {second!r} overlap in the file (at byte {start}); "
                           "the tensor table is corrupt")
    return metadata, lazy, tensors


class ModelFile:
    """Metadata and zero-copy tensor bytes of one GGUF file. Use `ModelFile.open(path)`."""

    def __init__(self, path: Path, data: np.memmap) -> None:
        self.path = path
        self._data = data
        self._cursor = _Cursor(data, path)
        metadata, self._lazy, tensors = _read_header(self._cursor)
        # Decoded (str, int, float, bool, lists) except LAZY_KEYS, which get() decodes on demand.
        self.metadata: dict[str, Any] = metadata
        self.tensors: dict[str, TensorInfo] = tensors
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise self._cursor.fail("no general.architecture string; not a model file")
        self.arch: str = arch
        # Told each tensor's byte count as `torch_raw` hands it to a builder, which reads it (a
        # dense weight dequantized or moved to the GPU) or maps it (experts): load progress in bytes.
        self.on_tensor: Callable[[int], None] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ModelFile:
        """Maps the file read-only; GGUFError for anything that is not a sound GGUF file."""
        path = Path(path)
        size = path.stat().st_size
        if size < 24:
            raise GGUFError(f"{path}: not a GGUF file ({size} bytes, shorter than a GGUF header)")
        return cls(path, np.memmap(path, dtype=np.uint8, mode="r"))

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value of `key`, or `default`; tokenizer arrays are decoded on each call."""
        if key in self._lazy:
            return self._cursor.decode(self._lazy[key], repr(key))
        return self.metadata.get(key, default)

    def raw_strings(self, key: str) -> list[bytes] | None:
        """The items of a tokenizer string array (LAZY_KEYS) as undecoded bytes, as llama.cpp takes
        them; None if the file has no such array of strings."""
        array = self._lazy.get(key)
        if array is None or array.itype != VT.STRING:
            return None
        return self._cursor.decode(array, repr(key), raw=True)

    def require(self, key: str) -> Any:
        value = self.get(key, _REQUIRED)
        if value is _REQUIRED:
            raise GGUFError(f"{self.path}: required metadata key {key!r} is missing")
        return value

    def arch_key(self, suffix: str, default: Any = _REQUIRED) -> Any:
        """metadata[f"{arch}.{suffix}"], e.g. arch_key("expert_count")."""
        key = f"{self.arch}.{suffix}"
        return self.require(key) if default is _REQUIRED else self.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the map, shaped (*shape[:-1], row bytes)."""
        info = self.tensors[name]  # GGUFError naming it if missing
        data = self._data[info.offset:info.offset + info.n_bytes]
        if not info.shape:
            return data
        block_size, type_size = GGML_QUANT_SIZES[info.qtype]
        return data.reshape(*info.shape[:-1], info.shape[-1] // block_size * type_size)

    def torch_raw(self, name: str) -> torch.Tensor:
        """`raw(name)` as a uint8 tensor sharing the map. Read-only memory: writing to it
        crashes the process, so clone() before modifying."""
        import torch

        if self.on_tensor is not None:
            self.on_tensor(self.tensors[name].n_bytes)
        with warnings.catch_warnings():
            # torch warns that the array is not writable; that is the point of a read-only map.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(self.raw(name))
