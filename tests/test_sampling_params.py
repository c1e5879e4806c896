"""`validate`, the one check of the sampling fields: the server's bad-input catalogue fed to it
directly, each bad field named in its error; limits (vocabulary, context) where they are known."""
import dataclasses

import pytest

from draftwise.bench.soak import bad_input_cases
from draftwise.sampling_params import InvalidSamplingParams, SamplingLimits, SamplingParams, validate

FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
LIMITS = SamplingLimits(vocab_size=1000, max_model_len=2048)


def _catalogue_sampling_cases():
    """(field, value) of every catalogue request that is bad in one sampling field."""
    out = []
    for name, _, body in bad_input_cases("m"):
        if not isinstance(body, dict) or not name.startswith("completions "):
            continue
        field = name.removeprefix("completions ").split("=")[0]
        if field in FIELDS:
            out.append((field, body[field]))
    return out


CASES = _catalogue_sampling_cases()


def test_the_catalogue_has_sampling_cases():
    assert len(CASES) >= 25 and {"temperature", "top_p", "top_k", "max_tokens", "seed", "logit_bias"} <= {
        f for f, _ in CASES}


@pytest.mark.parametrize("field,value", CASES, ids=[f"{f}={v!r}"[:40] for f, v in CASES])
def test_each_bad_field_of_the_catalogue_is_refused_by_validate_naming_it(field, value):
    with pytest.raises(InvalidSamplingParams) as e:
        params = SamplingParams(**{field: value})       # types and ranges: on construction
        validate(params, LIMITS, prompt_len=1)          # the context and vocabulary
    assert e.value.param == field


def test_limits_vocabulary_and_context():
    validate(SamplingParams(logit_bias={999: 1.0}, allowed_token_ids=[0, 999], max_tokens=2047), LIMITS, 1)
    for kw, param in [({"logit_bias": {1000: 1.0}}, "logit_bias"), ({"allowed_token_ids": [5, 1000]},
                                                                     "allowed_token_ids")]:
        with pytest.raises(InvalidSamplingParams, match="outside the vocabulary") as e:
            validate(SamplingParams(**kw), LIMITS)
        assert e.value.param == param
    with pytest.raises(InvalidSamplingParams) as e:
        validate(SamplingParams(max_tokens=2048), LIMITS, prompt_len=1)
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    validate(SamplingParams(max_tokens=10 ** 6), LIMITS)  # no prompt length: the engine stops at the context


def test_a_dict_is_not_a_stop_list():
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(stop={"a": 1})
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]
