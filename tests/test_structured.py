"""Structured outputs in the engine (runtime.grammar, the coordinator's masks, the ranks' sampler).

Independent checks: every finished output is validated by `jsonschema` / `re.fullmatch` / the list of
choices (not by the grammar library that constrained it); every generated token is replayed through
a fresh parser, which must accept it; a grammar that admits one string forces that exact text
whatever the model prefers; unconstrained requests in the same steps are unchanged (the masks do not
leak between rows, shards or steps). Sampler unit tests check the masked logits against a float
formula on every vocabulary shard. The engine runs the embedded demo model (it has a tokenizer and
an MTP head) on the CPU at tp 1 and 2, with speculation, steps planned after each result and
device-fed steps.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch

from ranks.demo import PACKAGED_DIR
from ranks.sampler import SeqSampler, apply_penalties, sample_rows
from runtime import Engine, EngineOptions, SamplingParams
from runtime import grammar as G
from runtime.tokenizer import Tokenizer
from tests.conftest import BASE_SEED

TIMEOUT = 180
OPTS = dict(max_concurrency=8, max_pending=64, prefill_chunk=64, max_step_tokens=256, max_context=1024,
            threads_per_rank=1, startup_timeout_s=180)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8} is [0-9]{2,3}\."
CHOICES = ["alpha", "beta", "gamma delta"]


def _seed(name: str) -> int:
    return (BASE_SEED + zlib.crc32(name.encode())) % 2**31


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(PACKAGED_DIR)


def _llg(tok):
    from runtime.config import load_spec
    spec = load_spec(PACKAGED_DIR)
    return G.llg_tokenizer(f"{PACKAGED_DIR}/tokenizer.json", spec.vocab_size, tuple(spec.eos_token_ids)), spec


def _cases(tok, rng):
    """(name, prompt ids, params, check(text) -> None) for each grammar and sampler kind."""
    prompts = ["Describe a person as JSON.", "Write a short sentence about a number.", "Pick one word."]
    g_json = G.compile_format({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                              "response_format")
    g_obj = G.compile_format({"type": "json_object"}, "response_format")
    g_re = G.regex_grammar(REGEX, "guided_regex")
    g_ch = G.choice_grammar(CHOICES, "guided_choice")
    samplers = [dict(temperature=0.0), dict(temperature=1.0, seed=rng.randrange(2**31)),
                dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=rng.randrange(2**31))]

    def json_ok(text):
        jsonschema.validate(json.loads(text), SCHEMA)

    def obj_ok(text):
        assert isinstance(json.loads(text), dict), text

    def re_ok(text):
        assert re.fullmatch(REGEX, text), text

    def ch_ok(text):
        assert text in CHOICES, text

    out = []
    for i, (g, ok, p) in enumerate(((g_json, json_ok, 0), (g_obj, obj_ok, 0), (g_re, re_ok, 1), (g_ch, ch_ok, 2))):
        for j, kw in enumerate(samplers):
            ids = tok.encode(prompts[p] + " " * (j % 2))
            out.append((f"g{i}s{j}", ids, SamplingParams(max_new_tokens=160, grammar=g, **kw), ok))
    return out


def _check(tok, llg_tok, eos, params, tokens, finish, ok):
    """Every token passes a fresh parser; a finished output (end-of-sequence id last) is valid."""
    m = G.Constraint(llg_tok, params.grammar)
    for i, t in enumerate(tokens):
        mask = m.mask()
        assert G.mask_shard(mask, t, 1)[0], f"token {i} ({t}) was not allowed"
        m.advance([t])
        assert m.error is None, m.error
    if finish == "stop":                  # ended at an end id, or where the grammar could take no more
        assert tokens[-1] in eos or m.complete, (tokens[-3:], finish)
        ok(tok.decode(tokens[:-1] if tokens[-1] in eos else tokens))
    else:
        assert finish == "length" and len(tokens) == params.max_new_tokens


def _run(engine, reqs):
    streams = [engine.submit(ids, params) for _, ids, params, _ in reqs]
    return [s.result(timeout=TIMEOUT) for s in streams]


@pytest.mark.parametrize("tp", [1, 2])
def test_constrained_outputs_follow_their_grammar(tok, tp):
    """json_schema / json_object / regex / choice grammars under greedy, temperature and top-p with a
    repetition penalty, eight at a time beside unconstrained requests, at tp 1 and 2 (each rank masks
    its own vocabulary shard): every output is valid and finished, and the unconstrained requests
    produce what they produce alone."""
    llg_tok, spec = _llg(tok)
    eos = set(spec.eos_token_ids)
    reqs = _cases(tok, random.Random(_seed(f"structured-{tp}")))
    free = [("free", tok.encode("Once upon a time"), SamplingParams(temperature=0.0, max_new_tokens=24,
                                                                        ignore_eos=True), None)]
    with Engine.start(PACKAGED_DIR, tp=tp, options=EngineOptions(**OPTS)) as eng:
        alone = _run(eng, free)[0]
        results = _run(eng, reqs[:4] + free + reqs[4:])
    together = results.pop(4)
    assert together.tokens == alone.tokens
    for (name, _, params, ok), r in zip(reqs, results):
        assert r.error is None, (name, r.error)
        _check(tok, llg_tok, eos, params, r.tokens, r.finish_reason, ok)
    # bounded grammars end well inside the budget; a free JSON object may run on in one long string
    # (a valid prefix, checked above)
    unfinished = [(n, tok.decode(r.tokens)) for (n, _, p, _), r in zip(reqs, results)
                  if r.finish_reason != "stop" and not n.startswith("g1")]
    assert not unfinished, unfinished


def test_a_grammar_overrides_what_the_model_prefers(tok):
    """A grammar of one string yields exactly that string, token by token, greedy and sampled, and the
    same text with speculation on, steps planned after each result and device-fed steps."""
    target = "zebra 42 quokka!"
    g = G.regex_grammar(re.escape(target), "guided_regex")
    ids = tok.encode("Hello")
    params = [SamplingParams(temperature=0.0, max_new_tokens=40, grammar=g),
              SamplingParams(temperature=1.5, seed=7, max_new_tokens=40, grammar=g)]
    for opts in (dict(), dict(spec_draft_tokens=3), dict(overlap_steps=False), dict(device_feed=True)):
        with Engine.start(PACKAGED_DIR, tp=1, options=EngineOptions(**opts, **OPTS)) as eng:
            free = eng.submit(ids, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
            got = [eng.submit(ids, p).result(timeout=TIMEOUT) for p in params]
            free = free.result(timeout=TIMEOUT)
        assert target not in tok.decode(free.tokens)           # the model on its own writes something else
        for r in got:
            assert r.error is None and r.finish_reason == "stop", (opts, r.error, r.finish_reason)
            assert tok.decode(r.tokens) == target, (opts, tok.decode(r.tokens))   # ended when complete


def test_speculation_and_fed_steps_keep_constrained_outputs_valid(tok):
    """With MTP speculation (constrained sequences take no drafts; the others still speculate) and
    device-fed steps, the same greedy constrained requests give the same tokens as plain steps."""
    llg_tok, spec = _llg(tok)
    reqs = [r for r in _cases(tok, random.Random(_seed("structured-spec"))) if r[2].temperature == 0.0]
    free = ("free", tok.encode("The weather today"), SamplingParams(temperature=0.0, max_new_tokens=20,
                                                                    ignore_eos=True), None)
    outs = {}
    for name, opts in (("plain", dict(overlap_steps=False)), ("spec", dict(spec_draft_tokens=3)),
                       ("fed", dict(device_feed=True))):
        with Engine.start(PACKAGED_DIR, tp=1, options=EngineOptions(**opts, **OPTS)) as eng:
            res = _run(eng, reqs + [free])
            if name == "spec":
                assert eng.stats()["spec"]["drafted"] > 0      # the free request speculated
        outs[name] = [r.tokens for r in res]
        for (n, _, params, ok), r in zip(reqs, res):
            _check(tok, llg_tok, set(spec.eos_token_ids), params, r.tokens, r.finish_reason, ok)
    assert outs["spec"] == outs["plain"] and outs["fed"] == outs["plain"]


def test_a_complete_output_ends_the_request_even_with_ignore_eos(tok):
    """A grammar that can take nothing more ends the request ("stop") without an end id, so ignore_eos
    cannot pad a finished document with end tokens."""
    ends = set(_llg(tok)[1].eos_token_ids) | set(tok.eos_token_ids)
    with Engine.start(PACKAGED_DIR, tp=1, options=EngineOptions(**OPTS)) as eng:
        for p in (SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True,
                                 grammar=G.choice_grammar(CHOICES, "c")),
                  SamplingParams(temperature=1.0, seed=5, max_new_tokens=30, ignore_eos=True,
                                 grammar=G.regex_grammar(REGEX, "r"))):
            r = eng.submit(tok.encode("Pick one word."), p).result(timeout=TIMEOUT)
            assert r.finish_reason == "stop" and r.tokens[-1] not in ends, tok.decode(r.tokens)
            text = tok.decode(r.tokens)
            assert text in CHOICES or re.fullmatch(REGEX, text), text


def test_whitespace_may_precede_the_grammar_after_reasoning(tok):
    """After </think> up to two whitespace-only tokens are allowed (and not fed to the grammar); the
    third must be the grammar's."""
    llg_tok, _ = _llg(tok)
    end = tok.token_to_id("</think>")
    nl = tok.encode("\n\n")
    assert end is not None and len(nl) == 1
    c = G.Constraint(llg_tok, G.regex_grammar("ok", "r"), after=(end,))
    c.advance([end])
    first = G.mask_shard(c.mask(), 0, llg_tok.vocab_size)
    ok_id = tok.encode("ok")
    assert len(ok_id) == 1 and first[nl[0]] and first[ok_id[0]] and first.sum() == 1 + G.mask_shard(
        G.whitespace_mask(llg_tok), 0, llg_tok.vocab_size).sum()
    c.advance(nl + nl)
    third = G.mask_shard(c.mask(), 0, llg_tok.vocab_size)
    assert not third[nl[0]] and third[ok_id[0]] and third.sum() == 1
    c.advance(tok.encode("ok"))
    assert c.complete and c.error is None


def test_bad_grammars_are_refused_and_the_engine_keeps_serving(tok):
    with Engine.start(PACKAGED_DIR, tp=1, options=EngineOptions(**OPTS)) as eng:
        with pytest.raises(ValueError, match="grammar"):
            eng.submit(tok.encode("x"), SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: ("}]}'))
        with pytest.raises(ValueError, match="grammar_after"):
            eng.submit(tok.encode("x"), SamplingParams(grammar=G.json_object_grammar(), grammar_after=(10**9,)))
        r = eng.submit(tok.encode("x"), SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
        assert len(r.result(timeout=TIMEOUT).tokens) == 3


@pytest.mark.parametrize("fmt, field", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "schema": {"properties": {"a": {"$ref": "#/$defs/missing"}}}}, "response_format.schema"),
    ({"type": "json_schema", "schema": [1, 2]}, "response_format.schema"),
    ({"type": "yaml"}, "response_format.type"),
    ("json", "response_format"),
])
def test_compile_format_names_the_bad_field(fmt, field):
    with pytest.raises(G.GrammarError, match=re.escape(field)):
        G.compile_format(fmt, "response_format")


def test_text_format_is_no_grammar():
    assert G.compile_format({"type": "text"}, "f") is None and G.compile_format(None, "f") is None


def test_the_grammar_applies_after_the_end_of_reasoning(tok):
    """grammar_after: no mask until that id is in the output; tokens inserted after it (the close of
    a thinking budget) stay free; the next sampled token is constrained."""
    llg_tok, _ = _llg(tok)
    end = tok.encode("</think>") if tok.token_to_id("</think>") is None else [tok.token_to_id("</think>")]
    assert len(end) == 1
    c = G.Constraint(llg_tok, G.regex_grammar("ok", "r"), after=(end[0],))
    assert c.mask() is None
    c.advance(tok.encode("thinking hard"))
    assert c.mask() is None
    c.advance([end[0]] + tok.encode("\n\n"))
    m = c.mask()
    assert m is not None and not c.active          # the grammar or (still) whitespace
    allowed = np.nonzero(G.mask_shard(m, 0, len(m) * 8))[0]
    texts = [tok.decode([int(t)]) for t in allowed]
    assert "ok" in texts and all(("ok".startswith(x) or not x.strip()) and x for x in texts), texts


TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
              "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit/x",
                                                                                   "a b#c-d&e~f.(g)"]},
                                               "exact": {"type": "boolean"}, "lat": {"type": "number"}}}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
         {"name": "lookup", "strict": True, "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}},
         {"type": "function", "function": {"name": "loose", "parameters": {"type": "object", "properties": {
             "a": {"type": "string"}}}}}]


def _accepts(tok, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` (tokenised as the model would write it, <tool_call> and
    </tool_call> as their single ids) as a complete output."""
    llg_tok, _ = _llg(tok)
    import llguidance
    m = llguidance.LLMatcher(llg_tok, grammar, log_level=0)
    for t in tok.encode(text):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


CALL_W = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
CALL_S = "<tool_call>\n<function=search>\n<parameter=any key>\na </parameter> b\nc\n</parameter>\n</function>\n</tool_call>"
CALL_L = "<tool_call>\n<function=lookup>\n</function>\n</tool_call>"


def test_tool_call_grammar_takes_declared_calls_only(tok):
    """tool_call_grammar: calls in the XML form of the offered tools only, keys a strict tool's schema
    declares (any key where it declares none or is not strict), values with anything but a line
    "</parameter>" (a strict tool's integers, numbers, booleans and enums: literals of their type);
    one call, or
    several with parallel; a named choice only that function; a prompt-opened call continued."""
    ids = (tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>"))
    assert None not in ids
    g = G.tool_call_grammar(TOOLS, None, True, "", *ids)
    loose = CALL_W.replace("get_weather", "loose").replace("parameter=days", "parameter=undeclared")
    for text in (CALL_W, CALL_S, CALL_L, loose, CALL_W + "\n" + CALL_L, CALL_S + "\n" + CALL_W + "\n" + CALL_W):
        assert _accepts(tok, g, text), text
    for text in ("", "Sure! " + CALL_W, CALL_W + " done", CALL_W.replace("get_weather", "get_time"),
                 CALL_W.replace("parameter=days", "parameter=weeks"), CALL_L.replace("lookup>", "lookup>\n<parameter=x>"),
                 CALL_W + CALL_W, CALL_W.replace("</function>", "")):
        assert not _accepts(tok, g, text), text
    # a strict tool's integer, number, boolean and enum values are literals of their type
    def weather(**values):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        return f"<tool_call>\n<function=get_weather>\n{body}</function>\n</tool_call>"
    good = [dict(days=12, unit="fahrenheit/x", exact="True", lat="-48.5e1"), dict(exact="false", lat=0, days=-3),
            dict(city="anything at all\nover lines", unit="celsius"), dict(unit="a b#c-d&e~f.(g)")]
    bad = [dict(days="three"), dict(days="1.5"), dict(unit="kelvin"), dict(exact="yes"), dict(lat="1,5"),
           dict(days="07"), dict(unit="a b")]
    for values in good:
        assert _accepts(tok, g, weather(**values)), values
    for values in bad:
        assert not _accepts(tok, g, weather(**values)), values
    one = G.tool_call_grammar(TOOLS, None, False, "", *ids)
    assert _accepts(tok, one, CALL_W) and not _accepts(tok, one, CALL_W + "\n" + CALL_L)
    named = G.tool_call_grammar(TOOLS, "lookup", True, "", *ids)
    assert _accepts(tok, named, CALL_L) and not _accepts(tok, named, CALL_W)
    # the prompt opened "<tool_call>\n<function" (required, several tools) or the whole head (one tool)
    opened = G.tool_call_grammar(TOOLS, None, True, "<tool_call>\n<function", *ids)
    assert _accepts(tok, opened, CALL_W[len("<tool_call>\n<function"):] + "\n" + CALL_L)
    assert not _accepts(tok, opened, CALL_W)
    head = "<tool_call>\n<function=get_weather>\n"
    g1 = G.tool_call_grammar(TOOLS, "get_weather", False, head, *ids)
    assert _accepts(tok, g1, CALL_W[len(head):]) and not _accepts(tok, g1, CALL_W[len(head):] + "\n" + CALL_W)
    with pytest.raises(G.GrammarError, match="tool_choice"):
        G.tool_call_grammar(TOOLS, "missing", True, "", *ids)
    with pytest.raises(G.GrammarError, match="tool_choice"):
        G.tool_call_grammar(TOOLS, None, True, "<tool_call>\n<function=other>\n", *ids)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_masked_logits_are_the_logits_with_disallowed_ids_at_minus_inf(shards):
    """apply_penalties with a mask, on each shard of a 300-id vocabulary (with a bias and a penalty
    too): -inf exactly where the mask bit is 0, the unmasked formula elsewhere; sample_rows then picks
    only allowed ids, greedy and sampled."""
    rng = np.random.default_rng(_seed(f"mask-{shards}"))
    V = 300
    logits = torch.from_numpy(rng.normal(0, 3, V)).double()
    allow = rng.random(V) < 0.1
    allow[rng.integers(V)] = True
    mask = np.packbits(allow, bitorder="little").tobytes()
    base = dict(presence_penalty=0.5, bias=((3, 5.0), (250, -2.0)), seen={3: 1, 7: 2}, output={3: 1, 7: 2},
                prompt_len=0)
    n = V // shards
    for r in range(shards):
        lo = r * n
        shard = logits[lo:lo + n]
        got = apply_penalties(shard, SeqSampler(allow=mask, **base), lo)
        want = apply_penalties(shard, SeqSampler(**base), lo)
        keep = torch.from_numpy(allow[lo:lo + n])
        assert torch.isneginf(got[~keep]).all()
        assert torch.equal(got[keep], want[keep])
    full = logits[None].float()
    for s in (SeqSampler(temperature=0.0, allow=mask), SeqSampler(temperature=1.0, seed=3, allow=mask),
              SeqSampler(temperature=1.0, top_p=0.5, seed=4, allow=mask)):
        for pos in range(20):
            t = sample_rows(full, [s], [pos], rank=0, tp=1, gather=None)[0]
            assert allow[t], (s, pos, t)
    t = sample_rows(full, [SeqSampler(temperature=0.0, allow=mask)], [0], rank=0, tp=1, gather=None)[0]
    assert t == int(np.flatnonzero(allow)[np.argmax(logits.numpy()[allow])])


# bfloat16 logits differ by column count (a step of one row and one of many take different GEMV routes,
# so different summation orders): two greedy runs of one prompt may part where the top two are this close
BF16_TIE = 0.25


def _same_greedy_up_to_a_near_tie(got, alone):
    """`got` (a greedy run beside other requests) equals `alone` (the same request alone) or parts from it
    only where both runs' top two are within BF16_TIE and each picked the other's second choice; a mask
    leaking from a constrained row would force a token no such near tie explains."""
    for i, (a, b) in enumerate(zip(alone.tokens, got.tokens)):
        if a == b:
            continue
        for run, mine, other in ((alone, a, b), (got, b, a)):
            (first, lp1), (second, lp2) = run.logprobs[i][1][:2]     # [logprob, [[id, logprob], ...]]
            assert first == mine and second == other and lp1 - lp2 < BF16_TIE, (
                f"greedy runs part at {i} ({a} alone, {b} beside others) at no near tie: {run.logprobs[i]}")
        return
    assert got.tokens == alone.tokens


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(), dict(spec_draft_tokens=3), dict(device_feed=False)],
                         ids=["fed", "spec", "plain"])
def test_constrained_outputs_on_the_gpu(tok, opts):
    """The demo model on the CUDA backend (bfloat16): the masks reach the GPU ranks' samplers on
    device-fed steps (the default at tp 1), beside MTP speculation and GPU rounds (constrained rows
    are kept out of them) and on plain steps; every output is valid, the one-string grammar forces
    its text, an unconstrained greedy request beside them equals its run alone, and min_tokens holds a
    greedy chat answer past its stop id."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    llg_tok, spec = _llg(tok)
    reqs = _cases(tok, random.Random(_seed("structured-gpu")))
    target = "zebra 42 quokka!"
    forced = ("forced", tok.encode("Hello"), SamplingParams(temperature=0.0, max_new_tokens=40,
                                                            grammar=G.regex_grammar(re.escape(target), "r")), None)
    free = ("free", tok.encode("Once upon a time"), SamplingParams(temperature=0.0, max_new_tokens=24,
                                                                   ignore_eos=True, logprobs=2), None)
    # min_tokens on the GPU ranks: a chat answer that ends on a stop id after n tokens, then the same
    # request held to n + 4 (its stop ids masked out until then, through the same mask path)
    chat = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with Engine.start(PACKAGED_DIR, tp=1, device="cuda", dtype="bfloat16", options=EngineOptions(**opts, **OPTS)) as eng:
        alone = _run(eng, [free])[0]
        ends = _run(eng, [("ends", chat, SamplingParams(temperature=0.0, max_new_tokens=64, logprobs=2), None)])[0]
        n = len(ends.tokens)
        held = _run(eng, [("held", chat, SamplingParams(temperature=0.0, max_new_tokens=n + 8, min_tokens=n + 4,
                                                        logprobs=2), None)])[0]
        results = _run(eng, reqs + [forced, free])
    _same_greedy_up_to_a_near_tie(results[-1], alone)
    stops = set(spec.eos_token_ids)
    assert ends.finish_reason == "stop" and ends.tokens[-1] in stops, "the chat answer should end on a stop id"
    assert held.error is None and len(held.tokens) >= n + 4 and not stops & set(held.tokens[:n + 4]), held.tokens
    # up to the stop, the held request is the same greedy answer (or parts from it at a near tie)
    _same_greedy_up_to_a_near_tie(SimpleNamespace(tokens=held.tokens[:n - 1], logprobs=held.logprobs[:n - 1]),
                                  SimpleNamespace(tokens=ends.tokens[:n - 1], logprobs=ends.logprobs[:n - 1]))
    assert results[-2].error is None and tok.decode(results[-2].tokens) == target
    for (name, _, params, ok), r in zip(reqs, results):
        assert r.error is None, (name, r.error)
        _check(tok, llg_tok, set(spec.eos_token_ids), params, r.tokens, r.finish_reason, ok)


def test_min_tokens_masks_out_the_stop_ids_and_keeps_the_grammars_mask(seed):
    """MinTokens: until n tokens are taken its mask allows every id but the stop ids; over a grammar's
    mask it allows what both allow, and where the grammar allows only a stop id the grammar's mask
    stands; tokens reach the grammar; after n tokens the mask is the grammar's (None without one)."""
    from runtime.grammar import MinTokens
    rng = np.random.default_rng(_seed(f"min-tokens-{seed}"))
    V = int(rng.integers(40, 300))
    stops = frozenset(int(t) for t in rng.choice(V, 3, replace=False))

    def bits(m):
        return np.unpackbits(np.frombuffer(m, dtype=np.uint8), bitorder="little")[:V].astype(bool)

    class Grammar:
        def __init__(self, allow):
            self.allow, self.taken, self.error, self.complete = allow, [], None, False

        def mask(self):
            return np.packbits(self.allow, bitorder="little").tobytes()

        def advance(self, tokens):
            self.taken += tokens

    alone = MinTokens(2, stops, V)
    for _ in range(2):
        assert bits(alone.mask()).tolist() == [t not in stops for t in range(V)]
        alone.advance([int(rng.integers(V))])
    assert alone.mask() is None and alone.left == 0
    allow = rng.random(V) < 0.5
    allow[sorted(stops)[0]] = True
    g = Grammar(allow)
    both = MinTokens(3, stops, V, g)
    assert bits(both.mask()).tolist() == [bool(allow[t]) and t not in stops for t in range(V)]
    both.advance([7, 8])
    assert g.taken == [7, 8] and both.left == 1
    g.allow = np.zeros(V, dtype=bool)
    g.allow[sorted(stops)[0]] = True                # the grammar can only end: its mask stands
    assert bits(both.mask()).tolist() == g.allow.tolist()
    both.advance([9])
    assert bits(both.mask()).tolist() == g.allow.tolist() and both.inner is g
