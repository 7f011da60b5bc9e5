"""The PPO-family loop: ppo, grpo, dr-grpo, reinforce++, reinforce++-baseline and rloo.

Each step, as in OpenRLHF's PPO trainer:

1. rollout: the vLLM engines sample rollout.samplesPerPrompt completions for each of
   training.rolloutBatchSize prompts, with the log-prob of every sampled token;
2. rewards: every spec.reward source scores the completions (a `type: model` source through the
   reward-model group);
3. the actor's log-probs of the completions, the reference's (when training.kl.coef > 0) and the
   critic's values (ppo);
4. the per-token KL (training.kl.estimator), subtracted from the reward or added to the loss
   (training.kl.placement);
5. advantages from the estimator the catalogue names for spec.algorithm (rlhf_api.algorithms);
6. training.epochs shuffled passes of PPO-clip updates over micro-batches, for the actor and (ppo)
   the critic, at the same time;
7. the actor's new weights to every vLLM engine;
8. metrics to the reporters, and a checkpoint every checkpoint.intervalSteps.

With training.asyncQueueSize N > 0 the next N rollouts are generated while a step trains, by
engines that are up to N updates behind (a Ray actor runs its calls in order, so each weight
update lands after the rollouts queued before it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import ray
import torch
from ray.util.placement_group import remove_placement_group

from rlhf_api.algorithms import ALGORITHMS
from rlhf_api.v1alpha1 import RLHFJob

from . import checkpoint
from .algorithms import AdvantageConfig, AdvantageInputs, compute_advantages, compute_kl, kl_in_reward
from .data import PromptDataset, PromptItem, PromptLoader
from .experience import Experience
from .losses import masked_mean
from .paths import model_path
from .reporting import Reporter
from .rewards import build_reward
from .workers.group import (
    ROLLOUT,
    ModelGroup,
    Placement,
    create_placement_group,
    create_rollout_engines,
    mean_metrics,
)
from .workers.model_worker import ModelConfig
from .workers.rollout import Completion
from .workers.weight_sync import setup_broadcast_group, sync_weights

log = logging.getLogger(__name__)


@dataclass
class PendingRollout:
    """Prompts sent to the engines and the generations on their way back."""

    prompts: list[PromptItem]
    generations: list[ray.ObjectRef]  # per engine: (completions per prompt, seconds)
    data_position: dict  # the prompt loader's state once this batch is trained: resumes with the next


class Trainer:
    def __init__(self, job: RLHFJob, placement: Placement, *, base_dir: Path, output_dir: Path, reporter: Reporter):
        from transformers import AutoTokenizer

        self.job, self.spec, self.placement = job, job.spec, placement
        self.training, self.rollout = job.spec.training, job.spec.rollout
        self.base_dir, self.reporter = Path(base_dir), reporter
        self.checkpoint_dir = Path(output_dir) / self.spec.checkpoint.path  # an absolute path stays as it is
        self.actor_path = model_path(self.spec.models, "actor", self.base_dir)

        self.tokenizer = AutoTokenizer.from_pretrained(self.actor_path, revision=self.spec.models.actor.revision)
        dataset = PromptDataset.from_spec(self.spec.data.prompts, self.spec.data, self.tokenizer,
                                          base_dir=self.base_dir, seed=self.training.seed)
        self.prompts = PromptLoader(dataset, self.training.rollout_batch_size, seed=self.training.seed,
                                    shuffle=self.spec.data.prompts.shuffle)
        self.total_steps = self.training.episodes * len(self.prompts)
        if self.training.max_steps:
            self.total_steps = min(self.total_steps, self.training.max_steps)
        samples = self.training.rollout_batch_size * self.rollout.samples_per_prompt
        self.optimizer_steps = self.total_steps * self.training.epochs * samples // self.training.train_batch_size

        self.step = 0
        self.groups: dict[str, ModelGroup] = {}
        self.engines: list = []
        self.placement_group = create_placement_group(placement)
        try:
            self._start_workers()
        except BaseException:
            self.close()
            raise

    def _start_workers(self) -> None:
        placement, group = self.placement, self.placement_group
        self.groups = {role: ModelGroup(role, group, placement) for role in placement.ranks if role != ROLLOUT}
        setups = [ref for role, g in self.groups.items() for ref in g.setup(self._model_config(role))]
        self.engines = create_rollout_engines(  # they start while the model groups load
            group, placement, self.actor_path, rollout=self.rollout, dtype=self.spec.models.actor.dtype,
            max_model_len=self.spec.data.max_prompt_tokens + self.rollout.max_new_tokens,
            seed=self.training.seed, revision=self.spec.models.actor.revision,
            sleep_mode=placement.use_gpu and self.training.colocation == "all",
        )
        reward_model = self.groups.get("reward")
        self.reward = build_reward(self.spec.reward, base_dir=self.base_dir,
                                   model_scorer=reward_model.score if reward_model else None)
        ray.get(setups)
        if placement.use_gpu:
            setup_broadcast_group(self.actor, self.engines, self.rollout.tensor_parallel_size)

    def close(self) -> None:
        """Stop this run's Ray actors and free its placement group (the Ray instance may live on)."""
        for handle in [w for g in self.groups.values() for w in g.workers] + self.engines:
            ray.kill(handle)
        remove_placement_group(self.placement_group)

    def _model_config(self, role: str) -> ModelConfig:
        _, model = self.spec.models.source(role)
        return ModelConfig(
            role=role, path=model_path(self.spec.models, role, self.base_dir), model=model, training=self.training,
            temperature=self.rollout.temperature, optimizer_steps=max(self.optimizer_steps, 1),
            use_gpu=self.placement.use_gpu,
        )

    @property
    def actor(self) -> ModelGroup:
        return self.groups["actor"]

    @property
    def trained_groups(self) -> dict[str, ModelGroup]:
        return {role: g for role, g in self.groups.items() if role in ("actor", "critic")}

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> None:
        self._resume()
        batches = self._batches()
        queue: deque[PendingRollout] = deque()
        while self.step < self.total_steps:
            while len(queue) <= self.training.async_queue_size and (batch := next(batches, None)):
                queue.append(self._start_rollout(*batch))
            started = time.perf_counter()
            current = queue.popleft()
            generations = ray.get(current.generations)
            self._vllm_sleep(True)
            experience, metrics = self._make_experience(current.prompts, generations)
            metrics["rollout_seconds"] = time.perf_counter() - started
            position = current.data_position
            metrics["epoch"] = position["epoch"] + position["position"] / len(self.prompts)  # prompts seen, in epochs

            started = time.perf_counter()
            metrics.update(self._train(experience))
            self._vllm_sleep(False)
            sync_weights(self.actor, self.engines, dtype=self.spec.models.actor.dtype, use_gpu=self.placement.use_gpu)
            metrics["update_seconds"] = time.perf_counter() - started

            self.step += 1
            self.reporter.log(self.step, metrics)
            interval = self.spec.checkpoint.interval_steps
            if (interval and self.step % interval == 0) or self.step == self.total_steps:
                self._save(current.data_position)
        if self.spec.checkpoint.export_hf:
            ray.get(self.actor.call("save_pretrained", str(self.checkpoint_dir / "final")))

    def _batches(self) -> Iterator[tuple[list[PromptItem], dict]]:
        """Prompt batches with the loader position after each, up to the run's last step."""
        drawn = self.step
        while self.prompts.epoch < self.training.episodes:
            for batch in self.prompts:
                if drawn == self.total_steps:
                    return
                drawn += 1
                yield batch, self.prompts.state_dict()

    # -- 1. rollout ------------------------------------------------------------------------------

    def _start_rollout(self, prompts: list[PromptItem], data_position: dict) -> PendingRollout:
        sampling = dict(n=self.rollout.samples_per_prompt, max_tokens=self.rollout.max_new_tokens,
                        temperature=self.rollout.temperature, top_p=self.rollout.top_p, top_k=self.rollout.top_k)
        per_engine = -(-len(prompts) // len(self.engines))
        generations = [
            engine.generate.remote([p.prompt_token_ids for p in prompts[i * per_engine:(i + 1) * per_engine]], sampling)
            for i, engine in enumerate(self.engines)
        ]
        return PendingRollout(prompts, generations, data_position)

    def _vllm_sleep(self, asleep: bool) -> None:
        """Hybrid engine (colocation all) on GPUs: vLLM frees its GPU memory while the models score
        and train, and takes it back before the weight sync. UNTESTED (no GPUs here); on CPU
        vLLM's sleep does nothing, and nothing is called."""
        if self.placement.use_gpu and self.training.colocation == "all":
            ray.get([(engine.sleep if asleep else engine.wake_up).remote() for engine in self.engines])

    # -- 2-5. experience -------------------------------------------------------------------------

    def _make_experience(self, batch: list[PromptItem], generations: list) -> tuple[Experience, dict[str, float]]:
        """The scored, advantage-carrying Experience of one rollout, and its metrics."""
        completions = [samples for per_prompt, _ in generations for samples in per_prompt]
        generation_seconds = max(seconds for _, seconds in generations)
        n = self.rollout.samples_per_prompt
        prompts = [item for item in batch for _ in range(n)]  # prompt-major, as grouped estimators read
        samples = [c for per_prompt in completions for c in per_prompt]
        sequences, attention_mask, action_mask = self._pack(prompts, samples)
        num_actions = action_mask.shape[1]

        # 2. rewards
        texts = self.tokenizer.batch_decode([c.token_ids for c in samples], skip_special_tokens=True)
        reward = self.reward.score([p.prompt for p in prompts], texts, [p.label for p in prompts])

        # 3. log-probs and values, each group working on the whole batch at once
        action_log_probs = self.actor.forward(sequences, attention_mask, num_actions)
        base_log_probs = values = None
        if "reference" in self.groups:
            base_log_probs = self.groups["reference"].forward(sequences, attention_mask, num_actions)
        if "critic" in self.groups:
            values = self.groups["critic"].forward(sequences, attention_mask, num_actions) * action_mask

        # 4. KL
        kl_spec = self.training.kl
        kl = kl_penalty = None
        if base_log_probs is not None:
            kl = compute_kl(action_log_probs, base_log_probs, action_mask, kl_spec.estimator)
            if kl_spec.placement == "reward":
                kl_penalty = kl_in_reward(kl, kl_spec.coef, action_mask)

        # 5. advantages
        advantages, returns = compute_advantages(
            ALGORITHMS[self.spec.algorithm].advantage,
            AdvantageInputs(reward.total, action_mask, kl_penalty=kl_penalty, values=values, n_samples_per_prompt=n),
            AdvantageConfig(gamma=self.training.gamma, lambd=self.training.gae_lambda),
        )
        response_length = action_mask.sum(-1)
        experience = Experience(
            sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
            action_log_probs=action_log_probs, base_action_log_probs=base_log_probs, values=values, kl=kl,
            advantages=advantages, returns=returns, rewards=reward.total, response_length=response_length,
            group_ids=torch.arange(len(batch)).repeat_interleave(n),
        )

        rollout_log_probs = self._pad([c.log_probs for c in samples], num_actions, 0.0, torch.float32)
        metrics = {
            "reward_mean": reward.total.mean().item(),
            "reward_std": reward.total.std().item() if len(samples) > 1 else 0.0,
            **{f"reward/{name}": scores.mean().item() for name, scores in reward.by_source.items()},
            "response_length": response_length.float().mean().item(),
            "truncated_fraction": sum(c.truncated for c in samples) / len(samples),
            "tokens_per_second": response_length.sum().item() / generation_seconds,
            # vLLM's and the actor's log-probs of the same tokens: numerical noise while the weight
            # sync works, growing with every update the engines miss when it does not.
            "logprob_diff": masked_mean((rollout_log_probs - action_log_probs).abs(), action_mask).item(),
            "advantage_mean": masked_mean(advantages, action_mask).item(),
        }
        if kl is not None:
            metrics["kl"] = masked_mean(kl, action_mask).item()
        return experience, metrics

    def _pack(self, prompts: list[PromptItem], samples: list[Completion]):
        """sequences [B, P + T]: prompts left-padded to P, responses right-padded to T; their masks."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        width = max(len(p.prompt_token_ids) for p in prompts)
        num_actions = max(1, max(len(c.token_ids) for c in samples))
        prompt_ids = torch.stack([
            torch.nn.functional.pad(torch.tensor(p.prompt_token_ids), (width - len(p.prompt_token_ids), 0), value=pad)
            for p in prompts
        ])
        prompt_mask = torch.stack([torch.arange(width) >= width - len(p.prompt_token_ids) for p in prompts])
        response_ids = self._pad([c.token_ids for c in samples], num_actions, pad, torch.long)
        action_mask = self._pad([[True] * len(c.token_ids) for c in samples], num_actions, False, torch.bool)
        sequences = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, action_mask], dim=1).long()
        return sequences, attention_mask, action_mask

    @staticmethod
    def _pad(rows: list[list], width: int, value, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([list(row) + [value] * (width - len(row)) for row in rows], dtype=dtype)

    # -- 6. update -------------------------------------------------------------------------------

    def _train(self, experience: Experience) -> dict[str, float]:
        # The same shuffles after a resume: the order depends only on the seed and the step.
        generator = torch.Generator().manual_seed(self.training.seed * 100_003 + self.step)
        options = dict(train_batch_size=self.training.train_batch_size,
                       micro_batch_size=self.training.micro_train_batch_size, epochs=self.training.epochs)
        pending = {role: g.train(experience, generator=generator, **options) for role, g in self.trained_groups.items()}
        return {key: value for refs in pending.values() for key, value in mean_metrics(refs).items()}

    # -- 8. checkpoints --------------------------------------------------------------------------

    def _save(self, data_position: dict) -> None:
        path = checkpoint.save(self.checkpoint_dir, self.step, self.trained_groups, {"prompts": data_position},
                               keep=self.spec.checkpoint.keep)
        self.reporter.checkpoint(self.step, str(path))

    def _resume(self) -> None:
        path = checkpoint.latest(self.checkpoint_dir) if self.spec.checkpoint.resume else None
        if path is None:
            return
        state = checkpoint.load(path, self.trained_groups)
        self.step = state["step"]
        self.prompts.load_state_dict(state["prompts"])
        sync_weights(self.actor, self.engines, dtype=self.spec.models.actor.dtype, use_gpu=self.placement.use_gpu)
        log.info("resumed from %s at step %d", path, self.step)
