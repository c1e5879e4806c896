"""Fixtures shared by the server tests."""
import pytest
import torch

from tests.helpers import make_tiny_hf
from tests.tokenizer_util import add_tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("tiny_serve"))
    make_tiny_hf(path, "llama")
    add_tiny_tokenizer(path)
    yield path
    torch.set_num_threads(threads)
