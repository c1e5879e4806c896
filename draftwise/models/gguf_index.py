"""A GGUF file's index - metadata and tensor table - read in one pass over the header.

`gguf.GGUFReader` turns every metadata value into numpy memmap slices as it parses, ~14 s for the
300k strings of a Qwen tokenizer (its vocabulary and merges). The engine needs those strings at
most once (the tokenizer is cached), and the tensor table on every start. `GGUFIndex` reads the
header with `struct` over one memory map: scalars and numeric arrays at once, string arrays as
(offset, count) decoded only when asked for (`fields[key].contents()`), tensors as the reader's
(name, shape, tensor_type, n_elements, n_bytes, data_offset, data) with `data` a view of the
file. It answers the part of GGUFReader's API draftwise uses; anything malformed raises
`ValueError` (gguf_file.open_gguf names the file)."""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF value types -> struct format (scalars); 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf: memoryview, pos: int):
        self.buf, self.pos = buf, pos

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"a value of {n} bytes at offset {self.pos} runs past the end of the file")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        buf, pos, end = self.buf, self.pos, len(self.buf)
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("a string array runs past the end of the file")
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        if pos > end:
            raise ValueError("a string array runs past the end of the file")
        self.pos = pos


class Field:
    """One metadata value: `contents()` as GGUFReader's (a scalar, a str, or a list)."""

    def __init__(self, value: Any = None, strings: tuple[memoryview, int, int] | None = None):
        self._value, self._strings = value, strings

    def contents(self) -> Any:
        if self._strings is not None:
            buf, pos, count = self._strings
            cur, out = _Cursor(buf, pos), []
            for _ in range(count):
                out.append(cur.string())
            self._value, self._strings = out, None
        return self._value


@dataclass
class Tensor:
    name: str
    shape: np.ndarray                  # ggml order (the fastest dimension first), as GGUFReader's
    tensor_type: Any                   # gguf.GGMLQuantizationType
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray                   # a view of the file: uint8 [rows, row bytes] for block types
    mmap: Any = None                   # the mapping `data` views (a split model's shards each have one)


class GGUFIndex:
    def __init__(self, path: str):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape
        self.path = path
        with open(path, "rb") as f:
            self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self.mmap)
        cur = _Cursor(buf, 4)
        _version, n_tensors, n_kv = struct.unpack("<IQQ", cur.take(20))
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.fields[key] = self._value(cur, cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if not 1 <= n_dims <= 4:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = np.frombuffer(cur.take(8 * n_dims), dtype="<u8").astype(np.int64)
            infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        align = self.fields["general.alignment"].contents() if "general.alignment" in self.fields else 32
        if not isinstance(align, int) or isinstance(align, bool) or not 0 < align <= 1 << 20:
            raise ValueError(f"general.alignment is {align!r}")
        start = -(-cur.pos // align) * align
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                kind = GGMLQuantizationType(raw_type)
                block, type_size = GGML_QUANT_SIZES[kind]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
            n = 1
            for d in dims.tolist():
                n *= d
            if any(d <= 0 for d in dims.tolist()) or n % block or int(dims[0]) % block:
                raise ValueError(f"tensor {name!r} ({kind.name}, {dims.tolist()}) is not a whole number of blocks")
            n_bytes = n * type_size // block
            at = start + int(offset)
            if at + n_bytes > len(buf):
                raise ValueError(f"tensor {name!r} needs {n_bytes} bytes at offset {at}, past the end of the file")
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            dtype = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                     "I32": np.int32, "I64": np.int64}.get(kind.name)
            if dtype is None:
                data = np.frombuffer(self.mmap, dtype=np.uint8, count=n_bytes, offset=at).reshape(
                    quant_shape_to_byte_shape(np_dims, kind))
            else:
                data = np.frombuffer(self.mmap, dtype=dtype, count=n, offset=at).reshape(np_dims)
            self.tensors.append(Tensor(name, dims, kind, n, n_bytes, at, data, self.mmap))

    @staticmethod
    def _value(cur: _Cursor, vtype: int) -> Field:
        if vtype in _SCALARS:
            return Field(cur.unpack(_SCALARS[vtype]))
        if vtype == STRING:
            return Field(cur.string())
        if vtype != ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        sub, count = cur.unpack("<I"), cur.unpack("<Q")
        if sub in _NUMPY:
            width = np.dtype(_NUMPY[sub]).itemsize
            return Field(np.frombuffer(cur.take(width * count), dtype=_NUMPY[sub]).tolist())
        if sub == STRING:
            pos = cur.pos
            cur.skip_strings(count)
            return Field(strings=(cur.buf, pos, count))
        raise ValueError(f"metadata arrays of type {sub} are not supported")
