"""Training, tokenizer and trajectory commands refuse bad settings and destinations before writing anything, stop
at the first non-finite loss keeping the last good checkpoint, and resume only from verified checkpoints of the
same data set and config (issue 32)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import fastddrive
import fastddrive.train.loop as loop
from fastddrive.cli import app
from fastddrive.core.memory import MemoryBudgetError
from fastddrive.core.outputs import OutputError
from fastddrive.core.tokenizer import load_tokenizer
from fastddrive.data.dataset import DATASET_FORMAT, MANIFEST, write_shard
from fastddrive.engine.model_files import model_path
from fastddrive.train.checkpoint import CHECKSUMS, CheckpointError, list_checkpoints, validate_checkpoint
from fastddrive.train.config import ConfigError, load_config
from fastddrive.train.loop import NonFiniteLoss, train
from model_fixtures import SMALL, synthetic_sample

QUICK = dict(
    validation_samples=1,
    log_every=1,
    checkpoint_every=2,
    validate_every=1000,
    warmup_steps=1,
    batch_size=1,
    image_max_pixels=56 * 56,
)


def _dataset(root, seeds):
    shard = "train/00000-synthetic.parquet"
    record = write_shard(root / shard, [synthetic_sample(s) for s in seeds])
    manifest = {"format": DATASET_FORMAT, "version": 2, "settings": {}, "complete": True, "shards": {shard: record}}
    (root / MANIFEST).write_text(json.dumps(manifest))
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _dataset(tmp_path_factory.mktemp("safety") / "a", range(4))


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    return _dataset(tmp_path_factory.mktemp("safety") / "b", range(4, 8))


def _config(data, out, **settings):
    return load_config(
        "tiny-ar", data=str(data), out=str(out), **({"steps": 4, "architecture": SMALL} | QUICK | settings)
    )


def _yaml(tmp_path, data, out, extra=""):
    path = tmp_path / "run.yaml"
    quick = "".join(f"{k}: {v}\n" for k, v in QUICK.items())
    path.write_text(
        f"name: safety\nrecipe: ar\ninit_from: scratch\ndata: {data}\nout: {out}\nsteps: 4\n{quick}"
        f"architecture: {json.dumps(SMALL)}\n{extra}"
    )
    return path


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _error_line(result):
    """The one line of the error a refused command printed."""
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


# --- the config, before anything is written ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("seed: -1", "seed must be an integer in [0, 4294967295], got -1"),
        ("alpha: .nan", "alpha must be a finite number in [0, 1000], got nan"),
        ("ar_weight: -1", "ar_weight must be a finite number in [0, 1000], got -1"),
        ("lr: 2", "lr must be a finite number in (0, 1], got 2"),
        ("batch_size: 100000", "batch_size must be an integer in [1, 4096], got 100000"),
        (
            "section_weights: {critical_objects: 1, explanation: 1, future_meta_behavior: 1, trajectory: .inf}",
            "section_weights.trajectory must be a finite number in [0, 1000], got inf",
        ),
        (
            "section_noise: {critical_objects: [1, 0], explanation: [1, 1], future_meta_behavior: [1, 1],"
            " trajectory: [1, 1]}",
            "section_noise.critical_objects.1 must be a finite number in (0, 1000], got 0",
        ),
    ],
)
def test_a_setting_out_of_its_range_is_named_before_anything_is_written(data, tmp_path, setting, message):
    out = tmp_path / "run"
    result = _invoke("train", "--config", _yaml(tmp_path, data, out, setting + "\n"))
    assert result.exit_code == 2 and message in _error_line(result)
    assert not out.exists()


def test_an_architecture_that_cannot_be_built_is_named(data, tmp_path):
    with pytest.raises(ConfigError, match=r"architecture.hidden_size must be an integer in \[8, 16384\], got -64"):
        _config(data, tmp_path / "run", architecture=SMALL | {"hidden_size": -64})
    with pytest.raises(ConfigError, match="must be heads \\(4\\) times an even head size"):
        _config(data, tmp_path / "run", architecture=SMALL | {"hidden_size": 66})


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    result = _invoke("train", "--config", path)
    assert result.exit_code == 2 and "bad.yaml is not UTF-8 text" in _error_line(result)


def test_what_does_not_fit_the_memory_budget_is_refused_before_anything_is_written(data, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDDRIVE_MEMORY_BUDGET", "256MiB")
    out = tmp_path / "run"
    with pytest.raises(MemoryBudgetError, match="training batch_size=4096 .* over the memory budget of 256.0 MiB"):
        train(_config(data, out, batch_size=4096))
    wide = SMALL | {"hidden_size": 4096, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate_size": 16384}
    with pytest.raises(MemoryBudgetError, match="parameters from scratch"):
        train(_config(data, out, architecture=wide, batch_size=1))
    assert not out.exists()


@pytest.mark.parametrize("where", ["a file", "the data set", "inside the data set", "the package", "a model folder"])
def test_out_must_be_a_folder_of_the_runs_own(data, tmp_path, where):
    model_folder = tmp_path / "model"
    model_folder.mkdir()
    (model_folder / "config.json").write_text("{}")
    (model_folder / "model.safetensors").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("keep me")
    out = {
        "a file": tmp_path / "notes.txt",
        "the data set": data,
        "inside the data set": data / "runs",
        "the package": model_path("default").parent / "runs",
        "a model folder": model_folder,
    }[where]
    before = sorted(p.name for p in data.rglob("*"))
    result = _invoke("train", "--config", _yaml(tmp_path, data, out))
    assert result.exit_code == 2 and f"out {out}" in _error_line(result)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in data.rglob("*")) == before
    assert not (model_path("default").parent / "runs").exists()


# --- a non-finite loss ------------------------------------------------------------------------------------------


def test_training_stops_at_the_first_non_finite_loss_keeping_the_last_good_checkpoint(data, tmp_path, monkeypatch):
    real = loop.samples_loss
    steps = []

    def poisoned(model, *args):
        parts = real(model, *args)
        if model.model.training:
            steps.append(1)
            if len(steps) == 3:
                parts.clean = parts.clean * float("nan")
                parts.total = parts.clean
        return parts

    monkeypatch.setattr(loop, "samples_loss", poisoned)
    out = tmp_path / "run"
    yaml = _yaml(tmp_path, data, out)
    result = _invoke("train", "--config", yaml)
    assert result.exit_code == 2
    line = _error_line(result)
    assert "training stopped at step 3: the clean loss is nan" in line and "checkpoint-000002, is kept" in line
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-000002"]
    assert not (out / "final").exists()
    kept = validate_checkpoint(out / "checkpoint-000002")
    assert all(torch.isfinite(t).all() for t in load_file(str(kept.path / "model.safetensors")).values())

    monkeypatch.setattr(loop, "samples_loss", real)
    said = []
    assert train(load_config(path=yaml), resume=True, say=said.append, stop_after=3).resumed_from == 2
    assert "resuming from checkpoint-000002 (step 2)" in said


def test_the_api_raises_a_typed_error_for_a_non_finite_loss(data, tmp_path, monkeypatch):
    real = loop.samples_loss

    def infinite(model, *args):
        parts = real(model, *args)
        parts.total = parts.total * float("inf")
        return parts

    monkeypatch.setattr(loop, "samples_loss", infinite)
    with pytest.raises(NonFiniteLoss, match="step 1: the loss is inf; .*no checkpoint had been written yet"):
        train(_config(data, tmp_path / "run"))
    assert list_checkpoints(tmp_path / "run") == []


# --- checkpoints: checksums, fingerprints, leftovers ------------------------------------------------------------


@pytest.fixture
def interrupted(data, tmp_path):
    """A run of 4 steps stopped after 2 (its one checkpoint: checkpoint-000002)."""
    config = _config(data, tmp_path / "run")
    train(config, stop_after=2)
    return config


def test_a_checkpoint_whose_weights_changed_on_disk_is_refused_and_the_previous_one_used(data, tmp_path):
    config = _config(data, tmp_path / "run", steps=6)
    train(config, stop_after=4)
    newest = list_checkpoints(tmp_path / "run")[-1]
    recorded = json.loads((newest / CHECKSUMS).read_text())["files"]
    assert {"model.safetensors", "optimizer.safetensors", "trainer_state.json", "config.json"} <= recorded.keys()
    weights = newest / "model.safetensors"
    data_bytes = bytearray(weights.read_bytes())
    data_bytes[-3] ^= 0x40  # one bit of one weight: the file still parses, its values differ
    weights.write_bytes(bytes(data_bytes))
    with pytest.raises(CheckpointError, match="checkpoint-000004 is corrupt: model.safetensors fails its checksum"):
        validate_checkpoint(newest)
    said = []
    report = train(config, resume=True, say=said.append, stop_after=3)
    assert report.resumed_from == 2
    assert any(s.startswith("checkpoint-000004 is corrupt: model.safetensors fails its checksum") for s in said)


def test_a_checkpoint_without_its_checksums_is_partial(interrupted, tmp_path):
    (tmp_path / "run" / "checkpoint-000002" / CHECKSUMS).unlink()
    with pytest.raises(CheckpointError, match="checkpoint-000002 is partial: checksums.json missing"):
        validate_checkpoint(tmp_path / "run" / "checkpoint-000002")


def test_resuming_on_another_data_set_needs_the_flag(interrupted, data, other_data, tmp_path):
    yaml = _yaml(tmp_path, data, tmp_path / "run")
    written = (tmp_path / "run" / "train_config.json").read_text()
    refused = _invoke("train", "--config", yaml, "--data", other_data, "--resume")
    assert refused.exit_code == 2
    line = _error_line(refused)
    assert "checkpoint-000002 differs from this run: it was trained on another data set than" in line
    assert "--resume-with-changes" in line
    assert (tmp_path / "run" / "train_config.json").read_text() == written  # nothing written
    help_text = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert "--resume-with-changes " in help_text and "the data set or the config differ" in help_text

    accepted = _invoke("train", "--config", yaml, "--data", other_data, "--resume-with-changes")
    assert accepted.exit_code == 0, accepted.output
    assert "with changes: it was trained on another data set" in accepted.output
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_resuming_with_another_config_is_refused_naming_the_setting(interrupted, data, tmp_path):
    with pytest.raises(ConfigError, match=r"differs from this run: lr was 0\.001, now 0\.002; pass --resume-with"):
        train(interrupted.model_copy(update={"lr": 0.002}), resume=True)
    moved = interrupted.model_copy(update={"log_every": 2, "keep_checkpoints": 3})  # reporting only: no change
    assert train(moved, resume=True, say=lambda _: None, stop_after=3).resumed_from == 2


def test_resuming_with_more_steps_trains_on_and_says_the_schedule_is_stretched(interrupted):
    said = []
    report = train(interrupted.model_copy(update={"steps": 6}), resume=True, say=said.append, stop_after=3)
    assert report.resumed_from == 2
    assert any("to 6 steps (it was a run of 4): the lr schedule is stretched" in s for s in said), said


def test_a_sample_whose_numbers_are_not_finite_is_named_before_anything_is_written(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastddrive.data.dataset import _SCHEMA, shard_record, to_row

    rows = [to_row(synthetic_sample(s)) for s in range(3)]
    rows[2]["history"] = [float("nan")] * len(rows[2]["history"])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=_SCHEMA), sink)
    shard, data_bytes = "train/00000-synthetic.parquet", sink.getvalue().to_pybytes()
    (tmp_path / "d" / "train").mkdir(parents=True)
    (tmp_path / "d" / shard).write_bytes(data_bytes)
    manifest = {"format": DATASET_FORMAT, "version": 2, "settings": {}, "complete": True}
    (tmp_path / "d" / MANIFEST).write_text(json.dumps(manifest | {"shards": {shard: shard_record(data_bytes, 3)}}))
    refused = _invoke("train", "--config", _yaml(tmp_path, tmp_path / "d", tmp_path / "run"))
    assert refused.exit_code == 2
    line = _error_line(refused)
    assert f"train sample 2 ({rows[2]['sample_id']}): history holds NaN or infinite values" in line
    assert not (tmp_path / "run").exists()


def test_leftover_temporary_checkpoint_folders_are_removed_at_start(interrupted, tmp_path):
    out = tmp_path / "run"
    for name in (".checkpoint-000004.tmp-4242", ".final.staging.tmp-4242-0a1b2c3d"):
        (out / name).mkdir()
        (out / name / "model.safetensors").write_bytes(b"\0" * 1024)
    said = []
    report = train(interrupted, resume=True, say=said.append, stop_after=3)
    assert report.resumed_from == 2
    assert any("removed 2 leftover temporary folder(s)" in s for s in said)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


# --- tokenizer and trajectories destinations --------------------------------------------------------------------


@pytest.mark.parametrize("where", ["a file", "the data set", "a folder of other files"])
def test_tokenizer_train_refuses_its_destination_before_training(data, tmp_path, where):
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.csv").write_text("1,2\n")
    out = {"a file": tmp_path / "notes.txt", "the data set": data, "a folder of other files": tmp_path / "other"}[where]
    expected = {
        "a file": "that is a file",
        "the data set": "an input of this command",
        "a folder of other files": "holds results.csv, which is not a tokenizer file",
    }[where]
    result = _invoke("tokenizer", "train", "--data", data, "--out", out, "--vocab-size", 300)
    assert result.exit_code == 2 and expected in _error_line(result)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "other" / "results.csv").read_text() == "1,2\n"


def test_tokenizer_train_saves_whole_and_replaces_a_tokenizer_folder(data, tmp_path):
    out = tmp_path / "tokenizer"
    for _ in range(2):
        result = _invoke("tokenizer", "train", "--data", data, "--out", out, "--vocab-size", 300)
        assert result.exit_code == 0, result.output
        assert len(load_tokenizer(out)) > 256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]  # no staging folder left


@pytest.mark.parametrize(
    "where", ["a file", "the data set", "inside the data set", "the teacher", "a folder of other files"]
)
def test_trajectories_refuses_its_destination_before_loading_the_teacher(data, tmp_path, monkeypatch, where):
    monkeypatch.setattr(fastddrive, "load", lambda *a, **k: pytest.fail("the teacher was loaded"))
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.csv").write_text("1,2\n")
    out = {
        "a file": tmp_path / "notes.txt",
        "the data set": data,
        "inside the data set": data / "trajectories",
        "the teacher": model_path("default-ar"),
        "a folder of other files": tmp_path / "other",
    }[where]
    result = _invoke("trajectories", "--data", data, "--samples", 2, "--out", out)
    assert result.exit_code == 2 and f"--out {out}" in _error_line(result)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["results.csv"]
    assert not (data / "trajectories").exists()


def test_out_errors_are_typed_in_the_api(data, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(OutputError, match="that is a file"):
        train(_config(data, tmp_path / "notes.txt"))
