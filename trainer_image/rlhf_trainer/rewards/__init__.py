"""Rewards for online RL: every source scores each completion; the total is their weighted sum.

    reward = build_reward(spec.reward, base_dir=job_dir)
    result = reward.score(prompts, completions, labels)  # result.total: [N], result.by_source[name]: [N]

Source types are a registry (SOURCE_BUILDERS): a builder turns a RewardSource into a scorer,
`scorer(prompts, completions, labels) -> N numbers`. Scores are checked here, once for all types.
A scorer that takes an `images` keyword (a function with that parameter or **kwargs, an http source) also
gets each prompt's images of a vision-language job: their references (data.PromptItem.images: absolute
paths, URLs or base64 data URIs), a list per prompt, never the pixels.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from rlhf_api.v1alpha1 import RewardSource, RewardSpec, StepReward

from .. import redact
from .function import function_source
from .http import http_source
from .model import RewardModelScorer, model_source

Scorer = Callable[[list[str], list[str], list[Any]], Sequence[float] | Tensor]


class RewardError(RuntimeError):
    """A reward source could not be built or misbehaved; the message names the source."""


@dataclass(frozen=True)
class SourceContext:
    """What builders may need besides the source itself."""

    base_dir: Path  # the job file's directory: relative paths start here
    # scores for type model (e.g. a Ray actor's): (prompts, completions, the source's steps or None) -> [N]
    model_scorer: Callable[[list[str], list[str], StepReward | None], Tensor] | None


SOURCE_BUILDERS: dict[str, Callable[[RewardSource, SourceContext], Scorer]] = {
    "function": function_source,
    "http": http_source,
    "model": model_source,
}


@dataclass
class RewardResult:
    total: Tensor  # [N] float32: what trains; sum of weight * source score, shaped (sampling.shape_rewards)
    by_source: dict[str, Tensor]  # source name -> [N] float32 unweighted scores
    # [N] float32: the task's own reward (DAPO's accuracy), unshaped: what dynamic sampling filters on
    # and evaluation scores. The sources' weighted sum, plus an environment's episode reward.
    task: Tensor


def _describe(source: RewardSource) -> str:
    where = source.function.entrypoint if source.function else redact.url(source.http.url) if source.http else "spec.models.reward"
    return f"reward source {source.name!r} ({source.type} {where})"


def _as_scores(values: Any, count: int, source: RewardSource) -> Tensor:
    """values as a [count] float32 tensor, or a RewardError saying what is wrong with them."""
    what = _describe(source)
    if hasattr(values, "tolist"):  # a torch tensor or numpy array
        if values.ndim != 1:
            raise RewardError(f"{what} returned an array of shape {tuple(values.shape)}: return one score per completion, shape [{count}]")
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"{what} returned {type(values).__name__}: return a list with one float per completion")
    if len(values) != count:
        raise RewardError(f"{what} returned {len(values)} scores for {count} completions: return one per completion")
    for index, value in enumerate(values):
        if not isinstance(value, numbers.Real):
            raise RewardError(f"{what} returned {value!r} ({type(value).__name__}) at index {index}: scores must be numbers")
    scores = torch.tensor(values, dtype=torch.float32)
    if not torch.isfinite(scores).all():
        bad = int((~torch.isfinite(scores)).nonzero()[0])
        raise RewardError(f"{what} returned {values[bad]} at index {bad}: scores must be finite")
    return scores


def takes_images(scorer: Scorer) -> bool:
    """Whether a scorer takes the prompts' image references: an `images` parameter, or **kwargs."""
    import inspect

    try:
        parameters = inspect.signature(scorer).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        return False
    return any(p.name == "images" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class Reward:
    """Weighted sources; see build_reward."""

    def __init__(self, sources: list[tuple[RewardSource, Scorer]]):
        self.sources = sources

    def score(self, prompts: list[str], completions: list[str], labels: list[Any] | None = None,
              images: list[list[str]] | None = None) -> RewardResult:
        """Scores of N completions: prompts[i] (as given to the generator), completions[i], labels[i]; images[i]
        the prompt's image references, for the scorers that take them."""
        labels = [None] * len(prompts) if labels is None else list(labels)
        if not len(prompts) == len(completions) == len(labels):
            raise ValueError(f"got {len(prompts)} prompts, {len(completions)} completions and {len(labels)} labels; they must match")
        total = torch.zeros(len(prompts), dtype=torch.float32)
        by_source = {}
        for source, scorer in self.sources:
            try:
                values = scorer(prompts, completions, labels, **({"images": images} if images and takes_images(scorer) else {}))
            except Exception as error:
                raise RewardError(f"{_describe(source)} failed: {error}") from error
            by_source[source.name] = _as_scores(values, len(prompts), source)
            total += source.weight * by_source[source.name]
        return RewardResult(total, by_source, total.clone())


def build_reward(
    spec: RewardSpec,
    *,
    base_dir: Path,
    model_scorer: Callable[[list[str], list[str]], Tensor] | None = None,
) -> Reward:
    """The job's reward. Sources of type model score with model_scorer (the reward-model group's call)."""
    context = SourceContext(Path(base_dir), model_scorer)
    sources = []
    for source in spec.sources:
        try:
            sources.append((source, SOURCE_BUILDERS[source.type](source, context)))
        except Exception as error:
            raise RewardError(f"{_describe(source)}: {error}") from error
    return Reward(sources)


__all__ = [
    "SOURCE_BUILDERS",
    "Reward",
    "RewardError",
    "RewardModelScorer",
    "RewardResult",
    "Scorer",
    "SourceContext",
    "build_reward",
]
