"""Structured outputs: a grammar that constrains which tokens a request may sample.

The APIs' output formats (OpenAI `response_format` / Responses `text.format` json_object and
json_schema, Anthropic `output_config.format`) become an llguidance grammar (`compile_format`, in the
frontend, so a bad schema is a 400 naming its field). The grammar travels in SamplingParams; the
coordinator keeps one `Constraint` per sequence: before every step that samples the sequence it
computes the bitmask of allowed token ids (llguidance's Earley parser over the tokenizer's byte
strings, ~0.1-1 ms per token) and sends it with the step plan; each rank sets the disallowed ids of
its vocabulary shard to -inf before sampling (ranks.sampler.apply_penalties), so every sampler
(greedy, temperature, top-k / top-p / min-p, penalties, logit_bias) draws from the allowed ids only;
after the step the sampled token advances the parser. When the grammar is complete only the end-of-
sequence ids remain allowed, so the request stops there.

A grammar applies after the first of `grammar_after` ids in the output (the `</think>` of a
reasoning model: reasoning is never constrained, api.md section 6.9), or from the first token when
that is empty. Constrained sequences need the sampled token before the next step can be planned:
they take no speculative drafts and no steps planned ahead (runtime.scheduler).

llguidance (a Rust wheel with no Python dependencies) is imported on first use; without it a
request with an output format is refused with a message that says so.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import numpy as np


class GrammarError(ValueError):
    """An output format that cannot be compiled; the message starts with the field's name."""


class Grammar(str):
    """A compiled grammar that remembers the request field it came from (`field`), so that an error
    found later (with the model's tokenizer, in the engine) can name it."""
    field: str | None = None


def with_field(grammar: str | None, field: str) -> str | None:
    """grammar as a Grammar naming `field` (None stays None)."""
    if grammar is None:
        return None
    out = Grammar(grammar)
    out.field = field
    return out


def _llg():
    try:
        import llguidance
    except ImportError as e:                               # pragma: no cover - a dependency of the package
        raise GrammarError("structured outputs need the 'llguidance' package (pip install llguidance)") from e
    return llguidance


# Compiler options: JSON with the separators models write (", " and ": ") and free whitespace between
# tokens off, so a constrained model cannot pad its answer with endless spaces or newlines.
# Keywords llguidance does not implement (e.g. some "format" values) are ignored rather than refused.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
MAX_SCHEMA_BYTES = 1 << 20


def json_schema_grammar(schema: Any, field: str) -> str:
    """The grammar of JSON documents valid under `schema` (a dict, or True / {} for any JSON value);
    GrammarError naming `field` when the schema is not one llguidance can compile."""
    if schema is True or schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"{field} must be a JSON schema object, got {type(schema).__name__}")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise GrammarError(f"{field} is not JSON-serialisable: {e}") from None
    if len(text) > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{field} is {len(text)} bytes; at most {MAX_SCHEMA_BYTES} are accepted")
    llg = _llg()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(text, overrides=_JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{field} is not a usable JSON schema: {e}") from None
    _validate(grammar, field)
    return grammar


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's json_object mode)."""
    return json_schema_grammar({"type": "object"}, "response_format")


def regex_grammar(pattern: str, field: str) -> str:
    if not isinstance(pattern, str):
        raise GrammarError(f"{field} must be a string, got {type(pattern).__name__}")
    grammar = _llg().LLMatcher.grammar_from_regex(pattern)
    _validate(grammar, field)
    return grammar


def choice_grammar(choices: Any, field: str) -> str:
    """Exactly one of the given strings."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError(f"{field} must be a non-empty list of non-empty strings")
    alts = " | ".join(json.dumps(c) for c in choices)       # a JSON string literal is a Lark string literal
    grammar = _llg().LLMatcher.grammar_from_lark(f"start: {alts}\n")
    _validate(grammar, field)
    return grammar


def lark_grammar(text: str, field: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{field} must be a non-empty Lark grammar")
    grammar = _llg().LLMatcher.grammar_from_lark(text)
    _validate(grammar, field)
    return grammar


def tool_name(tool: dict) -> str | None:
    """The name of an offered tool or of a named tool_choice, in the OpenAI form ({"function": {"name"}})
    or the Anthropic one ({"name"}); None when it has none."""
    name = (tool.get("function") or {}).get("name") or tool.get("name")
    return name if isinstance(name, str) and name else None


def _tool_params(tool: dict) -> dict[str, Any] | None:
    """A strict tool's declared parameters, name -> its JSON schema (None: any name, where the tool is
    not `strict` or declares none: without strict, OpenAI's API does not promise the schema either)."""
    spec = tool.get("function") or tool
    if spec.get("strict") is not True:
        return None
    schema = spec.get("parameters") or spec.get("input_schema")
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props:
        return None
    return {k: v for k, v in props.items() if isinstance(k, str) and k and ">" not in k and "\n" not in k} or None


# A strict parameter's value as the template writes it (strings raw, other scalars as Python's str):
# the terminal of its text up to and including the "\n</parameter>" that closes it.
_CLOSE = r"\n<\/parameter>"
_TYPED = {
    "integer": r"-?(0|[1-9][0-9]*)",
    "number": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    "boolean": r"(true|false|True|False)",
}


def _value_terminal(schema: Any) -> str | None:
    """The typed terminal of one strict parameter (integer, number, boolean, an enum of strings), or
    None for free text (strings, objects, arrays, unions, other enums)."""
    if not isinstance(schema, dict):
        return None
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) and "\n" not in v for v in enum):
        return "(" + "|".join(re.escape(v).replace("/", r"\/") for v in enum) + ")"
    kind = schema.get("type")
    return _TYPED.get(kind) if isinstance(kind, str) else None


def tool_call_grammar(tools: list[dict], only: str | None, parallel: bool, opened: str, call_id: int,
                      call_end_id: int) -> str:
    """The grammar of tool calls in the Qwen3.5 / 3.6 XML form (api.md section 6), for tool_choice
    "required" (`only` None: any of `tools`) or a named tool (`only`): one call, or with `parallel`
    one or more separated by a newline, and nothing else. Each call is

        <tool_call>\n<function=NAME>\n(<parameter=KEY>\nVALUE\n</parameter>\n)*</function>\n</tool_call>

    with <tool_call> / </tool_call> as their single token ids (call_id, call_end_id: the parser
    matches them by id), NAME one of the offered tools, KEY one of that tool's declared parameters
    when it is `strict` (else any key: forcing a model off the key it would write sends it off its
    distribution), VALUE any text without "\n</parameter>", or for a strict tool's integer, number,
    boolean or enum parameter a literal of that type (the parser converts values by the schema;
    which keys are present, and the shape of objects and arrays, are not constrained).
    `opened`: the part of the first call the prompt already holds (Service._forced_call: the
    generation prompt opens the call when thinking is off); the grammar starts after it."""
    tools = [t for t in tools if isinstance(t, dict) and tool_name(t)]
    if only is not None:
        tools = [t for t in tools if tool_name(t) == only]
    if not tools:
        raise GrammarError("tool_choice: no tool to call")
    lines, alts, typed = [], [], {}
    for i, t in enumerate(tools):
        params = _tool_params(t)
        if params is None:
            choices = ['"<parameter=" KEY ">\\n" VALUE']
        else:
            choices = []
            for k, sch in params.items():
                term = _value_terminal(sch)
                name = "VALUE" if term is None else typed.setdefault(term, f"TYPED{len(typed)}")
                choices.append(f"{json.dumps(f'<parameter={k}>' + chr(10))} {name}")
        lines.append(f"p{i}: ({' | '.join(choices)}) \"\\n\"")
        lines.append(f"b{i}: p{i}* \"</function>\\n\"")
        alts.append((i, tool_name(t)))
    lines += [f"{name}: /{term}{_CLOSE}/" for term, name in typed.items()]
    head = f"<[{int(call_id)}]> \"\\n<function=\""
    calls = " | ".join(f"{json.dumps(n + '>' + chr(10))} b{i}" for i, n in alts)
    lines.append(f"call: {head} ({calls}) <[{int(call_end_id)}]>")
    # the first call, continued after what the prompt opened
    prefix = "<tool_call>\n<function="
    index = {n: i for i, n in alts}
    if not opened:
        first = "call"
    elif opened == "<tool_call>\n<function":
        first = f"\"=\" ({calls}) <[{int(call_end_id)}]>"
    elif opened.startswith(prefix) and opened.endswith(">\n") and opened[len(prefix):-2] in index:
        first = f"b{index[opened[len(prefix):-2]]} <[{int(call_end_id)}]>"
    else:
        raise GrammarError(f"tool_choice: cannot continue a call opened as {opened!r}")
    lines.append(f"first: {first}")
    lines.append("start: first" + (' ("\\n" call)*' if parallel else ""))
    lines.append("KEY: /[^>\\n]+/")
    lines.append("VALUE: /(?s:.*)\\n<\\/parameter>/ & ~/(?s:.*)\\n<\\/parameter>(?s:.+)/")
    return lark_grammar("\n".join(lines) + "\n", "tool_choice")


def _validate(grammar: str, field: str) -> None:
    err = _llg().LLMatcher.validate_grammar(grammar, None)
    if err:
        raise GrammarError(f"{field}: {err}")


def compile_format(fmt: dict | None, field: str) -> str | None:
    """An API output format -> a grammar (None for plain text). Accepted: {"type": "text"},
    {"type": "json_object"}, {"type": "json_schema", "schema": ...} and OpenAI Chat's nested
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}. `field` names the format in
    errors (e.g. "response_format")."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise GrammarError(f"{field} must be an object, got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if inner is not None:                              # OpenAI Chat: {"json_schema": {"name", "schema"}}
            if not isinstance(inner, dict):
                raise GrammarError(f"{field}.json_schema must be an object, got {type(inner).__name__}")
            return json_schema_grammar(inner.get("schema"), f"{field}.json_schema.schema")
        return json_schema_grammar(fmt.get("schema"), f"{field}.schema")
    raise GrammarError(f"{field}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


# --------------------------------------------------------------------------------------------------
# The coordinator's side: one parser per constrained sequence

_tokenizers: dict[tuple[str, int, tuple[int, ...]], Any] = {}
_tok_lock = threading.Lock()
MAX_TOKENIZERS = 8                      # distinct (file, vocabulary, end ids) kept
LEAD_WHITESPACE = 2                     # whitespace tokens a model may write between </think> and the grammar


def llg_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's view of a tokenizer (its token byte strings; ~1 s to build for a 248k vocabulary,
    so kept per (file, vocabulary size, end ids): the end ids are the ones a complete output may end
    with, a request's stop ids). vocab_size is the model's (the logits' width), which may exceed the
    tokenizer's: ids past it are never allowed."""
    key = (tokenizer_json, int(vocab_size), tuple(sorted(eos_ids)))
    with _tok_lock:
        tok = _tokenizers.get(key)
        if tok is None:
            if len(_tokenizers) >= MAX_TOKENIZERS:
                _tokenizers.pop(next(iter(_tokenizers)))
            with open(tokenizer_json, encoding="utf-8") as f:
                text = f.read()
            eos = list(key[2])
            try:
                tok = _llg().LLTokenizer(text, n_vocab=int(vocab_size), eos_token=eos)
            except TypeError:                      # llguidance < 1.7 takes one eos id
                tok = _llg().LLTokenizer(text, n_vocab=int(vocab_size), eos_token=eos[0] if eos else None)
            _tokenizers[key] = tok
        return tok


def whitespace_mask(tokenizer) -> bytes:
    """The bitmask of ids whose text is whitespace only (spaces, newlines, tabs; no special ids): the
    first-token mask of a whitespace grammar, one parser step."""
    return _llg().LLMatcher(tokenizer, _llg().LLMatcher.grammar_from_regex(r"[ \t\n\r]+"),
                            log_level=0).compute_bitmask()


class Constraint:
    """One sequence's grammar state. `mask()` before a step that samples the sequence, `advance()`
    with the tokens the step added (sampled or inserted). With `after` ids (the end of reasoning), the
    grammar starts at the first sampled token after one of them; up to LEAD_WHITESPACE whitespace-only
    tokens may come first (models write "\n\n" after </think>)."""

    def __init__(self, tokenizer, grammar: str, after: tuple[int, ...] = ()):
        llg = _llg()
        self.matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        # The first mask now, and a copy of the parser taking the first token it allows: limits that only
        # the tokenizer and the first token reach (a lexer too large, a row of too many alternatives)
        # then refuse the request before it runs instead of failing it mid-way.
        self._first = None if self.matcher.is_error() else self.matcher.compute_bitmask()
        err = self.matcher.get_error() if self.matcher.is_error() else self._probe(self._first)
        if err is not None:
            raise GrammarError(f"the request's grammar cannot be used with this model's tokenizer: {err}")
        self.after = frozenset(after)
        # whitespace-only ids: allowed (and not fed to the grammar) right after the end of reasoning
        self._ws = np.frombuffer(whitespace_mask(tokenizer), dtype=np.uint8) if after else None
        self.active = not after                 # waiting for the end of reasoning otherwise
        self._pending = False                   # `after` seen: the grammar (or lead whitespace) next
        self._lead = 0                          # whitespace tokens taken before the grammar

    def _probe(self, mask: bytes) -> str | None:
        """The error a copy of the parser meets taking the first id `mask` allows, then its next mask."""
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little"))
        if not allowed.size:
            return None
        probe = self.matcher.deep_copy()
        probe.consume_token(int(allowed[0]))
        if not probe.is_error():
            probe.compute_bitmask()
        return probe.get_error() if probe.is_error() else None

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def complete(self) -> bool:
        """The grammar can take nothing more (the output is whole: end the request)."""
        return self.active and self.matcher.is_stopped() and not self.matcher.is_error()

    def mask(self) -> bytes | None:
        """The allowed ids of the next sampled token (bit i of byte i // 8 = id i), None while the
        grammar does not apply yet."""
        if not self.active and not self._pending:
            return None
        m, self._first = self._first or self.matcher.compute_bitmask(), None   # nothing consumed since __init__
        if not self.active and self._lead < LEAD_WHITESPACE:
            m = (np.frombuffer(m, dtype=np.uint8) | self._ws).tobytes()     # both over the same vocabulary
        return m

    def advance(self, tokens: list[int]) -> None:
        """Tokens appended to the output (sampled under the last mask, or inserted without sampling)."""
        for t in tokens:
            t = int(t)
            if self.active or self._pending:
                self._first = None                  # the matcher's state moves on (or may): no stale mask
            if self.active:
                self.matcher.consume_token(t)
            elif self._pending:
                if self._lead < LEAD_WHITESPACE and t < 8 * self._ws.size and (self._ws[t >> 3] >> (t & 7)) & 1:
                    self._lead += 1             # whitespace before the document: not the grammar's
                else:
                    self.active = True
                    self.matcher.consume_token(t)
            elif t in self.after:
                self._pending = True


class MinTokens:
    """min_tokens as a constraint: until `n` tokens are generated the mask leaves out the stop ids,
    ANDed with the wrapped grammar's mask when the request has one (`inner`); once they are, the
    coordinator puts `inner` back in its place (speculation and device-fed steps skip constrained
    sequences). Where the grammar allows nothing but a stop id, the grammar's mask stands."""

    def __init__(self, n: int, stops: frozenset[int], vocab_size: int, inner: Constraint | None = None):
        self.left, self.inner = n, inner
        allow = np.ones(vocab_size, dtype=bool)
        allow[[t for t in stops if 0 <= t < vocab_size]] = False
        self._ban = np.packbits(allow, bitorder="little")

    @property
    def error(self) -> str | None:
        return self.inner.error if self.inner is not None else None

    @property
    def complete(self) -> bool:
        return self.inner is not None and self.inner.complete

    def mask(self) -> bytes | None:
        m = self.inner.mask() if self.inner is not None else None
        if self.left <= 0:
            return m
        if m is None:
            return self._ban.tobytes()
        g = np.frombuffer(m, dtype=np.uint8)
        n = min(g.size, self._ban.size)
        both = g.copy()
        both[:n] &= self._ban[:n]
        return both.tobytes() if both.any() else m

    def advance(self, tokens: list[int]) -> None:
        self.left -= len(tokens)
        if self.inner is not None:
            self.inner.advance(tokens)


def mask_shard(mask: bytes, offset: int, n: int) -> np.ndarray:
    """bool [n]: which ids offset .. offset + n - 1 a bitmask allows (ids past its end: none)."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    out = np.zeros(n, dtype=bool)
    have = max(0, min(n, bits.size - offset))
    out[:have] = bits[offset:offset + have].astype(bool)
    return out
