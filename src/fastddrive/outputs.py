"""The files the commands write: output paths refused before any work, and JSON that is JSON (no NaN)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fastddrive.data.sample import DatasetError


def check_outputs(*paths: Path | None) -> None:
    """Refuse, before any work, an output file whose folder does not exist or that is a folder."""
    for path in paths:
        if path is None:
            continue
        if path.is_dir():
            raise DatasetError(f"{path} is a folder; give a file name")
        if not path.parent.is_dir():
            raise DatasetError(f"cannot write {path}: the folder {path.parent} does not exist")


def check_demo_folder(out: Path) -> None:
    """Refuse a folder to write into that is a file or inside one (one that does not exist yet is made later)."""
    existing = next(folder for folder in (out, *out.parents) if folder.exists())  # what mkdir would build on
    if not existing.is_dir():
        raise DatasetError(f"--out {out}: {existing} is a file; the demo writes a folder of pictures")


def finite(value: object) -> object:
    """NaN and infinities as null, so that the JSON written is JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def finite_json(payload: object, **dumps: object) -> str:
    """`json.dumps` of `payload` with NaN and infinities as null; the payload is walked for them (`finite`)
    only when the plain rendering meets one, as the walk costs more than the rendering (a service pays it
    on every answer)."""
    try:
        return json.dumps(payload, allow_nan=False, **dumps)
    except ValueError:  # allow_nan=False met an out-of-range float
        return json.dumps(finite(payload), allow_nan=False, **dumps)


def write_json(path: Path, payload: object) -> None:
    path.write_text(finite_json(payload, indent=2))
