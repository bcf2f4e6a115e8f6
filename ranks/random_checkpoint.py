"""Random Qwen3.5/3.6 checkpoints for tests and benchmarks: presets, weights, tokenizer, writer.

A random checkpoint is a model directory that loads like a real one (config.json, safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json) but holds seeded random weights:

- PRESETS: text configs (HF key names, as inside ``text_config``) from a tiny CPU model up to the
  exact shapes of Qwen3.5/3.6-27B and -35B-A3B (spec §1).
- iter_random_tensors / random_tensors: every tensor of ``expected_shapes(spec)`` (experts fused,
  MTP included), randomised as spec §6.1 advises so that no part of the forward is degenerate.
  Each tensor depends only on (seed, name, shape, dtype), never on generation order, and large
  tensors are generated in row blocks, so the full-size presets never need all weights in memory.
- build_tokenizer: a small byte-level BPE trained deterministically on stdlib source text, with the
  Qwen3.5 special and added tokens; its size never exceeds the config's vocab_size (like real
  Qwen, the embedding may have more rows than the tokenizer has ids).
- write_random_checkpoint: the directory in the official layout (multimodal wrapper config,
  ``model.language_model.`` prefix, fused experts) or the HF text-only layout (``model.`` prefix,
  per-expert tensors, what transformers' save_pretrained writes), shard by shard.

No transformers import here: transformers is only a test dependency.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch

from ranks.weights import INDEX_FILE, SINGLE_FILE, _disk_items, expected_shapes
from runtime.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec, spec_from_hf

# --------------------------------------------------------------------------------------------------
# Presets


def _layer_types(num_layers: int, interval: int = 4) -> list[str]:
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]


def _rope(head_dim: int, section: list[int], theta: float = 1e7) -> dict[str, Any]:
    assert sum(section) * 2 == int(head_dim * 0.25), "mrope_section must sum to rotary_dim / 2"
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
            "mrope_section": section, "mrope_interleaved": True}


_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "output_gate_type": "swish",
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
}

_TINY: dict[str, Any] = {
    **_COMMON,
    "model_type": "qwen3_5_text",
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "layer_types": _layer_types(8),
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 8192,
    "rope_parameters": _rope(32, [2, 1, 1]),
}

_MOE_TINY = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 48, "router_aux_loss_coef": 0.001, "output_router_logits": False}


def _moe(dense: dict[str, Any], **moe: Any) -> dict[str, Any]:
    out = {k: v for k, v in dense.items() if k != "intermediate_size"}
    out.update(model_type="qwen3_5_moe_text", **moe)
    return out


_SMALL: dict[str, Any] = {
    **_COMMON,
    "model_type": "qwen3_5_text",
    "vocab_size": 8192,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "layer_types": _layer_types(8),
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "intermediate_size": 1024,
    "max_position_embeddings": 8192,
    "rope_parameters": _rope(64, [3, 3, 2]),
}

# Exact text_config values of the released checkpoints (spec §1). Their bos/eos ids (248044) are
# rewritten to the ids of the small tokenizer by write_random_checkpoint.
_27B: dict[str, Any] = {
    **_COMMON,
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "layer_types": _layer_types(64),
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "intermediate_size": 17408,
    "max_position_embeddings": 262144,
    "rope_parameters": _rope(256, [11, 11, 10]),
    "bos_token_id": 248044,
    "eos_token_id": 248044,
    "dtype": "bfloat16",
}

_35B: dict[str, Any] = _moe({
    **_27B,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "layer_types": _layer_types(40),
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "linear_num_value_heads": 32,
}, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    router_aux_loss_coef=0.001, output_router_logits=False)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "tiny-moe": _moe(_TINY, **_MOE_TINY),
    "small": _SMALL,
    "27b": _27B,
    "35b-a3b": _35B,
}

# Vision configs written into the official-layout wrapper (tandem ignores them; no vision weights
# are written). The full-size presets get the released values, the small ones a token tower.
_VISION_FULL = {"model_type": "qwen3_5_vision", "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
                "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16,
                "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
                "initializer_range": 0.02}
_VISION_SMALL = {**_VISION_FULL, "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                 "num_position_embeddings": 64}
_FULL_SIZE_VOCAB = 248320


def text_config(preset_or_config: str | Mapping[str, Any], num_layers: int | None = None) -> dict[str, Any]:
    """A fresh copy of a preset (by name) or of a given text config, optionally with `num_layers`
    layers (widths kept; layer_types rebuilt with the config's full-attention interval)."""
    if isinstance(preset_or_config, str):
        if preset_or_config not in PRESETS:
            raise ValueError(f"unknown preset {preset_or_config!r}; choose from {', '.join(PRESETS)}")
        cfg = copy.deepcopy(PRESETS[preset_or_config])
    elif isinstance(preset_or_config, Mapping):
        cfg = copy.deepcopy(dict(preset_or_config))
        if "text_config" in cfg:                       # a wrapper config was passed: use its text part
            cfg = cfg["text_config"]
    else:
        raise TypeError(f"expected a preset name or a text-config dict, got {type(preset_or_config).__name__}")
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        interval = cfg.get("full_attention_interval")
        if interval is None and isinstance(cfg.get("layer_types"), list) and FULL_ATTENTION in cfg["layer_types"]:
            interval = cfg["layer_types"].index(FULL_ATTENTION) + 1
        cfg["num_hidden_layers"] = num_layers
        cfg["layer_types"] = _layer_types(num_layers, interval or 4)
    return cfg


def spec_for(preset_or_config: str | Mapping[str, Any] | ModelSpec, num_layers: int | None = None) -> ModelSpec:
    """The ModelSpec of a preset name or text config (validated exactly as config.json would be)."""
    if isinstance(preset_or_config, ModelSpec):
        return preset_or_config
    name = preset_or_config if isinstance(preset_or_config, str) else "<text config>"
    return spec_from_hf(text_config(preset_or_config, num_layers), source=f"<preset {name}>")


def param_counts(spec: ModelSpec) -> dict[str, int]:
    """Parameter counts from the shapes alone (nothing allocated): text (embed, layers, final norm,
    lm_head unless tied), mtp, and total."""
    text = mtp = 0
    for name, shape in expected_shapes(spec, fused_experts=True, include_mtp=True).items():
        if name.startswith("mtp."):
            mtp += math.prod(shape)
        else:
            text += math.prod(shape)
    return {"text": text, "mtp": mtp, "total": text + mtp}


# --------------------------------------------------------------------------------------------------
# Random weights

LINEAR_GAIN = 1.0         # linear weights ~ N(0, (gain / sqrt(fan_in))^2): unit-scale activations, gates vary
ROUTER_GAIN = 4.0         # MoE router: distinct expert preferences per token
LM_HEAD_GAIN = 3.0        # logits std ~3 over the vocab: peaked but finite softmax
NORM_STD = 0.3            # zero-centred norm weights (used as 1 + w) and the gated norm (1 + N(0, 0.3))
CONV_STD = 0.3
DT_BIAS_MEAN = -3.0       # GDN decay exp(-A * softplus(a + dt_bias)) spread over ~(0.01, 0.99): state is remembered
REFERENCE_DEPTH = 8        # deeper models scale the residual-branch outputs by sqrt(8 / layers) (GPT-2 style),
                           # so the total residual update, and the sensitivity to rounding, does not grow with depth
_RESIDUAL_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
_BLOCK_ELEMENTS = 1 << 24  # rows are generated in blocks of at most this many elements


@dataclass(frozen=True)
class Init:
    """How one tensor is drawn: ``normal`` gives mean + std * N(0,1); ``log_uniform`` gives log(U(low, high))."""
    kind: str
    mean: float = 0.0
    std: float = 1.0
    low: float = 0.0
    high: float = 1.0


def init_for(name: str, shape: tuple[int, ...], spec: ModelSpec) -> Init:
    """The distribution of tensor `name` (canonical name, see ranks.weights)."""
    if name.endswith("linear_attn.norm.weight"):
        return Init("normal", mean=1.0, std=NORM_STD)
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name in (
            "norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        return Init("normal", std=NORM_STD)
    if name.endswith("linear_attn.A_log"):
        return Init("log_uniform", low=1.0, high=16.0)
    if name.endswith("linear_attn.dt_bias"):
        return Init("normal", mean=DT_BIAS_MEAN, std=1.0)
    if name.endswith("linear_attn.conv1d.weight"):
        return Init("normal", std=CONV_STD)
    if name == "embed_tokens.weight":
        # untied: unit-scale inputs; tied: the same table is the lm_head, so scale it like one
        std = LM_HEAD_GAIN / math.sqrt(spec.hidden_size) if spec.tie_word_embeddings else 1.0
        return Init("normal", std=std)
    if name == "lm_head.weight":
        return Init("normal", std=LM_HEAD_GAIN / math.sqrt(spec.hidden_size))
    if name.endswith("mlp.gate.weight"):
        return Init("normal", std=ROUTER_GAIN / math.sqrt(shape[-1]))
    if len(shape) >= 2:
        std = LINEAR_GAIN / math.sqrt(shape[-1])
        if name.endswith(_RESIDUAL_OUTPUTS):
            std *= math.sqrt(REFERENCE_DEPTH / max(spec.num_layers, REFERENCE_DEPTH))
        return Init("normal", std=std)
    raise ValueError(f"no initialisation rule for tensor {name!r} {list(shape)}")


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def random_tensor(name: str, shape: tuple[int, ...], spec: ModelSpec, seed: int = 0,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Tensor `name` of a random checkpoint: drawn in float32 (row blocks of at most 2^24 elements,
    each with its own seed from (seed, name, block), generated in parallel threads), then cast to
    `dtype`. Depends only on its arguments, so a bfloat16 checkpoint is the float32 one rounded."""
    shape = tuple(shape)
    init = init_for(name, shape, spec)
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(1) if not shape else out
    rows = flat.shape[0]
    per_block = max(1, _BLOCK_ELEMENTS // max(1, math.prod(flat.shape[1:])))
    blocks = [(b, r0, min(rows, r0 + per_block)) for b, r0 in enumerate(range(0, rows, per_block))]

    def fill(block: tuple[int, int, int]) -> None:
        b, r0, r1 = block
        gen = torch.Generator().manual_seed(_block_seed(seed, name, b))
        bshape = (r1 - r0, *flat.shape[1:])
        if init.kind == "normal":
            blk = torch.randn(bshape, generator=gen, dtype=torch.float32)
            if init.std != 1.0:
                blk.mul_(init.std)
            if init.mean:
                blk.add_(init.mean)
        elif init.kind == "log_uniform":
            blk = torch.rand(bshape, generator=gen, dtype=torch.float32)
            blk = blk.mul_(init.high - init.low).add_(init.low).log_()
        else:
            raise ValueError(f"unknown init kind {init.kind!r}")
        flat[r0:r1] = blk

    if len(blocks) > 1 and _WORKERS > 1:
        list(_thread_pool().map(fill, blocks))
    else:
        for block in blocks:
            fill(block)
    return out


_WORKERS = min(8, os.cpu_count() or 1)
_POOL: ThreadPoolExecutor | None = None


def _thread_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="random-weights")
    return _POOL


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
             "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unsupported dtype {dtype!r}; use bfloat16, float16 or float32")
    return table[dtype]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype]


def iter_random_tensors(spec: ModelSpec, seed: int = 0, dtype: str | torch.dtype = torch.bfloat16,
                        names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (canonical name, tensor) for every tensor of ``expected_shapes(spec, fused_experts=True,
    include_mtp=True)`` in that (deterministic) order, or for `names` only, one at a time."""
    dt = _as_dtype(dtype)
    shapes = expected_shapes(spec, fused_experts=True, include_mtp=True)
    for name in (shapes if names is None else names):
        if name not in shapes:
            raise KeyError(f"tensor {name!r} is not part of this model")
        yield name, random_tensor(name, shapes[name], spec, seed, dt)


def random_tensors(spec: ModelSpec, seed: int = 0,
                   dtype: str | torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """All tensors at once (canonical names, experts fused, MTP included): for small models only."""
    return dict(iter_random_tensors(spec, seed, dtype))


# --------------------------------------------------------------------------------------------------
# Tokenizer

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
MAX_TOKENIZER_SIZE = 8192
# Qwen2/3/3.5 pre-tokenizer split pattern
_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CORPUS_MODULES = ("textwrap", "string", "json.decoder", "json.encoder", "difflib", "argparse", "collections",
                   "functools", "heapq", "bisect", "fractions", "calendar", "dataclasses", "enum", "shlex", "pprint")
_CORPUS_TEXT = """\
The quick brown fox jumps over the lazy dog. A serving runtime reads a model directory, loads the
weights shard by shard, and answers chat completion requests one token at a time.
User: What is the capital of France?
Assistant: The capital of France is Paris. It has been the capital for many centuries.
User: Write a function that returns the sum of a list of numbers.
Assistant: Here is a short Python function:
def total(numbers):
    return sum(numbers)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -1 42.
Unicode: café, naïve, Größe, señor, Ελληνικά, русский язык, 日本語のテキスト, 中文文本, 한국어, 😀🎉🚀❤️👍.
"""

CHAT_TEMPLATE = (   # basic ChatML with the Qwen3.5 thinking switch (the full template is not needed here)
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}"
    "{{- '<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _training_corpus() -> list[str]:
    """Deterministic training text (for a given Python version): stdlib sources plus a fixed paragraph."""
    texts = [_CORPUS_TEXT] * 4
    for mod in _CORPUS_MODULES:
        try:
            m = importlib.import_module(mod)
            try:
                texts.append(inspect.getsource(m))
            except (OSError, TypeError):          # stdlib shipped without sources: docstrings only
                texts.append(m.__doc__ or "")
        except ImportError:
            pass
    return texts


def tokenizer_size_for(vocab_size: int) -> int:
    """Ids the random tokenizer gets for a model of `vocab_size` rows: at most MAX_TOKENIZER_SIZE,
    leaving 1/64 of the rows unused (like real Qwen: 248320 rows, 248077 ids)."""
    n = min(vocab_size, MAX_TOKENIZER_SIZE)
    return n - n // 64


def build_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly ``vocab_size`` ids (fewer only if the corpus
    runs out of merges): trained on _training_corpus(), then the Qwen3.5 special tokens
    (<|endoftext|>, <|im_start|>, <|im_end|>) and added tokens (<tool_call>, ..., <think>, </think>)
    appended, in that order, after the BPE ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    n_added = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + n_added:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer "
                         f"(needs at least {len(alphabet) + n_added}: 256 bytes + {n_added} special tokens)")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_added, min_frequency=0, show_progress=False,
                                  initial_alphabet=alphabet, special_tokens=[])
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab_size
    return tok


def tokenizer_config(tok, template: str) -> dict[str, Any]:
    """tokenizer_config.json of a Qwen-style tokenizer: eos <|im_end|>, pad <|endoftext|>, the added
    tokens of `tok` (special or not) and `template` as the chat template."""
    added = [t for t in SPECIAL_TOKENS + ADDED_TOKENS if tok.token_to_id(t) is not None]
    decoder = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": t in SPECIAL_TOKENS}
               for t in sorted(added, key=tok.token_to_id)}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer(out_dir: str | os.PathLike, tok) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json (Qwen-style: eos <|im_end|>, pad <|endoftext|>,
    a basic ChatML chat_template); return the ids of the special and added tokens."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config(tok, CHAT_TEMPLATE))
    return ids


# --------------------------------------------------------------------------------------------------
# Writing a checkpoint directory


@dataclass
class WriteResult:
    out_dir: str
    spec: ModelSpec
    files: list[str]          # every file written, relative to out_dir
    num_params: int           # tensors written (experts counted once; MTP included)
    num_bytes: int            # safetensors payload bytes
    tokenizer_size: int


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _wrapper_config(text: dict[str, Any], is_moe: bool) -> dict[str, Any]:
    full = text["vocab_size"] >= _FULL_SIZE_VOCAB
    vision = dict(_VISION_FULL if full else _VISION_SMALL, out_hidden_size=text["hidden_size"])
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if is_moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if is_moe else "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
    }
    if full:
        cfg.update(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                   vision_end_token_id=248054)
    return cfg


def config_only_dir(preset_or_config: str | Mapping[str, Any], num_layers: int | None = None,
                    prefix: str = "tandem-bench-") -> tuple[str, dict[str, Any]]:
    """A new temporary model directory holding only the preset's config.json (what --random-weights
    needs); returns (directory, text config)."""
    import tempfile
    cfg = text_config(preset_or_config, num_layers=num_layers)
    d = tempfile.mkdtemp(prefix=prefix)
    _write_json(os.path.join(d, "config.json"), _wrapper_config(cfg, "num_experts" in cfg))
    return d, cfg


def _plan_shards(items: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in items:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)


def write_random_checkpoint(out_dir: str | os.PathLike, preset_or_text_config: str | Mapping[str, Any],
                            seed: int = 0, dtype: str | torch.dtype = "bfloat16", layout: str = "official",
                            num_layers: int | None = None, max_shard_bytes: int = 4 * 2**30,
                            progress: bool = True) -> WriteResult:
    """Write a complete random model directory and return what was written.

    layout "official": config.json is the multimodal wrapper (model_type qwen3_5 / qwen3_5_moe,
    text_config, a vision_config; no vision weights), tensors under ``model.language_model.``,
    experts fused. layout "hf": config.json is the text config alone (qwen3_5_text /
    qwen3_5_moe_text, architectures *ForCausalLM), tensors under ``model.``, experts per expert.
    Both include the MTP weights. The weights are generated shard by shard (at most
    `max_shard_bytes` each, plus one tensor), so memory stays bounded for the full-size presets.
    Existing model*.safetensors files and the shard index in `out_dir` are replaced.
    """
    if layout not in ("official", "hf"):
        raise ValueError(f"layout must be 'official' or 'hf', got {layout!r}")
    dt = _as_dtype(dtype)
    out_dir = os.fspath(out_dir)
    text = text_config(preset_or_text_config, num_layers)

    tok = build_tokenizer(tokenizer_size_for(int(text["vocab_size"])))
    os.makedirs(out_dir, exist_ok=True)
    ids = write_tokenizer(out_dir, tok)
    eot, im_end = ids[ENDOFTEXT], ids[IM_END]
    text.update(bos_token_id=eot, eos_token_id=eot, dtype=_dtype_name(dt))
    text.pop("torch_dtype", None)
    is_moe = text.get("model_type") == "qwen3_5_moe_text"
    spec = spec_from_hf(text, source=os.path.join(out_dir, "config.json"))   # validate before writing weights

    if layout == "official":
        config = _wrapper_config(text, is_moe)
        prefix, split = "model.language_model.", False
    else:
        config = dict(text, architectures=["Qwen3_5MoeForCausalLM" if is_moe else "Qwen3_5ForCausalLM"])
        prefix, split = "model.", True
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot,
        "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
    })

    for f in os.listdir(out_dir):                 # stale weights of an earlier write would shadow ours
        if f == INDEX_FILE or (f.startswith("model") and f.endswith(".safetensors")):
            os.remove(os.path.join(out_dir, f))

    shapes = expected_shapes(spec, fused_experts=True, include_mtp=True)
    elsize = torch.empty((), dtype=dt).element_size()
    sizes = [(name, math.prod(shape) * elsize) for name, shape in shapes.items()]
    total_bytes = sum(b for _, b in sizes)
    shards = _plan_shards(sizes, max_shard_bytes)
    weight_files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    files = write_shards(out_dir, spec, shards, weight_files, seed=seed, dtype=dt, prefix=prefix,
                         split_experts=split, progress=_progress_bar(total_bytes, os.path.basename(out_dir) or out_dir,
                                                                     progress and total_bytes > 256 * 2**20))
    files += ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    return WriteResult(out_dir=out_dir, spec=spec, files=files, num_params=param_counts(spec)["total"],
                       num_bytes=total_bytes, tokenizer_size=tok.get_vocab_size(with_added_tokens=True))


def write_shards(out_dir: str, spec: ModelSpec, shards: list[list[str]], weight_files: list[str], *, seed: int,
                 dtype: torch.dtype, prefix: str, split_experts: bool, progress=None) -> list[str]:
    """Generate and save the tensors of each shard in turn (names canonical; keys as ranks.weights.
    write_checkpoint names them); write the index when there is more than one shard."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    try:
        for names, fname in zip(shards, weight_files):
            data: dict[str, torch.Tensor] = {}
            for name, t in iter_random_tensors(spec, seed, dtype, names=names):
                for key, piece in _disk_items({name: t}, prefix, split_experts):
                    data[key] = piece.contiguous()
                    weight_map[key] = fname
                    total += piece.numel() * piece.element_size()
                if progress is not None:
                    progress.update(t.numel() * t.element_size())
            save_file(data, os.path.join(out_dir, fname), metadata={"format": "pt"})
            del data
    finally:
        if progress is not None:
            progress.close()
    files = list(weight_files)
    if len(weight_files) > 1:
        _write_json(os.path.join(out_dir, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
        files.append(INDEX_FILE)
    return files


# --------------------------------------------------------------------------------------------------
# Random weights straight on the device (benchmarks, `--random-weights`)


class _DeviceRandomSource:
    """Stands in for a Checkpoint in ranks.sharding.load_shard: `read` draws the requested slice
    on the device with init_for's distribution (seeded by (seed, name, slice)), so every rank
    builds only its shard and nothing touches the disk. Shards of different ranks are not slices
    of one common full tensor; for benchmarks and smoke runs that does not matter."""

    def __init__(self, spec: ModelSpec, device: str | torch.device, seed: int):
        self.spec, self.device, self.seed = spec, torch.device(device), seed
        self.shapes = expected_shapes(spec, fused_experts=True, include_mtp=True)
        self.tensors = dict(self.shapes)

    def read(self, name: str, rows=None, cols=None, dtype: torch.dtype | None = None, device=None,
             index: tuple[slice, ...] | None = None) -> torch.Tensor:
        full = self.shapes[name]
        index = tuple(index or ())
        shape = tuple(len(range(*sl.indices(n))) if i < len(index) else n
                      for i, (n, sl) in enumerate(zip(full, index + (slice(None),) * len(full))))
        init = init_for(name, full, self.spec)
        gen = torch.Generator(device=self.device).manual_seed(_block_seed(self.seed, f"{name}{index}", 0))
        dtype = dtype or torch.bfloat16
        if init.kind == "normal":
            t = torch.randn(shape, generator=gen, dtype=torch.float32, device=self.device)
            t.mul_(init.std).add_(init.mean)
        else:
            t = torch.rand(shape, generator=gen, dtype=torch.float32, device=self.device)
            t.mul_(init.high - init.low).add_(init.low).log_()
        return t.to(dtype)


def random_shard(spec: ModelSpec, rank: int = 0, tp: int = 1, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", seed: int = 0, progress=None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard of a random model of `spec`, generated on `device` (any size, no files);
    progress(done, total) as load_shard's."""
    from ranks.sharding import load_shard
    from ranks.weights import Layout
    src = _DeviceRandomSource(spec, device, seed)
    return load_shard(src, spec, rank, tp, dtype=dtype, device=device, progress=progress,
                      layout=Layout(has_mtp=bool(spec.mtp_num_layers), per_expert=frozenset()))
