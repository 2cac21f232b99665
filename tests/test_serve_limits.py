"""The service closed and bounded (issue 32), against a fake planner on loopback: bodies past their size or
time (413, 408), too many images or history rows, a decompression bomb refused from its header, option caps,
no path taken from a request (and no file touched), draft ids outside the vocabulary, the API key, scene
names that stay in the data folder, parsing off the event loop, and a planner fault that leaves the service
up. Each abuse is answered with its status and one line naming the limit."""

import asyncio
import base64
import builtins
import dataclasses
import io
import os
import socket
import struct
import threading
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from fastddrive.cli import app as cli
from fastddrive.decode.planning_vocabulary import vocabulary_path
from fastddrive.decode.registry import DecoderError
from fastddrive.engine.model_files import model_path
from fastddrive.serve import schemas
from fastddrive.serve.app import create_app
from fastddrive.serve.guards import exposure_warning
from fastddrive.serve.limits import ServiceLimits, parse_caps
from serve_fakes import READY_S, FakePlanner, fake_ids, running, scene_body

KIB = 1024
LIMITS = ServiceLimits(
    max_body_bytes=256 * KIB, max_images=4, max_image_pixels=448 * 448, max_request_pixels=2 * 448 * 448
)
PACKAGED_VOCABULARY = vocabulary_path(model_path("default"))


@pytest.fixture(scope="module")
def planner():
    return FakePlanner()


@pytest.fixture(scope="module")
def url(planner):
    """A server with small limits over a fake planner, and the packaged planning vocabulary for `pvf`."""
    app = create_app(lambda: planner, "ss", timeout_s=600, limits=LIMITS, pvf_vocabulary=PACKAGED_VOCABULARY)
    with running(app) as base:
        yield base


def plan(url, body, **kwargs):
    return httpx.post(url + "/v1/plan", json=body, timeout=60, **kwargs)


def refused(reply, status, *words):
    """The reply's one-line message, once checked to be `status` naming each of `words`."""
    assert reply.status_code == status, reply.text
    detail = reply.json()["detail"]
    message = detail if isinstance(detail, str) else " | ".join(d["msg"] for d in detail)
    assert "\n" not in message and all(w in message for w in words), message
    return message


def png(width, height):
    data = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8)).save(data, "PNG")
    return base64.b64encode(data.getvalue()).decode()


def bomb_png(width, height):
    """A PNG header claiming width x height px, with a few bytes of pixels: decoded it would take w*h*3 bytes."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )
    return base64.b64encode(data).decode()


def bomb_jpeg(width, height):
    """A JPEG header (SOI, a baseline frame header, a scan header) claiming width x height px."""
    frame = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    scan = b"\xff\xda" + struct.pack(">H", 12) + b"\x03\x01\x00\x02\x11\x03\x11\x00\x3f\x00"
    return base64.b64encode(b"\xff\xd8" + frame + scan + b"\0" * 16 + b"\xff\xd9").decode()


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails a test whose request reaches an image decoder."""
    decoded = []
    monkeypatch.setattr(schemas, "image_from_bytes", lambda data: decoded.append(len(data)))
    yield
    assert decoded == [], "an image was decoded"


def test_a_body_past_the_limit_is_a_413_declared_or_counted_and_never_parsed(url, monkeypatch):
    parsed = []
    monkeypatch.setattr(schemas, "plan_from_json", lambda *args: parsed.append(args))
    big = b'{"history": "' + b"x" * (300 * KIB) + b'"}'
    declared = httpx.post(url + "/v1/plan", content=big, headers={"content-type": "application/json"})
    refused(declared, 413, "larger than the 262144 bytes")
    chunked = httpx.post(url + "/v1/plan", content=iter([big[:100_000], big[100_000:]]))  # no Content-Length
    refused(chunked, 413, "larger than the 262144 bytes")
    form = httpx.post(url + "/v1/plan/form", data={"command": "go_straight"}, files={"frame": ("f.png", big)})
    refused(form, 413, "larger than the 262144 bytes")
    history = b'{"command": "go_straight", "history": [' + b"[0,0,0,0,0,0]," * 3_000_000 + b"[0,0,0,0,0,0]]}"
    refused(httpx.post(url + "/v1/plan", content=history, timeout=60), 413)  # 42 MB: refused before a byte is read
    assert parsed == []
    assert httpx.get(url + "/healthz").status_code == 200


def test_a_stalled_body_is_a_408_and_its_connection_is_closed(planner):
    app = create_app(lambda: planner, limits=ServiceLimits(body_timeout_s=0.5))
    with running(app) as base:
        port = int(base.rpartition(":")[2])
        with socket.create_connection(("127.0.0.1", port), timeout=READY_S) as client:
            client.sendall(b"POST /v1/plan HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")  # and no more
            answer = b""
            while chunk := client.recv(65536):  # until the server closes the connection
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in answer


def test_healthz_answers_while_a_body_arrives_and_the_body_is_parsed_off_the_event_loop(url, monkeypatch):
    threads = []
    parse = schemas.plan_from_json

    def recorded(*args):
        try:
            asyncio.get_running_loop()
            threads.append("the event loop")
        except RuntimeError:
            threads.append(threading.current_thread().name)
        return parse(*args)

    monkeypatch.setattr(schemas, "plan_from_json", recorded)
    body = httpx.Request("POST", url + "/v1/plan", json=scene_body(7)).read()
    port = int(url.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=READY_S) as client:
        head = f"POST /v1/plan HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        client.sendall(head + body[:10])
        assert httpx.get(url + "/healthz").status_code == 200  # while that body is still arriving
        client.sendall(body[10:])
        answer = client.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200")
    assert len(threads) == 1 and threads[0] != "the event loop"


def test_too_many_images_and_a_long_history_are_refused_before_the_work(url, no_decoding):
    refused(plan(url, scene_body(1) | {"images": ["AAAA"] * 400}), 422, "at most 4 images", "got 400")
    rows = plan(url, {"command": "go_straight", "history": [[0.0] * 6] * 20})
    refused(rows, 422, "history must be 7 rows", "got 20 rows")
    # Under the body limit, but more values than a plan request holds: refused from a scan of the bytes.
    many = b'{"command": "go_straight", "history": [' + b"[0,0,0,0,0,0]," * 15_000 + b"[0,0,0,0,0,0]]}"
    reply = httpx.post(url + "/v1/plan", content=many, headers={"content-type": "application/json"})
    refused(reply, 422, "commas", "7 history rows")


def test_decompression_bombs_are_refused_from_their_headers_without_decoding(url, no_decoding):
    body = scene_body(1)
    refused(plan(url, body | {"images": [bomb_png(100_000, 100_000)]}), 422, "100000x100000 px", "200704 px")
    refused(plan(url, body | {"images": [bomb_jpeg(60_000, 60_000)]}), 422, "60000x60000 px")
    refused(plan(url, body | {"images": [bomb_png(100_000, 100_000)] * 3}), 422, "image 0 is 100000x100000")
    # Each image within its limit, together past the request's.
    together = plan(url, body | {"images": [bomb_png(448, 448)] * 3})
    refused(together, 422, "602112 px together", "401408 px a request may have")
    form = httpx.post(
        url + "/v1/plan/form",
        data={"command": "go_straight"},
        files={"frame": ("b.png", base64.b64decode(bomb_png(100_000, 100_000)))},
    )
    refused(form, 422, "100000x100000 px")


def test_images_within_the_limits_are_decoded_and_planned():
    class VisionFake(FakePlanner):
        facts = dataclasses.replace(FakePlanner.facts, is_vision=True)

    with running(create_app(lambda: VisionFake(), "ss", timeout_s=600, limits=LIMITS)) as base:
        reply = plan(base, scene_body(2) | {"images": [png(56, 28), png(28, 28)]})
        assert reply.status_code == 200 and reply.json()["token_ids"][:2] == [0, 2]


def test_images_sent_to_a_text_only_model_are_a_422(url):
    refused(plan(url, scene_body(2) | {"images": [png(56, 28)]}), 422, "text-only model")


@pytest.mark.parametrize(
    ("decoder", "options", "option", "cap"),
    [
        ("tts", {"rollouts": 9}, "rollouts", 8),
        ("selfspec-quad", {"block_size": 17}, "block_size", 16),
        ("ss", {"block_size": 65}, "block_size", 64),
        ("jacobi-mr", {"max_blocks": 5}, "max_blocks", 4),
        ("jacobi-mr", {"candidates": 17}, "candidates", 16),
        ("pvf", {"width": 9}, "width", 8),
    ],
)
def test_option_values_past_the_service_caps_are_a_422_naming_the_option_and_cap(url, decoder, options, option, cap):
    reply = plan(url, scene_body(1) | {"decoder": decoder, "options": options})
    refused(reply, 422, f"option {option}", f"at most {cap}")
    assert reply.json()["detail"][0]["loc"] == ["body", "options", option]
    at_cap = plan(url, scene_body(1) | {"decoder": decoder, "options": {option: cap}})
    assert at_cap.status_code == 200, at_cap.text


def test_the_caps_are_set_when_the_server_starts(planner):
    caps = parse_caps(["tts.rollouts=2", "width=3"])
    assert caps["tts.rollouts"] == 2 and caps["width"] == 3 and caps["block_size"] == 64
    for bad, words in (
        ("nope=2", "names no integer option"),
        ("tts.tau=2", "names no integer option"),
        ("width=0", "integer >= 1"),
        ("width", "OPTION=N"),
    ):
        with pytest.raises(DecoderError, match=words):
            parse_caps([bad])
    app = create_app(lambda: planner, limits=ServiceLimits(option_caps=caps))
    with running(app) as base:
        refused(plan(base, scene_body(1) | {"decoder": "tts", "options": {"rollouts": 3}}), 422, "at most 2")
        assert "tts.rollouts 2" in httpx.get(base + "/openapi.json").text


def test_the_openapi_schema_states_this_servers_limits():
    app = create_app(lambda: FakePlanner(), limits=ServiceLimits(max_images=3))
    schema = app.openapi()
    request = schema["components"]["schemas"]["PlanRequest"]["properties"]
    assert request["images"]["maxItems"] == 3 and request["history"]["maxItems"] == 7
    body = schema["paths"]["/v1/plan"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/PlanRequest"}


def test_draft_ids_outside_the_vocabulary_are_a_422(url):
    vocab, length = FakePlanner.facts.vocab_size, FakePlanner.facts.answer_length
    for decoder, drafts in (("ss", [vocab] * length), ("jacobi", [10**6]), ("jacobi-mr", [vocab + 5])):
        reply = plan(url, scene_body(1) | {"decoder": decoder, "options": {"drafts": drafts}})
        refused(reply, 422, "drafts", "outside the model's vocabulary")


class Touched:
    """Records every file a process opens or stats whose name holds `marker`."""

    def __init__(self, monkeypatch, marker):
        self.paths = []
        for module, name in (
            (builtins, "open"),
            (io, "open"),
            (os, "open"),
            (os, "stat"),
            (os, "lstat"),
            (os, "scandir"),
        ):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, self._spy(real, marker))

    def _spy(self, real, marker):
        def spy(path, *args, **kwargs):
            if marker in str(path):
                self.paths.append(str(path))
            return real(path, *args, **kwargs)

        return spy


def test_a_vocabulary_named_in_a_request_is_refused_and_no_file_is_touched(url, tmp_path, monkeypatch):
    real = tmp_path / "secret-vocabulary.json"
    real.write_bytes(PACKAGED_VOCABULARY.read_bytes())
    (tmp_path / "secret-folder").mkdir()
    touched = Touched(monkeypatch, "secret")
    answers = set()
    for path in (
        real,
        tmp_path / "secret-missing.json",
        tmp_path / "secret-folder",
        "/etc/passwd-secret",
        "/proc/self/environ#secret",
    ):
        for decoder in ("pvf", "ss"):
            reply = plan(url, scene_body(1) | {"decoder": decoder, "options": {"vocabulary": str(path)}})
            answers.add(refused(reply, 422, "option 'vocabulary'", "names a file on the server"))
            assert reply.json()["detail"][0]["loc"] == ["body", "options", "vocabulary"]
    assert len(answers) == 1  # the same line whatever the path: no oracle of what exists
    assert touched.paths == []


def test_pvf_plans_with_the_servers_own_vocabulary(url, planner, tmp_path):
    assert plan(url, scene_body(1) | {"decoder": "pvf"}).status_code == 200
    assert planner.asked[-1] == ("pvf", {"vocabulary": str(PACKAGED_VOCABULARY.resolve())})
    without = create_app(lambda: planner, limits=LIMITS)  # a server started without one
    with running(without) as base:
        refused(plan(base, scene_body(1) | {"decoder": "pvf"}), 422, "no planning vocabulary", "planning=false")
        assert plan(base, scene_body(1) | {"decoder": "pvf", "options": {"planning": False}}).status_code == 200
        assert planner.asked[-1] == ("pvf", {"planning": False})


def test_a_bad_planning_vocabulary_stops_the_server_before_it_serves(tmp_path):
    damaged = tmp_path / "vocabulary.json"
    damaged.write_text('{"format": "something else"}')
    for path, words in (
        (damaged, "is not a planning vocabulary"),
        (tmp_path / "missing.json", "no planning vocabulary at"),
    ):
        result = CliRunner().invoke(cli, ["serve", "--pvf-vocabulary", str(path), "--port", "1"])
        assert result.exit_code == 2 and words in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1


def test_an_api_key_guards_every_route_but_the_probes(planner):
    app = create_app(lambda: planner, api_key="s3cret key")
    with running(app) as base:
        assert httpx.get(base + "/healthz").json() == {"status": "ok"}
        assert httpx.get(base + "/readyz").json()["status"] == "ready"
        for method, path in (
            ("GET", "/metrics"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("GET", "/"),
            ("GET", "/v1/scenes"),
            ("POST", "/v1/plan"),
            ("POST", "/v1/plan/form"),
        ):
            missing = httpx.request(method, base + path, json=scene_body(1))
            refused(missing, 401, "needs an API key")
            assert missing.headers["www-authenticate"] == "Bearer"
            wrong = httpx.request(method, base + path, json=scene_body(1), headers={"Authorization": "Bearer s3cret"})
            refused(wrong, 401, "the API key is wrong")
            assert "invalid_token" in wrong.headers["www-authenticate"]
        keyed = {"Authorization": "Bearer s3cret key"}
        answer = httpx.post(base + "/v1/plan", json=scene_body(3), headers=keyed)
        assert answer.status_code == 200 and answer.json()["token_ids"] == fake_ids(3)
        schema = httpx.get(base + "/openapi.json", headers=keyed).json()
        assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
        assert "401" in schema["paths"]["/v1/plan"]["post"]["responses"]
        assert (
            "security" not in schema["paths"]["/healthz"]["get"] and "security" not in schema["paths"]["/readyz"]["get"]
        )


def test_listening_beyond_this_machine_without_a_key_is_warned_of():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert exposure_warning(host, None) is None
    warning = exposure_warning("0.0.0.0", None)
    assert warning is not None and "without an API key" in warning and "\n" not in warning
    assert exposure_warning("0.0.0.0", "key") is None and exposure_warning("192.168.1.2", None) is not None


def test_a_port_in_use_is_one_line_before_the_model_loads(monkeypatch):
    import fastddrive

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the port was checked")

    monkeypatch.setattr(fastddrive, "load", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, ["serve", "--port", str(port), "--model", "/no/such/model"])
    assert result.exit_code == 2, result.output
    assert f"127.0.0.1:{port} is in use" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["serve", "--host", "no-such-host.invalid", "--port", "0"])
    assert result.exit_code == 2 and "--host no-such-host.invalid" in result.output


def test_a_scene_name_stays_inside_the_data_folder(url):
    for scene in ("../../etc/passwd", "test/../../x", "test/-1", "test/99999999999", "/etc/0", "test/0\n"):
        reply = httpx.post(url + "/v1/plan/form", data={"command": "go_straight", "scene": scene})
        refused(reply, 422, "a scene is split/index")
    reply = httpx.post(url + "/v1/plan/form", data={"command": "go_straight", "scene": "test/0"})
    refused(reply, 422, "no data folder")
    assert httpx.get(url + "/v1/scenes/..%2F..%2Fetc/0").status_code in (404, 422)
    assert httpx.get(url + "/v1/scenes/test/-1").status_code == 422


def test_a_planner_fault_is_a_503_and_the_worker_goes_on():
    class Faulty(FakePlanner):
        def plan(self, scene, decoder="ss", **options):
            if scene.command == "go_left":
                raise RuntimeError("a fault of the planner")
            return super().plan(scene, decoder, **options)

    with running(create_app(lambda: Faulty())) as base:
        refused(plan(base, scene_body(1, "go_left")), 503, "the planner failed on this request", "RuntimeError")
        reply = plan(base, scene_body(2))
        assert reply.status_code == 200 and reply.json()["token_ids"] == fake_ids(2)


def test_a_malformed_form_is_a_422(url):
    broken = httpx.post(
        url + "/v1/plan/form", content=b"--x\r\nnonsense", headers={"content-type": "multipart/form-data; boundary=x"}
    )
    assert broken.status_code == 422
    as_file = httpx.post(url + "/v1/plan/form", data={"command": "go_straight"}, files={"history": ("h.json", b"[]")})
    refused(as_file, 422, "history must be a form field")
