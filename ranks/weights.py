"""Safetensors checkpoints: lazy per-tensor (and per-slice) reads, validation, writing.

Names are canonicalised on open: ``model.language_model.X`` and ``model.X`` become ``X``
(``layers.3.self_attn.q_proj.weight``, ``embed_tokens.weight``, ``norm.weight``); ``lm_head.weight``
and ``mtp.*`` keep their names; ``model.visual.*`` (the vision tower) is ignored.

MoE experts are accepted fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj
[E, H, I]``, the official on-disk form) or per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``,
what transformers' save_pretrained writes); ``load_weights`` always returns the fused form.

Every header is parsed and checked against the file size before anything is read, and
``validate`` compares the whole tensor set with what the ModelSpec implies, so a bad checkpoint is
refused with one message that names the file and the tensor before any model is built.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from runtime.config import FULL_ATTENTION, ModelSpec

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype tag -> (torch dtype, bytes per element)
_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
    "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
    "U16": (torch.uint16, 2), "U32": (torch.uint32, 4), "U64": (torch.uint64, 8),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
}
_FLOAT_TAGS = ("F32", "F16", "BF16")
_TORCH_TO_TAG = {v[0]: k for k, v in _DTYPES.items()}

_VISION_PREFIXES = ("model.visual.", "visual.")
_TEXT_PREFIXES = ("model.language_model.", "model.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    file: str          # absolute path of the .safetensors file
    key: str           # the name inside that file
    dtype: str         # safetensors tag (BF16, F32, ...)
    shape: tuple[int, ...]
    offset: int = 0    # byte offset of the tensor's data in the file


def canonical_name(key: str) -> str | None:
    """The tandem name of a checkpoint key, or None for tensors tandem ignores (vision tower)."""
    if key.startswith(_VISION_PREFIXES):
        return None
    for prefix in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header against the file size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors header (header length {n} bytes, "
                                      f"file {size} bytes)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not an object)")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        if key == "__metadata__":
            # the safetensors library refuses anything but a string -> string map when it opens the file
            if not isinstance(entry, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in entry.items()):
                raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ must map strings to "
                                      f"strings, got {json.dumps(entry)[:200]}")
            continue
        try:
            tag, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {key!r}: malformed header entry {entry!r}") from e
        if not all(_is_uint(d) for d in shape) or not (_is_uint(begin) and _is_uint(end)):
            raise CheckpointError(f"{path}: tensor {key!r}: malformed header entry {entry!r} (shape and "
                                  "data_offsets must be non-negative integers)")
        if tag not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {key!r}: unknown dtype {tag!r}")
        nbytes = math.prod(shape) * _DTYPES[tag][1]
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(f"{path}: tensor {key!r}: data offsets [{begin}, {end}) do not hold "
                                  f"{tag} {list(shape)} ({nbytes} bytes)")
        if end > data_size:
            raise CheckpointError(f"{path}: truncated: tensor {key!r} ends at byte {end} of the data "
                                  f"section but the file holds only {data_size}")
        out[key] = TensorInfo(path, key, tag, shape, 8 + n + begin)
        spans.append((begin, end, key))
    # safetensors requires the tensors to tile the data section exactly; check it here so that a gap,
    # an overlap or stray trailing bytes are refused before any tensor is read (not halfway through a load)
    pos = 0
    for begin, end, key in sorted(spans):
        if begin != pos:
            raise CheckpointError(f"{path}: corrupt safetensors file: tensor {key!r} starts at byte {begin} of the "
                                  f"data section, expected {pos} (overlapping or non-contiguous tensors)")
        pos = end
    if pos != data_size:
        raise CheckpointError(f"{path}: corrupt safetensors file: {data_size - pos} stray bytes after the last "
                              f"tensor (data section {data_size} bytes, tensors end at {pos})")
    return out


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class Checkpoint:
    """The tensors of one model directory (single file, sharded index, or loose shards), read lazily."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = os.path.abspath(os.fspath(model_dir))
        self.tensors: dict[str, TensorInfo] = {}
        self.ignored: list[str] = []
        for path in self._files():
            for key, info in read_header(path).items():
                name = canonical_name(key)
                if name is None:
                    self.ignored.append(key)
                    continue
                if name in self.tensors:
                    other = self.tensors[name]
                    raise CheckpointError(f"{path}: tensor {key!r} duplicates {other.key!r} in {other.file}")
                self.tensors[name] = info
        self._handles: dict[str, object] = {}
        if self.ignored:
            log.info("ignoring %d vision tensors in %s", len(self.ignored), self.dir)

    def _files(self) -> list[str]:
        index = os.path.join(self.dir, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: cannot parse the shard index: {e}") from e
            paths = [os.path.join(self.dir, f) for f in files]
            for p in paths:
                if not os.path.isfile(p):
                    raise CheckpointError(f"{index}: names shard {os.path.basename(p)!r}, which is missing")
            if SINGLE_FILE not in files and os.path.isfile(os.path.join(self.dir, SINGLE_FILE)):
                # transformers loads model.safetensors first, other loaders the index: one of them is stale
                raise CheckpointError(f"{self.dir}: holds both {SINGLE_FILE} and {INDEX_FILE}, which does not name "
                                      f"it; transformers would load {SINGLE_FILE}, other loaders the index's "
                                      "shards: remove the stale one")
            return paths
        single = os.path.join(self.dir, SINGLE_FILE)
        if os.path.isfile(single):
            return [single]
        loose = sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors")) if os.path.isdir(
            self.dir) else []
        if not loose:
            raise CheckpointError(f"{self.dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
        return [os.path.join(self.dir, f) for f in loose]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None,
             dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
             index: tuple[slice, ...] | None = None, align: bool = True) -> torch.Tensor:
        """One tensor, or a slice of it, as a torch tensor.

        `rows` / `cols` slice the first two axes; `index` (a tuple of slices, one per leading axis)
        is the general form. Only the selected bytes are read from the file. align: a CPU tensor
        whose data does not start on 64 bytes is copied to one that does (CPU matmul rounding depends
        on alignment); False where the tensor is only copied on (to a device).
        """
        if index is not None:
            if rows is not None or cols is not None:
                raise ValueError("give either index or rows/cols, not both")
            padded = tuple(index) + (None, None)
            rows, cols, rest = padded[0], padded[1], tuple(index[2:])
        else:
            rest = ()
        from safetensors import SafetensorError, safe_open

        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        try:
            handle = self._handles.get(info.file)
            if handle is None:
                handle = self._handles[info.file] = safe_open(info.file, framework="pt")
            if rows is None and cols is None and not rest:
                t = handle.get_tensor(info.key)
            else:
                sl = handle.get_slice(info.key)
                full = (rows or slice(None),) + ((cols or slice(None),) + rest if cols is not None or rest else ())
                t = sl[full]
        except SafetensorError as e:
            raise CheckpointError(f"{info.file}: tensor {info.key!r}: {e}") from e
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        if align and t.data_ptr() % 64:
            t = t.clone()   # CPU matmul rounding depends on alignment: make results independent of file offsets
        return t.to(device) if str(device) != "cpu" else t


# --------------------------------------------------------------------------------------------------
# What a spec implies


def expected_shapes(spec: ModelSpec, fused_experts: bool = True,
                    include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Canonical tensor name -> shape for a checkpoint of `spec` (experts fused or per expert)."""
    E = spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (spec.vocab_size, E), "norm.weight": (E,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, E)
    for i, kind in enumerate(spec.layer_types):
        p = f"layers.{i}."
        if kind == FULL_ATTENTION:
            out.update(_attention_shapes(spec, p))
        else:
            out.update({
                p + "linear_attn.in_proj_qkv.weight": (spec.conv_dim, E),
                p + "linear_attn.in_proj_z.weight": (spec.linear_value_dim, E),
                p + "linear_attn.in_proj_b.weight": (spec.linear_num_value_heads, E),
                p + "linear_attn.in_proj_a.weight": (spec.linear_num_value_heads, E),
                p + "linear_attn.conv1d.weight": (spec.conv_dim, 1, spec.conv_kernel),
                p + "linear_attn.A_log": (spec.linear_num_value_heads,),
                p + "linear_attn.dt_bias": (spec.linear_num_value_heads,),
                p + "linear_attn.norm.weight": (spec.linear_value_head_dim,),
                p + "linear_attn.out_proj.weight": (E, spec.linear_value_dim),
            })
        out.update(_ffn_shapes(spec, p, fused_experts))
    if include_mtp and spec.mtp_num_layers:
        out.update({
            "mtp.fc.weight": (E, 2 * E),
            "mtp.pre_fc_norm_embedding.weight": (E,),
            "mtp.pre_fc_norm_hidden.weight": (E,),
            "mtp.norm.weight": (E,),
        })
        for j in range(spec.mtp_num_layers):
            p = f"mtp.layers.{j}."
            out.update(_attention_shapes(spec, p))
            out.update(_ffn_shapes(spec, p, fused_experts))
    return out


def _attention_shapes(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    E = spec.hidden_size
    return {
        p + "self_attn.q_proj.weight": (2 * spec.q_width, E),
        p + "self_attn.k_proj.weight": (spec.kv_width, E),
        p + "self_attn.v_proj.weight": (spec.kv_width, E),
        p + "self_attn.o_proj.weight": (E, spec.q_width),
        p + "self_attn.q_norm.weight": (spec.head_dim,),
        p + "self_attn.k_norm.weight": (spec.head_dim,),
    }


def _ffn_shapes(spec: ModelSpec, p: str, fused: bool) -> dict[str, tuple[int, ...]]:
    E = spec.hidden_size
    out = {p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,)}
    if not spec.is_moe:
        I = spec.intermediate_size
        out.update({p + "mlp.gate_proj.weight": (I, E), p + "mlp.up_proj.weight": (I, E),
                    p + "mlp.down_proj.weight": (E, I)})
        return out
    X, I, S = spec.num_experts, spec.moe_intermediate_size, spec.shared_expert_intermediate_size
    out[p + "mlp.gate.weight"] = (X, E)
    if fused:
        out[p + "mlp.experts.gate_up_proj"] = (X, 2 * I, E)
        out[p + "mlp.experts.down_proj"] = (X, E, I)
    else:
        for e in range(X):
            q = f"{p}mlp.experts.{e}."
            out.update({q + "gate_proj.weight": (I, E), q + "up_proj.weight": (I, E), q + "down_proj.weight": (E, I)})
    if S:
        out.update({p + "mlp.shared_expert.gate_proj.weight": (S, E), p + "mlp.shared_expert.up_proj.weight": (S, E),
                    p + "mlp.shared_expert.down_proj.weight": (E, S), p + "mlp.shared_expert_gate.weight": (1, E)})
    return out


def _moe_prefixes(spec: ModelSpec, with_mtp: bool) -> list[str]:
    if not spec.is_moe:
        return []
    ps = [f"layers.{i}.mlp.experts." for i in range(spec.num_layers)]
    if with_mtp:
        ps += [f"mtp.layers.{j}.mlp.experts." for j in range(spec.mtp_num_layers)]
    return ps


@dataclass(frozen=True)
class Layout:
    """What validate() found: which experts are stored per expert, whether MTP weights are present,
    which linear weights are stored quantised."""
    has_mtp: bool
    per_expert: frozenset[str]     # expert prefixes stored per expert (others are fused)
    ignored: frozenset[str] = frozenset()    # accepted, never loaded (a zero-width shared expert)
    # logical weight name -> ranks.checkpoint_quant.QuantTensor (pre-quantised checkpoints)
    quantised: Mapping = field(default_factory=dict, compare=False)


def validate(ckpt: Checkpoint, spec: ModelSpec) -> Layout:
    """Check names, shapes and dtypes of every tensor against `spec`; raise CheckpointError on the first
    problem (naming the file and tensor), return the layout found."""
    from ranks import checkpoint_quant as CQ
    quant, stored = CQ.find(ckpt.tensors)
    _check_quantisation(ckpt, spec, quant)
    unused = {n for n in ckpt.tensors if CQ.is_unused(n)} if quant else set()
    if unused:
        log.info("%s: %d activation / KV-cache scales are not used (activations and KV stay 16-bit)",
                 ckpt.dir, len(unused))
    names = (set(ckpt.tensors) - stored - unused) | set(quant)
    mtp_names = {n for n in names if n.startswith("mtp.")}
    has_mtp = bool(spec.mtp_num_layers and mtp_names)
    if spec.mtp_num_layers and not mtp_names:
        log.warning("%s: config has mtp_num_hidden_layers=%d but the checkpoint has no mtp.* tensors "
                    "(transformers' save_pretrained drops them); MTP speculation is unavailable",
                    ckpt.dir, spec.mtp_num_layers)
    if not spec.mtp_num_layers and mtp_names:
        n = sorted(mtp_names)[0]
        raise CheckpointError(f"{ckpt.tensors[n].file}: tensor {ckpt.tensors[n].key!r} is an MTP weight but "
                              f"{spec.source} sets no mtp_num_hidden_layers")
    expected = expected_shapes(spec, fused_experts=True, include_mtp=has_mtp)
    per_expert: set[str] = set()
    for prefix in _moe_prefixes(spec, has_mtp):
        if any(n.startswith(prefix) and n[len(prefix):len(prefix) + 1].isdigit() for n in names):
            per_expert.add(prefix)
            layer_p = prefix[: -len("mlp.experts.")]
            del expected[prefix + "gate_up_proj"], expected[prefix + "down_proj"]
            for name, shape in _ffn_shapes(spec, layer_p, fused=False).items():
                if name.startswith(prefix):
                    expected[name] = shape
    if spec.tie_word_embeddings and "lm_head.weight" in names:
        expected["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)   # accepted, not used
        log.warning("%s: config.json ties the word embeddings (tie_word_embeddings) but the checkpoint also holds "
                    "lm_head.weight; the head is embed_tokens and the stored lm_head.weight is not used (set "
                    "tie_word_embeddings false to use it)", ckpt.dir)
    ignored: set[str] = set()
    if spec.is_moe and not spec.shared_expert_intermediate_size:
        # shared_expert_intermediate_size 0: transformers' save_pretrained writes the branch anyway, as
        # zero-width projections and a [1, E] gate; it adds nothing, so they are accepted, not loaded
        E = spec.hidden_size
        zero = {"mlp.shared_expert.gate_proj.weight": (0, E), "mlp.shared_expert.up_proj.weight": (0, E),
                "mlp.shared_expert.down_proj.weight": (E, 0), "mlp.shared_expert_gate.weight": (1, E)}
        for prefix in _moe_prefixes(spec, has_mtp):
            layer_p = prefix[: -len("mlp.experts.")]
            present = [layer_p + k for k in zero if layer_p + k in names]
            if present:                         # all four or none: a partial set is reported missing
                for k, shape in zero.items():
                    expected[layer_p + k] = shape
                    ignored.add(layer_p + k)

    missing = sorted(set(expected) - names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{ckpt.dir}: tensor {missing[0]!r} is missing{more}; the config "
                              f"({spec.source}) implies it")
    extra = sorted(names - set(expected))
    if extra:
        info = ckpt.tensors[quant[extra[0]].data if extra[0] in quant else extra[0]]
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{info.file}: unexpected tensor {info.key!r}{more}: the config "
                              f"({spec.source}) has no place for it")
    for name in sorted(unused):             # accepted unused, but only beside what they scale
        base = name.rsplit(".", 1)[0]
        kv = name.endswith((".k_scale", ".v_scale"))
        if base + ".weight" in expected or (kv and base.removesuffix(".attn") + ".q_proj.weight" in expected):
            continue
        info = ckpt.tensors[name]
        raise CheckpointError(f"{info.file}: unexpected tensor {info.key!r}: an activation / KV-cache scale, but "
                              f"the config ({spec.source}) has no {'attention layer' if kv else 'weight'} "
                              f"{base!r} for it")
    for name in sorted(expected):
        q = quant.get(name)
        if q is not None:
            if q.shape != expected[name]:
                info = ckpt.tensors[q.data]
                raise CheckpointError(f"{info.file}: tensor {info.key!r} holds a quantised weight of shape "
                                      f"{list(q.shape)} but the config ({spec.source}) implies {list(expected[name])}")
            continue
        info = ckpt.tensors[name]
        if info.shape != expected[name]:
            raise CheckpointError(f"{info.file}: tensor {info.key!r} has shape {list(info.shape)} but the "
                                  f"config ({spec.source}) implies {list(expected[name])}")
        if info.dtype not in _FLOAT_TAGS:
            raise CheckpointError(f"{info.file}: tensor {info.key!r} has dtype {info.dtype}; expected one of "
                                  f"{', '.join(_FLOAT_TAGS)}, or a quantised 2-D weight stored with its scales "
                                  "(fp8 weight_scale_inv, ModelOpt weight_scale / weight_scale_2, "
                                  "compressed-tensors weight_packed)")
    return Layout(has_mtp=has_mtp, per_expert=frozenset(per_expert), ignored=frozenset(ignored),
                  quantised={n: q for n, q in quant.items() if n in expected})


def _check_quantisation(ckpt: Checkpoint, spec: ModelSpec, quant: Mapping) -> None:
    """The quantised tensors and the config's quantization_config agree."""
    from ranks.checkpoint_quant import SPEC_KIND
    if quant and spec.quantization is None:
        q = next(iter(quant.values()))
        info = ckpt.tensors[q.data]
        raise CheckpointError(f"{info.file}: tensor {info.key!r} is stored quantised ({q.fmt}) but the config "
                              f"({spec.source}) has no quantization_config")
    family = {"fp8-block": "fp8", "fp8": "fp8", "nvfp4": "nvfp4"}     # a one-tile weight's scale reads as either fp8
    for q in quant.values():
        if spec.quantization != "mixed" and family[SPEC_KIND[q.kind]] != family[spec.quantization]:
            info = ckpt.tensors[q.data]
            raise CheckpointError(f"{info.file}: tensor {info.key!r} is stored as {SPEC_KIND[q.kind]} ({q.fmt}) "
                                  f"but the config's quantization_config ({spec.source}) says {spec.quantization}")
    if spec.quantization and not quant:
        log.warning("%s: the config has a quantization_config (%s) but no tensor is stored quantised; "
                    "loading the 16-bit tensors", ckpt.dir, spec.quantization)


def load_weights(ckpt: Checkpoint, spec: ModelSpec, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", keep_quantised: bool = False,
                 progress=None) -> dict[str, torch.Tensor]:
    """Validate, then read every tensor in `dtype`; experts come back fused, tied lm_head omitted.
    A pre-quantised checkpoint's weights are dequantised, or with `keep_quantised` (the CUDA backend)
    the ones its kernels read quantised come back as QuantWeight (ranks/checkpoint_quant.py). A
    device other than the CPU, or a progress(done, total) callback, loads through load_shard (tp 1):
    pinned staging, progress (ranks/upload.py)."""
    layout = validate(ckpt, spec)
    if layout.quantised or str(device) != "cpu" or progress is not None:
        from ranks.sharding import load_shard
        out = load_shard(ckpt, spec, 0, 1, dtype=dtype, device=device, layout=layout, keep_quantised=keep_quantised,
                         progress=progress)
        if spec.tie_word_embeddings:
            del out["lm_head.weight"]
        return out
    out: dict[str, torch.Tensor] = {}
    for name in ckpt.tensors:
        if name.startswith("mtp.") and not layout.has_mtp:
            continue
        if spec.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name in layout.ignored:
            continue
        if any(name.startswith(p) for p in layout.per_expert):
            continue
        out[name] = ckpt.read(name, dtype=dtype, device=device)
    for prefix in layout.per_expert:
        X = spec.num_experts
        gate_up = [torch.cat([ckpt.read(f"{prefix}{e}.gate_proj.weight", dtype=dtype),
                              ckpt.read(f"{prefix}{e}.up_proj.weight", dtype=dtype)]) for e in range(X)]
        down = [ckpt.read(f"{prefix}{e}.down_proj.weight", dtype=dtype) for e in range(X)]
        out[prefix + "gate_up_proj"] = torch.stack(gate_up).to(device)
        out[prefix + "down_proj"] = torch.stack(down).to(device)
    return out


# --------------------------------------------------------------------------------------------------
# Writing


def write_checkpoint(out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor], *,
                     prefix: str = "model.language_model.", max_shard_bytes: int = 4 * 2**30,
                     split_experts: bool = False) -> list[str]:
    """Write canonical-named tensors as HF safetensors (one file, or shards plus an index).

    `prefix` goes before text weights (not before ``lm_head.`` or ``mtp.``): ``model.language_model.``
    is the official multimodal layout, ``model.`` the text-only one transformers' CausalLM writes.
    With `split_experts`, fused expert tensors are written per expert.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    items = list(_disk_items(tensors, prefix, split_experts))
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for key, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, t))
        size += nbytes
    files = []
    if len(shards) == 1:
        files.append(SINGLE_FILE)
        save_file({k: t.contiguous() for k, t in shards[0]}, os.path.join(out_dir, SINGLE_FILE),
                  metadata={"format": "pt"})
        return files
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        files.append(fname)
        save_file({k: t.contiguous() for k, t in shard}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for k, t in shard:
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


def _disk_items(tensors: Mapping[str, torch.Tensor], prefix: str,
                split_experts: bool) -> Iterable[tuple[str, torch.Tensor]]:
    for name, t in tensors.items():
        key = name if name.startswith(("lm_head.", "mtp.")) else prefix + name
        if split_experts and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            base = key[: -len("gate_up_proj")] if name.endswith("gate_up_proj") else key[: -len("down_proj")]
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    gate, up = t[e].chunk(2, dim=0)
                    yield f"{base}{e}.gate_proj.weight", gate.clone()
                    yield f"{base}{e}.up_proj.weight", up.clone()
                else:
                    yield f"{base}{e}.down_proj.weight", t[e].clone()
            continue
        yield key, t
