"""nuScenes v1.0 in and out: driving samples read from the JSON tables and CAN bus, and samples written as nuScenes.

Read directly, not through nuscenes-devkit (it pins numpy<2). Sources, all read not imported: the schema and the
key-frame index of nutonomy/nuscenes-devkit `docs/schema_nuscenes.md` and `python-sdk/nuscenes/nuscenes.py`
(`__make_reverse_index__`, `get_boxes`, `box_velocity`); the CAN bus files of `python-sdk/nuscenes/can_bus/`
(`can_bus_api.py`, README); the scene splits of `python-sdk/nuscenes/utils/splits.py`; the planning targets and
command of OpenDriveLab/UniAD `projects/mmdet3d_plugin/datasets/data_utils/trajectory_api.py`
(`get_sdc_planning_label`) and hustvl/VAD `tools/data_converter/vad_nuscenes_converter.py`.

A converted sample is one key frame k with 3 s of key frames behind it and 5 s ahead (others are skipped and
counted):
- Frame: as UniAD and VAD, the ego trajectory is the LIDAR_TOP origin in the LIDAR_TOP frame at t = 0, with its
  axes named as ours (x forward = lidar +y, y left = lidar -x). That is a rotation, so L2 errors and the command
  equal theirs; it is the ego_pose (rear-axle) frame moved by the lidar mounting (about 1 m forward).
- history: key frames k-6..k (nominally -3..0 s). Velocity and acceleration are the CAN bus `pose` message at or
  before the key frame (at most 0.1 s old; vehicle frame, rotated into ours), else backward differences of the
  key-frame positions (forward at a scene's first key frame), as VAD falls back. `vehicle_monitor` is not read:
  it has the speed alone, at 2 Hz.
- future: 20 points. The odd ones (index 1, 3, .., 19) are the next 10 key frames exactly; the first 6
  (`NUSCENES_FUTURE`, about 0.5..3 s) are the UniAD / VAD target. The even ones are the LIDAR_TOP origin midway
  in time between two key frames, interpolated linearly between the nearest logged LIDAR_TOP poses (the sweeps,
  0.05 s apart; without sweeps, the two key frames). `future_time_s` holds the real offsets. Nothing is padded:
  UniAD and VAD keep a key frame with a short future under a mask; the sample format has no mask, so it is
  skipped.
- command: VAD and UniAD's rule on the 3 s key frame: lateral offset >= 2 m -> go_left, <= -2 m -> go_right,
  else go_straight.
- agents: vehicles (`vehicle.*`) and pedestrians (`human.pedestrian.*`) annotated at t = 0, followed through
  `next`: even indices are key frames (NaN where not annotated), odd ones the midpoint of two annotated key frames,
  as the devkit's `get_boxes` interpolates. `ego_size` is the nuScenes car, 4.084 x 1.85 m, unless told.
- image: CAM_FRONT (or the six cameras tiled 2 x 3), kept when both sides are multiples of 28 px, else resized
  to `image_width` wide. `view` is the top view a camera looking straight down defines (what an export writes),
  else `NO_TOP_VIEW`.
- response: data/labels.py on what nuScenes has: vehicles as the rules' agents, speed from positions, the turn
  from the ego's own heading over 5 s; no lane changes, yielding or crashes are known, so none are labelled;
  `pedestrian` is the rules' nearby test applied to pedestrians; the other classes are "no".
- ids: `sample_id` is the key frame's sample token, `scenario` the log's location, `episode_seed` the scene
  number, `time_s` the time since the scene's first key frame.
Splits: the exporter's `fastddrive split:` note in a scene's description; else v1.0-trainval and v1.0-mini by
the official scene lists (`create_splits_scenes`), v1.0-test all test; else train.

An export writes each simulator sample as one scene of 17 key frames at 2 Hz (t = -3..5 s): ego poses and empty
LIDAR_TOP point clouds at every key frame, LIDAR_TOP sweeps at the future's quarter seconds, CAN bus `pose`
messages at the 7 history key frames, the frame as a JPEG CAM_FRONT key frame at t = 0 from a camera looking
straight down, so that it projects the ground exactly as the sample's top view, and every agent as an instance
annotated (vehicle.car) at the key frames where it is present. The LIDAR_TOP is mounted as on the real cars but
with no horizontal offset, so the planning frame is the ego frame; the global yaw is minus the simulator's (y-down)
world heading. Not carried: raters, the response, ego size, agent heights (1.5 m written), lidar points (empty
files, num_lidar_pts 0), attributes, visibility, the map (an empty mask), the ego heading away from t = 0 (the
direction of travel is written).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import re
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw
from scipy.spatial.transform import Rotation

from fastddrive.core.outputs import check_folder_destination
from fastddrive.core.sample import FUTURE_STEPS, HISTORY_STEPS, IMAGE_UNIT_PX, CameraView, DrivingSample
from fastddrive.core.schema import DrivingResponse
from fastddrive.data import labels as rules
from fastddrive.data.build import holds_complete_dataset, prepare_output, staged_build, write_manifest
from fastddrive.data.dataset import SPLITS, DatasetError, DrivingDataset, write_shard

HISTORY_KEYFRAMES = HISTORY_STEPS - 1  # 6 key frames behind t = 0 (3 s at 2 Hz)
FUTURE_KEYFRAMES = FUTURE_STEPS // 2  # 10 key frames ahead (5 s)
NUSCENES_FUTURE = slice(1, 12, 2)  # the future's 6 points that are the UniAD / VAD 2 Hz target (0.5..3 s)
COMMAND_OFFSET_M = 2.0  # VAD / UniAD: lateral offset of the 3 s point that makes a turn command
MAX_CAN_AGE_US = 100_000
NUSCENES_EGO_SIZE_M = (4.084, 1.85)  # length, width: the nuScenes Renault Zoe (UniAD, VAD)
AGENT_CATEGORIES = ("vehicle.", "human.pedestrian.")
LIDAR, FRONT = "LIDAR_TOP", "CAM_FRONT"
SIX_CAMERAS = ("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT")
IMAGE_WIDTH_PX = 448  # the simulator frames' width
NO_TOP_VIEW = CameraView(pixels_per_metre=0.0, ego_pixel=(0.0, 0.0), ego_heading_rad=0.0)
TABLES = (
    "scene",
    "sample",
    "sample_data",
    "ego_pose",
    "calibrated_sensor",
    "sensor",
    "sample_annotation",
    "instance",
    "category",
    "log",
)
SPLIT_NOTE = "fastddrive split: "
# python-sdk/nuscenes/utils/splits.py: the scene numbers of `val` and `mini_val` (train is the rest).
VAL_SCENES = frozenset(
    [3, 12, 13, 14, 15, 16, 17, 18, 35, 36, 38, 39, *range(92, 111), 221, *range(268, 279), 329, 330, 331, 332]
    + [344, 345, 346, *range(519, 525), *range(552, 566), 625, 626, 627, 629, 630, *range(632, 639), 770, 771]
    + [775, 777, 778, *range(780, 785), *range(794, 801), 802, *range(904, 918), *range(919, 932), 962, 963]
    + [966, 967, 968, 969, 971, 972, *range(1059, 1074)]
)
MINI_VAL_SCENES = frozenset([103, 916])
# can_bus_api.py: scenes without CAN bus data; the devkit refuses their messages, so exports skip these numbers.
CAN_BLACKLIST = frozenset([*range(161, 169), *range(170, 177), *range(309, 315)])
CONVENTIONS = {
    "frame": "LIDAR_TOP origin and frame at t = 0 (UniAD, VAD), axes x forward = lidar +y, y left = lidar -x",
    "history": "key frames -6..0; velocity, acceleration from CAN pose (<= 0.1 s old) else key-frame differences",
    "future": "odd points: the next 10 key frames (first 6: the nuScenes 2 Hz target); even points: LIDAR_TOP "
    "poses interpolated midway between key frames; key frames without 5 s ahead are skipped",
    "command": "VAD/UniAD: lateral offset of the 3 s key frame >= 2 m go_left, <= -2 m go_right, else go_straight",
    "agents": "vehicle.* and human.pedestrian.* annotated at t = 0; key frames at even indices, midpoints at odd",
}

# Export layout.
EXPORT_VERSION = "v1.0-fastddrive"
EXPORT_ORIGIN_M = (600.0, 1600.0)  # where every exported scene's t = 0 lies on the (empty) map
EXPORT_EPOCH_US = 1_533_000_000_000_000  # 2018-07-31, the time of the first exported scene
SCENE_SPACING_US = 60_000_000
KEYFRAME_US = 500_000
LIDAR_HEIGHT_M = 1.84
TOP_VIEW_HEIGHT_M = 50.0  # of the exported CAM_FRONT above the ground (the ego origin)
AGENT_HEIGHT_M = 1.5
JPEG_QUALITY = 100  # with 4:4:4 chroma: at most 3 levels off on the simulator's frames
MIN_TRAVEL = 1e-3  # m or m/s: shorter displacements keep the previous direction of travel
EXPORT_TABLES = (
    "attribute",
    "visibility",
    "category",
    "instance",
    "sensor",
    "calibrated_sensor",
    "ego_pose",
    "log",
    "scene",
    "sample",
    "sample_data",
    "sample_annotation",
    "map",
)


class NuScenesError(DatasetError):
    """A nuScenes folder that cannot be read at all: a table missing or not a JSON list."""


class RecordError(NuScenesError):
    """One malformed or dangling record, named by its file and token."""

    def __init__(self, path: Path, token: str, message: str) -> None:
        super().__init__(f"{path} record {token}: {message}")


def _rz(yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def _rotation(q: np.ndarray) -> np.ndarray:
    """Rotation matrix of a nuScenes quaternion w, x, y, z (normalised)."""
    return Rotation.from_quat([*q[1:], q[0]]).as_matrix()


def _quaternion(rotation: np.ndarray) -> list[float]:
    """The nuScenes quaternion w, x, y, z of a rotation matrix."""
    x, y, z, w = Rotation.from_matrix(rotation).as_quat()
    return [float(w), float(x), float(y), float(z)]


def _wrap(angle: np.ndarray | float) -> np.ndarray | float:
    return (np.asarray(angle) + np.pi) % (2 * np.pi) - np.pi


@dataclass(frozen=True)
class _Rigid:
    """A frame placed in its parent: parent = rotation @ local + translation."""

    rotation: np.ndarray
    translation: np.ndarray

    def then(self, inner: _Rigid) -> _Rigid:
        """The frame `inner`, given in this one, placed in this one's parent."""
        return _Rigid(self.rotation @ inner.rotation, self.rotation @ inner.translation + self.translation)

    def local(self, points: np.ndarray) -> np.ndarray:
        """Parent points (..., 3) in this frame."""
        return (np.asarray(points) - self.translation) @ self.rotation

    def heading(self, rotation: np.ndarray) -> float:
        """Yaw in this frame of the +x axis of a parent-frame rotation."""
        forward = self.rotation.T @ rotation[:, 0]
        return math.atan2(forward[1], forward[0])


# The planning frame in the LIDAR_TOP frame: x forward = lidar +y, y left = lidar -x.
_RELABEL = _Rigid(_rz(math.pi / 2), np.zeros(3))
# The exported LIDAR_TOP in the ego frame: axes as on the real cars, no horizontal offset.
_EXPORT_LIDAR = _Rigid(_rz(-math.pi / 2), np.array([0.0, 0.0, LIDAR_HEIGHT_M]))


def nuscenes_command(lateral_3s_m: float) -> str:
    """The navigation command VAD and UniAD derive from the lateral offset (left positive) of the 3 s point."""
    if lateral_3s_m <= -COMMAND_OFFSET_M:
        return "go_right"  # VAD: lidar x >= 2 -> Turn Right (lidar x is our -y)
    if lateral_3s_m >= COMMAND_OFFSET_M:
        return "go_left"
    return "go_straight"


DRAWN_GROUND_RGB = (96, 96, 96)


def _drawn_top_view(sample: DrivingSample, key: int, ego0: _Rigid, ego: _Rigid) -> np.ndarray:
    """The export's CAM_FRONT at key frame `key` (0 = t = 0, negative in the history) where the simulator kept no
    frame: the ground, the ego box, and every agent box known at that key frame (agents are known from t = 0 on),
    each drawn where the top-view camera above the ego at that time sees it (`sample.view`'s projection)."""
    view = sample.view
    height, width = sample.image.shape[:2]
    c, s = math.cos(view.ego_heading_rad), math.sin(view.ego_heading_rad)

    def pixels(corners_m: np.ndarray) -> list[tuple[float, float]]:
        u = view.ego_pixel[0] + view.pixels_per_metre * (c * corners_m[:, 0] + s * corners_m[:, 1])
        v = view.ego_pixel[1] + view.pixels_per_metre * (s * corners_m[:, 0] - c * corners_m[:, 1])
        return list(zip(u.tolist(), v.tolist(), strict=True))

    def box(x: float, y: float, heading: float, length: float, width_m: float) -> np.ndarray:
        half = np.array([[1, 1], [1, -1], [-1, -1], [-1, 1]]) * [length / 2, width_m / 2]
        turn = np.array([[math.cos(heading), -math.sin(heading)], [math.sin(heading), math.cos(heading)]])
        return half @ turn.T + [x, y]

    canvas = Image.new("RGB", (width, height), DRAWN_GROUND_RGB)
    draw = ImageDraw.Draw(canvas)
    draw.polygon(pixels(box(0.0, 0.0, 0.0, *sample.ego_size)), fill=(40, 160, 40))
    if key >= 0:
        for path, (length, width_m) in zip(sample.agents, sample.agent_size, strict=True):
            x, y, heading = path[2 * key]
            if not np.isfinite([x, y, heading]).all():
                continue
            placed = ego0.then(_Rigid(_rz(heading), np.array([x, y, 0.0])))
            local = ego.local(placed.translation)
            draw.polygon(
                pixels(box(local[0], local[1], ego.heading(placed.rotation), length, width_m)), fill=(40, 80, 200)
            )
    return np.asarray(canvas)


class _Tables:
    """The v1.0 JSON tables of one version folder, by token; records without a token are left out and reported."""

    def __init__(self, folder: Path, problems: list[str]) -> None:
        self.folder = folder
        self.rows = {name: self._load(name, problems) for name in TABLES}

    def path(self, table: str) -> Path:
        return self.folder / f"{table}.json"

    def _load(self, table: str, problems: list[str]) -> dict[str, dict[str, Any]]:
        path = self.path(table)
        if not path.is_file():
            raise NuScenesError(f"{path} is missing; a nuScenes version folder needs {', '.join(TABLES)}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise NuScenesError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(data, list):
            raise NuScenesError(f"{path} must hold a JSON list of records, not a {type(data).__name__}")
        rows = {}
        for i, record in enumerate(data):
            if isinstance(record, dict) and isinstance(record.get("token"), str):
                rows[record["token"]] = record
            else:
                problems.append(f"{path} record #{i}: has no string token; left out")
        return rows

    def error(self, table: str, record: dict[str, Any], message: str) -> RecordError:
        return RecordError(self.path(table), record["token"], message)

    def field(self, table: str, record: dict[str, Any], key: str, kind: type) -> Any:
        value = record.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.error(table, record, f"{key} must be a {kind.__name__}, got {value!r}")
        return value

    def ref(self, table: str, record: dict[str, Any], key: str, target: str) -> dict[str, Any]:
        """The `target` record that `record` of `table` names in `key`."""
        token = record.get(key)
        if not isinstance(token, str) or token not in self.rows[target]:
            raise self.error(table, record, f"{key} {token!r} is not in {target}.json")
        return self.rows[target][token]

    def vector(self, table: str, record: dict[str, Any], key: str, size: int) -> np.ndarray:
        value = record.get(key)
        ok = isinstance(value, list) and len(value) == size
        ok = ok and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)
        if not ok:
            raise self.error(table, record, f"{key} must be {size} finite numbers, got {value!r}")
        return np.array(value, dtype=float)

    def pose(self, table: str, record: dict[str, Any]) -> _Rigid:
        q = self.vector(table, record, "rotation", 4)
        if not np.linalg.norm(q) > 0:
            raise self.error(table, record, "rotation is a zero quaternion")
        return _Rigid(_rotation(q), self.vector(table, record, "translation", 3))

    def sensor_pose(self, sample_data: dict[str, Any]) -> tuple[int, _Rigid, _Rigid]:
        """(timestamp, ego frame, sensor frame) of a sample_data record, both frames in the global frame."""
        ego = self.pose("ego_pose", self.ref("sample_data", sample_data, "ego_pose_token", "ego_pose"))
        sensor = self.pose(
            "calibrated_sensor", self.ref("sample_data", sample_data, "calibrated_sensor_token", "calibrated_sensor")
        )
        return self.field("sample_data", sample_data, "timestamp", int), ego, ego.then(sensor)


@dataclass
class _Index:
    """devkit `__make_reverse_index__`: per sample token, its key-frame data by channel, LIDAR_TOP data, annotations."""

    key_data: dict[str, dict[str, str]] = field(default_factory=dict)
    lidar: dict[str, list[str]] = field(default_factory=dict)  # key frame and the sweeps before it
    annotations: dict[str, list[str]] = field(default_factory=dict)


def _index(db: _Tables, problems: list[str]) -> _Index:
    index = _Index()
    channels: dict[str, str] = {}
    for token, data in db.rows["sample_data"].items():
        try:
            sensor_token = db.field("sample_data", data, "calibrated_sensor_token", str)
            if sensor_token not in channels:
                calibration = db.ref("sample_data", data, "calibrated_sensor_token", "calibrated_sensor")
                sensor = db.ref("calibrated_sensor", calibration, "sensor_token", "sensor")
                channels[sensor_token] = db.field("sensor", sensor, "channel", str)
            sample = db.field("sample_data", data, "sample_token", str)
            key_frame = db.field("sample_data", data, "is_key_frame", bool)
        except RecordError as err:
            problems.append(f"{err}; left out")
            continue
        if channels[sensor_token] == LIDAR:
            index.lidar.setdefault(sample, []).append(token)
        if key_frame:
            index.key_data.setdefault(sample, {})[channels[sensor_token]] = token
    for token, annotation in db.rows["sample_annotation"].items():
        try:
            sample = db.field("sample_annotation", annotation, "sample_token", str)
        except RecordError as err:
            problems.append(f"{err}; left out")
            continue
        index.annotations.setdefault(sample, []).append(token)
    return index


@dataclass(frozen=True)
class _KeyFrame:
    time_us: int
    ego: _Rigid
    lidar: _Rigid  # the LIDAR_TOP frame


@dataclass(frozen=True)
class _CanPoses:
    """A scene's CAN bus `pose` messages: time, velocity and acceleration in the vehicle frame."""

    utimes: np.ndarray
    velocity: np.ndarray
    acceleration: np.ndarray

    @classmethod
    def load(cls, path: Path, problems: list[str]) -> _CanPoses | None:
        """None when the file is absent or unreadable (then key-frame differences stand in)."""
        if not path.is_file():
            return None
        try:
            messages = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            problems.append(f"{path}: not valid JSON ({err}); velocities from ego poses")
            return None
        kept = []
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            try:
                utime = message["utime"]
                row = [float(v) for v in (*message["vel"], *message["accel"])]
                if not isinstance(utime, int) or len(row) != 6 or not all(map(math.isfinite, row)):
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                problems.append(f"{path} message #{i}: needs an integer utime and 3 vel, 3 accel numbers; left out")
                continue
            kept.append((utime, row))
        kept.sort(key=lambda m: m[0])
        rows = np.array([r for _, r in kept], dtype=float).reshape(-1, 6)
        return cls(np.array([u for u, _ in kept], dtype=np.int64), rows[:, :3], rows[:, 3:])

    def at(self, time_us: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The latest message at or before `time_us`, if it is at most MAX_CAN_AGE_US old."""
        i = bisect_right(self.utimes, time_us) - 1
        if i < 0 or time_us - self.utimes[i] > MAX_CAN_AGE_US:
            return None
        return self.velocity[i], self.acceleration[i]


class _Scene:
    """One scene: its key frames in `next` order, read lazily; a bad record fails only the samples that need it."""

    def __init__(self, db: _Tables, index: _Index, dataroot: Path, scene: dict[str, Any], problems: list[str]):
        self.db, self.index, self.dataroot, self.problems = db, index, dataroot, problems
        self.name = db.field("scene", scene, "name", str)
        self.location = db.field("log", db.ref("scene", scene, "log_token", "log"), "location", str)
        self.description = scene.get("description") if isinstance(scene.get("description"), str) else ""
        number = re.fullmatch(r"scene-(\d+)", self.name)
        self.number = int(number.group(1)) if number else 0
        self.samples = self._chain(scene)
        self.position = {s["token"]: i for i, s in enumerate(self.samples)}
        self.can = _CanPoses.load(dataroot / "can_bus" / f"{self.name}_pose.json", problems)
        self._frames: dict[int, _KeyFrame | RecordError] = {}
        self._track: tuple[np.ndarray, np.ndarray] | None = None

    def _chain(self, scene: dict[str, Any]) -> list[dict[str, Any]]:
        """The samples from `first_sample_token` along `next`; a broken link ends the chain and is reported."""
        records: list[dict[str, Any]] = []
        table, owner, key = "scene", scene, "first_sample_token"
        try:
            while True:
                record = self.db.ref(table, owner, key, "sample")
                if any(r is record for r in records):
                    raise self.db.error(table, owner, f"{key} leads back to an earlier sample")
                records.append(record)
                if not self.db.field("sample", record, "next", str):
                    return records
                table, owner, key = "sample", record, "next"
        except RecordError as err:
            self.problems.append(f"{self.name}: {err}; the scene ends there")
            return records

    def frame(self, i: int) -> _KeyFrame:
        if i not in self._frames:
            try:
                sample = self.samples[i]
                token = self.index.key_data.get(sample["token"], {}).get(LIDAR)
                if token is None:
                    raise self.db.error("sample", sample, f"has no {LIDAR} key frame in sample_data.json")
                self._frames[i] = _KeyFrame(*self.db.sensor_pose(self.db.rows["sample_data"][token]))
            except RecordError as err:
                self._frames[i] = err
        found = self._frames[i]
        if isinstance(found, RecordError):
            raise found
        return found

    def track_at(self, time_us: float) -> np.ndarray:
        """The LIDAR_TOP origin (global) at a time, linear between the nearest logged LIDAR_TOP poses."""
        if self._track is None:
            logged = []
            for sample in self.samples:
                for token in self.index.lidar.get(sample["token"], []):
                    try:
                        stamp, _, lidar = self.db.sensor_pose(self.db.rows["sample_data"][token])
                    except RecordError as err:
                        self.problems.append(f"{err}; left out of the {LIDAR} track")
                        continue
                    logged.append((stamp, lidar.translation))
            logged.sort(key=lambda entry: entry[0])
            self._track = np.array([t for t, _ in logged], dtype=float), np.array([p for _, p in logged])
        times, points = self._track
        return np.array([np.interp(time_us, times, points[:, d]) for d in range(3)])

    def _difference(self, a: int, b: int, value: Callable[[int], np.ndarray]) -> np.ndarray:
        dt = (self.frame(b).time_us - self.frame(a).time_us) / 1e6
        if dt <= 0:
            raise self.db.error("sample", self.samples[b], "timestamp is not after the previous key frame's")
        return (value(b) - value(a)) / dt

    def velocity(self, i: int) -> np.ndarray:
        """Global velocity of the LIDAR_TOP origin at key frame i: backward difference (forward at the first)."""
        a, b = (i - 1, i) if i > 0 else (0, 1)
        return self._difference(a, b, lambda j: self.frame(j).lidar.translation)

    def acceleration(self, i: int) -> np.ndarray:
        a, b = (i - 1, i) if i > 0 else (0, 1)
        return self._difference(a, b, self.velocity)

    def split(self, version: str) -> str:
        note = re.search(rf"{SPLIT_NOTE}(\w+)", self.description)
        if note and note.group(1) in SPLITS:
            return note.group(1)
        if version == "v1.0-test":
            return "test"
        val = {"v1.0-trainval": VAL_SCENES, "v1.0-mini": MINI_VAL_SCENES}.get(version, frozenset())
        return "val" if self.number in val else "train"


@dataclass(frozen=True)
class _Agents:
    paths: np.ndarray  # (N, 21, 3) x, y, heading in the planning frame
    size: np.ndarray  # (N, 2) length, width
    speed: np.ndarray  # (N,) m/s at t = 0 (devkit box_velocity), NaN where unknown
    vehicle: np.ndarray  # (N,) bool: vehicle.*, else a pedestrian


class _Converter:
    """Turns the key frames of scenes into driving samples."""

    def __init__(self, db: _Tables, channels: Sequence[str], image_width: int, ego_size_m: tuple[float, float]) -> None:
        self.db, self.channels, self.image_width, self.ego_size_m = db, tuple(channels), image_width, ego_size_m
        self.velocity_rows: Counter[str] = Counter()

    def sample(self, scene: _Scene, k: int) -> DrivingSample:
        window = range(k - HISTORY_KEYFRAMES, k + FUTURE_KEYFRAMES + 1)
        for i in window[1:]:
            if scene.frame(i).time_us <= scene.frame(i - 1).time_us:
                raise self.db.error("sample", scene.samples[i], f"{LIDAR} key frame is not after the previous one")
        now = scene.frame(k)
        plan = now.lidar.then(_RELABEL)
        history, sources = self._history(scene, k, plan)
        points, times = [], []
        for i in range(k + 1, k + FUTURE_KEYFRAMES + 1):
            before, after = scene.frame(i - 1), scene.frame(i)
            middle = (before.time_us + after.time_us) / 2
            points += [scene.track_at(middle), after.lidar.translation]
            times += [middle, after.time_us]
        future = plan.local(np.array(points))[:, :2]
        future_time = (np.array(times) - now.time_us) / 1e6
        command = nuscenes_command(float(future[NUSCENES_FUTURE][-1, 1]))
        agents = self._agents(scene, k, plan)
        turn = _wrap(plan.heading(scene.frame(k + FUTURE_KEYFRAMES).ego.rotation) - plan.heading(now.ego.rotation))
        record, first = scene.samples[k], scene.samples[0]
        image, view = self._image(scene, record, plan, plan.local(now.ego.translation)[2])
        stamps = [self.db.field("sample", r, "timestamp", int) for r in (first, record)]
        sample = DrivingSample(
            sample_id=record["token"],
            scenario=scene.location,
            episode_seed=scene.number,
            time_s=(stamps[1] - stamps[0]) / 1e6,
            image=image,
            history=history,
            command=command,
            future=future,
            future_time_s=future_time,
            response=_response(record["token"], scene.location, command, history, future, future_time, turn, agents),
            view=view,
            ego_size=self.ego_size_m,
            agents=agents.paths,
            agent_size=agents.size,
        )
        self.velocity_rows.update(sources)
        return sample

    def _history(self, scene: _Scene, k: int, plan: _Rigid) -> tuple[np.ndarray, list[str]]:
        """The (7, 6) history and, per row, where its velocity came from ("can_bus" or "ego_pose")."""
        rows, sources = [], []
        for i in range(k - HISTORY_KEYFRAMES, k + 1):
            frame = scene.frame(i)
            logged = scene.can.at(frame.time_us) if scene.can else None
            if logged is not None:
                velocity, acceleration = (frame.ego.rotation @ v for v in logged)
            else:
                velocity, acceleration = scene.velocity(i), scene.acceleration(i)
            sources.append("ego_pose" if logged is None else "can_bus")
            xy = plan.local(frame.lidar.translation)[:2]
            rows.append([*xy, *(plan.rotation.T @ velocity)[:2], *(plan.rotation.T @ acceleration)[:2]])
        return np.array(rows), sources

    def _agents(self, scene: _Scene, k: int, plan: _Rigid) -> _Agents:
        db = self.db
        paths, sizes, speeds, vehicle = [], [], [], []
        for token in scene.index.annotations.get(scene.samples[k]["token"], []):
            annotation = db.rows["sample_annotation"][token]
            instance = db.ref("sample_annotation", annotation, "instance_token", "instance")
            category = db.ref("instance", instance, "category_token", "category")
            name = db.field("category", category, "name", str)
            if not name.startswith(AGENT_CATEGORIES):
                continue
            path = np.full((FUTURE_STEPS + 1, 3), np.nan)
            record, offset = annotation, 0
            while True:
                box = db.pose("sample_annotation", record)
                path[2 * offset] = [*plan.local(box.translation)[:2], plan.heading(box.rotation)]
                if not db.field("sample_annotation", record, "next", str):
                    break
                record = db.ref("sample_annotation", record, "next", "sample_annotation")
                step = scene.position.get(db.field("sample_annotation", record, "sample_token", str), -1) - k
                if step <= offset:
                    raise db.error("sample_annotation", record, "is not later in the scene than its prev")
                if step > FUTURE_KEYFRAMES:
                    break
                offset = step
            keys = path[0::2]
            both = ~np.isnan(keys[:-1, 0]) & ~np.isnan(keys[1:, 0])
            middle = (keys[:-1] + keys[1:]) / 2
            middle[:, 2] = _wrap(keys[:-1, 2] + _wrap(keys[1:, 2] - keys[:-1, 2]) / 2)
            path[1::2] = np.where(both[:, None], middle, np.nan)
            width, length, _ = db.vector("sample_annotation", annotation, "size", 3)
            paths.append(path)
            sizes.append((length, width))
            speeds.append(self._box_speed(annotation))
            vehicle.append(name.startswith("vehicle."))
        return _Agents(
            np.array(paths).reshape(-1, FUTURE_STEPS + 1, 3),
            np.array(sizes, dtype=float).reshape(-1, 2),
            np.array(speeds, dtype=float),
            np.array(vehicle, dtype=bool),
        )

    def _box_speed(self, annotation: dict[str, Any]) -> float:
        """devkit `box_velocity`, horizontal: centred difference over prev and next (else one side), NaN if too far."""
        db = self.db
        links = {key: db.field("sample_annotation", annotation, key, str) for key in ("prev", "next")}
        if not any(links.values()):
            return float("nan")
        first, last = (
            db.ref("sample_annotation", annotation, key, "sample_annotation") if links[key] else annotation
            for key in ("prev", "next")
        )
        stamps = [
            db.field("sample", db.ref("sample_annotation", a, "sample_token", "sample"), "timestamp", int)
            for a in (first, last)
        ]
        dt = (stamps[1] - stamps[0]) / 1e6
        limit = 3.0 if all(links.values()) else 1.5
        if not 0 < dt <= limit:
            return float("nan")
        moved = db.vector("sample_annotation", last, "translation", 3) - db.vector(
            "sample_annotation", first, "translation", 3
        )
        return float(np.linalg.norm(moved[:2]) / dt)

    def _image(
        self, scene: _Scene, record: dict[str, Any], plan: _Rigid, ground: float
    ) -> tuple[np.ndarray, CameraView]:
        db = self.db
        tiles, view = [], NO_TOP_VIEW
        for channel in self.channels:
            token = scene.index.key_data.get(record["token"], {}).get(channel)
            if token is None:
                raise db.error("sample", record, f"has no {channel} key frame in sample_data.json")
            data = db.rows["sample_data"][token]
            path = scene.dataroot / db.field("sample_data", data, "filename", str)
            try:
                with Image.open(path) as opened:
                    image = np.asarray(opened.convert("RGB"))
            except OSError as err:
                raise db.error("sample_data", data, f"image {path} cannot be read: {err}") from None
            tile = _fit(image, self.image_width)
            if len(self.channels) == 1:
                view = self._top_view(
                    data, plan, ground, tile.shape[1] / image.shape[1], tile.shape[0] / image.shape[0]
                )
            tiles.append(tile if not tiles else _resized(tile, tiles[0].shape[1], tiles[0].shape[0]))
        if len(tiles) == 1:
            return tiles[0], view
        return np.vstack([np.hstack(tiles[:3]), np.hstack(tiles[3:])]), view

    def _top_view(self, data: dict[str, Any], plan: _Rigid, ground: float, sx: float, sy: float) -> CameraView:
        """The top view of a camera looking straight down on the ground (planning-frame height `ground`), else
        NO_TOP_VIEW (scaled by sx, sy where the frame was resized)."""
        db = self.db
        _, _, camera = db.sensor_pose(data)
        calibration = db.ref("sample_data", data, "calibrated_sensor_token", "calibrated_sensor")
        rows = calibration.get("camera_intrinsic")
        if not isinstance(rows, list) or len(rows) != 3:
            raise db.error("calibrated_sensor", calibration, f"camera_intrinsic must be 3 x 3 numbers, got {rows!r}")
        intrinsic = np.array([db.vector("calibrated_sensor", {**calibration, "row": r}, "row", 3) for r in rows])
        rotation, (tx, ty, tz) = plan.rotation.T @ camera.rotation, plan.local(camera.translation)
        height = tz - ground
        if np.abs(rotation[:, 2] - (0, 0, -1)).max() > 1e-6 or height <= 0:
            return NO_TOP_VIEW
        c, s = rotation[0, 0], rotation[1, 0]
        scale = intrinsic[0, 0] / height
        u = intrinsic[0, 2] - scale * (c * tx + s * ty)
        v = intrinsic[1, 2] - scale * (s * tx - c * ty)
        return CameraView(float(scale * sx), (float(u * sx), float(v * sy)), math.atan2(s, c))


def _resized(image: np.ndarray, width: int, height: int) -> np.ndarray:
    if image.shape[:2] == (height, width):
        return image
    return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.BILINEAR))


def _fit(image: np.ndarray, width: int) -> np.ndarray:
    """The image if both sides are multiples of 28 px, else resized to `width` and the nearest multiple in height."""
    h, w = image.shape[:2]
    if h % IMAGE_UNIT_PX == 0 and w % IMAGE_UNIT_PX == 0:
        return image
    height = max(IMAGE_UNIT_PX, round(width * h / w / IMAGE_UNIT_PX) * IMAGE_UNIT_PX)
    return _resized(image, width, height)


def _response(
    token: str,
    location: str,
    command: str,
    history: np.ndarray,
    future: np.ndarray,
    future_time: np.ndarray,
    turn_rad: float,
    agents: _Agents,
) -> DrivingResponse:
    """The expert answer by data/labels.py from what nuScenes has (module docstring)."""
    path = np.vstack([np.zeros(2), future])
    steps = np.diff(np.concatenate([[0.0], future_time]))
    speed = np.concatenate([[np.hypot(*history[-1, 2:4])], np.linalg.norm(np.diff(path, axis=0), axis=1) / steps])

    def scene(mask: np.ndarray) -> rules.Scene:
        return rules.Scene(
            scenario=location,
            command=command,
            ego_speed=speed,
            ego_future=future,
            heading_change_rad=float(turn_rad),
            lane_change=0,
            yielding=False,
            agents=agents.paths[mask],
            agent_speed=agents.speed[mask],
            agent_crashed=np.zeros(int(mask.sum()), dtype=bool),
        )

    found = rules.label(scene(agents.vehicle))
    flags = {**found.critical_objects, "pedestrian": rules.critical_objects(scene(~agents.vehicle))["nearby_vehicle"]}
    rng = np.random.default_rng(int.from_bytes(hashlib.md5(token.encode()).digest()[:8], "little"))
    return DrivingResponse(
        critical_objects=flags,
        explanation=rules.explanation(found, location, rng),
        future_meta_behavior=found.meta,
        trajectory=future[3::4],
    )


@dataclass(frozen=True)
class ConvertReport:
    """What `convert_nuscenes` wrote: samples per split, key frames skipped by reason, failures (file and token)."""

    scenes: int
    samples: dict[str, int]
    skipped: dict[str, int]
    failures: list[str]
    velocity_rows: dict[str, int]  # history rows whose velocity came from "can_bus" or from "ego_pose" differences
    seconds: float
    kept: bool = False  # samples failed and `out` held a complete data set: that was kept, the conversion dropped


def convert_nuscenes(
    dataroot: str | Path,
    version: str,
    out: str | Path,
    six_cameras: bool = False,
    image_width: int = IMAGE_WIDTH_PX,
    ego_size_m: tuple[float, float] = NUSCENES_EGO_SIZE_M,
    overwrite: bool = False,
    on_start: Callable[[int], None] | None = None,
    on_item: Callable[[], None] | None = None,
) -> ConvertReport:
    """Convert `dataroot/version` (and `dataroot/can_bus`) into a fastddrive dataset folder `out`, one shard a scene.

    `ego_size_m` (length, width) is the samples' ego box: the nuScenes car unless the data is an export of
    another vehicle (nuScenes has no field for it). `on_start(key_frames)` once, then `on_item()` per key frame.
    `out` is checked first (not inside `dataroot`, ...); a missing table raises NuScenesError before anything is
    written; a malformed record fails the samples that need it, named in `failures`, and the rest completes (the
    manifest is then not marked complete). The dataset is built beside `out` and takes its place at the end,
    except that a conversion with failures does not replace a complete data set (data/build.py).
    """
    start = time.perf_counter()
    dataroot, out = Path(dataroot), Path(out)
    if image_width < IMAGE_UNIT_PX or image_width % IMAGE_UNIT_PX:
        raise ValueError(f"image_width must be a positive multiple of {IMAGE_UNIT_PX} px, got {image_width}")
    check_folder_destination(out, "--out", inputs=(dataroot,), owned=(out,))
    channels = SIX_CAMERAS if six_cameras else (FRONT,)
    settings = {
        "source": "nuscenes",
        "version": version,
        "dataroot": str(dataroot.resolve()),
        "cameras": list(channels),
        "image_width_px": image_width,
        "ego_size_m": list(ego_size_m),
        "conventions": CONVENTIONS,
    }
    prepare_output(out, settings, overwrite)
    complete_before = holds_complete_dataset(out)
    problems: list[str] = []
    db = _Tables(dataroot / version, problems)
    index = _index(db, problems)
    scenes = []
    for record in db.rows["scene"].values():
        try:
            scenes.append(_Scene(db, index, dataroot, record, problems))
        except RecordError as err:
            problems.append(f"{err}; the scene is left out")
    converter = _Converter(db, channels, image_width, tuple(ego_size_m))

    def convert(folder: Path) -> ConvertReport:
        write_manifest(folder, settings, complete=False, counts={})
        if on_start:
            on_start(sum(len(s.samples) for s in scenes))
        counts, skipped, failures = dict.fromkeys(SPLITS, 0), Counter(), []
        for number, scene in enumerate(scenes):
            samples = []
            for k, record in enumerate(scene.samples):
                if k < HISTORY_KEYFRAMES:
                    skipped["under 3 s of history"] += 1
                elif k + FUTURE_KEYFRAMES >= len(scene.samples):
                    skipped["under 5 s of future"] += 1
                else:
                    try:
                        samples.append(converter.sample(scene, k))
                    except ValueError as err:  # a RecordError, or values the sample format refuses
                        failures.append(f"{scene.name} sample {record['token']}: {err}")
                if on_item:
                    on_item()
            split = scene.split(version)
            if samples:
                name = f"{number:05d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', scene.name)}.parquet"
                write_shard(folder / split / name, samples)
            counts[split] += len(samples)
        failures = problems + failures
        totals = {"samples": counts, "skipped": dict(skipped), "failures": len(failures)}
        write_manifest(folder, settings, complete=not failures, counts=totals)
        return ConvertReport(
            len(scenes), counts, dict(skipped), failures, dict(converter.velocity_rows), time.perf_counter() - start
        )

    report, replaced = staged_build(out, convert, lambda r: not (r.failures and complete_before))
    return report if replaced else dataclasses.replace(report, kept=True, seconds=time.perf_counter() - start)


@dataclass(frozen=True)
class ExportReport:
    """What `export_nuscenes` wrote: the version folder, scenes, samples per split, each sample's key-frame token."""

    version: str
    scenes: int
    samples: dict[str, int]
    tokens: dict[str, str]  # simulator sample_id -> the token of its t = 0 nuScenes sample
    seconds: float


def _headings(vectors: np.ndarray) -> np.ndarray:
    """Direction of each (x, y) vector, the previous one carried where it is (near) zero; 0 before any."""
    out, last = [], 0.0
    for vx, vy in vectors:
        if math.hypot(vx, vy) > MIN_TRAVEL:
            last = math.atan2(vy, vx)
        out.append(last)
    return np.array(out)


class _Exporter:
    """Collects the tables of an export and writes the files of each scene as it goes."""

    def __init__(self, out: Path, version: str) -> None:
        self.out, self.version = out, version
        self.tables: dict[str, list[dict[str, Any]]] = {name: [] for name in EXPORT_TABLES}
        self.number = 0
        for channel, modality in ((LIDAR, "lidar"), (FRONT, "camera")):
            self.tables["sensor"].append(
                {"token": self.token("sensor", channel), "channel": channel, "modality": modality}
            )
        self.tables["category"].append(
            {"token": self.token("category", "car"), "name": "vehicle.car", "description": "Simulated car."}
        )
        self.lidar_calibration = self._calibration(self.token("calibration", LIDAR), LIDAR, _EXPORT_LIDAR, [])

    @staticmethod
    def token(*parts: object) -> str:
        return hashlib.md5("/".join(map(str, parts)).encode()).hexdigest()

    def _calibration(self, token: str, channel: str, frame: _Rigid, intrinsic: list[list[float]]) -> str:
        self.tables["calibrated_sensor"].append(
            {
                "token": token,
                "sensor_token": self.token("sensor", channel),
                "translation": frame.translation.tolist(),
                "rotation": _quaternion(frame.rotation),
                "camera_intrinsic": intrinsic,
            }
        )
        return token

    def _write(self, relative: str, data: bytes) -> None:
        """One file of the export (`out` is a folder being built: it takes its place once whole)."""
        path = self.out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def add(self, sample: DrivingSample, split: str) -> str:
        """Write one sample as a scene; returns the token of its t = 0 sample."""
        self.number += 1
        while self.number in CAN_BLACKLIST:
            self.number += 1
        if self.number > 9999:
            raise ValueError("a nuScenes export holds at most 9978 scenes (names scene-0001..scene-9999)")
        name = f"scene-{self.number:04d}"

        def tok(*parts: object) -> str:
            return self.token(name, *parts)

        t0 = EXPORT_EPOCH_US + self.number * SCENE_SPACING_US + HISTORY_KEYFRAMES * KEYFRAME_US
        world = _Rigid(_rz(-sample.view.ego_heading_rad), np.array([*EXPORT_ORIGIN_M, 0.0]))
        history_heading = _headings(sample.history[:, 2:4])
        history_heading[-1] = 0.0  # the ego frame at t = 0 is the planning frame
        future_heading = _headings(np.diff(np.vstack([np.zeros(2), sample.future]), axis=0))
        # (time, x, y, heading, key frame index, is key frame) of every LIDAR_TOP pose, in time order
        poses = [
            (t0 + (j - HISTORY_KEYFRAMES) * KEYFRAME_US, *sample.history[j, :2], history_heading[j], j, True)
            for j in range(HISTORY_STEPS)
        ]
        poses += [
            (t0 + round(float(t) * 1e6), *sample.future[i], future_heading[i], HISTORY_STEPS + i // 2, i % 2 == 1)
            for i, t in enumerate(sample.future_time_s)
        ]
        keys = [p for p in poses if p[5]]
        samples = [tok("sample", j) for j in range(len(keys))]
        for j, pose in enumerate(keys):
            self.tables["sample"].append(
                {
                    "token": samples[j],
                    "timestamp": pose[0],
                    "prev": samples[j - 1] if j else "",
                    "next": samples[j + 1] if j + 1 < len(keys) else "",
                    "scene_token": tok("scene"),
                }
            )
        lidar = [tok(LIDAR, n) for n in range(len(poses))]
        ego_frames = []
        for n, (stamp, x, y, heading, j, key) in enumerate(poses):
            ego = world.then(_Rigid(_rz(heading), np.array([x, y, 0.0])))
            ego_frames.append(ego)
            filename = f"{'samples' if key else 'sweeps'}/{LIDAR}/{name}__{LIDAR}__{stamp}.pcd.bin"
            self._write(filename, b"")  # no point cloud: the simulator has no lidar
            self._sample_data(
                lidar[n],
                samples[j],
                self._ego_pose(tok("ego_pose", n), ego, stamp),
                self.lidar_calibration,
                filename,
                stamp,
                key,
                prev=lidar[n - 1] if n else "",
                next=lidar[n + 1] if n + 1 < len(poses) else "",
            )
        key_egos = [ego for ego, pose in zip(ego_frames, poses, strict=True) if pose[5]]
        self._cameras(sample, name, tok, samples, [p[0] for p in keys], key_egos)
        self._annotations(sample, tok, samples, world)
        self._can_bus(sample, name, poses[:HISTORY_STEPS], ego_frames[:HISTORY_STEPS], world)
        log = tok("log")
        self.tables["log"].append(
            {
                "token": log,
                "logfile": f"fastddrive-{name}",
                "vehicle": "highway-env",
                "date_captured": datetime.fromtimestamp(t0 / 1e6, UTC).strftime("%Y-%m-%d"),
                "location": sample.scenario,
            }
        )
        self.tables["scene"].append(
            {
                "token": tok("scene"),
                "log_token": log,
                "nbr_samples": len(keys),
                "first_sample_token": samples[0],
                "last_sample_token": samples[-1],
                "name": name,
                "description": f"fastddrive sample {sample.sample_id}; {SPLIT_NOTE}{split}",
            }
        )
        return samples[HISTORY_KEYFRAMES]

    def _ego_pose(self, token: str, ego: _Rigid, stamp: int) -> str:
        self.tables["ego_pose"].append(
            {
                "token": token,
                "timestamp": stamp,
                "rotation": _quaternion(ego.rotation),
                "translation": ego.translation.tolist(),
            }
        )
        return token

    def _sample_data(
        self,
        token: str,
        sample: str,
        ego_pose: str,
        calibration: str,
        filename: str,
        stamp: int,
        key: bool,
        size: tuple[int, int] = (0, 0),
        prev: str = "",
        next: str = "",
    ) -> None:
        self.tables["sample_data"].append(
            {
                "token": token,
                "sample_token": sample,
                "ego_pose_token": ego_pose,
                "calibrated_sensor_token": calibration,
                "timestamp": stamp,
                "fileformat": "pcd" if filename.endswith(".pcd.bin") else "jpg",
                "is_key_frame": key,
                "height": size[1],
                "width": size[0],
                "filename": filename,
                "prev": prev,
                "next": next,
            }
        )

    def _cameras(
        self,
        sample: DrivingSample,
        name: str,
        tok: Callable[..., str],
        samples: list[str],
        stamps: list[int],
        egos: list[_Rigid],
    ) -> None:
        """CAM_FRONT at every key frame, as the devkit expects of every sample: a camera TOP_VIEW_HEIGHT_M straight
        above the ego looking down, image x along the view's heading, so that it projects the ground as
        `sample.view` does. At t = 0 its image is the sample's frame; the simulator keeps no frame of the other
        key frames, so theirs is a drawing of what is known there (the ego, and the agents after t = 0)."""
        view = sample.view
        heading = view.ego_heading_rad
        axes = np.array([[math.cos(heading), math.sin(heading), 0.0], [math.sin(heading), -math.cos(heading), 0.0]])
        rotation = np.column_stack([axes[0], axes[1], [0.0, 0.0, -1.0]])
        focal = view.pixels_per_metre * TOP_VIEW_HEIGHT_M
        intrinsic = [[focal, 0.0, view.ego_pixel[0]], [0.0, focal, view.ego_pixel[1]], [0.0, 0.0, 1.0]]
        mount = _Rigid(rotation, np.array([0.0, 0.0, TOP_VIEW_HEIGHT_M]))
        calibration = self._calibration(tok("calibration", FRONT), FRONT, mount, intrinsic)
        height, width = sample.image.shape[:2]
        tokens = [tok(FRONT) if j == HISTORY_KEYFRAMES else tok(FRONT, j) for j in range(len(samples))]
        for j, (stamp, ego) in enumerate(zip(stamps, egos, strict=True)):
            drawn = j != HISTORY_KEYFRAMES
            image = (
                _drawn_top_view(sample, j - HISTORY_KEYFRAMES, egos[HISTORY_KEYFRAMES], ego) if drawn else sample.image
            )
            filename = f"samples/{FRONT}/{name}__{FRONT}__{stamp}.jpg"
            jpeg = io.BytesIO()
            Image.fromarray(image).save(jpeg, format="JPEG", quality=JPEG_QUALITY, subsampling=0)
            self._write(filename, jpeg.getvalue())
            ego_pose = self._ego_pose(tok("ego_pose", FRONT, j), ego, stamp)
            self._sample_data(
                tokens[j],
                samples[j],
                ego_pose,
                calibration,
                filename,
                stamp,
                True,
                (width, height),
                prev=tokens[j - 1] if j else "",
                next=tokens[j + 1] if j + 1 < len(tokens) else "",
            )

    def _annotations(self, sample: DrivingSample, tok: Callable[..., str], samples: list[str], world: _Rigid) -> None:
        """Every agent as an instance, annotated at the key frames (even indices) where it is present."""
        for n, path in enumerate(sample.agents):
            present = [j for j in range(FUTURE_KEYFRAMES + 1) if np.isfinite(path[2 * j]).all()]
            tokens = [tok("annotation", n, j) for j in present]
            length, width = sample.agent_size[n]
            for m, j in enumerate(present):
                x, y, heading = path[2 * j]
                box = world.then(_Rigid(_rz(heading), np.array([x, y, AGENT_HEIGHT_M / 2])))
                self.tables["sample_annotation"].append(
                    {
                        "token": tokens[m],
                        "sample_token": samples[HISTORY_KEYFRAMES + j],
                        "instance_token": tok("instance", n),
                        "visibility_token": "",
                        "attribute_tokens": [],
                        "translation": box.translation.tolist(),
                        "size": [float(width), float(length), AGENT_HEIGHT_M],
                        "rotation": _quaternion(box.rotation),
                        "prev": tokens[m - 1] if m else "",
                        "next": tokens[m + 1] if m + 1 < len(tokens) else "",
                        "num_lidar_pts": 0,
                        "num_radar_pts": 0,
                    }
                )
            if tokens:
                self.tables["instance"].append(
                    {
                        "token": tok("instance", n),
                        "category_token": self.token("category", "car"),
                        "nbr_annotations": len(tokens),
                        "first_annotation_token": tokens[0],
                        "last_annotation_token": tokens[-1],
                    }
                )

    def _can_bus(self, sample: DrivingSample, name: str, poses: list, egos: list[_Rigid], world: _Rigid) -> None:
        """CAN bus `pose` messages at the history key frames (vehicle frame; keys sorted as in the real files)."""
        headings = np.array([p[3] for p in poses])
        rates = np.concatenate([[0.0], _wrap(np.diff(headings)) / (KEYFRAME_US / 1e6)])
        messages = []
        for j, ego in enumerate(egos):
            to_vehicle = ego.rotation.T @ world.rotation
            messages.append(
                {
                    "utime": poses[j][0],
                    "pos": ego.translation.tolist(),
                    "orientation": _quaternion(ego.rotation),
                    "vel": (to_vehicle @ [*sample.history[j, 2:4], 0.0]).tolist(),
                    "accel": (to_vehicle @ [*sample.history[j, 4:6], 0.0]).tolist(),
                    "rotation_rate": [0.0, 0.0, float(rates[j])],
                }
            )
        self._write(f"can_bus/{name}_pose.json", json.dumps(messages, sort_keys=True).encode())

    def finish(self) -> None:
        """The map (an empty mask: no map is known) and every table."""
        token = self.token("map")
        filename = f"maps/{token}.png"
        mask = io.BytesIO()
        Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(mask, format="PNG")
        self._write(filename, mask.getvalue())
        logs = [log["token"] for log in self.tables["log"]]
        self.tables["map"].append(
            {"token": token, "log_tokens": logs, "category": "semantic_prior", "filename": filename}
        )
        folder = self.out / self.version
        folder.mkdir(parents=True, exist_ok=True)
        for table, rows in self.tables.items():
            (folder / f"{table}.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")


def export_nuscenes(
    data: str | Path,
    out: str | Path,
    version: str = EXPORT_VERSION,
    splits: Sequence[str] = SPLITS,
    overwrite: bool = False,
    on_start: Callable[[int], None] | None = None,
    on_item: Callable[[], None] | None = None,
) -> ExportReport:
    """Write the samples of a fastddrive dataset's `splits` into `out` in the nuScenes v1.0 layout.

    Tables go to `out/version/`, frames to `out/samples/CAM_FRONT/`, CAN bus messages to `out/can_bus/`; each
    sample is one scene (module docstring). `on_start(samples)` once, then `on_item()` per sample. `out` must be
    missing or empty, or with `overwrite` an earlier export of `version` (nothing else is deleted); it is checked
    first, and the export is built beside it and takes its place only once it is whole.
    """
    from fastddrive.data.wod_e2e import check_export_output

    start = time.perf_counter()
    out = Path(out)
    unknown = [s for s in splits if s not in SPLITS]
    if unknown:
        raise ValueError(f"unknown split {unknown[0]!r}; known: {', '.join(SPLITS)}")
    check_folder_destination(out, "--out", inputs=(data,))
    dataset = DrivingDataset.open(data)
    check_export_output(out, overwrite, {version, "samples", "sweeps", "can_bus", "maps"}, "a nuScenes export")
    if on_start:
        on_start(sum(dataset.table(s, columns=["sample_id"]).num_rows for s in splits))

    def export(folder: Path) -> ExportReport:
        exporter = _Exporter(folder, version)
        counts, tokens = dict.fromkeys(splits, 0), {}
        for split in splits:
            for sample in dataset.samples(split):
                tokens[sample.sample_id] = exporter.add(sample, split)
                counts[split] += 1
                if on_item:
                    on_item()
        exporter.finish()
        return ExportReport(version, len(exporter.tables["scene"]), counts, tokens, time.perf_counter() - start)

    report, _ = staged_build(out, export, lambda _: True)
    return report
