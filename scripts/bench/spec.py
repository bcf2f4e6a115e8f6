#!/usr/bin/env python
"""MTP speculation through the engine: tokens per round, round time and tok/s for K draft tokens
against plain decoding, per concurrency.

    python scripts/bench/spec.py --device cuda --draft-tokens 0 1 2 3 4 5 --concurrency 1 4 8 --out spec.json
    python scripts/bench/spec.py --device cuda --model 27b --tp 2 --draft-tokens 0 3 --concurrency 1 \
        --rounds gpu eager

--model demo (default) runs the embedded model with its trained MTP head (real acceptance, greedy
chat-like prompts from its tokenizer); a preset name (27b, 35b-a3b, ...) runs random weights built on
the GPUs (acceptance ~0, so a round yields one token: what it measures is the round's cost next to a
plain step, from which the break-even acceptance follows). For each K (0 = off) and C: C requests
submitted together, greedy, ignore_eos; round time = the median gap between a request's output
events (each round, or plain step, sends one), the steady round; mean_round_s in the JSON is
(last finish - last first token) / rounds of the slowest request, which also counts the last
rounds (fewer drafts near max_new_tokens, on the eager path) and the first after prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

import numpy as np

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)
sys.path.insert(0, os.path.join(repo_root, "scripts", "bench"))

from decode import decode_window  # noqa: E402
from runtime import Engine, EngineOptions, SamplingParams  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
           "import os\nimport sys\n\n\ndef main():\n", "The quick brown fox", "class Stack:\n    def __init__(self):\n",
           "<|im_start|>user\nWrite a python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
           "for i in range(10):\n", "# Sorting a list in Python\n"]


def run(model_dir: str, prompts: list[list[int]], tp: int, device: str, dtype: str, k: int, C: int,
        new_tokens: int, random_weights: bool, log_level: str = "WARNING", rounds: str = "gpu",
        weights: str = "bf16", draft_vocab: int = 0) -> dict:
    os.environ["TANDEM_SPEC_GPU_ROUNDS"] = "1" if rounds == "gpu" else "0"      # the ranks inherit it
    opts = EngineOptions(weights=weights, spec_draft_vocab=draft_vocab, max_concurrency=C, spec_draft_tokens=k, random_weights=random_weights,
                         max_context=max(map(len, prompts)) + new_tokens + 16, startup_timeout_s=900,
                         log_level=log_level)
    with Engine.start(model_dir, tp=tp, device=device, dtype=dtype, options=opts) as engine:
        def batch():
            finals = [None] * C

            def one(i):
                evs, at = [], []
                for ev in engine.submit(prompts[i % len(prompts)], SamplingParams(
                        temperature=0, max_new_tokens=new_tokens, ignore_eos=True)):
                    evs.append(ev)
                    at.append(time.perf_counter())
                if evs[-1].error:
                    raise RuntimeError(evs[-1].error)
                finals[i] = evs[-1]
                gaps.extend(np.diff(at[1:]).tolist())          # one event per round after the first token
            threads = [threading.Thread(target=one, args=(i,)) for i in range(C)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return finals
        gaps: list[float] = []
        batch()                                         # warm-up: kernels, graphs
        gaps.clear()
        finals = batch()
    first, last = decode_window([f.timings for f in finals], C)
    rounds = max((f.spec or {}).get("rounds", 0) or (new_tokens - 1) for f in finals)
    per_round = (sum((f.spec or {}).get("tokens_per_round") or 1.0 for f in finals) / C)
    decode_tokens = C * (new_tokens - 1)
    return dict(K=k, C=C, rounds=rounds if k else "-", tokens_per_round=per_round, round_s=float(np.median(gaps)),
                mean_round_s=(last - first) / rounds,
                decode_tok_s=decode_tokens / (last - first), per_request_tok_s=(new_tokens - 1) / (last - first))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="demo (the embedded model) or a random preset (27b, ...)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", nargs="+", default=["gpu"], choices=["gpu", "eager"],
                    help="greedy rounds as one GPU program (the default) and/or the eager round")
    ap.add_argument("--weights", default="bf16", help="bf16, fp8, fp8-block or nvfp4 (random presets)")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="reduced proposal head: drafts among token ids below N (0 = the whole vocabulary)")
    ap.add_argument("--log-level", default="WARNING",
                    help="the ranks' log level (DEBUG shows where a round's host time goes)")
    args = ap.parse_args(argv)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.model == "demo":
        from ranks.demo import default_model_dir
        from runtime.tokenizer import Tokenizer
        model_dir, random_weights = default_model_dir(), False
        tok = Tokenizer.from_dir(model_dir)
        prompts = [tok.encode(p) for p in PROMPTS]
    else:
        from ranks.random_checkpoint import config_only_dir
        (model_dir, cfg), random_weights = config_only_dir(args.model, args.layers), True
        rng = random.Random(0)
        prompts = [[rng.randrange(cfg["vocab_size"]) for _ in range(64)] for _ in range(8)]
    res = dict(model=args.model, weights=args.weights, draft_vocab=args.draft_vocab, tp=args.tp, device=args.device, dtype=dtype, date=time.strftime("%Y-%m-%d"), runs=[])
    base: dict[int, float] = {}
    print(f"{'K':>2s} {'C':>3s} {'rounds':>6s} {'tok/round':>9s} {'round ms':>9s} {'tok/s':>8s} {'per req':>8s} {'round/step':>10s}")
    for C in args.concurrency:
        for k, mode in [(k, m) for k in args.draft_tokens for m in (args.rounds if k else ["-"])]:
            r = run(model_dir, prompts, args.tp, args.device, dtype, k, C, args.new_tokens, random_weights,
                    args.log_level, mode, args.weights, args.draft_vocab)
            if k == 0:
                base[C] = r["round_s"]
            r["round_over_step"] = r["round_s"] / base[C] if C in base else None
            res["runs"].append(r)
            ratio = f"{r['round_over_step']:10.2f}" if r["round_over_step"] else f"{'':>10s}"
            print(f"{k:2d} {C:3d} {mode:>6s} {r['tokens_per_round']:9.2f} {r['round_s'] * 1e3:9.2f} {r['decode_tok_s']:8.1f} "
                  f"{r['per_request_tok_s']:8.1f} {ratio}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
