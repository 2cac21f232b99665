"""One driving sample, its validation, and its storage as parquet shards (DESIGN section 8).

Units and frames: metres, seconds, m/s, m/s^2; every array is in the ego frame at t = 0 (+x forward,
+y left). A dataset folder holds `manifest.json` and one parquet shard per episode under
`train/`, `val/` and `test/`.
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
    width [m].
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

    def __post_init__(self) -> None:
        check_image(self.image)
        check_history(self.history)
        check_command(self.command)
        if self.future.shape != (FUTURE_STEPS, 2) or not np.isfinite(self.future).all():
            raise SampleError(f"future must be {FUTURE_STEPS} finite [x, y] points, got shape {self.future.shape}")


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
    ]
)


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
    }


def from_row(row: dict[str, Any]) -> DrivingSample:
    ppm, u, v, heading = row["view"]
    n_agents = len(row["agent_size"]) // 2
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
    )


def write_shard(path: Path, samples: list[DrivingSample]) -> None:
    """Write samples as one parquet shard, atomically (a partial file never has the final name)."""
    table = pa.Table.from_pylist([to_row(s) for s in samples], schema=_SCHEMA)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


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
        return pa.concat_tables(pq.read_table(p, columns=columns) for p in shards)

    def __len__(self) -> int:
        return sum(pq.ParquetFile(p).metadata.num_rows for split in SPLITS for p in self.shards(split))

    def samples(self, split: str) -> Iterator[DrivingSample]:
        for shard in self.shards(split):
            for row in pq.read_table(shard).to_pylist():
                yield from_row(row)

    def sample(self, split: str, index: int) -> DrivingSample:
        table = self.table(split)
        if not 0 <= index < table.num_rows:
            raise IndexError(f"split {split!r} has {table.num_rows} samples; index {index} is out of range")
        return from_row(table.slice(index, 1).to_pylist()[0])
