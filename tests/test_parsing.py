"""runtime/parsing.py: reasoning / content / tool-call splitting, streamed == non-streamed.

Every case is parsed whole and fed in many splits (one character at a time, random fragment sizes,
special tags as whole fragments); all must give the same ParsedOutput, and the deltas must concatenate
to its fields.
"""

import json
import random
import re

import pytest

from runtime.parsing import (ContentDelta, OutputParser, ParsedOutput, ReasoningDelta, ToolCallArgs, ToolCallEnd,
                             ToolCallStart, parse_text, start_from_prompt)


def fn(name, properties, **extra):
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": {"type": "object", "properties": properties, **extra}}}


S, I = {"type": "string"}, {"type": "integer"}
TOOLS = [
    fn("get_weather", {"city": S, "days": I, "units": {"type": "string", "enum": ["c", "f"]}}),
    fn("write_file", {"path": S, "content": S}),
    fn("ping", {}),
    fn("typed", {
        "s": S, "i": I, "n": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "a": {"type": "array"}, "ns": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "ni": {"type": ["integer", "null"]}, "nn": {"anyOf": [{"type": "null"}, {"type": "number"}]},
        "u": {}, "e": {"enum": [1, 2, 3]}, "r": {"$ref": "#/$defs/point"}, "no": {"type": "object", "nullable": True},
    }, **{"$defs": {"point": {"type": "object", "properties": {"x": I}}}}),
]
SPECIAL = re.compile(r"(<think>|</think>|<tool_call>|</tool_call>)")


def call(name, params, close=True):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}" + ("</function>\n</tool_call>" if close else "")


# ---- the harness ------------------------------------------------------------------------------------

def splits(text, seed):
    """Ways a detokenizer might cut `text`: whole, per character, at special tags (whole, like added
    tokens) with text cut at newlines, and random fragment sizes."""
    rng = random.Random(seed)
    yield [text]
    yield list(text)
    yield [p for part in SPECIAL.split(text) for p in (re.split(r"(?<=\n)", part) if not SPECIAL.fullmatch(part)
                                                        else [part]) if p]
    for top in (2, 5, 13):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, top)
            pieces.append(text[i:i + n])
            i += n
        yield pieces


def feed(pieces, start, tools, parallel=True):
    parser = OutputParser(start, tools, parallel, id_seed="t")
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    return parser, deltas


def check_deltas(deltas, out: ParsedOutput):
    """Deltas concatenate to the final fields, in section order, with one start/end per dense index."""
    order = {ReasoningDelta: 0, ContentDelta: 1, ToolCallStart: 2, ToolCallArgs: 2, ToolCallEnd: 2}
    ranks = [order[type(d)] for d in deltas]
    assert ranks == sorted(ranks), f"{deltas=}"
    assert "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) == (out.reasoning or "")
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == (out.content or "")
    calls = [d for d in deltas if isinstance(d, (ToolCallStart, ToolCallArgs, ToolCallEnd))]
    assert [d.index for d in calls] == sorted(d.index for d in calls)
    assert [(d.index, d.id, d.name) for d in calls if isinstance(d, ToolCallStart)] == \
        [(c.index, c.id, c.name) for c in out.tool_calls]
    for c in out.tool_calls:
        mine = [d for d in calls if d.index == c.index]
        assert isinstance(mine[0], ToolCallStart) and isinstance(mine[-1], ToolCallEnd), f"{mine=}"
        assert all(isinstance(d, ToolCallArgs) for d in mine[1:-1]), f"{mine=}"
        assert "".join(d.fragment for d in mine[1:-1]) == c.arguments
        assert isinstance(json.loads(c.arguments), dict), c.arguments


def check(text, start, tools=TOOLS, seed=0, parallel=True) -> ParsedOutput:
    ref = parse_text(text, start, tools, parallel_tool_calls=parallel, id_seed="t")
    for pieces in splits(text, seed):
        parser, deltas = feed(pieces, start, tools, parallel)
        got = parser.result()
        assert got == ref, f"{pieces=}"
        check_deltas(deltas, got)
        assert parser.stop_requested == (not parallel and bool(ref.tool_calls))
    return ref


# ---- table of generated outputs -----------------------------------------------------------------------

CASES = [
    # id, start, generated text, reasoning, content, calls [(name, args)], note substrings
    ("reasoning_and_content", "reasoning", "\nLet me think: 2 < 3.\n\n</think>\n\nThe answer is 2.\n",
     "Let me think: 2 < 3.", "The answer is 2.", [], []),
    ("reasoning_only_unterminated", "reasoning", "Still thinking about <b>x</b>, <tool and </thi",
     "Still thinking about <b>x</b>, <tool and </thi", None, [], []),
    ("content_only", "content", "\n\nJust text with <angle> & < brackets, <tool_c and </ ", None,
     "Just text with <angle> & < brackets, <tool_c and </", [], []),
    ("empty", "reasoning", "", None, None, [], []),
    ("stray_think_in_reasoning", "reasoning", "<think>\nhmm\n</think>\n\nok", "hmm", "ok", [], []),
    ("stray_think_opens_reasoning", "content", "\n<think>\nhmm\n</think>\n\nok", "hmm", "ok", [], []),
    ("think_tags_in_content_dropped", "reasoning", "r</think>a</think>b<think>c", "r", "abc", [],
     ["stray </think>", "stray <think>"]),
    ("late_think_in_reasoning_is_text", "reasoning", "a <think> b</think>c", "a <think> b", "c", [], []),
    ("one_call", "reasoning", "Need weather.\n</think>\n\nChecking.\n\n"
     + call("get_weather", [("city", "Paris"), ("days", "3")]),
     "Need weather.", "Checking.", [("get_weather", {"city": "Paris", "days": 3})], []),
    ("two_calls_and_trailing_text", "content", call("get_weather", [("city", "Oslo")]) + "\n\n"
     + call("ping", []) + "\n\n", None, None, [("get_weather", {"city": "Oslo"}), ("ping", {})], []),
    ("text_after_call_dropped", "content", "Hi\n\n" + call("ping", []) + "\nBye now", None, "Hi",
     [("ping", {})], ["dropped text after a tool call"]),
    ("call_inside_reasoning", "reasoning", "I will call it.\n\n" + call("get_weather", [("city", "Rome")]),
     "I will call it.", None, [("get_weather", {"city": "Rome"})], []),
    ("call_inside_reasoning_then_think_end", "reasoning", "plan\n" + call("ping", []) + "\n</think>\n\n",
     "plan", None, [("ping", {})], []),
    ("tool_call_word_in_reasoning", "reasoning", "Use <tool_call> tags.\n</think>\n\nok",
     "Use <tool_call> tags.", "ok", [], []),
    ("unknown_function_in_reasoning", "reasoning", "x <tool_call>\n<function=nope>\n</think>\nok", 
     "x <tool_call>\n<function=nope>", "ok", [], ["unknown function 'nope'; kept as reasoning"]),
    ("hermes_json", "content", 'On it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", '
     '"days": 2}}\n</tool_call>', None, "On it.", [("get_weather", {"city": "Lima", "days": 2})], []),
    ("hermes_double_encoded", "content", '<tool_call>{"name": "typed", "arguments": "{\\"o\\": {\\"k\\": [1]}}"}'
     '</tool_call>', None, None, [("typed", {"o": {"k": [1]}})], []),
    ("hermes_unterminated_at_eos", "content", '<tool_call>\n{"name": "ping", "arguments": {}}\n', None, None,
     [("ping", {})], []),
    ("embedded_function_end_in_value", "content",
     call("write_file", [("path", "a.xml"), ("content", "<x></function>\n</parameter2>\n<tool_call>y</tool_call> z\n"
                                               "</function>")]),
     None, None, [("write_file", {"path": "a.xml", "content": "<x></function>\n</parameter2>\n<tool_call>y"
                                                              "</tool_call> z\n</function>"})], []),
    ("missing_parameter_end", "content", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "<parameter=days>\n3\n</function>\n</tool_call>", None, None,
     [("get_weather", {"city": "Paris", "days": 3})], ["missing </parameter>"]),
    ("duplicated_parameter_end", "content", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n</parameter>\n<parameter=days>\n3\n</parameter>\n</parameter>\n</function>\n</tool_call>",
     None, None, [("get_weather", {"city": "Paris", "days": 3})], []),
    ("missing_tool_call_end_at_eos", "content", call("get_weather", [("city", "Bern")], close=False)
     + "</function>\n", None, None, [("get_weather", {"city": "Bern"})], []),
    ("cut_off_inside_value", "content", call("write_file", [("path", "p")], close=False)
     + "<parameter=content>\nline1\nline2\n", None, None, [("write_file", {"path": "p", "content": "line1\nline2"})],
     ["cut off at end of generation"]),
    # the end of generation inside a call's opening: dropped from content (which never holds <tool_call>),
    # kept in reasoning
    ("cut_off_inside_header", "content", "ok <tool_call>\n<function=get_wea", None, "ok", [], ["cut off"]),
    ("cut_off_after_tool_call", "content", "ok\n\n<tool_call>\n", None, "ok", [], ["cut off"]),
    ("cut_off_inside_function_tag", "content", "ok <tool_call>\n<func", None, "ok", [], ["cut off"]),
    ("cut_off_inside_hermes_json", "content", 'ok <tool_call>\n{"name": "get_weather", "argu', None, "ok", [],
     ["cut off"]),
    ("cut_off_header_in_reasoning", "reasoning", "plan <tool_call>\n<function=get_wea",
     "plan <tool_call>\n<function=get_wea", None, [], []),
    ("nested_json_arguments", "content", call("typed", [("o", '{"a": {"b": [1, 2, {"c": null}]}, "d": "x\\"y"}'),
                                                        ("a", '[[1], {"k": [true, false]}]')]),
     None, None, [("typed", {"o": {"a": {"b": [1, 2, {"c": None}]}, "d": 'x"y'}, "a": [[1], {"k": [True, False]}]})],
     []),
    ("typed_coercion", "content", call("typed", [
        ("s", "007"), ("i", " 42 "), ("n", "3.5"), ("b", "TRUE"), ("o", "{'k': True, 'n': None}"),
        ("a", "[1, 'two', None]"), ("ns", "None"), ("ni", "null"), ("nn", "2"), ("u", '{"x": 1}'), ("e", "2"),
        ("r", '{"x": 4}'), ("no", "None")]),
     None, None, [("typed", {"s": "007", "i": 42, "n": 3.5, "b": True, "o": {"k": True, "n": None},
                             "a": [1, "two", None], "ns": None, "ni": None, "nn": 2, "u": '{"x": 1}', "e": 2,
                             "r": {"x": 4}, "no": None})], []),
    ("typed_strings_never_json", "content", call("typed", [("s", "null"), ("ns", "nullx"), ("u", "None")]), None,
     None, [("typed", {"s": "null", "ns": "nullx", "u": "None"})], []),
    ("typed_more_coercion", "content", call("typed", [
        ("i", "7.0"), ("n", "-1e3"), ("b", "false"), ("o", '"{\\"k\\": 1}"'), ("a", "'[1, 2]'")]),
     None, None, [("typed", {"i": 7, "n": -1000.0, "b": False, "o": {"k": 1}, "a": [1, 2]})], []),
    ("typed_failures_keep_string", "content", call("typed", [("i", "many"), ("b", "yes"), ("o", "{oops"),
                                                             ("n", "nan"), ("a", "None")]),
     None, None, [("typed", {"i": "many", "b": "yes", "o": "{oops", "n": "nan", "a": "None"})],
     ["'i' is not a valid integer", "'b' is not a valid boolean", "'o' is not a valid object", "'a' is not"]),
    ("value_newlines_stripped_once", "content", call("write_file", [("path", "\n p \n"), ("content", "")]), None,
     None, [("write_file", {"path": "\n p \n", "content": ""})], []),
    ("duplicate_parameter_ignored", "content", call("get_weather", [("city", "A"), ("city", "B")]), None, None,
     [("get_weather", {"city": "A"})], ["duplicate parameter 'city'"]),
    ("unknown_function_is_text", "content", "Hi " + call("nope", [("a", "1")]), None,
     "Hi " + call("nope", [("a", "1")]), [], ["unknown function 'nope'; kept as content"]),
    ("not_a_call_is_text", "content", "<tool_call>\nnot a call\n</tool_call>", None,
     "<tool_call>\nnot a call\n</tool_call>", [], ["not followed by <function=...>"]),
    ("bad_hermes_json_is_text", "content", "<tool_call>\n{bad json}\n</tool_call>", None,
     "<tool_call>\n{bad json}\n</tool_call>", [], ["JSON body does not parse"]),
    ("bad_call_after_good_dropped", "content", call("ping", []) + "\n" + call("nope", []), None, None,
     [("ping", {})], ["unknown function 'nope'; dropped"]),
    ("junk_between_parameters", "content", "<tool_call>\n<function=get_weather>\nblah <parameter=city>\nX\n"
     "</parameter>\n</function>\n</tool_call>", None, None, [("get_weather", {"city": "X"})], ["ignored text"]),
    ("missing_function_end", "content", "<tool_call>\n<function=ping>\n</tool_call>\n" + call("ping", []), None,
     None, [("ping", {}), ("ping", {})], ["no </function>"]),
    ("unicode", "reasoning",
     "ünï 😀 ✓\n</think>\n\n答案 " + call("write_file", [("path", "ü/😀"), ("content", "é\t\"\\")]),
     "ünï 😀 ✓", "答案", [("write_file", {"path": "ü/😀", "content": "é\t\"\\"})], []),
]


@pytest.mark.parametrize("case_id,start,text,reasoning,content,calls,notes", CASES, ids=[c[0] for c in CASES])
def test_generated_output_splits_the_same_streamed_and_whole(case_id, start, text, reasoning, content, calls, notes,
                                                              seed):
    out = check(text, start, seed=seed)
    assert (out.reasoning, out.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == calls
    assert [c.index for c in out.tool_calls] == list(range(len(calls)))
    for want in notes:
        assert any(want in n for n in out.notes), f"{want=} {out.notes=}"
    if not notes:
        assert not [n for n in out.notes if "kept as" in n or "dropped" in n], out.notes


@pytest.mark.parametrize("second", [call("get_weather", [("city", "B")]),
                                    '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'])
def test_parallel_tool_calls_false_stops_after_first_call(second, seed):
    text = "ok\n" + call("get_weather", [("city", "A")]) + "\n" + second + "\ntrailing"
    out = check(text, "content", seed=seed, parallel=False)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "A"})]
    parser = OutputParser("content", TOOLS, parallel_tool_calls=False)
    parser.feed("ok\n" + call("get_weather", [("city", "A")], close=False))
    assert not parser.stop_requested
    assert isinstance(parser.feed("</function>")[-1], ToolCallEnd) and parser.stop_requested
    assert parser.feed(second) == [] and parser.finish() == []


def test_parse_without_tools_accepts_any_name_as_strings(seed):
    out = check(call("anything", [("n", "1"), ("o", '{"a": 1}')]), "content", tools=None, seed=seed)
    assert json.loads(out.tool_calls[0].arguments) == {"n": "1", "o": '{"a": 1}'}
    assert check(call("anything", []), "content", tools=[], seed=seed).tool_calls == []


# ---- streaming behaviour -------------------------------------------------------------------------------

def test_call_header_streams_before_parameters():
    parser = OutputParser("content", TOOLS, id_seed=1)
    assert parser.feed("Sure.\n\n<tool_call>") == [ContentDelta("Sure.")]
    out = parser.feed("\n<function=write_file>")
    assert [type(d) for d in out] == [ToolCallStart, ToolCallArgs]
    assert out[0].name == "write_file" and out[0].id.startswith("call_") and out[1].fragment == "{"


def test_string_values_stream_as_escaped_chunks():
    parser = OutputParser("content", TOOLS)
    head = parser.feed(call("write_file", [("path", "x")], close=False) + "<parameter=content>\n")
    assert head[-1] == ToolCallArgs(0, '{"path": "x", "content": "')
    got = [[d.fragment for d in parser.feed(line)] for line in ['print("a")\n', "x = 1\n", "</param"]]
    assert got == [['print(\\"a\\")'], ["\\nx = 1"], []]   # a trailing newline and a partial tag wait
    got = [d.fragment for d in parser.feed("eter>\n</function>") if isinstance(d, ToolCallArgs)]
    assert got == ['"}']


def test_non_string_values_are_emitted_when_complete():
    parser = OutputParser("content", TOOLS)
    parser.feed(call("get_weather", [], close=False) + "<parameter=days>\n1")
    assert [d.fragment for d in parser.feed("2\n") if isinstance(d, ToolCallArgs)] == []
    assert [d.fragment for d in parser.feed("</parameter>") if isinstance(d, ToolCallArgs)] == ["12"]


def test_reasoning_holds_back_possible_tool_call():
    parser = OutputParser("reasoning", TOOLS)
    assert parser.feed("think <tool_call>") == [ReasoningDelta("think")]
    assert parser.feed("\n") == []
    assert [type(d) for d in parser.feed("<function=ping>")] == [ToolCallStart, ToolCallArgs]


def test_tool_call_ids_are_deterministic_and_unique():
    text = call("ping", []) + call("ping", [])
    a = parse_text(text, "content", TOOLS, id_seed=7, id_prefix="toolu_")
    b = parse_text(text, "content", TOOLS, id_seed=7, id_prefix="toolu_")
    assert [c.id for c in a.tool_calls] == [c.id for c in b.tool_calls]
    assert len({c.id for c in a.tool_calls}) == 2 and all(c.id.startswith("toolu_") for c in a.tool_calls)
    assert parse_text(text, "content", TOOLS).tool_calls[0].id != parse_text(text, "content", TOOLS).tool_calls[0].id


def test_start_from_prompt():
    assert start_from_prompt("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n") == "reasoning"
    assert start_from_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "content"
    assert start_from_prompt("<|im_start|>assistant\n<think>\nr\n</think>\n\nx<|im_end|>\n<|im_start|>assistant\n") \
        == "content"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="start must be"):
        OutputParser("thinking")
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        OutputParser("content", [{"type": "function"}])
    parser = OutputParser("content")
    parser.finish()
    with pytest.raises(ValueError, match="after finish"):
        parser.feed("x")


def test_values_nested_deeper_than_json_can_decode_stay_text():
    """json.loads raises RecursionError (not ValueError) past its depth: an object / array parameter keeps
    its text (api.md §6.5), a Hermes body nested that deep stays content; neither raises."""
    deep = "[" * 3000 + "]" * 3000
    tools = [fn("put", {"items": {"type": "array"}, "o": {"type": "object"}})]
    for value, key in ((deep, "items"), ('{"a": ' * 3000 + "1" + "}" * 3000, "o")):
        text = f"<tool_call>\n<function=put>\n<parameter={key}>\n{value}\n</parameter>\n</function>\n</tool_call>"
        out = parse_text(text, "content", tools)
        assert [json.loads(c.arguments) for c in out.tool_calls] == [{key: value}]
    hermes = '<tool_call>\n{"name": "put", "arguments": {"items": ' + deep + '}}\n</tool_call>'
    out = parse_text(hermes, "content", tools)
    assert not out.tool_calls and deep in out.content
    out = parse_text('<tool_call>\n{"name": "put", "arguments": ' + json.dumps(deep) + '}\n</tool_call>', "content", tools)
    assert not out.tool_calls                      # a string of arguments that cannot be decoded: not an object


# ---- property: random compositions render and parse back exactly --------------------------------------

GEN_TOOL = fn("gen", {"s": S, "t": S, "ns": {"type": ["string", "null"]}, "i": I, "f": {"type": "number"},
                      "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"}})
GEN_TOOLS = [GEN_TOOL, fn("other", {"x": S})]
TEXT_BITS = ["a", "word", " ", " ", "\n", "\n\n", "\t", "<", "</", "<b>", "</b>", "<tool", "</tool_call",
             "<thi", "think>", "<function", "</function>", "<parameter", "{", "}", '"', "\\", "é", "😀", "null", "&"]
VALUE_BITS = TEXT_BITS + ["<tool_call>", "</function>\n", "</think>", "<think>", "\n</param", "</parameter", "None"]


def rand_text(rng, bits, n):
    return "".join(rng.choice(bits) for _ in range(rng.randint(0, n)))


def rand_json(rng, depth=0):
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice([1, -2, 3.25, True, False, None, "s", 'q"\\é', ""])
    if r < 0.65:
        return [rand_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rand_text(rng, ["k", "é", " ", "<"], 4): rand_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def rand_value(rng, key):
    if key in ("s", "t"):
        return rand_text(rng, VALUE_BITS, 12)
    if key == "ns":
        return None if rng.random() < 0.3 else rand_text(rng, VALUE_BITS, 12)
    return {"i": lambda: rng.randint(-10**6, 10**6), "f": lambda: rng.uniform(-1e4, 1e4),
            "b": lambda: rng.random() < .5, "o": lambda: {"k": rand_json(rng)}, "a": lambda: [rand_json(rng)]}[key]()


def render_value(v):
    """As the chat template: strings raw, objects/arrays JSON, other scalars Python str."""
    return v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def value_ok(v):
    """Values a call cannot carry unambiguously (spec'd terminators inside a string)."""
    return not isinstance(v, str) or not any(t in v for t in ("</parameter>", "</tool_call>", "<parameter="))


def rand_call(rng):
    if rng.random() < 0.15:
        args = {"x": rand_text(rng, VALUE_BITS, 6)}
        return "other", args, "<tool_call>\n" + json.dumps({"name": "other", "arguments": args}) + "\n</tool_call>"
    keys = rng.sample(list(GEN_TOOL["function"]["parameters"]["properties"]), rng.randint(0, 5))
    args = {}
    for k in keys:
        v = rand_value(rng, k)
        while not value_ok(v) or (k == "ns" and v in ("null", "None")):
            v = rand_value(rng, k)
        args[k] = v
    return "gen", args, call("gen", [(k, render_value(v)) for k, v in args.items()])


def rand_section(rng, banned):
    while True:
        text = rand_text(rng, TEXT_BITS, 14)
        if not any(b in text for b in banned) and not text.lstrip().startswith("<think>"):
            return text


def rand_generation(rng):
    """(start, generated text, reasoning, content, calls) as the chat template would render a turn."""
    start = rng.choice(["reasoning", "content"])
    reasoning = rand_section(rng, ("</think>", "<think>", "<tool_call>\n<function", "<tool_call><function",
                                   "<tool_call> <function"))
    content = rand_section(rng, ("<think>", "</think>", "<tool_call>"))
    calls = [rand_call(rng) for _ in range(rng.choice([0, 0, 1, 1, 2, 3]))]
    rendered = "\n".join(c[2] for c in calls)
    mode = rng.random()
    if start == "reasoning" and calls and calls[0][0] == "gen" and mode < 0.3:   # Qwen3.5: XML calls in <think>
        return start, reasoning + "\n\n" + rendered, reasoning, "", calls
    if start == "reasoning" or mode < 0.2:                   # with mode < 0.2, a self-opened <think>
        head = ("" if start == "reasoning" else "<think>\n") + reasoning.strip() + "\n</think>\n\n"
    else:
        head, reasoning = "", ""
    sep = "\n\n" if content.strip() and calls else ""
    return start, head + content.strip() + sep + rendered, reasoning, content, calls


def test_random_compositions_parse_back_exactly(seed):
    rng = random.Random(seed)
    for _ in range(300):
        start, text, reasoning, content, calls = rand_generation(rng)
        out = check(text, start, GEN_TOOLS, seed=rng.randrange(2**31))
        assert out.reasoning == (reasoning.strip() or None), f"{text=}"
        assert out.content == (content.strip() or None), f"{text=}"
        got = [(c.name, json.loads(c.arguments)) for c in out.tool_calls]
        assert got == [(name, args) for name, args, _ in calls], f"{text=}"
        assert [list(a) for _, a in got] == [list(args) for _, args, _ in calls]    # parameter order kept
        assert not [n for n in out.notes if "kept as" in n or "dropped" in n], f"{text=} {out.notes=}"


SOUP = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=gen>", "<function=other>", "<function=nope>",
        "<function=", "</function>", "<parameter=s>", "<parameter=i>", "<parameter=o>", "<parameter=ns>",
        "<parameter=", "</parameter>", "\n", " ", "a", "1", "null", "None", "{", "}", "[1]", "true", "é", "<", "</",
        ">", '"', '{"name": "other", "arguments": {"x": 1}}', '{"name": "gen"}']


def test_any_markup_soup_parses_the_same_in_every_split(seed):
    """Malformed, truncated and nested markup: whatever the parse is, streaming gives the same."""
    rng = random.Random(seed)
    for _ in range(150):
        text = "".join(rng.choice(SOUP) for _ in range(rng.randint(0, 40)))
        start, parallel, tools = rng.choice(["reasoning", "content"]), rng.random() < 0.7, rng.choice([GEN_TOOLS, None])
        check(text, start, tools, seed=rng.randrange(2**31), parallel=parallel)


@pytest.mark.parametrize("tail", ["\n</", "\n</param", "\n<", "\n</function", "\n<parameter=da"])
def test_a_value_cut_off_inside_a_tag_drops_the_tag(tail):
    """The end of generation inside a terminator (or the next parameter's tag) keeps the value without
    the tag's beginning or the newline before it, and marks the call as cut off."""
    p = OutputParser("content", TOOLS)
    out = p.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis" + tail) + p.finish()
    r = p.result()
    assert [json.loads(c.arguments) for c in r.tool_calls] == [{"city": "Paris"}]
    assert "".join(d.fragment for d in out if isinstance(d, ToolCallArgs)) == '{"city": "Paris"}'
    assert p.cut_off and r.content is None
    done = OutputParser("content", TOOLS)
    done.feed(call("get_weather", [("city", "Paris")]))
    done.finish()
    assert not done.cut_off


def test_a_forced_opening_with_an_unknown_name_is_dropped():
    p = OutputParser("content", TOOLS)
    out = p.feed_forced("<tool_call>\n<function=") + p.feed("20, 36 is not a name>\nrest") + p.finish()
    r = p.result()
    assert r.tool_calls == [] and "<tool_call>" not in (r.content or "") and "<function=" not in (r.content or "")
    assert "".join(d.text for d in out if isinstance(d, ContentDelta)) == (r.content or "")
    assert any("forced call opening was dropped" in n for n in r.notes)
    q = OutputParser("content", TOOLS)
    q.feed_forced("<tool_call>\n<function=")
    q.feed("ping>\n</function>\n</tool_call>")
    q.finish()
    assert [c.name for c in q.result().tool_calls] == ["ping"]
    with pytest.raises(ValueError, match="first"):
        q.feed_forced("<tool_call>")



def test_a_call_cut_off_by_the_end_of_generation_ends_marked_cut_off():
    """A call the model closed ends with ToolCallEnd(cut_off=False); one the end of generation closed
    (max_tokens or a stop string inside a parameter, or before </function>) with cut_off=True, which
    the Responses API turns into an incomplete item."""
    whole = OutputParser("content", TOOLS)
    ends = [d for d in whole.feed(call("get_weather", [("city", "A")])) + whole.finish() if isinstance(d, ToolCallEnd)]
    assert [e.cut_off for e in ends] == [False]
    for cut in ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"):
        p = OutputParser("content", TOOLS)
        ends = [d for d in p.feed(cut) + p.finish() if isinstance(d, ToolCallEnd)]
        assert [e.cut_off for e in ends] == [True] and p.cut_off, cut


def test_the_responses_api_marks_a_cut_off_call_incomplete():
    from server.reasoning_seal import ReasoningSeal
    from server.responses_output import ResponseBuilder, ToolSet
    from server.service import Finish, ToolCallArgs as Args, ToolCallEnd as End, ToolCallStart as Start
    for cut_off, status in ((True, "incomplete"), (False, "completed")):
        b = ResponseBuilder("resp_x", {}, ToolSet(), ReasoningSeal(), summary=False, encrypted=False)
        b.start()
        events = b.feed(Start(0, "call_1", "get_weather")) + b.feed(Args(0, '{"city": "Pa"}')) + b.feed(End(0, cut_off))
        done = [e for name, e in events if name == "response.output_item.done"]
        assert [d["item"]["status"] for d in done] == [status]
        b.finish(Finish("length" if cut_off else "tool_calls", {"prompt_tokens": 3, "completion_tokens": 5}, {}))
        assert b.response()["output"][0]["status"] == status
