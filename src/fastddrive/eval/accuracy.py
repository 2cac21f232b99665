"""Accuracy of a model's answers on a dataset split, through any decoder, next to constant velocity.

DESIGN section 7. Per sample: ADE@3s/5s of the JMT-upsampled waypoints against the logged 4 Hz future,
RFS against the simulated raters where the sample has them, nuScenes-convention L2 and collision rate on
the plan resampled at 2 Hz (t = 0.5..3 s), meta-behaviour and critical objects against the labels. A
sample whose decoding raises is reported in `failures` and the others complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastddrive.data.sample import DrivingSample
from fastddrive.decode.registry import DecoderError, decode
from fastddrive.eval.jmt import jmt_upsample
from fastddrive.eval.metrics import (
    STEPS_3S,
    ade_m,
    collision_at_steps,
    collision_rate,
    constant_velocity_m,
    critical_object_f1,
    meta_accuracy,
    nuscenes_l2_m,
    rater_feedback_score,
)
from fastddrive.model import BlockDiffusionModel
from fastddrive.planner import Planner, prompt_inputs
from fastddrive.scaffold import Scaffold
from fastddrive.schema import DrivingResponse

TWO_HZ = slice(1, 12, 2)  # t = 0.5, 1.0, ..., 3.0 s of a 4 Hz path starting at 0.25 s
AGENTS_TWO_HZ = slice(2, 13, 2)  # the same times of the agents' paths, which start at t = 0


@dataclass
class AccuracyReport:
    """Means over the samples with a valid answer (metres); `invalid` answers did not parse.

    `rfs` is the mean over valid answers of samples with simulated raters (None if none has raters);
    `l2_m` and `collision` follow `nuscenes_l2_m` / `collision_rate` ("stp3" and "uniad" conventions).
    """

    decoder: str
    samples: int
    invalid: int
    ade3_m: float
    ade5_m: float
    cv_ade3_m: float
    cv_ade5_m: float
    longitudinal_accuracy: float
    lateral_accuracy: float
    critical_object_f1: float
    rfs: float | None = None
    l2_m: dict[str, dict[str, float]] = field(default_factory=dict)
    collision: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    per_sample: list[dict[str, object]] = field(default_factory=list)

    @property
    def validity(self) -> float:
        """Share of answers that parse (failed samples count as invalid)."""
        return 1.0 - (self.invalid + len(self.failures)) / self.samples if self.samples else float("nan")

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


def greedy_ar_response(
    model: BlockDiffusionModel, scaffold: Scaffold, sample: DrivingSample
) -> tuple[DrivingResponse | None, list[int]]:
    """Greedy AR answer to a sample: (the response, or None if it does not parse; the token ids).

    A block-diffusion model decodes with the scaffold forced; an AR baseline writes the JSON freely.
    """
    prompt = prompt_inputs(model, sample.command, sample.history, [sample.image])
    result = decode("ar", model, prompt, scaffold)
    return result.response, result.token_ids


def _plan_collisions(dense_m: np.ndarray, sample: DrivingSample) -> np.ndarray:
    """Per 2 Hz step (t = 0.5..3 s), does the ego box on the plan overlap another vehicle's box?"""
    agents = sample.agents[:, AGENTS_TWO_HZ]
    sizes = np.broadcast_to(sample.agent_size[:, None, :], (*agents.shape[:2], 2))
    length, width = sample.ego_size
    return collision_at_steps(dense_m[TWO_HZ], np.concatenate([agents, sizes], axis=-1), length, width)


def evaluate(
    model: BlockDiffusionModel,
    samples: Iterable[DrivingSample],
    decoder: str = "ar",
    options: dict[str, Any] | None = None,
    on_sample: Callable[[], None] | None = None,
) -> AccuracyReport:
    """Answer every sample with `decoder` and score the answers."""
    planner = Planner(model)
    predicted: list[DrivingResponse] = []
    truth: list[DrivingResponse] = []
    ades, cv, rfs, l2, collisions, failures, rows, invalid, count = [], [], [], [], [], [], [], 0, 0
    for sample in samples:
        count += 1
        constant = constant_velocity_m(sample.history)
        cv.append((ade_m(constant, sample.future, STEPS_3S), ade_m(constant, sample.future)))
        row: dict[str, object] = {"sample_id": sample.sample_id, "scenario": sample.scenario, "ade3_m": None}
        row |= {"ade5_m": None, "cv_ade3_m": cv[-1][0], "cv_ade5_m": cv[-1][1]}
        rows.append(row)
        try:
            response = planner.plan(sample, decoder, **(options or {})).response
        except DecoderError:
            raise  # a wrong decoder or option fails every sample alike
        except Exception as err:  # one failed sample is reported; the rest completes
            failures.append(f"{sample.sample_id}: {type(err).__name__}: {err}")
            row["error"] = str(err)
            continue
        finally:
            if on_sample:
                on_sample()
        if response is None:
            invalid += 1
            continue
        predicted.append(response)
        truth.append(sample.response)
        dense = jmt_upsample(np.asarray(response.trajectory))
        ades.append((ade_m(dense, sample.future, STEPS_3S), ade_m(dense, sample.future)))
        row["ade3_m"], row["ade5_m"] = ades[-1]
        l2.append(nuscenes_l2_m(dense[TWO_HZ], sample.future[TWO_HZ]))
        collisions.append(_plan_collisions(dense, sample))
        if len(sample.rater_scores):
            speed = float(np.linalg.norm(sample.history[-1, 2:4]))
            rfs.append(rater_feedback_score(dense, sample.rater_trajectories, sample.rater_scores, speed))
            row["rfs"] = rfs[-1]
    ade3, ade5 = np.mean(ades, axis=0) if ades else (float("nan"), float("nan"))
    cv3, cv5 = np.mean(cv, axis=0) if cv else (float("nan"), float("nan"))
    lon, lat = meta_accuracy(predicted, truth) if predicted else (float("nan"), float("nan"))
    return AccuracyReport(
        decoder=decoder,
        samples=count,
        invalid=invalid,
        ade3_m=float(ade3),
        ade5_m=float(ade5),
        cv_ade3_m=float(cv3),
        cv_ade5_m=float(cv5),
        longitudinal_accuracy=lon,
        lateral_accuracy=lat,
        critical_object_f1=critical_object_f1(predicted, truth) if predicted else float("nan"),
        rfs=float(np.mean(rfs)) if rfs else None,
        l2_m=_mean_nested(l2),
        collision=collision_rate(np.array(collisions)) if collisions else {},
        failures=failures,
        per_sample=rows,
    )


def evaluate_greedy_ar(
    model: BlockDiffusionModel, samples: Iterable[DrivingSample], on_sample: Callable[[], None] | None = None
) -> AccuracyReport:
    """Greedy AR on every sample (scaffold forced on a block-diffusion model, free JSON on an AR one)."""
    return evaluate(model, samples, "ar", on_sample=on_sample)


def _mean_nested(values: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    if not values:
        return {}
    return {k: {h: float(np.mean([v[k][h] for v in values])) for h in values[0][k]} for k in values[0]}
