"""n > 1 and logprobs over HTTP, through the `openai` SDK, on the real engine (a random tiny checkpoint, tp 1).

n: choice i of a seeded request is the single request with seed + i (so the n choices are independent
draws, each reproducible alone); streamed choices interleave and concatenate to the non-streamed ones;
usage counts the prompt once; a client that leaves a stream cancels every choice.
logprobs (chat: logprobs + top_logprobs; completions: logprobs 0..5): the values themselves are checked
against transformers in tests/test_logprobs.py; here the shapes the SDK parses, one entry per generated
token whose bytes make up the text, the sampled token among its alternatives, stream == non-stream, and
requests that do not ask get null."""

from __future__ import annotations

import math
import time

import httpx
import openai
import pytest

from tests.server_util import real_server

CONTEXT = 512
USER = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def real():
    with real_server(CONTEXT) as srv:
        yield srv


def _check_entry(e, k: int) -> None:
    assert e.logprob <= 1e-9 and math.isfinite(e.logprob)
    assert e.bytes is not None and bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    assert len(e.top_logprobs) == k
    vals = [a.logprob for a in e.top_logprobs]
    assert vals == sorted(vals, reverse=True)
    if k:
        assert e.logprob <= vals[0] + 1e-6                       # nothing beats the best alternative
        # the sampled token, when among the alternatives, carries the same value
        for a in e.top_logprobs:
            if bytes(a.bytes) == bytes(e.bytes):
                assert abs(a.logprob - e.logprob) < 1e-6 or a.token == "\ufffd"


def test_chat_logprobs_greedy_stream_equals_nonstream(real):
    kw = dict(model="tiny", messages=USER, max_tokens=16, temperature=0, logprobs=True, top_logprobs=4,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    r = real.client.chat.completions.create(**kw)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 16
    for e in entries:
        _check_entry(e, 4)
        assert bytes(e.top_logprobs[0].bytes) == bytes(e.bytes)   # greedy: the sampled token is the best
        assert e.top_logprobs[0].logprob == e.logprob
    m = r.choices[0].message
    joined = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")
    if "<" not in joined and "\ufffd" not in joined and not getattr(m, "reasoning_content", None) \
            and not m.tool_calls:
        assert joined == m.content                                # no markup: the tokens are the text
    streamed = []
    for chunk in real.client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                streamed += ch.logprobs.content
    assert [(e.token, e.logprob, [a.logprob for a in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [a.logprob for a in e.top_logprobs]) for e in entries]


def test_chat_logprobs_sampled_with_zero_alternatives(real):
    r = real.client.chat.completions.create(model="tiny", messages=USER, max_tokens=10, temperature=1.0, seed=3,
                                            logprobs=True, extra_body={"ignore_eos": True})
    entries = r.choices[0].logprobs.content
    assert len(entries) == 10
    for e in entries:
        _check_entry(e, 0)


def test_no_logprobs_unless_asked(real):
    r = real.client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs is None
    r = real.client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0, logprobs=False,
                                            top_logprobs=0, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs is None
    c = real.client.completions.create(model="tiny", prompt="abc", max_tokens=4, extra_body={"ignore_eos": True})
    assert c.choices[0].logprobs is None


def test_completions_logprobs_text_offsets_and_stream(real):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0.7, seed=11, logprobs=3,
              extra_body={"ignore_eos": True})
    r = real.client.completions.create(**kw)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert n == 12 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    text = r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for tok, v, top, off in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert v <= 1e-9
        assert 1 <= len(top) <= 3 and all(x <= 1e-9 for x in top.values())
        assert v <= max(top.values()) + 1e-6
        if "\ufffd" not in tok:                      # a whole token's text sits at its offset
            assert text.startswith(tok, off), (tok, off, text)
    if "\ufffd" not in "".join(lp.tokens):
        assert "".join(lp.tokens) == text
    chunks = list(real.client.completions.create(stream=True, **kw))
    got = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for ch in c.choices:
            if ch.logprobs is not None:
                for key in got:
                    got[key] += getattr(ch.logprobs, key)
    assert got == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}


def test_bad_logprobs_requests_are_400_and_the_server_keeps_serving(real):
    bad = [
        ("chat", dict(messages=USER, top_logprobs=2), "top_logprobs"),
        ("chat", dict(messages=USER, logprobs=True, top_logprobs=21), "top_logprobs"),
        ("completions", dict(prompt="x", logprobs=9), "logprobs"),
    ]
    for route, body, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            if route == "chat":
                real.client.chat.completions.create(model="tiny", max_tokens=2, **body)
            else:
                real.client.completions.create(model="tiny", max_tokens=2, **body)
        assert e.value.body["param"] == param, e.value.body
    r = real.client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, logprobs=True, top_logprobs=1,
                                            extra_body={"ignore_eos": True})
    assert len(r.choices[0].logprobs.content) == 3


def test_completions_echo_with_logprobs_scores_the_prompt(real):
    """echo + logprobs (how scoring clients read a prompt's log-likelihood): the prompt's tokens first, the
    first with null logprob and alternatives, each other's value the engine's prompt entry; then the
    generated tokens; the stream carries the same lists, the prompt's in the echo chunk."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = real.tok.encode(prompt)
    kw = dict(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
              extra_body={"ignore_eos": True})
    r = real.client.completions.create(**kw)
    lp = r.choices[0].logprobs
    n = len(ids) + 3
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 1e-9 for v in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 2 and max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert [real.tok.token_bytes(i).decode("utf-8", errors="replace") for i in ids] == lp.tokens[:len(ids)]
    assert r.choices[0].text.startswith(prompt)
    assert lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    # the engine's own entries for the prompt, in the engine's order
    from runtime import SamplingParams
    e = real.engine.submit(ids, SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True,
                                               prompt_logprobs=2)).result(timeout=60)
    assert [x[0] for x in e.prompt_logprobs] == lp.token_logprobs[1:len(ids)]
    got = {"tokens": [], "token_logprobs": [], "text_offset": []}
    text = ""
    for c in real.client.completions.create(stream=True, **kw):
        for ch in c.choices:
            text += ch.text
            if ch.logprobs is not None:
                for key in got:
                    got[key] += getattr(ch.logprobs, key)
    assert text == r.choices[0].text
    assert got == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}


# --------------------------------------------------------------------------------------------------
# n > 1


def _chat_stream(client, **kw) -> dict:
    """Per choice index: content, finish reasons, logprob entries; and the one usage chunk."""
    out = {"content": {}, "finish": {}, "logprobs": {}, "usage": None, "first": {}}
    for k, c in enumerate(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)):
        if not c.choices:
            assert out["usage"] is None
            out["usage"] = c.usage
            continue
        for ch in c.choices:
            i = ch.index
            assert i not in out["finish"], "a chunk after the choice's finish chunk"
            if i not in out["first"]:
                out["first"][i] = ch.delta.role
            out["content"][i] = out["content"].get(i, "") + (ch.delta.content or "")
            if ch.logprobs is not None and ch.logprobs.content:
                out["logprobs"].setdefault(i, []).extend(ch.logprobs.content)
            if ch.finish_reason:
                out["finish"][i] = ch.finish_reason
    return out


def test_chat_n_choices_are_the_seeded_single_requests(real):
    kw = dict(model="tiny", messages=USER, max_tokens=10, temperature=1.0,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    r = real.client.chat.completions.create(n=3, seed=41, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    for i, text in enumerate(texts):
        alone = real.client.chat.completions.create(seed=41 + i, **kw)
        assert alone.choices[0].message.content == text, f"choice {i} is not the request with seed {41 + i}"
        assert r.choices[i].finish_reason == "length"
    assert len(set(texts)) > 1, "three seeded draws of a random model came out the same"
    assert r.usage.completion_tokens == 30
    assert r.usage.total_tokens == r.usage.prompt_tokens + 30
    s = _chat_stream(real.client, n=3, seed=41, **kw)
    assert [s["content"][i] for i in range(3)] == texts
    assert s["finish"] == {0: "length", 1: "length", 2: "length"} and set(s["first"].values()) == {"assistant"}
    assert s["usage"].completion_tokens == 30 and s["usage"].prompt_tokens == r.usage.prompt_tokens


def test_chat_n_greedy_choices_agree_and_carry_their_logprobs(real):
    kw = dict(model="tiny", messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    r = real.client.chat.completions.create(n=2, **kw)
    a, b = r.choices
    assert a.message.content == b.message.content
    assert [e.logprob for e in a.logprobs.content] == [e.logprob for e in b.logprobs.content]
    assert len(a.logprobs.content) == 6
    s = _chat_stream(real.client, n=2, **kw)
    assert [e.logprob for e in s["logprobs"][1]] == [e.logprob for e in b.logprobs.content]


def test_completions_n_and_best_of_equal_to_n(real):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0.9, seed=5,
              extra_body={"ignore_eos": True})
    r = real.client.completions.create(n=2, best_of=2, **kw)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 16
    for i in range(2):
        alone = real.client.completions.create(**{**kw, "seed": 5 + i})
        assert alone.choices[0].text == r.choices[i].text
    text = {0: "", 1: ""}
    for c in real.client.completions.create(n=2, stream=True, **kw):
        for ch in c.choices:
            text[ch.index] += ch.text
    assert [text[0], text[1]] == [c.text for c in r.choices]


def test_leaving_an_n_stream_cancels_every_choice(real):
    body = {"model": "tiny", "messages": USER, "max_tokens": 400, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=real.url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data:")
                if seen >= 8:
                    break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = real.engine.stats()
        if st["running"] == 0 and st["waiting"] == 0:
            break
        time.sleep(0.05)
    st = real.engine.stats()
    assert (st["running"], st["waiting"], st["slots_used"]) == (0, 0, 0), st


def test_completions_batch_of_prompts_is_each_prompt_alone(real):
    """prompt: a list (strings or token lists): prompt k's n choices are indices k n .. k n + n - 1, each
    the seeded single request of its prompt; streamed the same; usage counts every prompt once."""
    prompts = ["Once upon a time", "The capital of"]
    kw = dict(model="tiny", max_tokens=6, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    r = real.client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prompt_tokens = completion_tokens = 0
    for k, p in enumerate(prompts):
        for j in range(2):
            alone = real.client.completions.create(prompt=p, **{**kw, "seed": 11 + j})
            assert r.choices[2 * k + j].text == alone.choices[0].text, (k, j)
        prompt_tokens += alone.usage.prompt_tokens
        completion_tokens += 2 * alone.usage.completion_tokens
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert r.usage.total_tokens == prompt_tokens + completion_tokens
    text = {i: "" for i in range(4)}
    usage = None
    for c in real.client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                            **kw):
        for ch in c.choices:
            text[ch.index] += ch.text
        usage = c.usage or usage
    assert [text[i] for i in range(4)] == [c.text for c in r.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion_tokens)
    # token-id prompts, echoed: each choice starts with its own prompt
    ids = [real.tok.encode(p) for p in prompts]
    e = real.client.completions.create(prompt=ids, echo=True, **kw)
    for k, p in enumerate(prompts):
        assert e.choices[k].text.startswith(real.tok.decode(ids[k]))


def test_bad_batches_of_prompts_are_400_and_name_the_field(real):
    with httpx.Client(base_url=real.url, timeout=60) as http:
        for prompt, field in (([], "prompt"), ([[1, 2], []], "prompt[1]"), ([[1, "x"]], "prompt[0][1]"),
                              (["a", 3], "prompt[1]"), ([3, "a"], "prompt[1]"), (["a"] * 65, "prompt")):
            resp = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                      "n": 2 if len(prompt) == 65 else 1})
            assert resp.status_code == 400, (prompt[:3], resp.text)
            assert resp.json()["error"]["param"] == field, (prompt[:3], resp.json())
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_completions_text_offsets_count_characters_across_split_utf8():
    """Tokens that carry pieces of one multi-byte character (each shown as U+FFFD) all start at that
    character; the tokens after it at the characters the text really has (offsets advanced by the
    placeholder strings drifted by one per extra piece)."""
    from server.completions import TextOffsets, logprobs_object
    pieces = [b"a", b"\xf0\x9f", b"\x98\x80", b"b", "é".encode()[:1], "é".encode()[1:], b"cd"]
    entries = [{"token": p.decode("utf-8", errors="replace"), "logprob": -0.5, "bytes": list(p),
                "top_logprobs": []} for p in pieces]
    text = b"".join(pieces).decode()
    assert text == "a\U0001F600b\u00e9cd"
    out = logprobs_object(entries, TextOffsets())
    assert out["text_offset"] == [0, 1, 1, 2, 3, 3, 4]
    assert text[4:] == "cd"
    orphan = [b"x", b"\xf0", b"yz", b"\xe2\x82", b"\xac"]   # a lead byte nothing completes, then a euro sign
    got = logprobs_object([dict(e, bytes=list(p)) for e, p in zip(entries, orphan)], TextOffsets())
    assert b"".join(orphan).decode(errors="replace") == "x\ufffdyz\u20ac"
    assert got["text_offset"] == [0, 1, 2, 4, 4]
    stream = TextOffsets(10)                          # continued across chunks, from an echo's length
    first, second = logprobs_object(entries[:2], stream), logprobs_object(entries[2:], stream)
    assert first["text_offset"] + second["text_offset"] == [10, 11, 11, 12, 13, 13, 14]
