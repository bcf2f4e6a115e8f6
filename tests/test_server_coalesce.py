"""Coalesced deltas: the tokens of one engine event (a speculation round) go out as one chunk per kind of
text, with their log-probabilities on it; the text of different events stays apart; a consumer that fell
behind takes every queued event in one wake-up (RequestStream.batches). The stream says what it said
token by token: checked against the non-streamed answer and, chunk by chunk, against the logprob entries'
own bytes, through the OpenAI (chat, completions), Responses and Anthropic SDKs.
"""

from __future__ import annotations

import asyncio
import random
import threading
from types import SimpleNamespace

import anthropic
import openai
import pytest

from runtime.engine import Event, RequestStream
from runtime.tokenizer import Tokenizer, generation_defaults
from server.app import create_app
from server.generation import EVENT_END, coalesce
from server.service import (ContentDelta, Finish, ReasoningDelta, Service, TokenLogprobs, ToolCallArgs,
                            ToolCallStart)
from tests.server_util import FakeEngine, qwen_template, running, tiny_model_dir

TEXT = "The quick brown fox jumps over the lazy dog, then naps; a second fox counts sheep."


# ---- coalesce() ------------------------------------------------------------------------------------

def _entries(tag: str, n: int) -> list[dict]:
    return [{"token": f"{tag}{i}"} for i in range(n)]


def test_coalesce_merges_runs_within_an_event_and_keeps_the_order():
    deltas = [TokenLogprobs(_entries("a", 1)), ContentDelta("The"), TokenLogprobs(_entries("b", 2)),
              ContentDelta(" quick"), ReasoningDelta("hm"), ReasoningDelta(" ok"),
              ToolCallStart(0, "call_1", "f"), ToolCallArgs(0, '{"x"'), ToolCallArgs(0, ": 1"),
              ToolCallArgs(1, "{"), TokenLogprobs(_entries("c", 1)),
              EVENT_END, ToolCallArgs(1, "}"), ContentDelta(" brown"), ContentDelta(" fox"),
              TokenLogprobs(_entries("d", 1)), Finish("stop", {}, {}, None, [])]
    out = coalesce(deltas)
    assert [type(d).__name__ for d in out] == [
        "TokenLogprobs", "ContentDelta", "ReasoningDelta", "ToolCallStart", "ToolCallArgs", "ToolCallArgs",
        "TokenLogprobs", "ToolCallArgs", "ContentDelta", "TokenLogprobs", "Finish"]
    assert [e["token"] for e in out[0].entries] == ["a0", "b0", "b1"] and out[1].text == "The quick"
    assert out[2].text == "hm ok"
    assert (out[4].index, out[4].fragment) == (0, '{"x": 1') and (out[5].index, out[5].fragment) == (1, "{")
    # c0 came after the last delta of the first event: it rides on the next event's first delta
    assert [e["token"] for e in out[6].entries] == ["c0"] and out[7].fragment == "}"
    assert out[8].text == " brown fox" and [e["token"] for e in out[9].entries] == ["d0"]


def test_coalesce_of_random_runs_says_the_same():
    rng = random.Random(20261202)
    for _ in range(200):
        deltas, n_entries = [], 0
        for _ in range(rng.randrange(1, 30)):
            r = rng.random()
            if r < 0.15:
                deltas.append(EVENT_END)
            elif r < 0.4:
                k = rng.randrange(1, 4)
                deltas.append(TokenLogprobs(_entries(f"e{n_entries}_", k)))
                n_entries += k
            elif r < 0.7:
                deltas.append(ContentDelta("".join(rng.choice("ab ") for _ in range(rng.randrange(1, 4)))))
            elif r < 0.85:
                deltas.append(ReasoningDelta(rng.choice("xyz")))
            else:
                deltas.append(ToolCallArgs(rng.randrange(2), rng.choice("{}:,")))
        out = coalesce(deltas)
        flat = [d for d in deltas if d is not EVENT_END]
        # the same entries in the same order, the same text of every kind in the same order
        assert [e for d in out if isinstance(d, TokenLogprobs) for e in d.entries] == \
            [e for d in flat if isinstance(d, TokenLogprobs) for e in d.entries]

        def texts(ds):
            return [(type(d).__name__, getattr(d, "index", None), getattr(d, "text", getattr(d, "fragment", None)))
                    for d in ds if not isinstance(d, TokenLogprobs)]

        def joined(ts):
            out = []
            for kind, index, text in ts:
                if out and out[-1][:2] == (kind, index):
                    out[-1] = (kind, index, out[-1][2] + text)
                else:
                    out.append((kind, index, text))
            return out
        assert joined(texts(out)) == joined(texts(flat))
        # never more chunks than before; as many as one per run of one kind inside one event
        assert len(texts(out)) <= len(texts(flat))
        runs = 0
        for seg in "|".join("E" if d is EVENT_END else "T" if isinstance(d, TokenLogprobs) else
                            f"{type(d).__name__}{getattr(d, 'index', '')}" for d in deltas).split("E"):
            kinds = [k for k in seg.split("|") if k not in ("", "T")]
            runs += sum(1 for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1])
        assert len(texts(out)) == runs


# ---- RequestStream.batches() -------------------------------------------------------------------------

def test_batches_take_every_queued_event_in_one_wake_up():
    async def go():
        s = RequestStream(7)
        for t in (11, 12, 13):
            s._push(Event(7, [t]))
        it = s.batches()
        first = await it.__anext__()
        assert [e.tokens for e in first] == [[11], [12], [13]]
        loop = asyncio.get_running_loop()

        def later():
            s._push(Event(7, [14]))
            s._push(Event(7, [15], finish_reason="length"))
        loop.call_later(0.05, lambda: threading.Thread(target=later).start())
        rest = []
        async for batch in it:
            rest.append([e.tokens for e in batch])
        assert [t for b in rest for t in b] == [[14], [15]] and rest[-1][-1] == [15]
        s2 = RequestStream(8)                       # `async for` gives the same events one at a time
        for t in (1, 2):
            s2._push(Event(8, [t]))
        s2._push(Event(8, [3], finish_reason="stop"))
        assert [e.tokens async for e in s2] == [[1], [2], [3]]
    asyncio.run(go())


# ---- end to end: an engine whose events carry several tokens --------------------------------------

class RoundsEngine(FakeEngine):
    """FakeEngine whose events carry 1-4 tokens each (a speculation round's), with logprob entries when
    the request asks (token t at position n: logprob -(n + 1) / 8, alternatives t, t+1, ...)."""

    def __init__(self, tokenizer, seed: int):
        super().__init__(tokenizer)
        self.rng = random.Random(seed)
        self.events: list[list[int]] = []

    def submit(self, prompt_ids, params, stop_token_ids=None):
        out = self.outputs.popleft() if self.outputs else self.default
        ids = self.tokenizer.encode(out) + [self.eos]
        stream = RequestStream(next(self._ids))
        self.submitted.append(SimpleNamespace(id=stream.id, prompt_ids=list(prompt_ids), params=params))
        groups, at = [], 0
        while at < len(ids):
            k = self.rng.randrange(1, 5)
            groups.append(ids[at:at + k])
            at += k
        self.events.append([len(g) for g in groups])
        n = 0
        for gi, g in enumerate(groups):
            lps = None
            if params.logprobs is not None:
                lps = [[-(n + j + 1) / 8, [[t + a, -(n + j + 1) / 8 - a] for a in range(params.logprobs)]]
                       for j, t in enumerate(g)]
            n += len(g)
            last = gi == len(groups) - 1
            stream._push(Event(stream.id, g, logprobs=lps, finish_reason="stop" if last else None,
                               usage=dict(prompt_tokens=len(prompt_ids), completion_tokens=len(ids)) if last else None))
        return stream


@pytest.fixture(scope="module")
def rounds():
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    engine = RoundsEngine(tok, random.randrange(1 << 30))
    service = Service(engine, tok, "tiny", 4096, generation_defaults(d), qwen_template())
    with running(create_app(service)) as url:
        yield SimpleNamespace(url=url, tok=tok, engine=engine,
                              openai=openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60),
                              anthropic=anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60))


def _text_of(entries) -> str:
    return bytes(b for e in entries for b in e.bytes).decode()


def test_chat_chunks_are_one_per_round_and_carry_their_tokens_logprobs(rounds):
    rounds.engine.script(TEXT, TEXT)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "go"}], reasoning_effort="none",
              logprobs=True, top_logprobs=2)
    chunks = [c for c in rounds.openai.chat.completions.create(stream=True, **kw)
              if c.choices and c.choices[0].delta.content]
    events = rounds.engine.events[-1]
    whole = rounds.openai.chat.completions.create(**kw).choices[0]
    assert "".join(c.choices[0].delta.content for c in chunks) == whole.message.content == TEXT
    # one chunk per event that made text (the last event's EOS makes none), each with its own tokens
    assert len(chunks) <= len(events) and len(chunks) < sum(events) - 1
    assert any(len(c.choices[0].logprobs.content) > 1 for c in chunks)
    for c in chunks:
        assert _text_of(c.choices[0].logprobs.content) == c.choices[0].delta.content
    streamed = [e.model_dump() for c in chunks for e in c.choices[0].logprobs.content]
    assert streamed == [e.model_dump() for e in whole.logprobs.content]


def test_completions_chunks_carry_their_tokens_logprobs(rounds):
    rounds.engine.script(TEXT, TEXT)
    kw = dict(model="tiny", prompt="go", logprobs=1, max_tokens=200)
    chunks = [c for c in rounds.openai.completions.create(stream=True, **kw) if c.choices and c.choices[0].text]
    whole = rounds.openai.completions.create(**kw).choices[0]
    assert "".join(c.choices[0].text for c in chunks) == whole.text == TEXT
    assert len(chunks) < len(rounds.tok.encode(TEXT))
    for c in chunks:
        assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text


def test_responses_deltas_carry_their_tokens_logprobs(rounds):
    rounds.engine.script(TEXT, TEXT)
    kw = dict(model="tiny", input="go", reasoning={"effort": "none"}, include=["message.output_text.logprobs"],
              top_logprobs=1)
    deltas = [e for e in rounds.openai.responses.create(stream=True, **kw) if e.type == "response.output_text.delta"]
    whole = rounds.openai.responses.create(**kw)
    assert "".join(d.delta for d in deltas) == whole.output_text == TEXT
    assert len(deltas) < len(rounds.tok.encode(TEXT))
    for d in deltas:
        assert "".join(lp.token for lp in d.logprobs) == d.delta


def test_anthropic_text_deltas_are_fewer_than_tokens_and_say_the_same(rounds):
    rounds.engine.script(TEXT, TEXT)
    kw = dict(model="tiny", max_tokens=200, messages=[{"role": "user", "content": "go"}],
              thinking={"type": "disabled"})
    with rounds.anthropic.messages.stream(**kw) as s:
        deltas = [e.delta.text for e in s if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        final = s.get_final_message()
    whole = rounds.anthropic.messages.create(**kw)
    assert "".join(deltas) == final.content[-1].text == whole.content[-1].text
    assert TEXT in whole.content[-1].text and len(deltas) < len(rounds.tok.encode(TEXT))
