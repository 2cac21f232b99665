"""The planner in a process of its own, so that the model never holds the service's GIL.

A decode step of a small model is mostly Python (the decoders' loops, op dispatch), and while it runs it
holds the interpreter lock; in the same process the event loop then waits for the lock each time it parses,
validates or answers a request (Python hands the lock over every `sys.getswitchinterval()`, 5 ms), which
is service overhead that grows with the number of clients. Here the model lives in a spawned process (a GPU
is fine there too) and the server keeps only the HTTP work: `PlannerProcess.plan` sends a validated scene
over a pipe and waits for the answer, releasing the lock while it waits. Only this package's own objects
cross the pipe, between two processes of the same service; nothing a client sent is unpickled.

A model process can die under the service (the kernel's OOM killer sends SIGKILL): a thread watches its
sentinel, so that the service knows at once (`alive`, the `on_exit` callback) rather than at the next request,
and the request the model was on gets ModelProcessDied; the model worker then starts a new one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from fastddrive.decode.result import DecodeResult
from fastddrive.planner import ModelFacts, PlanInputs, Planner


class ModelProcessDied(RuntimeError):
    """The model process ended while the service still needed it."""


def ended(exitcode: int | None) -> str:
    """How a process ended, in words: 'killed by SIGKILL', 'exit status 1'."""
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


def timed_plan(planner: Planner, scene: PlanInputs, decoder: str, **options: Any) -> tuple[DecodeResult, float]:
    """`planner.plan`'s answer and how long it took (ms)."""
    began = time.perf_counter()
    result = planner.plan(scene, decoder, **options)
    return result, 1000 * (time.perf_counter() - began)


class PlannerOnThread:
    """A planner loaded on the calling thread, behind `PlannerProcess`'s interface (`facts`, `timed_plan`,
    `close`), so that the model worker treats both alike."""

    alive = True  # it lives as long as the service

    def __init__(self, load: Callable[[], Planner]) -> None:
        self._planner = load()
        self.facts: ModelFacts = self._planner.facts

    def timed_plan(self, scene: PlanInputs, decoder: str, **options: Any) -> tuple[DecodeResult, float]:
        return timed_plan(self._planner, scene, decoder, **options)

    def close(self) -> None:
        """Nothing to release: the model goes with its thread."""


class PlannerProcess:
    """`load()` run in a child process; then `timed_plan`, and `facts` as `Planner.facts`. `on_exit()` is called
    (on a thread of its own) as soon as the process has ended, however it ended."""

    def __init__(self, load: Callable[[], Planner], on_exit: Callable[[], None] = lambda: None) -> None:
        context = multiprocessing.get_context("spawn")  # a fork would copy the server's threads and locks
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_plans, args=(load, child), name="fastddrive-model", daemon=True)
        self._process.start()
        child.close()
        self._exited = threading.Event()
        self._on_exit = on_exit
        threading.Thread(target=self._watch, name="model-process-watch", daemon=True).start()
        loaded = self._receive()
        if isinstance(loaded, BaseException):
            self.close()
            raise loaded
        self.facts: ModelFacts = loaded

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def timed_plan(self, scene: PlanInputs, decoder: str, **options: Any) -> tuple[DecodeResult, float]:
        """The answer, and how long the model process spent planning it (ms, without the pipe)."""
        try:
            self._conn.send((scene, decoder, options))
        except OSError:
            raise self.died() from None
        answer, error, plan_ms = self._receive()
        if error is not None:
            raise error
        return answer, plan_ms

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the model process finish what it is on and exit; kill it after `timeout_s`."""
        if self.alive:
            with contextlib.suppress(OSError):  # it is gone already
                self._conn.send(None)
        self._process.join(timeout_s)
        self.kill()
        self._conn.close()

    def kill(self) -> None:
        """End the process now (what it is on is abandoned); a `timed_plan` waiting on it gets ModelProcessDied."""
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def _watch(self) -> None:
        wait([self._process.sentinel])  # readable once the process has ended
        self._exited.set()
        self._on_exit()

    def _receive(self) -> Any:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self.died() from None

    def died(self) -> ModelProcessDied:
        """The error that says how the process ended (call it once it has)."""
        self._process.join(5)
        return ModelProcessDied(f"the model process ended ({ended(self._process.exitcode)})")


def _serve_plans(load: Callable[[], Planner], conn: Connection) -> None:
    """The model process: load, say what the model is (or why it did not load), then answer until told to stop."""
    # Ctrl+C reaches the whole process group; the server decides when this process stops (after its queue).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        planner = load()
    except Exception as err:  # the server says why on /readyz
        conn.send(_sendable(err))
        return
    conn.send(planner.facts)
    while (job := conn.recv()) is not None:
        scene, decoder, options = job
        try:
            (answer, plan_ms), error = timed_plan(planner, scene, decoder, **options), None
        except Exception as err:  # handed back to the request that asked
            answer, plan_ms, error = None, 0.0, _sendable(err)
        conn.send((answer, error, plan_ms))


def _sendable(err: Exception) -> Exception:
    """`err` if it survives the pipe, else a RuntimeError with its message (its type named)."""
    try:
        multiprocessing.reduction.ForkingPickler.loads(multiprocessing.reduction.ForkingPickler.dumps(err))
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err
