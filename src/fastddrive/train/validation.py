"""What a run reports of itself while it trains: greedy-AR ADE on a few validation samples (DESIGN section 7).

Scored as `fastddrive eval` scores (eval/accuracy.py): an answer that does not parse is the all-zero plan, and
when any sample carries raters only the rated ones count (the WOD-E2E frames that are scored).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastddrive.core.metrics import STEPS_3S, ade_m, scored_plan_m
from fastddrive.core.sample import DrivingSample
from fastddrive.engine.model import BlockDiffusionModel
from fastddrive.planner import Planner


@dataclass(frozen=True)
class ValidationAde:
    ade3_m: float
    ade5_m: float
    invalid: int  # answers that do not parse


def greedy_ar_ade(model: BlockDiffusionModel, samples: list[DrivingSample]) -> ValidationAde:
    """Greedy AR (the scaffold forced on a block-diffusion model, free JSON on an AR one) on every sample."""
    planner = Planner(model)
    rated = any(len(s.rater_scores) for s in samples)
    ade3, ade5, invalid = [], [], 0
    for sample in samples:
        response = planner.plan(sample, "ar").response
        invalid += response is None
        if rated and not len(sample.rater_scores):
            continue
        dense = scored_plan_m(response)
        ade3.append(ade_m(dense, sample.future, STEPS_3S))
        ade5.append(ade_m(dense, sample.future))
    return ValidationAde(_mean(ade3), _mean(ade5), invalid)


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")
