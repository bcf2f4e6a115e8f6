#!/usr/bin/env python
"""The prompt-prefix cache through the engine: an agent loop's turns, time to first token with the
cache and without it.

    python scripts/bench/prefix_cache.py --device cpu --context 2000 --turn-tokens 200 --turns 5
    python scripts/bench/prefix_cache.py --device cuda --model 27b --context 16000 32000 --out prefix.json

Each turn's prompt is the previous turn's prompt, its output (greedy, --new-tokens, ignore_eos) and
--turn-tokens new tokens (a tool result, say), the way an agent resends a growing conversation; the
first prompt holds --context tokens. For each context length the same turns run on an engine with
the cache (--prefix-cache 1: the conversation's last frontier is all it needs) and one without, and
the table gives the median TTFT of turns 2.. on each, their ratio, and the prompt tokens served
from the cache. Before the conversation each engine also serves --one-shot prompts of --context
tokens that share nothing (the median TTFT of those is what leaving a frontier costs a prompt that
is never resent); --cut-too adds an engine with the cache on whose prefill chunks end on frontiers
instead of saving them mid-step (EngineOptions.snapshot_in_step False). --model demo (default) runs
the embedded model; a preset name (27b, 35b-a3b, ...) random weights built on the devices from its
config.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)

from runtime import Engine, EngineOptions, SamplingParams  # noqa: E402


def conversation(rng: random.Random, vocab: int, context: int, turn_tokens: int) -> tuple[list[int], callable]:
    first = [rng.randrange(vocab) for _ in range(context)]

    def extend(prompt: list[int], output: list[int]) -> list[int]:
        return prompt + output + [rng.randrange(vocab) for _ in range(turn_tokens)]
    return first, extend


def turn(engine, prompt: list[int], new_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT in s, the output ids, cached_tokens) of one greedy request."""
    t0 = time.perf_counter()
    first_at, tokens, usage = None, [], None
    for ev in engine.submit(prompt, SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)):
        if ev.tokens and first_at is None:
            first_at = time.perf_counter()
        tokens += ev.tokens
        if ev.usage is not None:
            usage = ev.usage
    return first_at - t0, tokens, (usage or {}).get("cached_tokens", 0)


def run(model_dir: str, args, context: int, cache: bool, random_weights: bool, vocab: int, dtype: str,
        in_step: bool = True) -> dict:
    max_context = context + args.turns * (args.turn_tokens + args.new_tokens) + 64
    opts = EngineOptions(max_concurrency=1, max_context=max_context, prefix_cache=1 if cache else 0,
                         random_weights=random_weights, weights=args.weights, startup_timeout_s=900,
                         prefill_chunk=args.prefill_chunk, snapshot_in_step=in_step)
    rng = random.Random(args.seed)
    prompt, extend = conversation(rng, vocab, context, args.turn_tokens)
    one_shot = [[rng.randrange(vocab) for _ in range(context)] for _ in range(args.one_shot)]
    turns, single = [], []
    with Engine.start(model_dir, tp=args.tp, device=args.device, dtype=dtype, options=opts) as engine:
        for p in one_shot:
            single.append(turn(engine, p, 1)[0])
        for t in range(args.turns):
            ttft, tokens, cached = turn(engine, prompt, args.new_tokens)
            turns.append(dict(prompt_tokens=len(prompt), ttft_s=ttft, cached_tokens=cached))
            prompt = extend(prompt, tokens)
    later = [t["ttft_s"] for t in turns[1:]]
    return dict(context=context, cache=cache, in_step=in_step, turns=turns, one_shot_ttft_s=single,
                one_shot_median_s=statistics.median(single) if single else None,
                median_ttft_s=statistics.median(later) if later else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="demo (the embedded model) or a random preset (27b, ...)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--weights", default="bf16", help="bf16, fp8, fp8-block or nvfp4 (random presets)")
    ap.add_argument("--context", type=int, nargs="+", default=[2000])
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--turn-tokens", type=int, default=200, help="new tokens each turn adds after the output")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated each turn")
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--one-shot", type=int, default=3, help="unrelated prompts of --context tokens served first")
    ap.add_argument("--cut-too", action="store_true",
                    help="also the cache with prefill chunks cut at frontiers (no mid-step saves)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.turns < 2:
        ap.error("--turns must be >= 2 (the first turn has nothing cached)")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.model == "demo":
        from ranks.demo import default_model_dir
        from runtime.config import load_spec
        model_dir, random_weights = default_model_dir(), False
        vocab = load_spec(model_dir).vocab_size
    else:
        from ranks.random_checkpoint import config_only_dir
        (model_dir, cfg), random_weights = config_only_dir(args.model, args.layers), True
        vocab = cfg["vocab_size"]
    res = dict(model=args.model, device=args.device, tp=args.tp, dtype=dtype, weights=args.weights,
               date=time.strftime("%Y-%m-%d"), commit=os.environ.get("TANDEM_COMMIT"), runs=[])
    def ms(x: float | None) -> str:
        return f"{x * 1e3:7.1f}ms" if x is not None else f"{'-':>9s}"

    print(f"{'context':>8s} {'engine':>10s} {'TTFT':>9s} {'vs off':>7s} {'one-shot':>9s} {'vs off':>7s} "
          f"{'cached / prompt (last turn)':>28s}")
    for context in args.context:
        engines = [("off", False, True), ("on", True, True)] + ([("on, cut", True, False)] if args.cut_too else [])
        runs = [run(model_dir, args, context, cache, random_weights, vocab, dtype, in_step)
                for _, cache, in_step in engines]
        res["runs"] += runs
        off = runs[0]
        for (name, _, _), r in zip(engines, runs):
            last = r["turns"][-1]
            shot = r["one_shot_median_s"]
            print(f"{context:8d} {name:>10s} {ms(r['median_ttft_s'])} {r['median_ttft_s'] / off['median_ttft_s']:7.3f} "
                  f"{ms(shot)} {shot / off['one_shot_median_s'] if shot else float('nan'):7.3f} "
                  f"{last['cached_tokens']:>13d} / {last['prompt_tokens']:<13d}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
