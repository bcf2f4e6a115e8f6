"""The prompt-prefix cache (runtime/prefix_cache.py, the scheduler's pages and snapshots, the ranks'
snapshot copies).

Three levels: the model (a float64 prefill resumed from a GDN snapshot on shared KV pages equals the
whole prefill to 1e-12); the scheduler against a symbolic model of the ranks (each state slot and
snapshot slot holds the token prefix it summarises, each KV page the tokens written to it: every
step must read exactly its own sequence's tokens, through any sharing, eviction and cancellation);
and the engine (greedy and penalised sampled ids equal the float32 reference's at tp 1 and 2, with
MTP speculation and with int8 KV, with `cached_tokens` as the entry rules predict). The features a
request may combine with a hit are checked the same way: stop ids, n copies of one prompt sent at once,
page-aligned prompts and budgets, prompts that are strict prefixes of a cached one,
seeded sampling cold and warm, and grammars (against an engine without the cache, on the embedded
model); through OpenAI chat, a response_format, a stop string and n choices against a server without it.
"""

from __future__ import annotations

import random

import pytest
import torch

from ranks.model import Batch, HybridModel
from runtime.config import PAGE_SIZE, spec_from_hf
from runtime.prefix_cache import CACHE_MARGIN, PrefixCache
from runtime.sampling import SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.sequence import Sequence, Status
from tests.util import random_weights, rel, tiny_config, write_tiny_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The in-process references run far faster on one intra-op thread here (the ranks and other work
    share the cores; two spinning threads slowed them many times over)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _frontier(n: int) -> int:
    """The rule, restated: the last page boundary at least CACHE_MARGIN tokens before the end."""
    f = (n - 1 - CACHE_MARGIN) // PAGE_SIZE * PAGE_SIZE
    return f if f > 0 else 0


def test_frontier_rule():
    for n in range(1, 400):
        f = PrefixCache.frontier(n)
        assert f == _frontier(n) and f % PAGE_SIZE == 0 and (f == 0 or f + CACHE_MARGIN + 1 <= n)


# ---- the model: a resumed prefill equals the whole one ---------------------------------------------

@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_prefill_resumed_from_a_snapshot_equals_the_whole_prefill(moe, seed):
    """Sequence A prefills to a frontier F, its slot is saved to a snapshot; B (A's first F tokens, then
    its own) loads the snapshot into another slot, shares A's pages [0, F) and prefills from F. Its
    logits equal B's whole prefill on a fresh state, in float64."""
    spec = spec_from_hf(tiny_config(moe))
    model = HybridModel(spec, random_weights(spec, seed, dtype=torch.float64))
    g = torch.Generator().manual_seed(seed)
    F = 2 * PAGE_SIZE
    a = torch.randint(0, spec.vocab_size, (F + 40,), generator=g)
    b = torch.cat([a[:F], torch.randint(0, spec.vocab_size, (70,), generator=g)])
    state = model.new_state(num_slots=2, num_pages=8)
    state.reserve_snapshots(1)
    # slot 1 holds garbage first: the load must replace all of it
    for t in state.conv + state.recurrent:
        t[1].normal_(generator=g)
    ta = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    model.forward(Batch(a[:90], [90], [0], [0], ta), state, logits="none")
    model.forward(Batch(a[90:F], [F - 90], [90], [0], ta), state, logits="none")
    state.save_snapshot(0, 0)
    model.forward(Batch(a[F:], [40], [F], [0], ta), state, logits="none")     # A goes on past F
    state.load_snapshot(0, 1)
    tb = torch.tensor([[0, 1, 4, 5]], dtype=torch.int32)                     # A's pages of [0, F), then its own
    got = model.forward(Batch(b[F:], [70], [F], [1], tb), state, logits="all").logits
    fresh = model.new_state(num_slots=1, num_pages=4)
    want = model.forward(Batch(b, [len(b)], [0], [0], torch.arange(4, dtype=torch.int32)[None]), fresh,
                         logits="all").logits[F:]
    assert rel(got, want) < 1e-12


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_snapshots_saved_inside_a_prefill_step_equal_the_state_at_their_frontier(moe, seed):
    """Batch.saves: sequence A (fresh, and again resumed part-way) prefills in one step past two save
    points; each snapshot then resumes another sequence exactly as the whole prefill of its tokens,
    A's own state after the step is the one of the step without saves, and its logits too (float64)."""
    spec = spec_from_hf(tiny_config(moe))
    model = HybridModel(spec, random_weights(spec, seed, dtype=torch.float64))
    g = torch.Generator().manual_seed(seed)
    F1, F2 = PAGE_SIZE, 3 * PAGE_SIZE
    a = torch.randint(0, spec.vocab_size, (F2 + 30,), generator=g)
    start = 5                                         # A's step starts mid-way (its slot holds [0, 5))
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    plain = model.new_state(num_slots=1, num_pages=4)
    model.forward(Batch(a[:start], [start], [0], [0], table), plain, logits="none")
    want_a = model.forward(Batch(a[start:], [len(a) - start], [start], [0], table), plain, logits="all").logits
    state = model.new_state(num_slots=2, num_pages=8)
    state.reserve_snapshots(2)
    model.forward(Batch(a[:start], [start], [0], [0], table), state, logits="none")
    got_a = model.forward(Batch(a[start:], [len(a) - start], [start], [0], table,
                                saves=[(0, F2 - start, 1), (0, F1 - start, 0)]), state, logits="all").logits
    assert rel(got_a, want_a) < 1e-12
    for t, u in zip(state.conv + state.recurrent, plain.conv + plain.recurrent):
        assert rel(t[0], u[0]) < 1e-12
    for F, snap in ((F1, 0), (F2, 1)):
        b = torch.cat([a[:F], torch.randint(0, spec.vocab_size, (50,), generator=g)])
        for t in state.conv + state.recurrent:       # slot 1 holds garbage: the load must replace it
            t[1].normal_(generator=g)
        state.load_snapshot(snap, 1)
        pages = F // PAGE_SIZE
        tb = torch.tensor([list(range(pages)) + list(range(4, 8 - pages))], dtype=torch.int32)
        got = model.forward(Batch(b[F:], [50], [F], [1], tb), state, logits="all").logits
        fresh = model.new_state(num_slots=1, num_pages=4)
        want = model.forward(Batch(b, [len(b)], [0], [0], torch.arange(4, dtype=torch.int32)[None]), fresh,
                             logits="all").logits[F:]
        assert rel(got, want) < 1e-12, F


def test_in_step_saves_are_refused_where_they_cannot_apply():
    spec = spec_from_hf(tiny_config(False))
    model = HybridModel(spec, random_weights(spec, 0, dtype=torch.float32))
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    ids = torch.arange(1, 9)
    for bad in ([(0, 0, 0)], [(0, 8, 0)], [(1, 3, 0)], [(0, 3, -1)]):
        with pytest.raises(ValueError, match="save"):
            Batch(ids, [8], [0], [0], table, saves=bad)
    state = model.new_state(num_slots=1, num_pages=2)
    state.reserve_snapshots(1)
    with pytest.raises(ValueError, match="verification"):
        model.forward(Batch(ids, [8], [0], [0], table, saves=[(0, 3, 0)]), state, keep_columns=True)


@pytest.mark.parametrize("trial", range(4))
def test_cuda_models_in_step_save_bookkeeping_on_the_cpu(trial, seed):
    """The CUDA backend's side of Batch.saves, run on the CPU: _rule_parts' launches (row ranges,
    slots, cu_seqlens, fresh flags, the state copied after each) replayed with the reference rule in
    place of the kernel, and _save_conv_windows' windows, against the state after u columns of the
    whole sequence (gated_delta_rule_states, the conv over the first u inputs), float64, exactly."""
    import types

    import kernels.reference as R
    from ranks.model_cuda import CudaHybridModel
    rng = random.Random(seed + trial)
    g = torch.Generator().manual_seed(seed + trial)
    HV, DK, DV, C, K = 2, 4, 3, 5, 4
    B = rng.randint(1, 4)
    columns = [rng.randint(2, 40)] + [rng.randint(1, 40) for _ in range(B - 1)]
    starts = [rng.choice([0, 0, 7]) for _ in range(B)]
    slots = rng.sample(range(6), B)
    saves, snap = [], 0
    for b, c in enumerate(columns):
        for u in sorted(rng.sample(range(1, c), min(c - 1, rng.randint(1 if b == 0 else 0, 3)))):
            saves.append((b, u, snap))
            snap += 1
    host = Batch(torch.zeros(sum(columns), dtype=torch.long), columns, starts, slots,
                 torch.zeros(B, 1, dtype=torch.int32), saves)
    N = sum(columns)
    q, k = (torch.randn(N, HV, DK, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(N, HV, DV, generator=g, dtype=torch.float64)
    gate, beta = -torch.rand(N, HV, generator=g, dtype=torch.float64), torch.rand(N, HV, generator=g, dtype=torch.float64)
    S0 = torch.randn(6, HV, DK, DV, generator=g, dtype=torch.float64)
    fake = types.SimpleNamespace(device="cpu", _rule_parts_of=None)
    parts = CudaHybridModel._rule_parts(fake, host)
    assert CudaHybridModel._rule_parts(fake, host) is parts          # made once per step
    S, snaps, out = S0.clone(), {}, torch.full((N, HV, DV), float("nan"), dtype=torch.float64)
    for r0, r1, p_slots, p_cu, p_fresh, longest, save in parts:      # the kernel's contract, by the reference
        cu = p_cu.tolist()
        assert cu[0] == 0 and cu[-1] == r1 - r0 and longest == max(b - a for a, b in zip(cu, cu[1:]))
        for i, (sl, fr) in enumerate(zip(p_slots.tolist(), p_fresh.tolist())):
            lo, hi = r0 + cu[i], r0 + cu[i + 1]
            o, S[sl] = R.gated_delta_rule_recurrent(q[lo:hi], k[lo:hi], v[lo:hi], gate[lo:hi], beta[lo:hi],
                                                    None if fr else S[sl])
            out[lo:hi] = o
        if save is not None:
            snaps[save[1]] = S[save[0]].clone()
    assert sorted(snaps) == list(range(snap))
    for b, (lo, hi) in enumerate(host.bounds):
        o, states = R.gated_delta_rule_states(q[lo:hi], k[lo:hi], v[lo:hi], gate[lo:hi], beta[lo:hi],
                                              None if starts[b] == 0 else S0[slots[b]])
        assert torch.equal(out[lo:hi], o) and torch.equal(S[slots[b]], states[-1])
        for u, sn in host.saves_of(b):
            assert torch.equal(snaps[sn], states[u - 1]), (b, u)
    # the conv windows
    qkv = torch.randn(N, C, generator=g, dtype=torch.float64)
    state = types.SimpleNamespace(conv=[torch.randn(6, C, K - 1, generator=g, dtype=torch.float64)],
                                  snap_conv=[torch.full((max(snap, 1), C, K - 1), float("nan"), dtype=torch.float64)])
    CudaHybridModel._save_conv_windows(qkv, state, 0, host)
    w = torch.randn(C, K, generator=g, dtype=torch.float64)
    for b, (lo, _) in enumerate(host.bounds):
        old = None if starts[b] == 0 else state.conv[0][slots[b]]
        for u, sn in host.saves_of(b):
            assert torch.equal(state.snap_conv[0][sn], R.causal_conv1d(qkv[lo:lo + u], w, old)[1]), (b, u)


def test_in_step_threshold_is_the_cuda_fast_programs_column_limit():
    from ranks.model_cuda import MAX_FAST_COLUMNS
    from runtime.scheduler import IN_STEP_SAVE_MIN_COLUMNS
    assert IN_STEP_SAVE_MIN_COLUMNS == MAX_FAST_COLUMNS


# ---- the scheduler against a symbolic model of the ranks -----------------------------------------

class SymbolicRanks:
    """What the ranks hold, as tokens: slot and snapshot contents are the token prefixes their GDN
    state summarises; KV pages map positions to the token written there."""

    def __init__(self, slots: int, snaps: int, pages: int):
        self.slot: list[tuple] = [("garbage",)] * slots
        self.snap: list[tuple] = [("garbage",)] * snaps
        self.kv: list[dict] = [dict() for _ in range(pages)]

    def run(self, plan) -> None:
        for snap, slot in plan.loads:
            self.slot[slot] = self.snap[snap]
        saves = []
        for s, c, start in zip(plan.seqs, plan.columns, [s.computed for s in plan.seqs]):
            want = tuple(s.token(i) for i in range(start))
            prefix = () if start == 0 else self.slot[s.slot]
            assert prefix == want, f"seq {s.id}: its slot summarises {len(prefix)} other tokens at {start}"
            fed = tuple(s.token(i) for i in range(start, start + c))
            for slot, snap, u in plan.saves:                 # after u of its columns (in the step or at its end)
                if slot == s.slot:
                    assert 0 < u <= c, f"seq {s.id}: a save after {u} of its {c} columns"
                    saves.append((snap, want + fed[:u]))
            self.slot[s.slot] = want + fed
            for pos in range(start, start + c):
                self.kv[s.pages[pos // PAGE_SIZE]][pos % PAGE_SIZE] = s.token(pos)
            for pos in range(start + c):                     # every key the step's queries read
                assert self.kv[s.pages[pos // PAGE_SIZE]].get(pos % PAGE_SIZE) == s.token(pos), \
                    f"seq {s.id}: KV at position {pos} is not its token"
        assert len(saves) == len(plan.saves), "a save of a slot that runs nothing in the step"
        for snap, tokens in saves:
            self.snap[snap] = tokens


def _check_pages(sch: Scheduler) -> None:
    held = [0] * sch.config.kv_pages
    for s in sch.running:
        for p in s.pages:
            held[p] += 1
    for e in sch.cache.entries:
        assert len(e.pages) == e.frontier // PAGE_SIZE and len(e.tokens) == e.frontier + 1
        for p in e.pages:
            held[p] += 1
    assert held == sch.refs
    assert sorted(sch.free_pages) == [p for p in range(sch.config.kv_pages) if held[p] == 0]


@pytest.mark.parametrize("trial", range(3))
def test_scheduler_pages_and_snapshots_against_symbolic_ranks(trial, seed):
    """Conversations that grow, branch and repeat, with cancellations and a pool and cache small
    enough to evict: every step reads its own tokens, every page is held exactly as counted, and the
    hits are the ones the entry rules allow."""
    rng = random.Random(seed + trial)
    K = rng.choice([0, 2])
    cfg = SchedulerConfig(max_concurrency=3, max_pending=64, prefill_chunk=rng.choice([48, 100]), max_step_tokens=160,
                          kv_pages=rng.choice([12, 20]), max_context=600, spec_draft_tokens=K,
                          prefix_cache=rng.choice([1, 2, 4]), snapshot_in_step=rng.choice([0, 16, 60]))
    sch = Scheduler(cfg)
    ranks = SymbolicRanks(cfg.max_concurrency, cfg.prefix_cache, cfg.kv_pages)
    roots = [[rng.randrange(50) for _ in range(rng.randint(60, 300))] for _ in range(3)]
    sent: list[list[int]] = []
    ids, hits = iter(range(1, 10**6)), 0
    for step in range(600):
        if step >= 200 and hits >= 3:
            break
        if len(sch.waiting) < 4 and rng.random() < 0.5:
            if sent and rng.random() < 0.5:            # a follow-up: an earlier prompt, extended
                prompt = rng.choice(sent) + [rng.randrange(50) for _ in range(rng.randint(1, 60))]
            else:                                     # a branch of a root
                root = rng.choice(roots)
                prompt = root[:rng.randint(1, len(root))] + [rng.randrange(50) for _ in range(rng.randint(0, 40))]
            sent.append(prompt)
            p = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 60), ignore_eos=True)
            s = Sequence(next(ids), prompt, p, seed=0, max_new_tokens=min(p.max_new_tokens, 600 - len(prompt)),
                         stop_ids=frozenset())
            if s.max_new_tokens > 0 and sch.pages_for(s) <= cfg.kv_pages:
                sch.add(s)
        plan = sch.schedule()
        if plan is None:
            continue
        for s in plan.new:
            if s.cached_tokens:              # (its entry may already be evicted: the load comes first)
                hits += 1
                assert s.cached_tokens % PAGE_SIZE == 0 and len(s.prompt) >= s.cached_tokens + 2
                assert [slot for _, slot in plan.loads].count(s.slot) == 1
        ranks.run(plan)
        sampled = {s.id: rng.randrange(50) for s, smp in zip(plan.seqs, plan.sample) if smp}
        sch.commit(plan, sampled)
        for s in [s for s in sch.running if rng.random() < 0.03]:
            sch.cancel(s)
        _check_pages(sch)
    assert hits > 0, "the trial made no cache hit: it tested nothing of the cache"


@pytest.mark.parametrize("in_step", [0, 16, 50])
def test_a_prefill_chunk_is_cut_at_the_frontier_or_saves_inside_it(in_step):
    """Without in-step saves the chunk ends on the frontier and the state is saved after it; with them,
    a chunk longer than snapshot_in_step keeps its length and saves after the frontier's column."""
    sch = Scheduler(SchedulerConfig(max_concurrency=2, prefill_chunk=100, max_step_tokens=200, kv_pages=20,
                                    max_context=1000, prefix_cache=2, snapshot_in_step=in_step))
    p = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    prompt = list(range(1, 300))                      # frontier (299 - 9) // 64 * 64 = 256
    s = Sequence(1, prompt, p, seed=0, max_new_tokens=4, stop_ids=frozenset())
    sch.add(s)
    cols = []
    for _ in range(3):
        plan = sch.schedule()
        cols.append((plan.columns[0], plan.saves, plan.sample[0]))
        sch.commit(plan, {1: 7} if plan.sample[0] else {})
    assert [e.frontier for e in sch.cache.entries] == [256]
    if not in_step:
        assert cols == [(100, [], False), (100, [], False), (56, [(s.slot, 0, 56)], False)]
        plan = sch.schedule()
        assert plan.columns == [43] and plan.sample == [True]
    else:                                             # 99 columns > 16 and > 50: one step, saved mid-way
        assert cols == [(100, [], False), (100, [], False), (99, [(s.slot, 0, 56)], True)]
        assert s.output == [7]


def _drain(sch: Scheduler) -> list:
    """Run the scheduler's plans to the end (every sampling sequence samples token 3); the plans."""
    plans = []
    while (plan := sch.schedule()) is not None:
        plans.append(plan)
        sch.commit(plan, {q.id: 3 for q, smp in zip(plan.seqs, plan.sample) if smp})
    return plans


def test_two_frontiers_inside_one_chunk_are_both_saved_in_it():
    """A prompt that branches off an entry (at 300: branch frontier 256) and ends past another page
    (frontier 576), prefilled as one chunk of 600 columns: both saved in that step, in column order."""
    sch = Scheduler(SchedulerConfig(max_concurrency=2, prefill_chunk=1024, max_step_tokens=1024, kv_pages=40,
                                    max_context=2000, prefix_cache=4, snapshot_in_step=16))
    p = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    x = list(range(1, 401))
    sch.add(Sequence(1, x, p, seed=0, max_new_tokens=2, stop_ids=frozenset()))
    _drain(sch)
    assert [e.frontier for e in sch.cache.entries] == [384]
    y = Sequence(2, x[:300] + [1000 + i for i in range(300)], p, seed=0, max_new_tokens=2, stop_ids=frozenset())
    sch.add(y)
    plans = _drain(sch)
    assert plans[0].columns == [600] and plans[0].sample == [True] and y.cached_tokens == 0
    assert [u for _, _, u in plans[0].saves] == [256, 576] and len({slot for slot, _, _ in plans[0].saves}) == 1
    assert sorted(e.frontier for e in sch.cache.entries) == [256, 384, 576]


def test_short_chunks_end_on_the_frontier_even_with_in_step_saves():
    """A chunk of at most snapshot_in_step columns (the CUDA backend's graphed steps) still ends on the
    frontier and saves after it."""
    sch = Scheduler(SchedulerConfig(max_concurrency=2, prefill_chunk=12, max_step_tokens=64, kv_pages=20,
                                    max_context=1000, prefix_cache=2, snapshot_in_step=16))
    p = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    sch.add(Sequence(1, list(range(1, 271)), p, seed=0, max_new_tokens=2, stop_ids=frozenset()))  # frontier 256
    saving = [(plan.columns, [u for _, _, u in plan.saves]) for plan in _drain(sch) if plan.saves]
    assert saving == [([4], [4])]                       # the chunk [252, 264) cut at 256


def test_entries_are_evicted_only_when_that_admits_the_request():
    """A waiting request that evicting every entry would still not fit keeps the entries; one that it
    fits evicts the least recently used first, only as many as it needs."""
    sch = Scheduler(SchedulerConfig(max_concurrency=3, prefill_chunk=512, max_step_tokens=600, kv_pages=12,
                                    max_context=1000, prefix_cache=3))

    def seq(sid: int, first: int, n: int, max_new: int) -> Sequence:
        p = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
        return Sequence(sid, [first + k for k in range(n)], p, seed=0, max_new_tokens=max_new, stop_ids=frozenset())

    def step() -> None:
        plan = sch.schedule()
        sch.commit(plan, {x.id: 0 for x, smp in zip(plan.seqs, plan.sample) if smp})

    for i in range(3):                                   # three entries of 2 pages each (frontier 128)
        s = seq(i + 1, 1000 * (i + 1), 150, 1)
        sch.add(s)
        while not s.done:
            step()
    assert [e.frontier for e in sch.cache.entries] == [128] * 3 and len(sch.free_pages) == 6
    keeper = seq(4, 5000, 60, 196)                       # 4 pages, running on; too short to leave an entry
    sch.add(keeper)
    step()
    assert keeper.status.name == "RUNNING" and len(sch.free_pages) == 2
    big = seq(5, 6000, 500, 60)                          # 9 pages > 2 free + 6 the entries hold
    sch.add(big)
    step()
    assert big.status.name == "WAITING" and len(sch.cache.entries) == 3 and len(sch.free_pages) == 2
    sch.cancel(big)
    small = seq(6, 7000, 200, 10)                        # 4 pages: the oldest entry goes, the others stay
    sch.add(small)
    step()
    assert small.status.name == "RUNNING"
    assert sorted(e.tokens[0] for e in sch.cache.entries) == [2000, 3000, 7000]     # small left its own


def test_prompt_logprobs_requests_take_no_hit():
    sch = Scheduler(SchedulerConfig(max_concurrency=3, prefill_chunk=512, max_step_tokens=600, kv_pages=40,
                                    max_context=1000, prefix_cache=2))
    prompt = list(range(1, 200))
    a = Sequence(1, prompt, SamplingParams(temperature=0.0, max_new_tokens=2), seed=0, max_new_tokens=2,
                 stop_ids=frozenset())
    sch.add(a)
    while a.prefilling:
        sch.commit(sch.schedule(), {})
    b = Sequence(2, prompt + [7, 8], SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=0), seed=0,
                 max_new_tokens=2, stop_ids=frozenset())
    c = Sequence(3, prompt + [7, 8], SamplingParams(temperature=0.0, max_new_tokens=2), seed=0, max_new_tokens=2,
                 stop_ids=frozenset())
    sch.add(b)
    sch.add(c)
    plan = sch.schedule()
    # b computes its whole prompt (no hit) and leaves an entry at 192; c, the same prompt, waits for it
    assert b in plan.seqs and c not in plan.seqs and b.cached_tokens == 0 and plan.loads == []
    while c.status != Status.RUNNING:
        sch.commit(plan, {})
        plan = sch.schedule()
    assert c.cached_tokens == 192 and [slot for _, slot in plan.loads] == [c.slot]


# ---- the engine ---------------------------------------------------------------------------------------

def _turns(rng: random.Random, V: int) -> list[list[int]]:
    """A conversation: each turn's prompt extends the last one; then a branch of an earlier turn, a
    repeat of one, and a prompt sharing only a first few tokens."""
    p1 = [rng.randrange(V) for _ in range(150)]
    p2 = p1 + [rng.randrange(V) for _ in range(45)]
    p3 = p2 + [rng.randrange(V) for _ in range(90)]
    branch = p2[:140] + [rng.randrange(V) for _ in range(30)]
    other = p1[:20] + [rng.randrange(V) for _ in range(130)]
    return [p1, p2, p3, branch, list(p3), other]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _expected_cached(prompts: list[list[int]]) -> list[int]:
    """cached_tokens per prompt, run one after another, from the rules restated (capacity large enough):
    a hit is the longest entry whose tokens begin the prompt with a token to spare; a prompt leaves
    entries at its end frontier and at the page boundary before where it branches off an entry."""
    entries, out = [], []
    for p in prompts:
        f = max((len(e) - 1 for e in entries if len(p) >= len(e) + 1 and p[:len(e)] == e), default=0)
        out.append(f)
        branch = max(0, (max((_common(p, e) for e in entries), default=0) - 1) // PAGE_SIZE * PAGE_SIZE)
        for fr in sorted({branch, _frontier(len(p))}):
            if fr > f and p[:fr + 1] not in entries:
                entries.append(p[:fr + 1])
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.test_engine import HEADS, Reference
    cfg = tiny_config(False, **HEADS, head_dim=64)          # int8 KV groups 64 channels
    d = str(tmp_path_factory.mktemp("prefix"))
    spec, w = write_tiny_checkpoint(d, cfg, 4242)
    return d, Reference(spec, w)


def _reference_logprobs(ref, prompt: list[int], ids: list[int]) -> list[float]:
    """The float32 reference's log-probability of each of `ids` after `prompt` (one teacher-forced pass)."""
    seq = prompt + ids[:-1]
    pages = -(-len(seq) // PAGE_SIZE)
    state = ref.model.new_state(num_slots=1, num_pages=pages)
    logits = ref.model.forward(Batch(torch.tensor(seq), [len(seq)], [0], [0], torch.arange(pages, dtype=torch.int32)[None]),
                               state, logits="all").logits[len(prompt) - 1:]
    lp = torch.log_softmax(logits.double(), dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(ids)]


def _clear(ref, rng, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Turns (redrawn until no step of any of them has a near tie) and their reference greedy ids."""
    from tests.test_engine import MARGIN, _NearTie
    for _ in range(30):
        prompts = _turns(rng, ref.V)
        try:
            return prompts, [ref.greedy(p, n, MARGIN)[0] for p in prompts]
        except _NearTie:
            continue
    pytest.fail("no conversation without a near tie in 30 draws")


@pytest.mark.parametrize("tp,spec_k,kv,chunk,in_step", [
    (1, 0, "bf16", 64, True), (2, 0, "bf16", 64, True), (1, 2, "bf16", 64, True), (1, 0, "int8", 64, True),
    (1, 0, "bf16", 100, True), (2, 2, "bf16", 100, True), (1, 0, "bf16", 100, False)],
    ids=["tp1", "tp2", "tp1-mtp", "tp1-int8", "tp1-in-step", "tp2-mtp-in-step", "tp1-chunks-end-on-frontiers"])
def test_engine_turns_hit_the_cache_and_keep_the_reference_ids(tiny, tp, spec_k, kv, chunk, in_step, seed):
    """Chunks of 64 start and end on page boundaries, so frontiers end chunks; chunks of 100 put them
    inside, where they are saved mid-step (snapshot_in_step) or the chunk is cut there."""
    from runtime import Engine, EngineOptions
    from tests.test_engine import greedy

    d, ref = tiny
    rng = random.Random(seed)
    prompts, want = _clear(ref, rng, 12)
    opts = EngineOptions(max_concurrency=2, max_context=1024, prefill_chunk=chunk, threads_per_rank=1,
                         spec_draft_tokens=spec_k, kv_dtype=kv, prefix_cache=8, snapshot_in_step=in_step)
    eng = Engine.start(d, tp=tp, options=opts)
    try:
        cached = []
        for p, ids in zip(prompts, want):
            r = eng.submit(p, greedy(len(ids), logprobs=0)).result(timeout=120)
            assert r.error is None
            if kv == "bf16":           # int8 KV rounds keys and values: its ids are the cache-off engine's
                assert r.tokens == ids, f"turn {len(cached)}: {r.tokens} != reference {ids}"
                # the ids alone can survive a wrong GDN state on this tiny model; the logprobs cannot:
                # measured, the float32 engine is within 4e-4 of the reference, and a turn that starts
                # from a zeroed snapshot 0.025-2.3 off
                lp = _reference_logprobs(ref, p, ids)
                got = [v for v, _ in r.logprobs]
                assert max(abs(a - b) for a, b in zip(got, lp)) < 5e-3, f"turn {len(cached)}: {got} != {lp}"
            else:
                want[len(cached)] = r.tokens
            cached.append(r.usage.get("cached_tokens", 0))
        assert cached == _expected_cached(prompts)
        stats = eng.stats()["prefix_cache"]
        assert stats["hits"] == sum(cached) and stats["queries"] == sum(map(len, prompts))
    finally:
        eng.shutdown()
    if kv == "int8":                   # the same prompts without the cache: the same ids
        eng = Engine.start(d, tp=tp, options=EngineOptions(max_concurrency=2, max_context=1024, prefill_chunk=64,
                                                           threads_per_rank=1, kv_dtype=kv, prefix_cache=0))
        try:
            for p, ids in zip(prompts, want):
                assert eng.submit(p, greedy(len(ids))).result(timeout=120).tokens == ids
        finally:
            eng.shutdown()


def test_conversations_sharing_a_system_prompt_start_from_its_branch_frontier(tiny, seed):
    """Three conversations with one long system prompt and their own questions: the first leaves an
    entry at its end, the second misses it (it branches off before that frontier) but leaves one at
    the branch point, and the third starts there, with the reference's greedy ids."""
    from runtime import Engine, EngineOptions
    from tests.test_engine import MARGIN, _NearTie, greedy

    d, ref = tiny
    rng = random.Random(seed)
    system = [rng.randrange(ref.V) for _ in range(rng.randint(200, 330))]
    for _ in range(30):
        # questions long enough that each end frontier lies past the system prompt
        prompts = [system + [rng.randrange(ref.V) for _ in range(rng.randint(140, 200))] for _ in range(3)]
        if len({p[len(system)] for p in prompts}) < 3:
            continue                                  # the questions must differ from their first token
        try:
            want = [ref.greedy(p, 8, MARGIN)[0] for p in prompts]
            break
        except _NearTie:
            continue
    else:
        pytest.fail("no draw without a near tie")
    branch = (len(system) - 1) // PAGE_SIZE * PAGE_SIZE
    eng = Engine.start(d, tp=1, options=EngineOptions(max_concurrency=2, max_context=1024, prefill_chunk=64,
                                                      threads_per_rank=1, prefix_cache=4))
    try:
        got = [eng.submit(p, greedy(8)).result(timeout=120) for p in prompts]
    finally:
        eng.shutdown()
    assert [r.tokens for r in got] == want
    assert [r.usage.get("cached_tokens", 0) for r in got] == [0, 0, branch] == _expected_cached(prompts)


def test_engine_penalised_sampling_counts_the_cached_prompt(tiny, seed):
    """Repetition / presence / frequency penalties see the cached prompt tokens as if computed: a
    seeded, penalised request that starts on a cached prefix draws the reference's ids."""
    from runtime import Engine, EngineOptions
    from tests.test_engine import MARGIN, _NearTie

    d, ref = tiny
    rng = random.Random(seed)
    eng = Engine.start(d, tp=1, options=EngineOptions(max_concurrency=2, max_context=1024, prefill_chunk=64,
                                                      threads_per_rank=1, prefix_cache=4))
    try:
        checked = 0
        for _ in range(20):
            # the cached part and the computed part use different ids: the penalties of the cached
            # ones are only right if the samplers counted them
            base = [rng.randrange(40) for _ in range(150)]
            p = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=10, ignore_eos=True, seed=rng.randrange(1000),
                               repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3)
            follow = base + [40 + rng.randrange(8) for _ in range(30)]
            try:
                want = ref.sample(follow, p, MARGIN)[0]
            except _NearTie:
                continue
            eng.submit(base, SamplingParams(temperature=0.0, max_new_tokens=1)).result(timeout=120)
            r = eng.submit(follow, p).result(timeout=120)
            assert r.usage.get("cached_tokens") == 128
            assert r.tokens == want
            checked += 1
            if checked == 3:
                break
        assert checked, "every draw had a near tie"
    finally:
        eng.shutdown()


def test_engine_stress_concurrent_conversations_cancellations_and_constant_eviction(tiny, seed):
    """The strongest mix: conversations that grow by their own replies, branch and repeat, prompts at
    page boundaries and at the frontier's margin, a few very short ones, sent in concurrent waves to
    an engine with one cache entry and a pool of 12 pages (entries are evicted for snapshots and for
    pages all the time), some cancelled at once or after their first token, with and without MTP
    speculation. Every greedy or seeded, penalised request that ran to its end has the reference's
    ids (their paths redrawn away from near ties); once idle nothing is held but what the entry
    keeps, and a request needing the whole pool is still served."""
    from runtime import Engine, EngineOptions
    from tests.test_engine import MARGIN, _NearTie

    d, ref = tiny
    rng = random.Random(seed)
    V, pool, ctx = ref.V, 12, 768

    def clear(prefix: list[int], extra: int, p: SamplingParams) -> tuple[list[int], list[int]] | None:
        """prefix + `extra` fresh tokens (redrawn on a near tie) and the reference's ids."""
        for _ in range(8):
            prompt = prefix + [rng.randrange(V) for _ in range(extra)]
            try:
                return prompt, ref.sample(prompt, p, MARGIN)[0]
            except _NearTie:
                continue
        return None

    spec_k = rng.choice([0, 2])

    def params() -> SamplingParams:
        """Greedy, or penalised: seeded sampling (greedy under speculation, whose sampled rounds draw
        by rejection, not as the reference does)."""
        n = rng.randint(1, 8)
        if rng.random() < 0.5:
            return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
        return SamplingParams(temperature=0.0 if spec_k else 0.8, top_k=rng.choice([0, 20]), max_new_tokens=n,
                              ignore_eos=True, seed=rng.randrange(1 << 30), repetition_penalty=1.4,
                              presence_penalty=0.3, frequency_penalty=0.2)

    eng = Engine.start(d, tp=1, options=EngineOptions(max_concurrency=3, max_context=ctx, kv_capacity=pool * PAGE_SIZE,
                                                      prefill_chunk=rng.choice([48, 64, 100]), max_step_tokens=160,
                                                      threads_per_rank=1, spec_draft_tokens=spec_k, prefix_cache=1))
    try:
        history: list[list[int]] = []               # prompts and their replies, to grow and branch from
        sent: list[list[int]] = []                  # prompts, in order
        checked = cancelled = 0
        for n_wave in range(14):
            if n_wave >= 6 and eng.stats()["prefix_cache"]["hits"]:
                break
            wave = []
            for _ in range(rng.randint(2, 5)):
                p, kind = params(), rng.random()
                if history and kind < 0.45:                      # the next turn of a conversation
                    case = clear(rng.choice(history[-3:]), rng.randint(1, 20), p)
                elif history and kind < 0.6:                     # a repeat, or a branch of one
                    h = rng.choice(history)
                    case = clear(h[:rng.randint(1, len(h))], rng.randint(0, 3), p)
                elif kind < 0.85:                                # at a page boundary / the frontier's margin
                    f = PAGE_SIZE * rng.randint(1, 4)
                    base = history[0] if history and len(history[0]) > f else []
                    case = clear(base[:f], f + rng.choice([1, 2, CACHE_MARGIN, CACHE_MARGIN + 1, CACHE_MARGIN + 2])
                                 - len(base[:f]), p)
                else:                                            # very short
                    case = clear([], rng.randint(1, 3), p)
                if case is not None and len(case[0]) + p.max_new_tokens <= 400:
                    wave.append((case[0], p, case[1]))
            streams = [eng.submit(prompt, p) for prompt, p, _ in wave]
            sent += [prompt for prompt, _, _ in wave]
            when = [rng.choice(["now", "first", None, None, None, None]) for _ in wave]
            for st, w in zip(streams, when):
                if w == "now":
                    eng.cancel(st.id)
            first = [st.get(timeout=120) if w == "first" else None for st, w in zip(streams, when)]
            for st, ev in zip(streams, first):
                if ev is not None:
                    eng.cancel(st.id)
            # alone: a prompt of the wave again (its entry is then the one kept), and a branch 2 to 4
            # tokens past its frontier, whose first tokens the snapshot's GDN state decides
            long = [prompt for prompt, _, _ in wave if _frontier(len(prompt))]
            if long:
                h = rng.choice(long)
                f = _frontier(len(h))
                eng.submit(h, SamplingParams(temperature=0.0, max_new_tokens=1)).result(timeout=120)
                p = params()
                case = clear(h[:f + 1], rng.randint(1, 3), p)
                if case is not None:
                    wave.append((case[0], p, case[1]))
                    streams.append(eng.submit(case[0], p))
                    first.append(None)
            for (prompt, p, want), st, ev in zip(wave, streams, first):
                if ev is not None and ev.final:
                    tokens, reason, error = ev.tokens, ev.finish_reason, ev.error
                else:
                    r = st.result(timeout=120)
                    tokens, reason, error = (ev.tokens if ev else []) + r.tokens, r.finish_reason, r.error
                assert error is None, error
                if reason == "cancelled":
                    cancelled += 1
                    continue
                assert tokens == want, f"{len(prompt)}-token prompt, {p}, spec {spec_k}"
                checked += 1
                history.append(prompt + tokens)
        st = eng.stats()
        assert (st["running"], st["waiting"], st["slots_used"], st["pages_used"]) == (0, 0, 0, 0), st
        assert st["prefix_entries"] <= 1 and st["pages_cached"] <= 400 // PAGE_SIZE, st
        assert st["prefix_cache"]["hits"] > 0 and st["prefix_cache"]["evicted"] > 0, st["prefix_cache"]
        assert checked >= 10, (checked, cancelled)
        # nothing leaked: a request whose budget is the whole pool (its max_tokens fill the context) is
        # admitted, evicting the entry, and served
        n = pool * PAGE_SIZE - 300
        r = eng.submit([rng.randrange(V) for _ in range(300)],
                       SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)).result(timeout=120)
        assert r.finish_reason == "length" and len(r.tokens) == n
        assert eng.stats()["prefix_cache"]["entries"] == 1 and eng.stats()["pages_used"] == 0
    finally:
        eng.shutdown()


def _clear_case(ref, make_prompt, params: list[SamplingParams], draws: int = 30) -> tuple[list[int], list[list[int]]]:
    """A prompt from make_prompt() whose reference path under every one of `params` has no near tie,
    and the reference's ids for each (redrawn otherwise)."""
    from tests.test_engine import MARGIN, _NearTie
    for _ in range(draws):
        prompt = make_prompt()
        try:
            return prompt, [ref.sample(prompt, p, MARGIN)[0] for p in params]
        except _NearTie:
            continue
    pytest.fail(f"no prompt without a near tie in {draws} draws")


def test_stop_ids_end_requests_on_a_cached_prefix_where_the_reference_does(tiny, seed):
    """Stop ids end a request that started on a cached prefix at the first of them in the reference's
    ids, inclusive ("stop"): one that comes as the first token (sampled by the step that finishes the
    prompt from the snapshot), one mid-decode (a step planned ahead is then already queued for it),
    given in SamplingParams.stop_token_ids or to submit(); an id that only the cached prompt holds ends
    nothing (stop ids look at the output). The entry itself was left by a request that stopped on its
    first token, in the step that ended its prefill."""
    from runtime import Engine, EngineOptions
    from tests.test_engine import greedy

    d, ref = tiny
    rng = random.Random(seed)
    n = 16
    base, (base_ids,) = _clear_case(ref, lambda: [rng.randrange(ref.V) for _ in range(rng.randint(150, 260))],
                                    [greedy(n)])
    F = _frontier(len(base))
    follow = []
    while len(follow) < 3:
        # branches a few tokens past F: their first tokens are the ones the snapshot's GDN state decides
        prompt, (ids,) = _clear_case(ref, lambda: base[:F + 2 + rng.randrange(3)]
                                     + [rng.randrange(ref.V) for _ in range(rng.randrange(3))], [greedy(n)])
        if len(follow) != 1 or any(ids.index(t) >= 3 for t in ids):     # the second needs a later first occurrence
            follow.append((prompt, ids))
    (p0, ids0), (p1, ids1), (p2, ids2) = follow
    cached = _expected_cached([base, p0, p1, p2])
    assert cached == [0, F, F, F] and F > 0
    eng = Engine.start(d, tp=1, options=EngineOptions(max_concurrency=2, max_context=1024, prefill_chunk=64,
                                                      threads_per_rank=1, prefix_cache=4))
    try:
        r = eng.submit(base, greedy(n, stop_token_ids=(base_ids[0],))).result(timeout=120)
        assert (r.tokens, r.finish_reason, r.usage.get("cached_tokens", 0)) == (base_ids[:1], "stop", 0)
        # the first token
        r = eng.submit(p0, greedy(n), stop_token_ids={ids0[0]}).result(timeout=120)
        assert (r.tokens, r.finish_reason, r.usage.get("cached_tokens")) == (ids0[:1], "stop", cached[1])
        # mid-decode: the first occurrence of a later id ends it there; the first event already tells
        # the cached tokens (a server that stops at a stop string reads no further)
        at = rng.choice([k for k, t in enumerate(ids1) if ids1.index(t) == k >= 3])
        st, events = eng.submit(p1, greedy(n, stop_token_ids=(ids1[at],))), []
        while not (events and events[-1].final):
            events.append(st.get(timeout=120))
        last = events[-1]
        assert ([t for ev in events for t in ev.tokens], last.finish_reason, last.usage.get("cached_tokens")) \
            == (ids1[:at + 1], "stop", cached[2])
        assert events[0].tokens and events[0].cached_tokens == cached[2]
        # ids only the cached part of the prompt holds: the request runs to its length
        only_cached = sorted(set(p2[:cached[3]]) - set(ids2))[:4]
        assert only_cached, "every cached prompt id comes in the output too"
        r = eng.submit(p2, greedy(n, stop_token_ids=tuple(only_cached))).result(timeout=120)
        assert (r.tokens, r.finish_reason, r.usage.get("cached_tokens")) == (ids2, "length", cached[3])
    finally:
        eng.shutdown()


def test_copies_of_one_prompt_keep_each_reference_from_the_first_ones_entry(tiny, seed):
    """A request's n choices run as n engine requests of one prompt, seeds s, s + 1, ... (as the
    server makes them), here with a greedy copy, sent at once: the first computes the prompt (in one
    chunk, saving its frontier mid-step) and the others wait for that entry, then load the one snapshot
    into their slots and compute only their tails; one snapshot is saved. Each draws the reference's
    ids for its seed; a later copy of the first choice starts from the entry and draws them again."""
    from runtime import Engine, EngineOptions
    from tests.test_engine import greedy

    d, ref = tiny
    rng = random.Random(seed)
    s0 = rng.randrange(1 << 40)
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=10, ignore_eos=True, seed=s0 + i)
              for i in range(3)] + [greedy(10)]
    prompt, want = _clear_case(ref, lambda: [rng.randrange(ref.V) for _ in range(rng.randint(80, 118))], params)
    F = _frontier(len(prompt))                         # 64
    eng = Engine.start(d, tp=1, options=EngineOptions(max_concurrency=4, max_context=512, prefill_chunk=100,
                                                      threads_per_rank=1, prefix_cache=2))
    try:
        got = [st.result(timeout=120) for st in [eng.submit(prompt, p) for p in params]]
        assert [r.tokens for r in got] == want
        assert len({tuple(ids) for ids in want[:3]}) > 1, "the seeds drew the same ids: nothing tells them apart"
        assert [r.usage.get("cached_tokens", 0) for r in got] == [0, F, F, F]
        assert eng.stats()["prefix_cache"]["saved"] == 1
        again = eng.submit(prompt, params[0]).result(timeout=120)
        assert again.usage.get("cached_tokens") == F and again.tokens == want[0]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("spec_k", [0, 2], ids=["plain", "mtp"])
def test_page_aligned_prompts_and_budgets_on_cached_prefixes(tiny, spec_k, seed):
    """Prompt + max_tokens filling whole pages, prompts of whole pages, and a request needing the
    whole pool, on a five-page pool with the cache: A (250 + 6 = 4 pages; its entry at 192 keeps 3),
    B (A's first 195 tokens + 61 = 4 pages: 3 shared, 1 fresh), C (A's first 193 and 63 more: exactly
    4 pages of prompt, its new part exactly one page), D (312 fresh + 8: the whole pool, so the entry
    is evicted), then B's prompt again (a miss now). Greedy ids equal the reference's,
    every request ends by length with exactly max_tokens tokens, cached_tokens as the rules predict,
    with and without MTP speculation (whose 2K pages of slack D cannot have)."""
    from runtime import Engine, EngineOptions
    from tests.test_engine import MARGIN, _NearTie, greedy

    d, ref = tiny
    rng = random.Random(seed)

    def fresh(k: int) -> list[int]:
        return [rng.randrange(ref.V) for _ in range(k)]

    for _ in range(30):
        a = fresh(250)
        cases = [(a, 6), (a[:195], 61), (a[:193] + fresh(63), 8), (fresh(312), 8), (a[:195], 5)]
        try:
            want = [ref.greedy(p, m, MARGIN)[0] for p, m in cases]
            break
        except _NearTie:
            continue
    else:
        pytest.fail("no draw without a near tie")
    assert [(len(p) + m) % PAGE_SIZE for p, m in cases[:4]] == [0, 0, 8, 0] and len(cases[2][0]) % PAGE_SIZE == 0
    pool = 5
    eng = Engine.start(d, tp=1, options=EngineOptions(max_concurrency=2, max_context=pool * PAGE_SIZE,
                                                      kv_capacity=pool * PAGE_SIZE, prefill_chunk=48,
                                                      threads_per_rank=1, spec_draft_tokens=spec_k, prefix_cache=2))
    try:
        got = [eng.submit(p, greedy(m)).result(timeout=120) for p, m in cases]
        st = eng.stats()
    finally:
        eng.shutdown()
    assert [(r.error, r.finish_reason, len(r.tokens)) for r in got] == [(None, "length", m) for _, m in cases]
    assert [r.tokens for r in got] == want
    assert [r.usage.get("cached_tokens", 0) for r in got] == [0, 192, 192, 0, 0]
    assert st["prefix_cache"]["evicted"] >= 1 and st["pages_used"] == 0


@pytest.mark.parametrize("spec_k", [0, 2], ids=["plain", "mtp"])
def test_prompts_that_are_strict_prefixes_of_a_cached_prompt(tiny, spec_k, seed):
    """Prompts that are strict prefixes of an earlier, longer prompt (its entry's frontier F = 256 or
    beyond them): one token past F (too short to start from it: a token after F must be computed), two
    past F (starts there), and shorter ones that end before F, inside or just past an earlier page
    boundary, and within the first page. Each starts from the entries the rules predict (those the
    shorter prompts leave at their own frontiers and branch points included) and keeps the reference's
    greedy ids, with and without MTP speculation."""
    from runtime import Engine, EngineOptions
    from tests.test_engine import MARGIN, _NearTie, greedy

    d, ref = tiny
    rng = random.Random(seed)
    cuts = [None, 257, 200, 258, 130, 64, 66, 40, 194]
    for _ in range(30):
        a = [rng.randrange(ref.V) for _ in range(rng.randint(300, 315))]
        prompts = [a if c is None else a[:c] for c in cuts]
        try:
            want = [ref.greedy(p, 6, MARGIN)[0] for p in prompts]
            break
        except _NearTie:
            continue
    else:
        pytest.fail("no draw without a near tie")
    expected = _expected_cached(prompts)
    assert expected[1] == 0 and expected[3] == 256 and 0 in expected[4:] and any(expected[4:])
    eng = Engine.start(d, tp=1, options=EngineOptions(max_concurrency=2, max_context=1024, prefill_chunk=64,
                                                      threads_per_rank=1, spec_draft_tokens=spec_k, prefix_cache=8))
    try:
        got = [eng.submit(p, greedy(6)).result(timeout=120) for p in prompts]
    finally:
        eng.shutdown()
    assert [r.tokens for r in got] == want
    assert [r.usage.get("cached_tokens", 0) for r in got] == expected


@pytest.mark.parametrize("spec_k", [0, 2], ids=["plain", "mtp"])
def test_seeded_sampling_gives_the_same_ids_with_the_cache_cold_and_warm(tiny, spec_k, seed):
    """A seeded request (top-p, top-k, min-p, plain temperature) sent twice: the first computes its
    whole prompt and leaves an entry, the second starts from it; both draw the same ids, and without
    speculation the reference's (the draws are keyed by seed and position, so where the prompt's
    computation started must not matter). With MTP speculation the sampled rounds accept drafts by
    rejection, which the reference does not do: cold and warm must still agree, on the same drafts."""
    from runtime import Engine, EngineOptions

    d, ref = tiny
    rng = random.Random(seed)
    kinds = [dict(temperature=0.9, top_p=0.9), dict(temperature=0.8, top_k=20), dict(temperature=1.1, min_p=0.05),
             dict(temperature=0.7)]
    cases = []
    for kw in kinds:
        p = SamplingParams(max_new_tokens=12, ignore_eos=True, seed=rng.randrange(-2**63, 2**63), **kw)
        prompt, (ids,) = _clear_case(ref, lambda: [rng.randrange(ref.V) for _ in range(rng.randint(80, 260))], [p])
        cases.append((prompt, p, ids))
    # chunks of 100 columns: the frontier falls inside one of the cold request's chunks (saved mid-step)
    eng = Engine.start(d, tp=1, options=EngineOptions(max_concurrency=2, max_context=1024, prefill_chunk=100,
                                                      threads_per_rank=1, spec_draft_tokens=spec_k, prefix_cache=4))
    try:
        for prompt, p, ids in cases:
            cold = eng.submit(prompt, p).result(timeout=120)
            warm = eng.submit(prompt, p).result(timeout=120)
            assert (cold.usage.get("cached_tokens", 0), warm.usage.get("cached_tokens")) == (0, _frontier(len(prompt)))
            assert warm.tokens == cold.tokens, f"{p}: warm {warm.tokens} != cold {cold.tokens}"
            if not spec_k:
                assert cold.tokens == ids, f"{p}: {cold.tokens} != reference {ids}"
        if spec_k:
            assert eng.stats()["spec"]["drafted"] > 0
    finally:
        eng.shutdown()


def test_structured_outputs_on_a_cached_prefix_equal_the_engine_without_the_cache(seed):
    """Grammars (a JSON schema, a regex, a list of choices) under greedy, seeded temperature and seeded
    top-p with a repetition penalty, on the embedded model, for prompts that begin with a prefix an
    earlier request left in the cache: each starts from an entry (cached_tokens), its first token,
    masked, sampled by the step that finishes the prompt from the snapshot. They are sent together (the
    one snapshot loaded into several slots in a step). Their ids equal an engine's without the cache,
    and every finished output is a document that an independent validator (json + jsonschema,
    re.fullmatch, the list of choices) accepts."""
    import json
    import os
    import re

    from ranks.demo import PACKAGED_DIR
    from runtime import Engine, EngineOptions
    from runtime import grammar as G
    from runtime.config import load_spec
    from runtime.tokenizer import Tokenizer

    if not os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")):
        pytest.skip("no packaged demo model")
    jsonschema = pytest.importorskip("jsonschema")
    tok, spec = Tokenizer.from_dir(PACKAGED_DIR), load_spec(PACKAGED_DIR)
    eos = set(spec.eos_token_ids)
    rng = random.Random(seed)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colour"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 150},
                             "colour": {"enum": ["red", "green", "blue"]}}}
    regex, choices = r"[a-z]{2,8} is [0-9]{2,3}\.", ["alpha", "beta", "gamma delta"]
    grammars = [
        (G.compile_format({"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}, "response_format"),
         " Describe a person as JSON.", lambda text: jsonschema.validate(json.loads(text), schema)),
        (G.regex_grammar(regex, "guided_regex"), " Write a short sentence about a number.",
         lambda text: re.fullmatch(regex, text) or pytest.fail(f"{text!r} does not match {regex}")),
        (G.choice_grammar(choices, "guided_choice"), " Pick one word.",
         lambda text: text in choices or pytest.fail(f"{text!r} is not one of {choices}"))]
    samplers = [dict(temperature=0.0), dict(temperature=1.0, seed=rng.randrange(2**31)),
                dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=rng.randrange(2**31))]
    prefix = [rng.randrange(spec.vocab_size) for _ in range(rng.randint(150, 300))]
    prime = prefix + tok.encode(" Hello.")
    F = _frontier(len(prime))
    assert F + 1 <= len(prefix)                      # the entry stands for prefix tokens only
    reqs = [(prefix + tok.encode(text + " " * j), SamplingParams(max_new_tokens=160, grammar=g, **kw), ok)
            for g, text, ok in grammars for j, kw in enumerate(samplers)]
    runs = {}
    for cache in (0, 4):
        with Engine.start(PACKAGED_DIR, tp=1, options=EngineOptions(
                max_concurrency=len(reqs), max_context=1024, prefill_chunk=64, threads_per_rank=1,
                prefix_cache=cache)) as eng:
            eng.submit(prime, SamplingParams(temperature=0.0, max_new_tokens=1)).result(timeout=120)
            streams = [eng.submit(p, params) for p, params, _ in reqs]
            runs[cache] = [st.result(timeout=120) for st in streams]
    for (prompt, params, ok), off, on in zip(reqs, runs[0], runs[4]):
        assert off.error is None and on.error is None, (off.error, on.error)
        assert on.usage.get("cached_tokens", 0) >= F > 0 and "cached_tokens" not in off.usage
        assert (on.tokens, on.finish_reason) == (off.tokens, off.finish_reason), (params, tok.decode(on.tokens),
                                                                                   tok.decode(off.tokens))
        if on.finish_reason == "stop":
            ok(tok.decode(on.tokens[:-1] if on.tokens[-1] in eos else on.tokens))
    assert sum(r.finish_reason == "stop" for r in runs[4]) >= len(reqs) - 1, "the grammars ended too few outputs"


# ---- through the APIs ---------------------------------------------------------------------------------

def test_follow_up_turns_report_cached_tokens_through_the_apis():
    """The embedded model's chat template renders a conversation's next turn so that it begins with the
    last turn's prompt up to its frontier: OpenAI chat reports prompt_tokens_details.cached_tokens, and
    Anthropic Messages cache_read_input_tokens (input_tokens excluding them), for the second turn."""
    import os

    import httpx

    from ranks.demo import PACKAGED_DIR
    from tests.scripted_service import demo_app

    if not os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")):
        pytest.skip("no packaged demo model")
    system = "You answer in one short sentence. " * 30
    with demo_app() as (url, _service):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
        first = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "demo", "messages": msgs, "max_tokens": 12, "temperature": 0}).json()
        reply = first["choices"][0]["message"]
        msgs += [{"role": "assistant", "content": reply["content"] or ""}, {"role": "user", "content": "Another?"}]
        second = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "demo", "messages": msgs, "max_tokens": 12, "temperature": 0}).json()
        n1 = first["usage"]["prompt_tokens"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == _frontier(n1) > 0
        anthro = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another?"}]
        for turn in (anthro[:1], anthro):
            r = httpx.post(url + "/v1/messages", timeout=120, json={
                "model": "demo", "system": system, "messages": turn, "max_tokens": 8}).json()
        u = r["usage"]
        assert u["cache_read_input_tokens"] > 0 and u["cache_read_input_tokens"] % PAGE_SIZE == 0
        text = "def main():\n    return 0\n" * 40                       # completions: a prompt, then a batch
        first = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": text, "max_tokens": 4}).json()["usage"]
        batch = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": [text + "x = 1\n", "import os\n" * 3], "max_tokens": 4}).json()["usage"]
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        assert batch["prompt_tokens_details"]["cached_tokens"] == _frontier(first["prompt_tokens"]) > 0
        assert u["input_tokens"] >= 1              # the new part is computed


def test_chat_structured_output_stop_strings_and_n_choices_on_a_cached_prefix(seed):
    """Through OpenAI chat on the embedded model, with a long system prompt of random words: a
    json_schema response_format (greedy), a stop string (taken from the middle of the text the request
    gives without it) and n = 3 seeded, sampled choices. Each request goes once to a server without the
    cache and twice to one with it (the second time it starts from the entry the first left,
    prompt_tokens_details.cached_tokens; for n = 3 all three choices load that entry). All three answers
    agree: every choice's content and finish_reason, by index. (A request ended by a stop string is
    cancelled in the engine before its last event: its cached_tokens must come from the first one.)"""
    import json
    import os
    import string

    import httpx

    from ranks.demo import PACKAGED_DIR
    from tests.scripted_service import demo_app

    if not os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")):
        pytest.skip("no packaged demo model")
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7))) for _ in range(120)]
    system = {"role": "system", "content": "Remember these words: " + " ".join(words) + "."}
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}

    def body(user: str, **kw) -> dict:
        return {"model": "demo", "messages": [system, {"role": "user", "content": user}],
                "chat_template_kwargs": {"enable_thinking": False}, **kw}

    def post(url: str, b: dict) -> dict:
        r = httpx.post(url + "/v1/chat/completions", json=b, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def answers(r: dict) -> list[tuple]:
        return [(c["index"], c["message"]["content"], c["finish_reason"]) for c in r["choices"]]

    with demo_app(prefix_cache=0) as (ref_url, _), demo_app() as (url, _):
        free = post(ref_url, body("Tell me about the weather.", max_tokens=30, temperature=0))
        text = free["choices"][0]["message"]["content"]
        starts = [k for k in range(len(text) // 3, len(text) - 3)
                  if text.index(text[k:k + 4]) == k and not text[k - 1].isspace()]   # (content is rstripped)
        assert starts, f"no stop string to take from {text!r}"
        k = rng.choice(starts)
        requests = [
            body("Describe one user account as JSON.", max_tokens=80, temperature=0,
                 response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": schema}}),
            body("Tell me about the weather.", max_tokens=30, temperature=0, stop=[text[k:k + 4]]),
            body("Name a colour.", max_tokens=16, temperature=0.9, seed=rng.randrange(2**31), n=3)]
        wants = []
        for b in requests:
            want = post(ref_url, b)
            cold, warm = post(url, b), post(url, b)
            assert answers(cold) == answers(want) and answers(warm) == answers(want), (b["messages"][1], answers(want),
                                                                                       answers(cold), answers(warm))
            n = warm["usage"]["prompt_tokens"]
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == _frontier(n) > 0
            assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            wants.append(answers(want))
    # what the reference answers are (so that the agreement above means something)
    (_, doc, reason), = wants[0]
    assert reason == "stop" and set(json.loads(doc)) == {"name", "age"}, doc
    assert wants[1] == [(0, text[:k], "stop")]
    assert len(wants[2]) == 3 and len({content for _, content, _ in wants[2]}) > 1, wants[2]


@pytest.mark.parametrize("trial", range(3))
def test_a_step_planned_ahead_never_delays_an_admission(trial, seed):
    """The coordinator plans the next decode step ahead (Scheduler.plan_ahead) and only admits when it
    does not: so plan_ahead must decline whenever the first waiting request could be admitted now,
    also when that takes evicting entries or sharing a hit's pages (free pages alone too few). Checked
    against admission itself, run on a copy of the scheduler at each step planned ahead."""
    import copy

    rng = random.Random(seed + trial)
    cfg = SchedulerConfig(max_concurrency=rng.choice([2, 3]), max_pending=64, prefill_chunk=rng.choice([48, 200]),
                          max_step_tokens=256, kv_pages=rng.choice([8, 10, 14]), max_context=600,
                          prefix_cache=rng.choice([1, 2, 4]))
    sch = Scheduler(cfg)
    roots = [[rng.randrange(50) for _ in range(rng.randint(100, 400))] for _ in range(3)]
    ids, inflight, checked = iter(range(1, 10**6)), None, 0
    for _ in range(1500):
        if len(sch.waiting) < 3 and rng.random() < 0.3:
            root = rng.choice(roots)
            prompt = root[:rng.randint(1, len(root))] + [rng.randrange(50) for _ in range(rng.randint(0, 20))]
            n = rng.randint(1, 120)
            s = Sequence(next(ids), prompt, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), seed=0,
                         max_new_tokens=min(n, 600 - len(prompt)), stop_ids=frozenset())
            if s.max_new_tokens > 0 and sch.pages_for(s) <= cfg.kv_pages:
                sch.add(s)
        if inflight is None:
            inflight = sch.schedule()
            if inflight is None:
                continue
        twin = copy.deepcopy(sch)
        ahead = sch.plan_ahead(inflight)
        if sch.waiting and twin._admit([]):
            assert ahead is None, "a step was planned ahead while a waiting request could be admitted"
            checked += 1
        sch.commit(inflight, {s.id: rng.randrange(50) for s, smp in zip(inflight.seqs, inflight.sample) if smp})
        inflight = ahead
    assert checked, "no request became admissible while steps were planned ahead: the trial tested nothing"


def test_eviction_for_pages_skips_entries_that_free_none():
    """Admission short of pages evicts the least recently used entry that frees a page, not an older
    one whose pages a running request shares (evicting it would free nothing)."""
    sch = Scheduler(SchedulerConfig(max_concurrency=3, prefill_chunk=512, max_step_tokens=600, kv_pages=10,
                                    max_context=1000, prefix_cache=3))

    def seq(sid: int, prompt: list[int], max_new: int) -> Sequence:
        p = SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
        return Sequence(sid, prompt, p, seed=0, max_new_tokens=max_new, stop_ids=frozenset())

    def step() -> None:
        plan = sch.schedule()
        sch.commit(plan, {x.id: 0 for x, smp in zip(plan.seqs, plan.sample) if smp})

    old_prompt = [1000 + k for k in range(150)]
    for sid, prompt in ((1, old_prompt), (2, [2000 + k for k in range(150)])):    # entries A (older), B
        s = seq(sid, prompt, 1)
        sch.add(s)
        while not s.done:
            step()
    user = seq(3, old_prompt + [7] * 20, 40)           # hits A: A's 2 pages shared with a running request
    sch.add(user)
    step()
    assert user.cached_tokens == 128 and user.status.name == "RUNNING"
    a, b = sorted(sch.cache.entries, key=lambda e: e.tokens[0])
    sch.cache.touch(b)                                 # A least recent, but evicting it frees nothing
    free = len(sch.free_pages)
    late = seq(4, [3000 + k for k in range(60)], 64 * (free + 2) - 60)      # needs 2 pages more than free
    sch.add(late)
    step()
    assert late.status.name == "RUNNING"
    assert [e.tokens[0] for e in sch.cache.entries] == [1000]               # B went, A stayed


def test_copies_of_one_prompt_wait_for_the_first_ones_frontier():
    """n > 1 copies of a request (or the same prompt sent again while the first still prefills): the
    first computes the prompt; the others are admitted once its frontier is saved and start there, so
    the prompt is computed once plus each copy's tail, instead of once per copy."""
    sch = Scheduler(SchedulerConfig(max_concurrency=3, prefill_chunk=100, max_step_tokens=400, kv_pages=40,
                                    max_context=1000, prefix_cache=2, snapshot_in_step=16))
    p = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    prompt = list(range(1, 301))                      # frontier 256
    copies = [Sequence(i, list(prompt), p, seed=i, max_new_tokens=2, stop_ids=frozenset()) for i in (1, 2, 3)]
    for s in copies:
        sch.add(s)
    plans = _drain(sch)
    prefilled = {s.id: 0 for s in copies}
    for plan in plans:
        for s, c in zip(plan.seqs, plan.columns):
            prefilled[s.id] += c
    assert copies[0].cached_tokens == 0 and [s.cached_tokens for s in copies[1:]] == [256, 256]
    assert all(s.output == [3, 3] for s in copies)
    # the first copy: 300 prompt columns + 1 decode; the others: 44 + 1
    assert prefilled == {1: 301, 2: 45, 3: 45}
    assert plans[0].seqs == [copies[0]]               # the others waited, in arrival order


def test_a_request_waits_only_for_a_prefix_that_serves_it():
    """A prompt that shares less than a running prefill's next frontier is admitted at once, and one
    with prompt_logprobs (which takes no hit) never waits."""
    sch = Scheduler(SchedulerConfig(max_concurrency=3, prefill_chunk=50, max_step_tokens=400, kv_pages=40,
                                    max_context=1000, prefix_cache=2, snapshot_in_step=16))
    p = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    first = list(range(1, 301))
    other = first[:200] + [999] * 100                  # agrees up to 200 < the frontier 256
    logp = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True, prompt_logprobs=0)
    seqs = [Sequence(1, first, p, seed=0, max_new_tokens=2, stop_ids=frozenset()),
            Sequence(2, other, p, seed=0, max_new_tokens=2, stop_ids=frozenset()),
            Sequence(3, list(first), logp, seed=0, max_new_tokens=2, stop_ids=frozenset())]
    for s in seqs:
        sch.add(s)
    plan = sch.schedule()
    assert [s.id for s in plan.seqs] == [1, 2, 3]
