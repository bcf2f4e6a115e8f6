"""Tensor-parallel split of the checkpoint: which slice of each tensor rank r of N holds.

Column-parallel (output rows split, by head): attention q_proj (per head [q | gate]), k_proj,
v_proj; GDN in_proj_qkv (its q, k and v sections each split separately), conv1d (same channels),
in_proj_z, in_proj_b, in_proj_a, A_log, dt_bias (by value head); MLP / shared-expert gate and up;
each expert's gate and up rows. Row-parallel (input columns split; their outputs are summed by the
all-reduce): o_proj, out_proj, down_proj (and each expert's down). Vocabulary-parallel: lm_head
(the tied embedding's rows when tied). Replicated: embedding, norms, router, shared_expert_gate,
mtp.fc. Value head h of a GDN layer reads key head h // (HV / HK), so with contiguous splits the
value heads of rank r use exactly the key heads of rank r.

Each rank reads only its slices from the safetensors files (Checkpoint.read with an index).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ranks.upload import Upload, nbytes
from ranks.weights import _DTYPES, Checkpoint, Layout, validate
from runtime.config import ModelSpec

log = logging.getLogger(__name__)


class ShardError(ValueError):
    """A tensor-parallel degree the model cannot be split into; the message names the numbers."""


def check_tp(spec: ModelSpec, tp: int) -> None:
    """Refuse a tp that does not divide every split dimension."""
    if tp < 1:
        raise ShardError(f"tp must be >= 1, got {tp}")
    problem = spec.tp_conflict(tp)
    if problem:
        raise ShardError(problem)


def _part(n: int, rank: int, tp: int, offset: int = 0) -> slice:
    size = n // tp
    return slice(offset + rank * size, offset + (rank + 1) * size)


def load_shard(ckpt: Checkpoint, spec: ModelSpec, rank: int, tp: int, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", layout: Layout | None = None,
               keep_quantised: bool = False,
               progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """Validate the checkpoint, then read rank `rank`'s slices of every tensor (experts fused).

    Names are canonical; ``lm_head.weight`` is always present (the tied embedding's rows when tied).
    With tp == 1 this equals ranks.weights.load_weights plus the head. A pre-quantised checkpoint's
    weights are dequantised to `dtype`; with `keep_quantised` (the CUDA backend) the linear weights
    its kernels read quantised (checkpoint_quant.KEPT) come back as QuantWeight where this rank's
    slice falls on the format's block boundaries (always at tp 1; at tp 2 for the 27B and 35B-A3B).

    On a CUDA device the tensors go up through pinned staging (ranks/upload.py); `progress(done,
    total)` hears the bytes loaded so far and the shard's total, the total counted first by a pass
    over the same reads on the meta device (shapes only, nothing read).
    """
    check_tp(spec, tp)
    if not 0 <= rank < tp:
        raise ShardError(f"rank {rank} outside [0, {tp})")
    layout = layout or validate(ckpt, spec)
    quant = getattr(layout, "quantised", None) or {}
    unaligned: list[str] = []

    up: Upload | None = None                         # None: the meta pass (shapes only)

    def read(name: str, *index: slice):
        q = quant.get(name)
        if up is None:
            return _meta(ckpt, q, name, index, dtype, keep_quantised)
        if q is None:
            return up.read(ckpt, name, index, dtype)
        from ranks import checkpoint_quant as CQ
        rows, cols = (tuple(index) + (None, None))[:2]
        if keep_quantised and name.endswith(CQ.KEPT):
            w = CQ.read(ckpt, q, rows, cols)
            if w is not None:
                return up.put(w)
            unaligned.append(name)
        return up.put(CQ.dequantised(ckpt, q, rows, cols, dtype))

    def cat_rows(parts: list):
        """Row sections of one weight (in_proj_qkv's q, k, v): one QuantWeight where they join exactly."""
        from kernels.quant import QuantWeight, cat_rows as q_cat
        if all(isinstance(t, QuantWeight) for t in parts):
            joined = q_cat(parts)
            if joined is not None:
                return joined
        return torch.cat([t.dequantize(dtype) if isinstance(t, QuantWeight) else t for t in parts])

    kd, vd = spec.linear_key_dim, spec.linear_value_dim
    every = slice(None)

    def col(n: int, offset: int = 0) -> slice:      # this rank's part of an output (row) axis
        return _part(n, rank, tp, offset)

    def collect() -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        names = set(ckpt.tensors)
        if quant:                                        # the logical weights, not their stored parts
            from ranks.checkpoint_quant import is_unused
            names = {n for n in names if not is_unused(n)} - {p for q in quant.values() for p in q.stored} | set(quant)
        for name in sorted(names):
            if name.startswith("mtp.") and not layout.has_mtp:
                continue
            if name in layout.ignored:
                continue
            if any(name.startswith(p) for p in layout.per_expert):
                continue
            leaf = name.rsplit(".", 2)
            key = ".".join(leaf[-2:]) if len(leaf) >= 2 else name
            if name == "lm_head.weight":
                if spec.tie_word_embeddings:
                    continue
                t = read(name, col(spec.vocab_size))
            elif key in ("q_proj.weight",):
                t = read(name, col(2 * spec.q_width))
            elif key in ("k_proj.weight", "v_proj.weight"):
                t = read(name, col(spec.kv_width))
            elif key == "o_proj.weight":
                t = read(name, every, col(spec.q_width))
            elif key in ("in_proj_qkv.weight", "conv1d.weight"):
                t = cat_rows([read(name, col(kd)), read(name, col(kd, kd)), read(name, col(vd, 2 * kd))])
            elif key == "in_proj_z.weight":
                t = read(name, col(vd))
            elif key in ("in_proj_b.weight", "in_proj_a.weight") or name.endswith(("linear_attn.A_log",
                                                                                    "linear_attn.dt_bias")):
                t = read(name, col(spec.linear_num_value_heads))
            elif key == "out_proj.weight":
                t = read(name, every, col(vd))
            elif key in ("gate_proj.weight", "up_proj.weight"):
                width = spec.shared_expert_intermediate_size if "shared_expert" in name else spec.intermediate_size
                t = read(name, col(width))
            elif key == "down_proj.weight":
                width = spec.shared_expert_intermediate_size if "shared_expert" in name else spec.intermediate_size
                t = read(name, every, col(width))
            elif name.endswith("experts.gate_up_proj"):
                I = spec.moe_intermediate_size
                t = torch.cat([read(name, every, col(I)), read(name, every, col(I, I))], dim=1)
            elif name.endswith("experts.down_proj"):
                t = read(name, every, every, col(spec.moe_intermediate_size))
            else:                                         # norms, embedding, router, gates, mtp.fc
                t = read(name)
            out[name] = t

        I = spec.moe_intermediate_size
        for prefix in layout.per_expert:                 # per-expert files: read each expert's slices
            gate_up, down = [], []
            for e in range(spec.num_experts):
                gate_up.append(torch.cat([read(f"{prefix}{e}.gate_proj.weight", col(I)),
                                          read(f"{prefix}{e}.up_proj.weight", col(I))]))
                down.append(read(f"{prefix}{e}.down_proj.weight", every, col(I)))
            out[prefix + "gate_up_proj"] = torch.stack(gate_up)
            out[prefix + "down_proj"] = torch.stack(down)
        if spec.tie_word_embeddings:
            out["lm_head.weight"] = read("embed_tokens.weight", col(spec.vocab_size))
        return out

    total = sum(nbytes(t) for t in collect().values()) if progress is not None else 0
    with Upload(device, total=total, report=progress) as up:
        out = collect()
    if unaligned:
        log.warning("rank %d of %d: %d quantised weights (%s, ...) are dequantised to %s: this rank's slice "
                    "does not fall on the format's block boundaries", rank, tp, len(unaligned), unaligned[0],
                    str(dtype).replace("torch.", ""))
    return out


def _meta(ckpt: Checkpoint, q, name: str, index: tuple, dtype: torch.dtype, keep_quantised: bool) -> torch.Tensor:
    """A meta tensor the size of what load_shard's read of (name, index) puts on the device: the stored
    dtype's codes for a quantised weight the kernels keep (nvfp4: two a byte), else `dtype`."""
    if q is None:
        info = ckpt.tensors[name]
        if isinstance(info, tuple):                  # a stand-in source's shape (random weights)
            return torch.empty(info, dtype=dtype, device="meta")[tuple(index)]
        stored = _DTYPES[info.dtype][0]
        out = dtype if stored.is_floating_point and dtype is not None else stored
        return torch.empty(info.shape, dtype=out, device="meta")[tuple(index)]
    t = torch.empty(q.shape, dtype=dtype, device="meta")[tuple(index)]
    from ranks import checkpoint_quant as CQ
    if keep_quantised and name.endswith(CQ.KEPT):
        cols = t.shape[-1] // 2 + t.shape[-1] // 16 if q.kind == "nvfp4" else t.shape[-1]   # codes (+ scales)
        return torch.empty(*t.shape[:-1], cols, dtype=torch.uint8, device="meta")
    return t
