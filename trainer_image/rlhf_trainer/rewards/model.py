"""Reward sources of type model: a sequence classifier with one label scores prompt + completion.

In a run the reward-model group (workers.ModelWorker.score) scores, and `build_reward` gets its
call. RewardModelScorer scores the same text in one process: a trained rm tried by hand, and the
reference the reward group is tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlhf_api.v1alpha1 import RewardSource

if TYPE_CHECKING:
    from . import SourceContext


class RewardModelScorer:
    def __init__(
        self, model_path: str, tokenizer_path: str | None = None, dtype: str | torch.dtype = "float32",
        *, batch_size: int = 8, device: str | None = None, revision: str | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # only when a model source exists

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path, revision=revision)
        self.tokenizer.truncation_side = "left"  # an over-long text keeps its completion
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype, revision=revision)
        self.model.to(self.device).eval()
        if self.model.config.pad_token_id is None:  # the classifier finds each sequence's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str]) -> Tensor:
        """[N] float32 scores, read at the last token of prompt + completion + eos."""
        # Reward models learn on sequences that end with eos, as generated ones do.
        texts = [prompt + completion + self.tokenizer.eos_token for prompt, completion in zip(prompts, completions)]
        scores = [torch.zeros(0)]  # so that no texts give an empty tensor
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True, truncation=True,
                max_length=self.model.config.max_position_embeddings, add_special_tokens=False,
            ).to(self.device)
            scores.append(self.model(**batch).logits[:, 0].float().cpu())
        return torch.cat(scores)


def model_source(source: RewardSource, context: SourceContext):
    scorer = context.model_scorer
    if scorer is None:
        raise ValueError("a reward source of type model needs spec.models.reward")
    return lambda prompts, completions, labels: scorer(prompts, completions)
