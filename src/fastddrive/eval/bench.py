"""Every decoder on the same scenes, in one process, after a warm-up: speed and accuracy side by side.

DESIGN section 7 (throughput): medians over samples, speed-up against `ar` measured in the same run.
Decoders run interleaved scene by scene, so that drifts of a noisy machine hit all of them alike. Under
`accelerate launch` the timed scenes are shared among the processes (each warms up on the first scene) and
the results gathered once: the same rows as one process, timed on more machines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from itertools import cycle, islice
from pathlib import Path

import numpy as np

from fastddrive.data.highway import SCENARIOS, episode_samples
from fastddrive.data.sample import DrivingDataset, DrivingSample, SampleError
from fastddrive.decode.result import DecodeResult
from fastddrive.eval.metrics import waypoint_ade_m
from fastddrive.eval.parallel import gather, share
from fastddrive.planner import Planner


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


def _median(results: Sequence[DecodeResult], value: Callable[[DecodeResult], float]) -> float:
    return float(np.median([value(r) for r in results]))


def run_decoders(
    runs: Sequence[DecoderRun],
    scenes: Sequence[DrivingSample],
    warmup: int = 1,
    on_result: Callable[[], None] | None = None,
) -> dict[str, list[DecodeResult]]:
    """Every decoder on every scene after `warmup` untimed scenes (which are not in the results)."""
    if len(scenes) <= warmup:
        raise ValueError(f"the benchmark needs more than {warmup} scene(s): the first {warmup} only warm up")
    labels = [run.label for run in runs]
    if any(run.oracle and "ar" not in labels[:k] for k, run in enumerate(runs)):
        raise ValueError("oracle drafts are `ar`'s ids: give `ar` among the decoders, before them")
    results: dict[str, list[DecodeResult]] = {run.label: [] for run in runs}
    for k, scene in enumerate(scenes):
        answers: dict[str, DecodeResult] = {}
        for run in runs:
            options = run.options | (
                {"drafts": _accepted_drafts(run, scene, answers["ar"].token_ids)} if run.oracle else {}
            )
            answers[run.label] = run.planner.plan(scene, run.decoder, **options)
            if k >= warmup:
                results[run.label].append(answers[run.label])
                if on_result:
                    on_result()
    return results


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
                p90_latency_ms=float(np.percentile([r.latency_ms for r in done], 90)),
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


def run_bench(
    runs: Sequence[DecoderRun], scenes: Sequence[DrivingSample], on_result: Callable[[], None] | None = None
) -> tuple[list[BenchRow], dict[str, list[DecodeResult]]]:
    """(rows, per-scene results) of every decoder on `scenes[1:]` after a warm-up on `scenes[0]`, data parallel
    (module doc); `on_result` is called after each result of this process."""
    warm, timed = list(scenes[:1]), list(scenes[1:])
    mine = share(timed)
    results = run_decoders(runs, warm + mine, 1, on_result) if mine else {run.label: [] for run in runs}
    parts = gather([results])
    merged = {run.label: [r for part in parts for r in part[run.label]] for run in runs}
    return summarise(runs, timed, merged), merged


def bench_scenes(data: Path | None, split: str, seed: int, needed: int) -> list[DrivingSample]:
    """`needed` scenes (the first warms up): from a dataset split, or fresh seeded simulator episodes."""
    if data is not None:
        chosen = list(islice(DrivingDataset.open(data).samples(split), needed))
    else:
        chosen = []  # one scene per episode (its first, at t = 3 s), cycling the scenario types
        for k, name in zip(range(needed * 3), cycle(SCENARIOS)):
            chosen += episode_samples(name, seed * 100_000 + k, max_duration_s=9)[:1]
            if len(chosen) >= needed:
                break
    if len(chosen) < 2:
        raise SampleError("the benchmark needs at least 2 scenes (one is the warm-up)")
    return chosen
