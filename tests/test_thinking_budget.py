"""Thinking budget in the runtime: once spent, the close-of-thinking tokens are inserted unsampled.

Reference: the in-process model, greedy, fed the prompt, the budgeted reasoning tokens and the close
tokens as if they had been generated; the engine's continuation must equal it token for token.
"""

import json

import pytest
import torch

from kernels import reference as ops
from ranks.model import Batch, HybridModel
from ranks.weights import write_checkpoint
from runtime import Engine, EngineOptions, SamplingParams
from runtime.config import spec_from_hf
from tests.util import page_table, random_weights, tiny_config


def _greedy(model: HybridModel, ids: list[int], n: int) -> list[int]:
    state = model.new_state(1, 4)
    table = page_table(1, 4)
    out = model.forward(Batch(torch.tensor(ids), [len(ids)], [0], [0], table), state, logits="last")
    got, pos = [], len(ids)
    for _ in range(n):
        t = int(ops.greedy(out.logits)[0])
        got.append(t)
        out = model.forward(Batch(torch.tensor([t]), [1], [pos], [0], table), state, logits="last")
        pos += 1
    return got


@pytest.fixture(scope="module", params=[0, 3], ids=["plain", "spec-mtp-3"])
def setup(tmp_path_factory, request):
    """The engine without and with MTP speculation (drafting pauses inside the budgeted section)."""
    cfg = tiny_config(False)
    spec = spec_from_hf(cfg)
    weights = random_weights(spec, 11)
    d = tmp_path_factory.mktemp("budget")
    write_checkpoint(d, weights, prefix="model.")
    (d / "config.json").write_text(json.dumps(cfg))
    with Engine.start(d, tp=1, options=EngineOptions(max_concurrency=4, spec_draft_tokens=request.param)) as engine:
        yield engine, HybridModel(spec, weights)


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_spent_budget_inserts_close_tokens_then_continues(setup, budget):
    engine, model = setup
    prompt = [5, 17, 99, 3, 42, 8, 61]
    free = _greedy(model, prompt, budget + 1)
    end_id = next(t for t in range(1, 256) if t not in free)       # never sampled here: budget is spent
    close = [201, 202, 203]
    params = SamplingParams(temperature=0, max_new_tokens=budget + len(close) + 6, ignore_eos=True,
                            thinking_budget=budget, thinking_end_ids=(end_id,), thinking_close_ids=tuple(close))
    got = engine.submit(prompt, params).result(timeout=60)
    assert got.tokens[:budget] == free[:budget]
    assert got.tokens[budget:budget + 3] == close
    want_tail = _greedy(model, prompt + free[:budget] + close, 6)
    assert got.tokens[budget + 3:] == want_tail
    assert got.finish_reason == "length"


def test_ending_reasoning_within_budget_inserts_nothing(setup):
    engine, model = setup
    prompt = [9, 8, 7, 6]
    free = _greedy(model, prompt, 10)
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, thinking_budget=8,
                            thinking_end_ids=(free[2],), thinking_close_ids=(201, 202))
    assert engine.submit(prompt, params).result(timeout=60).tokens == free


def test_close_tokens_respect_max_new_tokens(setup):
    engine, model = setup
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, thinking_budget=2,
                            thinking_end_ids=(255,), thinking_close_ids=(201, 202, 203))
    got = engine.submit([1, 2, 3], params).result(timeout=60)
    assert len(got.tokens) == 3 and got.tokens[2] == 201 and got.finish_reason == "length"


def test_budget_without_close_tokens_is_refused():
    with pytest.raises(ValueError, match="thinking_close_ids"):
        SamplingParams(thinking_budget=4)
