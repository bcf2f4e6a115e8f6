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


def test_pack_args_match_kernel_params_of_the_converted_arguments():
    """pack_args (the direct launch's packing) lays out the same values as kernel_params of _arg's
    numpy scalars (the earlier route): fresh random mixes of every argument kind."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    t = torch.empty(int(rng.integers(1, 64)))
    pool = [lambda: t, lambda: None, lambda: bool(rng.integers(0, 2)), lambda: int(rng.integers(-2**31, 2**31)),
            lambda: float(rng.standard_normal()), lambda: np.int64(rng.integers(-2**62, 2**62)),
            lambda: np.uint64(rng.integers(1, 2**63)), lambda: np.float32(rng.standard_normal()),
            lambda: np.int16(rng.integers(-2**15, 2**15)), lambda: np.float64(rng.standard_normal())]
    for _ in range(50):
        args = [pool[int(i)]() for i in rng.integers(0, len(pool), size=int(rng.integers(1, 24)))]
        p1, v1 = L.pack_args(args)
        p2, v2 = L.kernel_params([L._arg(a) for a in args])
        assert ctypes.sizeof(v1) == ctypes.sizeof(v2)
        assert ctypes.string_at(ctypes.addressof(v1), ctypes.sizeof(v1)) == \
            ctypes.string_at(ctypes.addressof(v2), ctypes.sizeof(v2))
        assert [p - ctypes.addressof(v1) for p in p1] == [p - ctypes.addressof(v2) for p in p2]


def test_pack_args_refuse_what_a_kernel_cannot_take():
    with pytest.raises(L.KernelError, match="int32 range"):
        L.pack_args([2**31])
    with pytest.raises(L.KernelError, match="int32 range"):
        L.pack_args([-2**31 - 1])
    with pytest.raises(L.KernelError, match="numpy"):
        L.pack_args([object()])
    with pytest.raises(L.KernelError, match="numpy"):
        L.pack_args([np.complex64(1)])


def test_pack_args_refills_one_structure_per_signature_and_thread():
    """pack_args keeps a structure per argument signature and thread: the next call of the same
    signature writes its own values into it (a launch has handed the old ones to the driver by then),
    another signature or another thread has its own, and kernel_params always makes a new one."""
    import threading

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    t1, t2 = torch.empty(int(rng.integers(1, 64))), torch.empty(int(rng.integers(1, 64)))

    def values(params, types):
        return [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(types)]
    types = (ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_int64)
    a = [t1, int(rng.integers(-2**31, 2**31)), 0.5, np.int64(rng.integers(-2**62, 2**62))]
    b = [t2, int(rng.integers(-2**31, 2**31)), -2.25, np.int64(rng.integers(-2**62, 2**62))]
    p1, v1 = L.pack_args(a)
    assert values(p1, types) == [t1.data_ptr(), a[1], 0.5, int(a[3])]
    p2, v2 = L.pack_args(b)
    assert v2 is v1 and values(p2, types) == [t2.data_ptr(), b[1], -2.25, int(b[3])]
    p3, v3 = L.pack_args([t1, None])                                  # another signature
    assert v3 is not v1 and values(p3, (ctypes.c_uint64, ctypes.c_uint64)) == [t1.data_ptr(), 0]
    assert values(p2, types) == [t2.data_ptr(), b[1], -2.25, int(b[3])]
    seen = {}

    def other():
        seen["pv"] = L.pack_args(a)
    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert seen["pv"][1] is not v1 and values(seen["pv"][0], types)[1] == a[1]
    assert values(p2, types)[1] == b[1]                              # this thread's untouched
    kp, kv = L.kernel_params([L._arg(x) for x in a])
    assert kv is not v1 and values(kp, types)[1] == a[1] and values(p2, types)[1] == b[1]
    with pytest.raises(L.KernelError, match="int32 range"):             # a planned signature still checks
        L.pack_args([t1, 2**31, 0.5, np.int64(1)])
    p4, _ = L.pack_args([t1, 3, 1e39, np.int64(1)])                   # past float32: inf, as ctypes makes it
    assert values(p4, types)[1:] == [3, float("inf"), 1]


def test_getenv_follows_the_environment(monkeypatch):
    """The fast read of the tuning knobs sees every change made through os.environ (tests and
    benchmarks switch them inside one process)."""
    import os
    name = "TANDEM_TEST_GETENV_" + str(np.random.default_rng().integers(1 << 30))
    assert L.getenv(name) is None and L.env_int(name, 0) is None
    monkeypatch.setenv(name, "12")
    assert L.getenv(name) == "12" and L.env_int(name, 0, 20) == 12
    os.environ[name] = "héllo"
    assert L.getenv(name) == "héllo" == os.environ.get(name)
    with pytest.raises(L.KernelError, match=name):
        L.env_int(name, 0)
    os.environ[name] = "0"
    assert not L.env_flag(name, True)
    del os.environ[name]
    assert L.getenv(name) is None and L.env_flag(name, True)


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


def _memory_ops_before_wait(body: str) -> list[str]:
    """Global (or generic) loads, stores, atomics and async copies before the first griddepcontrol.wait."""
    head = body.split("griddepcontrol.wait")[0]
    found = []
    for line in head.splitlines():
        tok = line.strip().split(" ")[0].split("\t")[0]
        if tok.startswith("@"):                                         # predicated: the instruction follows
            parts = line.strip().split()
            tok = parts[1] if len(parts) > 1 else ""
        if not tok.startswith(("ld.", "st.", "atom.", "red.", "cp.async.", "prefetch.")):
            continue
        spaces = set(tok.split("."))
        if spaces & {"param", "shared", "local", "const"} and "global" not in spaces:
            continue
        found.append(tok)
    return found


@needs_nvcc
@pytest.mark.nvcc(keys=[(s.name, "sm_90a") for s in L.source_files()] + [("gemv.cu", "sm_86"), ("norm.cu", "sm_86")])
def test_every_pdl_kernel_waits(nvcc_builds):
    """Every kernel kernels/launch.py lets run as a dependent launch (is_pdl_kernel) executes
    griddepcontrol.wait (sm_90): the GEMV kernels after putting weight loads in flight, every other
    one before any global load, store, atomic or async copy. Every registered name exists, every kernel
    that waits is registered, and below sm_90 no kernel contains the instruction. (The PTX is the one
    the session's nvcc builds kept: tests/nvcc_builds.py.)"""
    seen, waiting = set(), set()                     # waiting: kernels that wait but are not registered
    for src in L.source_files():
        res = nvcc_builds.get(src.name, "sm_90a")
        assert res.returncode == 0 and res.ptx, f"nvcc failed for {src.name} (sm_90a):\n{res.log}"
        for name, body in _entries(res.ptx).items():
            if not L.is_pdl_kernel(name):
                if "griddepcontrol.wait" in body and name not in L.PDL_PROBES:
                    waiting.add(name)
                continue
            seen.add(name)
            assert "griddepcontrol.wait" in body, f"{src.name}: {name} may be a dependent launch but never waits"
            if not name.startswith(L.PDL_WAIT_FIRST) and name not in L.PDL_PROBES:
                early = _memory_ops_before_wait(body)
                assert not early, f"{src.name}: {name} touches memory before griddepcontrol.wait: {early}"
        if src.stem in ("gemv", "norm"):                                # spot check of the older targets
            old = nvcc_builds.get(src.name, "sm_86")
            assert old.returncode == 0 and old.ptx, old.log
            assert "griddepcontrol" not in old.ptx
    assert L.PDL_KERNELS <= seen, f"registered but not in any source: {sorted(L.PDL_KERNELS - seen)}"
    # a kernel that waits for its predecessor is meant to be a dependent launch: launch() refuses an
    # unregistered one at run time, so a new kernel left out of PDL_KERNELS fails here, on the CPU
    assert not waiting, f"kernels that call pdl_wait but are not registered (PDL_KERNELS): {sorted(waiting)}"
    assert sum(n.startswith("gemv_") for n in seen) >= 20
    assert any(n.startswith("gqa_decode_split_g") for n in seen) and any(n.startswith("gdn_recurrent_dk") for n in seen)
    assert {"mailbox_exchange_f2", "mailbox_lean_w1", "mailbox_lean_w2"} <= seen


def test_memory_op_scan_sees_loads_and_stores():
    body = "mov.u32 %r1, 0;\n\tld.param.u64 %rd1, [p];\n\t@%p1 ld.global.nc.v4.u32 {%r1}, [%rd2];\n" \
           "\tst.shared.u32 [%r3], %r1;\n\tst.u32 [%rd4], %r1;\n\tgriddepcontrol.wait;\n\tld.global.u32 %r5, [%rd5];"
    assert _memory_ops_before_wait(body) == ["ld.global.nc.v4.u32", "st.u32"]


def test_launch_refuses_unregistered_dependents():
    class Fn:
        name = "some_kernel"
    assert L.is_pdl_kernel("gemv_bf16_t1") and L.is_pdl_kernel("add_rms_norm_bf16_v8")
    assert not L.is_pdl_kernel("dequant_bf16") and not L.is_pdl_kernel("prefill_attn_split_d256")
    with pytest.raises(L.KernelError, match="not a registered dependent kernel"):
        L.launch(Fn(), (1,), (32,), (), device=0, pdl=True)


@pytest.mark.parametrize("value,gemv,norm,exchange", [(None, True, False, False), ("gemv", True, False, False),
                                                      ("1", True, False, False), ("all", True, True, True),
                                                      ("ALL", True, True, True)])
def test_pdl_scope(monkeypatch, value, gemv, norm, exchange):
    """TANDEM_PDL picks which registered kernels a pdl=True launch makes dependent: the GEMV kernels
    (and the test probe) by default, every registered kernel under `all`."""
    if value is None:
        monkeypatch.delenv("TANDEM_PDL", raising=False)
    else:
        monkeypatch.setenv("TANDEM_PDL", value)
    L.pdl_reset()
    try:
        assert L.pdl_scope_allows("gemv_nvfp4_tc") is gemv
        assert L.pdl_scope_allows("pdl_probe_secondary")
        assert L.pdl_scope_allows("add_rms_norm_bf16_v8") is norm
        assert L.pdl_scope_allows("mailbox_lean_w2") is exchange
        assert all(L.is_pdl_kernel(n) for n in ("gemv_nvfp4_tc", "add_rms_norm_bf16_v8", "mailbox_lean_w2"))
    finally:
        monkeypatch.undo()
        L.pdl_reset()


def test_moe_kernels_variant_from_the_environment(monkeypatch):
    """TANDEM_MOE_KERNELS (comparisons): auto when unset or empty, early and old on request, any other
    value an error that names the variable."""
    import pytest
    from kernels import cuda_misc as cm
    from kernels.launch import KernelError
    monkeypatch.delenv(cm.MOE_KERNELS_ENV, raising=False)
    assert cm.moe_kernels_variant() == "auto"
    for v, want in (("", "auto"), ("auto", "auto"), ("early", "early"), ("old", "old")):
        monkeypatch.setenv(cm.MOE_KERNELS_ENV, v)
        assert cm.moe_kernels_variant() == want
    monkeypatch.setenv(cm.MOE_KERNELS_ENV, "u8")
    with pytest.raises(KernelError, match=cm.MOE_KERNELS_ENV):
        cm.moe_kernels_variant()


def test_included_sources_change_the_compiled_text(tmp_path: Path, monkeypatch):
    """CuPy's kernel cache keys a module by its text: launch.with_include_digest appends a digest of the
    files a source includes from kernels/cuda (recursively, each once), so editing a header changes the
    text and its cache entry; a source that includes nothing is left as it is."""
    monkeypatch.setattr(L, "CUDA_DIR", tmp_path)
    (tmp_path / "inner.cuh").write_text("#define INNER 1\n")
    (tmp_path / "outer.cuh").write_text('#include "inner.cuh"\n#include "inner.cuh"\n#define OUTER 2\n')
    code = '#include "outer.cuh"\n  #  include "missing.cuh"\n__global__ void k() {}\n'
    first = L.with_include_digest(code)
    assert first.startswith(code) and "outer.cuh inner.cuh" in first and L.with_include_digest(code) == first
    (tmp_path / "inner.cuh").write_text("#define INNER 3\n")                  # a change two levels down
    second = L.with_include_digest(code)
    assert second != first and second.startswith(code)
    plain = "__global__ void k() {}\n"
    assert L.with_include_digest(plain) == plain


def test_every_real_source_carries_the_digest_of_common_cuh():
    for src in L.source_files():
        text = src.read_text()
        if '#include "common.cuh"' in text:
            assert "common.cuh" in L.with_include_digest(text).rsplit("\n// included from kernels/cuda:", 1)[1]


def test_nvcc_builds_keep_the_environment_they_started_with(tmp_path: Path, monkeypatch):
    """The session's nvcc builds run while tests monkeypatch os.environ: a build started during a test
    must not inherit its variables (test_server_common kills every process holding its tag)."""
    from tests import nvcc_builds as nb
    monkeypatch.delenv("TANDEM_TEST_TAG", raising=False)
    builds = nb.Builds(tmp_path, None, workers=1)
    try:
        monkeypatch.setenv("TANDEM_TEST_TAG", "leak-check")
        code, out = builds._run(["sh", "-c", 'echo "tag=${TANDEM_TEST_TAG:-none}"'])
        assert code == 0 and out.strip() == "tag=none"
    finally:
        builds.close()
