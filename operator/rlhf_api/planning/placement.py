"""Where a job's ranks go: one bundle per GPU (per process on CPU), each role's ranks and the vLLM engines on
bundles of their own or shared (training.colocation), each taking an equal fraction of a shared bundle:

- none: every role, and the vLLM engines, on bundles of their own;
- actor-reference: the reference ranks on the actor's bundles;
- all (hybrid engine): every role and every engine on the same bundles, taking turns.

On CPU (resources.gpusPerNode 0) a bundle is one CPU, resources.gpus.<role> counts processes,
and each role defaults to one.

A role may be served by another role's ranks (`shared_roles`) and then takes no bundles: the
reference of a LoRA actor is the actor's base weights with its adapters switched off.

Arithmetic only: the trainer reserves these bundles as a Ray placement group (rlhf_trainer.workers.group), and
`rlhf validate --gpu` plans a job's memory on them without Ray.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rlhf_api.algorithms import ALGORITHMS
from rlhf_api.v1alpha1 import RLHFJobSpec
from rlhf_api.validation import FieldError, InvalidJob

ROLLOUT = "rollout"


@dataclass
class Placement:
    use_gpu: bool
    bundles: int
    ranks: dict[str, list[int]]  # role -> bundle of each rank; "rollout" -> first bundle of each engine
    engine_width: int = 1  # bundles per vLLM engine (its tensor-parallel size)
    shared: dict[str, str] = field(default_factory=dict)  # role -> the role whose ranks serve it (shared_roles)

    @property
    def bundle(self) -> dict[str, float]:
        """What one bundle asks of the node it lands on: a GPU and a CPU to drive it, or a CPU."""
        return {"GPU": 1, "CPU": 1} if self.use_gpu else {"CPU": 1}

    @property
    def bundle_resources(self) -> list[dict[str, float]]:
        return [self.bundle] * self.bundles

    @property
    def needs(self) -> dict[str, float]:
        """What the whole placement group asks of the cluster, per resource."""
        return {kind: amount * self.bundles for kind, amount in self.bundle.items()}

    def bundles_of(self, role: str) -> set[int]:
        """The bundles a role's processes run on (an engine's every tensor-parallel bundle; a shared
        role's, its serving role's)."""
        if role == ROLLOUT:
            return {b + i for b in self.ranks.get(ROLLOUT, []) for i in range(self.engine_width)}
        return set(self.ranks.get(self.shared.get(role, role), []))

    def colocated(self, *roles: str) -> bool:
        """Whether two of these roles run on a bundle in common: on GPUs they hold its memory together,
        so their passes take turns (one model's activations at a time) and vLLM starts before the
        models load (it sizes its KV cache from the memory it finds free)."""
        seen: set[int] = set()
        for role in roles:
            bundles = self.bundles_of(role)
            if seen & bundles:
                return True
            seen |= bundles
        return False

    @property
    def engines_colocated(self) -> bool:
        """Whether a vLLM engine runs on a bundle of a model group (the hybrid engine)."""
        return any(self.colocated(ROLLOUT, role) for role in self.ranks if role != ROLLOUT)

    def share(self, bundle: int) -> float:
        """The fraction of a bundle each of the Ray actors placed on it gets."""
        users = Counter(b for role, bundles in self.ranks.items() if role != ROLLOUT for b in bundles)
        users.update(b + i for b in self.ranks.get(ROLLOUT, []) for i in range(self.engine_width))
        return 1.0 / users[bundle]


def roles_of(spec: RLHFJobSpec) -> list[str]:
    """The model groups a job needs: its algorithm's (the catalogue's), and for online RL the reference
    with a KL penalty (online-dpo always has one) and the reward model only when a reward source uses it."""
    algorithm = ALGORITHMS[spec.algorithm]
    roles = list(algorithm.roles)
    if not algorithm.online:
        return roles
    if spec.training.kl.coef > 0 and "reference" not in roles:
        roles.insert(1, "reference")
    if spec.reward and any(source.type == "model" for source in spec.reward.sources):
        roles.append("reward")
    return roles


def shared_roles(spec: RLHFJobSpec) -> dict[str, str]:
    """Roles served by another role's ranks, role -> serving role. A LoRA actor's frozen base is the
    reference when the reference would be the actor's initial weights (no models.reference): its
    log-probs are read with the adapters switched off, with no second copy of the model. A separate
    reference group is still loaded when models.reference names a model of its own, and for an
    actor that trains all its weights (its initial weights are gone after the first update)."""
    if "reference" in roles_of(spec) and spec.models.actor.lora is not None and spec.models.reference is None:
        return {"reference": "actor"}
    return {}


def plan_placement(spec: RLHFJobSpec, use_gpu: bool) -> Placement:
    """Ranks per role and their bundles; raises InvalidJob when the roles do not fit the GPUs."""
    shared, colocation = shared_roles(spec), spec.training.colocation
    roles = [role for role in roles_of(spec) if role not in shared]
    explicit = {role: getattr(spec.resources.gpus, "actor" if role == "rm" else role) for role in roles}
    tp = spec.rollout.tensor_parallel_size
    engines = spec.rollout.engines if ALGORITHMS[spec.algorithm].online else 0
    engine_gpus = engines * tp
    if not use_gpu:
        sizes = {role: explicit[role] or 1 for role in roles}
    elif colocation == "all":
        total = spec.resources.nodes * spec.resources.gpus_per_node
        sizes = {role: explicit[role] or total for role in roles}
    else:
        sizes = _split_gpus(spec, roles, explicit, engine_gpus)

    ranks: dict[str, list[int]] = {}
    if colocation == "all":
        for role in roles:
            ranks[role] = list(range(sizes[role]))
        ranks[ROLLOUT] = [e * tp for e in range(engines)]
        bundles = max([*sizes.values(), engine_gpus])
    else:
        bundles = 0
        for role in roles:
            if role == "reference" and colocation == "actor-reference":
                ranks[role] = list(range(sizes[role]))  # on the actor's bundles
                bundles = max(bundles, sizes[role])
                continue
            ranks[role] = list(range(bundles, bundles + sizes[role]))
            bundles += sizes[role]
        ranks[ROLLOUT] = [bundles + e * tp for e in range(engines)]
        bundles += engine_gpus
    return Placement(use_gpu, bundles, ranks, tp, shared)


def _split_gpus(spec: RLHFJobSpec, roles: list[str], explicit: dict, engine_gpus: int) -> dict[str, int]:
    """GPUs per role when roles do not all share: the vLLM engines first, then roles without a
    count split what is left evenly (actor and reference as one unit under actor-reference)."""
    total = spec.resources.nodes * spec.resources.gpus_per_node
    shared = spec.training.colocation == "actor-reference"
    units = [role for role in roles if not (shared and role == "reference")]
    left = total - engine_gpus - sum(explicit[role] or 0 for role in units)
    unset = [role for role in units if not explicit[role]]
    each = left // len(unset) if unset else 0
    if left < 0 or (unset and each < 1):
        counts = ", ".join(f"{role}={explicit[role] or 'auto'}" for role in roles)
        raise InvalidJob([FieldError("spec.resources.gpus", (
            f"the roles do not fit in {total} GPUs (nodes * gpusPerNode) next to {engine_gpus} for vLLM "
            f"(engines * tensorParallelSize); counts: {counts}. Add GPUs, lower the counts, or share GPUs "
            "with training.colocation"))])
    sizes = {role: explicit[role] or each for role in units}
    if shared and "reference" in roles:
        sizes["reference"] = explicit["reference"] or sizes["actor"]
    return sizes
