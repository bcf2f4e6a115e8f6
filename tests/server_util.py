"""Helpers for the HTTP server tests: a tiny random model, a scripted engine, uvicorn in a thread.

    model_dir = tiny_model_dir()                      # written once per test session
    engine = FakeEngine(tokenizer); engine.script("I think.\\n</think>\\n\\nHello")
    with running(create_app(service)) as base_url: ...

FakeEngine implements the runtime.Engine interface (submit -> RequestStream, cancel, stats, shutdown)
and answers each submit with the next scripted completion, encoded by the model's tokenizer, one token
per event, then <|im_end|> (finish "stop"), or cut at max_new_tokens (finish "length"). With random
weights the real engine's text is noise; the scripted engine is how tests check parsing end to end.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import os
import shutil
import socket
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Iterator

import uvicorn

from runtime.engine import EngineError, Event, RequestStream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_TEMPLATE = os.path.join(ROOT, "scripts", "demo", "chat_template.jinja")
_MODEL_DIR: list[str] = []
_LOCK = threading.Lock()


def tiny_model_dir() -> str:
    """A random `tiny` checkpoint (float32, tokenizer included), written once per process."""
    with _LOCK:
        if not _MODEL_DIR:
            from ranks.random_checkpoint import write_random_checkpoint

            d = tempfile.mkdtemp(prefix="tandem-server-test-")
            atexit.register(shutil.rmtree, d, True)
            write_random_checkpoint(d, "tiny", seed=0, dtype="float32", progress=False)
            _MODEL_DIR.append(d)
        return _MODEL_DIR[0]


def qwen_template() -> str:
    with open(QWEN_TEMPLATE, encoding="utf-8") as f:
        return f.read()


class FakeEngine:
    """The runtime.Engine interface with scripted outputs (see the module doc)."""

    def __init__(self, tokenizer, vocab_size: int = 1024, pages_total: int = 4096):
        self.tokenizer = tokenizer
        self.spec = SimpleNamespace(vocab_size=vocab_size)
        self.outputs: collections.deque = collections.deque()
        self.default = "Hello."
        self.submitted: list[SimpleNamespace] = []
        self.cancelled: list[int] = []
        self.healthy, self.failure, self.shut_down = True, None, False
        self.raise_on_submit: Exception | None = None
        self.pages_total = pages_total
        self.cached_tokens = 0          # prompt tokens a request "took from the prefix cache", as the engine reports them
        self.eos = tokenizer.token_to_id("<|im_end|>")
        self._ids = itertools.count(1)

    def script(self, *outputs: str | list[int]) -> None:
        self.outputs.extend(outputs)

    def submit(self, prompt_ids, params, stop_token_ids=None) -> RequestStream:
        if not self.healthy:
            raise EngineError(f"the engine is not serving: {self.failure}")
        if self.raise_on_submit is not None:
            raise self.raise_on_submit
        out = self.outputs.popleft() if self.outputs else self.default
        ids = (self.tokenizer.encode(out) if isinstance(out, str) else list(out)) + [self.eos]
        finish = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[:params.max_new_tokens], "length"
        stream = RequestStream(next(self._ids))
        self.submitted.append(SimpleNamespace(id=stream.id, prompt_ids=list(prompt_ids), params=params,
                                              stop_token_ids=stop_token_ids, output_ids=ids))
        cached = min(self.cached_tokens, len(prompt_ids) - 1)
        for n, t in enumerate(ids[:-1]):       # the engine's first event carries cached_tokens, as its usage does
            stream._push(Event(stream.id, [t], logprobs=self.logprobs_of(n, t, params),
                               cached_tokens=cached if n == 0 and cached else None))
        stream._push(Event(stream.id, [ids[-1]], finish_reason=finish,
                           usage=dict(prompt_tokens=len(prompt_ids), completion_tokens=len(ids),
                                      **({"cached_tokens": cached} if cached else {})),
                           timings=dict(ttft_s=0.001, total_s=0.002),
                           logprobs=self.logprobs_of(len(ids) - 1, ids[-1], params)))
        return stream

    def logprobs_of(self, n: int, token: int, params) -> list | None:
        """Event.logprobs of output token n (`token`): none here; scripted engines with logprobs override it."""
        return None

    def prompt_text(self, i: int = -1) -> str:
        return self.tokenizer.decode(self.submitted[i].prompt_ids)

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)

    def stats(self) -> dict:
        return dict(healthy=self.healthy, failure=self.failure, tp=1, running=0, waiting=0, slots_used=0,
                    pages_used=0, pages_total=self.pages_total, requests=len(self.submitted), finished=0,
                    cancelled=len(self.cancelled), failed=0, prompt_tokens=0, generated_tokens=0, steps=0)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.shut_down = True


@contextlib.contextmanager
def real_server(context: int, *service_args, **service_kwargs) -> Iterator[SimpleNamespace]:
    """The tiny random checkpoint on a real engine (tp 1, the given context) behind the whole app:
    (url, client: the `openai` SDK on it, tok, service, engine). Extra arguments go to Service after its
    generation defaults (a template, mode_sampling=..., ...)."""
    import openai

    from runtime import Engine, EngineOptions
    from runtime.tokenizer import Tokenizer, generation_defaults
    from server.app import create_app
    from server.service import Service
    d = tiny_model_dir()
    tok = Tokenizer.from_dir(d)
    engine = Engine.start(d, options=EngineOptions(max_concurrency=4, max_context=context, prefill_chunk=128,
                                                   max_step_tokens=256, threads_per_rank=1))
    try:
        service = Service(engine, tok, "tiny", context, generation_defaults(d), *service_args, **service_kwargs)
        with running(create_app(service)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            yield SimpleNamespace(url=url, client=client, tok=tok, service=service, engine=engine)
    finally:
        engine.shutdown()


@contextlib.contextmanager
def running(app, *, graceful_s: int = 2) -> Iterator[str]:
    """Serve `app` (lifespan on) with uvicorn on a free loopback port in a thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning",
                                           timeout_graceful_shutdown=graceful_s, h11_max_incomplete_event_size=256 << 10))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.01):
    """Poll until predicate() is truthy (returns its value) or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
