"""The README's endpoint tables list every request field with what the server does with it, and say the same as the
code: `supported` = a field the request model declares, `ignored` / `rejected` = engine.server.fields' tables."""
from __future__ import annotations

import re

import pytest

from engine.server import fields
from engine.server import protocol as p
from engine.server.responses import ResponsesRequest
from tests.server.live import ROOT

ENDPOINTS = {"chat": ("POST /v1/chat/completions", p.ChatCompletionRequest),
             "completions": ("POST /v1/completions", p.CompletionRequest),
             "responses": ("POST /v1/responses", ResponsesRequest)}


def readme_table(title: str) -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"#### `{title}`")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        m = re.match(r"^\| `(\w+)` \| (supported|ignored|rejected) \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} listed twice under {title}"
            rows[m.group(1)] = m.group(2)
    return rows


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_readme_lists_every_field_with_its_status(endpoint):
    title, model = ENDPOINTS[endpoint]
    want = {name: "supported" for name in model.model_fields}
    want |= {name: "ignored" for name in fields.IGNORED[endpoint]}
    want |= {name: "rejected" for name in fields.REJECTED[endpoint]}
    assert not set(fields.IGNORED[endpoint]) & set(fields.REJECTED[endpoint]) & set(model.model_fields)
    assert readme_table(title) == want
