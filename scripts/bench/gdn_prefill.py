#!/usr/bin/env python
"""The gated delta rule over one prefill chunk on one GPU: the recurrent kernel (one column at a time)
against the chunked kernels (kernels/cuda_gdn.py, max_columns >= CHUNKED_MIN_COLUMNS), per column
count, at the 27B shape (HK 16, HV 48, DK = DV = 128) and its tp 2 half; where the chunked form starts
to win sets CHUNKED_MIN_COLUMNS.

    python scripts/bench/gdn_prefill.py [--columns 16 32 64 128 256 2048 8192] [--out gdn.json]

Times are medians of CUDA-event-timed calls (state reset between calls is not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)

import torch  # noqa: E402

SHAPES = {"27b": (16, 48, 128, 128), "27b-tp2": (8, 24, 128, 128)}


def time_rule(cg, args, max_columns, reps: int) -> float:
    ts = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        cg.gated_delta_rule(*args, max_columns=max_columns)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--columns", type=int, nargs="+", default=[16, 32, 64, 128, 256, 2048, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kernels import cuda_gdn as cg
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'shape':8s} {'columns':>7s} {'recurrent ms':>12s} {'chunked ms':>10s} {'speedup':>7s}")
    for name, (HK, HV, DK, DV) in SHAPES.items():
        for T in args.columns:
            C = 2 * HK * DK + HV * DV
            y = torch.randn(T, C, generator=g, device="cuda").bfloat16()
            a = torch.randn(T, HV, generator=g, device="cuda").bfloat16()
            b = torch.randn(T, HV, generator=g, device="cuda").bfloat16()
            A_log = torch.rand(HV, generator=g, device="cuda") * 2
            dt_bias = torch.randn(HV, generator=g, device="cuda")
            state = torch.randn(1, HV, DK, DV, generator=g, device="cuda") * 0.1
            meta = torch.tensor([0, T, 0, 0], dtype=torch.int32, device="cuda")
            call = (y, a, b, A_log, dt_bias, state, meta[2:3], meta[:2], meta[3:4], HK, HV, DK, DV)
            rec = time_rule(cg, call, None, args.reps)
            chk = time_rule(cg, call, max(T, cg.CHUNKED_MIN_COLUMNS), args.reps)
            rows.append(dict(shape=name, columns=T, recurrent_ms=rec, chunked_ms=chk, speedup=rec / chk))
            print(f"{name:8s} {T:7d} {rec:12.3f} {chk:10.3f} {rec / chk:7.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
