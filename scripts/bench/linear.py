#!/usr/bin/env python
"""Decode linear layers: tandem's GEMV kernels vs cuBLAS (torch.matmul on bf16 weights), per shape,
column count T and weight format, against the bytes each must read at the bandwidth of this GPU.

    python scripts/bench/linear.py --out linear.json [--model 27b] [--columns 1 2 4 8 16]
    python scripts/bench/linear.py --variants --out variants.json [--model 27b] [--ks 1 2 4 8]
    python scripts/bench/linear.py --split --out split.json [--model 27b] [--columns 1 4 8]
    python scripts/bench/linear.py --dequant --out dequant.json [--model 27b] [--columns 449]
    python scripts/bench/linear.py --variants --shard-of 2 --kinds nvfp4 --out shard.json
    ncu --clock-control none --kernel-name regex:gemv_ python scripts/bench/linear.py --once --layers gate_up down

--layers keeps only the named layers (of SHAPES). --shard-of N takes each layer as rank 0's shard of a tp N
split (column-parallel layers O / N, o_proj and down I / N): a tp 2 rank's GEMVs, whose per-byte rate
fell to ~0.87x of the whole layers' in the nineteenth session's step profile (docs/perf.md).
--once runs every selected (layer, kind, T) GEMV once, eagerly and untimed, and prints the route each took: the launches a profiler such as Nsight Compute
should see (one per combination, nothing else named gemv_; scripts/gpu-session.sh ncu).

For every (O, I) of the model's decode linear layers it times kernels.cuda_linear's GEMV (CUDA graphs
of 20 calls, median of 10 replays) and torch.matmul for bf16, and reports the fraction of the
bandwidth floor reached. This is what the route table (GEMV up to which T) is chosen from. The bf16
GEMV is timed at every T asked for, also where the route table sends bf16 to cuBLAS.

--variants times the quantised GEMV under both GEMV variants (TANDEM_GEMV_VARIANT=tc, the tensor-core
route table, and =pipelined, the cp.async-pipelined kernels gemv_*_pipe for T <= 8) side by side at T = 1 2 4
8 (or --columns), with the bf16 GEMV and cuBLAS for reference, and prints GB/s and the fraction of the
read bandwidth measured in the same run (kernels/cuda/bench.cu read_probe); --ks also times every
variant with the I-split forced. The JSON rows carry the kernel and ks each variant's route chose.
The default variant, auto, takes per layer whichever of the two kernels kernels.cuda_linear.pipe_wins
names (the rule was read off this table).

--split times each fused projection group of the model (ranks/model_cuda.py FUSED_PROJECTIONS: q|k|v,
GDN qkv|z, a|b; a|b in bf16 only, as the model keeps it) as the model runs it, one linear_split launch
over the fused weight, against its parts as separate linears, both on the production routes.

--dequant times what a prefill chunk pays per quantised layer: the dequantisation kernel alone (bytes
read and written against the read bandwidth) and the whole prefill linear at each --columns (default
449: eight 56-token prompts and a decode column, dequantised slabs through cuBLAS) against cuBLAS on
the bf16 weight.
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
            ("in_proj_z", 6144, 5120), ("gate_up", 34816, 5120), ("down", 5120, 17408), ("lm_head", 248320, 5120), ("a_b", 96, 5120)],
    "35b-a3b": [("q_proj", 8192, 2048), ("o_proj", 2048, 4096), ("in_proj_qkv", 8192, 2048),
                ("shared_gate_up", 1024, 2048), ("lm_head", 248320, 2048), ("a_b", 64, 2048)],
}
QUANT_KINDS = ("fp8_row", "fp8_block", "nvfp4")
# Row-parallel layers (in_features split at tp N, an all-reduce after them); the others are column-parallel
# (out_features split): docs/architecture.md's tensor-parallel split. The GDN out_proj has o_proj's shape.
ROW_PARALLEL = frozenset({"o_proj", "down"})


def shard_shapes(shapes: list[tuple[str, int, int]], n: int) -> list[tuple[str, int, int]]:
    """Rank 0's (O, I) of each layer at tp n: column-parallel layers keep O / n rows, row-parallel ones
    I / n columns. ValueError naming the first layer whose split dimension n does not divide."""
    out = []
    for name, O, I in shapes:
        dim, size = ("in_features", I) if name in ROW_PARALLEL else ("out_features", O)
        if size % n:
            raise ValueError(f"{name}'s {dim} {size} is not a multiple of {n}")
        out.append((name, O, I // n) if name in ROW_PARALLEL else (name, O // n, I))
    return out


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


def make_weights(w: torch.Tensor, kinds) -> dict:
    from kernels.quant import quantize_fp8_blocks, quantize_fp8_rows, quantize_nvfp4
    quantise = {"fp8_row": quantize_fp8_rows, "fp8_block": quantize_fp8_blocks, "nvfp4": quantize_nvfp4}
    weights = {"bf16": w}
    for kind in kinds:
        if kind in quantise:
            weights[kind] = quantise[kind](w)
    return weights


def run_table(args, cl, bw) -> list[dict]:
    """The original table: every kind's GEMV (route table) and bf16 cuBLAS, optionally with ks forced."""
    rows = []
    for name, O, I in SHAPES[args.model]:
        w = (torch.randn(O, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
        weights = make_weights(w, args.kinds)
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
    return rows


def split_groups(model: str) -> list[tuple[str, list[tuple[int, int]], bool]]:
    """The model's fused projection groups (ranks/model_cuda.py FUSED_PROJECTIONS) as (name, part shapes
    [(O, I)], quantised on load), read off the checkpoint's shapes for the preset."""
    from ranks.model_cuda import FUSED_PROJECTIONS
    from ranks.random_checkpoint import spec_for
    from ranks.weights import expected_shapes
    spec = spec_for(model)
    shapes = expected_shapes(spec, include_mtp=False)
    layers = [spec.full_attention_layers[0], spec.linear_attention_layers[0]]
    out = []
    for fused, parts, quantised in FUSED_PROJECTIONS:
        for layer in layers:
            names = [f"layers.{layer}.{p}" for p in parts]
            if all(n in shapes for n in names):
                out.append((fused.split(".")[1], [tuple(shapes[n]) for n in names], quantised))
                break
    return out


def run_split(args, cl, bw) -> list[dict]:
    """Each fused projection group as the model runs it (one linear_split launch over the fused weight)
    against its parts as separate linears (the unfused model), on the production routes."""
    rows = []
    for name, shapes, quantised in split_groups(args.model):
        I, sizes = shapes[0][1], [o for o, _ in shapes]
        O = sum(sizes)
        w = (torch.randn(O, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
        for kind in [k for k in args.kinds if quantised or k == "bf16"]:
            fused = make_weights(w, [kind])[kind]
            bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            parts = [make_weights(w[a:b].contiguous(), [kind])[kind] for a, b in zip(bounds, bounds[1:])]
            for T in args.columns:
                x = torch.randn(T, I, device="cuda").to(torch.bfloat16)
                outs = [torch.empty(T, n, dtype=torch.bfloat16, device="cuda") for n in sizes]
                graph_time(lambda: cl.linear_split(x, fused, sizes, outs), reps=3)      # clocks up first
                t_fused = graph_time(lambda: cl.linear_split(x, fused, sizes, outs))
                t_parts = graph_time(lambda: [cl.linear(x, p, out=o) for p, o in zip(parts, outs)])
                floor = cl.bytes_read(O, I, T, kind) / bw
                rows.append(dict(group=name, sizes=sizes, I=I, T=T, kind=kind, fused_s=t_fused, parts_s=t_parts,
                                 gain=t_parts / t_fused, of_floor_fused=floor / t_fused,
                                 of_floor_parts=floor / t_parts))
        w = None
        torch.cuda.empty_cache()
    print(f"{'group':14s} {'rows':>18s} {'T':>3s} {'kind':>8s} {'parts us':>9s} {'fused us':>9s} {'gain':>6s} "
          f"{'floor %':>8s}")
    for r in rows:
        print(f"{r['group']:14s} {'|'.join(map(str, r['sizes'])):>18s} {r['T']:3d} {r['kind']:>8s} "
              f"{r['parts_s'] * 1e6:9.1f} {r['fused_s'] * 1e6:9.1f} {r['gain']:5.2f}x "
              f"{r['of_floor_parts']:4.0%}->{r['of_floor_fused']:.0%}")
    return rows


def run_variants(args, cl, bw) -> list[dict]:
    """Every kind under each GEMV variant (bf16's pipelined one is gemv_bf16_pipe), cuBLAS beside bf16."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []

    def row(name, O, I, T, kind, variant, impl, t, kernel, ks, grid):
        nbytes = cl.bytes_read(O, I, T, kind)
        return dict(layer=name, O=O, I=I, T=T, kind=kind, variant=variant, impl=impl, kernel=kernel, ks=ks,
                    grid=grid, s=t, bytes=nbytes, GBps=nbytes / t / 1e9, of_bw=nbytes / bw / t)

    saved = os.environ.get(cl.VARIANT_ENV)
    try:
        for name, O, I in SHAPES[args.model]:
            w = (torch.randn(O, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
            weights = make_weights(w, args.kinds)
            for T in args.columns:
                x = torch.randn(T, I, device="cuda").to(torch.bfloat16)
                out = torch.empty(T, O, dtype=torch.bfloat16, device="cuda")
                for kind in args.kinds:
                    wk = weights[kind]
                    variants = ("tc", "pipelined")          # bf16 pipelined: gemv_bf16_pipe (T <= 8)
                    for variant in variants:
                        os.environ[cl.VARIANT_ENV] = variant           # read by route() at graph capture
                        graph_time(lambda: cl._gemv(x, wk, out, None, swiglu=False), reps=3)   # clocks up
                        for ks in [None] + args.ks:
                            cl.FORCE_KS = ks
                            r = cl.route(O, I, min(T, cl.launch_columns(kind, I)), kind, sms, variant=variant)
                            t = graph_time(lambda: cl._gemv(x, wk, out, None, swiglu=False))
                            impl = variant if ks is None else f"{variant}_ks{ks}"
                            rows.append(row(name, O, I, T, kind, variant, impl, t, r.get("kernel", r["path"]),
                                            r.get("ks"), r.get("grid", [0])[0]))
                        cl.FORCE_KS = None
                if "bf16" in args.kinds:
                    t = graph_time(lambda: torch.matmul(x, w.t(), out=out))
                    rows.append(row(name, O, I, T, "bf16", "cublas", "cublas", t, "torch.matmul", None, 0))
            weights = w = None
            torch.cuda.empty_cache()
    finally:
        cl.FORCE_KS = None
        if saved is None:
            os.environ.pop(cl.VARIANT_ENV, None)
        else:
            os.environ[cl.VARIANT_ENV] = saved

    def get(name, T, kind, impl):
        return next((r for r in rows if r["layer"] == name and r["T"] == T and r["kind"] == kind
                     and r["impl"] == impl), None)

    def cell(r):
        return f"{r['s'] * 1e6:7.1f} {r['GBps']:6.0f} {r['of_bw']:5.0%}" if r else f"{'-':>20s}"

    print(f"GEMV variants: us, GB/s, % of the read bandwidth ({bw / 1e12:.2f} TB/s measured in this run); "
          f"'pipe/def' = default time / pipelined time")
    print(f"{'layer':12s} {'T':>2s} {'kind':>9s} | {'default':>20s} {'kernel':>18s} | {'pipelined':>20s} "
          f"{'kernel':>18s} | {'pipe/def':>8s}")
    for name, O, I in SHAPES[args.model]:
        for T in args.columns:
            for kind in args.kinds:
                d, p = get(name, T, kind, "tc"), get(name, T, kind, "pipelined")
                extra = f" | cuBLAS {cell(get(name, T, kind, 'cublas'))}" if kind == "bf16" else ""
                print(f"{name:12s} {T:2d} {kind:>9s} | {cell(d)} {d['kernel'][5:] + ' ks' + str(d['ks']):>18s} | "
                      f"{cell(p)} {p['kernel'][5:] + ' ks' + str(p['ks']):>18s} | {d['s'] / p['s']:7.2f}x{extra}")
    print("All layers above, each shape once (sum of bytes / sum of times), GB/s and % of the read bandwidth:")
    for kind in [k for k in args.kinds if k in QUANT_KINDS or k == "bf16"]:
        for T in args.columns:
            cells = []
            for variant in ("tc", "pipelined"):          # the variants timed above ("auto" picks one of them)
                sel = [r for r in rows if r["kind"] == kind and r["T"] == T and r["impl"] == variant]
                nb, ts = sum(r["bytes"] for r in sel), sum(r["s"] for r in sel)
                cells.append(f"{variant} {nb / ts / 1e9:6.0f} GB/s {nb / ts / bw:5.0%}")
            print(f"  {kind:>9s} T={T}: " + "   ".join(cells))
    if args.ks:
        print("With the I-split forced (% of the read bandwidth; 'route' = the variant's own choice)")
        print(f"{'layer':12s} {'T':>2s} {'kind':>9s} {'variant':>9s} {'route':>6s} "
              + " ".join(f"{'ks' + str(k):>6s}" for k in args.ks))
        for name, O, I in SHAPES[args.model]:
            for T in args.columns:
                for kind in [k for k in args.kinds if k in QUANT_KINDS]:
                    for variant in ("tc", "pipelined"):          # the variants timed above ("auto" picks one of them)
                        cells = [get(name, T, kind, variant)]
                        cells += [get(name, T, kind, f"{variant}_ks{k}") for k in args.ks]
                        print(f"{name:12s} {T:2d} {kind:>9s} {variant:>9s} "
                              + " ".join(f"{c['of_bw']:6.0%}" for c in cells))
    return rows


def run_dequant(args, cl, bw) -> list[dict]:
    """--dequant: the dequantisation kernel per layer and kind, and the prefill linear against bf16 cuBLAS."""
    rows = []
    kinds = [k for k in args.kinds if k in QUANT_KINDS]
    for name, O, I in SHAPES[args.model]:
        w = (torch.randn(O, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
        weights = make_weights(w, kinds)
        scratch = torch.empty(O, I, dtype=torch.bfloat16, device="cuda")
        for kind in kinds:
            wk = weights[kind]
            graph_time(lambda: cl.dequantize(wk, out=scratch), reps=3)          # clocks up, untimed
            t = graph_time(lambda: cl.dequantize(wk, out=scratch), calls=5)
            nb = cl.bytes_read(O, I, 1, kind) + 2 * O * I
            rows.append(dict(layer=name, O=O, I=I, kind=kind, impl="dequant", s=t, bytes=nb, of_bw=nb / t / bw))
        scratch = None
        for T in args.columns:
            x = torch.randn(T, I, device="cuda").to(torch.bfloat16)
            t = graph_time(lambda: torch.matmul(x, w.t()), calls=5)
            rows.append(dict(layer=name, O=O, I=I, T=T, kind="bf16", impl="cublas", s=t))
            for kind in kinds:
                wk = weights[kind]
                t = graph_time(lambda: cl.linear(x, wk), calls=5)
                rows.append(dict(layer=name, O=O, I=I, T=T, kind=kind, impl="linear", s=t,
                                 path=cl.route(O, I, T, kind, cl.L.sm_count())["path"]))
                t = graph_time(lambda: cl._prefill(x, wk), calls=5)
                rows.append(dict(layer=name, O=O, I=I, T=T, kind=kind, impl="prefill", s=t))
        weights = w = None
        torch.cuda.empty_cache()
    print("per T: the production route (g: GEMV, d: dequantise + cuBLAS) and the dequantise + cuBLAS path, "
          "us, each / cuBLAS on the bf16 weight")
    print(f"{'layer':12s} {'kind':>9s} {'dequant us':>10s} {'of bw':>6s} "
          + " ".join(f"{'T=' + str(T):>8s} {'route':>13s} {'dequant+mm':>13s}" for T in args.columns))
    for name, O, I in SHAPES[args.model]:
        for kind in kinds:
            d = next(r for r in rows if r["layer"] == name and r["kind"] == kind and r["impl"] == "dequant")
            cells = []
            for T in args.columns:
                pick = {r["impl"]: r for r in rows if r["layer"] == name and r.get("T") == T
                        and r["kind"] in (kind, "bf16")}
                lin, pre, ref = pick["linear"], pick["prefill"], pick["cublas"]
                cells.append(f"{'':8s} {lin['path'][0]} {lin['s'] * 1e6:7.1f} {lin['s'] / ref['s']:4.2f} "
                             f"{pre['s'] * 1e6:8.1f} {pre['s'] / ref['s']:4.2f}")
            print(f"{name:12s} {kind:>9s} {d['s'] * 1e6:10.1f} {d['of_bw']:6.0%} " + " ".join(cells))
    print("whole model (each layer once; lm_head included):")
    for kind in kinds:
        for T in args.columns:
            tot = {impl: sum(r["s"] for r in rows if r.get("T") == T and r["impl"] == impl
                             and r["kind"] == ("bf16" if impl == "cublas" else kind)) for impl in ("linear", "prefill", "cublas")}
            print(f"  {kind:>9s} T={T:3d}: route {tot['linear'] * 1e3:7.2f} ms, dequant+mm {tot['prefill'] * 1e3:7.2f} ms, "
                  f"bf16 cuBLAS {tot['cublas'] * 1e3:7.2f} ms")
    return rows


def run_once(args, cl) -> list[dict]:
    """--once: one eager launch of every selected (layer, kind, T), for a profiler; no timing."""
    rows = []
    for name, O, I in SHAPES[args.model]:
        w = (torch.randn(O, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
        weights = make_weights(w, args.kinds)
        for T in args.columns:
            x = torch.randn(T, I, device="cuda").to(torch.bfloat16)
            out = torch.empty(T, O, dtype=torch.bfloat16, device="cuda")
            for kind in args.kinds:
                plan = cl.route(O, I, T, kind, torch.cuda.get_device_properties(0).multi_processor_count)
                cl._gemv(x, weights[kind], out, None, swiglu=False)
                torch.cuda.synchronize()
                rows.append(dict(layer=name, O=O, I=I, T=T, kind=kind, kernel=plan.get("kernel", plan["path"]),
                                 ks=plan.get("ks"), grid=plan.get("grid")))
                print(f"{name:12s} T={T:2d} {kind:9s} {rows[-1]['kernel']} ks={rows[-1]['ks']} grid={rows[-1]['grid']}",
                      flush=True)
        weights = w = None
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="27b", choices=list(SHAPES))
    ap.add_argument("--columns", type=int, nargs="+", default=None,
                    help="column counts T (default 1 2 4 8 16; with --variants 1 2 4 8)")
    ap.add_argument("--kinds", nargs="+", default=["bf16", "fp8_row", "nvfp4"],
                    choices=["bf16", "fp8_row", "fp8_block", "nvfp4"])
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: measured by decode.py's probe)")
    ap.add_argument("--ks", type=int, nargs="*", default=[],
                    help="also time the GEMV with every launch's I-split forced to each of these (1, 2, 4, 8)")
    ap.add_argument("--variants", action="store_true",
                    help="time the quantised GEMV under TANDEM_GEMV_VARIANT=tc and =pipelined side by side")
    ap.add_argument("--split", action="store_true",
                    help="time the fused projection groups (q|k|v, GDN qkv|z, a|b) as one linear_split launch "
                         "against their parts as separate linears, on the production routes")
    ap.add_argument("--dequant", action="store_true",
                    help="time the dequantisation kernel per layer and the prefill linear (--columns, default "
                         "449) against bf16 cuBLAS")
    ap.add_argument("--layers", nargs="+", default=None, help="only these layers of the model's SHAPES")
    ap.add_argument("--once", action="store_true",
                    help="run every selected GEMV once, untimed (for a profiler such as ncu)")
    ap.add_argument("--shard-of", type=int, default=None, metavar="N",
                    help="each layer as rank 0's shard of a tp N split (column-parallel: O / N rows; o_proj and "
                         "down: I / N columns), for the per-byte rate of a tp N rank's GEMVs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.layers:
        known = [n for n, _, _ in SHAPES[args.model]]
        unknown = [n for n in args.layers if n not in known]
        if unknown:
            ap.error(f"--layers: {', '.join(unknown)} not among {args.model}'s layers ({', '.join(known)})")
        SHAPES[args.model] = [s for s in SHAPES[args.model] if s[0] in args.layers]
    if args.shard_of is not None:
        if args.shard_of < 1:
            ap.error(f"--shard-of {args.shard_of}: expected a tp of 1 or more")
        if args.split:
            ap.error("--shard-of times the layers alone: not with --split")
        try:
            SHAPES[args.model] = shard_shapes(SHAPES[args.model], args.shard_of)
        except ValueError as e:
            ap.error(f"--shard-of {args.shard_of}: {e}")
    if args.once and (args.split or args.variants or args.ks):
        ap.error("--once runs the production route only: no --split, --variants or --ks")
    if args.split and args.variants:
        ap.error("--split and --variants are separate tables: choose one")
    if args.dequant and (args.split or args.variants or args.ks or args.once):
        ap.error("--dequant is its own table: no --split, --variants, --ks or --once")
    if args.columns is None:
        args.columns = [449] if args.dequant else [1, 2, 4, 8] if args.variants else [1, 2, 4, 8, 16]
    from kernels import cuda_linear as cl
    # This script times the kernels: the bf16 GEMV at every T asked for, also where the production
    # table sends bf16 to cuBLAS (route() has no GEMV kernel to name beyond GEMV_COLUMNS["bf16"]).
    if not args.split:
        cl.GEMV_COLUMNS = dict(cl.GEMV_COLUMNS, bf16=cl.MAX_GEMV_COLUMNS)
    if max(args.columns) > cl.MAX_GEMV_COLUMNS and "bf16" in args.kinds and not (args.split or args.dequant):
        ap.error(f"the bf16 GEMV takes at most {cl.MAX_GEMV_COLUMNS} columns")
    if args.once:
        run_once(args, cl)
        return 0
    sys.path.insert(0, os.path.join(repo_root, "scripts", "bench"))
    from decode import measure_bandwidth
    bw = args.bandwidth or measure_bandwidth()["read_Bps"]
    print(f"read bandwidth {bw / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}")
    run = run_dequant if args.dequant else run_split if args.split else run_variants if args.variants else run_table
    rows = run(args, cl, bw)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(bandwidth=bw, rows=rows, device=torch.cuda.get_device_name(), model=args.model,
                           shard_of=args.shard_of,
                           columns=args.columns, kinds=args.kinds, variants=args.variants, split=args.split,
                           dequant=args.dequant, ks=args.ks), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
