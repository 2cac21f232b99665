"""The route an episode is scored on: the road the ego is meant to take from the hand-over, and its goal.

The route follows the ego's planned route where the scenario gives one (exit, roundabout, intersection) and
ends where it ends; without one (highway, merge, half of the exits) it follows the road ahead, taking at
every junction the continuation that turns least. The goal is what can be driven in the episode: how far
along the route the expert gets in the same time, driving from the same hand-over in a copy of the simulator
(`expert_goal_m`; the route's end if it gets there), so that the expert keeping the seat completes the route
and no scenario's route is longer than its time allows (issue 37; the CARLA leaderboard's routes are likewise
made to be finished).
Progress is the arc length of the route point nearest the ego. It never goes back, and it is searched only
a little around the last progress, so that a road passing near itself (a roundabout) cannot make it jump.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

REACH_SPEED_MPS = 40.0  # the route is built this far ahead per second of driving: farther than any car gets
SPACING_M = 1.0
SEARCH_BACK_M, SEARCH_AHEAD_M = 10.0, 60.0


def _lane_points(lane: Any, start_m: float) -> np.ndarray:
    s = np.append(np.arange(start_m, lane.length, SPACING_M), lane.length)
    return np.array([lane.position(x, 0.0) for x in s])


def _least_turn(net: Any, index: tuple) -> tuple | None:
    """The lane after `index` whose road turns least at the junction (same lane number where it exists)."""
    heading = net.get_lane(index).heading_at(net.get_lane(index).length)
    options = []
    for to, lanes in net.graph.get(index[1], {}).items():
        lane_id = min(index[2], len(lanes) - 1)
        turn = abs(np.angle(np.exp(1j * (lanes[lane_id].heading_at(0.0) - heading))))
        options.append((turn, (index[1], to, lane_id)))
    return min(options)[1] if options else None


@dataclass(frozen=True)
class Route:
    points_m: np.ndarray  # (N, 2) world frame, about SPACING_M apart
    arc_m: np.ndarray  # (N,) arc length from the ego's position at the hand-over
    goal_m: float

    @classmethod
    def ahead_of(cls, vehicle: Any, driving_s: float) -> Route:
        """The route of `vehicle` (a highway-env vehicle with a `route`) for `driving_s` of driving."""
        net = vehicle.road.network
        reach_m = REACH_SPEED_MPS * driving_s
        planned = list(vehicle.route or [])
        edges = [r[:2] for r in planned]
        if vehicle.lane_index[:2] in edges:  # else the route's first road is the next one already
            planned = planned[edges.index(vehicle.lane_index[:2]) + 1 :]
        index, start = vehicle.lane_index, vehicle.lane.local_coordinates(vehicle.position)[0]
        pieces = [vehicle.position[None, :]]
        length = 0.0
        while True:
            piece = _lane_points(net.get_lane(index), max(start, 0.0))
            pieces.append(piece)
            length += np.linalg.norm(np.diff(piece, axis=0), axis=1).sum()
            start = 0.0
            if length >= reach_m:
                break
            if planned:
                step = planned.pop(0)
                lanes = net.graph[step[0]][step[1]]
                index = (step[0], step[1], step[2] if step[2] is not None else min(index[2], len(lanes) - 1))
            elif vehicle.route:
                break  # the planned route is used up: its end is the goal
            elif (index := _least_turn(net, index)) is None:
                break
        points = np.concatenate(pieces)
        arc = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(points, axis=0), axis=1))])
        return cls(points, arc, float(arc[-1]))

    @property
    def end_m(self) -> float:
        return float(self.arc_m[-1])

    def with_goal(self, goal_m: float) -> Route:
        return replace(self, goal_m=float(min(goal_m, self.arc_m[-1])))

    def progress_m(self, position_m: np.ndarray, previous_m: float) -> float:
        """Arc length reached at `position_m`, given the progress so far."""
        near = (self.arc_m >= previous_m - SEARCH_BACK_M) & (self.arc_m <= previous_m + SEARCH_AHEAD_M)
        window = np.flatnonzero(near)
        nearest = window[np.argmin(np.linalg.norm(self.points_m[window] - position_m, axis=1))]
        return max(previous_m, float(self.arc_m[nearest]))
