"""The RLHFJob: its spec (with the cross-section CEL rules) and its status."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import Field, model_validator

from .. import algorithms, contract
from ..algorithms import cel_list, prose
from .base import API_VERSION, DNS_SUBDOMAIN, KIND, APIModel, DateTime, cel, immutable
from .data import PREFERENCES, DataSpec
from .environment import EnvironmentSpec
from .evaluation import EvaluationSpec
from .models import ModelsSpec
from .resources import CheckpointSpec, ResourcesSpec, RoleGPUs
from .reward import RewardSpec
from .runtime import RLHFRuntimeSpec, RuntimeKind, RuntimeRef
from .training import ENGINE_MEMORY_ALONE, ENGINE_MEMORY_SHARED, TENSOR_PARALLEL, RolloutSpec, TrainingSpec
from .tracking import TrackingSpec

Algorithm = Literal[algorithms.NAMES]  # type: ignore[valid-type]  # the catalogue's names
ONLINE = cel_list(algorithms.ONLINE)
NO_REFRESH = ("!has(self.training.referenceRefresh) || !has(self.training.referenceRefresh.intervalSteps) || "
              "self.training.referenceRefresh.intervalSteps == 0")
# The defaults that follow from spec.algorithm (RLHFJobSpec._algorithm_defaults): a CRD default is a
# constant, so the CRD leaves them unset and the chart's algorithm-defaults policy fills them in.
ALGORITHM_DEFAULTS = tuple(("training", name) for name in algorithms.TRAINING_DEFAULTS)
# Kueue's webhook refuses to relabel a RayJob it has admitted, so the queue is chosen once.
QUEUE_IMMUTABLE = ("spec.queueName cannot be set, changed or removed after creation (Kueue does not move an admitted "
                   "job between queues): delete the RLHFJob and create it again with the new queue")
# Kueue's webhook refuses a queued RayJob whose cluster outlives the run (shutdownAfterJobFinishes false), and Kueue
# frees a finished job's quota at once: a kept cluster would hold GPUs the queue hands to the next job.
KEEP_QUEUED = ("a queued job's cluster cannot be kept: Kueue frees a finished job's quota at once and refuses a RayJob "
               "that keeps its cluster; remove spec.keepFailedCluster or spec.queueName")

# flash-attn is on PyPI only as a source distribution (a CUDA build of hours), so the trainer image has
# none: a model asking for it failed to load after the whole Ray cluster had started.
FLASH_ATTENTION_NEEDS_IMAGE = ("the default trainer image has no flash-attn: set attnImplementation: sdpa, or set "
                               "resources.image to a trainer image with flash-attn installed")

# training.tensorParallel (DeepSpeed AutoTP) on a job: what the split needs of the rest of the spec.
TP_ON = TENSOR_PARALLEL.replace("self.", "self.training.")
TP_SIZE = "self.training.tensorParallel.size"
TENSOR_PARALLEL_RULES = (
    (f"!{TP_ON} || self.algorithm in {ONLINE}",
     "training.tensorParallel splits the actor and critic of online algorithms; offline algorithms deal their "
     "batches to every rank without it: remove training.tensorParallel", ".training.tensorParallel.size"),
    # Seen with DeepSpeed 0.19 and peft: AutoTP builds its sharded layer from a LoRA layer's base weight and the
    # adapters are gone from the model (nothing trains); DeepSpeed says nothing.
    *((f"!{TP_ON} || !has(self.models.{role}) || !has(self.models.{role}.lora)",
       f"DeepSpeed's AutoTP replaces each linear layer peft wrapped with a sharded copy of its base weight, dropping "
       f"the LoRA adapters: remove models.{role}.lora (adapters need no splitting: their state is megabytes) or "
       "training.tensorParallel", f".models.{role}.lora") for role in ("actor", "critic")),
    (f"!{TP_ON} || self.resources.gpusPerNode % {TP_SIZE} == 0",
     "AutoTP splits each layer over GPUs of one node (its collectives run every layer): make resources.gpusPerNode a "
     "multiple of training.tensorParallel.size", ".training.tensorParallel.size"),
    *((f"!{TP_ON} || !has(self.resources.gpus.{role}) || self.resources.gpus.{role} % {TP_SIZE} == 0",
       f"the {role}'s ranks form groups of training.tensorParallel.size: make resources.gpus.{role} a multiple of it",
       f".resources.gpus.{role}") for role in ("actor", "critic")),
    (f"!{TP_ON} || self.resources.gpusPerNode > 0 || has(self.resources.gpus.actor)",
     "on CPU a role has one rank unless resources.gpus.<role> says more: set resources.gpus.actor to a multiple of "
     "training.tensorParallel.size", ".resources.gpus.actor"),
    (f"!{TP_ON} || self.resources.gpusPerNode > 0 || !has(self.models.critic) || has(self.resources.gpus.critic)",
     "on CPU a role has one rank unless resources.gpus.<role> says more: set resources.gpus.critic to a multiple of "
     "training.tensorParallel.size", ".resources.gpus.critic"),
)

# training.sequenceParallel on a job: its groups of consecutive ranks in every model's group.
SP_ON = "(has(self.training.sequenceParallel) && has(self.training.sequenceParallel.size) && " \
        "self.training.sequenceParallel.size > 1)"
SP_SIZE = "self.training.sequenceParallel.size"
SEQUENCE_PARALLEL_RULES = (
    (f"!{SP_ON} || self.algorithm in {ONLINE}",
     "training.sequenceParallel splits the rows of online algorithms' passes; offline algorithms deal their batches "
     "to every rank without it: remove training.sequenceParallel", ".training.sequenceParallel.size"),
    *((f"!{SP_ON} || !has(self.resources.gpus.{role}) || self.resources.gpus.{role} % {SP_SIZE} == 0",
       f"the {role}'s ranks form groups of training.sequenceParallel.size that split each row: make "
       f"resources.gpus.{role} a multiple of it", f".resources.gpus.{role}") for role in RoleGPUs.model_fields),
    (f"!{SP_ON} || !has(self.data.prompts) || !has(self.data.prompts.imageKey)",
     "a vision-language model's passes read whole rows (its image positions are computed over the row), and "
     "training.sequenceParallel splits them: remove training.sequenceParallel or data.prompts.imageKey",
     ".training.sequenceParallel.size"),
    (f"!{SP_ON} || self.resources.gpusPerNode > 0 || has(self.resources.gpus.actor)",
     "on CPU a role has one rank unless resources.gpus.<role> says more: set resources.gpus.actor (and every other "
     "model's) to a multiple of training.sequenceParallel.size", ".resources.gpus.actor"),
)


class KeepFailedCluster(APIModel):
    """Keep the Ray cluster of a failed run for debugging: its dashboard, its logs, `kubectl exec` into its pods."""

    seconds: int | None = Field(None, ge=1, le=2**31 - 1)
    """How long after the failure KubeRay deletes it; unset: it stays until the RLHFJob is deleted (its ttlSecondsAfterFinished included)."""


class CodeConfigMap(NamedTuple):
    owner: str  # what loads it, for messages
    missing_reason: str  # the status reason while it does not exist
    name: str
    mount_dir: str


# Rules on the whole object: the only level whose CEL sees metadata.name (crd.py puts them at the root).
OBJECT_RULES = [
    {"rule": f"!has(self.spec.models.{role}) || !has(self.spec.models.{role}.fromJob) || "
             f"!has(self.metadata.name) || self.spec.models.{role}.fromJob.name != self.metadata.name",
     "message": f"models.{role}.fromJob names this job itself: name the job whose model this one starts from",
     "fieldPath": f".spec.models.{role}.fromJob.name"}
    for role in ModelsSpec.model_fields
]


def image_rule(dataset: str) -> tuple[str, str, str]:
    """data.<dataset>.imageKey only for the algorithms that take images (the catalogue's `images`)."""
    return (f"!has(self.data.{dataset}) || !has(self.data.{dataset}.imageKey) || "
            f"self.algorithm in {cel_list(algorithms.TAKES_IMAGES)}",
            f"data.{dataset}.imageKey gives the records images, and this algorithm does not take images (its models "
            f"load as text models): choose one that does ({prose(algorithms.TAKES_IMAGES)}) or remove "
            f"data.{dataset}.imageKey", f".data.{dataset}.imageKey")


class RLHFJobSpec(APIModel):
    """An RLHF or RL post-training run."""

    model_config = cel(
        (f"!(self.algorithm in {ONLINE}) || has(self.data.prompts)",
         "online algorithms train on prompts: set spec.data.prompts", ".data"),
        (f"!(self.algorithm in {cel_list(algorithms.NEEDS_REWARD)}) || has(self.reward) || has(self.environment)",
         "online algorithms need a reward: set spec.reward.sources (or spec.environment)", ".algorithm"),
        (f"!(self.algorithm in {cel_list(algorithms.USES_TEACHER)}) || has(self.models.teacher)",
         f"a teacher teaches {prose(algorithms.USES_TEACHER)}: set spec.models.teacher", ".models"),
        (f"self.algorithm in {cel_list(algorithms.USES_TEACHER)} || !has(self.models.teacher)",
         f"a teacher teaches {prose(algorithms.USES_TEACHER)} only: remove spec.models.teacher or set algorithm: "
         f"{algorithms.USES_TEACHER[0]}", ".models.teacher"),
        (f"self.algorithm in {ONLINE} || !has(self.environment)",
         "offline algorithms learn from the dataset, not from an environment: remove spec.environment", ".environment"),
        ("!has(self.environment) || !has(self.environment.maxTokensPerTurn) || "
         "self.environment.maxTokensPerTurn <= self.rollout.maxNewTokens",
         "environment.maxTokensPerTurn must not exceed rollout.maxNewTokens (the whole episode's budget)",
         ".environment.maxTokensPerTurn"),
        (f"self.algorithm in {ONLINE} || !has(self.evaluation)",
         "evaluation samples with the rollout engines of online algorithms: remove spec.evaluation", ".evaluation"),
        (f"!(self.algorithm in {cel_list(PREFERENCES)}) || has(self.data.preferences)",
         f"{prose(PREFERENCES)} train on preference data: set spec.data.preferences", ".data"),
        (f"!(self.algorithm in {cel_list(algorithms.reading('sft'))}) || has(self.data.sft)",
         f"{prose(algorithms.reading('sft'))} train on prompt/response records: set spec.data.sft", ".data"),
        (f"!(self.algorithm in {cel_list(algorithms.CONDITIONED)}) || (has(self.data.sft) && has(self.data.sft.scoreKey) "
         "&& self.data.scoreTemplate.contains('{score}'))",
         f"{prose(algorithms.CONDITIONED)} conditions each prompt on its response's score: set data.sft.scoreKey to "
         "the records' score field, and put {score} in data.scoreTemplate", ".data"),
        (f"self.algorithm in {cel_list(algorithms.CONDITIONED)} || !has(self.data.sft) || !has(self.data.sft.scoreKey)",
         f"only {prose(algorithms.CONDITIONED)} reads a score: remove data.sft.scoreKey or set algorithm: "
         f"{algorithms.CONDITIONED[0]}", ".data.sft.scoreKey"),
        (f"!(self.algorithm in {cel_list(algorithms.STEP_LABELLED)}) || (has(self.data.sft) && "
         "has(self.data.sft.labelKey))",
         f"{prose(algorithms.STEP_LABELLED)} learns each step's label: set data.sft.labelKey to the records' list of "
         "step labels (and data.sft.outputKey to their list of steps)", ".data"),
        *(image_rule(dataset) for dataset in ("prompts", "preferences", "sft")),
        (f"!(self.algorithm in {cel_list(algorithms.GROUP_SAMPLES)}) || self.rollout.samplesPerPrompt > 1",
         "this algorithm compares several samples of each prompt: set rollout.samplesPerPrompt to 2 or more (4-16 is usual)",
         ".rollout.samplesPerPrompt"),
        (f"!(self.algorithm in {cel_list(algorithms.USES_BEST_OF_N)}) || "
         "self.training.rejectionSampling.keepPerPrompt < self.rollout.samplesPerPrompt",
         f"{prose(algorithms.USES_BEST_OF_N)} trains on the best samples of each prompt: make "
         "training.rejectionSampling.keepPerPrompt smaller "
         "than rollout.samplesPerPrompt (keeping them all rejects none)", ".training.rejectionSampling.keepPerPrompt"),
        (f"!(self.algorithm in {cel_list(algorithms.ONE_STEP_PER_ROLLOUT)}) || (self.training.epochs == 1 && "
         "self.training.rolloutBatchSize * self.rollout.samplesPerPrompt == self.training.trainBatchSize)",
         f"{prose(algorithms.ONE_STEP_PER_ROLLOUT)} weighs each pair by the policy that sampled it, which is DPO's "
         "gradient for one optimizer step per rollout: set trainBatchSize to rolloutBatchSize * samplesPerPrompt "
         "and epochs to 1", ".training.trainBatchSize"),
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
        (f"{NO_REFRESH} || self.algorithm in {ONLINE}",
         "training.referenceRefresh moves an online run's reference during training; offline algorithms do not "
         "refresh theirs: remove training.referenceRefresh", ".training.referenceRefresh.intervalSteps"),
        (f"{NO_REFRESH} || self.algorithm in {cel_list(algorithms.ALWAYS_REFERENCED)} || "
         "!has(self.training.kl) || !has(self.training.kl.coef) || self.training.kl.coef > 0.0",
         "training.referenceRefresh has no reference to refresh: set training.kl.coef above 0 (the KL penalty loads "
         "the reference) or remove training.referenceRefresh", ".training.referenceRefresh.intervalSteps"),
        (f"{NO_REFRESH} || !has(self.models.actor.lora) || has(self.models.reference)",
         "a LoRA actor's reference is its own frozen base (the adapters switched off), which a refresh would "
         "overwrite: set models.reference to load a reference of its own, or remove training.referenceRefresh",
         ".training.referenceRefresh.intervalSteps"),
        ("!has(self.rollout.partial) || !self.rollout.partial || self.training.asyncQueueSize > 0",
         "partial rollouts pause rollouts that run ahead of training: set training.asyncQueueSize to 1 or more, "
         "or remove rollout.partial", ".rollout.partial"),
        ("self.resources.gpusPerNode == 0 || self.rollout.tensorParallelSize <= self.resources.gpusPerNode",
         "a vLLM engine runs within one node: tensorParallelSize must not exceed gpusPerNode", ".rollout.tensorParallelSize"),
        ("has(self.reward) == has(oldSelf.reward) && has(self.models.critic) == has(oldSelf.models.critic)",
         "spec.reward and spec.models define the run and are immutable; create a new RLHFJob instead"),
        ("has(self.environment) == has(oldSelf.environment) && has(self.evaluation) == has(oldSelf.evaluation)",
         "spec.environment and spec.evaluation define the run and are immutable; create a new RLHFJob instead"),
        ("has(self.queueName) == has(oldSelf.queueName)", QUEUE_IMMUTABLE, ".queueName"),
        ("!has(self.resources.topology) || has(self.queueName)",
         "resources.topology is carried out by Kueue's Topology-Aware Scheduling: set spec.queueName to a LocalQueue whose "
         "ClusterQueue has a ResourceFlavor with a topologyName, or remove resources.topology", ".resources.topology"),
        ("!has(self.keepFailedCluster) || !has(self.queueName)", KEEP_QUEUED, ".keepFailedCluster"),
        *((f"!has(self.models.{role}) || self.models.{role}.attnImplementation != 'flash_attention_2' || "
           "has(self.resources.image)", FLASH_ATTENTION_NEEDS_IMAGE, f".models.{role}.attnImplementation")
          for role in ModelsSpec.model_fields),
        *TENSOR_PARALLEL_RULES,
        *SEQUENCE_PARALLEL_RULES,
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
    environment: EnvironmentSpec | None = Field(None, json_schema_extra=immutable("environment"))
    """Multi-turn environment of the rollouts (online algorithms; agent RL): instead of or besides spec.reward."""
    evaluation: EvaluationSpec | None = Field(None, json_schema_extra=immutable("evaluation"))
    """Evaluation sets scored during training, and the best checkpoint (online algorithms)."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra=immutable("rollout"))
    """Generation settings (online algorithms)."""
    training: TrainingSpec = Field(default_factory=TrainingSpec, json_schema_extra=immutable("training"))
    """Optimisation settings."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, json_schema_extra=immutable("resources"))
    """Pods, GPUs, networking and environment."""
    runtime_ref: RuntimeRef | None = Field(None, json_schema_extra=immutable("runtimeRef"))
    """The runtime (a cluster's conventions: images, node selection, RDMA, pod sizes, volumes, queue) whose settings fill what spec.resources and queueName leave at their defaults; unset: the namespace's default RLHFRuntime, else the default ClusterRLHFRuntime, else none. The runtime is read once, when the job starts: status.runtime records it, and editing it later leaves this job as it is."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, json_schema_extra=immutable("checkpoint"))
    """Checkpoints and resume."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, json_schema_extra=immutable("tracking"))
    """Experiment tracking: Weights & Biases and MLflow, besides the TensorBoard events and metrics.jsonl always written to checkpoint.path/logs."""
    suspend: bool = False
    """Suspend the job: its Ray cluster is deleted and recreated on resume (from the newest checkpoint). Kueue sets this."""
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    """Delete the RLHFJob (and its children) this long after it succeeds or fails. Not applied to a job Argo CD syncs (annotation argocd.argoproj.io/tracking-id): auto-sync would create it again and rerun it; remove it from Git instead."""
    active_deadline_seconds: int | None = Field(None, ge=1)
    """Fail the job when it has run longer than this since it first started, across every retry (KubeRay restarts its own deadline with each attempt; the operator enforces the total)."""
    startup_deadline_seconds: int | None = Field(None, ge=1)
    """Fail an attempt whose Ray cluster and training job are not running this long after KubeRay began to start it (pods unschedulable, images not pulled...; KubeRay's preRunningDeadlineSeconds). Unset: wait, with the reason in status."""
    keep_failed_cluster: KeepFailedCluster | None = None
    """Keep the Ray cluster (and its GPUs) after the run fails, instead of deleting it, for debugging; status.keptCluster says which and until when. Not with spec.queueName. A successful run's cluster goes as usual."""
    backoff_limit: int = Field(0, ge=0, le=100)
    """Retries of the whole run after a failure (each resumes from the newest checkpoint)."""
    # A LocalQueue's name, and the RayJob carries it as the label kueue.x-k8s.io/queue-name: a label value.
    queue_name: str | None = Field(None, max_length=63, pattern=DNS_SUBDOMAIN, json_schema_extra={"x-kubernetes-validations": [
        {"rule": "self == oldSelf", "message": QUEUE_IMMUTABLE}]})
    """Kueue LocalQueue in the job's namespace (a name of at most 63 characters); the job is created suspended and Kueue admits it when the queue has quota."""

    @model_validator(mode="after")
    def _algorithm_defaults(self) -> RLHFJobSpec:
        """The unset training fields the catalogue defaults per algorithm take the algorithm's values, as
        the API server's algorithm-defaults policy sets them, so that the trainers, their workers and
        the trainer's config (`rlhf validate`'s defaults) read the values the stored job shows."""
        self.training = self.training.with_defaults(self.algorithm)
        return self

    @property
    def engine_memory_utilization(self) -> float:
        """rollout.gpuMemoryUtilization, or its default for the job's colocation."""
        if self.rollout.gpu_memory_utilization is not None:
            return self.rollout.gpu_memory_utilization
        return ENGINE_MEMORY_SHARED if self.training.colocation == "all" else ENGINE_MEMORY_ALONE

    @property
    def engine_dtype(self) -> str:
        """The rollout engines' dtype: the actor's, but bfloat16 when training.bf16 autocasts a float32 actor
        (generation in bfloat16 as the passes are; the weight sync sends that dtype)."""
        actor = self.models.actor.dtype
        return "bfloat16" if self.training.autocasts(actor) else actor

    def code_config_maps(self) -> list[CodeConfigMap]:
        """Every ConfigMap of Python code the job loads (function rewards', the environment's): the
        operator waits for each and mounts it where the trainer looks."""
        found = [CodeConfigMap(f"reward source {s.name!r}", "RewardConfigMapNotFound", s.function.config_map,
                               f"{contract.REWARD_FUNCTIONS_DIR}/{s.name}")
                 for s in (self.reward.sources if self.reward else []) if s.function and s.function.config_map]
        environment = self.environment.function if self.environment else None
        if environment and environment.config_map:
            found.append(CodeConfigMap("the environment", "EnvironmentConfigMapNotFound", environment.config_map,
                                       contract.ENVIRONMENT_CODE_DIR))
        return found


# ----------------------------------------------------------------------------------------- status

Phase = Literal["Waiting", "Pending", "Provisioning", "Running", "Succeeded", "Failed", "Suspended"]


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
    result: Literal["Succeeded", "Failed"] | None = None
    """How the trainer's run ended, as the trainer saw it (the phase is the operator's verdict; this tells it a finished run from a lost one when the RayJob is gone)."""


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
    evaluation: dict[str, float] | None = None
    """Latest evaluation results (spec.evaluation): <set>/mean_reward, <set>/pass@<k>, and for bestMetric best/step and best/value (the checkpoint in checkpoint.path/best)."""


class CheckpointStatus(APIModel):
    """The newest checkpoint."""

    step: int
    """Step it was taken at."""
    path: str
    """Where it is."""
    time: DateTime
    """When it was written."""


class KeptCluster(APIModel):
    """The Ray cluster of a failed run, kept for debugging (spec.keepFailedCluster)."""

    name: str
    """The RayCluster."""
    until: DateTime | None = None
    """When KubeRay deletes it; unset: when the RLHFJob is deleted."""


class PodUsage(APIModel):
    """What one pod of the job's Ray clusters held, and from when to when."""

    name: str
    """The pod's name."""
    gpus: int = 0
    """GPUs it requested (of spec.resources.gpuResourceName), as the scheduler counts a pod's requests."""
    cpus: float = 0.0
    """CPU cores it requested, counted alike."""
    gpu_product: str | None = None
    """Its node's nvidia.com/gpu.product label (read when the operator has GPU-hour prices)."""
    start_time: DateTime
    """The pod's status.startTime."""
    end_time: DateTime | None = None
    """When it stopped holding them: its containers' last finish, else its deletion; unset while it runs."""


class AttemptUsage(APIModel):
    """The usage of one attempt (one Ray cluster)."""

    ray_cluster_name: str
    """The attempt's Ray cluster."""
    gpu_seconds: int = 0
    """Sum over its pods of running seconds times GPUs."""
    cpu_seconds: float = 0.0
    """Sum over its pods of running seconds times CPU cores."""
    estimated_cost: float | None = None
    """GPU-hours times the operator's price for each pod's GPU product (unset without prices)."""
    pods: list[PodUsage] = Field(default_factory=list)
    """Its pods, as the operator saw them start and stop."""


class Usage(APIModel):
    """What the job's pods held, written by the operator from the pods it watches; running pods are counted up to countedUntil."""

    gpu_seconds: int = 0
    """GPU-seconds of every attempt."""
    cpu_seconds: float = 0.0
    """CPU-core-seconds of every attempt."""
    gpu_hours: float = 0.0
    """gpuSeconds / 3600, rounded to 0.01 (kubectl get)."""
    estimated_cost: float | None = None
    """Sum of the attempts' estimated costs (unset without prices)."""
    counted_until: DateTime | None = None
    """When the running pods were last counted up to."""
    attempts: list[AttemptUsage] = Field(default_factory=list)
    """Per attempt, oldest first."""


class OutputModel(APIModel):
    """Where the model a finished job exported is, for the jobs that name it (models.<role>.fromJob)."""

    claim_name: str
    """The PersistentVolumeClaim it is on (the job's spec.checkpoint.pvc)."""
    sub_path: str
    """The job's directory on that claim (its name)."""
    final: str
    """The final model, relative to subPath (final, or final/merged for a LoRA actor exported merged)."""
    best: str | None = None
    """The best evaluated checkpoint, relative to subPath (spec.evaluation.bestMetric), when the job kept one."""
    kind: Literal["policy", "reward"]
    """policy: a causal LM (for an actor, reference or teacher); reward: a sequence classifier (an rm job's, for models.reward or models.critic)."""
    step: int | None = None
    """The step it was exported at."""


class JobInput(APIModel):
    """A job this one starts from (models.<role>.fromJob), as last seen."""

    role: str
    """The model it gives: actor, critic, reference, reward or teacher."""
    name: str
    """The RLHFJob's name."""
    uid: str | None = None
    """Its uid once seen: a job deleted after that fails this one (one re-created under the name is another)."""
    phase: str | None = None
    """Its phase when last seen."""


class RuntimeStatus(APIModel):
    """Which runtime a job was made with, and what it said then: a later edit of the runtime changes no job made."""

    kind: RuntimeKind
    name: str
    generation: int | None = None
    """The runtime's metadata.generation when the job was made."""
    spec: RLHFRuntimeSpec
    """The runtime's spec when the job was made: what the job keeps applying."""


class RLHFJobStatus(APIModel):
    """Observed state, written by the operator (phase, conditions, children) and the trainer (progress, metrics)."""

    phase: Phase | None = None
    """Waiting (for an input job: models.<role>.fromJob), Pending, Provisioning, Running, Succeeded, Failed or Suspended."""
    reason: str | None = None
    """Reason of the current phase (CamelCase)."""
    message: str | None = None
    """What happened and, on failure, what to change."""
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
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
    kept_cluster: KeptCluster | None = None
    """The failed run's Ray cluster, kept for debugging (spec.keepFailedCluster)."""
    usage: Usage | None = None
    """GPU- and CPU-seconds held by the job's Ray cluster pods, per attempt and in total (written by the operator)."""
    inputs: list[JobInput] | None = None
    """The jobs whose models this one starts from (models.<role>.fromJob): its lineage."""
    output_model: OutputModel | None = None
    """The model this job exported, once Succeeded: what models.<role>.fromJob of a later job loads."""
    runtime: RuntimeStatus | None = None
    """The runtime the job was made with, as it was then (spec.runtimeRef, or the default)."""


class RLHFJob(APIModel):
    """An RLHFJob: one RLHF / RL post-training run on a KubeRay cluster."""

    api_version: Literal["rlhf.dev/v1alpha1"] = API_VERSION
    kind: Literal["RLHFJob"] = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RLHFJobSpec
    status: RLHFJobStatus | None = None
