"""Forced tool calls (tool_choice "required" or a named function) through the OpenAI client: the
arguments are constrained by the function's JSON schema, returned as tool_calls, streamed as one
tool_calls delta; "auto" is refused by name. Every test runs with and without drafts (n-gram)."""
import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from draftwise import LLM  # noqa: E402
from draftwise.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.helpers import ServerThread  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=[None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def client(model_dir, request):
    llm = LLM(model_dir, max_model_len=1024, speculative_config=request.param)
    with ServerThread(build_app(llm, "t")) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_named_function(client):
    r = client.chat.completions.create(model="t", messages=MSGS, tools=[WEATHER, TIME], max_tokens=120,
                                       temperature=0, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_picks_one_of_the_tools_and_streams(client):
    kw = dict(model="t", messages=MSGS, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120, temperature=0)
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [d for ch in chunks for c in ch.choices for d in (c.delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == call.function.name
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_and_bad_choices_are_refused(client):
    for kw, what in (({"tools": [WEATHER]}, "auto"),
                     ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
                     ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                      "one structured-output")):
        with pytest.raises(openai.BadRequestError, match=what):
            client.chat.completions.create(model="t", messages=MSGS, max_tokens=8, **kw)
    r = client.chat.completions.create(model="t", messages=MSGS, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None
