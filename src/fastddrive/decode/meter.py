"""Counting forward calls (NFE) and timing the first one (the prefill), from outside the decoders."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fastddrive.engine.model import BlockDiffusionModel


@dataclass
class ForwardMeter:
    """Counts a model's forwards (every decode forward, prefill included) and the tokens fed to the forwards
    after the first (a batched forward counts once, with all its rows' tokens), and times the first one."""

    calls: int = 0
    fed_after_prefill: int = 0
    first_end: float | None = None

    @contextmanager
    def watch(self, model: BlockDiffusionModel) -> Iterator[None]:
        def after(tokens: int) -> None:
            self.calls += 1
            if self.first_end is not None:
                self.fed_after_prefill += tokens
            if self.first_end is None:
                synchronize(model.device)
                self.first_end = time.perf_counter()

        model.forward_hooks.append(after)
        try:
            yield
        finally:
            model.forward_hooks.remove(after)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall time means finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
