"""Environments of multi-turn rollouts (spec.environment): one object per episode with

    reset(prompt, label) -> None, or a first observation (text)
    reset(prompt, label, images=None): also gets the prompt's image references (data.PromptItem.images:
        paths, URLs or base64 data URIs; never the pixels) when it takes an `images` keyword, as rewards do
    step(completion) -> (observation: str, reward: float, done: bool)

`completion` is the text of the policy's last turn; the observation is tokenized and appended to the
episode as context the policy does not train on (runner.EpisodeRunner). Environment types are a
registry (ENVIRONMENTS): a builder turns the spec into a factory of per-episode objects.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Any, Callable, Protocol

from rlhf_api.contract import ENVIRONMENT_CODE_DIR
from rlhf_api.v1alpha1 import EnvironmentSpec

from .. import redact
from ..rewards.function import load_entrypoint  # loaded as function rewards are
from .http import HTTPEnvironment, http_factory


class Environment(Protocol):
    def reset(self, prompt: str, label: Any) -> str | None: ...  # optionally images=None (see above)

    def step(self, completion: str) -> tuple[str, float, bool]: ...


class EnvironmentFailure(RuntimeError):
    """An environment misbehaved; the message says which and how."""


def _class_factory(spec: EnvironmentSpec, base_dir: Path) -> Callable[[], Environment]:
    """The class named by function.entrypoint: a module of the image, or a file loaded as a function
    reward's is (rewards.function)."""
    entrypoint, config_map = spec.function.entrypoint, spec.function.config_map
    root = Path(ENVIRONMENT_CODE_DIR) if config_map else Path(base_dir)
    _, cls = load_entrypoint(entrypoint, root, config_map, "rlhf_environment")
    missing = [method for method in ("reset", "step") if not callable(getattr(cls, method, None))]
    if not isinstance(cls, type) or missing:
        raise TypeError(f"environment {entrypoint} must be a class with reset(prompt, label) and "
                        f"step(completion) methods{'; it lacks ' + ', '.join(missing) if missing else ''}")
    return cls


def _http_factory(spec: EnvironmentSpec, base_dir: Path) -> Callable[[], Environment]:
    return http_factory(spec.http.url, spec.http.timeout_seconds, spec.http.retries)


ENVIRONMENTS: dict[str, Callable[[EnvironmentSpec, Path], Callable[[], Environment]]] = {
    "function": _class_factory,
    "http": _http_factory,
}


def environment_factory(spec: EnvironmentSpec, base_dir: Path) -> Callable[[], Environment]:
    """A callable returning a fresh environment per episode."""
    return ENVIRONMENTS[spec.type](spec, base_dir)


def describe(spec: EnvironmentSpec) -> str:
    return f"environment {spec.function.entrypoint if spec.function else redact.url(spec.http.url)}"


def checked_step(result: Any, spec: EnvironmentSpec) -> tuple[str, float, bool]:
    """An environment's step result, or an error saying what step must return."""
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise EnvironmentFailure(f"{describe(spec)}: step returned {result!r}; return (observation: str, reward: "
                                "float, done: bool)")
    observation, reward, done = result
    if not isinstance(observation, str) or not isinstance(reward, numbers.Real) or not isinstance(done, bool):
        raise EnvironmentFailure(f"{describe(spec)}: step returned ({type(observation).__name__}, "
                                f"{type(reward).__name__}, {type(done).__name__}); return (str, float, bool)")
    return observation, float(reward), done


__all__ = ["ENVIRONMENTS", "Environment", "EnvironmentFailure", "HTTPEnvironment", "checked_step", "describe",
           "environment_factory"]
