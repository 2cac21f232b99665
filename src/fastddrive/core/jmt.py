"""Jerk-minimal upsampling of 1 s waypoints to 4 Hz, as the official Fast-dDrive / dVLM-AD WOD-E2E evaluator does.

Source: NVlabs/Fast-dLLM `fast_ddrive/eval/evaluate_waymo_metrics.py` (`jmt_interpolate_xy_with_start` and its
helpers). The origin and the 5 waypoints are knots at t = 0..5 s; per axis one quintic per 1 s segment, matching
position, velocity and acceleration at both knots. Knot velocity: central differences, one-sided at the ends
(as `np.gradient`). Knot acceleration: the second difference of positions, except at the first knot, where the
official code takes (v01 - v12) / dt, the second difference with the opposite sign. The 20 points at
t = 0.25..5.0 s are read on the segment starting at floor(t) (the last one for t = 5 s), so t = 1..4 s fall
exactly on the knots.
"""

from __future__ import annotations

import numpy as np

NUM_WAYPOINTS = 5
KNOT_TIMES_S = np.arange(NUM_WAYPOINTS + 1, dtype=float)  # 0, 1, ..., 5 s
SAMPLE_TIMES_S = np.linspace(0.25, 5.0, 20)


def knot_derivatives(knots_m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Official velocity and acceleration at (K, D) knots 1 s apart, K >= 3: ((K, D), (K, D))."""
    p = np.asarray(knots_m, dtype=float)
    velocity = np.gradient(p, axis=0)  # (p[i+1] - p[i-1]) / 2 inside, one-sided differences at the ends
    second = np.diff(p, n=2, axis=0)  # (p[i+1] - p[i]) - (p[i] - p[i-1]), as the official code rounds it
    acceleration = np.concatenate([-second[:1], second, second[-1:]])  # the official sign at the first knot
    return velocity, acceleration


def jmt_upsample(waypoints_m: np.ndarray) -> np.ndarray:
    """(5, 2) waypoints in metres at t = 1..5 s -> (20, 2) points at t = 0.25..5.0 s (official evaluator)."""
    waypoints = np.asarray(waypoints_m, dtype=float)
    if waypoints.shape != (NUM_WAYPOINTS, 2):
        raise ValueError(f"need ({NUM_WAYPOINTS}, 2) waypoints at t = 1..5 s, got shape {waypoints.shape}")
    knots = np.vstack([np.zeros((1, 2)), waypoints])
    v, a = knot_derivatives(knots)
    p0, v0, a0 = knots[:-1], v[:-1], a[:-1]  # (5, 2) per segment
    # The official system for the cubic, quartic and quintic coefficients, with T = 1 s.
    system = np.array([[1.0, 1.0, 1.0], [3.0, 4.0, 5.0], [6.0, 12.0, 20.0]])
    rhs = np.stack([knots[1:] - (p0 + v0 + a0 / 2), v[1:] - (v0 + a0), a[1:] - a0], axis=-1)  # (5, 2, 3)
    # One 3 x 3 solve per segment and axis, as the official code does (its rounding, too).
    c3, c4, c5 = np.moveaxis(np.linalg.solve(np.broadcast_to(system, (*rhs.shape, 3)), rhs[..., None])[..., 0], -1, 0)
    s = np.minimum(np.floor(SAMPLE_TIMES_S).astype(int), NUM_WAYPOINTS - 1)  # segment of each sample time
    tau = (SAMPLE_TIMES_S - KNOT_TIMES_S[s])[:, None]
    return (((c5[s] * tau + c4[s]) * tau + c3[s]) * tau + a0[s] / 2) * tau**2 + v0[s] * tau + p0[s]
