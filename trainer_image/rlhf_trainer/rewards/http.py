"""Reward sources of type http: a remote scorer, called in batches.

Request:  POST url  {"prompts": [...], "completions": [...], "labels": [...]}
Answer:   {"rewards": [one number per completion]}

An attempt that gets no answer in time, an answer with status 408, 429 or 5xx, malformed JSON or
the wrong number of rewards is retried, waiting as backoff.Backoff says (the server's Retry-After
when it sends one, else exponential with jitter); once the retries are used up the error says what
the last answer was. Other 4xx answers are not retried (the request itself is wrong). A bearer token
is read from contract.reward_token_env(<name>), the variable the operator fills from http.authSecretRef.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any, Callable

from rlhf_api import contract
from rlhf_api.v1alpha1 import RewardSource

from ..backoff import Backoff, retry_after

if TYPE_CHECKING:
    from . import SourceContext

SHOWN = 200  # characters of an answer quoted in an error


def _retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500  # timed out, rate limited, or the server's own fault


class Retry(Exception):
    """An attempt worth repeating; `wait`: the server's Retry-After in seconds, if it sent one."""

    def __init__(self, what: str, wait: float | None = None):
        super().__init__(what)
        self.wait = wait


class HTTPScorer:
    def __init__(
        self, url: str, *, batch_size: int = 64, timeout: float = 30, retries: int = 3,
        token: str | None = None, backoff: Backoff = Backoff(base=1.0, cap=60.0),
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.url, self.batch_size, self.timeout, self.retries = url, batch_size, timeout, retries
        self.backoff, self.sleep = backoff, sleep
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def __call__(self, prompts: list[str], completions: list[str], labels: list[Any]) -> list[float]:
        rewards = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            rewards += self.post({"prompts": prompts[start:end], "completions": completions[start:end],
                                  "labels": labels[start:end]})
        return rewards

    def post(self, payload: dict[str, Any]) -> list:
        """POST one batch and return its rewards, retrying transient failures."""
        body = json.dumps(payload).encode()
        for attempt in range(self.retries + 1):
            try:
                return self._attempt(body, len(payload["prompts"]))
            except Retry as failure:
                last = failure
                if attempt < self.retries:
                    self.sleep(self.backoff.delay(attempt, failure.wait))
        raise RuntimeError(f"POST {self.url} failed {self.retries + 1} times (timeout {self.timeout}s); "
                           f"last error: {last}") from None

    def _attempt(self, body: bytes, expected: int) -> list:
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                status, text = response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as error:  # an answer with an error status
            shown = error.read(SHOWN).decode(errors="replace")
            what = f"HTTP {error.code} {error.reason}: {shown}"
            if _retryable(error.code):
                raise Retry(what, retry_after(error.headers.get("Retry-After"))) from None
            raise RuntimeError(f"POST {self.url}: {what}") from None
        except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as error:  # no (whole) answer
            raise Retry(f"no answer: {getattr(error, 'reason', error)}") from None
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
