"""The Gated DeltaNet mixer on the GPU (kernels/cuda/gdn.cu): causal conv1d, the gated delta rule
with its gates and q/k l2norm fused, and the gated RMSNorm, batched over sequences.

Batch metadata stays on the device (int32): ``cu_seqlens`` [B+1] (sequence b owns columns
cu_seqlens[b] .. cu_seqlens[b+1]-1 of the N flattened columns; T >= 1 each), ``slots`` [B] (its state
slot; a negative slot means "no slot": the state starts from zeros and nothing is written back),
``fresh`` [B] (1: the sequence starts at position 0, its conv window and recurrent state start from
zeros whatever the slot holds). The slots of one batch must be distinct; a sequence whose column range
is empty or outside [0, N) is skipped (its outputs are left as they were). Nothing here reads device data on the host, so every call can be
captured in a CUDA graph; the launch shapes depend only on tensor shapes.

Numerics follow kernels/reference.py (causal_conv1d, gdn_gates, gdn_prepare_qk,
gated_delta_rule_recurrent / _states, gated_rms_norm); only fp32 summation orders differ. Verification
columns and decode columns run the same instructions, so ``keep_states[lo + a]`` is bit for bit the
state that decoding the first a+1 columns one at a time leaves.

The gated delta rule has two forms. The recurrent kernel walks a sequence's columns one at a time
(decode, verification, CUDA graphs: always this one). When the caller passes ``max_columns`` (the
longest sequence's column count, known on the host for prefill) of at least CHUNKED_MIN_COLUMNS and
keeps no per-column states, the chunked form runs instead (reference.gated_delta_rule_chunked: a
parallel kernel prepares every chunk of 64 columns, then a scan takes one step per chunk). It agrees
with the recurrent form to fp32 rounding, not bit for bit, and needs fp32 scratch of
HV * (DV + DK + 68) * 4 bytes per column (61 KiB at the 27B shape), allocated per call.
"""

from __future__ import annotations

import operator

import torch

from kernels.launch import KernelError, check, device_of, getenv, kernel, launch, sm_count

Tensor = torch.Tensor

_SOURCE = "gdn"
_CONV_THREADS = 128
_CONV_COLS = 16          # GDN_CONV_COLS in gdn.cu
_CONV_MAX_K = 8          # GDN_CONV_MAX_K in gdn.cu
# Two channels per conv thread (gdn_conv1d_bf16_x2: one 32-bit load or store for both) where C is even
# and x / out are 4-byte aligned; the same arithmetic per channel, so the same bits. TANDEM_GDN_CONV_X2=0
# keeps one channel per thread everywhere (for comparisons; read at every launch, so at graph capture).
CONV_X2_ENV = "TANDEM_GDN_CONV_X2"
_REC_WARPS = 4           # warps per block of the recurrent kernel (8 value columns each)
_NORM_WARPS = 8
_REC_KERNELS = {16: "gdn_recurrent_dk16", 32: "gdn_recurrent_dk32", 64: "gdn_recurrent_dk64",
                128: "gdn_recurrent_dk128", 256: "gdn_recurrent_dk256"}

# The chunked rule from this many columns in the longest sequence (with max_columns given). Measured on
# an H200 (scripts/bench/gdn_prefill.py, one sequence, 27B shape and its tp 2 half): the recurrent
# kernel is faster up to 128 columns (0.17 vs 0.22 ms), even at 256 (0.27 vs 0.25 ms), and the chunked
# form 1.6x faster from 2048.
CHUNKED_MIN_COLUMNS = 256
_CHUNK = 64              # GDN_CHUNK in gdn.cu
_PREP_THREADS = 256      # GDN_PREP_THREADS
_SCAN_THREADS = 128      # GDN_SCAN_THREADS
_SCAN_COLS = 16          # GDN_SCAN_COLS: value columns per block of the CUDA-core scan (DK 256)
_SCAN_TC_DK = (16, 32, 64, 128)   # GDN_SCAN_TC: DK with the tensor-core scan
_SCAN_TC_WARPS = 4       # most warps per tensor-core scan block (its launch bound: 128 threads)
_SCAN_UP = 68            # GDN_SCAN_UP in gdn.cu: row pitch (floats) of the scan block's U tile


def _batch(slots: Tensor, cu_seqlens: Tensor, fresh: Tensor) -> int:
    check(slots, "slots", torch.int32, (None,))
    B = slots.shape[0]
    check(cu_seqlens, "cu_seqlens", torch.int32, (B + 1,))
    check(fresh, "fresh", torch.int32, (B,))
    return B


def _same_device(dev: int, **tensors: Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and device_of(t) != dev:
            raise KernelError(f"{name}: on cuda:{device_of(t)}, expected cuda:{dev} (like the other arguments)")


def _aligned(t: Tensor, name: str, nbytes: int) -> None:
    if t.data_ptr() % nbytes:
        raise KernelError(f"{name}: data pointer must be {nbytes}-byte aligned (is it an offset view?)")


def conv1d(x: Tensor, weight: Tensor, conv_state: Tensor, slots: Tensor, cu_seqlens: Tensor, fresh: Tensor,
           out: Tensor | None = None, update_state: bool = True, max_columns: int | None = None) -> Tensor:
    """Depthwise causal conv + SiLU of every sequence's columns, continuing from its conv window.

    x [N, C] bf16 pre-conv inputs (in_proj_qkv output), weight [C, K] bf16 (2 <= K <= 8),
    conv_state [S, C, K-1] bf16 (window of the last K-1 inputs per slot, oldest first).
    Returns y [N, C] bf16 = bf16(silu(bf16(sum_j w[:, j] x_{t-K+1+j}))), sum in fp32.
    With update_state the new window (last K-1 inputs of [old window, the sequence's columns]) is
    written to the slot; verification passes False and keeps x for the commit.
    max_columns bounds the longest sequence (default N - B + 1, right when every T >= 1).
    """
    check(x, "x", torch.bfloat16, (None, None))
    N, C = x.shape
    check(weight, "weight", torch.bfloat16, (C, None))
    K = weight.shape[1]
    if not 2 <= K <= _CONV_MAX_K:
        raise KernelError(f"weight: conv kernel width {K} outside 2..{_CONV_MAX_K}")
    check(conv_state, "conv_state", torch.bfloat16, (None, C, K - 1))
    B = _batch(slots, cu_seqlens, fresh)
    dev = device_of(x)
    if out is None:
        out = torch.empty(N, C, dtype=torch.bfloat16, device=x.device)
    else:
        check(out, "out", torch.bfloat16, (N, C))
        if out.data_ptr() == x.data_ptr() and N * C:
            raise KernelError("out: must not alias x (later columns read earlier inputs)")
    _same_device(dev, weight=weight, conv_state=conv_state, slots=slots, cu_seqlens=cu_seqlens, fresh=fresh,
                 out=out)
    if N == 0 or B == 0:
        return out
    longest = max(1, N - B + 1) if max_columns is None else max(1, int(max_columns))
    chunks = -(-longest // _CONV_COLS)
    pair = (C % 2 == 0 and x.data_ptr() % 4 == 0 and out.data_ptr() % 4 == 0
            and (getenv(CONV_X2_ENV) or "1").strip() != "0")
    P = 2 if pair else 1
    grid = (-(-C // (P * _CONV_THREADS)), B, chunks)
    launch(kernel(_SOURCE, "gdn_conv1d_bf16_x2" if pair else "gdn_conv1d_bf16", dev), grid, (_CONV_THREADS,),
           (out, x, weight, conv_state, slots, cu_seqlens, fresh, N, C, K, 1 if update_state else 0), device=dev, pdl=True)
    return out


def gated_delta_rule(y: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, state: Tensor,
                     slots: Tensor, cu_seqlens: Tensor, fresh: Tensor, num_k_heads: int, num_v_heads: int,
                     key_dim: int, value_dim: int, out: Tensor | None = None,
                     keep_states: Tensor | None = None, max_columns: int | None = None) -> Tensor:
    """Gates, q/k l2norm and the gated delta rule over every sequence's columns.

    y [N, C] bf16 conv output = [q (HK*DK) | k (HK*DK) | v (HV*DV)]; a, b [N, HV] bf16 (in_proj_a/b
    outputs); A_log, dt_bias [HV] fp32 or bf16; state [S, HV, DK, DV] fp32. num_k_heads = HK,
    num_v_heads = HV (HV % HK == 0; value head h reads key head h // (HV/HK)); key_dim = DK and
    value_dim = DV are the per-head dims (DK in {16, 32, 64, 128, 256}, DV % 8 == 0). Per column and
    value head: g = -exp(A_log) softplus(a + dt_bias), beta = bf16(sigmoid(b)),
    q = l2norm(q) DK^-0.5, k = l2norm(k); S = exp(g) S; u = k^T S; S += k (beta (v - u))^T; o = q^T S.
    Returns o [N, HV, DV] bf16. The slot's state is updated in place, unless keep_states
    [N, HV, DK, DV] fp32 is given: then the live state is left alone and the state after every
    column is written there (speculative verification).
    max_columns: the longest sequence's column count (it must not be smaller). Without keep_states and
    with max_columns >= CHUNKED_MIN_COLUMNS the chunked kernels run (prefill); otherwise, and always
    when it is None, the recurrent kernel.
    """
    HK, HV, DK, DV = int(num_k_heads), int(num_v_heads), int(key_dim), int(value_dim)
    if HK <= 0 or HV <= 0 or HV % HK:
        raise KernelError(f"num_v_heads {HV} must be a positive multiple of num_k_heads {HK}")
    if DK not in _REC_KERNELS:
        raise KernelError(f"key_dim {DK} (per head) not supported; expected one of {sorted(_REC_KERNELS)}")
    if DV <= 0 or DV % 8:
        raise KernelError(f"value_dim {DV} (per head) must be a positive multiple of 8")
    if max_columns is not None:
        try:
            max_columns = operator.index(max_columns)
        except TypeError:
            max_columns = -1
        if max_columns < 0:
            raise KernelError("max_columns must be a non-negative int (the longest sequence's column count)")
    C = 2 * HK * DK + HV * DV
    check(y, "y", torch.bfloat16, (None, C))
    N = y.shape[0]
    check(a, "a", torch.bfloat16, (N, HV))
    check(b, "b", torch.bfloat16, (N, HV))
    check(A_log, "A_log", (torch.float32, torch.bfloat16), (HV,))
    check(dt_bias, "dt_bias", (torch.float32, torch.bfloat16), (HV,))
    check(state, "state", torch.float32, (None, HV, DK, DV))
    B = _batch(slots, cu_seqlens, fresh)
    dev = device_of(y)
    if out is None:
        out = torch.empty(N, HV, DV, dtype=torch.bfloat16, device=y.device)
    else:
        check(out, "out", torch.bfloat16, (N, HV, DV))
    if keep_states is not None:
        check(keep_states, "keep_states", torch.float32, (N, HV, DK, DV))
        _aligned(keep_states, "keep_states", 16)
    _same_device(dev, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, slots=slots, cu_seqlens=cu_seqlens,
                 fresh=fresh, out=out, keep_states=keep_states)
    _aligned(y, "y", 16)
    _aligned(state, "state", 16)
    _aligned(out, "out", 8)
    if N == 0 or B == 0:
        return out
    flags = (1 if A_log.dtype == torch.bfloat16 else 0) | (2 if dt_bias.dtype == torch.bfloat16 else 0)
    if keep_states is None and max_columns is not None and max_columns >= CHUNKED_MIN_COLUMNS:
        _chunked_rule(out, state, y, a, b, A_log, dt_bias, flags, slots, cu_seqlens, fresh, N, B, HK, HV, DK, DV,
                      min(max_columns, N), dev)
        return out
    groups = DV // 8                                   # warps per value head
    wpb = min(_REC_WARPS, groups)
    grid = (-(-groups // wpb), HV, B)
    launch(kernel(_SOURCE, _REC_KERNELS[DK], dev), grid, (32 * wpb,),
           (out, keep_states, state, y, a, b, A_log, dt_bias, flags, slots, cu_seqlens, fresh,
            N, HK, HV, DV, float(DK ** -0.5)), device=dev, pdl=True)
    return out


def _scan_tc_smem(DK: int) -> int:
    """Dynamic shared memory of gdn_chunk_scan_tc_dkXX (GDN_SCAN_TC_SMEM in gdn.cu)."""
    return 4 * _CHUNK * DK * 2 + 2 * _CHUNK * _CHUNK * 2 + 2 * _CHUNK * 16 + _CHUNK * _SCAN_UP * 4


def _scan_tc_kernel(DK: int, dev: int):
    """The tensor-core scan for DK, opted in to its dynamic shared memory (launch.kernel)."""
    return kernel(_SOURCE, f"gdn_chunk_scan_tc_dk{DK}", dev, dynamic_smem=_scan_tc_smem(DK))


def _scan_tc_warps(DV: int, HV: int, B: int, sms: int) -> int:
    """Warps (16 value columns each) per tensor-core scan block: 4, halved while the smaller blocks
    still fit one per SM (every warp's step takes the same time, so an SM with two blocks would set the
    pace; a block loads its chunk tiles once for all its warps)."""
    w = min(_SCAN_TC_WARPS, -(-DV // 16))
    while w > 1 and -(-DV // (8 * w)) * HV * B <= sms:
        w //= 2
    return w


def _chunked_rule(out: Tensor, state: Tensor, y: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                  flags: int, slots: Tensor, cu_seqlens: Tensor, fresh: Tensor, N: int, B: int, HK: int, HV: int,
                  DK: int, DV: int, longest: int, dev: int) -> None:
    """The chunked gated delta rule (gdn.cu: gdn_chunk_prep_dkXX, then gdn_chunk_scan_tc_dkXX, or
    gdn_chunk_scan_dk256 for DK 256) through scratch indexed by column, in one fp32 allocation of
    N * HV * (DV + DK + 64 + 4) words (every section starts 16-byte aligned: DV % 8 == 0 and DK % 16 == 0):
    U [N, HV, DV] fp32, then for DK <= 128 W [N, HV, 2, DK] and QKD [N, HV, 2, 64] as bf16 hi, lo pairs
    and per-column factors {iq scale e^G, ik e^(G_last - G), e^G_last, 0} [N, HV, 4]; for DK 256
    W [N, HV, DK], QKD [N, HV, 64] fp32 and {G, iq, ik, 0}."""
    rows = N * HV
    scratch = torch.empty(rows * (DV + DK + _CHUNK + 4), dtype=torch.float32, device=out.device)
    U, W, QKD, info = torch.split(scratch, [rows * DV, rows * DK, rows * _CHUNK, rows * 4])
    scale = float(DK ** -0.5)
    launch(kernel(_SOURCE, f"gdn_chunk_prep_dk{DK}", dev), (-(-longest // _CHUNK), HK, B), (_PREP_THREADS,),
           (U, W, QKD, info, y, a, b, A_log, dt_bias, flags, cu_seqlens, N, HK, HV, DV, scale), device=dev)
    if DK in _SCAN_TC_DK:
        w = _scan_tc_warps(DV, HV, B, sm_count(dev))
        launch(_scan_tc_kernel(DK, dev), (-(-DV // (16 * w)), HV, B), (32 * w,),
               (out, state, U, W, QKD, info, y, slots, cu_seqlens, fresh, N, HK, HV, DV),
               shared_mem=_scan_tc_smem(DK), device=dev)
    else:
        launch(kernel(_SOURCE, f"gdn_chunk_scan_dk{DK}", dev), (-(-DV // _SCAN_COLS), HV, B), (_SCAN_THREADS,),
               (out, state, U, W, QKD, info, y, slots, cu_seqlens, fresh, N, HK, HV, DV, scale), device=dev)


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """The GDN output norm: x [N, HV, DV] bf16, z [N, HV*DV] (or [N, HV, DV]) bf16, weight [DV] bf16
    or fp32 -> [N, HV*DV] bf16 = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)) * silu(z)), as
    kernels/reference.gated_rms_norm (the product with a bf16 weight rounded to bf16). DV % 4 == 0."""
    check(x, "x", torch.bfloat16, (None, None, None))
    N, HV, DV = x.shape
    if DV % 4:
        raise KernelError(f"x: head dim {DV} must be a multiple of 4")
    check(z, "z", torch.bfloat16)
    if tuple(z.shape) not in ((N, HV * DV), (N, HV, DV)):
        raise KernelError(f"z: shape {tuple(z.shape)}, expected {(N, HV * DV)}")
    check(weight, "weight", (torch.bfloat16, torch.float32), (DV,))
    dev = device_of(x)
    if out is None:
        out = torch.empty(N, HV * DV, dtype=torch.bfloat16, device=x.device)
    else:
        check(out, "out", torch.bfloat16)
        if tuple(out.shape) not in ((N, HV * DV), (N, HV, DV)):
            raise KernelError(f"out: shape {tuple(out.shape)}, expected {(N, HV * DV)}")
    _same_device(dev, z=z, weight=weight, out=out)
    for t, name in ((x, "x"), (z, "z"), (out, "out")):
        _aligned(t, name, 8)
    rows = N * HV
    if rows == 0:
        return out
    launch(kernel(_SOURCE, "gdn_gated_rms_norm_bf16", dev), (-(-rows // _NORM_WARPS),), (32 * _NORM_WARPS,),
           (out, x, z, weight, 1 if weight.dtype == torch.bfloat16 else 0, rows, DV, float(eps)), device=dev, pdl=True)
    return out
