"""Training checkpoints: written atomically, checksummed, verified on resume, never unpickled.

A checkpoint folder holds the model (safetensors + config + tokenizer + image processor +
fastddrive.json), the optimizer state as safetensors plus JSON, the scheduler and trainer state as
JSON, and `checksums.json`: the size and sha256 of every other file, so that a file damaged on disk is
found on resume (issue 32) instead of training on from it. The trainer state records what the run was
trained on (the config and a fingerprint of the data) for `--resume` to compare. Randomness is a pure
function of (seed, step), so no RNG state needs saving.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from fastddrive.core.outputs import is_temporary, replace_folder
from fastddrive.engine.model import BlockDiffusionModel
from fastddrive.engine.model_files import sync_files, write_model_files

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_GROUPS = "optimizer.json"
SCHEDULER_STATE = "scheduler.json"
CHECKSUMS = "checksums.json"
FORMAT = 2  # trainer_state.json's "format": 2 has checksums.json; checkpoints without a format predate it
_NAME = re.compile(r"^checkpoint-(\d{6})$")


class CheckpointError(ValueError):
    """A checkpoint folder that is partial or corrupt."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]
    verified: bool = True  # False for a checkpoint written before checksums were recorded


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / f"checkpoint-{step:06d}"


def file_record(path: Path) -> dict[str, Any]:
    """Size and sha256 of a file, read in chunks (a 3B model's weights do not fit twice in memory)."""
    with path.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def save_checkpoint(
    out: Path,
    step: int,
    model: BlockDiffusionModel,
    optimizer_state: dict[str, Any],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    keep: int,
    core: PreTrainedModel | None = None,
) -> Path:
    """Write checkpoint-STEP atomically (a temporary folder, fsynced, renamed at the end) with the checksums of
    its files; keep the newest `keep`. A sharded run passes its model and optimizer state gathered whole (`core`
    stands for the model's transformers model)."""
    final = checkpoint_dir(out, step)
    tmp = out / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_model_files(model, tmp, core)
    tensors, groups = _optimizer_to_safe(optimizer_state)
    save_file(tensors, str(tmp / OPTIMIZER_TENSORS))
    (tmp / OPTIMIZER_GROUPS).write_text(json.dumps(groups))
    scheduler_state = scheduler.state_dict()  # lr_lambdas is [None] for plain functions: JSON-safe
    (tmp / SCHEDULER_STATE).write_text(json.dumps(scheduler_state))
    (tmp / TRAINER_STATE).write_text(json.dumps({**state, "step": step, "format": FORMAT}, indent=2))
    files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
    (tmp / CHECKSUMS).write_text(json.dumps({"files": {name: file_record(tmp / name) for name in files}}, indent=2))
    sync_files(tmp)
    replace_folder(tmp, final)
    for old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old)
    return final


def _optimizer_to_safe(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    for index, entries in state_dict["state"].items():
        for name, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{name}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_state(path: Path) -> dict[str, Any]:
    """The optimizer state_dict of a checkpoint, rebuilt from safetensors + JSON."""
    tensors = load_file(str(path / OPTIMIZER_TENSORS))
    groups = json.loads((path / OPTIMIZER_GROUPS).read_text())
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *groups["scalars"].items()]:
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": groups["param_groups"]}


def scheduler_state(path: Path) -> dict[str, Any]:
    return json.loads((path / SCHEDULER_STATE).read_text())


def list_checkpoints(out: Path) -> list[Path]:
    """Checkpoint folders in `out`, oldest first."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.is_dir() and _NAME.match(p.name))


def remove_leftovers(out: Path) -> list[Path]:
    """Remove the temporary folders and files an interrupted checkpoint or final save left in `out` (a 3B
    checkpoint's are tens of GB); the paths removed."""
    if not out.is_dir():
        return []
    leftovers = sorted(p for p in out.iterdir() if is_temporary(p))
    for path in leftovers:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return leftovers


def _verify_checksums(path: Path) -> None:
    """Every file checksums.json lists has its recorded size and sha256 (the size first: cheap)."""
    try:
        recorded = json.loads((path / CHECKSUMS).read_text())["files"]
        records = {str(name): (int(r["bytes"]), str(r["sha256"])) for name, r in recorded.items()}
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{path.name} is corrupt: {CHECKSUMS} is not a table of file checksums") from None
    unlisted = {TRAINER_STATE, OPTIMIZER_TENSORS, "model.safetensors"} - records.keys()
    if unlisted:
        raise CheckpointError(f"{path.name} is corrupt: {CHECKSUMS} does not list {sorted(unlisted)[0]}")
    for name, (size, sha256) in sorted(records.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path.name} is partial: {name} missing")
        if file.stat().st_size != size:
            raise CheckpointError(
                f"{path.name} is corrupt: {name} has {file.stat().st_size} bytes where {CHECKSUMS} records {size}"
            )
        digest = file_record(file)["sha256"]
        if digest != sha256:
            raise CheckpointError(
                f"{path.name} is corrupt: {name} fails its checksum (sha256 {digest[:12]}... where {CHECKSUMS} "
                f"records {sha256[:12]}...)"
            )


def validate_checkpoint(path: Path) -> Checkpoint:
    """Raise CheckpointError unless every file of the checkpoint is present, has the checksum recorded when it
    was written, and is readable."""
    required = ("config.json", "model.safetensors", TRAINER_STATE, OPTIMIZER_TENSORS, OPTIMIZER_GROUPS, SCHEDULER_STATE)
    missing = [name for name in required if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"{path.name} is partial: {', '.join(missing)} missing")
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        if not isinstance(state, dict):
            raise ValueError(f"{TRAINER_STATE} is not a JSON object")
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{path.name} is corrupt: {err}") from None
    old_format = isinstance(state.get("format", 1), int) and state.get("format", 1) < FORMAT
    verified = (path / CHECKSUMS).is_file() or not old_format
    if verified:
        if not (path / CHECKSUMS).is_file():
            raise CheckpointError(f"{path.name} is partial: {CHECKSUMS} missing")
        _verify_checksums(path)
    try:
        for name in (OPTIMIZER_GROUPS, SCHEDULER_STATE, "config.json"):
            json.loads((path / name).read_text())
        for name in ("model.safetensors", OPTIMIZER_TENSORS):
            with safe_open(str(path / name), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    handle.get_slice(key)
    except (ValueError, OSError, SafetensorError) as err:
        raise CheckpointError(f"{path.name} is corrupt: {err}") from None
    step = int(_NAME.match(path.name).group(1))
    if state.get("step") != step:
        raise CheckpointError(f"{path.name} is corrupt: its trainer state says step {state.get('step')}")
    return Checkpoint(path, step, state, verified)


def latest_checkpoint(out: Path, warn: Callable[[str], None] = print) -> Checkpoint | None:
    """The newest valid checkpoint; a corrupt or partial newer one is reported and skipped."""
    for path in reversed(list_checkpoints(out)):
        try:
            checkpoint = validate_checkpoint(path)
        except CheckpointError as err:
            warn(f"{err}; using the checkpoint before it")
            continue
        if not checkpoint.verified:
            warn(f"{path.name} records no checksums (written by an older fastddrive): its files are not verified")
        return checkpoint
    return None
