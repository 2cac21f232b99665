"""Build a simulator dataset episode by episode, resumably, in parallel worker processes.

Every episode is one parquet shard written atomically into its split's folder. The manifest records the
settings and, as each episode finishes, its shard's size, sha256 and sample count and the episode's end
reason (rewritten atomically), so an interrupted run loses nothing it finished: a rerun with the same
settings keeps every shard that matches its record and simulates the rest again, which also rebuilds
missing or damaged shards of a complete dataset (episodes are seeded, so byte for byte the same). Splits
are by episode (no scene in two splits). A failed episode is reported and the others still complete; the
dataset is marked complete only when none failed.
Val and test episodes also get the simulated raters (data/raters.py) that the WOD-E2E rater feedback
score needs; training episodes do not (nothing trains on them, and they cost several times the episode).
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from fastddrive.data.sample import (
    DATASET_FORMAT,
    MANIFEST,
    SHARDS,
    SPLITS,
    ShardCheck,
    check_shard,
    shard_record,
    write_shard,
)
from fastddrive.outputs import write_bytes

# Over every 10 rounds of scenarios: 8 to train, 1 to val, 1 to test; test comes early so that
# small datasets have one.
SPLIT_CYCLE = ("train", "test", "train", "val", "train", "train", "train", "train", "train", "train")
SEED_STRIDE = 100_000
MANIFEST_VERSION = 2  # 2: the manifest records every shard (SHARDS); 1: it did not
RATER_SPLITS = ("val", "test")  # the splits that are scored with the rater feedback score


class OutputExists(FileExistsError):
    """The output folder already holds something that generating would overwrite."""


@dataclass(frozen=True)
class EpisodeJob:
    index: int
    scenario: str
    seed: int
    split: str
    shard: str  # path relative to the dataset root
    raters: bool = False  # roll out and score the simulated raters for every sample


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

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


def plan_episodes(
    episodes: int, seed: int, scenarios: list[str], rater_splits: tuple[str, ...] = RATER_SPLITS
) -> list[EpisodeJob]:
    """Episode i uses scenario i mod S and seed `seed * 100000 + i`; its split follows SPLIT_CYCLE.

    Episodes in `rater_splits` (val and test by default) get the simulated raters; training ones do not.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if episodes > SEED_STRIDE:
        raise ValueError(f"at most {SEED_STRIDE} episodes per seed")
    jobs = []
    for i in range(episodes):
        scenario = scenarios[i % len(scenarios)]
        split = SPLIT_CYCLE[(i // len(scenarios)) % len(SPLIT_CYCLE)]
        episode_seed = seed * SEED_STRIDE + i
        shard = f"{split}/{i:05d}-{scenario}-{episode_seed}.parquet"
        jobs.append(EpisodeJob(i, scenario, episode_seed, split, shard, raters=split in rater_splits))
    return jobs


def planned_shards(settings: dict[str, object]) -> list[str] | None:
    """The shards (relative paths) that a simulator dataset's manifest settings plan; None for another source."""
    if settings.get("source") != "highway-env":
        return None
    try:
        jobs = plan_episodes(int(settings["episodes"]), int(settings["seed"]), list(settings["scenarios"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return [job.shard for job in jobs]


def _episode_key(job: EpisodeJob) -> str:
    return f"{job.index:05d}-{job.scenario}"


def _settings(episodes: int, seed: int, scenarios: list[str], rater_splits: tuple[str, ...]) -> dict[str, object]:
    from fastddrive.data.highway import FRAME_SIZE_PX, SIMULATION_HZ
    from fastddrive.data.raters import DRIVERS, RULE_VERSION

    return {
        "source": "highway-env",
        "highway_env_version": version("highway-env"),
        "episodes": episodes,
        "seed": seed,
        "scenarios": scenarios,
        "frame_size_px": list(FRAME_SIZE_PX),
        "simulation_hz": SIMULATION_HZ,
        # Which splits carry simulated raters, and by which drivers and score rule (data/raters.py).
        "raters": {
            "splits": [s for s in SPLITS if s in rater_splits],
            "drivers": list(DRIVERS),
            "rule_version": RULE_VERSION,
        },
    }


def prepare_output(
    out: Path, settings: dict[str, object], overwrite: bool, refuse_complete: bool = True
) -> dict[str, object]:
    """Check (or with `overwrite` clear) the output folder; returns the manifest of the dataset it holds with
    the same settings ({} for none). A complete one is refused unless `refuse_complete` is False."""
    manifest_path = out / MANIFEST
    if out.exists() and not out.is_dir():
        raise OutputExists(f"{out} exists and is not a directory")
    if overwrite:
        if out.exists() and any(out.iterdir()) and not manifest_path.is_file():
            raise OutputExists(f"{out} is not empty and is not a fastddrive dataset; refusing to delete it")
        if manifest_path.is_file():
            for split in SPLITS:
                shutil.rmtree(out / split, ignore_errors=True)
            manifest_path.unlink()
        return {}
    if not out.exists() or not any(out.iterdir()):
        return {}
    if not manifest_path.is_file():
        raise OutputExists(f"{out} is not empty and is not a fastddrive dataset; choose another --out")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise OutputExists(
            f"{manifest_path} is not valid JSON ({err.msg}); pass --overwrite to replace the dataset"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != DATASET_FORMAT:
        raise OutputExists(f"{out} is not a fastddrive dataset; choose another --out")
    existing = manifest.get("settings", {})
    if existing != settings:
        differ = ", ".join(
            f"{k} {existing.get(k)!r} there, {v!r} now" for k, v in settings.items() if existing.get(k) != v
        )
        raise OutputExists(
            f"{out} holds a dataset made with other settings ({differ}); "
            "pass --overwrite to replace it or choose another --out"
        )
    if refuse_complete and manifest.get("complete"):
        raise OutputExists(_COMPLETE.format(out=out))
    return manifest


_COMPLETE = "{out} already holds this complete dataset; pass --overwrite to regenerate it"


def record_shards(out: Path) -> dict[str, dict[str, object]]:
    """Records (sample.shard_record) of the readable shards now in `out`'s split folders, for converters that
    write their shards first and the manifest after."""
    records = {}
    for split in SPLITS:
        for path in sorted((out / split).glob("*.parquet")):
            shard = f"{split}/{path.name}"
            check: ShardCheck = check_shard(out, shard, None)
            if check.ok and check.samples is not None:
                records[shard] = shard_record(path.read_bytes(), check.samples)
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
) -> BuildReport:
    """Generate (or resume, or repair) a dataset in `out`. `on_start(todo, done)` and `on_episode` report
    progress; `on_problem("shard problem")` names, before any work, each shard found missing or damaged
    that will be rebuilt (also in the report's `repaired`).

    The samples of `rater_splits` (val and test) carry simulated raters; the manifest's settings say so.
    """
    from fastddrive.data.highway import check_scenarios

    check_scenarios(scenarios)
    out = Path(out)
    unknown = [s for s in rater_splits if s not in SPLITS]
    if unknown:
        raise ValueError(f"unknown split {unknown[0]!r} for raters; known: {', '.join(SPLITS)}")
    jobs = plan_episodes(episodes, seed, scenarios, rater_splits)
    settings = _settings(episodes, seed, scenarios, rater_splits)
    manifest = prepare_output(out, settings, overwrite, refuse_complete=False)
    planned = {job.shard for job in jobs}
    on_disk = [f"{split}/{p.name}" for split in SPLITS for p in (out / split).glob("*.parquet")]
    stray = sorted(shard for shard in on_disk if shard not in planned)
    if stray:
        raise OutputExists(
            f"{out} holds shard(s) this dataset does not plan ({', '.join(stray[:3])}"
            f"{', ...' if len(stray) > 3 else ''}); remove them or pass --overwrite"
        )
    records, ends, todo, problems = _kept_episodes(out, jobs, manifest)
    if manifest.get("complete") and not todo:
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
            result = run_episode(str(out), job)
            note(result)
            results.append(result)
            if on_episode:
                on_episode(result)
    else:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        futures = []
        noted: set[int] = set()
        try:
            futures = [pool.submit(run_episode, str(out), job) for job in todo]
            for future in as_completed(futures):
                result = future.result()
                note(result)
                noted.add(id(future))
                results.append(result)
                if on_episode:
                    on_episode(result)
        finally:
            # On Ctrl-C stop at once: queued episodes are cancelled, not run (a rerun resumes them); the
            # episodes that finish meanwhile are recorded.
            pool.shutdown(wait=True, cancel_futures=True)
            for future in futures:
                if id(future) not in noted and future.done() and not future.cancelled() and not future.exception():
                    note(future.result())
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
    )
