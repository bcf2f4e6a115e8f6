"""Safetensors checkpoints (spec §2.7, §3.1, §7): layouts that load, and bad input refused up front.

Checkpoints are written into tmp_path with ranks.weights.write_checkpoint from a tiny ModelSpec and
filled with random non-zero values from the per-run `seed`, so a mix-up of any two tensors shows.
Every refusal must be a CheckpointError (or ConfigError) raised before a single tensor byte is read.
"""

from __future__ import annotations

import json
import logging
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

import ranks.weights as W
from ranks.model import HybridModel
from ranks.weights import (INDEX_FILE, SINGLE_FILE, Checkpoint, CheckpointError, expected_shapes, load_weights,
                           validate, write_checkpoint)
from runtime.config import FULL_ATTENTION as F
from runtime.config import LINEAR_ATTENTION as L
from runtime.config import ConfigError, ModelSpec, spec_from_hf

# ------------------------------------------------------------------------------------------------
# Tiny configs and checkpoints

_DROP = object()

DENSE_TEXT = {
    "model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
    "layer_types": [L, L, L, F], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    "mtp_num_hidden_layers": 1, "intermediate_size": 128,
}
MOE_TEXT = {**{k: v for k, v in DENSE_TEXT.items() if k != "intermediate_size"},
            "model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}

TEXT_PREFIXES = ["model.language_model.", "model."]


def config(moe: bool = False, **over) -> dict:
    d = dict(MOE_TEXT if moe else DENSE_TEXT)
    d.update(over)
    return {k: v for k, v in d.items() if v is not _DROP}


def make_spec(moe: bool = False, **over) -> ModelSpec:
    return spec_from_hf(config(moe, **over))


def random_tensor(shape, g: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """Random values bounded away from zero, random sign."""
    mag = torch.rand(shape, generator=g) + 0.25
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return (mag * sign).to(dtype)


def random_weights(spec: ModelSpec, seed: int, *, include_mtp: bool = True,
                   dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor, experts fused, for every tensor `spec` implies."""
    g = torch.Generator().manual_seed(seed)
    return {n: random_tensor(s, g, dtype) for n, s in expected_shapes(spec, include_mtp=include_mtp).items()}


def write_model(model_dir, raw_config: dict, tensors: dict[str, torch.Tensor], **write_kw) -> str:
    model_dir = str(model_dir)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw_config, f)
    write_checkpoint(model_dir, tensors, **write_kw)
    return model_dir


def build(tmp_path, seed: int, moe: bool = False, *, name: str = "model", include_mtp: bool = True,
          tensors=None, cfg_over: dict | None = None, **write_kw):
    """Write config.json + a checkpoint; return (dir, spec, canonical tensors written)."""
    raw = config(moe, **(cfg_over or {}))
    spec = spec_from_hf(raw)
    tensors = random_weights(spec, seed, include_mtp=include_mtp) if tensors is None else tensors
    return write_model(tmp_path / name, raw, tensors, **write_kw), spec, tensors


def split_expert_keys(tensors: dict[str, torch.Tensor], prefix: str, only: str) -> dict[str, torch.Tensor]:
    """On-disk keys with the fused experts whose canonical name starts with `only` written per expert."""
    out = {}
    for name, t in tensors.items():
        key = name if name.startswith(("lm_head.", "mtp.")) else prefix + name
        if name.startswith(only) and name.endswith("mlp.experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif name.startswith(only) and name.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[key] = t
    return out


def on_disk(tensors: dict[str, torch.Tensor], prefix: str = "model.language_model.") -> dict[str, torch.Tensor]:
    return {(n if n.startswith(("lm_head.", "mtp.")) else prefix + n): t for n, t in tensors.items()}


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]):
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t.to(got[name].dtype)), name


@pytest.fixture
def no_reads(monkeypatch):
    """Make any tensor-data read fail: refusals must come from headers and validate() alone."""
    def boom(self, name, *a, **k):
        raise AssertionError(f"tensor data of {name!r} was read before the checkpoint was validated")
    monkeypatch.setattr(Checkpoint, "read", boom)


# ------------------------------------------------------------------------------------------------
# Layouts that load: single file, sharded index, loose shards; both text prefixes; dense and MoE


LAYOUTS = {
    "single_file": dict(max_shard_bytes=4 * 2**30),
    "sharded_index": dict(max_shard_bytes=64 * 1024),
    "loose_shards": dict(max_shard_bytes=64 * 1024, drop_index=True),
}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("prefix", TEXT_PREFIXES, ids=["prefix_model.language_model", "prefix_model"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_loads_layout(tmp_path, seed, moe, prefix, layout):
    layout = dict(layout)
    drop_index = layout.pop("drop_index", False)
    model_dir, spec, tensors = build(tmp_path, seed, moe, prefix=prefix, **layout)
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if layout["max_shard_bytes"] < 2**20:
        assert len(files) > 2 and os.path.isfile(os.path.join(model_dir, INDEX_FILE))
        if drop_index:
            os.remove(os.path.join(model_dir, INDEX_FILE))
    else:
        assert files == [SINGLE_FILE]
    ckpt = Checkpoint(model_dir)
    assert {os.path.basename(i.file) for i in ckpt.tensors.values()} == set(files)
    assert set(ckpt.tensors) == set(tensors)            # canonical names, prefix stripped
    assert all(i.key.startswith(prefix) or i.key.startswith(("lm_head.", "mtp.")) for i in ckpt.tensors.values())
    weights = load_weights(ckpt, spec)
    assert_same_tensors(weights, tensors)
    assert any(n.startswith("mtp.") for n in weights)
    if moe:
        assert weights["layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
        assert weights["mtp.layers.0.mlp.experts.down_proj"].shape == (8, 64, 32)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_from_dir_builds_model(tmp_path, seed, moe):
    model_dir, spec, tensors = build(tmp_path, seed, moe)
    model = HybridModel.from_dir(model_dir)
    assert model.spec == spec and model.has_mtp
    assert torch.equal(model.head, tensors["lm_head.weight"])


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("want", [torch.float32, torch.bfloat16], ids=str)
def test_float_dtypes_convert_on_load(tmp_path, seed, stored, want):
    spec = make_spec(True)
    tensors = random_weights(spec, seed, dtype=stored)
    model_dir = write_model(tmp_path / "m", config(True), tensors)
    weights = load_weights(Checkpoint(model_dir), spec, dtype=want)
    assert all(t.dtype == want for t in weights.values())
    assert_same_tensors(weights, {n: t.to(want) for n, t in tensors.items()})


def test_mixed_float_dtypes_in_one_checkpoint_load(tmp_path, seed):
    spec = make_spec()
    tensors = random_weights(spec, seed, dtype=torch.bfloat16)
    tensors["norm.weight"] = tensors["norm.weight"].float()
    tensors["layers.0.linear_attn.A_log"] = tensors["layers.0.linear_attn.A_log"].half()
    model_dir = write_model(tmp_path / "m", config(), tensors)
    assert_same_tensors(load_weights(Checkpoint(model_dir), spec), {n: t.float() for n, t in tensors.items()})


# ------------------------------------------------------------------------------------------------
# MoE experts: fused (official) and per expert (save_pretrained), in any mix per layer


EXPERT_LAYOUTS = {
    "all_fused": (None, frozenset()),
    "all_per_expert": ("", frozenset({"layers.0.mlp.experts.", "layers.1.mlp.experts.", "layers.2.mlp.experts.",
                                      "layers.3.mlp.experts.", "mtp.layers.0.mlp.experts."})),
    "mtp_per_expert_only_qwen3_5_35b": ("mtp.", frozenset({"mtp.layers.0.mlp.experts."})),
    "one_layer_per_expert": ("layers.2.", frozenset({"layers.2.mlp.experts."})),
}


@pytest.mark.parametrize("prefix", TEXT_PREFIXES, ids=["prefix_model.language_model", "prefix_model"])
@pytest.mark.parametrize("only,per_expert", EXPERT_LAYOUTS.values(), ids=EXPERT_LAYOUTS.keys())
def test_fused_and_per_expert_experts_load_identically(tmp_path, seed, prefix, only, per_expert):
    spec = make_spec(True)
    tensors = random_weights(spec, seed)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config(True)))
    disk = on_disk(tensors, prefix) if only is None else split_expert_keys(tensors, prefix, only)
    save_file({k: t.contiguous() for k, t in disk.items()}, str(d / SINGLE_FILE))
    ckpt = Checkpoint(d)
    layout = validate(ckpt, spec)
    assert layout.per_expert == per_expert and layout.has_mtp
    weights = load_weights(ckpt, spec)
    assert_same_tensors(weights, tensors)     # always fused: experts.gate_up_proj [E, 2I, H], experts.down_proj


def test_write_checkpoint_split_experts_round_trips(tmp_path, seed):
    fused_dir, spec, tensors = build(tmp_path, seed, True, name="fused")
    split_dir, _, _ = build(tmp_path, seed, True, name="split", tensors=tensors, split_experts=True,
                            max_shard_bytes=100 * 1024)
    split_ckpt = Checkpoint(split_dir)
    assert "layers.0.mlp.experts.7.down_proj.weight" in split_ckpt
    assert "layers.0.mlp.experts.gate_up_proj" not in split_ckpt
    assert split_ckpt.shape("layers.1.mlp.experts.3.gate_proj.weight") == (32, 64)
    a, b = load_weights(Checkpoint(fused_dir), spec), load_weights(split_ckpt, spec)
    assert_same_tensors(b, a)
    assert_same_tensors(a, tensors)


# ------------------------------------------------------------------------------------------------
# Lazy, per-slice reads


SLICES = {
    "embed_rows": ("embed_tokens.weight", slice(10, 50), None),
    "q_proj_cols": ("layers.3.self_attn.q_proj.weight", None, slice(8, 40)),
    "q_proj_rows_and_cols": ("layers.3.self_attn.q_proj.weight", slice(64, 192), slice(0, 32)),
    "gdn_in_proj_qkv_rows": ("layers.0.linear_attn.in_proj_qkv.weight", slice(32, 64), None),
    "conv1d_3d_rows": ("layers.1.linear_attn.conv1d.weight", slice(0, 64), None),
    "norm_1d_rows": ("layers.2.input_layernorm.weight", slice(4, 20), None),
    "experts_rows_pick_experts": ("layers.0.mlp.experts.gate_up_proj", slice(2, 5), None),
    "experts_rows_and_cols_gate_half": ("layers.1.mlp.experts.gate_up_proj", slice(0, 8), slice(0, 32)),
    "experts_down_cols": ("mtp.layers.0.mlp.experts.down_proj", slice(4, 8), slice(16, 64)),
    "lm_head_last_rows": ("lm_head.weight", slice(128, 256), None),
    "empty_slice": ("norm.weight", slice(5, 5), None),
    "open_ended_slice": ("layers.0.linear_attn.out_proj.weight", slice(48, None), slice(None, 16)),
}


@pytest.mark.parametrize("layout", ["single_file", "sharded_index"])
@pytest.mark.parametrize("name,rows,cols", SLICES.values(), ids=SLICES.keys())
def test_slices_equal_full_tensor_slices(tmp_path, seed, layout, name, rows, cols):
    model_dir, spec, tensors = build(tmp_path, seed, True,
                                     max_shard_bytes=64 * 1024 if layout == "sharded_index" else 2**30)
    ckpt = Checkpoint(model_dir)
    full = ckpt.read(name)
    assert torch.equal(full, tensors[name])
    part = ckpt.read(name, rows=rows, cols=cols)
    want = tensors[name][rows or slice(None)]
    if cols is not None:
        want = want[:, cols]
    assert part.shape == want.shape and torch.equal(part, want)


def test_slice_read_converts_dtype(tmp_path, seed):
    spec = make_spec()
    tensors = random_weights(spec, seed, dtype=torch.bfloat16)
    model_dir = write_model(tmp_path / "m", config(), tensors)
    part = Checkpoint(model_dir).read("layers.0.mlp.up_proj.weight", rows=slice(0, 64), cols=slice(32, 64),
                                      dtype=torch.float32)
    assert part.dtype == torch.float32
    assert torch.equal(part, tensors["layers.0.mlp.up_proj.weight"][:64, 32:].float())


def test_open_and_validate_read_no_tensor_data(tmp_path, seed, monkeypatch):
    """Opening parses headers only and validate() checks names/shapes/dtypes without reading tensor data."""
    import safetensors
    model_dir, spec, tensors = build(tmp_path, seed, True, max_shard_bytes=64 * 1024, split_experts=True)
    opened = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    ckpt = Checkpoint(model_dir)
    validate(ckpt, spec)
    assert opened == []
    ckpt.read("norm.weight", rows=slice(0, 8))
    assert opened == [ckpt.tensors["norm.weight"].file]      # one shard opened for one slice
    reads = []
    real_read = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, name, **k: reads.append(name) or real_read(self, name, **k))
    load_weights(ckpt, spec)
    assert sorted(reads) == sorted(ckpt.tensors)             # every stored tensor exactly once


def test_reading_an_unknown_tensor_names_it(tmp_path, seed):
    model_dir, _, _ = build(tmp_path, seed)
    with pytest.raises(CheckpointError, match="layers.9.mlp.up_proj.weight"):
        Checkpoint(model_dir).read("layers.9.mlp.up_proj.weight")


# ------------------------------------------------------------------------------------------------
# Vision tower ignored; MTP optional; tied embeddings


def test_visual_tensors_are_ignored(tmp_path, seed):
    model_dir, spec, tensors = build(tmp_path, seed, True)
    g = torch.Generator().manual_seed(seed + 1)
    visual = {"model.visual.blocks.0.attn.qkv.weight": random_tensor((96, 32), g),
              "model.visual.blocks.0.attn.qkv.bias": random_tensor((96,), g),
              "model.visual.patch_embed.proj.weight": random_tensor((32, 3, 2, 4, 4), g),
              "model.visual.pos_embed.idx": torch.arange(12, dtype=torch.int64),   # a dtype text would refuse
              "visual.merger.norm.weight": random_tensor((32,), g)}
    save_file(visual, os.path.join(model_dir, "vision.safetensors"))
    os.replace(os.path.join(model_dir, SINGLE_FILE), os.path.join(model_dir, "text.safetensors"))  # loose shards
    ckpt = Checkpoint(model_dir)
    assert sorted(ckpt.ignored) == sorted(visual)
    assert not any("visual" in n for n in ckpt.tensors)
    assert_same_tensors(load_weights(ckpt, spec), tensors)


def test_mtp_absent_loads_with_warning(tmp_path, seed, caplog):
    model_dir, spec, tensors = build(tmp_path, seed, True, include_mtp=False)
    assert spec.mtp_num_layers == 1
    with caplog.at_level(logging.WARNING, logger="ranks.weights"):
        weights = load_weights(Checkpoint(model_dir), spec)
    assert not any(n.startswith("mtp.") for n in weights)
    assert_same_tensors(weights, tensors)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "ranks.weights"]
    assert len(warnings) == 1
    assert "mtp" in warnings[0].getMessage() and model_dir in warnings[0].getMessage()
    assert not HybridModel(spec, weights).has_mtp


def test_mtp_present_loads_without_warning(tmp_path, seed, caplog):
    model_dir, spec, tensors = build(tmp_path, seed)
    with caplog.at_level(logging.WARNING, logger="ranks.weights"):
        weights = load_weights(Checkpoint(model_dir), spec)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert {n for n in weights if n.startswith("mtp.")} == {n for n in tensors if n.startswith("mtp.")}
    assert "mtp.layers.0.self_attn.q_proj.weight" in weights and "mtp.fc.weight" in weights


def test_no_mtp_config_and_no_mtp_weights_loads_quietly(tmp_path, seed, caplog):
    model_dir, spec, tensors = build(tmp_path, seed, cfg_over={"mtp_num_hidden_layers": 0})
    with caplog.at_level(logging.WARNING, logger="ranks.weights"):
        weights = load_weights(Checkpoint(model_dir), spec)
    assert not caplog.records
    assert_same_tensors(weights, tensors)


TIED = {
    "tied_without_lm_head": (dict(tie_word_embeddings=True), False),
    "tied_with_lm_head_present": (dict(tie_word_embeddings=True), True),
}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("over,with_lm_head", TIED.values(), ids=TIED.keys())
def test_tied_embeddings_load(tmp_path, seed, moe, over, with_lm_head, caplog):
    spec = make_spec(moe, **over)
    tensors = random_weights(spec, seed)
    assert "lm_head.weight" not in tensors
    if with_lm_head:
        tensors["lm_head.weight"] = random_tensor((256, 64), torch.Generator().manual_seed(seed + 1))
    model_dir = write_model(tmp_path / "m", config(moe, **over), tensors)
    model = HybridModel.from_dir(model_dir)
    assert "lm_head.weight" not in model.w                    # lm_head = embed_tokens
    assert model.head is model.w["embed_tokens.weight"]
    assert torch.equal(model.head, tensors["embed_tokens.weight"])
    # a stored lm_head.weight that the tie leaves unused is said so (transformers would use it)
    assert any("lm_head.weight is not used" in r.getMessage() for r in caplog.records) == with_lm_head


def test_tied_via_wrapper_top_level_as_transformers_writes_it(tmp_path, seed):
    spec = make_spec(tie_word_embeddings=True)
    tensors = random_weights(spec, seed)
    raw = {"model_type": "qwen3_5", "tie_word_embeddings": True,
           "text_config": config(tie_word_embeddings=False, model_type=_DROP), "vision_config": {}}
    model_dir = write_model(tmp_path / "m", raw, tensors)
    model = HybridModel.from_dir(model_dir)
    assert model.spec.tie_word_embeddings and torch.equal(model.head, tensors["embed_tokens.weight"])


# ------------------------------------------------------------------------------------------------
# Bad checkpoints: one CheckpointError naming the file and tensor, before any tensor data is read.
# Each case builds a model directory and returns (dir, expected exception, [substrings of the message]).


def _single(tmp_path, seed, moe=False, **kw):
    return build(tmp_path, seed, moe, **kw)


def _rewrite(model_dir, tensors, prefix="model.language_model.", **kw):
    """Replace the checkpoint of `model_dir` by canonical `tensors` (config.json kept)."""
    for f in os.listdir(model_dir):
        if f.endswith(".safetensors") or f == INDEX_FILE:
            os.remove(os.path.join(model_dir, f))
    write_checkpoint(model_dir, tensors, prefix=prefix, **kw)


def _file(model_dir):
    return os.path.join(model_dir, SINGLE_FILE)


def case_missing_tensor(tmp_path, seed):
    d, _, t = _single(tmp_path, seed)
    del t["layers.1.linear_attn.A_log"]
    _rewrite(d, t)
    return d, CheckpointError, [d, "'layers.1.linear_attn.A_log'", "missing"]


def case_missing_many_tensors_names_first_and_count(tmp_path, seed):
    d, _, t = _single(tmp_path, seed)
    for n in ["layers.2.mlp.up_proj.weight", "layers.2.mlp.down_proj.weight", "norm.weight"]:
        del t[n]
    _rewrite(d, t)
    return d, CheckpointError, [d, "'layers.2.mlp.down_proj.weight'", "and 2 more"]


def case_missing_lm_head_untied(tmp_path, seed):
    d, _, t = _single(tmp_path, seed, True)
    del t["lm_head.weight"]
    _rewrite(d, t)
    return d, CheckpointError, [d, "'lm_head.weight'", "missing"]


def case_missing_tensor_in_sharded_checkpoint(tmp_path, seed):
    d, _, t = _single(tmp_path, seed, True, max_shard_bytes=64 * 1024)
    del t["layers.3.self_attn.k_norm.weight"]
    _rewrite(d, t, max_shard_bytes=64 * 1024)
    return d, CheckpointError, [d, "'layers.3.self_attn.k_norm.weight'", "missing"]


def case_extra_tensor(tmp_path, seed):
    d, _, t = _single(tmp_path, seed)
    t["layers.0.mlp.bogus.weight"] = torch.ones(4, 4)
    _rewrite(d, t)
    return d, CheckpointError, [_file(d), "'model.language_model.layers.0.mlp.bogus.weight'", "unexpected"]


def case_extra_layer(tmp_path, seed):
    d, _, t = _single(tmp_path, seed, prefix="model.")
    t["layers.4.input_layernorm.weight"] = torch.ones(64)
    _rewrite(d, t, prefix="model.")
    return d, CheckpointError, [_file(d), "'model.layers.4.input_layernorm.weight'", "unexpected"]


def case_extra_tensor_in_loose_shard_names_that_shard(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    save_file({"model.language_model.layers.0.self_attn.q_proj.weight": torch.ones(256, 64)},
              os.path.join(d, "zz-extra.safetensors"))
    os.replace(_file(d), os.path.join(d, "aa-main.safetensors"))
    return d, CheckpointError, [os.path.join(d, "zz-extra.safetensors"),
                                "'model.language_model.layers.0.self_attn.q_proj.weight'", "unexpected"]


def case_wrong_shape(tmp_path, seed):
    d, _, t = _single(tmp_path, seed)
    t["layers.3.self_attn.k_proj.weight"] = torch.ones(32, 64)
    _rewrite(d, t)
    return d, CheckpointError, [_file(d), "'model.language_model.layers.3.self_attn.k_proj.weight'",
                                "[32, 64]", "[64, 64]"]


def case_transposed_weight(tmp_path, seed):
    d, _, t = _single(tmp_path, seed)
    t["layers.3.self_attn.o_proj.weight"] = t["layers.3.self_attn.o_proj.weight"].T.contiguous()
    _rewrite(d, t)
    return d, CheckpointError, [_file(d), "layers.3.self_attn.o_proj.weight", "[128, 64]", "[64, 128]"]


def case_wrong_shape_fused_experts(tmp_path, seed):
    d, _, t = _single(tmp_path, seed, True)
    t["layers.2.mlp.experts.gate_up_proj"] = torch.ones(8, 32, 64)    # gate only, up missing
    _rewrite(d, t)
    return d, CheckpointError, [_file(d), "layers.2.mlp.experts.gate_up_proj", "[8, 32, 64]", "[8, 64, 64]"]


def case_wrong_shape_mtp_fc(tmp_path, seed):
    d, _, t = _single(tmp_path, seed)
    t["mtp.fc.weight"] = torch.ones(64, 64)
    _rewrite(d, t)
    return d, CheckpointError, [_file(d), "'mtp.fc.weight'", "[64, 64]", "[64, 128]"]


def _dtype_case(dtype, tag, name="embed_tokens.weight"):
    def case(tmp_path, seed):
        d, _, t = _single(tmp_path, seed)
        t[name] = torch.ones(t[name].shape).to(dtype)
        _rewrite(d, t)
        return d, CheckpointError, [_file(d), f"'model.language_model.{name}'", tag]
    return case


def case_truncated_data(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    f = _file(d)
    os.truncate(f, os.path.getsize(f) - 100)
    return d, CheckpointError, [f, "truncated"]


def case_truncated_to_half(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed, True, max_shard_bytes=64 * 1024)
    f = os.path.join(d, sorted(x for x in os.listdir(d) if x.endswith(".safetensors"))[1])
    os.truncate(f, os.path.getsize(f) // 2)
    return d, CheckpointError, [f, "truncated"]


def case_truncated_inside_header(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    f = _file(d)
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    os.truncate(f, 8 + n // 2)
    return d, CheckpointError, [f, "truncated"]


def case_truncated_to_four_bytes(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    os.truncate(_file(d), 4)
    return d, CheckpointError, [_file(d), "truncated"]


def case_empty_file(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    open(_file(d), "wb").close()
    return d, CheckpointError, [_file(d), "truncated"]


def _patch_bytes(path, offset, data):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def case_garbage_header_length(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    _patch_bytes(_file(d), 0, b"\xde\xad\xbe\xef\xde\xad\xbe\xef")
    return d, CheckpointError, [_file(d), "corrupt"]


def case_header_length_larger_than_file(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    _patch_bytes(_file(d), 0, struct.pack("<Q", os.path.getsize(_file(d))))
    return d, CheckpointError, [_file(d), "corrupt", f"header length {os.path.getsize(_file(d))}"]


def case_garbage_header_bytes(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    _patch_bytes(_file(d), 8, b"\x00\x13garbage!\xff")
    return d, CheckpointError, [_file(d), "corrupt"]


def case_whole_file_garbage(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    g = torch.Generator().manual_seed(seed)
    with open(_file(d), "wb") as fh:
        fh.write(bytes(torch.randint(0, 256, (4096,), generator=g, dtype=torch.uint8).tolist()))
    return d, CheckpointError, [_file(d), "corrupt"]


def _raw_safetensors(path, header: dict, data: bytes):
    blob = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob + data)


def _raw_header_case(header, data, words):
    def case(tmp_path, seed):
        d, _, _ = _single(tmp_path, seed)
        extra = os.path.join(d, "zz-raw.safetensors")
        os.replace(_file(d), os.path.join(d, "aa-main.safetensors"))
        _raw_safetensors(extra, header, data)
        return d, CheckpointError, [extra] + words
    return case


def case_index_names_missing_shard(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed, True, max_shard_bytes=64 * 1024)
    with open(os.path.join(d, INDEX_FILE)) as fh:
        gone = json.load(fh)["weight_map"]["lm_head.weight"]
    os.remove(os.path.join(d, gone))
    return d, CheckpointError, [os.path.join(d, INDEX_FILE), repr(gone), "missing"]


def case_index_corrupt_json(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed, max_shard_bytes=64 * 1024)
    with open(os.path.join(d, INDEX_FILE), "w") as fh:
        fh.write('{"weight_map": {"lm_head.weight": ')
    return d, CheckpointError, [os.path.join(d, INDEX_FILE), "shard index"]


def case_index_without_weight_map(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed, max_shard_bytes=64 * 1024)
    with open(os.path.join(d, INDEX_FILE), "w") as fh:
        json.dump({"metadata": {"total_size": 1}}, fh)
    return d, CheckpointError, [os.path.join(d, INDEX_FILE), "weight_map"]


def case_stale_single_file_beside_index(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed, max_shard_bytes=64 * 1024)
    other = write_model(tmp_path / "other", config(), random_weights(make_spec(), seed + 1))
    os.replace(_file(other), _file(d))                     # transformers would load this one, not the shards
    return d, CheckpointError, [d, SINGLE_FILE, INDEX_FILE, "stale"]


def case_no_weight_files(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    os.remove(_file(d))
    return d, CheckpointError, [d, SINGLE_FILE, INDEX_FILE]


def case_duplicate_across_prefixes(tmp_path, seed):
    d, _, t = _single(tmp_path, seed)
    disk = on_disk(t)
    disk["model.norm.weight"] = t["norm.weight"].clone()
    os.remove(_file(d))
    save_file(disk, _file(d))
    return d, CheckpointError, [_file(d), "'model.norm.weight'", "'model.language_model.norm.weight'", "duplicates"]


def case_duplicate_across_shards(tmp_path, seed):
    d, _, t = _single(tmp_path, seed)
    save_file({"model.embed_tokens.weight": t["embed_tokens.weight"].clone()}, os.path.join(d, "zz.safetensors"))
    os.replace(_file(d), os.path.join(d, "aa.safetensors"))
    return d, CheckpointError, [os.path.join(d, "zz.safetensors"), os.path.join(d, "aa.safetensors"),
                                "'model.embed_tokens.weight'", "duplicates"]


def case_mtp_partially_present(tmp_path, seed):
    d, _, t = _single(tmp_path, seed, True)
    del t["mtp.layers.0.self_attn.q_proj.weight"]
    _rewrite(d, t)
    return d, CheckpointError, [d, "'mtp.layers.0.self_attn.q_proj.weight'", "missing"]


def case_mtp_only_fc_present(tmp_path, seed):
    d, _, t = _single(tmp_path, seed)
    t = {n: v for n, v in t.items() if not n.startswith("mtp.") or n == "mtp.fc.weight"}
    _rewrite(d, t)
    return d, CheckpointError, [d, "'mtp.", "missing"]


def case_mtp_present_but_config_has_none(tmp_path, seed):
    spec = make_spec(True)
    t = random_weights(spec, seed)
    d = write_model(tmp_path / "m", config(True, mtp_num_hidden_layers=0), t)
    return d, CheckpointError, [_file(d), "'mtp.", "mtp_num_hidden_layers", os.path.join(d, "config.json")]


def case_fused_and_per_expert_in_one_layer(tmp_path, seed):
    d, _, t = _single(tmp_path, seed, True)
    disk = split_expert_keys(t, "model.language_model.", "layers.1.")
    disk["model.language_model.layers.1.mlp.experts.gate_up_proj"] = t["layers.1.mlp.experts.gate_up_proj"]
    os.remove(_file(d))
    save_file(disk, _file(d))
    return d, CheckpointError, [_file(d), "'model.language_model.layers.1.mlp.experts.gate_up_proj'", "unexpected"]


def case_per_expert_missing_one_projection(tmp_path, seed):
    d, _, t = _single(tmp_path, seed, True)
    disk = split_expert_keys(t, "model.", "")
    del disk["model.layers.2.mlp.experts.5.up_proj.weight"]
    os.remove(_file(d))
    save_file(disk, _file(d))
    return d, CheckpointError, [d, "'layers.2.mlp.experts.5.up_proj.weight'", "missing"]


def case_per_expert_index_out_of_range(tmp_path, seed):
    d, _, t = _single(tmp_path, seed, True)
    disk = split_expert_keys(t, "model.", "")
    disk["model.layers.0.mlp.experts.8.down_proj.weight"] = torch.ones(64, 32)
    os.remove(_file(d))
    save_file(disk, _file(d))
    return d, CheckpointError, [_file(d), "'model.layers.0.mlp.experts.8.down_proj.weight'", "unexpected"]


def case_per_expert_wrong_shape(tmp_path, seed):
    d, _, t = _single(tmp_path, seed, True)
    disk = split_expert_keys(t, "model.", "mtp.")
    disk["mtp.layers.0.mlp.experts.3.gate_proj.weight"] = torch.ones(64, 32)
    os.remove(_file(d))
    save_file(disk, _file(d))
    return d, CheckpointError, [_file(d), "'mtp.layers.0.mlp.experts.3.gate_proj.weight'", "[64, 32]", "[32, 64]"]


def case_config_unknown_model_type(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(config(model_type="llama"), fh)
    return d, ConfigError, [os.path.join(d, "config.json"), "model_type", "'llama'"]


def case_config_corrupt_json(tmp_path, seed):
    d, _, _ = _single(tmp_path, seed)
    with open(os.path.join(d, "config.json"), "w") as fh:
        fh.write("{")
    return d, ConfigError, [os.path.join(d, "config.json")]


BAD = {
    # names and shapes
    "missing_tensor": case_missing_tensor,
    "missing_many_tensors_names_first_and_count": case_missing_many_tensors_names_first_and_count,
    "missing_lm_head_untied": case_missing_lm_head_untied,
    "missing_tensor_in_sharded_checkpoint": case_missing_tensor_in_sharded_checkpoint,
    "extra_tensor": case_extra_tensor,
    "extra_layer": case_extra_layer,
    "extra_tensor_in_loose_shard_names_that_shard": case_extra_tensor_in_loose_shard_names_that_shard,
    "wrong_shape": case_wrong_shape,
    "transposed_weight": case_transposed_weight,
    "wrong_shape_fused_experts": case_wrong_shape_fused_experts,
    "wrong_shape_mtp_fc": case_wrong_shape_mtp_fc,
    # dtypes
    "integer_dtype_int32": _dtype_case(torch.int32, "I32"),
    "integer_dtype_int64_norm": _dtype_case(torch.int64, "I64", "norm.weight"),
    "uint8_packed_weights": _dtype_case(torch.uint8, "U8", "layers.0.mlp.up_proj.weight"),
    "fp8_weights": _dtype_case(torch.float8_e4m3fn, "F8_E4M3", "layers.3.self_attn.q_proj.weight"),
    "bool_dtype": _dtype_case(torch.bool, "BOOL", "layers.0.linear_attn.dt_bias"),
    # truncated / corrupt files
    "truncated_data": case_truncated_data,
    "truncated_shard_to_half": case_truncated_to_half,
    "truncated_inside_header": case_truncated_inside_header,
    "truncated_to_four_bytes": case_truncated_to_four_bytes,
    "empty_file": case_empty_file,
    "garbage_header_length": case_garbage_header_length,
    "header_length_larger_than_file": case_header_length_larger_than_file,
    "garbage_header_bytes": case_garbage_header_bytes,
    "whole_file_garbage": case_whole_file_garbage,
    "header_not_an_object": _raw_header_case([1, 2], b"", ["corrupt"]),
    "header_unknown_dtype": _raw_header_case(
        {"model.norm2": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", ["'model.norm2'", "'F4'"]),
    "header_entry_not_an_object": _raw_header_case({"model.norm2": 5}, b"", ["'model.norm2'", "malformed"]),
    "header_shape_not_ints": _raw_header_case(
        {"model.norm2": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 8]}}, b"\0" * 8,
        ["'model.norm2'", "malformed"]),
    "header_negative_dims": _raw_header_case(
        {"model.norm2": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}, b"\0" * 8,
        ["'model.norm2'", "malformed"]),
    "header_offsets_not_ints": _raw_header_case(
        {"model.norm2": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}, b"\0" * 8,
        ["'model.norm2'", "malformed"]),
    "header_offsets_do_not_match_shape": _raw_header_case(
        {"model.norm2": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12,
        ["'model.norm2'", "data offsets"]),
    "header_tensor_past_end_of_file": _raw_header_case(
        {"model.norm2": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8,
        ["'model.norm2'", "truncated"]),
    "header_overlapping_tensors": _raw_header_case(
        {"model.a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "model.b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, ["corrupt", "'model."]),
    "header_gap_before_tensor": _raw_header_case(
        {"model.a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, ["corrupt", "'model.a'"]),
    "metadata_not_strings": _raw_header_case(
        {"__metadata__": {"format": 1}, "model.a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
        b"\0" * 8, ["__metadata__", "strings"]),
    "metadata_not_an_object": _raw_header_case(
        {"__metadata__": ["pt"], "model.a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
        b"\0" * 8, ["__metadata__"]),
    "trailing_garbage_after_tensors": _raw_header_case(
        {"model.a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8 + b"junk", ["corrupt", "stray"]),
    # index
    "index_names_missing_shard": case_index_names_missing_shard,
    "index_corrupt_json": case_index_corrupt_json,
    "index_without_weight_map": case_index_without_weight_map,
    "stale_single_file_beside_index": case_stale_single_file_beside_index,
    "no_weight_files": case_no_weight_files,
    # duplicates
    "duplicate_across_prefixes": case_duplicate_across_prefixes,
    "duplicate_across_shards": case_duplicate_across_shards,
    # MTP
    "mtp_partially_present": case_mtp_partially_present,
    "mtp_only_fc_present": case_mtp_only_fc_present,
    "mtp_present_but_config_has_none": case_mtp_present_but_config_has_none,
    # experts
    "fused_and_per_expert_in_one_layer": case_fused_and_per_expert_in_one_layer,
    "per_expert_missing_one_projection": case_per_expert_missing_one_projection,
    "per_expert_index_out_of_range": case_per_expert_index_out_of_range,
    "per_expert_wrong_shape": case_per_expert_wrong_shape,
    # config errors come first, as ConfigError
    "config_unknown_model_type": case_config_unknown_model_type,
    "config_corrupt_json": case_config_corrupt_json,
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_checkpoint_refused_before_any_read(tmp_path, seed, no_reads, case):
    model_dir, exc_type, words = case(tmp_path, seed)
    with pytest.raises((CheckpointError, ConfigError)) as exc:
        HybridModel.from_dir(model_dir)
    assert type(exc.value) is exc_type, repr(exc.value)
    msg = str(exc.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert "\n" not in msg                       # one clear line


# Config that contradicts the weights: the error names the file, tensor, and both shapes (or the missing tensor).

CONTRADICTIONS = {
    "hidden_64_weights_32": (dict(hidden_size=32), {}, False,
                             ["'model.language_model.embed_tokens.weight'", "[256, 32]", "[256, 64]"]),
    "intermediate_mismatch": (dict(intermediate_size=96), {}, False,
                              ["'model.language_model.layers.0.mlp.down_proj.weight'", "[64, 96]", "[64, 128]"]),
    "vocab_mismatch": (dict(vocab_size=512), {}, False,
                       ["'model.language_model.embed_tokens.weight'", "[512, 64]", "[256, 64]"]),
    "head_dim_mismatch": (dict(head_dim=16), {}, False,
                          ["'model.language_model.layers.3.self_attn.k_norm.weight'", "[16]", "[32]"]),
    "kv_heads_mismatch": (dict(num_key_value_heads=1), {}, False,
                          ["'model.language_model.layers.3.self_attn.k_proj.weight'", "[32, 64]", "[64, 64]"]),
    "gdn_value_heads_mismatch": (dict(linear_num_value_heads=2), {}, False,
                                 ["'model.language_model.layers.0.linear_attn.A_log'", "[2]", "[4]"]),
    "conv_kernel_mismatch": (dict(linear_conv_kernel_dim=2), {}, False,
                             ["'model.language_model.layers.0.linear_attn.conv1d.weight'", "[128, 1, 2]",
                              "[128, 1, 4]"]),
    "moe_intermediate_mismatch": (dict(moe_intermediate_size=16), {}, True,
                                  ["'model.language_model.layers.0.mlp.experts.down_proj'", "[8, 64, 16]",
                                   "[8, 64, 32]"]),
    "num_experts_mismatch_fused": (dict(num_experts=4, num_experts_per_tok=2), {}, True,
                                   ["'model.language_model.layers.0.mlp.experts.down_proj'", "[4, 64, 32]",
                                    "[8, 64, 32]"]),
    "shared_expert_mismatch": (dict(shared_expert_intermediate_size=24), {}, True,
                               ["'model.language_model.layers.0.mlp.shared_expert.down_proj.weight'",
                                "[64, 24]", "[64, 48]"]),
    "config_has_more_layers": ({}, dict(num_hidden_layers=8, layer_types=[L, L, L, F] * 2), False,
                               ["'layers.4.", "missing"]),
    "config_has_fewer_layers": (dict(num_hidden_layers=8, layer_types=[L, L, L, F] * 2), {}, False,
                                ["'model.language_model.layers.4.", "unexpected"]),
    "layer_types_swapped": ({}, dict(layer_types=[F, L, L, L]), False, ["'layers.0.self_attn.", "missing"]),
    "config_dense_weights_moe": (dict(), dict(), "weights_moe", ["'layers.0.mlp.down_proj.weight'", "missing"]),
    "config_untied_weights_tied": (dict(tie_word_embeddings=True), {}, False, ["'lm_head.weight'", "missing"]),
}


@pytest.mark.parametrize("weights_over,config_over,moe,words", CONTRADICTIONS.values(), ids=CONTRADICTIONS.keys())
def test_config_contradicting_weights_refused(tmp_path, seed, no_reads, weights_over, config_over, moe, words):
    if moe == "weights_moe":
        wspec, raw = make_spec(True), config(False)
    else:
        wspec, raw = make_spec(moe, **weights_over), config(moe, **config_over)
    d = write_model(tmp_path / "m", raw, random_weights(wspec, seed))
    with pytest.raises(CheckpointError) as exc:
        HybridModel.from_dir(d)
    msg = str(exc.value)
    assert d in msg
    assert os.path.join(d, "config.json") in msg          # which config disagrees
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    if "missing" not in words:
        assert _file(d) in msg                            # the file holding the offending tensor


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


# ------------------------------------------------------------------------------------------------
# Checkpoints written by transformers itself (save_pretrained): names, prefixes, per-expert layout


def _tiny_hf_text_kwargs(moe: bool) -> dict:
    d = {k: v for k, v in config(moe).items() if k not in ("model_type",)}
    return d


@pytest.mark.parametrize("kind", ["dense_causal_lm", "moe_causal_lm_per_expert", "tied_conditional_generation"])
def test_transformers_save_pretrained_loads(tmp_path, seed, kind, caplog):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    if kind == "dense_causal_lm":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**_tiny_hf_text_kwargs(False)))
    elif kind == "moe_causal_lm_per_expert":
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**_tiny_hf_text_kwargs(True)))
    else:
        cfg = transformers.Qwen3_5Config(
            text_config=_tiny_hf_text_kwargs(False), tie_word_embeddings=True,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=4, temporal_patch_size=2, spatial_merge_size=2))
        model = transformers.Qwen3_5ForConditionalGeneration(cfg)
    with torch.no_grad():                               # non-default values everywhere (norms init to 0/1)
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.copy_(random_tensor(p.shape, g))
    model_dir = str(tmp_path / kind)
    model.save_pretrained(model_dir)
    with caplog.at_level(logging.WARNING, logger="ranks.weights"):
        loaded = HybridModel.from_dir(model_dir)        # no mtp.* in save_pretrained output -> warning only
    assert not loaded.has_mtp and any("mtp" in r.getMessage() for r in caplog.records)
    want = {}
    for k, v in model.state_dict().items():
        if k.startswith("model.visual."):
            continue
        name = W.canonical_name(k)
        want[name] = v
    if kind == "tied_conditional_generation":
        want.pop("lm_head.weight", None)
        assert loaded.spec.tie_word_embeddings
        assert torch.equal(loaded.head, model.get_input_embeddings().weight.detach())
    assert_same_tensors(loaded.w, {k: v.detach() for k, v in want.items()})
