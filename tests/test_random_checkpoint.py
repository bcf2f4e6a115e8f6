"""Random checkpoints: presets, weight generation, both on-disk layouts, parity with transformers."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from ranks import random_checkpoint as rc
from ranks.model import Batch, HybridModel
from ranks.weights import Checkpoint, expected_shapes, load_weights
from runtime.config import FULL_ATTENTION, LINEAR_ATTENTION, load_spec
from runtime.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {"tiny": None, "tiny-moe": None, "small": 4}     # preset -> layer override (small shrunk for speed)
SEQ = 70                                                 # > 64: two chunks of the chunked delta rule


def _ckpt_seed() -> int:
    conftest = sys.modules.get("tests.conftest") or sys.modules.get("conftest")
    return getattr(conftest, "BASE_SEED", 0) % 1000


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(preset, layout, dtype) -> directory of a checkpoint written once per module."""
    cache = {}

    def get(preset, layout="official", dtype="float32"):
        key = (preset, layout, dtype)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{preset}-{layout}-{dtype}")
            rc.write_random_checkpoint(d, preset, seed=_ckpt_seed(), dtype=dtype, layout=layout,
                                       num_layers=SMALL.get(preset), progress=False)
            cache[key] = str(d)
        return cache[key]
    return get


def _ids(n, high, seed):
    return torch.randint(0, high, (n,), generator=torch.Generator().manual_seed(seed))


def _forward(model, ids):
    state = model.new_state(1, 4)
    batch = Batch(ids, [len(ids)], [0], [0], torch.arange(4, dtype=torch.int32)[None])
    return model.forward(batch, state, logits="all"), state, batch


# --------------------------------------------------------------------------------------------------
# Presets and shapes


@pytest.mark.parametrize("preset", list(rc.PRESETS))
def test_preset_is_valid_and_tp2_divisible(preset):
    spec = rc.spec_for(preset)
    for field in ("num_heads", "num_kv_heads", "linear_num_key_heads", "linear_num_value_heads", "vocab_size",
                  "hidden_size"):
        assert getattr(spec, field) % 2 == 0, field
    if spec.is_moe:
        assert spec.num_experts % 2 == 0 and spec.moe_intermediate_size % 2 == 0
        assert spec.shared_expert_intermediate_size % 2 == 0
    else:
        assert spec.intermediate_size % 2 == 0
    cfg = rc.PRESETS[preset]
    assert sum(cfg["rope_parameters"]["mrope_section"]) * 2 == spec.rotary_dim
    assert spec.mtp_num_layers == 1 and not spec.tie_word_embeddings
    assert spec.layer_types[3] == FULL_ATTENTION and spec.layer_types[:3] == (LINEAR_ATTENTION,) * 3
    assert rc.tokenizer_size_for(spec.vocab_size) <= spec.vocab_size


def test_tiny_presets_follow_spec_6_1():
    for preset in ("tiny", "tiny-moe"):
        s = rc.spec_for(preset)
        assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (64, 8, 4, 2, 32)
        assert (s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim,
                s.linear_value_head_dim, s.conv_kernel, s.rotary_dim, s.rope_theta) == (2, 4, 16, 16, 4, 8, 1e7)
        assert s.full_attention_layers == (3, 7)
    assert rc.spec_for("tiny").intermediate_size == 128
    m = rc.spec_for("tiny-moe")
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size) == (
        8, 2, 32, 48)
    assert 10e6 <= rc.param_counts(rc.spec_for("small"))["total"] <= 30e6


@pytest.mark.parametrize("preset,fields,text_b,mtp_b", [
    ("27b", dict(hidden_size=5120, num_layers=64, num_heads=24, num_kv_heads=4, head_dim=256, rotary_dim=64,
                 linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                 linear_value_head_dim=128, intermediate_size=17408, conv_dim=10240, q_width=6144), 26.896, 0.425),
    ("35b-a3b", dict(hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2, head_dim=256, rotary_dim=64,
                     linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                     linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512, conv_dim=8192, q_width=4096), 34.661, 0.845),
])
def test_full_size_presets_match_spec(preset, fields, text_b, mtp_b):
    spec = rc.spec_for(preset)
    for k, v in fields.items():
        assert getattr(spec, k) == v, k
    assert spec.vocab_size == 248320 and spec.rope_theta == 1e7 and spec.rms_norm_eps == 1e-6
    assert spec.max_position_embeddings == 262144 and spec.mtp_num_layers == 1
    assert spec.eos_token_ids == (248044,) and spec.bos_token_id == 248044
    assert spec.full_attention_layers == tuple(range(3, spec.num_layers, 4))
    counts = rc.param_counts(spec)                           # from shapes, nothing allocated
    assert round(counts["text"] / 1e9, 3) == text_b
    assert round(counts["mtp"] / 1e9, 3) == mtp_b
    # the same preset shrunk keeps its widths
    short = rc.spec_for(preset, num_layers=4)
    assert short.num_layers == 4 and short.full_attention_layers == (3,)
    assert short.hidden_size == spec.hidden_size and short.vocab_size == spec.vocab_size


@pytest.mark.parametrize("preset", ["27b", "35b-a3b", "tiny-moe"])
def test_shapes_match_transformers_on_meta_device(preset):
    transformers = pytest.importorskip("transformers")
    cfg = rc.text_config(preset)
    moe = cfg.pop("model_type") == "qwen3_5_moe_text"
    config_cls = transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig
    model_cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    with torch.device("meta"):
        model = model_cls(config_cls(**cfg))
    theirs = {k.removeprefix("model."): tuple(v.shape) for k, v in model.state_dict().items()}
    ours = expected_shapes(rc.spec_for(preset), fused_experts=True, include_mtp=False)
    assert theirs == ours


# --------------------------------------------------------------------------------------------------
# Weight generation


def test_random_tensors_deterministic_and_order_independent(seed):
    spec = rc.spec_for("tiny-moe")
    full = rc.random_tensors(spec, seed=seed, dtype=torch.float32)
    assert {k: tuple(v.shape) for k, v in full.items()} == expected_shapes(spec, fused_experts=True, include_mtp=True)
    names = list(reversed(list(full)))[::3]
    for name, t in rc.iter_random_tensors(spec, seed=seed, dtype=torch.float32, names=names):
        assert torch.equal(t, full[name]), name
    bf16 = rc.random_tensors(spec, seed=seed, dtype="bfloat16")
    for name, t in bf16.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, full[name].to(torch.bfloat16)), name
    other = rc.random_tensors(spec, seed=seed + 1, dtype=torch.float32)
    assert not torch.equal(other["embed_tokens.weight"], full["embed_tokens.weight"])
    # distinct tensors of equal shape are not copies of each other
    assert not torch.equal(full["layers.0.input_layernorm.weight"], full["layers.0.post_attention_layernorm.weight"])
    with pytest.raises(KeyError):
        next(rc.iter_random_tensors(spec, names=["layers.99.mlp.gate.weight"]))


def test_randomisation_follows_spec_6_1(seed):
    spec = rc.spec_for("small")
    w = dict(rc.iter_random_tensors(spec, seed=seed, dtype=torch.float32, names=[
        "norm.weight", "layers.3.self_attn.q_norm.weight", "layers.0.linear_attn.norm.weight",
        "layers.0.linear_attn.A_log", "layers.0.linear_attn.dt_bias", "layers.0.linear_attn.conv1d.weight",
        "layers.0.linear_attn.in_proj_qkv.weight", "mtp.pre_fc_norm_hidden.weight", "lm_head.weight"]))
    assert abs(w["norm.weight"].mean()) < 0.1 and 0.2 < w["norm.weight"].std() < 0.4
    assert 0.15 < w["layers.3.self_attn.q_norm.weight"].std() < 0.45
    assert 0.15 < w["mtp.pre_fc_norm_hidden.weight"].std() < 0.45
    gated = w["layers.0.linear_attn.norm.weight"]
    assert abs(gated.mean() - 1) < 0.15 and 0.15 < gated.std() < 0.45
    a = w["layers.0.linear_attn.A_log"]
    assert (a >= 0).all() and (a <= math.log(16) + 1e-6).all() and a.std() > 0.1
    assert w["layers.0.linear_attn.dt_bias"].std() > 0.3
    assert 0.2 < w["layers.0.linear_attn.conv1d.weight"].std() < 0.4
    qkv = w["layers.0.linear_attn.in_proj_qkv.weight"]
    assert abs(qkv.std().item() * math.sqrt(spec.hidden_size) - rc.LINEAR_GAIN) < 0.05


def test_block_generation_is_deterministic(monkeypatch, seed):
    spec = rc.spec_for("tiny")
    monkeypatch.setattr(rc, "_BLOCK_ELEMENTS", 64 * 100)          # 100 rows per block, 11 blocks
    a = rc.random_tensor("embed_tokens.weight", (1024, 64), spec, seed, torch.float32)
    monkeypatch.setattr(rc, "_WORKERS", 1)
    b = rc.random_tensor("embed_tokens.weight", (1024, 64), spec, seed, torch.float32)
    assert torch.equal(a, b)
    assert not torch.equal(a[:100], a[100:200])
    assert 0.9 < a.std() < 1.1


# --------------------------------------------------------------------------------------------------
# Written checkpoints


@pytest.mark.parametrize("preset", list(SMALL))
def test_checkpoint_loads_and_runs_in_both_layouts(preset, written, seed):
    ids = _ids(SEQ, rc.tokenizer_size_for(rc.spec_for(preset).vocab_size), seed)
    logits = {}
    for layout in ("official", "hf"):
        d = written(preset, layout)
        spec = load_spec(d)
        assert spec.num_layers == (SMALL[preset] or rc.spec_for(preset).num_layers)
        model = HybridModel.from_dir(d)
        assert model.has_mtp
        out, state, batch = _forward(model, ids)
        x = out.logits
        assert x.shape == (SEQ, spec.vocab_size) and torch.isfinite(x).all()
        assert x.std(-1).min() > 1.0                                   # not a flat distribution
        assert x.softmax(-1).max(-1).values.mean() < 0.9               # nor a one-hot one
        assert len(set(x.argmax(-1).tolist())) > SEQ // 2              # predictions vary across positions
        mtp = model.mtp_forward(batch, out.hidden, state).logits
        assert torch.isfinite(mtp).all() and mtp.std(-1).min() > 0.5
        logits[layout] = x
    # same tensors, different names and expert layout. Bitwise equality is not guaranteed: CPU matmul
    # rounding depends on the alignment of the mmap'd tensors, which differs between the two files.
    a, b = logits["official"], logits["hf"]
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_layouts_on_disk(written):
    off, hf = written("tiny-moe", "official"), written("tiny-moe", "hf")
    c = json.load(open(os.path.join(off, "config.json")))
    assert c["model_type"] == "qwen3_5_moe" and c["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert c["text_config"]["model_type"] == "qwen3_5_moe_text" and "vision_config" in c
    assert c["tie_word_embeddings"] is False
    c = json.load(open(os.path.join(hf, "config.json")))
    assert c["model_type"] == "qwen3_5_moe_text" and c["architectures"] == ["Qwen3_5MoeForCausalLM"]
    keys_off = {i.key for i in Checkpoint(off).tensors.values()}
    keys_hf = {i.key for i in Checkpoint(hf).tensors.values()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in keys_off
    assert "mtp.layers.0.mlp.experts.down_proj" in keys_off and "lm_head.weight" in keys_off
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in keys_hf
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in keys_hf
    assert not any(k.startswith("model.language_model.") for k in keys_hf)
    spec = load_spec(off)
    a = load_weights(Checkpoint(off), spec)
    b = load_weights(Checkpoint(hf), spec)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tokenizer_and_ids_in_checkpoint(written):
    d = written("tiny")
    tok = Tokenizer.from_dir(d)
    spec = load_spec(d)
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    assert tok.vocab_size == rc.tokenizer_size_for(spec.vocab_size) <= spec.vocab_size
    assert spec.eos_token_ids == (eot,) and spec.bos_token_id == eot
    assert tok.eos_token_ids == {eot, im_end}
    gen = json.load(open(os.path.join(d, "generation_config.json")))
    assert gen["eos_token_id"] == [im_end, eot] and gen["pad_token_id"] == eot
    cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    text = tok.render_chat([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.parametrize("preset", list(SMALL))
def test_logits_match_transformers(preset, written, seed):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cls = transformers.Qwen3_5MoeForCausalLM if rc.spec_for(preset).is_moe else transformers.Qwen3_5ForCausalLM
    ids = _ids(SEQ, rc.tokenizer_size_for(rc.spec_for(preset).vocab_size), seed)
    d = written(preset, "official")
    ours = _forward(HybridModel.from_dir(d), ids)[0].logits
    hf = cls.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    rel = ((ref - ours).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, f"{preset}: max |ours - transformers| / max |logit| = {rel:.2e}"


def test_transformers_loads_hf_layout_and_tokenizer(written, seed):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    d = written("tiny-moe", "hf")
    ids = _ids(20, rc.tokenizer_size_for(1024), seed)
    ref = transformers.Qwen3_5MoeForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0]
    ours = _forward(HybridModel.from_dir(d), ids)[0].logits
    assert ((theirs - ours).abs().max() / theirs.abs().max()).item() < 1e-4
    hf_tok = transformers.AutoTokenizer.from_pretrained(d)
    text = "<|im_start|>user\nHello, wörld! 你好 😀<|im_end|>\n<think>"
    assert hf_tok.encode(text, add_special_tokens=False) == Tokenizer.from_dir(d).encode(text)


def test_bfloat16_checkpoint(written):
    d16, d32 = written("tiny", "official", "bfloat16"), written("tiny", "official", "float32")
    assert load_spec(d16).dtype == "bfloat16"
    ck16, ck32 = Checkpoint(d16), Checkpoint(d32)
    assert {i.dtype for i in ck16.tensors.values()} == {"BF16"}
    for name in ("embed_tokens.weight", "layers.3.self_attn.q_proj.weight", "layers.0.linear_attn.A_log"):
        assert torch.equal(ck16.read(name), ck32.read(name).to(torch.bfloat16))
    out = _forward(HybridModel.from_dir(d16, dtype=torch.bfloat16), _ids(SEQ, 1000, 0))[0]
    assert torch.isfinite(out.logits).all() and out.logits.float().std(-1).min() > 1.0


def test_sharded_write_matches_single_file(tmp_path, written):
    d = tmp_path / "sharded"
    r = rc.write_random_checkpoint(d, "tiny-moe", seed=_ckpt_seed(), dtype="float32", layout="hf",
                                   max_shard_bytes=300_000, progress=False)
    shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(d)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.load(open(d / "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == r.num_bytes == 4 * r.num_params
    spec = load_spec(d)
    a = load_weights(Checkpoint(d), spec)
    b = load_weights(Checkpoint(written("tiny-moe", "hf")), spec)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # rewriting as one file drops the stale shards and index
    rc.write_random_checkpoint(d, "tiny-moe", seed=1, dtype="float32", layout="official", progress=False)
    assert sorted(f for f in os.listdir(d) if "safetensors" in f) == ["model.safetensors"]
    assert not torch.equal(load_weights(Checkpoint(d), spec)["embed_tokens.weight"], a["embed_tokens.weight"])


def test_custom_text_config_and_tied_embeddings(tmp_path, seed):
    cfg = rc.text_config("tiny", num_layers=4)
    cfg.update(tie_word_embeddings=True, vocab_size=512, mtp_num_hidden_layers=0)
    r = rc.write_random_checkpoint(tmp_path, cfg, seed=seed, dtype="float32", progress=False)
    assert r.spec.tie_word_embeddings and r.tokenizer_size <= 512
    names = Checkpoint(tmp_path).tensors
    assert "lm_head.weight" not in names and not any(n.startswith("mtp.") for n in names)
    x = _forward(HybridModel.from_dir(tmp_path), _ids(SEQ, r.tokenizer_size, seed))[0].logits
    assert torch.isfinite(x).all() and x.std(-1).min() > 1.0 and len(set(x.argmax(-1).tolist())) > SEQ // 2
    with pytest.raises(ValueError, match="too small"):
        rc.write_random_checkpoint(tmp_path / "x", dict(cfg, vocab_size=200), progress=False)
    with pytest.raises(ValueError, match="unknown preset"):
        rc.write_random_checkpoint(tmp_path / "y", "70b", progress=False)


def test_make_random_model_script(tmp_path):
    out = tmp_path / "m"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "make_random_model.py"), "--config", "tiny-moe",
           "--out", str(out), "--layers", "4", "--layout", "hf", "--dtype", "float32", "--seed", "3", "--quiet"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)   # not run from the repo
    assert p.returncode == 0, p.stderr
    assert "parameters" in p.stdout and "bytes" in p.stdout
    spec = load_spec(out)
    assert spec.num_layers == 4 and spec.is_moe and spec.dtype == "float32"
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "not empty" in p.stderr and "--force" in p.stderr
    # --force writes into it (in-process, through main())
    import importlib.util
    mod_spec = importlib.util.spec_from_file_location("make_random_model", os.path.join(ROOT, "scripts",
                                                                                        "make_random_model.py"))
    script = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(script)
    assert script.main(cmd[2:] + ["--force", "--layers", "8"]) == 0
    assert load_spec(out).num_layers == 8
