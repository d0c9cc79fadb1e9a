"""`GET /metrics` of `xds-mpi serve`: Prometheus text through `prometheus_client`.

vLLM's names where vLLM has the metric (a dashboard made for vLLM reads these as they are), the
emulator's own under `xds:`. Latencies measured on the HTTP side (wall clock, what a client sees)
and on the dies' 910C virtual clock (projected) are kept apart.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a millisecond up to a minute, as vLLM's latency buckets.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0)
LATENCY_BUCKETS += (2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# The projected 910C times are far shorter: from 10 microseconds.
PROJECTED_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025)
PROJECTED_BUCKETS += (0.05, 0.1, 0.25, 0.5, 1.0)


class ServeMetrics:
    """Every metric of one endpoint, in its own registry. Labels: model_name (vLLM's), die (a
    die's rank) on the per-die ones, and te (a served cluster's TE: `add_te_series`)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.running = Gauge(
            "vllm:num_requests_running", "Requests on a die", labels, registry=r
        ).labels(model)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests queued in the TE-shell", labels, registry=r
        ).labels(model)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV cache reserved over every DP group's capacity (1 = full)",
            labels,
            registry=r,
        ).labels(model)
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token (wall)", LATENCY_BUCKETS
        )
        self.itl = self._histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens (wall)", LATENCY_BUCKETS
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token (wall)", LATENCY_BUCKETS
        )
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens")
        self.success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.draft_tokens = self._counter(
            "vllm:spec_decode_num_draft_tokens", "MTP draft tokens verified"
        )
        self.accepted_tokens = self._counter(
            "vllm:spec_decode_num_accepted_tokens", "MTP draft tokens accepted"
        )
        self.projected_ttft = self._histogram(
            "xds:projected_time_to_first_token_seconds",
            "Dispatch to first token on the dies' 910C virtual clock",
            PROJECTED_BUCKETS,
        )
        self.projected_tpot = self._histogram(
            "xds:projected_time_per_output_token_seconds",
            "Time per output token on the dies' 910C virtual clock",
            PROJECTED_BUCKETS,
        )
        self.iteration = Histogram(
            "xds:die_iteration_seconds",
            "Wall time of a die's iterations that produced tokens",
            ["die"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.xccl = Histogram(
            "xds:die_dispatch_combine_seconds",
            "Wall time a die spent in dispatch and combine (waiting for peers included), "
            "per iteration that produced tokens",
            ["die"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cancelled = Counter(
            "xds:requests_cancelled",
            "Requests ended early, by reason (client disconnected, stop string, shutdown)",
            ["reason"],
            registry=r,
        )
        self.http_errors = Counter(
            "xds:http_errors", "Requests refused, by HTTP status", ["status"], registry=r
        )
        self.failures = Counter(
            "xds:failures_detected", "Dies found stuck or dead (heartbeats)", registry=r
        )

    def add_te_series(self) -> None:
        """A served cluster (ranks/cluster/served_je.py): the same loads per TE, label `te`."""
        r = self.registry
        self.te_running = Gauge(
            "xds:te_requests_running", "Requests on a die of the TE", ["te"], registry=r
        )
        self.te_waiting = Gauge(
            "xds:te_requests_waiting", "Requests queued in the TE's TE-shell", ["te"], registry=r
        )
        self.te_kv_usage = Gauge(
            "xds:te_kv_cache_usage_perc",
            "KV cache reserved over the TE's DP groups' capacity (1 = full)",
            ["te"],
            registry=r,
        )
        self.te_finished = Counter(
            "xds:te_requests_finished",
            "Requests the TE served to their end (max_tokens or EOS)",
            ["te"],
            registry=r,
        )
        self.te_failing_over = Gauge(
            "xds:te_failing_over", "1 while a die of the TE fails over", ["te"], registry=r
        )
        self.te_lost = Gauge(
            "xds:te_lost", "1 once the JE found the TE lost (cluster.te_losses)", ["te"], registry=r
        )

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(
            self.model
        )

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model)

    def text(self) -> bytes:
        return generate_latest(self.registry)
