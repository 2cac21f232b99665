"""Counting forward calls (NFE) and timing the first one (the prefill), from outside the decoders."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class ForwardMeter:
    """Counts forward calls of a module and times the first one (the prefill)."""

    calls: int = 0
    first_end: float | None = None

    @contextmanager
    def watch(self, module: torch.nn.Module) -> Iterator[None]:
        def after(*_: object) -> None:
            self.calls += 1
            if self.first_end is None:
                synchronize(module)
                self.first_end = time.perf_counter()

        handle = module.register_forward_hook(after)
        try:
            yield
        finally:
            handle.remove()


def synchronize(module: torch.nn.Module) -> None:
    device = next(module.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
