"""The WOD-E2E adapter on simulator samples exported in the Fast-dDrive / dVLM-AD release format."""

import json
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fastddrive.core.metrics import rater_feedback_score
from fastddrive.core.release_prompt import PROMPT, prompt_text
from fastddrive.core.sample import DrivingSample
from fastddrive.core.schema import parse
from fastddrive.data.build import OutputExists, write_manifest
from fastddrive.data.dataset import DrivingDataset, write_shard
from fastddrive.data.highway import episode_samples
from fastddrive.data.wod_e2e import (
    RELEASE_MAX_PIXELS,
    convert_wod_e2e,
    export_wod_e2e,
    history_from_prompt,
    join_cameras,
    split_cameras,
    split_of,
)
from fastddrive.data.wod_tfrecord import (
    CorruptRecord,
    WodFrame,
    decode_frame,
    encode_frame,
    read_frames,
    read_records,
    write_records,
)

FRAMES = {split: f"{split}.tfrecord-00000-of-00001" for split in ("training", "validation", "test")}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small dataset: train without raters, val and test with the simulated raters."""
    rated = episode_samples("highway", 11, max_duration_s=9, raters=True)
    root = tmp_path_factory.mktemp("sim")
    write_shard(root / "train" / "a.parquet", episode_samples("intersection", 12, max_duration_s=9))
    write_shard(root / "val" / "a.parquet", rated)
    write_shard(root / "test" / "a.parquet", [replace(rated[1], sample_id="highway-11-test")])
    write_manifest(root, {"source": "test"}, complete=True, counts={})
    return root


def stored(root: Path) -> dict[str, list[DrivingSample]]:
    dataset = DrivingDataset.open(root)
    return {split: list(dataset.samples(split)) for split in ("train", "val", "test")}


def load(path: Path) -> list:
    return json.loads(path.read_text(encoding="utf-8"))


def save(path: Path, records: list) -> None:
    path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")


def assert_same(back: DrivingSample, original: DrivingSample, exact_image: bool = True) -> None:
    assert back.sample_id == original.sample_id
    assert back.command == original.command
    assert back.time_s == original.time_s
    assert back.response == original.response
    np.testing.assert_array_equal(back.history, original.history)
    np.testing.assert_array_equal(back.future, original.future)
    np.testing.assert_array_equal(back.future_time_s, original.future_time_s)
    np.testing.assert_array_equal(back.rater_trajectories, original.rater_trajectories)
    np.testing.assert_array_equal(back.rater_scores, original.rater_scores)
    assert back.image.shape == original.image.shape
    if exact_image:
        np.testing.assert_array_equal(back.image, original.image)


def rated_frame(sample: DrivingSample) -> bytes:
    return encode_frame(sample.sample_id, sample.rater_trajectories, sample.rater_scores)


def test_export_writes_the_release_layout(dataset, tmp_path):
    calls = []
    report = export_wod_e2e(dataset, tmp_path, on_item=lambda: calls.append(1))
    assert report.samples == {"training": 2, "validation": 2, "test": 1}
    assert calls == [1] * 5
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["test.json", "training.json", "validation.json"]
    record = load(tmp_path / "validation.json")[0]
    original = stored(dataset)["val"][0]
    assert record["sample_id"] == original.sample_id
    assert record["image"] == [
        f"images/validation/{original.sample_id}_{cam}.jpg" for cam in ("FRONT_LEFT", "FRONT", "FRONT_RIGHT")
    ]
    for path in record["image"]:
        assert (tmp_path / path).read_bytes()[:3] == b"\xff\xd8\xff"  # JPEG
    assert record["navigation_command"] == "GO_STRAIGHT"
    human, gpt = record["conversations"]
    assert (human["from"], gpt["from"]) == ("human", "gpt")
    prefix = PROMPT.split("{NAV}")[0]
    assert human["value"].startswith(prefix) and human["value"].count("<image>") == 1
    assert "- High-level navigation command: GO_STRAIGHT\n" in human["value"]
    x, y = original.history[0, :2]
    assert f"last 3.0 seconds (at 0.5-second intervals).(t-3.0s) [{x:.2f}, {y:.2f}], Acceleration: X " in human["value"]
    assert human["value"].endswith(" m/s,\n\nOutput:")
    assert parse(gpt["value"]) == original.response
    assert np.array_equal(record["future waypoints"], original.future)
    assert np.array_equal(record["gt_5waypoints_1s"], original.future[3::4])
    assert record["rated"] is True
    assert "preference_trajectories" not in record  # as in the release, the raters are in the TFRecords
    assert sorted(p.name for p in tmp_path.glob("*.tfrecord*")) == sorted(FRAMES.values())
    frames = list(read_frames(tmp_path / FRAMES["validation"]))
    assert [frame.name for frame in frames] == [s.sample_id for s in stored(dataset)["val"]]
    assert [t["preference_score"] for t in frames[0].raters] == original.rater_scores.tolist()
    assert [frame.name for frame in read_frames(tmp_path / FRAMES["training"]) if frame.raters] == []
    # Each frame carries the logged future (float32 on the wire), the intent and the timestamp too.
    for frame, sample in zip(frames, stored(dataset)["val"], strict=True):
        np.testing.assert_allclose(frame.future, sample.future, rtol=1e-6, atol=1e-5)
        assert frame.intent == "GO_STRAIGHT" if sample.command == "go_straight" else frame.intent != "UNKNOWN"
        assert frame.timestamp_micros == round(sample.time_s * 1e6)


def test_a_record_without_future_waypoints_takes_the_tfrecord_future_states(dataset, tmp_path):
    release = tmp_path / "release"
    export_wod_e2e(dataset, release, image_format="png")
    for path in release.glob("*.json"):
        records = load(path)
        for record in records:
            del record["future waypoints"]
        path.write_text(json.dumps(records))
    report = convert_wod_e2e(release, tmp_path / "back")
    assert report.failures == []
    back, original = stored(tmp_path / "back"), stored(dataset)
    for split in ("train", "val", "test"):
        for b, o in zip(back[split], original[split], strict=True):
            np.testing.assert_allclose(b.future, o.future, rtol=1e-6, atol=1e-5)

    for path in release.glob("*.tfrecord*"):
        path.unlink()  # neither the record nor a frame has the future: the record is malformed, by name
    report = convert_wod_e2e(release, tmp_path / "bare")
    assert report.failures and all("future waypoints" in failure for failure in map(str, report.failures))


# The human turn of the release's example (SaFo-Lab/dVLM-AD eval/inference.py), verbatim.
RELEASE_EXAMPLE = (
    "You are an expert autonomous driving agent.\nTask 1: Critical Object Detection\nFor each class below, answer "
    '"yes" or "no" to indicate whether it affects the ego vehicle’s behavior or future trajectory:\n[nearby_vehicle, '
    "pedestrian, cyclist, construction, traffic_element, weather_condition, road_hazard, emergency_vehicle, animal, "
    "special_vehicle, conflicting_vehicle, door_opening_vehicle]\nTask 2: Scene Reasoning\nPredict the future "
    "behavior of the identified critical objects and explain how the identified critical objects or conditions "
    "affect the ego vehicle’s next 3-second trajectory.\nTask 3: Meta-Behavior Prediction\nPredict the ego "
    "vehicle’s future meta-driving behavior:\n- speed ∈ {keep, accelerate, decelerate, stop, other}\n- command ∈ "
    "{straight, yield, left_turn, right_turn, lane_follow, lane_change_left, lane_change_right, reverse, overtake, "
    "other}\nTask 4: Trajectory Prediction\nPredict the optimal 5-second future trajectory (5 waypoints, 1 s "
    "intervals).\n\nInput:\n- <image>: three front-view frames from left front, center front, right front "
    "cameras. \n- High-level navigation command: GO_STRAIGHT\n- Historical ego state: Provided are the previous ego "
    "vehicle status recorded over the last 3.0 seconds (at 0.5-second intervals).(t-3.0s) [-43.35, 0.12], "
    "Acceleration: X 0.04, Y 0.03 m/s², Velocity: X 14.28, Y -0.19 m/s,; (t-2.5s) [-36.21, 0.04], Acceleration: "
    "X 0.04, Y 0.04 m/s², Velocity: X 14.36, Y -0.12 m/s,; (t-2.0s) [-29.02, -0.02], Acceleration: X 0.06, Y 0.04 "
    "m/s², Velocity: X 14.43, Y -0.04 m/s,; (t-1.5s) [-21.81, -0.02], Acceleration: X 0.04, Y 0.04 m/s², "
    "Velocity: X 14.49, Y 0.04 m/s,; (t-1.0s) [-14.57, -0.01], Acceleration: X 0.04, Y 0.00 m/s², Velocity: X "
    "14.55, Y 0.03 m/s,; (t-0.5s) [-7.30, 0.00], Acceleration: X 0.04, Y -0.02 m/s², Velocity: X 14.61, Y 0.00 "
    "m/s,; (t+0.0s) [0.00, 0.00], Acceleration: X 0.03, Y -0.01 m/s², Velocity: X 14.64, Y -0.01 m/s,\n\nOutput:"
)


def test_the_prompt_is_the_releases_byte_for_byte():
    history = history_from_prompt(RELEASE_EXAMPLE)
    np.testing.assert_array_equal(history[0], [-43.35, 0.12, 14.28, -0.19, 0.04, 0.03])  # x, y, vx, vy, ax, ay
    np.testing.assert_array_equal(history[-1], [0.0, 0.0, 14.64, -0.01, 0.03, -0.01])
    assert prompt_text("go_straight", history) == RELEASE_EXAMPLE


def test_png_export_converts_back_to_the_same_samples(dataset, tmp_path):
    export_wod_e2e(dataset, tmp_path / "release", image_format="png")
    calls = []
    report = convert_wod_e2e(tmp_path / "release", tmp_path / "back", on_item=calls.append)
    assert (report.samples, report.failures, report.answers_derived) == ({"train": 2, "val": 2, "test": 1}, [], 0)
    assert calls == [1] * 5
    back, original = stored(tmp_path / "back"), stored(dataset)
    for split in original:
        assert len(back[split]) == len(original[split])
        for b, o in zip(back[split], original[split], strict=True):
            assert_same(b, o)
    assert DrivingDataset.open(tmp_path / "back").manifest["complete"]


def test_jpeg_export_converts_back_within_jpeg_loss(dataset, tmp_path):
    export_wod_e2e(dataset, tmp_path / "release", split="val")
    report = convert_wod_e2e(tmp_path / "release", tmp_path / "back")
    assert report.samples == {"train": 0, "val": 2, "test": 0}
    for b, o in zip(stored(tmp_path / "back")["val"], stored(dataset)["val"], strict=True):
        assert_same(b, o, exact_image=False)
        error = np.abs(b.image.astype(int) - o.image.astype(int))
        assert error.mean() < 0.5 and np.percentile(error, 99) <= 6


def test_history_is_read_from_the_prompt_or_from_16_past_states(dataset, tmp_path):
    release = tmp_path / "release"
    export_wod_e2e(dataset, release, split="val", image_format="png")
    first, second = load(release / "validation.json")
    for name in ("history waypoints", "velocity", "acceleration"):
        del first[name]  # as convert_wod_e2e.py writes records: the ego state is in the prompt only
        rows = np.zeros((16, 2))
        rows[3::2] = second[name]
        second[name] = rows.tolist()  # WOD-E2E past_states: 16 rows at 4 Hz
    second["image"] = [f"dataset/{p}" for p in second["image"]]  # batch_inference.py drops this prefix
    save(release / "validation.json", [first, second])
    report = convert_wod_e2e(release, tmp_path / "back")
    assert report.failures == []
    back, original = stored(tmp_path / "back")["val"], stored(dataset)["val"]
    np.testing.assert_allclose(back[0].history, original[0].history, rtol=0, atol=0.005 + 1e-9)
    assert_same(back[1], original[1])


def test_malformed_records_are_reported_with_file_and_id_and_the_rest_converts(dataset, tmp_path):
    release = tmp_path / "release"
    export_wod_e2e(dataset, release, image_format="png")
    first, second = load(release / "validation.json")
    missing = release / first["image"][1]
    missing.unlink()
    unrated = {k: v for k, v in second.items() if k != "rated"}  # no TFRecord frame has these ids
    short = {**unrated, "sample_id": "short-future", "future waypoints": second["future waypoints"][:19]}
    no_command = {k: v for k, v in unrated.items() if k != "navigation_command"} | {"sample_id": "no-command"}
    save(release / "validation.json", [first, second, short, "not a record", no_command])
    (release / "test.json").write_text("[{", encoding="utf-8")
    save(release / "predictions.json", [])
    write_records(release / "frames.tfrecord", [])

    report = convert_wod_e2e(release, tmp_path / "back")
    assert report.samples == {"train": 2, "val": 1, "test": 0}
    failures = {(f.file.name, f.record_id): f.error for f in report.failures}
    assert set(failures) == {
        ("validation.json", first["sample_id"]),
        ("validation.json", "short-future"),
        ("validation.json", "#3"),
        ("validation.json", "no-command"),
        ("test.json", ""),
        ("predictions.json", ""),
        ("frames.tfrecord", ""),
    }
    assert str(missing) in failures[("validation.json", first["sample_id"])]
    assert "20 points" in failures[("validation.json", "short-future")]
    assert "navigation_command" in failures[("validation.json", "no-command")]
    assert str(report.failures[0]).startswith(str(report.failures[0].file))
    assert not DrivingDataset.open(tmp_path / "back").manifest["complete"]
    assert_same(stored(tmp_path / "back")["val"][0], stored(dataset)["val"][1])


def test_unrated_frames_are_kept_and_marked_by_having_no_raters(dataset, tmp_path):
    release = tmp_path / "release"
    export_wod_e2e(dataset, release, image_format="png")
    original = stored(dataset)
    first, second = original["val"]
    unrated = np.full(len(first.rater_scores), -1.0)  # the official evaluator skips a frame scored -1
    write_records(
        release / FRAMES["validation"],
        [encode_frame(first.sample_id, first.rater_trajectories, unrated), rated_frame(second)],
    )
    train = original["train"]
    write_records(
        release / FRAMES["training"],
        [encode_frame(train[0].sample_id, first.rater_trajectories, unrated), rated_frame(train[1])],
    )
    (release / FRAMES["test"]).unlink()  # the test records carry their raters themselves, or none
    test = load(release / "test.json")[0]
    as_json = [
        {"pos_x": f[:, 0].tolist(), "pos_y": f[:, 1].tolist(), "preference_score": float(s)}
        for f, s in zip(second.rater_trajectories, second.rater_scores, strict=True)
    ]
    save(
        release / "test.json",
        [
            test | {"preference_trajectories": [t | {"preference_score": -1} for t in as_json]},
            {k: v for k, v in test.items() if k != "preference_trajectories"}
            | {"sample_id": "no-raters", "rated": False},
            test | {"sample_id": "json-rated", "preference_trajectories": as_json},
        ],
    )

    report = convert_wod_e2e(release, tmp_path / "back")
    assert report.failures == []
    assert report.unrated == {"train": 0, "val": 1, "test": 2}
    back = stored(tmp_path / "back")
    # Kept for a submission, which must cover every frame; the official evaluator (and eval) score rated ones only.
    assert [(s.sample_id, len(s.rater_scores)) for s in back["val"]] == [(first.sample_id, 0), (second.sample_id, 3)]
    assert [(s.sample_id, len(s.rater_scores)) for s in back["test"]] == [
        (test["sample_id"], 0),
        ("no-raters", 0),
        ("json-rated", 3),
    ]
    np.testing.assert_array_equal(back["test"][2].rater_trajectories, second.rater_trajectories)
    np.testing.assert_array_equal(back["test"][2].rater_scores, second.rater_scores)
    assert [s.rater_scores.size for s in back["train"]] == [0, 0]


def test_an_empty_or_template_answer_is_derived_from_the_future(dataset, tmp_path):
    release = tmp_path / "release"
    export_wod_e2e(dataset, release, split="train", image_format="png")
    records = load(release / "training.json")
    records[0]["conversations"][1]["value"] = ""
    records[1]["conversations"][1]["value"] = '{"trajectory": "<|mdm_mask|><|mdm_mask|>"}'
    save(release / "training.json", records)
    report = convert_wod_e2e(release, tmp_path / "back")
    assert report.answers_derived == 2 and report.failures == []
    for back, original in zip(stored(tmp_path / "back")["train"], stored(dataset)["train"], strict=True):
        assert np.allclose(back.response.trajectory, original.future[3::4], atol=0.005)
        assert back.response.future_meta_behavior.lateral == "other"
        assert not any(back.response.critical_objects.values())


def test_split_is_read_from_the_file_name():
    assert split_of(Path("dvlm-ad_waymo_e2e_val_cot.json")) == "val"
    assert split_of(Path("training.json")) == "train"
    assert split_of(Path("val_rated.json")) == "val"
    assert split_of(Path("test.json")) == "test"
    assert split_of(Path("predictions.json")) is None
    assert split_of(Path("train_val.json")) is None
    assert split_of(Path("validation.tfrecord-00000-of-00001")) == "val"
    assert split_of(Path("val_202504211836.tfrecord-00012-of-00093")) == "val"


def test_waymo_cameras_are_fitted_to_the_release_pixel_budget():
    rng = np.random.default_rng(0)
    cameras = [rng.integers(0, 255, (1280, 1920, 3), dtype=np.uint8) for _ in range(3)]
    joined = join_cameras(cameras)
    assert joined.shape == (364, 3 * 532, 3)  # Qwen2.5-VL smart_resize of 1920 x 1280 into 200704 px
    assert joined.shape[0] * joined.shape[1] // 3 <= RELEASE_MAX_PIXELS
    frame = rng.integers(0, 255, (224, 448, 3), dtype=np.uint8)
    assert [c.shape[1] for c in split_cameras(frame)] == [140, 168, 140]
    np.testing.assert_array_equal(join_cameras(split_cameras(frame)), frame)


def test_outputs_are_not_overwritten_unless_asked(dataset, tmp_path):
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "keep.txt").write_text("x")
    with pytest.raises(OutputExists):
        export_wod_e2e(dataset, tmp_path / "release")
    with pytest.raises(OutputExists, match="keep.txt"):  # --overwrite replaces an earlier export, nothing else
        export_wod_e2e(dataset, tmp_path / "release", split="test", overwrite=True)
    assert (tmp_path / "release" / "keep.txt").read_text() == "x"
    (tmp_path / "release" / "keep.txt").unlink()
    export_wod_e2e(dataset, tmp_path / "release", split="test", overwrite=True)
    export_wod_e2e(dataset, tmp_path / "release", split="test", overwrite=True)  # an earlier export is replaced
    convert_wod_e2e(tmp_path / "release", tmp_path / "back")
    with pytest.raises(OutputExists):
        convert_wod_e2e(tmp_path / "release", tmp_path / "back")
    assert convert_wod_e2e(tmp_path / "release", tmp_path / "back", overwrite=True).samples["test"] == 1
    with pytest.raises(FileNotFoundError):
        convert_wod_e2e(tmp_path / "empty", tmp_path / "other")


def crc32c_bitwise(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) one bit at a time: a reference independent of the code."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def framed(data: bytes) -> bytes:
    """One TFRecord record by the format: length, masked CRC of the length, data, masked CRC of the data."""

    def masked(chunk: bytes) -> bytes:
        crc = crc32c_bitwise(chunk)
        return ((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF).to_bytes(4, "little")

    length = len(data).to_bytes(8, "little")
    return length + masked(length) + data + masked(data)


def test_tfrecord_framing_round_trips_and_a_flipped_byte_is_named(tmp_path):
    assert crc32c_bitwise(b"123456789") == 0xE3069283  # the CRC-32C check value: the reference is right
    records = [b"", b"frame", bytes(range(256)) * 3]
    path = tmp_path / "validation.tfrecord"
    assert write_records(path, records) == 3
    raw = path.read_bytes()
    assert raw == b"".join(framed(r) for r in records)
    assert list(read_records(path)) == records

    def read_altered(data: bytes) -> list:
        path.write_bytes(data)
        return list(read_records(path))

    second = len(framed(records[0]))  # where record #1 starts
    flipped = bytearray(raw)
    flipped[second + 12 + 2] ^= 0x10  # in record #1's data: that record is lost, the next one read
    first, error, third = read_altered(bytes(flipped))
    assert (first, third) == (records[0], records[2])
    assert isinstance(error, CorruptRecord) and error.index == 1
    assert str(error) == f"{path}: record #1 at byte {second}: the data fails its CRC"
    flipped = bytearray(raw)
    flipped[second] ^= 0x01  # in record #1's length: the framing is lost from there
    first, error = read_altered(bytes(flipped))
    assert first == records[0] and error.index == 1 and "length" in error.reason
    *kept, error = read_altered(raw[:-10])  # a cut file
    assert kept == records[:2] and error.index == 2 and str(path) in str(error)
    *kept, error = read_altered(raw + b"\x01\x02")  # a stray tail shorter than a header
    assert kept == records and error.index == 3


def test_e2ed_frames_use_the_official_field_numbers():
    f32 = struct.Struct("<f").pack
    data = encode_frame("ab", [np.array([[1.0, 2.0]])], [10.0])
    # Tags are (field number << 3) | wire type; 2 = length-delimited, 5 = 32-bit.
    # E2EDFrame.frame = 1 { Frame.context = 1 { Context.name = 1: "ab" } }
    name = b"\x0a\x06" + b"\x0a\x04" + b"\x0a\x02ab"
    # EgoTrajectoryStates: pos_x = 1, pos_y = 2 (packed floats), preference_score = 8 (float: tag 0x45)
    rater = b"\x0a\x04" + f32(1.0) + b"\x12\x04" + f32(2.0) + b"\x45" + f32(10.0)
    # E2EDFrame.preference_trajectories = 8 (tag 0x42)
    assert data == name + b"\x42" + bytes([len(rater)]) + rater
    assert decode_frame(data) == WodFrame("ab", raters=[{"pos_x": [1.0], "pos_y": [2.0], "preference_score": 10.0}])

    # Frame.timestamp_micros = 2 (varint), E2EDFrame.future_states = 5 (pos_x, pos_y, pos_z packed floats),
    # E2EDFrame.intent = 7 (varint; GO_LEFT = 2), written before the raters in field order.
    states = encode_frame("ab", [], [], future=np.array([[3.0, 4.0]]), intent="GO_LEFT", timestamp_micros=42)
    future = b"\x0a\x04" + f32(3.0) + b"\x12\x04" + f32(4.0) + b"\x1a\x04" + f32(0.0)
    frame = b"\x0a\x04\x0a\x02ab" + b"\x10\x2a"  # Frame { context { name }, timestamp_micros = 42 }
    assert states == b"\x0a\x08" + frame + b"\x2a" + bytes([len(future)]) + future + b"\x38\x02"
    decoded = decode_frame(states)
    assert (decoded.name, decoded.timestamp_micros, decoded.intent, decoded.raters) == ("ab", 42, "GO_LEFT", [])
    np.testing.assert_array_equal(decoded.future, [[3.0, 4.0]])

    # A frame as WOD writes it holds its cameras and past: Frame.images = 4 with CameraImage name = 1 (FRONT = 1)
    # and image = 2, E2EDFrame.past_states = 6 with pos_x, pos_y, vel_x, vel_y, accel_x, accel_y = 1, 2, 4, 5, 6, 7.
    image = b"\x08\x01" + b"\x12\x03jpg"
    frame = b"\x0a\x04\x0a\x02ab" + b"\x22" + bytes([len(image)]) + image
    past = b"".join(bytes([number << 3 | 2, 4]) + f32(float(number)) for number in (1, 2, 4, 5, 6, 7))
    full = b"\x0a" + bytes([len(frame)]) + frame + b"\x32" + bytes([len(past)]) + past + data[len(name) :]
    decoded = decode_frame(full)
    assert decoded.images == {"FRONT": b"jpg"} and decoded.raters == decode_frame(data).raters
    np.testing.assert_array_equal(decoded.past, [[1.0, 2.0, 4.0, 5.0, 6.0, 7.0]])
    cut = b"\x0a" + bytes([len(frame)]) + frame + b"\x32\x06" + b"\x0a\x04" + f32(5.0)  # pos_x alone
    with pytest.raises(ValueError, match="past_states columns differ in length: 1 pos_x, 0 pos_y"):
        decode_frame(cut)
    with pytest.raises(ValueError, match="E2EDFrame"):
        decode_frame(b"\x0a\xff")


def test_raters_round_trip_through_the_tfrecords_with_the_same_rfs(dataset, tmp_path):
    release = tmp_path / "release"
    export_wod_e2e(dataset, release, image_format="png")
    assert all("preference_trajectories" not in r for r in load(release / "validation.json"))
    report = convert_wod_e2e(release, tmp_path / "back")
    assert report.failures == []
    back, original = stored(tmp_path / "back"), stored(dataset)
    pairs = list(zip(back["val"] + back["test"], original["val"] + original["test"], strict=True))
    assert len(pairs) == 3
    for b, o in pairs:
        assert b.sample_id == o.sample_id and o.rater_scores.size > 0
        np.testing.assert_allclose(b.rater_trajectories, o.rater_trajectories, rtol=0, atol=1e-6)
        assert b.rater_scores.tolist() == o.rater_scores.tolist()
        speed = float(np.linalg.norm(o.history[-1, 2:4]))
        for plan in (o.future, o.future + [3.0, 1.0], o.rater_trajectories[-1]):
            rfs = rater_feedback_score(plan, o.rater_trajectories, o.rater_scores, speed)
            assert rater_feedback_score(plan, b.rater_trajectories, b.rater_scores, speed) == rfs

    for path in release.glob("*.tfrecord*"):
        path.unlink()  # without them the records hold no raters: the TFRecords carried them
    convert_wod_e2e(release, tmp_path / "bare")
    assert [s.rater_scores.size for s in stored(tmp_path / "bare")["val"]] == [0, 0]


def test_rater_paths_are_fitted_to_20_points_and_3_raters_as_the_official_evaluator(dataset, tmp_path):
    release = tmp_path / "release"
    export_wod_e2e(dataset, release, split="val", image_format="png")
    first, second = stored(dataset)["val"]
    path = np.cumsum(np.full((25, 2), [1.0, 0.25]), axis=0)
    paths = [path, path[:12], path[:20], path[:20] + 1]
    write_records(
        release / FRAMES["validation"], [encode_frame(first.sample_id, paths, [8, 6, 4, 2]), rated_frame(second)]
    )
    report = convert_wod_e2e(release, tmp_path / "back")
    assert report.failures == []
    fitted = stored(tmp_path / "back")["val"][0]
    assert fitted.rater_scores.tolist() == [8, 6, 4]  # the first 3 raters
    np.testing.assert_array_equal(fitted.rater_trajectories[0], path[:20])  # cut
    np.testing.assert_array_equal(
        fitted.rater_trajectories[1], np.concatenate([path[:12], np.repeat(path[11:12], 8, axis=0)])
    )


def test_a_corrupt_or_cut_tfrecord_is_reported_by_file_and_record_and_the_rest_converts(dataset, tmp_path):
    release = tmp_path / "release"
    export_wod_e2e(dataset, release, split="val", image_format="png")
    first, second = stored(dataset)["val"]
    frames = release / FRAMES["validation"]
    raw = frames.read_bytes()
    flipped = bytearray(raw)
    flipped[12 + 5] ^= 0xFF  # inside frame #0
    frames.write_bytes(bytes(flipped))

    report = convert_wod_e2e(release, tmp_path / "back")
    failures = {(f.file.name, f.record_id): f for f in report.failures}
    assert set(failures) == {(frames.name, "#0"), ("validation.json", first.sample_id)}
    assert str(failures[frames.name, "#0"]) == f"{frames}: record #0: the data fails its CRC"
    assert "marked rated" in failures["validation.json", first.sample_id].error  # its raters were lost
    assert_same(stored(tmp_path / "back")["val"][0], second)
    assert not DrivingDataset.open(tmp_path / "back").manifest["complete"]

    frames.write_bytes(raw[:-7])  # a download cut inside frame #1
    report = convert_wod_e2e(release, tmp_path / "back", overwrite=True)
    assert [(f.file.name, f.record_id) for f in report.failures] == [
        (frames.name, "#1"),
        ("validation.json", second.sample_id),
    ]
    assert "ends inside" in report.failures[0].error
    assert_same(stored(tmp_path / "back")["val"][0], first)
