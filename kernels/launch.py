"""Compile and launch tandem's CUDA kernels (kernels/cuda/*.cu) from torch tensors, through CuPy.

Tensors stay torch tensors; a kernel receives raw device pointers. Each source file is compiled once
per process and device by CuPy's RawModule (NVRTC, cached on disk by CuPy across processes), with
kernels/cuda/ on the include path. Launches go to torch's current stream, so they order with torch
work and are recorded when torch captures a CUDA graph.

    fn = kernel("norm", "rms_norm_bf16")
    launch(fn, grid, block, (out, x, weight, np.int32(E), np.float32(eps)), shared_mem=0)

Arguments: a torch.Tensor becomes its data pointer; a Python int becomes int32 and a float float32
(wrap in numpy scalars for other widths); numpy scalars pass through. Launches go through the
driver's cuLaunchKernelEx with the arguments packed straight into one ctypes structure (pack_args),
or, with TANDEM_DIRECT_LAUNCH=0 (a comparison switch), through CuPy's kernel call.

Programmatic dependent launch (`launch(..., pdl=True)`, sm_90 and newer): the kernel is launched with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION through the driver's cuLaunchKernelEx, so its
blocks may start while the previous kernel on the stream is still running, as soon as every block of
that kernel has executed `griddepcontrol.launch_dependents` (pdl_trigger() in common.cuh) or exited.
Such a kernel must execute `griddepcontrol.wait` (pdl_wait()) before it reads anything an earlier
kernel wrote and before it writes anything; what it does before that may only touch memory no kernel
of the step writes (weights). The decode GEMV uses this to start streaming its weights under the
previous kernel's tail; stream capture turns the attribute into a programmatic graph edge. Off with
TANDEM_PDL=0, and below sm_90 (where the launch is the ordinary one).

Which pdl=True launches are dependent ones (TANDEM_PDL, read once per process; `pdl_reset()` re-reads):
unset or `gemv` (the default) the decode GEMV kernels only; `all` every registered kernel (norms,
embedding, SwiGLU, attention, GDN, MoE, the mailbox exchange: bit-identical results, but no faster
than the default for a one-GPU step, 3% slower on the 35B-A3B; it saves 0.3-0.7 us per mailbox
exchange; docs/perf.md, eighth session); `0` none. The others launch the ordinary way, where their
pdl_wait() returns at once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import struct as _struct
import threading
from pathlib import Path

import numpy as np
import torch

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
log = logging.getLogger("tandem.kernels")
_lock = threading.Lock()

# Options shared by NVRTC here and nvcc in the compile test (tests/test_cuda_compile.py). CuPy
# always appends -ftz=true (fp32 subnormals flush to zero) and it cannot be overridden, so the
# kernels are written for it and the compile test builds with it too.
COMPILE_OPTIONS = ("-std=c++17", "-ftz=true")


class KernelError(RuntimeError):
    pass


class LaunchError(KernelError):
    """cuLaunchKernelEx returned an error: `code` is the CUresult."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


CUDA_ERROR_INVALID_CONTEXT = 201


def available() -> bool:
    """True when CuPy imports and a CUDA device is visible."""
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return torch.cuda.is_available()


def source_files() -> list[Path]:
    return sorted(CUDA_DIR.glob("*.cu"))


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)


def with_include_digest(code: str) -> str:
    """`code` with a closing comment that carries a digest of every file it includes from kernels/cuda
    (recursively). CuPy's disk cache keys a module by its own text, options and CuPy's headers only, so
    without this an edited common.cuh would keep loading binaries built from the old one."""
    seen: list[str] = []
    todo = [code]
    digest = hashlib.sha256()
    while todo:
        for inc in _INCLUDE.findall(todo.pop()):
            path = CUDA_DIR / inc
            if inc in seen or not path.is_file():
                continue
            seen.append(inc)
            text = path.read_text()
            digest.update(inc.encode() + b"\0" + text.encode() + b"\0")
            todo.append(text)
    return code if not seen else f"{code}\n// included from kernels/cuda: {' '.join(seen)} {digest.hexdigest()}\n"


@functools.lru_cache(maxsize=None)
def _module(name: str, device: int):
    import cupy
    path = CUDA_DIR / f"{name}.cu"                    # an absolute name (tests) stays as it is
    if not path.exists():
        raise KernelError(f"no CUDA source {path}")
    code = with_include_digest(path.read_text())
    with cupy.cuda.Device(device):
        mod = cupy.RawModule(code=code, options=COMPILE_OPTIONS + (f"-I{CUDA_DIR}",),
                             name_expressions=None)
        try:
            mod.compile()
        except Exception as e:                        # NVRTC log names the file and line
            raise KernelError(f"compiling {path.name} failed: {e}") from e
    return mod


@functools.lru_cache(maxsize=None)
def _function(name: str, fn: str, device: int):
    with _lock:
        mod = _module(name, device)
    import cupy
    with cupy.cuda.Device(device):
        return mod.get_function(fn)


_smem_opted: dict[tuple[str, str, int], int] = {}     # (source, function, device) -> dynamic bytes opted in


def kernel(source: str, fn: str, device: int | None = None, dynamic_smem: int = 0):
    """The function `fn` of kernels/cuda/<source>.cu, compiled for `device` (default: torch's current).

    dynamic_smem: the bytes of dynamic shared memory its launches ask for. The function is opted in to
    them (a launch whose static + dynamic shared memory passes 48 KiB fails without the attribute): set
    once per function, device and larger size, with the device current (CuPy resolves a kernel's handle
    per current device); not a stream operation, so a call may come during a graph capture."""
    if device is None:
        device = torch.cuda.current_device()
    f = _function(source, fn, device)
    if dynamic_smem > _smem_opted.get((source, fn, device), 0):
        import cupy
        with cupy.cuda.Device(device):
            f.max_dynamic_shared_size_bytes = dynamic_smem
        _smem_opted[(source, fn, device)] = dynamic_smem
    return f


@functools.lru_cache(maxsize=64)
def _stream(ptr: int, device: int):
    import cupy
    return cupy.cuda.ExternalStream(ptr, device)


def _arg(a):
    if isinstance(a, torch.Tensor):
        return np.uint64(a.data_ptr())
    if isinstance(a, bool):
        return np.int32(int(a))
    if isinstance(a, int):
        return np.int32(a)
    if isinstance(a, float):
        return np.float32(a)
    if a is None:
        return np.uint64(0)
    return a


def _dim3(d) -> tuple[int, int, int]:
    d = d if isinstance(d, tuple) else (d,)
    return (tuple(int(v) for v in d) + (1, 1))[:3]


def launch(fn, grid, block, args, shared_mem: int = 0, device: int | None = None, pdl: bool = False) -> None:
    """Launch on torch's current stream of `device` (default: the current device). pdl: a programmatic
    dependent launch where the device supports it (the kernel must call pdl_wait(); module docstring).

    Launches go through the driver's cuLaunchKernelEx with the arguments packed straight from the
    Python values (direct_launch_enabled(); a dependent launch adds its attribute), else through
    CuPy's kernel call. The direct route measured 1-4 us less host time per launch (scripts/bench/
    launch.py); eager (prefill) steps are host-bound (docs/perf.md, thirteenth session)."""
    if device is None:
        device = torch.cuda.current_device()
    grid3, block3 = _dim3(grid), _dim3(block)
    if min(grid3) <= 0:
        return
    name = getattr(fn, "name", "")
    dependent = False
    if pdl:
        if not is_pdl_kernel(name):
            raise KernelError(f"{name or fn!r} is not a registered dependent kernel (PDL_KERNELS): "
                              "it must call pdl_wait() before touching what earlier kernels wrote")
        dependent = pdl_enabled(device) and pdl_scope_allows(name)
    import cupy
    if dependent or direct_launch_enabled():
        if cupy.cuda.runtime.getDevice() != device:
            with cupy.cuda.Device(device):
                return launch(fn, grid3, block3, args, shared_mem, device, pdl)
        func = fn.kernel if hasattr(fn, "kernel") else fn              # RawKernel -> its Function on `device`
        params, _vals = pack_args(args)
        stream = _current_stream(device)
        if dependent:
            try:
                _launch_in_context(device, func.ptr, grid3, block3, shared_mem, stream, params, attrs=True)
                return
            except KernelError as e:                   # a driver that refuses the attribute: ordinary launches
                _PDL_REFUSED.add(device)
                log.warning("device %d: programmatic dependent launch refused (%s); launching kernels the "
                            "ordinary way from now on", device, e)
        if direct_launch_enabled():
            _launch_in_context(device, func.ptr, grid3, block3, shared_mem, stream, params, attrs=False)
            return
    stream = _stream(torch.cuda.current_stream(device).cuda_stream, device)
    with cupy.cuda.Device(device), stream:
        fn(grid3, block3, tuple(_arg(a) for a in args), shared_mem=shared_mem)


def _launch_in_context(device: int, func: int, grid, block, shared_mem: int, stream: int, params, attrs: bool) -> None:
    """_launch_ex; on a thread where no CUDA context is current yet (nothing on it has called the
    runtime: the current device reads as 0 without a context behind it), make `device`'s primary
    context current (cudaSetDevice) and launch again, once."""
    try:
        _launch_ex(func, grid, block, shared_mem, stream, params, attrs)
    except LaunchError as e:
        if e.code != CUDA_ERROR_INVALID_CONTEXT:
            raise
        import cupy
        cupy.cuda.runtime.setDevice(device)
        _launch_ex(func, grid, block, shared_mem, stream, params, attrs)


def _current_stream(device: int) -> int:
    """torch's current stream of `device` as a raw handle (one C call where torch has it)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


@functools.lru_cache(maxsize=None)
def direct_launch_enabled() -> bool:
    """Whether ordinary launches go through cuLaunchKernelEx too (TANDEM_DIRECT_LAUNCH, default on;
    off: CuPy's kernel call, the earlier route, for comparisons); needs a driver with cuLaunchKernelEx
    (CUDA 12.0+). Read once per process."""
    if not env_flag("TANDEM_DIRECT_LAUNCH", True):
        return False
    try:
        _driver()
    except (OSError, AttributeError):
        return False
    return True


# Kernels that may be launched with pdl=True: each calls pdl_wait() before it reads anything an earlier
# kernel wrote or writes anything (tests/test_launch.py checks their PTX). The GEMV and GEMM kernels put
# weight loads in flight first; the others wait at entry (pdl_enter()).
PDL_PREFIXES = ("gemv_bf16_", "gemv_fp8row_", "gemv_fp8blk_", "gemv_nvfp4", "gemm_fp8row_", "gemm_fp8blk_", "gemm_nvfp4_",
                "gqa_decode_split_g", "gqa_decode_split_i8_g",
                "gdn_recurrent_dk", "mailbox_exchange_f", "mailbox_lean_w")
PDL_KERNELS = frozenset({
    "embedding_bf16_v8", "embedding_bf16_generic", "rms_norm_bf16_v8", "rms_norm_bf16_generic",
    "add_rms_norm_bf16_v8", "add_rms_norm_bf16_generic", "swiglu_bf16_v8", "swiglu_bf16_generic",
    "moe_route_topk", "moe_gate_up_swiglu", "moe_gate_up_swiglu_late", "moe_down_combine",
    "moe_down_combine_late", "qk_norm_rope_kv_write_bf16",
    "qk_norm_rope_kv_write_i8", "gqa_decode_combine", "gdn_conv1d_bf16", "gdn_conv1d_bf16_x2",
    "gdn_gated_rms_norm_bf16",
    "floor_empty"})
PDL_WAIT_FIRST = ("gemv_", "gemm_")                 # may start loads (weights only) before pdl_wait
# bench.cu's probe (tests/test_cuda_launch.py) writes a flag before its wait on purpose
PDL_PROBES = frozenset({"pdl_probe_secondary"})


PDL_DEFAULT = ("gemv_", "gemm_") + tuple(PDL_PROBES)   # dependent launches under the default TANDEM_PDL


@functools.lru_cache(maxsize=None)
def _pdl_all() -> bool:
    return (getenv("TANDEM_PDL") or "").strip().lower() == "all"


def pdl_scope_allows(name: str) -> bool:
    """Whether a pdl=True launch of kernel `name` is a dependent launch under TANDEM_PDL (module
    docstring; the device's capability is pdl_enabled's question)."""
    return _pdl_all() or name.startswith(PDL_DEFAULT)


def pdl_reset() -> None:
    """Re-read TANDEM_PDL and TANDEM_DIRECT_LAUNCH (benchmarks that compare settings in one process)."""
    _pdl_capable.cache_clear()
    _pdl_all.cache_clear()
    direct_launch_enabled.cache_clear()


def is_pdl_kernel(name: str) -> bool:
    return name in PDL_KERNELS or name in PDL_PROBES or name.startswith(PDL_PREFIXES)


# cuda.h: CUlaunchAttribute (id, 4 bytes of padding, a 64-byte value union) and CUlaunchConfig. (The
# union's padding is c_ubyte, not c_char: ctypes hands out a c_char array field as a bytes copy.)
class LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_ubyte * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6           # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

_CTYPE = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
          np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
          np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
          np.dtype(np.int16): ctypes.c_int16, np.dtype(np.uint16): ctypes.c_uint16,
          np.dtype(np.int8): ctypes.c_int8, np.dtype(np.uint8): ctypes.c_uint8}


def kernel_params(args) -> tuple[ctypes.Array, ctypes.Structure]:
    """cuLaunchKernelEx's kernelParams: an array of pointers to each argument's value, and the values
    (one ctypes structure with a field per argument, kept alive by the caller). Arguments are numpy
    scalars (what _arg makes of launch's arguments: the CuPy route's form), packed by pack_args."""
    for a in args:
        if not isinstance(a, np.generic) or a.dtype not in _CTYPE:
            raise KernelError(f"kernel argument {a!r}: expected a numpy scalar of a fixed width")
    return _pack_args_struct(args)


_U64, _I32, _F32 = np.dtype(np.uint64), np.dtype(np.int32), np.dtype(np.float32)


def pack_args(args):
    """kernelParams straight from launch()'s arguments (the conversions of _arg without numpy
    scalars in between): a tensor is its data pointer (u64), None a null pointer, a bool or int an
    int32 (range-checked), a float a float32, a numpy scalar its own type. Returns the array of
    pointers to each value and the values' structure.

    The host time of an eager step is mostly launches (~820 for a 27B step, docs/perf.md), so the
    packing is planned once per signature (the arguments' types): the structure and its pointer array
    are kept per thread and signature and refilled with one struct.pack_into. They are valid until this
    thread's next pack_args call of the same signature, which is enough for a launch (the driver copies
    the values when it is called, graph capture included); kernel_params gives a structure of its own."""
    key = tuple(map(type, args))
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.setdefault(key, _pack_plan(key))
    fmt, tensors, nones, dtypes = plan
    vals = list(args)
    for i in tensors:
        vals[i] = args[i].data_ptr()
    for i in nones:
        vals[i] = 0
    slots = getattr(_tls, "slots", None)
    if slots is None:
        slots = _tls.slots = {}
    slot = slots.get(key)
    if slot is None:
        struct_t, offsets = _param_layout(dtypes)
        v = struct_t()
        base = ctypes.addressof(v)
        slot = slots[key] = ((ctypes.c_void_p * max(1, len(offsets)))(*[base + o for o in offsets]), v)
    try:
        _struct.pack_into(fmt, slot[1], 0, *vals)
    except (_struct.error, OverflowError):           # an int out of int32 range (KernelError), a float past
        _, v = _pack_args_struct(args)               # float32's range (ctypes makes it inf, struct refuses)
        ctypes.memmove(ctypes.addressof(slot[1]), ctypes.addressof(v), ctypes.sizeof(v))
    return slot


_plans: dict[tuple, tuple] = {}
_tls = threading.local()
_STRUCT_CHAR = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i",
                np.dtype(np.uint32): "I", np.dtype(np.float32): "f", np.dtype(np.float64): "d",
                np.dtype(np.int16): "h", np.dtype(np.uint16): "H", np.dtype(np.int8): "b", np.dtype(np.uint8): "B"}


def _pack_plan(types: tuple) -> tuple[str, tuple[int, ...], tuple[int, ...], tuple]:
    """pack_args' plan for arguments of these types: the struct format (native byte order, the padding
    of _param_layout's ctypes structure written out), which positions are tensors and which None, and
    the argument dtypes."""
    dtypes, tensors, nones = [], [], []
    for i, t in enumerate(types):
        if issubclass(t, torch.Tensor):                  # the order of _pack_args_struct's isinstance chain
            dtypes.append(_U64)
            tensors.append(i)
        elif issubclass(t, int):                         # bool too
            dtypes.append(_I32)
        elif issubclass(t, float):                       # numpy.float64 too, as there
            dtypes.append(_F32)
        elif t is type(None):
            dtypes.append(_U64)
            nones.append(i)
        elif issubclass(t, np.generic) and np.dtype(t) in _CTYPE:
            dtypes.append(np.dtype(t))
        else:
            raise KernelError(f"kernel argument of type {t.__name__}: expected a tensor, None, bool, int, float "
                              "or a numpy scalar of a fixed width")
    struct_t, offsets = _param_layout(tuple(dtypes))
    fmt, at = "=", 0
    for d, o in zip(dtypes, offsets):
        fmt += "x" * (o - at) + _STRUCT_CHAR[d]
        at = o + d.itemsize
    fmt += "x" * (ctypes.sizeof(struct_t) - at)
    return fmt, tuple(tensors), tuple(nones), tuple(dtypes)


def _pack_args_struct(args):
    """pack_args' conversions into a fresh structure (kernel_params: the caller keeps it)."""
    dtypes, vals = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            dtypes.append(_U64)
            vals.append(a.data_ptr())
        elif isinstance(a, bool):
            dtypes.append(_I32)
            vals.append(int(a))
        elif isinstance(a, int):
            if not -0x80000000 <= a <= 0x7FFFFFFF:
                raise KernelError(f"kernel argument {a}: out of int32 range (pass a numpy int64 for wider values)")
            dtypes.append(_I32)
            vals.append(a)
        elif isinstance(a, float):
            dtypes.append(_F32)
            vals.append(a)
        elif a is None:
            dtypes.append(_U64)
            vals.append(0)
        elif isinstance(a, np.generic) and a.dtype in _CTYPE:
            dtypes.append(a.dtype)
            vals.append(a.item())
        else:
            raise KernelError(f"kernel argument {a!r}: expected a tensor, None, bool, int, float or a numpy "
                              "scalar of a fixed width")
    struct, offsets = _param_layout(tuple(dtypes))
    v = struct(*vals)
    base = ctypes.addressof(v)
    return (ctypes.c_void_p * max(1, len(offsets)))(*[base + o for o in offsets]), v


@functools.lru_cache(maxsize=256)
def _param_layout(dtypes: tuple) -> tuple[type, tuple[int, ...]]:
    """A ctypes structure type with one field per argument dtype, and the fields' offsets (a launch
    signature's layout, built once: building ctypes values one by one cost ~50 us per launch)."""
    struct = type("KernelParams", (ctypes.Structure,), {"_fields_": [(f"a{i}", _CTYPE[d]) for i, d in enumerate(dtypes)]})
    return struct, tuple(getattr(struct, f"a{i}").offset for i in range(len(dtypes)))


def launch_config(grid, block, shared_mem: int, stream: int, attrs=None) -> LaunchConfig:
    """cuLaunchKernelEx's configuration; attrs None: no launch attributes (an ordinary launch)."""
    cfg = LaunchConfig(*grid, *block, shared_mem, ctypes.c_void_p(stream))
    if attrs is not None:
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
    return cfg


def pdl_attributes():
    attrs = (LaunchAttribute * 1)()
    attrs[0].id = ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value.programmaticStreamSerializationAllowed = 1
    return attrs


@functools.lru_cache(maxsize=1)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib, fn, pdl_attributes()


def _launch_ex(func: int, grid, block, shared_mem: int, stream: int, params, attrs: bool) -> None:
    """cuLaunchKernelEx of `func` with kernelParams `params` (pack_args or kernel_params); attrs: with
    the programmatic-serialisation attribute (a dependent launch), else none (an ordinary launch)."""
    lib, launch_ex, pdl_attrs = _driver()
    # the configuration structure kept per thread and launch shape (a step has a few hundred): the driver
    # reads it during the call only
    configs = getattr(_tls, "configs", None)
    if configs is None:
        configs = _tls.configs = {}
    key = (grid, block, shared_mem, stream, attrs)
    cfg = configs.get(key)
    if cfg is None:
        if len(configs) > 4096:
            configs.clear()
        cfg = configs[key] = launch_config(grid, block, shared_mem, stream, pdl_attrs if attrs else None)
    rc = launch_ex(cfg, func, params, None)
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(msg))
        raise LaunchError(f"cuLaunchKernelEx failed: {rc} {(msg.value or b'').decode()}", rc)


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: int) -> bool:
    if not env_flag("TANDEM_PDL", True):
        return False
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return False
    try:
        _driver()
    except (OSError, AttributeError):                 # no libcuda.so.1, or a driver before CUDA 12.0
        return False
    return True


_PDL_REFUSED: set[int] = set()                 # devices whose driver refused a programmatic launch


def pdl_enabled(device: int | None = None) -> bool:
    """True when launch(..., pdl=True) is a programmatic dependent launch on `device` (sm_90+, the
    driver has cuLaunchKernelEx, TANDEM_PDL not 0, and it has not refused one). Read once per process
    and device."""
    if device is None:
        device = torch.cuda.current_device()
    return device not in _PDL_REFUSED and _pdl_capable(device)


def warm_up(device: int | None = None) -> None:
    """Compile every source for `device` now (before CUDA graph capture, and to fail early)."""
    if device is None:
        device = torch.cuda.current_device()
    for path in source_files():
        _module(path.stem, device)


def device_of(t: torch.Tensor) -> int:
    if t.device.type != "cuda":
        raise KernelError(f"expected a CUDA tensor, got one on {t.device}")
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def check(t: torch.Tensor, name: str, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
          shape: tuple | None = None) -> torch.Tensor:
    """Validate a kernel argument: CUDA, contiguous, dtype and shape (None entries match anything)."""
    if not isinstance(t, torch.Tensor):
        raise KernelError(f"{name}: expected a tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise KernelError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise KernelError(f"{name}: must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    if dtype is not None:
        ok = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in ok:
            raise KernelError(f"{name}: dtype {t.dtype}, expected {' or '.join(map(str, ok))}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            raise KernelError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
    return t


def sm_count(device: int | None = None) -> int:
    if device is None:
        device = torch.cuda.current_device()
    return _sm_count(device)


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


DEV_ATTR_SMEM_PER_SM = 81                               # cudaDevAttrMaxSharedMemoryPerMultiprocessor
DEV_ATTR_SMEM_OPTIN = 97                                # cudaDevAttrMaxSharedMemoryPerBlockOptin


@functools.lru_cache(maxsize=None)
def device_attribute(device: int, prop: str, attr: int) -> int:
    """A device property: torch's `prop` where its properties have it, else CUDA attribute `attr`."""
    v = getattr(torch.cuda.get_device_properties(device), prop, None)
    if v:
        return int(v)
    import cupy
    return int(cupy.cuda.runtime.deviceGetAttribute(attr, device))


def smem_per_sm(device: int | None = None) -> int:
    """Shared memory per SM in bytes (228 KiB on H100 / H200, 100 KiB on sm_86 / 89 / 120 boards)."""
    if device is None:
        device = torch.cuda.current_device()
    return device_attribute(device, "shared_memory_per_multiprocessor", DEV_ATTR_SMEM_PER_SM)


# The tuning knobs (TANDEM_GEMV_*, ...) are read on every linear() call, thousands of times an eager
# step, and benchmarks and tests change them inside a process, so they are read each time, not cached:
# os.environ.get costs ~1 us a read (the name encoded, the value decoded); getenv is a dict lookup in the
# mapping os.environ keeps its bytes in on POSIX, the value decoded once per distinct value.
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEYS: dict[str, bytes] = {}
_ENV_VALUES: dict[bytes, str] = {}


def getenv(name: str) -> str | None:
    """os.environ.get(name), faster (see above); follows every change made through os.environ."""
    if _ENV_DATA is None:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    raw = _ENV_DATA.get(key)
    if raw is None:
        return None
    v = _ENV_VALUES.get(raw)
    if v is None:
        if len(_ENV_VALUES) > 4096:
            _ENV_VALUES.clear()
        v = _ENV_VALUES[raw] = os.fsdecode(raw)
    return v


def env_flag(name: str, default: bool = False) -> bool:
    v = getenv(name)
    return default if v is None else v not in ("", "0", "false", "no")


def env_int(name: str, lo: int, hi: int | None = None) -> int | None:
    """$name as an integer in lo..hi (hi None: no bound); None when unset or empty; KernelError naming
    the variable otherwise."""
    v = getenv(name)
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or n < lo or (hi is not None and n > hi):
        raise KernelError(f"{name}={v!r}: expected an integer {lo}..{'' if hi is None else hi}")
    return n
