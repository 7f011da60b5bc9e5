"""Tensor-parallel training (training.tensorParallel) through DeepSpeed's AutoTP, for the actor and the critic.

DeepSpeed does the splitting: given `tensor_parallel.autotp_size` N, `deepspeed.initialize` replaces each
attention and MLP linear layer by a sharded one (q/k/v, gate and up split by output rows, o_proj and down_proj by
input columns and all-reduced), and lays the group's ranks out as a (data-parallel x tensor-parallel) mesh of
consecutive ranks: ranks 0..N-1 split one copy of the model, N..2N-1 the next. What the trainer adds, here:

- the config (`autotp_config`): the output head kept whole, so that every rank holds the logits of the whole
  vocabulary (the log-probs, entropy and KL read them); DeepSpeed otherwise splits a tied head over the vocabulary
  and expects its own loss;
- the batch: the N ranks of a split read the same rows (`same_rows`), so the group deals its rows to ranks / N
  data-parallel ranks and reads each split's output from its first rank (`one_per_split`);
- the gradient norm of a split model (`grad_norm`): a shard's squares summed over the split, a whole parameter
  counted once, as DeepSpeed clips;
- the full weights (`gathered`, `full_shape`): each sharded layer's weight and bias all-gathered over its split
  and split again afterwards (DeepSpeed's GatherReplacedLayerParams, one layer at a time: its gather reads the
  layer's own split), for the weight sync, the exports and the reference refresh.

The reference, reward and teacher models stay whole on each of their ranks: they hold weights only, no gradients or
optimizer state (2 bytes a parameter in 16 bits, against the trained models' 16), and their forward passes then
run without a collective per layer. LoRA is refused (AutoTP drops peft's adapters) and so is ZeRO-3 (API rules).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterable, Iterator, Sequence, TypeVar

import torch
from torch import nn

from rlhf_api.planning.memory import TRAINED_WITH_AUTOTP, split_size  # noqa: F401 - the trainer's names for them

# Where DeepSpeed's AutoTP keeps a sharded parameter's full shape (its universal-checkpoint metadata), and the
# flag it sets on every parameter it shards.
_UC_META, _SHARDED = "ds_autotp_universal_checkpoint_meta", "ds_is_replaced_module"

T = TypeVar("T")


def autotp_config(size: int) -> dict:
    """The DeepSpeed config entries of a model split over `size` ranks (update the role's config with them)."""
    return {"tensor_parallel": {"autotp_size": size, "vocab_parallel_lm_head": False}}


def accumulation_batch(train_batch_size: int, size: int) -> int:
    """DeepSpeed's train_batch_size for a model split over `size` ranks: DeepSpeed derives the gradient accumulation
    steps from it and the micro-batch over every rank of the world (it reads its config before AutoTP makes the
    mesh), so the batch is counted once per rank of a split for the accumulation to be that of ranks / size
    data-parallel ranks."""
    return train_batch_size * size


# -- the batch --------------------------------------------------------------------------------------------------


def same_rows(per_data_parallel_rank: Sequence[T], size: int) -> list[T]:
    """Each rank's share from each data-parallel rank's: the `size` consecutive ranks of a split read the same."""
    return [share for share in per_data_parallel_rank for _ in range(size)]


def one_per_split(per_rank: Sequence[T], size: int) -> list[T]:
    """Each split's output (its first rank's) from every rank's: the ranks of a split return the same."""
    return list(per_rank[::size])


# -- gradients and weights ----------------------------------------------------------------------------------------


def is_sharded(param: nn.Parameter) -> bool:
    return getattr(param, _SHARDED, False)


def grad_norm(parameters: Iterable[nn.Parameter]) -> float:
    """The global gradient norm of the model this rank holds a split of (every rank of the split must call):
    a sharded parameter's squares summed over its split, a whole one (replicated on every rank of the split, with
    the same gradient) counted once."""
    from deepspeed.utils import groups

    sharded, whole = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for param in parameters:
        if param.grad is not None:
            squares = param.grad.detach().double().pow(2).sum().cpu()
            if is_sharded(param):
                sharded += squares
            else:
                whole += squares
    torch.distributed.all_reduce(sharded, group=groups.get_tensor_model_parallel_group())
    return float((sharded + whole).sqrt())


def full_shape(param: nn.Parameter) -> tuple[int, ...] | None:
    """A sharded parameter's full shape without a gather (None: not sharded by AutoTP)."""
    meta = getattr(param, _UC_META, None)
    return tuple(meta["logical_shape"]) if meta is not None and is_sharded(param) else None


@contextmanager
def gathered(params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Within, the sharded ones of `params` hold their full tensors (their layers' weight and bias gathered over
    the split); split again on exit, a change to the full tensor kept in each rank's shard. Every rank of the split
    must enter with the same parameters."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    layers = {}
    for param in params:
        if is_sharded(param):
            layer = param.gather_params.__self__  # the sharded layer whose gather (and split) is bound to it
            layers[id(layer)] = layer
    with ExitStack() as stack:
        for layer in layers.values():
            stack.enter_context(GatherReplacedLayerParams([layer.weight, layer.bias], layer))
        yield
