"""The coordinator: owns the rank processes and runs the step loop.

    plan = scheduler.schedule(); send the StepPlan to every rank; scheduler.commit(plan, result)

It starts N rank processes (``python -m ranks.worker``), hands each a Hello over a ZeroMQ ROUTER
socket, and waits for every Ready. Then it loops: drain submissions and cancellations, plan a step,
send it to all ranks, wait for rank 0's StepResult while watching every rank (process exit, Error
message, heartbeat age), commit, stream events. With EngineOptions.overlap_steps (the default), while
a decode step is in flight the next one is planned and sent before its result comes back
(Scheduler.plan_ahead: the ranks feed it the tokens they just sampled), so the ranks start it as soon
as they finish the first and the coordinator's round trip is off the critical path. A rank that fails ends every in-flight request with
an error event at once, the engine turns unhealthy, the other ranks are stopped, and later
submissions are refused; whoever owns the engine (``tandem serve``) then exits non-zero.
"""

from __future__ import annotations

import logging
import operator
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from runtime.config import PAGE_SIZE, load_spec
from runtime.engine import EngineError, Event, step_sizes
from runtime.grammar import MinTokens
from runtime.sampling import SamplingParams
from runtime.scheduler import IN_STEP_SAVE_MIN_COLUMNS, Overloaded, Scheduler, SchedulerConfig
from runtime.sequence import Sequence, Status
from transport import control as msg
from transport.mailbox import create_segment

log = logging.getLogger(__name__)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_KV_TOKENS = 1 << 30          # tokens of KV one engine may hold (2^24 pages; ~64 TB for the 27B)


def kv_pool_tokens(options, max_context: int,
                   names: tuple[str, str, str] = ("max_concurrency", "max_context", "kv_capacity")) -> int:
    """Tokens of KV in the pool: options.kv_capacity, or by default room for max_concurrency sequences
    of max_context tokens in whole pages with speculation's slack; ValueError past MAX_KV_TOKENS, naming
    the three settings as `names` spells them (the CLI passes its flags)."""
    per_seq = -(-(max_context + 2 * options.spec_draft_tokens) // PAGE_SIZE)
    kv_tokens = options.kv_capacity or options.max_concurrency * per_seq * PAGE_SIZE
    if kv_tokens > MAX_KV_TOKENS:    # the page lists alone would exhaust the host's memory
        conc, ctx, cap = names
        raise ValueError(f"a KV pool of {kv_tokens} tokens ({conc} {options.max_concurrency} x {ctx} "
                         f"{max_context}, or {cap}) exceeds {MAX_KV_TOKENS}; lower {conc}, {ctx} or {cap}")
    return kv_tokens


class Coordinator:
    def __init__(self, model_dir: str, *, tp: int, device: str, dtype: str, options, on_load_progress=None):
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        # absolute: the rank processes run from the repository root, not from the caller's directory
        model_dir = os.path.abspath(model_dir)
        self.model_dir, self.tp, self.device, self.dtype, self.options = model_dir, tp, device, dtype, options
        self.on_load_progress = on_load_progress
        self.loading: dict[int, tuple[int, int]] = {}      # rank -> (bytes loaded, its shard's bytes)
        self._load_decile = -1                              # the last tenth of the load logged
        self.spec = load_spec(model_dir)
        problem = self.spec.tp_conflict(tp)       # the ranks' rule, checked before any process starts
        if problem:
            raise ValueError(problem)
        max_context = options.max_context or min(self.spec.max_position_embeddings, 8192)
        if max_context > self.spec.max_position_embeddings:
            raise ValueError(f"max_context {max_context} exceeds the model's max_position_embeddings "
                             f"{self.spec.max_position_embeddings}")
        # default: room for max_concurrency sequences of max_context tokens each, in whole pages, with
        # speculation's slack (Scheduler.pages_for); max_concurrency x max_context tokens rounded up to
        # pages fell a page short whenever max_context is not a multiple of PAGE_SIZE, so that the last
        # sequence waited for the others to finish
        kv_tokens = kv_pool_tokens(options, max_context)
        chunk, step = step_sizes(device, options.max_concurrency, options.prefill_chunk, options.max_step_tokens)
        self.config = SchedulerConfig(
            max_concurrency=options.max_concurrency, max_pending=options.max_pending,
            pending_timeout_s=options.pending_timeout_s, prefill_chunk=chunk,
            max_step_tokens=step, kv_pages=-(-kv_tokens // PAGE_SIZE), max_context=max_context,
            spec_draft_tokens=options.spec_draft_tokens,
            prefix_cache=options.max_concurrency if options.prefix_cache is None else options.prefix_cache,
            snapshot_in_step=IN_STEP_SAVE_MIN_COLUMNS if options.snapshot_in_step else 0)
        self.scheduler = Scheduler(self.config)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[int, object] = {}
        self.seqs: dict[int, Sequence] = {}
        self.procs: list[subprocess.Popen] = []
        self.healthy = False
        self.failure: str | None = None
        self.counters = dict(requests=0, finished=0, cancelled=0, failed=0, prompt_tokens=0, generated_tokens=0,
                             steps=0, steps_ahead=0, steps_fed=0)
        # where the steps' wall time went (seconds, summed over steps; stats()["step_time"]): the
        # coordinator's own work per step (scheduling, the plan's message, applying the result),
        # waiting for rank 0's result, and the part of that wait rank 0 spent in its step (from the
        # plan decoded to the result built: inputs, forward, sampling); without steps planned ahead
        # the rest of the wait is messaging and the rank's receive / send (with them, rank 0 often
        # starts a step before the coordinator waits for it, and the wait is the shorter)
        self.step_time = dict(steps=0, coordinator_s=0.0, wait_s=0.0, rank_s=0.0)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = False             # set (under _lock) once the loop stops taking requests
        self._queued = 0                 # submissions in the inbox, not yet in the scheduler (under _lock)
        self._tmp = tempfile.mkdtemp(prefix="tandem-")
        self._addr = f"ipc://{self._tmp}/ctl"
        self._ctx = zmq.Context()
        self._sock = None
        self._shm = None
        self._gpu_shm = None
        self.ready: dict = {}
        self._last_beat: dict[int, float] = {}

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._spawn()
            self._handshake()
        except BaseException:
            self._teardown()
            raise
        self.healthy = True
        self._thread = threading.Thread(target=self._loop, name="tandem-coordinator", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(self._addr)
        max_payload = max(self.config.max_step_tokens * self.spec.hidden_size,
                          (2 + self.options.spec_draft_tokens) * self.config.max_concurrency
                          * self.spec.vocab_size // self.tp, 1024)
        self.mailbox_words = min(max_payload, 1 << 22)
        self._shm = create_segment(self.tp, self.mailbox_words)
        # a second segment for the GPU transports (their own epochs; never shared with the CPU mailbox)
        if self.tp > 1 and self.device != "cpu" and self.options.transport in ("auto", "mailbox", "copies"):
            self._gpu_shm = create_segment(self.tp, self.options.gpu_mailbox_words)
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        # one torch thread per rank unless asked: on small CPU models more threads were slower (docs/perf.md)
        threads = self.options.threads_per_rank or 1
        cores = os.cpu_count() or 1
        if threads > cores:              # far past the cores, torch's thread pool crashed the rank (SIGSEGV)
            log.warning("threads_per_rank %d exceeds the %d cores here; using %d", threads, cores, cores)
            threads = cores
        env.setdefault("OMP_NUM_THREADS", str(threads))
        for r in range(self.tp):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "ranks.worker", "--connect", self._addr, "--rank", str(r),
                 "--log-level", self.options.log_level],
                cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, start_new_session=True))
        self._threads_per_rank = threads

    def _unlink_segments(self) -> None:
        """Remove the mailbox segments' names (already gone once the ranks were ready)."""
        for shm in (self._shm, self._gpu_shm):
            if shm is not None:
                try:
                    shm.unlink()
                except FileNotFoundError:
                    pass

    def _handshake(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        alive, ready = set(), {}
        while len(ready) < self.tp:
            self._check_processes(starting=True)
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.tp)) - set(ready))
                raise RuntimeError(f"ranks {missing} did not report Ready within {self.options.startup_timeout_s:.0f} s")
            if not self._sock.poll(50):
                continue
            ident, m = self._recv()
            if isinstance(m, msg.Heartbeat):
                self._last_beat[m.rank] = time.monotonic()
                if ident == f"rank{m.rank}".encode() and m.rank not in alive:
                    alive.add(m.rank)
                    self._send(m.rank, msg.Hello(
                        rank=m.rank, tp=self.tp, model_dir=self.model_dir, device=self.device, dtype=self.dtype,
                        num_slots=self.config.max_concurrency, num_pages=self.config.kv_pages,
                        mailbox=self._shm.name, mailbox_words=self.mailbox_words,
                        options=dict(mailbox_timeout_s=self.options.mailbox_timeout_s,
                                     threads_per_rank=self._threads_per_rank,
                                     spec_draft_tokens=self.options.spec_draft_tokens,
                                     prefix_snapshots=self.config.prefix_cache,
                                     spec_draft_vocab=self.options.spec_draft_vocab,
                                     backend=self.options.backend, weights=self.options.weights,
                                     kv_dtype=self.options.kv_dtype,
                                     cuda_graphs=self.options.cuda_graphs,
                                     device_feed=self.options.device_feed,
                                     random_weights=self.options.random_weights,
                                     transport=self.options.transport,
                                     gpu_mailbox=self._gpu_shm.name if self._gpu_shm is not None else None,
                                     nccl_init=f"file://{self._tmp}/nccl-init")))
            elif isinstance(m, msg.Loading):
                self._loading(m)
            elif isinstance(m, msg.Ready):
                if not m.ok:
                    if "needs MTP weights" in m.error:
                        raise ValueError(f"--spec mtp needs the model's MTP weights (mtp.*); {self.model_dir} "
                                         "has none")
                    raise RuntimeError(f"rank {m.rank} could not load {self.model_dir}: {m.error}")
                ready[m.rank] = m
            elif isinstance(m, msg.Error):
                raise RuntimeError(f"rank {m.rank} failed while starting: {m.reason}")
        self.ready = ready
        # Every rank has mapped the mailbox segments (before Ready): drop their names now, so that none is
        # left in /dev/shm however this process ends (SIGKILL, the OOM killer); the mappings live on.
        self._unlink_segments()
        self.has_mtp = all(r.has_mtp for r in ready.values())
        if self.options.spec_draft_tokens and not self.has_mtp:      # the ranks refuse too; say it plainly
            raise ValueError(f"--spec mtp needs the model's MTP weights (mtp.*); {self.model_dir} has none")
        log.info("%d rank(s) ready: %s", self.tp, {r: dict(pid=m.pid, weight_bytes=m.weight_bytes,
                                                            state_bytes=m.state_bytes, **m.runtime)
                                                    for r, m in ready.items()})
        log.info("steps: up to %d sequences, %d columns per step, prefill chunks of %d columns",
                 self.config.max_concurrency, self.config.max_step_tokens, self.config.prefill_chunk)

    def _loading(self, m: msg.Loading) -> None:
        """A rank's load progress: the sums over the ranks to on_load_progress, or without one to the log
        at INFO about every 10% of the whole."""
        self.loading[m.rank] = (int(m.done), int(m.total))
        done = sum(d for d, _ in self.loading.values())
        # a rank not heard from yet counts as the largest shard so far (ranks' shards are nearly equal)
        total = sum(t for _, t in self.loading.values()) + (self.tp - len(self.loading)) * max(
            t for _, t in self.loading.values())
        if self.on_load_progress is not None:
            try:
                self.on_load_progress(done, total)
            except Exception:                 # noqa: BLE001 - a display's failure must not stop the load
                log.exception("on_load_progress failed")
            return
        decile = int(10 * done / total) if total else 0
        if decile > self._load_decile:
            self._load_decile = decile
            log.info("loading weights: %.1f of %.1f GiB (%d%%)", done / 2**30, total / 2**30, 100 * done // max(total, 1))

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping.is_set() and self._thread is None:
            return
        self.inbox.put(("shutdown", None))
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._thread = None
        self._teardown()

    def _teardown(self) -> None:
        if self._sock is not None:
            for r in range(len(self.procs)):
                try:
                    self._send(r, msg.Shutdown(reason="engine shutdown"))
                except (zmq.ZMQError, KeyError):
                    pass
        deadline = time.monotonic() + 3.0
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if not self._ctx.closed:
            self._ctx.term()
        self._unlink_segments()
        for shm in (self._shm, self._gpu_shm):
            if shm is not None:
                shm.close()
        self._shm = self._gpu_shm = None
        shutil.rmtree(self._tmp, ignore_errors=True)
        self.healthy = False

    # ---- requests (any thread) ---------------------------------------------------------------------

    def submit(self, stream, prompt: list[int], params: SamplingParams, stop_ids: frozenset[int]) -> None:
        if self.failure or not self.healthy:
            raise EngineError(f"the engine is not serving: {self.failure or 'not started or shut down'}")
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        V = self.spec.vocab_size
        try:
            prompt = [operator.index(t) for t in prompt]       # ints, numpy integers; not floats or strings
        except TypeError:
            bad = next(t for t in prompt if not hasattr(type(t), "__index__"))
            raise ValueError(f"prompt token id {bad!r} is not an integer") from None
        for t in prompt:
            if not 0 <= t < V:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {V})")
        for t in params.banned_token_ids:
            if not 0 <= t < V:
                raise ValueError(f"banned token id {t!r} is outside the vocabulary [0, {V})")
        for t, _ in params.logit_bias:
            if not 0 <= t < V:
                raise ValueError(f"logit_bias token id {t!r} is outside the vocabulary [0, {V})")
        if len(prompt) >= self.config.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds {self.config.max_context} "
                             "(prompt plus at least one generated token)")
        room = self.config.max_context - len(prompt)
        stops = frozenset(stop_ids) | frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= frozenset(self.spec.eos_token_ids)
        for t in params.grammar_after:
            if not 0 <= t < V:
                raise ValueError(f"grammar_after token id {t!r} is outside the vocabulary [0, {V})")
        seq = Sequence(id=stream.id, prompt=prompt, params=params,
                       seed=params.seed if params.seed is not None else random.randrange(2**62),
                       max_new_tokens=min(params.max_new_tokens, room), stop_ids=stops)
        if params.grammar is not None:
            seq.constraint = self._constraint(params, stops)
        if params.min_tokens > 0 and stops:
            seq.constraint = MinTokens(params.min_tokens, stops, V, seq.constraint)
        need = self.scheduler.pages_for(seq)
        if need > self.config.kv_pages:
            raise ValueError(f"the request needs {need * PAGE_SIZE} tokens of KV; the pool holds "
                             f"{self.config.kv_pages * PAGE_SIZE}")
        with self._lock:
            # checked again under the lock: once _fail has drained the inbox nothing may enter it
            if self._closed or self.failure:
                raise EngineError(f"the engine is not serving: {self.failure or 'shut down'}")
            # the submissions still in the inbox count as queued; those the free slots will take do not wait
            if self.scheduler.pending(self._queued + 1) > self.config.max_pending:
                raise Overloaded(f"too many waiting requests (max_pending {self.config.max_pending})")
            self.streams[seq.id] = stream
            self._queued += 1
            self.inbox.put(("submit", seq))

    def cancel(self, request_id: int) -> None:
        self.inbox.put(("cancel", request_id))

    def stats(self) -> dict:
        with self._lock:
            usage = self.scheduler.usage()
            out = dict(healthy=self.healthy and not self.failure, failure=self.failure, tp=self.tp,
                       **usage, **self.counters)
            out["step_time"] = dict(self.step_time)
            if self.ready:
                out["ranks"] = {r: dict(m.runtime, pid=m.pid) for r, m in sorted(self.ready.items())}
            if self.scheduler.cache is not None:
                out["prefix_cache"] = dict(self.scheduler.cache_stats, entries=len(self.scheduler.cache.entries),
                                           capacity=self.scheduler.cache.capacity)
            sc = self.scheduler.spec_totals
            if sc is not None:
                out["spec"] = dict(sc, draft_tokens=self.options.spec_draft_tokens,
                                   accepted_hist=list(sc["accepted_hist"]),
                                   position_drafted=list(sc["position_drafted"]),
                                   position_accepted=list(sc["position_accepted"]),
                                   tokens_per_round=(sc["accepted"] + sc["rounds"]) / sc["rounds"] if sc["rounds"]
                                   else None)
            return out

    # ---- the loop (coordinator thread) -------------------------------------------------------------

    def _loop(self) -> None:
        inflight = None                                  # a plan sent and not yet committed
        try:
            while not self._stopping.is_set():
                if not self._drain(block=not self.scheduler.running and not self.scheduler.waiting
                                   and inflight is None):
                    break
                for s in self.scheduler.expire(time.monotonic()):
                    self._finish(s)
                t0 = time.perf_counter()
                if inflight is None:
                    with self._lock:
                        inflight = self.scheduler.schedule()
                    if inflight is None:
                        continue
                    self._send_plan(inflight)
                ahead = None
                if self.options.overlap_steps:
                    with self._lock:
                        ahead = self.scheduler.plan_ahead(inflight)
                    if ahead is not None:
                        self._send_plan(ahead)
                        self.counters["steps_ahead"] += 1
                self._complete(inflight, t0)
                inflight = ahead
            # shutdown() sets _stopping too, so the loop can end here before it has read the "shutdown"
            # item: end what is still running or queued (a no-op when _drain already did)
            self._fail("the engine was shut down", status=Status.CANCELLED)
        except _RankFailure as e:
            self._fail(str(e))
        except Exception as e:                           # a bug here must not hang the clients
            log.exception("coordinator loop failed")
            self._fail(f"coordinator failed: {type(e).__name__}: {e}")

    def _drain(self, block: bool) -> bool:
        """Apply queued submissions / cancellations; False on shutdown."""
        try:
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            if block:
                self._check_processes()
                self._check_messages()
            return True
        while True:
            kind, value = item
            if kind == "shutdown":
                self._fail("the engine was shut down", status=Status.CANCELLED)
                return False
            if kind == "submit":
                with self._lock:
                    self._queued -= 1
                    try:
                        self.scheduler.add(value)
                        self.seqs[value.id] = value
                        self.counters["requests"] += 1
                    except (Overloaded, ValueError) as e:
                        value.status, value.error = Status.FAILED, str(e)
                        self._finish(value)
            elif kind == "cancel":
                s = self.seqs.get(value)
                if s is not None and not s.done:
                    with self._lock:
                        self.scheduler.cancel(s)
                    s.finish_reason = "cancelled"
                    self._finish(s)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _constraint(self, params: SamplingParams, stops: frozenset[int]):
        """The request's grammar parser (structured outputs) over the model's tokenizer.json, ending on
        the request's stop ids (the model's eos ids when ignore_eos drops them); ValueError naming the
        problem when the model directory has none or the grammar cannot be used."""
        from runtime import grammar
        path = os.path.join(self.model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"structured outputs need the model's tokenizer: {path} is missing")
        ends = tuple(t for t in stops if 0 <= t < self.spec.vocab_size) or tuple(self.spec.eos_token_ids)
        tok = grammar.llg_tokenizer(path, self.spec.vocab_size, ends)
        return grammar.Constraint(tok, params.grammar, tuple(params.grammar_after))

    def _send_plan(self, plan) -> None:
        """Send a step's StepPlan to every rank."""
        max_pages = max(len(s.pages) for s in plan.seqs)
        arrays = plan.to_arrays(max_pages)
        new_sampling = {}
        for s in plan.new:
            p = s.params
            # top_k >= vocab keeps everything; clamped so any int fits the message's 64-bit integers
            new_sampling[s.id] = dict(temperature=p.temperature, top_k=min(p.top_k, self.spec.vocab_size),
                                      top_p=p.top_p, min_p=p.min_p,
                                      presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                      repetition_penalty=p.repetition_penalty, seed=s.seed, prompt_len=len(s.prompt))
            if p.banned_token_ids:
                new_sampling[s.id]["banned"] = list(p.banned_token_ids)
            if p.logit_bias:
                new_sampling[s.id]["bias"] = [[t, v] for t, v in p.logit_bias]
            if p.logprobs is not None:
                new_sampling[s.id]["logprobs"] = p.logprobs
            if p.prompt_logprobs is not None:
                new_sampling[s.id]["prompt_logprobs"] = p.prompt_logprobs
        prompt_next = {}
        for s, c in zip(plan.seqs, plan.columns):
            end = s.computed + c
            if s.params.prompt_logprobs is not None and plan.starts is None and s.computed < len(s.prompt) \
                    and end < len(s.prompt):
                prompt_next[s.id] = s.prompt[end]
        spec_stops = {s.id: sorted(s.stop_ids) for s in plan.new} if self.options.spec_draft_tokens else {}
        masks = {}
        for s, smp in zip(plan.seqs, plan.sample):
            if smp and s.constraint is not None:
                m = s.constraint.mask()
                if m is not None:
                    masks[s.id] = m
        # a sequence started on a cached prefix: its samplers count the cached prompt tokens (penalties)
        cached = {s.id: s.prompt[:s.cached_tokens] for s in plan.new if s.cached_tokens and s.params.has_penalties}
        step = msg.StepPlan(step=plan.step, new_sampling=new_sampling, finished=plan.released, spec_stops=spec_stops,
                            prompt_next=prompt_next, masks=masks, prompt_tokens=cached,
                            snapshot_loads=[list(x) for x in plan.loads], snapshot_saves=[list(x) for x in plan.saves],
                            **arrays)
        frames = step.to_frames()
        for r in range(self.tp):
            self._sock.send_multipart([f"rank{r}".encode()] + frames, copy=False)

    def _complete(self, plan, t0: float) -> None:
        """Wait for a sent step's result and commit it (t0: when this loop pass began)."""
        t_sent = time.perf_counter()
        result = self._await_result(plan.step)
        t_result = time.perf_counter()
        self.counters["steps"] += 1
        ids, toks = result.seq_ids.tolist(), result.tokens.tolist()
        drafts, lps = None, None
        counts = [1] * len(ids) if result.counts is None else result.counts.tolist()
        if result.counts is None:
            sampled = dict(zip(ids, toks))
        else:
            sampled, at = {}, 0
            for sid, c in zip(ids, counts):
                sampled[sid] = toks[at:at + c]
                at += c
            drafts = dict(zip(ids, result.drafts.tolist())) if result.drafts is not None else None
        if result.logprobs is not None:
            lps, at = {}, 0
            for sid, c in zip(ids, counts):
                if c and result.logprobs[at] is not None:
                    lps[sid] = result.logprobs[at:at + c]
                at += c
        for sid, entries in (result.prompt_logprobs or {}).items():
            s = self.seqs.get(int(sid))
            if s is not None:
                s.new_prompt_logprobs = (s.new_prompt_logprobs or []) + list(entries)
        with self._lock:
            events = self.scheduler.commit(plan, sampled, drafts, lps)
            for s, tokens, reason in events:            # structured outputs: the parser takes the tokens
                if s.constraint is not None and tokens:
                    s.constraint.advance(tokens)
                    if s.constraint.error is not None and reason is None:
                        # a token outside the mask (never expected): stop the request, not the engine
                        self.scheduler.cancel(s, Status.FAILED, f"structured output failed: {s.constraint.error}")
                    elif s.constraint.complete and reason is None:
                        # the document is whole: end here rather than sample an end id (with
                        # ignore_eos one would not end it)
                        self.scheduler.finish(s, "stop")
                    if isinstance(s.constraint, MinTokens) and s.constraint.left <= 0:   # the grammar, or nothing
                        s.constraint = s.constraint.inner
        hook = self.options.spec_draft_hook
        if hook is not None and drafts is not None:                  # TEST-ONLY (EngineOptions)
            for s in plan.seqs:
                if s.id in drafts and not s.done:
                    s.drafts = list(hook(s, list(s.drafts)))
        for s, tokens, reason in events:
            self.counters["generated_tokens"] += len(tokens)
            if reason is None and not s.done:
                first = len(s.output) == len(tokens)
                self.streams[s.id]._push(Event(s.id, tokens, logprobs=_take_logprobs(s),
                                               prompt_logprobs=_take_prompt_logprobs(s),
                                               cached_tokens=s.cached_tokens if first else None))
            else:
                self._finish(s, last_tokens=tokens)
        if result.fed:
            self.counters["steps_fed"] += 1
        st = self.step_time
        st["steps"] += 1
        st["coordinator_s"] += (t_sent - t0) + (time.perf_counter() - t_result)
        st["wait_s"] += t_result - t_sent
        st["rank_s"] += result.elapsed_s

    def _await_result(self, step: int) -> msg.StepResult:
        while True:
            self._check_processes()
            if not self._sock.poll(20):
                continue
            ident, m = self._recv()
            if isinstance(m, msg.StepResult):
                if m.step != step:
                    raise _RankFailure(f"rank 0 answered step {m.step} while step {step} was in flight")
                return m
            self._on_message(m)

    def _check_messages(self) -> None:
        while self._sock is not None and self._sock.poll(0):
            _, m = self._recv()
            self._on_message(m)

    def _on_message(self, m) -> None:
        if isinstance(m, msg.Heartbeat):
            self._last_beat[m.rank] = time.monotonic()
        elif isinstance(m, msg.Error):
            raise _RankFailure(f"rank {m.rank} failed at step {m.step}: {m.reason}")
        else:
            raise _RankFailure(f"unexpected {type(m).__name__} from a rank")

    def _check_processes(self, starting: bool = False) -> None:
        now = time.monotonic()
        for r, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                what = f"signal {-code}" if code < 0 else f"exit code {code}"
                raise (RuntimeError if starting else _RankFailure)(f"rank {r} (pid {p.pid}) exited with {what}")
            if not starting and now - self._last_beat.get(r, now) > self.options.heartbeat_timeout_s:
                raise _RankFailure(f"rank {r} (pid {p.pid}) sent no heartbeat for "
                                   f"{self.options.heartbeat_timeout_s:.0f} s")

    def _send(self, rank: int, m) -> None:
        self._sock.send_multipart([f"rank{rank}".encode()] + m.to_frames(), copy=False)

    def _recv(self):
        frames = self._sock.recv_multipart()
        return frames[0], msg.Message.from_frames(frames[1:])

    # ---- endings ------------------------------------------------------------------------------------

    def _finish(self, s: Sequence, last_tokens: list[int] | None = None) -> None:
        stream = self.streams.pop(s.id, None)
        self.seqs.pop(s.id, None)
        now = time.monotonic()
        usage = dict(prompt_tokens=len(s.prompt), completion_tokens=len(s.output))
        if s.cached_tokens:
            usage["cached_tokens"] = s.cached_tokens          # prompt tokens taken from the prefix cache
        timings = dict(queue_s=(s.admitted_at - s.submitted_at) if s.admitted_at else None,
                       ttft_s=(s.first_token_at - s.submitted_at) if s.first_token_at else None,
                       total_s=now - s.submitted_at)
        if s.status == Status.FAILED:
            self.counters["failed"] += 1
        elif s.status == Status.CANCELLED:
            self.counters["cancelled"] += 1
        else:
            self.counters["finished"] += 1
            self.counters["prompt_tokens"] += len(s.prompt)
        if stream is not None:
            tokens = list(last_tokens or [])
            reason = s.finish_reason if s.status != Status.FAILED else None
            spec = None
            if s.spec is not None:
                spec = dict(s.spec, tokens_per_round=(s.spec["accepted"] + s.spec["rounds"]) / s.spec["rounds"])
            stream._push(Event(s.id, tokens, finish_reason=reason, error=s.error if s.status == Status.FAILED else None,
                               usage=usage, timings=timings, spec=spec,
                               logprobs=_take_logprobs(s) if tokens else None,
                               prompt_logprobs=_take_prompt_logprobs(s)))

    def _fail(self, reason: str, status: Status = Status.FAILED) -> None:
        """End every request; with FAILED the engine also turns unhealthy and stops its ranks."""
        if status == Status.FAILED:
            log.error("engine failure: %s", reason)
            self.failure = reason
            self.healthy = False
            for p in self.procs:        # the survivors may be stuck in an exchange: stop them now
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        with self._lock:
            self._closed = True            # submit() refuses from now on, so the drain below is the last
            pending = list(self.seqs.values())
            for s in pending:
                self.scheduler.cancel(s, Status.FAILED if status == Status.FAILED else Status.CANCELLED, reason)
                if status != Status.FAILED:
                    s.finish_reason = "cancelled"
            # a submit that raced the failure is still in the inbox: answer it too
            raced = []
            while True:
                try:
                    kind, value = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    self._queued -= 1
                    value.status, value.error = Status.FAILED, reason
                    raced.append(value)
        for s in pending + raced:
            self._finish(s)


def _take_logprobs(s: Sequence) -> list | None:
    """The logprob entries of the tokens added since the last event (None: the request did not ask)."""
    out, s.new_logprobs = s.new_logprobs, ([] if s.new_logprobs is not None else None)
    return out


def _take_prompt_logprobs(s: Sequence) -> list | None:
    """The prompt logprob entries reported since the last event (None when none came)."""
    out, s.new_prompt_logprobs = s.new_prompt_logprobs, None
    return out


class _RankFailure(RuntimeError):
    pass

