"""The server's own per-model resources, fixed when it starts (issue 32: a request names no path, no file and
no other server-side resource).

`pvf` reads a planning vocabulary; a request may not name one (its `vocabulary` option is refused), and the
server hands the decoder the one it was started with: `fastddrive serve --pvf-vocabulary PATH`, by default
the model folder's own `pvf_vocabulary.json` where it has one. The file is read and checked at start, and
checked against the model's tokenizer when the model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastddrive.decode.planning_vocabulary import read_vocabulary, vocabulary_path
from fastddrive.decode.pvf import planning_ids
from fastddrive.planner import Planner


def planning_vocabulary(model_folder: Path, given: Path | None) -> Path | None:
    """The planning vocabulary file the server uses: `given`, else the model folder's own, else None (then
    `pvf` runs only without planning). PlanningVocabularyError names a file that is missing or malformed."""
    path = given if given is not None else vocabulary_path(model_folder)
    if given is None and not path.is_file():
        return None
    if path.is_dir():
        path = vocabulary_path(path)
    read_vocabulary(path)
    return path.resolve()


def load_with_vocabulary(load: Callable[[], Planner], vocabulary: Path) -> Planner:
    """`load()`, then the vocabulary checked against the model's tokenizer (PlanningVocabularyError: the service
    says why on /readyz). A module-level function, so that a partial of it can load in a model process."""
    planner = load()
    planning_ids(planner.model, vocabulary)
    return planner
