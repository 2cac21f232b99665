"""The text the planner reads: system prompt, navigation command and ego state (no images here).

The sample keeps the whole history (7 x 6); the prompt states what a planner needs of it in few tokens:
the velocity and acceleration now, and the positions 3, 2 and 1 s ago (ego frame at t = 0). Numbers
carry an explicit sign and one decimal (zero is +0.0). Image placeholders are expanded by the model, not here.
"""

from __future__ import annotations

import numpy as np

from fastddrive.core.sample import check_command, check_history

SYSTEM_PROMPT = "You are a driving planner. Answer in JSON."
VISION_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
PAST_ROWS = (0, 2, 4)  # history rows at t = -3, -2, -1 s


def _numbers(values: np.ndarray) -> str:
    # Rounded first, and a rounded zero written +0.0: the prompt must not hang on the sign of float noise (a
    # lateral speed of -1e-17 m/s in one source and +1e-17 in another, say, after a change of frames).
    return " ".join(f"{round(float(v), 1) + 0.0:+.1f}" for v in values)


def state_text(history: np.ndarray) -> str:
    """Velocity [m/s] and acceleration [m/s^2] now, and x y [m] at -3, -2, -1 s; ego frame at t = 0."""
    check_history(history)
    history = np.asarray(history, dtype=float)
    now = history[-1]
    past = history[list(PAST_ROWS), :2].ravel()
    return f"Velocity {_numbers(now[2:4])}. Acceleration {_numbers(now[4:6])}. Past positions {_numbers(past)}."


def user_text(command: str, history: np.ndarray) -> str:
    """The user turn: the command, then the ego state."""
    check_command(command)
    return f"Command: {command}. {state_text(history)}"


def chat_text(command: str, history: np.ndarray, images: int = 1) -> str:
    """The whole Qwen2.5-VL chat prompt up to the assistant's answer."""
    vision = VISION_PLACEHOLDER * images
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{vision}{user_text(command, history)}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
