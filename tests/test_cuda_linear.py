"""GPU tests of kernels/cuda_linear.py (decode GEMV, SwiGLU / residual epilogues, dequantisation)
against kernels/reference.py in fp32 on the dequantised weights."""

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref
from kernels.launch import KernelError
from tests.util import rel

pytestmark = pytest.mark.gpu

KINDS = ("bf16", "fp8_row", "fp8_block", "nvfp4")

# (O, I): 27B dense, then 35B-A3B (E = 2048)
SHAPES_27B = [(12288, 5120), (1024, 5120), (5120, 6144), (10240, 5120), (6144, 5120), (48, 5120),
              (34816, 5120), (5120, 17408)]
SHAPES_35B = [(8192, 2048), (512, 2048), (2048, 4096), (4096, 2048), (32, 2048), (1024, 2048),
              (2048, 512), (256, 2048)]
LM_HEAD = [(248320, 5120), (248320, 2048)]


@pytest.fixture(autouse=True)
def every_column_count_on_the_gemv(monkeypatch):
    """The kernels are tested at every T they are built for (bf16 1..16, quantised 1..64 in launches
    of up to 32), whatever the route table sends to cuBLAS in production; test_routes_to_cublas
    covers the other side."""
    from kernels import cuda_linear
    monkeypatch.setattr(cuda_linear, "GEMV_COLUMNS", dict(cuda_linear.GEMV_COLUMNS, bf16=cuda_linear.MAX_GEMV_COLUMNS))


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _weight(kind, O, I, seed):
    from kernels import quant
    w = (torch.randn(O, I, device="cuda", generator=_gen(seed)) * 0.02).to(torch.bfloat16)
    if kind == "bf16":
        return w, w.float()
    q = {"fp8_row": quant.quantize_fp8_rows, "fp8_block": quant.quantize_fp8_blocks,
         "nvfp4": quant.quantize_nvfp4}[kind](w)
    return q, q.dequantize(torch.float32)


def _x(T, I, seed):
    return torch.randn(T, I, device="cuda", generator=_gen(seed + 1)).to(torch.bfloat16)


def _check(got, want):
    assert not torch.isnan(got).any(), "NaN in the output (unwritten poison?)"
    assert rel(got, want) <= 1e-2, rel(got, want)


def _run_linear(kind, O, I, T, seed, residual=False):
    from kernels.cuda_linear import linear
    w, wf = _weight(kind, O, I, seed)
    x = _x(T, I, seed)
    out = torch.full((T, O), float("nan"), dtype=torch.bfloat16, device="cuda")
    want = ref.linear(x.float(), wf)
    if residual:
        res = torch.randn(T, O, device="cuda", generator=_gen(seed + 2)).to(torch.bfloat16)
        want = res.float() + want
        got = linear(x, w, out=out, residual=res)
    else:
        got = linear(x, w, out=out)
    assert got is out
    _check(got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("O,I", SHAPES_27B + SHAPES_35B)
def test_model_shapes(kind, O, I, seed):
    for T in (1, 5) if kind == "bf16" else (1, 5, 13, 32):
        _run_linear(kind, O, I, T, seed + T)


@pytest.mark.parametrize("kind", ("bf16", "nvfp4"))
@pytest.mark.parametrize("O,I", LM_HEAD)
def test_lm_head(kind, O, I, seed):
    _run_linear(kind, O, I, 2, seed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("O", (1, 3, 77))
@pytest.mark.parametrize("I", (16, 48, 64, 1040, 1056))
def test_odd_shapes(kind, O, I, seed):
    for T in (1, 2, 3, 5, 8, 16) if kind == "bf16" else (1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 64):
        _run_linear(kind, O, I, T, seed + T)


@pytest.mark.parametrize("kind", KINDS)
def test_residual(kind, seed):
    for O, I, T in ((5120, 6144, 1), (77, 1040, 3), (2048, 4096, 16), (2048, 4096, 24), (300, 512, 40)):
        _run_linear(kind, O, I, T, seed + T, residual=True)


def test_residual_in_place(seed):
    from kernels.cuda_linear import linear
    w, wf = _weight("fp8_block", 300, 256, seed)
    x = _x(4, 256, seed)
    res = torch.randn(4, 300, device="cuda", generator=_gen(seed + 5)).to(torch.bfloat16)
    want = res.float() + x.float() @ wf.t()
    got = linear(x, w, out=res, residual=res)
    assert got is res
    _check(got, want)


def _swiglu_want(x, wf):
    Fh = wf.shape[0] // 2
    return F.silu(ref.linear(x.float(), wf[:Fh])) * ref.linear(x.float(), wf[Fh:])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("O,I,T", [(34816, 5120, 1), (34816, 5120, 4), (1024, 2048, 16), (6, 48, 3),
                                   (154, 1040, 5), (2, 64, 1), (300, 512, 17), (34816, 5120, 24),
                                   (1024, 2048, 40), (154, 1040, 65)])
def test_swiglu(kind, O, I, T, seed):
    from kernels.cuda_linear import linear_swiglu
    w, wf = _weight(kind, O, I, seed)
    x = _x(T, I, seed)
    out = torch.full((T, O // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = linear_swiglu(x, w, out=out)
    assert got is out
    _check(got, _swiglu_want(x, wf))


@pytest.mark.parametrize("T", (3, 8, 16))
def test_routes_to_cublas(T, seed, monkeypatch):
    """With the production route table, bf16 beyond GEMV_COLUMNS goes through cuBLAS: same results."""
    from kernels import cuda_linear
    monkeypatch.setattr(cuda_linear, "GEMV_COLUMNS", dict(cuda_linear.GEMV_COLUMNS, bf16=2))
    assert cuda_linear.route(5120, 6144, T, "bf16", 132)["path"] == "dequant_matmul"
    _run_linear("bf16", 5120, 6144, T, seed)
    _run_linear("bf16", 5120, 6144, T, seed + 1, residual=True)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill(kind, seed, monkeypatch):
    from kernels import cuda_linear
    monkeypatch.setattr(cuda_linear, "PREFILL_SLAB_ELEMS", 128 * 512)     # several slabs
    for O, I, T in ((300, 512, 17), (1000, 512, 40), (1000, 512, 65)):
        _run_linear(kind, O, I, T, seed + T)
        _run_linear(kind, O, I, T, seed + T + 1, residual=True)


@pytest.mark.parametrize("kind", ("fp8_row", "fp8_block", "nvfp4"))
@pytest.mark.parametrize("O,I", [(1, 16), (77, 1040), (300, 4096), (5120, 6144)])
def test_dequantize_bit_exact(kind, O, I, seed):
    from kernels.cuda_linear import dequantize
    w, _ = _weight(kind, O, I, seed)
    out = torch.full((O, I), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = dequantize(w, out=out)
    assert torch.equal(got.view(torch.int16), w.dequantize().view(torch.int16))


def test_cuda_graph_capture(seed):
    from kernels.cuda_linear import linear, linear_swiglu
    w, wf = _weight("nvfp4", 1024, 2048, seed)
    wg, wgf = _weight("fp8_block", 512, 2048, seed + 3)
    x = _x(3, 2048, seed)
    out = torch.empty(3, 1024, dtype=torch.bfloat16, device="cuda")
    out2 = torch.empty(3, 256, dtype=torch.bfloat16, device="cuda")
    linear(x, w, out=out)                                  # compile + warm up outside the capture
    linear_swiglu(x, wg, out=out2)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            linear(x, w, out=out)
            linear_swiglu(x, wg, out=out2)
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(_x(3, 2048, seed + 9))
    out.fill_(float("nan"))
    out2.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(out, ref.linear(x.float(), wf))
    _check(out2, _swiglu_want(x, wgf))


def test_errors():
    from kernels.cuda_linear import linear, linear_swiglu
    from kernels import quant
    w = torch.zeros(8, 12, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(KernelError, match="% 8"):
        linear(torch.zeros(1, 12, dtype=torch.bfloat16, device="cuda"), w)
    w = torch.zeros(8, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(KernelError, match="x: shape"):
        linear(torch.zeros(1, 32, dtype=torch.bfloat16, device="cuda"), w)
    with pytest.raises(KernelError, match="x: dtype"):
        linear(torch.zeros(1, 16, dtype=torch.float32, device="cuda"), w)
    with pytest.raises(KernelError, match="out: shape"):
        linear(torch.zeros(2, 16, dtype=torch.bfloat16, device="cuda"), w,
               out=torch.empty(1, 8, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(KernelError, match="even number of rows"):
        linear_swiglu(torch.zeros(1, 16, dtype=torch.bfloat16, device="cuda"),
                      torch.zeros(7, 16, dtype=torch.bfloat16, device="cuda"))
    q = quant.quantize_fp8_rows(torch.zeros(4, 24, device="cuda"))
    with pytest.raises(KernelError, match="in_features % 16"):
        linear(torch.zeros(1, 24, dtype=torch.bfloat16, device="cuda"), q)
