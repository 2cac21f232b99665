"""Data commands never destroy their inputs, name damaged files, say when a data set is incomplete, survive a
killed worker and refuse out-of-range settings before any work (issue 32).

The builds here run a stand-in for the simulator (`quick_episode`: two tiny samples per episode, the same for
the same job), so that they take moments; worker processes import it from this module by name.
"""

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from fastddrive.core.sample import CameraView, DrivingSample
from fastddrive.core.schema import example_response
from fastddrive.data import build, episodes
from fastddrive.data.build import EpisodeResult
from fastddrive.data.dataset import MANIFEST, DrivingDataset, write_shard
from fastddrive.data.episodes import EpisodeJob

EPISODES = 3  # merge: train/00000, test/00001, train/00002
SEED = 7
DIES = 1  # the episode whose worker process is killed


def _samples(job: EpisodeJob) -> list[DrivingSample]:
    return [
        DrivingSample(
            sample_id=f"{job.scenario}-{job.seed}-{k:03d}s",
            scenario=job.scenario,
            episode_seed=job.seed,
            time_s=3.0 + k,
            image=np.full((28, 84, 3), (job.seed + k) % 256, dtype=np.uint8),
            history=np.zeros((7, 6)),
            command="go_straight",
            future=np.stack([np.arange(1, 21) * (1.0 + k), np.zeros(20)], axis=1),
            future_time_s=np.arange(1, 21) * 0.25,
            response=example_response(),
            view=CameraView(5.5, (42.0, 14.0), 0.0),
        )
        for k in range(2)
    ]


def quick_episode(root: str, job: EpisodeJob) -> EpisodeResult:
    """A stand-in for the simulator: two samples per episode, byte for byte the same for the same job."""
    record = write_shard(Path(root) / job.shard, _samples(job))
    return EpisodeResult(job, 2, 0.0, "duration", record=record)


def dying_episode(root: str, job: EpisodeJob) -> EpisodeResult:
    """Episode DIES kills its own process, as the kernel's out-of-memory killer would."""
    if job.index == DIES:
        os.kill(os.getpid(), signal.SIGKILL)
    return quick_episode(root, job)


def failing_episode(root: str, job: EpisodeJob) -> EpisodeResult:
    if job.index == DIES:
        return EpisodeResult(job, 0, 0.0, error="RuntimeError: simulator exploded")
    return quick_episode(root, job)


def _build(out: Path, seed: int = SEED, **kwargs) -> build.BuildReport:
    kwargs.setdefault("episode", quick_episode)
    return build.build_dataset(out, EPISODES, seed, ["merge"], rater_splits=(), **kwargs)


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` (hidden ones too) by relative path, with its sha256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _run(*args):
    from typer.testing import CliRunner

    from fastddrive.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _refused(result, *needles: str) -> str:
    """The command exited 2 with one line that holds every needle."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("safety") / "reference"
    report = _build(out)
    assert report.complete and not report.failed
    return out


@pytest.fixture
def dataset(reference, tmp_path) -> Path:
    return Path(shutil.copytree(reference, tmp_path / "dataset"))


# --- outputs never destroy inputs ----------------------------------------------------------------------------


def _inputs(tmp_path: Path, dataset: Path) -> dict[str, Path]:
    src = tmp_path / "release"
    src.mkdir()
    (src / "validation.json").write_text("[]")
    dataroot = tmp_path / "nuscenes"
    (dataroot / "v1.0-mini").mkdir(parents=True)
    (dataroot / "v1.0-mini" / "scene.json").write_text("[]")
    other = Path(shutil.copytree(dataset, tmp_path / "other"))
    return {"ds": dataset, "src": src, "root": dataroot, "other": other}


WRITERS_AT_THEIR_INPUTS = {
    "verify --json onto the manifest": (lambda p: ["data", "verify", p["ds"], "--json", p["ds"] / MANIFEST], "input"),
    "stats --json onto the manifest": (lambda p: ["data", "stats", p["ds"], "--json", p["ds"] / MANIFEST], "input"),
    "stats --json into another data set": (
        lambda p: ["data", "stats", p["ds"], "--json", p["other"] / "train" / "figures.json"],
        "inside the data set",
    ),
    "show --png with a parquet name": (lambda p: ["data", "show", p["ds"], "--png", p["src"] / "x.parquet"], ".png"),
    "show --png into the data set": (
        lambda p: ["data", "show", p["ds"], "--png", p["ds"] / "train" / "x.png"],
        "input",
    ),
    "export --out its --data (wod-e2e)": (
        lambda p: ["data", "export", "--data", p["ds"], "--out", p["ds"], "--format", "wod-e2e", "--overwrite"],
        "input",
    ),
    "export --out its --data (nuscenes)": (
        lambda p: ["data", "export", "--data", p["ds"], "--out", p["ds"], "--format", "nuscenes", "--overwrite"],
        "input",
    ),
    "export --out inside its --data": (
        lambda p: ["data", "export", "--data", p["ds"], "--out", p["ds"] / "train", "--format", "wod-e2e"],
        "input",
    ),
    "wod-e2e --out its --src": (
        lambda p: ["data", "wod-e2e", "--src", p["src"], "--out", p["src"], "--overwrite"],
        "input",
    ),
    "wod-e2e --out inside its --src": (
        lambda p: ["data", "wod-e2e", "--src", p["src"], "--out", p["src"] / "converted"],
        "input",
    ),
    "wod-e2e --out its --image-root": (
        lambda p: ["data", "wod-e2e", "--src", p["src"], "--image-root", p["ds"], "--out", p["ds"], "--overwrite"],
        "input",
    ),
    "nuscenes --out its --dataroot": (
        lambda p: ["data", "nuscenes", "--dataroot", p["root"], "--out", p["root"], "--overwrite"],
        "input",
    ),
    "nuscenes --out inside its --dataroot": (
        lambda p: ["data", "nuscenes", "--dataroot", p["root"], "--out", p["root"] / "converted"],
        "input",
    ),
    "highway --out inside a data set": (
        lambda p: ["data", "highway", "--out", p["ds"] / "train" / "more", "--episodes", 1],
        "inside the data set",
    ),
    "highway --out a data set's manifest": (
        lambda p: ["data", "highway", "--out", p["ds"] / MANIFEST, "--overwrite"],
        "is a file",
    ),
}


@pytest.mark.parametrize("case", WRITERS_AT_THEIR_INPUTS)
def test_a_writer_pointed_at_its_own_inputs_is_refused_and_they_stay_as_they_were(dataset, tmp_path, case):
    paths = _inputs(tmp_path, dataset)
    before = {name: _tree(path) for name, path in paths.items()}
    beside = sorted(tmp_path.iterdir())
    args, needle = WRITERS_AT_THEIR_INPUTS[case]
    _refused(_run(*args(paths)), needle)
    assert {name: _tree(path) for name, path in paths.items()} == before
    assert sorted(tmp_path.iterdir()) == beside  # no staging folder or report left beside them


# --- damaged manifests are named -----------------------------------------------------------------------------


def _edit(root: Path, change) -> None:
    manifest = json.loads((root / MANIFEST).read_text())
    change(manifest)
    (root / MANIFEST).write_text(json.dumps(manifest))


DAMAGED_MANIFESTS = {
    "not UTF-8": (lambda root: (root / MANIFEST).write_bytes(b'{"format": "\xff\xfe"}'), "not UTF-8"),
    "settings a list": (lambda root: _edit(root, lambda m: m.update(settings=[1, 2])), "'settings' is a list"),
    "complete a string": (lambda root: _edit(root, lambda m: m.update(complete="yes")), "'complete' is 'yes'"),
    "version 2 without shards": (lambda root: _edit(root, lambda m: m.pop("shards")), "'shards' record"),
    "no version": (lambda root: _edit(root, lambda m: m.pop("version")), "no 'version'"),
    "a shard record without its checksum": (
        lambda root: _edit(root, lambda m: next(iter(m["shards"].values())).pop("sha256")),
        ".sha256 is None",
    ),
    "a shard outside the splits": (
        lambda root: _edit(root, lambda m: m["shards"].update({"../x.parquet": {"bytes": 1, "sha256": "0" * 64}})),
        "is not a shard name",
    ),
    "episodes a string": (
        lambda root: _edit(root, lambda m: m["settings"].update(episodes="3")),
        "'settings.episodes' is '3'",
    ),
}


@pytest.mark.parametrize("damage", DAMAGED_MANIFESTS)
def test_a_damaged_manifest_is_named_in_one_line_by_every_command(dataset, damage):
    make, needle = DAMAGED_MANIFESTS[damage]
    make(dataset)
    before = _tree(dataset)
    for args in (["show", dataset], ["stats", dataset], ["verify", dataset]):
        _refused(_run("data", *args), f"{dataset / MANIFEST} is damaged", needle)
    line = _refused(_run("data", "highway", "--out", dataset, "--episodes", EPISODES, "--seed", SEED))
    assert "damaged dataset" in line and "--overwrite" in line and "rerun" not in line
    assert _tree(dataset) == before


def test_a_flipped_shard_of_a_manifest_stripped_of_its_records_is_not_read_silently(dataset):
    """Read as a pre-checksum data set, a flipped byte would change sample values without a word."""
    _edit(dataset, lambda m: m.pop("shards"))
    shard = dataset / "test" / "00001-merge-700001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    _refused(_run("data", "show", dataset), "'shards' record of the shards is missing")


def test_a_version_1_data_set_still_reads(dataset, reference):
    _edit(dataset, lambda m: (m.pop("shards"), m.update(version=1)))
    assert DrivingDataset.open(dataset).table("train").equals(DrivingDataset.open(reference).table("train"))
    result = _run("data", "verify", dataset)
    assert result.exit_code == 0 and "written before shards were recorded" in result.output


def test_a_newer_manifest_asks_for_a_newer_fastddrive(dataset):
    _edit(dataset, lambda m: m.update(version=build.MANIFEST_VERSION + 1))
    _refused(_run("data", "show", dataset), "newer than this fastddrive reads", "upgrade")


# --- incomplete data sets are said to be so -------------------------------------------------------------------


class Stop:
    """An on_episode callback that interrupts after the first episode, as Ctrl-C does."""

    def __call__(self, result: EpisodeResult) -> None:
        raise KeyboardInterrupt


def test_stats_and_verify_say_an_interrupted_data_set_is_incomplete(tmp_path):
    out = tmp_path / "partial"
    with pytest.raises(KeyboardInterrupt):
        _build(out, on_episode=Stop())
    figures = tmp_path / "figures.json"
    result = _run("data", "stats", out, "--json", figures)
    assert result.exit_code == 0, result.output
    assert "incomplete data set: 1 of 3 planned episodes written" in result.output
    assert "(3 episodes)" not in result.output
    assert json.loads(figures.read_text())["complete"] is False
    verified = _run("data", "verify", out)
    assert verified.exit_code == 1 and "not complete" in verified.output and "pending: 2" in verified.output


def test_stats_and_verify_see_planned_shards_gone_from_a_manifest_marked_complete(dataset):
    shard = "train/00002-merge-700002.parquet"
    _edit(dataset, lambda m: m["shards"].pop(shard))
    (dataset / shard).unlink()
    result = _run("data", "stats", dataset)
    assert result.exit_code == 0 and "incomplete data set: 2 of 3 planned episodes written" in result.output
    verified = _run("data", "verify", dataset)
    assert verified.exit_code == 1 and f"problem: {shard} is missing" in verified.output


# --- --overwrite builds beside --out and swaps in only on success ---------------------------------------------


def test_an_interrupted_highway_overwrite_leaves_the_old_data_set_and_resumes_exactly(dataset, tmp_path):
    expected = tmp_path / "expected"
    _build(expected, seed=SEED + 1)
    before = _tree(dataset)
    with pytest.raises(KeyboardInterrupt):
        _build(dataset, seed=SEED + 1, overwrite=True, on_episode=Stop())
    assert _tree(dataset) == before
    staging = build.overwrite_staging(dataset)
    assert len(json.loads((staging / MANIFEST).read_text())["shards"]) == 1

    report = _build(dataset, seed=SEED + 1, overwrite=True)
    assert report.skipped == 1 and report.complete and report.staged is None
    assert _tree(dataset) == _tree(expected) and not staging.exists()


def test_a_highway_overwrite_with_a_failed_episode_keeps_the_old_data_set_until_a_rerun_completes(
    dataset, tmp_path, monkeypatch
):
    before = _tree(dataset)
    replace = ("data", "highway", "--out", dataset, "--episodes", EPISODES, "--seed", SEED + 1, "--scenarios", "merge")
    monkeypatch.setattr(build, "run_episode", failing_episode)
    result = _run(*replace, "--overwrite")
    assert result.exit_code == 1, result.output
    assert "simulator exploded" in result.output and f"{dataset} is unchanged" in result.output
    assert _tree(dataset) == before

    monkeypatch.setattr(build, "run_episode", quick_episode)
    result = _run(*replace, "--overwrite")
    assert result.exit_code == 0, result.output
    assert "resuming: 2 of 3 episodes already written" in result.output
    assert DrivingDataset.open(dataset).manifest["settings"]["seed"] == SEED + 1
    assert not build.overwrite_staging(dataset).exists()


def _release(root: Path, records: list) -> Path:
    root.mkdir()
    (root / "validation.json").write_text(json.dumps(records))
    return root


def test_a_wod_conversion_with_a_malformed_record_does_not_replace_a_complete_data_set(dataset, tmp_path):
    src = _release(tmp_path / "release", [{"sample_id": "broken"}])
    before = _tree(dataset)
    result = _run("data", "wod-e2e", "--src", src, "--out", dataset, "--overwrite")
    assert result.exit_code == 1, result.output
    assert "record broken" in result.output and f"{dataset} still holds the complete dataset" in result.output
    assert _tree(dataset) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset", "release"]  # nothing left beside it


def test_a_wod_conversion_replaces_a_data_set_once_it_converted_and_an_interrupted_one_leaves_nothing(
    dataset, tmp_path
):
    from fastddrive.data.wod_e2e import convert_wod_e2e, export_wod_e2e

    release = tmp_path / "release"
    export_wod_e2e(dataset, release, split="train")
    before = _tree(dataset)

    def interrupt(_: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_wod_e2e(release, dataset, overwrite=True, on_item=interrupt)
    assert _tree(dataset) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset", "release"]

    report = convert_wod_e2e(release, dataset, overwrite=True)
    assert report.samples["train"] == 4 and not report.kept
    assert DrivingDataset.open(dataset).manifest["settings"]["source"] == "wod-e2e"


def test_a_kill_leftover_staging_folder_is_removed_by_the_next_conversion(dataset, tmp_path):
    from fastddrive.data.wod_e2e import convert_wod_e2e, export_wod_e2e

    release = tmp_path / "release"
    export_wod_e2e(dataset, release, split="train")
    dead = tmp_path / ".converted.staging.tmp-999999999-0123abcd"  # a pid no process has
    (dead / "train").mkdir(parents=True)
    convert_wod_e2e(release, tmp_path / "converted")
    assert not dead.exists() and (tmp_path / "converted" / MANIFEST).is_file()


@pytest.mark.parametrize("fmt", ["wod-e2e", "nuscenes"])
def test_export_overwrite_replaces_an_earlier_export_and_a_failed_one_leaves_it(dataset, tmp_path, fmt):
    out = tmp_path / "exported"
    args = ("data", "export", "--data", dataset, "--out", out, "--format", fmt, "--split", "train")
    assert _run(*args).exit_code == 0
    earlier = _tree(out)
    assert _run(*args, "--overwrite").exit_code == 0
    assert _tree(out) == earlier  # the same export again

    shard = dataset / "train" / "00002-merge-700002.parquet"
    shard.write_bytes(shard.read_bytes()[:-9])
    _refused(_run(*args, "--overwrite"), "00002-merge-700002.parquet is truncated")
    assert _tree(out) == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset", "exported"]


def test_export_overwrite_deletes_nothing_but_an_earlier_export(dataset, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _refused(
        _run("data", "export", "--data", dataset, "--out", out, "--format", "nuscenes", "--overwrite"),
        "notes.txt",
        "refusing to delete it",
    )
    assert (out / "notes.txt").read_text() == "mine"


# --- a killed worker is reported, the others complete, a rerun resumes -----------------------------------------


def test_a_killed_worker_fails_its_episode_the_others_complete_and_a_rerun_resumes(reference, tmp_path):
    out = tmp_path / "killed"
    report = _build(out, workers=2, episode=dying_episode)
    assert [r.job.index for r in report.failed] == [DIES]
    assert report.failed[0].error == f"{build.WORKER_DIED} (killed by SIGKILL, as the out-of-memory killer does)"
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] is False and len(manifest["shards"]) == EPISODES - 1

    again = _build(out, workers=2)
    assert again.skipped == EPISODES - 1 and again.complete
    assert _tree(out) == _tree(reference)


def test_the_cli_names_the_episode_of_a_killed_worker_and_exits_non_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "run_episode", dying_episode)
    out = tmp_path / "killed"
    result = _run(
        "data", "highway", "--out", out, "--episodes", EPISODES, "--seed", SEED, "--scenarios", "merge", "--workers", 2
    )
    assert result.exit_code == 1, result.output
    assert f"episode {DIES} (merge, test/00001-merge-700001.parquet) failed: its worker process died" in result.output
    assert "Traceback" not in result.output and "BrokenProcessPool" not in result.output
    assert len(DrivingDataset.open(out).records) == EPISODES - 1


def test_what_killed_writers_leave_is_no_shard_and_is_removed_on_resume(dataset):
    leftover = dataset / "train" / ".00002-merge-700002.tmp.tmp-999999999-0123abcd.parquet"
    leftover.write_bytes(b"half a shard")
    assert DrivingDataset.open(dataset).table("train").num_rows == 4
    result = _run("data", "verify", dataset)
    assert result.exit_code == 0, result.output
    _edit(dataset, lambda m: m.update(complete=False))
    assert _build(dataset).skipped == EPISODES and not leftover.exists()


# --- settings out of range are refused before any work -----------------------------------------------------------


OUT_OF_RANGE = {
    "--seed": (-1, episodes.MAX_SEED + 1, 2**64),
    "--episodes": (0, episodes.MAX_EPISODES + 1),
    "--workers": (0, build.max_workers() + 1),
}


@pytest.mark.parametrize(("option", "value"), [(o, v) for o, values in OUT_OF_RANGE.items() for v in values])
def test_an_out_of_range_setting_is_refused_in_one_line_before_anything_is_simulated(tmp_path, option, value):
    out = tmp_path / "never"
    line = _refused(_run("data", "highway", "--out", out, option, value), f"{option} {value} is out of range: give")
    assert "rerun" not in line
    assert not out.exists()


def test_the_largest_seed_gives_episode_seeds_a_shard_stores(tmp_path):
    jobs = episodes.plan_episodes(episodes.MAX_EPISODES, episodes.MAX_SEED, ["merge"])
    assert jobs[-1].seed == episodes.MAX_SEED * episodes.SEED_STRIDE + episodes.MAX_EPISODES - 1 < 2**63
    write_shard(tmp_path / "x.parquet", _samples(jobs[-1]))
    with pytest.raises(build.DataSettingsError):
        episodes.plan_episodes(1, episodes.MAX_SEED + 1, ["merge"])


def test_stats_refuses_an_unknown_scaffold_tokenization_in_one_line(dataset):
    _refused(_run("data", "stats", dataset, "--scaffold-tokenization", "words"), "'words'", "pieces, runs")
