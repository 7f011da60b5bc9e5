"""spec.rollout (vLLM generation) and spec.training (DeepSpeed, batch sizes, the RL loss)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..algorithms import ALGORITHMS, CATALOGUE, TRAINING_DEFAULTS
from .base import APIModel, cel, section
from .shaping import DynamicSamplingSpec, LengthShapingSpec

# Names shared with the trainer's registry (rlhf_trainer.losses.LOSS_AGGREGATIONS; a test checks them).
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def per_algorithm(name: str) -> str:
    """The description's note on a TRAINING_DEFAULTS field (`kubectl explain` shows it): its value per algorithm."""
    values = [f"{a.defaults[name]} for {a.name}" for a in CATALOGUE if name in a.defaults]
    if not values:
        return f" Unset: {TRAINING_DEFAULTS[name]}."
    return f" Unset: the algorithm's default ({', '.join(values)}, {TRAINING_DEFAULTS[name]} otherwise)."


# rollout.gpuMemoryUtilization when unset: engines alone on their GPUs, or sharing them with training
ENGINE_MEMORY_ALONE, ENGINE_MEMORY_SHARED = 0.9, 0.5


class RolloutSpec(APIModel):
    """Generation with vLLM engines (online algorithms)."""

    model_config = cel(
        ("!has(self.lengthShaping) || !has(self.lengthShaping.overlongBufferTokens) || "
         "self.lengthShaping.overlongBufferTokens < self.maxNewTokens",
         "lengthShaping.overlongBufferTokens must be smaller than maxNewTokens (it is the end of that budget)",
         ".lengthShaping.overlongBufferTokens"),
        ("!has(self.dynamicSampling) || !has(self.dynamicSampling.enabled) || !self.dynamicSampling.enabled || "
         "self.samplesPerPrompt > 1",
         "dynamic sampling drops groups whose samples all earn the same reward: set samplesPerPrompt to 2 or more",
         ".dynamicSampling.enabled"),
    )

    engines: int = Field(1, ge=1, le=1024)
    """Number of vLLM engines."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """Tensor-parallel workers per vLLM engine, one process each on one node: its GPUs (on CPU, processes sharing the node's cores)."""
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
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Fraction of each of its GPUs' memory a vLLM engine may take (weights + KV cache). Unset: 0.9 (vLLM's own default) when the engines have their GPUs to themselves, 0.5 with training.colocation all (the hybrid engine, which shares them with training)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower decoding, faster start, less memory)."""
    enable_prefix_caching: bool = True
    """Reuse KV cache across samples of one prompt."""
    partial: bool = False
    """Partial rollouts (needs training.asyncQueueSize > 0): each weight sync pauses the engines where they stand instead of waiting for the rollouts sent before it; the samples in flight keep their tokens and go on with the new weights, so generation never waits for an update and no sample is thrown away. A sample may then mix tokens of two policies: each token's log-prob is its own policy's, which training.rolloutCorrectionCap weighs per token (the metrics rollout/staleness_max and rollout/partial_fraction show how much)."""
    weight_sync_bucket_mib: int = Field(256, ge=1, le=16384)
    """MiB of weights per transfer to the vLLM engines after each update: the actor gathers its weights
    and sends them flattened into buckets of this size, one gather and one broadcast (or same-GPU
    handle) per bucket; a larger weight goes alone. Larger buckets mean fewer transfers and more
    memory while the sync runs: up to 3 buckets on each actor GPU, 1 on each engine's."""
    dynamic_sampling: DynamicSamplingSpec = section(DynamicSamplingSpec)
    """Drop groups that train nothing and sample more prompts (DAPO)."""
    length_shaping: LengthShapingSpec = section(LengthShapingSpec)
    """Overlong and truncation penalties (DAPO)."""


# --------------------------------------------------------------------------------------- training


class KLSpec(APIModel):
    """KL regularisation against the reference model (Schulman 2020, "Approximating KL Divergence")."""

    # k1's expected gradient is zero: in the loss it regularises nothing (OpenRLHF warns the same).
    model_config = cel(
        # has(): the API server also checks the rule on this section's own default, {} (defaults
        # are filled in before real objects are validated).
        ("!(has(self.placement) && has(self.estimator) && self.placement == 'loss' && self.estimator == 'k1')",
         "k1 in the loss regularises nothing (its expected gradient is zero): use estimator k2 (its gradient is the "
         "exact KL's) or k3, or placement reward", ".estimator"),
    )

    coef: float = Field(0.001, ge=0)
    """KL coefficient; 0 disables the penalty and the reference model."""
    estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token estimator: k1 = log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    placement: Literal["reward", "loss"] = "reward"
    """reward: subtract coef*KL from each token's reward (InstructGPT); loss: add coef*KL to the policy loss (GRPO; with k2 or k3)."""


class ReferenceRefreshSpec(APIModel):
    """The reference moved to the policy as training goes (TR-DPO, Gorbatovski et al. 2024, arXiv:2404.09656; TRL's sync_ref_model): the KL penalty, or online-dpo's implicit reward, then anchors to a recent policy instead of the initial model."""

    interval_steps: int = Field(0, ge=0)
    """Refresh the reference after every this many steps (online algorithms with a reference; the refreshed reference is saved with each checkpoint, so a resumed run goes on from it). 0: never, the reference stays the model it loaded."""
    mixup_alpha: float = Field(1.0, gt=0, le=1)
    """Each refresh sets the reference to alpha * policy + (1 - alpha) * reference (TR-DPO's soft update); 1 copies the policy."""


class PreferenceSpec(APIModel):
    """Hyperparameters of the offline preference losses."""

    beta: float = Field(0.1, gt=0)
    """Inverse temperature of dpo/cdpo/kto and online-dpo; the regularisation strength tau of ipo."""
    # Not lt=0.5: the API server compares a whole number (0) with a fractional exclusive bound as
    # integers (0 < 0) and refuses the default.
    label_smoothing: float = Field(0.0, ge=0, le=0.49)
    """cdpo: assumed probability that a preference label is flipped."""
    desirable_weight: float = Field(1.0, gt=0)
    """kto: weight of desirable examples."""
    undesirable_weight: float = Field(1.0, gt=0)
    """kto: weight of undesirable examples."""


class RejectionSamplingSpec(APIModel):
    """Which samples raft trains on (Dong et al. 2023, RAFT, arXiv:2304.06767)."""

    keep_per_prompt: int = Field(1, ge=1, le=1024)
    """The best samples of each prompt trained on, ranked by reward (less the KL penalty when training.kl places it in the reward); must be fewer than rollout.samplesPerPrompt. A sample no better than its prompt's worst is never kept: a prompt whose samples all score alike keeps none."""
    min_reward: float | None = None
    """Keep only samples whose reward is at least this (1 on a task scored 0 or 1: only right answers). Unset: no threshold. Metric trained_fraction is the share of samples kept."""


class DistillationSpec(APIModel):
    """What distill (on-policy: Agarwal et al. 2024, GKD, arXiv:2306.13649; Gu et al. 2024, MiniLLM, arXiv:2306.08543) and kd (on data.sft: Hinton et al. 2015, arXiv:1503.02531) learn from the teacher."""

    kl_coef: float = Field(1.0, gt=0)
    """Weight of the teacher. distill: each sampled token's reward is minus this times log pi_actor - log pi_teacher (the per-token reverse KL, whose expectation the policy gradient minimises); kd: the loss is the response's NLL plus this times the forward KL from the teacher's next-token distribution to the actor's at each response token (jsdBeta: its divergence instead, for distill too). Metric teacher_kl is the KL's mean."""
    reward_coef: float = Field(0.0, ge=0)
    """distill: weight of spec.reward's total in the training signal. 0: the reward only measures (its metrics and spec.evaluation), the teacher alone teaches."""
    top_k: int = Field(20, ge=1, le=1024)
    """kd, and distill with jsdBeta: the teacher's k likeliest tokens at each response position, renormalised over them, are the soft target (what the teacher sends per token: k log-probs and ids, not the vocabulary)."""
    jsd_beta: float | None = Field(None, ge=0, lt=1)
    """GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024, arXiv:2306.13649) from the teacher's top_k next-token distribution to the actor's at every response token, with this beta: 0 is the forward KL(teacher || actor), which covers all of the teacher's likely tokens; toward 1 it seeks the teacher's likeliest ones, as the reverse KL does. distill: the divergence times kl_coef joins the policy loss, differentiated through the actor's whole distribution at each sampled position (the reward, weighted by reward_coef, stays the policy gradient's signal); unset: each sampled token's reverse KL, in the reward. kd: it replaces the forward KL (unset: 0). Metric teacher_jsd (teacher_kl at 0)."""


class SequenceParallelSpec(APIModel):
    """Sequence parallelism for long samples: each packed row's tokens split over `size` ranks of a trained or
    scoring model's group (DeepSpeed-Ulysses: the ranks trade each attention layer's heads for the whole
    sequence), so one sample's activations and logits need 1/size of a GPU's memory."""

    size: int = Field(1, ge=1, le=64)
    """Ranks one row's tokens are split over: 1 is off. It divides the ranks of every model group (resources.gpus.<role>)
    and the model's attention heads and key-value heads (checked when the trainer loads the model); the data-parallel
    degree becomes ranks / size, and trainBatchSize and rolloutBatchSize are dealt to ranks / size groups."""


# CEL, on a training section: tensor parallelism is on (the API server fills the defaults in first; has() for clusters
# without them).
TENSOR_PARALLEL = "(has(self.tensorParallel) && has(self.tensorParallel.size) && self.tensorParallel.size > 1)"


class TensorParallelSpec(APIModel):
    """Tensor-parallel training with DeepSpeed's AutoTP (OpenRLHF's --ds_tensor_parallel_size): the actor's and the critic's linear layers split over `size` ranks, each holding 1/size of every layer's weights, gradients and optimizer state, the ranks of one split computing each layer together."""

    size: int = Field(1, ge=1, le=64)
    """Ranks each layer is split over: 1 is off. They are consecutive ranks of the actor's (and the critic's) group on one node, so it divides resources.gpusPerNode and the group's ranks (resources.gpus.actor / critic); the data-parallel degree becomes ranks / size, every rank of a split reading the same samples. The model's key-value heads must divide by it (checked when the trainer starts). With zeroStage 0-2 only and without LoRA; the reference, reward and teacher models stay whole on each of their ranks."""


class TrainingSpec(APIModel):
    """Optimisation: DeepSpeed, batch sizes, the RL loss and its regularisers."""

    model_config = cel(
        ("self.microTrainBatchSize <= self.trainBatchSize", "microTrainBatchSize must not exceed trainBatchSize", ".microTrainBatchSize"),
        # The API server's algorithm-defaults policy sets both before this rule runs (on a cluster without it they may be unset).
        ("!has(self.clipEps) || !has(self.clipEpsHigh) || self.clipEpsHigh == 0.0 || self.clipEpsHigh >= self.clipEps", "clipEpsHigh must be 0 (same as clipEps) or at least clipEps", ".clipEpsHigh"),
        # ZeRO-3 would gather each layer whole over the data-parallel ranks, undoing the split; the trainer's gathers
        # (weight sync, export) compose AutoTP's shards with ZeRO 0-2's whole parameters only.
        (f"!{TENSOR_PARALLEL} || self.zeroStage <= 2",
         "tensorParallel (DeepSpeed AutoTP) trains with zeroStage 0, 1 or 2: set zeroStage 2 (ZeRO-2 splits the "
         "gradients and optimizer state over the data-parallel ranks besides), or remove tensorParallel",
         ".zeroStage"),
        (f"!{TENSOR_PARALLEL} || !has(self.sequenceParallel) || !has(self.sequenceParallel.size) || "
         "self.sequenceParallel.size == 1",
         "tensorParallel and sequenceParallel together are not supported (their rank groups would have to be laid "
         "out as one mesh): use one of them", ".tensorParallel.size"),
    )

    zero_stage: Literal[0, 1, 2, 3] = 3
    """DeepSpeed ZeRO stage: 3 shards parameters, gradients and optimizer state."""
    bf16: bool = True
    """Mixed precision in bfloat16: the passes' matmuls in bfloat16. On bfloat16 weights (models.<role>.dtype, the default) DeepSpeed's bf16: the optimizer keeps float32 master weights and the passes read a bfloat16 copy, which moves only once the updates add up to bfloat16's resolution (about 0.4% of a weight). On float32 weights torch autocast: weights, gradients and optimizer stay float32 and the rollout engines generate in bfloat16; the fit for CPUs with AVX-512 BF16 or AMX and for small learning rates."""
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
    reference_refresh: ReferenceRefreshSpec = section(ReferenceRefreshSpec)
    """The reference moved to the policy every few steps instead of staying the initial model."""
    clip_eps: float | None = Field(None, gt=0, lt=1, description=(
        "Clip range epsilon of the importance ratio (PPO, Schulman et al. 2017)."
        + per_algorithm("clipEps")))
    clip_eps_high: float | None = Field(None, ge=0, lt=10, description=(
        'Upper clip range when different from clipEps ("clip-higher", DAPO, Yu et al. 2025); 0 uses clipEps.'
        + per_algorithm("clipEpsHigh")))
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (Ye et al. 2020)."""
    rollout_correction_cap: float | None = Field(None, ge=1)
    """Rollout correction, truncated importance sampling against vLLM's sampling log-probs (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"): each token's policy loss is weighed by min(pi_trainer_old / pi_vllm, C) with this cap C (2 in the paper; verl's rollout_is_threshold), correcting the gap between the engine's and the trainer's probabilities (metric logprob_diff); metric rollout_correction_clipped_fraction is the share of tokens the cap bounded. Unset: off."""
    value_clip: float = Field(0.2, gt=0)
    """Clip range of the value loss (ppo)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor."""
    gae_lambda: float = Field(0.95, ge=0, le=1)
    """GAE lambda (ppo)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    loss_aggregation: LossAggregation | None = Field(
        None, description=(
            "How token losses become the loss of an optimizer step: token-mean (every valid token of the step weighs "
            "the same, DAPO), seq-mean-token-mean (mean per sequence, then over sequences: GRPO as published), "
            "seq-mean-token-sum (sum per sequence, no length normalisation), seq-mean-token-sum-norm (sum per "
            "sequence over the constant rollout.maxNewTokens: Dr. GRPO)." + per_algorithm("lossAggregation")))
    preference: PreferenceSpec = section(PreferenceSpec)
    """dpo, ipo, cdpo, kto and online-dpo hyperparameters."""
    rejection_sampling: RejectionSamplingSpec = section(RejectionSamplingSpec)
    """raft: which of each prompt's samples are trained on."""
    distillation: DistillationSpec = section(DistillationSpec)
    """distill: the teacher's weight and the reward's."""
    sequence_parallel: SequenceParallelSpec = section(SequenceParallelSpec)
    tensor_parallel: TensorParallelSpec = section(TensorParallelSpec)
    """Split the actor's and critic's layers over several ranks (models whose weights, gradients and optimizer state do not fit one GPU even under ZeRO-2)."""
    """Split each sample's tokens over several ranks (long answers whose activations and logits do not fit one GPU)."""
    colocation: Literal["none", "actor-reference", "all"] = "none"
    """Share GPUs: none (each role has its own), actor-reference, or all (hybrid engine: every model and vLLM on the same GPUs, taking turns)."""
    async_queue_size: int = Field(0, ge=0, le=64)
    """0: rollout and training alternate. N > 0: rollouts run up to N batches ahead of training (off-policy by up to N updates)."""
    pack_samples: bool = True
    """Pack each micro-batch's samples into rows without padding in the language models' forward and backward passes (actor and reference log-probs, the sft, dpo, ipo, cdpo and kto steps; not the critic's or reward model's): position ids restart at each sample and attention stays within it, with every models.*.attnImplementation. false pads every sample to the longest."""
    freeze_vision_tower: bool = True
    """Vision-language models: keep the vision encoder's weights (its patch embedding and blocks) as loaded, training the language model and the projector that feeds it image features (most recipes' choice: the tower is already good at seeing, and its gradients cost memory). The weight sync then never sends the tower. false trains it too. Text-only models have no tower: no effect."""
    seed: int = 42
    """Random seed for data order, sampling and initialisation."""

    def autocasts(self, dtype: str) -> bool:
        """bf16 on weights of this dtype is torch autocast (float32 weights), not DeepSpeed's bf16 (see bf16)."""
        return self.bf16 and dtype == "float32"

    def with_defaults(self, algorithm: str) -> TrainingSpec:
        """This section with each unset TRAINING_DEFAULTS field at the algorithm's value (the catalogue's)."""
        names = {f.alias: name for name, f in type(self).model_fields.items()}
        unset = {names[k]: v for k, v in ALGORITHMS[algorithm].training_defaults.items() if getattr(self, names[k]) is None}
        return self.model_copy(update=unset)
