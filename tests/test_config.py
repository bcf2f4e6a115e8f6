"""config.json -> ModelSpec (spec §0, §1, §7): accepted layouts, and refusals that name file, field and value.

Every refusal goes through ``load_spec`` on a real file so the message can be checked for the path.
"""

from __future__ import annotations

import copy
import json
import os

import pytest

from runtime.config import FULL_ATTENTION as F
from runtime.config import LINEAR_ATTENTION as L
from runtime.config import ConfigError, ModelSpec, load_spec, spec_from_hf

# ------------------------------------------------------------------------------------------------
# Tiny configs (spec §6.1)

ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True}

DENSE_TEXT = {
    "model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
    "layer_types": [L, L, L, F], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "rope_parameters": ROPE,
    "mtp_num_hidden_layers": 1, "intermediate_size": 128, "hidden_act": "silu", "attention_bias": False,
    "attn_output_gate": True, "output_gate_type": "swish", "mtp_use_dedicated_embeddings": False,
    "eos_token_id": 7, "bos_token_id": 5, "dtype": "bfloat16",
}
MOE_TEXT = {**{k: v for k, v in DENSE_TEXT.items() if k != "intermediate_size"},
            "model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [], "decoder_sparse_step": 1}
_DROP = object()   # an override value that deletes the key

# A vision config the runtime must not look at (types and values deliberately unusable).
VISION = {"model_type": "qwen3_5", "depth": "deep", "hidden_act": "gelu_pytorch_tanh", "hidden_size": -1}


def text(moe: bool = False, **over) -> dict:
    d = copy.deepcopy(MOE_TEXT if moe else DENSE_TEXT)
    d.update(over)
    return {k: v for k, v in d.items() if v is not _DROP}


def wrapper(txt: dict, **top) -> dict:
    moe = txt.get("model_type", "").startswith("qwen3_5_moe")
    d = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
         "model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": txt, "vision_config": VISION,
         "image_token_id": 248056}
    d.update(top)
    return {k: v for k, v in d.items() if v is not _DROP}


def write_config(tmp_path, raw) -> tuple[str, str]:
    """Write `raw` (a dict, or literal str / bytes content) as MODEL_DIR/config.json; return (dir, path)."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    path = d / "config.json"
    if isinstance(raw, bytes):
        path.write_bytes(raw)
    elif isinstance(raw, str):
        path.write_text(raw, encoding="utf-8")
    else:
        path.write_text(json.dumps(raw), encoding="utf-8")
    return str(d), str(path)


# ------------------------------------------------------------------------------------------------
# Accepted model types


def _no_model_type(t: dict) -> dict:
    return {k: v for k, v in t.items() if k != "model_type"}


ACCEPTED = {
    "qwen3_5_text": (text(), "qwen3_5_text"),
    "qwen3_5_moe_text": (text(moe=True), "qwen3_5_moe_text"),
    "qwen3_5_wrapper_nests_text_config": (wrapper(text()), "qwen3_5_text"),
    "qwen3_5_moe_wrapper_nests_text_config": (wrapper(text(moe=True)), "qwen3_5_moe_text"),
    "wrapper_text_config_without_model_type": ({**wrapper(text()), "text_config": _no_model_type(text())},
                                               "qwen3_5_text"),
    "moe_wrapper_text_config_without_model_type": (
        {**wrapper(text(moe=True)), "text_config": _no_model_type(text(moe=True))}, "qwen3_5_moe_text"),
    "wrapper_without_vision_config": ({**wrapper(text()), "vision_config": None}, "qwen3_5_text"),
}


@pytest.mark.parametrize("raw,model_type", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_accepts_model_type(tmp_path, raw, model_type):
    model_dir, path = write_config(tmp_path, raw)
    spec = load_spec(model_dir)
    moe = model_type == "qwen3_5_moe_text"
    assert spec.model_type == model_type and spec.is_moe == moe
    assert spec.source == path
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers) == (256, 64, 4)
    assert spec.layer_types == (L, L, L, F)
    assert spec.full_attention_layers == (3,) and spec.linear_attention_layers == (0, 1, 2)
    # gated attention: q_proj emits q | gate, heads * head_dim != hidden
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 32)
    assert (spec.q_width, spec.kv_width, spec.gqa_groups) == (128, 64, 2)
    assert (spec.rotary_dim, spec.rope_theta) == (8, 1e7)
    # GDN dims
    assert (spec.linear_num_key_heads, spec.linear_num_value_heads) == (2, 4)
    assert (spec.linear_key_dim, spec.linear_value_dim, spec.conv_dim, spec.gva_ratio) == (32, 64, 128, 2)
    assert spec.conv_kernel == 4
    # FFN
    if moe:
        assert spec.intermediate_size == 0
        assert (spec.num_experts, spec.num_experts_per_tok) == (8, 2)
        assert (spec.moe_intermediate_size, spec.shared_expert_intermediate_size) == (32, 48)
    else:
        assert spec.intermediate_size == 128 and spec.num_experts == 0
    assert spec.mtp_num_layers == 1
    assert spec.tie_word_embeddings is False
    assert spec.eos_token_ids == (7,) and spec.bos_token_id == 5
    assert spec.max_position_embeddings == 512
    assert "source" not in spec.to_dict() and spec.to_dict()["layer_types"] == (L, L, L, F)


def test_spec_from_hf_equals_load_spec(tmp_path):
    model_dir, _ = write_config(tmp_path, wrapper(text(moe=True)))
    assert load_spec(model_dir) == spec_from_hf(text(moe=True))   # source is not compared


def test_optional_fields_take_family_defaults():
    keep = {"model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "intermediate_size"}
    spec = spec_from_hf({k: v for k, v in DENSE_TEXT.items() if k in keep})
    # transformers' Qwen3_5TextConfig defaults: head_dim 256 (not hidden / heads), 32768 positions
    assert spec.head_dim == 256 and spec.max_position_embeddings == 32768
    assert spec.rotary_dim == 64 and spec.rope_theta == 10000.0  # partial_rotary_factor 0.25 by default
    assert spec.layer_types == (L, L, L, F)              # full_attention_interval 4 by default
    assert (spec.conv_kernel, spec.rms_norm_eps, spec.mtp_num_layers) == (4, 1e-6, 0)
    assert spec.tie_word_embeddings is False and spec.eos_token_ids == () and spec.dtype == "bfloat16"


# ------------------------------------------------------------------------------------------------
# Wrapper: what is inherited from the top level (ids, tie, dtype); transformers writes unset
# text_config fields as null and a tied wrapper as top-level true / text_config false.

INHERIT = {
    "eos_from_top_level": (dict(eos_token_id=_DROP), dict(eos_token_id=9), "eos_token_ids", (9,)),
    "eos_list_from_top_level": (dict(eos_token_id=_DROP), dict(eos_token_id=[9, 11]), "eos_token_ids", (9, 11)),
    "eos_null_in_text_config_inherits": (dict(eos_token_id=None), dict(eos_token_id=9), "eos_token_ids", (9,)),
    "eos_in_text_config_wins": (dict(eos_token_id=7), dict(eos_token_id=9), "eos_token_ids", (7,)),
    "bos_from_top_level": (dict(bos_token_id=None), dict(bos_token_id=3), "bos_token_id", 3),
    "pad_from_top_level": ({}, dict(pad_token_id=4), "pad_token_id", 4),
    "dtype_from_top_level": (dict(dtype=_DROP), dict(dtype="float32"), "dtype", "float32"),
    "tie_from_top_level": (dict(tie_word_embeddings=_DROP), dict(tie_word_embeddings=True),
                           "tie_word_embeddings", True),
    "tie_top_level_true_overrides_text_false": (dict(tie_word_embeddings=False), dict(tie_word_embeddings=True),
                                                "tie_word_embeddings", True),
    "tie_in_text_config_only": (dict(tie_word_embeddings=True), {}, "tie_word_embeddings", True),
    "tie_top_level_false_overrides_text_true": (dict(tie_word_embeddings=True), dict(tie_word_embeddings=False),
                                                "tie_word_embeddings", False),
    "untied_everywhere": (dict(tie_word_embeddings=_DROP), {}, "tie_word_embeddings", False),
}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("text_over,top,attr,expected", INHERIT.values(), ids=INHERIT.keys())
def test_wrapper_inherits_from_top_level(tmp_path, moe, text_over, top, attr, expected):
    model_dir, _ = write_config(tmp_path, wrapper(text(moe, **text_over), **top))
    assert getattr(load_spec(model_dir), attr) == expected


def test_text_only_config_ignores_nothing_from_a_missing_wrapper():
    spec = spec_from_hf(text(tie_word_embeddings=True, eos_token_id=[1, 2]))
    assert spec.tie_word_embeddings is True and spec.eos_token_ids == (1, 2)


# ------------------------------------------------------------------------------------------------
# layer_types: explicit, or from full_attention_interval (same rule as transformers)

LAYER_TYPES = {
    "explicit_list": (dict(layer_types=[F, L, L, F]), (F, L, L, F)),
    "explicit_all_linear": (dict(layer_types=[L] * 4), (L,) * 4),
    "explicit_list_wins_over_interval": (dict(layer_types=[F, L, L, L], full_attention_interval=2), (F, L, L, L)),
    "default_interval_4_eight_layers": (dict(layer_types=_DROP, num_hidden_layers=8), (L, L, L, F) * 2),
    "interval_2": (dict(layer_types=_DROP, full_attention_interval=2), (L, F, L, F)),
    "interval_1_all_full": (dict(layer_types=_DROP, full_attention_interval=1), (F,) * 4),
    "interval_5_longer_than_model": (dict(layer_types=_DROP, full_attention_interval=5), (L,) * 4),
    "layer_types_null_uses_interval": (dict(layer_types=None, full_attention_interval=2), (L, F, L, F)),
}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("over,expected", LAYER_TYPES.values(), ids=LAYER_TYPES.keys())
def test_layer_types(moe, over, expected):
    spec = spec_from_hf(text(moe, **over))
    assert spec.layer_types == expected
    assert spec.num_layers == len(expected)
    assert spec.full_attention_layers == tuple(i for i, t in enumerate(expected) if t == F)


# ------------------------------------------------------------------------------------------------
# Partial rotary: rope_parameters, or the legacy top-level rope_theta / partial_rotary_factor

ROPE_CASES = {
    "rope_parameters": (dict(rope_parameters=ROPE), 8, 1e7),
    "rope_parameters_half_rotary": (dict(rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                          "partial_rotary_factor": 0.5}), 16, 5e6),
    "rope_parameters_full_rotary": (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                          "partial_rotary_factor": 1.0}), 32, 1e6),
    "legacy_top_level_keys": (dict(rope_parameters=_DROP, rope_theta=5e6, partial_rotary_factor=0.5), 16, 5e6),
    "legacy_top_level_int_theta": (dict(rope_parameters=_DROP, rope_theta=1000000), 8, 1e6),
    "legacy_rope_scaling_default": (dict(rope_parameters=_DROP, rope_scaling={"type": "default"},
                                         rope_theta=2e6), 8, 2e6),
    "rope_parameters_without_factor_uses_top_level": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, partial_rotary_factor=0.5), 16, 1e6),
    "rope_parameters_key_wins_over_top_level": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
             rope_theta=3.0, partial_rotary_factor=1.0), 8, 1e6),
    "no_rope_keys_defaults": (dict(rope_parameters=_DROP), 8, 10000.0),
    "rope_parameters_null_defaults": (dict(rope_parameters=None), 8, 10000.0),
}


@pytest.mark.parametrize("over,rotary_dim,theta", ROPE_CASES.values(), ids=ROPE_CASES.keys())
def test_partial_rotary(over, rotary_dim, theta):
    spec = spec_from_hf(text(**over))
    assert (spec.rotary_dim, spec.rope_theta) == (rotary_dim, theta)
    assert isinstance(spec.rope_theta, float)


GDN_CASES = {
    "gva_ratio_1": (dict(linear_num_key_heads=4, linear_num_value_heads=4), (64, 64, 192, 1)),
    "gva_ratio_3": (dict(linear_num_key_heads=1, linear_num_value_heads=3), (16, 48, 80, 3)),
    "wide_value_heads": (dict(linear_value_head_dim=32), (32, 128, 192, 2)),
    "conv_kernel_2": (dict(linear_conv_kernel_dim=2), (32, 64, 128, 2)),
}


@pytest.mark.parametrize("over,dims", GDN_CASES.values(), ids=GDN_CASES.keys())
def test_gdn_dims(over, dims):
    spec = spec_from_hf(text(**over))
    assert (spec.linear_key_dim, spec.linear_value_dim, spec.conv_dim, spec.gva_ratio) == dims
    assert spec.conv_kernel == over.get("linear_conv_kernel_dim", 4)


def test_moe_without_shared_expert_is_accepted():
    spec = spec_from_hf(text(moe=True, shared_expert_intermediate_size=0))
    assert spec.is_moe and spec.shared_expert_intermediate_size == 0


# ------------------------------------------------------------------------------------------------
# Cross-check against transformers' own config classes (layer_types and rotary rules)

TRANSFORMERS_CASES = {
    "dense_explicit": text(),
    "dense_interval_2_legacy_rope": text(layer_types=_DROP, full_attention_interval=2, num_hidden_layers=6,
                                         rope_parameters=_DROP, rope_theta=5e6, partial_rotary_factor=0.5),
    "moe_default_interval": text(moe=True, layer_types=_DROP, num_hidden_layers=8),
    "moe_no_rope_keys": text(moe=True, rope_parameters=_DROP),
}


@pytest.mark.parametrize("raw", TRANSFORMERS_CASES.values(), ids=TRANSFORMERS_CASES.keys())
def test_matches_transformers_config(raw):
    cfg_mod = pytest.importorskip("transformers.models.qwen3_5_moe.configuration_qwen3_5_moe")
    dense_mod = pytest.importorskip("transformers.models.qwen3_5.configuration_qwen3_5")
    cls = cfg_mod.Qwen3_5MoeTextConfig if raw["model_type"] == "qwen3_5_moe_text" else dense_mod.Qwen3_5TextConfig
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "dtype", "mtp_num_hidden_layers",
                                                        "mtp_use_dedicated_embeddings", "output_gate_type",
                                                        "attn_output_gate", "decoder_sparse_step")}
    hf = cls(**kwargs)
    spec = spec_from_hf(raw)
    assert spec.layer_types == tuple(hf.layer_types)
    assert spec.head_dim == hf.head_dim
    assert spec.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert spec.rope_theta == hf.rope_parameters["rope_theta"]


# ------------------------------------------------------------------------------------------------
# Refusals: ConfigError naming the file, the field and the offending value


def _moe(**over):
    return text(moe=True, **over)


REFUSED = {
    # model type
    "unknown_model_type_llama": (text(model_type="llama"), "model_type", "'llama'"),
    "unknown_model_type_qwen3_next": (text(model_type="qwen3_next"), "model_type", "'qwen3_next'"),
    "unknown_model_type_qwen3_moe": (text(model_type="qwen3_moe"), "model_type", "'qwen3_moe'"),
    "vision_model_type_at_top_level": (text(model_type="qwen3_5_vision"), "model_type", "'qwen3_5_vision'"),
    "model_type_not_a_string": (text(model_type=35), "model_type", "35"),
    "missing_model_type": (text(model_type=_DROP), "model_type", "missing"),
    "wrapper_with_foreign_text_config": (wrapper(text(model_type="qwen3_5_moe_text"), model_type="qwen3_5"),
                                         "text_config.model_type", "'qwen3_5_moe_text'"),
    "wrapper_with_unknown_text_model_type": (wrapper(text(model_type="qwen3_next")),
                                             "text_config.model_type", "'qwen3_next'"),
    "wrapper_text_config_not_an_object": ({**wrapper(text()), "text_config": "qwen3_5_text"},
                                          "text_config", "'qwen3_5_text'"),
    "wrapper_without_text_config": ({**wrapper(text()), "text_config": None}, "text_config", "None"),
    # missing required fields
    "missing_hidden_size": (text(hidden_size=_DROP), "hidden_size", "missing"),
    "missing_num_hidden_layers": (text(num_hidden_layers=_DROP), "num_hidden_layers", "missing"),
    "missing_vocab_size": (text(vocab_size=_DROP), "vocab_size", "missing"),
    "missing_linear_key_head_dim": (text(linear_key_head_dim=_DROP), "linear_key_head_dim", "missing"),
    "missing_intermediate_size_dense": (text(intermediate_size=_DROP), "intermediate_size", "missing"),
    "missing_num_experts_moe": (_moe(num_experts=_DROP), "num_experts", "missing"),
    "missing_moe_intermediate_size": (_moe(moe_intermediate_size=_DROP), "moe_intermediate_size", "missing"),
    "missing_shared_expert_size": (_moe(shared_expert_intermediate_size=_DROP),
                                   "shared_expert_intermediate_size", "missing"),
    "missing_field_in_wrapper_names_text_config": (wrapper(text(hidden_size=_DROP)),
                                                   "text_config.hidden_size", "missing"),
    # wrong types
    "string_for_int": (text(hidden_size="64"), "hidden_size", "'64'"),
    "bool_for_int": (text(num_hidden_layers=True), "num_hidden_layers", "True"),
    "float_for_int": (text(head_dim=32.0), "head_dim", "32.0"),
    "list_for_int": (text(num_attention_heads=[4]), "num_attention_heads", "[4]"),
    "string_for_bool": (text(tie_word_embeddings="true"), "tie_word_embeddings", "'true'"),
    "string_for_bool_top_level": (wrapper(text(), tie_word_embeddings="yes"), "tie_word_embeddings", "'yes'"),
    "string_for_float": (text(rms_norm_eps="1e-6"), "rms_norm_eps", "'1e-6'"),
    "string_for_int_in_wrapper": (wrapper(text(vocab_size="256")), "text_config.vocab_size", "'256'"),
    "bool_for_int_moe": (_moe(num_experts_per_tok=True), "num_experts_per_tok", "True"),
    # out of range
    "zero_kv_heads": (text(num_key_value_heads=0), "num_key_value_heads", "0"),
    "negative_hidden_size": (text(hidden_size=-64), "hidden_size", "-64"),
    "zero_full_attention_interval": (text(layer_types=_DROP, full_attention_interval=0),
                                     "full_attention_interval", "0"),
    "string_full_attention_interval": (text(layer_types=_DROP, full_attention_interval="4"),
                                       "full_attention_interval", "'4'"),
    # layer_types
    "layer_types_too_short": (text(layer_types=[L, L, F]), "layer_types", "['linear_attention', 'linear_attention', "
                                                                         "'full_attention']"),
    "layer_types_too_long": (text(layer_types=[L, L, L, F, L]), "layer_types",
                             "'full_attention', 'linear_attention']"),
    "layer_types_not_a_list": (text(layer_types="full_attention"), "layer_types", "'full_attention'"),
    "layer_types_bad_entry": (text(layer_types=[L, L, "mamba", F]), "layer_types[2]", "'mamba'"),
    "layer_types_qwen3_next_spelling": (text(layer_types=[L, L, L, "attention"]), "layer_types[3]", "'attention'"),
    # head divisibility
    "heads_not_divisible_by_kv_heads": (text(num_key_value_heads=3), "num_attention_heads", "(3)"),
    "value_heads_not_divisible_by_key_heads": (text(linear_num_value_heads=3), "linear_num_value_heads", "(3)"),
    # MoE
    "top_k_exceeds_num_experts": (_moe(num_experts_per_tok=9), "num_experts_per_tok", "(9)"),
    "mlp_only_layers": (_moe(mlp_only_layers=[0]), "mlp_only_layers", "[0]"),
    "decoder_sparse_step_2": (_moe(decoder_sparse_step=2), "decoder_sparse_step", "2"),
    "zero_experts": (_moe(num_experts=0), "num_experts", "0"),
    # rope
    "rope_type_yarn": (text(rope_parameters={**ROPE, "rope_type": "yarn", "factor": 4.0}),
                       "rope_parameters.rope_type", "'yarn'"),
    "rope_type_linear": (text(rope_parameters={**ROPE, "rope_type": "linear"}), "rope_parameters.rope_type",
                         "'linear'"),
    "legacy_rope_scaling_yarn": (text(rope_parameters=_DROP, rope_scaling={"type": "yarn", "factor": 4.0}),
                                 "rope_scaling.type", "'yarn'"),
    "rope_parameters_not_an_object": (text(rope_parameters="default"), "rope_parameters", "'default'"),
    "yarn_rope_scaling_beside_default_rope_parameters": (text(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                                                         "rope_scaling.rope_type", "'yarn'"),
    "partial_rotary_factor_zero": (text(rope_parameters={**ROPE, "partial_rotary_factor": 0}),
                                   "rope_parameters.partial_rotary_factor", "0"),
    "partial_rotary_factor_above_one": (text(rope_parameters=_DROP, partial_rotary_factor=1.5),
                                        "partial_rotary_factor", "1.5"),
    "partial_rotary_factor_odd_dim": (text(rope_parameters={**ROPE, "partial_rotary_factor": 0.1}),
                                      "partial_rotary_factor", "0.1"),
    "rope_theta_negative": (text(rope_parameters={**ROPE, "rope_theta": -1.0}), "rope_parameters.rope_theta",
                            "-1.0"),
    "legacy_rope_theta_string": (text(rope_parameters=_DROP, rope_theta="1e7"), "rope_theta", "'1e7'"),
    # unsupported features
    "quantization_config_fp8_per_tensor": (text(quantization_config={"quant_method": "fp8", "fmt": "e4m3"}),
                                           "quantization_config.weight_block_size", "None"),
    "quantization_config_fp8_64_blocks": (text(quantization_config={"quant_method": "fp8",
                                                                    "weight_block_size": [64, 64]}),
                                          "quantization_config.weight_block_size", "[64, 64]"),
    "quantization_config_fp8_e5m2": (text(quantization_config={"quant_method": "fp8", "fmt": "e5m2",
                                                               "weight_block_size": [128, 128]}),
                                     "quantization_config.fmt", "'e5m2'"),
    "quantization_config_on_wrapper": (wrapper(text(), quantization_config={"quant_method": "modelopt"}),
                                       "quantization_config.quant_algo", "None"),
    "quantization_config_modelopt_int4": (text(quantization_config={"quant_method": "modelopt",
                                                                    "quant_algo": "W4A16_AWQ"}),
                                          "quantization_config.quant_algo", "'W4A16_AWQ'"),
    "quantization_config_ct_fp8_group": (text(quantization_config={
        "quant_method": "compressed-tensors", "config_groups": {"g": {"format": "float-quantized",
                                                                      "weights": {"num_bits": 8, "type": "float",
                                                                                  "strategy": "group"}}}}),
        "quantization_config.config_groups.weights.strategy", "'group'"),
    "quantization_config_modelopt_group_32": (text(quantization_config={"quant_method": "modelopt",
                                                                        "quant_algo": "NVFP4", "group_size": 32}),
                                              "quantization_config.group_size", "32"),
    "quantization_config_awq": (text(quantization_config={"quant_method": "awq", "bits": 4}),
                                "quantization_config.quant_method", "'awq'"),
    "quantization_config_ct_int4": (text(quantization_config={"quant_method": "compressed-tensors",
                                                              "format": "pack-quantized"}),
                                    "quantization_config.format", "'pack-quantized'"),
    "quantization_config_not_object": (text(quantization_config="fp8"), "quantization_config", "'fp8'"),
    "hidden_act_gelu": (text(hidden_act="gelu"), "hidden_act", "'gelu'"),
    "attention_bias_true": (text(attention_bias=True), "attention_bias", "true"),
    "attn_output_gate_false": (text(attn_output_gate=False), "attn_output_gate", "false"),
    "output_gate_type_sigmoid": (text(output_gate_type="sigmoid"), "output_gate_type", "'sigmoid'"),
    "mtp_dedicated_embeddings": (text(mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings", "true"),
    "mtp_num_hidden_layers_2": (text(mtp_num_hidden_layers=2), "mtp_num_hidden_layers", "2"),
    "mtp_num_hidden_layers_negative": (text(mtp_num_hidden_layers=-1), "mtp_num_hidden_layers", "-1"),
    "mtp_num_hidden_layers_2_in_wrapper": (wrapper(_moe(mtp_num_hidden_layers=2)),
                                           "text_config.mtp_num_hidden_layers", "2"),
    "dtype_float8": (text(dtype="float8_e4m3fn"), "dtype", "'float8_e4m3fn'"),
    "torch_dtype_int8": (text(dtype=_DROP, torch_dtype="int8"), "dtype", "'int8'"),
    # token ids
    "eos_outside_vocab": (text(eos_token_id=256), "eos_token_id", "256"),
    "eos_list_entry_outside_vocab": (text(eos_token_id=[7, 1000]), "eos_token_id", "1000"),
    "eos_string": (text(eos_token_id="</s>"), "eos_token_id", "'</s>'"),
    "eos_bool": (text(eos_token_id=True), "eos_token_id", "True"),
}


@pytest.mark.parametrize("raw,field,value", REFUSED.values(), ids=REFUSED.keys())
def test_refused_config_names_file_field_and_value(tmp_path, raw, field, value):
    model_dir, path = write_config(tmp_path, raw)
    with pytest.raises(ConfigError) as exc:
        load_spec(model_dir)
    msg = str(exc.value)
    assert path in msg, msg
    assert field in msg, msg
    assert value in msg, msg


UNREADABLE = {
    "invalid_json": ('{"model_type": "qwen3_5_text", ', "cannot parse"),
    "empty_file": ("", "cannot parse"),
    "not_utf8": (b"\xff\xfe\x00garbage", "cannot parse"),
    "top_level_list": (json.dumps([DENSE_TEXT]), "JSON object"),
    "top_level_string": (json.dumps("qwen3_5_text"), "JSON object"),
}


@pytest.mark.parametrize("content,words", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_unreadable_config_names_file(tmp_path, content, words):
    model_dir, path = write_config(tmp_path, content)
    with pytest.raises(ConfigError) as exc:
        load_spec(model_dir)
    assert path in str(exc.value) and words in str(exc.value)


def test_missing_config_json_names_path(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_spec(tmp_path)
    assert os.path.join(str(tmp_path), "config.json") in str(exc.value)
    assert "no config.json" in str(exc.value)


def test_config_that_is_a_directory_is_refused(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError) as exc:
        load_spec(tmp_path)
    assert str(tmp_path / "config.json") in str(exc.value)


@pytest.mark.parametrize("raw", [text(model_type="llama"), text(hidden_act="relu"), "{oops"],
                         ids=["unknown_model_type", "unsupported_value", "invalid_json"])
def test_bad_config_refused_before_weights_are_opened(tmp_path, monkeypatch, raw):
    """HybridModel.from_dir raises ConfigError before any checkpoint file is looked at."""
    import ranks.model
    import ranks.weights

    def no_checkpoint(*a, **k):
        raise AssertionError("the checkpoint was opened before the config was validated")

    monkeypatch.setattr(ranks.weights.Checkpoint, "__init__", no_checkpoint)
    model_dir, path = write_config(tmp_path, raw)
    with pytest.raises(ConfigError) as exc:
        ranks.model.HybridModel.from_dir(model_dir)
    assert path in str(exc.value)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError):
        spec_from_hf([])   # type: ignore[arg-type]
    assert isinstance(spec_from_hf(text()), ModelSpec)


def test_omitted_fields_read_as_transformers_reads_them():
    """A config without head_dim, max_position_embeddings, rope or layer-pattern fields: the spec takes
    the values transformers' own config class gives the same dict (an independent reading)."""
    cfg_mod = pytest.importorskip("transformers.models.qwen3_5.configuration_qwen3_5")
    keep = {"model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "intermediate_size"}
    raw = {k: v for k, v in DENSE_TEXT.items() if k in keep}
    spec = spec_from_hf(raw)
    hf = cfg_mod.Qwen3_5TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    rope = hf.rope_parameters
    assert spec.head_dim == hf.head_dim and spec.max_position_embeddings == hf.max_position_embeddings
    assert spec.rope_theta == rope["rope_theta"]
    assert spec.rotary_dim == int(hf.head_dim * rope["partial_rotary_factor"])
    assert list(spec.layer_types) == list(hf.layer_types)
    assert (spec.conv_kernel, spec.rms_norm_eps) == (hf.linear_conv_kernel_dim, hf.rms_norm_eps)



QUANT_CONFIGS = {
    "fp8_block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}, "fp8-block"),
    "modelopt_nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                        "exclude_modules": ["lm_head"]}, "nvfp4"),
    "modelopt_fp8": ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None}, "fp8"),
    "compressed_tensors_fp8_channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                            "num_bits": 8, "type": "float", "strategy": "channel"}}}}, "fp8"),
    "compressed_tensors_fp8_block": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                          "num_bits": 8, "type": "float", "strategy": "block",
                                          "block_structure": [128, 128]}}}}, "fp8-block"),
    "compressed_tensors_mixed": ({"quant_method": "compressed-tensors", "config_groups": {
        "a": {"format": "nvfp4-pack-quantized", "weights": {"num_bits": 4, "type": "float", "group_size": 16}},
        "b": {"format": "float-quantized", "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}},
        "mixed"),
    "compressed_tensors_nvfp4": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                  "config_groups": {"group_0": {"format": "nvfp4-pack-quantized", "targets": ["Linear"],
                                                                "weights": {"num_bits": 4, "type": "float",
                                                                            "group_size": 16}}}}, "nvfp4"),
}


@pytest.mark.parametrize("qc,kind", QUANT_CONFIGS.values(), ids=QUANT_CONFIGS.keys())
def test_pre_quantised_configs_name_their_format(tmp_path, qc, kind):
    """quantization_config of the three loadable formats, on the text config or the wrapper."""
    for raw in (text(quantization_config=qc), wrapper(text(), quantization_config=qc)):
        model_dir, _ = write_config(tmp_path, raw)
        assert load_spec(model_dir).quantization == kind
    model_dir, _ = write_config(tmp_path, text())
    assert load_spec(model_dir).quantization is None


def test_hf_quant_config_json_is_read_for_modelopt(tmp_path):
    """ModelOpt's older export: no quantization_config, an hf_quant_config.json beside config.json."""
    model_dir, path = write_config(tmp_path, text())
    with open(os.path.join(model_dir, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}, f)
    assert load_spec(model_dir).quantization == "nvfp4"
    with open(os.path.join(model_dir, "hf_quant_config.json"), "w") as f:
        json.dump({"quantization": {"quant_algo": "W4A16_AWQ"}}, f)
    with pytest.raises(ConfigError) as exc:
        load_spec(model_dir)
    assert "quant_algo" in str(exc.value) and "'W4A16_AWQ'" in str(exc.value)


@pytest.mark.parametrize("qc,kind", [QUANT_CONFIGS[k] for k in ("modelopt_nvfp4", "compressed_tensors_nvfp4")],
                         ids=["modelopt", "compressed_tensors"])
def test_wrapper_quantization_config_wins_over_a_null_one_in_text_config(tmp_path, qc, kind):
    """transformers serialises unset text_config fields as null: a text_config 'quantization_config: null'
    is absent, so the wrapper's quantization_config applies (it was dropped, and the quantised tensors
    were then refused as having no quantization_config)."""
    model_dir, _ = write_config(tmp_path, wrapper(text(quantization_config=None), quantization_config=qc))
    assert load_spec(model_dir).quantization == kind


@pytest.mark.parametrize("fmt,weights,kind", [
    ("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}, "nvfp4"),
    ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}, "fp8"),
    ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
     "fp8-block"),
], ids=["nvfp4", "fp8_channel", "fp8_block"])
def test_compressed_tensors_group_format_null_takes_the_top_level_format(tmp_path, fmt, weights, kind):
    """compressed-tensors writes a scheme's unset 'format' as null inside config_groups; the top-level
    'format' then applies to the group (as in vLLM), rather than the group being refused as format None.
    A null group format with no top-level one is still refused, naming the field."""
    group = {"targets": ["Linear"], "format": None, "weights": weights, "input_activations": None}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}}
    model_dir, _ = write_config(tmp_path, text(quantization_config=qc))
    assert load_spec(model_dir).quantization == kind
    model_dir, _ = write_config(tmp_path, text(quantization_config={**qc, "format": None}))
    with pytest.raises(ConfigError) as exc:
        load_spec(model_dir)
    assert "quantization_config.format" in str(exc.value) and "None" in str(exc.value), str(exc.value)
