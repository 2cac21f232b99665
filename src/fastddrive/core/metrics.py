"""Driving metrics: pure functions on arrays (metres, seconds). DESIGN section 7."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np

from fastddrive.core.jmt import jmt_upsample
from fastddrive.core.sample import FUTURE_INTERVAL_S, FUTURE_STEPS
from fastddrive.core.schema import (
    CRITICAL_OBJECT_CLASSES,
    LATERAL_BEHAVIORS,
    LONGITUDINAL_BEHAVIORS,
    DrivingResponse,
)

STEPS_3S = int(round(3.0 / FUTURE_INTERVAL_S))  # the first 12 of 20 points at 4 Hz

# WOD-E2E rater feedback score (DESIGN 7), on the 20-point 4 Hz future.
RFS_NUM_POINTS = 20
RFS_MAX_RATERS = 3
RFS_TIMES_S = (3.0, 5.0)
RFS_INDICES = tuple(int(round(t / FUTURE_INTERVAL_S)) - 1 for t in RFS_TIMES_S)  # (11, 19)
RFS_LAT_THRESHOLDS_M = np.array([1.0, 1.8])
RFS_LNG_THRESHOLDS_M = np.array([4.0, 7.2])
RFS_LOW_SPEED_MPS = 1.4
RFS_HIGH_SPEED_MPS = 11.0
RFS_DECAY = 0.1
RFS_FLOOR = 4.0
RFS_MAX_SCORE = 10.0

# nuScenes open-loop planning: 6 waypoints at 2 Hz, reported at 1, 2 and 3 s.
NUSCENES_INTERVAL_S = 0.5
NUSCENES_HORIZONS_S = (1.0, 2.0, 3.0)
NUSCENES_STEPS = int(round(NUSCENES_HORIZONS_S[-1] / NUSCENES_INTERVAL_S))
NUSCENES_EGO_LENGTH_M = 4.084
NUSCENES_EGO_WIDTH_M = 1.85
# Raster collision of ST-P3 / VAD / UniAD: 200 x 200 cells of 0.5 m over +-50 m around the ego.
BEV_CELLS = 200
BEV_CELL_M = 0.5
BEV_START_M = -50.0 + BEV_CELL_M / 2  # centre of the first cell (their `bx`)
EGO_BOX_SHIFT_M = 0.5  # their ego box is centred this far ahead of the waypoint


def ade_m(predicted_m: np.ndarray, truth_m: np.ndarray, steps: int | None = None) -> float:
    """Average displacement error in metres over the first `steps` points (all by default)."""
    err = np.linalg.norm(np.asarray(predicted_m)[:steps] - np.asarray(truth_m)[:steps], axis=-1)
    return float(err.mean())


def fde_m(predicted_m: np.ndarray, truth_m: np.ndarray) -> float:
    """Final displacement error in metres: the L2 distance between the last points of two (T, 2) paths."""
    return float(np.linalg.norm(np.asarray(predicted_m, dtype=float)[-1] - np.asarray(truth_m, dtype=float)[-1]))


def waypoint_ade_m(waypoints_m: np.ndarray, future_m: np.ndarray) -> tuple[float, float]:
    """ADE@3s and ADE@5s of 5 waypoints at 1 s, JMT-upsampled to the 20-point 4 Hz future."""
    dense = jmt_upsample(waypoints_m)
    return ade_m(dense, future_m, STEPS_3S), ade_m(dense, future_m)


def scored_plan_m(response: DrivingResponse | None) -> np.ndarray:
    """The 20-point 4 Hz plan (metres) an answer is scored on: its 5 waypoints upsampled by the evaluator's JMT,
    or all zeros when the answer does not parse (the official evaluator scores an unparsable answer so)."""
    if response is None:
        return np.zeros((FUTURE_STEPS, 2))
    return jmt_upsample(np.asarray(response.trajectory))


def constant_velocity_m(history: np.ndarray, steps: int = 20, interval_s: float = FUTURE_INTERVAL_S) -> np.ndarray:
    """Extrapolate the velocity at t = 0 (history row -1, columns vx, vy in m/s) to (steps, 2) metres."""
    t = interval_s * np.arange(1, steps + 1)[:, None]
    return t * np.asarray(history)[-1, 2:4][None, :]


def _travel_directions(path_m: np.ndarray) -> np.ndarray:
    """Unit heading at each point of a (T, 2) path that starts after the origin: the direction from the previous
    point (the origin for the first). Where the path does not move, the last heading carries on; before any
    movement it is +x, the ego's heading at t = 0 in its own frame (as the WOD-E2E evaluator does)."""
    steps = np.diff(path_m, axis=0, prepend=np.zeros((1, 2)))
    out = np.empty_like(steps)
    heading = np.array([1.0, 0.0])
    for i, step in enumerate(steps):
        norm = np.hypot(step[0], step[1])
        if norm > 0:
            heading = step / norm
        out[i] = heading
    return out


def rfs_speed_scale(initial_speed_mps: float) -> float:
    """WOD-E2E trust-region scale for the ego speed at t = 0 in m/s: 0.5 up to 1.4 m/s, 1.0 from 11 m/s, linear."""
    ramp = (initial_speed_mps - RFS_LOW_SPEED_MPS) / (RFS_HIGH_SPEED_MPS - RFS_LOW_SPEED_MPS)
    return float(np.clip(0.5 + 0.5 * ramp, 0.5, 1.0))


def rater_feedback_score(
    predicted_m: np.ndarray,
    rater_trajectories_m: np.ndarray,
    rater_scores: np.ndarray,
    initial_speed_mps: float,
) -> float:
    """WOD-E2E Rater Feedback Score (DESIGN 7) of one predicted (20, 2) path in metres at 4 Hz (t = 0.25..5 s).

    `rater_trajectories_m` is (R, 20, 2) with R in 1..3, `rater_scores` (R,) in [0, 10], `initial_speed_mps` the
    ego speed at t = 0. Raters are padded to 3 by repeating the last one, as the official evaluator does.

    Per rater and per evaluated time t in {3 s, 5 s} (points 11 and 19), the offset of the prediction from the
    rater's point is split into a longitudinal part along the rater's heading there and a lateral part across
    it. The heading is that of the rater's own displacement into that point, from the previous point (the
    origin before the first), carried on where the rater stands still: the WOD-E2E evaluator's frame.
    Thresholds lat (1.0, 1.8) m and lng (4.0, 7.2) m are scaled by `rfs_speed_scale`;
    d = max(lng / t_lng, lat / t_lat) and the score is label * 0.1 ** max(d - 1, 0): flat inside the trust
    region (d <= 1), 10x lower per further threshold width. Best rater per time, mean over the two times.

    The floor, read literally: if no single rater has the prediction inside its trust region at both 3 s and
    5 s (inside one rater at 3 s and another at 5 s does not count), the score becomes max(score, 4). Inside
    some rater's region at both times the score is kept as is, even below 4 when the raters scored low.
    """
    predicted = np.asarray(predicted_m, dtype=float)
    raters = np.asarray(rater_trajectories_m, dtype=float)
    labels = np.asarray(rater_scores, dtype=float)
    if predicted.shape != (RFS_NUM_POINTS, 2):
        raise ValueError(f"predicted path must be ({RFS_NUM_POINTS}, 2) at 4 Hz, got {predicted.shape}")
    if raters.ndim != 3 or raters.shape[1:] != (RFS_NUM_POINTS, 2) or not 1 <= len(raters) <= RFS_MAX_RATERS:
        raise ValueError(
            f"rater paths must be (R, {RFS_NUM_POINTS}, 2) with R in 1..{RFS_MAX_RATERS}, got {raters.shape}"
        )
    if labels.shape != (len(raters),) or np.any((labels < 0) | (labels > RFS_MAX_SCORE)):
        raise ValueError(f"need one rater score in [0, {RFS_MAX_SCORE:g}] per rater path, got {labels.tolist()}")
    # Repeated raters cannot change a max; padding keeps the official evaluator's shapes and is tested as a no-op.
    keep = np.minimum(np.arange(RFS_MAX_RATERS), len(raters) - 1)
    raters, labels = raters[keep], labels[keep]

    scale = rfs_speed_scale(initial_speed_mps)
    lat_threshold_m, lng_threshold_m = scale * RFS_LAT_THRESHOLDS_M, scale * RFS_LNG_THRESHOLDS_M
    at = list(RFS_INDICES)
    distance = np.empty((RFS_MAX_RATERS, len(at)))
    for r, path in enumerate(raters):
        forward = _travel_directions(path)[at]
        left = np.stack([-forward[:, 1], forward[:, 0]], axis=-1)
        offset = predicted[at] - path[at]
        lng_m = np.abs(np.sum(offset * forward, axis=-1))
        lat_m = np.abs(np.sum(offset * left, axis=-1))
        distance[r] = np.maximum(lng_m / lng_threshold_m, lat_m / lat_threshold_m)
    per_rater = labels[:, None] * RFS_DECAY ** np.maximum(distance - 1.0, 0.0)
    score = float(per_rater.max(axis=0).mean())
    if not np.any(np.all(distance <= 1.0, axis=1)):
        score = max(score, RFS_FLOOR)
    return score


def _horizon_steps() -> dict[str, int]:
    """{"1s": 2, "2s": 4, "3s": 6}: how many 2 Hz nuScenes steps each horizon covers."""
    return {f"{h:g}s": int(round(h / NUSCENES_INTERVAL_S)) for h in NUSCENES_HORIZONS_S}


def _by_horizon(per_step: np.ndarray, window: Callable[[np.ndarray], np.ndarray]) -> dict[str, float]:
    """Per horizon, `window` of the (S, n) steps up to it, averaged over the S samples; plus their "avg"."""
    out = {name: float(np.mean(window(per_step[:, :n]))) for name, n in _horizon_steps().items()}
    out["avg"] = float(np.mean(list(out.values())))
    return out


def nuscenes_l2_m(
    predicted_m: np.ndarray, truth_m: np.ndarray, valid_steps: np.ndarray | None = None
) -> dict[str, dict[str, float]]:
    """nuScenes open-loop L2 in metres of a (6, 2) plan at 2 Hz (t = 0.5..3 s) against the logged (6, 2) future.

    Per step, UniAD's `PlanningMetric.compute_L2` (OpenDriveLab/UniAD `planning_head_plugin/planning_metrics.py`):
    sqrt(sum(((plan - truth) ** 2) * mask)), so a step whose logged future is missing (`valid_steps` False, UniAD's
    `sdc_planning_mask`) counts as 0 m and the sample still counts in the mean over samples. Keys "1s", "2s", "3s"
    and "avg" (their mean) in the two conventions of the literature (DESIGN 7):
    "stp3" (ST-P3, VAD): the mean of the per-step L2 over every step up to the horizon;
    "uniad" (UniAD): the L2 at the horizon's step alone.
    VAD (`VAD.py`) instead leaves out a sample whose 6 future steps are not all logged (`fut_valid_flag`).
    """
    predicted = np.asarray(predicted_m, dtype=float)
    truth = np.asarray(truth_m, dtype=float)
    if predicted.shape != (NUSCENES_STEPS, 2) or truth.shape != (NUSCENES_STEPS, 2):
        raise ValueError(f"nuScenes plans are ({NUSCENES_STEPS}, 2) at 2 Hz, got {predicted.shape} and {truth.shape}")
    mask = np.ones(NUSCENES_STEPS) if valid_steps is None else np.asarray(valid_steps, dtype=float)
    if mask.shape != (NUSCENES_STEPS,):
        raise ValueError(f"valid_steps must be ({NUSCENES_STEPS},), got {mask.shape}")
    per_step = np.sqrt((((predicted - truth) ** 2) * mask[:, None]).sum(axis=-1))[None, :]
    return {
        "stp3": _by_horizon(per_step, lambda w: w.mean(axis=1)),
        "uniad": _by_horizon(per_step, lambda w: w[:, -1]),
    }


def _box_frames(
    center_m: np.ndarray, heading_rad: np.ndarray, length_m: np.ndarray, width_m: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Corners (..., 4, 2) and unit axes (..., 2, 2) (forward, left) of oriented boxes."""
    forward = np.stack([np.cos(heading_rad), np.sin(heading_rad)], axis=-1)
    left = np.stack([-forward[..., 1], forward[..., 0]], axis=-1)
    half_forward = forward * (np.asarray(length_m)[..., None] / 2)
    half_left = left * (np.asarray(width_m)[..., None] / 2)
    signs = np.array([[1, 1], [1, -1], [-1, -1], [-1, 1]], dtype=float)
    corners = (
        center_m[..., None, :]
        + signs[:, 0, None] * half_forward[..., None, :]
        + signs[:, 1, None] * half_left[..., None, :]
    )
    return corners, np.stack([forward, left], axis=-2)


def collision_at_steps(
    ego_trajectory_m: np.ndarray,
    agent_boxes: np.ndarray,
    ego_length_m: float = NUSCENES_EGO_LENGTH_M,
    ego_width_m: float = NUSCENES_EGO_WIDTH_M,
) -> np.ndarray:
    """Whether the ego box overlaps any agent box at each step: (T,) bool.

    `ego_trajectory_m` is (T, 2), the ego box centre at each step in metres; `agent_boxes` is (N, T, 5) with
    x, y (centre, metres), heading (radians, counter-clockwise from +x), length (along the heading) and width
    (metres), all in the same frame. An agent with any NaN at a step is absent there. The ego heading is that of
    its own displacement into the step (from the origin at the first step), carried on while it stands still
    (+x before it moves). The ego default is the nuScenes box, 4.084 x 1.85 m (DESIGN 7), centred on the
    waypoint (no rear-axle offset). Overlap is tested exactly with the separating axis theorem on the four
    box axes; boxes that only touch, with no common area, do not collide. The official counting is the raster
    one, `raster_collision_at_steps`; `plan_collisions` offers both.
    """
    ego = np.asarray(ego_trajectory_m, dtype=float)
    agents = np.asarray(agent_boxes, dtype=float)
    if ego.ndim != 2 or ego.shape[1] != 2:
        raise ValueError(f"ego trajectory must be (T, 2), got {ego.shape}")
    if agents.ndim != 3 or agents.shape[1:] != (len(ego), 5):
        raise ValueError(f"agent boxes must be (N, {len(ego)}, 5) as x, y, heading, length, width, got {agents.shape}")
    direction = _travel_directions(ego)
    ego_corners, ego_axes = _box_frames(
        ego,
        np.arctan2(direction[:, 1], direction[:, 0]),
        np.full(len(ego), ego_length_m),
        np.full(len(ego), ego_width_m),
    )
    present = ~np.isnan(agents).any(axis=-1)
    boxes = np.where(present[..., None], agents, 0.0)
    agent_corners, agent_axes = _box_frames(boxes[..., :2], boxes[..., 2], boxes[..., 3], boxes[..., 4])
    axes = np.concatenate([np.broadcast_to(ego_axes, agent_axes.shape), agent_axes], axis=-2)  # (N, T, 4, 2)
    ego_proj = np.einsum("ntkd,tcd->ntkc", axes, ego_corners)
    agent_proj = np.einsum("ntkd,ntcd->ntkc", axes, agent_corners)
    separated = (ego_proj.max(-1) <= agent_proj.min(-1)) | (agent_proj.max(-1) <= ego_proj.min(-1))
    return (~separated.any(axis=-1) & present).any(axis=0)


def _trunc_div(a: int, b: int) -> int:
    """C integer division, rounding toward zero (OpenCV's int64 arithmetic)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _clip_line(p1: tuple[int, int], p2: tuple[int, int], size: int) -> tuple[tuple[int, int], tuple[int, int], bool]:
    """OpenCV `clipLine` (imgproc/src/drawing.cpp) for a size x size image: the clipped ends, and whether
    the segment is inside."""
    (x1, y1), (x2, y2), last = p1, p2, size - 1
    c1 = (x1 < 0) + (x1 > last) * 2 + (y1 < 0) * 4 + (y1 > last) * 8
    c2 = (x2 < 0) + (x2 > last) * 2 + (y2 < 0) * 4 + (y2 > last) * 8
    if (c1 & c2) == 0 and (c1 | c2) != 0:
        if c1 & 12:
            a = 0 if c1 < 8 else last
            x1 += _trunc_div((a - y1) * (x2 - x1), y2 - y1)
            y1, c1 = a, (x1 < 0) + (x1 > last) * 2
        if c2 & 12:
            a = 0 if c2 < 8 else last
            x2 += _trunc_div((a - y2) * (x2 - x1), y2 - y1)
            y2, c2 = a, (x2 < 0) + (x2 > last) * 2
        if (c1 & c2) == 0 and (c1 | c2) != 0:
            if c1:
                a = 0 if c1 == 1 else last
                y1 += _trunc_div((a - x1) * (y2 - y1), x2 - x1)
                x1, c1 = a, 0
            if c2:
                a = 0 if c2 == 1 else last
                y2 += _trunc_div((a - x2) * (y2 - y1), x2 - x1)
                x2, c2 = a, 0
    return (x1, y1), (x2, y2), (c1 | c2) == 0


def _draw_line(grid: np.ndarray, p1: tuple[int, int], p2: tuple[int, int]) -> None:
    """OpenCV's 8-connected `Line` (a left-to-right `LineIterator`) from (x, y) = (column, row) p1 to p2."""
    size = len(grid)
    if not all(0 <= v < size for v in (*p1, *p2)):
        p1, p2, inside = _clip_line(p1, p2, size)
        if not inside:
            return
    if p2[0] < p1[0]:
        p1, p2 = p2, p1
    (x, y), dx, dy = p1, p2[0] - p1[0], p2[1] - p1[1]
    y_step = -1 if dy < 0 else 1
    steep = abs(dy) > dx
    major, minor = (abs(dy), dx) if steep else (dx, abs(dy))
    err = major - 2 * minor
    for _ in range(major + 1):
        grid[y, x] = True
        if err < 0:
            err += 2 * major - 2 * minor
            x, y = x + 1, y + y_step
        else:
            err -= 2 * minor
            x, y = (x, y + y_step) if steep else (x + 1, y)


def _fill_polygon(grid: np.ndarray, vertices: np.ndarray) -> None:
    """`cv2.fillPoly(grid, [vertices], 1)` for integer (x, y) = (column, row) vertices, 8-connected, no shift.

    Ported from OpenCV `CollectPolyEdges` and `FillEdgeCollection` (imgproc/src/drawing.cpp): each edge is drawn
    as a line, then every row between its lowest and highest vertex is filled between pairs of edges, whose x is
    kept in 16-bit fixed point (left end rounded up, right end down)."""
    size, one = len(grid), 1 << 16
    edges = []  # (y0, y1, x at y0 in fixed point, dx per row)
    pt0 = tuple(int(v) for v in vertices[-1])
    for vertex in vertices:
        pt1 = tuple(int(v) for v in vertex)
        _draw_line(grid, pt0, pt1)
        (x0c, y0c), (x1c, y1c) = pt0, pt1
        if not all(0 <= v < size for v in (*pt0, *pt1)):
            (x0c, t0y), (x1c, t1y), _ = _clip_line(pt0, pt1, size)
            if t0y != t1y:
                y0c, y1c = t0y, t1y
        if pt0[1] != pt1[1]:
            dx = _trunc_div((x1c - x0c) * one, y1c - y0c)
            if pt0[1] < pt1[1]:
                edges.append((pt0[1], pt1[1], x0c * one + (pt0[1] - y0c) * dx, dx))
            else:
                edges.append((pt1[1], pt0[1], x1c * one + (pt1[1] - y1c) * dx, dx))
        pt0 = pt1
    if len(edges) < 2:
        return
    ends = [x + (y1 - y0) * dx for y0, y1, x, dx in edges] + [x for _, _, x, _ in edges]
    y_min, y_max = min(e[0] for e in edges), max(e[1] for e in edges)
    if y_max < 0 or y_min >= size or max(ends) < 0 or min(ends) >= size * one:
        return
    for y in range(max(y_min, 0), min(y_max, size)):
        xs = sorted(x + (y - y0) * dx for y0, y1, x, dx in edges if y0 <= y < y1)
        for left, right in zip(xs[0::2], xs[1::2], strict=True):
            x1, x2 = (left + one - 1) >> 16, right >> 16
            if x1 < size and x2 >= 0:
                grid[y, max(x1, 0) : min(x2, size - 1) + 1] = True


def _lidar_frame(x_m: np.ndarray, y_m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our ego frame (+x forward, +y left) to the nuScenes LiDAR frame of ST-P3 / VAD (+x right, +y forward)."""
    return -np.asarray(y_m), np.asarray(x_m)


def bev_occupancy(agent_boxes: np.ndarray) -> np.ndarray:
    """(T, 200, 200) bool occupancy of the agents' boxes per step, as VAD's `PlanningMetric` builds it for its
    collision rate (hustvl/VAD `projects/mmdet3d_plugin/VAD/planner/metric_stp3.py`, `get_birds_eye_view_label`).

    `agent_boxes` is (N, T, 5) x, y, heading, length, width in the ego frame (NaN: absent at that step). Row
    round((50 - forward) / 0.5), column round((50 + right) / 0.5): each box's corners rounded to cells and filled as
    `cv2.fillPoly` does. VAD fills vehicles and pedestrians (nuScenes `vehicle.*` and `human.*` but for animals)
    and ORs them: pass those agents only.
    """
    agents = np.asarray(agent_boxes, dtype=float)
    if agents.ndim != 3 or agents.shape[-1] != 5:
        raise ValueError(f"agent boxes must be (N, T, 5) as x, y, heading, length, width, got {agents.shape}")
    occupancy = np.zeros((agents.shape[1], BEV_CELLS, BEV_CELLS), dtype=bool)
    local = np.array([[0.5, -0.5, -0.5, 0.5], [0.5, 0.5, -0.5, -0.5]])  # corners in box lengths and widths
    for n, t in zip(*np.nonzero(~np.isnan(agents).any(axis=-1)), strict=True):
        x, y, heading, length, width = agents[n, t]
        x_l, y_l = _lidar_frame(x, y)
        yaw = heading + np.pi / 2
        rotation = np.array([[np.cos(yaw), -np.sin(yaw)], [np.sin(yaw), np.cos(yaw)]])
        corners = rotation @ (local * np.array([[length], [width]])) + np.array([[x_l], [y_l]])
        cells = np.stack([corners[0] - BEV_START_M, -corners[1] - BEV_START_M]) + BEV_CELL_M / 2
        _fill_polygon(occupancy[t], np.round(cells.T / BEV_CELL_M).astype(np.int32))
    return occupancy


def _ego_footprint(length_m: float, width_m: float) -> tuple[np.ndarray, np.ndarray]:
    """Cell offsets of the official ego box: `skimage.draw.polygon` of the box shifted 0.5 m forward, in cells
    from the grid's first cell centre: every whole (along, across) in the closed box. Two (K,) arrays."""
    along = (np.array([-length_m / 2, length_m / 2]) + EGO_BOX_SHIFT_M - BEV_START_M) / BEV_CELL_M
    across = (np.array([-width_m / 2, width_m / 2]) - BEV_START_M) / BEV_CELL_M
    rows = np.arange(np.ceil(along[0]), np.floor(along[1]) + 1)
    cols = np.arange(np.ceil(across[0]), np.floor(across[1]) + 1)
    r, c = np.meshgrid(rows, cols, indexing="ij")
    return r.ravel(), c.ravel()


def raster_collision_at_steps(
    ego_trajectory_m: np.ndarray,
    occupancy: np.ndarray,
    ego_length_m: float = NUSCENES_EGO_LENGTH_M,
    ego_width_m: float = NUSCENES_EGO_WIDTH_M,
) -> np.ndarray:
    """Whether the official ego box hits `bev_occupancy` at each step: (T,) bool.

    VAD's `PlanningMetric.evaluate_single_coll` ("same as ST-P3"; ST-P3 `stp3/metrics.py` and UniAD
    `planning_metrics.py` use the same box and grid on occupancy from their own pipelines): the box is axis-aligned
    (no heading), ego_length x ego_width, its centre 0.5 m ahead of the waypoint, as 32 cells (along 97..104, across
    98..101 for the nuScenes box), read at row int(200 - (forward / 0.5 + along)), column int(right / 0.5 + across),
    truncated and clipped to the grid (so a box off the grid is read at its edge).
    """
    ego = np.asarray(ego_trajectory_m, dtype=float)
    grid = np.asarray(occupancy, dtype=bool)
    if ego.ndim != 2 or ego.shape[1] != 2 or grid.shape != (len(ego), BEV_CELLS, BEV_CELLS):
        raise ValueError(f"need (T, 2) and (T, {BEV_CELLS}, {BEV_CELLS}) occupancy, got {ego.shape}, {grid.shape}")
    along, across = _ego_footprint(ego_length_m, ego_width_m)
    right, forward = _lidar_frame(ego[:, 0], ego[:, 1])
    rows = np.clip((BEV_CELLS - (forward[:, None] / BEV_CELL_M + along)).astype(np.int32), 0, BEV_CELLS - 1)
    cols = np.clip((right[:, None] / BEV_CELL_M + across).astype(np.int32), 0, BEV_CELLS - 1)
    return grid[np.arange(len(ego))[:, None], rows, cols].any(axis=1)


def plan_collisions(
    plan_m: np.ndarray,
    logged_m: np.ndarray,
    agent_boxes: np.ndarray,
    ego_length_m: float = NUSCENES_EGO_LENGTH_M,
    ego_width_m: float = NUSCENES_EGO_WIDTH_M,
    method: Literal["raster", "box"] = "raster",
) -> np.ndarray:
    """Per-step collisions of a (T, 2) plan as ST-P3 / VAD / UniAD count them (`obj_box_col`): (T,) bool.

    A step where the logged (T, 2) future collides too is not counted. "raster" (the official way, default):
    `raster_collision_at_steps` on `bev_occupancy`; "box": the exact rotated-box test `collision_at_steps`.
    """
    if method == "raster":
        occupancy = bev_occupancy(agent_boxes)
        hits = [raster_collision_at_steps(path, occupancy, ego_length_m, ego_width_m) for path in (plan_m, logged_m)]
    elif method == "box":
        hits = [collision_at_steps(path, agent_boxes, ego_length_m, ego_width_m) for path in (plan_m, logged_m)]
    else:
        raise ValueError(f"method must be 'raster' or 'box', got {method!r}")
    return hits[0] & ~hits[1]


def collision_rate(collisions: np.ndarray) -> dict[str, dict[str, float]]:
    """nuScenes collision rates (fractions, not %) of (S, 6) per-step collision flags at 2 Hz, or one (6,) plan.

    Keys "1s", "2s", "3s" and "avg" (their mean) in three conventions, averaged over the S samples:
    "stp3" (ST-P3, VAD, as their evaluation code computes it): the fraction of steps up to the horizon that collide;
    "uniad" (UniAD): whether the horizon's step collides;
    "any": whether any step up to the horizon collides (a per-scene reading some later papers use).
    `plan_collisions` gives the flags as the official code counts them.
    """
    flags = np.atleast_2d(np.asarray(collisions, dtype=bool))
    if flags.ndim != 2 or flags.shape[1] != NUSCENES_STEPS:
        raise ValueError(f"collision flags must be (S, {NUSCENES_STEPS}) at 2 Hz, got {flags.shape}")
    return {
        "stp3": _by_horizon(flags, lambda w: w.mean(axis=1)),
        "uniad": _by_horizon(flags, lambda w: w[:, -1]),
        "any": _by_horizon(flags, lambda w: w.any(axis=1)),
    }


def meta_accuracy(predicted: Sequence[DrivingResponse], truth: Sequence[DrivingResponse]) -> tuple[float, float]:
    """Accuracy of the longitudinal and the lateral decision."""
    lon = np.mean(
        [
            p.future_meta_behavior.longitudinal == t.future_meta_behavior.longitudinal
            for p, t in zip(predicted, truth, strict=True)
        ]
    )
    lat = np.mean(
        [
            p.future_meta_behavior.lateral == t.future_meta_behavior.lateral
            for p, t in zip(predicted, truth, strict=True)
        ]
    )
    return float(lon), float(lat)


def meta_confusion(
    predicted: Sequence[DrivingResponse],
    truth: Sequence[DrivingResponse],
    field: Literal["longitudinal", "lateral"] = "longitudinal",
) -> tuple[tuple[str, ...], np.ndarray]:
    """Confusion matrix of one meta-behaviour decision over the schema's whole vocabulary for it.

    Returns (labels, counts) with counts[i, j] the number of answers whose truth is labels[i] and whose
    prediction is labels[j] (rows truth, columns prediction, as scikit-learn).
    """
    vocabularies = {"longitudinal": LONGITUDINAL_BEHAVIORS, "lateral": LATERAL_BEHAVIORS}
    if field not in vocabularies:
        raise ValueError(f"field must be one of {', '.join(vocabularies)}, got {field!r}")
    labels = vocabularies[field]
    index = {label: i for i, label in enumerate(labels)}
    counts = np.zeros((len(labels), len(labels)), dtype=np.int64)
    for p, t in zip(predicted, truth, strict=True):
        counts[index[getattr(t.future_meta_behavior, field)], index[getattr(p.future_meta_behavior, field)]] += 1
    return labels, counts


def _critical_flags(responses: Sequence[DrivingResponse]) -> np.ndarray:
    """(answers, 12) bool "yes" flags in CRITICAL_OBJECT_CLASSES order."""
    return np.array([[r.critical_objects[c] for c in CRITICAL_OBJECT_CLASSES] for r in responses], dtype=bool).reshape(
        -1, len(CRITICAL_OBJECT_CLASSES)
    )


def critical_object_f1(predicted: Sequence[DrivingResponse], truth: Sequence[DrivingResponse]) -> float:
    """Micro-averaged F1 of the "yes" flags over all 12 classes (0 if neither side says yes anywhere)."""
    p, t = _critical_flags(predicted), _critical_flags(truth)
    tp, fp, fn = (p & t).sum(), (p & ~t).sum(), (~p & t).sum()
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else 0.0


def _detection_scores(tp: int, fp: int, fn: int) -> dict[str, float | int | None]:
    return {
        "precision": tp / (tp + fp) if tp + fp else None,
        "recall": tp / (tp + fn) if tp + fn else None,
        "f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else None,
        "tp": tp,
        "fp": fp,
        "fn": fn,
    }


def critical_object_scores(
    predicted: Sequence[DrivingResponse], truth: Sequence[DrivingResponse]
) -> dict[str, dict[str, float | int | None]]:
    """Precision, recall and F1 of the "yes" flags per critical-object class, and micro-averaged as "micro".

    Each entry also holds its counts tp, fp, fn. A ratio whose denominator is zero is None, not 0, so that "no
    data" stays apart from "all wrong": precision is None when nothing was predicted "yes", recall is None when
    the truth has no "yes", and F1 = 2 tp / (2 tp + fp + fn) is None only when neither side says "yes". So a
    class with positives that the model never flags gets F1 0 and precision None.
    """
    p, t = _critical_flags(predicted), _critical_flags(truth)
    if p.shape != t.shape:
        raise ValueError(f"need as many predicted as true answers, got {len(p)} and {len(t)}")
    tp, fp, fn = (p & t).sum(axis=0), (p & ~t).sum(axis=0), (~p & t).sum(axis=0)
    scores = {
        name: _detection_scores(int(tp[i]), int(fp[i]), int(fn[i])) for i, name in enumerate(CRITICAL_OBJECT_CLASSES)
    }
    scores["micro"] = _detection_scores(int(tp.sum()), int(fp.sum()), int(fn.sum()))
    return scores


def json_validity_rate(valid_flags: Sequence[bool]) -> float:
    """Fraction of answers whose text parsed into a valid DrivingResponse."""
    flags = np.asarray(valid_flags, dtype=bool)
    if flags.size == 0:
        raise ValueError("no answers to rate")
    return float(flags.mean())
