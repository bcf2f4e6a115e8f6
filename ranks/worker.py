"""Rank process: holds one weight shard and its state, executes StepPlans, reports StepResults.

    python -m ranks.worker --connect ipc:///tmp/tandem-XXXX/ctl --rank R

The rank connects a DEALER socket to the coordinator's ROUTER, says it is alive, receives Hello
(what to load), answers Ready, then executes plans in order. Rank 0 reports sampled tokens; every
rank stays in lockstep through the mailbox exchanges inside the forward. A failure is reported as
an Error message (step id and reason) before the process exits non-zero. A heartbeat thread with
its own socket reports liveness and ends the process if the coordinator's process goes away, so no
rank outlives its coordinator.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch
import zmq

from ranks.kvcache import ModelState
from ranks.model import Batch, HybridModel
from ranks.sampler import SeqSampler, sample_rows
from ranks.sharding import load_shard
from ranks.weights import Checkpoint, validate
from runtime.config import load_spec
from transport import control as msg
from transport.mailbox import Mailbox

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, hello: msg.Hello):
        self.rank, self.tp = hello.rank, hello.tp
        torch.set_num_threads(max(1, int(hello.options.get("threads_per_rank", 1))))
        self.spec = load_spec(hello.model_dir)
        ckpt = Checkpoint(hello.model_dir)
        layout = validate(ckpt, self.spec)
        dtype = getattr(torch, hello.dtype)
        # "cuda" means one device per rank: rank r uses the r-th visible GPU
        device = f"cuda:{self.rank}" if hello.device == "cuda" else hello.device
        weights = load_shard(ckpt, self.spec, self.rank, self.tp, dtype=dtype, device=device, layout=layout)
        self.mailbox = Mailbox(hello.mailbox, self.rank, timeout_s=float(hello.options.get("mailbox_timeout_s", 60)))
        self.model = HybridModel(self.spec, weights, tp=self.tp, all_reduce=self.mailbox.all_reduce)
        self.state: ModelState = self.model.new_state(hello.num_slots, hello.num_pages)
        self.samplers: dict[int, SeqSampler] = {}
        self.weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    def ready(self) -> msg.Ready:
        shard = {k: list(self.model.w[k].shape) for k in ("embed_tokens.weight", "lm_head.weight")
                 if k in self.model.w}
        return msg.Ready(rank=self.rank, ok=True, pid=os.getpid(), shard=shard, weight_bytes=self.weight_bytes,
                         state_bytes=self.state.nbytes(), has_mtp=self.model.has_mtp)

    def step(self, plan: msg.StepPlan) -> msg.StepResult | None:
        t0 = time.perf_counter()
        for sid, fields in plan.new_sampling.items():
            self.samplers[int(sid)] = SeqSampler(**fields)
        seq_ids = plan.seq_ids.tolist()
        columns, starts = plan.columns.tolist(), plan.starts.tolist()
        tokens = plan.token_ids.astype(np.int64)
        at = 0
        for sid, c, s in zip(seq_ids, columns, starts):
            self.samplers[sid].observe(tokens[at:at + c].tolist(), s)
            at += c
        batch = Batch(torch.from_numpy(tokens), columns, starts, plan.slots.tolist(),
                      torch.from_numpy(plan.page_tables.astype(np.int32)))
        out = self.model.forward(batch, self.state, logits="last")
        rows = [b for b, flag in enumerate(plan.sample.tolist()) if flag]
        sampled: list[int] = []
        if rows:
            sampled = sample_rows(out.logits[rows].float(), [self.samplers[seq_ids[b]] for b in rows],
                                  [starts[b] + columns[b] for b in rows], rank=self.rank, tp=self.tp,
                                  gather=self.mailbox.all_gather, vocab=self.spec.vocab_size)
        for sid in plan.finished:
            self.samplers.pop(int(sid), None)
        if self.rank != 0:
            return None
        return msg.StepResult(step=plan.step, seq_ids=np.array([seq_ids[b] for b in rows], dtype=np.int64),
                              tokens=np.array(sampled, dtype=np.int64), elapsed_s=time.perf_counter() - t0)


def _heartbeat(ctx: zmq.Context, addr: str, rank: int, parent: int, stop: threading.Event,
               current_step: list[int]) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"hb{rank}".encode())
    sock.connect(addr)
    while not stop.wait(msg.HEARTBEAT_S):
        if os.getppid() != parent:                    # the coordinator died: do not outlive it
            os._exit(3)
        try:
            msg.send(sock, msg.Heartbeat(rank=rank, step=current_step[0]), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
    sock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ranks.worker")
    ap.add_argument("--connect", required=True, help="coordinator ROUTER address")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)           # Ctrl-C goes to the coordinator; it shuts us down

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.IDENTITY, f"rank{args.rank}".encode())
    sock.connect(args.connect)
    current_step = [-1]
    hb = threading.Thread(target=_heartbeat, args=(ctx, args.connect, args.rank, os.getppid(), stop, current_step),
                          daemon=True)
    hb.start()
    msg.send(sock, msg.Heartbeat(rank=args.rank))
    worker = None
    step = -1
    try:
        hello = _recv_until(sock, stop, msg.Hello)
        if hello is None:
            return 0
        if hello.version != msg.PROTOCOL_VERSION:
            raise msg.ProtocolError(f"coordinator speaks protocol {hello.version}, rank speaks {msg.PROTOCOL_VERSION}")
        try:
            worker = Worker(hello)
        except Exception as e:                                 # load failures are answers, not crashes
            msg.send(sock, msg.Ready(rank=args.rank, ok=False, error=f"{type(e).__name__}: {e}", pid=os.getpid()))
            return 2
        msg.send(sock, worker.ready())
        while not stop.is_set():
            m = _recv_until(sock, stop, (msg.StepPlan, msg.Cancel, msg.Shutdown))
            if m is None or isinstance(m, msg.Shutdown):
                break
            if isinstance(m, msg.Cancel):
                for sid in m.seq_ids:
                    worker.samplers.pop(int(sid), None)
                continue
            step = current_step[0] = m.step
            result = worker.step(m)
            if result is not None:
                msg.send(sock, result)
        return 0
    except Exception as e:
        log.error("rank %d failed at step %d: %s", args.rank, step, traceback.format_exc())
        try:
            msg.send(sock, msg.Error(rank=args.rank, step=step, reason=f"{type(e).__name__}: {e}"))
        except zmq.ZMQError:
            pass
        return 1
    finally:
        stop.set()
        if worker is not None:
            worker.mailbox.close()
        sock.close()
        ctx.term()


def _recv_until(sock, stop: threading.Event, kinds):
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            m = msg.recv(sock)
            if isinstance(m, kinds):
                return m
            raise msg.ProtocolError(f"unexpected {type(m).__name__}")
    return None


if __name__ == "__main__":
    sys.exit(main())
