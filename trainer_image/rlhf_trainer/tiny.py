"""Tiny models built offline, for tests and the CPU example job (`rlhf tiny-model DIR`).

A byte-level BPE tokenizer trained on a small built-in corpus (the toy task's prompts and
answers), and a 2-layer Qwen2 with random weights: small enough to train on a laptop CPU, and
shaped so that vLLM's CPU backend serves it (head_dim 32).

The toy task: a prompt names a letter, the answer repeats it ("Repeat the letter c." -> "cccc").
Its reward (manifests/examples/tiny/reward.py) is the fraction of answer characters equal to
the letter, which a randomly initialised model already earns now and then, so GRPO has signal.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

TOY_LETTERS = "abcd"
TOY_TEMPLATES = (
    "Repeat the letter {letter}.",
    "Write the letter {letter} again and again.",
    "Say {letter}.",
    "Answer with the letter {letter} only.",
    "Type {letter} many times.",
    "Letter: {letter}",
    "Please write {letter}.",
    "Only {letter}, nothing else.",
)
# Names that vary the prompts; they are context, not part of the answer.
TOY_NAMES = ("Ada", "Bo", "Cy", "Dee", "Eli", "Fay")

PAD, EOS, TURN = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}" + TURN + "{{ message['role'] }}\n{{ message['content'] }}" + EOS + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + TURN + "assistant\n{% endif %}"
)
VOCAB_SIZE = 384
MAX_POSITIONS = 512


def toy_prompts(count: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """Records {"prompt", "label"} of the toy task; manifests/examples/tiny/prompts.jsonl is count=256, seed=0."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        letter = rng.choice(TOY_LETTERS)
        prompt = rng.choice(TOY_TEMPLATES).format(letter=letter)
        records.append({"prompt": f"{rng.choice(TOY_NAMES)}: {prompt}", "label": letter})
    return records


def _corpus() -> list[str]:
    """Text the tokenizer is trained on: the toy prompts and answers, and the chat roles."""
    prompts = [record["prompt"] for record in toy_prompts()]
    answers = [letter * n for letter in TOY_LETTERS for n in (1, 2, 4, 8)]
    return prompts + answers + ["system user assistant"] * 4


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every byte encodes) with pad/eos tokens and a ChatML-style template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, TURN, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD,
        chat_template=CHAT_TEMPLATE, model_max_length=MAX_POSITIONS,
    )


def tiny_config(tokenizer: PreTrainedTokenizerFast, **overrides) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: a size vLLM's CPU attention supports
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **overrides,
    )


def build_tiny_model(
    out_dir: str | Path, *, kind: Literal["causal-lm", "reward"] = "causal-lm", seed: int = 0
) -> Path:
    """Write a tokenizer and a randomly initialised tiny Qwen2 to out_dir; the same seed gives the same files.

    kind "causal-lm" is an actor/reference; "reward" is a sequence classifier with one label (a
    reward model or critic).
    """
    builders = {"causal-lm": AutoModelForCausalLM, "reward": AutoModelForSequenceClassification}
    if kind not in builders:
        raise ValueError(f"unknown tiny model kind {kind!r}: use one of {', '.join(builders)}")
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    config = tiny_config(tokenizer, **({"num_labels": 1} if kind == "reward" else {}))
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        model = builders[kind].from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
