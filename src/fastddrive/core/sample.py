"""One driving sample and its validation: what every layer shares about a scene (DESIGN section 8).

Units and frames: metres, seconds, m/s, m/s^2; every array is in the ego frame at t = 0 (+x forward,
+y left). A sample holds one camera frame, 7 history rows of x, y, vx, vy, ax, ay (t = -3.0..0.0 s), a
navigation command, the expert's 20-point future at 4 Hz, its driving answer, the camera view that maps
metres onto the frame, the agents around it, and (val and test) up to 3 raters' futures with 0..10 scores
for the WOD-E2E rater feedback score. Storage of samples is `fastddrive.data.dataset`'s.
"""

from __future__ import annotations

import io
import numbers
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyspng
from PIL import Image

from fastddrive.core.schema import DrivingResponse

HISTORY_STEPS = 7  # t = -3.0, -2.5, ..., 0.0 s
HISTORY_INTERVAL_S = 0.5
HISTORY_COLUMNS = ("x", "y", "vx", "vy", "ax", "ay")
FUTURE_STEPS = 20  # t = 0.25, 0.5, ..., 5.0 s
FUTURE_INTERVAL_S = 0.25
NAV_COMMANDS: tuple[str, ...] = ("go_straight", "go_left", "go_right")
IMAGE_UNIT_PX = 28  # Qwen2.5-VL: 14-pixel patches merged 2x2 (the grid a model folder's processor resizes onto)
MAX_ASPECT_RATIO = 200  # Qwen2.5-VL's `smart_resize` refuses frames longer than 200 times their width
MAX_RATERS = 3  # WOD-E2E: up to 3 rater trajectories per scene
RATER_MAX_SCORE = 10.0


class SampleError(ValueError):
    """A driving sample or a part of it that is malformed."""


@dataclass(frozen=True)
class CameraView:
    """How ego-frame metres map onto the frame: a world-aligned top view centred on the ego.

    `ego_heading_rad` is the ego heading in image axes (x right, y down); `pixels_per_metre` the scale.
    """

    pixels_per_metre: float
    ego_pixel: tuple[float, float]
    ego_heading_rad: float

    def to_pixels(self, points_m: np.ndarray) -> np.ndarray:
        """Ego-frame points (N, 2) in metres to pixel coordinates (N, 2)."""
        c, s = np.cos(self.ego_heading_rad), np.sin(self.ego_heading_rad)
        x, y = points_m[:, 0], points_m[:, 1]
        # +y (left) in the ego frame is -lateral in image axes, whose y grows downwards.
        u = self.ego_pixel[0] + self.pixels_per_metre * (c * x + s * y)
        v = self.ego_pixel[1] + self.pixels_per_metre * (s * x - c * y)
        return np.stack([u, v], axis=1)


@dataclass(frozen=True)
class DrivingSample:
    """One planning problem and its expert answer.

    image: (H, W, 3) uint8 of any size (the model's processor resizes it). history: (7, 6) at t = -3.0..0.0 s every
    0.5 s, columns x, y [m], vx, vy [m/s], ax, ay [m/s^2]. future: (20, 2) expert positions [m] at
    `future_time_s` (0.25..5.0 s), all NaN where unknown (`has_future`). agents: other vehicles' (N, 21, 3)
    x, y [m], heading [rad] at t = 0..5 s every 0.25 s (NaN where a vehicle has left the scene); agent_size:
    (N, 2) length, width [m]. rater_trajectories: (R, 20, 2) alternative futures [m] at the times of `future`,
    R in 0..3; rater_scores: (R,) their scores in [0, 10] (none by default: training samples need no raters).
    """

    sample_id: str
    scenario: str
    episode_seed: int
    time_s: float
    image: np.ndarray
    history: np.ndarray
    command: str
    future: np.ndarray
    future_time_s: np.ndarray
    response: DrivingResponse
    view: CameraView
    ego_size: tuple[float, float] = (5.0, 2.0)
    agents: np.ndarray = field(default_factory=lambda: np.zeros((0, FUTURE_STEPS + 1, 3)))
    agent_size: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    rater_trajectories: np.ndarray = field(default_factory=lambda: np.zeros((0, FUTURE_STEPS, 2)))
    rater_scores: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def has_future(self) -> bool:
        """Whether the expert's future is known: a WOD-E2E test frame has none (its `future` all NaN, its
        `response` derived from nothing but the scaffold's defaults); metrics of the future skip it."""
        return not np.isnan(self.future).all()

    def __post_init__(self) -> None:
        check_image(self.image)
        check_history(self.history)
        check_command(self.command)
        if self.future.shape != (FUTURE_STEPS, 2) or not (np.isfinite(self.future).all() or not self.has_future):
            raise SampleError(
                f"future must be {FUTURE_STEPS} finite [x, y] points (all NaN for a frame without one), got shape "
                f"{self.future.shape}"
            )
        # Stored as float arrays whatever sequence was given, so that rows and metrics can rely on it.
        object.__setattr__(self, "rater_trajectories", np.asarray(self.rater_trajectories, dtype=np.float64))
        object.__setattr__(self, "rater_scores", np.asarray(self.rater_scores, dtype=np.float64))
        check_raters(self.rater_trajectories, self.rater_scores)


def check_image(image: Any) -> None:
    """Raise SampleError unless `image` is an (H, W, 3) uint8 array of any size that a Qwen2.5-VL processor can
    resize (`smart_resize`: sides in any ratio up to MAX_ASPECT_RATIO); the model folder's processor resizes it
    onto its grid (`BlockDiffusionModel.encode_prompt`)."""
    if not isinstance(image, np.ndarray):
        raise SampleError(f"image must be a numpy array, got {type(image).__name__}")
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise SampleError(f"image must be (H, W, 3) uint8 RGB, got shape {image.shape} dtype {image.dtype}")
    h, w = image.shape[:2]
    if h == 0 or w == 0:
        raise SampleError(f"image is {w}x{h} px: it has no pixels")
    if max(h, w) > MAX_ASPECT_RATIO * min(h, w):
        raise SampleError(f"image is {w}x{h} px: its sides differ by more than {MAX_ASPECT_RATIO} times")


def check_pixel_range(low: int, high: int, names: tuple[str, str] = ("min_pixels", "max_pixels")) -> None:
    """SampleError unless a resize range (Qwen2.5-VL's min_pixels, max_pixels) is not empty; `names` are what
    the caller calls the two bounds (an option, a config key)."""
    if low > high:
        raise SampleError(f"{names[0]} {low} is more than {names[1]} {high}")


def split_cameras(image: np.ndarray, count: int) -> list[np.ndarray]:
    """A joined frame (cameras side by side) cut into `count` cameras at 28 px boundaries, the outer ones of equal
    width (the inverse of `data.wod_e2e.join_cameras`). SampleError if it is too narrow."""
    units = image.shape[1] // IMAGE_UNIT_PX
    if units < count:
        raise SampleError(f"a frame {image.shape[1]} px wide is too narrow to cut into {count} cameras")
    if count == 1:
        return [image]
    side = units // count * IMAGE_UNIT_PX
    cuts = [side * k for k in range(1, count - 1)] + [image.shape[1] - side]
    return np.split(image, cuts, axis=1)


def _real_numbers(value: Any) -> bool:
    """Whether `value` is an int or float array, or nested sequences of ints and floats (not bools)."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "iuf"
    if isinstance(value, (list, tuple)):
        return all(_real_numbers(item) for item in value)
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_history(history: Any) -> None:
    """Raise SampleError unless `history` is a finite (7, 6) array of x, y, vx, vy, ax, ay. Strings, booleans and
    complex numbers are refused rather than cast."""
    if not _real_numbers(history):
        raise SampleError("history must be 7 rows of 6 real numbers (x, y, vx, vy, ax, ay)")
    try:
        array = np.asarray(history, dtype=float)
    except ValueError:  # ragged rows
        raise SampleError("history must be 7 rows of 6 real numbers (x, y, vx, vy, ax, ay)") from None
    if array.shape != (HISTORY_STEPS, len(HISTORY_COLUMNS)):
        raise SampleError(
            f"history must be {HISTORY_STEPS} rows (t = -3.0..0.0 s every 0.5 s) of "
            f"{', '.join(HISTORY_COLUMNS)}; got shape {array.shape}"
        )
    if not np.isfinite(array).all():
        raise SampleError("history holds NaN or infinite values")


def check_raters(trajectories: np.ndarray, scores: np.ndarray) -> None:
    """Raise SampleError unless there are R in 0..3 finite (20, 2) rater futures with one score in [0, 10] each."""
    if trajectories.ndim != 3 or trajectories.shape[1:] != (FUTURE_STEPS, 2) or len(trajectories) > MAX_RATERS:
        raise SampleError(
            f"rater_trajectories must be (R, {FUTURE_STEPS}, 2) [x, y] points with R in 0..{MAX_RATERS}, "
            f"got shape {trajectories.shape}"
        )
    if not np.isfinite(trajectories).all():
        raise SampleError("rater_trajectories hold NaN or infinite values")
    if scores.shape != (len(trajectories),):
        raise SampleError(f"need one rater score per rater trajectory ({len(trajectories)}), got shape {scores.shape}")
    if not np.isfinite(scores).all() or np.any((scores < 0) | (scores > RATER_MAX_SCORE)):
        raise SampleError(f"rater scores must lie in [0, {RATER_MAX_SCORE:g}], got {scores.tolist()}")


def check_command(command: str) -> None:
    """Raise SampleError unless `command` is a known navigation command."""
    if command not in NAV_COMMANDS:
        raise SampleError(f"unknown navigation command {command!r}; known: {', '.join(NAV_COMMANDS)}")


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of an (H, W, 3) uint8 frame, as a shard stores it (compression level 6)."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", optimize=False, compress_level=6)
    return buffer.getvalue()


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def decode_png(data: bytes) -> np.ndarray:
    """PNG bytes as (H, W, 3) uint8 RGB (alpha dropped, 16-bit channels scaled to 8), decoded by libspng: a
    448 x 224 frame in about a third of Pillow's time, which a service pays per request. SampleError if the
    bytes are not a PNG, or its header claims more than Pillow's `MAX_IMAGE_PIXELS` (a decompression bomb)."""
    if len(data) < 24 or data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise SampleError("image is not a readable PNG")
    width, height = struct.unpack(">II", data[16:24])
    if width * height > Image.MAX_IMAGE_PIXELS:
        raise SampleError(f"image is {width}x{height} px, more than the {Image.MAX_IMAGE_PIXELS} px allowed")
    try:
        return pyspng.load(data, "RGB")
    except RuntimeError as err:  # libspng's own message: a damaged chunk, a truncated stream
        raise SampleError(f"image is not a readable PNG ({str(err).removeprefix('pyspng: ')})") from None
