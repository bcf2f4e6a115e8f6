"""tp 2 on two GPUs with the CUDA backend, through the engine: each all-reduce transport gives the
greedy ids of tp 1 on one GPU (the embedded model's golden prompts), the ranks report the transport
they run, and auto falls back to staged copies when the mailbox probe is too slow."""

from __future__ import annotations

import pytest

from tests.conftest import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs")]

PROMPTS = [
    "def add(a, b):\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
]
NEW_TOKENS = 24


def _generate(tp, transport="auto", spec=0, device_feed=False):
    from ranks.demo import default_model_dir
    from runtime import Engine, EngineOptions, SamplingParams
    from runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_dir())
    opts = EngineOptions(max_concurrency=2, transport=transport, spec_draft_tokens=spec, device_feed=device_feed)
    with Engine.start(default_model_dir(), tp=tp, device="cuda", dtype="bfloat16", options=opts) as engine:
        outs = []
        for p in PROMPTS:
            evs = list(engine.submit(tok.encode(p), SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS,
                                                                   ignore_eos=True)))
            assert not evs[-1].error, evs[-1].error
            outs.append(sum((e.tokens for e in evs), []))
        stats = engine.stats()
        if device_feed and all(r.get("device_feed") for r in stats["ranks"].values()):
            assert stats["steps_fed"] > 0, stats["steps_fed"]       # how many depends on timing
        if not any(r.get("device_feed") for r in stats["ranks"].values()):
            assert stats["steps_fed"] == 0
        return outs, stats["ranks"]


@pytest.fixture(scope="module")
def tp1():
    ids, ranks = _generate(1)
    assert ranks[0]["backend"] == "cuda"
    return ids


@pytest.mark.parametrize("transport", ["mailbox", "copies", "nccl"])
def test_tp2_equals_tp1(tp1, transport):
    ids, ranks = _generate(2, transport)
    assert [r["transport"] for r in ranks.values()] == [transport, transport]
    if transport in ("mailbox", "nccl"):
        assert all(r.get("cuda_graphs") for r in ranks.values()), ranks
    for a, b in zip(ids, tp1):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"{transport}: first divergence from tp 1 at token {same} of {len(a)}")
        assert a == b


def test_auto_falls_back_to_copies_when_the_probe_is_slow(tp1, monkeypatch):
    monkeypatch.setenv("TANDEM_MAILBOX_PROBE_LIMIT_US", "0")
    ids, ranks = _generate(2, "auto")
    assert [r["transport"] for r in ranks.values()] == ["copies", "copies"]
    assert all(r["probe_us"] > 0 for r in ranks.values())
    assert ids == tp1


@pytest.mark.parametrize("transport", ["mailbox", "nccl"])
def test_tp2_speculation_equals_tp1(tp1, transport):
    """MTP rounds at tp 2 (GPU rounds: the vocabulary shards' argmax merged by one all-reduce inside
    the captured round) give tp 1's plain greedy ids."""
    ids, ranks = _generate(2, transport, spec=3)
    assert [r["spec_rounds"] for r in ranks.values()] == ["gpu", "gpu"]
    assert ids == tp1


@pytest.mark.parametrize("tp,transport,on", [(1, "auto", True), (2, "mailbox", False)])
def test_device_feed_default(tp1, tp, transport, on):
    """EngineOptions.device_feed unset: on at tp 1 (measured, docs/perf.md), off at tp 2 until
    measured on two GPUs; tp 1's plain ids either way."""
    ids, ranks = _generate(tp, transport, device_feed=None)
    assert [r["device_feed"] for r in ranks.values()] == [on] * tp
    assert ids == tp1


@pytest.mark.parametrize("tp,transport", [(1, "auto"), (2, "mailbox"), (2, "nccl"), (2, "copies")])
def test_device_fed_steps_equal_tp1(tp1, tp, transport):
    """EngineOptions.device_feed: greedy tokens chosen on the GPUs (the shards' candidates merged by
    the transport's all-reduce) feed the next step, launched before they reach the host: tp 1's
    plain ids, and most steps fed. The staged copies synchronise the stream, so there the ranks turn
    the feed off (and say so in Ready.runtime)."""
    ids, ranks = _generate(tp, transport, device_feed=True)
    assert [r["device_feed"] for r in ranks.values()] == [transport != "copies"] * tp
    assert ids == tp1
