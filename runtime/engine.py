"""runtime.Engine: the one Python API of the serving runtime.

    engine = Engine.start(model_dir, tp=2)
    stream = engine.submit(prompt_ids, SamplingParams(temperature=0))
    for event in stream: ...            # or: async for event in stream
    engine.cancel(stream.id); engine.stats(); engine.shutdown()

The engine runs the coordinator loop in a thread of the calling process and one rank process per
device; requests and cancellations reach the loop through a queue, events come back through each
request's stream (usable from threads and from asyncio).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine cannot serve (a rank failed, or it was shut down)."""


# Columns per step when EngineOptions leaves them unset. The GPU's matmuls want long prefill chunks
# (27B bf16, an 8 192-token prompt on one H200: 1.14 s in 256-column steps, 0.91 s in 512, 0.85 s in
# 1 024, 0.82 s in 2 048; docs/perf.md), and a step then holds a whole chunk beside a decode column of
# every running sequence; the CPU's reference program gains nothing past a few hundred columns.
CUDA_PREFILL_CHUNK = 2048
CPU_PREFILL_CHUNK = 256
CPU_MAX_STEP_TOKENS = 1024


def step_sizes(device: str, max_concurrency: int, prefill_chunk: int | None = None,
               max_step_tokens: int | None = None) -> tuple[int, int]:
    """(prefill_chunk, max_step_tokens): the given values, or the device's defaults; the step budget is
    at least max_concurrency (every running sequence decodes in each step)."""
    cuda = str(device).startswith("cuda")
    chunk = prefill_chunk or (CUDA_PREFILL_CHUNK if cuda else CPU_PREFILL_CHUNK)
    step = max_step_tokens or (chunk + max_concurrency if cuda else CPU_MAX_STEP_TOKENS)
    return chunk, max(step, max_concurrency)


MAX_CONCURRENCY = 4096                   # sequences at once: each holds a GDN state slot on every rank
                                         # (also the most prefix-cache entries: a snapshot slot each)


@dataclass(frozen=True)
class EngineOptions:
    """Knobs of the runtime; the CLI's flags are kebab-case versions of these names."""
    max_concurrency: int = 8
    max_pending: int = 256
    pending_timeout_s: float = 600.0
    prefill_chunk: int | None = None     # prefill columns per sequence per step; None: by device (step_sizes)
    max_step_tokens: int | None = None   # columns per step, all sequences; None: by device (step_sizes)
    max_context: int | None = None       # default: min(model's max_position_embeddings, 8192)
    kv_capacity: int | None = None       # tokens of KV in the pool; default: max_concurrency sequences of
                                         # max_context tokens (whole pages, plus speculation's 2K slack each)
    startup_timeout_s: float = 600.0
    heartbeat_timeout_s: float = 10.0
    mailbox_timeout_s: float = 60.0
    threads_per_rank: int | None = None  # torch threads per rank process; default 1 (see docs/perf.md)
    log_level: str = "WARNING"
    spec_draft_tokens: int = 0           # MTP speculation: drafts per round, 1..5 (0 = off, the default)
    spec_draft_vocab: int = 0            # drafts only among token ids below this (a reduced proposal head; 0 = all)
    prefix_cache: int | None = None      # prompt-prefix cache entries (runtime/prefix_cache.py; one GDN state
                                         # snapshot each on every rank); None: max_concurrency; 0: off
    snapshot_in_step: bool = True        # prefix cache: a frontier inside a prefill chunk of more than 16
                                         # columns is saved mid-step (Batch.saves); False: the chunk ends
                                         # there and the rest of the prompt takes a step of its own
    backend: str = "auto"                # "auto" (CUDA kernels for bfloat16 on cuda where they take the model's
                                         # shapes, else the reference backend: ranks.backend.resolve_backend),
                                         # "cuda", "reference"
    weights: str = "bf16"                # weight format on the device: bf16 | fp8 | fp8-block | nvfp4
    kv_dtype: str = "bf16"               # KV cache: bf16 (the activation dtype) | int8 (+ fp32 scale per 64 channels)
    cuda_graphs: bool = True             # capture decode steps as CUDA graphs (cuda backend)
    overlap_steps: bool = True           # plan the next decode step while one runs (one step queued ahead)
    device_feed: bool | None = None      # tokens chosen on the device feed the next step, launched before they
                                         # reach the host (ranks/worker.py); pays with overlap_steps. None: on for
                                         # the cuda backend at tp 1 (measured: docs/perf.md), off otherwise
    random_weights: bool = False         # build random weights on the device from config.json alone
    transport: str = "auto"              # tp > 1 all-reduce on GPUs: auto | mailbox | copies | nccl | cpu
    gpu_mailbox_words: int = 1 << 18     # words per slot of the GPU mailbox (one word per element)
    # TEST-ONLY: called by the coordinator as hook(sequence, drafts) -> drafts after each round, to
    # force drafts right or wrong (tests/test_speculation.py); never set it in production
    spec_draft_hook: Callable | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"max_concurrency must be 1..{MAX_CONCURRENCY}, got {self.max_concurrency}")
        if not 0 <= self.spec_draft_tokens <= 5:
            raise ValueError(f"spec_draft_tokens must be 0 (off) or 1..5, got {self.spec_draft_tokens}")
        if self.prefix_cache is not None and not 0 <= self.prefix_cache <= MAX_CONCURRENCY:
            raise ValueError(f"prefix_cache must be 0..{MAX_CONCURRENCY} (0 = off), got {self.prefix_cache}")
        if self.spec_draft_vocab < 0:
            raise ValueError(f"spec_draft_vocab must be >= 0 (0 = the whole vocabulary), got {self.spec_draft_vocab}")
        if self.backend not in ("auto", "cuda", "reference"):
            raise ValueError(f"backend must be auto, cuda or reference, got {self.backend!r}")
        if self.transport not in ("auto", "mailbox", "copies", "nccl", "cpu"):
            raise ValueError(f"transport must be auto, mailbox, copies, nccl or cpu, got {self.transport!r}")
        if self.weights not in ("bf16", "fp8", "fp8-block", "nvfp4"):
            raise ValueError(f"weights must be bf16, fp8, fp8-block or nvfp4, got {self.weights!r}")
        if self.kv_dtype not in ("bf16", "int8"):
            raise ValueError(f"kv_dtype must be bf16 or int8, got {self.kv_dtype!r}")


@dataclass
class Event:
    """One piece of a request's output. The last event has `finish_reason` (or `error`)."""
    request_id: int
    tokens: list[int]
    finish_reason: str | None = None     # "stop" | "length" | "cancelled" | None
    error: str | None = None
    usage: dict | None = None            # prompt_tokens, completion_tokens (last event)
    timings: dict | None = None          # ttft_s, total_s (last event)
    spec: dict | None = None             # speculation statistics (last event, when speculation ran):
                                         # rounds, drafted, accepted, accepted_hist [K+1],
                                         # position_drafted [K], position_accepted [K], tokens_per_round
    # SamplingParams.logprobs set: one entry per token of `tokens`: [logprob, [[id, logprob], ...]] (the
    # token's log-probability under the model's raw distribution and the k most likely ids), or None
    # for a token inserted without sampling (a thinking budget's closing tokens)
    logprobs: list | None = None
    # SamplingParams.prompt_logprobs set: entries of prompt positions 1, 2, ... (the same shape), arriving
    # with the event of the first generated token (all of them, whatever the prefill's chunks)
    prompt_logprobs: list | None = None
    # prompt tokens taken from the prefix cache, on the event of the first generated tokens when that is
    # not the last one (whose usage has them, as cached_tokens): a consumer that stops reading before the
    # last event (at a stop string) still knows them
    cached_tokens: int | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Completion:
    request_id: int
    tokens: list[int]
    finish_reason: str | None
    error: str | None
    usage: dict | None
    timings: dict | None
    spec: dict | None = None
    logprobs: list | None = None       # SamplingParams.logprobs set: one entry per token (Event.logprobs)
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs set: prompt positions 1.. (Event)


class RequestStream:
    """Events of one request, in order; iterate synchronously or with `async for`."""

    def __init__(self, request_id: int):
        self.id = request_id
        self._events: collections.deque[Event] = collections.deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.closed = False

    def _push(self, event: Event) -> None:
        with self._cond:
            self._events.append(event)
            self.closed = self.closed or event.final
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:                        # that loop is closed
                pass

    def get(self, timeout: float | None = None) -> Event:
        with self._cond:
            if not self._cond.wait_for(lambda: self._events, timeout=timeout):
                raise TimeoutError(f"no event for request {self.id} within {timeout} s")
            return self._events.popleft()

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self.get()
            yield ev
            if ev.final:
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for batch in self.batches():
            for ev in batch:
                yield ev

    async def batches(self) -> AsyncIterator[list[Event]]:
        """The events in order, as `async for` gives them, but each pass takes every event queued by then
        (one or more; the final event ends the last list): a consumer that fell behind the engine catches
        up in one pass instead of one wake-up per event."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, wake))
        try:
            while True:
                with self._cond:
                    batch = list(self._events)
                    self._events.clear()
                    if not batch:
                        wake.clear()
                if not batch:
                    await wake.wait()
                    continue
                for n, ev in enumerate(batch):
                    if ev.final:                        # nothing comes after a final event
                        del batch[n + 1:]
                        break
                yield batch
                if batch[-1].final:
                    return
        finally:
            with self._cond:
                self._waiters.remove((loop, wake))

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request ends; all its tokens and how it ended."""
        tokens: list[int] = []
        logprobs: list | None = None
        prompt: list | None = None
        while True:
            ev = self.get(timeout)
            tokens.extend(ev.tokens)
            if ev.logprobs is not None:
                logprobs = (logprobs or []) + list(ev.logprobs)
            if ev.prompt_logprobs is not None:
                prompt = (prompt or []) + list(ev.prompt_logprobs)
            if ev.final:
                return Completion(self.id, tokens, ev.finish_reason, ev.error, ev.usage, ev.timings, ev.spec,
                                  logprobs, prompt)


class Engine:
    """Starts the coordinator and its rank processes; thread-safe submit / cancel / stats."""

    def __init__(self, model_dir: str | os.PathLike, *, tp: int = 1, device: str = "cpu", dtype: str = "float32",
                 options: EngineOptions | None = None,
                 on_load_progress: Callable[[int, int], None] | None = None):
        from runtime.coordinator import Coordinator       # keeps `import runtime` light

        self.options = options or EngineOptions()
        self._coordinator = Coordinator(os.fspath(model_dir), tp=tp, device=device, dtype=dtype,
                                        options=self.options, on_load_progress=on_load_progress)
        self._ids = itertools.count(1)

    @classmethod
    def start(cls, model_dir: str | os.PathLike, *, tp: int = 1, device: str = "cpu", dtype: str = "float32",
              options: EngineOptions | None = None,
              on_load_progress: Callable[[int, int], None] | None = None) -> "Engine":
        """Spawn the ranks, wait until every one has loaded its shard, start the step loop.
        on_load_progress(done, total): the weight bytes the ranks have loaded so far and their total,
        summed over the ranks, from the thread that starts the engine, as the ranks report them
        (about every half second per rank, and once when each is done)."""
        engine = cls(model_dir, tp=tp, device=device, dtype=dtype, options=options,
                     on_load_progress=on_load_progress)
        engine._coordinator.start()
        return engine

    @property
    def spec(self):
        return self._coordinator.spec

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None,
               stop_token_ids: frozenset[int] | set[int] | None = None) -> RequestStream:
        """Queue a request; raise ValueError for bad input, Overloaded when the queue is full,
        EngineError when the engine is down. EOS ids of the model are stop ids unless ignore_eos."""
        params = params or SamplingParams()
        stream = RequestStream(next(self._ids))
        self._coordinator.submit(stream, list(prompt_ids), params, frozenset(stop_token_ids or ()))
        return stream

    def cancel(self, request_id: int) -> None:
        self._coordinator.cancel(request_id)

    def stats(self) -> dict:
        return self._coordinator.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._coordinator.shutdown(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):  # pragma: no cover - best effort if the owner forgot
        try:
            self._coordinator.shutdown(2.0)
        except Exception:
            pass

