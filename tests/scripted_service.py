"""Test helpers for the HTTP adapters: a Service that plays scripted deltas, a real uvicorn server, and
a real Service over a tiny random checkpoint.

ScriptedService implements what adapters and server.app call (prepare, submit, release, count_tokens,
generate, resolve_model, thinking_for_effort, record_rejected). prepare() records each ChatRequest; its
prompt is a token per 4 characters of the request's JSON, so count_tokens() == len(prepare().prompt_ids)
as in the real Service. generate() plays
`service.script`: deltas as they are; a Finish gets prompt_tokens / cached_tokens filled in; a number
sleeps that many seconds; an APIError is raised. Tool call ids take the request's tool_id_prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
import time
from typing import Any, Iterator

import uvicorn

from server.reasoning_seal import ReasoningSeal
from server.service import (APIError, ChatRequest, ContentDelta, Finish, Prepared, ReasoningDelta, ToolCallArgs,
                            ToolCallEnd, ToolCallStart)

MODEL = "tiny-test"
ALIAS = "claude-test"
TOO_LONG = "<<too long>>"
SEAL = ReasoningSeal(b"k" * 32)


class ScriptedService:
    model_id = MODEL
    max_context = 100_000
    reasoning_seal = SEAL          # the adapters' default seal when the service carries one
    metrics = request_log = engine = None

    def __init__(self):
        self.script: list[Any] = []
        self.requests: list[ChatRequest] = []
        self.cached_tokens = 0
        self.started: list[str] = []
        self.closed: list[str] = []
        self.released: list[str] = []
        self.rejected: list[APIError] = []
        self.closed_event = threading.Event()

    def reset(self) -> None:
        self.__init__()

    def thinking_for_effort(self, effort: str | None) -> tuple[bool | None, int | None]:
        if effort is None:
            return None, None
        return (False, None) if effort == "none" else (True, {"minimal": 1024, "low": 4096}.get(effort))

    def resolve_model(self, name: str | None) -> str:
        if name not in (None, MODEL, ALIAS):
            raise APIError(404, "not_found", f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")
        return MODEL

    def count_tokens(self, request: ChatRequest) -> int:
        blob = json.dumps([request.messages, request.tools, request.thinking], sort_keys=True)
        return len(blob) // 4 + 1

    def prepare(self, request: ChatRequest) -> Prepared:
        self.resolve_model(request.model)
        if TOO_LONG in json.dumps(request.messages):
            raise APIError(400, "context_length_exceeded", "This model's maximum context length is 100000 tokens. "
                           "However, your request has 200000 input tokens.", param="messages",
                           code="context_length_exceeded")
        self.requests.append(request)
        start = "content" if request.thinking is False else "reasoning"
        return Prepared(request, list(range(self.count_tokens(request))), request.max_tokens or 1000, start,
                        "req_" + secrets.token_hex(6), model=MODEL)

    def record_rejected(self, err: APIError, api: str | None = None) -> None:
        self.rejected.append(err)

    def submit(self, prepared: Prepared) -> None:
        pass

    async def submit_async(self, prepared: Prepared) -> None:
        self.submit(prepared)

    def release(self, prepared: Prepared) -> None:
        self.released.append(prepared.request_id)

    async def generate(self, prepared: Prepared):
        self.started.append(prepared.request_id)
        prefix = getattr(prepared.request, "tool_id_prefix", "call_")
        try:
            for step in list(self.script):
                if isinstance(step, (int, float)):
                    await asyncio.sleep(step)
                elif isinstance(step, APIError):
                    raise step
                elif isinstance(step, Finish):
                    usage = {"prompt_tokens": len(prepared.prompt_ids), "cached_tokens": self.cached_tokens,
                             **step.usage}
                    usage["total_tokens"] = usage["prompt_tokens"] + usage.get("completion_tokens", 0)
                    yield Finish(step.finish_reason, usage, {}, step.matched_stop)
                elif isinstance(step, ToolCallStart):
                    yield ToolCallStart(step.index, prefix + step.id, step.name)
                else:
                    yield step
        finally:
            self.closed.append(prepared.request_id)
            self.closed_event.set()


def _pieces(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


def script(reasoning: str = "", content: str = "", calls: tuple[tuple[str, str], ...] = (), finish: str = "stop",
           matched: str | None = None, chunk: int = 4) -> list[Any]:
    """Deltas for reasoning, then content, then tool calls (name, arguments JSON), then a Finish whose
    completion_tokens is a token per chunk (reasoning_tokens those of the reasoning)."""
    out: list[Any] = [ReasoningDelta(p) for p in _pieces(reasoning, chunk)]
    out += [ContentDelta(p) for p in _pieces(content, chunk)]
    for i, (name, args) in enumerate(calls):
        out.append(ToolCallStart(i, f"{i}{secrets.token_hex(4)}", name))
        out += [ToolCallArgs(i, p) for p in _pieces(args, 5)]
        out.append(ToolCallEnd(i))
    n_reason = len(_pieces(reasoning, chunk))
    usage = {"completion_tokens": len(out) + 1, "reasoning_tokens": n_reason}
    if finish == "tool_calls" or (calls and finish == "stop"):
        finish = "tool_calls"
    out.append(Finish(finish, usage, {}, matched))
    return out


@contextlib.contextmanager
def serve(app, lifespan: str = "off") -> Iterator[str]:
    """Run `app` under uvicorn on a free local port in a thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def sse_events(lines: Iterator[str]) -> list[tuple[str | None, Any]]:
    """Parse SSE lines into [(event name, JSON data)]; comment lines come back as (":", text)."""
    out, name, data = [], None, []
    for line in lines:
        if line == "":
            if data:
                text = "\n".join(data)
                out.append((name, text if text == "[DONE]" else json.loads(text)))
            name, data = None, []
        elif line.startswith(":"):
            out.append((":", line[1:].strip()))
        elif line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].lstrip())
    return out


@contextlib.contextmanager
def tiny_app(model_dir) -> Iterator[str]:
    """The real app (server.app.create_app) over a real Service and Engine on a random tiny checkpoint
    written to model_dir, with the demo chat template (tools, thinking); yields the base URL."""
    import os

    from ranks.random_checkpoint import write_random_checkpoint
    from runtime import Engine, EngineOptions
    from runtime.tokenizer import Tokenizer, generation_defaults
    from server.app import create_app
    from server.service import Service

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "scripts", "demo", "chat_template.jinja"), encoding="utf-8") as f:
        template = f.read()
    write_random_checkpoint(model_dir, "tiny", seed=0, dtype="float32", progress=False)
    options = EngineOptions(max_concurrency=4, max_context=1024, prefill_chunk=64, threads_per_rank=1)
    engine = Engine.start(model_dir, tp=1, options=options)
    service = Service(engine, Tokenizer.from_dir(model_dir), "tiny", 1024, generation_defaults(model_dir),
                      chat_template=template)
    try:
        with serve(create_app(service), lifespan="on") as url:
            yield url
    finally:
        service.shutdown()


@contextlib.contextmanager
def demo_app(max_concurrency: int = 4, max_context: int = 4096,
             prefix_cache: int | None = None) -> Iterator[tuple[str, Any]]:
    """The real app over a real Service and Engine on the embedded demo model (tp 1, CPU); yields
    (base URL, service). prefix_cache: the engine's EngineOptions.prefix_cache (None: its default)."""
    from ranks.demo import PACKAGED_DIR
    from runtime import Engine, EngineOptions
    from runtime.tokenizer import Tokenizer, generation_defaults
    from server.app import create_app
    from server.service import Service

    engine = Engine.start(PACKAGED_DIR, tp=1, options=EngineOptions(max_concurrency=max_concurrency,
                                                                     max_context=max_context, threads_per_rank=1,
                                                                     prefix_cache=prefix_cache))
    service = Service(engine, Tokenizer.from_dir(PACKAGED_DIR), "demo", max_context,
                      generation_defaults(PACKAGED_DIR))
    try:
        with serve(create_app(service), lifespan="on") as url:
            yield url, service
    finally:
        service.shutdown()
