import numpy as np
import pytest

import staging
from fastddrive.core.sample import FUTURE_STEPS, HISTORY_STEPS
from fastddrive.core.schema import parse, render
from fastddrive.data import labels
from fastddrive.data.dataset import DrivingDataset, from_row, to_row
from fastddrive.data.highway import SCENARIOS, episode_samples, sample_steps, simulate_episode


@pytest.fixture(scope="module")
def lane_change_episode():
    return episode_samples("highway", 7, max_duration_s=14, setup=staging.slow_car_ahead_in_right_lane)


@pytest.fixture(scope="module")
def braking_episode():
    return episode_samples("highway", 7, max_duration_s=12, setup=staging.slow_wall_ahead)


def test_frames_are_rendered_not_blank(lane_change_episode):
    assert lane_change_episode
    for sample in lane_change_episode:
        assert sample.image.shape == (224, 448, 3)
        assert sample.image.var() > 0
        ego_green = (sample.image == np.array([50, 200, 0], dtype=np.uint8)).all(axis=2)
        assert ego_green.sum() > 50  # the ego is drawn in its own colour


def test_a_car_the_ego_closes_on_leaves_its_past_boxes_in_the_frame(braking_episode):
    """data/past_boxes.py: the slow car ahead was farther away 0.5 s and 1 s ago, so its past boxes are drawn."""

    def past_box_pixels(image: np.ndarray) -> int:
        r, g, b = (image[..., k].astype(int) for k in range(3))
        return int(((r > 140) & (g > 100) & (g < 140) & (b < 80)).sum())  # orange over the grey road

    counts = [past_box_pixels(sample.image) for sample in braking_episode]
    assert max(counts) > 100, counts


def test_samples_are_one_second_apart_with_a_quarter_second_future(lane_change_episode):
    times = [s.time_s for s in lane_change_episode]
    assert times[0] == pytest.approx(3.0)
    assert np.allclose(np.diff(times), 1.0)
    for sample in lane_change_episode:
        assert np.allclose(np.diff(sample.future_time_s), 0.25)
        assert sample.future_time_s[0] == pytest.approx(0.25)
        assert sample.future.shape == (FUTURE_STEPS, 2)
        assert sample.history.shape == (HISTORY_STEPS, 6)
        assert np.allclose(sample.history[-1, :2], 0.0)  # the ego frame is centred on now
        # The target waypoints are the expert future at 1, 2, ..., 5 s, rounded to centimetres.
        assert np.allclose(np.asarray(sample.response.trajectory), sample.future[3::4], atol=0.005)


def test_a_left_lane_change_gives_plus_y_and_lane_change_left(lane_change_episode):
    lateral = [s.response.future_meta_behavior.lateral for s in lane_change_episode]
    assert "lane_change_left" in lateral
    assert "lane_change_right" not in lateral
    # Where the manoeuvre lies wholly ahead (no sideways motion in the first second; mid-change the
    # ego frame is tilted with the car), it ends one lane (4 m) to the LEFT: +y.
    ahead = [
        s
        for s in lane_change_episode
        if s.response.future_meta_behavior.lateral == "lane_change_left" and abs(s.response.trajectory[0][1]) < 0.5
    ]
    assert ahead
    for sample in ahead:
        assert sample.response.trajectory[-1][1] > 3.0


def test_braking_gives_decelerate(braking_episode):
    decelerating = [s for s in braking_episode if s.response.future_meta_behavior.longitudinal == "decelerate"]
    assert decelerating
    for sample in decelerating:
        speed_now = sample.history[-1, 2]
        assert sample.future[11, 0] < 3.0 * speed_now - 1.0  # covers less than at constant speed
    assert all(s.response.future_meta_behavior.lateral == "straight" for s in braking_episode)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_scenario_makes_valid_samples(scenario):
    log = simulate_episode(scenario, 1, max_duration_s=12)
    steps = sample_steps(log)
    assert steps, f"{scenario}: no sample from a 12 s episode ({log.end_reason})"
    for k in steps:
        assert (k + FUTURE_STEPS) < log.usable_steps + 1
    samples = episode_samples(scenario, 1, max_duration_s=12)
    assert [s.time_s for s in samples] == [log.steps[k].time_s for k in steps]  # seeded: the same episode again
    row = to_row(samples[0])
    back = from_row(row)
    assert back.response == samples[0].response
    assert np.array_equal(back.image, samples[0].image)
    assert np.allclose(back.future, samples[0].future, atol=1e-4)
    assert parse(render(back.response)) == back.response


def _scene(**changes):
    base = dict(
        scenario="highway",
        command="go_straight",
        ego_speed=np.full(21, 20.0),
        ego_future=np.stack([np.arange(1, 21) * 5.0, np.zeros(20)], axis=1),
        heading_change_rad=0.0,
        lane_change=0,
        yielding=False,
        agents=np.zeros((0, 21, 3)),
        agent_speed=np.zeros(0),
        agent_crashed=np.zeros(0, dtype=bool),
    )
    return labels.Scene(**{**base, **changes})


def test_label_rules_on_hand_made_scenes():
    assert labels.label(_scene()).meta.model_dump() == {"longitudinal": "keep", "lateral": "straight"}
    braking = np.linspace(20.0, 12.0, 21)
    assert labels.label(_scene(ego_speed=braking)).meta.longitudinal == "decelerate"
    assert labels.label(_scene(ego_speed=np.linspace(20.0, 0.0, 21))).meta.longitudinal == "stop"
    assert labels.label(_scene(ego_speed=np.linspace(15.0, 20.0, 21))).meta.longitudinal == "accelerate"
    assert labels.label(_scene(lane_change=1)).meta.lateral == "lane_change_left"
    assert labels.label(_scene(lane_change=-1)).meta.lateral == "lane_change_right"
    assert labels.label(_scene(heading_change_rad=np.deg2rad(80))).meta.lateral == "left_turn"
    assert labels.label(_scene(heading_change_rad=-np.deg2rad(80))).meta.lateral == "right_turn"
    assert labels.label(_scene(heading_change_rad=np.deg2rad(15))).meta.lateral == "lane_follow"

    # A car in the next lane, 15 m ahead, that moves into the expert's path: a cut-in.
    t = np.arange(21) * 0.25
    cut_in = np.stack([15.0 + 15.0 * t, np.clip(4.0 - 2.0 * t, 0.0, 4.0), np.zeros(21)], axis=1)[None]
    scene = _scene(agents=cut_in, agent_speed=np.array([15.0]), agent_crashed=np.array([False]), ego_speed=braking)
    found = labels.label(scene)
    assert found.critical_objects["conflicting_vehicle"] and found.critical_objects["nearby_vehicle"]
    assert found.meta.lateral == "yield" and found.cause == "cut_in" or found.meta.lateral == "yield"
    # The same car staying in its lane is nearby but not conflicting.
    stays = cut_in.copy()
    stays[..., 1] = 4.0
    calm = labels.label(_scene(agents=stays, agent_speed=np.array([15.0]), agent_crashed=np.array([False])))
    assert calm.critical_objects["nearby_vehicle"] and not calm.critical_objects["conflicting_vehicle"]
    # A crashed car ahead in the lane is a road hazard.
    wreck = np.zeros((1, 21, 3))
    wreck[0, :, 0] = 40.0
    hazard = labels.label(
        _scene(agents=wreck, agent_speed=np.zeros(1), agent_crashed=np.array([True]), ego_speed=braking)
    )
    assert hazard.critical_objects["road_hazard"] and hazard.cause == "hazard"


def test_explanations_name_the_cause_in_several_phrasings():
    found = labels.label(
        _scene(
            lane_change=1,
            agents=np.array([[[30.0, 0.0, 0.0]] * 21]),
            agent_speed=np.array([10.0]),
            agent_crashed=np.array([False]),
        )
    )
    assert found.cause == "pass_slower"
    texts = {labels.explanation(found, "highway", np.random.default_rng(i)) for i in range(30)}
    assert len(texts) >= 2
    assert all("left" in t for t in texts)


def test_opening_something_that_is_not_a_dataset_is_a_clear_error(tmp_path):
    from fastddrive.data.dataset import DatasetError

    with pytest.raises(DatasetError, match="not a fastddrive dataset"):
        DrivingDataset.open(tmp_path)
    with pytest.raises(DatasetError, match="is not a directory"):
        DrivingDataset.open(tmp_path / "missing")


def test_an_intersection_episode_does_not_change_the_next_episodes():
    before = episode_samples("merge", 77, max_duration_s=9)
    episode_samples("intersection", 78, max_duration_s=9)
    after = episode_samples("merge", 77, max_duration_s=9)
    assert [s.future.tolist() for s in before] == [s.future.tolist() for s in after]


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_process_that_renders_frames_still_stops_on_a_signal(signal_name):
    """SDL, which draws the frames, turns SIGINT and SIGTERM into quit events by default: a data or drive
    job would then ignore Ctrl-C and `kill`."""
    import signal
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from fastddrive.data.highway import make_env\n"
        "env = make_env('highway'); env.reset(seed=0); env.render()\n"
        "print('rendered', flush=True)\n"
        "time.sleep(60)\n"
    )
    # A job started in the background inherits an ignored SIGINT; a terminal's Ctrl-C job does not.
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert process.stdout.readline().strip() == b"rendered"
        process.send_signal(getattr(signal, signal_name))
        assert process.wait(timeout=10) != 0
    finally:
        process.kill()
