"""FSDP full sharding of a training run (issue 36): each process holds 1/N of the weights, gradients and
optimizer states, and gathers one block's weights at a time for its forward and backward.

The engine is PyTorch's FSDP2 (`fully_shard`), wrapped as accelerate's FSDP2 plugin wraps a transformers model
(one unit per entry of `_no_split_modules`: every decoder layer and every vision block, then the whole model).
It is applied here rather than through accelerate's plugin because accelerate enables FSDP only for GPU process
groups, and the same command must shard the gloo processes of a CPU run (the tests) as the NCCL ones of a GPU
node. FSDP rather than DeepSpeed ZeRO: no extra dependency or compiled ops, and the same DTensor state runs on
both. Gradients are averaged over the processes, as DDP's are, so the loss scaling of data parallelism holds.

A checkpoint holds the full state, gathered on save: the model as a plain model folder, the optimizer state in
the layout of an unsharded run. A run resumes by loading it and sharding it again, so a checkpoint of 8
processes resumes on 8, on 16 or on one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on the main process only


def shard_model(model: torch.nn.Module, processes: int, device: torch.device) -> None:
    """Shard `model` in place over the `processes` of the process group: one FSDP unit per block (module doc)."""
    mesh = init_device_mesh(device.type, (processes,))
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


@contextmanager
def full_weights(model: torch.nn.Module) -> Iterator[None]:
    """Every unit's weights gathered for the duration: the cached decoders (validation's greedy ADE) call the
    model's parts one by one, outside the forward that gathers them."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def gathered_model(model: PreTrainedModel, dtype: torch.dtype | None = None) -> PreTrainedModel | None:
    """A plain (unsharded) copy of a sharded model on the main process's CPU, None elsewhere; every process must
    call it. Built on the meta device and given the gathered tensors, so the weights are held once; buffers
    that are not saved (rotary frequencies) stay unset: it is a copy to save, not to run."""
    weights = get_model_state_dict(model, options=GATHERED)
    if not weights:  # not the main process
        return None
    plain = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # FSDP2 subclasses the model
    with torch.device("meta"):
        copy = plain._from_config(model.config)
    copy.load_state_dict(weights, assign=True)
    copy.tie_weights()
    return copy.to(dtype) if dtype is not None else copy


def trained_names(model: torch.nn.Module) -> list[str]:
    """The names of the trained parameters, in the optimizer's order (the order of `model.parameters()`)."""
    return [name for name, param in model.named_parameters() if param.requires_grad]


def gathered_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state on the main process, in an unsharded optimizer's layout (parameters numbered
    in order); every process must call it."""
    state = get_optimizer_state_dict(model, optimizer, options=GATHERED)
    if not state:  # not the main process
        return {}
    number = {name: i for i, name in enumerate(trained_names(model))}
    groups = [{**group, "params": [number[name] for name in group["params"]]} for group in state["param_groups"]]
    return {"state": {number[name]: entries for name, entries in state["state"].items()}, "param_groups": groups}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A checkpoint's full optimizer state (`gathered_optimizer_state`'s layout) sharded into `optimizer`."""
    names = trained_names(model)
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
    named = {"state": {names[int(i)]: entries for i, entries in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated result of sharded tensors (the gradient norm) as a plain tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
