"""Sample packing (training.packSamples): a micro-batch's samples laid end to end in rows, with no
padding inside a row, instead of one padded row per sample.

Position ids restart at 0 at each sample; with no attention mask and no KV cache (a cache turns the
detection off: use_cache=False), transformers reads the restarts as sample boundaries, the convention
of its DataCollatorWithFlattening. How many rows depends on the attention implementation:

- flash_attention_2: one row. Its varlen kernel is used only when the batch has a single row
  (modeling_flash_attention_utils._is_packed_sequence); with several rows it attends causally across
  each whole row, samples into each other. Varlen attention costs per sample, and the row holds
  only the micro-batch's real tokens (fewer than its padded rows), so one row costs nothing extra.
- sdpa and eager: rows at most as long as the longest sample (first-fit decreasing). Their mask is
  built per row from the restarts (masking_utils.find_packed_sequence_indices) and is dense over the
  row, so a row no longer than a padded one keeps attention's cost at the padded one's while the
  rows, and so the tokens every linear layer processes, are fewer (one row of a whole micro-batch
  trains 2.4x slower than these rows under sdpa on CPU: benchmarks/packing.py's micro-batches). A
  row's unused tail is one more "sample" of its own whose outputs nobody reads.

The logits come back in the padded layout the losses read, [B, num_actions, V]: only the
positions that predict a response token are computed (logits_to_keep).

A vision-language model's samples pack too (pack_images): each keeps its multimodal rotary positions
and its images, which the model reads in the order their tokens appear in the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Packed:
    input_ids: Tensor  # [rows, width]
    position_ids: Tensor  # [rows, width], restarting at 0 at every sample
    keep: Tensor  # [U] the columns whose logits are computed (logits_to_keep)
    row: Tensor  # [B, T] the row of each wanted logit
    column: Tensor  # [B, T] its index into keep
    placed: list[tuple[int, int]]  # each sample's (row, offset) in the packed rows


def pack(sequences: Tensor, attention_mask: Tensor, num_actions: int, one_row: bool = False) -> Packed:
    """Pack rows whose real tokens are one contiguous run (left-padded prompt, right-padded response),
    keeping the logits that predict each of the last num_actions tokens of every row; all samples in
    one row with one_row (flash-attention), else rows as long as the longest sample."""
    batch, width = sequences.shape
    mask = attention_mask.bool()
    lengths = mask.sum(-1).tolist()
    starts = mask.int().argmax(-1).tolist()  # first real token
    capacity = sum(lengths) if one_row else max(lengths)
    free: list[int] = []  # tokens left in each packed row
    row_of, offset_of = [0] * batch, [0] * batch
    for b in sorted(range(batch), key=lambda b: -lengths[b]):  # first-fit decreasing
        row = next((r for r, left in enumerate(free) if left >= lengths[b]), len(free))
        if row == len(free):
            free.append(capacity)
        row_of[b], offset_of[b] = row, capacity - free[row]
        free[row] -= lengths[b]

    input_ids = torch.zeros(len(free), capacity, dtype=sequences.dtype, device=sequences.device)
    position_ids = torch.zeros(len(free), capacity, dtype=torch.long, device=sequences.device)
    for b in range(batch):
        row, offset, length = row_of[b], offset_of[b], lengths[b]
        input_ids[row, offset:offset + length] = sequences[b, starts[b]:starts[b] + length]
        position_ids[row, offset:offset + length] = torch.arange(length)
    for row, left in enumerate(free):  # the tail: a sample of its own
        position_ids[row, capacity - left:] = torch.arange(left)

    # Padded position p predicts token p + 1; a response token that is padding gets any real
    # position of its sample (the losses mask it).
    predicting = torch.arange(width - num_actions - 1, width - 1)
    local = predicting[None, :] - torch.tensor(starts)[:, None]
    local = torch.minimum(local.clamp(min=0), torch.tensor(lengths)[:, None] - 1)
    packed_column = local + torch.tensor(offset_of)[:, None]
    keep, column = torch.unique(packed_column, return_inverse=True)
    row = torch.tensor(row_of)[:, None].expand(batch, num_actions)
    device = sequences.device
    return Packed(input_ids, position_ids, keep.to(device), row.to(device), column.to(device),
                  list(zip(row_of, offset_of)))


def pack_images(packed: Packed, sequences: Tensor, attention_mask: Tensor, mm_token_type_ids: Tensor,
                vision: dict[str, Tensor], module) -> dict[str, Tensor]:
    """A vision-language model's inputs for packed rows: each sample's image inputs and multimodal rotary positions
    travel with its tokens. The positions are the model's own (its get_rope_index over the padded rows, as the padded
    forward computes them), moved to where each sample's tokens now lie, under the text positions that restart at
    every sample (transformers' [4, rows, width] layout for packed samples: the mask is read from the first); the
    pixel values and grids in the order the samples' image tokens now appear, as the model fills them in.
    vision: the padded [B, P, D] pixel_values and [B, I, 3] image_grid_thw (vision.py)."""
    grids = vision["image_grid_thw"]
    rope_index = next(m for m in module.modules() if hasattr(m, "get_rope_index")).get_rope_index
    mrope, _ = rope_index(input_ids=sequences, mm_token_type_ids=mm_token_type_ids,
                          image_grid_thw=grids[grids.prod(-1) > 0], attention_mask=attention_mask)
    positions = packed.position_ids[None].repeat(4, 1, 1)  # the tails' too: text positions in every dimension
    mask = attention_mask.bool()
    for b, (row, offset) in enumerate(packed.placed):
        real = mrope[:, b, mask[b]]
        positions[1:, row, offset:offset + real.shape[1]] = real
    pixel_values, image_grid_thw = [], []
    for b in sorted(range(len(packed.placed)), key=lambda b: packed.placed[b]):  # the packed rows' token order
        sample = grids[b][grids[b].prod(-1) > 0]
        pixel_values.append(vision["pixel_values"][b, :int(sample.prod(-1).sum())])
        image_grid_thw.append(sample)
    return {"position_ids": positions, "pixel_values": torch.cat(pixel_values),
            "image_grid_thw": torch.cat(image_grid_thw)}


def longest_first(attention_mask: Tensor) -> Tensor:
    """Row indices, longest first: micro-batches cut from them in turn hold rows of like lengths, and a
    micro-batch packs (or pads) to its longest row, so mixed lengths would waste its compute."""
    return attention_mask.sum(-1).argsort(descending=True, stable=True)


def unpack_logits(logits: Tensor, packed: Packed) -> Tensor:
    """[rows, U, V] -> [B, T, V] in the padded layout."""
    return logits[packed.row, packed.column]
