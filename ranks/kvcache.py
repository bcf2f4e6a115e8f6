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

__all__ = ["PAGE_SIZE", "ModelState", "StateShapes"]


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
    conv[j]         [slots, C, K-1] for the j-th GDN layer (activation dtype)
    recurrent[j]    [slots, HV, DK, DV] fp32 (``state_dtype``)
    """

    def __init__(self, spec: ModelSpec, num_slots: int, num_pages: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", tp: int = 1, with_mtp: bool = False,
                 state_dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None):
        s = StateShapes.of(spec, tp)
        kv_dtype = kv_dtype or dtype
        self.num_slots, self.num_pages, self.page_size = num_slots, num_pages, PAGE_SIZE
        page = (num_pages, PAGE_SIZE, s.kv_heads, s.head_dim)
        n_attn, n_gdn = len(spec.full_attention_layers), len(spec.linear_attention_layers)
        self.k = [torch.zeros(page, dtype=kv_dtype, device=device) for _ in range(n_attn)]
        self.v = [torch.zeros(page, dtype=kv_dtype, device=device) for _ in range(n_attn)]
        self.mtp_k = torch.zeros(page, dtype=kv_dtype, device=device) if with_mtp else None
        self.mtp_v = torch.zeros(page, dtype=kv_dtype, device=device) if with_mtp else None
        self.conv = [torch.zeros(num_slots, s.conv_channels, s.conv_window, dtype=dtype, device=device)
                     for _ in range(n_gdn)]
        self.recurrent = [torch.zeros(num_slots, s.value_heads, s.key_head_dim, s.value_head_dim,
                                      dtype=state_dtype, device=device) for _ in range(n_gdn)]

    def nbytes(self) -> int:
        ts = self.k + self.v + self.conv + self.recurrent + [t for t in (self.mtp_k, self.mtp_v) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)
