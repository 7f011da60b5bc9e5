"""Trainer-side checks: combinations the CRD's schema and CEL rules cannot judge.

`check` runs after `validate` and before Ray starts or any model loads; `check_cluster` runs once
Ray is up, before the first model group is created. Both raise InvalidJob naming the field.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_api.algorithms import ALGORITHMS
from rlhf_api.v1alpha1 import RLHFJobSpec
from rlhf_api.validation import FieldError, InvalidJob

from .paths import model_path
from .workers.group import Placement, plan_placement


def uses_gpus(spec: RLHFJobSpec) -> bool:
    return spec.resources.gpus_per_node > 0


def check(spec: RLHFJobSpec, base_dir: Path) -> Placement:
    """Refuse what this trainer cannot run; returns the placement of the model groups and engines."""
    errors = []

    def refuse(path: str, message: str) -> None:
        errors.append(FieldError(path, message))

    offline = not ALGORITHMS[spec.algorithm].online
    if offline and spec.data.max_prompt_tokens >= spec.data.max_tokens:
        refuse("spec.data.maxPromptTokens", f"data.maxPromptTokens {spec.data.max_prompt_tokens} leaves no room for "
               f"the response in data.maxTokens {spec.data.max_tokens}: lower it or raise maxTokens")
    for role in ("actor", "critic", "reference", "reward"):
        model = getattr(spec.models, role)
        if model is not None and model.lora is not None:
            refuse(f"spec.models.{role}.lora",
                   "LoRA is not supported by the trainer yet: remove lora to train all weights")
    if not uses_gpus(spec) and spec.rollout.tensor_parallel_size > 1:
        refuse("spec.rollout.tensorParallelSize",
               "tensor parallelism splits a vLLM engine over GPUs: set resources.gpusPerNode > 0, or 1 on CPU")
    if spec.training.colocation == "all" and spec.training.async_queue_size > 0:
        refuse("spec.training.asyncQueueSize",
               "with colocation all (hybrid engine) vLLM and training take turns on the same GPUs, so rollouts "
               "cannot run ahead of training: set asyncQueueSize 0, or colocation none or actor-reference")
    if spec.training.colocation == "all":
        counts = {role: n for role in ("actor", "critic", "reference", "reward")
                  if (n := getattr(spec.resources.gpus, role)) is not None}
        if len(set(counts.values())) > 1:
            refuse("spec.resources.gpus", f"with colocation all every role runs on the same GPUs, but the counts "
                   f"differ ({', '.join(f'{r}={n}' for r, n in counts.items())}): set them equal or remove them")
    if errors:
        raise InvalidJob(errors)

    placement = plan_placement(spec, uses_gpus(spec))  # raises InvalidJob when the roles do not fit
    training = spec.training
    for role in ("actor", "critic", "rm"):
        ranks = len(placement.ranks.get(role, ()))
        if ranks and training.train_batch_size % (training.micro_train_batch_size * ranks):
            refuse("spec.training.trainBatchSize",
                   f"trainBatchSize {training.train_batch_size} must split into whole micro-batches on each of "
                   f"the {role}'s {ranks} ranks: make it a multiple of microTrainBatchSize * {ranks}")
    context = _context_length(spec, base_dir)
    if offline and context is not None and spec.data.max_tokens > context:
        refuse("spec.data.maxTokens", f"data.maxTokens {spec.data.max_tokens} exceeds the actor's context of "
               f"{context} tokens: lower it")
    needed = spec.data.max_prompt_tokens + spec.rollout.max_new_tokens
    if not offline and context is not None and needed > context:
        refuse("spec.rollout.maxNewTokens", f"data.maxPromptTokens + rollout.maxNewTokens = {needed} exceeds the "
               f"actor's context of {context} tokens: lower one of them")
    if errors:
        raise InvalidJob(errors)
    return placement


def check_cluster(spec: RLHFJobSpec, placement: Placement, resources: dict[str, float]) -> None:
    """The Ray cluster has what the placement asks for (one GPU or CPU per bundle)."""
    kind = "GPU" if placement.use_gpu else "CPU"
    if resources.get(kind, 0) < placement.bundles:
        field = "spec.resources.gpusPerNode" if placement.use_gpu else "spec.resources.gpus"
        hint = "set gpusPerNode: 0 to run on CPU" if placement.use_gpu else "start Ray with more CPUs (--num-cpus)"
        raise InvalidJob([FieldError(field, f"the job needs {placement.bundles} {kind}s (one per rank and vLLM "
                                            f"worker) but the Ray cluster has {resources.get(kind, 0):g}: {hint}")])


def _context_length(spec: RLHFJobSpec, base_dir: Path) -> int | None:
    """max_position_embeddings of a local actor (read from its config.json; hub models are not fetched here)."""
    import json

    config = Path(model_path(spec.models, "actor", base_dir)) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")
