"""The context-length rule (deploykit.modelconfig.context_length), which the planner and the engine both apply."""

import pytest

from deploykit.errors import ModelError, PlanError
from deploykit.modelconfig import context_length


def test_what_was_asked_for_else_what_the_checkpoint_states():
    assert context_length(2048, None) == 2048
    assert context_length(2048, 512) == 512
    assert context_length(None, 512) == 512  # a checkpoint without max_position_embeddings needs max_model_len


def test_too_long_or_unknown_names_the_setting_in_the_callers_terms():
    with pytest.raises(ModelError) as e:  # the engine's terms (re-raised as its ModelLoadError)
        context_length(2048, 4096)
    p = e.value.problems[0]
    assert (p.path, p.value, p.allowed) == ("max_model_len", 4096, "1-2048")
    assert "max_position_embeddings=2048" in p.message
    with pytest.raises(PlanError) as e:  # the planner's: the spec's field, and a placement error (exit 5)
        context_length(None, None, field="model.max_model_len", error=PlanError)
    assert e.value.problems[0].path == "model.max_model_len" and "set model.max_model_len" in str(e.value)
