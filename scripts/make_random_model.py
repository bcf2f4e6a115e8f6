#!/usr/bin/env python
"""Write a random-weight Qwen3.5/3.6 model directory (config, safetensors, tokenizer) for tests and benchmarks.

    python scripts/make_random_model.py --config tiny --out /tmp/tiny
    python scripts/make_random_model.py --config 27b --layers 4 --out /tmp/27b-4l     # full widths, 4 layers
    python scripts/make_random_model.py --config 35b-a3b --out /data/35b-random        # ~71 GB in bfloat16

Presets: tiny, tiny-moe, small (CPU-sized), 27b, 35b-a3b (the released shapes). See ranks/random_checkpoint.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ranks.random_checkpoint import (PRESETS, param_counts, spec_for,  # noqa: E402
                                     write_random_checkpoint)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, choices=list(PRESETS), help="preset to write")
    ap.add_argument("--out", required=True, help="output directory (must be empty or absent unless --force)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--layout", default="official", choices=["official", "hf"],
                    help="official: multimodal wrapper config, model.language_model.*, fused experts; "
                         "hf: text-only config, model.*, per-expert tensors")
    ap.add_argument("--layers", type=int, default=None, help="number of decoder layers (widths unchanged)")
    ap.add_argument("--max-shard-gib", type=float, default=4.0, help="largest safetensors shard (GiB)")
    ap.add_argument("--force", action="store_true", help="write into a non-empty directory (replacing our files)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        print(f"error: {out} exists and is not a directory", file=sys.stderr)
        return 2
    if os.path.isdir(out) and os.listdir(out) and not args.force:
        print(f"error: {out} is not empty; pass --force to write into it anyway", file=sys.stderr)
        return 2
    if args.layers is not None and args.layers < 1:
        print(f"error: --layers must be >= 1, got {args.layers}", file=sys.stderr)
        return 2

    spec = spec_for(args.config, args.layers)
    counts = param_counts(spec)
    elsize = 4 if args.dtype == "float32" else 2
    need = counts["total"] * elsize
    os.makedirs(out, exist_ok=True)
    free = shutil.disk_usage(out).free
    if need > free:
        print(f"error: {args.config} needs {_gb(need)} of weights but {out} has {_gb(free)} free", file=sys.stderr)
        return 2
    print(f"writing {args.config} ({spec.num_layers} layers, {args.dtype}, {args.layout} layout, seed {args.seed}): "
          f"{counts['total'] / 1e6:,.1f} M parameters, {_gb(need)} -> {out}", flush=True)

    t0 = time.time()
    result = write_random_checkpoint(out, args.config, seed=args.seed, dtype=args.dtype, layout=args.layout,
                                     num_layers=args.layers, max_shard_bytes=int(args.max_shard_gib * 2**30),
                                     progress=not args.quiet)
    shards = [f for f in result.files if f.endswith(".safetensors")]
    print(f"wrote {out} in {time.time() - t0:.1f} s")
    print(f"  parameters: {counts['text']:,} text + {counts['mtp']:,} MTP = {counts['total']:,}")
    print(f"  weights:    {result.num_bytes:,} bytes in {len(shards)} safetensors file(s)")
    print(f"  tokenizer:  {result.tokenizer_size} ids (model vocab_size {spec.vocab_size}); "
          f"eos ids {list(result.spec.eos_token_ids)}")
    print(f"  files:      {', '.join(sorted(result.files))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
