"""The algorithm catalogue: one entry per algorithm, the only place an algorithm is declared.

Everything else is derived from it: the API's `spec.algorithm` enum and the CRD's CEL rules
(which dataset an algorithm reads, who needs a reward or several samples per prompt), the
trainer's model groups, which training loop runs it, which advantage estimator or offline
objective it uses, and the loss aggregation it defaults to (keys of the trainer's registries; a
test checks that every key is registered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dataset = Literal["prompts", "preferences", "sft"]


@dataclass(frozen=True)
class AlgorithmInfo:
    name: str
    paper: str  # where it comes from (the docs and `kubectl explain` cite it)
    dataset: Dataset  # the spec.data field it trains on; prompts means online RL (rollouts, rewards)
    # Model groups it always runs. Online runs add a reference when training.kl.coef > 0 and a
    # reward group when a reward source is a model; offline ones train roles[0].
    roles: tuple[str, ...]
    advantage: str | None = None  # online: rlhf_trainer.algorithms.ADVANTAGE_ESTIMATORS key
    objective: str | None = None  # offline: rlhf_trainer.offline.OBJECTIVES key
    group_samples: bool = False  # compares the samples of one prompt: needs rollout.samplesPerPrompt > 1
    # training.lossAggregation when unset: an rlhf_trainer.losses.LOSS_AGGREGATIONS key
    loss_aggregation: str = "token-mean"

    @property
    def online(self) -> bool:
        return self.dataset == "prompts"


CATALOGUE: tuple[AlgorithmInfo, ...] = (
    AlgorithmInfo("ppo", "Schulman et al. 2017, arXiv:1707.06347; Ouyang et al. 2022, arXiv:2203.02155",
                  "prompts", ("actor", "critic"), advantage="gae"),
    AlgorithmInfo("grpo", "Shao et al. 2024, arXiv:2402.03300", "prompts", ("actor",),
                  advantage="group-norm", group_samples=True),
    AlgorithmInfo("dr-grpo", "Liu et al. 2025, arXiv:2503.20783", "prompts", ("actor",),
                  advantage="dr-grpo", group_samples=True, loss_aggregation="seq-mean-token-sum-norm"),
    AlgorithmInfo("reinforce++", "Hu 2025, arXiv:2501.03262", "prompts", ("actor",), advantage="reinforce++"),
    AlgorithmInfo("reinforce++-baseline", "Hu 2025, arXiv:2501.03262", "prompts", ("actor",),
                  advantage="reinforce++-baseline", group_samples=True),
    AlgorithmInfo("rloo", "Ahmadian et al. 2024, arXiv:2402.14740", "prompts", ("actor",),
                  advantage="rloo", group_samples=True),
    AlgorithmInfo("dpo", "Rafailov et al. 2023, arXiv:2305.18290", "preferences", ("actor", "reference"),
                  objective="preference"),
    AlgorithmInfo("ipo", "Azar et al. 2023, arXiv:2310.12036", "preferences", ("actor", "reference"),
                  objective="preference"),
    AlgorithmInfo("cdpo", "Mitchell 2023, conservative DPO", "preferences", ("actor", "reference"),
                  objective="preference"),
    AlgorithmInfo("kto", "Ethayarajh et al. 2024, arXiv:2402.01306", "preferences", ("actor", "reference"),
                  objective="kto"),
    AlgorithmInfo("sft", "supervised fine-tuning on prompt/response records", "sft", ("actor",), objective="sft"),
    AlgorithmInfo("rm", "Bradley-Terry reward model, Ouyang et al. 2022, arXiv:2203.02155", "preferences",
                  ("rm",), objective="pairwise"),
)

ALGORITHMS: dict[str, AlgorithmInfo] = {a.name: a for a in CATALOGUE}
NAMES: tuple[str, ...] = tuple(ALGORITHMS)
ONLINE: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.online)
OFFLINE: tuple[str, ...] = tuple(a.name for a in CATALOGUE if not a.online)
GROUP_SAMPLES: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.group_samples)
USES_CRITIC: tuple[str, ...] = tuple(a.name for a in CATALOGUE if "critic" in a.roles)


def reading(dataset: Dataset) -> tuple[str, ...]:
    """The algorithms that train on spec.data.<dataset>."""
    return tuple(a.name for a in CATALOGUE if a.dataset == dataset)


def cel_list(names: tuple[str, ...]) -> str:
    """A CEL list literal of algorithm names: ['ppo','grpo']."""
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


def prose(names: tuple[str, ...]) -> str:
    """Names for a message: 'dpo, ipo and rm'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
