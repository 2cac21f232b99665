"""Closed-loop driving metrics: pure functions on arrays (metres, seconds, m/s).

Driving score, in the style of the CARLA leaderboard: route completion times one penalty factor per
infraction, multiplied for every occurrence,
    driving_score = route_completion x 0.60^collisions x 0.65^off_roads x 0.90^ttc_violations
with the leaderboard's factor for a collision with a vehicle (0.60) and for leaving the road its factor for
hitting the static world (0.65); a collision or leaving the road also ends the episode, so its route
completion stops there. A time-to-collision violation (a stretch of time with TTC below TTC_LIMIT_S to the
nearest lead car, not an oncoming one, in the ego's path while the ego is not braking, decelerating by less
than REACTING_MPS2) costs 0.90: the leaderboard has no such infraction, the factor is ours. A car that brakes
for a car that cut in or braked ahead of it is reacting, not infringing. Route completion is the fraction of
the route's goal reached, the goal being what the expert drives in the episode's time (route.py): the expert
keeping the seat completes its route, as a leaderboard route is made to be completed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

TTC_LIMIT_S = 1.5
REACTING_MPS2 = 1.0  # braking harder than this is a response to a closing gap, not a TTC violation
PENALTIES = {"collision": 0.60, "offroad": 0.65, "ttc_violation": 0.90}


def lead_ttc_s(
    positions_m: np.ndarray,
    forward_speed_mps: np.ndarray,
    sizes_m: np.ndarray,
    ego_speed_mps: float,
    ego_size_m: tuple[float, float],
    lateral_speed_mps: np.ndarray | None = None,
) -> float:
    """Time to collision with the nearest lead car in the ego's path: other cars' centres (N, 2) and speeds
    along the ego's heading (N,) in the ego frame (+x forward, +y left), their (length, width) (N, 2). A car
    is in the path when it is ahead and the two footprints overlap sideways, now and, given its sideways
    speeds (N,), still when the gap would close (a car crossing the ego's road ahead of it is not in its
    path). A lead car is one not coming towards the ego: an oncoming car seen ahead while the ego turns
    across its lane is not one the ego follows, and meeting one head-on counts as a collision. inf when no
    lead car closes in."""
    if len(positions_m) == 0:
        return math.inf
    ego_length, ego_width = ego_size_m
    overlap = (ego_width + sizes_m[:, 1]) / 2
    ahead = (positions_m[:, 0] > 0) & (np.abs(positions_m[:, 1]) < overlap) & (forward_speed_mps >= 0)
    gap = np.maximum(positions_m[:, 0] - (ego_length + sizes_m[:, 0]) / 2, 0.0)
    closing = ego_speed_mps - forward_speed_mps
    ttc = np.where(ahead & (closing > 0), gap / np.where(closing > 0, closing, 1.0), np.inf)
    if lateral_speed_mps is not None:
        sideways_then = positions_m[:, 1] + np.asarray(lateral_speed_mps) * np.where(np.isfinite(ttc), ttc, 0.0)
        ttc = np.where(np.abs(sideways_then) < overlap, ttc, np.inf)
    return float(ttc.min())


def longitudinal_jerk_mps3(speed_mps: np.ndarray, dt_s: float) -> np.ndarray:
    """Second differences of the speed: (T - 2,) jerk values."""
    return np.diff(np.asarray(speed_mps, dtype=float), n=2) / dt_s**2


def lateral_accel_mps2(speed_mps: np.ndarray, heading_rad: np.ndarray, dt_s: float) -> np.ndarray:
    """Speed times turn rate: (T - 1,) values."""
    turn_rate = np.diff(np.unwrap(np.asarray(heading_rad, dtype=float))) / dt_s
    return np.asarray(speed_mps, dtype=float)[1:] * turn_rate


def count_events(flags: np.ndarray) -> int:
    """How many separate stretches of True there are."""
    padded = np.concatenate([[False], np.asarray(flags, dtype=bool)])
    return int(np.count_nonzero(padded[1:] & ~padded[:-1]))


def ttc_violation_flags(ttc_s: np.ndarray, speed_mps: np.ndarray, dt_s: float) -> np.ndarray:
    """Records with TTC below TTC_LIMIT_S while the ego brakes by less than REACTING_MPS2 (its deceleration over
    the step into the record; the first record counts as not braking)."""
    accel = np.diff(np.asarray(speed_mps, dtype=float), prepend=float(np.asarray(speed_mps)[0])) / dt_s
    return (np.asarray(ttc_s) < TTC_LIMIT_S) & (accel > -REACTING_MPS2)


def route_completion(progress_m: float, goal_m: float) -> float:
    return float(min(1.0, progress_m / goal_m)) if goal_m > 0 else 1.0


def driving_score(completion: float, infractions: Mapping[str, int]) -> float:
    """Route completion times PENALTIES[kind] ** count for every kind of infraction."""
    return float(completion * math.prod(PENALTIES[kind] ** count for kind, count in infractions.items()))


def episode_metrics(
    speed_mps: np.ndarray,
    heading_rad: np.ndarray,
    ttc_s: np.ndarray,
    progress_m: np.ndarray,
    goal_m: float,
    end_reason: str,
    dt_s: float,
) -> dict[str, float]:
    """The metrics of one episode from its records every `dt_s` seconds."""
    infractions = {
        "collision": int(end_reason == "collision"),
        "offroad": int(end_reason == "offroad"),
        "ttc_violation": count_events(ttc_violation_flags(ttc_s, speed_mps, dt_s)),
    }
    completion = route_completion(float(np.max(progress_m)), goal_m)
    jerk = longitudinal_jerk_mps3(speed_mps, dt_s)
    lateral = lateral_accel_mps2(speed_mps, heading_rad, dt_s)
    return {
        "collision": float(infractions["collision"]),
        "offroad": float(infractions["offroad"]),
        "route_completion": completion,
        "driving_score": driving_score(completion, infractions),
        "mean_speed_mps": float(np.mean(speed_mps)),
        "jerk_mps3": float(np.mean(np.abs(jerk))) if len(jerk) else 0.0,
        "lat_accel_mps2": float(np.mean(np.abs(lateral))) if len(lateral) else 0.0,
        "ttc_violations": float(infractions["ttc_violation"]),
        "driven_s": dt_s * (len(speed_mps) - 1),
    }
