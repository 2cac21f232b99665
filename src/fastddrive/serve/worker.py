"""One thread owns the model and answers the requests one at a time, in arrival order, from a bounded queue.

The event loop never runs the model: a request becomes a `Job` whose asyncio future the worker thread
settles. The model runs on that thread, or, with `isolated=True`, in a process of its own
(`model_process`; the thread only waits on its pipe). Each job carries its own future, so an answer can only
reach the request that asked for it. A full queue is refused at once (QueueFull, a 503); a request past
its time, or given up by its client, is withdrawn from the queue (its slot freed at once) or, if the model is
already on it, its answer is dropped when it comes (a forward cannot be interrupted).

A model process that dies (issue 32: the OOM killer's SIGKILL) is seen at once: the worker is not ready, the
job the model was on and those queued get ModelProcessDied (a 503), and a new process is started; the
`restarted` callback counts it once it is back. `close` stops without waiting for work nobody waits for: a
job still on the model when the server stops is abandoned (its process killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastddrive.decode.result import DecodeResult
from fastddrive.planner import PlanInputs, Planner
from fastddrive.serve.model_process import ModelProcessDied, PlannerOnThread, PlannerProcess

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds its most requests already."""


class NotReady(Exception):
    """The model is not loaded (yet, or it failed to load, or its process is being restarted), or the worker is
    stopping."""


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

    def __init__(
        self,
        load: Callable[[], Planner],
        max_queue: int,
        isolated: bool = False,
        restarted: Callable[[], None] = lambda: None,
    ) -> None:
        self.max_queue = max_queue
        self.isolated = isolated
        self.planner: PlannerOnThread | PlannerProcess | None = None
        self.load_error: str | None = None
        self.down: str | None = None  # why the model is not there while a new model process starts
        self._load = load
        self._restarted = restarted
        self._jobs: deque[Job] = deque()
        self._changed = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="model-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop: what is still queued is refused (NotReady), the thread ends once the model is idle; a job the
        model is still on after `timeout_s` is abandoned (a model process is killed, a thread left to finish)."""
        with self._changed:
            self._closing = True
            self._refuse_queued(NotReady("stopping"))
            self._changed.notify_all()
        self._thread.join(timeout_s)
        planner = self.planner
        if self._thread.is_alive() and isinstance(planner, PlannerProcess):
            planner.kill()
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        """Whether the thread is still on (after `close`: on a job it was abandoned on)."""
        return self._thread.is_alive()

    @property
    def ready(self) -> bool:
        planner = self.planner
        return planner is not None and planner.alive and not self._closing

    @property
    def status(self) -> str:
        """'ready', or why not: the model is loading, failed to load, is being restarted, or the server stops."""
        if self._closing:
            return "stopping"
        if self.load_error:
            return self.load_error
        planner = self.planner
        if planner is not None and not planner.alive:
            return "restarting: the model process ended"
        if planner is None:
            return f"restarting: {self.down}" if self.down else "loading"
        return "ready"

    def depth(self) -> int:
        """Requests waiting (not counting the one the model is on)."""
        return len(self._jobs)

    async def plan(
        self, scene: PlanInputs, decoder: str, options: dict[str, Any], timeout_s: float
    ) -> tuple[DecodeResult, Job]:
        """Queue one scene and wait for its answer: QueueFull, NotReady, TimeoutError, ModelProcessDied, or what
        `plan` raised."""
        loop = asyncio.get_running_loop()
        job = Job(scene, decoder, options, loop.create_future(), loop)
        with self._changed:
            if not self.ready:
                raise NotReady(self.status)
            if len(self._jobs) >= self.max_queue:
                raise QueueFull
            self._jobs.append(job)
            self._changed.notify_all()
        try:
            return await asyncio.wait_for(job.future, timeout_s), job
        except (TimeoutError, asyncio.CancelledError):  # past its time, or its client (or the server) gave up
            with self._changed:
                if job in self._jobs:
                    self._jobs.remove(job)
            raise

    def _run(self) -> None:
        restarts = 0
        while not self._closing:
            try:
                planner = PlannerProcess(self._load, self._wake) if self.isolated else PlannerOnThread(self._load)
            except Exception as err:  # the service stays up to say why on /readyz
                self.load_error = f"{type(err).__name__}: {err}"
                with self._changed:
                    self._refuse_queued(NotReady(self.load_error))
                return
            self.planner, self.down = planner, None
            if restarts:
                self._restarted()
            try:
                self._serve(planner)
            except ModelProcessDied as err:
                log.error("%s; starting a new one", err)
                with self._changed:
                    self.planner, self.down = None, str(err)
                    self._refuse_queued(err)
                restarts += 1
            finally:
                planner.close()

    def _serve(self, planner: PlannerOnThread | PlannerProcess) -> None:
        """Plan the queued jobs until closing; ModelProcessDied when the model process dies (the job it was on
        is told so)."""
        while (job := self._next_job(planner)) is not None:
            job.queue_ms = 1000 * (time.perf_counter() - job.queued_at)
            try:
                # plan_ms is the model's own time: the pipe to a model process counts as the service's.
                (result, job.plan_ms), error = planner.timed_plan(job.scene, job.decoder, **job.options), None
            except ModelProcessDied as err:
                _answer(job, None, err)
                raise
            except Exception as err:  # handed to the request that asked, never lost; the worker goes on
                result, error = None, err
            _answer(job, result, error)

    def _next_job(self, planner: PlannerOnThread | PlannerProcess) -> Job | None:
        """The oldest queued job; None once closing; ModelProcessDied if the model process ends while idle."""
        with self._changed:
            while not self._jobs and not self._closing and planner.alive:
                self._changed.wait()
            if self._closing and not self._jobs:
                return None
            if not planner.alive:
                raise planner.died()
            return self._jobs.popleft()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _refuse_queued(self, error: Exception) -> None:
        """Settle every queued job with `error` (the caller holds the lock)."""
        while self._jobs:
            _answer(self._jobs.popleft(), None, error, wait=False)


def _answer(job: Job, result: DecodeResult | None, error: Exception | None, wait: bool = True) -> None:
    with contextlib.suppress(RuntimeError):  # a stopped event loop: nobody waits for this answer
        job.loop.call_soon_threadsafe(_settle, job.future, result, error)
        if wait:
            _let_the_loop_answer(job.loop)


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
