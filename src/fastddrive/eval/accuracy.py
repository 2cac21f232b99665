"""Accuracy of a model's greedy AR answers on a dataset split, next to constant-velocity extrapolation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from fastddrive.data.sample import DrivingSample
from fastddrive.decode.ar import ar_free_decode, ar_scaffold_decode
from fastddrive.eval.metrics import (
    STEPS_3S,
    ade_m,
    constant_velocity_m,
    critical_object_f1,
    meta_accuracy,
    waypoint_ade_m,
)
from fastddrive.model import BlockDiffusionModel
from fastddrive.prompt import chat_text
from fastddrive.scaffold import DEFAULT_EXPLANATION_BUDGET, Scaffold
from fastddrive.schema import DrivingResponse, ResponseError, parse


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


def greedy_ar_response(
    model: BlockDiffusionModel, scaffold: Scaffold, sample: DrivingSample
) -> tuple[DrivingResponse | None, list[int]]:
    """Greedy AR answer to a sample: (the response, or None if it does not parse; the token ids).

    A block-diffusion model decodes with the scaffold forced; an AR baseline writes the JSON freely.
    """
    images = [sample.image] if model.is_vision else []
    prompt = model.encode_prompt(chat_text(sample.command, sample.history, images=len(images)), images)
    if model.info.kind == "autoregressive":
        end = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = ar_free_decode(model, prompt, end, max_new_tokens=len(scaffold) + 16)
        text = model.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        try:
            return parse(text), ids
        except ResponseError:
            return None, ids
    ids = ar_scaffold_decode(model, prompt, scaffold)
    try:
        return scaffold.decode(ids), ids
    except ResponseError:
        return None, ids


def evaluate_greedy_ar(
    model: BlockDiffusionModel,
    samples: Iterable[DrivingSample],
    on_sample: Callable[[], None] | None = None,
) -> AccuracyReport:
    """Greedy AR on every sample (scaffold forced on a block-diffusion model, free JSON on an AR one)."""
    scaffold = Scaffold(model.tokenizer, explanation_budget=model.info.explanation_budget or DEFAULT_EXPLANATION_BUDGET)
    predicted: list[DrivingResponse] = []
    truth: list[DrivingResponse] = []
    ades, cv, failures, rows, count = [], [], [], [], 0
    for sample in samples:
        count += 1
        constant = constant_velocity_m(sample.history)
        cv.append((ade_m(constant, sample.future, STEPS_3S), ade_m(constant, sample.future)))
        response, _ = greedy_ar_response(model, scaffold, sample)
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
