"""`tandem serve`: build the Service and the app, bind, run uvicorn (uvloop), and pick the exit status.

Order: read the tokenizer, config and chat template (a bad model directory exits 2 before anything
listens), bind the socket (a busy port exits 2), start uvicorn; the engine loads in the background
while /health answers 503. SIGTERM / SIGINT: stop accepting, let in-flight requests finish for up to
--shutdown-timeout-s (then cancel them; a second signal cancels them at once), shut the engine and
its ranks down, exit 0. A signal at any moment counts: one that comes while serve is still reading
the model directory or binding (no rank started yet) ends it at once with exit 0, and one that comes
between the "listening" line and uvicorn's own handlers is the same graceful stop. An engine
failure: in-flight requests get their errors, the server stops, exit 1 (systemd restarts it).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import sys
import threading

import uvicorn

log = logging.getLogger("tandem.serve")


def _fail(message: str) -> int:
    print(f"tandem serve: {message}", file=sys.stderr)
    return 2


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)                   # connections queue from now on; uvicorn accepts them once it runs
    sock.set_inheritable(True)
    return sock


class _StopBeforeServing(Exception):
    """A SIGTERM / SIGINT while serve starts, before uvicorn's handlers: nothing runs yet but this process."""


def serve(args, argv: list[str]) -> int:
    """Run `tandem serve` (exit status as the module docstring says). A SIGTERM / SIGINT from the first
    line on is honoured: while starting it ends serve at once (exit 0: nothing runs yet, no rank has
    started); from the moment the server object exists it is the server's own shutdown."""
    held: dict = {}

    def stop_starting(sig, frame):
        raise _StopBeforeServing(signal.Signals(sig).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_starting)
    try:
        return _serve(args, argv, held)
    except _StopBeforeServing as e:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)          # the cleanup below is not cut short again
        if held.get("sock") is not None:
            held["sock"].close()
        if held.get("request_log") is not None:
            held["request_log"].close(f"{e} while starting")
        print(f"tandem serve: stopped by {e} while starting", file=sys.stderr, flush=True)
        return 0


def _serve(args, argv: list[str], held: dict) -> int:
    from ranks.demo import default_model_dir
    from runtime.config import ConfigError, load_spec
    from runtime.engine import Engine, EngineOptions
    from runtime.tokenizer import Tokenizer, TokenizerError, generation_defaults
    from server.app import create_app
    from server.load_progress import LoadProgress
    from server.metrics import Metrics
    from server.request_log import RequestLog, config_record
    from server.service import QWEN_MODE_SAMPLING, Service

    from server.cli import backend_conflict, model_dir_problem
    model_dir = args.model_dir or default_model_dir()
    api_key = args.api_key or os.environ.get("TANDEM_API_KEY") or None
    problem = model_dir_problem(model_dir) or backend_conflict(args) or _device_problem(args.device)
    if problem:
        return _fail(problem)
    try:
        spec = load_spec(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        defaults = generation_defaults(model_dir)
    except (ConfigError, TokenizerError, OSError) as e:
        return _fail(f"cannot load {model_dir}: {e}")
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            return _fail(f"--chat-template {args.chat_template}: {e}")
    conflict = spec.tp_conflict(args.tp)             # the ranks' rule, before anything listens (exit 2)
    if conflict:
        return _fail(f"--tp {args.tp}: {conflict}")
    from ranks.checkpoint_quant import quantised_conflict
    conflict = None if args.random_weights else quantised_conflict(spec, args.weights)
    if conflict:
        return _fail(conflict)
    max_context = args.max_context or min(spec.max_position_embeddings, 8192)
    if max_context > spec.max_position_embeddings:
        return _fail(f"--max-context {max_context} exceeds the model's max_position_embeddings "
                     f"{spec.max_position_embeddings}")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    # a shape the CUDA kernels cannot run, when these flags pick them: auto takes the reference backend (a
    # warning), --backend cuda and quantised weights exit 2 naming the config.json fields
    from ranks.backend import resolve_backend
    try:
        backend = resolve_backend(spec, args.backend, args.device, dtype, tp=args.tp, weights=args.weights,
                                  kv_dtype=args.kv_dtype)
    except ConfigError as e:
        return _fail(f"cannot load {model_dir}: {e}")
    except ValueError as e:
        return _fail(str(e))
    from ranks.weights import Checkpoint, CheckpointError, validate
    if not args.random_weights:
        # every header, name, shape and dtype now (headers only, no tensor data): a checkpoint that cannot
        # load exits 2 before anything listens, not 1 from a rank after the port is bound
        try:
            validate(Checkpoint(model_dir), spec)
        except (CheckpointError, OSError) as e:
            return _fail(f"cannot load {model_dir}: {e}")
    from server.cli import spec_draft_tokens
    try:
        spec_k = spec_draft_tokens(args, model_dir, spec)
    except (ValueError, ConfigError, CheckpointError) as e:
        return _fail(str(e))
    options = EngineOptions(max_concurrency=args.max_concurrency, max_pending=args.max_pending,
                            pending_timeout_s=args.pending_timeout_s, prefill_chunk=args.prefill_chunk,
                            max_step_tokens=args.max_step_tokens, max_context=max_context,
                            kv_capacity=args.kv_capacity, prefix_cache=args.prefix_cache,
                            snapshot_in_step=args.snapshot_in_step,
                            threads_per_rank=args.threads_per_rank,
                            log_level=args.log_level, spec_draft_tokens=spec_k, spec_draft_vocab=args.draft_vocab,
                            backend=backend,
                            weights=args.weights, kv_dtype=args.kv_dtype, cuda_graphs=args.cuda_graphs,
                            random_weights=args.random_weights, transport=args.transport,
                            overlap_steps=args.overlap_steps, device_feed=args.device_feed)
    from runtime.coordinator import kv_pool_tokens
    try:
        kv_pool_tokens(options, max_context, ("--max-concurrency", "--max-context", "--kv-capacity"))  # exit 2
    except ValueError as e:                             # before anything listens
        return _fail(str(e))
    model_id = args.model_id or (os.path.basename(os.path.normpath(model_dir)) if args.model_dir else "tandem-demo")
    try:
        request_log = RequestLog(args.request_log_jsonl) if args.request_log_jsonl else None
    except OSError as e:
        return _fail(f"--request-log-jsonl {args.request_log_jsonl}: {e}")
    fields = ("reasoning_content", "reasoning") if args.reasoning_field == "both" else (args.reasoning_field,)
    try:
        service = Service(None, tokenizer, model_id, max_context, defaults, template, request_log,
                          aliases=tuple(args.model_alias), accept_any_model=args.accept_any_model,
                          default_thinking=None if args.thinking is None else args.thinking == "on",
                          preserve_thinking=True if args.preserve_thinking else None,
                          mode_sampling=QWEN_MODE_SAMPLING if args.sampling_presets == "qwen" else None,
                          default_max_tokens=args.default_max_tokens, reasoning_fields=fields)
    except Exception as e:              # a chat template that does not compile
        return _fail(f"cannot build the chat template: {e}")
    service.metrics = Metrics(model_id, stats_fn=service.stats, in_flight_fn=lambda: service.in_flight)
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        return _fail(f"cannot listen on {args.host}:{args.port}: {e}")
    held["sock"] = sock
    attachments = []
    if args.zmq_endpoint:
        from server.zmq_api import ZmqServer

        err = _check_zmq_endpoint(args.zmq_endpoint)
        if err:
            sock.close()
            return _fail(f"--zmq-endpoint {args.zmq_endpoint}: {err}")
        attachments.append(ZmqServer(service, args.zmq_endpoint, api_key))
    host, port = sock.getsockname()[:2]
    if request_log is not None:
        request_log.event("server_start", **config_record(args, argv), model_dir=os.path.abspath(model_dir),
                          model=model_id, max_context=max_context, tp=args.tp, device=args.device, dtype=dtype,
                          listen=f"{host}:{port}", auth=api_key is not None)
        held["request_log"] = request_log   # (before server_start the log holds nothing, as for an exit 2)

    outcome = {"code": 0, "reason": "signal"}

    progress = LoadProgress("tandem serve")
    service.load_progress = progress

    def load():
        try:
            return Engine.start(model_dir, tp=args.tp, device=args.device, dtype=dtype, options=options,
                                on_load_progress=progress)
        finally:
            progress.close()

    def on_fatal(reason: str) -> None:
        outcome.update(code=1, reason=f"engine failure: {reason}")
        server.should_exit = True

    app = create_app(service, api_key, engine_loader=load, on_fatal=on_fatal,
                     max_body_bytes=int(args.max_body_mib * 2**20), throughput_interval_s=args.throughput_interval_s,
                     body_timeout_s=args.body_timeout_s,
                     attachments=tuple(attachments), drain_timeout_s=args.shutdown_timeout_s)
    config = uvicorn.Config(app, loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio", lifespan="on",
                            log_level=args.log_level.lower(), access_log=args.access_log,
                            timeout_graceful_shutdown=max(1, round(args.shutdown_timeout_s)),
                            h11_max_incomplete_event_size=256 * 1024, server_header=False)
    server = _Server(config, service)

    def to_server(sig, frame):
        # from here a signal is the server's shutdown, also in the moment before uvicorn installs its own
        # handlers (uvicorn's startup then sees should_exit and shuts down). uvicorn restores this handler
        # and re-raises a caught signal after a graceful stop: the server is exiting by then, so that
        # re-raise is a no-op and a SIGTERM ends in exit status 0
        if not server.should_exit:
            server.handle_exit(sig, frame)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, to_server)
    held.clear()                        # from here the server's own shutdown closes them
    print(f"tandem serve: listening on http://{host}:{port} (model {model_id}, loading)", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    except SystemExit:                  # uvicorn exits (3) on a failed lifespan startup, e.g. a busy endpoint
        outcome.update(code=2, reason="startup failed")
    finally:
        sock.close()
        if request_log is not None:
            request_log.close(outcome["reason"])
    if service.state == "failed" and outcome["code"] == 0:
        outcome["code"] = 1
    if outcome["code"]:
        print(f"tandem serve: stopped: {outcome['reason']}", file=sys.stderr, flush=True)
    return outcome["code"]


def _device_problem(device: str) -> str | None:
    """Why --device cannot work on this machine (None if it can), found before anything listens. No CUDA
    context is made here (the ranks make their own): only the build and the device count are read."""
    if not device.startswith("cuda"):
        return None
    import torch
    if not torch.backends.cuda.is_built():
        return f"--device {device}: not usable here: this torch build has no CUDA support"
    n = torch.cuda.device_count()
    if n == 0:
        return f"--device {device}: not usable here: no CUDA device is visible"
    if ":" in device:
        index = device.split(":", 1)[1]
        if not index.isdigit():
            return f"--device {device}: expected cuda or cuda:N"
        if int(index) >= n:
            return f"--device {device}: not usable here: {n} CUDA device(s) visible"
    return None


def _check_zmq_endpoint(endpoint: str) -> str | None:
    """Why `endpoint` cannot be bound (None if it can): checked before anything starts, so that a busy
    endpoint exits 2 at once. The real bind happens in the app's lifespan."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(endpoint)
        sock.unbind(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    except zmq.ZMQError as e:
        return str(e)
    finally:
        sock.close(0)
        ctx.term()
    return None


class _Server(uvicorn.Server):
    """uvicorn.Server that puts the service into draining (health 503, new requests refused) on a signal,
    and, a second before uvicorn's graceful-shutdown deadline would cut the connections still open,
    stops the engine: the requests still running then end with their in-band 503 "shutting down"
    error (a streamed error event, or a JSON 503) instead of a dropped connection."""

    CUT_MARGIN_S = 1.0

    def __init__(self, config, service):
        super().__init__(config)
        self.service = service
        self._cut: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and self._cut is not None:
            # a second SIGTERM / SIGINT: do not wait out the timeout. The requests still running end now
            # with their in-band 503 and uvicorn's graceful wait closes their connections (not
            # uvicorn's forced exit on a second SIGINT, which would cut them)
            if not self._cut.finished.is_set():
                self._cut.cancel()
                self._cut = threading.Timer(0, self._cancel_in_flight)
                self._cut.daemon = True
                self._cut.start()
            return
        self.service.begin_drain()
        if self._cut is None and self.config.timeout_graceful_shutdown is not None:
            t = self.config.timeout_graceful_shutdown
            self._cut = threading.Timer(max(0.5 * t, t - self.CUT_MARGIN_S), self._cancel_in_flight)
            self._cut.daemon = True
            self._cut.start()
        super().handle_exit(sig, frame)

    def _cancel_in_flight(self) -> None:
        log.info("shutdown timeout: cancelling the requests still running")
        try:
            self.service.shutdown()
        except Exception:                               # the lifespan's shutdown reports engine errors
            log.exception("stopping the engine at the shutdown timeout failed")
