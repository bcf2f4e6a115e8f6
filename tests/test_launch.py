"""kernels/launch.py's programmatic dependent launch, checked without a GPU: the ctypes mirrors of
cuda.h's launch structures (against the header, compiled with the toolkit's compiler), the kernel
argument packing, and that every kernel cuda_linear launches with pdl=True waits (griddepcontrol.wait
in its PTX) before it can touch what an earlier kernel wrote."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kernels import launch as L

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH (needs the CUDA toolkit)")

_LAYOUT_C = r"""
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
           sizeof(CUlaunchAttributeValue), sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream),
           offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
"""


@needs_nvcc
def test_launch_structures_match_cuda_h(tmp_path: Path):
    src = tmp_path / "layout.cu"
    src.write_text(_LAYOUT_C)
    exe = tmp_path / "layout"
    subprocess.run([NVCC, "-o", str(exe), str(src)], check=True, capture_output=True, text=True)
    got = [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    mine = [ctypes.sizeof(L.LaunchAttribute), L.LaunchAttribute.value.offset, ctypes.sizeof(L.LaunchAttributeValue),
            ctypes.sizeof(L.LaunchConfig), L.LaunchConfig.hStream.offset, L.LaunchConfig.attrs.offset,
            L.LaunchConfig.numAttrs.offset, L.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION]
    assert mine == got


def test_kernel_params_point_at_each_value():
    rng = np.random.default_rng()
    args = [np.uint64(rng.integers(1, 2**63)), np.int32(rng.integers(-2**31, 2**31)),
            np.float32(rng.standard_normal()), np.int64(-rng.integers(1, 2**62)), np.uint8(rng.integers(1, 255))]
    params, vals = L.kernel_params(args)
    types = (ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_int64, ctypes.c_uint8)
    for i, (a, t) in enumerate(zip(args, types)):
        assert ctypes.cast(params[i], ctypes.POINTER(t)).contents.value == a.item()
    assert len(vals._fields_) == len(args)


def test_kernel_params_take_launch_arguments():
    """What launch() hands over after its argument conversion: ints, floats, bools, None as numpy scalars."""
    conv = [L._arg(a) for a in (7, -3.5, True, None, np.int64(5))]
    params, _ = L.kernel_params(conv)
    assert ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int32)).contents.value == 7
    assert ctypes.cast(params[1], ctypes.POINTER(ctypes.c_float)).contents.value == -3.5
    assert ctypes.cast(params[2], ctypes.POINTER(ctypes.c_int32)).contents.value == 1
    assert ctypes.cast(params[3], ctypes.POINTER(ctypes.c_uint64)).contents.value == 0
    assert ctypes.cast(params[4], ctypes.POINTER(ctypes.c_int64)).contents.value == 5


def test_kernel_params_refuse_unsized_values():
    with pytest.raises(L.KernelError, match="numpy scalar"):
        L.kernel_params([object()])
    with pytest.raises(L.KernelError, match="numpy scalar"):
        L.kernel_params([np.complex64(1)])


def test_pdl_attribute_and_config():
    attrs = L.pdl_attributes()
    raw = ctypes.string_at(ctypes.addressof(attrs), ctypes.sizeof(L.LaunchAttribute))   # the bytes the driver reads
    assert int.from_bytes(raw[0:4], "little") == L.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    assert int.from_bytes(raw[8:12], "little") == 1                  # value.programmaticStreamSerializationAllowed
    assert raw[4:8] == bytes(4) and raw[12:] == bytes(60)
    assert b"" == bytes() and len(b"") == 0                         # no write went through a bytes object
    cfg = L.launch_config((3, 2, 1), (256, 1, 1), 1024, 0xABC0, attrs)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.sharedMemBytes) == (3, 2, 1, 256, 1024)
    assert cfg.hStream == 0xABC0 and cfg.numAttrs == 1 and cfg.attrs[0].id == attrs[0].id


def _entries(ptx: str) -> dict[str, str]:
    """PTX kernel name -> its body."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx):
        start = ptx.index("{", m.end())
        depth, i = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(ptx[i], 0)
            if depth == 0:
                break
            i += 1
        out[m.group(1)] = ptx[start:i]
    return out


@needs_nvcc
def test_every_pdl_kernel_waits(tmp_path: Path):
    """cuda_linear launches every gemv_* kernel with pdl=True: each must execute griddepcontrol.wait
    (sm_90), and below sm_90 none may contain the instruction."""
    out = tmp_path / "gemv.ptx"
    base = [NVCC, *L.COMPILE_OPTIONS, f"-I{L.CUDA_DIR}", "-ptx", "-o", str(out), str(L.CUDA_DIR / "gemv.cu")]
    subprocess.run(base + ["-arch=sm_90a"], check=True, capture_output=True, text=True)
    entries = {k: v for k, v in _entries(out.read_text()).items() if k.startswith("gemv_")}
    assert len(entries) >= 20
    missing = [k for k, body in entries.items() if "griddepcontrol.wait" not in body]
    assert not missing, f"launched with pdl=True but never wait: {missing}"
    subprocess.run(base + ["-arch=sm_86"], check=True, capture_output=True, text=True)
    assert "griddepcontrol" not in out.read_text()
