"""Scenarios where reaction time decides the outcome (issue 37): each stages one sudden event a second or two
after the hand-over (3 s), on a road cleared of other traffic, so that a planner that answers in 0.1 s avoids a
crash that one answering in a second does not.

- lead-brake: one lane; the car ahead brakes at 7-8 m/s^2 down to 3-5 m/s.
- cut-in: two lanes; a car 13-15 m/s slower, in the next lane, changes into the ego's lane 30-36 m ahead.
- closing-gap: merge-v0's ramp; a car 9-11 m/s slower merges into the ego's lane 22-26 m ahead of it.
- late-stop: two lanes; a car stands in the ego's lane; the car ahead changes lanes only when it is 30-36 m
  from it, revealing it late.

The staged cars are scripted (ScriptedVehicle): they keep their speed and lane, ignore the ego, and do their one
manoeuvre at its time (or place); they are not IDM drivers, which would brake early for what they see. The
drivers of these scenes (the expert included) keep a 0.8 s headway, brake firmly and change no lanes
(data/highway.py sets their IDM class settings), so an event is answered by braking. The event's timing and
distances are drawn from the episode's seed. tests/test_reactive.py checks for each scenario that the expert's
plans followed at zero latency survive and that the same plans 1.5 s late crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from highway_env.vehicle.behavior import IDMVehicle
from highway_env.vehicle.kinematics import Vehicle

EGO_SPEED_MPS = 25.0
EXPERT_TARGET_MPS = 40.0  # above the staged cars' speed: the expert follows them, at IDM's gap
IDM_TIME_WANTED_S = 0.8
IDM_COMFORT_ACC_MPS2 = 4.5  # a firmer driver than the default 3: its braking reaches the 6 m/s^2 limit
LEAD_BRAKE_MPS2 = (7.0, 8.0)
LEAD_HEADWAY_S = (1.0, 1.2)
LEAD_FLOOR_MPS = (3.0, 5.0)
CUT_IN_SLOWER_MPS = (13.0, 15.0)
CUT_IN_GAP_M = (30.0, 36.0)
MERGE_SLOWER_MPS = (9.0, 11.0)
MERGE_GAP_M = (22.0, 26.0)
EVENT_S = (4.0, 5.0)  # when the event happens, simulation clock (the planner drives from 3 s)


class ScriptedVehicle(IDMVehicle):
    """A staged car: holds its lane and speed (no IDM braking, no MOBIL), then at `trigger_s` of simulation
    time, or once `trigger` says so, brakes at `brake_mps2` to a stop and/or changes to `cut_to` lane."""

    def __init__(self, road: Any, lane_index: tuple, along_m: float, speed: float, **script: Any) -> None:
        lane = road.network.get_lane(lane_index)
        super().__init__(road, lane.position(along_m, 0.0), lane.heading_at(along_m), speed, target_speed=speed)
        self.lane_index = self.target_lane_index = lane_index
        self.clock_s = 0.0
        self.trigger_s: float = script.get("trigger_s", np.inf)
        self.trigger = script.get("trigger")  # callable(vehicle) -> bool, a place-based trigger
        self.brake_mps2: float = script.get("brake_mps2", 0.0)
        self.floor_mps: float = script.get("floor_mps", 0.0)  # the speed the braking stops at
        self.cut_to: tuple | None = script.get("cut_to")
        self.fired = False

    def act(self, action: Any = None) -> None:
        """Fire the script when its time or place has come; steer to the target lane at the scripted speed."""
        if not self.fired and (self.clock_s >= self.trigger_s or (self.trigger is not None and self.trigger(self))):
            self.fired = True
            if self.cut_to is not None:
                self.target_lane_index = self.cut_to
            if self.brake_mps2:
                self.target_speed = self.floor_mps
        self.follow_road()
        acceleration = 0.0
        if self.fired and self.brake_mps2:
            acceleration = -min(self.brake_mps2, max(self.speed - self.floor_mps, 0.0) * 12)  # down to the floor
        Vehicle.act(self, {"steering": self.steering_control(self.target_lane_index), "acceleration": acceleration})

    def step(self, dt: float) -> None:
        """Move, and keep the script's clock (the simulation's: staged at its start)."""
        super().step(dt)
        self.clock_s += dt

    def unannounced(self) -> None:
        """Keep lane and speed from now on unless the manoeuvre has begun: what a planner's rollout in a copy
        of the simulator may assume of it (the script is the future, which no planner knows)."""
        if not self.fired:
            self.trigger_s, self.trigger = np.inf, None


def events_begun(vehicles: list[Any]) -> int:
    """How many of the staged cars among `vehicles` have begun their manoeuvre."""
    return sum(1 for v in vehicles if isinstance(v, ScriptedVehicle) and v.fired)


@dataclass(frozen=True)
class Staging:
    """Where the ego is when the scene is staged: its road, lane and position along the lane (m)."""

    road: Any
    lane_index: tuple
    along_m: float

    @classmethod
    def of(cls, expert: Any) -> Staging:
        """Where `expert` is now."""
        along, _ = expert.lane.local_coordinates(expert.position)
        return cls(expert.road, expert.lane_index, float(along))

    def lane(self, index: int | None = None) -> tuple:
        """The ego's lane, or lane `index` of its road."""
        return self.lane_index if index is None else (*self.lane_index[:2], index)


def _clear(sim: Any, expert: Any, target_mps: float = EGO_SPEED_MPS) -> Staging:
    """Only the ego on the road, at the scenario's speed and desired speed, in its lane; its staging."""
    sim.road.vehicles = [expert]
    expert.speed, expert.target_speed = EGO_SPEED_MPS, target_mps
    return Staging.of(expert)


def stage_lead_brake(sim: Any, expert: Any, rng: np.random.Generator) -> None:
    """One lane: the car ahead, at the ego's speed, brakes at LEAD_BRAKE_MPS2 down to LEAD_FLOOR_MPS."""
    at = _clear(sim, expert, EXPERT_TARGET_MPS)
    headway_s = rng.uniform(*LEAD_HEADWAY_S)
    along = at.along_m + EGO_SPEED_MPS * headway_s + Vehicle.LENGTH
    brake = float(rng.uniform(*LEAD_BRAKE_MPS2))
    floor = float(rng.uniform(*LEAD_FLOOR_MPS))
    lead = ScriptedVehicle(
        at.road, at.lane(), along, EGO_SPEED_MPS, trigger_s=rng.uniform(*EVENT_S), brake_mps2=brake, floor_mps=floor
    )
    sim.road.vehicles.append(lead)


def stage_cut_in(sim: Any, expert: Any, rng: np.random.Generator) -> None:
    """Two lanes: a car CUT_IN_SLOWER_MPS slower, in the next lane, changes into the ego's lane CUT_IN_GAP_M
    ahead of it (bumper to bumper) at the event."""
    at = _clear(sim, expert)
    other = 1 - at.lane_index[2]
    speed = EGO_SPEED_MPS - rng.uniform(*CUT_IN_SLOWER_MPS)
    event_s = rng.uniform(*EVENT_S)
    # Placed so that at the event it is CUT_IN_GAP_M ahead of the ego (bumper to bumper), closing at the speed gap.
    gap_at_event = rng.uniform(*CUT_IN_GAP_M) + Vehicle.LENGTH
    along = at.along_m + gap_at_event + (EGO_SPEED_MPS - speed) * event_s
    car = ScriptedVehicle(at.road, at.lane(other), along, speed, trigger_s=event_s, cut_to=at.lane())
    sim.road.vehicles.append(car)


def stage_late_stop(sim: Any, expert: Any, rng: np.random.Generator) -> None:
    """Two lanes: a car stands in the ego's lane; the car ahead of the ego changes lanes only when it is 30-36 m
    from it."""
    at = _clear(sim, expert)
    other = 1 - at.lane_index[2]
    headway_s = rng.uniform(0.9, 1.1)
    lead_along = at.along_m + EGO_SPEED_MPS * headway_s + Vehicle.LENGTH
    stopped_along = lead_along + EGO_SPEED_MPS * rng.uniform(*EVENT_S) + rng.uniform(30.0, 36.0)
    lane = at.road.network.get_lane(at.lane())
    stopped = Vehicle(at.road, lane.position(stopped_along, 0.0), lane.heading_at(stopped_along), 0.0)
    reveal_m = rng.uniform(30.0, 36.0) + Vehicle.LENGTH

    def close_to_stopped(car: ScriptedVehicle) -> bool:
        return float(np.linalg.norm(stopped.position - car.position)) < reveal_m

    lead = ScriptedVehicle(
        at.road, at.lane(), lead_along, EGO_SPEED_MPS, trigger=close_to_stopped, cut_to=at.lane(other)
    )
    sim.road.vehicles += [lead, stopped]


def stage_closing_gap(sim: Any, expert: Any, rng: np.random.Generator) -> None:
    """merge-v0: the ego on the main road's right lane; a slower car on the ramp, timed to be on the merge lane
    (b -> c) 6-10 m ahead of the ego at the event, then merging into the ego's lane."""
    sim.road.vehicles = [expert]
    net = sim.road.network
    right, merge_lane = ("a", "b", 1), ("b", "c", 2)
    merge_x = net.get_lane(merge_lane).start[0]
    lane = net.get_lane(right)
    ego_speed = min(EGO_SPEED_MPS, lane.speed_limit or EGO_SPEED_MPS)  # merge-v0's road is limited to 20 m/s
    event_s = rng.uniform(*EVENT_S)
    ahead = rng.uniform(*MERGE_GAP_M) + Vehicle.LENGTH
    ego_x = merge_x - 10.0 - ego_speed * event_s  # 10 m before the merge lane at the event
    expert.position, expert.heading = lane.position(ego_x, 0.0), lane.heading_at(ego_x)
    expert.lane_index = expert.target_lane_index = right
    expert.lane = lane
    expert.speed = expert.target_speed = ego_speed
    speed = ego_speed - rng.uniform(*MERGE_SLOWER_MPS)
    start_x = merge_x - 10.0 + ahead - speed * event_s
    ramp = [("j", "k", 0), ("k", "b", 0), merge_lane]
    index = next(i for i in reversed(ramp) if net.get_lane(i).start[0] <= start_x)
    car = ScriptedVehicle(
        sim.road, index, start_x - net.get_lane(index).start[0], speed, trigger_s=event_s, cut_to=("b", "c", 1)
    )
    car.route = ramp[ramp.index(index) :]
    sim.road.vehicles.append(car)
