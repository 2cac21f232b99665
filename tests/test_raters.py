import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import staging
from fastddrive.core.sample import FUTURE_STEPS, SampleError
from fastddrive.data import build, episodes, raters
from fastddrive.data.dataset import DATASET_FORMAT, MANIFEST, DrivingDataset, from_row, to_row, write_shard
from fastddrive.data.highway import SCENARIOS, episode_samples, install_expert, make_env


@pytest.fixture(scope="module")
def plain_and_rated():
    """A short val-like episode in ordinary traffic, without and with raters."""
    return episode_samples("highway", 5, max_duration_s=9), episode_samples("highway", 5, max_duration_s=9, raters=True)


def _alone(env, expert):
    staging._place(expert, 1, {})  # the middle lane of a clear road: both side lanes are free


@pytest.fixture(scope="module")
def clear_road():
    return episode_samples("highway", 7, max_duration_s=9, setup=_alone, raters=True)


def test_val_like_samples_carry_one_to_three_scored_raters(plain_and_rated):
    plain, rated = plain_and_rated
    assert rated and len(rated) == len(plain)
    for sample in rated:
        assert 1 <= len(sample.rater_trajectories) <= 3
        assert sample.rater_trajectories.shape[1:] == (FUTURE_STEPS, 2)
        assert sample.rater_scores.shape == (len(sample.rater_trajectories),)
        assert np.all((sample.rater_scores >= 0) & (sample.rater_scores <= 10))
        # The alternatives are other futures, not copies of the expert's.
        assert np.abs(sample.rater_trajectories[1:] - sample.future).max() > 1.0
    for sample in plain:  # without the flag (training episodes) there are none
        assert sample.rater_trajectories.shape == (0, FUTURE_STEPS, 2) and sample.rater_scores.shape == (0,)


def test_the_expert_rater_replays_the_logged_future(plain_and_rated):
    _, rated = plain_and_rated
    for sample in rated:
        # Same state, same driver, same copied random generator: the very same path.
        np.testing.assert_allclose(sample.rater_trajectories[0], sample.future, atol=1e-9)


def test_computing_raters_leaves_the_episode_unchanged(plain_and_rated):
    plain, rated = plain_and_rated
    for a, b in zip(plain, rated, strict=True):
        assert a.sample_id == b.sample_id and a.time_s == b.time_s
        assert np.array_equal(a.image, b.image)
        assert np.array_equal(a.history, b.history)
        assert np.array_equal(a.future, b.future)
        assert a.response == b.response
        assert np.array_equal(a.agents, b.agents, equal_nan=True)


def test_on_a_clear_road_the_expert_scores_high_and_a_lane_change_is_offered(clear_road):
    assert clear_road
    for sample in clear_road:
        assert sample.rater_scores[0] >= 8
        np.testing.assert_allclose(sample.rater_trajectories[0], sample.future, atol=1e-9)
        assert len(sample.rater_scores) == 3
        change = sample.rater_trajectories[2]
        assert change[-1, 1] > 3.0  # a free lane on the left is taken first: +y, one lane over (4 m)
        assert sample.rater_scores[2] >= 7  # a clean lane change only costs comfort points
        cautious = sample.rater_trajectories[1]
        assert cautious[-1, 0] < sample.future[-1, 0] - 5.0 and sample.rater_scores[1] < sample.rater_scores[0]


def test_a_rollout_that_crashes_scores_zero_and_the_simulator_is_left_as_it_was():
    env = make_env("highway")
    try:
        env.reset(seed=3)
        expert = install_expert(env, SCENARIOS["highway"], np.random.default_rng(3))
        # Stopped cars 12 m ahead in every lane at 25 m/s: nobody can stop or swerve in time.
        staging._place(expert, 1, {0: (12.0, 0.0), 1: (12.0, 0.0), 2: (12.0, 0.0)})
        sim = env.unwrapped
        position, speed, rng_state = expert.position.copy(), expert.speed, sim.np_random.bit_generator.state
        rollouts = raters.roll_out_raters(sim)
        rated = raters.rate(sim)
        assert [r.crashed for r in rollouts] == [True] * 3
        assert rated.scores.tolist() == [0.0, 0.0, 0.0]
        assert np.array_equal(expert.position, position) and expert.speed == speed and not expert.crashed
        assert sim.np_random.bit_generator.state == rng_state and sim.vehicle is expert
    finally:
        env.close()


def _rollout(**changes):
    """A 5 s straight drive at 20 m/s, nobody ahead."""
    t = np.arange(FUTURE_STEPS + 1) * 0.25
    base = dict(
        name="test",
        positions=np.stack([20.0 * t, np.zeros_like(t)], axis=1),
        speeds=np.full_like(t, 20.0),
        crashed=False,
        off_road=False,
        min_ttc_s=np.inf,
        min_headway_s=np.inf,
    )
    return raters.Rollout(**{**base, **changes})


def test_the_score_rule_is_monotone_and_bounded():
    smooth = _rollout()
    assert raters.score(smooth, smooth.distance_m) == 10.0
    assert raters.score(_rollout(crashed=True), smooth.distance_m) == 0.0
    assert raters.score(_rollout(off_road=True), smooth.distance_m) <= 2.0
    # Less progress than the expert, harder braking, closer behind the car ahead: each lowers the score.
    assert raters.score(smooth, 1.2 * smooth.distance_m) < 10.0
    assert raters.score(smooth, 1.2 * smooth.distance_m) > raters.score(smooth, 1.4 * smooth.distance_m)
    assert raters.score(smooth, 0.5 * smooth.distance_m) == 10.0  # going further earns nothing
    speeds = np.full(FUTURE_STEPS + 1, 20.0)
    soft, hard = speeds.copy(), speeds.copy()
    soft[10:], hard[10:] = 18.75, 18.0  # 5 and 8 m/s^2 over one step
    assert 10.0 > raters.score(_rollout(speeds=soft), 0.0) > raters.score(_rollout(speeds=hard), 0.0)
    scores = [raters.score(_rollout(min_ttc_s=ttc), 0.0) for ttc in (5.0, 2.0, 1.0, 0.0)]
    assert scores == sorted(scores, reverse=True) and scores[0] == 10.0 and scores[-1] == 7.0
    scores = [raters.score(_rollout(min_headway_s=h), 0.0) for h in (1.0, 0.5, 0.0)]
    assert scores == sorted(scores, reverse=True) and scores[0] == 10.0
    worst = _rollout(speeds=hard, min_ttc_s=0.0, min_headway_s=0.0)
    assert 0.0 <= raters.score(worst, 2 * smooth.distance_m) <= 10.0


def test_raters_survive_a_row_round_trip_and_old_rows_have_none(plain_and_rated):
    sample = plain_and_rated[1][0]
    back = from_row(to_row(sample))
    np.testing.assert_allclose(back.rater_trajectories, sample.rater_trajectories, atol=1e-4)
    np.testing.assert_allclose(back.rater_scores, sample.rater_scores, atol=1e-5)
    old = {k: v for k, v in to_row(sample).items() if not k.startswith("rater_")}
    assert from_row(old).rater_trajectories.shape == (0, FUTURE_STEPS, 2)
    assert from_row(old).rater_scores.shape == (0,)


def test_a_shard_written_before_raters_existed_still_reads(plain_and_rated, tmp_path):
    plain, rated = plain_and_rated
    rows = [{k: v for k, v in to_row(s).items() if not k.startswith("rater_")} for s in plain]
    (tmp_path / "train").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train" / "00000-old.parquet")
    write_shard(tmp_path / "test" / "00001-new.parquet", rated)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": DATASET_FORMAT, "version": 1}))
    dataset = DrivingDataset.open(tmp_path)
    old = list(dataset.samples("train"))
    assert len(old) == len(plain) and all(len(s.rater_scores) == 0 for s in old)
    assert dataset.table("train").column("rater_scores").to_pylist() == [[]] * len(plain)
    assert dataset.table("train", ["sample_id", "rater_scores"]).num_columns == 2
    new = list(dataset.samples("test"))
    assert [len(s.rater_scores) for s in new] == [len(s.rater_scores) for s in rated]


@pytest.mark.parametrize(
    ("trajectories", "scores", "message"),
    [
        (np.zeros((4, FUTURE_STEPS, 2)), np.zeros(4), r"R in 0\.\.3"),
        (np.zeros((1, 19, 2)), np.zeros(1), r"\(R, 20, 2\)"),
        (np.zeros((FUTURE_STEPS, 2)), np.zeros(1), r"\(R, 20, 2\)"),
        (np.full((1, FUTURE_STEPS, 2), np.nan), np.zeros(1), "NaN"),
        (np.zeros((2, FUTURE_STEPS, 2)), np.zeros(1), "one rater score per rater trajectory"),
        (np.zeros((1, FUTURE_STEPS, 2)), np.array([10.5]), r"must lie in \[0, 10\]"),
        (np.zeros((1, FUTURE_STEPS, 2)), np.array([-1.0]), r"must lie in \[0, 10\]"),
        (np.zeros((1, FUTURE_STEPS, 2)), np.array([np.nan]), r"must lie in \[0, 10\]"),
    ],
)
def test_a_bad_rater_array_is_refused_with_a_clear_error(plain_and_rated, trajectories, scores, message):
    sample = plain_and_rated[1][0]
    with pytest.raises(SampleError, match=message):
        dataclasses.replace(sample, rater_trajectories=trajectories, rater_scores=scores)


def test_the_builder_rates_val_and_test_episodes_only_and_says_so(tmp_path, monkeypatch):
    from fastddrive.data import highway

    jobs = episodes.plan_episodes(10, 1, ["merge"])
    assert {j.split for j in jobs if j.raters} == {"val", "test"}
    assert not any(j.raters for j in jobs if j.split == "train")

    real = highway.simulate_episode

    def short(scenario, seed, max_duration_s=None, setup=None, raters=False):
        return real(scenario, seed, 9, setup, raters=raters)  # keep the test quick

    monkeypatch.setattr(highway, "simulate_episode", short)
    report = build.build_dataset(tmp_path / "d", 2, 5, ["highway"])
    assert not report.failed
    dataset = DrivingDataset.open(tmp_path / "d")
    assert dataset.manifest["settings"]["raters"]["splits"] == ["val", "test"]
    assert dataset.manifest["settings"]["raters"]["rule_version"] == raters.RULE_VERSION
    assert all(len(s.rater_scores) == 0 for s in dataset.samples("train"))
    test = list(dataset.samples("test"))
    assert test and all(1 <= len(s.rater_scores) <= 3 for s in test)


def test_the_raters_do_not_import_the_episode_recorder():
    """data.highway uses the raters; the raters share only data.expert with it (no import circle)."""
    import subprocess
    import sys

    code = "import sys, fastddrive.data.raters; assert 'fastddrive.data.highway' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
