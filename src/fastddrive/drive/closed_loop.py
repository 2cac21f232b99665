"""One closed-loop episode: the planner drives highway-env while it thinks.

The episode starts as the data generator's do (same environment, seed, expert, route and desired speed)
and the expert drives the first HANDOVER_S, so that the planner's first question comes with a full 3 s
history, as the data's first sample does. Then a TrackedVehicle takes the ego seat. Every `replan_s` of
simulated time at which the planner is free, it gets the frame, the history and the command; its answer
comes into force `latency` later on the simulation clock (at the first 1/12 s simulator step at or after
that), the plan in force being followed meanwhile. Until the first answer arrives the car holds its
hand-over velocity (a constant-velocity plan): a slow decoder pays for its first answer as for the others.

The episode ends on a collision, off the road (the whole car outside its lane and the nearest lane, sideways),
at the route's end (a planned route's), or at the scenario's duration; route completion counts progress up to
the goal, how far the expert gets in the episode's time (route.py).
The state is recorded every 0.25 s.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from highway_env.vehicle.controller import ControlledVehicle
from highway_env.vehicle.kinematics import Vehicle

from fastddrive.core.metrics import constant_velocity_m
from fastddrive.core.sample import HISTORY_STEPS
from fastddrive.core.schema import NUM_WAYPOINTS, WAYPOINT_INTERVAL_S
from fastddrive.data.expert import STEP_HZ, ExpertVehicle
from fastddrive.data.highway import (
    HISTORY_STRIDE,
    SCENARIOS,
    SCENES_READ,
    SIMULATION_HZ,
    command_of,
    ego_history,
    frame_geometry,
    render_frame,
    route_turn_rad,
    scene_of,
    seeded_episode,
)
from fastddrive.data.raters import simulator_copy
from fastddrive.drive.controller import TrackingController
from fastddrive.drive.metrics import lead_ttc_s
from fastddrive.drive.plan import TimedPath, to_ego
from fastddrive.drive.policies import EXPERT_DRIVES, Observation, Policy, Proposal
from fastddrive.drive.route import Route

HANDOVER_S = (HISTORY_STEPS - 1) * HISTORY_STRIDE / STEP_HZ  # 3 s: the planner's history is full
RECORD_S = 1.0 / STEP_HZ
END_REASONS = ("goal", "collision", "offroad", "timeout")
_EPS = 1e-9


class TrackedVehicle(ControlledVehicle):
    """The ego under closed-loop control: highway-env's bicycle model, steered and accelerated by a
    TrackingController along the plan in force, never by highway-env's own controllers.

    It is a ControlledVehicle with the expert's route, dropping roads as it leaves them as the expert does,
    so that the traffic's right-of-way rules predict it along its route as they did the expert (and the
    navigation command and the expert's rollouts read that route)."""

    color = ExpertVehicle.color  # drawn in the ego colour, as the data's expert

    def __init__(self, road: Any, driver: ControlledVehicle, controller: TrackingController, clock_s: float) -> None:
        route = list(driver.route or [])
        super().__init__(road, driver.position.copy(), driver.heading, driver.speed, target_speed=1.0, route=route)
        self.target_speed = driver.target_speed  # not read here, but the right-of-way rules change it
        self.crashed = driver.crashed
        self.controller = controller
        self.clock_s = clock_s
        self.plans: list[tuple[float, TimedPath]] = []  # (time it comes into force, path), in that order
        self.in_force_s: list[float | None] = []  # the simulator time each plan actually took over

    def schedule(self, active_s: float, path: TimedPath) -> None:
        self.plans.append((active_s, path))
        self.in_force_s.append(None)

    def plan_index(self, time_s: float) -> int | None:
        """The plan in force at `time_s`: the last one scheduled to be in force by then."""
        due = [i for i, (active_s, _) in enumerate(self.plans) if active_s <= time_s + _EPS]
        return due[-1] if due else None

    def act(self, action: Any = None) -> None:
        # The environment's own action (IDLE) is ignored: the controller drives.
        k = self.plan_index(self.clock_s)
        if k is None:
            self.action = {"steering": 0.0, "acceleration": 0.0}
            return
        if self.in_force_s[k] is None:
            self.in_force_s[k] = self.clock_s
        steering, accel = self.controller.control(
            self.position, self.heading, self.speed, self.plans[k][1], self.clock_s, 1.0 / SIMULATION_HZ
        )
        self.action = {"steering": steering, "acceleration": accel}

    def step(self, dt: float) -> None:
        super().step(dt)
        self.clock_s += dt

    def on_state_update(self) -> None:
        super().on_state_update()
        self.keep_to_route_branch()
        self.target_lane_index = self.lane_index
        edges = [r[:2] for r in self.route or []]
        if self.lane_index[:2] in edges:
            self.route = self.route[edges.index(self.lane_index[:2]) :]

    def keep_to_route_branch(self) -> None:
        """At a fork the nearest lane may be the branch the route does not take (a roundabout's exit starts
        beside the ring): the car is on its route's branch while its centre is within a lane's width of that
        branch's middle, as highway-env's own cars head for the branch their route names before they reach
        it. Else the route, cut only on the roads the car is on, would go stale at the fork, and the
        navigation command and the expert's rollouts read it."""
        roads = [r[:2] for r in (self.route or [])[:2]]  # the road the car is on, or the next, and the one after
        if self.lane_index[:2] in roads:
            return
        fork = next((road for road in roads if road[0] == self.lane_index[0]), None)
        if fork is None:
            return
        lanes = self.road.network.graph[fork[0]][fork[1]]
        index = (*fork, min(self.lane_index[2], len(lanes) - 1))
        branch = lanes[index[2]]
        if branch.on_lane(self.position, margin=branch.width_at(0.0) / 2):
            self.lane_index, self.lane = index, branch


def take_over(sim: Any, driver: ControlledVehicle, controller: TrackingController) -> TrackedVehicle:
    """Put a TrackedVehicle in `driver`'s seat, in its state."""
    car = TrackedVehicle(sim.road, driver, controller, float(sim.time))
    sim.road.vehicles[sim.road.vehicles.index(driver)] = car
    sim.controlled_vehicles[0] = car
    return car


@dataclass
class PlanEvent:
    """One answer: asked at `asked_s`, due at `due_s` (asked + charged latency), in force from `active_s`
    (None if the episode ended first or the answer was unusable)."""

    asked_s: float
    due_s: float
    active_s: float | None
    charged_ms: float
    measured_ms: float
    wall_s: float  # this machine's wall time for the whole call (prompt building included)
    valid: bool


@dataclass
class EpisodeTrace:
    """What one episode did, recorded every 0.25 s from the hand-over (world frame: x right, y down)."""

    scenario: str
    seed: int
    label: str
    goal_m: float
    time_s: list[float] = field(default_factory=list)
    position_m: list[np.ndarray] = field(default_factory=list)
    heading_rad: list[float] = field(default_factory=list)
    speed_mps: list[float] = field(default_factory=list)
    ttc_s: list[float] = field(default_factory=list)
    progress_m: list[float] = field(default_factory=list)
    end_reason: str = ""  # one of END_REASONS once the episode is over
    plans: list[PlanEvent] = field(default_factory=list)
    # With video: the frame at each record and the world points of the plan in force and of the one due next.
    frames: list[np.ndarray] = field(default_factory=list)
    overlays: list[tuple[np.ndarray | None, np.ndarray | None]] = field(default_factory=list)
    pixels_per_metre: float = 0.0
    ego_pixel: tuple[float, float] = (0.0, 0.0)


def _outside(car: Vehicle, lane: Any) -> bool:
    along, across = lane.local_coordinates(car.position)
    return bool(abs(across) > (lane.width_at(along) + car.WIDTH) / 2)


def _off_road(car: Vehicle) -> bool:
    """The whole car is outside its lane and the nearest lane, sideways: its centre more than half a lane and
    half a car from each one's middle (past a road's end the world just stops). Both are read because at a
    fork the car takes its route's branch while it still drives on the lane beside it
    (`TrackedVehicle.keep_to_route_branch`). A car whose wheels cross a lane's edge as it takes a curved exit
    is still on the road."""
    if not _outside(car, car.lane):
        return False
    nearest = car.road.network.get_closest_lane_index(car.position, car.heading)
    return _outside(car, car.road.network.get_lane(nearest))


def _ttc_s(sim: Any, car: Vehicle) -> float:
    others = [v for v in sim.road.vehicles if v is not car]
    if not others:
        return math.inf
    heading = car.heading
    positions = to_ego(np.array([v.position for v in others]), car.position, heading)
    velocities = to_ego(np.array([v.velocity for v in others]), np.zeros(2), heading)
    sizes = np.array([(v.LENGTH, v.WIDTH) for v in others])
    return lead_ttc_s(positions, velocities[:, 0], sizes, car.speed, (car.LENGTH, car.WIDTH), velocities[:, 1])


def _plans_shown(car: Vehicle, now: float) -> tuple[np.ndarray | None, np.ndarray | None]:
    """World points of the plan in force and of the next one due (None where there is none)."""
    if not isinstance(car, TrackedVehicle):
        return None, None
    k = car.plan_index(now)
    due = [path for active_s, path in car.plans if active_s > now + _EPS]
    return None if k is None else car.plans[k][1].points_m, due[0].points_m if due else None


def _end_reason(car: Vehicle, at_end: bool, out_of_time: bool) -> str:
    """Why the episode ends here ('' while it goes on); a crash counts before the rest, and the route's end
    before leaving the road (past it, a junction's next road may turn away under the car)."""
    if car.crashed:
        return "collision"
    if at_end:
        return "goal"
    return "offroad" if _off_road(car) else "timeout" if out_of_time else ""


def expert_goal_m(sim: Any, route: Route, duration_s: float) -> float:
    """How far along `route` the expert in the seat gets by `duration_s`, or until its episode would end (a
    crash, leaving the road, the route's end), driving from here in a copy of the simulator: the episode's
    goal (route.py)."""
    world = simulator_copy(sim)
    idle = world.action_type.actions_indexes["IDLE"]
    progress = route.progress_m(world.vehicle.position, 0.0)
    while world.time < duration_s - _EPS and progress < route.end_m:
        world.step(idle)
        if world.vehicle.crashed or _off_road(world.vehicle):
            break
        progress = route.progress_m(world.vehicle.position, progress)
    return progress


def _next_ask_s(asked_s: float, due_s: float, replan_s: float) -> float:
    """The first replanning tick after `asked_s` at which the planner is free again."""
    ticks = max(1, math.ceil((due_s - asked_s) / replan_s - 1e-6))
    return asked_s + ticks * replan_s


def drive_episode(
    scenario: str,
    seed: int,
    policy: Policy | None,
    latency_ms: Callable[[Proposal], float],
    replan_s: float = 0.5,
    duration_s: float | None = None,
    video: bool = False,
    controller: TrackingController | None = None,
) -> EpisodeTrace:
    """Drive one seeded episode of `scenario` with `policy` (None: the expert keeps the seat); each answer
    costs `latency_ms(proposal)` of simulated time."""
    spec = SCENARIOS[scenario]
    duration = spec.max_duration_s if duration_s is None else duration_s
    with seeded_episode(scenario, seed) as (env, sim, expert):
        idle = sim.action_type.actions_indexes["IDLE"]
        # The scene every 0.25 s, as far back as the history (and its first acceleration) and the frame's past
        # boxes read. Cars are keyed by id(); holding every car to the end stops a later one from reusing a
        # departed one's id (see data/highway.py).
        scenes = deque([scene_of(sim, expert)], maxlen=SCENES_READ)
        alive = {id(v): v for v in sim.road.vehicles}
        while sim.time < HANDOVER_S - _EPS:
            sim.step(idle)
            alive.update((id(v), v) for v in sim.road.vehicles)
            scenes.append(scene_of(sim, expert))
        route = Route.ahead_of(expert, duration - sim.time)
        route = route.with_goal(expert_goal_m(sim, route, duration))
        label = EXPERT_DRIVES if policy is None else policy.label
        pixels_per_metre, ego_pixel = frame_geometry(sim)
        trace = EpisodeTrace(scenario, seed, label, route.goal_m, pixels_per_metre=pixels_per_metre)
        trace.ego_pixel = ego_pixel
        car = expert if policy is None else take_over(sim, expert, controller or TrackingController())
        if policy is not None:
            policy.start(expert)
            history = ego_history([ego for ego, _ in scenes])
            hold = constant_velocity_m(history, NUM_WAYPOINTS, WAYPOINT_INTERVAL_S)
            car.schedule(
                sim.time, TimedPath.from_waypoints(hold, history[-1, 2:4], car.position, car.heading, sim.time)
            )
        ask_s, progress = float(sim.time), 0.0
        while True:
            now = float(sim.time)
            progress = route.progress_m(car.position, progress)
            trace.time_s.append(now)
            trace.position_m.append(car.position.copy())
            trace.heading_rad.append(float(car.heading))
            trace.speed_mps.append(float(car.speed))
            trace.ttc_s.append(_ttc_s(sim, car))
            trace.progress_m.append(progress)
            if video:
                trace.frames.append(env.render())
                trace.overlays.append(_plans_shown(car, now))
            # Only the route's end ends the episode early: a car past the expert's mark still has to drive on
            # (the expert's mark may lie just short of a stopped car).
            trace.end_reason = _end_reason(car, progress >= route.end_m, now >= duration - _EPS)
            if trace.end_reason:
                break
            if policy is not None and now >= ask_s - _EPS:
                observation = Observation(
                    time_s=now,
                    frame=render_frame(env, scenes, pixels_per_metre, ego_pixel),
                    history=ego_history([ego for ego, _ in scenes]),
                    command=command_of(route_turn_rad(car)),
                    position_m=car.position.copy(),
                    heading_rad=float(car.heading),
                    sim=sim,
                )
                began = time.perf_counter()
                proposal = policy.propose(observation)
                wall_s = time.perf_counter() - began
                charged = float(latency_ms(proposal))
                due_s = now + charged / 1000.0
                valid = proposal.waypoints_m is not None
                if valid:
                    state = (observation.history[-1, 2:4], observation.position_m, observation.heading_rad)
                    car.schedule(due_s, TimedPath.from_waypoints(proposal.waypoints_m, *state, now))
                trace.plans.append(PlanEvent(now, due_s, None, charged, proposal.measured_ms, wall_s, valid))
                ask_s = _next_ask_s(now, due_s, replan_s)
            sim.step(idle)
            alive.update((id(v), v) for v in sim.road.vehicles)
            scenes.append(scene_of(sim, car))
        if isinstance(car, TrackedVehicle):
            in_force = iter(car.in_force_s[1:])  # the first is the hand-over plan
            for event in (e for e in trace.plans if e.valid):
                event.active_s = next(in_force)
        return trace
