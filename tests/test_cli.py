import json

import pytest
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.data import build, episodes
from fastddrive.data.dataset import DrivingDataset
from fastddrive.decode.speculative import ss_nfe_floor
from fastddrive.planner import load

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "merge"
    result = _run("data", "highway", "--out", out, "--episodes", 2, "--scenarios", "merge", "--seed", 5)
    assert result.exit_code == 0, result.output
    return out


def test_generation_writes_episode_shards_in_splits(small_dataset):
    dataset = DrivingDataset.open(small_dataset)
    assert dataset.manifest["complete"] is True
    assert [len(dataset.shards(s)) for s in ("train", "val", "test")] == [1, 0, 1]
    train = {s.episode_seed for s in dataset.samples("train")}
    test = {s.episode_seed for s in dataset.samples("test")}
    assert train and test and not train & test  # no scene in two splits
    assert len(dataset) > 10


def test_show_prints_the_target_json_and_draws_it(small_dataset, tmp_path):
    png = tmp_path / "scene.png"
    result = _run("data", "show", small_dataset, "--split", "test", "--index", 1, "--png", png)
    assert result.exit_code == 0, result.output
    assert '"critical_objects"' in result.output and '"trajectory"' in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_reports_distribution_truncations_and_the_scaffold_table(small_dataset, tmp_path):
    figures = tmp_path / "stats.json"
    result = _run("data", "stats", small_dataset, "--json", figures)
    assert result.exit_code == 0, result.output
    for needle in ("merge", "Longitudinal meta-behaviour", "explanations cut", "value share", "episode endings"):
        assert needle in result.output
    data = json.loads(figures.read_text())
    assert sum(data["longitudinal"].values()) == sum(data["samples"].values())
    assert data["scaffold"][-1]["section"] == "all"


def test_unknown_scenario_lists_the_known_ones(tmp_path):
    result = _run("data", "highway", "--out", tmp_path / "x", "--scenarios", "highway,moon")
    assert result.exit_code == 2
    assert "unknown scenario 'moon'" in result.output and "roundabout" in result.output
    assert not (tmp_path / "x").exists()


def test_existing_output_is_refused_without_overwrite(small_dataset):
    before = {p: p.stat().st_mtime_ns for p in small_dataset.rglob("*")}
    result = _run("data", "highway", "--out", small_dataset, "--episodes", 2, "--scenarios", "merge", "--seed", 5)
    assert result.exit_code == 2 and "--overwrite" in result.output
    other = _run("data", "highway", "--out", small_dataset, "--episodes", 3, "--scenarios", "merge")
    assert other.exit_code == 2 and "other settings" in other.output
    assert {p: p.stat().st_mtime_ns for p in small_dataset.rglob("*")} == before


def test_a_folder_that_is_not_a_dataset_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for args in (("data", "show", tmp_path), ("data", "stats", tmp_path)):
        result = _run(*args)
        assert result.exit_code == 2 and "not a fastddrive dataset" in result.output
    result = _run("data", "highway", "--out", tmp_path, "--episodes", 1, "--scenarios", "merge", "--overwrite")
    assert result.exit_code == 2 and "refusing to delete" in result.output
    assert (tmp_path / "notes.txt").read_text() == "mine"
    missing = _run("data", "show", tmp_path / "nope")
    assert missing.exit_code == 2 and "is not a directory" in missing.output


def test_an_out_of_range_index_is_a_clear_error(small_dataset):
    result = _run("data", "show", small_dataset, "--split", "test", "--index", 10_000)
    assert result.exit_code == 2 and "out of range" in result.output


def test_an_interrupted_run_resumes_and_keeps_what_was_written(tmp_path):
    out = tmp_path / "d"
    build.build_dataset(out, 2, 9, ["merge"])
    shards = sorted(out.rglob("*.parquet"))
    kept, lost = shards
    kept_mtime = kept.stat().st_mtime_ns
    lost.unlink()  # as if the run had been killed before this episode was written
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))

    result = _run("data", "highway", "--out", out, "--episodes", 2, "--scenarios", "merge", "--seed", 9)
    assert result.exit_code == 0, result.output
    assert "resuming: 1 of 2 episodes already written" in result.output
    assert kept.stat().st_mtime_ns == kept_mtime and lost.is_file()
    assert json.loads((out / "manifest.json").read_text())["complete"] is True


def test_a_failed_episode_is_reported_and_the_rest_completes(tmp_path, monkeypatch):
    from fastddrive.data import highway

    real = highway.simulate_episode

    def flaky(scenario, seed, *args, **kwargs):
        if seed == 11 * episodes.SEED_STRIDE + 1:
            raise RuntimeError("simulator exploded")
        return real(scenario, seed, *args, **kwargs)

    monkeypatch.setattr(highway, "simulate_episode", flaky)
    report = build.build_dataset(tmp_path / "d", 3, 11, ["merge"])
    assert [r.job.index for r in report.failed] == [1]
    assert "simulator exploded" in report.failed[0].error
    assert len(list((tmp_path / "d").rglob("*.parquet"))) == 2
    assert json.loads((tmp_path / "d" / "manifest.json").read_text())["complete"] is False

    monkeypatch.setattr(highway, "simulate_episode", real)
    again = build.build_dataset(tmp_path / "d", 3, 11, ["merge"])
    assert again.skipped == 2 and not again.failed
    assert len(list((tmp_path / "d").rglob("*.parquet"))) == 3


def test_two_worker_processes_make_the_same_dataset_as_one(tmp_path):
    one = build.build_dataset(tmp_path / "one", 2, 4, ["merge"], workers=1)
    two = build.build_dataset(tmp_path / "two", 2, 4, ["merge"], workers=2)
    assert one.samples == two.samples > 0
    a, b = DrivingDataset.open(tmp_path / "one"), DrivingDataset.open(tmp_path / "two")
    for split in ("train", "test"):
        assert a.table(split, ["sample_id", "response"]).equals(b.table(split, ["sample_id", "response"]))


def test_tokenizer_table_command():
    result = _run("tokenizer", "table", "--block-size", 32)
    assert result.exit_code == 0, result.output
    assert "trajectory" in result.output and "slot budgets" in result.output


def test_plan_prints_one_json_object_from_a_dataset_scene(small_dataset):
    result = _run("plan", "--data", small_dataset, "--split", "test", "--index", 0, "--decoder", "ss", "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert set(answer) >= {"response", "text", "token_ids", "nfe", "tokens", "prefill_ms", "decode_ms", "decoder"}
    assert answer["decoder"] == "ss" and answer["response"]["trajectory"]
    ar = json.loads(_run("plan", "--data", small_dataset, "--index", 0, "--decoder", "ar", "--json").stdout)
    assert ar["token_ids"] == answer["token_ids"] and ar["nfe"] > answer["nfe"]


def test_plan_from_an_image_history_and_command(small_dataset, tmp_path):
    from PIL import Image

    sample = DrivingDataset.open(small_dataset).sample("test", 0)
    png = tmp_path / "frame.png"
    Image.fromarray(sample.image).save(png)
    history = json.dumps(sample.history.tolist())
    ok = _run(
        "plan",
        "--image",
        png,
        "--history",
        history,
        "--command",
        sample.command,
        "--option",
        "tau=0.5",
        "--decoder",
        "sd",
    )
    assert ok.exit_code == 0, ok.output
    assert '"trajectory"' in ok.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--history", "[[1, 2]]", "--command", "go_straight"], "history must be 7 rows"),
        (["--history", "not json", "--command", "go_straight"], "not valid JSON"),
        (["--history", "missing.json", "--command", "go_straight"], "does not exist"),
        (["--history", json.dumps([[0.0] * 6] * 7), "--command", "fly"], "unknown navigation command"),
        (["--image", "missing.png", "--history", "[]", "--command", "go_straight"], "image missing.png is not a file"),
        (["--decoder", "beam"], "unknown decoder 'beam'"),
        (["--option", "tau"], "KEY=VALUE"),
    ],
)
def test_plan_rejects_bad_input_with_a_clear_message(small_dataset, args, message):
    if "--history" not in args:
        args = ["--data", small_dataset, *args]
    result = _run("plan", *args)
    assert result.exit_code == 2
    assert message in result.output


def test_bench_times_decoders_on_the_same_scenes_and_writes_json_and_png(small_dataset, tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "frontier.png"
    args = ["bench", "--data", small_dataset, "--samples", 2, "--decoders", "ar,ar-jump,ss,sd:tau=0.0", "--json", out]
    result = _run(*args, "--png", png, "--baseline", "default-ar", "--oracle-drafts")
    assert result.exit_code == 0, result.output
    rows = {row["label"]: row for row in json.loads(out.read_text())["rows"]}
    oracle = "ss (oracle drafts: speed bound)"
    assert set(rows) == {"ar (default-ar, free JSON)", "ar", "ar-jump", "ss", "sd:tau=0.0", oracle}
    assert rows[oracle]["identical_to_ar"] == 1.0 and rows[oracle]["nfe"] == ss_nfe_floor(load("default").scaffold)
    keys = {"decoder", "nfe", "tokens_per_nfe", "tokens_per_s", "latency_ms", "speedup_vs_ar", "ade3", "ade5"}
    keys |= {"speedup_vs_ar_jump", "speedup_vs_baseline"}
    for row in rows.values():
        assert keys <= set(row)
        assert row["samples"] == 2
    assert rows["ss"]["identical_to_ar"] == rows["ar-jump"]["identical_to_ar"] == 1.0
    assert rows["ss"]["nfe"] < rows["ar-jump"]["nfe"] < rows["ar"]["nfe"]
    assert rows["ar"]["speedup_vs_ar"] == rows["ar-jump"]["speedup_vs_ar_jump"] == 1.0
    assert rows["ar (default-ar, free JSON)"]["speedup_vs_baseline"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = _run("bench", "--data", small_dataset, "--decoders", "ss:tau=0.5")
    assert bad.exit_code == 2 and "takes no option 'tau'" in bad.output


def test_pvf_calibrate_writes_a_vocabulary_that_pvf_reads(small_dataset, tmp_path):
    out = tmp_path / "vocabulary.json"
    result = _run("pvf", "calibrate", "--data", small_dataset, "--split", "test", "--samples", 2, "--out", out)
    assert result.exit_code == 0, result.output
    assert "planning vocabulary of default" in result.output
    written = json.loads(out.read_text())
    assert written["settings"]["split"] == "test"
    planned = _run(
        "plan", "--data", small_dataset, "--split", "test", "--decoder", "pvf", "--option", f"vocabulary={out}"
    )
    assert planned.exit_code == 0, planned.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--split", "nope"), "unknown split 'nope'"),
        (("--samples", 0), "greater than or equal to 1"),
    ],
)
def test_pvf_calibrate_refuses_bad_input(small_dataset, tmp_path, args, message):
    result = _run("pvf", "calibrate", "--data", small_dataset, "--out", tmp_path / "v.json", *args)
    assert result.exit_code == 2
    assert message in result.output


def test_plan_with_a_malformed_vocabulary_names_the_file(small_dataset, tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    result = _run(
        "plan", "--data", small_dataset, "--split", "test", "--decoder", "pvf", "--option", f"vocabulary={bad}"
    )
    assert result.exit_code == 2
    assert "broken.json" in result.output


@pytest.mark.parametrize(
    ("fmt", "convert"), [("wod-e2e", ["wod-e2e", "--src"]), ("nuscenes", ["nuscenes", "--dataroot"])]
)
def test_export_to_a_real_layout_and_convert_back(small_dataset, tmp_path, fmt, convert):
    exported, back = tmp_path / "exported", tmp_path / "back"
    result = _run("data", "export", "--data", small_dataset, "--out", exported, "--format", fmt, "--split", "test")
    assert result.exit_code == 0, result.output
    extra = ["--version", "v1.0-fastddrive"] if fmt == "nuscenes" else []
    result = _run("data", *convert, exported, "--out", back, *extra)
    assert result.exit_code == 0, result.output
    original = list(DrivingDataset.open(small_dataset).samples("test"))
    converted = list(DrivingDataset.open(back).samples("test"))
    assert len(converted) == len(original)
    assert _run("data", "stats", back).exit_code == 0


def test_export_and_conversion_refuse_bad_input_in_one_line(small_dataset, tmp_path):
    result = _run("data", "export", "--data", small_dataset, "--out", tmp_path / "x", "--format", "kitti")
    assert result.exit_code == 2 and "unknown --format 'kitti'" in result.output
    result = _run("data", "nuscenes", "--dataroot", tmp_path / "none", "--out", tmp_path / "y")
    assert result.exit_code == 2 and "scene.json is missing" in result.output
    (tmp_path / "src").mkdir()
    result = _run("data", "wod-e2e", "--src", tmp_path / "src", "--out", tmp_path / "z")
    assert result.exit_code == 2 and "holds no release JSON files" in result.output
