"""Checkpoint tensors onto a rank's device through pinned staging, with the load's progress.

    with Upload("cuda:0", total=shard_bytes, report=send_progress) as up:
        w = up.read(ckpt, "layers.0.mlp.down_proj.weight", (slice(None), slice(0, 8704)), torch.bfloat16)
        q = up.put(quant_weight_on_the_cpu)

On a CUDA device the bytes go through two pinned host slabs in turn: the host fills one while the
copy engine moves the other to the device (an asynchronous copy on the current stream, whose event
says when that slab may be filled again), so reading the file and the transfer overlap. A tensor, or a
slice of one that is a single byte range of its file (the whole tensor, or rows of it), is read
straight from the file into the slabs (`os.preadv`: the page cache, or the disk, to pinned memory in
one copy; READERS threads each read a part of a slab's piece, since one core copies from the page
cache at only ~5 GiB/s), then converted to the wanted dtype on the device where the file stores
another float type. A column slice (the row-parallel weights of tp > 1) reads its rows whole where
they are at most MAX_OVERREAD times its bytes (tp <= 4) and is cut on the device; other slices come
through the safetensors reader and are staged the same way. Tensors larger than a slab go in slab-sized pieces. Before
this, every tensor went through the safetensors reader (one copy), was copied again where its file
offset was not 64-byte aligned, and went to the device by a synchronous pageable copy (the driver's
own staging); docs/perf.md has the measurement (scripts/bench/load.py). TANDEM_PINNED_UPLOAD=0
restores that path but for the aligning copy, TANDEM_UPLOAD_READERS=N sets the reading threads
(comparison switches). A CPU "device" reads as before (Checkpoint.read) and only counts.

Progress: every tensor read or put adds its bytes (on the device, after any conversion); `report(done,
total)` is called at most every REPORT_S seconds and once from close(). close() waits for the last
copies, so every tensor returned is complete once the `with` block ends.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from kernels.quant import QuantWeight
from ranks.weights import _DTYPES, Checkpoint, CheckpointError

log = logging.getLogger(__name__)

SLAB_BYTES = 64 * 2**20          # per slab; two slabs: 128 MiB of pinned memory per rank while loading
REPORT_S = 0.5
ENV = "TANDEM_PINNED_UPLOAD"
READERS_ENV = "TANDEM_UPLOAD_READERS"
READERS = 4                      # threads reading one slab's piece of a file (os.preadv releases the GIL)
MIN_SPLIT = 4 * 2**20            # pieces smaller than this are read by one thread
MAX_OVERREAD = 4                 # a column slice reads its whole rows when they are at most 4x its bytes


def pinned_upload_enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def nbytes(t: torch.Tensor | QuantWeight) -> int:
    return t.nbytes() if isinstance(t, QuantWeight) else t.numel() * t.element_size()


class Upload:
    """Tensors to `device` (see the module docstring); use as a context manager, or call close()."""

    def __init__(self, device: str | torch.device, *, total: int = 0,
                 report: Callable[[int, int], None] | None = None, slab_bytes: int | None = None,
                 staged: bool | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.staged = self.cuda and (pinned_upload_enabled() if staged is None else staged)
        self.total, self.done = int(total), 0
        self._report, self._last = report, 0.0
        self._fds: dict[str, int] = {}
        self.readers = max(1, int(os.environ.get(READERS_ENV, READERS)))
        self._pool = None
        self._slabs: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._next = 0
        self.t0 = time.monotonic()
        if self.staged:
            try:
                with torch.cuda.device(self.device):
                    for _ in range(2):
                        self._slabs.append(torch.empty(slab_bytes or SLAB_BYTES, dtype=torch.uint8, pin_memory=True))
                        self._events.append(torch.cuda.Event())
                        self._events[-1].record()             # "free" until a copy is recorded after it
            except RuntimeError as e:                         # no pinned memory to be had: the plain copies
                log.warning("pinned staging unavailable (%s); loading through pageable copies", e)
                self._slabs.clear()
                self._events.clear()
                self.staged = False

    # ----------------------------------------------------------------------------------------------

    def read(self, ckpt: Checkpoint, name: str, index: tuple = (), dtype: torch.dtype | None = None) -> torch.Tensor:
        """Checkpoint.read(name, index=index, dtype=dtype) on this device."""
        index = tuple(index)
        if not isinstance(ckpt, Checkpoint):           # a stand-in that makes its tensors (random weights)
            return self.put(ckpt.read(name, index=index or None, dtype=dtype))
        if not self.staged:
            t = ckpt.read(name, index=index or None, dtype=dtype, align=not self.cuda)
            return self._count(t if not self.cuda else t.to(self.device))
        span = _byte_span(ckpt, name, index, dtype, MAX_OVERREAD)
        if span is None:
            return self._count(self._stage(ckpt.read(name, index=index or None, dtype=dtype, align=False)))
        path, offset, shape, stored, rest = span
        dst = torch.empty(shape, dtype=stored, device=self.device)
        try:
            self._fill(dst, lambda buf, at: self._pread(self._fd(path), buf, offset + at))
        except OSError as e:
            raise CheckpointError(f"{path}: tensor {ckpt.tensors[name].key!r}: cannot read: {e}") from e
        if rest is not None:                         # the columns of the rows read: sliced here
            dst = dst[rest].contiguous()
        if dtype is not None and dtype != stored:
            dst = dst.to(dtype)
        return self._count(dst)

    def put(self, t: torch.Tensor | QuantWeight) -> torch.Tensor | QuantWeight:
        """A CPU tensor (or QuantWeight) on this device."""
        if isinstance(t, QuantWeight):
            if not self.cuda or not self.staged:
                return self._count(t.to(self.device))
            gs = None if t.global_scale is None else self._stage(t.global_scale)
            return self._count(QuantWeight(t.kind, t.out_features, t.in_features, self._stage(t.data),
                                           self._stage(t.scale), gs))
        if t.device == self.device:
            return self._count(t)
        return self._count(self._stage(t) if self.staged else t.to(self.device))

    def close(self, report: bool = True) -> None:
        """Wait for the copies, release the staging memory and the files, report the final count."""
        error = None
        if self._slabs:
            try:
                torch.cuda.current_stream(self.device).synchronize()
            except RuntimeError as e:             # raised after the files and threads are released
                error = e
            self._slabs.clear()
            self._events.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if error is not None:
            raise error
        if not report:
            return
        if self._report is not None:
            self._report(self.done, max(self.total, self.done))
        dt = time.monotonic() - self.t0
        log.info("%.2f GiB to %s in %.1f s (%.2f GiB/s, %s)", self.done / 2**30, self.device, dt,
                 self.done / 2**30 / max(dt, 1e-9), "pinned staging" if self.staged else "direct")

    def __enter__(self) -> "Upload":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
            return
        try:                                   # a failed load: release what is held, keep its error
            self.close(report=False)
        except Exception:                      # noqa: BLE001 - e.g. the CUDA error that failed the load
            pass

    # ----------------------------------------------------------------------------------------------

    def _count(self, t):
        self.done += nbytes(t)
        if self._report is not None:
            now = time.monotonic()
            if now - self._last >= REPORT_S:
                self._last = now
                self._report(self.done, max(self.total, self.done))
        return t

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _pread(self, fd: int, buf: torch.Tensor, offset: int) -> None:
        """buf's bytes from the file at offset, in `readers` parts read at once (one core copies from the
        page cache at ~5 GiB/s, under a tenth of the host-to-device copy)."""
        n = buf.numel()
        if self.readers == 1 or n < MIN_SPLIT:
            _pread(fd, buf, offset)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="upload-read")
        part = ((n + self.readers - 1) // self.readers + 4095) // 4096 * 4096      # whole pages
        jobs = [self._pool.submit(_pread, fd, buf[a:a + part], offset + a) for a in range(0, n, part)]
        for j in jobs:
            j.result()

    def _stage(self, src: torch.Tensor) -> torch.Tensor:
        """A CPU tensor's copy on the device through the slabs."""
        src = src.contiguous()
        dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        flat = src.reshape(-1).view(torch.uint8) if src.numel() else src
        self._fill(dst, lambda buf, at: buf.copy_(flat[at:at + buf.numel()]))
        return dst

    def _fill(self, dst: torch.Tensor, fill: Callable[[torch.Tensor, int], None]) -> None:
        """dst's bytes, slab-sized piece by piece: fill(slab_view, byte_offset) writes the piece into the
        slab, then it goes to the device asynchronously while the next piece fills the other slab."""
        n = dst.numel() * dst.element_size()
        if n == 0:
            return
        out = dst.reshape(-1).view(torch.uint8)
        slab_bytes = self._slabs[0].numel()
        stream = torch.cuda.current_stream(self.device)
        at = 0
        while at < n:
            k = min(n - at, slab_bytes)
            i = self._next
            self._next = 1 - i
            self._events[i].synchronize()          # the slab's last copy has left it
            buf = self._slabs[i][:k]
            fill(buf, at)
            out[at:at + k].copy_(buf, non_blocking=True)
            self._events[i].record(stream)
            at += k


def _pread(fd: int, buf: torch.Tensor, offset: int) -> None:
    """Fill buf (a CPU uint8 tensor) with the file's bytes from offset."""
    view = memoryview(buf.numpy()).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(f"short read at byte {offset + got}")
        got += n


def _byte_span(ckpt: Checkpoint, name: str, index: tuple, dtype: torch.dtype | None, overread: int = 1):
    """How to read the slice `index` of tensor `name` as one byte range of its file, where it needs at
    most a float-to-float conversion: (file, byte offset, shape of the range, stored dtype, the index
    that leaves the slice of the range or None). A slice of later axes (columns: a row-parallel weight
    at tp > 1) reads its whole rows when they are at most `overread` times its bytes, and is cut on the
    device; else None (the reader's strided copy)."""
    info = ckpt.tensors.get(name)
    if info is None or info.offset == 0:
        return None
    stored, size = _DTYPES[info.dtype]
    if dtype is not None and dtype != stored and not (dtype.is_floating_point and info.dtype in ("F32", "F16", "BF16")):
        return None
    shape = list(info.shape)
    if len(index) > len(shape):
        return None
    r0, rest, kept = 0, [slice(None)], 1             # kept: the slice's share of the rows read
    for axis, s in enumerate(index):
        if s is None:
            if axis:
                rest.append(slice(None))
            continue
        if not isinstance(s, slice):
            return None
        lo, hi, step = s.indices(shape[axis])
        if step != 1 or hi < lo:
            return None
        if axis == 0:
            r0, shape[0] = lo, hi - lo
            continue
        rest.append(slice(lo, hi))
        if (lo, hi) != (0, shape[axis]):
            kept *= (hi - lo) / shape[axis] if shape[axis] else 1
    if kept * overread < 1:
        return None
    row = size
    for d in info.shape[1:]:
        row *= d
    cut = tuple(rest) if kept < 1 else None
    return info.file, info.offset + r0 * row, tuple(shape), stored, cut
