"""QLoRA's weight sync (issue 50, defect 7): with adapters on some layers only (q_proj, v_proj), every
weight the sync announces and sends, adapted or not, is one the unquantized model vLLM loads has, in
its shape and a floating dtype, with the trainer's values (the 4-bit base dequantized, adapters merged).

Seam: bitsandbytes is in none of the project's locks (checks.py refuses QLoRA without it) and its 4-bit
kernels need CUDA, so the 4-bit base here is made in its format by `_quantize_nf4`: a weight becomes a
`Params4bit` holding the packed NF4 codes (uint8, [out * in / 2, 1], two codes a byte, high nibble first)
and a `quant_state` (per-64-block absmax, the original shape and dtype), and `bitsandbytes.functional.
dequantize_4bit` is this file's decoder, installed in sys.modules (peft, before the fix, reached it too).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from rlhf_api.v1alpha1 import LoRASpec
from rlhf_trainer.workers.lora import apply_lora
from rlhf_trainer.workers.weight_sync import _unpack, send_parameters
from rlhf_trainer.workers.weights import full_shapes

# bitsandbytes' NF4 code book (the 16 values a 4-bit code stands for, times its block's absmax).
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
BLOCK = 64
BUCKET_BYTES = 64 * 1024


@dataclass
class QuantState:  # the fields of bitsandbytes' QuantState that dequantizing reads
    absmax: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype


class Params4bit(nn.Parameter):
    """bitsandbytes' class name: peft dequantizes a base layer only when its weight is called so."""


def _quantize_nf4(weight: torch.Tensor) -> Params4bit:
    blocks = weight.detach().float().reshape(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    codes = ((blocks / absmax[:, None]).unsqueeze(-1) - NF4).abs().argmin(dim=-1).reshape(-1).to(torch.uint8)
    packed = Params4bit((codes[0::2] << 4 | codes[1::2]).reshape(-1, 1), requires_grad=False)
    packed.quant_state = QuantState(absmax, weight.shape, weight.dtype)
    return packed


def _dequantize_4bit(packed: torch.Tensor, state: QuantState) -> torch.Tensor:
    codes = torch.stack([packed.reshape(-1) >> 4, packed.reshape(-1) & 15], dim=1).reshape(-1, BLOCK).long()
    return (NF4[codes] * state.absmax[:, None]).reshape(state.shape).to(state.dtype)


def _install_bitsandbytes_seam(monkeypatch) -> None:
    """After the adapters are in: peft looks for bitsandbytes' layers when it injects them."""
    functional = types.ModuleType("bitsandbytes.functional")
    functional.dequantize_4bit = _dequantize_4bit
    package = types.ModuleType("bitsandbytes")
    package.functional = functional
    monkeypatch.setitem(sys.modules, "bitsandbytes", package)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", functional)


def _qlora_model(path) -> nn.Module:
    """The tiny model with adapters on q_proj and v_proj (B random, so merging shows) and every decoder
    linear layer's weight in 4 bits, as transformers' bitsandbytes loading leaves it (the head stays whole)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    apply_lora(model, LoRASpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]), "actor")
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in name and ".lora_" not in name:
            module.weight = _quantize_nf4(module.weight)
        elif name.endswith(".lora_B.default"):
            nn.init.normal_(module.weight)
    return model


def test_qlora_sync_sends_every_weight_as_the_unquantized_model_holds_it(tiny_model, monkeypatch):
    model = _qlora_model(tiny_model)
    _install_bitsandbytes_seam(monkeypatch)
    actor = SimpleNamespace(engine=SimpleNamespace(module=model, autotp_size=lambda: 1), zero3=False,
                            frozen_tower=frozenset())
    buckets: list[torch.Tensor] = []
    send_parameters(actor, [SimpleNamespace(send=buckets.append, done=lambda: None)], torch.bfloat16, BUCKET_BYTES)
    received = iter(buckets)
    source = SimpleNamespace(receive=lambda numel, dtype: next(received))
    sent = dict(_unpack(source, full_shapes(actor), torch.bfloat16, BUCKET_BYTES))  # as a vLLM worker cuts them
    assert next(received, None) is None, "the sender sent more than it announced"

    # What vLLM loads: the unquantized checkpoint (the output head tied to the embedding, so not sent).
    expected = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    assert sent.keys() == expected.keys() - {"lm_head.weight"}
    for name, tensor in sent.items():
        assert tensor.shape == expected[name].shape and tensor.dtype.is_floating_point, \
            f"{name}: sent {tuple(tensor.shape)} {tensor.dtype}, vLLM loads {tuple(expected[name].shape)}"

    # The values the trainer's policy computes with: the dequantized base, plus the adapters where adapted.
    layers = model.get_submodule("model.layers.0.self_attn")
    k_proj = _dequantize_4bit(layers.k_proj.weight.data, layers.k_proj.weight.quant_state)
    q_proj = _dequantize_4bit(layers.q_proj.base_layer.weight.data, layers.q_proj.base_layer.weight.quant_state)
    torch.testing.assert_close(sent["model.layers.0.self_attn.k_proj.weight"], k_proj.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(sent["model.layers.0.self_attn.q_proj.weight"],
                               (q_proj + layers.q_proj.get_delta_weight("default")).bfloat16(), rtol=0, atol=0)
    # nf4 rounds each weight by at most half a code step (<= 0.14) of its block's absmax (~0.1 here).
    torch.testing.assert_close(k_proj, expected["model.layers.0.self_attn.k_proj.weight"], rtol=0, atol=0.02)
