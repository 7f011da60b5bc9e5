"""spec.reward: weighted reward sources (a model, a Python function, an HTTP service)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import DNS_LABEL, APIModel, ObjectName, cel

# module:name importable in the image, or file.py:name (function rewards and environment classes).
ENTRYPOINT_PATTERN = r"^[A-Za-z0-9_./-]+(\.py)?:[A-Za-z_][A-Za-z0-9_]*$"
# What ends each step of a solution, for a process reward model's training data and its reward source alike.
DEFAULT_STEP_SEPARATOR = "\n"


class SecretKeyRef(APIModel):
    """A key of a Secret in the job's namespace; its value is never copied into the job."""

    name: ObjectName
    """Name of the Secret."""
    key: str = Field(max_length=253)
    """Key within the Secret."""


class FunctionReward(APIModel):
    """A Python function `fn(prompts, completions, labels) -> list[float]` (one score per completion)."""

    entrypoint: str = Field(pattern=ENTRYPOINT_PATTERN, max_length=512)
    """module:function importable in the image, or file.py:function (relative to the ConfigMap or the job file's directory)."""
    config_map: ObjectName | None = None
    """Name of the ConfigMap whose keys are Python files; it is mounted and put on the import path."""


class HTTPReward(APIModel):
    """A remote reward service: POST {"prompts", "completions", "labels"} -> {"rewards": [...]}, batched."""

    url: str = Field(pattern=r"^https?://", max_length=2048)
    """Endpoint URL, starting with http:// or https://."""
    batch_size: int = Field(64, ge=1, le=4096)
    """Completions per request."""
    timeout_seconds: float = Field(30, gt=0, le=3600)
    """Per-request timeout."""
    retries: int = Field(3, ge=0, le=20)
    """Retries of a batch that got no answer within timeoutSeconds, an HTTP 408, 429 or 5xx answer, malformed JSON or the wrong number of rewards. Each waits the server's Retry-After (at most 60 s), else a random time up to 1, 2, 4... s (exponential backoff with jitter, at most 60 s); then the run fails with the last answer. Other 4xx answers fail at once."""
    auth_secret_ref: SecretKeyRef | None = None
    """Bearer token for the Authorization header, read from a Secret at run time."""


class StepReward(APIModel):
    """How a process reward model (trained by algorithm prm) scores a completion: step by step."""

    separator: str = Field(DEFAULT_STEP_SEPARATOR, min_length=1, max_length=64)
    """What ends a step: the completion is split at it and each step scored at the separator after it, as the model was trained (its job's data.stepSeparator)."""
    aggregation: Literal["min", "last", "product"] = "min"
    """How the steps' scores (each the probability that the step is correct: the sigmoid of the model's score) make the completion's reward: min, its weakest step (Wang et al. 2024, Math-Shepherd); product, every step correct (Lightman et al. 2023); last, its final step's."""


class RewardSource(APIModel):
    """One source of reward. The total reward is the weighted sum over sources."""

    model_config = cel(
        ("self.type != 'function' || has(self.function)", "a reward source of type function needs function.entrypoint", ".function"),
        ("self.type != 'http' || has(self.http)", "a reward source of type http needs http.url", ".http"),
        ("self.type == 'function' || !has(self.function)", "function is set but type is not function; set type: function or remove function"),
        ("self.type == 'http' || !has(self.http)", "http is set but type is not http; set type: http or remove http"),
        ("self.type == 'model' || !has(self.steps)",
         "steps reads a process reward model (spec.models.reward): set type: model or remove steps", ".steps"),
    )

    name: str = Field(pattern=DNS_LABEL, max_length=63)
    """Name of the source; its mean reward is reported under this name."""
    type: Literal["model", "function", "http"]
    """model: spec.models.reward scores the completion; function: a Python function; http: a remote service."""
    weight: float = Field(1.0, gt=0)
    """Weight of this source in the total reward."""
    function: FunctionReward | None = None
    """The function, for type function."""
    http: HTTPReward | None = None
    """The endpoint, for type http."""
    steps: StepReward | None = None
    """For type model, when spec.models.reward is a process reward model (algorithm prm): score each step of the completion and aggregate; without it the model scores the whole completion at its last token."""


class RewardSpec(APIModel):
    """Where rewards come from in online RL."""

    model_config = cel(
        ("self.sources.all(s, self.sources.exists_one(t, t.name == s.name))", "reward source names must be unique", ".sources"),
    )

    sources: list[RewardSource] = Field(min_length=1, max_length=8)
    """Reward sources, summed with their weights."""
    clip: float | None = Field(None, gt=0)
    """Clip each total reward to [-clip, clip] before advantages are computed: the sources' weighted sum, the environment's reward and the length penalties together."""
