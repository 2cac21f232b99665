"""One driving sample, its validation, and its storage as parquet shards (DESIGN section 8).

Units and frames: metres, seconds, m/s, m/s^2; every array is in the ego frame at t = 0 (+x forward,
+y left). A dataset folder holds `manifest.json` and one parquet shard per episode under
`train/`, `val/` and `test/`. Val and test samples of simulator datasets also carry up to 3 simulated
raters' futures with 0..10 scores (data/raters.py) for the WOD-E2E rater feedback score; shards written
before raters existed read back with none.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from fastddrive.schema import DrivingResponse, parse, render

HISTORY_STEPS = 7  # t = -3.0, -2.5, ..., 0.0 s
HISTORY_INTERVAL_S = 0.5
HISTORY_COLUMNS = ("x", "y", "vx", "vy", "ax", "ay")
FUTURE_STEPS = 20  # t = 0.25, 0.5, ..., 5.0 s
FUTURE_INTERVAL_S = 0.25
NAV_COMMANDS: tuple[str, ...] = ("go_straight", "go_left", "go_right")
SPLITS: tuple[str, ...] = ("train", "val", "test")
IMAGE_UNIT_PX = 28  # Qwen2.5-VL: 14-pixel patches merged 2x2
MAX_RATERS = 3  # WOD-E2E: up to 3 rater trajectories per scene
RATER_MAX_SCORE = 10.0
MANIFEST = "manifest.json"
DATASET_FORMAT = "fastddrive-driving-samples"


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

    image: (H, W, 3) uint8, H and W multiples of 28 px. history: (7, 6) at t = -3.0..0.0 s every
    0.5 s, columns x, y [m], vx, vy [m/s], ax, ay [m/s^2]. future: (20, 2) expert positions [m] at
    `future_time_s` (0.25..5.0 s). agents: other vehicles' (N, 21, 3) x, y [m], heading [rad] at
    t = 0..5 s every 0.25 s (NaN where a vehicle has left the scene); agent_size: (N, 2) length,
    width [m]. rater_trajectories: (R, 20, 2) alternative futures [m] at the times of `future`, R in 0..3;
    rater_scores: (R,) their scores in [0, 10] (none by default: training samples need no raters).
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

    def __post_init__(self) -> None:
        check_image(self.image)
        check_history(self.history)
        check_command(self.command)
        if self.future.shape != (FUTURE_STEPS, 2) or not np.isfinite(self.future).all():
            raise SampleError(f"future must be {FUTURE_STEPS} finite [x, y] points, got shape {self.future.shape}")
        # Stored as float arrays whatever sequence was given, so that rows and metrics can rely on it.
        object.__setattr__(self, "rater_trajectories", np.asarray(self.rater_trajectories, dtype=np.float64))
        object.__setattr__(self, "rater_scores", np.asarray(self.rater_scores, dtype=np.float64))
        check_raters(self.rater_trajectories, self.rater_scores)


def check_image(image: Any) -> None:
    """Raise SampleError unless `image` is an (H, W, 3) uint8 array with H, W multiples of 28."""
    if not isinstance(image, np.ndarray):
        raise SampleError(f"image must be a numpy array, got {type(image).__name__}")
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise SampleError(f"image must be (H, W, 3) uint8 RGB, got shape {image.shape} dtype {image.dtype}")
    h, w = image.shape[:2]
    if h % IMAGE_UNIT_PX or w % IMAGE_UNIT_PX or h == 0 or w == 0:
        raise SampleError(f"image size {w}x{h} px is not a multiple of {IMAGE_UNIT_PX} px in both sides")


def check_history(history: Any) -> None:
    """Raise SampleError unless `history` is a finite (7, 6) array of x, y, vx, vy, ax, ay."""
    array = np.asarray(history, dtype=float) if not isinstance(history, np.ndarray) else history
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
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", optimize=False, compress_level=6)
    return buffer.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("scenario", pa.string()),
        ("episode_seed", pa.int64()),
        ("time_s", pa.float64()),
        ("image_png", pa.binary()),
        ("history", pa.list_(pa.float32())),
        ("command", pa.string()),
        ("future", pa.list_(pa.float32())),
        ("future_time_s", pa.list_(pa.float32())),
        ("response", pa.string()),
        ("view", pa.list_(pa.float64())),
        ("ego_size", pa.list_(pa.float32())),
        ("agents", pa.list_(pa.float32())),
        ("agent_size", pa.list_(pa.float32())),
        ("rater_trajectories", pa.list_(pa.float32())),
        ("rater_scores", pa.list_(pa.float32())),
    ]
)
# Columns added after datasets were first written: older shards lack them and read back as empty lists.
_LATER_COLUMNS = ("rater_trajectories", "rater_scores")


def to_row(sample: DrivingSample) -> dict[str, Any]:
    view = sample.view
    return {
        "sample_id": sample.sample_id,
        "scenario": sample.scenario,
        "episode_seed": sample.episode_seed,
        "time_s": sample.time_s,
        "image_png": encode_png(sample.image),
        "history": sample.history.astype(np.float32).ravel().tolist(),
        "command": sample.command,
        "future": sample.future.astype(np.float32).ravel().tolist(),
        "future_time_s": sample.future_time_s.astype(np.float32).tolist(),
        "response": render(sample.response),
        "view": [view.pixels_per_metre, *view.ego_pixel, view.ego_heading_rad],
        "ego_size": list(sample.ego_size),
        "agents": sample.agents.astype(np.float32).ravel().tolist(),
        "agent_size": sample.agent_size.astype(np.float32).ravel().tolist(),
        "rater_trajectories": sample.rater_trajectories.astype(np.float32).ravel().tolist(),
        "rater_scores": sample.rater_scores.astype(np.float32).tolist(),
    }


def from_row(row: dict[str, Any]) -> DrivingSample:
    ppm, u, v, heading = row["view"]
    n_agents = len(row["agent_size"]) // 2
    # A row from a shard written before raters existed has no rater columns: no raters.
    rater_scores = np.asarray(row.get("rater_scores") or [], dtype=np.float64)
    rater_trajectories = np.asarray(row.get("rater_trajectories") or [], dtype=np.float64)
    return DrivingSample(
        sample_id=row["sample_id"],
        scenario=row["scenario"],
        episode_seed=row["episode_seed"],
        time_s=row["time_s"],
        image=decode_png(row["image_png"]),
        history=np.asarray(row["history"], dtype=np.float64).reshape(HISTORY_STEPS, len(HISTORY_COLUMNS)),
        command=row["command"],
        future=np.asarray(row["future"], dtype=np.float64).reshape(FUTURE_STEPS, 2),
        future_time_s=np.asarray(row["future_time_s"], dtype=np.float64),
        response=parse(row["response"]),
        view=CameraView(ppm, (u, v), heading),
        ego_size=tuple(row["ego_size"]),
        agents=np.asarray(row["agents"], dtype=np.float64).reshape(n_agents, FUTURE_STEPS + 1, 3),
        agent_size=np.asarray(row["agent_size"], dtype=np.float64).reshape(n_agents, 2),
        rater_trajectories=_reshape_raters(rater_trajectories),
        rater_scores=rater_scores,
    )


def _reshape_raters(flat: np.ndarray) -> np.ndarray:
    if flat.size % (FUTURE_STEPS * 2):
        raise SampleError(f"rater_trajectories hold {flat.size} numbers, not a whole number of {FUTURE_STEPS} points")
    return flat.reshape(-1, FUTURE_STEPS, 2)


def write_shard(path: Path, samples: list[DrivingSample]) -> None:
    """Write samples as one parquet shard, atomically (a partial file never has the final name)."""
    table = pa.Table.from_pylist([to_row(s) for s in samples], schema=_SCHEMA)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def read_shard(path: Path, columns: list[str] | None = None) -> pa.Table:
    """One shard as an Arrow table in the current schema; columns an older shard lacks come back as empty lists."""
    wanted = list(columns) if columns else _SCHEMA.names
    present = set(pq.read_schema(path).names)
    table = pq.read_table(path, columns=[c for c in wanted if c in present])
    for name in wanted:
        if name not in present and name in _LATER_COLUMNS:
            empty = pa.array([[]] * table.num_rows, type=_SCHEMA.field(name).type)
            table = table.append_column(_SCHEMA.field(name), empty)
    return table.select(wanted)


class DatasetError(ValueError):
    """A path that is not a fastddrive dataset, or a dataset that cannot be read."""


@dataclass(frozen=True)
class DrivingDataset:
    """A dataset folder: its manifest and its shards, read lazily split by split."""

    root: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, root: str | Path) -> DrivingDataset:
        root = Path(root)
        if not root.is_dir():
            raise DatasetError(f"{root} is not a directory")
        manifest_path = root / MANIFEST
        if not manifest_path.is_file():
            raise DatasetError(f"{root} is not a fastddrive dataset: {MANIFEST} is missing")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise DatasetError(f"{manifest_path} is not valid JSON: {err.msg}") from None
        if manifest.get("format") != DATASET_FORMAT:
            raise DatasetError(f"{root} is not a fastddrive dataset: {MANIFEST} has format {manifest.get('format')!r}")
        return cls(root, manifest)

    def shards(self, split: str) -> list[Path]:
        if split not in SPLITS:
            raise DatasetError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
        return sorted((self.root / split).glob("*.parquet"))

    def table(self, split: str, columns: list[str] | None = None) -> pa.Table:
        """All rows of a split (optionally only some columns) as one Arrow table, in shard order."""
        shards = self.shards(split)
        if not shards:
            return _SCHEMA.empty_table().select(columns) if columns else _SCHEMA.empty_table()
        return pa.concat_tables(read_shard(p, columns) for p in shards)

    def __len__(self) -> int:
        return sum(pq.ParquetFile(p).metadata.num_rows for split in SPLITS for p in self.shards(split))

    def samples(self, split: str) -> Iterator[DrivingSample]:
        for shard in self.shards(split):
            for row in read_shard(shard).to_pylist():
                yield from_row(row)

    def sample(self, split: str, index: int) -> DrivingSample:
        table = self.table(split)
        if not 0 <= index < table.num_rows:
            raise IndexError(f"split {split!r} has {table.num_rows} samples; index {index} is out of range")
        return from_row(table.slice(index, 1).to_pylist()[0])
