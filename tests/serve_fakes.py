"""Planners without a model for the serve tests, and a server on loopback to run an app in.

A fake planner answers at once from the scene (so that an answer shows which scene it is for), records what
it was asked, and, gated, waits until the test lets it go: a test decides when the model is busy, never a
clock. The load functions are module-level, so that a model process (`isolated=True`) can load them too.
"""

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import uvicorn

from fastddrive.core.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold
from fastddrive.core.tokenizer import load_tokenizer
from fastddrive.decode.footprint import ModelSizes
from fastddrive.decode.result import DecodeResult
from fastddrive.engine.model_files import model_path, read_info
from fastddrive.planner import NAV_COMMANDS, ModelFacts, PlanInputs


def _text_facts() -> ModelFacts:
    """The embedded model's facts, from its small files, as a text-only model: images optional, every decoder
    runs, drafts and memory checked against its sizes."""
    folder = model_path("default")
    sizes = ModelSizes.from_config(json.loads((folder / "config.json").read_text()), 4)
    info = read_info(folder)
    budget = info.explanation_budget or DEFAULT_EXPLANATION_BUDGET
    scaffold = Scaffold(
        load_tokenizer(folder), explanation_budget=budget, scaffold_tokenization=info.scaffold_tokenization
    )
    return ModelFacts(False, "block-diffusion", sizes.vocab, len(scaffold), sizes, "cpu")


TEXT_FACTS = _text_facts()
READY_S = 120  # a generous bound on a model process starting on a busy machine: only a failure waits for it


class FakePlanner:
    """Answers a scene at once with ids that name it (the command's index and the first history row). Its
    `model` has the embedded tokenizer only, against which a server checks its planning vocabulary."""

    facts = TEXT_FACTS

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self.model = SimpleNamespace(tokenizer=load_tokenizer(model_path("default")))

    def plan(self, scene: PlanInputs, decoder: str = "ss", **options: Any) -> DecodeResult:
        options = self.facts.check_options(decoder, options)  # the library's own refusal, as `decode` gives it
        self.asked.append((decoder, options))
        ids = [
            NAV_COMMANDS.index(scene.command),
            len(scene.images),
            *(round(float(np.clip(v, -1e6, 1e6)) * 1000) for v in scene.history[0]),
        ]
        return DecodeResult(decoder, ids, scene.command, None, 1, len(ids), 0, [len(ids)], 0.1, 0.1, "a fake")


class GatedPlanner:
    """A planner (a FakePlanner unless given) that, on each plan, says it started (`started`) and waits for
    `release` (threading.Events, or Gates across processes)."""

    def __init__(self, started: Any, release: Any, planner: Any = None) -> None:
        self.started, self.release = started, release
        self.planner = planner or FakePlanner()
        self.facts = self.planner.facts

    def plan(self, scene: PlanInputs, decoder: str = "ss", **options: Any) -> DecodeResult:
        self.started.set()
        self.release.wait()
        return self.planner.plan(scene, decoder, **options)


def fake_load() -> FakePlanner:
    return FakePlanner()


def gated_load(started: Any, release: Any, loadable: Any = None) -> GatedPlanner:
    """A GatedPlanner, loaded once `loadable` (if given) is set: a test holds a restart in its loading."""
    if loadable is not None:
        loadable.wait()
    return GatedPlanner(started, release)


def scene_body(k: int, command: str = "go_straight") -> dict[str, Any]:
    """A /v1/plan body without images whose fake answer names `k` (its first history row's x, in mm)."""
    return {"history": [[float(k), 0.0, 0.0, 0.0, 0.0, 0.0]] * 7, "command": command}


def fake_ids(k: int, command: str = "go_straight") -> list[int]:
    """The token ids a fake planner answers `scene_body(k, command)` with."""
    return [NAV_COMMANDS.index(command), 0, 1000 * k, 0, 0, 0, 0, 0]


def serve(port: int, started: Any, release: Any, isolated: bool, timeout_s: float, grace_s: float) -> None:
    """`fastddrive serve` as it runs (`app.run`: SIGTERM, the grace period) over a gated fake planner: the
    target of a spawned server process."""
    from functools import partial

    from fastddrive.serve.app import create_app, run
    from fastddrive.serve.guards import listening_socket

    app = create_app(partial(gated_load, started, release), "ss", 8, timeout_s, isolated=isolated)
    run(app, listening_socket("127.0.0.1", port), grace_s)


class Gate:
    """A flag that processes share through a file (set: the file exists). Unlike a multiprocessing.Event, a
    process killed while it waits, or while it sets it, leaves it whole: the tests here kill such processes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def set(self) -> None:
        self.path.touch()

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def is_set(self) -> bool:
        return self.path.exists()

    def wait(self, bound_s: float | None = None) -> bool:
        """Whether it was set (within `bound_s`, which only ends a test that would otherwise hang)."""
        deadline = None if bound_s is None else time.monotonic() + bound_s
        while not self.is_set():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True


def gates(folder: Path, *names: str) -> list[Gate]:
    return [Gate(folder / name) for name in names]


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def wait_until(condition, what: str, bound_s: float = READY_S) -> None:
    """Poll `condition()` until it holds; the bound only ends a test that would otherwise hang."""
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {bound_s} s"
        time.sleep(0.02)


@contextmanager
def running(app, ready: bool = True, headers: dict[str, str] | None = None):
    """Serve `app` on a free loopback port in a thread; yields the URL once it listens (and, with `ready`,
    once the model is loaded)."""
    sock = free_socket()
    # A test that fails with a request still on the gated model must not wait on it for ever.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_until(lambda: server.started, "the server start")
        if ready:
            wait_until(lambda: httpx.get(url + "/readyz", headers=headers).status_code == 200, "the model load")
        yield url
    finally:
        server.should_exit = True
        thread.join(60)
