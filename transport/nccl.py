"""The all-reduce through torch.distributed's NCCL backend (boxes with peer-to-peer, multi-node, benchmarks).

    comm = NcclAllReduce(rank, tp, "tcp://127.0.0.1:29512", device=rank)
    comm.all_reduce(x)        # in place, sum
    comm.all_gather(x)        # [tp, *x.shape] float32 (same contract as the mailbox)

Capturable in a CUDA graph under NCCL's rules: the communicator exists before the capture (`warm_up()`
runs one collective), every rank captures and replays the same sequence. NCCL chooses its own
summation order, so results are not bit-identical to the mailbox's float32 rank-order sums.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class NcclAllReduce:
    def __init__(self, rank: int, tp: int, init_method: str, device: int | None = None, timeout_s: float = 600.0):
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} outside 0 .. {tp - 1}")
        self.rank, self.tp = rank, tp
        self.device = rank if device is None else int(device)
        torch.cuda.set_device(self.device)
        kw = dict(backend="nccl", init_method=init_method, rank=rank, world_size=tp,
                  timeout=timedelta(seconds=timeout_s))
        try:
            dist.init_process_group(**kw, device_id=torch.device("cuda", self.device))
        except TypeError:                        # torch without device_id
            dist.init_process_group(**kw)
        self.group = dist.group.WORLD

    def warm_up(self) -> None:
        """One collective and a sync: creates the communicator (required before graph capture)."""
        x = torch.zeros(1, dtype=torch.float32, device=f"cuda:{self.device}")
        dist.all_reduce(x, group=self.group)
        torch.cuda.synchronize(self.device)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t <- sum over ranks, in place (t's dtype throughout); returns t."""
        if self.tp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[tp, *t.shape] float32: row r is rank r's t."""
        t = t.contiguous()
        out = torch.empty((self.tp, *t.shape), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t, group=self.group)
        return out if out.dtype == torch.float32 else out.float()

    def barrier(self) -> None:
        self.warm_up()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
