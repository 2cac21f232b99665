"""Property tests of the planner's inputs (issue 32, items 5 and 7): any history, image list or image bytes is
either accepted or refused with a SampleError in one line, never another exception; what is too large (a
decompression bomb, a million history rows, a list nested past the recursion limit) is refused from its
header or its first level, before anything is decoded or walked."""

import io
import json
import math
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image, JpegImagePlugin, PngImagePlugin

from fastddrive.core.inputs import MAX_HISTORY_BYTES, MAX_IMAGE_PIXELS, image_from_bytes, read_history, read_image
from fastddrive.core.sample import SampleError
from fastddrive.planner import MAX_IMAGES, PlanInputs

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
GOOD_HISTORY = [[-2.5 * (6 - k), 0.0, 5.0, 0.0, 0.0, 0.0] for k in range(7)]

numbers = st.one_of(st.floats(), st.integers(), st.booleans(), st.just(math.nan), st.just(math.inf))
arrays = hnp.arrays(
    st.sampled_from([np.float64, np.int8, np.bool_, object]), hnp.array_shapes(min_dims=0, max_dims=2, max_side=7)
)
leaves = st.one_of(numbers, st.none(), st.text(max_size=5), st.binary(max_size=5), st.complex_numbers(), arrays)
nested = st.recursive(leaves, lambda inner: st.lists(inner, max_size=8) | st.tuples(inner, inner), max_leaves=60)


@st.composite
def near_histories(draw):
    """7 x 6 of numbers, with a row or a value sometimes missing, added, or of another type."""
    rows = draw(st.integers(5, 9))
    table = [draw(st.lists(numbers, min_size=5, max_size=7)) for _ in range(rows)]
    if draw(st.booleans()):
        table = [[float(v) for v in GOOD_HISTORY[k]] for k in range(7)]
        k, j = draw(st.integers(0, 6)), draw(st.integers(0, 5))
        table[k][j] = draw(leaves)
    return draw(st.sampled_from([table, tuple(table), json.loads(json.dumps(table, default=str))]))


histories = st.one_of(
    nested,
    near_histories(),
    hnp.arrays(
        st.sampled_from([np.float64, np.float32, np.int8, np.bool_, np.complex64, object, "U3"]),
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=8) | st.just((7, 6)),
    ),
)


def _accepted_or_refused(**fields):
    try:
        scene = PlanInputs.checked(**fields)
    except SampleError as err:
        assert "\n" not in str(err) and len(str(err)) < 400, str(err)
        return None
    return scene


@FUZZ
@given(history=histories)
def test_any_history_is_accepted_finite_or_refused_in_one_line(history):
    scene = _accepted_or_refused(images=(), history=history, command="go_straight")
    if scene is not None:
        assert scene.history.shape == (7, 6) and scene.history.dtype == np.float64
        assert np.isfinite(scene.history).all()


images_values = st.one_of(
    nested,
    hnp.arrays(
        st.sampled_from([np.uint8, np.uint16, np.float32]),
        st.sampled_from([(28, 28, 3), (56, 28, 3), (28, 28), (28, 28, 4), (27, 28, 3), (0, 28, 3), (28, 28, 3, 1)]),
    ),
    st.lists(hnp.arrays(np.uint8, st.sampled_from([(28, 28, 3), (28, 56, 3), (28, 28, 1), (30, 28, 3)])), max_size=3),
)


@FUZZ
@given(images=images_values, command=st.one_of(st.sampled_from(["go_straight", "go_left"]), st.text(), leaves))
def test_any_images_and_command_are_accepted_or_refused_in_one_line(images, command):
    scene = _accepted_or_refused(images=images, history=GOOD_HISTORY, command=command)
    if scene is not None:
        assert all(im.dtype == np.uint8 and im.ndim == 3 and im.shape[2] == 3 for im in scene.images)


def test_a_huge_or_deep_history_is_refused_at_its_first_level():
    class Unwalkable(list):
        def __iter__(self):
            raise AssertionError("the rows were walked")

    deep: list = []
    for _ in range(100_000):  # past the recursion limit of anything that walks it
        deep = [deep]
    for history, message in [
        (Unwalkable([[0.0] * 6] * 3_000_000), "got 3000000 rows"),
        (deep, "got 1 rows"),
        ([np.zeros(())] * 7, "row 0 is an array of shape ()"),
        ([np.zeros((6, 1))] * 7, "row 0 is an array of shape (6, 1)"),
        ([deep] * 7, "row 0 has 1 values"),
        ([[0.0] * 6] * 6 + [[0.0] * 5 + [deep]], "row 6 holds"),
        (np.zeros((3_000_000, 6)), "shape (3000000, 6)"),
        ({"x": 1}, "got dict"),
        ("[[0, 0, 0, 0, 0, 0]]", "got str"),
    ]:
        with pytest.raises(SampleError, match=r"history must be 7 rows") as err:
            PlanInputs.checked(images=(), history=history, command="go_straight")
        assert message in str(err.value)


def test_too_many_or_too_large_images_are_refused():
    frame = np.zeros((28, 28, 3), np.uint8)
    with pytest.raises(SampleError, match=f"{MAX_IMAGES + 1} images given; a scene takes at most {MAX_IMAGES}"):
        PlanInputs.checked(images=[frame] * (MAX_IMAGES + 1), history=GOOD_HISTORY, command="go_straight")
    side = 28 * math.ceil(math.sqrt(MAX_IMAGE_PIXELS) / 28)  # the smallest square over the limit: a view, no memory
    huge = np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (side, side, 3))
    with pytest.raises(SampleError, match=f"more than the {MAX_IMAGE_PIXELS} px"):
        PlanInputs.checked(images=[huge], history=GOOD_HISTORY, command="go_straight")
    with pytest.raises(SampleError, match="unknown navigation command 'xxx"):
        PlanInputs.checked(images=(), history=GOOD_HISTORY, command="x" * 10**6)


# --- image bytes -------------------------------------------------------------------------------------------------


def _encoded(kind: str, seed: int = 0, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (28, 56, 3), dtype=np.uint8)
    data = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(data, kind)
    return data.getvalue()


VALID = [_encoded("PNG"), _encoded("JPEG"), _encoded("PNG", 1, "P"), _encoded("JPEG", 2, "L"), _encoded("PNG", 3, "LA")]


@st.composite
def damaged_images(draw):
    """A valid PNG or JPEG cut short, with bytes overwritten, or with bytes inserted."""
    data = bytearray(draw(st.sampled_from(VALID)))
    how = draw(st.sampled_from(["cut", "flip", "insert"]))
    if how == "cut":
        return bytes(data[: draw(st.integers(0, len(data)))])
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    at = draw(st.integers(0, len(data)))
    return bytes(data[:at]) + draw(st.binary(min_size=1, max_size=64)) + bytes(data[at:])


def _decoded_or_refused(data: bytes) -> None:
    try:
        image = image_from_bytes(data)
    except SampleError as err:
        assert "\n" not in str(err), str(err)
        return
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3


@FUZZ
@given(data=st.one_of(st.binary(max_size=200), damaged_images()))
def test_any_bytes_decode_to_rgb_or_are_refused_in_one_line(data):
    _decoded_or_refused(data)


def test_valid_images_decode_to_rgb():
    for data in VALID:
        assert image_from_bytes(data).shape == (28, 56, 3)


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_bomb(width: int, height: int) -> bytes:
    """A few hundred bytes of PNG whose header claims width x height RGB pixels (all zero once inflated)."""
    header = _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    rows = zlib.compress(b"\0" * (1 + 3 * min(width, 4096)) * 64, 9)
    return b"\x89PNG\r\n\x1a\n" + header + _chunk(b"IDAT", rows) + _chunk(b"IEND", b"")


def jpeg_bomb(width: int, height: int) -> bytes:
    """A small JPEG whose frame header (SOF0) is rewritten to claim width x height pixels."""
    data = bytearray(_encoded("JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.fixture
def no_decoding(monkeypatch):
    """Any pixel decoding fails the test: a refusal must come from the header alone."""

    def refuse(*args, **kwargs):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr("fastddrive.core.sample.pyspng.load", refuse)
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", refuse)
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "load", refuse)


# 6000 x 6000 is over this limit and under Pillow's (89 MP, where it warns); 60000 x 60000 is over twice
# Pillow's, where its DecompressionBombError escaped `read_image` as a traceback.
BOMBS = [(6000, 6000), (60_000, 60_000), (65_535, 65_535)]


@pytest.mark.parametrize(("width", "height"), BOMBS)
@pytest.mark.parametrize("bomb", [png_bomb, jpeg_bomb])
def test_a_decompression_bomb_is_refused_from_its_header(no_decoding, tmp_path, bomb, width, height):
    data = bomb(width, height)
    assert len(data) < 2000
    message = f"is {width}x{height} px, more than the {MAX_IMAGE_PIXELS} px an image may have"
    with pytest.raises(SampleError, match=message):
        image_from_bytes(data)
    path = tmp_path / "bomb.img"
    path.write_bytes(data)
    with pytest.raises(SampleError, match=f"image {path} {message}"):
        read_image(path)


def test_read_image_refuses_what_is_not_a_png_or_jpeg_file(tmp_path):
    gif = tmp_path / "frame.gif"
    Image.new("RGB", (28, 28)).save(gif)
    for path, message in [
        (tmp_path, "is not a file"),
        (tmp_path / "missing.png", "is not a file"),
        (gif, "is not a PNG or JPEG"),
    ]:
        with pytest.raises(SampleError, match=message):
            read_image(path)
    good = tmp_path / "frame.png"
    good.write_bytes(VALID[0])
    assert read_image(good).shape == (28, 56, 3)


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=60),
        st.integers(1, 3000).map(lambda n: "[" * n),
        nested.map(lambda v: json.dumps(v, default=str)),
    )
)
def test_any_history_text_is_json_or_refused_in_one_line(text):
    try:
        read_history(text)
    except SampleError as err:
        assert "\n" not in str(err)


def test_history_files_and_texts_that_are_not_json_are_refused(tmp_path):
    latin = tmp_path / "latin.json"
    latin.write_bytes(b"[\xe9]")
    big = tmp_path / "big.json"
    big.write_text("[" + " " * MAX_HISTORY_BYTES + "]")
    for text, message in [
        (str(latin), "is not UTF-8 text"),
        (str(big), "is larger than"),
        (str(tmp_path / "missing.json"), "does not exist"),
        (str(tmp_path / ("x" * 5000)) + ".json", "cannot read --history file"),
        ("[" * 10_000, "is not valid JSON"),
        ("[" + "9" * 5000 + "]", "is not valid JSON"),
        (" " * (MAX_HISTORY_BYTES + 1), "more than 7 rows of numbers take"),
    ]:
        with pytest.raises(SampleError, match=message):
            read_history(text)
    good = tmp_path / "history.json"
    good.write_text(json.dumps(GOOD_HISTORY))
    assert read_history(str(good)) == GOOD_HISTORY


def test_plan_refuses_a_bomb_image_in_one_line_before_loading(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fastddrive.cli import app

    monkeypatch.setattr("fastddrive.planner.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_bomb(60_000, 60_000))
    args = ["plan", "--image", str(bomb), "--history", json.dumps(GOOD_HISTORY), "--command", "go_straight"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "is 60000x60000 px, more than the 33177600 px an image may have" in " ".join(result.output.split())
