"""Per-request text layer over EngineCore's token outputs: detokenization, stop strings, output records."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.params import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from engine.messages import TokenOutput


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One streamed increment of a request."""
    request_id: str
    text: str                                # new text since the previous output
    token_ids: list[int]                     # new token ids since the previous output
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None                # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int                   # cumulative


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request, as Engine.generate returns it."""
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None


class RequestState:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=True)
        self.stop = StopStringMatcher(tuple(params.stop)) if params.stop else None
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.finished = False
        self.finish_reason: str | None = None

    def process(self, out: TokenOutput) -> RequestOutput:
        """Fold one core output in; a stop-string hit finishes the request here (see `fold`). Several tokens at once
        (a run of decode steps) go in one by one where stop strings are watched, so that the output ends at the token
        that completed one, as it would have one step at a time."""
        ids = out.new_token_ids
        if self.stop is None or len(ids) < 2:
            return self._process(out)
        parts = []
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            lp = None if out.logprobs is None else out.logprobs[i:i + 1]
            parts.append(self._process(replace(out, new_token_ids=(token,), logprobs=lp, finished=out.finished and last,
                                               finish_reason=out.finish_reason if last else None)))
            if parts[-1].finished:
                break
        lps = None if out.logprobs is None else [lp for p in parts for lp in p.logprobs or ()]
        return replace(parts[-1], text="".join(p.text for p in parts),
                       token_ids=[t for p in parts for t in p.token_ids], logprobs=lps)

    def _process(self, out: TokenOutput) -> RequestOutput:
        text = self.detok.add(out.new_token_ids)
        finished, reason = out.finished, out.finish_reason
        if finished:
            text += self.detok.flush()  # a trailing partial character is emitted (as U+FFFD) rather than lost
        if self.stop is not None and len(self.token_ids) + len(out.new_token_ids) > self.params.min_tokens:
            text, hit = self.stop.feed(text)
            if hit:
                finished, reason = True, "stop"
            elif finished:
                text += self.stop.flush()
        return self._emit(text, out.new_token_ids, out.logprobs, finished, reason)

    def abort(self) -> RequestOutput:
        return self._emit("", [], None, True, "abort")

    def _emit(self, text: str, token_ids: list[int], logprobs, finished: bool, reason: str | None) -> RequestOutput:
        self.text_parts.append(text)
        self.token_ids += token_ids
        if self.logprobs is not None and logprobs:
            self.logprobs += logprobs
        self.finished, self.finish_reason = finished, reason
        return RequestOutput(self.request_id, text, list(token_ids), None if logprobs is None else list(logprobs),
                             finished, reason, len(self.prompt_token_ids), len(self.token_ids))

    def completion(self) -> Completion:
        return Completion(self.request_id, self.prompt_token_ids, "".join(self.text_parts), self.token_ids,
                          self.finish_reason, self.logprobs)


def fold(state: RequestState, out: TokenOutput) -> tuple[RequestOutput, bool]:
    """One core output through the text layer: (the request's output, whether the caller must abort it in the
    core). The second is true when a stop string ended the request while the core still holds it (and its KV)."""
    ro = state.process(out)
    return ro, ro.finished and not out.finished
