"""Small models built offline, for tests, the CPU example job and benchmarks (`rlhf tiny-model [--shape NAME] DIR`).

A byte-level BPE tokenizer trained on a small built-in corpus (the toy task's prompts and
answers), and a Qwen2 with random weights of a named shape (SHAPES): "tiny", 2 layers, small
enough to train on a laptop CPU; "qwen2-40m", a realistic layout for benchmarks. Both are shaped
so that vLLM's CPU backend serves them (head_dim 32 and 64).

The toy task: a prompt names a letter, the answer repeats it ("Repeat the letter c." -> "cccc").
Its reward (manifests/examples/tiny/reward.py) is the fraction of answer characters equal to
the letter, which a randomly initialised model already earns now and then, so GRPO has signal.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
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
MAX_POSITIONS = 512


@dataclass(frozen=True)
class Shape:
    """A Qwen2 layout. head_dim (hidden / heads) must be one vLLM's CPU attention supports."""

    vocab_size: int  # the tokenizer's target; the model's is the tokenizer's (the toy corpus fills 366 of tiny's 384)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


SHAPES = {
    # 0.34M parameters: tests and the CPU example job; head_dim 32.
    "tiny": Shape(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    # 39.3M parameters, 16.8M of them the (tied) embedding: Qwen2-0.5B's head_dim 64, grouped-query
    # attention and tied embeddings at a quarter of its depth, a 32k vocabulary (so the embedding and
    # the lm_head over the vocabulary cost what they cost in real models), SwiGLU at about 8/3 x hidden.
    "qwen2-40m": Shape(vocab_size=32768, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=2),
}


def toy_prompts(count: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """Records {"prompt", "label"} of the toy task; manifests/examples/tiny/prompts.jsonl is count=256, seed=0."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        letter = rng.choice(TOY_LETTERS)
        prompt = rng.choice(TOY_TEMPLATES).format(letter=letter)
        records.append({"prompt": f"{rng.choice(TOY_NAMES)}: {prompt}", "label": letter})
    return records


def one_letter_task(letter: str = "a", seed: int = 4) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The toy task narrowed to one letter, which a tiny reward model learns to prefer in a few steps: the
    prompts that ask for it (of toy_prompts(512, seed)) and preference pairs over them, the letter four
    times chosen against another letter four times or half and half."""
    prompts = [record for record in toy_prompts(512, seed=seed) if record["label"] == letter]
    others = [other for other in TOY_LETTERS if other != letter]
    pairs = [{"prompt": record["prompt"], "chosen": letter * 4, "rejected": other * 4 if i % 2 else letter * 2 + other * 2}
             for i, record in enumerate(prompts) for other in others]
    return prompts, pairs


def _corpus(vocab_size: int) -> list[str]:
    """Text the tokenizer is trained on: the toy prompts and answers and the chat roles, which fill the
    tiny vocabulary, and for a larger one a pseudo-word (a syllable string, in the text twice so that
    BPE merges it into one token) per entry beyond the tiny vocabulary."""
    prompts = [record["prompt"] for record in toy_prompts()]
    answers = [letter * n for letter in TOY_LETTERS for n in (1, 2, 4, 8)]
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(2, 4)))
             for _ in range(vocab_size - SHAPES["tiny"].vocab_size)] * 2
    rng.shuffle(words)
    lines = [" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]
    return prompts + answers + ["system user assistant"] * 4 + lines


def build_tokenizer(vocab_size: int = SHAPES["tiny"].vocab_size) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every byte encodes) of at most vocab_size tokens, with pad/eos tokens
    and a ChatML-style template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, TURN, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(vocab_size), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD,
        chat_template=CHAT_TEMPLATE, model_max_length=MAX_POSITIONS,
    )


def model_config(shape: Shape, tokenizer: PreTrainedTokenizerFast, **overrides) -> Qwen2Config:
    return Qwen2Config(
        **{**asdict(shape), "vocab_size": len(tokenizer)},
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **overrides,
    )


def build_tiny_model(
    out_dir: str | Path, *, kind: Literal["causal-lm", "reward"] = "causal-lm", seed: int = 0, shape: str = "tiny"
) -> Path:
    """Write a tokenizer and a randomly initialised Qwen2 of a SHAPES name to out_dir; the same seed gives the same files.

    kind "causal-lm" is an actor/reference; "reward" is a sequence classifier with one label (a
    reward model or critic).
    """
    builders = {"causal-lm": AutoModelForCausalLM, "reward": AutoModelForSequenceClassification}
    if kind not in builders:
        raise ValueError(f"unknown tiny model kind {kind!r}: use one of {', '.join(builders)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: use one of {', '.join(SHAPES)}")
    out = Path(out_dir)
    tokenizer = build_tokenizer(SHAPES[shape].vocab_size)
    config = model_config(SHAPES[shape], tokenizer, **({"num_labels": 1} if kind == "reward" else {}))
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        model = builders[kind].from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
