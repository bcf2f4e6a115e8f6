"""Gated attention on the GPU: q/k norm + rope + paged KV write, batched decode/verification
attention (flash-decoding over the paged bf16 pools), batched prefill attention on tensor cores, and a
torch prefill path. Kernels: cuda/attention.cu, cuda/prefill_attention.cu.

Batch metadata lives on the device so every call is CUDA-graph capturable (no host sync, no
data-dependent Python): positions [N] int32 (position of each column), seq_of_col [N] int32 (the
sequence of each column), page_tables [B, max_pages] int32 (page ids into pools [P, 64, KV, D]).
A sequence's columns sit at consecutive positions; column n attends to keys 0..positions[n].

    q = qk_norm_rope_kv_write(qg, k, v, q_norm_w, k_norm_w, eps, positions, seq_of_col,
                              page_tables, k_pool, v_pool, rotary_dim, theta)
    o = decode_attention(q, k_pool, v_pool, page_tables, positions, seq_of_col, D ** -0.5,
                         gate, max_len_hint=bucket_max_context)              # [N, H*D] gated
    o = prefill_attention_batched(q, k_pool, v_pool, page_tables, positions, cu_seqlens, D ** -0.5,
                                  gate, max_columns)                         # [N, H*D] gated, tensor cores

int8 KV: pools of int8 codes [P, 64, KV, D] with fp32 scale pools k_scale / v_scale [P, 64, KV, D/64]
(one scale per token, kv head and 64 channels; kernels/reference.quantize_kv_int8). Pass the scale
pools as k_scale= / v_scale= to every function; the pool dtype picks the kernels
(qk_norm_rope_kv_write_i8 quantises k after norm + rope and v; gqa_decode_split_i8_g* dequantise in
registers; prefill_attention_batched dequantises each K/V tile in shared memory; prefill_attention
gathers and dequantises in torch). D must be 64, 128 or 256 for the int8 decode.

Numerics follow kernels/reference.py in bf16: norms in fp32 rounded to bf16, cos/sin rounded to
bf16 and the rotation done in bf16 steps, softmax in fp32, the attention output rounded to bf16 and
multiplied by bf16(sigmoid(gate)) with one more bf16 rounding. (The reference also rounds the
probabilities to bf16 before P.V; the kernel keeps them in fp32.)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels import launch as L
from kernels.launch import KernelError, check

PAGE_SIZE = 64
_SRC = "attention"
_LOG2E = 1.4426950408889634
_NR_THREADS = 256                # qk_norm_rope_kv_write_*: 8 warps, one head row each
_NR_MAXD = 512
_ATT_THREADS = 128               # gqa_decode_split_g* (4 warps)
_ATT_MAXG = 8                    # query heads per CTA (instantiated 1..8)
_ATT_I8_MAXG = 4                 # gqa_decode_split_i8_g* (16 dims per lane: instantiated 1..4)
# head dims of the decode kernels: gqa_decode_split_g* a power of two in [8, ATT_MAXD = 256] (LPK = D / 8
# lanes per key row), gqa_decode_split_i8_g* 64, 128 or 256 (D / 16 lanes, scales per 64 channels).
# Every decode and verification step runs them (decode_attention_tc falls back to them), so these are
# also the head dims the CUDA backend can serve (ranks/cuda_support.py).
DECODE_HEAD_DIMS = (8, 16, 32, 64, 128, 256)
DECODE_I8_HEAD_DIMS = (64, 128, 256)
_KV_GROUP = 64                   # channels per int8 scale
_COMBINE_THREADS = 64
_MIN_CHUNK = 64                  # keys per split at least (H200, 27B C=1: 256 left 32 CTAs and 10% of the step)
_WAVES = 2                       # aim for this many CTAs per SM when choosing splits
# keys per split at most, for long contexts: a CTA streams its keys with ~8 KiB of loads in flight,
# so a long context needs many CTAs per SM to cover HBM latency (27B, 4 decodes at 32k keys in a
# 64k-key graph bucket: 17 splits of 3 904 keys left ~1 CTA per SM busy); bounded by the scratch
_MAX_CHUNK = 512
_SPLIT_SCRATCH = 32 << 20        # bytes of fp32 partial sums per call at most (wide batches: fewer splits)

__all__ = ["qk_norm_rope_kv_write", "decode_attention", "decode_attention_tc", "prefill_attention",
           "prefill_attention_batched", "choose_splits", "choose_tc_splits"]


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _rows(t: torch.Tensor, name: str, n: int, cols: int) -> torch.Tensor:
    """A bf16 [n, cols] matrix (or [n, a, b] with a*b = cols) whose rows may be strided (views of a
    fused projection); returned as 2-D with unit last stride, 16-byte aligned rows (copied if not)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        raise KernelError(f"{name}: expected a CUDA tensor")
    if t.dtype != torch.bfloat16:
        raise KernelError(f"{name}: dtype {t.dtype}, expected torch.bfloat16")
    if t.dim() == 3:
        t = t.flatten(1)
    if t.dim() != 2 or t.shape[0] != n or t.shape[1] != cols:
        raise KernelError(f"{name}: shape {tuple(t.shape)}, expected ({n}, {cols})")
    if t.stride(1) != 1 or (n > 1 and t.stride(0) % 8) or not _aligned(t):
        t = t.contiguous()
    return t


def _meta(positions: torch.Tensor, seq_of_col: torch.Tensor, page_tables: torch.Tensor, n: int) -> None:
    check(positions, "positions", torch.int32, (n,))
    check(seq_of_col, "seq_of_col", torch.int32, (n,))
    check(page_tables, "page_tables", torch.int32, (None, None))


def _pools(k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> tuple[int, int, bool]:
    """(KV, D, int8): bf16 pools without scales, or int8 pools with both fp32 scale pools."""
    quant = isinstance(k_pool, torch.Tensor) and k_pool.dtype == torch.int8
    dt = torch.int8 if quant else torch.bfloat16
    check(k_pool, "k_pool", dt, (None, PAGE_SIZE, None, None))
    check(v_pool, "v_pool", dt, tuple(k_pool.shape))
    if not (_aligned(k_pool) and _aligned(v_pool)):
        raise KernelError("k_pool/v_pool must be 16-byte aligned")
    P, _, KV, D = k_pool.shape
    if not quant:
        if k_scale is not None or v_scale is not None:
            raise KernelError("k_scale/v_scale are for int8 pools; these pools are bf16")
        return KV, D, False
    if k_scale is None or v_scale is None:
        raise KernelError("int8 pools need k_scale and v_scale")
    if D % _KV_GROUP:
        raise KernelError(f"int8 KV: head_dim {D} is not a multiple of {_KV_GROUP}")
    check(k_scale, "k_scale", torch.float32, (P, PAGE_SIZE, KV, D // _KV_GROUP))
    check(v_scale, "v_scale", torch.float32, (P, PAGE_SIZE, KV, D // _KV_GROUP))
    return KV, D, True


# --------------------------------------------------------------------------------------------------
# q/k norm + rope + KV write


def qk_norm_rope_kv_write(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor,
                          k_norm_w: torch.Tensor, eps: float, positions: torch.Tensor, seq_of_col: torch.Tensor,
                          page_tables: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rotary_dim: int,
                          theta: float, q_out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Zero-centred RMSNorm of every q and k head, partial NeoX rope over the first rotary_dim dims,
    q -> q_out [N, H, D]; normed+roped k and raw v stored in the pools at each column's position.

    qg [N, H*2*D] (per head [q | gate], the q_proj output), k, v [N, KV*D] (rows may be strided),
    q_norm_w, k_norm_w [D] bf16. Returns q_out. int8 pools (with k_scale / v_scale): k (the bf16
    value the bf16 kernel would store) and v are quantised per 64 channels and codes + scales stored.
    """
    KV, D, quant = _pools(k_pool, v_pool, k_scale, v_scale)
    N = qg.shape[0]
    if D % 8 or D > _NR_MAXD:
        raise KernelError(f"head_dim {D}: need a multiple of 8 <= {_NR_MAXD}")
    if qg.dim() != 2 or qg.shape[1] % (2 * D):
        raise KernelError(f"qg: shape {tuple(qg.shape)}, expected (N, H*2*{D})")
    H = qg.shape[1] // (2 * D)
    if rotary_dim % 2 or not 0 < rotary_dim <= D:
        raise KernelError(f"rotary_dim {rotary_dim}: need an even value in (0, {D}]")
    qg = _rows(qg, "qg", N, H * 2 * D)
    k = _rows(k, "k", N, KV * D)
    v = _rows(v, "v", N, KV * D)
    for w, name in ((q_norm_w, "q_norm_w"), (k_norm_w, "k_norm_w")):
        check(w, name, torch.bfloat16, (D,))
        if not _aligned(w):
            raise KernelError(f"{name} must be 16-byte aligned")
    _meta(positions, seq_of_col, page_tables, N)
    if q_out is None:
        q_out = torch.empty(N, H, D, dtype=torch.bfloat16, device=qg.device)
    check(q_out, "q_out", torch.bfloat16, (N, H, D))
    if not _aligned(q_out):
        raise KernelError("q_out must be 16-byte aligned")
    if N == 0:
        return q_out
    dev = L.device_of(qg)
    tail = (qg, k, v, q_norm_w, k_norm_w, positions, seq_of_col, page_tables,
            H, KV, D, int(rotary_dim), page_tables.shape[1], np.int64(qg.stride(0)), np.int64(k.stride(0)),
            np.int64(v.stride(0)), np.float32(eps), np.float32(theta))
    grid = (N, -(-(H + 2 * KV) // (_NR_THREADS // 32)))
    if quant:
        fn = L.kernel(_SRC, "qk_norm_rope_kv_write_i8", dev)
        L.launch(fn, grid, (_NR_THREADS,), (q_out, k_pool, v_pool, k_scale, v_scale) + tail, device=dev, pdl=True)
    else:
        fn = L.kernel(_SRC, "qk_norm_rope_kv_write_bf16", dev)
        L.launch(fn, grid, (_NR_THREADS,), (q_out, k_pool, v_pool) + tail, device=dev, pdl=True)
    return q_out


# --------------------------------------------------------------------------------------------------
# Decode / verification attention


def _head_chunk(groups: int, max_chunk: int = _ATT_MAXG) -> int:
    """Query heads per CTA: the largest divisor of `groups` that is <= max_chunk (8; 4 for int8 KV)."""
    return max(c for c in range(1, max_chunk + 1) if groups % c == 0)


def choose_splits(n_cols: int, kv_heads: int, groups: int, max_len: int, sms: int,
                  max_chunk: int = _ATT_MAXG, head_dim: int = 256) -> tuple[int, int]:
    """(splits, chunk): key splits per (column, kv head) and keys per split (a multiple of 64).

    Enough CTAs for ~_WAVES per SM, but no split shorter than _MIN_CHUNK keys of the bound max_len;
    and no split longer than _MAX_CHUNK keys while the partial sums (n_cols x heads x splits x
    head_dim fp32) stay within _SPLIT_SCRATCH. The kernel's last split runs to the true length, so a
    bound that is too small stays correct.
    """
    max_len = max(int(max_len), 1)
    ctas = max(1, n_cols * kv_heads * (groups // _head_chunk(groups, max_chunk)))
    want = max(1, -(-_WAVES * sms // ctas))
    splits = max(1, min(want, -(-max_len // _MIN_CHUNK)))
    per_split = max(1, n_cols * kv_heads * groups * (head_dim + 2) * 4)
    splits = max(splits, min(-(-max_len // _MAX_CHUNK), _SPLIT_SCRATCH // per_split))
    chunk = -(-max_len // splits)
    chunk = -(-chunk // PAGE_SIZE) * PAGE_SIZE
    return -(-max_len // chunk), chunk


def _gate(gate: torch.Tensor, N: int, H: int, D: int) -> tuple[torch.Tensor, int, int]:
    """gate as (tensor, column stride, head stride): [N, H*D] or [N, H, D] with unit last stride
    (e.g. qg.view(N, H, 2*D)[..., D:], no copy); copied when the layout does not fit 16-byte loads."""
    if not isinstance(gate, torch.Tensor) or gate.device.type != "cuda" or gate.dtype != torch.bfloat16:
        raise KernelError("gate: expected a bf16 CUDA tensor")
    if gate.dim() == 2:
        if tuple(gate.shape) != (N, H * D):
            raise KernelError(f"gate: shape {tuple(gate.shape)}, expected ({N}, {H * D})")
        s0, s1, s2 = gate.stride(0), D, gate.stride(1)
    elif gate.dim() == 3:
        if tuple(gate.shape) != (N, H, D):
            raise KernelError(f"gate: shape {tuple(gate.shape)}, expected ({N}, {H}, {D})")
        s0, s1, s2 = gate.stride(0), gate.stride(1), gate.stride(2)
    else:
        raise KernelError(f"gate: shape {tuple(gate.shape)}, expected ({N}, {H * D}) or ({N}, {H}, {D})")
    if s2 != 1 or s0 % 8 or s1 % 8 or not _aligned(gate):
        gate = gate.reshape(N, H * D).contiguous()
        s0, s1 = H * D, D
    return gate, s0, s1



def _gated_out(out: torch.Tensor | None, N: int, H: int, D: int, device) -> torch.Tensor:
    """The gated output [N, H*D] bf16 (16-byte aligned): `out` checked, or a new tensor."""
    if out is None:
        out = torch.empty(N, H * D, dtype=torch.bfloat16, device=device)
    check(out, "out", torch.bfloat16, (N, H * D))
    if not _aligned(out):
        raise KernelError("out must be 16-byte aligned")
    return out

def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_tables: torch.Tensor,
                     positions: torch.Tensor, seq_of_col: torch.Tensor, scale: float, gate: torch.Tensor,
                     out: torch.Tensor | None = None, max_len_hint: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of N columns (any mix of sequences, T >= 1 columns each) against the
    paged KV, gated: out [N, H*D] = bf16(attn) * bf16(sigmoid(gate)) in bf16. int8 pools: pass
    their scale pools (K and V dequantised in registers; D 64, 128 or 256).

    q [N, H, D] bf16 (from qk_norm_rope_kv_write); gate [N, H*D] or [N, H, D] (strided view ok).
    max_len_hint: a host-side bound on every column's key count (the bucket's max context); it
    picks the number of key splits (default: the page table width * 64). Lengths themselves are
    read on the device; a hint that is too small is slower, never wrong.
    """
    KV, D, quant = _pools(k_pool, v_pool, k_scale, v_scale)
    check(q, "q", torch.bfloat16, (None, None, D))
    N, H = q.shape[0], q.shape[1]
    if H % KV:
        raise KernelError(f"{H} query heads not a multiple of {KV} kv heads")
    if D not in DECODE_HEAD_DIMS:
        raise KernelError(f"head_dim {D}: the decode kernel needs a power of two in [8, 256]")
    if quant and D not in DECODE_I8_HEAD_DIMS:
        raise KernelError(f"head_dim {D}: the int8 decode kernel needs 64, 128 or 256")
    if not _aligned(q):
        raise KernelError("q must be 16-byte aligned")
    _meta(positions, seq_of_col, page_tables, N)
    gate, gs0, gs1 = _gate(gate, N, H, D)
    out = _gated_out(out, N, H, D, q.device)
    if N == 0:
        return out

    dev = L.device_of(q)
    G = H // KV
    max_chunk = _ATT_I8_MAXG if quant else _ATT_MAXG
    GC = _head_chunk(G, max_chunk)
    bound = page_tables.shape[1] * PAGE_SIZE
    max_len = bound if max_len_hint is None else max(1, min(int(max_len_hint), bound))
    S, chunk = choose_splits(N, KV, G, max_len, L.sm_count(dev), max_chunk, D)
    if S > 1:
        part_ml = torch.empty(N, H, S, 2, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(N, H, S, D, dtype=torch.float32, device=q.device)
    else:
        part_ml = part_acc = None
    pools = (k_pool, v_pool, k_scale, v_scale) if quant else (k_pool, v_pool)
    fn = L.kernel(_SRC, f"gqa_decode_split_i8_g{GC}" if quant else f"gqa_decode_split_g{GC}", dev)
    L.launch(fn, (N, KV * (G // GC), S), (_ATT_THREADS,),
             (out, part_ml, part_acc, q) + pools + (page_tables, positions, seq_of_col, gate,
              H, KV, D, page_tables.shape[1], chunk, S, np.int64(gs0), np.int64(gs1),
              np.float32(scale * _LOG2E)), device=dev, pdl=True)
    if S > 1:
        fn = L.kernel(_SRC, "gqa_decode_combine", dev)
        L.launch(fn, (N, H), (_COMBINE_THREADS,),
                 (out, part_ml, part_acc, positions, gate, H, D, chunk, S, np.int64(gs0), np.int64(gs1)),
                 device=dev, pdl=True)
    return out


# --------------------------------------------------------------------------------------------------
# Prefill (torch fallback)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [..., D] x fp32 [..., D/64] -> bf16 (fp32 product rounded once)."""
    D = codes.shape[-1]
    x = codes.float().view(*codes.shape[:-1], D // _KV_GROUP, _KV_GROUP) * scale[..., None]
    return x.view(codes.shape).to(torch.bfloat16)


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table_row: torch.Tensor,
                      positions: torch.Tensor, scale: float, gate: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, length: int | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of one sequence's T columns (q [T, H, D] at positions [T]) against its
    paged KV (already written for every position <= max(positions)).

    Not a custom kernel: the keys are gathered from the pool and torch's scaled_dot_product_attention
    runs with an explicit causal mask, the query heads of a kv head folded into the query axis (no
    KV repeat). Returns [T, H, D] bf16, or with `gate` the gated [T, H*D] (reference epilogue).
    `length` (keys to gather) defaults to max(positions) + 1, which reads it on the host: pass it
    (or use decode_attention) inside a CUDA graph. int8 pools (with k_scale / v_scale): the gathered
    codes are dequantised (fp32 code * scale, rounded to bf16) before the attention.
    """
    KV, D, quant = _pools(k_pool, v_pool, k_scale, v_scale)
    check(q, "q", torch.bfloat16, (None, None, D))
    T, H = q.shape[0], q.shape[1]
    if H % KV:
        raise KernelError(f"{H} query heads not a multiple of {KV} kv heads")
    G = H // KV
    check(positions, "positions", torch.int32, (T,))
    check(page_table_row, "page_table_row", torch.int32, (None,))
    if length is None:
        length = int(positions.max()) + 1
    pos = torch.arange(length, device=q.device)
    pages = page_table_row.long()[pos // PAGE_SIZE]
    offs = pos % PAGE_SIZE
    k, v = k_pool[pages, offs], v_pool[pages, offs]                         # [L, KV, D]
    if quant:
        k = _dequantize(k, k_scale[pages, offs])
        v = _dequantize(v, v_scale[pages, offs])
    k, v = k.permute(1, 0, 2), v.permute(1, 0, 2)                          # [KV, L, D]
    qf = q.view(T, KV, G, D).permute(1, 2, 0, 3).reshape(KV, G * T, D)       # row g*T + t
    mask = pos[None, :] <= positions.long()[:, None]                         # [T, L]
    o = F.scaled_dot_product_attention(qf[None], k[None], v[None], attn_mask=mask.repeat(G, 1)[None, None],
                                       scale=scale)[0]                      # [KV, G*T, D]
    o = o.view(KV, G, T, D).permute(2, 0, 1, 3).reshape(T, H, D)
    if gate is None:
        if out is not None:
            out.copy_(o)
            return out
        return o
    y = o.reshape(T, H * D) * torch.sigmoid(gate.reshape(T, H * D))
    if out is not None:
        out.copy_(y)
        return out
    return y


# --------------------------------------------------------------------------------------------------
# Batched prefill on tensor cores (cuda/prefill_attention.cu)

_PF_SRC = "prefill_attention"
_PF_DIMS = (64, 128, 256)        # head dims the kernel is instantiated for
_PF_WARPS = (8, 4)               # 16 query rows per warp; 8 preferred (a K/V tile serves 128 rows)
_SMEM_DEFAULT = 48 * 1024        # dynamic shared memory without the opt-in attribute


def prefill_smem_bytes(D: int, warps: int, quant: bool) -> int:
    """Dynamic shared memory of prefill_attn_*: Q [16 warps, D] + K, V [64, D] bf16 tiles, int8 staging
    (codes [64, D] and fp32 scales [64, D/64], for K and V), and one int per warp."""
    smem = 2 * D * (16 * warps + 2 * PAGE_SIZE) + 4 * warps
    if quant:
        smem += 2 * (PAGE_SIZE * D + PAGE_SIZE * (D // _KV_GROUP) * 4)
    return smem


def _smem_optin(device: int) -> int:
    """Largest dynamic shared memory a block may opt in to on `device`."""
    try:
        return L.device_attribute(device, "shared_memory_per_block_optin", L.DEV_ATTR_SMEM_OPTIN)
    except Exception:  # noqa: BLE001
        return _SMEM_DEFAULT


def _prefill_kernel(name: str, dev: int, smem: int):
    """The kernel, opted in to `smem` bytes of dynamic shared memory (launch.kernel)."""
    return L.kernel(_PF_SRC, name, dev, dynamic_smem=smem)


def prefill_warps(D: int, quant: bool, ctas8: int, sms: int, smem_limit: int, warps: int | None = None) -> int | None:
    """Warps per CTA of the prefill kernel (8 or 4), or None when no variant applies (the wrapper then
    takes the torch path): D must be 64, 128 or 256 and the CTA's shared memory must fit `smem_limit`.
    8 warps unless 4 are forced, 8 do not fit, or 8-warp CTAs (`ctas8` of them) would leave SMs idle."""
    if D not in _PF_DIMS:
        return None
    fits = [w for w in _PF_WARPS if prefill_smem_bytes(D, w, quant) <= smem_limit]
    if warps is not None:
        if warps not in _PF_WARPS:
            raise KernelError(f"warps {warps}: the prefill kernel has {_PF_WARPS}")
        return warps if warps in fits else None
    if not fits:
        return None
    if 8 in fits and (4 not in fits or ctas8 >= sms):
        return 8
    return 4


def _check_batched(q, k_pool, v_pool, k_scale, v_scale, page_tables, positions, cu_seqlens, scale,
                   max_columns) -> tuple[int, int, bool, int, int, int, int]:
    """The arguments of the batched attention (prefill_attention_batched, decode_attention_tc), checked:
    (KV, D, quant, N, H, B, max_columns)."""
    KV, D, quant = _pools(k_pool, v_pool, k_scale, v_scale)
    check(q, "q", torch.bfloat16, (None, None, D))
    N, H = q.shape[0], q.shape[1]
    if H % KV:
        raise KernelError(f"{H} query heads not a multiple of {KV} kv heads")
    if not _aligned(q):
        raise KernelError("q must be 16-byte aligned")
    check(positions, "positions", torch.int32, (N,))
    check(cu_seqlens, "cu_seqlens", torch.int32, (None,))
    B = cu_seqlens.shape[0] - 1
    if B < 1:
        raise KernelError("cu_seqlens: need B + 1 >= 2 entries")
    check(page_tables, "page_tables", torch.int32, (None, None))
    if page_tables.shape[0] < B or page_tables.shape[1] < 1:
        raise KernelError(f"page_tables: shape {tuple(page_tables.shape)} for {B} sequences")
    if not scale > 0:
        raise KernelError(f"scale {scale}: must be > 0")
    max_columns = int(max_columns)
    if N and not 1 <= max_columns <= N:
        raise KernelError(f"max_columns {max_columns}: need 1 <= max_columns <= N = {N}")
    return KV, D, quant, N, H, B, max_columns


def prefill_attention_batched(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              page_tables: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                              scale: float, gate: torch.Tensor, max_columns: int, max_len: int | None = None,
                              out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None, warps: int | None = None) -> torch.Tensor:
    """Causal gated GQA attention of the prefill columns of B sequences against the paged KV, on
    tensor cores (flash attention: no mask, no gather, key tiles past a tile's last position skipped).

    Inputs (device tensors, nothing read on the host, so a call is CUDA-graph capturable once the
    kernel is compiled):
      q            [N, H, D] bf16, contiguous: normed and roped queries (qk_norm_rope_kv_write's q_out).
      k_pool, v_pool  [P, 64, KV, D] bf16, or int8 codes with k_scale / v_scale [P, 64, KV, D/64] fp32.
                   Every key 0..positions[n] of each column's sequence must already be written (the
                   columns' own keys included: qk_norm_rope_kv_write runs first).
      page_tables  [>= B, max_pages] int32: row b holds sequence b's page ids; every page holding a key
                   <= that sequence's largest position must be valid.
      positions    [N] int32: position of each column.
      cu_seqlens   [B + 1] int32: sequence b owns columns cu_seqlens[b] .. cu_seqlens[b+1] - 1
                   (non-decreasing, cu_seqlens[0] = 0, cu_seqlens[B] = N; a sequence may have 0 columns).
      gate         [N, H*D] or [N, H, D] bf16 with unit last stride (a strided view of the q projection,
                   e.g. qg.view(N, H, 2*D)[..., D:], is used in place).
      scale        softmax scale (D ** -0.5), > 0.
      max_columns  host-side upper bound on any sequence's column count (it sizes the grid: a bound
                   that is too small leaves the first columns of longer sequences unwritten).
      max_len      optional host-side bound on any column's key count (largest position + 1); checked
                   against the page table width.
      warps        force 8 or 4 warps per CTA (tuning); default: 8 unless they would leave SMs idle
                   or do not fit the device's shared memory.

    Column n attends to keys 0..positions[n] of its sequence; query head h reads kv head h // (H/KV).
    Positions need not start at 0 (a chunk continuing a cached prompt) nor be consecutive, but each
    must be below max_pages * 64. Returns out [N, H*D] bf16 = bf16(attn) * bf16(sigmoid(gate)) (the
    decode kernels' epilogue); int8 pools are dequantised as the reference's bf16 path (fp32 code *
    scale rounded to bf16). Numerics: fp32 scores, softmax and accumulation; probabilities rounded to
    bf16 for P.V (as the reference does in bf16).

    D other than 64/128/256, or a device whose shared memory does not fit the smallest variant
    (int8 at D 256 needs ~130 KB), takes the torch path instead: prefill_attention per sequence, which
    reads cu_seqlens and the positions on the host (synchronises; not capturable).
    """
    KV, D, quant, N, H, B, max_columns = _check_batched(q, k_pool, v_pool, k_scale, v_scale, page_tables,
                                                        positions, cu_seqlens, scale, max_columns)
    if max_len is not None and not 1 <= int(max_len) <= page_tables.shape[1] * PAGE_SIZE:
        raise KernelError(f"max_len {max_len}: need 1 <= max_len <= {page_tables.shape[1] * PAGE_SIZE} "
                          f"(page table width * {PAGE_SIZE})")
    gate, gs0, gs1 = _gate(gate, N, H, D)
    out = _gated_out(out, N, H, D, q.device)
    if N == 0:
        return out

    dev = L.device_of(q)
    G = H // KV
    tiles8 = -(-max_columns * G // (16 * 8))
    W = prefill_warps(D, quant, KV * B * tiles8, L.sm_count(dev), _smem_optin(dev), warps)
    if W is None:
        return _prefill_torch(q, k_pool, v_pool, page_tables, positions, cu_seqlens, scale, gate, out,
                              k_scale, v_scale)
    tiles = -(-max_columns * G // (16 * W))
    if B > 65535 or tiles > 65535:
        raise KernelError(f"prefill grid ({KV}, {B}, {tiles}) exceeds 65535 in y or z")
    smem = prefill_smem_bytes(D, W, quant)
    name = f"prefill_attn_{'i8_' if quant else ''}d{D}_w{W}"
    fn = _prefill_kernel(name, dev, smem)
    L.launch(fn, (KV, B, tiles), (32 * W,),
             (out, q, k_pool, v_pool, k_scale, v_scale, page_tables, positions, cu_seqlens, gate,
              H, KV, page_tables.shape[1], np.int64(gs0), np.int64(gs1), np.float32(scale * _LOG2E)),
             shared_mem=smem, device=dev)
    return out


def _prefill_torch(q, k_pool, v_pool, page_tables, positions, cu_seqlens, scale, gate, out, k_scale, v_scale):
    """prefill_attention_batched on the torch path: prefill_attention per sequence (host sync)."""
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        if hi > lo:
            prefill_attention(q[lo:hi], k_pool, v_pool, page_tables[b], positions[lo:hi], scale, gate=gate[lo:hi],
                              out=out[lo:hi], k_scale=k_scale, v_scale=v_scale)
    return out


# --------------------------------------------------------------------------------------------------
# Decode on tensor cores: the prefill kernel's key-split form + the decode combine

_TC_MAX_CHUNK = 1024             # keys per split at most (while the partial sums fit _SPLIT_SCRATCH)
_TC_WARPS = 4                    # prefill_attn_split_* are instantiated with 4 warps (64 query rows)


def choose_tc_splits(ctas: int, max_len: int, sms: int, per_split_bytes: int) -> tuple[int, int]:
    """(splits, chunk_tiles) for decode_attention_tc: `ctas` CTAs per split (kv heads x sequences x row
    tiles); enough splits for ~_WAVES CTAs per SM and none longer than _TC_MAX_CHUNK keys, while the
    partial sums (per_split_bytes each) stay within _SPLIT_SCRATCH; chunk_tiles 64-key pages per split."""
    tiles = max(1, -(-int(max_len) // PAGE_SIZE))
    want = max(1, -(-_WAVES * sms // max(1, ctas)), -(-tiles * PAGE_SIZE // _TC_MAX_CHUNK))
    splits = max(1, min(want, tiles, _SPLIT_SCRATCH // max(1, per_split_bytes)))
    chunk_tiles = -(-tiles // splits)
    return -(-tiles // chunk_tiles), chunk_tiles


def decode_attention_tc(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_tables: torch.Tensor,
                        positions: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, gate: torch.Tensor,
                        max_columns: int, max_len_hint: int | None = None, out: torch.Tensor | None = None,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention's result (gated [N, H*D] bf16) for columns grouped by sequence (cu_seqlens, as
    prefill_attention_batched takes them), with Q K^T and P V on tensor cores: the prefill kernel's
    key-split form (prefill_attn_split_*: the G query heads of a kv head folded into the rows of one
    mma tile, 64-key pages through shared memory) writes per-split partials, gqa_decode_combine merges
    them and applies the gate. For long contexts, where the CUDA-core split kernel is bound by its
    per-head dot products. max_columns: a host bound on any sequence's column count; max_len_hint: on
    any column's key count (default: the page table width * 64; a hint that is too small is slower,
    never wrong: the last split runs to the end). Device reads only: capturable in a CUDA graph.
    D other than 64/128/256, or a device without the shared memory, takes decode_attention instead
    (it needs seq_of_col: derived here on the device)."""
    KV, D, quant, N, H, B, max_columns = _check_batched(q, k_pool, v_pool, k_scale, v_scale, page_tables,
                                                        positions, cu_seqlens, scale, max_columns)
    gate, gs0, gs1 = _gate(gate, N, H, D)
    out = _gated_out(out, N, H, D, q.device)
    if N == 0:
        return out
    dev = L.device_of(q)
    smem = prefill_smem_bytes(D, _TC_WARPS, quant)
    if D not in _PF_DIMS or smem > _smem_optin(dev):
        seq_of_col = torch.repeat_interleave(
            torch.arange(B, dtype=torch.int32, device=q.device), (cu_seqlens[1:] - cu_seqlens[:-1]).long(),
            output_size=N)
        return decode_attention(q, k_pool, v_pool, page_tables, positions, seq_of_col, scale, gate, out=out,
                                max_len_hint=max_len_hint, k_scale=k_scale, v_scale=v_scale)
    G = H // KV
    bound = page_tables.shape[1] * PAGE_SIZE
    max_len = bound if max_len_hint is None else max(1, min(int(max_len_hint), bound))
    tiles = -(-max_columns * G // (16 * _TC_WARPS))
    S, chunk_tiles = choose_tc_splits(KV * B * tiles, max_len, L.sm_count(dev), N * H * (D + 2) * 4)
    if B > 65535 or tiles * S > 65535:
        raise KernelError(f"decode grid ({KV}, {B}, {tiles * S}) exceeds 65535 in y or z")
    part_ml = torch.empty(N, H, S, 2, dtype=torch.float32, device=q.device)
    part_acc = torch.empty(N, H, S, D, dtype=torch.float32, device=q.device)
    name = f"prefill_attn_split_{'i8_' if quant else ''}d{D}_w{_TC_WARPS}"
    fn = _prefill_kernel(name, dev, smem)
    L.launch(fn, (KV, B, tiles * S), (32 * _TC_WARPS,),
             (q, k_pool, v_pool, k_scale, v_scale, page_tables, positions, cu_seqlens, H, KV, page_tables.shape[1],
              np.float32(scale * _LOG2E), tiles, chunk_tiles, S, part_ml, part_acc),
             shared_mem=smem, device=dev)
    L.launch(L.kernel(_SRC, "gqa_decode_combine", dev), (N, H), (_COMBINE_THREADS,),
             (out, part_ml, part_acc, positions, gate, H, D, chunk_tiles * PAGE_SIZE, S, np.int64(gs0),
              np.int64(gs1)), device=dev, pdl=True)
    return out
