"""LoRA (Hu et al. 2021, arXiv:2106.09685) on a trained role's model, with peft.

`apply_lora` injects the adapters into the Hugging Face model in place and freezes everything
else, so the DeepSpeed engine keeps wrapping the same module (its parameter names gain
`.base_layer` and `lora_A/B` entries) and only the adapters get optimizer state. The PeftModel
it returns switches the adapters off (`disable_adapter`): the base model, which serves as the
reference without a second copy of the weights (rlhf_api/planning/placement.py: `shared_roles`).

`merged_entries` lists the model's weights under the base model's names, each adapted layer's
weight merged as W + scale * B @ A: what vLLM is sent after every update and what the merged
export holds. A critic's or reward model's score head, and any module lora.modulesToSave names, is
trained whole (peft's modules_to_save) and read from its trained copy. Under QLoRA every 4-bit base
weight, adapted or not, is listed dequantized, in its full shape: vLLM loads the unquantized model's
layout and refuses bitsandbytes' packed one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from rlhf_api.v1alpha1 import LoRASpec

from .vision import is_vision_language, language_model_linears

ADAPTER = "default"  # peft's name of the one adapter
# peft's task type per trained role: a sequence classifier's score head trains whole with the adapters.
TASK_TYPES = {"actor": "CAUSAL_LM", "critic": "SEQ_CLS", "rm": "SEQ_CLS"}
# Parameter-name parts peft adds around a wrapped module, and what the base model calls it.
_WRAPPERS = {".base_layer.": ".", f".modules_to_save.{ADAPTER}.": "."}


def quantization_config(spec: LoRASpec | None) -> Any:
    """from_pretrained's quantization_config: nf4 loads the frozen base in 4 bits (QLoRA, Dettmers et al.
    2023, arXiv:2305.14314). UNTESTED: bitsandbytes needs GPUs (checks.py refuses it elsewhere)."""
    if spec is None or spec.quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def apply_lora(model: nn.Module, spec: LoRASpec, role: str) -> Any:
    """Adapters injected into `model` in place (the rest frozen); returns the PeftModel around it."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if spec.quantization != "none":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    targets = spec.target_modules
    if targets == ["all-linear"] and is_vision_language(model.config):  # the language model's layers only
        targets = language_model_linears(model)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, task_type=TASK_TYPES[role],
                        target_modules="all-linear" if targets == ["all-linear"] else targets,
                        modules_to_save=spec.modules_to_save or None)
    return get_peft_model(model, config)


def base_name(name: str) -> str:
    """A parameter's name in the base model (peft's wrappers removed)."""
    for wrapped, plain in _WRAPPERS.items():
        name = name.replace(wrapped, plain)
    return name


# (base name, full shape, the parameters it is computed from, how) for each weight of the base model.
Entry = tuple[str, tuple[int, ...], list[nn.Parameter], Callable[[], Tensor]]


def merged_entries(module: nn.Module) -> list[Entry]:
    """The module's weights as the base model names them, in parameter order; an adapted layer's
    weight is computed from its base weight and adapters (gather them all before calling)."""
    from peft.tuners.lora import LoraLayer

    entries: list[Entry] = []
    for name, param in module.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue  # folded into the merged weight / replaced by the trained copy
        owner = module.get_submodule(name.rsplit(".base_layer.", 1)[0]) if ".base_layer." in name else None
        if isinstance(owner, LoraLayer) and name.endswith(".base_layer.weight"):
            adapters = [owner.lora_A[ADAPTER].weight, owner.lora_B[ADAPTER].weight]
            # A Conv1D layer (GPT-2's, peft's fan_in_fan_out) stores its weight [in, out], and so is the merged one.
            entries.append((base_name(name), full_shape(param), [param, *adapters],
                            lambda layer=owner, p=param: _merged_weight(layer, p)))
        else:
            # A frozen layer is sent too, dequantized, although vLLM loaded it from the same checkpoint: vLLM holds
            # the unquantized weight, the trainer's policy computes with the dequantized one (nf4 rounding), and
            # vLLM reloads a fused layer (qkv_proj, gate_up_proj) from all of its parts, adapted or not.
            entries.append((base_name(name), full_shape(param), [param], lambda p=param: dense(p)))
    return entries


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    """A parameter's full shape, without a gather: a ZeRO-3 shard keeps it as `ds_shape`, an AutoTP shard in its
    metadata (tensor_parallel.full_shape), a 4-bit weight in its quant_state (its own shape is the packed one,
    [out * in / 2, 1])."""
    from .tensor_parallel import full_shape as split_full_shape

    state = getattr(param, "quant_state", None)
    if state is not None:
        return tuple(state.shape)
    return split_full_shape(param) or tuple(getattr(param, "ds_shape", param.shape))


def dense(param: nn.Parameter) -> Tensor:
    """A parameter's values as the unquantized model holds them: a 4-bit base weight (bitsandbytes' Params4bit,
    packed uint8 with its quant_state) dequantized to the dtype it was loaded in."""
    if getattr(param, "quant_state", None) is None:
        return param.data
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(param.data, param.quant_state)


def _merged_weight(layer, base_weight: nn.Parameter) -> Tensor:
    """W + scale * B @ A (peft's delta, which also transposes for fan_in_fan_out layers)."""
    base = dense(base_weight)
    return base + layer.get_delta_weight(ADAPTER).to(base.dtype)
