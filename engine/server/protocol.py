"""OpenAI wire format: pydantic request models (validation at the HTTP edge) and response models."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt

from engine.params import MAX_STOP, RANGES

MAX_N = 128  # OpenAI's documented limit for `n`
# Bounds on lists a body may carry (all well past real use), so no request costs more to parse and check than a
# prompt of the same size would: OpenAI documents 128 tools; the others are ours.
MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_STOP_TOKEN_IDS = 4096
MAX_LOGIT_BIAS = 1024
MAX_PROMPTS = 1024  # a batch of prompts in one completion request

# Unknown fields are ignored (OpenAI SDKs send extras); NaN/Infinity are rejected, not passed to the sampler.
_LENIENT = ConfigDict(extra="ignore", allow_inf_nan=False)


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


Text = Annotated[str, AfterValidator(_utf8)]
PositiveInt = Annotated[int, Field(ge=1)]
Stop = Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None


class StreamOptions(BaseModel):
    model_config = _LENIENT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both completion endpoints share, including the vLLM extensions clients already send."""
    model_config = _LENIENT
    model: Text | None = None  # None = the served model
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    max_tokens: _ranged("max_tokens", int) | None = None  # None = the rest of the context window
    temperature: _ranged("temperature") = 1.0
    top_p: _ranged("top_p") = 1.0
    seed: int | None = None
    stop: Stop = None
    presence_penalty: _ranged("presence_penalty") = 0.0
    frequency_penalty: _ranged("frequency_penalty") = 0.0
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None  # accepted only empty
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
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
    logprobs: _ranged("logprobs", int) | None = None
    echo: bool = False
    best_of: PositiveInt | None = None  # only best_of == n is supported
    suffix: Text | None = None  # not supported


class TextPart(BaseModel):
    model_config = _LENIENT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = _LENIENT
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: _ranged("logprobs", int) | None = None
    tools: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None  # accepted only when empty
    response_format: dict | None = None  # only {"type": "text"}
    add_generation_prompt: bool = True  # vLLM extension


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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
