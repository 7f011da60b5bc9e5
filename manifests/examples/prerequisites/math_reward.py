"""Reward of grpo-job.yaml (GSM8K): 1.0 when the completion's final answer equals the label's, else 0.0.

The label is GSM8K's answer field, a worked solution that ends "#### 72" (a bare "72" works too). The
completion's final answer is, in order: the last \\boxed{...} (Qwen2.5's math habit), the number after
the last "####", else its last number. Numbers compare by value: "1,000", "$1000.00" and "1000" agree,
as do "\\frac{1}{2}" and "0.5". The trainer calls score(prompts, completions, labels), one entry each a completion.
"""

import re
from fractions import Fraction

NUMBER = re.compile(r"-?\d+/\d+|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
FRACTION = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")  # LaTeX \frac{1}{2} (or \dfrac) read as 1/2


def boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces inside it balanced; None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for end in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth < 0:
            return text[begin:end]
    return None  # cut off by maxNewTokens before the brace closed


def value(text: str) -> Fraction | None:
    """The last number in text (thousands separators dropped, a fraction kept whole); None without one."""
    numbers = NUMBER.findall(FRACTION.sub(r"\1/\2", text))
    try:
        return Fraction(numbers[-1].replace(",", "")) if numbers else None
    except ZeroDivisionError:  # "1/0"
        return None


def final_answer(text: str) -> Fraction | None:
    found = boxed(text)
    if found is None and "####" in text:
        found = text.rsplit("####", 1)[1]
    return value(text if found is None else found)


def score(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    rewards = []
    for completion, label in zip(completions, labels):
        answer, expected = final_answer(completion), final_answer(label)
        rewards.append(float(answer is not None and answer == expected))
    return rewards
