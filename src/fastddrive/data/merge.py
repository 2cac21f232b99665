"""The union of data sets as one data set: DAgger's aggregation D <- D u D_i (Ross, Gordon and Bagnell, 2011).

`fastddrive train` reads one data set folder; a DAgger round adds the samples collected with the last model
(drive/dagger.py) to everything gathered before. Every shard of every source is copied, unchanged, into the
same split, named `s<k>-<name>` after its source's place k on the command line, so the splits stay by episode
and a scene stays in one split. The sources are checked first: each must be a complete data set whose shards
all match their manifest (every byte copied is checked against its recorded sha256 too), and no sample id may
be in two of them (the same data twice would weigh it double). The manifest records each source's settings
and a fingerprint of its shards as the merge's settings, and their episode end reasons under `s<k>.`.

The merge is built beside `--out` and takes its place only when whole (build.staged_build): interrupted,
`--out` is as it was, and the same command starts it again. A data set in `--out` is replaced only with
`overwrite` (a complete merge of the same sources has nothing left to do).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastddrive.core.outputs import check_folder_destination, write_bytes
from fastddrive.data.build import prepare_output, staged_build, write_manifest
from fastddrive.data.dataset import SPLITS, DatasetError, DrivingDataset, ShardCheck, check_shard, shard_record
from fastddrive.data.verify import unfinished

SOURCE = "merge"


@dataclass(frozen=True)
class MergeReport:
    """What a merge wrote: the samples per split, the shards, the time it took."""

    samples: dict[str, int]  # per split
    shards: int
    seconds: float


def _open_sources(sources: Sequence[str | Path]) -> list[DrivingDataset]:
    """The sources, each a complete data set; DatasetError (one line) for the first that is not."""
    if len(sources) < 2:
        raise DatasetError(f"give at least two data sets to merge ({len(sources)} given)")
    resolved = [Path(s).resolve() for s in sources]
    twice = next((str(s) for s, r in zip(sources, resolved, strict=True) if resolved.count(r) > 1), None)
    if twice is not None:
        raise DatasetError(f"{twice} is named twice: its samples would weigh double")
    datasets = [DrivingDataset.open(s) for s in sources]
    for dataset in datasets:
        why = unfinished(dataset)
        if why is not None:
            raise DatasetError(f"{dataset.root} is not a complete data set ({why}); finish it before merging it")
    _check_frames(datasets)
    return datasets


def _simulator_frames(settings: dict) -> set[tuple[str, str]]:
    """How the simulator frames of a data set were drawn (size, past boxes), through merges of merges."""
    if "sources" in settings:
        return {f for source in settings["sources"] for f in _simulator_frames(source["settings"])}
    if "frame_size_px" not in settings:
        return set()  # camera frames (WOD-E2E, nuScenes): not the simulator's
    return {(str(settings["frame_size_px"]), str(settings.get("frame_past_boxes_s", "none")))}


def _check_frames(datasets: list[DrivingDataset]) -> None:
    """DatasetError when two sources' simulator frames are drawn differently: a model trained on both would
    learn two pictures of one scene (data/past_boxes.py)."""
    seen: dict[tuple[str, str], Path] = {}
    for dataset in datasets:
        for frames in sorted(_simulator_frames(dataset.manifest["settings"])):
            other = next((root for key, root in seen.items() if key != frames), None)
            if other is not None:
                size, boxes = frames
                raise DatasetError(
                    f"{dataset.root} draws its frames at {size} px with past boxes {boxes}, {other} otherwise; "
                    "remake the older one with this version's `data highway` or `data dagger`"
                )
            seen[frames] = dataset.root


def _check_ids(datasets: list[DrivingDataset]) -> dict[str, int]:
    """The samples of every split, summed; DatasetError naming a sample id that two sources hold. Reading the ids
    also checks every shard against its manifest (dataset.py), naming the first that is not what was written."""
    owner: dict[str, Path] = {}
    samples = dict.fromkeys(SPLITS, 0)
    for dataset in datasets:
        mine: set[str] = set()
        for split in SPLITS:
            ids = [str(i) for i in dataset.table(split, columns=["sample_id"])["sample_id"].to_pylist()]
            samples[split] += len(ids)
            mine.update(ids)
        clash = next((i for i in sorted(mine) if i in owner), None)
        if clash is not None:
            raise DatasetError(
                f"sample {clash} is in both {owner[clash]} and {dataset.root}; a sample merged twice would weigh "
                "double (collect each DAgger round with its own --seed or model)"
            )
        owner.update(dict.fromkeys(mine, dataset.root))
    return samples


def merge_settings(datasets: list[DrivingDataset]) -> dict[str, object]:
    """The merge's settings: what each source is, by its own settings and its shards' fingerprint."""
    return {
        "source": SOURCE,
        "sources": [{"settings": d.manifest["settings"], "fingerprint": d.fingerprint()} for d in datasets],
    }


def merge_datasets(
    sources: Sequence[str | Path],
    out: str | Path,
    overwrite: bool = False,
    on_start: Callable[[int], None] | None = None,
    on_shard: Callable[[str], None] | None = None,
) -> MergeReport:
    """Write the union of `sources` to `out` (module docstring). `on_start(shards)` once the sources are checked,
    `on_shard(name)` after each shard copied. Every refusal is one line (DatasetError, build.OutputExists,
    core.outputs.OutputError) before anything is written."""
    start = time.perf_counter()
    out = Path(out)
    check_folder_destination(out, "--out", inputs=sources, owned=(out,))
    datasets = _open_sources(sources)
    settings = merge_settings(datasets)
    prepare_output(out, settings, overwrite)  # a complete merge of the same sources: nothing to do, refused
    samples = _check_ids(datasets)
    copies = [(k, d, c) for k, d in enumerate(datasets) for split in SPLITS for c in d.check_shards(split, False)]
    if on_start:
        on_start(len(copies))

    def merge(folder: Path) -> int:
        write_manifest(folder, settings, complete=False, counts={}, shards={})
        records: dict[str, dict[str, object]] = {}
        for k, dataset, check in copies:
            name = _copy(dataset, check, folder, k)
            records[name] = shard_record((folder / name).read_bytes(), _samples(dataset, check))
            if on_shard:
                on_shard(name)
        ends = {
            f"s{k}.{key}": reason
            for k, dataset in enumerate(datasets)
            for key, reason in sorted(dataset.manifest.get("end_reasons", {}).items())
        }
        counts = {"episodes_written": len(records), "end_reasons": ends}
        write_manifest(folder, settings, complete=True, counts=counts, shards=records)
        return len(records)

    shards, _ = staged_build(out, merge, lambda _: True)
    return MergeReport(samples, shards, time.perf_counter() - start)


def _copy(dataset: DrivingDataset, check: ShardCheck, folder: Path, k: int) -> str:
    """Copy one shard of source `k` into `folder`, checked against its record as it is read; its new name."""
    split, name = check.shard.split("/", 1)
    data = (dataset.root / check.shard).read_bytes()
    record = (dataset.records or {}).get(check.shard)
    if record is not None and hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise DatasetError(
            f"damaged dataset {dataset.root}: shard {check.shard} changed while it was merged (it no longer "
            "matches its checksum); make that data set again"
        )
    target = f"{split}/s{k}-{name}"
    write_bytes(folder / target, data)
    return target


def _samples(dataset: DrivingDataset, check: ShardCheck) -> int:
    """The shard's sample count: its record's, or (a data set from before records) its parquet footer's."""
    record = (dataset.records or {}).get(check.shard)
    if record is not None:
        return int(record["samples"])
    counted = check_shard(dataset.root, check.shard, None)
    return counted.samples or 0
