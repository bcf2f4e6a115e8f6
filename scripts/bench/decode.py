#!/usr/bin/env python
"""Decode and prefill speed of the CUDA backend on one GPU, against the memory-bandwidth floor.

    python scripts/bench/decode.py --model 27b --weights bf16 fp8 nvfp4 --concurrency 1 4 8 16 32 \
        --out decode.json [--layers 8] [--prefill 8192 65536] [--hf]

Random weights of the full-size model are generated on the GPU (ranks.random_checkpoint.random_shard),
so no checkpoint is needed. For every weight format and concurrency C it times the decode step
(C sequences, one column each, --context tokens already in every sequence; CUDA graphs unless
--no-graph), and divides the bytes a step must read (every weight once, the lm_head included; each
sequence's KV; each GDN state read and written) by the HBM read bandwidth measured in the same run:
that quotient is the floor, and floor / step is the fraction of it reached. Prefill: one sequence
of each --prefill length in --prefill-chunk columns per step, run twice (the second run is the figure;
the first, with its one-off compiles and library plans, is kept in the JSON), tokens/s and the fraction
of the dense bf16 matmul rate measured in the same run (FLOPs: 2 x the layers' 2-D weights x tokens,
plus the head for the last token). --mixed CONTEXT: a step carrying --mixed-decodes decodes at CONTEXT
tokens beside one prefill chunk, with the decodes on the split decode kernel and on the prefill kernel.
--hf: Hugging Face transformers on the same config with random bf16
weights (decode steps at each C) in the same run.

Prints a table and writes JSON (configuration, device, commit, results) to --out.

--shard-of N: rank 0's shard of the model split for tp N, alone on one GPU, its all-reduces left out
(each returns its input): the compute part of one rank's tp N step, against that shard's floor, where
no second GPU is at hand. The exchanges' part is scripts/bench/allreduce.py's (two GPUs); a tp 2 step is
about this plus 2 x layers exchanges. Prefill and --mixed run on the shard too; --hf is skipped.

--tp 1 2 [--transport mailbox copies nccl]: tensor parallelism is timed through the whole engine (rank
processes, transport), which is scripts/bench/decode_tp.py's work: decode.py hands --model, --layers,
--weights, --concurrency, --tp, --transport and --out over to it (tp 2 with each transport next to
tp 1, against each rank's bandwidth floor; its docstring has the details) and times nothing itself.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)

import torch  # noqa: E402

from ranks.kvcache import ModelState  # noqa: E402
from ranks.model import Batch  # noqa: E402
from ranks.random_checkpoint import random_shard, spec_for  # noqa: E402
from runtime.config import PAGE_SIZE  # noqa: E402


def decode_window(timings: list[dict], C: int) -> tuple[float, float]:
    """(latest first token, latest finish) of C requests run together (their final events' timings,
    seconds from each submission, plus the submission's own offset "submitted_s" where the caller
    recorded one, so that every time is on one clock): the window in which every one of them decodes,
    which the engine benchmarks divide by the steps in it. Raises when some request finished before
    another had its first token: the steps timed were not C wide (a KV pool or slots too small;
    docs/perf.md, eleventh session: such rows once timed one lone sequence)."""
    first = max(t.get("submitted_s", 0.0) + t["ttft_s"] for t in timings)
    if first >= min(t.get("submitted_s", 0.0) + t["total_s"] for t in timings):
        raise RuntimeError(f"C={C}: the {C} requests did not all decode at once (KV pool or slots)")
    return first, max(t.get("submitted_s", 0.0) + t["total_s"] for t in timings)


def measure_bandwidth(gib: float = 4.0) -> dict:
    """HBM read bandwidth (kernels/cuda/bench.cu read_probe: 16-byte loads over a large buffer),
    and torch's copy bandwidth (read + write) for comparison, in bytes/s. The floor uses the read rate."""
    import numpy as np
    from kernels import launch
    n = int(gib * (1 << 30)) // 16 * 16
    a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    sink = torch.zeros(4096, dtype=torch.int32, device="cuda")
    fn = launch.kernel("bench", "read_probe")
    blocks = launch.sm_count() * 4

    def timed(f, reps=10):
        f()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            f()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        return statistics.median(ts)
    t_read = timed(lambda: launch.launch(fn, blocks, 512, (a, np.int64(n // 16), sink)))
    t_copy = timed(lambda: b.copy_(a))
    return dict(read_Bps=n / t_read, copy_Bps=2 * n / t_copy, floor_Bps=n / t_read)


def matmul_rate() -> float:
    """Dense bf16 matmul FLOP/s (cuBLAS, [8192, 5120] x [5120, 17408])."""
    x = torch.randn(8192, 5120, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(17408, 5120, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        x @ w.T
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        x @ w.T
    e1.record()
    e1.synchronize()
    return 10 * 2 * 8192 * 5120 * 17408 / (e0.elapsed_time(e1) / 1e3)


def step_bytes(model, spec, C: int, context: int) -> dict:
    """Bytes one decode step of C sequences at `context` must move (ranks/model_cuda.py
    step_byte_parts: every weight once, the chosen experts' share, C embedding rows, KV, GDN state)."""
    from ranks.model_cuda import step_byte_parts, step_bytes_from
    return step_bytes_from(step_byte_parts(model, spec), C, context)


def linear_params(weights: dict) -> int:
    """Parameters of the layers' 2-D linear weights (not the embedding, the head or the MTP layer),
    each storage once: the gate / up views of the fused gate|up weight (and any other view) are not
    counted again. (Before 2026-11-30's sixth session they were, which overstated every prefill
    "of matmul rate" by 1.47x on the 27B; docs/perf.md.)"""
    held = {id(v) for v in weights.values() if isinstance(v, torch.Tensor)}
    total, in_stacks = 0, {}
    for k, v in weights.items():
        if not isinstance(v, torch.Tensor) or v.dim() != 2 or k.startswith("mtp.") or "embed" in k \
                or k == "lm_head.weight":
            continue
        if v._base is not None and id(v._base) in held:
            if v._base.dim() == 2:                     # a view of a 2-D weight counted on its own
                continue
            # a 2-D view of a 3-D expert stack (the folded shared expert, and views of that view):
            # count the elements it covers once
            in_stacks.setdefault(id(v._base), []).append((v.storage_offset(), v.storage_offset() + v.numel()))
            continue
        total += v.numel()
    for spans in in_stacks.values():                    # the union of each stack's spans
        end = 0
        for lo, hi in sorted(spans):
            total += max(0, hi - max(lo, end))
            end = max(end, hi)
    return total


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """Set environment variables for a block (and drop the caches that read them once per process)."""
    from kernels import launch
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    launch.pdl_reset()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        launch.pdl_reset()


def time_decode(model, state, C: int, context: int, steps: int) -> float:
    pages_per_seq = (context + 1 + PAGE_SIZE - 1) // PAGE_SIZE
    tables = torch.arange(C * pages_per_seq, dtype=torch.int32).view(C, pages_per_seq)
    batch = Batch(torch.randint(0, model.spec.vocab_size, (C,)), [1] * C, [context] * C, list(range(C)), tables)
    for _ in range(3):                                  # eager, capture, replay
        model.forward(batch, state)
    torch.cuda.synchronize()
    ts = []
    for _ in range(steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = model.forward(batch, state)
        out.logits.argmax(-1)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(ts)


def time_prefill(model, state, length: int, chunk: int) -> tuple[float, float]:
    """(first, second) wall time of prefilling one `length`-token prompt in `chunk`-column steps: the
    first run includes one-off costs (kernel compiles, library plans for new shapes), the second is
    the steady figure."""
    ids = torch.randint(0, model.spec.vocab_size, (length,))
    pages = (length + PAGE_SIZE - 1) // PAGE_SIZE
    tables = torch.arange(pages, dtype=torch.int32).view(1, pages)
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(0, length, chunk):
            c = min(chunk, length - s)
            model.forward(Batch(ids[s:s + c], [c], [s], [0], tables), state,
                          logits="last" if s + c == length else "none")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def time_mixed(model, spec, context: int, C: int, chunk: int, steps: int, tp: int = 1) -> dict:
    """Steps that carry C decodes at `context` tokens beside one `chunk`-column prefill chunk (the
    scheduler's mixed steps), with the decodes on the split decode kernel and, for comparison, on the
    prefill kernel with the chunk; the chunk alone and the decodes alone for reference. Medians of
    `steps` CUDA-event-timed steps (the state is overwritten in place; timing only)."""
    from ranks import model_cuda
    per = (context + 1 + PAGE_SIZE - 1) // PAGE_SIZE
    cp = (chunk + PAGE_SIZE - 1) // PAGE_SIZE
    state = ModelState(spec, C + 1, C * per + cp, torch.bfloat16, "cuda", tp=tp, with_mtp=False)
    tables = torch.zeros(C + 1, max(per, cp), dtype=torch.int32)
    for b in range(C):
        tables[b, :per] = torch.arange(b * per, (b + 1) * per)
    tables[C, :cp] = torch.arange(C * per, C * per + cp)
    ids = torch.randint(0, spec.vocab_size, (C + chunk,))
    batches = dict(
        mixed=Batch(ids, [1] * C + [chunk], [context] * C + [0], list(range(C + 1)), tables),
        chunk=Batch(ids[C:], [chunk], [0], [C], tables[C:]),
        decodes=Batch(ids[:C], [1] * C, [context] * C, list(range(C)), tables[:C]))
    out = {}
    for name, batch, on_decode in (("mixed", batches["mixed"], True), ("mixed_prefill_kernel", batches["mixed"], False),
                                   ("chunk_alone", batches["chunk"], True), ("decodes_alone", batches["decodes"], True)):
        model_cuda.MIXED_DECODE_KERNEL = on_decode
        try:
            ts = []
            for i in range(steps + 1):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                model.forward(batch, state, logits="last")
                e1.record()
                e1.synchronize()
                if i:
                    ts.append(e0.elapsed_time(e1) / 1e3)
            out[name] = statistics.median(ts)
        finally:
            model_cuda.MIXED_DECODE_KERNEL = True
    del state
    torch.cuda.empty_cache()
    return out


def hf_decode(spec_name: str, layers: int | None, concurrency: list[int], context: int, steps: int,
              device: str = "cuda") -> dict:
    """transformers on the same config, random bf16 weights, decode step time at each C."""
    import transformers
    from ranks.random_checkpoint import text_config
    cfg = text_config(spec_name, num_layers=layers)
    moe = "num_experts" in cfg
    conf = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(**cfg)
    mcls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            m = mcls(conf).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    out = {}
    for C in concurrency:
        ids = torch.randint(0, spec_for(spec_name).vocab_size, (C, context), device=device)
        with torch.inference_mode():
            r = m(input_ids=ids, use_cache=True)
            past = r.past_key_values
            nxt = r.logits[:, -1:].argmax(-1)
            ts = []
            sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
            for _ in range(steps):
                sync()
                t0 = time.perf_counter()
                r = m(input_ids=nxt, past_key_values=past, use_cache=True)
                past = r.past_key_values
                nxt = r.logits[:, -1:].argmax(-1)
                sync()
                ts.append(time.perf_counter() - t0)
        out[C] = statistics.median(ts[2:] or ts)
        del past, r
    del m
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def tp_argv(args) -> list[str]:
    """decode_tp.py's arguments for decode.py's --tp run."""
    argv = ["--model", args.model, "--weights", *args.weights, "--tp", *map(str, args.tp),
            "--concurrency", *map(str, args.concurrency)]
    if args.layers is not None:
        argv += ["--layers", str(args.layers)]
    if args.transport:
        argv += ["--transport", *args.transport]
    if args.out:
        argv += ["--out", args.out]
    return argv


def _tp_run(args) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import decode_tp
    return decode_tp.main(tp_argv(args))


def check_shard_of(spec, tp: int) -> int:
    """--shard-of's N, or SystemExit with the sharding rule's message when the model cannot be split so."""
    from ranks.sharding import ShardError, check_tp
    try:
        check_tp(spec, tp)
    except ShardError as e:
        raise SystemExit(f"--shard-of {tp}: {e}")
    return tp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="27b", help="preset of ranks.random_checkpoint (27b, 35b-a3b, small, ...)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (quick runs)")
    ap.add_argument("--weights", nargs="+", default=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each sequence")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", type=int, nargs="*", default=[8192])
    ap.add_argument("--prefill-chunk", type=int, nargs="+", default=[2048],
                    help="columns per prefill step; several values time each --prefill length with each "
                         "(the first also sizes --mixed's chunk)")
    ap.add_argument("--mixed", type=int, nargs="*", default=[], metavar="CONTEXT",
                    help="bf16: time steps of --mixed-decodes decodes at CONTEXT tokens beside one "
                         "--prefill-chunk chunk (decodes on the decode kernel vs on the prefill kernel)")
    ap.add_argument("--mixed-decodes", type=int, default=4)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--gemv-columns", type=int, default=None,
                    help="route bf16 linears with more columns than this to cuBLAS (default: the route table)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:ENV=VALUE[,ENV=VALUE]",
                    help="time the decode steps again with these environment settings (fresh CUDA graphs; "
                         "e.g. nopdl:TANDEM_PDL=0 or pipe:TANDEM_GEMV_VARIANT=pipelined); repeatable, "
                         "the default settings always run first")
    ap.add_argument("--hf", action="store_true", help="also time transformers on the same config")
    ap.add_argument("--shard-of", type=int, default=1, metavar="N",
                    help="time rank 0's shard of a tp N split alone, its all-reduces left out (module docstring)")
    ap.add_argument("--tp", type=int, nargs="+", default=None,
                    help="time these tensor-parallel degrees through the engine (decode_tp.py) instead")
    ap.add_argument("--transport", nargs="+", default=None, help="with --tp: the transports (decode_tp.py)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tp is not None:
        return _tp_run(args)
    variants = [("default", {})]
    for v in args.variant:
        name, _, settings = v.partition(":")
        pairs = [kv for kv in settings.split(",") if kv]
        if not name or not pairs or any("=" not in kv or not kv.split("=", 1)[0] for kv in pairs):
            ap.error(f"--variant {v!r}: expected NAME:ENV=VALUE[,ENV=VALUE]")
        if name in (n for n, _ in variants):
            ap.error(f"--variant {v!r}: the name {name!r} is taken (default is the run without settings)")
        variants.append((name, dict(kv.split("=", 1) for kv in pairs)))

    from kernels import cuda_linear
    from ranks.model_cuda import WEIGHT_FORMATS, CudaHybridModel, _fuse_gate_up
    bad = [f for f in args.weights if f not in WEIGHT_FORMATS]
    if bad:
        raise SystemExit(f"--weights {' '.join(bad)}: choose from {', '.join(WEIGHT_FORMATS)}")
    if args.gemv_columns is not None:
        cuda_linear.GEMV_COLUMNS["bf16"] = args.gemv_columns
    torch.manual_seed(0)
    spec = spec_for(args.model, num_layers=args.layers)
    tp = check_shard_of(spec, args.shard_of)
    if tp > 1 and args.hf:
        print("--hf skipped: transformers runs the whole model, not a shard", flush=True)
        args.hf = False
    props = torch.cuda.get_device_properties(0)
    # TANDEM_COMMIT names the tree when the checkout's git metadata is not the tree's own (a copy)
    commit = os.environ.get("TANDEM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo_root, capture_output=True, text=True).stdout.strip() or None
    bw = measure_bandwidth()
    torch.cuda.empty_cache()
    mm = matmul_rate()
    print(f"device {props.name}, {props.multi_processor_count} SMs; read {bw['read_Bps'] / 1e12:.2f} TB/s, "
          f"copy {bw['copy_Bps'] / 1e12:.2f} TB/s (read + write); "
          f"bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    if tp > 1:
        print(f"rank 0's shard of a tp {tp} split, alone: its all-reduces left out, its own floor", flush=True)
    res = dict(model=args.model, layers=spec.num_layers, shard_of=tp, gemv_columns=dict(cuda_linear.GEMV_COLUMNS),
               device=props.name, commit=commit,
               date=time.strftime("%Y-%m-%d"), bandwidth=bw, matmul_flops=mm, decode=[], prefill=[], mixed=[], hf={})
    t0 = time.perf_counter()
    base = random_shard(spec, 0, tp, dtype=torch.bfloat16, device="cuda")
    _fuse_gate_up(base)                                  # once, so each format's model shares it
    torch.cuda.synchronize()
    print(f"random weights: {time.perf_counter() - t0:.1f} s", flush=True)
    max_c = max(args.concurrency)
    rows = []
    for fmt in args.weights:
        weights = dict(base)
        # the format goes to the model, which quantises before it folds the shared expert, as serving does
        # (quantising afterwards left the folded stacks in bf16)
        model = CudaHybridModel(spec, weights, tp=tp, weight_format=fmt, cuda_graphs=not args.no_graph,
                                all_reduce_capturable=True)     # tp > 1: the identity all-reduce
        pages = max_c * ((args.context + 2 + PAGE_SIZE - 1) // PAGE_SIZE) + 4
        need_prefill = max(args.prefill or [0])
        pages = max(pages, (need_prefill + PAGE_SIZE - 1) // PAGE_SIZE + 1)
        state = ModelState(spec, max_c, pages, torch.bfloat16, "cuda", tp=tp, with_mtp=False)
        for vname, env in variants:
            with environment(env):
                if model.graphs is not None:                # graphs captured under these settings
                    from ranks.graphs import GraphRunner
                    model.graphs = None                     # the previous variant's graphs freed first
                    gc.collect()
                    torch.cuda.empty_cache()
                    model.graphs = GraphRunner(model)
                for C in args.concurrency:
                    t = time_decode(model, state, C, args.context, args.steps)
                    b = step_bytes(model, spec, C, args.context)
                    floor = b["total"] / bw["floor_Bps"]
                    r = dict(weights=fmt, variant=vname, env=env, C=C, step_s=t, tok_s=C / t, bytes=b,
                             floor_s=floor, of_floor=floor / t)
                    res["decode"].append(r)
                    rows.append(r)
                    print(f"{fmt:6s} {vname:10s} C={C:3d} step {t * 1e3:8.2f} ms  {C / t:8.1f} tok/s  "
                          f"floor {floor * 1e3:7.2f} ms  {floor / t:6.1%} of floor", flush=True)
        if fmt == "bf16":
            # the layers' matmuls run on every token; the head only on the last one
            active = linear_params(model.w)
            for L in args.prefill:
                for chunk in args.prefill_chunk:
                    first, t = time_prefill(model, state, L, chunk)
                    rate = 2 * (active * L + model.head.numel()) / t
                    res["prefill"].append(dict(tokens=L, chunk=chunk, s=t, first_s=first, tok_s=L / t,
                                               flops=rate, of_matmul=rate / mm))
                    print(f"prefill {L:6d} tokens in {chunk}-column steps: {t:7.2f} s  {L / t:9.0f} tok/s  "
                          f"{rate / mm:6.1%} of matmul rate (first run {first:.2f} s)", flush=True)
            if args.mixed:
                del state
                gc.collect()
                torch.cuda.empty_cache()
                state = None
            for L in args.mixed:
                chunk = args.prefill_chunk[0]
                m = time_mixed(model, spec, L, args.mixed_decodes, chunk, max(3, args.steps // 2), tp)
                res["mixed"].append(dict(context=L, decodes=args.mixed_decodes, chunk=chunk,
                                         **{k + "_s": v for k, v in m.items()}))
                print(f"mixed step, {args.mixed_decodes} decodes at {L} tokens + a {chunk}-column chunk: "
                      f"{m['mixed'] * 1e3:.1f} ms (decodes through the prefill kernel: "
                      f"{m['mixed_prefill_kernel'] * 1e3:.1f} ms; chunk alone {m['chunk_alone'] * 1e3:.1f} ms, "
                      f"decodes alone {m['decodes_alone'] * 1e3:.1f} ms)", flush=True)
        del model, weights, state
        gc.collect()
        torch.cuda.empty_cache()
    del base
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf:
        try:
            res["hf"] = hf_decode(args.model, args.layers, args.concurrency, args.context, max(5, args.steps // 2))
            for C, t in res["hf"].items():
                ours = min(r["step_s"] for r in rows if r["C"] == C and r["weights"] == "bf16"
                           and r["variant"] == "default")
                print(f"transformers bf16 C={C:3d} step {t * 1e3:8.2f} ms  {C / t:8.1f} tok/s  "
                      f"tandem bf16 is {t / ours:5.1f}x faster")
        except Exception as e:                         # report, do not lose the rest of the run
            res["hf"] = dict(error=f"{type(e).__name__}: {e}")
            print(f"transformers comparison failed: {e}")
    print("\nweights variant      C   step ms   tok/s   floor ms   of floor   vs default")
    base_t = {(r["weights"], r["C"]): r["step_s"] for r in rows if r["variant"] == "default"}
    for r in rows:
        print(f"{r['weights']:6s}  {r['variant']:10s} {r['C']:3d} {r['step_s'] * 1e3:8.2f} {r['tok_s']:8.1f} "
              f"{r['floor_s'] * 1e3:8.2f} {r['of_floor']:8.1%} {base_t[(r['weights'], r['C'])] / r['step_s']:8.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
