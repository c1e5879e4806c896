"""Opening a GGUF file safely: every reader of a GGUF goes through `open_gguf`, which refuses a
malformed, truncated or hostile file with a `ValueError` naming the file and the problem - never a
traceback from deep inside a parser, a hang, or an allocation sized by the header.

Before the `gguf` package parses anything, the fixed header is checked against the file's size
(every tensor info and key-value pair takes at least a few bytes, so counts larger than the file
could hold are refused at once); after it parses, each tensor's dimensions, type and data range
are checked against the file (a tensor whose bytes run past the end means a truncated file)."""
from __future__ import annotations

import os
import struct

import numpy as np

from draftwise.models.gguf_index import GGUFIndex
from draftwise.models.hub_files import SPLIT

GGUF_MAGIC = b"GGUF"
_MIN_TENSOR_INFO = 8 + 1 + 4 + 4 + 8          # name length + 1 char, n_dims, one dim... type, offset
_MIN_KV = 8 + 1 + 4 + 1                       # key length + 1 char, value type, 1-byte value
MAX_DIMS = 4


class GGUFError(ValueError):
    """A GGUF file that cannot be read: the message names the file and the problem."""


def is_gguf(path: str) -> bool:
    """Whether `path` is a file that starts with the GGUF magic (Ollama's blobs have no suffix)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def check_header(path: str) -> tuple[int, int, int]:
    """(version, n_tensors, n_kv) of a GGUF file whose fixed header is plausible for its size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise GGUFError(f"cannot read GGUF file {path}: {e.strerror or e}") from None
    if len(head) < 24:
        raise GGUFError(f"{path} is not a GGUF file: {size} bytes, shorter than the 24-byte header")
    if head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file: it starts with {head[:4]!r}, not {GGUF_MAGIC!r}")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    if n_tensors * _MIN_TENSOR_INFO + n_kv * _MIN_KV > size - 24:
        raise GGUFError(f"{path}: the header claims {n_tensors} tensors and {n_kv} metadata entries, more than "
                        f"a file of {size} bytes can hold (truncated or corrupt)")
    return version, n_tensors, n_kv


def open_gguf(path: str):
    """The index of `path` (models/gguf_index.py: metadata and tensors, the tensors' data memory-
    mapped; the part of `gguf.GGUFReader`'s API draftwise reads), or GGUFError saying what is wrong
    with the file. A model split by llama.cpp's `gguf-split` (`NAME-00001-of-00003.gguf`, ...; keys
    `split.no`, `split.count`, `split.tensors.count`) is opened from its first shard as one model:
    the first shard's metadata, every shard's tensors, each mapped from its own file."""
    reader = _open_one(path)
    count = _split_field(reader, "split.count", 1)
    if count <= 1:
        return reader
    no = _split_field(reader, "split.no", 0)
    m = SPLIT.search(path)
    if no != 0 or m is None:
        raise GGUFError(f"{path} is shard {no + 1} of a model split in {count}: open its first shard "
                        f"(NAME-00001-of-{count:05d}.gguf)" if no else
                        f"{path} is the first of {count} shards, but its name does not end in -00001-of-{count:05d}.gguf, "
                        "so the other shards cannot be found")
    reader.shards = []
    names = {t.name for t in reader.tensors}
    for i in range(2, count + 1):
        shard_path = f"{path[:m.start()]}-{i:05d}-of-{count:05d}.gguf"
        if not os.path.isfile(shard_path):
            raise GGUFError(f"{path}: shard {i} of {count} ({os.path.basename(shard_path)}) is missing")
        shard = _open_one(shard_path)
        if _split_field(shard, "split.no", -1) != i - 1 or _split_field(shard, "split.count", 0) != count:
            raise GGUFError(f"{shard_path} is not shard {i} of {count} of the same model (its split keys differ)")
        for t in shard.tensors:
            if t.name in names:
                raise GGUFError(f"{shard_path}: tensor {t.name!r} is also in another shard")
            names.add(t.name)
        reader.tensors.extend(shard.tensors)
        reader.shards.append(shard)
    expected = _split_field(reader, "split.tensors.count", len(reader.tensors))
    if expected != len(reader.tensors):
        raise GGUFError(f"{path}: the {count} shards hold {len(reader.tensors)} tensors, the first says {expected}")
    return reader


def _split_field(reader, key: str, default: int) -> int:
    f = reader.fields.get(key)
    value = f.contents() if f is not None else default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 100000:
        raise GGUFError(f"{reader.path}: {key} is {value!r}")
    return value


def _open_one(path: str):
    from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
    check_header(path)
    try:
        reader = GGUFIndex(path)
    except Exception as e:  # noqa: BLE001 - the parser's own errors: bad types, offsets, lengths
        raise GGUFError(f"{path}: malformed GGUF ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
                        ) from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        dims = [int(d) for d in t.shape]
        if not 1 <= len(dims) <= MAX_DIMS or any(d <= 0 for d in dims):
            raise GGUFError(f"{path}: tensor {t.name!r} has dimensions {dims}")
        try:
            kind = GGMLQuantizationType(int(t.tensor_type))
            block, type_size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {t.name!r} has unknown type {int(t.tensor_type)}") from None
        n = int(np.prod(dims, dtype=object))
        if n % block or dims[0] % block:
            raise GGUFError(f"{path}: tensor {t.name!r} ({kind.name}, {dims}) is not a whole number of blocks")
        nbytes = n // block * type_size
        if t.data_offset + nbytes > size or t.data.nbytes != nbytes:
            raise GGUFError(f"{path}: tensor {t.name!r} needs {nbytes} bytes at offset {t.data_offset}, past the "
                            f"end of the {size}-byte file (truncated)")
    return reader
