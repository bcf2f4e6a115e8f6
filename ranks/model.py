"""The layer program of the Qwen3.5/3.6 hybrid model for one shard, on the reference ops.

A step gives each of B sequences some number of input columns (a prefill chunk, one decode token,
or the K+1 columns of a speculation round); all N columns are projected together and each
sequence's mixer runs against its own state (KV pages for attention layers, a state slot for GDN
layers). Decode is the case of one column per sequence.

The model knows nothing about ranks: tensor parallelism hands it a weight shard and an
`all_reduce` that sums row-parallel outputs (after o_proj / out_proj, and after the FFN's down
projection). With one rank the all-reduce is the identity.
"""

from __future__ import annotations

import logging
import os
import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from kernels import reference as ops
from ranks.kvcache import ModelState
from ranks.weights import Checkpoint, load_weights
from runtime.config import FULL_ATTENTION, ModelSpec, load_spec

log = logging.getLogger(__name__)
Tensor = torch.Tensor
LogitsMode = Literal["last", "all", "none"]


@dataclass
class Batch:
    """Inputs of one step: B sequences, N = sum(columns) input columns.

    token_ids    [N] int64, the columns of sequence 0, then sequence 1, ...
    columns      [B] number of input columns per sequence
    starts       [B] tokens already in each sequence's state: its first column sits at that position;
                 0 means a fresh sequence (its GDN state starts from zeros, whatever the slot holds)
    slots        [B] GDN state slot per sequence
    page_tables  [B, max_pages] int32 KV page ids (entries past a sequence's need are ignored)
    saves        (b, u, snap): after the first u columns of sequence b (0 < u < columns[b]), copy its
                 GDN state (every layer's conv window and recurrent state) to snapshot slot `snap`
                 (ModelState.reserve_snapshots): the prefix cache's frontier inside a prefill chunk,
                 which then needs no step of its own. Long (prefill) steps only on the CUDA backend.
    """
    token_ids: Tensor
    columns: list[int]
    starts: list[int]
    slots: list[int]
    page_tables: Tensor
    saves: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        B = len(self.columns)
        if not (len(self.starts) == len(self.slots) == B and self.page_tables.shape[0] == B):
            raise ValueError(f"batch fields disagree on B: columns {B}, starts {len(self.starts)}, "
                             f"slots {len(self.slots)}, page_tables {tuple(self.page_tables.shape)}")
        if self.token_ids.shape != (sum(self.columns),):
            raise ValueError(f"token_ids has shape {tuple(self.token_ids.shape)}; columns sum to {sum(self.columns)}")
        if any(c < 1 for c in self.columns):
            raise ValueError(f"every sequence needs at least one column, got {self.columns}")
        for b, u, snap in self.saves:
            if not (0 <= b < B and 0 < u < self.columns[b] and snap >= 0):
                raise ValueError(f"save {(b, u, snap)}: needs a sequence of the batch and 0 < u < its "
                                 f"{self.columns[b] if 0 <= b < B else '?'} columns")

    def saves_of(self, b: int) -> list[tuple[int, int]]:
        """(u, snap) of sequence b's in-step snapshot saves, in column order."""
        return sorted((u, snap) for i, u, snap in self.saves if i == b)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """(begin, end) row range of each sequence's columns."""
        out, at = [], 0
        for c in self.columns:
            out.append((at, at + c))
            at += c
        return out

    def positions(self, device: torch.device | str = "cpu") -> Tensor:
        """[N] position of every column."""
        return torch.cat([torch.arange(s, s + c) for s, c in zip(self.starts, self.columns)]).to(device)


@dataclass
class KeptColumns:
    """What a verification forward kept so that the GDN state can be committed after any accepted
    length without re-running anything (speculative decoding).

    seqs       batch indices of the kept sequences; slots their GDN state slots
    old_conv   [j][i] conv window [C, K-1] before the step (zeros for a fresh sequence)
    conv_in    [j][i] pre-conv inputs [T, C] of the step's columns
    states     [j][i] recurrent state after every column [T, HV, DK, DV]
    The live state of kept sequences is left untouched until `HybridModel.commit`.
    """
    seqs: list[int]
    slots: list[int]
    columns: list[int]
    old_conv: list[list[Tensor]]
    conv_in: list[list[Tensor]]
    states: list[list[Tensor]]
    # The batched form (the CUDA backend, every kept sequence with T columns; the lists above stay
    # empty): {"T": T, "old_conv": [j] -> [B, C, K-1], "conv_in": [j] -> [B*T, C],
    # "states": [j] -> [B*T, HV, DK, DV]}, committed by `commit_batched`.
    batched: dict | None = None


def conv_window(old: Tensor, x: Tensor, fresh: bool) -> Tensor:
    """A GDN conv window [C, K-1] (the last K-1 pre-conv inputs, oldest first) after the inputs x [u, C],
    continuing from the window `old` (zeros for a fresh sequence): an in-step snapshot's (Batch.saves)."""
    K1 = old.shape[-1]
    if x.shape[0] >= K1:
        return x[-K1:].t()
    return torch.cat([torch.zeros_like(old) if fresh else old, x.t().to(old.dtype)], 1)[:, -K1:]


def commit_batched(kept: KeptColumns, state: ModelState, accepted: list[int]) -> None:
    """HybridModel.commit for the batched form: per GDN layer, one gather of the kept recurrent
    states (row i*T + a_i) into the slots, and one gather of the conv windows (rows a_i+1 .. a_i+K-1
    of [old window; x_0 .. x_{T-1}])."""
    b = kept.batched
    B, T = len(kept.slots), b["T"]
    if len(accepted) != B:
        raise ValueError(f"commit needs one accepted length per kept sequence ({B}), got {len(accepted)}")
    if any(not 0 <= a < T for a in accepted):
        raise ValueError(f"accepted lengths {accepted} outside [0, {T})")
    if not b["states"]:
        return
    dev = b["states"][0].device
    commit_rows(b, state, torch.tensor(kept.slots, dtype=torch.long, device=dev),
                torch.tensor(accepted, dtype=torch.long, device=dev))


def commit_rows(b: dict, state: ModelState, slots: Tensor, a: Tensor) -> None:
    """The device part of commit_batched: `slots` and accepted lengths `a` [B] (int64) already on the
    device, so a whole speculation round can run (and be captured) without the host knowing `a`."""
    T, B = b["T"], slots.shape[0]
    if not b["states"]:
        return
    dev = b["states"][0].device
    rows = torch.arange(B, device=dev) * T + a
    windows: dict[tuple[int, int], Tensor] = {}                 # (C, W) -> gather index [B, W, C], built once
    for j in range(len(b["states"])):
        state.recurrent[j].index_copy_(0, slots, b["states"][j].index_select(0, rows).to(state.recurrent[j].dtype))
        old = b["old_conv"][j]                                     # [B, C, K-1]
        C, W = old.shape[1], old.shape[2]
        xs = torch.cat([old.transpose(1, 2), b["conv_in"][j].view(B, T, C).to(old.dtype)], dim=1)   # [B, W+T, C]
        idx = windows.get((C, W))
        if idx is None:
            idx = (a[:, None] + 1 + torch.arange(W, device=dev)[None, :])[:, :, None].expand(B, W, C)
            windows[(C, W)] = idx
        win = torch.gather(xs, 1, idx)                                                              # [B, W, C]
        state.conv[j].index_copy_(0, slots, win.transpose(1, 2).contiguous())


@dataclass
class StepOutput:
    hidden: Tensor          # [N, E] final-norm hidden (the MTP layer's input)
    logits: Tensor | None   # [B, V] (mode "last") or [N, V] (mode "all")
    kept: KeptColumns | None = None   # forward(keep_columns=...) only


class HybridModel:
    """One shard of the model: weights by canonical name plus the forward program."""

    def __init__(self, spec: ModelSpec, weights: dict[str, Tensor], *, tp: int = 1,
                 all_reduce: Callable[[Tensor], Tensor] | None = None):
        self.spec, self.w, self.tp = spec, weights, tp
        self.all_reduce = all_reduce or (lambda t: t)
        emb = weights["embed_tokens.weight"]
        self.dtype, self.device = emb.dtype, emb.device
        # the vocabulary shard of the head (tp > 1 loads the tied embedding's rows as lm_head.weight)
        self.head = weights.get("lm_head.weight", emb)
        self.has_mtp = "mtp.fc.weight" in weights
        self.attn_index = {i: j for j, i in enumerate(spec.full_attention_layers)}
        self.gdn_index = {i: j for j, i in enumerate(spec.linear_attention_layers)}
        # per-shard head counts
        self.num_heads, self.num_kv_heads = spec.num_heads // tp, spec.num_kv_heads // tp
        self.hk, self.hv = spec.linear_num_key_heads // tp, spec.linear_num_value_heads // tp
        self._kept: KeptColumns | None = None          # set during forward(keep_columns=...)
        self._keep: list[bool] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> "HybridModel":
        spec = load_spec(model_dir)
        weights = load_weights(Checkpoint(model_dir), spec, dtype=dtype, device=device)
        log.info("loaded %s: %d layers, %s, %.1f M parameters", model_dir, spec.num_layers, dtype,
                 sum(t.numel() for t in weights.values()) / 1e6)
        return cls(spec, weights)

    def new_state(self, num_slots: int, num_pages: int, kv_dtype: str | torch.dtype | None = None) -> ModelState:
        """Decode state; kv_dtype "bf16" / None (KV in the activation dtype) or "int8" (int8 codes
        with fp32 scales per 64 channels)."""
        state_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        return ModelState(self.spec, num_slots, num_pages, self.dtype, self.device, tp=self.tp,
                          with_mtp=self.has_mtp, state_dtype=state_dtype, kv_dtype=kv_dtype)

    # ----------------------------------------------------------------------------------------------
    # Forward passes

    @torch.inference_mode()
    def forward(self, batch: Batch, state: ModelState, logits: LogitsMode = "last",
                keep_columns: bool | list[bool] = False) -> StepOutput:
        """Run all layers over the batch's columns, updating `state` (KV written, GDN state advanced).

        keep_columns (all sequences, or a flag per sequence): verification columns. For those
        sequences the GDN layers run the recurrent rule column by column, keep the state after
        every column and the pre-conv inputs, and leave the live GDN state untouched; the result's
        `kept` is then handed to `commit` once the accepted lengths are known. Their KV is written
        for every column as usual: entries past the accepted length are stale but are rewritten
        (the next step's first column sits right after the accepted ones) before any query reads them.
        """
        if isinstance(keep_columns, bool):
            keep_columns = [keep_columns] * len(batch.columns)
        if any(keep_columns[b] for b, _, _ in batch.saves):
            raise ValueError("a verification sequence (keep_columns) cannot save a snapshot inside the step")
        kept = None
        if any(keep_columns):
            idx = [b for b, f in enumerate(keep_columns) if f]
            n_gdn = len(self.spec.linear_attention_layers)
            kept = KeptColumns(idx, [batch.slots[b] for b in idx], [batch.columns[b] for b in idx],
                               [[] for _ in range(n_gdn)], [[] for _ in range(n_gdn)], [[] for _ in range(n_gdn)])
        self._kept, self._keep = kept, keep_columns
        try:
            out = self._forward(batch, state, logits)
        finally:
            self._kept, self._keep = None, None
        out.kept = kept
        return out

    @torch.inference_mode()
    def forward_in_parts(self, batch: Batch, state: ModelState, logits: LogitsMode, keep: list[bool]) -> StepOutput:
        """forward(batch, state, logits, keep_columns=keep) as two steps: the kept sequences, then the
        others. Sequences of a step share nothing (own slots, pages, positions), so the result is the
        same up to rounding (matmuls of other shapes); outputs are put back in the batch's order and
        `kept.seqs` indexes the whole batch. For backends whose fast programs take a verification step
        or a prefill step but not both at once (a speculation round that carries a prompt chunk)."""
        B = len(batch.columns)
        if len(keep) != B:
            raise ValueError(f"keep has {len(keep)} flags for {B} sequences")
        starts_at = [0]
        for c in batch.columns:
            starts_at.append(starts_at[-1] + c)
        groups = [[b for b in range(B) if keep[b]], [b for b in range(B) if not keep[b]]]
        outs, col_order, seq_order = [], [], []
        for flag, idx in zip((True, False), groups):
            if not idx:
                continue
            cols = [c for b in idx for c in range(starts_at[b], starts_at[b + 1])]
            sub = Batch(batch.token_ids[cols], [batch.columns[b] for b in idx], [batch.starts[b] for b in idx],
                        [batch.slots[b] for b in idx], batch.page_tables[idx],
                        [(idx.index(b), u, snap) for b, u, snap in batch.saves if b in idx])
            out = self.forward(sub, state, logits, keep_columns=flag)
            if out.kept is not None:
                out.kept = dataclasses.replace(out.kept, seqs=[idx[i] for i in out.kept.seqs])
            outs.append(out)
            col_order += cols
            seq_order += idx
        if len(outs) == 1:
            return outs[0]

        def restore(parts: list[Tensor], order: list[int]) -> Tensor:
            cat = torch.cat(parts)
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            return cat.index_select(0, inverse.to(cat.device))
        hidden = restore([o.hidden for o in outs], col_order)
        lg = None
        if outs[0].logits is not None:
            lg = restore([o.logits for o in outs], col_order if logits == "all" else seq_order)
        return StepOutput(hidden, lg, outs[0].kept)

    @torch.inference_mode()
    def commit(self, kept: KeptColumns, state: ModelState, accepted: list[int]) -> None:
        """Make each kept sequence's GDN state the state after its first accepted[i] + 1 columns
        (accepted[i] in 0..columns-1): the recurrent state kept for that column, and the conv
        window = the last K-1 pre-conv inputs of [old window, x_0 .. x_a]."""
        if len(accepted) != len(kept.seqs):
            raise ValueError(f"commit needs one accepted length per kept sequence ({len(kept.seqs)}), "
                             f"got {len(accepted)}")
        for i, (slot, a) in enumerate(zip(kept.slots, accepted)):
            if not 0 <= a < kept.columns[i]:
                raise ValueError(f"accepted length {a} outside [0, {kept.columns[i]})")
            for j in range(len(kept.states)):
                old, x = kept.old_conv[j][i], kept.conv_in[j][i]
                w_dtype = self.w[f"layers.{self.spec.linear_attention_layers[j]}.linear_attn.conv1d.weight"].dtype
                xs = torch.cat([old.to(w_dtype).T, x[:a + 1].to(w_dtype)], dim=0)      # [K-1+a+1, C]
                state.conv[j][slot] = xs[a + 1:].T.to(old.dtype)
                state.recurrent[j][slot] = kept.states[j][i][a]

    def head_logits(self, hidden: Tensor) -> Tensor:
        """Logits of this rank's vocabulary shard for final-norm (or MTP) hidden rows [R, E]."""
        return self._linear(hidden, self.head)

    # The dense ops a backend may replace (the CUDA model routes them to its kernels and quantised weights).
    def _linear(self, x: Tensor, weight) -> Tensor:
        return ops.linear(x, weight)

    def _swiglu_mlp(self, x: Tensor, w_gate, w_up, w_down) -> Tensor:
        return ops.swiglu_mlp(x, w_gate, w_up, w_down)

    def _forward(self, batch: Batch, state: ModelState, logits: LogitsMode) -> StepOutput:
        s = self.spec
        positions = batch.positions(self.device)
        cos, sin = ops.rope_cos_sin(positions, s.rotary_dim, s.rope_theta, self.dtype)
        x = ops.embedding(batch.token_ids.to(self.device), self.w["embed_tokens.weight"])   # [N, E]
        for i, kind in enumerate(s.layer_types):
            p = f"layers.{i}."
            h = ops.rms_norm(x, self.w[p + "input_layernorm.weight"], s.rms_norm_eps)
            if kind == FULL_ATTENTION:
                j = self.attn_index[i]
                y = self._attention(p, h, batch, positions, cos, sin, *state.attention_kv(j))
            else:
                y = self._gated_deltanet(p, h, batch, state, self.gdn_index[i])
            x = x + y
            x = x + self._ffn(p, ops.rms_norm(x, self.w[p + "post_attention_layernorm.weight"], s.rms_norm_eps))
        hidden = ops.rms_norm(x, self.w["norm.weight"], s.rms_norm_eps)
        return StepOutput(hidden, self._logits(hidden, batch, logits))

    @torch.inference_mode()
    def mtp_forward(self, batch: Batch, hidden: Tensor, state: ModelState,
                    logits: LogitsMode = "all") -> StepOutput:
        """The MTP layer over the batch's columns.

        Column t of a sequence carries the id of the token *after* position starts+t and `hidden`
        [N, E] is the main model's final-norm hidden at that position (or the previous MTP output,
        for drafts 2..K). Writes the MTP layer's KV at those positions. Returns m (post mtp.norm,
        the feedback hidden) and logits that predict the token two ahead.
        """
        if not self.has_mtp:
            raise RuntimeError("this checkpoint has no MTP weights")
        s = self.spec
        positions = batch.positions(self.device)
        cos, sin = ops.rope_cos_sin(positions, s.rotary_dim, s.rope_theta, self.dtype)
        e = ops.embedding(batch.token_ids.to(self.device), self.w["embed_tokens.weight"])
        x = ops.mtp_fuse(e, hidden.to(self.dtype), self.w["mtp.pre_fc_norm_embedding.weight"],
                         self.w["mtp.pre_fc_norm_hidden.weight"], self.w["mtp.fc.weight"], s.rms_norm_eps)
        p = "mtp.layers.0."
        h = ops.rms_norm(x, self.w[p + "input_layernorm.weight"], s.rms_norm_eps)
        x = x + self._attention(p, h, batch, positions, cos, sin, *state.attention_kv(None))
        x = x + self._ffn(p, ops.rms_norm(x, self.w[p + "post_attention_layernorm.weight"], s.rms_norm_eps))
        m = ops.rms_norm(x, self.w["mtp.norm.weight"], s.rms_norm_eps)
        return StepOutput(m, self._logits(m, batch, logits))

    def _logits(self, hidden: Tensor, batch: Batch, mode: LogitsMode) -> Tensor | None:
        if mode == "none":
            return None
        if mode == "last":
            hidden = hidden[[end - 1 for _, end in batch.bounds]]
        return self._linear(hidden, self.head)

    # ----------------------------------------------------------------------------------------------
    # Mixers and FFN

    def _attention(self, p: str, h: Tensor, batch: Batch, positions: Tensor, cos: Tensor, sin: Tensor,
                   k_pool: Tensor, v_pool: Tensor, k_scale: Tensor | None = None,
                   v_scale: Tensor | None = None) -> Tensor:
        s, w, N = self.spec, self.w, h.shape[0]
        H, KV, D = self.num_heads, self.num_kv_heads, s.head_dim
        q, gate = ops.split_q_gate(self._linear(h, w[p + "self_attn.q_proj.weight"]), H, D)   # [N,H,D], [N,H*D]
        k = self._linear(h, w[p + "self_attn.k_proj.weight"]).view(N, KV, D)
        v = self._linear(h, w[p + "self_attn.v_proj.weight"]).view(N, KV, D)
        q = ops.apply_partial_rope(ops.rms_norm(q, w[p + "self_attn.q_norm.weight"], s.rms_norm_eps), cos, sin)
        k = ops.apply_partial_rope(ops.rms_norm(k, w[p + "self_attn.k_norm.weight"], s.rms_norm_eps), cos, sin)
        out = torch.empty_like(q)
        for b, (lo, hi) in enumerate(batch.bounds):
            table = batch.page_tables[b].to(self.device)
            ops.paged_kv_write(k_pool, v_pool, table, positions[lo:hi], k[lo:hi], v[lo:hi], k_scale, v_scale)
            out[lo:hi] = ops.paged_attention(q[lo:hi], k_pool, v_pool, table, positions[lo:hi], D ** -0.5,
                                             k_scale=k_scale, v_scale=v_scale)
        o = out.reshape(N, H * D) * torch.sigmoid(gate)
        return self.all_reduce(self._linear(o, w[p + "self_attn.o_proj.weight"]))

    def _gated_deltanet(self, p: str, h: Tensor, batch: Batch, state: ModelState, j: int) -> Tensor:
        s, w, N = self.spec, self.w, h.shape[0]
        HK, HV, DK, DV = self.hk, self.hv, s.linear_key_head_dim, s.linear_value_head_dim
        p += "linear_attn."
        qkv = self._linear(h, w[p + "in_proj_qkv.weight"])                       # [N, C] = [q | k | v]
        z = self._linear(h, w[p + "in_proj_z.weight"]).view(N, HV, DV)
        g, beta = ops.gdn_gates(self._linear(h, w[p + "in_proj_a.weight"]), self._linear(h, w[p + "in_proj_b.weight"]),
                                w[p + "A_log"], w[p + "dt_bias"])              # [N, HV] each
        conv_w = w[p + "conv1d.weight"][:, 0, :]                               # [C, K]
        out = torch.empty(N, HV, DV, dtype=self.dtype, device=self.device)
        for b, (lo, hi) in enumerate(batch.bounds):
            slot, fresh = batch.slots[b], batch.starts[b] == 0
            if self._keep is not None and self._keep[b]:
                out[lo:hi] = self._gdn_kept(j, qkv[lo:hi], conv_w, g[lo:hi], beta[lo:hi], slot, fresh, state)
                continue
            y, conv_state = ops.causal_conv1d(qkv[lo:hi], conv_w, None if fresh else state.conv[j][slot])
            q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
            T = hi - lo
            q, k = ops.gdn_prepare_qk(q.view(T, HK, DK), k.view(T, HK, DK), HV // HK)
            v = v.reshape(T, HV, DV)
            rec = None if fresh else state.recurrent[j][slot]
            at = 0
            for u, snap in batch.saves_of(b) + [(T, None)]:     # the rule in parts, split at the saves
                o, rec = ops.gated_delta_rule(q[at:u], k[at:u], v[at:u], g[lo + at:lo + u], beta[lo + at:lo + u], rec)
                out[lo + at:lo + u] = o.to(self.dtype)
                if snap is not None:                    # the state after u columns: window and rule
                    state.snap_conv[j][snap] = conv_window(state.conv[j][slot], qkv[lo:lo + u], fresh)
                    state.snap_recurrent[j][snap] = rec
                at = u
            state.conv[j][slot] = conv_state
            state.recurrent[j][slot] = rec
        y = ops.gated_rms_norm(out, z, w[p + "norm.weight"], s.rms_norm_eps).reshape(N, HV * DV)
        return self.all_reduce(self._linear(y, w[p + "out_proj.weight"]))

    def _gdn_kept(self, j: int, x: Tensor, conv_w: Tensor, g: Tensor, beta: Tensor, slot: int, fresh: bool,
                  state: ModelState) -> Tensor:
        """A verification block: per-column states kept, live state untouched."""
        s, kept = self.spec, self._kept
        HK, HV, DK, DV = self.hk, self.hv, s.linear_key_head_dim, s.linear_value_head_dim
        old = torch.zeros_like(state.conv[j][slot]) if fresh else state.conv[j][slot].clone()
        y, _ = ops.causal_conv1d(x, conv_w, old)
        q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
        T = x.shape[0]
        q, k = ops.gdn_prepare_qk(q.view(T, HK, DK), k.view(T, HK, DK), HV // HK)
        o, states = ops.gated_delta_rule_states(q, k, v.reshape(T, HV, DV), g, beta,
                                                None if fresh else state.recurrent[j][slot])
        kept.old_conv[j].append(old)
        kept.conv_in[j].append(x.clone())
        kept.states[j].append(states)
        return o.to(self.dtype)

    def _ffn(self, p: str, h: Tensor) -> Tensor:
        w = self.w
        p += "mlp."
        if not self.spec.is_moe:
            return self.all_reduce(self._swiglu_mlp(h, w[p + "gate_proj.weight"], w[p + "up_proj.weight"],
                                                    w[p + "down_proj.weight"]))
        shared = None
        if p + "shared_expert.gate_proj.weight" in w:
            shared = (w[p + "shared_expert.gate_proj.weight"], w[p + "shared_expert.up_proj.weight"],
                      w[p + "shared_expert.down_proj.weight"])
        y = ops.moe_block(h, w[p + "gate.weight"], self.spec.num_experts_per_tok, w[p + "experts.gate_up_proj"],
                          w[p + "experts.down_proj"], shared, w.get(p + "shared_expert_gate.weight"))
        return self.all_reduce(y)
