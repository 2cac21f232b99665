"""The planner's inputs from files, text and bytes: shared by the command line and the service.

Images are PNG or JPEG, read as (H, W, 3) uint8 RGB, at most MAX_IMAGE_PIXELS each: the size in the header is
checked before anything is decoded, so a decompression bomb (a few KB claiming gigapixels) is refused without
allocating. The history is JSON (7 rows of x, y, vx, vy, ax, ay). Every failure is a SampleError in one line;
the shapes and ranges are then checked by `PlanInputs`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image, JpegImagePlugin, PngImagePlugin

from fastddrive.core.sample import PNG_SIGNATURE, SampleError, decode_png

IMAGE_FORMATS = ("PNG", "JPEG")
JPEG_SIGNATURE = b"\xff\xd8\xff"
# An 8K frame (7680 x 4320, 100 MB as RGB): larger than any driving camera (1920 x 1280 in WOD-E2E; the model
# sees 448 x 224), and well below Pillow's own bomb limit (89 MP), which warns first and refuses only at twice it.
MAX_IMAGE_PIXELS = 7680 * 4320
MAX_HISTORY_BYTES = 64 * 1024  # 7 rows of 6 numbers are a few hundred bytes of JSON, however they are written
# What Pillow's plugins raise on damaged or cut bytes, while reading a header or decoding.
_DAMAGED = (
    OSError,
    SyntaxError,
    ValueError,
    IndexError,
    TypeError,
    struct.error,
    EOFError,
    Image.DecompressionBombError,
)


def check_pixels(width: int, height: int, what: str = "image") -> None:
    """SampleError unless an image of width x height px has pixels and at most MAX_IMAGE_PIXELS of them."""
    if width * height > MAX_IMAGE_PIXELS:
        raise SampleError(f"{what} is {width}x{height} px, more than the {MAX_IMAGE_PIXELS} px an image may have")
    if width < 1 or height < 1:
        raise SampleError(f"{what} is {width}x{height} px: it has no pixels")


def _opened(stream: BinaryIO, what: str) -> Image.Image:
    """The PNG or JPEG in `stream` with its header read and its size checked, nothing decoded. Each format's own
    plugin opens it: `Image.open` would first check the size against Pillow's larger limit, with a warning."""
    head = stream.read(len(PNG_SIGNATURE))
    stream.seek(0)
    for signature, kind, opener in (
        (PNG_SIGNATURE, "PNG", PngImagePlugin.PngImageFile),
        (JPEG_SIGNATURE, "JPEG", JpegImagePlugin.JpegImageFile),
    ):
        if head.startswith(signature):
            try:
                image = opener(stream)
            except _DAMAGED:
                raise SampleError(f"{what} is not a readable {kind}") from None
            check_pixels(*image.size, what)
            return image
    raise SampleError(f"{what} is not a PNG or JPEG")


def _rgb(image: Image.Image, what: str) -> np.ndarray:
    try:
        return np.asarray(image.convert("RGB"))
    except _DAMAGED as err:
        raise SampleError(f"{what} is not a readable {image.format} ({str(err).splitlines()[0]})") from None


def read_image(path: Path) -> np.ndarray:
    """A PNG or JPEG file as (H, W, 3) uint8 RGB."""
    what = f"image {path}"
    if not Path(path).is_file():  # a folder, a FIFO (opening it would wait for a writer) or nothing
        raise SampleError(f"{what} is not a file")
    try:
        with open(path, "rb") as stream, _opened(stream, what) as image:
            return _rgb(image, what)
    except OSError as err:
        raise SampleError(f"cannot read {what}: {err.strerror or err}") from None


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of PNG or JPEG bytes, read from the header (nothing is decoded); None for bytes of
    another format (`image_from_bytes` refuses them), SampleError for a damaged header."""
    if data.startswith(PNG_SIGNATURE):  # libspng reads the size from the IHDR chunk, always the first
        if len(data) < 24 or data[12:16] != b"IHDR":
            raise SampleError("image is not a readable PNG")
        width, height = struct.unpack(">II", data[16:24])
        return width, height
    if data.startswith(JPEG_SIGNATURE):
        try:  # the plugin reads the markers up to the frame header; the pixels are never loaded
            with JpegImagePlugin.JpegImageFile(io.BytesIO(data)) as image:
                return image.size
        except _DAMAGED:
            raise SampleError("image is not a readable JPEG") from None
    return None


def image_from_bytes(data: bytes) -> np.ndarray:
    """PNG or JPEG bytes as (H, W, 3) uint8 RGB; other formats are refused (a service takes no TIFF or GIF)."""
    if data.startswith(PNG_SIGNATURE):
        check_pixels(*image_size(data))  # before libspng allocates for the size the header claims
        return decode_png(data)
    with _opened(io.BytesIO(data), "image") as image:
        return _rgb(image, "image")


def image_from_base64(text: str) -> np.ndarray:
    """Base64 PNG or JPEG (a `data:image/...;base64,` prefix is allowed) as (H, W, 3) uint8 RGB."""
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise SampleError("image is not valid base64") from None
    return image_from_bytes(data)


def read_history(text: str) -> Any:
    """The `--history` value: JSON text, or the name of a .json file holding it; at most MAX_HISTORY_BYTES."""
    raw = _history_file(Path(text)) if text.strip().endswith(".json") else text
    if len(raw) > MAX_HISTORY_BYTES:
        raise SampleError(
            f"--history holds {len(raw)} characters, more than 7 rows of numbers take ({MAX_HISTORY_BYTES})"
        )
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # not JSON, a number of more digits than Python reads, too deep
        raise SampleError(f"--history is not valid JSON ({err}); give 7 rows of [x, y, vx, vy, ax, ay]") from None


def _history_file(source: Path) -> str:
    try:
        size = source.stat().st_size if source.is_file() else None
    except (OSError, ValueError) as err:  # a name too long, or with a NUL byte
        raise SampleError(f"cannot read --history file {source}: {getattr(err, 'strerror', None) or err}") from None
    if size is None:
        raise SampleError(f"--history file {source} does not exist or is not a file")
    if size > MAX_HISTORY_BYTES:
        raise SampleError(f"--history file {source} is larger than 7 rows of numbers take ({MAX_HISTORY_BYTES} B)")
    try:
        return source.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise SampleError(f"--history file {source} is not UTF-8 text") from None
    except OSError as err:
        raise SampleError(f"cannot read --history file {source}: {err.strerror or err}") from None
