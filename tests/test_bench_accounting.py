"""What the benchmarks divide by, checked on the CPU: the linear parameters behind decode.py's prefill
"of matmul rate" count each weight once, however the CUDA model fused or viewed it."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

from ranks.model_cuda import _fold_shared_experts, _fuse_gate_up, _fuse_gdn_inputs, _fuse_projections  # noqa: E402
from ranks.random_checkpoint import spec_for  # noqa: E402
from ranks.weights import expected_shapes  # noqa: E402


def _want(shapes) -> int:
    """Sum over the checkpoint's 2-D linear weights (layers only), from their shapes alone."""
    return sum(int(torch.Size(s).numel()) for k, s in shapes.items()
               if len(s) == 2 and not k.startswith("mtp.") and "embed" not in k and k != "lm_head.weight")


def test_linear_params_count_fused_gate_up_once():
    import decode
    for name in ("27b", "35b-a3b", "small"):
        spec = spec_for(name)
        shapes = expected_shapes(spec, fused_experts=True)
        w = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes.items()}
        want = _want(shapes)
        assert decode.linear_params(w) == want
        _fuse_gate_up(w)                                  # gate / up become views of gate|up
        assert any(k.endswith("mlp.gate_up_proj.weight") for k in w) or spec.is_moe
        assert decode.linear_params(w) == want, name
        _fuse_projections(w)                              # q|k|v, GDN qkv|z, a|b: the parts become views
        assert decode.linear_params(w) == want, name
        _fuse_gdn_inputs(w)                               # bf16: qkv|z|a|b one weight, all views of it
        assert decode.linear_params(w) == want, name
        _fold_shared_experts(w, spec.num_experts_per_tok or 0)                           # the shared expert: views of the expert stacks
        assert any(k.endswith("mlp.gate_shared.weight") for k in w) == spec.is_moe
        assert decode.linear_params(w) == want, name


def test_linear_split_groups_are_the_models_fused_projections():
    """linear.py --split times the groups the model fuses, with the checkpoint's part shapes."""
    import linear
    assert linear.split_groups("27b") == [
        ("qkv_proj", [(12288, 5120), (1024, 5120), (1024, 5120)], True),
        ("in_proj_qkvz", [(10240, 5120), (6144, 5120)], True),
        ("in_proj_ab", [(48, 5120), (48, 5120)], False)]
    assert [sizes for _, sizes, _ in linear.split_groups("35b-a3b")] == [
        [(8192, 2048), (512, 2048), (512, 2048)], [(8192, 2048), (4096, 2048)], [(32, 2048), (32, 2048)]]


def _model(spec, w, tp=1):
    from types import SimpleNamespace
    return SimpleNamespace(w=w, head=w.get("lm_head.weight", w["embed_tokens.weight"]),
                           num_kv_heads=spec.num_kv_heads // tp, hv=spec.linear_num_value_heads // tp)


def test_step_bytes_count_every_weight_once_and_the_chosen_experts():
    """decode.py's floor (ranks/model_cuda.py step_byte_parts / step_bytes_from) against the
    checkpoint's tensor shapes: every layer weight once (after the load-time fusions and the shared
    expert's fold, which only make views), the routed experts in the share min(X, C * top_k) / X, C
    embedding rows (the whole table again when tied: the head reads it), KV and GDN state by formula."""
    import decode
    from ranks.model_cuda import step_byte_parts, step_bytes_from
    from runtime.config import FULL_ATTENTION
    from tests.util import random_weights, tiny_spec
    for spec in (tiny_spec(False), tiny_spec(True), tiny_spec(True, shared_expert_intermediate_size=32),
                 tiny_spec(False, tie_word_embeddings=True)):
        shapes = expected_shapes(spec, fused_experts=True)
        w = {k: v.to(torch.bfloat16) for k, v in random_weights(spec, 3).items()}
        _fuse_gate_up(w)
        _fuse_projections(w)
        _fuse_gdn_inputs(w)
        _fold_shared_experts(w, spec.num_experts_per_tok or 0)
        layer = {k: s for k, s in shapes.items() if not k.startswith("mtp.") and k != "embed_tokens.weight"}
        experts = sum(2 * torch.Size(s).numel() for k, s in layer.items() if ".mlp.experts." in k)
        fixed = sum(2 * torch.Size(s).numel() for s in layer.values()) - experts
        emb = shapes["embed_tokens.weight"]
        if spec.tie_word_embeddings:
            fixed += 2 * torch.Size(emb).numel()
        n_attn = sum(1 for k in spec.layer_types if k == FULL_ATTENTION)
        parts = step_byte_parts(_model(spec, w), spec)
        assert parts["fixed"] == fixed and parts["experts"] == experts, (spec.is_moe, parts, fixed, experts)
        for C, ctx in ((1, 0), (3, 100), (64, 4096)):
            got = step_bytes_from(parts, C, ctx)
            share = experts * min(spec.num_experts, C * spec.num_experts_per_tok) // spec.num_experts \
                if spec.is_moe else 0
            assert got["weights"] == fixed + share + C * 2 * emb[1]
            assert got["kv"] == C * (ctx + 1) * n_attn * 2 * spec.num_kv_heads * spec.head_dim * 2
            assert got["gdn_state"] == C * (spec.num_layers - n_attn) * 2 * spec.linear_num_value_heads \
                * spec.linear_key_head_dim * spec.linear_value_head_dim * 4
            assert decode.step_bytes(_model(spec, w), spec, C, ctx) == got
        int8 = step_byte_parts(_model(spec, w), spec, kv_dtype="int8")
        assert int8["kv_token"] == round(n_attn * 2 * spec.num_kv_heads * spec.head_dim * (1 + 4 / 64))


def test_step_bytes_of_a_tp_shard_halve_what_is_split():
    """A tp 2 rank reads half the KV heads, GDN value heads and expert rows of tp 1 (what decode_tp.py's
    floor per rank divides)."""
    from ranks.model_cuda import step_byte_parts
    from ranks.random_checkpoint import random_shard
    from tests.util import tiny_spec
    spec = tiny_spec(True)
    one = step_byte_parts(_model(spec, random_shard(spec, 0, 1)), spec)
    for r in (0, 1):
        half = step_byte_parts(_model(spec, random_shard(spec, r, 2), tp=2), spec)
        assert 2 * half["kv_token"] == one["kv_token"] and 2 * half["gdn_seq"] == one["gdn_seq"]
        assert 2 * half["experts"] == one["experts"]
        assert one["fixed"] / 2 <= half["fixed"] < one["fixed"]          # replicated norms, router, ...


def test_decode_window_refuses_requests_that_did_not_decode_together():
    """The engine benchmarks time C requests between the latest first token and the latest finish;
    a request that finished before another's first token (a pool too small for C) must not pass."""
    import pytest
    from decode import decode_window
    together = [dict(ttft_s=0.05, total_s=0.50), dict(ttft_s=0.08, total_s=0.52), dict(ttft_s=0.07, total_s=0.51)]
    assert decode_window(together, 3) == (0.08, 0.52)
    one_after = together[:2] + [dict(ttft_s=0.53, total_s=0.90)]
    with pytest.raises(RuntimeError, match="did not all decode at once"):
        decode_window(one_after, 3)
    # times relative to each submission are moved onto one clock by the submission's offset
    shifted = [dict(ttft_s=0.05, total_s=0.50, submitted_s=0.04), dict(ttft_s=0.08, total_s=0.52, submitted_s=0.0)]
    first, last = decode_window(shifted, 2)
    assert abs(first - 0.09) < 1e-12 and abs(last - 0.54) < 1e-12
    late = [dict(ttft_s=0.05, total_s=0.50, submitted_s=0.0), dict(ttft_s=0.05, total_s=0.50, submitted_s=0.46)]
    with pytest.raises(RuntimeError, match="did not all decode at once"):
        decode_window(late, 2)


def test_decode_tp_flag_hands_over_to_decode_tp(monkeypatch):
    """decode.py --tp: the engine-level tp run (decode_tp.py) gets the model, weights, concurrency, tp
    degrees, transports and output path, and decode.py times nothing itself."""
    import decode
    import decode_tp
    got = []
    monkeypatch.setattr(decode_tp, "main", lambda argv: got.append(argv) or 0)
    monkeypatch.setattr(decode, "measure_bandwidth", lambda *a, **k: (_ for _ in ()).throw(AssertionError("timed")))
    assert decode.main(["--model", "27b", "--weights", "nvfp4", "bf16", "--concurrency", "1", "8", "--tp", "1", "2",
                        "--transport", "mailbox", "nccl", "--layers", "4", "--out", "x.json"]) == 0
    assert got == [["--model", "27b", "--weights", "nvfp4", "bf16", "--tp", "1", "2", "--concurrency", "1", "8",
                    "--layers", "4", "--transport", "mailbox", "nccl", "--out", "x.json"]]
    got.clear()
    decode.main(["--tp", "2"])                              # defaults: decode.py's weights and concurrencies
    assert got == [["--model", "27b", "--weights", "bf16", "fp8", "nvfp4", "--tp", "2",
                    "--concurrency", "1", "4", "8", "16", "32"]]


def test_shard_of_refuses_a_split_the_model_cannot_take_before_touching_a_gpu(monkeypatch):
    """decode.py / profile_step.py --shard-of N: a tp the model's heads do not divide is refused with the
    sharding rule's message, before any GPU work (so also on a machine without one); N < 1 too."""
    import decode
    import profile_step
    monkeypatch.setattr(decode, "measure_bandwidth", lambda *a, **k: (_ for _ in ()).throw(AssertionError("timed")))
    for main in (decode.main, profile_step.main):
        with pytest.raises(SystemExit, match=r"--shard-of 3: .*"):
            main(["--model", "27b", "--layers", "4", "--shard-of", "3"])
    with pytest.raises(SystemExit, match="--shard-of 0"):
        decode.main(["--model", "27b", "--layers", "4", "--shard-of", "0"])


def test_a_tp_shard_runs_alone_with_its_all_reduces_left_out():
    """What decode.py --shard-of builds, on the CPU reference model: rank 0's random shard of a tp 2
    split with the identity all-reduce, and its state, make a step of the right (vocabulary-split)
    shape; with tp 1 the whole vocabulary."""
    from ranks.kvcache import ModelState
    from ranks.model import Batch, HybridModel
    from ranks.random_checkpoint import random_shard
    spec = spec_for("tiny-moe")
    for tp in (1, 2):
        m = HybridModel(spec, random_shard(spec, 0, tp, dtype=torch.float32, device="cpu"), tp=tp)
        st = ModelState(spec, 2, 4, torch.float32, "cpu", tp=tp)
        tables = torch.arange(4, dtype=torch.int32).view(2, 2)
        out = m.forward(Batch(torch.tensor([3, 5]), [1, 1], [0, 0], [0, 1], tables), st)
        assert out.logits.shape == (2, spec.vocab_size // tp) and torch.isfinite(out.logits).all()


def test_linear_shard_of_splits_each_layer_on_its_parallel_dimension():
    """linear.py --shard-of N: column-parallel layers keep O / N rows, o_proj and down I / N columns;
    a tp the shapes do not divide is refused naming the layer, before any GPU work."""
    import linear
    whole = dict((n, (O, I)) for n, O, I in linear.SHAPES["27b"])
    half = dict((n, (O, I)) for n, O, I in linear.shard_shapes(linear.SHAPES["27b"], 2))
    assert half["o_proj"] == (5120, 3072) and half["down"] == (5120, 8704)
    assert half["gate_up"] == (17408, 5120) and half["lm_head"] == (124160, 5120) and half["a_b"] == (48, 5120)
    for n, (O, I) in whole.items():
        assert half[n][0] * half[n][1] * 2 == O * I
    assert linear.shard_shapes(linear.SHAPES["35b-a3b"], 1) == linear.SHAPES["35b-a3b"]
    with pytest.raises(ValueError, match="kv_proj's out_features 1024"):
        linear.shard_shapes(linear.SHAPES["27b"], 3)
    with pytest.raises(SystemExit):
        linear.main(["--shard-of", "3"])
    with pytest.raises(SystemExit):
        linear.main(["--shard-of", "2", "--split"])
