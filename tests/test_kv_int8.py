"""int8 KV cache on the CPU: the quantisation formula (against float64), the paged reference ops
over int8 pools, ModelState allocation, and the demo model with int8 KV against its 16/32-bit KV.

The CUDA kernels (qk_norm_rope_kv_write_i8, gqa_decode_split_i8_g*) are tested against these
reference functions in tests/test_cuda_attention.py (GPU).
"""

import os

import numpy as np
import pytest
import torch

from kernels import reference as ops
from ranks.demo import PACKAGED_DIR
from ranks.kvcache import ModelState
from runtime.config import load_spec


def _f64_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round-half-even(x / scale) clamped, in float64, with the (fp32) scale the function chose."""
    s = scale.double().repeat_interleave(64, dim=-1)
    r = torch.where(s > 0, x.double() / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    return torch.round(r).clamp(-127, 127), r


def test_quantize_matches_float64_formula(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 4, 256, generator=g) * torch.logspace(-20, 6, 300)[:, None, None]
    x[5, 1, 64:128] = 0.0                                                    # a zero group
    x[6, 2, :64] = 1e-35                                                     # below the floor: zero
    for dtype in (torch.float32, torch.bfloat16):
        xi = x.to(dtype)
        q, scale = ops.quantize_kv_int8(xi)
        assert q.dtype == torch.int8 and q.shape == xi.shape
        assert scale.dtype == torch.float32 and scale.shape == (300, 4, 4)
        xd = xi.double()
        amax = xd.view(300, 4, 4, 64).abs().amax(-1)
        live = amax >= ops.KV_INT8_MIN_AMAX
        # the scale is fp32(amax / 127) (correctly rounded), 0 for zero groups
        assert torch.equal(scale[~live], torch.zeros_like(scale[~live]))
        assert torch.equal(scale[live], (amax[live] / 127).float())
        codes, r = _f64_codes(xi, scale)
        # fp32 division can only flip a rounding exactly at a half-integer
        near_tie = ((r - r.floor()) - 0.5).abs() < 1e-5
        assert torch.equal(q.double()[~near_tie], codes[~near_tie])
        assert (q.double() - codes).abs().max() <= 1
        assert int(q.abs().max()) == 127 and int(q.min()) >= -127
        # error <= scale / 2 per element, up to the fp32 division's rounding: x / scale < 128 is
        # off by <= 2^-18 before the round to an integer (an x/scale of 63.4999982 becomes 63.5 -> 64)
        half = scale.double().repeat_interleave(64, dim=-1) / 2
        deq = q.double() * 2 * half                                          # exact in float64
        err = (deq - xd).abs()
        dead = ~live.repeat_interleave(64, dim=-1)
        assert (err[dead] < ops.KV_INT8_MIN_AMAX).all()                     # groups stored as 0
        err[dead] = 0.0
        assert (err <= half * (1 + 2.0 ** -17)).all()
        assert (err[~near_tie] <= half[~near_tie]).all()
        # the fp32 dequantisation is that product rounded once
        assert torch.equal(ops.dequantize_kv_int8(q, scale), deq.float())
        # the element of largest magnitude maps to +-127
        arg = xd.view(300, 4, 4, 64).abs().argmax(-1)
        top = q.view(300, 4, 4, 64).gather(-1, arg[..., None])[..., 0]
        assert (top.abs()[live] == 127).all()
        # zero groups: codes 0, no NaN
        assert not deq.isnan().any()
        assert torch.equal(q[5, 1, 64:128], torch.zeros(64, dtype=torch.int8))
        assert torch.equal(q[6, 2, :64], torch.zeros(64, dtype=torch.int8))
        assert float(scale[5, 1, 1]) == 0.0 and float(scale[6, 2, 0]) == 0.0


def test_quantize_rounds_half_to_even():
    s = 2.0 ** -3                                    # scale = amax / 127 exactly when amax = 127 s
    vals = torch.tensor([127.0, 2.5, 3.5, -2.5, -3.5, 0.5, 1.5, -0.5, 126.5, -126.5] + [0.0] * 54) * s
    q, scale = ops.quantize_kv_int8(vals[None])
    assert float(scale[0, 0]) == s
    assert q[0, :10].tolist() == [127, 2, 4, -2, -4, 0, 2, 0, 126, -126]


def test_quantize_needs_groups_of_64():
    with pytest.raises(ValueError):
        ops.quantize_kv_int8(torch.randn(3, 32))


def test_paged_ops_on_int8_pools_equal_the_dequantised_pools(seed):
    g = torch.Generator().manual_seed(seed)
    P, KV, D, H = 6, 2, 128, 6
    kq, vq = torch.zeros(P, 64, KV, D, dtype=torch.int8), torch.zeros(P, 64, KV, D, dtype=torch.int8)
    ks, vs = torch.zeros(P, 64, KV, D // 64), torch.zeros(P, 64, KV, D // 64)
    table = torch.tensor([4, 0, 3], dtype=torch.int32)
    n = 150
    k, v = torch.randn(n, KV, D, generator=g), torch.randn(n, KV, D, generator=g) * 3
    pos = torch.arange(n)
    ops.paged_kv_write(kq, vq, table, pos[:100], k[:100], v[:100], ks, vs)           # two writes
    ops.paged_kv_write(kq, vq, table, pos[100:], k[100:], v[100:], ks, vs)
    kq_ref, ks_ref = ops.quantize_kv_int8(k)
    assert torch.equal(ops.paged_kv_read(kq, table, n), kq_ref)
    assert torch.equal(ks[table.long()[pos // 64], pos % 64], ks_ref)
    kd = ops.paged_kv_read(kq, table, n, ks)
    vd = ops.paged_kv_read(vq, table, n, vs)
    assert kd.dtype == torch.float32
    assert torch.equal(kd, ops.dequantize_kv_int8(kq_ref, ks_ref))
    # attention over int8 pools == attention over float pools holding the dequantised values
    kf, vf = torch.zeros(P, 64, KV, D), torch.zeros(P, 64, KV, D)
    ops.paged_kv_write(kf, vf, table, pos, kd, vd)
    q = torch.randn(4, H, D, generator=g)
    qpos = torch.arange(n - 4, n)
    got = ops.paged_attention(q, kq, vq, table, qpos, D ** -0.5, k_scale=ks, v_scale=vs)
    ref = ops.paged_attention(q, kf, vf, table, qpos, D ** -0.5)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    fp = ops.paged_attention(q, *(torch.zeros(P, 64, KV, D) for _ in range(2)), table, qpos, D ** -0.5)
    assert fp.shape == got.shape


def _spec():
    if not os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")):
        pytest.skip("no packaged demo model")
    return load_spec(PACKAGED_DIR)


def test_model_state_int8_pools():
    spec = _spec()
    a = ModelState(spec, 2, 5, torch.float32, with_mtp=True)
    b = ModelState(spec, 2, 5, torch.float32, with_mtp=True, kv_dtype="int8")
    assert a.k_scale is None and a.mtp_k_scale is None
    assert a.attention_kv(0)[2:] == (None, None)
    assert b.k[0].dtype == torch.int8 and b.mtp_v.dtype == torch.int8
    D, KV = spec.head_dim, spec.num_kv_heads
    assert b.k_scale[0].shape == (5, 64, KV, D // 64) and b.mtp_v_scale.dtype == torch.float32
    assert len(b.k_scale) == len(b.v_scale) == len(spec.full_attention_layers)
    kv_a = sum(t.numel() * 4 for t in a.k + a.v + [a.mtp_k, a.mtp_v])
    kv_b = sum(t.numel() * (1 + 4 / 64) for t in b.k + b.v + [b.mtp_k, b.mtp_v])
    assert a.nbytes() - b.nbytes() == kv_a - kv_b
    assert ModelState(spec, 1, 1, torch.float32, kv_dtype="bf16").k[0].dtype == torch.float32
    with pytest.raises(ValueError):
        ModelState(spec, 1, 1, torch.float32, kv_dtype="fp8")


@pytest.fixture(scope="module")
def demo_model():
    _spec()
    from ranks.model import HybridModel
    return HybridModel.from_dir(PACKAGED_DIR)


def test_demo_model_teacher_forced_logits_with_int8_kv(demo_model):
    """float32 model, 256 held-out tokens in two prefill chunks (the second reads quantised history)
    and 4 single-token decode steps: logits with int8 KV against the float32 KV.

    Measured on the demo model (384 tokens): relative L2 error 2.3e-3, max |diff| 0.082 (logit std
    2.6), max KL 3.9e-4, argmax agreement 99.7%. Each K/V element moves by at most scale/2 =
    amax/254 (<= 0.4% of its group's largest entry); the bounds below leave ~4x margin."""
    from ranks.model import Batch
    m = demo_model
    here = os.path.dirname(os.path.abspath(__file__))
    ids = torch.from_numpy(np.load(os.path.join(here, "..", "scripts", "demo", "heldout_sample.npy"))
                           .astype(np.int64).reshape(-1)[:260])

    def run(kv):
        st = m.new_state(1, 5, kv_dtype=kv)
        table = torch.arange(5, dtype=torch.int32)[None]
        outs = []
        for lo, hi in ((0, 128), (128, 256), (256, 257), (257, 258), (258, 259), (259, 260)):
            c = ids[lo:hi]
            outs.append(m.forward(Batch(c, [len(c)], [lo], [0], table), st, logits="all").logits)
        return torch.cat(outs), st

    a, sa = run("bf16")
    b, sb = run("int8")
    assert sa.k[0].dtype == torch.float32 and sb.k[0].dtype == torch.int8
    rel = float((a - b).norm() / a.norm())
    assert rel <= 1e-2, rel
    assert float((a - b).abs().max()) <= 0.35
    pa, pb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (pa.exp() * (pa - pb)).sum(-1)
    assert float(kl.max()) <= 5e-3
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.97


def test_demo_model_greedy_with_int8_kv_equals_golden(demo_model):
    from ranks.local import LocalGenerator
    from runtime.sampling import SamplingParams
    from runtime.tokenizer import Tokenizer
    from tests.test_demo_model import GOLDEN
    tok = Tokenizer.from_dir(PACKAGED_DIR)
    for prompt, golden in GOLDEN:
        gen = LocalGenerator(demo_model, kv_dtype="int8")
        out = list(gen.generate(tok.encode(prompt), SamplingParams(temperature=0, max_new_tokens=len(golden)),
                                eos_token_ids=tok.eos_token_ids))
        assert out == golden


def test_engine_options_and_cli_kv_dtype():
    from runtime.engine import EngineOptions
    from server.cli import add_backend_arguments
    import argparse
    assert EngineOptions().kv_dtype == "bf16"
    assert EngineOptions(kv_dtype="int8").kv_dtype == "int8"
    with pytest.raises(ValueError):
        EngineOptions(kv_dtype="fp8")
    p = argparse.ArgumentParser()
    add_backend_arguments(p)
    assert p.parse_args([]).kv_dtype == "bf16"
    assert p.parse_args(["--kv-dtype", "int8"]).kv_dtype == "int8"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-dtype", "fp16"])
