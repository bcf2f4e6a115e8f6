"""transport.select.choose without a GPU: the ranks agree on one transport (auto falls back to staged
copies when the GPU mailbox cannot be set up on some rank), explicit choices fail loudly, tp 1 is the
identity. Two ranks are two threads on one real shared-memory segment (the CPU mailbox carries the
vote, as between rank processes)."""

from __future__ import annotations

import threading


import numpy as np
import pytest
import torch

from transport import select
from transport.mailbox import Mailbox


def _both(fn, tp=2):
    out, errors = [None] * tp, [None] * tp

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as e:                     # noqa: BLE001 - surfaced below
            errors[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out, errors


def _choose_everywhere(kind, segments):
    """select.choose on both ranks at once; each rank closes what it chose. -> (transports, errors)."""
    cpu_name, gpu_name = segments

    def rank(r):
        mb = Mailbox(cpu_name, r)
        try:
            tr = select.choose(kind, r, 2, 0, mb, gpu_name, None)
            tr.close()
            return tr
        finally:
            mb.close()
    return _both(rank)


@pytest.fixture
def segments(segment):
    """(CPU mailbox segment, GPU mailbox segment) names for two ranks."""
    return segment(2, 64).name, segment(2, 64).name


def test_tp1_is_the_identity():
    t = torch.randn(3)
    tr = select.choose("auto", 0, 1, 0, None, None, None)
    assert tr.name == "none" and tr.capturable and tr.all_reduce(t) is t


def test_cpu_transport_sums_over_the_cpu_mailbox(segments, seed):
    cpu_name, _ = segments
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(5, generator=g) for _ in range(2)]

    def rank(r):
        mb = Mailbox(cpu_name, r)
        try:
            tr = select.choose("cpu", r, 2, 0, mb, None, None)
            assert tr.name == "cpu" and not tr.capturable
            return tr.all_reduce(parts[r].clone())
        finally:
            mb.close()
    out, errors = _both(rank)
    assert errors == [None, None]
    want = (parts[0].double() + parts[1].double()).float()
    for o in out:
        assert torch.allclose(o, want, rtol=1e-6, atol=1e-6)


def test_auto_falls_back_to_copies_on_every_rank_when_the_mailbox_is_unavailable(segments, monkeypatch):
    """Here the GPU mailbox cannot be built (no GPU / CuPy), so both ranks vote 'unavailable' and both
    take staged copies (which touch the GPU only when used)."""
    import transport.mailbox_cuda as mc

    def broken(*a, **k):
        raise RuntimeError("no GPU here")
    monkeypatch.setattr(mc, "CudaMailbox", broken)

    view = Mailbox(segments[1], 0)
    view.hang[0] = 2                             # as if a probe had timed out on rank 1

    out, errors = _choose_everywhere("auto", segments)
    assert errors == [None, None]
    assert [(t.name, t.capturable) for t in out] == [("copies", False), ("copies", False)]
    assert int(view.hang[0]) == 0                # cleared before the first staged exchange
    view.close()


def test_one_rank_failing_sends_both_to_copies(segments, monkeypatch):
    """A mailbox that works on rank 0 but not on rank 1: the vote makes both fall back."""
    import transport.mailbox_cuda as mc

    class Fake:
        closed = []

        def __init__(self, name, rank, device=None, timeout_s=60.0):
            if rank == 1:
                raise RuntimeError("hostRegister failed")
            self.rank = rank

        def probe(self):
            return 3.0

        def close(self):
            Fake.closed.append(self.rank)
    monkeypatch.setattr(mc, "CudaMailbox", Fake)

    out, errors = _choose_everywhere("auto", segments)
    assert errors == [None, None]
    assert [t.name for t in out] == ["copies", "copies"]
    assert Fake.closed == [0]                      # rank 0 released the mailbox it had built


@pytest.mark.parametrize("probe_us,want", [(3.0, "mailbox"), (500.0, "copies")])
def test_auto_follows_the_mean_probe_time(segments, monkeypatch, probe_us, want):
    import transport.mailbox_cuda as mc

    class Fake:
        def __init__(self, name, rank, device=None, timeout_s=60.0):
            pass

        def probe(self):
            return probe_us

        def all_reduce(self, t):
            return t

        def check(self):
            pass

        def close(self):
            pass
    monkeypatch.setattr(mc, "CudaMailbox", Fake)

    out, errors = _choose_everywhere("auto", segments)
    assert errors == [None, None]
    assert [t.name for t in out] == [want, want]
    assert all(np.isclose(t.probe_us, probe_us) for t in out)


def test_explicit_mailbox_fails_loudly_when_unavailable(segments, monkeypatch):
    import transport.mailbox_cuda as mc

    def broken(*a, **k):
        raise RuntimeError("no GPU here")
    monkeypatch.setattr(mc, "CudaMailbox", broken)

    _, errors = _choose_everywhere("mailbox", segments)
    for e in errors:
        assert isinstance(e, RuntimeError) and "--transport mailbox" in str(e) and "no GPU here" in str(e)


def test_gpu_transports_need_the_segment():
    with pytest.raises(ValueError, match="GPU mailbox segment"):
        select.choose("copies", 0, 2, 0, object(), None, None)
