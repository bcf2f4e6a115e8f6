"""Speculative decoding statistics through the server: the real app on a real engine with the packaged
demo model (its trained MTP head), greedy requests, then /metrics against the request log's
request_done `spec` objects (the metrics are fed from the same per-request statistics), and no `spec`
at all with speculation off.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from ranks.demo import PACKAGED_DIR

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")),
                                reason="no packaged demo model")

K = 2
PROMPTS = ("The quick brown fox", "Once upon a time, there was a little girl named", "def fibonacci(n):")
OPTS = dict(max_concurrency=4, max_context=1024, threads_per_rank=1, startup_timeout_s=180)


def _serve_and_run(tmp_path, spec_draft_tokens: int, device_feed: bool = False) -> tuple[list[dict], str, dict]:
    """Start engine + app, run the greedy prompts; return request_done events, /metrics text, engine stats."""
    from runtime import Engine, EngineOptions
    from runtime.tokenizer import Tokenizer, generation_defaults
    from server.app import create_app
    from server.metrics import Metrics
    from server.request_log import RequestLog
    from server.service import Service
    from tests.server_util import running

    log_path = tmp_path / f"requests-k{spec_draft_tokens}-{device_feed}.jsonl"
    engine = Engine.start(PACKAGED_DIR, tp=1, options=EngineOptions(spec_draft_tokens=spec_draft_tokens,
                                                                    device_feed=device_feed, **OPTS))
    service = Service(engine, Tokenizer.from_dir(PACKAGED_DIR), "demo", 1024, generation_defaults(PACKAGED_DIR),
                      request_log=RequestLog(str(log_path)))
    service.metrics = Metrics("demo", service.stats, lambda: service.in_flight)
    try:
        with running(create_app(service)) as url, httpx.Client(base_url=url, timeout=120) as http:
            for i, prompt in enumerate(PROMPTS):
                if i % 2:
                    r = http.post("/v1/chat/completions", json={
                        "model": "demo", "messages": [{"role": "user", "content": prompt}],
                        "temperature": 0, "max_tokens": 24})
                else:
                    r = http.post("/v1/completions", json={"model": "demo", "prompt": prompt, "temperature": 0,
                                                           "max_tokens": 24})
                assert r.status_code == 200, r.text
            metrics = http.get("/metrics").text
            stats = engine.stats()
    finally:
        service.shutdown()
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    return [e for e in events if e["event"] == "request_done"], metrics, stats


def _value(text: str, name: str, **labels: str) -> float:
    want = dict(model_name="demo", **labels)
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if got == want:
            return float(m.group(2))
    raise AssertionError(f"no {name}{want} in /metrics")


def test_spec_stats_in_metrics_and_request_log(tmp_path):
    done, metrics, stats = _serve_and_run(tmp_path, K)
    assert len(done) == len(PROMPTS) and all(e["status"] == 200 for e in done)
    specs = [e["spec"] for e in done]
    for s in specs:
        assert s["rounds"] > 0 and 0 <= s["accepted"] <= s["drafted"] <= K * s["rounds"]
        assert len(s["accepted_hist"]) == K + 1 and sum(s["accepted_hist"]) == s["rounds"]
        assert sum(i * n for i, n in enumerate(s["accepted_hist"])) == s["accepted"]
        assert len(s["position_drafted"]) == K and sum(s["position_drafted"]) == s["drafted"]
        assert sum(s["position_accepted"]) == s["accepted"]
        assert all(a <= d for a, d in zip(s["position_accepted"], s["position_drafted"]))
        assert len(s["position_acceptance"]) == K
    total = {k: sum(s[k] for s in specs) for k in ("rounds", "drafted", "accepted")}
    assert _value(metrics, "tandem_spec_rounds_total") == total["rounds"]
    assert _value(metrics, "tandem_spec_draft_tokens_total") == total["drafted"]
    assert _value(metrics, "tandem_spec_accepted_tokens_total") == total["accepted"]
    assert total["accepted"] <= total["drafted"] and total["accepted"] > 0     # the trained head does accept
    for p in range(K):
        assert _value(metrics, "tandem_spec_position_draft_tokens_total", position=str(p + 1)) == \
            sum(s["position_drafted"][p] for s in specs)
        assert _value(metrics, "tandem_spec_position_accepted_tokens_total", position=str(p + 1)) == \
            sum(s["position_accepted"][p] for s in specs)
    for n in range(K + 1):
        assert _value(metrics, "tandem_spec_accepted_length_total", length=str(n)) == \
            sum(s["accepted_hist"][n] for s in specs)
    # every request reached the engine's final event, so the engine's global totals agree too
    assert {k: stats["spec"][k] for k in total} == total
    assert _value(metrics, "tandem_spec_acceptance_rate") == pytest.approx(total["accepted"] / total["drafted"])
    # speculation rounds are never planned ahead
    assert _value(metrics, "tandem_engine_steps_total") == stats["steps"] > 0
    assert _value(metrics, "tandem_engine_steps_ahead_total") == stats["steps_ahead"] == 0
    assert _value(metrics, "tandem_engine_steps_fed_total") == stats["steps_fed"] == 0


def test_no_spec_fields_with_speculation_off(tmp_path):
    done, metrics, stats = _serve_and_run(tmp_path, 0)
    assert len(done) == len(PROMPTS) and all(e["status"] == 200 for e in done)
    assert all("spec" not in e for e in done)
    assert "spec" not in stats
    assert _value(metrics, "tandem_spec_rounds_total") == 0
    assert _value(metrics, "tandem_spec_draft_tokens_total") == 0
    assert "tandem_spec_position_draft_tokens_total{" not in metrics
    assert "tandem_spec_acceptance_rate" not in metrics
    # the engine's step counters: decode steps planned ahead, and the steps' wall time by part
    assert _value(metrics, "tandem_engine_steps_total") == stats["steps"] > 0
    assert 0 < _value(metrics, "tandem_engine_steps_ahead_total") == stats["steps_ahead"] < stats["steps"]
    assert _value(metrics, "tandem_engine_steps_fed_total") == stats["steps_fed"] == 0       # off by default
    for part, key in (("coordinator", "coordinator_s"), ("wait", "wait_s"), ("rank0", "rank_s")):
        assert _value(metrics, "tandem_engine_step_seconds_total", part=part) == pytest.approx(stats["step_time"][key])
        assert stats["step_time"][key] > 0


def test_device_fed_steps_are_counted(tmp_path):
    """EngineOptions.device_feed (serve --device-feed): greedy decode steps planned ahead take their
    inputs from the previous step's device ids; /metrics and the engine's stats count them alike."""
    done, metrics, stats = _serve_and_run(tmp_path, 0, device_feed=True)
    assert len(done) == len(PROMPTS) and all(e["status"] == 200 for e in done)
    assert 0 < _value(metrics, "tandem_engine_steps_fed_total") == stats["steps_fed"] <= stats["steps_ahead"]
