"""The text the planner reads: system prompt, navigation command and ego history (no images here).

Numbers are written with an explicit sign and one decimal so that every history row has the same
token layout; image placeholders are expanded by the model's processor, not here.
"""

from __future__ import annotations

import numpy as np

from fastddrive.data.sample import check_command, check_history

SYSTEM_PROMPT = (
    "You are a driving planner. Given the camera view, the ego history and the navigation command, "
    "answer in JSON with the critical objects, an explanation, the future meta behavior and the "
    "trajectory: 5 waypoints at 1 s in the ego frame (+x forward, +y left, metres)."
)
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def history_text(history: np.ndarray) -> str:
    """History rows t = -3.0..0.0 s: x y [m], vx vy [m/s], ax ay [m/s^2], ego frame at t = 0."""
    check_history(history)
    rows = (" ".join(f"{v:+.1f}" for v in row) for row in np.asarray(history, dtype=float))
    return "\n".join(rows)


def user_text(command: str, history: np.ndarray) -> str:
    """The user turn: the command, then the history table."""
    check_command(command)
    return (
        f"Command: {command}.\n"
        "Ego history, t = -3.0 to 0.0 s every 0.5 s, columns x y vx vy ax ay:\n"
        f"{history_text(history)}"
    )


def chat_text(command: str, history: np.ndarray, images: int = 1) -> str:
    """The whole Qwen2.5-VL chat prompt up to the assistant's answer."""
    vision = VISION_PLACEHOLDER * images
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{vision}{user_text(command, history)}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
