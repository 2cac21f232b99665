"""The other cars' recent past drawn into a top-down frame, as ChauffeurNet renders its agents' past boxes
(Bansal et al., 2018, section 3.1).

One frame cannot tell a car stopped ahead from one cruising at the ego's speed: both are the same box at the
same place. The planner has to brake for the first and follow the second, so each frame also shows where every
other car stood relative to the ego PAST_BOX_AGES_S ago, faded with age. The boxes are placed by their offset
from the ego at that time, so a car closing in leaves its past box ahead of it, one keeping its distance none,
and one pulling away a box behind it. The current cars (and the ego) stay on top, drawn as the renderer drew them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
from PIL import Image, ImageDraw

PAST_BOX_AGES_S = (0.5, 1.0)
PAST_BOX_RGB = (255, 140, 0)  # in none of highway-env's vehicle, road or lane colours
PAST_BOX_OPACITY = (0.6, 0.3)  # per age: older boxes fainter


class Box(Protocol):
    """A vehicle's state as data/highway.py copies it (world frame, metres)."""

    position: np.ndarray
    heading: float
    size: tuple[float, float]  # length, width


def box_corners_px(box: Box, offset_m: np.ndarray, pixels_per_metre: float, ego_pixel: tuple[float, float]) -> list:
    """The four corners of `box` drawn `offset_m` from the ego's pixel (the frame is world-aligned)."""
    length, width = box.size
    c, s = np.cos(box.heading), np.sin(box.heading)
    local = np.array([[1, 1], [1, -1], [-1, -1], [-1, 1]]) * [length / 2, width / 2]
    world = offset_m + local @ np.array([[c, s], [-s, c]])
    pixels = np.asarray(ego_pixel) + world * pixels_per_metre
    return [tuple(p) for p in pixels]


def draw_past_boxes(
    frame: np.ndarray,
    ego: Box,
    others: Mapping[int, Box],
    past: Sequence[tuple[Box, Mapping[int, Box]]],
    pixels_per_metre: float,
    ego_pixel: tuple[float, float],
) -> np.ndarray:
    """`frame` (H, W, 3 uint8, centred on `ego`) with the past boxes drawn in.

    others: the other cars now, by id; past: (ego, others) at each of PAST_BOX_AGES_S ago, in that order.
    A car is drawn at an age only if it is there now and was then (ids are the simulator's).
    """
    height, width = frame.shape[:2]
    on_top = Image.new("L", (width, height), 0)
    draw_on_top = ImageDraw.Draw(on_top)
    for box in [ego, *others.values()]:
        draw_on_top.polygon(box_corners_px(box, box.position - ego.position, pixels_per_metre, ego_pixel), fill=255)
    out = frame.astype(np.float32)
    colour = np.array(PAST_BOX_RGB, dtype=np.float32)
    for opacity, (past_ego, past_others) in reversed(list(zip(PAST_BOX_OPACITY, past, strict=True))):
        layer = Image.new("L", (width, height), 0)
        draw = ImageDraw.Draw(layer)
        for key in others.keys() & past_others.keys():
            box = past_others[key]
            offset = box.position - past_ego.position
            draw.polygon(box_corners_px(box, offset, pixels_per_metre, ego_pixel), fill=255)
        mask = (np.asarray(layer) > 0) & (np.asarray(on_top) == 0)
        out[mask] = (1 - opacity) * out[mask] + opacity * colour
    return np.rint(out).astype(np.uint8)
