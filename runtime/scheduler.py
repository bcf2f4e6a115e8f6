"""Admission, slots, continuous batching and chunked prefill (bookkeeping only; no tensors).

Every step, each running sequence that has finished its prompt decodes one column, and sequences
still in their prompt get prefill chunks (at most `prefill_chunk` columns each) until the step's
column budget (`max_step_tokens`) is spent. A step that feeds a sequence's last known token samples
one token for it.

KV policy: a request is admitted only when a state slot and the KV pages for its whole budget
(prompt + max_new_tokens, clamped to the context) are free, and it keeps them until it ends. KV
therefore never runs out mid-generation and nothing is preempted; the price is that a large
max_new_tokens holds pages it may not use. A request whose budget exceeds the whole pool is refused
at submission. Waiting requests are admitted in arrival order (no overtaking, so a large request
cannot starve); the pending queue is bounded and its entries time out.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np

from runtime.config import PAGE_SIZE
from runtime.prefix_cache import PrefixCache
from runtime.sequence import Sequence, Status, new_spec_stats, record_round


LAST_SAMPLED = -1     # a token id in a step planned ahead: the token the ranks sampled for it last step


class Overloaded(RuntimeError):
    """The pending queue is full; the caller should retry later."""


# prefill chunks of at most this many columns end on a prefix-cache frontier rather than save it
# mid-step (the CUDA backend runs them as graphed steps of its fast program, ranks/model_cuda.py
# MAX_FAST_COLUMNS, which cannot; an extra short step costs little)
IN_STEP_SAVE_MIN_COLUMNS = 16


@dataclass(frozen=True)
class SchedulerConfig:
    max_concurrency: int = 8          # state slots = sequences running at once
    max_pending: int = 256            # waiting requests before Overloaded
    pending_timeout_s: float = 600.0  # a waiting request older than this fails
    prefill_chunk: int = 256          # prefill columns per sequence per step
    max_step_tokens: int = 1024       # columns per step, all sequences together
    kv_pages: int = 1024              # pages in the pool (each PAGE_SIZE tokens)
    max_context: int = 8192           # prompt + output tokens per sequence
    spec_draft_tokens: int = 0        # MTP speculation: drafts per round (0 = off)
    prefix_cache: int = 0             # prompt-prefix cache entries (GDN snapshot slots on the ranks; 0 = off)
    # a prefill chunk of more than this many columns saves a frontier that falls inside it mid-step
    # (the ranks split the GDN rule there: Batch.saves) instead of ending at it; 0 = always end there
    snapshot_in_step: int = 0

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "max_pending", "prefill_chunk", "max_step_tokens", "kv_pages", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_cache < 0:
            raise ValueError(f"prefix_cache must be >= 0 (0 = off), got {self.prefix_cache}")
        if self.snapshot_in_step < 0:
            raise ValueError(f"snapshot_in_step must be >= 0 (0 = never), got {self.snapshot_in_step}")
        if self.max_step_tokens < self.max_concurrency:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must be >= max_concurrency "
                             f"({self.max_concurrency}) so every running sequence can decode each step")


@dataclass
class Plan:
    """What one step does; `to_arrays` flattens it for the StepPlan message."""
    step: int
    seqs: list[Sequence]
    columns: list[int]
    sample: list[bool]
    new: list[Sequence] = field(default_factory=list)        # first step of these sequences
    released: list[int] = field(default_factory=list)        # ended since the last plan
    drafts: list[int] | None = None                          # speculation: draft columns per sequence
    # a step planned ahead (Scheduler.plan_ahead): each sequence's position, and its token is the one
    # the ranks sampled for it in the step before (token id -1 in the message)
    starts: list[int] | None = None
    # prefix cache (runtime/prefix_cache.py): GDN snapshot slot -> state slot copies before the step
    # (sequences admitted on a cached prefix), and (state slot, snapshot slot, u) copies of a sequence's
    # state after the first u of its columns in this step (frontiers; u = all its columns: after the step)
    loads: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int, int]] = field(default_factory=list)

    def to_arrays(self, max_pages: int) -> dict[str, np.ndarray]:
        B = len(self.seqs)
        tables = np.zeros((B, max(max_pages, 1)), dtype=np.int32)
        tokens: list[int] = []
        drafts = self.drafts or [0] * B
        for b, (s, c) in enumerate(zip(self.seqs, self.columns)):
            tables[b, :len(s.pages)] = s.pages
            if self.starts is not None:
                tokens.append(LAST_SAMPLED)
                continue
            n = drafts[b]
            tokens.extend(s.token(i) for i in range(s.computed, s.computed + c - n))
            tokens.extend(s.drafts[:n])
        spec = {}
        if self.drafts is not None:
            spec = dict(
                drafts=np.array(drafts, dtype=np.int32),
                next_token=np.array([s.token(s.computed + c) if s.computed + c < len(s.prompt) else -1
                                     for s, c in zip(self.seqs, self.columns)], dtype=np.int32),
                kv_tokens=np.array([len(s.pages) * PAGE_SIZE for s in self.seqs], dtype=np.int32))
        return dict(**spec,
            seq_ids=np.array([s.id for s in self.seqs], dtype=np.int64),
            columns=np.array(self.columns, dtype=np.int32),
            starts=np.array(self.starts if self.starts is not None else [s.computed for s in self.seqs],
                            dtype=np.int32),
            slots=np.array([s.slot for s in self.seqs], dtype=np.int32),
            page_tables=tables,
            token_ids=np.array(tokens, dtype=np.int32),
            sample=np.array(self.sample, dtype=np.int8),
        )


class Scheduler:
    """Single-threaded: the coordinator's loop is its only caller."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(config.max_concurrency - 1, -1, -1))
        self.free_pages = list(range(config.kv_pages - 1, -1, -1))
        self.refs = [0] * config.kv_pages           # holders of each page: sequences and cache entries
        self.cache = PrefixCache(config.prefix_cache) if config.prefix_cache else None
        self.cache_stats = dict(queries=0, hits=0, saved=0, evicted=0)    # prompt tokens looked up / found
        self.released: list[int] = []
        self.step = 0
        # speculation statistics over all requests (None when speculation is off)
        self.spec_totals = new_spec_stats(config.spec_draft_tokens) if config.spec_draft_tokens else None

    # ---- requests ---------------------------------------------------------------------------------

    def pages_for(self, seq: Sequence) -> int:
        """KV pages a sequence reserves at admission: prompt + max_new_tokens, plus, with speculation,
        2K positions of slack (when the pool has them) so that a round near the budget still has pages
        for its K+1 verification columns and its K draft positions: the ranks then run it like any
        other round (a GPU round) instead of the eager fallback."""
        need = -(-(len(seq.prompt) + seq.max_new_tokens) // PAGE_SIZE)
        slack = -(-(len(seq.prompt) + seq.max_new_tokens + 2 * self.config.spec_draft_tokens) // PAGE_SIZE)
        return slack if slack <= self.config.kv_pages else need

    def add(self, seq: Sequence) -> None:
        """Queue a request (Overloaded when the queue is full; ValueError if it can never fit)."""
        need = self.pages_for(seq)
        if need > self.config.kv_pages:
            raise ValueError(f"the request needs {need * PAGE_SIZE} tokens of KV (prompt {len(seq.prompt)} + "
                             f"max_new_tokens {seq.max_new_tokens}); the pool holds {self.config.kv_pages * PAGE_SIZE}")
        if self.pending(1) > self.config.max_pending:
            raise Overloaded(f"{self.pending()} requests are already waiting (max_pending {self.config.max_pending})")
        self.waiting.append(seq)

    def pending(self, queued: int = 0) -> int:
        """Requests waiting for a slot (what max_pending bounds): the queue, plus `queued` requests not
        yet added to it, beyond the free slots, which the next schedule() gives to the first of them.
        Counting the queue alone would refuse a burst's requests that arrive before the step that
        admits the earlier ones: with every slot free, only max_pending of them would get in. Running,
        waiting and queued requests together stay within max_concurrency + max_pending; where a free slot
        stays empty (no KV pages for the first waiting request, a copy waiting for its prefix), that many
        more than max_pending wait."""
        return max(0, len(self.waiting) + queued - len(self.free_slots))

    def cancel(self, seq: Sequence, status: Status = Status.CANCELLED, reason: str | None = None) -> None:
        """End a sequence now and free what it holds (its in-flight result, if any, is ignored)."""
        if seq.done:
            return
        if seq.status == Status.WAITING:
            self.waiting.remove(seq)
        else:
            self._release(seq)
        seq.status, seq.error, seq.finished_at = status, reason, time.monotonic()

    def expire(self, now: float) -> list[Sequence]:
        """Fail waiting requests older than pending_timeout_s."""
        out = [s for s in self.waiting if now - s.submitted_at > self.config.pending_timeout_s]
        for s in out:
            self.cancel(s, Status.FAILED, f"waited more than {self.config.pending_timeout_s:.0f} s for a free slot")
        return out

    # ---- steps ------------------------------------------------------------------------------------

    def schedule(self) -> Plan | None:
        """Admit what fits, then plan one step (None when there is nothing to run)."""
        loads: list[tuple[int, int]] = []
        saves: list[tuple[int, int]] = []
        new = self._admit(loads)
        budget = self.config.max_step_tokens
        seqs, columns, sample = [], [], []
        K = self.config.spec_draft_tokens
        drafts: list[int] | None = [] if K else None
        decoding = [s for s in self.running if not s.prefilling]
        spare = budget - sum(s.unfed for s in decoding)
        for s in decoding:                              # decodes first: the unfed tokens (one, or more
            n = 0                                       # after forced close-of-thinking tokens)
            # speculation: [last token, d1..dn]; not inside a budgeted reasoning section (the budget
            # replaces sampled tokens there), never past max_new_tokens (which the context clamps)
            # a constrained sequence (structured outputs) needs each token before the next one's mask
            if K and s.unfed == 1 and not s.thinking and s.drafts and s.constraint is None:
                valid = next((i for i, d in enumerate(s.drafts) if d < 0), len(s.drafts))
                n = max(0, min(K, valid, s.max_new_tokens - len(s.output) - 1, spare))
                spare -= n
            seqs.append(s), columns.append(s.unfed + n), sample.append(True)
            if drafts is not None:
                drafts.append(n)
            budget -= s.unfed + n
        for s in self.running:                          # then prefill chunks, oldest first
            if s.prefilling and budget > 0:
                n = min(self.config.prefill_chunk, len(s.prompt) - s.computed, budget)
                inside = [f for f in s.save_at if s.computed < f < s.computed + n]
                if inside and not (self.config.snapshot_in_step and n > self.config.snapshot_in_step):
                    n = inside[0] - s.computed          # the chunk ends on the prefix cache's frontier
                seqs.append(s), columns.append(n), sample.append(s.computed + n == len(s.prompt))
                if drafts is not None:
                    drafts.append(0)
                budget -= n
                while s.save_at and s.save_at[0] <= s.computed + n:     # frontiers in or at the end of it
                    self._save(s, saves, s.save_at[0] - s.computed)
        released, self.released = self.released, []
        if not seqs:
            if released:
                self.released = released
            return None
        self.step += 1
        return Plan(self.step, seqs, columns, sample, new=new, released=released, drafts=drafts,
                    loads=loads, saves=saves)

    def plan_ahead(self, inflight: Plan) -> Plan | None:
        """The decode step after `inflight`, planned before its result is back, so that the ranks find
        it queued when they finish `inflight` (the coordinator's round trip leaves the step's critical
        path). Each sequence of `inflight` that samples in it and can take another token decodes one
        column at the position after `inflight`'s, fed with the token the ranks sampled for it there.

        None (plan normally once `inflight` is committed) when that needs the result: speculation,
        a sequence of `inflight` that does not sample, whose next token the thinking budget may
        replace or whose next token's allowed ids depend on this one (a grammar), a running sequence not in `inflight` (a prompt still waiting for its chunk), or a
        waiting request that could be admitted now (counting the pages a prefix-cache hit shares and
        those evicting entries would free: a step planned ahead never delays an admission). A sequence that ends by length in `inflight` is
        left out; one that ends otherwise (a stop id) costs the ranks one wasted column, which
        commit() ignores (the sequence is done by then)."""
        if self.config.spec_draft_tokens or inflight.drafts is not None:
            return None
        if self.waiting and self.free_slots and self._admissible(self.waiting[0]):
            return None
        planned = {s.id for s in inflight.seqs}
        if any(s.id not in planned for s in self.running):
            return None
        seqs, starts = [], []
        for s, c, smp in zip(inflight.seqs, inflight.columns, inflight.sample):
            if s.done:
                continue
            if not smp or s.thinking or s.constraint is not None or s.computed + c != s.length:
                return None
            if len(s.output) + 2 > s.max_new_tokens:     # its last token comes from `inflight`
                continue
            seqs.append(s), starts.append(s.computed + c)
        if not seqs:
            return None
        released, self.released = self.released, []
        self.step += 1
        return Plan(self.step, seqs, [1] * len(seqs), [True] * len(seqs), released=released, starts=starts)

    def commit(self, plan: Plan, sampled: dict[int, int | list[int]],
               drafts: dict[int, list[int]] | None = None,
               logprobs: dict[int, list] | None = None) -> list[tuple[Sequence, list[int], str | None]]:
        """Apply a step's result: advance, append sampled tokens, finish what is complete.

        sampled: a token per sequence, or (speculation) the accepted tokens of its round: the
        accepted drafts then the correction / bonus token. drafts: the next round's drafts.
        logprobs: per sequence that asked, one entry per sampled token (StepResult.logprobs); the entries
        of the tokens added go to the sequence's new_logprobs (None for tokens inserted without sampling).
        Returns (sequence, tokens added, finish reason or None) for sequences that got tokens.
        """
        events = []
        K = self.config.spec_draft_tokens
        for b, (s, c) in enumerate(zip(plan.seqs, plan.columns)):
            if s.done:                                  # cancelled while the step ran
                continue
            n = plan.drafts[b] if plan.drafts else 0
            got = sampled.get(s.id)
            toks = [] if got is None else ([got] if isinstance(got, int) else list(got))
            a = max(0, len(toks) - 1) if n else 0       # drafts now in the ranks' state
            s.computed += c - n + a
            if n:
                s.spec_record(K, n, a)
                record_round(self.spec_totals, n, a)
            if drafts is not None and s.id in drafts:
                s.drafts = list(drafts[s.id])
            if not toks:
                continue
            added, reason = [], None
            lps = (logprobs or {}).get(s.id)
            if lps is not None and s.new_logprobs is None:
                s.new_logprobs = []
            for i, t in enumerate(toks):
                more, reason = s.accept(t)
                added += more
                if lps is not None:
                    s.new_logprobs += [lps[i]] if more == [t] else [None] * len(more)
                if reason is not None:
                    break
            if reason is not None:
                self.finish(s, reason)
            events.append((s, added, reason))
        return events

    def finish(self, s: Sequence, reason: str) -> None:
        """End a running sequence normally (`reason`: stop or length), freeing its slot and pages."""
        s.finish_reason = reason
        self._release(s)
        s.status, s.finished_at = Status.FINISHED, time.monotonic()

    # ---- internals --------------------------------------------------------------------------------

    def _admit(self, loads: list[tuple[int, int]]) -> list[Sequence]:
        new = []
        while self.waiting and self.free_slots:
            s = self.waiting[0]
            hit = self._lookup(s)
            if self._coming(s, hit):
                break                                   # in arrival order, after the prefix it waits for
            shared = hit.pages if hit is not None else []
            need = self.pages_for(s) - len(shared)
            if need > len(self.free_pages):
                self._evict_for(need, keep=hit)
            if need > len(self.free_pages):
                break                                   # arrival order: no overtaking
            self.waiting.popleft()
            s.slot = self.free_slots.pop()
            for p in shared:
                self.refs[p] += 1
            s.pages = shared + self._take(need)
            s.status, s.admitted_at = Status.RUNNING, time.monotonic()
            if hit is not None:                         # prefill from the frontier, on the entry's state
                s.computed = s.cached_tokens = hit.frontier
                self.cache.touch(hit, hit=True)
                self.cache_stats["hits"] += hit.frontier
                loads.append((hit.snap, s.slot))
            if self.cache is not None:                  # frontiers to leave: where it branches off, its end
                points = {self.cache.branch(s.prompt), self.cache.frontier(len(s.prompt))}
                s.save_at = [f for f in sorted(points)
                             if f > s.computed and self.cache.find(s.prompt[:f + 1]) is None]
            self.running.append(s)
            new.append(s)
        return new

    def _lookup(self, s: Sequence):
        """The cache entry `s` may start from (None without a cache, for prompt_logprobs, on a miss);
        counts the lookup once per request."""
        if self.cache is None or s.params.prompt_logprobs is not None:
            return None
        if not s.cache_counted:
            s.cache_counted = True
            self.cache_stats["queries"] += len(s.prompt)
        return self.cache.lookup(s.prompt)

    def _save(self, s: Sequence, saves: list[tuple[int, int, int]], u: int) -> None:
        """Leave an entry at s.save_at[0]: its pages and a snapshot of its slot after the first u of its
        columns in this step (its frontier)."""
        f = s.save_at.pop(0)
        tokens = s.prompt[:f + 1]
        same = self.cache.find(tokens)
        if same is not None:                            # the same prefix saved meanwhile: now recent
            self.cache.touch(same)
            return
        if not self.cache.free_snaps:
            victim = self.cache.lru()
            if victim is None:
                return
            self._evict(victim)
        snap = self.cache.free_snaps.pop()
        pages = s.pages[:f // PAGE_SIZE]
        for p in pages:
            self.refs[p] += 1
        self.cache.add(f, tokens, pages, snap)
        self.cache_stats["saved"] += 1
        saves.append((s.slot, snap, u))

    def _evict(self, e) -> None:
        self.cache.remove(e)
        self._drop(reversed(e.pages))
        self.cache_stats["evicted"] += 1

    def _coming(self, s: Sequence, hit) -> bool:
        """Whether a running sequence will save an entry, before its prefill ends, that serves `s`
        further than `hit` does: the same prompt sent again before the first finished its prefill, or
        the n > 1 copies of one request. `s` then waits for it rather than compute that prefix a
        second time; once the running one has passed that frontier this no longer holds (saved, or
        evicted since: then `s` computes it)."""
        if self.cache is None or s.params.prompt_logprobs is not None:
            return False
        best = hit.frontier if hit is not None else 0
        return any(f > best and len(s.prompt) >= f + 2 and s.prompt[f] == r.prompt[f]
                   and s.prompt[:f + 1] == r.prompt[:f + 1] for r in self.running for f in r.save_at)

    def _admissible(self, s: Sequence) -> bool:
        """Whether _admit would admit `s` now (given a free slot): its pages, less those a cache hit
        shares, are free or would be once entries are evicted, and it waits for no running prefill's
        entry (_coming)."""
        hit = self._lookup(s)
        if self._coming(s, hit):
            return False
        need = self.pages_for(s) - (len(hit.pages) if hit is not None else 0)
        return need <= len(self.free_pages) + self._evictable(keep=hit)

    def _evictable(self, keep=None) -> int:
        """Pages that evicting every entry but `keep` would free (those only entries hold)."""
        if self.cache is None:
            return 0
        holders: dict[int, int] = {}
        for e in self.cache.entries:
            if e is not keep:
                for p in e.pages:
                    holders[p] = holders.get(p, 0) + 1
        return sum(1 for p, n in holders.items() if self.refs[p] == n)

    def _evict_for(self, need: int, keep=None) -> None:
        """Evict least recently used entries (never `keep`) until `need` pages are free; nothing when
        even evicting them all would not free enough (pages running sequences share stay held)."""
        if self.cache is None or need > len(self.free_pages) + self._evictable(keep):
            return
        while need > len(self.free_pages):
            # the least recently used entry whose eviction frees a page now (one whose pages running
            # sequences or other entries also hold frees nothing by itself), else the least recent
            freeing = [e for e in self.cache.entries if e is not keep and any(self.refs[p] == 1 for p in e.pages)]
            victim = min(freeing, key=lambda e: e.used) if freeing else self.cache.lru(keep)
            if victim is None:
                return
            self._evict(victim)

    def _take(self, n: int) -> list[int]:
        pages = [self.free_pages.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def _drop(self, pages) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_pages.append(p)

    def _release(self, s: Sequence) -> None:
        if s in self.running:
            self.running.remove(s)
            self.free_slots.append(s.slot)
            self._drop(reversed(s.pages))
            self.released.append(s.id)
        s.slot, s.pages, s.save_at = -1, [], []

    def usage(self) -> dict[str, int]:
        """pages_used: pages the running sequences hold; with the prefix cache, pages_cached: pages only
        cache entries hold (given back to admission when it needs them); the rest are free."""
        cached = 0
        if self.cache is not None:
            held = {p for s in self.running for p in s.pages}
            cached = len({p for e in self.cache.entries for p in e.pages} - held)
        out = dict(running=len(self.running), waiting=len(self.waiting),
                   slots_used=self.config.max_concurrency - len(self.free_slots),
                   pages_used=self.config.kv_pages - len(self.free_pages) - cached, pages_total=self.config.kv_pages)
        if self.cache is not None:
            out.update(pages_cached=cached, prefix_entries=len(self.cache.entries))
        return out
