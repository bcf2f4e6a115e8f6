"""Which models the CUDA backend's kernels can run: a check on config.json alone, made before any
weight is read or any rank starts.

The CUDA layer program (ranks/model_cuda.py) launches kernels whose wrappers (kernels/cuda_*.py) refuse
some shapes with a KernelError. Without this check such a checkpoint loads and fails at its first step;
with it, ranks.backend.resolve_backend (the CLI, serve, build_model, the ranks) either runs it on the
reference backend (--backend auto, bf16 weights: a warning) or refuses it up front with one ConfigError
that lists every condition it misses, each naming its config.json field; CudaHybridModel refuses it too.

What is checked (sizes per rank where tp splits them; "quantised" is --weights fp8, fp8-block or nvfp4):

  head_dim                   a power of two in [8, 256]: the decode / verification attention kernel
                             (gqa_decode_split_g*), which every decode step runs (the tensor-core decode
                             falls back to it); with --kv-dtype int8 64, 128 or 256 (gqa_decode_split_i8_g*)
  linear_conv_kernel_dim     2..8: the GDN causal conv kernel
  linear_key_head_dim        16, 32, 64, 128 or 256: the gated delta rule kernels' instantiations
  linear_value_head_dim      a multiple of 8: the gated delta rule kernels (8 value columns per warp)
  hidden_size                at most 16384: the RMSNorm kernels
  in_features of the linear layers on the decode GEMV: a multiple of 8 for bf16 weights, 16 for the
                             quantised ones (and nvfp4 quantisation on load needs 16): hidden_size (every
                             projection from the residual stream), num_attention_heads x head_dim / tp
                             (o_proj), linear_num_value_heads x linear_value_head_dim / tp (out_proj),
                             intermediate_size / tp, shared_expert_intermediate_size / tp (down_proj)
  num_experts                at most 512: the router's top-k kernel
  num_experts_per_tok        at most 32: the router's top-k kernel
  moe_intermediate_size / tp a multiple of 8, and num_experts_per_tok x (2 x moe_intermediate_size / tp + 8)
                             bytes within 48 KiB: the routed experts' decode kernels

Not refused, because a slower path takes over: head dims other than 64 / 128 / 256 in the tensor-core
prefill and decode attention (torch attention, the split decode kernel), shapes the shared-expert fold or
a fused projection cannot take (kept apart), nvfp4 rows of an odd number of 16-element groups (the
CUDA-core GEMV). A pre-quantised checkpoint (quantization_config) is held to the bf16 rules: which of its
layers are quantised is read from the checkpoint, not from config.json.
"""

from __future__ import annotations

from runtime.config import ConfigError, ModelSpec

WEIGHT_FORMATS = ("bf16", "fp8", "fp8-block", "nvfp4")
KV_DTYPES = ("bf16", "int8")


def cuda_support_problems(spec: ModelSpec, tp: int = 1, weight_format: str = "bf16",
                          kv_dtype: str | None = "bf16") -> list[str]:
    """Every reason the CUDA backend's kernels cannot run `spec` split over `tp` ranks with weights
    quantised on load to `weight_format` and a `kv_dtype` KV cache (None: not known yet, its condition
    skipped), one string per condition naming the config.json field; [] when they can. Per-rank sizes
    are checked only for a tp that divides the model (ModelSpec.tp_conflict reports the others)."""
    from kernels import cuda_attention as ca
    from kernels import cuda_gdn as cg
    from kernels import cuda_linear as cl
    from kernels import cuda_misc as cm

    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r}: choose from {', '.join(WEIGHT_FORMATS)}")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype {kv_dtype!r}: choose from {', '.join(KV_DTYPES)}")
    problems: list[str] = []
    has_attention = bool(spec.full_attention_layers) or spec.mtp_num_layers > 0     # the MTP layer attends
    has_gdn = bool(spec.linear_attention_layers)
    quantised = weight_format != "bf16"
    bf16_rule = cl._vector_rule("bf16")
    q_rule = max(cl._vector_rule(k) for k in ("fp8_row", "fp8_block", "nvfp4"))

    if has_attention:
        D = spec.head_dim
        if D not in ca.DECODE_HEAD_DIMS:
            problems.append(f"head_dim {D}: the decode attention kernel needs a power of two in "
                            f"[{ca.DECODE_HEAD_DIMS[0]}, {ca.DECODE_HEAD_DIMS[-1]}]")
        elif kv_dtype == "int8" and D not in ca.DECODE_I8_HEAD_DIMS:
            problems.append(f"head_dim {D} with --kv-dtype int8: the int8 decode attention kernel needs "
                            + _one_of(ca.DECODE_I8_HEAD_DIMS))
    if has_gdn:
        if not 2 <= spec.conv_kernel <= cg._CONV_MAX_K:
            problems.append(f"linear_conv_kernel_dim {spec.conv_kernel}: the GDN conv kernel takes widths "
                            f"2..{cg._CONV_MAX_K}")
        if spec.linear_key_head_dim not in cg._REC_KERNELS:
            problems.append(f"linear_key_head_dim {spec.linear_key_head_dim}: the gated delta rule kernels are "
                            f"built for {_one_of(sorted(cg._REC_KERNELS))}")
        if spec.linear_value_head_dim % 8:
            problems.append(f"linear_value_head_dim {spec.linear_value_head_dim}: the gated delta rule kernels "
                            "need a multiple of 8")
    if spec.hidden_size > cm.NORM_MAX_E:
        problems.append(f"hidden_size {spec.hidden_size}: the RMSNorm kernels take at most {cm.NORM_MAX_E}")

    # in_features of the linear layers the decode GEMV reads: (what, value); every one of them is
    # quantised on load with a quantised weight format (the hidden_size ones: at least q/k/v, GDN in_proj
    # or gate|up; router, lm_head and in_proj_a/b stay bf16 and need less)
    split = spec.tp_conflict(tp) is None
    linears = [(f"hidden_size {spec.hidden_size}", spec.hidden_size)]
    if split:
        per = "" if tp == 1 else f" / tp {tp}"
        if has_attention:
            n = spec.num_heads // tp * spec.head_dim
            linears.append((f"num_attention_heads {spec.num_heads} x head_dim {spec.head_dim}{per} = {n} "
                            "(o_proj's in_features)", n))
        if has_gdn:
            n = spec.linear_num_value_heads // tp * spec.linear_value_head_dim
            linears.append((f"linear_num_value_heads {spec.linear_num_value_heads} x linear_value_head_dim "
                            f"{spec.linear_value_head_dim}{per} = {n} (out_proj's in_features)", n))
        if not spec.is_moe:
            n = spec.intermediate_size // tp
            linears.append((f"intermediate_size {spec.intermediate_size}{per}"
                            + (f" = {n}" if tp > 1 else "") + " (down_proj's in_features)", n))
        elif spec.shared_expert_intermediate_size:
            n = spec.shared_expert_intermediate_size // tp
            linears.append((f"shared_expert_intermediate_size {spec.shared_expert_intermediate_size}{per}"
                            + (f" = {n}" if tp > 1 else "") + " (shared_expert.down_proj's in_features)", n))
    rule = q_rule if quantised else bf16_rule
    kind = f"with --weights {weight_format}: the quantised" if quantised else ": the bf16"
    for what, n in linears:
        if n % rule:
            problems.append(f"{what} {kind} GEMV kernels need in_features that are a multiple of {rule}"
                            .replace(" : ", ": "))

    if spec.is_moe:
        X, k = spec.num_experts, spec.num_experts_per_tok
        if X > cm.ROUTE_MAX_X:
            problems.append(f"num_experts {X}: the MoE router kernel takes at most {cm.ROUTE_MAX_X} experts")
        if k > cm.ROUTE_MAX_K:
            problems.append(f"num_experts_per_tok {k}: the MoE router kernel takes at most {cm.ROUTE_MAX_K}")
        if split:
            I = spec.moe_intermediate_size // tp
            per = "" if tp == 1 else f" / tp {tp} = {I}"
            if I % 8:
                problems.append(f"moe_intermediate_size {spec.moe_intermediate_size}{per}: the MoE decode expert "
                                "kernels need a multiple of 8")
            smem = k * (2 * I + 8)
            if smem > cm.SMEM_LIMIT:
                problems.append(f"num_experts_per_tok {k} x moe_intermediate_size {spec.moe_intermediate_size}{per}: "
                                f"the MoE decode expert kernel stages {k} x (2 x {I} + 8) = {smem} bytes of shared "
                                f"memory, more than its {cm.SMEM_LIMIT}")
    return problems


def check_cuda_support(spec: ModelSpec, tp: int = 1, weight_format: str = "bf16",
                       kv_dtype: str | None = "bf16") -> None:
    """ConfigError naming every config.json field whose value the CUDA backend's kernels cannot run
    (cuda_support_problems); None when they can. Pure: reads nothing and needs no GPU."""
    problems = cuda_support_problems(spec, tp, weight_format, kv_dtype)
    if problems:
        raise ConfigError(f"{spec.source}: the CUDA backend's kernels cannot run this model "
                          f"({len(problems)} problem{'s' if len(problems) > 1 else ''}): " + "; ".join(problems)
                          + "; the reference backend (--backend reference, bf16 weights) runs any shape")


def picks_cuda(backend: str, device: str, dtype) -> bool:
    """Whether ranks.backend.choose_backend gives "cuda" for these settings (without its errors: a
    conflicting combination, such as --backend cuda on the CPU, is for it to report). dtype: a torch
    dtype or its name."""
    if not str(device).startswith("cuda") or backend not in ("auto", "cuda"):
        return False
    if backend == "cuda":
        return True
    import torch

    from kernels import launch
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dt == torch.bfloat16 and launch.available()


def _one_of(values) -> str:
    values = [str(v) for v in values]
    return ", ".join(values[:-1]) + " or " + values[-1]
