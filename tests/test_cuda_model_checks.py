"""The GPU model tests' own checks, on the CPU: Agreement's per-position bound with the perturbed
references' judgement of ill-conditioned positions (test_cuda_model.PerturbedReferences)."""

from __future__ import annotations

import pytest
import torch

from ranks.model import Batch, HybridModel
from tests.test_cuda_model import Agreement, PerturbedReferences, _reference_logits
from tests.util import random_weights, rel, tiny_spec


@pytest.fixture(scope="module")
def refs():
    spec = tiny_spec(False)
    w = random_weights(spec, 7)
    ref = HybridModel(spec, w)
    ref16 = HybridModel(spec, {k: v.to(torch.bfloat16) for k, v in w.items()})
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (30, 20)]
    want, want16 = _reference_logits(ref, seqs), _reference_logits(ref16, seqs)
    return ref, seqs, want, want16


def test_perturbed_references_move_the_logits_by_rounding_sized_amounts(refs):
    ref, seqs, want, want16 = refs
    noisy = PerturbedReferences(ref, seqs, None)
    errs = torch.tensor([noisy.error(b, t, want[b][t:t + 1]) for b in range(2) for t in range(len(seqs[b]))])
    e16 = torch.tensor([rel(want16[b][t], want[b][t]) for b in range(2) for t in range(len(seqs[b]))])
    assert (errs > 0).all()
    # the same order as bf16 rounding's own effect (weights noise of 2^-8 against bf16's 2^-9 rounding
    # of weights and activations), far from a wrong row's ~1
    ratio = float((errs / e16).median())
    assert 0.3 < ratio < 10, ratio
    assert float(errs.median()) < 0.2
    # deterministic for the same sequences (a replayed seed judges the same)
    assert noisy.error(1, 5, want[1][5:6]) == PerturbedReferences(ref, seqs, None).error(1, 5, want[1][5:6])


def _row(want, scale, g):
    """want's rows moved by `scale` of their norm in a random direction."""
    d = torch.randn(want.shape, generator=g)
    return want + scale * want.norm() * d / d.norm()


def test_agreement_excuses_a_chunk_only_where_the_perturbed_references_move_as_much():
    g = torch.Generator().manual_seed(11)
    want = torch.randn(1, 500, generator=g)
    want16 = _row(want, 0.01, g)
    # past 6x the bf16 reference's 0.01 + 0.02
    far = _row(want, 0.5, g)
    a = Agreement("ill-conditioned")
    for _ in range(30):
        a.add(_row(want, 0.01, g), want, _row(want, 0.01, g), "a clear position")
    a.add(far, want, want16, "position 67", lambda w: 0.4)      # noisy references 0.4 off: excused
    assert len(a.conditioned) == 1 and not a.outliers
    a.check()
    b = Agreement("well-conditioned")
    with pytest.raises(AssertionError, match="position 3"):
        b.add(far, want, want16, "position 3", lambda w: 0.012)  # noisy references agree there: a bug
    c = Agreement("no noise asked")
    with pytest.raises(AssertionError, match="position 3"):
        c.add(far, want, want16, "position 3")


def test_agreement_bounds_how_many_chunks_are_ill_conditioned():
    """At most 1 + 5% of the chunks are excused so; more count against `allowed` like any outlier."""
    g = torch.Generator().manual_seed(12)
    want = torch.randn(1, 500, generator=g)
    for allowed in (0, 1):
        a = Agreement("too many", allowed)
        for _ in range(19):
            a.add(_row(want, 0.01, g), want, _row(want, 0.01, g), "clear")
        a.add(_row(want, 0.5, g), want, _row(want, 0.01, g), "first", lambda w: 0.5)
        a.add(_row(want, 0.5, g), want, _row(want, 0.01, g), "second", lambda w: 0.5)   # 2 of 21: 1 + 5%
        assert len(a.conditioned) == 2
        if allowed:
            a.add(_row(want, 0.5, g), want, _row(want, 0.01, g), "third", lambda w: 0.5)
            assert len(a.conditioned) == 2 and len(a.outliers) == 1
        else:
            with pytest.raises(AssertionError, match="third"):   # 3 of 22, none allowed
                a.add(_row(want, 0.5, g), want, _row(want, 0.01, g), "third", lambda w: 0.5)
