#!/usr/bin/env python
"""Where the time of one step goes: CUDA kernel time per kernel name (torch.profiler / CUPTI) for a
decode step of C sequences, or a prefill step of C prompts, of a random full-width model on one GPU.

    python scripts/bench/profile_step.py --model 27b [--layers 16] [--concurrency 1] [--prefill 2048]
        [--spec-round K] [--out profile.json]

--prefill L profiles one step that prefills C (--concurrency) prompts of L tokens together (the
scheduler's step when prompts arrive at once). Every profile also reports the step's wall time
(eager, back to back, synchronised at the end) and the host time to issue one step (from an idle GPU)
beside its kernel time: a step whose issue time exceeds its kernel time is host-bound;
--cprofile N then prints the N functions with the most cumulative host time over the timed steps.

--spec-round K profiles a greedy speculation round on the GPU (ranks/spec_cuda.py: verification of
K+1 columns, acceptance, commit, K MTP drafting steps) instead of the decode step, and also times
the round and the plain decode step as replayed CUDA graphs (wall time per call, host included).

Prints the kernels sorted by total time with their share of the step and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)

import torch  # noqa: E402

from ranks.kvcache import ModelState  # noqa: E402
from ranks.model import Batch  # noqa: E402
from ranks.random_checkpoint import random_shard, spec_for  # noqa: E402
from runtime.config import PAGE_SIZE  # noqa: E402


def profile(fn, reps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for e in p.events():
        if e.device_type.name == "CUDA":
            times[e.name[:90]] += e.device_time / reps / 1e3        # ms per step
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="27b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=0, help="profile one prefill chunk of this many tokens instead")
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--spec-round", type=int, default=0, metavar="K",
                    help="profile a GPU speculation round with K drafts per sequence instead")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also print the N functions with the most cumulative and the most own host time "
                         "(cProfile) of the steps; with --out the profile is saved beside it (OUT.prof)")
    ap.add_argument("--shard-of", type=int, default=1, metavar="N",
                    help="rank 0's shard of a tp N split alone, its all-reduces left out (decode.py --shard-of)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from ranks.model_cuda import CudaHybridModel
    from decode import check_shard_of
    spec = spec_for(args.model, num_layers=args.layers)
    tp = check_shard_of(spec, args.shard_of)
    if tp > 1 and args.spec_round:
        raise SystemExit("--shard-of with --spec-round: the speculation round needs the whole model's head")
    model = CudaHybridModel(spec, random_shard(spec, 0, tp, device="cuda"), tp=tp, weight_format=args.weights,
                            cuda_graphs=False)
    C = args.concurrency
    if args.prefill:
        L = args.prefill
        pages = (L + PAGE_SIZE - 1) // PAGE_SIZE + 1
        state = ModelState(spec, C, C * pages, torch.bfloat16, "cuda", tp=tp)
        ids = torch.randint(0, spec.vocab_size, (C * L,))
        batch = Batch(ids, [L] * C, [0] * C, list(range(C)), torch.arange(C * pages, dtype=torch.int32).view(C, pages))
        what = f"prefill of {C} prompt(s) of {L} tokens" if C > 1 else f"prefill chunk of {L} tokens"
    else:
        per = (args.context + 2 + PAGE_SIZE - 1) // PAGE_SIZE
        state = ModelState(spec, C, C * per, torch.bfloat16, "cuda", tp=tp)
        batch = Batch(torch.randint(0, spec.vocab_size, (C,)), [1] * C, [args.context] * C, list(range(C)),
                      torch.arange(C * per, dtype=torch.int32).view(C, per))
        what = f"decode step, C={C}, context {args.context}" + (f", rank 0 of a tp {tp} split" if tp > 1 else "")
    if args.spec_round:
        batch, state, what, fn = spec_round(model, spec, args.spec_round, C, args.context)
    else:
        fn = lambda: model.forward(batch, state)          # noqa: E731
    times = profile(fn, args.reps)
    total = sum(times.values())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.reps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.reps * 1e3
    issue = []                            # host time to issue one step, from an idle GPU (no overlap)
    for _ in range(args.reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        issue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    issue_ms = sorted(issue)[len(issue) // 2]
    print(f"{args.model} ({spec.num_layers} layers, {args.weights}), {what}: {total:.3f} ms of kernel time per step, "
          f"{wall:.3f} ms wall back to back, {issue_ms:.3f} ms to issue one step on the host (median)")
    if args.cprofile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.reps):
            fn()
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(args.cprofile)
        pstats.Stats(pr).sort_stats("tottime").print_stats(args.cprofile)
        if args.out:
            pr.dump_stats(args.out + ".prof")           # for pstats elsewhere
    for name, t in list(times.items())[:args.top]:
        print(f"{t:9.3f} ms {t / total:6.1%}  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, layers=spec.num_layers, what=what, total_ms=total, wall_ms=wall, issue_ms=issue_ms,
                           kernels=times), f,
                      indent=1)
    return 0


def spec_round(model, spec, K: int, C: int, context: int):
    """A GPU speculation round of C sequences at `context` tokens: its profile target, after timing
    the round and a plain step, each replayed as a CUDA graph (model.graphs of a second model view)."""
    from ranks.graphs import GraphRunner
    from ranks.spec_cuda import GpuRounds
    T = K + 1
    per = (context + 2 * K + PAGE_SIZE - 1) // PAGE_SIZE
    state = model.new_state(C, C * per)
    model.reserve_verification(C * T)
    rounds = GpuRounds(model, K, rank=0, tp=1)
    tables = torch.arange(C * per, dtype=torch.int32).view(C, per)
    batch = Batch(torch.randint(0, spec.vocab_size, (C * T,)), [T] * C, [context] * C, list(range(C)), tables)
    step = Batch(torch.randint(0, spec.vocab_size, (C,)), [1] * C, [context] * C, list(range(C)), tables)
    model.graphs = GraphRunner(model)

    def wall(fn, reps=20) -> float:
        for _ in range(3):                               # eager, capture, replay
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps * 1e3
    step_ms = wall(lambda: model.forward(step, state).logits.argmax(-1).cpu())
    round_ms = wall(lambda: rounds.run(batch, state, [[]] * C))
    print(f"graphs: plain step {step_ms:.3f} ms (with its argmax copied to the host), GPU round K={K} "
          f"{round_ms:.3f} ms = {round_ms / step_ms:.2f}x")
    model.graphs = None
    return batch, state, f"GPU speculation round K={K}, C={C}, context {context}", \
        lambda: rounds.run(batch, state, [[]] * C)


if __name__ == "__main__":
    sys.exit(main())
