"""Which files a Hub name picks (models/hub_files.py): llama.cpp's rule, table-tested."""
import pytest

from draftwise.models.hub_files import NoSuchQuant, gguf_choices, pick_checkpoint, pick_gguf, quant_of

REPO = ["README.md", "mmproj-model-f16.gguf", "model-IQ4_XS.gguf", "model-Q4_K_M.gguf", "model-Q8_0.gguf",
        "model-q5_k_m.gguf", "imatrix.gguf", "model-eagle3-Q8_0.gguf", "mtp-model-Q8_0.gguf",
        "big-Q6_K-00001-of-00002.gguf", "big-Q6_K-00002-of-00002.gguf",
        "broken-Q2_K-00001-of-00003.gguf", "broken-Q2_K-00003-of-00003.gguf"]


@pytest.mark.parametrize("files, quant, expected", [
    (REPO, None, ("model-Q4_K_M.gguf",)),                                  # no tag: Q4_K_M
    (REPO, "q8_0", ("model-Q8_0.gguf",)),                                  # tags are case-insensitive
    (REPO, "Q5_K_M", ("model-q5_k_m.gguf",)),
    (REPO, "IQ4_XS", ("model-IQ4_XS.gguf",)),
    (REPO, "Q6_K", ("big-Q6_K-00001-of-00002.gguf", "big-Q6_K-00002-of-00002.gguf")),   # every shard
    ([f for f in REPO if "Q4_K_M" not in f], None, ("model-Q8_0.gguf",)),  # then Q8_0
    (["b-Q5_0.gguf", "a-Q6_K.gguf", "mmproj-a-Q4_K_M.gguf"], None, ("a-Q6_K.gguf",)),   # then the first
    (["Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"], "Q4_K_M", ("Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",)),
    (["sub/dir/m-BF16.gguf"], "bf16", ("sub/dir/m-BF16.gguf",)),
])
def test_pick_gguf(files, quant, expected):
    assert pick_gguf(files, quant).files == expected


def test_auxiliary_files_and_incomplete_splits_are_never_the_model():
    main = {c.files[0] for c in gguf_choices(REPO)}
    assert not any(n.startswith(("mmproj", "imatrix", "mtp-")) or "eagle3" in n for n in main)
    assert not any("broken" in n for n in main)                # shard 2 of 3 is missing
    assert pick_gguf(["mmproj-x-Q4_K_M.gguf", "README.md"]) is None


def test_a_missing_quant_names_those_the_repo_has():
    with pytest.raises(NoSuchQuant) as e:
        pick_gguf(REPO, "Q3_K_S")
    assert e.value.available == ["IQ4_XS", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]


@pytest.mark.parametrize("name, quant", [("a-Q4_K_M.gguf", "Q4_K_M"), ("a.q8_0.gguf", "Q8_0"),
                                         ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"), ("a-f16.gguf", "F16"),
                                         ("x-Q6_K-00001-of-00002.gguf", "Q6_K"), ("plain.gguf", None)])
def test_quant_of(name, quant):
    assert quant_of(name) == quant


def test_pick_checkpoint_prefers_safetensors_and_skips_other_exports():
    files = ["config.json", "generation_config.json", "tokenizer.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "original/consolidated.00.pth", "model.onnx", "README.md"]
    assert pick_checkpoint(files) == ["config.json", "generation_config.json", "tokenizer.json",
                                      "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                      "model-00002-of-00002.safetensors"]
    assert pick_checkpoint(["config.json", "pytorch_model.bin", "x.pth"]) == ["config.json", "pytorch_model.bin"]
    assert pick_checkpoint(["model.safetensors"]) == []
