"""Hugging Face config.json -> ModelSpec: the one description of a Qwen3.5/3.6 model.

Accepted model types: ``qwen3_5`` and ``qwen3_5_moe`` (the multimodal wrappers; their ``text_config``
is read, ``vision_config`` ignored), ``qwen3_5_text`` and ``qwen3_5_moe_text`` (text only).
Anything the runtime cannot execute faithfully is refused with a ConfigError that names the file,
the field and the value, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
PAGE_SIZE = 64          # tokens per KV page: shared by the coordinator's bookkeeping and the ranks' pools

_WRAPPER_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config.json that tandem cannot serve; the message names the file, field and value."""


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions and options of one text model; derived sizes are properties.

    Layer i is GatedDeltaNet when ``layer_types[i] == "linear_attention"`` and gated softmax
    attention when it is ``"full_attention"``. ``is_moe`` selects the sparse MoE FFN for every layer.
    """

    model_type: str                   # qwen3_5_text | qwen3_5_moe_text
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    # gated attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # gated deltanet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    # FFN
    intermediate_size: int            # dense MLP width (0 for MoE)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    mtp_num_layers: int = 0
    max_position_embeddings: int = 262144
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "bfloat16"           # the checkpoint's stored dtype
    # a pre-quantised checkpoint's linear weights (quantization_config): "fp8-block" (E4M3, 128x128
    # scales) or "nvfp4" (E2M1, E4M3 scale per 16, fp32 global); None for 16-bit checkpoints
    quantization: str | None = None
    source: str = field(default="<dict>", compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def q_width(self) -> int:
        """Width of the attention output (heads * head_dim); q_proj emits twice this (q | gate)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN short convolution: [q | k | v]."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def gqa_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def gva_ratio(self) -> int:
        """Value heads per key head in GDN layers (value head h reads key head h // ratio)."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    def tp_conflict(self, tp: int) -> str | None:
        """Why `tp` ranks cannot split this model (a dimension it does not divide), or None.

        The one rule for both sides: the coordinator checks it before spawning ranks, the ranks'
        sharding before slicing.
        """
        dims = {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "linear_num_key_heads": self.linear_num_key_heads,
                "linear_num_value_heads": self.linear_num_value_heads, "vocab_size": self.vocab_size}
        if self.is_moe:
            dims["moe_intermediate_size"] = self.moe_intermediate_size
            if self.shared_expert_intermediate_size:
                dims["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        else:
            dims["intermediate_size"] = self.intermediate_size
        for name, value in dims.items():
            if value % tp:
                return (f"tp {tp} does not divide {name} = {value} ({self.source}); "
                        "choose a tp that divides every head count and width")
        return None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


def load_spec(model_dir: str | os.PathLike) -> ModelSpec:
    """Read ``MODEL_DIR/config.json`` into a ModelSpec (ConfigError on anything unsupported)."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no config.json in the model directory")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse config.json: {e}") from e
    hf_quant = os.path.join(os.fspath(model_dir), "hf_quant_config.json")
    if isinstance(raw, dict) and os.path.isfile(hf_quant) and not _has_quantization(raw):
        # NVIDIA ModelOpt exports before quantization_config: {"quantization": {"quant_algo": ...}}
        try:
            with open(hf_quant, encoding="utf-8") as f:
                section = json.load(f).get("quantization")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ConfigError(f"{hf_quant}: cannot parse hf_quant_config.json: {e}") from e
        if section:
            raw = dict(raw, quantization_config={"quant_method": "modelopt", "quantization": section})
    return spec_from_hf(raw, source=path)


def _has_quantization(raw: dict) -> bool:
    text = raw.get("text_config")
    return bool(raw.get("quantization_config") or (isinstance(text, dict) and text.get("quantization_config")))


def spec_from_hf(raw: dict[str, Any], source: str = "<dict>") -> ModelSpec:
    """Build a ModelSpec from a parsed HF config (wrapper or text config)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: config must be a JSON object, got {type(raw).__name__}")
    r = _Reader(raw, source)
    model_type = r.get("model_type", str)
    top_tie = raw.get("tie_word_embeddings")
    if model_type in _WRAPPER_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: field 'text_config' must be an object for model_type "
                              f"{model_type!r}, got {text!r}")
        text = dict(text)
        text.setdefault("model_type", _WRAPPER_TYPES[model_type])
        # transformers serialises every text_config field, unset ones as null: null counts as absent
        for key in ("eos_token_id", "bos_token_id", "pad_token_id", "dtype", "torch_dtype"):
            if text.get(key) is None and raw.get(key) is not None:
                text[key] = raw[key]
        # The wrapper's own tie_word_embeddings is what Qwen3_5ForConditionalGeneration ties by (transformers
        # writes a tied wrapper as top-level true with text_config false), so it wins when present.
        if top_tie is not None:
            if not isinstance(top_tie, bool):
                raise ConfigError(f"{source}: field 'tie_word_embeddings' must be bool, got {top_tie!r}")
            if text.get("tie_word_embeddings") not in (None, top_tie):
                log.info("%s: top-level tie_word_embeddings=%r overrides text_config's %r", source, top_tie,
                         text["tie_word_embeddings"])
            text["tie_word_embeddings"] = top_tie
        # the wrapper's quantization_config applies unless text_config has its own (null counts as absent)
        if raw.get("quantization_config") is not None and text.get("quantization_config") is None:
            text["quantization_config"] = raw["quantization_config"]
        r = _Reader(text, source, prefix="text_config.")
        model_type = r.get("model_type", str)
        if model_type != _WRAPPER_TYPES[raw["model_type"]]:
            raise ConfigError(f"{source}: field 'text_config.model_type' is {model_type!r}; "
                              f"expected {_WRAPPER_TYPES[raw['model_type']]!r} inside {raw['model_type']!r}")
    if model_type not in _TEXT_TYPES:
        allowed = ", ".join(sorted(_TEXT_TYPES + tuple(_WRAPPER_TYPES)))
        raise ConfigError(f"{source}: unsupported model_type {model_type!r} (supported: {allowed})")
    is_moe = model_type == "qwen3_5_moe_text"

    quantization = _quantization(r.raw.get("quantization_config"), r.source)

    hidden = r.get("hidden_size", int, minimum=1)
    num_layers = r.get("num_hidden_layers", int, minimum=1)
    num_heads = r.get("num_attention_heads", int, minimum=1)
    num_kv = r.get("num_key_value_heads", int, minimum=1)
    # omitted fields take transformers' Qwen3.5 config defaults (head_dim 256, not hidden / heads;
    # max_position_embeddings 32768), so a config reads the same here as there
    head_dim = r.get("head_dim", int, minimum=2, default=256)
    if num_heads % num_kv:
        raise ConfigError(f"{r.source}: field '{r.prefix}num_attention_heads' ({num_heads}) must be a multiple "
                          f"of '{r.prefix}num_key_value_heads' ({num_kv})")
    hk = r.get("linear_num_key_heads", int, minimum=1)
    hv = r.get("linear_num_value_heads", int, minimum=1)
    if hv % hk:
        raise ConfigError(f"{r.source}: field '{r.prefix}linear_num_value_heads' ({hv}) must be a multiple "
                          f"of '{r.prefix}linear_num_key_heads' ({hk})")

    layer_types = raw_layer_types = r.raw.get("layer_types")
    if layer_types is None:
        interval = r.get("full_attention_interval", int, minimum=1, default=4)
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                       for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ConfigError(f"{r.source}: field '{r.prefix}layer_types' must be a list of {num_layers} entries "
                          f"(num_hidden_layers), got {raw_layer_types!r}")
    for i, t in enumerate(layer_types):
        if t not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise ConfigError(f"{r.source}: field '{r.prefix}layer_types[{i}]' is {t!r}; "
                              f"allowed: {LINEAR_ATTENTION!r}, {FULL_ATTENTION!r}")

    hidden_act = r.get("hidden_act", str, default="silu")
    if hidden_act != "silu":
        raise ConfigError(f"{r.source}: field '{r.prefix}hidden_act' is {hidden_act!r}; only 'silu' is supported")
    if r.get("attention_bias", bool, default=False):
        raise ConfigError(f"{r.source}: field '{r.prefix}attention_bias' is true; the Qwen3.5 family has no "
                          "attention bias and tandem does not support one")
    gate_type = r.get("output_gate_type", str, default="swish")
    if gate_type != "swish":
        raise ConfigError(f"{r.source}: field '{r.prefix}output_gate_type' is {gate_type!r}; only 'swish'")
    if not r.get("attn_output_gate", bool, default=True):
        raise ConfigError(f"{r.source}: field '{r.prefix}attn_output_gate' is false; only gated attention "
                          "is supported")
    if r.get("mtp_use_dedicated_embeddings", bool, default=False):
        raise ConfigError(f"{r.source}: field '{r.prefix}mtp_use_dedicated_embeddings' is true; the MTP layer "
                          "must share embed_tokens and lm_head")

    rotary_dim, theta = _rope(r, head_dim)

    dense_i = 0
    moe_kwargs: dict[str, int] = {}
    if is_moe:
        n_exp = r.get("num_experts", int, minimum=1)
        top_k = r.get("num_experts_per_tok", int, minimum=1)
        if top_k > n_exp:
            raise ConfigError(f"{r.source}: field '{r.prefix}num_experts_per_tok' ({top_k}) exceeds "
                              f"'{r.prefix}num_experts' ({n_exp})")
        for key in ("mlp_only_layers",):
            if r.raw.get(key):
                raise ConfigError(f"{r.source}: field '{r.prefix}{key}' is {r.raw[key]!r}; every layer of "
                                  "this family is sparse and dense layers inside a MoE model are not supported")
        step = r.get("decoder_sparse_step", int, default=1)
        if step != 1:
            raise ConfigError(f"{r.source}: field '{r.prefix}decoder_sparse_step' is {step}; only 1 is supported")
        moe_kwargs = dict(
            num_experts=n_exp,
            num_experts_per_tok=top_k,
            moe_intermediate_size=r.get("moe_intermediate_size", int, minimum=1),
            shared_expert_intermediate_size=r.get("shared_expert_intermediate_size", int, minimum=0),
        )
    else:
        dense_i = r.get("intermediate_size", int, minimum=1)

    dtype = r.raw.get("dtype", r.raw.get("torch_dtype", "bfloat16")) or "bfloat16"
    if dtype not in _SUPPORTED_DTYPES:
        raise ConfigError(f"{r.source}: field '{r.prefix}dtype' is {dtype!r}; allowed: {', '.join(_SUPPORTED_DTYPES)}")
    eos = r.raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    vocab = r.get("vocab_size", int, minimum=1)
    for t in eos_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
            raise ConfigError(f"{r.source}: field '{r.prefix}eos_token_id' is {eos!r}; expected a token id "
                              f"(or a list of ids) in [0, {vocab})")
    mtp = r.get("mtp_num_hidden_layers", int, minimum=0, default=0)
    if mtp > 1:
        raise ConfigError(f"{r.source}: field '{r.prefix}mtp_num_hidden_layers' is {mtp}; at most 1 is supported")

    return ModelSpec(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=tuple(layer_types),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=r.get("linear_key_head_dim", int, minimum=1),
        linear_value_head_dim=r.get("linear_value_head_dim", int, minimum=1),
        conv_kernel=r.get("linear_conv_kernel_dim", int, minimum=1, default=4),
        intermediate_size=dense_i,
        rms_norm_eps=r.get("rms_norm_eps", float, minimum=0.0, default=1e-6),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", bool, default=False)),
        mtp_num_layers=mtp,
        max_position_embeddings=r.get("max_position_embeddings", int, minimum=1, default=32768),
        bos_token_id=r.raw.get("bos_token_id") if isinstance(r.raw.get("bos_token_id"), int) else None,
        eos_token_ids=eos_ids,
        pad_token_id=r.raw.get("pad_token_id") if isinstance(r.raw.get("pad_token_id"), int) else None,
        dtype=dtype,
        quantization=quantization,
        source=source,
        **moe_kwargs,
    )


QUANT_METHODS = ("fp8 (block-scaled, weight_block_size [128, 128])", "modelopt (quant_algo NVFP4 or FP8)",
                 "compressed-tensors (format nvfp4-pack-quantized, or float-quantized 8-bit float weights with "
                 "the block, channel or tensor strategy)")


def _quantization(qc: Any, source: str) -> str | None:
    """The weight format of a pre-quantised checkpoint from its quantization_config (or the quantization
    section of ModelOpt's hf_quant_config.json): "fp8-block" (128x128 scales), "fp8" (a scale per row
    or per tensor), "nvfp4", "mixed" (compressed-tensors groups of several), or None when there is none.
    ConfigError naming the field for a method or layout tandem cannot load. Which tensors are quantised
    (and how) is read from the checkpoint itself (ranks/checkpoint_quant.py), not from the config's
    module lists."""
    if not qc:
        return None
    f = "quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: field '{f}' must be an object, got {qc!r}")
    method = qc.get("quant_method")
    supported = "supported: " + "; ".join(QUANT_METHODS)
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"{source}: field '{f}.fmt' is {fmt!r}; only 'e4m3' fp8 weights load")
        block = qc.get("weight_block_size")
        if block != [128, 128]:
            raise ConfigError(f"{source}: field '{f}.weight_block_size' is {block!r}; only block-scaled fp8 "
                              "checkpoints with [128, 128] blocks load with quant_method 'fp8'")
        return "fp8-block"
    if method == "modelopt":
        section = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        algo = section.get("quant_algo")
        if algo == "FP8":
            return "fp8"
        if algo != "NVFP4":
            raise ConfigError(f"{source}: field '{f}.quant_algo' is {algo!r}; only ModelOpt 'NVFP4' and 'FP8' "
                              f"checkpoints load ({supported})")
        group = section.get("group_size", 16)
        if group != 16:
            raise ConfigError(f"{source}: field '{f}.group_size' is {group!r}; NVFP4 scales groups of 16")
        return "nvfp4"
    if method == "compressed-tensors":
        groups = qc.get("config_groups")
        groups = [g for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
        kinds = set()
        for g in groups or [{}]:
            fmt = g.get("format") or qc.get("format")        # a group's null format is the top-level one
            weights = g.get("weights") if isinstance(g.get("weights"), dict) else {}
            if fmt == "nvfp4-pack-quantized":
                kinds.add("nvfp4")
            elif fmt == "float-quantized" and weights.get("num_bits", 8) == 8 and weights.get("type", "float") == "float":
                strategy = weights.get("strategy", "tensor")
                if strategy not in ("block", "channel", "tensor"):
                    raise ConfigError(f"{source}: field '{f}.config_groups.weights.strategy' is {strategy!r}; "
                                      "8-bit float weights load with the block, channel or tensor strategy")
                if strategy == "block" and weights.get("block_structure", [128, 128]) != [128, 128]:
                    raise ConfigError(f"{source}: field '{f}.config_groups.weights.block_structure' is "
                                      f"{weights.get('block_structure')!r}; only [128, 128] blocks load")
                kinds.add("fp8-block" if strategy == "block" else "fp8")
            else:
                raise ConfigError(f"{source}: field '{f}.format' is {fmt!r}; only compressed-tensors "
                                  f"'nvfp4-pack-quantized' and 8-bit 'float-quantized' checkpoints load ({supported})")
        return kinds.pop() if len(kinds) == 1 else "mixed"
    raise ConfigError(f"{source}: field '{f}.quant_method' is {method!r}; {supported}; or a 16-bit checkpoint "
                      "(quantised on load with --weights)")


def _rope(r: "_Reader", head_dim: int) -> tuple[int, float]:
    """Rotary dimension and theta from rope_parameters (or the legacy rope_theta / rope_scaling keys)."""
    key = "rope_parameters"
    params = r.raw.get(key)
    legacy = r.raw.get("rope_scaling")
    if params is None:
        key, params = "rope_scaling", legacy or {}      # legacy name
    elif isinstance(legacy, dict) and legacy.get("rope_type", legacy.get("type", "default")) != "default":
        # both given: transformers lets the legacy rope_scaling win, so a scaled rope there must not be
        # silently replaced by rope_parameters' default one
        kind = legacy.get("rope_type", legacy.get("type"))
        raise ConfigError(f"{r.source}: field '{r.prefix}rope_scaling.rope_type' is {kind!r}; only 'default' "
                          "is supported")
    if not isinstance(params, dict):
        raise ConfigError(f"{r.source}: field '{r.prefix}{key}' must be an object, got {params!r}")

    def pick(name: str, default: Any) -> tuple[str, Any]:
        """(field name as written in the file, value): inside the rope dict, else top level, else default."""
        if name in params:
            return f"{r.prefix}{key}.{name}", params[name]
        if name in r.raw:
            return f"{r.prefix}{name}", r.raw[name]
        return f"{r.prefix}{key}.{name}", default

    type_field = f"{r.prefix}{key}." + ("type" if "type" in params and "rope_type" not in params else "rope_type")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{r.source}: field '{type_field}' is {rope_type!r}; only 'default' is supported")
    theta_field, theta = pick("rope_theta", 10000.0)
    factor_field, factor = pick("partial_rotary_factor", 0.25)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{r.source}: field '{theta_field}' is {theta!r}; expected a positive number")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise ConfigError(f"{r.source}: field '{factor_field}' is {factor!r}; expected a number in (0, 1]")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"{r.source}: head_dim {head_dim} x partial_rotary_factor {factor} gives rotary "
                          f"dimension {rotary_dim}; it must be even and >= 2")
    return rotary_dim, float(theta)


class _Reader:
    """Typed access to one config dict with errors that name the field."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = ""):
        self.raw, self.source, self.prefix = raw, source, prefix

    _MISSING = object()

    def get(self, key: str, typ: type, minimum: float | None = None, default: Any = _MISSING) -> Any:
        name = f"{self.prefix}{key}"
        if key not in self.raw or self.raw[key] is None:
            if default is _Reader._MISSING:
                raise ConfigError(f"{self.source}: required field '{name}' is missing")
            return default
        value = self.raw[key]
        ok = isinstance(value, typ) and not (typ is not bool and isinstance(value, bool))
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"{self.source}: field '{name}' must be {typ.__name__}, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{self.source}: field '{name}' is {value!r}; it must be >= {minimum}")
        return value
