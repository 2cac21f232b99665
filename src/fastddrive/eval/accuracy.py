"""Accuracy of a model's greedy AR answers on a dataset split, next to constant-velocity extrapolation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from fastddrive.data.sample import DrivingSample
from fastddrive.eval.metrics import (
    STEPS_3S,
    ade_m,
    constant_velocity_m,
    critical_object_f1,
    meta_accuracy,
    waypoint_ade_m,
)
from fastddrive.model import BlockDiffusionModel
from fastddrive.scaffold import Scaffold
from fastddrive.schema import DrivingResponse


@dataclass
class AccuracyReport:
    """Means over the samples with a valid answer (ADE in metres); `invalid` answers did not parse."""

    samples: int
    invalid: int
    ade3_m: float
    ade5_m: float
    cv_ade3_m: float
    cv_ade5_m: float
    longitudinal_accuracy: float
    lateral_accuracy: float
    critical_object_f1: float
    failures: list[str] = field(default_factory=list)
    per_sample: list[dict[str, object]] = field(default_factory=list)

    def by_scenario(self) -> dict[str, dict[str, float]]:
        """Mean ADE@5s of the model and of constant velocity per scenario (valid answers only)."""
        out: dict[str, dict[str, float]] = {}
        for name in sorted({str(r["scenario"]) for r in self.per_sample}):
            rows = [r for r in self.per_sample if r["scenario"] == name and r["ade5_m"] is not None]
            out[name] = {
                "samples": len(rows),
                "ade5_m": float(np.mean([r["ade5_m"] for r in rows])) if rows else float("nan"),
                "cv_ade5_m": float(np.mean([r["cv_ade5_m"] for r in rows])) if rows else float("nan"),
            }
        return out


def evaluate_greedy_ar(
    model: BlockDiffusionModel,
    samples: Iterable[DrivingSample],
    on_sample: Callable[[], None] | None = None,
) -> AccuracyReport:
    """Greedy AR on every sample (scaffold forced on a block-diffusion model, free JSON on an AR one)."""
    from fastddrive.train.loop import response_of

    scaffold = Scaffold(model.tokenizer, explanation_budget=model.info.explanation_budget or 32)
    recipe = "ar" if model.info.kind == "autoregressive" else "sasd"
    predicted: list[DrivingResponse] = []
    truth: list[DrivingResponse] = []
    ades, cv, failures, rows, count = [], [], [], [], 0
    for sample in samples:
        count += 1
        constant = constant_velocity_m(sample.history)
        cv.append((ade_m(constant, sample.future, STEPS_3S), ade_m(constant, sample.future)))
        response, _ = response_of(model, scaffold, recipe, sample)
        ade = None
        if response is None:
            failures.append(sample.sample_id)
        else:
            predicted.append(response)
            truth.append(sample.response)
            ade = waypoint_ade_m(np.asarray(response.trajectory), sample.future)
            ades.append(ade)
        rows.append(
            {
                "sample_id": sample.sample_id,
                "scenario": sample.scenario,
                "ade3_m": ade and ade[0],
                "ade5_m": ade and ade[1],
                "cv_ade3_m": cv[-1][0],
                "cv_ade5_m": cv[-1][1],
            }
        )
        if on_sample:
            on_sample()
    ade3, ade5 = np.mean(ades, axis=0) if ades else (float("nan"), float("nan"))
    cv3, cv5 = np.mean(cv, axis=0)
    lon, lat = meta_accuracy(predicted, truth) if predicted else (float("nan"), float("nan"))
    return AccuracyReport(
        samples=count,
        invalid=len(failures),
        ade3_m=float(ade3),
        ade5_m=float(ade5),
        cv_ade3_m=float(cv3),
        cv_ade5_m=float(cv5),
        longitudinal_accuracy=lon,
        lateral_accuracy=lat,
        critical_object_f1=critical_object_f1(predicted, truth) if predicted else float("nan"),
        failures=failures,
        per_sample=rows,
    )
