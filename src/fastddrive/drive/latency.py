"""What an answer costs in simulated time: `measured`, `fixed:MS` (or per decoder) and `zero`.

- measured: the decoder's own wall time for this answer, prefill plus decode (`DecodeResult.latency_ms`);
- fixed:MS: MS milliseconds for every decoder, or `fixed:ar=7855,ss=1919` one value per decoder, so that a
  figure does not depend on this machine's noise and a GPU's latencies can be replayed on a CPU;
- zero: the answer is in force the moment it was asked for (the open-loop ideal);
- sweep:MS,MS,...: not one latency but a list of fixed ones, each charged to every decoder in its own run
  (`parse_sweep`; drive/sweep.py runs them).

Reference planners (the expert, constant velocity) are not decoders: their answers always cost zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from fastddrive.drive import DriveError

MODES = ("measured", "fixed:MS", "fixed:DECODER=MS,...", "zero")
SWEEP = "sweep:"  # sweep:MS,MS,... a list of fixed latencies, one run each
MAX_FIXED_MS = 60_000.0  # a minute of simulated time per answer: twelve times the 5 s a plan covers


class LatencyError(DriveError):
    """A latency spec that is not one of MODES, or a fixed value that is not a latency."""


@dataclass(frozen=True)
class Latency:
    mode: Literal["measured", "fixed", "zero"]
    fixed_ms: dict[str, float] = field(default_factory=dict)  # decoder spec -> ms, for mode "fixed"

    def charge_ms(self, decoder: str | None, measured_ms: float) -> float:
        """The simulated delay of one answer of `decoder` (a spec; None for a reference planner)."""
        if decoder is None or self.mode == "zero":
            return 0.0
        return measured_ms if self.mode == "measured" else self.fixed_ms[decoder]

    def describe(self, decoder: str | None) -> str:
        if decoder is None or self.mode == "zero":
            return "zero"
        return "measured" if self.mode == "measured" else f"fixed {self.fixed_ms[decoder]:g} ms"


def _milliseconds(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= MAX_FIXED_MS:
        raise LatencyError(f"{what}: {text!r} is not a latency in milliseconds (a number from 0 to {MAX_FIXED_MS:g})")
    return value


def parse_latency(spec: str, decoders: list[str]) -> Latency:
    """'measured', 'zero', 'fixed:250' or 'fixed:ar=7855,ss=1919': one value for each of `decoders`, the
    run's decoder specs (a spec with options is named whole: 'fixed:sd:tau=0.0=300')."""
    text = spec.strip()
    if text in ("measured", "zero"):
        return Latency(text)
    if text.startswith(SWEEP):
        raise LatencyError(f"latency {spec!r} is a list of runs, not one latency: run it with drive.sweep.run_sweep")
    kind, sep, values = text.partition(":")
    if kind != "fixed" or not sep:
        raise LatencyError(f"unknown latency {spec!r}; use one of: {', '.join(MODES)}")
    if "=" not in values:
        return Latency("fixed", dict.fromkeys(decoders, _milliseconds(values, f"latency {spec!r}")))
    fixed = parse_named_ms(values, decoders, f"latency {spec!r}")
    missing = [name for name in decoders if name not in fixed]
    if missing:
        raise LatencyError(f"latency {spec!r} gives no value for decoder {missing[0]!r}")
    return Latency("fixed", fixed)


def parse_named_ms(text: str, decoders: list[str], what: str) -> dict[str, float]:
    """'ar=7855,ss=1919' as {decoder spec: ms}, each name one of `decoders` and given once (not necessarily
    all of them); `what` names the input in the error ("latency 'fixed:...'", "--mark 'ar=1'")."""
    named: dict[str, float] = {}
    for pair in text.split(","):
        name, sep, ms = pair.strip().rpartition("=")
        if not sep:
            raise LatencyError(f"{what}: {pair.strip()!r} is not DECODER=MS")
        if name not in decoders:
            raise LatencyError(f"{what} names {name!r}, which is not a decoder of this run ({decoders})")
        if name in named:
            raise LatencyError(f"{what} gives {name!r} twice")
        named[name] = _milliseconds(ms, what)
    return named


def parse_sweep(spec: str) -> list[float] | None:
    """The latencies of 'sweep:0,250,500' in the order given (each 0 to MAX_FIXED_MS ms, none twice), or None
    when `spec` is not a sweep (then it is one latency for `parse_latency`)."""
    text = spec.strip()
    if not text.startswith(SWEEP):
        return None
    values = [v.strip() for v in text.removeprefix(SWEEP).split(",")]
    if values == [""]:
        raise LatencyError(f"latency sweep {spec!r} gives no latency: give sweep:MS,MS,... (e.g. sweep:0,250,500)")
    sweep: list[float] = []
    for value in values:
        ms = _milliseconds(value, f"latency sweep {spec!r}")
        if ms in sweep:
            raise LatencyError(f"latency sweep {spec!r} gives {ms:g} ms twice")
        sweep.append(ms)
    return sweep
