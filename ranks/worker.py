"""Rank process: holds one weight shard and its state, executes StepPlans, reports StepResults.

    python -m ranks.worker --connect ipc:///tmp/tandem-XXXX/ctl --rank R

The rank connects a DEALER socket to the coordinator's ROUTER, says it is alive, receives Hello
(what to load), answers Ready, then executes plans in order. Rank 0 reports sampled tokens; every
rank stays in lockstep through the mailbox exchanges inside the forward. A failure is reported as
an Error message (step id and reason) before the process exits non-zero. A heartbeat thread with
its own socket reports liveness and ends the process if the coordinator's process goes away, so no
rank outlives its coordinator.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import zmq

from ranks.kvcache import ModelState
from ranks.model import Batch, HybridModel
from ranks.sampler import (SeqSampler, _nan_row, accept_greedy, accept_sampled, argmax_rows, gather_log_probs,
                           local_candidates, merge_on_device, sample_rows, take_rows, token_logprobs, with_tokens)
from ranks.backend import resolve_backend
from ranks.checkpoint_quant import quantised_conflict
from ranks.random_checkpoint import random_shard
from ranks.sharding import load_shard
from ranks.weights import Checkpoint, validate
from runtime.config import load_spec
from transport import control as msg
from transport.mailbox import Mailbox

log = logging.getLogger(__name__)
PROMPT_LOGPROB_ROWS = 256      # prompt columns per head launch for prompt logprobs (bounds the logits' memory)


@dataclass
class _Pending:
    """A step whose tokens were chosen on the device and are still on their way to the host."""
    plan: msg.StepPlan
    seq_ids: list[int]
    rows: list[int]                     # the batch rows it sampled
    ids: torch.Tensor                   # int64 [R] on the model's device: what a fed step takes
    host: torch.Tensor                  # float32 [R, 2] (score, id): pinned on a GPU, filled by the copy
    ready: "torch.cuda.Event | None"    # recorded after the copy (None on the CPU: nothing is pending)
    launch_s: float                     # host seconds from the plan to the step's launch
    fed: bool                           # its own inputs came from the device


class Worker:
    def __init__(self, hello: msg.Hello, progress: Callable[[int, int], None] | None = None):
        """Load this rank's shard and build its model; progress(done, total) hears the weight bytes
        loaded so far (load_shard's)."""
        self.rank, self.tp = hello.rank, hello.tp
        threads = max(1, int(hello.options.get("threads_per_rank", 1)))
        torch.set_num_threads(threads)
        self.spec = load_spec(hello.model_dir)
        opts = hello.options
        dtype = getattr(torch, hello.dtype)
        # "cuda" means one device per rank: rank r uses the r-th visible GPU
        device = f"cuda:{self.rank}" if hello.device == "cuda" else hello.device
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
            # loading is CPU work while the GPU waits (reading and checking the shard: an fp8 checkpoint's
            # NaN scan ran 1.5x faster on two threads than on one): this rank's share of the cores, up
            # to 8, until the model is built; the steps' host work is back on `threads` after
            torch.set_num_threads(max(threads, min(8, len(os.sched_getaffinity(0)) // self.tp)))
        # tandem generate / serve resolved auto before spawning (ranks get "cuda" or "reference"); this for
        # Engine users: the model's shapes decide between them as there (ranks.backend.resolve_backend)
        backend = resolve_backend(self.spec, opts.get("backend", "auto"), device, dtype, tp=self.tp,
                                  weights=opts.get("weights", "bf16"), kv_dtype=opts.get("kv_dtype", "bf16"))
        self.backend, self.weight_format = backend, opts.get("weights", "bf16")
        if opts.get("random_weights"):
            weights = random_shard(self.spec, self.rank, self.tp, dtype=dtype, device=device, progress=progress)
        else:
            ckpt = Checkpoint(hello.model_dir)
            layout = validate(ckpt, self.spec)
            if layout.quantised:
                problem = quantised_conflict(self.spec, self.weight_format)
                if problem:
                    raise ValueError(problem)
                self.weight_format = f"{self.spec.quantization} (checkpoint)"
            weights = load_shard(ckpt, self.spec, self.rank, self.tp, dtype=dtype, device=device, layout=layout,
                                 keep_quantised=backend == "cuda", progress=progress)
        timeout_s = float(opts.get("mailbox_timeout_s", 60))
        self.mailbox = Mailbox(hello.mailbox, self.rank, timeout_s=timeout_s)
        self.transport = None
        if backend == "cuda":
            from ranks.model_cuda import CudaHybridModel
            from transport.select import choose
            kind = opts.get("transport", "auto")
            self.transport = choose(kind, self.rank, self.tp, torch.cuda.current_device(), self.mailbox,
                                    opts.get("gpu_mailbox"), opts.get("nccl_init"), timeout_s)
            # a pre-quantised checkpoint's weights arrive quantised: "bf16" quantises nothing more
            self.model = CudaHybridModel(self.spec, weights, tp=self.tp, all_reduce=self.transport.all_reduce,
                                         weight_format=opts.get("weights", "bf16"),
                                         cuda_graphs=bool(opts.get("cuda_graphs", True)),
                                         all_reduce_capturable=self.transport.capturable)
        else:
            self.model = HybridModel(self.spec, weights, tp=self.tp, all_reduce=self.mailbox.all_reduce)
        torch.set_num_threads(threads)
        self.kv_dtype = opts.get("kv_dtype", "bf16")
        self.state: ModelState = self.model.new_state(hello.num_slots, hello.num_pages, kv_dtype=self.kv_dtype)
        if int(opts.get("prefix_snapshots", 0) or 0):
            self.state.reserve_snapshots(int(opts["prefix_snapshots"]))
        self.samplers: dict[int, SeqSampler] = {}
        self.masked: list[int] = []          # sequences whose sampler holds a grammar mask (_set_masks)
        self.last_sampled: dict[int, int] = {}            # per sequence, its token sampled last (steps planned ahead)
        # device-fed steps (submit). Unset: on for the cuda backend at tp 1, where it was measured (the 27B
        # nvfp4 engine step 10.2 -> 9.1 ms, docs/perf.md); tp > 1 waits for its two-GPU run, and the CPU
        # runs nothing ahead, so there it would only add work. Only with an all-reduce that runs on the
        # stream: the staged copies sync the stream anyway, so the merge there would cost an exchange and
        # gain nothing (every rank chose the same transport: choose() votes)
        feed = opts.get("device_feed")
        self.device_feed = bool(feed) if feed is not None else (self.backend == "cuda" and self.tp == 1)
        if self.device_feed and self.transport is not None and not self.transport.capturable:
            log.warning("rank %d: device-fed steps are off: the %s transport synchronises the stream",
                        self.rank, self.transport.name)
            self.device_feed = False
        self.pending: _Pending | None = None
        self.spec_k = int(hello.options.get("spec_draft_tokens", 0) or 0)
        # the reduced proposal head: drafts only among token ids below this (0 = the whole vocabulary)
        from ranks.spec_cuda import draft_head_rows
        self.draft_rows = draft_head_rows(int(hello.options.get("spec_draft_vocab", 0) or 0), self.rank,
                                          self.model.head.shape[0])
        self._phases = np.zeros(4)                       # host seconds per speculation phase, summed
        self._phase_rounds = 0
        if self.spec_k and not self.model.has_mtp:
            raise ValueError(f"speculation (spec_draft_tokens {self.spec_k}) needs MTP weights; "
                             f"{hello.model_dir} has none")
        self.keep_bytes = 0
        if self.spec_k and hasattr(self.model, "reserve_verification"):
            # per-column GDN states of a verification step, for every slot: allocated once, up front
            self.keep_bytes = self.model.reserve_verification(hello.num_slots * (self.spec_k + 1))
        self.stops: dict[int, frozenset[int]] = {}
        self.profiler: StepProfiler | None = None          # diagnostics (TANDEM_PROFILE_DIR)
        # greedy rounds as one GPU program (ranks/spec_cuda.py); TANDEM_SPEC_GPU_ROUNDS=0 keeps every
        # round on the eager path (for comparisons)
        self.gpu_rounds = None
        if self.spec_k and backend == "cuda" and os.environ.get("TANDEM_SPEC_GPU_ROUNDS", "1") != "0":
            from ranks.spec_cuda import GpuRounds
            self.gpu_rounds = GpuRounds(self.model, self.spec_k, self.rank, self.tp, self.draft_rows)
        self._gpu_round_s = np.zeros(2)                  # host seconds of GPU rounds: launch, wait
        if backend == "cuda":
            from ranks.model_cuda import weight_bytes
            self.weight_bytes = weight_bytes(self.model.w)
        else:
            self.weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    def ready(self) -> msg.Ready:
        shard = {k: list(self.model.w[k].shape) for k in ("embed_tokens.weight", "lm_head.weight")
                 if k in self.model.w}
        runtime = dict(backend=self.backend, weights=self.weight_format, kv_dtype=self.kv_dtype)
        if self.transport is not None:
            runtime.update(transport=self.transport.name, probe_us=self.transport.probe_us)
        if getattr(self.model, "graphs", None) is not None:
            runtime["cuda_graphs"] = True
        if self.spec_k:
            runtime["spec_rounds"] = "gpu" if self.gpu_rounds is not None else "eager"
        runtime["device_feed"] = self.device_feed
        if self.backend == "cuda":                       # what a decode step reads here (benchmark floors)
            from ranks.model_cuda import step_byte_parts
            try:
                runtime["step_bytes"] = step_byte_parts(self.model, self.spec, self.kv_dtype)
            except Exception as e:                       # noqa: BLE001 - a statistic, never a reason to fail
                log.warning("rank %d: no step byte count (%s: %s)", self.rank, type(e).__name__, e)
        return msg.Ready(rank=self.rank, ok=True, pid=os.getpid(), shard=shard, weight_bytes=self.weight_bytes,
                         runtime=runtime,
                         state_bytes=self.state.nbytes() + self.keep_bytes, has_mtp=self.model.has_mtp)

    def _fill_last_sampled(self, step: int, seq_ids: list[int], columns: list[int], tokens: np.ndarray) -> None:
        """A step planned ahead (runtime.scheduler.LAST_SAMPLED): each -1 token is the one this rank
        sampled for that sequence in its previous step."""
        at = 0
        for sid, c in zip(seq_ids, columns):
            for i in range(at, at + c):
                if tokens[i] < 0:
                    t = self.last_sampled.get(sid)
                    if t is None:
                        raise msg.ProtocolError(f"step {step}: sequence {sid} is fed its last sampled token, "
                                                "but it sampled none here")
                    tokens[i] = t
            at += c

    def step(self, plan: msg.StepPlan) -> msg.StepResult | None:
        """One step from start to finish: its result (rank 0), None on the other ranks."""
        results = self.submit(plan) + self.flush()
        return results[-1] if results else None

    def submit(self, plan: msg.StepPlan) -> list[msg.StepResult]:
        """Start a step; returns the results (rank 0) of the steps that finished meanwhile, oldest first.

        Device-fed steps (`device_feed`, EngineOptions.device_feed): when no sampled row of the step
        needs the whole distribution (greedy, or temperature alone, penalties or not), its tokens are
        chosen on the device (candidates per vocabulary shard, merged by one all-reduce) and the step
        is left pending: the host copy of its tokens arrives in the background. When the next plan,
        planned ahead, feeds those tokens (LAST_SAMPLED), its inputs are taken from the device and
        it is launched before this one's tokens reach the host; the pending step is finished after
        that launch, so the GPU runs the two back to back. `flush` finishes a pending step."""
        for snap, slot in plan.snapshot_loads:          # prefix cache: before anything reads the slots
            self.state.load_snapshot(int(snap), int(slot))
        if self.spec_k:
            done = self.flush()
            r = self.spec_step(plan)
            self._save_snapshots(plan)
            return done + ([r] if r is not None else [])
        t0 = time.perf_counter()
        self._new_samplers(plan)
        self._set_masks(plan)
        seq_ids = plan.seq_ids.tolist()
        columns, starts = plan.columns.tolist(), plan.starts.tolist()
        tokens = plan.token_ids.astype(np.int64)
        last_fed = tokens.size > 0 and tokens.min() < 0
        feed = self._feed(seq_ids, columns, tokens) if last_fed else None
        done: list[msg.StepResult] = []
        if feed is None:
            done = self.flush()
            if last_fed:
                self._fill_last_sampled(plan.step, seq_ids, columns, tokens)
        batch_tokens = torch.from_numpy(np.maximum(tokens, 0))    # fed columns: overwritten from the device
        batch = Batch(batch_tokens, columns, starts, plan.slots.tolist(),
                      torch.from_numpy(plan.page_tables.astype(np.int32)), self._split_saves(plan)[0])
        if self.profiler is not None:
            self.profiler.mark("prepared")
        if feed is None:
            out = self.model.forward(batch, self.state, logits="last")
        elif self.backend == "cuda":
            out = self.model.forward(batch, self.state, logits="last", feed=feed)
        else:                                           # the CPU runs nothing ahead: patch the inputs
            batch_tokens.index_copy_(0, feed[0], feed[1])
            out = self.model.forward(batch, self.state, logits="last")
        self._save_snapshots(plan)                      # after the forward, on its stream
        if self.profiler is not None:
            self.profiler.mark("launched")
        if feed is not None:                            # the previous step's tokens, while this one runs
            done = self.flush(mark="previous sampled")
            self._fill_last_sampled(plan.step, seq_ids, columns, tokens)
        at = 0
        for sid, c, s in zip(seq_ids, columns, starts):
            self.samplers[sid].observe(tokens[at:at + c].tolist(), s)
            at += c
        if self.transport is not None:
            self.transport.check()                      # a peer's hang shows here, not as garbage
        prompt_lp = self._prompt_logprobs(plan, out.hidden, seq_ids, columns, starts, tokens)
        rows = [b for b, flag in enumerate(plan.sample.tolist()) if flag]
        smp = [self.samplers[seq_ids[b]] for b in rows]
        positions = [starts[b] + columns[b] for b in rows]
        # decode-sized steps only: a long prefill chunk would leave the rank spinning for its whole length
        if rows and self.device_feed and self.model_feeds(columns) and prompt_lp is None \
                and not any(s.needs_full_distribution or s.logprobs >= 0 for s in smp):
            self._pend(plan, seq_ids, rows, take_rows(out.logits, rows).float(), smp, positions, t0,
                       feed is not None)
            return done
        sampled: list[int] = []
        logprobs = None
        if rows:
            sampled = sample_rows(take_rows(out.logits, rows).float(), smp, positions, rank=self.rank, tp=self.tp,
                                  gather=self.mailbox.all_gather)
            want = [j for j, s in enumerate(smp) if s.logprobs >= 0]
            if want:
                got = token_logprobs(take_rows(out.logits, [rows[j] for j in want]).float(),
                                     [sampled[j] for j in want], [smp[j].logprobs for j in want],
                                     rank=self.rank, tp=self.tp, gather=self.mailbox.all_gather)
                logprobs = [None] * len(rows)
                for j, e in zip(want, got):
                    logprobs[j] = e
        if self.profiler is not None:
            self.profiler.mark("sampled")
        result = self._finish_step(plan, seq_ids, rows, sampled, t0, feed is not None, logprobs, prompt_lp)
        return done + ([result] if result is not None else [])

    def _new_samplers(self, plan: msg.StepPlan) -> None:
        """Samplers of the sequences admitted in this plan; one started on a cached prefix counts the
        cached prompt tokens (plan.prompt_tokens) as if they had been fed."""
        for sid, fields in plan.new_sampling.items():
            self.samplers[int(sid)] = SeqSampler(**fields)
        for sid, ids in plan.prompt_tokens.items():
            self.samplers[int(sid)].observe(np.asarray(ids).tolist(), 0)

    @staticmethod
    def _split_saves(plan: msg.StepPlan) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """The plan's snapshot saves: those inside a sequence's columns as Batch.saves (b, u, snap),
        and those at the end of its columns as (slot, snap), made after the forward."""
        if not plan.snapshot_saves:
            return [], []
        slots, columns = plan.slots.tolist(), plan.columns.tolist()
        inside, after = [], []
        for slot, snap, u in plan.snapshot_saves:
            b = slots.index(int(slot))
            if int(u) < columns[b]:
                inside.append((b, int(u), int(snap)))
            else:
                after.append((int(slot), int(snap)))
        return inside, after

    def _save_snapshots(self, plan: msg.StepPlan) -> None:
        for slot, snap in self._split_saves(plan)[1]:
            self.state.save_snapshot(slot, snap)

    def _set_masks(self, plan: msg.StepPlan) -> None:
        """Structured outputs: each constrained sequence's allowed ids for the token it samples in this
        step (a mask holds for one step; samplers without one in the plan have none)."""
        for sid in self.masked:
            s = self.samplers.get(sid)
            if s is not None:
                s.allow = None
        self.masked = [int(sid) for sid in (plan.masks or {})]
        for sid, m in (plan.masks or {}).items():
            self.samplers[int(sid)].allow = bytes(m)

    def _finish_step(self, plan: msg.StepPlan, seq_ids: list[int], rows: list[int], sampled: list[int],
                     t0: float, fed: bool, logprobs: list | None = None,
                     prompt_logprobs: dict | None = None) -> msg.StepResult | None:
        for b, t in zip(rows, sampled):                 # what a step planned ahead feeds (every rank)
            self.last_sampled[seq_ids[b]] = t
        for sid in plan.finished:
            self.samplers.pop(int(sid), None)
            self.last_sampled.pop(int(sid), None)
        if self.rank != 0:
            return None
        return msg.StepResult(step=plan.step, seq_ids=np.array([seq_ids[b] for b in rows], dtype=np.int64),
                              tokens=np.array(sampled, dtype=np.int64), elapsed_s=time.perf_counter() - t0,
                              fed=fed, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(self, plan: msg.StepPlan, hidden: torch.Tensor, seq_ids: list[int], columns: list[int],
                         starts: list[int], tokens: np.ndarray) -> dict | None:
        """The prompt logprob entries of this step's prompt columns, for the sequences that asked: column
        i of a chunk predicts the prompt token at its position + 1 (the chunk's next input, or for its
        last column StepPlan.prompt_next; a column that predicts the first sampled token is left to the
        sampled token's own entry). The head runs on those columns only, PROMPT_LOGPROB_ROWS at a time.
        None when no sequence asked. Collective (every rank has the same plan)."""
        rows, toks, tops, owner = [], [], [], []
        at = 0
        for sid, c, st in zip(seq_ids, columns, starts):
            s = self.samplers[sid]
            if s.prompt_logprobs >= 0 and st < s.prompt_len:
                for i in range(c):
                    if st + i + 1 >= s.prompt_len:
                        break
                    t = int(tokens[at + i + 1]) if i + 1 < c else plan.prompt_next.get(sid)
                    if t is None:
                        break
                    rows.append(at + i)
                    toks.append(int(t))
                    tops.append(s.prompt_logprobs)
                    owner.append(sid)
            at += c
        if not rows:
            return None
        out: dict[int, list] = {}
        for a in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            idx = torch.tensor(rows[a:a + PROMPT_LOGPROB_ROWS], dtype=torch.int64)
            logits = self.model.head_logits(hidden.index_select(0, idx.to(hidden.device))).float()
            got = token_logprobs(logits, toks[a:a + PROMPT_LOGPROB_ROWS], tops[a:a + PROMPT_LOGPROB_ROWS],
                                 rank=self.rank, tp=self.tp, gather=self.mailbox.all_gather)
            for sid, e in zip(owner[a:a + PROMPT_LOGPROB_ROWS], got):
                out.setdefault(sid, []).append(e)
        return out

    # ---- device-fed steps ---------------------------------------------------------------------------

    def _pend(self, plan: msg.StepPlan, seq_ids: list[int], rows: list[int], logits: torch.Tensor,
              samplers: list[SeqSampler], positions: list[int], t0: float, fed: bool) -> None:
        """Choose the step's tokens on the device and leave the step pending (see submit)."""
        offset = self.rank * logits.shape[-1]
        cand = local_candidates(logits, samplers, positions, list(range(len(rows))), offset, batched=True,
                                on_host=False)
        picked = merge_on_device(cand, self.rank, self.tp, self.model.all_reduce)      # [R, 2] (score, id)
        # the ids the next step may take as inputs; a NaN row (refused when flushed) feeds id 0, never
        # an index outside the embedding
        ids = picked[:, 1].nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(0, self.spec.vocab_size - 1).long()
        if self.backend == "cuda":
            host = torch.empty(picked.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(picked, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:                                           # (the reference backend on a GPU: to the host here)
            host, ready = picked.cpu(), None
        # elapsed_s: the host's work on the step (to here) plus flush's (its wait for the device included),
        # not the next step's launch that may come in between
        self.pending = _Pending(plan, seq_ids, rows, ids, host, ready, time.perf_counter() - t0, fed)

    def _feed(self, seq_ids: list[int], columns: list[int], tokens: np.ndarray) -> tuple | None:
        """(columns, ids) on the model's device: the step's LAST_SAMPLED columns and the pending
        step's device ids that fill them; None when the pending step did not sample every one of
        them, or the model cannot take a fed step of these columns (a prefill-sized step)."""
        p = self.pending
        if p is None or not self.model_feeds(columns):
            return None
        row_of = {p.seq_ids[b]: j for j, b in enumerate(p.rows)}
        cols, src, at = [], [], 0
        for sid, c in zip(seq_ids, columns):
            for i in range(at, at + c):
                if tokens[i] < 0:
                    j = row_of.get(sid)
                    if j is None:
                        return None
                    cols.append(i)
                    src.append(j)
            at += c
        idx = torch.tensor([cols, src], dtype=torch.int64)
        if self.backend == "cuda":                      # pinned, so the copy waits for nothing on the host
            idx = idx.pin_memory().to(p.ids.device, non_blocking=True)
        return idx[0], p.ids.index_select(0, idx[1])

    def model_feeds(self, columns: list[int]) -> bool:
        feeds = getattr(self.model, "feeds", None)
        return True if feeds is None else feeds(columns)

    def pending_ready(self) -> bool:
        """True when flush() would not wait (no pending step, or its tokens are on the host)."""
        p = self.pending
        return p is None or p.ready is None or p.ready.query()

    def flush(self, mark: str = "sampled") -> list[msg.StepResult]:
        """Finish the pending step, if any: wait for its tokens on the host, record them; its result
        (rank 0) in a list."""
        p = self.pending
        if p is None:
            return []
        self.pending = None
        t0 = time.perf_counter() - p.launch_s          # elapsed_s = launch_s + this flush
        if p.ready is not None:
            p.ready.synchronize()
        if self.transport is not None:
            self.transport.check()                      # tokens after a peer's hang are garbage: refuse them
        scores, ids = p.host[:, 0].numpy(), p.host[:, 1].numpy()
        bad = np.flatnonzero(np.isnan(scores))
        if bad.size:                                    # named as its own step: the next may be launched
            e = _nan_row(int(bad[0]))
            raise type(e)(f"step {p.plan.step}: {e}")
        if self.profiler is not None:                   # inside the next step's row when that one was fed
            self.profiler.mark(mark)
        result = self._finish_step(p.plan, p.seq_ids, p.rows, ids.astype(np.int64).tolist(), t0, p.fed)
        return [result] if result is not None else []


    # ---- speculation --------------------------------------------------------------------------------

    def spec_step(self, plan: msg.StepPlan) -> msg.StepResult | None:
        """A step with MTP speculation: verify each sequence's draft columns, commit the GDN state at
        the accepted length, then draft K tokens for the next round with the MTP layer."""
        t0 = time.perf_counter()
        self._new_samplers(plan)
        self._set_masks(plan)
        for sid, ids in plan.spec_stops.items():
            self.stops[int(sid)] = frozenset(int(t) for t in ids)
        seq_ids = plan.seq_ids.tolist()
        columns, starts = plan.columns.tolist(), plan.starts.tolist()
        B = len(seq_ids)
        ndraft = plan.drafts.tolist() if plan.drafts is not None else [0] * B
        next_tok = plan.next_token.tolist() if plan.next_token is not None else [-1] * B
        kv_tokens = plan.kv_tokens.tolist() if plan.kv_tokens is not None else [1 << 62] * B
        tokens = plan.token_ids.astype(np.int64)
        bounds, at = [], 0
        for c in columns:
            bounds.append((at, at + c))
            at += c
        for b, sid in enumerate(seq_ids):               # drafts are counted once accepted
            lo, hi = bounds[b]
            self.samplers[sid].observe(tokens[lo:hi - ndraft[b]].tolist(), starts[b])
        batch = Batch(torch.from_numpy(tokens), columns, starts, plan.slots.tolist(),
                      torch.from_numpy(plan.page_tables.astype(np.int32)), self._split_saves(plan)[0])
        if self.gpu_rounds is not None and not batch.saves:
            smp = [self.samplers[sid] for sid in seq_ids]
            stops = [sorted(self.stops.get(sid, ())) for sid in seq_ids]
            if self.gpu_rounds.eligible(batch, ndraft, plan.sample.tolist(),
                                        [s.greedy and not s.has_penalties and not s.banned and not s.bias and s.logprobs < 0
                                         and s.prompt_logprobs < 0 and s.allow is None for s in smp],
                                        kv_tokens, stops):
                return self._gpu_round(plan, batch, stops, ndraft, t0)
        out = self.model.forward(batch, self.state, logits="none", keep_columns=[n > 0 for n in ndraft])
        t_fwd = time.perf_counter()
        if self.transport is not None:
            self.transport.check()                      # a peer's hang shows here, not as garbage
        flags = plan.sample.tolist()
        rows = [b for b in range(B) if flags[b]]
        gather = self.mailbox.all_gather
        # logits of every verification column (plain sampled rows: the last column only)
        row_cols = {b: list(range(bounds[b][1] - ndraft[b] - 1, bounds[b][1])) for b in rows}
        flat = [c for b in rows for c in row_cols[b]]
        logits = self.model.head_logits(out.hidden[flat]).float() if flat else None
        at, col_logits = 0, {}
        for b in rows:
            col_logits[b] = (at, at + len(row_cols[b]))
            at += len(row_cols[b])
        accepted: dict[int, list[int]] = {}
        plain = [b for b in rows if ndraft[b] == 0]
        if plain:
            picked = sample_rows(logits[[col_logits[b][0] for b in plain]], [self.samplers[seq_ids[b]] for b in plain],
                                 [starts[b] + columns[b] for b in plain], rank=self.rank, tp=self.tp, gather=gather)
            accepted.update({b: [t] for b, t in zip(plain, picked)})
        drafted = [b for b in rows if ndraft[b] > 0]

        def column_samplers(b):
            s, hi = self.samplers[seq_ids[b]], bounds[b][1]
            d = tokens[hi - ndraft[b]:hi].tolist()
            first = starts[b] + columns[b] - ndraft[b]            # position of d1
            return [with_tokens(s, d[:i], first) for i in range(ndraft[b] + 1)], d, first
        greedy = [b for b in drafted if self.samplers[seq_ids[b]].greedy]
        if greedy:
            idx, smp, pos = [], [], []
            for b in greedy:
                ss, _, first = column_samplers(b)
                idx += list(range(*col_logits[b]))
                smp += ss
                pos += [first + i for i in range(len(ss))]
            targets = sample_rows(logits[idx], smp, pos, rank=self.rank, tp=self.tp, gather=gather)
            at = 0
            for b in greedy:
                n = ndraft[b]
                d = tokens[bounds[b][1] - n:bounds[b][1]].tolist()
                accepted[b] = accept_greedy(targets[at:at + n + 1], d)
                at += n + 1
        sampled = [b for b in drafted if not self.samplers[seq_ids[b]].greedy]
        if sampled:
            idx, smp = [], []
            for b in sampled:
                ss, _, _ = column_samplers(b)
                idx += list(range(*col_logits[b]))
                smp += ss
            logp = gather_log_probs(logits[idx], smp, rank=self.rank, tp=self.tp, gather=gather)
            at = 0
            for b in sampled:
                n = ndraft[b]
                _, d, first = column_samplers(b)
                accepted[b] = accept_sampled(logp[at:at + n + 1], d, self.samplers[seq_ids[b]].seed,
                                             [first + i for i in range(n + 1)])
                at += n + 1
        # stop tokens inside a round: commit exactly up to the stop
        for b in drafted:
            stops = self.stops.get(seq_ids[b], frozenset())
            for i, t in enumerate(accepted[b]):
                if t in stops:
                    accepted[b] = accepted[b][:i + 1]
                    break
        logprobs = self._round_logprobs(logits, rows, seq_ids, col_logits, accepted)
        prompt_lp = self._prompt_logprobs(plan, out.hidden, seq_ids, columns, starts, tokens)
        t_acc = time.perf_counter()
        if out.kept is not None:
            self.model.commit(out.kept, self.state, [len(accepted.get(b, [0])) - 1 for b in out.kept.seqs])
        t_commit = time.perf_counter()
        for b in drafted:                                       # accepted drafts join the penalty counts
            a = len(accepted[b]) - 1
            if a:
                self.samplers[seq_ids[b]].observe(accepted[b][:a], starts[b] + columns[b] - ndraft[b])
        drafts = self._draft(out.hidden, batch, bounds, tokens, ndraft, next_tok, kv_tokens, rows, accepted)
        self._time_phases(t0, t_fwd, t_acc, t_commit, time.perf_counter())
        for sid in plan.finished:
            self.samplers.pop(int(sid), None)
            self.stops.pop(int(sid), None)
        if self.rank != 0:
            return None
        toks = [t for b in rows for t in accepted[b]]
        return msg.StepResult(step=plan.step, seq_ids=np.array([seq_ids[b] for b in rows], dtype=np.int64),
                              tokens=np.array(toks, dtype=np.int64),
                              counts=np.array([len(accepted[b]) for b in rows], dtype=np.int32),
                              drafts=np.array([drafts[b] for b in rows], dtype=np.int64).reshape(len(rows), self.spec_k),
                              elapsed_s=time.perf_counter() - t0, logprobs=logprobs, prompt_logprobs=prompt_lp)

    def _round_logprobs(self, logits, rows: list[int], seq_ids: list[int], col_logits: dict,
                        accepted: dict) -> list | None:
        """logprobs of a round's emitted tokens for the sequences that asked (None when none did): token i
        of a sequence's round was decided by its verification column i. One entry per emitted token, in
        StepResult.tokens order. Collective."""
        want = {b for b in rows if self.samplers[seq_ids[b]].logprobs >= 0}
        if not want:
            return None
        idx, toks, tops = [], [], []
        for b in rows:
            if b in want:
                k = self.samplers[seq_ids[b]].logprobs
                for i, t in enumerate(accepted[b]):
                    idx.append(col_logits[b][0] + i)
                    toks.append(t)
                    tops.append(k)
        got = iter(token_logprobs(logits[idx], toks, tops, rank=self.rank, tp=self.tp, gather=self.mailbox.all_gather))
        return [next(got) if b in want else None for b in rows for _ in accepted[b]]

    def _gpu_round(self, plan: msg.StepPlan, batch: Batch, stops: list[list[int]], ndraft: list[int],
                   t0: float) -> msg.StepResult | None:
        """A greedy round as one GPU program (ranks/spec_cuda.py): the host uploads the plan's
        metadata, launches (or replays) it, and waits once for [targets, a, drafts] per sequence."""
        K = self.spec_k
        res = self.gpu_rounds.run(batch, self.state, stops, ndraft,
                                  mark=self.profiler.mark if self.profiler else None)
        t1 = time.perf_counter()
        if self.transport is not None:
            self.transport.check()                      # a peer's hang shows here, not as garbage
        for sid in plan.finished:
            self.samplers.pop(int(sid), None)
            self.stops.pop(int(sid), None)
        self._gpu_round_s += (t1 - t0, time.perf_counter() - t1)
        if self.gpu_rounds.rounds % 256 == 0:
            ms = self._gpu_round_s / 256 * 1e3
            log.debug("rank %d: GPU speculation round %.2f ms on the host (mean of 256): launch and wait %.2f, "
                      "results %.2f", self.rank, ms.sum(), *ms)
            self._gpu_round_s[:] = 0
        if self.rank != 0:
            return None
        counts = res[:, K + 1] + 1                      # accepted drafts + the correction / bonus
        toks = np.concatenate([res[b, :counts[b]] for b in range(len(counts))])
        return msg.StepResult(step=plan.step, seq_ids=plan.seq_ids.astype(np.int64), tokens=toks.astype(np.int64),
                              counts=counts.astype(np.int32), drafts=np.ascontiguousarray(res[:, K + 2:]),
                              elapsed_s=time.perf_counter() - t0)

    def _time_phases(self, *marks: float) -> None:
        """Where a speculation round's host time goes, logged at DEBUG every 32 rounds: the verification
        call (its host cost: small when replayed as a graph), waiting for and accepting its results,
        the GDN commit call, and drafting (MTP steps with their argmax syncs)."""
        self._phases += np.diff(marks)
        self._phase_rounds += 1
        if self._phase_rounds == 32:
            ms = self._phases / self._phase_rounds * 1e3
            log.debug("rank %d: speculation round %.2f ms on the host (mean of 32): verification call %.2f, "
                      "accept %.2f, commit %.2f, drafting %.2f", self.rank, ms.sum(), *ms)
            self._phases[:] = 0
            self._phase_rounds = 0

    def _draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's float32 head logits for drafting: rows past the reduced proposal head (token
        ids >= spec_draft_vocab) are -inf, so the argmax is that of the GPU round's reduced head."""
        logits = self.model.head_logits(h).float()
        if self.draft_rows is not None:
            logits[:, self.draft_rows:] = float("-inf")
        return logits

    def _draft(self, hidden, batch: Batch, bounds, tokens, ndraft, next_tok, kv_tokens, rows, accepted) -> dict:
        """MTP pass 1 over each sequence's accepted columns (ids shifted left by one, the last = the
        token decided after them; hidden = the target's final-norm hidden there), then K-1 single MTP
        steps on its own output hidden. Returns {b: K drafts (-1 where the KV bound stopped it)}."""
        K = self.spec_k
        ids, cols, starts, keep_b, hid_rows = [], [], [], [], []
        for b, (lo, hi) in enumerate(bounds):
            n_acc = (hi - lo) - ndraft[b] + (len(accepted[b]) - 1 if b in accepted else 0)
            nxt = accepted[b][-1] if b in accepted else next_tok[b]
            if nxt < 0:
                continue
            ids += tokens[lo + 1:lo + n_acc].tolist() + [nxt]
            cols.append(n_acc)
            starts.append(batch.starts[b])
            keep_b.append(b)
            hid_rows += list(range(lo, lo + n_acc))
        if not keep_b:
            return {}
        mb = Batch(torch.tensor(ids, dtype=torch.int64), cols, starts, [batch.slots[b] for b in keep_b],
                   batch.page_tables[keep_b])
        m = self.model.mtp_forward(mb, hidden[hid_rows], self.state, logits="none").hidden
        drafting = [i for i, b in enumerate(keep_b) if b in accepted]
        ends = [sum(cols[:i + 1]) - 1 for i in drafting]
        drafts = {keep_b[i]: [] for i in drafting}
        if not drafting:            # prompt chunks only: the MTP pass kept their KV, nothing is drafted (and
            return drafts           # the CUDA head refuses an empty batch)
        h = m[ends]
        pos = [starts[i] + cols[i] - 1 for i in drafting]        # position of the last MTP column
        toks = argmax_rows(self._draft_logits(h), rank=self.rank, tp=self.tp,
                           gather=self.mailbox.all_gather)
        live = list(range(len(drafting)))
        cur = {li: toks[k] for k, li in enumerate(live)}
        for j in range(K):
            for li in live:
                drafts[keep_b[drafting[li]]].append(cur[li])
            if j == K - 1:
                break
            # the next MTP step sits at pos + 1: every rank drops the same rows (plan data only)
            live2 = [li for li in live if pos[li] + 1 < kv_tokens[keep_b[drafting[li]]]]
            if not live2:
                break
            sel = [live.index(li) for li in live2]
            for li in live2:
                pos[li] += 1
            sb = Batch(torch.tensor([cur[li] for li in live2], dtype=torch.int64), [1] * len(live2),
                       [pos[li] for li in live2], [batch.slots[keep_b[drafting[li]]] for li in live2],
                       batch.page_tables[[keep_b[drafting[li]] for li in live2]])
            h = self.model.mtp_forward(sb, h[sel], self.state, logits="none").hidden
            new = argmax_rows(self._draft_logits(h), rank=self.rank, tp=self.tp,
                              gather=self.mailbox.all_gather)
            cur = {li: new[k] for k, li in enumerate(live2)}
            live = live2
        for b in drafts:
            drafts[b] += [-1] * (K - len(drafts[b]))
        return drafts


class StepProfiler:
    """TANDEM_PROFILE_DIR=DIR (diagnostics): after TANDEM_PROFILE_SKIP steps (default 64) this rank
    records TANDEM_PROFILE_STEPS steps (default 32) and writes, in DIR,
      rank{R}.txt       GPU time per kernel name per step (torch.profiler; mailbox exchange kernels
                        include their wait for the peer) and the mean wall time of the steps;
                        TANDEM_PROFILE_KERNELS=0 leaves the profiler off
      rank{R}-host.txt  per step, host clock marks (time.time(), comparable across ranks): the plan
                        received, the step's own marks (prepared, launched, sampled; a GPU round:
                        launched, synchronised), computed, done. With device-fed steps a fed step's
                        row has "previous sampled" (the step before it reached the host) after
                        launched, and its own "sampled" lands in the next row (or nowhere, when no
                        step follows at once)."""

    def __init__(self, out_dir: str, rank: int, skip: int, steps: int, kernels: bool = True):
        self.out_dir, self.rank, self.skip, self.steps, self.kernels = out_dir, rank, skip, steps, kernels
        self.seen, self.prof, self.t0 = 0, None, 0.0
        self.marks: list[tuple[str, float]] | None = None
        self.rows: list[list[tuple[str, float]]] = []

    @classmethod
    def from_env(cls, rank: int) -> "StepProfiler | None":
        d = os.environ.get("TANDEM_PROFILE_DIR")
        if not d:
            return None
        return cls(d, rank, int(os.environ.get("TANDEM_PROFILE_SKIP", "64")),
                   int(os.environ.get("TANDEM_PROFILE_STEPS", "32")), os.environ.get("TANDEM_PROFILE_KERNELS") != "0")

    def mark(self, label: str) -> None:
        if self.marks is not None:
            self.marks.append((label, time.time()))

    def before_step(self) -> None:
        if self.seen == self.skip:
            torch.cuda.synchronize()
            if self.kernels:
                from torch.profiler import ProfilerActivity, profile
                self.prof = profile(activities=[ProfilerActivity.CUDA])
                self.prof.__enter__()
            self.t0 = time.perf_counter()
        if self.skip <= self.seen < self.skip + self.steps:
            self.marks = [("plan", time.time())]

    def after_step(self) -> None:
        if self.marks is not None:
            self.mark("done")
            self.rows.append(self.marks)
            self.marks = None
        self.seen += 1
        if self.seen != self.skip + self.steps:
            return
        torch.cuda.synchronize()
        wall = (time.perf_counter() - self.t0) / self.steps * 1e3
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"rank{self.rank}-host.txt"), "w") as f:
            f.write(f"rank {self.rank}: steps {self.skip}..{self.skip + self.steps - 1}: wall {wall:.3f} ms per step; "
                    "per step: plan received (time.time()), then each mark as +ms after it\n")
            for row in self.rows:
                t0 = row[0][1]
                f.write(f"{t0:.6f} " + " ".join(f"{k}+{(t - t0) * 1e3:.3f}" for k, t in row[1:]) + "\n")
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            times: dict[str, float] = {}
            for e in self.prof.events():
                if e.device_type.name == "CUDA":
                    times[e.name[:100]] = times.get(e.name[:100], 0.0) + e.device_time / self.steps / 1e3
            self.prof = None
            total = sum(times.values())
            with open(os.path.join(self.out_dir, f"rank{self.rank}.txt"), "w") as f:
                f.write(f"rank {self.rank}: steps {self.skip}..{self.skip + self.steps - 1}: wall {wall:.3f} ms per "
                        f"step, GPU kernel time {total:.3f} ms per step\n")
                for name, t in sorted(times.items(), key=lambda kv: -kv[1]):
                    f.write(f"{t:9.3f} ms {t / max(total, 1e-9):6.1%}  {name}\n")
        log.warning("rank %d: step profile written to %s", self.rank, self.out_dir)


def _heartbeat(ctx: zmq.Context, addr: str, rank: int, parent: int, stop: threading.Event,
               current_step: list[int]) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"hb{rank}".encode())
    sock.connect(addr)
    while not stop.wait(msg.HEARTBEAT_S):
        if os.getppid() != parent:                    # the coordinator died: do not outlive it
            os._exit(3)
        try:
            msg.send(sock, msg.Heartbeat(rank=rank, step=current_step[0]), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
    sock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ranks.worker")
    ap.add_argument("--connect", required=True, help="coordinator ROUTER address")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)           # Ctrl-C goes to the coordinator; it shuts us down

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.IDENTITY, f"rank{args.rank}".encode())
    sock.connect(args.connect)
    current_step = [-1]
    hb = threading.Thread(target=_heartbeat, args=(ctx, args.connect, args.rank, os.getppid(), stop, current_step),
                          daemon=True)
    hb.start()
    msg.send(sock, msg.Heartbeat(rank=args.rank))
    worker = None
    profiler = None
    step = -1
    try:
        hello = _recv_until(sock, stop, msg.Hello)
        if hello is None:
            return 0
        if hello.version != msg.PROTOCOL_VERSION:
            raise msg.ProtocolError(f"coordinator speaks protocol {hello.version}, rank speaks {msg.PROTOCOL_VERSION}")

        def progress(done: int, total: int) -> None:
            msg.send(sock, msg.Loading(rank=args.rank, done=done, total=total))

        try:
            worker = Worker(hello, progress)
        except Exception as e:                                 # load failures are answers, not crashes
            msg.send(sock, msg.Ready(rank=args.rank, ok=False, error=f"{type(e).__name__}: {e}", pid=os.getpid()))
            return 2
        msg.send(sock, worker.ready())
        profiler = StepProfiler.from_env(args.rank) if worker.backend == "cuda" else None
        worker.profiler = profiler
        kinds = (msg.StepPlan, msg.Cancel, msg.Shutdown)
        while not stop.is_set():
            if worker.pending is None:
                m = _recv_until(sock, stop, kinds)
            else:                   # a step's tokens are on their way: the next plan, or them, first
                m = _recv_until(sock, stop, kinds, worker.pending_ready)
                if m is _READY:
                    for r in worker.flush():
                        msg.send(sock, r)
                    continue
            if m is None or isinstance(m, msg.Shutdown):
                break
            if isinstance(m, msg.Cancel):
                for r in worker.flush():                        # in order: the pending step first
                    msg.send(sock, r)
                for sid in m.seq_ids:
                    worker.samplers.pop(int(sid), None)
                    worker.last_sampled.pop(int(sid), None)
                    worker.stops.pop(int(sid), None)
                continue
            step = current_step[0] = m.step
            if profiler is not None:
                profiler.before_step()
            results = worker.submit(m)
            if profiler is not None:
                profiler.mark("computed")
            for r in results:
                msg.send(sock, r)
            if profiler is not None:
                profiler.after_step()
        return 0
    except Exception as e:
        log.error("rank %d failed at step %d: %s", args.rank, step, traceback.format_exc())
        try:
            msg.send(sock, msg.Error(rank=args.rank, step=step, reason=f"{type(e).__name__}: {e}"))
        except zmq.ZMQError:
            pass
        return 1
    finally:
        stop.set()
        if worker is not None:
            if worker.transport is not None:
                try:
                    worker.transport.close()
                except Exception:                               # noqa: BLE001 - the process is ending
                    log.debug("closing the transport failed", exc_info=True)
            worker.mailbox.close()
        sock.close()
        ctx.term()


_READY = object()


def _recv_until(sock, stop: threading.Event, kinds, ready=None):
    """The next message (one of `kinds`); None when stopping. With `ready` (a pending step: its tokens
    are on their way to the host), _READY once ready() is true, whichever comes first; then it spins,
    as the wait is a GPU step at most and a message or the tokens are acted on within microseconds."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(0 if ready is not None else 100):
            m = msg.recv(sock)
            if isinstance(m, kinds):
                return m
            raise msg.ProtocolError(f"unexpected {type(m).__name__}")
        if ready is not None and ready():
            return _READY
    return None


if __name__ == "__main__":
    sys.exit(main())
