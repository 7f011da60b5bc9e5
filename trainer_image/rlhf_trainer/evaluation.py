"""Evaluation during training (spec.evaluation): held-out prompt sets sampled with the rollout engines
(and environment) and scored with the run's reward; the metrics and the choice of the best checkpoint.

Metrics, per set: eval/<set>/mean_reward (over every sample) and eval/<set>/pass@<k> (k written out:
pass@4), the unbiased
estimate of the chance that at least one of k samples of a prompt passes (its reward reaches
passThreshold), averaged over prompts (Chen et al. 2021, arXiv:2107.03374); with bestMetric also
eval/best/step and eval/best/value.
"""

from __future__ import annotations

from math import comb
from pathlib import Path

from torch import Tensor

from rlhf_api.v1alpha1 import DataSpec, EvaluationSpec, RolloutSpec

from .data import PromptDataset
from .rewards import RewardResult

PREFIX = "eval/"


def pass_at_k(passed: Tensor, k: int) -> float:
    """passed [G, n] bool (n samples of each of G prompts): mean over prompts of 1 - C(n - c, k) / C(n, k)."""
    n = passed.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n samples per prompt, got k={k}, n={n}")
    correct = passed.sum(dim=1).tolist()
    return sum(1.0 - comb(n - c, k) / comb(n, k) for c in correct) / len(correct)


class Evaluation:
    """The sets, when they are due, their sampling and metrics, and which value is best."""

    def __init__(self, spec: EvaluationSpec, data: DataSpec, tokenizer, *, base_dir: Path, seed: int):
        self.spec = spec
        self.k = spec.pass_k or spec.samples_per_prompt
        self.sets = {d.name: PromptDataset.from_spec(d, data, tokenizer, base_dir=base_dir, seed=seed)
                     for d in spec.datasets}

    def due(self, step: int, total_steps: int) -> bool:
        """After step `step` (0: before the first): every intervalSteps, after the last one, and at 0 with atStart."""
        if step == 0:
            return self.spec.at_start
        interval = self.spec.interval_steps
        return step == total_steps or bool(interval and step % interval == 0)

    def sampling(self, rollout: RolloutSpec) -> dict:
        """vLLM sampling of the evaluation: its own samples and temperature, the rollout's length limit."""
        return dict(n=self.spec.samples_per_prompt, max_tokens=rollout.max_new_tokens,
                    temperature=self.spec.temperature)

    def metrics(self, name: str, reward: RewardResult) -> dict[str, float]:
        """A set's metrics from its rewards [prompts * samplesPerPrompt], prompt-major: the task's own
        (unshaped) reward, comparable across runs whatever their length shaping."""
        rewards = reward.task
        passed = (rewards >= self.spec.pass_threshold).reshape(-1, self.spec.samples_per_prompt)
        return {f"{PREFIX}{name}/mean_reward": rewards.float().mean().item(),
                f"{PREFIX}{name}/pass@{self.k}": pass_at_k(passed, self.k)}

    def best_value(self, metrics: dict[str, float]) -> float | None:
        """The value of bestMetric among an evaluation's metrics (None without bestMetric); its
        <set>/pass@k names the set's pass@<k>."""
        if not self.spec.best_metric:
            return None
        return metrics[PREFIX + self.spec.best_metric.replace("/pass@k", f"/pass@{self.k}")]

    def better(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        return value > best if self.spec.best_mode == "max" else value < best


__all__ = ["Evaluation", "PREFIX", "pass_at_k"]
