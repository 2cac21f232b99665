import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from fastddrive.core.inputs import image_from_bytes
from fastddrive.core.prompt import chat_text, user_text
from fastddrive.core.sample import CameraView, DrivingSample, SampleError, decode_png
from fastddrive.core.schema import example_response
from fastddrive.data.dataset import from_row, to_row


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
        ({"image": np.zeros((300, 1, 3), dtype=np.uint8)}, "sides differ by more than 200 times"),
        ({"image": np.zeros((0, 28, 3), dtype=np.uint8)}, "it has no pixels"),
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


def _png(image: Image.Image) -> bytes:
    data = io.BytesIO()
    image.save(data, "PNG")
    return data.getvalue()


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "1"])
def test_png_frames_decode_to_the_rgb_pillow_gives(mode):
    pixels = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    data = _png(Image.fromarray(pixels).convert(mode))
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    for decoded in (decode_png(data), image_from_bytes(data)):
        assert decoded.dtype == np.uint8 and decoded.shape == (56, 84, 3)
        np.testing.assert_array_equal(decoded, expected)


def test_sixteen_bit_png_channels_are_scaled_to_eight():
    levels = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)  # 0, 1, 128, 255 in 8 bits
    decoded = decode_png(_png(Image.fromarray(levels)))
    np.testing.assert_array_equal(decoded[0, :, 0], [0, 1, 128, 255])
    assert (decoded == decoded[..., :1]).all()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_a_damaged_or_oversized_png_is_refused_in_one_line():
    data = _png(Image.new("RGB", (56, 28)))
    with pytest.raises(SampleError, match="not a readable PNG"):
        decode_png(data[:60])  # cut inside its pixels
    with pytest.raises(SampleError, match="not a readable PNG"):
        decode_png(b"GIF89a" + data[6:])
    # A header claiming 100,000 x 100,000 px is refused before anything is allocated.
    header = _chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
    with pytest.raises(SampleError, match="100000x100000 px, more than"):
        decode_png(data[:8] + header + _chunk(b"IEND", b""))
