"""What the official nuscenes-devkit reads from a nuScenes folder, as JSON, for `test_nuscenes_devkit.py`.

Run with an interpreter that has nuscenes-devkit (it pins numpy<2, so not this project's environment):
    python nuscenes_devkit_check.py DATAROOT VERSION OUT.json
Per key frame that has 3 s of past and 3 s of future key frames (the ones a planning sample can use): the
6 future LIDAR_TOP positions in the LIDAR_TOP frame at t = 0 and the command exactly as VAD's converter
(tools/data_converter/vad_nuscenes_converter.py) computes them; the annotation boxes the devkit gives at
that key frame and at the first lidar sweep after it (`get_sample_data`, which interpolates between key
frames), in the same frame; the CAN bus `pose` message at the key frame's time. Also renders the front camera
with its boxes, the devkit's own check that images, calibrations and boxes fit together, and checks that every
sample carries CAM_FRONT and that the boxes the devkit projects onto a drawn key frame land on the drawn agents.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
from nuscenes.can_bus.can_bus_api import NuScenesCanBus  # noqa: E402
from nuscenes.nuscenes import NuScenes  # noqa: E402
from nuscenes.utils.geometry_utils import BoxVisibility, transform_matrix, view_points  # noqa: E402
from PIL import Image  # noqa: E402
from pyquaternion import Quaternion  # noqa: E402

DRAWN_GROUND_RGB = (96, 96, 96)  # data/nuscenes.py: the ground of a drawn key frame
AGENT_RGB = (40, 80, 200)  # and its agents


def lidar_global_pose(nusc: NuScenes, lidar_token: str) -> np.ndarray:
    """VAD get_global_sensor_pose: the pose of a LIDAR_TOP sample_data in the global frame."""
    record = nusc.get("sample_data", lidar_token)
    ego = nusc.get("ego_pose", record["ego_pose_token"])
    sensor = nusc.get("calibrated_sensor", record["calibrated_sensor_token"])
    ego_matrix = transform_matrix(ego["translation"], Quaternion(ego["rotation"]))
    return ego_matrix @ transform_matrix(sensor["translation"], Quaternion(sensor["rotation"]))


def vad_future(nusc: NuScenes, sample: dict) -> tuple[np.ndarray, str]:
    """VAD's ego_fut_trajs (6 future key frames, LIDAR_TOP frame at t = 0) and its command."""
    record = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
    ego = nusc.get("ego_pose", record["ego_pose_token"])
    sensor = nusc.get("calibrated_sensor", record["calibrated_sensor_token"])
    points, current = [], sample
    for _ in range(6):
        current = nusc.get("sample", current["next"])
        points.append(lidar_global_pose(nusc, current["data"]["LIDAR_TOP"])[:3, 3])
    future = np.array(points) - np.array(ego["translation"])
    future = (Quaternion(ego["rotation"]).inverse.rotation_matrix @ future.T).T
    future = future - np.array(sensor["translation"])
    future = (Quaternion(sensor["rotation"]).inverse.rotation_matrix @ future.T).T
    command = "go_right" if future[-1, 0] >= 2 else "go_left" if future[-1, 0] <= -2 else "go_straight"
    return future[:, :2], command


def boxes_in_frame(nusc: NuScenes, lidar_token: str, reference_token: str) -> list[list[float]]:
    """Box centres (x, y) of a lidar sample_data, moved from its own LIDAR_TOP frame to the reference one's."""
    _, boxes, _ = nusc.get_sample_data(lidar_token)
    to_global = lidar_global_pose(nusc, lidar_token)
    to_reference = np.linalg.inv(lidar_global_pose(nusc, reference_token))
    moved = to_reference @ to_global
    return [(moved @ np.append(box.center, 1.0))[:2].tolist() for box in boxes]


def main(dataroot: str, version: str, out: str) -> None:
    nusc = NuScenes(version=version, dataroot=dataroot, verbose=False)
    can = NuScenesCanBus(dataroot=dataroot)
    checked = {}
    for sample in nusc.sample:
        back, ahead, current = 0, 0, sample
        while current["prev"] and back < 6:
            current, back = nusc.get("sample", current["prev"]), back + 1
        current = sample
        while current["next"] and ahead < 6:
            current, ahead = nusc.get("sample", current["next"]), ahead + 1
        if back < 6 or ahead < 6:
            continue
        future, command = vad_future(nusc, sample)
        lidar = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
        scene = nusc.get("scene", sample["scene_token"])
        poses = [m for m in can.get_messages(scene["name"], "pose") if m["utime"] == sample["timestamp"]]
        checked[sample["token"]] = {
            "future": future.tolist(),
            "command": command,
            "boxes": boxes_in_frame(nusc, lidar["token"], lidar["token"]),
            "sweep_boxes": boxes_in_frame(nusc, lidar["next"], lidar["token"]),
            "sweep_is_key_frame": nusc.get("sample_data", lidar["next"])["is_key_frame"],
            "can_velocity": poses[0]["vel"][:2] if poses else None,
        }
    cameras = {"samples": len(nusc.sample), "with_cam_front": 0, "boxes_seen": 0, "boxes_on_drawn_agents": 0}
    for sample in nusc.sample:  # every sample carries the camera it claims, and its boxes project onto it
        if "CAM_FRONT" not in sample["data"]:
            continue
        cameras["with_cam_front"] += 1
        path, boxes, intrinsic = nusc.get_sample_data(sample["data"]["CAM_FRONT"], box_vis_level=BoxVisibility.ANY)
        image = np.asarray(Image.open(path).convert("RGB"))
        drawn = bool((image == DRAWN_GROUND_RGB).all(axis=-1).mean() > 0.5)  # a drawn key frame
        for box in boxes:
            u, v = view_points(box.center[:, None], intrinsic, normalize=True)[:2, 0]
            if not (0 <= u < image.shape[1] and 0 <= v < image.shape[0]):
                continue
            cameras["boxes_seen"] += int(drawn)
            rgb = image[int(v), int(u)].astype(int)
            cameras["boxes_on_drawn_agents"] += bool(drawn and np.abs(rgb - AGENT_RGB).max() < 40)
    first = nusc.get("sample", next(iter(checked)))
    rendered = out.removesuffix(".json") + ".png"
    nusc.render_sample_data(first["data"]["CAM_FRONT"], out_path=rendered, verbose=False)
    with open(out, "w") as file:
        json.dump({"samples": checked, "scenes": len(nusc.scene), "rendered": rendered, "cameras": cameras}, file)


if __name__ == "__main__":
    main(*sys.argv[1:4])
