"""Build a simulator dataset episode by episode, resumably, in parallel worker processes.

Every episode is one parquet shard written atomically into its split's folder, so an interrupted run
picks up where it stopped: the manifest records the settings, and a rerun with the same settings
skips the shards that exist. Splits are by episode (no scene in two splits). A failed episode is
reported and the others still complete; the dataset is marked complete only when none failed.
Val and test episodes also get the simulated raters (data/raters.py) that the WOD-E2E rater feedback
score needs; training episodes do not (nothing trains on them, and they cost several times the episode).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from fastddrive.data.sample import DATASET_FORMAT, MANIFEST, SPLITS, write_shard

# Over every 10 rounds of scenarios: 8 to train, 1 to val, 1 to test; test comes early so that
# small datasets have one.
SPLIT_CYCLE = ("train", "test", "train", "val", "train", "train", "train", "train", "train", "train")
SEED_STRIDE = 100_000
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


@dataclass(frozen=True)
class BuildReport:
    episodes: int
    skipped: int
    samples: int
    failed: list[EpisodeResult]
    seconds: float

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


def _prepare_output(out: Path, settings: dict[str, object], overwrite: bool) -> None:
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
        return
    if not out.exists() or not any(out.iterdir()):
        return
    if not manifest_path.is_file():
        raise OutputExists(f"{out} is not empty and is not a fastddrive dataset; choose another --out")
    manifest = json.loads(manifest_path.read_text())
    existing = manifest.get("settings", {})
    if existing != settings:
        differ = ", ".join(
            f"{k} {existing.get(k)!r} there, {v!r} now" for k, v in settings.items() if existing.get(k) != v
        )
        raise OutputExists(
            f"{out} holds a dataset made with other settings ({differ}); "
            "pass --overwrite to replace it or choose another --out"
        )
    if manifest.get("complete"):
        raise OutputExists(f"{out} already holds this complete dataset; pass --overwrite to regenerate it")


def _write_manifest(out: Path, settings: dict[str, object], complete: bool, counts: dict[str, int]) -> None:
    manifest = {"format": DATASET_FORMAT, "version": 1, "settings": settings, "complete": complete, **counts}
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / MANIFEST)


def run_episode(root: str, job: EpisodeJob) -> EpisodeResult:
    """Simulate one episode and write its shard; errors are returned, not raised."""
    start = time.perf_counter()
    try:
        from fastddrive.data.highway import build_sample, sample_steps, simulate_episode

        log = simulate_episode(job.scenario, job.seed, raters=job.raters)
        samples = [build_sample(log, k) for k in sample_steps(log)]
        write_shard(Path(root) / job.shard, samples)
        return EpisodeResult(job, len(samples), time.perf_counter() - start, log.end_reason)
    except Exception:  # noqa: BLE001 - a failed episode is reported, the build goes on
        return EpisodeResult(job, 0, time.perf_counter() - start, error=traceback.format_exc(limit=4))


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
) -> BuildReport:
    """Generate (or resume) a dataset in `out`. `on_start(todo, done)` and `on_episode` report progress.

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
    _prepare_output(out, settings, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    kept = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    _write_manifest(out, settings, complete=False, counts={"end_reasons": kept.get("end_reasons", {})})

    todo = [j for j in jobs if not (out / j.shard).is_file()]
    if on_start:
        on_start(len(todo), len(jobs) - len(todo))
    start = time.perf_counter()
    results: list[EpisodeResult] = []
    if workers <= 1:
        for job in todo:
            results.append(run_episode(str(out), job))
            if on_episode:
                on_episode(results[-1])
    else:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        try:
            futures = [pool.submit(run_episode, str(out), job) for job in todo]
            for future in as_completed(futures):
                results.append(future.result())
                if on_episode:
                    on_episode(results[-1])
        finally:
            # On Ctrl-C stop at once: queued episodes are cancelled, not run (a rerun resumes them).
            pool.shutdown(wait=True, cancel_futures=True)
    failed = [r for r in results if r.error is not None]
    previous = json.loads(manifest_path.read_text()).get("end_reasons", {})
    ends = {f"{r.job.index:05d}-{r.job.scenario}": r.end_reason for r in results if r.error is None}
    counts = {"episodes_written": len(jobs) - len(failed), "end_reasons": {**previous, **ends}}
    _write_manifest(out, settings, complete=not failed, counts=counts)
    return BuildReport(
        episodes=len(jobs),
        skipped=len(jobs) - len(todo),
        samples=sum(r.samples for r in results),
        failed=failed,
        seconds=time.perf_counter() - start,
    )
