"""All-reduce between two GPUs: the GPU mailbox vs NCCL vs staged copies, bf16 payloads 4 KiB .. 1 MiB.

    python scripts/bench/allreduce.py [--sizes 4096,16384,...] [--per-graph 100] [--replays 50] [--out ar.json]
        [--mailbox-variants lean8,lean16,lean8d300,...] [--no-floor]

Two processes (GPUs 0 and 1). Mailbox and NCCL run inside a captured CUDA graph of --per-graph exchanges
replayed --replays times (CUDA events around each replay; median per exchange); staged copies cannot be
captured and run eagerly (a tenth of --per-graph exchanges per timed group, a fifth of the
replays, host clock). Every rank reports its
own medians; the table shows both ranks, GB/s of payload (bf16 bytes per exchange / time) and the
ratio of each transport's time to NCCL's. --mailbox-variants times other mailbox kernel variants too
(transport/mailbox_cuda.py: classic, lean16, lean8, plus fields f<flags> b<grid cap> t<threads per block>
d<first-poll delay ns>), each in its own graph on the same mailbox, in the order given, once per size;
the "mailbox" column is the default variant (or TANDEM_MAILBOX_VARIANT). After its timing, each
transport, variant and size runs one exchange of known inputs whose result is checked (bit for bit for
the mailbox and the staged copies, within 1% for NCCL); a wrong one is listed and the exit status is 3.

First, unless --no-floor, the latency floor of an exchange on this machine (kernels/cuda/bench.cu
floor_*), per rank: an empty kernel in a captured graph (us per launch), one read of mapped pinned host
memory (the PCIe read round trip), and the one-way latency of a store to host memory until the peer's
poll sees it (a ping-pong of single words between the ranks, half a round trip). An exchange costs at
least one launch plus one one-way latency; the table prints the exchanges against that sum.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

DEFAULT_SIZES = [4096 << k for k in range(9)]              # 4 KiB .. 1 MiB of bf16


def _graph_us(torch, fn, x, per_graph: int, replays: int) -> list[float]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    del g
    return [a.elapsed_time(b) * 1e3 / per_graph for a, b in ev]


def _eager_us(torch, fn, x, per_graph: int, replays: int) -> list[float]:
    for _ in range(3):
        fn(x)
    out = []
    for _ in range(replays):
        t0 = time.perf_counter()
        for _ in range(per_graph):
            fn(x)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6 / per_graph)
    return out


def _check(torch, fn, size: int, rank: int, dev: str, exact: bool) -> str:
    """One eager exchange of known inputs (both ranks draw both inputs from one seed): 'exact' when the
    result is bit for bit the float32 sum in rank order rounded once to bf16 (what the mailbox and the
    staged copies promise), 'close' when within 1% (NCCL makes no such promise), else 'WRONG (...)'."""
    g = torch.Generator().manual_seed(size)
    xs = [torch.randn(size // 2, generator=g).to(torch.bfloat16) for _ in range(2)]
    want = (xs[0].float() + xs[1].float()).to(torch.bfloat16)
    got = fn(xs[rank].to(dev)).cpu()
    if torch.equal(got, want):
        return "exact"
    err = float((got.float() - want.float()).abs().max())
    if not exact and torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
        return "close"
    return f"WRONG (max error {err:.3g}, {int((got != want).sum())} of {got.numel()} elements differ)"


def _floor(torch, mb, pong, rank: int, dev: str, per_graph: int, replays: int, iters: int = 2000) -> dict:
    """The latency floor of an exchange (module docstring): medians of five runs each. Collective."""
    import numpy as np
    from kernels import launch as L
    from transport.mailbox import HEADER_BYTES
    empty = L.kernel("bench", "floor_empty", rank)
    launch_us = statistics.median(_graph_us(
        torch, lambda _x: L.launch(empty, (1,), (32,), (), device=rank, pdl=True), None, per_graph, replays))
    out = torch.full((2,), -1, dtype=torch.int64, device=dev)
    read = L.kernel("bench", "floor_host_read", rank)
    reads = []
    for _ in range(5):
        L.launch(read, (1,), (1,), (np.uint64(mb._ptr), np.int32(iters), np.uint64(0), out), device=rank)
        torch.cuda.synchronize()
        reads.append(int(out[0]) / iters / 1e3)
    ping = L.kernel("bench", "floor_ping_pong", rank)
    words = np.uint64(pong._ptr + HEADER_BYTES)
    one_way, base = [], 1
    for _ in range(5):
        mb.barrier()                                       # both ranks launch at about the same moment
        L.launch(ping, (1,), (1,), (words, np.int32(rank), np.int32(iters), np.uint64(base), np.uint64(10**10), out),
                 device=rank)
        torch.cuda.synchronize()
        ns, done = (int(v) for v in out.tolist())
        if done != iters:
            raise RuntimeError(f"rank {rank}: the ping-pong stopped after {done} of {iters} round trips (peer gone?)")
        one_way.append(ns / iters / 2 / 1e3)
        base += iters + 1
    return {"launch_us": launch_us, "host_read_us": statistics.median(reads), "one_way_us": statistics.median(one_way)}


def _variants(text: str) -> list[tuple[str, dict]]:
    """'lean8d300,b8' -> [('lean8d300', all fields), ('b8', all fields)]: fields a variant does not set keep
    the default variant's (transport/mailbox_cuda.py make_variant; a name sets them all)."""
    from transport.mailbox_cuda import make_variant, variant_from_env
    default = variant_from_env()                       # the ranks' default: they inherit this environment
    out = []
    for v in text.split(","):
        try:
            fields = dataclasses.asdict(make_variant(v, default))     # fails here, not in the ranks
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        out.append((v, fields))
    names = [v for v, _ in out]
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"mailbox variants repeat a name: {text!r}")
    return out


def _rank(rank: int, q, args, mailbox_name: str, staged_name: str, pong_name: str, init: str) -> None:
    try:
        import torch
        from transport.copies import StagedCopies
        from transport.mailbox_cuda import CudaMailbox
        from transport.nccl import NcclAllReduce
        torch.cuda.set_device(rank)
        dev = f"cuda:{rank}"
        nccl = NcclAllReduce(rank, 2, init, device=rank)
        nccl.warm_up()
        mb = CudaMailbox(mailbox_name, rank, device=rank, timeout_s=60.0)
        staged = StagedCopies(staged_name, rank, device=rank, timeout_s=60.0)
        default = mb.variant
        res = {"probe_us": None, "rows": [], "variant": str(default)}
        mb.barrier()
        res["probe_us"] = mb.probe(iters=100)
        if args.floor:
            pong = CudaMailbox(pong_name, rank, device=rank, timeout_s=60.0)     # its words only, never exchanged
            try:
                res["floor"] = _floor(torch, mb, pong, rank, dev, args.per_graph, args.replays)
            finally:
                pong.close()
        for size in args.sizes:
            n = size // 2
            x = torch.randn(n, device=dev).to(torch.bfloat16)   # values grow over the repeats; timing ignores them
            row = {"bytes": size}
            variants = [("nccl", nccl.all_reduce, True, None), ("mailbox", mb.all_reduce, True, default)]
            variants += [(f"mailbox_{v}", mb.all_reduce, True, dataclasses.replace(default, **fields))
                         for v, fields in args.mailbox_variants]
            variants.append(("staged", staged.all_reduce, False, None))
            for name, fn, graph, conf in variants:
                if conf is not None:
                    mb.synchronize()                   # both ranks switch between exchanges, never inside one
                    mb.variant = conf
                nccl.barrier()
                if graph:
                    us = _graph_us(torch, fn, x, args.per_graph, args.replays)
                else:                                  # ~100x slower per exchange: fewer of them
                    us = _eager_us(torch, fn, x, max(1, args.per_graph // 10), max(3, args.replays // 5))
                row[name] = statistics.median(us)
                row[name + ".check"] = _check(torch, fn, size, rank, dev, exact=name != "nccl")
            mb.variant = default
            mb.synchronize()
            res["rows"].append(row)
        staged.close()
        mb.close()
        nccl.close()
        q.put((rank, "ok", res))
    except BaseException as e:
        q.put((rank, type(e).__name__, f"{e}\n{traceback.format_exc()}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=DEFAULT_SIZES,
                    help="payload bytes (bf16), comma-separated")
    ap.add_argument("--per-graph", type=int, default=100)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--mailbox-variants", type=_variants, default=[],
                    help="also time mailbox kernel variants, comma-separated: [classic|lean16|lean8] then "
                         "optional f<flags> b<grid cap in blocks> t<threads per block> d<first-poll delay ns>, "
                         "e.g. classic,lean16,lean8,lean8d300,lean8t128,f2b16")
    ap.add_argument("--no-floor", dest="floor", action="store_false",
                    help="skip the latency floor (empty launch, host read, one-way latency)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    import torch
    if torch.cuda.device_count() < 2:
        print("needs two GPUs", file=sys.stderr)
        return 2
    from multiprocessing import resource_tracker
    from transport.mailbox import create_segment
    words = max(args.sizes) // 2
    segs = [create_segment(2, words), create_segment(2, words), create_segment(2, 64)]
    tmp = tempfile.mkdtemp(prefix="tandem-ar-")
    init = f"file://{tmp}/init"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, q, args, segs[0].name, segs[1].name, segs[2].name, init), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    out, failed = {}, False
    try:
        deadline = time.monotonic() + args.timeout
        for _ in procs:
            rank, status, value = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if status != "ok":
                print(f"rank {rank} failed: {status}: {value}", file=sys.stderr)
                failed = True
                break
            out[rank] = value
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
        for shm in segs:
            shm.close()
            resource_tracker.register(shm._name, "shared_memory")  # type: ignore[attr-defined]
            shm.unlink()
    if failed or len(out) != 2:
        return 1

    print(f"{torch.cuda.get_device_name(0)} x2; graph of {args.per_graph} exchanges x {args.replays} replays "
          f"(staged: eager); us per exchange, rank 0 / rank 1")
    print(f"mailbox (default variant {out[0]['variant']}) probe (4 KiB, graph): {out[0]['probe_us']:.2f} / "
          f"{out[1]['probe_us']:.2f} us")
    floors = [out[r].get("floor") for r in (0, 1)]
    if all(floors):
        f0, f1 = floors
        print(f"latency floor, rank 0 / rank 1: empty kernel in a graph {f0['launch_us']:.2f} / {f1['launch_us']:.2f} us, "
              f"host read round trip {f0['host_read_us']:.2f} / {f1['host_read_us']:.2f} us, one-way (store -> peer "
              f"sees it) {f0['one_way_us']:.2f} / {f1['one_way_us']:.2f} us; floor of an exchange (launch + one-way) "
              f"{max(f['launch_us'] + f['one_way_us'] for f in floors):.2f} us")
    hdr = f"{'bytes':>8} | {'nccl us':>13} | {'mailbox us':>13} {'GB/s':>6} {'x nccl':>6} | " \
          f"{'staged us':>15} {'GB/s':>6} {'x nccl':>6}"
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for r0, r1 in zip(out[0]["rows"], out[1]["rows"]):
        b = r0["bytes"]
        row = {"bytes": b}
        for name in ("nccl", "mailbox", "staged"):
            row[name] = {"rank0_us": r0[name], "rank1_us": r1[name], "us": max(r0[name], r1[name])}
            row[name]["gbps"] = b / (row[name]["us"] * 1e3)
            row[name]["x_nccl"] = row[name]["us"] / max(row["nccl"]["us"], 1e-9)
        rows.append(row)
        m, s, n = row["mailbox"], row["staged"], row["nccl"]
        print(f"{b:>8} | {n['rank0_us']:>6.2f}/{n['rank1_us']:<6.2f} | {m['rank0_us']:>6.2f}/{m['rank1_us']:<6.2f} "
              f"{m['gbps']:>6.2f} {m['x_nccl']:>6.2f} | {s['rank0_us']:>7.1f}/{s['rank1_us']:<7.1f} "
              f"{s['gbps']:>6.2f} {s['x_nccl']:>6.2f}")
    if args.mailbox_variants:
        names = [v for v, _ in args.mailbox_variants]
        print("mailbox kernel variants (transport/mailbox_cuda.py: classic = f2, lean16 = f4, lean8 = f12; "
              "f: flags, 1 fence after publishing, 2 hang word polled by lane 0 only (classic), 4 lean kernel, "
              "8 one word per thread (lean); b: grid cap; t: threads per block; d: first-poll delay ns), "
              f"us per exchange (max of the ranks); default = {out[0]['variant']}")
        w = max(8, *(len(v) for v in names))
        print(f"{'bytes':>8} | {'default':>{w}} " + " ".join(f"{v:>{w}}" for v in names))
        for r0, r1, row in zip(out[0]["rows"], out[1]["rows"], rows):
            row["mailbox_variants"] = {v: max(r0[f"mailbox_{v}"], r1[f"mailbox_{v}"]) for v in names}
            print(f"{row['bytes']:>8} | {row['mailbox']['us']:>{w}.2f} "
                  + " ".join(f"{row['mailbox_variants'][v]:>{w}.2f}" for v in names))
    checks = {}
    for r, res in out.items():
        for row in res["rows"]:
            for k, v in row.items():
                if k.endswith(".check"):
                    checks.setdefault(v, []).append(f"{k[:-6]} {row['bytes']} B rank {r}")
    wrong = {k: v for k, v in checks.items() if k.startswith("WRONG")}
    print("result check (one exchange of known inputs per transport, variant and size, after its timing): "
          + ", ".join(f"{len(v)} {k}" for k, v in sorted(checks.items()) if not k.startswith("WRONG")))
    for k, v in wrong.items():
        print(f"  {k}: {'; '.join(v)}")
    for row, r0, r1 in zip(rows, out[0]["rows"], out[1]["rows"]):
        row["checks"] = {k[:-6]: [r0[k], r1[k]] for k in r0 if k.endswith(".check")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), per_graph=args.per_graph, replays=args.replays,
                           variant=out[0]["variant"], probe_us=[out[0]["probe_us"], out[1]["probe_us"]],
                           floor=[out[0].get("floor"), out[1].get("floor")],
                           rows=rows), f, indent=1)
    return 3 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
