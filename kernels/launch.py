"""Compile and launch tandem's CUDA kernels (kernels/cuda/*.cu) from torch tensors, through CuPy.

Tensors stay torch tensors; a kernel receives raw device pointers. Each source file is compiled once
per process and device by CuPy's RawModule (NVRTC, cached on disk by CuPy across processes), with
kernels/cuda/ on the include path. Launches go to torch's current stream, so they order with torch
work and are recorded when torch captures a CUDA graph.

    fn = kernel("norm", "rms_norm_bf16")
    launch(fn, grid, block, (out, x, weight, np.int32(E), np.float32(eps)), shared_mem=0)

Arguments: a torch.Tensor becomes its data pointer; a Python int becomes int32 and a float float32
(wrap in numpy scalars for other widths); numpy scalars pass through.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import numpy as np
import torch

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
_lock = threading.Lock()

# Options shared by NVRTC here and nvcc in the compile test (tests/test_cuda_compile.py). CuPy
# always appends -ftz=true (fp32 subnormals flush to zero) and it cannot be overridden, so the
# kernels are written for it and the compile test builds with it too.
COMPILE_OPTIONS = ("-std=c++17", "-ftz=true")


class KernelError(RuntimeError):
    pass


def available() -> bool:
    """True when CuPy imports and a CUDA device is visible."""
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return torch.cuda.is_available()


def source_files() -> list[Path]:
    return sorted(CUDA_DIR.glob("*.cu"))


@functools.lru_cache(maxsize=None)
def _module(name: str, device: int):
    import cupy
    path = CUDA_DIR / f"{name}.cu"
    if not path.exists():
        raise KernelError(f"no CUDA source {path}")
    code = path.read_text()
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


def kernel(source: str, fn: str, device: int | None = None):
    """The function `fn` of kernels/cuda/<source>.cu, compiled for `device` (default: torch's current)."""
    if device is None:
        device = torch.cuda.current_device()
    return _function(source, fn, device)


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


def launch(fn, grid, block, args, shared_mem: int = 0, device: int | None = None) -> None:
    """Launch on torch's current stream of `device` (default: the current device)."""
    if device is None:
        device = torch.cuda.current_device()
    grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
    block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
    if min(grid) <= 0:
        return
    stream = _stream(torch.cuda.current_stream(device).cuda_stream, device)
    import cupy
    with cupy.cuda.Device(device), stream:
        fn(grid, block, tuple(_arg(a) for a in args), shared_mem=shared_mem)


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
    if t.device.type != "cuda":
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
    return torch.cuda.get_device_properties(device).multi_processor_count


def env_flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    return default if v is None else v not in ("", "0", "false", "no")
