"""A streamed token's chunk is spliced into a pre-serialized template: it must be the very JSON the whole chunk
serializes to, for any text a tokenizer can emit and any id or model name."""
from __future__ import annotations

import json

import pytest

from engine.server.serving import _MARK, dumps, splice

TEXTS = ["", " world", 'a "quoted" \\ back\\slash', "line\nbreak\ttab\r", "\x00\x01\x1f control", "é漢字 🙂",
         "\u2028\u2029 separators", "\ufffd", "</script>", "{\"json\": [1, 2]}"]


@pytest.mark.parametrize("model", ["tiny", 'we"ird \\ mödel/name', _MARK])
@pytest.mark.parametrize("text", TEXTS)
def test_a_spliced_chunk_is_the_whole_chunk_serialized(model, text):
    head = {"id": "chatcmpl-0f", "object": "chat.completion.chunk", "created": 1764567890, "model": model}
    for usage in ({}, {"usage": None}):
        def chunk(t: str) -> dict:
            return {**head, "choices": [{"index": 3, "delta": {"content": t}, "logprobs": None,
                                         "finish_reason": None}], **usage}
        before, after = splice(chunk(_MARK))
        assert before + dumps(text) + after == dumps(chunk(text))
        assert json.loads(before + dumps(text) + after)["choices"][0]["delta"]["content"] == text


def test_dumps_is_compact_and_keeps_non_ascii():
    assert dumps({"a": [1, None], "b": "é"}) == '{"a":[1,null],"b":"é"}'
