"""A run over several charged latencies: the same episodes driven once per latency, one row per (planner,
latency), and the outputs that span the runs (the side-by-side videos of two planners).

`sweep:0,250,500` charges each value, as a fixed latency, to every decoder of its run; the references,
which always run at zero latency, are driven once (in the first run). Each run is `run_drive` into the same
results folder: an episode's result is named by its latency (run.result_path), so a sweep resumes like one
run, and reuses what an earlier `--latency fixed:250` run in that folder drove. The model is loaded once.
Without scenarios named, a sweep drives the reactive ones: in the default scenarios nothing sudden happens, a
late answer costs little, and the curve is flat (docs/driving.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from fastddrive.data.highway import DEFAULT_SCENARIOS, REACTIVE_SCENARIOS
from fastddrive.decode.registry import parse_decoder_spec
from fastddrive.drive import DriveError
from fastddrive.drive.latency import Latency, LatencyError, parse_sweep
from fastddrive.drive.paired import paired_difference
from fastddrive.drive.policies import DecoderPolicy
from fastddrive.drive.run import (
    DriveReport,
    DriveSettings,
    EpisodeOutcome,
    check_settings,
    held_out_note,
    plan_jobs,
    result_path,
    run_drive,
    title,
    warm_up,
)
from fastddrive.drive.summary import draw_summary
from fastddrive.drive.video import gif_path, side_by_side_path, write_side_by_side
from fastddrive.planner import Planner


@dataclass
class SweepReport:
    """Every run of a sweep (one per latency; a single one when the latency is not a sweep) and their rows."""

    runs: list[DriveReport]
    rows: list[dict[str, Any]]  # one per (planner, latency): each decoder at each latency, then the references
    sweep_ms: list[float] | None  # the latencies of a sweep, None for a single latency
    summary_png: Path
    seconds: float

    @property
    def failures(self) -> list[EpisodeOutcome]:
        """The episodes that crashed, in every run."""
        return [f for run in self.runs for f in run.failures]

    @property
    def shown_rows(self) -> list[dict[str, Any]]:
        """The rows for the pictures and tables that name a row by its planner alone: in a sweep a decoder's
        as 'ar (fixed 250 ms)'."""
        if self.sweep_ms is None:
            return self.rows
        return [
            row if row["reference"] else row | {"decoder": f"{row['decoder']} ({row['latency']})"} for row in self.rows
        ]

    @property
    def title(self) -> str:
        """The title of the tables and pictures."""
        if self.sweep_ms is None:
            return title(self.runs[0].settings)
        s = self.runs[0].settings
        return (
            f"{s.model}: {s.episodes} episode(s) per scenario{held_out_note(s)}, seed {s.seed}, latency swept over "
            f"{', '.join(f'{ms:g}' for ms in self.sweep_ms)} ms, replanning every {s.replan_s} s ({s.device})"
        )

    @cached_property
    def paired(self) -> list[dict[str, Any]]:
        """Driving-score differences over the same episodes (drive/paired.py): every later decoder against every
        earlier one in each run and, in a sweep, each decoder at every latency against itself at the first."""
        results = [o.result for run in self.runs for o in run.outcomes if o.result is not None]
        sides = [[(d, run.settings.latency.describe(d)) for d in run.settings.decoders] for run in self.runs]
        pairs = [(run[i], run[j]) for run in sides for i in range(len(run)) for j in range(i + 1, len(run))]
        pairs += [(sides[0][k], run[k]) for run in sides[1:] for k in range(len(run))]
        return [paired_difference(results, a, b) for a, b in pairs]

    def to_json(self) -> dict[str, Any]:
        """`{"settings": ..., "rows": [...], "paired": [...]}`, settings as DriveReport's; a sweep's say
        `latency: "sweep"` and give `sweep_ms` in place of `fixed_ms`."""
        settings = self.runs[0].to_json()["settings"]
        if self.sweep_ms is not None:
            settings.pop("fixed_ms")
            settings |= {"latency": "sweep", "sweep_ms": self.sweep_ms}
        return {"settings": settings, "rows": self.rows, "paired": self.paired}


def check_sweep(
    latency: str = "measured", scenarios: str | Sequence[str] | None = None, **fields: Any
) -> list[DriveSettings]:
    """The checked settings of each run: one per value of 'sweep:MS,...' (a fixed latency for every decoder,
    the references in the first only), else the one run of `latency`. `scenarios` None: the reactive ones for a
    sweep, the default ones otherwise. Raises as run.check_settings does."""
    sweep = parse_sweep(latency)
    if scenarios is None:  # only None: an empty name is refused by check_settings, not taken for the default
        scenarios = DEFAULT_SCENARIOS if sweep is None else tuple(REACTIVE_SCENARIOS)
    if sweep is None:
        return [check_settings(latency=latency, scenarios=scenarios, **fields)]
    base = check_settings(latency="zero", scenarios=scenarios, **fields)
    if not base.decoders:
        raise LatencyError(f"latency sweep {latency!r} needs a decoder: references always run at zero latency")
    return [
        base.model_copy(
            update={
                "latency": Latency("fixed", dict.fromkeys(base.decoders, ms)),
                "references": base.references and not i,
            }
        )
        for i, ms in enumerate(sweep)
    ]


def check_pair(spec: str, settings: DriveSettings) -> tuple[str, str]:
    """The two planners of '--side-by-side ar,ss': two different planners of the run, and a video folder."""
    names = [name.strip() for name in spec.split(",")]
    if len(names) != 2 or not all(names):
        raise DriveError(f"--side-by-side {spec!r}: name exactly two planners, as ar,ss")
    for name in names:
        if name not in settings.labels:
            raise DriveError(f"--side-by-side {spec!r}: {name!r} is not a planner of this run ({settings.labels})")
    if names[0] == names[1]:
        raise DriveError(f"--side-by-side {spec!r}: name two different planners")
    if settings.video is None:
        raise DriveError("--side-by-side needs --video DIR: the videos are made from the episodes' GIFs")
    return names[0], names[1]


def _needs_model(runs: Sequence[DriveSettings]) -> bool:
    """A decoder's episode is not on disk yet (a damaged file is caught again by run_drive, which then loads)."""
    return any(job.decoder and not result_path(s, job).is_file() for s in runs for job in plan_jobs(s))


def _charged(row: dict[str, Any], latency: Latency) -> dict[str, Any]:
    """`latency_ms` as the value charged, not the mean over the answers (which is 0 for a planner never asked)."""
    if row["reference"] or latency.mode == "zero":
        return row | {"latency_ms": 0.0}
    if latency.mode == "fixed":
        return row | {"latency_ms": latency.fixed_ms[row["decoder"]]}
    return row


def run_sweep(
    runs: Sequence[DriveSettings],
    planner: Planner | None = None,
    on_start: Callable[[DriveSettings, int, int], None] | None = None,
    on_episode: Callable[[EpisodeOutcome], None] | None = None,
) -> SweepReport:
    """Drive each of `runs` (from check_sweep) in turn; `planner` (else the model, loaded once when an episode
    needs it) answers for the decoders. on_start(settings, todo, already done) as each run starts."""
    began = time.perf_counter()
    if _needs_model(runs) and runs[0].workers == 1:  # with workers, each process loads its own copy
        if planner is None:
            from fastddrive.planner import load

            planner = load(runs[0].model, device=runs[0].device)
        if all(run.latency.mode != "measured" for run in runs):  # run_drive warms up only for measured
            # The rows report the measured time whatever is charged (the curve marks it): not the cold first call's.
            warm_up({spec: DecoderPolicy(planner, spec, *parse_decoder_spec(spec)) for spec in runs[0].decoders})
    reports = []
    for settings in runs:
        start = None if on_start is None else lambda todo, done, s=settings: on_start(s, todo, done)
        reports.append(run_drive(settings, planner, start, on_episode))
    rows = [_charged(row, report.settings.latency) for report in reports for row in report.rows]
    order = list(runs[0].labels)  # decoder by decoder, each latency by latency; then the references
    rows.sort(key=lambda row: order.index(row["decoder"]))
    sweep = None if len(runs) == 1 else [run.latency.fixed_ms[run.decoders[0]] for run in runs]
    report = SweepReport(reports, rows, sweep, reports[-1].summary_png, 0.0)
    if sweep is not None:  # each run drew its own: the folder's summary is of them all
        report.summary_png = draw_summary(report.shown_rows, report.summary_png, title=report.title)
    report.seconds = time.perf_counter() - began
    return report


def side_by_side_videos(report: SweepReport, pair: tuple[str, str]) -> list[Path]:
    """One video per episode and latency of the two planners of `pair` (their GIFs, written by the runs, side
    by side) in the video folder's side-by-side/; an episode without both GIFs (driven earlier without
    --video) is skipped. Returns the files written."""
    written: dict[Path, None] = {}
    for run in report.runs:
        settings = run.settings
        if settings.video is None:
            continue
        results = {(o.job.label, o.job.scenario, o.job.seed): o.result for o in run.outcomes}
        latencies = [settings.latency.describe(label if label in settings.decoders else None) for label in pair]
        halves = list(zip(pair, latencies, strict=True))
        for scenario, seed in dict.fromkeys((job.scenario, job.seed) for job in plan_jobs(settings)):
            gifs = [gif_path(settings.video, label, latency, scenario, seed) for label, latency in halves]
            out = side_by_side_path(settings.video, halves[0], halves[1], scenario, seed)
            if out in written or not all(gif.is_file() for gif in gifs):
                continue  # two references make the same pair in every run of a sweep
            captions = [_caption(label, latency, results.get((label, scenario, seed))) for label, latency in halves]
            written |= dict.fromkeys(write_side_by_side(gifs[0], gifs[1], (captions[0], captions[1]), out))
    return list(written)


def _caption(label: str, latency: str, result: dict[str, Any] | None) -> str:
    """The planner and its charged latency; a measured one as the episode's median charge."""
    if latency == "measured" and result and result["plans"]:
        latency = f"measured, median {np.median([p[3] for p in result['plans']]):.0f} ms"
    return f"{label} - latency {latency}"
