"""How much memory a command may plan to allocate, and the refusal of a request above it before any work.

The budget is a share of the machine's memory (half by default; the least of the physical memory and the
process's cgroup limit), or of a GPU's memory for work on a GPU. `FASTDDRIVE_MEMORY_BUDGET` (and the
command line's `--memory-budget`, which sets it) takes a share ("0.25") or an amount ("8GiB", "512MB").
An estimate above the budget is a MemoryBudgetError naming the option that made it grow, the estimate and
the budget, in one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

BUDGET_ENV = "FASTDDRIVE_MEMORY_BUDGET"
DEFAULT_SHARE = 0.5
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMOUNT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*", re.IGNORECASE)
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


class MemoryBudgetError(ValueError):
    """An allocation a command would make is above the memory budget, or the budget itself is malformed."""


def machine_memory_bytes() -> int:
    """The memory this process may use: the physical memory, or the cgroup's limit where it is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in _CGROUP_LIMITS:
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def device_memory_bytes(device: object = "cpu") -> int:
    """The memory of `device`: a GPU's own memory, else the machine's (`machine_memory_bytes`)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return machine_memory_bytes()


def parse_budget(text: str, total_bytes: int) -> int:
    """A budget given as a share of `total_bytes` ("0.25", in (0, 1]) or as an amount ("8GiB", "512MB")."""
    match = _AMOUNT.fullmatch(text)
    if match is None:
        raise MemoryBudgetError(f"memory budget {text!r}: give a share of the memory (0.5) or an amount (8GiB)")
    number, unit = float(match[1]), (match[2] or "").lower()
    if not unit:
        if not 0 < number <= 1:
            raise MemoryBudgetError(f"memory budget {text!r}: a share of the memory is in (0, 1]")
        return int(number * total_bytes)
    if number <= 0:
        raise MemoryBudgetError(f"memory budget {text!r}: an amount is more than 0 bytes")
    return int(number * _UNITS[unit])


def memory_budget_bytes(device: object = "cpu") -> int:
    """The budget for work on `device`: FASTDDRIVE_MEMORY_BUDGET, else half of the device's memory."""
    total = device_memory_bytes(device)
    given = os.environ.get(BUDGET_ENV, "").strip()
    return parse_budget(given, total) if given else int(DEFAULT_SHARE * total)


def human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def check_allocation(what: str, estimate_bytes: float, device: object = "cpu") -> None:
    """MemoryBudgetError when `what` (the option and value that make the allocation grow, as the user gave
    them: "tts option rollouts=100000") would allocate more than the budget for `device`."""
    budget = memory_budget_bytes(device)
    if estimate_bytes > budget:
        raise MemoryBudgetError(
            f"{what} would allocate about {human_bytes(estimate_bytes)}, over the memory budget of "
            f"{human_bytes(budget)}; lower it, or raise the budget with --memory-budget or {BUDGET_ENV}"
        )
