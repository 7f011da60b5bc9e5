"""One rank's model inside a DeepSpeed engine: the config a rank is sent, each role's DeepSpeed
config and learning-rate schedule, loading the Hugging Face model, and the forward passes the
training steps (objectives.py) and the worker's scoring share.

Roles:
- actor: causal LM, trained with the policy loss the catalogue names for the algorithm; log-probs of response tokens.
- reference: frozen causal LM; log-probs for the KL penalty.
- critic: sequence classifier whose score head is read at every token (values), trained with the value loss.
- reward: frozen sequence classifier scoring whole texts (the reward of a `type: model` source).
- rm: the same sequence classifier, trained (the offline algorithm rm), exported in Hugging Face format.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from rlhf_api.algorithms import ALGORITHMS, CAUSAL_LM_ROLES, TRAINED_ROLES
from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec

from ..losses import token_log_probs
from ..rewards.process import STEP_SEPARATOR_KEY
from .lora import apply_lora, quantization_config
from .packing import pack, pack_images, unpack_logits
from .vision import NEVER_SAMPLED_BIAS, freeze_tower, is_vision_language, model_inputs, never_sampled
from .tensor_parallel import accumulation_batch, autotp_config, grad_norm, split_size
from .sequence_parallel import ATTENTION as sequence_parallel_attention
from .sequence_parallel import Read, SequenceParallel, split_problem
from .sequence_parallel import initialize as initialize_sequence_parallel

# The roles a vision-language model may fill (image-text-to-text models): the policy and its reference.
VISION_LANGUAGE_ROLES = ("actor", "reference")
SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine_with_min_lr": "cosine_with_min_lr"}
MIN_LR_RATE = 0.1  # cosine_with_min_lr decays to a tenth of the peak learning rate


@dataclass
class ModelConfig:
    """What a rank needs to build its model and engine (sent once, at setup)."""

    role: str  # actor | critic | reference | reward
    path: str  # resolved local directory or Hugging Face id
    model: ModelSpec
    training: TrainingSpec
    temperature: float = 1.0  # log-probs are those of the sampling distribution softmax(logits / T)
    optimizer_steps: int = 1  # length of the learning-rate schedule
    use_gpu: bool = False
    max_new_tokens: int | None = None  # online: rollout.maxNewTokens, seq-mean-token-sum-norm's constant
    algorithm: str = "ppo"  # spec.algorithm: its catalogue entry names the actor's policy loss
    # prm's rm: data.stepSeparator, kept in the model's config (rewards.process.STEP_SEPARATOR_KEY) for its readers
    step_separator: str | None = None

    def __post_init__(self) -> None:
        # A job's training section has the algorithm's defaults already (RLHFJobSpec); a bare one gets them here.
        self.training = self.training.with_defaults(self.algorithm)

    @property
    def policy_loss(self) -> str:
        """The rlhf_trainer.losses.POLICY_LOSSES key the catalogue names for the algorithm."""
        return ALGORITHMS[self.algorithm].policy_loss


def deepspeed_config(cfg: ModelConfig, world_size: int) -> dict:
    """DeepSpeed config of a role; frozen models keep ZeRO-3 sharding (or none) and get no optimizer."""
    training, trainable = cfg.training, cfg.role in TRAINED_ROLES
    stage = training.zero_stage if trainable else (3 if training.zero_stage == 3 else 0)
    zero: dict = {"stage": stage}
    if stage == 3 and training.sequence_parallel.size > 1:
        # ZeRO-3's reduce-scatter path (DeepSpeed 0.19) averages the gradients over all ranks, ignoring the
        # sequence-parallel groups whose ranks' gradients add up (half the gradient at size 2, seen); its
        # all-reduce path divides by ranks / size as ZeRO-1 and 2 do.
        zero["reduce_scatter"] = False
    if trainable and training.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.use_gpu}
    micro = training.micro_train_batch_size if trainable else training.micro_rollout_batch_size
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": training.train_batch_size if trainable else micro * world_size,
        "gradient_clipping": training.max_grad_norm,
        "zero_optimization": zero,
        # training.bf16 on bfloat16 weights: DeepSpeed's bf16, fp32 master weights in the optimizer. On float32
        # weights: torch autocast, the matmuls in bfloat16 and the weights, gradients and optimizer in float32,
        # so that updates smaller than bfloat16's grid still land (Hugging Face Trainer's bf16 on a float32 model).
        "bf16": {"enabled": training.bf16 and cfg.model.dtype == "bfloat16"},
        "torch_autocast": {"enabled": training.autocasts(cfg.model.dtype), "dtype": "bfloat16"},
        "fp16": {"enabled": cfg.model.dtype == "float16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if trainable:
        lr = training.critic_learning_rate if cfg.role == "critic" else training.learning_rate
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": lr, "betas": [0.9, 0.95], "weight_decay": training.weight_decay,
            # torch.optim.AdamW on every device and with offloadOptimizer too: DeepSpeed's own choices are
            # ops built at first use, FusedAdam with nvcc at each GPU pod's start and DeepSpeedCPUAdam (a
            # C++ build that neither image nor the set-up makes).
            # Its fused kernel (CUDA and CPU) steps 20M float32 parameters on CPU in 41 ms, against 392 ms
            # unfused and 52 ms for DeepSpeedCPUAdam (2 busy cores).
            "torch_adam": True, "fused": True,
        }}
    if (tensor_parallel := split_size(cfg.role, training)) > 1:  # AutoTP: tensor_parallel.py
        config |= autotp_config(tensor_parallel)
        config["train_batch_size"] = accumulation_batch(training.train_batch_size, tensor_parallel)
    return config


def lr_scheduler(cfg: ModelConfig, optimizer):
    """training.lrScheduler over cfg.optimizer_steps, after training.lrWarmupRatio of them of warmup."""
    from transformers import get_scheduler

    training, steps = cfg.training, cfg.optimizer_steps
    cosine = training.lr_scheduler == "cosine_with_min_lr"
    return get_scheduler(
        SCHEDULERS[training.lr_scheduler], optimizer,
        num_warmup_steps=math.ceil(training.lr_warmup_ratio * steps), num_training_steps=steps,
        scheduler_specific_kwargs={"min_lr_rate": MIN_LR_RATE} if cosine else None,
    )


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, so a left-padded prompt sees the positions vLLM used."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


class ValueModel(nn.Module):
    """A sequence classifier read at every position: the value (critic) or reward of each prefix."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                **kwargs) -> Tensor:
        """positions: a split row's position ids (sequence_parallel.py: no mask then, kwargs carry its layout)."""
        hidden = self.classifier.base_model(
            input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids(attention_mask) if positions is None else positions, **kwargs,
        ).last_hidden_state
        return self.classifier.score(hidden).squeeze(-1).float()  # [B, S]


@dataclass
class Model:
    """One rank's model in its DeepSpeed engine (see `load_model`), with the forward passes it is read by."""

    cfg: ModelConfig
    rank: int
    engine: Any  # deepspeed.DeepSpeedEngine
    tokenizer: Any
    zero3: bool  # parameters sharded (ZeRO-3): reading a full one is a collective gather
    # Under ZeRO-3, from_pretrained must see the config to load straight into shards; it has to
    # stay alive as long as the model (transformers holds only a weak reference).
    hf_ds_config: Any = None
    peft: Any = None  # with models.<role>.lora: the PeftModel around the engine's module (lora.py)
    grad_norms: list[float] = field(default_factory=list)  # per optimizer step, see backward_step
    sequence_parallel: SequenceParallel | None = None  # training.sequenceParallel.size > 1: this rank's share
    # A vision-language model's vision tower, frozen (training.freezeVisionTower): its parameters' names,
    # which the weight sync never sends (vLLM loaded them from the same checkpoint)
    frozen_tower: set[str] = field(default_factory=set)

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def action_logits(self, sequences: Tensor, attention_mask: Tensor, num_actions: int,
                      vision: dict[str, Tensor] | None = None) -> Tensor:
        """Logits [B, T, V] predicting the last num_actions tokens, at the sampling temperature; the
        samples packed without padding with training.packSamples (packing.py). vision: the rows' image
        inputs (vision.py); padded, the model computes its multimodal positions from the mask, packed, each
        sample's positions and images travel with it (pack_images)."""
        if vision is not None:
            inputs = model_inputs(sequences, num_actions, vision["pixel_values"], vision["image_grid_thw"],
                                  self.engine.module.config.image_token_id)
            if self.cfg.training.pack_samples:
                packed = pack(sequences, attention_mask, num_actions,
                              one_row=self.cfg.model.attn_implementation == "flash_attention_2")
                rows = pack_images(packed, sequences, attention_mask, inputs["mm_token_type_ids"], vision,
                                   self.engine.module)
                logits = unpack_logits(self.engine(input_ids=packed.input_ids, logits_to_keep=packed.keep,
                                                   use_cache=False, **rows).logits, packed).float()
            else:
                logits = self.engine(input_ids=sequences, attention_mask=attention_mask, logits_to_keep=num_actions + 1,
                                     use_cache=False, **inputs).logits[:, :-1].float()
            logits[..., never_sampled(self.engine.module.config)] += NEVER_SAMPLED_BIAS  # as the engines sample
            return logits / (self.cfg.temperature or 1.0)
        if self.sequence_parallel is not None:  # gathered whole: the reads below keep them split
            return self.action_reads(sequences, attention_mask, num_actions, lambda logits, at: logits)[0]
        if self.cfg.training.pack_samples:
            packed = pack(sequences, attention_mask, num_actions,
                          one_row=self.cfg.model.attn_implementation == "flash_attention_2")
            # No KV cache: transformers reads packed position ids as sample boundaries only without one.
            logits = unpack_logits(self.engine(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                               logits_to_keep=packed.keep, use_cache=False).logits, packed)
        else:
            logits = self.engine(
                input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                logits_to_keep=num_actions + 1,
            ).logits[:, :-1]
        return logits.float() / (self.cfg.temperature or 1.0)

    def action_reads(self, sequences: Tensor, attention_mask: Tensor, num_actions: int, *reads: Read,
                     vision: dict[str, Tensor] | None = None) -> list[Tensor]:
        """Each read(logits [..., V], at) -> [..., ...] of the logits predicting the last num_actions tokens, as
        [B, T, ...]: `at` indexes a [B, T] tensor at the positions the logits are of (the whole [B, T] here;
        a rank's own positions under sequence parallelism, where no rank holds a whole row's logits)."""
        if self.sequence_parallel is None or vision is not None:
            logits = self.action_logits(sequences, attention_mask, num_actions, vision)
            return [read(logits, (slice(None), slice(None))) for read in reads]
        if self.cfg.training.pack_samples:
            packed = pack(sequences, attention_mask, num_actions,
                          one_row=self.cfg.model.attn_implementation == "flash_attention_2")
            rows = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                    "real": torch.ones_like(packed.input_ids, dtype=torch.bool)}
            wanted = (packed.row, packed.keep[packed.column])
        else:
            rows = {"input_ids": sequences, "position_ids": position_ids(attention_mask), "real": attention_mask}
            width = sequences.shape[1]
            columns = torch.arange(width - num_actions - 1, width - 1, device=sequences.device)
            wanted = (torch.arange(len(sequences), device=sequences.device)[:, None].expand(-1, num_actions),
                      columns.expand(len(sequences), -1))
        return self.sequence_parallel.action_reads(self.engine, rows, wanted, (len(sequences), num_actions),
                                                   self.cfg.temperature or 1.0, reads)

    def action_log_probs(self, sequences: Tensor, attention_mask: Tensor, num_actions: int,
                         vision: dict[str, Tensor] | None = None) -> Tensor:
        """log pi of each of the last num_actions tokens [B, T] (padding included: mask it)."""
        targets = sequences[:, -num_actions:]
        return self.action_reads(sequences, attention_mask, num_actions,
                                 lambda logits, at: token_log_probs(logits, targets[at]), vision=vision)[0]

    def token_values(self, sequences: Tensor, attention_mask: Tensor) -> Tensor:
        """A sequence classifier's score at every position [B, S] (split over the sequence-parallel ranks)."""
        if self.sequence_parallel is None:
            return self.engine(sequences, attention_mask)
        return self.sequence_parallel.token_values(self.engine, sequences, attention_mask,
                                                   position_ids(attention_mask))

    def action_values(self, sequences: Tensor, attention_mask: Tensor, num_actions: int) -> Tensor:
        """V(s_t) [B, T]: the value of the prefix before each response token."""
        return self.token_values(sequences, attention_mask)[:, :-1][:, -num_actions:]

    def response_scores(self, sequences: Tensor, attention_mask: Tensor, num_actions: int) -> Tensor:
        """The classifier's score at each response token [B, T] (a process reward model's, read where steps end)."""
        return self.token_values(sequences, attention_mask)[:, -num_actions:]

    def last_token_scores(self, sequences: Tensor, attention_mask: Tensor) -> Tensor:
        """The classifier's score at the last real token of each right-padded row [B]."""
        values = self.token_values(sequences, attention_mask)  # [B, S]
        last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).argmax(-1)
        return values.gather(1, last.unsqueeze(1)).squeeze(1)

    @contextmanager
    def base_weights(self) -> Iterator[None]:
        """The base model, its LoRA adapters switched off (the reference a LoRA actor shares)."""
        with self.peft.disable_adapter():
            yield

    @contextmanager
    def scoring(self) -> Iterator[None]:
        """The module in eval mode (dropout off) while it scores rollouts: the old and reference
        log-probs and the values are those of the deterministic model; then back in its mode."""
        mode = self.engine.module.training  # the engine's own flag does not follow its module's
        self.engine.eval()
        try:
            yield
        finally:
            self.engine.train(mode)

    def backward_step(self, loss: Tensor) -> None:
        """Accumulate the loss's gradients; DeepSpeed steps the optimizer at the accumulation boundary,
        and the global gradient norm before clipping joins grad_norms."""
        self.engine.backward(loss)
        boundary = self.engine.is_gradient_accumulation_boundary()  # before step() counts this micro-batch
        # ZeRO-1..3 and the bf16/fp16 optimizers keep the norm they clip with; plain ZeRO-0 in fp32 clips
        # with torch and drops it, so it is taken here, from the gradients all-reduced by backward().
        own_norm = boundary and not hasattr(self.engine.optimizer, "_global_grad_norm")
        if own_norm and self.engine.autotp_size() > 1:  # a split's shards make one gradient
            norm = grad_norm(self.engine.module.parameters())
        elif own_norm:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.engine.module.parameters() if p.grad is not None])
        self.engine.step()
        if boundary:
            self.grad_norms.append(float(norm if own_norm else self.engine.get_global_grad_norm()))

    def take_grad_norm(self) -> float | None:
        """The mean gradient norm of the optimizer steps since the last call (None: there was none)."""
        norms, self.grad_norms = self.grad_norms, []
        return sum(norms) / len(norms) if norms else None

    def micro_batch_divisor(self, step_total: float) -> float:
        """What a micro-batch divides its loss sum by for the optimizer step's gradient to be that of
        the whole step's sum over `step_total`: backward_step's engine.backward divides every loss by
        the gradient accumulation steps (scale_wrt_gas) and the data-parallel ranks average their
        gradients, so the divisor is step_total / (accumulation steps * ranks)."""
        return step_total / (self.engine.gradient_accumulation_steps() * self.data_parallel_size)

    @property
    def data_parallel_size(self) -> int:
        """The data-parallel degree: the ranks over the sequence-parallel size (DeepSpeed's own dp_world_size is
        None when it is given sequence-parallel groups)."""
        return self.engine.seq_dp_world_size // self.engine.sequence_parallel_size

    @property
    def learning_rate(self) -> float:
        return self.engine.get_lr()[0]


def load_model(cfg: ModelConfig, rank: int, world_size: int) -> Model:
    """The role's model from cfg.path inside a DeepSpeed engine (torch.distributed must be up)."""
    import deepspeed
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                              AutoModelForSequenceClassification, AutoTokenizer)
    from transformers.integrations import HfDeepSpeedConfig

    split = cfg.training.sequence_parallel.size
    ds_config = deepspeed_config(cfg, world_size // split)
    zero3 = ds_config["zero_optimization"]["stage"] == 3
    hf_ds_config = HfDeepSpeedConfig(ds_config) if zero3 else None
    trainable = cfg.role in TRAINED_ROLES
    lora = cfg.model.lora if trainable else None
    load = dict(dtype=getattr(torch, cfg.model.dtype), attn_implementation=cfg.model.attn_implementation,
                revision=cfg.model.revision, quantization_config=quantization_config(lora))
    config = AutoConfig.from_pretrained(cfg.path, revision=cfg.model.revision)
    if cfg.role in CAUSAL_LM_ROLES and is_vision_language(config):
        if cfg.role not in VISION_LANGUAGE_ROLES:
            raise ValueError(f"models.{cfg.role} is a vision-language model ({cfg.path}); the {cfg.role} loads as a "
                             "text model only: give it a text model's path")
        hf_model = AutoModelForImageTextToText.from_pretrained(cfg.path, **load)
    elif cfg.role in CAUSAL_LM_ROLES:
        hf_model = AutoModelForCausalLM.from_pretrained(cfg.path, **load)
    else:
        hf_model = AutoModelForSequenceClassification.from_pretrained(cfg.path, num_labels=1, **load)
        if cfg.step_separator is not None:  # exported with the model: what a reward source must split at
            setattr(hf_model.config, STEP_SEPARATOR_KEY, cfg.step_separator)
    tokenizer = AutoTokenizer.from_pretrained(cfg.path, revision=cfg.model.revision)
    sequence_parallel, mpu = initialize_sequence_parallel(split, cfg.model.attn_implementation) if split > 1 else (None, None)
    if sequence_parallel:
        if problem := split_problem(hf_model.config.to_dict(), split):  # a hub model's, unknown to checks.py
            raise ValueError(problem)
        hf_model.set_attn_implementation(sequence_parallel_attention)
    # Before LoRA, so that its modules are those of the language model (and the projector) only.
    frozen_tower = freeze_tower(hf_model) if trainable and cfg.training.freeze_vision_tower else set()
    peft = apply_lora(hf_model, lora, cfg.role) if lora else None  # in place: hf_model stays the module
    if not trainable:
        hf_model.requires_grad_(False)
    elif cfg.model.gradient_checkpointing:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = hf_model if cfg.role in CAUSAL_LM_ROLES else ValueModel(hf_model)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=mpu,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      lr_scheduler=partial(lr_scheduler, cfg) if trainable else None)
    engine.train(trainable)
    if engine.zero_optimization_stage() == 0 and engine.dp_world_size == 1:
        # Alone, a rank has nothing to all-reduce, yet at every accumulation boundary DeepSpeed's ZeRO-0 path
        # flattens all gradients into one copy to reduce and copies them back (0.5 GB for 135M parameters).
        engine.enable_backward_allreduce = False
    return Model(cfg, rank, engine, tokenizer, zero3, hf_ds_config, peft=peft, sequence_parallel=sequence_parallel,
                 frozen_tower=frozen_tower)
