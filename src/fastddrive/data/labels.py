"""Rules that turn a simulated scene and the expert's future into the target answer (DESIGN section 8).

Everything here is a pure function of ego-frame arrays (metres, seconds, m/s; +x forward, +y left at
t = 0), so the rules can be read and tested without the simulator.

Critical objects (at t = 0; the simulator has only cars, so the other classes stay "no"):
- nearby_vehicle: another vehicle within 20 m along and 6 m across (same or next lane), or 12 m.
- conflicting_vehicle: a vehicle not in the ego lane at t = 0 (|y| > 2 m or heading off by > 20 deg)
  that, within 3 s, is within 6 m of where the expert will be and within 2 m of its lateral position
  (cut-ins, merging and crossing traffic); or any such vehicle within 30 m while the expert yields.
- road_hazard: a crashed, stopped vehicle 0..60 m ahead within 6 m across.

Meta-behaviour (from the expert's own future):
- longitudinal: stop if the speed at 5 s is below 0.5 m/s; else decelerate / accelerate if the speed at
  3 s differs from the speed now by more than 1 m/s; else keep.
- lateral, first rule that holds: a lane change within 5 s -> lane_change_left / _right; change of
  the heading of the expert's lane over 5 s above 30 deg -> left_turn / right_turn; yielding (the
  simulator's right-of-way rule stops the expert, or it slows for a conflicting vehicle) -> yield;
  lane heading change above 10 deg -> lane_follow (a curved lane); otherwise straight.

Explanation: a small grammar with several phrasings per cause (the slower car, the gap, the merge,
the crossing car, the exit, the hazard); the phrasing is drawn from a seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastddrive.core.schema import CRITICAL_OBJECT_CLASSES, MetaBehavior

LANE_HALF_WIDTH_M = 2.0
NEARBY_ALONG_M, NEARBY_ACROSS_M, NEARBY_RADIUS_M = 20.0, 6.0, 12.0
CONFLICT_DISTANCE_M, CONFLICT_HORIZON_STEPS = 6.0, 12  # 3 s at 4 Hz
HAZARD_AHEAD_M = 60.0
STOP_SPEED_MPS = 0.5
SPEED_CHANGE_MPS = 1.0
SPEED_CHANGE_STEP = 12  # 3 s at 4 Hz
TURN_RAD, CURVE_RAD, SAME_HEADING_RAD = np.deg2rad(30.0), np.deg2rad(10.0), np.deg2rad(20.0)


@dataclass(frozen=True)
class Scene:
    """What the rules see of one sample, in the ego frame at t = 0.

    ego_speed (21,) m/s at t = 0..5 s every 0.25 s; ego_future (20, 2) m at t = 0.25..5 s;
    heading_change_rad: the heading of the expert's lane at 5 s minus now, left positive; lane_change: +1 left,
    -1 right, 0 none (the first lane change in the next 5 s); agents (N, 21, 3) x, y [m], heading [rad]
    at t = 0..5 s, NaN once a vehicle has left; agent_speed (N,) m/s and agent_crashed (N,) at t = 0.
    """

    scenario: str
    command: str
    ego_speed: np.ndarray
    ego_future: np.ndarray
    heading_change_rad: float
    lane_change: int
    yielding: bool
    agents: np.ndarray
    agent_speed: np.ndarray
    agent_crashed: np.ndarray


@dataclass(frozen=True)
class Labels:
    critical_objects: dict[str, bool]
    meta: MetaBehavior
    cause: str
    side: str


def _in_ego_lane(xy: np.ndarray) -> np.ndarray:
    return np.abs(xy[..., 1]) <= LANE_HALF_WIDTH_M


def leader_index(scene: Scene) -> int | None:
    """The nearest vehicle ahead in the ego lane (0..50 m) at t = 0, if any."""
    now = scene.agents[:, 0, :2]
    ahead = (now[:, 0] > 0) & (now[:, 0] < 50.0) & _in_ego_lane(now) & ~scene.agent_crashed
    if not ahead.any():
        return None
    candidates = np.flatnonzero(ahead)
    return int(candidates[np.argmin(now[candidates, 0])])


def conflicting(scene: Scene) -> bool:
    now = scene.agents[:, 0]
    off_lane = (np.abs(now[:, 1]) > LANE_HALF_WIDTH_M) | (np.abs(now[:, 2]) > SAME_HEADING_RAD)
    later = scene.agents[:, 1 : CONFLICT_HORIZON_STEPS + 1, :2]
    ego = scene.ego_future[None, :CONFLICT_HORIZON_STEPS]
    with np.errstate(invalid="ignore"):
        close = np.linalg.norm(later - ego, axis=-1) < CONFLICT_DISTANCE_M
        in_path = np.abs(later[..., 1] - ego[..., 1]) < LANE_HALF_WIDTH_M
        cutting_in = off_lane & (close & in_path).any(axis=1)
        near_cross = off_lane & (np.linalg.norm(now[:, :2], axis=1) < 30.0)
    return bool(cutting_in.any() or (scene.yielding and near_cross.any()))


def critical_objects(scene: Scene) -> dict[str, bool]:
    now = scene.agents[:, 0, :2]
    nearby = ((np.abs(now[:, 0]) < NEARBY_ALONG_M) & (np.abs(now[:, 1]) < NEARBY_ACROSS_M)) | (
        np.linalg.norm(now, axis=1) < NEARBY_RADIUS_M
    )
    hazard = scene.agent_crashed & (now[:, 0] > 0) & (now[:, 0] < HAZARD_AHEAD_M) & (np.abs(now[:, 1]) < 6.0)
    flags = dict.fromkeys(CRITICAL_OBJECT_CLASSES, False)
    flags["nearby_vehicle"] = bool(nearby.any())
    flags["conflicting_vehicle"] = conflicting(scene)
    flags["road_hazard"] = bool(hazard.any())
    return flags


def longitudinal(ego_speed: np.ndarray) -> str:
    """Speed decision from the expert's speed profile (m/s at t = 0..5 s every 0.25 s)."""
    if ego_speed[-1] < STOP_SPEED_MPS:
        return "stop"
    change = ego_speed[SPEED_CHANGE_STEP] - ego_speed[0]
    if change < -SPEED_CHANGE_MPS:
        return "decelerate"
    if change > SPEED_CHANGE_MPS:
        return "accelerate"
    return "keep"


def lateral(scene: Scene, lon: str, conflict: bool) -> str:
    if scene.lane_change:
        return "lane_change_left" if scene.lane_change > 0 else "lane_change_right"
    if abs(scene.heading_change_rad) > TURN_RAD:
        return "left_turn" if scene.heading_change_rad > 0 else "right_turn"
    if scene.yielding or (conflict and lon in ("decelerate", "stop")):
        return "yield"
    if abs(scene.heading_change_rad) > CURVE_RAD:
        return "lane_follow"
    return "straight"


def label(scene: Scene) -> Labels:
    """Critical objects, meta-behaviour and the cause the explanation names."""
    objects = critical_objects(scene)
    lon = longitudinal(scene.ego_speed)
    lat = lateral(scene, lon, objects["conflicting_vehicle"])
    leader = leader_index(scene)
    slower_leader = leader is not None and scene.agent_speed[leader] < scene.ego_speed[0] - 0.5
    side = "left" if lat.endswith("left") or scene.heading_change_rad > 0 else "right"
    if objects["road_hazard"] and (lon in ("decelerate", "stop") or "lane_change" in lat):
        cause = "hazard"
    elif lat == "yield":
        cause = "yield_merge" if scene.scenario == "merge" else "yield"
    elif scene.scenario == "exit" and scene.command == "go_right" and lat in ("lane_change_right", "right_turn"):
        cause = "exit"
    elif lat in ("left_turn", "right_turn"):
        cause = "turn"
    elif lat.startswith("lane_change"):
        cause = "pass_slower" if slower_leader else "lane_change_gap"
    elif objects["conflicting_vehicle"] and lon in ("decelerate", "stop"):
        cause = "cut_in"
    elif lon == "stop":
        cause = "stop_queue" if leader is not None else "stop"
    elif lon == "decelerate":
        cause = "slower_leader" if leader is not None else "slow_down"
    elif lon == "accelerate":
        cause = "speed_up_behind" if leader is not None else "speed_up_clear"
    elif lat == "lane_follow":
        cause = "curve"
    else:
        cause = "follow" if leader is not None else "clear"
    return Labels(objects, MetaBehavior(longitudinal=lon, lateral=lat), cause, side)


PLACES = {"intersection": "at the intersection", "roundabout": "in the roundabout", "exit": "onto the exit"}

PHRASINGS: dict[str, tuple[str, ...]] = {
    "hazard": (
        "A crashed car blocks the road ahead, so I {react}.",
        "There is a stopped vehicle ahead after a crash; I {react} to avoid it.",
        "Road hazard ahead: a wrecked car, so I {react}.",
    ),
    "yield": (
        "A car is crossing my path {place}, so I yield and let it go first.",
        "I give way to the vehicle that has priority {place}.",
        "Yielding to the crossing traffic {place} before I continue.",
    ),
    "yield_merge": (
        "A car is merging from the ramp into my lane, so I slow down to let it in.",
        "The merging vehicle needs the gap ahead; I yield to it.",
        "I ease off to leave room for the car merging from the right.",
    ),
    "exit": (
        "My route takes the exit, so I move right toward the off-ramp.",
        "Heading for the exit on the right as the route requires.",
        "I keep right to take the upcoming exit.",
    ),
    "turn": (
        "The route turns {side} {place}, so I follow it.",
        "Turning {side} {place} as the navigation asks.",
        "I take the {side} turn {place}.",
    ),
    "pass_slower": (
        "The car ahead is slower, so I change to the {side} lane to pass it.",
        "I move into the {side} lane to overtake the slower vehicle in front.",
        "A slow car is ahead in my lane; the {side} lane is free, so I change lanes.",
    ),
    "lane_change_gap": (
        "There is a safe gap in the {side} lane, so I change lanes.",
        "I move over to the {side} lane where traffic is lighter.",
        "The {side} lane is clear, so I shift into it.",
    ),
    "cut_in": (
        "A vehicle is cutting into my lane, so I slow down to keep a safe gap.",
        "Another car moves into my path; I brake to give it space.",
        "I slow down because a car from the next lane is merging in front of me.",
    ),
    "stop_queue": (
        "Traffic ahead has stopped, so I stop behind the car in front.",
        "I come to a stop behind the queue ahead.",
    ),
    "stop": (
        "I stop and wait before going on.",
        "I bring the car to a stop here.",
    ),
    "slower_leader": (
        "The car ahead is slower, so I slow down to keep a safe distance.",
        "I brake gently because the vehicle in front is slowing.",
        "Slowing down to keep my gap to the car ahead.",
    ),
    "slow_down": (
        "I reduce my speed for the road ahead.",
        "Slowing down to a safer speed.",
    ),
    "speed_up_behind": (
        "The car ahead is pulling away, so I speed up to follow it.",
        "The gap in front is growing; I accelerate to close it.",
    ),
    "speed_up_clear": (
        "The lane ahead is clear, so I speed up.",
        "No one is in front of me; I accelerate to cruising speed.",
        "The road is open, so I pick up speed.",
    ),
    "curve": (
        "I follow the curve of my lane {place}.",
        "The lane bends, so I steer along it.",
    ),
    "follow": (
        "I follow the car ahead at a steady speed.",
        "Keeping my lane and a constant gap to the vehicle in front.",
        "The car ahead moves at my speed, so I keep following it.",
    ),
    "clear": (
        "The road ahead is clear; I keep my lane and speed.",
        "Nothing blocks my lane, so I continue straight at the same speed.",
        "Clear road: I hold my lane and speed.",
    ),
}


def explanation(labels: Labels, scenario: str, rng: np.random.Generator) -> str:
    """One phrasing of the cause, drawn by `rng`."""
    react = {
        "decelerate": "slow down",
        "stop": "stop",
        "lane_change_left": "change to the left lane",
        "lane_change_right": "change to the right lane",
    }
    template = PHRASINGS[labels.cause][rng.integers(len(PHRASINGS[labels.cause]))]
    text = template.format(
        side=labels.side,
        place=PLACES.get(scenario, "ahead"),
        react=react.get(labels.meta.lateral, react.get(labels.meta.longitudinal, "slow down")),
    )
    return text
