"""Test helpers: tiny specs and randomised weights (spec section 6.1), built without transformers."""

from __future__ import annotations

import json
import os

import torch

from ranks.weights import expected_shapes
from runtime.config import ModelSpec, spec_from_hf

ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True}


def tiny_config(moe: bool = False, **overrides) -> dict:
    """A tiny text config (HF key names) with 2 full-attention layers out of 8."""
    cfg = dict(model_type="qwen3_5_moe_text" if moe else "qwen3_5_text", vocab_size=256, hidden_size=64,
               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
               max_position_embeddings=4096, rope_parameters=dict(ROPE), mtp_num_hidden_layers=1, dtype="float32")
    if moe:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    else:
        cfg.update(intermediate_size=128)
    cfg.update(overrides)
    return cfg


def tiny_spec(moe: bool = False, **overrides) -> ModelSpec:
    return spec_from_hf(tiny_config(moe, **overrides))


def randomize_(name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill one tensor in place the way the spec advises, so (1+w)-vs-w or gate-order bugs show."""
    r = torch.randn(t.shape, generator=gen, dtype=torch.float32)
    if name.endswith("linear_attn.norm.weight"):
        v = 1.0 + 0.3 * r
    elif name.endswith("norm.weight") or "norm_" in name.rsplit(".", 2)[-2]:
        v = 0.3 * r                                       # zero-centred norms: (1 + w)
    elif name.endswith("dt_bias"):
        v = r
    elif name.endswith("A_log"):
        v = torch.empty(t.shape).uniform_(1.0, 16.0, generator=gen).log()
    elif name.endswith("conv1d.weight"):
        v = 0.3 * r
    elif name.endswith("embed_tokens.weight"):
        v = r
    else:                                                 # linear layers, fan-in scaled, a bit hot
        v = r * (1.5 / t.shape[-1] ** 0.5)
    t.copy_(v.to(t.dtype))
    return t


def random_weights(spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: randomize_(name, torch.empty(shape, dtype=dtype), gen)
            for name, shape in sorted(expected_shapes(spec, fused_experts=True).items())}


def page_table(batch: int, pages: int) -> torch.Tensor:
    """Disjoint page tables: sequence b owns pages [b*pages, (b+1)*pages)."""
    return torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def write_tiny_checkpoint(d: str, cfg: dict, seed: int) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Random float32 weights of the config `cfg` (random_weights) written to directory d as a checkpoint
    (safetensors + config.json) the Engine loads; returns (spec, weights)."""
    from ranks.weights import write_checkpoint
    spec = spec_from_hf(cfg)
    w = random_weights(spec, seed)
    write_checkpoint(d, w, prefix="model.")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return spec, w
