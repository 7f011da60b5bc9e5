"""The RLHFJob API, rlhf.dev/v1alpha1: the single source of the CRD, the trainer's config and `rlhf validate`.

Field docstrings become the CRD's descriptions (`kubectl explain rlhfjob.spec.training.kl`).
Cross-field rules are CEL (`x-kubernetes-validations`) attached to the model that owns them, so
the API server, `rlhf validate` and the trainer enforce exactly the same rules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from . import algorithms
from .algorithms import cel_list, prose

GROUP = "rlhf.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"

Algorithm = Literal[algorithms.NAMES]  # type: ignore[valid-type]  # the catalogue's names

ONLINE, OFFLINE = cel_list(algorithms.ONLINE), cel_list(algorithms.OFFLINE)
PREFERENCES = algorithms.reading("preferences")

Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi)?$", max_length=32)]
# Kubernetes objects we pass through untouched (tolerations, affinity, envFrom entries...).
Passthrough = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]
DateTime = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]


def cel(*rules: tuple[str, str] | tuple[str, str, str]) -> ConfigDict:
    """Model config carrying CEL rules: (rule, message[, fieldPath relative to this object])."""
    validations = []
    for rule, message, *field_path in rules:
        entry = {"rule": rule, "message": message}
        if field_path:
            entry["fieldPath"] = field_path[0]
        validations.append(entry)
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": validations})


def section(model: type[BaseModel]) -> Any:
    """An optional sub-object whose own fields all have defaults: absent means all defaults."""
    return Field(default_factory=model, json_schema_extra={"default": {}})


def immutable(what: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{
        "rule": "self == oldSelf",
        "message": f"spec.{what} defines the run and is immutable; create a new RLHFJob instead",
    }]}


class APIModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_attribute_docstrings=True,
    )


# ----------------------------------------------------------------------------------------- models


class LoRASpec(APIModel):
    """Train low-rank adapters instead of all weights (Hu et al. 2021, arXiv:2106.09685)."""

    rank: int = Field(16, ge=1, le=1024)
    """Adapter rank r."""
    alpha: int = Field(32, ge=1)
    """Scaling numerator: adapters are scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=lambda: ["all-linear"], max_length=64
    )
    """Module names to adapt, or all-linear."""


class PVCSource(APIModel):
    """A PersistentVolumeClaim mounted read-only into every Ray pod."""

    claim_name: str = Field(max_length=253)
    """Name of the PersistentVolumeClaim in the job's namespace."""
    sub_path: str = Field("", max_length=1024)
    """Directory inside the volume that holds the model."""


class ModelSpec(APIModel):
    """A Hugging Face causal LM (actor, reference) or a model with a scalar head (critic, reward)."""

    path: str = Field(min_length=1, max_length=1024)
    """Hugging Face model id (org/name), or a path inside the container. With pvc set, the path is relative to the volume."""
    revision: str | None = Field(None, max_length=128)
    """Hub revision (branch, tag or commit) for a Hugging Face id."""
    pvc: PVCSource | None = None
    """Load the model from a PersistentVolumeClaim instead of the hub."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the weights are loaded and trained in (with training.bf16, DeepSpeed keeps fp32 master weights)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% more compute."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to transformers."""
    lora: LoRASpec | None = None
    """Train LoRA adapters instead of full weights (actor and critic only)."""


class ModelsSpec(APIModel):
    """The models of the run. Only the actor is required; the others follow from the algorithm."""

    actor: ModelSpec
    """The policy being trained (for sft, dpo and rm: the model being fine-tuned)."""
    critic: ModelSpec | None = None
    """Value model for ppo. Defaults to the reward model if there is one, else the actor, with a fresh value head."""
    reference: ModelSpec | None = None
    """Frozen model the KL penalty is measured against. Defaults to the actor's initial weights."""
    reward: ModelSpec | None = None
    """Reward model (sequence classifier with one label) used by reward sources of type model."""

    def source(self, role: str) -> tuple[str, ModelSpec]:
        """The field a model group loads: the critic defaults to the reward model, else the actor (with a
        fresh value head); the reference to the actor's initial weights; rm trains the actor field."""
        fallbacks = {"critic": ("critic", "reward", "actor"), "reference": ("reference", "actor"), "rm": ("actor",)}
        for field in fallbacks.get(role, (role,)):
            if (model := getattr(self, field)) is not None:
                return field, model
        raise ValueError(f"spec.models has no model for the {role} group")


# ----------------------------------------------------------------------------------------- reward


class SecretKeyRef(APIModel):
    """A key of a Secret in the job's namespace; its value is never copied into the job."""

    name: str = Field(max_length=253)
    """Secret name."""
    key: str = Field(max_length=253)
    """Key within the Secret."""


class FunctionReward(APIModel):
    """A Python function `fn(prompts, completions, labels) -> list[float]` (one score per completion)."""

    entrypoint: str = Field(pattern=r"^[A-Za-z0-9_./-]+(\.py)?:[A-Za-z_][A-Za-z0-9_]*$", max_length=512)
    """module:function importable in the image, or file.py:function (relative to the ConfigMap or the job file's directory)."""
    config_map: str | None = Field(None, max_length=253)
    """ConfigMap whose keys are Python files; it is mounted and put on the import path."""


class HTTPReward(APIModel):
    """A remote reward service: POST {"prompts", "completions", "labels"} -> {"rewards": [...]}, batched."""

    url: str = Field(pattern=r"^https?://", max_length=2048)
    """Endpoint URL, starting with http:// or https://."""
    batch_size: int = Field(64, ge=1, le=4096)
    """Completions per request."""
    timeout_seconds: float = Field(30, gt=0, le=3600)
    """Per-request timeout."""
    retries: int = Field(3, ge=0, le=20)
    """Retries on connection errors and 5xx answers, with exponential backoff."""
    auth_secret_ref: SecretKeyRef | None = None
    """Bearer token for the Authorization header, read from a Secret at run time."""


class RewardSource(APIModel):
    """One source of reward. The total reward is the weighted sum over sources."""

    model_config = cel(
        ("self.type != 'function' || has(self.function)", "a reward source of type function needs function.entrypoint", ".function"),
        ("self.type != 'http' || has(self.http)", "a reward source of type http needs http.url", ".http"),
        ("self.type == 'function' || !has(self.function)", "function is set but type is not function; set type: function or remove function"),
        ("self.type == 'http' || !has(self.http)", "http is set but type is not http; set type: http or remove http"),
    )

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    """Name of the source; its mean reward is reported under this name."""
    type: Literal["model", "function", "http"]
    """model: spec.models.reward scores the completion; function: a Python function; http: a remote service."""
    weight: float = Field(1.0, gt=0)
    """Weight of this source in the total reward."""
    function: FunctionReward | None = None
    """The function, for type function."""
    http: HTTPReward | None = None
    """The endpoint, for type http."""


class RewardSpec(APIModel):
    """Where rewards come from in online RL."""

    model_config = cel(
        ("self.sources.all(s, self.sources.exists_one(t, t.name == s.name))", "reward source names must be unique", ".sources"),
    )

    sources: list[RewardSource] = Field(min_length=1, max_length=8)
    """Reward sources, summed with their weights."""
    clip: float | None = Field(None, gt=0)
    """Clip each total reward to [-clip, clip] before advantages are computed."""


# ------------------------------------------------------------------------------------------- data


class DatasetSource(APIModel):
    """One dataset in a mixture."""

    path: str = Field(min_length=1, max_length=1024)
    """Hugging Face dataset id, or a path to a .jsonl/.json/.parquet file or a directory saved by datasets."""
    split: str = Field("train", max_length=64)
    """Split to read (Hugging Face datasets)."""
    probability: float = Field(1.0, gt=0, le=1)
    """Sampling probability in the mixture (normalised over sources)."""


class DatasetSpec(APIModel):
    """A dataset (or mixture) and how to read its records."""

    sources: list[DatasetSource] = Field(min_length=1, max_length=16)
    """The datasets to mix."""
    input_key: str = Field("prompt", max_length=128)
    """Record key of the prompt (a string, or a list of chat messages)."""
    label_key: str | None = Field(None, max_length=128)
    """Record key passed to reward functions as the label (e.g. the reference answer); for kto, the desirable flag."""
    output_key: str = Field("response", max_length=128)
    """Record key of the target completion (sft)."""
    chosen_key: str = Field("chosen", max_length=128)
    """Record key of the preferred completion (dpo, ipo, cdpo, rm)."""
    rejected_key: str = Field("rejected", max_length=128)
    """Record key of the dispreferred completion (dpo, ipo, cdpo, rm)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many records."""
    shuffle: bool = True
    """Shuffle records with training.seed."""


class DataSpec(APIModel):
    """Training data. Which dataset is needed follows from spec.algorithm."""

    prompts: DatasetSpec | None = Field(None, description=f"Prompts for online RL ({', '.join(algorithms.ONLINE)}).")
    preferences: DatasetSpec | None = Field(None, description=(
        f"Pairs (chosen/rejected) for {', '.join(PREFERENCES)}; for kto also records with a desirable flag."))
    sft: DatasetSpec | None = Field(None, description=(
        f"Prompt/response records for {', '.join(algorithms.reading('sft'))}."))
    max_prompt_tokens: int = Field(1024, ge=8, le=1 << 20)
    """Prompts longer than this are truncated from the left."""
    max_tokens: int = Field(2048, ge=16, le=1 << 20)
    """Maximum prompt + response length for offline algorithms (sft, dpo, ...)."""


# ---------------------------------------------------------------------------------------- rollout


class RolloutSpec(APIModel):
    """Generation with vLLM engines (online algorithms)."""

    engines: int = Field(1, ge=1, le=1024)
    """Number of vLLM engines."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs per vLLM engine."""
    samples_per_prompt: int = Field(1, ge=1, le=1024)
    """Completions sampled per prompt (the group size of grpo, rloo, ...)."""
    max_new_tokens: int = Field(1024, ge=1, le=1 << 20)
    """Maximum completion length."""
    temperature: float = Field(1.0, ge=0, le=10)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling probability mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables it."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of GPU memory each vLLM engine may take (weights + KV cache)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower decoding, faster start, less memory)."""
    enable_prefix_caching: bool = True
    """Reuse KV cache across samples of one prompt."""


# --------------------------------------------------------------------------------------- training


class KLSpec(APIModel):
    """KL regularisation against the reference model (Schulman 2020, "Approximating KL Divergence")."""

    coef: float = Field(0.001, ge=0)
    """KL coefficient; 0 disables the penalty and the reference model."""
    estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token estimator: k1 = log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    placement: Literal["reward", "loss"] = "reward"
    """reward: subtract coef*KL from each token's reward (InstructGPT); loss: add coef*KL to the policy loss (GRPO)."""


class PreferenceSpec(APIModel):
    """Hyperparameters of the offline preference losses."""

    beta: float = Field(0.1, gt=0)
    """Inverse temperature of dpo/cdpo/kto; the regularisation strength tau of ipo."""
    # Not lt=0.5: the API server compares a whole number (0) with a fractional exclusive bound as
    # integers (0 < 0) and refuses the default.
    label_smoothing: float = Field(0.0, ge=0, le=0.49)
    """cdpo: assumed probability that a preference label is flipped."""
    desirable_weight: float = Field(1.0, gt=0)
    """kto: weight of desirable examples."""
    undesirable_weight: float = Field(1.0, gt=0)
    """kto: weight of undesirable examples."""


class TrainingSpec(APIModel):
    """Optimisation: DeepSpeed, batch sizes, the RL loss and its regularisers."""

    model_config = cel(
        ("self.microTrainBatchSize <= self.trainBatchSize", "microTrainBatchSize must not exceed trainBatchSize", ".microTrainBatchSize"),
        ("self.clipEpsHigh == 0.0 || self.clipEpsHigh >= self.clipEps", "clipEpsHigh must be 0 (same as clipEps) or at least clipEps", ".clipEpsHigh"),
    )

    zero_stage: Literal[0, 1, 2, 3] = 3
    """DeepSpeed ZeRO stage: 3 shards parameters, gradients and optimizer state."""
    bf16: bool = True
    """Mixed precision in bfloat16."""
    offload_optimizer: bool = False
    """Keep optimizer state in CPU memory (ZeRO-Offload)."""
    learning_rate: float = Field(1e-6, gt=0, le=1)
    """Learning rate of the actor (the trained model for offline algorithms)."""
    critic_learning_rate: float = Field(9e-6, gt=0, le=1)
    """Learning rate of the critic (ppo)."""
    lr_warmup_ratio: float = Field(0.03, ge=0, le=1)
    """Fraction of steps with linear warmup."""
    lr_scheduler: Literal["constant", "cosine_with_min_lr", "linear"] = "cosine_with_min_lr"
    """Learning-rate schedule after warmup."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping norm."""
    rollout_batch_size: int = Field(128, ge=1)
    """Prompts per rollout; each gives samplesPerPrompt completions."""
    train_batch_size: int = Field(128, ge=1)
    """Samples per optimizer step (global, across data-parallel ranks)."""
    micro_train_batch_size: int = Field(4, ge=1)
    """Samples per forward/backward pass on one rank (gradient accumulation fills the rest)."""
    micro_rollout_batch_size: int = Field(8, ge=1)
    """Samples per forward pass when scoring rollouts (log-probs, values, rewards)."""
    epochs: int = Field(1, ge=1, le=100)
    """Passes over each rollout batch (online) or over the dataset (offline)."""
    episodes: int = Field(1, ge=1, le=10000)
    """Passes over the prompt dataset (online)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many rollout steps (online) or optimizer steps (offline)."""
    kl: KLSpec = section(KLSpec)
    """KL penalty against the reference model."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """PPO clip range epsilon (Schulman et al. 2017)."""
    clip_eps_high: float = Field(0.0, ge=0, lt=10)
    """Upper clip range when different from clipEps ("clip-higher", DAPO, Yu et al. 2025); 0 uses clipEps."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (Ye et al. 2020)."""
    value_clip: float = Field(0.2, gt=0)
    """Clip range of the value loss (ppo)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor."""
    gae_lambda: float = Field(0.95, ge=0, le=1)
    """GAE lambda (ppo)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How token losses become the batch loss: token-mean (DAPO), seq-mean-token-mean (GRPO paper), seq-mean-token-sum (Dr. GRPO)."""
    preference: PreferenceSpec = section(PreferenceSpec)
    """dpo, ipo, cdpo and kto hyperparameters."""
    colocation: Literal["none", "actor-reference", "all"] = "none"
    """Share GPUs: none (each role has its own), actor-reference, or all (hybrid engine: every model and vLLM on the same GPUs, taking turns)."""
    async_queue_size: int = Field(0, ge=0, le=64)
    """0: rollout and training alternate. N > 0: rollouts run up to N batches ahead of training (off-policy by up to N updates)."""
    seed: int = 42
    """Random seed for data order, sampling and initialisation."""


# -------------------------------------------------------------------------------------- resources


class EnvVar(APIModel):
    """An environment variable (core/v1 EnvVar). Secrets go through valueFrom.secretKeyRef."""

    model_config = cel(
        ("!has(self.value) || !self.name.matches('(?i)(TOKEN|SECRET|PASSWORD|API_KEY|ACCESS_KEY)$')",
         "this variable looks like a secret: reference it with valueFrom.secretKeyRef instead of a literal value"),
    )

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256)
    """Variable name."""
    value: str | None = Field(None, max_length=32768)
    """Literal value."""
    value_from: Passthrough | None = None
    """Source of the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""


class RDMASpec(APIModel):
    """RDMA (InfiniBand/RoCE) for NCCL between GPU nodes."""

    resource_name: str = Field("rdma/ib", max_length=253)
    """Extended resource the RDMA device plugin advertises (e.g. rdma/ib, rdma/rdma_shared_device_a, nvidia.com/hostdev)."""
    resource_count: int = Field(1, ge=1)
    """Units of that resource per worker pod."""
    hca: str = Field("mlx5", max_length=512)
    """NCCL_IB_HCA: which host channel adapters NCCL uses."""
    socket_ifname: str = Field("eth0", max_length=256)
    """NCCL_SOCKET_IFNAME: interface for NCCL's bootstrap and socket traffic."""
    gdr_level: Literal["LOC", "PIX", "PXB", "PHB", "SYS"] = "PHB"
    """NCCL_NET_GDR_LEVEL: the farthest topology distance at which GPUDirect RDMA is used."""
    gid_index: int | None = Field(None, ge=0, le=255)
    """NCCL_IB_GID_INDEX (RoCE: usually 3)."""
    nccl_debug: Literal["VERSION", "WARN", "INFO", "TRACE"] = "WARN"
    """NCCL_DEBUG level."""


class PodResources(APIModel):
    """CPU and memory of one pod."""

    cpu: Quantity = "8"
    """CPU request and limit."""
    memory: Quantity = "32Gi"
    """Memory request and limit."""


class RoleGPUs(APIModel):
    """GPUs per role when roles do not share GPUs (training.colocation none or actor-reference). Unset roles are sized automatically."""

    actor: int | None = Field(None, ge=1)
    """GPUs of the actor group (data-parallel ZeRO ranks)."""
    critic: int | None = Field(None, ge=1)
    """GPUs of the critic group."""
    reference: int | None = Field(None, ge=1)
    """GPUs of the reference group."""
    reward: int | None = Field(None, ge=1)
    """GPUs of the reward-model group."""


class ResourcesSpec(APIModel):
    """Where and on what the job runs: the Ray cluster's pods."""

    model_config = cel(
        ("!has(self.rdma) || self.gpusPerNode > 0", "RDMA is only for GPU workers: set gpusPerNode > 0 or remove rdma", ".rdma"),
        ("!has(self.gpuProduct) || self.gpusPerNode > 0", "gpuProduct selects GPU nodes: set gpusPerNode > 0 or remove gpuProduct", ".gpuProduct"),
    )

    image: str = Field("ghcr.io/rlhf-operator/trainer:0.1.0", max_length=1024)
    """Trainer image for the Ray head and workers."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Image pull policy."""
    image_pull_secrets: list[Annotated[str, Field(max_length=253)]] = Field(default_factory=list, max_length=16)
    """Names of Secrets used to pull the image."""
    nodes: int = Field(1, ge=1, le=1024)
    """GPU worker pods (one per node)."""
    gpus_per_node: int = Field(8, ge=0, le=64)
    """GPUs per worker pod; 0 runs on CPU workers."""
    gpu_resource_name: str = Field("nvidia.com/gpu", max_length=253)
    """Extended resource name of a GPU."""
    gpu_product: str | None = Field(None, max_length=253)
    """Required value of the node label nvidia.com/gpu.product (e.g. NVIDIA-H100-80GB-HBM3)."""
    gpus: RoleGPUs = section(RoleGPUs)
    """Per-role GPU counts."""
    head: PodResources = Field(default_factory=lambda: PodResources(cpu="4", memory="16Gi"), json_schema_extra={"default": {}})
    """Ray head pod (runs the trainer driver, no GPUs)."""
    worker: PodResources = section(PodResources)
    """Each GPU worker pod."""
    shm_size: Quantity = "16Gi"
    """Size of the memory-backed /dev/shm as a quantity such as 16Gi (NCCL and vLLM need more than the 64Mi default)."""
    rdma: RDMASpec | None = None
    """Enable RDMA for NCCL (adds the RDMA resource, IPC_LOCK and NCCL_* settings)."""
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(default_factory=dict)
    """Extra node labels the worker pods require."""
    tolerations: list[Passthrough] = Field(default_factory=list, max_length=32)
    """Extra tolerations (core/v1 Toleration) for worker pods; GPU taints are tolerated already."""
    affinity: Passthrough | None = None
    """Extra affinity (core/v1 Affinity) merged into the worker pods' affinity."""
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    """Environment of the trainer and workers (e.g. HF_TOKEN from a Secret)."""
    env_from: list[Passthrough] = Field(default_factory=list, max_length=16)
    """Environment from ConfigMaps or Secrets (core/v1 EnvFromSource), by reference."""
    priority_class_name: str | None = Field(None, max_length=253)
    """PriorityClass of the pods."""


# ------------------------------------------------------------------------------------- checkpoint


class CheckpointSpec(APIModel):
    """Checkpointing and resume."""

    pvc: str | None = Field(None, max_length=253)
    """PersistentVolumeClaim mounted at path on every pod; without it, checkpoints live in the pod and die with it."""
    path: str = Field("/checkpoints", max_length=1024)
    """Directory for checkpoints and the final model."""
    interval_steps: int = Field(0, ge=0)
    """Save every N steps; 0 saves only at the end."""
    keep: int = Field(3, ge=1, le=1000)
    """Number of checkpoints kept (oldest removed first)."""
    resume: bool = True
    """Resume from the newest checkpoint under path when one exists."""
    export_hf: bool = True
    """Export the final actor in Hugging Face format to path/final."""


# ------------------------------------------------------------------------------------------- spec


class RLHFJobSpec(APIModel):
    """An RLHF or RL post-training run."""

    model_config = cel(
        (f"!(self.algorithm in {ONLINE}) || has(self.data.prompts)",
         "online algorithms train on prompts: set spec.data.prompts", ".data"),
        (f"!(self.algorithm in {ONLINE}) || has(self.reward)",
         "online algorithms need a reward: set spec.reward.sources", ".algorithm"),
        (f"!(self.algorithm in {cel_list(PREFERENCES)}) || has(self.data.preferences)",
         f"{prose(PREFERENCES)} train on preference data: set spec.data.preferences", ".data"),
        (f"!(self.algorithm in {cel_list(algorithms.reading('sft'))}) || has(self.data.sft)",
         f"{prose(algorithms.reading('sft'))} trains on prompt/response records: set spec.data.sft", ".data"),
        (f"!(self.algorithm in {cel_list(algorithms.GROUP_SAMPLES)}) || self.rollout.samplesPerPrompt > 1",
         "this algorithm compares several samples of each prompt: set rollout.samplesPerPrompt to 2 or more (4-16 is usual)",
         ".rollout.samplesPerPrompt"),
        (f"self.algorithm in {cel_list(algorithms.USES_CRITIC)} || !has(self.models.critic)",
         f"only {prose(algorithms.USES_CRITIC)} uses a critic: remove spec.models.critic or set algorithm: "
         f"{algorithms.USES_CRITIC[0]}", ".models.critic"),
        (f"self.algorithm in {ONLINE} || !has(self.reward)",
         "offline algorithms learn from the dataset, not a reward: remove spec.reward", ".reward"),
        ("!has(self.reward) || !self.reward.sources.exists(s, s.type == 'model') || has(self.models.reward)",
         "a reward source of type model scores with spec.models.reward: set it", ".models"),
        (f"!(self.algorithm in {ONLINE}) || (self.training.rolloutBatchSize * self.rollout.samplesPerPrompt) % self.training.trainBatchSize == 0",
         "each rollout must split into whole optimizer steps: make rolloutBatchSize * samplesPerPrompt a multiple of trainBatchSize",
         ".training.trainBatchSize"),
        ("self.training.colocation != 'all' || self.resources.gpusPerNode == 0 || self.rollout.engines * self.rollout.tensorParallelSize <= self.resources.nodes * self.resources.gpusPerNode",
         "with colocation all, the vLLM engines share the GPUs: engines * tensorParallelSize must fit in nodes * gpusPerNode",
         ".rollout.engines"),
        ("self.resources.gpusPerNode == 0 || self.rollout.tensorParallelSize <= self.resources.gpusPerNode",
         "a vLLM engine runs within one node: tensorParallelSize must not exceed gpusPerNode", ".rollout.tensorParallelSize"),
        ("has(self.reward) == has(oldSelf.reward) && has(self.models.critic) == has(oldSelf.models.critic)",
         "spec.reward and spec.models define the run and are immutable; create a new RLHFJob instead"),
    )

    algorithm: Algorithm = Field(json_schema_extra=immutable("algorithm"), description=(
        f"The training algorithm. Online RL: {', '.join(algorithms.ONLINE)}. "
        f"Offline: {', '.join(algorithms.OFFLINE)} (rm trains a reward model)."))
    models: ModelsSpec = Field(json_schema_extra=immutable("models"))
    """The models."""
    reward: RewardSpec | None = Field(None, json_schema_extra=immutable("reward"))
    """Reward sources (online algorithms only)."""
    data: DataSpec = Field(json_schema_extra=immutable("data"))
    """Datasets."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra={"default": {}, **immutable("rollout")})
    """Generation settings (online algorithms)."""
    # The whole default, not {}: the API server checks training's CEL rules on the default itself.
    training: TrainingSpec = Field(default_factory=TrainingSpec, json_schema_extra={
        "default": TrainingSpec().model_dump(by_alias=True, exclude_none=True), **immutable("training")})
    """Optimisation settings."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, json_schema_extra={"default": {}, **immutable("resources")})
    """Pods, GPUs, networking and environment."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, json_schema_extra={"default": {}, **immutable("checkpoint")})
    """Checkpoints and resume."""
    suspend: bool = False
    """Suspend the job: its Ray cluster is deleted and recreated on resume (from the newest checkpoint). Kueue sets this."""
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    """Delete the RLHFJob (and its children) this long after it succeeds or fails."""
    active_deadline_seconds: int | None = Field(None, ge=1)
    """Fail the job when it has run longer than this."""
    backoff_limit: int = Field(0, ge=0, le=100)
    """Retries of the whole run after a failure (each resumes from the newest checkpoint)."""
    queue_name: str | None = Field(None, max_length=253)
    """Kueue LocalQueue; the job is created suspended and Kueue admits it."""


# ----------------------------------------------------------------------------------------- status

Phase = Literal["Pending", "Provisioning", "Running", "Succeeded", "Failed", "Suspended"]


class Condition(APIModel):
    """A metav1.Condition."""

    type: str = Field(max_length=316)
    """Ready, Running, Succeeded, Failed or Suspended."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = Field(max_length=1024)
    """CamelCase reason for the last transition."""
    message: str = Field("", max_length=32768)
    """Human-readable details."""
    last_transition_time: DateTime
    """When status last changed."""
    observed_generation: int | None = None
    """metadata.generation the condition was computed from."""


class Progress(APIModel):
    """Training progress, written by the trainer."""

    step: int = 0
    """Completed steps."""
    total_steps: int = 0
    """Planned steps."""
    percent: float = 0.0
    """step / totalSteps * 100."""
    summary: str = ""
    """step/totalSteps as shown by kubectl get."""
    eta_seconds: int | None = None
    """Estimated seconds to completion."""
    updated: DateTime | None = None
    """When the trainer last reported."""


class Metrics(APIModel):
    """Latest training metrics, written by the trainer."""

    reward_mean: float | None = None
    """Mean total reward of the last rollout batch."""
    reward_std: float | None = None
    """Standard deviation of that reward."""
    kl: float | None = None
    """Mean per-token KL to the reference model."""
    policy_loss: float | None = None
    """Actor loss."""
    value_loss: float | None = None
    """Critic loss (ppo)."""
    loss: float | None = None
    """Training loss (offline algorithms)."""
    entropy: float | None = None
    """Mean token entropy of the policy."""
    response_length: float | None = None
    """Mean completion length in tokens."""
    tokens_per_second: float | None = None
    """Generated tokens per second in the last rollout."""
    learning_rate: float | None = None
    """Current actor learning rate."""


class CheckpointStatus(APIModel):
    """The newest checkpoint."""

    step: int
    """Step it was taken at."""
    path: str
    """Where it is."""
    time: DateTime
    """When it was written."""


class RLHFJobStatus(APIModel):
    """Observed state, written by the operator (phase, conditions, children) and the trainer (progress, metrics)."""

    phase: Phase | None = None
    """Pending, Provisioning, Running, Succeeded, Failed or Suspended."""
    reason: str | None = None
    """Reason of the current phase (CamelCase)."""
    message: str | None = None
    """What happened and, on failure, what to change."""
    conditions: list[Condition] = Field(default_factory=list)
    """Standard conditions (Ready, Running, Succeeded, Failed, Suspended)."""
    observed_generation: int | None = None
    """metadata.generation last acted on."""
    ray_job_name: str | None = None
    """Name of the KubeRay RayJob."""
    ray_cluster_name: str | None = None
    """Name of the Ray cluster."""
    dashboard_url: str | None = Field(None, alias="dashboardURL")
    """Ray dashboard address."""
    start_time: DateTime | None = None
    """When the run started."""
    completion_time: DateTime | None = None
    """When the run finished."""
    progress: Progress | None = None
    """Training progress."""
    metrics: Metrics | None = None
    """Latest metrics."""
    last_checkpoint: CheckpointStatus | None = None
    """Newest checkpoint."""


class RLHFJob(APIModel):
    """An RLHFJob: one RLHF / RL post-training run on a KubeRay cluster."""

    api_version: Literal["rlhf.dev/v1alpha1"] = API_VERSION
    kind: Literal["RLHFJob"] = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RLHFJobSpec
    status: RLHFJobStatus | None = None
