#!/usr/bin/env python
"""Train the embedded demo model (a small Qwen3.5-architecture hybrid with its MTP layer) and export it.

The model is the Qwen3.5 layer program scaled down (preset "demo": hidden 384, 8 layers in the 3:1
Gated DeltaNet : gated attention pattern, 6 attention heads / 2 KV heads of dim 64 with partial
rotary 0.25, GDN 2 key heads : 6 value heads of dim 64, SwiGLU 1024, tied 8192-token embedding, one
MTP layer; ~19 M parameters, ~38 MB in bf16). The forward is built from kernels/reference.py ops
over whole training sequences: the chunked gated delta rule with batch folded into the head axis,
causal scaled-dot-product attention with q/k norm, partial RoPE and the sigmoid output gate exactly
as ranks/model.py, and the MTP layer trained jointly (input at position i: embedding of token i+1
and the main final-norm hidden h_i; target token i+2; shared lm_head).

Training: AdamW, linear warmup then cosine decay, gradient clipping, bf16 autocast on CUDA,
seeded data order. Every run stops cleanly before --time-budget-s (measured from process start),
saves its full state (model, optimizer, step, data-sampler and torch RNG states) to
WORK/train_state.pt, evaluates on the held-out split and exports the checkpoint in the official
Hugging Face Qwen3.5 layout (multimodal wrapper config, ``model.language_model.`` prefix, mtp.*,
bf16 shards of at most --max-shard-mb) plus the tokenizer, generation_config.json, metrics.json and
a README. The LR schedule length is fitted to the time budget after a few measured steps
(--runs N stretches it over N runs joined with --resume).

    python scripts/train_demo.py --smoke --data /tmp/d --work-dir /tmp/w        # CPU, seconds
    python scripts/train_demo.py --data .demo-data --work-dir .demo-work --pack-out "$OUT"   # H200

--pack-out DIR additionally writes the export as a tar split into <= 15 MiB parts
(demo_model.tar.000, ...) plus train.log and metrics.json, for transports that limit file sizes.
Install with ``cat DIR/demo_model.tar.* | tar -x -C ranks/`` (creates ranks/demo_model/).
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels import reference as ops  # noqa: E402
from ranks.weights import INDEX_FILE, expected_shapes, write_checkpoint  # noqa: E402
from runtime.config import FULL_ATTENTION, ModelSpec, spec_from_hf  # noqa: E402

Tensor = torch.Tensor
ENDOFTEXT, IM_END = "<|endoftext|>", "<|im_end|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
STATE_FILE = "train_state.pt"

# --------------------------------------------------------------------------------------------------
# Model configuration

PRESETS: dict[str, dict] = {
    # ~19 M parameters (text 16.9 M incl. the tied 8192 x 384 embedding, MTP 2.0 M): 38 MB in bf16
    "demo": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                 linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=64,
                 linear_value_head_dim=64, intermediate_size=1024, mrope_section=[3, 3, 2]),
    # CPU smoke / tests: seconds per step
    "smoke": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, intermediate_size=128, mrope_section=[2, 1, 1]),
}


def text_config(preset: str, vocab_size: int, eot_id: int, *, tie: bool = True, rope_theta: float = 1e7,
                max_position_embeddings: int = 8192) -> dict:
    """The ``text_config`` (HF key names, as in the released Qwen3.5 checkpoints) of a preset."""
    p = dict(PRESETS[preset])
    section = p.pop("mrope_section")
    L = p["num_hidden_layers"]
    rotary = int(p["head_dim"] * 0.25)
    assert 2 * sum(section) == rotary, "mrope_section must sum to rotary_dim / 2"
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        **p,
        "layer_types": [FULL_ATTENTION if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)],
        "full_attention_interval": 4,
        "attn_output_gate": True,
        "output_gate_type": "swish",
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.25,
                            "mrope_section": section, "mrope_interleaved": True},
        "tie_word_embeddings": tie,
        "initializer_range": 0.02,
        "use_cache": True,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": eot_id,
        "dtype": "bfloat16",
    }


def wrapper_config(text: dict) -> dict:
    """config.json of the official multimodal layout around `text` (vision tower described, not shipped)."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32,
                          "hidden_act": "gelu_pytorch_tanh",
                          "intermediate_size": 64, "num_heads": 2, "in_channels": 3, "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                          "out_hidden_size": text["hidden_size"], "initializer_range": 0.02},
        "tie_word_embeddings": text["tie_word_embeddings"],
        "dtype": "bfloat16",
    }


def param_counts(spec: ModelSpec) -> dict[str, int]:
    text = mtp = 0
    for name, shape in expected_shapes(spec, include_mtp=True).items():
        if name.startswith("mtp."):
            mtp += math.prod(shape)
        else:
            text += math.prod(shape)
    return {"text": text, "mtp": mtp, "total": text + mtp}


# --------------------------------------------------------------------------------------------------
# The model: parameters by canonical name, a differentiable full-sequence forward


def _key(name: str) -> str:
    return name.replace(".", "__")


_OUT_PROJ = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")


class DemoModel(nn.Module):
    """The hybrid model + MTP layer for training; parameters under ranks.weights canonical names."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.is_moe:
            raise ValueError("the demo trainer builds dense models only")
        self.spec = spec
        self.shapes = expected_shapes(spec, include_mtp=True)
        self.names = list(self.shapes)
        self.params = nn.ParameterDict({_key(n): nn.Parameter(torch.empty(s)) for n, s in self.shapes.items()})

    def w(self, name: str) -> Tensor:
        return self.params[_key(name)]

    @property
    def head(self) -> Tensor:
        return self.w("embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight")

    # ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """HF-style initialisation: linear and embedding N(0, std) (output projections scaled by
        1/sqrt(2 * layers)), zero-centred norms 0, gated norm 1, dt_bias 1, A_log = log U(1, 16),
        conv1d U(+-1/sqrt(K)) (torch's default for a depthwise conv)."""
        gen = torch.Generator().manual_seed(seed)
        s = self.spec
        out_std = std / math.sqrt(2 * (s.num_layers + s.mtp_num_layers))
        for name in self.names:
            p = self.w(name)
            if name.endswith("linear_attn.norm.weight"):
                v = torch.ones(p.shape)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                v = torch.zeros(p.shape)
            elif name.endswith("dt_bias"):
                v = torch.ones(p.shape)
            elif name.endswith("A_log"):
                v = torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("conv1d.weight"):
                bound = 1.0 / math.sqrt(s.conv_kernel)
                v = torch.empty(p.shape).uniform_(-bound, bound, generator=gen)
            elif name.endswith(_OUT_PROJ):
                v = torch.randn(p.shape, generator=gen) * out_std
            else:
                v = torch.randn(p.shape, generator=gen) * std
            p.copy_(v.to(p.dtype))

    def canonical_state(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        out = {}
        for n in self.names:
            t = self.w(n).detach().cpu()
            out[n] = t.to(dtype) if dtype is not None else t.clone()
        return out

    @torch.no_grad()
    def load_canonical(self, tensors: dict[str, Tensor]) -> None:
        missing = [n for n in self.names if n not in tensors]
        if missing:
            raise KeyError(f"missing tensors: {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        for n in self.names:
            self.w(n).copy_(tensors[n].to(self.w(n).dtype))

    # ---------------------------------------------------------------------------------------------
    # Forward ([B, T, ...] tensors). The layers run through module-level functions that take their
    # weights as arguments, so that with compile_layers() one compiled graph serves every layer of a
    # kind (GDN; attention, including the MTP layer's) and the loss head.

    def compile_layers(self) -> None:
        self.compiled = {name: torch.compile(fn) for name, fn in _LAYER_FNS.items()}

    def _fn(self, name: str):
        compiled = getattr(self, "compiled", None)
        return compiled[name] if compiled and self.training else _LAYER_FNS[name]

    def _attention_layer(self, p: str, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        s, w = self.spec, self.w
        a = p + "self_attn."
        return self._fn("attention")(
            x, cos, sin, w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight"),
            w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight"), w(a + "o_proj.weight"),
            w(a + "q_norm.weight"), w(a + "k_norm.weight"),
            w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"), w(p + "mlp.down_proj.weight"),
            s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps)

    def _gdn_layer(self, p: str, x: Tensor) -> Tensor:
        s, w = self.spec, self.w
        a = p + "linear_attn."
        return self._fn("gdn")(
            x, w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight"),
            w(a + "in_proj_qkv.weight"), w(a + "in_proj_z.weight"), w(a + "in_proj_a.weight"),
            w(a + "in_proj_b.weight"), w(a + "conv1d.weight"), w(a + "A_log"), w(a + "dt_bias"),
            w(a + "norm.weight"), w(a + "out_proj.weight"),
            w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"), w(p + "mlp.down_proj.weight"),
            s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim,
            s.rms_norm_eps)

    def _rope(self, T: int, device) -> tuple[Tensor, Tensor]:
        s = self.spec
        return ops.rope_cos_sin(torch.arange(T, device=device), s.rotary_dim, s.rope_theta, torch.float32)

    def trunk(self, ids: Tensor) -> Tensor:
        """Final-norm hidden states [B, T, E] of the main model for token ids [B, T] (positions 0..T-1)."""
        s = self.spec
        cos, sin = self._rope(ids.shape[1], ids.device)
        x = F.embedding(ids, self.w("embed_tokens.weight"))
        for i, kind in enumerate(s.layer_types):
            p = f"layers.{i}."
            x = self._attention_layer(p, x, cos, sin) if kind == FULL_ATTENTION else self._gdn_layer(p, x)
        return ops.rms_norm(x, self.w("norm.weight"), s.rms_norm_eps)

    def mtp(self, next_ids: Tensor, hidden: Tensor) -> Tensor:
        """The MTP output m [B, T, E] (post mtp.norm): column i takes token i+1's id and h_i."""
        s = self.spec
        cos, sin = self._rope(next_ids.shape[1], next_ids.device)
        e = F.embedding(next_ids, self.w("embed_tokens.weight"))
        x = ops.mtp_fuse(e, hidden, self.w("mtp.pre_fc_norm_embedding.weight"),
                         self.w("mtp.pre_fc_norm_hidden.weight"), self.w("mtp.fc.weight"), s.rms_norm_eps)
        x = self._attention_layer("mtp.layers.0.", x, cos, sin)
        return ops.rms_norm(x, self.w("mtp.norm.weight"), s.rms_norm_eps)

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(h, self.head)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [B, T+2] -> (main logits [B, T, V] predicting tokens 1..T, MTP logits [B, T, V]
        predicting tokens 2..T+1, main hidden [B, T, E])."""
        h = self.trunk(tokens[:, :-2])
        m = self.mtp(tokens[:, 1:-1], h)
        return self.logits(h), self.logits(m), h

    def losses(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(main loss, MTP loss): mean cross-entropy of tokens 1..T and of tokens 2..T+1."""
        h = self.trunk(tokens[:, :-2])
        m = self.mtp(tokens[:, 1:-1], h)
        ce = self._fn("ce")
        return ce(h, self.head, tokens[:, 1:-1]), ce(m, self.head, tokens[:, 2:])


def attention_mixer(h: Tensor, cos: Tensor, sin: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor,
                    wqn: Tensor, wkn: Tensor, H: int, KV: int, D: int, eps: float) -> Tensor:
    """Gated attention as ranks/model.py, causal over the whole sequence (SDPA)."""
    B, T, _ = h.shape
    qg = F.linear(h, wq).view(B, T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(B, T, H * D)                    # per head [q | gate]
    k = F.linear(h, wk).view(B, T, KV, D)
    v = F.linear(h, wv).view(B, T, KV, D)
    q = ops.apply_partial_rope(ops.rms_norm(q, wqn, eps), cos.to(q.dtype), sin.to(q.dtype))
    k = ops.apply_partial_rope(ops.rms_norm(k, wkn, eps), cos.to(k.dtype), sin.to(k.dtype))
    qh = q.transpose(1, 2)                                                       # [B, H, T, D]
    kh = k.transpose(1, 2).repeat_interleave(H // KV, dim=1).to(qh.dtype)
    vh = v.transpose(1, 2).repeat_interleave(H // KV, dim=1).to(qh.dtype)
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=D ** -0.5)
    o = o.transpose(1, 2).reshape(B, T, H * D) * torch.sigmoid(gate)
    return F.linear(o, wo)


def gdn_mixer(h: Tensor, w_qkv: Tensor, w_z: Tensor, w_a: Tensor, w_b: Tensor, conv_w: Tensor, A_log: Tensor,
              dt_bias: Tensor, norm_w: Tensor, w_out: Tensor, HK: int, HV: int, DK: int, DV: int,
              eps: float) -> Tensor:
    """Gated DeltaNet as ranks/model.py, from a zero state, chunked delta rule over the whole sequence."""
    B, T, _ = h.shape
    qkv = F.linear(h, w_qkv)                                                     # [B, T, C] = [q | k | v]
    z = F.linear(h, w_z).view(B, T, HV, DV)
    a = F.linear(h, w_a)
    b = F.linear(h, w_b)
    C, K = conv_w.shape[0], conv_w.shape[-1]
    # causal depthwise conv + SiLU: the batched form of ops.causal_conv1d from a zero state
    y = F.conv1d(F.pad(qkv.transpose(1, 2), (K - 1, 0)), conv_w.to(qkv.dtype), groups=C)
    y = F.silu(y).transpose(1, 2)
    q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
    with torch.autocast(device_type=h.device.type, enabled=False):               # the recurrence in fp32
        g, beta = ops.gdn_gates(a.float(), b.float(), A_log, dt_bias)          # [B, T, HV]

        def seq_major(x: Tensor, heads: int, dim: int) -> Tensor:               # [B,T,heads*dim] -> [T,B*heads,dim]
            return x.float().reshape(B, T, heads, dim).transpose(0, 1).reshape(T, B * heads, dim)

        # batch folded into the head axis: value head (b, h) reads key head (b, h // ratio)
        qf, kf = ops.gdn_prepare_qk(seq_major(q, HK, DK), seq_major(k, HK, DK), HV // HK)
        o, _ = ops.gated_delta_rule_chunked(qf, kf, seq_major(v, HV, DV), g.transpose(0, 1).reshape(T, B * HV),
                                            beta.transpose(0, 1).reshape(T, B * HV), None)
        o = o.view(T, B, HV, DV).transpose(0, 1)                                # [B, T, HV, DV]
    o = ops.gated_rms_norm(o.to(z.dtype), z, norm_w, eps)
    return F.linear(o.reshape(B, T, HV * DV), w_out)


def attention_layer(x, cos, sin, ln_in, ln_post, wq, wk, wv, wo, wqn, wkn, w_gate, w_up, w_down, H, KV, D, eps):
    x = x + attention_mixer(ops.rms_norm(x, ln_in, eps), cos, sin, wq, wk, wv, wo, wqn, wkn, H, KV, D, eps)
    return x + ops.swiglu_mlp(ops.rms_norm(x, ln_post, eps), w_gate, w_up, w_down)


def gdn_layer(x, ln_in, ln_post, w_qkv, w_z, w_a, w_b, conv_w, A_log, dt_bias, norm_w, w_out, w_gate, w_up,
              w_down, HK, HV, DK, DV, eps):
    x = x + gdn_mixer(ops.rms_norm(x, ln_in, eps), w_qkv, w_z, w_a, w_b, conv_w, A_log, dt_bias, norm_w, w_out,
                      HK, HV, DK, DV, eps)
    return x + ops.swiglu_mlp(ops.rms_norm(x, ln_post, eps), w_gate, w_up, w_down)


def ce_loss(h: Tensor, head: Tensor, targets: Tensor) -> Tensor:
    logits = F.linear(h, head)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


_LAYER_FNS = {"attention": attention_layer, "gdn": gdn_layer, "ce": ce_loss}


# --------------------------------------------------------------------------------------------------
# Data


class Corpus:
    """The token arrays written by scripts/demo/build_corpus.py."""

    def __init__(self, data_dir: str):
        self.dir = data_dir
        with open(os.path.join(data_dir, "manifest.json"), encoding="utf-8") as f:
            self.manifest = json.load(f)
        self.train = np.load(os.path.join(data_dir, "train.npy"))
        self.train_docs = np.load(os.path.join(data_dir, "train_docs.npy"))
        self.heldout = np.load(os.path.join(data_dir, "heldout.npy"))
        self.heldout_docs = np.load(os.path.join(data_dir, "heldout_docs.npy"))
        self.heldout_kinds = np.load(os.path.join(data_dir, "heldout_kinds.npy"))
        tok = self.manifest["tokenizer"]
        self.vocab_size = int(tok["vocab_size"])
        self.ids = {k: int(v) for k, v in tok["added_tokens"].items()}
        self.kinds = self.manifest["kinds"]

    def heldout_token_kinds(self) -> np.ndarray:
        ends = np.append(self.heldout_docs[1:], len(self.heldout))
        return np.repeat(self.heldout_kinds, ends - self.heldout_docs)


class Sampler:
    """Random training windows of seq_len + 2 tokens: a fraction start at a document boundary (so
    chats are seen from their first token, as at inference), the rest anywhere."""

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, seed: int, aligned_frac: float):
        self.tokens, self.n = tokens, seq_len + 2
        if len(tokens) < self.n + 1:
            raise SystemExit(f"the training split has {len(tokens)} tokens; --seq-len {seq_len} needs more")
        self.max_start = len(tokens) - self.n
        self.doc_starts = doc_starts[doc_starts <= self.max_start]
        self.aligned_frac = aligned_frac
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def batch(self, B: int) -> torch.Tensor:
        starts = self.rng.integers(0, self.max_start + 1, B)
        aligned = self.rng.random(B) < self.aligned_frac
        if aligned.any() and len(self.doc_starts):
            starts[aligned] = self.rng.choice(self.doc_starts, int(aligned.sum()))
        idx = starts[:, None] + np.arange(self.n)[None, :]
        return torch.from_numpy(self.tokens[idx].astype(np.int64))

    def state(self) -> dict:
        return self.rng.bit_generator.state

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state


# --------------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model: DemoModel, corpus: Corpus, seq_len: int, batch: int, max_tokens: int, device: torch.device,
             amp: bool) -> dict:
    """Held-out metrics over windows spread evenly through the split: main loss / perplexity / top-1,
    and the MTP head's loss, top-1 accuracy (argmax at i == token i+2), that accuracy given the main
    model's argmax at i is right, and the greedy acceptance of a 1-token draft (MTP argmax at i == main
    argmax at i+1, given the main argmax at i is right), overall and per kind of text."""
    toks = corpus.heldout
    kinds = corpus.heldout_token_kinds()
    T = min(seq_len, len(toks) - 2)
    if T < 2:
        return {"error": "held-out split too small"}
    starts = list(range(0, len(toks) - (T + 2) + 1, T))
    want = max(1, max_tokens // T)
    if len(starts) > want:                      # spread over the whole split (it is ordered by source)
        starts = [starts[i] for i in np.linspace(0, len(starts) - 1, want).round().astype(int)]
    acc = {k: np.zeros(8) for k in ["all"] + list(corpus.kinds)}
    # columns: tokens, main nll, main correct, mtp nll, mtp correct, main-correct count,
    #          mtp correct & main correct, greedy accept & main correct (positions < T-1 only) + count
    accept_n = {k: 0.0 for k in acc}
    model.eval()
    for i in range(0, len(starts), batch):
        st = starts[i:i + batch]
        idx = np.asarray(st)[:, None] + np.arange(T + 2)[None, :]
        tokens = torch.from_numpy(toks[idx].astype(np.int64)).to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            main, mtp, _ = model(tokens)
        main, mtp = main.float(), mtp.float()
        t1, t2 = tokens[:, 1:-1], tokens[:, 2:]
        nll_main = F.cross_entropy(main.transpose(1, 2), t1, reduction="none")       # [b, T]
        nll_mtp = F.cross_entropy(mtp.transpose(1, 2), t2, reduction="none")
        arg_main, arg_mtp = main.argmax(-1), mtp.argmax(-1)
        ok_main = arg_main == t1
        ok_mtp = arg_mtp == t2
        accept = torch.zeros_like(ok_main)
        accept[:, :-1] = arg_mtp[:, :-1] == arg_main[:, 1:]
        valid_accept = torch.zeros_like(ok_main)
        valid_accept[:, :-1] = True
        kind = torch.from_numpy(kinds[idx[:, 1:-1]].astype(np.int64)).to(device)   # kind of token i+1
        cols = [torch.ones_like(nll_main), nll_main, ok_main.float(), nll_mtp, ok_mtp.float(), ok_main.float(),
                (ok_mtp & ok_main).float(), (accept & ok_main).float()]
        for name in acc:
            mask = torch.ones_like(ok_main) if name == "all" else kind == corpus.kinds[name]
            acc[name] += np.array([float((c * mask).sum()) for c in cols])
            accept_n[name] += float((ok_main & valid_accept & mask).sum())
    model.train()

    def summary(a: np.ndarray, an: float) -> dict:
        n = a[0]
        if n == 0:
            return {"tokens": 0}
        return {"tokens": int(n), "loss": a[1] / n, "perplexity": math.exp(a[1] / n), "top1": a[2] / n,
                "mtp_loss": a[3] / n, "mtp_top1": a[4] / n,
                "mtp_top1_given_main_correct": a[6] / a[5] if a[5] else None,
                "mtp_greedy_acceptance": a[7] / an if an else None}

    out = {"window": T, "windows": len(starts), **summary(acc["all"], accept_n["all"])}
    out["by_kind"] = {k: summary(acc[k], accept_n[k]) for k in corpus.kinds if acc[k][0]}
    return out


# --------------------------------------------------------------------------------------------------
# Export


def export(model: DemoModel, text_cfg: dict, data_dir: str, out_dir: str, metrics: dict,
           max_shard_bytes: int) -> list[str]:
    """Write the model directory in the official Qwen3.5 layout (bf16) with tokenizer and metrics."""
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):                        # stale shards of an earlier export would shadow ours
        if f == INDEX_FILE or (f.startswith("model") and f.endswith(".safetensors")):
            os.remove(os.path.join(out_dir, f))
    tensors = model.canonical_state(torch.bfloat16)
    files = write_checkpoint(out_dir, tensors, prefix="model.language_model.", max_shard_bytes=max_shard_bytes)
    eot, im_end = text_cfg["eos_token_id"], None
    with open(os.path.join(data_dir, "manifest.json"), encoding="utf-8") as f:
        im_end = json.load(f)["tokenizer"]["added_tokens"][IM_END]
    _write_json(os.path.join(out_dir, "config.json"), wrapper_config(text_cfg))
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot,
        "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    for f in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(data_dir, f), os.path.join(out_dir, f))
    _write_json(os.path.join(out_dir, "metrics.json"), metrics)
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(text_cfg, metrics))
    for f in files:
        os.chmod(os.path.join(out_dir, f), 0o644)        # safetensors writes 0600
    return files + ["config.json", "generation_config.json", *TOKENIZER_FILES, "metrics.json", "README.md"]


def model_card(text_cfg: dict, metrics: dict) -> str:
    ev = metrics.get("eval", {})
    tr = metrics.get("train", {})
    srcs = metrics.get("data", {}).get("sources", {})
    lines = [
        "# tandem demo model",
        "",
        "A small Qwen3.5-architecture model (Gated DeltaNet + gated attention, 3:1, with one MTP layer) trained",
        "from scratch by `scripts/train_demo.py` on the corpus of `scripts/demo/build_corpus.py`. It exists to",
        "exercise the tandem runtime end to end (chat template, reasoning and tool-call parsing, MTP speculation);",
        "it knows little and is often wrong. See docs/demo-model.md in the tandem repository.",
        "",
        f"- parameters: {metrics.get('params', {}).get('total', 0) / 1e6:.1f} M "
        f"(MTP {metrics.get('params', {}).get('mtp', 0) / 1e6:.1f} M), bf16",
        f"- hidden {text_cfg['hidden_size']}, {text_cfg['num_hidden_layers']} layers, vocab {text_cfg['vocab_size']}",
        f"- trained {tr.get('steps', 0)} steps, {tr.get('tokens', 0) / 1e6:.1f} M tokens, "
        f"{tr.get('train_seconds', 0):.0f} s on {tr.get('device', '?')}",
    ]
    if "loss" in ev:
        lines.append(f"- held-out perplexity {ev['perplexity']:.2f}, MTP top-1 {ev['mtp_top1']:.3f}, "
                     f"greedy 1-token draft acceptance {ev['mtp_greedy_acceptance'] or 0:.3f}")
    lines += ["", "## Training data and licences", "",
              "`<stdlib>` is the CPython standard library directory (`sysconfig.get_paths()[\"stdlib\"]`); the",
              "`/usr/share/...` paths are Debian package documentation.", ""]
    for name, s in srcs.items():
        lines.append(f"- {name}: {s.get('origin', '')} ({s.get('licence', '')})")
    lines.append("")
    return "\n".join(lines)


def pack(export_dir: str, out: str, extra: list[str], part_bytes: int = 15 * 2**20) -> list[str]:
    """export_dir as demo_model.tar split into parts of <= part_bytes, plus loose copies of `extra`."""
    os.makedirs(out, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for f in sorted(os.listdir(export_dir)):
            info = tar.gettarinfo(os.path.join(export_dir, f), arcname=f"demo_model/{f}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(os.path.join(export_dir, f), "rb") as fh:
                tar.addfile(info, fh)
    data = buf.getvalue()
    written = []
    for i in range(0, max(1, len(data)), part_bytes):
        path = os.path.join(out, f"demo_model.tar.{i // part_bytes:03d}")
        with open(path, "wb") as f:
            f.write(data[i:i + part_bytes])
        written.append(path)
    for p in extra:
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(out, os.path.basename(p)))
            written.append(os.path.join(out, os.path.basename(p)))
    return written


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# --------------------------------------------------------------------------------------------------
# Training


class Logger:
    def __init__(self, path: str | None):
        self.f = open(path, "a", encoding="utf-8") if path else None

    def close(self) -> None:
        if self.f:
            self.f.close()
            self.f = None

    def __call__(self, msg: str) -> None:
        line = f"[{time.time() - T_START:7.1f}s] {msg}"
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")
            self.f.flush()


def lr_at(step: int, total: int | None, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    if not total:
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: DemoModel, args, fused: bool) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for n in model.names:
        (decay if model.w(n).ndim == 2 else no_decay).append(model.w(n))
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2), eps=1e-8, **kw)


def _fmt_time(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 60:d}:{s % 60:02d}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=".demo-data", help="corpus directory from build_corpus.py")
    ap.add_argument("--work-dir", default=".demo-work", help="train_state.pt, train.log (and the export)")
    ap.add_argument("--out-dir", default=None, help="export directory (default WORK/export)")
    ap.add_argument("--pack-out", default=None, help="also write <=15 MiB tar parts + log + metrics here")
    ap.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny preset, few short steps")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="loss weight of the MTP head")
    ap.add_argument("--aligned-frac", type=float, default=0.5, help="fraction of windows starting at a document")
    ap.add_argument("--no-tie", action="store_true", help="separate lm_head (default: tied to the embedding)")
    ap.add_argument("--rope-theta", type=float, default=1e7)
    ap.add_argument("--time-budget-s", type=float, default=480.0, help="wall-clock limit of this run (from start)")
    ap.add_argument("--reserve-s", type=float, default=25.0, help="kept for the final save, eval and export")
    ap.add_argument("--runs", type=int, default=1, help="runs (joined with --resume) the LR schedule spans")
    ap.add_argument("--total-steps", type=int, default=None, help="schedule length (default: fitted to time)")
    ap.add_argument("--max-steps", type=int, default=None, help="hard step limit (also the schedule length)")
    ap.add_argument("--resume", action="store_true", help="continue from WORK/train_state.pt if present")
    ap.add_argument("--init-from", default=None, help="start from the weights of an exported model directory")
    ap.add_argument("--ckpt-every-s", type=float, default=0.0, help="also save train_state.pt this often")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--eval-tokens", type=int, default=262144, help="held-out tokens for the final evaluation")
    ap.add_argument("--eval-every", type=int, default=500, help="quick held-out check every N steps (0: off)")
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--max-shard-mb", type=float, default=15.0, help="safetensors shard size limit (MiB)")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="torch.compile the layers (auto: on CUDA); ~2.7x faster steps after ~1-2 min")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--export-only", action="store_true", help="no training: evaluate and export WORK's state "
                    "(with --resume) or the --init-from weights")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
        if args.device == "auto":
            args.device = "cpu"
        args.seq_len = min(args.seq_len, 128)
        args.batch_size = min(args.batch_size, 4)
        args.max_steps = args.max_steps or 30
        args.warmup_steps = min(args.warmup_steps, 2)
        args.log_every = min(args.log_every, 5)
        args.eval_tokens = min(args.eval_tokens, 2048)
        args.lr = max(args.lr, 3e-3)
    return args


def load_exported(model_dir: str, dtype: torch.dtype = torch.float32) -> DemoModel:
    """A DemoModel holding the weights of an exported model directory (via ranks.weights)."""
    from ranks.weights import Checkpoint, load_weights
    from runtime.config import load_spec

    spec = load_spec(model_dir)
    model = DemoModel(spec).to(dtype)
    model.load_canonical(load_weights(Checkpoint(model_dir), spec, dtype=dtype))
    return model


def main(argv: list[str] | None = None) -> dict:
    global T_START
    if argv is not None:                    # called in-process (tests): the budget starts now
        T_START = time.time()
    args = parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    out_dir = args.out_dir or os.path.join(args.work_dir, "export")
    log_path = os.path.join(args.work_dir, "train.log")
    log = Logger(log_path)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_flush_denormal(True)       # decayed GDN terms underflow; denormals make CPU maths crawl
    torch.manual_seed(args.seed)

    corpus = Corpus(args.data)
    eot = corpus.ids[ENDOFTEXT]
    vocab = -(-corpus.vocab_size // 64) * 64                     # embedding rows: tokenizer ids rounded up
    text_cfg = text_config(args.preset, vocab, eot, tie=not args.no_tie, rope_theta=args.rope_theta)
    spec = spec_from_hf(text_cfg, source=f"<preset {args.preset}>")
    counts = param_counts(spec)
    model = DemoModel(spec)
    model.init_weights(args.seed)
    state_path = os.path.join(args.work_dir, STATE_FILE)
    resumed = args.resume and os.path.isfile(state_path)
    ckpt = None
    if resumed:
        ckpt = torch.load(state_path, map_location="cpu", weights_only=False)
        if ckpt["config"] != text_cfg:
            raise SystemExit(f"{state_path}: its model config differs from this run's (preset/vocab/flags)")
        model.load_canonical(ckpt["model"])
    elif args.init_from:
        init = load_exported(args.init_from)
        if init.spec.to_dict() != spec.to_dict():
            raise SystemExit(f"{args.init_from}: its config differs from this run's model")
        model.load_canonical(init.canonical_state())
        log(f"initialised from {args.init_from}")
    model.to(device)
    opt = make_optimizer(model, args, fused=cuda)
    sampler = Sampler(corpus.train, corpus.train_docs, args.seq_len, args.seed, args.aligned_frac)
    step, tokens_seen, train_seconds, history = 0, 0, 0.0, []
    total_steps = args.max_steps or args.total_steps
    if ckpt is not None:
        opt.load_state_dict(ckpt["optimizer"])
        sampler.set_state(ckpt["sampler"])
        torch.set_rng_state(ckpt["torch_rng"])
        if cuda and ckpt.get("cuda_rng") is not None:
            torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
        step, tokens_seen, train_seconds = ckpt["step"], ckpt["tokens_seen"], ckpt["train_seconds"]
        history = ckpt.get("history", [])
        total_steps = args.max_steps or args.total_steps or ckpt.get("total_steps")
        del ckpt

    log(f"device {device}{' (' + torch.cuda.get_device_name(device) + ')' if cuda else ''}, torch {torch.__version__}")
    log(f"model {args.preset}: hidden {spec.hidden_size}, {spec.num_layers} layers "
        f"({len(spec.linear_attention_layers)} GDN + {len(spec.full_attention_layers)} attention), vocab {vocab}, "
        f"{counts['total'] / 1e6:.2f} M parameters (text {counts['text'] / 1e6:.2f} M, "
        f"MTP {counts['mtp'] / 1e6:.2f} M), "
        f"{counts['total'] * 2 / 2**20:.1f} MiB in bf16")
    log(f"data {args.data}: {len(corpus.train):,} train tokens, {len(corpus.heldout):,} held-out; "
        f"batch {args.batch_size} x {args.seq_len} = {args.batch_size * args.seq_len:,} tokens/step")
    if args.resume and not resumed:
        log(f"--resume: no {state_path} here (a fresh machine?); starting from scratch")
    if resumed:
        log(f"resumed from {state_path} at step {step} ({tokens_seen / 1e6:.1f} M tokens, "
            f"{train_seconds:.0f} s trained, schedule {total_steps} steps)")

    use_compile = args.compile == "on" or (args.compile == "auto" and cuda)
    if use_compile:
        model.compile_layers()
        log("torch.compile: layers and loss head compiled on first use (about 1-2 min)")
    amp = cuda
    deadline = T_START + args.time_budget_s - args.reserve_s
    tok_per_step = args.batch_size * args.seq_len
    measure_at = (step + 5, step + 25)
    t_measure = None
    step_time = None
    last_ckpt = time.time()
    window_t, window_tokens = time.time(), 0
    run_start_step = step
    sums = torch.zeros(3, device=device)
    n_sum = 0
    stop_reason = "max steps" if total_steps and step >= total_steps else None
    if args.export_only:
        if not (resumed or args.init_from):
            raise SystemExit("--export-only needs --resume (with a saved state) or --init-from")
        stop_reason = "export only"
    model.train()

    def save_state() -> None:
        tmp = state_path + ".tmp"
        torch.save({"model": model.canonical_state(), "optimizer": opt.state_dict(), "sampler": sampler.state(),
                    "torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if cuda else None,
                    "step": step, "tokens_seen": tokens_seen, "train_seconds": train_seconds,
                    "total_steps": total_steps, "config": text_cfg, "args": vars(args), "history": history}, tmp)
        os.replace(tmp, state_path)

    t_loop = time.time()
    while stop_reason is None:
        now = time.time()
        if now + (step_time or 0.0) > deadline:
            stop_reason = "time budget"
            break
        if total_steps and step >= total_steps:
            stop_reason = "schedule complete"
            break
        lr = lr_at(step, total_steps, args.warmup_steps, args.lr, args.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sampler.batch(args.batch_size).to(device, non_blocking=True)
        first = step == run_start_step
        try:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                loss_main, loss_mtp = model.losses(batch)
                loss = loss_main + args.mtp_weight * loss_mtp
            loss.backward()
        except Exception as e:                       # a compiler failure must not cost the run: go eager
            if not (first and getattr(model, "compiled", None)):
                raise
            log(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); continuing eagerly")
            model.compiled = None
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                loss_main, loss_mtp = model.losses(batch)
                loss = loss_main + args.mtp_weight * loss_mtp
            loss.backward()
        if first:
            if cuda:
                torch.cuda.synchronize()
            what = "compilation and warm-up" if getattr(model, "compiled", None) else "warm-up"
            log(f"first step done ({time.time() - now:.1f} s incl. {what})")
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tok_per_step
        window_tokens += tok_per_step
        sums += torch.stack([loss_main.detach(), loss_mtp.detach(), gnorm.detach().float()])
        n_sum += 1

        if step in measure_at:                                   # fit the schedule to the time budget
            if cuda:
                torch.cuda.synchronize()
            if step == measure_at[0]:
                t_measure = time.time()
            else:
                step_time = (time.time() - t_measure) / (measure_at[1] - measure_at[0])
                if not total_steps:
                    fit = int((deadline - time.time()) / step_time * 0.95)   # evals, jitter
                    this_run = step - run_start_step + fit
                    total_steps = step + fit + (args.runs - 1) * this_run
                    log(f"step time {step_time * 1000:.0f} ms ({tok_per_step / step_time / 1e3:.0f} k tok/s): "
                        f"schedule set to {total_steps} steps ({args.runs} run{'s' if args.runs > 1 else ''})")
        if step % args.log_every == 0 or step == total_steps:
            vals = (sums / n_sum).tolist()
            now = time.time()
            rate = window_tokens / (now - window_t)
            eta = (total_steps - step) * (step_time or 0) if total_steps else 0
            rec = {"step": step, "loss": vals[0], "mtp_loss": vals[1], "grad_norm": vals[2], "lr": lr,
                   "tokens": tokens_seen, "tok_per_s": rate, "elapsed": now - T_START}
            history.append(rec)
            log(f"step {step:5d}/{total_steps or '?'} | loss {vals[0]:.4f} | mtp {vals[1]:.4f} | "
                f"lr {lr:.2e} | gnorm {vals[2]:.2f} | {rate / 1e3:6.1f} k tok/s | {tokens_seen / 1e6:7.1f} M tok | "
                f"run {_fmt_time(now - T_START)} left {_fmt_time(deadline - now)} | sched eta {_fmt_time(eta)}"
                + (f" | mem {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if cuda else ""))
            sums.zero_()
            n_sum = 0
            window_t, window_tokens = now, 0
        if args.eval_every and step % args.eval_every == 0 and step != total_steps:
            quick = evaluate(model, corpus, args.seq_len, args.eval_batch, 65536, device, amp)
            if "loss" in quick:
                if not history or history[-1]["step"] != step:
                    history.append({"step": step})
                history[-1].update(heldout_loss=quick["loss"], heldout_mtp_top1=quick["mtp_top1"])
                kinds = ", ".join(f"{k} {v['loss']:.3f}" for k, v in quick["by_kind"].items() if v.get("tokens"))
                log(f"held-out check at step {step}: loss {quick['loss']:.4f} ({kinds}), "
                    f"MTP top1 {quick['mtp_top1']:.3f}, acceptance {quick['mtp_greedy_acceptance'] or 0:.3f}")
            window_t = time.time()
        if args.ckpt_every_s and time.time() - last_ckpt > args.ckpt_every_s:
            save_state()
            last_ckpt = time.time()
    train_seconds += time.time() - t_loop
    if cuda:
        torch.cuda.synchronize()
    log(f"stopped at step {step} ({stop_reason}); this run {step - run_start_step} steps, "
        f"{(step - run_start_step) * tok_per_step / 1e6:.1f} M tokens in {time.time() - t_loop:.0f} s")
    save_state()
    log(f"saved {state_path}")

    t_eval = time.time()
    ev = evaluate(model, corpus, args.seq_len, args.eval_batch, args.eval_tokens, device, amp)
    if "loss" in ev:
        log(f"held-out ({ev['tokens']:,} tokens, {time.time() - t_eval:.1f}s): loss {ev['loss']:.4f}, "
            f"ppl {ev['perplexity']:.2f}, top1 {ev['top1']:.3f} | MTP loss {ev['mtp_loss']:.4f}, "
            f"top1 {ev['mtp_top1']:.3f}, given main right {ev['mtp_top1_given_main_correct'] or 0:.3f}, "
            f"greedy acceptance {ev['mtp_greedy_acceptance'] or 0:.3f}")
        for k, v in ev["by_kind"].items():
            if v.get("tokens"):
                log(f"  {k:5s}: ppl {v['perplexity']:8.2f}  top1 {v['top1']:.3f}  MTP top1 {v['mtp_top1']:.3f}  "
                    f"acceptance {v['mtp_greedy_acceptance'] or 0:.3f}  ({v['tokens']:,} tokens)")
    recent = history[-5:]
    metrics = {
        "eval": ev,
        "train": {"steps": step, "total_steps": total_steps, "tokens": tokens_seen, "train_seconds": train_seconds,
                  "stop_reason": stop_reason,
                  "final_loss": float(np.mean([r["loss"] for r in recent])) if recent else None,
                  "final_mtp_loss": float(np.mean([r["mtp_loss"] for r in recent])) if recent else None,
                  "tok_per_s": (step - run_start_step) * tok_per_step / max(1e-9, time.time() - t_loop),
                  "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                  "history": history},
        "hyperparameters": {k: v for k, v in vars(args).items()
                            if k not in ("data", "work_dir", "out_dir", "pack_out")},
        "params": counts,
        "config": text_cfg,
        "data": {"dir": os.path.basename(os.path.normpath(args.data)), "train_tokens": int(len(corpus.train)),
                 "heldout_tokens": int(len(corpus.heldout)), "sources": corpus.manifest.get("sources", {}),
                 "train_sha256": corpus.manifest["splits"]["train"]["sha256"]},
    }
    metrics_path = os.path.join(args.work_dir, "metrics.json")
    _write_json(metrics_path, metrics)
    if not args.no_export:
        files = export(model, text_cfg, args.data, out_dir, metrics, int(args.max_shard_mb * 2**20))
        size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
        log(f"exported {out_dir}: {len(files)} files, {size / 2**20:.1f} MiB")
        if args.pack_out:
            log(f"packing to {args.pack_out}")
            written = pack(out_dir, args.pack_out, [metrics_path])
            log(f"packed {len(written)} files: " + ", ".join(os.path.basename(w) for w in written))
    log(f"done in {time.time() - T_START:.0f} s")
    log.close()
    if args.pack_out:
        shutil.copyfile(log_path, os.path.join(args.pack_out, "train.log"))
    return metrics


if __name__ == "__main__":
    main()
