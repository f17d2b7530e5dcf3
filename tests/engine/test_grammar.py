"""Grammar-constrained sampling (engine.grammar through the batched sampler and the core) and logit_bias: constrained
rows produce documents valid for their schema under every sampling control while unconstrained rows in the same
batch sample exactly as they would alone; the core ends a request when its document is complete."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import grammar
from engine import tokenizer as tokenizers
from engine.errors import RequestError
from engine.grammar import Grammars
from engine.params import SamplingParams, check_token_ids
from engine.sampling import Sampler, SamplingState

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]},
                                           "words": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                     "maxItems": 3}},
          "required": ["n", "ok", "tag", "words"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("qwen3", chat_template="qwen3")


@pytest.fixture(scope="module")
def tok(model):
    return tokenizers.load(model)


@pytest.fixture(scope="module")
def grammars(model, tok) -> Grammars:
    return Grammars(model, len(tok), [tok.eos_token_id])


def test_constrained_rows_follow_the_schema_in_a_batch_with_free_rows(grammars, tok):
    """Six rows over random logits: three under the schema with temperature 1, top-k, top-p, min-p and penalties,
    three free and seeded. Every constrained row ends with a valid document; the free rows draw exactly the tokens
    they draw in a batch of their own."""
    g = grammar.json_schema(SCHEMA)
    vocab, eos = len(tok), [tok.eos_token_id]
    tied = [SamplingParams(temperature=1.0, max_tokens=None, grammar=g),
            SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3, max_tokens=None, grammar=g),
            SamplingParams(temperature=1.5, min_p=0.01, presence_penalty=1.0, frequency_penalty=0.5, seed=3,
                           max_tokens=None, grammar=g)]
    free = [SamplingParams(temperature=1.0, seed=10 + i, top_p=0.95, max_tokens=None) for i in range(3)]
    torch.manual_seed(0)
    steps = [torch.randn(6, vocab, generator=torch.Generator().manual_seed(s)) * 4 for s in range(400)]

    def run(params: list[SamplingParams], rows: list[int]) -> dict[int, list[int]]:
        states = {r: SamplingState(p, [1, 2, 3], eos, vocab, grammars) for r, p in zip(rows, params)}
        out: dict[int, list[int]] = {r: [] for r in rows}
        for logits in steps:
            live = [r for r in rows if not states[r].complete]
            if not any(states[r].matcher is not None for r in live):
                break
            tokens = Sampler()(logits[live].clone(), [states[r] for r in live]).token_ids
            for r, t in zip(live, tokens):
                states[r].append(t)
                out[r].append(t)
        return out

    mixed = run(tied + free, list(range(6)))
    for r in range(3):
        text = tok.decode(mixed[r], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
    alone = run(free, [3, 4, 5])
    for r in (3, 4, 5):
        n = len(alone[r])
        assert mixed[r][:n] == alone[r][: len(mixed[r])][:n]


def test_the_core_ends_the_request_when_the_document_is_complete(model, tok):
    from engine.config import EngineConfig
    from engine.engine import Engine
    engine = Engine(EngineConfig(model, max_model_len=512))
    g = grammar.json_schema(SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, grammar=g) for s in range(4)]
    params.append(SamplingParams(temperature=0.0, max_tokens=300, grammar=g))
    for c in engine.generate(["Hello"] * len(params), params):
        assert c.finish_reason == "stop" and len(c.token_ids) < 300, c
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_logit_bias_moves_and_bans_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 500, generator=g)
    best = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias=((7, 100.0),)),  # forces token 7
              SamplingParams(temperature=0, logit_bias=((best[1], -100.0),)),  # bans the favourite
              SamplingParams(temperature=0)]
    states = [SamplingState(p, [1], [0], 500) for p in params]
    tokens = Sampler()(logits.clone(), states).token_ids
    second = logits[1].topk(2).indices[1].item()
    assert tokens == [7, second, best[2]]


@pytest.mark.parametrize("bias, message", [(((5, 100.5),), "logit_bias"), (((-1, 1.0),), "logit_bias"),
                                           (((5, float("nan")),), "logit_bias")])
def test_logit_bias_out_of_range_names_the_field(bias, message):
    with pytest.raises(RequestError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == message


def test_logit_bias_and_stop_ids_must_be_in_the_vocabulary():
    with pytest.raises(RequestError) as e:
        check_token_ids(SamplingParams(logit_bias={900: 1.0}), 500)
    assert e.value.param == "logit_bias" and "900" in e.value.message


def test_unsupported_schema_features_are_named():
    assert grammar.check(grammar.json_schema(SCHEMA)) is None
    err = grammar.check(grammar.json_schema({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}))
    assert err is not None and "not" in err
    assert "Unknown format" in grammar.check(grammar.json_schema({"type": "string", "format": "no-such-format"}))
