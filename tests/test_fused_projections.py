"""The fused projections of the CUDA model (ranks/model_cuda.py _fuse_projections, quantise_weights),
checked on the CPU: q|k|v and the GDN qkv|z and a|b concatenated at load, the parts row views of the
fused weight (16-bit) or row slices of its quantised form, bit for bit the same values as quantising
the fused weight, and the weight-byte count of a step unchanged by the fusion."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import QuantWeight
from ranks import model_cuda as mc
from tests.util import random_weights, tiny_spec


def _weights(seed, **overrides):
    spec = tiny_spec(**overrides)
    return spec, {k: v.to(torch.bfloat16) for k, v in random_weights(spec, seed).items()}


def _groups(w):
    for fused, parts, quantised in mc.FUSED_PROJECTIONS:
        for name in [n for n in w if n.endswith(fused)]:
            base = name[: -len(fused)]
            yield name, [base + p for p in parts], quantised


def test_projections_fuse_into_views(seed):
    spec, w = _weights(seed)
    orig = {k: v.clone() for k, v in w.items()}
    mc._fuse_projections(w)
    groups = list(_groups(w))
    n_attn = len(spec.full_attention_layers) + 1                     # + the MTP layer
    n_gdn = len(spec.linear_attention_layers)
    assert len(groups) == n_attn + 2 * n_gdn
    for fused, parts, _ in groups:
        f = w[fused]
        assert torch.equal(f, torch.cat([orig[p] for p in parts]))
        a = 0
        for p in parts:
            assert w[p].untyped_storage().data_ptr() == f.untyped_storage().data_ptr()
            assert torch.equal(w[p], orig[p]) and torch.equal(w[p], f[a:a + orig[p].shape[0]])
            a += orig[p].shape[0]
    assert mc.weight_bytes(w) == mc.weight_bytes(orig)
    mc._fuse_projections(w)                                            # idempotent
    assert len(list(_groups(w))) == len(groups)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp8-block"])
def test_fused_projections_quantise_as_one_weight(fmt, seed):
    # head dims and counts chosen so that every part boundary is a multiple of 128 rows (fp8-block)
    spec, w = _weights(seed, hidden_size=128, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                       linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                       linear_num_value_heads=4)
    mc._fuse_projections(w)
    mc.quantise_weights(w, fmt)
    for fused, parts, quantised in _groups(w):
        if not quantised:
            assert all(w[p].dtype == torch.bfloat16 for p in parts + [fused])
            continue
        f = w[fused]
        assert isinstance(f, QuantWeight)
        whole = f.dequantize()
        a = 0
        for p in parts:
            q = w[p]
            assert isinstance(q, QuantWeight) and q.kind == f.kind and q.in_features == f.in_features
            assert q.data.untyped_storage().data_ptr() == f.data.untyped_storage().data_ptr()
            assert torch.equal(q.dequantize().view(torch.int16), whole[a:a + q.out_features].view(torch.int16))
            a += q.out_features
        assert a == f.out_features
    # the fused weights count once: the bytes of the same parts quantised apart (nvfp4: one global
    # scale per group instead of one per part)
    _, apart = _weights(seed, hidden_size=128, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                        linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                        linear_num_value_heads=4)
    mc.quantise_weights(apart, fmt)
    shared = sum(len(parts) - 1 for _, parts, q in _groups(w) if q) * 4 if fmt == "nvfp4" else 0
    assert mc.weight_bytes(w) == mc.weight_bytes(apart) - shared


def test_fp8_block_keeps_unaligned_groups_apart(seed):
    """tiny: q 256 rows, k and v 64 (boundary 320 is not a multiple of 128: apart); GDN qkv 128, z 64
    (fused)."""
    from kernels.quant import quantize_fp8_blocks
    spec, w = _weights(seed)
    mc._fuse_projections(w)
    groups = [(f, parts) for f, parts, q in _groups(w) if q]
    before = {p: w[p].clone() for _, parts in groups for p in parts}
    mc.quantise_weights(w, "fp8-block")
    kept = 0
    for fused, parts in groups:
        sizes = [before[p].shape[0] for p in parts]
        aligned = all(sum(sizes[:i]) % 128 == 0 for i in range(1, len(sizes)))
        assert (fused in w) == aligned, (fused, sizes)
        kept += aligned
        for p in parts:
            assert isinstance(w[p], QuantWeight)
            if not aligned:                                           # quantised on its own
                want = quantize_fp8_blocks(before[p]).dequantize()
                assert torch.equal(w[p].dequantize().view(torch.int16), want.view(torch.int16))
    assert 0 < kept < len(groups)


def test_quantised_checkpoints_stay_apart(seed):
    from kernels.quant import quantize_fp8_rows
    spec, w = _weights(seed)
    for k in [k for k in w if k.endswith("self_attn.q_proj.weight")]:
        w[k] = quantize_fp8_rows(w[k])
    mc._fuse_projections(w)
    assert not any(k.endswith("self_attn.qkv_proj.weight") for k in w)
    assert any(k.endswith("linear_attn.in_proj_qkvz.weight") for k in w)


def test_gdn_inputs_fuse_into_one_weight_for_bf16(seed):
    """_fuse_gdn_inputs (bf16 models, after _fuse_projections): each GDN layer's qkv | z | a | b become
    row views of one weight, in that order, with the same values; the qkv|z and a|b groups are views of
    it too; the weight bytes do not change; idempotent."""
    spec, w = _weights(seed)
    orig = {k: v.clone() for k, v in w.items()}
    mc._fuse_projections(w)
    mc._fuse_gdn_inputs(w)
    fused = [n for n in w if n.endswith(mc.GDN_INPUTS_FUSED)]
    assert len(fused) == len(spec.linear_attention_layers) > 0
    for name in fused:
        base = name[: -len(mc.GDN_INPUTS_FUSED)]
        parts = [base + p for p in mc.GDN_INPUTS]
        f = w[name]
        assert torch.equal(f, torch.cat([orig[p] for p in parts]))
        for p in parts + [base + "in_proj_qkvz.weight", base + "in_proj_ab.weight"]:
            assert w[p].untyped_storage().data_ptr() == f.untyped_storage().data_ptr(), p
        for p in parts:
            assert torch.equal(w[p], orig[p])
        assert torch.equal(w[base + "in_proj_qkvz.weight"], torch.cat([orig[p] for p in parts[:2]]))
        assert torch.equal(w[base + "in_proj_ab.weight"], torch.cat([orig[p] for p in parts[2:]]))
    assert mc.weight_bytes(w) == mc.weight_bytes(orig)
    mc._fuse_gdn_inputs(w)
    assert len([n for n in w if n.endswith(mc.GDN_INPUTS_FUSED)]) == len(fused)


def test_gdn_inputs_stay_two_groups_when_a_part_is_quantised(seed):
    from kernels.quant import quantize_fp8_rows
    spec, w = _weights(seed)
    for k in [k for k in w if k.endswith("linear_attn.in_proj_qkv.weight")]:
        w[k] = quantize_fp8_rows(w[k])
    mc._fuse_projections(w)
    mc._fuse_gdn_inputs(w)
    assert not any(k.endswith(mc.GDN_INPUTS_FUSED) for k in w)
