"""The planner in a process of its own, so that the model never holds the service's GIL.

A decode step of a small model is mostly Python (the decoders' loops, op dispatch), and while it runs it
holds the interpreter lock; in the same process the event loop then waits for the lock each time it parses,
validates or answers a request (Python hands the lock over every `sys.getswitchinterval()`, 5 ms), which
is service overhead that grows with the number of clients. Here the model lives in a spawned process (a GPU
is fine there too) and the server keeps only the HTTP work: `PlannerProcess.plan` sends a validated scene
over a pipe and waits for the answer, releasing the lock while it waits. Only this package's own objects
cross the pipe, between two processes of the same service; nothing a client sent is unpickled.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from fastddrive.decode.result import DecodeResult
from fastddrive.planner import ModelFacts, PlanInputs, Planner


class ModelProcessDied(RuntimeError):
    """The model process ended while the service still needed it."""


def timed_plan(planner: Planner, scene: PlanInputs, decoder: str, **options: Any) -> tuple[DecodeResult, float]:
    """`planner.plan`'s answer and how long it took (ms)."""
    began = time.perf_counter()
    result = planner.plan(scene, decoder, **options)
    return result, 1000 * (time.perf_counter() - began)


class PlannerOnThread:
    """A planner loaded on the calling thread, behind `PlannerProcess`'s interface (`facts`, `timed_plan`,
    `close`), so that the model worker treats both alike."""

    def __init__(self, load: Callable[[], Planner]) -> None:
        self._planner = load()
        self.facts: ModelFacts = self._planner.facts

    def timed_plan(self, scene: PlanInputs, decoder: str, **options: Any) -> tuple[DecodeResult, float]:
        return timed_plan(self._planner, scene, decoder, **options)

    def close(self) -> None:
        """Nothing to release: the model goes with its thread."""


class PlannerProcess:
    """`load()` run in a child process; then `timed_plan`, and `facts` as `Planner.facts`."""

    def __init__(self, load: Callable[[], Planner]) -> None:
        context = multiprocessing.get_context("spawn")  # a fork would copy the server's threads and locks
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_plans, args=(load, child), name="fastddrive-model", daemon=True)
        self._process.start()
        child.close()
        loaded = self._receive()
        if isinstance(loaded, BaseException):
            self.close()
            raise loaded
        self.facts: ModelFacts = loaded

    def timed_plan(self, scene: PlanInputs, decoder: str, **options: Any) -> tuple[DecodeResult, float]:
        """The answer, and how long the model process spent planning it (ms, without the pipe)."""
        try:
            self._conn.send((scene, decoder, options))
        except OSError:
            raise ModelProcessDied(f"the model process is gone (status {self._process.exitcode})") from None
        answer, error, plan_ms = self._receive()
        if error is not None:
            raise error
        return answer, plan_ms

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the model process finish what it is on and exit."""
        if self._process.is_alive():
            with contextlib.suppress(OSError):  # it is gone already
                self._conn.send(None)
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()

    def _receive(self) -> Any:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise ModelProcessDied(f"the model process exited (status {self._process.exitcode})") from None


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
