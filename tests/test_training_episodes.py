"""A model records the simulated episodes it was trained on, and a drive over them says so (issue 37: targets on
episodes the model does not see)."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.core.training_episodes import KEY, record_problem, training_episodes, with_training_episodes
from fastddrive.data.dataset import DrivingDataset
from fastddrive.data.episodes import plan_episodes, simulated_scenarios
from fastddrive.data.highway import DEFAULT_SCENARIOS, REACTIVE_SCENARIOS
from fastddrive.drive.run import check_settings, episode_seed, plan_jobs, training_episodes_driven
from fastddrive.drive.sweep import check_sweep
from fastddrive.engine.model_check import ModelFileError
from fastddrive.engine.model_files import model_path, read_info


def test_the_record_holds_the_union_sorted_by_scenario_and_seed():
    extra = with_training_episodes({"preset": "p"}, [("merge", 12), ("highway", 5), ("merge", 3)])
    assert extra == {"preset": "p", KEY: {"highway": [5], "merge": [3, 12]}}
    assert with_training_episodes(extra, [("merge", 3), ("cut-in", 0)])[KEY] == {
        "cut-in": [0],
        "highway": [5],
        "merge": [3, 12],
    }
    assert training_episodes(extra) == {("highway", 5), ("merge", 3), ("merge", 12)}
    assert with_training_episodes({"preset": "p"}, []) == {"preset": "p"}  # none: no record at all
    assert training_episodes({}) == frozenset()


@pytest.mark.parametrize(
    "record, phrase",
    [
        ([1, 2], "must map scenario names"),
        ({"": [1]}, "must map scenario names"),
        ({"merge": 3}, "'merge'] must be a list"),
        ({"merge": [-1]}, "non-negative"),
        ({"merge": [True]}, "non-negative"),
        ({"merge": ["7"]}, "non-negative"),
    ],
)
def test_a_malformed_record_is_refused_in_one_line_naming_it(tmp_path, record, phrase):
    assert record_problem({KEY: record}) is not None
    shutil.copyfile(model_path("default") / "fastddrive.json", tmp_path / "fastddrive.json")
    info = json.loads((tmp_path / "fastddrive.json").read_text())
    (tmp_path / "fastddrive.json").write_text(json.dumps(info | {"extra": {KEY: record}}))
    with pytest.raises(ModelFileError, match="training_episodes") as caught:
        read_info(tmp_path)
    assert phrase in str(caught.value) and "\n" not in str(caught.value)


def test_the_scenarios_of_simulated_episodes_are_read_through_merges():
    generator = {"source": "highway-env", "scenarios": ["highway", "merge"]}
    dagger = {"source": "dagger", "scenarios": ["roundabout"]}
    converted = {"source": "wod-e2e"}
    merged = {"source": "merge", "sources": [{"settings": generator}, {"settings": converted}]}
    again = {"source": "merge", "sources": [{"settings": merged}, {"settings": dagger}]}
    assert simulated_scenarios(again) == {"highway", "merge", "roundabout"}
    assert simulated_scenarios(converted) == set()


def test_the_embedded_models_record_what_their_model_card_trained_them_on():
    default = training_episodes(read_info(model_path("default")).extra)
    # Seeds 0, 9, 21 (the five default scenarios) and 3, 23 (the reactive four): the model card's commands.
    assert {seed // 100_000 for _, seed in default} == {0, 3, 9, 21, 23}
    assert ("highway", 0) in default and ("highway", 5) not in default  # episode 5 of seed 0 is in the test split
    five, reactive = list(DEFAULT_SCENARIOS), list(REACTIVE_SCENARIOS)
    sets = {0: (500, five), 9: (150, five), 21: (150, five), 3: (240, reactive), 23: (240, reactive)}
    split = {(j.scenario, j.seed): j.split for seed, (n, names) in sets.items() for j in plan_episodes(n, seed, names)}
    assert all(split.get(episode) == "train" for episode in default)  # none of their val or test episodes
    assert training_episodes(read_info(model_path("default-ar")).extra) == default
    jf = training_episodes(read_info(model_path("default-jf")).extra)
    assert {seed // 100_000 for _, seed in jf} == {0, 7}  # tiny-ar's first data set, then its own prompts


def _recording(tmp_path, episodes):
    tmp_path.mkdir(exist_ok=True)
    folder = tmp_path / "model"
    shutil.copytree(model_path("default"), folder)
    info = json.loads((folder / "fastddrive.json").read_text())
    (folder / "fastddrive.json").write_text(json.dumps(info | {"extra": with_training_episodes({}, episodes)}))
    return folder


def test_a_drive_names_the_episodes_its_model_was_trained_on(tmp_path):
    trained = [("lead-brake", episode_seed(7, "lead-brake", 1)), ("merge", episode_seed(7, "merge", 0))]
    folder = _recording(tmp_path, [*trained, ("cut-in", episode_seed(8, "cut-in", 0))])
    fields = dict(decoders="ss", scenarios="lead-brake,cut-in", episodes=3, latency="zero", out=tmp_path / "out")
    settings = check_settings(model=str(folder), **fields)
    assert training_episodes_driven(settings) == [trained[0]]
    assert training_episodes_driven(settings.model_copy(update={"decoders": ()})) == []  # references: no model
    assert training_episodes_driven(check_settings(**fields)) == []  # seed 7 is none the default was trained on

    args = ["--model", folder, "--decoders", "ss", "--scenarios", "lead-brake", "--episodes", 2, "--duration-s", 4]
    args += ["--latency", "zero", "--no-references", "--out", tmp_path / "out", "--json", tmp_path / "rows.json"]
    result = CliRunner().invoke(app, ["drive", *(str(a) for a in args)])
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.output.splitlines() if line.startswith("warning:"))
    assert f"1 of the 2 episodes to drive are among those {folder} was trained on" in warning
    assert f"lead-brake {trained[0][1]}" in warning
    settings_json = json.loads((tmp_path / "rows.json").read_text())["settings"]
    assert settings_json["training_episodes_driven"] == [{"scenario": "lead-brake", "seed": trained[0][1]}]


def test_an_evaluation_names_the_samples_of_episodes_its_model_was_trained_on(tmp_path):
    from fastddrive.data.build import build_dataset

    data = tmp_path / "cut-in"
    build_dataset(data, 2, 3, ["cut-in"])  # episode 1 (seed 300001) is in the test split
    test_ids = [row["sample_id"] for row in DrivingDataset.open(data).table("test", ["sample_id"]).to_pylist()]
    assert test_ids and all(i.startswith("cut-in-300001-") for i in test_ids)
    trained = _recording(tmp_path, [("cut-in", 300001), ("lead-brake", 300001)])
    clean = _recording(tmp_path / "clean", [("cut-in", 300000)])  # the train split's episode only
    for model, expected in ((trained, test_ids[:2]), (clean, [])):
        out = tmp_path / f"{model.parent.name}.json"
        args = ["eval", "--model", model, "--data", data, "--split", "test", "--limit", 2, "--json", out]
        result = CliRunner().invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
        if expected:
            (warning,) = warnings
            assert f"2 of the 2 samples to evaluate are of episodes {model} was trained on" in warning
        else:
            assert warnings == []
        assert json.loads(out.read_text())["samples_of_training_episodes"] == expected


def test_held_out_leaves_the_trained_episodes_out_for_every_planner(tmp_path):
    trained = ("cut-in", episode_seed(7, "cut-in", 0))
    folder = _recording(tmp_path, [trained])
    fields = dict(model=str(folder), decoders="ss", scenarios="lead-brake,cut-in", episodes=2, out=tmp_path / "out")
    settings = check_settings(latency="zero", held_out=True, **fields)
    assert settings.skipped == (trained,) and training_episodes_driven(settings) == []
    jobs = plan_jobs(settings)
    assert {(j.scenario, j.seed) for j in jobs} == {
        ("lead-brake", episode_seed(7, "lead-brake", 0)),
        ("lead-brake", episode_seed(7, "lead-brake", 1)),
        ("cut-in", episode_seed(7, "cut-in", 1)),
    }
    assert {j.label for j in jobs} == {"ss", "expert-drives", "expert-plans", "constant-velocity"}
    assert len(jobs) == 3 * 4
    (swept,) = {run.skipped for run in check_sweep(latency="sweep:0,500", held_out=True, **fields)}
    assert swept == (trained,)  # every latency of a sweep drives the same episodes

    args = ["--model", folder, "--decoders", "ss", "--scenarios", "cut-in", "--episodes", 2, "--duration-s", 4]
    args += ["--latency", "zero", "--no-references", "--out", tmp_path / "cli", "--json", tmp_path / "rows.json"]
    result = CliRunner().invoke(app, ["drive", *(str(a) for a in args), "--held-out"])
    assert result.exit_code == 0, result.output
    assert f"held out: 1 of the 2 episodes left out, those {folder} was trained on (cut-in {trained[1]};" in (
        result.output
    )
    assert "warning:" not in result.output
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows["settings"]["training_episodes_skipped"] == [{"scenario": "cut-in", "seed": trained[1]}]
    assert rows["settings"]["training_episodes_driven"] == []
    assert [row["episodes"] for row in rows["rows"]] == [1]

    everything = _recording(tmp_path / "all", [trained, ("cut-in", episode_seed(7, "cut-in", 1))])
    refused = CliRunner().invoke(app, ["drive", *(str(a) for a in args), "--held-out", "--model", str(everything)])
    assert refused.exit_code == 2, refused.output
    lines = refused.output.strip().splitlines()
    assert len(lines) == 1 and "--held-out leaves nothing to drive" in lines[0], refused.output
