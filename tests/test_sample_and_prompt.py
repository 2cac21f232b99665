import numpy as np
import pytest

from fastddrive.data.sample import CameraView, DrivingSample, SampleError, from_row, to_row
from fastddrive.prompt import chat_text, user_text
from fastddrive.schema import example_response


def _sample(**changes):
    fields = dict(
        sample_id="s",
        scenario="highway",
        episode_seed=1,
        time_s=3.0,
        image=np.full((224, 448, 3), 90, dtype=np.uint8),
        history=np.zeros((7, 6)),
        command="go_straight",
        future=np.stack([np.arange(1, 21) * 5.0, np.zeros(20)], axis=1),
        future_time_s=np.arange(1, 21) * 0.25,
        response=example_response(),
        view=CameraView(5.5, (134.4, 112.0), 0.0),
    )
    return DrivingSample(**{**fields, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"image": np.zeros((100, 100, 3), dtype=np.uint8)}, "not a multiple of 28"),
        ({"image": np.zeros((224, 448), dtype=np.uint8)}, r"\(H, W, 3\) uint8"),
        ({"image": np.zeros((224, 448, 3), dtype=np.float32)}, r"\(H, W, 3\) uint8"),
        ({"image": [[0]]}, "must be a numpy array, got list"),
        ({"history": np.zeros((6, 6))}, "history must be 7 rows"),
        ({"history": np.full((7, 6), np.nan)}, "NaN"),
        ({"command": "turn_around"}, "unknown navigation command 'turn_around'"),
        ({"future": np.zeros((5, 2))}, "future must be 20"),
    ],
)
def test_a_malformed_sample_names_the_problem(changes, message):
    with pytest.raises(SampleError, match=message):
        _sample(**changes)


def test_a_sample_survives_its_parquet_row():
    sample = _sample(agents=np.ones((2, 21, 3)), agent_size=np.array([[5.0, 2.0], [4.0, 1.8]]))
    back = from_row(to_row(sample))
    assert back.response == sample.response
    assert np.array_equal(back.image, sample.image)
    assert back.agents.shape == (2, 21, 3) and np.allclose(back.agent_size, sample.agent_size)
    assert back.view == sample.view


def test_the_camera_view_maps_forward_right_and_left_left():
    view = CameraView(pixels_per_metre=10.0, ego_pixel=(100.0, 50.0), ego_heading_rad=0.0)
    forward, left = view.to_pixels(np.array([[1.0, 0.0], [0.0, 1.0]]))
    assert tuple(forward) == (110.0, 50.0)
    assert tuple(left) == (100.0, 40.0)  # image y grows downwards: left of an eastbound car is up
    south = CameraView(10.0, (100.0, 50.0), np.pi / 2)  # heading down the image
    assert np.allclose(south.to_pixels(np.array([[0.0, 1.0]])), [[110.0, 50.0]])  # its left is east


def test_the_prompt_states_velocity_acceleration_and_past_positions():
    history = np.arange(42, dtype=float).reshape(7, 6) / 10
    text = user_text("go_left", history)
    assert text == (
        "Command: go_left. Velocity +3.8 +3.9. Acceleration +4.0 +4.1. Past positions +0.0 +0.1 +1.2 +1.3 +2.4 +2.5."
    )
    noisy = history.copy()
    noisy[-1, 2:6] = [-1e-17, -0.04, 0.04, -0.06]  # float noise around zero is +0.0; a real -0.06 stays -0.1
    assert "Velocity +0.0 +0.0. Acceleration +0.0 -0.1." in user_text("go_left", noisy)
    assert chat_text("go_left", history).count("<|image_pad|>") == 1
    assert chat_text("go_left", history).endswith("<|im_start|>assistant\n")
    with pytest.raises(SampleError, match="unknown navigation command"):
        user_text("left", history)
    with pytest.raises(SampleError, match="history must be 7 rows"):
        user_text("go_left", history[:3])
