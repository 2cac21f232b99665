"""Calibration of Plan-Verify-Fill's planning-token vocabulary (paper 001 section 3, Appendix A.2).

The base decoder (`sd`'s confidence rule at tau_high, over the same section-aligned blocks as `pvf`) runs
on calibration scenes. At every step, each mask outside the base set whose confidence lies in the
calibration band becomes a planning draft of its top-1 token, verified beside the base branch in the step's
forward (`pvf`'s own machinery) and never committed: the event records whether the impact set was not
empty (m_v), verified compatibility (Eq. 3, A) and the verified information gain (A times the entropy
reduction). Tokens with enough events and verifiable events, a high verified rate and a high mean gain form
the vocabulary, written beside the model as `pvf_vocabulary.json`, or where `out` says: a model shipped inside
the installed package is never written, so calibrating one needs an explicit `out` (issue 32).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastddrive.core.outputs import PACKAGE_ROOT, OutputError, check_file_destination
from fastddrive.core.sample import DrivingSample, SampleError
from fastddrive.core.scaffold import DEFAULT_BLOCK_SIZE, Scaffold
from fastddrive.data.dataset import DatasetError, DrivingDataset
from fastddrive.decode.blocks import section_blocks
from fastddrive.decode.planning_vocabulary import (
    VOCABULARY_FILE,
    PlanningToken,
    PlanningVocabulary,
    vocabulary_path,
    write_vocabulary,
)
from fastddrive.decode.pvf import DEFAULT_TAU, BlockWalker, Candidate, Proposal, Verified
from fastddrive.decode.state import Canvas
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs
from fastddrive.engine.model_files import model_path
from fastddrive.eval.accuracy import stored_samples
from fastddrive.planner import Planner, load

DEFAULT_BAND = (0.15, 0.25)  # [tau_cal^l, tau_cal^u), Appendix A.2
# Appendix A.2 keeps n_v >= 50 and m_v >= 20 over 1,000 calibration examples of up to 512 tokens; a scene
# here has 109 values, so the support floors are scaled to what 100 scenes give.
DEFAULT_MIN_EVENTS = 20
DEFAULT_MIN_VERIFIABLE = 10
DEFAULT_MIN_VERIFIED_RATE = 0.9  # rho_ver
DEFAULT_MIN_GAIN = 0.03  # gamma_vig

MAX_SAMPLES = 100_000  # `pvf calibrate --samples`: every calibration scene is held in memory

Progress = Callable[[int, int], None]  # (scenes done, scenes in all)


@dataclass(frozen=True)
class Event:
    """One calibration candidate (Appendix A.2): its token, whether the impact set was not empty, whether
    the draft was verified compatible (A), and its verified information gain (VIG = A * Delta H)."""

    token: int
    verifiable: bool
    compatible: bool
    gain: float


@dataclass
class Probe:
    """The calibration route: every mask in the band becomes a draft that is scored and never committed."""

    band: tuple[float, float]
    events: list[Event] = field(default_factory=list)

    def propose(self, candidates: list[Candidate]) -> Proposal:
        low, high = self.band
        return Proposal("calibration", [[(c.index, c.token)] for c in candidates if low <= c.confidence < high])

    def choose(self, proposal: Proposal, verified: Verified) -> int:
        verifiable = bool(verified.impact_set())
        for branch, fills in enumerate(proposal.drafts, 1):
            compatible = verified.compatible(branch, fills)
            gain = verified.information_gain(branch, fills) if compatible else 0.0
            self.events.append(Event(fills[0][1], verifiable, compatible, gain))
        return 0  # the base decoder's trajectory


@torch.no_grad()
def scene_events(
    model: BlockDiffusionModel,
    prompt: PromptInputs,
    scaffold: Scaffold,
    *,
    tau: float = DEFAULT_TAU,
    block_size: int = DEFAULT_BLOCK_SIZE,
    band: tuple[float, float] = DEFAULT_BAND,
) -> list[Event]:
    """The calibration events of one scene, along the base decoder's trajectory."""
    probe = Probe(band)
    canvas = Canvas.prefill(model, prompt, scaffold)
    BlockWalker(model, canvas, section_blocks(scaffold, block_size), tau, 0, probe).run()
    return probe.events


def select_tokens(
    events: Sequence[Event],
    texts: Callable[[int], str],
    *,
    min_events: int = DEFAULT_MIN_EVENTS,
    min_verifiable: int = DEFAULT_MIN_VERIFIABLE,
    min_verified_rate: float = DEFAULT_MIN_VERIFIED_RATE,
    min_gain: float = DEFAULT_MIN_GAIN,
) -> tuple[list[PlanningToken], list[PlanningToken]]:
    """Appendix A.2's aggregation and filtering rule: (kept, all scored), each by mean gain, highest first."""
    by_token: dict[int, list[Event]] = {}
    for event in events:
        by_token.setdefault(event.token, []).append(event)
    scored = []
    for token, seen in by_token.items():
        verifiable = sum(e.verifiable for e in seen)
        rate = sum(e.compatible for e in seen) / verifiable if verifiable else 0.0
        gain = sum(e.gain for e in seen) / len(seen)
        scored.append(PlanningToken(token, texts(token), len(seen), verifiable, round(rate, 4), round(gain, 4)))
    scored.sort(key=lambda t: (-t.gain, t.id))
    kept = [
        t
        for t in scored
        if t.events >= min_events
        and t.verifiable >= min_verifiable
        and t.verified_rate >= min_verified_rate
        and t.gain >= min_gain
    ]
    return kept, scored


def calibrate(
    planner: Planner,
    scenes: Sequence[DrivingSample],
    *,
    tau: float = DEFAULT_TAU,
    block_size: int = DEFAULT_BLOCK_SIZE,
    band: tuple[float, float] = DEFAULT_BAND,
    min_events: int = DEFAULT_MIN_EVENTS,
    min_verifiable: int = DEFAULT_MIN_VERIFIABLE,
    min_verified_rate: float = DEFAULT_MIN_VERIFIED_RATE,
    min_gain: float = DEFAULT_MIN_GAIN,
    progress: Progress | None = None,
) -> PlanningVocabulary:
    """The planning vocabulary of `planner`'s model calibrated on `scenes` (their labels are not used).

    The base decoder runs at `tau` over blocks of `block_size` (those of the `pvf` runs it serves), the
    calibration band is [band[0], band[1]), and a token is kept with at least `min_events` events (n_min),
    `min_verifiable` of them with a non-empty impact set (m_min), a verified rate of `min_verified_rate`
    (rho_ver) and a mean gain of `min_gain` (gamma_vig). `progress(done, total)` is called before the first
    scene and after each. `counts` holds every scored token as [id, text, events, verifiable, rate, gain].
    """
    if not 0.0 <= band[0] < band[1] <= 1.0:
        raise ValueError(f"the calibration band needs 0 <= low < high <= 1, got [{band[0]}, {band[1]})")
    events: list[Event] = []
    for done, scene in enumerate(scenes):
        if progress is not None:
            progress(done, len(scenes))
        prompt = planner.prompt(scene)
        events += scene_events(planner.model, prompt, planner.scaffold, tau=tau, block_size=block_size, band=band)
    if progress is not None:
        progress(len(scenes), len(scenes))
    tokenizer = planner.model.tokenizer
    thresholds = {
        "min_events": min_events,
        "min_verifiable": min_verifiable,
        "min_verified_rate": min_verified_rate,
        "min_gain": min_gain,
    }
    kept, scored = select_tokens(events, lambda t: tokenizer.decode([t]), **thresholds)
    settings: dict[str, Any] = {"tau": tau, "block_size": block_size, "band": list(band), **thresholds}
    counts: dict[str, Any] = {
        "scenes": len(scenes),
        "events": len(events),
        "verifiable_events": sum(e.verifiable for e in events),
        "compatible_events": sum(e.compatible for e in events),
        "scored_tokens": len(scored),
        "scored": [[t.id, t.text, t.events, t.verifiable, t.verified_rate, t.gain] for t in scored],
    }
    return PlanningVocabulary(tuple(kept), settings, counts)


def _inside_package(path: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(PACKAGE_ROOT)


def vocabulary_destination(model: str | Path, out: str | Path | None, data: str | Path | None = None) -> Path:
    """The file a calibration of `model` writes (`out`, a file or a folder; by default the model folder's
    `VOCABULARY_FILE`), checked before any work: OutputError for a packaged model without `out`, a place
    inside the installed package, the data set, another model folder or any other file of the model's."""
    folder = model_path(str(model))
    if _inside_package(folder) and out is None:
        raise OutputError(
            f"--out is needed: model {str(model)!r} ships inside the installed fastddrive package, which is never "
            "written; give --out FILE.json and decode with pvf:vocabulary=FILE.json"
        )
    if out is None and not folder.is_dir():
        return vocabulary_path(folder)  # no model there: loading it says so, before any calibration
    target = Path(out) if out is not None else folder
    if target.is_dir():
        target = vocabulary_path(target)
    if _inside_package(target):
        raise OutputError(
            f"--out {out}: that is inside the installed fastddrive package, which is never written; "
            "give a path outside it"
        )
    # The model's own files are inputs (its weights, config, tokenizer): only its vocabulary may be replaced.
    mine = folder.is_dir() and not _inside_package(folder)
    model_files = [p for p in folder.iterdir() if p.name != VOCABULARY_FILE] if mine else []
    return check_file_destination(
        target, "--out", suffixes=(".json",), inputs=(data, *model_files), owned=(folder,) if mine else ()
    )


def calibration_scenes(data: str | Path, split: str, samples: int | None = None) -> list[DrivingSample]:
    """The first `samples` scenes of a split (all by default); SampleError names the first that does not read
    (its shard and id), as a calibration over a damaged split would not be the one asked for."""
    if samples is not None and not 1 <= samples <= MAX_SAMPLES:
        raise SampleError(f"--samples {samples}: calibrate on 1 to {MAX_SAMPLES} scenes")
    scenes = []
    for stored in stored_samples(DrivingDataset.open(data), split, 0, samples):
        if stored.sample is None:
            raise SampleError(f"{stored.where}: {stored.problem}; calibrate on a split whose samples read")
        scenes.append(stored.sample)
    if not scenes:
        raise DatasetError(f"split {split!r} of {data} holds no samples to calibrate on")
    return scenes


def calibrate_split(
    model: str | Path,
    data: str | Path,
    split: str = "val",
    *,
    out: str | Path | None = None,
    samples: int | None = None,
    device: str = "cpu",
    progress: Progress | None = None,
    **settings: Any,
) -> tuple[PlanningVocabulary, Path]:
    """Calibrate model `model` (a name or folder, as `fastddrive.load`) on the first `samples` scenes of
    `split` of dataset `data` (all by default) and write the vocabulary to `out` (default: beside the
    model's weights; a packaged model needs `out`: `vocabulary_destination`). `settings` are `calibrate`'s
    keyword options. Returns the vocabulary and its file. The destination and the scenes are checked before
    the model loads."""
    target = vocabulary_destination(model, out, data)
    scenes = calibration_scenes(data, split, samples)
    planner = load(model, device=device)
    vocabulary = calibrate(planner, scenes, progress=progress, **settings)
    vocabulary.settings.update({"model": str(model), "data": str(data), "split": split})
    return vocabulary, write_vocabulary(vocabulary, target)
