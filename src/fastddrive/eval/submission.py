"""The WOD-E2E challenge submission (issue 35): every frame of a split planned, as the challenge takes it.

Messages (proto2, package waymo.open_dataset), from waymo-open-dataset
`src/waymo_open_dataset/protos/end_to_end_driving_submission.proto`, mirrored with the official numbers and types
(`data.wod_tfrecord.mirrored_classes`; fastddrive needs neither tensorflow nor waymo's wheel):
- TrajectoryPrediction: `pos_x` = 1, `pos_y` = 2 (repeated float, packed): 20 points at t = 0.25 ... 5 s;
- FrameTrajectoryPredictions: `frame_name` = 1 (the frame's `context.name`), `trajectory` = 2;
- E2EDChallengeSubmission: `predictions` = 1, `submission_type` = 2 (E2ED_SUBMISSION = 1, must be set),
  `account_name` = 3, `unique_method_name` = 4, `authors` = 5, `affiliation` = 6, `description` = 7,
  `method_link` = 8, `uses_public_model_pretraining` = 11, `num_model_parameters` = 12 ("3B"),
  `public_model_names` = 13.

The archive is what the challenge takes: shards of serialized submissions (each with the same metadata and a
part of the predictions), packed with tar and gzip. An answer's 5 waypoints become the 20 points by the JMT the
official evaluator uses (`core.metrics.scored_plan_m`); a frame whose answer does not parse gets the documented
fallback, constant velocity from its history (`core.metrics.constant_velocity_m`), and is counted.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2
from google.protobuf.message import DecodeError

from fastddrive.core.metrics import constant_velocity_m, scored_plan_m
from fastddrive.core.outputs import write_bytes
from fastddrive.core.sample import FUTURE_STEPS
from fastddrive.core.schema import DrivingResponse
from fastddrive.data.dataset import DrivingDataset
from fastddrive.data.wod_tfrecord import mirrored_classes
from fastddrive.decode.registry import DecoderError
from fastddrive.eval.accuracy import stored_samples
from fastddrive.eval.parallel import gather, is_main_process, process_index, share
from fastddrive.planner import Planner

E2ED_SUBMISSION = 1  # E2EDChallengeSubmission.SubmissionType
SHARD_PREDICTIONS = 1000  # predictions per shard
SHARD_NAME = "e2ed_submission.binproto-{k:05d}-of-{n:05d}"
_PARAMETERS = re.compile(r"^\d+(\.\d+)?[KMBT]$")  # "3B", "7.5B", "250M"
_F = descriptor_pb2.FieldDescriptorProto

_MESSAGES = {
    "TrajectoryPrediction": [
        ("pos_x", 1, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
        ("pos_y", 2, _F.LABEL_REPEATED, _F.TYPE_FLOAT, None),
    ],
    "FrameTrajectoryPredictions": [
        ("frame_name", 1, _F.LABEL_OPTIONAL, _F.TYPE_STRING, None),
        ("trajectory", 2, _F.LABEL_OPTIONAL, _F.TYPE_MESSAGE, "TrajectoryPrediction"),
    ],
    "E2EDChallengeSubmission": [
        ("predictions", 1, _F.LABEL_REPEATED, _F.TYPE_MESSAGE, "FrameTrajectoryPredictions"),
        ("submission_type", 2, _F.LABEL_OPTIONAL, _F.TYPE_INT32, None),  # an enum: the same varint on the wire
        ("account_name", 3, _F.LABEL_OPTIONAL, _F.TYPE_STRING, None),
        ("unique_method_name", 4, _F.LABEL_OPTIONAL, _F.TYPE_STRING, None),
        ("authors", 5, _F.LABEL_REPEATED, _F.TYPE_STRING, None),
        ("affiliation", 6, _F.LABEL_OPTIONAL, _F.TYPE_STRING, None),
        ("description", 7, _F.LABEL_OPTIONAL, _F.TYPE_STRING, None),
        ("method_link", 8, _F.LABEL_OPTIONAL, _F.TYPE_STRING, None),
        ("uses_public_model_pretraining", 11, _F.LABEL_OPTIONAL, _F.TYPE_BOOL, None),
        ("num_model_parameters", 12, _F.LABEL_OPTIONAL, _F.TYPE_STRING, None),
        ("public_model_names", 13, _F.LABEL_REPEATED, _F.TYPE_STRING, None),
    ],
}
Submission = mirrored_classes("fastddrive/wod_e2e_submission.proto", _MESSAGES)["E2EDChallengeSubmission"]


class SubmissionError(ValueError):
    """Submission metadata that the challenge would refuse, or an archive that does not fit a split."""


@dataclass(frozen=True)
class SubmissionMetadata:
    """What the challenge records of a method; `check` names the first required field that is missing."""

    account_name: str = ""
    unique_method_name: str = ""
    authors: tuple[str, ...] = ()
    affiliation: str = ""
    description: str = ""
    method_link: str = ""
    uses_public_model_pretraining: bool | None = None
    num_model_parameters: str = ""
    public_model_names: tuple[str, ...] = field(default_factory=tuple)

    def check(self) -> None:
        """SubmissionError naming the first required field that is missing or malformed (before any planning)."""
        for name, option in (
            ("account_name", "--account-name"),
            ("unique_method_name", "--method-name"),
            ("affiliation", "--affiliation"),
            ("description", "--description"),
        ):
            if not str(getattr(self, name)).strip():
                raise SubmissionError(f"the submission needs {name}: give {option}")
        if not any(a.strip() for a in self.authors):
            raise SubmissionError("the submission needs authors: give --authors (once per author)")
        if self.uses_public_model_pretraining is None:
            raise SubmissionError(
                "the submission needs uses_public_model_pretraining: give --uses-public-model-pretraining or "
                "--no-uses-public-model-pretraining"
            )
        if self.uses_public_model_pretraining and not self.public_model_names:
            raise SubmissionError("a method that uses public model pretraining names them: give --public-model-names")
        if not _PARAMETERS.match(self.num_model_parameters.strip()):
            raise SubmissionError(
                f"num_model_parameters must be a count like 3B, 7.5B or 250M (give --num-model-parameters), "
                f"got {self.num_model_parameters!r}"
            )


def submitted_points(response: DrivingResponse | None, history: np.ndarray) -> tuple[np.ndarray, bool]:
    """The 20 points at t = 0.25 ... 5 s submitted for an answer, and whether they are the fallback (constant
    velocity from the history, for an answer that does not parse)."""
    if response is None:
        return constant_velocity_m(history, FUTURE_STEPS), True
    return scored_plan_m(response), False


def submission_shards(
    predictions: Mapping[str, np.ndarray], metadata: SubmissionMetadata, per_shard: int = SHARD_PREDICTIONS
) -> list[bytes]:
    """The serialized E2EDChallengeSubmission shards of `predictions` (frame name -> (20, 2) points), in frame
    order, each with the metadata (`metadata.check()` first)."""
    metadata.check()
    names = list(predictions)
    shards = []
    for start in range(0, max(len(names), 1), per_shard):
        message = Submission(
            submission_type=E2ED_SUBMISSION,
            account_name=metadata.account_name,
            unique_method_name=metadata.unique_method_name,
            authors=list(metadata.authors),
            affiliation=metadata.affiliation,
            description=metadata.description,
            method_link=metadata.method_link,
            uses_public_model_pretraining=bool(metadata.uses_public_model_pretraining),
            num_model_parameters=metadata.num_model_parameters.strip(),
            public_model_names=list(metadata.public_model_names),
        )
        for name in names[start : start + per_shard]:
            points = np.asarray(predictions[name], dtype=np.float64)
            prediction = message.predictions.add(frame_name=name)
            prediction.trajectory.pos_x.extend(points[:, 0].tolist())
            prediction.trajectory.pos_y.extend(points[:, 1].tolist())
        shards.append(message.SerializeToString(deterministic=True))
    return shards


def write_submission(
    path: str | Path, predictions: Mapping[str, np.ndarray], metadata: SubmissionMetadata
) -> list[str]:
    """Write the `.tar.gz` the challenge takes, atomically and reproducibly (no timestamps); returns the shard
    names inside."""
    shards = submission_shards(predictions, metadata)
    names = [SHARD_NAME.format(k=k, n=len(shards)) for k in range(len(shards))]
    buffer = io.BytesIO()
    # gzip's header time fixed: the same predictions give the same bytes
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as packed, tarfile.open(fileobj=packed, mode="w") as archive:
        for name, data in zip(names, shards, strict=True):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    write_bytes(path, buffer.getvalue())
    return names


MAX_ARCHIVE_MEMBER_BYTES = 1 << 30  # a shard of ~1,000 predictions is ~200 kB


def read_submission(path: str | Path) -> list[Any]:
    """The E2EDChallengeSubmission shards of an archive, in name order; SubmissionError naming what is wrong
    (not a tar.gz, a member that is not a plain file, one that does not parse)."""
    path = Path(path)
    try:
        with tarfile.open(path, mode="r:gz") as archive:
            members = sorted(archive.getmembers(), key=lambda m: m.name)
            shards = []
            for member in members:
                if not member.isfile():
                    raise SubmissionError(f"{path}: {member.name!r} is not a plain file")
                if member.size > MAX_ARCHIVE_MEMBER_BYTES:
                    raise SubmissionError(f"{path}: {member.name!r} is {member.size} bytes, more than a shard holds")
                data = archive.extractfile(member).read()
                try:
                    shards.append(Submission.FromString(data))
                except DecodeError as err:
                    raise SubmissionError(f"{path}: {member.name!r} is not an E2EDChallengeSubmission: {err}") from None
    except (tarfile.TarError, OSError, EOFError) as err:
        raise SubmissionError(f"{path} is not a readable .tar.gz: {err}") from None
    if not shards:
        raise SubmissionError(f"{path} holds no submission shard")
    return shards


def check_submission(path: str | Path, frame_names: Sequence[str]) -> int:
    """Check an archive against a split's frames: one prediction per frame, names equal to the frames'
    `context.name`, 20 finite points each, the submission type and required metadata set in every shard.
    Returns the prediction count; SubmissionError naming the first problem."""
    shards = read_submission(path)
    seen: dict[str, int] = {}
    for k, shard in enumerate(shards):
        if shard.submission_type != E2ED_SUBMISSION:
            raise SubmissionError(f"shard {k}: submission_type is {shard.submission_type}, not E2ED_SUBMISSION (1)")
        if not shard.HasField("uses_public_model_pretraining"):
            raise SubmissionError(f"shard {k}: uses_public_model_pretraining is not set")
        metadata = SubmissionMetadata(
            shard.account_name,
            shard.unique_method_name,
            tuple(shard.authors),
            shard.affiliation,
            shard.description,
            shard.method_link,
            shard.uses_public_model_pretraining,
            shard.num_model_parameters,
            tuple(shard.public_model_names),
        )
        try:
            metadata.check()
        except SubmissionError as err:
            raise SubmissionError(f"shard {k}: {err}") from None
        for prediction in shard.predictions:
            name = prediction.frame_name
            if name in seen:
                raise SubmissionError(f"frame {name!r} is predicted twice (shards {seen[name]} and {k})")
            seen[name] = k
            xs, ys = prediction.trajectory.pos_x, prediction.trajectory.pos_y
            if len(xs) != FUTURE_STEPS or len(ys) != FUTURE_STEPS:
                raise SubmissionError(
                    f"frame {name!r}: {len(xs)} pos_x and {len(ys)} pos_y, not {FUTURE_STEPS} points each"
                )
            if not np.isfinite([*xs, *ys]).all():
                raise SubmissionError(f"frame {name!r}: its points are not all finite")
    expected = set(frame_names)
    if unknown := sorted(set(seen) - expected):
        raise SubmissionError(f"frame {unknown[0]!r} is not a frame of the split ({len(unknown)} such)")
    if missing := [n for n in frame_names if n not in seen]:
        raise SubmissionError(f"frame {missing[0]!r} of the split has no prediction ({len(missing)} missing)")
    return len(seen)


@dataclass(frozen=True)
class SubmissionReport:
    """A written submission: the archive, its frames, those given the fallback (answers that do not parse) and
    the failed ones among them (a sample that did not read or plan: reported, given the fallback), the frames
    taken from an interrupted run, the shard names, and the seconds taken."""

    path: Path
    frames: int
    fallbacks: int
    failures: list[str]
    resumed: int
    shards: list[str]
    seconds: float


class _Journal:
    """The frames a process has planned, one JSON line each, flushed to disk as they come: an interrupted run
    picks up where it stopped (when it runs with the same settings; otherwise it starts over)."""

    def __init__(self, out: Path, rank: int, settings: dict[str, Any]) -> None:
        self.path = out.with_name(f".{out.name}.part{rank}.jsonl")
        self.entries: dict[str, dict[str, Any]] = {}
        header = json.dumps({"settings": settings}, sort_keys=True)
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.is_file() else []
        if lines[:1] == [header]:
            for line in lines[1:]:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # the line being written when the run stopped
                    break
                self.entries[entry["frame"]] = entry
        self.file = self.path.open("w", encoding="utf-8")  # rewritten whole: a foreign or cut tail is dropped
        self.file.write(header + "\n")
        for entry in self.entries.values():
            self.file.write(json.dumps(entry) + "\n")
        self._sync()

    def add(self, entry: dict[str, Any]) -> None:
        self.entries[entry["frame"]] = entry
        self.file.write(json.dumps(entry) + "\n")
        self._sync()

    def _sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self, remove: bool) -> None:
        self.file.close()
        if remove:
            self.path.unlink(missing_ok=True)


def plan_submission(
    planner: Planner,
    dataset: DrivingDataset,
    split: str,
    decoder: str,
    options: dict[str, Any],
    metadata: SubmissionMetadata,
    out: str | Path,
    settings: dict[str, Any],
    on_sample: Callable[[], None] | None = None,
) -> SubmissionReport | None:
    """Plan every frame of `split` with `decoder` and write the challenge archive `out` (the main process;
    the others return None). The metadata is checked before anything is planned; each process takes a
    contiguous share under `accelerate launch` and keeps a journal beside `out`, so that a run interrupted and
    started again with the same `settings` plans only the frames it had not."""
    metadata.check()
    start_s = time.perf_counter()
    out = Path(out)
    total = len(dataset.table(split, columns=["sample_id"]))
    if total == 0:
        raise SubmissionError(f"split {split!r} has no frames: nothing to submit")
    frames = share(range(total))  # this process's contiguous share of the frames
    first, stop = (frames[0], frames[-1] + 1) if frames else (total, total)
    journal = _Journal(out, process_index(), settings)
    resumed = 0
    try:
        for stored in stored_samples(dataset, split, first, stop):
            if stored.sample_id in journal.entries:
                resumed += 1
            else:
                journal.add(_planned(planner, stored, decoder, options))
            if on_sample:
                on_sample()
        planned = [journal.entries[name] for name in _names(dataset, split, first, stop)]
    finally:
        journal.close(remove=False)
    entries = gather(planned)
    if not is_main_process():
        return None
    predictions = {e["frame"]: np.asarray(e["points"]) for e in entries}
    shards = write_submission(out, predictions, metadata)
    for path in out.parent.glob(f".{out.name}.part*.jsonl"):
        path.unlink(missing_ok=True)
    return SubmissionReport(
        out,
        len(predictions),
        sum(e["fallback"] for e in entries),
        [e["failure"] for e in entries if e["failure"]],
        sum(gather([resumed])),
        shards,
        time.perf_counter() - start_s,
    )


def _names(dataset: DrivingDataset, split: str, first: int, stop: int) -> list[str]:
    return [str(n) for n in dataset.table(split, columns=["sample_id"]).column("sample_id").to_pylist()[first:stop]]


def _planned(planner: Planner, stored: Any, decoder: str, options: dict[str, Any]) -> dict[str, Any]:
    """One frame's journal entry: its 20 points, whether they are the fallback, and why it failed (if it did).
    A frame that does not read has no history: its fallback is standing still (zeros)."""
    entry: dict[str, Any] = {"frame": stored.sample_id, "failure": None}
    if stored.sample is None:
        points, fallback = np.zeros((FUTURE_STEPS, 2)), True
        entry["failure"] = f"{stored.where}: {stored.problem}"
    else:
        try:
            response = planner.plan(stored.sample, decoder, **options).response
        except DecoderError:
            raise  # a wrong decoder or option fails every frame alike
        except Exception as err:  # noqa: BLE001 - one failed frame is reported; the rest completes
            response = None
            entry["failure"] = f"{stored.where}: {type(err).__name__}: {err}"
        points, fallback = submitted_points(response, stored.sample.history)
    return entry | {"points": np.round(points, 4).tolist(), "fallback": fallback}
