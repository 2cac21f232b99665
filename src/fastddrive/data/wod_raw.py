"""Raw WOD-E2E TFRecords into a dataset (issue 35): file by file, in worker processes, resumably.

Each TFRecord file is one job: a worker reads its frames one at a time (`wod_e2e.raw_file_outcomes`; memory is
flat in the number of records: at most one parquet shard of samples is held), writes its shards
`<split>/<file>-<k>.parquet` atomically, and returns their records with its counts and its failed records. The
main process records each finished file in the manifest (rewritten atomically), so an interrupted conversion
loses nothing it finished: the same command again keeps every file whose shards match their records and
converts the rest (other settings: it refuses, or with --overwrite starts over beside `--out`, as the simulator
build does). A corrupt or malformed record is reported by file and index (and byte offset) and skipped; the
data set is complete only when none failed. Before any work the records are counted from their headers alone,
for a progress bar with an ETA.
"""

from __future__ import annotations

import re
import shutil
import struct
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastddrive.core.outputs import replace_folder
from fastddrive.data.build import (
    OutputExists,
    build_folder,
    prepare_output,
    remove_leftovers,
    write_manifest,
)
from fastddrive.data.dataset import SHARDS, SPLITS, check_shard, write_shard
from fastddrive.data.wod_e2e import (
    SOURCE,
    ConversionReport,
    RecordOutcome,
    raw_file_outcomes,
    raw_tfrecords,
    split_of,
)

_HEADER = struct.Struct("<QI")
FILES = "raw_files"  # manifest key: per converted file, its shards, counts and failed records


@dataclass
class FileResult:
    """What converting one TFRecord file gave: its shards' records, counts per split, and its failed records as
    (record id, problem)."""

    name: str
    split: str
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: int = 0
    unrated: int = 0
    derived: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)

    @property
    def records(self) -> int:
        return self.samples + len(self.failures)


def count_records(path: Path) -> int:
    """The records of a TFRecord file, from its headers alone (a cut or damaged tail counts as one record)."""
    count = 0
    with path.open("rb") as file:
        while header := file.read(_HEADER.size):
            count += 1
            if len(header) < _HEADER.size:
                break
            (length, _) = _HEADER.unpack(header)
            file.seek(length + 4, 1)
    return count


def convert_file(root: str, path: str, max_pixels: int, shard_size: int) -> FileResult:
    """Convert one TFRecord file into shards under `root` (run in a worker process)."""
    source = Path(path)
    stem = re.sub(r"[^\w.-]", "_", source.name)
    result = FileResult(source.name, split_of(source) or "")
    pending = []

    def flush() -> None:
        shard = f"{result.split}/{stem}-{len(result.shards):05d}.parquet"
        result.shards[shard] = write_shard(Path(root) / shard, pending)
        pending.clear()

    for outcome in raw_file_outcomes(source, max_pixels):
        if outcome.sample is None:
            result.failures.append((outcome.record_id, outcome.error or ""))
            continue
        pending.append(outcome.sample)
        result.samples += 1
        result.unrated += outcome.unrated
        result.derived += outcome.answer_derived
        if len(pending) >= shard_size:
            flush()
    if pending:
        flush()
    return result


def convert_raw_wod_e2e(
    src: Path,
    out: Path,
    max_pixels: int,
    shard: tuple[int, int],
    workers: int,
    shard_size: int,
    overwrite: bool,
    on_item: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> ConversionReport:
    """Convert this machine's share (`shard` (i, n): every n-th file from the i-th) of the raw TFRecords in `src`
    into `out`, in `workers` processes, resuming an interrupted conversion of the same settings (module doc)."""
    start = time.perf_counter()
    index, count = shard
    files = raw_tfrecords(src)[index::count]
    if not files:
        raise FileNotFoundError(f"{src}: shard {index}/{count} holds none of its {len(raw_tfrecords(src))} files")
    settings = {
        "source": SOURCE,
        "src": str(src.resolve()),
        "max_pixels": max_pixels,
        "shard_size": shard_size,
        "files": [p.name for p in files],
    }
    manifest = prepare_output(out, settings, overwrite, refuse_complete=False)
    folder = build_folder(out, overwrite)
    if folder != out:
        try:
            manifest = prepare_output(folder, settings, overwrite=False, refuse_complete=False)
        except OutputExists:  # a replacement begun with other settings: start over
            shutil.rmtree(folder)
            manifest = {}
    done = _finished_files(folder, manifest)
    todo = [p for p in files if p.name not in done]
    if on_total:
        on_total(sum(count_records(p) for p in files))
    if on_item:
        on_item(sum(r.records for r in done.values()))
    folder.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        remove_leftovers(folder / split)

    def record(result: FileResult) -> None:
        done[result.name] = result
        _write(folder, settings, done, complete=False)
        if on_item:
            on_item(result.records)

    if workers <= 1:
        for path in todo:
            record(convert_file(str(folder), str(path), max_pixels, shard_size))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(convert_file, str(folder), str(p), max_pixels, shard_size) for p in todo]
            for future in futures:
                record(future.result())
    failures = [
        RecordOutcome(src / r.name, record_id, r.split, error=problem)
        for r in done.values()
        for record_id, problem in r.failures
    ]
    complete = not failures
    _write(folder, settings, done, complete=complete)
    if folder != out and complete:
        replace_folder(folder, out)
    derived = sum(r.derived for r in done.values())
    seconds = time.perf_counter() - start
    return ConversionReport(_per_split(done, "samples"), _per_split(done, "unrated"), derived, failures, seconds)


def _write(folder: Path, settings: dict[str, Any], done: dict[str, FileResult], complete: bool) -> None:
    shards = {name: rec for r in done.values() for name, rec in r.shards.items()}
    files = {
        r.name: {
            "split": r.split,
            "shards": sorted(r.shards),
            "samples": r.samples,
            "unrated": r.unrated,
            "derived": r.derived,
            "failures": [list(f) for f in r.failures],
        }
        for r in done.values()
    }
    counts = {
        "samples": _per_split(done, "samples"),
        FILES: files,
        "failed": sum(len(r.failures) for r in done.values()),
    }
    write_manifest(folder, settings, complete=complete, counts=counts, shards=shards)


def _per_split(done: dict[str, FileResult], count: str) -> dict[str, int]:
    """A count of the converted files (`samples`, `unrated`), summed per split."""
    return {split: sum(getattr(r, count) for r in done.values() if r.split == split) for split in SPLITS}


def _finished_files(folder: Path, manifest: dict[str, Any]) -> dict[str, FileResult]:
    """The files an earlier run of the same settings finished whose shards are all there and match their
    records; a file with a shard missing or damaged is converted again."""
    recorded = manifest.get(FILES) or {}
    records = manifest.get(SHARDS) or {}
    done = {}
    for name, entry in recorded.items():
        shards = {s: records.get(s) for s in entry["shards"]}
        if all(rec is not None and check_shard(folder, s, rec).ok for s, rec in shards.items()):
            done[name] = FileResult(
                name,
                entry["split"],
                shards,
                entry["samples"],
                entry["unrated"],
                entry["derived"],
                [tuple(f) for f in entry["failures"]],
            )
    return done
