"""A model's full weights out of its (possibly ZeRO-3 sharded) engine: parameter by parameter, as a
state dict, as checksums, or exported in Hugging Face format.

Under ZeRO-3 reading a full parameter is a collective gather: every rank of the group must make
the same calls, in the same order (ModelGroup.call does), even where only rank 0 keeps the result.

A LoRA model (workers/lora.py) is read two ways: its own parameters (adapters included, under
peft's names: checksums), or as the base model with the adapters merged in, under the base
model's names (lora.merged_entries: the weight sync, the merged export).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from .engine import Model, ValueModel
from .lora import merged_entries
from . import tensor_parallel
from .transfer_plan import bucket_ranges


def named_full_parameters(model: Model, dtype: torch.dtype | None = None,
                          trained_only: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) per parameter of the engine's module (only those with gradients when
    trained_only), gathered from the ZeRO-3 shards; every rank must iterate."""
    for name, param in model.engine.module.named_parameters():
        if trained_only and not param.requires_grad:
            continue
        with full_parameters(model, [param]):
            yield name, param.data.to(dtype or param.dtype)


def named_merged_parameters(model: Model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(base model's name, full tensor) per weight of the model as Hugging Face and vLLM load it:
    LoRA adapters merged into their layers (each layer and its adapters gathered together); every
    rank must iterate."""
    for bucket in merged_buckets(model, dtype, bucket_bytes=0):
        yield from bucket


def merged_buckets(model: Model, dtype: torch.dtype | None, bucket_bytes: int,
                   synced: bool = False) -> Iterator[list[tuple[str, Tensor]]]:
    """named_merged_parameters' weights (synced: those the weight sync sends, synced_entries), consecutive
    ones together up to bucket_bytes in `dtype` (transfer_plan.bucket_ranges), each bucket's parameters
    gathered at once: one ZeRO-3 gather per bucket instead of one per weight. A bucket is valid until the
    next one is asked for; every rank must iterate."""
    entries = synced_entries(model) if synced else merged_entries(model.engine.module)
    sizes = [math.prod(shape) * (dtype or params[0].dtype).itemsize for _, shape, params, _ in entries]
    for bucket in bucket_ranges(sizes, bucket_bytes):
        params = list({id(p): p for _, _, entry_params, _ in entries[bucket.start:bucket.stop]
                       for p in entry_params}.values())
        with full_parameters(model, params):
            yield [(name, compute().to(dtype) if dtype else compute())
                   for name, _, _, compute in entries[bucket.start:bucket.stop]]


def full_parameters(model: Model, params: list, modifier_rank: int | None = None):
    """Within, `params` hold their full tensors: gathered from ZeRO-3's shards over the group (rank modifier_rank's
    changes kept), or from AutoTP's over each split (every rank's changes kept in its own shard: the ranks of a
    split make the same). Every rank must enter with the same parameters."""
    import deepspeed

    if model.engine.autotp_size() > 1:
        return tensor_parallel.gathered(params)
    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank, enabled=model.zero3)


def synced_entries(model: Model) -> list:
    """The merged weights the weight sync sends: all but a frozen vision tower's (training.freezeVisionTower),
    which the engines loaded from the same checkpoint and which never changes."""
    return [entry for entry in merged_entries(model.engine.module) if entry[0] not in model.frozen_tower]


def full_shapes(model: Model) -> list[tuple[str, tuple[int, ...]]]:
    """(name, full shape) per weight the weight sync sends, in its order, without a gather."""
    return [(name, shape) for name, shape, _, _ in synced_entries(model)]


def state_dict(model: Model, dtype: torch.dtype | None = None) -> dict[str, Tensor] | None:
    """The full merged weights on rank 0 (CPU tensors in Hugging Face names); None on the other ranks."""
    weights = {}
    for name, tensor in named_merged_parameters(model, dtype):
        if model.rank == 0:
            weights[name] = tensor.detach().to("cpu", copy=True)
    return weights if model.rank == 0 else None


def blend(model: Model, weights: dict[str, Tensor], alpha: float) -> None:
    """Move every parameter to alpha * weights[name] + (1 - alpha) * itself (a reference refreshed from the
    policy's state_dict, Hugging Face names); under ZeRO-3 rank 0's result goes to every shard. Every rank
    must call it, each with the whole dict."""
    module = model.engine.module
    missing = sorted(set(name for name, _ in module.named_parameters()) - weights.keys())
    if missing:
        raise ValueError(f"training.referenceRefresh: the policy has no weight {missing[0]} (and {len(missing) - 1} "
                         "more) of the reference's; a refresh copies the policy's weights into the reference, so "
                         "models.reference must be the actor's architecture")
    for name, param in module.named_parameters():
        with full_parameters(model, [param], modifier_rank=0):
            param.data.lerp_(weights[name].to(param.device, param.dtype), alpha)


def checksums(model: Model) -> dict[str, float]:
    """Sum of each full parameter as this rank sees it after the gather: equal on every rank of a healthy group."""
    return {name: tensor.double().sum().item() for name, tensor in named_full_parameters(model)}


def save_pretrained(model: Model, directory: str) -> None:
    """Export in Hugging Face format (rank 0 writes; every rank takes part in the gathers). A LoRA
    model is exported as its adapter (peft's format, loaded with PeftModel.from_pretrained onto the
    base), and with lora.exportMerged also merged, to directory/merged."""
    lora = model.cfg.model.lora if model.peft is not None else None
    if lora is not None:
        _save_adapter(model, directory)
    if lora is None or lora.export_merged:
        _save_merged(model, directory if lora is None else str(Path(directory) / "merged"))


def _save_merged(model: Model, directory: str) -> None:
    weights = state_dict(model)
    if model.rank == 0:
        module = model.engine.module
        if isinstance(module, ValueModel):  # a sequence classifier under its own names
            module = module.classifier
            weights = {name.removeprefix("classifier."): tensor for name, tensor in weights.items()}
        module.save_pretrained(directory, state_dict=weights)
        model.tokenizer.save_pretrained(directory)


def _save_adapter(model: Model, directory: str) -> None:
    """The trained parameters (adapters, and a classifier's score head) in peft's format."""
    trained = {}
    for name, tensor in named_full_parameters(model, trained_only=True):
        if model.rank == 0:
            trained["base_model.model." + name.removeprefix("classifier.")] = tensor.detach().to("cpu", copy=True)
    if model.rank == 0:
        model.peft.save_pretrained(directory, state_dict=trained)
        model.tokenizer.save_pretrained(directory)
