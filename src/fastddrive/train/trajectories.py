"""Jacobi trajectories of an AR teacher (paper 003 sections 2.1 and 3.1): collected, stored, read back.

The teacher decodes each prompt with vanilla Jacobi over blocks of n tokens, and every block's iterates,
from its first guess to its fixed point, are kept: the states Jacobi Forcing trains on (Appendix C).
The fixed points concatenated are the teacher's greedy answer (Eq. 4).

A trajectories folder holds `manifest.json` and JSON shards of `SHARD_SAMPLES` samples each. A shard is
written to a temporary file, flushed to disk and renamed (`outputs.write_bytes`), and the manifest
(rewritten the same way after each shard) holds every shard's size and sha256, checked whenever the shard
is read. Sample k's initial guesses are seeded with (seed, k), so a rerun after an interruption collects
the missing shards exactly as an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastddrive.core.outputs import OutputError, check_folder_destination, is_temporary, owner, write_bytes
from fastddrive.core.scaffold import Scaffold
from fastddrive.data.dataset import DrivingDataset, from_row
from fastddrive.decode.jacobi import Guesser, jacobi_blocks, jacobi_canvas
from fastddrive.engine.model import BlockDiffusionModel, PromptInputs
from fastddrive.engine.model_check import check_model_folder
from fastddrive.engine.model_files import model_path, read_info
from fastddrive.planner import prompt_inputs
from fastddrive.train.config import ConfigError

FORMAT = "fastddrive-jacobi-trajectories"
MANIFEST = "manifest.json"
SHARD_SAMPLES = 32


class TrajectoryError(ConfigError):
    """Trajectories that cannot be collected as asked, or a trajectories folder that cannot be used."""


@dataclass(frozen=True)
class Trajectory:
    """One sample's Jacobi decoding by the teacher.

    `answer`: the fixed points concatenated (the greedy answer, ending with <|im_end|> where the teacher
    stopped); `blocks`: per block its iterates before each forward, then its fixed point, each as long as
    the fixed point (the last block's may be shorter than n)."""

    index: int  # the sample's index in its split
    sample_id: str
    answer: list[int]
    blocks: list[list[list[int]]]

    @property
    def forwards(self) -> int:
        """Forwards spent after the prefill: one per recorded iterate before a fixed point."""
        return sum(len(states) - 1 for states in self.blocks)


def jacobi_trajectory(
    model: BlockDiffusionModel, prompt: PromptInputs, scaffold: Scaffold, block_size: int, seed: int
) -> tuple[list[int], list[list[list[int]]]]:
    """The answer ids and per block the iterates (trimmed to the fixed point's length) of vanilla Jacobi."""
    answer = jacobi_canvas(model, prompt, scaffold, room=2 * block_size)
    recorded: dict[int, list[list[int]]] = {}
    jacobi_blocks(
        model,
        answer,
        block_size,
        Guesser(model, prompt, seed, None),
        record=lambda start, iterate: recorded.setdefault(start, []).append(iterate),
    )
    blocks = []
    for start in sorted(recorded):
        *iterates, fixed = recorded[start]
        blocks.append([iterate[: len(fixed)] for iterate in iterates] + [fixed])
    return answer.ids[: answer.committed], blocks


def sample_seed(seed: int, index: int) -> int:
    """The seed of one sample's initial guesses: independent of which samples run before it."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _weights_sha256(path: Path) -> str:
    """sha256 of the weight files one after the other, read in chunks (a 3B model's are 7 GB)."""
    digest = hashlib.sha256()
    for weights in sorted(path.glob("*.safetensors")):
        with weights.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.json"


_SHARD = re.compile(r"^shard-\d{5}\.json$")


@dataclass
class CollectionPlan:
    """What to collect: the settings the manifest records, the split's rows and the chosen sample indices."""

    out: Path
    settings: dict[str, Any]
    rows: list[dict[str, Any]]
    indices: list[int]

    @property
    def shards(self) -> int:
        return -(-len(self.indices) // SHARD_SAMPLES)

    def shard_indices(self, k: int) -> list[int]:
        return self.indices[k * SHARD_SAMPLES : (k + 1) * SHARD_SAMPLES]


def plan_collection(
    model: str, data: str | Path, split: str, samples: int, block_size: int, seed: int, out: str | Path
) -> CollectionPlan:
    """Check a collection request before any model is loaded: the teacher is an AR checkpoint, the data
    and split exist and hold `samples` samples (chosen by `seed`), and `out` holds nothing else."""
    if samples < 1:
        raise TrajectoryError(f"samples must be at least 1, got {samples}")
    if not 1 <= block_size <= 1024:
        raise TrajectoryError(f"block size must be in [1, 1024], got {block_size}")
    if seed < 0 or seed >= 2**32:
        raise TrajectoryError(f"seed must be in [0, 4294967295], got {seed}")
    path = model_path(model)
    check_folder_destination(out, "--out", inputs=(data, path))
    what = owner(Path(out).resolve())
    if what is not None and not (Path(out) / MANIFEST).is_file():  # a manifest is read below: ours or refused
        raise OutputError(f"--out {out}: that is {what}; give a folder of its own for the trajectories")
    if Path(out).is_dir() and not (Path(out) / MANIFEST).is_file():
        others = sorted(p.name for p in Path(out).iterdir() if not (is_temporary(p) or _SHARD.match(p.name)))
        if others:
            raise OutputError(f"--out {out}: it holds {others[0]} and no trajectories; give a new or empty folder")
    settings = {"model": str(model), "data": str(data), "split": split, "samples": samples}
    settings |= {"block_size": block_size, "seed": seed}
    existing = _read_manifest(Path(out)) if (Path(out) / MANIFEST).is_file() else None
    _check_same_settings(out, existing, settings)  # before the model is checked and its weights hashed
    if not (path / "config.json").is_file():
        raise TrajectoryError(f"model {model!r}: {path} holds no model (config.json is missing)")
    check_model_folder(path)
    kind = read_info(path).kind
    if kind != "autoregressive":
        raise TrajectoryError(f"model {model!r} is a {kind} checkpoint; the teacher must be an AR one (default-ar)")
    rows = DrivingDataset.open(data).table(split).to_pylist()
    if samples > len(rows):
        raise TrajectoryError(f"split {split!r} of {data} has {len(rows)} samples; cannot take {samples}")
    settings = {"model": settings["model"], "model_sha256": _weights_sha256(path)} | settings
    _check_same_settings(out, existing, settings)
    indices = sorted(int(i) for i in np.random.default_rng(seed).permutation(len(rows))[:samples])
    return CollectionPlan(Path(out), settings, rows, indices)


def _check_same_settings(out: str | Path, existing: dict[str, Any] | None, settings: dict[str, Any]) -> None:
    """TrajectoryError when `out` already holds trajectories collected with other `settings` (a rerun resumes
    only the same collection)."""
    for key, value in settings.items():
        if existing is not None and existing["settings"].get(key) != value:
            raise TrajectoryError(
                f"{out} holds trajectories collected with {key} {existing['settings'].get(key)!r}, not "
                f"{value!r}; choose another output folder"
            )


@dataclass(frozen=True)
class CollectionReport:
    collected: int  # samples decoded by this run
    skipped: int  # samples found already collected
    seconds: float
    tokens: int  # answer tokens of the samples decoded by this run
    forwards: int  # their forwards after the prefill


def collect_trajectories(
    plan: CollectionPlan,
    model: BlockDiffusionModel,
    scaffold: Scaffold,
    on_start: Callable[[int, int], None] = lambda todo, done: None,
    on_sample: Callable[[Trajectory], None] = lambda trajectory: None,
    say: Callable[[str], None] = print,
) -> CollectionReport:
    """Collect the planned trajectories shard by shard; shards already in `plan.out` and intact are kept."""
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():  # left by an interrupted write
        if is_temporary(stale) and stale.is_file():
            stale.unlink()
    manifest = {"format": FORMAT, "version": 1, "settings": plan.settings, "shards": [], "complete": False}
    if (out / MANIFEST).is_file():
        manifest["shards"] = _read_manifest(out)["shards"]
    kept = []
    for entry in manifest["shards"]:
        try:
            _verified_shard(out, entry)
            kept.append(entry)
        except TrajectoryError as err:
            say(f"{err}: collecting it again")
    manifest["shards"] = kept
    done = {entry["shard"] for entry in kept}
    todo = [k for k in range(plan.shards) if k not in done]
    skipped = sum(len(plan.shard_indices(k)) for k in done)
    on_start(len(plan.indices) - skipped, skipped)
    began = time.perf_counter()
    tokens = forwards = collected = 0
    for k in todo:
        trajectories = []
        for index in plan.shard_indices(k):
            sample = from_row(plan.rows[index])
            prompt = prompt_inputs(model, sample.command, sample.history, [sample.image])
            answer, blocks = jacobi_trajectory(
                model, prompt, scaffold, plan.settings["block_size"], sample_seed(plan.settings["seed"], index)
            )
            trajectory = Trajectory(index, sample.sample_id, answer, blocks)
            trajectories.append(trajectory)
            tokens, forwards, collected = tokens + len(answer), forwards + trajectory.forwards, collected + 1
            on_sample(trajectory)
        data = json.dumps({"format": FORMAT, "trajectories": [asdict(t) for t in trajectories]}).encode()
        write_bytes(out / _shard_name(k), data)
        entry = {"shard": k, "file": _shard_name(k), "samples": len(trajectories), "bytes": len(data)}
        manifest["shards"] = sorted([*manifest["shards"], entry | {"sha256": _sha256(data)}], key=lambda e: e["shard"])
        manifest["complete"] = len(manifest["shards"]) == plan.shards
        write_bytes(out / MANIFEST, json.dumps(manifest, indent=2).encode())
    return CollectionReport(collected, skipped, time.perf_counter() - began, tokens, forwards)


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise TrajectoryError(f"{folder} holds no trajectories ({MANIFEST} is missing); collect them first")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise TrajectoryError(f"{path} is not UTF-8 text; it is not a trajectories manifest") from None
    except json.JSONDecodeError as err:
        raise TrajectoryError(f"{path} is not valid JSON: {err.msg}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TrajectoryError(f"{path} is not a trajectories manifest")
    if not isinstance(manifest.get("settings"), dict):
        raise TrajectoryError(f"{path} is damaged: its 'settings' entry is not a JSON object")
    shards = manifest.get("shards")
    keys = {"shard": int, "file": str, "bytes": int, "sha256": str}
    if not isinstance(shards, list) or not all(
        isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in keys.items()) for e in shards
    ):
        raise TrajectoryError(f"{path} is damaged: its 'shards' entry is not a list of shard records")
    if any(Path(e["file"]).name != e["file"] for e in shards):
        raise TrajectoryError(f"{path} is damaged: a shard record names a file outside {folder}")
    return manifest


def _verified_shard(folder: Path, entry: dict[str, Any]) -> bytes:
    """The bytes of a shard, if its size and sha256 are those the manifest recorded."""
    path = folder / entry["file"]
    if not path.is_file():
        raise TrajectoryError(f"trajectory shard {path} is missing")
    data = path.read_bytes()
    if len(data) != entry["bytes"] or _sha256(data) != entry["sha256"]:
        raise TrajectoryError(f"trajectory shard {path} is damaged (its size or sha256 differs from the manifest)")
    return data


@dataclass(frozen=True)
class TrajectorySet:
    settings: dict[str, Any]
    trajectories: list[Trajectory]
    digest: str  # sha256 of the manifest's shard records: what a training checkpoint records of them


def read_trajectories(folder: str | Path) -> TrajectorySet:
    """Every trajectory of a complete folder, each shard checked against the manifest."""
    folder = Path(folder)
    manifest = _read_manifest(folder)
    if not manifest.get("complete"):
        raise TrajectoryError(
            f"{folder} is incomplete ({len(manifest['shards'])} shards written): rerun the collection to finish it"
        )
    trajectories = []
    for entry in manifest["shards"]:
        try:
            shard = json.loads(_verified_shard(folder, entry))
        except TrajectoryError as err:
            raise TrajectoryError(f"{err}; rerun the same collection to collect it again") from None
        trajectories += [Trajectory(**t) for t in shard["trajectories"]]
    digest = _sha256(json.dumps(manifest["shards"], sort_keys=True).encode())
    return TrajectorySet(manifest["settings"], trajectories, digest)
