"""Closed-loop driving (issue 17): the controller, the expert reproduced in the loop, latency charged on the
simulation clock, bad settings refused up front, and a run that survives a crash, Ctrl-C and a re-run.

Stub planners stand in for the model wherever the model is not the point; the embedded model drives once.
"""

import json
import math
import os
import signal
from itertools import pairwise

import numpy as np
import pytest
import torch
from highway_env.vehicle.kinematics import Vehicle

from fastddrive.core.schema import CRITICAL_OBJECT_CLASSES, DrivingResponse, MetaBehavior
from fastddrive.data.build import max_workers, usable_cpus
from fastddrive.data.highway import SIMULATION_HZ, UnknownScenario, episode_samples, seeded_episode, simulate_episode
from fastddrive.decode.registry import DecoderError
from fastddrive.decode.result import DecodeResult
from fastddrive.drive import DriveError
from fastddrive.drive.closed_loop import HANDOVER_S, RECORD_S, drive_episode
from fastddrive.drive.controller import TrackingController
from fastddrive.drive.latency import Latency, LatencyError
from fastddrive.drive.metrics import driving_score, lead_ttc_s, ttc_violation_flags
from fastddrive.drive.plan import TimedPath
from fastddrive.drive.policies import DecoderPolicy, ExpertPolicy, Observation, Proposal
from fastddrive.drive.route import Route
from fastddrive.drive.run import check_settings, run_drive
from fastddrive.engine.model_files import DeviceError

DT = 1.0 / SIMULATION_HZ
HANDOVER_STEP = round(HANDOVER_S / RECORD_S)


def _cross_track_m(path: TimedPath, position: np.ndarray) -> float:
    """Distance to the path, the polyline resampled every few centimetres."""
    arc = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(path.points_m, axis=0), axis=1))])
    s = np.linspace(0, arc[-1], 20_000)
    dense = np.stack([np.interp(s, arc, path.points_m[:, i]) for i in (0, 1)], axis=1)
    return float(np.linalg.norm(dense - position, axis=1).min())


def _track(path: TimedPath, start: tuple[float, float], speed_mps: float, seconds: float):
    """Drive highway-env's own bicycle model with the controller; cross-track and speed errors per step."""
    car = Vehicle(None, np.array(start, dtype=float), 0.0, speed_mps)
    controller = TrackingController()
    cross, speed, positions, headings = [], [], [], []
    for k in range(round(seconds / DT)):
        t = k * DT
        steering, accel = controller.control(car.position, car.heading, car.speed, path, t, DT)
        car.action = {"steering": steering, "acceleration": accel}
        car.step(DT)
        positions.append(car.position.copy())
        headings.append(car.heading)
        cross.append(_cross_track_m(path, car.position))
        speed.append(car.speed - path.speed_mps(t + DT))
    return np.array(cross), np.array(speed), np.array(positions), np.array(headings)


def test_controller_follows_a_straight_and_a_curved_trajectory():
    t = np.arange(0, 12.01, 0.25)
    # Straight at 20 m/s, starting 1.5 m to the side and 5 m/s slow: within 0.1 m and 0.2 m/s after 3 s.
    straight = TimedPath(t, np.stack([20.0 * t, np.zeros_like(t)], axis=1))
    cross, speed, _, _ = _track(straight, (0.0, 1.5), 15.0, 10.0)
    assert cross[0] > 1.0
    assert cross[36:].max() < 0.1 and np.abs(speed[36:]).max() < 0.2
    # A 40 m radius curve, speeding up from 5 m/s at 1 m/s^2 (0.6..2.5 m/s^2 sideways): within 0.2 m.
    radius, s = 40.0, 5.0 * t + 0.5 * t**2
    curve = TimedPath(t, np.stack([radius * np.sin(s / radius), radius * (1 - np.cos(s / radius))], axis=1))
    cross, speed, _, _ = _track(curve, (0.0, 0.0), 5.0, 8.0)
    assert cross.max() < 0.2 and np.abs(speed[12:]).max() < 0.1


@pytest.mark.parametrize("speed_mps", [0.0, 1.5, 6.0])
def test_a_plan_that_backs_up_stops_the_car_with_the_wheel_straight(speed_mps):
    # Highway-env's expert reverses when it stopped too close; its plan then runs behind the car, slightly
    # to the side. Steering toward it at the plan's unsigned speed turned the car round and off the road.
    t = np.arange(0, 5.01, 0.5)
    backing_up = TimedPath(t, np.stack([-1.2 * t, 0.3 * t], axis=1))
    _, _, positions, headings = _track(backing_up, (0.0, 0.0), speed_mps, 5.0)
    assert np.abs(headings).max() == 0.0  # never steered
    assert np.all(np.diff(positions[:, 0]) >= 0.0)  # never backed up
    # Braking at 2/s x the speed, at most at the brake limit: it stops within speed / (2/s) plus the braking
    # distance at the limit (a bound on both phases), and stays there.
    brake = TrackingController().limits.max_brake_mps2
    assert positions[-1, 0] <= speed_mps / 2.0 + speed_mps**2 / (2 * brake) + 0.01
    assert np.abs(positions[:, 1]).max() == 0.0
    assert np.linalg.norm(positions[-1] - positions[-15]) < 0.01


def test_the_expert_answer_goes_straight_on_past_the_end_of_its_route():
    # The intersection's route ends at the map's edge, where highway-env's cars turn back into the map; an
    # answer that turned back there made the tracking car cut the turn and leave the road.
    with seeded_episode("intersection", 700029) as (_, sim, expert):
        idle = sim.action_type.actions_indexes["IDLE"]
        policy = ExpertPolicy(0.5)
        policy.start(expert)
        end = Route.ahead_of(expert, 30.0).points_m[-1]
        while np.linalg.norm(expert.position - end) > 20.0:
            sim.step(idle)
        before_end = expert.position.copy()
        answer = policy.propose(Observation(float(sim.time), None, None, "", before_end, expert.heading, sim))
    forward, sideways = answer.waypoints_m[:, 0], answer.waypoints_m[:, 1]
    assert forward[-1] > np.linalg.norm(end - before_end) + 5.0  # well past the route's end
    assert np.all(np.diff(forward) > 0) and np.abs(sideways).max() < 0.5


@pytest.mark.parametrize("seed", [700008, 2900008])
def test_expert_plans_takes_the_roundabout_exit_its_route_names(seed):
    # The exit starts beside the ring, whose lane is nearer at first: a car that counted itself on the ring
    # there kept a stale route, and the expert's rollouts from it went round the ring instead (700008). A car
    # that takes the exit as its lane while it still drives on the ring's outer lane is on the road, not
    # 3.17 m off the exit's middle (2900008, off the road 2.75 s after the hand-over when only its lane was read).
    drives = drive_episode("roundabout", seed, None, lambda _: 0.0, duration_s=8.0)
    plans = drive_episode("roundabout", seed, ExpertPolicy(0.5), lambda _: 0.0, duration_s=8.0)
    assert drives.progress_m[-1] > 40.0  # past the exit, 25 m along the route
    assert plans.end_reason == "timeout" and plans.progress_m[-1] == pytest.approx(drives.progress_m[-1], abs=2.0)


def test_expert_in_the_loop_reproduces_its_own_episode():
    """The data's episode (same seed), first with the expert keeping the seat (exactly), then with its own 5 s
    rollouts as the plans, followed by the controller: within 1.5 m at every 0.25 s (the 1 s waypoints lose
    the shape of its accelerations), 0.3 m sideways."""
    seed, duration = 700_000, 9.0
    log = simulate_episode("highway", seed, max_duration_s=duration)
    expert = np.array([step.ego.position for step in log.steps])[HANDOVER_STEP:]
    own = drive_episode("highway", seed, None, lambda p: 0.0, duration_s=duration)
    np.testing.assert_allclose(np.array(own.position_m), expert[: len(own.position_m)], atol=1e-9)
    looped = drive_episode("highway", seed, ExpertPolicy(0.5), lambda p: 0.0, duration_s=duration)
    n = len(looped.position_m)
    assert looped.end_reason == "timeout" == own.end_reason and n > 12 and len(looped.plans) == n // 2
    gap = np.array(looped.position_m) - expert[:n]
    assert np.linalg.norm(gap, axis=1).max() < 1.5
    assert np.abs(gap[:, 1]).max() < 0.3  # the highway runs along +x: y is sideways


class _Recorder:
    """Keeps what the planner is asked and answers nothing (the hand-over plan is followed meanwhile)."""

    label, decoder = "recorder", None

    def __init__(self) -> None:
        self.asked: list[Observation] = []

    def start(self, expert) -> None:
        return None

    def propose(self, observation: Observation) -> Proposal:
        self.asked.append(observation)
        return Proposal(None, 0.0)


@pytest.mark.parametrize(("scenario", "seed"), [("roundabout", 700_003), ("intersection", 700_004)])
def test_the_first_question_in_the_loop_is_the_datas_first_sample(scenario, seed):
    """At the hand-over the planner is asked exactly what a data set's first sample of the same episode holds (the
    frame to the pixel, the history, the command): closed loop and training read the scene alike."""
    sample = episode_samples(scenario, seed, max_duration_s=9.0)[0]
    recorder = _Recorder()
    drive_episode(scenario, seed, recorder, lambda p: 0.0, duration_s=HANDOVER_S + 0.5)
    asked = recorder.asked[0]
    assert asked.time_s == pytest.approx(HANDOVER_S) and sample.time_s == pytest.approx(HANDOVER_S)
    np.testing.assert_array_equal(asked.frame, sample.image)
    np.testing.assert_array_equal(asked.history, sample.history)
    assert asked.command == sample.command


def _response(trajectory) -> DrivingResponse:
    return DrivingResponse(
        critical_objects=dict.fromkeys(CRITICAL_OBJECT_CLASSES, False),
        explanation="keep going",
        future_meta_behavior=MetaBehavior(longitudinal="keep", lateral="lane_follow"),
        trajectory=trajectory,
    )


class StubPlanner:
    """Answers 'straight on at the current speed' and reports the decode time it is told (never sleeps)."""

    def __init__(self, latency_ms: float, fail_on: tuple[int, ...] = (), interrupt_on: int | None = None):
        self.latency_ms, self.fail_on, self.interrupt_on, self.calls = latency_ms, fail_on, interrupt_on, 0

    def plan(self, decoder, images, history, command, **options):
        self.calls += 1
        if self.calls == self.interrupt_on:
            raise KeyboardInterrupt
        if self.calls in self.fail_on:
            raise RuntimeError("stub decoder crashed")
        speed = float(history[-1, 2])
        trajectory = [(speed * t, 0.0) for t in range(1, 6)]
        return DecodeResult(
            decoder, [], "", _response(trajectory), 10, 0, 0, [], 0.4 * self.latency_ms, 0.6 * self.latency_ms
        )


@pytest.mark.parametrize("latency_ms", [0.0, 700.0])
def test_measured_latency_delays_every_plan(latency_ms):
    policy = DecoderPolicy(StubPlanner(latency_ms), "ss", "ss", {})
    latency = Latency("measured")
    trace = drive_episode("merge", 4, policy, lambda p: latency.charge_ms("ss", p.measured_ms), duration_s=7.0)
    assert len(trace.plans) >= 3
    asked = np.array([p.asked_s for p in trace.plans])
    # While it decodes the planner takes no new question: asked every 0.5 s, or every 1 s at 700 ms.
    np.testing.assert_allclose(np.diff(asked), 0.5 if latency_ms == 0 else 1.0)
    for plan in trace.plans:
        assert plan.charged_ms == pytest.approx(latency_ms) and plan.measured_ms == pytest.approx(latency_ms)
        assert plan.due_s == pytest.approx(plan.asked_s + latency_ms / 1000)
        if plan.active_s is not None:  # in force at the first simulator step at or after it is due
            assert plan.due_s - 1e-9 <= plan.active_s < plan.due_s + DT
    assert sum(plan.active_s is not None for plan in trace.plans) >= len(trace.plans) - 1


def test_bad_settings_are_refused_with_a_typed_error_naming_the_problem():
    with pytest.raises(DecoderError, match="'nope'"):
        check_settings(decoders="ar,nope")
    with pytest.raises(DecoderError, match="tau"):
        check_settings(decoders="sd:tau=2")
    with pytest.raises(UnknownScenario, match="'moon'"):
        check_settings(scenarios="highway,moon")
    with pytest.raises(DriveError, match="'merge' is named twice"):
        check_settings(scenarios="merge,merge")
    with pytest.raises(LatencyError, match="'slow'"):
        check_settings(latency="slow")
    with pytest.raises(LatencyError, match="'-5'"):
        check_settings(latency="fixed:-5")
    with pytest.raises(LatencyError, match="no value for decoder 'ss'"):
        check_settings(decoders="ar,ss", latency="fixed:ar=7855")
    with pytest.raises(LatencyError, match="'tts'"):
        check_settings(decoders="ar", latency="fixed:ar=1,tts=2")
    with pytest.raises(DriveError, match="--replan-s"):
        check_settings(replan_s=0.3)
    with pytest.raises(DriveError, match="--duration-s"):
        check_settings(duration_s=2.0)
    with pytest.raises(DriveError, match="--episodes"):
        check_settings(episodes=0)
    with pytest.raises(DeviceError, match="'tpu'"):
        check_settings(device="tpu")
    fixed = check_settings(decoders="ar,sd:tau=0.0", latency="fixed:ar=7855,sd:tau=0.0=3006").latency
    assert fixed.charge_ms("ar", 1.0) == 7855 and fixed.charge_ms("sd:tau=0.0", 1.0) == 3006
    assert fixed.charge_ms(None, 1.0) == 0  # references never wait


def test_metrics_score_and_time_to_collision():
    assert driving_score(0.8, {"collision": 1, "offroad": 0, "ttc_violation": 2}) == pytest.approx(0.8 * 0.6 * 0.81)
    # A car 20 m ahead (bumper gap 15 m) closing at 5 m/s; one beside us and one behind do not count.
    positions = np.array([[20.0, 0.5], [0.0, 3.5], [-10.0, 0.0]])
    ttc = lead_ttc_s(positions, np.array([10.0, 0.0, 30.0]), np.array([[5.0, 2.0]] * 3), 15.0, (5.0, 2.0))
    assert ttc == pytest.approx(3.0)
    # A car crossing the ego's road 10 m ahead, 4 m/s sideways, is out of the path before the gap closes.
    crossing = np.array([[10.0, 0.0]]), np.array([0.0]), np.array([[5.0, 2.0]]), 10.0, (5.0, 2.0)
    assert lead_ttc_s(*crossing) == pytest.approx(0.5)
    assert lead_ttc_s(*crossing, np.array([4.0])) == math.inf
    assert lead_ttc_s(*crossing, np.array([0.5])) == pytest.approx(0.5)  # still in the way after 0.5 s
    # An oncoming car ahead (seen across the ego's turn at an intersection) is not a lead car.
    assert lead_ttc_s(np.array([[10.0, 0.0]]), np.array([-6.0]), np.array([[5.0, 2.0]]), 9.0, (5.0, 2.0)) == math.inf
    # Braking for it is a response, not a violation: only the records without braking count.
    speeds = np.array([10.0, 10.0, 9.0, 8.0, 8.0])
    flags = ttc_violation_flags(np.array([5.0, 1.0, 1.0, 1.0, 1.0]), speeds, 0.25)
    assert flags.tolist() == [False, True, False, False, True]


def test_run_survives_a_crash_keeps_results_on_ctrl_c_and_resumes(tmp_path):
    settings = check_settings(
        decoders="ss", scenarios="merge,roundabout", episodes=1, latency="fixed:200", duration_s=5.0, out=tmp_path
    )
    # The stub crashes on its first question (ss on merge); the other episodes complete and are reported.
    with pytest.raises(KeyboardInterrupt):  # ... until Ctrl-C on the stub's fourth question (ss, roundabout)
        run_drive(settings, StubPlanner(0.0, fail_on=(1,), interrupt_on=4))
    kept = [json.loads(p.read_text()) for p in (tmp_path / "episodes").glob("*.json")]  # whole files only
    assert sorted((r["label"], r["scenario"]) for r in kept) == [
        ("constant-velocity", "merge"),
        ("expert-drives", "merge"),
        ("expert-plans", "merge"),
    ]
    started, outcomes = [], []
    report = run_drive(settings, StubPlanner(0.0), lambda todo, done: started.append((todo, done)), outcomes.append)
    assert started == [(5, 3)] and [o.error for o in outcomes] == [None] * 5
    rows = {row["decoder"]: row for row in report.rows}
    assert rows["ss"]["episodes"] == 2 and rows["expert-drives"]["episodes"] == 2
    assert rows["ss"]["latency_ms"] == 200 and rows["expert-plans"]["latency_ms"] == 0
    assert report.summary_png.stat().st_size > 10_000
    alone = check_settings(
        decoders="ss", scenarios="merge", latency="zero", duration_s=5.0, references=False, out=tmp_path
    )
    failing = run_drive(alone, StubPlanner(0.0, fail_on=(1,)))
    assert len(failing.failures) == 1 and "stub decoder crashed" in failing.failures[0].error


def test_the_embedded_model_drives_with_measured_latency_and_video(tmp_path):
    settings = check_settings(
        decoders="ss",
        scenarios="highway",
        episodes=1,
        latency="measured",
        duration_s=5.0,
        references=False,
        out=tmp_path,
        video=tmp_path / "video",
    )
    report = run_drive(settings)
    (row,) = report.rows
    assert row["planner_calls"] >= 1 and row["invalid_answers"] == 0
    assert row["latency_ms"] > 1 and row["latency_ms"] == pytest.approx(row["measured_ms"])
    (result,) = [json.loads(p.read_text()) for p in (tmp_path / "episodes").glob("*.json")]
    for asked, due, active, charged, *_ in result["plans"]:
        assert due == pytest.approx(asked + charged / 1000) and (active is None or active >= due - 1e-9)
    # How many questions fit in 2 s of driving depends on this machine's speed; each waits for the last answer.
    for (_, due, *_), (asked, *_) in pairwise(result["plans"]):
        assert asked >= due - 1e-9
    (gif,) = (tmp_path / "video").glob("*.gif")
    assert gif.stat().st_size > 10_000
    assert {"decoder", "episodes", "collision_rate", "offroad_rate", "route_completion", "driving_score"} <= set(row)
    assert {"mean_speed_mps", "latency_ms", "by_scenario"} <= set(row)


class DyingPlanner(StubPlanner):
    """Kills its own process, as the out-of-memory killer would, at the first question of an episode that any
    process asks it (the warm-up's car at rest is not one): the process that creates `marker` dies, once."""

    def __init__(self, marker: str):
        super().__init__(0.0)
        self.marker = marker

    def plan(self, decoder, images, history, command, **options):
        if history[-1, 2] > 0:
            try:
                open(self.marker, "x").close()  # noqa: SIM115 - atomic: one process alone creates it
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().plan(decoder, images, history, command, **options)


def _stored(folder) -> dict[str, dict]:
    """Every episode's stored result without the measured and wall times of its questions (what a process's speed
    sets; the latency charged stays)."""
    results = {}
    for path in (folder / "episodes").glob("*.json"):
        result = json.loads(path.read_text())
        result["plans"] = [plan[:4] + plan[6:] for plan in result["plans"]]
        results[path.name] = result
    return results


def _without_times(rows):
    timed = ("measured_ms", "wall_s_per_call", "by_scenario")  # by_scenario holds both per scenario
    return [{k: v for k, v in row.items() if k not in timed} for row in rows]


def test_workers_drive_the_same_episodes_as_one_process(tmp_path):
    common = dict(decoders="ss", scenarios="merge,roundabout", episodes=2, latency="fixed:200", duration_s=5.0)
    alone = run_drive(check_settings(out=tmp_path / "one", **common), StubPlanner(0.0))
    side_by_side = run_drive(check_settings(out=tmp_path / "two", workers=2, **common), StubPlanner(0.0))
    assert not side_by_side.failures and len(side_by_side.outcomes) == 16
    assert [o.job for o in side_by_side.outcomes] == [o.job for o in alone.outcomes]  # the same order
    assert _stored(tmp_path / "two") == _stored(tmp_path / "one")
    assert _without_times(side_by_side.rows) == _without_times(alone.rows)


def test_the_embedded_model_drives_the_same_in_workers(tmp_path):
    # Each worker loads the model itself, with the usable CPUs shared out as torch threads: one process given
    # as many threads drives the same episodes to the same results.
    common = dict(decoders="ss", scenarios="cut-in,late-stop", latency="zero", duration_s=5.0, references=False)
    side_by_side = run_drive(check_settings(out=tmp_path / "two", workers=2, **common))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, usable_cpus() // 2))
    try:
        alone = run_drive(check_settings(out=tmp_path / "one", **common))
    finally:
        torch.set_num_threads(threads)
    assert not side_by_side.failures and side_by_side.rows[0]["planner_calls"] >= 4
    assert _stored(tmp_path / "two") == _stored(tmp_path / "one")
    assert _without_times(side_by_side.rows) == _without_times(alone.rows)


def test_a_worker_that_dies_fails_its_episode_only_and_a_rerun_drives_it(tmp_path):
    settings = check_settings(
        decoders="ss", scenarios="merge,roundabout", episodes=2, latency="zero", duration_s=5.0, workers=2, out=tmp_path
    )
    report = run_drive(settings, DyingPlanner(str(tmp_path / "died")))
    (failure,) = report.failures
    assert failure.job.label == "ss"
    assert failure.error == "its worker process died (killed by SIGKILL, as the out-of-memory killer does)"
    assert len([o for o in report.outcomes if o.result is not None]) == 15
    started = []
    again = run_drive(settings, StubPlanner(0.0), lambda todo, done: started.append((todo, done)))
    assert started == [(1, 15)] and not again.failures


def test_worker_counts_are_refused_in_one_line():
    with pytest.raises(DriveError, match=r"--workers 0 is out of range: give 1 to \d+"):
        check_settings(workers=0)
    with pytest.raises(DriveError, match=f"--workers {max_workers() + 1} is out of range"):
        check_settings(workers=max_workers() + 1)
    with pytest.raises(DriveError, match="--workers 2 with --latency measured"):
        check_settings(decoders="ss", latency="measured", workers=2)
    assert check_settings(decoders=(), latency="measured", workers=2).workers == 2  # references never wait
    assert check_settings(decoders="ss", latency="fixed:100", workers=2).workers == 2
