"""Which simulated episodes a model was trained on, recorded in its fastddrive.json, so that a closed-loop drive
can say when it drives them again: issue 37's targets are "on episodes you do not see", and a drive's episode j
is the data generator's episode of the same seed and scenario (docs/driving.md).

The record is `extra["training_episodes"]`: scenario name -> the sorted episode seeds of the training samples
(`DrivingSample.scenario`, `.episode_seed`) of every run that made the model, the model it started from
included. A model trained on no simulated episode has none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

KEY = "training_episodes"

Episode = tuple[str, int]  # (scenario, episode seed)


def record_problem(extra: Mapping[str, Any]) -> str | None:
    """What makes `extra`'s record unreadable, naming it; None when it is sound or absent."""
    record = extra.get(KEY)
    if record is None:
        return None
    if not isinstance(record, dict) or not all(isinstance(name, str) and name for name in record):
        return f"extra.{KEY} must map scenario names to lists of episode seeds"
    for name, seeds in record.items():
        if not isinstance(seeds, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds
        ):
            return f"extra.{KEY}[{name!r}] must be a list of non-negative episode seeds, got {seeds!r:.60}"
    return None


def training_episodes(extra: Mapping[str, Any]) -> frozenset[Episode]:
    """The episodes `extra` records (checked by `record_problem` where the file was read)."""
    record = extra.get(KEY) or {}
    return frozenset((name, seed) for name, seeds in record.items() for seed in seeds)


def with_training_episodes(extra: Mapping[str, Any], episodes: Iterable[Episode]) -> dict[str, Any]:
    """`extra` whose record also holds `episodes`; unchanged (no record added) when there are none."""
    every = training_episodes(extra) | frozenset(episodes)
    if not every:
        return dict(extra)
    record: dict[str, list[int]] = {}
    for name, seed in sorted(every):
        record.setdefault(name, []).append(seed)
    return {**extra, KEY: record}
