"""EngineArgs: one set of options behind LLM, generate / chat and serve; flags generated from it."""
from dataclasses import fields

import pytest

from draftwise.engine_args import EngineArgs
from draftwise.entrypoints.cli import make_parser


def _parse(argv):
    return make_parser().parse_args(argv)


def test_every_field_has_a_flag_on_every_engine_command():
    for cmd in (["generate"], ["chat"], ["serve"]):
        args = _parse(cmd)
        ea = EngineArgs.from_cli_args(args)
        assert ea == EngineArgs(), cmd                      # the same defaults everywhere
        assert all(hasattr(args, f.name) for f in fields(EngineArgs))


def test_flags_reach_the_engine_config():
    args = _parse(["serve", "--max-model-len", "512", "--compile", "--quantization", "none",
                   "--kv-cache-memory", "64MiB", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                   "--compile-sizes", "1,4", "--no-prefix-caching", "--threads", "1"])
    ea = EngineArgs.from_cli_args(args)
    assert ea.enforce_eager is False and ea.threads == 1 and ea.enable_prefix_caching is False
    cfg = ea.create_engine_config()
    assert cfg.max_model_len == 512 and cfg.enforce_eager is False and cfg.quantization is None
    assert cfg.kv_cache_memory == 64 << 20 and cfg.compile_sizes == (1, 4)
    assert cfg.speculative_config.method == "ngram" and cfg.speculative_config.num_speculative_tokens == 3


def test_speculative_config_spellings():
    assert EngineArgs(speculative_config="none").speculative() is None
    assert EngineArgs(speculative_config=None).speculative() is None
    assert EngineArgs(speculative_config="auto").speculative().method == "suffix"
    assert EngineArgs(speculative_config={"method": "suffix"}).speculative().method == "suffix"
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineArgs(speculative_config="{method").speculative()


def test_auto_drafts_with_the_installed_sibling_of_a_packaged_target(monkeypatch):
    """"auto" is suffix decoding, with the packaged smaller model of the target's family beside it
    only where that model's packages are installed."""
    import draftwise.models.packaged as packaged
    installed = set()
    monkeypatch.setattr(packaged, "is_installed", lambda name: name in installed)
    assert EngineArgs(model="qwen2.5-coder-1.5b").speculative().method == "suffix"
    installed.add("qwen2.5-coder-0.5b")
    spec = EngineArgs(model="qwen2.5-coder-1.5b").speculative()
    assert (spec.method, spec.model, spec.hybrid, spec.quantization) == ("draft_model", "qwen2.5-coder-0.5b",
                                                                        "suffix", "Q4_0")
    assert EngineArgs(model="Qwen/Qwen2.5-Coder-1.5B-Instruct").speculative().method == "draft_model"
    for other in ("smollm2-135m", "qwen2.5-coder-0.5b", "/models/any.gguf"):
        assert EngineArgs(model=other).speculative().method == "suffix", other


def test_eager_is_the_default_everywhere():
    assert EngineArgs().create_engine_config().enforce_eager is True
    assert _parse(["generate", "--compile"]).enforce_eager is False
    assert _parse(["serve", "--no-enforce-eager"]).enforce_eager is False


def test_unknown_llm_option_is_a_clear_error(tiny_llama):
    from draftwise import LLM
    path, _ = tiny_llama
    with pytest.raises(TypeError, match="max_model_length"):
        LLM(path, max_model_length=64)
