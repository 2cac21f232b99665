"""Property-based tests over data set manifests and shard records (issue 32): whatever bytes, JSON values or
shapes a manifest holds, opening, verifying and reading the data set either works or raises one DatasetError
of one line; never another exception."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fastddrive.core.sample import CameraView, DrivingSample
from fastddrive.core.schema import example_response
from fastddrive.data import build
from fastddrive.data.build import EpisodeResult
from fastddrive.data.dataset import MANIFEST, SPLITS, DatasetError, DrivingDataset, write_shard
from fastddrive.data.episodes import EpisodeJob
from fastddrive.data.verify import unfinished, verify_dataset

FUZZ = settings(max_examples=120, deadline=None, derandomize=True)


def _episode(root: str, job: EpisodeJob) -> EpisodeResult:
    """A stand-in for the simulator: one tiny sample per episode."""
    sample = DrivingSample(
        sample_id=f"s-{job.seed}",
        scenario=job.scenario,
        episode_seed=job.seed,
        time_s=3.0,
        image=np.zeros((28, 28, 3), dtype=np.uint8),
        history=np.zeros((7, 6)),
        command="go_straight",
        future=np.stack([np.arange(1, 21) * 1.0, np.zeros(20)], axis=1),
        future_time_s=np.arange(1, 21) * 0.25,
        response=example_response(),
        view=CameraView(5.5, (14.0, 14.0), 0.0),
    )
    return EpisodeResult(job, 1, 0.0, "duration", record=write_shard(Path(root) / job.shard, [sample]))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "dataset"
    build.build_dataset(out, 3, 1, ["merge"], rater_splits=(), episode=_episode)
    return out


@pytest.fixture(scope="module")
def manifest(root) -> dict:
    return json.loads((root / MANIFEST).read_text())


def _opens_or_names_the_problem(root: Path) -> None:
    """Everything a command does with a data set: it works, or one DatasetError of one line."""
    try:
        dataset = DrivingDataset.open(root)
        report = verify_dataset(root)
        json.dumps(report.to_dict())
        report.lines()
        unfinished(dataset)
        for split in SPLITS:
            dataset.table(split, columns=["sample_id"])
        len(dataset)
    except DatasetError as err:
        message = str(err)
        assert message.strip() and "\n" not in message, message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=16,
)


@FUZZ
@given(data=st.binary(max_size=300))
@example(data=b"\xff\xfe{}")
@example(data=b"[" * 100_000)
@example(data=b"1" * 5_000)
@example(data=b'{"format": "fastddrive-driving-samples", "version": 2, "settings": {}, "complete": NaN}')
def test_any_bytes_as_a_manifest(root, manifest, data):
    (root / MANIFEST).write_bytes(data)
    _opens_or_names_the_problem(root)


@FUZZ
@given(value=json_values)
def test_any_json_value_as_a_manifest(root, manifest, value):
    (root / MANIFEST).write_text(json.dumps(value))
    _opens_or_names_the_problem(root)


KEYS = [
    ("format",),
    ("version",),
    ("settings",),
    ("complete",),
    ("shards",),
    ("end_reasons",),
    ("episodes_written",),
    ("settings", "source"),
    ("settings", "episodes"),
    ("settings", "seed"),
    ("settings", "scenarios"),
]


@FUZZ
@given(key=st.sampled_from(KEYS), value=json_values, drop=st.booleans())
@example(key=("version",), value=1, drop=False)
@example(key=("settings", "seed"), value=2**70, drop=False)
@example(key=("settings", "episodes"), value=10**6, drop=False)
def test_any_key_of_a_manifest_replaced_or_dropped(root, manifest, key, value, drop):
    changed = copy.deepcopy(manifest)
    parent = changed if len(key) == 1 else changed[key[0]]
    if drop:
        parent.pop(key[-1], None)
    else:
        parent[key[-1]] = value
    (root / MANIFEST).write_text(json.dumps(changed))
    _opens_or_names_the_problem(root)


def _records(manifest: dict) -> st.SearchStrategy:
    names = st.sampled_from(sorted(manifest["shards"])) | st.text(max_size=30)
    fields = st.fixed_dictionaries(
        {},
        optional={
            "bytes": st.integers(-2, 10**6) | json_values,
            "samples": st.integers(-2, 5) | json_values,
            "sha256": st.sampled_from([r["sha256"] for r in manifest["shards"].values()])
            | st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
            | json_values,
        },
    )
    return st.dictionaries(names, fields | json_values, max_size=5)


@FUZZ
@given(data=st.data())
def test_any_shard_records(root, manifest, data):
    changed = {**manifest, "shards": data.draw(_records(manifest))}
    (root / MANIFEST).write_text(json.dumps(changed))
    _opens_or_names_the_problem(root)


@FUZZ
@given(data=st.data())
def test_a_real_record_with_one_field_changed(root, manifest, data):
    shard = data.draw(st.sampled_from(sorted(manifest["shards"])))
    field = data.draw(st.sampled_from(["bytes", "samples", "sha256"]))
    changed = copy.deepcopy(manifest)
    changed["shards"][shard][field] = data.draw(st.integers(-1, 10**4) | json_values)
    (root / MANIFEST).write_text(json.dumps(changed))
    _opens_or_names_the_problem(root)
