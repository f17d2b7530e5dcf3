"""Grammar-constrained decoding: the grammars requests may carry (JSON Schema, any JSON object, Lark with inline
JSON Schemas for tool calls), their validation, and the per-request matcher whose token mask the sampler applies.

The library is llguidance (Microsoft's, used by vLLM's `guidance` backend and llama.cpp), chosen over xgrammar:
  - it has no Python dependencies; xgrammar requires torch and transformers, so installing it can move the pinned
    torch==2.13.0 CPU build;
  - it compiles nothing ahead: the Earley parser and the lexer's derivatives are built lazily, so a new schema
    costs about a millisecond and a mask a few microseconds (benchmarks/grammar.py measures it), where a
    per-schema precompilation would stall the engine loop for every request with a new schema;
  - it reports the JSON Schema features it does not implement by name ("Unimplemented keys: [\"not\"]"), which is
    what a 400 must say; and its Lark dialect embeds JSON Schemas (`%json {...}`), which is exactly how a tool
    call is shaped (`<tool_call>` + JSON + `</tool_call>`).

Grammars travel to the engine-core process as llguidance's own grammar text in SamplingParams.grammar. Building
and checking them needs no tokenizer and no torch (front end); matching them needs the model's tokenizer (core).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from engine.errors import RequestError

log = logging.getLogger("engine")

# Compact, deterministic JSON: no free whitespace (a small model at temperature 1 would otherwise emit newlines
# forever), and the separators json.dumps writes, which models have seen most.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg():
    import llguidance  # noqa: PLC0415 - only requests with a grammar need it
    return llguidance


def _with_options(schema: dict) -> dict:
    """The schema with our JSON layout, unless the schema sets its own through llguidance's `x-guidance` key."""
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


def json_schema(schema: dict) -> str:
    """A grammar for JSON documents valid under `schema` (draft 2020-12, as far as llguidance implements it)."""
    return _llg().LLMatcher.grammar_from_json_schema(_with_options(schema))


def json_object() -> str:
    """Any JSON object (OpenAI's `json_object` mode)."""
    return json_schema({"type": "object"})


def lark(text: str) -> str:
    return _llg().LLMatcher.grammar_from_lark(text)


def lark_json(schema: dict) -> str:
    """`%json {...}`: a schema inlined into a Lark rule, with our JSON layout."""
    return "%json " + json.dumps(_with_options(schema), ensure_ascii=False)


def lark_literal(text: str) -> str:
    """A Lark string literal matching `text` exactly (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def check(grammar: str) -> str | None:
    """Why `grammar` cannot be used (llguidance's message, which names unsupported schema keywords), or None. No
    tokenizer needed: the front end calls this before a request is accepted."""
    failed, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if failed else None


class Matcher:
    """One request's position in its grammar. The sampler asks for the mask of allowed next tokens; the state
    advances with every token the request accepts (`accept`)."""

    __slots__ = ("_m",)

    def __init__(self, matcher):
        self._m = matcher

    def bitmask(self) -> bytes:
        """Allowed next tokens, one bit per token id (little-endian within 32-bit words)."""
        return self._m.compute_bitmask()

    def accept(self, token_id: int) -> bool:
        """False if the token broke the grammar (the matcher then stays in an error state)."""
        return self._m.consume_token(token_id)

    @property
    def done(self) -> bool:
        """Nothing but end-of-sequence may follow (the document is complete), or the matcher failed."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class Grammars:
    """The engine core's grammar support: the model's tokenizer as llguidance sees it (every token's bytes, in
    a trie), built on the first request that has a grammar (~0.5 s for a 50k vocabulary) and kept."""

    def __init__(self, model: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self.model, self.vocab_size, self.eos_token_ids = model, vocab_size, list(eos_token_ids)
        self._tokenizer = None

    def tokenizer(self):
        if self._tokenizer is None:
            started = time.monotonic()
            from engine import tokenizer as tokenizers
            hf = tokenizers.load(self.model)
            if not hasattr(hf, "backend_tokenizer"):
                raise RequestError("structured output and forced tool calls need a fast tokenizer "
                                   "(tokenizer.json); this model has none", param="response_format")
            import llguidance.hf  # noqa: PLC0415
            # Every end token ends a grammar's document, not only the tokenizer's eos_token.
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            log.info("grammar support ready: the tokenizer's %d tokens indexed in %.2f s", self.vocab_size,
                     time.monotonic() - started)
        return self._tokenizer

    def matcher(self, grammar: str) -> Matcher:
        m = _llg().LLMatcher(self.tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise RequestError(f"the output grammar cannot be used: {m.get_error()}", param="response_format")
        return Matcher(m)
