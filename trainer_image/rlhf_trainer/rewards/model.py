"""Reward sources of type model: a sequence classifier with one label scores prompt + completion (with
`steps`, a process reward model each step: rewards/process.py).

In a run the reward-model group (workers.ModelWorker.score) scores, and `build_reward` gets its
call. RewardModelScorer scores the same text in one process: a trained rm tried by hand, and the
reference the reward group is tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlhf_api.v1alpha1 import RewardSource, StepReward

from .process import read_texts, score_reads

if TYPE_CHECKING:
    from . import SourceContext


class RewardModelScorer:
    def __init__(
        self, model_path: str, tokenizer_path: str | None = None, dtype: str | torch.dtype = "float32",
        *, batch_size: int = 8, device: str | None = None, revision: str | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # only when a model source exists

        from ..workers.engine import ValueModel

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path, revision=revision)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        classifier = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype, revision=revision)
        self.max_length = classifier.config.max_position_embeddings
        self.model = ValueModel(classifier).to(self.device).eval()  # read at every position

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], steps: StepReward | None = None) -> Tensor:
        """[N] float32 rewards: the score at the last token of prompt + completion + eos (reward models learn
        on sequences that end with eos, as generated ones do), or with steps each step's, aggregated."""
        reads = read_texts(self.tokenizer, prompts, completions, steps, self.max_length)
        return score_reads(lambda ids, mask: self.model(ids.to(self.device), mask.to(self.device)).cpu(), reads,
                           self.tokenizer.pad_token_id, self.batch_size, steps)

    def step_accuracy(self, prompts: list[str], solutions: list[list[str]], labels: list[list[bool]],
                      separator: str = "\n") -> float:
        """The share of the solutions' steps whose probability of being correct is on their label's side of 0.5,
        step k read as a process reward source reads the solution cut after it (aggregation last); labels in any
        form prm's data takes (true/false, 1/0, +/-)."""
        from ..offline_data import step_label  # offline_data reads steps through this package

        cut = [(prompt, separator.join(steps[:k + 1])) for prompt, steps in zip(prompts, solutions)
               for k in range(len(steps))]
        correct = self([prompt for prompt, _ in cut], [prefix for _, prefix in cut],
                       StepReward(separator=separator, aggregation="last"))
        return ((correct > 0.5) == torch.tensor([step_label(x) for steps in labels for x in steps])).float().mean().item()


def model_source(source: RewardSource, context: SourceContext):
    scorer = context.model_scorer
    if scorer is None:
        raise ValueError("a reward source of type model needs spec.models.reward")
    return lambda prompts, completions, labels: scorer(prompts, completions, source.steps)
