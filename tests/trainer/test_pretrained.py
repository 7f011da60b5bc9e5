"""The real pretrained model (SmolLM2-135M-Instruct) as `rlhf smollm2-model` writes it."""

from __future__ import annotations

import json
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_trainer.data import render_prompt
from rlhf_trainer.pretrained import build_smollm2, write_checked


def test_the_converted_model_is_the_real_instruct_model_and_answers_until_its_end_of_turn(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["hidden_size"]) == (
        ["LlamaForCausalLM"], 30, 576)
    assert "quantization_config" not in config  # dequantised: ordinary float weights
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    prompt = render_prompt("What is 7+5? Answer with just the number.", tokenizer, apply_chat_template=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 7+5? Answer with just the number.<|im_end|>\n"
                           "<|im_start|>assistant\n")  # the tokenizer's own (SmolLM's) chat template
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=40, do_sample=False)[0, ids.input_ids.shape[1]:].tolist()
    assert tokenizer.eos_token_id in out, tokenizer.decode(out)  # stops at its end of turn
    assert "12" in tokenizer.decode(out[:out.index(tokenizer.eos_token_id)])
    # Readable by the non-root user a pod runs as.
    assert all(path.stat().st_mode & stat.S_IROTH for path in (smollm2, *smollm2.iterdir()))


def test_a_conversion_whose_logits_differ_is_refused(tiny_model, tmp_path):
    # The conversion's last step on a model whose weights are not the ones it is checked against (the tiny
    # model stands for SmolLM2: converting the GGUF again costs minutes, and the check is the same).
    reference = AutoModelForCausalLM.from_pretrained(tiny_model)
    converted = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        converted.lm_head.weight.mul_(1.001)
    with pytest.raises(ValueError, match="logits differ"):
        write_checked(converted, AutoTokenizer.from_pretrained(tiny_model), tmp_path / "model", against=reference)
    assert not list(tmp_path.iterdir())  # nothing half-written is left for models.actor.path to name


def test_an_existing_directory_is_not_overwritten(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(ValueError, match="exists: remove it first"):
        build_smollm2(tmp_path / "model")
