"""Data parallel across processes with accelerate: each process takes a contiguous share, the shares are
gathered once, in process order, so that the merged list is the one a single process makes.

Run any command that uses these under `accelerate launch --multi_gpu --num_processes N` (on a machine without
GPUs the processes talk over gloo; `--cpu --num_processes N` starts one process); run plainly, there is one
process and the share is everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from accelerate import PartialState
from accelerate.utils import gather_object

T = TypeVar("T")


def state() -> PartialState:
    """The launch's processes; on a machine without GPUs, over gloo (a plain PartialState would see only itself)."""
    import torch

    return PartialState(cpu=not torch.cuda.is_available())


def share(items: Sequence[T]) -> list[T]:
    """This process's contiguous share of `items` (the first processes take one more when it does not divide)."""
    with state().split_between_processes(list(items)) as mine:
        return list(mine)


def gather(mine: list[T]) -> list[T]:
    """Every process's share, concatenated in process order (every process gets the whole list)."""
    return list(gather_object(mine))


def process_index() -> int:
    return state().process_index


def is_main_process() -> bool:
    return state().is_main_process


def device_of_process(device: str) -> str:
    """A bare 'cuda' under a multi-process launch means this process's own GPU."""
    launch = state()
    return str(launch.device) if device == "cuda" and launch.num_processes > 1 else device
