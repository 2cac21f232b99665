"""The tour `fastddrive demo` gives: fresh simulator scenes planned by several decoders, one answer printed,
pictures of every plan and the speed-accuracy frontier written to a folder (each file atomically), a folder
checked before any work."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fastddrive.core.outputs import write_json
from fastddrive.core.sample import DrivingSample
from fastddrive.decode.result import DecodeResult
from fastddrive.eval.bench import BenchRow, DecoderRun
from fastddrive.eval.plots import draw_frontier, draw_scene
from fastddrive.planner import Planner

DEMO_DECODERS = ("ar", "ar-jump", "sd", "ss", "tts")


def demo_runs(planner: Planner) -> list[DecoderRun]:
    return [DecoderRun(name, name, {}, planner) for name in DEMO_DECODERS]


def write_demo(
    out: Path,
    title: str,
    runs: Sequence[DecoderRun],
    scenes: Sequence[DrivingSample],
    rows: Sequence[BenchRow],
    results: dict[str, list[DecodeResult]],
) -> None:
    """answer.json (ss on the first timed scene), one picture per timed scene with every plan, frontier.png."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "answer.json", results["ss"][0].to_json())
    for k, scene in enumerate(scenes):
        plans = {run.label: results[run.label][k] for run in runs}
        drawn = {label: r.response.trajectory for label, r in plans.items() if r.response is not None}
        draw_scene(scene, out / f"scene-{k}-{scene.scenario}.png", drawn)
    draw_frontier([r.to_json() for r in rows], out / "frontier.png", title=title)
