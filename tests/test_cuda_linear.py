"""GPU tests of kernels/cuda_linear.py (decode GEMV, SwiGLU / residual epilogues, dequantisation)
against kernels/reference.py in fp32 on the dequantised weights.

The GEMV tests run under both GEMV variants (TANDEM_GEMV_VARIANT=default | pipelined, the `variant`
fixture); test_pipelined_* cover the cp.async-pipelined kernels (gemv_*_pipe, T <= 8) at every column
count, and check them bit for bit against the tensor-core kernels they re-implement."""

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


VARIANTS = ("tc", "pipelined")
PIPE_KINDS = ("fp8_row", "fp8_block", "nvfp4")        # pipe kernels that re-implement a gemv_*_tc kernel
PIPE_ALL = ("bf16",) + PIPE_KINDS                     # every gemv_*_pipe kernel
_TAG = {"bf16": "bf16", "fp8_row": "fp8row", "fp8_block": "fp8blk", "nvfp4": "nvfp4"}


@pytest.fixture(autouse=True)
def default_variant_unless_asked(monkeypatch):
    """Tests without the `variant` fixture run the default route, whatever the environment says."""
    monkeypatch.delenv("TANDEM_GEMV_VARIANT", raising=False)


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """The GEMV variant the test's launches are routed with (kernels/cuda_linear.py reads it at route time)."""
    monkeypatch.setenv("TANDEM_GEMV_VARIANT", request.param)
    return request.param


@pytest.fixture(autouse=True)
def every_column_count_on_the_gemv(monkeypatch):
    """The kernels are tested at every T they are built for (bf16 1..16, quantised 1..64 in launches
    of up to 32), whatever the route table sends to cuBLAS in production; test_routes_to_cublas
    covers the other side."""
    from kernels import cuda_linear
    monkeypatch.setattr(cuda_linear, "GEMV_COLUMNS", dict(cuda_linear.GEMV_COLUMNS, bf16=cuda_linear.MAX_GEMV_COLUMNS,
                                                          nvfp4=64))


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


def _check(got, want, scale=None):
    """Relative error <= 1e-2, relative to ||want|| or to `scale` (the size of the terms a result is
    the sum of, where their cancellation would blow up an allowed rounding: a residual add)."""
    assert not torch.isnan(got).any(), "NaN in the output (unwritten poison?)"
    if scale is None:
        assert rel(got, want) <= 1e-2, rel(got, want)
    else:
        err = float((got.float() - want.float()).norm() / scale)
        assert err <= 1e-2, err


def _run_linear(kind, O, I, T, seed, residual=False):
    w, wf = _weight(kind, O, I, seed)
    _linear_vs_reference(w, wf, T, seed, 1 if residual else 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("O,I", SHAPES_27B + SHAPES_35B)
def test_model_shapes(kind, O, I, seed, variant):
    for T in (1, 5) if kind == "bf16" else (1, 5, 13, 32):
        _run_linear(kind, O, I, T, seed + T)


@pytest.mark.parametrize("kind", ("bf16", "nvfp4"))
@pytest.mark.parametrize("O,I", LM_HEAD)
def test_lm_head(kind, O, I, seed, variant):
    _run_linear(kind, O, I, 2, seed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("O", (1, 3, 77))
@pytest.mark.parametrize("I", (16, 48, 64, 1040, 1056))
def test_odd_shapes(kind, O, I, seed, variant):
    for T in (1, 2, 3, 5, 8, 16) if kind == "bf16" else (1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 64):
        _run_linear(kind, O, I, T, seed + T)


@pytest.mark.parametrize("kind", KINDS)
def test_residual(kind, seed, variant):
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
    """The epilogue's contract, bf16(bf16(silu(bf16(gate))) * bf16(up)), on fp32 products (without
    the roundings, a single-element output can be off by four bf16 roundings, ~1.5%)."""
    Fh = wf.shape[0] // 2
    gate = ref.linear(x.float(), wf[:Fh]).bfloat16().float()
    up = ref.linear(x.float(), wf[Fh:]).bfloat16().float()
    return F.silu(gate).bfloat16().float() * up


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("O,I,T", [(34816, 5120, 1), (34816, 5120, 4), (1024, 2048, 16), (6, 48, 3),
                                   (154, 1040, 5), (2, 64, 1), (300, 512, 17), (34816, 5120, 24),
                                   (1024, 2048, 40), (154, 1040, 65)])
def test_swiglu(kind, O, I, T, seed, variant):
    from kernels.cuda_linear import linear_swiglu
    w, wf = _weight(kind, O, I, seed)
    x = _x(T, I, seed)
    out = torch.full((T, O // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = linear_swiglu(x, w, out=out)
    assert got is out
    _check(got, _swiglu_want(x, wf))


@pytest.mark.parametrize("T", (3, 8, 16))
def test_routes_to_cublas(T, seed, monkeypatch):
    """With the production route table, bf16 beyond GEMV_COLUMNS goes through cuBLAS, a small bf16
    weight (the GDN a|b) stays on the GEMV: same results."""
    from kernels import cuda_linear
    monkeypatch.setattr(cuda_linear, "GEMV_COLUMNS", dict(cuda_linear.GEMV_COLUMNS, bf16=2))
    monkeypatch.setenv(cuda_linear.BF16_PIPE_ENV, "0")          # the mid-sized window: the test below
    assert cuda_linear.route(5120, 6144, T, "bf16", 132)["path"] == "dequant_matmul"
    _run_linear("bf16", 5120, 6144, T, seed)
    _run_linear("bf16", 5120, 6144, T, seed + 1, residual=True)
    assert cuda_linear.route(96, 5120, T, "bf16", 132)["path"] == "gemv"
    _run_linear("bf16", 96, 5120, T, seed + 2)


@pytest.mark.parametrize("T", (3, 5, 8))
@pytest.mark.parametrize("O,I", [(5120, 6144), (12288, 5120), (5120, 17408), (2048, 4096)])
def test_mid_sized_bf16_routes_to_the_pipelined_gemv(O, I, T, seed, monkeypatch):
    """With the production route table, a bf16 weight inside BF16_PIPE_ELEMS (the 27B's o / q / down,
    the 35B-A3B's layers) at 3..8 columns runs gemv_bf16_pipe: within the reference's bounds."""
    from kernels import cuda_linear
    monkeypatch.setattr(cuda_linear, "GEMV_COLUMNS", dict(cuda_linear.GEMV_COLUMNS, bf16=2))
    monkeypatch.delenv(cuda_linear.BF16_PIPE_ENV, raising=False)
    assert cuda_linear.route(O, I, T, "bf16", 132)["kernel"] == "gemv_bf16_pipe"
    _run_linear("bf16", O, I, T, seed)
    _run_linear("bf16", O, I, T, seed + 1, residual=True)


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


def _captured(program):
    """program() run once eagerly (compiles, allocates the GEMM workspace, warms up), then captured into a
    CUDA graph on a side stream, which is returned."""
    program()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            program()
    torch.cuda.current_stream().wait_stream(s)
    return g


def test_cuda_graph_capture(seed, variant):
    from kernels.cuda_linear import linear, linear_swiglu
    w, wf = _weight("nvfp4", 1024, 2048, seed)
    wg, wgf = _weight("fp8_block", 512, 2048, seed + 3)
    x = _x(3, 2048, seed)
    out = torch.empty(3, 1024, dtype=torch.bfloat16, device="cuda")
    out2 = torch.empty(3, 256, dtype=torch.bfloat16, device="cuda")
    g = _captured(lambda: (linear(x, w, out=out), linear_swiglu(x, wg, out=out2)))
    x.copy_(_x(3, 2048, seed + 9))
    out.fill_(float("nan"))
    out2.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(out, ref.linear(x.float(), wf))
    _check(out2, _swiglu_want(x, wgf))


# ------------------------------------------------------------------------------------------------
# The pipelined variant (gemv_*_pipe): every column count it serves, the model shapes, odd shapes
# (partial last steps, tails of 128-row fp8 blocks, rows past O), all three epilogues.

PIPE_ODD_O = (1, 2, 3, 77, 300)
PIPE_ODD_I = (16, 48, 64, 192, 1040, 1088, 4160)
# (kind, I) the pipe kernels serve (fp8: I % 16 == 0; nvfp4: I % 64 == 0; the other nvfp4 widths keep
# the older kernels, test_odd_shapes with variant=pipelined and tests/test_linear_route.py cover that)
PIPE_ODD_KI = [(k, i) for k in PIPE_ALL for i in PIPE_ODD_I if i % (64 if k == "nvfp4" else 16) == 0]
PIPE_ODD_KI_TC = [(k, i) for k, i in PIPE_ODD_KI if k in PIPE_KINDS]


def _pipe_kernel(kind, O, I, T, swiglu=False):
    """The kernel the pipelined route picks (asserting it is a pipe kernel)."""
    from kernels import cuda_linear as cl
    r = cl.route(O, I, T, kind, torch.cuda.get_device_properties(0).multi_processor_count,
                 swiglu=swiglu, variant="pipelined")
    assert r["kernel"] == f"gemv_{_TAG[kind]}_pipe", r
    return r


def _linear_vs_reference(w, wf, T, seed, mode):
    """One linear (mode 0), residual linear (1) or SwiGLU (2) through kernels.cuda_linear, output
    poisoned with NaN first, against the fp32 reference on the dequantised weight."""
    from kernels.cuda_linear import linear, linear_swiglu
    O, I = wf.shape
    x = _x(T, I, seed)
    scale = None
    if mode == 2:
        out = torch.full((T, O // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = linear_swiglu(x, w, out=out)
        want = _swiglu_want(x, wf)
    else:
        out = torch.full((T, O), float("nan"), dtype=torch.bfloat16, device="cuda")
        want = ref.linear(x.float(), wf)
        if mode == 1:
            # bf16(residual + bf16(y)): y's rounding is part of the contract, and where residual and y
            # cancel it is large next to the sum, so the bound is relative to the terms' size
            res = torch.randn(T, O, device="cuda", generator=_gen(seed + 2)).to(torch.bfloat16)
            scale = float(res.float().norm() + want.norm())
            want = res.float() + want
            got = linear(x, w, out=out, residual=res)
        else:
            got = linear(x, w, out=out)
    assert got is out
    _check(got, want, scale)


@pytest.mark.parametrize("kind", PIPE_ALL)
@pytest.mark.parametrize("O,I", SHAPES_27B + SHAPES_35B)
def test_pipelined_model_shapes(kind, O, I, seed, monkeypatch):
    monkeypatch.setenv("TANDEM_GEMV_VARIANT", "pipelined")
    w, wf = _weight(kind, O, I, seed)
    for T in range(1, 9):
        _pipe_kernel(kind, O, I, T)
        _linear_vs_reference(w, wf, T, seed + T, mode=0)
    for T in (1, 4, 8):
        _linear_vs_reference(w, wf, T, seed + 10 + T, mode=1)
        if O % 2 == 0:
            _pipe_kernel(kind, O, I, T, swiglu=True)
            _linear_vs_reference(w, wf, T, seed + 20 + T, mode=2)


@pytest.mark.parametrize("kind,I", PIPE_ODD_KI)
@pytest.mark.parametrize("O", PIPE_ODD_O)
def test_pipelined_odd_shapes(kind, O, I, seed, monkeypatch):
    monkeypatch.setenv("TANDEM_GEMV_VARIANT", "pipelined")
    w, wf = _weight(kind, O, I, seed)
    for T in range(1, 9):
        _pipe_kernel(kind, O, I, T)
        for mode in (0, 1, 2) if O % 2 == 0 else (0, 1):
            _linear_vs_reference(w, wf, T, seed + 3 * T + mode, mode)


def _launch(kernel, x, w, out, ks, mode, residual=None):
    """One launch of gemv.cu's `kernel` (a 16-row-tile kernel: gemv_*_tc or gemv_*_pipe) with the
    I-split forced to ks, as kernels.cuda_linear._gemv would launch it."""
    from kernels import cuda_linear as cl
    from kernels import launch as L
    _, O, I, data, scale, gscale, sb = cl._check_weight(w, "w")
    tiles = -(-(O // 2) // 8) if mode == 2 else -(-O // 16)
    d = L.device_of(x)
    L.launch(L.kernel("gemv", kernel, d), (-(-tiles // (8 // ks)),), (256,),
             (out, x, data, scale, gscale, residual, O, I, x.shape[0], ks, mode, O // 2 if mode == 2 else 0, sb,
              None, None, None, O, O, O),
             device=d)
    return out


def _same_bits(kind, w, O, I, seed, pairs, max_kt=None):
    """Each (kernel a, kernel b, column counts) of `pairs` does the same arithmetic in the same order
    (the same decoded bf16 words, the same mma sequence per warp, the same reductions): with the same ks
    the outputs are equal bit for bit, for every ks (whose x per iteration fits max_kt elements, when
    given), column count and epilogue."""
    epc = 32 if kind == "nvfp4" else 16
    steps = -(-(I // epc) // 4)
    for ks in (k for k in (1, 2, 4, 8) if k <= steps and (max_kt is None or k * 4 * epc <= max_kt)):
        for a, b, cols in pairs:
            for T in cols:
                x = _x(T, I, seed + 7 * ks + T)
                res = torch.randn(T, O, device="cuda", generator=_gen(seed + ks + T)).to(torch.bfloat16)
                for mode in (0, 1, 2) if O % 2 == 0 else (0, 1):
                    shape = (T, O // 2) if mode == 2 else (T, O)
                    outs = []
                    for kernel in (a, b):
                        out = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
                        outs.append(_launch(kernel, x, w, out, ks, mode, res if mode == 1 else None))
                    assert not torch.isnan(outs[1]).any(), (b, ks, T, mode, "unwritten output")
                    assert torch.equal(outs[0], outs[1]), (b, ks, T, mode, rel(outs[1], outs[0]))


def _pipe_equals_tc(kind, w, O, I, seed):
    """gemv_*_pipe re-implements gemv_*_tc (one column tile)."""
    tag = _TAG[kind]
    _same_bits(kind, w, O, I, seed, [(f"gemv_{tag}_tc", f"gemv_{tag}_pipe", (1, 3, 8))])


@pytest.mark.parametrize("kind", PIPE_KINDS)
@pytest.mark.parametrize("O,I", SHAPES_27B + SHAPES_35B)
def test_pipelined_matches_tensor_core_kernel(kind, O, I, seed):
    w, _ = _weight(kind, O, I, seed)
    _pipe_equals_tc(kind, w, O, I, seed)


@pytest.mark.parametrize("kind,I", PIPE_ODD_KI_TC)
@pytest.mark.parametrize("O", PIPE_ODD_O)
def test_pipelined_matches_tensor_core_kernel_odd(kind, O, I, seed):
    w, _ = _weight(kind, O, I, seed)
    _pipe_equals_tc(kind, w, O, I, seed)


def test_pipelined_every_scale_code(seed, monkeypatch):
    """nvfp4 group scales of every finite e4m3 code (zero, subnormals, negatives), which random
    weights never produce: gemv_nvfp4_pipe decodes them in bf16 arithmetic (subnormal inputs),
    gemv_nvfp4_tc through fp16. Rows 0-15 have only zero and subnormal scales, so a flush to zero
    would show in their error, not only in the bit-for-bit comparison."""
    from kernels.quant import QuantWeight
    O, I = 256, 4096
    gen = _gen(seed)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8, device="cuda")
    tiny = torch.tensor([c for c in range(256) if c & 0x78 == 0], dtype=torch.uint8, device="cuda")  # exponent 0
    scale = finite[torch.randint(0, finite.numel(), (O, I // 16), device="cuda", generator=gen)]
    scale[:16] = tiny[torch.randint(0, tiny.numel(), (16, I // 16), device="cuda", generator=gen)]
    assert torch.isin(finite, scale).all()
    data = torch.randint(0, 256, (O, I // 2), dtype=torch.uint8, device="cuda", generator=gen)
    w = QuantWeight("nvfp4", O, I, data, scale.contiguous(), torch.tensor([0.01], device="cuda"))
    wf = w.dequantize(torch.float32)
    _pipe_equals_tc("nvfp4", w, O, I, seed)
    monkeypatch.setenv("TANDEM_GEMV_VARIANT", "pipelined")
    from kernels.cuda_linear import linear
    for T in (1, 8):
        _pipe_kernel("nvfp4", O, I, T)
        x = _x(T, I, seed + T)
        out = torch.full((T, O), float("nan"), dtype=torch.bfloat16, device="cuda")
        linear(x, w, out=out)
        want = ref.linear(x.float(), wf)
        _check(out, want)
        _check(out[:, :16], want[:, :16])


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


# ------------------------------------------------------------------------------------------------
# Programmatic dependent launch (kernels/launch.py, pdl=True): the GEMV's blocks start under the
# previous kernel's tail and must not read x / the residual, or write y, before pdl_wait.

def _pdl_chain(kind, layers, seed, graph: bool):
    """x <- x + W_l rms_norm(x) for `layers` weights, in place (the GEMV reads the residual and writes
    the buffer the next norm reads), eagerly or as one captured graph; returns the final x."""
    from kernels import cuda_misc as cm
    from kernels.cuda_linear import linear
    E = 5120
    ws = [_weight(kind, E, E, seed + 11 * l)[0] for l in range(layers)]
    nw = (0.1 * torch.randn(E, device="cuda", generator=_gen(seed + 7))).to(torch.bfloat16)   # zero-centred
    x0 = _x(2, E, seed)
    x = x0.clone()
    h = torch.empty_like(x)

    def run():
        for w in ws:
            cm.rms_norm(x, nw, 1e-6, out=h)
            linear(h, w, out=x, residual=x)

    if not graph:
        run()
        torch.cuda.synchronize()
        return x.clone(), ws, nw, x0
    run()                                                   # compile + warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            run()
    torch.cuda.current_stream().wait_stream(s)
    outs = []
    for _ in range(3):                                      # replays from the same start agree
        x.copy_(x0)
        g.replay()
        torch.cuda.synchronize()
        outs.append(x.clone())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    return outs[0], ws, nw, x0


@pytest.mark.parametrize("kind", ("bf16", "fp8_row", "nvfp4"))
@pytest.mark.parametrize("graph", (False, True), ids=("eager", "graph"))
def test_dependent_launch_chain(kind, graph, seed, variant, monkeypatch):
    """A chain of norm -> GEMV (residual, in place) layers gives bit for bit the results of the same
    kernels launched the ordinary way, and follows the float32 reference."""
    from kernels import launch as L
    if torch.cuda.get_device_capability()[0] >= 9:
        assert L.pdl_enabled(), "sm_90+: the GEMV should be a programmatic dependent launch"
    got, ws, nw, x0 = _pdl_chain(kind, 12, seed, graph)
    monkeypatch.setattr(L, "pdl_enabled", lambda device=None: False)
    want, _, _, _ = _pdl_chain(kind, 12, seed, graph)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    xf = x0.float()                                         # float32 reference on the dequantised weights
    for w in ws:
        wf = w.float() if kind == "bf16" else w.dequantize(torch.float32)
        hf = ref.rms_norm(xf, nw.float(), 1e-6)
        xf = xf + hf @ wf.t()
    # 12 layers of bf16 roundings (norm output, GEMV output, residual sum) against none: ~0.2% each,
    # growing like their square root; a read of x before the norm wrote it would be O(1).
    assert not torch.isnan(got).any()
    assert rel(got, xf) <= 3e-2, rel(got, xf)


# ------------------------------------------------------------------------------------------------
# Fused weights with several outputs (linear_split): q|k|v, GDN qkv|z and a|b at the 27B and 35B-A3B
# shapes, and odd ones; the GEMV writes each part's rows to its own output in one launch, cuBLAS runs
# one matmul per part.

SPLITS = [((12288, 1024, 1024), 5120), ((10240, 6144), 5120), ((48, 48), 5120), ((8192, 512, 512), 2048),
          ((8192, 4096), 2048), ((32, 32), 2048), ((128, 256, 384, 128), 1040), ((77, 3, 40, 16), 1040)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes,I", SPLITS)
def test_linear_split(kind, sizes, I, seed, variant):
    from kernels.cuda_linear import linear_split
    bounds = [sum(sizes[:i]) for i in range(1, len(sizes))]
    if kind == "fp8_block" and any(b % 128 for b in bounds):
        pytest.skip("fp8_block parts start at multiples of 128 rows (the model keeps other groups apart)")
    w, wf = _weight(kind, sum(sizes), I, seed)
    for T in (1, 3, 8, 13) + (() if kind == "bf16" else (40, 70)):
        x = _x(T, I, seed + T)
        outs = [torch.full((T, n), float("nan"), dtype=torch.bfloat16, device="cuda") for n in sizes]
        got = linear_split(x, w, sizes, outs=outs)
        want = ref.linear(x.float(), wf)
        a = 0
        for o, g, n in zip(outs, got, sizes):
            assert g is o
            _check(g, want[:, a:a + n])
            a += n
    fresh = linear_split(_x(2, I, seed), w, sizes)                       # outputs allocated
    assert [tuple(t.shape) for t in fresh] == [(2, n) for n in sizes]


def test_linear_split_errors(seed):
    from kernels.cuda_linear import linear_split
    w, _ = _weight("bf16", 96, 64, seed)
    x = _x(1, 64, seed)
    with pytest.raises(KernelError, match="summing to 96"):
        linear_split(x, w, [32, 32])
    with pytest.raises(KernelError, match="1 to 4"):
        linear_split(x, w, [16] * 6)
    with pytest.raises(KernelError, match="2 outputs for 3 parts"):
        linear_split(x, w, [32, 32, 32], outs=[torch.empty(1, 32, dtype=torch.bfloat16, device="cuda")] * 2)
    with pytest.raises(KernelError, match=r"outs\[1\]: shape"):
        linear_split(x, w, [32, 64], outs=[torch.empty(1, 32, dtype=torch.bfloat16, device="cuda"),
                                           torch.empty(1, 32, dtype=torch.bfloat16, device="cuda")])


# ------------------------------------------------------------------------------------------------
# The x-staging kernels (gemv_*_xs16 / xs32, 9..32 columns per launch, the default route there):
# gemv_*_tc16 / tc32's arithmetic with x read from a per-block shared copy, so the same bits for the
# same ks; test_model_shapes / test_odd_shapes / test_residual check them against the reference.

XS_ODD = [(k, o, i) for k in PIPE_KINDS for o in (1, 3, 77, 300) for i in (16, 48, 1040, 4160)
          if i % (32 if k == "nvfp4" else 16) == 0]


def _staged_equals_tc(kind, w, O, I, seed):
    """gemv_*_xs16 / xs32 re-implement gemv_*_tc16 / tc32 (x read from shared memory), for every ks whose
    iteration of x fits the staging buffer (256 elements per column)."""
    tag = _TAG[kind]
    _same_bits(kind, w, O, I, seed, [(f"gemv_{tag}_tc16", f"gemv_{tag}_xs16", (9, 16)),
                                     (f"gemv_{tag}_tc32", f"gemv_{tag}_xs32", (17, 32))], max_kt=256)


@pytest.mark.parametrize("kind", PIPE_KINDS)
@pytest.mark.parametrize("O,I", SHAPES_27B + SHAPES_35B)
def test_staged_matches_tensor_core_kernel(kind, O, I, seed):
    w, _ = _weight(kind, O, I, seed)
    _staged_equals_tc(kind, w, O, I, seed)


@pytest.mark.parametrize("kind,O,I", XS_ODD)
def test_staged_matches_tensor_core_kernel_odd(kind, O, I, seed):
    w, _ = _weight(kind, O, I, seed)
    _staged_equals_tc(kind, w, O, I, seed)


@pytest.mark.parametrize("kind", PIPE_KINDS)
def test_staged_route_is_taken_and_matches_the_reference(kind, seed, monkeypatch):
    """With the staging kernels on, a wide layer's 9..32 columns (and 33..64 in two launches) take them."""
    from kernels import cuda_linear as cl
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.setenv(cl.STAGED_ENV, "all")
    monkeypatch.setenv(cl.MM_ENV, "0")
    monkeypatch.setenv(cl.QCOLUMNS_ENV, "64")             # nvfp4 too: 33..64 columns in two launches
    for T in (9, 24, 32, 40, 64):
        assert cl.route(34816, 5120, T, kind, sms)["kernel"].startswith(f"gemv_{_TAG[kind]}_xs")
        _run_linear(kind, 34816, 5120, T, seed + T)
    _run_linear(kind, 300, 4160, 20, seed, residual=True)


# ------------------------------------------------------------------------------------------------
# The dequantising GEMM (gemm_*_n16 / n32 / n64: quantised launches of 9..64 columns, the default route
# there): test_model_shapes / test_odd_shapes / test_residual / test_swiglu / test_linear_split run it at
# its default slice counts; here every slice count, the slices' determinism, graph replays (the per-tile
# counters reset themselves) and the GEMV kernels it replaces.

GEMM_SHAPES = [(5120, 17408), (34816, 5120), (5120, 6144), (10240, 5120), (2048, 512), (300, 4160), (77, 1056),
               (256, 64), (96, 128)]             # the tiny test models' rows (the ring at one or two iterations)


def _modes(O):
    return (0, 1, 2) if O % 2 == 0 else (0, 1)


def _gemm_vs_reference(kind, w, wf, O, I, T, seed, mode):
    """One GEMM launch (the route must pick it) against the fp32 reference; returns the output."""
    from kernels import cuda_linear as cl
    from kernels.cuda_linear import linear, linear_swiglu
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert cl.route(O, I, T, kind, sms, swiglu=mode == 2)["kernel"].startswith("gemm_"), (kind, O, I, T)
    x = _x(T, I, seed)
    if mode == 2:
        out = torch.full((T, O // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = linear_swiglu(x, w, out=out)
        _check(got, _swiglu_want(x, wf))
        return got
    out = torch.full((T, O), float("nan"), dtype=torch.bfloat16, device="cuda")
    if mode == 1:
        res = torch.randn(T, O, device="cuda", generator=_gen(seed + 3)).to(torch.bfloat16)
        want = res.float() + ref.linear(x.float(), wf)
        got = linear(x, w, out=out, residual=res)
        _check(got, want, scale=float(res.float().norm() + ref.linear(x.float(), wf).norm()))
        return got
    got = linear(x, w, out=out)
    _check(got, ref.linear(x.float(), wf))
    return got


@pytest.mark.parametrize("kind", PIPE_KINDS)
@pytest.mark.parametrize("O,I", GEMM_SHAPES)
@pytest.mark.parametrize("shape", ("base", "m1", "p4", "r"))
def test_gemm_every_slice_count(kind, O, I, shape, seed, monkeypatch):
    """1, 3 and 7 slices of I (capped by the row length) and the route's own choice, each column tile
    width and tile shape (MM_SHAPE_ENV), every epilogue: each against the reference, and 3 slices'
    output the same bits on a second run (the last block sums the slices in slice order,
    whichever arrives last)."""
    from kernels import cuda_linear as cl
    monkeypatch.setenv(cl.MM_ENV, "all")
    monkeypatch.setenv(cl.MM_SHAPE_ENV, shape)
    w, wf = _weight(kind, O, I, seed)
    for T in (9, 24, 33, 64):
        for S in (None, 1, 3, 7):
            if S is None:
                monkeypatch.delenv(cl.MM_SPLITS_ENV, raising=False)
            else:
                monkeypatch.setenv(cl.MM_SPLITS_ENV, str(S))
            for mode in _modes(O):
                a = _gemm_vs_reference(kind, w, wf, O, I, T, seed + T, mode)
                if S == 3:
                    b = _gemm_vs_reference(kind, w, wf, O, I, T, seed + T, mode)
                    assert torch.equal(a, b), (T, S, mode)


@pytest.mark.parametrize("kind", PIPE_KINDS)
def test_gemm_agrees_with_the_gemv_kernels(kind, seed, monkeypatch):
    """The GEMM and the GEMV kernels it replaces (TANDEM_GEMV_MM=0) compute the same products in another
    order: their outputs agree to rounding, far inside the reference bound."""
    from kernels import cuda_linear as cl
    from kernels.cuda_linear import linear
    for O, I, T in ((5120, 17408, 32), (34816, 5120, 17), (300, 4160, 64)):
        w, _ = _weight(kind, O, I, seed + T)
        x = _x(T, I, seed + T)
        monkeypatch.setenv(cl.MM_ENV, "all")
        a = linear(x, w)
        monkeypatch.setenv(cl.MM_ENV, "0")
        b = linear(x, w)
        assert rel(a, b) <= 4e-3, (O, I, T, rel(a, b))


@pytest.mark.parametrize("shape", ("auto", "reg", "r"))
def test_gemm_graph_replays(shape, seed, monkeypatch):
    """Two sliced GEMMs in one captured graph, replayed 200 times over fresh inputs: every replay equals
    the eager launch bit for bit (the counters are reset by each row tile's last block, not the host);
    with the route's shapes (the ring where it keeps residency), the register shapes and the weight-ring
    ones everywhere (dynamic shared memory)."""
    from kernels import cuda_linear as cl
    from kernels.cuda_linear import linear, linear_swiglu
    monkeypatch.setenv(cl.MM_SPLITS_ENV, "5")
    monkeypatch.setenv(cl.MM_ENV, "all")
    monkeypatch.setenv(cl.MM_SHAPE_ENV, shape)
    w, _ = _weight("nvfp4", 5120, 17408, seed)
    wg, _ = _weight("fp8_block", 2048, 5120, seed + 1)
    x = _x(24, 17408, seed)
    x2 = _x(24, 5120, seed + 2)
    out = torch.empty(24, 5120, dtype=torch.bfloat16, device="cuda")
    out2 = torch.empty(24, 1024, dtype=torch.bfloat16, device="cuda")
    g = _captured(lambda: (linear(x, w, out=out), linear_swiglu(x2, wg, out=out2)))
    for i in range(200):
        if i % 20 == 0:
            x.copy_(_x(24, 17408, seed + 10 + i))
            x2.copy_(_x(24, 5120, seed + 11 + i))
            want, want2 = linear(x, w), linear_swiglu(x2, wg)
        out.fill_(float("nan"))
        out2.fill_(float("nan"))
        g.replay()
        if i % 20 == 19:
            torch.cuda.synchronize()
            assert torch.equal(out, want) and torch.equal(out2, want2), i
