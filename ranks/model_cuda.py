"""The layer program on tandem's CUDA kernels (kernels/cuda/), for one shard on one GPU.

`CudaHybridModel` is a `HybridModel` whose steps run batched kernels over device-side batch
metadata:

    embedding -> [input norm -> mixer -> all-reduce -> add + post norm -> FFN -> all-reduce
                  -> add + next norm] x layers -> final norm -> vocabulary-shard head

Decode and verification steps (every sequence of the step has at most MAX_FAST_COLUMNS columns)
have no per-sequence Python, so the whole step can be captured as a CUDA graph (ranks/graphs.py)
and replayed with only the metadata copied in. Steps with longer sequences (prefill chunks) run the
same program eagerly ("long" steps: the DeviceBatch carries the host batch), with the prefill
attention kernel over the paged KV, the GDN rule in its chunked form, cuBLAS for the linear layers
and, for MoE models, the routed experts grouped by expert (torch matmuls). Verification steps with more than
MAX_FAST_COLUMNS columns (never planned by the engine) run the reference layer program. Weights may be quantised on load (FP8 per-row or 128x128 blocks, NVFP4):
the linear layers of attention, GDN and the MLP; embeddings, lm_head, norms, router, in_proj_a/b and
conv weights stay 16-bit.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kernels import cuda_attention as ca
from kernels import cuda_gdn as cg
from kernels import cuda_linear as cl
from kernels import cuda_misc as cm
from kernels import launch
from kernels import reference as ops
from kernels.quant import QuantWeight, cat_rows, quantize_fp8_blocks, quantize_fp8_rows, quantize_nvfp4
from ranks.cuda_support import WEIGHT_FORMATS, check_cuda_support
from ranks.kvcache import ModelState
from ranks.model import Batch, HybridModel, KeptColumns, StepOutput, commit_batched, conv_window
from ranks.upload import nbytes
from runtime.config import FULL_ATTENTION, PAGE_SIZE, ModelSpec

log = logging.getLogger(__name__)
Tensor = torch.Tensor

MAX_FAST_COLUMNS = 16
# a long step's leading short sequences (decodes beside prefill chunks) take the split decode kernel;
# False sends them through the prefill kernel with the chunks (scripts/bench/decode.py --mixed compares)
MIXED_DECODE_KERNEL = True
# decode / verification attention on tensor cores (cuda_attention.decode_attention_tc, which falls back
# to the CUDA-core split kernel for head dims or shared memory it lacks) when the step's key bound
# reaches TC_DECODE_MIN_LEN, else the split kernel. On an H200 it wins at every length measured: 27B bf16
# at 32k keys 1.20x / 1.46x / 1.79x faster steps at C = 1 / 4 / 8, and at 1k keys (the threshold was
# 4096 until then) 27B nvfp4 / fp8 / bf16 steps 1.03 / 1.04 / 1.03x faster at C = 1, 1.13 / 1.12 / 1.09x
# at C = 8 (docs/perf.md). TANDEM_DECODE_ATTENTION=split keeps the split kernel at every length (None:
# the variable is read at each step plan, so also at graph capture; True / False override it).
# TANDEM_TC_DECODE_MIN_LEN (read the same way) moves the threshold.
TC_DECODE_ATTENTION: bool | None = None
TC_DECODE_MIN_LEN = 0
TC_MIN_LEN_ENV = "TANDEM_TC_DECODE_MIN_LEN"


def tc_decode_min_len() -> int:
    n = launch.env_int(TC_MIN_LEN_ENV, 0)
    return TC_DECODE_MIN_LEN if n is None else n


def tc_decode_attention() -> bool:
    if TC_DECODE_ATTENTION is not None:
        return TC_DECODE_ATTENTION
    v = launch.getenv("TANDEM_DECODE_ATTENTION") or "tc"
    if v not in ("tc", "split"):
        raise ValueError(f"TANDEM_DECODE_ATTENTION={v!r}: expected tc or split")
    return v == "tc"

# linear layers that quantisation on load converts (suffixes of canonical names)
QUANTISED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
             "linear_attn.out_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
             "mlp.shared_expert.gate_up_proj.weight", "mlp.shared_expert.down_proj.weight")


@dataclass
class DeviceBatch:
    """A step's metadata on the device (int32), from one host-to-device copy.

    ids [N], positions [N], seq_of_col [N], cu_seqlens [B+1], slots [B], fresh [B] (1 = starts at 0),
    page_tables [B, P], last_cols [B] (row of each sequence's last column). max_len bounds every
    sequence's length after the step (sizes the attention's key splits).
    """
    B: int
    N: int
    P: int
    ids: Tensor
    positions: Tensor
    seq_of_col: Tensor
    cu_seqlens: Tensor
    slots: Tensor
    fresh: Tensor
    page_tables: Tensor
    last_cols: Tensor
    max_len: int
    storage: Tensor
    host: Batch | None = None

    @staticmethod
    def words(B: int, N: int, P: int) -> int:
        return 4 * N + (B + 1) + 3 * B + B * P

    @classmethod
    def on(cls, storage: Tensor, B: int, N: int, P: int, max_len: int, host: Batch | None = None) -> "DeviceBatch":
        """Views of a flat int32 buffer laid out as `pack` writes it."""
        at = 0

        def take(n: int) -> Tensor:
            nonlocal at
            t = storage[at:at + n]
            at += n
            return t
        ids, positions, seq_of_col = take(N), take(N), take(N)
        cu_seqlens, slots, fresh = take(B + 1), take(B), take(B)
        page_tables = take(B * P).view(B, P)
        last_cols = take(B)
        take(N)                                              # spare (keeps words() a simple formula)
        return cls(B, N, P, ids, positions, seq_of_col, cu_seqlens, slots, fresh, page_tables, last_cols,
                   max_len, storage, host)

    @staticmethod
    def pack(batch: Batch, P: int) -> np.ndarray:
        B, N = len(batch.columns), sum(batch.columns)
        cols = np.asarray(batch.columns, dtype=np.int64)
        starts = np.asarray(batch.starts, dtype=np.int64)
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(cols, out=cu[1:])
        seq_of_col = np.repeat(np.arange(B), cols)
        positions = starts[seq_of_col] + (np.arange(N) - cu[:-1][seq_of_col])
        tables = np.zeros((B, P), dtype=np.int32)
        pt = batch.page_tables.numpy() if isinstance(batch.page_tables, torch.Tensor) else np.asarray(batch.page_tables)
        w = min(P, pt.shape[1])
        tables[:, :w] = pt[:, :w]
        parts = [batch.token_ids.numpy(), positions, seq_of_col, cu, np.asarray(batch.slots),
                 (starts == 0).astype(np.int32), tables.reshape(-1), cu[1:] - 1, np.zeros(N)]
        return np.concatenate([np.asarray(p).astype(np.int32, copy=False).reshape(-1) for p in parts])


def apply_feed(storage: Tensor, feed: tuple[Tensor, Tensor] | None) -> None:
    """Write fed ids into a step's uploaded metadata (ids are its first words: DeviceBatch.pack), on
    the stream, after the upload."""
    if feed is not None:
        cols, ids = feed
        storage.index_copy_(0, cols, ids.to(torch.int32))


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pages_needed(batch: Batch) -> int:
    return max((s + c + PAGE_SIZE - 1) // PAGE_SIZE for s, c in zip(batch.starts, batch.columns))


class CudaHybridModel(HybridModel):
    """HybridModel with decode and verification on CUDA kernels, optionally as CUDA graphs."""

    def __init__(self, spec: ModelSpec, weights: dict[str, Tensor], *, tp: int = 1,
                 all_reduce: Callable[[Tensor], Tensor] | None = None, weight_format: str = "bf16",
                 cuda_graphs: bool = True, all_reduce_capturable: bool | None = None):
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {weight_format!r}: choose from {', '.join(WEIGHT_FORMATS)}")
        # the shapes the kernels take (ranks/cuda_support.py; the CLI and the ranks check it before any
        # weight is read, this for direct users). The KV format is not known yet: ModelState refuses an
        # int8 KV whose head_dim is not a multiple of 64, which with this check is the int8 kernel's rule
        check_cuda_support(spec, tp, weight_format, kv_dtype=None)
        emb = weights["embed_tokens.weight"]
        if emb.device.type != "cuda":
            raise ValueError(f"CudaHybridModel needs weights on a CUDA device, got {emb.device}")
        if emb.dtype != torch.bfloat16:
            raise ValueError(f"the CUDA kernels run bfloat16 activations; weights are {emb.dtype} "
                             "(use the reference backend for float32)")
        _fuse_gate_up(weights)
        _fuse_projections(weights)
        super().__init__(spec, weights, tp=tp, all_reduce=all_reduce)
        self.weight_format = weight_format
        if weight_format != "bf16":
            quantise_weights(weights, weight_format)
        else:
            _fuse_gdn_inputs(weights)                  # a|b stay bf16 when the others are quantised
        _fold_shared_experts(weights, spec.num_experts_per_tok)
        self.device_index = launch.device_of(emb)
        with torch.cuda.device(self.device_index):
            launch.warm_up(self.device_index)
        # a graph may only contain an all-reduce that runs on the stream (tp 1, or the GPU mailbox)
        if all_reduce_capturable is None:
            all_reduce_capturable = tp == 1
        self.graphs = None
        if cuda_graphs and all_reduce_capturable:
            from ranks.graphs import GraphRunner
            self.graphs = GraphRunner(self)
        self._meta_pinned: Tensor | None = None
        self._meta_copied: torch.cuda.Event | None = None
        self._keep_scratch: list[Tensor] | None = None
        self._rule_parts_of: tuple | None = None        # (host batch, _rule_parts) of the latest long step that saves

    # ----------------------------------------------------------------------------------------------
    # Entry points

    def feeds(self, columns: list[int]) -> bool:
        """Whether forward takes `feed` for a step of these columns (the fast program's steps)."""
        return max(columns) <= MAX_FAST_COLUMNS

    @torch.inference_mode()
    def forward(self, batch: Batch, state: ModelState, logits="last", keep_columns=False,
                feed: tuple[Tensor, Tensor] | None = None) -> StepOutput:
        """feed (device-fed steps, ranks/worker.py): (columns, ids), int64 on this device: those input
        columns take those ids instead of the batch's, written into the step's metadata on the stream
        after its upload, so the step may be launched before the ids are known on the host."""
        flags = [keep_columns] * len(batch.columns) if isinstance(keep_columns, bool) else list(keep_columns)
        if feed is not None and (any(flags) or not self.feeds(batch.columns)):
            raise ValueError("a fed step must be a plain step of the fast program (at most "
                             f"{MAX_FAST_COLUMNS} columns per sequence, no verification columns)")
        if any(flags) and not all(flags) and all(f or c == 1 for f, c in zip(flags, batch.columns)):
            # a speculation step with some undrafted one-column sequences: keep those too (committing
            # a = 0 installs exactly their one-column state), so the step stays on the fast path
            flags = [True] * len(flags)
        # in-step snapshot saves (Batch.saves) split the GDN rule: the eager long program does that
        fast = max(batch.columns) <= MAX_FAST_COLUMNS and (all(flags) or not any(flags)) and not batch.saves
        if not fast:
            if any(flags) and not all(flags) and max(c for c, f in zip(batch.columns, flags) if f) <= MAX_FAST_COLUMNS:
                # a speculation step that also carries prompt chunks (or undrafted sequences of more
                # than one column): the verification on the fast program, the rest as a long step
                return self.forward_in_parts(batch, state, logits, flags)
            if any(flags):                  # verification of more than 16 columns (never planned)
                return super().forward(batch, state, logits, keep_columns)
            with torch.cuda.device(self.device_index):          # a long (prefill) step, eager
                return self.fast_forward(self.device_batch(batch, long=True), state, logits)
        keep = all(flags)
        # a verification step where every sequence has T columns keeps its columns in the batched
        # form (graphable, committed by one gather per layer); mixed column counts keep lists (eager)
        uniform = all(c == batch.columns[0] for c in batch.columns)
        with torch.cuda.device(self.device_index):
            out = None
            if self.graphs is not None and logits != "all" and (uniform or not keep):
                out = self.graphs.run(batch, state, logits, keep=keep, feed=feed)
            if out is None:
                # the same page-table width as a graph of this batch would use: same attention splits,
                # so eager and replayed steps give the same bits
                db = self.device_batch(batch, pow2(pages_needed(batch)))
                apply_feed(db.storage, feed)
                if keep and uniform:
                    out = self.fast_forward(db, state, logits, keep_T=batch.columns[0])
                else:
                    return self.fast_forward(db, state, logits, keep_batch=batch if keep else None)
            if keep:                                  # the template's tensors, this batch's sequences
                out = StepOutput(out.hidden, out.logits, dataclasses.replace(
                    out.kept, seqs=list(range(len(batch.columns))), slots=list(batch.slots),
                    columns=list(batch.columns)))
            return out

    @torch.inference_mode()
    def commit(self, kept: KeptColumns, state: ModelState, accepted: list[int]) -> None:
        if kept.batched is not None:
            with torch.cuda.device(self.device_index):
                commit_batched(kept, state, accepted)
            return
        super().commit(kept, state, accepted)

    def _keep_buffers(self, N: int) -> list[Tensor]:
        """Per GDN layer an fp32 [N, HV, DK, DV] buffer for the per-column states of a verification
        step, shared by every step and graph (only the latest step's are committed); grown, never
        shrunk (graphs captured with an older buffer keep it alive)."""
        s = self.spec
        if self._keep_scratch is None or self._keep_scratch[0].shape[0] < N:
            size = pow2(N)                                      # powers of two: few regrowths
            n_gdn = len(s.linear_attention_layers)
            self._keep_scratch = None
            self._keep_scratch = [torch.empty(size, self.hv, s.linear_key_head_dim, s.linear_value_head_dim,
                                              dtype=torch.float32, device=self.device) for _ in range(n_gdn)]
        return [t[:N] for t in self._keep_scratch]

    def reserve_verification(self, columns: int) -> int:
        """Allocate the per-column GDN state buffers of verification steps up front for `columns`
        columns (slots x (K+1)), so they are not regrown while graphs hold older ones; returns bytes."""
        bufs = self._keep_buffers(columns)
        return sum(t.numel() * t.element_size() for t in self._keep_scratch) if bufs else 0

    @torch.inference_mode()
    def mtp_forward(self, batch: Batch, hidden: Tensor, state: ModelState, logits="all") -> StepOutput:
        """The MTP layer on the kernels (eagerly for prefill chunks, > MAX_FAST_COLUMNS columns)."""
        if not self.has_mtp:
            raise RuntimeError("this checkpoint has no MTP weights")
        with torch.cuda.device(self.device_index):
            long = max(batch.columns) > MAX_FAST_COLUMNS
            return self.fast_mtp(self.device_batch(batch, long=long), hidden, state, logits)

    def fast_mtp(self, db: DeviceBatch, hidden: Tensor, state: ModelState, logits="all") -> StepOutput:
        """m = mtp.norm(layer(fc([norm_e(embed(ids)) | norm_h(hidden)]))) and its head logits; the
        layer's attention uses the MTP KV pools (ops.mtp_fuse and HybridModel.mtp_forward in kernels)."""
        w, eps = self.w, self.spec.rms_norm_eps
        e = cm.rms_norm(cm.embedding(db.ids, w["embed_tokens.weight"]), w["mtp.pre_fc_norm_embedding.weight"], eps)
        h = cm.rms_norm(hidden.to(self.dtype).contiguous(), w["mtp.pre_fc_norm_hidden.weight"], eps)
        x = self._linear(torch.cat([e, h], dim=-1), w["mtp.fc.weight"])
        p = "mtp.layers.0."
        h = cm.rms_norm(x, w[p + "input_layernorm.weight"], eps)
        y = self._fast_attention(p, h, db, *state.attention_kv(None))
        x, h = cm.add_rms_norm(x, y, w[p + "post_attention_layernorm.weight"], eps)
        y = self._fast_ffn(p, h, long=db.host is not None)
        x, m = cm.add_rms_norm(x, y, w["mtp.norm.weight"], eps)
        return StepOutput(m, self._fast_logits(m, db, logits))

    def device_batch(self, batch: Batch, P: int | None = None, storage: Tensor | None = None,
                     extra: np.ndarray | None = None, long: bool = False) -> DeviceBatch:
        """Upload a batch's metadata (one copy through a pinned buffer); `extra` int32 words follow
        the batch's in the same copy (a speculation round's stop ids). long: a prefill step (the
        DeviceBatch keeps the host batch)."""
        P = P or pages_needed(batch)
        B, N = len(batch.columns), sum(batch.columns)
        packed = DeviceBatch.pack(batch, P)
        if extra is not None:
            packed = np.concatenate([packed, np.asarray(extra, dtype=np.int32).reshape(-1)])
        words = torch.from_numpy(packed)
        if self._meta_pinned is None or self._meta_pinned.numel() < words.numel():
            self._meta_pinned = torch.empty(max(words.numel(), 1 << 16), dtype=torch.int32, pin_memory=True)
            self._meta_copied = None
        if self._meta_copied is not None:          # the previous step's copy must have left the buffer
            self._meta_copied.synchronize()
        pinned = self._meta_pinned[:words.numel()]
        pinned.copy_(words)
        if storage is None:
            storage = torch.empty(words.numel(), dtype=torch.int32, device=self.device)
        storage[:words.numel()].copy_(pinned, non_blocking=True)
        self._meta_copied = torch.cuda.Event()
        self._meta_copied.record()
        return DeviceBatch.on(storage, B, N, P, P * PAGE_SIZE, batch if long else None)

    # ----------------------------------------------------------------------------------------------
    # The fast program

    def fast_forward(self, db: DeviceBatch, state: ModelState, logits="last",
                     keep_batch: Batch | None = None, keep_T: int | None = None) -> StepOutput:
        """keep_T: a verification step with T columns per sequence, kept in the batched form (its
        KeptColumns has no sequences yet: forward fills them in); keep_batch: mixed column counts,
        kept as per-sequence lists."""
        s, w, eps = self.spec, self.w, self.spec.rms_norm_eps
        kept = None
        n_gdn = len(s.linear_attention_layers)
        if keep_batch is not None:
            B = len(keep_batch.columns)
            kept = KeptColumns(list(range(B)), list(keep_batch.slots), list(keep_batch.columns),
                               [[] for _ in range(n_gdn)], [[] for _ in range(n_gdn)], [[] for _ in range(n_gdn)])
        elif keep_T is not None:
            kept = KeptColumns([], [], [], [], [], [], batched=dict(
                T=keep_T, old_conv=[], conv_in=[], states=self._keep_buffers(db.N)))
        x = cm.embedding(db.ids, w["embed_tokens.weight"])
        h = cm.rms_norm(x, w["layers.0.input_layernorm.weight"], eps)
        L = s.num_layers
        for i, kind in enumerate(s.layer_types):
            p = f"layers.{i}."
            if kind == FULL_ATTENTION:
                j = self.attn_index[i]
                y = self._fast_attention(p, h, db, *state.attention_kv(j))
            else:
                y = self._fast_gdn(p, h, db, state, self.gdn_index[i], keep_batch, kept)
            x, h = cm.add_rms_norm(x, y, w[p + "post_attention_layernorm.weight"], eps)
            y = self._fast_ffn(p, h, long=db.host is not None)
            nxt = w[f"layers.{i + 1}.input_layernorm.weight"] if i + 1 < L else w["norm.weight"]
            x, h = cm.add_rms_norm(x, y, nxt, eps)
        return StepOutput(h, self._fast_logits(h, db, logits), kept)

    def _fast_logits(self, hidden: Tensor, db: DeviceBatch, mode) -> Tensor | None:
        """Head logits of every column ("all"), of each sequence's last column ("last"), or none."""
        if mode == "none":
            return None
        return self._linear(hidden.index_select(0, db.last_cols) if mode == "last" else hidden, self.head)

    def _fast_attention(self, p: str, h: Tensor, db: DeviceBatch, k_pool: Tensor, v_pool: Tensor,
                        k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
        q, gate = self._attention_in(p, h, db.positions, db.seq_of_col, db.page_tables, k_pool, v_pool,
                                     k_scale, v_scale)
        if db.host is not None:
            o = self._prefill_attention(q, gate, db, k_pool, v_pool, k_scale, v_scale)
            return self.all_reduce(self._linear(o, self.w[p + "self_attn.o_proj.weight"]))
        if tc_decode_attention() and db.max_len >= tc_decode_min_len():
            o = ca.decode_attention_tc(q, k_pool, v_pool, db.page_tables, db.positions, db.cu_seqlens,
                                       self.spec.head_dim ** -0.5, gate, max_columns=db.N - db.B + 1,
                                       max_len_hint=db.max_len, k_scale=k_scale, v_scale=v_scale)
        else:
            o = ca.decode_attention(q, k_pool, v_pool, db.page_tables, db.positions, db.seq_of_col,
                                    self.spec.head_dim ** -0.5, gate, max_len_hint=db.max_len, k_scale=k_scale,
                                    v_scale=v_scale)                         # [N, H*D], gated
        return self.all_reduce(self._linear(o, self.w[p + "self_attn.o_proj.weight"]))

    def _prefill_attention(self, q: Tensor, gate: Tensor, db: DeviceBatch, k_pool: Tensor, v_pool: Tensor,
                           k_scale: Tensor | None, v_scale: Tensor | None) -> Tensor:
        """Gated attention [N, H*D] of a long step's columns (q, gate from _attention_in): the
        tensor-core prefill kernel over every sequence of the step at once.

        A step that mixes decodes with prefill chunks (the scheduler puts the decoding sequences
        first) sends its leading run of short sequences (<= MAX_FAST_COLUMNS columns) to the decode
        kernel instead: it splits a long context over the key axis, where the prefill kernel gives a
        sequence's last query tile one CTA per kv head that walks the whole context alone (which sets
        the step's pace once the context is long enough; 4 decodes at 32k keys beside a 2048-column
        chunk were 1.6% faster this way, docs/perf.md)."""
        batch, scale = db.host, self.spec.head_dim ** -0.5
        d = next((i for i, c in enumerate(batch.columns) if c > MAX_FAST_COLUMNS), len(batch.columns))
        d = d if MIXED_DECODE_KERNEL else 0
        nd = sum(batch.columns[:d])
        ends = [s + c for s, c in zip(batch.starts, batch.columns)]
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        if d:
            ca.decode_attention(q[:nd], k_pool, v_pool, db.page_tables, db.positions[:nd], db.seq_of_col[:nd],
                                scale, gate[:nd], out=out[:nd], max_len_hint=max(ends[:d]), k_scale=k_scale,
                                v_scale=v_scale)
        if d < len(batch.columns):
            cu = db.cu_seqlens[d:] - nd if d else db.cu_seqlens
            ca.prefill_attention_batched(
                q[nd:], k_pool, v_pool, db.page_tables[d:], db.positions[nd:], cu, scale, gate[nd:],
                max_columns=max(batch.columns[d:]), max_len=max(ends[d:]), out=out[nd:], k_scale=k_scale,
                v_scale=v_scale)
        return out

    def _attention_in(self, p: str, h: Tensor, positions: Tensor, seq_of_col: Tensor, page_tables: Tensor,
                      k_pool: Tensor, v_pool: Tensor, k_scale: Tensor | None, v_scale: Tensor | None):
        """q/k/v projections, q/k norm + partial rope, k and v written to the pools: (q [N, H, D],
        gate [N, H, D] view of the q projection's per-head [q | gate])."""
        s, w, N = self.spec, self.w, h.shape[0]
        H, D = self.num_heads, s.head_dim
        qg, k, v = self._projections(h, p + "self_attn.", "qkv_proj.weight",
                                     ("q_proj.weight", "k_proj.weight", "v_proj.weight"))   # qg [N, H*2D]
        q = ca.qk_norm_rope_kv_write(qg, k, v, w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"],
                                     s.rms_norm_eps, positions, seq_of_col, page_tables, k_pool, v_pool,
                                     s.rotary_dim, s.rope_theta, k_scale=k_scale, v_scale=v_scale)
        return q, qg.view(N, H, 2 * D)[..., D:]

    def _fast_gdn(self, p: str, h: Tensor, db: DeviceBatch, state: ModelState, j: int,
                  keep_batch: Batch | None, kept: KeptColumns | None) -> Tensor:
        s, N = self.spec, h.shape[0]
        HV, DK, DV = self.hv, s.linear_key_head_dim, s.linear_value_head_dim
        qkv, z, a, b = self._gdn_in(p, h)
        keep_states = None
        if kept is not None and kept.batched is not None:       # device ops only: graphable
            kb = kept.batched
            keep_states = kb["states"][j]
            old = state.conv[j].index_select(0, db.slots)      # a fresh sequence's window is zeros
            kb["old_conv"].append(old.masked_fill_(db.fresh.bool()[:, None, None], 0))
            kb["conv_in"].append(qkv)
        elif keep_batch is not None:
            keep_states = torch.empty(N, HV, DK, DV, dtype=torch.float32, device=h.device)
            for (lo, hi), slot, start in zip(keep_batch.bounds, keep_batch.slots, keep_batch.starts):
                old = state.conv[j][slot]
                kept.old_conv[j].append(torch.zeros_like(old) if start == 0 else old.clone())
                kept.conv_in[j].append(qkv[lo:hi].clone())
                kept.states[j].append(keep_states[lo:hi])
        return self._gdn_out(p, qkv, z, a, b, state, j, db.slots, db.cu_seqlens, db.fresh, keep_states,
                             max_columns=None if db.host is None else max(db.host.columns),
                             saving=db.host if db.host is not None and db.host.saves else None)

    def _gdn_in(self, p: str, h: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The GDN input projections: qkv [N, C] (pre-conv), z [N, HV*DV], a and b [N, HV]; one launch
        where _fuse_gdn_inputs made one weight of all four (bf16), else two."""
        q = p + "linear_attn."
        if q + GDN_INPUTS_FUSED in self.w and h.dtype == torch.bfloat16 and launch.getenv(GDN_FUSE_ENV) != "0":
            qkv, z, a, b = self._projections(h, q, GDN_INPUTS_FUSED, GDN_INPUTS)
            return qkv, z, a, b
        qkv, z = self._projections(h, q, "in_proj_qkvz.weight", ("in_proj_qkv.weight", "in_proj_z.weight"))
        a, b = self._projections(h, q, "in_proj_ab.weight", ("in_proj_a.weight", "in_proj_b.weight"))
        return qkv, z, a, b

    def _projections(self, h: Tensor, prefix: str, fused: str, parts: tuple[str, ...]) -> list[Tensor]:
        """The outputs of the linears `parts` (names under prefix): one launch over their fused weight
        where _fuse_projections made one, else one linear each."""
        w = self.w
        f = w.get(prefix + fused)
        if f is None or h.dtype != torch.bfloat16:
            return [self._linear(h, w[prefix + n]) for n in parts]
        return cl.linear_split(h.contiguous(), f, [_out_features(w[prefix + n]) for n in parts])

    def _gdn_out(self, p: str, qkv: Tensor, z: Tensor, a: Tensor, b: Tensor, state: ModelState, j: int,
                 slots: Tensor, cu_seqlens: Tensor, fresh: Tensor, keep_states: Tensor | None = None,
                 max_columns: int | None = None, saving: Batch | None = None) -> Tensor:
        """Conv, gated delta rule, gated norm and out_proj (+ all-reduce) over every sequence's
        columns; with keep_states the live state is left alone (verification). saving: a long step's
        host batch with in-step snapshot saves (Batch.saves): each save point's conv window is copied
        before the conv, and the rule runs in parts split at the save points (_rule_parts)."""
        s, w, q = self.spec, self.w, p + "linear_attn."
        conv_w = w[q + "conv1d.weight"].view(w[q + "conv1d.weight"].shape[0], -1)
        if saving is not None:
            self._save_conv_windows(qkv, state, j, saving)
        y = cg.conv1d(qkv, conv_w, state.conv[j], slots, cu_seqlens, fresh, update_state=keep_states is None,
                      max_columns=max_columns)
        rule = (w[q + "A_log"], w[q + "dt_bias"], state.recurrent[j])
        dims = (self.hk, self.hv, s.linear_key_head_dim, s.linear_value_head_dim)
        if saving is None:
            o = cg.gated_delta_rule(y, a, b, *rule, slots, cu_seqlens, fresh, *dims, keep_states=keep_states,
                                    max_columns=max_columns)
        else:
            o = torch.empty(y.shape[0], self.hv, s.linear_value_head_dim, dtype=torch.bfloat16, device=y.device)
            for r0, r1, p_slots, p_cu, p_fresh, longest, save in self._rule_parts(saving):
                cg.gated_delta_rule(y[r0:r1], a[r0:r1], b[r0:r1], *rule, p_slots, p_cu, p_fresh, *dims,
                                    out=o[r0:r1], max_columns=longest)
                if save is not None:                    # that slot's state after the save point
                    state.snap_recurrent[j][save[1]].copy_(state.recurrent[j][save[0]])
        o = cg.gated_rms_norm(o, z, w[q + "norm.weight"], s.rms_norm_eps)
        return self.all_reduce(self._linear(o, w[q + "out_proj.weight"]))

    @staticmethod
    def _save_conv_windows(qkv: Tensor, state: ModelState, j: int, host: Batch) -> None:
        """The conv window at each in-step save point of GDN layer j into its snapshot: the K-1 pre-conv
        inputs before the point, reaching back into the slot's window (zeros for a fresh sequence)
        where the point is that close to the step's start; taken before the conv moves the window."""
        for b, (lo, _) in enumerate(host.bounds):
            for u, snap in host.saves_of(b):
                state.snap_conv[j][snap].copy_(conv_window(state.conv[j][host.slots[b]], qkv[lo:lo + u],
                                                           host.starts[b] == 0))

    def _rule_parts(self, host: Batch) -> list[tuple]:
        """A long step's gated delta rule split at its in-step saves, as launches over contiguous row
        ranges: each sequence's columns cut at its save points, and a launch ends with every segment
        that ends at one (after it, that slot's state is the snapshot's). Per launch (r0, r1, slots,
        cu_seqlens, fresh, longest, (slot, snapshot) or None), the int32 tensors uploaded once per step
        (every GDN layer's rule splits alike)."""
        if self._rule_parts_of is not None and self._rule_parts_of[0] is host:
            return self._rule_parts_of[1]
        segments = []                                                       # (b, c0, c1, snapshot at c1)
        for b, c in enumerate(host.columns):
            at = 0
            for u, snap in host.saves_of(b) + [(c, None)]:
                segments.append((b, at, u, snap))
                at = u
        groups, cur = [], []
        for seg in segments:
            cur.append(seg)
            if seg[3] is not None:
                groups.append(cur)
                cur = []
        if cur:
            groups.append(cur)
        layout, words = [], []                          # per launch: (r0, rows, first word, sequences, longest, save)
        for g in groups:
            lens = [c1 - c0 for _, c0, c1, _ in g]
            b, _, _, snap = g[-1]
            layout.append((host.bounds[g[0][0]][0] + g[0][1], sum(lens), len(words), len(g), max(lens),
                           None if snap is None else (host.slots[b], snap)))
            words += [host.slots[b] for b, *_ in g] + [0] + np.cumsum(lens).tolist() + \
                [1 if c0 == 0 and host.starts[b] == 0 else 0 for b, c0, _, _ in g]
        dev = torch.tensor(words, dtype=torch.int32).to(self.device)
        parts = [(r0, r0 + n, dev[at:at + B], dev[at + B:at + 2 * B + 1], dev[at + 2 * B + 1:at + 3 * B + 1], longest,
                  save) for r0, n, at, B, longest, save in layout]
        self._rule_parts_of = (host, parts)
        return parts

    def _fast_ffn(self, p: str, h: Tensor, long: bool = False) -> Tensor:
        """The FFN; long: a prefill step, whose routed experts run grouped by expert (torch matmuls,
        one host sync) instead of the decode kernels."""
        w = self.w
        p += "mlp."
        if not self.spec.is_moe:
            mid = self._linear_swiglu(h, w[p + "gate_up_proj.weight"])
            return self.all_reduce(self._linear(mid, w[p + "down_proj.weight"]))
        if not long and p + SHARED_FOLD[0] in w:
            # the shared expert as one more expert (_fold_shared_experts): router and shared gate in one
            # GEMV, its sigmoid in the route kernel, its SwiGLU and down projection in the expert kernels
            logits = self._linear(h, w[p + SHARED_FOLD[0]])
            wts, ids = cm.moe_route(logits, self.spec.num_experts_per_tok, shared=True)
            y = cm.moe_experts_decode(h, ids, wts, w[p + SHARED_FOLD[1]], w[p + SHARED_FOLD[2]])
            return self.all_reduce(y)
        router = self._linear(h, w[p + "gate.weight"])
        wts, ids = cm.moe_route(router, self.spec.num_experts_per_tok)
        experts = cm.moe_experts_prefill if long else cm.moe_experts_decode
        y = experts(h, ids, wts, w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"])
        return self.all_reduce(self._add_shared_expert(p, h, y))

    def _add_shared_expert(self, q: str, h: Tensor, y: Tensor) -> Tensor:
        """y + sigmoid(shared_expert_gate h) * shared_expert(h) (through the fused, possibly quantised
        gate|up weight); y unchanged for a model without a shared expert. q: the "...mlp." prefix."""
        w = self.w
        if q + "shared_expert.gate_up_proj.weight" not in w:
            return y
        sh = self._linear(self._linear_swiglu(h, w[q + "shared_expert.gate_up_proj.weight"]),
                          w[q + "shared_expert.down_proj.weight"])
        return y + torch.sigmoid(self._linear(h, w[q + "shared_expert_gate.weight"])) * sh

    # ----------------------------------------------------------------------------------------------
    # Linear layers (kernels for few columns, cuBLAS for many; quantised weights either way)

    def _linear(self, x: Tensor, weight) -> Tensor:
        if x.dtype != torch.bfloat16 or (isinstance(weight, Tensor) and weight.dtype != torch.bfloat16):
            return super()._linear(x, weight)
        return cl.linear(x.contiguous(), weight)

    def _linear_swiglu(self, x: Tensor, gate_up) -> Tensor:
        return cl.linear_swiglu(x.contiguous(), gate_up)

    def _swiglu_mlp(self, x: Tensor, w_gate, w_up, w_down) -> Tensor:
        # reference path (prefill chunks): gate/up are views of the fused weight unless quantised
        return self._linear(torch.nn.functional.silu(self._linear(x, w_gate)) * self._linear(x, w_up), w_down)

    def _attention(self, p: str, h: Tensor, batch: Batch, positions: Tensor, cos: Tensor, sin: Tensor,
                   k_pool: Tensor, v_pool: Tensor, k_scale: Tensor | None = None,
                   v_scale: Tensor | None = None) -> Tensor:
        """Reference-path attention (prefill chunks) with the fused norm/rope/KV-write kernel and
        torch's fused attention per sequence instead of materialised scores."""
        N, H, D = h.shape[0], self.num_heads, self.spec.head_dim
        B = len(batch.columns)
        seq_of_col = torch.repeat_interleave(torch.arange(B, dtype=torch.int32),
                                             torch.tensor(batch.columns)).to(self.device)
        pos32 = positions.to(torch.int32)
        tables = batch.page_tables.to(device=self.device, dtype=torch.int32).contiguous()
        q, gate = self._attention_in(p, h, pos32, seq_of_col, tables, k_pool, v_pool, k_scale, v_scale)
        o = torch.empty(N, H * D, dtype=h.dtype, device=h.device)
        for b, (lo, hi) in enumerate(batch.bounds):
            o[lo:hi] = ca.prefill_attention(q[lo:hi], k_pool, v_pool, tables[b], pos32[lo:hi], D ** -0.5,
                                            gate=gate[lo:hi], length=batch.starts[b] + batch.columns[b],
                                            k_scale=k_scale, v_scale=v_scale)
        return self.all_reduce(self._linear(o, self.w[p + "self_attn.o_proj.weight"]))

    def _gated_deltanet(self, p: str, h: Tensor, batch: Batch, state: ModelState, j: int) -> Tensor:
        """Reference-path GDN (prefill chunks) on the decode kernels, which take any column count:
        the conv runs its columns in parallel, the recurrence walks them in order inside one kernel
        per layer (fp32 state in registers), instead of the torch chunked rule's many small ops.
        Verification blocks (keep_columns) keep the reference path."""
        if self._keep is not None and any(self._keep):
            return super()._gated_deltanet(p, h, batch, state, j)
        B = len(batch.columns)
        meta = torch.tensor([0] + list(np.cumsum(batch.columns)) + list(batch.slots)
                            + [int(st == 0) for st in batch.starts], dtype=torch.int32).to(self.device)
        cu, slots, fresh = meta[:B + 1], meta[B + 1:2 * B + 1], meta[2 * B + 1:]
        return self._gdn_out(p, *self._gdn_in(p, h), state, j, slots, cu, fresh, max_columns=max(batch.columns))

    def _ffn(self, p: str, h: Tensor) -> Tensor:
        """Reference-path FFN (prefill chunks): dense through the fused gate|up weight; MoE with the
        reference router and experts (bf16, never quantised) and the shared expert through its fused,
        possibly quantised weights, as in _fast_ffn."""
        if not self.spec.is_moe:
            return self._fast_ffn(p, h)                   # the dense FFN is the same at any column count
        w, q = self.w, p + "mlp."
        wts, ids = ops.moe_route(h, w[q + "gate.weight"], self.spec.num_experts_per_tok)
        y = ops.moe_experts(h, ids, wts, w[q + "experts.gate_up_proj"], w[q + "experts.down_proj"])
        return self.all_reduce(self._add_shared_expert(q, h, y))


def _fuse_gate_up(weights: dict[str, Tensor | QuantWeight]) -> None:
    """Concatenate every dense gate/up pair into one [2I, E] weight (one pass over the input per
    step); the separate names stay as views of it. A pre-quantised pair is joined exactly
    (kernels.quant.cat_rows), or where it cannot be (nvfp4 halves with different global scales, fp8
    halves off the 128-row tiles) dequantised to bf16 first."""
    for name in [n for n in weights if n.endswith("gate_proj.weight") and ".experts." not in n]:
        base = name[: -len("gate_proj.weight")]
        if base + "gate_up_proj.weight" in weights:
            continue
        gate, up = weights[name], weights[base + "up_proj.weight"]
        if isinstance(gate, QuantWeight) or isinstance(up, QuantWeight):
            fused = cat_rows([gate, up]) if isinstance(gate, QuantWeight) and isinstance(up, QuantWeight) else None
            if fused is None:
                log.warning("%sgate_proj / up_proj: quantised halves that cannot be joined exactly; "
                            "dequantised to bf16", base)
                fused = torch.cat([t.dequantize(torch.bfloat16) if isinstance(t, QuantWeight) else t
                                   for t in (gate, up)], dim=0)
        else:
            fused = torch.cat([gate, up], dim=0)
        del gate, up
        half = _out_features(fused) // 2
        weights[base + "gate_up_proj.weight"] = fused
        weights[name] = cl.weight_rows(fused, 0, half)
        weights[base + "up_proj.weight"] = cl.weight_rows(fused, half, 2 * half)


# The shared expert folded into the routed experts for decode (_fold_shared_experts): names under
# "...mlp." of the router with the shared gate as its last row [X + 1, E], and the expert stacks with the
# shared expert as expert X: gate|up [X + 1, 2I, E], down [X + 1, E, I].
SHARED_FOLD = ("gate_shared.weight", "experts_shared.gate_up_proj", "experts_shared.down_proj")


def _fold_shared_experts(weights: dict[str, Tensor | QuantWeight], top_k: int) -> None:
    """Where a MoE layer's shared expert has the routed experts' shapes and dtype (the 35B-A3B: both
    SwiGLU 512 wide, bf16), stack it after them as one more expert and its gate after the router's rows
    (SHARED_FOLD): a decode step then routes it as a (top_k + 1)-th expert with weight
    sigmoid(gate logit), which saves the shared expert's three GEMV launches and the gating's three
    elementwise ones per layer. The old names stay as views of the stacks (prefill and the reference
    path use them); layers whose shapes differ, or whose shared expert is quantised, stay apart, and so
    do layers the decode kernels could not take with one expert more (top_k + 1 > 32 slots, more than
    512 router columns, or the experts kernel's shared memory)."""
    for name in [n for n in weights if n.endswith("mlp.shared_expert_gate.weight")]:
        q = name[: -len("shared_expert_gate.weight")]
        if q + SHARED_FOLD[0] in weights:
            continue
        sg, router = weights[name], weights.get(q + "gate.weight")
        gu, dn = weights.get(q + "experts.gate_up_proj"), weights.get(q + "experts.down_proj")
        sgu, sdn = weights.get(q + "shared_expert.gate_up_proj.weight"), weights.get(q + "shared_expert.down_proj.weight")
        ts = (sg, router, gu, dn, sgu, sdn)
        if any(not isinstance(t, Tensor) or t.dtype != torch.bfloat16 for t in ts):
            continue
        if gu.dim() != 3 or dn.dim() != 3 or sgu.shape != gu.shape[1:] or sdn.shape != dn.shape[1:]:
            continue
        if router.dim() != 2 or sg.shape != (1, router.shape[1]):
            continue
        X, I = gu.shape[0], gu.shape[1] // 2
        A = top_k + 1
        if X + 1 > cm.ROUTE_MAX_X or A > cm.ROUTE_MAX_K or A * I * 2 + A * 8 > cm.SMEM_LIMIT:
            continue
        try:                                        # a second copy of one layer's experts, for a moment
            stack_gu = torch.cat([gu, sgu[None]], 0)
            stack_dn = torch.cat([dn, sdn[None]], 0)
        except torch.OutOfMemoryError:
            stack_gu = stack_dn = None
            torch.cuda.empty_cache()
            log.warning("%s: no memory to fold the shared expert into the experts; it stays apart", q)
            continue
        weights[q + "experts.gate_up_proj"] = stack_gu[:X]
        weights[q + "shared_expert.gate_up_proj.weight"] = stack_gu[X]
        if q + "shared_expert.gate_proj.weight" in weights:
            weights[q + "shared_expert.gate_proj.weight"] = stack_gu[X, :I]
            weights[q + "shared_expert.up_proj.weight"] = stack_gu[X, I:]
        weights[q + "experts.down_proj"] = stack_dn[:X]
        weights[q + "shared_expert.down_proj.weight"] = stack_dn[X]
        gates = torch.cat([router, sg], 0)
        weights[q + "gate.weight"] = gates[:X]
        weights[q + "shared_expert_gate.weight"] = gates[X:]
        weights[q + SHARED_FOLD[0]] = gates
        weights[q + SHARED_FOLD[1]] = stack_gu
        weights[q + SHARED_FOLD[2]] = stack_dn
        del ts, sg, router, gu, dn, sgu, sdn       # the old tensors, before empty_cache returns their memory
    torch.cuda.empty_cache()


# Linears that read the same input, concatenated at load into one weight (one GEMV launch per step
# instead of one per part; kernels/cuda_linear.linear_split writes each part to its own output): the
# fused name and its parts (suffixes), and whether quantisation on load converts it.
FUSED_PROJECTIONS = (
    ("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), True),
    ("linear_attn.in_proj_qkvz.weight", ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"), True),
    ("linear_attn.in_proj_ab.weight", ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"), False),
)


# bf16 models: the GDN layer's four input projections as one weight (qkv | z | a | b), one GEMV launch
# per layer instead of two; quantised formats keep qkv|z quantised and a|b in bf16, so two groups.
GDN_INPUTS_FUSED = "in_proj_qkvzab.weight"
GDN_INPUTS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight")
# TANDEM_GDN_INPUTS_FUSED=0 runs the two-group launches on the same weights (read per step, so at
# graph capture too: decode.py --variant compares both in one process)
GDN_FUSE_ENV = "TANDEM_GDN_INPUTS_FUSED"


def _fuse_gdn_inputs(weights: dict[str, Tensor | QuantWeight]) -> None:
    """After _fuse_projections, for bf16 models: concatenate each GDN layer's qkv|z and a|b weights into
    one [sum O, I] weight (`linear_attn.in_proj_qkvzab.weight`); the two groups and their four parts
    become row views of it (the old storages are freed layer by layer). Layers whose four parts are not
    all 2-D 16-bit tensors of one dtype, device and width stay as they are. Idempotent."""
    for name in [n for n in weights if n.endswith("linear_attn." + GDN_INPUTS[0])]:
        base = name[: -len(GDN_INPUTS[0])]
        if base + GDN_INPUTS_FUSED in weights:
            continue
        ts = [weights.get(base + p) for p in GDN_INPUTS]
        if any(not isinstance(t, Tensor) or t.dim() != 2 for t in ts):
            continue
        if len({(t.dtype, t.device, t.shape[1]) for t in ts}) != 1:
            continue
        cat = torch.cat(ts, dim=0)
        sizes = [t.shape[0] for t in ts]
        del ts
        weights[base + GDN_INPUTS_FUSED] = cat
        a = 0
        for p, n in zip(GDN_INPUTS, sizes):
            weights[base + p] = cat[a:a + n]
            a += n
        for group, parts in (("in_proj_qkvz.weight", GDN_INPUTS[:2]), ("in_proj_ab.weight", GDN_INPUTS[2:])):
            if base + group in weights:
                lo = 0 if group.startswith("in_proj_qkvz") else sizes[0] + sizes[1]
                weights[base + group] = cat[lo:lo + sum(weights[base + q].shape[0] for q in parts)]


def _out_features(t) -> int:
    return t.out_features if isinstance(t, QuantWeight) else t.shape[0]


def _fuse_projections(weights: dict[str, Tensor | QuantWeight]) -> None:
    """Concatenate each FUSED_PROJECTIONS group of 16-bit weights into one [sum O, I] weight; the parts
    stay as views of it. A pre-quantised checkpoint's groups are joined where that is exact
    (kernels.quant.cat_rows: one kind, fp8 parts on 128-row tiles, nvfp4 parts under one global
    scale), their parts then row slices of it; other groups with a quantised part stay apart."""
    for fused, parts, _ in FUSED_PROJECTIONS:
        for name in [n for n in weights if n.endswith(parts[0])]:
            base = name[: -len(parts[0])]
            ts = [weights.get(base + p) for p in parts]
            if base + fused in weights:
                continue
            if all(isinstance(t, QuantWeight) for t in ts):
                q = cat_rows(ts)
                if q is not None:
                    weights[base + fused] = q
                    a = 0
                    for p, t in zip(parts, ts):
                        weights[base + p] = cl.weight_rows(q, a, a + t.out_features)
                        a += t.out_features
                continue
            if any(not isinstance(t, Tensor) or t.dim() != 2 for t in ts):
                continue
            if len({(t.dtype, t.device, t.shape[1]) for t in ts}) != 1:
                continue
            cat = torch.cat(ts, dim=0)
            del ts
            weights[base + fused] = cat
            a = 0
            for p in parts:
                n = weights[base + p].shape[0]
                weights[base + p] = cat[a:a + n]
                a += n


def _quantise_fused(weights: dict[str, Tensor | QuantWeight], fmt: str, fn) -> None:
    """Quantise the fused projections as one weight (one nvfp4 global scale for the group) and make
    their parts row slices of it; for fp8-block, a group whose part boundaries are not multiples of 128
    rows (its scale tiles would straddle two parts) is quantised part by part and unfused."""
    for fused, parts, quantised in FUSED_PROJECTIONS:
        if not quantised:
            continue
        for name in [n for n in weights if n.endswith(fused) and isinstance(weights[n], Tensor)]:
            base = name[: -len(fused)]
            sizes = [_out_features(weights[base + p]) for p in parts]
            bounds = [sum(sizes[:i]) for i in range(1, len(sizes))]
            if fmt == "fp8-block" and any(b % 128 for b in bounds):
                for p in parts:
                    weights[base + p] = fn(weights[base + p].contiguous())
                del weights[name]
                continue
            q = fn(weights[name])
            weights[name] = q
            a = 0
            for p, n in zip(parts, sizes):
                weights[base + p] = cl.weight_rows(q, a, a + n)
                a += n


def quantise_weights(weights: dict[str, Tensor | QuantWeight], fmt: str) -> None:
    """Replace the QUANTISED linear weights by `fmt` (fp8 per-row, fp8-block 128x128, nvfp4) in place."""
    fn = {"fp8": quantize_fp8_rows, "fp8-block": quantize_fp8_blocks, "nvfp4": quantize_nvfp4}[fmt]
    _quantise_fused(weights, fmt, fn)
    for name in sorted(weights):
        if name.endswith(QUANTISED) and isinstance(weights[name], Tensor):
            weights[name] = fn(weights[name])
            if name.endswith("gate_up_proj.weight"):     # the views would keep the 16-bit copy alive
                base = name[: -len("gate_up_proj.weight")]
                weights.pop(base + "gate_proj.weight", None)
                weights.pop(base + "up_proj.weight", None)
    torch.cuda.empty_cache()


def weight_bytes(weights: dict[str, Tensor | QuantWeight]) -> int:
    """Bytes of the weights, each once: views of a 16-bit weight count with its storage; quantised
    weights sharing a storage (a fused weight and its parts' row slices) count as the one that covers
    the others, else each."""
    seen, groups, total = set(), {}, 0
    for name, t in weights.items():
        if isinstance(t, QuantWeight):
            g = groups.setdefault(t.data.untyped_storage().data_ptr(), {})
            g[(t.data.data_ptr(), t.data.numel())] = t
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    for g in groups.values():
        items = list(g.values())
        big = max(items, key=lambda q: q.data.numel())
        lo, hi = big.data.data_ptr(), big.data.data_ptr() + big.data.numel()
        if all(lo <= q.data.data_ptr() and q.data.data_ptr() + q.data.numel() <= hi for q in items):
            total += big.nbytes()
        else:
            total += sum(q.nbytes() for q in items)
    return total


def _ptr(t: Tensor | QuantWeight) -> int:
    return (t.data if isinstance(t, QuantWeight) else t).data_ptr()


def step_byte_parts(model, spec: ModelSpec, kv_dtype: str = "bf16") -> dict[str, int]:
    """What one decode step of this model (or tp shard) reads, in parts that the concurrency C and the
    context scale (step_bytes_from): `fixed` every weight read once per step whatever C (the MTP layer
    and the embedding table excluded; a tied table counts whole, as the head reads it), `embed_row`
    per sequence (one embedding row gathered), `experts` the routed expert stacks of all layers, of
    which a step reads the share min(X, C * top_k) / X, `kv_token` K and V of one cached token over
    the full-attention layers (bf16, or int8 codes with a float32 scale per 64 channels), and
    `gdn_seq` one sequence's GDN state, read and written. Works on real tensors (weight_bytes counts
    shared storages once)."""
    w = model.w
    emb = w["embed_tokens.weight"]
    fixed = weight_bytes({k: v for k, v in w.items() if not k.startswith("mtp.")}) - nbytes(emb)
    if _ptr(model.head) == _ptr(emb):                    # a tied table is read whole as the head
        fixed += nbytes(emb)
    experts, X, A = 0, 0, 0
    if spec.is_moe:                                      # the stacks (with the shared expert folded in,
        X, A = spec.num_experts, spec.num_experts_per_tok    # its slice stays in `fixed`: always read)
        for i in range(spec.num_layers):
            for n in ("experts.gate_up_proj", "experts.down_proj"):
                t = w.get(f"layers.{i}.mlp.{n}")
                experts += nbytes(t) if t is not None else 0
        fixed -= experts
    n_attn = sum(1 for k in spec.layer_types if k == FULL_ATTENTION)
    n_gdn = spec.num_layers - n_attn
    per = spec.head_dim * (1 + 4 / 64 if kv_dtype == "int8" else 2)
    return dict(fixed=int(fixed), embed_row=int(emb.shape[-1] * emb.element_size()), experts=int(experts),
                num_experts=X, top_k=A, kv_token=int(round(n_attn * 2 * model.num_kv_heads * per)),
                gdn_seq=int(n_gdn * 2 * model.hv * spec.linear_key_head_dim * spec.linear_value_head_dim * 4))


def step_bytes_from(parts: dict[str, int], C: int, context: int) -> dict[str, int]:
    """Bytes one decode step of C sequences at `context` cached tokens each reads (step_byte_parts):
    weights, kv (the new token's included), gdn_state, total."""
    wb = parts["fixed"] + C * parts["embed_row"]
    if parts["num_experts"]:
        X = parts["num_experts"]
        wb += parts["experts"] * min(X, C * parts["top_k"]) // X
    kv = C * (context + 1) * parts["kv_token"]
    gdn = C * parts["gdn_seq"]
    return dict(weights=wb, kv=kv, gdn_state=gdn, total=wb + kv + gdn)
