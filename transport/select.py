"""Choosing a rank's all-reduce for tensor parallelism on GPUs.

    mailbox  the GPU mailbox (transport/mailbox_cuda.py): an exchange kernel over pinned host memory,
             inside captured CUDA graphs; needs no peer-to-peer
    copies   staged copies through pinned host buffers and the CPU mailbox (transport/copies.py):
             not capturable (decode runs eagerly), works wherever pinned memory does
    nccl     torch.distributed / NCCL (transport/nccl.py): for boxes with P2P / NVLink
    cpu      the CPU mailbox on host copies of the tensor (the reference backend's transport)
    auto     mailbox, unless it cannot be set up on some rank or a captured 4 KiB exchange takes
             longer than PROBE_LIMIT_US on average, then copies

Every rank takes the same decision: construction success and probe times are exchanged over the
CPU mailbox before anyone commits.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

# a captured 4 KiB exchange slower than this (mean over ranks) sends auto to staged copies; the
# environment variable exists to exercise the fallback on machines where the mailbox is fast
PROBE_LIMIT_US = float(os.environ.get("TANDEM_MAILBOX_PROBE_LIMIT_US", "50"))


@dataclass
class Transport:
    name: str
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    capturable: bool                               # may run inside a captured CUDA graph
    check: Callable[[], None] = lambda: None       # raise MailboxHang if a rank reported a hang
    close: Callable[[], None] = lambda: None
    probe_us: float | None = None
    notes: dict = field(default_factory=dict)


def choose(kind: str, rank: int, tp: int, device: int, cpu_mailbox, gpu_mailbox: str | None,
           nccl_init: str | None, timeout_s: float = 60.0) -> Transport:
    """The all-reduce rank `rank` uses (collective: every rank calls it with the same kind)."""
    if tp == 1:
        return Transport("none", lambda t: t, True)
    if os.environ.get("TANDEM_BENCH_SKIP_ALLREDUCE") == "1":
        # benchmarks only (scripts/bench/decode_tp.py --share): every rank keeps its partial sums, so
        # outputs are wrong; the step time without exchanges gives the all-reduce share of a step
        log.warning("rank %d: TANDEM_BENCH_SKIP_ALLREDUCE=1: all-reduces are skipped, outputs are wrong", rank)
        return Transport("skip", lambda t: t, True)
    if kind == "cpu":
        return Transport("cpu", cpu_mailbox.all_reduce, False)
    if kind == "nccl":
        from transport.nccl import NcclAllReduce
        nc = NcclAllReduce(rank, tp, nccl_init, device=device, timeout_s=max(timeout_s, 60.0))
        nc.warm_up()
        return Transport("nccl", nc.all_reduce, True, close=nc.close)
    if kind not in ("auto", "mailbox", "copies"):
        raise ValueError(f"unknown transport {kind!r}: choose auto, mailbox, copies, nccl or cpu")
    if gpu_mailbox is None:
        raise ValueError(f"transport {kind!r} needs the GPU mailbox segment (the coordinator makes one for "
                         "--device cuda with tp > 1)")
    if kind == "copies":
        return _copies(rank, device, gpu_mailbox, timeout_s)
    # mailbox / auto: (1) every rank sets the mailbox up and the ranks vote, (2) only if all succeeded
    # the collective probe runs and the ranks vote on its time. A rank never waits in an exchange
    # for a peer that has no mailbox.
    mb, err = None, None
    try:
        from transport.mailbox_cuda import CudaMailbox
        mb = CudaMailbox(gpu_mailbox, rank, device=device, timeout_s=timeout_s)
    except Exception as e:                         # noqa: BLE001 - reported, and the ranks agree below
        err = f"{type(e).__name__}: {e}"
        log.warning("rank %d: GPU mailbox unavailable: %s", rank, err)
    try:
        all_ok = bool(cpu_mailbox.exchange(np.array([0.0 if err else 1.0], dtype=np.float32)).min() > 0.5)
        mean_us = float("inf")
        if all_ok:
            try:
                us = mb.probe()
            except Exception as e:                 # noqa: BLE001 - a failed probe counts as unusable
                err, us = f"probe: {type(e).__name__}: {e}", -1.0
            times = cpu_mailbox.exchange(np.array([us], dtype=np.float32))[:, 0]
            all_ok = bool(times.min() >= 0)
            mean_us = float(times.mean()) if all_ok else float("inf")
    except BaseException:
        if mb is not None:
            mb.close()
        raise
    if kind == "mailbox" and not all_ok:
        if mb is not None:
            mb.close()
        raise RuntimeError(f"--transport mailbox: the GPU mailbox could not be set up on every rank "
                           f"(this rank: {err or 'ok'})")
    if all_ok and (kind == "mailbox" or mean_us <= PROBE_LIMIT_US):
        log.info("rank %d: GPU mailbox, %.1f us per captured 4 KiB exchange", rank, mean_us)
        return Transport("mailbox", mb.all_reduce, True, check=mb.check, close=mb.close, probe_us=mean_us)
    if mb is not None:
        mb.close()
    log.warning("rank %d: falling back to staged copies (mailbox %s, probe %.1f us)", rank,
                "ok" if all_ok else "unavailable", mean_us)
    t = _copies(rank, device, gpu_mailbox, timeout_s)
    t.probe_us = mean_us if all_ok else None
    # a probe that timed out left the segment's sticky hang word set: clear it (every rank is past
    # the GPU exchanges now) and let every rank see the cleared word before the first copy exchange
    if rank == 0:
        t.notes["segment"].hang[0] = 0
    cpu_mailbox.barrier()
    return t


def _copies(rank: int, device: int, name: str, timeout_s: float) -> Transport:
    from transport.copies import StagedCopies
    sc = StagedCopies(name, rank, device=device, timeout_s=timeout_s)
    return Transport("copies", sc.all_reduce, False, close=sc.close, notes=dict(segment=sc.mb))
