"""Camera frames of any size go in (issue 34): the model folder's image processor resizes them (Qwen2.5-VL's
`smart_resize`), overridable per planner and per training config; the answer records the size the model saw.
A text-only model given images, and a Qwen2-VL or official release folder, are refused in one line."""

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from fastddrive.cli import app
from fastddrive.core.prompt import chat_text
from fastddrive.core.sample import SampleError
from fastddrive.engine.model_check import ModelFileError, check_model_folder
from fastddrive.engine.model_files import model_path
from fastddrive.planner import PlanInputs, Planner, load
from fastddrive.serve.app import create_app
from fastddrive.train.config import load_config
from fastddrive.train.loop import initial_model
from model_fixtures import text_model
from serve_fakes import running

CAMERA_SIZES = [(1920, 1080), (1600, 900)]  # (width, height) of the users' cameras


def _frame(width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _jpeg(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _image_tokens(planner: Planner, frame: np.ndarray) -> int:
    model = planner.model
    prompt = model.encode_prompt(chat_text("go_straight", np.zeros((7, 6)), images=1), [frame])
    return int((prompt.input_ids == model.image_token_id).sum())


@pytest.mark.parametrize(("width", "height"), CAMERA_SIZES)
def test_a_camera_frame_of_any_size_plans_and_the_answer_says_what_the_model_saw(embedded, width, height):
    result = embedded.plan(images=[_frame(width, height)], history=np.zeros((7, 6)), command="go_straight")
    (seen,) = result.image_sizes_px
    low, high = (embedded.model.image_processor.size[k] for k in ("shortest_edge", "longest_edge"))
    assert seen[0] % 28 == 0 and seen[1] % 28 == 0 and low <= seen[0] * seen[1] <= high
    assert abs(seen[0] / seen[1] - width / height) < 0.35  # the aspect kept as closely as the grid allows
    assert result.to_json()["image_sizes_px"] == [list(seen)]
    assert len(result.token_ids) > 0


def test_the_pixel_range_is_overridable_per_planner_and_bounds_the_image_tokens():
    small, large = load("default"), load("default", image_max_pixels=401_408)
    frame = _frame(1920, 1080)
    assert _image_tokens(small, frame) <= small.model.image_processor.size["longest_edge"] // (28 * 28)
    tokens = _image_tokens(large, frame)
    assert _image_tokens(small, frame) < tokens <= 512
    with pytest.raises(ValueError, match="min_pixels 9000 is more than max_pixels 4000"):
        large.model.set_image_pixels(9000, 4000)


def test_training_honours_image_max_pixels_for_a_model_folder(tmp_path):
    config = load_config(
        "tiny-sasd",
        init_from=str(model_path("default")),
        image_max_pixels=401_408,
        data=str(tmp_path / "data"),
        out=str(tmp_path / "run"),
    )
    model = initial_model(config)
    assert model.image_processor.size["longest_edge"] == 401_408
    assert 0 < _image_tokens(Planner(model), _frame(1920, 1080)) <= 512
    with pytest.raises(ValueError, match="image_min_pixels 500000 is more than image_max_pixels 401408"):
        load_config("tiny-sasd", image_max_pixels=401_408, image_min_pixels=500_000)


def test_plan_on_the_command_line_takes_a_large_jpeg(tmp_path):
    (tmp_path / "cam.jpg").write_bytes(_jpeg(_frame(1600, 900)))
    history = json.dumps(np.zeros((7, 6)).tolist())
    args = ["plan", "--image", str(tmp_path / "cam.jpg"), "--history", history, "--command", "go_left", "--json"]
    result = CliRunner().invoke(app, [*args, "--decoder", "ar-jump"])
    assert result.exit_code in (0, 1), result.output  # 1 only when the tiny model's answer does not parse
    answer = json.loads(result.stdout)
    assert len(answer["image_sizes_px"]) == 1 and answer["token_ids"]
    wide = CliRunner().invoke(app, [*args, "--image-max-pixels", "401408", "--image-min-pixels", "500000"])
    assert wide.exit_code == 2 and "--image-min-pixels 500000 is more than --image-max-pixels" in wide.output


def test_the_service_takes_a_1920x1080_jpeg(embedded):
    body = {
        "images": [base64.b64encode(_jpeg(_frame(1920, 1080))).decode()],
        "history": np.zeros((7, 6)).tolist(),
        "command": "go_straight",
        "decoder": "ss",
    }
    with running(create_app(lambda: embedded, "ss", max_queue=2, timeout_s=60)) as base:
        reply = httpx.post(base + "/v1/plan", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["image_sizes_px"]) == 1


def test_a_text_only_model_given_images_is_refused():
    planner = Planner(text_model())
    with pytest.raises(SampleError, match="text-only model: it cannot see the 1 camera image"):
        planner.plan(images=[_frame(56, 56)], history=np.zeros((7, 6)), command="go_straight")
    scene = PlanInputs.checked(images=[_frame(56, 56)], history=np.zeros((7, 6)), command="go_straight")
    with pytest.raises(SampleError, match="text-only model"):
        planner.plan(scene, "ar")
    assert planner.plan(history=np.zeros((7, 6)), command="go_straight", decoder="ar").token_ids


@pytest.mark.parametrize(
    ("model_type", "words"),
    [
        ("qwen2_vl", "a Qwen2-VL model, which fastddrive does not run"),
        ("fast_dllm_qwen2_5_vl", "fastddrive import-official SRC OUT"),
        ("fast_dvlm", "fastddrive import-official SRC OUT"),
    ],
)
def test_a_foreign_model_type_is_named_before_any_weight_is_read(tmp_path, model_type, words):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ModelFileError, match=words):
        check_model_folder(tmp_path)
    history = json.dumps(np.zeros((7, 6)).tolist())
    result = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--history", history, "--command", "go_left"])
    assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output


CAMERAS = ["FRONT_LEFT", "FRONT", "FRONT_RIGHT"]


@pytest.fixture(scope="module")
def three_cameras(tmp_path_factory):
    """The embedded model's folder declaring three separate cameras (the official release's layout)."""
    import shutil

    folder = tmp_path_factory.mktemp("cameras") / "model"
    shutil.copytree(model_path("default"), folder)
    info = json.loads((folder / "fastddrive.json").read_text())
    (folder / "fastddrive.json").write_text(json.dumps(info | {"cameras": CAMERAS}))
    return folder


def test_a_model_of_separate_cameras_takes_one_image_per_camera(three_cameras, scenes):
    planner = load(three_cameras)
    history = np.zeros((7, 6))
    frames = [_frame(1920, 1280, seed) for seed in range(3)]
    result = planner.plan(images=frames, history=history, command="go_straight", decoder="ar-jump")
    assert len(result.image_sizes_px) == 3
    with pytest.raises(SampleError, match="takes 3 cameras as separate images, in this order: FRONT_LEFT, FRONT"):
        planner.plan(images=frames[:1], history=history, command="go_straight")
    # A data set's joined frame is cut into the model's cameras.
    assert len(planner.plan(scenes[0], "ar-jump").image_sizes_px) == 3
    assert len(load("default").plan(scenes[0], "ar-jump").image_sizes_px) == 1


def test_plan_names_the_cameras_on_the_command_line(three_cameras, tmp_path):
    paths = []
    for seed, name in enumerate(CAMERAS):
        paths.append(tmp_path / f"{name}.jpg")
        paths[-1].write_bytes(_jpeg(_frame(1600, 900, seed)))
    history = json.dumps(np.zeros((7, 6)).tolist())
    base = ["plan", "--model", str(three_cameras), "--history", history, "--command", "go_right", "--json"]
    named = [arg for name, path in zip(CAMERAS, paths, strict=True) for arg in ("--camera", f"{name}={path}")]
    result = CliRunner().invoke(app, [*base, *reversed_pairs(named), "--decoder", "ar-jump"])
    assert result.exit_code in (0, 1), result.output
    assert len(json.loads(result.stdout)["image_sizes_px"]) == 3
    wrong = CliRunner().invoke(app, [*base, "--camera", f"REAR={paths[0]}"])
    assert wrong.exit_code == 2 and "unknown camera 'REAR'; this model takes 3 cameras" in wrong.output
    one = CliRunner().invoke(app, [*base, "--image", str(paths[0])])
    assert one.exit_code == 2 and "takes 3 cameras as separate images" in " ".join(one.output.split())
    joined = CliRunner().invoke(app, [*base[:1], *base[3:], "--camera", f"FRONT={paths[0]}"])
    assert joined.exit_code == 2 and "reads one frame" in joined.output


def reversed_pairs(args: list[str]) -> list[str]:
    """--camera pairs given in the reverse of the model's order: the order is the model's, not the user's."""
    pairs = [args[k : k + 2] for k in range(0, len(args), 2)]
    return [a for pair in reversed(pairs) for a in pair]
