"""OpenAI Chat Completions, Completions and Models over HTTP, through the official `openai` SDK.

Two servers per module: one on the real engine (a random tiny checkpoint, tp 1, context 512) for the
plumbing (usage, seeds, stream == non-stream, clamping, context overflow), and one on FakeEngine with
the Qwen-style template for parsing end to end (reasoning, content, tool calls, stop strings), since a
random model's text is noise.
"""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace

import httpx
import openai
import pytest

from runtime import SamplingParams
from runtime.tokenizer import Tokenizer, generation_defaults
from server.app import create_app
from server.metrics import Metrics
from server.service import Service
from tests.server_util import FakeEngine, qwen_template, real_server, running, tiny_model_dir

CONTEXT = 512          # the real engine's
FAKE_CONTEXT = 4096    # the scripted engine's (the Qwen template's tool instructions are long in a tiny vocabulary)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
CALL2 = "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def real():
    with real_server(CONTEXT) as srv:
        yield srv


@pytest.fixture(scope="module")
def fake_server():
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    engine = FakeEngine(tok)
    service = Service(engine, tok, "tiny", FAKE_CONTEXT, generation_defaults(d), qwen_template(),
                      aliases=("tiny-alias",))
    service.metrics = Metrics("tiny", service.stats, lambda: service.in_flight)
    with running(create_app(service)) as url:
        yield SimpleNamespace(url=url, client=_client(url), tok=tok, service=service, engine=engine)


@pytest.fixture
def fake(fake_server):
    e = fake_server.engine
    e.outputs.clear()
    e.submitted.clear()
    e.cancelled.clear()
    return fake_server


def collect(stream) -> dict:
    """Accumulate an SDK chat stream; checks the grammar on the way."""
    out = dict(reasoning="", content="", calls={}, finish=[], usage=None, ids=set(), roles=[], n=0)
    for i, chunk in enumerate(stream):
        out["ids"].add(chunk.id)
        assert chunk.object == "chat.completion.chunk"
        if not chunk.choices:
            assert out["usage"] is None and chunk.usage is not None
            out["usage"] = chunk.usage
            continue
        assert out["usage"] is None, "a choice chunk after the usage chunk"
        ch = chunk.choices[0]
        d = ch.delta
        if i == 0:
            assert d.role == "assistant" and d.content == ""
        else:
            assert not out["finish"], "a delta after the finish chunk"
        if d.role:
            out["roles"].append(d.role)
        r = getattr(d, "reasoning_content", None)
        if r:
            assert not out["content"] and not out["calls"], "reasoning after content"
            assert getattr(d, "reasoning", None) == r
            out["reasoning"] += r
        if d.content:
            out["content"] += d.content
        for tc in d.tool_calls or []:
            if tc.id is not None:
                assert tc.index == len(out["calls"]) and tc.type == "function" and tc.function.arguments == ""
                out["calls"][tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                out["calls"][tc.index]["arguments"] += tc.function.arguments
        if ch.finish_reason:
            assert d.model_dump(exclude_none=True) in ({}, {"content": None}) or not any(
                d.model_dump(exclude_none=True).values())
            out["finish"].append(ch.finish_reason)
        out["n"] += 1
    assert len(out["ids"]) == 1 and next(iter(out["ids"])).startswith("chatcmpl-")
    assert out["roles"] == ["assistant"] and len(out["finish"]) == 1
    return out


def nonstream_view(r) -> dict:
    m = r.choices[0].message
    calls = {i: {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for i, c in enumerate(m.tool_calls or [])}
    return dict(reasoning=getattr(m, "reasoning_content", None) or "", content=m.content or "", calls=calls,
                finish=[r.choices[0].finish_reason])


def both(client, **kw) -> tuple[dict, dict, object, dict]:
    """The same request non-streamed and streamed (with usage); returns (non-stream view, stream view, raw, usage)."""
    r = client.chat.completions.create(model="tiny", **kw)
    s = collect(client.chat.completions.create(model="tiny", stream=True, stream_options={"include_usage": True}, **kw))
    return nonstream_view(r), s, r, s["usage"]


def same(ns: dict, s: dict, ignore_ids: bool = True) -> None:
    assert ns["reasoning"] == s["reasoning"] and ns["content"] == s["content"] and ns["finish"] == s["finish"]
    strip = (lambda c: {k: {**v, "id": None} for k, v in c.items()}) if ignore_ids else (lambda c: c)
    assert strip(ns["calls"]) == strip(s["calls"])


# --------------------------------------------------------------------------------------------------
# Real engine: plumbing


def test_real_models_list_and_retrieve(real):
    models = real.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert real.client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        real.client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"
    raw = httpx.get(real.url + "/v1/models").json()
    assert raw["has_more"] is False and raw["first_id"] == raw["last_id"] == "tiny"
    assert raw["data"][0]["max_model_len"] == CONTEXT and raw["data"][0]["type"] == "model"


def test_real_seeded_chat_stream_equals_nonstream_and_usage_adds_up(real):
    kw = dict(messages=USER, max_tokens=24, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    ns, s, r, usage = both(real.client, **kw)
    same(ns, s)
    rendered = real.tok.render_chat([{"role": "user", "content": USER[0]["content"]}], add_generation_prompt=True)
    assert r.usage.prompt_tokens == usage.prompt_tokens == len(real.tok.encode(rendered))
    assert r.usage.completion_tokens == usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.completion_tokens_details.reasoning_tokens <= r.usage.completion_tokens
    assert r.choices[0].finish_reason == "length" and r.id.startswith("chatcmpl-")
    for text in (ns["reasoning"], ns["content"]):
        assert "<think>" not in text and "</think>" not in text


def test_real_completions_stream_equals_nonstream_and_echo(real):
    prompt = "The quick brown fox"
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    r = real.client.completions.create(**kw)
    chunks = list(real.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text and r.id.startswith("cmpl-")
    assert len({c.id for c in chunks}) == 1 and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert r.usage.prompt_tokens == len(real.tok.encode(prompt)) and r.usage.completion_tokens == 12
    echoed = real.client.completions.create(echo=True, **kw)
    assert echoed.choices[0].text == prompt + r.choices[0].text
    ids = real.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 3


def test_real_max_tokens_is_clamped_to_the_context(real):
    ids = [(7 * i) % 900 + 10 for i in range(CONTEXT - 12)]
    r = real.client.completions.create(model="tiny", prompt=ids, max_tokens=65535, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    r = real.client.chat.completions.create(model="tiny", messages=USER, max_completion_tokens=10**6,
                                            extra_body={"ignore_eos": True}, temperature=0)
    assert r.usage.prompt_tokens + r.usage.completion_tokens == CONTEXT


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_real_prompt_over_the_context_is_context_length_exceeded(real, route):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            real.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 600}])
        else:
            real.client.completions.create(model="tiny", prompt=list(range(10, 10 + CONTEXT)))
    body = e.value.body
    assert body["code"] == "context_length_exceeded" and body["type"] == "invalid_request_error"
    assert body["param"] == ("messages" if route == "chat" else "prompt")
    assert f"maximum context length is {CONTEXT} tokens" in body["message"]
    if route == "completions":
        assert f"your request has {CONTEXT} input tokens" in body["message"]
    assert real.client.completions.create(model="tiny", prompt="ok", max_tokens=1).usage.completion_tokens == 1


def test_real_logit_bias_forces_a_token_and_refuses_ids_outside_the_vocabulary(real, seed):
    """logit_bias on the real engine: greedy with +100 on an id that is not the unbiased first token (nor a
    stop id) generates that id first, and throughout (/v1/completions: the exact text; chat: in the
    message); an id outside the model's vocabulary is the engine's refusal, a 400 naming logit_bias, on
    both routes; the server keeps serving."""
    rng = random.Random(seed)
    V = min(real.engine.spec.vocab_size, real.tok.vocab_size)
    prompt = [rng.randrange(10, 900) for _ in range(rng.randint(3, 40))]
    base = dict(model="tiny", prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    plain = real.client.completions.create(**base).choices[0].text
    words = [t for t in range(V) if t not in real.service.stop_token_ids and len(real.tok.decode([t]).strip()) >= 2
             and real.tok.decode([t]).strip().isalpha() and not plain.startswith(real.tok.decode([t]))]
    target = rng.choice(words)
    r = real.client.completions.create(**base, logit_bias={str(target): 100})
    assert r.choices[0].text == real.tok.decode([target] * 3) != plain
    c = real.client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, temperature=0,
                                            logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    m = c.choices[0].message
    assert c.usage.completion_tokens == 3
    assert real.tok.decode([target]).strip() in (m.content or "") + (getattr(m, "reasoning_content", None) or "")
    for bad in (real.engine.spec.vocab_size, 10**9):
        for route in ("chat", "completions"):
            with pytest.raises(openai.BadRequestError) as e:
                if route == "chat":
                    real.client.chat.completions.create(model="tiny", messages=USER, logit_bias={"5": 1, str(bad): 1})
                else:
                    real.client.completions.create(**base, logit_bias={str(bad): -1})
            body = e.value.body
            assert body["type"] == "invalid_request_error" and body["param"] == "logit_bias", body
            assert str(bad) in body["message"] and "vocabulary" in body["message"], body
    assert real.client.completions.create(**base).choices[0].text == plain


# --------------------------------------------------------------------------------------------------
# Scripted engine: reasoning, content, tool calls


def test_reasoning_then_content_stream_equals_nonstream(fake):
    fake.engine.script(*["Let me think.\nStep two.\n</think>\n\nParis is the capital."] * 2)
    ns, s, r, usage = both(fake.client, messages=USER)
    same(ns, s)
    assert ns["reasoning"] == "Let me think.\nStep two." and ns["content"] == "Paris is the capital."
    m = r.choices[0].message
    assert m.reasoning == m.reasoning_content and m.refusal is None and m.tool_calls is None
    out = fake.engine.submitted[0].output_ids
    think_end = fake.tok.token_to_id("</think>")
    assert r.usage.completion_tokens == usage.completion_tokens == len(out)
    assert r.usage.completion_tokens_details.reasoning_tokens == out.index(think_end) + 1
    assert r.usage.prompt_tokens == len(fake.engine.submitted[0].prompt_ids)
    assert fake.engine.prompt_text().endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("how", ["chat_template_kwargs", "reasoning_effort", "enable_thinking"])
def test_thinking_off_renders_a_closed_think_block_and_yields_content(fake, how):
    extra = {"chat_template_kwargs": {"enable_thinking": False}} if how == "chat_template_kwargs" else \
        {"enable_thinking": False} if how == "enable_thinking" else {}
    kw = dict(reasoning_effort="none") if how == "reasoning_effort" else {}
    fake.engine.script("Paris.")
    r = fake.client.chat.completions.create(model="tiny", messages=USER, extra_body=extra, **kw)
    assert fake.engine.prompt_text().endswith("<think>\n\n</think>\n\n")
    m = r.choices[0].message
    assert m.content == "Paris." and getattr(m, "reasoning_content", None) is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_thinking_on_without_end_is_all_reasoning_and_content_null(fake):
    fake.engine.script("still thinking about it")
    r = fake.client.chat.completions.create(model="tiny", messages=USER, extra_body={"enable_thinking": True},
                                            max_tokens=100)
    m = r.choices[0].message
    assert m.content is None and m.reasoning_content == "still thinking about it"
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens


def test_include_reasoning_false_drops_reasoning(fake):
    fake.engine.script("hmm\n</think>\n\nok", "hmm\n</think>\n\nok")
    ns, s, r, _ = both(fake.client, messages=USER, extra_body={"include_reasoning": False})
    assert ns["reasoning"] == s["reasoning"] == "" and ns["content"] == s["content"] == "ok"


def test_tool_call_auto_stream_equals_nonstream(fake):
    fake.engine.script(*["I should call the tool.\n</think>\n\n" + CALL] * 2)
    ns, s, r, usage = both(fake.client, messages=USER, tools=[WEATHER])
    same(ns, s)
    assert ns["reasoning"] == "I should call the tool." and ns["content"] == ""
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert s["calls"][0]["id"].startswith("call_")
    prompt = fake.engine.prompt_text()
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt


DEEP = "[" * 1100 + "]" * 1100          # deeper than Python's json can decode (its recursion limit)
LIST_TOOL = {"type": "function", "function": {"name": "put", "parameters": {
    "type": "object", "properties": {"items": {"type": "array"}}}}}


def test_a_generated_value_nested_too_deeply_keeps_its_text_not_a_500(fake):
    """A model writing an array parameter (XML form) or a Hermes JSON call nested past what json.loads can
    decode: the value stays the raw string (api.md §6.5: failure -> keep string), the Hermes body stays
    text; before, the parser's RecursionError failed the request with a 500 (an in-band error streamed)."""
    xml = "</think>\n\n<tool_call>\n<function=put>\n<parameter=items>\n" + DEEP + "\n</parameter>\n</function>\n</tool_call>"
    fake.engine.script(xml, xml)
    ns, s, r, _ = both(fake.client, messages=USER, tools=[LIST_TOOL])
    same(ns, s)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "put"
    assert json.loads(call.function.arguments) == {"items": DEEP}
    hermes = '</think>\n\n<tool_call>\n{"name": "put", "arguments": {"items": ' + DEEP + '}}\n</tool_call>'
    fake.engine.script(hermes, hermes)
    ns, s, r, _ = both(fake.client, messages=USER, tools=[LIST_TOOL])
    same(ns, s)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert DEEP in r.choices[0].message.content


def test_tool_call_inside_reasoning_is_still_a_call(fake):
    fake.engine.script("Calling now.\n" + CALL)
    r = fake.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.reasoning_content == "Calling now."


def test_two_calls_get_dense_indices(fake):
    fake.engine.script(*["</think>\n\n" + CALL + "\n" + CALL2] * 2)
    ns, s, r, _ = both(fake.client, messages=USER, tools=[WEATHER, TIME])
    same(ns, s)
    assert [c["name"] for c in s["calls"].values()] == ["get_weather", "get_time"]
    assert json.loads(s["calls"][1]["arguments"]) == {"zone": "CET"}
    assert len({c.id for c in r.choices[0].message.tool_calls}) == 2


def test_parallel_tool_calls_false_stops_after_the_first_call(fake):
    fake.engine.script(*["</think>\n\n" + CALL + "\n" + CALL2] * 2)
    ns, s, r, usage = both(fake.client, messages=USER, tools=[WEATHER, TIME], parallel_tool_calls=False)
    same(ns, s)
    assert [c["name"] for c in s["calls"].values()] == ["get_weather"]
    assert s["finish"] == ["tool_calls"]
    assert [x.id for x in fake.engine.submitted] == fake.engine.cancelled      # the rest was cancelled
    end_call = fake.tok.token_to_id("</tool_call>")     # it stops once </function> is complete
    assert usage.completion_tokens < fake.engine.submitted[1].output_ids.index(end_call)


@pytest.mark.parametrize("end", ["one call", "stop string"])
def test_cached_tokens_are_reported_when_the_server_ends_a_run_early(fake, end):
    """A run the server ends before the engine's last event (parallel_tool_calls false after the first
    call, a stop string) still reports the prompt tokens the engine took from the prefix cache: they
    come with the first event (a regression: such requests reported 0 after a cache hit)."""
    fake.engine.cached_tokens = 16
    try:
        if end == "one call":
            fake.engine.script(*["</think>\n\n" + CALL + "\n" + CALL2] * 2)
            kw = dict(tools=[WEATHER, TIME], parallel_tool_calls=False)
        else:
            fake.engine.script(*["</think>\n\nParis is the capital. Rome is another."] * 2)
            kw = dict(stop=["Rome"])
        ns, s, r, usage = both(fake.client, messages=USER, **kw)
    finally:
        fake.engine.cached_tokens = 0
    assert fake.engine.cancelled == [x.id for x in fake.engine.submitted]      # both ended before the last event
    assert ns["finish"] == (["tool_calls"] if end == "one call" else ["stop"])
    for u in (r.usage, usage):
        assert u.prompt_tokens_details.cached_tokens == 16, u


def test_a_stop_string_inside_a_call_finishes_stop_not_tool_calls(fake):
    """A stop string that matches inside a call's arguments cuts the call off: the finish is "stop"
    (as a max_tokens cut-off keeps "length"), so no client runs a call with truncated arguments; one
    that matches after a complete call leaves "tool_calls"."""
    fake.engine.script(*["</think>\n\n" + CALL] * 2)
    ns, s, r, _ = both(fake.client, messages=USER, tools=[WEATHER], stop=["aris"])
    same(ns, s)
    assert ns["finish"] == ["stop"]
    fake.engine.script(*["</think>\n\n" + CALL + "\nDone."] * 2)
    ns, s, r, _ = both(fake.client, messages=USER, tools=[WEATHER], stop=["Done"])
    same(ns, s)
    assert ns["finish"] == ["tool_calls"] and json.loads(r.choices[0].message.tool_calls[0].function.arguments)


def test_tool_choice_none_keeps_tools_in_the_prompt_and_bans_the_call_token(fake):
    """tool_choice none: the tools stay in the prompt (its cache) and the sampler may not start a call
    (<tool_call>'s id is banned, api.md §6.9); markup that still comes out (a template whose call opening
    is several tokens) stays text, never a call."""
    fake.engine.script("</think>\n\n" + CALL)
    r = fake.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="none")
    assert "<tools>" in fake.engine.prompt_text()
    tool_call = fake.tok.token_to_id("<tool_call>")
    assert tool_call is not None and fake.engine.submitted[-1].params.banned_token_ids == (tool_call,)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert "<function=get_weather>" in r.choices[0].message.content
    fake.engine.script("Sunny.")
    fake.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="auto")
    assert fake.engine.submitted[-1].params.banned_token_ids == ()


def test_tool_choice_required_opens_the_call_when_thinking_is_off(fake):
    fake.engine.script("=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>")
    r = fake.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                            reasoning_effort="none")
    # the opening stops before "=": the tokenizer joins it to the name, as the model writes calls
    assert fake.engine.prompt_text().endswith("</think>\n\n<tool_call>\n<function")
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_forces_that_function(fake):
    body = "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    fake.engine.script(body, body)
    kw = dict(messages=USER, tools=[WEATHER, TIME], reasoning_effort="none",
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ns, s, r, usage = both(fake.client, **kw)
    same(ns, s)
    assert fake.engine.prompt_text().endswith("<tool_call>\n<function=get_weather>\n")
    assert json.loads(s["calls"][0]["arguments"]) == {"city": "Rome"} and s["calls"][0]["name"] == "get_weather"
    assert s["finish"] == ["tool_calls"]
    # the named call is the one call: the output ends once its </function> is complete
    end_call = fake.tok.token_to_id("</tool_call>")
    assert usage.completion_tokens < fake.engine.submitted[1].output_ids.index(end_call)


def test_named_tool_choice_allows_no_second_call(fake):
    """A named tool_choice whose call the prompt opened ends the output after that call: a second call
    (to another declared tool) is neither parsed nor generated."""
    body = "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>\n" + CALL2
    fake.engine.script(body, body)
    kw = dict(messages=USER, tools=[WEATHER, TIME], reasoning_effort="none",
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ns, s, r, _ = both(fake.client, **kw)
    same(ns, s)
    assert [c["name"] for c in s["calls"].values()] == ["get_weather"] and s["finish"] == ["tool_calls"]
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert fake.engine.cancelled[-2:] == [x.id for x in fake.engine.submitted[-2:]]


def test_tool_history_with_json_string_arguments_renders_parameters(fake):
    fake.engine.script("</think>\n\nIt is sunny.")
    messages = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "need weather",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = fake.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    prompt = fake.engine.prompt_text()
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>" in prompt
    assert "<think>\nneed weather\n</think>" in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt
    assert r.choices[0].message.content == "It is sunny."


def test_developer_and_extra_system_messages_merge_into_one_system_turn(fake):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "system", "content": "Answer in French."}, {"role": "assistant", "content": "Bonjour"},
                {"role": "user", "content": [{"type": "text", "text": "Again"}]}]
    fake.client.chat.completions.create(model="tiny", messages=messages)
    prompt = fake.engine.prompt_text()
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi")
    assert prompt.count("<|im_start|>system") == 1 and "<|im_start|>user\nAgain<|im_end|>" in prompt


@pytest.mark.parametrize("stop,want", [(["STOP"], "Hello world."), ("wor", "Hello"), (["xyz", "d. S"], "Hello worl")])
def test_stop_strings_end_the_text_and_cancel_the_request(fake, stop, want):
    fake.engine.script(*["</think>\n\nHello world. STOP here and more"] * 2)
    ns, s, r, usage = both(fake.client, messages=USER, stop=stop)
    same(ns, s)
    assert ns["content"] == want and ns["finish"] == ["stop"]
    assert fake.engine.cancelled == [x.id for x in fake.engine.submitted]
    assert usage.completion_tokens < len(fake.engine.submitted[1].output_ids)


def test_held_back_stop_prefix_is_released_at_the_end(fake):
    fake.engine.script("</think>\n\nends with ST")
    r = fake.client.chat.completions.create(model="tiny", messages=USER, stop=["STOP"])
    assert r.choices[0].message.content == "ends with ST" and fake.engine.cancelled == []


def test_completions_stop_and_finish(fake):
    fake.engine.script("one two three", "one two three")
    r = fake.client.completions.create(model="tiny", prompt="count:", stop=[" three"], max_tokens=50)
    assert r.choices[0].text == "one two" and r.choices[0].finish_reason == "stop"
    r = fake.client.completions.create(model="tiny", prompt="count:", max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_multibyte_text_streams_without_replacement_characters(fake):
    text = "日本語のテキスト 😀🎉 café Größe"
    fake.engine.script(*["</think>\n\n" + text] * 2)
    r = fake.client.chat.completions.create(model="tiny", messages=USER, stream=True)
    deltas = [c.choices[0].delta.content for c in r if c.choices and c.choices[0].delta.content]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text
    assert len(deltas) > 3


def test_length_finish_and_max_tokens_alias(fake):
    fake.engine.script("a b c d e f g h", "a b c d e f g h")
    r = fake.client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, reasoning_effort="none")
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = fake.client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, max_completion_tokens=5,
                                            reasoning_effort="none")
    assert r.usage.completion_tokens == 5 and fake.engine.submitted[-1].params.max_new_tokens == 5


def test_max_tokens_default_is_the_room_left(fake):
    fake.client.chat.completions.create(model="tiny", messages=USER, max_tokens=10**9)
    sub = fake.engine.submitted[-1]
    assert sub.params.max_new_tokens == FAKE_CONTEXT - len(sub.prompt_ids)
    fake.client.chat.completions.create(model="tiny", messages=USER)
    assert fake.engine.submitted[-1].params.max_new_tokens == FAKE_CONTEXT - len(sub.prompt_ids)


def test_sampling_presets_apply_only_to_omitted_fields(fake):
    fake.client.chat.completions.create(model="tiny", messages=USER)
    p = fake.engine.submitted[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.presence_penalty) == (1.0, 0.95, 20, 0.0)
    fake.client.chat.completions.create(model="tiny", messages=USER, reasoning_effort="none", temperature=0.2,
                                        seed=99, frequency_penalty=0.5, extra_body={"top_k": -1, "min_p": 0.1})
    p = fake.engine.submitted[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.presence_penalty, p.seed, p.frequency_penalty, p.min_p) == \
        (0.2, 0.8, 0, 1.5, 99, 0.5, 0.1)
    assert fake.engine.submitted[-1].stop_token_ids == fake.service.stop_token_ids


def test_thinking_budget_reaches_the_sampler_when_supported(fake):
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    fake.client.chat.completions.create(model="tiny", messages=USER, reasoning_effort="low")
    p = fake.engine.submitted[-1].params
    if "thinking_budget" not in fields:
        pytest.skip("SamplingParams has no thinking_budget yet")
    assert p.thinking_budget == 4096 and p.thinking_end_ids == (fake.tok.token_to_id("</think>"),)
    assert fake.tok.decode(p.thinking_close_ids) == "\n</think>\n\n"


def test_model_alias_is_served(fake):
    r = fake.client.chat.completions.create(model="tiny-alias", messages=USER)
    assert r.model == "tiny"
    assert [m.id for m in fake.client.models.list().data] == ["tiny", "tiny-alias"]


@pytest.mark.parametrize("messages,fragment", [
    ([{"role": "system", "content": "only a system prompt"}], "at least one user message"),
    ([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}], "No user query found"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}, {"role": "wizard", "content": "y"}],
     "messages[2].role"),
])
def test_template_refusals_are_400_naming_the_problem(fake, messages, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        fake.client.chat.completions.create(model="tiny", messages=messages)
    body = e.value.body
    assert fragment in body["message"] + body["param"] and body["param"].startswith("messages")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("content,fragment", [
    ([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}], "at least one user message"),
    ("<tool_response>\nx\n</tool_response>", "the chat template refused the messages: No user query found"),
], ids=["tool-results-only", "template"])
def test_prompt_refusals_on_the_anthropic_api_name_the_field(fake, path, content, fragment):
    """The prompt layer's refusals (shared with the OpenAI routes) reach an Anthropic client in that
    API's error shape, the message prefixed with the field as the adapter's own validation errors are."""
    body = {"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(fake.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith("messages: ") and fragment in err["error"]["message"], err


def test_in_band_error_after_the_stream_started(fake):
    from runtime.engine import RequestStream, Event

    def failing_submit(prompt_ids, params, stop_token_ids=None):
        s = RequestStream(999)
        s._push(Event(999, [fake.tok.encode("hi")[0]]))
        s._push(Event(999, [], error="rank 1 (pid 1) exited with signal 9"))
        return s

    original = fake.engine.submit
    fake.engine.submit = failing_submit
    try:
        with httpx.stream("POST", fake.url + "/v1/chat/completions", timeout=30,
                          json={"model": "tiny", "messages": USER, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    finally:
        fake.engine.submit = original
    assert r.status_code == 200
    last = json.loads(lines[-1][6:])
    assert last["error"]["type"] == "server_error" and "rank 1" in last["error"]["message"]
    assert "[DONE]" not in lines[-1]


def test_the_sdk_stream_helper_accumulates_reasoning_content_and_calls(fake):
    fake.engine.script("Think.\n</think>\n\nCalling.\n\n" + CALL + "\n" + CALL2)
    with fake.client.chat.completions.stream(model="tiny", messages=USER, tools=[WEATHER, TIME]) as stream:
        kinds = {type(e).__name__ for e in stream}
        final = stream.get_final_completion()
    m = final.choices[0].message
    assert m.content == "Calling." and final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
    assert "FunctionToolCallArgumentsDoneEvent" in kinds and "ContentDoneEvent" in kinds


def test_a_call_cut_off_by_max_tokens_finishes_with_length(fake):
    """max_tokens ends generation inside a parameter's closing tag: finish_reason length (not tool_calls,
    the arguments may be incomplete), and the tag's beginning is not part of the value."""
    text = "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</"
    n = len(fake.tok.encode(text))
    fake.engine.script(text, text)
    ns, s, r, _ = both(fake.client, messages=USER, tools=[WEATHER], max_tokens=n)
    same(ns, s)
    assert r.choices[0].finish_reason == "length" and s["finish"] == ["length"]
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_a_final_assistant_turn_is_continued_as_transformers_renders_it(fake):
    """Anthropic's prefill (a final assistant message with text) and chat's continue_final_message:
    the prompt is transformers' apply_chat_template(continue_final_message=True) rendering (it ends
    right after the prefill's text, reasoning closed before it), the output is only the continuation,
    in content; a prefill ending in whitespace (Anthropic) or a continue_final_message without a final
    assistant text (chat) is a 400 naming the field."""
    import os

    import httpx
    import transformers
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(tiny_model_dir(), "tokenizer.json"))
    hf.chat_template = qwen_template()
    prefill = 'Here is the JSON: {"city": "'
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris as JSON?"},
            {"role": "assistant", "content": prefill}]
    for thinking in (True, False):
        want = hf.apply_chat_template(msgs, tokenize=False, continue_final_message=True, enable_thinking=thinking)
        assert want.endswith(prefill)
        fake.engine.script('Paris"}')
        r = httpx.post(fake.url + "/v1/messages", json={
            "model": "tiny", "max_tokens": 20, "system": "Be brief.", "messages": msgs[1:],
            "thinking": {"type": "enabled", "budget_tokens": 10} if thinking else {"type": "disabled"}}, timeout=30)
        assert r.status_code == 200, r.text
        assert fake.engine.prompt_text() == want, thinking
        assert [b["type"] for b in r.json()["content"]] == ["text"] and r.json()["content"][0]["text"] == 'Paris"}'
        fake.engine.script('Paris"}')
        c = fake.client.chat.completions.create(model="tiny", messages=msgs, extra_body={
            "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": thinking}})
        assert fake.engine.prompt_text() == want and c.choices[0].message.content == 'Paris"}', thinking
    r = httpx.post(fake.url + "/v1/messages", json={"model": "tiny", "max_tokens": 5, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure "}]}, timeout=30)
    assert r.status_code == 400 and "messages.1.content" in r.text, r.text
    for last in ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}):
        with pytest.raises(openai.BadRequestError) as e:
            fake.client.chat.completions.create(model="tiny", messages=[USER[0], last],
                                                extra_body={"continue_final_message": True})
        assert e.value.body["param"] == "continue_final_message", e.value.body


def test_min_tokens_reaches_the_engine_and_holds_back_stop_strings(fake):
    """min_tokens (chat and completions): reaches SamplingParams (clamped to what the context leaves),
    the text of the first min_tokens tokens is not searched for stop strings, and more than max_tokens
    is a 400 naming it."""
    text = "one STOP two STOP three"
    ids = fake.tok.encode(text)
    first = len(fake.tok.encode("one STOP"))            # the tokens through the first stop string
    fake.engine.script(text, text)
    ns, s, r, _ = both(fake.client, messages=USER, stop=["STOP"], extra_body={"min_tokens": first,
                                                                              "reasoning_effort": "none"})
    same(ns, s)
    assert fake.engine.submitted[-1].params.min_tokens == first
    assert r.choices[0].message.content == "one STOP two" and r.choices[0].finish_reason == "stop"
    fake.engine.script(text)
    c = fake.client.completions.create(model="tiny", prompt="x", max_tokens=len(ids), stop=["STOP"],
                                       extra_body={"min_tokens": first})
    assert c.choices[0].text == "one STOP two " and fake.engine.submitted[-1].params.min_tokens == first
    fake.engine.script(text)
    c = fake.client.completions.create(model="tiny", prompt="x", max_tokens=len(ids), stop=["STOP"])
    assert c.choices[0].text == "one " and fake.engine.submitted[-1].params.min_tokens == 0
    for call in (lambda: fake.client.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                                             extra_body={"min_tokens": 4}),
                 lambda: fake.client.completions.create(model="tiny", prompt="x", extra_body={"min_tokens": 17}),
                 lambda: fake.client.chat.completions.create(model="tiny", messages=USER,
                                                             extra_body={"min_tokens": -1})):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "min_tokens", e.value.body


def test_special_tokens_are_left_out_of_the_text_unless_asked_for(fake):
    """skip_special_tokens (default true, as vLLM): with ignore_eos the model runs past <|im_end|> and
    <|endoftext|>; chat content and completion text leave them out, streamed or not, and keep them
    with skip_special_tokens false. The reasoning and tool-call tags are not special and still parse."""
    text = "</think>\n\nHello<|im_end|> there<|endoftext|>!"
    n = len(fake.tok.encode(text))
    for skip, want in ((None, "Hello there!"), (True, "Hello there!"), (False, "Hello<|im_end|> there<|endoftext|>!")):
        extra = {"ignore_eos": True} | ({} if skip is None else {"skip_special_tokens": skip})
        fake.engine.script(text, text)
        ns, s, r, _ = both(fake.client, messages=USER, max_tokens=n, extra_body=extra)
        same(ns, s)
        assert r.choices[0].message.content == want and not ns["reasoning"], skip
        raw = "a<|im_end|>b"
        fake.engine.script(raw, raw)
        c = fake.client.completions.create(model="tiny", prompt="x", max_tokens=len(fake.tok.encode(raw)), extra_body=extra)
        chunks = fake.client.completions.create(model="tiny", prompt="x", max_tokens=len(fake.tok.encode(raw)),
                                                extra_body=extra, stream=True)
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert c.choices[0].text == streamed == ("a<|im_end|>b" if skip is False else "ab"), skip


def test_max_tokens_inside_a_calls_opening_leaves_no_markup_in_content(fake):
    """max_tokens ends generation before a call's <function=NAME> header is whole: no call was made, so
    finish_reason length, and the opening is not in the content (which never holds <tool_call>),
    streamed or not."""
    for tail in ("<tool_call>\n", "<tool_call>\n<function=get_wea"):
        text = "</think>\n\nLet me check." + "\n\n" + tail
        n = len(fake.tok.encode(text))
        fake.engine.script(text, text)
        ns, s, r, _ = both(fake.client, messages=USER, tools=[WEATHER], max_tokens=n)
        same(ns, s)
        m = r.choices[0].message
        assert m.content == "Let me check." and not m.tool_calls, (tail, m)
        assert r.choices[0].finish_reason == "length" and s["finish"] == ["length"]


def test_tool_choice_required_with_an_undeclared_name_leaves_no_markup(fake):
    """The forced opening (<tool_call>\\n<function) continued with no declared tool's name is dropped,
    not returned as text the model never wrote."""
    fake.engine.script("=20, 36")
    r = fake.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                            reasoning_effort="none")
    assert fake.engine.prompt_text().endswith("<tool_call>\n<function")
    m = r.choices[0].message
    assert m.tool_calls is None and "<tool_call>" not in (m.content or "") and "<function=" not in (m.content or "")
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_required_with_one_tool_forces_its_name(fake):
    fake.engine.script("<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")
    r = fake.client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="required",
                                            reasoning_effort="none")
    assert fake.engine.prompt_text().endswith("<tool_call>\n<function=get_weather>\n")
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("system", ["", "  "])
def test_an_empty_system_message_renders_as_transformers_renders_it(fake, system):
    """transformers' apply_chat_template on the same template and messages is the reference: an empty
    (or blank) system message still opens the prompt with a system turn."""
    from transformers import PreTrainedTokenizerFast
    import os
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    fake.client.chat.completions.create(model="tiny", messages=messages, reasoning_effort="none")
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tiny_model_dir(), "tokenizer.json"),
                                 chat_template=qwen_template())
    want = hf.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert fake.engine.prompt_text() == want



def test_max_tokens_after_a_whole_call_is_tool_calls_in_chat_and_incomplete_in_responses(fake):
    """max_tokens ends the output inside a second call's opening, after a whole first call. Chat finishes
    tool_calls (api.md 1: tool_calls iff a call was parsed; the cut opening stays out of the content);
    the Responses API ends the response incomplete (api.md 5: max_output_tokens hit ->
    response.incomplete), with the whole call's item completed and no item for the cut one."""
    text = "</think>\n\n" + CALL + "\n<tool_call>\n<function=get_ti"
    n = len(fake.tok.encode(text))                     # the engine stops there: "length"
    fake.engine.script(*[text] * 4)
    ns, s, r, _ = both(fake.client, messages=USER, tools=[WEATHER, TIME], max_tokens=n)
    assert ns["finish"] == s["finish"] == ["tool_calls"]
    assert [c["name"] for c in s["calls"].values()] == ["get_weather"] and "<tool_call>" not in ns["content"]
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    resp = fake.client.responses.create(model="tiny", input="What is the weather in Paris?", tools=tools,
                                        max_output_tokens=n)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    calls = [o for o in resp.output if o.type == "function_call"]
    assert [(c.name, c.status) for c in calls] == [("get_weather", "completed")]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    events = list(fake.client.responses.create(model="tiny", input="What is the weather in Paris?", tools=tools,
                                               max_output_tokens=n, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(d.name, d.status) for d in done] == [("get_weather", "completed")]
