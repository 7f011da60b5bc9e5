"""The online RL loop: every algorithm of the catalogue (rlhf_api.algorithms) that trains on prompts.

Each step, as in OpenRLHF's PPO trainer:

1. rollout (`_start_rollout`): the vLLM engines sample rollout.samplesPerPrompt completions for each of
   training.rolloutBatchSize prompts, with the log-prob of every sampled token;
2. rewards (`_score_rewards`): every spec.reward source scores the completions (a `type: model` source through the
   reward-model group);
3. the actor's log-probs of the completions (unless the update's forward gives them:
   `actor_scored_in_update`), the reference's (when training.kl.coef > 0, and for online-dpo), the
   teacher's (distill; with training.distillation.jsdBeta its top-k distributions instead) and the critic's
   values (ppo) (`_log_probs_and_values`);
4. the per-token KL (training.kl.estimator), subtracted from the reward or added to the loss
   (training.kl.placement) (`_kl`);
5. advantages from the estimator the catalogue names for spec.algorithm (rlhf_api.algorithms)
   (`_advantages`); steps 2-5 make up `_make_experience`;
6. training.epochs shuffled passes over micro-batches, for the actor (the policy loss the catalogue
   names) and (ppo) the critic, at the same time (`_train`; the steps are workers/objectives.py's; each micro-batch
   carries its optimizer step's token count, which token-mean divides by);
7. the actor's new weights to every vLLM engine (`_sync_weights`), and with training.referenceRefresh every
   intervalSteps the reference moved to the policy (`_refresh_reference`);
8. metrics to the reporters, and a checkpoint every checkpoint.intervalSteps (loop.RunLoop, the
   loop this trainer shares with the offline one).

With spec.environment each sample is a multi-turn episode (environments.runner: the policy's turns and
the environment's observations, the latter masked out of the loss by action_mask). Before step 3,
rollout.lengthShaping penalises long completions and rollout.dynamicSampling drops groups whose
rewards are all equal, sampling fresh prompts until the batch is full (sampling.py, DAPO).
spec.evaluation samples held-out sets after the steps it names and keeps the best actor (evaluation.py).

With training.asyncQueueSize N > 0 the next N rollouts are generated while a step trains, by
engines that are up to N updates behind (a Ray actor runs its calls in order, so each weight
update lands after the rollouts queued before it; the episode runner's too, whose turns reach the
engines one by one: the sync waits for it first).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import ray
import torch
from torch import Tensor

from rlhf_api.algorithms import ALGORITHMS, NEEDS_REWARD, TAKES_IMAGES, prose
from rlhf_api.planning.placement import Placement
from rlhf_api.v1alpha1 import RLHFJob, RLHFJobSpec

from . import checkpoint, learning_signal
from .algorithms import (
    READS_ACTOR_LOG_PROBS,
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    compute_kl,
    kl_in_reward,
)
from .data import PromptDataset, PromptItem, PromptLoader
from .environments import environment_factory
from .environments.runner import start_runner
from .evaluation import PREFIX as EVAL, Evaluation
from .experience import Experience
from .losses import masked_mean
from .loop import RunLoop
from .rewards import RewardResult, build_reward
from .sampling import Rollout, fill_batch, informative_groups, shape_rewards, staleness
from .workers.group import ModelGroup, create_rollout_engines, mean_metrics
from .workers.rollout import Completion
from .workers.vision import batch_inputs
from .workers.weight_sync import setup_weight_sync, sync_weights


@dataclass
class PendingRollout:
    """Prompts sent to the engines and the generations on their way back."""

    prompts: list[PromptItem]
    generations: list[ray.ObjectRef]  # per engine (or the episode runner): (completions per prompt, seconds)
    data_position: dict  # the prompt loader's state once this batch is trained: resumes with the next
    samples_per_prompt: int


@dataclass(frozen=True)
class Scored:
    """Step 3's scores of a rollout's response tokens, each [B, T] (None: the job has no such group)."""

    actor: Tensor | None  # log pi_actor, the policy that trains (None: trainer.actor_scored_in_update)
    reference: Tensor | None  # log pi_ref (a KL penalty, online-dpo)
    teacher: Tensor | None  # log pi_teacher (distill)
    values: Tensor | None  # the critic's V(s_t) (ppo)
    # the teacher's top-k log-probs and ids [B, T, k] each (distill with training.distillation.jsdBeta)
    teacher_top: tuple[Tensor, Tensor] | None = None

    def log_ratio(self, other: Tensor | None) -> Tensor | None:
        """log pi_actor - log pi_other, or None without either."""
        return None if other is None or self.actor is None else self.actor - other


def actor_scored_in_update(spec: RLHFJobSpec) -> bool:
    """One optimizer step per rollout, and nothing before the update reads the actor's log-probs (a KL
    penalty in the reward, an estimator's log-ratio): the update's forward runs on the very weights
    step 3 would score with, so step 3 leaves the actor out and the update reads its own (as TRL's
    GRPO does), one forward pass over the batch fewer per step."""
    training = spec.training
    return (training.epochs == 1
            and training.train_batch_size == training.rollout_batch_size * spec.rollout.samples_per_prompt
            and (ALGORITHMS[spec.algorithm].advantage not in READS_ACTOR_LOG_PROBS or teacher_in_loss(spec))
            and not (training.kl.coef > 0 and training.kl.placement == "reward"))


def teacher_in_loss(spec: RLHFJobSpec) -> bool:
    """distill with training.distillation.jsdBeta: the teacher's top-k distributions join the actor's loss
    (GKD's divergence), in place of its sampled tokens' log-probs in the reward."""
    return "teacher" in ALGORITHMS[spec.algorithm].roles and spec.training.distillation.jsd_beta is not None


def in_turns(placement: Placement, roles: list[str], start: Callable[[str], Any], wait: Callable[[Any], Any]) -> dict:
    """{role: wait(start(role))}: every role started before any is waited for, or, when the roles share
    bundles (one model's activations and gradients at a time on a GPU), each after the last ended."""
    if placement.colocated(*roles):
        return {role: wait(start(role)) for role in roles}
    started = {role: start(role) for role in roles}
    return {role: wait(handle) for role, handle in started.items()}


class Trainer(RunLoop):
    data_key = "prompts"

    def __init__(self, job: RLHFJob, placement: Placement, **options):
        """options: base_dir, output_dir and reporter (see RunLoop)."""
        super().__init__(job, placement, **options)
        self.rollout = self.spec.rollout
        dataset = PromptDataset.from_spec(self.spec.data.prompts, self.spec.data, self.tokenizer,
                                          base_dir=self.base_dir, seed=self.training.seed)
        if (with_images := sum(bool(item.images) for item in dataset.items)) and not ALGORITHMS[self.spec.algorithm].images:
            raise ValueError(f"data.prompts: {with_images} prompts have images (image parts in their messages), and "
                             f"{self.spec.algorithm} does not take images: use one of {prose(TAKES_IMAGES)}")
        self._use_data(PromptLoader(dataset, self.training.rollout_batch_size, seed=self.training.seed,
                                    shuffle=self.spec.data.prompts.shuffle), passes=self.training.episodes)
        samples = self.training.rollout_batch_size * self.rollout.samples_per_prompt
        self.optimizer_steps = self.total_steps * self.training.epochs * samples // self.training.train_batch_size
        self.actor_scored_in_update = actor_scored_in_update(self.spec)
        self.teacher_top_k = self.training.distillation.top_k if teacher_in_loss(self.spec) else None
        self.engines: list = []
        self.runner = None  # the multi-turn episode runner (spec.environment)
        self.evaluation = self.spec.evaluation and Evaluation(
            self.spec.evaluation, self.spec.data, self.tokenizer, base_dir=self.base_dir, seed=self.training.seed)
        self.best = checkpoint.best_record(self.checkpoint_dir) if self.spec.checkpoint.resume else None
        self.signal = learning_signal.Streak()
        self._start()

    def _start_workers(self) -> None:
        placement = self.placement
        # The engines first: vLLM takes the longest to start, and the model groups load meanwhile
        # unless they share bundles with it.
        self.engines = create_rollout_engines(
            self.placement_group, placement, self.actor_path, rollout=self.rollout, dtype=self.spec.engine_dtype,
            max_model_len=self.spec.data.max_prompt_tokens + self.rollout.max_new_tokens,
            seed=self.training.seed, revision=self.spec.models.actor.revision,
            sleep_mode=placement.use_gpu and placement.engines_colocated,
            memory_utilization=self.spec.engine_memory_utilization,
            sequences=-(-self.training.rollout_batch_size // self.rollout.engines) * self.rollout.samples_per_prompt,
        )
        if placement.engines_colocated:
            # vLLM counts the memory it finds free at start as its own: the models load once it is up
            # (asleep on GPUs, its weights in host memory, until the first rollout).
            ray.get([engine.ready.remote() for engine in self.engines])
            self._engines_sleep(level=1)
        setups = self._start_groups(temperature=self.rollout.temperature, optimizer_steps=max(self.optimizer_steps, 1),
                                    max_new_tokens=self.rollout.max_new_tokens)
        reward_model = self.groups.get("reward")
        self.reward = self.spec.reward and build_reward(self.spec.reward, base_dir=self.base_dir,
                                                        model_scorer=reward_model.score if reward_model else None)
        if self.spec.environment:
            environment_factory(self.spec.environment, self.base_dir)  # a broken entrypoint fails here, plainly
            self.runner = start_runner(self.spec.environment, self.base_dir, self.actor_path, self.engines,
                                       self.rollout.max_new_tokens, revision=self.spec.models.actor.revision)
        ray.get(setups)
        self._release_and_wake(None)  # the blocks the load left cached, back before vLLM takes its share
        self.weight_sync = setup_weight_sync(self.actor, self.engines, placement,
                                             bucket_bytes=self.rollout.weight_sync_bucket_mib << 20)

    def _actors(self) -> list:
        return super()._actors() + self.engines + ([self.runner] if self.runner else [])

    @property
    def actor(self) -> ModelGroup:
        return self.groups["actor"]

    # -- the loop --------------------------------------------------------------------------------

    def _before_steps(self) -> None:
        if self.step == 0 and self.evaluation and self.evaluation.due(0, self.total_steps):
            self._log_evaluation(0)  # the baseline

    def _steps(self, batches: Iterator[tuple[list[PromptItem], dict]]) -> Iterator[tuple[dict[str, float], dict]]:
        queue: deque[PendingRollout] = deque()
        for step in range(self.step + 1, self.total_steps + 1):
            while len(queue) <= self.training.async_queue_size and (batch := next(batches, None)):
                queue.append(self._start_rollout(*batch))
            if not queue:
                # Dynamic sampling's extra rounds used up the data passes: the step before was the last,
                # and gets the evaluation (and best-checkpoint check) due after the last one.
                if self.evaluation and not self.evaluation.due(self.step, self.total_steps):
                    self._log_evaluation(self.step)
                return
            started = time.perf_counter()
            current = queue.popleft()
            rollout, metrics = self._collect(current, batches)
            self._engines_sleep(level=2)  # the weights too: the sync after training replaces them
            with self.timer.phase("experience"):
                experience, rollout_metrics = self._make_experience(rollout)
            metrics.update(rollout_metrics | staleness(rollout.samples, policy=step - 1))
            if self.spec.algorithm in NEEDS_REWARD:  # distill learns from its teacher, whatever the rewards
                metrics[learning_signal.METRIC] = self.signal.observe(rollout.reward.total, current.samples_per_prompt)
            metrics["rollout_seconds"] = time.perf_counter() - started
            metrics["epoch"] = self._epoch(current.data_position)  # prompts seen, in epochs

            started = time.perf_counter()
            with self.timer.phase("update"):
                metrics.update(self._train(experience))
            with self.timer.phase("weight_sync"):
                self._wake_and_sync(step)
            refresh = self.training.reference_refresh.interval_steps
            if refresh and step % refresh == 0:
                with self.timer.phase("reference_refresh"):
                    self._refresh_reference()
            metrics["update_seconds"] = time.perf_counter() - started
            if self.evaluation and self.evaluation.due(step, self.total_steps):
                with self.timer.phase("evaluation", split=False):
                    metrics.update(self._evaluate(step))
            yield metrics, current.data_position

    # -- 1. rollout ------------------------------------------------------------------------------

    def _start_rollout(self, prompts: list[PromptItem], data_position: dict, sampling: dict | None = None) -> PendingRollout:
        """Send the prompts to the engines (or episodes to the runner); `sampling` defaults to the rollout's."""
        sampling = sampling or dict(
            n=self.rollout.samples_per_prompt, max_tokens=self.rollout.max_new_tokens,
            temperature=self.rollout.temperature, top_p=self.rollout.top_p, top_k=self.rollout.top_k)
        if self.runner:
            return PendingRollout(prompts, [self.runner.run.remote(prompts, sampling)], data_position, sampling["n"])
        per_engine = -(-len(prompts) // len(self.engines))
        generations = [
            engine.generate.remote([p.prompt_token_ids for p in share], sampling,
                                   [p.images for p in share] if any(p.images for p in share) else None)
            for i, engine in enumerate(self.engines) if (share := prompts[i * per_engine:(i + 1) * per_engine])
        ]
        return PendingRollout(prompts, generations, data_position, sampling["n"])

    def _scored(self, pending: PendingRollout) -> Rollout:
        """The finished rollout's samples with their rewards (step 2)."""
        with self.timer.phase("generation"):  # what is left of it: the engines may have run ahead (asyncQueueSize)
            generations = ray.get(pending.generations)
        prompts = [item for item in pending.prompts for _ in range(pending.samples_per_prompt)]  # prompt-major
        samples = [c for per_engine, _ in generations for per_prompt in per_engine for c in per_prompt]
        with self.timer.phase("rewards"):
            reward = self._score_rewards(prompts, samples)
        return Rollout(prompts, samples, reward, max(seconds for _, seconds in generations))

    def _collect(self, pending: PendingRollout, batches: Iterator) -> tuple[Rollout, dict[str, float]]:
        """The scored rollout; with dynamic sampling, its informative groups topped up from extra rollouts
        of fresh prompts (rollout.dynamicSampling.maxExtraRounds at most), then with dropped groups."""
        rollout, spec = self._scored(pending), self.rollout.dynamic_sampling
        if not spec.enabled:
            return rollout, {}
        n, wanted = pending.samples_per_prompt, len(pending.prompts)
        rounds = [rollout]
        keep = [informative_groups(rollout.reward, n, spec)]
        while sum(int(k.sum()) for k in keep) < wanted and len(rounds) <= spec.max_extra_rounds:
            batch = self._extra_batch(batches)
            if batch is None:
                break
            rounds.append(self._scored(self._start_rollout(*batch)))
            keep.append(informative_groups(rounds[-1].reward, n, spec))
        kept = [r.groups(k, n) for r, k in zip(rounds, keep)]
        dropped = [r.groups(~k, n) for r, k in zip(rounds, keep)]
        batch, refilled = fill_batch(kept, dropped, wanted, n)
        sampled, informative = torch.cat([r.reward.total for r in rounds]), torch.cat(keep)
        return batch, {
            "dynamic_sampling/dropped_groups": float((~informative).sum()),
            "dynamic_sampling/kept_fraction": informative.float().mean().item(),  # of every round's groups
            "dynamic_sampling/extra_rounds": float(len(rounds) - 1),
            "dynamic_sampling/refilled_groups": float(refilled),
            "dynamic_sampling/sampled_reward_mean": sampled.mean().item(),
        }

    @property
    def _hybrid(self) -> bool:
        """Engines on the models' GPUs (colocation all): vLLM sleeps while they score and train. vLLM's sleep
        needs CUDA; on CPU the engines stay up, and the order below is what the tests check."""
        return self.placement.use_gpu and self.placement.engines_colocated

    def _engines_sleep(self, level: int) -> None:
        if self._hybrid:
            ray.get([engine.sleep.remote(level) for engine in self.engines])

    def _engines_wake(self, tags: list[str] | None) -> None:
        if self._hybrid:
            ray.get([engine.wake_up.remote(tags) for engine in self.engines])

    def _wake_and_sync(self, version: int) -> None:
        """The actor's new weights to the engines. The hybrid engine wakes in the memory plan's order: the
        models' cached blocks handed back, vLLM's weights allocated and synced, then its KV cache (woken
        first, the cache would claim its share of a GPU still holding the passes' blocks)."""
        self._release_and_wake(["weights"])
        self._sync_weights(version)
        self._engines_wake(["kv_cache"])

    def _release_and_wake(self, tags: list[str] | None) -> None:
        """The hybrid engine wakes (`tags`: what of it) once every model has handed its cached blocks back."""
        if self._hybrid:
            ray.get([ref for group in self.groups.values() for ref in group.call("release_memory")])
            self._engines_wake(tags)

    @property
    def changed_frozen_groups(self) -> dict[str, ModelGroup]:
        """The reference, when training.referenceRefresh moves it."""
        return {"reference": self.groups["reference"]} if self.training.reference_refresh.interval_steps else {}

    def _refresh_reference(self) -> None:
        """training.referenceRefresh (TR-DPO): the reference to alpha * policy + (1 - alpha) * reference, the
        policy's weights gathered on the actor's rank 0 and handed to every reference rank by Ray's object store."""
        policy = self.actor.call("full_weights")  # rank 0's is the state dict; the other ranks' None
        alpha = self.training.reference_refresh.mixup_alpha
        ray.get(self.groups["reference"].call("blend_weights", policy[0], alpha) + policy[1:])

    # -- 2-5. experience -------------------------------------------------------------------------

    def _make_experience(self, rollout: Rollout) -> tuple[Experience, dict[str, float]]:
        """The advantage-carrying Experience of one scored rollout, and its metrics."""
        n = self.rollout.samples_per_prompt
        prompts, samples, reward = rollout.prompts, rollout.samples, rollout.reward
        sequences, attention_mask, action_mask = self._pack(prompts, samples)
        vision = batch_inputs([p.vision for p in prompts])

        scored = self._log_probs_and_values(sequences, attention_mask, action_mask, vision)
        kl, kl_penalty = self._kl(scored.actor, scored.reference, action_mask)
        advantages, returns = self._advantages(reward.total, action_mask, kl_penalty, scored)
        experience = Experience(
            sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
            action_log_probs=scored.actor, base_action_log_probs=scored.reference, values=scored.values, kl=kl,
            rollout_log_probs=self._pad([c.log_probs for c in samples], action_mask.shape[1], 0.0, torch.float32),
            advantages=advantages, returns=returns, rewards=reward.total, response_length=action_mask.sum(-1),
            group_ids=torch.arange(len(samples) // n).repeat_interleave(n),
            **dict(zip(("teacher_logps", "teacher_ids"), scored.teacher_top or ())), **(vision or {}),
        )
        metrics = self._rollout_metrics(experience, rollout)
        if scored.teacher is not None:  # the per-token reverse KL to the teacher (k1), distill's loss
            metrics["teacher_kl"] = masked_mean(scored.actor - scored.teacher, action_mask).item()
        return experience, metrics

    def _score_rewards(self, prompts: list[PromptItem], samples: list[Completion]) -> RewardResult:
        """2. every spec.reward source's score of each completion (a whole episode's transcript), the
        environment's episode reward, the length penalties, and their weighted total."""
        texts = self.tokenizer.batch_decode([c.token_ids for c in samples], skip_special_tokens=True)
        if self.reward:
            result = self.reward.score([p.prompt for p in prompts], texts, [p.label for p in prompts],
                                       [list(p.images) for p in prompts] if any(p.images for p in prompts) else None)
        else:
            result = RewardResult(torch.zeros(len(samples)), {}, torch.zeros(len(samples)))
        return shape_rewards(result, samples, self.spec)

    def _log_probs_and_values(self, sequences: Tensor, attention_mask: Tensor, action_mask: Tensor,
                              vision: dict[str, Tensor] | None = None) -> Scored:
        """3. the actor's, the reference's (with a KL penalty) and the teacher's (distill) log-probs of the
        response tokens, and (ppo) the critic's values; each group working on the whole batch, all
        groups at once unless they share bundles (then one after another). vision: the rows' image inputs
        (the algorithms that take images have no critic or teacher)."""
        num_actions = action_mask.shape[1]
        roles = [role for role in ("actor", "reference", "teacher", "critic") if role in self.groups
                 and not (role == "actor" and self.actor_scored_in_update)]
        top_k = self.teacher_top_k

        def start(role: str) -> Callable[[], Any]:
            if role == "teacher" and top_k:
                return self.groups[role].start_top_log_probs(sequences, attention_mask, num_actions, top_k)
            return self.groups[role].start_forward(sequences, attention_mask, num_actions, vision)

        results = in_turns(self.placement, roles, start, lambda result: result())
        values = results["critic"] * action_mask if "critic" in results else None
        teacher = results.get("teacher")
        return Scored(results.get("actor"), results.get("reference"), None if top_k else teacher, values,
                      teacher_top=teacher if top_k else None)

    def _kl(self, log_probs: Tensor | None, base_log_probs: Tensor | None,
            action_mask: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """4. the per-token KL to the reference (none without one, or without the actor's log-probs: the
        update reports it then), and its penalty when training.kl places it in the reward (in the loss,
        the actor's policy step adds it)."""
        if base_log_probs is None or log_probs is None:
            return None, None
        kl_spec = self.training.kl
        kl = compute_kl(log_probs, base_log_probs, action_mask, kl_spec.estimator)
        penalty = kl_in_reward(kl, kl_spec.coef, action_mask) if kl_spec.placement == "reward" else None
        return kl, penalty

    def _advantages(self, rewards: Tensor, action_mask: Tensor, kl_penalty: Tensor | None,
                    scored: Scored) -> tuple[Tensor, Tensor]:
        """5. advantages and returns from the estimator the catalogue names for spec.algorithm."""
        training = self.training
        return compute_advantages(
            self.algorithm.advantage,
            AdvantageInputs(rewards, action_mask, kl_penalty=kl_penalty, values=scored.values,
                            n_samples_per_prompt=self.rollout.samples_per_prompt,
                            log_ratio=scored.log_ratio(scored.reference),
                            teacher_log_ratio=scored.log_ratio(scored.teacher)),
            AdvantageConfig(gamma=training.gamma, lambd=training.gae_lambda,
                            keep_per_prompt=training.rejection_sampling.keep_per_prompt,
                            min_reward=training.rejection_sampling.min_reward,
                            beta=training.preference.beta,
                            teacher_coef=0.0 if self.teacher_top_k else training.distillation.kl_coef,
                            reward_coef=training.distillation.reward_coef),
        )

    def _rollout_metrics(self, experience: Experience, rollout: Rollout) -> dict[str, float]:
        reward, samples = rollout.reward, rollout.samples
        action_mask, response_length = experience.action_mask, experience.response_length
        metrics = {
            "reward_mean": reward.total.mean().item(),
            "reward_std": reward.total.std().item() if len(samples) > 1 else 0.0,
            **{f"reward/{name}": scores.mean().item() for name, scores in reward.by_source.items()},
            "response_length": response_length.float().mean().item(),
            "truncated_fraction": sum(c.truncated for c in samples) / len(samples),
            "turns": sum(c.turns for c in samples) / len(samples),
            "tokens_per_second": rollout.tokens / rollout.seconds,  # sampled, dropped groups' too
            "advantage_mean": masked_mean(experience.advantages, action_mask).item(),
            # The share of samples with a nonzero advantage on some token: raft's kept samples
            # (the rest have no gradient), a group estimator's samples in groups whose rewards differ.
            "trained_fraction": (experience.advantages != 0).any(dim=1).float().mean().item(),
        }
        if experience.action_log_probs is not None:  # else the update reports it (objectives.policy_step)
            # vLLM's and the actor's log-probs of the same tokens: numerical noise while the weight
            # sync works, growing with every update the engines miss when it does not.
            metrics["logprob_diff"] = masked_mean(
                (experience.rollout_log_probs - experience.action_log_probs).abs(), action_mask).item()
        if experience.kl is not None:
            metrics["kl"] = masked_mean(experience.kl, action_mask).item()
        return metrics

    def _pack(self, prompts: list[PromptItem], samples: list[Completion]):
        """sequences [B, P + T]: prompts left-padded to P, responses right-padded to T; their masks."""
        pad = self.pad_token_id
        width = max(len(p.prompt_token_ids) for p in prompts)
        num_actions = max(1, max(len(c.token_ids) for c in samples))
        prompt_ids = torch.stack([
            torch.nn.functional.pad(torch.tensor(p.prompt_token_ids), (width - len(p.prompt_token_ids), 0), value=pad)
            for p in prompts
        ])
        prompt_mask = torch.stack([torch.arange(width) >= width - len(p.prompt_token_ids) for p in prompts])
        response_ids = self._pad([c.token_ids for c in samples], num_actions, pad, torch.long)
        response_mask = self._pad([[True] * len(c.token_ids) for c in samples], num_actions, False, torch.bool)
        # Observation tokens of multi-turn episodes are context (attention) but not actions (loss).
        action_mask = self._pad([c.trained for c in samples], num_actions, False, torch.bool)
        sequences = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
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
        groups = self.trained_groups
        metrics = in_turns(self.placement, list(groups),
                           lambda role: groups[role].train(experience, generator=generator, **options),
                           mean_metrics)
        return {key: value for role_metrics in metrics.values() for key, value in role_metrics.items()}

    # -- evaluation --------------------------------------------------------------------------------

    def _log_evaluation(self, step: int) -> None:
        """An evaluation reported on its own (not with a step's metrics), with its time."""
        with self.timer.phase("evaluation", split=False):
            metrics = self._evaluate(step)
        self.reporter.log(step, metrics | self.timer.take())

    def _evaluate(self, step: int) -> dict[str, float]:
        """Every evaluation set sampled and scored with the current weights; the best actor kept."""
        sampling = self.evaluation.sampling(self.rollout)
        metrics = {}
        for name, dataset in self.evaluation.sets.items():
            rollout = self._scored(self._start_rollout(dataset.items, {}, sampling))
            metrics.update(self.evaluation.metrics(name, rollout.reward))
        value = self.evaluation.best_value(metrics)
        if value is not None and self.evaluation.better(value, self.best and self.best["value"]):
            self.best = {"step": step, "metric": self.spec.evaluation.best_metric, "value": value}
            checkpoint.save_best(self.checkpoint_dir, self.actor, self.best)
        if self.best:
            metrics.update({f"{EVAL}best/step": float(self.best["step"]), f"{EVAL}best/value": self.best["value"]})
        return metrics

    # -- 7. weight sync ---------------------------------------------------------------------------

    def _sync_weights(self, version: int) -> None:
        """The actor's weights after `version` steps to the engines."""
        partial = self.spec.rollout.partial
        if self.runner and not partial:
            # The runner sends an episode's turns to the engines one by one: idle engines may be between
            # two turns of a queued episode (asyncQueueSize), which must not straddle the update. Its
            # episodes queued before this sync finish first, as an engine's queued rollouts do.
            ray.get(self.runner.ready.remote())
        sync_weights(self.weight_sync, dtype=self.spec.engine_dtype, version=version, partial=partial)

    def _resume(self) -> bool:
        """RunLoop's resume, then the checkpoint's actor weights to the engines (they load the initial ones)."""
        resumed = super()._resume()
        if resumed:
            self._sync_weights(self.step)
        return resumed
