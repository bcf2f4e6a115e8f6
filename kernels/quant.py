"""Quantised linear weights (FP8 per row, FP8 128x128 blocks, NVFP4) in plain torch.

A `QuantWeight` holds the codes and scales of one [O, I] weight exactly as the CUDA kernels read them
(kernels/cuda/gemv.cu); `.dequantize()` is the torch reference they are tested against, bit for bit.

Layouts (row-major, O = out_features, I = in_features):
  fp8_row    data uint8 [O, I] e4m3fn codes; scale fp32 [O] (multiplier, = row amax / 448)
  fp8_block  data uint8 [O, I] e4m3fn codes; scale fp32 [ceil(O/128), ceil(I/128)] (multiplier,
             like the official FP8 checkpoints' weight_scale_inv)
  nvfp4      data uint8 [O, I/2] E2M1 codes, element 2i in the LOW nibble of byte i; scale uint8
             [O, I/16] e4m3fn bits, one per 16 consecutive elements of a row; global_scale fp32 [1]
             W = e2m1 * fp8(scale) * global_scale  (ModelOpt's weight_scale_2; ~ amax / (6 * 448))

Dequantised values are computed in fp32 and rounded once (round to nearest even) to bf16:
  fp8_*  bf16(f32(code) * scale)          nvfp4  bf16((e2m1 * f32(fp8 scale)) * global_scale)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor

KINDS = ("fp8_row", "fp8_block", "nvfp4")
FP8_MAX = 448.0
FP4_MAX = 6.0
BLOCK = 128          # fp8_block tile
GROUP = 16           # nvfp4 elements per scale

# e2m1 magnitudes by code & 7; bit 3 is the sign.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class QuantError(ValueError):
    pass


def _fp8_dtype() -> torch.dtype:
    dt = getattr(torch, "float8_e4m3fn", None)
    if dt is None:
        raise QuantError("this torch build has no torch.float8_e4m3fn (torch >= 2.1 needed for FP8 weights)")
    return dt


def fp8_to_float(codes: Tensor) -> Tensor:
    """uint8 e4m3fn bits -> fp32 values (exact)."""
    return codes.contiguous().view(_fp8_dtype()).float()


def float_to_fp8(x: Tensor) -> Tensor:
    """fp32 -> uint8 e4m3fn bits (round to nearest even; caller keeps |x| <= 448)."""
    return x.float().to(_fp8_dtype()).view(torch.uint8)


def e2m1_to_float(codes: Tensor) -> Tensor:
    """4-bit codes (any int tensor, values 0..15) -> fp32."""
    lut = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def float_to_e2m1(x: Tensor) -> Tensor:
    """fp32 (|x| <= 6 after scaling) -> uint8 codes 0..15, round to nearest, ties to the even code."""
    x = x.float()
    mag = x.abs().clamp(max=FP4_MAX)
    # Midpoints between consecutive magnitudes; at a tie pick the even code (even mantissa bit).
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32, device=x.device)
    code = torch.bucketize(mag, bounds, right=False)            # mag <= bound -> lower code
    # bucketize(right=False) puts mag == bound into the lower bucket; ties go to the even code.
    tie = (mag.unsqueeze(-1) == bounds).any(-1)
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    sign = (x < 0) & (code > 0)
    return (code + sign.to(code.dtype) * 8).to(torch.uint8)


@dataclass
class QuantWeight:
    kind: str                 # "fp8_row" | "fp8_block" | "nvfp4"
    out_features: int
    in_features: int
    data: Tensor              # uint8 codes, see module docstring
    scale: Tensor             # fp32 [O] | fp32 [ceil(O/128), ceil(I/128)] | uint8 [O, I/16]
    global_scale: Tensor | None = None   # fp32 [1] (nvfp4 only), a tensor so kernels never sync

    def __post_init__(self):
        O, I = int(self.out_features), int(self.in_features)
        self.out_features, self.in_features = O, I
        if self.kind not in KINDS:
            raise QuantError(f"kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if O <= 0 or I <= 0:
            raise QuantError(f"{self.kind}: shape [{O}, {I}] must be positive")

        def need(t, name, dtype, shape):
            if not isinstance(t, torch.Tensor):
                raise QuantError(f"{self.kind} {name}: expected a tensor, got {type(t).__name__}")
            if t.dtype != dtype:
                raise QuantError(f"{self.kind} {name}: dtype {t.dtype}, expected {dtype}")
            if tuple(t.shape) != tuple(shape):
                raise QuantError(f"{self.kind} {name}: shape {tuple(t.shape)}, expected {tuple(shape)}")

        if self.kind == "nvfp4":
            if I % GROUP:
                raise QuantError(f"nvfp4: in_features {I} must be a multiple of {GROUP}")
            need(self.data, "data", torch.uint8, (O, I // 2))
            need(self.scale, "scale", torch.uint8, (O, I // GROUP))
            gs = self.global_scale
            if isinstance(gs, (int, float)):
                gs = torch.tensor([float(gs)], dtype=torch.float32, device=self.data.device)
            if not isinstance(gs, torch.Tensor) or gs.numel() != 1:
                raise QuantError("nvfp4 global_scale: expected a one-element fp32 tensor")
            self.global_scale = gs.reshape(1).to(torch.float32)
        else:
            need(self.data, "data", torch.uint8, (O, I))
            if self.kind == "fp8_row":
                need(self.scale, "scale", torch.float32, (O,))
            else:
                need(self.scale, "scale", torch.float32, (-(-O // BLOCK), -(-I // BLOCK)))
            self.global_scale = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
        return n + (4 if self.global_scale is not None else 0)

    def to(self, device) -> "QuantWeight":
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return QuantWeight(self.kind, self.out_features, self.in_features, self.data.to(device),
                           self.scale.to(device), gs)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The weight [O, I]: fp32 products (see module docstring), cast once to `dtype`."""
        O, I = self.out_features, self.in_features
        if self.kind == "fp8_row":
            w = fp8_to_float(self.data) * self.scale[:, None]
        elif self.kind == "fp8_block":
            s = self.scale.repeat_interleave(BLOCK, 0)[:O].repeat_interleave(BLOCK, 1)[:, :I]
            w = fp8_to_float(self.data) * s
        else:
            d = self.data
            codes = torch.stack([d & 0xF, d >> 4], dim=-1).reshape(O, I)     # low nibble first
            s = fp8_to_float(self.scale).repeat_interleave(GROUP, 1)
            w = (e2m1_to_float(codes) * s) * self.global_scale.to(d.device)
        return w if dtype == torch.float32 else w.to(dtype)


def _weight_2d(w: Tensor, name: str = "weight") -> Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise QuantError(f"{name}: expected a 2-D [out, in] tensor")
    if not w.is_floating_point() or w.dtype in (getattr(torch, "float8_e4m3fn", None),):
        raise QuantError(f"{name}: expected a bf16/fp16/fp32 tensor, got {w.dtype}")
    return w.float()


def quantize_fp8_rows(w: Tensor) -> QuantWeight:
    """Per-row e4m3: scale = row amax / 448 (1 for an all-zero row), codes = fp8(w / scale)."""
    wf = _weight_2d(w)
    O, I = wf.shape
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = float_to_fp8((wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX))
    return QuantWeight("fp8_row", O, I, codes, scale.contiguous())


def quantize_fp8_blocks(w: Tensor) -> QuantWeight:
    """128x128 tiles (edge tiles partial): scale = tile amax / 448, a multiplier [ceil(O/128), ceil(I/128)]."""
    wf = _weight_2d(w)
    O, I = wf.shape
    ob, ib = -(-O // BLOCK), -(-I // BLOCK)
    pad = torch.zeros(ob * BLOCK, ib * BLOCK, dtype=torch.float32, device=wf.device)
    pad[:O, :I] = wf
    amax = pad.abs().view(ob, BLOCK, ib, BLOCK).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    s = scale.repeat_interleave(BLOCK, 0)[:O].repeat_interleave(BLOCK, 1)[:, :I]
    codes = float_to_fp8((wf / s).clamp(-FP8_MAX, FP8_MAX))
    return QuantWeight("fp8_block", O, I, codes, scale.contiguous())


def quantize_nvfp4(w: Tensor, global_scale: float | Tensor | None = None) -> QuantWeight:
    """NVFP4: global = amax / (6 * 448); per 16 elements s = fp8(group amax / (6 * global)),
    codes = e2m1(w / (s * global)). I must be a multiple of 16."""
    wf = _weight_2d(w)
    O, I = wf.shape
    if I % GROUP:
        raise QuantError(f"nvfp4: in_features {I} must be a multiple of {GROUP}")
    if global_scale is None:
        amax = wf.abs().amax()
        g = torch.where(amax > 0, amax / (FP4_MAX * FP8_MAX), torch.ones_like(amax)).reshape(1)
    else:
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=wf.device).reshape(1)
    groups = wf.view(O, I // GROUP, GROUP)
    gmax = groups.abs().amax(dim=-1)
    s_codes = float_to_fp8((gmax / (FP4_MAX * g)).clamp(0, FP8_MAX))
    s = fp8_to_float(s_codes) * g                                        # effective group scale
    q = torch.where(s[..., None] > 0, groups / s[..., None], torch.zeros_like(groups))
    codes = float_to_e2m1(q).reshape(O, I)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return QuantWeight("nvfp4", O, I, packed, s_codes.contiguous(), g.float())


def from_modelopt(weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor | float) -> QuantWeight:
    """NVIDIA ModelOpt NVFP4 tensors: weight uint8 [O, I/2], weight_scale float8_e4m3fn (or uint8) [O, I/16],
    weight_scale_2 fp32 scalar."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise QuantError(f"modelopt weight: expected uint8 [O, I/2], got {weight.dtype} {tuple(weight.shape)}")
    O, I = weight.shape[0], weight.shape[1] * 2
    ws = weight_scale
    if ws.dtype != torch.uint8:
        if ws.dtype != _fp8_dtype():
            raise QuantError(f"modelopt weight_scale: dtype {ws.dtype}, expected float8_e4m3fn")
        ws = ws.contiguous().view(torch.uint8)
    g = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device).reshape(-1)
    if g.numel() != 1:
        raise QuantError(f"modelopt weight_scale_2: expected a scalar, got shape {tuple(g.shape)}")
    return QuantWeight("nvfp4", O, I, weight.contiguous(), ws.contiguous(), g)


def from_fp8_checkpoint(weight: Tensor, weight_scale_inv: Tensor) -> QuantWeight:
    """Official FP8 checkpoints: weight float8_e4m3fn (or uint8) [O, I], weight_scale_inv fp32
    [ceil(O/128), ceil(I/128)] (a multiplier despite the name)."""
    if weight.dim() != 2:
        raise QuantError(f"fp8 weight: expected [O, I], got shape {tuple(weight.shape)}")
    w = weight
    if w.dtype != torch.uint8:
        if w.dtype != _fp8_dtype():
            raise QuantError(f"fp8 weight: dtype {w.dtype}, expected float8_e4m3fn")
        w = w.contiguous().view(torch.uint8)
    O, I = w.shape
    return QuantWeight("fp8_block", O, I, w.contiguous(), weight_scale_inv.to(torch.float32).contiguous())


def cat_rows(parts: list[QuantWeight]) -> QuantWeight | None:
    """The row concatenation of quantised weights of one kind, width and device, exactly: fp8 codes and
    per-row or per-tile scales stacked, nvfp4 codes and group scales stacked under their one global
    scale. None where that is not exact: fp8_block parts (all but the last) whose rows are not whole
    128-row tiles, or nvfp4 parts whose global scales differ (each part would need its own)."""
    if not parts:
        raise QuantError("cat_rows: no parts")
    first = parts[0]
    if any(p.kind != first.kind or p.in_features != first.in_features or p.device != first.device for p in parts):
        return None
    if len(parts) == 1:
        return first
    if first.kind == "fp8_block" and any(p.out_features % BLOCK for p in parts[:-1]):
        return None
    gs = None
    if first.kind == "nvfp4":
        if any(not torch.equal(p.global_scale, first.global_scale) for p in parts[1:]):
            return None
        gs = first.global_scale
    O = sum(p.out_features for p in parts)
    return QuantWeight(first.kind, O, first.in_features, torch.cat([p.data for p in parts]),
                       torch.cat([p.scale for p in parts]), gs)
