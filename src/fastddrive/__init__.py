"""fastddrive: fast block-diffusion vision-language driving planners (Fast-dDrive).

import fastddrive
planner = fastddrive.load("default")
result = planner.plan(images=[frame], history=history, command="go_straight", decoder="ss")
"""

from typing import Any

from fastddrive import _moved

__version__ = "0.1.0"
_PLANNER_NAMES = ("load", "Planner", "PlanInputs")
_moved.install()


def __getattr__(name: str) -> Any:
    # Lazy, so that `import fastddrive` (and the CLI's start) does not pay for torch and transformers.
    if name in _PLANNER_NAMES:
        from fastddrive import planner

        return getattr(planner, name)
    raise AttributeError(f"module 'fastddrive' has no attribute {name!r}")
