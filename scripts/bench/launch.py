#!/usr/bin/env python
"""Host time per kernel launch: kernels/launch.py's routes side by side, eagerly, on one GPU.

    python scripts/bench/launch.py [--launches 20000] [--out launch.json]

Launches an empty kernel (kernels/cuda/bench.cu floor_empty) and a decode GEMV of the 27B's a|b shape
(19 arguments, the widest signature the model launches; a few microseconds of GPU time) back to back,
through cuLaunchKernelEx with pack_args (TANDEM_DIRECT_LAUNCH=1, the default) and through CuPy's
kernel call (=0), alternated three times; prints microseconds per launch (host-bound: the GPU
finishes each kernel faster than the host issues the next) and each route's median, and writes JSON.
An eager prefill step issues ~800 launches on the 27B.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)

import torch  # noqa: E402


def per_launch(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kernels import cuda_linear as cl
    from kernels import launch as L
    d = torch.cuda.current_device()
    empty = L.kernel("bench", "floor_empty", d)
    w = torch.randn(96, 5120, device="cuda").to(torch.bfloat16)
    x = torch.randn(1, 5120, device="cuda").to(torch.bfloat16)
    out = torch.empty(1, 96, dtype=torch.bfloat16, device="cuda")
    cases = {"empty kernel": lambda: L.launch(empty, (1,), (32,), (), device=d),
             "GEMV a|b, T=1 (linear())": lambda: cl.linear(x, w, out=out)}
    rows = []
    for rep in range(3):
        for direct in (True, False):
            os.environ["TANDEM_DIRECT_LAUNCH"] = "1" if direct else "0"
            L.pdl_reset()
            for name, fn in cases.items():
                rows.append(dict(case=name, direct=direct, rep=rep, s=per_launch(fn, args.launches)))
    os.environ.pop("TANDEM_DIRECT_LAUNCH", None)
    L.pdl_reset()
    print(f"{torch.cuda.get_device_name()}: host time per call, us (three alternated runs; median)")
    for name in cases:
        for direct in (True, False):
            ts = [r["s"] * 1e6 for r in rows if r["case"] == name and r["direct"] == direct]
            label = "cuLaunchKernelEx" if direct else "CuPy call"
            print(f"  {name:28s} {label:17s} " + " ".join(f"{t:6.2f}" for t in ts) + f"   median {statistics.median(ts):6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), launches=args.launches, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
