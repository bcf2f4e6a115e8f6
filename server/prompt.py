"""Chat messages -> the prompt text the model was trained on (api.md §6, template half).

`normalize_messages` turns OpenAI-shaped messages (what every adapter produces) into what Qwen-style
templates accept: developer -> system, legacy function -> tool, every system message merged into one
first system message, content parts joined to text, `reasoning` accepted as `reasoning_content`, and
tool-call arguments given as JSON strings parsed to mappings (the template renders a mapping's items;
a string would make every parameter vanish silently). `ChatTemplate` renders with a compiled, cached
template in the same sandbox as runtime.tokenizer.Tokenizer.render_chat. Problems are APIError 400s
naming the message or field.
"""

from __future__ import annotations

import json
from typing import Any

from server.service import APIError

TEXT_PARTS = ("text", "input_text", "output_text")
ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system", "function": "tool"}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, "invalid_request", message, param=param)


def content_text(content: Any, param: str) -> str:
    """str | None | [parts] -> text; only text parts are accepted (the server is text-only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string or a list of content parts, got {type(content).__name__}", param)
    out = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, dict):
            raise _bad(f"'{p}' must be an object, got {type(part).__name__}", p)
        kind = part.get("type", "text")
        if kind in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"'{p}.text' must be a string", f"{p}.text")
            out.append(text)
        elif kind in ("refusal",):
            out.append(part.get("refusal") or "")
        else:
            raise _bad(f"content part type {kind!r} is not supported by this model (text only)", f"{p}.type")
    return "".join(out)


def tool_arguments(value: Any, param: str) -> dict:
    """A tool call's arguments (a JSON object, or a string of one) as a dict; APIError 400 naming `param`."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:              # json.loads of a string the body check never saw nested
            raise _bad(f"'{param}' is nested too deeply", param) from None
        except ValueError as e:
            raise _bad(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise _bad(f"'{param}' must be a JSON object, got {type(value).__name__}", param)
    return value


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list):
        raise _bad(f"'{param}' must be a list", param)
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise _bad(f"'{p}' must be an object", p)
        fn = call.get("function", call)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"'{p}.function.name' must be a non-empty string", f"{p}.function.name")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": tool_arguments(fn.get("arguments"),
                                                                            f"{p}.function.arguments")}})
    return out


def normalize_messages(messages: Any, param: str = "messages") -> list[dict[str, Any]]:
    """OpenAI-shaped messages -> template-ready ones (see the module doc)."""
    if not isinstance(messages, list) or not messages:
        raise _bad(f"'{param}' must be a non-empty list of messages", param)
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        p = f"{param}[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"'{p}' must be an object, got {type(m).__name__}", p)
        role = m.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"'{p}.role' must be one of system, developer, user, assistant, tool, function; got {role!r}",
                       f"{p}.role")
        text = content_text(m.get("content"), f"{p}.content")
        if role == "system":
            system.append(text)
            continue
        msg: dict[str, Any] = {"role": role, "content": text}
        if role == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning is None:
                reasoning = m.get("reasoning")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise _bad(f"'{p}.reasoning_content' must be a string", f"{p}.reasoning_content")
                msg["reasoning_content"] = reasoning
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
        elif role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(m.get(key), str):
                    msg[key] = m[key]
        if isinstance(m.get("name"), str) and role != "tool":
            msg["name"] = m["name"]
        out.append(msg)
    if not any(m["role"] == "user" for m in out):
        raise _bad(f"'{param}' must contain at least one user message", param)
    if system:
        # blank ones drop out of a merge; a lone system message stays as given, even empty (as
        # transformers renders it)
        texts = [t for t in system if t.strip()]
        merged = "\n\n".join(texts) if texts else (system[0] if len(system) == 1 else "")
        out.insert(0, {"role": "system", "content": merged})
    return out


class ChatTemplate:
    """A compiled chat template; render() raises APIError 400 naming the problem."""

    def __init__(self, source: str, special: dict[str, Any] | None = None):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise _TemplateRaise(str(message))

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        self.source = source
        self.template = env.from_string(source)
        self.special = dict(special or {})
        self.xml_tool_calls = "<function=" in source

    def render(self, messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any],
               continue_final: bool = False) -> str:
        """The prompt: the messages and a new assistant turn's opening; continue_final: the last message is
        an assistant turn to continue (a prefill), so the prompt ends right after its text."""
        ctx = {**self.special, **{k: v for k, v in kwargs.items()
                                  if k not in ("messages", "tools", "add_generation_prompt")}}
        try:
            if continue_final:
                final = messages[-1]["content"]
                text = self.template.render(messages=messages, tools=tools, add_generation_prompt=False, **ctx)
                at = text.rfind(final) if final else -1
                if at < 0:
                    raise _bad("the chat template did not render the final assistant message's text, so it "
                               "cannot be continued", "messages")
                return text[:at + len(final)]
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=True, **ctx)
        except _TemplateRaise as e:
            raise _bad(f"the chat template refused the messages: {e}", "messages") from None
        except RecursionError:
            raise _bad("the chat template could not render the messages: nesting too deep", "messages") from None
        except Exception as e:          # jinja2 errors, TypeError on unexpected shapes, ...
            raise _bad(f"the chat template could not render the messages: {type(e).__name__}: {e}",
                       "messages") from None


class _TemplateRaise(Exception):
    pass
