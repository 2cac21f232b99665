"""Every decoder on the same scenes, in one process, after a warm-up: speed and accuracy side by side.

DESIGN section 7 (throughput): medians over samples, speed-up against `ar` measured in the same run.
Decoders run interleaved scene by scene, so that drifts of a noisy machine hit all of them alike. A scene
that does not read from its shard, or on which a decoder fails, is reported by shard and sample id and left
out of every row, so that the rows stay over the same scenes; the others complete (issue 32). Under
`accelerate launch` the timed scenes are shared among the processes (each warms up on the first scene) and
the results and failures gathered once: the same rows as one process, timed on more machines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import cycle
from pathlib import Path

import numpy as np

from fastddrive.core.metrics import waypoint_ade_m
from fastddrive.core.sample import DrivingSample, SampleError
from fastddrive.data.dataset import DrivingDataset
from fastddrive.data.episodes import MAX_SEED, SEED_STRIDE
from fastddrive.data.highway import DEFAULT_SCENARIOS, episode_samples
from fastddrive.decode.registry import DecoderError
from fastddrive.decode.result import DecodeResult
from fastddrive.eval.accuracy import StoredSample, stored_samples
from fastddrive.eval.parallel import gather, share
from fastddrive.planner import Planner


def check_seed(seed: int, option: str = "--seed") -> None:
    """SampleError unless `seed` seeds fresh scenes: 0..MAX_SEED, as the data generator's seeds (scene k is
    seeded seed * SEED_STRIDE + k, a non-negative 64-bit integer); checked before any simulation."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise SampleError(
            f"{option} {seed} is out of range: give 0 to {MAX_SEED} (scene k is seeded seed * {SEED_STRIDE} + k, "
            "a non-negative 64-bit integer)"
        )


@dataclass(frozen=True)
class DecoderRun:
    """One row of the benchmark: a decoder with its options, on a planner (label names it)."""

    label: str
    decoder: str
    options: dict[str, object]
    planner: Planner
    baseline: bool = False  # the separately trained AR model writing JSON freely
    oracle: bool = False  # draft what the verifier accepts in full (the speed bound at perfect acceptance)


@dataclass
class BenchRow:
    """Medians over the samples (latency p90 too); ADE is the mean over answers that parse (metres)."""

    label: str
    decoder: str
    samples: int
    nfe: float
    tokens_per_nfe: float
    fed_per_forward: float  # tokens a forward after the prefill carries (what it costs), not what it commits
    tokens_per_s: float
    latency_ms: float
    p90_latency_ms: float
    prefill_ms: float
    decode_ms: float
    speedup_vs_ar: float | None
    speedup_vs_ar_jump: float | None
    speedup_vs_baseline: float | None
    ade3: float | None
    ade5: float | None
    invalid: int
    identical_to_ar: float | None  # share of samples whose ids equal `ar`'s on the same planner

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Decoded:
    """Every decoder on some scenes: per label the results of the timed scenes every decoder answered (`done`:
    their indices among the timed scenes, in order), and one line per scene that failed."""

    results: dict[str, list[DecodeResult]]
    done: list[int]
    failures: list[str] = field(default_factory=list)


@dataclass
class BenchResult:
    """A benchmark: its rows, the timed scenes every decoder answered with their results (per label, aligned),
    and the scenes left out of every row, one line each ("<shard> sample <id>: <what failed>")."""

    rows: list[BenchRow]
    scenes: list[DrivingSample]
    results: dict[str, list[DecodeResult]]
    failures: list[str]


def _median(results: Sequence[DecodeResult], value: Callable[[DecodeResult], float]) -> float:
    return float(np.median([value(r) for r in results])) if results else float("nan")


def run_decoders(
    runs: Sequence[DecoderRun],
    scenes: Sequence[DrivingSample],
    warmup: int = 1,
    on_result: Callable[[], None] | None = None,
    names: Sequence[str] | None = None,
) -> Decoded:
    """Every decoder on every scene after `warmup` untimed scenes (which are not in the results). A scene on
    which a decoder raises is reported (named by `names`, else its sample id) and dropped for every decoder."""
    if len(scenes) <= warmup:
        raise ValueError(f"the benchmark needs more than {warmup} scene(s): the first {warmup} only warm up")
    labels = [run.label for run in runs]
    if any(run.oracle and "ar" not in labels[:k] for k, run in enumerate(runs)):
        raise ValueError("oracle drafts are `ar`'s ids: give `ar` among the decoders, before them")
    decoded = Decoded({run.label: [] for run in runs}, [])
    for k, scene in enumerate(scenes):
        answers: dict[str, DecodeResult] = {}
        for run in runs:
            options = run.options
            try:
                if run.oracle:
                    options = options | {"drafts": _accepted_drafts(run, scene, answers["ar"].token_ids)}
                answers[run.label] = run.planner.plan(scene, run.decoder, **options)
            except DecoderError:
                raise  # a wrong decoder or option fails every scene alike
            except Exception as err:  # one failed scene is reported and left out of every row; the rest completes
                name = (names[k] if names is not None else scene.sample_id) + (" (warm-up)" if k < warmup else "")
                decoded.failures.append(f"{name}: {run.label}: {type(err).__name__}: {err}")
                break
            finally:
                if k >= warmup and on_result:
                    on_result()
        if k >= warmup and len(answers) == len(runs):
            decoded.done.append(k - warmup)
            for label, answer in answers.items():
                decoded.results[label].append(answer)
    return decoded


def _accepted_drafts(run: DecoderRun, scene: DrivingSample, drafts: list[int], tries: int = 4) -> list[int]:
    """Oracle drafts, found untimed: `ar`'s ids, which the verifier accepts in full in float32; in bfloat16 a
    block forward can order near-equal logits otherwise than `ar`'s one-token forwards, so the drafts
    become the ids the verifier returned with them until they are its fixed point (or `tries` run out)."""
    for _ in range(tries):
        ids = run.planner.plan(scene, run.decoder, **(run.options | {"drafts": drafts})).token_ids
        if ids == drafts:
            break
        drafts = ids
    return drafts


def summarise(
    runs: Sequence[DecoderRun], scenes: Sequence[DrivingSample], results: dict[str, list[DecodeResult]]
) -> list[BenchRow]:
    """One row per decoder; `scenes` are the timed ones, in the order of the results."""
    # `ar` on the model under test: the reference for speed-up and for token-for-token equality; `ar-jump`
    # the strongest exact AR baseline; the separately trained AR model the paper's headline baseline.
    reference = next((run for run in runs if run.label == "ar"), None)
    jump = next((run for run in runs if run.label == "ar-jump"), None)
    free = next((run for run in runs if run.baseline), None)
    ar_latency, jump_latency, free_latency = (
        _median(results[run.label], lambda r: r.latency_ms) if run else None for run in (reference, jump, free)
    )
    rows = []
    for run in runs:
        done = results[run.label]
        pairs = zip(done, scenes, strict=True)
        ades = [waypoint_ade_m(np.asarray(r.response.trajectory), s.future) for r, s in pairs if r.response]
        identical = None
        if reference is not None and reference.planner is run.planner:
            same = zip(done, results[reference.label], strict=True)
            identical = float(np.mean([a.token_ids == b.token_ids for a, b in same]))
        latency = _median(done, lambda r: r.latency_ms)
        rows.append(
            BenchRow(
                label=run.label,
                decoder=run.decoder,
                samples=len(done),
                nfe=_median(done, lambda r: r.nfe),
                tokens_per_nfe=_median(done, lambda r: r.tokens_per_nfe),
                fed_per_forward=_median(done, lambda r: r.fed_per_forward),
                tokens_per_s=_median(done, lambda r: r.tokens_per_s),
                latency_ms=latency,
                p90_latency_ms=float(np.percentile([r.latency_ms for r in done], 90)) if done else float("nan"),
                prefill_ms=_median(done, lambda r: r.prefill_ms),
                decode_ms=_median(done, lambda r: r.decode_ms),
                speedup_vs_ar=ar_latency / latency if ar_latency else None,
                speedup_vs_ar_jump=jump_latency / latency if jump_latency else None,
                speedup_vs_baseline=free_latency / latency if free_latency else None,
                ade3=float(np.mean([a[0] for a in ades])) if ades else None,
                ade5=float(np.mean([a[1] for a in ades])) if ades else None,
                invalid=len(done) - len(ades),
                identical_to_ar=identical,
            )
        )
    return rows


def _scene(item: DrivingSample | StoredSample) -> tuple[str, DrivingSample | None, str | None]:
    """(its name in a report, the sample or None, why it did not read)."""
    if isinstance(item, StoredSample):
        return item.where, item.sample, item.problem
    return item.sample_id, item, None


def readable(scenes: Sequence[DrivingSample | StoredSample]) -> list[DrivingSample]:
    """The scenes that read, in order (what `run_bench` times after the first)."""
    return [sample for _, sample, _ in map(_scene, scenes) if sample is not None]


def _too_few(unread: list[str]) -> SampleError:
    first = f"; {unread[0]}" if unread else ""
    return SampleError(f"the benchmark needs at least 2 readable scenes (one is the warm-up){first}")


def run_bench(
    runs: Sequence[DecoderRun],
    scenes: Sequence[DrivingSample | StoredSample],
    on_result: Callable[[], None] | None = None,
) -> BenchResult:
    """Every decoder on the readable `scenes` after a warm-up on the first of them, data parallel (module doc);
    `on_result` is called after each result of this process. Failed scenes are in `failures`, in no row."""
    readable, failures = [], []
    for item in scenes:
        name, sample, problem = _scene(item)
        if sample is None:
            failures.append(f"{name}: {problem}")
        else:
            readable.append((name, sample))
    if len(readable) < 2:
        raise _too_few(failures)
    timed = readable[1:]
    mine = share(range(len(timed)))
    if mine:
        chosen = [readable[0], *(timed[i] for i in mine)]
        decoded = run_decoders(runs, [s for _, s in chosen], 1, on_result, [n for n, _ in chosen])
        part = (decoded.results, [mine[i] for i in decoded.done], decoded.failures)
    else:
        part = ({run.label: [] for run in runs}, [], [])
    parts = gather([part])
    merged = {run.label: [r for results, _, _ in parts for r in results[run.label]] for run in runs}
    done = [timed[i][1] for _, indices, _ in parts for i in indices]
    # Every process warms up on the same scene: a failed warm-up is reported once.
    failures += list(dict.fromkeys(line for _, _, lines in parts for line in lines))
    return BenchResult(summarise(runs, done, merged), done, merged, failures)


def bench_scenes(data: Path | None, split: str, seed: int, needed: int) -> list[DrivingSample | StoredSample]:
    """`needed` scenes (the first warms up): the first of a dataset split, each with where it is stored (one
    that does not read is kept, for `run_bench` to report), or fresh seeded simulator episodes."""
    check_seed(seed)
    if data is not None:
        chosen: list[DrivingSample | StoredSample] = list(stored_samples(DrivingDataset.open(data), split, 0, needed))
    else:
        chosen = []  # one scene per episode (its first, at t = 3 s), cycling the scenario types
        for k, name in zip(range(needed * 3), cycle(DEFAULT_SCENARIOS)):
            chosen += episode_samples(name, seed * SEED_STRIDE + k, max_duration_s=9)[:1]
            if len(chosen) >= needed:
                break
    unread = [f"{name}: {problem}" for name, sample, problem in map(_scene, chosen) if sample is None]
    if len(chosen) - len(unread) < 2:
        raise _too_few(unread)
    return chosen
