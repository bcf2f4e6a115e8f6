"""The load-time check of the shapes the CUDA backend's kernels can run (ranks/cuda_support.py): every
model of the family the repository knows passes at tp 1 and 2 with every weight format; each condition
a kernel wrapper would raise on at the first step is refused from config.json alone, naming the field;
unusual shapes the kernels take are not refused. On the CPU: the pure function, and its place before the
device is touched (build_model, CudaHybridModel); --backend auto falling back to the reference backend
(resolve_backend), with the kernels' availability faked on the CPU. On a GPU box (the gpu tests at the
end): the CLI's exit 2 under --backend cuda, and auto running such a model on the reference backend."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ranks.cuda_support import check_cuda_support, cuda_support_problems, picks_cuda
from ranks.demo import default_model_dir
from ranks.random_checkpoint import spec_for, text_config
from runtime.config import ConfigError, load_spec, spec_from_hf
from tests.util import tiny_config, tiny_spec

FORMATS = ("bf16", "fp8", "fp8-block", "nvfp4")

KNOWN = {
    "tiny": lambda: spec_for("tiny"),
    "tiny-moe": lambda: spec_for("tiny-moe"),
    "small": lambda: spec_for("small"),
    "27b": lambda: spec_for("27b"),
    "35b-a3b": lambda: spec_for("35b-a3b"),
    "demo": lambda: load_spec(default_model_dir()),
    "tests-tiny-dense": lambda: tiny_spec(False),
    "tests-tiny-moe": lambda: tiny_spec(True),
    "tests-tiny-moe-folded": lambda: tiny_spec(True, shared_expert_intermediate_size=32),
}

# The tiny MoE models' shared expert is 48 wide: at tp 2 its down_proj has 24 input features, which the
# quantised GEMV kernels refuse (in_features % 16: kernels/cuda_linear._check_weight) and nvfp4
# quantisation on load cannot group (kernels/quant.quantize_nvfp4). They run at tp 1, and at tp 2 in bf16.
TINY_MOE_TP2_QUANTISED = {("tiny-moe", 2), ("tests-tiny-moe", 2)}


def _kv_dtypes(spec) -> list[str]:
    return ["bf16", "int8"] if spec.head_dim % 64 == 0 else ["bf16"]     # int8 KV: ModelState's rule too


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(KNOWN))
def test_the_family_passes(name, tp):
    spec = KNOWN[name]()
    assert spec.tp_conflict(tp) is None
    for fmt in FORMATS:
        if fmt != "bf16" and (name, tp) in TINY_MOE_TP2_QUANTISED:
            continue
        for kv in _kv_dtypes(spec):
            assert cuda_support_problems(spec, tp, fmt, kv) == [], (name, tp, fmt, kv)
            check_cuda_support(spec, tp, fmt, kv)


@pytest.mark.parametrize("fmt", FORMATS[1:])
@pytest.mark.parametrize("name", ["tiny-moe", "tests-tiny-moe"])
def test_the_tiny_moe_shared_expert_is_too_narrow_for_quantised_weights_at_tp2(name, fmt):
    spec = KNOWN[name]()
    check_cuda_support(spec, 1, fmt)
    check_cuda_support(spec, 2, "bf16")
    with pytest.raises(ConfigError) as e:
        check_cuda_support(spec, 2, fmt)
    assert "shared_expert_intermediate_size 48 / tp 2 = 24" in str(e.value)
    assert f"--weights {fmt}" in str(e.value) and "multiple of 16" in str(e.value)


def test_the_kernels_nvfp4_quantiser_agrees_on_the_too_narrow_shared_expert():
    """The condition above, where the CPU can show it: nvfp4 quantisation of a 24-wide input fails."""
    from kernels.quant import QuantError, quantize_nvfp4
    quantize_nvfp4(torch.randn(64, 32))
    with pytest.raises(QuantError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(64, 24))


# --------------------------------------------------------------------------------------------------
# Refusals: (config overrides on tests.util.tiny_config, moe, tp, weights, kv dtype, what the message names)

REFUSED = {
    "head_dim_96": (dict(head_dim=96), False, 1, "bf16", "bf16", "head_dim 96: the decode attention kernel"),
    "head_dim_512": (dict(head_dim=512), False, 1, "bf16", "bf16", "head_dim 512: the decode attention kernel"),
    "head_dim_24": (dict(head_dim=24), False, 1, "bf16", "bf16", "head_dim 24: the decode attention kernel"),
    "head_dim_32_int8_kv": ({}, False, 1, "bf16", "int8", "head_dim 32 with --kv-dtype int8"),
    "head_dim_8_int8_kv": (dict(head_dim=8), False, 1, "bf16", "int8", "head_dim 8 with --kv-dtype int8"),
    "conv_1": (dict(linear_conv_kernel_dim=1), False, 1, "bf16", "bf16", "linear_conv_kernel_dim 1"),
    "conv_9": (dict(linear_conv_kernel_dim=9), False, 1, "bf16", "bf16", "linear_conv_kernel_dim 9"),
    "key_dim_48": (dict(linear_key_head_dim=48), False, 1, "bf16", "bf16", "linear_key_head_dim 48"),
    "key_dim_8": (dict(linear_key_head_dim=8), False, 1, "bf16", "bf16", "linear_key_head_dim 8"),
    "key_dim_512": (dict(linear_key_head_dim=512), False, 1, "bf16", "bf16", "linear_key_head_dim 512"),
    "value_dim_12": (dict(linear_value_head_dim=12), False, 1, "bf16", "bf16", "linear_value_head_dim 12"),
    "hidden_over_norm_limit": (dict(hidden_size=16400), False, 1, "bf16", "bf16",
                               "hidden_size 16400: the RMSNorm kernels take at most 16384"),
    "hidden_not_8": (dict(hidden_size=1004), False, 1, "bf16", "bf16", "hidden_size 1004: the bf16 GEMV"),
    "hidden_not_16_quantised": (dict(hidden_size=1032), False, 1, "fp8", "bf16",
                                "hidden_size 1032 with --weights fp8: the quantised GEMV"),
    "o_proj_tp2_quantised": (dict(head_dim=8, num_attention_heads=6), False, 2, "nvfp4", "bf16",
                             "num_attention_heads 6 x head_dim 8 / tp 2 = 24 (o_proj"),
    "out_proj_tp2_quantised": (dict(linear_value_head_dim=8, linear_num_value_heads=6), False, 2, "fp8-block", "bf16",
                               "linear_num_value_heads 6 x linear_value_head_dim 8 / tp 2 = 24 (out_proj"),
    "intermediate_not_8": (dict(intermediate_size=1004), False, 1, "bf16", "bf16", "intermediate_size 1004 (down_proj"),
    "intermediate_not_16_quantised": (dict(intermediate_size=1000), False, 1, "fp8", "bf16",
                                      "intermediate_size 1000 (down_proj"),
    "intermediate_tp2_quantised": (dict(intermediate_size=1040), False, 2, "fp8", "bf16",
                                   "intermediate_size 1040 / tp 2 = 520 (down_proj"),
    "shared_expert_not_8": (dict(shared_expert_intermediate_size=44), True, 1, "bf16", "bf16",
                            "shared_expert_intermediate_size 44 (shared_expert.down_proj"),
    "moe_intermediate_not_8": (dict(moe_intermediate_size=36), True, 1, "bf16", "bf16",
                               "moe_intermediate_size 36: the MoE decode expert kernels need a multiple of 8"),
    "moe_intermediate_tp2": (dict(moe_intermediate_size=40), True, 2, "bf16", "bf16",
                             "moe_intermediate_size 40 / tp 2 = 20: the MoE decode expert kernels"),
    "experts_600": (dict(num_experts=600), True, 1, "bf16", "bf16", "num_experts 600: the MoE router kernel"),
    "top_k_33": (dict(num_experts=64, num_experts_per_tok=33), True, 1, "bf16", "bf16",
                 "num_experts_per_tok 33: the MoE router kernel takes at most 32"),
    "expert_smem": (dict(num_experts_per_tok=8, moe_intermediate_size=3072), True, 1, "bf16", "bf16",
                    "num_experts_per_tok 8 x moe_intermediate_size 3072: the MoE decode expert kernel stages "
                    "8 x (2 x 3072 + 8) = 49216 bytes"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_condition_is_refused_naming_the_field(case):
    over, moe, tp, fmt, kv, names = REFUSED[case]
    spec = tiny_spec(moe, **over)
    assert spec.tp_conflict(tp) is None
    problems = cuda_support_problems(spec, tp, fmt, kv)
    assert len(problems) == 1 and names in problems[0], problems
    with pytest.raises(ConfigError) as e:
        check_cuda_support(spec, tp, fmt, kv)
    msg = str(e.value)
    assert names in msg and "\n" not in msg
    assert msg.startswith(f"{spec.source}: the CUDA backend's kernels cannot run this model")


@pytest.mark.parametrize("case", ["o_proj_tp2_quantised", "out_proj_tp2_quantised", "intermediate_tp2_quantised",
                                  "moe_intermediate_tp2"])
def test_a_per_rank_condition_holds_at_tp1(case):
    over, moe, tp, fmt, kv, _ = REFUSED[case]
    assert cuda_support_problems(tiny_spec(moe, **over), 1, fmt, kv) == []


@pytest.mark.parametrize("case", ["hidden_not_16_quantised", "o_proj_tp2_quantised", "out_proj_tp2_quantised",
                                  "intermediate_not_16_quantised", "intermediate_tp2_quantised"])
def test_a_quantised_condition_holds_with_bf16_weights(case):
    over, moe, tp, _, kv, _ = REFUSED[case]
    assert cuda_support_problems(tiny_spec(moe, **over), tp, "bf16", kv) == []


def test_the_expert_kernels_shared_memory_depends_on_tp():
    spec = tiny_spec(True, num_experts_per_tok=8, moe_intermediate_size=3072)
    assert cuda_support_problems(spec, 2) == []          # 8 x (2 x 1536 + 8) bytes fit


def test_every_problem_is_listed_at_once_in_one_line():
    spec = tiny_spec(False, head_dim=96, linear_conv_kernel_dim=9, linear_key_head_dim=48, linear_value_head_dim=12)
    with pytest.raises(ConfigError) as e:
        check_cuda_support(spec)
    msg = str(e.value)
    assert "(4 problems)" in msg and "\n" not in msg
    for field in ("head_dim 96", "linear_conv_kernel_dim 9", "linear_key_head_dim 48", "linear_value_head_dim 12"):
        assert field in msg
    assert "--backend reference" in msg


def test_a_kv_dtype_not_known_yet_skips_only_its_condition():
    spec = tiny_spec(False)                               # head_dim 32: not for an int8 KV
    assert cuda_support_problems(spec, kv_dtype=None) == []
    assert cuda_support_problems(tiny_spec(False, head_dim=96), kv_dtype=None)


def test_a_tp_that_does_not_divide_the_model_is_left_to_tp_conflict():
    spec = tiny_spec(False)
    assert spec.tp_conflict(3) is not None
    assert cuda_support_problems(spec, 3) == []


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="weight format"):
        cuda_support_problems(tiny_spec(False), weight_format="int4")
    with pytest.raises(ValueError, match="kv dtype"):
        cuda_support_problems(tiny_spec(False), kv_dtype="fp8")


# --------------------------------------------------------------------------------------------------
# Unusual shapes the kernels take (their wrappers' accepted ranges; most also in the kernels' GPU tests)

SUPPORTED = {
    "conv_2": (dict(linear_conv_kernel_dim=2), False),                  # test_cuda_gdn CONV_CASES: 2, 3, 5, 8
    "conv_3": (dict(linear_conv_kernel_dim=3), False),
    "conv_5": (dict(linear_conv_kernel_dim=5), False),
    "conv_8": (dict(linear_conv_kernel_dim=8), False),
    "head_dim_8": (dict(head_dim=8), False),
    "head_dim_16": (dict(head_dim=16), False),
    "head_dim_64": (dict(head_dim=64), False),
    "head_dim_128": (dict(head_dim=128), False),                        # no tensor-core-only path needed
    "head_dim_256": (dict(head_dim=256), False),
    "gqa_12_heads_per_kv": (dict(num_attention_heads=12, num_key_value_heads=1), False),
    "key_dim_32": (dict(linear_key_head_dim=32), False),
    "key_dim_256": (dict(linear_key_head_dim=256), False),
    "value_dim_24": (dict(linear_key_head_dim=64, linear_value_head_dim=24), False),   # test_cuda_gdn dk64-dv24
    "value_dim_40": (dict(linear_value_head_dim=40), False),
    "gva_3": (dict(linear_num_value_heads=6), False),
    "hidden_48": (dict(hidden_size=48), False),
    "hidden_16384": (dict(hidden_size=16384), False),
    "intermediate_136": (dict(intermediate_size=136), False),
    "experts_511_no_fold": (dict(num_experts=511), True),              # fold off at 512 + 1; 511 routes
    "experts_512": (dict(num_experts=512), True),
    "top_k_31": (dict(num_experts=64, num_experts_per_tok=31), True),
    "top_k_32": (dict(num_experts=64, num_experts_per_tok=32), True),   # the fold needs 33: it stays apart
    "moe_intermediate_24": (dict(moe_intermediate_size=24), True),
    "no_shared_expert": (dict(shared_expert_intermediate_size=0), True),
    "experts_smem_near_the_limit": (dict(num_experts_per_tok=8, moe_intermediate_size=3064), True),  # 49088 bytes
}


@pytest.mark.parametrize("case", list(SUPPORTED))
def test_unusual_supported_shapes_are_not_refused(case):
    over, moe = SUPPORTED[case]
    spec = tiny_spec(moe, **over)
    assert cuda_support_problems(spec, 1) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantised_formats_take_widths_of_16(fmt):
    spec = tiny_spec(False, hidden_size=48, intermediate_size=80)
    assert cuda_support_problems(spec, 1, fmt) == []


def test_int8_kv_takes_the_int8_kernels_head_dims():
    for D in (64, 128, 256):
        assert cuda_support_problems(tiny_spec(False, head_dim=D), kv_dtype="int8") == []


# --------------------------------------------------------------------------------------------------
# Where the check runs

def test_which_settings_pick_the_cuda_kernels():
    from kernels import launch
    assert not picks_cuda("auto", "cpu", "float32")
    assert not picks_cuda("cuda", "cpu", "bfloat16")          # choose_backend's own error, not a shape's
    assert not picks_cuda("reference", "cuda", "bfloat16")
    assert picks_cuda("cuda", "cuda", "bfloat16") and picks_cuda("cuda", "cuda:1", torch.bfloat16)
    assert not picks_cuda("auto", "cuda", "float32")
    assert picks_cuda("auto", "cuda", "bfloat16") == launch.available()


@pytest.fixture
def kernels_available(monkeypatch):
    """As on a GPU box: auto picks the CUDA kernels for bfloat16 on cuda (nothing here touches a device)."""
    from kernels import launch
    monkeypatch.setattr(launch, "available", lambda: True)


def test_auto_falls_back_to_the_reference_backend_where_the_kernels_cannot_run(kernels_available, caplog):
    from ranks.backend import resolve_backend
    bad, good = tiny_spec(False, head_dim=96), tiny_spec(False)
    assert resolve_backend(good, "auto", "cuda", "bfloat16") == "cuda"
    assert resolve_backend(good, "auto", "cuda", torch.bfloat16, weights="nvfp4") == "cuda"
    assert not caplog.records
    with caplog.at_level("WARNING", logger="ranks.backend"):
        assert resolve_backend(bad, "auto", "cuda:1", "bfloat16", tp=1, kv_dtype="int8") == "reference"
    (rec,) = caplog.records
    assert rec.levelname == "WARNING"
    assert "head_dim 96" in rec.getMessage() and "reference backend on cuda:1" in rec.getMessage()
    # per rank: a shape the kernels take at tp 1 but not at tp 2 falls back only at tp 2
    odd = tiny_spec(False, intermediate_size=40)            # down_proj's in_features: 40 at tp 1, 20 at tp 2
    assert cuda_support_problems(odd, 1) == [] and cuda_support_problems(odd, 2)
    assert resolve_backend(odd, "auto", "cuda", "bfloat16", tp=1) == "cuda"
    assert resolve_backend(odd, "auto", "cuda", "bfloat16", tp=2) == "reference"


def test_cuda_and_quantised_weights_are_refused_not_fallen_back(kernels_available):
    from ranks.backend import resolve_backend
    bad = tiny_spec(False, head_dim=96)
    with pytest.raises(ConfigError, match="head_dim 96"):
        resolve_backend(bad, "cuda", "cuda", "bfloat16")
    # the reference backend runs bf16 weights only: quantised weights of such a model have nowhere to go
    with pytest.raises(ConfigError, match="head_dim 96"):
        resolve_backend(bad, "auto", "cuda", "bfloat16", weights="fp8")
    assert resolve_backend(bad, "reference", "cuda", "bfloat16") == "reference"
    assert resolve_backend(bad, "auto", "cpu", "float32") == "reference"
    assert resolve_backend(bad, "auto", "cuda", "float32") == "reference"        # auto's dtype rule, no warning
    with pytest.raises(ValueError, match="needs --device cuda"):
        resolve_backend(tiny_spec(False), "cuda", "cpu", "bfloat16")


def test_generate_passes_the_fallback_to_its_ranks(tmp_path, kernels_available, monkeypatch, capsys):
    """tandem generate resolves auto once, before the engine starts, and hands the ranks "reference"."""
    import runtime
    from server.cli import main
    seen = {}

    def start(model_dir, *, tp, device, dtype, options, on_load_progress=None):
        seen.update(backend=options.backend, tp=tp, device=device)
        raise runtime.EngineError("stopped here by the test")
    monkeypatch.setattr(runtime.Engine, "start", staticmethod(start))
    empty = torch.empty          # generate's probe of --device: a CPU tensor stands in for the GPU's here
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **kw: empty(*a, **kw))
    d = _config_dir(tmp_path, head_dim=96)
    assert main(["generate", d, "--prompt-ids", "1,2,3", "--device", "cuda", "--tp", "2", "--random-weights"]) != 0
    assert seen == dict(backend="reference", tp=2, device="cuda")
    assert "stopped here by the test" in capsys.readouterr().err


def test_serve_passes_the_fallback_to_its_ranks(tmp_path, kernels_available, monkeypatch, capsys):
    import runtime.coordinator as coordinator
    import server.serve as serve_mod
    from ranks.random_checkpoint import build_tokenizer, write_tokenizer
    from server.cli import main
    seen = {}

    def pool(options, *a):
        seen["backend"] = options.backend
        raise ValueError("stopped here by the test")
    monkeypatch.setattr(serve_mod, "_device_problem", lambda device: None)
    monkeypatch.setattr(coordinator, "kv_pool_tokens", pool)
    d = _config_dir(tmp_path, head_dim=96)
    write_tokenizer(d, build_tokenizer(text_config("tiny")["vocab_size"]))
    assert main(["serve", d, "--port", "0", "--device", "cuda", "--random-weights"]) == 2
    assert seen == {"backend": "reference"}
    assert main(["serve", d, "--port", "0", "--device", "cuda", "--backend", "cuda", "--random-weights"]) == 2
    assert "head_dim 96" in capsys.readouterr().err and seen == {"backend": "reference"}


def _config_dir(tmp_path, **over) -> str:
    """A model directory holding only config.json: the tiny preset's text config with overrides."""
    cfg = text_config("tiny")
    cfg.update(over)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_build_model_refuses_before_the_device_is_touched(tmp_path):
    """tandem generate's in-process model: the shape is refused before torch.cuda.set_device (which on
    a machine without a GPU would fail otherwise) and before any weight is read (the directory has none)."""
    from ranks.backend import build_model
    d = _config_dir(tmp_path, head_dim=96)
    with pytest.raises(ConfigError) as e:
        build_model(d, torch.bfloat16, "cuda", backend="cuda")
    assert "head_dim 96" in str(e.value) and os.path.join(d, "config.json") in str(e.value)


def test_the_reference_backend_still_takes_any_shape(tmp_path):
    from ranks.backend import build_model
    d = _config_dir(tmp_path, head_dim=96, linear_conv_kernel_dim=9)
    model = build_model(d, torch.float32, "cpu", backend="auto", random_weights=True)
    assert model.spec.head_dim == 96 and model.spec.conv_kernel == 9


def test_generate_on_the_cpu_is_not_held_to_the_kernels(tmp_path, capsys):
    """The default CPU path (reference backend) runs a shape the CUDA kernels cannot."""
    from server.cli import main
    d = _config_dir(tmp_path, head_dim=96, linear_conv_kernel_dim=9)
    assert main(["generate", d, "--prompt-ids", "1,2,3", "--random-weights", "--greedy", "--max-new-tokens", "2",
                 "--print-token-ids"]) == 0, capsys.readouterr().err


def test_cuda_model_refuses_before_looking_at_the_weights():
    """A direct user of CudaHybridModel gets the same message, before its device checks (so on the CPU)."""
    from ranks.model_cuda import CudaHybridModel
    w = {"embed_tokens.weight": torch.zeros(4, 4)}
    with pytest.raises(ConfigError, match="linear_key_head_dim 48"):
        CudaHybridModel(tiny_spec(False, linear_key_head_dim=48), w)
    with pytest.raises(ConfigError, match="with --weights fp8"):
        CudaHybridModel(tiny_spec(True, **{"shared_expert_intermediate_size": 48}), dict(w), tp=2, weight_format="fp8")
    with pytest.raises(ValueError, match="needs weights on a CUDA device"):
        CudaHybridModel(tiny_spec(False), w)


def test_the_config_fields_are_the_ones_config_json_spells():
    """Each refused field is a config.json key (the names in the message are the file's, not ModelSpec's)."""
    keys = set(tiny_config(False)) | set(tiny_config(True))
    for over, *_ in REFUSED.values():
        assert set(over) <= keys
    spec = spec_from_hf(tiny_config(False, linear_conv_kernel_dim=9))
    assert "linear_conv_kernel_dim 9" in cuda_support_problems(spec)[0]


# --------------------------------------------------------------------------------------------------
# On a GPU box: the CLI exits 2 naming the field, before any rank starts; supported odd shapes run

def _bad_dir(tmp_path):
    return _config_dir(tmp_path, head_dim=96)


@pytest.mark.gpu
def test_generate_on_cuda_refuses_with_exit_2(tmp_path, capsys):
    from server.cli import main
    d = _bad_dir(tmp_path)
    assert main(["generate", d, "--prompt-ids", "1,2,3", "--device", "cuda", "--backend", "cuda",
                 "--random-weights"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tandem generate: cannot load {d}: ") and "head_dim 96" in err and "\n" not in err


@pytest.mark.gpu
@pytest.mark.parametrize("engine", [False, True], ids=["in-process", "engine"])
def test_generate_on_cuda_with_auto_runs_on_the_reference_backend(tmp_path, capsys, caplog, engine):
    """auto on a GPU with a shape the kernels cannot run: the reference backend on the GPU, the same
    greedy tokens as --backend reference asked for explicitly, and a warning naming the field. In process
    (build_model), and through the engine's rank process (speculation with the MTP head takes the engine).
    """
    from server.cli import main
    d = _bad_dir(tmp_path)
    ids = ",".join(str(1 + i % 200) for i in range(40))
    extra = ["--spec", "mtp"] if engine else []
    out = {}
    for backend in ("auto", "reference"):
        with caplog.at_level("WARNING", logger="ranks.backend"):
            assert main(["generate", d, "--prompt-ids", ids, "--device", "cuda", "--backend", backend,
                         "--random-weights", "--greedy", "--max-new-tokens", "6", "--print-token-ids", *extra]) == 0
        cap = capsys.readouterr()
        out[backend] = cap.out.strip()
    assert out["auto"] == out["reference"] and len(out["auto"].split(",")) == 6, out
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "head_dim 96" in warned[0] and "reference backend" in warned[0]


@pytest.mark.gpu
def test_generate_on_cuda_at_tp2_refuses_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    import runtime.coordinator as coordinator
    from server.cli import main

    def no_spawn(*a, **kw):
        raise AssertionError("a rank process was spawned for a model the CUDA kernels cannot run")
    monkeypatch.setattr(coordinator.subprocess, "Popen", no_spawn)
    d = _bad_dir(tmp_path)
    assert main(["generate", d, "--prompt-ids", "1,2,3", "--device", "cuda", "--tp", "2", "--backend", "cuda",
                 "--random-weights"]) == 2
    assert "head_dim 96" in capsys.readouterr().err


@pytest.mark.gpu
def test_serve_on_cuda_refuses_before_listening(tmp_path, capsys, monkeypatch):
    import server.serve as serve_mod
    from server.cli import main

    def no_bind(*a, **kw):
        raise AssertionError("serve bound its port for a model the CUDA kernels cannot run")
    monkeypatch.setattr(serve_mod, "_bind", no_bind)
    from ranks.random_checkpoint import build_tokenizer, write_tokenizer
    d = _bad_dir(tmp_path)
    write_tokenizer(d, build_tokenizer(text_config("tiny")["vocab_size"]))            # serve reads one first
    assert main(["serve", d, "--port", "0", "--device", "cuda", "--backend", "cuda", "--random-weights"]) == 2
    err = capsys.readouterr().err
    assert "cannot load" in err and "head_dim 96" in err


@pytest.mark.gpu
@pytest.mark.parametrize("over,fmt", [
    (dict(linear_conv_kernel_dim=2, linear_value_head_dim=24), "bf16"),
    (dict(linear_conv_kernel_dim=8, head_dim=128), "bf16"),
    (dict(hidden_size=48, linear_key_head_dim=32), "fp8"),
    (dict(head_dim=16, linear_num_value_heads=6), "nvfp4"),
], ids=["conv2-dv24", "conv8-d128", "hidden48-dk32-fp8", "d16-gva3-nvfp4"])
def test_unusual_supported_shapes_run_on_the_kernels(tmp_path, capsys, over, fmt):
    """A prompt past the chunked GDN rule's threshold and a few decode steps on random weights."""
    from server.cli import main
    d = _config_dir(tmp_path, **over)
    ids = ",".join(str(1 + i % 200) for i in range(300))
    assert main(["generate", d, "--prompt-ids", ids, "--device", "cuda", "--backend", "cuda", "--weights", fmt,
                 "--random-weights", "--greedy", "--max-new-tokens", "4", "--print-token-ids"]) == 0, \
        capsys.readouterr().err
