"""Load test: the service's throughput and latency at several numbers of concurrent clients, beside
`planner.plan` called directly on the same scenes, and the service's own overhead per request.

The service runs in a process of its own (`fastddrive serve`, as deployed); the clients are asyncio httpx
connections on loopback, each sending its next request when its last is answered. Overhead is read per
request from the server's `Server-Timing` header (queue, plan, and app: the time the service held the
request): the service's own is app minus queueing minus planning (JSON, validation, image decoding, the
hand-over to the model worker and back); the one a client sees is its latency minus queueing minus planning
(its HTTP stack and the loopback besides).

The clients' first requests go out together, and each of them also waits while the event loop reads the
ones that came before it: queueing for the event loop, which grows with the number of clients. Their median
is reported apart (`burst_overhead_ms`); the overheads per request are the medians of the requests sent
after them, one at a time as answers come back.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import httpx
import numpy as np

from fastddrive.core.sample import DrivingSample, encode_png
from fastddrive.planner import Planner

# Each client holds a connection (a file descriptor of both processes, 1024 by default) and a place in the
# server's queue; past a few hundred a loopback load test measures the client's own event loop.
MAX_CLIENTS = 256


class LoadTestError(ValueError):
    """Client counts that are not integers in [1, MAX_CLIENTS], or no more requests than clients."""


def client_counts(text: str, requests: int) -> list[int]:
    """'1,4,16' -> [1, 4, 16], each below `requests` (the overhead is read on the requests sent after the
    clients' first ones)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or max(counts) > MAX_CLIENTS:
        raise LoadTestError(f"clients must be comma-separated integers in [1, {MAX_CLIENTS}], got {text!r}")
    _check_enough(requests, max(counts))
    return counts


def _check_enough(requests: int, clients: int) -> None:
    if requests <= clients:
        raise LoadTestError(
            f"{requests} requests at {clients} clients: give more requests than clients, so that some are"
            " sent after the clients' first ones"
        )


@dataclass
class LoadRow:
    """One decoder at one concurrency, through the service or direct; latencies in ms, throughput per s."""

    target: str  # "service" or "direct"
    decoder: str
    clients: int
    requests: int
    answered: int
    refused: int  # 503
    failed: int  # any other status (504 past the server's timeout)
    throughput: float
    p50_ms: float
    p99_ms: float
    overhead_ms: float | None = None  # the service's own, median per request after the start
    client_overhead_ms: float | None = None  # as a client sees it, median per request after the start
    burst_overhead_ms: float | None = None  # the service's own, median of the first `clients` requests

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def request_body(scene: DrivingSample, decoder: str) -> dict[str, object]:
    """The POST /v1/plan body of a scene."""
    image = base64.b64encode(encode_png(scene.image)).decode()
    return {"images": [image], "history": scene.history.tolist(), "command": scene.command, "decoder": decoder}


def _timing(header: str) -> dict[str, float]:
    """'queue;dur=0.2, plan;dur=270.1, app;dur=273.0' -> {'queue': 0.2, 'plan': 270.1, 'app': 273.0}."""
    parts = (item.strip().split(";dur=") for item in header.split(",") if ";dur=" in item)
    return {name: float(value) for name, value in parts}


async def _drive(url: str, bodies: Sequence[dict], clients: int) -> tuple[list[tuple[int, int, float, dict]], float]:
    """Send every body with `clients` concurrent connections: ([(index of the body, status, latency ms,
    Server-Timing)], seconds)."""
    todo = iter(enumerate(bodies))
    done: list[tuple[int, int, float, dict]] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def one_client() -> None:
            for index, body in todo:  # a shared iterator: each body is sent once
                began = time.perf_counter()
                reply = await client.post("/v1/plan", json=body)
                latency = 1000 * (time.perf_counter() - began)
                done.append((index, reply.status_code, latency, _timing(reply.headers.get("server-timing", ""))))

        began = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
    return done, time.perf_counter() - began


def load_test(url: str, scenes: Sequence[DrivingSample], decoder: str, clients: int, requests: int) -> LoadRow:
    """`requests` plans of the scenes (cycled) through the service at `clients` concurrent clients; more
    requests than clients, so that some are sent after the clients' first ones."""
    _check_enough(requests, clients)
    bodies = [request_body(scenes[k % len(scenes)], decoder) for k in range(requests)]
    done, seconds = asyncio.run(_drive(url, bodies, clients))
    answered = [(index, latency, timing) for index, status, latency, timing in done if status == 200]
    latencies = [latency for _, latency, _ in answered]
    refused = sum(status == 503 for _, status, _, _ in done)
    steady = [(latency, timing) for index, latency, timing in answered if index >= clients]
    burst = [timing for index, _, timing in answered if index < clients]

    def median(values: list[float]) -> float | None:
        return float(np.median(values)) if values else None

    return LoadRow(
        target="service",
        decoder=decoder,
        clients=clients,
        requests=requests,
        answered=len(answered),
        refused=refused,
        failed=len(done) - len(answered) - refused,
        throughput=len(answered) / seconds,
        p50_ms=float(np.percentile(latencies, 50)),
        p99_ms=float(np.percentile(latencies, 99)),
        overhead_ms=median([t["app"] - t["queue"] - t["plan"] for _, t in steady]),
        client_overhead_ms=median([ms - t["queue"] - t["plan"] for ms, t in steady]),
        burst_overhead_ms=median([t["app"] - t["queue"] - t["plan"] for t in burst]),
    )


def direct(planner: Planner, scenes: Sequence[DrivingSample], decoder: str, requests: int) -> LoadRow:
    """The same plans by `planner.plan` in this process, one after another."""
    latencies = []
    for k in range(requests):
        began = time.perf_counter()
        planner.plan(scenes[k % len(scenes)], decoder)
        latencies.append(1000 * (time.perf_counter() - began))
    return LoadRow(
        target="direct",
        decoder=decoder,
        clients=1,
        requests=requests,
        answered=requests,
        refused=0,
        failed=0,
        throughput=1000 * requests / sum(latencies),
        p50_ms=float(np.percentile(latencies, 50)),
        p99_ms=float(np.percentile(latencies, 99)),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def served(*args: str, ready_s: float = 120.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """`fastddrive serve ARGS` on a free loopback port, ready: yields (its URL, the process), then stops it
    with SIGTERM."""
    port = free_port()
    command = [sys.executable, "-m", "fastddrive.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while not _ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the service did not become ready (exit status {process.poll()})")
            time.sleep(0.2)
        yield url, process
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def serve_bench(
    model: str,
    planner: Planner,
    scenes: Sequence[DrivingSample],
    decoders: Sequence[str],
    clients: Sequence[int],
    requests: int,
) -> list[LoadRow]:
    """Every decoder at every concurrency through a fresh `fastddrive serve --model MODEL`, then directly on
    `planner` (the same model loaded here) after the service has stopped, so that they never share the CPU.
    The service may queue every client and wait for all (no 503 or 504 by design of the test)."""
    rows = []
    with served("--model", model, "--max-queue", str(max(clients)), "--timeout-s", "3600") as (url, _):
        for decoder in decoders:
            load_test(url, scenes, decoder, 1, 2)  # warm-up
            rows += [load_test(url, scenes, decoder, n, requests) for n in clients]
    for decoder in decoders:
        direct(planner, scenes, decoder, 2)  # warm-up
        rows.append(direct(planner, scenes, decoder, requests))
    return rows
