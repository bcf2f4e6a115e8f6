"""Per-rank decode state: paged KV pools for attention layers, GDN state slots, and a page allocator.

Slots and pages are indices. A sequence owns one state slot (for every GDN layer: the conv window
of the last K-1 pre-conv inputs and the fp32 recurrent state) and a page table of int32 page ids
into one pool of PAGE_SIZE-token pages per attention layer (the MTP layer has its own pool, indexed
by the same page table). Ranks never decide bookkeeping: whoever plans the step hands them slot ids
and page tables, and they apply them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config import ModelSpec

PAGE_SIZE = 64


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


class PageAllocator:
    """Free lists of page ids and slot ids (pure bookkeeping; no tensors)."""

    def __init__(self, num_pages: int, num_slots: int):
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.free_slots = list(range(num_slots - 1, -1, -1))

    def take_slot(self) -> int:
        if not self.free_slots:
            raise MemoryError("no free state slot")
        return self.free_slots.pop()

    def grow(self, table: list[int], length: int) -> None:
        """Append pages to `table` until it covers `length` tokens."""
        need = -(-length // PAGE_SIZE) - len(table)
        if need > len(self.free_pages):
            raise MemoryError(f"need {need} more KV pages for {length} tokens, {len(self.free_pages)} free")
        for _ in range(max(need, 0)):
            table.append(self.free_pages.pop())

    def release(self, table: list[int], slot: int | None) -> None:
        self.free_pages.extend(reversed(table))
        table.clear()
        if slot is not None:
            self.free_slots.append(slot)
