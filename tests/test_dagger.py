"""DAgger's closed-loop data (drive/dagger.py) and its aggregation (data/merge.py): the planner's visited states
labelled with the expert's rollout, written as a resumable data set, merged with the data so far and trained on.

Cheap policies stand in for the model where the planner's quality does not matter; one collection drives the
embedded model through the command line. Episodes are short (`duration_s` 4 to 5: one to four questions)."""

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.core.metrics import constant_velocity_m
from fastddrive.core.schema import NUM_WAYPOINTS, WAYPOINT_INTERVAL_S
from fastddrive.data.build import OutputExists, build_dataset
from fastddrive.data.dataset import SPLITS, DatasetError, DrivingDataset
from fastddrive.data.highway import episode_samples
from fastddrive.data.merge import merge_datasets
from fastddrive.drive.dagger import DaggerRunner, build_dagger, check_dagger_settings, collect_episode
from fastddrive.drive.policies import ExpertPolicy, Proposal

EVERY = round(WAYPOINT_INTERVAL_S * 4)  # future points (4 Hz) per 1 s waypoint


class Braking:
    """Holds 70 % of the current velocity: the car slows where the expert would not, so it visits other states."""

    label, decoder = "braking", None

    def start(self, expert) -> None:
        return None

    def propose(self, observation) -> Proposal:
        return Proposal(0.7 * constant_velocity_m(observation.history, NUM_WAYPOINTS, WAYPOINT_INTERVAL_S), 0.0)


class Watched(Braking):
    """Braking, keeping every observation and what the `expert-plans` reference answers to it."""

    def __init__(self, replan_s: float = 0.5) -> None:
        self.expert = ExpertPolicy(replan_s)
        self.asked: list[tuple[object, np.ndarray]] = []

    def start(self, expert) -> None:
        self.expert.start(expert)

    def propose(self, observation) -> Proposal:
        self.asked.append((observation, self.expert.propose(observation).waypoints_m))
        return super().propose(observation)


class Exploding(Braking):
    def propose(self, observation) -> Proposal:
        raise RuntimeError("planner exploded")


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_samples_are_the_planners_states_labelled_with_the_experts_rollout_from_them():
    watched = Watched()
    episode = collect_episode("merge", 6, watched, duration_s=5.0)
    assert len(watched.asked) == 4 and len(episode.samples) + episode.skipped == 4
    expert_drive = {round(s.time_s, 2): s for s in episode_samples("merge", 6, max_duration_s=9)}
    asked = {round(o.time_s, 2): (o, answer) for o, answer in watched.asked}
    for sample in episode.samples:
        observation, answer = asked[round(sample.time_s, 2)]
        # What the planner was given...
        assert np.array_equal(sample.image, observation.frame) and np.array_equal(sample.history, observation.history)
        assert sample.command == observation.command and sample.view.ego_heading_rad == observation.heading_rad
        # ... and the expert's answer from there: the expert-plans rollout, point for point.
        np.testing.assert_allclose(sample.future[EVERY - 1 :: EVERY], answer, atol=1e-9)
        np.testing.assert_allclose(sample.response.trajectory, answer, atol=0.005)  # the answer's 2 decimals
    first, later = episode.samples[0], next(s for s in episode.samples if s.time_s == 4.0)
    # At the hand-over the car is where the expert was, and the rollout is the expert's own drive: the sample is
    # the data generator's, answer included (the same labelling rules).
    theirs = expert_drive[3.0]
    assert first.time_s == 3.0 and first.response == theirs.response
    assert np.array_equal(first.image, theirs.image)  # the frame too, the other cars' past boxes included
    assert np.array_equal(first.future, theirs.future) and np.array_equal(first.history, theirs.history)
    # A second later the braking car is where the expert's episode never was.
    assert np.abs(later.history - expert_drive[4.0].history).max() > 1.0


def test_the_data_set_is_written_resumed_and_reported_as_the_generators(tmp_path):
    settings = check_dagger_settings(
        model="default", decoder="ss", episodes=2, seed=5, scenarios="merge", duration_s=4.0
    )
    made: list[str] = []

    def policies(failing: int | None = None):
        """Each episode's policy, counted; the `failing`-th one made explodes."""

        def make():
            made.append("policy")
            return Exploding() if len(made) == failing else Braking()

        return make

    whole = build_dagger(tmp_path / "whole", settings, make_policy=policies())
    assert whole.complete and whole.samples > 0 and not whole.failed
    dataset = DrivingDataset.open(tmp_path / "whole")
    assert dataset.manifest["settings"]["source"] == "dagger" and len(dataset) == whole.samples
    # The generator's episodes, seeds and split rule.
    assert set(dataset.records) == {"train/00000-merge-500000.parquet", "test/00001-merge-500001.parquet"}

    made.clear()  # episode 1 (the second policy made) fails; the other is written
    failed = build_dagger(tmp_path / "out", settings, make_policy=policies(failing=2))
    assert len(failed.failed) == 1 and failed.failed[0].job.index == 1 and not failed.complete
    assert failed.failed[0].error.strip().endswith("RuntimeError: planner exploded")
    with pytest.raises(DatasetError, match="not a complete data set"):
        merge_datasets([tmp_path / "out", tmp_path / "whole"], tmp_path / "merged")

    made.clear()
    resumed = build_dagger(tmp_path / "out", settings, make_policy=policies())
    assert made == ["policy"] and resumed.skipped == 1 and resumed.complete  # only the failed episode again
    assert _tree(tmp_path / "out") == _tree(tmp_path / "whole")  # byte for byte an uninterrupted run

    def interrupt(result) -> None:
        raise KeyboardInterrupt

    made.clear()
    with pytest.raises(KeyboardInterrupt):
        build_dagger(tmp_path / "cut", settings, on_episode=interrupt, make_policy=policies())
    build_dagger(tmp_path / "cut", settings, make_policy=policies())
    assert len(made) == 2 and _tree(tmp_path / "cut") == _tree(tmp_path / "whole")

    other = check_dagger_settings(
        model="default", decoder="ss", episodes=2, seed=5, scenarios="merge", duration_s=4.0, replan_s=1.0
    )
    with pytest.raises(OutputExists, match="other settings .*replan_s 0.5 there, 1.0 now"):
        build_dagger(tmp_path / "out", other, make_policy=policies())
    with pytest.raises(OutputExists, match="already holds this complete dataset"):
        build_dagger(tmp_path / "out", settings, make_policy=policies())
    runner = DaggerRunner(settings, "dagger")  # worker processes get the runner pickled
    assert pickle.loads(pickle.dumps(runner)) == runner


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _refused(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_round_collects_with_the_model_merges_with_the_data_and_trains(tmp_path):
    from fastddrive.train.config import load_config
    from fastddrive.train.loop import train
    from model_fixtures import SMALL

    collected, sim, union = tmp_path / "dagger-r1", tmp_path / "sim", tmp_path / "aggregate"
    command = ["data", "dagger", "--model", "default", "--decoder", "ss", "--episodes", 1, "--seed", 5]
    command += ["--scenarios", "merge", "--duration-s", 4.0, "--out", collected]
    result = _run(*command)
    assert result.exit_code == 0, result.output
    assert "wrote 2 samples from 1 episodes" in result.output
    samples = list(DrivingDataset.open(collected).samples("train"))
    assert len(samples) == 2 and all(s.sample_id.startswith("merge-500000-") for s in samples)
    assert _run("data", "verify", collected).exit_code == 0

    _refused(_run(*command, "--replan-s", 1.0), "other settings", "replan_s 0.5 there, 1.0 now")
    _refused(_run(*command[:-2], "--latency", "measured", "--out", tmp_path / "x"), "--latency measured")

    build_dataset(sim, 1, 21, ["merge"], rater_splits=())
    result = _run("data", "merge", sim, collected, "--out", union)
    assert result.exit_code == 0, result.output
    aggregate = DrivingDataset.open(union)
    ids = {s.sample_id for split in SPLITS for s in aggregate.samples(split)}
    sources = [DrivingDataset.open(root) for root in (sim, collected)]
    expected = {s.sample_id for source in sources for split in SPLITS for s in source.samples(split)}
    assert ids == expected and len(aggregate) == len(sources[0]) + len(sources[1])
    _refused(_run("data", "merge", union, collected, "--out", tmp_path / "twice"), "is in both")
    # Frames drawn before the past boxes (data/past_boxes.py) do not mix with today's, through a merge too.
    old = tmp_path / "sim-before-past-boxes"
    shutil.copytree(sim, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["settings"]["frame_past_boxes_s"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    for first in (collected, union):
        _refused(_run("data", "merge", first, old, "--out", tmp_path / "mixed"), str(old), "past boxes none")

    quick = dict(validation_samples=2, log_every=1, checkpoint_every=2, validate_every=1000, warmup_steps=1)
    config = load_config("tiny-ar", data=str(union), out=str(tmp_path / "run"), steps=1, architecture=SMALL, **quick)
    assert train(config).final.is_dir()
