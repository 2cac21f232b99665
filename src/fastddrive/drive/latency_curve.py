"""The latency curve of a run: driving score and collision rate against the latency charged, one line per
decoder, the references (always at zero latency) as dashed horizontal lines, and each decoder's own
latency marked as a vertical line (its measured time in the run, or given ones, such as a GPU's).

Pure plotting from the rows of `drive.sweep.run_sweep` (or `run_drive`): a row's `latency_ms` is the latency
charged, its `measured_ms` the decoder's own time; a single latency gives one point per decoder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fastddrive.drive.summary import save_figure  # noqa: E402

PANELS = (("driving_score", "driving score"), ("collision_rate", "collision rate"))


def measured_marks(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each decoder's median measured time (ms) over its rows that asked it anything: where to mark it."""
    times: dict[str, list[float]] = {}
    for row in rows:
        if not row["reference"] and row["planner_calls"]:
            times.setdefault(row["decoder"], []).append(row["measured_ms"])
    return {decoder: float(np.median(values)) for decoder, values in times.items()}


def draw_latency_curve(
    rows: Sequence[dict[str, Any]], path: Path, marks: Mapping[str, float] | None = None, title: str = ""
) -> Path:
    """PNG at `path`: the two panels of PANELS against the charged latency (ms), and a vertical line at each
    decoder's latency: those of `marks` (decoder -> ms, labelled 'given'), else its measured time in `rows`."""
    note = "given" if marks is not None else "measured"
    marks = marks if marks is not None else measured_marks(rows)
    decoders = list(dict.fromkeys(row["decoder"] for row in rows if not row["reference"]))
    references = [row for row in rows if row["reference"]]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 4.4))
    colours = {name: f"C{i % 10}" for i, name in enumerate(decoders)}
    for axis, (key, name) in zip(axes, PANELS, strict=True):
        for decoder in decoders:
            points = sorted((row["latency_ms"], row[key]) for row in rows if row["decoder"] == decoder)
            axis.plot(*zip(*points, strict=True), "o-", color=colours[decoder], label=decoder)
        for i, row in enumerate(references):  # the yardsticks: no latency of their own
            colour = f"C{(len(decoders) + i) % 10}"
            axis.axhline(row[key], color=colour, linestyle="--", linewidth=1, label=f"{row['decoder']} (zero)")
        for decoder, ms in marks.items():
            axis.axvline(ms, color=colours.get(decoder, "grey"), linestyle=":", linewidth=1.5)
            axis.annotate(
                f"{decoder} {ms:.5g} ms ({note})",
                (ms, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -4),
                textcoords="offset points",
                rotation=90,
                va="top",
                fontsize=7,
                color=colours.get(decoder, "grey"),
            )
        axis.set_xlabel("latency charged (ms)")
        axis.set_ylabel(name)
        axis.set_xlim(left=min(0.0, axis.get_xlim()[0]))
        axis.set_ylim(-0.02, 1.05)  # both are shares of 1
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    return save_figure(fig, title, path)
