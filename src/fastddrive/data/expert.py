"""The simulator's expert driver and recording rate, shared by the episode recorder and the raters.

highway-env's IDM/MOBIL driver takes the ego seat (DESIGN 8); the raters (data/raters.py) drive
variations of it. Importing this module also makes pygame draw offscreen before highway-env loads.
"""

from __future__ import annotations

import os

# pygame must draw offscreen; its no-op video driver silently renders all-black frames.
os.environ["SDL_VIDEODRIVER"] = "offscreen"
os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
# SDL turns SIGINT and SIGTERM into quit events nobody reads: Ctrl-C and `kill` would not stop a job.
os.environ["SDL_NO_SIGNAL_HANDLERS"] = "1"

from highway_env.vehicle.behavior import IDMVehicle  # noqa: E402
from highway_env.vehicle.graphics import VehicleGraphics  # noqa: E402

STEP_HZ = 4  # recording rate = future rate


class ExpertVehicle(IDMVehicle):
    """The IDM/MOBIL expert in the ego seat; always drawn in the ego colour.

    `color` is a property because highway-env's road regulation sets and deletes it on yielding cars.
    """

    color = property(lambda self: VehicleGraphics.EGO_COLOR, lambda self, value: None, lambda self: None)
