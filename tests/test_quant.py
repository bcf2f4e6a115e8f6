"""CPU tests of kernels/quant.py: formats, round trips, error bounds, shape rules."""

import pytest
import torch

from kernels.quant import (QuantError, QuantWeight, e2m1_to_float, float_to_e2m1, fp8_to_float,
                           from_fp8_checkpoint, from_modelopt, quantize_fp8_blocks, quantize_fp8_rows,
                           quantize_nvfp4)
from tests.util import rel


def _w(seed, O, I, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(O, I, generator=g) * 0.05).to(dtype)


def test_fp8_rows_round_trip(seed):
    w = _w(seed, 37, 80)
    q = quantize_fp8_rows(w)
    assert q.data.dtype == torch.uint8 and q.data.shape == (37, 80)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (37,)
    # float64 formula: code * scale, then one rounding.
    ref64 = fp8_to_float(q.data).double() * q.scale.double()[:, None]
    # the float64 product is exact (4-bit x 24-bit significands): fp32 dequant = one rounding of it
    assert torch.equal(q.dequantize(torch.float32), ref64.float())
    assert torch.equal(q.dequantize(), ref64.float().to(torch.bfloat16))
    # e4m3 has a 3-bit mantissa: elementwise relative error <= 2^-4 for normal codes.
    wf = w.double()
    err = (q.dequantize(torch.float32).double() - wf).abs()
    bound = wf.abs() * 2.0 ** -4 + q.scale.double()[:, None] * 2.0 ** -10
    assert bool((err <= bound).all())
    assert rel(q.dequantize(torch.float32), wf) < 0.04
    # the row amax maps to 448 exactly
    assert torch.equal(fp8_to_float(q.data).abs().amax(1), torch.full((37,), 448.0))


def test_fp8_blocks_round_trip_and_shapes(seed):
    w = _w(seed, 300, 200)
    q = quantize_fp8_blocks(w)
    assert q.scale.shape == (3, 2) and q.scale.dtype == torch.float32
    s = q.scale.double().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    ref64 = fp8_to_float(q.data).double() * s
    assert torch.equal(q.dequantize(torch.float32), ref64.float())     # one rounding of the exact product
    assert rel(q.dequantize(torch.float32), w) < 0.04
    err = (ref64 - w.double()).abs()
    assert bool((err <= w.double().abs() * 2.0 ** -4 + s * 2.0 ** -10).all())


def test_fp8_block_scale_is_a_multiplier():
    w = torch.zeros(128, 128)
    w[0, 0] = 2.0
    q = quantize_fp8_blocks(w)
    assert q.scale.item() == pytest.approx(2.0 / 448)
    assert q.dequantize(torch.float32)[0, 0].item() == pytest.approx(2.0, rel=1e-6)
    q2 = from_fp8_checkpoint(q.data.view(torch.float8_e4m3fn), q.scale)
    assert torch.equal(q2.dequantize(), q.dequantize())


def test_nvfp4_round_trip(seed):
    w = _w(seed, 24, 96)
    q = quantize_nvfp4(w)
    assert q.data.shape == (24, 48) and q.data.dtype == torch.uint8
    assert q.scale.shape == (24, 6) and q.scale.dtype == torch.uint8
    assert q.global_scale.shape == (1,) and q.global_scale.dtype == torch.float32
    amax = w.float().abs().amax()
    assert q.global_scale.item() == pytest.approx((amax / (6 * 448)).item(), rel=1e-6)
    # float64 oracle of the format
    codes = torch.stack([q.data & 15, q.data >> 4], -1).reshape(24, 96)
    ref64 = (e2m1_to_float(codes).double() * fp8_to_float(q.scale).double().repeat_interleave(16, 1)
             * q.global_scale.double())
    assert (q.dequantize(torch.float32).double() - ref64).abs().max().item() <= 1e-6 * ref64.abs().max().item()
    # e2m1 step is at most 1/3 of the group max (between 4 and 6) -> error <= group amax / 6 * ~(1 + fp8 rounding)
    wf = w.double().view(24, 6, 16)
    gmax = wf.abs().amax(-1, keepdim=True)
    err = (q.dequantize(torch.float32).double().view(24, 6, 16) - wf).abs()
    assert bool((err <= gmax / 6 * 1.2 + 1e-12).all())
    assert rel(q.dequantize(torch.float32), w) < 0.15


def test_nvfp4_nibble_order():
    # element 2i in the low nibble: a row [0.5, -6, 0...] -> byte 0 = code(0.5)=1 | code(-6)=15 << 4
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 0.5, -6.0
    q = quantize_nvfp4(w, global_scale=1.0)
    assert q.scale[0, 0].item() == fp8_code(1.0)
    assert q.data[0, 0].item() == 0x1 | (0xF << 4)
    assert q.data[0, 1:].eq(0).all()
    d = q.dequantize(torch.float32)
    assert d[0, 0].item() == 0.5 and d[0, 1].item() == -6.0 and d[0, 2:].eq(0).all()


def fp8_code(v: float) -> int:
    return torch.tensor([v]).to(torch.float8_e4m3fn).view(torch.uint8).item()


def test_e2m1_rounding_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.26, -0.0, 0.1])
    got = e2m1_to_float(float_to_e2m1(x))
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, 0.0, 0.0]


def test_from_modelopt_matches():
    w = torch.randn(8, 32)
    q = quantize_nvfp4(w)
    q2 = from_modelopt(q.data, q.scale.view(torch.float8_e4m3fn), q.global_scale.reshape(()))
    assert q2.kind == "nvfp4" and q2.shape == (8, 32)
    assert torch.equal(q2.dequantize(), q.dequantize())


def test_zero_weight():
    for fn in (quantize_fp8_rows, quantize_fp8_blocks, quantize_nvfp4):
        q = fn(torch.zeros(4, 32))
        assert q.dequantize().eq(0).all()


def test_shape_rules():
    with pytest.raises(QuantError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(QuantError, match="2-D"):
        quantize_fp8_rows(torch.randn(8))
    with pytest.raises(QuantError, match="scale: shape"):
        QuantWeight("fp8_block", 130, 64, torch.zeros(130, 64, dtype=torch.uint8), torch.ones(1, 1))
    with pytest.raises(QuantError, match="data: shape"):
        QuantWeight("nvfp4", 4, 32, torch.zeros(4, 32, dtype=torch.uint8),
                    torch.zeros(4, 2, dtype=torch.uint8), 1.0)
    with pytest.raises(QuantError, match="kind"):
        QuantWeight("int4", 4, 32, torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4))
    with pytest.raises(QuantError, match="scale: dtype"):
        QuantWeight("fp8_row", 4, 32, torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, dtype=torch.float64))
