"""The service's Prometheus metrics, in a registry of its own (two apps in one process do not collide), and
the ASGI middleware that counts and times the plan requests."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastddrive.decode.result import DecodeResult

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
NFE_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024)
TOKENS_PER_FORWARD_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32)


class ServiceMetrics:
    """Plan requests by status and their latency, the queue depth, per decoder the forwards an answer took and
    the tokens each forward gave, and the model processes started again after theirs died."""

    def __init__(self, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "fastddrive_plan_requests", "Plan requests answered, by HTTP status.", ["status"], registry=self.registry
        )
        self.latency = Histogram(
            "fastddrive_plan_latency_seconds",
            "Wall time of a plan request in the service, queue included.",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.queue = Gauge("fastddrive_queue_depth", "Plan requests waiting for the model.", registry=self.registry)
        self.queue.set_function(queue_depth)
        self.model_restarts = Counter(
            "fastddrive_model_restarts",
            "Model processes started again after theirs ended (--model-process).",
            registry=self.registry,
        )
        self.nfe = Histogram(
            "fastddrive_nfe",
            "Model forward calls per answer (prefill included), by decoder.",
            ["decoder"],
            buckets=NFE_BUCKETS,
            registry=self.registry,
        )
        self.tokens_per_forward = Histogram(
            "fastddrive_tokens_per_forward",
            "Answer tokens per model forward, by decoder.",
            ["decoder"],
            buckets=TOKENS_PER_FORWARD_BUCKETS,
            registry=self.registry,
        )

    def request(self, status: int, seconds: float) -> None:
        self.requests.labels(status=str(status)).inc()
        self.latency.observe(seconds)

    def answer(self, result: DecodeResult) -> None:
        self.nfe.labels(decoder=result.decoder).observe(result.nfe)
        self.tokens_per_forward.labels(decoder=result.decoder).observe(result.tokens_per_nfe)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class PlanTiming:
    """Counts every /v1/plan* answer by status with its latency, and adds `app;dur=<ms>` (the time the service
    held the request) to its Server-Timing header. Plain ASGI: a BaseHTTPMiddleware costs about a millisecond."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/plan"):
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        started = False

        async def timed(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started, seconds = True, time.perf_counter() - began
                self.metrics.request(message["status"], seconds)
                timing = (b"server-timing", f"app;dur={1000 * seconds:.3f}".encode())
                message = {**message, "headers": [*message.get("headers", []), timing]}
            await send(message)

        try:
            await self.app(scope, receive, timed)
        except Exception:
            if not started:  # answered 500 by the server's outermost error handler
                self.metrics.request(500, time.perf_counter() - began)
            raise
