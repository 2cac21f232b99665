"""Damaged datasets are named, repaired and verified; an interrupted build loses no metadata (issue 16, 2 and 5)."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.data import build, episodes
from fastddrive.data.dataset import MANIFEST, DatasetError, DrivingDataset, ShardError, write_shard
from fastddrive.data.verify import verify_dataset

SEED = 21
EPISODES = 3  # train/00000, test/00001 (with raters), train/00002
SCENARIOS = ["merge"]
DAMAGED = "train/00002-merge-2100002.parquet"  # the second train shard: the first one reads before it
DAMAGES = {"truncated": "is truncated", "deleted": "is missing", "corrupted": "fails its checksum"}


def _build(out: Path, **kwargs) -> build.BuildReport:
    return build.build_dataset(out, EPISODES, SEED, SCENARIOS, **kwargs)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.parquet"))}


def _manifest(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text())


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "deleted":
        path.unlink()
    else:  # same size, a few bytes in the middle changed
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 8]) + data[middle + 8 :])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An intact, uninterrupted build."""
    out = tmp_path_factory.mktemp("integrity") / "reference"
    report = _build(out)
    assert not report.failed and report.skipped == 0
    return out


@pytest.fixture
def copy(reference, tmp_path) -> Path:
    return Path(shutil.copytree(reference, tmp_path / "copy"))


def test_the_manifest_records_every_shard_with_its_size_checksum_and_samples(reference):
    import hashlib

    manifest = _manifest(reference)
    assert manifest["version"] == build.MANIFEST_VERSION and manifest["complete"] is True
    files = _files(reference)
    assert sorted(manifest["shards"]) == sorted(files) == sorted(episodes.planned_shards(manifest["settings"]))
    dataset = DrivingDataset.open(reference)
    for shard, data in files.items():
        record = manifest["shards"][shard]
        assert record["bytes"] == len(data)
        assert record["sha256"] == hashlib.sha256(data).hexdigest()
        split = shard.split("/")[0]
        assert sum(record["samples"] for s, record in manifest["shards"].items() if s.startswith(split)) == len(
            dataset.table(split, columns=["sample_id"])
        )
    assert sorted(manifest["end_reasons"]) == ["00000-merge", "00001-merge", "00002-merge"]
    assert not list(reference.rglob(".*tmp*"))  # no temporary file left behind


READERS = {
    "shards": lambda d: d.shards("train"),
    "table": lambda d: d.table("train"),
    "table columns": lambda d: d.table("train", columns=["scenario", "command"]),
    "samples": lambda d: list(d.samples("train")),
    "sample": lambda d: d.sample("train", 0),
    "len": len,
}
SIZE_ONLY = {"shards", "len"}  # checks presence and size, not the checksum


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("reader", READERS)
def test_every_reader_names_the_damaged_shard(copy, how, reader):
    damage(copy / DAMAGED, how)
    dataset = DrivingDataset.open(copy)
    if how == "corrupted" and reader in SIZE_ONLY:
        READERS[reader](dataset)  # same size: found when the shard is read
        return
    with pytest.raises(ShardError, match=DAMAGES[how]) as caught:
        READERS[reader](dataset)
    assert caught.value.shard == DAMAGED and DAMAGED in str(caught.value)
    assert "data highway" in str(caught.value)  # says how to repair it
    assert isinstance(caught.value, DatasetError)
    # The intact split still reads.
    assert len(dataset.table("test")) == _manifest(copy)["shards"]["test/00001-merge-2100001.parquet"]["samples"]


def test_a_shard_damaged_after_it_was_read_is_caught_on_the_next_read(copy):
    dataset = DrivingDataset.open(copy)
    before = dataset.table("train")
    damage(copy / DAMAGED, "corrupted")
    with pytest.raises(ShardError, match="fails its checksum"):
        dataset.table("train")
    assert before.num_rows > 0


@pytest.mark.parametrize("how", DAMAGES)
def test_data_stats_and_show_name_the_shard_in_one_line(copy, how):
    damage(copy / DAMAGED, how)
    runner = CliRunner()
    for args in (["data", "stats", str(copy)], ["data", "show", str(copy), "--split", "train"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert DAMAGED in result.output and DAMAGES[how] in result.output
        assert "Traceback" not in result.output and "ArrowInvalid" not in result.output


def _legacy(root: Path) -> None:
    """Make `root` look written before shards were recorded (version 1, no shard records)."""
    manifest = _manifest(root)
    del manifest["shards"]
    (root / MANIFEST).write_text(json.dumps({**manifest, "version": 1}, indent=2))


def test_a_dataset_from_before_shard_records_reads_and_names_bad_shards(copy, reference):
    _legacy(copy)
    dataset = DrivingDataset.open(copy)
    assert dataset.records is None
    assert len(dataset) == len(DrivingDataset.open(reference))
    assert dataset.table("train").equals(DrivingDataset.open(reference).table("train"))
    assert verify_dataset(copy).ok and not verify_dataset(copy).recorded

    damage(copy / DAMAGED, "truncated")
    with pytest.raises(ShardError, match="is not a readable parquet file") as caught:
        DrivingDataset.open(copy).table("train")
    assert caught.value.shard == DAMAGED
    damage(copy / DAMAGED, "deleted")  # a complete simulator dataset lists its shards by its settings
    for reader in ("shards", "table", "samples", "len"):
        with pytest.raises(ShardError, match="is missing"):
            READERS[reader](DrivingDataset.open(copy))


@pytest.mark.parametrize("how", DAMAGES)
def test_data_highway_rebuilds_exactly_the_damaged_shard_byte_for_byte(copy, reference, how):
    damage(copy / DAMAGED, how)
    problems = []
    report = _build(copy, on_problem=problems.append)
    assert report.skipped == EPISODES - 1 and not report.failed
    assert len(report.repaired) == 1 and report.repaired[0].startswith(DAMAGED) and DAMAGES[how] in problems[0]
    assert _files(copy) == _files(reference)
    assert _manifest(copy) == _manifest(reference)
    assert verify_dataset(copy).ok


def test_data_highway_rebuilds_a_deleted_shard_of_a_dataset_from_before_shard_records(copy, reference):
    _legacy(copy)
    damage(copy / DAMAGED, "deleted")
    report = _build(copy)
    assert report.repaired == [f"{DAMAGED} is missing"] and report.skipped == EPISODES - 1
    assert _files(copy) == _files(reference)
    assert _manifest(copy) == _manifest(reference)  # the intact shards are recorded too


def test_an_intact_complete_dataset_is_still_refused_and_left_untouched(copy):
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in copy.rglob("*") if p.is_file()}
    with pytest.raises(build.OutputExists, match="already holds this complete dataset"):
        _build(copy)
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in copy.rglob("*") if p.is_file()} == before


def test_a_shard_whose_rebuild_fails_is_still_named(copy, monkeypatch):
    from fastddrive.data import highway

    def broken(*args, **kwargs):
        raise RuntimeError("simulator exploded")

    damage(copy / DAMAGED, "deleted")
    monkeypatch.setattr(highway, "simulate_episode", broken)
    report = _build(copy)
    assert [r.job.shard for r in report.failed] == [DAMAGED]
    assert _manifest(copy)["complete"] is False
    with pytest.raises(ShardError, match="is missing"):  # its record stays: never skipped
        DrivingDataset.open(copy).table("train")


def test_a_shard_file_the_dataset_does_not_plan_is_refused_by_the_build(copy):
    shutil.copy(copy / DAMAGED, copy / "train" / "stray.parquet")
    with pytest.raises(build.OutputExists, match="does not plan.*train/stray.parquet"):
        _build(copy)
    with pytest.raises(ShardError, match="is not recorded in the manifest"):
        DrivingDataset.open(copy).table("train")


class Stop:
    """An on_episode callback that interrupts the build after `after` episodes, as Ctrl-C does."""

    def __init__(self, after: int) -> None:
        self.after, self.seen = after, []

    def __call__(self, result: build.EpisodeResult) -> None:
        self.seen.append(result.job.shard)
        if len(self.seen) >= self.after:
            raise KeyboardInterrupt


def _assert_every_written_episode_is_recorded(out: Path) -> None:
    manifest = _manifest(out)
    assert manifest["complete"] is False
    assert sorted(manifest["shards"]) == sorted(_files(out))  # no shard without its record
    keys = {Path(s).name.rsplit("-", 1)[0] for s in manifest["shards"]}
    assert set(manifest["end_reasons"]) == keys and manifest["episodes_written"] == len(keys)
    report = verify_dataset(out)
    assert not report.problems and not report.ok and len(report.pending) == EPISODES - len(keys)


@pytest.mark.parametrize("workers", [1, 2])
def test_an_interrupted_and_resumed_build_gives_the_uninterrupted_manifest(reference, tmp_path, workers):
    out = tmp_path / "interrupted"
    stop = Stop(after=1)
    with pytest.raises(KeyboardInterrupt):
        _build(out, workers=workers, on_episode=stop)
    _assert_every_written_episode_is_recorded(out)
    written = len(_manifest(out)["shards"])
    assert written >= 1 and stop.seen[0] in _manifest(out)["shards"]
    DrivingDataset.open(out).table("train" if stop.seen[0].startswith("train") else "test")  # what is there reads

    report = _build(out, workers=workers)
    assert report.skipped == written and not report.repaired
    assert _manifest(out) == _manifest(reference)
    assert (out / MANIFEST).read_bytes() == (reference / MANIFEST).read_bytes()
    assert _files(out) == _files(reference)


def test_a_build_interrupted_before_metadata_was_recorded_is_made_whole(copy, reference):
    """Datasets left by the old build lost the end reasons of the episodes written before an interrupt."""
    _legacy(copy)
    manifest = _manifest(copy)
    del manifest["end_reasons"]["00000-merge"]
    (copy / MANIFEST).write_text(json.dumps({**manifest, "complete": False}))
    assert verify_dataset(copy).missing_metadata == ("00000-merge",)
    report = _build(copy)
    assert report.repaired == ["train/00000-merge-2100000.parquet has no recorded end reason"]
    assert _manifest(copy) == _manifest(reference) and _files(copy) == _files(reference)


def test_verify_reports_every_state(copy, reference):
    intact = verify_dataset(reference)
    assert intact.ok and intact.complete and intact.recorded and intact.checksums
    assert [intact.splits[s].count("ok") for s in ("train", "val", "test")] == [2, 0, 1]
    assert intact.samples == len(DrivingDataset.open(reference)) and not intact.problems

    damage(copy / "train/00000-merge-2100000.parquet", "truncated")
    damage(copy / "test/00001-merge-2100001.parquet", "deleted")
    damage(copy / DAMAGED, "corrupted")
    shutil.copy(copy / DAMAGED, copy / "train" / "stray.parquet")
    report = verify_dataset(copy)
    states = {c.shard: c.state for c in report.shards}
    assert states == {
        "train/00000-merge-2100000.parquet": "damaged",
        DAMAGED: "damaged",
        "train/stray.parquet": "unrecorded",
        "test/00001-merge-2100001.parquet": "missing",
    }
    assert not report.ok and report.complete and report.samples == 0
    assert report.splits["train"].count("damaged") == 2 and report.splits["test"].count("missing") == 1
    problems = "\n".join(report.problems)
    for needle in ("is truncated", "fails its checksum", "is missing", "is not recorded in the manifest"):
        assert needle in problems
    as_json = json.loads(json.dumps(report.to_dict()))
    assert as_json["ok"] is False and as_json["splits"]["train"]["damaged"] == 2

    quick = verify_dataset(copy, checksums=False)  # presence and size only: the same-size corruption passes
    assert {c.shard: c.state for c in quick.shards}[DAMAGED] == "ok" and not quick.checksums


def test_verify_reports_an_unfinished_build_and_refuses_a_non_dataset(tmp_path):
    with pytest.raises(DatasetError, match="not a fastddrive dataset"):
        verify_dataset(tmp_path)
    out = tmp_path / "partial"
    with pytest.raises(KeyboardInterrupt):
        _build(out, on_episode=Stop(after=1))
    report = verify_dataset(out)
    assert not report.ok and not report.complete and not report.problems
    assert report.pending == ("test/00001-merge-2100001.parquet", DAMAGED)
    assert report.splits["train"].count("ok") == 1


def test_converters_manifests_record_their_shards_too(reference, tmp_path):
    """wod-e2e and nuscenes write their shards, then the manifest (build.write_manifest records them)."""
    root = tmp_path / "converted"
    samples = list(DrivingDataset.open(reference).samples("test"))
    record = write_shard(root / "test" / "a.parquet", samples)
    build.write_manifest(root, {"source": "test"}, complete=True, counts={})
    assert _manifest(root)["shards"] == {"test/a.parquet": record}
    assert verify_dataset(root).ok
    damage(root / "test" / "a.parquet", "corrupted")
    with pytest.raises(ShardError, match="test/a.parquet fails its checksum") as caught:
        list(DrivingDataset.open(root).samples("test"))
    assert "make the dataset again" in str(caught.value)


def test_the_verify_report_reads_as_lines(copy):
    assert verify_dataset(copy).lines()[-1].startswith("ok: ")
    damage(copy / DAMAGED, "truncated")
    lines = verify_dataset(copy).lines()
    assert f"problem: {DAMAGED} is truncated" in "\n".join(lines)
    assert (
        any(line.startswith("train: 2 shard(s): 1 ok, 1 damaged; ") for line in lines)
        and lines[-1] == "not ok: 1 problem(s)"
    )
