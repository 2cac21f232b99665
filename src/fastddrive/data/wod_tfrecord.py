"""WOD-E2E TFRecord files without tensorflow: the record framing and the E2EDFrame fields a sample is made of.

Framing (tensorflow `core/lib/io/record_writer.cc`, `core/lib/hash/crc32c.h`), per record: the data length as
uint64 little endian, the masked crc32c of those 8 bytes (uint32 LE), the data, the masked crc32c of the data;
mask(crc) = rotate right by 15 bits + 0xa282ead8. Both CRCs are checked on read. A bad data CRC loses one record
and reading goes on (the length was verified); a bad length CRC or a cut file loses the rest of the file.

Messages (proto2, package waymo.open_dataset), from waymo-research/waymo-open-dataset
`src/waymo_open_dataset/protos/end_to_end_driving_data.proto` (commit e378e5ba5bb8, 2025-04-28) and
`src/waymo_open_dataset/dataset.proto` (Frame, Context, CameraImage, CameraCalibration). Only these fields are
mirrored, with the official numbers and types; the rest are unknown fields here, which protobuf skips:
- E2EDFrame: `frame` = 1 (Frame), `future_states` = 5 (EgoTrajectoryStates: t = (0, 5] s at 4 Hz, positions
  only), `intent` = 7 (EgoIntent.Intent: UNKNOWN 0, GO_STRAIGHT 1, GO_LEFT 2, GO_RIGHT 3; a varint, read as
  int32), `preference_trajectories` = 8 (repeated EgoTrajectoryStates);
- E2EDFrame `past_states` = 6 (EgoTrajectoryStates: 16 states at 4 Hz over (-4, 0] s, with velocities and
  accelerations);
- Frame: `context` = 1 (Context), `timestamp_micros` = 2 (int64), `images` = 4 (CameraImage: `name` = 1 as
  CameraName.Name, `image` = 2, JPEG bytes); Context: `camera_calibrations` = 2 (CameraCalibration: `name` = 1,
  `intrinsic` = 2, `extrinsic` = 3 (Transform: `transform` = 1, 16 doubles row-major), `width` = 4,
  `height` = 5) and `name` = 1 (string), the frame name,
  which the release's JSON records use as `sample_id` (Kaiwen-Hong/Fast-dLLM
  `fast_ddrive/data/convert_wod_e2e.py`; the release's `fast_ddrive/eval/evaluate_waymo_metrics.py` keys its
  ground truth on it);
- EgoTrajectoryStates: `pos_x` = 1, `pos_y` = 2, `pos_z` = 3, `vel_x` = 4, `vel_y` = 5, `accel_x` = 6,
  `accel_y` = 7 (repeated float, packed), `preference_score` = 8 (float).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from fastddrive.core.outputs import write_bytes

_HEADER = struct.Struct("<QI")  # length, masked crc of the length
_CRC = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8


class CorruptRecord(ValueError):
    """A TFRecord record that cannot be read: names the file, the record's index (from 0) and its byte offset."""

    def __init__(self, path: Path, index: int, reason: str, offset: int | None = None) -> None:
        where = f"record #{index}" + (f" at byte {offset}" if offset is not None else "")
        super().__init__(f"{path}: {where}: {reason}")
        self.path, self.index, self.reason, self.offset = path, index, reason, offset


def masked_crc(data: bytes) -> int:
    """The crc32c of `data` as TFRecord stores it (masked, so that a CRC over stored CRCs does not degenerate)."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def read_records(path: str | Path) -> Iterator[bytes | CorruptRecord]:
    """Every record's data in a TFRecord file, in order; a record that fails its checks comes as a CorruptRecord."""
    for _, data in framed_records(path):
        yield data


def framed_records(path: str | Path) -> Iterator[tuple[int, bytes | CorruptRecord]]:
    """(byte offset, data) of every record in a TFRecord file, as `read_records`."""
    path = Path(path)
    with path.open("rb") as file:
        index = offset = 0
        while header := file.read(_HEADER.size):
            if len(header) < _HEADER.size:
                reason = f"the file ends inside the record header ({len(header)} bytes)"
                yield offset, CorruptRecord(path, index, reason, offset)
                return
            length, length_crc = _HEADER.unpack(header)
            if masked_crc(header[:8]) != length_crc:
                reason = "the length fails its CRC; the rest of the file cannot be framed"
                yield offset, CorruptRecord(path, index, reason, offset)
                return
            body = file.read(length + _CRC.size)
            if len(body) < length + _CRC.size:
                reason = f"the file ends inside the record ({len(body)} of {length + 4} bytes)"
                yield offset, CorruptRecord(path, index, reason, offset)
                return
            data = body[:length]
            if masked_crc(data) != _CRC.unpack(body[length:])[0]:
                yield offset, CorruptRecord(path, index, "the data fails its CRC", offset)
            else:
                yield offset, data
            index += 1
            offset += _HEADER.size + length + _CRC.size


def write_records(path: str | Path, records: Iterable[bytes]) -> int:
    """Write `records` as a TFRecord file, atomically (a reader never sees half a file); returns the count."""
    framed = []
    for data in records:
        length = struct.pack("<Q", len(data))
        framed.append(length + _CRC.pack(masked_crc(length)) + data + _CRC.pack(masked_crc(data)))
    write_bytes(Path(path), b"".join(framed))
    return len(framed)


_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "waymo.open_dataset"
# message -> (field, number, label, type, message type): the official protos' numbers and types.
_MESSAGES = {
    "Transform": [("transform", 1, _F.LABEL_REPEATED, _F.TYPE_DOUBLE, None)],
    # CameraName.Name and the calibration's fields (dataset.proto); enums read as int32, as `intent` below.
    "CameraCalibration": [
        ("name", 1, _F.LABEL_OPTIONAL, _F.TYPE_INT32, None),
        ("intrinsic", 2, _F.LABEL_REPEATED, _F.TYPE_DOUBLE, None),
        ("extrinsic", 3, _F.LABEL_OPTIONAL, _F.TYPE_MESSAGE, "Transform"),
        ("width", 4, _F.LABEL_OPTIONAL, _F.TYPE_INT32, None),
        ("height", 5, _F.LABEL_OPTIONAL, _F.TYPE_INT32, None),
    ],
    "CameraImage": [
        ("name", 1, _F.LABEL_OPTIONAL, _F.TYPE_INT32, None),
        ("image", 2, _F.LABEL_OPTIONAL, _F.TYPE_BYTES, None),
    ],
    "Context": [
        ("name", 1, _F.LABEL_OPTIONAL, _F.TYPE_STRING, None),
        ("camera_calibrations", 2, _F.LABEL_REPEATED, _F.TYPE_MESSAGE, "CameraCalibration"),
    ],
    "Frame": [
        ("context", 1, _F.LABEL_OPTIONAL, _F.TYPE_MESSAGE, "Context"),
        ("timestamp_micros", 2, _F.LABEL_OPTIONAL, _F.TYPE_INT64, None),
        ("images", 4, _F.LABEL_REPEATED, _F.TYPE_MESSAGE, "CameraImage"),
    ],
    "EgoTrajectoryStates": [
        ("pos_x", 1, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("pos_y", 2, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("pos_z", 3, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("vel_x", 4, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("vel_y", 5, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("accel_x", 6, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("accel_y", 7, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("preference_score", 8, _F.LABEL_OPTIONAL, _F.TYPE_FLOAT, None),
    ],
    "E2EDFrame": [
        ("frame", 1, _F.LABEL_OPTIONAL, _F.TYPE_MESSAGE, "Frame"),
        ("future_states", 5, _F.LABEL_OPTIONAL, _F.TYPE_MESSAGE, "EgoTrajectoryStates"),
        ("past_states", 6, _F.LABEL_OPTIONAL, _F.TYPE_MESSAGE, "EgoTrajectoryStates"),
        # An enum in the official proto; the same varint on the wire, so read as int32 (no enum descriptor here).
        ("intent", 7, _F.LABEL_OPTIONAL, _F.TYPE_INT32, None),
        ("preference_trajectories", 8, _F.LABEL_REPEATED, _F.TYPE_MESSAGE, "EgoTrajectoryStates"),
    ],
}


def mirrored_classes(file_name: str, messages: dict[str, list[tuple]]) -> dict[str, Any]:
    """Message classes for `messages` (name -> (field, number, label, type, message type) rows, the official
    numbers and types; enums as int32, the same varint on the wire; repeated floats packed, as the official
    protos declare them), built in a private descriptor pool: no clash with waymo's own classes if imported."""
    file = descriptor_pb2.FileDescriptorProto(name=file_name, package=_PACKAGE, syntax="proto2")
    for name, fields in messages.items():
        message = file.message_type.add(name=name)
        for field_name, number, label, kind, type_name in fields:
            spec = message.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name:
                spec.type_name = f".{_PACKAGE}.{type_name}"
            if label == _F.LABEL_REPEATED and kind == _F.TYPE_FLOAT:
                spec.options.packed = True  # [packed = true] in the official proto
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(file.SerializeToString())
    find = pool.FindMessageTypeByName
    return {name: message_factory.GetMessageClass(find(f"{_PACKAGE}.{name}")) for name in messages}


E2EDFrame = mirrored_classes("fastddrive/wod_e2e_frame.proto", _MESSAGES)["E2EDFrame"]


INTENT_NUMBERS = {"UNKNOWN": 0, "GO_STRAIGHT": 1, "GO_LEFT": 2, "GO_RIGHT": 3}  # EgoIntent.Intent
_INTENT_NAMES = {number: name for name, number in INTENT_NUMBERS.items()}


CAMERA_NUMBERS = {  # CameraName.Name
    "FRONT": 1,
    "FRONT_LEFT": 2,
    "FRONT_RIGHT": 3,
    "SIDE_LEFT": 4,
    "SIDE_RIGHT": 5,
    "REAR_LEFT": 6,
    "REAR": 7,
    "REAR_RIGHT": 8,
}
CAMERA_NAMES = {number: name for name, number in CAMERA_NUMBERS.items()}
PAST_COLUMNS = ("pos_x", "pos_y", "vel_x", "vel_y", "accel_x", "accel_y")


@dataclass(frozen=True)
class CameraCalibration:
    """One camera's calibration: intrinsics [f_u, f_v, c_u, c_v, k1, k2, p1, p2, k3], the 4 x 4 camera-to-vehicle
    extrinsic, and the image size [px]."""

    intrinsic: tuple[float, ...]
    extrinsic: np.ndarray
    width: int
    height: int


@dataclass
class WodFrame:
    """The fields of one E2EDFrame that this project reads: its name and timestamp, the logged future (T, 2) [m]
    at 4 Hz (None when the frame has none, as in the test split), the intent's name, the raters as
    `{pos_x, pos_y, preference_score}` dicts, the logged past (T, 6) [x, y, vx, vy, ax, ay] at 4 Hz ending at
    t = 0 (None without), and the camera images (JPEG bytes) and calibrations by camera name, paired by the
    name each carries, never by list position."""

    name: str
    timestamp_micros: int = 0
    future: np.ndarray | None = None
    intent: str = "UNKNOWN"
    raters: list[dict[str, Any]] = field(default_factory=list)
    past: np.ndarray | None = None
    images: dict[str, bytes] = field(default_factory=dict)
    calibrations: dict[str, CameraCalibration] = field(default_factory=dict)


def decode_frame(data: bytes) -> WodFrame:
    """A serialized E2EDFrame's fields. Raises ValueError when `data` is not a protobuf message."""
    try:
        frame = E2EDFrame.FromString(data)
    except DecodeError as err:
        raise ValueError(f"not an E2EDFrame: {err}") from None
    rated = [
        {"pos_x": list(t.pos_x), "pos_y": list(t.pos_y), "preference_score": t.preference_score}
        for t in frame.preference_trajectories
    ]
    future = None
    if frame.HasField("future_states") and len(frame.future_states.pos_x):
        states = frame.future_states
        if len(states.pos_x) != len(states.pos_y):
            raise ValueError(f"future_states has {len(states.pos_x)} pos_x but {len(states.pos_y)} pos_y")
        future = np.stack([states.pos_x, states.pos_y], axis=-1).astype(np.float64)
    intent = _INTENT_NAMES.get(frame.intent, "UNKNOWN")
    past = None
    if frame.HasField("past_states") and len(frame.past_states.pos_x):
        columns = [list(getattr(frame.past_states, c)) for c in PAST_COLUMNS]
        if len({len(c) for c in columns}) != 1:
            counts = ", ".join(f"{len(c)} {n}" for n, c in zip(PAST_COLUMNS, columns, strict=True))
            raise ValueError(f"past_states columns differ in length: {counts}")
        past = np.asarray(columns, dtype=np.float64).T
    images, calibrations = {}, {}
    for image in frame.frame.images:
        name = CAMERA_NAMES.get(image.name)
        if name is not None:
            images[name] = image.image
    for calibration in frame.frame.context.camera_calibrations:
        name = CAMERA_NAMES.get(calibration.name)
        if name is not None:
            extrinsic = np.asarray(calibration.extrinsic.transform, dtype=np.float64)
            calibrations[name] = CameraCalibration(
                tuple(calibration.intrinsic),
                extrinsic.reshape(4, 4) if extrinsic.size == 16 else np.eye(4),
                calibration.width,
                calibration.height,
            )
    context = frame.frame.context
    return WodFrame(context.name, frame.frame.timestamp_micros, future, intent, rated, past, images, calibrations)


def read_frames(path: str | Path) -> Iterator[WodFrame | CorruptRecord]:
    """Every E2EDFrame in a TFRecord file as `decode_frame` gives it; an unreadable record comes as a CorruptRecord."""
    for index, (offset, data) in enumerate(framed_records(path)):
        if isinstance(data, CorruptRecord):
            yield data
            continue
        try:
            yield decode_frame(data)
        except ValueError as err:
            yield CorruptRecord(Path(path), index, str(err), offset)


def encode_frame(
    name: str,
    trajectories: Sequence[np.ndarray],
    scores: Sequence[float],
    future: np.ndarray | None = None,
    intent: str = "UNKNOWN",
    timestamp_micros: int = 0,
) -> bytes:
    """An E2EDFrame holding the frame name and timestamp, the logged `future` (T, 2) [m] at 4 Hz as `future_states`
    (z = 0: the official targets are x and y), the intent, and R rater trajectories, (T, 2) [m] each, with their
    R scores (float32)."""
    frame = E2EDFrame()
    frame.frame.context.name = name
    if timestamp_micros:
        frame.frame.timestamp_micros = timestamp_micros
    if future is not None:
        frame.future_states.pos_x.extend(future[:, 0].tolist())
        frame.future_states.pos_y.extend(future[:, 1].tolist())
        frame.future_states.pos_z.extend([0.0] * len(future))
    if intent != "UNKNOWN":
        frame.intent = INTENT_NUMBERS[intent]
    for path, score in zip(trajectories, scores, strict=True):
        rated = frame.preference_trajectories.add(preference_score=float(score))
        rated.pos_x.extend(path[:, 0].tolist())
        rated.pos_y.extend(path[:, 1].tolist())
    return frame.SerializeToString(deterministic=True)
