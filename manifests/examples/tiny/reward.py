"""Reward of the tiny toy task: the fraction of the answer's characters that are the asked letter.

"Repeat the letter c." answered "cccc" scores 1.0, "ccxx" 0.5, "" or "xyz" 0.0. Whitespace is
ignored. The score is dense, so even a randomly initialised model's samples differ in reward.
"""


def letter_fraction(completion: str, letter: str) -> float:
    chars = [c for c in completion if not c.isspace()]
    return sum(c == letter for c in chars) / len(chars) if chars else 0.0


def score(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    return [letter_fraction(completion, label) for completion, label in zip(completions, labels)]
