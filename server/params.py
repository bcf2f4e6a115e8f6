"""Request bodies: JSON decoding and typed field readers that name the field's path in their errors.

    body = await read_json(request)                 # 400 for invalid UTF-8, bad JSON, a non-object
    f = Fields(body)
    t = f.number("temperature", lo=0, hi=2)         # None when absent or null
    n = f.integer("n", lo=1)
    stop = f.stop("stop")

Every problem is an APIError(400, "invalid_request", message, param=path), never a 422. Null means
"omitted" for optional fields (clients send null for unset options).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from runtime.sampling import MAX_LOGIT_BIAS
from server.service import APIError

_TYPE_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", dict: "an object",
               list: "an array", type(None): "null"}


def _json_type(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def bad(message: str, param: str | None) -> APIError:
    return APIError(400, "invalid_request", message, param=param)


async def read_json(request) -> dict[str, Any]:
    """The request body as a JSON object."""
    body = await request.body()
    if not body.strip():
        raise bad("the request body is empty; expected a JSON object", None)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start})", None) from None
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad("the request body is nested too deeply", None) from None
    except ValueError as e:
        raise bad(f"the request body is not valid JSON: {e}", None) from None
    if not isinstance(value, dict):
        raise bad(f"the request body must be a JSON object, got {_json_type(value)}", None)
    if _SURROGATE_ESCAPE.search(text) and not _valid_unicode(value):
        raise bad("the request body contains an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF)", None)
    return value


def _valid_unicode(value: Any) -> bool:
    """No lone surrogates anywhere (JSON escapes can encode them; UTF-8 and tokenizers cannot)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return True


def _finite_float(token: str) -> float:
    """A JSON number that overflows a double (1e999) is refused like NaN / Infinity: echoed back it would
    make the response itself invalid JSON."""
    v = float(token)
    if not math.isfinite(v):
        raise ValueError(f"number {token[:40]} is out of range")
    return v


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class Fields:
    """Typed reads of one JSON object's fields; `prefix` is the object's own path ("" for the body)."""

    def __init__(self, obj: dict[str, Any], prefix: str = ""):
        self.obj, self.prefix = obj, prefix

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def get(self, key: str, required: bool = False) -> Any:
        value = self.obj.get(key)
        if value is None and required:
            raise bad(f"you must provide '{self.path(key)}'", self.path(key))
        return value

    def _type_error(self, key: str, expected: str, value: Any) -> APIError:
        return bad(f"invalid type for '{self.path(key)}': expected {expected}, got {_json_type(value)}",
                   self.path(key))

    def number(self, key: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
               required: bool = False) -> float | None:
        v = self.get(key, required)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._type_error(key, "a number", v)
        v = float(v)
        if not math.isfinite(v) or (lo is not None and (v < lo or (lo_open and v == lo))) \
                or (hi is not None and v > hi):
            lo_s = "" if lo is None else (f"> {lo:g}" if lo_open else f">= {lo:g}")
            hi_s = "" if hi is None else f"<= {hi:g}"
            raise bad(f"invalid value for '{self.path(key)}': expected a number {' and '.join(filter(None, (lo_s, hi_s)))}"
                      f", got {v:g}", self.path(key))
        return v

    def integer(self, key: str, lo: int | None = None, hi: int | None = None, required: bool = False) -> int | None:
        v = self.get(key, required)
        if v is None:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._type_error(key, "an integer", v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = " and ".join(filter(None, (f">= {lo}" if lo is not None else "", f"<= {hi}" if hi is not None else "")))
            raise bad(f"invalid value for '{self.path(key)}': expected an integer {rng}, got {v}", self.path(key))
        return v

    def boolean(self, key: str) -> bool | None:
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise self._type_error(key, "a boolean", v)
        return v

    def string(self, key: str, required: bool = False, choices: tuple[str, ...] | None = None) -> str | None:
        v = self.get(key, required)
        if v is None:
            return None
        if not isinstance(v, str):
            raise self._type_error(key, "a string", v)
        if choices is not None and v not in choices:
            raise bad(f"invalid value for '{self.path(key)}': expected one of {', '.join(choices)}; got {v!r}",
                      self.path(key))
        return v

    def object(self, key: str, required: bool = False) -> dict[str, Any] | None:
        v = self.get(key, required)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self._type_error(key, "an object", v)
        return v

    def logit_bias(self, key: str = "logit_bias", limit: int = MAX_LOGIT_BIAS) -> tuple[tuple[int, float], ...] | None:
        """OpenAI logit_bias: an object {"token id": bias in [-100, 100]} (keys: decimal digit strings, at
        most `limit` of them) -> sorted (id, bias) pairs; None when absent, null or empty. Whether the
        ids are in the vocabulary is the engine's check (a 400 naming the field too)."""
        v = self.object(key)
        if not v:
            return None
        path = self.path(key)
        if len(v) > limit:
            raise bad(f"invalid value for '{path}': at most {limit} token ids may be biased, got {len(v)}", path)
        out: dict[int, float] = {}
        for k, b in v.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise bad(f"invalid key in '{path}': expected a token id (a string of at most 10 decimal digits), "
                          f"got {k!r:.40}", path)
            t = int(k)
            if t in out:
                raise bad(f"invalid key in '{path}': token id {t} appears twice", path)
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
                got = f"{b:g}" if isinstance(b, (int, float)) and not isinstance(b, bool) else _json_type(b)
                raise bad(f"invalid value for '{path}.{k}': expected a number in [-100, 100], got {got}", path)
            out[t] = float(b)
        return tuple(sorted(out.items()))

    def array(self, key: str, required: bool = False) -> list[Any] | None:
        v = self.get(key, required)
        if v is None:
            return None
        if not isinstance(v, list):
            raise self._type_error(key, "an array", v)
        return v

    def stop(self, key: str) -> list[str]:
        """str | [str] -> list of non-empty strings (lenient on count, as clients send long lists)."""
        v = self.get(key)
        if v is None:
            return []
        if isinstance(v, str):
            return [v] if v else []
        if not isinstance(v, list):
            raise self._type_error(key, "a string or an array of strings", v)
        for i, s in enumerate(v):
            if not isinstance(s, str):
                raise bad(f"invalid type for '{self.path(key)}[{i}]': expected a string, got {_json_type(s)}",
                          f"{self.path(key)}[{i}]")
        return [s for s in v if s]


def tools(value: Any, param: str = "tools") -> list[dict[str, Any]] | None:
    """OpenAI Chat tools [{type: "function", function: {name, description?, parameters?, strict?}}],
    validated; None for absent or empty."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad(f"invalid type for '{param}': expected an array, got {_json_type(value)}", param)
    out = []
    seen = set()
    for i, tool in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise bad(f"invalid type for '{p}': expected an object, got {_json_type(tool)}", p)
        if tool.get("type", "function") != "function":
            raise bad(f"invalid value for '{p}.type': only 'function' tools are supported, got {tool.get('type')!r}",
                      f"{p}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"you must provide '{p}.function' (an object)", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 256 or any(c.isspace() or c in "<>" for c in name):
            raise bad(f"invalid value for '{p}.function.name': expected a non-empty name without spaces or "
                      f"angle brackets (at most 256 characters), got {name!r:.80}", f"{p}.function.name")
        if name in seen:
            raise bad(f"duplicate tool name {name!r} in '{p}.function.name'", f"{p}.function.name")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"invalid type for '{p}.function.description': expected a string", f"{p}.function.description")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad(f"invalid type for '{p}.function.parameters': expected a JSON Schema object, got "
                          f"{_json_type(params)}", f"{p}.function.parameters")
            kind = params.get("type")
            if kind is not None and kind != "object":
                raise bad(f"invalid value for '{p}.function.parameters.type': a function's parameters must be "
                          f"a JSON Schema of type 'object', got {kind!r}", f"{p}.function.parameters.type")
            props = params.get("properties")
            if props is not None and not isinstance(props, dict):
                raise bad(f"invalid type for '{p}.function.parameters.properties': expected an object",
                          f"{p}.function.parameters.properties")
        out.append(tool if "type" in tool else {"type": "function", **tool})
    return out or None


def tool_choice(value: Any, tools_: list[dict] | None, param: str = "tool_choice") -> Any:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name"}} checked against tools."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad(f"invalid value for '{param}': expected 'none', 'auto', 'required' or an object naming a "
                      f"function, got {value!r}", param)
        if value == "required" and not tools_:
            raise bad(f"'{param}' is 'required' but no tools were given", param)
        return value
    if not isinstance(value, dict):
        raise bad(f"invalid type for '{param}': expected a string or an object, got {_json_type(value)}", param)
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if value.get("type") != "function" or not isinstance(name, str):
        raise bad(f"invalid value for '{param}': expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                  param)
    if name not in {t["function"]["name"] for t in tools_ or ()}:
        raise bad(f"invalid value for '{param}.function.name': no tool named {name!r} was given",
                  f"{param}.function.name")
    return value
