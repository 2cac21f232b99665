"""Jobs run in spawned worker processes, each result handed back as it comes (the data generator's episodes,
DAgger's, the closed loop's).

A worker that dies fails only the job it held, named with how the process ended, and is replaced for the
remaining ones. On Ctrl-C (or an error in `deliver`) no further job starts; the jobs running finish and are
`record`ed unless interrupted too, so that a rerun resumes the rest.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, Protocol, TypeVar


class Outcome(Protocol):
    """What a job gives back: `error` is None unless it failed."""

    @property
    def error(self) -> str | None: ...


J = TypeVar("J")
R = TypeVar("R", bound=Outcome)


def how_it_ended(exitcode: int | None) -> str:
    """A process's exit code in words."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}" + (", as the out-of-memory killer does" if name == "SIGKILL" else "")
    return f"exit status {exitcode}"


def _serve(connection: Connection, run: Callable[[Any], Any]) -> None:
    """A worker process: run each job it is sent until it is sent None. Ctrl-C reaches the workers too: the
    main process reports it, so a worker just stops."""
    with suppress(KeyboardInterrupt, EOFError, BrokenPipeError):
        while (job := connection.recv()) is not None:
            connection.send(run(job))


@dataclass
class _Worker(Generic[J, R]):
    """One worker process, the main process's end of its pipe, and the job it holds."""

    process: multiprocessing.process.BaseProcess
    connection: Connection
    job: J | None = None
    since: float = 0.0

    @classmethod
    def start(cls, context: Any, run: Callable[[J], R]) -> _Worker[J, R]:
        ours, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(theirs, run), daemon=True)
        process.start()
        theirs.close()
        return cls(process, ours)

    def give(self, job: J) -> None:
        """Send `job`. A process that died meanwhile cannot take it: `take` then reports how it ended."""
        self.job, self.since = job, time.perf_counter()
        with suppress(OSError):
            self.connection.send(job)

    def take(self, failure: Callable[[J, float, str], R]) -> R:
        """The result of the job it held (once its pipe or its process is ready), or `failure(job, seconds, how
        the process ended)`."""
        job, self.job = self.job, None
        assert job is not None
        with suppress(EOFError, OSError):
            if self.connection.poll():
                return self.connection.recv()
        self.process.join()
        return failure(job, time.perf_counter() - self.since, how_it_ended(self.process.exitcode))

    def stop(self) -> None:
        if self.job is None and self.process.is_alive():
            with suppress(OSError):
                self.connection.send(None)
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.connection.close()


def run_in_workers(
    todo: Sequence[J],
    workers: int,
    run: Callable[[J], R],
    deliver: Callable[[R], None],
    record: Callable[[R], None],
    failure: Callable[[J, float, str], R],
) -> None:
    """Run `todo` in up to `workers` spawned processes (`run` must be picklable; each process unpickles it
    once), `deliver`ing each result as it comes; a job whose worker died gives `failure(job, seconds, how)`.
    On an interruption the results of the jobs still running are `record`ed, then it is raised again."""
    context = multiprocessing.get_context("spawn")
    queue = deque(todo)
    pool: list[_Worker[J, R]] = []
    try:
        try:
            while queue or any(w.job is not None for w in pool):
                for worker in [w for w in pool if w.job is None and not w.process.is_alive()]:
                    worker.stop()  # died between jobs: nothing was lost
                    pool.remove(worker)
                for worker in pool:
                    if worker.job is None and queue:
                        worker.give(queue.popleft())
                while queue and len(pool) < workers:
                    pool.append(_Worker.start(context, run))
                    pool[-1].give(queue.popleft())
                busy = [w for w in pool if w.job is not None]
                ready = set(wait([w.connection for w in busy] + [w.process.sentinel for w in busy]))
                for worker in busy:
                    if worker.connection in ready or worker.process.sentinel in ready:
                        deliver(worker.take(failure))
        except BaseException:
            for worker in [w for w in pool if w.job is not None]:
                wait([worker.connection, worker.process.sentinel])
                result = worker.take(failure)
                if result.error is None:
                    record(result)
            raise
    finally:
        for worker in pool:
            worker.stop()
