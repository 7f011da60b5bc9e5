"""One rank of a model group: a Hugging Face model inside a DeepSpeed engine, run as a Ray actor.

Roles:
- actor: causal LM, trained with the PPO-clip loss; log-probs of response tokens.
- reference: frozen causal LM; log-probs for the KL penalty.
- critic: sequence classifier whose score head is read at every token (values), trained with the value loss.
- reward: frozen sequence classifier scoring whole texts (the reward of a `type: model` source).
- rm: the same sequence classifier, trained (the offline algorithm rm), exported in Hugging Face format.

The offline algorithms (sft, dpo, ...) train the actor (or rm) with `train_offline`, one
objective of OFFLINE_OBJECTIVES per micro-batch of offline_data.OfflineBatch.

Every rank of a ZeRO-3 group must run the same number of forward passes (each one gathers the
sharded parameters collectively); `ModelGroup` guarantees it by giving ranks equal shards.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec

from ..algorithms.kl import compute_kl, kl_in_loss
from ..experience import Experience
from ..losses import (
    PREFERENCE_LOSSES,
    PreferenceConfig,
    PreferenceInputs,
    entropy_bonus,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    pairwise_reward_loss,
    ppo_policy_loss,
    reward_accuracy,
    sft_loss,
    token_log_probs,
    value_loss,
)
from ..offline_data import OfflineBatch
from .distributed import free_port, init_distributed, node_address

CAUSAL_LM_ROLES = ("actor", "reference")
TRAINED_ROLES = ("actor", "critic", "rm")
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


def deepspeed_config(cfg: ModelConfig, world_size: int) -> dict:
    """DeepSpeed config of a role; frozen models keep ZeRO-3 sharding (or none) and get no optimizer."""
    training, trainable = cfg.training, cfg.role in TRAINED_ROLES
    stage = training.zero_stage if trainable else (3 if training.zero_stage == 3 else 0)
    zero: dict = {"stage": stage}
    if trainable and training.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.use_gpu}
    micro = training.micro_train_batch_size if trainable else training.micro_rollout_batch_size
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": training.train_batch_size if trainable else micro * world_size,
        "gradient_clipping": training.max_grad_norm,
        "zero_optimization": zero,
        # bf16 mixed precision keeps fp32 master weights in the optimizer; a float32 model trains in float32.
        "bf16": {"enabled": training.bf16 and cfg.model.dtype == "bfloat16"},
        "fp16": {"enabled": cfg.model.dtype == "float16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if trainable:
        lr = training.critic_learning_rate if cfg.role == "critic" else training.learning_rate
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": lr, "betas": [0.9, 0.95], "weight_decay": training.weight_decay,
            # DeepSpeed's default here is FusedAdam, a CUDA kernel (a long JIT build on CPU).
            "torch_adam": not cfg.use_gpu and not training.offload_optimizer,
        }}
    return config


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, so a left-padded prompt sees the positions vLLM used."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


# objective name (offline.py's families) -> ModelWorker method training one micro-batch with it
OFFLINE_OBJECTIVES = {"sft": "_sft_step", "preference": "_preference_step", "pairwise": "_pairwise_step"}


def _pair_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    """Implicit (dpo) or model (rm) rewards of chosen and rejected responses: accuracy and margin
    (unpaired kto batches: the margin of the means, no accuracy; a side a batch lacks counts 0)."""
    chosen_mean = chosen.float().mean().item() if chosen.numel() else 0.0
    rejected_mean = rejected.float().mean().item() if rejected.numel() else 0.0
    metrics = {"reward_margin": chosen_mean - rejected_mean, "chosen_reward": chosen_mean,
               "rejected_reward": rejected_mean}
    if chosen.shape == rejected.shape:
        metrics["reward_accuracy"] = reward_accuracy(chosen.float(), rejected.float()).item()
    return metrics


class ValueModel(nn.Module):
    """A sequence classifier read at every position: the value (critic) or reward of each prefix."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.classifier.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)
        ).last_hidden_state
        return self.classifier.score(hidden).squeeze(-1).float()  # [B, S]


class ModelWorker:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def master_address(self) -> tuple[str, int]:
        return node_address(), free_port()

    def setup(self, cfg: ModelConfig, master_addr: str, master_port: int) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
        from transformers.integrations import HfDeepSpeedConfig

        self.cfg = cfg
        # DeepSpeed calls a torch.distributed function torch deprecated, once per step.
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        torch.manual_seed(cfg.training.seed)
        init_distributed(self.rank, self.world_size, master_addr, master_port, use_gpu=cfg.use_gpu)
        ds_config = deepspeed_config(cfg, self.world_size)
        self.zero3 = ds_config["zero_optimization"]["stage"] == 3
        # Under ZeRO-3, from_pretrained must see the config to load straight into shards; it has to
        # stay alive as long as the model (transformers holds only a weak reference).
        self._hf_ds_config = HfDeepSpeedConfig(ds_config) if self.zero3 else None
        load = dict(dtype=getattr(torch, cfg.model.dtype), attn_implementation=cfg.model.attn_implementation,
                    revision=cfg.model.revision)
        if cfg.role in CAUSAL_LM_ROLES:
            model = AutoModelForCausalLM.from_pretrained(cfg.path, **load)
        else:
            model = ValueModel(AutoModelForSequenceClassification.from_pretrained(cfg.path, num_labels=1, **load))
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path, revision=cfg.model.revision)
        trainable = cfg.role in TRAINED_ROLES
        if not trainable:
            model.requires_grad_(False)
        elif cfg.model.gradient_checkpointing:
            hf_model = model if cfg.role in CAUSAL_LM_ROLES else model.classifier
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                               lr_scheduler=self._lr_scheduler if trainable else None)
        self.engine.train(trainable)

    def _lr_scheduler(self, optimizer):
        from transformers import get_scheduler

        training, steps = self.cfg.training, self.cfg.optimizer_steps
        cosine = training.lr_scheduler == "cosine_with_min_lr"
        return get_scheduler(
            SCHEDULERS[training.lr_scheduler], optimizer,
            num_warmup_steps=math.ceil(training.lr_warmup_ratio * steps), num_training_steps=steps,
            scheduler_specific_kwargs={"min_lr_rate": MIN_LR_RATE} if cosine else None,
        )

    # -- forward passes --------------------------------------------------------------------------

    def _action_logits(self, sequences: Tensor, attention_mask: Tensor, num_actions: int) -> Tensor:
        """Logits [B, T, V] predicting the last num_actions tokens, at the sampling temperature."""
        logits = self.engine(
            input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
            logits_to_keep=num_actions + 1,
        ).logits[:, :-1]
        return logits.float() / (self.cfg.temperature or 1.0)

    def _action_values(self, sequences: Tensor, attention_mask: Tensor, num_actions: int) -> Tensor:
        """V(s_t) [B, T]: the value of the prefix before each response token."""
        return self.engine(sequences, attention_mask)[:, :-1][:, -num_actions:]

    @torch.no_grad()
    def forward(self, sequences: Tensor, attention_mask: Tensor, num_actions: int) -> Tensor:
        """Log-probs (actor, reference) or values (critic) of the response tokens, [B, T]."""
        device = self.engine.device
        outputs = []
        for start in range(0, sequences.shape[0], self.cfg.training.micro_rollout_batch_size):
            rows = slice(start, start + self.cfg.training.micro_rollout_batch_size)
            seq, mask = sequences[rows].to(device), attention_mask[rows].to(device)
            if self.cfg.role == "critic":
                outputs.append(self._action_values(seq, mask, num_actions).cpu())
            else:
                logits = self._action_logits(seq, mask, num_actions)
                outputs.append(token_log_probs(logits, seq[:, -num_actions:]).cpu())
        return torch.cat(outputs)

    @torch.no_grad()
    def score(self, prompts: list[str], completions: list[str]) -> Tensor:
        """Reward model: one score per prompt + completion [B], read at the last token.

        The text is the one rewards.model.RewardModelScorer scores: ending with eos, as the
        sequences reward models learn on do, and truncated from the left to the model's context.
        """
        texts = [prompt + completion + self.tokenizer.eos_token for prompt, completion in zip(prompts, completions)]
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        micro = self.cfg.training.micro_rollout_batch_size
        scores = []
        for start in range(0, len(texts), micro):
            batch = self.tokenizer(
                texts[start:start + micro], return_tensors="pt", padding=True, truncation=True,
                max_length=self.engine.module.classifier.config.max_position_embeddings, add_special_tokens=False,
            ).to(self.engine.device)
            rewards = self.engine(batch.input_ids, batch.attention_mask)  # [b, S]
            last = batch.attention_mask.sum(-1) - 1
            scores.append(rewards.gather(1, last.unsqueeze(1)).squeeze(1).cpu())
        return torch.cat(scores)

    # -- training --------------------------------------------------------------------------------

    def train(self, micro_batches: list[Experience]) -> dict[str, float]:
        """One pass over this rank's micro-batches; DeepSpeed steps the optimizer every
        trainBatchSize / (microTrainBatchSize * ranks) of them."""
        step = self._policy_step if self.cfg.role == "actor" else self._value_step
        totals: dict[str, float] = {}
        for experience in micro_batches:
            for key, value in step(experience.to(self.engine.device)).items():
                totals[key] = totals.get(key, 0.0) + value
        metrics = {key: value / len(micro_batches) for key, value in totals.items()}
        metrics["learning_rate" if self.cfg.role == "actor" else "critic_learning_rate"] = self.engine.get_lr()[0]
        return metrics

    def _policy_step(self, exp: Experience) -> dict[str, float]:
        training = self.cfg.training
        logits = self._action_logits(exp.sequences, exp.attention_mask, exp.num_actions)
        log_probs = token_log_probs(logits, exp.sequences[:, -exp.num_actions:])
        policy = ppo_policy_loss(
            log_probs, exp.action_log_probs, exp.advantages, exp.action_mask,
            clip_eps_low=training.clip_eps, clip_eps_high=training.clip_eps_high or None,
            dual_clip=training.dual_clip, aggregation=training.loss_aggregation,
        )
        loss = policy.loss
        metrics = policy.metrics()  # loss, clip_fraction, dual_clip_fraction, approx_kl
        metrics["policy_loss"] = metrics.pop("loss")
        if training.kl.placement == "loss" and exp.base_action_log_probs is not None:
            kl = compute_kl(log_probs, exp.base_action_log_probs, exp.action_mask, training.kl.estimator)
            loss = loss + kl_in_loss(kl, training.kl.coef, exp.action_mask, training.loss_aggregation)
        entropy = entropy_from_logits(logits if training.entropy_coef else logits.detach())
        if training.entropy_coef:
            loss = loss + entropy_bonus(entropy, exp.action_mask, training.entropy_coef, training.loss_aggregation)
        metrics["entropy"] = float(masked_mean(entropy.detach(), exp.action_mask))
        self.engine.backward(loss)
        self.engine.step()
        return metrics

    def _value_step(self, exp: Experience) -> dict[str, float]:
        values = self._action_values(exp.sequences, exp.attention_mask, exp.num_actions)
        result = value_loss(values, exp.values, exp.returns, exp.action_mask,
                            clip_eps=self.cfg.training.value_clip, aggregation=self.cfg.training.loss_aggregation)
        self.engine.backward(result.loss)
        self.engine.step()
        metrics = result.metrics()
        return {"value_loss": metrics["loss"], "value_clip_fraction": metrics["clip_fraction"]}

    # -- offline training (sft, dpo, ipo, cdpo, rm) ----------------------------------------------

    def train_offline(self, micro_batches: list[OfflineBatch], objective: str, options: dict) -> dict[str, float]:
        """One optimizer step's share of micro-batches on this rank, each trained with
        OFFLINE_OBJECTIVES[objective] (DeepSpeed steps the optimizer at the accumulation boundary)."""
        step = getattr(self, OFFLINE_OBJECTIVES[objective])
        totals: dict[str, float] = {}
        for batch in micro_batches:
            for key, value in step(batch.to(self.engine.device), **options).items():
                totals[key] = totals.get(key, 0.0) + value
        metrics = {key: value / len(micro_batches) for key, value in totals.items()}
        metrics["learning_rate"] = self.engine.get_lr()[0]
        return metrics

    def _response_log_probs(self, batch: OfflineBatch) -> Tensor:
        """log pi of each response token [R, T] (padding included: mask with action_mask)."""
        logits = self._action_logits(batch.sequences, batch.attention_mask, batch.num_actions)
        return token_log_probs(logits, batch.sequences[:, -batch.num_actions:])

    def _sft_step(self, batch: OfflineBatch) -> dict[str, float]:
        """Token NLL of the responses only (the prompt is context, not a target)."""
        loss = sft_loss(self._response_log_probs(batch), batch.action_mask, self.cfg.training.loss_aggregation)
        self.engine.backward(loss)
        self.engine.step()
        return {"loss": loss.item()}

    def _preference_step(self, batch: OfflineBatch, loss: str, config: PreferenceConfig) -> dict[str, float]:
        """PREFERENCE_LOSSES[loss] on summed response log-probs of the desirable (chosen) and the
        other rows (pairs keep their order on both sides); kto also reads the batch's kl_logps."""
        logps = masked_sum(self._response_log_probs(batch), batch.action_mask, dim=-1)
        good, reference = batch.desirable, batch.reference_logps
        kl = (batch.kl_logps[0:1], batch.kl_logps[1:2]) if batch.kl_logps is not None else (None, None)
        inputs = PreferenceInputs(logps[good], logps[~good], reference[good], reference[~good], *kl)
        result = PREFERENCE_LOSSES[loss](inputs, config)
        total = result.losses.mean()
        self.engine.backward(total)
        self.engine.step()
        metrics = {"loss": total.item(), **_pair_metrics(result.chosen_rewards, result.rejected_rewards)}
        if result.kl is not None:
            metrics["kto_reference_point"] = result.kl.item()
        return metrics

    def _pairwise_step(self, batch: OfflineBatch) -> dict[str, float]:
        """Bradley-Terry loss on the reward model's scores, read at each sequence's last token."""
        scores = self._last_token_scores(batch.sequences, batch.attention_mask)
        chosen, rejected = scores.chunk(2)
        loss = pairwise_reward_loss(chosen, rejected)
        self.engine.backward(loss)
        self.engine.step()
        return {"loss": loss.item(), **_pair_metrics(chosen.detach(), rejected.detach())}

    def _last_token_scores(self, sequences: Tensor, attention_mask: Tensor) -> Tensor:
        """The classifier's score at the last real token of each right-padded row [B]."""
        values = self.engine(sequences, attention_mask)  # [B, S]
        last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).argmax(-1)
        return values.gather(1, last.unsqueeze(1)).squeeze(1)

    # -- weights out -----------------------------------------------------------------------------

    def named_full_parameters(self, dtype: torch.dtype | None = None):
        """(name, full tensor) per parameter, gathered from the ZeRO-3 shards; every rank must iterate."""
        import deepspeed

        for name, param in self.engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], enabled=self.zero3):
                yield name, param.data.to(dtype or param.dtype)

    def state_dict(self, dtype: str | None = None) -> dict[str, Tensor] | None:
        """The full weights on rank 0 (CPU tensors in Hugging Face names); None on the other ranks."""
        weights = {}
        for name, tensor in self.named_full_parameters(getattr(torch, dtype) if dtype else None):
            if self.rank == 0:
                weights[name] = tensor.detach().to("cpu", copy=True)
        return weights if self.rank == 0 else None

    def checksums(self) -> dict[str, float]:
        """Sum of each full parameter as this rank sees it after the gather: equal on every rank of a healthy group."""
        return {name: tensor.double().sum().item() for name, tensor in self.named_full_parameters()}

    def save_pretrained(self, directory: str) -> None:
        """Export in Hugging Face format (rank 0 writes; every rank takes part in the gather)."""
        weights = self.state_dict()
        if self.rank == 0:
            module = self.engine.module
            if isinstance(module, ValueModel):  # a sequence classifier under its own names
                module = module.classifier
                weights = {name.removeprefix("classifier."): tensor for name, tensor in weights.items()}
            module.save_pretrained(directory, state_dict=weights)
            self.tokenizer.save_pretrained(directory)

    def broadcast_weights(self, engines: list, dtype: str) -> None:
        """GPU weight sync, sender side (see weight_sync.py)."""
        from .weight_sync import broadcast_parameters

        broadcast_parameters(self, engines, getattr(torch, dtype))

    def init_weight_sync(self, master_addr: str, master_port: int, world_size: int) -> None:
        from .weight_sync import init_sender

        self.sync_group = init_sender(master_addr, master_port, world_size)

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, tag: str) -> None:
        self.engine.save_checkpoint(directory, tag=tag, save_latest=False)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(directory, tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")
