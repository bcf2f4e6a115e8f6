"""Staged copies: the all-reduce fallback for CUDA tensors when the GPU mailbox cannot be used.

The partial goes device -> pinned host buffer (float32), the stream is synchronised, the CPU mailbox
(transport/mailbox.py: same segment layout, same word format, float32 rank-order sums) exchanges it, and
the sum goes host -> device with one rounding to the tensor's dtype. Every call synchronises the
stream, so nothing here can be captured in a CUDA graph; results are bit-identical to the GPU mailbox's.
"""

from __future__ import annotations

import numpy as np
import torch

from transport.mailbox import Mailbox


class StagedCopies:
    """One rank's staged all-reduce / all-gather over the segment `name` (CPU mailbox epochs)."""

    def __init__(self, name: str, rank: int, device: int | None = None, timeout_s: float = 60.0, epoch: int = 0):
        self.mb = Mailbox(name, rank, timeout_s)
        self.mb.epoch = epoch
        self.rank, self.tp, self.words = rank, self.mb.tp, self.mb.words
        self.device = torch.cuda.current_device() if device is None else int(device)
        self._down = self._up = None          # pinned float32 staging buffers, grown on demand
        self._up_done = None                  # the last host -> device copy out of _up

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._down is None or self._down.numel() < n:
            if self._up_done is not None:
                self._up_done.synchronize()
            size = max(n, 1024)
            self._down = torch.empty(size, dtype=torch.float32, pin_memory=True)
            self._up = torch.empty(size, dtype=torch.float32, pin_memory=True)
        return self._down[:n], self._up[:n]

    def _stage(self, t: torch.Tensor) -> np.ndarray:
        if t.device.type != "cuda" or t.device.index != self.device:
            raise ValueError(f"expected a tensor on cuda:{self.device}, got {t.device}")
        if t.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype {t.dtype}, expected bfloat16 or float32")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("staged copies synchronise the stream and cannot be captured in a CUDA graph")
        down, _ = self._buffers(t.numel())
        down.copy_(t.reshape(-1).float(), non_blocking=True)      # convert on the device, then one D2H copy
        torch.cuda.current_stream(self.device).synchronize()
        return down.numpy()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t <- sum over ranks (float32 in rank order, one rounding to t's dtype); in place, returns t."""
        if self.tp == 1 or t.numel() == 0:
            return t
        if not t.is_contiguous():
            raise ValueError(f"must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
        parts = self.mb.exchange(self._stage(t))
        _, up = self._buffers(t.numel())
        if self._up_done is not None:
            self._up_done.synchronize()          # the last upload out of `up` has finished
        total = up.numpy()
        np.copyto(total, parts[0])
        for r in range(1, self.tp):
            total += parts[r]
        t.view(-1).copy_(up.to(t.device, non_blocking=True))     # one H2D copy, then round on the device
        self._up_done = torch.cuda.Event()
        self._up_done.record(torch.cuda.current_stream(self.device))
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[tp, *t.shape] float32 on t's device: row r is rank r's t."""
        parts = self.mb.exchange(self._stage(t))
        return torch.from_numpy(parts).to(t.device).view(self.tp, *t.shape)

    def close(self) -> None:
        if self._up_done is not None:
            self._up_done.synchronize()
        self.mb.close()
