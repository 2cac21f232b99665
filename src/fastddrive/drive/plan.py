"""A plan the car can follow: the planner's 1 s waypoints, upsampled and pinned to the world and the clock.

The planner answers in the ego frame of the moment it was asked (+x forward, +y left); the car follows
the answer later, so it is placed in the world frame of the simulator (x right, y down) at the time the
observation was taken. Between the waypoints it is a cubic spline per axis that starts at the car's own
velocity when it asked: the evaluator's JMT (eval/jmt.py) starts at the first second's mean velocity
instead, and a car that follows that runs ahead of the plan whenever it accelerates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.interpolate import CubicSpline

from fastddrive.core.schema import WAYPOINT_INTERVAL_S

SAMPLE_S = 0.25


def to_world(points_m: np.ndarray, origin_m: np.ndarray, heading_rad: float) -> np.ndarray:
    """Ego-frame points (..., 2) at pose (origin, heading) to the simulator's world frame."""
    c, s = np.cos(heading_rad), np.sin(heading_rad)
    x, y = points_m[..., 0], points_m[..., 1]
    # The ego frame's +y (left) is the world's -y side of the heading, since the world's y points down.
    return np.asarray(origin_m) + np.stack([c * x + s * y, s * x - c * y], axis=-1)


def to_ego(points_m: np.ndarray, origin_m: np.ndarray, heading_rad: float) -> np.ndarray:
    """World points (..., 2) to the ego frame at pose (origin, heading); the inverse of `to_world`."""
    c, s = np.cos(heading_rad), np.sin(heading_rad)
    d = np.asarray(points_m) - np.asarray(origin_m)
    return np.stack([c * d[..., 0] + s * d[..., 1], s * d[..., 0] - c * d[..., 1]], axis=-1)


@dataclass(frozen=True)
class TimedPath:
    """World-frame points (N, 2) at strictly increasing absolute times (N,), N >= 2."""

    times_s: np.ndarray
    points_m: np.ndarray

    @classmethod
    def from_waypoints(
        cls,
        waypoints_m: np.ndarray,
        velocity_mps: np.ndarray,
        origin_m: np.ndarray,
        heading_rad: float,
        time_s: float,
    ) -> TimedPath:
        """(K, 2) ego-frame waypoints at t = 1..K s after `time_s`, asked at pose (origin, heading) with the
        ego-frame velocity (2,)."""
        waypoints = np.asarray(waypoints_m, dtype=float)
        knots_s = WAYPOINT_INTERVAL_S * np.arange(len(waypoints) + 1)
        spline = CubicSpline(
            knots_s, np.vstack([np.zeros((1, 2)), waypoints]), bc_type=((1, np.asarray(velocity_mps)), (2, np.zeros(2)))
        )
        times = np.arange(0.0, knots_s[-1] + SAMPLE_S / 2, SAMPLE_S)
        return cls(time_s + times, to_world(spline(times), origin_m, heading_rad))

    @property
    def end_s(self) -> float:
        return float(self.times_s[-1])

    def _segment_speeds(self) -> tuple[np.ndarray, np.ndarray]:
        lengths = np.linalg.norm(np.diff(self.points_m, axis=0), axis=1)
        dt = np.diff(self.times_s)
        return (self.times_s[:-1] + self.times_s[1:]) / 2, lengths / dt

    def speed_mps(self, time_s: float) -> float:
        """The plan's speed at `time_s`; zero past its end (a plan that runs out stops the car)."""
        if time_s > self.end_s:
            return 0.0
        mids, speeds = self._segment_speeds()
        return float(np.interp(time_s, mids, speeds))

    def accel_mps2(self, time_s: float) -> float:
        """The plan's longitudinal acceleration at `time_s` (the speed controller's feed-forward)."""
        mids, speeds = self._segment_speeds()
        if time_s > self.end_s or len(mids) < 2:
            return 0.0
        # Before the first segment's middle the first segment's rate holds: a plan in force the moment it was
        # asked for (zero latency) would otherwise start every replan without its feed-forward.
        k = int(np.clip(np.searchsorted(mids, time_s, side="right") - 1, 0, len(mids) - 2))
        return float((speeds[k + 1] - speeds[k]) / (mids[k + 1] - mids[k]))
