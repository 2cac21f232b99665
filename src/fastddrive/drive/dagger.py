"""Closed-loop training data (DAgger, Ross, Gordon and Bagnell, 2011): the planner drives, the expert labels.

A model trained on the expert's own drives only ever saw the states the expert visits; driving, it makes
small errors and reaches states it never saw, where it errs more (the compounding error DAgger addresses).
Here the current planner drives seeded highway-env episodes (closed_loop.drive_episode, as `fastddrive
drive` does) and, at every question it is asked, the state it reached is recorded as a training sample:
- the frame, the ego history and the navigation command are those the planner was given;
- the answer is the expert's from that state: the 5 s rollout of the `expert-plans` reference
  (policies.ExpertPolicy, its decisions carried from one question to the next) in a copy of the simulator,
  that very rollout recorded at 4 Hz as the data generator records an episode, and labelled by the
  generator's rules (critical objects, explanation, meta-behaviour, trajectory: data/highway.build_sample,
  data/labels.py).
As in the generator, a state whose 5 s of expert future reach a crash or the end of the road makes no
sample. Aggregating with the data so far (`fastddrive data merge`) and retraining is one DAgger round.

The data set is written as `fastddrive data highway` writes its own (data/build.build_episodes): episode i
is scenario i mod S with seed `seed * 100000 + i` and the generator's split rule, one shard per episode
written atomically, a manifest recording the settings (the model's files by their sha256, the decoder,
latency, replanning, duration), resumed after an interruption to the same bytes, a failed episode reported
while the others complete. Latency is `zero` or `fixed:MS` on the simulation clock: a measured latency
would make the states visited, and so the data, depend on this machine's load.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastddrive.core.outputs import is_temporary
from fastddrive.core.sample import FUTURE_STEPS, DrivingSample
from fastddrive.core.schema import NUM_WAYPOINTS, WAYPOINT_INTERVAL_S
from fastddrive.data.build import (
    BuildReport,
    EpisodeResult,
    build_episodes,
    check_build_settings,
    simulator_settings,
)
from fastddrive.data.dataset import write_shard
from fastddrive.data.episodes import EpisodeJob, plan_episodes
from fastddrive.data.expert import STEP_HZ, ExpertVehicle
from fastddrive.data.highway import (
    EpisodeLog,
    Step,
    build_sample,
    check_scenarios,
    end_of_road,
    frame_geometry,
    record_step,
    route_turn_rad,
)
from fastddrive.decode.registry import parse_decoder_spec
from fastddrive.drive import DriveError
from fastddrive.drive.closed_loop import EpisodeTrace, drive_episode
from fastddrive.drive.latency import Latency, parse_latency
from fastddrive.drive.policies import DecoderPolicy, ExpertPolicy, Observation, Policy, Proposal
from fastddrive.drive.run import drive_settings

SOURCE = "dagger"  # the manifest's settings.source
LABEL_VERSION = 1  # bump when the labels of a visited state would change: a data set records it
LATENCIES = ("zero", "fixed:MS")
ROLLOUT_STEPS = NUM_WAYPOINTS * round(WAYPOINT_INTERVAL_S * STEP_HZ)  # ExpertPolicy's 5 s at 4 Hz
assert ROLLOUT_STEPS == FUTURE_STEPS  # its steps are the future's points, one for one


class _Rollout:
    """The steps of one expert rollout, recorded as the generator records an episode (`steps`), and whether the
    generator would make a sample of its first (`usable`: no crash within the 5 s, the road ending at their
    last point at the earliest, as highway.sample_steps). Called with the rollout's world before its first step
    and after each (ExpertPolicy.propose's `watch`)."""

    def __init__(self, turn_rad: float, planned: bool) -> None:
        self.turn_rad, self.planned = turn_rad, planned
        self.steps: list[Step] = []
        self.usable = True
        self.lane: tuple = ()
        # Cars are keyed by id(), as in the generator: holding every car until the rollout ends stops a car
        # spawned later from reusing a departed one's id.
        self.alive: dict[int, Any] = {}

    def __call__(self, world: Any) -> None:
        driver = world.vehicle
        self.alive.update((id(v), v) for v in world.road.vehicles)
        if not self.steps:  # the state asked about: the command is the planner's, read off the car it drives
            self.steps.append(record_step(world, driver, driver.lane_index, self.turn_rad))
            self.usable = not end_of_road(driver, self.planned)
        else:
            self.steps.append(record_step(world, driver, self.lane))
            last = len(self.steps) == ROLLOUT_STEPS + 1
            self.usable &= not driver.crashed and (last or not end_of_road(driver, self.planned))
        self.lane = driver.lane_index


class ExpertLabeller:
    """The expert's answer at the states a planner visits, as training samples (module docstring): the
    `expert-plans` reference (policies.ExpertPolicy) answers each state, its rollout recorded step by step."""

    def __init__(self, scenario: str, seed: int, replan_s: float, tag: str = SOURCE) -> None:
        self.scenario, self.seed, self.tag = scenario, seed, tag
        self.expert = ExpertPolicy(replan_s)  # its decisions carry from one question to the next
        self.planned = False

    def start(self, expert: ExpertVehicle) -> None:
        """A new episode; `expert` is the driver the planner takes over from."""
        self.expert.start(expert)
        # The generator ends an episode at the end of its planned route (highway._end_of_road); the route is
        # the expert's from the start, shortened only as it leaves roads, so it is still there at the hand-over.
        self.planned = bool(expert.route)

    def label(self, observation: Observation) -> DrivingSample | None:
        """The sample of the state the planner is asked about, labelled with the expert's 5 s rollout from it in
        a copy of the simulator; None when that future reaches a crash or the end of the road."""
        rollout = _Rollout(route_turn_rad(observation.sim.vehicle), self.planned)
        self.expert.propose(observation, watch=rollout)
        if not rollout.usable:
            return None
        steps = rollout.steps
        steps[0].frame = observation.frame
        now = round(observation.time_s * STEP_HZ)  # the step index the generator gives this time
        pixels_per_metre, ego_pixel = frame_geometry(observation.sim)
        # build_sample reads the past only for the history, which is replaced by the planner's own below.
        log = EpisodeLog(self.scenario, self.seed, [steps[0]] * now + steps, pixels_per_metre=pixels_per_metre)
        log.ego_pixel = ego_pixel
        sample = build_sample(log, now)
        return replace(
            sample,
            sample_id=f"{self.scenario}-{self.seed}-{round(observation.time_s * 1000):06d}ms-{self.tag}",
            history=observation.history,
        )


class RecordingPolicy:
    """Drives as `policy` does; at each question it is asked, the expert's labelled sample of that state is kept
    (`samples`), or counted in `skipped` when the generator's rules make none."""

    def __init__(self, policy: Policy, labeller: ExpertLabeller) -> None:
        self.policy, self.labeller = policy, labeller
        self.label, self.decoder = policy.label, policy.decoder
        self.samples: list[DrivingSample] = []
        self.skipped = 0

    def start(self, expert: ExpertVehicle) -> None:
        self.policy.start(expert)
        self.labeller.start(expert)

    def propose(self, observation: Observation) -> Proposal:
        sample = self.labeller.label(observation)  # a copy of the world: the drive itself is untouched
        if sample is None:
            self.skipped += 1
        else:
            self.samples.append(sample)
        return self.policy.propose(observation)


@dataclass
class DaggerEpisode:
    """One collected episode: its samples in the order asked, the questions without one, the drive itself."""

    samples: list[DrivingSample]
    skipped: int
    trace: EpisodeTrace


def collect_episode(
    scenario: str,
    seed: int,
    policy: Policy,
    latency_ms: Callable[[Proposal], float] = lambda proposal: 0.0,
    replan_s: float = 0.5,
    duration_s: float | None = None,
    tag: str = SOURCE,
) -> DaggerEpisode:
    """Drive one seeded episode with `policy` and label every state it is asked about (module docstring);
    `tag` ends every sample id, telling apart the samples of several rounds' models."""
    recorder = RecordingPolicy(policy, ExpertLabeller(scenario, seed, replan_s, tag))
    trace = drive_episode(scenario, seed, recorder, latency_ms, replan_s=replan_s, duration_s=duration_s)
    return DaggerEpisode(recorder.samples, recorder.skipped, trace)


# --- the data set -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DaggerSettings:
    """A collection's settings, checked (`check_dagger_settings`)."""

    model: str
    decoder: str
    episodes: int
    seed: int
    scenarios: tuple[str, ...]
    replan_s: float = 0.5
    duration_s: float | None = None
    latency: Latency = field(default_factory=lambda: Latency("zero"))
    device: str = "cpu"

    def charge_ms(self, proposal: Proposal, decoder: str | None) -> float:
        """The simulated time an answer of `decoder` costs (None: a reference planner, free)."""
        return self.latency.charge_ms(decoder, proposal.measured_ms)


def check_dagger_settings(
    *,
    model: str,
    decoder: str,
    episodes: int,
    seed: int,
    scenarios: str | Sequence[str],
    replan_s: float = 0.5,
    duration_s: float | None = None,
    latency: str = "zero",
    device: str = "cpu",
    workers: int = 1,
) -> DaggerSettings:
    """Every setting checked before anything is loaded or simulated; the first problem is one line
    (DecoderError, UnknownScenario, DataSettingsError, LatencyError, DeviceError, DriveError)."""
    from fastddrive.engine.model_files import check_device

    parse_decoder_spec(decoder)
    names = [s.strip() for s in scenarios.split(",") if s.strip()] if isinstance(scenarios, str) else list(scenarios)
    names = check_scenarios(names)
    check_build_settings(episodes, seed, workers)
    parsed = parse_latency(latency, [decoder])
    if parsed.mode == "measured":
        raise DriveError(
            "--latency measured would make the states visited depend on this machine's load, and a resumed "
            f"collection differ from an uninterrupted one; give one of: {', '.join(LATENCIES)}"
        )
    check_device(device)
    # the closed-loop run's own checks of the replanning period and the duration
    drive_settings(decoders=(decoder,), replan_s=replan_s, duration_s=duration_s, references=False)
    return DaggerSettings(model, decoder, episodes, seed, tuple(names), replan_s, duration_s, parsed, device)


def model_folder(name: str) -> Path:
    """The model folder `name` stands for ('default', another embedded name, or a local folder); DriveError if
    there is none."""
    from fastddrive.engine.model_files import model_path

    path = model_path(name)
    if not (path / "config.json").is_file():
        raise DriveError(f"--model {name}: {path} is not a model folder (no config.json)")
    return path


def model_digest(folder: Path) -> str:
    """sha256 over the model folder's files (their names and contents): a collection resumed after the model
    was retrained in place is refused rather than mixing the states of two models."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not is_temporary(p)):
        with path.open("rb") as handle:
            inner = hashlib.file_digest(handle, "sha256").hexdigest()
        digest.update(f"{path.relative_to(folder).as_posix()}\0{inner}\n".encode())
    return digest.hexdigest()


def collection_settings(settings: DaggerSettings, planner: dict[str, object], decoder: str | None) -> dict[str, object]:
    """The manifest's settings: a rerun with the same ones resumes, another is refused. `planner` says who drove
    (the model's name and digest and `decoder`, or the import path of an injected policy's factory)."""
    return {
        **simulator_settings(SOURCE, settings.episodes, settings.seed, list(settings.scenarios)),
        "planner": planner,
        "latency": settings.latency.describe(decoder),
        "replan_s": settings.replan_s,
        "duration_s": settings.duration_s,
        "device": settings.device,
        "label_version": LABEL_VERSION,
    }


@lru_cache(maxsize=1)
def _planner(model: str, device: str) -> Any:
    """The planner of a process: loaded once, by the first episode a worker runs."""
    import transformers

    from fastddrive.planner import load

    # Worker processes do not import the command line, which turns transformers' "Loading weights" bar off: it
    # would break into the progress bar.
    transformers.utils.logging.disable_progress_bar()

    return load(model, device=device)


@dataclass(frozen=True)
class DaggerRunner:
    """Collects one episode and writes its shard (data/build.EpisodeRunner); picklable, so that worker processes
    take it. `make_policy` (the library's hook: a cheap or scripted policy) replaces the model's decoder."""

    settings: DaggerSettings
    tag: str
    make_policy: Callable[[], Policy] | None = None

    def policy(self) -> Policy:
        if self.make_policy is not None:
            return self.make_policy()
        name, options = parse_decoder_spec(self.settings.decoder)
        planner = _planner(str(model_folder(self.settings.model)), self.settings.device)
        return DecoderPolicy(planner, self.settings.decoder, name, options)

    def __call__(self, root: str, job: EpisodeJob) -> EpisodeResult:
        start = time.perf_counter()
        try:
            policy = self.policy()
            episode = collect_episode(
                job.scenario,
                job.seed,
                policy,
                lambda proposal: self.settings.charge_ms(proposal, policy.decoder),
                replan_s=self.settings.replan_s,
                duration_s=self.settings.duration_s,
                tag=self.tag,
            )
            record = write_shard(Path(root) / job.shard, episode.samples)
            seconds = time.perf_counter() - start
            return EpisodeResult(job, len(episode.samples), seconds, episode.trace.end_reason, record=record)
        except Exception:  # noqa: BLE001 - a failed episode is reported, the collection goes on
            return EpisodeResult(job, 0, time.perf_counter() - start, error=traceback.format_exc(limit=4))


def build_dagger(
    out: str | Path,
    settings: DaggerSettings,
    workers: int = 1,
    overwrite: bool = False,
    on_start: Callable[[int, int], None] | None = None,
    on_episode: Callable[[EpisodeResult], None] | None = None,
    on_problem: Callable[[str], None] | None = None,
    make_policy: Callable[[], Policy] | None = None,
) -> BuildReport:
    """Collect (or resume, or repair) the DAgger data set of `settings` in `out` (module docstring); the
    callbacks and the report are data/build.build_dataset's. `make_policy()` gives each episode's policy in
    place of the model's decoder (recorded in the settings by its import path; with workers it must be picklable)."""
    if make_policy is None:
        from fastddrive.engine.model_files import weights_bytes

        folder = model_folder(settings.model)
        # each worker loads its own copy
        check_build_settings(settings.episodes, settings.seed, workers, model_bytes=weights_bytes(folder))
        planner: dict[str, object] = {
            "model": settings.model,
            "model_sha256": model_digest(folder),
            "decoder": settings.decoder,
        }
        tag = f"{SOURCE}-{str(planner['model_sha256'])[:8]}"
    else:
        check_build_settings(settings.episodes, settings.seed, workers)
        # named by the factory's import path, so that a rerun with another one is refused
        factory = make_policy if hasattr(make_policy, "__qualname__") else type(make_policy)
        planner = {"policy": f"{factory.__module__}.{factory.__qualname__}"}
        tag = SOURCE
    jobs = plan_episodes(settings.episodes, settings.seed, list(settings.scenarios), rater_splits=())
    runner = DaggerRunner(settings, tag, make_policy)
    record = collection_settings(settings, planner, settings.decoder if make_policy is None else None)
    return build_episodes(out, jobs, record, runner, workers, overwrite, on_start, on_episode, on_problem)
