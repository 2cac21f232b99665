"""Training checkpoints: written atomically, validated on resume, never unpickled.

A checkpoint folder holds the model (safetensors + config + tokenizer + image processor +
fastddrive.json), the optimizer state as safetensors plus JSON, the scheduler and trainer state as
JSON. Randomness is a pure function of (seed, step), so no RNG state needs saving.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from fastddrive.model import BlockDiffusionModel
from fastddrive.model_files import save_model

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_GROUPS = "optimizer.json"
SCHEDULER_STATE = "scheduler.json"
_NAME = re.compile(r"^checkpoint-(\d{6})$")


class CheckpointError(ValueError):
    """A checkpoint folder that is partial or corrupt."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / f"checkpoint-{step:06d}"


def save_checkpoint(
    out: Path,
    step: int,
    model: BlockDiffusionModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint-STEP atomically (a temporary folder renamed at the end); keep the newest `keep`."""
    final = checkpoint_dir(out, step)
    tmp = out / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp)
    tensors, groups = _optimizer_to_safe(optimizer.state_dict())
    save_file(tensors, str(tmp / OPTIMIZER_TENSORS))
    (tmp / OPTIMIZER_GROUPS).write_text(json.dumps(groups))
    scheduler_state = scheduler.state_dict()  # lr_lambdas is [None] for plain functions: JSON-safe
    (tmp / SCHEDULER_STATE).write_text(json.dumps(scheduler_state))
    (tmp / TRAINER_STATE).write_text(json.dumps({**state, "step": step}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
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


def validate_checkpoint(path: Path) -> Checkpoint:
    """Raise CheckpointError unless every file of the checkpoint is present and readable."""
    required = ("config.json", "model.safetensors", TRAINER_STATE, OPTIMIZER_TENSORS, OPTIMIZER_GROUPS, SCHEDULER_STATE)
    missing = [name for name in required if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"{path.name} is partial: {', '.join(missing)} missing")
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
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
    return Checkpoint(path, step, state)


def latest_checkpoint(out: Path, warn: Any = print) -> Checkpoint | None:
    """The newest valid checkpoint; a corrupt or partial newer one is reported and skipped."""
    for path in reversed(list_checkpoints(out)):
        try:
            return validate_checkpoint(path)
        except CheckpointError as err:
            warn(f"refusing checkpoint {err}; using the previous one")
    return None
