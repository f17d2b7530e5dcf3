"""OpenAI wire format: pydantic request models (validation at the HTTP edge) and response models."""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt

from engine.params import LOGIT_BIAS, MAX_LOGIT_BIAS, MAX_STOP, RANGES

MAX_N = 128  # OpenAI's documented limit for `n`
# Bounds on lists a body may carry (all well past real use), so no request costs more to parse and check than a
# prompt of the same size would: OpenAI documents 128 tools; the others are ours.
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOP_TOKEN_IDS = 4096
MAX_PROMPTS = 1024  # a batch of prompts in one completion request
MAX_PARTS = 1024  # text parts of one message's content

# Unknown fields are ignored (OpenAI SDKs send extras); NaN/Infinity are rejected, not passed to the sampler.
_LENIENT = ConfigDict(extra="ignore", allow_inf_nan=False)
# A request body keeps its unknown fields (engine.server.fields logs each name once, then ignores them).
_REQUEST = ConfigDict(extra="allow", allow_inf_nan=False)


def _ranged(name: str, kind: type = float):
    """A field bounded by params.RANGES[name]: the ranges SamplingParams checks, stated once."""
    return Annotated[kind, Field(**RANGES[name].bounds)]


def _utf8(text: str) -> str:
    """JSON may escape a lone surrogate ("\\ud800"): not Unicode text, so no tokenizer or encoder can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate (\\u{ord(text[e.start]):04x} at character {e.start}); send "
                         "valid UTF-8 text") from None
    return text


def _utf8_json(value):
    """A free-form JSON value that reaches a template, a tokenizer or the grammar compiler: every string (keys too)
    Unicode, every number finite (Python's JSON reader takes NaN, which no JSON writer may emit)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            _utf8(v)
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"contains {v}, which is not JSON; send finite numbers")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return value


Text = Annotated[str, AfterValidator(_utf8)]
JSONObject = Annotated[dict[str, Any], AfterValidator(_utf8_json)]
PositiveInt = Annotated[int, Field(ge=1)]
# OpenAI allows [a-zA-Z0-9_-]{1,64}; dots and colons too here (MCP clients name tools "server.tool")
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS, le=LOGIT_BIAS)]
Stop = Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None


class StreamOptions(BaseModel):
    model_config = _LENIENT
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: Text = "response"
    description: Text | None = None
    schema_: JSONObject = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the output always follows the schema (grammar-constrained), strict or not


class ResponseFormat(BaseModel):
    model_config = _LENIENT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Fields both completion endpoints share, including the vLLM extensions clients already send."""
    model_config = _REQUEST
    model: Text | None = None  # None = the served model
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    max_tokens: _ranged("max_tokens", int) | None = None  # None = the rest of the context window
    temperature: _ranged("temperature") = 1.0
    top_p: _ranged("top_p") = 1.0
    seed: int | None = None
    stop: Stop = None
    presence_penalty: _ranged("presence_penalty") = 0.0
    frequency_penalty: _ranged("frequency_penalty") = 0.0
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None  # token id -> bias
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: _ranged("top_k", int) = 0
    min_p: _ranged("min_p") = 0.0
    repetition_penalty: _ranged("repetition_penalty") = 1.0
    min_tokens: _ranged("min_tokens", int) = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None


class CompletionRequest(SamplingFields):
    # token ids: no true/1.0 coercion
    prompt: (Text | Annotated[list[Text], Field(max_length=MAX_PROMPTS)] | list[StrictInt]
             | Annotated[list[list[StrictInt]], Field(max_length=MAX_PROMPTS)])
    max_tokens: _ranged("max_tokens", int) | None = 16  # OpenAI's default; null = the rest of the context window
    logprobs: _ranged("logprobs", int) | None = None
    echo: bool = False
    best_of: PositiveInt | None = None  # only best_of == n is supported
    response_format: ResponseFormat | None = None  # vLLM extension


class TextPart(BaseModel):
    model_config = _LENIENT
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    model_config = _LENIENT
    name: Text
    arguments: Text = "{}"  # a JSON object, as text


class ToolCallIn(BaseModel):
    model_config = _LENIENT
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _LENIENT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: Text | None = None  # tool
    reasoning_content: Text | None = None  # assistant: its earlier thinking (templates that keep it read it)


class FunctionDef(BaseModel):
    model_config = _LENIENT
    name: FunctionName
    description: Text | None = None
    parameters: JSONObject | None = None  # JSON Schema; none = any object
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = _LENIENT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _LENIENT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = _LENIENT
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: _ranged("logprobs", int) | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: Text | None = None  # passed to the chat template as `reasoning_effort`
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open and continue it
    chat_template_kwargs: JSONObject | None = None  # extra template variables, e.g. {"enable_thinking": false}


class TokenizeRequest(BaseModel):
    model_config = _LENIENT
    prompt: Text
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _LENIENT
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


# ---- responses ----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # present only when there is something to say (exclude_if): clients send the message back as history
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deploykit"
    root: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int | None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
