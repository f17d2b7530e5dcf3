"""OpenAI wire format: pydantic request models (validation at the HTTP edge) and response models."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from engine.params import MAX_STOP, RANGES

MAX_N = 128  # OpenAI's documented limit for `n`

# Unknown fields are ignored (OpenAI SDKs send extras); NaN/Infinity are rejected, not passed to the sampler.
_LENIENT = ConfigDict(extra="ignore", allow_inf_nan=False)


def _ranged(name: str, kind: type = float):
    """A field bounded by params.RANGES[name]: the ranges SamplingParams checks, stated once."""
    return Annotated[kind, Field(**RANGES[name].bounds)]


PositiveInt = Annotated[int, Field(ge=1)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP)] | None


class StreamOptions(BaseModel):
    model_config = _LENIENT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both completion endpoints share, including the vLLM extensions clients already send."""
    model_config = _LENIENT
    model: str | None = None  # None = the served model
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    max_tokens: _ranged("max_tokens", int) | None = None  # None = the rest of the context window
    temperature: _ranged("temperature") = 1.0
    top_p: _ranged("top_p") = 1.0
    seed: int | None = None
    stop: Stop = None
    presence_penalty: _ranged("presence_penalty") = 0.0
    frequency_penalty: _ranged("frequency_penalty") = 0.0
    logit_bias: dict[str, float] | None = None  # accepted only when empty
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: _ranged("top_k", int) = 0
    min_p: _ranged("min_p") = 0.0
    repetition_penalty: _ranged("repetition_penalty") = 1.0
    min_tokens: _ranged("min_tokens", int) = 0
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # token ids: no true/1.0 coercion
    logprobs: _ranged("logprobs", int) | None = None
    echo: bool = False
    best_of: PositiveInt | None = None  # only best_of == n is supported
    suffix: str | None = None  # not supported


class TextPart(BaseModel):
    model_config = _LENIENT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _LENIENT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: _ranged("logprobs", int) | None = None
    tools: list[dict] | None = None  # accepted only when empty
    response_format: dict | None = None  # only {"type": "text"}
    add_generation_prompt: bool = True  # vLLM extension


class TokenizeRequest(BaseModel):
    model_config = _LENIENT
    prompt: str
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
