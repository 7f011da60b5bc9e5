"""The realistic model shape (rlhf_trainer.tiny.SHAPES["qwen2-40m"]) the benchmarks run: built through the CLI,
the real size, a vocabulary the tokenizer fills exactly, a forward pass, text and sampled ids that decode."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_cli.cli import main
from rlhf_trainer.tiny import SHAPES, build_tiny_model

SHAPE = SHAPES["qwen2-40m"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("qwen2-40m") / "model"
    assert main(["tiny-model", "--shape", "qwen2-40m", str(directory)]) == 0
    return directory


def test_the_model_is_a_qwen2_of_the_named_shape_and_size(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"]
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(model_dir)) == SHAPE.vocab_size == 32768
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # a head size vLLM's CPU attention serves
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (8, 2)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    hidden, kv = SHAPE.hidden_size, SHAPE.hidden_size // SHAPE.num_attention_heads * SHAPE.num_key_value_heads
    attention = hidden * hidden + hidden + 2 * (hidden * kv + kv) + hidden * hidden  # q, k, v with biases; o without
    layer = attention + 3 * hidden * SHAPE.intermediate_size + 2 * hidden  # SwiGLU, two RMSNorms
    expected = SHAPE.vocab_size * hidden + SHAPE.num_hidden_layers * layer + hidden  # tied embedding, final norm
    assert sum(p.numel() for p in model.parameters()) == expected == 39_336_448


def test_forward_pass_gives_logits_over_the_whole_vocabulary(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Ada: Repeat the letter c."}],
                                           add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**prompt).logits
    assert logits.shape == (1, prompt["input_ids"].shape[1], 32768) and torch.isfinite(logits).all()
    probabilities = logits[0, -1].softmax(-1)
    assert probabilities.max() < 0.01  # random weights: no token stands out, every one is sampled now and then


def test_text_and_sampled_ids_round_trip(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for text in ["Ada: Repeat the letter c.", "cccc", "  spaces\tand\nlines ", "ünïcödé ✓ 数字 🙂"]:
        assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    ids = random.Random(0).sample(range(len(tokenizer)), 500)  # what a random model samples: any id
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert len(text) > 2000 and tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_the_same_seed_gives_the_same_files(model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", shape="qwen2-40m")
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_an_unknown_shape_is_refused_with_the_known_names(tmp_path, capsys):
    assert main(["tiny-model", "--shape", "qwen2-7b", str(tmp_path / "m")]) == 2
    assert "unknown model shape 'qwen2-7b': use one of tiny, qwen2-40m" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
