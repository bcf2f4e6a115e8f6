"""A real two-turn agent exchange with the embedded demo model through each chat API's official SDK.

Turn 1: the user asks for the weather with a get_weather tool offered; the model reasons, then calls
the tool (finish reason tool_calls / tool_use, arguments parsed from its Qwen XML into JSON).
Turn 2: the tool result goes back in each API's own shape; the model answers with the result and
ends its turn (finish reason stop / end_turn / completed). Greedy, so the exchange is deterministic.
"""

import json
import os

import pytest

from ranks.demo import PACKAGED_DIR

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")),
                                reason="no packaged demo model")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

PARAMS = {"type": "object", "required": ["location"],
          "properties": {"location": {"type": "string", "description": "City name, e.g. Paris"},
                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
DESCRIPTION = "Get the current weather for a location."
RESULT = {"location": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny", "humidity": 40,
          "wind_kph": 10}
QUESTION = "What's the weather like in Paris?"


@pytest.fixture(scope="module")
def url():
    from tests.scripted_service import demo_app

    with demo_app() as (base, _):
        yield base


def _answer_uses_the_result(text: str) -> None:
    assert text and "18" in text and "sunny" in text.lower(), text


def test_openai_chat_tool_round_trip(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    tool = {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMS}}
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="demo", messages=messages, tools=[tool], temperature=0, max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["location"] == "Paris"
    messages += [{"role": "assistant", "content": choice.message.content or "",
                  "tool_calls": [c.model_dump() for c in choice.message.tool_calls]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULT)}]
    second = client.chat.completions.create(model="demo", messages=messages, tools=[tool], temperature=0,
                                            max_tokens=200)
    assert second.choices[0].finish_reason == "stop"
    _answer_uses_the_result(second.choices[0].message.content)


def test_anthropic_messages_tool_round_trip(url):
    client = anthropic.Anthropic(base_url=url, api_key="unused")
    tool = {"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMS}
    messages = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(model="demo", max_tokens=200, messages=messages, tools=[tool],
                                   extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input["location"] == "Paris"
    assert any(b.type == "thinking" and "weather" in b.thinking for b in first.content)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": json.dumps(RESULT)}]}]
    second = client.messages.create(model="demo", max_tokens=200, messages=messages, tools=[tool],
                                    extra_body={"temperature": 0})
    assert second.stop_reason == "end_turn"
    _answer_uses_the_result("".join(b.text for b in second.content if b.type == "text"))


def test_anthropic_forced_tool_choice_after_thinking(url):
    """Anthropic tool_choice {"type": "tool"} (named) and "any" (required) with thinking on (Anthropic's
    own API refuses forced tool_choice with thinking; this server does not enforce that rule, api.md):
    the reasoning stays free and the answer is a tool_use of the tool asked for: get_time for a weather
    question that the model, left to itself, answers by calling get_weather (the round trip above)."""
    client = anthropic.Anthropic(base_url=url, api_key="unused")
    tools = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMS},
             {"name": "get_time", "description": "Get the time in a city", "input_schema": PARAMS}]
    for choice, names in (({"type": "tool", "name": "get_time"}, {"get_time"}),
                          ({"type": "any"}, {"get_weather", "get_time"})):
        r = client.messages.create(model="demo", max_tokens=200, tools=tools, tool_choice=choice,
                                   messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0})
        assert r.stop_reason == "tool_use", r.content
        uses = [b for b in r.content if b.type == "tool_use"]
        assert uses and {u.name for u in uses} <= names and all(isinstance(u.input, dict) for u in uses)
        assert any(b.type == "thinking" and b.thinking for b in r.content)


def test_openai_responses_tool_round_trip(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    tool = {"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMS}
    first = client.responses.create(model="demo", input=QUESTION, tools=[tool], temperature=0, max_output_tokens=200)
    assert first.status == "completed"
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["location"] == "Paris"
    second = client.responses.create(model="demo", previous_response_id=first.id, tools=[tool], temperature=0,
                                     max_output_tokens=200,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": json.dumps(RESULT)}])
    assert second.status == "completed"
    _answer_uses_the_result(second.output_text)


TWO_TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for n, d in (("get_weather", "Get the weather for a city"), ("get_time", "Get the time in a city"))]
TWO_QUESTIONS = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_tool_choice_none_keeps_calls_out_of_the_answer(url):
    """tool_choice none with tools the model would call (it does under auto): the call token is banned,
    so the answer is text with no call markup, finish reason stop."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    kw = dict(model="demo", messages=TWO_QUESTIONS, tools=TWO_TOOLS, temperature=0, max_tokens=60, extra_body=NO_THINKING)
    auto = client.chat.completions.create(tool_choice="auto", **kw).choices[0]
    assert auto.finish_reason == "tool_calls"                   # what "none" has to keep out
    none = client.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert none.message.tool_calls is None and none.finish_reason in ("stop", "length")
    assert none.message.content and "<tool_call>" not in none.message.content and "<function=" not in none.message.content


def _declared_calls(choice, names, keys=None) -> None:
    """Every call is one of `names` (with keys among `keys` where given: a strict tool's grammar allows
    no other), its arguments a JSON object, and the turn ends on the calls."""
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.tool_calls and {c.function.name for c in choice.message.tool_calls} <= set(names)
    for c in choice.message.tool_calls:
        args = json.loads(c.function.arguments)
        assert isinstance(args, dict) and (keys is None or set(args) <= keys), c.function.arguments


def test_tool_choice_required_and_named_produce_the_calls_asked_for(url):
    """tool_choice required with two tools and thinking off opens the call in the prompt, and a grammar
    continues it into declared calls only (runtime.grammar.tool_call_grammar). A named choice gives that
    function's one call and no other."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    kw = dict(model="demo", messages=TWO_QUESTIONS, tools=TWO_TOOLS, temperature=0, max_tokens=120, extra_body=NO_THINKING)
    required = client.chat.completions.create(tool_choice="required", **kw).choices[0]
    _declared_calls(required, {"get_weather", "get_time"})
    for name in ("get_time", "get_weather"):
        named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": name}}, **kw)
        _declared_calls(named.choices[0], {name})
        assert len(named.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_tool_choice_is_enforced_after_free_reasoning(url, choice):
    """With thinking on nothing is forced in the prompt: the model reasons freely (a thinking budget
    closes it here), then the call grammar applies after </think>, so the answer is the asked-for
    call(s) (parallel calls allowed: nothing in the prompt opened one), nothing else."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    kw = dict(model="demo", messages=TWO_QUESTIONS, tools=TWO_TOOLS, temperature=0, max_tokens=200,
              extra_body={"thinking_budget": 12})
    r = client.chat.completions.create(tool_choice=choice, **kw).choices[0]
    assert getattr(r.message, "reasoning_content", None) or (r.model_extra or {}).get("reasoning_content")
    if isinstance(choice, dict):            # left alone, the model calls get_weather: the grammar decided
        auto = client.chat.completions.create(tool_choice="auto", **kw).choices[0]
        assert "get_time" not in {c.function.name for c in auto.message.tool_calls or ()}
    _declared_calls(r, {"get_time"} if isinstance(choice, dict) else {"get_weather", "get_time"})


def test_a_strict_tool_gets_only_its_declared_keys(url):
    """strict: true: the call's keys are the schema's (here the keys the demo model writes for weather
    anyway, so the constraint does not fight it; test_structured.py shows it refusing others)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    tool = {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "strict": True,
                                             "parameters": PARAMS}}
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": QUESTION}], tools=[tool],
                                       tool_choice="required", temperature=0, max_tokens=120,
                                       extra_body=NO_THINKING).choices[0]
    _declared_calls(r, {"get_weather"}, set(PARAMS["properties"]))
    assert json.loads(r.message.tool_calls[0].function.arguments).get("location") == "Paris"
