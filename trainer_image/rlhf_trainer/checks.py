"""Trainer-side checks: combinations the CRD's schema and CEL rules cannot judge, and files the job
names that are not there.

`check` runs after `validate` and before Ray starts or any model loads; `check_cluster` runs once
Ray is up, before the first model group is created. Both raise InvalidJob naming the field.
`check` also looks for the local dataset files the run reads (data.local_dataset says which are
local) and imports each reward function, checking that it can be called as the trainer calls it,
so that neither fails a minute into the run.
"""

from __future__ import annotations

import logging
from importlib.util import find_spec
from pathlib import Path

from rlhf_api.algorithms import ALGORITHMS
from rlhf_api.paths import model_path
from rlhf_api.planning.memory import (GPU_MEMORY_MIB, gpu_label, head_counts, local_config, plan_memory,
                                      ranks_per_copy, refuse_unless_fits, shapes_of)
from rlhf_api.planning.placement import ROLLOUT, Placement, plan_placement
from rlhf_api.v1alpha1 import ModelsSpec, RLHFJobSpec
from rlhf_api.validation import FieldError, InvalidJob

from .data import missing_dataset
from .rewards.process import STEP_SEPARATOR_KEY
from .workers.sequence_parallel import split_problem
from .workers.tensor_parallel import TRAINED_WITH_AUTOTP


log = logging.getLogger(__name__)
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}  # bfloat16 matmuls in hardware (/proc/cpuinfo's names)


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
    for role in ("actor", "critic"):
        model = getattr(spec.models, role)
        if model is not None and model.lora is not None and model.lora.quantization != "none":
            for message in _qlora_problems(spec):
                refuse(f"spec.models.{role}.lora.quantization", message)
    for role in ModelsSpec.model_fields:
        model = getattr(spec.models, role)
        # Checked here, on the driver, since the model groups would only fail to load once all had started.
        if model is not None and model.attn_implementation == "flash_attention_2" and find_spec("flash_attn") is None:
            refuse(f"spec.models.{role}.attnImplementation", "flash_attention_2 needs the flash-attn package, which "
                   "this environment lacks: set attnImplementation: sdpa, or install flash-attn (in a cluster: set "
                   "resources.image to a trainer image that has it)")
    if spec.training.colocation == "all" and spec.training.async_queue_size > 0:
        refuse("spec.training.asyncQueueSize",
               "with colocation all (hybrid engine) vLLM and training take turns on the same GPUs, so rollouts "
               "cannot run ahead of training: set asyncQueueSize 0, or colocation none or actor-reference")
    if spec.training.colocation == "all":
        counts = {role: n for role, n in spec.resources.gpus if n is not None}
        if len(set(counts.values())) > 1:
            refuse("spec.resources.gpus", f"with colocation all every role runs on the same GPUs, but the counts "
                   f"differ ({', '.join(f'{r}={n}' for r, n in counts.items())}): set them equal or remove them")
    errors += _missing_data(spec, base_dir) + _unusable_reward_functions(spec, base_dir)
    errors += _teacher_vocabulary(spec, base_dir) + _process_reward_reading(spec, base_dir)
    if errors:
        raise InvalidJob(errors)

    for warning in precision_warnings(spec, cpu_flags()):
        log.warning("%s", warning)
    placement = plan_placement(spec, uses_gpus(spec))  # raises InvalidJob when the roles do not fit
    training = spec.training
    for role in ("actor", "critic", "rm"):
        ranks = len(placement.ranks.get(role, ())) // ranks_per_copy(role, training)  # the data-parallel ones
        if ranks and training.train_batch_size % (training.micro_train_batch_size * ranks):
            refuse("spec.training.trainBatchSize",
                   f"trainBatchSize {training.train_batch_size} must split into whole micro-batches on each of "
                   f"the {role}'s {ranks} data-parallel ranks: make it a multiple of microTrainBatchSize * {ranks}")
    errors += _tensor_parallel_problems(spec, placement, base_dir) + _sequence_parallel_problems(spec, placement, base_dir)
    _refuse_unless_memory_fits(spec, placement, base_dir)
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


def cpu_flags() -> set[str] | None:
    """This machine's CPU feature flags (/proc/cpuinfo), None where it cannot tell."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def precision_warnings(spec: RLHFJobSpec, flags: set[str] | None) -> list[str]:
    """What training.bf16 and the trained models' dtype cost a job on CPU, given the CPU's flags (nothing on GPUs)."""
    if uses_gpus(spec) or not spec.training.bf16:
        return []
    warnings = []
    if flags is not None and not flags & BF16_CPU_FLAGS:
        warnings.append("training.bf16 on a CPU without bfloat16 instructions (AVX-512 BF16 or AMX): its bfloat16 "
                        "matmuls are emulated and slower than float32's: set training.bf16: false")
    for role in ("actor", "critic"):
        model = getattr(spec.models, role)
        if model is not None and model.dtype == "bfloat16":
            warnings.append(
                f"spec.models.{role}.dtype bfloat16 with training.bf16 on CPU: the passes read a bfloat16 copy of the "
                "float32 master weights, which moves only once the updates add up to bfloat16's resolution (about "
                "0.4% of a weight), so short runs at small learning rates barely move it: set dtype: float32 "
                "(training.bf16 then autocasts: bfloat16 matmuls on float32 weights)")
    return warnings


_SHORT_HINTS = {  # (resource, GPU job?) -> the field to change, and how
    ("GPU", True): ("spec.resources.gpusPerNode", "set gpusPerNode: 0 to run on CPU"),
    ("CPU", True): ("spec.resources.worker.cpu", "give each worker pod at least one CPU per GPU"),
    ("CPU", False): ("spec.resources.gpus", "start Ray with more CPUs (--num-cpus), or run fewer ranks"),
}


def check_cluster(spec: RLHFJobSpec, placement: Placement, resources: dict[str, float]) -> None:
    """The Ray cluster has, in all, every resource the placement's bundles ask for (Placement.needs:
    a GPU and a CPU per bundle on GPUs, a CPU on CPU)."""
    errors = []
    for kind, needed in placement.needs.items():
        if resources.get(kind, 0) < needed:
            field, hint = _SHORT_HINTS[kind, placement.use_gpu]
            errors.append(FieldError(field, f"the job needs {needed:g} {kind}s (one per rank and vLLM worker) but "
                                            f"the Ray cluster has {resources.get(kind, 0):g}: {hint}"))
    if errors:
        raise InvalidJob(errors)


def _missing_data(spec: RLHFJobSpec, base_dir: Path) -> list[FieldError]:
    """Local dataset paths that do not exist, in the datasets the run reads: the algorithm's and the
    evaluation sets."""
    name = ALGORITHMS[spec.algorithm].dataset
    datasets = [(f"spec.data.{name}", getattr(spec.data, name))]
    if spec.evaluation is not None:
        datasets += [(f"spec.evaluation.datasets[{i}]", d) for i, d in enumerate(spec.evaluation.datasets)]
    return [FieldError(f"{field}.sources[{i}].path", problem)
            for field, dataset in datasets if dataset is not None
            for i, source in enumerate(dataset.sources) if (problem := missing_dataset(source.path, base_dir))]


def _unusable_reward_functions(spec: RLHFJobSpec, base_dir: Path) -> list[FieldError]:
    """Reward functions that cannot be imported, or called as fn(prompts, completions, labels)."""
    from .rewards import SourceContext
    from .rewards.function import function_source

    errors = []
    for i, source in enumerate(spec.reward.sources if spec.reward else []):
        if source.type != "function":
            continue
        try:
            function_source(source, SourceContext(base_dir, model_scorer=None))
        except Exception as error:  # noqa: BLE001 - an import runs the user's code: anything may come out
            errors.append(FieldError(f"spec.reward.sources[{i}].function.entrypoint", f"{type(error).__name__}: {error}"))
    return errors


def _qlora_problems(spec: RLHFJobSpec) -> list[str]:
    """Why QLoRA's 4-bit base cannot run here (bitsandbytes' kernels are CUDA's; its packed weights are not
    ZeRO-3 shards)."""
    import importlib.util

    problems = []
    if not uses_gpus(spec):
        problems.append("QLoRA's 4-bit base weights need GPUs (bitsandbytes): set resources.gpusPerNode > 0, "
                        "or quantization none to train LoRA on the unquantized base")
    if spec.training.zero_stage == 3:
        problems.append("QLoRA's 4-bit base weights cannot be ZeRO-3 shards: set training.zeroStage 2 or lower")
    if importlib.util.find_spec("bitsandbytes") is None:
        problems.append("QLoRA needs bitsandbytes, which this trainer image lacks: use an image with it, or "
                        "quantization none")
    return problems


def _refuse_unless_memory_fits(spec: RLHFJobSpec, placement: Placement, base_dir: Path) -> None:
    """The memory plan (rlhf_api.planning.memory) on GPUs of the job's gpuProduct, when their size is known: local models'
    configs read from their directories, hub models' config.json fetched alone, before any GPU is touched."""
    if not uses_gpus(spec) or gpu_label(spec.resources.gpu_product or "") not in GPU_MEMORY_MIB:
        return
    try:
        shapes = shapes_of(spec, placement, local_config(None, base_dir, spec, fetch=True))
    except Exception as error:  # noqa: BLE001 - a hub out of reach: loading the model will say so, plainly
        log.warning("no memory plan (%s: %s): the job starts unchecked", type(error).__name__, error)
        return
    refuse_unless_fits(plan_memory(spec, placement, shapes, spec.resources.gpu_product))


def _local_config(spec: RLHFJobSpec, role: str, base_dir: Path) -> dict:
    """A local model's config.json ({} for a hub model: those are not fetched here)."""
    import json

    config = Path(model_path(spec.models, role, base_dir)) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _context_length(spec: RLHFJobSpec, base_dir: Path) -> int | None:
    """max_position_embeddings of a local actor."""
    return _local_config(spec, "actor", base_dir).get("max_position_embeddings")


def _process_reward_reading(spec: RLHFJobSpec, base_dir: Path) -> list[FieldError]:
    """A process reward model (its config holds the separator prm trained it with) is read step by step at that
    separator: read whole, or split elsewhere, it scores positions it never learnt."""
    if spec.reward is None or spec.models.reward is None:
        return []
    learnt = _local_config(spec, "reward", base_dir).get(STEP_SEPARATOR_KEY)
    if learnt is None:  # an outcome reward model, or one trained elsewhere
        return []
    errors = []
    for i, source in enumerate(spec.reward.sources):
        if source.type != "model":
            continue
        if source.steps is None:
            errors.append(FieldError(f"spec.reward.sources[{i}]", f"spec.models.reward is a process reward model (prm "
                                     f"trained it on steps ending in {learnt!r}): read it step by step with "
                                     f"steps: {{separator: {learnt!r}, aggregation: min}}"))
        elif source.steps.separator != learnt:
            errors.append(FieldError(f"spec.reward.sources[{i}].steps.separator", f"the process reward model learnt "
                                     f"steps ending in {learnt!r}, not {source.steps.separator!r}: set separator to "
                                     f"{learnt!r}"))
    return errors


def _tensor_parallel_problems(spec: RLHFJobSpec, placement: Placement, base_dir: Path) -> list[FieldError]:
    """training.tensorParallel against what the CRD's rules cannot see: the ranks the placement gives each split
    role (resources.gpus left to the automatic split), and a local model's heads, which AutoTP splits whole (the
    key-value heads of grouped-query attention too: a rank holding part of a head would compute wrong attention)."""
    size, errors = spec.training.tensor_parallel.size, []
    for role in TRAINED_WITH_AUTOTP:
        ranks = len(placement.ranks.get(role, ()))
        if size == 1 or not ranks:
            continue
        if ranks % size:
            errors.append(FieldError(f"spec.resources.gpus.{role}", f"the {role} has {ranks} ranks, which do not form "
                                     f"groups of training.tensorParallel.size {size}: set resources.gpus.{role} to a "
                                     "multiple of it"))
        for what, count in head_counts(_local_config(spec, role, base_dir)).items():
            if count is not None and count % size:
                errors.append(FieldError("spec.training.tensorParallel.size", f"the {role}'s model has {count} {what}, "
                                         f"which AutoTP cannot split over {size} ranks: use a size that divides "
                                         f"{count}"))
    return errors


def _sequence_parallel_problems(spec: RLHFJobSpec, placement: Placement, base_dir: Path) -> list[FieldError]:
    """training.sequenceParallel against what the CRD's rules cannot see: the ranks the placement gives each model
    (resources.gpus left to the automatic split), and a local model's heads (a hub model's: when its rank loads it)."""
    size, errors = spec.training.sequence_parallel.size, []
    roles = [role for role in placement.ranks if role != ROLLOUT] if size > 1 else []
    for role in roles:
        ranks = len(placement.ranks[role])
        if ranks % size:
            errors.append(FieldError(f"spec.resources.gpus.{role}", f"the {role} has {ranks} ranks, which do not form "
                                     f"groups of training.sequenceParallel.size {size}: set resources.gpus.{role} to "
                                     "a multiple of it"))
        if problem := split_problem(_local_config(spec, role, base_dir), size):
            errors.append(FieldError("spec.training.sequenceParallel.size", f"{role}: {problem}"))
    return errors


def _teacher_vocabulary(spec: RLHFJobSpec, base_dir: Path) -> list[FieldError]:
    """The teacher scores the actor's token ids: a teacher of another vocabulary reads other tokens."""
    if spec.models.teacher is None:
        return []
    sizes = [_local_config(spec, role, base_dir).get("vocab_size") for role in ("actor", "teacher")]
    if None in sizes or sizes[0] == sizes[1]:
        return []
    return [FieldError("spec.models.teacher", f"the teacher's vocabulary ({sizes[1]} tokens) is not the actor's "
                                              f"({sizes[0]}): distill a student of the teacher's tokenizer")]
