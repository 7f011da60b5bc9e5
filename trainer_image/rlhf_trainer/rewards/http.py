"""Reward sources of type http: a remote scorer, called in batches.

Request:  POST url  {"prompts": [...], "completions": [...], "labels": [...]}
Answer:   {"rewards": [one number per completion]}

Connection errors, timeouts and 5xx answers are retried with exponential backoff; 4xx answers
are not (the request itself is wrong). A bearer token is read from contract.reward_token_env(<name>),
the variable the operator fills from http.authSecretRef.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from rlhf_api import contract
from rlhf_api.v1alpha1 import RewardSource

if TYPE_CHECKING:
    from . import SourceContext


class HTTPScorer:
    def __init__(
        self, url: str, *, batch_size: int = 64, timeout: float = 30, retries: int = 3,
        token: str | None = None, backoff_seconds: float = 1.0,
    ):
        self.url, self.batch_size, self.timeout, self.retries = url, batch_size, timeout, retries
        self.backoff_seconds = backoff_seconds  # wait before retry k (0-based) is backoff_seconds * 2**k
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def __call__(self, prompts: list[str], completions: list[str], labels: list[Any]) -> list[float]:
        rewards = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            answer = self.post({"prompts": prompts[start:end], "completions": completions[start:end], "labels": labels[start:end]})
            batch = answer.get("rewards") if isinstance(answer, dict) else None
            expected = len(prompts[start:end])
            if not isinstance(batch, list) or len(batch) != expected:
                raise ValueError(f"{self.url} answered {str(answer)[:200]!r}; expected {{\"rewards\": [{expected} numbers]}}")
            rewards.extend(batch)
        return rewards

    def post(self, payload: dict[str, Any]) -> Any:
        """POST payload as JSON and parse the JSON answer, retrying transient failures."""
        request = urllib.request.Request(self.url, data=json.dumps(payload).encode(), headers=self.headers, method="POST")
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_seconds * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.load(response)
            except urllib.error.HTTPError as error:  # an answer with a status code
                if error.code < 500:
                    body = error.read(300).decode(errors="replace")
                    raise RuntimeError(f"POST {self.url}: HTTP {error.code} {error.reason}: {body}") from error
                failure = error
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:  # no answer
                failure = error
        raise RuntimeError(f"POST {self.url} failed {self.retries + 1} times (timeout {self.timeout}s); last error: {failure}") from failure


def http_source(source: RewardSource, context: SourceContext) -> HTTPScorer:
    spec = source.http
    return HTTPScorer(
        spec.url, batch_size=spec.batch_size, timeout=spec.timeout_seconds, retries=spec.retries,
        token=os.environ.get(contract.reward_token_env(source.name)),
    )
