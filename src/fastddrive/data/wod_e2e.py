"""WOD-E2E in the Fast-dDrive / dVLM-AD release format: read it into a dataset, and write a dataset as it.

The format, as the release reads and writes it. One JSON array of records per split (NVlabs/Fast-dLLM
`fast_ddrive/eval/batch_inference.py`, `--eval_json`); the split is read off the file name (`training` or
`train`, `validation` or `val`, `test`; e.g. dVLM-AD's `dvlm-ad_waymo_e2e_val_cot.json`), and an export
writes `training.json`, `validation.json`, `test.json`, the WOD-E2E split names. Each record holds:
- `sample_id`: the WOD frame name; `image`: paths relative to the image root (a leading `dataset/` is
  dropped, batch_inference.py `_resolve_single_image_path`), front-left, front, front-right camera
  (Kaiwen-Hong/Fast-dLLM `fast_ddrive/data/convert_wod_e2e.py` FRONT_TRIPLET, a fork's converter: NVlabs has
  not published its own; the WOD tutorial's camera order 2, 1, 3); a single path is one camera. An export
  writes `images/<split>/<sample_id>_<CAMERA>.jpg` (that script: `images/<sample_id>_<CAMERA>.jpg`).
- `navigation_command`: the EgoIntent name GO_STRAIGHT, GO_LEFT or GO_RIGHT; UNKNOWN reads as go_straight
  (convert_wod_e2e.py `intent_to_nav`; waymo-open-dataset `protos/end_to_end_driving_data.proto`).
- `conversations`: the human prompt, the release's fixed instructions with one `<image>`, the command and
  the ego state at t = -3.0..0 s every 0.5 s, byte for byte as SaFo-Lab/dVLM-AD `eval/inference.py`; then
  the answer JSON (`schema.render`). batch_inference.py takes the answer from `"from": "assistant"`, the
  LLaVA-style data files from `"gpt"` (written here); both are read. An answer outside `schema` (say, the
  fork's weak labels "keep speed") makes the record malformed.
- `future waypoints`: 20 [x, y] at 0.25..5 s (a JSON string of them is read too, as batch_inference.py);
  `gt_5waypoints_1s` and `rated` (convert_wod_e2e.py); `timestamp_micros`, `history waypoints`, `velocity`,
  `acceleration` (dVLM-AD `eval/waymo/eval_planning.py`): WOD-E2E `past_states`, 16 rows at 4 Hz over
  (-4, 0] s, of which rows 3, 5, ..., 15 are the 0.5 s history (convert_wod_e2e.py HIST_IDX). Without them
  the history is read from the prompt (2 decimals). A record without `future waypoints` takes its TFRecord
  frame's `future_states` (WOD-E2E's logged future, t = (0, 5] s at 4 Hz).

Where the release is silent, or this project differs (choices made here):
- Raters: the release keeps them in the WOD-E2E TFRecords (`E2EDFrame.preference_trajectories`, read by
  `fast_ddrive/eval/evaluate_waymo_metrics.py`), not in the JSON. They are read here without tensorflow
  (data/wod_tfrecord.py) from the `*.tfrecord*` files beside the JSON files (the WOD-E2E tutorial's
  `validation.tfrecord*`, convert_wod_e2e.py's `val_*.tfrecord*`), whose split is read off the name as for
  the JSON; a split's TFRecords are read, in full (each frame holds its camera images), when a JSON file of
  that split is. A record gets the raters of the frame whose `frame.context.name` is its `sample_id`, else
  its own `preference_trajectories` under the proto's names (`[{"pos_x": [20], "pos_y": [20],
  "preference_score": s}, ...]`), else none; where its split has TFRecords, a record marked `rated: true`
  without them is malformed (its frame is missing or was lost to a corrupt record, reported on its own).
  Rater paths are cut or padded (last point repeated) to 20 points and the first 3 raters kept, as the
  official evaluator (waymo-open-dataset `metrics/python/rater_feedback_utils.py`). An export writes the JSON
  without raters and, per split, `<split>.tfrecord-00000-of-00001`: one E2EDFrame per sample holding its name,
  timestamp, logged future (`future_states`, z = 0), intent and raters (no cameras, calibrations or past
  states: the simulator's history has 7 points at 2 Hz where `past_states` holds 16 at 4 Hz).
- Unrated frames: the official evaluator scores a frame only when it has preference trajectories and the
  first one's score is not -1 (evaluate_waymo_metrics.py `load_waymo_e2e_data`); in val and test other
  frames are dropped and counted (as is a record with `rated: false` and no trajectories); in train they
  are kept, without raters.
- One image per sample: the cameras are scaled to one height and laid side by side, left to right, each
  within the release's Qwen2.5-VL pixel budget (batch_inference.py `max_pixels = 200704`) by Qwen2.5-VL's
  smart_resize rule, except that a camera is never enlarged beyond rounding its sides to 28 px (the release
  also sets `min_pixels = 200704`): frames in budget keep their pixels. An export cuts the frame into three
  cameras at 28 px boundaries, so a round trip gives it back: exactly as PNG, to JPEG's loss as JPEG
  (quality 95, no chroma subsampling; the release copies Waymo's own JPEG bytes).
- An export's ego state holds the 7 rows at 0.5 s that a sample keeps, not WOD's 16 at 4 Hz.
- A record whose answer is empty or a mask template (`<|mdm_mask|>`, dVLM-AD's eval files) gets a derived
  answer, counted: the future at 1..5 s, no critical object, no explanation, meta behaviour other/other.
- Sample fields with no release counterpart: scenario `wod-e2e`, episode_seed 0, time_s from
  `timestamp_micros` (0 without), a NaN view (a camera frame is no top view), no other agents (WOD-E2E has
  no boxes, so no collision metric), the default ego size.
"""

from __future__ import annotations

import io
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image

from fastddrive.core.inputs import image_from_bytes
from fastddrive.core.outputs import check_folder_destination, is_temporary, write_bytes
from fastddrive.core.release_prompt import HISTORY_LABELS as _HISTORY_LABELS
from fastddrive.core.release_prompt import INTENTS, prompt_text
from fastddrive.core.sample import (
    FUTURE_INTERVAL_S,
    FUTURE_STEPS,
    HISTORY_STEPS,
    IMAGE_UNIT_PX,
    MAX_RATERS,
    CameraView,
    DrivingSample,
    encode_png,
)
from fastddrive.core.sample import split_cameras as split_joined
from fastddrive.core.schema import (
    CRITICAL_OBJECT_CLASSES,
    WAYPOINT_INTERVAL_S,
    DrivingResponse,
    MetaBehavior,
    parse,
    render,
)
from fastddrive.data.build import OutputExists, holds_complete_dataset, prepare_output, staged_build, write_manifest
from fastddrive.data.dataset import SPLITS, DrivingDataset, write_shard
from fastddrive.data.episodes import RATER_SPLITS
from fastddrive.data.wod_tfrecord import CorruptRecord, WodFrame, encode_frame, read_frames, write_records

SOURCE = "wod-e2e"
RELEASE_SPLITS = {"train": "training", "val": "validation", "test": "test"}  # our split -> the file an export writes
_SPLIT_WORDS = {"train": "train", "training": "train", "val": "val", "validation": "val", "test": "test"}
CAMERAS = ("FRONT_LEFT", "FRONT", "FRONT_RIGHT")
RELEASE_MAX_PIXELS = 200_704  # per camera: batch_inference.py min_pixels = max_pixels
JPEG_QUALITY = 95
SHARD_SIZE = 128  # samples per parquet shard
TFRECORD_PATTERN = "*.tfrecord*"
TFRECORD_SHARD = ".tfrecord-00000-of-00001"  # an export's one shard per split, in WOD's sharded naming
_COMMANDS = {name: command for command, name in INTENTS.items()} | {"UNKNOWN": "go_straight"}
PAST_STATES_4HZ = 16  # WOD-E2E past_states: t = (-4, 0] s at 4 Hz
HISTORY_ROWS_4HZ = (3, 5, 7, 9, 11, 13, 15)  # t = -3.0, -2.5, ..., 0.0 s
_STATE_FIELDS = ("history waypoints", "velocity", "acceleration")
MASK_TOKEN = "<|mdm_mask|>"
_WAYPOINT_STEP = round(WAYPOINT_INTERVAL_S / FUTURE_INTERVAL_S)
_WAYPOINT_ROWS = slice(_WAYPOINT_STEP - 1, None, _WAYPOINT_STEP)  # the future at t = 1..5 s
_FUTURE_TIME_S = np.arange(1, FUTURE_STEPS + 1) * FUTURE_INTERVAL_S
_NO_VIEW = CameraView(math.nan, (math.nan, math.nan), math.nan)

_NUMBER = r"[+-]?\d+(?:\.\d+)?"
_STATE = re.compile(
    rf"\(t([+-]\d+\.\d)s\) \[({_NUMBER}), ({_NUMBER})\], Acceleration: X ({_NUMBER}), Y ({_NUMBER}) m/s², "
    rf"Velocity: X ({_NUMBER}), Y ({_NUMBER}) m/s,"
)


Frames = dict[str, WodFrame]  # frame name -> its E2EDFrame fields, as wod_tfrecord.decode_frame


class RecordError(ValueError):
    """A release record that cannot become a sample."""


@dataclass(frozen=True)
class RecordOutcome:
    """What became of one record: a sample (`unrated`: a val/test frame without raters, kept), or the error that
    stopped it.

    `record_id` is the record's sample_id (`#<index>` when it has none; empty for a whole-file error).
    """

    file: Path
    record_id: str
    split: str
    sample: DrivingSample | None = None
    answer_derived: bool = False
    unrated: bool = False
    error: str | None = None

    def __str__(self) -> str:
        where = f"{self.file}: record {self.record_id}" if self.record_id else str(self.file)
        return f"{where}: {self.error}" if self.error else where


@dataclass(frozen=True)
class ConversionReport:
    samples: dict[str, int]  # per split
    unrated: dict[str, int]  # val/test frames kept without raters (the official evaluator skips them), per split
    answers_derived: int
    failures: list[RecordOutcome]
    seconds: float
    kept: bool = False  # records failed and `out` held a complete data set: that was kept, the conversion dropped


@dataclass(frozen=True)
class ExportReport:
    samples: dict[str, int]  # per release file written (training, validation, test)
    seconds: float


def split_of(path: Path) -> str | None:
    """Our split for a release file, from the words of its name; None unless exactly one split is named."""
    words = {_SPLIT_WORDS[w] for w in re.split(r"[^a-z0-9]+", path.stem.lower()) if w in _SPLIT_WORDS}
    return words.pop() if len(words) == 1 else None


def camera_height_px(height: int, width: int, max_pixels: int) -> int:
    """The height Qwen2.5-VL's smart_resize gives a camera, without enlarging it into min_pixels."""
    unit = IMAGE_UNIT_PX
    fitted = max(unit, round(height / unit) * unit)
    if fitted * max(unit, round(width / unit) * unit) > max_pixels:
        fitted = max(unit, math.floor(height / math.sqrt(height * width / max_pixels) / unit) * unit)
    return fitted


def join_cameras(cameras: list[np.ndarray], max_pixels: int = RELEASE_MAX_PIXELS) -> np.ndarray:
    """Cameras side by side at the height the middle (front) one fits to; widths floored to 28 px."""
    middle = cameras[len(cameras) // 2]
    height = camera_height_px(*middle.shape[:2], max_pixels)
    parts = []
    for image in cameras:
        h, w = image.shape[:2]
        width = max(IMAGE_UNIT_PX, w * height // h // IMAGE_UNIT_PX * IMAGE_UNIT_PX)
        if (h, w) != (height, width):
            image = np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.BICUBIC))
        parts.append(image)
    return np.concatenate(parts, axis=1)


def split_cameras(image: np.ndarray) -> list[np.ndarray]:
    """A frame cut into front-left, front and front-right cameras at 28 px boundaries (the inverse of joining)."""
    return split_joined(image, len(CAMERAS))


def _xy(value: Any, name: str) -> np.ndarray:
    if isinstance(value, str):
        value = json.loads(value)
    points = np.asarray(value, dtype=np.float64)
    if points.ndim != 2 or points.shape[1] != 2:
        raise RecordError(f"{name!r} must be a list of [x, y] points, got shape {points.shape}")
    return points


def _history(record: dict[str, Any], prompt: str) -> np.ndarray:
    present = [name for name in _STATE_FIELDS if name in record]
    if not present:
        return history_from_prompt(prompt)
    if len(present) < len(_STATE_FIELDS):
        missing = ", ".join(repr(n) for n in _STATE_FIELDS if n not in present)
        raise RecordError(f"ego state has {', '.join(repr(n) for n in present)} but not {missing}")
    parts = [_xy(record[name], name) for name in _STATE_FIELDS]
    rows = {len(p) for p in parts}
    if rows == {PAST_STATES_4HZ}:
        parts = [p[list(HISTORY_ROWS_4HZ)] for p in parts]
    elif rows != {HISTORY_STEPS}:
        raise RecordError(
            f"ego state must be {PAST_STATES_4HZ} rows at 4 Hz or {HISTORY_STEPS} at 0.5 s, got {sorted(rows)} rows"
        )
    return np.concatenate(parts, axis=1)


def history_from_prompt(prompt: str) -> np.ndarray:
    """The (7, 6) ego history written in a release prompt (2 decimals), columns x, y, vx, vy, ax, ay."""
    states = _STATE.findall(prompt)
    if tuple(s[0] for s in states) != _HISTORY_LABELS:
        raise RecordError(f"the prompt's historical ego state is not {HISTORY_STEPS} states at t-3.0s..t+0.0s")
    return np.array([[x, y, vx, vy, ax, ay] for _, x, y, ax, ay, vx, vy in states], dtype=np.float64)


def _conversation(record: dict[str, Any]) -> tuple[str, str]:
    """The (last) human prompt and the (last) answer; the answer is empty when there is none."""
    messages = record["conversations"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RecordError("'conversations' must be a list of {from, value} messages")
    prompts = [str(m.get("value", "")) for m in messages if m.get("from") == "human"]
    answers = [str(m.get("value", "")) for m in messages if m.get("from") in ("gpt", "assistant")]
    if not prompts:
        raise RecordError("'conversations' has no human message")
    return prompts[-1], answers[-1] if answers else ""


def _answer(text: str, future: np.ndarray) -> tuple[DrivingResponse, bool]:
    """The record's answer, or (when it is empty or a mask template) one derived from the future."""
    if text.strip() and MASK_TOKEN not in text:
        return parse(text), False
    derived = DrivingResponse(
        critical_objects={name: False for name in CRITICAL_OBJECT_CLASSES},
        explanation="",
        future_meta_behavior=MetaBehavior(longitudinal="other", lateral="other"),
        trajectory=future[_WAYPOINT_ROWS],
    )
    return derived, True


def _image(value: Any, root: Path, max_pixels: int) -> np.ndarray:
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise RecordError("'image' must be a path or a list of paths")
    cameras = []
    for relative in paths:
        path = root / relative.removeprefix("dataset/").removeprefix("dataset\\")
        if not path.is_file():
            raise RecordError(f"image file {path} is missing")
        with Image.open(path) as image:
            cameras.append(np.asarray(image.convert("RGB")))
    return join_cameras(cameras, max_pixels)


def _rater_future(rated: dict[str, Any]) -> np.ndarray:
    """One rater path cut or padded (its last point repeated) to 20 points, as the official evaluator does."""
    points = np.stack([rated["pos_x"], rated["pos_y"]], axis=-1).astype(np.float64)
    if len(points) == 0:
        raise RecordError("a preference trajectory has no points")
    padding = np.repeat(points[-1:], max(FUTURE_STEPS - len(points), 0), axis=0)
    return np.concatenate([points[:FUTURE_STEPS], padding])


def _raters(
    record: dict[str, Any], frame: WodFrame | None, has_tfrecords: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """The rater futures and scores (from the record's TFRecord frame, else the record), None for an unrated frame.

    Unrated is the official evaluator's rule: no preference trajectories, or the first one scored -1.
    """
    rated = frame.raters if frame is not None else record.get("preference_trajectories")
    if rated is None:
        if has_tfrecords and record.get("rated") is True:
            raise RecordError("marked rated, but no TFRecord frame of this name has preference trajectories")
        return None if record.get("rated") is False else (np.zeros((0, FUTURE_STEPS, 2)), np.zeros(0))
    if not isinstance(rated, list) or not all(isinstance(t, dict) for t in rated):
        raise RecordError("'preference_trajectories' must be a list of {pos_x, pos_y, preference_score}")
    if not rated or float(rated[0]["preference_score"]) == -1:
        return None
    rated = rated[:MAX_RATERS]
    futures = np.array([_rater_future(t) for t in rated])
    return futures, np.array([t["preference_score"] for t in rated], dtype=np.float64)


def _future(record: dict[str, Any], frame: WodFrame | None) -> np.ndarray:
    """The record's `future waypoints`, else its TFRecord frame's `future_states`."""
    if "future waypoints" in record or frame is None or frame.future is None:
        return _xy(record["future waypoints"], "future waypoints")
    return frame.future


def _sample(
    record: dict[str, Any], split: str, root: Path, max_pixels: int, frames: Frames | None
) -> tuple[DrivingSample, bool]:
    """The record as a sample (an unrated frame without raters) and whether its answer is derived."""
    frame = (frames or {}).get(str(record["sample_id"]))
    raters = _raters(record, frame, frames is not None)
    prompt, answer = _conversation(record)
    command = record["navigation_command"]
    if command not in _COMMANDS:
        raise RecordError(f"unknown navigation_command {command!r}; known: {', '.join(_COMMANDS)}")
    future = _future(record, frame)
    if len(future) != FUTURE_STEPS:
        raise RecordError(f"'future waypoints' must be {FUTURE_STEPS} points at 4 Hz, got {len(future)}")
    response, derived = _answer(answer, future)
    image = _image(record["image"], root, max_pixels)
    time_s = float(record.get("timestamp_micros", 0)) / 1e6
    history = _history(record, prompt)
    return _wod_sample(str(record["sample_id"]), time_s, image, history, command, future, response, raters), derived


def _wod_sample(
    sample_id: str,
    time_s: float,
    image: np.ndarray,
    history: np.ndarray,
    intent: str,
    future: np.ndarray,
    response: DrivingResponse,
    raters: tuple[np.ndarray, np.ndarray] | None,
) -> DrivingSample:
    """A WOD-E2E frame as a sample (module doc: the fields with no WOD-E2E counterpart), with its rater futures and
    scores (`_raters`; None: an unrated frame, kept without them)."""
    trajectories, scores = raters if raters is not None else (np.zeros((0, FUTURE_STEPS, 2)), np.zeros(0))
    return DrivingSample(
        sample_id=sample_id,
        scenario=SOURCE,
        episode_seed=0,
        time_s=time_s,
        image=image,
        history=history,
        command=_COMMANDS[intent],
        future=future,
        future_time_s=_FUTURE_TIME_S,
        response=response,
        view=_NO_VIEW,
        rater_trajectories=trajectories,
        rater_scores=scores,
    )


def _outcome(
    path: Path, index: int, record: Any, split: str, root: Path, max_pixels: int, frames: Frames | None
) -> RecordOutcome:
    record_id = str(record.get("sample_id") or f"#{index}") if isinstance(record, dict) else f"#{index}"
    try:
        if not isinstance(record, dict):
            raise RecordError(f"a record must be a JSON object, got {type(record).__name__}")
        sample, derived = _sample(record, split, root, max_pixels, frames)
    except KeyError as err:
        return RecordOutcome(path, record_id, split, error=f"missing field {err}")
    except (ValueError, TypeError, OSError) as err:  # a malformed record is reported, the others go on
        return RecordOutcome(path, record_id, split, error=f"{type(err).__name__}: {err}")
    unrated = split in RATER_SPLITS and not len(sample.rater_scores)
    return RecordOutcome(path, record_id, split, sample, answer_derived=derived, unrated=unrated)


def _raw_sample(frame: WodFrame, split: str, max_pixels: int) -> tuple[DrivingSample, bool]:
    """A raw E2EDFrame as a sample: the three front cameras found by name and joined, the history from rows 3, 5,
    ..., 15 of `past_states`, the command from `intent`, the logged future (a test frame has none: all NaN), the
    raters; its answer derived from the future (as for a record without one)."""
    missing = [c for c in CAMERAS if c not in frame.images]
    if missing:
        held = ", ".join(sorted(frame.images)) or "none"
        raise RecordError(f"camera {missing[0]} has no image in the frame (it holds: {held})")
    cameras = [image_from_bytes(frame.images[c]) for c in CAMERAS]
    if frame.past is None or len(frame.past) != PAST_STATES_4HZ:
        got = 0 if frame.past is None else len(frame.past)
        raise RecordError(f"past_states must hold {PAST_STATES_4HZ} states at 4 Hz (t = -3.75..0 s), got {got}")
    future = frame.future
    if future is None and split == "train":
        raise RecordError("a training frame needs future_states (the expert's future it is trained on)")
    if future is not None and len(future) != FUTURE_STEPS:
        raise RecordError(f"future_states must be {FUTURE_STEPS} points at 4 Hz, got {len(future)}")
    response, derived = _answer("", np.zeros((FUTURE_STEPS, 2)) if future is None else future)
    image, history = join_cameras(cameras, max_pixels), frame.past[list(HISTORY_ROWS_4HZ)]
    logged = np.full((FUTURE_STEPS, 2), np.nan) if future is None else future
    raters = _raters({}, frame, has_tfrecords=True)
    sample = _wod_sample(
        frame.name, frame.timestamp_micros / 1e6, image, history, frame.intent, logged, response, raters
    )
    return sample, derived


def _raw_outcomes(tfrecords: list[Path], max_pixels: int) -> Iterator[RecordOutcome]:
    """Every frame of raw WOD-E2E TFRecord files as an outcome, file after file, streamed (one frame in memory)."""
    for path in tfrecords:
        yield from raw_file_outcomes(path, max_pixels)


def raw_file_outcomes(path: Path, max_pixels: int) -> Iterator[RecordOutcome]:
    """Every frame of one raw WOD-E2E TFRecord file as an outcome (a corrupt record by index and byte offset)."""
    split = split_of(path)
    if split is None:
        yield RecordOutcome(path, "", "", error="its name tells no split: name it training, validation or test")
        return
    try:
        for index, frame in enumerate(read_frames(path)):
            if isinstance(frame, CorruptRecord):
                where = f"#{frame.index}" + (f" at byte {frame.offset}" if frame.offset is not None else "")
                yield RecordOutcome(path, where, split, error=frame.reason)
                continue
            try:
                sample, derived = _raw_sample(frame, split, max_pixels)
            except (ValueError, OSError) as err:  # a malformed frame is reported, the others go on
                yield RecordOutcome(path, frame.name or f"#{index}", split, error=f"{type(err).__name__}: {err}")
                continue
            unrated = split in RATER_SPLITS and not len(sample.rater_scores)
            yield RecordOutcome(path, frame.name, split, sample, answer_derived=derived, unrated=unrated)
    except OSError as err:
        yield RecordOutcome(path, "", split, error=f"not readable: {err}")


def _read_frames(paths: list[Path], split: str) -> tuple[Frames | None, list[RecordOutcome]]:
    """The preference trajectories in a split's TFRecord files by frame name (None without files), and failures."""
    if not paths:
        return None, []
    frames: Frames = {}
    failures = []
    for path in paths:
        try:
            for frame in read_frames(path):
                if isinstance(frame, CorruptRecord):
                    failures.append(RecordOutcome(path, f"#{frame.index}", split, error=frame.reason))
                else:
                    frames[frame.name] = frame
        except OSError as err:
            failures.append(RecordOutcome(path, "", split, error=f"not readable: {err}"))
    return frames, failures


def _outcomes(files: list[Path], tfrecords: list[Path], root: Path, max_pixels: int) -> Iterator[RecordOutcome]:
    unnamed = "its name tells no split: name it training, validation or test"
    for path in tfrecords:
        if split_of(path) is None:
            yield RecordOutcome(path, "", "", error=unnamed)
    frames: dict[str, Frames | None] = {}  # per split, read when the first JSON file of the split is
    for path in files:
        split = split_of(path)
        if split is None:
            yield RecordOutcome(path, "", "", error=unnamed)
            continue
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            yield RecordOutcome(path, "", split, error=f"not readable as JSON: {err}")
            continue
        if not isinstance(records, list):
            kind = type(records).__name__
            yield RecordOutcome(path, "", split, error=f"must hold a JSON list of records, not a JSON {kind}")
            continue
        if split not in frames:
            frames[split], failures = _read_frames([p for p in tfrecords if split_of(p) == split], split)
            yield from failures
        for index, record in enumerate(records):
            yield _outcome(path, index, record, split, root, max_pixels, frames[split])


def raw_tfrecords(src: Path) -> list[Path]:
    """The TFRecord files of a folder, sorted (hidden files are an interrupted export's temporary files)."""
    return sorted(p for p in src.glob(TFRECORD_PATTERN) if not p.name.startswith(".")) if src.is_dir() else []


def read_wod_e2e(
    src: str | Path,
    image_root: str | Path | None = None,
    max_pixels: int = RELEASE_MAX_PIXELS,
    shard: tuple[int, int] = (0, 1),
) -> Iterator[RecordOutcome]:
    """Every record of `src`, lazily: the release JSON files (images relative to `image_root`, default `src`) with
    the raters of the TFRecord files beside them; or, where `src` holds TFRecords and no JSON, the raw WOD-E2E
    frames themselves (`_raw_sample`). `shard` (i, n) takes every n-th raw file from the i-th, so that n
    machines split one folder.

    Raises FileNotFoundError at once when `src` holds neither; everything after is reported per record (a
    TFRecord record that cannot be read, by its index `#k` and byte offset).
    """
    src = Path(src)
    files = sorted(src.glob("*.json")) if src.is_dir() else []
    tfrecords = raw_tfrecords(src)
    if not files and not tfrecords:
        raise FileNotFoundError(
            f"{src} holds no release JSON files (training.json, validation.json, test.json) and no WOD-E2E "
            "TFRecord files (training.tfrecord-*, validation.tfrecord-*, test.tfrecord-*)"
        )
    if not files:
        index, count = shard
        return _raw_outcomes(tfrecords[index::count], max_pixels)
    return _outcomes(files, tfrecords, Path(image_root) if image_root is not None else src, max_pixels)


def export_layout_problem(out: Path, names: set[str], what: str) -> str | None:
    """Why the existing folder `out` is not an earlier export that `--overwrite` may replace: it holds something
    other than `names` (what an export of `what` writes) and temporary leftovers."""
    foreign = sorted(p.name for p in out.iterdir() if p.name not in names and not is_temporary(p))
    if not foreign:
        return None
    listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    return f"{out} holds {listed}, which {what} does not write; refusing to delete it, choose another --out"


def check_export_output(out: Path, overwrite: bool, names: set[str], what: str) -> None:
    """An export's `--out`: missing or empty, or with `overwrite` an earlier export (`export_layout_problem`)."""
    if out.exists() and not out.is_dir():
        raise OutputExists(f"{out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise OutputExists(f"{out} is not empty; pass --overwrite to replace it or choose another --out")
    problem = export_layout_problem(out, names, what)
    if problem is not None:
        raise OutputExists(problem)


def convert_wod_e2e(
    src: str | Path,
    out: str | Path,
    image_root: str | Path | None = None,
    max_pixels: int = RELEASE_MAX_PIXELS,
    shard_size: int = SHARD_SIZE,
    overwrite: bool = False,
    on_item: Callable[[int], None] | None = None,
    shard: tuple[int, int] = (0, 1),
    workers: int = 1,
    on_total: Callable[[int], None] | None = None,
) -> ConversionReport:
    """Convert the release files, or the raw TFRecords, in `src` into a dataset in `out` (`read_wod_e2e`; raw
    records go file by file in `workers` processes, resumably: `data.wod_raw`; `shard` (i, n): this machine's
    share of the raw files); `on_item(n)` is called as n more records are done, `on_total(n)` (raw records) once
    they are counted.

    Shards are `<split>/<file>-<k>.parquet`; the manifest is marked complete only when no record failed. `out` is
    checked first (not inside `src` or the image root, ...); the dataset is built beside it and takes its place
    at the end, except that a conversion with failed records does not replace a complete data set (data/build.py).
    """
    start = time.perf_counter()
    src, out = Path(src), Path(out)
    root = Path(image_root) if image_root is not None else src
    check_folder_destination(out, "--out", inputs=(src, root), owned=(out,))
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: need 0 <= I < N")
    if src.is_dir() and not any(src.glob("*.json")) and raw_tfrecords(src):
        from fastddrive.data.wod_raw import convert_raw_wod_e2e  # raw records: file by file, resumably

        check_folder_destination(out, "--out", inputs=(src,), owned=(out,))
        return convert_raw_wod_e2e(src, out, max_pixels, shard, workers, shard_size, overwrite, on_item, on_total)
    outcomes = read_wod_e2e(src, root, max_pixels, shard)
    settings = {
        "source": SOURCE,
        "src": str(src.resolve()),
        "image_root": str(root.resolve()),
        "max_pixels": max_pixels,
        **({"shard": f"{index}/{count}"} if count > 1 else {}),
    }
    prepare_output(out, settings, overwrite)
    complete_before = holds_complete_dataset(out)

    def convert(folder: Path) -> ConversionReport:
        write_manifest(folder, settings, complete=False, counts={})
        pending: dict[tuple[str, str], list[DrivingSample]] = {}
        written: dict[tuple[str, str], int] = {}

        def flush(key: tuple[str, str]) -> None:
            split, stem = key
            write_shard(folder / split / f"{stem}-{written.get(key, 0):05d}.parquet", pending.pop(key))
            written[key] = written.get(key, 0) + 1

        samples, unrated = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
        derived, failures = 0, []
        for outcome in outcomes:
            if outcome.sample is not None:
                key = (outcome.split, re.sub(r"[^\w.-]", "_", outcome.file.stem))
                pending.setdefault(key, []).append(outcome.sample)
                samples[outcome.split] += 1
                unrated[outcome.split] += outcome.unrated
                derived += outcome.answer_derived
                if len(pending[key]) >= shard_size:
                    flush(key)
            else:
                failures.append(outcome)
            if on_item:
                on_item(1)
        for key in list(pending):
            flush(key)
        counts = {"samples": samples, "unrated_kept": unrated, "answers_derived": derived, "failed": len(failures)}
        write_manifest(folder, settings, complete=not failures, counts=counts)
        return ConversionReport(samples, unrated, derived, failures, time.perf_counter() - start)

    report, replaced = staged_build(out, convert, lambda r: not (r.failures and complete_before))
    return report if replaced else replace(report, kept=True, seconds=time.perf_counter() - start)


def _encode(image: np.ndarray, image_format: Literal["jpeg", "png"]) -> bytes:
    if image_format == "png":
        return encode_png(image)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=JPEG_QUALITY, subsampling=0)
    return buffer.getvalue()


def release_record(
    sample: DrivingSample, out: Path, split: str, image_format: Literal["jpeg", "png"] = "jpeg"
) -> dict[str, Any]:
    """One sample as a release record; its camera images are written under `out` (a folder being built)."""
    suffix = ".jpg" if image_format == "jpeg" else ".png"
    paths = []
    for camera, image in zip(CAMERAS, split_cameras(sample.image), strict=True):
        relative = f"images/{RELEASE_SPLITS[split]}/{sample.sample_id}_{camera}{suffix}"
        (out / relative).parent.mkdir(parents=True, exist_ok=True)
        (out / relative).write_bytes(_encode(image, image_format))
        paths.append(relative)
    history = sample.history
    return {
        "sample_id": sample.sample_id,
        "image": paths,
        "navigation_command": INTENTS[sample.command],
        "conversations": [
            {"from": "human", "value": prompt_text(sample.command, history)},
            {"from": "gpt", "value": render(sample.response)},
        ],
        "future waypoints": sample.future.tolist(),
        "gt_5waypoints_1s": sample.future[_WAYPOINT_ROWS].tolist(),
        "rated": len(sample.rater_scores) > 0,
        "timestamp_micros": round(sample.time_s * 1e6),
        "history waypoints": history[:, 0:2].tolist(),
        "velocity": history[:, 2:4].tolist(),
        "acceleration": history[:, 4:6].tolist(),
    }


EXPORT_NAMES = {"images"} | {f"{name}{ext}" for name in RELEASE_SPLITS.values() for ext in (".json", TFRECORD_SHARD)}


def export_wod_e2e(
    data: str | Path,
    out: str | Path,
    split: str | None = None,
    image_format: Literal["jpeg", "png"] = "jpeg",
    overwrite: bool = False,
    on_item: Callable[[], None] | None = None,
) -> ExportReport:
    """Write a dataset's samples (one split, or all) in the release format; `on_item()` is called per sample.

    `out` gets `training.json`, `validation.json` and `test.json` (those with samples) with the raters in
    `<split>.tfrecord-00000-of-00001` beside them, and the camera images under `images/`. `out` is checked first
    (not the data set or inside it; with `overwrite`, only an earlier export is replaced); the export is built
    beside it and takes its place only once it is whole.
    """
    start = time.perf_counter()
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    if image_format not in ("jpeg", "png"):
        raise ValueError(f"image_format must be jpeg or png, got {image_format!r}")
    out = Path(out)
    check_folder_destination(out, "--out", inputs=(data,))
    dataset = DrivingDataset.open(data)
    check_export_output(out, overwrite, EXPORT_NAMES, "a WOD-E2E export")

    def export(folder: Path) -> dict[str, int]:
        counts = {}
        for name in SPLITS if split is None else (split,):
            records, frames = [], []
            for sample in dataset.samples(name):
                records.append(release_record(sample, folder, name, image_format))
                frames.append(
                    encode_frame(
                        sample.sample_id,
                        sample.rater_trajectories,
                        sample.rater_scores,
                        future=sample.future,
                        intent=INTENTS[sample.command],
                        timestamp_micros=round(sample.time_s * 1e6),
                    )
                )
                if on_item:
                    on_item()
            if records:
                path = folder / f"{RELEASE_SPLITS[name]}.json"
                write_bytes(path, json.dumps(records, ensure_ascii=False).encode("utf-8"))
                write_records(folder / f"{RELEASE_SPLITS[name]}{TFRECORD_SHARD}", frames)
                counts[RELEASE_SPLITS[name]] = len(records)
        return counts

    counts, _ = staged_build(out, export, lambda _: True)
    return ExportReport(counts, time.perf_counter() - start)
