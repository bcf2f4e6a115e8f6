"""runtime.scheduler: admission order, KV reservation, chunking budget, release, pending timeout.

Pure bookkeeping, no processes: the expected plans are worked out by hand here (small cases) or
checked against invariants restated independently of the implementation (a random workload).
Time is faked by moving Sequence.submitted_at into the past; nothing sleeps.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from runtime.config import PAGE_SIZE
from runtime.sampling import SamplingParams
from runtime.scheduler import Overloaded, Scheduler, SchedulerConfig
from runtime.sequence import Sequence, Status

_ids = iter(range(1, 10**9))


def seq(prompt_len: int, max_new: int, *, stop=(), first_token: int = 0) -> Sequence:
    prompt = [(first_token + i) % 256 for i in range(prompt_len)]
    return Sequence(id=next(_ids), prompt=prompt, params=SamplingParams(temperature=0), seed=0,
                    max_new_tokens=max_new, stop_ids=frozenset(stop))


def cfg(**kw) -> SchedulerConfig:
    base = dict(max_concurrency=4, max_pending=16, pending_timeout_s=60.0, prefill_chunk=64, max_step_tokens=128,
                kv_pages=32, max_context=4096)
    base.update(kw)
    return SchedulerConfig(**base)


def plan_of(plan) -> list[tuple[int, int, bool]]:
    return [(s.id, c, f) for s, c, f in zip(plan.seqs, plan.columns, plan.sample)]


def run_step(sched: Scheduler, token_for=lambda s: 7):
    """Plan one step and commit it with `token_for(seq)` for every sampled sequence."""
    plan = sched.schedule()
    if plan is None:
        return None, []
    sampled = {s.id: token_for(s) for s, f in zip(plan.seqs, plan.sample) if f}
    return plan, sched.commit(plan, sampled)


def check_books(sched: Scheduler) -> None:
    """Every page and slot is either free or owned by exactly one running sequence."""
    c = sched.config
    owned_pages = [p for s in sched.running for p in s.pages]
    assert len(owned_pages) == len(set(owned_pages)), "a page is owned twice"
    assert not set(owned_pages) & set(sched.free_pages), "a page is both free and owned"
    assert sorted(owned_pages + sched.free_pages) == list(range(c.kv_pages))
    slots = [s.slot for s in sched.running]
    assert sorted(slots + sched.free_slots) == list(range(c.max_concurrency))
    for s in sched.running:
        assert s.status == Status.RUNNING and len(s.pages) == -(-(len(s.prompt) + s.max_new_tokens) // PAGE_SIZE)
    for s in sched.waiting:
        assert s.status == Status.WAITING and s.slot == -1 and not s.pages
    u = sched.usage()
    assert u["pages_used"] == len(owned_pages) and u["slots_used"] == len(slots)
    assert u["running"] == len(sched.running) and u["waiting"] == len(sched.waiting)


# --------------------------------------------------------------------------------------------------
# Configuration


@pytest.mark.parametrize("field", ["max_concurrency", "max_pending", "prefill_chunk", "max_step_tokens", "kv_pages",
                                   "max_context"])
def test_config_rejects_non_positive(field):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: 0})


def test_config_needs_a_decode_column_per_slot():
    with pytest.raises(ValueError, match="max_step_tokens"):
        cfg(max_concurrency=8, max_step_tokens=7)


# --------------------------------------------------------------------------------------------------
# Admission and reservation


def test_reservation_is_prompt_plus_budget_in_pages():
    sched = Scheduler(cfg())
    for n, new, pages in [(1, 1, 1), (63, 1, 1), (64, 1, 2), (10, 54, 1), (10, 55, 2), (200, 300, 8)]:
        assert sched.pages_for(seq(n, new)) == pages, (n, new)


def test_speculation_reserves_two_rounds_of_slack_when_the_pool_has_it():
    """With K drafts a sequence reserves prompt + budget + 2K positions (a round near the budget keeps
    pages for its K+1 verification columns and K draft positions); without room in the pool for the
    slack, the plain reservation."""
    sched = Scheduler(cfg(spec_draft_tokens=3))
    for n, new, pages in [(1, 1, 1), (57, 1, 1), (58, 1, 2), (10, 48, 1), (10, 49, 2), (200, 300, 8)]:
        assert sched.pages_for(seq(n, new)) == pages, (n, new)
    tight = Scheduler(cfg(spec_draft_tokens=3, kv_pages=2))
    assert tight.pages_for(seq(100, 28)) == 2                # 128 + 6 would need 3 pages: no slack


def test_admission_in_arrival_order_and_slot_limit():
    sched = Scheduler(cfg(max_concurrency=2))
    a, b, c = seq(5, 3), seq(5, 3), seq(5, 3)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert [s.id for s in plan.new] == [a.id, b.id]
    assert [s.id for s in sched.waiting] == [c.id] and c.status == Status.WAITING
    assert {a.slot, b.slot} == {0, 1}
    check_books(sched)


def test_no_overtaking_when_the_head_does_not_fit():
    """A big request at the head of the queue blocks smaller ones behind it (no starvation)."""
    sched = Scheduler(cfg(kv_pages=10, max_concurrency=4))
    hog = seq(64 * 6, 1)            # 7 pages
    big = seq(64 * 5, 1)            # 6 pages: does not fit next to the hog
    small = seq(5, 1)               # 1 page: would fit, but must wait behind big
    for s in (hog, big, small):
        sched.add(s)
    plan = sched.schedule()
    assert [s.id for s in plan.new] == [hog.id]
    assert [s.id for s in sched.waiting] == [big.id, small.id]
    assert sched.usage()["pages_used"] == 7
    # the hog finishes: both are admitted, in order
    while hog.status == Status.RUNNING:
        run_step(sched)
    plan = sched.schedule()
    assert [s.id for s in plan.new] == [big.id, small.id]
    check_books(sched)


def test_request_bigger_than_the_pool_is_refused():
    sched = Scheduler(cfg(kv_pages=4))
    with pytest.raises(ValueError, match="KV"):
        sched.add(seq(200, 57))      # 257 tokens = 5 pages > 4
    sched.add(seq(200, 56))          # 256 tokens = 4 pages: fits exactly
    assert sched.schedule().new


@pytest.mark.parametrize("slots", [1, 3])
def test_max_pending_raises_overloaded_beyond_what_the_free_slots_take(slots):
    """A burst added before the step that admits it: the free slots take the first of it, so
    max_concurrency + max_pending get in (pending() counts only the requests beyond the free slots)."""
    sched = Scheduler(cfg(max_pending=2, max_concurrency=slots))
    burst = [seq(5, 5) for _ in range(slots + 2)]
    for s in burst:
        assert sched.pending() <= 2
        sched.add(s)
    assert sched.pending() == 2 and sched.pending(1) == 3
    with pytest.raises(Overloaded, match="2 requests are already waiting"):
        sched.add(seq(5, 5))
    assert sched.schedule().new == burst[:slots]        # still 2 waiting for a slot: full
    assert sched.pending() == 2
    with pytest.raises(Overloaded):
        sched.add(seq(5, 5))
    sched.cancel(burst[0])                              # a slot frees: one more
    assert sched.pending() == 1
    sched.add(seq(5, 5))
    with pytest.raises(Overloaded):
        sched.add(seq(5, 5))


# --------------------------------------------------------------------------------------------------
# Step planning


def test_chunked_prefill_budget_and_sample_flags():
    sched = Scheduler(cfg(max_concurrency=3, prefill_chunk=64, max_step_tokens=100))
    a, b, c = seq(150, 4), seq(30, 4), seq(10, 4)
    for s in (a, b, c):
        sched.add(s)
    # step 1: a gets a chunk of 64, b the rest of the budget (30 < 36: its whole prompt), c 6
    plan, ev = run_step(sched)
    assert plan_of(plan) == [(a.id, 64, False), (b.id, 30, True), (c.id, 6, False)]
    assert [e[0].id for e in ev] == [b.id]
    # step 2: b decodes first (1), then a 64, then c the remaining 4 of its prompt (budget 35 left)
    plan, ev = run_step(sched)
    assert plan_of(plan) == [(b.id, 1, True), (a.id, 64, False), (c.id, 4, True)]
    # step 3: b, c decode; a's last 22
    plan = sched.schedule()
    assert plan_of(plan) == [(b.id, 1, True), (c.id, 1, True), (a.id, 22, True)]
    arrays = plan.to_arrays(max(len(s.pages) for s in plan.seqs))
    assert arrays["starts"].tolist() == [30 + 1, 10, 128]
    assert arrays["columns"].tolist() == [1, 1, 22]
    assert arrays["token_ids"].tolist() == [b.output[0], c.output[0]] + a.prompt[128:150]
    assert arrays["slots"].tolist() == [b.slot, c.slot, a.slot]
    assert arrays["sample"].dtype == np.int8 and arrays["sample"].tolist() == [1, 1, 1]
    for row, s in zip(arrays["page_tables"], plan.seqs):
        assert row[:len(s.pages)].tolist() == s.pages
    sched.commit(plan, {a.id: 1, b.id: 2, c.id: 3})
    assert a.computed == 150 and b.computed == 32 and c.computed == 11
    assert not any(s.prefilling for s in (a, b, c))


def test_decodes_always_fit_and_prefill_takes_the_rest():
    c = cfg(max_concurrency=4, prefill_chunk=1000, max_step_tokens=4 + 9)
    sched = Scheduler(c)
    shorts = [seq(1, 50) for _ in range(3)]
    long = seq(100, 5)
    for s in shorts:
        sched.add(s)
    run_step(sched)                                       # the three shorts prefill (1 column) and sample
    sched.add(long)
    for _ in range(5):
        plan, _ = run_step(sched)
        cols = dict((s.id, n) for s, n in zip(plan.seqs, plan.columns))
        assert all(cols[s.id] == 1 for s in shorts)
        assert cols[long.id] == 13 - 3
        assert sum(plan.columns) <= c.max_step_tokens


def test_finish_by_length_and_stop_releases():
    sched = Scheduler(cfg())
    a = seq(3, 2)                 # length: 2 tokens
    b = seq(3, 10, stop={99})     # stop at token 99 (sampled as its third token)
    sched.add(a), sched.add(b)
    outs = {a.id: iter([5, 6]), b.id: iter([1, 2, 99])}
    reasons, released = {}, []
    while sched.running or sched.waiting:
        plan, events = run_step(sched, lambda s: next(outs[s.id]))
        released += plan.released
        for i in plan.released:
            assert i in reasons, "released before it ended"
        for s, tok, reason in events:
            if reason:
                reasons[s.id] = reason
        check_books(sched)
    assert reasons == {a.id: "length", b.id: "stop"}
    assert a.output == [5, 6] and b.output == [1, 2, 99]
    assert a.status == b.status == Status.FINISHED and a.slot == b.slot == -1 and not a.pages
    assert sched.usage()["pages_used"] == 0 and sched.usage()["slots_used"] == 0
    # the ranks learn about both releases in the next plan
    c = seq(4, 1)
    sched.add(c)
    plan = sched.schedule()
    released += plan.released
    assert sorted(released) == sorted([a.id, b.id]), "each release is reported to the ranks exactly once"
    assert sched.released == []


def test_cancel_waiting_running_and_during_a_step():
    sched = Scheduler(cfg(max_concurrency=1))
    run, wait = seq(100, 20), seq(5, 5)
    sched.add(run), sched.add(wait)
    plan = sched.schedule()                               # run admitted, gets a prefill chunk
    sched.cancel(wait)                                    # cancelled while waiting
    assert wait.status == Status.CANCELLED and not sched.waiting
    sched.cancel(run)                                     # cancelled while its step is in flight
    events = sched.commit(plan, {})
    assert events == [] and run.computed == 0, "a cancelled sequence must ignore its in-flight result"
    check_books(sched)
    assert sched.usage() == dict(running=0, waiting=0, slots_used=0, pages_used=0, pages_total=32)
    sched.cancel(run)                                     # idempotent
    assert run.status == Status.CANCELLED
    assert sched.schedule() is None                       # nothing to run; the release is kept for later
    nxt = seq(3, 1)
    sched.add(nxt)
    assert sched.schedule().released == [run.id]


def test_cancel_with_failure_status_keeps_reason():
    sched = Scheduler(cfg())
    s = seq(5, 5)
    sched.add(s)
    sched.schedule()
    sched.cancel(s, Status.FAILED, "rank 1 died")
    assert s.status == Status.FAILED and s.error == "rank 1 died" and s.done


def test_pending_timeout_with_a_fake_clock():
    sched = Scheduler(cfg(max_concurrency=1, pending_timeout_s=30.0))
    running, old, young = seq(5, 100), seq(5, 5), seq(5, 5)
    for s in (running, old, young):
        sched.add(s)
    sched.schedule()
    now = young.submitted_at
    old.submitted_at = now - 31.0                      # waited longer than the timeout
    young.submitted_at = now - 29.0
    running.submitted_at = now - 1000.0               # running requests never expire
    expired = sched.expire(now)
    assert [s.id for s in expired] == [old.id]
    assert old.status == Status.FAILED and "30" in old.error
    assert [s.id for s in sched.waiting] == [young.id] and running.status == Status.RUNNING
    assert sched.expire(now) == []
    check_books(sched)


# --------------------------------------------------------------------------------------------------
# A random workload against restated invariants


def test_random_workload_keeps_the_books(seed):
    rng = random.Random(seed)
    c = cfg(max_concurrency=5, max_pending=40, prefill_chunk=rng.choice([16, 64]), max_step_tokens=rng.choice([5, 40, 100]),
            kv_pages=rng.choice([12, 40]), max_context=1024)
    sched = Scheduler(c)
    submitted: list[Sequence] = []
    fed: dict[int, list[int]] = {}              # every input token a sequence was given, in order
    admitted_order: list[int] = []
    for step in range(1500):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            s = seq(rng.randint(1, 150), rng.randint(1, 40), stop={rng.randrange(256)}, first_token=rng.randrange(256))
            if sched.pages_for(s) > c.kv_pages:
                continue
            try:
                sched.add(s)
            except Overloaded:
                assert sched.pending() >= c.max_pending
                continue
            submitted.append(s)
        for s in list(sched.running) + list(sched.waiting):
            if rng.random() < 0.01:
                sched.cancel(s)
        plan = sched.schedule()
        if plan is None:
            assert not sched.running and not sched.waiting
            continue
        admitted_order += [s.id for s in plan.new]
        assert sum(plan.columns) <= c.max_step_tokens
        assert len(plan.seqs) == len({s.id for s in plan.seqs}) <= c.max_concurrency
        decoding = [s for s in sched.running if not s.prefilling]
        assert {s.id for s in decoding} <= {s.id for s in plan.seqs}, "a decoding sequence was skipped"
        arrays = plan.to_arrays(max(len(s.pages) for s in plan.seqs))
        at = 0
        for s, n, flag, start in zip(plan.seqs, plan.columns, plan.sample, arrays["starts"]):
            assert start == len(fed.setdefault(s.id, []))
            assert n <= (c.prefill_chunk if s.prefilling else 1)
            fed[s.id] += arrays["token_ids"][at:at + n].tolist()
            at += n
            assert flag == (start + n == s.length)
        # a random subset of the running sequences gets cancelled while the step is in flight
        in_flight_cancel = [s for s in plan.seqs if rng.random() < 0.02]
        for s in in_flight_cancel:
            sched.cancel(s)
        sched.commit(plan, {s.id: rng.randrange(256) for s, f in zip(plan.seqs, plan.sample) if f})
        check_books(sched)
    # admission happened in submission order (no overtaking), skipping only cancelled-while-waiting ones
    order = {s.id: i for i, s in enumerate(submitted)}
    assert [order[i] for i in admitted_order] == sorted(order[i] for i in admitted_order)
    for s in submitted:
        if s.status == Status.FINISHED:
            # the inputs were exactly prompt + output minus the last sampled token
            assert fed[s.id] == (s.prompt + s.output)[:s.length - 1]
            assert s.finish_reason == ("stop" if s.output[-1] in s.stop_ids else "length")
            assert len(s.output) <= s.max_new_tokens
    statuses = [s.status for s in submitted]
    assert statuses.count(Status.FINISHED) >= 5 and statuses.count(Status.CANCELLED) >= 1, "the workload was too thin"
    for s in list(sched.running) + list(sched.waiting):
        sched.cancel(s)
    check_books(sched)
    assert sched.usage()["pages_used"] == 0 and sched.usage()["slots_used"] == 0


# --------------------------------------------------------------------------------------------------
# Steps planned ahead (the coordinator's overlapped loop)


def _overlapped_run(seed: int, overlap: bool) -> tuple[dict[int, list[int]], int]:
    """The coordinator's loop on a random workload (arrivals per committed step, stop ids, lengths)
    with simulated ranks: plans reach them in send order, as arrays built at send time; a token id -1
    is what they sampled for that sequence last; the token sampled at position p of sequence k is
    (k * 7919 + p * 104729) % 256. -> (outputs by arrival index, steps planned ahead)."""
    rng = random.Random(seed)
    c = cfg(max_concurrency=4, max_pending=256, prefill_chunk=rng.choice([8, 64]), max_step_tokens=rng.choice([6, 80]),
            kv_pages=rng.choice([10, 40]), max_context=1024)
    sched = Scheduler(c)
    seqs: list[Sequence] = []
    fed: dict[int, list[int]] = {}
    last: dict[int, int] = {}
    ahead_steps = 0

    def send(plan) -> dict:
        return plan.to_arrays(max(len(s.pages) for s in plan.seqs))

    def execute(arrays) -> dict[int, int]:
        sampled, at = {}, 0
        for sid, n, start, flag in zip(arrays["seq_ids"].tolist(), arrays["columns"].tolist(),
                                       arrays["starts"].tolist(), arrays["sample"].tolist()):
            toks = [last[sid] if t == -1 else t for t in arrays["token_ids"][at:at + n].tolist()]
            at += n
            assert start == len(fed.setdefault(sid, [])), "a step starts where the ranks' state is not"
            fed[sid] += toks
            if flag:
                last[sid] = sampled[sid] = (sid * 7919 + (start + n) * 104729) % 256
        return sampled

    inflight = None
    for step in range(1200):
        if step < 400:
            for _ in range(rng.choice([0, 0, 0, 0, 0, 1])):
                k = len(seqs) + 1
                s = Sequence(id=k, prompt=[(k * 31 + i) % 256 for i in range(rng.randint(1, 60))],
                             params=SamplingParams(temperature=0), seed=0, max_new_tokens=rng.randint(1, 30),
                             stop_ids=frozenset({rng.randrange(256)}))
                if sched.pages_for(s) <= c.kv_pages:
                    sched.add(s)
                    seqs.append(s)
        if inflight is None:
            plan = sched.schedule()
            if plan is None:
                continue
            inflight = (plan, send(plan))
        ahead = None
        if overlap:
            a = sched.plan_ahead(inflight[0])
            if a is not None:
                assert a.starts == [s.computed + c for s, c in zip(inflight[0].seqs, inflight[0].columns)
                                    if s in a.seqs]
                ahead, ahead_steps = (a, send(a)), ahead_steps + 1
        sched.commit(inflight[0], execute(inflight[1]))
        check_books(sched)
        inflight = ahead
    assert not sched.running and not sched.waiting and inflight is None
    for s in seqs:
        full = s.prompt + s.output
        assert s.done and fed[s.id] == full[:len(fed[s.id])] and len(fed[s.id]) >= len(full) - 1
        assert s.output == [(s.id * 7919 + (len(s.prompt) + i) * 104729) % 256 for i in range(len(s.output))]
    return {s.id: s.output for s in seqs}, ahead_steps


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_steps_planned_ahead_give_every_sequence_the_same_tokens(seed):
    plain, none = _overlapped_run(seed, overlap=False)
    overlapped, ahead = _overlapped_run(seed, overlap=True)
    assert none == 0 and ahead > 20, ahead
    assert overlapped == plain


def test_plan_ahead_waits_for_what_needs_the_result():
    def started(*seqs_, **kw):
        sched = Scheduler(cfg(**kw))
        for s in seqs_:
            sched.add(s)
        return sched
    # a decode step: planned ahead at the next positions, tokens left to the ranks (-1)
    a, b = seq(5, 10), seq(3, 10)
    sched = started(a, b)
    plan, _ = run_step(sched)                         # both prompts in one step, both sample
    inflight = sched.schedule()
    ahead = sched.plan_ahead(inflight)
    assert plan_of(ahead) == [(a.id, 1, True), (b.id, 1, True)] and ahead.starts == [6, 4]
    arrays = ahead.to_arrays(2)
    assert arrays["token_ids"].tolist() == [-1, -1] and arrays["starts"].tolist() == [6, 4]
    assert ahead.step == inflight.step + 1
    # a sequence whose last token comes from the step in flight is left out
    c_ = seq(4, 2)
    sched = started(c_, seq(4, 10))
    run_step(sched)
    inflight = sched.schedule()
    assert [s.id for s in sched.plan_ahead(inflight).seqs] == [inflight.seqs[1].id]
    # a prompt chunk that does not sample, or a prompt still waiting for its chunk
    sched = started(seq(100, 5), prefill_chunk=64)
    assert sched.plan_ahead(sched.schedule()) is None
    sched = started(seq(4, 9), seq(200, 5), prefill_chunk=64, max_step_tokens=64)
    run_step(sched)
    assert sched.plan_ahead(sched.schedule()) is None
    # an admissible waiting request; a full engine does not wait for it
    sched = started(seq(4, 9))
    inflight = sched.schedule()
    sched.add(seq(4, 9))
    assert sched.plan_ahead(inflight) is None
    sched = started(seq(4, 9), max_concurrency=1)
    run_step(sched)
    sched.add(seq(4, 9))
    assert sched.plan_ahead(sched.schedule()) is not None
    # the thinking budget may replace the next token; speculation plans its own rounds
    s = Sequence(id=next(_ids), prompt=[1, 2, 3], params=SamplingParams(temperature=0, thinking_budget=4,
                 thinking_end_ids=(9,), thinking_close_ids=(9,)), seed=0, max_new_tokens=9, stop_ids=frozenset())
    sched = started(s)
    run_step(sched)
    assert sched.plan_ahead(sched.schedule()) is None
    sched = started(seq(4, 9), spec_draft_tokens=2)
    run_step(sched)
    assert sched.plan_ahead(sched.schedule()) is None
