"""The planner's inputs from files, text and bytes: shared by the command line and the service.

Images are PNG or JPEG, read as (H, W, 3) uint8 RGB; the history is JSON (7 rows of x, y, vx, vy, ax, ay).
Every failure is a SampleError in one line; the shapes and ranges are then checked by `PlanInputs`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from fastddrive.data.sample import PNG_SIGNATURE, SampleError, decode_png

IMAGE_FORMATS = ("PNG", "JPEG")


def read_image(path: Path) -> np.ndarray:
    """An image file as (H, W, 3) uint8 RGB."""
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, UnidentifiedImageError) as err:
        raise SampleError(f"cannot read image {path}: {err}") from None


def image_from_bytes(data: bytes) -> np.ndarray:
    """PNG or JPEG bytes as (H, W, 3) uint8 RGB; other formats are refused (a service takes no TIFF or GIF)."""
    if data.startswith(PNG_SIGNATURE):
        return decode_png(data)
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in IMAGE_FORMATS:
                raise SampleError(f"image is {image.format or 'of an unknown format'}; give PNG or JPEG")
            return np.asarray(image.convert("RGB"))
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError):
        raise SampleError("image is not a readable PNG or JPEG") from None


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
    """The `--history` value: JSON text, or the name of a .json file holding it."""
    source = Path(text)
    if source.suffix == ".json" and not source.is_file():
        raise SampleError(f"--history file {source} does not exist")
    raw = source.read_text() if source.suffix == ".json" else text
    try:
        return json.loads(raw)
    except json.JSONDecodeError as err:
        raise SampleError(f"--history is not valid JSON ({err}); give 7 rows of [x, y, vx, vy, ax, ay]") from None
