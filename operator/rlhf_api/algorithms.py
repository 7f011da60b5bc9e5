"""The algorithm catalogue: one entry per algorithm, the only place an algorithm is declared.

Everything else is derived from it: the API's `spec.algorithm` enum and the CRD's CEL rules
(which dataset an algorithm reads, who needs a reward or several samples per prompt), the
trainer's model groups, which training loop runs it, which advantage estimator and policy loss or
which offline objective it uses (keys of the trainer's registries; a test checks that every key is
registered), and the training settings it defaults to (the API server's MutatingAdmissionPolicy,
`rlhf validate` and the trainer all apply `training_defaults`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Dataset = Literal["prompts", "preferences", "sft"]
# What the model of each role is: a causal LM (its token log-probs are read), or else the same network with a
# one-label value head (critic, rm, reward); and the roles whose weights a run updates.
CAUSAL_LM_ROLES = ("actor", "reference", "teacher")
TRAINED_ROLES = ("actor", "critic", "rm")

# The spec.training fields whose default depends on the algorithm, with the value an algorithm that
# declares none gets. They have no constant CRD default: the API server fills them per algorithm.
TRAINING_DEFAULTS: dict[str, Any] = {"lossAggregation": "token-mean", "clipEps": 0.2, "clipEpsHigh": 0.0}


@dataclass(frozen=True)
class AlgorithmInfo:
    name: str
    paper: str  # where it comes from (the docs and `kubectl explain` cite it)
    dataset: Dataset  # the spec.data field it trains on; prompts means online RL (rollouts, rewards)
    # Model groups it always runs. Online runs add a reference when training.kl.coef > 0 (if they
    # have none) and a reward group when a reward source is a model; offline ones train roles[0].
    roles: tuple[str, ...]
    advantage: str | None = None  # online: rlhf_trainer.algorithms.ADVANTAGE_ESTIMATORS key
    policy_loss: str = "ppo-clip"  # online: rlhf_trainer.losses.POLICY_LOSSES key (the actor's loss)
    objective: str | None = None  # offline: rlhf_trainer.offline.OBJECTIVES key
    group_samples: bool = False  # compares the samples of one prompt: needs rollout.samplesPerPrompt > 1
    conditioned: bool = False  # offline: each prompt carries its record's score (data.<dataset>.scoreKey)
    # offline: each response is a list of steps, each with a label (data.<dataset>.labelKey, data.stepSeparator)
    step_labelled: bool = False
    # trains vision-language models on records with images (data.<dataset>.imageKey, image parts in messages):
    # its models load as image-text-to-text models (the actor and reference; no value-head roles)
    images: bool = False
    # spec.training fields (API names, TRAINING_DEFAULTS keys) this algorithm defaults differently
    defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def online(self) -> bool:
        return self.dataset == "prompts"

    @property
    def training_defaults(self) -> dict[str, Any]:
        """The value of each TRAINING_DEFAULTS field when the job leaves it unset."""
        return {**TRAINING_DEFAULTS, **self.defaults}


CATALOGUE: tuple[AlgorithmInfo, ...] = (
    AlgorithmInfo("ppo", "Schulman et al. 2017, arXiv:1707.06347; Ouyang et al. 2022, arXiv:2203.02155",
                  "prompts", ("actor", "critic"), advantage="gae"),
    AlgorithmInfo("grpo", "Shao et al. 2024, arXiv:2402.03300", "prompts", ("actor",),
                  advantage="group-norm", group_samples=True, images=True),
    AlgorithmInfo("dr-grpo", "Liu et al. 2025, arXiv:2503.20783", "prompts", ("actor",),
                  advantage="dr-grpo", group_samples=True, images=True, defaults={"lossAggregation": "seq-mean-token-sum-norm"}),
    AlgorithmInfo("gspo", "Zheng et al. 2025, arXiv:2507.18071", "prompts", ("actor",), advantage="group-norm",
                  policy_loss="gspo", group_samples=True, images=True,
                  defaults={"clipEps": 3e-4, "clipEpsHigh": 4e-4, "lossAggregation": "seq-mean-token-mean"}),
    AlgorithmInfo("reinforce++", "Hu 2025, arXiv:2501.03262", "prompts", ("actor",), advantage="reinforce++",
                  images=True),
    AlgorithmInfo("reinforce++-baseline", "Hu 2025, arXiv:2501.03262", "prompts", ("actor",),
                  advantage="reinforce++-baseline", group_samples=True, images=True),
    AlgorithmInfo("rloo", "Ahmadian et al. 2024, arXiv:2402.14740", "prompts", ("actor",),
                  advantage="rloo", group_samples=True, images=True),
    # Rejection sampling fine-tuning: the likelihood of each prompt's best samples, nothing of the rest.
    AlgorithmInfo("raft", "Dong et al. 2023, RAFT, arXiv:2304.06767", "prompts", ("actor",),
                  advantage="best-of-n", policy_loss="nll", group_samples=True, images=True),
    # Online (iterative) DPO: DPO's gradient on each prompt's best and worst sample, against the reference.
    AlgorithmInfo("online-dpo", "Xiong et al. 2024, arXiv:2312.11456; Guo et al. 2024, arXiv:2402.04792", "prompts",
                  ("actor", "reference"), advantage="dpo-pairs", policy_loss="nll", group_samples=True, images=True,
                  defaults={"lossAggregation": "seq-mean-token-sum"}),
    # On-policy distillation: the student samples, the teacher scores its tokens (reverse KL per token).
    AlgorithmInfo("distill", "Agarwal et al. 2024, GKD, arXiv:2306.13649; Gu et al. 2024, MiniLLM, arXiv:2306.08543",
                  "prompts", ("actor", "teacher"), advantage="reverse-kl"),
    AlgorithmInfo("dpo", "Rafailov et al. 2023, arXiv:2305.18290", "preferences", ("actor", "reference"),
                  objective="preference", images=True),
    AlgorithmInfo("ipo", "Azar et al. 2023, arXiv:2310.12036", "preferences", ("actor", "reference"),
                  objective="preference", images=True),
    AlgorithmInfo("cdpo", "Mitchell 2023, conservative DPO", "preferences", ("actor", "reference"),
                  objective="preference", images=True),
    AlgorithmInfo("kto", "Ethayarajh et al. 2024, arXiv:2402.01306", "preferences", ("actor", "reference"),
                  objective="kto"),
    AlgorithmInfo("sft", "supervised fine-tuning on prompt/response records", "sft", ("actor",), objective="sft",
                  images=True),
    # Conditional SFT: the sft objective on prompts that carry each response's quality score
    # (data.scoreTemplate), so that asking for the top score at inference asks for the best responses.
    AlgorithmInfo("csft", "Dong et al. 2023, SteerLM, arXiv:2310.05344", "sft", ("actor",), objective="sft",
                  conditioned=True),
    # Knowledge distillation on an SFT dataset: the response's NLL plus the forward KL to the teacher's
    # next-token distributions (its top-k), the soft targets.
    AlgorithmInfo("kd", "Hinton et al. 2015, arXiv:1503.02531; Kim & Rush 2016, arXiv:1606.07947", "sft",
                  ("actor", "teacher"), objective="kd"),
    AlgorithmInfo("rm", "Bradley-Terry reward model, Ouyang et al. 2022, arXiv:2203.02155", "preferences",
                  ("rm",), objective="pairwise"),
    # Process reward model: the reward model's score at the end of each step of a solution, trained on each
    # step's label (correct or not) and nowhere else; a reward source reads it step by step (reward.sources[].steps).
    AlgorithmInfo("prm", "Lightman et al. 2023, arXiv:2305.20050; Wang et al. 2024, Math-Shepherd, arXiv:2312.08935",
                  "sft", ("rm",), objective="process", step_labelled=True),
)

ALGORITHMS: dict[str, AlgorithmInfo] = {a.name: a for a in CATALOGUE}
NAMES: tuple[str, ...] = tuple(ALGORITHMS)
ONLINE: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.online)
OFFLINE: tuple[str, ...] = tuple(a.name for a in CATALOGUE if not a.online)
GROUP_SAMPLES: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.group_samples)
USES_CRITIC: tuple[str, ...] = tuple(a.name for a in CATALOGUE if "critic" in a.roles)
USES_TEACHER: tuple[str, ...] = tuple(a.name for a in CATALOGUE if "teacher" in a.roles)
# Online algorithms whose training signal is a reward (a teacher's is not: its reward only adds to it).
NEEDS_REWARD: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.online and "teacher" not in a.roles)
# Algorithms that load a reference whatever training.kl says (the other online ones load one for a KL penalty).
ALWAYS_REFERENCED: tuple[str, ...] = tuple(a.name for a in CATALOGUE if "reference" in a.roles)
CONDITIONED: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.conditioned)
STEP_LABELLED: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.step_labelled)
TAKES_IMAGES: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.images)
USES_BEST_OF_N: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.advantage == "best-of-n")
# Weigh each sample by the policy that sampled it: exact for one optimizer step per rollout.
ONE_STEP_PER_ROLLOUT: tuple[str, ...] = tuple(a.name for a in CATALOGUE if a.advantage == "dpo-pairs")


def reading(dataset: Dataset) -> tuple[str, ...]:
    """The algorithms that train on spec.data.<dataset>."""
    return tuple(a.name for a in CATALOGUE if a.dataset == dataset)


def cel_list(names: tuple[str, ...]) -> str:
    """A CEL list literal of algorithm names: ['ppo','grpo']."""
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


def prose(names: tuple[str, ...]) -> str:
    """Names for a message: 'dpo, ipo and rm'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
