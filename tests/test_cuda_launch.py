"""Whether programmatic dependent launch (kernels/launch.py, pdl=True) is in effect on this GPU, eagerly
and inside a captured CUDA graph: a probe kernel pair (kernels/cuda/bench.cu pdl_probe_*) where the
dependent signals a flag before its pdl_wait and the primary waits for it (bounded). With PDL the
dependent runs while the primary still does; with an ordinary launch the primary's wait runs out."""

import numpy as np
import pytest
import torch

from kernels import launch as L

pytestmark = pytest.mark.gpu

SPIN = 200_000_000                     # clocks (~0.1 s at 2 GHz): far beyond a kernel launch's latency


def _probe(pdl: bool, graph: bool) -> list[int]:
    d = torch.cuda.current_device()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    result = torch.zeros(2, dtype=torch.int32, device="cuda")
    prim, sec = L.kernel("bench", "pdl_probe_primary", d), L.kernel("bench", "pdl_probe_secondary", d)

    def run():
        L.launch(prim, (1,), (32,), (flag, result, np.int64(SPIN)), device=d)
        L.launch(sec, (1,), (32,), (flag, result), device=d, pdl=pdl)

    if not graph:
        run()
    else:
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            run()
        torch.cuda.current_stream().wait_stream(s)
        flag.zero_()
        result.zero_()
        g.replay()
    torch.cuda.synchronize()
    return result.tolist()


@pytest.mark.parametrize("graph", (False, True), ids=("eager", "graph"))
def test_the_probe_tells_an_ordinary_launch(graph):
    assert _probe(False, graph) == [2, 1]


@pytest.mark.parametrize("graph", (False, True), ids=("eager", "graph"))
def test_dependent_launch_overlaps_on_sm90(graph):
    if torch.cuda.get_device_capability()[0] < 9:
        assert not L.pdl_enabled()
        pytest.skip("programmatic dependent launch needs sm_90")
    assert L.pdl_enabled()
    assert _probe(True, graph) == [1, 1]


def _norm(x, w, graph: bool):
    from kernels import cuda_misc
    out = torch.full_like(x, float("nan"))
    if graph:
        cg, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(cg, stream=s):
            cuda_misc.rms_norm(x, w, 1e-6, out=out)
        torch.cuda.current_stream().wait_stream(s)
        cg.replay()
    else:
        cuda_misc.rms_norm(x, w, 1e-6, out=out)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("graph", (False, True), ids=("eager", "graph"))
def test_both_launch_routes_give_the_same_bits(graph, monkeypatch):
    """An ordinary launch through cuLaunchKernelEx (pack_args) and through CuPy's kernel call run the
    same kernel on the same arguments (tensors, an int, a float): bit-identical outputs, near the
    float32 reference, eagerly and captured in a graph, on every GPU (up to two: a launch for a device
    other than the current one switches to it)."""
    from kernels import reference
    for dev in range(min(2, torch.cuda.device_count())):
        g = torch.Generator(device=f"cuda:{dev}").manual_seed(int(np.random.SeedSequence().entropy % 2**31))
        x = torch.randn(37, 5120, device=f"cuda:{dev}", generator=g).to(torch.bfloat16)
        w = torch.randn(5120, device=f"cuda:{dev}", generator=g).to(torch.bfloat16)
        got = {}
        try:
            for direct in (True, False):
                monkeypatch.setenv("TANDEM_DIRECT_LAUNCH", "1" if direct else "0")
                L.pdl_reset()
                assert L.direct_launch_enabled() is direct
                with torch.cuda.device(dev if graph else 0):          # eager: launched from device 0's context
                    got[direct] = _norm(x, w, graph)
        finally:
            monkeypatch.delenv("TANDEM_DIRECT_LAUNCH")
            L.pdl_reset()
        assert not torch.isnan(got[True]).any()
        assert torch.equal(got[True].view(torch.int16), got[False].view(torch.int16))
        want = reference.rms_norm(x.float(), w.float(), 1e-6)
        assert torch.allclose(got[True].float(), want, rtol=1e-2, atol=1e-2)


def test_a_bad_direct_launch_names_the_driver_call():
    d = torch.cuda.current_device()
    fn = L.kernel("bench", "pdl_probe_secondary", d)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    result = torch.zeros(2, dtype=torch.int32, device="cuda")
    if not L.direct_launch_enabled():
        pytest.skip("the driver has no cuLaunchKernelEx")
    with pytest.raises(L.KernelError, match="cuLaunchKernelEx failed"):
        L.launch(fn, (1,), (4096,), (flag, result), device=d)          # more threads than a block may have


def test_a_launch_from_a_fresh_thread():
    """A thread that has made no CUDA call yet (its tensors made on the main thread) launches a kernel:
    the launch makes the device's context current where none is (launch._launch_in_context), on
    either route. The kernel's result is checked against the float32 reference."""
    import threading
    from kernels import cuda_misc, reference
    g = torch.Generator(device="cuda").manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    x = torch.randn(5, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(2048, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))               # poisoned here: the thread's only CUDA call is the launch
    torch.cuda.synchronize()
    errors = []

    def run():
        try:
            cuda_misc.rms_norm(x, w, 1e-6, out=out)
        except Exception as e:                           # reported on the main thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert torch.allclose(out.float(), reference.rms_norm(x.float(), w.float(), 1e-6), rtol=1e-2, atol=1e-2)
