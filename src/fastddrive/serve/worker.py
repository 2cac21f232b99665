"""One thread owns the model and answers the requests one at a time, in arrival order, from a bounded queue.

The event loop never runs the model: a request becomes a `Job` whose asyncio future the worker thread
settles. The model runs on that thread, or, with `isolated=True`, in a process of its own
(`model_process`; the thread only waits on its pipe). Each job carries its own future, so an answer can only
reach the request that asked for it. A full queue is refused at once (QueueFull, a 503); a request past
its time is withdrawn from the queue (its slot freed at once) or, if the model is already on it, its
answer is dropped when it comes (a forward cannot be interrupted).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastddrive.decode.result import DecodeResult
from fastddrive.planner import PlanInputs, Planner
from fastddrive.serve.model_process import PlannerOnThread, PlannerProcess


class QueueFull(Exception):
    """The queue holds its most requests already."""


class NotReady(Exception):
    """The model is not loaded (yet, or it failed to load), or the worker is stopping."""


@dataclass(eq=False)
class Job:
    """One request on its way through the queue; `queue_ms` and `plan_ms` are filled by the worker."""

    scene: PlanInputs
    decoder: str
    options: dict[str, Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float = field(default_factory=time.perf_counter)
    queue_ms: float = 0.0
    plan_ms: float = 0.0


class ModelWorker:
    """The thread that loads the model with `load()` (in a process of its own when `isolated`; `load` must
    then be picklable, a module-level function or a partial of one) and then plans the queued jobs."""

    def __init__(self, load: Callable[[], Planner], max_queue: int, isolated: bool = False) -> None:
        self.max_queue = max_queue
        self.isolated = isolated
        self.planner: PlannerOnThread | PlannerProcess | None = None
        self.load_error: str | None = None
        self._load = load
        self._jobs: deque[Job] = deque()
        self._changed = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="model-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float | None = None) -> None:
        """Plan what is still queued, then stop the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join(timeout_s)

    @property
    def ready(self) -> bool:
        return self.planner is not None and not self._closing

    def depth(self) -> int:
        """Requests waiting (not counting the one the model is on)."""
        return len(self._jobs)

    async def plan(
        self, scene: PlanInputs, decoder: str, options: dict[str, Any], timeout_s: float
    ) -> tuple[DecodeResult, Job]:
        """Queue one scene and wait for its answer: QueueFull, NotReady, TimeoutError, or what `plan` raised."""
        loop = asyncio.get_running_loop()
        job = Job(scene, decoder, options, loop.create_future(), loop)
        with self._changed:
            if not self.ready:
                raise NotReady
            if len(self._jobs) >= self.max_queue:
                raise QueueFull
            self._jobs.append(job)
            self._changed.notify()
        try:
            return await asyncio.wait_for(job.future, timeout_s), job
        except TimeoutError:
            with self._changed:
                if job in self._jobs:
                    self._jobs.remove(job)
            raise

    def _run(self) -> None:
        try:
            planner = PlannerProcess(self._load) if self.isolated else PlannerOnThread(self._load)
        except Exception as err:  # the service stays up to say why on /readyz
            self.load_error = f"{type(err).__name__}: {err}"
            return
        self.planner = planner
        try:
            while (job := self._next_job()) is not None:
                job.queue_ms = 1000 * (time.perf_counter() - job.queued_at)
                try:
                    # plan_ms is the model's own time: the pipe to a model process counts as the service's.
                    (result, job.plan_ms), error = self.planner.timed_plan(job.scene, job.decoder, **job.options), None
                except Exception as err:  # handed to the request that asked, never lost
                    result, error = None, err
                with contextlib.suppress(RuntimeError):  # a stopped event loop: nobody waits for this answer
                    job.loop.call_soon_threadsafe(_settle, job.future, result, error)
                    _let_the_loop_answer(job.loop)
        finally:
            planner.close()

    def _next_job(self) -> Job | None:
        """The oldest queued job; None once closing with nothing left."""
        with self._changed:
            while not self._jobs and not self._closing:
                self._changed.wait()
            return self._jobs.popleft() if self._jobs else None


def _let_the_loop_answer(loop: asyncio.AbstractEventLoop, limit_s: float = 0.05) -> None:
    """Wait (at most `limit_s`) until the event loop has run the answer's request on to its response: a plan
    started at once would hold the GIL against it, and the answer would wait on the next plan's Python."""
    answered = threading.Event()
    loop.call_soon_threadsafe(loop.call_soon, answered.set)  # after the callbacks the answer's settling queues
    answered.wait(limit_s)


def _settle(future: asyncio.Future, result: DecodeResult | None, error: Exception | None) -> None:
    if future.done():  # timed out and cancelled: the answer is dropped
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
