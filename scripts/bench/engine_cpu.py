#!/usr/bin/env python
"""CPU throughput of the whole runtime (coordinator + rank processes + mailbox), not a test.

    python scripts/bench/engine_cpu.py --out bench.json [--tp 1 2] [--concurrency 1 8]

For each tensor-parallel degree it starts one Engine on a random 'small' checkpoint (hidden 256,
8 layers, vocab 8192; float32) and measures, for each concurrency c:

* prefill tok/s: c requests of --prompt-len tokens, one generated token each, submitted together;
  prompt tokens of all requests / wall time from submit to the last completion.
* decode tok/s: c requests of --decode-prompt-len tokens and --new-tokens new tokens (greedy,
  ignore_eos), submitted together; tokens after each request's first one / wall time from the first
  first-token to the last completion (the short prompts' prefill excluded); also per-request decode
  tok/s (a request's tokens after its first / its time from first token to end).

Prints a table and writes everything (configuration, machine, results) as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)
sys.path.insert(0, os.path.join(repo_root, "scripts", "bench"))

from decode import decode_window  # noqa: E402
from runtime import Engine, EngineOptions, SamplingParams  # noqa: E402


def small_checkpoint(out_dir: str, seed: int) -> str:
    """The 'small' preset through ranks.random_checkpoint when available, else an equivalent config
    built here with tests.util-style random weights."""
    try:
        from ranks.random_checkpoint import write_random_checkpoint
        write_random_checkpoint(out_dir, "small", seed=seed, dtype="float32", layout="official", progress=False)
        return "ranks.random_checkpoint PRESETS['small']"
    except ImportError:
        pass
    import torch
    from ranks.weights import write_checkpoint
    from runtime.config import spec_from_hf
    from tests.util import ROPE, random_weights, tiny_config

    cfg = tiny_config(False, vocab_size=8192, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                      linear_value_head_dim=64, intermediate_size=1024, max_position_embeddings=8192,
                      rope_parameters=dict(ROPE, mrope_section=[3, 3, 2]))
    spec = spec_from_hf(cfg)
    write_checkpoint(out_dir, random_weights(spec, seed, dtype=torch.float32), prefix="model.")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return "tests.util-style config (hidden 256, 8 layers, vocab 8192)"


def run_batch(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Submit all prompts at once; per request: submit, first-token and end times, tokens."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    records = [dict() for _ in prompts]

    def consume(i: int, stream) -> None:
        n = 0
        for ev in stream:
            now = time.perf_counter()
            if ev.tokens and "first" not in records[i]:
                records[i]["first"] = now
            n += len(ev.tokens)
            if ev.final:
                if ev.error:
                    raise RuntimeError(f"request failed: {ev.error}")
                records[i].update(end=now, tokens=n)

    t0 = time.perf_counter()
    streams = [engine.submit(p, params) for p in prompts]
    threads = [threading.Thread(target=consume, args=(i, s)) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in records:
        if "end" not in r:
            raise RuntimeError("a request did not finish")
    return dict(t0=t0, records=records)


def measure(engine: Engine, concurrency: int, args, rng: random.Random, vocab: int) -> dict:
    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    steps0 = engine.stats()["steps"]
    pre = run_batch(engine, [prompt(args.prompt_len) for _ in range(concurrency)], 1)
    pre_wall = max(r["end"] for r in pre["records"]) - pre["t0"]
    steps1 = engine.stats()["steps"]
    dec = run_batch(engine, [prompt(args.decode_prompt_len) for _ in range(concurrency)], args.new_tokens)
    steps2 = engine.stats()["steps"]
    recs = dec["records"]
    decode_window([dict(ttft_s=r["first"] - dec["t0"], total_s=r["end"] - dec["t0"]) for r in recs], concurrency)
    # the short prompts prefill together in the first step(s); decode is everything after the first token
    start = min(r["first"] for r in recs)
    end = max(r["end"] for r in recs)
    after = sum(r["tokens"] - 1 for r in recs)
    per_request = [(r["tokens"] - 1) / (r["end"] - r["first"]) for r in recs if r["tokens"] > 1]
    return dict(
        concurrency=concurrency,
        prefill_tokens=concurrency * args.prompt_len,
        prefill_wall_s=pre_wall,
        prefill_tok_s=concurrency * args.prompt_len / pre_wall,
        prefill_steps=steps1 - steps0,
        decode_tokens=after,
        decode_wall_s=end - start,
        decode_tok_s=after / (end - start) if end > start else float("nan"),
        decode_tok_s_per_request=statistics.mean(per_request) if per_request else float("nan"),
        decode_steps=steps2 - steps1,
        ttft_s_mean=statistics.mean(r["first"] - dec["t0"] for r in recs),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="write the results as JSON here")
    ap.add_argument("--model-dir", help="an existing checkpoint (default: a random 'small' one in a temp dir)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (prefill)")
    ap.add_argument("--decode-prompt-len", type=int, default=16, help="prompt tokens per request (decode)")
    ap.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request (decode)")
    ap.add_argument("--threads-per-rank", type=int, default=1,
                    help="torch threads per rank process; 0 = the engine's default (cores // tp). Default 1: "
                         "on small VMs several intra-op threads per rank can be many times slower than one")
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--max-step-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-overlap-steps", dest="overlap_steps", action="store_false",
                    help="plan each step after the previous one's result (EngineOptions.overlap_steps=False)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        model_dir, source = args.model_dir, "given"
        if model_dir is None:
            model_dir = os.path.join(tmp, "small")
            t = time.perf_counter()
            source = small_checkpoint(model_dir, args.seed)
            print(f"wrote a random checkpoint ({source}) in {time.perf_counter() - t:.1f} s", flush=True)
        rows = []
        for tp in args.tp:
            opts = EngineOptions(max_concurrency=max(args.concurrency), prefill_chunk=args.prefill_chunk,
                                 max_step_tokens=max(args.max_step_tokens, max(args.concurrency)),
                                 max_context=max(args.prompt_len, args.decode_prompt_len + args.new_tokens) + 1,
                                 threads_per_rank=args.threads_per_rank or None, overlap_steps=args.overlap_steps)
            t = time.perf_counter()
            with Engine.start(model_dir, tp=tp, options=opts) as engine:
                start_s = time.perf_counter() - t
                vocab = engine.spec.vocab_size
                rng = random.Random(args.seed + tp)
                run_batch(engine, [[1, 2, 3]], 4)                             # warm-up
                for c in args.concurrency:
                    r = measure(engine, c, args, rng, vocab)
                    r.update(tp=tp, engine_start_s=start_s)
                    rows.append(r)
                    print(f"tp {tp} concurrency {c}: prefill {r['prefill_tok_s']:.0f} tok/s, "
                          f"decode {r['decode_tok_s']:.1f} tok/s", flush=True)

    header = f"{'tp':>3} {'conc':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'per-req dec':>12} " \
             f"{'dec steps':>10} {'ttft s':>8}"
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['tp']:>3} {r['concurrency']:>5} {r['prefill_tok_s']:>14.0f} {r['decode_tok_s']:>13.1f} "
              f"{r['decode_tok_s_per_request']:>12.1f} {r['decode_steps']:>10} {r['ttft_s_mean']:>8.3f}")
    result = dict(
        benchmark="engine_cpu", model=source if args.model_dir is None else args.model_dir,
        config=dict(vars(args)), machine=dict(cpu_count=os.cpu_count(), platform=platform.platform(),
                                                python=platform.python_version()),
        results=rows,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
