"""What the benchmarks divide by, checked on the CPU: the linear parameters behind decode.py's prefill
"of matmul rate" count each weight once, however the CUDA model fused or viewed it."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

from ranks.model_cuda import _fold_shared_experts, _fuse_gate_up, _fuse_projections  # noqa: E402
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
