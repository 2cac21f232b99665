"""A closed-loop run: settings checked before any costly work, every planner on the same episodes (in one process,
or in `workers` processes side by side), each episode's result written atomically as it finishes, so that Ctrl-C
keeps what is done and a re-run with the same settings resumes; then the rows, the table and the PNG summary.

Episode j of scenario s uses the seed the data generator gives its episode i = j * 5 + (the index of s among
the five default scenarios) for `seed` (seed * 100000 + i), whichever scenarios are chosen; a reactive
scenario's index is its place among the four reactive ones. The default seed, 7, is none the embedded model
was trained on.
"""

from __future__ import annotations

import hashlib
import json
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fastddrive.core.outputs import check_folder_destination, write_bytes
from fastddrive.core.sample import HISTORY_COLUMNS, HISTORY_STEPS
from fastddrive.core.schema import NUM_WAYPOINTS, WAYPOINT_INTERVAL_S
from fastddrive.core.training_episodes import training_episodes
from fastddrive.core.worker_pool import run_in_workers
from fastddrive.data.build import WORKER_DIED, check_workers_memory, usable_cpus, workers_problem
from fastddrive.data.episodes import MAX_SEED, SEED_STRIDE
from fastddrive.data.highway import DEFAULT_SCENARIOS, FRAME_SIZE_PX, REACTIVE_SCENARIOS, check_scenarios
from fastddrive.decode.registry import parse_decoder_spec, split_decoders
from fastddrive.drive import DriveError
from fastddrive.drive.closed_loop import HANDOVER_S, RECORD_S, EpisodeTrace, drive_episode
from fastddrive.drive.latency import Latency, parse_latency
from fastddrive.drive.metrics import episode_metrics
from fastddrive.drive.policies import (
    CONSTANT_VELOCITY,
    EXPERT_DRIVES,
    EXPERT_PLANS,
    REFERENCES,
    ConstantVelocityPolicy,
    DecoderPolicy,
    ExpertPolicy,
    Policy,
)
from fastddrive.drive.summary import draw_summary, summarise
from fastddrive.drive.video import gif_path, safe_name, write_gif
from fastddrive.planner import Planner

RESULT_VERSION = 3  # bump when an episode's result would change for the same settings: old ones are not reused
MAX_REPLAN_S = NUM_WAYPOINTS * WAYPOINT_INTERVAL_S  # a plan covers 5 s
SEEDS_PER_EPISODE = len(DEFAULT_SCENARIOS)  # episode j of a scenario: seeds 5 j + index
MAX_DURATION_S = 300.0  # 7.5 times the longest scenario; a video holds 4 frames a second of it


class DriveSettings(BaseModel):
    """A run's settings, checked; `check_settings` builds it from user input."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    model: str = "default"
    decoders: tuple[str, ...] = ("ss",)
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    episodes: int = Field(1, ge=1, le=SEED_STRIDE // SEEDS_PER_EPISODE)
    seed: int = 7
    latency: Latency = Latency("measured")
    replan_s: float = 0.5
    duration_s: float | None = None  # None: each scenario's own duration (40 s; the intersection 25 s)
    references: bool = True
    device: str = "cpu"
    out: Path = Path("runs/drive")
    video: Path | None = None
    # With --held-out: the episodes the model was trained on (training_episodes_driven), left out for every planner.
    skipped: tuple[tuple[str, int], ...] = ()
    workers: int = 1  # processes driving episodes side by side (check_settings bounds it)

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int) -> int:
        if not 0 <= value <= MAX_SEED:
            raise ValueError(
                f"{value} is out of range: give 0 to {MAX_SEED} (episode j of scenario s is seeded "
                f"seed * {SEED_STRIDE} + 5 j + s, a non-negative 64-bit integer)"
            )
        return value

    @field_validator("replan_s")
    @classmethod
    def _replan(cls, value: float) -> float:
        steps = value / RECORD_S
        if not 0 < value <= MAX_REPLAN_S or abs(steps - round(steps)) > 1e-9:
            raise ValueError(f"must be a positive multiple of {RECORD_S} s, at most {MAX_REPLAN_S} s; got {value}")
        return value

    @field_validator("duration_s")
    @classmethod
    def _duration(cls, value: float | None) -> float | None:
        if value is not None and not HANDOVER_S + RECORD_S < value <= MAX_DURATION_S:
            raise ValueError(
                f"must leave driving time after the {HANDOVER_S} s hand-over and be at most {MAX_DURATION_S:g} s, "
                f"got {value}"
            )
        return value

    @property
    def labels(self) -> list[str]:
        return [*self.decoders, *(REFERENCES if self.references else ())]


def _names(value: str | Sequence[str]) -> list[str]:
    return [v.strip() for v in value.split(",")] if isinstance(value, str) else [v.strip() for v in value]


def drive_settings(**fields: Any) -> DriveSettings:
    """DriveSettings of `fields`; a value out of its range is one DriveError line naming its option."""
    try:
        return DriveSettings(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise DriveError(f"--{where.replace('_', '-')}: {str(first['msg']).removeprefix('Value error, ')}") from None


def check_settings(
    *,
    decoders: str | Sequence[str] = "ss",
    scenarios: str | Sequence[str] = DEFAULT_SCENARIOS,
    latency: str = "measured",
    device: str = "cpu",
    held_out: bool = False,
    **fields: Any,
) -> DriveSettings:
    """Every setting checked before anything is simulated or loaded. The first problem raises one line:
    DecoderError (a decoder or its options), UnknownScenario, LatencyError, DeviceError, DriveError (the rest).
    `held_out` leaves out, for every planner, the episodes that the model records as trained on."""
    from fastddrive.engine.model_files import check_device  # torch and the model code: only to check a device

    specs = split_decoders(decoders) if isinstance(decoders, str) else [s.strip() for s in decoders]
    for spec in specs:
        parse_decoder_spec(spec)
    names = check_scenarios(_names(scenarios))
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DriveError(f"scenario {twice[0]!r} is named twice")
    parsed = parse_latency(latency, specs)
    if specs:
        check_device(device)
    settings = drive_settings(decoders=tuple(specs), scenarios=tuple(names), latency=parsed, device=device, **fields)
    if not settings.labels:
        raise DriveError("nothing to drive: no decoder and no reference planners")
    if held_out:
        settings = settings.model_copy(update={"skipped": tuple(training_episodes_driven(settings))})
        if not plan_jobs(settings):
            raise DriveError(
                f"--held-out leaves nothing to drive: {settings.model} was trained on every episode of "
                f"seed {settings.seed} asked for; choose another --seed"
            )
    check_workers(settings)
    check_destinations(settings)
    return settings


def check_workers(settings: DriveSettings) -> None:
    """DriveError (one line) for a worker count outside 1 to twice the usable CPUs, or above 1 with a measured
    latency (the processes share the CPUs, so each answer's time would not be the decoder's); MemoryBudgetError
    when the workers' copies of the model would not fit."""
    from fastddrive.engine.model_files import model_path, weights_bytes

    workers = settings.workers
    if problem := workers_problem(workers):
        raise DriveError(problem)
    if workers > 1 and settings.decoders and settings.latency.mode == "measured":
        raise DriveError(
            f"--workers {workers} with --latency measured: processes sharing the CPUs would time each other's "
            "answers; give --latency fixed:MS or zero, or --workers 1"
        )
    check_workers_memory(workers, weights_bytes(model_path(settings.model)) if settings.decoders else 0)


def check_destinations(settings: DriveSettings) -> None:
    """OutputError unless the results folder and the video folder can be written: folders (made when missing),
    not the model's folder, a data set or the installed package, nor inside one."""
    from fastddrive.engine.model_files import model_path

    model = model_path(settings.model) if settings.decoders else None
    for option, folder in (("--out", settings.out), ("--video", settings.video)):
        if folder is None:
            continue
        check_folder_destination(folder, option, inputs=(model,), own_folder=True)


@dataclass(frozen=True)
class Job:
    """One episode to drive: a planner (a decoder, or a reference when `decoder` is None) on a scenario and seed."""

    label: str
    decoder: str | None  # None for a reference planner
    scenario: str
    seed: int


@dataclass
class EpisodeOutcome:
    """What one episode gave: its metrics, or the traceback of a crash (the other episodes complete)."""

    job: Job
    result: dict[str, Any] | None
    error: str | None = None  # the traceback of an episode that crashed


@dataclass
class DriveReport:
    """A finished `drive` run: one row per planner (the `--json` rows), every outcome, the failures, the summary PNG."""

    settings: DriveSettings
    rows: list[dict[str, Any]]
    outcomes: list[EpisodeOutcome]
    summary_png: Path
    seconds: float
    failures: list[EpisodeOutcome] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        settings = {
            "model": s.model,
            "decoders": list(s.decoders),
            "scenarios": list(s.scenarios),
            "episodes": s.episodes,
            "seed": s.seed,
            "latency": s.latency.mode,
            "fixed_ms": s.latency.fixed_ms,
            "replan_s": s.replan_s,
            "duration_s": s.duration_s,
            "device": s.device,
            "workers": s.workers,
            "training_episodes_driven": [
                {"scenario": name, "seed": seed} for name, seed in training_episodes_driven(s)
            ],
            "training_episodes_skipped": [{"scenario": name, "seed": seed} for name, seed in s.skipped],
        }
        return {"settings": settings, "rows": self.rows}


def episode_seed(seed: int, scenario: str, episode: int) -> int:
    """The seed of episode `episode` of `scenario`: `seed * 100000 + 5 * episode + (index of the scenario)`
    among the default five, or among the reactive four."""
    family = DEFAULT_SCENARIOS if scenario in DEFAULT_SCENARIOS else tuple(REACTIVE_SCENARIOS)
    return seed * SEED_STRIDE + episode * SEEDS_PER_EPISODE + family.index(scenario)


def plan_jobs(settings: DriveSettings) -> list[Job]:
    """Episode-major, so that an interrupted run has every planner on the same finished episodes; the episodes
    `skipped` (--held-out) by none."""
    decoders, skipped = set(settings.decoders), set(settings.skipped)
    episodes = [
        (scenario, episode_seed(settings.seed, scenario, j))
        for j in range(settings.episodes)
        for scenario in settings.scenarios
    ]
    return [
        Job(label, label if label in decoders else None, scenario, seed)
        for scenario, seed in episodes
        if (scenario, seed) not in skipped
        for label in settings.labels
    ]


def training_episodes_driven(settings: DriveSettings) -> list[tuple[str, int]]:
    """The (scenario, seed) of the run's episodes that its model's fastddrive.json records as trained on
    (core/training_episodes.py), in driving order: their scores are not held-out figures. Empty without a
    decoder; a malformed record is a ModelFileError."""
    if not settings.decoders:
        return []
    from fastddrive.engine.model_files import model_path, read_info

    trained = training_episodes(read_info(model_path(settings.model)).extra)
    episodes = dict.fromkeys((job.scenario, job.seed) for job in plan_jobs(settings))
    return [episode for episode in episodes if episode in trained]


def result_path(settings: DriveSettings, job: Job) -> Path:
    """Where a job's result lives: named by everything the result depends on (references do not depend on
    the model or the latency, so a run under another latency reuses them)."""
    key = {
        "version": RESULT_VERSION,
        "label": job.label,
        "scenario": job.scenario,
        "seed": job.seed,
        "replan_s": settings.replan_s,
        "duration_s": settings.duration_s,
        "latency": settings.latency.describe(job.decoder),
    }
    if job.decoder is not None:
        key |= {"model": settings.model, "device": settings.device}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return settings.out / "episodes" / f"{safe_name(job.label)}-{job.scenario}-{job.seed}-{digest}.json"


def episode_result(trace: EpisodeTrace, decoder: str | None, latency: str) -> dict[str, Any]:
    """What is kept of an episode: its metrics and the timing of every question asked."""
    metrics = episode_metrics(
        np.array(trace.speed_mps),
        np.array(trace.heading_rad),
        np.array(trace.ttc_s),
        np.array(trace.progress_m),
        trace.goal_m,
        trace.end_reason,
        RECORD_S,
    )
    plans = [[p.asked_s, p.due_s, p.active_s, p.charged_ms, p.measured_ms, p.wall_s, int(p.valid)] for p in trace.plans]
    return {
        "label": trace.label,
        "decoder": decoder,
        "scenario": trace.scenario,
        "seed": trace.seed,
        "latency": latency,
        "end_reason": trace.end_reason,
        "goal_m": trace.goal_m,
        "metrics": metrics,
        "plans": plans,
    }


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # missing or damaged: the episode is driven again


def warm_up(policies: dict[str, Policy]) -> None:
    """One untimed answer per decoder: the first call of a process pays one-off costs a car would not."""
    frame = np.zeros((FRAME_SIZE_PX[1], FRAME_SIZE_PX[0], 3), dtype=np.uint8)
    history = np.zeros((HISTORY_STEPS, len(HISTORY_COLUMNS)))
    for policy in policies.values():
        if isinstance(policy, DecoderPolicy):
            policy.planner.plan(
                decoder=policy.name, images=[frame], history=history, command="go_straight", **policy.options
            )


def make_policies(
    settings: DriveSettings, planner: Planner | None, decoders: bool, warm: bool
) -> dict[str, Policy | None]:
    """The planners of a run: the references and, with `decoders`, one DecoderPolicy per decoder answered by
    `planner` (else `settings.model`, loaded), given one untimed answer each with `warm`."""
    policies: dict[str, Policy | None] = {
        EXPERT_DRIVES: None,
        EXPERT_PLANS: ExpertPolicy(settings.replan_s),
        CONSTANT_VELOCITY: ConstantVelocityPolicy(),
    }
    if not decoders or not settings.decoders:
        return policies
    if planner is None:
        from fastddrive.planner import load

        planner = load(settings.model, device=settings.device)
    for spec in settings.decoders:
        name, options = parse_decoder_spec(spec)
        policies[spec] = DecoderPolicy(planner, spec, name, options)
    if warm:
        warm_up(policies)
    return policies


def drive_job(settings: DriveSettings, policies: dict[str, Policy | None], job: Job) -> EpisodeOutcome:
    """Drive one episode and write its result (and its GIF) atomically; a crash is the outcome's traceback."""
    latency = settings.latency.describe(job.decoder)
    try:
        trace = drive_episode(
            job.scenario,
            job.seed,
            policies[job.label],
            lambda p, decoder=job.decoder: settings.latency.charge_ms(decoder, p.measured_ms),
            replan_s=settings.replan_s,
            duration_s=settings.duration_s,
            video=settings.video is not None,
        )
        result = episode_result(trace, job.decoder, latency)
        write_bytes(result_path(settings, job), json.dumps(result, allow_nan=False).encode())
        if settings.video is not None:
            write_gif(trace, gif_path(settings.video, job.label, latency, job.scenario, job.seed))
        return EpisodeOutcome(job, result)
    except Exception:  # one episode's crash is reported; the others go on
        return EpisodeOutcome(job, None, traceback.format_exc())


@dataclass(frozen=True)
class EpisodeDriver:
    """A worker process's task: `drive_job` with the process's own planners, made once, on its first episode
    (picklable: `planner`, when given, is copied into each process; else each loads `settings.model`)."""

    settings: DriveSettings
    planner: Planner | None = None
    decoders: bool = True  # whether any episode to drive is a decoder's (else no model is loaded)
    threads: int = 1  # torch threads of a worker: the usable CPUs shared out

    @cached_property
    def policies(self) -> dict[str, Policy | None]:
        if self.decoders:
            import torch
            import transformers

            torch.set_num_threads(self.threads)
            # Worker processes do not import the command line, which turns transformers' "Loading weights" bar
            # off: it would break into the progress bar.
            transformers.utils.logging.disable_progress_bar()
        # warmed up whatever the latency: the rows report each answer's measured time, not a cold first call's
        return make_policies(self.settings, self.planner, self.decoders, warm=True)

    def __call__(self, job: Job) -> EpisodeOutcome:
        return drive_job(self.settings, self.policies, job)


def _worker_died(job: Job, seconds: float, how: str) -> EpisodeOutcome:
    return EpisodeOutcome(job, None, f"{WORKER_DIED} ({how})")


def run_drive(
    settings: DriveSettings,
    planner: Planner | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_episode: Callable[[EpisodeOutcome], None] | None = None,
) -> DriveReport:
    """Drive every planner of `settings` on the same episodes; `planner` (else `settings.model` is loaded)
    answers for the decoders. on_start(todo, already done) once, on_episode(outcome) after each episode. With
    `settings.workers` above 1 the episodes are driven in that many processes (`EpisodeDriver`), with the same
    results and the outcomes in the same order."""
    began = time.perf_counter()
    jobs = plan_jobs(settings)
    outcomes, todo = [], []
    for job in jobs:
        stored = _read(result_path(settings, job))
        if stored is None:
            todo.append(job)
        else:
            outcomes.append(EpisodeOutcome(job, stored))
    if on_start is not None:
        on_start(len(todo), len(outcomes))
    decoders = any(job.decoder for job in todo)
    if settings.workers > 1 and len(todo) > 1:
        driver = EpisodeDriver(settings, planner, decoders, threads=max(1, usable_cpus() // settings.workers))

        def deliver(outcome: EpisodeOutcome) -> None:
            outcomes.append(outcome)
            if on_episode is not None:
                on_episode(outcome)

        run_in_workers(todo, settings.workers, driver, deliver, outcomes.append, _worker_died)
    else:
        policies = make_policies(settings, planner, decoders, warm=settings.latency.mode == "measured")
        for job in todo:
            outcomes.append(drive_job(settings, policies, job))
            if on_episode is not None:
                on_episode(outcomes[-1])
    order = {job: i for i, job in enumerate(jobs)}
    outcomes.sort(key=lambda outcome: order[outcome.job])  # as one process drives them, whatever finished first
    results = [o.result for o in outcomes if o.result is not None]
    failures = [o for o in outcomes if o.error is not None]
    failed = {label: sum(o.job.label == label for o in failures) for label in settings.labels}
    rows = summarise(results, settings.labels, failed)
    png = draw_summary(rows, settings.out / "summary.png", title=title(settings))
    return DriveReport(settings, rows, outcomes, png, time.perf_counter() - began, failures)


def title(settings: DriveSettings) -> str:
    """The title of the run's table and PNG."""
    mode = settings.latency.mode + (f" {settings.latency.fixed_ms}" if settings.latency.mode == "fixed" else "")
    episodes = f"{settings.episodes} episode(s) per scenario{held_out_note(settings)}"
    return (
        f"{settings.model}: {episodes}, seed {settings.seed}, latency {mode}, replanning every {settings.replan_s} s "
        f"({settings.device})"
    )


def held_out_note(settings: DriveSettings) -> str:
    """What a title says of the episodes --held-out left out ('' when none)."""
    return f" less {len(settings.skipped)} trained on" if settings.skipped else ""
