"""Where the commands write: destinations refused before any work, and writes that never leave a partial file.

Every writer checks its destination first (`check_file_destination`, `check_folder_destination`): not one
of the command's inputs, not inside a data set or model folder the command does not own, never inside the
installed package, a writable place, a suffix the writer can write. Every write is atomic: a temporary
file in the same folder, flushed and fsynced, then renamed over the final name (`write_bytes`,
`write_json`, `atomic_file` for writers that want a path, such as matplotlib). A folder replaced with
`--overwrite` is built beside it and swapped in only once the build succeeded (`staged_folder`).

This module uses only the standard library, so every layer (data storage included) may use it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the installed fastddrive package (this file is core/outputs.py)
MANIFEST_NAME = "manifest.json"  # data sets and trajectory collections
MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
TEMPORARY_MARK = ".tmp-"  # in the names of temporary files and folders (`is_temporary`)


class OutputError(ValueError):
    """A destination a command must not or cannot write; the message (one line) names it and why."""


# --- what a path is ------------------------------------------------------------------------------------------


def _resolved(path: Path) -> Path:
    return Path(os.path.abspath(os.path.realpath(path)))


def owner(folder: Path) -> str | None:
    """What `folder` is, if it is something the commands read and must not write into unasked: 'the
    installed fastddrive package', 'the data set' or 'the model folder'; None otherwise."""
    if folder == PACKAGE_ROOT:
        return "the installed fastddrive package"
    if (folder / MANIFEST_NAME).is_file():
        return "the data set"
    if (folder / "config.json").is_file() and any((folder / name).is_file() for name in MODEL_WEIGHTS):
        return "the model folder"
    return None


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _existing_ancestor(path: Path) -> Path:
    """The nearest of `path` and its parents that exists (what a mkdir of `path` would build on)."""
    return next(folder for folder in (path, *path.parents) if os.path.lexists(folder))


def _check_not_input(path: Path, option: str, inputs: Iterable[Path | str | None]) -> None:
    for given in inputs:
        if given is None:
            continue
        source = _resolved(Path(given))
        if _is_within(path, source):
            raise OutputError(
                f"{option} {path}: that is {'' if path == source else 'inside '}{given}, an input of "
                "this command; writing there would destroy it"
            )
        if _is_within(source, path):
            raise OutputError(
                f"{option} {path}: it holds {given}, an input of this command; writing there would destroy it"
            )


def _check_not_owned(path: Path, option: str, owned: Iterable[Path | str | None], start: Path) -> None:
    """Refuse `path` when a folder from `start` upwards is a data set, a model folder or the package that the
    command does not own (`owned`: folders it was asked to write into)."""
    mine = [_resolved(Path(folder)) for folder in owned if folder is not None]
    for folder in (start, *start.parents):
        if any(_is_within(folder, own) for own in mine) and not _is_within(folder, PACKAGE_ROOT):
            return
        what = owner(folder)
        if what is not None:
            raise OutputError(
                f"{option} {path}: it is inside {what} {folder}, which this command does not write;"
                " give a path outside it"
            )


def _check_writable(path: Path, option: str, folder: Path) -> None:
    """`folder` (or what a mkdir of it would build on) is a folder this process may write into."""
    base = _existing_ancestor(folder)
    if not base.is_dir():
        raise OutputError(f"{option} {path}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: the folder {base} is not writable")


def check_file_destination(
    path: Path | str,
    option: str,
    *,
    suffixes: Iterable[str] = (),
    inputs: Iterable[Path | str | None] = (),
    owned: Iterable[Path | str | None] = (),
    make_parents: bool = False,
) -> Path:
    """`path` if a command may write a file there, else OutputError naming `option` and the problem.

    Refused: a suffix not in `suffixes` (when given; case-insensitive); a folder or anything but a regular
    file; one of the command's `inputs` or a path inside or around one; a file inside a data set, a model
    folder or the installed package, unless inside a folder of `owned`; a folder that does not exist
    (unless `make_parents`) or cannot be written; an existing file that cannot be replaced."""
    path = Path(path)
    wanted = tuple(s.lower() for s in suffixes)
    if wanted and path.suffix.lower() not in wanted:
        raise OutputError(f"{option} {path}: this file is written as {' or '.join(wanted)}; give a name ending so")
    if os.path.lexists(path):
        mode = os.stat(path).st_mode if path.exists() else 0
        if stat.S_ISDIR(mode):
            raise OutputError(f"{option} {path}: that is a folder; give a file name")
        if not stat.S_ISREG(mode):
            raise OutputError(f"{option} {path}: that is not a regular file; give a file name")
    resolved = _resolved(path)
    _check_not_input(resolved, option, inputs)
    _check_not_owned(path, option, owned, resolved.parent)
    if not make_parents and not path.parent.is_dir():
        base = _existing_ancestor(path.parent)
        detail = f"{base} is a file" if not base.is_dir() else f"the folder {path.parent} does not exist"
        raise OutputError(f"{option} {path}: {detail}")
    _check_writable(path, option, resolved.parent)
    return path


def check_folder_destination(
    path: Path | str,
    option: str,
    *,
    inputs: Iterable[Path | str | None] = (),
    owned: Iterable[Path | str | None] = (),
    own_folder: bool = False,
) -> Path:
    """`path` if a command may write a folder there (made when missing), else OutputError: a file, a folder
    inside a file, one of the command's `inputs` or a folder inside or around one, a folder inside a data set,
    a model folder or the installed package (unless inside a folder of `owned`), or a place that cannot be
    written. The folder itself may be a data set or model folder (a command resuming or replacing its own),
    unless `own_folder`: a command that fills a folder of its own (pictures, results) is refused one."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise OutputError(f"{option} {path}: that is a file; give a folder")
    resolved = _resolved(path)
    what = owner(resolved) if own_folder else None
    if what is not None:
        raise OutputError(f"{option} {path}: that is {what}; give a folder of its own")
    _check_not_input(resolved, option, inputs)
    _check_not_owned(path, option, owned, resolved.parent)  # the folder itself may be a data set: its command's
    if resolved == PACKAGE_ROOT or _is_within(resolved, PACKAGE_ROOT):
        raise OutputError(f"{option} {path}: that is inside the installed fastddrive package; give a folder outside it")
    _check_writable(path, option, resolved)
    return path


def is_temporary(path: Path) -> bool:
    """A temporary file or folder that an interrupted writer left behind."""
    return path.name.startswith(".") and TEMPORARY_MARK in path.name


# --- atomic writes ------------------------------------------------------------------------------------------


def _temporary_name(path: Path, kind: str = "tmp") -> Path:
    # The suffix is kept, so that writers that choose a format by it (matplotlib, PIL) choose the same.
    return path.with_name(f".{path.stem}.{kind}{TEMPORARY_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}{path.suffix}")


def fsync_folder(folder: Path) -> None:
    """Make a rename inside `folder` durable (a no-op where folders cannot be opened)."""
    with suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


@contextmanager
def atomic_file(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path` (same suffix) to write; on success it is fsynced and renamed to `path`,
    on failure removed, so `path` is either what it was or whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(path)
    try:
        yield tmp
        with open(tmp, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            tmp.unlink()
        raise
    fsync_folder(path.parent)


def write_bytes(path: Path | str, data: bytes) -> None:
    """Write `data` to `path` atomically (`atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path | str, text: str) -> None:
    """Write UTF-8 `text` to `path` atomically."""
    write_bytes(path, text.encode("utf-8"))


@contextmanager
def staged_folder(out: Path | str) -> Iterator[Path]:
    """A fresh folder beside `out` to build a replacement in; on success it takes `out`'s place (the old
    content is removed only after the new one is in place), on failure it is removed and `out` is untouched."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _temporary_name(out, "staging")
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_folder(staging, out)


def replace_folder(new: Path, out: Path) -> None:
    """Put the folder `new` in `out`'s place (two renames; the old `out` is deleted last)."""
    old = _temporary_name(out, "replaced") if os.path.lexists(out) else None
    if old is not None:
        os.replace(out, old)
    os.replace(new, out)
    fsync_folder(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- JSON ---------------------------------------------------------------------------------------------------


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


def write_json(path: Path | str, payload: object) -> None:
    """`payload` as indented JSON (NaN and infinities as null), written atomically."""
    write_text(path, finite_json(payload, indent=2) + "\n")
