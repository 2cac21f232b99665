"""The planning service through a real HTTP client against servers on 127.0.0.1: the library's answers (the
embedded model), 422s naming the field, a burst past the queue, timeouts, a killed model process, SIGTERM,
the page, metrics. Whatever depends on the model being busy uses a gated fake planner (`serve_fakes`) that
waits until the test releases it: no outcome here is decided by a clock."""

import asyncio
import base64
import io
import json
import multiprocessing
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

import fastddrive
from fastddrive.core.outputs import finite
from fastddrive.decode.registry import DecoderError
from fastddrive.planner import PlanInputs
from fastddrive.serve.app import FiniteJSONResponse, create_app
from fastddrive.serve.loadtest import LoadTestError, client_counts, free_port, load_test
from fastddrive.serve.worker import _let_the_loop_answer
from serve_fakes import (
    READY_S,
    FakePlanner,
    GatedPlanner,
    fake_ids,
    gated_load,
    gates,
    running,
    scene_body,
    serve,
    wait_until,
)

COMMANDS = ("go_straight", "go_left", "go_right")


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
def url(embedded):
    """The service over the embedded model, on the worker thread (`fastddrive serve`'s default)."""
    with running(create_app(lambda: embedded, "ss", max_queue=2, timeout_s=60)) as base:
        yield base


def test_a_model_that_fails_to_load_in_its_own_process_says_why_on_readyz():
    app = create_app(partial(fastddrive.load, "/no/such/model"), isolated=True)
    with TestClient(app) as client:  # the load fails in the model process; the service says why
        wait_until(lambda: client.get("/readyz").json()["status"] != "loading", "the failed load")
        ready = client.get("/readyz")
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
    ({"images": [_image((1, 300))]}, ["images"], "sides differ by more than 200 times"),
    ({"images": [_image((28, 28), "GIF")]}, ["images", 0], "PNG or JPEG"),
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
    ({"options": {"drafts": [1, 2]}}, ["options"], "drafts"),
    ({"options": {"drafts": [10**6] * 261}}, ["options"], "outside the model's vocabulary"),
    ({"decoder": "jacobi", "options": {"drafts": [815]}}, ["options"], "outside the model's vocabulary"),
    ({"decoder": "tts", "options": {"rollouts": 2000}}, ["options"], "rollouts"),
    ({"decoder": "pvf", "options": {"vocabulary": "/etc/passwd"}}, ["options", "vocabulary"], "names a file"),
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


def test_a_burst_larger_than_the_queue_is_answered_or_refused_never_mixed_up(embedded, tagged):
    # The model (embedded, on the worker thread) waits at a gate: one request on it, then of a burst of seven
    # two wait in the queue and five are refused, whatever the machine's speed; each answer is its own plan.
    started, release = threading.Event(), threading.Event()
    with running(create_app(lambda: GatedPlanner(started, release, embedded), max_queue=2)) as base:
        first, burst = tagged[0], tagged[1:8]
        with ThreadPoolExecutor(len(burst) + 1) as pool:
            on_model = pool.submit(_post, base, first[1])
            assert started.wait(READY_S)
            pending = [pool.submit(_post, base, body) for _, body in burst]
            wait_until(lambda: sum(f.done() for f in pending) == 5, "five refusals")
            refused = [f.result(timeout=READY_S)[0] for f in pending if f.done()]
            assert [reply.status_code for reply in refused] == [503] * 5
            assert all(reply.headers["retry-after"] == "1" for reply in refused)
            metrics = httpx.get(base + "/metrics").text
            assert "fastddrive_queue_depth 2.0" in metrics
            assert 'fastddrive_plan_requests_total{status="503"} 5.0' in metrics
            release.set()
            answered = [(first[0], on_model.result(timeout=READY_S))] + [
                (inputs, f.result(timeout=READY_S))
                for (inputs, _), f in zip(burst, pending, strict=True)
                if f.result(timeout=READY_S)[0].status_code != 503
            ]
    assert len(answered) == 3
    for inputs, (reply, _) in answered:
        assert reply.status_code == 200
        assert reply.json()["token_ids"] == embedded.plan(inputs, "ss").token_ids  # its own scene's plan


def test_a_request_past_its_timeout_is_a_504_and_frees_its_slot():
    # The model is held at a gate for the whole test: every request times out, whatever the machine's speed.
    started, release = threading.Event(), threading.Event()
    app = create_app(lambda: GatedPlanner(started, release), "ss", max_queue=1, timeout_s=0.2)
    try:
        with running(app) as base, ThreadPoolExecutor(1) as pool:
            on_model = pool.submit(_post, base, scene_body(1))
            assert started.wait(READY_S)
            waiting, _ = _post(base, scene_body(2))  # the queue's one slot, until its time is up
            assert waiting.status_code == 504, waiting.text
            # The model is still on the first request, but the waiting one's slot is free again: 504, not 503.
            again, _ = _post(base, scene_body(3))
            assert again.status_code == 504, again.text
            assert on_model.result(timeout=READY_S)[0].status_code == 504
            assert "fastddrive_queue_depth 0.0" in httpx.get(base + "/metrics").text
            release.set()
    finally:
        release.set()


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


def test_health_readiness_metrics_and_docs():
    with running(create_app(FakePlanner, "ss")) as url:
        assert httpx.get(url + "/healthz").json() == {"status": "ok"}
        assert httpx.get(url + "/readyz").json()["status"] == "ready"
        for decoder in ("ss", "ar"):
            assert httpx.post(url + "/v1/plan", json=scene_body(1) | {"decoder": decoder}).status_code == 200
        metrics = httpx.get(url + "/metrics").text
        for name in (
            "fastddrive_plan_requests_total",
            "fastddrive_plan_latency_seconds_bucket",
            "fastddrive_queue_depth",
            "fastddrive_model_restarts_total 0.0",
        ):
            assert name in metrics
        assert 'fastddrive_nfe_count{decoder="ss"}' in metrics
        assert 'fastddrive_tokens_per_forward_sum{decoder="ar"}' in metrics
        assert "/v1/plan" in httpx.get(url + "/openapi.json").json()["paths"]
        docs = httpx.get(url + "/docs")
        assert docs.status_code == 200 and "cdn" not in docs.text  # offline: the page's scripts are served here
        assert httpx.get(url + "/docs-assets/swagger-ui-bundle.js").status_code == 200


def _server_process(started, release, isolated=False, timeout_s=600.0, grace_s=600.0):
    """`app.run` over a gated fake planner in a process of its own, ready: (its URL, the process)."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=serve, args=(port, started, release, isolated, timeout_s, grace_s))
    process.start()
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert process.is_alive(), f"the server ended (exit status {process.exitcode})"
        try:
            return httpx.get(base + "/readyz").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, "the server start")
    return base, process


def _refuses_connections(base):
    """Whether the server's listening socket is closed. While it closes, a connection may still be taken and then
    dropped unanswered (RemoteProtocolError, a read error): that is "not yet", not a failure."""
    try:
        httpx.get(base + "/healthz", timeout=5)
    except httpx.ConnectError:
        return True
    except httpx.TransportError:
        return False
    return False


def test_sigterm_during_a_burst_finishes_in_flight_refuses_new_and_exits_0(tmp_path):
    started, release = gates(tmp_path, "started", "release")
    base, process = _server_process(started, release)
    try:
        with ThreadPoolExecutor(4) as pool:
            replies = [pool.submit(_post, base, scene_body(k)) for k in range(4)]
            assert started.wait(READY_S)
            wait_until(lambda: "fastddrive_queue_depth 3.0" in httpx.get(base + "/metrics").text, "all queued")
            os.kill(process.pid, signal.SIGTERM)
            wait_until(lambda: _refuses_connections(base), "the listening socket's close")
            with pytest.raises(httpx.ConnectError):
                httpx.post(base + "/v1/plan", json=scene_body(9), timeout=5)
            release.set()  # the four in flight are answered, each with its own scene's answer
            for k, future in enumerate(replies):
                reply, _ = future.result(timeout=READY_S)
                assert reply.status_code == 200 and reply.json()["token_ids"] == fake_ids(k)
        process.join(READY_S)
        assert process.exitcode == 0
    finally:
        release.set()
        if process.is_alive():
            process.kill()


def test_sigterm_stops_within_the_grace_period_when_the_model_is_on_an_abandoned_request(tmp_path):
    # The model never comes back from its request (the gate stays shut), whose client has had its 504: the
    # server must still exit after SIGTERM, abandoning it; without the bound on the worker it never would.
    # (A model process is killed instead: the end of the next test.)
    started, release = gates(tmp_path, "started", "release")
    base, process = _server_process(started, release, timeout_s=0.2, grace_s=1.0)
    try:
        reply, _ = _post(base, scene_body(1))
        assert reply.status_code == 504 and started.is_set()
        os.kill(process.pid, signal.SIGTERM)
        process.join(READY_S)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()


def test_the_model_process_answers_over_its_pipe_and_when_killed_is_seen_and_restarted(tmp_path):
    # As the OOM killer would: SIGKILL to the model process, once while it plans, once while it is idle. Its
    # restart is held in its loading (the `loadable` gate), so that the time it is down is the test's.
    started, release, loadable = gates(tmp_path, "started", "release", "loadable")
    loadable.set()
    app = create_app(partial(gated_load, started, release, loadable), max_queue=4, timeout_s=600, isolated=True)

    def restarts(base):
        found = re.search(r"fastddrive_model_restarts_total ([\d.]+)", httpx.get(base + "/metrics").text)
        return float(found[1])

    with running(app) as base, ThreadPoolExecutor(2) as pool:
        planner = app.state.worker.planner  # idle: the test may use its pipe
        assert planner.pid != os.getpid() and planner.facts == FakePlanner.facts
        release.set()
        with pytest.raises(DecoderError, match="unknown decoder 'beam'"):  # the library's error, typed, via the pipe
            planner.timed_plan(PlanInputs(images=[], history=np.zeros((7, 6)), command="go_straight"), "beam")
        release.clear()
        started.clear()

        on_model = pool.submit(_post, base, scene_body(1))
        assert started.wait(READY_S)
        queued = pool.submit(_post, base, scene_body(2))
        wait_until(lambda: "fastddrive_queue_depth 1.0" in httpx.get(base + "/metrics").text, "the second queued")
        loadable.clear()
        killed = app.state.worker.planner.pid
        os.kill(killed, signal.SIGKILL)
        for future in (on_model, queued):  # the request on the model and the one queued behind it
            reply, _ = future.result(timeout=READY_S)
            assert reply.status_code == 503 and "killed by SIGKILL" in reply.json()["detail"], reply.text
        ready = httpx.get(base + "/readyz")
        assert ready.status_code == 503 and "restarting" in ready.json()["status"]
        refused, _ = _post(base, scene_body(3))
        assert refused.status_code == 503 and "not ready" in refused.json()["detail"]
        release.set()
        loadable.set()
        wait_until(lambda: httpx.get(base + "/readyz").status_code == 200, "the restart")
        assert restarts(base) == 1.0 and app.state.worker.planner.pid != killed
        reply, _ = _post(base, scene_body(4))
        assert reply.status_code == 200 and reply.json()["token_ids"] == fake_ids(4)

        loadable.clear()  # now while idle: seen without a request
        os.kill(app.state.worker.planner.pid, signal.SIGKILL)
        wait_until(lambda: httpx.get(base + "/readyz").status_code == 503, "the death seen")
        loadable.set()
        wait_until(lambda: httpx.get(base + "/readyz").status_code == 200, "the second restart")
        assert restarts(base) == 2.0
        reply, _ = _post(base, scene_body(5))
        assert reply.status_code == 200 and reply.json()["token_ids"] == fake_ids(5)

        release.clear()  # the server stops while the model process is on a request: it is killed, not awaited
        started.clear()
        on_model = pool.submit(_post, base, scene_body(6))
        assert started.wait(READY_S)
        busy = app.state.worker.planner.pid
        app.state.worker.close()  # as the server's shutdown does, after its grace period
        assert not app.state.worker.running
        with pytest.raises(ProcessLookupError):
            os.kill(busy, 0)
        assert (
            on_model.result(timeout=READY_S)[0].status_code == 503 and restarts(base) == 2.0
        )  # stopped, not restarted


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
    for clients, requests, message in (
        ("1,4,16", 16, "more requests than clients"),
        ("1,x", 9, "integers in"),
        ("1,100000", 100001, r"integers in \[1, 256\]"),
    ):
        with pytest.raises(LoadTestError, match=message):
            client_counts(clients, requests)
