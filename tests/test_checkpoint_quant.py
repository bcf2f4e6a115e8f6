"""Pre-quantised checkpoints (ranks/checkpoint_quant.py): FP8 block-scaled, ModelOpt NVFP4 and
compressed-tensors NVFP4, on the CPU.

Each format is written the way its exporter lays it out (names, dtypes, shapes, scale conventions),
from fresh random weights quantised by kernels.quant; the expected weights are dequantised here by an
independent float64 formula (its own E2M1 table, torch's float8 decoding, the tile / group expansion),
and a model over those weights is the reference for the loaded one. Malformed checkpoints are refused
with messages that name the file and the tensor.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from kernels.quant import QuantWeight, cat_rows, quantize_fp8_blocks, quantize_fp8_rows, quantize_nvfp4
from ranks.model import Batch, HybridModel
from ranks.sharding import load_shard
from ranks.weights import Checkpoint, CheckpointError, _disk_items, load_weights, validate, write_checkpoint
from runtime.config import spec_from_hf
from tests.util import page_table, random_weights, rel, tiny_config

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FORMATS = ("fp8", "modelopt", "compressed-tensors", "ct-fp8-block", "ct-fp8-channel", "modelopt-fp8")
KIND = {"fp8": "fp8_block", "ct-fp8-block": "fp8_block", "ct-fp8-channel": "fp8_row", "modelopt-fp8": "fp8_row",
        "modelopt": "nvfp4", "compressed-tensors": "nvfp4"}


def _ct_fp8(strategy: str, **more) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized", "weights": {
                "num_bits": 8, "type": "float", "strategy": strategy, **more}}}}


QCONFIG = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "ct-fp8-block": _ct_fp8("block", block_structure=[128, 128]),
    "ct-fp8-channel": _ct_fp8("channel"),
    "modelopt-fp8": {"quant_method": "modelopt", "quant_algo": "FP8"},
    "modelopt": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                           "config_groups": {"group_0": {"format": "nvfp4-pack-quantized", "targets": ["Linear"],
                                                         "weights": {"num_bits": 4, "type": "float",
                                                                     "group_size": 16}}}},
}
F8 = torch.float8_e4m3fn


def _quantisable(name: str, t: torch.Tensor, fmt: str) -> bool:
    """The linear weights an exporter quantises here: every projection and mtp.fc (embedding, head,
    routers and norms stay 16-bit); the fp8 exporter also keeps GDN's a / b projections 16-bit, as the
    official repositories do, while the nvfp4 ones quantise them (read dequantised: not kept)."""
    leaf = name.rsplit(".", 2)[-2]
    if t.dim() != 2 or not name.endswith(".weight") or not ("_proj" in leaf or name == "mtp.fc.weight"):
        return False
    if fmt != "modelopt" and name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
        return False
    return t.shape[1] % 16 == 0


def _fp8_ref(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    N, K = codes.shape
    s = scale.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return codes.double() * s


def _nvfp4_ref(packed: torch.Tensor, scale: torch.Tensor, g: float, divide: bool) -> torch.Tensor:
    N = packed.shape[0]
    lo, hi = packed & 0xF, packed >> 4
    nib = torch.stack([lo, hi], -1).reshape(N, -1).long()
    mag = torch.tensor(E2M1, dtype=torch.float64)[nib & 7]
    val = torch.where(nib >= 8, -mag, mag)
    s = scale.double().repeat_interleave(16, 1)
    return val * s / g if divide else val * s * g


def quantise(weights: dict[str, torch.Tensor], fmt: str, seed: int) -> tuple[dict, dict]:
    """(the tensors as the format's exporter stores them, canonical names; the float32 weights they
    stand for, dequantised in float64 by this test). Experts are written per expert."""
    rng = random.Random(seed)
    disk = dict(_disk_items(weights, "", split_experts=True))
    stored, ref = {}, {}
    # ModelOpt and llm-compressor give the layers that read one input (q|k|v, gate|up) one global scale
    # (amax / (6 * 448) over the group), so the loader can fuse them exactly
    shared: dict[str, torch.Tensor] = {}
    for a, group in (("q_proj", ("q_proj", "k_proj", "v_proj")), ("gate_proj", ("gate_proj", "up_proj"))):
        for name in [n for n in disk if n.endswith(f".{a}.weight") and ".experts." not in n]:
            parts = [disk[name[: -len(a + ".weight")] + p + ".weight"] for p in group]
            amax = max(float(t.abs().max()) for t in parts)
            for p in group:
                shared[name[: -len(a + ".weight")] + p + ".weight"] = torch.tensor([amax / (6 * 448)])
    for name, t in disk.items():
        if not _quantisable(name, t, fmt):
            stored[name] = ref[name] = t
            continue
        base = name[: -len(".weight")]
        if fmt in ("fp8", "ct-fp8-block"):
            q = quantize_fp8_blocks(t)
            stored[name] = q.data.view(F8)
            stored[base + (".weight_scale_inv" if fmt == "fp8" else ".weight_scale")] = q.scale
            ref[name] = _fp8_ref(stored[name], q.scale).float()
            continue
        if fmt == "ct-fp8-channel":
            q = quantize_fp8_rows(t)
            stored[name], stored[base + ".weight_scale"] = q.data.view(F8), q.scale[:, None].clone()
            ref[name] = (stored[name].double() * q.scale.double()[:, None]).float()
            continue
        if fmt == "modelopt-fp8":                  # one scale for the tensor, and a static input scale
            scale = t.abs().max() / 448
            stored[name] = (t / scale).clamp(-448, 448).to(F8)
            stored[base + ".weight_scale"] = scale.reshape(())
            stored[base + ".input_scale"] = torch.tensor(rng.uniform(0.01, 1.0), dtype=torch.float32)
            ref[name] = (stored[name].double() * scale.double()).float()
            continue
        q = quantize_nvfp4(t, shared.get(name))
        scale = q.scale.view(F8)
        g = float(q.global_scale)
        if fmt == "modelopt":
            stored.update({name: q.data, base + ".weight_scale": scale,
                           base + ".weight_scale_2": torch.tensor(g, dtype=torch.float32),
                           base + ".input_scale": torch.tensor(rng.uniform(0.01, 1.0), dtype=torch.float32)})
            ref[name] = _nvfp4_ref(q.data, scale, g, divide=False).float()
        else:
            gs = torch.tensor([1.0 / g], dtype=torch.float32)      # a divisor on disk
            stored.update({base + ".weight_packed": q.data, base + ".weight_scale": scale,
                           base + ".weight_global_scale": gs,
                           base + ".input_global_scale": torch.tensor([rng.uniform(1.0, 9.0)]),
                           base + ".weight_shape": torch.tensor(list(t.shape), dtype=torch.int64)})
            ref[name] = _nvfp4_ref(q.data, scale, float(gs), divide=True).float()
    return stored, ref


def write_quantised(d: str, cfg: dict, fmt: str, seed: int) -> tuple[object, dict[str, torch.Tensor]]:
    """A pre-quantised checkpoint of `cfg` in `fmt` at d; returns (spec, the float32 weights it holds)."""
    spec = spec_from_hf(cfg)
    stored, ref = quantise(random_weights(spec, seed), fmt, seed)
    write_checkpoint(d, stored, prefix="model.language_model.")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": QCONFIG[fmt]}, f)
    return spec_from_hf({**cfg, "quantization_config": QCONFIG[fmt]}), ref


def _fused(ref: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """Per-expert reference tensors stacked the way the loader returns them."""
    out = {k: v for k, v in ref.items() if ".experts." not in k}
    for i in range(spec.num_layers) if spec.is_moe else ():
        for p in (f"layers.{i}.mlp.experts.", "mtp.layers.0.mlp.experts.") if i == 0 else (f"layers.{i}.mlp.experts.",):
            if p + "0.gate_proj.weight" not in ref:
                continue
            X = spec.num_experts
            out[p + "gate_up_proj"] = torch.stack([torch.cat([ref[f"{p}{e}.gate_proj.weight"],
                                                             ref[f"{p}{e}.up_proj.weight"]]) for e in range(X)])
            out[p + "down_proj"] = torch.stack([ref[f"{p}{e}.down_proj.weight"] for e in range(X)])
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_pre_quantised_checkpoint_loads_as_its_dequantised_weights(tmp_path, fmt, moe, seed):
    """Every weight loads as the float64 dequantisation of what is stored (cast once to float32), and
    the model's logits and MTP logits equal those of a model built on those weights."""
    cfg = tiny_config(moe)
    spec, ref = write_quantised(str(tmp_path), cfg, fmt, seed)
    want = _fused(ref, spec)
    assert validate(Checkpoint(tmp_path), spec).quantised, "no weight was found quantised"
    got = load_weights(Checkpoint(tmp_path), spec)
    assert set(got) == set(want)
    for name in sorted(want):
        assert got[name].dtype == torch.float32
        assert rel(got[name], want[name]) < 1e-7, name
    model = HybridModel.from_dir(tmp_path)
    reference = HybridModel(spec, want)
    ids = torch.randint(0, spec.vocab_size, (40,), generator=torch.Generator().manual_seed(seed))
    table = page_table(1, 2)
    out, out_ref = (m.forward(Batch(ids, [40], [0], [0], table), m.new_state(num_slots=1, num_pages=2), logits="all")
                    for m in (model, reference))
    assert rel(out.logits, out_ref.logits) < 1e-6
    assert torch.equal(out.logits.argmax(-1), out_ref.logits.argmax(-1))


# dimensions on whole 128-row / 128-column tiles for both ranks of tp 2 (q|gate 512 rows, k/v 256,
# o_proj 256 columns, GDN q/k/v 256 each, MLP 512): every kept weight splits without dequantising
ALIGNED = dict(hidden_size=256, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
               num_attention_heads=2, num_key_value_heads=2, head_dim=128, linear_num_key_heads=2,
               linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
               intermediate_size=512, mtp_num_hidden_layers=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kept_weights_are_quant_weights_equal_to_the_dequantised_slices(tmp_path, fmt, seed):
    """With keep_quantised (the CUDA backend), each rank's slice of a kept linear weight is a QuantWeight
    (read on block boundaries, nothing dequantised) whose dequantisation is the dequantised slice;
    in_proj_qkv's q, k and v sections join into one QuantWeight."""
    from ranks.checkpoint_quant import KEPT

    cfg = tiny_config(False, **ALIGNED)
    spec, _ = write_quantised(str(tmp_path), cfg, fmt, seed)
    ckpt = Checkpoint(tmp_path)
    for tp in (1, 2):
        for rank in range(tp):
            kept = load_shard(ckpt, spec, rank, tp, keep_quantised=True)
            plain = load_shard(ckpt, spec, rank, tp)
            assert set(kept) == set(plain)
            n_kept = 0
            for name, t in plain.items():
                k = kept[name]
                if name.endswith(KEPT):
                    assert isinstance(k, QuantWeight), f"{name} (tp {tp}, rank {rank}) was dequantised"
                    assert k.kind == KIND[fmt]
                    assert k.shape == tuple(t.shape)
                    assert rel(k.dequantize(torch.float32), t) < 1e-6, name
                    n_kept += 1
                else:
                    assert isinstance(k, torch.Tensor) and torch.equal(k, t), name
            assert n_kept == 13         # GDN qkv, z, out; attention q, k, v, o; two MLPs gate, up, down


@pytest.mark.parametrize("fmt", ["fp8", "modelopt"])
def test_slices_off_the_blocks_are_dequantised(tmp_path, fmt, seed, caplog):
    """The tiny config's fp8 tiles straddle the two ranks (and its in_proj_qkv sections are not whole
    tiles): those weights come back dequantised, equal to the plain load, with a warning; nvfp4's
    groups of 16 columns always split."""
    from ranks.checkpoint_quant import KEPT

    spec, _ = write_quantised(str(tmp_path), tiny_config(False), fmt, seed)
    ckpt = Checkpoint(tmp_path)
    caplog.set_level("WARNING")
    kept = load_shard(ckpt, spec, 1, 2, keep_quantised=True)
    plain = load_shard(ckpt, spec, 1, 2)
    kinds = {type(kept[n]) for n in plain if n.endswith(KEPT)}
    # fp8: q_proj's rank-1 half starts on row 128 and stays quantised; the others straddle tiles
    assert kinds == ({torch.Tensor, QuantWeight} if fmt == "fp8" else {QuantWeight})
    if fmt == "fp8":
        assert isinstance(kept["layers.0.linear_attn.in_proj_qkv.weight"], torch.Tensor)
        assert isinstance(kept["layers.3.self_attn.q_proj.weight"], QuantWeight)
    for name, t in plain.items():
        k = kept[name]
        assert rel(k.dequantize(torch.float32) if isinstance(k, QuantWeight) else k, t) < 1e-6, name
    assert ("dequantised" in caplog.text) == (fmt == "fp8")


def test_engine_at_tp_2_generates_the_reference_greedy_ids(tmp_path, seed):
    """End to end on the CPU: tp 1 and tp 2 engines over an FP8 checkpoint produce the greedy ids of the
    reference model on the dequantised weights (prompts redrawn where the reference has a near tie)."""
    from runtime import Engine
    from tests.test_engine import OPTS, Reference, greedy

    cfg = tiny_config(True)
    spec, ref = write_quantised(str(tmp_path), cfg, "fp8", seed)
    reference = Reference(spec, _fused(ref, spec))
    cases = reference.clear_prompts(random.Random(seed), [5, 70], 12)
    for tp in (1, 2):
        eng = Engine.start(tmp_path, tp=tp, options=OPTS)
        try:
            for prompt, ids in cases:
                r = eng.submit(prompt, greedy(len(ids))).result(timeout=120)
                assert r.error is None and r.tokens == ids, f"tp {tp}"
        finally:
            eng.shutdown()


# ---- joining quantised weights -----------------------------------------------------------------------

def test_cat_rows_joins_exactly_or_refuses(seed):
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(n, 96, generator=g) for n in (128, 256, 40))
    fp8 = [quantize_fp8_blocks(t) for t in (a, b, c)]
    joined = cat_rows(fp8)
    assert joined.shape == (424, 96)
    assert torch.equal(joined.dequantize(torch.float32), torch.cat([q.dequantize(torch.float32) for q in fp8]))
    assert cat_rows([fp8[2], fp8[0]]) is None                 # a part of 40 rows before another: tiles straddle
    one = torch.tensor([0.01])
    nv = [quantize_nvfp4(t, one) for t in (a, c)]
    joined = cat_rows(nv)
    assert torch.equal(joined.dequantize(torch.float32), torch.cat([q.dequantize(torch.float32) for q in nv]))
    assert cat_rows([quantize_nvfp4(a), quantize_nvfp4(2 * c)]) is None      # two global scales
    assert cat_rows([fp8[0], nv[0]]) is None


def test_cuda_model_fusions_join_pre_quantised_parts(seed):
    """The CUDA model's load-time fusions (gate|up, q|k|v, qkv|z) on QuantWeight parts: one weight whose
    rows are the parts', the parts its row views; halves that cannot join become bf16."""
    from ranks.model_cuda import _fuse_gate_up, _fuse_projections

    g = torch.Generator().manual_seed(seed)
    w = {n: quantize_fp8_blocks(torch.randn(o, 256, generator=g)) for n, o in (
        ("layers.0.mlp.gate_proj.weight", 256), ("layers.0.mlp.up_proj.weight", 256),
        ("layers.1.self_attn.q_proj.weight", 512), ("layers.1.self_attn.k_proj.weight", 128),
        ("layers.1.self_attn.v_proj.weight", 128))}
    w["layers.2.mlp.gate_proj.weight"] = quantize_nvfp4(torch.randn(64, 256, generator=g))
    w["layers.2.mlp.up_proj.weight"] = quantize_nvfp4(3 * torch.randn(64, 256, generator=g))
    before = {n: q.dequantize(torch.float32) for n, q in w.items()}
    _fuse_gate_up(w)
    _fuse_projections(w)
    fused = w["layers.0.mlp.gate_up_proj.weight"]
    assert isinstance(fused, QuantWeight)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([before["layers.0.mlp.gate_proj.weight"],
                                                                   before["layers.0.mlp.up_proj.weight"]]))
    qkv = w["layers.1.self_attn.qkv_proj.weight"]
    assert isinstance(qkv, QuantWeight) and qkv.shape == (768, 256)
    for n in ("gate_proj", "up_proj"):
        assert torch.equal(w[f"layers.0.mlp.{n}.weight"].dequantize(torch.float32), before[f"layers.0.mlp.{n}.weight"])
    for n in ("q_proj", "k_proj", "v_proj"):
        name = f"layers.1.self_attn.{n}.weight"
        assert torch.equal(w[name].dequantize(torch.float32), before[name])
    mixed = w["layers.2.mlp.gate_up_proj.weight"]            # two global scales: bf16
    assert isinstance(mixed, torch.Tensor) and mixed.dtype == torch.bfloat16
    want = torch.cat([before["layers.2.mlp.gate_proj.weight"], before["layers.2.mlp.up_proj.weight"]])
    assert torch.equal(mixed, want.to(torch.bfloat16))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_weight_preparation_keeps_every_weight(tmp_path, fmt, moe, seed):
    """The CUDA model's load-time preparation (gate|up, q|k|v, qkv|z and GDN-input fusions, the shared
    expert folded into the experts) over a pre-quantised checkpoint loaded for the CUDA backend (bf16,
    kept weights quantised): every weight still reads as the checkpoint's, quantised ones exactly,
    the fused groups whose exporter shared a global scale stay quantised."""
    from ranks.model_cuda import _fold_shared_experts, _fuse_gate_up, _fuse_gdn_inputs, _fuse_projections

    spec, _ = write_quantised(str(tmp_path), tiny_config(moe), fmt, seed)
    plain = load_weights(Checkpoint(tmp_path), spec)
    w = load_weights(Checkpoint(tmp_path), spec, dtype=torch.bfloat16, keep_quantised=True)
    _fuse_gate_up(w)
    _fuse_projections(w)
    _fuse_gdn_inputs(w)
    _fold_shared_experts(w, spec.num_experts_per_tok)
    for name, want in plain.items():
        got = w[name]
        if isinstance(got, QuantWeight):
            assert rel(got.dequantize(torch.float32), want) < 1e-6, name
        else:
            assert torch.equal(got, want.to(torch.bfloat16)), name
    fused = "layers.3.self_attn.qkv_proj.weight"
    if KIND[fmt] == "fp8_block":              # k_proj's 64 rows are not a whole tile: q, k, v stay apart
        assert fused not in w and isinstance(w["layers.3.self_attn.k_proj.weight"], QuantWeight)
    else:
        assert isinstance(w[fused], QuantWeight) and w[fused].kind == KIND[fmt]
    if not moe:
        assert isinstance(w["layers.0.mlp.gate_up_proj.weight"], QuantWeight)


# ---- refused checkpoints --------------------------------------------------------------------------------

def _broken(tmp_path, fmt: str, seed: int, edit) -> str:
    cfg = tiny_config(False, num_hidden_layers=4, mtp_num_hidden_layers=0)
    spec = spec_from_hf(cfg)
    stored, _ = quantise(random_weights(spec, seed), fmt, seed)
    qc = edit(stored)
    write_checkpoint(str(tmp_path), stored, prefix="model.language_model.")
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({**cfg, **({} if qc is False else {"quantization_config": qc or QCONFIG[fmt]})}, f)
    return str(tmp_path)


W = "layers.0.linear_attn.in_proj_z"


def _drop(name):
    return lambda s: (s.pop(name), None)[1]


def _put(name, t):
    return lambda s: s.__setitem__(name, t)


BROKEN = {
    "fp8_weight_without_scale": ("fp8", _drop(W + ".weight_scale_inv"), W + ".weight", "dtype F8_E4M3"),
    "fp8_scale_without_weight": ("fp8", _drop(W + ".weight"), W + ".weight_scale_inv", "not in the checkpoint"),
    "fp8_scale_wrong_shape": ("fp8", _put(W + ".weight_scale_inv", torch.ones(2, 2)), W + ".weight_scale_inv",
                              "128x128 blocks"),
    "fp8_weight_not_fp8": ("fp8", lambda s: s.__setitem__(W + ".weight", s[W + ".weight"].view(torch.uint8)),
                           W + ".weight", "float8_e4m3fn"),
    "modelopt_without_weight_scale": ("modelopt", _drop(W + ".weight_scale"), W + ".weight_scale_2",
                                      "not in the checkpoint"),
    "modelopt_scale_wrong_shape": ("modelopt", _put(W + ".weight_scale", torch.ones(3, 3).to(F8)), W + ".weight_scale",
                                   "scales must be"),
    "modelopt_global_not_scalar": ("modelopt", _put(W + ".weight_scale_2", torch.ones(2)), W + ".weight_scale_2",
                                   "one float"),
    "ct_without_global": ("compressed-tensors", _drop(W + ".weight_global_scale"), W + ".weight_packed",
                          "not in the checkpoint"),
    "quantised_without_config": ("fp8", lambda s: False, "layers.", "no quantization_config"),
    "config_names_the_other_format": ("fp8", lambda s: QCONFIG["modelopt"], "layers.", "says nvfp4"),
}


@pytest.mark.parametrize("fmt,edit,tensor,words", BROKEN.values(), ids=BROKEN.keys())
def test_malformed_quantised_checkpoints_name_file_and_tensor(tmp_path, seed, fmt, edit, tensor, words):
    from runtime.config import load_spec

    d = _broken(tmp_path, fmt, seed, edit)
    with pytest.raises(CheckpointError) as exc:
        validate(Checkpoint(d), load_spec(d))
    msg = str(exc.value)
    assert "model.safetensors" in msg and f"model.language_model.{tensor}" in msg and words in msg, msg


@pytest.mark.parametrize("fmt,name,value,words", [
    ("compressed-tensors", ".weight_shape", torch.tensor([64, 32]), "packed codes are [64, 64]"),
    ("compressed-tensors", ".weight_global_scale", torch.tensor([0.0]), "positive"),
    ("modelopt", ".weight_scale_2", torch.tensor(float("nan")), "finite"),
], ids=["ct_weight_shape", "ct_zero_divisor", "modelopt_nan_global"])
def test_bad_scale_values_are_refused_at_load(tmp_path, seed, fmt, name, value, words):
    from runtime.config import load_spec

    d = _broken(tmp_path, fmt, seed, _put(W + name, value))
    with pytest.raises(CheckpointError) as exc:
        load_weights(Checkpoint(d), load_spec(d))
    assert f"model.language_model.{W}{name}" in str(exc.value) and words in str(exc.value), str(exc.value)


def test_weights_flag_on_a_pre_quantised_checkpoint_is_refused(tmp_path, seed, capsys, monkeypatch):
    """--weights quantises 16-bit checkpoints: asked of a pre-quantised one, serve exits 2 with a line
    naming the flag before anything listens (the device check is passed over: no GPU here), and the
    rule's message says what to do."""
    import shutil

    import server.serve
    from ranks.checkpoint_quant import quantised_conflict
    from ranks.demo import PACKAGED_DIR
    from server.cli import main

    spec, _ = write_quantised(str(tmp_path), tiny_config(False), "fp8", seed)
    assert quantised_conflict(spec, "bf16") is None
    assert quantised_conflict(spec_from_hf(tiny_config(False)), "nvfp4") is None
    assert "leave --weights at bf16" in quantised_conflict(spec, "nvfp4")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(PACKAGED_DIR, f), tmp_path)
    monkeypatch.setattr(server.serve, "_device_problem", lambda device: None)
    assert main(["serve", str(tmp_path), "--device", "cuda", "--weights", "fp8", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--weights fp8" in err and "already quantised (fp8-block" in err, err


def _corrupt(t: torch.Tensor, how: str, rng: random.Random) -> torch.Tensor:
    """`t` with one random element made NaN, +-inf or negative: fp8 tensors (nvfp4 scales, fp8 codes)
    by their bits (e4m3fn has no inf: 0x7f / 0xff are its NaNs), float scales by value."""
    if t.dtype == F8:
        bits = t.view(torch.uint8).clone().reshape(-1)
        nonzero = (bits & 0x7F).nonzero().flatten().tolist()
        i = rng.choice(nonzero)
        bits[i] = rng.choice([0x7F, 0xFF]) if how == "nan" else int(bits[i]) | 0x80
        return bits.reshape(t.shape).view(F8)
    flat = t.float().clone().reshape(-1)
    i = rng.randrange(flat.numel())
    flat[i] = {"nan": float("nan"), "inf": rng.choice([float("inf"), float("-inf")]),
               "negative": -(abs(float(flat[i])) or 1.0)}[how]
    return flat.reshape(t.shape).to(t.dtype)


SCALE = {"fp8": ".weight_scale_inv"}
BAD_VALUES = [(fmt, SCALE.get(fmt, ".weight_scale"), how) for fmt in FORMATS for how in ("nan", "inf", "negative")
              if not (KIND[fmt] == "nvfp4" and how == "inf")]
BAD_VALUES += [(fmt, ".weight", "nan") for fmt in FORMATS if KIND[fmt] != "nvfp4"]       # fp8 NaN codes


@pytest.mark.parametrize("fmt,part,how", BAD_VALUES, ids=[f"{f}{p}-{h}" for f, p, h in BAD_VALUES])
def test_non_finite_or_negative_scales_and_nan_codes_are_refused(tmp_path, seed, fmt, part, how):
    """One NaN, infinite or negative per-tile / per-row / per-tensor / per-group scale (or an fp8 NaN
    code) is refused when read, naming the file, the tensor and the element, both dequantised (CPU)
    and kept quantised (CUDA); they loaded, as NaN weights or weights of the wrong sign."""
    from runtime.config import load_spec

    rng = random.Random(seed)
    d = _broken(tmp_path, fmt, seed, lambda s: s.__setitem__(W + part, _corrupt(s[W + part], how, rng)))
    spec = load_spec(d)
    for load in (lambda: load_weights(Checkpoint(d), spec),
                 lambda: load_shard(Checkpoint(d), spec, 0, 1, keep_quantised=True)):
        with pytest.raises(CheckpointError) as exc:
            load()
        msg = str(exc.value)
        assert "model.safetensors" in msg and f"'model.language_model.{W}{part}'" in msg, msg
        assert "finite" in msg, msg


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_nvfp4_scales_stored_as_uint8_bits_load_as_fp8(tmp_path, seed, fmt):
    """Some exporters store NVFP4 group scales as uint8 (the e4m3fn bits): they decode as fp8, dequantised
    and kept quantised alike, not as integers."""
    spec = spec_from_hf(tiny_config(False))
    a, b = tmp_path / "fp8", tmp_path / "u8"
    for d, view in ((a, False), (b, True)):
        stored, _ = quantise(random_weights(spec, seed), fmt, seed)
        if view:
            stored = {n: t.view(torch.uint8) if t.dtype == F8 else t for n, t in stored.items()}
        write_checkpoint(str(d), stored)
    want, got = (load_weights(Checkpoint(d), spec_from_hf({**tiny_config(False), "quantization_config": QCONFIG[fmt]}))
                 for d in (a, b))
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    spec = spec_from_hf({**tiny_config(False), "quantization_config": QCONFIG[fmt]})
    kept = load_shard(Checkpoint(b), spec, 0, 1, keep_quantised=True)
    for n, t in kept.items():
        if isinstance(t, QuantWeight):
            assert rel(t.dequantize(torch.float32), want[n]) < 1e-6, n      # 1/divisor: one more rounding


ORPHANS = {
    "input_scale_of_no_weight": ("modelopt", "layers.0.linear_attn.in_proj_y.input_scale"),
    "input_global_scale_of_no_layer": ("compressed-tensors", "layers.9.mlp.down_proj.input_global_scale"),
    "weight_shape_of_no_weight": ("compressed-tensors", "layers.1.mlp.gate_up.weight_shape"),
    "k_scale_of_a_gdn_layer": ("modelopt", "layers.0.self_attn.k_scale"),
    "v_scale_of_no_layer": ("modelopt-fp8", "layers.12.self_attn.v_proj.v_scale"),
}


@pytest.mark.parametrize("fmt,name", ORPHANS.values(), ids=ORPHANS.keys())
def test_activation_and_kv_scales_of_nothing_are_refused(tmp_path, seed, fmt, name):
    """Activation / KV-cache scales are accepted unused beside the weight or attention layer they belong
    to (ModelOpt's self_attn.k_proj.k_scale, compressed-tensors' self_attn.k_scale); one that belongs to
    nothing the config has is an unexpected tensor, as any other (it was silently ignored)."""
    from runtime.config import load_spec

    value = torch.rand((), generator=torch.Generator().manual_seed(seed)) + 0.1
    kv = ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale", "self_attn.k_scale", "self_attn.v_scale")
    ok = _broken(tmp_path / "ok", fmt, seed, lambda s: s.update({"layers.3." + n: value.clone() for n in kv}))
    validate(Checkpoint(ok), load_spec(ok))
    d = _broken(tmp_path / "bad", fmt, seed, _put(name, value))
    with pytest.raises(CheckpointError) as exc:
        validate(Checkpoint(d), load_spec(d))
    msg = str(exc.value)
    assert "model.safetensors" in msg and f"'model.language_model.{name}'" in msg and "unexpected" in msg, msg


def test_nvfp4_codes_without_their_weight_scale_2_say_so(tmp_path, seed):
    """A ModelOpt NVFP4 weight whose weight_scale_2 is missing reads as an fp8 weight with a weight_scale;
    the message names the missing global scale rather than only asking for float8_e4m3fn."""
    from runtime.config import load_spec

    d = _broken(tmp_path, "modelopt", seed, _drop(W + ".weight_scale_2"))
    with pytest.raises(CheckpointError) as exc:
        validate(Checkpoint(d), load_spec(d))
    msg = str(exc.value)
    assert f"'model.language_model.{W}.weight'" in msg and f"{W}.weight_scale_2" in msg and "missing" in msg, msg


def test_the_wordwise_fp8_nan_scan_equals_the_bytewise_test(seed):
    """has_fp8_nan against (b & 0x7f) == 0x7f on random codes: lengths that are not whole words, views
    that start off a word boundary, NaN codes (0x7f, 0xff) at the start, the end, inside, none; and
    the near misses 0x7e / 0xfe / 0x80 / 0x00, which are numbers."""
    from ranks.checkpoint_quant import has_fp8_nan
    g = torch.Generator().manual_seed(seed)
    for n in (1, 7, 8, 9, 63, 64, 1000, 4099):
        for where in (None, 0, n - 1, n // 2):
            base = torch.randint(0, 256, (n + 3,), generator=g, dtype=torch.uint8)
            base[(base & 0x7F) == 0x7F] = torch.tensor([0x7E, 0xFE, 0x80, 0x00], dtype=torch.uint8)[
                torch.randint(0, 4, (int(((base & 0x7F) == 0x7F).sum()),), generator=g)]
            for off in (0, 1, 3):
                t = base[off:off + n].clone() if off == 0 else base[off:off + n]
                if where is not None:
                    t[where] = [0x7F, 0xFF][int(torch.randint(0, 2, (1,), generator=g))]
                assert has_fp8_nan(t) == bool(((t & 0x7F) == 0x7F).any()) == (where is not None), (n, where, off)
