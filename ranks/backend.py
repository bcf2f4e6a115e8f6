"""Which layer-program backend a rank (or `tandem generate`) runs, and building a model with it.

"reference": ranks/model.py on the torch ops of kernels/reference.py, any device and dtype (the
oracle, and the CPU product). "cuda": ranks/model_cuda.py on tandem's CUDA kernels (bfloat16
activations; bf16, fp8 or nvfp4 weights; CUDA graphs). "auto" picks cuda for bfloat16 on a CUDA
device when CuPy is importable, else reference; given the model (resolve_backend), auto also takes the
reference backend on the GPU, with a warning, for a bf16 model whose shapes the kernels cannot run
(ranks/cuda_support.py), where --backend cuda is refused.
"""

from __future__ import annotations

import logging
import os

import torch

from ranks.cuda_support import check_cuda_support, cuda_support_problems, picks_cuda
from ranks.model import HybridModel
from ranks.random_checkpoint import random_shard
from ranks.weights import Checkpoint, load_weights
from runtime.config import ModelSpec, load_spec

log = logging.getLogger(__name__)


def choose_backend(backend: str, device: str, dtype: torch.dtype, weights: str = "bf16") -> str:
    """"cuda" (tandem's kernels) or "reference" (torch ops on any device) for this rank.

    auto picks cuda for bfloat16 on a CUDA device when CuPy is importable; quantised weights
    need the cuda backend."""
    on_cuda = device.startswith("cuda")
    if backend == "auto":
        backend = "cuda" if picks_cuda("auto", device, dtype) else "reference"
    if backend == "cuda":
        if not on_cuda:
            raise ValueError(f"the cuda backend needs --device cuda (got {device})")
        if dtype != torch.bfloat16:
            raise ValueError(f"the cuda backend runs bfloat16; got --dtype {str(dtype).replace('torch.', '')}")
    if weights != "bf16" and backend != "cuda":
        raise ValueError(f"--weights {weights} needs the cuda backend (bfloat16 on --device cuda)")
    return backend


def resolve_backend(spec: ModelSpec, backend: str, device: str, dtype, *, tp: int = 1, weights: str = "bf16",
                    kv_dtype: str | None = "bf16") -> str:
    """choose_backend for this model: "cuda" or "reference", before any weight is read.

    Where the settings pick the CUDA kernels (picks_cuda) and the kernels cannot run the model's shapes
    (cuda_support_problems), --backend auto with bf16 weights falls back to the reference backend on the
    same device, logging a warning that names the fields; --backend cuda, and quantised weights (which
    only the kernels run), raise the ConfigError of check_cuda_support instead. dtype: a torch dtype or
    its name. Conflicting flags raise choose_backend's ValueError."""
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if picks_cuda(backend, device, dt):
        problems = cuda_support_problems(spec, tp, weights, kv_dtype)
        if problems and backend == "auto" and weights == "bf16":
            log.warning("%s: the CUDA backend's kernels cannot run this model (%s); running it on the reference "
                        "backend on %s instead (torch ops: correct, much slower; --backend reference "
                        "says so explicitly)", spec.source, "; ".join(problems), device)
            return choose_backend("reference", device, dt, weights)
        if problems:
            check_cuda_support(spec, tp, weights, kv_dtype)
    return choose_backend(backend, device, dt, weights)


def build_model(model_dir: str | os.PathLike, dtype: torch.dtype, device: str, backend: str = "auto",
                weights: str = "bf16", cuda_graphs: bool = True, random_weights: bool = False,
                progress=None) -> HybridModel:
    """One whole model (tp 1) in this process, on the chosen backend; progress(done, total) hears the
    weight bytes loaded (ranks/upload.py)."""
    spec = load_spec(model_dir)
    # shapes the CUDA kernels cannot run: the reference backend under auto, refused under cuda, before the
    # device is touched or a weight is read (the KV format is the caller's: tandem generate checks it)
    backend = resolve_backend(spec, backend, device, dtype, weights=weights, kv_dtype=None)
    if device == "cuda":
        device = "cuda:0"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if random_weights:
        w = random_shard(spec, 0, 1, dtype=dtype, device=device, progress=progress)
    else:
        if spec.quantization:
            from ranks.checkpoint_quant import quantised_conflict
            problem = quantised_conflict(spec, weights)
            if problem:
                raise ValueError(problem)
        w = load_weights(Checkpoint(model_dir), spec, dtype=dtype, device=device, keep_quantised=backend == "cuda",
                         progress=progress)
    if backend == "cuda":
        from ranks.model_cuda import CudaHybridModel
        return CudaHybridModel(spec, w, weight_format=weights, cuda_graphs=cuda_graphs)
    return HybridModel(spec, w)
