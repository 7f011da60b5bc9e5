"""Where a reward model's score is read: at the end of the whole text (an outcome reward model, trained by
rm), or at the end of every step (a process reward model, trained by prm; reward.sources[].steps).

A solution is its steps, each followed by the separator (data.stepSeparator in training, steps.separator
when scoring). Each step and each separator is tokenized on its own, so that a step's score sits on its
separator's last token whatever the tokenizer would merge across the join, and training
(offline_data) and scoring (workers.ModelWorker.score) put it at the same place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from rlhf_api.v1alpha1 import StepReward

from ..losses import Registry

# The key of a process reward model's config.json that holds the separator it learnt (written by prm's export,
# checked against a reward source's steps.separator before a run starts: checks.py).
STEP_SEPARATOR_KEY = "step_separator"
# [steps] probabilities that each step is correct -> the completion's reward (a 0-d tensor)
STEP_AGGREGATIONS: Registry[Callable[[Tensor], Tensor]] = Registry("step aggregation")


@STEP_AGGREGATIONS.register("min")
def weakest_step(correct: Tensor) -> Tensor:
    """A solution is as good as its weakest step (Wang et al. 2024, Math-Shepherd, arXiv:2312.08935)."""
    return correct.min()


@STEP_AGGREGATIONS.register("product")
def every_step_correct(correct: Tensor) -> Tensor:
    """The probability that every step is correct (Lightman et al. 2023, arXiv:2305.20050)."""
    return correct.prod()


@STEP_AGGREGATIONS.register("last")
def final_step(correct: Tensor) -> Tensor:
    return correct[-1]


@dataclass(frozen=True)
class ReadText:
    """A text's token ids and the positions where the model's score is read."""

    ids: list[int]
    positions: list[int]  # the last token (rm), or each step's separator's last token (prm)


def split_steps(completion: str, separator: str) -> list[str]:
    """The text between separators; a completion that ends with the separator has no empty step after it."""
    steps = completion.split(separator)
    return steps[:-1] if len(steps) > 1 and not steps[-1] else steps


def step_token_ids(tokenizer, steps: list[str], separator: str) -> ReadText:
    """The steps' token ids, each step followed by the separator's, read at each separator's last token."""
    separator_ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    ids, ends = [], []
    for step_ids in tokenizer(steps, add_special_tokens=False)["input_ids"]:
        ids += step_ids + separator_ids
        ends.append(len(ids) - 1)
    return ReadText(ids, ends)


def read_texts(tokenizer, prompts: list[str], completions: list[str], steps: StepReward | None,
               max_length: int) -> list[ReadText]:
    """What a reward model reads of each prompt + completion, cut from the left to max_length tokens (a step
    whose end is cut off is not read). Without steps: the text with eos, as rm trains on it, read at its end."""
    if not prompts:
        return []  # a tokenizer refuses an empty batch
    if steps is None:
        texts = [p + c + tokenizer.eos_token for p, c in zip(prompts, completions)]
        whole = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [_cut(ReadText(ids, [len(ids) - 1]), max_length) for ids in whole]
    reads = []
    for prompt, completion in zip(tokenizer(prompts, add_special_tokens=False)["input_ids"], completions):
        solution = step_token_ids(tokenizer, split_steps(completion, steps.separator), steps.separator)
        reads.append(_cut(ReadText(prompt + solution.ids, [len(prompt) + end for end in solution.positions]),
                          max_length))
    return reads


def _cut(text: ReadText, max_length: int) -> ReadText:
    cut = max(len(text.ids) - max_length, 0)
    return ReadText(text.ids[cut:], [p - cut for p in text.positions if p >= cut])


def score_reads(score_tokens: Callable[[Tensor, Tensor], Tensor], reads: list[ReadText], pad_token_id: int,
                batch_size: int, steps: StepReward | None) -> Tensor:
    """Each text's reward [N] (reward_of), batch_size texts at a time, right-padded; score_tokens(input_ids,
    attention_mask) -> the model's score at every position [b, S] on the CPU."""
    rewards = []
    for start in range(0, len(reads), batch_size):
        chunk = reads[start:start + batch_size]
        width = max(len(read.ids) for read in chunk)
        ids = torch.tensor([read.ids + [pad_token_id] * (width - len(read.ids)) for read in chunk])
        attention_mask = torch.tensor([[1] * len(read.ids) + [0] * (width - len(read.ids)) for read in chunk])
        rewards += [reward_of(row[read.positions], steps) for row, read in zip(score_tokens(ids, attention_mask), chunk)]
    return torch.stack(rewards).float() if rewards else torch.zeros(0)


def reward_of(scores: Tensor, steps: StepReward | None) -> Tensor:
    """A completion's reward from the model's scores at its read positions [P]: the score itself (rm); the
    steps' probabilities of being correct, aggregated (prm; a completion with no step left scores 0)."""
    if steps is None:
        return scores[-1]
    if not scores.numel():
        return torch.tensor(0.0)
    return STEP_AGGREGATIONS[steps.aggregation](torch.sigmoid(scores.float()))
