"""Tiny offline models: the tokenizer, the chat template, a causal LM that generates, a reward model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from rlhf_cli.cli import main
from rlhf_trainer.tiny import build_tiny_model, toy_prompts

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("actor"))


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("reward"), kind="reward")


def test_tokenizer_round_trips_any_text(actor_dir):
    tokenizer = AutoTokenizer.from_pretrained(actor_dir)
    for text in ["Ada: Repeat the letter c.", "cccc", "  spaces\tand\nlines ", "ünïcödé ✓ 数字 🙂", ""]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert len(tokenizer("cccc", add_special_tokens=False)["input_ids"]) == 1  # toy answers are merged tokens


def test_special_tokens_and_chat_template(actor_dir):
    tokenizer = AutoTokenizer.from_pretrained(actor_dir)
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert (actor_dir / "chat_template.jinja").is_file()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say a."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay a.<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tokenizer.eos_token_id in ids


def test_causal_lm_loads_and_generates(actor_dir):
    config = AutoConfig.from_pretrained(actor_dir)
    assert config.model_type == "qwen2" and config.hidden_size // config.num_attention_heads == 32
    assert config.num_hidden_layers == 2 and config.max_position_embeddings == 512 and config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(actor_dir)
    assert config.vocab_size == len(tokenizer) and config.eos_token_id == tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(actor_dir)
    assert next(model.parameters()).dtype == torch.float32
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say a."}], add_generation_prompt=True, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=6, do_sample=True, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[0] == 1 and prompt["input_ids"].shape[1] < out.shape[1] <= prompt["input_ids"].shape[1] + 6
    assert torch.equal(out[0, : prompt["input_ids"].shape[1]], prompt["input_ids"][0])


def test_reward_model_gives_one_score_per_sequence(reward_dir):
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    texts = ["Say a. aaaa", "Say b. b", "Repeat the letter c. cccc cccc cccc"]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        scores = model(**batch).logits
        alone = [model(**tokenizer([t], return_tensors="pt", add_special_tokens=False)).logits for t in texts]
    assert scores.shape == (3, 1)
    # padding is skipped: a sequence scores the same alone and in a padded batch
    torch.testing.assert_close(scores, torch.cat(alone), rtol=1e-4, atol=1e-5)
    assert len(set(scores.flatten().tolist())) == 3


def test_same_seed_same_files_other_seed_other_weights(actor_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    for name in ["model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"]:
        assert (again / name).read_bytes() == (actor_dir / name).read_bytes(), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (actor_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (actor_dir / "tokenizer.json").read_bytes()


def test_building_leaves_the_global_random_state_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model kind 'critic': use one of causal-lm, reward"):
        build_tiny_model(tmp_path, kind="critic")


def test_cli_builds_a_tiny_model(tmp_path, capsys):
    assert main(["tiny-model", str(tmp_path / "rm"), "--kind", "reward", "--seed", "3"]) == 0
    # The path is the last line: a DeepSpeed import earlier in this process may have printed its accelerator first.
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]


def test_example_prompts_are_the_toy_task():
    lines = (EXAMPLES / "tiny" / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == toy_prompts(), "regenerate prompts.jsonl from rlhf_trainer.tiny.toy_prompts()"
