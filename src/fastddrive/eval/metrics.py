"""Driving metrics: pure functions on arrays (metres, seconds). DESIGN section 7."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastddrive.data.sample import FUTURE_INTERVAL_S
from fastddrive.eval.jmt import jmt_upsample
from fastddrive.schema import CRITICAL_OBJECT_CLASSES, DrivingResponse

STEPS_3S = int(round(3.0 / FUTURE_INTERVAL_S))  # the first 12 of 20 points at 4 Hz


def ade_m(predicted_m: np.ndarray, truth_m: np.ndarray, steps: int | None = None) -> float:
    """Average displacement error in metres over the first `steps` points (all by default)."""
    err = np.linalg.norm(np.asarray(predicted_m)[:steps] - np.asarray(truth_m)[:steps], axis=-1)
    return float(err.mean())


def waypoint_ade_m(waypoints_m: np.ndarray, future_m: np.ndarray) -> tuple[float, float]:
    """ADE@3s and ADE@5s of 5 waypoints at 1 s, JMT-upsampled to the 20-point 4 Hz future."""
    dense = jmt_upsample(waypoints_m)
    return ade_m(dense, future_m, STEPS_3S), ade_m(dense, future_m)


def constant_velocity_m(history: np.ndarray, steps: int = 20, interval_s: float = FUTURE_INTERVAL_S) -> np.ndarray:
    """Extrapolate the velocity at t = 0 (history row -1, columns vx, vy in m/s) to (steps, 2) metres."""
    t = interval_s * np.arange(1, steps + 1)[:, None]
    return t * np.asarray(history)[-1, 2:4][None, :]


def meta_accuracy(predicted: Sequence[DrivingResponse], truth: Sequence[DrivingResponse]) -> tuple[float, float]:
    """Accuracy of the longitudinal and the lateral decision."""
    lon = np.mean(
        [
            p.future_meta_behavior.longitudinal == t.future_meta_behavior.longitudinal
            for p, t in zip(predicted, truth, strict=True)
        ]
    )
    lat = np.mean(
        [
            p.future_meta_behavior.lateral == t.future_meta_behavior.lateral
            for p, t in zip(predicted, truth, strict=True)
        ]
    )
    return float(lon), float(lat)


def critical_object_f1(predicted: Sequence[DrivingResponse], truth: Sequence[DrivingResponse]) -> float:
    """Micro-averaged F1 of the "yes" flags over all 12 classes (0 if neither side says yes anywhere)."""
    p = np.array([[r.critical_objects[c] for c in CRITICAL_OBJECT_CLASSES] for r in predicted])
    t = np.array([[r.critical_objects[c] for c in CRITICAL_OBJECT_CLASSES] for r in truth])
    tp, fp, fn = (p & t).sum(), (p & ~t).sum(), (~p & t).sum()
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else 0.0
