"""Reward sources of type http: a remote scorer, called in batches.

Request:  POST url  {"prompts": [...], "completions": [...], "labels": [...]}
Answer:   {"rewards": [one number per completion]}

Retried as jsonpost.post_json retries (no answer in time, 408, 429, 5xx), and also an answer with
malformed JSON or the wrong number of rewards; once the retries are used up the error says what
the last answer was. Other 4xx answers are not retried (the request itself is wrong). A bearer token
is read from contract.reward_token_env(<name>), the variable the operator fills from http.authSecretRef.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from rlhf_api import contract
from rlhf_api.v1alpha1 import RewardSource

from ..backoff import Backoff
from ..jsonpost import SHOWN, Retry, post_json

if TYPE_CHECKING:
    from . import SourceContext

class HTTPScorer:
    def __init__(
        self, url: str, *, batch_size: int = 64, timeout: float = 30, retries: int = 3,
        token: str | None = None, backoff: Backoff = Backoff(base=1.0, cap=60.0),
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.url, self.batch_size, self.timeout, self.retries = url, batch_size, timeout, retries
        self.backoff, self.sleep = backoff, sleep
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def __call__(self, prompts: list[str], completions: list[str], labels: list[Any],
                 images: list[list[str]] | None = None) -> list[float]:
        """images: each prompt's image references (a vision-language job's), sent as the payload's "images"."""
        rewards = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            rewards += self.post({"prompts": prompts[start:end], "completions": completions[start:end],
                                  "labels": labels[start:end], **({"images": images[start:end]} if images else {})})
        return rewards

    def post(self, payload: dict[str, Any]) -> list:
        """POST one batch and return its rewards, retrying transient failures and wrong answers."""
        expected = len(payload["prompts"])
        return post_json(self.url, payload, timeout=self.timeout, retries=self.retries, backoff=self.backoff,
                         read=lambda status, text: _rewards(status, text, expected), headers=self.headers,
                         sleep=self.sleep)


def _rewards(status: int, text: str, expected: int) -> list:
    try:
        answer = json.loads(text)
    except ValueError:
        raise Retry(f"HTTP {status} with malformed JSON: {text[:SHOWN]!r}") from None
    rewards = answer.get("rewards") if isinstance(answer, dict) else None
    if not isinstance(rewards, list) or len(rewards) != expected:
        raise Retry(f"HTTP {status} {text[:SHOWN]!r}, expected {{\"rewards\": [{expected} numbers]}}")
    return rewards


def http_source(source: RewardSource, context: SourceContext) -> HTTPScorer:
    spec = source.http
    return HTTPScorer(
        spec.url, batch_size=spec.batch_size, timeout=spec.timeout_seconds, retries=spec.retries,
        token=os.environ.get(contract.reward_token_env(source.name)),
    )
