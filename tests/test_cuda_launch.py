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
