"""One episode as an animated GIF: the simulator's frames (ego in the ego colour, the other cars) with the
plan in force drawn in green and the answer still being decoded (asked for, not yet due) in orange, with a
dot at every second of each.

Frames are world-aligned top views centred on the ego (highway-env's camera), so a world point p is drawn
at ego_pixel + pixels_per_metre * (p - ego position).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fastddrive.core.outputs import write_bytes
from fastddrive.core.schema import WAYPOINT_INTERVAL_S
from fastddrive.drive.closed_loop import RECORD_S, EpisodeTrace
from fastddrive.drive.plan import SAMPLE_S

IN_FORCE, DUE = (30, 170, 60), (240, 140, 0)


def _pixels(points_m: np.ndarray, ego_m: np.ndarray, trace: EpisodeTrace) -> list[tuple[float, float]]:
    px = np.asarray(trace.ego_pixel) + trace.pixels_per_metre * (points_m - ego_m)
    return [(float(u), float(v)) for u, v in px]


def episode_frames(trace: EpisodeTrace) -> list[Image.Image]:
    """The recorded frames with the plans and a caption drawn over them."""
    images = []
    for frame, (in_force, due), ego, now, speed in zip(
        trace.frames, trace.overlays, trace.position_m, trace.time_s, trace.speed_mps, strict=True
    ):
        image = Image.fromarray(frame)
        draw = ImageDraw.Draw(image)
        for points, colour in ((due, DUE), (in_force, IN_FORCE)):
            if points is not None:
                xy = _pixels(points, ego, trace)
                draw.line(xy, fill=colour, width=2)
                for u, v in xy[:: round(WAYPOINT_INTERVAL_S / SAMPLE_S)]:  # a dot every second
                    draw.ellipse((u - 2, v - 2, u + 2, v + 2), fill=colour)
        caption = f"{trace.label}  {trace.scenario} {trace.seed}  t={now:5.2f} s  {speed:4.1f} m/s"
        draw.rectangle((0, 0, image.width, 12), fill=(255, 255, 255))
        draw.text((3, 1), caption, fill=(0, 0, 0))
        images.append(image)
    return images


def write_gif(trace: EpisodeTrace, path: Path) -> Path:
    """Write the episode as a GIF playing in real time (one frame per 0.25 s recorded)."""
    images = episode_frames(trace)
    if not images:
        raise ValueError("the episode was driven without video: no frames to write")
    gif = io.BytesIO()
    images[0].save(gif, format="GIF", save_all=True, append_images=images[1:], duration=int(RECORD_S * 1000), loop=0)
    write_bytes(path, gif.getvalue())
    return path
