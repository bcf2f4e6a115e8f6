"""Pinned staging of checkpoint tensors to a GPU (ranks/upload.py): bit for bit what the CPU load reads.

The device's caching allocator is poisoned first (a large block filled with 0xff bytes, then freed),
so a byte the staging never wrote shows up. Slabs are made small so that tensors cross several of
them, and odd sized so that pieces end mid-element.
"""

import json

import pytest
import torch

from kernels.quant import QuantWeight, quantize_nvfp4
from ranks import upload
from ranks.sharding import load_shard
from ranks.upload import Upload, nbytes
from ranks.weights import Checkpoint, write_checkpoint
from runtime.config import spec_from_hf
from tests.util import random_weights, tiny_config

pytestmark = pytest.mark.gpu


def _poison(n: int = 64 * 2**20) -> None:
    torch.cuda.synchronize()
    junk = torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    del junk


def _checkpoint(tmp_path, seed: int, moe: bool, per_expert: bool, dtype: torch.dtype):
    cfg = tiny_config(moe, num_attention_heads=8, num_key_value_heads=4, linear_num_key_heads=4,
                      linear_num_value_heads=8, hidden_size=256, **({} if moe else {"intermediate_size": 768}))
    spec = spec_from_hf(cfg)
    w = {k: v.to(dtype) if v.is_floating_point() else v for k, v in random_weights(spec, seed).items()}
    write_checkpoint(tmp_path, w, prefix="model.", split_experts=per_expert, max_shard_bytes=1 << 20)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return spec, Checkpoint(tmp_path)


def _same(a, b, name):
    if isinstance(a, QuantWeight):
        for f in ("data", "scale", "global_scale"):
            _same(getattr(a, f), getattr(b, f), f"{name}.{f}")
        return
    assert a.dtype == b.dtype and a.shape == b.shape, name
    a, b = a.cpu().contiguous(), b.contiguous()      # the CPU load's column slices are strided views
    assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                       b.view(-1).view(torch.uint8) if b.numel() else b), name


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", ["dense", "moe-fused", "moe-per-expert"])
@pytest.mark.parametrize("tp", [1, 2])
def test_staged_load_equals_the_cpu_load(tmp_path, monkeypatch, seed, variant, tp, stored):
    """Every rank's shard on the GPU (whole tensors and row ranges read straight from the files, column
    slices through the reader, float32 files converted on the device) equals the CPU load's bytes."""
    monkeypatch.setattr(upload, "SLAB_BYTES", 40_003)
    spec, ckpt = _checkpoint(tmp_path, seed, variant.startswith("moe"), variant.endswith("per-expert"), stored)
    for rank in range(tp):
        want = load_shard(ckpt, spec, rank, tp, dtype=torch.bfloat16)
        _poison()
        calls = []
        got = load_shard(ckpt, spec, rank, tp, dtype=torch.bfloat16, device="cuda",
                         progress=lambda d, t: calls.append((d, t)))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].is_cuda, k
            _same(got[k], want[k], k)
        total = sum(nbytes(t) for t in want.values())
        assert calls[-1] == (total, total)


def test_staged_and_direct_uploads_agree_on_odd_tensors(monkeypatch, seed):
    """put(): empty, one-element, bool, int, fp8 and QuantWeight tensors, sizes around the slab's."""
    monkeypatch.setattr(upload, "SLAB_BYTES", 4099)
    g = torch.Generator().manual_seed(seed)
    cases = [torch.empty(0, 7), torch.randn(1, generator=g), torch.randn(4099 // 4, generator=g),
             torch.randn(3, 4099, generator=g).to(torch.bfloat16), torch.rand(513, generator=g) > 0.5,
             torch.randint(-2**31, 2**31 - 1, (1000, 3), generator=g, dtype=torch.int64),
             (torch.randn(77, 129, generator=g) * 3).to(torch.float8_e4m3fn),
             torch.randn(64, 96, generator=g)[:, ::2]]                      # not contiguous
    q = quantize_nvfp4(torch.randn(96, 256, generator=g))
    _poison()
    with Upload("cuda") as up:
        got = [up.put(t) for t in cases] + [up.put(q)]
    for i, (a, b) in enumerate(zip(got, cases + [q])):
        _same(a, b.contiguous() if isinstance(b, torch.Tensor) else b, f"case {i}")
    assert up.done == sum(nbytes(t) for t in cases) + nbytes(q)


def test_a_file_cut_short_after_opening_fails_the_load_naming_it(tmp_path, seed):
    spec, ckpt = _checkpoint(tmp_path, seed, False, False, torch.bfloat16)
    info = max(ckpt.tensors.values(), key=lambda i: i.offset)             # the last tensor of its file
    with open(info.file, "r+b") as f:
        f.truncate(info.offset + 10)
    with pytest.raises(Exception) as err:
        load_shard(ckpt, spec, 0, 1, dtype=torch.bfloat16, device="cuda")
    assert info.file in str(err.value) or info.key in str(err.value)
    torch.cuda.synchronize()                                               # the device is still usable
    assert torch.ones(3, device="cuda").sum().item() == 3
