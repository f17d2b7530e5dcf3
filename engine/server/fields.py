"""Which request fields each endpoint honours, ignores or rejects, beyond the ones its request model declares (those
are supported). Clients send many fields a self-hosted server has no use for; each such field is logged once per
name (not per request) so an operator sees what clients expect, and a field whose absence would silently change
the answer is a 400 naming it. The README's endpoint tables list the same fields (tests/server/test_fields.py
holds them to this file and the request models).
"""
from __future__ import annotations

import logging

from pydantic import BaseModel

from engine.server.errors import bad_request

log = logging.getLogger("engine.server")
_SEEN_CAP = 1024  # distinct names remembered; a client inventing names per request cannot grow memory

# Accepted and ignored (logged once): why each does not matter here.
_NO_STORE = "this server stores nothing"
_ONE_TIER = "one service tier"
_NOTHING = "no effect on a self-hosted model"
_NO_KEY = "prefix reuse needs no key"
IGNORED: dict[str, dict[str, str]] = {
    "completions": {"user": _NOTHING},
    "chat": {"user": _NOTHING, "metadata": _NO_STORE, "store": _NO_STORE, "service_tier": _ONE_TIER,
             "safety_identifier": _NOTHING, "prompt_cache_key": _NO_KEY,
             "prompt_cache_retention": _NO_KEY, "modalities": "text is the only modality",
             "verbosity": "the model's length is steered by max_tokens only"},
    "responses": {"user": _NOTHING, "metadata": "echoed back, not stored", "store": _NO_STORE,
                  "service_tier": _ONE_TIER, "safety_identifier": _NOTHING,
                  "prompt_cache_key": _NO_KEY, "prompt_cache_retention": _NO_KEY,
                  "include": "nothing extra to include", "truncation": "an input over the context is a 400",
                  "max_tool_calls": "calls are bounded by parallel_tool_calls and max_output_tokens",
                  "top_logprobs": "not reported by this endpoint; use /v1/chat/completions",
                  "stream_options": "no stream options apply", "context_management": _NO_STORE},
}

# Rejected when set (not null / false): what to do instead.
REJECTED: dict[str, dict[str, str]] = {
    "completions": {"suffix": "suffix (insertion) is not supported; put all the text in prompt"},
    "chat": {"functions": "the legacy `functions` field is not supported; send them as `tools` "
                          "([{\"type\": \"function\", \"function\": {...}}])",
             "function_call": "the legacy `function_call` field is not supported; use `tool_choice` "
                              "(\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}})",
             "audio": "audio output is not supported; this server returns text",
             "prediction": "predicted outputs are not supported; drop `prediction`",
             "web_search_options": "web search is not available on this server"},
    "responses": {"previous_response_id": "this server is stateless (responses are not stored), so "
                                          "previous_response_id cannot be resolved; send the whole conversation "
                                          "as `input` (earlier outputs included) instead",
                  "conversation": "this server is stateless: conversations are not stored; send the whole "
                                  "conversation as `input`",
                  "background": "background responses need stored state; this server is stateless",
                  "prompt": "stored prompt templates are not available on this server; send `instructions` and "
                            "`input`"},
}

_seen: set[tuple[str, str]] = set()


def check(req: BaseModel, endpoint: str) -> None:
    """400 for a rejected field that is set; a log line, once per name, for each ignored or unknown one."""
    extra = req.model_extra or {}
    for name, value in extra.items():
        why = REJECTED[endpoint].get(name)
        if why is not None and value not in (None, False):
            raise bad_request(why, name)
    for name in extra:
        if name in REJECTED[endpoint] or (endpoint, name) in _seen or len(_seen) >= _SEEN_CAP:
            continue
        _seen.add((endpoint, name))
        shown = name[:64].encode("unicode_escape").decode("ascii")  # lone surrogates and controls, printable
        if name in IGNORED[endpoint]:
            log.info("%s: ignoring request field '%s' (%s); logged once", endpoint, shown, IGNORED[endpoint][name])
        else:
            log.warning("%s: ignoring unknown request field '%s'; logged once per name", endpoint, shown)
        if len(_seen) == _SEEN_CAP:
            log.warning("%d distinct ignored field names seen; no longer logging new ones", _SEEN_CAP)
