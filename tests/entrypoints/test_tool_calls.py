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


AUTO_CALL = r'Sure\.<tool_call>\{"name":"get_weather","arguments":\{"city":"[a-z]{2,5}","unit":"c"\}\}</tool_call>'


def test_auto_parses_tool_call_blocks_streamed_or_not(client):
    """auto: the model's own <tool_call> blocks become tool_calls (a regex makes this tiny model write
    one); the text before the block stays the content; streamed the same."""
    kw = dict(model="t", messages=MSGS, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
              extra_body={"guided_regex": AUTO_CALL})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    deltas = [d for ch in chunks for c in ch.choices for d in (c.delta.tool_calls or [])]
    assert content.strip() == "Sure." and len(deltas) == 1
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)
    # without a block: plain content, no calls
    plain = client.chat.completions.create(model="t", messages=MSGS, tools=[WEATHER], max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


def test_auto_parser_by_hand():
    from draftwise.entrypoints.openai import protocol as P
    from draftwise.entrypoints.openai.serving import auto_visible, split_auto_tool_calls
    tools = [P.ToolDef(**WEATHER)]
    content, calls = split_auto_tool_calls('Hi <tool_call>{"name": "get_weather", "arguments": {"city": "x"}}'
                                           '</tool_call> bye', tools)
    assert content == "Hi  bye" and calls[0].function.name == "get_weather"
    assert split_auto_tool_calls('<tool_call>{"name": "other", "arguments": {}}</tool_call>', tools)[1] is None
    assert split_auto_tool_calls("<tool_call>not json</tool_call>", tools)[1] is None
    assert auto_visible("abc <tool_", False) == "abc " and auto_visible("abc <tool_", True) == "abc <tool_"
    assert auto_visible("a <tool_call>{", False) == "a "


def test_bad_choices_are_refused(client):
    for kw, what in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
                     ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                      "one structured-output")):
        with pytest.raises(openai.BadRequestError, match=what):
            client.chat.completions.create(model="t", messages=MSGS, max_tokens=8, **kw)
    r = client.chat.completions.create(model="t", messages=MSGS, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None
