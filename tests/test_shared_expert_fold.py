"""The shared expert folded into the routed experts (ranks/model_cuda.py _fold_shared_experts), checked
on the CPU: where the shared expert is as wide as the routed ones, it is stacked after them as expert X
and its gate after the router's rows; the old names stay views of the stacks; routing it as a
(top_k + 1)-th expert with weight sigmoid(gate logit) computes the reference MoE block; other layers,
and quantised shared experts, stay apart; the weight bytes do not change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref
from ranks import model_cuda as mc
from tests.util import random_weights, tiny_spec


def _weights(seed, **overrides):
    spec = tiny_spec(True, **overrides)
    w = {k: v.to(torch.bfloat16) for k, v in random_weights(spec, seed).items()}
    mc._fuse_gate_up(w)
    return spec, w


def _prefixes(w):
    return [n[: -len("shared_expert_gate.weight")] for n in w if n.endswith("mlp.shared_expert_gate.weight")]


def _route_with_shared(logits: torch.Tensor, top_k: int):
    """What moe_route(shared=True) computes (kernels/cuda/moe.cu), in float32 on the CPU."""
    X = logits.shape[1] - 1
    probs = torch.softmax(logits[:, :X].float(), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    sig = torch.sigmoid(logits[:, X:].float())
    return torch.cat([top, sig], 1), torch.cat([ids, torch.full_like(ids[:, :1], X)], 1)


def test_fold_stacks_the_shared_expert_after_the_routed_ones(seed):
    spec, w = _weights(seed, shared_expert_intermediate_size=32)
    orig = {k: v.clone() for k, v in w.items()}
    before = mc.weight_bytes(w)
    mc._fold_shared_experts(w, spec.num_experts_per_tok)
    prefixes = _prefixes(w)
    assert len(prefixes) == spec.num_layers + 1                      # every layer and the MTP layer
    for q in prefixes:
        gates, gu, dn = (w[q + n] for n in mc.SHARED_FOLD)
        X = orig[q + "gate.weight"].shape[0]
        assert torch.equal(gates, torch.cat([orig[q + "gate.weight"], orig[q + "shared_expert_gate.weight"]]))
        assert torch.equal(gu[:X], orig[q + "experts.gate_up_proj"])
        assert torch.equal(gu[X], orig[q + "shared_expert.gate_up_proj.weight"])
        assert torch.equal(dn[:X], orig[q + "experts.down_proj"])
        assert torch.equal(dn[X], orig[q + "shared_expert.down_proj.weight"])
        for name, stack in (("gate.weight", gates), ("shared_expert_gate.weight", gates),
                            ("experts.gate_up_proj", gu), ("shared_expert.gate_up_proj.weight", gu),
                            ("shared_expert.gate_proj.weight", gu), ("shared_expert.up_proj.weight", gu),
                            ("experts.down_proj", dn), ("shared_expert.down_proj.weight", dn)):
            assert w[q + name].untyped_storage().data_ptr() == stack.untyped_storage().data_ptr(), name
            assert torch.equal(w[q + name], orig[q + name]), name
    assert mc.weight_bytes(w) == before


def test_the_folded_experts_compute_the_moe_block(seed):
    """Routing the stacks with the shared expert as slot top_k (float32 on the CPU) equals
    reference.moe_block with the shared expert apart."""
    spec, w = _weights(seed, shared_expert_intermediate_size=32)
    w = {k: v.float() for k, v in w.items()}
    q = _prefixes(w)[0]
    want_shared = (w[q + "shared_expert.gate_proj.weight"].clone(), w[q + "shared_expert.up_proj.weight"].clone(),
                   w[q + "shared_expert.down_proj.weight"].clone())
    x = torch.randn(7, spec.hidden_size, generator=torch.Generator().manual_seed(seed))
    want = ref.moe_block(x, w[q + "gate.weight"], spec.num_experts_per_tok, w[q + "experts.gate_up_proj"],
                         w[q + "experts.down_proj"], want_shared, w[q + "shared_expert_gate.weight"])
    wb = {k: v.to(torch.bfloat16) for k, v in w.items()}                 # fold needs bf16; stack in float32
    mc._fold_shared_experts(wb, spec.num_experts_per_tok)
    assert q + mc.SHARED_FOLD[0] in wb
    gates = torch.cat([w[q + "gate.weight"], w[q + "shared_expert_gate.weight"]])
    gu = torch.cat([w[q + "experts.gate_up_proj"], w[q + "shared_expert.gate_up_proj.weight"][None]])
    dn = torch.cat([w[q + "experts.down_proj"], w[q + "shared_expert.down_proj.weight"][None]])
    for name, t in zip(mc.SHARED_FOLD, (gates, gu, dn)):                  # the fold's layout, in float32
        assert torch.equal(wb[q + name], t.to(torch.bfloat16)), name
    wts, ids = _route_with_shared(F.linear(x, gates), spec.num_experts_per_tok)
    got = ref.moe_experts(x, ids, wts, gu, dn)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layers_whose_shapes_differ_stay_apart(seed):
    spec, w = _weights(seed)                                         # shared 48 wide, routed 32
    names = set(w)
    mc._fold_shared_experts(w, spec.num_experts_per_tok)
    assert set(w) == names


def test_a_quantised_shared_expert_stays_apart(seed):
    spec, w = _weights(seed, shared_expert_intermediate_size=32)
    mc.quantise_weights(w, "fp8")
    q = _prefixes(w)[0]
    assert not isinstance(w[q + "shared_expert.gate_up_proj.weight"], torch.Tensor)
    mc._fold_shared_experts(w, spec.num_experts_per_tok)
    assert not any(n.endswith(mc.SHARED_FOLD) for n in w)


def test_no_memory_for_the_stacks_leaves_the_layer_apart(seed, monkeypatch, caplog):
    """Folding needs a second copy of one layer's experts for a moment; where that allocation fails, the
    layer keeps its shared expert apart (and loading goes on) instead of failing the load."""
    spec, w = _weights(seed, shared_expert_intermediate_size=32)
    orig = {k: v.clone() for k, v in w.items()}
    real_cat, calls = torch.cat, []

    def cat(ts, dim=0):
        calls.append(len(ts))
        if len(calls) == 2:                              # the first layer's down stack
            raise torch.OutOfMemoryError("no memory")
        return real_cat(ts, dim)

    monkeypatch.setattr(torch, "cat", cat)
    with caplog.at_level("WARNING"):
        mc._fold_shared_experts(w, spec.num_experts_per_tok)
    monkeypatch.undo()
    prefixes = _prefixes(w)
    folded = [q for q in prefixes if q + mc.SHARED_FOLD[0] in w]
    assert len(folded) == len(prefixes) - 1 and "stays apart" in caplog.text
    (apart,) = set(prefixes) - set(folded)
    for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_up_proj.weight"):
        assert torch.equal(w[apart + name], orig[apart + name])


@pytest.mark.parametrize("overrides", [dict(num_experts=512, num_experts_per_tok=2),     # 513 router columns
                                       dict(num_experts=40, num_experts_per_tok=32),     # 33 slots
                                       dict(moe_intermediate_size=8200, shared_expert_intermediate_size=8200,
                                            num_experts=4)])                             # shared memory
def test_layers_the_decode_kernels_cannot_take_stay_apart(seed, overrides):
    """With the shared expert as one more expert the route kernel must still fit every router column
    and slot, and the experts kernel its activations in shared memory; otherwise no fold."""
    spec, w = _weights(seed, **{"shared_expert_intermediate_size": overrides.get("moe_intermediate_size", 32),
                                **overrides})
    names = set(w)
    mc._fold_shared_experts(w, spec.num_experts_per_tok)
    assert set(w) == names
