"""The reactive scenarios (data/reactive.py): each is one that the expert survives with zero latency and fails
with enough latency; the oracle does not foresee the staged event, nor does a sample's answer; `reactive` names
all four."""

import pytest
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.core.sample import FUTURE_STEPS
from fastddrive.data.highway import (
    REACTIVE_SCENARIOS,
    SCENARIO_GROUPS,
    check_scenarios,
    episode_samples,
    sample_steps,
    simulate_episode,
)
from fastddrive.drive.closed_loop import drive_episode
from fastddrive.drive.policies import ExpertPolicy
from fastddrive.drive.run import episode_seed

EPISODES = 3  # seed 11, episodes 0..2 of each scenario


@pytest.mark.parametrize("scenario", list(REACTIVE_SCENARIOS))
def test_the_expert_survives_at_zero_latency_and_crashes_a_second_and_a_half_late(scenario):
    seeds = [episode_seed(11, scenario, j) for j in range(EPISODES)]
    kept = [drive_episode(scenario, seed, None, lambda p: 0.0) for seed in seeds]
    assert all(t.end_reason != "collision" for t in kept)  # the expert in the seat
    prompt = [drive_episode(scenario, seed, ExpertPolicy(0.5), lambda p: 0.0) for seed in seeds]
    assert all(t.end_reason != "collision" for t in prompt)  # its plans, in force at once
    late = [drive_episode(scenario, seed, ExpertPolicy(0.5), lambda p: 1500.0) for seed in seeds]
    assert sum(t.end_reason == "collision" for t in late) >= EPISODES - 1, [t.end_reason for t in late]
    # The route's goal is what the expert in the seat drives in the episode's time (route.py).
    assert all(t.progress_m[-1] >= t.goal_m - 1.0 for t in kept)


def test_no_sample_answers_with_an_event_still_to_come():
    scenario = "late-stop"  # its event comes at a place, not a time: the rule reads the staged car's script
    log = simulate_episode(scenario, episode_seed(11, scenario, 0))
    begun = [step.time_s for step in log.steps if step.events_begun][0]  # the event, seen in the log
    kept = sample_steps(log)
    assert kept and all(log.steps[k + FUTURE_STEPS].events_begun == log.steps[k].events_begun for k in kept)
    # Every second from 3 s whose 5 s future holds the event is left out; the ones after the event stay.
    assert all(log.steps[k].time_s >= begun for k in kept)
    assert [s.time_s for s in episode_samples(scenario, log.seed)] == [log.steps[k].time_s for k in kept]
    assert log.steps[kept[0]].time_s < begun + 1.0


def test_the_group_name_reactive_stands_for_the_four_scenarios_and_a_repeat_is_refused(tmp_path):
    assert check_scenarios(["reactive"]) == list(SCENARIO_GROUPS["reactive"]) == list(REACTIVE_SCENARIOS)
    assert check_scenarios(["highway", "reactive"])[1:] == list(REACTIVE_SCENARIOS)
    result = CliRunner().invoke(
        app, ["drive", "--scenarios", "reactive,cut-in", "--decoders", "ss", "--out", str(tmp_path / "d")]
    )
    assert result.exit_code == 2 and "'cut-in' is named twice" in result.output
    unknown = CliRunner().invoke(app, ["drive", "--scenarios", "reactiv", "--out", str(tmp_path / "d")])
    assert unknown.exit_code == 2 and "reactive" in unknown.output  # the known names include the group
