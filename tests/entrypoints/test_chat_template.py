"""A model without a chat template (a base model such as Gemma 3 270M) serves completions; a chat
request to it is refused naming the option that supplies one; `chat_template` / `--chat-template`
(a Jinja file or the template itself, as vLLM's option) supplies one, offline and in the server."""
import json
import os
import shutil

import httpx
import pytest

from draftwise import LLM, SamplingParams
from draftwise.entrypoints.cli import make_parser
from draftwise.entrypoints.openai.api_server import build_app
from draftwise.inputs import read_chat_template
from tests.helpers import ServerThread
from tests.tokenizer_util import CHATML_TEMPLATE

KW = dict(max_model_len=128, max_num_seqs=2, speculative_config=None)
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def base_model_dir(model_dir, tmp_path_factory):
    """The tiny model with its tokenizer's chat template removed."""
    path = str(tmp_path_factory.mktemp("base_model"))
    for f in os.listdir(model_dir):
        shutil.copy(os.path.join(model_dir, f), path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg.pop("chat_template", None)
    json.dump(cfg, open(cfg_path, "w"))
    for f in ("chat_template.jinja", "chat_template.json"):
        if os.path.exists(os.path.join(path, f)):
            os.remove(os.path.join(path, f))
    return path


def test_no_template_serves_completions_and_refuses_chat_naming_the_option(base_model_dir):
    llm = LLM(base_model_dir, **KW)
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="--chat-template"):
        llm.chat(CHAT, SamplingParams(max_tokens=3))
    with ServerThread(build_app(llm, "base")) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "base", "messages": CHAT, "max_tokens": 3})
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "base", "prompt": "Hello", "max_tokens": 3})
        assert r.status_code == 200


@pytest.mark.parametrize("given", ["file", "inline"])
def test_a_supplied_template_is_used(base_model_dir, tmp_path, given):
    if given == "file":
        (tmp_path / "chatml.jinja").write_text(CHATML_TEMPLATE)
        value = str(tmp_path / "chatml.jinja")
    else:
        value = CHATML_TEMPLATE
    llm = LLM(base_model_dir, chat_template=value, **KW)
    out = llm.chat(CHAT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out[0].prompt == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    with ServerThread(build_app(llm, "base")) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "base", "messages": CHAT, "max_tokens": 3})
        assert r.status_code == 200, r.text


def test_template_values_that_are_neither_file_nor_template_are_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        read_chat_template(str(tmp_path / "empty.jinja"))


def test_the_command_line_takes_it():
    args = make_parser().parse_args(["serve", "--chat-template", "t.jinja"])
    assert args.chat_template == "t.jinja"
