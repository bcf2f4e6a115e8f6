"""Log-probabilities of generated tokens (SamplingParams.logprobs, the APIs' logprobs / top_logprobs).

1. ranks.sampler.token_logprobs over vocabulary shards (tp 1, 2, 3 ranks as threads) against float64
   log_softmax of the whole row: the chosen token's value, the top-k ids and values, the same on every rank.
2. Through the Engine (rank processes, tp 1 and 2; plain steps, steps planned ahead, MTP speculation):
   every generated token's entry against transformers' float64 log_softmax of the same checkpoint's
   logits with the prompt and the generated tokens teacher-forced.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from ranks.sampler import token_logprobs
from runtime import Engine, EngineOptions, SamplingParams
from tests.test_engine import HEADS, _seed
from tests.test_sampler import on_ranks
from tests.test_speculation import OPTS, TIMEOUT, _one_torch_thread  # noqa: F401 - the autouse fixture too
from tests.util import tiny_config, write_tiny_checkpoint


# --------------------------------------------------------------------------------------------------
# 1. The merge over vocabulary shards


def _sharded(logits: torch.Tensor, tokens: list[int], tops: list[int], tp: int) -> list[list]:
    """token_logprobs on `tp` simulated ranks (threads, tests/test_sampler.py on_ranks), each with its
    vocabulary shard: rank 0's result, after checking that every rank merged the same."""
    n = logits.shape[1] // tp
    results = on_ranks(tp, lambda r, gather: token_logprobs(logits[:, r * n:(r + 1) * n], tokens, tops, rank=r,
                                                            tp=tp, gather=gather))
    for r in range(1, tp):
        assert results[r] == results[0], f"rank {r} merged differently from rank 0"
    return results[0]


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_token_logprobs_over_shards_equal_log_softmax(tp, seed):
    g = torch.Generator().manual_seed(seed)
    R, V = 6, 3 * 2 * 97                                            # divisible by every tp
    logits = (torch.randn(R, V, generator=g) * 3.0).float()
    tokens = torch.randint(0, V, (R,), generator=g).tolist()
    tokens[0] = int(torch.argmax(logits[0]))                         # a chosen argmax and random others
    tops = [0, 1, 5, 20, 3, 20]
    got = _sharded(logits, tokens, tops, tp)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for r in range(R):
        lp, alts = got[r]
        assert math.isclose(lp, float(ref[r, tokens[r]]), abs_tol=2e-5), (r, lp, float(ref[r, tokens[r]]))
        assert len(alts) == tops[r]
        want = torch.topk(ref[r], tops[r]) if tops[r] else None
        if want is not None:
            assert [a[0] for a in alts] == want.indices.tolist()
            for (i, v), w in zip(alts, want.values.tolist()):
                assert math.isclose(v, w, abs_tol=2e-5) and math.isclose(v, float(ref[r, i]), abs_tol=2e-5)
            assert all(alts[j][1] >= alts[j + 1][1] for j in range(len(alts) - 1))


def test_token_logprobs_ties_go_to_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 0.5, 3.0, -2.0, 3.0]])
    got = _sharded(logits, [5], [3], 2)
    assert [a[0] for a in got[0][1]] == [1, 3, 5]
    assert math.isclose(got[0][0], got[0][1][2][1], abs_tol=1e-12)


# --------------------------------------------------------------------------------------------------
# 2. Through the engine, against transformers


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("logprobs"))
    spec, _ = write_tiny_checkpoint(d, tiny_config(False, **HEADS), _seed("engine-logprobs"))
    return d, spec


LOGPROB_TOL = 1e-2      # float32 ranks against float64: these hot random models' logits move by up to ~4e-3 with
                        # the summation order (tests/test_engine.py), a logprob is two of them (2.5e-3 seen);
                        # a wrong row, shard or merge is off by O(0.1 .. 1)


class HF:
    """transformers' model of the checkpoint in float64 (the reference) and in float32, whose own error
    measures the float32 noise at each position: on these hot models it grows along a prompt (0.025 at
    position 119 of one 150-token prompt, where the engine was 0.023 off), past the fixed LOGPROB_TOL."""

    def __init__(self, model_dir: str):
        transformers = pytest.importorskip("transformers", minversion="5.2")
        self.f64, self.f32 = (transformers.Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=dt).eval()
                              for dt in (torch.float64, torch.float32))

    def __call__(self, **kw):
        return self.f64(**kw)

    def rows(self, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 log-softmax rows of positions start.. of `ids`, and each row's allowance: LOGPROB_TOL
        plus twice transformers' own float32 error in that row (its largest over the vocabulary)."""
        with torch.no_grad():
            lp64, lp32 = (torch.log_softmax(m(input_ids=torch.tensor([ids])).logits[0, start:].double(), dim=-1)
                          for m in (self.f64, self.f32))
        return lp64, LOGPROB_TOL + 2 * (lp32 - lp64).abs().amax(dim=-1)


@pytest.fixture(scope="module")
def hf(dense):
    return HF(dense[0])


def _check_against_hf(hf: HF, prompt: list[int], tokens: list[int], entries: list, k: int) -> None:
    """Each entry = [logprob of tokens[i], top-k [[id, logprob]]] of position len(prompt) + i - 1."""
    assert entries is not None and len(entries) == len(tokens)
    lp, tols = hf.rows(prompt + tokens[:-1], len(prompt) - 1)
    for i, (t, (v, alts)) in enumerate(zip(tokens, entries)):
        row, tol = lp[i], float(tols[i])
        assert abs(v - float(row[t])) < tol, f"token {i}: {v} != {float(row[t])}"
        assert len(alts) == k
        top = torch.topk(row, k + 1)
        vals = top.values.tolist()
        for j, (a, av) in enumerate(alts):
            assert abs(av - float(row[a])) < tol
            assert abs(av - vals[j]) < tol                           # the j-th best value (ids may swap at ties)
        if k and vals[k - 1] - vals[k] > 5 * tol:                    # the set is clear: the same ids
            assert {a for a, _ in alts} == set(top.indices[:k].tolist())


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_logprobs_equal_transformers(dense, hf, tp):
    d, spec = dense
    rng = random.Random(_seed(f"logprobs-engine-{tp}"))
    cases = [([rng.randrange(spec.vocab_size) for _ in range(n)], params) for n, params in (
        (5, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, logprobs=5)),
        (70, SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_new_tokens=10, ignore_eos=True, logprobs=0)),
        (17, SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=5, max_new_tokens=9, ignore_eos=True,
                            logprobs=20)),
        (9, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)),        # did not ask
    )]
    with Engine.start(d, tp=tp, options=EngineOptions(**OPTS)) as eng:
        streams = [eng.submit(p, params) for p, params in cases]
        for (p, params), st in zip(cases, streams):
            events = list(st)
            r_tokens = [t for ev in events for t in ev.tokens]
            if params.logprobs is None:
                assert all(ev.logprobs is None for ev in events)
                continue
            entries = [e for ev in events if ev.tokens for e in ev.logprobs]
            assert all(ev.logprobs is None or len(ev.logprobs) == len(ev.tokens) for ev in events)
            _check_against_hf(hf, p, r_tokens, entries, params.logprobs)
        # the sampled token is the one the entry describes: greedy picks the top alternative
        p, params = cases[0]
        r = eng.submit(p, params).result(timeout=TIMEOUT)
        assert r.logprobs is not None and len(r.logprobs) == len(r.tokens)
        for t, (v, alts) in zip(r.tokens, r.logprobs):
            assert alts[0][0] == t and alts[0][1] == v


@pytest.mark.parametrize("tp", [1, 2])
def test_logprobs_with_speculation_and_other_step_modes(dense, hf, tp):
    """Speculation rounds emit several tokens per step: each gets the entry of its verification column;
    steps planned after each result, and device-fed steps (a step with a logprobs row is not fed)."""
    d, spec = dense
    rng = random.Random(_seed(f"logprobs-spec-{tp}"))
    prompts = [[rng.randrange(spec.vocab_size) for _ in range(n)] for n in (3, 66, 12)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, max_new_tokens=11, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)]
    for opts in (EngineOptions(spec_draft_tokens=3, **OPTS), EngineOptions(overlap_steps=False, **OPTS),
                 EngineOptions(device_feed=True, **OPTS)):
        with Engine.start(d, tp=tp, options=opts) as eng:
            streams = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
            results = [st.result(timeout=TIMEOUT) for st in streams]
            for p, sp, r in zip(prompts, params, results):
                assert r.error is None and len(r.tokens) == sp.max_new_tokens
                if sp.logprobs is None:
                    assert r.logprobs is None
                else:
                    _check_against_hf(hf, p, r.tokens, r.logprobs, sp.logprobs)
            if opts.spec_draft_tokens:
                assert eng.stats()["spec"]["rounds"] > 0


def _check_prompt_against_hf(hf: HF, prompt: list[int], entries: list, k: int) -> None:
    """Entry j = [logprob of prompt[j + 1] given prompt[:j + 1], top-k]: one per prompt token after the first."""
    assert entries is not None and len(entries) == len(prompt) - 1, (len(entries or []), len(prompt))
    lp, tols = hf.rows(prompt, 0)
    for j, (v, alts) in enumerate(entries):
        tol = float(tols[j])
        assert abs(v - float(lp[j, prompt[j + 1]])) < tol, (j, v, float(lp[j, prompt[j + 1]]))
        assert len(alts) == k
        for a, av in alts:
            assert abs(av - float(lp[j, a])) < tol
        if k:
            assert abs(alts[0][1] - float(lp[j].max())) < tol


@pytest.mark.parametrize("tp,spec_k", [(1, 0), (2, 0), (1, 2), (2, 2)])
def test_prompt_logprobs_equal_transformers(dense, hf, tp, spec_k):
    """Every prompt token after the first, across prefill chunks (64 columns here: a 150-token prompt
    takes three, their last columns predicting the next chunk's first token), with and without MTP
    speculation, next to sampled-token logprobs and a request that asks for neither."""
    d, spec = dense
    rng = random.Random(_seed(f"prompt-logprobs-{tp}-{spec_k}"))
    cases = [([rng.randrange(spec.vocab_size) for _ in range(n)], sp) for n, sp in (
        (150, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=1)),
        (5, SamplingParams(temperature=0.8, seed=2, max_new_tokens=3, ignore_eos=True, prompt_logprobs=0)),
        (1, SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True, prompt_logprobs=2)),
        (40, SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)),
    )]
    with Engine.start(d, tp=tp, options=EngineOptions(spec_draft_tokens=spec_k, **OPTS)) as eng:
        streams = [eng.submit(p, sp) for p, sp in cases]
        for (p, sp), st in zip(cases, streams):
            events = list(st)
            assert events[-1].error is None
            got = [e for ev in events for e in (ev.prompt_logprobs or [])]
            if sp.prompt_logprobs is None:
                assert all(ev.prompt_logprobs is None for ev in events)
                continue
            first = next(i for i, ev in enumerate(events) if ev.prompt_logprobs is not None) if len(p) > 1 else None
            if first is not None:                      # all of them with the first generated token
                assert events[first].tokens and all(ev.prompt_logprobs is None for ev in events[first + 1:])
            _check_prompt_against_hf(hf, p, got, sp.prompt_logprobs)
            if sp.logprobs is not None:
                tokens = [t for ev in events for t in ev.tokens]
                _check_against_hf(hf, p, tokens, [e for ev in events for e in ev.logprobs], sp.logprobs)
        r = eng.submit(cases[0][0], cases[0][1]).result(timeout=TIMEOUT)
        assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(cases[0][0]) - 1


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_token_logprobs_on_the_gpu_equal_log_softmax(tp, seed):
    """The device half of the merge (logsumexp, gather of the chosen id, top-k, offsets) on CUDA tensors
    of a 248k vocabulary, against float64 log_softmax on the CPU."""
    g = torch.Generator().manual_seed(seed)
    R, V = 5, 248_320
    logits = (torch.randn(R, V, generator=g) * 4.0).to(torch.bfloat16).float()
    tokens = torch.randint(0, V, (R,), generator=g).tolist()
    tokens[1] = int(torch.argmax(logits[1]))
    tops = [20, 0, 5, 1, 20]
    got = _sharded(logits.cuda(), tokens, tops, tp)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for r in range(R):
        assert abs(got[r][0] - float(ref[r, tokens[r]])) < 1e-4
        want = torch.topk(ref[r], tops[r])
        # bfloat16 logits tie often at 248k ids: the values must be the top ones, each id's its own
        assert max((abs(a[1] - w) for a, w in zip(got[r][1], want.values.tolist())), default=0.0) < 1e-4
        assert all(abs(v - float(ref[r, i])) < 1e-4 for i, v in got[r][1])
        assert len({i for i, _ in got[r][1]}) == tops[r]


@pytest.fixture(scope="module")
def demo_hf():
    transformers = pytest.importorskip("transformers", minversion="5.2")
    from ranks.demo import default_model_dir
    return default_model_dir(), transformers.Qwen3_5ForCausalLM.from_pretrained(default_model_dir(),
                                                                                 dtype=torch.float64).eval()


@pytest.mark.gpu
@pytest.mark.parametrize("spec_k", [0, 3])
def test_engine_logprobs_on_the_gpu(demo_hf, spec_k):
    """The CUDA backend (bfloat16, the host speculation path for logprob rows with the demo model's MTP
    head) on the embedded demo model (trained weights: its bfloat16 logprobs stay within ~0.02 of
    float64 at the likely tokens; random models are too hot for bfloat16 to say anything), against
    transformers' float64."""
    from runtime.tokenizer import Tokenizer
    d, hf = demo_hf
    tok = Tokenizer.from_dir(d)
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    cases = [(tok.encode(chat.format(q)), sp) for q, sp in (
        ("What is the capital of France?", SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True,
                                                          logprobs=4)),
        ("Name a colour.", SamplingParams(temperature=0.7, seed=9, max_new_tokens=10, ignore_eos=True, logprobs=2)),
        ("Count to five.", SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)),
    )]
    opts = EngineOptions(spec_draft_tokens=spec_k, **OPTS)
    with Engine.start(d, tp=1, device="cuda", dtype="bfloat16", options=opts) as eng:
        streams = [eng.submit(p, sp) for p, sp in cases]
        for (p, sp), st in zip(cases, streams):
            r = st.result(timeout=TIMEOUT)
            assert r.error is None and len(r.tokens) == sp.max_new_tokens
            if sp.logprobs is None:
                assert r.logprobs is None
                continue
            ids = torch.tensor([p + r.tokens[:-1]])
            with torch.no_grad():
                lp = torch.log_softmax(hf(input_ids=ids).logits[0, len(p) - 1:].double(), dim=-1)
            assert len(r.logprobs) == len(r.tokens)
            for i, (t, (v, alts)) in enumerate(zip(r.tokens, r.logprobs)):
                if float(lp[i, t]) > -3.0:                       # a likely token: bfloat16 is close there
                    assert abs(v - float(lp[i, t])) < 0.1, f"token {i}: {v} != {float(lp[i, t])}"
                assert len(alts) == sp.logprobs
                assert all(alts[j][1] >= alts[j + 1][1] for j in range(len(alts) - 1))
                assert abs(alts[0][1] - float(lp[i].max())) < 0.1      # the best value
                if sp.temperature == 0.0:
                    assert alts[0][0] == t and alts[0][1] == v
        # the prompt's tokens (a prompt longer than a 64-column prefill chunk)
        p = tok.encode(chat.format("Tell me about " + ", ".join(["Paris", "Rome", "Madrid", "Berlin"] * 8) + "."))
        assert len(p) > 64
        r = eng.submit(p, SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True,
                                         prompt_logprobs=3)).result(timeout=TIMEOUT)
        assert r.error is None and len(r.prompt_logprobs) == len(p) - 1
        with torch.no_grad():
            lp = torch.log_softmax(hf(input_ids=torch.tensor([p])).logits[0].double(), dim=-1)
        # teacher-forced over repetitive text the bfloat16 values drift more than at the generated tokens
        # (0.19 seen at a best alternative of -1.2); an entry of the wrong position is off by nats
        for j, (v, alts) in enumerate(r.prompt_logprobs):
            if float(lp[j, p[j + 1]]) > -3.0:
                assert abs(v - float(lp[j, p[j + 1]])) < 0.3, (j, v, float(lp[j, p[j + 1]]))
            assert len(alts) == 3 and abs(alts[0][1] - float(lp[j].max())) < 0.3
        if spec_k:
            assert eng.stats()["spec"]["rounds"] > 0


def test_logprobs_bounds_are_checked():
    for bad in (-1, 21, 2.0, True, "3"):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(logprobs=20).logprobs == 20 and SamplingParams(logprobs=0).logprobs == 0


def test_tokens_a_thinking_budget_inserts_have_no_entry(dense, hf):
    """The close-of-thinking tokens a budget inserts were not sampled: their entries are None, the
    sampled tokens around them keep theirs (against transformers on the whole sequence)."""
    d, spec = dense
    rng = random.Random(_seed("logprobs-budget"))
    prompt = [rng.randrange(spec.vocab_size) for _ in range(6)]
    close = (7, 8, 9)
    # the end id is never sampled (logit_bias -100; logprobs stay those of the raw distribution), so the
    # budget always inserts the close tokens
    sp = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=1, thinking_budget=2,
                        thinking_end_ids=(close[0],), thinking_close_ids=close, logit_bias={close[0]: -100.0})
    with Engine.start(d, tp=1, options=EngineOptions(**OPTS)) as eng:
        r = eng.submit(prompt, sp).result(timeout=TIMEOUT)
    assert r.error is None and len(r.logprobs) == len(r.tokens) == 10
    at = next(i for i in range(len(r.tokens) - 2) if tuple(r.tokens[i:i + 3]) == close)
    assert r.logprobs[at:at + 3] == [None, None, None]
    assert all(e is not None for i, e in enumerate(r.logprobs) if not at <= i < at + 3)
    sampled = [i for i in range(len(r.tokens)) if not at <= i < at + 3]
    ids = torch.tensor([prompt + r.tokens[:-1]])
    with torch.no_grad():
        lp = torch.log_softmax(hf(input_ids=ids).logits[0, len(prompt) - 1:].double(), dim=-1)
    for i in sampled:
        assert abs(r.logprobs[i][0] - float(lp[i, r.tokens[i]])) < LOGPROB_TOL
