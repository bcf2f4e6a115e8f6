"""Messages between processes, defined once: typed records, msgpack on ZeroMQ.

Wire format: frame 0 is one byte (the message kind), frame 1 the msgpack body of the record's
fields, and any further frames are raw arrays (int32 / float32 numpy buffers) that the record names
in its body as ``{"__array__": i, "dtype": ..., "shape": ...}``, so large tables never go through
msgpack. Every Hello carries PROTOCOL_VERSION; a mismatch is refused at the handshake.

Records:
  Hello       coordinator -> rank   what to load and where to connect
  Ready       rank -> coordinator   shard shapes, memory, capacities (or the reason it failed)
  StepPlan    coordinator -> ranks  one step: per sequence its columns, positions, slot, pages
  StepResult  rank 0 -> coordinator sampled tokens (per sequence), timings
  Cancel      coordinator -> ranks  forget sequences' sampler state between steps
  Loading     rank -> coordinator   weight bytes loaded so far and the shard's total, while starting
  Heartbeat   rank -> coordinator   liveness, every HEARTBEAT_S
  Shutdown    coordinator -> ranks  exit cleanly
  Error       rank -> coordinator   the step id and the reason, sent before a rank exits on failure

Speculation (MTP drafts, Hello.options["spec_draft_tokens"] = K > 0): drafts live with the
coordinator. Rank 0 returns, with each sequence's accepted tokens, the K drafts the ranks' MTP
layer proposed for its next round (StepResult.drafts); the coordinator feeds them back as the last
columns of that sequence in the next StepPlan (StepPlan.drafts says how many of its columns are
drafts, fewer than K near max_new_tokens or the context limit, 0 while drafting is off for it).
Every rank verifies the same way (the exchanges give every rank the same candidates / logits and
the RNG is keyed by (seed, position, purpose)), so all ranks commit the same accepted length to
their GDN state without another message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

PROTOCOL_VERSION = 9     # 9: Loading (weight bytes loaded while a rank starts); 8: StepPlan.snapshot_saves entries carry the column count u (frontiers inside a prefill chunk); 7: prefix cache (StepPlan.snapshot_loads / snapshot_saves); 6: prompt logprobs (StepPlan.prompt_next, StepResult.prompt_logprobs); 5: StepResult.logprobs; 4: StepResult.fed (device-fed steps); 3: Ready.runtime (backend, transport, graphs); 2: speculation fields (StepPlan drafts / next_token / kv_tokens / spec_stops,
                         #    StepResult counts / drafts)
HEARTBEAT_S = 0.25


class ProtocolError(RuntimeError):
    """A malformed or unexpected message (version mismatch, unknown kind, bad frames)."""


_REGISTRY: dict[int, type["Message"]] = {}


class Message:
    """Base of all records: dataclass fields go to msgpack, numpy arrays to their own frames."""
    KIND: ClassVar[int]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.KIND in _REGISTRY:
            raise TypeError(f"message kind {cls.KIND} used twice ({_REGISTRY[cls.KIND].__name__}, {cls.__name__})")
        _REGISTRY[cls.KIND] = cls

    def to_frames(self) -> list[bytes]:
        arrays: list[np.ndarray] = []

        def enc(v: Any) -> Any:
            if isinstance(v, np.ndarray):
                arrays.append(np.ascontiguousarray(v))
                return {"__array__": len(arrays) - 1, "dtype": v.dtype.str, "shape": list(v.shape)}
            if isinstance(v, (list, tuple)):
                return [enc(x) for x in v]
            if isinstance(v, dict):
                return {k: enc(x) for k, x in v.items()}
            if isinstance(v, (np.integer, np.floating)):
                return v.item()
            return v

        body = {f.name: enc(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return [bytes([self.KIND]), msgpack.packb(body, use_bin_type=True)] + [a.data for a in arrays]

    @staticmethod
    def from_frames(frames: list[bytes]) -> "Message":
        if len(frames) < 2 or len(frames[0]) != 1:
            raise ProtocolError(f"expected [kind, body, arrays...], got {len(frames)} frames")
        cls = _REGISTRY.get(frames[0][0])
        if cls is None:
            raise ProtocolError(f"unknown message kind {frames[0][0]}")
        arrays = frames[2:]

        def dec(v: Any) -> Any:
            if isinstance(v, dict):
                if "__array__" in v:
                    buf = arrays[v["__array__"]]
                    return np.frombuffer(buf, dtype=np.dtype(v["dtype"])).reshape(v["shape"]).copy()
                return {k: dec(x) for k, x in v.items()}
            if isinstance(v, list):
                return [dec(x) for x in v]
            return v

        try:
            body = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
            if not isinstance(body, dict):
                raise TypeError(f"the body is a {type(body).__name__}, not a map of fields")
            return cls(**{k: dec(v) for k, v in body.items()})
        except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as e:
            raise ProtocolError(f"cannot decode {cls.__name__}: {e}") from e


@dataclass
class Hello(Message):
    KIND: ClassVar[int] = 1
    rank: int
    tp: int
    model_dir: str
    device: str
    dtype: str
    num_slots: int
    num_pages: int
    mailbox: str                      # shared-memory segment name
    mailbox_words: int                # payload capacity per slot, in 8-byte words
    version: int = PROTOCOL_VERSION
    options: dict = field(default_factory=dict)


@dataclass
class Ready(Message):
    KIND: ClassVar[int] = 2
    rank: int
    ok: bool
    error: str = ""
    pid: int = 0
    shard: dict = field(default_factory=dict)     # name -> shape of a few representative tensors
    weight_bytes: int = 0
    state_bytes: int = 0
    has_mtp: bool = False
    runtime: dict = field(default_factory=dict)   # backend, weights, transport, probe_us, cuda_graphs
    version: int = PROTOCOL_VERSION


@dataclass
class StepPlan(Message):
    """One step for all ranks. Arrays are int32 and flat; sequence b owns rows of the per-sequence
    arrays and columns [col_start[b], col_start[b] + columns[b]) of token_ids.

    seq_ids      [B] request ids (int64)       columns    [B] input columns
    starts       [B] first column's position   slots      [B] GDN state slot
    page_tables  [B, P] KV page ids            token_ids  [N] input tokens
    sample       [B] 1 when the step samples a token for the sequence (its last column is the last
                 known token), 0 for a prefill chunk that ends before the prompt does
    new_sampling {seq_id: sampler fields} for sequences admitted this step: temperature, top_k, top_p,
                 min_p, presence_penalty, frequency_penalty, repetition_penalty, seed, prompt_len, and
                 when set banned ([id]) and bias ([[id, value]], logit_bias) (the keyword arguments of
                 ranks.sampler.SeqSampler)
    finished     seq ids whose sampler state the ranks may drop
    """
    KIND: ClassVar[int] = 4
    step: int
    seq_ids: np.ndarray
    columns: np.ndarray
    starts: np.ndarray
    slots: np.ndarray
    page_tables: np.ndarray
    token_ids: np.ndarray
    sample: np.ndarray
    new_sampling: dict = field(default_factory=dict)
    prompt_tokens: dict = field(default_factory=dict)   # seq_id -> [prompt ids] (penalties; see below)
    finished: list = field(default_factory=list)
    # speculation only (None when off):
    drafts: np.ndarray | None = None      # [B] how many of the sequence's last columns are drafts
    next_token: np.ndarray | None = None  # [B] the token after the last column when already known (a
                                          #     prefill chunk that does not end the prompt), else -1
    kv_tokens: np.ndarray | None = None   # [B] KV positions the sequence's pages hold (drafting bound)
    spec_stops: dict = field(default_factory=dict)      # seq_id -> stop token ids (new sequences):
                                                        # acceptance stops at the first stop token
    # prompt_logprobs sequences in a prefill chunk that does not end the prompt: seq_id -> the prompt
    # token after the chunk (its last column's logprob entry is that token's)
    prompt_next: dict = field(default_factory=dict)
    # structured outputs: seq_id -> the bitmask of ids its token of this step may take (bytes, bit i of
    # byte i // 8 = id i; runtime.grammar), for constrained sequences that sample in the step
    masks: dict = field(default_factory=dict)
    # prefix cache (runtime/prefix_cache.py): [[snapshot, slot]] copies of GDN state into slots before
    # the step (sequences admitted on a cached prefix), [[slot, snapshot, u]] copies out of a slot's
    # state after the first u of its sequence's columns in the step (a frontier: at the end of the
    # chunk, after the step; inside it, mid-step, Batch.saves); prompt_tokens then holds the cached
    # prompt ids of restored sequences with penalties (their samplers count them as if fed)
    snapshot_loads: list = field(default_factory=list)
    snapshot_saves: list = field(default_factory=list)


@dataclass
class StepResult(Message):
    KIND: ClassVar[int] = 5
    step: int
    seq_ids: np.ndarray          # [S] sequences that sampled this step
    tokens: np.ndarray           # [S] sampled ids, or with counts: [sum(counts)] accepted tokens, in order
    elapsed_s: float = 0.0
    counts: np.ndarray | None = None   # speculation: [S] tokens per sequence (1 + accepted drafts)
    drafts: np.ndarray | None = None   # speculation: [S, K] drafts for each sequence's next round
    fed: bool = False                  # its LAST_SAMPLED inputs came from the previous step's device ids
    # logprobs (rows whose sampler asked): one entry per token of `tokens`, None for rows that did not
    # ask, else [logprob, [[id, logprob], ...]] (ranks.sampler.token_logprobs)
    logprobs: list | None = None
    # prompt_logprobs sequences whose prompt columns ran this step: seq_id -> one entry per prompt
    # token they predict, in order (the entry of prompt position p comes from column p - 1)
    prompt_logprobs: dict | None = None


@dataclass
class Cancel(Message):
    """Sequences the ranks may forget now (their slots and pages are reused by later plans)."""
    KIND: ClassVar[int] = 3
    seq_ids: list


@dataclass
class Heartbeat(Message):
    KIND: ClassVar[int] = 6
    rank: int
    step: int = -1


@dataclass
class Loading(Message):
    """Sent while a rank loads its weights (at most every ranks.upload.REPORT_S, and once at the end)."""
    KIND: ClassVar[int] = 9
    rank: int
    done: int                          # bytes on the rank's device so far
    total: int                         # the shard's bytes (counted before the load)


@dataclass
class Shutdown(Message):
    KIND: ClassVar[int] = 7
    reason: str = ""


@dataclass
class Error(Message):
    KIND: ClassVar[int] = 8
    rank: int
    step: int
    reason: str


def send(sock, msg: Message, flags: int = 0) -> None:
    sock.send_multipart(msg.to_frames(), flags=flags, copy=False)


def recv(sock, flags: int = 0) -> Message:
    return Message.from_frames([bytes(f) for f in sock.recv_multipart(flags=flags)])
