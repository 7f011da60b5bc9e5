"""A run that cannot learn says so.

When every group's rewards are equal (a prompt's samples all scored alike: every reward 0 on a task the
model never gets right, say), every group-relative advantage is zero and the policy does not move, while
the progress bar shows `reward=0, kl=0, loss=0` as if all were well. The trainer counts such steps in a
row (the metric METRIC, in every reporter), logs a warning once the count reaches STALL_STEPS, and the
status reporter (kube_status.py) sets the job's condition CONDITION with the reward statistics and what
to check, cleared once a step has signal again. Only for the algorithms that learn from a reward
(rlhf_api.algorithms.NEEDS_REWARD): distill's signal is its teacher.
"""

from __future__ import annotations

import logging

from torch import Tensor

from rlhf_api import contract

log = logging.getLogger(__name__)

STALL_STEPS = 3  # steps in a row without signal before the run says so
METRIC = "zero_advantage_steps"  # steps in a row whose groups all had equal rewards (0 after one that had not)
CONDITION = contract.TRAINER_CONDITION
STALLED, LEARNING = contract.NO_LEARNING_SIGNAL, contract.LEARNING_SIGNAL  # the condition's reasons, True and False


def has_signal(rewards: Tensor, samples_per_prompt: int) -> bool:
    """rewards [B]: prompt-major, samples_per_prompt consecutive samples per prompt. With one sample per
    prompt (a critic's baseline) the group is the whole batch."""
    groups = rewards.view(-1, samples_per_prompt) if samples_per_prompt > 1 else rewards.view(1, -1)
    return bool((groups.amax(dim=1) > groups.amin(dim=1)).any())


def advice(steps: int, reward_mean: float, reward_std: float) -> str:
    return (f"no learning signal for {steps} steps in a row: within every group of samples the rewards were equal "
            f"(mean {reward_mean:.4g}, std {reward_std:.4g}), so every advantage is zero and the policy does not change. "
            "Check the reward function (does it ever score two answers differently?), the task's difficulty for "
            "this model, rollout.samplesPerPrompt (more samples make a differing one likelier), rollout.temperature, "
            "and rollout.maxNewTokens (truncated answers: see the truncated_fraction metric)")


def condition(metrics: dict[str, float]) -> dict[str, str] | None:
    """The job's CONDITION for a step's metrics: True from STALL_STEPS steps without signal on, False
    once a step has signal again; None on metrics of a step that carries no count (an evaluation's)."""
    steps = metrics.get(METRIC)
    if steps is None:
        return None
    if steps >= STALL_STEPS:
        return {"type": CONDITION, "status": "True", "reason": STALLED,
                "message": advice(int(steps), metrics.get("reward_mean", 0.0), metrics.get("reward_std", 0.0))}
    return {"type": CONDITION, "status": "False", "reason": LEARNING,
            "message": "the last step's rewards differed within a group: the policy gets a gradient"}


class Streak:
    """Counts the steps in a row without signal; warns once per streak, when it reaches STALL_STEPS."""

    def __init__(self) -> None:
        self.steps = 0

    def observe(self, rewards: Tensor, samples_per_prompt: int) -> int:
        self.steps = 0 if has_signal(rewards, samples_per_prompt) else self.steps + 1
        if self.steps == STALL_STEPS:
            log.warning("%s", advice(self.steps, rewards.mean().item(), rewards.std().item() if rewards.numel() > 1 else 0.0))
        return self.steps
