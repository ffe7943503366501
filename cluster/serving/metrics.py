"""Prometheus metrics of the OpenAI server (`GET /metrics`): request and token counters,
latency histograms observed per request, and engine state read at scrape time (queue
depth, running sequences, speculation counters, acceptance by draft position, the
validate-time model's error).

    curl -s http://127.0.0.1:8000/metrics | grep '^adaspec_'
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cluster.engine.request import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class EngineSnapshot:
    waiting: int
    running: int
    drafted: int
    verified: int
    accepted: int
    accepted_per_position: list[int]
    verified_per_position: list[int]
    recoveries: int
    aborted: int


def engine_state(engine) -> tuple[EngineSnapshot, object]:
    """(read in the engine's process, under its lock) the counters a scrape shows, and the
    time-model link's last known report (None without adaptive speculation)."""
    s = engine.stats
    snap = EngineSnapshot(len(engine.scheduler.waiting), len(engine.scheduler.running), s.drafted, s.verified,
                          s.accepted, list(s.accepted_per_position), list(s.verified_per_position), s.recoveries,
                          s.aborted)
    link = engine.time_models
    return snap, (link.report() if link is not None else None)  # a report never waits on the profile actor


class ServerMetrics:
    """One registry per server (not the process-wide default one)."""

    def __init__(self, engine):
        self.engine = engine  # anything with state() -> engine_state(...)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("adaspec_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("adaspec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("adaspec_generation_tokens", "Tokens generated for finished requests",
                                         registry=r)
        self.ttft = Histogram("adaspec_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("adaspec_time_per_output_token_seconds", "Mean time per output token after the first",
                              registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("adaspec_e2e_request_latency_seconds", "Request received to last token", registry=r,
                             buckets=LATENCY_BUCKETS)
        self._lock = threading.Lock()
        self._decode_tokens = 0  # tokens after each sample's first
        self._decode_steps = 0  # target verifications that produced them
        r.register(_EngineCollector(self))

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe_finished(self, outputs: list[RequestOutput], latency_s: float) -> None:
        self.prompt_tokens.inc(len(outputs[0].prompt_ids))
        self.e2e.observe(latency_s)
        for out in outputs:
            self.generation_tokens.inc(len(out.token_ids))
            self.ttft.observe(out.ttft_s)
            if len(out.token_ids) > 1:
                self.tpot.observe(out.tpot_ms / 1e3)
            decode = max(len(out.token_ids) - 1, 0)
            with self._lock:  # every decode step emits one target token plus the accepted drafts
                self._decode_tokens += decode
                self._decode_steps += max(decode - out.accepted, 0)

    def mean_acceptance_length(self) -> float | None:
        with self._lock:
            return self._decode_tokens / self._decode_steps if self._decode_steps else None

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Reads the engine at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        snap, report = self.metrics.engine.state()
        yield _gauge("adaspec_queue_depth", "Requests waiting to be scheduled", snap.waiting)
        yield _gauge("adaspec_running_sequences", "Sequences being prefilled or decoded", snap.running)
        for name, doc, value in (("drafted", "Draft tokens proposed", snap.drafted),
                                 ("verified", "Draft tokens sent to target validation", snap.verified),
                                 ("accepted", "Draft tokens the target accepted", snap.accepted)):
            yield CounterMetricFamily(f"adaspec_spec_{name}_tokens", doc, value=value)
        yield CounterMetricFamily("adaspec_worker_recoveries", "Worker groups rebuilt after a rank died",
                                  value=snap.recoveries)
        yield CounterMetricFamily("adaspec_aborted_sequences", "Sequences dropped because their client went away",
                                  value=snap.aborted)
        mal = self.metrics.mean_acceptance_length()
        if mal is not None:
            yield _gauge("adaspec_mean_acceptance_length", "Tokens emitted per decode step (1 + accepted drafts)",
                         mal)
        rate = GaugeMetricFamily("adaspec_acceptance_rate", "Accepted / verified drafts at each draft position",
                                 labels=["position"])
        for j, (acc, ver) in enumerate(zip(snap.accepted_per_position, snap.verified_per_position)):
            if ver:
                rate.add_metric([str(j)], acc / ver)
        yield rate
        yield from self._time_model(report)

    def _time_model(self, report):
        if report is None:
            return
        yield _gauge("adaspec_time_model_version", "Validate-time model version in use", report.version)
        if report.mape is not None:
            yield _gauge("adaspec_time_model_mape", "Validate-time model mean absolute percentage error", report.mape)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
