"""CUDA graphs of decode and verification steps.

A step is graphable when every sequence has the same number of columns T (1 for decode, K+1 for
a speculation round's verification, which keeps its per-column GDN states in the model's shared
buffers) and the model's all-reduce runs on the stream. Graphs are keyed by (batch size B, T,
page-table width P rounded up to a power of two, logits mode, state, verification or not): the
first step of a key runs eagerly with the graph's metadata shapes (loading every kernel the graph
will launch, creating library handles), the second is
captured and every later one only copies its metadata (ids, positions, slots, page tables: one
int32 buffer) into the graph's static input and replays it: no Python per layer. All graphs share
one memory pool; their outputs stay valid until the next step of the same key. At most `max_graphs`
are kept: capturing one more retires the least recently replayed. Graphs hold raw pointers into
one ModelState: a step on another state retires them all.

`run_keyed` is the same machinery for any program of device ops over one metadata buffer: a whole
greedy speculation round (ranks/spec_cuda.py) is captured through it, keyed apart from the steps.

`--no-cuda-graph` (EngineOptions.cuda_graphs = False) runs every step eagerly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ranks.model import Batch, StepOutput
from runtime.config import PAGE_SIZE as PAGE_TOKENS

Tensor = torch.Tensor

log = logging.getLogger(__name__)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    storage: torch.Tensor          # static metadata input (int32)
    out: Any                       # the program's outputs (a StepOutput for decode and verification)
    replays: int = 0


class GraphRunner:
    def __init__(self, model, max_graphs: int = 96):
        self.model = model
        self.max_graphs = max_graphs
        self.pool = torch.cuda.graph_pool_handle()
        # warm-up steps and captures run on one side stream (the torch recipe: libraries such as
        # cuBLAS set up per-stream state on first use, which must not happen during a capture)
        self.stream = torch.cuda.Stream(device=model.device)
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()      # least recently replayed first
        self.state = None                  # the state the graphs write into (kept alive with them)
        self.seen: set[tuple] = set()
        self.failed: set[tuple] = set()
        self.captures = 0
        self.replays = 0

    def key(self, batch: Batch, state, logits: str, keep: bool = False) -> tuple | None:
        from ranks.model_cuda import pages_needed, pow2
        T = batch.columns[0]
        if any(c != T for c in batch.columns):
            return None
        return (len(batch.columns), T, pow2(pages_needed(batch)), logits, id(state), keep)

    def run(self, batch: Batch, state, logits: str, keep: bool = False,
            feed: tuple[Tensor, Tensor] | None = None) -> StepOutput | None:
        """Replay (capturing first if due) the graph of this batch's key, or run the step eagerly the
        first time a key is seen; None = not graphable (the caller runs it). keep: a verification
        step (the output's KeptColumns is the template: forward fills in the sequences). feed:
        (columns, ids) on the device, written over the uploaded ids (CudaHybridModel.forward)."""
        from ranks.model_cuda import DeviceBatch, apply_feed
        key = self.key(batch, state, logits, keep)
        if key is None:
            return None
        B, T, P = key[0], key[1], key[2]

        def upload(storage: Tensor | None) -> Tensor:
            storage = self.model.device_batch(batch, P, storage=storage).storage
            apply_feed(storage, feed)
            return storage
        out = self.run_keyed(
            key, state, DeviceBatch.words(B, B * T, P), upload,
            lambda storage: self.model.fast_forward(DeviceBatch.on(storage, B, B * T, P, P * PAGE_TOKENS), state,
                                                    logits, keep_T=T if keep else None))
        return None if out is None else StepOutput(out.hidden, out.logits, out.kept)

    def run_keyed(self, key: tuple, state, words: int, upload: Callable[[Tensor | None], Tensor],
                  program: Callable[[Tensor], Any]) -> Any:
        """The graph machinery for any program of device ops over one int32 metadata buffer:
        upload(storage) copies this call's metadata into `storage` (None: a new buffer) and returns
        it; program(storage) enqueues the work and returns its outputs (tensors that a replay
        rewrites). The first call of a key runs eagerly, the second captures, later ones upload and
        replay. None = the key failed to capture before (the caller runs it eagerly)."""
        if state is not self.state:
            # graphs hold raw pointers into one state's pools and slots: a new state (a new
            # LocalGenerator request, a test) retires every graph of the old one
            self.graphs.clear()
            self.seen.clear()
            self.failed.clear()
            self.state = state
        if key in self.failed:
            return None
        cap = self.graphs.get(key)
        if cap is None:
            if key not in self.seen:
                # eager, on the capture stream and with the graph's metadata shapes: the same kernels
                # (attention splits included) get loaded now, since loading one during a capture
                # invalidates it
                self.seen.add(key)
                storage = upload(None)
                return self._on_side(lambda: program(storage))
            while len(self.graphs) >= self.max_graphs:   # bounded: retire the least recently replayed
                self.graphs.popitem(last=False)
            try:
                cap = self._capture(key, words, program)
            except Exception:                        # noqa: BLE001 - a capture failure costs speed, not the step
                log.warning("CUDA graph capture failed for %s; that shape runs eagerly", key, exc_info=True)
                self.failed.add(key)
                torch.cuda.synchronize(self.model.device)
                return None
        self.graphs.move_to_end(key)
        upload(cap.storage)
        cap.graph.replay()
        cap.replays += 1
        self.replays += 1
        return cap.out

    def _on_side(self, fn):
        cur = torch.cuda.current_stream(self.model.device)
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            out = fn()
        cur.wait_stream(self.stream)
        return out

    def _capture(self, key: tuple, words: int, program: Callable[[Tensor], Any]) -> Captured:
        m = self.model
        storage = torch.zeros(words, dtype=torch.int32, device=m.device)
        torch.cuda.synchronize(m.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="relaxed"):
            out = program(storage)
        cap = Captured(graph, storage, out)
        self.graphs[key] = cap
        self.captures += 1
        log.debug("captured a CUDA graph for %s (%d graphs)", key, len(self.graphs))
        return cap
