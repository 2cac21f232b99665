"""`drive` (issue 32): its results folder, video folder and JSON report are checked before anything is loaded
or driven, and every numeric setting (episodes, seed, replanning, duration, fixed latency) has a range checked
before work, refused in one line with exit status 2."""

import pytest
from typer.testing import CliRunner

import fastddrive.drive.run as run_module
import fastddrive.planner as planner_module
from fastddrive.cli import app
from fastddrive.core.outputs import PACKAGE_ROOT, OutputError
from fastddrive.data.episodes import MAX_SEED
from fastddrive.drive import DriveError
from fastddrive.drive.latency import LatencyError
from fastddrive.drive.run import check_settings
from fastddrive.engine.model_files import model_path

runner = CliRunner()


def _drive(*args):
    return runner.invoke(app, ["drive", *(str(a) for a in args)])


@pytest.fixture
def nothing_runs(monkeypatch):
    """Makes a model load or a driven episode fail loudly: a refusal must come before either."""
    monkeypatch.setattr(planner_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(run_module, "drive_episode", lambda *a, **k: pytest.fail("an episode was driven"))


@pytest.fixture
def data_set(tmp_path):
    """A folder the commands read as a data set (its manifest marks it)."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"format": "fastddrive-driving-samples"}')
    return folder


def _refused(result, *phrases):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert all(phrase in lines[0] for phrase in phrases), lines[0]
    assert "rerun" not in lines[0]


def test_an_out_that_is_a_file_is_refused_before_driving(tmp_path, nothing_runs):
    file = tmp_path / "results.txt"
    file.write_text("mine")
    _refused(_drive("--out", file), "--out", "is a file")
    assert file.read_text() == "mine"


@pytest.mark.parametrize("video", ["/dev/null", "file"])
def test_a_video_folder_that_is_not_a_folder_is_refused(tmp_path, video, nothing_runs):
    if video == "file":
        video = tmp_path / "v.gif"
        video.write_text("mine")
    _refused(_drive("--out", tmp_path / "out", "--video", video), "--video")
    assert not (tmp_path / "out").exists()


def test_outputs_in_a_data_set_a_model_folder_or_the_package_are_refused(tmp_path, data_set, nothing_runs):
    _refused(_drive("--out", data_set), "--out", "the data set")
    _refused(_drive("--out", data_set / "drive"), "--out", "inside the data set")
    _refused(_drive("--out", tmp_path / "out", "--video", data_set / "gifs"), "--video", "inside the data set")
    _refused(_drive("--out", tmp_path / "out", "--json", data_set / "rows.json"), "--json", "inside the data set")
    _refused(_drive("--out", model_path("default") / "drive"), "--out", "an input of this command")
    _refused(_drive("--out", PACKAGE_ROOT / "runs"), "--out", "installed fastddrive package")
    _refused(_drive("--out", tmp_path / "out", "--json", tmp_path / "no" / "rows.json"), "--json", "does not exist")
    _refused(_drive("--out", tmp_path / "out", "--json", tmp_path / "rows.txt"), "--json", ".json")
    assert sorted(p.name for p in data_set.iterdir()) == ["manifest.json"] and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--seed", MAX_SEED + 1], f"0 to {MAX_SEED}"),
        (["--seed", 2**64], f"0 to {MAX_SEED}"),
        (["--replan-s", 0.3], "--replan-s"),
        (["--replan-s", 5.25], "--replan-s"),
        (["--replan-s", "nan"], "--replan-s"),
        (["--duration-s", 300.25], "--duration-s"),
        (["--duration-s", "inf"], "--duration-s"),
        (["--duration-s", 3.0], "--duration-s"),
        (["--latency", "fixed:60001"], "0 to 60000"),
        (["--latency", "fixed:nan"], "0 to 60000"),
        (["--decoders", "ar,ss", "--latency", "fixed:ar=1,ss=1e300"], "0 to 60000"),
    ],
)
def test_numbers_out_of_range_are_refused_in_one_line_before_work(tmp_path, args, phrase, nothing_runs):
    _refused(_drive("--out", tmp_path / "out", *args), phrase)


@pytest.mark.parametrize("args", [["--seed", -1], ["--episodes", 0], ["--episodes", 20_001]])
def test_typer_ranges_are_refused_before_work(tmp_path, args, nothing_runs):
    result = _drive("--out", tmp_path / "out", *args)
    assert result.exit_code == 2 and args[0] in result.output and "Traceback" not in result.output


def test_the_api_checks_the_same_ranges_and_places(tmp_path, data_set):
    with pytest.raises(DriveError, match="--seed: -1 is out of range"):
        check_settings(seed=-1, out=tmp_path)
    assert check_settings(seed=MAX_SEED, out=tmp_path).seed == MAX_SEED
    with pytest.raises(DriveError, match="--duration-s"):
        check_settings(duration_s=float("inf"), out=tmp_path)
    with pytest.raises(LatencyError, match="0 to 60000"):
        check_settings(latency="fixed:-0.5", out=tmp_path)
    with pytest.raises(OutputError, match="--out .*: that is the data set"):
        check_settings(out=data_set)
    with pytest.raises(OutputError, match="--video /dev/null"):
        check_settings(out=tmp_path, video="/dev/null")
