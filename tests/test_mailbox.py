"""transport.mailbox between real processes (multiprocessing 'spawn'), tp 2 and 3.

* all_reduce of random float32 / bfloat16 vectors of 1 to 3x the slot capacity (so exchanges split
  into pieces): every rank's result is bit-identical and equals the float32 sum in rank order
  0, 1, ..., N-1 cast once to the input dtype, computed here from the same inputs.
* all_gather is exact.
* Epochs grow by one per piece over 1000 exchanges and never reset; the words a rank wrote carry
  the current epoch; across the 32-bit wrap the slots keep alternating and stale words are cleared.
* Hang guard: a rank that never arrives is named in the MailboxHang of the rank that waited for it,
  the sticky hang word is set, and the other ranks fail on the hang word instead of waiting out
  their own (much longer) timeout.

The rank functions below run in spawned children, which import this module: keep its top light
(torch is imported inside the functions that need it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import time
import traceback

import numpy as np
import pytest

from transport.mailbox import _HANG_OFFSET, Mailbox, MailboxHang, create_segment

WORDS = 97                      # payload words per slot: small and odd, so pieces and edges are cheap
EXCHANGES = 1000
JOIN_S = 120                    # a child that has not finished by then hung: the test fails


# --------------------------------------------------------------------------------------------------
# Inputs, shared by the children (who reduce them) and the parent (who checks the sums)


def _plan(seed: int) -> list[tuple[str, int, str]]:
    """(op, size, dtype) of every exchange: edges of the slot capacity first, then random sizes."""
    rng = np.random.default_rng([seed, 12345])
    edges = [1, 2, WORDS - 1, WORDS, WORDS + 1, 2 * WORDS - 1, 2 * WORDS, 2 * WORDS + 1, 3 * WORDS - 1, 3 * WORDS]
    plan = [("reduce", n, dt) for n in edges for dt in ("float32", "bfloat16")]
    while len(plan) < EXCHANGES:
        op = "gather" if rng.random() < 0.05 else "reduce"
        plan.append((op, int(rng.integers(1, 3 * WORDS + 1)), "float32" if rng.random() < 0.6 else "bfloat16"))
    return plan


def _input(seed: int, rank: int, i: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, i])
    scale = 10.0 ** rng.integers(-3, 4)                     # mixed magnitudes: summation order matters
    return (rng.standard_normal(n) * scale).astype(np.float32)


def _tensor(x: np.ndarray, dtype: str):
    import torch
    return torch.from_numpy(x.copy()).to(getattr(torch, dtype))


def _pieces(n: int) -> int:
    return max(1, -(-n // WORDS))


# --------------------------------------------------------------------------------------------------
# Children


def _child(fn, q, rank, *args) -> None:
    try:
        q.put((rank, "ok", fn(rank, *args)))
    except BaseException as e:                              # report, never hang the parent
        q.put((rank, type(e).__name__, f"{e}\n{traceback.format_exc()}"))


def _rank_exchanges(rank: int, name: str, seed: int, out_dir: str) -> dict:
    import torch
    torch.set_num_threads(1)
    mb = Mailbox(name, rank, timeout_s=60.0)
    results, epochs = [], []
    t0 = time.monotonic()
    for i, (op, n, dtype) in enumerate(_plan(seed)):
        x = _tensor(_input(seed, rank, i, n), dtype)
        before = mb.epoch
        if op == "reduce":
            y = mb.all_reduce(x)
            assert y.dtype == x.dtype and y.shape == x.shape, (y.dtype, y.shape)
            results.append(y.float().numpy())
        else:
            y = mb.all_gather(x.view(1, n))
            assert y.dtype == torch.float32 and tuple(y.shape) == (mb.tp, 1, n), (y.dtype, y.shape)
            results.append(y.numpy().reshape(-1))
        assert mb.epoch == before + _pieces(n), f"exchange {i}: epoch {before} -> {mb.epoch}"
        # the words this rank wrote last carry the current epoch in their high half
        last = n - (_pieces(n) - 1) * WORDS
        mine = mb.slots[rank, mb.epoch % 2, :last]
        assert ((mine >> np.uint64(32)) == mb.epoch).all(), f"exchange {i}: stale words in my slot"
        epochs.append(mb.epoch)
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.concatenate(results))
    mb.close()
    return dict(epochs=epochs, loop_s=time.monotonic() - t0)


def _rank_wrap(rank: int, name: str, seed: int, start_epoch: int, delay_reads: bool) -> list:
    """Exchanges across the 32-bit epoch wrap; with delay_reads, this rank reads every peer late."""

    class Late(Mailbox):
        def _wait(self, *a):
            time.sleep(0.05)
            return super()._wait(*a)

    mb = (Late if delay_reads else Mailbox)(name, rank, timeout_s=5.0)
    mb.epoch = start_epoch
    out = []
    for i in range(8):
        x = _input(seed, rank, i, WORDS if i % 3 == 0 else 5)
        out.append((mb.epoch, mb.exchange(x).tolist()))
    mb.close()
    return out


def _rank_hang(rank: int, name: str, timeout_s: float, exchanges: int, go) -> dict:
    mb = Mailbox(name, rank, timeout_s=timeout_s)
    if hasattr(go, "wait") and not hasattr(go, "is_set"):
        go.wait(JOIN_S)                                 # a Barrier: start together (spawn times vary)
    elif go is not None and not go.wait(JOIN_S):
        raise RuntimeError("never told to go")
    done, t0 = 0, time.monotonic()
    try:
        for _ in range(exchanges):
            mb.exchange(np.ones(3, dtype=np.float32))
            done += 1
    except MailboxHang as e:
        return dict(hang=str(e), elapsed=time.monotonic() - t0, done=done)
    finally:
        mb.close()
    return dict(hang=None, done=done)


def _run(fn, args_per_rank: list[tuple], ctx=None) -> dict[int, object]:
    ctx = ctx or mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, q, r, *a), daemon=True) for r, a in enumerate(args_per_rank)
             if a is not None]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            rank, status, value = q.get(timeout=JOIN_S)
            assert status == "ok", f"rank {rank} raised {status}: {value}"
            out[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return out


# --------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("tp", [2, 3])
def test_all_reduce_and_all_gather_across_processes(tp, segment, seed, tmp_path):
    import torch
    shm = segment(tp, WORDS)
    out = _run(_rank_exchanges, [(shm.name, seed, str(tmp_path))] * tp)
    got = [np.load(tmp_path / f"rank{r}.npy") for r in range(tp)]
    for r in range(1, tp):
        assert got[r].tobytes() == got[0].tobytes(), f"rank {r}'s results are not bit-identical to rank 0's"
    at = 0
    for i, (op, n, dtype) in enumerate(_plan(seed)):
        xs = [_tensor(_input(seed, r, i, n), dtype).float().numpy() for r in range(tp)]
        if op == "reduce":
            total = xs[0].copy()
            for r in range(1, tp):
                total += xs[r]                                  # float32, rank order
            want = torch.from_numpy(total).to(getattr(torch, dtype)).float().numpy()
        else:
            want = np.concatenate(xs)
        have = got[0][at:at + want.size]
        assert have.tobytes() == want.tobytes(), (
            f"exchange {i} ({op}, {n} x {dtype}): max abs diff {np.abs(have - want).max():.3e}")
        at += want.size
    assert at == got[0].size
    # epochs: one per piece, strictly increasing, identical on every rank, never reset
    for r in range(tp):
        assert out[r]["epochs"] == out[0]["epochs"]
    pieces = np.cumsum([_pieces(n) for _, n, _ in _plan(seed)])
    assert out[0]["epochs"] == pieces.tolist()
    assert out[0]["epochs"][-1] > EXCHANGES


def test_epochs_keep_alternating_slots_across_the_wrap(segment, seed):
    """Around 2**32 the epoch wraps; consecutive exchanges must still use different slots, or a fast
    rank overwrites the slot a slow peer is still reading (rank 1 reads 50 ms late here)."""
    shm = segment(2, WORDS)
    start = 0xFFFF_FFFF - 5
    out = _run(_rank_wrap, [(shm.name, seed, start, False), (shm.name, seed, start, True)])
    for i in range(8):
        want = [_input(seed, r, i, WORDS if i % 3 == 0 else 5).tolist() for r in range(2)]
        for r in range(2):
            assert out[r][i][1] == want, f"rank {r}, exchange {i} (epoch {out[r][i][0]}) got wrong data"
    epochs = [e for e, _ in out[0]]
    assert out[1] and [e for e, _ in out[1]] == epochs
    nxt = [(e % 0xFFFF_FFFE) + 1 for e in epochs]           # the epoch each exchange used
    assert 0 not in nxt and all(a % 2 != b % 2 for a, b in zip(nxt, nxt[1:])), f"slots do not alternate: {nxt}"


def test_stale_words_are_cleared_at_the_wrap():
    """Words a long exchange wrote at epoch e must not pass for current when the epoch comes back to e."""
    shm = create_segment(1, WORDS)
    try:
        mb = Mailbox(shm.name, 0)
        mb.exchange(np.arange(WORDS, dtype=np.float32))     # epoch 1 fills slot 1
        mb.exchange(np.arange(WORDS, dtype=np.float32))     # epoch 2 fills slot 0
        mb.epoch = 0xFFFF_FFFE - 2
        for _ in range(4):                                  # ..., wrap, epochs 1 and 2 again, 1 word each
            mb.exchange(np.ones(1, dtype=np.float32))
        assert mb.epoch == 2
        for slot, e in ((1, 1), (0, 2)):
            stale = (mb.slots[0, slot, 1:] >> np.uint64(32)) == e
            assert not stale.any(), f"slot {slot}: {int(stale.sum())} words still carry epoch {e} from the last pass"
        mb.close()
    finally:
        shm.close()
        shm.unlink()


def test_hang_guard_names_the_missing_rank_tp2(segment):
    """Rank 1 is late: rank 0 gives up after its timeout naming rank 1; rank 1, arriving later, finds
    its first exchange complete (rank 0 had written it) and fails on the hang word at the next."""
    shm = segment(2, WORDS)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    q = ctx.Queue()
    timeout = 1.0
    p0 = ctx.Process(target=_child, args=(_rank_hang, q, 0, shm.name, timeout, 1, None), daemon=True)
    p1 = ctx.Process(target=_child, args=(_rank_hang, q, 1, shm.name, 600.0, 2, go), daemon=True)
    p0.start(), p1.start()
    try:
        rank, status, r0 = q.get(timeout=JOIN_S)
        assert (rank, status) == (0, "ok"), r0
        assert r0["hang"] and "rank 1 did not arrive" in r0["hang"], r0
        assert r0["elapsed"] >= timeout, "gave up before its timeout"
        assert struct.unpack_from("<Q", shm.buf, _HANG_OFFSET)[0] == 0 + 1, "hang word must name the reporter"
        go.set()
        rank, status, r1 = q.get(timeout=JOIN_S)
        assert (rank, status) == (1, "ok"), r1
        assert r1["done"] == 1 and r1["hang"] and "rank 0 reported a mailbox hang" in r1["hang"], r1
    finally:
        go.set()
        for p in (p0, p1):
            p.join(10)
            if p.is_alive():
                p.kill()


def test_hang_guard_tp3_one_rank_never_arrives(segment):
    """Rank 2 never starts. Rank 0 (1 s timeout) names rank 2; rank 1 (600 s timeout) fails on the hang
    word, not on its own timeout (the test would not finish otherwise)."""
    shm = segment(3, WORDS)
    ctx = mp.get_context("spawn")
    together = ctx.Barrier(2)
    out = _run(_rank_hang, [(shm.name, 1.0, 3, together), (shm.name, 600.0, 3, together), None], ctx=ctx)
    assert out[0]["hang"] and "rank 0 waited" in out[0]["hang"] and "rank 2 did not arrive" in out[0]["hang"], out
    assert out[0]["elapsed"] >= 1.0 and out[0]["done"] == 0
    assert out[1]["hang"] and "rank 0 reported a mailbox hang" in out[1]["hang"], out
    assert out[1]["done"] == 0
    assert struct.unpack_from("<Q", shm.buf, _HANG_OFFSET)[0] == 1
