"""Multi-turn rollouts, token in, token out (a Ray actor next to the trainer driver).

Each turn, the live episodes' token ids (prompt, then every turn and observation so far, never
re-tokenized) go to the vLLM engines, each with the token budget it has left; the environment steps
on the decoded turn and its observation's tokens are appended. The episode is returned as one
Completion whose policy_mask is False on observation tokens (context the loss does not see) and
whose log-probs are the engine's for the policy's tokens.

A prompt's images (a vision-language job's) go with every turn's request, as its expanded image tokens
stay at the head of the episode's tokens; an environment whose reset takes `images` gets their references.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from rlhf_api.v1alpha1 import EnvironmentSpec

from ..data import PromptItem
from ..rewards import takes_images
from ..workers.rollout import Completion
from . import Environment, EnvironmentFailure, checked_step, describe, environment_factory


@dataclass
class Episode:
    prompt: PromptItem
    env: Environment
    budget: int  # rollout.maxNewTokens: the episode's tokens, policy's and observations', at most
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # of the policy's tokens, see Completion.versions
    reward: float = 0.0
    turns: int = 0
    truncated: bool = False
    done: bool = False

    @property
    def left(self) -> int:
        return self.budget - len(self.token_ids)

    def observe(self, token_ids: list[int]) -> None:
        """Append an observation; with no room left for a turn after it, the episode ends without it, cut
        by the budget (truncated, as a turn stopped by its token limit is)."""
        if len(token_ids) >= self.left:
            self.done = self.truncated = True
            return
        self.token_ids += token_ids
        self.log_probs += [0.0] * len(token_ids)
        self.policy_mask += [False] * len(token_ids)

    def act(self, turn: Completion) -> None:
        self.token_ids += turn.token_ids
        self.log_probs += turn.log_probs
        self.policy_mask += [True] * len(turn.token_ids)
        self.versions += turn.versions or []
        self.turns += 1
        self.truncated = turn.truncated

    def completion(self) -> Completion:
        return Completion(self.token_ids, self.log_probs, self.truncated, self.policy_mask, self.reward, self.turns,
                          self.versions or None)


class EpisodeRunner:
    def __init__(self, spec: EnvironmentSpec, base_dir: str, tokenizer_path: str, engines: list, max_new_tokens: int,
                 revision: str | None = None):
        from transformers import AutoTokenizer

        self.spec, self.engines, self.max_new_tokens = spec, engines, max_new_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, revision=revision)
        self.new_environment = environment_factory(spec, Path(base_dir))

    def run(self, prompts: list[PromptItem], sampling: dict) -> tuple[list[list[Completion]], float]:
        """sampling["n"] episodes per prompt, as an engine's generate returns completions; and the seconds."""
        started = time.perf_counter()
        n = sampling["n"]
        episodes = [Episode(p, self.new_environment(), self.max_new_tokens) for p in prompts for _ in range(n)]
        for episode in episodes:
            images = list(episode.prompt.images)
            shown = {"images": images} if images and takes_images(episode.env.reset) else {}
            first = self._call(episode.env.reset, episode.prompt.prompt, episode.prompt.label, **shown)
            if first:
                episode.observe(self._tokens(first))
        for turn in range(self.spec.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            per_turn = self.spec.max_tokens_per_turn or self.max_new_tokens
            requests = [dict(sampling, n=1, max_tokens=min(e.left, per_turn)) for e in live]
            outputs = self._generate([e.prompt.prompt_token_ids + e.token_ids for e in live], requests,
                                     [e.prompt.images for e in live])
            for episode, output in zip(live, outputs):
                episode.act(output)
                text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
                observation, reward, done = checked_step(self._call(episode.env.step, text), self.spec)
                episode.reward += reward
                episode.done = done or turn == self.spec.max_turns - 1 or episode.left <= 0
                if not episode.done:
                    episode.observe(self._tokens(observation))
        completions = [e.completion() for e in episodes]
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))], time.perf_counter() - started

    def ready(self) -> None:
        """Nothing: an actor runs its calls in order, so this returns once the episodes queued before it are done."""

    def _tokens(self, text: str) -> list[int]:
        # Special tokens written in the text (a chat template's turn markers) are encoded as such.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _call(self, method, *args, **keywords):
        try:
            return method(*args, **keywords)
        except Exception as error:
            raise EnvironmentFailure(f"{describe(self.spec)}: {method.__name__} failed: {error}") from error

    def _generate(self, prompt_token_ids: list[list[int]], sampling: list[dict],
                  images: list[tuple[str, ...]]) -> list[Completion]:
        """One completion per request, the requests split over the engines; images: each request's prompt's."""
        per_engine = -(-len(prompt_token_ids) // len(self.engines))
        chunks = [slice(i * per_engine, (i + 1) * per_engine) for i in range(len(self.engines))]
        results = ray.get([engine.generate.remote(prompt_token_ids[c], sampling[c],
                                                  **({"images": images[c]} if any(images[c]) else {}))
                           for engine, c in zip(self.engines, chunks) if prompt_token_ids[c]])
        return [per_prompt[0] for completions, _ in results for per_prompt in completions]


def start_runner(spec: EnvironmentSpec, base_dir: Path, tokenizer_path: str, engines: list, max_new_tokens: int,
                 revision: str | None = None):
    """The runner as a Ray actor on this (the driver's) node, where the job's files are; it takes no CPU
    of the placement (it waits on the engines)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(EpisodeRunner).options(num_cpus=0, scheduling_strategy=node).remote(
        spec, str(base_dir), tokenizer_path, engines, max_new_tokens, revision)
