"""Structured outputs through every API, on the embedded demo model (CPU, tp 1), checked independently.

Each API's output format (Chat / Completions response_format and the vLLM extras guided_* and
structured_outputs, Responses text.format, Anthropic output_config.format) must make the content a
document that `jsonschema` accepts (or that re.fullmatch / the list of choices accepts), greedy and
sampled, streamed and not; reasoning stays free (the grammar applies after </think>); with tools the
model may call, the format is not applied (the call still comes); a format that cannot be compiled is
a 400 naming its field. The schemas bound their strings, numbers and arrays so that even this small
model finishes the document well inside max_tokens.
"""

from __future__ import annotations

import json
import os
import re
from typing import Annotated, Literal

import httpx
import pytest

from ranks.demo import PACKAGED_DIR

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")),
                                reason="no packaged demo model")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MAX_TOKENS = 200
USER = [{"role": "user", "content": "Describe one user account as JSON."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
THINK = {"chat_template_kwargs": {"enable_thinking": True}}

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}
ITEMS = {"type": "array", "minItems": 1, "maxItems": 3,
         "items": {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
                   "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                  "tag": {"enum": ["a", "b", "c"]}}}}
STATUS = {"type": "object", "additionalProperties": False, "required": ["status", "value", "place"],
          "properties": {"status": {"const": "ok"},
                         "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
                         "place": {"type": "object", "additionalProperties": False, "required": ["x", "y", "open"],
                                   "properties": {"x": {"type": "integer", "minimum": -90, "maximum": 90},
                                                  "y": {"type": "integer", "minimum": -180, "maximum": 180},
                                                  "open": {"type": "boolean"}}}}}
SCHEMAS = {"person": PERSON, "items": ITEMS, "status": STATUS}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a location.",
    "parameters": {"type": "object", "required": ["location"],
                   "properties": {"location": {"type": "string", "description": "City name, e.g. Paris"}}}}}


@pytest.fixture(scope="module")
def srv():
    from types import SimpleNamespace

    from tests.scripted_service import demo_app

    with demo_app() as (url, service):
        yield SimpleNamespace(url=url, service=service,
                              openai=openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                                   timeout=120),
                              anthropic=anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0,
                                                            timeout=120))


# ---- independent checks ---------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def assert_compact(text: str) -> None:
    """The documented JSON style: outside strings, no whitespace but one space after each ',' and ':'."""
    skeleton = _STRING.sub('""', text)
    assert skeleton == skeleton.strip() and not re.search(r"\s{2,}|[\n\r\t]", skeleton), text
    for m in re.finditer(r"\s", skeleton):
        assert m.start() > 0 and skeleton[m.start() - 1] in ",:", text
    assert not re.search(r"[,:](?! )", skeleton), text


def assert_valid(text: str | None, schema: dict) -> object:
    assert text is not None, "no content"
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert_compact(text)
    return value


def is_json_prefix(text: str) -> bool:
    """Whether some completion of `text` is a JSON document: close an open string (an escape or \\u in
    progress too), finish a partial literal, number or member, close the open brackets."""
    stack, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return False
    closers = "".join(reversed(stack))
    strings = ['"', 'n"', '0"', '00"', '000"', '0000"'] if in_str else [""]
    middles = ["", "0", "e", "ue", "rue", "alse", "lse", "se", "ull", "ll", "l", '""', ": 0", '"": 0', ' "": 0', " 0"]
    for a in strings:
        for b in middles:
            try:
                json.loads(text + a + b + closers)
                return True
            except ValueError:
                pass
    return False


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def chat(srv, **body) -> dict:
    r = post(srv, "/v1/chat/completions", {"model": "demo", "messages": USER, "max_tokens": MAX_TOKENS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(srv, **body) -> tuple[str, str, str | None]:
    """-> (content, reasoning, finish_reason) accumulated from the SSE chunks."""
    content, reasoning, finish = [], [], None
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120,
                      json={"model": "demo", "messages": USER, "max_tokens": MAX_TOKENS, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for ch in chunk["choices"]:
                content.append(ch["delta"].get("content") or "")
                reasoning.append(ch["delta"].get("reasoning_content") or "")
                finish = ch["finish_reason"] or finish
    return "".join(content), "".join(reasoning), finish


def json_schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ---- OpenAI Chat -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_json_schema_greedy_and_sampled(srv, name):
    schema = SCHEMAS[name]
    fmt = json_schema_format(schema, name)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}, {"temperature": 1.0, "seed": 12},
                     {"temperature": 1.0, "seed": 13}):
        body = {"response_format": fmt, **NO_THINK, **sampling}
        r = chat(srv, **body)
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert_valid(choice["message"]["content"], schema)
        assert not choice["message"].get("tool_calls")
        content, _, finish = chat_stream(srv, **body)
        assert finish == "stop"
        assert_valid(content, schema)
        assert content == choice["message"]["content"]        # same seed / greedy: the same document


def test_chat_reasoning_is_free_then_content_follows_the_schema(srv):
    """Thinking on: the grammar applies after </think>, so the reasoning is the model's prose and the
    content the document (a grammar from the first token would have left no </think> and no content)."""
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        r = chat(srv, response_format=json_schema_format(PERSON), **THINK, **sampling)
        m = r["choices"][0]["message"]
        assert m.get("reasoning_content"), m
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
        assert_valid(m["content"], PERSON)
        content, reasoning, finish = chat_stream(srv, response_format=json_schema_format(PERSON), **THINK, **sampling)
        assert (content, reasoning, finish) == (m["content"], m["reasoning_content"], "stop")


def test_chat_thinking_budget_close_then_schema(srv):
    """A thinking budget inserts the close of thinking ("\\n</think>\\n\\n") without sampling: the document
    starts after it, and the blank line is not part of the content."""
    r = chat(srv, response_format=json_schema_format(ITEMS), thinking_budget=3, temperature=0, **THINK)
    m = r["choices"][0]["message"]
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] <= 3 + 4
    assert_valid(m["content"], ITEMS)
    assert m["content"][0] == "["


def test_json_prefix_checker():
    for good in ('{"a": [1, {"b": "x\\', '{"a": tr', '{"a": -1.', '{"a": "\\u00', '[{"a": 1}, ', '{"a', '{'):
        assert is_json_prefix(good), good
    for bad in ('{"a": 1]', '{"a": 1}}', '{"a" 1', '{"a": tx', "{'a'"):
        assert not is_json_prefix(bad), bad


def test_chat_json_object(srv):
    """Any object: greedy, this model closes it at once; sampled it may run to max_tokens, and then the
    text is a prefix of an object (the grammar let nothing else through)."""
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0, "seed": 4},
                     {"temperature": 1.0, "seed": 5}):
        r = chat(srv, response_format={"type": "json_object"}, **NO_THINK, **sampling)
        choice, text = r["choices"][0], r["choices"][0]["message"]["content"]
        if choice["finish_reason"] == "length":
            assert r["usage"]["completion_tokens"] == MAX_TOKENS
            assert text.startswith("{") and is_json_prefix(text), text
        else:
            assert choice["finish_reason"] == "stop"
            assert isinstance(assert_valid(text, {"type": "object"}), dict)


def test_chat_text_format_is_free_text(srv):
    free = chat(srv, temperature=0, **NO_THINK)["choices"][0]["message"]["content"]
    same = chat(srv, temperature=0, response_format={"type": "text"}, **NO_THINK)["choices"][0]["message"]["content"]
    assert same == free


def test_chat_n_choices_each_follow_the_schema(srv):
    r = chat(srv, n=3, temperature=1.0, seed=21, response_format=json_schema_format(STATUS), **NO_THINK)
    assert len(r["choices"]) == 3
    for choice in r["choices"]:
        assert choice["finish_reason"] == "stop"
        assert_valid(choice["message"]["content"], STATUS)


def test_chat_guided_choice_regex_grammar(srv):
    colours = ["red", "green", "blue", "dark purple"]
    for body in ({"guided_choice": colours}, {"structured_outputs": {"choice": colours}}):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 8}):
            r = chat(srv, **body, **NO_THINK, **sampling)
            assert r["choices"][0]["message"]["content"] in colours, r
            assert r["choices"][0]["finish_reason"] == "stop"
    pattern = r"[A-Z][a-z]{2,8}-[0-9]{2,4}( ok)?"
    for body, think in (({"guided_regex": pattern}, NO_THINK), ({"structured_outputs": {"regex": pattern}}, THINK)):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 9}):
            content = chat(srv, **body, **think, **sampling)["choices"][0]["message"]["content"]
            assert re.fullmatch(pattern, content), content
            streamed, _, _ = chat_stream(srv, **body, **think, **sampling)
            assert streamed == content
    lark = 'start: ANSWER " because " REASON\nANSWER: "yes" | "no"\nREASON: /[a-z]{1,10}/\n'
    for body in ({"guided_grammar": lark}, {"structured_outputs": {"grammar": lark}}):
        content = chat(srv, **body, temperature=0, **NO_THINK)["choices"][0]["message"]["content"]
        assert re.fullmatch(r"(yes|no) because [a-z]{1,10}", content), content


def test_chat_guided_json_object_or_string(srv):
    for body in ({"guided_json": STATUS}, {"guided_json": json.dumps(STATUS)}, {"structured_outputs": {"json": STATUS}}):
        r = chat(srv, **body, temperature=0, **NO_THINK)
        assert_valid(r["choices"][0]["message"]["content"], STATUS)


def test_tools_the_model_may_call_leave_the_format_unapplied(srv):
    """tool_choice auto with a tool: the format is not applied (it would forbid the call), so the model
    still calls the tool; tool_choice none: the format applies to the answer."""
    weather = [{"role": "user", "content": "What's the weather like in Paris?"}]
    r = chat(srv, messages=weather, tools=[WEATHER_TOOL], tool_choice="auto", temperature=0,
             response_format=json_schema_format(STATUS))
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["location"] == "Paris"
    r = chat(srv, messages=weather, tools=[WEATHER_TOOL], tool_choice="none", temperature=0,
             response_format=json_schema_format(STATUS))
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
    assert_valid(choice["message"]["content"], STATUS)


def test_constrained_and_free_requests_in_one_batch(srv):
    """Masks are per sequence: run together, free requests give their solo greedy text and constrained
    ones their solo documents."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [dict(temperature=0, max_tokens=40, **NO_THINK),
              dict(temperature=0, response_format=json_schema_format(STATUS), **NO_THINK),
              dict(temperature=0, max_tokens=40, **THINK),
              dict(temperature=0, response_format=json_schema_format(PERSON), **THINK)]
    solo = [chat(srv, **b)["choices"][0]["message"]["content"] for b in bodies]
    with ThreadPoolExecutor(len(bodies) * 2) as pool:
        together = list(pool.map(lambda b: chat(srv, **b)["choices"][0]["message"]["content"], bodies * 2))
    assert together == solo * 2
    assert_valid(solo[1], STATUS)
    assert_valid(solo[3], PERSON)
    with pytest.raises(ValueError):               # the free answer is prose (else this test proves nothing)
        json.loads(solo[0])


def test_sampling_params_carry_the_grammar(srv):
    """Service: the grammar reaches SamplingParams, after </think> when the prompt opens reasoning, not at
    all when the model may call a tool."""
    from server.service import ChatRequest
    from server.structured import output_format

    service = srv.service
    grammar = output_format(json_schema_format(STATUS), "response_format")

    def params(**kw):
        return service.prepare(ChatRequest(messages=USER, model="demo", grammar=grammar, **kw)).params

    assert params(thinking=True).grammar == grammar
    assert params(thinking=True).grammar_after == (service.think_end_id,)
    assert params(thinking=False).grammar == grammar and params(thinking=False).grammar_after == ()
    tools = [WEATHER_TOOL]
    assert params(thinking=False, tools=tools).grammar is None                     # tool_choice omitted: auto
    assert params(thinking=False, tools=tools, tool_choice="none").grammar == grammar
    # a call is required: the output format gives way to the grammar of the call (tool_call_grammar)
    for thinking in (False, True):
        p = params(thinking=thinking, tools=tools, tool_choice="required")
        assert p.grammar is not None and p.grammar != grammar and "<function=" in p.grammar
        assert p.grammar_after == ((service.think_end_id,) if thinking else ())


def test_a_tool_grammar_that_cannot_be_built_leaves_the_request_as_before(srv, monkeypatch):
    """The call grammar is an optional constraint: when it cannot be built (here llguidance refuses it)
    the request runs unconstrained, as before the grammar existed, instead of failing."""
    from runtime import grammar as G
    from server.service import ChatRequest

    def refuse(*a, **k):
        raise ValueError("no such grammar feature")
    monkeypatch.setattr(G, "tool_call_grammar", refuse)
    p = srv.service.prepare(ChatRequest(messages=USER, model="demo", thinking=False, tools=[WEATHER_TOOL],
                                        tool_choice="required"))
    assert p.params.grammar is None and p.forced_prefix


# ---- the official SDKs, other APIs ------------------------------------------------------------------

def test_openai_sdk_chat_json_schema_and_parse(srv):
    from pydantic import BaseModel, Field

    r = srv.openai.chat.completions.create(model="demo", messages=USER, max_tokens=MAX_TOKENS, temperature=0,
                                           response_format=json_schema_format(PERSON), extra_body=NO_THINK)
    assert_valid(r.choices[0].message.content, PERSON)

    class Account(BaseModel):
        name: Annotated[str, Field(max_length=12)]
        age: Annotated[int, Field(ge=0, le=120)]
        role: Literal["admin", "user", "guest"]

    parsed = srv.openai.chat.completions.parse(model="demo", messages=USER, max_tokens=MAX_TOKENS, temperature=0,
                                               response_format=Account, extra_body=NO_THINK)
    account = parsed.choices[0].message.parsed
    assert isinstance(account, Account) and 0 <= account.age <= 120 and len(account.name) <= 12
    stream = srv.openai.chat.completions.create(model="demo", messages=USER, max_tokens=MAX_TOKENS, temperature=1.0,
                                                seed=4, stream=True, response_format=json_schema_format(ITEMS),
                                                extra_body=THINK)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert_valid(text, ITEMS)


def test_completions_response_format_and_guided(srv):
    prompt = "A user account, as JSON:\n"
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 2}):
        r = srv.openai.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, **sampling,
                                          extra_body={"response_format": json_schema_format(PERSON)})
        assert r.choices[0].finish_reason == "stop"
        assert_valid(r.choices[0].text, PERSON)
        streamed = srv.openai.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                                 **sampling, extra_body={"response_format": json_schema_format(PERSON)})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    r = srv.openai.completions.create(model="demo", prompt="Code: ", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", r.choices[0].text), r.choices[0].text


def test_responses_text_format(srv):
    fmt = {"type": "json_schema", "name": "account", "schema": PERSON, "strict": True}
    for think in (None, "none"):
        reasoning = {"effort": think} if think else None
        kw = dict(model="demo", input="Describe one user account as JSON.", max_output_tokens=MAX_TOKENS,
                  temperature=0, text={"format": fmt}, **({"reasoning": reasoning} if reasoning else {}))
        r = srv.openai.responses.create(**kw)
        assert r.status == "completed"
        assert_valid(r.output_text, PERSON)
        deltas, final = [], None
        for ev in srv.openai.responses.create(stream=True, **kw):
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            elif ev.type == "response.completed":
                final = ev.response
        assert "".join(deltas) == final.output_text == r.output_text
    r = srv.openai.responses.create(model="demo", input="Any JSON object.", max_output_tokens=MAX_TOKENS,
                                    temperature=1.0, text={"format": {"type": "json_object"}},
                                    reasoning={"effort": "none"})
    if r.status == "completed":
        assert isinstance(assert_valid(r.output_text, {"type": "object"}), dict)
    else:
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.output_text.startswith("{") and is_json_prefix(r.output_text), r.output_text


def test_anthropic_output_config_format(srv):
    fmt = {"type": "json_schema", "schema": STATUS}
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 64}):
        kw = dict(model="demo", max_tokens=MAX_TOKENS, messages=USER, output_config={"format": fmt},
                  thinking=thinking, extra_body={"temperature": 0 if thinking["type"] == "disabled" else 1.0})
        m = srv.anthropic.messages.create(**kw)
        assert m.stop_reason == "end_turn"
        texts = [b.text for b in m.content if b.type == "text"]
        assert len(texts) == 1
        assert_valid(texts[0], STATUS)
        if thinking["type"] == "enabled":
            assert any(b.type == "thinking" and b.thinking for b in m.content)
        with srv.anthropic.messages.stream(**kw) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == next(b.text for b in final.content if b.type == "text")
        assert_valid(streamed, STATUS)
        if thinking["type"] == "disabled":                      # greedy: the same document
            assert streamed == texts[0]
    r = post(srv, "/v1/messages", {"model": "demo", "max_tokens": MAX_TOKENS, "messages": USER, "temperature": 0,
                                    "thinking": {"type": "disabled"}, "output_format": fmt})
    assert r.status_code == 200, r.text
    assert_valid(next(b["text"] for b in r.json()["content"] if b["type"] == "text"), STATUS)


# ---- errors -----------------------------------------------------------------------------------------

CHAT_ERRORS = [
    ({"response_format": json_schema_format({"type": "objectx"})}, "response_format.json_schema.schema"),
    ({"response_format": json_schema_format({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema"),
    ({"response_format": json_schema_format({"type": "integer", "minimum": 5, "maximum": 2})},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "schema": {"type": "objectx"}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": 5}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_regex": "[a-z"}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"guided_json": {}, "structured_outputs": {"json_object": True}}, "structured_outputs.json_object"),
    # compiled, but past llguidance's limits with the model's tokenizer (its first mask): still a 400
    ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    ({"guided_choice": [f"c{i}" for i in range(2500)]}, "guided_choice"),
    ({"structured_outputs": {"regex": "(b{999}){999}"}}, "structured_outputs.regex"),
]


@pytest.mark.parametrize("extra,param", CHAT_ERRORS, ids=[f"{i}-{p}" for i, (_, p) in enumerate(CHAT_ERRORS)])
def test_bad_formats_are_400_naming_the_field(srv, extra, param):
    for path, body in (("/v1/chat/completions", {"model": "demo", "messages": USER}),
                       ("/v1/completions", {"model": "demo", "prompt": "x"})):
        for stream in (False, True):
            r = post(srv, path, {**body, **extra, "stream": stream})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
            assert param.split(".")[0] in err["message"], err


def test_a_text_format_with_a_guided_field_is_one_constraint(srv):
    r = chat(srv, response_format={"type": "text"}, guided_choice=["yes", "no"], temperature=0, **NO_THINK)
    assert r["choices"][0]["message"]["content"] in ("yes", "no")


def test_responses_and_anthropic_bad_formats(srv):
    base = {"model": "demo", "input": "x"}
    for fmt, param in (({"type": "json_schema", "name": "a", "schema": {"type": "objectx"}}, "text.format.schema"),
                       ({"type": "json_schema", "name": "a", "schema": {"$ref": "#/$defs/nope"}}, "text.format.schema"),
                       ({"type": "xml"}, "text.format.type"), ("json", "text.format")):
        r = post(srv, "/v1/responses", {**base, "text": {"format": fmt}})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        srv.openai.responses.create(model="demo", input="x",
                                    text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "objectx"}}})
    base = {"model": "demo", "max_tokens": 10, "messages": USER}
    good = {"type": "json_schema", "schema": STATUS}
    for extra, param in (({"output_config": {"format": {"type": "json_schema", "schema": {"type": "objectx"}}}},
                          "output_config.format.schema"),
                         ({"output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#/x"}}}},
                          "output_config.format.schema"),
                         ({"output_config": {"format": {"type": "regex"}}}, "output_config.format.type"),
                         ({"output_config": {"format": "json"}}, "output_config.format"),
                         ({"output_format": {"type": "json_schema", "schema": {"type": "objectx"}}},
                          "output_format.schema"),
                         ({"output_config": {"format": good}, "output_format": good}, "output_format")):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = post(srv, path, {**base, **extra})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and param in err["message"], err
    with pytest.raises(anthropic.BadRequestError):
        srv.anthropic.messages.create(model="demo", max_tokens=10, messages=USER,
                                      output_config={"format": {"type": "json_schema", "schema": {"type": "objectx"}}})


# ---- the content parser of a constrained request (no engine) -----------------------------------------

def test_raw_content_keeps_the_grammar_text_verbatim():
    from runtime import parsing
    from server.structured import RawContent

    def run(start: str, pieces: list[str]):
        p = RawContent(start)
        out = []
        for piece in pieces:
            out += p.feed(piece)
        out += p.finish()
        reasoning = "".join(d.text for d in out if isinstance(d, parsing.ReasoningDelta))
        content = "".join(d.text for d in out if isinstance(d, parsing.ContentDelta))
        r = p.result()
        assert (r.reasoning or "", r.content or "") == (reasoning, content) and r.tool_calls == []
        return reasoning, content

    doc = '{"a": "<tool_call> </think> x ", "b": [1, 2]}'
    text = "Let me think.\n</think>\n\n" + doc
    for cut in range(len(text) + 1):                         # every split, "</think>" cut anywhere
        assert run("reasoning", [text[:cut], text[cut:]]) == ("Let me think.", doc)
    assert run("reasoning", list(text)) == ("Let me think.", doc)
    assert run("content", [" spaced ", "<think>x</think> "]) == ("", " spaced <think>x</think> ")
    assert run("reasoning", ["still thinking </thi"]) == ("still thinking </thi", "")


# ---- a grammar's parser is built off the event loop ---------------------------------------------------

class _Gate:
    """Constraint.__init__ held until opened: the build of a request's parser, made as long as wanted."""

    def __init__(self, monkeypatch):
        import threading

        from runtime import grammar as G
        self.entered, self.open = threading.Event(), threading.Event()
        real = G.Constraint.__init__

        def held(c, *a, **k):
            self.entered.set()
            assert self.open.wait(60), "the gate was never opened"
            real(c, *a, **k)
        monkeypatch.setattr(G.Constraint, "__init__", held)


def test_other_requests_are_served_while_a_grammar_is_built(srv, monkeypatch):
    """A constrained request whose parser takes long to build (held here; ~1 s for a pathological
    grammar) does not stall the server: a plain request and /v1/models complete meanwhile, then the
    constrained one completes too."""
    import threading

    gate = _Gate(monkeypatch)
    done: dict = {}
    slow = threading.Thread(target=lambda: done.update(r=post(srv, "/v1/chat/completions", {
        "model": "demo", "messages": USER, "max_tokens": 8, "guided_choice": ["yes", "no"], **NO_THINK})))
    slow.start()
    try:
        assert gate.entered.wait(60), "the constrained request never reached its grammar"
        # with the parser built on the event loop these would wait for the gate (and time out)
        models = httpx.get(srv.url + "/v1/models", timeout=20)
        plain = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "demo", "messages": USER, "max_tokens": 4, **NO_THINK})
        assert not done, "the constrained request ended before its grammar was built"
        assert models.status_code == 200 and plain.status_code == 200, (models.text, plain.text)
    finally:
        gate.open.set()
        slow.join(120)
    assert done["r"].status_code == 200, done["r"].text
    assert done["r"].json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_submission_abandoned_while_its_grammar_builds_is_released(srv, monkeypatch):
    """The coroutine awaiting a grammar's build is cancelled (the client left): once the build ends,
    the submission is cancelled in the engine and the service counts no request in flight."""
    import asyncio

    from runtime import grammar as G
    from server.service import ChatRequest

    gate = _Gate(monkeypatch)
    service = srv.service
    prepared = service.prepare(ChatRequest(messages=USER, max_tokens=8, thinking=False,
                                           grammar=G.json_object_grammar()))
    assert prepared.params.grammar is not None
    before = service.in_flight

    async def abandon():
        task = asyncio.ensure_future(service.submit_async(prepared))
        while not gate.entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(abandon())
    assert not prepared.claimed
    gate.open.set()
    import time
    for _ in range(600):                      # the worker thread finishes the submission, then releases it
        if prepared.claimed:
            break
        time.sleep(0.05)
    assert prepared.claimed and prepared.submitted is not None
    engine, stream = prepared.submitted
    final = [e for e in stream][-1]
    assert final.final and final.finish_reason == "cancelled", final
    assert service.in_flight == before
