"""Reward of the arithmetic task: 1.0 when the answer's last number is the sum, else 0.0.

"12" and "7 + 5 = 12" both score 1.0 for "What is 7 + 5?"; an answer cut off by maxNewTokens
before it reaches a number, or one that ends on another number, scores 0.0. SmolLM2-135M-Instruct
gets about a third of them right before training, often after a long preamble.
"""

import re

NUMBER = re.compile(r"-?\d+")


def correct(completion: str, label: str) -> float:
    numbers = NUMBER.findall(completion)
    return float(bool(numbers) and numbers[-1] == label)


def score(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    return [correct(completion, label) for completion, label in zip(completions, labels)]
