#!/usr/bin/env python
"""Decode step time through the whole engine (coordinator, rank processes, transport): tp 1 against
tp 2 with each GPU transport, on a random full-size model (weights built on the GPUs), against the
bandwidth floor of the slowest rank.

    python scripts/bench/decode_tp.py --model 27b --weights bf16 nvfp4 --tp 1 2 \
        --transport mailbox copies nccl --concurrency 1 4 8 16 --out decode_tp.json

For each weight format and configuration: C requests of --prompt-len random tokens, --new-tokens
greedy tokens each (ignore_eos), submitted together; the decode step time is (last finish - last
first token) / (new tokens - 1), on one clock (each request's times plus its submission's offset; the
JSON keeps them per request), from the second of two runs (the first captures that C's CUDA
graphs). The floor per rank: the bytes a decode step reads on that rank (its weight shard, the
chosen experts' share, its KV heads and GDN state at the mean context of the decode, as the rank
counts them: ranks/model_cuda.py step_byte_parts) over the read bandwidth measured on GPU 0 before
the engines start (decode.py's probe; the GPUs are taken to be alike); a step is held to the
slowest rank's. Prints a table with the ratio to tp 1 and the fraction of the floor, each row followed
by the requests' first-token times (ms after the first submission: prompts submitted together, so
the spread shows how the scheduler and the prefill steps served them), and writes JSON.
--share adds a tp 2 run whose all-reduces are skipped (TANDEM_BENCH_SKIP_ALLREDUCE=1; outputs are
wrong, only its time counts): 1 - that step / the mailbox step is the all-reduce share of a tp 2 step.
Each row also splits the step's wall time on the host (the engine's stats()["step_time"], averaged
over all steps of the timed run, prefill included): rank 0 inside its step (inputs, forward, sampling),
the messaging around it (wait - rank 0's step: negative when steps are planned ahead, as rank 0 then
starts a step before the coordinator waits for it), and the coordinator's own work; and the share of steps planned ahead
(EngineOptions.overlap_steps; --no-overlap-steps plans each step after the previous one's result).
--device-feed also runs every configuration with EngineOptions.device_feed (the greedy tokens chosen
on the GPU feed the next step, launched before they reach the host), as rows "<transport>+feed",
each held to the tp 1 run of the same setting; the share of fed steps is printed with them. The
plain rows run with it off (the engine's default turns it on at tp 1).
--logprobs K makes every request ask for its tokens' logprobs with K alternatives: the step then
exchanges and merges them (ranks/sampler.py token_logprobs) and is neither device-fed nor a GPU
speculation round; compare with a run without it for their cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)

from ranks.random_checkpoint import config_only_dir  # noqa: E402
from runtime import Engine, EngineOptions, SamplingParams  # noqa: E402


def run(model_dir: str, vocab: int, tp: int, transport: str, weights: str, concurrency: list[int],
        prompt_len: int, new_tokens: int, overlap_steps: bool = True, device_feed: bool = False,
        logprobs: int | None = None) -> tuple[dict, dict]:
    """({C: step_s, wall_s, host}, {rank: its step_bytes parts (Ready)})."""
    from decode import decode_window
    opts = EngineOptions(max_concurrency=max(concurrency), random_weights=True, weights=weights,
                         transport=transport, max_context=prompt_len + new_tokens + 8, startup_timeout_s=900,
                         overlap_steps=overlap_steps, device_feed=device_feed)
    out = {}
    with Engine.start(model_dir, tp=tp, device="cuda", dtype="bfloat16", options=opts) as engine:
        step_bytes = {r: info.get("step_bytes") for r, info in engine.stats().get("ranks", {}).items()}
        # every C runs twice and the second run is timed: the first captures the CUDA graphs of the C
        # bucket, which otherwise lands inside the timed window (docs/perf.md, eighth session: C=8
        # rows at twice the one-GPU step)
        for C in [c for c in concurrency for _ in range(2)]:
            results = [None] * C

            def one(i):
                prompt = [random.randrange(vocab) for _ in range(prompt_len)]
                sub = time.perf_counter() - t0
                evs = list(engine.submit(prompt, SamplingParams(temperature=0, max_new_tokens=new_tokens,
                                                                ignore_eos=True, logprobs=logprobs)))
                if evs[-1].error:
                    raise RuntimeError(evs[-1].error)
                results[i] = dict(evs[-1].timings, submitted_s=sub)
            st0 = dict(engine.stats()["step_time"], ahead=engine.stats()["steps_ahead"], fed=engine.stats()["steps_fed"])
            t0 = time.perf_counter()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(C)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            first, last = decode_window(results, C)
            st1 = dict(engine.stats()["step_time"], ahead=engine.stats()["steps_ahead"], fed=engine.stats()["steps_fed"])
            n = max(st1["steps"] - st0["steps"], 1)
            host = {k: (st1[k] - st0[k]) / n for k in ("coordinator_s", "wait_s", "rank_s", "ahead", "fed")}
            out[C] = dict(step_s=(last - first) / (new_tokens - 1), wall_s=wall, host=host,
                          requests=[{k: t.get(k) for k in ("submitted_s", "ttft_s", "total_s")} for t in results])
    return out, step_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="27b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--weights", nargs="+", default=["bf16"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--transport", nargs="+", default=["mailbox", "copies", "nccl"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--share", action="store_true", help="also time tp 2 with the all-reduces skipped")
    ap.add_argument("--no-overlap-steps", dest="overlap_steps", action="store_false",
                    help="plan each step after the previous one's result (EngineOptions.overlap_steps=False)")
    ap.add_argument("--device-feed", action="store_true",
                    help="also run each configuration with EngineOptions.device_feed (rows <transport>+feed)")
    ap.add_argument("--logprobs", type=int, default=None, metavar="K",
                    help="every request asks for logprobs with K alternatives (what they cost per step)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    d, cfg = config_only_dir(args.model, args.layers)
    import torch
    from ranks.model_cuda import step_bytes_from
    sys.path.insert(0, os.path.join(repo_root, "scripts", "bench"))
    from decode import measure_bandwidth
    bw = measure_bandwidth()["read_Bps"]
    torch.cuda.empty_cache()
    context = args.prompt_len + args.new_tokens // 2              # the mean context of the timed steps
    res = dict(model=args.model, layers=args.layers, weights=args.weights, date=time.strftime("%Y-%m-%d"),
               overlap_steps=args.overlap_steps, device_feed=args.device_feed, logprobs=args.logprobs,
               device=torch.cuda.get_device_name(0), read_Bps=bw, context=context, runs=[])
    print(f"{torch.cuda.get_device_name(0)}: read bandwidth {bw / 1e12:.2f} TB/s (GPU 0)", flush=True)
    for weights in args.weights:
        base = {}
        for tp in args.tp:
            plain = args.transport + (["skip"] if args.share else []) if tp > 1 else ["none"]
            fed = [t + "+feed" for t in plain if t != "skip"] if args.device_feed else []
            for transport in plain + fed:
                kind = transport.removesuffix("+feed")
                try:
                    if transport == "skip":
                        os.environ["TANDEM_BENCH_SKIP_ALLREDUCE"] = "1"
                    r, parts = run(d, cfg["vocab_size"], tp, {"none": "cpu", "skip": "mailbox"}.get(kind, kind),
                                   weights, args.concurrency, args.prompt_len, args.new_tokens, args.overlap_steps,
                                   device_feed=transport.endswith("+feed"), logprobs=args.logprobs)
                except Exception as e:                     # report and go on with the other configurations
                    print(f"{weights} tp {tp} {transport}: failed: {e}", flush=True)
                    res["runs"].append(dict(weights=weights, tp=tp, transport=transport, error=str(e)))
                    continue
                finally:
                    os.environ.pop("TANDEM_BENCH_SKIP_ALLREDUCE", None)
                for C in args.concurrency:
                    step = r[C]["step_s"]
                    feed = transport.endswith("+feed")
                    if tp == 1:
                        base[C, feed] = step
                    ratio = step / base[C, feed] if (C, feed) in base else float("nan")
                    floors = {rank: step_bytes_from(p, C, context)["total"] / bw
                              for rank, p in parts.items() if p}
                    floor = max(floors.values()) if floors else float("nan")
                    host = r[C]["host"]
                    res["runs"].append(dict(weights=weights, tp=tp, transport=transport, C=C, step_s=step,
                                            ratio_to_tp1=ratio, floor_s=floor, of_floor=floor / step,
                                            rank_floor_s=floors, host_per_step_s=host, requests=r[C]["requests"]))
                    print(f"{weights:6s} tp {tp} {transport:13s} C={C:3d}: step {step * 1e3:7.2f} ms  "
                          f"{C / step:8.1f} tok/s  {ratio:5.2f}x the tp 1 step  floor {floor * 1e3:6.2f} ms  "
                          f"{floor / step:6.1%} of floor  | per step: rank 0 in its step "
                          f"{host['rank_s'] * 1e3:.2f} ms, messaging "
                          f"{(host['wait_s'] - host['rank_s']) * 1e3:.2f}, coordinator "
                          f"{host['coordinator_s'] * 1e3:.2f}; planned ahead {host['ahead']:.0%}, fed {host['fed']:.0%}", flush=True)
                    firsts = sorted((q["submitted_s"] + q["ttft_s"]) * 1e3 for q in r[C]["requests"])
                    print(f"{'':33s}first tokens, ms after the first submission: " + " ".join(f"{t:.0f}" for t in firsts),
                          flush=True)
        for C in args.concurrency:
            steps = {x["transport"]: x["step_s"] for x in res["runs"]
                     if x.get("C") == C and x["tp"] == 2 and x["weights"] == weights}
            if "skip" in steps and "mailbox" in steps:
                share = 1 - steps["skip"] / steps["mailbox"]
                res.setdefault("allreduce_share", {}).setdefault(weights, {})[C] = share
                print(f"{weights} C={C}: all-reduce share of a tp 2 mailbox step {share:.1%} "
                      f"({steps['mailbox'] * 1e3:.2f} ms with, {steps['skip'] * 1e3:.2f} ms without)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
