"""The shipped demo model (ranks/demo_model): layout, tokenizer, golden greedy tokens, perplexity.

The golden ids were produced by this code on the CPU (float32) when the model was installed; the
perplexity is the one docs/demo-model.md records for scripts/demo/heldout_sample.npy (CPU float32
and the H200 agreed to 7 digits). A change in either means the model, the layer program or the
tokenizer changed behaviour.
"""

import os

import numpy as np
import pytest
import torch

from ranks.demo import PACKAGED_DIR, default_model_dir
from ranks.local import LocalGenerator
from ranks.model import HybridModel
from ranks.weights import Checkpoint, validate
from runtime.config import FULL_ATTENTION, load_spec
from runtime.sampling import SamplingParams
from runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")),
                                reason="no packaged demo model")

SPECIALS = {"<|endoftext|>": 8183, "<|im_start|>": 8184, "<|im_end|>": 8185, "<think>": 8186,
            "</think>": 8187, "<tool_call>": 8188, "</tool_call>": 8189, "<tool_response>": 8190,
            "</tool_response>": 8191}
GOLDEN = [
    ("def add(a, b):\n", [259, 415, 264, 198, 886, 1209, 326, 4900, 883, 3403, 25, 2423, 363, 64, 11, 307]),
    ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
     [547, 1513, 399, 5873, 326, 1068, 13, 8185]),
]
RECORDED_PPL = 4.3426              # docs/demo-model.md: CPU float32 4.342561, H200 float32 4.342561
RECORDED_ACCEPTANCE = 0.8876
HELDOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "demo",
                       "heldout_sample.npy")


def test_default_model_is_the_packaged_one():
    assert default_model_dir() == PACKAGED_DIR


def test_config_fits_the_family_constraints():
    spec = load_spec(PACKAGED_DIR)
    assert spec.model_type == "qwen3_5_text"
    assert all((t == FULL_ATTENTION) == ((i + 1) % 4 == 0) for i, t in enumerate(spec.layer_types))
    assert spec.rotary_dim == spec.head_dim // 4 and spec.rope_theta == 1e7
    assert spec.linear_num_value_heads % spec.linear_num_key_heads == 0 and spec.gva_ratio > 1
    assert spec.num_heads % spec.num_kv_heads == 0 and spec.gqa_groups > 1
    assert spec.mtp_num_layers == 1 and spec.conv_kernel == 4
    layout = validate(Checkpoint(PACKAGED_DIR), spec)
    assert layout.has_mtp
    size = sum(os.path.getsize(os.path.join(PACKAGED_DIR, f)) for f in os.listdir(PACKAGED_DIR))
    assert size <= 40 * 10**6, f"the packaged model is {size} bytes; the budget is 40 MB"


def test_tokenizer_has_the_family_special_tokens():
    tok = Tokenizer.from_dir(PACKAGED_DIR)
    for text, want in SPECIALS.items():
        assert tok.token_to_id(text) == want
        assert tok.encode(text) == [want], f"{text} must encode as one id"
    assert SPECIALS["<|im_end|>"] in tok.eos_token_ids
    prompt = tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("prompt,golden", GOLDEN, ids=["code", "chat"])
def test_greedy_tokens_equal_the_golden_list(prompt, golden):
    tok = Tokenizer.from_dir(PACKAGED_DIR)
    gen = LocalGenerator.from_dir(PACKAGED_DIR)
    out = list(gen.generate(tok.encode(prompt), SamplingParams(temperature=0, max_new_tokens=len(golden)),
                            eos_token_ids=tok.eos_token_ids))
    assert out == golden


def test_held_out_perplexity_is_the_recorded_one():
    import importlib.util
    spec = importlib.util.spec_from_file_location("eval_ppl", os.path.join(os.path.dirname(HELDOUT), "eval_ppl.py"))
    eval_ppl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_ppl)
    result = eval_ppl.evaluate(HybridModel.from_dir(PACKAGED_DIR, dtype=torch.float32), np.load(HELDOUT))
    assert result["tokens"] == 16384
    assert result["perplexity"] == pytest.approx(RECORDED_PPL, rel=1e-3)     # same number to 3 digits
    assert result["mtp_greedy_acceptance"] == pytest.approx(RECORDED_ACCEPTANCE, abs=5e-3)
