"""WOD-E2E end to end (issue 35): raw TFRecords written with Waymo's own generated classes (all 8 cameras in
shuffled order, calibrations, past and future states, intent, raters; a test split without futures or raters;
one corrupt record) become samples; a split becomes a challenge archive whose shards parse with Waymo's own
E2EDChallengeSubmission, and `submit-check` names what is wrong with a bad one."""

import io
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.core.metrics import constant_velocity_m, scored_plan_m
from fastddrive.data.dataset import DrivingDataset
from fastddrive.data.wod_e2e import HISTORY_ROWS_4HZ, convert_wod_e2e, split_cameras
from fastddrive.data.wod_tfrecord import CAMERA_NUMBERS, write_records
from fastddrive.eval.submission import SubmissionError, SubmissionMetadata, check_submission, write_submission

WAYMO_PROTOS = os.environ.get("WAYMO_PROTOS")
pytestmark = pytest.mark.skipif(not WAYMO_PROTOS, reason="WAYMO_PROTOS is not set (`make test` installs and sets it)")
CAMERA_SIZE = {"FRONT": (640, 400), "FRONT_LEFT": (560, 400), "FRONT_RIGHT": (560, 400)}  # (width, height)
COLOURS = {"FRONT_LEFT": (200, 30, 30), "FRONT": (30, 200, 30), "FRONT_RIGHT": (30, 30, 200)}
METADATA = dict(
    account_name="someone@example.com",
    unique_method_name="fastddrive-ss",
    authors=("A. Author", "B. Author"),
    affiliation="Somewhere",
    description="Scaffold speculative decoding of a tiny block-diffusion planner.",
    method_link="https://example.com",
    uses_public_model_pretraining=False,
    num_model_parameters="5M",
)


@pytest.fixture(scope="module")
def waymo():
    """Waymo's generated classes (`make test` installs their wheel's files without tensorflow)."""
    sys.path.insert(0, WAYMO_PROTOS)
    from waymo_open_dataset import dataset_pb2
    from waymo_open_dataset.protos import end_to_end_driving_data_pb2, end_to_end_driving_submission_pb2

    return dataset_pb2, end_to_end_driving_data_pb2, end_to_end_driving_submission_pb2


def _jpeg(name: str, rng) -> bytes:
    width, height = CAMERA_SIZE.get(name, (320, 200))
    pixels = np.zeros((height, width, 3), np.uint8) + np.array(COLOURS.get(name, (90, 90, 90)), np.uint8)
    pixels += rng.integers(0, 20, pixels.shape, dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _frame(waymo, name: str, k: int, rng, future: bool, raters: bool) -> bytes:
    """An E2EDFrame as Waymo writes one: 8 cameras and their calibrations in shuffled, unpaired orders."""
    _, data, _ = waymo
    frame = data.E2EDFrame()
    frame.frame.context.name = name
    frame.frame.timestamp_micros = 1_000_000 * (k + 1)
    cameras = list(CAMERA_NUMBERS)
    for camera in rng.permutation(cameras):
        frame.frame.images.add(name=CAMERA_NUMBERS[camera], image=_jpeg(camera, rng))
    for camera in rng.permutation(cameras):
        calibration = frame.frame.context.camera_calibrations.add(name=CAMERA_NUMBERS[camera])
        calibration.intrinsic.extend([1000.0, 1000.0, 320.0, 200.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        calibration.extrinsic.transform.extend(np.eye(4).ravel().tolist())
        calibration.width, calibration.height = CAMERA_SIZE.get(camera, (320, 200))
    t = np.arange(-15, 1) * 0.25  # 16 past states at 4 Hz, t = -3.75 .. 0 s
    speed = 8.0 + k
    past = frame.past_states
    past.pos_x.extend((speed * t).tolist())
    past.pos_y.extend((0.1 * k * t).tolist())
    past.pos_z.extend([0.0] * 16)
    past.vel_x.extend([speed] * 16)
    past.vel_y.extend([0.1 * k] * 16)
    past.accel_x.extend((0.01 * np.arange(16)).tolist())
    past.accel_y.extend([0.0] * 16)
    frame.intent = [1, 2, 3][k % 3]
    if future:
        ahead = np.arange(1, 21) * 0.25
        frame.future_states.pos_x.extend((speed * ahead).tolist())
        frame.future_states.pos_y.extend((0.1 * k * ahead).tolist())
        frame.future_states.pos_z.extend([0.0] * 20)
    if raters:
        for score in (9.0, 5.0, 2.0):
            rated = frame.preference_trajectories.add(preference_score=score)
            rated.pos_x.extend((speed * np.arange(1, 21) * 0.25 * score / 9).tolist())
            rated.pos_y.extend([0.0] * 20)
    return frame.SerializeToString()


@pytest.fixture(scope="module")
def raw(waymo, tmp_path_factory):
    """A WOD-E2E folder of raw records: training and validation with futures and raters, test without, and one
    corrupt record (its data flipped after the CRC was written) in the validation file."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("wod-raw")
    names = {split: [f"{split[:3]}{k:02d}{'ab' * 15}-{k}" for k in range(3)] for split in ("train", "val", "test")}
    write_records(
        root / "training.tfrecord-00000-of-00001",
        [_frame(waymo, n, k, rng, True, False) for k, n in enumerate(names["train"])],
    )
    write_records(
        root / "validation.tfrecord-00000-of-00001",
        [_frame(waymo, n, k, rng, True, True) for k, n in enumerate(names["val"])],
    )
    data = bytearray((root / "validation.tfrecord-00000-of-00001").read_bytes())
    data[100] ^= 0xFF  # inside the first record's data: its CRC fails, the others read
    (root / "validation.tfrecord-00000-of-00001").write_bytes(bytes(data))
    write_records(
        root / "test.tfrecord-00000-of-00001",
        [_frame(waymo, n, k, rng, False, False) for k, n in enumerate(names["test"])],
    )
    return root, names


@pytest.fixture(scope="module")
def converted(raw, tmp_path_factory):
    root, names = raw
    out = tmp_path_factory.mktemp("wod-converted") / "data"
    report = convert_wod_e2e(root, out)
    return out, report, names


def test_raw_records_become_samples_with_the_three_front_cameras_the_history_and_the_command(converted, waymo):
    out, report, names = converted
    dataset = DrivingDataset.open(out)
    train = list(dataset.samples("train"))
    assert [s.sample_id for s in train] == names["train"]
    for k, sample in enumerate(train):
        parts = split_cameras(sample.image)  # joined left to right: FRONT_LEFT, FRONT, FRONT_RIGHT
        for part, camera in zip(parts, ("FRONT_LEFT", "FRONT", "FRONT_RIGHT"), strict=True):
            mean = part.reshape(-1, 3).mean(axis=0)
            assert np.abs(mean - np.array(COLOURS[camera]) - 9.5).max() < 12, camera  # the camera of that name
        t = np.arange(-15, 1)[list(HISTORY_ROWS_4HZ)] * 0.25
        np.testing.assert_allclose(sample.history[:, 0], (8.0 + k) * t, atol=1e-4)
        np.testing.assert_allclose(sample.history[:, 2], 8.0 + k, atol=1e-5)
        np.testing.assert_allclose(sample.history[:, 4], 0.01 * np.array(HISTORY_ROWS_4HZ), atol=1e-6)
        assert sample.command == ["go_straight", "go_left", "go_right"][k]
        assert sample.has_future and sample.time_s == k + 1


def test_the_test_frames_are_kept_and_the_corrupt_record_is_named_and_skipped(converted):
    out, report, names = converted
    dataset = DrivingDataset.open(out)
    test = list(dataset.samples("test"))
    assert [s.sample_id for s in test] == names["test"]  # kept, without a future or raters
    assert not any(s.has_future for s in test) and all(len(s.rater_scores) == 0 for s in test)
    val = list(dataset.samples("val"))
    assert [s.sample_id for s in val] == names["val"][1:]
    assert all(len(s.rater_scores) == 3 for s in val)
    (failure,) = report.failures
    assert failure.file.name == "validation.tfrecord-00000-of-00001" and failure.record_id == "#0 at byte 0"
    assert "fails its CRC" in str(failure)
    assert report.unrated == {"train": 0, "val": 0, "test": 3}


def test_shards_split_the_files_between_machines(raw, tmp_path):
    root, names = raw
    parts = [convert_wod_e2e(root, tmp_path / f"part{i}", shard=(i, 2)) for i in range(2)]
    assert [sum(p.samples.values()) for p in parts] == [3 + 2, 3]  # test and validation | training
    result = CliRunner().invoke(
        app, ["data", "wod-e2e", "--src", str(root), "--out", str(tmp_path / "x"), "--shard", "2/2"]
    )
    assert result.exit_code == 2 and "--shard must be I/N with 0 <= I < N" in result.output


def test_a_submission_parses_with_waymos_class_one_20_point_prediction_per_test_frame(converted, waymo, tmp_path):
    out, _, names = converted
    archive = tmp_path / "submission.tar.gz"
    options = [f"--{k.replace('_', '-').replace('unique-', '')}={v}" for k, v in METADATA.items() if k != "authors"]
    options = [o for o in options if "pretraining" not in o] + ["--no-uses-public-model-pretraining"]
    options += [f"--authors={a}" for a in METADATA["authors"]]
    result = CliRunner().invoke(
        app, ["submit", "--data", str(out), "--split", "test", "--out", str(archive), "--decoder", "ss", *options]
    )
    assert result.exit_code == 0, result.output
    _, _, submission = waymo
    with tarfile.open(archive, "r:gz") as packed:
        shards = [submission.E2EDChallengeSubmission.FromString(packed.extractfile(m).read()) for m in packed]
    predictions = [p for s in shards for p in s.predictions]
    assert sorted(p.frame_name for p in predictions) == sorted(names["test"])
    assert all(len(p.trajectory.pos_x) == len(p.trajectory.pos_y) == 20 for p in predictions)
    for shard in shards:
        assert shard.submission_type == submission.E2EDChallengeSubmission.E2ED_SUBMISSION
        assert (shard.account_name, shard.unique_method_name, list(shard.authors)) == (
            METADATA["account_name"],
            METADATA["unique_method_name"],
            list(METADATA["authors"]),
        )
        assert shard.HasField("uses_public_model_pretraining") and shard.num_model_parameters == "5M"
    check = CliRunner().invoke(app, ["submit-check", str(archive), "--data", str(out), "--split", "test"])
    assert check.exit_code == 0 and "3 predictions" in check.output
    # Each prediction is the answer's JMT upsampling, or constant velocity from the history where it does not parse.
    dataset = DrivingDataset.open(out)
    import fastddrive

    planner = fastddrive.load("default")
    for prediction, sample in zip(
        sorted(predictions, key=lambda p: p.frame_name), dataset.samples("test"), strict=True
    ):
        response = planner.plan(sample, "ss").response
        expected = scored_plan_m(response) if response else constant_velocity_m(sample.history)
        got = np.stack([prediction.trajectory.pos_x, prediction.trajectory.pos_y], axis=-1)
        np.testing.assert_allclose(got, expected, atol=1e-3)


def test_missing_metadata_is_refused_in_one_line_before_planning(converted, tmp_path):
    out, _, _ = converted
    archive = tmp_path / "s.tar.gz"
    result = CliRunner().invoke(app, ["submit", "--data", str(out), "--out", str(archive), "--account-name", "x"])
    assert result.exit_code == 2 and "the submission needs unique_method_name: give --method-name" in result.output
    assert not archive.exists()
    with pytest.raises(SubmissionError, match="num_model_parameters must be a count like 3B"):
        SubmissionMetadata(**(METADATA | {"num_model_parameters": "three billion"})).check()
    with pytest.raises(SubmissionError, match="uses_public_model_pretraining"):
        SubmissionMetadata(**(METADATA | {"uses_public_model_pretraining": None})).check()


def test_submit_check_names_the_first_problem(converted, tmp_path):
    out, _, names = converted
    metadata = SubmissionMetadata(**METADATA)
    points = {n: np.zeros((20, 2)) for n in names["test"]}
    good = tmp_path / "good.tar.gz"
    write_submission(good, points, metadata)
    assert check_submission(good, names["test"]) == 3
    cases = {
        "missing": ({n: p for n, p in points.items() if n != names["test"][1]}, "has no prediction"),
        "foreign": (points | {"elsewhere-1": np.zeros((20, 2))}, "'elsewhere-1' is not a frame of the split"),
        "short": (points | {names["test"][0]: np.zeros((5, 2))}, "5 pos_x and 5 pos_y, not 20 points each"),
        "nan": (points | {names["test"][2]: np.full((20, 2), np.nan)}, "not all finite"),
    }
    for label, (predictions, words) in cases.items():
        archive = tmp_path / f"{label}.tar.gz"
        write_submission(archive, predictions, metadata)
        result = CliRunner().invoke(app, ["submit-check", str(archive), "--data", str(out), "--split", "test"])
        assert result.exit_code == 2 and words in result.output, (label, result.output)
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(SubmissionError, match="is not a readable .tar.gz"):
        check_submission(tmp_path / "junk.tar.gz", names["test"])


def test_an_interrupted_submission_resumes_to_the_same_archive(converted, tmp_path):
    import fastddrive
    from fastddrive.eval.submission import plan_submission

    out, _, names = converted
    dataset = DrivingDataset.open(out)
    planner = fastddrive.load("default")
    metadata = SubmissionMetadata(**METADATA)
    settings = {"model": "default", "split": "test", "decoder": "ar-jump"}
    whole = plan_submission(planner, dataset, "test", "ar-jump", {}, metadata, tmp_path / "whole.tar.gz", settings)
    assert whole.resumed == 0 and whole.frames == 3

    class Interrupted(Exception):
        pass

    planned = []

    def stop_after_two() -> None:
        planned.append(1)
        if len(planned) == 2:
            raise Interrupted

    archive = tmp_path / "again.tar.gz"
    with pytest.raises(Interrupted):
        plan_submission(planner, dataset, "test", "ar-jump", {}, metadata, archive, settings, on_sample=stop_after_two)
    assert not archive.exists() and len(list(tmp_path.glob(".again.tar.gz.part*.jsonl"))) == 1
    again = plan_submission(planner, dataset, "test", "ar-jump", {}, metadata, archive, settings)
    assert again.resumed == 2 and again.frames == 3
    assert archive.read_bytes() == (tmp_path / "whole.tar.gz").read_bytes()  # deterministic gzip, same predictions
    assert not list(tmp_path.glob(".*.jsonl"))  # the journal is gone once the archive is written


def test_frames_without_a_future_are_evaluated_on_what_exists_and_never_trained_on(converted, tmp_path):
    from fastddrive.core.sample import SampleError
    from fastddrive.data.dataset import check_row_numbers

    out, _, _ = converted
    result = CliRunner().invoke(app, ["eval", "--data", str(out), "--split", "test", "--decoders", "ar-jump"])
    assert result.exit_code == 0, result.output  # no future, no raters: nothing to score, nothing fails
    row = DrivingDataset.open(out).table("test").to_pylist()[0]
    with pytest.raises(SampleError, match="no logged future"):
        check_row_numbers(row)


def _shard_records(root: Path) -> dict:
    return DrivingDataset.open(root).manifest["shards"]


def test_workers_give_the_one_process_result_and_an_interrupted_conversion_resumes_to_it(raw, tmp_path, monkeypatch):
    from fastddrive.data import wod_raw

    root, _ = raw
    one = convert_wod_e2e(root, tmp_path / "one", workers=1)
    two = convert_wod_e2e(root, tmp_path / "two", workers=2)
    assert (one.samples, [str(f) for f in one.failures]) == (two.samples, [str(f) for f in two.failures])
    assert _shard_records(tmp_path / "one") == _shard_records(tmp_path / "two")  # byte for byte the same shards

    real, converted = wod_raw.convert_file, []

    def stops_after_one_file(*args):
        if converted:
            raise KeyboardInterrupt  # as a user's Ctrl-C between two files
        converted.append(args[1])
        return real(*args)

    monkeypatch.setattr(wod_raw, "convert_file", stops_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        convert_wod_e2e(root, tmp_path / "resumed", workers=1)
    kept = _shard_records(tmp_path / "resumed")
    assert kept and set(kept) < set(_shard_records(tmp_path / "one"))  # the finished file is recorded
    monkeypatch.setattr(wod_raw, "convert_file", real)
    counted = []
    again = convert_wod_e2e(root, tmp_path / "resumed", workers=1, on_item=counted.append, on_total=counted.append)
    assert again.samples == one.samples and _shard_records(tmp_path / "resumed") == _shard_records(tmp_path / "one")
    assert counted[0] == 9 and sum(counted[1:]) == 9  # the total counted from the headers, then every record
    assert [str(f) for f in again.failures] == [str(f) for f in one.failures]
