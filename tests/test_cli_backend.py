"""Backend, weight-format and transport flags: impossible combinations are refused up front (exit 2,
a message naming the flags) by `tandem generate` and `tandem serve`, before any model is loaded; the
option values reach EngineOptions, which validates them too."""

from __future__ import annotations

import random

import pytest

from runtime.engine import EngineOptions
from server.cli import main

BAD = [
    (["--backend", "cuda"], "--backend cuda needs --device cuda"),
    (["--weights", "nvfp4"], "--weights nvfp4 needs the cuda backend"),
    (["--weights", "fp8", "--device", "cuda", "--dtype", "float32"], "--weights fp8 needs the cuda backend"),
    (["--weights", "fp8-block", "--device", "cuda", "--backend", "reference"], "--weights fp8-block needs"),
    (["--transport", "mailbox"], "--transport mailbox is for GPU ranks"),
    (["--transport", "nccl", "--tp", "2"], "--transport nccl is for GPU ranks"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_generate_refuses(flags, message, capsys):
    assert main(["generate", "--prompt-ids", "1,2,3", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_serve_refuses(flags, message, capsys):
    assert main(["serve", "--port", "0", *flags]) == 2
    assert message in capsys.readouterr().err


def test_cuda_backend_on_cuda_with_float32_is_refused(capsys):
    assert main(["generate", "--prompt-ids", "1", "--device", "cuda", "--dtype", "float32", "--backend", "cuda"]) == 2
    assert "--backend cuda runs bfloat16" in capsys.readouterr().err


@pytest.mark.parametrize("field,value", [("backend", "triton"), ("weights", "int4"), ("transport", "rdma")])
def test_engine_options_validate(field, value):
    with pytest.raises(ValueError, match=field):
        EngineOptions(**{field: value})


@pytest.mark.parametrize("flag,value", [("--backend", "triton"), ("--weights", "int4"), ("--transport", "rdma")])
def test_argparse_rejects_unknown_choices(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt-ids", "1", flag, value])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_reference_backend_still_generates_on_cpu(capsys):
    """The default CPU path is untouched by the new flags (the demo model, a few greedy tokens)."""
    assert main(["generate", "--prompt-ids", "1,2,3", "--greedy", "--max-new-tokens", "3", "--print-token-ids",
                 "--backend", "reference"]) == 0
    ids = capsys.readouterr().out.strip().splitlines()[-1].split(",")
    assert len(ids) == 3 and all(i.isdigit() for i in ids)


@pytest.mark.parametrize("flags,want", [
    (["serve"], (256, 1024)),                                                   # cpu defaults
    (["serve", "--device", "cuda"], (2048, 2048 + 8)),                          # a chunk beside 8 decodes
    (["serve", "--device", "cuda", "--max-concurrency", "32"], (2048, 2048 + 32)),
    (["serve", "--device", "cuda", "--prefill-chunk", "512"], (512, 512 + 8)),
    (["serve", "--device", "cuda", "--max-step-tokens", "300"], (2048, 300)),
    (["serve", "--max-concurrency", "2000"], (256, 2000)),                      # never below the decodes
    (["serve", "--prefill-chunk", "64", "--max-step-tokens", "100"], (64, 100)),
    (["generate", "--prompt-ids", "1", "--device", "cuda:1"], (2048, 2049)),
    (["generate", "--prompt-ids", "1"], (256, 1024)),
])
def test_step_sizes_follow_the_device(flags, want):
    """Prefill chunk and step budget: given flags win; otherwise long chunks on cuda (the GPU's matmuls)
    and short ones on cpu. The CLI passes its flags through unresolved (None when not given); the
    coordinator resolves them with runtime.engine.step_sizes."""
    from runtime.engine import step_sizes
    from server.cli import build_parser
    a = build_parser().parse_args(flags)
    assert step_sizes(a.device, getattr(a, "max_concurrency", 1), a.prefill_chunk,
                      getattr(a, "max_step_tokens", None)) == want


@pytest.mark.parametrize("flags,want", [([], None), (["--device-feed"], True), (["--no-device-feed"], False)])
def test_serve_device_feed_flags(flags, want):
    """serve --device-feed / --no-device-feed reach EngineOptions as True / False; neither leaves None,
    which the ranks read as "on for the cuda backend at tp 1" (EngineOptions.device_feed)."""
    from server.cli import build_parser
    assert build_parser().parse_args(["serve", *flags]).device_feed is want
    assert EngineOptions().device_feed is None


def test_engine_options_leave_step_sizes_to_the_device():
    assert EngineOptions().prefill_chunk is None and EngineOptions().max_step_tokens is None


def _copy_model(tmp_path):
    import shutil

    from tests.server_util import tiny_model_dir
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), d)
    return d


@pytest.mark.parametrize("content,names", [
    ('{"temperature": "hot"}', ["generation_config.json", "'temperature'", "number"]),
    ("{not json", ["generation_config.json"]),
    ("[1, 2]", ["generation_config.json", "JSON object"]),
    ('{"temperature": -0.5}', ["generation_config.json", "temperature must be >= 0"]),
    ('{"top_p": 0.0}', ["generation_config.json", "top_p must be in (0, 1]"]),        # was read as 1.0 (off)
])
def test_generate_refuses_a_bad_generation_config_naming_the_file(tmp_path, capsys, content, names):
    """A checkpoint's generation_config.json that cannot be used is refused with exit 2 and a message
    naming the file (not a traceback, nor a flag the user never passed)."""
    d = _copy_model(tmp_path)
    (d / "generation_config.json").write_text(content)
    assert main(["generate", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem generate: cannot load") and "Traceback" not in err, err
    for name in names:
        assert name in err, err


def test_generate_reads_a_negative_top_k_in_generation_config_as_off(tmp_path, capsys):
    d = _copy_model(tmp_path)
    (d / "generation_config.json").write_text('{"top_k": -1, "temperature": 0.0}')
    assert main(["generate", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--print-token-ids"]) == 0


def test_generate_takes_top_k_minus_one_as_off_like_the_apis(tmp_path, capsys):
    """--top-k -1 is "off" as HTTP's and ZeroMQ's top_k -1 (vLLM's): the same tokens as --top-k 0 with a
    seed; -2 is refused naming the flag."""
    d = _copy_model(tmp_path)
    runs = []
    for k in ("-1", "0"):
        assert main(["generate", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--seed", "5",
                     "--temperature", "1.0", "--top-k", k, "--print-token-ids"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0].strip()
    assert main(["generate", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--top-k", "-2"]) == 2
    assert "--top-k" in capsys.readouterr().err


def test_generate_at_tp2_refuses_a_bad_checkpoint_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    """A checkpoint missing a tensor is refused at tp 2 as at tp 1 (exit 2, the tensor named), from the
    safetensors headers, before rank processes are spawned."""
    import runtime.coordinator as coordinator
    from safetensors.torch import load_file, save_file

    def no_spawn(*a, **kw):
        raise AssertionError("a rank process was spawned for a checkpoint that cannot load")

    monkeypatch.setattr(coordinator.subprocess, "Popen", no_spawn)
    d = _copy_model(tmp_path)
    shard = next(d.glob("*.safetensors"))
    tensors = load_file(str(shard))
    victim = sorted(k for k in tensors if "layers.0." in k)[0]
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert not (d / "model.safetensors.index.json").exists()
    assert main(["generate", str(d), "--prompt-ids", "1,2,3", "--tp", "2", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot load" in err and victim.split("layers.0.", 1)[1] in err, err


def test_generate_reports_nan_logits_without_a_traceback(tmp_path, capsys):
    """A checkpoint whose final norm is NaN: `generate` at tp 1 (in process) exits 1 with the sampler's
    message, not a Python traceback, as tp 2 already did."""
    from safetensors.torch import load_file, save_file
    d = _copy_model(tmp_path)
    shard = next(d.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = next(k for k in tensors if k.endswith("norm.weight") and "layers." not in k)
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert main(["generate", str(d), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert "NaN logits" in err and "Traceback" not in err and not err.startswith("\n"), err


def _bad_numbers(kind: str) -> list[str]:
    """Fresh values a flag of this kind must refuse: negative, non-finite, not a number (and zero where
    the flag needs a positive value)."""
    import random
    rng = random.Random()
    neg = f"-{rng.uniform(0.001, 1e6):.3f}" if kind != "int>=0" else str(-rng.randint(1, 10**6))
    out = [neg, "nan", "inf", "-inf", "abc"] if kind != "int>=0" else [neg, "1.5", "abc"]
    return out + (["0"] if kind == "float>0" else [])


NUMERIC_FLAGS = [("serve", "--pending-timeout-s", "float>0"), ("serve", "--max-body-mib", "float>0"),
                 ("serve", "--body-timeout-s", "float>0"), ("serve", "--shutdown-timeout-s", "float>=0"),
                 ("serve", "--throughput-interval-s", "float>=0"), ("serve", "--draft-vocab", "int>=0"),
                 ("generate", "--draft-vocab", "int>=0")]


@pytest.mark.parametrize("command,flag,kind", NUMERIC_FLAGS, ids=[f"{c} {f}" for c, f, _ in NUMERIC_FLAGS])
def test_bad_numeric_flags_are_argparse_errors_naming_the_flag(command, flag, kind, capsys):
    """A value the flag cannot mean (negative, NaN, infinite, zero for a positive one) is an argparse error
    naming the flag, exit 2, before anything loads: not a traceback, and not a server that starts with it
    (a negative --pending-timeout-s failed every queued request, NaN never timed out; --max-body-mib nan
    and --shutdown-timeout-s inf raised tracebacks after the port was bound)."""
    from server.cli import build_parser
    base = ["serve", "--port", "0"] if command == "serve" else ["generate", "--prompt-ids", "1"]
    for value in _bad_numbers(kind):
        with pytest.raises(SystemExit) as e:          # parse only: the old code went on to serve
            build_parser().parse_args([*base, f"{flag}={value}"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}" in err and "Traceback" not in err, (value, err)


@pytest.mark.parametrize("flag,value,dest,want", [
    ("--shutdown-timeout-s", "0", "shutdown_timeout_s", 0.0), ("--throughput-interval-s", "0", "throughput_interval_s", 0.0),
    ("--pending-timeout-s", "0.5", "pending_timeout_s", 0.5), ("--max-body-mib", "0.25", "max_body_mib", 0.25),
    ("--draft-vocab", "0", "draft_vocab", 0), ("--draft-vocab", "4096", "draft_vocab", 4096)])
def test_numeric_flags_take_their_documented_values(flag, value, dest, want):
    from server.cli import build_parser
    args = build_parser().parse_args(["serve", flag, value])
    assert getattr(args, dest) == want


def test_sizes_past_what_an_engine_can_hold_are_refused_before_listening(capsys):
    """--max-concurrency past MAX_CONCURRENCY is an argparse error; a KV pool past MAX_KV_TOKENS (the page
    lists alone exhausted the host's memory: the OOM killer took the server) exits 2 naming the flags,
    before the engine starts or the port is bound."""
    from runtime.coordinator import MAX_KV_TOKENS
    from runtime.engine import MAX_CONCURRENCY
    from server.cli import build_parser, main
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--max-concurrency", str(MAX_CONCURRENCY + 1)])
    assert e.value.code == 2 and "argument --max-concurrency" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--max-concurrency", str(MAX_CONCURRENCY)]).max_concurrency == MAX_CONCURRENCY
    assert main(["serve", "--port", "0", "--kv-capacity", str(MAX_KV_TOKENS + random.randrange(1, 10**9))]) == 2
    err = capsys.readouterr().err
    assert "KV pool" in err and "--kv-capacity" in err, err


def test_prefix_cache_entries_past_max_concurrency_are_refused(capsys):
    """Each prefix-cache entry is a GDN state snapshot on every rank, as costly as a state slot, so
    --prefix-cache (EngineOptions.prefix_cache) takes 0..MAX_CONCURRENCY like --max-concurrency: a
    billion entries made the coordinator build a billion-element snapshot-slot list (~40 GB) and every
    rank reserve a billion snapshots."""
    from runtime import EngineOptions
    from runtime.engine import MAX_CONCURRENCY
    from server.cli import build_parser
    big = MAX_CONCURRENCY + random.randrange(1, 10**9)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--prefix-cache", str(big)])
    assert e.value.code == 2 and "argument --prefix-cache" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prefix_cache"):
        EngineOptions(prefix_cache=big)
    for n in (0, MAX_CONCURRENCY):
        assert build_parser().parse_args(["serve", "--prefix-cache", str(n)]).prefix_cache == n
        assert EngineOptions(prefix_cache=n).prefix_cache == n


@pytest.mark.parametrize("flags,want", [([], True), (["--no-snapshot-in-step"], False), (["--snapshot-in-step"], True)])
def test_serve_snapshot_in_step_reaches_the_engine_options(flags, want, monkeypatch):
    """serve --no-snapshot-in-step (the prefix cache's chunks end on frontiers) reaches EngineOptions;
    the options are caught where serve sizes the KV pool, before anything starts or listens."""
    import runtime.coordinator as coordinator
    from server.cli import build_parser
    from server.serve import serve

    seen = []

    def caught(options, *_a, **_k):
        seen.append(options)
        raise ValueError("stop here")
    monkeypatch.setattr(coordinator, "kv_pool_tokens", caught)
    argv = ["serve", "--device", "cpu", *flags]
    assert serve(build_parser().parse_args(argv), argv) == 2
    assert [o.snapshot_in_step for o in seen] == [want]


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_a_model_directory_that_is_not_one_is_named_first(tmp_path, capsys, cmd):
    """A MODEL_DIR that does not exist, or is a file: exit 2 with one line saying so, before any file
    inside it is looked for (not "no config.json" / "no tokenizer.json" in a directory that is not there)."""
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"not a directory")
    extra = ["--prompt", "hi"] if cmd == "generate" else ["--port", "0"]
    for path, says in ((tmp_path / "missing", "no such model directory"), (a_file, "not a directory")):
        assert main([cmd, str(path), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tandem {cmd}: {path}: {says}") and "config.json in" not in err, err
