"""Driving samples stored as parquet shards (DESIGN section 8).

Units and frames: metres, seconds, m/s, m/s^2; every array is in the ego frame at t = 0 (+x forward,
+y left). A dataset folder holds `manifest.json` and one parquet shard per episode under
`train/`, `val/` and `test/`; the manifest records every shard's size, sha256 and sample count (`shards`),
and readers check a shard before they use it: its presence and size always, its checksum when this process
first reads it, so a missing, truncated or corrupted shard is a DatasetError that names it. Val and test
samples of simulator datasets also carry up to 3 simulated raters' futures with 0..10 scores (data/raters.py)
for the WOD-E2E rater feedback score; shards written before raters existed read back with none.

The manifest is checked whole before anything trusts it (`read_manifest`): UTF-8 JSON, every key the readers
use of its type, every shard record well formed; anything else is a DatasetError naming the file and the key.
Every manifest ever written carries a `version`: 2 (MANIFEST_VERSION in data/build.py; the simulator build and
both converters) records every shard, 1 (the first releases, before checksums) records none. Version 1 data
sets are still read, as they were made: readable parquet, and for a complete simulator data set every planned
shard present (`data highway` on one adopts its shards and records them). A version 2 manifest without its
`shards` record, or one without a version, was never written so: it is damaged, not old, and refused, since
reading it as old would silently turn the checksums off.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fastddrive.core.outputs import is_temporary, write_bytes
from fastddrive.core.sample import (
    FUTURE_STEPS,
    HISTORY_COLUMNS,
    HISTORY_STEPS,
    CameraView,
    DrivingSample,
    SampleError,
    check_history,
    decode_png,
    encode_png,
)
from fastddrive.core.schema import parse, render
from fastddrive.data.episodes import DatasetError, planned_shards, settings_problem, simulated_scenarios

SPLITS: tuple[str, ...] = ("train", "val", "test")
MANIFEST = "manifest.json"
DATASET_FORMAT = "fastddrive-driving-samples"
SHARDS = "shards"  # manifest key: shard path relative to the root -> {"bytes", "sha256", "samples"}
MANIFEST_VERSIONS = (1, 2)  # 1: no shard records (before checksums); 2: every shard recorded (build.MANIFEST_VERSION)
_SHARD_NAME = re.compile(r"(?:train|val|test)/[^/\\\x00]+\.parquet")  # one file in a split folder
_SHA256 = re.compile(r"[0-9a-f]{64}")


_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("scenario", pa.string()),
        ("episode_seed", pa.int64()),
        ("time_s", pa.float64()),
        ("image_png", pa.binary()),
        ("history", pa.list_(pa.float32())),
        ("command", pa.string()),
        ("future", pa.list_(pa.float32())),
        ("future_time_s", pa.list_(pa.float32())),
        ("response", pa.string()),
        ("view", pa.list_(pa.float64())),
        ("ego_size", pa.list_(pa.float32())),
        ("agents", pa.list_(pa.float32())),
        ("agent_size", pa.list_(pa.float32())),
        ("rater_trajectories", pa.list_(pa.float32())),
        ("rater_scores", pa.list_(pa.float32())),
    ]
)
# Columns added after datasets were first written: older shards lack them and read back as empty lists.
_LATER_COLUMNS = ("rater_trajectories", "rater_scores")


def to_row(sample: DrivingSample) -> dict[str, Any]:
    """One parquet row of a sample (the shard columns; the frame as PNG bytes)."""
    view = sample.view
    return {
        "sample_id": sample.sample_id,
        "scenario": sample.scenario,
        "episode_seed": sample.episode_seed,
        "time_s": sample.time_s,
        "image_png": encode_png(sample.image),
        "history": sample.history.astype(np.float32).ravel().tolist(),
        "command": sample.command,
        "future": sample.future.astype(np.float32).ravel().tolist(),
        "future_time_s": sample.future_time_s.astype(np.float32).tolist(),
        "response": render(sample.response),
        "view": [view.pixels_per_metre, *view.ego_pixel, view.ego_heading_rad],
        "ego_size": list(sample.ego_size),
        "agents": sample.agents.astype(np.float32).ravel().tolist(),
        "agent_size": sample.agent_size.astype(np.float32).ravel().tolist(),
        "rater_trajectories": sample.rater_trajectories.astype(np.float32).ravel().tolist(),
        "rater_scores": sample.rater_scores.astype(np.float32).tolist(),
    }


def from_row(row: dict[str, Any]) -> DrivingSample:
    """The sample of one parquet row; rows written before raters existed read with no raters."""
    ppm, u, v, heading = row["view"]
    n_agents = len(row["agent_size"]) // 2
    # A row from a shard written before raters existed has no rater columns: no raters.
    rater_scores = np.asarray(row.get("rater_scores") or [], dtype=np.float64)
    rater_trajectories = np.asarray(row.get("rater_trajectories") or [], dtype=np.float64)
    return DrivingSample(
        sample_id=row["sample_id"],
        scenario=row["scenario"],
        episode_seed=row["episode_seed"],
        time_s=row["time_s"],
        image=decode_png(row["image_png"]),
        history=np.asarray(row["history"], dtype=np.float64).reshape(HISTORY_STEPS, len(HISTORY_COLUMNS)),
        command=row["command"],
        future=np.asarray(row["future"], dtype=np.float64).reshape(FUTURE_STEPS, 2),
        future_time_s=np.asarray(row["future_time_s"], dtype=np.float64),
        response=parse(row["response"]),
        view=CameraView(ppm, (u, v), heading),
        ego_size=tuple(row["ego_size"]),
        agents=np.asarray(row["agents"], dtype=np.float64).reshape(n_agents, FUTURE_STEPS + 1, 3),
        agent_size=np.asarray(row["agent_size"], dtype=np.float64).reshape(n_agents, 2),
        rater_trajectories=_reshape_raters(rater_trajectories),
        rater_scores=rater_scores,
    )


def check_row_numbers(row: dict[str, Any]) -> None:
    """Raise SampleError unless a stored row's history and future are finite arrays of their shapes (a frame without
    a future is refused, named as such): what a reader that does not build the sample (training batches) must
    check, since a shard's checksum only says that the row is what was written."""
    history = np.asarray(row["history"], dtype=np.float64)
    if history.size != HISTORY_STEPS * len(HISTORY_COLUMNS):
        raise SampleError(f"history holds {history.size} numbers, not {HISTORY_STEPS} rows of {len(HISTORY_COLUMNS)}")
    check_history(history.reshape(HISTORY_STEPS, len(HISTORY_COLUMNS)))
    future = np.asarray(row["future"], dtype=np.float64)
    if future.size == FUTURE_STEPS * 2 and np.isnan(future).all():
        raise SampleError("it has no logged future (a WOD-E2E test frame): there is nothing to train it on")
    if future.size != FUTURE_STEPS * 2 or not np.isfinite(future).all():
        raise SampleError(f"future must be {FUTURE_STEPS} finite [x, y] points ({future.size} numbers given)")


def _reshape_raters(flat: np.ndarray) -> np.ndarray:
    if flat.size % (FUTURE_STEPS * 2):
        raise SampleError(f"rater_trajectories hold {flat.size} numbers, not a whole number of {FUTURE_STEPS} points")
    return flat.reshape(-1, FUTURE_STEPS, 2)


def shard_record(data: bytes, samples: int) -> dict[str, Any]:
    """What the manifest records of one shard: its size in bytes, its sha256 and its number of samples."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "samples": samples}


def write_shard(path: Path, samples: list[DrivingSample]) -> dict[str, Any]:
    """Write samples as one parquet shard, atomically; returns its record for the manifest (shard_record)."""
    table = pa.Table.from_pylist([to_row(s) for s in samples], schema=_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    data = sink.getvalue().to_pybytes()
    write_bytes(path, data)
    return shard_record(data, table.num_rows)


def read_shard(path: Path | pa.NativeFile, columns: list[str] | None = None) -> pa.Table:
    """One shard (a path or an open Arrow file) as an Arrow table in the current schema; columns an older
    shard lacks come back as empty lists."""
    wanted = list(columns) if columns else _SCHEMA.names
    with pq.ParquetFile(path) as file:
        present = set(file.schema_arrow.names)
        table = file.read(columns=[c for c in wanted if c in present])
    for name in wanted:
        if name not in present and name in _LATER_COLUMNS:
            empty = pa.array([[]] * table.num_rows, type=_SCHEMA.field(name).type)
            table = table.append_column(_SCHEMA.field(name), empty)
    return table.select(wanted)


class ShardError(DatasetError):
    """One shard of a dataset is missing, damaged or not the one the manifest records; `shard` names it
    (relative to the dataset root) and `problem` says what is wrong."""

    def __init__(self, message: str, shard: str, problem: str) -> None:
        super().__init__(message)
        self.shard = shard
        self.problem = problem


SHARD_STATES = ("ok", "missing", "damaged", "unrecorded")


@dataclass(frozen=True)
class ShardCheck:
    """The state of one shard: ok, missing, damaged (wrong size, checksum mismatch, unreadable parquet, or
    another number of samples than recorded) or unrecorded (a shard file the manifest does not list)."""

    shard: str  # path relative to the dataset root, as the manifest records it: "<split>/<name>.parquet"
    state: str
    problem: str = ""  # what is wrong, as it follows the shard's name ("is truncated: ...")
    samples: int | None = None  # known when the shard is ok (or recorded)
    bytes: int | None = None  # the size on disk

    @property
    def ok(self) -> bool:
        return self.state == "ok"


# Shards whose checksum this process has verified: (path, size, mtime_ns, sha256). Hashing once per process
# keeps repeated reads (a split read per epoch, `sample` after `table`) at the cost of reading the file alone.
_VERIFIED: set[tuple[str, int, int, str]] = set()


def _size_problem(size: int, recorded: int) -> str:
    if size < recorded:
        return f"is truncated: {size} bytes where the manifest records {recorded}"
    return f"has the wrong size: {size} bytes where the manifest records {recorded}"


def _unreadable(err: BaseException) -> str:
    detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"is not a readable parquet file ({type(err).__name__}{': ' + detail if detail else ''})"


def _check_bytes(shard: str, record: dict[str, Any] | None, data: bytes) -> tuple[ShardCheck, pa.Table | None]:
    """Check a shard's bytes against its record (the checksum, then the parquet footer's row count) or, without
    a record, by reading every column; the table comes back when it was read."""
    size = len(data)
    if record is not None:
        if size != record["bytes"]:
            return ShardCheck(shard, "damaged", _size_problem(size, record["bytes"]), bytes=size), None
        digest = hashlib.sha256(data).hexdigest()
        if digest != record["sha256"]:
            recorded = record["sha256"][:16]
            problem = f"fails its checksum: sha256 {digest[:16]}... where the manifest records {recorded}..."
            return ShardCheck(shard, "damaged", problem, bytes=size), None
    try:
        if record is not None:
            with pq.ParquetFile(pa.BufferReader(data)) as file:
                rows, table = file.metadata.num_rows, None
        else:
            table = read_shard(pa.BufferReader(data))
            rows = table.num_rows
    except (pa.ArrowException, OSError) as err:
        return ShardCheck(shard, "damaged", _unreadable(err), bytes=size), None
    if record is not None and rows != record["samples"]:
        problem = f"holds {rows} samples where the manifest records {record['samples']}"
        return ShardCheck(shard, "damaged", problem, bytes=size), None
    return ShardCheck(shard, "ok", samples=rows, bytes=size), table


def _verified_key(path: Path, record: dict[str, Any]) -> tuple[str, int, int, str] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns, record["sha256"])


def check_shard(root: Path, shard: str, record: dict[str, Any] | None, checksum: bool = True) -> ShardCheck:
    """The state of `root/shard` against its manifest `record` (None: a dataset written before shards were
    recorded, checked for readable parquet only). `checksum=False` checks presence and size alone."""
    path = root / shard
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return ShardCheck(shard, "missing", "is missing")
    except OSError as err:
        return ShardCheck(shard, "damaged", f"cannot be read ({err.strerror or err})")
    if record is not None and (size != record["bytes"] or not checksum):
        if size != record["bytes"]:
            return ShardCheck(shard, "damaged", _size_problem(size, record["bytes"]), bytes=size)
        return ShardCheck(shard, "ok", samples=record["samples"], bytes=size)
    key = _verified_key(path, record) if record is not None else None
    try:
        data = path.read_bytes()
    except OSError as err:
        return ShardCheck(shard, "damaged", f"cannot be read ({err.strerror or err})", bytes=size)
    check, _ = _check_bytes(shard, record, data)
    if check.ok and key is not None:
        _VERIFIED.add(key)
    return check


def _planned_shards(manifest: dict[str, Any]) -> list[str] | None:
    """The shards a simulator dataset's settings plan (None for other sources or unusable settings)."""
    return planned_shards(manifest.get("settings") or {})


@dataclass(frozen=True)
class DrivingDataset:
    """A dataset folder: its manifest and its shards, read lazily split by split.

    Every read checks the shards it uses (presence and size always, the checksum once per process) and raises
    ShardError naming a missing or damaged one; no shard is skipped.
    """

    root: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, root: str | Path) -> DrivingDataset:
        root = Path(root)
        if not root.is_dir():
            raise DatasetError(f"{root} is not a directory")
        manifest_path = root / MANIFEST
        if not manifest_path.is_file():
            raise DatasetError(f"{root} is not a fastddrive dataset: {MANIFEST} is missing")
        return cls(root, read_manifest(manifest_path))

    @property
    def records(self) -> dict[str, dict[str, Any]] | None:
        """The manifest's shard records, or None for a dataset written before shards were recorded."""
        return self.manifest.get(SHARDS)

    def fingerprint(self) -> str:
        """sha256 of the shard records (size and sha256 of every shard): two data sets with the same fingerprint
        hold the same samples. A data set written before shards were recorded: of its manifest."""
        records = self.records if self.records is not None else self.manifest
        return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise DatasetError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")

    def check_shards(self, split: str, checksum: bool = True) -> list[ShardCheck]:
        """Every shard of a split in order, the manifest's and those on disk: `checksum=False` checks presence
        and size only (of a dataset without records: presence of the planned shards of a complete one)."""
        self._check_split(split)
        on_disk = set(shards_on_disk(self.root, split))
        records = self.records
        if records is None:
            expected = set()
            if self.manifest.get("complete"):
                expected = {s for s in _planned_shards(self.manifest) or () if s.startswith(f"{split}/")}
            checks = []
            for shard in sorted(on_disk | expected):
                if shard not in on_disk:
                    checks.append(ShardCheck(shard, "missing", "is missing"))
                elif checksum:
                    checks.append(check_shard(self.root, shard, None))
                else:
                    checks.append(ShardCheck(shard, "ok", bytes=(self.root / shard).stat().st_size))
            return checks
        listed = {s for s in records if s.startswith(f"{split}/")}
        return [
            check_shard(self.root, s, records[s], checksum)
            if s in listed
            else ShardCheck(s, "unrecorded", "is not recorded in the manifest")
            for s in sorted(listed | on_disk)
        ]

    def _error(self, check: ShardCheck, others: int = 0) -> ShardError:
        simulated = self.manifest["settings"].get("source") == "highway-env"
        if check.state == "unrecorded":
            remedy = "remove it" + (", or rerun `fastddrive data highway` with the same settings" if simulated else "")
        elif simulated:
            remedy = "rerun `fastddrive data highway` with the same settings to rebuild it"
        else:
            remedy = "make the dataset again"
        more = f" (and {others} more shard(s) with problems)" if others else ""
        return ShardError(
            f"damaged dataset {self.root}: shard {check.shard} {check.problem}{more}; {remedy}",
            check.shard,
            check.problem,
        )

    def shards(self, split: str) -> list[Path]:
        """The split's shard files in order, each present with its recorded size, or a ShardError."""
        checks = self.check_shards(split, checksum=False)
        bad = [c for c in checks if not c.ok]
        if bad:
            raise self._error(bad[0], len(bad) - 1)
        return [self.root / c.shard for c in checks]

    def _read(self, path: Path, columns: list[str] | None) -> pa.Table:
        """One shard, its checksum verified on the first read in this process."""
        shard = f"{path.parent.name}/{path.name}"
        record = (self.records or {}).get(shard)
        try:
            key = _verified_key(path, record) if record is not None else None
            if key is None or key in _VERIFIED:
                return read_shard(path, columns)
            check, _ = _check_bytes(shard, record, data := path.read_bytes())
            if not check.ok:
                raise self._error(check)
            _VERIFIED.add(key)
            return read_shard(pa.BufferReader(data), columns)
        except FileNotFoundError:
            raise self._error(ShardCheck(shard, "missing", "is missing")) from None
        except (pa.ArrowException, OSError) as err:
            raise self._error(ShardCheck(shard, "damaged", _unreadable(err))) from None

    def table(self, split: str, columns: list[str] | None = None) -> pa.Table:
        """All rows of a split (optionally only some columns) as one Arrow table, in shard order."""
        shards = self.shards(split)
        if not shards:
            return _SCHEMA.empty_table().select(columns) if columns else _SCHEMA.empty_table()
        return pa.concat_tables([self._read(p, columns) for p in shards])

    def __len__(self) -> int:
        total = 0
        for split in SPLITS:
            for path in self.shards(split):
                record = (self.records or {}).get(f"{split}/{path.name}")
                if record is not None:
                    total += record["samples"]
                    continue
                try:
                    with pq.ParquetFile(path) as file:
                        total += file.metadata.num_rows
                except (pa.ArrowException, OSError) as err:
                    raise self._error(ShardCheck(f"{split}/{path.name}", "damaged", _unreadable(err))) from None
        return total

    def simulated_episodes(self, split: str, indices: Iterable[int] | None = None) -> set[tuple[str, int]]:
        """The (scenario, episode seed) of the split's samples (of those at `indices` only, when given) that come
        from simulated episodes: of a scenario that the manifest's simulator settings name, through merges.
        A converted data set's samples (WOD-E2E, nuScenes) are of none."""
        names = simulated_scenarios(self.manifest.get("settings") or {})
        table = self.table(split, columns=["scenario", "episode_seed"]).to_pylist()
        rows = table if indices is None else [table[i] for i in indices]
        return {(row["scenario"], row["episode_seed"]) for row in rows if row["scenario"] in names}

    def samples(self, split: str) -> Iterator[DrivingSample]:
        for shard in self.shards(split):
            for row in self._read(shard, None).to_pylist():
                yield from_row(row)

    def sample(self, split: str, index: int) -> DrivingSample:
        table = self.table(split)
        if not 0 <= index < table.num_rows:
            raise IndexError(f"split {split!r} has {table.num_rows} samples; index {index} is out of range")
        return from_row(table.slice(index, 1).to_pylist()[0])


def shards_on_disk(root: Path, split: str) -> list[str]:
    """The shard files of a split folder ("<split>/<name>.parquet"), without the temporary files of writers that
    were interrupted (outputs.is_temporary): those are no shards."""
    return sorted(f"{split}/{p.name}" for p in (root / split).glob("*.parquet") if not is_temporary(p))


def _kind(value: Any) -> str:
    """What a JSON value is, in words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _record_problem(shard: Any, record: Any) -> str | None:
    where = f"{SHARDS}[{_short(shard)}]"
    if not isinstance(shard, str) or not _SHARD_NAME.fullmatch(shard):
        return f"{where} is not a shard name (<train|val|test>/<name>.parquet)"
    if not isinstance(record, dict):
        return f"{where} is {_kind(record)}, not an object"
    for key in ("bytes", "samples"):
        if not _count(record.get(key)):
            return f"{where}.{key} is {_short(record.get(key))}, not a count"
    if not isinstance(record.get("sha256"), str) or not _SHA256.fullmatch(record["sha256"]):
        return f"{where}.sha256 is {_short(record.get('sha256'))}, not a sha256 digest (64 hex digits)"
    return None


def manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What makes a data set's manifest (of its format) unusable, naming the key; None when it is sound."""

    if "version" not in manifest:
        return "it has no 'version'"
    version = manifest["version"]
    if not _count(version) or version not in MANIFEST_VERSIONS:
        return f"'version' is {_short(version)}, not a manifest version ({', '.join(map(str, MANIFEST_VERSIONS))})"
    if not isinstance(manifest.get("settings", {}), dict):
        return f"'settings' is {_kind(manifest['settings'])}, not an object"
    if not isinstance(manifest.get("complete", False), bool):
        return f"'complete' is {_short(manifest['complete'])}, not true or false"
    if "episodes_written" in manifest and not _count(manifest["episodes_written"]):
        return f"'episodes_written' is {_short(manifest['episodes_written'])}, not a count"
    ends = manifest.get("end_reasons", {})
    if not isinstance(ends, dict) or not all(isinstance(v, str) for v in ends.values()):
        return "'end_reasons' is not an object of episode end reasons"
    problem = settings_problem(manifest.get("settings", {}))
    if problem is not None:
        return problem
    if version == 1:
        return f"a version 1 manifest records no {SHARDS!r}, yet this one does" if SHARDS in manifest else None
    records = manifest.get(SHARDS)
    if records is None:
        return f"its {SHARDS!r} record of the shards is missing (a version {version} manifest has one)"
    if not isinstance(records, dict):
        return f"{SHARDS!r} is {_kind(records)}, not an object"
    return next((p for shard, record in records.items() if (p := _record_problem(shard, record))), None)


class ManifestError(DatasetError):
    """A data set's manifest that is damaged: not UTF-8 JSON, or a key missing or of the wrong type; `problem`
    says what, naming the key."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path} is damaged: {problem}; make the data set again")
        self.path = path
        self.problem = problem


def read_manifest(path: Path) -> dict[str, Any]:
    """The data set manifest at `path`, checked whole (module docstring); otherwise a ManifestError naming the file
    and the key, or a DatasetError for a manifest of another format or a newer version."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DatasetError(f"{path} cannot be read ({err.strerror or err})") from None
    try:
        manifest = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ManifestError(path, f"it is not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ManifestError(path, f"it is not valid JSON ({err.msg}, line {err.lineno})") from None
    except (ValueError, RecursionError):  # an integer of thousands of digits, or arrays nested thousands deep
        raise ManifestError(path, "it is not JSON that can be read") from None
    if not isinstance(manifest, dict) or manifest.get("format") != DATASET_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise DatasetError(f"{path.parent} is not a fastddrive dataset: {MANIFEST} has format {_short(found)}")
    version = manifest.get("version")
    if _count(version) and version > max(MANIFEST_VERSIONS):
        raise DatasetError(
            f"{path} has manifest version {version}, newer than this fastddrive reads "
            f"({max(MANIFEST_VERSIONS)}); upgrade fastddrive"
        )
    problem = manifest_problem(manifest)
    if problem is not None:
        raise ManifestError(path, problem)
    # Optional keys, as readers take them: no settings, and not complete.
    return {"settings": {}, "complete": False, **manifest}
