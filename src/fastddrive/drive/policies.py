"""Who plans: a decoder of the loaded model, or a reference planner.

A policy answers an Observation with a Proposal: 5 ego-frame waypoints at t = 1..5 s (or none, when the
answer does not parse) and what the answer cost. The decoder policy only sees what a car would have: the
frame, the ego history and the navigation command. The references are the yardsticks of the table:
- expert-drives: no planner at all, the simulator's IDM/MOBIL driver keeps the seat (the data's own episode;
  closed_loop.drive_episode with no policy);
- expert-plans: that driver rolled out for 5 s from the current state in a copy of the simulator, its
  positions at 1..5 s followed like any answer; an oracle (it reads the whole world, but not the future: the
  staged events of the reactive scenarios are not foreseen) whose answers cost no time. Its gap to
  expert-drives is what 1 s waypoints, replanning and tracking cost by themselves;
- constant-velocity: the current velocity held for 5 s (no turn, no braking), the floor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fastddrive.core.metrics import constant_velocity_m
from fastddrive.core.schema import NUM_WAYPOINTS, WAYPOINT_INTERVAL_S
from fastddrive.data.expert import STEP_HZ, ExpertVehicle
from fastddrive.data.raters import simulator_copy
from fastddrive.data.reactive import ScriptedVehicle
from fastddrive.drive.plan import to_ego
from fastddrive.planner import Planner

EXPERT_DRIVES, EXPERT_PLANS, CONSTANT_VELOCITY = "expert-drives", "expert-plans", "constant-velocity"
REFERENCES = (EXPERT_DRIVES, EXPERT_PLANS, CONSTANT_VELOCITY)
ROLLOUT_RADIUS_M = 150.0  # 5 s at a 30 m/s closing speed
DECISION = ("target_lane_index", "timer", "target_speed", "is_yielding", "yield_timer")


@dataclass(frozen=True)
class Observation:
    """What the planner is given at `time_s`, and the pose its answer is relative to (world frame)."""

    time_s: float
    frame: np.ndarray  # (224, 448, 3) uint8, the data's camera
    history: np.ndarray  # (7, 6), as PlanInputs.history
    command: str
    position_m: np.ndarray
    heading_rad: float
    sim: Any  # the live simulator: only the expert, an oracle, reads it


@dataclass(frozen=True)
class Proposal:
    waypoints_m: np.ndarray | None  # (5, 2) ego frame at the observation; None: no usable answer
    measured_ms: float  # the decoder's own prefill + decode time; 0 for a reference
    error: str | None = None


class Policy(Protocol):
    label: str
    decoder: str | None  # the decoder spec, None for a reference planner

    def start(self, expert: ExpertVehicle) -> None:
        """A new episode: `expert` is the driver the car takes over from."""

    def propose(self, observation: Observation) -> Proposal: ...


class DecoderPolicy:
    """One decoder of a loaded planner, with its options."""

    def __init__(self, planner: Planner, spec: str, name: str, options: dict[str, object]) -> None:
        self.planner, self.name, self.options = planner, name, options
        self.label = self.decoder = spec

    def start(self, expert: ExpertVehicle) -> None:
        return None

    def propose(self, observation: Observation) -> Proposal:
        result = self.planner.plan(
            decoder=self.name,
            images=[observation.frame],
            history=observation.history,
            command=observation.command,
            **self.options,
        )
        waypoints = None if result.response is None else np.array(result.response.trajectory, dtype=float)
        return Proposal(waypoints, result.latency_ms, result.error)


class ConstantVelocityPolicy:
    label, decoder = CONSTANT_VELOCITY, None

    def start(self, expert: ExpertVehicle) -> None:
        return None

    def propose(self, observation: Observation) -> Proposal:
        return Proposal(constant_velocity_m(observation.history, NUM_WAYPOINTS, WAYPOINT_INTERVAL_S), 0.0)


def straight_on(lane: Any, along_m: float) -> np.ndarray:
    """The point `along_m` along the middle of `lane`, continuing straight past its end."""
    end = min(along_m, lane.length)
    heading = lane.heading_at(end)
    return lane.position(end, 0.0) + (along_m - end) * np.array([np.cos(heading), np.sin(heading)])


class ExpertPolicy:
    """The IDM/MOBIL expert rolled out for 5 s in a copy of the simulator. Its decisions carry over from one
    answer to the next, as they would in the expert's own drive: the lane it is changing to, MOBIL's timer,
    and the desired speed and yielding state that the intersection's right-of-way rules set on it.

    Past the end of its planned route its answer goes straight on at the speed it had: the route ends at the
    map's edge, where highway-env sends its cars back into the map by a U-turn, and an answer that turns back
    there made the tracking car cut the turn and leave the road short of the route's end."""

    label, decoder = EXPERT_PLANS, None

    def __init__(self, replan_s: float) -> None:
        self.replan_steps = round(replan_s * STEP_HZ)
        self.decision: dict[str, Any] = {}  # DECISION attributes of the expert at the next question

    def start(self, expert: ExpertVehicle) -> None:
        self.decision = {name: getattr(expert, name) for name in DECISION if hasattr(expert, name)}

    def propose(self, observation: Observation, watch: Callable[[Any], None] | None = None) -> Proposal:
        """The expert's 5 s rollout from the observed state; `watch(world)` sees the copy it drives in before the
        first step and after each (the DAgger labeller records the rollout so)."""
        world = simulator_copy(observation.sim)
        car = world.vehicle
        driver = ExpertVehicle(
            world.road, car.position.copy(), heading=car.heading, speed=car.speed, route=list(car.route)
        )
        # The car's own lane, which keeps to its route's branch at a fork (closed_loop.TrackedVehicle), not
        # the nearest one the new driver would take.
        driver.lane_index, driver.lane, driver.target_lane_index = car.lane_index, car.lane, car.lane_index
        for name, value in self.decision.items():
            if name != "target_lane_index" or value[:2] == car.lane_index[:2]:
                setattr(driver, name, value)
        # Cars that cannot reach the expert within the 5 s are left out: the copy then steps several times faster.
        world.road.vehicles = [
            driver if v is car else v
            for v in world.road.vehicles
            if np.linalg.norm(v.position - car.position) < ROLLOUT_RADIUS_M
        ]
        world.controlled_vehicles[0] = driver
        for vehicle in world.road.vehicles:  # a staged event is not foreseen (data/reactive.py)
            if isinstance(vehicle, ScriptedVehicle):
                vehicle.unannounced()
        idle = world.action_type.actions_indexes["IDLE"]
        positions = []
        every = round(WAYPOINT_INTERVAL_S * STEP_HZ)
        last_road = car.route[-1][:2] if car.route else None
        past_end: tuple[Any, float, float, int] | None = None  # (last lane, along it, speed, step) on leaving
        if watch is not None:
            watch(world)
        for k in range(1, NUM_WAYPOINTS * every + 1):
            target_before = driver.target_lane_index  # it turns for the next lane before its own ends
            world.step(idle)
            if watch is not None:
                watch(world)
            if k == self.replan_steps:
                self.decision = {name: getattr(driver, name) for name in DECISION if hasattr(driver, name)}
            if past_end is None and target_before[:2] == last_road and driver.target_lane_index[:2] != last_road:
                lane = world.road.network.get_lane(target_before)
                past_end = (lane, lane.local_coordinates(driver.position)[0], driver.speed, k)
            if k % every == 0:
                if past_end is None:
                    positions.append(driver.position.copy())
                else:
                    lane, along, speed, left_at = past_end
                    positions.append(straight_on(lane, along + speed * (k - left_at) / STEP_HZ))
        return Proposal(to_ego(np.array(positions), observation.position_m, observation.heading_rad), 0.0)
