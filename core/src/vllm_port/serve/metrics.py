"""The server's Prometheus metrics, named ``vllm_port:...`` as vLLM names its own ``vllm:...``.

One :class:`ServerMetrics` per server, in a registry of its own (two servers in one process do not
clash); ``GET /metrics`` answers :meth:`ServerMetrics.exposition`. Latencies are measured where the
client sees them: from a request's arrival at the front end to each delta's delivery to its stream.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

#: The content type of the Prometheus text format ``/metrics`` answers in.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Histogram buckets in seconds: a 4M-parameter model on a CPU answers in milliseconds, a large one in seconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Every metric a server exports; the engine thread sets the gauges, the front end the rest."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "vllm_port:time_to_first_token_seconds",
            "From arrival to the first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "vllm_port:inter_token_latency_seconds",
            "Between a request's successive tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "vllm_port:e2e_request_latency_seconds",
            "From arrival to the last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.num_requests_running = Gauge(
            "vllm_port:num_requests_running", "Requests in the running batch.", registry=r
        )
        self.num_requests_waiting = Gauge(
            "vllm_port:num_requests_waiting", "Requests waiting for the batch (preempted ones included).", registry=r
        )
        self.kv_cache_usage = Gauge(
            "vllm_port:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0 to 1).", registry=r
        )
        self.kv_cache_free_blocks = Gauge(
            "vllm_port:kv_cache_free_blocks", "KV-cache blocks free to allocate (cached-free included).", registry=r
        )
        self.kv_cache_total_blocks = Gauge("vllm_port:kv_cache_total_blocks", "KV-cache blocks in all.", registry=r)
        self.num_preemptions = Counter("vllm_port:num_preemptions", "Requests preempted so far.", registry=r)
        self.prompt_tokens = Counter("vllm_port:prompt_tokens", "Prompt tokens of requests admitted.", registry=r)
        self.generation_tokens = Counter("vllm_port:generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(
            "vllm_port:request_success",
            "Requests finished, by finish reason (abort: the client left).",
            ["finished_reason"],
            registry=r,
        )
        self.requests_rejected = Counter(
            "vllm_port:requests_rejected", "Requests answered 503 because the waiting queue was full.", registry=r
        )
        self._preemptions_seen = 0

    def set_engine_state(
        self, running: int, waiting: int, free_blocks: int, total_blocks: int, preemptions: int
    ) -> None:
        """The engine's state after a step (called by the engine thread)."""
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_free_blocks.set(free_blocks)
        self.kv_cache_total_blocks.set(total_blocks)
        self.kv_cache_usage.set(1.0 - free_blocks / total_blocks if total_blocks else 0.0)
        if preemptions > self._preemptions_seen:
            self.num_preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions

    def exposition(self) -> bytes:
        """Every metric in the Prometheus text format."""
        return generate_latest(self.registry)
