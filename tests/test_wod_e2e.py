"""The WOD-E2E adapter on simulator samples exported in the Fast-dDrive / dVLM-AD release format."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fastddrive.data.build import OutputExists, write_manifest
from fastddrive.data.highway import episode_samples
from fastddrive.data.sample import DrivingDataset, DrivingSample, write_shard
from fastddrive.data.wod_e2e import (
    PROMPT,
    RELEASE_MAX_PIXELS,
    convert_wod_e2e,
    export_wod_e2e,
    history_from_prompt,
    join_cameras,
    prompt_text,
    split_cameras,
    split_of,
)
from fastddrive.schema import parse


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


def test_export_writes_the_release_layout(dataset, tmp_path):
    calls = []
    report = export_wod_e2e(dataset, tmp_path, on_item=lambda: calls.append(1))
    assert report.samples == {"training": 2, "validation": 2, "test": 1}
    assert len(calls) == 5
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
    assert [t["preference_score"] for t in record["preference_trajectories"]] == original.rater_scores.tolist()
    assert load(tmp_path / "training.json")[0]["preference_trajectories"] == []


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
    report = convert_wod_e2e(tmp_path / "release", tmp_path / "back", on_item=lambda: calls.append(1))
    assert (report.samples, report.failures, report.answers_derived) == ({"train": 2, "val": 2, "test": 1}, [], 0)
    assert len(calls) == 5
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
    short = {**second, "sample_id": "short-future", "future waypoints": second["future waypoints"][:19]}
    no_command = {k: v for k, v in second.items() if k != "navigation_command"} | {"sample_id": "no-command"}
    save(release / "validation.json", [first, second, short, "not a record", no_command])
    (release / "test.json").write_text("[{", encoding="utf-8")
    save(release / "predictions.json", [])

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
    }
    assert str(missing) in failures[("validation.json", first["sample_id"])]
    assert "20 points" in failures[("validation.json", "short-future")]
    assert "navigation_command" in failures[("validation.json", "no-command")]
    assert str(report.failures[0]).startswith(str(report.failures[0].file))
    assert not DrivingDataset.open(tmp_path / "back").manifest["complete"]
    assert_same(stored(tmp_path / "back")["val"][0], stored(dataset)["val"][1])


def test_unrated_frames_are_dropped_from_scored_splits_and_kept_in_train(dataset, tmp_path):
    release = tmp_path / "release"
    export_wod_e2e(dataset, release, image_format="png")
    val = load(release / "validation.json")
    val[0]["preference_trajectories"][0]["preference_score"] = -1  # the official evaluator skips this frame
    save(release / "validation.json", val)
    test = load(release / "test.json")
    del test[0]["preference_trajectories"]
    test[0]["rated"] = False  # convert_wod_e2e.py's flag for the same rule
    save(release / "test.json", test)
    train = load(release / "training.json")
    train[0]["preference_trajectories"] = val[0]["preference_trajectories"]
    save(release / "training.json", train)

    report = convert_wod_e2e(release, tmp_path / "back")
    assert report.failures == []
    assert report.unrated == {"train": 0, "val": 1, "test": 1}
    back = stored(tmp_path / "back")
    assert [s.sample_id for s in back["val"]] == [val[1]["sample_id"]]
    assert back["test"] == []
    assert len(back["train"]) == 2 and back["train"][0].rater_scores.size == 0


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
    export_wod_e2e(dataset, tmp_path / "release", split="test", overwrite=True)
    convert_wod_e2e(tmp_path / "release", tmp_path / "back")
    with pytest.raises(OutputExists):
        convert_wod_e2e(tmp_path / "release", tmp_path / "back")
    assert convert_wod_e2e(tmp_path / "release", tmp_path / "back", overwrite=True).samples["test"] == 1
    with pytest.raises(FileNotFoundError):
        convert_wod_e2e(tmp_path / "empty", tmp_path / "other")
