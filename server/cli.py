"""The ``tandem`` command: one entry point, one subcommand per job.

    tandem generate [MODEL_DIR] --prompt TEXT | --prompt-ids 1,2,3 [--max-new-tokens N] ...
    tandem serve [MODEL_DIR] [--host 127.0.0.1] [--port 8080] [--tp N] [--api-key KEY] ...

With no MODEL_DIR the embedded default model is used. Exit status: 0 on success (serve: after
SIGTERM / SIGINT), 2 for bad arguments or an unloadable model (the message names the flag, file or
field), 1 otherwise (serve: the engine failed while serving, so a supervisor should restart it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from runtime.engine import CPU_MAX_STEP_TOKENS, CPU_PREFILL_CHUNK, CUDA_PREFILL_CHUNK, MAX_CONCURRENCY, step_sizes

log = logging.getLogger("tandem")


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = _finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _int_range(low: int, high: int | None = None):
    """An argparse type: an integer >= low (and <= high when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value
    return parse


_positive_int = _int_range(1)
_count = _int_range(0)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Serve Qwen3.5/3.6 hybrid models.")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a continuation of one prompt in this process")
    g.add_argument("model_dir", nargs="?", default=None,
                   help="Hugging Face model directory (default: the embedded demo model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--prompt-ids", type=_token_ids, help="prompt as comma-separated token ids")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: generation_config.json, else 1.0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 or -1 = off)")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top probability")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--print-token-ids", action="store_true", help="also print the generated token ids")
    g.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N (default cpu)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="activation and weight dtype (default float32 on cpu, bfloat16 on cuda)")
    g.add_argument("--prefill-chunk", type=_positive_int, default=None,
                   help=f"prefill columns per step (default {CUDA_PREFILL_CHUNK} on cuda, {CPU_PREFILL_CHUNK} on cpu)")
    g.add_argument("--tp", type=_positive_int, default=1,
                   help="tensor-parallel ranks (1 runs in this process; N > 1 starts N rank processes)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtract per token present in the output")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract per occurrence in the output")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="penalise prompt and output tokens (>1)")
    add_spec_arguments(g)
    add_backend_arguments(g)
    g.set_defaults(func=cmd_generate)
    add_serve_parser(sub)
    return parser


def add_backend_arguments(p) -> None:
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "reference"],
                   help="layer program: tandem's CUDA kernels or the torch reference ops (default auto: "
                        "cuda for bfloat16 on a CUDA device, the reference ops there, with a warning, for a "
                        "model whose shapes the kernels cannot run)")
    p.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "fp8-block", "nvfp4"],
                   help="weight format on the device, quantised on load from a 16-bit checkpoint (cuda backend); "
                        "a pre-quantised checkpoint (fp8 block-scaled, nvfp4) keeps its own and needs bf16 here")
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "int8"],
                   help="KV cache format: bf16 (the activation dtype) or int8 (symmetric, one fp32 scale per "
                        "64 channels of each token and kv head; about half the KV bytes)")
    p.add_argument("--no-cuda-graph", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--transport", default="auto", choices=["auto", "mailbox", "copies", "nccl", "cpu"],
                   help="all-reduce between GPU ranks (tp > 1): the pinned-host mailbox kernel, staged copies, "
                        "NCCL, or the CPU mailbox (default auto: mailbox unless its startup probe is slow)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights built on the device from config.json alone (benchmarks, smoke tests)")


def default_dtype(args) -> str:
    return args.dtype or ("float32" if args.device == "cpu" else "bfloat16")


def model_dir_problem(model_dir: str) -> str | None:
    """Why MODEL_DIR cannot be a model directory at all (None when it is a directory): said before the
    files inside it are looked for."""
    if not os.path.exists(model_dir):
        return f"{model_dir}: no such model directory"
    if not os.path.isdir(model_dir):
        return f"{model_dir}: not a directory (the model directory holds config.json, the tokenizer and the weights)"
    return None


def backend_conflict(args) -> str | None:
    """Why the backend flags cannot work together (a message naming the flags), or None."""
    dtype = default_dtype(args)
    on_cuda = args.device.startswith("cuda")
    if args.backend == "cuda" and not on_cuda:
        return f"--backend cuda needs --device cuda (got --device {args.device})"
    if args.backend == "cuda" and dtype != "bfloat16":
        return f"--backend cuda runs bfloat16 (got --dtype {dtype})"
    if args.weights != "bf16" and (not on_cuda or args.backend == "reference" or dtype != "bfloat16"):
        return (f"--weights {args.weights} needs the cuda backend (--device cuda, bfloat16); "
                f"got --device {args.device} --dtype {dtype} --backend {args.backend}")
    if args.transport not in ("auto", "cpu") and not on_cuda:
        return f"--transport {args.transport} is for GPU ranks (--device cuda); the CPU ranks use the CPU mailbox"
    return None


def add_serve_parser(sub) -> None:
    from runtime.engine import EngineOptions

    d = EngineOptions()
    s = sub.add_parser("serve", help="serve the OpenAI / Anthropic HTTP APIs")
    s.add_argument("model_dir", nargs="?", default=None,
                   help="Hugging Face model directory (default: the embedded demo model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    s.add_argument("--port", type=_port, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    s.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks (one process per device)")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device kind of the ranks (default cpu)")
    s.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight / activation dtype (default float32 on cpu, bfloat16 on cuda)")
    add_backend_arguments(s)
    s.add_argument("--max-concurrency", type=_int_range(1, MAX_CONCURRENCY), default=d.max_concurrency,
                   help=f"sequences decoded at once, 1..{MAX_CONCURRENCY} (default {d.max_concurrency})")
    s.add_argument("--max-pending", type=_positive_int, default=d.max_pending,
                   help=f"waiting requests before 429 (default {d.max_pending})")
    s.add_argument("--pending-timeout-s", type=_positive_float, default=d.pending_timeout_s,
                   help=f"seconds a request may wait for a slot (default {d.pending_timeout_s:g})")
    s.add_argument("--max-context", type=_positive_int, default=None,
                   help="prompt + output tokens per sequence (default min(max_position_embeddings, 8192))")
    s.add_argument("--prefill-chunk", type=_positive_int, default=None,
                   help=f"prefill columns per sequence per step (default {CUDA_PREFILL_CHUNK} on cuda, "
                        f"{CPU_PREFILL_CHUNK} on cpu)")
    s.add_argument("--max-step-tokens", type=_positive_int, default=None,
                   help=f"columns per step, all sequences together (default on cuda: the prefill chunk + "
                        f"max-concurrency; on cpu {CPU_MAX_STEP_TOKENS}; never below max-concurrency)")
    s.add_argument("--kv-capacity", type=_positive_int, default=None,
                   help="tokens of KV in the pool (default: room for max-concurrency sequences of max-context tokens, "
                        "in whole pages of 64, plus speculation's slack)")
    s.add_argument("--prefix-cache", type=_int_range(0, MAX_CONCURRENCY), default=None, metavar="N",
                   help="prompt-prefix cache entries: a request whose prompt begins with an earlier one's prefills "
                        "only the rest (one GDN state snapshot per entry on every rank; its KV pages stay in the "
                        f"pool until evicted); 0..{MAX_CONCURRENCY}, 0 turns it off (default: max-concurrency)")
    s.add_argument("--snapshot-in-step", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix cache: save a frontier that falls inside a prefill chunk of more than 16 columns "
                        "mid-step (default); --no-snapshot-in-step ends the chunk there instead, and the rest of "
                        "the prompt takes a step of its own")
    s.add_argument("--threads-per-rank", type=_positive_int, default=None,
                   help="torch threads per rank process (default 1)")
    s.add_argument("--no-overlap-steps", dest="overlap_steps", action="store_false",
                   help="plan each step only after the previous one's result (default: the next decode step "
                        "is planned and queued while one runs)")
    s.add_argument("--device-feed", action=argparse.BooleanOptionalAction, default=None,
                   help="choose greedy and temperature-only tokens on the GPU and feed them to the next step, "
                        "launched before they reach the host (default: on at tp 1 with the cuda backend; "
                        "at tp > 1 not yet measured on GPUs, so off unless asked for)")
    s.add_argument("--api-key", default=None,
                   help="require this key (Authorization: Bearer or x-api-key); default $TANDEM_API_KEY")
    s.add_argument("--model-id", default=None, help="model name clients use (default: the model directory's name)")
    s.add_argument("--model-alias", action="append", default=[], help="another accepted model name (repeatable)")
    s.add_argument("--accept-any-model", action="store_true",
                   help="serve unknown model names with this model instead of answering 404")
    s.add_argument("--request-log-jsonl", default=None, metavar="FILE",
                   help="append one JSON event per line (no prompt or output text)")
    s.add_argument("--throughput-interval-s", type=_non_negative_float, default=10.0,
                   help="seconds between throughput events in the request log (default 10; 0 = none)")
    s.add_argument("--chat-template", default=None, metavar="FILE", help="jinja chat template replacing the model's")
    s.add_argument("--thinking", default=None, choices=["on", "off"],
                   help="thinking when a request does not say (default: the template's default)")
    s.add_argument("--preserve-thinking", action="store_true",
                   help="render the reasoning of every past assistant turn (better prefix reuse for agents)")
    s.add_argument("--reasoning-field", default="both", choices=["both", "reasoning_content", "reasoning"],
                   help="OpenAI Chat field(s) carrying reasoning (default both)")
    s.add_argument("--sampling-presets", default="qwen", choices=["qwen", "none"],
                   help="per-mode recommended sampling for omitted fields (default qwen)")
    s.add_argument("--default-max-tokens", type=_positive_int, default=None,
                   help="output cap when a request gives none (default: the rest of the context)")
    s.add_argument("--max-body-mib", type=_positive_float, default=16.0, help="request body limit in MiB (default 16)")
    s.add_argument("--body-timeout-s", type=_positive_float, default=30.0,
                   help="a request body that has not fully arrived after this long between its pieces is a 408 "
                        "(default 30)")
    s.add_argument("--shutdown-timeout-s", type=_non_negative_float, default=15.0,
                   help="seconds in-flight requests may take to finish on SIGTERM (default 15)")
    s.add_argument("--zmq-endpoint", default=None, metavar="ENDPOINT",
                   help="also serve the ZeroMQ protocol here (e.g. tcp://127.0.0.1:5557, ipc:///run/tandem.sock)")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn access log)")
    add_spec_arguments(s)
    s.set_defaults(func=cmd_serve)


def add_spec_arguments(p) -> None:
    p.add_argument("--spec", default="off", choices=["off", "mtp"],
                   help="speculative decoding: 'mtp' drafts with the model's MTP head (default off)")
    p.add_argument("--draft-tokens", type=int, default=3, choices=range(1, 6), metavar="K",
                   help="drafts per speculation round with --spec mtp, 1..5 (default 3)")
    p.add_argument("--draft-vocab", type=_count, default=0, metavar="N",
                   help="draft only among token ids below N: a reduced proposal head of the N most frequent "
                        "tokens (BPE ids follow merge order), cheaper per draft; 0 = the whole vocabulary "
                        "(default)")


def spec_draft_tokens(args: argparse.Namespace, model_dir: str, spec=None) -> int:
    """EngineOptions.spec_draft_tokens from --spec / --draft-tokens; ValueError when the checkpoint
    has no MTP weights (checked on the safetensors headers before any rank starts), or with
    --random-weights when config.json declares no MTP layer (the random weights follow config.json).
    spec: the model's ModelSpec where the caller has read it already (else config.json is read here)."""
    if getattr(args, "spec", "off") != "mtp":
        return 0
    from ranks.weights import Checkpoint, validate
    from runtime.config import load_spec

    spec = spec if spec is not None else load_spec(model_dir)
    if getattr(args, "random_weights", False):
        if not spec.mtp_num_layers:
            raise ValueError(f"--spec mtp needs an MTP layer; {os.path.join(model_dir, 'config.json')} declares "
                             "none (mtp_num_hidden_layers)")
    elif not validate(Checkpoint(model_dir), spec).has_mtp:
        raise ValueError(f"--spec mtp needs the model's MTP weights (mtp.* tensors); {model_dir} has none")
    return args.draft_tokens


def cmd_serve(args: argparse.Namespace) -> int:
    from server.serve import serve

    return serve(args, sys.argv)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from ranks.demo import default_model_dir
    from ranks.local import LocalGenerator
    from ranks.weights import CheckpointError
    from runtime.config import ConfigError
    from runtime.sampling import SamplingParams
    from runtime.tokenizer import Tokenizer, TokenizerError, generation_defaults

    model_dir = args.model_dir or default_model_dir()
    args.dtype = default_dtype(args)
    problem = backend_conflict(args) or model_dir_problem(model_dir)
    if problem:
        print(f"tandem generate: {problem}", file=sys.stderr)
        return 2
    if args.device != "cpu":
        try:
            torch.empty(0, device=args.device)
        except (RuntimeError, AssertionError) as e:
            print(f"tandem generate: --device {args.device}: not usable here: {e}", file=sys.stderr)
            return 2
    tokenizer = None
    try:
        tokenizer = Tokenizer.from_dir(model_dir)
    except TokenizerError as e:
        if args.prompt is not None:
            print(f"tandem generate: --prompt needs a tokenizer: {e}", file=sys.stderr)
            return 2
        args.print_token_ids = True
    try:
        defaults = generation_defaults(model_dir)
    except TokenizerError as e:
        print(f"tandem generate: cannot load {model_dir}: {e}", file=sys.stderr)
        return 2
    temperature = 0.0 if args.greedy else (args.temperature if args.temperature is not None
                                           else defaults.get("temperature", 1.0))
    flags = dict(temperature=args.temperature if not args.greedy else 0.0, top_k=args.top_k, top_p=args.top_p)
    try:
        params = SamplingParams(
            temperature=temperature,
            # top_k <= 0 in generation_config.json means off (as `serve` reads it); -1 is vLLM's "off"
            # -1 from the flag too, as HTTP and ZeroMQ take it; below -1 is refused
            top_k=(0 if args.top_k == -1 else args.top_k) if args.top_k is not None
            else max(0, int(defaults.get("top_k", 0) or 0)),
            top_p=args.top_p if args.top_p is not None else float(defaults.get("top_p", 1.0) or 1.0),
            min_p=args.min_p if args.min_p is not None else 0.0,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    except ValueError as e:
        field = str(e).split(" ")[0]
        if field in flags and flags[field] is None:         # the value came from the checkpoint, not a flag
            where = os.path.join(model_dir, "generation_config.json")
            print(f"tandem generate: cannot load {model_dir}: {where}: {e}", file=sys.stderr)
        else:
            print(f"tandem generate: --{field.replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    prompt_ids = tokenizer.encode(args.prompt) if args.prompt is not None else args.prompt_ids
    extra_eos = (tokenizer.eos_token_ids if tokenizer else set()) | set(defaults.get("eos_token_ids", ()))
    decoder = tokenizer.incremental_decoder() if tokenizer else None
    out_ids: list[int] = []

    def emit(token: int) -> None:
        out_ids.append(token)
        if decoder is not None:
            sys.stdout.write(decoder.add(token))
            sys.stdout.flush()

    def nl() -> str:
        """A newline before an error when generated text is on the line (decoded text was written)."""
        return "\n" if out_ids and decoder is not None else ""

    try:
        from runtime.config import load_spec
        spec = load_spec(model_dir)
        spec_k = spec_draft_tokens(args, model_dir, spec)
        if not args.random_weights:
            from ranks.checkpoint_quant import quantised_conflict
            problem = quantised_conflict(spec, args.weights)
            if problem:
                raise ValueError(problem)
        # a shape the CUDA kernels cannot run (when these flags pick them): auto takes the reference backend
        # (a warning), --backend cuda and quantised weights a ConfigError naming the config.json fields, before
        # any weight is read or any rank starts
        from ranks.backend import resolve_backend
        args.backend = resolve_backend(spec, args.backend, args.device, args.dtype, tp=args.tp,
                                       weights=args.weights, kv_dtype=args.kv_dtype)
        if args.tp > 1 and not args.random_weights:
            # every header, name, shape and dtype (no tensor data) before rank processes start: a checkpoint
            # that cannot load is refused here, as at tp 1, not reported by a rank
            from ranks.weights import Checkpoint, validate
            validate(Checkpoint(model_dir), spec)
    except (ConfigError, CheckpointError, OSError) as e:            # before ValueError: they are ValueErrors
        print(f"tandem generate: cannot load {model_dir}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"tandem generate: {e}", file=sys.stderr)
        return 2
    from server.load_progress import LoadProgress
    progress = LoadProgress("tandem generate")
    try:
        if args.tp == 1 and not spec_k:
            from ranks.backend import build_model
            try:
                model = build_model(model_dir, getattr(torch, args.dtype), args.device, backend=args.backend,
                                    weights=args.weights, cuda_graphs=args.cuda_graphs,
                                    random_weights=args.random_weights, progress=progress)
            finally:
                progress.close()
            gen = LocalGenerator(model, prefill_chunk=step_sizes(args.device, 1, args.prefill_chunk)[0],
                                 kv_dtype=args.kv_dtype)
            for token in gen.generate(prompt_ids, params, set(gen.model.spec.eos_token_ids) | extra_eos):
                emit(token)
        else:
            from runtime import Engine, EngineError, EngineOptions

            options = EngineOptions(max_concurrency=1, prefill_chunk=args.prefill_chunk, log_level=args.log_level,
                                    spec_draft_tokens=spec_k, spec_draft_vocab=args.draft_vocab,
                                    backend=args.backend, weights=args.weights,
                                    kv_dtype=args.kv_dtype,
                                    cuda_graphs=args.cuda_graphs, random_weights=args.random_weights,
                                    transport=args.transport, prefix_cache=0)     # one request: nothing to reuse
            try:
                engine = Engine.start(model_dir, tp=args.tp, device=args.device, dtype=args.dtype, options=options,
                                      on_load_progress=progress)
            finally:
                progress.close()
            with engine:
                for event in engine.submit(prompt_ids, params, stop_token_ids=extra_eos if not args.ignore_eos
                                           else None):
                    for token in event.tokens:
                        emit(token)
                    if event.error:
                        raise EngineError(event.error)
    except (ConfigError, CheckpointError) as e:
        print(f"tandem generate: cannot load {model_dir}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{nl()}tandem generate: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, ArithmeticError) as e:       # ArithmeticError: NaN logits (ranks.sampler.NonFiniteLogits)
        print(f"{nl()}tandem generate: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:                           # Ctrl-C: the engine (if any) was shut down on the way out
        print(f"{nl()}tandem generate: interrupted", file=sys.stderr)
        return 130
    if decoder is not None:
        sys.stdout.write(decoder.flush() + "\n")
    if args.print_token_ids:
        print(",".join(map(str, out_ids)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
