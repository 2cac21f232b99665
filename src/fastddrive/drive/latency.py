"""What an answer costs in simulated time: `measured`, `fixed:MS` (or per decoder) and `zero`.

- measured: the decoder's own wall time for this answer, prefill plus decode (`DecodeResult.latency_ms`);
- fixed:MS: MS milliseconds for every decoder, or `fixed:ar=7855,ss=1919` one value per decoder, so that a
  figure does not depend on this machine's noise and a GPU's latencies can be replayed on a CPU;
- zero: the answer is in force the moment it was asked for (the open-loop ideal).

Reference planners (the expert, constant velocity) are not decoders: their answers always cost zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from fastddrive.drive import DriveError

MODES = ("measured", "fixed:MS", "fixed:DECODER=MS,...", "zero")
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


def _milliseconds(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= MAX_FIXED_MS:
        raise LatencyError(
            f"latency {spec!r}: {text!r} is not a latency in milliseconds (a number from 0 to {MAX_FIXED_MS:g})"
        )
    return value


def parse_latency(spec: str, decoders: list[str]) -> Latency:
    """'measured', 'zero', 'fixed:250' or 'fixed:ar=7855,ss=1919': one value for each of `decoders`, the
    run's decoder specs (a spec with options is named whole: 'fixed:sd:tau=0.0=300')."""
    text = spec.strip()
    if text in ("measured", "zero"):
        return Latency(text)
    kind, sep, values = text.partition(":")
    if kind != "fixed" or not sep:
        raise LatencyError(f"unknown latency {spec!r}; use one of: {', '.join(MODES)}")
    if "=" not in values:
        return Latency("fixed", dict.fromkeys(decoders, _milliseconds(values, spec)))
    fixed: dict[str, float] = {}
    for pair in values.split(","):
        name, _, ms = pair.strip().rpartition("=")
        if name not in decoders:
            raise LatencyError(f"latency {spec!r} names {name!r}, which is not a decoder of this run ({decoders})")
        if name in fixed:
            raise LatencyError(f"latency {spec!r} gives {name!r} twice")
        fixed[name] = _milliseconds(ms, spec)
    missing = [name for name in decoders if name not in fixed]
    if missing:
        raise LatencyError(f"latency {spec!r} gives no value for decoder {missing[0]!r}")
    return Latency("fixed", fixed)
