"""Paired differences between two planners driven over the same episodes, with a bootstrap interval.

Two planners' mean driving scores over a few dozen episodes differ by less than either varies from episode to
episode; the difference episode by episode (same scenario, seed and traffic) varies far less. A planner is
measurably better than another when the 95% interval of the mean of those differences excludes 0 (the
percentile bootstrap over episodes, resampled with a fixed seed so the same results give the same interval).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.stats import bootstrap

CONFIDENCE = 0.95
RESAMPLES = 10_000
BOOTSTRAP_SEED = 0

Side = tuple[str, str]  # (label, latency as the results name it)


def paired_difference(results: Sequence[dict[str, Any]], a: Side, b: Side, metric: str = "driving_score") -> dict:
    """`b` minus `a` in `metric`, over the episodes (scenario, seed) both drove: their mean, the 95% interval
    (None below two episodes) and the count."""
    by_side: dict[Side, dict[tuple[str, int], float]] = {a: {}, b: {}}
    for result in results:
        side = (result["label"], result["latency"])
        if side in by_side:
            by_side[side][(result["scenario"], result["seed"])] = float(result["metrics"][metric])
    episodes = sorted(by_side[a].keys() & by_side[b].keys())
    differences = np.array([by_side[b][e] - by_side[a][e] for e in episodes])
    interval = None
    if len(differences) >= 2:
        if np.ptp(differences) == 0:  # every resample has the same mean
            interval = [float(differences[0])] * 2
        else:
            found = bootstrap(
                (differences,),
                np.mean,
                confidence_level=CONFIDENCE,
                n_resamples=RESAMPLES,
                method="percentile",
                rng=np.random.default_rng(BOOTSTRAP_SEED),
            ).confidence_interval
            interval = [float(found.low), float(found.high)]
    return {
        "a": {"planner": a[0], "latency": a[1]},
        "b": {"planner": b[0], "latency": b[1]},
        "metric": metric,
        "episodes": len(episodes),
        "mean_difference": float(differences.mean()) if len(differences) else None,
        "interval_95": interval,
    }


def excludes_zero(pair: dict[str, Any]) -> bool:
    """The interval lies wholly on one side of 0: one planner is measurably better."""
    interval = pair["interval_95"]
    return interval is not None and (interval[0] > 0 or interval[1] < 0)
