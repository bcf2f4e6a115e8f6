#!/usr/bin/env python
"""Checkpoint load to one GPU: the pinned staging (ranks/upload.py) against the path before it.

    python scripts/bench/load.py --model 27b --layers 8 --dir /tmp/ckpt-27b-8 --tp 1 2 --reps 2 --out load.json

Writes a random bf16 checkpoint of --model with --layers layers to --dir unless one is there, reads
its files once so that the page cache holds them (the figures are for a warm cache: a cold load is the
disk's rate, whichever path), then times load_shard(..., device="cuda") of rank 0's shard at each --tp,
for each variant, alternated --reps times:

* staged: the default (pinned slabs, whole tensors and row ranges read straight from the files by
  ranks.upload.READERS threads);
* staged1: the same with one reading thread (TANDEM_UPLOAD_READERS=1);
* pageable: TANDEM_PINNED_UPLOAD=0 (the safetensors reader, then a synchronous copy from pageable memory);
* before: as the code was before the staging (the reader, a copy where the file offset is not 64-byte
  aligned, then the synchronous copy).

Floors measured in the same run: the page-cache read rate (os.preadv of every file into pinned memory,
with one thread and with ranks.upload.READERS threads, as the staging reads) and the pinned
host-to-device copy rate (1 GiB, torch). Each load's rate is reported with its ratio to the lower of
the parallel read and the copy. A table on stdout, JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, repo_root)

import torch  # noqa: E402

VARIANTS = ("staged", "staged1", "pageable", "before")


def read_floor(files: list[str], readers: int) -> float:
    """Bytes a second of reading the files into pinned memory, 64 MiB a call in `readers` parts at once
    (the staging's own reads, ranks.upload.Upload._pread, without the copies to the device)."""
    from ranks.upload import Upload
    up = Upload("cpu")
    up.readers = readers
    buf = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
    total, t0 = 0, time.perf_counter()
    for path in files:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            for at in range(0, size, buf.numel()):
                n = min(buf.numel(), size - at)
                up._pread(fd, buf[:n], at)
                total += n
        finally:
            os.close(fd)
    up.close()
    return total / (time.perf_counter() - t0)


def h2d_floor(n: int = 2**30) -> float:
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(7)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - t0))
    return best


def load_once(ckpt, spec, tp: int, variant: str) -> tuple[float, int]:
    from ranks import upload
    from ranks.sharding import load_shard
    from ranks.upload import nbytes
    os.environ[upload.ENV] = "1" if variant.startswith("staged") else "0"
    if variant == "staged1":
        os.environ[upload.READERS_ENV] = "1"
    saved = upload.Upload.read
    if variant == "before":
        def read(self, ckpt, name, index=(), dtype=None):
            return self._count(ckpt.read(name, index=tuple(index) or None, dtype=dtype).to(self.device))
        upload.Upload.read = read
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = load_shard(ckpt, spec, 0, tp, dtype=torch.bfloat16, device="cuda", keep_quantised=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    finally:
        upload.Upload.read = saved
        os.environ.pop(upload.ENV, None)
        os.environ.pop(upload.READERS_ENV, None)
    n = sum(nbytes(t) for t in out.values())
    del out
    torch.cuda.empty_cache()
    return dt, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="27b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dir", required=True, help="the checkpoint (written there if it holds no config.json)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from ranks.random_checkpoint import write_random_checkpoint
    from ranks.weights import Checkpoint
    from runtime.config import load_spec
    if not os.path.isfile(os.path.join(args.dir, "config.json")):
        t0 = time.perf_counter()
        res = write_random_checkpoint(args.dir, args.model, seed=0, dtype="bfloat16", num_layers=args.layers)
        print(f"wrote {res.num_bytes / 2**30:.2f} GiB to {args.dir} in {time.perf_counter() - t0:.1f} s", flush=True)
    spec = load_spec(args.dir)
    ckpt = Checkpoint(args.dir)
    files = sorted({info.file for info in ckpt.tensors.values()})
    from ranks.upload import READERS
    read_floor(files, READERS)                                    # into the page cache
    rd1, rd, h2d = read_floor(files, 1), read_floor(files, READERS), h2d_floor()
    floor = min(rd, h2d)
    props = torch.cuda.get_device_properties(0)
    commit = os.environ.get("TANDEM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=repo_root, capture_output=True, text=True).stdout.strip() or None
    print(f"device {props.name}; {len(files)} files; page-cache read {rd1 / 2**30:.2f} GiB/s (one thread), "
          f"{rd / 2**30:.2f} GiB/s ({READERS} threads); pinned host-to-device {h2d / 2**30:.2f} GiB/s; floor: "
          f"the lower of the last two", flush=True)
    rows = []
    for rep in range(args.reps):
        for tp in args.tp:
            for variant in args.variants:
                dt, n = load_once(ckpt, spec, tp, variant)
                rows.append(dict(rep=rep, tp=tp, variant=variant, seconds=dt, bytes=n, Bps=n / dt, of_floor=n / dt / floor))
                print(f"rep {rep} tp {tp} {variant:9s} {n / 2**30:6.2f} GiB {dt:7.2f} s {n / dt / 2**30:6.2f} GiB/s "
                      f"{n / dt / floor:6.1%} of floor", flush=True)
    print("\nvariant    tp  GiB/s (best)  of floor  seconds (best)")
    for tp in args.tp:
        for variant in args.variants:
            sel = [r for r in rows if r["tp"] == tp and r["variant"] == variant]
            b = max(sel, key=lambda r: r["Bps"])
            print(f"{variant:9s} {tp:3d}  {b['Bps'] / 2**30:12.2f}  {b['of_floor']:8.1%}  {b['seconds']:14.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, layers=spec.num_layers, device=props.name, commit=commit,
                           date=time.strftime("%Y-%m-%d"), files=len(files), read1_Bps=rd1, read_Bps=rd,
                           readers=READERS, h2d_Bps=h2d,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
