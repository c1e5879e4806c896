import os

import pytest
import torch

from tests.helpers import make_tiny_hf

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    model = make_tiny_hf(path, "llama")
    return path, model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen3"))
    model = make_tiny_hf(path, "qwen3", seed=1)
    return path, model
