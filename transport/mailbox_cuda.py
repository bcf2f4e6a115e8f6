"""The mailbox, GPU flavor: the segment of transport/mailbox.py registered as mapped pinned host memory,
exchanged by a kernel (kernels/cuda/exchange.cu) that writes its words and polls its peers' words.

Same layout, same word format for float32 payloads (float32 bits low, epoch high; bf16 payloads are
packed two elements to a word, which halves the PCIe traffic), same alternating slots, same sticky hang
word, same float32 rank-order sums; what differs is who keeps the epoch. Here it lives in device memory
(`state`, u32 [2]: last epoch used, a block counter) and the kernel advances it, so a captured CUDA graph
replays with fresh epochs and no host involvement. The host never knows the current epoch without a sync
(`epoch()` reads it). All ranks must start from the same epoch: `epoch=` names the last epoch used on
the segment (0 for a fresh one; a CPU Mailbox's `.epoch` when handing a segment over), and no exchange
may be in flight on the segment while a rank attaches. Do not interleave CPU and GPU flavors on one
segment without handing the epoch over.

    mb = CudaMailbox(name, rank, device=0, timeout_s=60.0)
    mb.all_reduce(x)          # in place, x bf16 or float32 CUDA [..]; capturable
    mb.all_gather(x)          # [tp, *x.shape] float32
    mb.synchronize()          # stream sync, then MailboxHang if any rank reported a hang

Payloads larger than a slot go in pieces of `piece_elements(words)` elements (twice that for bf16; one
epoch each).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from transport.mailbox import HEADER_BYTES, Mailbox, MailboxHang, segment_bytes

PERIOD = 0xFFFF_FFFE                 # epochs run 1 .. PERIOD, then wrap to 1 (as in the CPU flavor)
THREADS = 256                        # kernel block size (MB_THREADS in exchange.cu)
MAX_TP = 8                           # MB_MAX_TP in exchange.cu
BLOCKS_PER_SM = 2                    # grid cap: every block resident (the kernel allows 4 at 64 registers)
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 0x01, 0x02
PROBE_BYTES = 4096
# Kernel tuning flags (MB_FLAG_* in exchange.cu): 1 system fence after publishing, 2 only lane 0 of a warp
# polls the hang word (the other lanes rely on their own timeout). 2 was as fast as 0 or faster at every
# payload on two H200s, and keeps thousands of waiting threads off one host word; the fence was slower
# (docs/perf.md). TANDEM_MAILBOX_FLAGS overrides (benchmarks).
FLAGS = 2


def next_epoch(e: int) -> int:
    """The epoch of the exchange after one at epoch e (0: none yet)."""
    return e % PERIOD + 1


def piece_elements(words: int) -> int:
    """Elements per exchange for a slot of `words` words: one word per element, kept even when more than
    one fits so that every piece but the last starts 4-byte aligned."""
    if words < 1:
        raise ValueError(f"a slot needs at least one word, got {words}")
    return words if words == 1 else words & ~1


def pieces(n: int, words: int, packed: bool = False) -> list[tuple[int, int]]:
    """(start, count) of each exchange that carries n elements (none for n == 0); packed: bf16
    elements, two to a word."""
    step = piece_elements(words) * (2 if packed else 1)
    return [(at, min(step, n - at)) for at in range(0, n, step)]


def check_start_epoch(slots: np.ndarray, epoch: int) -> None:
    """Refuse a start epoch older than what the segment's words carry: such words would pass for current
    in a later exchange. A peer may already be one exchange ahead (it wrote epoch + 1), not more."""
    if not 0 <= epoch <= PERIOD:
        raise ValueError(f"epoch {epoch} outside 0 .. {PERIOD}")
    if epoch == 1 or epoch >= PERIOD - 2:
        return                                   # at the wrap: words of the last pass remain (the kernel clears them)
    newest = int((slots >> np.uint64(32)).max()) if slots.size else 0
    if newest > epoch + 1:
        raise ValueError(f"the segment holds words of epoch {newest}, after start epoch {epoch}: pass the "
                         f"last epoch used on it (a CPU Mailbox's .epoch)")


class CudaMailbox:
    """One rank's GPU view of the segment."""

    def __init__(self, name: str, rank: int, device: int | None = None, timeout_s: float = 60.0, epoch: int = 0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._mb = Mailbox(name, rank, timeout_s)        # attach, check magic/version/rank; CPU views
        self.name, self.rank, self.tp, self.words = name, rank, self._mb.tp, self._mb.words
        self.timeout_s = timeout_s
        try:
            if self.tp > MAX_TP:
                raise ValueError(f"the GPU mailbox supports up to {MAX_TP} ranks, the segment has {self.tp}")
            check_start_epoch(self._mb.slots, epoch)
        except BaseException:
            self._mb.close()
            raise
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.piece = piece_elements(self.words)
        self._host = self._ptr = 0
        try:
            import cupy
            from kernels import launch
            host = self._mb.slots.ctypes.data - HEADER_BYTES
            with cupy.cuda.Device(self.device):
                cupy.cuda.runtime.hostRegister(host, segment_bytes(self.tp, self.words),
                                               _HOST_REGISTER_MAPPED | _HOST_REGISTER_PORTABLE)
                self._host = host
                try:
                    self._ptr = int(cupy.cuda.runtime.pointerGetAttributes(host).devicePointer) or host
                except Exception:                        # measured: the host address is the device address
                    self._ptr = host
            self._kernel = launch.kernel
            self._launch = launch.launch
            self.max_blocks = BLOCKS_PER_SM * launch.sm_count(self.device)
            self.state = torch.tensor(np.array([epoch, 0], dtype=np.uint32).view(np.int32),
                                      device=f"cuda:{self.device}")
            self._timeout_ns = np.uint64(int(timeout_s * 1e9))
            self.flags = int(os.environ.get("TANDEM_MAILBOX_FLAGS", FLAGS))
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t <- sum over ranks (float32 in rank order, one rounding to t's dtype); in place, returns t.
        t: bf16 or float32, contiguous, on this mailbox's device. No host sync: capturable."""
        self._check(t, "all_reduce")
        if self.tp > 1:
            for at, n in pieces(t.numel(), self.words, packed=t.dtype == torch.bfloat16):
                self._exchange(t, at, n, t, at, gather=False, out_stride=0)
        return t

    def all_gather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[tp, *t.shape] float32: row r is rank r's t (exact for bf16 and float32 inputs)."""
        self._check(t, "all_gather")
        if out is None:
            out = torch.empty((self.tp, *t.shape), dtype=torch.float32, device=t.device)
        elif (out.dtype != torch.float32 or tuple(out.shape) != (self.tp, *t.shape) or not out.is_contiguous()
              or out.device != t.device):
            raise ValueError(f"all_gather: out must be contiguous float32 {(self.tp, *t.shape)} on {t.device}, "
                             f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        n = t.numel()
        if self.tp == 1:
            out[0].copy_(t)
            return out
        for at, k in pieces(n, self.words, packed=t.dtype == torch.bfloat16):
            self._exchange(t, at, k, out, at, gather=True, out_stride=n)
        return out

    def barrier(self) -> None:
        """One exchange of one element, then a stream sync (raises MailboxHang)."""
        self.all_reduce(torch.zeros(1, dtype=torch.float32, device=f"cuda:{self.device}"))
        self.synchronize()

    def hang(self) -> int:
        """The hang word as the host sees it: 0, or 1 + the rank that gave up waiting."""
        return int(self._mb.hang[0])

    def check(self) -> None:
        """Raise MailboxHang if any rank reported a hang (reads host memory; no sync)."""
        h = self.hang()
        if h:
            raise MailboxHang(f"rank {self.rank}: rank {h - 1} reported a mailbox hang")

    def synchronize(self) -> None:
        """Wait for this device's current stream, then check the hang word."""
        torch.cuda.current_stream(self.device).synchronize()
        self.check()

    def epoch(self) -> int:
        """The last epoch used (reads device memory: syncs)."""
        return int(self.state.cpu().numpy().view(np.uint32)[0])

    def probe(self, iters: int = 200, per_graph: int = 20) -> float:
        """Microseconds per 4 KiB bf16 all-reduce inside a captured CUDA graph (median of `iters` replays
        of `per_graph` exchanges). Collective: every rank calls it with the same arguments."""
        dev = f"cuda:{self.device}"
        x = torch.zeros(PROBE_BYTES // 2, dtype=torch.bfloat16, device=dev)
        with torch.cuda.device(self.device):
            self.all_reduce(x)                            # compile and warm up outside the capture
            self.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(per_graph):
                    self.all_reduce(x)
            g.replay()
            self.synchronize()
            start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            stop = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            for a, b in zip(start, stop):
                a.record()
                g.replay()
                b.record()
            self.synchronize()
        ms = sorted(a.elapsed_time(b) for a, b in zip(start, stop))
        return ms[len(ms) // 2] * 1e3 / per_graph

    def close(self) -> None:
        if self._mb is None:
            return
        if self._host:
            import cupy
            try:
                torch.cuda.synchronize(self.device)    # no kernel may touch the segment after this
            finally:
                with cupy.cuda.Device(self.device):
                    cupy.cuda.runtime.hostUnregister(self._host)
                self._host = 0
        self._mb.close()
        self._mb = None  # type: ignore[assignment]

    # ----------------------------------------------------------------------------------------------

    def _check(self, t: torch.Tensor, what: str) -> None:
        if self._mb is None:
            raise RuntimeError(f"{what}: the mailbox is closed")
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.device.index != self.device:
            raise ValueError(f"{what}: expected a tensor on cuda:{self.device}, got "
                             f"{getattr(t, 'device', type(t).__name__)}")
        if t.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{what}: dtype {t.dtype}, expected bfloat16 or float32")
        if not t.is_contiguous():
            raise ValueError(f"{what}: must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
        if not torch.cuda.is_current_stream_capturing():
            self.check()                                  # fail fast; inside a capture the host reads it later

    def _exchange(self, src: torch.Tensor, at: int, n: int, dst: torch.Tensor, dst_at: int, gather: bool,
                  out_stride: int) -> None:
        words = (n + 1) // 2 if src.dtype == torch.bfloat16 else n
        blocks = min(-(-((words + 1) // 2) // THREADS), self.max_blocks)
        args = (np.uint64(src.data_ptr() + at * src.element_size()),
                np.uint64(dst.data_ptr() + dst_at * dst.element_size()),
                np.uint64(self._ptr), self.state,
                np.int32(self.rank), np.int32(self.tp), np.int64(self.words), np.int32(n),
                np.int32(src.dtype == torch.float32), np.int32(dst.dtype == torch.float32),
                np.int32(gather), np.int64(out_stride), self._timeout_ns)
        fn = self._kernel("exchange", f"mailbox_exchange_f{self.flags & 3}", self.device)
        self._launch(fn, (blocks,), (THREADS,), args, device=self.device)
