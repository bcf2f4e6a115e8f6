"""The load path's byte accounting and progress (ranks/upload.py, server/load_progress.py) on the CPU.

The pinned staging itself needs a GPU (tests/test_cuda_upload.py); here: the byte ranges it would
read straight from the files hold exactly the bytes the safetensors reader returns, load_shard's
progress counts every byte it returns and its meta pass predicts the total, the engine passes the
ranks' progress on, and the console display prints what it should.
"""

import io
import json
import math
import os

import numpy as np
import pytest
import torch

from ranks import upload
from ranks.sharding import load_shard
from ranks.upload import Upload, _byte_span, _pread, nbytes
from ranks.weights import Checkpoint, write_checkpoint
from runtime.config import spec_from_hf
from server.load_progress import LoadProgress
from tests.util import random_weights, tiny_config


def _checkpoint(tmp_path, seed: int, moe: bool = False, per_expert: bool = False, dtype=torch.bfloat16,
                max_shard_bytes: int = 4 * 2**30):
    cfg = tiny_config(moe, num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4,
                      linear_num_value_heads=8)
    spec = spec_from_hf(cfg)
    w = {k: v.to(dtype) if v.is_floating_point() else v for k, v in random_weights(spec, seed).items()}
    write_checkpoint(tmp_path, w, prefix="model.", split_experts=per_expert, max_shard_bytes=max_shard_bytes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return spec, Checkpoint(tmp_path)


def _file_bytes(path: str, offset: int, n: int) -> bytes:
    buf = torch.empty(n, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        _pread(fd, buf, offset)
    finally:
        os.close(fd)
    return buf.numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_byte_spans_hold_the_readers_bytes(tmp_path, seed, dtype):
    """Every tensor, and row ranges of every matrix, read as a byte range at the span the staging
    would read equal the safetensors reader's bytes; column slices and integer conversions have none."""
    spec, ckpt = _checkpoint(tmp_path, seed, moe=True, dtype=dtype, max_shard_bytes=200_000)
    assert len({info.file for info in ckpt.tensors.values()}) > 1            # several shard files
    rng = np.random.default_rng(seed)
    checked = 0
    for name, info in ckpt.tensors.items():
        shape = info.shape
        cases = [()]
        if len(shape) >= 2 and shape[0] > 1:
            lo = int(rng.integers(0, shape[0] - 1))
            hi = int(rng.integers(lo + 1, shape[0] + 1))
            cases += [(slice(lo, hi),), (slice(lo, hi), slice(None))]
        if len(shape) >= 2 and shape[-1] > 1:                     # columns: rows read whole, cut after
            half = shape[-1] // 2
            lo = int(rng.integers(0, shape[-1] - half + 1))
            cols = (slice(None),) * (len(shape) - 1) + (slice(lo, lo + half),)
            assert _byte_span(ckpt, name, cols, None) is None        # no over-read allowed
            narrow = (slice(None),) * (len(shape) - 1) + (slice(0, 1),)
            assert (_byte_span(ckpt, name, narrow, None, 4) is None) == (shape[-1] > 4)   # over 4x: the reader
            cases.append(cols)
        for index in cases:
            span = _byte_span(ckpt, name, index, None, overread=4)
            assert span is not None, (name, index)
            path, offset, rows_shape, stored, cut = span
            want = ckpt.read(name, index=index or None)
            rows = torch.frombuffer(bytearray(_file_bytes(path, offset, math.prod(rows_shape) * want.element_size())),
                                    dtype=stored).reshape(rows_shape)
            got = rows if cut is None else rows[cut]
            assert (cut is None) == (tuple(rows_shape) == tuple(want.shape))
            assert got.dtype == want.dtype and torch.equal(got.contiguous().view(torch.uint8),
                                                           want.contiguous().view(torch.uint8)), (name, index)
            checked += 1
    assert checked > 2 * len(ckpt.tensors)
    name = next(n for n, i in ckpt.tensors.items() if len(i.shape) == 2)
    assert _byte_span(ckpt, name, (), torch.int32) is None                   # not a float conversion
    assert _byte_span(ckpt, name, (), torch.float16) is not None             # converted on the device


@pytest.mark.parametrize("variant", ["dense-tp1", "dense-tp2", "moe-fused-tp2", "moe-per-expert-tp2"])
def test_load_progress_counts_every_byte_and_predicts_the_total(tmp_path, seed, variant):
    moe, tp = variant.startswith("moe"), int(variant[-1])
    spec, ckpt = _checkpoint(tmp_path, seed, moe=moe, per_expert="per-expert" in variant)
    for rank in range(tp):
        calls = []
        out = load_shard(ckpt, spec, rank, tp, dtype=torch.float32, progress=lambda d, t: calls.append((d, t)))
        returned = sum(nbytes(t) for t in out.values())
        assert calls, "no progress reported"
        assert calls[-1] == (returned, returned)              # the end: every byte, the predicted total
        assert all(t == returned for _, t in calls)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
        plain = load_shard(ckpt, spec, rank, tp, dtype=torch.float32)
        assert plain.keys() == out.keys()
        for k in plain:                                       # progress changes nothing that is loaded
            assert torch.equal(plain[k], out[k]), k


@pytest.mark.parametrize("readers", [1, 3, 4])
def test_parallel_reads_fill_the_buffer_with_the_files_bytes(tmp_path, seed, readers):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, 3 * upload.MIN_SPLIT + 12345, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    up = Upload("cpu")
    up.readers = readers
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, n in [(0, data.size), (777, data.size - 777), (5, 100), (4096, upload.MIN_SPLIT + 1)]:
            buf = torch.full((n,), 0xAB, dtype=torch.uint8)
            up._pread(fd, buf, offset)
            assert np.array_equal(buf.numpy(), data[offset:offset + n]), (offset, n)
    finally:
        os.close(fd)
        up.close()


def test_a_short_read_is_an_error_not_stale_bytes(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 40)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="short read at byte 10240"):
            _pread(fd, torch.empty(10241, dtype=torch.uint8), 0)
    finally:
        os.close(fd)


def test_upload_on_the_cpu_counts_and_reports_at_close(tmp_path, seed):
    spec, ckpt = _checkpoint(tmp_path, seed)
    reports = []
    names = sorted(ckpt.tensors)[:5]
    with Upload("cpu", total=123, report=lambda d, t: reports.append((d, t))) as up:
        got = [up.read(ckpt, n, (), torch.float32) for n in names]
    n = sum(nbytes(t) for t in got)
    assert up.done == n and reports[-1] == (n, max(123, n))
    for name, t in zip(names, got):
        assert torch.equal(t, ckpt.read(name, dtype=torch.float32))


@pytest.mark.parametrize("source", ["checkpoint", "random"])
def test_engine_passes_the_ranks_progress_on(tmp_path, seed, source):
    """Engine.start(on_load_progress=...) hears both ranks' loads summed; the last call is the whole."""
    from ranks.random_checkpoint import random_shard
    from runtime import Engine, EngineOptions
    spec, ckpt = _checkpoint(tmp_path, seed)
    calls = []
    opts = EngineOptions(max_concurrency=1, random_weights=source == "random")
    with Engine.start(tmp_path, tp=2, options=opts, on_load_progress=lambda d, t: calls.append((d, t))) as engine:
        assert engine.spec.num_layers == spec.num_layers
    if source == "random":
        shards = [random_shard(spec, r, 2, dtype=torch.float32) for r in range(2)]
    else:
        shards = [load_shard(ckpt, spec, r, 2) for r in range(2)]
    expect = sum(sum(nbytes(t) for t in shard.values()) for shard in shards)
    assert calls and calls[-1] == (expect, expect)
    assert all(d <= t for d, t in calls)


def test_console_progress_prints_a_line_per_tenth_and_nothing_for_small_loads():
    out = io.StringIO()
    p = LoadProgress("tandem serve", stream=out, bar=False, min_bytes=1000)
    total = 10 * 2**30
    for done in range(0, total + 1, total // 40):
        p(done, total)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and lines[0].startswith("tandem serve: loading weights 0% (0.0 of 10.0 GiB")
    assert lines[-1].startswith("tandem serve: loading weights 100% (10.0 of 10.0 GiB")
    assert [int(x.split()[4].rstrip("%")) for x in lines] == list(range(0, 101, 10))
    assert p.snapshot() == {"done_bytes": total, "total_bytes": total}
    quiet = io.StringIO()
    small = LoadProgress("tandem serve", stream=quiet, bar=False)
    small(10, 100)
    small(100, 100)
    assert quiet.getvalue() == "" and small.snapshot() == {"done_bytes": 100, "total_bytes": 100}


def test_console_progress_bar_on_a_terminal():
    pytest.importorskip("tqdm")
    out = io.StringIO()
    p = LoadProgress("tandem generate", stream=out, bar=True, min_bytes=0)
    p(2**29, 2**31)
    p(2**31, 2**31)
    p(2**30, 2**31)                          # after the end: ignored
    p.close()
    text = out.getvalue()
    assert "tandem generate: loading weights" in text and "100%" in text and "2.00G" in text
