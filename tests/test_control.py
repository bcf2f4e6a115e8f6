"""transport.control: every message survives to_frames -> from_frames; bad frames raise ProtocolError.

The expected values are the records as built here, compared field by field (numpy arrays by dtype,
shape and bytes), so a field the codec drops, reorders, retypes or truncates fails the test.
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from transport import control as msg


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _messages(seed: int) -> list[msg.Message]:
    """One instance of every record kind, with arrays of several dtypes, shapes and layouts."""
    r = _rng(seed)
    B, P = 5, 7
    tables = r.integers(0, 1000, (P, B), dtype=np.int32).T            # non-contiguous (transposed) view
    columns = r.integers(1, 300, B).astype(np.int32)
    return [
        msg.Hello(rank=1, tp=4, model_dir="/models/qwen3.5 é", device="cuda:1", dtype="bfloat16", num_slots=8,
                  num_pages=1 << 20, mailbox="psm_abc", mailbox_words=(1 << 22) + 3,
                  options=dict(mailbox_timeout_s=12.5, threads_per_rank=3, nested={"a": [1, 2.5, None, True]})),
        msg.Ready(rank=3, ok=False, error="OSError: no such file", pid=12345,
                  shard={"embed_tokens.weight": [256, 64], "lm_head.weight": [64, 64]}, weight_bytes=2**40 + 7,
                  state_bytes=0, has_mtp=True),
        msg.StepPlan(step=2**40, seq_ids=r.integers(0, 2**62, B, dtype=np.int64), columns=columns,
                     starts=r.integers(0, 4096, B).astype(np.int32), slots=r.permutation(B).astype(np.int32),
                     page_tables=tables, token_ids=r.integers(0, 2**31 - 1, int(columns.sum())).astype(np.int32),
                     sample=(r.random(B) < 0.5).astype(np.int8),
                     new_sampling={7: dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, presence_penalty=-0.5,
                                           frequency_penalty=1.5, repetition_penalty=1.1, seed=2**63 - 1,
                                           prompt_len=300),
                                   2**40: dict(temperature=0.0, seed=-5)},
                     prompt_tokens={7: r.integers(0, 256, 300).astype(np.int32), 9: np.zeros(0, dtype=np.int32)},
                     finished=[3, 4, 2**50]),
        msg.StepResult(step=17, seq_ids=np.array([5, 2**40], dtype=np.int64),
                       tokens=np.array([0, 255], dtype=np.int64), elapsed_s=0.125),
        msg.StepResult(step=0, seq_ids=np.zeros(0, dtype=np.int64), tokens=np.zeros(0, dtype=np.int64)),
        msg.Cancel(seq_ids=[1, 2, 3]),
        msg.Heartbeat(rank=2, step=99),
        msg.Heartbeat(rank=0),
        msg.Loading(rank=1, done=int(r.integers(0, 2**40)), total=2**41 + 12345),
        msg.Shutdown(reason="engine shutdown"),
        msg.Shutdown(),
        msg.Error(rank=1, step=-1, reason="RuntimeError: boom\nwith a second line"),
    ]


def _assert_same(got, want, where: str) -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got).__name__} instead of an array"
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{where}: {got.dtype}{got.shape} instead of {want.dtype}{want.shape}"
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{where}: values differ"
        assert got.flags.writeable, f"{where}: decoded arrays must be owned, writable copies"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} ({type(got).__name__}) != {want!r}"


def _kinds() -> list[type]:
    return sorted(msg._REGISTRY.values(), key=lambda c: c.KIND)


def test_every_registered_kind_is_covered(seed):
    covered = {type(m) for m in _messages(seed)}
    assert covered == set(_kinds()), f"not exercised: {set(_kinds()) - covered}"
    assert len({c.KIND for c in _kinds()}) == len(_kinds())


@pytest.mark.parametrize("as_bytes", [False, True], ids=["memoryview-frames", "bytes-frames"])
def test_every_message_round_trips(seed, as_bytes):
    for m in _messages(seed):
        frames = m.to_frames()
        assert len(frames[0]) == 1 and frames[0][0] == m.KIND
        if as_bytes:                           # what recv_multipart hands over
            frames = [bytes(f) for f in frames]
        back = msg.Message.from_frames(frames)
        assert type(back) is type(m)
        for f in dataclasses.fields(m):
            _assert_same(getattr(back, f.name), getattr(m, f.name), f"{type(m).__name__}.{f.name}")


def test_arrays_travel_as_raw_frames_not_msgpack(seed):
    """Large tables must not go through msgpack: the body stays small, the array bytes are a frame."""
    big = np.arange(100_000, dtype=np.int32)
    m = msg.StepPlan(step=1, seq_ids=np.array([1], dtype=np.int64), columns=np.array([big.size], dtype=np.int32),
                     starts=np.zeros(1, np.int32), slots=np.zeros(1, np.int32),
                     page_tables=np.zeros((1, 1), np.int32), token_ids=big, sample=np.ones(1, np.int8))
    frames = m.to_frames()
    assert len(frames[1]) < 2000
    assert any(len(bytes(f)) == big.nbytes and bytes(f) == big.tobytes() for f in frames[2:])


def test_version_is_carried(seed):
    h = msg.Message.from_frames(msg.Hello(rank=0, tp=1, model_dir="m", device="cpu", dtype="float32", num_slots=1,
                                          num_pages=1, mailbox="x", mailbox_words=1, version=99).to_frames())
    assert h.version == 99 and msg.Hello.__dataclass_fields__["version"].default == msg.PROTOCOL_VERSION


def _body(d) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


GOOD_HEARTBEAT = _body({"rank": 1, "step": 2})


@pytest.mark.parametrize("frames, what", [
    ([], "no frames"),
    ([b"\x06"], "kind only"),
    ([b"", GOOD_HEARTBEAT], "empty kind frame"),
    ([b"\x06\x00", GOOD_HEARTBEAT], "two-byte kind frame"),
    ([b"\xff", GOOD_HEARTBEAT], "unknown kind 255"),
    ([b"\x00", GOOD_HEARTBEAT], "unknown kind 0"),
    ([b"\x06", b"\xc1"], "invalid msgpack"),
    ([b"\x06", GOOD_HEARTBEAT[:-1]], "truncated body"),
    ([b"\x06", GOOD_HEARTBEAT + b"\x01"], "trailing bytes"),
    ([b"\x06", _body([1, 2])], "body is a list"),
    ([b"\x06", _body(5)], "body is an int"),
    ([b"\x06", _body(None)], "body is nil"),
    ([b"\x06", _body({"rank": 1, "bogus": 2})], "unknown field"),
    ([b"\x06", _body({"step": 2})], "missing required field"),
    ([b"\x05", _body({"step": 1, "seq_ids": {"__array__": 0, "dtype": "<i8", "shape": [1]},
                      "tokens": {"__array__": 1, "dtype": "<i8", "shape": [1]}}), b"\0" * 8], "array frame missing"),
    ([b"\x05", _body({"step": 1, "seq_ids": {"__array__": 0, "dtype": "<i8", "shape": [2]},
                      "tokens": {"__array__": 0, "dtype": "<i8", "shape": [1]}}), b"\0" * 8], "array shape mismatch"),
    ([b"\x05", _body({"step": 1, "seq_ids": {"__array__": 0, "dtype": "<i8", "shape": [1]},
                      "tokens": {"__array__": 0, "dtype": "<i8", "shape": [1]}}), b"\0" * 7], "ragged array bytes"),
    ([b"\x05", _body({"step": 1, "seq_ids": {"__array__": 0, "dtype": "no-such-dtype", "shape": [1]},
                      "tokens": {"__array__": 0, "dtype": "<i8", "shape": [1]}}), b"\0" * 8], "bad dtype"),
    ([b"\x05", _body({"step": 1, "seq_ids": {"__array__": 0, "shape": [1]},
                      "tokens": {"__array__": 0, "dtype": "<i8", "shape": [1]}}), b"\0" * 8], "array without dtype"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_garbage_frames_raise_protocol_error(frames, what):
    with pytest.raises(msg.ProtocolError):
        msg.Message.from_frames(frames)


def test_unknown_kind_is_named():
    with pytest.raises(msg.ProtocolError, match="unknown message kind 200"):
        msg.Message.from_frames([bytes([200]), GOOD_HEARTBEAT])


def test_send_recv_over_zmq(seed):
    """The socket helpers: what send writes, recv reads back (multi-frame, arrays included)."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.setsockopt(zmq.LINGER, 0), b.setsockopt(zmq.LINGER, 0)
        a.bind("inproc://control-test")
        b.connect("inproc://control-test")
        for m in _messages(seed):
            msg.send(a, m)
            assert b.poll(5000), "message did not arrive"
            back = msg.recv(b)
            for f in dataclasses.fields(m):
                _assert_same(getattr(back, f.name), getattr(m, f.name), f"{type(m).__name__}.{f.name}")
        a.close(), b.close()
    finally:
        ctx.term()
