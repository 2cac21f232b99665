"""AdamW for weights held in bfloat16, with float32 moments and stochastic rounding (issue 36).

A bf16 run that keeps float32 master weights (accelerate's mixed precision) holds 16 bytes per trained
parameter (weights, gradients, two moments) plus the bf16 copies autocast makes; holding the weights and
gradients themselves in bf16 drops that to 12. Rounding each updated weight to the nearest bf16 would lose
every update smaller than half a bf16 ulp (2^-9 of the weight: an lr of 1e-5 never moves anything), so the
update is computed in float32 and rounded stochastically, up with the probability of the remainder, which
keeps the expected weight equal to the float32 one (Zamirai et al., "Revisiting BFloat16 Training", 2020;
torchao's `bf16_stochastic_round`). The rounding noise of a parameter is drawn from a generator seeded with
(seed, step, parameter index, chunk), so a resumed run rounds exactly as the uninterrupted one did. The update
runs over chunks of CHUNK elements, so that its float32 temporaries stay small beside the moments.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

CHUNK = 1 << 22  # elements updated at once: the float32 temporaries of a 311M-row embedding would be gigabytes


def stochastic_round_to_bf16(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`value` (float32) rounded to bf16, up with the probability of the part below bf16's precision: random
    bits added to the 16 low bits of the float32 pattern, which are then cut off."""
    bits = value.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) over bf16 parameters, the moments in float32 (module doc). FSDP's
    sharded parameters (DTensors) are updated shard by shard: the update is elementwise."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        seed: int = 0,
    ) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps})
        self.seed = seed

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        index = 0
        for group in self.param_groups:
            hyper = (group["lr"], group["weight_decay"], *group["betas"], group["eps"])
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                if param.dtype != torch.bfloat16:
                    raise TypeError(f"BF16AdamW updates bfloat16 parameters, got {param.dtype}")
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = _float32_zeros_like(param)
                    state["exp_avg_sq"] = _float32_zeros_like(param)
                state["step"] += 1
                step = state["step"]
                flat = [_local(t).view(-1) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                for start in range(0, flat[0].numel(), CHUNK):  # float32 temporaries of one chunk at a time
                    key = np.random.SeedSequence([self.seed, step, index, start]).generate_state(2, dtype=np.uint64)
                    generator = torch.Generator(device=flat[0].device).manual_seed(int(key[0]) >> 1)
                    chunk = [t[start : start + CHUNK] for t in flat]
                    _adamw_update(*chunk, step, *hyper, generator)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts a loaded state to its parameter's dtype: the moments are put back in float32."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = dict(zip(saved_ids, chain.from_iterable(group["params"] for group in self.param_groups), strict=True))
        for index, saved in state_dict["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                self.state[params[index]][name] = saved[name].to(params[index].device, torch.float32, copy=True)


def _adamw_update(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
    eps: float,
    generator: torch.Generator,
) -> None:
    """One AdamW step of bf16 `weight` in place, computed in float32 (Loshchilov and Hutter's decoupled decay)."""
    grad32 = grad.float()
    exp_avg.lerp_(grad32, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad32, grad32, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    updated = weight.float().mul_(1 - lr * weight_decay)
    updated.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
    weight.copy_(stochastic_round_to_bf16(updated, generator))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's values held by this process: its shard under FSDP (sharing its storage), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _float32_zeros_like(param: torch.Tensor) -> torch.Tensor:
    """Float32 zeros shaped and sharded as `param` (a DTensor's on its own mesh, so that FSDP gathers them)."""
    zeros = torch.zeros_like(_local(param), dtype=torch.float32)
    if isinstance(param, DTensor):
        return DTensor.from_local(
            zeros, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return zeros
