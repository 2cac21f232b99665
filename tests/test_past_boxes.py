"""The other cars' past boxes drawn into the frames (data/past_boxes.py): what they show and what they leave."""

import numpy as np
import pytest

from fastddrive.data.highway import VehicleState
from fastddrive.data.past_boxes import PAST_BOX_AGES_S, PAST_BOX_RGB, draw_past_boxes

PPM, EGO_PX = 5.0, (100.0, 50.0)
ROAD = 100  # the grey of an empty frame


def car(x_m: float, y_m: float = 0.0, speed: float = 0.0) -> VehicleState:
    return VehicleState(np.array([x_m, y_m]), 0.0, speed, np.array([speed, 0.0]), False, (5.0, 2.0))


def drawn(ego_speed: float, other_speed: float, other_ahead_m: float = 30.0) -> np.ndarray:
    """A 400 x 100 frame of the ego and one car `other_ahead_m` ahead of it now, both driving along +x."""
    ego_now, other_now = car(100.0, speed=ego_speed), car(100.0 + other_ahead_m, speed=other_speed)
    past = [
        (car(100.0 - ego_speed * age, speed=ego_speed), {7: car(other_now.position[0] - other_speed * age)})
        for age in PAST_BOX_AGES_S
    ]
    frame = np.full((100, 400, 3), ROAD, dtype=np.uint8)
    return draw_past_boxes(frame, ego_now, {7: other_now}, past, PPM, EGO_PX)


def tinted_columns(frame: np.ndarray) -> np.ndarray:
    """Columns holding a pixel pulled towards the past boxes' colour."""
    tint = (frame[..., 0].astype(int) > ROAD) & (frame[..., 2].astype(int) < ROAD)
    return np.flatnonzero(tint.any(axis=0))


def test_a_car_stopped_ahead_of_a_moving_ego_leaves_its_past_boxes_ahead_of_it():
    frame = drawn(ego_speed=20.0, other_speed=0.0)
    columns = tinted_columns(frame)
    now_front_px = EGO_PX[0] + (30.0 + 2.5) * PPM
    # 0.5 s and 1 s ago it was 10 m and 20 m further from the ego: boxes ahead of where it is now, none behind.
    assert columns.size and columns.min() >= now_front_px - 1
    assert columns.max() == pytest.approx(EGO_PX[0] + (50.0 + 2.5) * PPM, abs=1)
    # Older is fainter.
    row = frame[int(EGO_PX[1])]
    newer, older = row[int(EGO_PX[0] + 40.0 * PPM)], row[int(EGO_PX[0] + 50.0 * PPM) - 2]
    assert newer[0] > older[0] > ROAD and tuple(PAST_BOX_RGB)[0] > newer[0]


def test_a_car_keeping_its_distance_leaves_nothing_and_one_pulling_away_leaves_its_boxes_behind():
    assert np.all(drawn(ego_speed=20.0, other_speed=20.0) == ROAD)
    columns = tinted_columns(drawn(ego_speed=20.0, other_speed=30.0))
    assert columns.size and columns.max() <= EGO_PX[0] + (30.0 - 2.5) * PPM + 1


def test_the_cars_as_they_are_now_stay_on_top():
    ego_now, other_now = car(100.0, speed=20.0), car(130.0)
    # A past box that falls on the car now (and on the ego) is not drawn over either.
    past = [(car(100.0), {7: car(130.0 + 1.0), 8: car(101.0)}) for _ in PAST_BOX_AGES_S]
    frame = np.full((100, 400, 3), ROAD, dtype=np.uint8)
    out = draw_past_boxes(frame, ego_now, {7: other_now, 8: car(180.0)}, past, PPM, EGO_PX)
    inside_car = out[48:52, int(EGO_PX[0] + 28 * PPM) : int(EGO_PX[0] + 32 * PPM)]
    inside_ego = out[48:52, int(EGO_PX[0] - 2 * PPM) : int(EGO_PX[0] + 2 * PPM)]
    assert np.all(inside_car == ROAD) and np.all(inside_ego == ROAD)
    assert tinted_columns(out).size  # the part of car 7's past box clear of the car now is drawn


def test_a_car_not_there_now_or_then_has_no_past_box():
    ego_now = car(100.0, speed=20.0)
    past = [(car(100.0 - 20.0 * age), {9: car(150.0)}) for age in PAST_BOX_AGES_S]
    frame = np.full((100, 400, 3), ROAD, dtype=np.uint8)
    assert np.all(draw_past_boxes(frame, ego_now, {7: car(130.0)}, past, PPM, EGO_PX) == ROAD)
