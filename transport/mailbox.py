"""The mailbox: all-reduce and all-gather between rank processes through one shared-memory segment.

Layout (defined here once; the GPU flavor registers the same segment as pinned host memory):

    header   64 bytes: magic u64 | version u32 | tp u32 | words per slot u64 | hang word u64 | pad
    payload  for rank r in [0, tp), slot s in {0, 1}: `words` little-endian u64 words at
             HEADER_BYTES + ((r * 2 + s) * words) * 8

Every payload word carries 4 data bytes (a float32) in its low half and the 4-byte epoch of the
exchange that wrote it in its high half, so a reader knows a word is current by looking at the word
itself: no flags, no fences, no reset between uses. Exchange e writes slot e % 2; a rank can only
reach exchange e + 2 (the same slot again) after every peer has finished e + 1, hence after every
peer has finished reading e. Epochs grow monotonically (32 bits; 0 is never used) and wrap from
2**32 - 2 to 1 (an even period, so slots keep alternating); each rank clears its stale words then.

Sums are float32 in rank order 0, 1, ..., N-1 on every rank, so every rank holds bit-identical
results. A rank that waits longer than `timeout_s` for a peer sets the sticky hang word and raises
MailboxHang naming the peer it waited for; the others see the hang word and fail at once.
"""

from __future__ import annotations

import logging
import struct
import time
from multiprocessing import resource_tracker, shared_memory

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAGIC = 0x7461_6E64_656D_4D42          # "tandemMB"
VERSION = 1
HEADER_BYTES = 64
_HANG_OFFSET = 24


class MailboxHang(RuntimeError):
    """A peer did not arrive in time (or another rank reported a hang)."""


def segment_bytes(tp: int, words: int) -> int:
    return HEADER_BYTES + tp * 2 * words * 8


def create_segment(tp: int, words: int, name: str | None = None) -> shared_memory.SharedMemory:
    """Create and initialise the segment (the coordinator owns it and unlinks it at shutdown)."""
    shm = shared_memory.SharedMemory(name=name, create=True, size=segment_bytes(tp, words))
    shm.buf[:HEADER_BYTES] = b"\0" * HEADER_BYTES
    struct.pack_into("<QIIQ", shm.buf, 0, MAGIC, VERSION, tp, words)
    np.ndarray((tp * 2 * words,), dtype=np.uint64, buffer=shm.buf, offset=HEADER_BYTES)[:] = 0
    return shm


class Mailbox:
    """One rank's view of the segment (CPU flavor: numpy polling with backoff)."""

    def __init__(self, name: str, rank: int, timeout_s: float = 60.0):
        self.shm = shared_memory.SharedMemory(name=name, create=False)
        # Attaching must not make this process's resource tracker unlink the segment at exit.
        try:
            resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:  # pragma: no cover - tracker details differ across Python versions
            pass
        magic, version, tp, words = struct.unpack_from("<QIIQ", self.shm.buf, 0)
        if magic != MAGIC or version != VERSION:
            raise RuntimeError(f"shared memory {name!r} is not a tandem mailbox (magic {magic:#x}, version {version})")
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} outside the mailbox's {tp} ranks")
        self.name, self.rank, self.tp, self.words, self.timeout_s = name, rank, tp, words, timeout_s
        self.slots = np.ndarray((tp, 2, words), dtype=np.uint64, buffer=self.shm.buf, offset=HEADER_BYTES)
        self.hang = np.ndarray((1,), dtype=np.uint64, buffer=self.shm.buf, offset=_HANG_OFFSET)
        self.epoch = 0

    def close(self) -> None:
        self.slots = self.hang = None  # type: ignore[assignment]
        self.shm.close()

    # ----------------------------------------------------------------------------------------------

    def exchange(self, x: np.ndarray) -> np.ndarray:
        """Every rank's float32 vector: x [n] from each rank -> [tp, n] (row r is rank r's x)."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        out = np.empty((self.tp, x.size), dtype=np.float32)
        for at in range(0, max(x.size, 1), self.words):
            piece = x[at:at + self.words]
            out[:, at:at + piece.size] = self._exchange_piece(piece)
        return out

    def all_reduce(self, t: "torch.Tensor") -> "torch.Tensor":
        """Sum of `t` over ranks: float32 in rank order, one cast back to t's dtype."""
        if self.tp == 1:
            return t
        parts = self.exchange(t.detach().float().cpu().numpy())
        total = parts[0].copy()
        for r in range(1, self.tp):
            total += parts[r]
        import torch
        return torch.from_numpy(total).view(t.shape).to(dtype=t.dtype, device=t.device)

    def all_gather(self, t: "torch.Tensor") -> "torch.Tensor":
        """[tp, *t.shape] float32: every rank's tensor (exact; used for sampling candidates)."""
        import torch
        return torch.from_numpy(self.exchange(t.detach().float().cpu().numpy())).view(self.tp, *t.shape)

    def barrier(self) -> None:
        self.exchange(np.zeros(1, dtype=np.float32))

    # ----------------------------------------------------------------------------------------------

    def _exchange_piece(self, x: np.ndarray) -> np.ndarray:
        # 1 .. 2**32 - 2: an even count, so the slots keep alternating across the wrap (2**32 - 1 -> 1 would
        # write slot 1 twice in a row while a slow peer may still be reading it)
        self.epoch = self.epoch % 0xFFFF_FFFE + 1
        e = np.uint64(self.epoch)
        slot = self.epoch % 2
        n = x.size
        if self.epoch <= 2:
            # first use of this slot, or first use after a wrap: words that no exchange has overwritten since
            # the last pass still carry this epoch; clear them (every peer is done with this slot's last data)
            self.slots[self.rank, slot, :] = 0
        self.slots[self.rank, slot, :n] = (e << np.uint64(32)) | x.view(np.uint32).astype(np.uint64)
        out = np.empty((self.tp, n), dtype=np.float32)
        out[self.rank] = x
        for peer in range(self.tp):
            if peer != self.rank:
                out[peer] = self._wait(peer, slot, n, e)
        return out

    def _wait(self, peer: int, slot: int, n: int, e: np.uint64) -> np.ndarray:
        deadline, spins, pause = None, 0, 0.0
        view = self.slots[peer, slot, :n]
        while True:
            words = view.copy()
            if (words >> np.uint64(32) == e).all():
                return (words & np.uint64(0xFFFF_FFFF)).astype(np.uint32).view(np.float32)
            if self.hang[0]:
                raise MailboxHang(f"rank {self.rank}: rank {int(self.hang[0]) - 1} reported a mailbox hang")
            spins += 1
            if spins < 64:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline, yield_until = now + self.timeout_s, now + 2e-3
            elif now > deadline:
                self.hang[0] = np.uint64(self.rank + 1)
                raise MailboxHang(f"rank {self.rank} waited {self.timeout_s:.1f} s for rank {peer} at "
                                  f"exchange {int(e)}; rank {peer} did not arrive")
            if now < yield_until:
                time.sleep(0)              # first 2 ms: give the core away but come straight back
                continue
            pause = min(max(pause * 2, 20e-6), 1e-3)
            time.sleep(pause)
