"""The planning-token vocabulary of Plan-Verify-Fill (paper 001 section 3, Appendix A.2): its file and reader.

A small JSON file kept beside the model's weights (`VOCABULARY_FILE`), written by the offline calibration
(`fastddrive.eval.pvf_calibration`) and read by the `pvf` decoder, which uses it only as an eligibility
filter for planning candidates. Each entry keeps the token's id, its text and the statistics it was chosen
by; the settings of the calibration run are kept beside them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastddrive.core.outputs import finite_json, write_text

VOCABULARY_FILE = "pvf_vocabulary.json"
VOCABULARY_FORMAT = "fastddrive-pvf-vocabulary"


class PlanningVocabularyError(ValueError):
    """A planning vocabulary file that is missing or malformed (the message names the file and the problem)."""


@dataclass(frozen=True)
class PlanningToken:
    """One token's calibration statistics (Appendix A.2): `events` n_v, `verifiable` m_v (events with a
    non-empty impact set), `verified_rate` r_v^ver and `gain` the mean verified information gain."""

    id: int
    text: str
    events: int
    verifiable: int
    verified_rate: float
    gain: float


@dataclass(frozen=True)
class PlanningVocabulary:
    """The planning tokens, and how the calibration that chose them was run (`settings`, `counts`)."""

    tokens: tuple[PlanningToken, ...]
    settings: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(t.id for t in self.tokens)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": VOCABULARY_FORMAT,
            "tokens": [asdict(t) for t in self.tokens],
            "settings": self.settings,
            "counts": self.counts,
        }


def vocabulary_path(folder: str | Path) -> Path:
    """Where a model folder keeps its planning vocabulary."""
    return Path(folder) / VOCABULARY_FILE


def write_vocabulary(vocabulary: PlanningVocabulary, path: str | Path) -> Path:
    """Write `vocabulary` as JSON to `path` (a file, or a folder to put `VOCABULARY_FILE` in), atomically: a
    model's vocabulary is whole or as it was."""
    path = Path(path)
    if path.is_dir():
        path = vocabulary_path(path)
    write_text(path, finite_json(vocabulary.to_json(), indent=2, ensure_ascii=False) + "\n")
    return path


def read_vocabulary(path: str | Path) -> PlanningVocabulary:
    """Read a vocabulary file (or a folder holding `VOCABULARY_FILE`); PlanningVocabularyError names the file
    and what is wrong with it."""
    path = Path(path)
    if path.is_dir():
        path = vocabulary_path(path)
    if not path.is_file():
        raise PlanningVocabularyError(
            f"no planning vocabulary at {path}; write one with `fastddrive pvf calibrate`, "
            "or decode with planning=false"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlanningVocabularyError(f"planning vocabulary {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict) or data.get("format") != VOCABULARY_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise PlanningVocabularyError(
            f"{path} is not a planning vocabulary: expected format {VOCABULARY_FORMAT!r}, found {found!r}"
        )
    entries = data.get("tokens")
    if not isinstance(entries, list):
        raise PlanningVocabularyError(f"planning vocabulary {path}: 'tokens' must be a list")
    tokens = []
    for k, entry in enumerate(entries):
        try:
            token = PlanningToken(**entry)
        except TypeError as err:
            raise PlanningVocabularyError(f"planning vocabulary {path}: token entry {k} is malformed ({err})") from None
        if not isinstance(token.id, int) or isinstance(token.id, bool) or token.id < 0:
            raise PlanningVocabularyError(f"planning vocabulary {path}: token entry {k} has no valid id ({token.id!r})")
        tokens.append(token)
    settings, counts = data.get("settings", {}), data.get("counts", {})
    if not isinstance(settings, dict) or not isinstance(counts, dict):
        raise PlanningVocabularyError(f"planning vocabulary {path}: 'settings' and 'counts' must be objects")
    return PlanningVocabulary(tuple(tokens), settings, counts)
