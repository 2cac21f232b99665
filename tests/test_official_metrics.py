"""The metrics in the official conventions, on hand cases taken from the official code.

JMT and invalid answers: NVlabs/Fast-dLLM `fast_ddrive/eval/evaluate_waymo_metrics.py`. Raster collisions:
hustvl/VAD `projects/mmdet3d_plugin/VAD/planner/metric_stp3.py` (cells as its `cv2.fillPoly` and
`skimage.draw.polygon` give them). L2 mask: OpenDriveLab/UniAD `planning_head_plugin/planning_metrics.py`.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from fastddrive.core.jmt import jmt_upsample, knot_derivatives
from fastddrive.core.metrics import (
    ade_m,
    bev_occupancy,
    collision_at_steps,
    collision_rate,
    nuscenes_l2_m,
    plan_collisions,
    raster_collision_at_steps,
    rater_feedback_score,
)
from fastddrive.core.sample import CameraView, DrivingSample
from fastddrive.core.schema import CRITICAL_OBJECT_CLASSES, DrivingResponse, MetaBehavior
from fastddrive.eval import accuracy

ACCELERATING = np.array([[1.0, 0.0], [3.0, 0.0], [6.0, 0.0], [10.0, 0.0], [15.0, 0.0]])  # t = 1..5 s


def test_jmt_knot_derivatives_have_the_official_sign_at_the_first_knot():
    velocity, acceleration = knot_derivatives(np.vstack([np.zeros((1, 2)), ACCELERATING]))
    assert velocity[:, 0].tolist() == [1.0, 1.5, 2.5, 3.5, 4.5, 5.0]  # central inside, one-sided at the ends
    # Second differences are all +1 m/s^2; the official code gives -1 at the origin (np.gradient twice: 0.5).
    assert acceleration[:, 0].tolist() == [-1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert not acceleration[:, 1].any()


def test_jmt_matches_the_official_evaluator_on_the_hand_case():
    dense = jmt_upsample(ACCELERATING)
    # First segment: p0 0, v0 1, a0 -1 -> p1 1, v1 1.5, a1 1 over 1 s is x(t) = t - t^2 / 2 + t^4 - t^5 / 2.
    t = np.array([0.25, 0.5, 0.75, 1.0])
    assert dense[:4, 0] == pytest.approx(t - t**2 / 2 + t**4 - t**5 / 2, abs=1e-12)
    assert dense[:4, 0] == pytest.approx([0.2222, 0.4219, 0.6665, 1.0], abs=5e-5)  # the official figures
    # All 20 points as the official code computes them (exact binary fractions here).
    official = [0.22216796875, 0.421875, 0.66650390625, 1.0, 1.40625, 1.875, 2.40625, 3.0, 3.65625, 4.375]
    official += [5.15625, 6.0, 6.90625, 7.875, 8.90625, 10.0, 11.17529296875, 12.453125, 13.74853515625, 15.0]
    assert dense[:, 0] == pytest.approx(official, abs=1e-12)
    assert not dense[:, 1].any()
    with pytest.raises(ValueError, match="waypoints"):
        jmt_upsample(ACCELERATING[:4])


def test_uniad_l2_mask_counts_a_missing_step_as_zero():
    truth = np.stack([5.0 * np.arange(1, 7), np.zeros(6)], axis=-1)
    predicted = truth + np.arange(1, 7)[:, None] * np.array([0.3, 0.4])  # per-step L2 0.5, 1.0, ..., 3.0 m
    valid = np.array([True, True, True, True, False, False])  # the logged future ends after 2 s
    l2 = nuscenes_l2_m(predicted, truth, valid)
    # UniAD: sqrt(sum(diff^2 * mask)) -> 0.5, 1.0, 1.5, 2.0, 0, 0.
    assert l2["uniad"] == pytest.approx({"1s": 1.0, "2s": 2.0, "3s": 0.0, "avg": 1.0})
    assert l2["stp3"] == pytest.approx({"1s": 0.75, "2s": 1.25, "3s": 5.0 / 6, "avg": (0.75 + 1.25 + 5.0 / 6) / 3})
    assert nuscenes_l2_m(predicted, truth, np.ones(6, dtype=bool)) == nuscenes_l2_m(predicted, truth)
    with pytest.raises(ValueError, match="valid_steps"):
        nuscenes_l2_m(predicted, truth, valid[:4])


def one_cell(row: int, col: int, steps: int = 1) -> np.ndarray:
    grid = np.zeros((steps, 200, 200), dtype=bool)
    grid[:, row, col] = True
    return grid


@pytest.mark.parametrize(
    ("row", "col", "hit"),
    [
        # At the origin the official box covers rows 200 - (97..104) = 96..103 and columns 98..101: the 32 cells
        # of skimage.draw.polygon on the 4.084 x 1.85 m box shifted 0.5 m forward.
        (96, 98, True),
        (103, 101, True),
        (95, 99, False),
        (104, 99, False),
        (100, 97, False),
        (100, 102, False),
    ],
)
def test_official_ego_box_cells(row, col, hit):
    assert raster_collision_at_steps(np.zeros((1, 2)), one_cell(row, col)).tolist() == [hit]


def test_ego_cells_move_by_truncation_and_clip_to_the_grid():
    # 1.3 m forward and 0.4 m left: rows int(200 - (2.6 + 97..104)) = 93..100, columns int(-0.8 + 98..101) = 97..100.
    ego = np.array([[1.3, 0.4]])
    assert raster_collision_at_steps(ego, one_cell(93, 97)).tolist() == [True]
    assert raster_collision_at_steps(ego, one_cell(92, 97)).tolist() == [False]
    assert raster_collision_at_steps(ego, one_cell(100, 101)).tolist() == [False]
    # 80 m ahead is off the grid: the official code clips the cells onto its first row.
    assert raster_collision_at_steps(np.array([[80.0, 0.0]]), one_cell(0, 100)).tolist() == [True]


def box_at_first_step(x: float, y: float, heading: float, length: float, width: float) -> np.ndarray:
    """(1, 6, 5) boxes of one agent present at the first 2 Hz step only."""
    boxes = np.full((1, 6, 5), np.nan)
    boxes[0, 0] = [x, y, heading, length, width]
    return boxes


def spans(grid: np.ndarray) -> dict[int, tuple[int, int]]:
    rows = sorted(set(np.nonzero(grid)[0].tolist()))
    assert all(np.ptp(np.nonzero(grid[r])[0]) + 1 == grid[r].sum() for r in rows)  # one run per row
    return {r: (int(np.nonzero(grid[r])[0].min()), int(np.nonzero(grid[r])[0].max())) for r in rows}


def test_occupancy_cells_are_those_of_the_official_fill():
    # Rows and columns of each box as VAD's _get_poly_region_in_image and cv2.fillPoly (OpenCV 4.11) set them.
    ahead = bev_occupancy(box_at_first_step(9.2, 0.0, 0.0, 4.0, 2.0))
    assert spans(ahead[0]) == {r: (98, 102) for r in range(78, 87)} and not ahead[1:].any()
    turned = bev_occupancy(box_at_first_step(10.0, 5.0, np.pi / 6, 4.5, 1.9))[0]
    assert spans(turned) == {
        **{75: (89, 89), 76: (87, 90), 77: (86, 90), 78: (87, 91), 79: (87, 91), 80: (88, 92)},
        **{81: (88, 93), 82: (89, 93), 83: (90, 94), 84: (90, 93), 85: (91, 91)},
    }
    # Cut by the grid's far edge (OpenCV's clipped edges; OpenCV 4.7 and older differ by a cell here).
    edge = bev_occupancy(box_at_first_step(49.0, -20.0, 0.3, 6.0, 2.5))[0]
    assert spans(edge) == {
        **{0: (136, 142), 1: (136, 142), 2: (137, 143), 3: (137, 143), 4: (137, 143)},
        **{5: (138, 143), 6: (138, 144), 7: (139, 144), 8: (139, 141)},
    }


def ego_along_x() -> np.ndarray:
    """Six 2 Hz ego positions at 10 m/s along +x: x = 5, 10, ..., 30 m."""
    return np.stack([5.0 * np.arange(1, 7), np.zeros(6)], axis=-1)


def test_raster_and_rotated_box_tests_disagree_as_the_official_code_says():
    ego = ego_along_x()
    # A car whose tail is 0.16 m past the ego's front at 0.5 s: the exact boxes stay apart, but the official box
    # reaches 0.5 m further forward and the official code reports a collision.
    ahead = box_at_first_step(9.2, 0.0, 0.0, 4.0, 2.0)
    assert not collision_at_steps(ego, ahead).any()
    assert raster_collision_at_steps(ego, bev_occupancy(ahead)).tolist() == [True] + [False] * 5
    # A car 0.125 m into the ego's right side: the exact test sees it; the official cells, off-centre to the
    # left (columns 98..101 are 1.0 m left to 0.5 m right), do not.
    right = box_at_first_step(5.0, -1.8, 0.0, 4.0, 2.0)
    assert collision_at_steps(ego, right).tolist() == [True] + [False] * 5
    assert not raster_collision_at_steps(ego, bev_occupancy(right)).any()
    # The same car on the left is a collision for both.
    left = box_at_first_step(5.0, 1.8, 0.0, 4.0, 2.0)
    assert raster_collision_at_steps(ego, bev_occupancy(left)).tolist() == [True] + [False] * 5
    assert plan_collisions(ego, np.zeros((6, 2)), ahead).tolist() == [True] + [False] * 5  # raster by default
    assert not plan_collisions(ego, np.zeros((6, 2)), ahead, method="box").any()


def test_plan_collisions_drop_steps_where_the_logged_future_collides():
    ego = ego_along_x()
    parked = np.tile([15.0, 0.0, 0.0, 4.0, 2.0], (1, 6, 1))  # hit at 1.5 s (x = 15 m)
    assert plan_collisions(ego, np.full((6, 2), -30.0), parked).tolist() == [False, False, True, False, False, False]
    # The logged future passes there too at 1.5 s: ST-P3 / VAD / UniAD do not count that step.
    assert not plan_collisions(ego, ego, parked).any()
    assert not plan_collisions(ego, ego, parked, method="box").any()
    with pytest.raises(ValueError, match="method"):
        plan_collisions(ego, ego, parked, method="exact")


def straight_future(speed_mps: float) -> np.ndarray:
    return np.stack([speed_mps * 0.25 * np.arange(1, 21), np.zeros(20)], axis=-1)


def answer(future: np.ndarray) -> DrivingResponse:
    return DrivingResponse(
        critical_objects={c: False for c in CRITICAL_OBJECT_CLASSES},
        explanation="",
        future_meta_behavior=MetaBehavior(longitudinal="keep", lateral="lane_follow"),
        trajectory=[tuple(p) for p in future[3::4]],
    )


def sample(name: str, speed_mps: float, rated: bool) -> DrivingSample:
    future = straight_future(speed_mps)
    history = np.zeros((7, 6))
    history[:, 2] = speed_mps
    raters = {"rater_trajectories": future[None], "rater_scores": np.array([8.0])} if rated else {}
    return DrivingSample(
        sample_id=name,
        scenario="highway",
        episode_seed=0,
        time_s=0.0,
        image=np.zeros((28, 28, 3), dtype=np.uint8),
        history=history,
        command="go_straight",
        future=future,
        future_time_s=0.25 * np.arange(1, 21),
        response=answer(future),
        view=CameraView(1.0, (14.0, 14.0), 0.0),
        **raters,
    )


@pytest.fixture
def answers(monkeypatch):
    """Replace the planner: each sample gets the answer under its id (None: does not parse; "raise": fails)."""
    table: dict[str, object] = {}

    class Scripted:
        def __init__(self, model):
            pass

        def plan(self, scene, decoder, **options):
            if table[scene.sample_id] == "raise":
                raise RuntimeError("out of memory")
            return SimpleNamespace(response=table[scene.sample_id])

    monkeypatch.setattr(accuracy, "Planner", Scripted)
    return table


def test_invalid_answers_are_scored_as_zero_trajectories_over_the_rated_frames(answers):
    samples = [sample("rated-ok", 10.0, True), sample("rated-bad", 8.0, True)]
    samples += [sample("unrated-ok", 6.0, False), sample("unrated-bad", 4.0, False), sample("crash", 5.0, True)]
    answers |= {"rated-ok": samples[0].response, "rated-bad": None, "unrated-ok": samples[2].response}
    answers |= {"unrated-bad": None, "crash": "raise"}
    report = accuracy.evaluate(None, samples, "ar")
    zero = np.zeros((20, 2))
    assert (report.samples, report.invalid, report.scored, len(report.failures)) == (5, 2, 2, 1)
    # Official: the two rated frames that decoded, the unparsed one as the zero trajectory.
    assert report.ade5_m == pytest.approx(ade_m(zero, samples[1].future) / 2)
    assert report.ade3_m == pytest.approx(ade_m(zero, samples[1].future, 12) / 2)
    assert report.ade5_parsed_m == pytest.approx(0.0) and report.ade3_parsed_m == pytest.approx(0.0)
    zero_rfs = rater_feedback_score(zero, samples[1].rater_trajectories, [8.0], 8.0)
    assert zero_rfs == pytest.approx(4.0)  # far outside the rater's trust region: the floor
    assert report.rfs == pytest.approx((8.0 + zero_rfs) / 2) and report.rfs_parsed == pytest.approx(8.0)
    l2_zero = nuscenes_l2_m(zero[1:12:2], samples[1].future[1:12:2])["uniad"]["3s"]
    assert report.l2_m["uniad"]["3s"] == pytest.approx(l2_zero / 2)
    assert report.collision == collision_rate(np.zeros((2, 6), dtype=bool))
    assert report.cv_ade5_m == pytest.approx(0.0)  # constant speed futures
    scored = {r["sample_id"]: (r["valid"], r["scored"]) for r in report.per_sample}
    assert scored == {
        "rated-ok": (True, True),
        "rated-bad": (False, True),
        "unrated-ok": (True, False),
        "unrated-bad": (False, False),
        "crash": (None, False),
    }
    assert report.by_scenario()["highway"]["samples"] == 2
    assert report.validity == pytest.approx(2 / 5)
    assert set(report.conventions) >= {"ade5_m", "ade5_parsed_m", "rfs", "collision", "collision_box", "invalid"}


def test_without_raters_every_decoded_frame_is_scored(answers):
    samples = [sample("ok", 10.0, False), sample("bad", 8.0, False)]
    answers |= {"ok": samples[0].response, "bad": None}
    report = accuracy.evaluate(None, samples, "ar")
    assert (report.invalid, report.scored, report.rfs, report.rfs_parsed) == (1, 2, None, None)
    assert report.ade5_m == pytest.approx(ade_m(np.zeros((20, 2)), samples[1].future) / 2)
    assert report.ade5_parsed_m == pytest.approx(0.0)
