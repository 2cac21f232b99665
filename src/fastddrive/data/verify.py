"""The state of a dataset folder, shard by shard (`fastddrive data verify`).

Every shard the manifest records is checked against its record (present, its size, its sha256, its sample
count); a shard file the manifest does not record is reported too. A dataset written before shards were
recorded is checked for readable parquet shards and, for a complete simulator dataset, for every shard its
settings plan. A simulator dataset that is not complete lists the episodes still to be simulated (pending),
and every written episode needs its recorded end reason. `unfinished` says in words why a data set is not
complete, for every command that reports on one (`data stats`: its figures then cover only what is written).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastddrive.data.dataset import SHARD_STATES, SPLITS, DrivingDataset, ShardCheck, shards_on_disk


@dataclass(frozen=True)
class SplitReport:
    """One split: its shards in order with their state, and the samples of the ok ones."""

    split: str
    shards: tuple[ShardCheck, ...]

    @property
    def samples(self) -> int:
        """Samples in the split's ok shards."""
        return sum(c.samples or 0 for c in self.shards if c.ok)

    def count(self, state: str) -> int:
        """How many of the split's shards are in `state` (ok, missing, damaged or unrecorded)."""
        return sum(c.state == state for c in self.shards)


@dataclass(frozen=True)
class VerifyReport:
    """What `verify_dataset` found; `ok` when the dataset is complete and every shard is intact."""

    root: Path
    source: str | None  # the manifest's settings' source: highway-env, wod-e2e, nuscenes, ...
    complete: bool  # the manifest marks the dataset complete
    recorded: bool  # the manifest records every shard's size and sha256 (False: written before it did)
    checksums: bool  # the shards' checksums were verified (False: presence and size only)
    splits: dict[str, SplitReport]
    pending: tuple[str, ...] = ()  # simulator shards the settings plan that are not written yet
    missing_metadata: tuple[str, ...] = ()  # simulator episodes written whose end reason is not recorded

    @property
    def shards(self) -> list[ShardCheck]:
        return [c for split in SPLITS for c in self.splits[split].shards]

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.splits.values())

    @property
    def problems(self) -> list[str]:
        """One line per bad shard ("<split>/<name>.parquet is truncated: ...") and per lost episode end reason."""
        lines = [f"{c.shard} {c.problem}" for c in self.shards if not c.ok]
        return lines + [f"episode {key} has no recorded end reason" for key in self.missing_metadata]

    @property
    def ok(self) -> bool:
        return self.complete and not self.problems and not self.pending

    def lines(self) -> list[str]:
        """The report as plain text lines (no markup): the dataset, one line per split, every problem, a verdict."""
        recorded = "sizes and checksums recorded" if self.recorded else "written before shards were recorded"
        checked = "" if self.checksums else " (presence and size only)"
        state = "complete" if self.complete else "not complete"
        out = [f"{self.root}: {self.source or 'unknown source'} dataset, {state}, {recorded}{checked}"]
        for name, split in self.splits.items():
            counts = ", ".join(f"{split.count(s)} {s}" for s in SHARD_STATES if s == "ok" or split.count(s))
            out.append(f"{name}: {len(split.shards)} shard(s): {counts}; {split.samples} samples")
        if self.pending:
            out.append(f"pending: {len(self.pending)} planned shard(s) not written yet")
        out += [f"problem: {line}" for line in self.problems]
        if self.ok:
            out.append(f"ok: {self.samples} samples")
        else:
            why = f"{len(self.problems)} problem(s)" if self.problems else "the dataset is not complete"
            out.append(f"not ok: {why}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "source": self.source,
            "ok": self.ok,
            "complete": self.complete,
            "recorded": self.recorded,
            "checksums": self.checksums,
            "samples": self.samples,
            "splits": {
                name: {
                    "samples": split.samples,
                    **{state: split.count(state) for state in SHARD_STATES},
                    "shards": [
                        {"shard": c.shard, "state": c.state, "problem": c.problem, "samples": c.samples}
                        for c in split.shards
                    ],
                }
                for name, split in self.splits.items()
            },
            "pending": list(self.pending),
            "missing_metadata": list(self.missing_metadata),
            "problems": self.problems,
        }


def verify_dataset(root: str | Path, checksums: bool = True) -> VerifyReport:
    """Check every shard of the dataset in `root` (`checksums=False`: presence and size only, no reading).

    Raises DatasetError when `root` is not a dataset (no folder, no or an unreadable manifest)."""
    from fastddrive.data.build import _episode_key
    from fastddrive.data.episodes import plan_episodes, planned_shards

    dataset = DrivingDataset.open(root)
    manifest = dataset.manifest
    settings = manifest["settings"]
    complete = manifest["complete"]
    checks = {split: dataset.check_shards(split, checksum=checksums) for split in SPLITS}
    pending: list[str] = []
    missing_metadata: list[str] = []
    planned = planned_shards(settings)
    if planned is not None:
        seen = {c.shard for split in SPLITS for c in checks[split]}
        for shard in planned:
            if shard in seen:
                continue
            if complete:
                split = shard.split("/", 1)[0]
                checks[split] = sorted([*checks[split], ShardCheck(shard, "missing", "is missing")], key=_by_shard)
            else:
                pending.append(shard)
        ends = manifest.get("end_reasons", {})
        jobs = plan_episodes(int(settings["episodes"]), int(settings["seed"]), list(settings["scenarios"]))
        written = {c.shard for split in SPLITS for c in checks[split] if c.state != "missing"}
        missing_metadata = [_episode_key(j) for j in jobs if j.shard in written and _episode_key(j) not in ends]
    return VerifyReport(
        root=dataset.root,
        source=settings.get("source"),
        complete=complete,
        recorded=dataset.records is not None,
        checksums=checksums,
        splits={split: SplitReport(split, tuple(checks[split])) for split in SPLITS},
        pending=tuple(pending),
        missing_metadata=tuple(missing_metadata),
    )


def _by_shard(check: ShardCheck) -> str:
    return check.shard


def unfinished(dataset: DrivingDataset) -> str | None:
    """Why `dataset` is not complete, in words ("1 of 3 planned episodes written"); None when it is complete:
    its manifest says so and, for a simulator data set, every shard its settings plan is there."""
    from fastddrive.data.episodes import planned_shards

    manifest = dataset.manifest
    planned = planned_shards(manifest["settings"])
    if planned is not None:
        present = set(dataset.records or ()) | {s for split in SPLITS for s in shards_on_disk(dataset.root, split)}
        written = sum(shard in present for shard in planned)
        if manifest["complete"] and written == len(planned):
            return None
        return (
            f"{written} of {len(planned)} planned episodes written; `fastddrive data highway` with the same "
            "settings finishes it"
        )
    if manifest["complete"]:
        return None
    failed = next((manifest[k] for k in ("failed", "failures") if isinstance(manifest.get(k), int)), None)
    made = "the command that made it" + (f" reported {failed} failure(s)" if failed else " did not finish")
    return f"{made}; make it again to complete it"
