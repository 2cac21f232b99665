"""Staged highway situations: the expert alone with a few slow cars placed ahead."""

from highway_env.vehicle.behavior import IDMVehicle


def _place(expert, lane_id: int, ahead: dict[int, tuple[float, float]]):
    """Put the expert on `lane_id` of the straight highway, alone but for slow cars {lane: (gap m, speed)}."""
    road = expert.road
    lane_index = ("0", "1", lane_id)
    lane = road.network.get_lane(lane_index)
    s, _ = lane.local_coordinates(expert.position)
    expert.position = lane.position(s, 0.0)
    expert.heading = lane.heading_at(s)
    expert.lane_index = expert.target_lane_index = lane_index
    expert.lane = lane
    expert.speed, expert.target_speed = 25.0, 30.0
    road.vehicles = [expert]
    for other_lane, (gap, speed) in ahead.items():
        other = road.network.get_lane(("0", "1", other_lane))
        car = IDMVehicle(road, other.position(s + gap, 0.0), other.heading_at(s + gap), speed, target_speed=speed)
        car.enable_lane_change = False
        road.vehicles.append(car)


def slow_car_ahead_in_right_lane(env, expert):
    """A slow car far ahead in the rightmost lane, the lane to its left free: MOBIL passes on the left."""
    _place(expert, 2, {2: (550.0, 12.0)})  # far enough that MOBIL acts after 3 s


def slow_wall_ahead(env, expert):
    """Slow cars across every lane: the only answer is to brake."""
    _place(expert, 1, {0: (90.0, 10.0), 1: (90.0, 10.0), 2: (90.0, 10.0)})
