"""Bad input is refused in one line before any costly work (exit status 2 on the command line, a typed error
in the API), and nothing is left behind: the table of issue-16 probes for the CLI, the API, model folders and
devices."""

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

import fastddrive
import fastddrive.planner as planner_module
from fastddrive.cli import app
from fastddrive.core.sample import SampleError
from fastddrive.data.dataset import DatasetError
from fastddrive.engine.model_check import ModelFileError
from fastddrive.engine.model_files import DeviceError, model_path
from fastddrive.train.config import ConfigError, load_config

runner = CliRunner()
HISTORY = np.zeros((7, 6))
HISTORY_JSON = str(HISTORY.tolist())


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def no_model_loads(monkeypatch):
    """Makes any model load fail loudly: a refused input must be refused before one."""
    monkeypatch.setattr(planner_module, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["eval", "--data", "runs/none", "--limit", 0], "--limit"),
        (["eval", "--data", "runs/none", "--limit", -1], "--limit"),
        (["eval", "--data", "runs/none", "--decoders", ","], "names no decoder"),
        (["bench", "--samples", -5], "--samples"),
        (["eval", "--data", "runs/none", "--json", "/no/such/folder/x.json"], "/no/such/folder does not exist"),
        (["demo", "--out", "README.md"], "is a file"),
        (["data", "stats", "runs/none", "--json", "/no/such/folder/x.json"], "/no/such/folder does not exist"),
        (["plan", "--device", "tpu7", "--history", HISTORY_JSON, "--command", "go_straight"], "device"),
    ],
)
def test_the_cli_refuses_in_one_line(args, message, no_model_loads):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_an_empty_split_is_refused_before_the_model_loads(tmp_path, no_model_loads):
    data = tmp_path / "data"
    result = _run("data", "highway", "--out", data, "--episodes", 1, "--scenarios", "merge", "--seed", 3)
    assert result.exit_code == 0, result.output
    result = _run("eval", "--data", data, "--split", "val", "--json", tmp_path / "x.json")
    assert result.exit_code == 2 and "no val samples" in result.output
    assert not (tmp_path / "x.json").exists()


@pytest.fixture(scope="module")
def damaged_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")

    def damaged(name, damage):
        folder = root / name
        shutil.copytree(model_path("default"), folder)
        damage(folder)
        return folder

    def truncate(folder):
        weights = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])

    return {
        "truncated": (damaged("truncated", truncate), "is truncated"),
        "missing": (damaged("missing", lambda f: (f / "model.safetensors").unlink()), "holds no model.safetensors"),
        "pickle": (
            damaged("pickle", lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin")),
            "never pickles",
        ),
        "config": (damaged("config", lambda f: (f / "config.json").write_text("{oops")), "not valid JSON"),
        "info": (damaged("info", lambda f: (f / "fastddrive.json").write_text('{"bogus": 1}')), "fastddrive.json"),
        "tokenizer": (damaged("tokenizer", lambda f: (f / "tokenizer_config.json").unlink()), "tokenizer"),
        "empty-tokenizer": (
            damaged("empty-tokenizer", lambda f: (f / "tokenizer.json").write_text("{}")),
            "tokenizer.json is not a tokenizer",
        ),
        "fewer-layers": (
            damaged("fewer-layers", lambda f: (f / "config.json").write_text(_fewer_layers(f / "config.json"))),
            "model.layers.2.input_layernorm.weight, a tensor the model described by config.json does not have",
        ),
    }


def _fewer_layers(config_file):
    """config.json with 2 of the model's 4 layers: the weights hold layers the config does not."""
    config = json.loads(config_file.read_text())
    config["text_config"].update(num_hidden_layers=2, layer_types=["full_attention"] * 2)
    return json.dumps(config)


@pytest.mark.parametrize(
    "case", ["truncated", "missing", "pickle", "config", "info", "tokenizer", "empty-tokenizer", "fewer-layers"]
)
def test_a_damaged_model_folder_is_named_in_one_line(damaged_models, case):
    folder, message = damaged_models[case]
    with pytest.raises(ModelFileError, match=message):
        fastddrive.load(folder)
    result = _run("plan", "--model", folder, "--history", HISTORY_JSON, "--command", "go_straight")
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("device", ["tpu7", "cuda:99", "banana"])
def test_an_unknown_or_absent_device_is_a_typed_error(device, no_model_loads):
    with pytest.raises(DeviceError, match="device"):
        fastddrive.load("default", device=device)


@pytest.mark.parametrize(
    "history",
    [
        [["1"] * 6] * 7,  # numeric strings
        [[True] * 6] * 7,  # booleans
        np.full((7, 6), 1 + 2j),  # complex: the imaginary part would be dropped
        [[0.0] * 6] * 6 + [[0.0] * 5 + [False]],  # one boolean among floats
    ],
)
def test_history_must_be_real_numbers(history):
    from fastddrive.planner import PlanInputs

    with pytest.raises(SampleError, match="real numbers"):
        PlanInputs.checked(images=(), history=history, command="go_straight")


def test_a_vision_model_needs_an_image_in_the_api():
    planner = fastddrive.load("default")
    for images in (None, []):
        with pytest.raises(SampleError, match="camera image"):
            planner.plan(images=images, history=HISTORY, command="go_straight")


@pytest.mark.parametrize(
    ("override", "message"),
    [({"lr": 0}, "lr"), ({"batch_size": 0}, "batch_size"), ({"checkpoint_every": 0}, "checkpoint_every")],
)
def test_training_settings_are_validated(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-ar", **override)


def test_training_refuses_a_missing_data_folder_before_writing_anything(tmp_path):
    from fastddrive.train.loop import train

    config = load_config("tiny-ar", data=str(tmp_path / "none"), out=str(tmp_path / "run"))
    with pytest.raises(DatasetError):
        train(config)
    assert not (tmp_path / "run").exists()


def test_plan_json_exits_1_when_the_answer_does_not_parse(monkeypatch, tmp_path):
    import json

    from PIL import Image

    from fastddrive.decode.result import DecodeResult

    image = tmp_path / "frame.png"
    Image.fromarray(np.zeros((224, 448, 3), dtype=np.uint8)).save(image)
    unparsed = DecodeResult("ss", [1, 2], '{"critical', None, 3, 2, 2, [1], 1.0, 2.0, error="truncated JSON")
    monkeypatch.setattr(planner_module.Planner, "plan", lambda self, *a, **k: unparsed)
    result = _run("plan", "--image", image, "--history", HISTORY_JSON, "--command", "go_straight", "--json")
    assert result.exit_code == 1, result.output
    printed = result.output[result.output.index('{"decoder"') :].splitlines()[0]  # after any loading bar
    assert json.loads(printed)["error"] == "truncated JSON"


def test_the_demo_folder_may_be_new_but_not_inside_a_file(tmp_path):
    from fastddrive.core.outputs import OutputError, check_folder_destination

    check_folder_destination(tmp_path / "runs" / "demo", "--out", own_folder=True)  # made when written
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        check_folder_destination(tmp_path / "file" / "demo", "--out", own_folder=True)
