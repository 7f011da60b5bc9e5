"""What each GPU of a job holds, phase by phase, estimated from the models' configs before anything loads.

The trainer's order of calls is the plan's (trainer.py): on shared GPUs vLLM's engines start first and
sleep while the models load; each step the engines sample (phase "generate"), then sleep while the models
score the rollout one after another ("score") and train one after another ("train"); then the models hand
their cached blocks back, the engines wake their weights, take the sync, and only then their KV cache.
A job whose busiest GPU cannot hold a phase is refused before any model loads.

The estimates, per process on a GPU (bytes):
- weights: parameters (counted from config.json, exact for the architectures in _layer_params) x the
  dtype's bytes, split over the group's ranks under ZeRO-3;
- a trained model's gradients (its dtype, split from ZeRO-2) and AdamW's state (fp32 master weights under
  bf16, and two fp32 moments: 12 or 8 bytes per parameter, split from ZeRO-1; none with offloadOptimizer);
  LoRA trains adapters only, whose state is counted as nothing;
- activations of one micro-batch of full-length sequences: the logits in fp32 (log-softmax and, when
  training, its gradient beside them) and the layers' own: about 34 x tokens x hidden bytes per layer in
  16 bits (Korthikanti et al. 2022, arXiv:2205.05198, with a fused attention), or only each layer's input
  and one layer's working set with gradient checkpointing. Upper bounds: packing and shorter samples hold less;
- a vLLM engine awake: gpuMemoryUtilization x the GPU, all of it its weights, activations and KV cache
  (vLLM sizes the cache to fill its share), asleep nothing but its CUDA context (level 1 before the first
  rollout, its weights in host memory; level 2 in the loop, the weights dropped for the sync to replace);
- CUDA_CONTEXT per process: the CUDA context, cuBLAS workspace and NCCL buffers, as benchmarks/gpu_check.py
  measured them (a process's GPU memory less what torch's allocator reserved): 1.30 GiB on an H200 with torch
  2.11 / CUDA 13 and a one-rank NCCL group (2026-11-27). More NCCL peers add buffers.

- DEEPSPEED_BUFFERS per trained rank and per 2 bytes of each dtype it reduces gradients in: what DeepSpeed's
  engine allocates beyond the weights, gradients and optimizer state (its reduce bucket, 5e8 elements by
  default, sized by its defaults rather than by the model), as benchmarks/gpu_check.py measured it: a
  39M-parameter model's ZeRO-3 bf16 step peaked at 1.73 GiB allocated where the rest of the plan counts 0.84,
  and a 0.34M-parameter one's at 1.00 GiB (H200, 2026-11-27); the 39M model's float32 weights under bf16
  autocast at 3.74 GiB (2026-11-28): a bucket for the linear layers' bfloat16 gradients and one for the rest's
  float32, 1 + 2 GiB (`deepspeed_buffers`).

What the plan leaves out: the caching allocator's fragmentation. Treat a phase within a few GiB of the GPU's
size as not fitting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_api.algorithms import ALGORITHMS
from rlhf_api.v1alpha1 import RLHFJobSpec
from rlhf_api.validation import FieldError, InvalidJob

from .workers.engine import CAUSAL_LM_ROLES, TRAINED_ROLES
from .workers.group import ROLLOUT, Placement

GIB = 1 << 30
CUDA_CONTEXT = 13 * GIB // 10  # measured, see above
DEEPSPEED_BUFFERS = GIB  # per 2 bytes of a gradient dtype: measured 0.89 and 0.99 GiB in bfloat16, see above
# nvidia.com/gpu.product label -> the memory nvidia-smi reports (MiB)
GPU_MEMORY_MIB = {
    "NVIDIA-H100-80GB-HBM3": 81559, "NVIDIA-H100-NVL": 95830, "NVIDIA-H200": 143771,
    "NVIDIA-A100-SXM4-80GB": 81920, "NVIDIA-A100-SXM4-40GB": 40960, "NVIDIA-A100-80GB-PCIe": 81920,
    "NVIDIA-L40S": 46068, "NVIDIA-A10G": 23028, "NVIDIA-L4": 23034,
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PHASES = ("generate", "score", "train")


def gpu_bytes(gpu: str) -> int:
    """A GPU's memory from its product label (GPU_MEMORY_MIB) or a size such as 80GiB."""
    if gpu in GPU_MEMORY_MIB:
        return GPU_MEMORY_MIB[gpu] << 20
    if gpu.endswith("GiB") and gpu[:-3].replace(".", "", 1).isdigit():
        return int(float(gpu[:-3]) * GIB)
    raise ValueError(f"unknown GPU {gpu!r}: name a size such as 80GiB, or one of {', '.join(GPU_MEMORY_MIB)}")


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: its parameters and the sizes its activations and KV cache scale with."""

    params: int
    layers: int
    hidden: int
    vocab: int
    kv_bytes_per_token: int  # keys and values of every layer, per token, in 16 bits

    @classmethod
    def from_config(cls, config: dict, value_head: bool = False) -> Shape:
        """From a Hugging Face config.json; value_head: a sequence classifier with one label (critic, reward)."""
        text = config.get("text_config", config)
        hidden = text.get("hidden_size") or text["n_embd"]
        layers = text.get("num_hidden_layers") or text["n_layer"]
        heads = text.get("num_attention_heads") or text["n_head"]
        kv_heads = text.get("num_key_value_heads") or heads
        head_dim = text.get("head_dim") or hidden // heads
        vocab = text["vocab_size"]
        params = layers * _layer_params(text, hidden, heads, kv_heads, head_dim) + vocab * hidden + _final_norm(text, hidden)
        if text.get("model_type") == "gpt2":
            params += text["n_positions"] * hidden  # learned positions
        if value_head:
            params += hidden  # the score head, one label, no bias
        elif not text.get("tie_word_embeddings", True):
            params += vocab * hidden
        return cls(params, layers, hidden, vocab, layers * 2 * kv_heads * head_dim * 2)


def _layer_params(text: dict, hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    kind = text.get("model_type")
    if kind == "gpt2":  # fused qkv and MLP with biases, two LayerNorms
        inner = text.get("n_inner") or 4 * hidden
        return (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) + 2 * (hidden * inner) + inner + hidden + 4 * hidden
    if kind not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"model_type {kind!r}: the memory plan counts llama, mistral, qwen2, qwen3 and gpt2 models")
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    if kind == "qwen2":
        attention += q + 2 * kv  # q, k and v biases
    if kind == "qwen3":
        attention += 2 * head_dim  # q and k norms
    return attention + 3 * hidden * text["intermediate_size"] + 2 * hidden  # gated MLP, two RMSNorms


def _final_norm(text: dict, hidden: int) -> int:
    return 2 * hidden if text.get("model_type") == "gpt2" else hidden


@dataclass
class Process:
    """One process's share of a GPU: what it holds throughout, and its peak on top in each phase."""

    name: str
    held: dict[str, int] = field(default_factory=dict)  # what -> bytes, all phases
    extra: dict[str, int] = field(default_factory=dict)  # phase -> bytes on top of `held`, while it runs

    @property
    def resident(self) -> int:
        return sum(self.held.values()) + CUDA_CONTEXT


@dataclass
class GPUPlan:
    index: int
    processes: list[Process]
    engine_share: float  # of the GPU's memory an awake engine worker here claims (0: none here)

    def phase(self, name: str, total: int) -> int:
        """Bytes in use during a phase: every process's resident memory, an awake engine's share while it
        generates, and the largest of the passes that take turns here."""
        engine = self.engine_share * total if name == "generate" else 0
        return sum(p.resident for p in self.processes) + int(engine) + max(
            (p.extra.get(name, 0) for p in self.processes), default=0)


@dataclass
class MemoryPlan:
    gpu: str
    total: int
    gpus: list[GPUPlan]
    kv_sequences: int | None  # full-length sequences an engine's KV cache holds at once (None: no engines)
    notes: list[str]

    def peak(self) -> tuple[GPUPlan, str, int]:
        return max(((g, phase, g.phase(phase, self.total)) for g in self.gpus for phase in PHASES), key=lambda t: t[2])

    @property
    def fits(self) -> bool:
        return self.peak()[2] <= self.total and (self.kv_sequences is None or self.kv_sequences >= 1)

    def render(self) -> str:
        gib = lambda n: f"{n / GIB:.1f}"  # noqa: E731
        lines = [f"GPU {self.gpu}: {gib(self.total)} GiB each; GiB per GPU and phase ({', '.join(PHASES)})"]
        for plan in _distinct(self.gpus):
            phases = "  ".join(f"{phase} {gib(plan.phase(phase, self.total)):>6}" for phase in PHASES)
            lines.append(f"  GPU {plan.index}: {phases}")
            for process in plan.processes:
                held = ", ".join(f"{what} {gib(n)}" for what, n in process.held.items())
                extra = ", ".join(f"{phase} +{gib(n)}" for phase, n in process.extra.items())
                lines.append(f"    {process.name}: {held}; context {gib(CUDA_CONTEXT)}" + (f"; {extra}" if extra else ""))
            if plan.engine_share:
                lines.append(f"    vLLM worker awake: {plan.engine_share:g} of the GPU ({gib(plan.engine_share * self.total)})")
        if self.kv_sequences is not None:
            lines.append(f"  KV cache per engine: {self.kv_sequences} full-length sequences at once")
        plan, phase, used = self.peak()
        lines.append(f"  peak: GPU {plan.index} in {phase}, {gib(used)} of {gib(self.total)} GiB: "
                     + ("fits" if self.fits else "DOES NOT FIT"))
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])


def _distinct(gpus: list[GPUPlan]) -> list[GPUPlan]:
    """One GPU of each layout (GPUs holding the same processes print once)."""
    seen, kept = set(), []
    for plan in gpus:
        key = (tuple((p.name.split(" rank")[0], tuple(p.held.items()), tuple(p.extra.items())) for p in plan.processes),
               plan.engine_share)
        if key not in seen:
            seen.add(key)
            kept.append(plan)
    return kept


def deepspeed_buffers(dtype_bytes: int, autocast: bool) -> int:
    """DeepSpeed's reduce bucket in each dtype it reduces gradients in: the weights', and also bfloat16 when
    training.bf16 autocasts float32 weights (its linear layers' gradients travel in bfloat16)."""
    reduced = [dtype_bytes] + ([2] if autocast else [])
    return sum(DEEPSPEED_BUFFERS * size // 2 for size in reduced)


def plan_memory(spec: RLHFJobSpec, placement: Placement, shapes: dict[str, Shape], gpu: str) -> MemoryPlan:
    """The job's memory on each GPU (bundle) of its placement; shapes: role -> Shape (Shape.from_config)."""
    total, training = gpu_bytes(gpu), spec.training
    online = bool(placement.ranks.get(ROLLOUT))
    sequence = spec.data.max_prompt_tokens + spec.rollout.max_new_tokens if online else spec.data.max_tokens
    sequence *= 2 if ALGORITHMS[spec.algorithm].dataset == "preference" else 1  # chosen and rejected together
    gpus = [GPUPlan(i, [], 0.0) for i in range(placement.bundles)]
    for role, bundles in placement.ranks.items():
        if role == ROLLOUT:
            continue
        model = _model_spec(spec, role)
        shape, dtype = shapes[role], DTYPE_BYTES[model.dtype]
        ranks = len(bundles)
        split = lambda stage: ranks if training.zero_stage >= stage else 1  # noqa: E731
        held = {"weights": shape.params * dtype // split(3)}
        trained = role in TRAINED_ROLES and model.lora is None
        if trained:
            held["gradients"] = shape.params * dtype // split(2)
            if not training.offload_optimizer:
                held["optimizer"] = shape.params * (12 if training.bf16 and dtype == 2 else 8) // split(1)
            held["deepspeed buffers"] = deepspeed_buffers(dtype, training.autocasts(model.dtype))
        extra = {}
        if online or role == "reference":  # rollouts are scored by every model; dpo's reference reads each batch
            batch = training.micro_rollout_batch_size if online else training.micro_train_batch_size
            extra["score"] = _activations(shape, batch * sequence, role, False, False)
        if role in TRAINED_ROLES:
            extra["train"] = _activations(shape, training.micro_train_batch_size * sequence, role, True,
                                          model.gradient_checkpointing)
        for rank, bundle in enumerate(bundles):
            gpus[bundle].processes.append(Process(f"{role} rank {rank}", held, extra))
    kv_sequences = None
    if online:
        share = spec.engine_memory_utilization
        for bundle in placement.bundles_of(ROLLOUT):
            gpus[bundle].engine_share = share
        actor = shapes["actor"]
        width = placement.engine_width
        kv = share * total - actor.params * DTYPE_BYTES[spec.engine_dtype] / width - CUDA_CONTEXT
        kv_sequences = max(0, int(kv * width // (actor.kv_bytes_per_token * sequence)))
    notes = []
    if placement.engines_colocated:
        notes.append("vLLM starts before the models load and must find its share free: the models' resident "
                     "memory and its share together must fit (the generate column)")
    if any(_model_spec(spec, role).lora is not None for role in placement.ranks if role in TRAINED_ROLES):
        notes.append("LoRA adapters' weights, gradients and optimizer state are not counted (megabytes)")
    return MemoryPlan(gpu, total, gpus, kv_sequences, notes)


def _model_spec(spec: RLHFJobSpec, role: str):
    return spec.models.source(role)[1]


def _activations(shape: Shape, tokens: int, role: str, training: bool, checkpointing: bool) -> int:
    """Bytes of one micro-batch's pass (see the module's docstring)."""
    logits = tokens * shape.vocab * 4 * (3 if training else 2) if role in CAUSAL_LM_ROLES else 0  # value heads: none
    layer = 34 * tokens * shape.hidden
    if not training:
        return logits + layer  # one layer's working set at a time
    layers = shape.layers * tokens * shape.hidden * 2 + layer if checkpointing else shape.layers * layer
    return logits + layers


def shapes_of(spec: RLHFJobSpec, placement: Placement, config_of) -> dict[str, Shape]:
    """role -> Shape for every model group and the engines' actor; config_of(role) -> config.json's dict."""
    roles = {role for role in placement.ranks if role != ROLLOUT} | {"actor"}
    return {role: Shape.from_config(config_of(role), value_head=role not in CAUSAL_LM_ROLES) for role in roles}


def local_config(models_dir: Path | None, base_dir: Path, spec: RLHFJobSpec):
    """config_of(role) for shapes_of: config.json from the model's directory (a local path), else from
    models_dir/<hub id>/config.json (a directory laid out like the hub, such as manifests/examples/model-configs)."""
    from .paths import model_path

    def config_of(role: str) -> dict:
        model = _model_spec(spec, role)
        candidates = [Path(model_path(spec.models, role, base_dir)) / "config.json"]
        if models_dir is not None:
            candidates.append(models_dir / model.path / "config.json")
        for candidate in candidates:
            if candidate.is_file():
                return json.loads(candidate.read_text())
        raise FileNotFoundError(f"no config.json for the {role}'s model {model.path} (looked at "
                                f"{', '.join(map(str, candidates))}): pass --model-configs DIR holding "
                                f"{model.path}/config.json")

    return config_of


def refuse_unless_fits(plan: MemoryPlan) -> None:
    """InvalidJob with the plan's numbers and what to change, when a phase of a GPU does not fit."""
    if plan.fits:
        return
    gpu, phase, used = plan.peak()
    if plan.kv_sequences == 0:
        problem = ("vLLM's share of each GPU (rollout.gpuMemoryUtilization) leaves no room for one full-length "
                   "sequence's KV cache after the actor's weights: raise it, or rollout.tensorParallelSize")
    else:
        problem = (f"GPU {gpu.index} would hold {used / GIB:.1f} GiB of {plan.total / GIB:.1f} GiB while the job "
                   f"{'samples' if phase == 'generate' else 'scores' if phase == 'score' else 'trains'}. To fit: "
                   "zeroStage 3, offloadOptimizer, gradientCheckpointing, smaller micro-batches, a lower "
                   "rollout.gpuMemoryUtilization, or more GPUs")
    raise InvalidJob([FieldError("spec.resources", f"the job does not fit {plan.gpu}: {problem}.\n{plan.render()}")])


def plan_job(spec: RLHFJobSpec, gpu: str, config_of) -> MemoryPlan:
    """The plan of a GPU job (resources.gpusPerNode > 0) on GPUs of this kind (gpu_bytes)."""
    from .workers.group import plan_placement

    placement = plan_placement(spec, use_gpu=True)
    return plan_memory(spec, placement, shapes_of(spec, placement, config_of), gpu)
