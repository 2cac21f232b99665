"""Pictures people look at: trajectories drawn over the scene, the speed-accuracy frontier, the roofline.

Each is written atomically (`outputs.atomic_file`): an interrupted or failed drawing leaves the file as it was."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fastddrive.core.outputs import atomic_file  # noqa: E402
from fastddrive.data.dataset import DrivingSample  # noqa: E402


def _save(fig: plt.Figure, path: str | Path, **options: object) -> Path:
    """Save `fig` to `path` atomically (the format from its suffix) and close it."""
    path = Path(path)
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, **options)
    finally:
        plt.close(fig)
    return path


def draw_scene(
    sample: DrivingSample,
    path: str | Path,
    trajectories: Mapping[str, np.ndarray] | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG of the frame with the ego history, the expert future and any other trajectories.

    `trajectories` maps a label to ego-frame points (N, 2) in metres (for example a decoder's plan).
    """
    image = sample.image
    h, w = image.shape[:2]
    fig, ax = plt.subplots(figsize=(w / 60, h / 60 + 0.5), dpi=100)
    ax.imshow(image)
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.axis("off")
    to_px = sample.view.to_pixels
    history = to_px(sample.history[:, :2])
    ax.plot(history[:, 0], history[:, 1], "o-", color="black", ms=3, lw=1.5, label="history (3 s)")
    future = to_px(np.vstack([[0.0, 0.0], sample.future]))
    ax.plot(future[:, 0], future[:, 1], "-", color="tab:green", lw=2, label="expert future (5 s)")
    waypoints = to_px(np.asarray(sample.response.trajectory))
    ax.plot(waypoints[:, 0], waypoints[:, 1], "s", color="tab:green", ms=4)
    colours = iter(["tab:red", "tab:purple", "tab:orange", "tab:blue", "tab:brown", "tab:pink"])
    for name, points in (trajectories or {}).items():
        px = to_px(np.vstack([[0.0, 0.0], np.asarray(points, dtype=float)]))
        ax.plot(px[:, 0], px[:, 1], "x--", color=next(colours), ms=4, lw=1.5, label=name)
    ax.legend(loc="lower left", fontsize=6, framealpha=0.7)
    meta = sample.response.future_meta_behavior
    ax.set_title(title or f"{sample.sample_id}  {sample.command}  {meta.longitudinal}/{meta.lateral}", fontsize=7)
    return _save(fig, path, bbox_inches="tight")


def draw_frontier(rows: Sequence[Mapping[str, object]], path: str | Path, title: str = "") -> Path:
    """Write the speed-accuracy frontier: median latency (ms, log scale) against ADE@5s (m), one point per
    decoder; `rows` are benchmark rows with `label`, `latency_ms` and `ade5`."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    drawn = sorted((r for r in rows if r.get("ade5") is not None), key=lambda r: r["latency_ms"])
    for k, row in enumerate(drawn):
        ax.scatter(row["latency_ms"], row["ade5"], s=30)
        # Alternate labels above and below: neighbouring decoders often sit at the same accuracy.
        offset = (4, 4 if k % 2 == 0 else -10)
        ax.annotate(
            str(row["label"]), (row["latency_ms"], row["ade5"]), fontsize=7, xytext=offset, textcoords="offset points"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")  # decoders that fail by tens of metres must not flatten the others
    ax.set_xlabel("median latency per answer (ms, log scale)")
    ax.set_ylabel("ADE@5s (m, log scale)")
    ax.set_title(title or "speed-accuracy frontier (lower left is better)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path, bbox_inches="tight")


def draw_roofline(rows: Sequence[Mapping[str, float]], floor_ms: float, path: str | Path, title: str = "") -> Path:
    """Write latency per forward (median, p10-p90 bars) against tokens per forward (log scale), with the
    weight-read floor as a horizontal line; `rows` are roofline rows with `tokens`, `median_ms`, `p10_ms`
    and `p90_ms`."""
    drawn = sorted(rows, key=lambda r: r["tokens"])
    tokens = [r["tokens"] for r in drawn]
    median = np.array([r["median_ms"] for r in drawn])
    spread = [median - [r["p10_ms"] for r in drawn], [r["p90_ms"] for r in drawn] - median]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.errorbar(tokens, median, yerr=spread, fmt="o-", ms=4, capsize=3, label="one forward (median, p10-p90)")
    ax.axhline(floor_ms, color="tab:red", ls="--", lw=1.2, label=f"weight-read floor {floor_ms:.2f} ms")
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_ylim(bottom=0)  # latencies as multiples of the floor must read off the picture
    ax.set_xlabel("new tokens per forward (log scale)")
    ax.set_ylabel("latency per forward (ms)")
    ax.set_title(title or "decode roofline", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path, bbox_inches="tight")
