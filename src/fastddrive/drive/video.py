"""One episode as an animated GIF: the simulator's frames (ego in the ego colour, the other cars) with the
plan in force drawn in green and the answer still being decoded (asked for, not yet due) in orange, with a
dot at every second of each.

Frames are world-aligned top views centred on the ego (highway-env's camera), so a world point p is drawn
at ego_pixel + pixels_per_metre * (p - ego position).

Two planners' GIFs of the same episode can be put side by side (`write_side_by_side`), each half labelled,
the shorter episode holding its last frame; also as an MP4 where imageio-ffmpeg is installed.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageSequence

from fastddrive.core.outputs import atomic_file, write_bytes
from fastddrive.core.schema import WAYPOINT_INTERVAL_S
from fastddrive.drive.closed_loop import RECORD_S, EpisodeTrace
from fastddrive.drive.plan import SAMPLE_S

IN_FORCE, DUE = (30, 170, 60), (240, 140, 0)
LABEL_PX = 16  # the band above each half of a side-by-side video; 224 + 16 keeps the height a multiple of 16
SIDE_BY_SIDE = "side-by-side"  # the subfolder of the video folder that holds them


def safe_name(text: str) -> str:
    """`text` with what a file name should not hold replaced by '_' (decoder specs carry ':' and ',')."""
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text)


def gif_path(folder: Path, label: str, latency: str, scenario: str, seed: int) -> Path:
    """Where a run writes the GIF of `label`'s episode under `latency` (Latency.describe's words)."""
    return folder / f"{safe_name(label)}-{safe_name(latency)}-{scenario}-{seed}.gif"


def side_by_side_path(folder: Path, left: tuple[str, str], right: tuple[str, str], scenario: str, seed: int) -> Path:
    """Where the side-by-side GIF of two (label, latency) planners on one episode goes."""
    name = "-vs-".join(f"{safe_name(label)}-{safe_name(latency)}" for label, latency in (left, right))
    return folder / SIDE_BY_SIDE / f"{name}-{scenario}-{seed}.gif"


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


def _gif_frames(path: Path) -> list[Image.Image]:
    """One image per RECORD_S: a GIF writer merges equal frames into one that lasts longer."""
    step_ms = RECORD_S * 1000
    with Image.open(path) as gif:
        return [
            image
            for frame in ImageSequence.Iterator(gif)
            for image in [frame.convert("RGB")] * max(1, round(frame.info.get("duration", step_ms) / step_ms))
        ]


def side_by_side_frames(
    left: Sequence[Image.Image], right: Sequence[Image.Image], captions: tuple[str, str]
) -> list[Image.Image]:
    """The two episodes' frames side by side under a band with each one's caption; the shorter episode holds
    its last frame (its caption then says it ended), so that both halves show the same simulated time."""
    if not left or not right:
        raise ValueError("an episode without frames cannot be shown side by side")
    width, height = left[0].width + right[0].width, LABEL_PX + max(left[0].height, right[0].height)
    images = []
    for k in range(max(len(left), len(right))):
        image = Image.new("RGB", (width, height), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        for x, frames, caption in ((0, left, captions[0]), (left[0].width, right, captions[1])):
            image.paste(frames[min(k, len(frames) - 1)], (x, LABEL_PX))
            ended = "  (episode over)" if k >= len(frames) else ""
            draw.text((x + 3, 2), caption + ended, fill=(0, 0, 0))
        draw.line((left[0].width, 0, left[0].width, height), fill=(90, 90, 90))  # where one ends and the other starts
        images.append(image)
    return images


def _write_mp4(images: Sequence[Image.Image], path: Path) -> bool:
    """The frames as an H.264 MP4 at the GIF's pace; False (nothing written) without imageio-ffmpeg."""
    try:
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError):  # optional: the GIF is the video
        return False
    with atomic_file(path) as tmp:
        writer = imageio_ffmpeg.write_frames(str(tmp), images[0].size, fps=1 / RECORD_S, macro_block_size=LABEL_PX)
        writer.send(None)  # starts ffmpeg
        for image in images:
            writer.send(np.ascontiguousarray(np.asarray(image.convert("RGB"))))
        writer.close()
    return True


def write_side_by_side(left: Path, right: Path, captions: tuple[str, str], path: Path) -> list[Path]:
    """Two episode GIFs (as write_gif writes them) side by side as one GIF at `path`, and beside it an MP4
    of the same name where imageio-ffmpeg is installed. Returns the files written."""
    images = side_by_side_frames(_gif_frames(left), _gif_frames(right), captions)
    gif = io.BytesIO()
    images[0].save(gif, format="GIF", save_all=True, append_images=images[1:], duration=int(RECORD_S * 1000), loop=0)
    write_bytes(path, gif.getvalue())
    mp4 = path.with_suffix(".mp4")
    return [path, mp4] if _write_mp4(images, mp4) else [path]
