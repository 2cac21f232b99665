"""nuScenes adapter and exporter: simulator samples exported in the v1.0 layout and converted back."""

import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy.spatial.transform import Rotation

from fastddrive.core.prompt import user_text
from fastddrive.data.dataset import DATASET_FORMAT, MANIFEST, DrivingDataset, write_shard
from fastddrive.data.highway import episode_samples
from fastddrive.data.nuscenes import (
    EXPORT_VERSION,
    NO_TOP_VIEW,
    NUSCENES_FUTURE,
    NuScenesError,
    convert_nuscenes,
    export_nuscenes,
    nuscenes_command,
)

# The official nuscenes-devkit pins numpy<2, so it runs in an interpreter of its own (`make test` builds one with
# nuscenes-devkit 1.2.0 and names it here); the tests that read an export with it are skipped without one.
DEVKIT_PYTHON = os.environ.get("NUSCENES_DEVKIT_PYTHON")
needs_devkit = pytest.mark.skipif(not DEVKIT_PYTHON, reason="NUSCENES_DEVKIT_PYTHON is not set (`make test` sets it)")

DEVKIT_TABLES = (  # the tables nuscenes-devkit's NuScenes() loads
    "category",
    "attribute",
    "visibility",
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


def _with_lateral_offset(sample, offset_m):
    """The sample with its future bent sideways so that the 3 s point is `offset_m` further left."""
    bend = offset_m * (sample.future_time_s / 3.0) ** 2
    future = sample.future + np.stack([np.zeros(20), bend], axis=1)
    return replace(sample, sample_id=f"{sample.sample_id}-bent{offset_m:+g}", future=future)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """A small simulator dataset: a highway and a merge episode, agents with gaps, futures bent left and right."""
    highway = episode_samples("highway", 90_000, max_duration_s=9)
    merge = episode_samples("merge", 90_001, max_duration_s=9)
    first = highway[0]
    agents = first.agents.copy()
    agents[0, 10:] = np.nan  # leaves after 2.25 s
    agents[1, 6] = np.nan  # missing at the 1.5 s key frame only
    splits = {
        "train": [replace(first, agents=agents), highway[1]],
        "val": merge,
        "test": [_with_lateral_offset(first, 4.0), _with_lateral_offset(first, -4.0)],
    }
    root = tmp_path_factory.mktemp("sim")
    for split, samples in splits.items():
        write_shard(root / split / "00000.parquet", samples)
    (root / MANIFEST).write_text(json.dumps({"format": DATASET_FORMAT, "version": 1, "complete": True}))
    return root, splits


@pytest.fixture(scope="module")
def exported(simulated, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "nuscenes"
    progress = []
    report = export_nuscenes(simulated[0], out, on_start=progress.append, on_item=lambda: progress.append(None))
    assert progress == [sum(report.samples.values())] + [None] * progress[0]
    return out, report


@pytest.fixture(scope="module")
def converted(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted")
    progress = []
    report = convert_nuscenes(
        exported[0],
        EXPORT_VERSION,
        out,
        ego_size_m=(5.0, 2.0),  # the simulator's car: nuScenes has no field for it
        on_start=progress.append,
        on_item=lambda: progress.append(None),
    )
    assert progress == [17 * report.scenes] + [None] * progress[0]  # every key frame, used or skipped
    return DrivingDataset.open(out), report


def _by_id(dataset):
    return {s.sample_id: (split, s) for split in ("train", "val", "test") for s in dataset.samples(split)}


def test_export_then_convert_gives_back_the_samples(simulated, exported, converted):
    _, splits = simulated
    _, export = exported
    dataset, report = converted
    assert report.failures == []
    assert report.samples == {s: len(v) for s, v in splits.items()}
    assert report.velocity_rows == {"can_bus": 7 * sum(report.samples.values())}
    assert dataset.manifest["complete"] is True
    back = _by_id(dataset)
    for split, samples in splits.items():
        for original in samples:
            got_split, sample = back[export.tokens[original.sample_id]]
            assert got_split == split
            assert sample.scenario == original.scenario
            assert sample.ego_size == original.ego_size
            assert np.allclose(sample.history, original.history, atol=1e-4)
            # The planner reads the same state: a round trip's float noise moves no digit or sign of the prompt.
            assert user_text("go_straight", sample.history) == user_text("go_straight", original.history)
            assert np.allclose(sample.future, original.future, atol=1e-4)
            assert np.allclose(sample.future_time_s, original.future_time_s, atol=1e-6)
            assert sample.command == nuscenes_command(original.future[11, 1])
            assert np.allclose(np.asarray(sample.response.trajectory), original.future[3::4], atol=0.006)
            assert sample.image.shape == original.image.shape
            error = np.abs(sample.image.astype(int) - original.image.astype(int))
            assert error.mean() < 0.1 and error.max() <= 8  # JPEG at quality 100, 4:4:4
            assert sample.view.pixels_per_metre == pytest.approx(original.view.pixels_per_metre)
            assert np.allclose(sample.view.ego_pixel, original.view.ego_pixel)
            assert sample.view.ego_heading_rad == pytest.approx(original.view.ego_heading_rad)
            assert np.allclose(sample.agent_size, original.agent_size, atol=1e-5)
            # Key frames (even indices) carry the agents exactly, NaN where they are absent.
            keys, original_keys = sample.agents[:, 0::2], original.agents[:, 0::2]
            assert np.array_equal(np.isnan(keys), np.isnan(original_keys))
            assert np.allclose(keys, original_keys, atol=1e-4, equal_nan=True)


def test_agents_between_key_frames_are_interpolated_and_gaps_stay_empty(simulated, exported, converted):
    _, splits = simulated
    sample = _by_id(converted[0])[exported[1].tokens[splits["train"][0].sample_id]][1]
    keys = sample.agents[:, 0::2]
    middle = sample.agents[:, 1::2]
    expected = (keys[:, :-1, :2] + keys[:, 1:, :2]) / 2
    assert np.allclose(middle[..., :2], expected, equal_nan=True)
    assert np.isnan(sample.agents[0, 10:]).all()  # left after 2.25 s
    assert np.isnan(sample.agents[1, 5:8]).all() and not np.isnan(sample.agents[1, [4, 8]]).any()


def test_the_command_is_vads_lateral_offset_rule(simulated, exported, converted):
    commands = [nuscenes_command(y) for y in (2.0, 1.99, -1.99, -2.0)]
    assert commands == ["go_left", "go_straight", "go_straight", "go_right"]
    back = _by_id(converted[0])
    left, right = (back[exported[1].tokens[s.sample_id]][1] for s in simulated[1]["test"])
    assert left.future[NUSCENES_FUTURE][-1, 1] > 2 and left.command == "go_left"
    assert right.future[NUSCENES_FUTURE][-1, 1] < -2 and right.command == "go_right"


def test_the_export_has_the_nuscenes_layout(exported):
    root, report = exported
    tables = {name: json.loads((root / EXPORT_VERSION / f"{name}.json").read_text()) for name in DEVKIT_TABLES}
    tokens = {name: {r["token"]: r for r in rows} for name, rows in tables.items()}
    assert report.scenes == len(tables["scene"]) == sum(report.samples.values())
    for scene in tables["scene"]:
        assert scene["nbr_samples"] == 17 and scene["name"].startswith("scene-")
        messages = json.loads((root / "can_bus" / f"{scene['name']}_pose.json").read_text())
        assert len(messages) == 7 and list(messages[0]) == sorted(messages[0])  # as the real files: keys sorted
    for record in tables["sample_data"]:  # what the devkit's reverse index follows
        calibration = tokens["calibrated_sensor"][record["calibrated_sensor_token"]]
        assert tokens["sensor"][calibration["sensor_token"]]["channel"] in ("LIDAR_TOP", "CAM_FRONT")
        assert record["sample_token"] in tokens["sample"] and record["ego_pose_token"] in tokens["ego_pose"]
        assert (root / record["filename"]).is_file()
    for record in tables["sample_annotation"]:
        instance = tokens["instance"][record["instance_token"]]
        assert tokens["category"][instance["category_token"]]["name"] == "vehicle.car"
    assert {t for m in tables["map"] for t in m["log_tokens"]} == set(tokens["log"])
    assert (root / tables["map"][0]["filename"]).is_file()
    frames = sorted((root / "samples" / "CAM_FRONT").glob("*.jpg"))
    assert len(frames) == 17 * report.scenes  # CAM_FRONT at every key frame, as every nuScenes sample has
    cameras = [r for r in tables["sample_data"] if r["filename"].startswith("samples/CAM_FRONT/")]
    assert {r["sample_token"] for r in cameras} == set(tokens["sample"])


def test_a_missing_table_is_named_and_nothing_is_written(exported, tmp_path):
    root = tmp_path / "nuscenes"
    shutil.copytree(exported[0], root)
    (root / EXPORT_VERSION / "sample_annotation.json").unlink()
    with pytest.raises(NuScenesError, match="sample_annotation.json is missing"):
        convert_nuscenes(root, EXPORT_VERSION, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_malformed_record_fails_its_sample_by_file_and_token_and_the_rest_converts(simulated, exported, tmp_path):
    root = tmp_path / "nuscenes"
    shutil.copytree(exported[0], root)
    folder = root / EXPORT_VERSION
    key = exported[1].tokens[simulated[1]["val"][0].sample_id]
    lidar = next(r for r in json.loads((folder / "sample_data.json").read_text()) if r["sample_token"] == key)
    poses = json.loads((folder / "ego_pose.json").read_text())
    bad = next(p for p in poses if p["token"] == lidar["ego_pose_token"])
    bad["rotation"] = [1.0, 0.0]
    (folder / "ego_pose.json").write_text(json.dumps(poses))
    report = convert_nuscenes(root, EXPORT_VERSION, tmp_path / "out")
    assert len(report.failures) == 1
    assert "ego_pose.json" in report.failures[0] and bad["token"] in report.failures[0]
    assert key in report.failures[0]
    assert sum(report.samples.values()) == sum(exported[1].samples.values()) - 1
    assert DrivingDataset.open(tmp_path / "out").manifest["complete"] is False


def test_without_can_bus_velocity_and_acceleration_come_from_ego_poses(simulated, exported, tmp_path):
    root = tmp_path / "nuscenes"
    shutil.copytree(exported[0], root, ignore=shutil.ignore_patterns("can_bus"))
    report = convert_nuscenes(root, EXPORT_VERSION, tmp_path / "out")
    assert report.velocity_rows == {"ego_pose": 7 * sum(report.samples.values())}
    original = simulated[1]["train"][1]
    sample = _by_id(DrivingDataset.open(tmp_path / "out"))[exported[1].tokens[original.sample_id]][1]
    velocity = np.diff(original.history[:, :2], axis=0) / 0.5  # backward differences over 0.5 s
    assert np.allclose(sample.history[1:, 2:4], velocity, atol=1e-4)
    assert np.allclose(sample.history[0, 2:4], velocity[0], atol=1e-4)  # forward at the scene's first key frame
    assert np.allclose(sample.history[2:, 4:6], np.diff(velocity, axis=0) / 0.5, atol=1e-3)


def test_six_cameras_are_tiled_two_by_three(simulated, exported, converted, tmp_path):
    root = tmp_path / "nuscenes"
    shutil.copytree(exported[0], root)
    folder = root / EXPORT_VERSION
    tables = {n: json.loads((folder / f"{n}.json").read_text()) for n in ("sensor", "calibrated_sensor", "sample_data")}
    fronts = [r for r in tables["sample_data"] if r["filename"].startswith("samples/CAM_FRONT/")]
    for n, channel in enumerate(("CAM_FRONT_LEFT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT")):
        tables["sensor"].append({"token": f"sensor-{n}", "channel": channel, "modality": "camera"})
        tables["calibrated_sensor"].append(
            {"token": f"calibration-{n}", "sensor_token": f"sensor-{n}", "translation": [1.0, 0.0, 1.5]}
            | {"rotation": [0.5, -0.5, 0.5, -0.5], "camera_intrinsic": [[500, 0, 224], [0, 500, 112], [0, 0, 1]]}
        )
        for front in fronts:
            image = front["filename"].replace("CAM_FRONT", channel)
            (root / image).parent.mkdir(exist_ok=True)
            shutil.copy(root / front["filename"], root / image)
            tables["sample_data"].append(
                {**front, "token": f"{front['token']}-{n}", "calibrated_sensor_token": f"calibration-{n}"}
                | {"filename": image}
            )
    for name, rows in tables.items():
        (folder / f"{name}.json").write_text(json.dumps(rows))
    report = convert_nuscenes(root, EXPORT_VERSION, tmp_path / "out", six_cameras=True)
    assert report.failures == []
    single = _by_id(converted[0])
    for _, sample in _by_id(DrivingDataset.open(tmp_path / "out")).values():
        front = single[sample.sample_id][1].image
        h, w = front.shape[:2]
        assert sample.image.shape == (2 * h, 3 * w, 3)
        assert np.array_equal(sample.image[:h, w : 2 * w], front)  # CAM_FRONT in the middle of the top row
        assert sample.view == NO_TOP_VIEW


def test_the_planning_frame_is_vads_lidar_frame_on_a_real_lidar_mounting(simulated, exported, tmp_path):
    """With the LIDAR_TOP calibration of a real nuScenes car, the 2 Hz future and command equal VAD's converter."""
    root = tmp_path / "nuscenes"
    shutil.copytree(exported[0], root)
    folder = root / EXPORT_VERSION
    calibrations = json.loads((folder / "calibrated_sensor.json").read_text())
    sensors = {s["token"]: s["channel"] for s in json.loads((folder / "sensor.json").read_text())}
    lidar = next(c for c in calibrations if sensors[c["sensor_token"]] == "LIDAR_TOP")
    lidar["translation"] = [0.985793, 0.0, 1.84019]  # v1.0-mini, scene-0061
    lidar["rotation"] = [0.706749235646644, -0.015300993788019, 0.01739745181256607, -0.7070846669051719]
    (folder / "calibrated_sensor.json").write_text(json.dumps(calibrations))
    report = convert_nuscenes(root, EXPORT_VERSION, tmp_path / "out")
    assert report.failures == []

    samples = {s["token"]: s for s in json.loads((folder / "sample.json").read_text())}
    data = json.loads((folder / "sample_data.json").read_text())
    lidar_of = {d["sample_token"]: d for d in data if d["is_key_frame"] and d["filename"].startswith("samples/LIDAR")}
    poses = {p["token"]: p for p in json.loads((folder / "ego_pose.json").read_text())}

    def matrix(q):
        return Rotation.from_quat([*q[1:], q[0]]).as_matrix()  # scipy is scalar-last

    def lidar_position(token):  # VAD get_global_sensor_pose(...)[:3, 3]
        pose = poses[lidar_of[token]["ego_pose_token"]]
        return matrix(pose["rotation"]) @ lidar["translation"] + pose["translation"]

    for _, sample in _by_id(DrivingDataset.open(tmp_path / "out")).values():
        pose = poses[lidar_of[sample.sample_id]["ego_pose_token"]]
        token, future = sample.sample_id, []
        for _ in range(6):
            token = samples[token]["next"]
            future.append(lidar_position(token))
        # VAD: global -> ego at t = 0 -> lidar at t = 0
        vad = (np.array(future) - pose["translation"]) @ matrix(pose["rotation"])
        vad = (vad - lidar["translation"]) @ matrix(lidar["rotation"])
        assert np.allclose(sample.future[NUSCENES_FUTURE], np.stack([vad[:, 1], -vad[:, 0]], axis=1), atol=1e-6)
        vad_command = "go_right" if vad[-1, 0] >= 2 else "go_left" if vad[-1, 0] <= -2 else "go_straight"
        assert sample.command == vad_command


def test_frames_whose_sides_are_not_multiples_of_28_are_resized(exported, tmp_path):
    root = tmp_path / "nuscenes"
    shutil.copytree(exported[0], root)
    for frame in (root / "samples" / "CAM_FRONT").glob("*.jpg"):
        Image.new("RGB", (1600, 900), (90, 120, 150)).save(frame)  # a real nuScenes camera's size
    report = convert_nuscenes(root, EXPORT_VERSION, tmp_path / "out", image_width=448)
    assert report.failures == []
    for _, sample in _by_id(DrivingDataset.open(tmp_path / "out")).values():
        assert sample.image.shape == (252, 448, 3)  # 16:9 at 448 px wide, height rounded to 9 x 28 px
        assert np.abs(sample.image.astype(int) - (90, 120, 150)).max() <= 2


@pytest.fixture(scope="module")
def devkit(exported, tmp_path_factory):
    """What the devkit reads from the export (tests/nuscenes_devkit_check.py, run in the devkit's interpreter)."""
    out = tmp_path_factory.mktemp("devkit") / "devkit.json"
    script = Path(__file__).with_name("nuscenes_devkit_check.py")
    command = [DEVKIT_PYTHON, str(script), str(exported[0]), EXPORT_VERSION, str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@needs_devkit
def test_the_devkit_loads_the_export_and_renders_a_camera_with_its_boxes(devkit, converted):
    assert devkit["scenes"] == converted[1].scenes
    assert Path(devkit["rendered"]).stat().st_size > 10_000


@needs_devkit
def test_every_sample_carries_cam_front_and_the_devkits_boxes_land_on_the_drawn_agents(devkit):
    cameras = devkit["cameras"]
    assert cameras["with_cam_front"] == cameras["samples"] > 0
    assert cameras["boxes_seen"] > 20 and cameras["boxes_on_drawn_agents"] == cameras["boxes_seen"]


@needs_devkit
def test_the_devkits_future_and_command_are_the_converted_ones(devkit, converted):
    samples = _by_id(converted[0])
    assert samples and set(samples) <= set(devkit["samples"])  # every sample is a key frame the devkit plans from
    for token, (_, sample) in samples.items():
        seen = devkit["samples"][token]
        future = np.array(seen["future"])  # the LIDAR_TOP frame: x right, y forward; ours: x forward, y left
        assert np.allclose(sample.future[NUSCENES_FUTURE], np.stack([future[:, 1], -future[:, 0]], 1), atol=1e-4)
        assert sample.command == seen["command"]


@needs_devkit
def test_the_devkits_boxes_and_interpolated_sweep_boxes_are_the_converted_agents(devkit, converted):
    for token, (_, sample) in _by_id(converted[0]).items():
        seen = devkit["samples"][token]
        assert not seen["sweep_is_key_frame"]  # the first sweep lies between key frames: its boxes are interpolated
        for step, key in ((0, "boxes"), (1, "sweep_boxes")):
            ours = sample.agents[:, step, :2]
            ours = ours[~np.isnan(ours).any(axis=1)]
            boxes = np.array(seen[key]).reshape(-1, 2)
            assert len(boxes) == len(ours), (token, key)
            boxes = np.stack([boxes[:, 1], -boxes[:, 0]], axis=1)
            nearest = np.linalg.norm(ours[:, None] - boxes[None], axis=-1).min(axis=1, initial=np.inf)
            assert nearest.max(initial=0.0) < 1e-3, (token, key, nearest.max(initial=0.0))


@needs_devkit
def test_the_devkits_can_bus_velocity_is_the_history_velocity(devkit, converted):
    for token, (_, sample) in _by_id(converted[0]).items():
        velocity = devkit["samples"][token]["can_velocity"]
        assert velocity is not None, token
        assert np.allclose(sample.history[-1, 2:4], velocity, atol=1e-4)
