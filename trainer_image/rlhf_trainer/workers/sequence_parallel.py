"""Sequence parallelism (training.sequenceParallel): one packed row's tokens split over the N ranks of a
sequence-parallel group, for the actor, critic, reference and reward passes, forward and backward.

Design: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509), not ring attention. Every layer but
attention works token by token, so each rank runs the model on its contiguous 1/N of every row's
columns. At attention, two all-to-alls (`_AllToAll`) trade the split: each rank receives the whole
sequence for 1/N of the heads, runs the job's own attention implementation (`ATTENTION` wraps sdpa,
eager or flash-attention) over it, and trades back. Why this one:

- The attention kernel stays the job's own and sees whole rows: packing's per-sample masks, padding
  and every attnImplementation work unchanged through one seam (the mask below for sdpa and eager, the
  position ids for flash-attention's varlen kernel). A ring needs its own attention with an online-
  softmax merge and a backward for each kernel and each mask shape (packed rows' block diagonals).
- Its traffic per rank is a constant 4/N of the layer's q, k, v and output activations, over one
  collective that gloo has (CPU ranks) and NCCL runs on NVLink at full speed.
- The price: N must divide the attention heads and the key-value heads (checks.py refuses it at the
  start otherwise, where the model is known); a ring has no such limit. Qwen2.5-7B's 28 heads and 4
  key-value heads allow 2 and 4.

The step equals the unsplit step. Every rank of a group gets the same micro-batches and returns the
same per-token reads (log-probs, entropy, values: `gather_shares` sums each rank's own positions), so
each computes the whole loss; the gradient a rank keeps is that of its own tokens (gather_shares'
backward passes the loss's gradient through unsummed), and the ranks' gradients add up to the
unsplit one. DeepSpeed's engine, given this group through its sequence-parallel state
(deepspeed.runtime.sequence_parallel.parallel_state_sp), sums the gradients over all ranks and
divides by ranks / N, the data-parallel degree: the mean over data-parallel groups of whole-row
gradients. ZeRO shards over all ranks (its sequence-data-parallel group).

No rank holds a whole row's logits: each computes the logits of its own columns only (logits_to_keep)
and reads them token by token (`Model.action_reads`); a caller that wants the logits themselves
(`Model.action_logits`: kd, a teacher's top-k) gets them gathered, a whole micro-batch's on every rank.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor
from torch import distributed as dist

from rlhf_api.planning.memory import head_counts

ATTENTION = "sequence_parallel"  # the attention implementation registered with transformers (`register`)
# A per-token read: (logits [M, V] of M positions, where (their (row, token) indices into [B, T])) -> [M, ...]
Read = Callable[[Tensor, tuple], Tensor]


class _AllToAll(torch.autograd.Function):
    """x cut into N pieces along scatter_dim, piece i sent to rank i; the pieces received joined along
    gather_dim in rank order. Its backward is the reverse trade."""

    @staticmethod
    def forward(ctx, x: Tensor, scatter_dim: int, gather_dim: int, group) -> Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group) -> Tensor:
    pieces = [piece.contiguous() for piece in x.chunk(dist.get_world_size(group), dim=scatter_dim)]
    received = [torch.empty_like(piece) for piece in pieces]
    dist.all_to_all(received, pieces, group=group)
    return torch.cat(received, dim=gather_dim)


class _SumOfShares(torch.autograd.Function):
    """The sum of every rank's share (each holds its own positions, zeros elsewhere). Each rank then
    computes the same loss from it, so the gradient of a rank's share is the loss's gradient itself:
    the backward passes it through (a summing backward would count it N times)."""

    @staticmethod
    def forward(ctx, share: Tensor, group) -> Tensor:
        total = share.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def gather_shares(share: Tensor, group) -> Tensor:
    return _SumOfShares.apply(share, group)


@dataclass
class Layout:
    """One forward's split: the whole rows' position ids and which columns are real keys, [R, S] with S a
    multiple of N; each rank holds columns [rank * S/N, (rank + 1) * S/N)."""

    position_ids: Tensor
    real: Tensor
    split: SequenceParallel  # whose attention reads this layout
    masks: dict = field(default_factory=dict)  # per attention implementation, built once a forward

    def allowed(self) -> Tensor:
        """[R, 1, S, S]: a query sees the real keys at or before it in its own sample (a sample starts
        where the position ids do not count up by one: packing's restarts, a left-padded prompt's
        start), and itself, so that no softmax row is empty (a padding query's output is read by nobody)."""
        positions = self.position_ids
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        sample = starts.cumsum(-1)
        width = positions.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=positions.device).tril()
        allowed = causal & (sample[:, :, None] == sample[:, None, :]) & self.real[:, None, :]
        return (allowed | torch.eye(width, dtype=torch.bool, device=positions.device))[:, None]

    def mask(self, implementation: str, dtype: torch.dtype) -> Tensor | None:
        if implementation not in self.masks:
            self.masks[implementation] = MASKS[implementation](self, dtype)
        return self.masks[implementation]


# What each attention implementation reads as its mask: sdpa a boolean one, eager one added to the
# scores, flash-attention none (its varlen kernel reads the samples from the position ids).
MASKS: dict[str, Callable[[Layout, torch.dtype], "Tensor | None"]] = {
    "sdpa": lambda layout, dtype: layout.allowed(),
    "eager": lambda layout, dtype: torch.zeros((), dtype=dtype, device=layout.real.device).masked_fill(
        ~layout.allowed(), torch.finfo(dtype).min),
    "flash_attention_2": lambda layout, dtype: None,
    "flash_attention_3": lambda layout, dtype: None,
}


@dataclass
class SequenceParallel:
    """This rank's place in its sequence-parallel group and the attention implementation it wraps."""

    size: int
    rank: int
    group: object  # torch.distributed ProcessGroup
    inner: str  # the job's attnImplementation

    def split(self, input_ids: Tensor, position_ids: Tensor, real: Tensor) -> tuple[Tensor, Tensor, Layout, int]:
        """This rank's columns of input ids and position ids, the layout, and its first column; rows are
        padded on the right to a multiple of N columns with keys nobody sees (a row shorter than N too)."""
        pad = -input_ids.shape[1] % self.size
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            position_ids = torch.nn.functional.pad(position_ids, (0, pad))
            real = torch.nn.functional.pad(real, (0, pad))
        width = input_ids.shape[1] // self.size
        first = self.rank * width
        mine = slice(first, first + width)
        return input_ids[:, mine], position_ids[:, mine], Layout(position_ids, real.bool(), self), first

    def attention(self, module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *,
                  sequence_parallel: Layout, **kwargs) -> tuple[Tensor, None]:
        """The job's attention over whole rows for 1/N of the heads: q, k, v [R, heads, S/N, D] ->
        [R, heads/N, S, D], its output [R, S, heads/N, D] -> [R, S/N, heads, D]."""
        group = self.group
        query, key, value = (_AllToAll.apply(t, 1, 2, group) for t in (query, key, value))
        if self.inner.startswith("flash_attention"):
            kwargs["position_ids"] = sequence_parallel.position_ids
        output, _ = self._inner_function(module)(
            module, query, key, value, sequence_parallel.mask(self.inner, query.dtype), **kwargs)
        return _AllToAll.apply(output, 1, 2, group), None

    def _inner_function(self, module) -> Callable:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.inner == "eager":  # each model family's own, beside its attention module
            return sys.modules[type(module).__module__].eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[self.inner]

    # -- the passes ---------------------------------------------------------------------------------

    def action_reads(self, engine, rows: dict, wanted: tuple[Tensor, Tensor], shape: tuple[int, int],
                     temperature: float, reads: tuple[Read, ...]) -> list[Tensor]:
        """Each read of the logits predicting the wanted tokens, [B, T, ...] on every rank of the group.
        rows: input_ids, position_ids and real [R, S] of the causal LM's input rows; wanted: the
        (row, column) [B, T] of the logit of each response token in them."""
        local_ids, local_positions, layout, first = self.split(rows["input_ids"], rows["position_ids"], rows["real"])
        row, column = wanted
        mine = (column >= first) & (column < first + local_ids.shape[1])
        keep, index = torch.unique(column[mine] - first, return_inverse=True)
        logits = engine(input_ids=local_ids, position_ids=local_positions, logits_to_keep=keep, use_cache=False,
                        sequence_parallel=layout).logits
        logits = logits[row[mine], index].float() / temperature  # [M, V]: this rank's wanted positions
        at = mine.nonzero(as_tuple=True)
        outputs = []
        for read in reads:
            share = read(logits, at)
            whole = share.new_zeros(shape + share.shape[1:]).index_put(at, share)
            outputs.append(gather_shares(whole, self.group))
        return outputs

    def token_values(self, engine, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        """A sequence classifier's score at every position, [B, S] on every rank of the group."""
        width = input_ids.shape[1]
        local_ids, local_positions, layout, first = self.split(input_ids, position_ids, attention_mask)
        local = engine(local_ids, None, local_positions, sequence_parallel=layout)  # [B, S/N]
        whole = torch.nn.functional.pad(local, (first, layout.real.shape[1] - first - local.shape[1]))
        return gather_shares(whole, self.group)[:, :width]


def split_problem(config: dict, size: int) -> str | None:
    """Why a model of this config.json (a dict) cannot split its rows over `size` ranks, with the fix; None if it can:
    each rank attends with 1/size of the attention heads and of the key-value heads, and reads text only (a
    vision-language model's image positions come from the whole row: its passes are not split)."""
    if "vision_config" in config:
        return ("a vision-language model's passes read whole rows (its image positions are computed over the row), "
                "and sequence parallelism splits them: remove training.sequenceParallel")
    for what, count in head_counts(config).items():
        if count is not None and count % size:
            return (f"the model has {count} {what}, which sequence parallelism (DeepSpeed-Ulysses: each rank attends "
                    f"with 1/size of them) cannot split over {size} ranks: set training.sequenceParallel.size to a "
                    f"divisor of {count}")
    return None


def register() -> None:
    """`ATTENTION` with transformers: the attention function, and a mask function that builds nothing
    (the whole rows' mask is the Layout's; the one transformers would build covers a rank's columns only)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)


def _attention(module, query, key, value, attention_mask, *, sequence_parallel: Layout, **kwargs):
    """transformers' attention call, with the forward's layout among its keyword arguments (a checkpointed
    layer's recomputation in the backward is called with them again)."""
    return sequence_parallel.split.attention(module, query, key, value, attention_mask,
                                             sequence_parallel=sequence_parallel, **kwargs)


def initialize(size: int, inner: str):
    """Join this process's sequence-parallel group (ranks [i*N, (i+1)*N)) through DeepSpeed's sequence-parallel
    state, which deepspeed.initialize takes as its mpu; returns (SequenceParallel, mpu)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:  # noqa: SLF001 - a second model of the process shares it
        parallel_state_sp.initialize_sequence_parallel(size)
    elif parallel_state_sp.get_sequence_parallel_world_size() != size:
        raise ValueError(f"this process's sequence-parallel groups have {parallel_state_sp.get_sequence_parallel_world_size()} "
                         f"ranks, not {size}: every model of a process splits its rows alike")
    register()
    this = SequenceParallel(size, parallel_state_sp.get_sequence_parallel_rank(),
                            parallel_state_sp.get_sequence_parallel_group(), inner)
    return this, parallel_state_sp
