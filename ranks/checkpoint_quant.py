"""Pre-quantised checkpoints: which linear weights of a safetensors checkpoint are stored quantised,
and reading them (whole, or one rank's slice) as kernels.quant.QuantWeight or dequantised.

These on-disk formats load (the spec's section 8); the config's quantization_config names the method
(runtime.config, ModelSpec.quantization) and the tensors say which weights are quantised and how, so
the config's module lists (modules_to_not_convert, exclude_modules, ignore) need not be parsed:

- FP8 block-scaled (the official ``-FP8`` repositories; quant_method "fp8", weight_block_size
  [128, 128]): ``<m>.weight`` float8_e4m3fn [N, K] and ``<m>.weight_scale_inv`` fp32
  [ceil(N/128), ceil(K/128)], a multiplier despite its name: W = fp8(code) * scale of its tile.
- FP8 with ``<m>.weight_scale`` (compressed-tensors "float-quantized", ModelOpt quant_algo "FP8"):
  [ceil(N/128), ceil(K/128)] (block strategy), [N, 1] (channel: one scale per row) or one value
  (tensor); the last two load as fp8_row.
- NVIDIA ModelOpt NVFP4 (quant_method "modelopt", quant_algo "NVFP4"; or hf_quant_config.json):
  ``<m>.weight`` uint8 [N, K/2] (two E2M1 codes a byte, element 2i in the low nibble),
  ``<m>.weight_scale`` float8_e4m3fn [N, K/16], ``<m>.weight_scale_2`` fp32 scalar:
  W = e2m1(code) * fp8(scale of its 16) * weight_scale_2.
- compressed-tensors NVFP4 (format "nvfp4-pack-quantized"): ``<m>.weight_packed`` uint8 [N, K/2],
  ``<m>.weight_scale`` float8_e4m3fn [N, K/16], ``<m>.weight_global_scale`` fp32 [1], a divisor:
  W = e2m1(code) * fp8(scale) / weight_global_scale.

Activation scales (``input_scale``, ``input_global_scale``), compressed-tensors' ``weight_shape`` and
ModelOpt's KV-cache scales (``k_scale`` / ``v_scale``) are accepted and not used: activations and the
KV cache stay 16-bit (or --kv-dtype int8). They must sit beside a weight or attention layer the config
has (ranks.weights.validate); one that scales nothing is an unexpected tensor.

The CUDA backend keeps the linear weights its kernels read quantised (KEPT: attention, GDN and MLP /
shared-expert projections) where a rank's slice falls on the format's block boundaries, as
QuantWeight (kind fp8_block, fp8_row or nvfp4; compressed-tensors' divisor becomes the multiplier
1/g in fp32); everything else (routed experts, a|b, routers, the reference backend's whole model) is
dequantised at load, in fp32 and cast once to the model's dtype.

Scales are checked as they are read (only the slice a rank reads): a NaN, infinite or negative scale,
or an fp8 NaN code (0x7f / 0xff), is a QuantCheckpointError naming the file, tensor and element.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from kernels.quant import BLOCK, GROUP, QuantWeight, e2m1_to_float, fp8_to_float
from ranks.weights import CheckpointError

log = logging.getLogger(__name__)

# The linear weights (on-disk names) the CUDA kernels read quantised; ranks/model_cuda.py fuses them
# (q|k|v, qkv|z, gate|up) after loading.
KEPT = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
        "linear_attn.out_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
        "mlp.shared_expert.down_proj.weight")

# the ModelSpec.quantization name of each QuantWeight kind
SPEC_KIND = {"fp8_block": "fp8-block", "fp8_row": "fp8", "nvfp4": "nvfp4"}
_FLOAT_SCALES = ("F32", "BF16", "F16")
# stored beside quantised weights or attention layers, accepted and not loaded
UNUSED_SUFFIXES = (".input_scale", ".input_global_scale", ".weight_shape", ".k_scale", ".v_scale")


QuantCheckpointError = CheckpointError       # a quantised tensor that cannot be read (names file, tensor)


@dataclass(frozen=True)
class QuantTensor:
    """One quantised linear weight: its canonical (logical) name and [N, K] shape, the QuantWeight kind
    it loads as, and the stored tensors it is made of (canonical names)."""
    name: str
    kind: str                         # "fp8_block" | "fp8_row" | "nvfp4"
    fmt: str                          # the layout, for messages: "fp8 weight_scale_inv", ...
    shape: tuple[int, int]
    data: str
    scale: str
    global_scale: str | None = None
    divisor: bool = False             # nvfp4: the global scale divides (compressed-tensors)
    per_tensor: bool = False          # fp8_row: one scale for the whole weight

    @property
    def stored(self) -> tuple[str, ...]:
        return tuple(n for n in (self.data, self.scale, self.global_scale) if n is not None)


def find(tensors: dict) -> tuple[dict[str, QuantTensor], set[str]]:
    """(logical name -> QuantTensor, the stored names they account for) from a checkpoint's
    TensorInfo map (canonical names); QuantCheckpointError naming the tensor when a quantised weight's
    parts do not fit together."""
    out: dict[str, QuantTensor] = {}
    for n in sorted(tensors):
        if n.endswith(".weight_scale_inv"):
            q = _fp8(tensors, n[: -len("_scale_inv")], n)
        elif n.endswith(".weight_packed"):
            q = _nvfp4(tensors, n[: -len("_packed")], "compressed-tensors NVFP4", n, ".weight_global_scale")
        elif n.endswith(".weight_scale_2"):
            q = _nvfp4(tensors, n[: -len("_scale_2")], "ModelOpt NVFP4", n[: -len("_scale_2")], ".weight_scale_2")
        elif n.endswith(".weight_scale") and n + "_2" not in tensors and n[: -len("_scale")] + "_packed" not in tensors:
            q = _fp8(tensors, n[: -len("_scale")], n)       # compressed-tensors / ModelOpt FP8
        else:
            continue
        out[q.name] = q
    stored = {s for q in out.values() for s in q.stored}
    return out, stored


def _where(info) -> str:
    return f"{info.file}: tensor {info.key!r}"


def _need(tensors: dict, name: str, by: str) -> object:
    info = tensors.get(name)
    if info is None:
        raise QuantCheckpointError(f"{_where(tensors[by])} is a quantisation part, but {name!r} (its "
                                   "weight or scale) is not in the checkpoint")
    return info


def _fp8(tensors: dict, name: str, scale_name: str) -> QuantTensor:
    """An fp8 weight and its scales: 128x128 tiles (weight_scale_inv, or compressed-tensors' block
    strategy), one per row ([N, 1] / [N]: the channel strategy) or one for the tensor."""
    w = _need(tensors, name, scale_name)
    s = tensors[scale_name]
    leaf = scale_name.rsplit(".", 1)[-1]
    if w.dtype == "U8" and leaf == "weight_scale" and name + "_scale_2" not in tensors:
        raise QuantCheckpointError(f"{_where(w)} holds uint8 codes with a weight_scale, as ModelOpt NVFP4 stores "
                                   f"them, but its global scale {name + '_scale_2'!r} is missing")
    if w.dtype != "F8_E4M3" or len(w.shape) != 2:
        raise QuantCheckpointError(f"{_where(w)} has dtype {w.dtype} and shape {list(w.shape)}; a weight with "
                                   f"a {leaf} must be float8_e4m3fn [out, in] (2-D)")
    N, K = w.shape
    blocks = (-(-N // BLOCK), -(-K // BLOCK))
    shape = tuple(s.shape)
    if s.dtype in _FLOAT_SCALES:
        if leaf == "weight_scale" and shape in ((N, 1), (N,)):
            return QuantTensor(name, "fp8_row", "fp8 per-channel", (N, K), name, scale_name)
        if shape == blocks:             # before per-tensor: a one-tile weight's [1, 1] reads the same either way
            return QuantTensor(name, "fp8_block", f"fp8 {leaf} 128x128", (N, K), name, scale_name)
        if leaf == "weight_scale" and math.prod(shape) == 1 and len(shape) <= 2:
            return QuantTensor(name, "fp8_row", "fp8 per-tensor", (N, K), name, scale_name, per_tensor=True)
    want = f"float {list(blocks)} (128x128 blocks)" + (f", [{N}, 1] (per row) or [1] (per tensor)"
                                                         if leaf == "weight_scale" else "")
    raise QuantCheckpointError(f"{_where(s)} has dtype {s.dtype} and shape {list(shape)}; the [{N}, {K}] "
                               f"weight's scales must be {want}")


def _nvfp4(tensors: dict, name: str, fmt: str, data_name: str, global_suffix: str) -> QuantTensor:
    base = name[: -len(".weight")]
    by = data_name if data_name != name else base + global_suffix
    d = _need(tensors, data_name, by)
    s = _need(tensors, base + ".weight_scale", by)
    g = _need(tensors, base + global_suffix, by)
    if d.dtype != "U8" or len(d.shape) != 2:
        raise QuantCheckpointError(f"{_where(d)} has dtype {d.dtype} and shape {list(d.shape)}; NVFP4 codes "
                                   "must be uint8 [out, in / 2] (2-D)")
    N, K = d.shape[0], 2 * d.shape[1]
    if K % GROUP:
        raise QuantCheckpointError(f"{_where(d)}: {K} input features are not a multiple of {GROUP}")
    if s.dtype not in ("F8_E4M3", "U8") or tuple(s.shape) != (N, K // GROUP):
        raise QuantCheckpointError(f"{_where(s)} has dtype {s.dtype} and shape {list(s.shape)}; the "
                                   f"[{N}, {K}] weight's scales must be float8_e4m3fn [{N}, {K // GROUP}]")
    if g.dtype not in _FLOAT_SCALES or math.prod(g.shape) != 1:
        raise QuantCheckpointError(f"{_where(g)} has dtype {g.dtype} and shape {list(g.shape)}; expected "
                                   "one float (the weight's global scale)")
    return QuantTensor(name, "nvfp4", fmt, (N, K), data_name, base + ".weight_scale", base + global_suffix,
                       divisor=data_name != name)


def _tiles(sl: slice | None, n: int, size: int) -> tuple[int, int]:
    """The start and stop of slice `sl` of an axis of n, widened to whole tiles of `size`."""
    a, b, _ = (sl or slice(None)).indices(n)
    return a // size * size, min(n, -(-b // size) * size)


def _tile_index(r0: int, r1: int, c0: int, c1: int) -> tuple[slice, slice]:
    """The 128x128 tile scales covering rows [r0, r1) x columns [c0, c1) of an fp8_block weight."""
    return slice(r0 // BLOCK, -(-r1 // BLOCK)), slice(c0 // BLOCK, -(-c1 // BLOCK))


def _bounds(sl: slice | None, n: int) -> tuple[int, int]:
    a, b, step = (sl or slice(None)).indices(n)
    if step != 1:
        raise ValueError("quantised weights are read in contiguous slices")
    return a, b


def _global(ckpt, q: QuantTensor) -> torch.Tensor:
    g = ckpt.read(q.global_scale).to(torch.float32).reshape(1)
    divisor = q.divisor
    if not bool(torch.isfinite(g).all()) or float(g) < 0 or (divisor and float(g) == 0):
        info = ckpt.tensors[q.global_scale]
        raise QuantCheckpointError(f"{_where(info)} is {float(g)!r}; a global scale must be finite and "
                                   + ("positive (it divides)" if divisor else "not negative"))
    return g


def _scales(ckpt, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
    """The fp32 values of scale tensor `name` (or its slice `index`), QuantCheckpointError naming the
    element where one is NaN, infinite or negative (a corrupt scale would load as NaN weights, or
    weights of the wrong sign)."""
    return _checked(ckpt, name, ckpt.read(name, index=index), index)


def _checked(ckpt, name: str, t: torch.Tensor, index: tuple[slice, ...] | None) -> torch.Tensor:
    """_scales on `t`, the slice `index` of `name` already read (fp8 scales, as float8_e4m3fn or uint8
    bits, are decoded)."""
    fp8 = t.dtype in (torch.float8_e4m3fn, torch.uint8)
    s = fp8_to_float(t.contiguous().view(torch.uint8)) if fp8 else t.to(torch.float32)
    bad = ~torch.isfinite(s) | (s < 0)
    if bool(bad.any()):
        at = bad.nonzero()[0].tolist()
        value = float(s[tuple(at)])
        at = [i + (sl.start or 0) for i, sl in zip(at, tuple(index or ()) + (slice(0),) * len(at))]
        raise QuantCheckpointError(f"{_where(ckpt.tensors[name])} holds {value!r}"
                                   + (f" at {at}" if at else "") + "; weight scales must be finite and not negative")
    return s


_HIGH_BITS = 0x8080808080808080 - (1 << 64)            # as int64
_LOW_BITS = 0x0101010101010101
_NAN_SCAN = 1 << 23                                    # words per pass (64 MiB)


def has_fp8_nan(t: torch.Tensor) -> bool:
    """Whether contiguous uint8 e4m3fn bits hold a NaN code (low seven bits all set), eight bytes at a
    time: with every byte's high bit set, a NaN byte is 0xff, i.e. a zero byte of the complement, found
    by the zero-byte test (v - 0x01..01) & 0x80..80 on words whose bytes are <= 0x7f (no overflow). On
    one core it reads ~1.3 GB/s against ~0.5 for the bytewise test (a 27B's codes: ~20 s, not ~50)."""
    flat = t.reshape(-1)
    if flat.storage_offset() % 8:                          # int64 words need an aligned start
        flat = flat.clone()
    n = flat.numel() // 8 * 8
    if n < flat.numel() and bool(((flat[n:] & 0x7F) == 0x7F).any()):
        return True
    words = flat[:n].view(torch.int64)
    for a in range(0, words.numel(), _NAN_SCAN):
        v = torch.bitwise_or(words[a:a + _NAN_SCAN], _HIGH_BITS)
        v.bitwise_not_()
        v.sub_(_LOW_BITS)
        v.bitwise_and_(_HIGH_BITS)
        if bool(v.any()):
            return True
    return False


def _codes(ckpt, name: str, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """Rows [r0, r1) x columns [c0, c1) of an fp8 weight as uint8 e4m3fn bits; QuantCheckpointError
    naming the element where one is a NaN code (0x7f / 0xff: no exporter writes one)."""
    t = ckpt.read(name, index=(slice(r0, r1), slice(c0, c1))).contiguous().view(torch.uint8)
    if has_fp8_nan(t):
        nan = (t & 0x7F) == 0x7F
        i, j = nan.nonzero()[0].tolist()
        raise QuantCheckpointError(f"{_where(ckpt.tensors[name])} holds the NaN code {int(t[i, j]):#04x} at "
                                   f"[{r0 + i}, {c0 + j}]; float8_e4m3fn weights must be finite")
    return t


def _row_scales(ckpt, q: QuantTensor, r0: int, r1: int) -> torch.Tensor:
    """fp8_row: the fp32 scales of rows [r0, r1) (one scale repeated for a per-tensor weight)."""
    if q.per_tensor:
        return _scales(ckpt, q.scale).reshape(1).expand(r1 - r0).contiguous()
    return _scales(ckpt, q.scale, (slice(r0, r1),)).reshape(r1 - r0).contiguous()


def read(ckpt, q: QuantTensor, rows: slice | None = None, cols: slice | None = None) -> QuantWeight | None:
    """Rows x cols of `q` as a QuantWeight on the CPU, reading only those bytes; None when the slice
    does not fall on the format's boundaries (fp8 tiles: 128 rows / 128 columns, the last tile of an
    axis excepted; nvfp4: groups of 16 columns), so its scales would be shared with other ranks."""
    N, K = q.shape
    r0, r1 = _bounds(rows, N)
    c0, c1 = _bounds(cols, K)
    if q.kind == "fp8_row":
        return QuantWeight("fp8_row", r1 - r0, c1 - c0, _codes(ckpt, q.data, r0, r1, c0, c1),
                           _row_scales(ckpt, q, r0, r1))
    if q.kind == "fp8_block":
        if r0 % BLOCK or (r1 % BLOCK and r1 != N) or c0 % BLOCK or (c1 % BLOCK and c1 != K):
            return None
        data = _codes(ckpt, q.data, r0, r1, c0, c1)
        scale = _scales(ckpt, q.scale, _tile_index(r0, r1, c0, c1))
        return QuantWeight("fp8_block", r1 - r0, c1 - c0, data, scale.contiguous())
    if c0 % GROUP or c1 % GROUP:
        return None
    data = ckpt.read(q.data, index=(slice(r0, r1), slice(c0 // 2, c1 // 2)))
    index = (slice(r0, r1), slice(c0 // GROUP, c1 // GROUP))
    scale = ckpt.read(q.scale, index=index)
    _checked(ckpt, q.scale, scale, index)                   # kept as fp8 bits
    g = _global(ckpt, q)
    if q.divisor:
        _check_shape(ckpt, q)
        g = 1.0 / g                     # a divisor on disk, the kernels' multiplier here
    return QuantWeight("nvfp4", r1 - r0, c1 - c0, data.contiguous(), scale.contiguous().view(torch.uint8), g)


def dequantised(ckpt, q: QuantTensor, rows: slice | None = None, cols: slice | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows x cols of `q` dequantised: fp32 products (a division by compressed-tensors' global scale),
    cast once to `dtype`. Reads the tiles / groups that cover the slice."""
    N, K = q.shape
    r0, r1 = _bounds(rows, N)
    c0, c1 = _bounds(cols, K)
    if q.kind == "fp8_row":
        w = fp8_to_float(_codes(ckpt, q.data, r0, r1, c0, c1)) * _row_scales(ckpt, q, r0, r1)[:, None]
    elif q.kind == "fp8_block":
        R0, R1 = _tiles(slice(r0, r1), N, BLOCK)
        C0, C1 = _tiles(slice(c0, c1), K, BLOCK)
        codes = _codes(ckpt, q.data, R0, R1, C0, C1)
        s = _scales(ckpt, q.scale, _tile_index(R0, R1, C0, C1))
        s = s.repeat_interleave(BLOCK, 0)[:R1 - R0].repeat_interleave(BLOCK, 1)[:, :C1 - C0]
        w = fp8_to_float(codes) * s
        w = w[r0 - R0:r1 - R0, c0 - C0:c1 - C0]
    else:
        C0, C1 = _tiles(slice(c0, c1), K, GROUP)
        d = ckpt.read(q.data, index=(slice(r0, r1), slice(C0 // 2, C1 // 2)))
        s = _scales(ckpt, q.scale, (slice(r0, r1), slice(C0 // GROUP, C1 // GROUP)))
        codes = torch.stack([d & 0xF, d >> 4], dim=-1).reshape(r1 - r0, C1 - C0)     # low nibble first
        w = e2m1_to_float(codes) * s.repeat_interleave(GROUP, 1)
        g = _global(ckpt, q)
        if q.divisor:
            _check_shape(ckpt, q)
            w = w / g
        else:
            w = w * g
        w = w[:, c0 - C0:c1 - C0]
    return w.contiguous() if dtype == torch.float32 else w.to(dtype)


def _check_shape(ckpt, q: QuantTensor) -> None:
    """compressed-tensors' weight_shape, where stored, must be the shape the packed codes imply."""
    name = q.name[: -len(".weight")] + ".weight_shape"
    if name not in ckpt.tensors:
        return
    shape = [int(v) for v in ckpt.read(name).reshape(-1).tolist()]
    if shape != list(q.shape):
        raise QuantCheckpointError(f"{_where(ckpt.tensors[name])} is {shape}; the packed codes are {list(q.shape)}")


def quantised_conflict(spec, weights: str) -> str | None:
    """Why --weights `weights` cannot apply to `spec`'s pre-quantised checkpoint, or None."""
    if spec.quantization and weights != "bf16":
        return (f"--weights {weights} quantises a 16-bit checkpoint on load; this checkpoint is already "
                f"quantised ({spec.quantization}, its config's quantization_config): leave --weights at bf16")
    return None


def is_unused(name: str) -> bool:
    return name.endswith(UNUSED_SUFFIXES)
