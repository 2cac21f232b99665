"""Simulated raters (issue 5): alternative 5 s futures rolled out from a sample's state, each scored 0..10.

WOD-E2E scores a predicted path against up to 3 rater trajectories with scores in [0, 10] (DESIGN 7).
Here the "raters" are drivers put in the ego seat of a deep copy of the simulator at the sample's step;
the rest of the traffic goes on as the simulator drives it (its random generator is copied too, so
a driver that does what the expert did meets the same traffic). The main episode is never touched.

Drivers, in this order (index 0 is always the expert):
- expert: the expert itself (IDM/MOBIL, its route and desired speed); its rollout is the logged future.
- cautious: IDM with 0.75 x the expert's desired speed, a 2.5 s time gap (the expert's: 1.5 s) and 5 m more
  standstill distance, falling back to them braking no harder than 1.5 m/s^2 (yet braking at least as
  hard as the expert would there, and accelerating no harder); a reluctant MOBIL (politeness 0.5, lane
  change only for a 1 m/s^2 gain).
- lane_change_left / lane_change_right: the expert forced into an adjacent lane (left preferred) that is
  free now (MOBIL's safety test passes: neither the ego nor its new follower must brake harder than
  2 m/s^2) and is not the lane it is already changing to; it then keeps that lane (MOBIL off), IDM as before.
- assertive, where no lane qualifies: 1.2 x the desired speed (lane speed limits still hold), a 1.0 s time
  gap, 3 m less standstill distance and an eager MOBIL (lane change for a 0.1 m/s^2 gain).
Every rollout is 5 s, recorded at 4 Hz (t = 0.25..5 s, the timing of the sample's `future`).

Score, from simulator state only. Every term only takes points off, so the score never rises when a
quantity gets worse (constants below; values in brackets):
    score = clip(10 - progress - accel - jerk - lateral - ttc - headway, 0, 10)
    progress = 10 * clip((d_expert - d) / max(d_expert, 10 m), 0, 0.4)   d: path length driven in the 5 s;
               going further than the expert earns nothing; at most 4 points
    accel    = 0.5 per m/s^2 of peak |longitudinal accel| above 4 m/s^2, at most 2 (IDM's hardest, 6 m/s^2: 1)
    jerk     = 0.05 per m/s^3 of peak |longitudinal jerk| above 10 m/s^3, at most 1
    lateral  = 0.1 per m/s^2 of peak |lateral accel| above 6 m/s^2, at most 2 (a lane change: about 1)
    ttc      = 3 * clip((3 s - min time to collision) / 3 s, 0, 1)
    headway  = 2 * clip((0.8 s - min time headway) / 0.8 s, 0, 1)
    then: any crash of the ego within the 5 s -> 0; its centre ever outside the nearest lane sideways
    (off the road) -> at most 2.
Longitudinal accel and jerk are finite differences of the speed at 4 Hz; lateral accel is speed x turn
rate of the driven path (4 Hz positions). Time to collision (gap / closing speed, while closing) and headway
(gap / ego speed, above 1 m/s) use the bumper gap to the nearest car ahead in the ego's lane, and in its
target lane while it changes lanes, heading the same way (within 45 deg), at t = 0.25..5 s.
An expert rollout without incidents scores 8..10 (10 on a clear road); the cautious driver usually 7..9.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from highway_env import utils

from fastddrive.core.sample import FUTURE_STEPS
from fastddrive.data.expert import STEP_HZ, ExpertVehicle

RULE_VERSION = 1  # bump when a driver or the score rule changes: datasets record it in their manifest
DRIVERS = ("expert", "cautious", "lane_change_left | lane_change_right | assertive")

# Drivers and score: the module docstring quotes these values.
CAUTIOUS_SPEED_FACTOR = 0.75
CAUTIOUS_EASE_OFF_MPS2 = 1.5
CAUTIOUS_TIME_GAP_S = 2.5
CAUTIOUS_EXTRA_DISTANCE_M = 5.0
ASSERTIVE_SPEED_FACTOR = 1.2
ASSERTIVE_TIME_GAP_S = 1.0

MAX_SCORE = 10.0
PROGRESS_POINTS, PROGRESS_FLOOR_M, PROGRESS_MAX_SHORTFALL = 10.0, 10.0, 0.4
ACCEL_COMFORT_MPS2, ACCEL_POINTS_PER_MPS2, ACCEL_MAX_POINTS = 4.0, 0.5, 2.0
JERK_COMFORT_MPS3, JERK_POINTS_PER_MPS3, JERK_MAX_POINTS = 10.0, 0.05, 1.0
# highway-env's lane changes peak at 10..16 m/s^2 sideways (its steering is brisk): a lane change costs
# about a point, a sharp one up to two, and a curve driven at the traffic's speed nothing.
LATERAL_COMFORT_MPS2, LATERAL_POINTS_PER_MPS2, LATERAL_MAX_POINTS = 6.0, 0.1, 2.0
TTC_SAFE_S, TTC_POINTS = 3.0, 3.0
HEADWAY_SAFE_S, HEADWAY_POINTS = 0.8, 2.0
OFF_ROAD_MAX_SCORE = 2.0
MOVING_MPS = 1.0  # below this a headway means nothing
SAME_DIRECTION_RAD = np.deg2rad(45.0)


class CautiousDriver(ExpertVehicle):
    """The expert, slower and further back, getting there gently.

    Its acceleration is IDM's with CAUTIOUS_SPEED_FACTOR x the expert's desired speed, a CAUTIOUS_TIME_GAP_S
    time gap and CAUTIOUS_EXTRA_DISTANCE_M more standstill distance, braking no harder than
    CAUTIOUS_EASE_OFF_MPS2 for that; and never above, nor braking less than, the expert's IDM in its place.
    """

    POLITENESS = 0.5
    LANE_CHANGE_MIN_ACC_GAIN = 1.0

    def acceleration(self, ego_vehicle: Any, front_vehicle: Any = None, rear_vehicle: Any = None) -> float:
        as_expert = super().acceleration(ego_vehicle, front_vehicle, rear_vehicle)
        if ego_vehicle is not self:  # MOBIL also asks about the other cars: they are not cautious
            return as_expert
        # IDM as highway-env writes it (behavior.py: acceleration, desired_gap), with the cautious parameters.
        target = self.target_speed
        if self.lane is not None and self.lane.speed_limit is not None:
            target = float(np.clip(target, 0, self.lane.speed_limit))
        target *= CAUTIOUS_SPEED_FACTOR
        own = self.COMFORT_ACC_MAX * (1 - np.power(max(self.speed, 0) / abs(utils.not_zero(target)), self.DELTA))
        if front_vehicle is not None:
            closing = np.dot(self.velocity - front_vehicle.velocity, self.direction)
            wanted = (
                self.DISTANCE_WANTED
                + CAUTIOUS_EXTRA_DISTANCE_M
                + self.speed * CAUTIOUS_TIME_GAP_S
                + self.speed * closing / (2 * np.sqrt(-self.COMFORT_ACC_MAX * self.COMFORT_ACC_MIN))
            )
            own -= self.COMFORT_ACC_MAX * np.power(wanted / utils.not_zero(self.lane_distance_to(front_vehicle)), 2)
        # Falling back to the longer gap or the lower speed is gentle; braking for danger is as hard as the expert's.
        return float(min(as_expert, max(own, -CAUTIOUS_EASE_OFF_MPS2)))


class AssertiveDriver(ExpertVehicle):
    """The expert, faster, closer behind the car ahead and quicker to change lanes."""

    TIME_WANTED = ASSERTIVE_TIME_GAP_S
    DISTANCE_WANTED = ExpertVehicle.DISTANCE_WANTED - 3.0
    LANE_CHANGE_MIN_ACC_GAIN = 0.1


@dataclass(frozen=True)
class Rollout:
    """One driver's 5 s in a copy of the simulator (world frame: x right, y down, metres)."""

    name: str
    positions: np.ndarray  # (21, 2) at t = 0, 0.25, ..., 5 s
    speeds: np.ndarray  # (21,)
    crashed: bool
    off_road: bool
    min_ttc_s: float
    min_headway_s: float

    @property
    def future(self) -> np.ndarray:
        """(20, 2) positions at t = 0.25..5 s, as the sample's `future` (still in the world frame)."""
        return self.positions[1:]

    @property
    def distance_m(self) -> float:
        return float(np.linalg.norm(np.diff(self.positions, axis=0), axis=1).sum())


@dataclass(frozen=True)
class RaterSet:
    """The raters of one sample: names, world-frame futures (R, 20, 2) and scores (R,)."""

    names: tuple[str, ...]
    positions: np.ndarray
    scores: np.ndarray


def _off_road(ego: Any) -> bool:
    """The ego's centre is outside the nearest lane, sideways (running past where the simulated road stops
    is not leaving it: the world just ends there)."""
    along, across = ego.lane.local_coordinates(ego.position)
    return bool(abs(across) > ego.lane.width_at(along) / 2)


def _lead_times(road: Any, ego: Any) -> tuple[float, float]:
    """Time to collision and time headway to the nearest car ahead in the ego's lane (and target lane).

    A car ahead is one whose centre lies in the lane, ahead of the ego, heading the lane's way within
    SAME_DIRECTION_RAD: crossing and oncoming traffic is not a lead car (a crash with it scores 0 anyway).
    """
    ttc = headway = np.inf
    for lane_index in dict.fromkeys((ego.lane_index, ego.target_lane_index)):
        lane = road.network.get_lane(lane_index)
        s, _ = lane.local_coordinates(ego.position)
        for other in road.vehicles:
            if other is ego:
                continue
            along, across = lane.local_coordinates(other.position)
            if along <= s or abs(across) > lane.width_at(along) / 2:
                continue
            if abs(utils.wrap_to_pi(other.heading - lane.heading_at(along))) > SAME_DIRECTION_RAD:
                continue
            gap = max(along - s - (ego.LENGTH + other.LENGTH) / 2, 0.0)
            closing = ego.speed - other.speed
            if closing > 0:
                ttc = min(ttc, gap / closing)
            if ego.speed > MOVING_MPS:
                headway = min(headway, gap / ego.speed)
    return ttc, headway


class _NoObservation:
    def observe(self) -> None:
        return None


def simulator_copy(sim: Any) -> Any:
    """A copy of the simulator to roll a driver out in: highway-env leaves the viewer out of its copies and the
    RNG state is copied; the gym observation, which nobody reads, is switched off (a sixth of a step's time)."""
    world = copy.deepcopy(sim)
    world.observation_type = _NoObservation()
    return world


def roll_out(sim: Any, name: str, prepare: Callable[[Any], None] | None = None) -> Rollout:
    """Copy the simulator, let `prepare(ego)` turn the copied expert into another driver, and drive 5 s."""
    world = simulator_copy(sim)
    ego = world.vehicle
    if prepare is not None:
        prepare(ego)
    idle = world.action_type.actions_indexes["IDLE"]
    positions, speeds = [ego.position.copy()], [ego.speed]
    crashed = off_road = False
    min_ttc = min_headway = np.inf
    for _ in range(FUTURE_STEPS):
        world.step(idle)
        ego = world.vehicle
        positions.append(ego.position.copy())
        speeds.append(ego.speed)
        crashed |= bool(ego.crashed)
        off_road |= _off_road(ego)
        ttc, headway = _lead_times(world.road, ego)
        min_ttc, min_headway = min(min_ttc, ttc), min(min_headway, headway)
    return Rollout(
        name=name,
        positions=np.array(positions, dtype=float),
        speeds=np.array(speeds, dtype=float),
        crashed=crashed,
        off_road=off_road,
        min_ttc_s=float(min_ttc),
        min_headway_s=float(min_headway),
    )


def _free_side_lane(road: Any, ego: Any) -> tuple[str, tuple] | None:
    """An adjacent lane the ego may move into now, left first: ("left" | "right", lane index).

    Free means safe by MOBIL's own criterion, without its incentive: neither the ego nor the car that would
    follow it in that lane has to brake harder than LANE_CHANGE_MAX_BRAKING_IMPOSED (2 m/s^2), and no car
    overlaps the ego lengthwise. The lane the ego is already changing to is not an alternative.
    """
    net = road.network
    here = net.get_lane(ego.lane_index)
    s, _ = here.local_coordinates(ego.position)
    found = {}
    for index in net.side_lanes(ego.lane_index):
        lane = net.get_lane(index)
        if index == ego.target_lane_index or not lane.is_reachable_from(ego.position):
            continue
        front, rear = road.neighbour_vehicles(ego, index)
        overlaps = any(
            other is not None and abs(ego.lane_distance_to(other, lane)) < (ego.LENGTH + other.LENGTH) / 2
            for other in (front, rear)
        )
        braking = min(
            ego.acceleration(ego_vehicle=ego, front_vehicle=front),
            ego.acceleration(ego_vehicle=rear, front_vehicle=ego),  # 0 when there is no car behind
        )
        if overlaps or braking < -ego.LANE_CHANGE_MAX_BRAKING_IMPOSED:
            continue
        _, lateral = here.local_coordinates(lane.position(s, 0.0))
        found["left" if lateral < 0 else "right"] = index  # lateral grows to the driver's right
    for side in ("left", "right"):
        if side in found:
            return side, found[side]
    return None


def _cautious(ego: Any) -> None:
    # Same state, other driver: a class swap keeps every simulator field. The desired speed stays the
    # expert's: CautiousDriver.acceleration scales it itself, and needs it for the expert's IDM.
    ego.__class__ = CautiousDriver


def _assertive(ego: Any) -> None:
    ego.__class__ = AssertiveDriver
    ego.target_speed = ASSERTIVE_SPEED_FACTOR * ego.target_speed


def _change_lane_to(lane_index: tuple) -> Callable[[Any], None]:
    def prepare(ego: Any) -> None:
        ego.enable_lane_change = False  # MOBIL would often steer straight back
        ego.target_lane_index = lane_index

    return prepare


def roll_out_raters(sim: Any) -> list[Rollout]:
    """The expert, the cautious driver, and a lane change (or the assertive driver) from the current state."""
    ego = sim.vehicle
    rollouts = [roll_out(sim, "expert"), roll_out(sim, "cautious", _cautious)]
    side = _free_side_lane(sim.road, ego)
    if side is not None:
        rollouts.append(roll_out(sim, f"lane_change_{side[0]}", _change_lane_to(side[1])))
    else:
        rollouts.append(roll_out(sim, "assertive", _assertive))
    return rollouts


def penalties(rollout: Rollout, expert_distance_m: float) -> dict[str, float]:
    """The points each term of the score rule (module docstring) takes off a rollout."""
    dt = 1.0 / STEP_HZ
    accel = np.diff(rollout.speeds) / dt
    jerk = np.diff(accel) / dt
    # Lateral: speed x turn rate of the path itself (the car's heading swings more than its path in a lane change).
    moves = np.diff(rollout.positions, axis=0)
    course = np.unwrap(np.arctan2(moves[:, 1], moves[:, 0]))
    length = np.linalg.norm(moves, axis=1)
    moving = (length[1:] > MOVING_MPS * dt) & (length[:-1] > MOVING_MPS * dt)  # a standing car has no course
    lateral = np.where(moving, (length[1:] + length[:-1]) / (2 * dt) * np.diff(course) / dt, 0.0)
    shortfall = (expert_distance_m - rollout.distance_m) / max(expert_distance_m, PROGRESS_FLOOR_M)
    return {
        "progress": PROGRESS_POINTS * float(np.clip(shortfall, 0.0, PROGRESS_MAX_SHORTFALL)),
        "accel": min(ACCEL_POINTS_PER_MPS2 * max(np.abs(accel).max() - ACCEL_COMFORT_MPS2, 0.0), ACCEL_MAX_POINTS),
        "jerk": min(JERK_POINTS_PER_MPS3 * max(np.abs(jerk).max() - JERK_COMFORT_MPS3, 0.0), JERK_MAX_POINTS),
        "lateral": min(
            LATERAL_POINTS_PER_MPS2 * max(np.abs(lateral).max() - LATERAL_COMFORT_MPS2, 0.0), LATERAL_MAX_POINTS
        ),
        "ttc": TTC_POINTS * float(np.clip((TTC_SAFE_S - rollout.min_ttc_s) / TTC_SAFE_S, 0.0, 1.0)),
        "headway": HEADWAY_POINTS * float(np.clip((HEADWAY_SAFE_S - rollout.min_headway_s) / HEADWAY_SAFE_S, 0.0, 1.0)),
    }


def score(rollout: Rollout, expert_distance_m: float) -> float:
    """The 0..10 score of a rollout by the rule in the module docstring."""
    if rollout.crashed:
        return 0.0
    value = float(np.clip(MAX_SCORE - sum(penalties(rollout, expert_distance_m).values()), 0.0, MAX_SCORE))
    return min(value, OFF_ROAD_MAX_SCORE) if rollout.off_road else value


def rate(sim: Any) -> RaterSet:
    """Roll out and score the raters from the simulator's current state (which is left as it was)."""
    rollouts = roll_out_raters(sim)
    expert_distance = rollouts[0].distance_m
    return RaterSet(
        names=tuple(r.name for r in rollouts),
        positions=np.stack([r.future for r in rollouts]),
        scores=np.array([score(r, expert_distance) for r in rollouts]),
    )
