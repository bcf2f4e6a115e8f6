"""The decode attention's key-split choice (kernels.cuda_attention.choose_splits), on the CPU: the
splits cover the bound exactly once in 64-key pages, short contexts keep the wave-based choice, long
ones get splits of at most _MAX_CHUNK keys unless the partial sums would pass _SPLIT_SCRATCH."""

from __future__ import annotations

import itertools

import pytest

from kernels import cuda_attention as ca

SHAPES = [(4, 6, 256), (2, 6, 256), (2, 8, 128), (1, 4, 64), (8, 1, 128)]     # (kv heads, G, D)


@pytest.mark.parametrize("kv,G,D", SHAPES)
def test_splits_cover_the_bound(kv, G, D):
    for n, L, sms in itertools.product((1, 2, 4, 8, 32, 128), (1, 63, 64, 1000, 4096, 32768, 65536, 262144),
                                       (16, 82, 132)):
        S, chunk = ca.choose_splits(n, kv, G, L, sms, head_dim=D)
        assert S >= 1 and chunk % ca.PAGE_SIZE == 0 and chunk >= ca.PAGE_SIZE, (n, L, S, chunk)
        assert (S - 1) * chunk < L <= S * chunk, f"{S} splits of {chunk} keys for {L} keys: one is empty"
        per_split = n * kv * G * (D + 2) * 4
        if -(-L // ca._MAX_CHUNK) * per_split <= ca._SPLIT_SCRATCH:
            assert chunk <= ca._MAX_CHUNK, (n, L, S, chunk)


def test_long_contexts_get_many_ctas():
    """27B at tp 1 (4 kv heads, G 6): 4 decodes in a 64k-key bucket had 17 splits of 3 904 keys;
    now every 512 keys is a CTA."""
    S, chunk = ca.choose_splits(4, 4, 6, 65536, 132)
    assert chunk == 512 and S == 128
    # short contexts: the wave rule as before (C=1 at a 1k bucket: 16 splits of 64 keys)
    assert ca.choose_splits(1, 4, 6, 1024, 132) == (16, 64)
    # wide batches at long contexts: the scratch bound wins, the splits stay long
    S, chunk = ca.choose_splits(32, 4, 6, 262144, 132)
    assert 32 * 24 * S * 258 * 4 <= ca._SPLIT_SCRATCH and chunk > ca._MAX_CHUNK
