"""CPU smoke of the demo-model pipeline (scripts/demo/build_corpus.py, scripts/train_demo.py).

A tiny corpus and tokenizer are built, a tiny model of the same architecture trains a few steps
(the loss must fall), and the export must load in tandem (HybridModel, LocalGenerator) and in
transformers (Qwen3_5ForCausalLM) with the training forward's logits, main and MTP, within 1e-4
in float32. Also: the chat template's rendering rules, resuming, and the split-tar packing.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import tarfile

import numpy as np
import pytest
import torch

from ranks.kvcache import PAGE_SIZE
from ranks.model import Batch, HybridModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod                     # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


train_demo = _load("tandem_train_demo", "scripts/train_demo.py")
build_corpus = _load("tandem_build_corpus", "scripts/demo/build_corpus.py")
chat_data = build_corpus.chat_data

TRAIN_ARGS = ["--smoke", "--seq-len", "80", "--batch-size", "2", "--log-every", "4", "--eval-every", "0",
              "--eval-tokens", "1024", "--seed", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("demo") / "data")
    build_corpus.main(["--out", out, "--max-bytes", "150000", "--vocab-size", "512", "--heldout-frac", "0.08",
                       "--tokenizer-bytes", "150000"])
    return out


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[str, dict]:
    work = str(tmp_path_factory.mktemp("demo") / "work")
    metrics = train_demo.main(TRAIN_ARGS + ["--data", corpus, "--work-dir", work, "--max-steps", "8"])
    return work, metrics


# --------------------------------------------------------------------------------------------------
# Corpus and tokenizer


def test_corpus_layout(corpus):
    from tokenizers import Tokenizer

    with open(os.path.join(corpus, "manifest.json")) as f:
        manifest = json.load(f)
    tok = Tokenizer.from_file(os.path.join(corpus, "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    assert n == manifest["tokenizer"]["vocab_size"] <= 512
    added = manifest["tokenizer"]["added_tokens"]
    assert list(added) == list(build_corpus.ALL_ADDED)
    assert list(added.values()) == list(range(n - 9, n))           # one id each, after the BPE ids
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    assert special == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    for t in build_corpus.ALL_ADDED:                                 # a single id inside running text
        assert tok.encode(f"x{t}y", add_special_tokens=False).ids.count(added[t]) == 1
    with open(os.path.join(corpus, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    assert cfg["chat_template"] == chat_data.load_template()
    with open(os.path.join(corpus, "chat_template.jinja")) as f:
        assert f.read() == cfg["chat_template"]

    for split in ("train", "heldout"):
        ids = np.load(os.path.join(corpus, f"{split}.npy"))
        starts = np.load(os.path.join(corpus, f"{split}_docs.npy"))
        kinds = np.load(os.path.join(corpus, f"{split}_kinds.npy"))
        assert ids.dtype == np.uint16 and len(ids) == manifest["splits"][split]["tokens"] > 0
        assert len(starts) == len(kinds) == manifest["splits"][split]["documents"]
        assert starts[0] == 0 and (ids[starts[1:] - 1] == added["<|endoftext|>"]).all()
        assert ids[-1] == added["<|endoftext|>"] and int(ids.max()) < n
    assert set(manifest["sources"]) >= {"stdlib", "chat"}
    assert all(s["licence"] for s in manifest["sources"].values())
    assert manifest["splits"]["train"]["tokens_by_kind"]["chat"] > 0


def test_corpus_is_deterministic(corpus, tmp_path):
    out = str(tmp_path / "again")
    build_corpus.main(["--out", out, "--max-bytes", "150000", "--vocab-size", "512", "--heldout-frac", "0.08",
                       "--tokenizer-bytes", "150000"])
    for f in ("train.npy", "heldout.npy", "tokenizer.json"):
        with open(os.path.join(corpus, f), "rb") as a, open(os.path.join(out, f), "rb") as b:
            assert a.read() == b.read(), f


def test_chat_template_rules():
    render = chat_data.render_chat
    user = [{"role": "user", "content": "hi"}]
    assert render(user, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert render(user, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    msgs = [{"role": "system", "content": "sys"}, *user,
            {"role": "assistant", "content": "<think>\nold\n</think>\n\nHello"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "call it",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"location": "Oslo", "days": 2,
                                                                            "opts": {"a": [1]}, "ok": True}}},
                            {"function": {"name": "get_time", "arguments": {"timezone": "UTC"}}}]},
            {"role": "tool", "content": "{\"t\": 3}"}, {"role": "tool", "content": "12:00"},
            {"role": "assistant", "content": "Done.", "reasoning_content": ""}]
    tools = [chat_data.TOOLS["get_weather"], chat_data.TOOLS["get_time"]]
    text = render(msgs, tools)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           + json.dumps(tools[0], ensure_ascii=False) + "\n")
    assert "</IMPORTANT>\n\nsys<|im_end|>\n" in text
    assert "<|im_start|>assistant\nHello<|im_end|>" in text           # before the last query: no reasoning
    assert ("<|im_start|>assistant\n<think>\ncall it\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=location>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
            "<parameter=opts>\n{\"a\": [1]}\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=timezone>\nUTC\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\n{\"t\": 3}\n</tool_response>\n<tool_response>\n12:00\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nDone.<|im_end|>\n") in text
    assert "<think>\nold\n</think>" in render(msgs, tools, preserve_thinking=True)
    content_first = [*user, {"role": "assistant", "content": "Checking.", "reasoning_content": "r",
                             "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    assert "Checking.\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>" in render(content_first)
    with pytest.raises(ValueError, match="No user query"):
        render([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}])
    with pytest.raises(ValueError, match="System message"):
        render([*user, {"role": "system", "content": "late"}])


def test_synthetic_chats_close_their_turns():
    chats = list(zip(range(200), chat_data.iter_rendered(seed=3)))
    kinds = {c["kind"].split("+")[0] for _, (c, _) in chats}
    assert {"tool", "arithmetic", "python", "conversion"} <= kinds
    assert any(not c["thinking"] for _, (c, _) in chats) and any(c["thinking"] for _, (c, _) in chats)
    for _, (chat, text) in chats:
        assert text.endswith("<|im_end|>\n")
        assert text.count("<|im_start|>") == text.count("<|im_end|>")
        assert text.count("<|im_start|>assistant\n") == sum(m["role"] == "assistant" for m in chat["messages"])
        turns = text
        if chat["tools"]:
            assert text.startswith("<|im_start|>system\n# Tools") and "<tools>" in text
            turns = text.split("<|im_end|>\n", 1)[1]                  # past the instructions' example call
        calls = turns.count("<tool_call>\n<function=")
        assert calls == turns.count("</function>\n</tool_call>")
        assert calls == 0 or turns.count("<tool_response>\n") == calls
    again = [c["messages"] for c in chat_data.generate_chats(3, 20)]
    assert again == [c["messages"] for _, (c, _) in chats[:20]]


# --------------------------------------------------------------------------------------------------
# Training and export


def test_training_lowers_the_loss(trained):
    work, metrics = trained
    hist = metrics["train"]["history"]
    assert metrics["train"]["steps"] == 8 and len(hist) == 2
    vocab = metrics["config"]["vocab_size"]
    ev = metrics["eval"]
    print("loss history", [(round(h["loss"], 3), round(h["mtp_loss"], 3)) for h in hist], "held-out", ev["loss"],
          "ln V", math.log(vocab))
    assert hist[0]["loss"] < math.log(vocab) + 0.5               # starts near uniform
    assert hist[-1]["loss"] < hist[0]["loss"], hist
    assert hist[-1]["mtp_loss"] < hist[0]["mtp_loss"], hist
    assert ev["loss"] < math.log(vocab) - 0.1                     # held-out: better than uniform
    for key in ("loss", "perplexity", "top1", "mtp_top1", "mtp_top1_given_main_correct", "mtp_greedy_acceptance"):
        assert key in ev, key
    assert ev["tokens"] > 0 and ev["by_kind"]
    assert os.path.isfile(os.path.join(work, "train_state.pt"))


def _export(work: str) -> str:
    return os.path.join(work, "export")


def test_export_layout(trained):
    from safetensors import safe_open

    work, metrics = trained
    d = _export(work)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen3_5" and cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["model_type"] == "qwen3_5_text" and text["mtp_num_hidden_layers"] == 1
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    rope = text["rope_parameters"]
    assert 2 * sum(rope["mrope_section"]) == int(text["head_dim"] * rope["partial_rotary_factor"])
    with open(os.path.join(d, "generation_config.json")) as f:
        gen = json.load(f)
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        added = {v["content"]: int(k) for k, v in json.load(f)["added_tokens_decoder"].items()}
    assert gen["eos_token_id"] == [added["<|im_end|>"], added["<|endoftext|>"]]
    assert text["eos_token_id"] == added["<|endoftext|>"]
    keys = {}
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as h:
                keys.update({k: h.get_slice(k).get_dtype() for k in h.keys()})
    assert set(keys.values()) == {"BF16"}
    assert all(k.startswith(("model.language_model.", "mtp.")) for k in keys)
    mtp = {k for k in keys if k.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= mtp
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "metrics.json", "README.md"):
        assert os.path.isfile(os.path.join(d, f)), f


def _ours(model: HybridModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T = ids.shape[0] - 1
    pages = -(-T // PAGE_SIZE)
    table = torch.arange(pages, dtype=torch.int32)[None]
    state = model.new_state(num_slots=1, num_pages=pages)
    out = model.forward(Batch(ids[:T], [T], [0], [0], table), state, logits="all")
    mtp = model.mtp_forward(Batch(ids[1:], [T], [0], [0], table), out.hidden, state, logits="all")
    return out.logits, mtp.logits


def test_export_matches_tandem_and_transformers(trained):
    transformers = pytest.importorskip("transformers", minversion="5.2")
    from ranks.local import LocalGenerator
    from runtime.sampling import SamplingParams
    from runtime.tokenizer import Tokenizer

    d = _export(trained[0])
    ours = HybridModel.from_dir(d)
    assert ours.has_mtp
    V = ours.spec.vocab_size
    ids = torch.randint(0, V, (101,), generator=torch.Generator().manual_seed(0))   # 100 positions: 2 chunks
    logits, mtp_logits = _ours(ours, ids)

    demo = train_demo.load_exported(d).eval()                   # the training forward, same (bf16) weights
    with torch.no_grad():
        main_t, mtp_t, _ = demo(torch.cat([ids, ids[:1]])[None])
    assert (main_t[0] - logits).abs().max() < TOL
    assert (mtp_t[0] - mtp_logits).abs().max() < TOL

    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids[None, :-1]).logits[0]
    assert (ref - logits).abs().max() < TOL

    tok = Tokenizer.from_dir(d)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True))
    gen = LocalGenerator(ours)
    out = list(gen.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=4), tok.eos_token_ids))
    assert 1 <= len(out) <= 4 and all(0 <= t < V for t in out)


def test_resume_continues(corpus, trained, tmp_path):
    import shutil

    work = str(tmp_path / "work")
    shutil.copytree(trained[0], work)
    metrics = train_demo.main(TRAIN_ARGS + ["--data", corpus, "--work-dir", work,
                                            "--max-steps", "10", "--resume", "--no-export"])
    assert metrics["train"]["steps"] == 10
    assert metrics["train"]["history"][:2] == trained[1]["train"]["history"]
    with open(os.path.join(work, "train.log")) as f:
        assert "resumed from" in f.read()


def test_pack_roundtrip(trained, tmp_path):
    d = _export(trained[0])
    files = train_demo.pack(d, str(tmp_path / "out"), [], part_bytes=100_000)
    assert len(files) > 1 and all(os.path.getsize(f) <= 100_000 for f in files)
    joined = tmp_path / "all.tar"
    with open(joined, "wb") as out:
        for f in sorted(files):
            with open(f, "rb") as part:
                out.write(part.read())
    with tarfile.open(joined) as tar:
        tar.extractall(tmp_path / "x")
    for f in os.listdir(d):
        with open(os.path.join(d, f), "rb") as a, open(tmp_path / "x" / "demo_model" / f, "rb") as b:
            assert a.read() == b.read(), f
