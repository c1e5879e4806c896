"""A local Hub (tests/hub/local_hub.py) with tiny repositories, and an empty Hugging Face cache
per test pointed at it through the environment the real `huggingface_hub` client reads."""
import json
import os
import shutil

import pytest

from tests.helpers import make_tiny_hf
from tests.hub.local_hub import LocalHub, Repo
from tests.models.gguf_builder import write_tiny_llama_gguf

TINY = dict(hidden=256, inter=256, vocab=512, tokenizer=True)     # K-quants need rows of 256
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
GATED_TOKEN = "hf_local_test_token"


def gguf(path, kind, seed, **kw):
    return write_tiny_llama_gguf(path, {n: kind for n in LINEARS}, seed=seed, **{**TINY, **kw})


@pytest.fixture(scope="session")
def hub_files(tmp_path_factory):
    """The repositories' files, made once: {repo: {path in repo: local file}}."""
    d = tmp_path_factory.mktemp("hub_files")
    q4km, q8, q40 = (gguf(str(d / f"tiny-{k}.gguf"), kind, seed)
                     for k, kind, seed in (("Q4_K_M", "Q4_K", 1), ("Q8_0", "Q8_0", 2), ("Q4_0", "Q4_0", 3)))
    mmproj = gguf(str(d / "mmproj-tiny-F16.gguf"), "Q8_0", 4)
    (d / "README.md").write_text("# tiny\n")
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                          "repetition_penalty": 1.05, "bos_token_id": 511}))
    (d / "split").mkdir()
    first = gguf(str(d / "split" / "tiny-Q8_0.gguf"), "Q8_0", 5, split_max_tensors=8)
    shards = sorted(os.listdir(d / "split"))
    mamba = _foreign_gguf(str(d / "mamba-Q8_0.gguf"), "mamba")
    big = _foreign_gguf(str(d / "big-F32.gguf"), "llama", rows=12 << 10)    # 12 MB: more than one download chunk
    hf = d / "hf"
    make_tiny_hf(str(hf), "llama", vocab=256, seed=7)
    (hf / "original").mkdir()
    (hf / "original" / "consolidated.pth").write_bytes(b"not to be fetched")
    (hf / "model.onnx").write_bytes(b"not to be fetched")
    from draftwise.config import cache_dir
    from draftwise.models.gguf_convert import gguf_metadata_dir
    tok = gguf_metadata_dir(q8, cache_dir())                 # the tokenizer files of the tiny GGUFs
    tok_files = {f: os.path.join(tok, f) for f in os.listdir(tok) if f.startswith(("tokenizer", "special", "chat"))}
    bare = write_tiny_llama_gguf(str(d / "bare-Q8_0.gguf"), {n: "Q8_0" for n in LINEARS}, seed=2,
                                 **{**TINY, "tokenizer": False})
    custom = d / "custom"
    custom.mkdir()
    (custom / "config.json").write_text(json.dumps({"model_type": "my_arch", "auto_map": {"AutoModel": "m.M"}}))
    (custom / "model.safetensors").write_bytes(b"x" * 64)
    return {
        "tiny-org/Tiny-GGUF": {"tiny-Q4_K_M.gguf": q4km, "tiny-Q8_0.gguf": q8, "tiny-Q4_0.gguf": q40,
                               "mmproj-tiny-F16.gguf": mmproj, "README.md": str(d / "README.md"),
                               "generation_config.json": str(d / "generation_config.json")},
        "tiny-org/Tiny-Split-GGUF": {s: str(d / "split" / s) for s in shards},
        "tiny-org/Tiny-HF": {f: str(hf / f) for f in ("config.json", "generation_config.json", "model.safetensors",
                                                       "model.onnx", "original/consolidated.pth")},
        "tiny-org/Gated-GGUF": {"tiny-Q8_0.gguf": q8},
        "tiny-org/Mamba-GGUF": {"mamba-Q8_0.gguf": mamba},
        "tiny-org/Big-GGUF": {"big-F32.gguf": big},
        "tiny-org/Tiny-Tokenizer": {**tok_files, "config.json": str(hf / "config.json")},
        "tiny-org/Custom-Code": {f: str(custom / f) for f in ("config.json", "model.safetensors")},
        "_paths": {"Q4_K_M": q4km, "Q8_0": q8, "Q4_0": q40, "split": first, "hf": str(hf), "big": big, "bare": bare},
    }


def _foreign_gguf(path: str, arch: str, rows: int = 512) -> str:
    """A GGUF with the header of `arch` and one [rows, 256] F32 tensor: not a model to run, a file
    to list, refuse or fetch."""
    import numpy as np
    from gguf import GGUFWriter
    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.arange(rows * 256, dtype=np.float32).reshape(rows, 256))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def local_hub(hub_files, tmp_path, monkeypatch):
    """A running local Hub and an empty cache, both in the environment (HF_ENDPOINT, HF_HUB_CACHE),
    HF_TOKEN and HF_HUB_OFFLINE unset."""
    repos = {name: Repo(dict(files), gated_token=GATED_TOKEN if name == "tiny-org/Gated-GGUF" else None)
             for name, files in hub_files.items() if not name.startswith("_")}
    hub = LocalHub(repos).start()
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    hub.cache = str(cache)
    hub.paths = hub_files["_paths"]
    yield hub
    hub.stop()
    shutil.rmtree(cache, ignore_errors=True)
