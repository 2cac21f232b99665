"""Accuracy of a model's answers on a dataset split, through any decoder, next to constant velocity.

DESIGN section 7, in the official conventions, which `AccuracyReport.conventions` spells out per figure. As the
official Fast-dDrive / dVLM-AD WOD-E2E evaluator (NVlabs/Fast-dLLM `fast_ddrive/eval/evaluate_waymo_metrics.py`)
does: waypoints JMT-upsampled to 4 Hz as it does (`eval/jmt.py`), an answer that does not parse scored as the
zero trajectory and counted, and ADE / RFS over the rated frames only where the split has raters (its ground
truth keeps only frames with rater scores). nuScenes L2 and collisions on the plan resampled at 2 Hz
(t = 0.5..3 s), collisions the ST-P3 / VAD raster way and with the exact rotated-box test. A sample whose
decoding raises, or that does not read back from its shard (a NaN history, a damaged image), is reported in
`failures` by shard and sample id, left out of every figure, and the others complete (issue 32).
`evaluate_split` shares a split among the processes of `accelerate launch` and merges their samples' outcomes
before any figure is computed, so the figures are those of one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastddrive.core.metrics import (
    STEPS_3S,
    ade_m,
    collision_rate,
    constant_velocity_m,
    critical_object_f1,
    meta_accuracy,
    nuscenes_l2_m,
    plan_collisions,
    rater_feedback_score,
    scored_plan_m,
)
from fastddrive.core.sample import DrivingSample, SampleError
from fastddrive.core.scaffold import Scaffold
from fastddrive.core.schema import DrivingResponse
from fastddrive.data.dataset import DatasetError, DrivingDataset, from_row
from fastddrive.decode.registry import DecoderError, decode
from fastddrive.engine.model import BlockDiffusionModel
from fastddrive.eval.parallel import gather, share
from fastddrive.planner import Planner, prompt_inputs

TWO_HZ = slice(1, 12, 2)  # t = 0.5, 1.0, ..., 3.0 s of a 4 Hz path starting at 0.25 s
AGENTS_TWO_HZ = slice(2, 13, 2)  # the same times of the agents' paths, which start at t = 0

_OFFICIAL = "official: over the scored frames, an answer that does not parse as the zero trajectory"
CONVENTIONS: dict[str, str] = {
    "scored": "frames in the official figures: those with rater scores where the split has any, else all",
    "invalid": "answers that do not parse, over all samples (the official evaluator's zero-fallback count)",
    "ade3_m": f"ADE@3s, {_OFFICIAL} (Fast-dDrive WOD-E2E evaluator)",
    "ade5_m": f"ADE@5s, {_OFFICIAL} (Fast-dDrive WOD-E2E evaluator)",
    "ade3_parsed_m": "ADE@3s over the scored frames whose answer parses",
    "ade5_parsed_m": "ADE@5s over the scored frames whose answer parses",
    "cv_ade3_m": "ADE@3s of constant velocity over the scored frames",
    "cv_ade5_m": "ADE@5s of constant velocity over the scored frames",
    "rfs": f"WOD-E2E rater feedback score, {_OFFICIAL}; None without raters",
    "rfs_parsed": "rater feedback score over the scored frames whose answer parses",
    "l2_m": f"nuScenes L2 at 2 Hz, 'stp3' (ST-P3, VAD) and 'uniad' (UniAD) keys, {_OFFICIAL}",
    "collision": f"nuScenes obj_box_col, ST-P3 / VAD raster (metrics.plan_collisions) with the sample's ego size, "
    f"'stp3', 'uniad' and 'any' keys (metrics.collision_rate), {_OFFICIAL}",
    "collision_box": "as collision, with the exact rotated-box overlap test instead of the raster",
    "longitudinal_accuracy": "over every answer that parses",
    "lateral_accuracy": "over every answer that parses",
    "critical_object_f1": "micro F1 over every answer that parses",
}


@dataclass
class AccuracyReport:
    """Figures of one decoder on a split (metres); what each figure is over: `conventions` (CONVENTIONS)."""

    decoder: str
    samples: int
    invalid: int
    scored: int
    ade3_m: float
    ade5_m: float
    ade3_parsed_m: float
    ade5_parsed_m: float
    cv_ade3_m: float
    cv_ade5_m: float
    longitudinal_accuracy: float
    lateral_accuracy: float
    critical_object_f1: float
    rfs: float | None = None
    rfs_parsed: float | None = None
    l2_m: dict[str, dict[str, float]] = field(default_factory=dict)
    collision: dict[str, dict[str, float]] = field(default_factory=dict)
    collision_box: dict[str, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    per_sample: list[dict[str, object]] = field(default_factory=list)
    conventions: dict[str, str] = field(default_factory=lambda: dict(CONVENTIONS))

    @property
    def validity(self) -> float:
        """Share of answers that parse (failed samples count as invalid)."""
        return 1.0 - (self.invalid + len(self.failures)) / self.samples if self.samples else float("nan")

    def by_scenario(self) -> dict[str, dict[str, float]]:
        """Official ADE@5s of the model and of constant velocity per scenario, over the scored frames."""
        out: dict[str, dict[str, float]] = {}
        for name in sorted({str(r["scenario"]) for r in self.per_sample}):
            rows = [r for r in self.per_sample if r["scenario"] == name and r["scored"]]
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


def _plan_collisions(dense_m: np.ndarray, sample: DrivingSample, method: str) -> np.ndarray:
    """Per 2 Hz step (t = 0.5..3 s), does the ego box on the plan hit another vehicle (official counting)?"""
    agents = sample.agents[:, AGENTS_TWO_HZ]
    sizes = np.broadcast_to(sample.agent_size[:, None, :], (*agents.shape[:2], 2))
    boxes = np.concatenate([agents, sizes], axis=-1)
    length, width = sample.ego_size
    return plan_collisions(dense_m[TWO_HZ], sample.future[TWO_HZ], boxes, length, width, method=method)


def _score(dense_m: np.ndarray, sample: DrivingSample) -> dict[str, Any]:
    """Every per-sample figure of one 4 Hz (20, 2) plan (none of the future's for a frame without one)."""
    if not sample.has_future:
        return {}
    scores: dict[str, Any] = {
        "ade3_m": ade_m(dense_m, sample.future, STEPS_3S),
        "ade5_m": ade_m(dense_m, sample.future),
        "l2": nuscenes_l2_m(dense_m[TWO_HZ], sample.future[TWO_HZ]),
        "collision": _plan_collisions(dense_m, sample, "raster"),
        "collision_box": _plan_collisions(dense_m, sample, "box"),
    }
    if len(sample.rater_scores):
        speed = float(np.linalg.norm(sample.history[-1, 2:4]))
        scores["rfs"] = rater_feedback_score(dense_m, sample.rater_trajectories, sample.rater_scores, speed)
    return scores


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


@dataclass(frozen=True)
class StoredSample:
    """A sample of a dataset split as stored: where it is (`where`: its shard and id) and the sample, or why it
    does not read back as one (`problem`; `sample` is None then)."""

    where: str
    sample_id: str
    scenario: str
    sample: DrivingSample | None = None
    problem: str | None = None


def _problem(err: Exception) -> str:
    return str(err) if isinstance(err, (SampleError, DatasetError)) else f"{type(err).__name__}: {err}"


def stored_samples(
    dataset: DrivingDataset, split: str, start: int = 0, stop: int | None = None
) -> Iterator[StoredSample]:
    """Samples `start` to `stop` of a split in order, each read on its own, so that one that does not read (a NaN
    history, a damaged image, a malformed answer) is reported where it is stored instead of ending the read.
    A shard that is missing or fails its checksum is still a DatasetError: no sample of it can be trusted."""
    index = 0
    records = dataset.records or {}
    for path in dataset.shards(split):
        if stop is not None and index >= stop:
            return
        shard = f"{split}/{path.name}"
        recorded = records.get(shard, {}).get("samples")
        if recorded is not None and index + recorded <= start:  # wholly before this share: not read
            index += recorded
            continue
        for k, row in enumerate(dataset._read(path, None).to_pylist()):
            if stop is not None and index >= stop:
                return
            if index >= start:
                sample_id = str(row.get("sample_id") or f"#{k}")
                where, scenario = f"{shard} sample {sample_id}", str(row.get("scenario") or "?")
                try:
                    found = StoredSample(where, sample_id, scenario, from_row(row))
                except Exception as err:  # one damaged sample is reported; the others are read on
                    found = StoredSample(where, sample_id, scenario, problem=_problem(err))
                yield found
            index += 1


@dataclass
class SampleOutcome:
    """One sample answered: its per-sample row, and what the split's figures need (None where it failed)."""

    row: dict[str, object]
    response: DrivingResponse | None = None
    truth: DrivingResponse | None = None
    scores: dict[str, Any] | None = None
    failure: str | None = None


def _unread(stored: StoredSample) -> SampleOutcome:
    row: dict[str, object] = {"sample_id": stored.sample_id, "scenario": stored.scenario, "valid": None}
    row |= {"rated": False, "scored": False, "ade3_m": None, "ade5_m": None, "cv_ade3_m": None, "cv_ade5_m": None}
    row["error"] = stored.problem
    return SampleOutcome(row, failure=f"{stored.where}: {stored.problem}")


def answer_samples(
    planner: Planner,
    samples: Iterable[DrivingSample | StoredSample],
    decoder: str = "ar",
    options: dict[str, Any] | None = None,
    on_sample: Callable[[], None] | None = None,
) -> list[SampleOutcome]:
    """Answer every sample with `decoder` and score each answer on its own. A sample that failed to read
    (a StoredSample with a problem) or to decode is reported, named where it is stored, and left out."""
    outcomes = []
    for item in samples:
        stored = item if isinstance(item, StoredSample) else None
        if stored is not None and stored.sample is None:
            outcomes.append(_unread(stored))
            if on_sample:
                on_sample()
            continue
        sample = stored.sample if stored is not None else item
        where = stored.where if stored is not None else sample.sample_id
        constant = constant_velocity_m(sample.history)
        row: dict[str, object] = {"sample_id": sample.sample_id, "scenario": sample.scenario, "valid": None}
        row |= {"rated": bool(len(sample.rater_scores)), "scored": False, "ade3_m": None, "ade5_m": None}
        row |= {"has_future": sample.has_future, "cv_ade3_m": None, "cv_ade5_m": None}
        if sample.has_future:
            row |= {"cv_ade3_m": ade_m(constant, sample.future, STEPS_3S), "cv_ade5_m": ade_m(constant, sample.future)}
        try:
            response = planner.plan(sample, decoder, **(options or {})).response
        except DecoderError:
            raise  # a wrong decoder or option fails every sample alike
        except Exception as err:  # one failed sample is reported; the rest completes
            row["error"] = str(err)
            outcomes.append(SampleOutcome(row, failure=f"{where}: {type(err).__name__}: {err}"))
            continue
        finally:
            if on_sample:
                on_sample()
        row["valid"] = response is not None
        dense = scored_plan_m(response)
        scores = _score(dense, sample)
        row |= {k: v for k, v in scores.items() if k in ("ade3_m", "ade5_m", "rfs")}
        outcomes.append(SampleOutcome(row, response, sample.response, scores))
    return outcomes


def summarise(decoder: str, outcomes: list[SampleOutcome]) -> AccuracyReport:
    """The split's figures from its samples' outcomes, in the official conventions (module doc)."""
    rows = [o.row for o in outcomes]
    done = [o for o in outcomes if o.scores]  # planned, with a future to score against
    parsed_answers = [o for o in done if o.response is not None]
    predicted = [o.response for o in parsed_answers]
    truth = [o.truth for o in parsed_answers]
    any_rated = any(r["rated"] for r in rows)
    scored = [(o.row, o.scores) for o in done if o.row["rated"] or not any_rated]
    parsed = [(r, s) for r, s in scored if r["valid"]]
    for r, _ in scored:
        r["scored"] = True
    lon, lat = meta_accuracy(predicted, truth) if predicted else (float("nan"), float("nan"))
    return AccuracyReport(
        decoder=decoder,
        samples=len(rows),
        invalid=sum(r["valid"] is False for r in rows),
        scored=len(scored),
        ade3_m=_mean([s["ade3_m"] for _, s in scored]),
        ade5_m=_mean([s["ade5_m"] for _, s in scored]),
        ade3_parsed_m=_mean([s["ade3_m"] for _, s in parsed]),
        ade5_parsed_m=_mean([s["ade5_m"] for _, s in parsed]),
        cv_ade3_m=_mean([float(r["cv_ade3_m"]) for r, _ in scored]),
        cv_ade5_m=_mean([float(r["cv_ade5_m"]) for r, _ in scored]),
        longitudinal_accuracy=lon,
        lateral_accuracy=lat,
        critical_object_f1=critical_object_f1(predicted, truth) if predicted else float("nan"),
        rfs=_mean([s["rfs"] for _, s in scored]) if any_rated and scored else None,
        rfs_parsed=_mean([s["rfs"] for _, s in parsed]) if any_rated and parsed else None,
        l2_m=_mean_nested([s["l2"] for _, s in scored]),
        collision=collision_rate(np.array([s["collision"] for _, s in scored])) if scored else {},
        collision_box=collision_rate(np.array([s["collision_box"] for _, s in scored])) if scored else {},
        failures=[o.failure for o in outcomes if o.failure],
        per_sample=rows,
    )


def evaluate(
    model: BlockDiffusionModel,
    samples: Iterable[DrivingSample],
    decoder: str = "ar",
    options: dict[str, Any] | None = None,
    on_sample: Callable[[], None] | None = None,
) -> AccuracyReport:
    """Answer every sample with `decoder` and score the answers in the official conventions (module doc)."""
    return summarise(decoder, answer_samples(Planner(model), samples, decoder, options, on_sample))


def evaluate_split(
    planner: Planner,
    dataset: DrivingDataset,
    split: str,
    decoders: dict[str, tuple[str, dict[str, Any]]],
    limit: int | None = None,
    on_decoder: Callable[[str, int], Callable[[], None]] | None = None,
) -> dict[str, AccuracyReport]:
    """Every decoder (label -> (name, options)) on the first `limit` samples of a split, data parallel: each
    process answers its share (eval/parallel.py) and every process gets the merged reports, equal to those
    of one process, failures included (a sample that does not read is one: `stored_samples`).
    `on_decoder(label, samples of this process)` gives the per-sample progress callback."""
    total = len(dataset.table(split, columns=["sample_id"]))
    mine = share(range(min(total, limit or total)))
    start, stop = (mine[0], mine[-1] + 1) if mine else (0, 0)
    reports = {}
    for label, (name, options) in decoders.items():
        on_sample = on_decoder(label, len(mine)) if on_decoder else None
        samples = stored_samples(dataset, split, start, stop)
        reports[label] = summarise(name, gather(answer_samples(planner, samples, name, options, on_sample)))
    return reports


def samples_of_training_episodes(
    dataset: DrivingDataset, split: str, limit: int, trained: frozenset[tuple[str, int]]
) -> list[str]:
    """The ids of the split's first `limit` samples whose episode is among `trained` (a model's record, which holds
    simulated episodes only: core/training_episodes.py): figures over them are not held-out ones."""
    if not trained:
        return []
    rows = dataset.table(split, columns=["sample_id", "scenario", "episode_seed"]).slice(0, limit).to_pylist()
    return [row["sample_id"] for row in rows if (row["scenario"], row["episode_seed"]) in trained]


def _mean_nested(values: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    if not values:
        return {}
    return {k: {h: float(np.mean([v[k][h] for v in values])) for h in values[0][k]} for k in values[0]}
