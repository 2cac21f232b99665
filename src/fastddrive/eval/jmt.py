"""Jerk-minimal upsampling of 1 s waypoints to 4 Hz (DESIGN section 7, as the Fast-dDrive release does).

The origin and the 5 waypoints are knots at t = 0..5 s; per axis, one quintic segment per second with
finite-difference velocity and acceleration at the knots; sampled at t = 0.25, 0.5, ..., 5.0 s.
"""

from __future__ import annotations

import numpy as np

KNOT_INTERVAL_S = 1.0
SAMPLES_PER_SEGMENT = 4


def _derivatives(knots: np.ndarray, dt: float) -> tuple[np.ndarray, np.ndarray]:
    velocity = np.gradient(knots, dt, axis=0)
    acceleration = np.gradient(velocity, dt, axis=0)
    return velocity, acceleration


def jmt_upsample(waypoints_m: np.ndarray, interval_s: float = KNOT_INTERVAL_S) -> np.ndarray:
    """(5, 2) waypoints in metres at t = 1..5 s -> (20, 2) points at t = 0.25..5.0 s."""
    waypoints_m = np.asarray(waypoints_m, dtype=float)
    knots = np.vstack([np.zeros((1, waypoints_m.shape[1])), waypoints_m])
    velocity, acceleration = _derivatives(knots, interval_s)
    t = interval_s * np.arange(1, SAMPLES_PER_SEGMENT + 1) / SAMPLES_PER_SEGMENT
    big_t = interval_s
    out = []
    for k in range(len(knots) - 1):
        p0, p1, v0, v1, a0, a1 = (
            knots[k],
            knots[k + 1],
            velocity[k],
            velocity[k + 1],
            acceleration[k],
            acceleration[k + 1],
        )
        dp = p1 - p0 - v0 * big_t - a0 * big_t**2 / 2
        dv = v1 - v0 - a0 * big_t
        da = a1 - a0
        c3 = (10 * dp - 4 * dv * big_t + da * big_t**2 / 2) / big_t**3
        c4 = (-15 * dp + 7 * dv * big_t - da * big_t**2) / big_t**4
        c5 = (6 * dp - 3 * dv * big_t + da * big_t**2 / 2) / big_t**5
        tt = t[:, None]
        out.append(p0 + v0 * tt + a0 * tt**2 / 2 + c3 * tt**3 + c4 * tt**4 + c5 * tt**5)
    return np.concatenate(out)
