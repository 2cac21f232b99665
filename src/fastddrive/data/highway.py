"""Driving samples from highway-env with the simulator's own IDM/MOBIL driver as the expert (DESIGN 8).

An episode is seeded, simulated at 12 Hz and recorded at 4 Hz (the future's rate). The ego is
replaced by an `IDMVehicle` copy of itself, so the expert is the same driver model as the traffic.
A sample is taken every 1 s once 3 s of history exist and while 5 s of future remain before a crash,
the end of the road or the end of the episode.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastddrive.core.sample import FUTURE_STEPS, HISTORY_STEPS, CameraView, DrivingSample
from fastddrive.core.schema import DrivingResponse
from fastddrive.data import labels as rules
from fastddrive.data.expert import STEP_HZ, ExpertVehicle
from fastddrive.data.past_boxes import PAST_BOX_AGES_S, draw_past_boxes
from fastddrive.data.raters import RaterSet, rate
from fastddrive.data.reactive import (
    IDM_COMFORT_ACC_MPS2,
    IDM_TIME_WANTED_S,
    events_begun,
    stage_closing_gap,
    stage_cut_in,
    stage_late_stop,
    stage_lead_brake,
)

# isort: split
# After data.expert has made pygame draw offscreen.
import gymnasium as gym  # noqa: E402
import highway_env  # noqa: E402,F401  (registers the environments)
from highway_env.vehicle.behavior import IDMVehicle  # noqa: E402

SIMULATION_HZ = 12  # a multiple of STEP_HZ; highway-env itself runs 5..15 Hz
SAMPLE_EVERY_STEPS = STEP_HZ  # one sample per second
SAMPLE_RULE_VERSION = 2  # 2: no sample whose future holds a staged event still to come (sample_steps)
HISTORY_STRIDE = 2  # 0.5 s at 4 Hz
# The scenes (one per 0.25 s step) that `ego_history` and `render_frame` read back from now: the history's states
# and the one before its first (its first acceleration), or the oldest past box's.
SCENES_READ = max((HISTORY_STEPS - 1) * HISTORY_STRIDE + 2, round(max(PAST_BOX_AGES_S) * STEP_HZ) + 1)
FRAME_SIZE_PX = (448, 224)  # width, height: 16 x 8 Qwen2.5-VL units of 28 px
ROUTE_LOOKAHEAD_M = 300.0
COMMAND_TURN_RAD = np.deg2rad(30.0)
AGENT_RADIUS_M = 80.0


@dataclass(frozen=True)
class Scenario:
    """A highway-env environment, its settings, the expert's desired-speed range (m/s), and for a staged
    scenario the function that stages it once the expert has the seat (data/reactive.py)."""

    env_id: str
    config: dict[str, Any]
    max_duration_s: float
    expert_speed_mps: tuple[float, float] | None = None
    stage: Callable[[Any, ExpertVehicle, np.random.Generator], None] | None = None
    idm: dict[str, float] = field(default_factory=dict)  # IDM class settings for the episode's drivers


SCENARIOS: dict[str, Scenario] = {
    "highway": Scenario(
        "highway-fast-v0", {"lanes_count": 3, "vehicles_count": 25, "vehicles_density": 1.5}, 40.0, (22.0, 33.0)
    ),
    "merge": Scenario("merge-v0", {}, 40.0, (20.0, 30.0)),
    "exit": Scenario("exit-v0", {"vehicles_count": 15}, 40.0, (20.0, 30.0)),
    "roundabout": Scenario("roundabout-v0", {}, 40.0),
    "intersection": Scenario("intersection-v0", {"destination": None}, 25.0),
}
# The scenarios of the data and of `fastddrive drive` by default: the five above (their episode seeds, 5 j + s,
# predate the staged ones).
DEFAULT_SCENARIOS = tuple(SCENARIOS)
_EMPTY_ROAD = {"vehicles_count": 0, "vehicles_density": 0.0}
# Shorter headways, and no lane changes: the expert answers these events by braking.
_REACTIVE_IDM = {
    "TIME_WANTED": IDM_TIME_WANTED_S,
    "COMFORT_ACC_MAX": IDM_COMFORT_ACC_MPS2,
    "LANE_CHANGE_MIN_ACC_GAIN": 1e3,
}
REACTIVE_SCENARIOS: dict[str, Scenario] = {
    "lead-brake": Scenario(
        "highway-v0", {**_EMPTY_ROAD, "lanes_count": 1}, 12.0, None, stage_lead_brake, _REACTIVE_IDM
    ),
    "cut-in": Scenario("highway-v0", {**_EMPTY_ROAD, "lanes_count": 2}, 12.0, None, stage_cut_in, _REACTIVE_IDM),
    "closing-gap": Scenario("merge-v0", {}, 12.0, None, stage_closing_gap, _REACTIVE_IDM),
    "late-stop": Scenario("highway-v0", {**_EMPTY_ROAD, "lanes_count": 2}, 12.0, None, stage_late_stop, _REACTIVE_IDM),
}
SCENARIOS |= REACTIVE_SCENARIOS
SCENARIO_GROUPS = {"reactive": tuple(REACTIVE_SCENARIOS)}  # a name for several scenarios on the command line
ROUNDABOUT_EXITS = ("exr", "nxr", "wxr", "sxr")


class UnknownScenario(ValueError):
    pass


def check_scenarios(names: list[str]) -> list[str]:
    """The scenarios `names` stands for (a group name expands to its scenarios, in order)."""
    known = f"known: {', '.join([*SCENARIOS, *SCENARIO_GROUPS])}"
    unknown = [n for n in names if n not in SCENARIOS and n not in SCENARIO_GROUPS]
    if unknown:
        raise UnknownScenario(f"unknown scenario {unknown[0]!r}; {known}")
    if not names:
        raise UnknownScenario(f"no scenario given; {known}")
    return [s for n in names for s in SCENARIO_GROUPS.get(n, (n,))]


@dataclass
class VehicleState:
    position: np.ndarray
    heading: float
    speed: float
    velocity: np.ndarray
    crashed: bool
    size: tuple[float, float]


@dataclass
class Step:
    """The scene at one 4 Hz step (world frame of the simulator: x right, y down, metres)."""

    time_s: float
    ego: VehicleState
    lane_change: int  # +1 left, -1 right, 0: lane change completed on this step
    yielding: bool
    route_turn_rad: float  # signed turn of the planned route ahead, left positive
    lane_heading: float  # heading of the lane under the ego (world, rad): road geometry, not steering
    others: dict[int, VehicleState]
    events_begun: int = 0  # staged manoeuvres (data/reactive.py) begun by this step
    frame: np.ndarray | None = None
    raters: RaterSet | None = None  # alternative futures from this step (world frame), see data/raters.py


@dataclass
class EpisodeLog:
    scenario: str
    seed: int
    steps: list[Step] = field(default_factory=list)
    end_reason: str = "duration"
    pixels_per_metre: float = 5.5
    ego_pixel: tuple[float, float] = (0.0, 0.0)

    @property
    def usable_steps(self) -> int:
        """Steps before any crash; `sample_steps` keeps every sample's 5 s future inside them."""
        return len(self.steps) - 1 if self.end_reason == "crash" else len(self.steps)


# highway-env's intersection sets these on the IDMVehicle class itself, so they would leak into every
# later episode of the process (and a dataset would depend on which episodes shared a worker).
IDM_CLASS_DEFAULTS = {
    k: getattr(IDMVehicle, k)
    for k in ("DISTANCE_WANTED", "TIME_WANTED", "COMFORT_ACC_MAX", "COMFORT_ACC_MIN", "LANE_CHANGE_MIN_ACC_GAIN")
}


def make_env(scenario: str) -> gym.Env:
    """A fresh environment of `scenario` whose traffic starts from highway-env's default IDM settings."""
    spec = SCENARIOS[scenario]
    for name, value in {**IDM_CLASS_DEFAULTS, **spec.idm}.items():
        setattr(IDMVehicle, name, value)
    config = {
        **spec.config,
        "simulation_frequency": SIMULATION_HZ,
        "policy_frequency": STEP_HZ,
        "duration": 10 * spec.max_duration_s,
        "screen_width": FRAME_SIZE_PX[0],
        "screen_height": FRAME_SIZE_PX[1],
        "offscreen_rendering": True,
        "render_agent": True,
        # The gym observation is never read; the cheapest one saves a fifth of the run time.
        "observation": {"type": "Kinematics", "vehicles_count": 1, "normalize": False},
    }
    # The classic v0 scenes are kept on purpose (the v1 ones use another road model), so their
    # "out of date" notice is silenced; the passive checker only checks the unread observation.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is out of date.*")
        return gym.make(spec.env_id, render_mode="rgb_array", config=config, disable_env_checker=True)


def install_expert(env: gym.Env, scenario: Scenario, rng: np.random.Generator) -> ExpertVehicle:
    """Replace the ego by an IDM/MOBIL copy of itself; give it a route and a desired speed."""
    sim = env.unwrapped
    ego = sim.vehicle
    expert = ExpertVehicle.create_from(ego)
    sim.road.vehicles[sim.road.vehicles.index(ego)] = expert
    sim.controlled_vehicles[0] = expert
    net = sim.road.network
    if "exit" in net.graph.get("2", {}) and rng.random() < 0.5:
        lanes = len(net.graph["0"]["1"])
        # A route naming a lane makes MOBIL change lanes towards it (highway-env's own mechanism).
        expert.route = [("0", "1", lanes - 1), ("1", "2", lanes), ("2", "exit", 0)]
    elif "ser" in net.graph:
        expert.plan_route_to(str(rng.choice(ROUNDABOUT_EXITS)))
    if scenario.expert_speed_mps is not None:
        # A desired speed above the traffic's makes MOBIL overtake; below it, follow and get passed.
        expert.target_speed = float(rng.uniform(*scenario.expert_speed_mps))
    return expert


@contextmanager
def seeded_episode(scenario: str, seed: int) -> Iterator[tuple[gym.Env, Any, ExpertVehicle]]:
    """(env, its simulator, the expert in the ego seat) of episode `seed` of `scenario`, as every episode here
    starts, data and closed loop alike; the environment is closed on leaving."""
    env = make_env(scenario)
    try:
        env.reset(seed=seed)
        rng = np.random.default_rng(seed)
        expert = install_expert(env, SCENARIOS[scenario], rng)
        if SCENARIOS[scenario].stage is not None:
            SCENARIOS[scenario].stage(env.unwrapped, expert, rng)
        yield env, env.unwrapped, expert
    finally:
        env.close()


def frame_geometry(sim: Any) -> tuple[float, tuple[float, float]]:
    """Pixels per metre of the rendered frames and the ego's pixel in them."""
    centering = sim.config["centering_position"]
    return float(sim.config["scaling"]), (centering[0] * FRAME_SIZE_PX[0], centering[1] * FRAME_SIZE_PX[1])


def route_turn_rad(vehicle: IDMVehicle, lookahead_m: float = ROUTE_LOOKAHEAD_M) -> float:
    """Signed heading change of the road the vehicle will follow in the next `lookahead_m`, left positive."""
    net = vehicle.road.network
    lanes = [vehicle.lane_index] + [r for r in (vehicle.route or []) if r[:2] != vehicle.lane_index[:2]]
    start, _ = vehicle.lane.local_coordinates(vehicle.position)
    headings: list[float] = []
    remaining = lookahead_m
    for index in lanes:
        lane = net.get_lane(index if index[2] is not None else (*index[:2], 0))
        s = np.arange(max(start, 0.0), min(lane.length, max(start, 0.0) + remaining), 2.0)
        headings += [lane.heading_at(x) for x in s]
        remaining -= lane.length - max(start, 0.0)
        start = 0.0
        if remaining <= 0:
            break
    if len(headings) < 2:
        return 0.0
    unwrapped = np.unwrap(headings)
    return float(-(unwrapped[-1] - unwrapped[0]))  # world y points down: clockwise is a right turn


Scene = tuple[VehicleState, dict[int, VehicleState]]  # the ego and the other cars by id, at one step


def render_frame(
    env: gym.Env, scenes: Sequence[Scene], pixels_per_metre: float, ego_pixel: tuple[float, float]
) -> np.ndarray:
    """The frame the planner sees now: the renderer's, with the other cars' past boxes (data/past_boxes.py).

    scenes: one per 0.25 s step up to now (the last), at least the oldest past box's age of them.
    """
    past = [scenes[-1 - round(age * STEP_HZ)] for age in PAST_BOX_AGES_S]
    ego, others = scenes[-1]
    return draw_past_boxes(env.render(), ego, others, past, pixels_per_metre, ego_pixel)


def vehicle_state(vehicle: Any) -> VehicleState:
    """A highway-env vehicle's state, copied (world frame of the simulator)."""
    return VehicleState(
        position=np.array(vehicle.position, dtype=float),
        heading=float(vehicle.heading),
        speed=float(vehicle.speed),
        velocity=np.array(vehicle.velocity, dtype=float),
        crashed=bool(vehicle.crashed),
        size=(float(vehicle.LENGTH), float(vehicle.WIDTH)),
    )


def scene_of(sim: Any, driver: Any) -> Scene:
    """The ego (`driver`) and the other cars by id, copied."""
    return vehicle_state(driver), {id(v): vehicle_state(v) for v in sim.road.vehicles if v is not driver}


def _lane_change(expert: IDMVehicle, previous: tuple, current: tuple) -> int:
    """+1 if the step from lane `previous` to `current` is a change to the left, -1 to the right, else 0."""
    if previous[:2] != current[:2] or previous[2] == current[2]:
        return 0
    net = expert.road.network
    old, new = net.get_lane(previous), net.get_lane(current)
    s, _ = new.local_coordinates(expert.position)
    _, lateral = old.local_coordinates(new.position(s, 0.0))
    return 1 if lateral < 0 else -1  # lateral grows to the driver's right in highway-env


def record_step(sim: Any, driver: Any, previous_lane: tuple, turn_rad: float | None = None) -> Step:
    """The scene at this step, `driver` in the ego seat, `previous_lane` its lane at the step before (a lane
    change completed is read off it); `turn_rad` stands for the route's turn when given."""
    ego, others = scene_of(sim, driver)
    return Step(
        time_s=float(sim.time),
        ego=ego,
        lane_change=_lane_change(driver, previous_lane, driver.lane_index),
        yielding=bool(getattr(driver, "is_yielding", False)),
        route_turn_rad=route_turn_rad(driver) if turn_rad is None else turn_rad,
        lane_heading=float(driver.lane.heading_at(driver.lane.local_coordinates(driver.position)[0])),
        others=others,
        events_begun=events_begun(sim.road.vehicles),
    )


def end_of_road(expert: IDMVehicle, planned: bool) -> bool:
    """The lane ends with no road after it, or with the planned route used up.

    (The intersection's graph loops back into the junction: past its route the expert would wander.)
    """
    if not expert.lane.after_end(expert.position):
        return False
    remaining = [r for r in (expert.route or []) if r[:2] != expert.lane_index[:2]]
    return not expert.road.network.graph.get(expert.lane_index[1]) or (planned and not remaining)


def simulate_episode(
    scenario: str,
    seed: int,
    max_duration_s: float | None = None,
    setup: Callable[[gym.Env, ExpertVehicle], None] | None = None,
    raters: bool = False,
) -> EpisodeLog:
    """Run one seeded episode with the expert; record every 0.25 s and render every 1 s from 3 s on.

    `setup(env, expert)`, if given, runs once before the first step to stage a situation. With `raters`,
    every rendered step with 5 s of episode left also gets the simulated raters (data/raters.py), rolled
    out in copies of the simulator: the episode itself comes out exactly as without them.
    """
    spec = SCENARIOS[scenario]
    duration = spec.max_duration_s if max_duration_s is None else max_duration_s
    with seeded_episode(scenario, seed) as (env, sim, expert):
        planned = bool(expert.route)
        if setup is not None:
            setup(env, expert)
        idle = sim.action_type.actions_indexes["IDLE"]
        pixels_per_metre, ego_pixel = frame_geometry(sim)
        log = EpisodeLog(scenario, seed, pixels_per_metre=pixels_per_metre)
        log.ego_pixel = ego_pixel
        lane = expert.lane_index
        # Other cars are keyed by id(); holding every car until the episode ends stops a later car from
        # reusing a departed one's id, which would hang on how memory happened to be reused (rater copies).
        alive: dict[int, Any] = {}
        k = 0
        while True:
            alive.update((id(v), v) for v in sim.road.vehicles)
            step = record_step(sim, expert, lane)
            lane = expert.lane_index
            if k % SAMPLE_EVERY_STEPS == 0 and k >= (HISTORY_STEPS - 1) * HISTORY_STRIDE:
                scenes = [(s.ego, s.others) for s in log.steps[-round(PAST_BOX_AGES_S[-1] * STEP_HZ) :]]
                step.frame = render_frame(env, [*scenes, (step.ego, step.others)], pixels_per_metre, ego_pixel)
                if raters and sim.time + FUTURE_STEPS / STEP_HZ <= duration + 1e-9:
                    step.raters = rate(sim)
            log.steps.append(step)
            if expert.crashed:
                log.end_reason = "crash"
                break
            if end_of_road(expert, planned):
                log.end_reason = "end_of_road"
                break
            if sim.time >= duration - 1e-9:
                break
            sim.step(idle)
            k += 1
        return log


def _to_ego(points: np.ndarray, origin: np.ndarray, heading: float) -> np.ndarray:
    """World points (..., 2) to the ego frame at (origin, heading): +x forward, +y left."""
    c, s = np.cos(heading), np.sin(heading)
    d = points - origin
    return np.stack([c * d[..., 0] + s * d[..., 1], s * d[..., 0] - c * d[..., 1]], axis=-1)


def _rotate_to_ego(vectors: np.ndarray, heading: float) -> np.ndarray:
    return _to_ego(vectors, np.zeros(2), heading)


def _wrap(angle: np.ndarray | float) -> np.ndarray | float:
    return (np.asarray(angle) + np.pi) % (2 * np.pi) - np.pi


def command_of(route_turn: float) -> str:
    if route_turn > COMMAND_TURN_RAD:
        return "go_left"
    if route_turn < -COMMAND_TURN_RAD:
        return "go_right"
    return "go_straight"


def sample_steps(log: EpisodeLog) -> list[int]:
    """Step indices that make a sample: every 1 s, 3 s of history behind, 5 s of future ahead, and no staged
    event beginning in that future. The answer is the expert's logged future, and a staged event cannot be
    foreseen from the present (data/reactive.py): a future braking for an event still to come would teach a
    planner to brake for the scene's layout instead of for the event."""
    first = (HISTORY_STEPS - 1) * HISTORY_STRIDE
    last = log.usable_steps - 1 - FUTURE_STEPS
    steps = log.steps
    return [
        k
        for k in range(first, last + 1)
        if k % SAMPLE_EVERY_STEPS == 0
        and steps[k].frame is not None
        and steps[k + FUTURE_STEPS].events_begun == steps[k].events_begun
    ]


def ego_history(egos: list[VehicleState]) -> np.ndarray:
    """The planner's (7, 6) history at the last of `egos` (ego states every 0.25 s, at least 13 of them):
    x, y, vx, vy, ax, ay at t = -3.0..0.0 s every 0.5 s, in the ego frame of the last state."""
    k = len(egos) - 1
    origin, heading = egos[k].position, egos[k].heading
    dt = 1.0 / STEP_HZ
    past = range(k - (HISTORY_STEPS - 1) * HISTORY_STRIDE, k + 1, HISTORY_STRIDE)
    positions = _to_ego(np.array([egos[j].position for j in past]), origin, heading)
    velocities = _rotate_to_ego(np.array([egos[j].velocity for j in past]), heading)
    # Backward differences: the acceleration at t = 0 must not peek into the future.
    accel_world = np.array([(egos[j].velocity - egos[max(j - 1, 0)].velocity) / dt for j in past])
    return np.concatenate([positions, velocities, _rotate_to_ego(accel_world, heading)], axis=1)


def build_sample(log: EpisodeLog, k: int) -> DrivingSample:
    """The sample at step k of an episode: frame, history, command, expert future and target answer."""
    steps = log.steps
    now = steps[k].ego
    origin, heading = now.position, now.heading
    history = ego_history([step.ego for step in steps[: k + 1]])

    ahead = range(k + 1, k + FUTURE_STEPS + 1)
    future = _to_ego(np.array([steps[j].ego.position for j in ahead]), origin, heading)
    future_time = np.array([steps[j].time_s - steps[k].time_s for j in ahead])
    ego_speed = np.array([steps[j].ego.speed for j in range(k, k + FUTURE_STEPS + 1)])
    # Turns are read off the road (lane heading), so a lane change in progress is not a "curve".
    heading_change = float(-_wrap(steps[k + FUTURE_STEPS].lane_heading - steps[k].lane_heading))
    lane_change = next((steps[j].lane_change for j in ahead if steps[j].lane_change), 0)
    yielding = any(steps[j].yielding for j in range(k, k + STEP_HZ + 1))

    keys = [key for key, v in steps[k].others.items() if np.linalg.norm(v.position - origin) < AGENT_RADIUS_M]
    agents = np.full((len(keys), FUTURE_STEPS + 1, 3), np.nan)
    for a, key in enumerate(keys):
        for t, j in enumerate(range(k, k + FUTURE_STEPS + 1)):
            state = steps[j].others.get(key)
            if state is not None:
                agents[a, t, :2] = _to_ego(state.position, origin, heading)
                agents[a, t, 2] = -_wrap(state.heading - heading)
    agent_size = np.array([steps[k].others[key].size for key in keys]).reshape(len(keys), 2)
    command = command_of(steps[k].route_turn_rad)
    scene = rules.Scene(
        scenario=log.scenario,
        command=command,
        ego_speed=ego_speed,
        ego_future=future,
        heading_change_rad=heading_change,
        lane_change=lane_change,
        yielding=yielding,
        agents=agents,
        agent_speed=np.array([steps[k].others[key].speed for key in keys]),
        agent_crashed=np.array([steps[k].others[key].crashed for key in keys], dtype=bool),
    )
    found = rules.label(scene)
    rng = np.random.default_rng([log.seed, k])
    raters = steps[k].raters
    response = DrivingResponse(
        critical_objects=found.critical_objects,
        explanation=rules.explanation(found, log.scenario, rng),
        future_meta_behavior=found.meta,
        trajectory=future[STEP_HZ - 1 :: STEP_HZ],
    )
    return DrivingSample(
        sample_id=f"{log.scenario}-{log.seed}-{k // STEP_HZ:03d}s",
        scenario=log.scenario,
        episode_seed=log.seed,
        time_s=steps[k].time_s,
        image=steps[k].frame,
        history=history,
        command=command,
        future=future,
        future_time_s=future_time,
        response=response,
        view=CameraView(log.pixels_per_metre, log.ego_pixel, heading),
        ego_size=now.size,
        agents=agents,
        agent_size=agent_size,
        rater_trajectories=np.zeros((0, FUTURE_STEPS, 2))
        if raters is None
        else _to_ego(raters.positions, origin, heading),
        rater_scores=np.zeros(0) if raters is None else raters.scores,
    )


def episode_samples(
    scenario: str,
    seed: int,
    max_duration_s: float | None = None,
    setup: Callable[[gym.Env, ExpertVehicle], None] | None = None,
    raters: bool = False,
) -> list[DrivingSample]:
    """All samples of one seeded episode; with `raters`, each carries the simulated raters' futures and scores."""
    log = simulate_episode(scenario, seed, max_duration_s, setup, raters=raters)
    return [build_sample(log, k) for k in sample_steps(log)]
