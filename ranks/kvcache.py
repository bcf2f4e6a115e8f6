"""Per-rank decode state: paged KV pools for attention layers and GDN state slots.

Slots and pages are indices. A sequence owns one state slot (for every GDN layer: the conv window
of the last K-1 pre-conv inputs and the fp32 recurrent state) and a page table of int32 page ids
into one pool of PAGE_SIZE-token pages per attention layer (the MTP layer has its own pool, indexed
by the same page table). Ranks never decide bookkeeping: the coordinator's scheduler allocates slots
and pages and hands them over in each StepPlan; the ranks apply them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config import PAGE_SIZE, ModelSpec

__all__ = ["PAGE_SIZE", "KV_DTYPES", "ModelState", "StateShapes", "kv_torch_dtype"]

KV_DTYPES = ("bf16", "int8")
KV_GROUP = 64                 # channels per int8 scale


def kv_torch_dtype(kv_dtype: str | torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """The pool dtype of a KV format name: "bf16" (and None) = the activation dtype (bfloat16 on the
    GPU; the reference backend's float32 runs keep float32), "int8" = int8 codes + fp32 scales."""
    if kv_dtype is None or kv_dtype == "bf16":
        return dtype
    if kv_dtype == "int8":
        return torch.int8
    if isinstance(kv_dtype, torch.dtype):
        return kv_dtype
    raise ValueError(f"kv dtype {kv_dtype!r}: choose from {', '.join(KV_DTYPES)}")


@dataclass
class StateShapes:
    """Per-rank state dimensions (tensor parallelism divides the heads and channels)."""
    kv_heads: int
    head_dim: int
    conv_channels: int
    conv_window: int      # K - 1
    value_heads: int
    key_head_dim: int
    value_head_dim: int

    @classmethod
    def of(cls, spec: ModelSpec, tp: int = 1) -> "StateShapes":
        return cls(kv_heads=spec.num_kv_heads // tp, head_dim=spec.head_dim, conv_channels=spec.conv_dim // tp,
                   conv_window=spec.conv_kernel - 1, value_heads=spec.linear_num_value_heads // tp,
                   key_head_dim=spec.linear_key_head_dim, value_head_dim=spec.linear_value_head_dim)


class ModelState:
    """All decode state of one rank.

    k[j], v[j]      [P, PAGE_SIZE, KV, D] for the j-th full-attention layer (kv dtype)
    mtp_k, mtp_v    the same for the MTP layer (None without MTP)
    k_scale[j], v_scale[j], mtp_k_scale, mtp_v_scale
                    int8 KV only (kv_dtype torch.int8 or "int8"): fp32 [P, PAGE_SIZE, KV, D / 64], the
                    scale of each group of 64 channels (kernels/reference.quantize_kv_int8); None
                    for a 16/32-bit KV
    conv[j]         [slots, C, K-1] for the j-th GDN layer (activation dtype)
    recurrent[j]    [slots, HV, DK, DV] fp32 (``state_dtype``)
    """

    def __init__(self, spec: ModelSpec, num_slots: int, num_pages: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", tp: int = 1, with_mtp: bool = False,
                 state_dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | str | None = None):
        s = StateShapes.of(spec, tp)
        kv_dtype = kv_torch_dtype(kv_dtype, dtype)
        self.kv_dtype = kv_dtype
        quant = kv_dtype == torch.int8
        if quant and s.head_dim % KV_GROUP:
            raise ValueError(f"int8 KV needs a head dim that is a multiple of {KV_GROUP}, got {s.head_dim}")
        self.num_slots, self.num_pages, self.page_size = num_slots, num_pages, PAGE_SIZE
        page = (num_pages, PAGE_SIZE, s.kv_heads, s.head_dim)
        n_attn, n_gdn = len(spec.full_attention_layers), len(spec.linear_attention_layers)
        self.k = [torch.zeros(page, dtype=kv_dtype, device=device) for _ in range(n_attn)]
        self.v = [torch.zeros(page, dtype=kv_dtype, device=device) for _ in range(n_attn)]
        self.mtp_k = torch.zeros(page, dtype=kv_dtype, device=device) if with_mtp else None
        self.mtp_v = torch.zeros(page, dtype=kv_dtype, device=device) if with_mtp else None
        self.k_scale = self.v_scale = self.mtp_k_scale = self.mtp_v_scale = None
        if quant:
            spage = (num_pages, PAGE_SIZE, s.kv_heads, s.head_dim // KV_GROUP)
            self.k_scale = [torch.zeros(spage, dtype=torch.float32, device=device) for _ in range(n_attn)]
            self.v_scale = [torch.zeros(spage, dtype=torch.float32, device=device) for _ in range(n_attn)]
            if with_mtp:
                self.mtp_k_scale = torch.zeros(spage, dtype=torch.float32, device=device)
                self.mtp_v_scale = torch.zeros(spage, dtype=torch.float32, device=device)
        self.conv = [torch.zeros(num_slots, s.conv_channels, s.conv_window, dtype=dtype, device=device)
                     for _ in range(n_gdn)]
        self.recurrent = [torch.zeros(num_slots, s.value_heads, s.key_head_dim, s.value_head_dim,
                                      dtype=state_dtype, device=device) for _ in range(n_gdn)]

        self.snap_conv: list[torch.Tensor] = []      # prefix-cache snapshots (reserve_snapshots)
        self.snap_recurrent: list[torch.Tensor] = []

    def reserve_snapshots(self, n: int) -> None:
        """n snapshot slots of GDN state (every layer's conv window and recurrent state), for the
        prefix cache (runtime/prefix_cache.py): save_snapshot / load_snapshot copy a slot out and in."""
        self.snap_conv = [torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device) for t in self.conv]
        self.snap_recurrent = [torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
                               for t in self.recurrent]

    def save_snapshot(self, slot: int, snap: int) -> None:
        for dst, src in zip(self.snap_conv + self.snap_recurrent, self.conv + self.recurrent):
            dst[snap].copy_(src[slot])

    def load_snapshot(self, snap: int, slot: int) -> None:
        for dst, src in zip(self.conv + self.recurrent, self.snap_conv + self.snap_recurrent):
            dst[slot].copy_(src[snap])

    def attention_kv(self, j: int | None) -> tuple:
        """(k_pool, v_pool, k_scale, v_scale) of the j-th full-attention layer (j None: the MTP
        layer); the scales are None unless the KV is int8."""
        if j is None:
            return self.mtp_k, self.mtp_v, self.mtp_k_scale, self.mtp_v_scale
        if self.k_scale is None:
            return self.k[j], self.v[j], None, None
        return self.k[j], self.v[j], self.k_scale[j], self.v_scale[j]

    def nbytes(self) -> int:
        ts = self.k + self.v + self.conv + self.recurrent + [t for t in (self.mtp_k, self.mtp_v) if t is not None]
        ts += (self.k_scale or []) + (self.v_scale or [])
        ts += [t for t in (self.mtp_k_scale, self.mtp_v_scale) if t is not None]
        ts += self.snap_conv + self.snap_recurrent
        return sum(t.numel() * t.element_size() for t in ts)
