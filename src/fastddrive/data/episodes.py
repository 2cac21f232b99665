"""Which episodes a simulator data set holds (DESIGN section 8): episode i of seed s is scenario i mod S,
seeded s * 100000 + i, in the split SPLIT_CYCLE gives it, written as one shard; and what a manifest's settings
may be. The build (build.py) simulates this plan; the reader (dataset.py) checks a data set against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Over every 10 rounds of scenarios: 8 to train, 1 to val, 1 to test; test comes early so that
# small datasets have one.
SPLIT_CYCLE = ("train", "test", "train", "val", "train", "train", "train", "train", "train", "train")
SEED_STRIDE = 100_000
MAX_EPISODES = SEED_STRIDE  # episode i of seed s is seeded s * SEED_STRIDE + i: more would reuse the next seed's
MAX_SEED = (2**63 - 1) // SEED_STRIDE - 1  # every episode seed fits the int64 `episode_seed` column
RATER_SPLITS = ("val", "test")  # the splits that are scored with the rater feedback score
SOURCE = "highway-env"


class DatasetError(ValueError):
    """A path that is not a fastddrive dataset, or a dataset that cannot be read (the base of the data errors)."""


class DataSettingsError(DatasetError):
    """A setting of a data command outside its range; the message (one line) names it and the range."""


@dataclass(frozen=True)
class EpisodeJob:
    index: int
    scenario: str
    seed: int
    split: str
    shard: str  # path relative to the dataset root
    raters: bool = False  # roll out and score the simulated raters for every sample


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_episode_settings(episodes: int, seed: int) -> None:
    """DataSettingsError (one line) for a number of episodes or a seed outside its range."""
    if not _whole(episodes) or not 1 <= episodes <= MAX_EPISODES:
        raise DataSettingsError(
            f"--episodes {episodes} is out of range: give 1 to {MAX_EPISODES} (episodes of one seed are seeded "
            f"seed * {SEED_STRIDE} + i)"
        )
    if not _whole(seed) or not 0 <= seed <= MAX_SEED:
        raise DataSettingsError(
            f"--seed {seed} is out of range: give 0 to {MAX_SEED} (episode i is seeded seed * {SEED_STRIDE} + i, "
            "a non-negative 64-bit integer)"
        )


def settings_problem(settings: dict[str, Any]) -> str | None:
    """What makes a manifest's settings unusable, naming the key (the simulator's settings plan its shards);
    None when they are sound."""
    source = settings.get("source")
    if source is not None and not isinstance(source, str):
        return "'settings.source' is not a string"
    if source != SOURCE:
        return None
    episodes, seed, scenarios = settings.get("episodes"), settings.get("seed"), settings.get("scenarios")
    if not _whole(episodes) or not 1 <= episodes <= MAX_EPISODES:
        return f"'settings.episodes' is {episodes!r:.40}, not 1 to {MAX_EPISODES}"
    if not _whole(seed) or not 0 <= seed <= MAX_SEED:
        return f"'settings.seed' is {seed!r:.40}, not 0 to {MAX_SEED}"
    if not isinstance(scenarios, list) or not scenarios or not all(isinstance(s, str) and s for s in scenarios):
        return "'settings.scenarios' is not a list of scenario names"
    return None


def simulated_scenarios(settings: dict[str, Any]) -> set[str]:
    """The scenario names of the simulated episodes that a manifest's settings make: its own `scenarios` (the
    generator's, DAgger's), and its sources' for a merge."""
    own, sources = settings.get("scenarios"), settings.get("sources")
    names = {name for name in own if isinstance(name, str)} if isinstance(own, list) else set()
    for source in sources if isinstance(sources, list) else ():
        if isinstance(source, dict) and isinstance(source.get("settings"), dict):
            names |= simulated_scenarios(source["settings"])
    return names


def plan_episodes(
    episodes: int, seed: int, scenarios: list[str], rater_splits: tuple[str, ...] = RATER_SPLITS
) -> list[EpisodeJob]:
    """Episode i uses scenario i mod S and seed `seed * 100000 + i`; its split follows SPLIT_CYCLE.

    Episodes in `rater_splits` (val and test by default) get the simulated raters; training ones do not.
    """
    check_episode_settings(episodes, seed)
    jobs = []
    for i in range(episodes):
        scenario = scenarios[i % len(scenarios)]
        split = SPLIT_CYCLE[(i // len(scenarios)) % len(SPLIT_CYCLE)]
        episode_seed = seed * SEED_STRIDE + i
        shard = f"{split}/{i:05d}-{scenario}-{episode_seed}.parquet"
        jobs.append(EpisodeJob(i, scenario, episode_seed, split, shard, raters=split in rater_splits))
    return jobs


def planned_shards(settings: dict[str, object]) -> list[str] | None:
    """The shards (relative paths) that a simulator dataset's manifest settings plan; None for another source."""
    if settings.get("source") != SOURCE or settings_problem(settings) is not None:
        return None
    jobs = plan_episodes(int(settings["episodes"]), int(settings["seed"]), list(settings["scenarios"]))
    return [job.shard for job in jobs]
