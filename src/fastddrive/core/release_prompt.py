"""The official release's prompt (issue 34): one user turn through Qwen2.5-VL's chat template with Qwen's default
system prompt, the fixed WOD-E2E instruction text (byte for byte as the release: dVLM-AD eval/inference.py,
convert_wod_e2e.py PROMPT_PREFIX) with the navigation command and the ego state filled in, and its single
`<image>` replaced by the cameras as separate images (the release's FRONT_LEFT, FRONT, FRONT_RIGHT). A model
folder selects it with `fastddrive.json` `"prompt": "release"` (`fastddrive import-official` writes it).
"""

from __future__ import annotations

import numpy as np

from fastddrive.core.sample import HISTORY_INTERVAL_S, HISTORY_STEPS, check_command, check_history

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."  # what Qwen2.5-VL's chat template adds without one
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_MARK = "<image>"
INTENTS = {"go_straight": "GO_STRAIGHT", "go_left": "GO_LEFT", "go_right": "GO_RIGHT"}
HISTORY_LABELS = tuple(f"{(k - HISTORY_STEPS + 1) * HISTORY_INTERVAL_S:+.1f}" for k in range(HISTORY_STEPS))
PROMPT = (
    "You are an expert autonomous driving agent.\n"
    "Task 1: Critical Object Detection\n"
    'For each class below, answer "yes" or "no" to indicate whether it affects the ego '
    "vehicle’s behavior or future trajectory:\n"
    "[nearby_vehicle, pedestrian, cyclist, construction, traffic_element, weather_condition, "
    "road_hazard, emergency_vehicle, animal, special_vehicle, conflicting_vehicle, door_opening_vehicle]\n"
    "Task 2: Scene Reasoning\n"
    "Predict the future behavior of the identified critical objects and explain how the identified critical "
    "objects or conditions affect the ego vehicle’s next 3-second trajectory.\n"
    "Task 3: Meta-Behavior Prediction\n"
    "Predict the ego vehicle’s future meta-driving behavior:\n"
    "- speed ∈ {keep, accelerate, decelerate, stop, other}\n"
    "- command ∈ {straight, yield, left_turn, right_turn, lane_follow, lane_change_left, lane_change_right, "
    "reverse, overtake, other}\n"
    "Task 4: Trajectory Prediction\n"
    "Predict the optimal 5-second future trajectory (5 waypoints, 1 s intervals).\n\n"
    "Input:\n"
    "- <image>: three front-view frames from left front, center front, right front cameras. \n"
    "- High-level navigation command: {NAV}\n"
    "- Historical ego state: Provided are the previous ego vehicle status recorded over the last 3.0 seconds "
    "(at 0.5-second intervals).{HIST}\n\n"
    "Output:"
)


def prompt_text(command: str, history: np.ndarray) -> str:
    """The release's human turn for a navigation command and a (7, 6) ego history (its `<image>` kept)."""
    check_command(command)
    check_history(history)
    states = "; ".join(
        f"(t{label}s) [{x:.2f}, {y:.2f}], Acceleration: X {ax:.2f}, Y {ay:.2f} m/s², "
        f"Velocity: X {vx:.2f}, Y {vy:.2f} m/s,"
        for label, (x, y, vx, vy, ax, ay) in zip(HISTORY_LABELS, np.asarray(history, dtype=float), strict=True)
    )
    return PROMPT.replace("{NAV}", INTENTS[command]).replace("{HIST}", states)


def release_chat_text(command: str, history: np.ndarray, images: int = 3) -> str:
    """The whole chat prompt up to the assistant's answer, as Qwen2.5-VL's chat template renders the release's
    user turn (its content: the text before `<image>`, `images` images, the text after)."""
    before, after = prompt_text(command, history).split(IMAGE_MARK, 1)
    return (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{before}{VISION_PLACEHOLDER * images}{after}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
