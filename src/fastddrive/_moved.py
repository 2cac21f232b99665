"""Old import paths of the modules that moved into `core` and `engine` (issue 33): they keep working for one
release, with a DeprecationWarning naming the new path. The moves are listed in docs/moves.md."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED: dict[str, tuple[str, ...]] = {
    "fastddrive.schema": ("fastddrive.core.schema",),
    "fastddrive.scaffold": ("fastddrive.core.scaffold",),
    "fastddrive.prompt": ("fastddrive.core.prompt",),
    "fastddrive.tokenizer": ("fastddrive.core.tokenizer",),
    "fastddrive.inputs": ("fastddrive.core.inputs",),
    "fastddrive.outputs": ("fastddrive.core.outputs",),
    "fastddrive.memory": ("fastddrive.core.memory",),
    "fastddrive.eval.jmt": ("fastddrive.core.jmt",),
    "fastddrive.eval.metrics": ("fastddrive.core.metrics",),
    "fastddrive.data.sample": ("fastddrive.core.sample", "fastddrive.data.dataset"),
    "fastddrive.model": ("fastddrive.engine.model",),
    "fastddrive.kv_cache": ("fastddrive.engine.kv_cache",),
    "fastddrive.masks": ("fastddrive.engine.masks",),
    "fastddrive.static_decode": ("fastddrive.engine.static_decode",),
    "fastddrive.layer_halves": ("fastddrive.engine.layer_halves",),
    "fastddrive.vision_tower": ("fastddrive.engine.vision_tower",),
    "fastddrive.model_files": ("fastddrive.engine.model_files",),
    "fastddrive.model_check": ("fastddrive.engine.model_check",),
    "fastddrive.random_init": ("fastddrive.engine.random_init",),
    "fastddrive.demo": ("fastddrive.eval.demo",),
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and fills its module with the public names of the new module(s)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED[module.__name__]
        warnings.warn(
            f"{module.__name__} moved to {' and '.join(new)}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        for target in new:
            names = vars(importlib.import_module(target))
            module.__dict__.update({k: v for k, v in names.items() if not k.startswith("__")})


def install() -> None:
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
