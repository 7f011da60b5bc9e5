"""spec.environment: a multi-turn environment the policy acts in (agent RL)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import APIModel, ObjectName, cel
from .reward import ENTRYPOINT_PATTERN


class EnvironmentClass(APIModel):
    """A Python class with `reset(prompt, label)` and `step(completion) -> (observation, reward, done)`; one instance per episode. A `reset` that takes an `images` keyword also gets the prompt's image references (paths or URLs, never pixels)."""

    entrypoint: str = Field(pattern=ENTRYPOINT_PATTERN, max_length=512)
    """module:Class importable in the image, or file.py:Class (relative to the ConfigMap or the job file's directory)."""
    config_map: ObjectName | None = None
    """Name of the ConfigMap whose keys are Python files; it is mounted and put on the import path (the operator waits for it as for a reward's)."""


class EnvironmentHTTP(APIModel):
    """An environment served over HTTP. POST url {"action": "reset", "episode", "prompt", "label"} (and "images", the prompt's image references, when it has images) answers anything (an optional "observation"); POST url {"action": "step", "episode", "turn", "completion"} answers {"observation", "reward", "done"}. episode is an id unique within the run; turn counts the episode's steps from 0. A step is retried after a timeout or a 5xx answer with the same episode and turn: answer a repeat with the first answer, without applying the turn again."""

    url: str = Field(pattern=r"^https?://", max_length=2048)
    """Endpoint URL, starting with http:// or https://."""
    timeout_seconds: float = Field(30, gt=0, le=3600)
    """Per-request timeout."""
    retries: int = Field(3, ge=0, le=20)
    """Retries on connection errors, timeouts and 408, 429 and 5xx answers, with exponential backoff (a step's retry repeats its turn)."""


class EnvironmentSpec(APIModel):
    """The environment of multi-turn rollouts, token in, token out: each turn vLLM generates the policy's tokens,
    the environment's step answers with an observation (text, tokenized and appended, masked out of the loss), a
    reward and whether the episode is done. An episode ends when done, after maxTurns turns, or when its tokens
    (policy and observations) fill rollout.maxNewTokens. Its reward, the sum of its step rewards times rewardWeight,
    is added to spec.reward's sources (which score the whole transcript) and feeds the algorithm's estimator
    unchanged."""

    model_config = cel(
        ("self.type != 'function' || has(self.function)", "an environment of type function needs function.entrypoint", ".function"),
        ("self.type != 'http' || has(self.http)", "an environment of type http needs http.url", ".http"),
        ("self.type == 'function' || !has(self.function)", "function is set but type is not function; set type: function or remove function"),
        ("self.type == 'http' || !has(self.http)", "http is set but type is not http; set type: http or remove http"),
    )

    type: Literal["function", "http"]
    """function: a Python class run by the trainer; http: a service."""
    function: EnvironmentClass | None = None
    """The class, for type function."""
    http: EnvironmentHTTP | None = None
    """The service, for type http."""
    max_turns: int = Field(4, ge=1, le=1000)
    """Policy turns per episode at most."""
    max_tokens_per_turn: int | None = Field(None, ge=1)
    """Tokens the policy may generate in one turn; unset: whatever is left of rollout.maxNewTokens."""
    reward_weight: float = Field(1.0, ge=0)
    """Weight of the episode reward in the total reward that trains (reported unweighted as reward/environment; dynamic sampling and evaluation take it unweighted)."""
