"""Malformed, truncated and hostile GGUF files are refused with a clear error naming the file and
the problem: seeded mutations of a tiny file (header, metadata, tensor infos, truncation), each a
ValueError or a file that still reads - never another exception, a hang or a large allocation."""
import os
import random
import resource
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from draftwise.formats import UnsupportedFormat  # noqa: F401 - a ValueError too
from draftwise.models.gguf_file import GGUFError, open_gguf
from draftwise.models.gguf_weights import GGUFBlocks
from tests.models.gguf_builder import write_tiny_llama_gguf

TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q8_0",
         "ffn_up": "Q5_0", "ffn_down": "Q8_0", "token_embd": "Q8_0"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    return write_tiny_llama_gguf(path, TYPES, hidden=64, layers=1, heads=2, kv_heads=1, inter=128, vocab=64)


def read_everything(path: str) -> None:
    """What loading a model reads of a file: the index, the configuration, every module's blocks."""
    blocks = GGUFBlocks(path)                       # reads the configuration too (blocks.cfg)
    for name in blocks.modules:
        blocks.get(name)
    for t in blocks.reader.tensors:
        if len(t.shape) == 1:
            blocks.dense(t.name)


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0:                                    # truncation
        return bytes(b[:rng.randrange(len(b))])
    if kind == 1:                                    # absurd counts in the fixed header
        off = rng.choice([4, 8, 16])
        b[off:off + 8 if off else 4] = struct.pack("<Q", rng.choice([0, 1, 2 ** 31, 2 ** 62, 2 ** 64 - 1]))[
            :8 if off else 4]
        return bytes(b)
    head = min(len(b), 4096)                         # metadata and tensor infos live up front
    if kind == 2:                                    # random bytes flipped
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(head)] = rng.randrange(256)
        return bytes(b)
    if kind == 3:                                    # a length / count / offset replaced by a huge one
        off = rng.randrange(24, head - 8)
        b[off:off + 8] = struct.pack("<Q", rng.choice([2 ** 32, 2 ** 40, 2 ** 62, 2 ** 63 + 5, 2 ** 64 - 1]))
        return bytes(b)
    off = rng.randrange(24, head - 4)                # a 32-bit field (type, dimension count) scrambled
    b[off:off + 4] = struct.pack("<I", rng.choice([0, 7, 31, 39, 99, 2 ** 31, 2 ** 32 - 1]))
    return bytes(b)


def test_two_thousand_mutations_each_read_or_refused_clearly(tiny, tmp_path):
    data = open(tiny, "rb").read()
    read_everything(tiny)
    rng = random.Random(1234)
    path = str(tmp_path / "mutant.gguf")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start, refused = time.time(), 0
    for i in range(2000):
        with open(path, "wb") as f:
            f.write(mutate(data, rng))
        try:
            read_everything(path)
        except ValueError as e:
            refused += 1
            assert str(e), i
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"mutation {i}: {type(e).__name__}: {e}")
    elapsed = time.time() - start
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert refused > 1000, refused
    assert elapsed < 60, elapsed                       # ~30 s on 2 busy cores; a hang would be minutes
    assert grown_mb < 100, grown_mb


@pytest.mark.parametrize("case", ["truncated", "magic", "huge_count", "missing"])
def test_cli_refuses_a_bad_file_with_exit_status_2(tiny, tmp_path, case):
    data = open(tiny, "rb").read()
    path = str(tmp_path / f"{case}.gguf")
    if case == "truncated":
        data = data[: len(data) * 2 // 3]
    elif case == "magic":
        data = b"GGUX" + data[4:]
    elif case == "huge_count":
        data = data[:8] + struct.pack("<Q", 2 ** 62) + data[16:]
    if case != "missing":
        open(path, "wb").write(data)
    r = subprocess.run([sys.executable, "-m", "draftwise.entrypoints.cli", "generate", "--model", path, "hi"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert os.path.basename(path) in r.stderr or case == "missing", r.stderr[-500:]


def test_header_checks_name_the_problem(tiny, tmp_path):
    data = open(tiny, "rb").read()
    p = tmp_path / "x.gguf"
    p.write_bytes(data[:10])
    with pytest.raises(GGUFError, match="shorter than the 24-byte header"):
        open_gguf(str(p))
    p.write_bytes(data[:8] + struct.pack("<Q", 2 ** 62) + data[16:])
    with pytest.raises(GGUFError, match="more than a file of"):
        open_gguf(str(p))
    p.write_bytes(data[:4] + struct.pack("<I", 9) + data[8:])
    with pytest.raises(GGUFError, match="version 9"):
        open_gguf(str(p))


def test_index_reads_what_the_gguf_reader_reads(tmp_path):
    """The fast index (metadata, tensor table, tensor bytes) against gguf's own reader."""
    from gguf import GGUFReader, GGUFWriter
    from draftwise.models.gguf_index import GGUFIndex
    path = str(tmp_path / "m.gguf")
    write_tiny_llama_gguf(path, {**TYPES, "attn_q": "Q4_K", "ffn_down": "Q6_K"}, hidden=256, layers=1, heads=2,
                          kv_heads=1, inter=256, vocab=64)
    # every metadata value kind beside the tensors: strings, string and number arrays, bools, floats
    extra = str(tmp_path / "kv.gguf")
    w = GGUFWriter(extra, "llama")
    w.add_token_list(["<s>", "héllo", "", "a" * 300])
    w.add_token_scores([0.0, -1.5, 2.25, 3.0])
    w.add_bool("test.flag", True)
    w.add_float64("test.f64", 0.1)
    w.add_int64("test.i64", -(1 << 40))
    w.add_string("test.s", "ünïcode")
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(4, 16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (path, extra):
        _same_index(GGUFReader(p), GGUFIndex(p))


def _same_index(ref, idx):
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]    # the reader's own header entries
    assert list(idx.fields) == keys
    for key in keys:
        f = ref.fields[key]
        want = f.contents()
        got = idx.fields[key].contents()
        assert got == want or (isinstance(want, float) and abs(got - want) <= 1e-6 * abs(want)), key
    assert [t.name for t in idx.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(idx.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape) and a.n_bytes == b.n_bytes
        assert a.data_offset == b.data_offset and a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_gguf_tokenizer_is_the_one_autotokenizer_builds(tmp_path, arch):
    """gguf_tokenizer builds a file's tokenizer with the class AutoTokenizer picks for it, without
    AutoTokenizer's whole-file read: the saved files are AutoTokenizer's, byte for byte (the
    architectures outside GGUF_TOKENIZER_CLASSES go through AutoTokenizer itself)."""
    from transformers import AutoTokenizer
    from draftwise.models.gguf_convert import GGUF_TOKENIZER_CLASSES, gguf_tokenizer
    path = write_tiny_llama_gguf(str(tmp_path / f"{arch}.gguf"), {}, vocab=300, arch=arch, tokenizer=True)
    mine = gguf_tokenizer(path, open_gguf(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    assert type(mine) is type(theirs)
    assert (arch, "gpt2") in GGUF_TOKENIZER_CLASSES or arch == "gemma3"
    mine.save_pretrained(str(tmp_path / "mine"))
    theirs.save_pretrained(str(tmp_path / "theirs"))
    names = sorted(os.listdir(tmp_path / "theirs"))
    assert sorted(os.listdir(tmp_path / "mine")) == names and "tokenizer.json" in names
    for name in names:
        assert (tmp_path / "mine" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
