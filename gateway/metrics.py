"""Prometheus metrics, named like vLLM's (`vllm:x` -> `pagedserve:x`) so its dashboards map
over by prefix.

Two sources: the control plane's Stats RPC, read once per scrape (queue sizes, KV usage,
preemptions), and the gateway's own timing of every request it streams (time to first token,
inter-token latency, end-to-end latency, token counts, finish reasons).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protos.v1 import control_plane_pb2 as pb

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class StatsCollector(Collector):
    """Exposes the last Stats snapshot; the /metrics handler refreshes it before each scrape."""

    def __init__(self) -> None:
        self.snapshot: pb.StatsResponse | None = None
        self.model_name = ""

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name"]
        value = [self.model_name]
        up = GaugeMetricFamily(
            "pagedserve:control_plane_up", "1 when the last Stats call succeeded", labels=labels
        )
        up.add_metric(value, 0.0 if self.snapshot is None else 1.0)
        yield up
        s = self.snapshot
        if s is None:
            return

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pagedserve:{name}", doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pagedserve:{name}", doc, labels=labels)
            c.add_metric(value, v)
            return c

        cpu_total = sum(w.num_cpu_blocks for w in s.workers)
        cpu_used = sum(w.num_cpu_blocks - w.num_free_cpu_blocks for w in s.workers)
        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge(
            "num_requests_waiting",
            "Requests waiting to be scheduled.",
            s.num_waiting + s.num_pending,
        )
        yield gauge("num_requests_swapped", "Requests swapped out to CPU.", s.num_swapped)
        yield gauge("gpu_cache_usage_perc", "Fraction of GPU KV blocks in use.", s.kv_cache_usage)
        yield gauge(
            "cpu_cache_usage_perc",
            "Fraction of CPU swap blocks in use.",
            cpu_used / cpu_total if cpu_total else 0.0,
        )
        yield gauge("num_workers", "Workers the control plane drives.", len(s.workers))
        yield gauge(
            "num_healthy_workers",
            "Workers answering the control plane's health probes.",
            sum(1 for w in s.workers if w.healthy),
        )
        yield counter("num_preemptions", "Preemptions (recompute and swap).", s.num_preemptions)
        yield counter("num_requests_aborted", "Requests aborted upstream.", s.num_requests_aborted)
        yield counter(
            "gpu_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_query_tokens,
        )
        yield counter(
            "gpu_prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hit_tokens,
        )
        yield gauge(
            "prefix_index_available",
            "1 while the Redis prefix index answers.",
            float(s.prefix_index_available),
        )


class GatewayMetrics:
    """One registry per app, so several gateways can live in one process (tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stats = StatsCollector()
        self.registry.register(self.stats)
        r = self.registry
        m = ["model_name"]
        self.ttft = Histogram(
            "pagedserve:time_to_first_token_seconds",
            "Time to first token.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedserve:inter_token_latency_seconds",
            "Time between two streamed token messages.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedserve:e2e_request_latency_seconds",
            "End-to-end request latency.",
            m,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagedserve:prompt_tokens", "Prompt tokens processed.", m, registry=r
        )
        self.generation_tokens = Counter(
            "pagedserve:generation_tokens", "Tokens generated.", m, registry=r
        )
        self.request_prompt_tokens = Histogram(
            "pagedserve:request_prompt_tokens",
            "Prompt tokens per request.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "pagedserve:request_generation_tokens",
            "Generated tokens per request.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.success = Counter(
            "pagedserve:request_success",
            "Finished requests by finish reason.",
            m + ["finished_reason"],
            registry=r,
        )

    def timer(self, model_name: str, final_only: bool = False) -> RequestTimer:
        return RequestTimer(self, model_name, final_only)

    def render(self, snapshot: pb.StatsResponse | None, model_name: str) -> bytes:
        self.stats.snapshot = snapshot
        self.stats.model_name = model_name
        return generate_latest(self.registry)


class RequestTimer:
    """Times one upstream Generate stream, from the call to its final message. A final-only
    stream's first token is timed by the control plane (time_to_first_token_s); it has no
    inter-token latencies to observe."""

    def __init__(self, metrics: GatewayMetrics, model_name: str, final_only: bool = False) -> None:
        self.m = metrics
        self.model_name = model_name
        self.final_only = final_only
        self.start = time.monotonic()
        self.last: float | None = None
        self._itl: Histogram | None = None  # the histogram's child for the model, looked up once

    def on_message(self, msg: pb.GenerateResponse) -> None:
        now = time.monotonic()
        if self.final_only:
            if self.last is None and msg.time_to_first_token_s:
                self.m.ttft.labels(self.model_name).observe(msg.time_to_first_token_s)
                self.last = now
        elif msg.token_ids:
            if self.last is None:
                self.m.ttft.labels(self.model_name).observe(now - self.start)
            else:
                if self._itl is None:
                    self._itl = self.m.itl.labels(self.model_name)
                self._itl.observe(now - self.last)
            self.last = now
        if msg.finish_reason:
            name = self.model_name
            self.m.e2e.labels(name).observe(now - self.start)
            self.m.prompt_tokens.labels(name).inc(msg.prompt_tokens)
            self.m.generation_tokens.labels(name).inc(msg.completion_tokens)
            self.m.request_prompt_tokens.labels(name).observe(msg.prompt_tokens)
            self.m.request_generation_tokens.labels(name).observe(msg.completion_tokens)
            self.m.success.labels(name, msg.finish_reason).inc()
