"""`eval`, `bench`, `roofline`, `demo` and `pvf calibrate` (issue 32): a destination that would destroy an input,
or that cannot be written, is refused in one line before any model loads; every numeric option has a range
checked before work; a sample that does not read is reported by shard and id while the others are scored;
the pictures and the vocabulary are written atomically."""

import hashlib
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import fastddrive.eval.bench as bench_module
import fastddrive.planner as planner_module
from fastddrive.cli import app
from fastddrive.data.build import build_dataset
from fastddrive.data.dataset import MANIFEST, shard_record
from fastddrive.data.episodes import MAX_SEED
from fastddrive.decode.planning_vocabulary import VOCABULARY_FILE
from fastddrive.decode.result import DecodeResult
from fastddrive.engine.model_files import model_path
from fastddrive.eval import plots
from fastddrive.eval.bench import DecoderRun

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def no_model_loads(monkeypatch):
    """Makes any model load or simulated scene fail loudly: a refusal must come before either."""
    monkeypatch.setattr(planner_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(bench_module, "episode_samples", lambda *a, **k: pytest.fail("a scene was simulated"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Two merge episodes: a train shard and a test shard of 14 samples."""
    data = tmp_path_factory.mktemp("eval-safety") / "data"
    build_dataset(data, 2, 5, ["merge"])
    return data


def _test_shard(data):
    """The test split's shard ("test/<name>.parquet") and its rows."""
    manifest = json.loads((data / MANIFEST).read_text())
    shard = next(s for s in sorted(manifest["shards"]) if s.startswith("test/"))
    return shard, pq.read_table(data / shard)


@pytest.fixture(scope="module")
def damaged(dataset, tmp_path_factory):
    """A copy of `dataset` whose second test sample has a NaN history (written past the sample checks, with
    the manifest's record of the shard updated, as a faulty writer would); (data set, shard, sample id)."""
    data = tmp_path_factory.mktemp("eval-safety-damaged") / "data"
    shutil.copytree(dataset, data)
    shard, table = _test_shard(data)
    rows = table.to_pylist()
    rows[1]["history"] = [float("nan")] * len(rows[1]["history"])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), sink)
    raw = sink.getvalue().to_pybytes()
    (data / shard).write_bytes(raw)
    manifest = json.loads((data / MANIFEST).read_text())
    manifest["shards"][shard] = shard_record(raw, len(rows))
    (data / MANIFEST).write_text(json.dumps(manifest))
    return data, shard, rows[1]["sample_id"]


def _refused(result, *phrases):
    """Exit status 2 and one line naming the problem."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert all(phrase in lines[0] for phrase in phrases), lines[0]


# ------------------------------------------------------------------ each writer pointed at its own inputs


def test_eval_json_over_the_manifest_is_refused_and_the_manifest_kept(dataset, no_model_loads):
    before = _digest(dataset / MANIFEST)
    _refused(_run("eval", "--data", dataset, "--json", dataset / MANIFEST), "--json", "an input of this command")
    assert _digest(dataset / MANIFEST) == before


def test_bench_png_inside_the_data_set_is_refused(dataset, no_model_loads):
    shards = sorted(p.name for p in (dataset / "train").iterdir())
    png = dataset / "train" / "x.png"
    _refused(_run("bench", "--data", dataset, "--png", png, "--decoders", "ss"), "--png", "an input of this command")
    assert sorted(p.name for p in (dataset / "train").iterdir()) == shards


def test_roofline_outputs_inside_a_model_folder_or_a_data_set_are_refused(dataset, no_model_loads):
    folder = model_path("default-ar")
    _refused(_run("roofline", "--model", "default-ar", "--png", folder / "roofline.png"), "--png", str(folder))
    _refused(_run("roofline", "--json", dataset / "r.json"), "--json", "inside the data set")
    assert not (folder / "roofline.png").exists() and not (dataset / "r.json").exists()


def test_demo_out_that_is_a_file_or_a_data_set_is_refused(dataset, tmp_path, no_model_loads):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    _refused(_run("demo", "--out", file), "--out", "is a file")
    _refused(_run("demo", "--out", dataset), "--out", "the data set")
    assert file.read_text() == "mine" and not (dataset / "frontier.png").exists()


def test_pvf_calibrate_never_writes_into_the_package(dataset, no_model_loads):
    shipped = model_path("default") / VOCABULARY_FILE
    before = _digest(shipped)
    _refused(_run("pvf", "calibrate", "--model", "default", "--data", dataset), "--out is needed", "package")
    _refused(_run("pvf", "calibrate", "--data", dataset, "--out", shipped), "--out", "installed fastddrive package")
    assert _digest(shipped) == before


def test_pvf_calibrate_into_a_missing_folder_or_over_a_model_file_is_refused(dataset, tmp_path, no_model_loads):
    missing = tmp_path / "missing" / "dir" / "v.json"
    _refused(_run("pvf", "calibrate", "--data", dataset, "--out", missing), "--out", "does not exist")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    _refused(_run("pvf", "calibrate", "--model", model, "--data", dataset, "--out", model / "config.json"), "input")
    assert (model / "config.json").read_text() == "{}" and not missing.parent.exists()


# ------------------------------------------------------------------ ranges, checked before work


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--seed", MAX_SEED + 1],
        ["demo", "--seed", 2**64],
        ["bench", "--seed", -1],
        ["bench", "--scenes", 1001],
        ["bench", "--samples", 5001],
        ["eval", "--limit", 1_000_001],
        ["demo", "--scenes", 101],
        ["roofline", "--repeats", 10_001],
        ["roofline", "--warmup", 1001],
        ["pvf", "calibrate", "--samples", 100_001],
    ],
)
def test_numbers_out_of_range_are_refused_before_work(args, tmp_path, no_model_loads):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert args[-2] in result.output and "Traceback" not in result.output and "rerun" not in result.output


def test_a_seed_out_of_range_is_one_line_naming_the_range(tmp_path, no_model_loads):
    _refused(_run("bench", "--seed", MAX_SEED + 1), f"--seed {MAX_SEED + 1} is out of range", f"0 to {MAX_SEED}")


# ------------------------------------------------------------------ partial failure


def test_eval_names_a_sample_that_does_not_read_and_scores_the_others(damaged, tmp_path):
    data, shard, bad = damaged
    out = tmp_path / "eval.json"
    result = _run("eval", "--data", data, "--limit", 3, "--decoders", "ss", "--json", out)
    assert result.exit_code == 1, result.output
    assert f"{shard} sample {bad}: history holds NaN" in result.output
    assert "1 of 3 samples failed" in result.output and "Traceback" not in result.output
    report = json.loads(out.read_text())["decoders"]["ss"]
    assert report["samples"] == 3 and report["scored"] == 2 and report["ade5_m"] is not None
    assert report["failures"] == [f"{shard} sample {bad}: history holds NaN or infinite values"]
    assert [row["sample_id"] for row in report["per_sample"] if "error" in row] == [bad]


def test_bench_leaves_a_scene_that_does_not_read_out_of_every_row(damaged, tmp_path):
    data, shard, bad = damaged
    out = tmp_path / "bench.json"
    result = _run("bench", "--data", data, "--samples", 2, "--decoders", "ss", "--json", out)
    assert result.exit_code == 1, result.output
    assert f"{shard} sample {bad}: history holds NaN" in result.output and "Traceback" not in result.output
    written = json.loads(out.read_text())
    assert [row["samples"] for row in written["rows"]] == [1]  # the warm-up, the bad scene, one timed
    assert written["failures"] == [f"{shard} sample {bad}: history holds NaN or infinite values"]


class StubPlanner:
    """Answers every scene with its own expert answer at once, and raises on `bad`."""

    def __init__(self, bad):
        self.bad = bad

    def plan(self, scene, decoder, **options):
        if scene.sample_id == self.bad:
            raise RuntimeError("out of memory")
        return DecodeResult(decoder, [1, 2], "", scene.response, 3, 2, 2, [1, 1], 1.0, 2.0)


def test_a_scene_on_which_a_decoder_fails_is_reported_and_in_no_row(dataset):
    scenes = bench_module.bench_scenes(dataset, "test", 7, 5)
    planner = StubPlanner(scenes[2].sample.sample_id)
    runs = [DecoderRun(name, name, {}, planner) for name in ("ar", "ss")]
    result = bench_module.run_bench(runs, scenes)
    assert [row.samples for row in result.rows] == [3, 3]
    assert [s.sample_id for s in result.scenes] == [s.sample.sample_id for s in scenes[1:2] + scenes[3:]]
    assert result.failures == [f"{scenes[2].where}: ar: RuntimeError: out of memory"]
    assert result.rows[1].latency_ms == 3.0 and result.rows[1].identical_to_ar == 1.0


# ------------------------------------------------------------------ atomic pictures


def test_a_picture_that_fails_to_draw_leaves_the_old_one_and_no_temporary(tmp_path, monkeypatch):
    png = tmp_path / "frontier.png"
    png.write_bytes(b"old")
    rows = [{"label": "ss", "latency_ms": 10.0, "ade5": 1.0}]

    def broken(self, path, **kwargs):
        path.write_bytes(b"half a picture")
        raise OSError("disk full")

    monkeypatch.setattr(plots.plt.Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        plots.draw_frontier(rows, png)
    assert png.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["frontier.png"]
    monkeypatch.undo()
    plots.draw_frontier(rows, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in tmp_path.iterdir()] == ["frontier.png"]
