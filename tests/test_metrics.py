import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastddrive.core.metrics import (
    RFS_INDICES,
    ade_m,
    collision_at_steps,
    collision_rate,
    critical_object_f1,
    critical_object_scores,
    fde_m,
    json_validity_rate,
    meta_accuracy,
    meta_confusion,
    nuscenes_l2_m,
    rater_feedback_score,
    rfs_speed_scale,
)
from fastddrive.core.schema import CRITICAL_OBJECT_CLASSES, LATERAL_BEHAVIORS, DrivingResponse, MetaBehavior

T3, T5 = RFS_INDICES
HIGH_SPEED = 11.0  # m/s: thresholds at full size, lat (1.0, 1.8) m and lng (4.0, 7.2) m
LOW_SPEED = 1.4  # m/s: thresholds halved, lat (0.5, 0.9) m and lng (2.0, 3.6) m


def straight(speed_mps: float = 10.0, lateral_m: float = 0.0) -> np.ndarray:
    """(20, 2) path along +x at 4 Hz, `lateral_m` to the left."""
    t = 0.25 * np.arange(1, 21)
    return np.stack([speed_mps * t, np.full_like(t, lateral_m)], axis=-1)


def shifted(path: np.ndarray, at_3s: tuple[float, float], at_5s: tuple[float, float]) -> np.ndarray:
    """`path` with its 3 s and 5 s points moved by the given (dx, dy) metres (the only points RFS reads)."""
    out = path.copy()
    out[T3] += at_3s
    out[T5] += at_5s
    return out


def test_rfs_evaluates_points_11_and_19():
    assert RFS_INDICES == (11, 19)


def test_rfs_speed_scale():
    assert rfs_speed_scale(LOW_SPEED) == pytest.approx(0.5)
    assert rfs_speed_scale(HIGH_SPEED) == pytest.approx(1.0)
    assert rfs_speed_scale(6.2) == pytest.approx(0.75)  # half-way up the ramp
    assert rfs_speed_scale(0.0) == 0.5
    assert rfs_speed_scale(30.0) == 1.0


@pytest.mark.parametrize("label", [0.0, 2.0, 7.0, 10.0])
def test_rfs_of_a_rater_trajectory_is_its_score_without_floor(label):
    rater = straight()
    # Inside the trust region the score is the label, even below the floor of 4 (the floor is for outside only).
    assert rater_feedback_score(rater, rater[None], [label], HIGH_SPEED) == pytest.approx(label)
    # Anywhere inside (d <= 1) is flat: 0.9 of the lateral and 0.9 of the longitudinal threshold at each time.
    inside = shifted(rater, (3.6, 0.9), (-6.48, -1.62))
    assert rater_feedback_score(inside, rater[None], [label], HIGH_SPEED) == pytest.approx(label)


def test_rfs_floors_at_4_outside_every_trust_region():
    rater = straight()
    # Lateral offsets of exactly 2 thresholds (2.0 m at 3 s, 3.6 m at 5 s): d = 2 at both times, so
    # 10 * 0.1 ** (2 - 1) = 1.0 per time, mean 1.0, outside everywhere -> floored to 4.
    prediction = shifted(rater, (0.0, 2.0), (0.0, 3.6))
    assert rater_feedback_score(prediction, rater[None], [10.0], HIGH_SPEED) == pytest.approx(4.0)
    # Far away: 10 * 0.1 ** large ~ 0 -> still 4.
    far = shifted(rater, (0.0, -50.0), (0.0, -50.0))
    assert rater_feedback_score(far, rater[None], [10.0], HIGH_SPEED) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("widths", "expected"),
    [
        # Inside at 3 s (half a threshold), d = widths at 5 s: (10 + 10 * 0.1 ** (d - 1)) / 2. Outside at 5 s
        # means not fully inside, but the mean is above 4, so the floor leaves it alone and the decay shows.
        (1.0, 10.0),
        (1.5, (10 + 10 * 0.1**0.5) / 2),  # 6.58
        (2.0, (10 + 1.0) / 2),  # 5.5: 10x lower one threshold width out
        (3.0, (10 + 0.1) / 2),  # 5.05: 100x lower two widths out
    ],
)
def test_rfs_decays_tenfold_per_threshold_width(widths, expected):
    rater = straight()
    lateral = shifted(rater, (0.0, 0.5), (0.0, widths * 1.8))
    assert rater_feedback_score(lateral, rater[None], [10.0], HIGH_SPEED) == pytest.approx(expected)
    longitudinal = shifted(rater, (-2.0, 0.0), (widths * 7.2, 0.0))
    assert rater_feedback_score(longitudinal, rater[None], [10.0], HIGH_SPEED) == pytest.approx(expected)


def test_rfs_decayed_better_rater_beats_a_low_rater_that_holds_the_prediction():
    low = straight()  # label 3, the prediction is on it: inside, so no floor
    # Label 10, 1.5 lateral thresholds to the right at both times (1.5 m at 3 s, 2.7 m at 5 s), heading +x at
    # points 11 and 19 because it keeps its lateral position over the step into each of them.
    high = straight()
    high[: T3 + 1, 1] = -1.5
    high[T3 + 1 :, 1] = -2.7
    # Per time: max(3, 10 * 0.1 ** 0.5 = 3.16) = 3.16; inside `low` at both times, so not floored to 4.
    score = rater_feedback_score(low, np.stack([low, high]), [3.0, 10.0], HIGH_SPEED)
    assert score == pytest.approx(10 * 0.1**0.5)
    assert score < 4.0
    assert rater_feedback_score(low, low[None], [3.0], HIGH_SPEED) == pytest.approx(3.0)


def test_rfs_floor_needs_one_rater_holding_both_times():
    a, b = straight(), straight(lateral_m=3.0)  # both scored 1
    # On a at 3 s and on b at 5 s: per time the best rater gives 1, mean 1. Inside some rater at each time, but
    # no single rater holds both times, so it is floored to 4.
    prediction = shifted(a, (0.0, 0.0), (0.0, 3.0))
    assert rater_feedback_score(prediction, np.stack([a, b]), [1.0, 1.0], HIGH_SPEED) == pytest.approx(4.0)
    # On a at both times: fully inside a, the score stays 1.
    assert rater_feedback_score(a, np.stack([a, b]), [1.0, 1.0], HIGH_SPEED) == pytest.approx(1.0)


def test_rfs_trust_region_scales_with_initial_speed():
    rater = straight()
    # Lateral 0.8 m at 3 s and 1.5 m at 5 s: inside at 11 m/s (thresholds 1.0, 1.8), outside at 1.4 m/s
    # (0.5, 0.9): d = 1.6 and 1.67 -> (2.51 + 2.15) / 2 = 2.33 -> floored to 4.
    prediction = shifted(rater, (0.0, 0.8), (0.0, 1.5))
    assert rater_feedback_score(prediction, rater[None], [10.0], HIGH_SPEED) == pytest.approx(10.0)
    assert rater_feedback_score(prediction, rater[None], [10.0], LOW_SPEED) == pytest.approx(4.0)
    # 1.0 m lateral at 3 s only: d = 1 at 11 m/s (inside, 10) but d = 2 at 1.4 m/s -> (1 + 10) / 2 = 5.5.
    edge = shifted(rater, (0.0, 1.0), (0.0, 0.0))
    assert rater_feedback_score(edge, rater[None], [10.0], HIGH_SPEED) == pytest.approx(10.0)
    assert rater_feedback_score(edge, rater[None], [10.0], LOW_SPEED) == pytest.approx(5.5)


def test_rfs_frame_follows_the_rater_heading():
    # A rater driving along +y: an offset along +y is longitudinal for it. 5 m: d = 5 / 4 = 1.25 at 3 s and
    # 5 / 7.2 < 1 at 5 s -> (10 * 0.1 ** 0.25 + 10) / 2. In the ego x/y frame it would be lateral (d = 5).
    rater = straight()[:, ::-1].copy()
    prediction = shifted(rater, (0.0, 5.0), (0.0, 5.0))
    expected = (10 * 0.1**0.25 + 10) / 2
    assert rater_feedback_score(prediction, rater[None], [10.0], HIGH_SPEED) == pytest.approx(expected)


def test_rfs_standing_rater_uses_the_ego_heading():
    # A rater that never moves has no displacement: its frame is the ego's at t = 0 (+x forward).
    rater = np.zeros((20, 2))
    ahead = shifted(rater, (1.5, 0.0), (1.5, 0.0))  # longitudinal 1.5 m < 2.0 m and 3.6 m at 1.4 m/s: inside
    assert rater_feedback_score(ahead, rater[None], [10.0], LOW_SPEED) == pytest.approx(10.0)
    beside = shifted(rater, (0.0, 1.5), (0.0, 1.5))  # lateral d = 3 and 1.67 -> 1.13, floored to 4
    assert rater_feedback_score(beside, rater[None], [10.0], LOW_SPEED) == pytest.approx(4.0)


offsets = st.floats(min_value=-6.0, max_value=6.0, allow_nan=False)


@given(
    st.lists(st.tuples(offsets, offsets), min_size=2, max_size=2),
    st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=2, max_size=2),
    st.floats(min_value=0.0, max_value=20.0),
)
@settings(max_examples=100, deadline=None)
def test_rfs_padding_to_three_raters_changes_nothing(moves, labels, speed):
    a, b = straight(), straight(speed_mps=8.0, lateral_m=1.0)
    prediction = shifted(a, moves[0], moves[1])
    one = rater_feedback_score(prediction, a[None], labels[:1], speed)
    assert one == rater_feedback_score(prediction, np.stack([a, a, a]), [labels[0]] * 3, speed)
    two = rater_feedback_score(prediction, np.stack([a, b]), labels, speed)
    assert two == rater_feedback_score(prediction, np.stack([a, b, b]), [*labels, labels[1]], speed)
    assert 0.0 <= two <= 10.0


@given(
    st.floats(min_value=-math.pi, max_value=math.pi),
    st.lists(st.tuples(offsets, offsets), min_size=20, max_size=20),
    st.floats(min_value=4.0, max_value=10.0),
    st.floats(min_value=0.0, max_value=20.0),
)
@settings(max_examples=100, deadline=None)
def test_rfs_is_invariant_to_rotating_the_scene(angle, moves, label, speed):
    # A curving rater; each rater's own frame makes the score independent of the scene's orientation. Labels
    # of at least 4 keep the floor continuous, so rounding at a trust-region edge cannot flip the result.
    t = 0.25 * np.arange(1, 21)
    rater = np.stack([8.0 * np.sin(t / 2) * 2, 8.0 * (1 - np.cos(t / 2)) * 2], axis=-1)
    prediction = rater + np.array(moves)
    rotation = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    before = rater_feedback_score(prediction, rater[None], [label], speed)
    after = rater_feedback_score(prediction @ rotation.T, (rater @ rotation.T)[None], [label], speed)
    assert after == pytest.approx(before, abs=1e-9)


def test_rfs_rejects_bad_inputs():
    rater = straight()
    with pytest.raises(ValueError, match="R in 1..3"):
        rater_feedback_score(rater, np.stack([rater] * 4), [5.0] * 4, HIGH_SPEED)
    with pytest.raises(ValueError, match="rater score"):
        rater_feedback_score(rater, rater[None], [11.0], HIGH_SPEED)
    with pytest.raises(ValueError, match="predicted path"):
        rater_feedback_score(rater[:5], rater[None], [5.0], HIGH_SPEED)


def test_fde_is_the_last_point_error():
    truth = straight()
    predicted = truth.copy()
    predicted[0] += (10.0, 0.0)
    predicted[-1] += (3.0, 4.0)
    assert fde_m(predicted, truth) == pytest.approx(5.0)
    assert ade_m(predicted, truth) == pytest.approx((10.0 + 5.0) / 20)


def test_nuscenes_l2_conventions_differ_as_documented():
    truth = np.stack([5.0 * np.arange(1, 7), np.zeros(6)], axis=-1)
    # Step k (k = 1..6, t = 0.5 k s) is off by k * (0.3, 0.4): per-step L2 = 0.5, 1.0, ..., 3.0 m.
    predicted = truth + np.arange(1, 7)[:, None] * np.array([0.3, 0.4])
    l2 = nuscenes_l2_m(predicted, truth)
    # ST-P3 / VAD: mean up to the horizon. 1 s: (0.5 + 1.0) / 2; 2 s: (0.5 + ... + 2.0) / 4; 3 s: 10.5 / 6.
    assert l2["stp3"] == pytest.approx({"1s": 0.75, "2s": 1.25, "3s": 1.75, "avg": 1.25})
    # UniAD: the step itself. 1 s: step 2; 2 s: step 4; 3 s: step 6.
    assert l2["uniad"] == pytest.approx({"1s": 1.0, "2s": 2.0, "3s": 3.0, "avg": 2.0})
    with pytest.raises(ValueError, match="2 Hz"):
        nuscenes_l2_m(predicted[:5], truth[:5])


def ego_along_x() -> np.ndarray:
    """Six 2 Hz ego centres at 10 m/s along +x: x = 5, 10, ..., 30 m."""
    return np.stack([5.0 * np.arange(1, 7), np.zeros(6)], axis=-1)


def parked(x: float, y: float, heading: float = 0.0, length: float = 4.0, width: float = 2.0) -> np.ndarray:
    """One agent's (6, 5) boxes standing still."""
    return np.tile([x, y, heading, length, width], (6, 1))


def test_collision_with_a_parked_car_ahead():
    # The agent spans x 13..17 m; the ego (4.084 m long) spans 12.96..17.04 m only at step 3 (x = 15 m).
    collisions = collision_at_steps(ego_along_x(), parked(15.0, 0.0)[None])
    assert collisions.tolist() == [False, False, True, False, False, False]


def test_no_collision_on_a_clear_road():
    # Neighbour lanes 3.5 m either side: half-widths 0.925 + 1.0 < 3.5 m.
    agents = np.stack([parked(15.0, 3.5), parked(20.0, -3.5), parked(100.0, 0.0)])
    assert not collision_at_steps(ego_along_x(), agents).any()
    assert not collision_at_steps(ego_along_x(), np.zeros((0, 6, 5))).any()


def test_rotated_boxes_apart_although_their_axis_aligned_boxes_overlap():
    ego = ego_along_x()
    corner = np.array([5.0 + 4.084 / 2, 1.85 / 2])  # front-left corner of the ego box at step 1
    diagonal = np.array([1.0, 1.0]) / math.sqrt(2)
    # A 4 x 1 m box across the diagonal (heading 135 deg), its near side 1.0 - 0.5 = 0.5 m beyond the corner.
    centre = corner + 1.0 * diagonal
    agent = np.full((6, 5), np.nan)
    agent[0] = [*centre, 3 * math.pi / 4, 4.0, 1.0]
    half_extent = (2.0 + 0.5) / math.sqrt(2)  # of the agent's axis-aligned box, both axes
    assert centre[0] - half_extent < corner[0] and centre[1] - half_extent < corner[1]  # AABBs overlap
    assert not collision_at_steps(ego, agent[None]).any()
    agent[0, :2] = corner + 0.3 * diagonal  # now 0.2 m into the corner
    assert collision_at_steps(ego, agent[None]).tolist() == [True] + [False] * 5


def test_ego_heading_comes_from_its_own_displacement():
    ego = ego_along_x()[:, ::-1].copy()  # driving along +y: box 1.85 m wide in x, 4.084 m long in y
    beside = parked(1.5, 10.0, length=1.0, width=1.0)  # x 1.0..2.0: clear of |x| <= 0.925
    # y 11.9..12.9: overlaps the ego's y 7.958..12.042 at step 2 only (12.958..17.042 at step 3); a +x heading
    # would give the ego y 9.075..10.925 there and miss it.
    ahead = parked(0.0, 12.4, length=1.0, width=1.0)
    assert not collision_at_steps(ego, beside[None]).any()
    assert collision_at_steps(ego, ahead[None]).tolist() == [False, True, False, False, False, False]


def test_agents_missing_at_a_step_are_ignored():
    agent = parked(15.0, 0.0)
    agent[2] = np.nan
    assert not collision_at_steps(ego_along_x(), agent[None]).any()
    agent[2, 0] = 15.0  # one NaN is enough to drop the box
    assert not collision_at_steps(ego_along_x(), agent[None]).any()
    # A missing box is absent, not a box at the origin: an ego whose box covers the origin still does not collide.
    slow_ego = np.stack([np.arange(1.0, 7.0), np.zeros(6)], axis=-1)
    assert not collision_at_steps(slow_ego, np.full((1, 6, 5), np.nan)).any()


def test_collision_rate_conventions():
    flags = np.zeros((2, 6), dtype=bool)
    flags[0, 1] = True  # sample 0 collides at 1 s only
    flags[1, 5] = True  # sample 1 collides at 3 s only
    rates = collision_rate(flags)
    # ST-P3 / VAD: fraction of steps up to the horizon, mean over samples. 1 s: (1/2 + 0) / 2; 2 s: (1/4 + 0) / 2;
    # 3 s: (1/6 + 1/6) / 2.
    assert rates["stp3"] == pytest.approx({"1s": 0.25, "2s": 0.125, "3s": 1 / 6, "avg": (0.25 + 0.125 + 1 / 6) / 3})
    # UniAD: the horizon's step. 1 s: step 2 -> (1 + 0) / 2; 2 s: step 4 -> 0; 3 s: step 6 -> (0 + 1) / 2.
    assert rates["uniad"] == pytest.approx({"1s": 0.5, "2s": 0.0, "3s": 0.5, "avg": 1 / 3})
    # Any collision up to the horizon.
    assert rates["any"] == pytest.approx({"1s": 0.5, "2s": 0.5, "3s": 1.0, "avg": 2 / 3})
    single = collision_rate(collision_at_steps(ego_along_x(), parked(15.0, 0.0)[None]))
    assert single["uniad"]["2s"] == 0.0 and single["any"]["2s"] == 1.0 and single["stp3"]["3s"] == pytest.approx(1 / 6)


def response(yes: set[str] = frozenset(), longitudinal: str = "keep", lateral: str = "lane_follow") -> DrivingResponse:
    return DrivingResponse(
        critical_objects={c: c in yes for c in CRITICAL_OBJECT_CLASSES},
        explanation="",
        future_meta_behavior=MetaBehavior(longitudinal=longitudinal, lateral=lateral),
        trajectory=[(float(k), 0.0) for k in range(1, 6)],
    )


def test_critical_object_scores_per_class_and_micro():
    truth = [
        response({"nearby_vehicle", "pedestrian", "construction"}),
        response({"nearby_vehicle", "construction"}),
        response({"construction"}),
    ]
    predicted = [
        response({"nearby_vehicle", "cyclist", "construction"}),
        response({"construction"}),
        response({"nearby_vehicle", "construction"}),
    ]
    scores = critical_object_scores(predicted, truth)
    # nearby_vehicle: truth yes, yes, no; predicted yes, no, yes -> tp 1, fp 1, fn 1.
    assert scores["nearby_vehicle"] == pytest.approx(
        {"precision": 0.5, "recall": 0.5, "f1": 0.5, "tp": 1, "fp": 1, "fn": 1}
    )
    # pedestrian: one true yes never predicted -> nothing predicted, so precision is undefined.
    assert scores["pedestrian"] == {"precision": None, "recall": 0.0, "f1": 0.0, "tp": 0, "fp": 0, "fn": 1}
    # cyclist: one false alarm, no true yes -> recall is undefined.
    assert scores["cyclist"] == {"precision": 0.0, "recall": None, "f1": 0.0, "tp": 0, "fp": 1, "fn": 0}
    assert scores["construction"] == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "tp": 3, "fp": 0, "fn": 0}
    assert scores["animal"] == {"precision": None, "recall": None, "f1": None, "tp": 0, "fp": 0, "fn": 0}
    # Micro: tp 1 + 3 = 4, fp 1 + 1 = 2, fn 1 + 1 = 2 -> 4/6 each.
    assert scores["micro"] == pytest.approx(
        {"precision": 2 / 3, "recall": 2 / 3, "f1": 2 / 3, "tp": 4, "fp": 2, "fn": 2}
    )
    assert critical_object_f1(predicted, truth) == pytest.approx(scores["micro"]["f1"])
    assert set(scores) == {*CRITICAL_OBJECT_CLASSES, "micro"}


def test_meta_confusion_counts():
    truth = [response(longitudinal=x) for x in ("keep", "keep", "stop", "decelerate")]
    predicted = [response(longitudinal=x) for x in ("keep", "stop", "stop", "keep")]
    labels, counts = meta_confusion(predicted, truth, "longitudinal")
    at = {label: i for i, label in enumerate(labels)}
    assert counts[at["keep"], at["keep"]] == 1
    assert counts[at["keep"], at["stop"]] == 1  # row = truth, column = prediction
    assert counts[at["stop"], at["stop"]] == 1
    assert counts[at["decelerate"], at["keep"]] == 1
    assert counts.sum() == 4
    assert np.trace(counts) / counts.sum() == meta_accuracy(predicted, truth)[0]
    lateral_labels, lateral = meta_confusion(predicted, truth, "lateral")
    assert lateral_labels == LATERAL_BEHAVIORS
    assert lateral[lateral_labels.index("lane_follow"), lateral_labels.index("lane_follow")] == 4
    with pytest.raises(ValueError, match="field"):
        meta_confusion(predicted, truth, "speed")


def test_json_validity_rate():
    assert json_validity_rate([True, False, True, True]) == 0.75
    assert json_validity_rate([False]) == 0.0
    with pytest.raises(ValueError):
        json_validity_rate([])


def test_jmt_of_a_constant_speed_straight_path_is_exactly_linear():
    from fastddrive.core.jmt import jmt_upsample

    t_s = np.arange(1, 6, dtype=float)[:, None]
    velocity_mps = np.array([[12.5, -0.8]])
    dense = jmt_upsample(t_s * velocity_mps)
    expected = 0.25 * np.arange(1, 21, dtype=float)[:, None] * velocity_mps
    assert dense.shape == (20, 2)
    assert np.allclose(dense, expected, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=10, max_size=10))
def test_jmt_passes_through_its_knots(values):
    from fastddrive.core.jmt import jmt_upsample

    waypoints = np.asarray(values).reshape(5, 2)
    dense = jmt_upsample(waypoints)
    assert np.allclose(dense[3::4], waypoints, atol=1e-9)  # t = 1, 2, 3, 4, 5 s
