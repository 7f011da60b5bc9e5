"""A model's full weights out of its (possibly ZeRO-3 sharded) engine: parameter by parameter, as a
state dict, as checksums, or exported in Hugging Face format.

Under ZeRO-3 reading a full parameter is a collective gather: every rank of the group must make
the same calls, in the same order (ModelGroup.call does), even where only rank 0 keeps the result.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from .engine import Model, ValueModel


def named_full_parameters(model: Model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) per parameter, gathered from the ZeRO-3 shards; every rank must iterate."""
    import deepspeed

    for name, param in model.engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=model.zero3):
            yield name, param.data.to(dtype or param.dtype)


def full_shapes(model: Model) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) per parameter, in named_full_parameters' order, without a gather: a
    ZeRO-3 shard keeps its parameter's full shape as `ds_shape`."""
    return [(name, tuple(getattr(param, "ds_shape", param.shape)))
            for name, param in model.engine.module.named_parameters()]


def state_dict(model: Model, dtype: torch.dtype | None = None) -> dict[str, Tensor] | None:
    """The full weights on rank 0 (CPU tensors in Hugging Face names); None on the other ranks."""
    weights = {}
    for name, tensor in named_full_parameters(model, dtype):
        if model.rank == 0:
            weights[name] = tensor.detach().to("cpu", copy=True)
    return weights if model.rank == 0 else None


def checksums(model: Model) -> dict[str, float]:
    """Sum of each full parameter as this rank sees it after the gather: equal on every rank of a healthy group."""
    return {name: tensor.double().sum().item() for name, tensor in named_full_parameters(model)}


def save_pretrained(model: Model, directory: str) -> None:
    """Export in Hugging Face format (rank 0 writes; every rank takes part in the gather)."""
    weights = state_dict(model)
    if model.rank == 0:
        module = model.engine.module
        if isinstance(module, ValueModel):  # a sequence classifier under its own names
            module = module.classifier
            weights = {name.removeprefix("classifier."): tensor for name, tensor in weights.items()}
        module.save_pretrained(directory, state_dict=weights)
        model.tokenizer.save_pretrained(directory)
