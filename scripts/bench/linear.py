#!/usr/bin/env python
"""Decode linear layers: tandem's GEMV kernels vs cuBLAS (torch.matmul on bf16 weights), per shape,
column count T and weight format, against the bytes each must read at the bandwidth of this GPU.

    python scripts/bench/linear.py --out linear.json [--model 27b] [--columns 1 2 4 8 16]

For every (O, I) of the model's decode linear layers it times kernels.cuda_linear.linear (CUDA
graphs of 20 calls, median of 10 replays) and torch.matmul for bf16, and reports the fraction of
the bandwidth floor reached. This is what the route table (GEMV up to which T) is chosen from.
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

SHAPES = {
    "27b": [("q_proj", 12288, 5120), ("kv_proj", 1024, 5120), ("o_proj", 5120, 6144), ("in_proj_qkv", 10240, 5120),
            ("in_proj_z", 6144, 5120), ("gate_up", 34816, 5120), ("down", 5120, 17408), ("lm_head", 248320, 5120)],
    "35b-a3b": [("q_proj", 8192, 2048), ("o_proj", 2048, 4096), ("in_proj_qkv", 8192, 2048),
                ("shared_gate_up", 1024, 2048), ("lm_head", 248320, 2048)],
}


def graph_time(fn, calls: int = 20, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / calls)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="27b", choices=list(SHAPES))
    ap.add_argument("--columns", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--kinds", nargs="+", default=["bf16", "fp8_row", "nvfp4"])
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: measured by decode.py's probe)")
    ap.add_argument("--ks", type=int, nargs="*", default=[],
                    help="also time the GEMV with every launch's I-split forced to each of these (1, 2, 4, 8)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kernels import cuda_linear as cl
    from kernels.quant import quantize_fp8_rows, quantize_nvfp4
    sys.path.insert(0, os.path.join(repo_root, "scripts", "bench"))
    from decode import measure_bandwidth
    bw = args.bandwidth or measure_bandwidth()["read_Bps"]
    print(f"read bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for name, O, I in SHAPES[args.model]:
        w = (torch.randn(O, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
        weights = {"bf16": w}
        if "fp8_row" in args.kinds:
            weights["fp8_row"] = quantize_fp8_rows(w)
        if "nvfp4" in args.kinds:
            weights["nvfp4"] = quantize_nvfp4(w)
        for T in args.columns:
            x = torch.randn(T, I, device="cuda").to(torch.bfloat16)
            out = torch.empty(T, O, dtype=torch.bfloat16, device="cuda")
            for kind in args.kinds:
                wk = weights[kind]
                floor = cl.bytes_read(O, I, T, kind) / bw
                # untimed first: the clocks ramp up after the host-side weight setup (without this the
                # first variant timed per shape read up to 13 points low)
                graph_time(lambda: cl._gemv(x, wk, out, None, swiglu=False), reps=3)
                for ks in [None] + args.ks:
                    cl.FORCE_KS = ks
                    t = graph_time(lambda: cl._gemv(x, wk, out, None, swiglu=False))
                    impl = "gemv" if ks is None else f"gemv_ks{ks}"
                    rows.append(dict(layer=name, O=O, I=I, T=T, kind=kind, impl=impl, s=t, of_floor=floor / t))
                cl.FORCE_KS = None
            t = graph_time(lambda: torch.matmul(x, w.t(), out=out))
            floor = cl.bytes_read(O, I, T, "bf16") / bw
            rows.append(dict(layer=name, O=O, I=I, T=T, kind="bf16", impl="cublas", s=t, of_floor=floor / t))
        weights = w = None
        torch.cuda.empty_cache()
    print(f"{'layer':12s} {'T':>3s} " + " ".join(f"{k + '/' + i:>14s}" for k in args.kinds for i in ("gemv",))
          + f" {'bf16/cublas':>14s}   (us, % of floor)")
    for name, O, I in SHAPES[args.model]:
        for T in args.columns:
            cells = []
            for kind, impl in [(k, "gemv") for k in args.kinds] + [("bf16", "cublas")]:
                r = next(r for r in rows if r["layer"] == name and r["T"] == T and r["kind"] == kind and r["impl"] == impl)
                cells.append(f"{r['s'] * 1e6:7.1f} {r['of_floor']:5.0%}")
            print(f"{name:12s} {T:3d} " + " ".join(f"{c:>14s}" for c in cells))
    if args.ks:
        print("GEMV with the I-split forced (% of floor; 'route' = the route table's choice)")
        print(f"{'layer':12s} {'T':>3s} {'kind':>8s} {'route':>6s} "
              + " ".join(f"{'ks' + str(k):>6s}" for k in args.ks))
        for name, O, I in SHAPES[args.model]:
            for T in args.columns:
                for kind in args.kinds:
                    got = {r["impl"]: r["of_floor"] for r in rows if r["layer"] == name and r["T"] == T
                           and r["kind"] == kind and r["impl"].startswith("gemv")}
                    print(f"{name:12s} {T:3d} {kind:>8s} {got['gemv']:6.0%} "
                          + " ".join(f"{got['gemv_ks' + str(k)]:6.0%}" for k in args.ks))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(bandwidth=bw, rows=rows, device=torch.cuda.get_device_name()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
