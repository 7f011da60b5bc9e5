"""Vision-language models in the trainer's passes: which weights are the vision tower, and a batch's image inputs.

A batch's images travel with its rows, per sample and padded (experience.Experience's image fields):
pixel_values [B, P, D], each sample's image patches (P: the most any sample has), and image_grid_thw
[B, I, 3], each of its images' patch grid (rows of zeros where a sample has fewer than I images). A
model's forward takes them flattened over the batch, in row order (model_inputs).
"""

from __future__ import annotations

from torch import Tensor, nn

import torch

VISION_KEYS = ("pixel_values", "image_grid_thw")  # the processor's outputs the passes read (data.VISION_INPUTS)

# Where a vision-language model keeps its vision tower, and the part of it that feeds the language model
# (the projector), which freezeVisionTower leaves trainable: Qwen2-VL's and Qwen2.5-VL's `visual` and its merger.
TOWERS = {"visual": "merger"}


# The vision special tokens (the config's names) a policy never samples: the rollout engines bias them out and the
# trainer's log-probs bias them the same (a sampled image token would be read as an image's place). Finite, so that
# the entropy's p log p stays 0 for them.
VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
NEVER_SAMPLED_BIAS = -1.0e4


def never_sampled(config) -> list[int]:
    """A vision-language model's vision special token ids (none for a text model)."""
    if not is_vision_language(config):
        return []
    return [token for key in VISION_TOKENS if (token := getattr(config, key, None)) is not None]


def is_vision_language(config) -> bool:
    """Whether a Hugging Face config is a vision-language model's (it has a vision config)."""
    return getattr(config, "vision_config", None) is not None


def tower_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The vision tower's parameters by name (the projector's left out); none for a text model."""
    found = {}
    for name, param in module.named_parameters():
        parts = name.split(".")
        for tower, projector in TOWERS.items():
            if tower in parts and parts[parts.index(tower) + 1] != projector:
                found[name] = param
    return found


def language_model_linears(module: nn.Module) -> list[str]:
    """A vision-language model's linear layers outside its vision tower and projector, but its output head: what
    LoRA's all-linear adapts in one (the tower is frozen, the projector trains whole or not at all)."""
    return [name for name, layer in module.named_modules()
            if isinstance(layer, nn.Linear) and not set(name.split(".")) & set(TOWERS) and name.split(".")[-1] != "lm_head"]


def freeze_tower(module: nn.Module) -> set[str]:
    """training.freezeVisionTower: the tower's weights stay as loaded; the names frozen."""
    frozen = tower_parameters(module)
    for param in frozen.values():
        param.requires_grad_(False)
    return set(frozen)


def batch_inputs(per_sample: list[dict[str, Tensor] | None]) -> dict[str, Tensor] | None:
    """Samples' image inputs (a prompt's pixel_values [P, D] and image_grid_thw [I, 3], None for a text prompt)
    as the batch's padded [B, P, D] and [B, I, 3]; None when no sample has images."""
    present = [inputs for inputs in per_sample if inputs is not None]
    if not present:
        return None
    patches = max(inputs["pixel_values"].shape[0] for inputs in present)
    images = max(inputs["image_grid_thw"].shape[0] for inputs in present)
    depth, dtype = present[0]["pixel_values"].shape[1], present[0]["pixel_values"].dtype
    pixel_values = torch.zeros(len(per_sample), patches, depth, dtype=dtype)
    grids = torch.zeros(len(per_sample), images, 3, dtype=torch.long)
    for row, inputs in enumerate(per_sample):
        if inputs is not None:
            pixel_values[row, :inputs["pixel_values"].shape[0]] = inputs["pixel_values"]
            grids[row, :inputs["image_grid_thw"].shape[0]] = inputs["image_grid_thw"]
    return {"pixel_values": pixel_values, "image_grid_thw": grids}


def model_inputs(sequences: Tensor, num_actions: int, pixel_values: Tensor, image_grid_thw: Tensor,
                 image_token_id: int) -> dict[str, Tensor]:
    """The forward's image arguments for rows `sequences` [B, S] (their last num_actions tokens the response)
    from their padded inputs: pixel_values and image_grid_thw flattened over the rows in order, and
    mm_token_type_ids (1 on the prompts' image tokens; a response that samples the image token's id is text),
    from which the model computes its multimodal rotary positions."""
    grids = image_grid_thw.reshape(-1, 3)
    patches = image_grid_thw.prod(-1).sum(-1)  # [B] each row's patches
    flat = torch.cat([pixel_values[row, :count] for row, count in enumerate(patches.tolist())])
    in_prompt = torch.arange(sequences.shape[1], device=sequences.device) < sequences.shape[1] - num_actions
    return {"pixel_values": flat, "image_grid_thw": grids[grids.prod(-1) > 0],
            "mm_token_type_ids": ((sequences == image_token_id) & in_prompt).int()}
