"""Build a simulator dataset episode by episode, resumably, in parallel worker processes.

Every episode is one parquet shard written atomically into its split's folder. The manifest records the
settings and, as each episode finishes, its shard's size, sha256 and sample count and the episode's end
reason (rewritten atomically), so an interrupted run loses nothing it finished: a rerun with the same
settings keeps every shard that matches its record and simulates the rest again, which also rebuilds
missing or damaged shards of a complete dataset (episodes are seeded, so byte for byte the same). Splits
are by episode (no scene in two splits). A failed episode is reported and the others still complete; the
dataset is marked complete only when none failed. A worker process that dies (killed, as the kernel's
out-of-memory killer does) fails the episode it held, named with how the process ended; a new worker takes
the remaining episodes.
Val and test episodes also get the simulated raters (data/raters.py) that the WOD-E2E rater feedback
score needs; training episodes do not (nothing trains on them, and they cost several times the episode).

Settings are range-checked before anything is simulated (`check_build_settings`): episode i is seeded with
`seed * 100000 + i`, stored as a 64-bit integer, so seeds run 0..MAX_SEED and episodes 1..100000; workers run
1..twice the CPUs this process may use (more only wait for a CPU), and each worker's memory counts against the
memory budget (memory.py).

Outputs never destroy inputs (issue 32): `--out` is checked before any work (outputs.check_folder_destination),
and `overwrite` never deletes the data set in `--out` first. The simulator build makes the replacement in
`.<out>.overwrite.tmp-build` beside it and swaps it in once it is complete; until then `--out` is untouched.
A replacement that is interrupted, or has failed episodes, stays there, and the same command resumes it
exactly as it resumes `--out` itself (settings changed since: it starts over). The converters and exports
(wod_e2e.py, nuscenes.py) build into a fresh folder beside `--out` (`staged_build`) that takes its place when
the work ends; interrupted, it is removed (or, after a kill, removed by the next run) and `--out` is as it was.
A conversion with failed records does not replace a complete data set (it would lose samples): it is dropped
and the old one kept.

`build_episodes` is that machinery for any plan of episodes, settings and episode runner: the closed-loop
DAgger collection (drive/dagger.py) writes its data sets through it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field, replace
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import TypeVar

from fastddrive.core.memory import check_allocation
from fastddrive.core.outputs import (
    TEMPORARY_MARK,
    check_folder_destination,
    is_temporary,
    replace_folder,
    staged_folder,
    write_bytes,
)
from fastddrive.core.worker_pool import run_in_workers
from fastddrive.data.dataset import (
    DATASET_FORMAT,
    MANIFEST,
    SHARDS,
    SPLITS,
    DatasetError,
    ManifestError,
    ShardCheck,
    check_shard,
    read_manifest,
    shard_record,
    shards_on_disk,
    write_shard,
)
from fastddrive.data.episodes import (
    RATER_SPLITS,
    SOURCE,
    DataSettingsError,
    EpisodeJob,
    _whole,
    check_episode_settings,
    plan_episodes,
)

MANIFEST_VERSION = 2  # 2: the manifest records every shard (SHARDS); 1: it did not
WORKERS_PER_CPU = 2
# What one worker process may hold: the simulator, its rater copies, a shard being written (about 200 MB
# measured on a highway episode with raters; twice that for the larger scenes).
WORKER_BYTES = 512 << 20
WORKER_DIED = "its worker process died"


class OutputExists(FileExistsError):
    """The output folder already holds something that generating would overwrite."""


@dataclass(frozen=True)
class EpisodeResult:
    job: EpisodeJob
    samples: int
    seconds: float
    end_reason: str = ""  # duration, end_of_road or crash (the expert's own)
    error: str | None = None
    record: dict[str, object] | None = None  # the shard's size, sha256 and samples (sample.shard_record)


@dataclass(frozen=True)
class BuildReport:
    episodes: int
    skipped: int
    samples: int
    failed: list[EpisodeResult]
    seconds: float
    repaired: list[str] = field(default_factory=list)  # "shard problem" of each shard found bad and redone
    complete: bool = False  # every planned episode is written: the dataset is marked complete
    staged: Path | None = None  # an unfinished replacement (overwrite) waiting beside --out; None once swapped in

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def max_workers() -> int:
    """The most worker processes a build takes: twice the usable CPUs (each simulates on one CPU)."""
    return WORKERS_PER_CPU * usable_cpus()


def check_build_settings(episodes: int, seed: int, workers: int = 1, model_bytes: int = 0) -> None:
    """DataSettingsError (one line), before anything is simulated, for a setting outside its range; with several
    workers, MemoryBudgetError when they would hold more than the budget (each its own copy of a model of
    `model_bytes`, where one drives)."""
    check_episode_settings(episodes, seed)
    if problem := workers_problem(workers):
        raise DataSettingsError(problem)
    check_workers_memory(workers, model_bytes)


def workers_problem(workers: int) -> str | None:
    """Why a worker count is out of range (1 to twice the usable CPUs), or None."""
    limit = max_workers()
    if not _whole(workers) or not 1 <= workers <= limit:
        return (
            f"--workers {workers} is out of range: give 1 to {limit} ({WORKERS_PER_CPU} per usable CPU; "
            f"this process may use {usable_cpus()})"
        )
    return None


def check_workers_memory(workers: int, model_bytes: int = 0) -> None:
    """MemoryBudgetError when `workers` processes (more than one), each with its own copy of a model of
    `model_bytes`, would hold more than the budget."""
    if workers > 1:
        check_allocation(f"--workers {workers}", workers * (WORKER_BYTES + model_bytes))


def _episode_key(job: EpisodeJob) -> str:
    return f"{job.index:05d}-{job.scenario}"


def simulator_settings(source: str, episodes: int, seed: int, scenarios: list[str]) -> dict[str, object]:
    """The settings every data set of simulated episodes records first (the generator's, DAgger's): who made
    it, with which highway-env, which episodes, the frames' size and past boxes, and the simulation rate."""
    from fastddrive.data.highway import FRAME_SIZE_PX, SIMULATION_HZ
    from fastddrive.data.past_boxes import PAST_BOX_AGES_S

    return {
        "source": source,
        "highway_env_version": version("highway-env"),
        "episodes": episodes,
        "seed": seed,
        "scenarios": scenarios,
        "frame_size_px": list(FRAME_SIZE_PX),
        "frame_past_boxes_s": list(PAST_BOX_AGES_S),  # the other cars' past drawn in (data/past_boxes.py)
        "simulation_hz": SIMULATION_HZ,
    }


def _settings(episodes: int, seed: int, scenarios: list[str], rater_splits: tuple[str, ...]) -> dict[str, object]:
    from fastddrive.data.highway import SAMPLE_RULE_VERSION
    from fastddrive.data.raters import DRIVERS, RULE_VERSION

    return {
        **simulator_settings(SOURCE, episodes, seed, scenarios),
        "sample_rule_version": SAMPLE_RULE_VERSION,  # which steps make a sample (highway.sample_steps)
        # Which splits carry simulated raters, and by which drivers and score rule (data/raters.py).
        "raters": {
            "splits": [s for s in SPLITS if s in rater_splits],
            "drivers": list(DRIVERS),
            "rule_version": RULE_VERSION,
        },
    }


def _layout_problem(out: Path) -> str | None:
    """Why `out` (an existing, non-empty folder) is not a data set that may be replaced: it must hold only its
    manifest, split folders and temporary leftovers, and a manifest (if readable) of the data set format."""
    if not (out / MANIFEST).is_file():
        return f"{out} is not empty and is not a fastddrive dataset"
    foreign = sorted(p.name for p in out.iterdir() if p.name not in (MANIFEST, *SPLITS) and not is_temporary(p))
    if foreign:
        listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        return f"{out} holds {listed}, which no fastddrive dataset holds"
    try:
        read_manifest(out / MANIFEST)
    except ManifestError:
        return None  # a damaged data set: replacing it is what --overwrite is for
    except DatasetError as err:  # another format's manifest, or a newer one
        return str(err)
    return None


def prepare_output(
    out: Path, settings: dict[str, object], overwrite: bool, refuse_complete: bool = True
) -> dict[str, object]:
    """Check the output folder before any work; nothing is deleted. Returns the manifest of the dataset it holds
    with the same settings ({} for none, and with `overwrite`, whose replacement the caller builds beside it).

    Refused: a file; a folder that holds anything but a data set; without `overwrite`, a data set with other
    settings or a damaged one, and (unless `refuse_complete` is False) a complete one."""
    if out.exists() and not out.is_dir():
        raise OutputExists(f"{out} exists and is not a directory")
    if not out.exists() or not any(out.iterdir()):
        return {}
    problem = _layout_problem(out)
    if problem is not None:
        then = "refusing to delete it" if overwrite else "choose another --out"
        raise OutputExists(f"{problem}; {then}")
    if overwrite:
        return {}
    try:
        manifest = read_manifest(out / MANIFEST)
    except ManifestError as err:
        raise OutputExists(
            f"{out} holds a damaged dataset ({err.problem}); pass --overwrite to replace it or choose another --out"
        ) from None
    existing = manifest["settings"]
    if existing != settings:
        differ = ", ".join(
            f"{k} {existing.get(k)!r} there, {v!r} now" for k, v in settings.items() if existing.get(k) != v
        )
        raise OutputExists(
            f"{out} holds a dataset made with other settings ({differ}); "
            "pass --overwrite to replace it or choose another --out"
        )
    if refuse_complete and manifest["complete"]:
        raise OutputExists(_COMPLETE.format(out=out))
    return manifest


_COMPLETE = "{out} already holds this complete dataset; pass --overwrite to regenerate it"


def holds_complete_dataset(out: Path) -> bool:
    """Whether `out` holds a data set whose manifest reads and marks it complete."""
    try:
        return bool(read_manifest(out / MANIFEST)["complete"])
    except DatasetError:
        return False


_WRITER_PID = re.compile(re.escape(TEMPORARY_MARK) + r"(\d+)-")


def _writer_gone(path: Path) -> bool:
    """Whether the process that made the temporary file or folder `path` (its pid is in the name) has ended."""
    found = _WRITER_PID.search(path.name)
    if found is None:
        return False
    try:
        os.kill(int(found.group(1)), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # alive under another user, or no pid this system has
        pass
    return False


def remove_leftovers(folder: Path, prefix: str = ".") -> None:
    """Remove what killed writers left in `folder`: the temporary files and folders (names starting with `prefix`)
    whose process has ended. Readers ignore them; this gives the space back."""
    with suppress(OSError):
        for path in folder.iterdir():
            if path.name.startswith(prefix) and is_temporary(path) and _writer_gone(path):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


Built = TypeVar("Built")


class _Dropped(Exception):
    """The staged folder is not to replace `out`."""


def staged_build(out: Path, make: Callable[[Path], Built], replaces: Callable[[Built], bool]) -> tuple[Built, bool]:
    """`make(folder)` in a fresh folder beside `out` (outputs.staged_folder) that then takes `out`'s place, unless
    `replaces(result)` is False: then it is dropped and `out` kept. Returns the result and whether it replaced
    `out`. An error or an interrupt drops it too; a kill leaves it, for the next staged build of `out` to remove."""
    remove_leftovers(out.parent, prefix=f".{out.stem}.")
    try:
        with staged_folder(out) as folder:
            result = make(folder)
            if not replaces(result):
                raise _Dropped
    except _Dropped:
        return result, False
    return result, True


def record_shards(out: Path) -> dict[str, dict[str, object]]:
    """Records (sample.shard_record) of the readable shards now in `out`'s split folders, for converters that
    write their shards first and the manifest after."""
    records = {}
    for split in SPLITS:
        for shard in shards_on_disk(out, split):
            check: ShardCheck = check_shard(out, shard, None)
            if check.ok and check.samples is not None:
                records[shard] = shard_record((out / shard).read_bytes(), check.samples)
    return records


def write_manifest(
    out: Path,
    settings: dict[str, object],
    complete: bool,
    counts: dict[str, object],
    shards: dict[str, dict[str, object]] | None = None,
) -> None:
    """Write the manifest atomically. `shards` are the shard records (sample.SHARDS); None records the
    readable shards in the folder now (record_shards)."""
    records = record_shards(out) if shards is None else shards
    manifest = {
        "format": DATASET_FORMAT,
        "version": MANIFEST_VERSION,
        "settings": settings,
        "complete": complete,
        **counts,
        SHARDS: {shard: records[shard] for shard in sorted(records)},
    }
    write_bytes(out / MANIFEST, json.dumps(manifest, indent=2).encode())


def run_episode(root: str, job: EpisodeJob) -> EpisodeResult:
    """Simulate one episode and write its shard; errors are returned, not raised."""
    start = time.perf_counter()
    try:
        from fastddrive.data.highway import build_sample, sample_steps, simulate_episode

        log = simulate_episode(job.scenario, job.seed, raters=job.raters)
        samples = [build_sample(log, k) for k in sample_steps(log)]
        record = write_shard(Path(root) / job.shard, samples)
        return EpisodeResult(job, len(samples), time.perf_counter() - start, log.end_reason, record=record)
    except Exception:  # noqa: BLE001 - a failed episode is reported, the build goes on
        return EpisodeResult(job, 0, time.perf_counter() - start, error=traceback.format_exc(limit=4))


def _kept_episodes(
    out: Path, jobs: list[EpisodeJob], manifest: dict[str, object]
) -> tuple[dict[str, dict[str, object]], dict[str, str], list[EpisodeJob], list[str]]:
    """What an earlier run left: the shard records and end reasons to keep, the episodes to simulate (again),
    and for each shard found bad, "shard problem".

    A shard is kept when it matches its record (size and sha256) and its episode's end reason is recorded;
    the records of bad shards stay in the manifest until they are rebuilt, so readers keep naming them. A
    dataset from before shards were recorded has its readable shards adopted (recorded now)."""
    before = manifest.get(SHARDS)
    ends_before = manifest.get("end_reasons") or {}
    complete = bool(manifest.get("complete"))
    records: dict[str, dict[str, object]] = {}
    ends: dict[str, str] = {}
    todo, problems = [], []
    for job in jobs:
        key, path = _episode_key(job), out / job.shard
        record = before.get(job.shard) if isinstance(before, dict) else None
        if record is None and not path.exists():
            if complete:  # a dataset from before shards were recorded lists its shards by its settings
                problems.append(f"{job.shard} is missing")
            todo.append(job)
            continue
        if before is not None and record is None:
            problems.append(f"{job.shard} is not recorded in the manifest")
            todo.append(job)
            continue
        check = check_shard(out, job.shard, record)
        if record is not None:
            records[job.shard] = record
            if key in ends_before:
                ends[key] = ends_before[key]
        if not check.ok:
            problems.append(f"{job.shard} {check.problem}")
        elif key not in ends_before:
            problems.append(f"{job.shard} has no recorded end reason")
        elif record is None:
            records[job.shard] = shard_record(path.read_bytes(), check.samples or 0)
            ends[key] = ends_before[key]
            continue
        else:
            continue
        todo.append(job)
    return records, ends, todo, problems


EpisodeRunner = Callable[[str, EpisodeJob], EpisodeResult]


def _worker_died(job: EpisodeJob, seconds: float, how: str) -> EpisodeResult:
    return EpisodeResult(job, 0, seconds, error=f"{WORKER_DIED} ({how})")


def overwrite_staging(out: Path) -> Path:
    """Where `build_dataset(..., overwrite=True)` builds the replacement of the data set in `out`: a fixed name
    beside it, so that an interrupted replacement is resumed."""
    return out.with_name(f".{out.name}.overwrite{TEMPORARY_MARK}build")


def build_folder(out: Path, overwrite: bool) -> Path:
    """Where `build_dataset` writes: `out`, or with `overwrite` its `overwrite_staging` when there is something
    to replace in `out` or a replacement to resume."""
    replacing = out.is_dir() and any(out.iterdir()) or overwrite_staging(out).is_dir()
    return overwrite_staging(out) if overwrite and replacing else out


def build_dataset(
    out: str | Path,
    episodes: int,
    seed: int,
    scenarios: list[str],
    workers: int = 1,
    overwrite: bool = False,
    on_start: Callable[[int, int], None] | None = None,
    on_episode: Callable[[EpisodeResult], None] | None = None,
    rater_splits: tuple[str, ...] = RATER_SPLITS,
    on_problem: Callable[[str], None] | None = None,
    episode: EpisodeRunner | None = None,
) -> BuildReport:
    """Generate (or resume, or repair) a dataset in `out`. `on_start(todo, done)` and `on_episode` report
    progress; `on_problem("shard problem")` names, before any work, each shard found missing or damaged
    that will be rebuilt (also in the report's `repaired`).

    The samples of `rater_splits` (val and test) carry simulated raters; the manifest's settings say so.
    Settings and `out` are checked before anything is simulated. With `overwrite`, a data set in `out` is
    replaced only once its replacement is complete (module docstring; the report's `staged` says where an
    unfinished one waits). `episode(root, job)` simulates and writes one episode (default `run_episode`); worker
    processes import it by name.
    """
    from fastddrive.data.highway import check_scenarios

    scenarios = check_scenarios(scenarios)
    check_build_settings(episodes, seed, workers)
    out = Path(out)
    check_folder_destination(out, "--out", owned=(out,))
    unknown = [s for s in rater_splits if s not in SPLITS]
    if unknown:
        raise ValueError(f"unknown split {unknown[0]!r} for raters; known: {', '.join(SPLITS)}")
    jobs = plan_episodes(episodes, seed, scenarios, rater_splits)
    settings = _settings(episodes, seed, scenarios, rater_splits)
    return build_episodes(
        out, jobs, settings, episode or run_episode, workers, overwrite, on_start, on_episode, on_problem
    )


def build_episodes(
    out: str | Path,
    jobs: list[EpisodeJob],
    settings: dict[str, object],
    run: EpisodeRunner,
    workers: int = 1,
    overwrite: bool = False,
    on_start: Callable[[int, int], None] | None = None,
    on_episode: Callable[[EpisodeResult], None] | None = None,
    on_problem: Callable[[str], None] | None = None,
) -> BuildReport:
    """Write (or resume, or repair) the data set of `jobs` in `out`, one shard per job made by `run(root, job)`
    in up to `workers` processes (`run` must then be picklable: worker processes import it by name), as
    `build_dataset` does for the simulator's own episodes (its docstring): `settings` are recorded in the
    manifest, and a data set in `out` with other settings is refused. Other episode sources (the DAgger
    collection) build through it with their own jobs, settings and runner."""
    out = Path(out)
    check_folder_destination(out, "--out", owned=(out,))
    manifest = prepare_output(out, settings, overwrite, refuse_complete=False)
    staging = build_folder(out, overwrite)
    if staging == out:  # nothing to replace: build (or resume) in place
        return _build_into(out, jobs, settings, manifest, workers, run, on_start, on_episode, on_problem)
    try:
        manifest = prepare_output(staging, settings, overwrite=False, refuse_complete=False)
    except OutputExists:  # left by an overwrite with other settings: start over
        shutil.rmtree(staging)
        manifest = {}
    report = _build_into(staging, jobs, settings, manifest, workers, run, on_start, on_episode, on_problem)
    if not report.complete:
        return replace(report, staged=staging)
    replace_folder(staging, out)
    remove_leftovers(out.parent, prefix=f".{out.stem}.")  # a data set replaced by a run killed mid-swap
    return report


def _build_into(
    out: Path,
    jobs: list[EpisodeJob],
    settings: dict[str, object],
    manifest: dict[str, object],
    workers: int,
    run: EpisodeRunner,
    on_start: Callable[[int, int], None] | None,
    on_episode: Callable[[EpisodeResult], None] | None,
    on_problem: Callable[[str], None] | None,
) -> BuildReport:
    """Resume the build of `jobs` in `out`, whose checked `manifest` is given ({} for none)."""
    for split in SPLITS:
        remove_leftovers(out / split)
    planned = {job.shard for job in jobs}
    stray = sorted(shard for split in SPLITS for shard in shards_on_disk(out, split) if shard not in planned)
    if stray:
        raise OutputExists(
            f"{out} holds shard(s) this dataset does not plan ({', '.join(stray[:3])}"
            f"{', ...' if len(stray) > 3 else ''}); remove them or pass --overwrite"
        )
    records, ends, todo, problems = _kept_episodes(out, jobs, manifest)
    if manifest.get("complete") and not todo and not is_temporary(out):
        raise OutputExists(_COMPLETE.format(out=out))
    out.mkdir(parents=True, exist_ok=True)

    def counts() -> dict[str, object]:
        return {"episodes_written": len(records), "end_reasons": {k: ends[k] for k in sorted(ends)}}

    def note(result: EpisodeResult) -> None:
        """Record a finished episode in the manifest at once, so that an interrupt cannot lose it."""
        if result.error is None and result.record is not None:
            records[result.job.shard] = result.record
            ends[_episode_key(result.job)] = result.end_reason
            write_manifest(out, settings, complete=False, counts=counts(), shards=records)

    def deliver(result: EpisodeResult) -> None:
        note(result)
        results.append(result)
        if on_episode:
            on_episode(result)

    write_manifest(out, settings, complete=False, counts=counts(), shards=records)
    if on_problem:
        for problem in problems:
            on_problem(problem)
    if on_start:
        on_start(len(todo), len(jobs) - len(todo))
    start = time.perf_counter()
    results: list[EpisodeResult] = []
    if workers <= 1:
        for job in todo:
            deliver(run(str(out), job))
    else:
        run_in_workers(todo, workers, partial(run, str(out)), deliver, note, _worker_died)
    failed = [r for r in results if r.error is not None]
    complete = not failed and len(records) == len(jobs)
    write_manifest(out, settings, complete=complete, counts=counts(), shards=records)
    return BuildReport(
        episodes=len(jobs),
        skipped=len(jobs) - len(todo),
        samples=sum(r.samples for r in results),
        failed=failed,
        seconds=time.perf_counter() - start,
        repaired=problems,
        complete=complete,
    )
