"""Environments of type http: one JSON POST per reset and per step, naming the episode (see
rlhf_api EnvironmentHTTP for the protocol). Connection errors, timeouts and 408/429/5xx answers are
retried with backoff.Backoff's waits (the server's Retry-After when it sends one); other 4xx answers
are not (the request itself is wrong)."""

from __future__ import annotations

import http.client
import itertools
import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Callable

from ..backoff import Backoff, retry_after

RETRYABLE = lambda status: status in (408, 429) or status >= 500  # noqa: E731 - timed out, rate limited, server fault


class JSONClient:
    def __init__(self, url: str, *, timeout: float, retries: int, backoff: Backoff = Backoff(base=1.0, cap=60.0)):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def post(self, payload: dict[str, Any]) -> Any:
        """POST payload as JSON and return the parsed answer, retrying transient failures."""
        request = urllib.request.Request(self.url, data=json.dumps(payload).encode(), method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        for attempt in range(self.retries + 1):
            wait = None
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.load(response)
            except urllib.error.HTTPError as error:  # an answer with an error status
                failure = f"HTTP {error.code} {error.reason}: {error.read(200).decode(errors='replace')}"
                if not RETRYABLE(error.code):
                    raise RuntimeError(f"POST {self.url}: {failure}") from None
                wait = retry_after(error.headers.get("Retry-After"))
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as error:
                failure = f"no answer: {getattr(error, 'reason', error)}"
            if attempt < self.retries:
                time.sleep(self.backoff.delay(attempt, wait))
        raise RuntimeError(f"POST {self.url} failed {self.retries + 1} times (timeout {self.timeout}s); "
                           f"last error: {failure}")


class HTTPEnvironment:
    """One episode of an environment service: every call names the episode."""

    def __init__(self, client: JSONClient, episode: str):
        self.client, self.episode = client, episode

    def reset(self, prompt: str, label: Any) -> str | None:
        answer = self.client.post({"action": "reset", "episode": self.episode, "prompt": prompt, "label": label})
        return answer.get("observation") if isinstance(answer, dict) else None

    def step(self, completion: str) -> tuple[str, float, bool]:
        answer = self.client.post({"action": "step", "episode": self.episode, "completion": completion})
        if not isinstance(answer, dict) or not {"observation", "reward", "done"} <= answer.keys():
            raise ValueError(f"{self.client.url} answered {str(answer)[:200]!r} to a step; expected "
                             '{"observation": text, "reward": number, "done": true/false}')
        return answer["observation"], answer["reward"], answer["done"]


def http_factory(url: str, timeout: float, retries: int) -> Callable[[], HTTPEnvironment]:
    """New episodes of the service, with ids unique to this run."""
    client = JSONClient(url, timeout=timeout, retries=retries)
    run, counter = uuid.uuid4().hex[:12], itertools.count()
    return lambda: HTTPEnvironment(client, f"{run}-{next(counter)}")
