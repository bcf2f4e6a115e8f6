"""Prometheus metrics of the HTTP frontend (GET /metrics), in a registry of their own.

Names follow vLLM's where one exists (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, token
totals, TTFT / e2e histograms, prefix-cache counters) so existing dashboards work; the rest are
`tandem_*`. Scheduler gauges are read from the engine's stats() at scrape time. Request counters are
labelled by API (chat, completions, messages, responses, ...) and by the X-Tandem-Client label; the
first MAX_CLIENT_LABELS distinct clients get their own label value, later ones count as "other".

Speculative decoding (MTP) counters are fed per request, from the speculation statistics on the engine's
final event of each request that finished (server.service.Finish.spec, via Service.request_done), never
from engine.stats()["spec"] at scrape time; each request is counted once, when it ends, and the counters
add up exactly to the `spec` objects of the request log's request_done events. Requests that end before
the engine's final event (a stop string or tool call matched in the server, client gone, errors) are not
counted, so these totals can be below the engine's own (engine.stats()["spec"]). The series:
  tandem_spec_rounds_total                      speculation rounds (verification steps)
  tandem_spec_draft_tokens_total                draft tokens fed for verification
  tandem_spec_accepted_tokens_total             draft tokens accepted (<= drafted)
  tandem_spec_position_draft_tokens_total{position}     drafts fed at draft position 1..K
  tandem_spec_position_accepted_tokens_total{position}  drafts accepted at draft position 1..K
  tandem_spec_accepted_length_total{length}     rounds that accepted `length` drafts (0..K)
all also labelled model_name. tandem_spec_acceptance_rate (a gauge, accepted / drafted) is the one
speculation series read from engine.stats()["spec"] at scrape time: the engine's global rate.
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

MAX_CLIENT_LABELS = 64
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class Metrics:
    """stats_fn: () -> engine stats dict ({} while loading); in_flight_fn: () -> requests the frontend runs."""

    def __init__(self, model_name: str, stats_fn: Callable[[], dict] | None = None,
                 in_flight_fn: Callable[[], int] | None = None):
        disable_created_metrics()           # process-wide: no *_created series (noise for dashboards)
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.stats_fn, self.in_flight_fn = stats_fn, in_flight_fn
        self._clients: set[str] = set()
        self._lock = threading.Lock()
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", m, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      m, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", m,
                                   registry=r)
        self.requests = Counter("tandem_requests", "Requests by API, client label and HTTP status",
                                ["api", "client", "status"], registry=r)
        self.aborted = Counter("tandem_requests_aborted", "Requests the client abandoned (499)", ["api"],
                               registry=r)
        self.spec_rounds = Counter("tandem_spec_rounds", "Speculation rounds of finished requests", m, registry=r)
        self.spec_drafted = Counter("tandem_spec_draft_tokens", "Draft tokens fed for verification", m,
                                    registry=r)
        self.spec_accepted = Counter("tandem_spec_accepted_tokens", "Draft tokens accepted", m, registry=r)
        self.spec_position_drafted = Counter("tandem_spec_position_draft_tokens",
                                             "Draft tokens fed, by draft position (1..K)", m + ["position"],
                                             registry=r)
        self.spec_position_accepted = Counter("tandem_spec_position_accepted_tokens",
                                              "Draft tokens accepted, by draft position (1..K)", m + ["position"],
                                              registry=r)
        self.spec_accepted_length = Counter("tandem_spec_accepted_length",
                                            "Speculation rounds by number of drafts accepted (0..K)",
                                            m + ["length"], registry=r)
        self.spec_rounds.labels(model_name)
        self.spec_drafted.labels(model_name)
        self.spec_accepted.labels(model_name)
        self.prompt_tokens.labels(model_name)
        self.generation_tokens.labels(model_name)
        self.prefix_queries.labels(model_name)
        self.prefix_hits.labels(model_name)
        r.register(_EngineCollector(self))

    def _client(self, client: str | None) -> str:
        if not client:
            return ""
        with self._lock:
            if client in self._clients:
                return client
            if len(self._clients) < MAX_CLIENT_LABELS:
                self._clients.add(client)
                return client
        return "other"

    def request_finished(self, api: str, client: str | None, status: int, prompt_tokens: int,
                         completion_tokens: int, ttft_s: float | None, e2e_s: float | None,
                         cached_tokens: int = 0) -> None:
        m = self.model_name
        self.requests.labels(api, self._client(client), str(status)).inc()
        if status == 499:
            self.aborted.labels(api).inc()
        self.generation_tokens.labels(m).inc(completion_tokens)
        if status == 200:
            self.prompt_tokens.labels(m).inc(prompt_tokens)
            self.prefix_queries.labels(m).inc(prompt_tokens)
            self.prefix_hits.labels(m).inc(cached_tokens)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
        if e2e_s is not None:
            self.e2e.labels(m).observe(e2e_s)

    def spec_finished(self, spec: dict) -> None:
        """Add one finished request's speculation statistics (runtime.engine.Event.spec)."""
        m = self.model_name
        self.spec_rounds.labels(m).inc(spec.get("rounds", 0))
        self.spec_drafted.labels(m).inc(spec.get("drafted", 0))
        self.spec_accepted.labels(m).inc(spec.get("accepted", 0))
        for i, n in enumerate(spec.get("position_drafted", ())):
            self.spec_position_drafted.labels(m, str(i + 1)).inc(n)
        for i, n in enumerate(spec.get("position_accepted", ())):
            self.spec_position_accepted.labels(m, str(i + 1)).inc(n)
        for length, n in enumerate(spec.get("accepted_hist", ())):
            self.spec_accepted_length.labels(m, str(length)).inc(n)

    def request_rejected(self, api: str, client: str | None, status: int) -> None:
        self.requests.labels(api, self._client(client), str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Scheduler gauges, read from the engine at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.metrics
        stats = m.stats_fn() if m.stats_fn else {}
        labels, values = ["model_name"], [m.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value))
            return c

        used, total = stats.get("pages_used", 0), stats.get("pages_total", 0)
        yield gauge("vllm:num_requests_running", "Requests in the engine's running batch", stats.get("running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting for a slot", stats.get("waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use (0..1)", used / total if total else 0.0)
        yield gauge("tandem_kv_pages_used", "KV pages in use", used)
        yield gauge("tandem_kv_pages_total", "KV pages in the pool", total)
        if "pages_cached" in stats:
            yield gauge("tandem_kv_pages_cached", "KV pages only prefix-cache entries hold (reclaimable)",
                        stats["pages_cached"])
            yield gauge("tandem_prefix_cache_entries", "Prompt-prefix cache entries", stats.get("prefix_entries", 0))
        yield gauge("tandem_slots_used", "Sequence state slots in use", stats.get("slots_used", 0))
        yield gauge("tandem_engine_healthy", "1 while the engine serves", 1.0 if stats.get("healthy") else 0.0)
        yield gauge("tandem_http_requests_in_flight", "Generation requests the frontend is running",
                    m.in_flight_fn() if m.in_flight_fn else 0)
        if "steps" in stats:                                          # engine totals since start
            yield counter("tandem_engine_steps", "Steps the engine ran", stats["steps"])
            yield counter("tandem_engine_steps_ahead", "Decode steps planned and sent while the previous one ran",
                          stats.get("steps_ahead", 0))
            yield counter("tandem_engine_steps_fed", "Steps whose inputs came from the previous step's tokens on "
                          "the device, launched before those reached the host", stats.get("steps_fed", 0))
        st = stats.get("step_time")
        if isinstance(st, dict):
            c = CounterMetricFamily("tandem_engine_step_seconds", "Wall time of the engine's steps by part: "
                                    "coordinator (its own work), wait (for rank 0's result), rank0 (rank 0 "
                                    "inside its steps; part of the wait without steps planned ahead)",
                                    labels=labels + ["part"])
            for part, key in (("coordinator", "coordinator_s"), ("wait", "wait_s"), ("rank0", "rank_s")):
                c.add_metric(values + [part], float(st.get(key, 0.0)))
            yield c
        spec = stats.get("spec")                                      # engine totals, with speculation on
        if isinstance(spec, dict) and "accepted" in spec and "drafted" in spec:
            drafted = spec["drafted"]
            yield gauge("tandem_spec_acceptance_rate", "Accepted / drafted MTP tokens (engine totals)",
                        spec["accepted"] / drafted if drafted else 0.0)
