"""`--request-log-jsonl FILE`: one JSON object per line, appended and flushed per event.

Every event has "v" (schema version, 1), "event", "ts" (unix seconds, float) and "instance" (random
per server process). Events:
  server_start      config (flags), argv (the API key redacted), pid, model
  request_start     request_id, client, api, model, stream, prompt_tokens, max_tokens, sampling, thinking,
                    tools / tool_choice shape
  request_rejected  request_id, client, path, api, status, kind, param, message (our own error text)
  request_done      request_id, client, api, status (200, or 499 when the client went away), finish_reason,
                    prompt/completion/total/cached/reasoning tokens, timings {queue_s, ttft_s, prefill_s,
                    decode_s, total_s, e2e_s}, parser_notes (why markup fell back to text), and, only when
                    speculation ran for the request, spec {rounds, drafted, accepted, accepted_hist (rounds by
                    number of drafts accepted, 0..K), position_drafted / position_accepted (per draft position
                    1..K), position_acceptance (accepted / drafted per position, null where none drafted),
                    tokens_per_round}
  request_error     request_id, client, api, status, kind, message, tokens so far
  engine_failed     reason
  throughput        interval_s, token deltas and rates, finished / failed / cancelled deltas, scheduler gauges,
                    gpus [{index, util_pct, mem_used_mib, mem_total_mib, power_w, temp_c, sm_clock_mhz}]
                    (NVML, when pynvml and a GPU are present; read on the stats thread)
  server_stop       reason
Never prompt or output text.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1
REDACTED = "<redacted>"


def redact_argv(argv: list[str], secret_flags: tuple[str, ...] = ("--api-key",)) -> list[str]:
    """argv with the values of secret flags replaced (both `--flag VALUE` and `--flag=VALUE`, and the
    abbreviations argparse accepts for them, `--api VALUE`)."""
    def secret(option: str) -> bool:
        return len(option) > 2 and option.startswith("--") and any(f.startswith(option) for f in secret_flags)

    out, hide_next = [], False
    for a in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif secret(a):
            out.append(a)
            hide_next = True
        elif "=" in a and secret(a.split("=", 1)[0]):
            out.append(a.split("=", 1)[0] + "=" + REDACTED)
        else:
            out.append(a)
    return out


class RequestLog:
    """Thread-safe JSONL writer; event() never raises (a full disk must not fail requests)."""

    def __init__(self, path: str):
        self.path = path
        self.instance = secrets.token_hex(6)
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._stats_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._warned = False

    def event(self, name: str, **fields: Any) -> None:
        record = {"v": SCHEMA_VERSION, "event": name, "ts": round(time.time(), 6), "instance": self.instance, **fields}
        try:
            line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
            with self._lock:
                if self._file.closed:
                    return
                self._file.write(line + "\n")
                self._file.flush()
        except (OSError, ValueError) as e:
            if not self._warned:
                self._warned = True
                log.warning("request log %s: cannot write: %s", self.path, e)

    def start_throughput(self, stats_fn: Callable[[], dict], interval_s: float = 10.0) -> None:
        """Write a throughput event every interval_s from a daemon thread until close()."""
        if self._stats_thread is not None or interval_s <= 0:
            return
        self._stats_thread = threading.Thread(target=self._throughput_loop, args=(stats_fn, interval_s),
                                              name="tandem-request-log-stats", daemon=True)
        self._stats_thread.start()

    def _throughput_loop(self, stats_fn: Callable[[], dict], interval_s: float) -> None:
        gpus = _Nvml()
        last, t_last = {}, time.monotonic()
        counters = ("prompt_tokens", "generated_tokens", "finished", "failed", "cancelled", "requests", "steps",
                    "steps_ahead", "steps_fed")
        last_time: dict = {}
        gauges = ("running", "waiting", "slots_used", "pages_used", "pages_total")
        try:
            while not self._stop.wait(interval_s):
                try:
                    stats = stats_fn() or {}
                except Exception as e:      # the engine may be gone
                    stats = {"failure": str(e)}
                now = time.monotonic()
                dt = now - t_last
                deltas = {k: stats[k] - last.get(k, 0) for k in counters if k in stats}
                fields: dict[str, Any] = dict(interval_s=round(dt, 3), **{f"{k}_delta": v for k, v in deltas.items()},
                                              **{k: stats[k] for k in gauges if k in stats})
                if "generated_tokens" in deltas and dt > 0:
                    fields["generation_tok_s"] = round(deltas["generated_tokens"] / dt, 2)
                if "prompt_tokens" in deltas and dt > 0:
                    fields["prompt_tok_s"] = round(deltas["prompt_tokens"] / dt, 2)
                st = stats.get("step_time")
                if isinstance(st, dict):
                    n = st.get("steps", 0) - last_time.get("steps", 0)
                    if n > 0:                   # where the interval's steps went, ms per step
                        fields["step_ms"] = {part: round((st.get(key, 0.0) - last_time.get(key, 0.0)) / n * 1e3, 3)
                                             for part, key in (("coordinator", "coordinator_s"), ("wait", "wait_s"),
                                                               ("rank0", "rank_s"))}
                    last_time = dict(st)
                if stats.get("healthy") is False:
                    fields["healthy"] = False
                g = gpus.read()
                if g:
                    fields["gpus"] = g
                self.event("throughput", **fields)
                last, t_last = {k: stats[k] for k in counters if k in stats}, now
        finally:
            gpus.close()

    def close(self, reason: str = "shutdown") -> None:
        self._stop.set()
        if self._stats_thread is not None:
            self._stats_thread.join(5.0)
            self._stats_thread = None
        self.event("server_stop", reason=reason)
        with self._lock:
            try:
                self._file.close()          # flushes what a failed write left in the buffer: may fail again
            except OSError as e:
                if not self._warned:
                    log.warning("request log %s: cannot write: %s", self.path, e)


class _Nvml:
    """Per-GPU stats through pynvml, if it imports and finds devices; otherwise read() returns []."""

    def __init__(self):
        self.nv, self.handles = None, []
        try:
            import pynvml as nv

            nv.nvmlInit()
            self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
            self.nv = nv
        except Exception:              # no pynvml, no driver, no GPU: no GPU stats
            self.nv = None

    def read(self) -> list[dict[str, Any]]:
        if self.nv is None:
            return []
        nv, out = self.nv, []
        for i, h in enumerate(self.handles):
            row: dict[str, Any] = {"index": i}
            for key, fn in (("util_pct", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                            ("mem_used_mib", lambda: nv.nvmlDeviceGetMemoryInfo(h).used >> 20),
                            ("mem_total_mib", lambda: nv.nvmlDeviceGetMemoryInfo(h).total >> 20),
                            ("power_w", lambda: round(nv.nvmlDeviceGetPowerUsage(h) / 1000, 1)),
                            ("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                            ("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))):
                try:
                    row[key] = fn()
                except Exception:      # a field the device does not support
                    pass
            out.append(row)
        return out

    def close(self) -> None:
        if self.nv is not None:
            try:
                self.nv.nvmlShutdown()
            except Exception:
                pass


def spec_log_record(spec: dict) -> dict[str, Any]:
    """request_done's `spec` from a request's speculation statistics (runtime.engine.Event.spec)."""
    drafted, accepted = list(spec.get("position_drafted", ())), list(spec.get("position_accepted", ()))
    tpr = spec.get("tokens_per_round")
    return dict(rounds=spec["rounds"], drafted=spec["drafted"], accepted=spec["accepted"],
                accepted_hist=list(spec.get("accepted_hist", ())), position_drafted=drafted,
                position_accepted=accepted,
                position_acceptance=[round(a / d, 4) if d else None for a, d in zip(accepted, drafted)],
                tokens_per_round=round(tpr, 4) if tpr is not None else None)


def config_record(args: Any, argv: list[str]) -> dict[str, Any]:
    """server_start fields from parsed CLI args (secrets removed) and argv (redacted)."""
    cfg = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
    cfg["api_key_set"] = bool(getattr(args, "api_key", None))
    return dict(config=cfg, argv=redact_argv(list(argv)), pid=os.getpid())
