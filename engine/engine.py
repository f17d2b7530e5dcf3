"""The offline engine: `Engine.generate` over an in-process EngineCore, with the text layer the server uses too."""
from __future__ import annotations

import itertools
from typing import Sequence

from engine import tokenizer as tokenizers
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import RequestError
from engine.outputs import Completion, RequestOutput, RequestState, fold
from engine.params import SamplingParams

Prompt = str | list[int]


class Engine:
    """Synchronous engine: the core plus tokenizer and the per-request text layer."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = tokenizers.load(config.model)
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def new_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> RequestState:
        """Tokenize and admit one request into the core; returns its text-layer state."""
        ids = self.encode(prompt)
        self.core.add_request(request_id, ids, params)
        return RequestState(request_id, ids, params, self.tokenizer)

    def step(self, states: dict[str, RequestState]) -> list[RequestOutput]:
        """One core step, folded through the text layer; requests that finish are dropped from states."""
        results = []
        for out in self.core.step():
            state = states.get(out.request_id)
            if state is None:
                continue
            ro, abort = fold(state, out)
            if abort:
                self.core.abort_request(out.request_id)
            if ro.finished:
                del states[out.request_id]
            results.append(ro)
        return results

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[Completion]:
        params = params if params is not None else SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise RequestError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        order: list[RequestState] = []
        live: dict[str, RequestState] = {}
        try:
            for prompt, p in zip(prompts, plist):
                state = self.new_request(f"gen-{next(self._ids)}", prompt, p)
                order.append(state)
                live[state.request_id] = state
            while live:
                self.step(live)
        finally:
            for rid in live:
                self.core.abort_request(rid)
        return [s.completion() for s in order]
