"""CPU tokens/s of the reference backend (in process, one sequence) for the tiny and small presets.

    python scripts/bench/cpu_reference.py [--presets tiny,small] [--dtype float32] [--out bench.json]

For each preset: prefill tokens/s (one chunk of --prompt tokens) and decode tokens/s (--decode
single-column steps), median of --repeat runs, with random weights built in memory. It also prints
the ratio of the decode step to the time it takes this machine to read the weights once (a memory
copy of the same bytes), the CPU analogue of the bandwidth floor. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from ranks.model import Batch, HybridModel  # noqa: E402
from ranks.random_checkpoint import random_tensors, spec_for  # noqa: E402


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def bench(preset: str, dtype: torch.dtype, prompt: int, decode: int, repeat: int) -> dict:
    spec = spec_for(preset)
    weights = random_tensors(spec, seed=0, dtype=dtype)
    model = HybridModel(spec, weights)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    pages = -(-(prompt + decode) // 64)
    table = torch.arange(pages, dtype=torch.int32)[None]
    ids = torch.randint(0, spec.vocab_size, (prompt + decode,), generator=torch.Generator().manual_seed(0))
    prefill_s, decode_s = [], []
    for _ in range(repeat):
        state = model.new_state(1, pages)
        t0 = time.perf_counter()
        model.forward(Batch(ids[:prompt], [prompt], [0], [0], table), state, logits="last")
        prefill_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(decode):
            model.forward(Batch(ids[prompt + i:prompt + i + 1], [1], [prompt + i], [0], table), state, logits="last")
        decode_s.append((time.perf_counter() - t0) / decode)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])
    copy_s = []
    for _ in range(5):
        t0 = time.perf_counter()
        flat.clone()
        copy_s.append(time.perf_counter() - t0)
    step, floor = statistics.median(decode_s), min(copy_s)
    return dict(preset=preset, dtype=str(dtype).replace("torch.", ""), params=sum(t.numel() for t in weights.values()),
                weight_bytes=weight_bytes, prompt=prompt, prefill_tok_s=prompt / statistics.median(prefill_s),
                decode_step_ms=step * 1e3, decode_tok_s=1.0 / step, weight_copy_ms=floor * 1e3,
                step_over_copy=step / floor)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="write JSON results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [bench(p, getattr(torch, args.dtype), args.prompt, args.decode, args.repeat)
            for p in args.presets.split(",")]
    meta = dict(date=time.strftime("%Y-%m-%d"), commit=_commit(), machine=platform.machine(),
                cpus=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__)
    print(f"# CPU reference backend, {meta['date']}, commit {meta['commit']}, {meta['cpus']} CPUs, "
          f"{meta['torch_threads']} torch threads")
    print(f"{'preset':8} {'dtype':9} {'params':>9} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'step ms':>8} {'copy ms':>8} {'step/copy':>9}")
    for r in rows:
        print(f"{r['preset']:8} {r['dtype']:9} {r['params'] / 1e6:8.1f}M {r['prefill_tok_s']:14.1f} "
              f"{r['decode_tok_s']:13.1f} {r['decode_step_ms']:8.2f} {r['weight_copy_ms']:8.3f} {r['step_over_copy']:9.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
