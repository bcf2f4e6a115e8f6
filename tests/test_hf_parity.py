"""HF parity: tandem's CPU reference forward against Hugging Face transformers (spec sections 2, 6, 7).

Tiny random Qwen3.5/3.6 text models are built with transformers' own config and model classes,
their weights randomised the way spec section 6.1 advises (zero-centred norms ~N(0, 0.3), gated
norm 1 + N(0, 0.3), dt_bias ~N(0, 1), conv ~N(0, 0.3), hot linear weights) so that (1 + w)-vs-w,
gate-order and head-grouping bugs cannot hide, and written to disk twice:

* the transformers layout: ``save_pretrained`` of the CausalLM (``model.`` prefix, text config,
  MoE experts per expert), and
* the official release layout: ``ranks.weights.write_checkpoint`` with the ``model.language_model.``
  prefix, MoE experts fused on disk (``gate_up_proj [X, 2I, E]``, ``down_proj [X, E, I]``), sharded
  with an index, a multimodal wrapper config.json and fake ``model.visual.*`` tensors.

Checked: float32 logits at every position of prompts of 1..300 tokens (one full prefill) within
1e-4 relative error per position; 32 greedy tokens (prefill, then one-column decode steps on the
recurrent delta-rule path) identical to ``generate``, with every step's logits within 1e-4; both
layouts load to identical weights in tandem; transformers itself loads the official layout
(CausalLM and ConditionalGeneration) with the same logits; a bfloat16 drift report against
transformers in bfloat16 (a noise-relative bound, not parity); and bf16 equality with transformers'
eager paths (equal to a few bf16 ulps). Uncommon shapes (conv kernels 1-6, widths not multiples of
64, no or one attention layer, top-1 / top-all routing) get a prefill, decode steps and tp 2 shards
each.

For MoE configs, prompts whose reference run puts some router's k-th and (k+1)-th logits within
ROUTER_GAP of each other are redrawn (deterministically): at such a near-tie float32 rounding alone
picks the expert. Everything is seeded from the session seed (TANDEM_TEST_SEED replays a run); a
summary of the observed errors is printed at the end of the session.
"""

from __future__ import annotations

import json
import math
import os
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.2")

from safetensors.torch import load_file, save_file  # noqa: E402

from kernels import reference as ops  # noqa: E402
from ranks.kvcache import PAGE_SIZE  # noqa: E402
from ranks.model import Batch, HybridModel  # noqa: E402
from ranks.weights import Checkpoint, load_weights, write_checkpoint  # noqa: E402
from runtime.config import load_spec  # noqa: E402
from tests.conftest import BASE_SEED  # noqa: E402
from tests.util import rel  # noqa: E402

FP32_TOL = 1e-4          # per-position relative error, ours vs transformers (float32)
LAYOUT_TOL = 1e-5        # the same weights read from another file layout (only rounding may differ)
BF16_NOISE_FACTOR = 3.0  # bf16 drift report: ours-vs-fp32 <= factor * transformers_bf16-vs-fp32 + slack
BF16_NOISE_SLACK = 0.02
BF16_EAGER_TOL = 1e-3    # bf16, against transformers with the same rounding points (eager attention/experts)
ROUTER_GAP = 3e-5        # MoE prompts whose reference run has a top-k router logit gap below this are redrawn
MAX_PROMPT_TRIES = 50
PROMPT_LENGTHS = [1, 7, 64, 65, 300]
GREEDY_PROMPT_LENGTHS = [1, 7, 65]
NEW_TOKENS = 32
VOCAB = 256
HIDDEN = 64


def _rope(head_dim: int, factor: float = 0.25, theta: float = 1e7) -> dict[str, Any]:
    """rope_parameters with an interleaved M-RoPE section summing to rotary_dim / 2 (as real configs do)."""
    half = int(head_dim * factor) // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]      # e.g. 4 -> [2, 1, 1], 6 -> [2, 2, 2]
    assert sum(section) == half
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor,
            "mrope_section": section, "mrope_interleaved": True}


FA, LA = "full_attention", "linear_attention"


@dataclass(frozen=True)
class ParityConfig:
    id: str
    moe: bool
    kwargs: dict[str, Any] = field(hash=False)

    def text_config(self):
        cls = transformers.Qwen3_5MoeTextConfig if self.moe else transformers.Qwen3_5TextConfig
        kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=512, linear_conv_kernel_dim=4,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
        kw.update(self.kwargs)
        return cls(**kw)


_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

CONFIGS = [
    # The spec's reference shape: GQA 2, GDN value/key ratio 2, 3:1 pattern, untied, head_dim 32 != 64/4.
    ParityConfig("dense-gqa2-gva2-3to1-untied", False, dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        intermediate_size=128, rope_parameters=_rope(32), tie_word_embeddings=False)),
    # MHA (GQA ratio 1), GDN ratio 1, 1:1 pattern starting with attention, tied, DK != DV, theta 1e4, eps 1e-5.
    ParityConfig("dense-gqa1-gva1-1to1-tied", False, dict(
        num_hidden_layers=4, layer_types=[FA, LA, FA, LA], num_attention_heads=4, num_key_value_heads=4, head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=24,
        intermediate_size=96, rope_parameters=_rope(24, theta=1e4), rms_norm_eps=1e-5, tie_word_embeddings=True)),
    # GQA ratio 8 (one KV head), GDN ratio 3 with a single key head, explicit irregular pattern.
    ParityConfig("dense-gqa8-gva3-FLLFL-untied", False, dict(
        num_hidden_layers=5, layer_types=[FA, LA, LA, FA, LA], num_attention_heads=8, num_key_value_heads=1,
        head_dim=48,
        linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=16,
        intermediate_size=128, rope_parameters=_rope(48), tie_word_embeddings=False)),
    # Half-rotary variant (rotary dim 8 of head_dim 16), 1:1 pattern starting with GDN.
    ParityConfig("dense-gqa2-gva2-rope0.5-LFLFLF-untied", False, dict(
        num_hidden_layers=6, layer_types=[LA, FA] * 3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
        intermediate_size=128, rope_parameters=_rope(16, factor=0.5), tie_word_embeddings=False)),
    # MoE with shared expert, GQA 8, GDN ratio 2, 3:1 pattern, tied.
    ParityConfig("moe-shared-gqa8-gva2-3to1-tied", True, dict(
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        rope_parameters=_rope(32), tie_word_embeddings=True, **_MOE)),
    # MoE with shared expert, 16 experts top-4, MHA, GDN ratio 3, explicit pattern, untied.
    ParityConfig("moe-shared-gqa1-gva3-LFLLF-untied", True, dict(
        num_hidden_layers=5, layer_types=[LA, FA, LA, LA, FA], num_attention_heads=4, num_key_value_heads=4,
        head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=8,
        rope_parameters=_rope(32), tie_word_embeddings=False,
        **dict(_MOE, num_experts=16, num_experts_per_tok=4))),
]

# Observed errors, printed in the terminal summary (fp32 columns are parity, bf16 columns are drift).
REPORT: dict[str, dict[str, float]] = {}


def _note(cfg_id: str, key: str, value: float) -> None:
    """Keep the worst value seen for (config, key)."""
    row = REPORT.setdefault(cfg_id, {})
    row[key] = max(row.get(key, 0.0), value)


class _ReportPlugin:
    def pytest_terminal_summary(self, terminalreporter):
        if not REPORT:
            return
        tr = terminalreporter
        tr.write_sep("-", f"HF parity report (tandem test seed {BASE_SEED})")
        tr.write_line("fp32*: max per-position relative error vs transformers (bound 1e-4, parity); layouts/hf_*: "
                      "same weights from the other checkpoint layout; bf16*: whole-prompt relative error "
                      "(drift report, not parity)")
        for cfg_id, values in REPORT.items():
            tr.write_line(f"{cfg_id}:")
            tr.write_line("    " + ", ".join(f"{k}={v:.2e}" for k, v in sorted(values.items())))


@pytest.fixture(scope="module", autouse=True)
def _report_plugin(request):
    pm = request.config.pluginmanager
    if not pm.has_plugin("tandem-hf-parity-report"):
        pm.register(_ReportPlugin(), "tandem-hf-parity-report")
    yield


# --------------------------------------------------------------------------------------------------
# Building the models and checkpoints


def _module_seed(name: str) -> int:
    return (BASE_SEED + zlib.crc32(name.encode())) % 2**31


def randomise_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Spec section 6.1: every parameter drawn from `gen` so no default (0 / 1 / 1.0) hides a bug.

    Linear weights get std 0.1 (5x transformers' 0.02 init, so softmaxes and routers are far from
    uniform). exp(A_log) is drawn from [0.1, 2]: per-token decays g = -A softplus(a + dt_bias) still
    reach -10 and below, but not the -30 that A up to 8 gives; with decays that strong the chunked
    delta rule's within-chunk cumulative sums (transformers' and ours alike) lose ~1e-5 of precision
    in float32 and hot layers amplify that to ~1e-4 at single positions, which made the 1e-4 bound
    a coin toss against transformers' own float32 error (measured against a float64 reference).
    """
    with torch.no_grad():
        for name, p in model.named_parameters():          # tied lm_head is the same Parameter: drawn once
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("linear_attn.norm.weight"):   # gated norm: plain w, stored ~1
                v = 1.0 + 0.3 * r
            elif name.endswith("norm.weight"):             # zero-centred (1 + w): layer, final, q/k norms
                v = 0.3 * r
            elif name.endswith("dt_bias"):
                v = r
            elif name.endswith("A_log"):
                v = torch.empty(p.shape).uniform_(0.1, 2.0, generator=gen).log()
            elif name.endswith("conv1d.weight"):
                v = 0.3 * r
            elif name.endswith("embed_tokens.weight"):
                v = 0.5 * r
            else:                                          # linear layers and fused expert tensors
                v = 0.1 * r
            p.copy_(v.to(p.dtype))


def _hf_causal_class(moe: bool):
    return transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM


def _hf_conditional_class(moe: bool):
    return transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration


def _official_tensors(hf_dir: str, cfg: ParityConfig, n_layers: int) -> dict[str, torch.Tensor]:
    """Canonical-named tensors of the official layout, built from the save_pretrained file by hand:
    ``model.`` stripped, per-expert MoE weights fused as the release checkpoints store them."""
    raw = load_file(os.path.join(hf_dir, "model.safetensors"))
    t = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in raw.items()}
    if cfg.moe:
        X = cfg.kwargs["num_experts"]
        for i in range(n_layers):
            p = f"layers.{i}.mlp.experts."
            t[p + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}{e}.gate_proj.weight"),
                                                            t.pop(f"{p}{e}.up_proj.weight")]) for e in range(X)])
            t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(X)])
    return t


def _wrapper_config(text_cfg, cfg: ParityConfig) -> dict[str, Any]:
    """config.json of the official multimodal wrapper around `text_cfg`, with a tiny vision config."""
    text = text_cfg.to_dict()
    for key in ("architectures", "id2label", "label2id", "transformers_version", "_name_or_path", "return_dict",
                "output_hidden_states", "output_attentions", "chunk_size_feed_forward", "is_encoder_decoder",
                "problem_type"):
        text.pop(key, None)
    text["dtype"] = "float32"
    wrapper = "qwen3_5_moe" if cfg.moe else "qwen3_5"
    assert text["model_type"] == wrapper + "_text"
    arch = "Qwen3_5MoeForConditionalGeneration" if cfg.moe else "Qwen3_5ForConditionalGeneration"
    vision = dict(model_type=wrapper + "_vision", depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  in_channels=3, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=HIDDEN, num_position_embeddings=16)
    return {"architectures": [arch], "model_type": wrapper, "text_config": text, "vision_config": vision,
            "tie_word_embeddings": text_cfg.tie_word_embeddings, "image_token_id": 248056,
            "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054}


def _fake_vision_tensors(config: dict[str, Any], cfg: ParityConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``model.visual.*`` tensors with the names and shapes transformers expects for the tiny vision
    config (so ConditionalGeneration loads them all), filled with noise: tandem must ignore them."""
    conf_cls = transformers.Qwen3_5MoeConfig if cfg.moe else transformers.Qwen3_5Config
    conf = conf_cls(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        shell = _hf_conditional_class(cfg.moe)(conf)
    out = {k: torch.randn(v.shape, generator=gen) for k, v in shell.state_dict().items()
           if k.startswith("model.visual.")}
    assert out, "the wrapper model has no vision tensors?"
    return out


def _write_official(out_dir: str, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                    vision: dict[str, torch.Tensor]) -> None:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    files = write_checkpoint(out_dir, tensors, prefix="model.language_model.", max_shard_bytes=total // 3 + 1)
    assert len(files) > 1, "expected a sharded checkpoint with an index"
    save_file({k: v.contiguous() for k, v in vision.items()}, os.path.join(out_dir, "model-visual.safetensors"),
              metadata={"format": "pt"})
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    index["weight_map"].update({k: "model-visual.safetensors" for k in vision})
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in vision.values())
    with open(index_path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


@dataclass
class Built:
    cfg: ParityConfig
    hf: torch.nn.Module          # transformers CausalLM, float32, randomised (the reference)
    hf_dir: str                  # save_pretrained layout
    official_dir: str            # official multimodal/fused layout
    vision_keys: frozenset[str]
    ours: HybridModel            # loaded from hf_dir, float32
    cache: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


@pytest.fixture(scope="module", params=CONFIGS, ids=[c.id for c in CONFIGS])
def built(request, tmp_path_factory) -> Built:
    cfg: ParityConfig = request.param
    seed = _module_seed(cfg.id)
    gen = torch.Generator().manual_seed(seed)
    text_cfg = cfg.text_config()
    with torch.random.fork_rng():
        torch.manual_seed(seed)                    # transformers' own init; everything is redrawn below
        hf = _hf_causal_class(cfg.moe)(text_cfg).float().eval()
    randomise_(hf, gen)
    root = tmp_path_factory.mktemp(cfg.id)
    hf_dir, official_dir = str(root / "hf"), str(root / "official")
    hf.save_pretrained(hf_dir)
    config = _wrapper_config(text_cfg, cfg)
    vision = _fake_vision_tensors(config, cfg, gen)
    _write_official(official_dir, _official_tensors(hf_dir, cfg, text_cfg.num_hidden_layers), config, vision)
    ours = HybridModel.from_dir(hf_dir)
    return Built(cfg, hf, hf_dir, official_dir, frozenset(vision), ours)


# --------------------------------------------------------------------------------------------------
# Helpers


@torch.no_grad()
def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=ids[None], use_cache=False).logits[0]


def _router_gap(hf: torch.nn.Module, ids: torch.Tensor) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit over every token and MoE layer of a
    transformers forward over `ids` (inf for dense models)."""
    gaps: list[float] = []

    def hook(mod, args, out):
        top = out[0].float().topk(mod.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in hf.model.layers
             if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "top_k")]
    if not hooks:
        return math.inf
    try:
        _hf_logits(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    return min(gaps)


def _prompts(built: Built, T: int, seed: int):
    """Random prompts of T ids, deterministic in `seed`. For MoE, candidates whose transformers run
    has a near-tie in some router's top-k (a gap below ROUTER_GAP) are passed over by the caller:
    at a near-tie, float32 rounding alone decides which expert wins, and both answers are right."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(MAX_PROMPT_TRIES):
        yield torch.randint(0, VOCAB, (T,), generator=gen)
    raise AssertionError(f"{built.cfg.id}: no prompt of {T} tokens without a router near-tie in "
                         f"{MAX_PROMPT_TRIES} tries (gap < {ROUTER_GAP})")


def _prompt(built: Built, T: int, seed: int) -> torch.Tensor:
    for ids in _prompts(built, T, seed):
        if not built.cfg.moe or _router_gap(built.hf, ids) >= ROUTER_GAP:
            return ids


def _table(pages: int, seed: int, spare: int = 3) -> tuple[torch.Tensor, int]:
    """A scrambled page table of `pages` entries out of a pool of pages + spare (paging must not matter)."""
    pool = pages + spare
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(seed ^ 0x5EED))
    return perm[:pages].to(torch.int32)[None], pool


def _prefill(model: HybridModel, ids: torch.Tensor, seed: int, logits: str = "all") -> torch.Tensor:
    T = ids.shape[0]
    table, pool = _table(math.ceil(T / PAGE_SIZE), seed)
    state = model.new_state(num_slots=2, num_pages=pool)
    return model.forward(Batch(ids, [T], [0], [1], table), state, logits=logits).logits


def _row_rel(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error ||ours_t - ref_t|| / ||ref_t|| of every position t, in float64."""
    a, b = ours.double(), ref.double()
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def _worst(errs: torch.Tensor) -> str:
    i = int(errs.argmax())
    return f"max per-position relative error {float(errs[i]):.3e} at position {i} of {errs.numel()}"


def _bf16_pair(built: Built, eager: bool = False) -> tuple[HybridModel, torch.nn.Module]:
    """tandem and transformers loaded from the save_pretrained checkpoint in bfloat16 (cached)."""
    ours = built.get("ours_bf16", lambda: HybridModel.from_dir(built.hf_dir, dtype=torch.bfloat16))
    kwargs = dict(attn_implementation="eager", experts_implementation="eager") if eager else {}
    hf16 = built.get(f"hf_bf16_eager={eager}", lambda: _hf_causal_class(built.cfg.moe).from_pretrained(
        built.hf_dir, dtype=torch.bfloat16, **kwargs).eval())
    assert ours.dtype == torch.bfloat16 and next(hf16.parameters()).dtype == torch.bfloat16
    return ours, hf16


# --------------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("T", PROMPT_LENGTHS, ids=[f"T{t}" for t in PROMPT_LENGTHS])
def test_prefill_logits_match_transformers(built: Built, T: int, seed: int):
    """One full prefill: float32 logits at every position within 1e-4 of the transformers forward."""
    ids = _prompt(built, T, seed)
    ours = _prefill(built.ours, ids, seed)
    ref = _hf_logits(built.hf, ids)
    assert ours.shape == ref.shape == (T, VOCAB)
    errs = _row_rel(ours, ref)
    _note(built.cfg.id, "fp32_prefill", float(errs.max()))
    assert float(errs.max()) < FP32_TOL, f"{built.cfg.id}, T={T}: {_worst(errs)}"


@pytest.mark.parametrize("T", GREEDY_PROMPT_LENGTHS, ids=[f"T{t}" for t in GREEDY_PROMPT_LENGTHS])
def test_greedy_decode_matches_generate(built: Built, T: int, seed: int):
    """Prefill, then one column per step (recurrent delta rule): 32 greedy tokens equal to generate(),
    and the logits of every step within 1e-4 of generate()'s."""
    for ids in _prompts(built, T, seed):
        with torch.no_grad():
            gen_out = built.hf.generate(input_ids=ids[None], attention_mask=torch.ones(1, T, dtype=torch.long),
                                        do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                        eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                                        output_logits=True)
        if not built.cfg.moe or _router_gap(built.hf, gen_out.sequences[0]) >= ROUTER_GAP:
            break
    ref_tokens = gen_out.sequences[0, T:].tolist()
    assert len(ref_tokens) == NEW_TOKENS, "transformers stopped early"

    model = built.ours
    table, pool = _table(math.ceil((T + NEW_TOKENS) / PAGE_SIZE), seed)
    state = model.new_state(num_slots=3, num_pages=pool)
    logits = model.forward(Batch(ids, [T], [0], [2], table), state, logits="last").logits
    tokens, worst = [], 0.0
    for step in range(NEW_TOKENS):
        err = rel(logits[0], gen_out.logits[step][0])
        worst = max(worst, err)
        assert err < FP32_TOL, (f"{built.cfg.id}, T={T}: step {step} logits differ from generate()'s by "
                                f"{err:.3e} (tokens so far agree: {tokens == ref_tokens[:step]})")
        tok = ops.greedy(logits)
        tokens.append(int(tok[0]))
        if step + 1 < NEW_TOKENS:
            logits = model.forward(Batch(tok, [1], [T + step], [2], table), state, logits="last").logits
    _note(built.cfg.id, "fp32_decode", worst)
    assert tokens == ref_tokens, f"{built.cfg.id}, T={T}: greedy tokens differ"


def test_both_checkpoint_layouts_load_identically(built: Built, seed: int):
    """save_pretrained layout and official fused/multimodal layout: same spec, same weights, same logits."""
    # The two directories really are the two layouts.
    hf_keys = set(load_file(os.path.join(built.hf_dir, "model.safetensors")))
    assert all(k.startswith("model.layers.") or k in ("model.embed_tokens.weight", "model.norm.weight",
                                                      "lm_head.weight") for k in hf_keys)
    with open(os.path.join(built.official_dir, "model.safetensors.index.json"), encoding="utf-8") as f:
        off_keys = set(json.load(f)["weight_map"])
    text_keys = off_keys - built.vision_keys
    assert all(k.startswith("model.language_model.") or k == "lm_head.weight" for k in text_keys)
    assert ("lm_head.weight" in text_keys) == (not built.cfg.kwargs["tie_word_embeddings"])
    if built.cfg.moe:
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in hf_keys)
        assert not any(".mlp.experts.0." in k for k in off_keys)
        assert {"model.language_model.layers.0.mlp.experts.gate_up_proj",
                "model.language_model.layers.0.mlp.experts.down_proj"} <= off_keys
    spec_hf, spec_off = load_spec(built.hf_dir), load_spec(built.official_dir)
    assert spec_off == spec_hf

    ckpt = Checkpoint(built.official_dir)
    assert set(ckpt.ignored) == built.vision_keys
    w_off = load_weights(ckpt, spec_off)
    w_hf = load_weights(Checkpoint(built.hf_dir), spec_hf)
    assert set(w_off) == set(w_hf)
    for name in sorted(w_hf):
        assert torch.equal(w_off[name], w_hf[name]), f"{name} differs between the two layouts"

    # Logits: equal up to rounding (CPU matmuls may round differently when the same values sit in
    # differently aligned buffers, and safetensors hands out views at arbitrary file offsets).
    ids = _prompt(built, 65, seed)
    off = _prefill(HybridModel.from_dir(built.official_dir), ids, seed)
    ref = _prefill(built.ours, ids, seed)
    err = rel(off, ref)
    _note(built.cfg.id, "layouts", err)
    assert err < LAYOUT_TOL, f"official layout vs save_pretrained layout: relative error {err:.3e}"


@pytest.mark.parametrize("which", ["CausalLM", "ConditionalGeneration"])
def test_transformers_loads_official_layout(built: Built, which: str, seed: int):
    """transformers reads the official layout we write (fused experts, language_model prefix, wrapper
    config, vision tensors) into the same model: proof that write_checkpoint's layout is right."""
    cls = _hf_causal_class(built.cfg.moe) if which == "CausalLM" else _hf_conditional_class(built.cfg.moe)
    model, info = cls.from_pretrained(built.official_dir, dtype=torch.float32, output_loading_info=True)
    model.eval()
    assert not info["missing_keys"], f"transformers found no tensor for {sorted(info['missing_keys'])[:5]}"
    assert not info["mismatched_keys"], f"shape mismatches: {info['mismatched_keys'][:5]}"
    if which == "ConditionalGeneration":
        assert not info["unexpected_keys"], f"unused tensors: {sorted(info['unexpected_keys'])[:5]}"
    ids = _prompt(built, 65, seed)
    theirs = _hf_logits(model, ids)
    err = rel(theirs, _hf_logits(built.hf, ids))
    _note(built.cfg.id, f"hf_official_{which}", err)
    assert err < LAYOUT_TOL, f"transformers {cls.__name__} from the official layout: relative error {err:.3e}"
    # ... and tandem, loading that same directory, agrees with it to parity.
    errs = _row_rel(_prefill(HybridModel.from_dir(built.official_dir), ids, seed), theirs)
    assert float(errs.max()) < FP32_TOL, f"{built.cfg.id}: {_worst(errs)}"


@pytest.mark.parametrize("T", [65, 300], ids=["T65", "T300"])
def test_bf16_drift_report(built: Built, T: int, seed: int):
    """bfloat16 smoke, a drift report and not parity: tandem and transformers (default sdpa attention,
    grouped_mm experts) both in bf16 from the same checkpoint, each compared with the float32 reference.

    With hot random weights every bf16 program drifts by percents from float32 (MoE routing flips add
    more) and two bf16 programs drift apart by about as much as each drifts from float32: transformers'
    own sdpa and eager attention differ by that much. So the bound is relative to that noise: tandem
    in bf16 may be at most 3x (+0.02) as far from float32 as transformers in bf16 is.
    """
    ids = _prompt(built, T, seed)
    ours_model, hf16 = _bf16_pair(built)
    ours = _prefill(ours_model, ids, seed)
    assert ours.dtype == torch.bfloat16 and torch.isfinite(ours.float()).all()
    ref16, ref32 = _hf_logits(hf16, ids), _hf_logits(built.hf, ids)
    ours_err, hf_err, apart = rel(ours, ref32), rel(ref16, ref32), rel(ours, ref16)
    _note(built.cfg.id, "bf16_ours_vs_fp32", ours_err)
    _note(built.cfg.id, "bf16_hf_vs_fp32", hf_err)
    _note(built.cfg.id, "bf16_ours_vs_hf_bf16", apart)
    assert ours_err < BF16_NOISE_FACTOR * hf_err + BF16_NOISE_SLACK, (
        f"{built.cfg.id}, T={T}: tandem bf16 is {ours_err:.3e} from fp32, transformers bf16 {hf_err:.3e} "
        f"(they are {apart:.3e} apart)")


def test_bf16_matches_transformers_eager(built: Built, seed: int):
    """bf16 parity against transformers with eager attention and eager (per-expert loop) MoE, which
    round at the same points as tandem's reference ops: expected equal to a few bf16 ulps."""
    ids = _prompt(built, 65, seed)
    ours_model, hf16 = _bf16_pair(built, eager=True)
    err = rel(_prefill(ours_model, ids, seed), _hf_logits(hf16, ids))
    _note(built.cfg.id, "bf16_ours_vs_hf_eager_bf16", err)
    assert err < BF16_EAGER_TOL, f"{built.cfg.id}: tandem bf16 vs transformers eager bf16: {err:.3e}"


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")     # the zero-width branch
def test_moe_without_a_shared_expert_saved_by_transformers_loads_and_matches(tmp_path, seed):
    """shared_expert_intermediate_size 0: transformers' save_pretrained still writes the shared branch
    (zero-width projections, a [1, E] gate), which adds nothing. tandem accepts those tensors without
    loading them (ranks.weights Layout.ignored), at tp 1 and in every tp 2 shard, and its float32 logits
    match transformers'."""
    from ranks.sharding import load_shard
    from ranks.weights import validate
    cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=0)
    gen = torch.Generator().manual_seed(seed)
    hf = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    randomise_(hf, gen)
    hf.save_pretrained(tmp_path)
    ckpt = Checkpoint(str(tmp_path))
    spec = load_spec(str(tmp_path))
    zero = sorted(n for n in ckpt.tensors if "shared_expert" in n)
    assert len(zero) == 4 * spec.num_layers, zero                 # what transformers wrote
    assert validate(ckpt, spec).ignored == frozenset(zero)
    model = HybridModel.from_dir(str(tmp_path))
    assert not any("shared_expert" in k for k in model.w)
    for rank in range(2):
        assert not any("shared_expert" in k for k in load_shard(ckpt, spec, rank, 2))
    ids = torch.randint(0, VOCAB, (23,), generator=gen)
    with torch.no_grad():
        want = _hf_logits(hf, ids)
    errs = _row_rel(_prefill(model, ids, seed), want)
    assert errs.max() < FP32_TOL, _worst(errs)
    # a partial set (one of the four missing) is still refused, naming the tensor
    from safetensors.torch import load_file as _load, save_file as _save
    shard = next(tmp_path.glob("*.safetensors"))
    tensors = _load(str(shard))
    del tensors[next(k for k in tensors if k.endswith("layers.0.mlp.shared_expert_gate.weight"))]
    _save(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(Exception, match="shared_expert_gate"):
        validate(Checkpoint(str(tmp_path)), spec)


def test_stale_single_file_beside_a_shard_index_is_not_loaded_silently(tmp_path, seed):
    """A directory with a shard index and a model.safetensors the index does not name (a re-save or
    re-download over an older copy with another shard size leaves both): transformers loads
    model.safetensors, other loaders the index. tandem must not quietly load other weights than
    transformers does: it either matches transformers' logits or refuses naming both files."""
    from ranks.weights import INDEX_FILE, SINGLE_FILE, CheckpointError
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, intermediate_size=64)
    gen = torch.Generator().manual_seed(seed)
    sharded, single = (transformers.Qwen3_5ForCausalLM(cfg).eval() for _ in range(2))
    randomise_(sharded, gen)
    randomise_(single, gen)
    sharded.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    single.save_pretrained(tmp_path / "other")
    os.replace(tmp_path / "other" / SINGLE_FILE, tmp_path / "m" / SINGLE_FILE)
    assert (tmp_path / "m" / INDEX_FILE).is_file()
    ids = torch.randint(0, VOCAB, (23,), generator=gen)
    with torch.no_grad():
        want = _hf_logits(transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path / "m").eval(), ids)
        assert rel(want, _hf_logits(single, ids)) < LAYOUT_TOL     # transformers took model.safetensors
    try:
        model = HybridModel.from_dir(str(tmp_path / "m"))
    except CheckpointError as e:
        assert SINGLE_FILE in str(e) and INDEX_FILE in str(e), str(e)
        return
    errs = _row_rel(_prefill(model, ids, seed), want)
    assert errs.max() < FP32_TOL, f"tandem loaded other weights than transformers: {_worst(errs)}"


# Shapes the CONFIGS above leave out: conv kernels other than 4 (the conv state is K - 1 columns), widths
# that are not multiples of 64 (hidden, intermediate, vocabulary), no attention layer or one, top-1 and
# top-all routing, odd expert widths. Each: a 70-token prefill (two chunks of the delta rule) and greedy
# decode steps against transformers' full forward (generate() itself fails without an attention layer),
# and tp 2 shards summed in threads where tp 2 divides the model, else the refusal naming the field.
UNCOMMON = {
    "dense-conv3-h96-i100-v250-FLLF-dk8-dv24": (False, dict(
        hidden_size=96, intermediate_size=100, vocab_size=250, linear_conv_kernel_dim=3, num_hidden_layers=4,
        layer_types=[FA, LA, LA, FA], num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=24)),
    "dense-conv6-all-linear-tied": (False, dict(
        linear_conv_kernel_dim=6, num_hidden_layers=3, layer_types=[LA] * 3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=64, tie_word_embeddings=True)),
    "dense-conv2-h200-v301-LLLF": (False, dict(
        hidden_size=200, intermediate_size=37, vocab_size=301, linear_conv_kernel_dim=2, num_hidden_layers=4,
        layer_types=[LA, LA, LA, FA], num_attention_heads=4, num_key_value_heads=1, head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=12, linear_value_head_dim=10)),
    "moe-conv5-top1-i34-v250": (True, dict(
        vocab_size=250, linear_conv_kernel_dim=5, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=6, num_experts_per_tok=1, moe_intermediate_size=34,
        shared_expert_intermediate_size=18)),
    "moe-conv1-topall-i33-FF": (True, dict(
        linear_conv_kernel_dim=1, num_hidden_layers=3, layer_types=[LA, FA, FA], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=3, num_experts_per_tok=3,
        moe_intermediate_size=33, shared_expert_intermediate_size=16)),
}


@pytest.mark.parametrize("moe,kwargs", UNCOMMON.values(), ids=UNCOMMON.keys())
def test_uncommon_shapes_match_transformers(tmp_path, seed, moe, kwargs):
    from ranks.sharding import ShardError, load_shard
    from tests.test_sharding import ThreadAllReduce
    kw = dict(max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
              rope_parameters=_rope(kwargs["head_dim"]), **kwargs)
    kw.setdefault("vocab_size", VOCAB)
    kw.setdefault("hidden_size", HIDDEN)
    cfg = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(**kw)
    gen = torch.Generator().manual_seed(seed)
    hf = _hf_causal_class(moe)(cfg).eval()
    if moe:
        hf.set_experts_implementation("eager")         # grouped_mm wants 16-byte strides (widths 33, 34)
    randomise_(hf, gen)
    hf.save_pretrained(tmp_path)
    V, T, steps = cfg.vocab_size, 70, 6
    for _ in range(MAX_PROMPT_TRIES):
        ids = torch.randint(0, V, (T,), generator=gen)
        # top-all routing has no k-th / (k+1)-th gap to tie on
        if not moe or cfg.num_experts_per_tok == cfg.num_experts or _router_gap(hf, ids) >= ROUTER_GAP:
            break
    model = HybridModel.from_dir(str(tmp_path))
    spec = model.spec
    assert (spec.conv_kernel, spec.vocab_size, spec.hidden_size) == (kw["linear_conv_kernel_dim"], V, cfg.hidden_size)

    ref = _hf_logits(hf, ids)
    errs = _row_rel(_prefill(model, ids, seed), ref)
    assert float(errs.max()) < FP32_TOL, f"prefill: {_worst(errs)}"

    table, pool = _table(math.ceil((T + steps) / PAGE_SIZE), seed)
    state = model.new_state(num_slots=1, num_pages=pool)
    logits = model.forward(Batch(ids, [T], [0], [0], table), state, logits="last").logits
    seq = ids
    for step in range(steps):
        want = _hf_logits(hf, seq)[-1]
        err = rel(logits[0], want)
        assert err < FP32_TOL, f"decode step {step}: relative error {err:.3e}"
        tok = ops.greedy(logits)
        assert int(tok[0]) == int(want.argmax()), f"decode step {step}: greedy token differs"
        seq = torch.cat([seq, tok])
        logits = model.forward(Batch(tok, [1], [T + step], [0], table), state, logits="last").logits

    conflict = spec.tp_conflict(2)
    if conflict:
        with pytest.raises(ShardError, match="tp 2 does not divide"):
            load_shard(Checkpoint(str(tmp_path)), spec, 0, 2)
        return
    reduce, parts, errors = ThreadAllReduce(2), {}, []

    def run(rank: int) -> None:
        try:
            shard = HybridModel(spec, load_shard(Checkpoint(str(tmp_path)), spec, rank, 2), tp=2,
                                all_reduce=reduce.for_rank(rank))
            parts[rank] = _prefill(shard, ids, seed)
        except BaseException as e:       # a dead thread would hang the barrier
            errors.append(e)
            reduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    errs = _row_rel(torch.cat([parts[0], parts[1]], dim=-1), ref)       # vocabulary shards side by side
    assert float(errs.max()) < FP32_TOL, f"tp 2: {_worst(errs)}"
