"""Prometheus metrics under vLLM's names, so a vLLM dashboard (and rosechat's remote KV panel)
reads a rosechat server unchanged.

Request counters are kept here as requests end; the KV-cache figures come from the engine's
latest CacheSnapshot through a collector, so they are never stale copies of engine state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import CacheSnapshot, Finished

# vLLM's buckets for time to first token (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _SnapshotCollector(Collector):
    def __init__(self, model_name: str, latest: Callable[[], CacheSnapshot | None]) -> None:
        self.model_name, self.latest = model_name, latest

    def collect(self) -> Iterator:
        snap, labels = self.latest(), [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])  # exported as name_total
            c.add_metric(labels, value)
            return c

        s = snap or CacheSnapshot(0, 0, (), (), ())
        yield gauge("vllm:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        usage = s.used_blocks / s.num_blocks if s.num_blocks else 0.0
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Preemptions of running sequences.", s.preemptions)
        yield counter("vllm:spec_decode_num_drafts", "Speculative checks that had guesses.", s.spec_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Speculative tokens guessed.", s.spec_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative tokens kept.", s.spec_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative tokens kept, by position among the guesses.",
                                      labels=["model_name", "position"])
        for position, kept in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([*labels, str(position)], kept)
        yield per_pos


class ServerMetrics:
    """One registry per app (tests start several servers in one process)."""

    def __init__(self, model_name: str, latest: Callable[[], CacheSnapshot | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(model_name, latest))
        lab = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", lab, registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", lab, registry=self.registry)
        self.request_success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", lab,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.e2e):
            metric.labels(model_name)  # exported at 0 from the start, as vLLM does, not after a first request

    def finished(self, ev: Finished) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(ev.usage.prompt_tokens)
        self.generation_tokens.labels(m).inc(ev.usage.completion_tokens)
        self.ttft.labels(m).observe(ev.ttft_s)
        self.e2e.labels(m).observe(ev.total_s)
        for reason in ev.finish_reasons:
            self.request_success.labels(m, reason).inc()

    def aborted(self) -> None:
        self.request_success.labels(self.model_name, "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
