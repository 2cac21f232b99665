"""Tracking control: pure pursuit for steering, a PID on speed, both within the vehicle's limits.

The simulator's ego is highway-env's kinematic bicycle: it turns about its centre with half its length as
wheelbase and moves along heading + slip angle beta, tan(beta) = tan(steering) / 2. Pure pursuit aims the
direction of travel at a point one look-ahead distance further along the plan; the speed loop follows the
plan's own speed (zero once the plan runs out) with its acceleration as feed-forward.

The car never reverses: a look-ahead point behind it (a plan that backs up, as highway-env's expert does
when it stopped too close) means brake to a stop with the wheel straight. Steering toward that point at the
plan's unsigned speed would drive forward in a circle, off the road.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from highway_env.vehicle.behavior import IDMVehicle
from highway_env.vehicle.controller import ControlledVehicle
from highway_env.vehicle.kinematics import Vehicle

from fastddrive.drive.plan import TimedPath

MIN_PATH_M = 0.5  # a plan shorter than this says "stand still": no direction to steer to
STOP_GAIN_PER_S = 2.0  # braking for a plan that backs up: this times the speed, within the brake limit


@dataclass(frozen=True)
class VehicleLimits:
    """The traffic's own limits in highway-env (steering of its controlled cars, IDM's acceleration)."""

    max_steering_rad: float = ControlledVehicle.MAX_STEERING_ANGLE
    max_accel_mps2: float = IDMVehicle.ACC_MAX
    max_brake_mps2: float = IDMVehicle.ACC_MAX
    half_wheelbase_m: float = Vehicle.LENGTH / 2


def lookahead_point(points_m: np.ndarray, position_m: np.ndarray, distance_m: float) -> np.ndarray | None:
    """The point `distance_m` further along the polyline than the point of it nearest to `position_m`,
    continuing straight past its end; None for a polyline shorter than MIN_PATH_M."""
    segments = np.diff(points_m, axis=0)
    lengths = np.linalg.norm(segments, axis=1)
    if lengths.sum() < MIN_PATH_M:
        return None
    safe = np.maximum(lengths, 1e-9)
    along = np.clip(np.einsum("ij,ij->i", position_m - points_m[:-1], segments) / safe**2, 0.0, 1.0)
    nearest = points_m[:-1] + along[:, None] * segments
    k = int(np.argmin(np.linalg.norm(nearest - position_m, axis=1)))
    arc = np.concatenate([[0.0], np.cumsum(lengths)])
    target = arc[k] + along[k] * lengths[k] + distance_m
    if target <= arc[-1]:
        return np.array([np.interp(target, arc, points_m[:, 0]), np.interp(target, arc, points_m[:, 1])])
    last = int(np.flatnonzero(lengths > 1e-9)[-1])
    return points_m[-1] + (target - arc[-1]) * segments[last] / lengths[last]


@dataclass
class TrackingController:
    """Steering and acceleration that make the car follow a TimedPath."""

    limits: VehicleLimits = field(default_factory=VehicleLimits)
    lookahead_s: float = 0.6  # look-ahead distance = speed x this, at least min_lookahead_m
    min_lookahead_m: float = 4.0
    kp: float = 2.0  # 1/s
    ki: float = 0.1  # 1/s^2
    kd: float = 0.05
    integral_m: float = 0.0
    previous_error_mps: float | None = None

    def steering_rad(self, position_m: np.ndarray, heading_rad: float, target_m: np.ndarray) -> float:
        """Pure pursuit: the steering whose steady arc passes through the look-ahead point `target_m`."""
        offset = target_m - position_m
        # The arc starts along the direction of travel, heading + beta, and beta is what we are choosing:
        # sin(beta) = 2 h sin(theta - beta) / L_d (h the half wheelbase) solves to the line below.
        theta = np.arctan2(offset[1], offset[0]) - heading_rad
        ratio = 2.0 * self.limits.half_wheelbase_m / max(float(np.linalg.norm(offset)), 1e-6)
        beta = np.arctan2(ratio * np.sin(theta), 1.0 + ratio * np.cos(theta))
        steering = np.arctan(2.0 * np.tan(beta))
        return float(np.clip(steering, -self.limits.max_steering_rad, self.limits.max_steering_rad))

    def control(
        self, position_m: np.ndarray, heading_rad: float, speed_mps: float, path: TimedPath, time_s: float, dt_s: float
    ) -> tuple[float, float]:
        """(steering rad, acceleration m/s^2) that follow `path`; stand still for a look-ahead point behind."""
        distance = max(self.min_lookahead_m, self.lookahead_s * abs(speed_mps))
        target = lookahead_point(path.points_m, position_m, distance)
        if target is None:  # a plan too short to steer along: hold the wheel straight
            return 0.0, self.accel_mps2(speed_mps, path, time_s, dt_s)
        if np.dot(target - position_m, [np.cos(heading_rad), np.sin(heading_rad)]) < 0:
            # Brake in proportion to speed so that the car comes to rest instead of rocking about zero.
            return 0.0, float(np.clip(-STOP_GAIN_PER_S * speed_mps, -self.limits.max_brake_mps2, 0.0))
        return self.steering_rad(position_m, heading_rad, target), self.accel_mps2(speed_mps, path, time_s, dt_s)

    def accel_mps2(self, speed_mps: float, path: TimedPath, time_s: float, dt_s: float) -> float:
        """PID on the speed error around the plan's own acceleration, clipped to the vehicle's limits."""
        error = path.speed_mps(time_s) - speed_mps
        derivative = 0.0 if self.previous_error_mps is None else (error - self.previous_error_mps) / dt_s
        self.previous_error_mps = error
        integral = self.integral_m + error * dt_s
        accel = path.accel_mps2(time_s) + self.kp * error + self.ki * integral + self.kd * derivative
        low, high = -self.limits.max_brake_mps2, self.limits.max_accel_mps2
        if low < accel < high:  # anti-windup: a saturated output does not integrate
            self.integral_m = integral
        return float(np.clip(accel, low, high))
