"""Every CUDA source (kernels/cuda/*.cu, whatever exists) compiles with nvcc for each target
architecture (sm_80, the oldest the product supports, to sm_120a), with the options the runtime gives
NVRTC (kernels.launch.COMPILE_OPTIONS), and no kernel spills registers to local memory (but for the
measured exceptions in KNOWN_SPILLS).

A CPU test: it needs nvcc on PATH (skipped otherwise), not a GPU. The builds come from the session's pool
(tests/nvcc_builds.py): started, at a lower priority, as soon as collection ends, while the rest of the
suite runs first. ptxas's resource report (registers, shared memory, stack, spills per kernel) is printed
in the terminal summary ("ptxas resource usage", via tests/conftest.py) and written to
<pytest basetemp>/ptxas_report.txt.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kernels.launch import COMPILE_OPTIONS, CUDA_DIR
from tests.nvcc_builds import ARCHS, NVCC, SOURCES, CompileResult, nvcc_command

# (source, arch, kernel) -> the spill bytes (stores or loads) ptxas is known to choose there, each one
# measured and left: anything more, or a spill anywhere else, fails
KNOWN_SPILLS = {
    # the int8 KV decode kernel for one query head a CTA, on the A100's ptxas only (nvcc 13.0): 72
    # registers, 16 B stack, 12 B spilled and reloaded (no register cap: ptxas's own choice; sm_86 and
    # newer do not spill). Not changed: no A100 to measure it on, and the bf16 KV kernels do not spill
    ("attention.cu", "sm_80", "gqa_decode_split_i8_g1"): 12,
}

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH (the CUDA compile checks need the CUDA toolkit)")


def test_there_are_sources():
    assert SOURCES, f"no CUDA sources in {CUDA_DIR}"


def test_compile_options_reach_nvcc():
    """The compile test builds with the options NVRTC gets at run time (and they are the C++ dialect the
    sources are written for)."""
    assert "-std=c++17" in COMPILE_OPTIONS
    cmd = nvcc_command(CUDA_DIR / "x.cu", "sm_90a", Path(tempfile.gettempdir()) / "x.cubin")
    for opt in COMPILE_OPTIONS:
        assert opt in cmd


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_compiles_without_spills(src: Path, arch: str, nvcc_builds):
    res: CompileResult = nvcc_builds.get(src.name, arch)
    assert res.returncode >= 0, f"nvcc for {src.name} ({arch}) was killed by signal {-res.returncode}, not a verdict on the source"
    assert res.returncode == 0, f"nvcc failed for {src.name} ({arch}):\n{res.log}"
    assert res.kernels, f"ptxas reported no functions for {src.name} ({arch}):\n{res.log}"
    for k in res.kernels.values():
        if k.entry:
            print(f"{src.name} {arch} {k.name}: {k.registers} regs, {k.smem} B smem, {k.stack} B stack, "
                  f"{k.spill_stores}/{k.spill_loads} B spill st/ld")
    spills = {k.name: (k.spill_stores, k.spill_loads) for k in res.kernels.values()
              if (k.spill_stores or k.spill_loads)
              and max(k.spill_stores, k.spill_loads) > KNOWN_SPILLS.get((src.name, arch, k.name), 0)}
    assert not spills, f"{src.name} ({arch}) spills registers (stores, loads in bytes): {spills}\n{res.log}"


@pytest.mark.nvcc(sources=["gemv.cu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gemm_static_shared_memory_is_what_the_route_assumes(arch: str, nvcc_builds):
    """kernels/cuda_linear.mm_static_bytes (which decides where the weight ring keeps its blocks per SM)
    states each GEMM kernel's static shared memory as ptxas reports it."""
    from kernels import cuda_linear as cl
    res: CompileResult = nvcc_builds.get("gemv.cu", arch)
    assert res.returncode == 0, res.log
    got = {name: res.kernels[name].smem for name in cl._MM_KERNELS if name in res.kernels}
    assert set(got) == set(cl._MM_KERNELS), set(cl._MM_KERNELS) - set(got)
    assert got == {name: cl.mm_static_bytes(name) for name in cl._MM_KERNELS}
