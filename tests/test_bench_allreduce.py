"""scripts/bench/allreduce.py's result check, on the CPU with stand-in transports: a right sum is
'exact', a one-ulp difference passes only where exactness is not promised (NCCL), and a wrong sum is
reported as such."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import allreduce  # noqa: E402


def _inputs(size):
    g = torch.Generator().manual_seed(size)
    return [torch.randn(size // 2, generator=g).to(torch.bfloat16) for _ in range(2)]


def test_check_tells_exact_close_and_wrong():
    size = 10240
    xs = _inputs(size)
    exact_sum = (xs[0].float() + xs[1].float()).to(torch.bfloat16)
    for rank in (0, 1):
        assert allreduce._check(torch, lambda t: exact_sum.clone(), size, rank, "cpu", exact=True) == "exact"
    nudged = exact_sum.clone()
    nudged.view(torch.int16)[:8] += 1                     # the next bf16 value in magnitude: one ulp off
    assert allreduce._check(torch, lambda t: nudged.clone(), size, 0, "cpu", exact=False) == "close"
    assert allreduce._check(torch, lambda t: nudged.clone(), size, 0, "cpu", exact=True).startswith("WRONG")
    assert allreduce._check(torch, lambda t: t, size, 1, "cpu", exact=False).startswith("WRONG")
