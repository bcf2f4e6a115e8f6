"""Generated text -> reasoning, content and tool calls: one incremental state machine (api.md §6).

Feed it the fragments of an incremental detokenizer; it returns deltas (reasoning text, content text,
tool-call start / argument fragments / end) and, at the end, a ParsedOutput. Streaming and non-streaming
run the same code, so the result never depends on how the text was split:
  - a decision at buffer position p is taken only when every continuation of the text would take it;
    otherwise the parser waits (holds back the suffix that could still start a tag);
  - concatenated deltas equal the final fields: reasoning / content (trimmed like the chat template
    does), and each call's arguments string, a JSON object built as `{` + `"k": value, ...` + `}`.

Section order is fixed: reasoning, then content, then tool calls; after the first call, any text that is
not another call is dropped. Markup that cannot be a call (unknown function, bad header, bad JSON) stays
text; the reason goes to ParsedOutput.notes (for the request log). The caller stops feeding at the stop
token and never feeds its text (<|im_end|>).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal, Union

Start = Literal["reasoning", "content"]

THINK, END_THINK = "<think>", "</think>"
CALL, END_CALL = "<tool_call>", "</tool_call>"
FUNC, END_FUNC = "<function=", "</function>"
PARAM, END_PARAM = "<parameter=", "</parameter>"
MAX_NAME = 256          # longest function / parameter name accepted in a header
NULL_WORDS = ("null", "None")   # the template renders None as Python str()
MAX_LITERAL = 200_000   # longest value tried as a Python literal (ast.literal_eval) when JSON fails

WAIT = ("wait",)        # undecidable until more text arrives
LITERAL = ("literal", None)


# ---- public types -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgs:
    """A piece of call `index`'s arguments; the pieces of one index concatenate to ToolCall.arguments."""
    index: int
    fragment: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    cut_off: bool = False   # closed at the end of generation (max_tokens, a stop string), not by the model


Delta = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallArgs, ToolCallEnd]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str      # a JSON object, as text
    index: int


@dataclass(slots=True)
class ParsedOutput:
    reasoning: str | None       # None when empty
    content: str | None         # None when empty
    tool_calls: list[ToolCall] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # why something was repaired, kept as text or dropped


def start_from_prompt(prompt: str) -> Start:
    """The start state for a rendered prompt: inside an open <think> of the last assistant turn -> reasoning."""
    tail = prompt[max(prompt.rfind("<|im_start|>assistant"), 0):]
    return "reasoning" if tail.rfind(THINK) > tail.rfind(END_THINK) else "content"


def parse_text(text: str, start: Start, tools: list[dict] | None = None, *, parallel_tool_calls: bool = True,
               id_seed: str | int | None = None, id_prefix: str = "call_") -> ParsedOutput:
    """Non-streaming parse: feed(text) + finish() + result()."""
    parser = OutputParser(start, tools, parallel_tool_calls, id_seed=id_seed, id_prefix=id_prefix)
    parser.feed(text)
    parser.finish()
    return parser.result()


# ---- the state machine ----------------------------------------------------------------------------

@dataclass(slots=True)
class _Call:
    index: int
    id: str
    name: str
    schema: dict                       # the tool's parameters schema ({} when unknown)
    args: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Param:
    name: str
    kind: str                          # string | integer | number | boolean | object | array | null
    nullable: bool
    skip: bool                         # a duplicate: parsed, not emitted
    parts: list[str] = field(default_factory=list)
    fresh: bool = True                 # the newline after <parameter=K> is not yet stripped
    opened: bool = False               # a string value's opening quote was emitted


class OutputParser:
    """Incremental parser of one generation. States: reasoning, content, call (inside <function=...>,
    between parameters), value (inside a parameter), after (a call was made), stopped.

    start: "reasoning" when the prompt ends inside <think> (see start_from_prompt), else "content".
    tools: OpenAI-shaped tools ({"type": "function", "function": {name, parameters}}; flat Responses and
      Anthropic input_schema shapes are accepted too). None accepts any function name with untyped
      (string) parameters; a list accepts only its names.
    parallel_tool_calls: False stops at the end of the first call; stop_requested then turns True and
      all later text is ignored.
    id_seed, id_prefix: call ids are id_prefix + 24 hex digits of sha256(f"{id_seed}:{index}");
      a random seed when None.
    """

    def __init__(self, start: Start, tools: list[dict] | None = None, parallel_tool_calls: bool = True, *,
                 id_seed: str | int | None = None, id_prefix: str = "call_"):
        if start not in ("reasoning", "content"):
            raise ValueError(f"start must be 'reasoning' or 'content', got {start!r}")
        self._tools = None if tools is None else _index_tools(tools)
        self._parallel = bool(parallel_tool_calls)
        self._id_seed = secrets.token_hex(8) if id_seed is None else id_seed
        self._id_prefix = id_prefix
        self.stop_requested = False
        self._state: str = start
        self._buf = ""
        self._at_start = True            # nothing but whitespace and dropped <think> seen so far
        self._started = False            # the current text section has non-whitespace text
        self._pending_ws = ""            # trailing whitespace of the section, emitted only if text follows
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[_Call] = []
        self._param: _Param | None = None
        self._notes: list[str] = []
        self._out: list[Delta] = []
        self._finished = False
        self._forced = 0                 # length of a forced call opening still at the start of _buf
        self.cut_off = False             # a call was cut off by the end of generation

    # ---- public verbs ----

    def feed(self, text: str) -> list[Delta]:
        """Consume one fragment; returns the deltas it completes (text that may start a tag is held back)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        if self._finished:
            raise ValueError("feed() called after finish()")
        if self._state != "stopped":
            self._buf += text
            self._run(final=False)
        return self._take()

    def feed_forced(self, text: str) -> list[Delta]:
        """Feed a call opening the server put in the prompt (tool_choice required / named): if what the
        model continues it with is not a call to a declared tool, the opening is dropped, not kept as
        text (the model never wrote it)."""
        if self._buf or self._state != "content":
            raise ValueError("feed_forced() must come first, in content")
        self._forced = len(text)
        return self.feed(text)

    def finish(self) -> list[Delta]:
        """End of generation: flush held-back text, close an unterminated call. Idempotent."""
        if not self._finished:
            self._run(final=True)
            self._finished = True
        return self._take()

    def result(self) -> ParsedOutput:
        """The parse so far (complete after finish())."""
        calls = [ToolCall(c.id, c.name, "".join(c.args), c.index) for c in self._calls]
        return ParsedOutput("".join(self._reasoning) or None, "".join(self._content) or None, calls, list(self._notes))

    # ---- driver ----

    def _run(self, final: bool) -> None:
        handlers = {"reasoning": self._on_text, "content": self._on_text, "call": self._on_call,
                    "value": self._on_value, "after": self._on_after, "stopped": self._on_stopped}
        while handlers[self._state](final):
            pass

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _emit(self, delta: Delta) -> None:
        """Append, merging with the previous delta of the same kind (and index)."""
        last = self._out[-1] if self._out else None
        if type(last) is type(delta) is ToolCallArgs and last.index == delta.index:
            self._out[-1] = ToolCallArgs(delta.index, last.fragment + delta.fragment)
        elif type(last) is type(delta) and type(delta) in (ReasoningDelta, ContentDelta):
            self._out[-1] = type(delta)(last.text + delta.text)
        else:
            self._out.append(delta)

    def _note(self, note: str) -> None:
        if note not in self._notes:
            self._notes.append(note)

    # ---- reasoning / content ----

    def _on_text(self, final: bool) -> bool:
        buf, i = self._buf, 0
        while True:
            p = buf.find("<", i)
            if p < 0:
                self._text(buf)
                self._buf = ""
                return False
            act = self._text_tag(p, final)
            if act[0] == "literal" and self._forced and p == 0:
                self._note(f"{act[1] or 'not a call'}: the forced call opening was dropped")
                buf = self._buf = buf[self._forced:]
                self._forced = 0
                continue
            if act is not WAIT:
                self._forced = 0
            if act[0] == "literal":
                if act[1]:
                    self._note(f"{act[1]}; kept as {self._state}")
                i = p + 1
                continue
            self._text(buf[:p])
            if act is WAIT:
                self._buf = buf[p:]
                return False
            self._act(act)
            return True

    def _text_tag(self, p: int, final: bool) -> tuple:
        """What the '<' at p starts in a text state: WAIT, ('literal', note) or an action for _act."""
        s, reasoning = self._buf[p:], self._state == "reasoning"
        if s.startswith(END_THINK):
            if reasoning:
                return ("end_think", p + len(END_THINK))
            return ("drop", p + len(END_THINK), "dropped a stray </think> in content")
        if s.startswith(THINK):
            if self._at_start and not self._buf[:p].strip():   # a stray generated <think>: drop it;
                # before content it opens reasoning
                return ("open_think", p + len(THINK))
            return LITERAL if reasoning else ("drop", p + len(THINK), "dropped a stray <think> in content")
        if s.startswith(CALL):
            return self._call_open(p, final, in_reasoning=reasoning)
        if not final and any(t.startswith(s) for t in (END_THINK, THINK, CALL)):
            return WAIT
        return LITERAL

    def _act(self, act: tuple) -> None:
        """Carry out a tag action (its end is a position in the buffer)."""
        kind, end = act[0], act[1]
        self._buf = self._buf[end:]
        if kind == "end_think":
            self._end_section("content")
            self._at_start = False
        elif kind == "open_think":
            self._state = "reasoning"
        elif kind == "drop":
            self._note(act[2])
        elif kind == "call":
            self._begin_call(act[2])
        elif kind == "hermes":
            self._begin_call(act[2])
            self._emit_args(json.dumps(act[3], ensure_ascii=False)[1:-1])
            self._end_call()
        else:
            raise AssertionError(f"{act=}")

    def _text(self, text: str) -> None:
        """Add text to the current section, trimmed: leading whitespace dropped, trailing held back."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return
            self._started, self._at_start = True, False
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        out, self._pending_ws = self._pending_ws + body, text[len(body):]
        if self._state == "reasoning":
            self._reasoning.append(out)
            self._emit(ReasoningDelta(out))
        else:
            self._content.append(out)
            self._emit(ContentDelta(out))

    def _end_section(self, state: str) -> None:
        self._state, self._started, self._pending_ws = state, False, ""

    def _call_open(self, p: int, final: bool, in_reasoning: bool) -> tuple:
        """Decide what the <tool_call> at p opens: ('call', end, name), ('hermes', end, name, args),
        WAIT or ('literal', note). In reasoning only the XML form counts (an implicit </think>)."""
        buf, k = self._buf, p + len(CALL)
        while k < len(buf) and buf[k].isspace():
            k += 1
        rest = buf[k:]
        # the end of generation inside a call's opening: in content the opening is dropped (content
        # never holds <tool_call>, and no call was made); reasoning keeps it as text
        cut = LITERAL if in_reasoning else ("drop", len(buf),
                                            "a tool call's opening cut off at end of generation: dropped")
        if not rest:
            return WAIT if not final else cut
        if rest.startswith(FUNC):
            j = k + len(FUNC)
            gt = buf.find(">", j)
            name = buf[j:] if gt < 0 else buf[j:gt]
            if not _name_ok(name) or (gt >= 0 and not name):
                return ("literal", "malformed <function=...> header")
            if gt < 0:
                return WAIT if not final else cut
            if self._tools is not None and name not in self._tools:
                return ("literal", f"tool call to unknown function {name!r}")
            return ("call", gt + 1, name)
        if FUNC.startswith(rest):
            return WAIT if not final else cut
        if in_reasoning:
            return LITERAL
        if rest[0] == "{":
            q = buf.find(END_CALL, k)
            if q < 0 and not final:
                return WAIT
            body, end = (buf[k:], len(buf)) if q < 0 else (buf[k:q], q + len(END_CALL))
            if q < 0 and not _parses(body):
                return cut                                # a JSON body the end of generation cut short
            name, args, why = self._hermes(body)
            return ("literal", why) if why else ("hermes", end, name, args)
        return ("literal", "<tool_call> not followed by <function=...> or a JSON object")

    def _hermes(self, body: str) -> tuple[str, dict, str | None]:
        """A Hermes JSON call body {"name": ..., "arguments": {...}} -> (name, args, None) or (.., why)."""
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):       # RecursionError: nested deeper than json can decode
            return "", {}, "<tool_call> JSON body does not parse"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return "", {}, "<tool_call> JSON body has no \"name\""
        name, args = obj["name"], obj.get("arguments", obj.get("parameters"))
        args = {} if args is None else args
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass
        if not isinstance(args, dict) or not _json_ok(args):
            return "", {}, f"<tool_call> JSON for {name!r} has arguments that are not a JSON object"
        if self._tools is not None and name not in self._tools:
            return "", {}, f"tool call to unknown function {name!r}"
        return name, args, None

    # ---- inside a call ----

    def _begin_call(self, name: str) -> None:
        self._end_section("call")
        index = len(self._calls)
        digest = hashlib.sha256(f"{self._id_seed}:{index}".encode()).hexdigest()[:24]
        call = _Call(index, self._id_prefix + digest, name, (self._tools or {}).get(name, {}))
        self._calls.append(call)
        self._emit(ToolCallStart(index, call.id, name))
        self._emit_args("{")

    def _emit_args(self, fragment: str) -> None:
        if fragment:
            call = self._calls[-1]
            call.args.append(fragment)
            self._emit(ToolCallArgs(call.index, fragment))

    def _call_note(self, note: str) -> None:
        self._note(f"call {self._calls[-1].index} ({self._calls[-1].name}): {note}")

    def _end_call(self, note: str | None = None) -> None:
        call = self._calls[-1]
        cut = bool(note) and note.startswith("cut off at end of generation")
        if note:
            self._call_note(note)
            if cut:
                self.cut_off = True
        self._emit_args("}")
        self._emit(ToolCallEnd(call.index, cut))
        self._state = "after"
        if not self._parallel:
            self.stop_requested = True
            self._state, self._buf = "stopped", ""
            self._note("parallel_tool_calls is false: stopped after the first call")

    def _on_call(self, final: bool) -> bool:
        """Between parameters: <parameter=K>, </function>, or tolerated junk."""
        buf = self._buf.lstrip()
        self._buf = buf
        if not buf:
            if final:
                self._end_call("cut off at end of generation (no </function>)")
                return True
            return False
        if buf.startswith(PARAM):
            gt = buf.find(">", len(PARAM))
            name = buf[len(PARAM):] if gt < 0 else buf[len(PARAM):gt]
            if _name_ok(name) and (gt >= 0 and name):
                self._buf = buf[gt + 1:]
                self._begin_param(name)
                return True
            if _name_ok(name) and gt < 0 and not final:
                return False
        elif buf.startswith(END_PARAM):     # a duplicated </parameter>
            self._buf = buf[len(END_PARAM):]
            return True
        elif buf.startswith(END_FUNC):
            self._buf = buf[len(END_FUNC):]
            self._end_call()
            return True
        elif buf.startswith(END_CALL):
            self._buf = buf[len(END_CALL):]
            self._end_call("no </function> before </tool_call>")
            return True
        elif buf.startswith(CALL):
            self._end_call("no </function></tool_call> before the next <tool_call>")
            return True
        elif not final and any(t.startswith(buf) for t in (PARAM, END_PARAM, END_FUNC, END_CALL, CALL)):
            return False
        q = buf.find("<", 1)
        self._buf = buf[q:] if q > 0 else ""
        self._call_note("ignored text between parameters")
        return True

    def _begin_param(self, name: str) -> None:
        call = self._calls[-1]
        props = call.schema.get("properties") if isinstance(call.schema.get("properties"), dict) else {}
        kind, nullable = _kind(props.get(name), call.schema)
        param = _Param(name, kind, nullable, skip=name in call.used)
        if param.skip:
            self._call_note(f"duplicate parameter {name!r} ignored")
        else:
            sep = ", " if call.used else ""
            call.used.add(name)
            param.opened = kind == "string" and not nullable
            self._emit_args(sep + json.dumps(name, ensure_ascii=False) + ": " + ('"' if param.opened else ""))
        self._param, self._state = param, "value"

    def _on_value(self, final: bool) -> bool:
        param = self._param
        if param.fresh:
            if not self._buf and not final:
                return False
            if self._buf.startswith("\n"):
                self._buf = self._buf[1:]
            param.fresh = False
        n, event = self._scan_value(final)
        self._value_text(self._buf[:n])
        if event is None:
            self._buf = self._buf[n:]
            return False
        kind, end = event
        self._buf = self._buf[end:]
        self._end_value()
        if kind == "param_end":
            self._state = "call"
        elif kind == "next_param":
            self._state = "call"
            self._call_note("missing </parameter>")
        elif kind == "func_end":
            self._end_call("missing </parameter> before </function>")
        elif kind == "call_end":
            self._end_call("missing </parameter></function> before </tool_call>")
        else:
            self._end_call("cut off at end of generation (inside a parameter)")
        return True

    def _scan_value(self, final: bool) -> tuple[int, tuple | None]:
        """(length of value text that is certain, event or None). The newline before a terminator (and
        a trailing one, which may precede a terminator) is never part of the certain text."""
        buf, i = self._buf, 0
        while True:
            p = buf.find("<", i)
            if p < 0:
                n = len(buf) - buf.endswith("\n")
                return n, (("eos", len(buf)) if final else None)
            act = self._value_tag(p, final)
            if act[0] == "literal":
                i = p + 1
                continue
            return p - (p > 0 and buf[p - 1] == "\n"), (None if act is WAIT else act)

    def _value_tag(self, p: int, final: bool) -> tuple:
        """What the '<' at p ends inside a value. </function> and </tool_call> count only when followed by
        what structure allows (else they are literal); <parameter=K> only on a new line with a known K."""
        buf, s = self._buf, self._buf[p:]
        if s.startswith(END_PARAM):
            return ("param_end", p + len(END_PARAM))
        if s.startswith(END_FUNC):
            return self._followed_by(p + len(END_FUNC), END_CALL, final, ("func_end", p + len(END_FUNC)))
        if s.startswith(END_CALL):
            return self._followed_by(p + len(END_CALL), CALL, final, ("call_end", p + len(END_CALL)))
        on_new_line = buf[p - 1] == "\n" if p > 0 else not self._param.parts
        if on_new_line and s.startswith(PARAM):
            gt = s.find(">")
            name = s[len(PARAM):] if gt < 0 else s[len(PARAM):gt]
            if gt < 0:
                could = _name_ok(name) and self._param_name_ok(name, prefix=True)
                if could:                       # at the end: the next parameter's tag, cut off
                    return WAIT if not final else ("eos", len(buf))
                return LITERAL
            if not self._param_name_ok(name, prefix=False):
                return LITERAL
            if gt + 1 == len(s):
                return WAIT if not final else ("next_param", p)
            return ("next_param", p) if s[gt + 1] == "\n" else LITERAL
        tags = (END_PARAM, END_FUNC, END_CALL, PARAM) if on_new_line else (END_PARAM, END_FUNC, END_CALL)
        if any(t.startswith(s) for t in tags):
            # a terminator's beginning: wait for the rest, or at the end of generation (max_tokens) drop
            # it with the newline before it, as a complete terminator would be
            return WAIT if not final else ("eos", len(buf))
        return LITERAL

    def _followed_by(self, k: int, tag: str, final: bool, act: tuple) -> tuple:
        """act if whitespace then `tag` or the end of generation follow k; LITERAL if something else does."""
        buf = self._buf
        while k < len(buf) and buf[k].isspace():
            k += 1
        rest = buf[k:]
        if not rest:
            return act if final else WAIT
        if rest.startswith(tag):
            return act
        return WAIT if not final and tag.startswith(rest) else LITERAL

    def _param_name_ok(self, name: str, prefix: bool) -> bool:
        """A name that may open the next parameter from inside a value: a schema property (any valid
        name when the schema lists none) other than the current parameter."""
        props = self._calls[-1].schema.get("properties")
        if not isinstance(props, dict) or not props:
            return _name_ok(name) and (prefix or (bool(name) and name != self._param.name))
        if prefix:
            return any(k.startswith(name) for k in props if k != self._param.name)
        return name in props and name != self._param.name

    def _value_text(self, text: str) -> None:
        param = self._param
        if not text:
            return
        param.parts.append(text)
        if param.kind != "string" or param.skip:
            return
        if param.opened:
            self._emit_args(_escape(text))
            return
        so_far = "".join(param.parts)
        if not any(w.startswith(so_far) for w in NULL_WORDS):   # a nullable string that can no longer be null
            param.opened = True
            self._emit_args('"' + _escape(so_far))

    def _end_value(self) -> None:
        param, self._param = self._param, None
        if param.skip:
            return
        text = "".join(param.parts)
        if param.kind == "string":
            if param.opened:
                self._emit_args('"')
            else:
                self._emit_args("null" if text in NULL_WORDS else '"' + _escape(text) + '"')
            return
        ok, value = _convert(text, param.kind, param.nullable)
        if not ok:
            self._call_note(f"parameter {param.name!r} is not a valid {param.kind}; kept as a string")
        self._emit_args(json.dumps(value, ensure_ascii=False))

    # ---- after a call ----

    def _on_after(self, final: bool) -> bool:
        """Between and after calls: only another <tool_call> counts; other text is dropped."""
        buf = self._buf.lstrip()
        self._buf = buf
        if not buf:
            return False
        for tag in (END_CALL, END_THINK):
            if buf.startswith(tag):
                self._buf = buf[len(tag):]
                return True
        if buf.startswith(CALL):
            act = self._call_open(0, final, in_reasoning=False)
            if act is WAIT:
                return False
            if act[0] == "literal":
                self._note(f"{act[1]}; dropped (text after a tool call)")
                self._buf = buf[len(CALL):]
            else:
                self._act(act)
            return True
        if not final and any(t.startswith(buf) for t in (END_CALL, END_THINK, CALL)):
            return False
        q = buf.find("<", 1)
        self._buf = buf[q:] if q > 0 else ""
        self._note("dropped text after a tool call")
        return True

    def _on_stopped(self, final: bool) -> bool:
        self._buf = ""
        return False


# ---- schemas and values ---------------------------------------------------------------------------

def _index_tools(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema, from OpenAI {type, function:{name, parameters}}, flat or Anthropic shapes."""
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of dicts or None, got {type(tools).__name__}")
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must have a function name, got {tool!r:.200}")
        schema = fn.get("parameters", fn.get("input_schema"))
        out[fn["name"]] = schema if isinstance(schema, dict) else {}
    return out


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _name_ok(name: str) -> bool:
    return len(name) <= MAX_NAME and not any(c.isspace() or c in "<>" for c in name)


def _kind(schema: Any, root: dict, depth: int = 0) -> tuple[str, bool]:
    """(kind, nullable) of a parameter schema; kind "string" (raw text) when unknown."""
    if not isinstance(schema, dict) or depth > 8:
        return "string", False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return _kind(target, root, depth + 1)
    nullable = schema.get("nullable") is True
    types = schema.get("type")
    if isinstance(types, str):
        types = [types]
    if isinstance(types, list) and types:
        real = [t for t in types if t != "null"]
        return (real[0] if real and real[0] in _KINDS else "string" if real else "null"), nullable or "null" in types
    for key in ("anyOf", "oneOf", "allOf"):
        alts = schema.get(key)
        if isinstance(alts, list) and alts:
            kinds = [_kind(a, root, depth + 1) for a in alts]
            real = [k for k, _ in kinds if k != "null"]
            return (real[0] if real else "null"), nullable or any(n or k == "null" for k, n in kinds)
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        nullable = nullable or None in values
        values = [v for v in values if v is not None]
        for kind, test in (("boolean", lambda v: isinstance(v, bool)), ("string", lambda v: isinstance(v, str)),
                           ("integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
                           ("number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))):
            if values and all(map(test, values)):
                return kind, nullable
    if "properties" in schema:
        return "object", nullable
    if "items" in schema:
        return "array", nullable
    return "string", nullable


_KINDS = ("string", "integer", "number", "boolean", "object", "array", "null")


def _convert(text: str, kind: str, nullable: bool) -> tuple[bool, Any]:
    """(ok, value) for a non-string parameter; (False, text) keeps the raw text as a string."""
    s = text.strip()
    if s in NULL_WORDS and (nullable or kind == "null"):
        return True, None
    if kind in ("integer", "number"):
        try:
            return True, int(s)
        except ValueError:
            pass
        try:
            f = float(s)
        except ValueError:
            return False, text
        if not math.isfinite(f):
            return False, text
        return True, (int(f) if kind == "integer" and f.is_integer() else f)
    if kind == "boolean":
        return (True, s.lower() == "true") if s.lower() in ("true", "false") else (False, text)
    if kind in ("object", "array"):
        for _ in range(3):    # up to doubly encoded
            try:
                value = json.loads(s)
            except (ValueError, RecursionError):       # RecursionError: nested deeper than json can decode
                if len(s) > MAX_LITERAL:
                    return False, text
                try:
                    value = ast.literal_eval(s)
                except Exception:   # literal_eval raises ValueError, SyntaxError, MemoryError, RecursionError...
                    return False, text
            if isinstance(value, str):
                s = value.strip()
                continue
            if isinstance(value, tuple):
                value = list(value)
            return (True, value) if isinstance(value, (dict, list)) and _json_ok(value) else (False, text)
    return False, text


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError, RecursionError):
        return False


def _escape(text: str) -> str:
    """JSON string escape without the quotes; escaping is per character, so pieces concatenate."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
