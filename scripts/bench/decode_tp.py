#!/usr/bin/env python
"""Decode step time through the whole engine (coordinator, rank processes, transport): tp 1 against
tp 2 with each GPU transport, on a random full-size model (weights built on the GPUs).

    python scripts/bench/decode_tp.py --model 27b --weights bf16 --tp 1 2 --transport mailbox copies nccl \
        --concurrency 1 8 --out decode_tp.json

For each configuration: C requests of --prompt-len random tokens, --new-tokens greedy tokens each
(ignore_eos), submitted together; the decode step time is (last finish - last first token) /
(new tokens - 1), from the second of two runs (the first captures that C's CUDA graphs). Prints a table with the ratio to tp 1 and writes JSON. --share adds a tp 2 run
whose all-reduces are skipped (TANDEM_BENCH_SKIP_ALLREDUCE=1; outputs are wrong, only its time
counts): 1 - that step / the mailbox step is the all-reduce share of a tp 2 step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)

from ranks.random_checkpoint import _wrapper_config, text_config  # noqa: E402
from runtime import Engine, EngineOptions, SamplingParams  # noqa: E402


def run(model_dir: str, vocab: int, tp: int, transport: str, weights: str, concurrency: list[int],
        prompt_len: int, new_tokens: int) -> dict:
    opts = EngineOptions(max_concurrency=max(concurrency), random_weights=True, weights=weights,
                         transport=transport, max_context=prompt_len + new_tokens + 8, startup_timeout_s=900)
    out = {}
    with Engine.start(model_dir, tp=tp, device="cuda", dtype="bfloat16", options=opts) as engine:
        # every C runs twice and the second run is timed: the first captures the CUDA graphs of the C
        # bucket, which otherwise lands inside the timed window (docs/perf.md, eighth session: C=8
        # rows at twice the one-GPU step)
        for C in [c for c in concurrency for _ in range(2)]:
            results = [None] * C

            def one(i):
                prompt = [random.randrange(vocab) for _ in range(prompt_len)]
                evs = list(engine.submit(prompt, SamplingParams(temperature=0, max_new_tokens=new_tokens,
                                                                ignore_eos=True)))
                if evs[-1].error:
                    raise RuntimeError(evs[-1].error)
                results[i] = evs[-1].timings
            t0 = time.perf_counter()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(C)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            first = max(r["ttft_s"] for r in results)
            last = max(r["total_s"] for r in results)
            out[C] = dict(step_s=(last - first) / (new_tokens - 1), wall_s=wall)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="27b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--transport", nargs="+", default=["mailbox", "copies", "nccl"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--share", action="store_true", help="also time tp 2 with the all-reduces skipped")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = text_config(args.model, num_layers=args.layers)
    d = tempfile.mkdtemp(prefix="tandem-bench-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(_wrapper_config(cfg, "num_experts" in cfg), f)
    res = dict(model=args.model, layers=args.layers, weights=args.weights, date=time.strftime("%Y-%m-%d"), runs=[])
    base = {}
    for tp in args.tp:
        for transport in (args.transport + (["skip"] if args.share else []) if tp > 1 else ["none"]):
            try:
                if transport == "skip":
                    os.environ["TANDEM_BENCH_SKIP_ALLREDUCE"] = "1"
                r = run(d, cfg["vocab_size"], tp, {"none": "cpu", "skip": "mailbox"}.get(transport, transport),
                        args.weights, args.concurrency, args.prompt_len, args.new_tokens)
            except Exception as e:                     # report and go on with the other configurations
                print(f"tp {tp} {transport}: failed: {e}", flush=True)
                res["runs"].append(dict(tp=tp, transport=transport, error=str(e)))
                continue
            finally:
                os.environ.pop("TANDEM_BENCH_SKIP_ALLREDUCE", None)
            for C in args.concurrency:
                step = r[C]["step_s"]
                if tp == 1:
                    base[C] = step
                ratio = step / base[C] if C in base else float("nan")
                res["runs"].append(dict(tp=tp, transport=transport, C=C, step_s=step, ratio_to_tp1=ratio))
                print(f"tp {tp} {transport:8s} C={C:3d}: step {step * 1e3:7.2f} ms  {C / step:8.1f} tok/s  "
                      f"{ratio:5.2f}x the tp 1 step", flush=True)
    for C in args.concurrency:
        steps = {r["transport"]: r["step_s"] for r in res["runs"] if r.get("C") == C and r["tp"] == 2}
        if "skip" in steps and "mailbox" in steps:
            share = 1 - steps["skip"] / steps["mailbox"]
            res.setdefault("allreduce_share", {})[C] = share
            print(f"C={C}: all-reduce share of a tp 2 mailbox step {share:.1%} "
                  f"({steps['mailbox'] * 1e3:.2f} ms with, {steps['skip'] * 1e3:.2f} ms without)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
