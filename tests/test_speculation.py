"""MTP speculative decoding (issue 7, CPU part).

1. The exact GDN state commit: a verification forward with keep_columns, committed at any accepted
   length, leaves GDN recurrent / conv state, target KV and MTP KV equal to plain one-column decoding
   of the accepted tokens (float64, in process), and the stale KV entries past the accepted length
   are never read (the next step's outputs are equal too).
2. Greedy speculation through the Engine is token-for-token the non-speculative greedy output
   (checked against the in-process reference of tests/test_engine.py, whose prompts avoid near ties)
   for K = 1..5, batches of 1..8, prompts crossing the 64-column GDN chunk, stops and length limits
   inside rounds, tp 1 and 2; the TEST-ONLY EngineOptions.spec_draft_hook forces drafts right with
   probability 0, 0.5 and 1 so every acceptance path runs on random weights.
3. The embedded demo model's trained MTP head: identical output, high acceptance.
4. Sampled speculation preserves the target distribution (chi-square over the next two tokens).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from ranks.model import Batch, HybridModel
from ranks.sampler import SeqSampler, accept_sampled, filtered_log_probs, gumbel_noise
from ranks.weights import write_checkpoint
from runtime import Engine, EngineOptions, SamplingParams
from runtime.config import spec_from_hf
from tests.test_engine import HEADS, MARGIN, Reference, _NearTie, _seed
from tests.util import random_weights, tiny_config, write_tiny_checkpoint

TIMEOUT = 120
OPTS = dict(max_concurrency=8, max_pending=64, prefill_chunk=64, max_step_tokens=256, max_context=1024,
            threads_per_rank=1, startup_timeout_s=180)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------------
# 1. The state commit (float64, in process)


def test_commit_equals_plain_decoding_float64():
    cfg = tiny_config(False)
    spec = spec_from_hf(cfg)
    w = random_weights(spec, _seed("spec-commit"), dtype=torch.float64)
    model = HybridModel(spec, w)
    rng = random.Random(_seed("spec-commit-rounds"))
    V, B, pages = spec.vocab_size, 2, 4
    table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    spec_state = model.new_state(num_slots=B, num_pages=B * pages)
    plain = model.new_state(num_slots=B, num_pages=B * pages)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (70, 5)]     # 70 crosses the 64-column chunk
    last_hidden = []
    for st in (spec_state, plain):
        out = model.forward(Batch(torch.tensor(prompts[0] + prompts[1]), [70, 5], [0, 0], [0, 1], table), st,
                            logits="none")
        last_hidden.append(out.hidden)
    lengths = [70, 5]
    last = [prompts[0][-1], prompts[1][-1]]
    for _ in range(12):
        K = [rng.randint(1, 5), rng.randint(1, 5)]
        drafts = [[rng.randrange(V) for _ in range(k)] for k in K]
        ids = torch.tensor([t for b in range(B) for t in [last[b]] + drafts[b]])
        cols, starts = [k + 1 for k in K], [lengths[b] - 1 for b in range(B)]
        out = model.forward(Batch(ids, cols, starts, [0, 1], table), spec_state, logits="none", keep_columns=True)
        acc = [rng.randint(0, K[0]), rng.randint(0, K[1])]
        model.commit(out.kept, spec_state, acc)
        # the MTP layer over the accepted columns, then two draft steps that write stale MTP KV
        mtp_ids, mtp_rows, at = [], [], 0
        new = [rng.randrange(V) for _ in range(B)]
        for b in range(B):
            toks = [last[b]] + drafts[b][:acc[b]]
            mtp_ids += toks[1:] + [new[b]]
            mtp_rows += list(range(at, at + acc[b] + 1))
            at += cols[b]
        mcols = [a + 1 for a in acc]
        m = model.mtp_forward(Batch(torch.tensor(mtp_ids), mcols, starts, [0, 1], table), out.hidden[mtp_rows],
                              spec_state, logits="none").hidden
        h = m[[sum(mcols[:b + 1]) - 1 for b in range(B)]]
        for j in range(2):
            h = model.mtp_forward(Batch(torch.tensor([rng.randrange(V) for _ in range(B)]), [1, 1],
                                        [starts[b] + acc[b] + 1 + j for b in range(B)], [0, 1], table), h,
                                  spec_state, logits="none").hidden
        # plain decoding of the accepted tokens, one column at a time, and the MTP pass 1 over them
        for b in range(B):
            toks = [last[b]] + drafts[b][:acc[b]]
            hs = []
            for i, t in enumerate(toks):
                o = model.forward(Batch(torch.tensor([t]), [1], [starts[b] + i], [b], table[b:b + 1]), plain,
                                  logits="none")
                hs.append(o.hidden)
            model.mtp_forward(Batch(torch.tensor(toks[1:] + [new[b]]), [len(toks)], [starts[b]], [b], table[b:b + 1]),
                              torch.cat(hs), plain, logits="none")
            lengths[b] += acc[b] + 1
            last[b] = new[b]
        for j in range(len(spec.linear_attention_layers)):
            torch.testing.assert_close(spec_state.recurrent[j], plain.recurrent[j], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(spec_state.conv[j], plain.conv[j], rtol=1e-10, atol=1e-10)
        for b in range(B):                        # KV up to the accepted length (beyond it: stale)
            n = lengths[b] - 1
            flat = lambda pool: pool[table[b].long()].reshape(-1, *pool.shape[2:])[:n]   # noqa: E731
            for pa, pb in zip(spec_state.k + spec_state.v, plain.k + plain.v):
                torch.testing.assert_close(flat(pa), flat(pb), rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(flat(spec_state.mtp_k), flat(plain.mtp_k), rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(flat(spec_state.mtp_v), flat(plain.mtp_v), rtol=1e-10, atol=1e-10)
    # the stale entries are overwritten before anything reads them: the next step agrees
    ids = torch.tensor(last)
    starts = [lengths[b] - 1 for b in range(B)]
    a = model.forward(Batch(ids, [1, 1], starts, [0, 1], table), spec_state, logits="all")
    p = model.forward(Batch(ids, [1, 1], starts, [0, 1], table), plain, logits="all")
    torch.testing.assert_close(a.logits, p.logits, rtol=1e-10, atol=1e-10)
    nxt = torch.tensor([1, 2])
    ma = model.mtp_forward(Batch(nxt, [1, 1], starts, [0, 1], table), a.hidden, spec_state).logits
    mp = model.mtp_forward(Batch(nxt, [1, 1], starts, [0, 1], table), p.hidden, plain).logits
    torch.testing.assert_close(ma, mp, rtol=1e-10, atol=1e-10)


def test_kept_forward_leaves_live_state_untouched():
    spec = spec_from_hf(tiny_config(False))
    model = HybridModel(spec, random_weights(spec, 3, dtype=torch.float64))
    st = model.new_state(num_slots=1, num_pages=2)
    table = torch.arange(2, dtype=torch.int32)[None]
    model.forward(Batch(torch.arange(10), [10], [0], [0], table), st, logits="none")
    before = [t.clone() for t in st.recurrent + st.conv]
    out = model.forward(Batch(torch.tensor([1, 2, 3]), [3], [9], [0], table), st, logits="none", keep_columns=True)
    assert all(torch.equal(x, y) for x, y in zip(before, st.recurrent + st.conv))
    with pytest.raises(ValueError):
        model.commit(out.kept, st, [3])
    model.commit(out.kept, st, [2])               # all accepted = the state of a plain 3-column step
    ref = model.new_state(num_slots=1, num_pages=2)
    model.forward(Batch(torch.arange(10), [10], [0], [0], table), ref, logits="none")
    model.forward(Batch(torch.tensor([1, 2, 3]), [3], [9], [0], table), ref, logits="none")
    for x, y in zip(st.recurrent + st.conv, ref.recurrent + ref.conv):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["all", "last", "none"])
def test_forward_in_parts_equals_the_one_step_forward_float64(mode):
    """forward_in_parts (how the CUDA backend runs a speculation step that also carries a prompt chunk:
    the verification and the rest as two steps) against forward with the same per-sequence flags in
    one step: hidden rows and logits in the batch's order, kept.seqs indexing the whole batch, and
    after commit the same GDN states and KV, so the next step agrees too (float64)."""
    spec = spec_from_hf(tiny_config(False))
    model = HybridModel(spec, random_weights(spec, _seed("spec-parts"), dtype=torch.float64))
    rng = random.Random(_seed("spec-parts-ids"))
    V, B, pages = spec.vocab_size, 3, 3
    table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    prefix = {0: [rng.randrange(V) for _ in range(20)], 2: [rng.randrange(V) for _ in range(30)]}
    # sequence 0 verifies 4 columns, sequence 1 is a fresh 70-column prompt chunk (crossing the
    # 64-column GDN chunk), sequence 2 verifies 3 columns: kept and not kept interleaved
    columns, starts, flags = [4, 70, 3], [20, 0, 30], [True, False, True]
    ids = torch.tensor([rng.randrange(V) for _ in range(sum(columns))])
    states, outs = [], []
    for parts in (False, True):
        st = model.new_state(num_slots=B, num_pages=B * pages)
        for b, p in prefix.items():
            model.forward(Batch(torch.tensor(p), [len(p)], [0], [b], table[b:b + 1]), st, logits="none")
        batch = Batch(ids, columns, starts, [0, 1, 2], table)
        out = (model.forward_in_parts(batch, st, mode, flags) if parts
               else model.forward(batch, st, logits=mode, keep_columns=flags))
        assert out.kept.seqs == [0, 2] and out.kept.slots == [0, 2]
        model.commit(out.kept, st, [2, 0])
        states.append(st)
        outs.append(out)
    one, two = outs
    torch.testing.assert_close(two.hidden, one.hidden, rtol=1e-10, atol=1e-10)
    if mode == "none":
        assert one.logits is None and two.logits is None
    else:
        assert two.logits.shape == one.logits.shape == ((sum(columns) if mode == "all" else B), V)
        torch.testing.assert_close(two.logits, one.logits, rtol=1e-10, atol=1e-10)
    def live(st):
        return st.recurrent + st.conv + st.k + st.v
    for x, y in zip(live(states[0]), live(states[1])):
        torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-10)
    nxt = Batch(torch.tensor([rng.randrange(V) for _ in range(B)]), [1] * B, [23, 70, 31], [0, 1, 2], table)
    after = [model.forward(nxt, st, logits="last").logits for st in states]
    torch.testing.assert_close(after[1], after[0], rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------------------------------
# 2. Greedy identity through the engine (random weights)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("spec-dense"))
    spec, w = write_tiny_checkpoint(d, tiny_config(False, **HEADS), _seed("engine-dense"))
    return d, Reference(spec, w)


@pytest.fixture(scope="module")
def cases(dense):
    """Prompts (1..130 tokens, several crossing the 64-column chunk) with their reference greedy ids."""
    _, ref = dense
    return ref.clear_prompts(random.Random(_seed("spec-cases")), [70, 130, 3, 64, 65, 9, 100, 20], 14)


def _hook(truth: dict, p_right: float, seed: int, V: int):
    """TEST-ONLY drafts: the reference continuation with probability p_right, else a wrong token."""
    rng = random.Random(seed)

    def hook(seq, drafts):
        ref = truth[tuple(seq.prompt)]
        out = []
        for j in range(len(drafts)):
            i = len(seq.output) + j
            t = ref[i] if i < len(ref) else 0
            out.append(t if rng.random() < p_right else (t + 1 + rng.randrange(V - 1)) % V)
        return out
    return hook


def _run(eng, cases, sizes, n=None):
    at = 0
    for size in sizes:
        group = cases[at:at + size]
        at += size
        streams = [eng.submit(p, SamplingParams(temperature=0.0, max_new_tokens=n or len(ids), ignore_eos=True))
                   for p, ids in group]
        for (p, ids), st in zip(group, streams):
            r = st.result(timeout=TIMEOUT)
            assert r.error is None and r.finish_reason == "length"
            assert r.tokens == ids[:n or len(ids)], f"prompt of {len(p)}: {r.tokens} != reference {ids}"
            assert r.spec is not None and r.spec["rounds"] >= 1


@pytest.mark.parametrize("tp,K,p_right", [(1, 1, None), (1, 2, 0.5), (1, 3, 1.0), (1, 4, 0.0), (1, 5, 0.5),
                                          (2, 1, 1.0), (2, 2, None), (2, 3, 0.5), (2, 4, 1.0), (2, 5, 0.0)])
def test_greedy_identical_to_plain(dense, cases, tp, K, p_right):
    d, ref = dense
    hook = None if p_right is None else _hook({tuple(p): ids for p, ids in cases}, p_right, K, ref.V)
    with Engine.start(d, tp=tp, options=EngineOptions(spec_draft_tokens=K, spec_draft_hook=hook, **OPTS)) as eng:
        sizes = [1, 7] if K % 2 else [8]
        sizes = sizes if (tp, K) != (1, 3) else [2, 3, 3]
        sizes = sizes if (tp, K) != (2, 4) else [4, 4]
        sizes = sizes if (tp, K) != (1, 5) else [5, 3]
        sizes = sizes if (tp, K) != (2, 5) else [6, 2]
        _run(eng, cases, sizes)
        st = eng.stats()["spec"]
        assert st["draft_tokens"] == K and st["rounds"] > 0
        if p_right == 1.0:      # every round accepts everything it drafted (drafts end at the budget)
            assert st["accepted"] == st["drafted"] and st["tokens_per_round"] > 1.5
        if p_right == 0.0:
            assert st["accepted"] == 0 and st["accepted_hist"][0] == st["rounds"]
        if p_right == 0.5:
            assert 0 < st["accepted"] < st["drafted"]
        assert sum(st["accepted_hist"]) == st["rounds"]
        assert st["position_drafted"][0] == st["rounds"]
        assert (eng.stats()["running"], eng.stats()["pages_used"]) == (0, 0)


def test_logit_bias_holds_inside_rounds(dense, cases):
    """A biased sequence's verification uses the bias: greedy requests with random logit_bias give the
    reference's biased greedy ids (drafts right half the time, so acceptance and rejection both run
    against biased targets), and a sampled request with +100 on one id generates only that id."""
    d, ref = dense
    rng = random.Random(_seed("spec-logit-bias"))
    biased = []
    for prompt, ids in cases[:4]:
        for _ in range(50):
            bias = {rng.randrange(ref.V): round(rng.uniform(-6.0, 6.0), 3) for _ in range(40)}
            bias[ids[0]] = -100.0 if rng.random() < 0.5 else bias.get(ids[0], 0.0)
            p = SamplingParams(temperature=0.0, max_new_tokens=len(ids), ignore_eos=True, logit_bias=bias)
            try:
                want, _ = ref.sample(prompt, p, MARGIN)
            except _NearTie:
                continue
            if want != ids:
                biased.append((prompt, p, want))
                break
        else:                                                            # pragma: no cover
            pytest.fail("no clear biased greedy case in 50 draws")
    target = rng.randrange(ref.V)
    forced = SamplingParams(temperature=0.8, seed=rng.randrange(2**63), max_new_tokens=10, ignore_eos=True,
                            logit_bias={target: 100.0})
    hook = _hook({tuple(p): w for p, _, w in biased} | {tuple(cases[4][0]): [target] * 10}, 0.5, 1, ref.V)
    with Engine.start(d, tp=1, options=EngineOptions(spec_draft_tokens=3, spec_draft_hook=hook, **OPTS)) as eng:
        streams = [eng.submit(p, sp) for p, sp, _ in biased] + [eng.submit(cases[4][0], forced)]
        for (p, sp, want), st in zip(biased, streams):
            r = st.result(timeout=TIMEOUT)
            assert r.error is None and r.tokens == want, (r.tokens, want)
            assert r.spec["rounds"] >= 1
        r = streams[-1].result(timeout=TIMEOUT)
        assert r.error is None and r.tokens == [target] * 10 and r.spec["rounds"] >= 1
        st = eng.stats()["spec"]
        assert 0 < st["accepted"] < st["drafted"]


@pytest.mark.parametrize("tp", [1, 2])
def test_stops_and_length_inside_rounds(dense, cases, tp):
    d, ref = dense
    truth = {tuple(p): ids for p, ids in cases}
    hook = _hook(truth, 1.0, 0, ref.V)
    with Engine.start(d, tp=tp, options=EngineOptions(spec_draft_tokens=4, spec_draft_hook=hook, **OPTS)) as eng:
        streams = []
        for j, (p, ids) in enumerate(cases[:6]):
            # a stop token whose first occurrence lies inside a round (not at its first column)
            stop_at = next((i for i in range(3 + j % 3, len(ids)) if ids[i] not in ids[:i]), None)
            if stop_at is None or j % 2:
                params = SamplingParams(temperature=0.0, max_new_tokens=7 + j, ignore_eos=True)
                want, reason = ids[:7 + j], "length"
            else:
                params = SamplingParams(temperature=0.0, max_new_tokens=len(ids), ignore_eos=True,
                                        stop_token_ids=[ids[stop_at]])
                want, reason = ids[:stop_at + 1], "stop"
            streams.append((eng.submit(p, params), want, reason))
        for st, want, reason in streams:
            r = st.result(timeout=TIMEOUT)
            assert (r.tokens, r.finish_reason) == (want, reason)
            # every draft was right, so the output = the prefill's token + the rounds' tokens (+ one plain
            # step when a single token of budget was left)
            assert len(want) - 2 <= r.spec["accepted"] + r.spec["rounds"] <= len(want) - 1
        # the engine is still right after those endings (slots and state reused)
        _run(eng, cases, [3])


@pytest.mark.parametrize("tp", [1, 2])
def test_reduced_proposal_head_drafts_below_the_bound(dense, cases, tp):
    """spec_draft_vocab N: every draft is a token id below N (or -1), the output is still plain greedy,
    and with N = the whole vocabulary the drafts are those of the full head."""
    d, ref = dense
    N = ref.V // 3                                 # at tp 2 only rank 0's shard has proposal rows
    for vocab in (N, 0):
        seen: list[int] = []

        def hook(seq, drafts):                     # records the ranks' drafts, changes nothing
            seen.extend(drafts)
            return drafts
        opts = EngineOptions(spec_draft_tokens=3, spec_draft_vocab=vocab, spec_draft_hook=hook, **OPTS)
        with Engine.start(d, tp=tp, options=opts) as eng:
            _run(eng, cases, [2, 2])
        assert seen and all(-1 <= t < ref.V for t in seen)
        if vocab:
            assert all(t < N for t in seen), sorted(set(seen))[-5:]
        else:
            assert any(t >= N for t in seen), "random weights should draft some ids above the bound"


def test_spec_refused_without_mtp_weights(tmp_path):
    cfg = tiny_config(False, mtp_num_hidden_layers=0)
    spec = spec_from_hf(cfg)
    w = random_weights(spec, 1)
    write_checkpoint(str(tmp_path), w, prefix="model.")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="MTP weights"):
        Engine.start(str(tmp_path), tp=1, options=EngineOptions(spec_draft_tokens=2, **OPTS))
    from server.cli import main
    assert main(["generate", str(tmp_path), "--prompt-ids", "1,2,3", "--spec", "mtp", "--draft-tokens", "2"]) == 2
    with pytest.raises(ValueError):
        EngineOptions(spec_draft_tokens=6)
    assert EngineOptions().spec_draft_tokens == 0


@pytest.mark.parametrize("mtp_layers", [1, 0])
def test_spec_with_random_weights_follows_config_json(tmp_path, capsys, mtp_layers):
    """--random-weights needs no safetensors for --spec mtp: the random model has an MTP layer when
    config.json declares one, and then speculation gives plain greedy decoding's ids; without one, exit 2
    naming the field."""
    from server.cli import main
    with open(tmp_path / "config.json", "w") as f:
        json.dump(tiny_config(False, mtp_num_hidden_layers=mtp_layers), f)
    base = ["generate", str(tmp_path), "--prompt-ids", "5,9,17,33,65", "--random-weights", "--greedy",
            "--max-new-tokens", "6", "--print-token-ids"]
    if not mtp_layers:
        assert main([*base, "--spec", "mtp"]) == 2
        assert "mtp_num_hidden_layers" in capsys.readouterr().err
        return
    assert main([*base, "--spec", "mtp", "--draft-tokens", "2"]) == 0, capsys.readouterr().err
    spec_ids = capsys.readouterr().out.strip()
    assert main(base) == 0
    assert capsys.readouterr().out.strip() == spec_ids and len(spec_ids.split(",")) == 6


# --------------------------------------------------------------------------------------------------
# 3. The embedded demo model's trained MTP head


def test_demo_model_trained_head(capsys):
    from ranks.demo import PACKAGED_DIR
    if not os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")):
        pytest.skip("no packaged demo model")
    from runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(PACKAGED_DIR)
    prompts = [tok.encode(t) for t in ("The quick brown fox", "Once upon a time, there was a little girl named",
                                        "def fibonacci(n):")]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    outs = {}
    for K in (0, 3):
        with Engine.start(PACKAGED_DIR, tp=1, options=EngineOptions(spec_draft_tokens=K, **OPTS)) as eng:
            outs[K] = [s.result(timeout=TIMEOUT) for s in [eng.submit(p, params) for p in prompts]]
            stats = eng.stats().get("spec")
    for a, b in zip(outs[0], outs[3]):
        assert a.tokens == b.tokens
    with capsys.disabled():
        print(f"\n[demo model, K=3] tokens per round {stats['tokens_per_round']:.2f}, acceptance per draft "
              f"position {[round(a / max(d, 1), 2) for a, d in zip(stats['position_accepted'], stats['position_drafted'])]}")
    assert stats["position_accepted"][0] / stats["position_drafted"][0] > 0.5
    assert stats["tokens_per_round"] > 1.8


# --------------------------------------------------------------------------------------------------
# 4. Sampled speculation preserves the target distribution


def test_sampled_acceptance_preserves_distribution():
    """A Markov 'target' over a small vocabulary at temperature 0.7 with top-p 0.9; drafts from a
    different 'draft model' (argmax = the target's runner-up, a point mass). Many seeds of: one speculation round with two
    drafts, then (if the round gave one token) a plain keyed draw; the joint of the next two tokens
    is compared with the exact target joint by a chi-square test."""
    from tests.test_sampler import chi2_sf       # scipy-free chi-square survival function
    V = 6
    g = torch.Generator().manual_seed(_seed("spec-chi2"))
    target = torch.randn(V + 1, V, generator=g, dtype=torch.float64) * 1.5     # row V: the prefix state
    # the runner-up 0.5 below the top: at temperature 0.7 the top token holds at most 1/(1 + e^-0.71)
    # = 0.67 of the mass, so the drafts (runner-ups) are always inside top-p 0.9 and can be accepted
    top2 = target.topk(2, dim=-1)
    target.scatter_(1, top2.indices[:, 1:], top2.values[:, :1] - 0.5)
    s = SeqSampler(temperature=0.7, top_p=0.9)

    def logp(prev):                               # normalised (top-p leaves the kept mass unnormalised)
        lp = filtered_log_probs(target[prev].float(), s)
        return lp - torch.logsumexp(lp, -1)

    def draft(prev):                              # a 'draft model' whose argmax is the target's runner-up
        return int(torch.topk(target[prev], 2).indices[1])
    P = 11                                        # position of the first new token
    lp0 = logp(V)
    exact = torch.stack([lp0[x].exp() * logp(x).exp() for x in range(V)])       # [V, V] joint
    N = 6000
    counts = torch.zeros(V, V)
    firsts_accepted = 0
    for seed in range(N):
        d1 = draft(V)
        d2 = draft(d1)
        rows = torch.stack([lp0, logp(d1), logp(d2)])
        toks = accept_sampled(rows, [d1, d2], seed, [P, P + 1, P + 2])
        firsts_accepted += toks[0] == d1
        if len(toks) == 1:
            toks.append(int(torch.argmax(logp(toks[0]) + gumbel_noise(seed, P + 1, V))))
        counts[toks[0], toks[1]] += 1
    mask = exact.flatten() > 0
    obs, exp = counts.flatten()[mask], (exact.flatten()[mask] * N)
    assert counts.flatten()[~mask].sum() == 0, "a token outside top-p was emitted"
    keep = exp >= 5                               # pool the rare cells
    obs_k = torch.cat([obs[keep], obs[~keep].sum()[None]]) if (~keep).any() else obs
    exp_k = torch.cat([exp[keep], exp[~keep].sum()[None]]) if (~keep).any() else exp
    exp_k = exp_k * (obs_k.sum() / exp_k.sum())  # the pooled expectation sums to N exactly
    chi2 = float(((obs_k - exp_k) ** 2 / exp_k).sum())
    pval = chi2_sf(chi2, len(obs_k) - 1)
    assert pval > 1e-4, f"chi2 {chi2:.1f}, p {pval:.2e}"
    assert 0 < firsts_accepted < N                # both paths ran


def test_sampled_speculation_independent_of_tp_and_batch(dense, cases):
    """Sampled rounds (temperature 0.7, top-p 0.9, a presence penalty) give the same tokens alone at
    tp 1 and batched with others at tp 2: the RNG is keyed by (seed, position, purpose)."""
    d, _ = dense
    params = [SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5, seed=100 + i, max_new_tokens=12,
                             ignore_eos=True) for i in range(3)]
    got = {}
    for tp in (1, 2):
        with Engine.start(d, tp=tp, options=EngineOptions(spec_draft_tokens=2, **OPTS)) as eng:
            if tp == 1:
                got[tp] = [eng.submit(p, sp).result(timeout=TIMEOUT) for (p, _), sp in zip(cases, params)]
            else:
                streams = [eng.submit(p, sp) for (p, _), sp in zip(cases, params)]
                streams += [eng.submit(p, SamplingParams(temperature=0.0, max_new_tokens=5)) for p, _ in cases[3:6]]
                got[tp] = [s.result(timeout=TIMEOUT) for s in streams[:3]]
    for a, b in zip(got[1], got[2]):
        assert a.error is None and b.error is None and len(a.tokens) == 12
        assert a.tokens == b.tokens
        assert a.spec["rounds"] >= 1


def test_batched_commit_equals_the_per_sequence_commit(seed):
    """commit_batched (the CUDA backend's one-gather-per-layer form) installs exactly the state the
    per-sequence commit does, for every accepted length, fresh windows and shuffled slots (float64)."""
    from ranks.model import KeptColumns, commit_batched
    spec = spec_from_hf(tiny_config(False))
    model = HybridModel(spec, random_weights(spec, seed % 1000, dtype=torch.float64))
    g = torch.Generator().manual_seed(seed)
    B, T, pages = 4, 4, 2
    slots = [3, 0, 2, 1]
    table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    st = model.new_state(num_slots=B, num_pages=B * pages)
    for b in range(B):                                   # different history per sequence
        n = 3 + 5 * b
        model.forward(Batch(torch.randint(0, spec.vocab_size, (n,), generator=g), [n], [0], [slots[b]],
                            table[b:b + 1]), st, logits="none")
    starts = [3 + 5 * b for b in range(B)]
    ids = torch.randint(0, spec.vocab_size, (B * T,), generator=g)
    out = model.forward(Batch(ids, [T] * B, starts, slots, table), st, logits="none", keep_columns=True)
    k = out.kept
    batched = dict(T=T, old_conv=[torch.stack(k.old_conv[j]) for j in range(len(k.old_conv))],
                   conv_in=[torch.cat(k.conv_in[j]) for j in range(len(k.conv_in))],
                   states=[torch.cat(k.states[j]) for j in range(len(k.states))])
    for accepted in ([0, 1, 2, 3], [3, 3, 0, 1], [0, 0, 0, 0], [3, 2, 1, 0]):
        a_state, b_state = (model.new_state(num_slots=B, num_pages=B * pages) for _ in range(2))
        for s in (a_state, b_state):                    # same starting contents, poisoned elsewhere
            for j in range(len(s.conv)):
                s.conv[j].copy_(st.conv[j])
                s.recurrent[j].copy_(st.recurrent[j])
        model.commit(k, a_state, accepted)
        commit_batched(KeptColumns(k.seqs, k.slots, k.columns, [], [], [], batched), b_state, accepted)
        for j in range(len(a_state.conv)):
            assert torch.equal(a_state.conv[j], b_state.conv[j]), (accepted, j)
            assert torch.equal(a_state.recurrent[j], b_state.recurrent[j]), (accepted, j)
    with pytest.raises(ValueError, match="accepted lengths"):
        commit_batched(KeptColumns(k.seqs, k.slots, k.columns, [], [], [], batched), st, [0, 1, 2, 4])
    with pytest.raises(ValueError, match="one accepted length per kept sequence"):
        commit_batched(KeptColumns(k.seqs, k.slots, k.columns, [], [], [], batched), st, [0, 1])
