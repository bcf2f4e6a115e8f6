"""Structured outputs at the API layer: each API's output-format fields -> one grammar (runtime.grammar).

    OpenAI Chat / Completions   response_format {type: text | json_object | json_schema}, and the vLLM /
                                SGLang extras guided_json, guided_regex, guided_choice, guided_grammar and
                                structured_outputs {json | regex | choice | grammar | json_object}
    OpenAI Responses            text.format {type: text | json_object | json_schema, name, schema, strict}
    Anthropic Messages          output_config.format {type: json_schema, schema} (the beta's top-level
                                output_format too)

The format is compiled when the request is parsed, so a schema llguidance cannot use is a 400 naming
its field, before anything runs. The grammar rides on the ChatRequest / TextRequest; Service decides
whether it applies (not when the model may call a tool) and from where (after </think>).
`RawContent` replaces the chat output parser for a constrained request: the content is the
grammar's text exactly, never trimmed or read for markup.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from runtime import grammar as G
from runtime import parsing
from server import params as P
from server.service import APIError

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def grammar_error(e: G.GrammarError, field: str) -> APIError:
    """A compile error -> a 400 whose param is the field the message names (a path inside `field`, e.g.
    response_format.json_schema.schema), else `field`."""
    message = str(e)
    head = message.split(None, 1)[0].rstrip(":") if message else ""
    param = head if head == field or head.startswith((field + ".", field + "[")) else field
    return APIError(400, "invalid_request", message, param=param)


def _compile(field: str, make: Callable[[], str | None]) -> str | None:
    try:
        return G.with_field(make(), field)
    except G.GrammarError as e:
        raise grammar_error(e, field) from None
    except (ValueError, TypeError) as e:                   # llguidance refusing what runtime.grammar passed on
        raise grammar_error(G.GrammarError(f"{field}: {e}"), field) from None


def output_format(fmt: Any, field: str) -> str | None:
    """One API output format object ({"type": ...}) -> its grammar, None for text; APIError 400 naming
    the field (or the path inside it) when it cannot be compiled."""
    return _compile(field, lambda: G.compile_format(fmt, field))


def _schema(value: Any, field: str) -> str:
    """guided_json / structured_outputs.json: a schema object, or the same as a JSON string."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise G.GrammarError(f"{field} is a string of JSON nested too deeply") from None
        except ValueError as e:
            raise G.GrammarError(f"{field} is a string but not JSON: {e}") from None
    return G.json_schema_grammar(value, field)


def openai_grammar(f: P.Fields) -> str | None:
    """Chat and completions: response_format, guided_* and structured_outputs -> the grammar of the one
    that is given (response_format "text" counts as none); a 400 naming the second field when two are."""
    given: list[tuple[str, Callable[[], str | None]]] = []
    fmt = f.object("response_format")
    if fmt is not None:
        kind = P.Fields(fmt, "response_format").string("type", required=True,
                                                        choices=("text", "json_object", "json_schema"))
        if kind != "text":
            given.append(("response_format", lambda: G.compile_format(fmt, "response_format")))
    makers = {"json": _schema, "regex": G.regex_grammar, "choice": G.choice_grammar, "grammar": G.lark_grammar}
    for name in GUIDED:
        value = f.get(name)
        if value is not None:
            given.append((name, lambda v=value, n=name: makers[n.split("_", 1)[1]](v, n)))
    so = f.object("structured_outputs")
    if so is not None:
        if so.get("structural_tag") is not None:
            raise P.bad("'structured_outputs.structural_tag' is not supported by this server; use json, regex, "
                        "choice or grammar", "structured_outputs.structural_tag")
        for kind in STRUCTURED_KINDS:
            value, name = so.get(kind), f"structured_outputs.{kind}"
            if kind == "json_object":
                if value is not None and not isinstance(value, bool):
                    raise P.bad(f"invalid type for '{name}': expected a boolean", name)
                if value:
                    given.append((name, G.json_object_grammar))
            elif value is not None:
                given.append((name, lambda v=value, n=name, k=kind: makers[k](v, n)))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(f"'{n}'" for n, _ in given)
        raise P.bad(f"give at most one output constraint per request (response_format, guided_json, "
                    f"guided_regex, guided_choice, guided_grammar or structured_outputs); got {names}", given[1][0])
    return _compile(*given[0])


class RawContent:
    """The output parser of a constrained chat request: reasoning (start "reasoning") goes through the
    usual parser up to </think>; everything after it is content, verbatim (but for leading whitespace
    after </think>: the thinking budget's inserted close-of-thinking leaves a blank line there). The grammar decided every
    character, so nothing in it is trimmed or read as markup (a JSON string may contain "<tool_call>")."""

    def __init__(self, start: parsing.Start, id_seed: str | None = None, id_prefix: str = "call_"):
        self._parser = parsing.OutputParser(start, [], id_seed=id_seed, id_prefix=id_prefix)
        self._reasoning = start == "reasoning"
        self._held = ""                   # reasoning text that could start "</think>"
        self._started = not self._reasoning   # content has begun (leading whitespace after </think> done)
        self._content: list[str] = []
        self.stop_requested = False
        self.cut_off = False

    def feed(self, text: str) -> list:
        if not self._reasoning:
            return self._text(text)
        buf = self._held + text
        end = buf.find(parsing.END_THINK)
        if end >= 0:
            self._held, self._reasoning = "", False
            k = end + len(parsing.END_THINK)
            out = self._parser.feed(buf[:k]) + self._parser.finish()
            return out + self._text(buf[k:])
        keep = next((n for n in range(min(len(buf), len(parsing.END_THINK) - 1), 0, -1)
                     if parsing.END_THINK.startswith(buf[-n:])), 0)
        self._held = buf[len(buf) - keep:]
        return self._parser.feed(buf[:len(buf) - keep])

    def feed_forced(self, text: str) -> list:           # pragma: no cover - forced calls need tools
        raise ValueError("a constrained request has no forced tool call")

    def finish(self) -> list:
        if self._reasoning:                                 # the output ended inside the reasoning
            held, self._held = self._held, ""
            return self._parser.feed(held) + self._parser.finish()
        return []

    def _text(self, text: str) -> list:
        if not self._started:
            text = text.lstrip()
            if not text:
                return []
            self._started = True
        self._content.append(text)
        return [parsing.ContentDelta(text)]

    def result(self) -> parsing.ParsedOutput:
        r = self._parser.result()
        return parsing.ParsedOutput(r.reasoning, "".join(self._content) or None, [], r.notes)
