"""WOD-E2E TFRecord files without tensorflow: the record framing and the E2EDFrame fields that carry the raters.

Framing (tensorflow `core/lib/io/record_writer.cc`, `core/lib/hash/crc32c.h`), per record: the data length as
uint64 little endian, the masked crc32c of those 8 bytes (uint32 LE), the data, the masked crc32c of the data;
mask(crc) = rotate right by 15 bits + 0xa282ead8. Both CRCs are checked on read. A bad data CRC loses one record
and reading goes on (the length was verified); a bad length CRC or a cut file loses the rest of the file.

Messages (proto2, package waymo.open_dataset), from waymo-research/waymo-open-dataset
`src/waymo_open_dataset/protos/end_to_end_driving_data.proto` (commit e378e5ba5bb8, 2025-04-28) and
`src/waymo_open_dataset/dataset.proto` (Frame, Context). Only these fields are mirrored, with the official
numbers and types; the rest (cameras, calibrations, past states) are unknown fields here, which protobuf skips:
- E2EDFrame: `frame` = 1 (Frame), `future_states` = 5 (EgoTrajectoryStates: t = (0, 5] s at 4 Hz, positions
  only), `intent` = 7 (EgoIntent.Intent: UNKNOWN 0, GO_STRAIGHT 1, GO_LEFT 2, GO_RIGHT 3; a varint, read as
  int32), `preference_trajectories` = 8 (repeated EgoTrajectoryStates);
- Frame: `context` = 1 (Context), `timestamp_micros` = 2 (int64); Context: `name` = 1 (string), the frame name,
  which the release's JSON records use as `sample_id` (Kaiwen-Hong/Fast-dLLM
  `fast_ddrive/data/convert_wod_e2e.py`; the release's `fast_ddrive/eval/evaluate_waymo_metrics.py` keys its
  ground truth on it);
- EgoTrajectoryStates: `pos_x` = 1, `pos_y` = 2, `pos_z` = 3 (repeated float, packed), `preference_score` = 8
  (float).
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
    """A TFRecord record that cannot be read: names the file and the record's index (from 0)."""

    def __init__(self, path: Path, index: int, reason: str) -> None:
        super().__init__(f"{path}: record #{index}: {reason}")
        self.path, self.index, self.reason = path, index, reason


def masked_crc(data: bytes) -> int:
    """The crc32c of `data` as TFRecord stores it (masked, so that a CRC over stored CRCs does not degenerate)."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def read_records(path: str | Path) -> Iterator[bytes | CorruptRecord]:
    """Every record's data in a TFRecord file, in order; a record that fails its checks comes as a CorruptRecord."""
    path = Path(path)
    with path.open("rb") as file:
        index = 0
        while header := file.read(_HEADER.size):
            if len(header) < _HEADER.size:
                yield CorruptRecord(path, index, f"the file ends inside the record header ({len(header)} bytes)")
                return
            length, length_crc = _HEADER.unpack(header)
            if masked_crc(header[:8]) != length_crc:
                yield CorruptRecord(path, index, "the length fails its CRC; the rest of the file cannot be framed")
                return
            body = file.read(length + _CRC.size)
            if len(body) < length + _CRC.size:
                yield CorruptRecord(path, index, f"the file ends inside the record ({len(body)} of {length + 4} bytes)")
                return
            data = body[:length]
            if masked_crc(data) != _CRC.unpack(body[length:])[0]:
                yield CorruptRecord(path, index, "the data fails its CRC")
            else:
                yield data
            index += 1


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
    "Context": [("name", 1, _F.LABEL_OPTIONAL, _F.TYPE_STRING, None)],
    "Frame": [
        ("context", 1, _F.LABEL_OPTIONAL, _F.TYPE_MESSAGE, "Context"),
        ("timestamp_micros", 2, _F.LABEL_OPTIONAL, _F.TYPE_INT64, None),
    ],
    "EgoTrajectoryStates": [
        ("pos_x", 1, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("pos_y", 2, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("pos_z", 3, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("preference_score", 8, _F.LABEL_OPTIONAL, _F.TYPE_FLOAT, None),
    ],
    "E2EDFrame": [
        ("frame", 1, _F.LABEL_OPTIONAL, _F.TYPE_MESSAGE, "Frame"),
        ("future_states", 5, _F.LABEL_OPTIONAL, _F.TYPE_MESSAGE, "EgoTrajectoryStates"),
        # An enum in the official proto; the same varint on the wire, so read as int32 (no enum descriptor here).
        ("intent", 7, _F.LABEL_OPTIONAL, _F.TYPE_INT32, None),
        ("preference_trajectories", 8, _F.LABEL_REPEATED, _F.TYPE_MESSAGE, "EgoTrajectoryStates"),
    ],
}


def _e2ed_frame_class() -> Any:
    file = descriptor_pb2.FileDescriptorProto(name="fastddrive/wod_e2e_raters.proto", package=_PACKAGE, syntax="proto2")
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        for field_name, number, label, kind, type_name in fields:
            spec = message.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name:
                spec.type_name = f".{_PACKAGE}.{type_name}"
            if label == _F.LABEL_REPEATED and kind == _F.TYPE_FLOAT:
                spec.options.packed = True  # [packed = true] in the official proto
    pool = descriptor_pool.DescriptorPool()  # a private pool: no clash with waymo's own classes if imported
    pool.AddSerializedFile(file.SerializeToString())
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.E2EDFrame"))


E2EDFrame = _e2ed_frame_class()


INTENT_NUMBERS = {"UNKNOWN": 0, "GO_STRAIGHT": 1, "GO_LEFT": 2, "GO_RIGHT": 3}  # EgoIntent.Intent
_INTENT_NAMES = {number: name for name, number in INTENT_NUMBERS.items()}


@dataclass
class WodFrame:
    """The fields of one E2EDFrame that this project reads: its name and timestamp, the logged future (T, 2) [m]
    at 4 Hz (None when the frame has none, as in the test split), the intent's name, and the raters as
    `{pos_x, pos_y, preference_score}` dicts."""

    name: str
    timestamp_micros: int = 0
    future: np.ndarray | None = None
    intent: str = "UNKNOWN"
    raters: list[dict[str, Any]] = field(default_factory=list)


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
    return WodFrame(frame.frame.context.name, frame.frame.timestamp_micros, future, intent, rated)


def read_frames(path: str | Path) -> Iterator[WodFrame | CorruptRecord]:
    """Every E2EDFrame in a TFRecord file as `decode_frame` gives it; an unreadable record comes as a CorruptRecord."""
    for index, data in enumerate(read_records(path)):
        if isinstance(data, CorruptRecord):
            yield data
            continue
        try:
            yield decode_frame(data)
        except ValueError as err:
            yield CorruptRecord(Path(path), index, str(err))


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
