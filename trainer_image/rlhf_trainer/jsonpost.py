"""POST JSON to a service and read its answer, retrying what may pass on a second try: no answer in
time, a 408, 429 or 5xx status, or an answer `read` refuses by raising Retry. Each retry waits as
backoff.Backoff says (the server's Retry-After when it sends one, else exponential with jitter);
once the retries are used up the error quotes the last failure. Other 4xx answers fail at once (the
request itself is wrong), and so do redirects: they are not followed, since urllib would re-send the
request, Authorization header included, to whatever host the answer names (https to http included).
Errors show the URL without its credentials (redact.url). The HTTP reward sources and environments
both call services this way."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any, Callable, TypeVar

from . import redact
from .backoff import Backoff, retry_after

SHOWN = 200  # characters of an answer quoted in an error
T = TypeVar("T")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any) -> None:
        return None  # urlopen raises the 3xx answer as an HTTPError


_OPENER = urllib.request.build_opener(_NoRedirects)


def _retryable(status: int) -> bool:
    return status in (408, 429) or status >= 500  # timed out, rate limited, or the server's own fault


class Retry(Exception):
    """An attempt worth repeating; `wait`: the server's Retry-After in seconds, if it sent one."""

    def __init__(self, what: str, wait: float | None = None):
        super().__init__(what)
        self.wait = wait


def post_json(url: str, payload: dict[str, Any], *, timeout: float, retries: int, backoff: Backoff,
              read: Callable[[int, str], T] = lambda status, text: json.loads(text),
              headers: dict[str, str] | None = None, sleep: Callable[[float], None] = time.sleep) -> T:
    """read(status, text) of the first answer that passes, the text being the answer's body."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json",
                                              **(headers or {})})
    for attempt in range(retries + 1):
        try:
            return read(*_answer(url, request, timeout))
        except Retry as failure:
            last = failure
            if attempt < retries:
                sleep(backoff.delay(attempt, failure.wait))
    raise RuntimeError(f"POST {redact.url(url)} failed {retries + 1} times (timeout {timeout}s); last error: {last}") from None


def _answer(url: str, request: urllib.request.Request, timeout: float) -> tuple[int, str]:
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:  # an answer with an error status
        what = f"HTTP {error.code} {error.reason}: {error.read(SHOWN).decode(errors='replace')}"
        if _retryable(error.code):
            raise Retry(what, retry_after(error.headers.get("Retry-After"))) from None
        if 300 <= error.code < 400:
            raise RuntimeError(f"POST {redact.url(url)}: HTTP {error.code} redirect to "
                               f"{redact.url(error.headers.get('Location', '?'))}, not followed (it would take the "
                               "credentials along): set the url to the service's final address") from None
        raise RuntimeError(f"POST {redact.url(url)}: {what}") from None
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as error:  # no (whole) answer
        raise Retry(f"no answer: {getattr(error, 'reason', error)}") from None
