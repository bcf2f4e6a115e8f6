"""A whole greedy speculation round on the GPU: verification, acceptance, GDN commit and MTP drafting
as one program of device ops, captured as one CUDA graph per (batch, K, page bucket, stop width).

The eager round (ranks/worker.py, `Worker.spec_step`) brings the verification logits to the host,
accepts per sequence in Python, commits, then drafts K tokens with K MTP calls, each followed by a
host argmax exchange: a handful of host round trips and dozens of eager launches per round. For
greedy sequences none of that needs the host:

    verification forward (T = K+1 columns per sequence, per-column GDN states kept)
      -> head over every column -> argmax over this rank's vocabulary shard
      -> the ranks' candidates merged (one all-reduce of disjoint slots, ties to the lower id)
      -> a = longest prefix of drafts equal to the targets, cut at the first stop token
      -> GDN state and conv window of each slot <- those after column a (commit_rows)
      -> MTP pass over all T columns (ids = the targets: for columns <= a they are the accepted
         tokens shifted by one, then the correction); its output at column a drafts d1
      -> K-1 single MTP steps at positions start + a + 1 ... feeding back their own hidden
      -> [targets (T), a, drafts (K)] per sequence: the one copy the host waits for

Columns past `a` in the MTP pass write MTP KV at positions after the accepted ones; the drafting
steps and the next round rewrite those positions before any query reads them (as the verification's
rejected columns do for the main KV), so results equal the eager round's: the same targets and
accepted tokens bit for bit (the same head GEMV over the same rows), the same committed state, and
drafts that differ only where the MTP pass's column count changes a GEMV's summation order.

A round qualifies (`eligible`) when every sequence is greedy without penalties, banned ids or a
logit_bias, feeds one token plus its n <= K drafts (fewer near its token budget: padded to K + 1
columns, acceptance capped at n), and has pages for its last draft position; anything else (sampled,
penalised or biased sequences, prefill chunks, forced tokens) runs the eager round.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import torch

from ranks.model import Batch, commit_rows
from ranks.model_cuda import CudaHybridModel, DeviceBatch, pow2
from ranks.sampler import merge_slots
from runtime.config import PAGE_SIZE

Tensor = torch.Tensor

MAX_STOPS = 64          # stop ids per sequence a captured round carries (more: the eager round)


class GpuRounds:
    """Greedy speculation rounds of one rank, on device ops (graphed when the model has graphs)."""

    def __init__(self, model: CudaHybridModel, K: int, rank: int, tp: int, draft_rows: int | None = None):
        """draft_rows: the reduced proposal head, this rank's lm_head rows that drafts come from
        (`draft_head_rows` of the draft vocabulary bound); None = the whole head."""
        if not 1 <= K <= 15:
            raise ValueError(f"draft tokens {K} outside 1..15")
        self.model, self.K, self.rank, self.tp = model, K, rank, tp
        self.shard_rows = model.head.shape[0]
        self.draft_rows = draft_rows
        self._host: Tensor | None = None
        self.rounds = 0

    def pages(self, batch: Batch) -> int:
        """Page-table width of a round: covers the last draft position (start + 2K - 1), rounded up
        to a power of two like the step graphs."""
        return pow2(max(-(-(s + 2 * self.K) // PAGE_SIZE) for s in batch.starts))

    def eligible(self, batch: Batch, ndraft: Sequence[int], sample: Sequence[bool], greedy: Sequence[bool],
                 kv_tokens: Sequence[int], stops: Sequence[Sequence[int]]) -> bool:
        K = self.K
        return (all(0 <= n <= K and c == 1 + n for c, n in zip(batch.columns, ndraft)) and all(sample)
                and all(greedy) and all(len(s) <= MAX_STOPS for s in stops)
                # every draft position start + a + j (a <= K, j < K) has a page: the eager round's bound
                and all(st + 2 * K <= kv for st, kv in zip(batch.starts, kv_tokens))
                and batch.page_tables.shape[1] * PAGE_SIZE >= max(st + 2 * K for st in batch.starts))

    @torch.inference_mode()
    def run(self, batch: Batch, state, stops: Sequence[Sequence[int]], ndraft: Sequence[int] | None = None,
            mark: Callable[[str], None] | None = None) -> np.ndarray:
        """One round for every sequence of `batch` ([x, d1..dn] columns each, n = ndraft[b] <= K,
        K when not given); returns int64 [B, 2K + 2]: the target argmax after each column (T), the
        accepted draft count a (<= n), and the next round's K drafts. The tokens emitted are
        targets[:a + 1]. A sequence with fewer than K drafts (near its token budget, or none at all) is
        padded to K + 1 columns, its acceptance capped at n: the padding's KV and states sit past
        the accepted ones, where nothing reads them before they are rewritten. Collective across ranks.
        mark(label): diagnostics (the worker's StepProfiler), called once launched and once synchronised."""
        m, K = self.model, self.K
        B, T = len(batch.columns), K + 1
        n = [K] * B if ndraft is None else [int(v) for v in ndraft]
        if any(c != T for c in batch.columns):
            ids, at = np.zeros((B, T), dtype=np.int64), 0
            tok = batch.token_ids.numpy()
            for b, c in enumerate(batch.columns):
                ids[b, :c] = tok[at:at + c]
                at += c
            batch = Batch(torch.from_numpy(ids.reshape(-1)), [T] * B, batch.starts, batch.slots, batch.page_tables)
        P = self.pages(batch)
        S = max(1, pow2(max(len(s) for s in stops))) if any(stops) else 1
        stop_ids = np.full((B, S), -1, dtype=np.int32)
        for b, s in enumerate(stops):
            stop_ids[b, :len(s)] = list(s)
        words = DeviceBatch.words(B, B * T, P)

        extra = np.concatenate([stop_ids.reshape(-1), np.asarray(n, dtype=np.int32)])

        def upload(storage: Tensor | None) -> Tensor:
            return m.device_batch(batch, P, storage=storage, extra=extra).storage

        def program(storage: Tensor) -> Tensor:
            db = DeviceBatch.on(storage, B, B * T, P, P * PAGE_SIZE)
            return self.program(db, storage[words:words + B * S].view(B, S), state,
                                storage[words + B * S:words + B * S + B])

        with torch.cuda.device(m.device_index):
            out = None
            if m.graphs is not None:
                out = m.graphs.run_keyed(("spec-round", B, T, P, S, id(state)), state, words + B * S + B,
                                         upload, program)
            if out is None:
                out = program(upload(None))
            if self._host is None or self._host.numel() < out.numel():
                self._host = torch.empty(max(out.numel(), 256), dtype=torch.int32, pin_memory=True)
            host = self._host[:out.numel()]
            host.copy_(out.view(-1), non_blocking=True)
            if mark is not None:
                mark("launched")
            torch.cuda.current_stream().synchronize()
            if mark is not None:
                mark("synced")
        self.rounds += 1
        return host.numpy().astype(np.int64).reshape(B, 2 * K + 2)

    def program(self, db: DeviceBatch, stops: Tensor, state, ndraft: Tensor | None = None) -> Tensor:
        """The round's device ops (no host synchronisation: capturable). stops [B, S] int32, -1 pads;
        ndraft [B] int32: real drafts per sequence (acceptance is capped there; None = K)."""
        m, K = self.model, self.K
        B, T = db.B, K + 1
        dev = db.ids.device
        out = m.fast_forward(db, state, logits="all", keep_T=T)
        targets = self.argmax(out.logits).view(B, T)                                  # int64
        a = accepted_lengths(targets, db.ids.view(B, T)[:, 1:].long(), stops)
        if ndraft is not None:
            a = torch.minimum(a, ndraft.long())
        commit_rows(out.kept.batched, state, db.slots.long(), a)
        # MTP pass over the T columns: column t carries the token at position start + t + 1
        ids = targets.reshape(-1).to(torch.int32)
        mtp = m.fast_mtp(dataclasses.replace(db, ids=ids), out.hidden, state, logits="none").hidden
        h = mtp.index_select(0, torch.arange(B, device=dev) * T + a)                  # [B, E] at column a
        d = self.draft_argmax(h)
        proposed = [d]
        if K > 1:
            one = torch.arange(B, device=dev, dtype=torch.int32)
            last = db.positions.view(B, T)[:, 0] + a.to(torch.int32)                  # position of column a
            step = DeviceBatch(B, B, db.P, ids=d, positions=last, seq_of_col=one,
                               cu_seqlens=torch.arange(B + 1, device=dev, dtype=torch.int32), slots=db.slots,
                               fresh=torch.zeros_like(one), page_tables=db.page_tables, last_cols=one,
                               max_len=db.max_len, storage=db.storage)
            for j in range(1, K):
                step = dataclasses.replace(step, ids=d.to(torch.int32), positions=last + j)
                h = m.fast_mtp(step, h, state, logits="none").hidden
                d = self.draft_argmax(h)
                proposed.append(d)
        return torch.cat([targets, a[:, None], torch.stack(proposed, dim=1)], dim=1).to(torch.int32)

    def argmax(self, logits: Tensor) -> Tensor:
        """Argmax over the whole vocabulary of rows of vocabulary-shard logits [R, V/tp], ties to the
        lower id, as ranks.sampler.argmax_rows decides it. Returns int64 [R], the same on every rank."""
        if self.tp == 1:
            return torch.argmax(logits.float(), dim=-1)
        buf = shard_candidates(logits, self.rank, self.tp)
        return merge_candidates(self.model.all_reduce(buf.view(-1)).view(buf.shape))

    def draft_argmax(self, h: Tensor) -> Tensor:
        """The draft after MTP hidden rows h [R, E]: the argmax of the whole head, or of the reduced
        proposal head (this rank's rows below the draft vocabulary bound; a rank with none offers
        -FLT_MAX, which x + 0 keeps finite in the merge)."""
        m = self.model
        if self.draft_rows is None:
            return self.argmax(m.head_logits(h))
        if self.draft_rows:
            logits = m._linear(h, m.head[:self.draft_rows])
            if self.tp == 1:
                return torch.argmax(logits.float(), dim=-1)
            buf = shard_candidates(logits, self.rank, self.tp, offset=self.rank * self.shard_rows)
        else:
            buf = torch.zeros(self.tp, h.shape[0], 2, dtype=torch.float32, device=h.device)
            buf[self.rank, :, 0] = -torch.finfo(torch.float32).max
        return merge_candidates(m.all_reduce(buf.view(-1)).view(buf.shape))


def draft_head_rows(draft_vocab: int, rank: int, shard_rows: int) -> int | None:
    """Rows of this rank's vocabulary shard (ids rank * shard_rows ...) that the reduced proposal head
    keeps: those below draft_vocab; None = the whole head (draft_vocab 0). A byte-level BPE vocabulary
    numbers its tokens in merge order, which follows their frequency, so the low ids are the common
    tokens."""
    if draft_vocab < 0:
        raise ValueError(f"draft vocabulary {draft_vocab} must be >= 0 (0 = the whole head)")
    if draft_vocab == 0:
        return None
    return max(0, min(shard_rows, draft_vocab - rank * shard_rows))


def accepted_lengths(targets: Tensor, drafts: Tensor, stops: Tensor) -> Tensor:
    """Accepted draft count per sequence, on device ops: the longest prefix of drafts [B, K] equal to
    targets [B, K+1] (the target argmax after each column), cut before the first column whose target
    is a stop id (stops [B, S], -1 pads): the tokens emitted, targets[:a + 1], then end at that stop.
    The batched form of ranks.sampler.accept_greedy plus Worker.spec_step's stop cut."""
    K, T = drafts.shape[1], targets.shape[1]
    matched = (drafts == targets[:, :K]).int().cumprod(1).sum(1)                      # [B]
    is_stop = (targets[:, :, None] == stops.long()[:, None, :]).any(-1)              # [B, T]
    cols = torch.arange(T, device=targets.device)
    first_stop = torch.where(is_stop, cols[None, :], T).min(1).values
    return torch.minimum(matched, first_stop)


def shard_candidates(logits: Tensor, rank: int, tp: int, offset: int | None = None) -> Tensor:
    """This rank's argmax candidate per row, float32 (value, global id), in its own slot of an
    otherwise zero [tp, R, 2] buffer: an all-reduce (sum; x + 0 = x exactly, ids < 2^24 exact in
    float32) then gives every rank every rank's candidate. Values are float32 of the 16-bit logits,
    as the host sampler compares them. offset: the global id of row 0 (default rank * rows)."""
    x = logits.float()
    R, n = x.shape
    idx = torch.argmax(x, dim=-1)                           # the first maximum: the lower id
    buf = torch.zeros(tp, R, 2, dtype=torch.float32, device=x.device)
    buf[rank, :, 0] = x.gather(1, idx[:, None])[:, 0]
    buf[rank, :, 1] = (idx + (rank * n if offset is None else offset)).float()
    return buf


def merge_candidates(buf: Tensor) -> Tensor:
    """[tp, R, 2] candidates of every rank -> int64 [R]: the largest value, ties to the lower id."""
    return merge_slots(buf)[1].long()
