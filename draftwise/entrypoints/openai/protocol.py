"""The OpenAI-compatible API as pydantic models (as vLLM's `protocol.py`): request validation is
declarative, and `/openapi.json` describes the real API.

Strict types: a string where a number is expected is an error, not a coercion. Fields the engine
does not support are rejected with a message that names them. Extensions (as in vLLM): `top_k`,
`ignore_eos`; draftwise's own: `speculate` (false: decode this request without drafts) and
`include_spec_trace` (also `stream_options.include_spec_trace`: each choice carries `spec_trace`,
the spans of its text with, per token, whether it was an accepted draft, the drafter and the
step). Responses carry `usage.spec_decode`, the request's own speculative-decoding counters, and
llama-server's `timings` (prompt / predicted ms and per-second, `draft_n`, `draft_n_accepted`)."""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

Number = StrictFloat | StrictInt
def _valid_unicode(v: str) -> str:
    """Reject lone UTF-16 surrogates (JSON "\\ud800" escapes): they cannot be encoded as UTF-8, so
    the tokenizer would fail on them later."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains an unpaired surrogate (\\u{ord(v[e.start]):04x} at character {e.start}); "
                         "text must be valid Unicode") from None
    return v


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")       # unknown fields are ignored, as OpenAI's API does


# --- errors -----------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --- requests ---------------------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False
    include_spec_trace: StrictBool = False


class JsonSchemaFormat(OpenAIModel):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs`: one of these."""
    json_: dict | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0)] = 1.0
    top_p: Annotated[Number, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1
    seed: Annotated[StrictInt, Field(ge=-(2 ** 63), lt=2 ** 64)] | None = None
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] = 1
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] = 0
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] = 0
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False
    speculate: StrictBool = True
    include_spec_trace: StrictBool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: Text | None = None

    def structured_output_spec(self) -> tuple[str, dict] | None:
        """(the request field that set it, StructuredOutputParams kwargs), None without a constraint;
        more than one constraint is an error."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            found.append(("response_format", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            kw = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object or None))
                  if v is not None}
            found.append(("structured_outputs", kw))
        for field_, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, field_) is not None:
                found.append((field_, {key: getattr(self, field_)}))
        found += self._tool_constraint()
        if len(found) > 1:
            raise ValueError("give one structured-output constraint, not " + " and ".join(f for f, _ in found))
        return found[0] if found else None

    def _tool_constraint(self) -> list:
        return []

    def wants_spec_trace(self) -> bool:
        return self.include_spec_trace or bool(self.stream_options and self.stream_options.include_spec_trace)

    min_p: Annotated[Number, Field(ge=0, le=1)] = 0
    repetition_penalty: Annotated[Number, Field(gt=0, le=10)] = 1
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    bad_words: list[Annotated[Text, Field(min_length=1)]] | None = None
    allowed_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)] | None = None

    def stop_list(self) -> list[str] | None:
        return [self.stop] if isinstance(self.stop, str) else self.stop


class CompletionRequest(SamplingRequest):
    prompt: Annotated[Text, Field(min_length=1)] | TokenIds | Annotated[
        list[Annotated[Text, Field(min_length=1)] | TokenIds], Field(min_length=1, max_length=1)]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=16)] | None = None      # None: n

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
        return v

    def check_choices(self) -> None:
        """best_of >= n (at most 16), no streaming with best_of > n, no echo with logprobs."""
        best = self.best_of or self.n
        if best < self.n:
            raise ValueError(f"best_of must be at least n, got best_of={best}, n={self.n}")
        if self.stream and best > self.n:
            raise ValueError("best_of > n cannot be streamed (the best choices are known only at the end)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs (prompt logprobs) is not supported yet")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]                              # a batch of one
        return p


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: Text


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            if self.role != "assistant":
                raise ValueError(f"a {self.role} message needs content")
            return ""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class FunctionDef(OpenAIModel):
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict | None = None


class ToolDef(OpenAIModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(OpenAIModel):
    name: StrictStr


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


def tool_call_schema(mode: str, tools: list[ToolDef]) -> dict:
    """The JSON the model must write: a named function's arguments, or (required) an object
    {"name": one of the tools, "arguments": that tool's arguments}."""
    def params(t):
        return t.function.parameters or {"type": "object"}
    if mode == "named":
        return params(tools[0])
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": params(t)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[dict] | None = None
    function_call: StrictStr | dict | None = None

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v):
        if v:
            raise ValueError("the legacy functions field is not supported: use tools")
        return v

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v):
        if v is not None and v != "none":
            raise ValueError("the legacy function_call field is not supported: use tool_choice")
        return v

    def _tool_constraint(self) -> list:
        mode = self.tool_mode()
        if mode is None or mode[0] == "auto":          # auto: the model decides, unconstrained
            return []
        return [("tool_choice", {"json": tool_call_schema(*mode)})]

    def tool_mode(self) -> tuple[str, list[ToolDef]] | None:
        """("auto" | "required" | "named", the tools the call may use), or None without tools or
        with tool_choice "none". auto (the default with tools): the model may answer with
        <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Hermes style), parsed from
        its text; required / named: the answer is constrained to a call."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice in (None, "auto"):
            return "auto", list(self.tools)
        if self.tool_choice == "required":
            return "required", list(self.tools)
        named = [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        if not named:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        return "named", named
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


# --- responses --------------------------------------------------------------------------------------
class TraceSpan(BaseModel):
    """A piece of a choice's text and the output token it belongs to. A token's text may be split
    over chunks, and a token may have no text (a pending multi-byte character, a special token, or
    text a stop string cut): spans are per token, in order, and their texts concatenate to the
    choice's text."""
    token: int                     # index of the output token
    text: str
    draft: bool                    # an accepted draft token (False: the target's own token)
    source: str | None             # the drafter that proposed it
    step: int                      # the request's decoding step that produced it


class Timings(BaseModel):
    """llama-server's per-response timings."""
    prompt_n: int
    prompt_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    draft_n: int
    draft_n_accepted: int


class SpecDecodeUsage(BaseModel):
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec_decode: SpecDecodeUsage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    spec_trace: list[TraceSpan] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str                  # JSON text, as OpenAI returns it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int = 0


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    spec_trace: list[TraceSpan] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    spec_trace: list[TraceSpan] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "draftwise"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a prompt, or chat messages (with the chat template)."""
    model: StrictStr | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: StrictBool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIModel):
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthStatus(BaseModel):
    status: str
