"""The fused decode step from token ids to greedy tokens (decode_step.cpp: the embedding lookup, the final norm, the LM
head and each row's argmax in the same native call): the same logits, KV cache and tokens as the per-op path, bit for
bit, for every kind of token table and head; ties and NaNs picked as torch.argmax picks them; bad inputs refused.
"""
from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.config import EngineConfig
from engine.core import EngineCore

from tests.engine.conftest import NATIVE
from tests.engine.test_bf16_decode import SHAPE
from tests.engine.test_decode_step import HELD, assert_bitwise, drive, side_by_side

pytestmark = [pytest.mark.skipif(not NATIVE, reason="no native path here (a CPU without AVX-512, or DEPLOYKIT_KERNELS "
                                                    "off)"),
              pytest.mark.usefixtures("native_kernels")]  # a CPU that runs it must have it built


# Token tables and LM heads of every kind the step reads: a plain bf16 table beside a packed or compact head, both
# quantized on load, and tied (the packed, compact or quantized head is the table).
TABLES = [(q, c, tie) for q, c in HELD for tie in (False, True)]


@pytest.mark.parametrize("quantization,compact,tie", TABLES)
def test_the_step_goes_from_token_ids_to_logits_bitwise_as_the_per_op_path(tiny_model, quantization, compact, tie,
                                                                           monkeypatch):
    # Decode steps take the embedding lookup, the final norm and the LM head into the fused call (decode_step.cpp
    # says why): no decode step leaves them to Python, and the logits and KV cache are the per-op path's, bit for bit.
    model_dir = tiny_model("qwen3", **SHAPE, tie_word_embeddings=tie)

    def run(fused: bool):
        core = EngineCore(EngineConfig(model_dir, dtype="bfloat16", block_size=8, max_model_len=256, decode_steps=1,
                                       quantization=quantization, compact_weights=compact, max_num_seqs=16))
        m = core.model
        python = []  # rows Python looked up or computed logits for
        for name in ("_embed", "compute_logits"):
            fn = getattr(m, name)
            monkeypatch.setattr(m, name, lambda x, fn=fn: python.append(x.shape[0]) or fn(x))
        if not fused:
            m.step_weights = None
        sample = core.sampler  # (logits, the step's argmax) of each decode step that has one
        core.sampler = lambda x, states, a=None: ((a is not None and picked.append((x.clone(), a)))
                                                  or sample(x, states, a))
        return (m, python) + drive(core, side_by_side(min(m.step_logits_rows, 6)), 2, monkeypatch)

    picked: list[tuple[torch.Tensor, torch.Tensor]] = []

    m, python, logits, kv, calls = run(True)
    _, _, ref_logits, ref_kv, ref_calls = run(False)
    assert ref_calls == [] and {rows for rows, _ in calls} == set(range(1, min(m.step_logits_rows, 6) + 1))
    assert len(python) == 2 * (len(logits) - len(calls)), "Python looked up rows or logits for a decode step"
    assert_bitwise(logits, kv, ref_logits, ref_kv)
    assert picked and all(torch.equal(a, x.argmax(-1)) for x, a in picked)  # the step's greedy tokens
    head, table = m.lm_head, m._table()
    assert kernels.is_quantized(head) == (quantization != "none") == kernels.is_quantized(table)
    assert kernels.is_compact(head) == (compact and quantization == "none")
    assert (table is head) == tie and (tie or quantization != "none" or table.dim() == 2)
    wide = kernels.is_quantized(head) or kernels.on_tiles(head)
    assert m.step_logits_rows == (m.step_max_rows if wide else kernels.STEP_MAX_ROWS)


def test_the_step_picks_as_torch_argmax_and_refuses_a_bad_token_table_head_or_logits(tiny_model):
    core = EngineCore(EngineConfig(tiny_model("qwen3", **SHAPE), dtype="bfloat16", block_size=8, max_model_len=64))
    m, s = core.model, core.model.config
    i32, i64 = torch.int32, torch.int64

    def step(logits=None, lm_head=m.lm_head, norm=m.norm.weight, ids=torch.tensor([5]), embed=m._table(),
             greedy=None) -> tuple[torch.Tensor, torch.Tensor]:
        n = ids.shape[0]
        logits = torch.empty(n, s.vocab_size) if logits is None else logits
        greedy = torch.full((n,), -1) if greedy is None else greedy
        kernels.decode_step_(torch.zeros(n, s.hidden_size, dtype=torch.bfloat16), m.step_weights,
                             core.runner.kv.layers, m.windows, m.rotary.cos, m.rotary.sin, torch.zeros(n, dtype=i64),
                             torch.zeros(n, 1, dtype=i32), torch.ones(n, dtype=i32), torch.zeros(n, dtype=i64),
                             s.num_heads, s.num_kv_heads, s.rms_norm_eps, 1.0, norm, lm_head, logits, ids, embed,
                             greedy)
        return logits, greedy

    logits, greedy = step(ids=torch.tensor([5, 9, 300]))  # valid
    assert torch.equal(greedy, logits.argmax(-1))
    # Each thread picks among the columns it computed; merged, they are torch.argmax's answer: the first maximum
    # (here every logit ties, and thread 1's columns start at 512), a NaN first.
    V, H = s.vocab_size, s.hidden_size
    zeros = kernels.prepare_weight(torch.zeros(V, H, dtype=torch.bfloat16), compact=False)
    assert step(lm_head=zeros)[1].tolist() == [0]
    tie = torch.zeros(V, H, dtype=torch.bfloat16)
    tie[[700, 900]] = 1.0
    tie[[100, 600]] = -1.0  # the best is 700 (x sums positive) or 100 (negative), never a later tie
    logits, greedy = step(lm_head=kernels.prepare_weight(tie, compact=False), ids=torch.tensor([5, 7]))
    assert torch.equal(greedy, logits.argmax(-1)) and set(greedy.tolist()) <= {0, 100, 700}
    assert step(norm=torch.full_like(m.norm.weight, float("nan")))[1].tolist() == [0]
    with pytest.raises(RuntimeError, match="greedy must be a contiguous int64 \\[B\\] tensor"):
        step(greedy=torch.zeros(1, dtype=i32))
    with pytest.raises(RuntimeError, match="logits must be a contiguous fp32 \\[B, V\\] tensor"):
        step(torch.empty(1, s.vocab_size, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="lm_head: the compact weight is"):
        step(torch.empty(1, s.vocab_size - 16))
    with pytest.raises(RuntimeError, match=f"the final norm: expected a contiguous bf16 tensor of {s.hidden_size}"):
        step(norm=m.norm.weight[:8])
    with pytest.raises(RuntimeError, match=f"token id {s.vocab_size} of row 1 is outside the vocabulary"):
        step(ids=torch.tensor([0, s.vocab_size]))
    with pytest.raises(RuntimeError, match="the token table: expected a contiguous bf16"):
        step(embed=m._table().float())
    with pytest.raises(RuntimeError, match="ids must be a contiguous int64"):
        step(ids=torch.tensor([5], dtype=i32))
