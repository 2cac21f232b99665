"""The planning service through a real HTTP client against servers on 127.0.0.1 (the embedded model): the
library's answers, 422s naming the field, a burst past the queue, timeouts, SIGTERM, the page, metrics."""

import asyncio
import base64
import io
import json
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi.testclient import TestClient
from PIL import Image

import fastddrive
from fastddrive.outputs import finite
from fastddrive.planner import PlanInputs
from fastddrive.serve.app import FiniteJSONResponse, create_app
from fastddrive.serve.loadtest import LoadTestError, client_counts, load_test, served
from fastddrive.serve.worker import _let_the_loop_answer

COMMANDS = ("go_straight", "go_left", "go_right")


@contextmanager
def running(app):
    """Serve `app` on a free loopback port in a thread; yields the URL once the model is ready."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 60
        while not (server.started and httpx.get(url + "/readyz").status_code == 200):
            assert time.monotonic() < deadline, "the service did not become ready"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.fixture(scope="module")
def tagged(scenes):
    """Distinct scenes: each scene with each command (their answers differ), as (PlanInputs, request body)."""
    out = []
    for scene in scenes:
        png = io.BytesIO()
        Image.fromarray(scene.image).save(png, "PNG")
        image = base64.b64encode(png.getvalue()).decode()
        for command in COMMANDS:
            inputs = PlanInputs(images=[scene.image], history=scene.history, command=command)
            out.append((inputs, {"images": [image], "history": scene.history.tolist(), "command": command}))
    return out


@pytest.fixture(scope="module")
def url():
    """The service with the model loaded in a process of its own (`fastddrive serve --model-process`)."""
    app = create_app(partial(fastddrive.load, "default"), "ss", max_queue=2, timeout_s=60, isolated=True)
    with running(app) as base:
        yield base


def test_the_model_runs_in_its_own_process_and_a_failed_load_says_why(url):
    from fastddrive.decode.registry import DecoderError
    from fastddrive.serve.model_process import ModelProcessDied, PlannerProcess

    planner = PlannerProcess(partial(fastddrive.load, "default-ar"))
    try:
        assert planner._process.pid != os.getpid() and planner.facts.kind == "autoregressive"
        with pytest.raises(DecoderError, match="needs a block-diffusion checkpoint"):
            planner.timed_plan(PlanInputs(images=[], history=np.zeros((7, 6)), command="go_straight"), "ss")
    finally:
        planner.close()
    with pytest.raises(ModelProcessDied):
        planner.timed_plan(PlanInputs(images=[], history=np.zeros((7, 6)), command="go_straight"), "ar")
    app = create_app(partial(fastddrive.load, "/no/such/model"), isolated=True)
    with TestClient(app) as client:  # the load fails in the model process; the service says why
        deadline = time.monotonic() + 60
        while (ready := client.get("/readyz")).json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ready.status_code == 503 and "/no/such/model" in ready.json()["status"]


def test_a_valid_request_answers_what_the_planner_answers(url, embedded, tagged):
    inputs, body = tagged[0]
    reply = httpx.post(url + "/v1/plan", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    expected = finite(embedded.plan(inputs, "ss").to_json())
    answer = reply.json()
    for key in ("decoder", "response", "text", "token_ids", "nfe", "tokens", "fed_tokens", "accepted_per_step"):
        assert answer[key] == expected[key], key
    assert answer["prefill_ms"] > 0 and answer["decode_ms"] > 0
    assert re.fullmatch(r"queue;dur=[\d.]+, plan;dur=[\d.]+, app;dur=[\d.]+", reply.headers["server-timing"])
    ar = httpx.post(url + "/v1/plan", json=body | {"decoder": "ar"}, timeout=60).json()
    assert ar["token_ids"] == answer["token_ids"] and ar["nfe"] > answer["nfe"]  # ss is lossless


def _image(size, fmt="PNG"):
    data = io.BytesIO()
    Image.fromarray(np.zeros((*size, 3), dtype=np.uint8)).save(data, fmt)
    return base64.b64encode(data.getvalue()).decode()


BAD = [
    ({"images": [_image((30, 30))]}, ["images"], "multiple of 28"),
    ({"images": [_image((28, 28), "GIF")]}, ["images", 0], "give PNG or JPEG"),
    ({"images": ["not base64!"]}, ["images", 0], "not valid base64"),
    ({"images": [base64.b64encode(base64.b64decode(_image((28, 28)))[:50]).decode()]}, ["images", 0], "readable PNG"),
    ({"images": []}, ["images"], "give at least one camera image"),
    ({"history": [[0.0] * 6] * 3}, ["history"], "7 rows"),
    ({"history": [["0"] * 6] * 7}, ["history", 0, 0], "valid number"),
    ({"history": [[float("nan")] * 6] * 7}, ["history"], "NaN"),
    ({"command": "fly"}, ["command"], "unknown navigation command 'fly'"),
    ({"decoder": "beam"}, ["decoder"], "unknown decoder 'beam'"),
    ({"options": {"tau": 0.5}}, ["options"], "takes no option 'tau'"),
    ({"decoder": "sd", "options": {"tau": 2}}, ["options"], "tau"),
    ({"options": {"drafts": [1, 2]}}, ["options"], "drafts"),  # checked by the decoder, on the worker
]


def test_each_bad_input_is_a_422_naming_the_field_and_the_server_keeps_serving(url, tagged):
    inputs, body = tagged[1]
    for change, loc, message in BAD:
        text = json.dumps(body | change)  # NaN as Python's json writes it (and a lenient client may send)
        reply = httpx.post(url + "/v1/plan", content=text, headers={"content-type": "application/json"}, timeout=60)
        assert reply.status_code == 422, (change, reply.text)
        detail = reply.json()["detail"]
        assert any(d["loc"][1 : 1 + len(loc)] == loc and message in d["msg"] for d in detail), (change, detail)
    missing = httpx.post(url + "/v1/plan", json={k: v for k, v in body.items() if k != "history"})
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "history"]
    assert httpx.post(url + "/v1/plan", json=body, timeout=60).status_code == 200


def _post(url, body):
    began = time.perf_counter()
    reply = httpx.post(url + "/v1/plan", json=body, timeout=120)
    return reply, 1000 * (time.perf_counter() - began)


def test_a_burst_larger_than_the_queue_is_answered_or_refused_never_mixed_up(url, embedded, tagged):
    burst = tagged[:8]  # 8 concurrent requests, distinct scenes; the model takes one, the queue 2
    with ThreadPoolExecutor(len(burst)) as pool:
        replies = list(pool.map(lambda item: _post(url, item[1]), burst))
    statuses = [reply.status_code for reply, _ in replies]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
    latencies = []
    for (inputs, _), (reply, ms) in zip(burst, replies, strict=True):
        if reply.status_code == 503:
            assert reply.headers["retry-after"] == "1"
            continue
        assert reply.json()["token_ids"] == embedded.plan(inputs, "ss").token_ids  # its own scene's plan
        latencies.append(ms)
    print(
        f"burst of {len(burst)}: {len(latencies)} answered, p50 {np.percentile(latencies, 50):.0f} ms, "
        f"p99 {np.percentile(latencies, 99):.0f} ms, {statuses.count(503)} refused with 503"
    )
    metrics = httpx.get(url + "/metrics").text
    assert f'fastddrive_plan_requests_total{{status="503"}} {float(statuses.count(503))}' in metrics
    assert "fastddrive_queue_depth 0.0" in metrics


def test_a_request_past_its_timeout_is_a_504_and_frees_its_slot(embedded, tagged):
    # The model on the worker thread (the default of `fastddrive serve`).
    with running(create_app(lambda: embedded, "ar", max_queue=1, timeout_s=0.05, isolated=False)) as base:
        with ThreadPoolExecutor(2) as pool:  # one on the model, one waiting: both past 50 ms
            first = [reply.status_code for reply, _ in pool.map(lambda item: _post(base, item[1]), tagged[:2])]
        assert first == [504, 504]
        # The model is still on the first request, but the waiting one's slot is free again: 504, not 503.
        again, _ = _post(base, tagged[2][1])
        assert again.status_code == 504, again.text
        assert "fastddrive_queue_depth 0.0" in httpx.get(base + "/metrics").text


def test_the_page_loads_and_its_form_round_trips_one_plan(url, embedded, tagged):
    page = httpx.get(url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'action="/v1/plan/form"' in page.text and 'enctype="multipart/form-data"' in page.text
    for field in ("frame", "scene", "history", "command", "decoder", "options"):
        assert f'name="{field}"' in page.text
    inputs, body = tagged[2]
    frame = base64.b64decode(body["images"][0])
    fields = {"history": json.dumps(body["history"]), "command": body["command"], "decoder": "ss", "options": "{}"}
    reply = httpx.post(url + "/v1/plan/form", data=fields, files={"frame": ("frame.png", frame)}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["token_ids"] == embedded.plan(inputs, "ss").token_ids
    bad = httpx.post(url + "/v1/plan/form", data=fields | {"scene": "test/0"}, files={"frame": ("x.png", b"x")})
    assert bad.status_code == 422 and {d["loc"][1] for d in bad.json()["detail"]} == {"scene", "frame"}


def test_health_readiness_metrics_and_docs(url, tagged):
    assert httpx.get(url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(url + "/readyz").json()["status"] == "ready"
    for decoder in ("ss", "ar"):  # so that both decoders' series exist, whatever ran before
        assert httpx.post(url + "/v1/plan", json=tagged[1][1] | {"decoder": decoder}, timeout=60).status_code == 200
    metrics = httpx.get(url + "/metrics").text
    for name in ("fastddrive_plan_requests_total", "fastddrive_plan_latency_seconds_bucket", "fastddrive_queue_depth"):
        assert name in metrics
    assert (
        'fastddrive_nfe_count{decoder="ss"}' in metrics and 'fastddrive_tokens_per_forward_sum{decoder="ar"}' in metrics
    )
    assert "/v1/plan" in httpx.get(url + "/openapi.json").json()["paths"]
    docs = httpx.get(url + "/docs")
    assert docs.status_code == 200 and "cdn" not in docs.text  # offline: the page's scripts are served here
    assert httpx.get(url + "/docs-assets/swagger-ui-bundle.js").status_code == 200


def test_sigterm_during_a_burst_finishes_in_flight_refuses_new_and_exits_0(embedded, tagged):
    burst = tagged[3:7]
    with served("--max-queue", "8") as (base, process), ThreadPoolExecutor(len(burst)) as pool:
        replies = [pool.submit(_post, base, body) for _, body in burst]
        deadline = time.monotonic() + 30
        while "fastddrive_queue_depth 3.0" not in httpx.get(base + "/metrics").text:  # all in: 1 running, 3 wait
            assert time.monotonic() < deadline
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.ConnectError):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the listening socket closes within a tick of uvicorn's loop
                httpx.get(base + "/healthz", timeout=5)
                time.sleep(0.02)
        with pytest.raises(httpx.ConnectError):
            httpx.post(base + "/v1/plan", json=burst[0][1], timeout=5)
        for (inputs, _), future in zip(burst, replies, strict=True):
            reply, _ = future.result()
            assert reply.status_code == 200
            assert reply.json()["token_ids"] == embedded.plan(inputs, "ss").token_ids
        assert process.wait(60) == 0


def test_the_worker_lets_the_event_loop_answer_before_it_plans_again():
    """The answer's callbacks run on the event loop, and what they queue after them (the request's coroutine
    going on to its response), before the worker thread goes on; otherwise the next plan holds the GIL."""
    loop = asyncio.new_event_loop()
    ran = []
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:

        def settle():  # as _settle: resolving the future queues the waiting request's next step
            ran.append("settled")
            loop.call_soon(lambda: ran.append("responded"))

        loop.call_soon_threadsafe(settle)
        _let_the_loop_answer(loop)
        ran.append("worker goes on")
        assert ran == ["settled", "responded", "worker goes on"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_an_answer_with_nan_or_infinity_is_written_with_null():
    assert FiniteJSONResponse({"ade": float("nan"), "path": [1.5, float("inf")], "ids": [3]}).body == (
        b'{"ade":null,"path":[1.5,null],"ids":[3]}'
    )


def test_the_load_test_reads_the_overhead_after_the_first_burst_and_loses_no_request(embedded, scenes):
    with running(create_app(lambda: embedded, "ss", max_queue=8, timeout_s=60)) as base:
        row = load_test(base, scenes, "ss", clients=3, requests=7)
    assert (row.answered, row.refused, row.failed) == (7, 0, 0)
    # Per request the client's latency holds the service's time, so its median overhead cannot be smaller.
    assert 0 < row.overhead_ms <= row.client_overhead_ms and row.burst_overhead_ms > 0
    assert client_counts("1,4,16", 17) == [1, 4, 16]
    for clients, requests, message in (("1,4,16", 16, "more requests than clients"), ("1,x", 9, "positive")):
        with pytest.raises(LoadTestError, match=message):
            client_counts(clients, requests)
