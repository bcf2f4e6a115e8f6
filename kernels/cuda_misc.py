"""CUDA wrappers for the small ops: embedding, RMSNorm (+ fused residual add), SwiGLU of a gate|up
product, the MoE router and routed experts, and the row argmax of the greedy sampler.

Sources: kernels/cuda/norm.cu, moe.cu, sample.cu. Every wrapper takes torch CUDA tensors, validates
them (errors name the argument), allocates missing outputs with torch.empty (or writes into `out=`),
and launches on torch's current stream. Everything here except moe_experts_prefill is capturable in
a CUDA graph: no host synchronisation, and launch shapes depend only on tensor shapes.

Semantics follow kernels/reference.py (the oracle in tests/test_cuda_misc.py):
  embedding      reference.embedding; out-of-range ids are clamped to [0, V) on the device (never an
                 out-of-bounds read): the host validates token ids.
  rms_norm       reference.rms_norm, bf16 in/out, fp32 maths in the same order; the fp32 sum of
                 squares is summed in a different order than torch's, so a result may differ by one
                 bf16 ulp where the sum rounds differently.
  add_rms_norm   x_new = bf16(x + y) (torch's bf16 add) and rms_norm(x_new), in one pass.
  swiglu         bf16(bf16(silu(gate)) * up) of a [T, 2F] gate|up product (torch's bf16 ops, bit for bit).
  moe_route      reference.moe_route on router logits: softmax in fp32 over all experts, top-k with
                 ties to the lower expert id, renormalised; weights bf16, ids int32.
  moe_experts_*  reference.moe_experts: sum_a w_a * down_e(silu(gate_e x) * up_e x); the decode kernels
                 sum the slots in fp32 with one bf16 rounding (the reference rounds per expert).
  argmax_rows    per-row max (fp32) and its index (int64), ties to the lower index, NaN never wins
                 (a row with nothing but NaN reports (-inf, 0)).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels.launch import KernelError, check, device_of, getenv, kernel, launch

BF16 = torch.bfloat16
Tensor = torch.Tensor

NORM_MAXV = 4                 # norm.cu: 16-byte vectors per thread (fast path)
NORM_MAXS = 16                # norm.cu: elements per thread (generic path)
NORM_MAX_E = 16384            # the documented limit (the fast path would take up to 32768)
ROUTE_MAX_X = 512             # moe.cu ROUTE_MAX_X: threads of the route kernel's block
ROUTE_MAX_K = 32
MOE_THREADS = 256             # 8 warps: 8 output rows per CTA
SMEM_LIMIT = 48 * 1024        # dynamic shared memory without the opt-in attribute
# The decode experts' kernels (TANDEM_MOE_KERNELS, read at every launch, so at graph capture too; for
# comparisons): "early" (each warp's first weight loads issued before x or h is staged; the down
# kernel 24 loads per lane in flight, more registers, fewer resident blocks), "old" (the kernels before
# the twelfth session: loads after the staging, the down kernel 8 per lane), "auto" (the default, or
# unset / empty): early for batches of at most MOE_EARLY_MAX_N tokens, old above. 35B-A3B step, one
# H200, the two alternated three times in one process (docs/perf.md, twelfth session): early was
# 3.4-4.8% faster at C = 1, old 1.5-5% faster at C = 2, 4 and 8. Both sum in the same order: the same bits.
MOE_KERNELS_ENV = "TANDEM_MOE_KERNELS"
MOE_KERNELS_VARIANTS = ("auto", "early", "old")
MOE_EARLY_MAX_N = 1
ARGMAX_THREADS = 256


def _round32(n: int) -> int:
    return max(32, (n + 31) // 32 * 32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _aligned(*ts: Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


def _same_device(**named: Tensor) -> int:
    devs = {name: device_of(t) for name, t in named.items()}
    first = next(iter(devs.values()))
    for name, d in devs.items():
        if d != first:
            raise KernelError(f"{name}: on cuda:{d}, expected cuda:{first} like {next(iter(devs))}")
    return first


# --------------------------------------------------------------------------------------------------
# Embedding


def embedding(ids: Tensor, table: Tensor, out: Tensor | None = None) -> Tensor:
    """Rows of table [V, E] bf16 for ids [...] (int32 or int64) -> [..., E] bf16."""
    check(ids, "ids", (torch.int32, torch.int64))
    check(table, "table", BF16, (None, None))
    V, E = table.shape
    if V == 0:
        raise KernelError("table: empty vocabulary")
    if out is None:
        out = torch.empty(*ids.shape, E, dtype=BF16, device=table.device)
    check(out, "out", BF16, (*ids.shape, E))
    dev = _same_device(ids=ids, table=table, out=out)
    N = ids.numel()
    if N == 0 or E == 0:
        return out
    ids64 = int(ids.dtype == torch.int64)
    if E % 8 == 0 and _aligned(table, out):
        threads = min(256, _round32(E // 8))
        launch(kernel("norm", "embedding_bf16_v8", dev), (N, _cdiv(E // 8, threads)), (threads,),
               (out, ids, ids64, table, V, E), device=dev, pdl=True)
    else:
        threads = min(256, _round32(E))
        launch(kernel("norm", "embedding_bf16_generic", dev), (N, _cdiv(E, threads)), (threads,),
               (out, ids, ids64, table, V, E), device=dev, pdl=True)
    return out


# --------------------------------------------------------------------------------------------------
# RMSNorm


def _norm_launch(out: Tensor, x_out: Tensor | None, x: Tensor, y: Tensor | None, weight: Tensor,
                 eps: float, dev: int) -> None:
    E = x.shape[-1]
    rows = x.numel() // E if E else 0
    if rows == 0:
        return
    if E > NORM_MAX_E:
        raise KernelError(f"x: hidden size {E} > {NORM_MAX_E}")
    inv_e = np.float32(1.0) / np.float32(E)          # torch's mean: sum * (1/E) in fp32
    eps32 = np.float32(eps)
    add = y is not None
    tensors = [out, x, weight] + ([x_out, y] if add else [])
    if E % 8 == 0 and _aligned(*tensors):
        nvec = E // 8
        threads = min(1024, _round32(_cdiv(nvec, 2)))
        assert nvec <= NORM_MAXV * threads
        name = "add_rms_norm_bf16_v8" if add else "rms_norm_bf16_v8"
    else:
        threads = min(1024, _round32(_cdiv(E, 4)))
        assert E <= NORM_MAXS * threads
        name = "add_rms_norm_bf16_generic" if add else "rms_norm_bf16_generic"
    args = ((out, x_out, x, y, weight) if add else (out, x, weight)) + (np.int32(E), inv_e, eps32)
    launch(kernel("norm", name, dev), (rows,), (threads,), args, device=dev, pdl=True)


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """Zero-centred RMSNorm over the last axis: x [..., E] bf16, weight [E] bf16 -> [..., E] bf16.
    `out` may be x (in place)."""
    check(x, "x", BF16)
    if x.dim() == 0:
        raise KernelError("x: expected at least one dimension")
    E = x.shape[-1]
    check(weight, "weight", BF16, (E,))
    if out is None:
        out = torch.empty_like(x)
    check(out, "out", BF16, tuple(x.shape))
    dev = _same_device(x=x, weight=weight, out=out)
    _norm_launch(out, None, x, None, weight, eps, dev)
    return out


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float, x_out: Tensor | None = None,
                 out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Residual add and norm in one pass: x_new = bf16(x + y), returns (x_new, rms_norm(x_new)).
    x, y [..., E] bf16, weight [E] bf16; x_out may be x (in-place residual update)."""
    check(x, "x", BF16)
    if x.dim() == 0:
        raise KernelError("x: expected at least one dimension")
    shape = tuple(x.shape)
    E = shape[-1]
    check(y, "y", BF16, shape)
    check(weight, "weight", BF16, (E,))
    if x_out is None:
        x_out = torch.empty_like(x)
    if out is None:
        out = torch.empty_like(x)
    check(x_out, "x_out", BF16, shape)
    check(out, "out", BF16, shape)
    if out.data_ptr() == x_out.data_ptr() and out.numel():
        raise KernelError("out: must not be the same memory as x_out")
    dev = _same_device(x=x, y=y, weight=weight, x_out=x_out, out=out)
    _norm_launch(out, x_out, x, y, weight, eps, dev)
    return x_out, out


def swiglu(y: Tensor, out: Tensor | None = None) -> Tensor:
    """SwiGLU of a gate|up product: y [T, 2F] bf16 (gate columns first) -> out [T, F] bf16 =
    bf16(bf16(silu(gate)) * up), bit for bit torch's F.silu(gate) * up in bf16."""
    check(y, "y", BF16, (None, None))
    T, F2 = y.shape
    if F2 % 2:
        raise KernelError(f"y: needs an even number of columns (gate | up), got {F2}")
    if not y.is_contiguous():
        raise KernelError("y: must be contiguous")
    Fh = F2 // 2
    if out is None:
        out = torch.empty(T, Fh, dtype=BF16, device=y.device)
    check(out, "out", BF16, (T, Fh))
    if not out.is_contiguous():
        raise KernelError("out: must be contiguous")
    dev = _same_device(y=y, out=out)
    if T == 0 or Fh == 0:
        return out
    if Fh % 8 == 0 and _aligned(y, out):
        threads = min(256, _round32(Fh // 8))
        launch(kernel("norm", "swiglu_bf16_v8", dev), (_cdiv(Fh // 8, threads), T), (threads,), (out, y, Fh),
               device=dev, pdl=True)
    else:
        threads = min(256, _round32(Fh))
        launch(kernel("norm", "swiglu_bf16_generic", dev), (_cdiv(Fh, threads), T), (threads,), (out, y, Fh),
               device=dev, pdl=True)
    return out


# --------------------------------------------------------------------------------------------------
# MoE


def moe_route(logits: Tensor, top_k: int, weights_out: Tensor | None = None,
              ids_out: Tensor | None = None, shared: bool = False) -> tuple[Tensor, Tensor]:
    """Router logits [N, X] (bf16 or fp32, X <= 512) -> (weights [N, A] bf16, ids [N, A] int32): the
    softmax's top_k, renormalised to sum 1 (A = top_k). shared: the last column of logits is the
    shared expert's gate logit, not a router logit; the top_k come from the other X - 1 columns, and a
    last slot (A = top_k + 1) holds the shared expert as id X - 1 with weight bf16(sigmoid(gate logit))
    (the expert kernels then run it beside the routed ones: the experts stacked with it last)."""
    check(logits, "logits", (BF16, torch.float32), (None, None))
    N, X = logits.shape
    if X > ROUTE_MAX_X:
        raise KernelError(f"logits: {X} experts > {ROUTE_MAX_X}")
    extra = int(shared)                                  # the shared expert's slot
    k_max = min(X - extra, ROUTE_MAX_K - extra)
    if not 1 <= top_k <= k_max:
        raise KernelError(f"top_k: {top_k} not in [1, {k_max}]")
    A = top_k + extra
    if weights_out is None:
        weights_out = torch.empty(N, A, dtype=BF16, device=logits.device)
    if ids_out is None:
        ids_out = torch.empty(N, A, dtype=torch.int32, device=logits.device)
    check(weights_out, "weights_out", BF16, (N, A))
    check(ids_out, "ids_out", torch.int32, (N, A))
    if not logits.is_contiguous() or not weights_out.is_contiguous() or not ids_out.is_contiguous():
        raise KernelError("logits, weights_out and ids_out must be contiguous")
    dev = _same_device(logits=logits, weights_out=weights_out, ids_out=ids_out)
    if N == 0:
        return weights_out, ids_out
    threads = 32 * _cdiv(X - extra, 32)                # a thread per routed logit, one block per token
    launch(kernel("moe", "moe_route_topk", dev), (N,), (threads,),
           (weights_out, ids_out, logits, int(logits.dtype == torch.float32), N, X, int(top_k), int(shared)),
           device=dev, pdl=True)
    return weights_out, ids_out


def _check_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor):
    check(x, "x", BF16, (None, None))
    N, E = x.shape
    check(ids, "ids", (torch.int32, torch.int64), (N, None))
    A = ids.shape[1]
    check(weights, "weights", (BF16, torch.float32), (N, A))
    check(gate_up, "gate_up", BF16, (None, None, E))
    X, I2 = gate_up.shape[:2]
    if I2 % 2:
        raise KernelError(f"gate_up: shape {tuple(gate_up.shape)}, expected [X, 2I, E]")
    I = I2 // 2
    check(down, "down", BF16, (X, E, I))
    return N, E, A, X, I


def moe_kernels_variant() -> str:
    """The decode experts' kernels from $TANDEM_MOE_KERNELS ("auto" when unset or empty)."""
    v = getenv(MOE_KERNELS_ENV) or "auto"
    if v not in MOE_KERNELS_VARIANTS:
        raise KernelError(f"{MOE_KERNELS_ENV}={v!r}: expected one of {', '.join(MOE_KERNELS_VARIANTS)}")
    return v


def moe_experts_decode(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                       out: Tensor | None = None, h: Tensor | None = None) -> Tensor:
    """Routed experts for a small batch (N <= ~64): x [N, E] bf16, ids [N, A] int32/int64,
    weights [N, A] bf16/fp32, gate_up [X, 2I, E] bf16, down [X, E, I] bf16 -> out [N, E] bf16.

    Two launches: SwiGLU of the selected experts' gate/up rows into h [N, A, I] bf16 (scratch, may
    be passed in), then the weighted sum of the down projections in fp32. E % 8 == 0, I % 8 == 0.
    Ids are clamped to [0, X) on the device."""
    N, E, A, X, I = _check_experts(x, ids, weights, gate_up, down)
    if out is None:
        out = torch.empty(N, E, dtype=BF16, device=x.device)
    if h is None:
        h = torch.empty(N, A, I, dtype=BF16, device=x.device)
    check(out, "out", BF16, (N, E))
    check(h, "h", BF16, (N, A, I))
    dev = _same_device(x=x, ids=ids, weights=weights, gate_up=gate_up, down=down, out=out, h=h)
    if N == 0 or E == 0:
        return out
    if A == 0 or I == 0:
        out.zero_()
        return out
    if E % 8 or I % 8:
        raise KernelError(f"gate_up: E={E} and I={I} must be multiples of 8")
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down), ("h", h)):
        if not _aligned(t):
            raise KernelError(f"{name}: data pointer not 16-byte aligned")
    smem_a = E * 2
    smem_b = A * I * 2 + A * 8
    if smem_a > SMEM_LIMIT:
        raise KernelError(f"x: hidden size {E} too large for the decode experts kernel")
    if smem_b > SMEM_LIMIT:
        raise KernelError(f"ids: A * I = {A} * {I} too large for the decode experts kernel")
    if N > 65535 or A > 65535:
        raise KernelError(f"ids: shape {tuple(ids.shape)} too large for the decode experts kernel")
    ids64 = int(ids.dtype == torch.int64)
    variant = moe_kernels_variant()
    late = "_late" if variant == "old" or (variant == "auto" and N > MOE_EARLY_MAX_N) else ""
    warps = MOE_THREADS // 32
    launch(kernel("moe", "moe_gate_up_swiglu" + late, dev), (_cdiv(I, warps), A, N), (MOE_THREADS,),
           (h, x, ids, ids64, gate_up, E, I, X, A), shared_mem=smem_a, device=dev, pdl=True)
    launch(kernel("moe", "moe_down_combine" + late, dev), (_cdiv(E, warps), N), (MOE_THREADS,),
           (out, h, ids, ids64, weights, int(weights.dtype == torch.float32), down, E, I, X, A),
           shared_mem=smem_b, device=dev, pdl=True)
    return out


_GROUPED_MM: dict[str, bool] = {}


def _grouped_mm_works(device: torch.device) -> bool:
    """Whether torch._grouped_mm runs bf16 on this device (tried once per device with a tiny case
    against per-group matmuls)."""
    key = str(device)
    if key not in _GROUPED_MM:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.arange(1, 3 * 16 + 1, device=device, dtype=torch.float32).view(3, 16).div(64).to(BF16)
                b = torch.arange(2 * 16 * 16, device=device, dtype=torch.float32).view(2, 16, 16).div(512).to(BF16)
                offs = torch.tensor([1, 3], dtype=torch.int32, device=device)
                y = torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
                want = torch.cat([a[:1] @ b[0].T, a[1:] @ b[1].T])
                ok = bool(torch.equal(y, want))
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_MM[key] = ok
    return _GROUPED_MM[key]


def moe_experts_prefill(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor,
                        out: Tensor | None = None) -> Tensor:
    """Routed experts for large batches, grouped by expert.

    The (token, slot) pairs are sorted by expert and run as two grouped matmuls (torch._grouped_mm:
    one launch for every expert's gate|up, one for every down, offsets on the device) with the SwiGLU
    kernel between them; where the grouped matmul is unavailable (older torch, or GPUs it does not
    support: it is tried once per device) a loop of per-expert matmuls that reads the per-expert token
    counts on the host. NOT capturable in a CUDA graph (the id range check syncs). Same shapes as
    moe_experts_decode; each expert's output is rounded to bf16 as F.linear does, and the slots are
    summed in fp32 with one bf16 rounding. Ids must be in [0, X) (checked on the host here)."""
    N, E, A, X, I = _check_experts(x, ids, weights, gate_up, down)
    if out is None:
        out = torch.empty(N, E, dtype=BF16, device=x.device)
    check(out, "out", BF16, (N, E))
    _same_device(x=x, ids=ids, weights=weights, gate_up=gate_up, down=down, out=out)
    if N == 0 or A == 0:
        out.zero_()
        return out
    flat = ids.reshape(-1).long()
    if bool(((flat < 0) | (flat >= X)).any()):                  # host sync (prefill only)
        raise KernelError(f"ids: expert ids outside [0, {X})")
    order = torch.argsort(flat, stable=True)
    w = weights.reshape(-1).float()
    acc = torch.zeros(N, E, dtype=torch.float32, device=x.device)
    if _grouped_mm_works(x.device):
        offs = torch.cumsum(torch.bincount(flat, minlength=X), 0, dtype=torch.int32)
        tok = order // A
        h = swiglu(torch._grouped_mm(x[tok], gate_up.transpose(1, 2), offs=offs))       # [N*A, I]
        y = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)                       # [N*A, E]
        acc.index_add_(0, tok, y.float() * w[order, None])
        out.copy_(acc)
        return out
    counts = torch.bincount(flat, minlength=X).tolist()         # host sync
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start:start + c]
        start += c
        tok = sel // A
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        acc.index_add_(0, tok, y.float() * w[sel, None])
    out.copy_(acc)
    return out


# --------------------------------------------------------------------------------------------------
# Argmax


def _argmax_chunk(R: int, V: int) -> int:
    """Elements per CTA: about 512 CTAs in all, 2048..16384 per CTA (a function of the shape only)."""
    want = _cdiv(V * max(R, 1), 512)
    chunk = 2048
    while chunk < want and chunk < 16384:
        chunk *= 2
    return chunk


def argmax_rows(logits: Tensor, values_out: Tensor | None = None,
                ids_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-row maximum and its index: logits [R, V] bf16 or fp32 -> (values [R] fp32, ids [R] int64).
    Ties go to the lower index; NaN never wins."""
    check(logits, "logits", (BF16, torch.float32), (None, None))
    R, V = logits.shape
    if V == 0:
        raise KernelError("logits: empty rows")
    if V >= 2**30:
        raise KernelError(f"logits: {V} columns >= 2^30")
    if values_out is None:
        values_out = torch.empty(R, dtype=torch.float32, device=logits.device)
    if ids_out is None:
        ids_out = torch.empty(R, dtype=torch.int64, device=logits.device)
    check(values_out, "values_out", torch.float32, (R,))
    check(ids_out, "ids_out", torch.int64, (R,))
    dev = _same_device(logits=logits, values_out=values_out, ids_out=ids_out)
    if R == 0:
        return values_out, ids_out
    if R > 65535:
        raise KernelError(f"logits: {R} rows > 65535")
    f32 = logits.dtype == torch.float32
    vec = 4 if f32 else 8
    vector = V % vec == 0 and _aligned(logits)
    name = ("argmax_chunks_f32" if f32 else "argmax_chunks_bf16") + (("_v4" if f32 else "_v8") if vector else "")
    chunk = _argmax_chunk(R, V)
    C = _cdiv(V, chunk)
    if C > 1:
        pv = torch.empty(R, C, dtype=torch.float32, device=logits.device)
        pi = torch.empty(R, C, dtype=torch.int32, device=logits.device)
    else:
        pv = pi = None
    launch(kernel("sample", name, dev), (C, R), (ARGMAX_THREADS,),
           (pv, pi, values_out, ids_out, logits, V, chunk, C), device=dev)
    if C > 1:
        launch(kernel("sample", "argmax_combine", dev), (R,), (min(ARGMAX_THREADS, _round32(C)),),
               (values_out, ids_out, pv, pi, C), device=dev)
    return values_out, ids_out
