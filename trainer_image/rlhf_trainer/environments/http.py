"""Environments of type http: one JSON POST per reset and per step, naming the episode (see
rlhf_api EnvironmentHTTP for the protocol), retried as jsonpost.post_json retries: connection errors,
timeouts and 408/429/5xx answers; other 4xx answers are not (the request itself is wrong).

A step is not idempotent, and a timed-out one may have been applied: each step names its turn too,
the same in every retry of it, so that the service can answer a repeat with its first answer
instead of playing the turn twice."""

from __future__ import annotations

import itertools
import uuid
from typing import Any, Callable

from .. import redact
from ..backoff import Backoff
from ..jsonpost import post_json


class JSONClient:
    def __init__(self, url: str, *, timeout: float, retries: int, backoff: Backoff = Backoff(base=1.0, cap=60.0)):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def post(self, payload: dict[str, Any]) -> Any:
        """POST payload as JSON and return the parsed answer, retrying transient failures."""
        return post_json(self.url, payload, timeout=self.timeout, retries=self.retries, backoff=self.backoff)


class HTTPEnvironment:
    """One episode of an environment service: every call names the episode."""

    def __init__(self, client: JSONClient, episode: str):
        self.client, self.episode = client, episode
        self.turn = 0  # steps answered so far

    def reset(self, prompt: str, label: Any, images: list[str] | None = None) -> str | None:
        """images: the prompt's image references (a vision-language job's), sent as the payload's "images"."""
        answer = self.client.post({"action": "reset", "episode": self.episode, "prompt": prompt, "label": label,
                                   **({"images": images} if images else {})})
        return answer.get("observation") if isinstance(answer, dict) else None

    def step(self, completion: str) -> tuple[str, float, bool]:
        answer = self.client.post({"action": "step", "episode": self.episode, "turn": self.turn,
                                   "completion": completion})
        if not isinstance(answer, dict) or not {"observation", "reward", "done"} <= answer.keys():
            raise ValueError(f"{redact.url(self.client.url)} answered {str(answer)[:200]!r} to a step; expected "
                             '{"observation": text, "reward": number, "done": true/false}')
        self.turn += 1
        return answer["observation"], answer["reward"], answer["done"]


def http_factory(url: str, timeout: float, retries: int) -> Callable[[], HTTPEnvironment]:
    """New episodes of the service, with ids unique to this run."""
    client = JSONClient(url, timeout=timeout, retries=retries)
    run, counter = uuid.uuid4().hex[:12], itertools.count()
    return lambda: HTTPEnvironment(client, f"{run}-{next(counter)}")
