"""The rows of a run: one per planner (decoders first, then the references), over all scenarios and per
scenario; the rich table and the PNG summary drawn from them.

An episode result is the dict run.py writes per episode: label, decoder, scenario, seed, latency, end_reason,
metrics (metrics.episode_metrics) and plans (one [asked_s, due_s, active_s, charged_ms, measured_ms, wall_s,
valid] per question asked).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from rich.table import Table  # noqa: E402

from fastddrive.core.outputs import atomic_file  # noqa: E402

RATES = {"collision_rate": "collision", "offroad_rate": "offroad"}
MEANS = ("route_completion", "driving_score", "mean_speed_mps", "jerk_mps3", "lat_accel_mps2", "ttc_violations")


def _figures(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over the episodes of one planner; plan timings over all its questions."""
    metrics = [r["metrics"] for r in results]
    plans = np.array([p for r in results for p in r["plans"]], dtype=float).reshape(-1, 7)
    row: dict[str, Any] = {"episodes": len(results)}
    row |= {name: float(np.mean([m[key] for m in metrics])) for name, key in RATES.items()}
    row |= {name: float(np.mean([m[name] for m in metrics])) for name in MEANS}
    row["planner_calls"] = len(plans)
    row["invalid_answers"] = int((plans[:, 6] == 0).sum())
    for name, column in (("latency_ms", 3), ("measured_ms", 4), ("wall_s_per_call", 5)):
        row[name] = float(plans[:, column].mean()) if len(plans) else 0.0
    return row


def summarise(results: Sequence[dict[str, Any]], labels: Sequence[str], failed: dict[str, int]) -> list[dict[str, Any]]:
    """One row per label with results, in the order of `labels`; `failed` counts the episodes that crashed."""
    rows = []
    for label in labels:
        mine = [r for r in results if r["label"] == label]
        if not mine:
            continue
        scenarios = dict.fromkeys(r["scenario"] for r in mine)
        rows.append(
            {
                "decoder": label,
                "reference": mine[0]["decoder"] is None,
                "latency": mine[0]["latency"],
                **_figures(mine),
                "failed": failed.get(label, 0),
                "by_scenario": {s: _figures([r for r in mine if r["scenario"] == s]) for s in scenarios},
            }
        )
    return rows


def rows_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    """The table the command line prints: every metric of every planner, all scenarios together."""
    table = Table(title=title)
    columns = ("planner", "latency", "episodes", "driving score", "route compl.", "collision", "off-road")
    columns += ("TTC viol./ep", "speed m/s", "jerk m/s3", "lat. acc m/s2", "latency ms", "wall s/call", "invalid")
    for column in columns:
        table.add_column(column, justify="left" if column in ("planner", "latency") else "right")
    for row in rows:
        table.add_row(
            row["decoder"],
            row["latency"],
            str(row["episodes"]) + (f" ({row['failed']} failed)" if row["failed"] else ""),
            f"{row['driving_score']:.3f}",
            f"{row['route_completion']:.3f}",
            f"{row['collision_rate']:.0%}",
            f"{row['offroad_rate']:.0%}",
            f"{row['ttc_violations']:.2f}",
            f"{row['mean_speed_mps']:.1f}",
            f"{row['jerk_mps3']:.2f}",
            f"{row['lat_accel_mps2']:.2f}",
            f"{row['latency_ms']:.0f}",
            f"{row['wall_s_per_call']:.3f}",
            f"{row['invalid_answers']}/{row['planner_calls']}",
        )
    return table


def scenario_table(rows: Sequence[dict[str, Any]]) -> Table:
    """Driving score per planner and scenario (route completion and collision rate in brackets)."""
    scenarios = list(dict.fromkeys(s for row in rows for s in row["by_scenario"]))
    table = Table(title="driving score per scenario (route completion, collision rate)")
    table.add_column("planner")
    for scenario in scenarios:
        table.add_column(scenario, justify="right")
    for row in rows:
        cells = []
        for scenario in scenarios:
            f = row["by_scenario"].get(scenario)
            cells.append(
                ""
                if f is None
                else f"{f['driving_score']:.2f} ({f['route_completion']:.2f}, {f['collision_rate']:.0%})"
            )
        table.add_row(row["decoder"], *cells)
    return table


def paired_table(pairs: Sequence[dict[str, Any]]) -> Table:
    """The paired differences (drive/paired.py): b minus a over the episodes both drove, with the 95% interval."""
    table = Table(title="driving score, b - a over the same episodes (95% bootstrap interval)")
    for column in ("b", "a", "episodes", "b - a", "95% interval", "measurably"):
        table.add_column(column, justify="left" if column in ("b", "a", "measurably") else "right")
    for pair in pairs:
        interval, mean = pair["interval_95"], pair["mean_difference"]
        verdict = "" if interval is None else "better" if interval[0] > 0 else "worse" if interval[1] < 0 else "no"
        table.add_row(
            f"{pair['b']['planner']} ({pair['b']['latency']})",
            f"{pair['a']['planner']} ({pair['a']['latency']})",
            str(pair["episodes"]),
            "" if mean is None else f"{mean:+.3f}",
            "" if interval is None else f"[{interval[0]:+.3f}, {interval[1]:+.3f}]",
            verdict,
        )
    return table


def draw_summary(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """PNG: driving score per scenario and planner; route completion, collision and off-road rates."""
    scenarios = list(dict.fromkeys(s for row in rows for s in row["by_scenario"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(len(rows), 1)
    for i, row in enumerate(rows):
        scores = [row["by_scenario"].get(s, {}).get("driving_score", np.nan) for s in scenarios]
        left.bar(np.arange(len(scenarios)) + i * width, scores, width, label=row["decoder"])
    left.set_xticks(np.arange(len(scenarios)) + width * (len(rows) - 1) / 2, scenarios)
    left.set_ylabel("driving score")
    left.set_ylim(0, 1.05)
    if rows:
        left.legend(fontsize=7, ncol=2)
    measures = (("route_completion", "route completion"), ("collision_rate", "collision"), ("offroad_rate", "off-road"))
    for j, (key, name) in enumerate(measures):
        right.bar(np.arange(len(rows)) + j * 0.27, [row[key] for row in rows], 0.27, label=name)
    right.set_xticks(np.arange(len(rows)) + 0.27, [row["decoder"] for row in rows], rotation=30, ha="right")
    right.set_ylim(0, 1.05)
    right.legend(fontsize=7)
    return save_figure(fig, title, path)


def save_figure(fig: Any, title: str, path: Path) -> Path:
    """Title `fig`, write it to `path` atomically (a picture is whole or as it was) and close it."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return path
