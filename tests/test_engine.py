"""runtime.Engine end to end on CPU: rank processes, mailbox, scheduler, sampler, failure handling.

Every output is compared with an independent reference: ranks.model.HybridModel run in this process
(one float32 prefill, then one-column decode steps, greedy or with the sampler applied to one
sequence alone), and for one config Hugging Face transformers' greedy generate.

float32 sums in another order (tp splits, chunked prefill, batch shapes) move these hot random
models' logits by up to ~4e-3 (measured: top-two gap differences p99 ~5e-4, max ~4e-3 at tp 4 over
500 positions), so a prompt whose reference path passes a near tie (top-two gap < MARGIN) could
legitimately flip a token; such prompts / seeds are redrawn before the engine sees them (about 1 in
70 positions is that close). The MoE router is the other place where those last bits can flip a
choice: two experts whose softmax probabilities sit within ROUTER_MARGIN of each other at the top-k
boundary swap under a different summation order (seen: a gap of 8e-7 at tp 4 moved the next logit by
1.1), so a reference path that routes any token that close is redrawn too. Everything else must match
exactly.

Engines cost ~2-4 s to start (process spawn, torch import): one dense tp 1 and one dense tp 2 engine
are shared by the module; tp 4, MoE and failure tests start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import random
import signal
import threading
import time
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ops
from ranks.model import Batch, HybridModel
from ranks.sampler import SeqSampler, apply_penalties, filtered_log_probs, gumbel_noise, sample_rows
from runtime import Engine, EngineError, EngineOptions, SamplingParams
from runtime.config import PAGE_SIZE, spec_from_hf
from runtime.scheduler import Overloaded
from tests.conftest import BASE_SEED
from tests.util import tiny_config, write_tiny_checkpoint

MARGIN = 1e-2           # top-two logit gap the reference path must keep (see module doc)
ROUTER_MARGIN = 2e-5    # gap between the k-th and (k+1)-th expert probability it must keep (MoE)
TIMEOUT = 120           # seconds any single wait may take before the test calls it a hang
HEADS = dict(num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
OPTS = EngineOptions(max_concurrency=8, max_pending=64, prefill_chunk=64, max_step_tokens=256, max_context=1024,
                     threads_per_rank=1, startup_timeout_s=180)


def _seed(name: str) -> int:
    return (BASE_SEED + zlib.crc32(name.encode())) % 2**31


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)


# --------------------------------------------------------------------------------------------------
# The in-process reference


class _NearTie(Exception):
    pass


@contextlib.contextmanager
def _router_watch(margin: float):
    """While the reference runs: raise _NearTie if the MoE router puts any token's k-th and (k+1)-th
    expert within `margin` of each other in probability (the reference's own rule: fp32 softmax)."""
    if margin <= 0:
        yield
        return
    route = ops.moe_route

    def watched(x, w_router, top_k):
        probs = torch.softmax(F.linear(x, w_router).float(), dim=-1)
        if top_k < probs.shape[-1]:
            p = torch.topk(probs, top_k + 1, dim=-1).values
            if float((p[:, top_k - 1] - p[:, top_k]).min()) < margin:
                raise _NearTie
        return route(x, w_router, top_k)
    ops.moe_route = watched            # moe_block looks the name up in its module at each call
    try:
        yield
    finally:
        ops.moe_route = route


class Reference:
    """One sequence at a time through HybridModel (float32, tp 1, whole-prompt prefill)."""

    def __init__(self, spec, weights):
        self.spec = spec
        self.model = HybridModel(spec, weights)
        self.V = spec.vocab_size

    def _run(self, prompt: list[int], n: int, pick, router_margin: float = 0.0) -> list[int]:
        pages = math.ceil((len(prompt) + n) / PAGE_SIZE)
        state = self.model.new_state(num_slots=1, num_pages=pages)
        table = torch.arange(pages, dtype=torch.int32)[None]

        def forward(tokens, pos):
            with _router_watch(router_margin):
                return self.model.forward(Batch(torch.tensor(tokens), [len(tokens)], [pos], [0], table),
                                          state).logits
        logits = forward(prompt, 0)
        out = []
        for i in range(n):
            tok = pick(logits[0], len(prompt) + i)
            out.append(tok)
            if i + 1 < n:
                logits = forward([tok], len(prompt) + i)
        return out

    def greedy(self, prompt: list[int], n: int, margin: float = 0.0) -> tuple[list[int], float]:
        """Greedy ids and the smallest top-two gap on the way (raises _NearTie below `margin`)."""
        gaps = []

        def pick(logits, _pos):
            top = torch.topk(logits, 2).values
            gaps.append(float(top[0] - top[1]))
            if gaps[-1] < margin:
                raise _NearTie
            return int(ops.greedy(logits[None])[0])
        return self._run(prompt, n, pick, ROUTER_MARGIN if margin > 0 else 0.0), min(gaps)

    def sample(self, prompt: list[int], p: SamplingParams, margin: float = 0.0) -> tuple[list[int], float]:
        """The engine's sampler semantics on one sequence: penalties over what it has seen, a draw keyed
        by (seed, position); returns the ids and the smallest top-two score gap along the way in logit
        units (score gap x temperature; raises _NearTie below `margin`)."""
        s = SeqSampler(temperature=p.temperature, top_k=min(p.top_k, self.V), top_p=p.top_p, min_p=p.min_p,
                       presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                       repetition_penalty=p.repetition_penalty, seed=p.seed, prompt_len=len(prompt),
                       bias=p.logit_bias)
        s.observe(prompt, 0)
        gaps = []

        def pick(logits, pos):
            if pos > len(prompt):
                s.observe([out_so_far[-1]], pos - 1)
            row = apply_penalties(logits.double(), s, 0)
            if s.needs_full_distribution:
                score = filtered_log_probs(row.float(), s) + gumbel_noise(s.seed, pos, self.V)
            elif s.greedy:
                score = row.float().double()
            else:
                score = (row / s.temperature + gumbel_noise(s.seed, pos, self.V)).float().double()
            top = torch.topk(score, 2).values
            gaps.append(float(top[0] - top[1]) * (s.temperature or 1.0) if torch.isfinite(top[1]) else math.inf)
            if gaps[-1] < margin:
                raise _NearTie
            tok = sample_rows(logits[None].float(), [s], [pos], rank=0, tp=1, gather=None)[0]
            assert tok == int(torch.argmax(score)), "the reference's score is not the sampler's"
            out_so_far.append(tok)
            return tok

        out_so_far: list[int] = []
        return self._run(prompt, p.max_new_tokens, pick, ROUTER_MARGIN if margin > 0 else 0.0), min(gaps)

    def clear_prompts(self, rng: random.Random, lengths: list[int], n: int) -> list[tuple[list[int], list[int]]]:
        """(prompt, reference greedy ids) for each length, redrawn until the path has no near tie."""
        out = []
        for length in lengths:
            for _ in range(50):
                prompt = [rng.randrange(self.V) for _ in range(length)]
                try:
                    ids, _ = self.greedy(prompt, n, MARGIN)
                except _NearTie:
                    continue
                out.append((prompt, ids))
                break
            else:                                                    # pragma: no cover
                pytest.fail(f"no prompt of length {length} without a near tie in 50 draws")
        return out


@dataclasses.dataclass
class Model:
    kind: str
    dir: str
    cfg: dict
    ref: Reference


def _build(tmp_path_factory, kind: str) -> Model:
    cfg = tiny_config(kind == "moe", **HEADS)
    d = str(tmp_path_factory.mktemp(kind))
    spec, w = write_tiny_checkpoint(d, cfg, _seed("engine-" + kind))
    return Model(kind, d, cfg, Reference(spec, w))


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """This machine runs the reference far faster on one intra-op thread (and the ranks share the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Model:
    return _build(tmp_path_factory, "dense")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Model:
    return _build(tmp_path_factory, "moe")


@pytest.fixture(scope="module")
def shared(dense):
    """The module's long-lived engines over the dense checkpoint, by tp (started on first use)."""
    live: dict[int, Engine] = {}

    def get(tp: int) -> Engine:
        if tp not in live:
            live[tp] = Engine.start(dense.dir, tp=tp, options=OPTS)
        assert live[tp].stats()["healthy"]
        return live[tp]

    yield get
    for e in live.values():
        e.shutdown()


def _idle(eng: Engine) -> None:
    s = eng.stats()
    assert (s["running"], s["waiting"], s["slots_used"], s["pages_used"]) == (0, 0, 0, 0), s


def _good_request(eng: Engine, model: Model) -> None:
    """A known-good request after a bad one: served, and correct."""
    if model.kind not in _good_request.cache:
        _good_request.cache[model.kind] = model.ref.clear_prompts(random.Random(7), [9], 6)[0]
    prompt, ids = _good_request.cache[model.kind]
    r = eng.submit(prompt, greedy(6)).result(timeout=TIMEOUT)
    assert r.error is None and r.tokens == ids and r.finish_reason == "length"


_good_request.cache = {}


# --------------------------------------------------------------------------------------------------
# 1. Greedy parity: tp 1 / 2 / 4 processes = in-process reference = transformers


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_ids_equal_reference_at_every_tp(kind, tp, request, shared):
    model: Model = request.getfixturevalue(kind)
    cases = model.ref.clear_prompts(random.Random(_seed(f"parity-{kind}")), [1, 7, 65, 200], 16)
    own = None if kind == "dense" and tp in (1, 2) else Engine.start(model.dir, tp=tp, options=OPTS)
    eng = own or shared(tp)
    try:
        streams = [eng.submit(p, greedy(len(ids))) for p, ids in cases]       # together: batched steps
        for (p, ids), st in zip(cases, streams):
            r = st.result(timeout=TIMEOUT)
            assert r.error is None and r.finish_reason == "length"
            assert r.tokens == ids, f"{kind} tp {tp}, prompt of {len(p)}: {r.tokens} != reference {ids}"
            assert r.usage == dict(prompt_tokens=len(p), completion_tokens=len(ids))
        p, ids = cases[2]                                                     # and alone
        assert eng.submit(p, greedy(len(ids))).result(timeout=TIMEOUT).tokens == ids
        assert eng.stats()["tp"] == tp
        _idle(eng)
    finally:
        if own is not None:
            own.shutdown()


def test_greedy_ids_equal_transformers_generate(dense, shared):
    transformers = pytest.importorskip("transformers", minversion="5.2")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(dense.dir, dtype=torch.float32).eval()
    cases = dense.ref.clear_prompts(random.Random(_seed("hf")), [3, 40, 130], 20)
    eng = shared(2)
    streams = [eng.submit(p, greedy(20)) for p, _ in cases]
    for (prompt, ref_ids), st in zip(cases, streams):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                              min_new_tokens=20, eos_token_id=None, pad_token_id=0)
        hf_ids = out[0, len(prompt):].tolist()
        got = st.result(timeout=TIMEOUT).tokens
        assert got == hf_ids, f"prompt of {len(prompt)}: engine {got} != transformers {hf_ids}"
        assert ref_ids == hf_ids


# --------------------------------------------------------------------------------------------------
# 2. 32 concurrent requests, staggered, batched, queued and chunked: each equals its solo result


def test_32_staggered_requests_each_equal_their_solo_ids(dense, shared):
    rng = random.Random(_seed("concurrent"))
    lengths = [1, 500, 2, 64, 65, 129, 300, 450] + [rng.randint(1, 500) for _ in range(24)]
    rng.shuffle(lengths)
    budgets = [rng.randint(1, 40) for _ in lengths]
    cases = [dense.ref.clear_prompts(rng, [n], b)[0] for n, b in zip(lengths, budgets)]
    eng = shared(1)
    before = eng.stats()
    seen = dict(waiting=0, running=0)
    stop_monitor = threading.Event()

    def monitor():
        while not stop_monitor.wait(0.002):
            s = eng.stats()
            seen["waiting"] = max(seen["waiting"], s["waiting"])
            seen["running"] = max(seen["running"], s["running"])

    mon = threading.Thread(target=monitor, daemon=True)
    mon.start()
    streams: list = [None] * len(cases)
    firsts: dict[int, list[int]] = {}

    def submit(i: int) -> None:
        p, ids = cases[i]
        streams[i] = eng.submit(p, greedy(len(ids)))

    # a burst of 12 (more than the 8 slots), then 4 threads that each submit their next request
    # only once their previous one has produced its first event: arrivals spread over the run
    for i in range(12):
        submit(i)

    def staggered(k: int) -> None:
        for i in range(12 + k, len(cases), 4):
            submit(i)
            ev = streams[i].get(timeout=TIMEOUT)
            firsts[i] = ev.tokens
            if ev.final:
                firsts[i] = ("final", ev)

    threads = [threading.Thread(target=staggered, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    for i, ((p, ids), st) in enumerate(zip(cases, streams)):
        if isinstance(firsts.get(i), tuple):
            ev = firsts[i][1]
            tokens, reason, err = ev.tokens, ev.finish_reason, ev.error
        else:
            r = st.result(timeout=TIMEOUT)
            tokens, reason, err = firsts.get(i, []) + r.tokens, r.finish_reason, r.error
        assert err is None and reason == "length"
        assert tokens == ids, f"request {i} (prompt {len(p)}, budget {len(ids)}): {tokens} != solo {ids}"
    stop_monitor.set()
    mon.join()
    after = eng.stats()
    assert seen["waiting"] > 0, "no request ever queued: the test did not exercise admission"
    assert seen["running"] == OPTS.max_concurrency, f"at most {seen['running']} ran at once"
    generated = sum(len(ids) for _, ids in cases)
    assert after["generated_tokens"] - before["generated_tokens"] == generated
    assert after["steps"] - before["steps"] < generated, "no step carried more than one sequence"
    # the step-time split covers every step (with steps planned ahead, rank 0 may start a step before
    # the coordinator waits for it, so its time in a step is not bounded by the wait)
    t0, t1 = before["step_time"], after["step_time"]
    assert t1["steps"] - t0["steps"] == after["steps"] - before["steps"]
    assert t1["rank_s"] > t0["rank_s"] and t1["wait_s"] > t0["wait_s"] and t1["coordinator_s"] > t0["coordinator_s"]
    _idle(eng)


# --------------------------------------------------------------------------------------------------
# 3. Seeded sampling: the same ids alone, in a busy batch, and at tp 2


def _seeded_cases(ref: Reference, rng: random.Random) -> list[tuple[list[int], SamplingParams, list[int]]]:
    kinds = [dict(temperature=0.9, top_k=40, top_p=0.9, presence_penalty=0.4, repetition_penalty=1.3),
             dict(temperature=0.7, frequency_penalty=0.5),                       # per-token path
             dict(temperature=1.1, min_p=0.05, top_k=2**70),                      # huge top_k: clamped, no overflow
             dict(temperature=0.8, top_p=0.8, seed_hi=True)]
    out = []
    for kw in kinds:
        for _ in range(50):
            prompt = [rng.randrange(ref.V) for _ in range(rng.randint(5, 150))]
            seed = rng.randrange(2**64 - 2**20, 2**64) if kw.get("seed_hi") else rng.randrange(-2**63, 2**63)
            p = SamplingParams(max_new_tokens=24, ignore_eos=True, seed=seed,
                               **{k: v for k, v in kw.items() if k != "seed_hi"})
            try:
                ids, _ = ref.sample(prompt, p, MARGIN)
            except _NearTie:
                continue
            out.append((prompt, p, ids))
            break
        else:                                                            # pragma: no cover
            pytest.fail("no seed without a near tie in 50 draws")
    return out


def test_seeded_sampling_is_reproducible_across_batches_and_tp(dense, shared):
    rng = random.Random(_seed("seeded"))
    cases = _seeded_cases(dense.ref, rng)
    distinct = {tuple(ids) for _, _, ids in cases}
    assert len(distinct) == len(cases)
    for tp in (1, 2):
        eng = shared(tp)
        # alone, one at a time
        for prompt, p, ids in cases:
            assert eng.submit(prompt, p).result(timeout=TIMEOUT).tokens == ids, f"tp {tp}, alone, {p}"
        # inside a busy batch: unseeded sampled and greedy neighbours, long prefills, staggered arrivals
        noise = []
        for k in range(7):
            n = rng.choice([3, 90, 333, 480])
            noise.append(eng.submit([rng.randrange(dense.ref.V) for _ in range(n)],
                                    SamplingParams(temperature=1.0, max_new_tokens=rng.randint(5, 40), ignore_eos=True)
                                    if k % 2 else greedy(rng.randint(5, 40))))
            if k == 3:
                noise[0].get(timeout=TIMEOUT)
        busy = []
        for prompt, p, ids in cases:
            busy.append(eng.submit(prompt, p))
            noise.append(eng.submit([rng.randrange(dense.ref.V) for _ in range(200)], greedy(10)))
        for (prompt, p, ids), st in zip(cases, busy):
            assert st.result(timeout=TIMEOUT).tokens == ids, f"tp {tp}, busy batch, {p}"
        for st in noise:
            assert st.result(timeout=TIMEOUT).error is None
        _idle(eng)


def _min_tokens_reference(ref: Reference, prompt: list[int], stop: int, min_tokens: int, n: int) -> list[int]:
    """Greedy ids with `stop` out of the first min_tokens picks, ending at the first `stop` after them
    (raises _NearTie where the masked top two are within MARGIN)."""
    def pick(logits, pos):
        row = logits.clone()
        if pos - len(prompt) < min_tokens:
            row[stop] = float("-inf")
        top = torch.topk(row, 2).values
        if float(top[0] - top[1]) < MARGIN:
            raise _NearTie
        return int(torch.argmax(row))
    ids = ref._run(prompt, n, pick)
    return ids[:ids.index(stop) + 1] if stop in ids[min_tokens:] else ids


def test_min_tokens_keeps_the_stop_ids_out_until_that_many_tokens(dense, shared):
    """SamplingParams.min_tokens: a greedy request whose stop id is its own third token ends there
    without min_tokens; with min_tokens 7 the stop id is masked out of its first seven tokens (the
    float32 reference's greedy path with that id at -inf there) and may end it after them; at tp 1 and
    2, beside a plain request, with MTP speculation (the masked sequence stays out of its rounds until
    the count is reached)."""
    rng = random.Random(_seed("min-tokens"))
    ref = dense.ref
    for _ in range(50):
        (prompt, ids), = ref.clear_prompts(rng, [rng.randint(5, 60)], 3)
        stop = ids[2]
        try:
            want = _min_tokens_reference(ref, prompt, stop, 7, 16)
        except _NearTie:
            continue
        if stop not in ids[:2]:
            break
    else:                                                                # pragma: no cover
        pytest.fail("no prompt with a clear masked path in 50 draws")
    plain = greedy(16, stop_token_ids=(stop,))
    held = dataclasses.replace(plain, min_tokens=7)
    spec = Engine.start(dense.dir, tp=1, options=dataclasses.replace(OPTS, spec_draft_tokens=2))
    try:
        for name, eng in (("tp 1", shared(1)), ("tp 2", shared(2)), ("mtp", spec)):
            a, b = eng.submit(prompt, plain), eng.submit(prompt, held)
            ra, rb = a.result(timeout=TIMEOUT), b.result(timeout=TIMEOUT)
            assert ra.error is None and ra.tokens == ids[:3] and ra.finish_reason == "stop", (name, ra)
            assert rb.error is None and rb.tokens == want, (name, rb.tokens, want)
            assert stop not in rb.tokens[:7] and len(rb.tokens) >= 7
            _idle(eng)
    finally:
        spec.shutdown()


def _bias_cases(ref: Reference, rng: random.Random, eos: set[int]) -> list[tuple[list[int], SamplingParams, list[int]]]:
    """(prompt, params with a logit_bias, reference ids): +100 on an id that is neither the unbiased
    first token nor an EOS id (greedy: generated first, and throughout); -100 on the unbiased first
    token; moderate random biases (greedy, per-token sampling with penalties, top-p) whose reference
    ids differ from the unbiased ones."""
    for _ in range(50):
        (prompt, ids), = ref.clear_prompts(rng, [rng.randint(5, 90)], 10)
        target = rng.choice([t for t in range(ref.V) if t != ids[0] and t not in eos])
        forced = greedy(10, logit_bias={target: 100.0})
        avoid = greedy(10, logit_bias={ids[0]: -100.0})
        try:
            out = [(prompt, forced, ref.sample(prompt, forced, MARGIN)[0]),
                   (prompt, avoid, ref.sample(prompt, avoid, MARGIN)[0])]
        except _NearTie:
            continue
        break
    else:                                                                # pragma: no cover
        pytest.fail("no prompt without a near tie under the bias in 50 draws")
    assert out[0][2][0] == target and out[1][2][0] != ids[0]
    kinds = [dict(temperature=0.0), dict(temperature=0.8, presence_penalty=0.4, repetition_penalty=1.2),
             dict(temperature=0.9, top_p=0.9)]
    for kw in kinds:
        for _ in range(50):
            p = [rng.randrange(ref.V) for _ in range(rng.randint(3, 120))]
            bias = {rng.randrange(ref.V): round(rng.uniform(-6.0, 6.0), 3) for _ in range(40)}
            plain = SamplingParams(max_new_tokens=16, ignore_eos=True, seed=rng.randrange(2**63), **kw)
            biased = dataclasses.replace(plain, logit_bias=bias)
            try:
                want, _ = ref.sample(p, biased, MARGIN)
            except _NearTie:
                continue
            if want != ref.sample(p, plain)[0]:
                out.append((p, biased, want))
                break
        else:                                                            # pragma: no cover
            pytest.fail(f"no clear biased case for {kw} in 50 draws")
    return out


def test_logit_bias_steers_tokens_as_the_reference_does(dense, shared):
    """SamplingParams.logit_bias reaches the ranks' sampler: +100 on an id that is not the unbiased
    argmax (nor an EOS id) is a greedy request's first token; -100 on the unbiased first token moves
    greedy off it; moderate random biases give the reference's tokens (the same sampler on one
    sequence in process, bias added before penalties) for greedy, per-token sampled and top-p
    requests; submitted together (batched steps) at tp 1 and 2, and on device-fed steps."""
    rng = random.Random(_seed("logit-bias"))
    cases = _bias_cases(dense.ref, rng, set(spec_from_hf(dense.cfg).eos_token_ids))
    fed = Engine.start(dense.dir, tp=1, options=dataclasses.replace(OPTS, device_feed=True))
    try:
        for name, eng in (("tp 1", shared(1)), ("tp 2", shared(2)), ("device-fed", fed)):
            streams = [eng.submit(prompt, p) for prompt, p, _ in cases]
            for (prompt, p, want), st in zip(cases, streams):
                r = st.result(timeout=TIMEOUT)
                assert r.error is None and r.tokens == want, (name, p.logit_bias, r.tokens, want)
            _good_request(eng, dense)
            _idle(eng)
    finally:
        fed.shutdown()


def test_steps_planned_ahead_equal_steps_planned_after_each_result(dense, shared):
    """EngineOptions.overlap_steps (the default: the next decode step is planned and queued while one
    runs, its tokens the ones the ranks just sampled) against planning each step after the previous
    one's result: the same tokens for seeded sampling with penalties, greedy batches and a stop id
    (whose sequence the queued step ran once more for nothing), at tp 1 and 2."""
    rng = random.Random(_seed("overlap"))
    cases = _seeded_cases(dense.ref, rng)
    greedy_cases = dense.ref.clear_prompts(rng, [2, 50, 130], 12)
    p, ids = greedy_cases[1]
    stop = ids[4]
    plain = Engine.start(dense.dir, tp=1, options=dataclasses.replace(OPTS, overlap_steps=False))
    try:
        for tp in (1, 2):
            eng = shared(tp)
            before = eng.stats()["steps_ahead"]
            for e in (eng, plain):
                streams = [e.submit(prompt, sp) for prompt, sp, _ in cases]
                streams += [e.submit(prompt, greedy(len(g))) for prompt, g in greedy_cases]
                streams.append(e.submit(p, greedy(len(ids), stop_token_ids=(stop,))))
                want = [w for _, _, w in cases] + [g for _, g in greedy_cases] + [ids[:ids.index(stop) + 1]]
                for st, w in zip(streams, want):
                    assert st.result(timeout=TIMEOUT).tokens == w, ("overlapped" if e is eng else "plain", tp)
                _good_request(e, dense)
                _idle(e)
            assert eng.stats()["steps_ahead"] > before + 10, "no step was planned ahead"
        assert plain.stats()["steps_ahead"] == 0
    finally:
        plain.shutdown()


def test_device_fed_steps_equal_the_reference(dense):
    """EngineOptions.device_feed (on by default only for the cuda backend at tp 1; forced on here, on
    the CPU): a step whose rows need no whole distribution (greedy, temperature with penalties)
    chooses its tokens as device ops, candidates merged across ranks by an all-reduce, and the next
    step planned ahead takes them as inputs before they reach the host. The tokens must be the reference's: greedy batches,
    seeded per-token sampling with penalties, a stop id, and rows that need the whole distribution
    (those steps sample on the host) in the same batches, at tp 1 and 2; and steps must be fed."""
    rng = random.Random(_seed("device-feed"))
    cases = _seeded_cases(dense.ref, rng)
    greedy_cases = dense.ref.clear_prompts(rng, [3, 40, 120], 14)
    p, ids = greedy_cases[0]
    stop = ids[5]
    per_token = [c for c in cases if not c[1].top_p < 1.0 and not c[1].min_p > 0 and c[1].top_k <= 0]
    assert per_token, "no per-token seeded case"
    for tp in (1, 2):
        eng = Engine.start(dense.dir, tp=tp, options=dataclasses.replace(OPTS, device_feed=True))
        try:
            # every row on the device path: greedy and per-token sampling only
            streams = [eng.submit(prompt, greedy(len(g))) for prompt, g in greedy_cases]
            streams += [eng.submit(prompt, sp) for prompt, sp, _ in per_token]
            want = [g for _, g in greedy_cases] + [w for _, _, w in per_token]
            for st, w in zip(streams, want):
                assert st.result(timeout=TIMEOUT).tokens == w, ("device path only", tp)
            # how many steps are fed depends on timing (a plan that reaches the rank after its pending
            # tokens are ready is filled on the host), so only that some are
            fed = eng.stats()["steps_fed"]
            assert fed > 0, f"tp {tp}: {fed} steps fed from the device"
            # mixed with rows that need the whole distribution, and a stop id
            streams = [eng.submit(prompt, sp) for prompt, sp, _ in cases]
            streams += [eng.submit(prompt, greedy(len(g))) for prompt, g in greedy_cases]
            streams.append(eng.submit(p, greedy(len(ids), stop_token_ids=(stop,))))
            want = [w for _, _, w in cases] + [g for _, g in greedy_cases] + [ids[:ids.index(stop) + 1]]
            for st, w in zip(streams, want):
                assert st.result(timeout=TIMEOUT).tokens == w, ("mixed", tp)
            _good_request(eng, dense)
            _idle(eng)
        finally:
            eng.shutdown()


def test_the_default_kv_pool_holds_max_concurrency_sequences_of_max_context(dense):
    """kv_capacity unset: max_concurrency sequences of max_context tokens all run at once, also when
    max_context is not a multiple of the page size (the pool was max_concurrency x max_context tokens
    rounded up to pages, a page short, so the last sequence waited for the others to finish). Every
    sequence's first token comes before any sequence's last, and the steps are those of one batch."""
    C, prompt_len, new = 4, 70, 30
    rng = random.Random(_seed("kv-pool"))
    opts = dataclasses.replace(OPTS, max_concurrency=C, max_context=prompt_len + new + 3)   # 4 x 103 tokens: 7 pages, one short
    eng = Engine.start(dense.dir, tp=1, options=opts)
    try:
        assert eng.stats()["pages_total"] * PAGE_SIZE >= C * (prompt_len + new)
        steps0 = eng.stats()["step_time"]["steps"]
        streams = [eng.submit([rng.randrange(dense.cfg["vocab_size"]) for _ in range(prompt_len)], greedy(new))
                   for _ in range(C)]
        done = [st.result(timeout=TIMEOUT) for st in streams]
        assert all(len(d.tokens) == new for d in done)
        first = max(d.timings["ttft_s"] for d in done)
        assert first < min(d.timings["total_s"] for d in done), [d.timings for d in done]
        steps = eng.stats()["step_time"]["steps"] - steps0
        assert steps <= new + C, f"{steps} steps for {C} sequences of {new} tokens"
    finally:
        eng.shutdown()


def test_a_relative_model_path_is_the_callers(dense, shared, tmp_path, monkeypatch):
    """Engine.start with a path relative to the caller's directory: the rank processes (which run from
    the repository root) load that model, and give the same greedy ids as the absolute path's engine."""
    link = tmp_path / "here" / "model"
    link.parent.mkdir()
    link.symlink_to(dense.dir, target_is_directory=True)
    monkeypatch.chdir(link.parent)
    prompt = [3, 14, 15, 92, 65]
    eng = Engine.start("model", tp=1, options=OPTS)
    try:
        got = eng.submit(prompt, greedy(6)).result(timeout=TIMEOUT).tokens
    finally:
        eng.shutdown()
    assert got == shared(1).submit(prompt, greedy(6)).result(timeout=TIMEOUT).tokens


def test_the_mailbox_segment_leaves_no_name_behind_once_the_ranks_run(shared):
    """Once every rank is ready the mailbox's shared-memory name is gone (nothing for a SIGKILL to leave in
    /dev/shm), and the ranks still exchange through their mappings: tp 2 keeps decoding."""
    from multiprocessing import shared_memory
    eng = shared(2)
    name = eng._coordinator._shm.name
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name, create=False)
    assert len(eng.submit([5, 6, 7], greedy(4)).result(timeout=TIMEOUT).tokens) == 4


def test_device_feed_is_off_by_default_on_the_cpu(dense, shared):
    """EngineOptions.device_feed unset: on only for the cuda backend at tp 1 (the CPU runs nothing
    ahead, so feeding would only add work): the reference ranks report it off and feed no step."""
    assert OPTS.device_feed is None
    for tp in (1, 2):
        eng = shared(tp)
        prompt, ids = dense.ref.clear_prompts(random.Random(_seed("feed-default")), [11], 8)[0]
        assert eng.submit(prompt, greedy(8)).result(timeout=TIMEOUT).tokens == ids
        s = eng.stats()
        assert [r["device_feed"] for r in s["ranks"].values()] == [False] * tp
        assert s["steps_fed"] == 0


# --------------------------------------------------------------------------------------------------
# Streams: async iteration, stop ids, timings


def test_async_iteration_and_stop_ids(dense, shared):
    eng = shared(1)
    cases = dense.ref.clear_prompts(random.Random(_seed("async")), [4, 70, 260], 16)

    async def consume(prompt, n):
        events = []
        async for ev in eng.submit(prompt, greedy(n)):
            events.append(ev)
        return events

    async def main():
        return await asyncio.gather(*(consume(p, len(ids)) for p, ids in cases))

    for (p, ids), events in zip(cases, asyncio.run(main())):
        assert [t for ev in events for t in ev.tokens] == ids
        assert [ev.final for ev in events] == [False] * (len(events) - 1) + [True]
        last = events[-1]
        assert last.finish_reason == "length" and last.usage["completion_tokens"] == len(ids)
        assert last.timings["ttft_s"] is not None and last.timings["total_s"] >= last.timings["ttft_s"] >= 0
    # a stop id ends the request at its first occurrence (inclusive), from params or from submit()
    p, ids = cases[1]
    stop = ids[5]
    want = ids[:ids.index(stop) + 1]
    for kw, extra in ((dict(stop_token_ids=(stop,)), None), ({}, {stop})):
        r = eng.submit(p, greedy(len(ids), **kw), stop_token_ids=extra).result(timeout=TIMEOUT)
        assert r.tokens == want and r.finish_reason == "stop"
    _idle(eng)


# --------------------------------------------------------------------------------------------------
# 4. A rank killed mid-decode


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigkill_of_a_rank_fails_every_request_fast_and_cleanly(dense):
    opts = dataclasses.replace(OPTS, max_concurrency=2, max_step_tokens=128, max_context=4096)
    cases = dense.ref.clear_prompts(random.Random(_seed("kill")), [12], 5)
    rng = random.Random(_seed("kill-prompts"))
    eng = Engine.start(dense.dir, tp=2, options=opts)
    for victim in (1, 0):
        try:
            prompt, ids = cases[0]
            assert eng.submit(prompt, greedy(5)).result(timeout=TIMEOUT).tokens == ids
            coord = eng._coordinator
            pids = [p.pid for p in coord.procs]
            shm_path = f"/dev/shm/{coord._shm.name.lstrip('/')}"
            # the name is unlinked once every rank has mapped the segment
            assert all(_alive(pid) for pid in pids) and not os.path.exists(shm_path)
            long = eng.submit(prompt, greedy(3000))                                # decodes for a long while
            prefill = eng.submit([rng.randrange(256) for _ in range(3500)], greedy(8))  # 28 chunks of prefill
            queued = eng.submit(prompt, greedy(8))                                  # both slots taken: waits
            for _ in range(3):                                                      # `long` is decoding now
                ev = long.get(timeout=TIMEOUT)
                assert not ev.final
            finals: dict[str, tuple[float, object]] = {}

            def watch(name, stream):
                for ev in stream:
                    if ev.final:
                        finals[name] = (time.monotonic(), ev)

            watchers = [threading.Thread(target=watch, args=(n, s), daemon=True)
                        for n, s in (("long", long), ("prefill", prefill), ("queued", queued))]
            for w in watchers:
                w.start()
            t_kill = time.monotonic()
            os.kill(pids[victim], signal.SIGKILL)
            for w in watchers:
                w.join(TIMEOUT)
                assert not w.is_alive(), "a stream never ended"
            print(f"SIGKILL rank {victim}: error events after "
                  + ", ".join(f"{n} {t - t_kill:.3f} s" for n, (t, _) in sorted(finals.items())))
            for name, (t, ev) in finals.items():
                assert ev.error and ev.finish_reason is None, f"{name}: {ev}"
                assert f"rank {victim}" in ev.error, ev.error
                assert t - t_kill < 2.0, f"{name}: error event {t - t_kill:.2f} s after the kill"
            assert set(finals) == {"long", "prefill", "queued"}
            st = eng.stats()
            assert st["healthy"] is False and f"rank {victim}" in st["failure"] and "signal 9" in st["failure"]
            assert st["failed"] >= 3
            with pytest.raises(EngineError):
                eng.submit(prompt, greedy(3))
            eng.cancel(long.id)                                                     # harmless now
        finally:
            eng.shutdown()
        assert not any(_alive(pid) for pid in pids), "a rank process outlived the engine"
        assert not os.path.exists(shm_path), "the mailbox segment was not unlinked"
        assert not os.path.exists(coord._tmp)
        with pytest.raises(EngineError):
            eng.submit(prompt, greedy(3))
        eng = Engine.start(dense.dir, tp=2, options=opts)                           # a new engine starts cleanly
    try:
        _good_request(eng, dense)
        # shutdown with requests in flight: they end as cancelled; later submits are refused
        st = eng.submit(cases[0][0], greedy(3000))
        assert not st.get(timeout=TIMEOUT).final
        pids = [p.pid for p in eng._coordinator.procs]
    finally:
        eng.shutdown()
    rest = st.result(timeout=TIMEOUT)
    assert rest.finish_reason == "cancelled" and rest.error is None
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(EngineError):
        eng.submit(cases[0][0], greedy(3))


def test_submits_racing_shutdown_all_end(dense):
    """Threads submit while the engine shuts down: each submit either raises EngineError or its stream
    ends (cancelled or failed); none is left open. submit's checks are slowed down to widen the race."""
    eng = Engine.start(dense.dir, tp=1, options=dataclasses.replace(OPTS, max_pending=10_000))
    coord = eng._coordinator
    pages_for = coord.scheduler.pages_for

    def slow_pages_for(seq):
        if threading.current_thread() is not coord._thread:
            time.sleep(0.002)                # inside submit(), between its health check and the queue
        return pages_for(seq)

    coord.scheduler.pages_for = slow_pages_for
    accepted, refused = [], []
    enough = threading.Event()

    def hammer(k: int) -> None:
        while True:
            try:
                accepted.append(eng.submit([1 + k, 2, 3], greedy(2)))
            except EngineError:
                refused.append(k)
                return
            if len(accepted) >= 40:
                enough.set()

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    assert enough.wait(TIMEOUT)
    eng.shutdown()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    assert sorted(refused) == [0, 1, 2, 3]
    open_streams = []
    deadline = time.monotonic() + 30
    for st in accepted:
        try:
            r = st.result(timeout=max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            open_streams.append(st.id)
            continue
        assert r.finish_reason in ("length", "cancelled") or r.error
    assert not open_streams, f"{len(open_streams)} of {len(accepted)} streams never ended"


# --------------------------------------------------------------------------------------------------
# 5. 1000 submit / cancel cycles


def test_1000_submit_cancel_cycles_leave_nothing_behind(dense, shared):
    eng = shared(1)
    coord = eng._coordinator
    pool = dense.ref.clear_prompts(random.Random(_seed("cancel-pool")), [1, 3, 8, 20, 40, 300, 500], 30)
    long_ones = [i for i, (p, _) in enumerate(pool) if len(p) >= 250]     # prefill mode: several chunks
    short_ones = [i for i, (p, _) in enumerate(pool) if len(p) <= 40]     # everything else: cheap steps
    before = eng.stats()
    cycles, workers = 1000, 12
    points = {"queued": 0, "waiting": 0, "prefill": 0, "decode": 0, "finished": 0}
    problems: list[str] = []
    streams: list = []
    lock = threading.Lock()
    pause = threading.Event()

    def where(stream) -> str:
        if stream.closed:
            return "finished"
        s = coord.seqs.get(stream.id)
        if s is None:
            return "queued"                     # not yet taken from the inbox
        if s.done:
            return "finished"
        if s.status == 0:
            return "waiting"
        return "prefill" if s.prefilling else "decode"

    def prefill_started(stream) -> bool:
        if stream.closed:
            return True
        s = coord.seqs.get(stream.id)
        return s is not None and (s.done or (s.status != 0 and (s.computed > 0 or not s.prefilling)))

    def worker(k: int) -> None:
        rng = random.Random(_seed(f"cancel-{k}"))
        for _ in range(cycles // workers + (k < cycles % workers)):
            mode = rng.choices(["now", "prefill", "decode", "finished"], weights=[3, 1, 3, 3])[0]
            i = rng.choice(long_ones if mode == "prefill" else short_ones)
            prompt, ids = pool[i]
            n = rng.randint(1, 4) if mode == "finished" else rng.randint(1, 30)
            st = eng.submit(prompt, greedy(n))
            got: list[int] = []
            finals = []
            if mode == "prefill":                   # wait until its first chunk is in (polling the loop's books)
                deadline = time.monotonic() + TIMEOUT
                while not prefill_started(st):
                    if time.monotonic() > deadline:
                        problems.append("prefill never started")
                        break
                    pause.wait(0.0005)
            elif mode == "decode":
                for _ in range(rng.randint(1, 3)):
                    ev = st.get(timeout=TIMEOUT)
                    got += ev.tokens
                    if ev.final:
                        finals.append(ev)
                        break
            elif mode == "finished":
                for ev in st:
                    got += ev.tokens
                    if ev.final:
                        finals.append(ev)
            point = where(st)
            eng.cancel(st.id)
            if not finals:
                for ev in st:
                    got += ev.tokens
                    if ev.final:
                        finals.append(ev)
            with lock:
                points[point] += 1
                streams.append(st)
            ev = finals[-1]
            if len(finals) != 1 or ev.error is not None:
                problems.append(f"request {st.id}: {len(finals)} final events, error {ev.error}")
            if got != ids[:len(got)]:
                problems.append(f"request {st.id}: tokens {got} are not a prefix of {ids[:n]}")
            if ev.finish_reason == "length" and got != ids[:n]:
                problems.append(f"request {st.id}: finished with {got} instead of {ids[:n]}")
            if ev.finish_reason not in ("length", "cancelled"):
                problems.append(f"request {st.id}: finish_reason {ev.finish_reason}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10 * TIMEOUT)
        assert not t.is_alive(), "a cycle hung"
    assert not problems, problems[:10]
    assert len(streams) == cycles
    _idle(eng)
    _good_request(eng, dense)                   # every cancel queued before it has been applied
    assert all(not st._events for st in streams), "an event arrived after a final event"
    after = eng.stats()
    assert after["requests"] - before["requests"] == cycles + 1
    ended = sum(after[k] - before[k] for k in ("finished", "cancelled", "failed"))
    assert ended == cycles + 1 and after["failed"] == before["failed"]
    assert points["queued"] + points["waiting"] >= 10 and min(points[k] for k in ("prefill", "decode", "finished")) >= 10, \
        f"cancel points not all exercised: {points}"
    _idle(eng)


# --------------------------------------------------------------------------------------------------
# 6. Bad input: clear errors, and the engine keeps serving


def test_bad_requests_are_refused_and_the_engine_keeps_serving(dense, shared):
    eng = shared(1)
    V, ctx = 256, OPTS.max_context
    bad = [
        ([1] * ctx, greedy(1), r"1024 tokens.*context holds 1024"),
        ([1] * (ctx + 500), greedy(1), r"1524 tokens"),
        ([], greedy(1), "empty"),
        ([1, 2, V], greedy(1), rf"{V}.*vocabulary \[0, {V}\)"),
        ([-1, 2], greedy(1), r"-1.*vocabulary"),
        ([1, 2.0, 3], greedy(1), "not an integer"),
        ([1, "7"], greedy(1), "not an integer"),
        ([1, 2], greedy(1, banned_token_ids=(3, V)), rf"banned token id {V}.*vocabulary"),
        ([1, 2], greedy(1, logit_bias={3: 1.0, V: -1.0}), rf"^logit_bias token id {V}.*vocabulary"),
    ]
    for prompt, params, match in bad:
        with pytest.raises(ValueError, match=match):
            eng.submit(prompt, params)
        _good_request(eng, dense)
    # numpy integer ids are ids (the same as Python ints)
    prompt, ids = dense.ref.clear_prompts(random.Random(_seed("numpy")), [20], 5)[0]
    assert eng.submit(np.array(prompt, dtype=np.int64), greedy(5)).result(timeout=TIMEOUT).tokens == ids
    assert eng.submit([np.int32(t) for t in prompt], greedy(5)).result(timeout=TIMEOUT).tokens == ids
    # the budget is clamped to the context, not refused
    near_full = [1] * (ctx - 10)
    r = eng.submit(near_full, greedy(10**9)).result(timeout=TIMEOUT)
    assert len(r.tokens) == 10 and r.finish_reason == "length"
    _idle(eng)
    # extreme-but-valid sampling values reach the ranks without breaking the step loop
    for p in (SamplingParams(seed=2**64 - 1, max_new_tokens=3), SamplingParams(seed=-2**63, max_new_tokens=3),
              SamplingParams(top_k=2**80, temperature=0.5, max_new_tokens=3)):
        r = eng.submit(prompt, p).result(timeout=TIMEOUT)
        assert r.error is None and len(r.tokens) >= 1
    _good_request(eng, dense)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1), ("top_k", 2.5), ("top_p", 0.0),
    ("top_p", 1.01), ("top_p", float("nan")), ("min_p", -0.01), ("min_p", 1.5), ("presence_penalty", 2.01),
    ("presence_penalty", -2.5), ("frequency_penalty", 3.0), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", 10.5), ("max_new_tokens", 0), ("max_new_tokens", 2.0),
    ("seed", 1.5), ("seed", "7"), ("seed", 2**64), ("seed", -2**63 - 1),
    ("banned_token_ids", (1, -2)), ("banned_token_ids", (1.0,)), ("banned_token_ids", (True,)),
    ("logit_bias", {1: 100.5}), ("logit_bias", {1: -101}), ("logit_bias", {1: float("nan")}), ("logit_bias", {-1: 0}),
    ("logit_bias", {1.0: 2}), ("logit_bias", {True: 2}), ("logit_bias", {1: True}), ("logit_bias", {1: "2"}),
    ("logit_bias", ((1, 2), (1, 3))), ("logit_bias", ((1, 2, 3),)), ("logit_bias", 5),
])
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be ") as e:
        SamplingParams(**{field: value})
    assert str(e.value).endswith(f"got {value!r}")


def test_sampling_params_accept_their_bounds():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   repetition_penalty=10.0, max_new_tokens=1, seed=0)
    SamplingParams(top_p=1e-9, min_p=1.0, repetition_penalty=1e-9, seed=2**64 - 1)


@pytest.mark.parametrize("tp, names", [(3, ["tp 3", "num_attention_heads = 8"]), (5, ["tp 5", "= 8"]),
                                       (8, ["tp 8", "num_key_value_heads = 4"]), (0, ["tp must be >= 1", "0"])])
def test_bad_tp_is_refused_before_any_process_starts(dense, monkeypatch, tp, names):
    import runtime.coordinator as coordinator

    def no_spawn(*a, **kw):
        raise AssertionError("a rank process was spawned for an impossible tp")

    monkeypatch.setattr(coordinator.subprocess, "Popen", no_spawn)
    with pytest.raises(ValueError) as e:
        Engine.start(dense.dir, tp=tp, options=OPTS)
    for name in names:
        assert name in str(e.value), str(e.value)


def test_pending_overflow_raises_overloaded_and_recovers(dense, shared):
    eng = shared(1)
    prompt = dense.ref.clear_prompts(random.Random(_seed("overflow")), [16], 1)[0][0]
    # hold every slot and the whole KV pool with long requests that have started decoding
    holders = [eng.submit(prompt, greedy(1000)) for _ in range(OPTS.max_concurrency)]
    for h in holders:
        assert not h.get(timeout=TIMEOUT).final
    waiting = []
    with pytest.raises(Overloaded, match=f"max_pending {OPTS.max_pending}"):
        for _ in range(OPTS.max_pending + 1):
            waiting.append(eng.submit(prompt, greedy(2)))
    assert len(waiting) == OPTS.max_pending, "Overloaded came at the wrong count"
    assert eng.stats()["healthy"]
    for st in holders + waiting:
        eng.cancel(st.id)
    for st in holders + waiting:
        r = st.result(timeout=TIMEOUT)
        assert r.finish_reason in ("cancelled", "length") and r.error is None
    _idle(eng)
    _good_request(eng, dense)


# --------------------------------------------------------------------------------------------------
# The reference backend with its ranks on a GPU: what --backend auto runs for a bf16 model whose shapes
# the CUDA kernels cannot take (ranks/backend.resolve_backend), and --backend reference on a GPU box


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_reference_backend_ranks_on_a_gpu(kind, request):
    """float32 torch ops on the device through the rank process: greedy ids (batched, then alone) and
    seeded samples equal the in-process CPU reference's; bfloat16 on the device runs the same prompts
    to valid ids of the requested length (its own rounding, so not compared token for token)."""
    model: Model = request.getfixturevalue(kind)
    rng = random.Random(_seed(f"reference-gpu-{kind}"))
    cases = model.ref.clear_prompts(rng, [1, 7, 65, 150], 8)
    sampled = _seeded_cases(model.ref, rng)[:2]
    opts = dataclasses.replace(OPTS, backend="reference")
    eng = Engine.start(model.dir, tp=1, device="cuda", dtype="float32", options=opts)
    try:
        streams = [eng.submit(p, greedy(len(ids))) for p, ids in cases]
        for (p, ids), st in zip(cases, streams):
            r = st.result(timeout=TIMEOUT)
            assert r.error is None and r.tokens == ids, f"prompt of {len(p)}: {r.tokens} != reference {ids}"
        p, ids = cases[2]
        assert eng.submit(p, greedy(len(ids))).result(timeout=TIMEOUT).tokens == ids
        for prompt, sp, ids in sampled:
            assert eng.submit(prompt, sp).result(timeout=TIMEOUT).tokens == ids, sp
        _idle(eng)
    finally:
        eng.shutdown()
    eng = Engine.start(model.dir, tp=1, device="cuda", dtype="bfloat16", options=opts)
    try:
        for p, ids in cases:
            r = eng.submit(p, greedy(len(ids))).result(timeout=TIMEOUT)
            assert r.error is None and len(r.tokens) == len(ids) and all(0 <= t < model.ref.V for t in r.tokens)
        _idle(eng)
    finally:
        eng.shutdown()
